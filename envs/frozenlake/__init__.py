"""FrozenLake in pure JAX (gymnax style), its maps, text interface and exact Q*."""
