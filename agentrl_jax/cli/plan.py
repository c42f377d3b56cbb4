"""``agentrl-jax plan``: does a config fit a target? Compiled, not guessed
(:mod:`agentrl_jax.plan`).

    agentrl-jax plan --config configs/frozenlake_qwen3_4b_tpu.yaml --topology v5p:2x2x2
    agentrl-jax plan --config configs/frozenlake_qwen3_8b_gpu.yaml --gpus 8 \\
        --gpu-memory-gib 80 --json

No accelerator and no weights are needed. TPU targets need libtpu (``pip install -e ".[tpu]"``);
GPU targets are estimated with a stand-in compiler: ``--gpu-stand-in tpu`` compiles for TPU v5p
chips of the same count (needs libtpu; bfloat16 kept, the closer estimate), ``--gpu-stand-in cpu``
(the default) on fake CPU devices (the command restarts itself with
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` when this process has fewer).
Exit status 0 when every program fits with the headroom asked, 1 when one does not.
"""

from __future__ import annotations

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
    gpus: Optional[int] = typer.Option(
        None, help="GPUs in one node (estimated on fake CPU devices)."
    ),
    gpu_memory_gib: float = typer.Option(80.0, help="Memory per GPU in GiB."),
    gpu_stand_in: str = typer.Option(
        "cpu",
        help="Compiler standing in for XLA:GPU: cpu (fake CPU "
        "devices, coarse) or tpu (TPU v5p, needs libtpu).",
    ),
    headroom: float = typer.Option(0.15, help="Share of device memory to keep free (0.15 = 15%)."),
    model: Optional[str] = typer.Option(
        None,
        help="Architecture when model.model_dir has no "
        "config.json: qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b.",
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
    if (topology is None) == (gpus is None):
        raise typer.BadParameter("give exactly one of --topology or --gpus")
    if not 0 <= headroom < 1:
        raise typer.BadParameter(f"--headroom must be in [0, 1), got {headroom}")
    if gpus is not None and gpu_stand_in == "cpu":
        if gpus < 1:
            raise typer.BadParameter(f"--gpus must be >= 1, got {gpus}")
        flag = f"--xla_force_host_platform_device_count={gpus}"
        if os.environ.get(_CHILD) is None and flag not in os.environ.get("XLA_FLAGS", ""):
            env = dict(
                os.environ,
                XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip(),
                JAX_PLATFORMS="cpu",
                **{_CHILD: "1"},
            )
            child = subprocess.run(
                [sys.executable, "-m", "agentrl_jax.cli", "plan", *sys.argv[2:]], env=env
            )
            raise typer.Exit(child.returncode)

    from agentrl_jax import plan as planner
    from agentrl_jax.plugins import load_plugins
    from agentrl_jax.reproduce.config import load_config

    try:
        load_plugins(plugin or ())
        settings = load_config(config, set_ or ())
        target = (
            planner.tpu_target(topology)
            if topology is not None
            else planner.gpu_target(gpus, gpu_memory_gib, gpu_stand_in)
        )
        report = planner.plan(
            settings, target, headroom=headroom, model_name=model, programs=program
        )
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    typer.echo(json.dumps(report, indent=1) if json_out else planner.format_table(report))
    raise typer.Exit(0 if report["fits"] else 1)
