"""``agentrl-jax reproduce ENV``: the paper's study of an environment end to end, resumable.

    agentrl-jax reproduce frozenlake                                   # built-in CPU default
    agentrl-jax reproduce sql                                          # InterCode-SQL's CPU default
    agentrl-jax reproduce frozenlake --config configs/frozenlake_qwen3_4b_gpu.yaml --out runs/4b
    agentrl-jax reproduce frozenlake --set rl.steps=10 --set eval.samples=4
    agentrl-jax reproduce frozenlake --seeds 0 --seeds 7 --seeds 13      # each finding at 3 seeds
    agentrl-jax reproduce frozenlake --set rl.runs=[gigpo,dapo] --set rl.epochs=2 \\
        --set rl.mini_batches=4
    agentrl-jax reproduce frozenlake --plugin my_loss.py --set 'rl.runs=[{name: mine, algorithm:
        {loss_terms: [policy_clip, {name: my_term, coef: 0.01}]}}]'

ENV is any registered environment (:mod:`envs.registry`: ``frozenlake``, ``sql``, ``code``,
``bfcl``, or one a ``--plugin`` registers). Its study (:mod:`agentrl_jax.reproduce.studies`) gives
the config's defaults (:attr:`~agentrl_jax.reproduce.studies.Study.config_defaults`, under
``--config`` and ``--set``), the tasks, the warm start's demonstrations and the analyses.

``--plugin`` (and ``AGENTRL_JAX_PLUGINS``) import the user's modules before the config is
read, so the environments, loss terms, estimators and run presets they register can be named
(:mod:`agentrl_jax.plugins`; README, "Write your own loss", "Add your own environment").

Several processes (one per host of a TPU pod slice or GPU cluster; README, "Several hosts"):
every process runs the same command with ``--coordinator HOST:PORT --num-processes N
--process-id I`` (or ``--cluster-auto`` where jax finds them itself), ``--out`` on a file
system all of them see.

Compiled programs are kept in a persistent cache (:mod:`agentrl_jax.cli.compile_cache`,
``--compile-cache``), so a program is compiled once per machine, not once per phase or run.

Rerunning the same command on the same ``--out`` resumes: finished phases are skipped and a
training run continues from its newest checkpoint (see :mod:`agentrl_jax.reproduce.pipeline`).
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer


def reproduce_command(
    env: str = typer.Argument(
        ..., help="The environment: frozenlake, sql, code, bfcl, or one a --plugin registers."
    ),
    config: Optional[Path] = typer.Option(
        None,
        help="YAML config (default: the environment's "
        "built-in CPU config, e.g. "
        "configs/frozenlake_cpu.yaml).",
    ),
    out: Optional[Path] = typer.Option(
        None,
        help="Results folder (resumed if it holds a run of the same config; default results/ENV).",
    ),
    set_: Optional[List[str]] = typer.Option(
        None, "--set", help="Override a field: section.field=value (repeatable)."
    ),
    fresh: bool = typer.Option(False, help="Delete the results folder first and start over."),
    progress: bool = typer.Option(True, help="Show the progress bar."),
    until: Optional[str] = typer.Option(
        None,
        help="Stop after this phase (e.g. warm_start, train:grpo, eval:table); rerun to go on.",
    ),
    seeds: Optional[List[int]] = typer.Option(
        None,
        "--seeds",
        help="Run the whole study at each "
        "of these seeds (repeatable) into OUT/seed_<s>/, "
        "then OUT/seeds.md: each finding across them.",
    ),
    plugin: Optional[List[str]] = typer.Option(
        None,
        "--plugin",
        help="A Python file or module to import "
        "first (repeatable; also AGENTRL_JAX_PLUGINS): its "
        "registered loss terms, estimators and run presets "
        "can then be named in the config.",
    ),
    coordinator: Optional[str] = typer.Option(
        None,
        help="Several processes: HOST:PORT of process "
        "0's coordinator (with --num-processes and "
        '--process-id; README, "Several hosts").',
    ),
    num_processes: Optional[int] = typer.Option(None, help="Several processes: how many."),
    process_id: Optional[int] = typer.Option(
        None, help="Several processes: this one's index, 0 .. N-1 (0 writes the results)."
    ),
    cluster_auto: bool = typer.Option(
        False,
        "--cluster-auto",
        help="Several processes found by jax itself (Cloud TPU pod slices, SLURM).",
    ),
    heartbeat_timeout: int = typer.Option(
        100,
        help="Several processes: seconds without a "
        "heartbeat after which a process is taken as dead "
        "and the others stop with an error.",
    ),
    compile_cache: Optional[str] = typer.Option(
        None,
        "--compile-cache",
        help="Folder of the "
        "persistent XLA compilation cache, or off "
        "(default: JAX_COMPILATION_CACHE_DIR if set, "
        "else ~/.cache/agentrl-jax/xla): a program "
        "compiled once is loaded after, in this run and "
        "later ones.",
    ),
) -> None:
    """Base policy (SFT on imperfect demonstrations), full-budget GRPO and BudgetMix GRPO
    from it, then Table 1, Pass@K, Pass@T, likelihood, training dynamics and, where the
    environment has an oracle (FrozenLake's Q*), step quality and error states, written to a
    results folder with report.md."""
    from agentrl_jax.cli.compile_cache import use_compile_cache
    from agentrl_jax.distributed import ClusterConfig, fail_fast, initialize

    try:  # before anything touches jax's devices
        initialize(
            ClusterConfig(
                coordinator,
                num_processes,
                process_id,
                auto=cluster_auto,
                heartbeat_timeout_s=heartbeat_timeout,
            )
        )
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    use_compile_cache(compile_cache)

    with fail_fast():
        _reproduce(env, config, out, set_, fresh, progress, until, seeds, plugin)


def _reproduce(env, config, out, set_, fresh, progress, until, seeds, plugin) -> None:
    import envs
    from agentrl_jax.cli.paths import output_folder
    from agentrl_jax.plugins import load_plugins
    from agentrl_jax.reproduce.config import load_config
    from agentrl_jax.reproduce.folder import ReproduceError, plugins_hint
    from agentrl_jax.reproduce.pipeline import reproduce
    from agentrl_jax.reproduce.seeds import seed_folder, seed_overrides, write_across_seeds
    from agentrl_jax.reproduce.studies import study_for

    out = out if out is not None else Path("results") / env
    output_folder(out)
    if seeds and len(set(seeds)) != len(seeds):
        raise typer.BadParameter(f"--seeds: each seed once, got {seeds}")
    runs = (
        [(None, out, list(set_ or ()))]
        if not seeds
        else [
            (seed, seed_folder(out, seed), list(set_ or ()) + seed_overrides(seed))
            for seed in seeds
        ]
    )
    try:
        load_plugins(plugin or ())
        envs.entry(env)  # an unknown name is refused here
        study = study_for(env)
        defaults = {
            **study.config_defaults,
            "task": {**study.config_defaults.get("task", {}), "env": env},
        }
        settings = [
            load_config(config, overrides, defaults=defaults) for _, _, overrides in runs
        ]  # all checked first
    except ValueError as error:
        raise typer.BadParameter(f"{error}{plugins_hint(out)}") from None
    if settings[0].task.env != env:
        raise typer.BadParameter(
            f"--config {config} sets task.env: {settings[0].task.env}, but "
            f"this command reproduces {env}"
        )
    for (_seed, folder, overrides), setting in zip(runs, settings):
        shown = f" with --set {', '.join(overrides)}" if overrides else ""
        typer.echo(
            f"Reproducing {envs.entry(env).label} into {folder} "
            f"(config: {config or 'built-in default'}"
            f"{shown})"
        )
        try:
            report = reproduce(setting, folder, fresh=fresh, progress=progress, until=until)
        except ReproduceError as error:
            raise typer.BadParameter(str(error)) from None
        typer.echo(
            f"Report: {report}"
            if report.exists()
            else f"Stopped after {until}; rerun without --until to go on"
        )
    if seeds and until is None:
        typer.echo(f"Findings across seeds: {write_across_seeds(out, seeds)}")
