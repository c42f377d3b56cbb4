"""The ``agentrl-jax`` command line: one console script, one sub-app per concern."""

from __future__ import annotations

import os

# transformers prints "PyTorch was not found..." (an advisory warning) when it is imported
# without torch; nothing the commands run needs torch, so the advice is noise here.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import typer  # noqa: E402

from agentrl_jax.cli import bench, evaluate, plan, reproduce, serve, solve  # noqa: E402
from agentrl_jax.cli.registries import RegistryHelpCommand, RegistryHelpGroup  # noqa: E402

# The help of eval, reproduce and train names the registered environments, run presets and
# analyses, read when it is shown (plugins included): cli/registries.py.
app = typer.Typer(
    name="agentrl-jax",
    help="JAX-native multi-turn RL for LLM agents.",
    cls=RegistryHelpGroup,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(bench.app, name="bench")
app.command("eval", cls=RegistryHelpCommand)(evaluate.eval_command)
app.command("reproduce", cls=RegistryHelpCommand, no_args_is_help=True)(reproduce.reproduce_command)
app.command("train", cls=RegistryHelpCommand)(reproduce.train_command)
app.add_typer(solve.app, name="solve")
app.command("plan")(plan.plan)
app.command("serve")(serve.serve_command)
app.command("compare")(reproduce.compare_command)


def main() -> None:
    # one name in usage lines and errors, also when plan restarts itself as
    # ``python -m agentrl_jax.cli`` (which click would print as the program)
    app(prog_name="agentrl-jax")
