"""One persistent XLA compilation cache for the whole test session.

The suite spends most of its time compiling tiny programs, and many tests (and the
subprocesses and notebook kernels they start, which inherit the environment) compile the same
ones: a program found in the cache is loaded instead of compiled again. This changes no
result (the loaded executable is the compiled one), and jax reports every load as a backend
compilation, so the compile-counting tests (tests/compile_counter.py) count the same. The cache
is a fresh temporary folder per session, removed at the end, unless ``AGENTRL_JAX_TEST_CACHE``
names one (to reuse it across local runs); ``AGENTRL_JAX_TEST_CACHE=off`` compiles everything
afresh.

The tests also compile with LLVM's ``-O1`` instead of XLA's default ``-O2`` (set through
``XLA_FLAGS``, which the child processes inherit; ``AGENTRL_JAX_TEST_LLVM_O2=1`` keeps the
default). Nearly all of a tiny program's compile time is LLVM optimising and generating its
kernels: ``-O1`` cuts a tiny Qwen3's gradient from ~6 s to ~4 s, and executes the programs the
tests run (benchmarks, rollouts, the learning runs) as fast as ``-O2`` does on this CPU
(``-O0`` would compile faster still but run them several times slower). Without fast math
(jax's default) LLVM may not reorder floating-point arithmetic at any level: a tiny Qwen3's
loss and gradients come out bit-identical at ``-O1`` and ``-O2``. Programs outside the tests
keep XLA's defaults.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

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

if os.environ.get("AGENTRL_JAX_TEST_LLVM_O2") != "1":
    _flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_backend_optimization_level" not in _flags:
        os.environ["XLA_FLAGS"] = f"{_flags} --xla_backend_optimization_level=1".strip()

import jax  # noqa: E402  (after the environment: jax reads it when first imported)

if _SETTING != "off":  # also when a plugin imported jax before this file
    jax.config.update("jax_compilation_cache_dir", _SETTING)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def pytest_unconfigure(config):
    if _OWNED is not None:
        shutil.rmtree(_OWNED, ignore_errors=True)


def pytest_addoption(parser):
    parser.addoption("--full-scale", action="store_true", default=False,
                     help="run the slow end-to-end tests at their full configuration (CI runs them reduced)")


@pytest.fixture(scope="session")
def full_scale(request) -> bool:
    """True under ``--full-scale``: slow end-to-end tests then run their acceptance-sized
    configuration instead of the reduced one CI runs (same code path, same assertions)."""
    return request.config.getoption("--full-scale")


def pytest_collection_modifyitems(config, items):
    """Files holding ``slow`` tests run first (otherwise in collection order): under
    README's ``-n 2 --dist loadfile`` the long files then start early instead of leaving one
    worker busy at the end while the other waits."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: files stay whole
