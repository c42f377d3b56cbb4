"""The ``agentrl-jax`` command line: one console script, one sub-app per concern."""

from __future__ import annotations

import typer

from agentrl_jax.cli import bench, eval_envs, plan, reproduce, solve
from agentrl_jax.cli import eval as eval_cli  # the module name would shadow the builtin

app = typer.Typer(
    name="agentrl-jax",
    help="JAX-native multi-turn RL for LLM agents.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(bench.app, name="bench")
eval_envs.register(eval_cli.app)  # eval env-passk / env-passt: SQL, code, BFCL
app.add_typer(eval_cli.app, name="eval")
app.add_typer(reproduce.app, name="reproduce")
app.add_typer(solve.app, name="solve")
app.command("plan")(plan.plan)


def main() -> None:
    app()
