"""One persistent XLA compilation cache for the whole test session.

The suite spends most of its time compiling tiny programs, and many tests (and the
subprocesses and notebook kernels they start, which inherit the environment) compile the same
ones: a program found in the cache is loaded instead of compiled again. This changes no
result (the loaded executable is the compiled one), and jax reports every load as a backend
compilation, so the compile-counting tests (tests/compile_counter.py) count the same. The cache
is a fresh temporary folder per session, removed at the end, unless ``AGENTRL_JAX_TEST_CACHE``
names one (to reuse it across local runs); ``AGENTRL_JAX_TEST_CACHE=off`` compiles everything
afresh.

The tests also compile with LLVM's ``-O0`` instead of XLA's default ``-O2`` (set through
``XLA_FLAGS``, which the child processes inherit; ``AGENTRL_JAX_TEST_LLVM_O2=1`` keeps XLA's
defaults everywhere). Nearly all of a tiny program's compile time is LLVM optimising and
generating its kernels: a tiny Qwen3's train step compiles in ~5 s at ``-O0``, ~8.5 s at
``-O1`` and ~14 s at ``-O2`` on this CPU, and most tests run what they compile once or
twice. ``-O0`` programs run about twice as slowly, so the tests that run theirs for long
(mark a module or test ``optimized``: the learning runs) compile at ``-O1`` instead, which
executes as fast as ``-O2``. Without fast math (jax's default) LLVM may not reorder
floating-point arithmetic: ``-O1`` gives a tiny Qwen3's loss and gradients bit for bit as
``-O2`` does, ``-O0`` to within float32 rounding (~1e-8 there);
every comparison the tests make is either against a reference with a tolerance or between
programs compiled alike. They also use XLA:CPU's older fusion emitters, which compile faster
(below). Programs outside the tests keep XLA's defaults.
"""

from __future__ import annotations

import contextlib
import inspect
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

_QUICK_COMPILE = os.environ.get("AGENTRL_JAX_TEST_LLVM_O2") != "1"
# XLA:CPU's older fusion emitters compile the suite's programs in about 60% of the time its
# newer (MLIR) emitters take, for the same numbers to float32 rounding (e.g. a tiny Qwen3's
# AdamW step within 2 ulp). An XLA that does not know the flag aborts, so the first process
# asks a child jax whether it starts with it; its children inherit the answer.
_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
_EMITTERS_OK = "AGENTRL_JAX_TEST_LEGACY_EMITTERS"


def _xla_accepts(flag: str) -> bool:
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip())
    probe = "import jax.numpy as jnp; jnp.zeros(1).block_until_ready()"
    try:
        done = subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


if _QUICK_COMPILE:
    _flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_backend_optimization_level" not in _flags:
        _flags = f"{_flags} --xla_backend_optimization_level=0".strip()
    if _EMITTERS_OK not in os.environ:
        os.environ[_EMITTERS_OK] = "1" if _xla_accepts(_EMITTERS) else "0"
    if os.environ[_EMITTERS_OK] == "1" and "fusion_emitters" not in _flags:
        _flags = f"{_flags} {_EMITTERS}"
    os.environ["XLA_FLAGS"] = _flags

import jax  # noqa: E402  (after the environment: jax reads it when first imported)

if _SETTING != "off":  # also when a plugin imported jax before this file
    jax.config.update("jax_compilation_cache_dir", _SETTING)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


# The LLVM level of ``optimized`` tests: an override of the compile options jax builds for every
# program (jax's private ``compiler.get_compile_options``; a jit's own ``compiler_options``
# still win). Persistent-cache keys include the options, so -O0 and -O1 programs stay apart.
# Where a jax version lacks that function or its ``env_options_overrides`` argument, nothing is
# overridden: ``optimized`` tests then compile at -O0 too (slower, same results).
_OPTIMIZED = {"level": None}


def _install_level_override() -> None:
    try:
        from jax._src import compiler

        original = compiler.get_compile_options
        signature = inspect.signature(original)
    except (ImportError, AttributeError, TypeError, ValueError):
        return
    if "env_options_overrides" not in signature.parameters:
        return

    def get_compile_options(*args, **kwargs):
        if _OPTIMIZED["level"] is None:
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.arguments["env_options_overrides"] = {
            "xla_backend_optimization_level": _OPTIMIZED["level"],
            **dict(bound.arguments.get("env_options_overrides") or {}),
        }
        return original(*bound.args, **bound.kwargs)

    compiler.get_compile_options = get_compile_options


if _QUICK_COMPILE:
    _install_level_override()


@pytest.fixture(autouse=True, scope="module")
def _optimized_module(request):
    """Modules marked ``optimized`` compile at LLVM -O1 (their module fixtures included)."""
    with _optimized_if(request.node.get_closest_marker("optimized") is not None):
        yield


@pytest.fixture(autouse=True)
def _optimized_test(request):
    """Tests marked ``optimized`` compile at LLVM -O1."""
    with _optimized_if(request.node.get_closest_marker("optimized") is not None):
        yield


@contextlib.contextmanager
def _optimized_if(optimized: bool):
    before = _OPTIMIZED["level"]
    if optimized and _QUICK_COMPILE:
        _OPTIMIZED["level"] = 1
    try:
        yield
    finally:
        _OPTIMIZED["level"] = before


def pytest_unconfigure(config):
    if _OWNED is not None:
        shutil.rmtree(_OWNED, ignore_errors=True)


def pytest_addoption(parser):
    parser.addoption(
        "--full-scale",
        action="store_true",
        default=False,
        help="run the slow end-to-end tests at their full configuration (CI runs them reduced)",
    )


@pytest.fixture(scope="session")
def full_scale(request) -> bool:
    """True under ``--full-scale``: slow end-to-end tests then run their acceptance-sized
    configuration instead of the reduced one CI runs (same code path, same assertions)."""
    return request.config.getoption("--full-scale")


# The files that cost most (CPU seconds in a --durations run at c14b752), most first.
HEAVIEST = (
    "test_multihost_reproduce.py",
    "test_frozenlake_learning.py",
    "test_frozenlake_learning_lora_moe.py",
    "test_reproduce_pipeline.py",
    "test_serve_learning.py",
    "test_multihost.py",
    "test_sampler_sharded.py",
)


def pytest_configure(config):
    # pytest-xdist reorders ``--dist loadfile``'s files by their number of tests (most first)
    # unless told not to, which undid the order below: the few-test, long files came last.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """The heaviest files (:data:`HEAVIEST`) run first, then the other files holding ``slow``
    tests, then the rest in collection order: under README's ``-n 2 --dist loadfile`` the long
    files then start early instead of leaving one worker busy at the end while the other
    waits."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    rank = {name: i for i, name in enumerate(HEAVIEST)}

    def order(item):
        return (rank.get(item.path.name, len(rank)), item.path not in slow_files)

    items.sort(key=order)  # stable: files stay whole, their tests in order
