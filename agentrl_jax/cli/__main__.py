"""``python -m agentrl_jax.cli``: the same as the ``agentrl-jax`` console script."""

from agentrl_jax.cli import main

main()
