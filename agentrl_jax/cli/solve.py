"""``agentrl-jax solve ...``: solve environments exactly (FrozenLake with Q*)."""

from __future__ import annotations

import typer

app = typer.Typer(help="Solve environments exactly and show the optimal play.", no_args_is_help=True)
