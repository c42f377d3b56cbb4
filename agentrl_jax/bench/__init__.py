"""User-runnable benchmarks. Each compares ours against a named baseline measured in the
same run and reports the ratio (see :mod:`agentrl_jax.bench.report`)."""
