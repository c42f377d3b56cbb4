"""``agentrl-jax reproduce frozenlake``: the paper's FrozenLake study end to end, resumable.

    agentrl-jax reproduce frozenlake                                   # built-in CPU default
    agentrl-jax reproduce frozenlake --config configs/frozenlake_qwen3_4b_gpu.yaml --out runs/4b
    agentrl-jax reproduce frozenlake --set rl.steps=10 --set eval.samples=4

Rerunning the same command on the same ``--out`` resumes: finished phases are skipped and a
training run continues from its newest checkpoint (see :mod:`agentrl_jax.reproduce.pipeline`).
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

app = typer.Typer(help="Reproduce the paper's studies end to end.", no_args_is_help=True)


@app.command("frozenlake")
def frozenlake(
    config: Optional[Path] = typer.Option(None, help="YAML config (default: the built-in CPU "
                                                     "config, configs/frozenlake_cpu.yaml)."),
    out: Path = typer.Option(Path("results/frozenlake"), help="Results folder (resumed if it "
                                                              "holds a run of the same config)."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a field: "
                                                                 "section.field=value (repeatable)."),
    fresh: bool = typer.Option(False, help="Delete the results folder first and start over."),
    progress: bool = typer.Option(True, help="Show the progress bar."),
    until: Optional[str] = typer.Option(None, help="Stop after this phase (e.g. warm_start, "
                                                   "train:grpo, eval:table); rerun to go on."),
) -> None:
    """Base policy (SFT on imperfect Q* demonstrations), full-budget GRPO and BudgetMix GRPO
    from it, then Table 1, Pass@K, Pass@T, step quality, error states, likelihood and training
    dynamics, written to a results folder with report.md."""
    from agentrl_jax.reproduce.config import load_config
    from agentrl_jax.reproduce.pipeline import ReproduceError, reproduce

    try:
        settings = load_config(config, set_ or ())
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    typer.echo(f"Reproducing FrozenLake into {out} (config: {config or 'built-in default'})")
    try:
        report = reproduce(settings, out, fresh=fresh, progress=progress, until=until)
    except ReproduceError as error:
        raise typer.BadParameter(str(error)) from None
    typer.echo(f"Report: {report}" if report.exists() else f"Stopped after {until}; rerun "
               "without --until to go on")
