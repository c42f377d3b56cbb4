"""What a plan compiles for: devices that need not be there, and which compiler builds for them.

A :class:`Target` holds compile-only devices (or fake CPU devices), the memory of one, and the
compiler that produces every figure of the plan:

* ``"XLA:GPU"``  :func:`cuda_target`: compile-only NVIDIA GPUs of jax's CUDA plugin (the
  ``cuda`` extra), described by a shipped target config (``gpus/<name>.txtpb``: the device's
  SMs, shared memory, registers, clock, memory and bandwidth, compute capability; sources in
  each file). The figures are XLA:GPU's own for that GPU: buffer assignment, fusion, the
  Triton and cuDNN paths. Needs a process started with ``JAX_PLATFORMS=cpu`` (jax must not
  open a GPU driver: ``agentrl-jax plan`` restarts itself so);
* ``"XLA:TPU"``  :func:`tpu_target`: compile-only chips of a TPU topology (libtpu, the ``tpu``
  extra);
* ``"XLA:TPU (stand-in for GPU)"``, ``"XLA:CPU (stand-in for GPU)"``  :func:`gpu_target`'s
  fallbacks where the CUDA plugin is not installed: the GPU run's mesh, shardings, shapes and
  dtypes compiled by another compiler; estimates (XLA:CPU computes bfloat16 in float32, so its
  buffers can be twice the GPU's).

:data:`GPUS` names the GPUs known by name (``--gpu h100|h200|a100``) with the figures a
prediction needs (:class:`GpuSpec`: peak dense bfloat16 FLOP/s, HBM bandwidth, memory).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import re
from pathlib import Path
from typing import Any

import jax

GIB = 1024**3
_GPU_FILES = Path(__file__).resolve().parent / "gpus"

# HBM per chip (bytes) by libtpu device kind.
TPU_MEMORY = {
    "TPU v4": 32 * GIB,
    "TPU v5 lite": 16 * GIB,
    "TPU v5": 95.74 * GIB,
    "TPU v5p": 95.74 * GIB,
    "TPU v6 lite": 32 * GIB,
    "TPU v6e": 32 * GIB,
}


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """One GPU model: its XLA:GPU target config and the figures a roofline needs.

    ``memory_bytes`` and ``bandwidth`` (bytes/s) are read from the target config (one source
    for the compiler and the prediction); ``peak_bf16_flops`` is the dense (no sparsity)
    bfloat16 tensor-core peak of NVIDIA's datasheet for the SXM part."""

    name: str  # "h100"
    description: str  # the device kind XLA reports, e.g. "NVIDIA H100 80GB HBM3"
    memory_bytes: int
    bandwidth: float
    peak_bf16_flops: float
    target_config: str  # GpuTargetConfig, protobuf text

    @classmethod
    def load(cls, name: str, peak_bf16_flops: float) -> GpuSpec:
        text = (_GPU_FILES / f"{name}.txtpb").read_text()
        field = lambda key: re.search(rf"^\s*{key}:\s*(.+?)\s*$", text, re.MULTILINE).group(1)  # noqa: E731
        return cls(
            name,
            field("device_description_str").strip('"'),
            int(field("device_memory_size")),
            float(field("memory_bandwidth")),
            peak_bf16_flops,
            text,
        )


# Dense bfloat16 peaks (FLOP/s): NVIDIA's datasheets, SXM parts (H100 and H200: 989.4
# TFLOPS, half the "with sparsity" 1,979; A100: 312 TFLOPS).
GPUS: dict[str, GpuSpec] = {
    name: GpuSpec.load(name, peak)
    for name, peak in (("h100", 989.4e12), ("h200", 989.4e12), ("a100", 312e12))
}


def gpu_spec(name_or_kind: str) -> GpuSpec | None:
    """The :class:`GpuSpec` of a name (``"h100"``) or a device kind XLA reports (``"NVIDIA
    H100 80GB HBM3"``, ``"NVIDIA H200"``); None for a GPU not in :data:`GPUS`."""
    key = name_or_kind.lower()
    return GPUS.get(key) or next((spec for name, spec in GPUS.items() if name in key), None)


@dataclasses.dataclass(frozen=True)
class Target:
    """Devices to compile for, the memory of each, and the ``compiler`` that produces every
    figure (module docstring). ``estimate``: a stand-in compiled for another chip than the one
    planned for; ``gpu``: the GPU planned for (its peak FLOP/s and bandwidth for predictions),
    None for a TPU."""

    name: str
    devices: tuple[Any, ...]
    memory_bytes: float
    estimate: bool
    cpu_stand_in: bool = False
    compiler: str = "XLA:TPU"
    gpu: GpuSpec | None = None

    @property
    def platform(self) -> str:
        """What the programs are built for (``jax.Device.platform``): "gpu", "tpu" or, for
        fake CPU devices standing in for GPUs, "cpu"."""
        return self.devices[0].platform


def cuda_plugin_version() -> str | None:
    """The installed ``jax-cuda12-plugin`` (or ``-cuda13-``) version, None without one."""
    for package in ("jax-cuda12-plugin", "jax-cuda13-plugin"):
        try:
            return f"{package} {importlib.metadata.version(package)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


# what a process needs to compile for GPUs that are not there (set before jax starts)
CUDA_COMPILE_ENV = {
    "JAX_PLATFORMS": "cpu",  # jax opens no GPU driver; the CUDA plugin still compiles
    "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1",  # its version check would need a driver
}


