"""Will a config fit, and how fast will it run? Compiled for the target, not guessed.

* :mod:`~agentrl_jax.plan.targets`: what is compiled for (compile-only GPUs by XLA:GPU, TPU
  topologies by XLA:TPU, stand-ins where a compiler is missing) and the GPUs known by name;
* :mod:`~agentrl_jax.plan.planner`: every program of a config compiled for a target, its
  per-device memory and verdict (:func:`plan`, :func:`format_table`);
* :mod:`~agentrl_jax.plan.programs`: each program (train step, LoRA merge, weight sync,
  sampler, likelihood) compiled from abstract inputs in their final shardings;
* :mod:`~agentrl_jax.plan.memory`: a compiled program's per-device memory
  (:class:`ProgramPlan`, :func:`analyse`);
* :mod:`~agentrl_jax.plan.roofline`: the speed those programs would reach on a GPU, from their
  FLOPs and bytes against its peak FLOP/s and bandwidth.

``agentrl-jax plan`` is the command-line front end (:mod:`agentrl_jax.cli.plan`).
"""

from agentrl_jax.models.config import QWEN3_ARCHITECTURES, qwen3_config, qwen3_hf_config
from agentrl_jax.plan.memory import ProgramPlan, analyse, largest_buffers, refused_plan
from agentrl_jax.plan.planner import fit_mesh, format_table, model_config, plan
from agentrl_jax.plan.programs import eval_rows
from agentrl_jax.plan.targets import (
    CUDA_COMPILE_ENV,
    GIB,
    GPUS,
    TPU_MEMORY,
    GpuSpec,
    Target,
    cuda_plugin_version,
    cuda_target,
    gpu_spec,
    gpu_target,
    tpu_target,
)

__all__ = [
    "CUDA_COMPILE_ENV",
    "GIB",
    "GPUS",
    "QWEN3_ARCHITECTURES",
    "TPU_MEMORY",
    "GpuSpec",
    "ProgramPlan",
    "Target",
    "analyse",
    "cuda_plugin_version",
    "cuda_target",
    "eval_rows",
    "fit_mesh",
    "format_table",
    "gpu_spec",
    "gpu_target",
    "largest_buffers",
    "model_config",
    "plan",
    "qwen3_config",
    "qwen3_hf_config",
    "refused_plan",
    "tpu_target",
]
