"""Evaluating given policies on any registered environment: the reproduction's analyses
(:func:`~agentrl_jax.reproduce.evaluate.run_analysis`) and report, for policies named by
directory, under one config. ``agentrl-jax eval`` is its command line.

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
from typing import Callable, Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from agentrl_jax.errors import did_you_mean
from agentrl_jax.reproduce import evaluate, findings
from agentrl_jax.reproduce.config import ReproduceConfig
from agentrl_jax.reproduce.folder import ReproduceError
from agentrl_jax.reproduce.report import write_report

BASE = "base"


@dataclasses.dataclass(frozen=True)
class FolderRun:
    """What a results folder holds: its config, its policies ``{label: directory}`` (the
    base first) and its runs' metrics ``{label: metrics.jsonl}``."""

    config: ReproduceConfig
    policies: dict[str, Path]
    logs: dict[str, Path]


def folder_run(folder: str | Path, overrides: Sequence[str] = ()) -> FolderRun:
    """The run in ``folder`` (its ``config.yaml`` with ``overrides``, its models and metrics);
    a :class:`ReproduceError` says what is missing."""
    from agentrl_jax.reproduce.config import load_config  # noqa: PLC0415

    folder = Path(folder)
    saved = folder / "config.yaml"
    if not folder.is_dir():
        raise ReproduceError(
            f"{folder}: {'is a file, not' if folder.exists() else 'does not exist, so not'} a "
            "results folder of agentrl-jax reproduce or train"
        )
    if not saved.is_file():
        raise ReproduceError(
            f"{folder}: no config.yaml, so not a results folder of agentrl-jax reproduce or "
            "train; name the policies (--policy LABEL=DIR) and the config (--config, --env)"
        )
    config = load_config(saved, overrides)
    if config.model.model_dir is not None and not config.warm_start.enabled:
        base = Path(config.model.model_dir)
    else:
        base = folder / "models" / (BASE if config.warm_start.enabled else "init")
    policies, logs = {BASE: base}, {}
    for run in config.rl.resolved_runs():
        model = folder / "models" / run.name
        if (model / "config.json").is_file():
            policies[run.label] = model
            logs[run.label] = folder / "runs" / run.name / "metrics.jsonl"
    if not (base / "config.json").is_file():
        raise ReproduceError(f"{folder}: the base policy {base} is not there (yet)")
    return FolderRun(config, policies, logs)


def default_analyses(
    config: ReproduceConfig, with_logs: bool, policies: int = 2
) -> tuple[str, ...]:
    """The analyses the environment's study supports: the training dynamics where there are
    runs' metrics to read, the pairwise ones (base against the others) given two policies."""
    names = config.study.analyses_for(evaluate.ANALYSES)
    return tuple(
        n
        for n in names
        if (with_logs or n != "dynamics") and (policies >= 2 or n not in evaluate.PAIRWISE)
    )


def evaluate_policies(
    config: ReproduceConfig,
    policies: Mapping[str, str | Path],
    out: str | Path,
    *,
    analyses: Sequence[str] | None = None,
    training_logs: Mapping[str, str | Path] | None = None,
    echo: Callable[[str], None] = print,
    rerun: str | None = None,
) -> Path:
    """Run ``analyses`` (default: :func:`default_analyses`) of ``policies`` (``{label:
    directory}``, the base first) on the environment of ``config`` into ``out`` and write its
    report; returns the report's path. Pairwise analyses need two policies or more. An
    interrupt (KeyboardInterrupt) is said in one line (where, what is saved, ``rerun``: the
    command that evaluates again) and raised again."""
    from agentrl_jax.evaluation.policies import PolicyLoadError, load_policy, same_tokenizer
    from agentrl_jax.reproduce.pipeline import make_tasks

    if not policies:
        raise ReproduceError("no policy to evaluate")
    analyses = tuple(analyses or default_analyses(config, bool(training_logs), len(policies)))
    supported = config.study.analyses_for(evaluate.ANALYSES)
    for name in analyses:
        if name not in supported:
            raise ReproduceError(
                f"unknown or unsupported analysis {name!r}: the {config.task.env} study "
                f"supports {', '.join(supported)}"
                f"{did_you_mean(name, supported) if name not in evaluate.ANALYSES else ''}"
            )
        if name in evaluate.PAIRWISE and len(policies) < 2:
            raise ReproduceError(f"{name} compares the base with other policies: name two")
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[config.model.dtype]
    # the tasks first (a ReproduceError for data that cannot be read), then the policies:
    # each problem is one line before the models load and before out is made
    tasks = make_tasks(config)
    try:
        try:
            loaded = {label: load_policy(path, dtype=dtype) for label, path in policies.items()}
        except PolicyLoadError as error:
            raise ReproduceError(str(error)) from None
        first, *others = loaded.values()
        for label, policy in loaded.items():
            if not same_tokenizer(first, policy):
                raise ReproduceError(
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
        findings.PaperFigures(**study.paper_figures).write(out)
        states = study.state_diagnostics(test)
        models = {label: policy.model for label, policy in loaded.items()}
        finished: list[str] = []
        for name in analyses:
            echo(f"Analysis: {name}")
            try:
                evaluate.run_analysis(
                    name,
                    out,
                    test.env,
                    np.arange(len(test.names)),
                    first.tokenizer,
                    models if name != "dynamics" else dict.fromkeys(loaded),
                    ev,
                    engine=config.engine,
                    training_logs=training_logs,
                    min_turns=study.min_turns(test),
                    bound_note=study.bound_note_for(config.task.options),
                    states=states,
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
