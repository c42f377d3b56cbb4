"""The ``agentrl-jax`` command line: one console script, one sub-app per concern."""

from __future__ import annotations

import os

# transformers prints "PyTorch was not found..." (an advisory warning) when it is imported
# without torch; nothing the commands run needs torch, so the advice is noise here.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import typer  # noqa: E402

from agentrl_jax.cli import bench, eval_envs, plan, reproduce, solve  # noqa: E402
from agentrl_jax.cli import eval as eval_cli  # noqa: E402 (the module name would shadow the builtin)

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
app.command("reproduce", no_args_is_help=True)(reproduce.reproduce_command)
app.command("train")(reproduce.train_command)
app.add_typer(solve.app, name="solve")
app.command("plan")(plan.plan)


def main() -> None:
    app()
