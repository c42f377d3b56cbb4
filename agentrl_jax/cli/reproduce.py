"""``agentrl-jax reproduce ENV`` and ``agentrl-jax train``: the paper's study of an environment
end to end, and its training alone; both resumable.

    agentrl-jax reproduce frozenlake                                   # built-in CPU default
    agentrl-jax reproduce sql                                          # InterCode-SQL's CPU default
    agentrl-jax reproduce frozenlake --print-config                    # the config it would run
    agentrl-jax reproduce frozenlake --config configs/frozenlake_qwen3_4b_gpu.yaml --out runs/4b
    agentrl-jax reproduce frozenlake --set rl.steps=10 --set eval.samples=4
    agentrl-jax reproduce frozenlake --seeds 0 --seeds 7 --seeds 13      # each finding at 3 seeds
    agentrl-jax reproduce frozenlake --set rl.runs=[gigpo,dapo] --set rl.batching.epochs=2 \\
        --set rl.batching.mini_batches=4
    agentrl-jax reproduce frozenlake --plugin my_loss.py --set 'rl.runs=[{name: mine, algorithm:
        {loss_terms: [policy_clip, {name: my_term, coef: 0.01}]}}]'
    agentrl-jax train --config configs/frozenlake_ci.yaml --out runs/ci   # no evaluation

ENV is any registered environment (:mod:`envs.registry`: ``frozenlake``, ``sql``, ``code``,
``bfcl``, or one a ``--plugin`` registers; ``train`` reads it from the config's ``task.env``).
The help texts name the environments, run presets and analyses registered when ``--help`` is
shown, a plugin's too (the ``{environments}``, ``{presets}`` and ``{analyses}`` placeholders
below: :mod:`agentrl_jax.cli.registries`).
Its study (:mod:`agentrl_jax.reproduce.studies`) gives the config's defaults
(:attr:`~agentrl_jax.reproduce.studies.Study.config_defaults`, under ``--config`` and
``--set``), the tasks, the warm start's demonstrations and the analyses.

``train`` runs the same phases up to the RL runs (the initial policy, the warm start, each run
of ``rl.runs`` through :func:`agentrl_jax.train.run.train_policy`) into the same folder layout,
without the evaluation: ``agentrl-jax reproduce ENV`` or ``agentrl-jax eval`` on the folder
goes on from there.

``--plugin`` (and ``AGENTRL_JAX_PLUGINS``) import the user's modules before the config is
read, so the environments, loss terms, estimators and run presets they register can be named
(:mod:`agentrl_jax.plugins`; docs/extending.md).

Several processes (one per host of a TPU pod slice or GPU cluster; docs/several-hosts.md):
every process runs the same command with ``--coordinator HOST:PORT --num-processes N
--process-id I`` (or ``--cluster-auto`` where jax finds them itself), ``--out`` on a file
system all of them see.

Compiled programs are kept in a persistent cache (:mod:`agentrl_jax.cli.compile_cache`,
``--compile-cache``), so a program is compiled once per machine, not once per phase or run.

Rerunning the same command on the same ``--out`` resumes: finished phases are skipped and a
training run continues from its newest checkpoint (see :mod:`agentrl_jax.reproduce.pipeline`).

``agentrl-jax compare``: did a results folder reproduce the stored run made on a CPU like the
one it ran on? (:mod:`agentrl_jax.reproduce.compare`; this module is the only one of ``cli/``
that imports :mod:`agentrl_jax.reproduce`)

    agentrl-jax compare                               # results/frozenlake, the README's run
    agentrl-jax compare runs/mine --reference agentrl_jax/reproduce/references/x.json

Exit status 0 when everything compared is identical, 1 when something differs (named), 2 when
no stored reference fits the run (its config, its CPU's deciding vector features or its jax
version; the reason is said).
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from agentrl_jax.cli.interrupts import command_line, interruptible

# The options both commands take.
_CONFIG = typer.Option(
    None,
    help="YAML config: what differs from the environment's built-in default "
    "(--print-config shows the whole config).",
)
_OUT = typer.Option(
    None,
    help="Results folder (resumed if it holds a run of the same config; default results/ENV).",
)
_SET = typer.Option(None, "--set", help="Override a field: section.field=value (repeatable).")
_FRESH = typer.Option(False, help="Delete the results folder first and start over.")
_PROGRESS = typer.Option(True, help="Show the progress bar.")
_PRINT = typer.Option(
    False, "--print-config", help="Print the whole config (YAML) and exit without running."
)
_PLUGIN = typer.Option(
    None,
    "--plugin",
    help="A Python file or module to import first (repeatable; also AGENTRL_JAX_PLUGINS): "
    "its registered environments, loss terms, estimators and run presets can then be named "
    "in the config (and --help with it lists them).",
)
_COORDINATOR = typer.Option(
    None,
    help="Several processes: HOST:PORT of process 0's coordinator (with --num-processes and "
    "--process-id; docs/several-hosts.md).",
)
_NUM_PROCESSES = typer.Option(None, help="Several processes: how many.")
_PROCESS_ID = typer.Option(
    None, help="Several processes: this one's index, 0 .. N-1 (0 writes the results)."
)
_CLUSTER_AUTO = typer.Option(
    False,
    "--cluster-auto",
    help="Several processes found by jax itself (Cloud TPU pod slices, SLURM).",
)
_HEARTBEAT = typer.Option(
    100,
    help="Several processes: seconds without a heartbeat after which a process is taken as "
    "dead and the others stop with an error.",
)
_COMPILE_CACHE = typer.Option(
    None,
    "--compile-cache",
    help="Folder of the persistent XLA compilation cache, or off (default: "
    "JAX_COMPILATION_CACHE_DIR if set, else ~/.cache/agentrl-jax/xla): a program compiled "
    "once is loaded after, in this run and later ones.",
)


def reproduce_command(
    env: str = typer.Argument(
        ...,
        help="The environment, one of those registered: {environments} (a --plugin module "
        "may register more).",
    ),
    config: Optional[Path] = _CONFIG,
    out: Optional[Path] = _OUT,
    set_: Optional[List[str]] = _SET,
    fresh: bool = _FRESH,
    progress: bool = _PROGRESS,
    until: Optional[str] = typer.Option(
        None,
        help="Stop after this phase (e.g. warm_start, train:grpo, eval:table); rerun to go on.",
    ),
    seeds: Optional[List[int]] = typer.Option(
        None,
        "--seeds",
        help="Run the whole study at each of these seeds (repeatable) into OUT/seed_<s>/, "
        "then OUT/seeds.md and OUT/report.md: each finding across them.",
    ),
    print_config: bool = _PRINT,
    plugin: Optional[List[str]] = _PLUGIN,
    coordinator: Optional[str] = _COORDINATOR,
    num_processes: Optional[int] = _NUM_PROCESSES,
    process_id: Optional[int] = _PROCESS_ID,
    cluster_auto: bool = _CLUSTER_AUTO,
    heartbeat_timeout: int = _HEARTBEAT,
    compile_cache: Optional[str] = _COMPILE_CACHE,
) -> None:
    """The paper's study of an environment ({environments}): the base policy, the RL runs of
    its config's registered presets from it, then the analyses, into a results folder with
    report.md.

    The base policy: SFT on imperfect demonstrations (or a local Qwen3). The RL runs: rl.runs,
    each a registered run preset ({presets}) or a run composed of registered loss terms and
    advantage estimators; the built-in defaults train several presets (--print-config shows
    which). The analyses: those of {analyses} that the environment's study supports (step
    quality, error states and the analyses built on them where it scores states, e.g.
    FrozenLake's Q*).

    A --plugin module (or one named by AGENTRL_JAX_PLUGINS) may register more environments and
    presets; --plugin FILE --help lists them too."""
    _start(coordinator, num_processes, process_id, cluster_auto, heartbeat_timeout, compile_cache)
    from agentrl_jax.distributed import fail_fast

    with fail_fast(), interruptible():
        _reproduce(env, config, out, set_, fresh, progress, until, seeds, plugin, print_config)


def train_command(
    config: Optional[Path] = _CONFIG,
    env: Optional[str] = typer.Option(
        None,
        help="The environment, one of {environments} (default: the config's task.env, else "
        "frozenlake).",
    ),
    out: Optional[Path] = _OUT,
    set_: Optional[List[str]] = _SET,
    fresh: bool = _FRESH,
    progress: bool = _PROGRESS,
    print_config: bool = _PRINT,
    plugin: Optional[List[str]] = _PLUGIN,
    coordinator: Optional[str] = _COORDINATOR,
    num_processes: Optional[int] = _NUM_PROCESSES,
    process_id: Optional[int] = _PROCESS_ID,
    cluster_auto: bool = _CLUSTER_AUTO,
    heartbeat_timeout: int = _HEARTBEAT,
    compile_cache: Optional[str] = _COMPILE_CACHE,
) -> None:
    """Train the config's RL runs (rl.runs) from its policy (a local Qwen3, or a random
    init warm-started on the environment's demonstrations) into a results folder: models,
    checkpoints and metrics, without the evaluation.

    Each run of rl.runs is a registered run preset ({presets}) or a run composed of
    registered loss terms and advantage estimators; a --plugin module may register more."""
    _start(coordinator, num_processes, process_id, cluster_auto, heartbeat_timeout, compile_cache)
    from agentrl_jax.distributed import fail_fast

    with fail_fast(), interruptible():
        _reproduce(env, config, out, set_, fresh, progress, None, None, plugin, print_config, True)


def resume_command(command: str, env, config, out, set_, plugin, until=None, seeds=None) -> str:
    """The command line that goes on with an interrupted run: the same command, options and
    folder, without ``--fresh`` (which would delete what is saved)."""
    positional = [env] if command == "reproduce" else []
    options = [("--env", env if command == "train" else None), ("--config", config)]
    options += [("--out", out), ("--set", set_), ("--plugin", plugin), ("--until", until)]
    return command_line(["agentrl-jax", command, *positional], [*options, ("--seeds", seeds)])


def _start(coordinator, num_processes, process_id, cluster_auto, heartbeat_timeout, cache) -> None:
    """Join the processes' cluster (before anything touches jax's devices) and open the
    compilation cache."""
    from agentrl_jax.cli.compile_cache import use_compile_cache
    from agentrl_jax.distributed import ClusterConfig, initialize

    try:
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
    use_compile_cache(cache)


def _reproduce(
    env, config, out, set_, fresh, progress, until, seeds, plugin, print_config, train_only=False
) -> None:
    import envs
    from agentrl_jax.cli.paths import output_folder
    from agentrl_jax.config_io import dump_config
    from agentrl_jax.evaluation.evaluate_policies import EvalError
    from agentrl_jax.plugins import load_plugins
    from agentrl_jax.reproduce.config import load_config
    from agentrl_jax.reproduce.folder import plugins_hint
    from agentrl_jax.reproduce.pipeline import last_training_phase, reproduce
    from agentrl_jax.reproduce.seeds import (
        seed_folder,
        seed_overrides,
        write_across_seeds,
        write_seeds_report,
    )

    given_env = env  # as the user named it (train: None where the config says it)
    if seeds and len(set(seeds)) != len(seeds):
        raise typer.BadParameter(f"--seeds: each seed once, got {seeds}")
    runs = (  # (seed, overrides) per reproduction
        [(None, list(set_ or ()))]
        if not seeds
        else [(seed, list(set_ or ()) + seed_overrides(seed)) for seed in seeds]
    )
    try:
        load_plugins(plugin or ())
        if env is not None:
            envs.entry(env)  # an unknown name is refused here
        settings = [
            load_config(config, overrides, env=env) for _, overrides in runs
        ]  # all checked first
    except ValueError as error:
        raise typer.BadParameter(f"{error}{plugins_hint(out) if out else ''}") from None
    if env is not None and settings[0].task.env != env:
        raise typer.BadParameter(
            f"--config {config} sets task.env: {settings[0].task.env}, but "
            f"this command reproduces {env}"
        )
    env = settings[0].task.env
    if print_config:
        typer.echo(dump_config(settings[0]), nl=False)
        return
    out = out if out is not None else Path("results") / env
    out = output_folder(out)
    runs = [(seed, out if seed is None else seed_folder(out, seed), o) for seed, o in runs]
    command = "train" if train_only else "reproduce"
    for (_seed, folder, overrides), setting in zip(runs, settings):
        shown = f" with --set {', '.join(overrides)}" if overrides else ""
        typer.echo(
            f"{'Training' if train_only else 'Reproducing'} {envs.entry(env).label} into "
            f"{folder} (config: {config or 'built-in default'}{shown})"
        )
        stop = last_training_phase(setting) if train_only else until
        try:
            report = reproduce(
                setting,
                folder,
                fresh=fresh,
                progress=progress,
                until=stop,
                command=command,
                resume_with=resume_command(
                    command, given_env, config, out, set_, plugin, until, seeds
                ),
            )
        except EvalError as error:  # a ReproduceError, or the tasks' data (make_tasks)
            raise typer.BadParameter(str(error)) from None
        if train_only:
            typer.echo(
                f"Trained: {', '.join(str(folder / 'models' / n) for n in setting.rl.run_names)}"
            )
        else:
            typer.echo(
                f"Report: {report}"
                if report.exists()
                else f"Stopped after {until}; rerun without --until to go on"
            )
    if seeds and until is None:
        typer.echo(f"Findings across seeds: {write_across_seeds(out, seeds)}")
        report = write_seeds_report(out, seeds)
        typer.echo(
            f"Report across seeds: {report}"
            if report is not None
            else f"{out} holds a run of its own: its report.md is kept (see seeds.md)"
        )


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
