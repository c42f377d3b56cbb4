"""``agentrl-jax eval``: the paper's analyses (Pass@K, Pass@T and Table 1, budget robustness,
step quality and error states where the environment's study scores states, likelihood,
training dynamics) for given policies on any registered environment, with a report.

    agentrl-jax eval results/frozenlake                        # a finished run, as it ran
    agentrl-jax eval results/frozenlake --analysis table --set eval.samples=16
    agentrl-jax eval --env sql --policy base=models/base --policy RL=runs/grpo/checkpoints \\
        --out results/sql_eval
    agentrl-jax eval --config configs/frozenlake_qwen3_4b_gpu.yaml \\
        --policy base=/models/Qwen3-4B --policy RL=results/4b/models/grpo --out results/4b_eval

A results folder (from ``agentrl-jax reproduce`` or ``train``) brings its config: its
environment, options, ``T_max``, tasks and evaluation settings, so its policies (the base and
every trained run, by default) are evaluated as that run would, unless ``--set`` says
otherwise; the settings used are printed. Without one, ``--config`` and ``--set`` (over
``--env``'s defaults) give them and ``--policy LABEL=DIR`` names the policies, the first the
base: a Hugging Face model directory or a training checkpoint (:mod:`agentrl_jax.evaluation.
policies`). See :mod:`agentrl_jax.evaluation.evaluate_policies`.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from agentrl_jax.cli.interrupts import command_line, interruptible


def eval_command(
    folder: Optional[Path] = typer.Argument(
        None, help="A results folder of agentrl-jax reproduce or train (its config and models)."
    ),
    policy: Optional[List[str]] = typer.Option(
        None,
        "--policy",
        help="LABEL=DIR: a policy (Hugging Face model directory or training checkpoint), the "
        "first the base (repeatable; default: the folder's base and runs).",
    ),
    analysis: Optional[List[str]] = typer.Option(
        None,
        "--analysis",
        help="One of {analyses} (repeatable; default: every one the environment's study supports).",
    ),
    config: Optional[Path] = typer.Option(
        None, help="YAML config, without a results folder (default: the environment's)."
    ),
    env: Optional[str] = typer.Option(
        None, help="The environment, without a results folder: one of {environments}."
    ),
    set_: Optional[List[str]] = typer.Option(
        None, "--set", help="Override a field: section.field=value (repeatable)."
    ),
    out: Optional[Path] = typer.Option(
        None, help="Where the results go (default: FOLDER/eval; required without a folder)."
    ),
    plugin: Optional[List[str]] = typer.Option(
        None,
        "--plugin",
        help="A Python file or module to import first (repeatable; also AGENTRL_JAX_PLUGINS): "
        "its environments can then be named (and --help with it lists them).",
    ),
    compile_cache: Optional[str] = typer.Option(
        None, "--compile-cache", help="Folder of the persistent XLA compilation cache, or off."
    ),
) -> None:
    """Evaluate policies on any registered environment: Pass@(K, T), Table 1 and the paper's
    diagnostics, with figures and report.md.

    Environments: {environments}. Analyses: {analyses}."""
    from agentrl_jax.cli.compile_cache import use_compile_cache
    from agentrl_jax.cli.paths import output_folder
    from agentrl_jax.evaluation.evaluate_policies import EvalError, evaluate_policies, folder_run
    from agentrl_jax.plugins import load_plugins
    from agentrl_jax.reproduce.config import load_config

    use_compile_cache(compile_cache)
    try:
        load_plugins(plugin or ())
        if folder is not None:
            if config is not None or env is not None:
                raise EvalError("a results folder brings its config: drop --config/--env")
            run = folder_run(folder, set_ or (), load_config)
            settings, logs = run.config, run.logs
            policies = _named(policy) if policy else run.policies
            out = out if out is not None else folder / "eval"
        else:
            if not policy:
                raise EvalError("name the policies: --policy base=DIR [--policy RL=DIR]")
            if out is None:
                raise EvalError("--out: where the results go")
            settings, logs = load_config(config, set_ or (), env=env), None
            policies = _named(policy)
        out = output_folder(out)
        with interruptible():
            report = evaluate_policies(
                settings,
                policies,
                out,
                analyses=analysis or None,
                training_logs=logs if not policy else None,
                # BudgetMix's counterparts: the folder's runs' settings (named: by their names)
                counterparts=run.counterparts if folder is not None and not policy else None,
                echo=typer.echo,
                rerun=_command_line(folder, policy, analysis, config, env, set_, out, plugin),
            )
    except ValueError as error:  # EvalError, ConfigError, a bad --policy
        raise typer.BadParameter(str(error)) from None
    typer.echo(f"Report: {report}")


def _command_line(folder, policy, analysis, config, env, set_, out, plugin) -> str:
    """This ``eval`` command, as the user would type it again."""
    return command_line(
        ["agentrl-jax", "eval", *([str(folder)] if folder is not None else [])],
        [
            ("--policy", policy),
            ("--analysis", analysis),
            ("--config", config),
            ("--env", env),
            ("--set", set_),
            ("--out", out),
            ("--plugin", plugin),
        ],
    )


def _named(items: List[str]) -> dict[str, Path]:
    """``LABEL=DIR`` items as ``{label: directory}``, in order; labels distinct."""
    out: dict[str, Path] = {}
    for item in items:
        label, sep, path = item.partition("=")
        if not sep or not label.strip() or not path.strip():
            raise ValueError(f"--policy {item!r}: expected LABEL=DIR")
        if label.strip() in out:
            raise ValueError(f"--policy: two policies are labelled {label.strip()!r}")
        out[label.strip()] = Path(path.strip())
    return out