def cuda_target(name: str, count: int = 1) -> Target:
    """``count`` compile-only ``name`` GPUs (a key of :data:`GPUS`) on one host, compiled by
    XLA:GPU. ValueError naming what is missing: the CUDA plugin (the ``cuda`` extra) or a
    process started with ``JAX_PLATFORMS=cpu``. Turns jax's persistent compilation cache off in
    this process (compile-only executables cannot be loaded from it)."""
    spec = GPUS.get(name.lower())
    if spec is None:
        raise ValueError(f"--gpu {name!r}: unknown GPU; known: {', '.join(GPUS)}")
    if count < 1:
        raise ValueError(f"--gpus must be >= 1, got {count}")
    if cuda_plugin_version() is None:
        raise ValueError(
            f"--gpu {name}: XLA:GPU needs jax's CUDA plugin: pip install -e '.[cuda]' "
            "(no GPU needed)"
        )
    from jax.experimental import topologies  # noqa: PLC0415

    # a compile-only executable cannot be loaded back from jax's persistent cache ("PjRtCompiler
    # must be constructed with a Client"): entries would be written, warned about and compiled
    # again on every later run, so this process keeps none
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        topology = topologies.get_topology_desc(
            platform="cuda",
            topology_name="",
            target_config=spec.target_config,
            topology=f"1x1x{count}",
        )
    except NotImplementedError:
        raise ValueError(
            f"--gpu {name}: this process opened jax without the CUDA compiler (start it with "
            + " ".join(f"{k}={v}" for k, v in CUDA_COMPILE_ENV.items())
            + "; agentrl-jax plan does so itself)"
        ) from None
    return Target(
        f"{count} x {spec.description}",
        tuple(topology.devices),
        spec.memory_bytes,
        estimate=False,
        compiler="XLA:GPU",
        gpu=spec,
    )


def tpu_target(topology: str) -> Target:
    """Compile-only devices of a TPU topology (e.g. ``"v5p:2x2x2"``); needs libtpu."""
    try:
        from jax.experimental import topologies  # noqa: PLC0415

        devices = topologies.get_topology_desc(topology, "tpu").devices
    except Exception as e:  # libtpu missing or the name unknown
        raise ValueError(
            f"--topology {topology!r}: no TPU topology ({type(e).__name__}: {e}); "
            "install the tpu extra (pip install -e '.[tpu]') and use a name like v5p:2x2x2"
        ) from None
    kind = devices[0].device_kind
    if kind not in TPU_MEMORY:
        raise ValueError(
            f"--topology {topology!r}: unknown device kind {kind!r} (known: {sorted(TPU_MEMORY)})"
        )
    return Target(f"{topology} ({kind})", tuple(devices), TPU_MEMORY[kind], estimate=False)


def gpu_target(
    count: int, memory_gib: float, stand_in: str = "cpu", gpu: GpuSpec | None = None
) -> Target:
    """``count`` GPUs of ``memory_gib`` each, estimated with a stand-in compiler (where the
    CUDA plugin is missing; :func:`cuda_target` is the real compiler).

    ``stand_in="tpu"``: compile-only TPU v5p chips of the same count (the first ``count`` chips
    of the smallest v5p topology holding them; needs libtpu), bfloat16 kept as such.
    ``stand_in="cpu"``: fake CPU devices; the process must have at least ``count`` of them
    (``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before jax starts).
    ``gpu``: the GPU planned for, kept for predictions.
    """
    label = gpu.description if gpu is not None else "GPU"
    if stand_in == "tpu":
        if count < 1:
            raise ValueError(f"--gpus must be >= 1, got {count}")
        # the smallest v5p topology holding them (4 chips a host); a count that is not a
        # multiple of 4 compiles on the first ``count`` chips
        topology = f"v5p:2x2x{-(-count // 4)}"
        try:
            devices = tpu_target(topology).devices[:count]
        except ValueError:  # name the option the user passed, not the topology chosen for it
            raise ValueError(
                "--gpu-stand-in tpu: the TPU compiler needs libtpu: pip install -e '.[tpu]' "
                "(or leave --gpu-stand-in out: XLA:GPU with the cuda extra, else XLA:CPU)"
            ) from None
        return Target(
            f"{count} x {label} {memory_gib:g} GiB (estimated with the TPU compiler, {topology})",
            tuple(devices),
            memory_gib * GIB,
            estimate=True,
            compiler="XLA:TPU (stand-in for GPU)",
            gpu=gpu,
        )
    if stand_in != "cpu":
        raise ValueError(f"--gpu-stand-in must be 'cpu' or 'tpu', got {stand_in!r}")
    devices = jax.devices("cpu")
    if len(devices) < count:
        raise ValueError(
            f"--gpus {count}: this process has {len(devices)} CPU devices; start it with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={count}"
        )
    return Target(
        f"{count} x {label} {memory_gib:g} GiB (estimated on CPU devices)",
        tuple(devices[:count]),
        memory_gib * GIB,
        estimate=True,
        cpu_stand_in=True,
        compiler="XLA:CPU (stand-in for GPU)",
        gpu=gpu,
    )


def libtpu_installed() -> bool:
    """Whether libtpu (the TPU stand-in's compiler) is installed."""
    try:
        importlib.metadata.version("libtpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def in_cuda_compile_process() -> bool:
    """Whether this process was started as :data:`CUDA_COMPILE_ENV` asks."""
    return all(os.environ.get(k) == v for k, v in CUDA_COMPILE_ENV.items())


__all__ = [
    "CUDA_COMPILE_ENV",
    "GIB",
    "GPUS",
    "GpuSpec",
    "TPU_MEMORY",
    "Target",
    "cuda_plugin_version",
    "cuda_target",
    "gpu_spec",
    "gpu_target",
    "in_cuda_compile_process",
    "libtpu_installed",
    "tpu_target",
]
