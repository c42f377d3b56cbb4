"""Start jax for XLA:GPU's compile-only devices when tests/gpu runs on its own.

XLA:GPU compiles for GPUs that are not there only in a process that opens no GPU driver:
``JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``
(:data:`~agentrl_jax.plan.targets.CUDA_COMPILE_ENV`). CI starts ``pytest tests/gpu`` so. Where
it was started otherwise and only tests/gpu is collected, this sets both before jax opens a
backend (tests/conftest.py imports jax but opens none). A session that also collects other
tests is left as it is (the rest of the suite may want the machine's GPU): there the checks
skip, naming the variables, or fail under ``AGENTRL_JAX_REQUIRE_XLA_GPU=1``.

Such a session also compiles without jax's persistent cache (tests/conftest.py's): jax writes
the compile-only executables there but cannot load them back ("PjRtCompiler must be constructed
with a Client to call DeserializeLoadedExecutable"), so a hit warns and compiles again.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
from jax._src import xla_bridge

from agentrl_jax.plan.targets import CUDA_COMPILE_ENV, cuda_plugin_version, in_cuda_compile_process

HERE = Path(__file__).resolve().parent


def _only_here(config) -> bool:
    """Whether every path the session was asked to run lies in tests/gpu."""
    root = Path(config.invocation_params.dir)
    paths = [(root / arg.split("::")[0]).resolve() for arg in config.args]
    return bool(paths) and all(p == HERE or HERE in p.parents for p in paths)


def pytest_configure(config):
    if cuda_plugin_version() is None or not _only_here(config):
        return
    jax.config.update("jax_enable_compilation_cache", False)
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)  # nor in agentrl-jax plan's process
    if in_cuda_compile_process():
        return
    if xla_bridge.backends_are_initialized():  # too late: the checks skip (or fail) with why
        return
    os.environ.update(CUDA_COMPILE_ENV)  # and child processes (agentrl-jax plan) inherit it
    jax.config.update("jax_platforms", CUDA_COMPILE_ENV["JAX_PLATFORMS"])
