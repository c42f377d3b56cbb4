"""One persistent XLA compilation cache for the whole test session.

The suite spends most of its time compiling tiny programs, and many tests (and the
subprocesses and notebook kernels they start, which inherit the environment) compile the same
ones: a program found in the cache is loaded instead of compiled again. This changes no
result (the loaded executable is the compiled one), and jax reports every load as a backend
compilation, so the compile-counting tests (tests/compile_counter.py) count the same. The cache
is a fresh temporary folder per session, removed at the end, unless ``AGENTRL_JAX_TEST_CACHE``
names one (to reuse it across local runs); ``AGENTRL_JAX_TEST_CACHE=off`` compiles everything
afresh.
"""

from __future__ import annotations

import os
import shutil
import tempfile

_OWNED = None  # the cache folder this process made and removes at the end
_SETTING = os.environ.get("AGENTRL_JAX_TEST_CACHE", "")
if _SETTING != "off":
    if not _SETTING:  # the first process makes the folder
        _OWNED = _SETTING = tempfile.mkdtemp(prefix="agentrl-jax-xla-cache-")
        os.environ["AGENTRL_JAX_TEST_CACHE"] = _SETTING  # child processes inherit it
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _SETTING
    # Cache every program, however small or quick to compile: the tests compile thousands.
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

import jax  # noqa: E402  (after the environment: jax reads it when first imported)

if _SETTING != "off":  # also when a plugin imported jax before this file
    jax.config.update("jax_compilation_cache_dir", _SETTING)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def pytest_unconfigure(config):
    if _OWNED is not None:
        shutil.rmtree(_OWNED, ignore_errors=True)
