"""``agentrl-jax plan``: does a config fit a target, and how fast could it run? Compiled, not
guessed (:mod:`agentrl_jax.plan`).

    agentrl-jax plan --config configs/frozenlake_qwen3_4b_tpu.yaml --topology v5p:2x2x2
    agentrl-jax plan --config configs/frozenlake_qwen3_8b_gpu.yaml --gpu h100 --gpus 8 --json

No accelerator and no weights are needed. GPU targets (``--gpu h100|h200|a100``, ``--gpus N``
of them in one node; ``--gpus`` alone means H100s) are compiled by XLA:GPU itself on
compile-only devices when jax's CUDA plugin is installed (``pip install -e ".[cuda]"``; the
command restarts itself with ``JAX_PLATFORMS=cpu`` so that jax opens no driver), with a
roofline prediction per program. Without the plugin a stand-in compiler estimates them:
``--gpu-stand-in tpu`` (TPU v5p chips, needs libtpu; the default when libtpu is installed) or
``cpu`` (fake CPU devices: XLA:CPU computes bfloat16 in float32, so buffers can be twice their
GPU size). The report names the compiler of every figure. TPU targets need libtpu
(``pip install -e ".[tpu]"``). Exit status 0 when every program compiles and fits with the
headroom asked (or the stand-in cannot tell: "unknown on this compiler", naming the buffer it
inflated and how to get the verdict), 1 when one does not compile or does not fit.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

import typer

app = typer.Typer(help="Compile a config's programs for a target and report per-device memory.")

_CHILD = "AGENTRL_JAX_PLAN_CHILD"


@app.command()
def plan(
    config: Optional[Path] = typer.Option(
        None, help="YAML config (default: the built-in CPU config)."
    ),
    topology: Optional[str] = typer.Option(
        None, help="A TPU topology, e.g. v5p:2x2x2 (needs libtpu)."
    ),
    gpu: Optional[str] = typer.Option(
        None, help="A GPU to compile for with XLA:GPU: h100, h200 or a100 (needs the cuda extra)."
    ),
    gpus: Optional[int] = typer.Option(
        None, help="GPUs in one node (default 1 with --gpu; alone: H100s)."
    ),
    gpu_memory_gib: Optional[float] = typer.Option(
        None, help="Memory per GPU in GiB (default: the GPU's own)."
    ),
    gpu_stand_in: Optional[str] = typer.Option(
        None,
        help="Estimate GPUs with another compiler: tpu (TPU v5p, needs libtpu) or cpu (fake CPU "
        "devices, coarse). Default: XLA:GPU when the CUDA plugin is installed, else tpu when "
        "libtpu is, else cpu.",
    ),
    headroom: float = typer.Option(0.15, help="Share of device memory to keep free (0.15 = 15%)."),
    model: Optional[str] = typer.Option(
        None,
        help="Architecture when model.model_dir has no "
        "config.json: qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, qwen3-30b-a3b.",
    ),
    program: Optional[List[str]] = typer.Option(
        None, help="Only programs whose name starts with this (repeatable): train, rollout, eval."
    ),
    set_: Optional[List[str]] = typer.Option(
        None, "--set", help="Override a field: section.field=value."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    plugin: Optional[List[str]] = typer.Option(
        None,
        "--plugin",
        help="A Python file or module to import "
        "first (repeatable; also AGENTRL_JAX_PLUGINS), e.g. one "
        "registering a loss term the config names.",
    ),
) -> None:
    """Per program and device: arguments, outputs, temporaries, peak, largest buffers, fit."""
    from agentrl_jax.plan import targets

    if (topology is None) == (gpus is None and gpu is None):
        raise typer.BadParameter("give exactly one of --topology or --gpu/--gpus")
    if not 0 <= headroom < 1:
        raise typer.BadParameter(f"--headroom must be in [0, 1), got {headroom}")
    compiler = None
    if topology is None:
        gpu = (gpu or "h100").lower()
        gpus = 1 if gpus is None else gpus
        if gpu not in targets.GPUS:
            raise typer.BadParameter(f"--gpu {gpu!r}: unknown; known: {', '.join(targets.GPUS)}")
        if gpus < 1:
            raise typer.BadParameter(f"--gpus must be >= 1, got {gpus}")
        if gpu_stand_in not in (None, "cpu", "tpu"):
            raise typer.BadParameter(f"--gpu-stand-in must be 'cpu' or 'tpu', got {gpu_stand_in!r}")
        compiler = gpu_stand_in or (
            "xla-gpu"
            if targets.cuda_plugin_version()
            else "tpu"
            if targets.libtpu_installed()
            else "cpu"
        )
        _restart_for(compiler, gpus)

    from agentrl_jax import plan as planner
    from agentrl_jax.plugins import load_plugins
    from agentrl_jax.reproduce.config import load_config

    try:
        load_plugins(plugin or ())
        settings = load_config(config, set_ or ())
        if topology is not None:
            target = planner.tpu_target(topology)
        elif compiler == "xla-gpu":
            target = planner.cuda_target(gpu, gpus)
            if gpu_memory_gib is not None:
                target = dataclasses.replace(target, memory_bytes=gpu_memory_gib * planner.GIB)
        else:
            spec = planner.GPUS[gpu]
            memory = gpu_memory_gib or spec.memory_bytes / planner.GIB
            target = planner.gpu_target(gpus, memory, compiler, gpu=spec)
        report = planner.plan(
            settings, target, headroom=headroom, model_name=model, programs=program
        )
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    typer.echo(json.dumps(report, indent=1) if json_out else planner.format_table(report))
    # exit 1 only for a verdict the compiler supports: "unknown on this compiler" exits 0
    raise typer.Exit(0 if report["fits"] is not False and report["compiled"] else 1)


def _restart_for(compiler: str, gpus: int) -> None:
    """Run this command again in a child process started as ``compiler`` needs (fake CPU
    devices; or ``JAX_PLATFORMS=cpu`` for XLA:GPU's compile-only devices), unless this is that
    process; exits with the child's status."""
    from agentrl_jax.plan import targets

    if compiler == "cpu":
        flag = f"--xla_force_host_platform_device_count={gpus}"
        if os.environ.get(_CHILD) is not None or flag in os.environ.get("XLA_FLAGS", ""):
            return
        env = {
            "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip(),
            "JAX_PLATFORMS": "cpu",
        }
    elif compiler == "xla-gpu":
        if os.environ.get(_CHILD) is not None or targets.in_cuda_compile_process():
            return
        env = dict(targets.CUDA_COMPILE_ENV)
    else:
        return
    child = subprocess.run(
        [sys.executable, "-m", "agentrl_jax.cli", "plan", *sys.argv[2:]],
        env={**os.environ, **env, _CHILD: "1"},
    )
    raise typer.Exit(child.returncode)
