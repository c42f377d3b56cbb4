"""Evaluating given policies on any registered environment: the registered analyses
(:func:`~agentrl_jax.evaluation.analyses.context.run_analysis`) and the report, for policies
named by directory, under one config. ``agentrl-jax eval`` is its command line.

Given a results folder (``agentrl-jax reproduce`` or ``agentrl-jax train`` made it), the
config is the folder's own ``config.yaml`` (the run's environment, options, ``T_max``, task
counts, lengths, evaluation settings), so the policies are evaluated as that run would
evaluate them unless overrides say otherwise; the policies default to the folder's base and
RL models, and the training dynamics read its runs' metrics. Without a folder, the config is a
file and overrides over the environment's defaults, and the policies are named.

Policies play the environment study's test tasks (``task.eval_tasks`` of them), each a
Hugging Face model directory or a training checkpoint
(:func:`~agentrl_jax.evaluation.policies.load_policy`); the first is the base every other
is compared with.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from agentrl_jax.errors import did_you_mean
from agentrl_jax.evaluation.analyses import registry
from agentrl_jax.evaluation.analyses.context import run_analysis
from agentrl_jax.evaluation.full_report import write_report
from agentrl_jax.evaluation.raw import counterparts_of_runs
from agentrl_jax.evaluation.verdicts import PaperFigures
from envs.protocol import EnvDataError, EnvOptionError, EnvTasks

BASE = "base"


class EvalError(ValueError):
    """What stops an evaluation before it starts (a folder, a policy, an analysis, the
    environment's data), said in one line."""


@dataclasses.dataclass(frozen=True)
class Tasks:
    """The environment's training and evaluation tasks (:class:`envs.EnvTasks`; disjoint
    splits where the environment has them, the study's ``has_split``)."""

    train: EnvTasks
    test: EnvTasks

    def close(self) -> None:
        self.train.close()
        if self.test is not self.train:
            self.test.close()


@dataclasses.dataclass(frozen=True)
class FolderRun:
    """What a results folder holds: its config, its policies ``{label: directory}`` (the
    base first), its runs' metrics ``{label: metrics.jsonl}`` and, from the runs' settings,
    each BudgetMix run's full-budget counterpart ``{label: label}``."""

    config: Any  # the run's config (agentrl_jax.reproduce.config.ReproduceConfig)
    policies: dict[str, Path]
    logs: dict[str, Path]
    counterparts: dict[str, str] = dataclasses.field(default_factory=dict)


def folder_run(
    folder: str | Path, overrides: Sequence[str], load_config: Callable[..., Any]
) -> FolderRun:
    """The run in ``folder`` (its ``config.yaml`` read by ``load_config(path, overrides)``,
    its models and metrics); an :class:`EvalError` says what is missing."""
    folder = Path(folder)
    saved = folder / "config.yaml"
    if not folder.is_dir():
        raise EvalError(
            f"{folder}: {'is a file, not' if folder.exists() else 'does not exist, so not'} a "
            "results folder of agentrl-jax reproduce or train"
        )
    if not saved.is_file():
        raise EvalError(
            f"{folder}: no config.yaml, so not a results folder of agentrl-jax reproduce or "
            "train; name the policies (--policy LABEL=DIR) and the config (--config, --env)"
        )
    config = load_config(saved, overrides)
    if config.model.model_dir is not None and not config.warm_start.enabled:
        base = Path(config.model.model_dir)
    else:
        base = folder / "models" / (BASE if config.warm_start.enabled else "init")
    policies, logs = {BASE: base}, {}
    runs = config.rl.resolved_runs()
    for run in runs:
        model = folder / "models" / run.name
        if (model / "config.json").is_file():
            policies[run.label] = model
            logs[run.label] = folder / "runs" / run.name / "metrics.jsonl"
    if not (base / "config.json").is_file():
        raise EvalError(f"{folder}: the base policy {base} is not there (yet)")
    return FolderRun(config, policies, logs, counterparts_of_runs(runs))


def default_analyses(config: Any, with_logs: bool, policies: int = 2) -> tuple[str, ...]:
    """The registered analyses the environment's study supports: those that read the runs'
    saved logs (the training dynamics) where there are runs' metrics to read, the pairwise
    ones (base against the others) given two policies."""
    names = config.study.analyses_for(registry.names())
    return tuple(
        n
        for n in names
        if (with_logs or registry.get(n).needs_models)
        and (policies >= 2 or not registry.get(n).pairwise)
    )


def make_tasks(config: Any) -> Tasks:
    """``config.task``'s environment over its train and test tasks, made by its study.

    Made before anything is written: data the environment cannot read (``task.options.data``
    missing, empty, of the wrong kind, unreadable, malformed: :class:`envs.EnvDataError`) or
    an option it refuses (e.g. a sandbox this machine lacks) is one :class:`EvalError` line
    naming the field, so the corrected command runs in the same results folder."""
    t, study = config.task, config.study
    try:
        train = study.tasks(t, split="train", count=t.train_tasks)
        try:
            test = study.tasks(t, split="test", count=t.eval_tasks)
        except BaseException:
            train.close()
            raise
    except EnvDataError as error:
        raise EvalError(f"task.options.data: {error}") from None
    except EnvOptionError as error:
        raise EvalError(f"task.options ({t.env}): {error}") from None
    return Tasks(train, test)


def evaluate_policies(
    config: Any,
    policies: Mapping[str, str | Path],
    out: str | Path,
    *,
    analyses: Sequence[str] | None = None,
    training_logs: Mapping[str, str | Path] | None = None,
    echo: Callable[[str], None] = print,
    rerun: str | None = None,
    counterparts: Mapping[str, str] | None = None,
) -> Path:
    """Run ``analyses`` (default: :func:`default_analyses`) of ``policies`` (``{label:
    directory}``, the base first) on the environment of ``config`` into ``out`` and write its
    report; returns the report's path. Pairwise analyses need two policies or more. An
    interrupt (KeyboardInterrupt) is said in one line (where, what is saved, ``rerun``: the
    command that evaluates again) and raised again. ``counterparts``: each BudgetMix policy's
    full-budget counterpart from the runs' settings (:attr:`FolderRun.counterparts`; None: from
    the policies' names, :mod:`agentrl_jax.evaluation.raw`)."""
    from agentrl_jax.evaluation.policies import PolicyLoadError, load_policy, same_tokenizer

    if not policies:
        raise EvalError("no policy to evaluate")
    analyses = tuple(analyses or default_analyses(config, bool(training_logs), len(policies)))
    supported = config.study.analyses_for(registry.names())
    for name in analyses:
        if name not in supported:
            raise EvalError(
                f"unknown or unsupported analysis {name!r}: the {config.task.env} study "
                f"supports {', '.join(supported)}"
                f"{did_you_mean(name, supported) if name not in registry.names() else ''}"
            )
        if registry.get(name).pairwise and len(policies) < 2:
            raise EvalError(f"{name} compares the base with other policies: name two")
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[config.model.dtype]
    # the tasks first (a EvalError for data that cannot be read), then the policies:
    # each problem is one line before the models load and before out is made
    tasks = make_tasks(config)
    try:
        try:
            loaded = {label: load_policy(path, dtype=dtype) for label, path in policies.items()}
        except PolicyLoadError as error:
            raise EvalError(str(error)) from None
        first, *others = loaded.values()
        for label, policy in loaded.items():
            if not same_tokenizer(first, policy):
                raise EvalError(
                    f"{label} uses another tokenizer than {next(iter(loaded))}; the policies "
                    "must share one to be compared on the same prompts"
                )
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        study, test = config.study, tasks.test
        described = study.describe(
            config.task.entry,
            config.task.options,
            t_max=config.task.t_max,
            train=tasks.train,
            test=test,
        )
        echo(f"Evaluating {', '.join(loaded)} on {described}")
        ev = config.eval
        echo(
            f"Settings: T_max {config.task.t_max}, {len(test.names)} test tasks; "
            f"{ev.samples} samples per task and budget, decoding temperature "
            f"{ev.sampling.temperature} top-p {ev.sampling.top_p}, lengths "
            f"{ev.max_response_tokens}/{ev.max_context} tokens; "
            f"analyses {', '.join(analyses)}"
        )
        PaperFigures(**study.paper_figures).write(out)
        states = study.state_diagnostics(test)
        models = {label: policy.model for label, policy in loaded.items()}
        finished: list[str] = []
        for name in analyses:
            echo(f"Analysis: {name}")
            try:
                run_analysis(
                    name,
                    out,
                    test.env,
                    np.arange(len(test.names)),
                    first.tokenizer,
                    models if registry.get(name).needs_models else dict.fromkeys(loaded),
                    ev,
                    engine=config.engine,
                    training_logs=training_logs,
                    min_turns=study.min_turns(test),
                    bound_note=study.bound_note_for(config.task.options),
                    states=states,
                    counterparts=counterparts,
                )
            except KeyboardInterrupt:  # Ctrl-C, or SIGTERM as the command line turns it
                kept = ", ".join(finished) if finished else "none"
                echo(
                    f"eval: interrupted during analysis {name}; saved in {out}: the files of "
                    f"the finished analyses ({kept}), no report; eval does not resume, so "
                    f"rerun to evaluate again{f': {rerun}' if rerun else ''}"
                )
                raise
            finished.append(name)
    finally:
        tasks.close()
    named = ", ".join(f"{label} = {path}" for label, path in policies.items())
    header = f"- Policies: {named}.\n- Tasks: {described}"
    return write_report(out, header_markdown=header, title=f"{config.task.entry.label} evaluation")
