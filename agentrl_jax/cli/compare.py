"""``agentrl-jax compare``: did a results folder reproduce the stored run made on a CPU like
the one it ran on? (:mod:`agentrl_jax.reproduce.compare`)

    agentrl-jax compare                               # results/frozenlake, the README's run
    agentrl-jax compare runs/mine --reference agentrl_jax/reproduce/references/x.json

Exit status 0 when everything compared is identical, 1 when something differs (named), 2 when
no stored reference fits the run (its config, its CPU's deciding vector features or its jax
version; the reason is said).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def compare_command(
    folder: Path = typer.Argument(
        Path("results/frozenlake"),
        help="A results folder of agentrl-jax reproduce (default: the README command's).",
    ),
    reference: Optional[Path] = typer.Option(
        None,
        help="A reference file to compare with instead of the stored one made on a CPU with "
        "the run's deciding vector features.",
    ),
) -> None:
    """Did a run reproduce? Bytes, Table 1, verdicts vs the stored run of the same kind of CPU."""
    from agentrl_jax.reproduce.compare import Reference, report

    try:
        text, status = report(folder, Reference.read(reference) if reference else None)
    except ValueError as error:  # not a results folder, not a reference file
        typer.echo(f"compare: {error}", err=True)
        raise typer.Exit(2) from None
    typer.echo(text)
    raise typer.Exit(status)
