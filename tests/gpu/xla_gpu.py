"""Helpers of the XLA:GPU compile checks (tests/gpu): compile-only NVIDIA GPUs, what a
compiled program's optimized HLO calls, and whether a program compiles at all.

The checks need jax's CUDA plugin (the ``gpu-compile`` extra) in a process started with
``JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` (tests/gpu/conftest.py sets both when
only tests/gpu is run). Without the plugin a module skips, with one reason
(:func:`skip_or_fail_module`); with ``AGENTRL_JAX_REQUIRE_XLA_GPU=1`` (CI) it fails instead,
so a CI step whose plugin went missing cannot pass by skipping everything.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any, Callable

import jax
import pytest
from jax.sharding import SingleDeviceSharding

from agentrl_jax.plan.targets import Target, cuda_plugin_version, cuda_target

REQUIRE_ENV = "AGENTRL_JAX_REQUIRE_XLA_GPU"

# custom_call_target of a Pallas kernel lowered through Triton (the whole call:
# custom_call_target="__gpu$xla.gpu.triton"), and the prefix of cuDNN's fused attention
# ("__cudnn$fmhaScaleBiasSoftmax", "...Backward"), as XLA:GPU's optimized HLO names them
# (jax 0.10.2)
TRITON = "__gpu$xla.gpu.triton"
CUDNN_FMHA = "__cudnn$fmha"

_TARGET = re.compile(r'custom_call_target="([^"]+)"')


def required() -> bool:
    """Whether a missing XLA:GPU is a failure (``AGENTRL_JAX_REQUIRE_XLA_GPU=1``, CI)."""
    return os.environ.get(REQUIRE_ENV) == "1"


@functools.cache
def unavailable() -> str | None:
    """Why this process cannot compile with XLA:GPU (None: it can)."""
    if cuda_plugin_version() is None:
        return (
            "XLA:GPU compile checks need jax's CUDA plugin: pip install -e '.[gpu-compile]' "
            "(no GPU needed; docs/testing.md)"
        )
    try:
        target("h100")
    except ValueError as error:
        return f"no compile-only GPUs in this process: {error}"
    return None


def skip_or_fail_module() -> None:
    """Skip the calling test module where XLA:GPU is unavailable, or fail it under
    ``AGENTRL_JAX_REQUIRE_XLA_GPU=1``. Call at module level, before anything compiles."""
    reason = unavailable()
    if reason is None:
        return
    if required():
        pytest.fail(f"{REQUIRE_ENV}=1 and {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


@functools.cache
def target(gpu: str, count: int = 1) -> Target:
    """``count`` compile-only ``gpu`` devices (``"h100"``, ``"a100"``, ``"h200"``)."""
    return cuda_target(gpu, count)


def device(gpu: str = "h100") -> Any:
    return target(gpu).devices[0]


def on(gpu: str) -> Callable[[tuple[int, ...], Any], jax.ShapeDtypeStruct]:
    """``spec(shape, dtype)``: an abstract array on one compile-only ``gpu``."""
    sharding = SingleDeviceSharding(device(gpu))
    return lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def compiles(fn: Callable, *abstract_args: Any) -> tuple[bool, str, Any]:
    """Compile ``jax.jit(fn)`` (or ``fn`` itself where it is jitted already) for the
    shardings of ``abstract_args``: ``(True, "", compiled)``, or ``(False, the compiler's
    message, None)`` where the compiler refuses it (``JaxRuntimeError``: e.g.
    ``RESOURCE_EXHAUSTED: Shared memory size limit exceeded``). Errors while tracing or
    lowering are bugs of the caller and raise."""
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    lowered = jitted.lower(*abstract_args)
    return compile_lowered(lowered)


def compile_lowered(lowered: Any) -> tuple[bool, str, Any]:
    """:func:`compiles` for a program lowered already."""
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as error:
        return False, str(error), None
    return True, "", compiled


def custom_call_targets(compiled: Any) -> list[str]:
    """The ``custom_call_target`` of every custom call in ``compiled``'s optimized HLO, in
    order (repeats kept)."""
    return _TARGET.findall(compiled.as_text())


__all__ = [
    "CUDNN_FMHA",
    "REQUIRE_ENV",
    "TRITON",
    "compile_lowered",
    "compiles",
    "custom_call_targets",
    "device",
    "on",
    "required",
    "skip_or_fail_module",
    "target",
    "unavailable",
]
