"""Evaluation of several policies on an environment's test tasks, as the paper evaluates them
(PAPER.md §3, §7, §9).

The library counterpart of ``agentrl-jax eval`` (which compares two policies) for ``N``
named policies, the first being the base: the reproduction pipeline calls
:func:`run_analysis` once per analysis of :data:`ANALYSES`, then
:func:`agentrl_jax.reproduce.report.write_report`.

* ``table``: Pass@(k, T) at every budget (each sampled afresh with T in the prompt), the
  Pass@T figure with the structural bound, and Table 1 (25/50/75/100% of ``T_max``) with
  the RL - base and BudgetMix - full-budget differences.
* ``passk``: the Pass@K curve, k = 1..``pass_k_samples``, at ``T_max``.
* ``steps``: step quality on matched states and against depth (§7.1, §7.3), base vs each
  other policy; a pair's pool is half base-visited, half other-visited states.
* ``errors``: step quality at injected error states and continuation success (§7.2), pairwise,
  and the error-recovery suite's table of every policy
  (:mod:`~agentrl_jax.evaluation.analyses.error_recovery`).
  Both score states with what the environment's study supplies
  (:mod:`agentrl_jax.evaluation.state_diagnostics`: FrozenLake's Q*, DeepCoder-MT's test pass
  share), and name the quality, the injected error and the suite as it says.
* ``likelihood``: ActionNLL under the base model and the cumulative LLR (§7.4), pairwise.
* ``dynamics``: R_multi and R_single over training from each run's metrics log (§7.5).
* ``presentation``: Pass@(k, T) with the budget shown exactly, hidden and approximately
  (:mod:`~agentrl_jax.evaluation.analyses.presentation`).
* ``splice``: the base and each other policy handing episodes to each other part-way
  (:mod:`~agentrl_jax.evaluation.analyses.splice`).
* ``erosion``: the base's tokens under each run's snapshots, and step quality by state class
  from ``steps`` and ``errors`` (:mod:`~agentrl_jax.evaluation.analyses.erosion`).

Each analysis samples its data through the drivers ``agentrl-jax eval`` uses
(:mod:`agentrl_jax.evaluation.drivers`: same seed and settings, same samples), writes
``raw/<analysis>.json`` (everything needed to recompute its numbers: :mod:`.results`), its
CSVs and figures through the analysis' ``section`` (:mod:`agentrl_jax.evaluation.analyses`),
and its report sections to ``sections/<analysis>.json``.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence

import jax
import numpy as np
from flax import nnx

from agentrl_jax.evaluation import drivers, likelihood, passk
from agentrl_jax.evaluation import report as eval_report
from agentrl_jax.evaluation.analyses import (
    continuation,
    depth,
    dynamics,
    erosion,
    error_recovery,
    pass_at_k,
    pass_at_t,
    presentation,
    splice,
    step_quality,
)
from agentrl_jax.evaluation.analyses import likelihood as likelihood_analysis

# the settings and their work units, re-exported: the pipeline's whole interface is here
from agentrl_jax.evaluation.config import EvalConfig
from agentrl_jax.evaluation.drivers import rollout_units
from agentrl_jax.evaluation.report import Section
from agentrl_jax.models.qwen3 import Qwen3ForCausalLM
from agentrl_jax.reproduce import findings, report, results
from agentrl_jax.reproduce.report import write_report
from agentrl_jax.reproduce.results import ANALYSES, raw_path, slug, table1_from_results
from agentrl_jax.reproduce.studies.base import Study
from agentrl_jax.rollout import RolloutConfig
from agentrl_jax.sampling import Policy, SamplerPolicy
from agentrl_jax.sampling.config import EngineConfig

__all__ = [
    "ANALYSES",
    "EvalConfig",
    "analysis_units",
    "run_analysis",
    "table1_from_results",
    "write_report",
]  # the last two re-exported: the pipeline's whole interface is here

PAIRWISE = ("steps", "errors", "splice", "likelihood", "erosion")
# The order of a raw record's settings (raw/*.json).
RECORDED_SETTINGS = (
    "samples",
    "k",
    "budgets",
    "diagnostic_tasks",
    "pass_k_samples",
    "states",
    "group_size",
    "source_samples",
    "gamma",
    "invalid",
    "depth_bins",
    "likelihood_samples",
    "likelihood_rows_per_batch",
    "temperature",
    "top_p",
    "max_response_tokens",
    "max_context",
    "enable_thinking",
    "tasks_per_call",
    "states_per_call",
    "prefill_chunk",
    "kv_cache_dtype",
    "attention",
    "kv_page_size",
    "seed",
)


# ---------------------------------------------------------------- the evaluation context


def _is_policy(obj: Any) -> bool:
    return all(callable(getattr(obj, m, None)) for m in ("start", "respond", "extend"))


def _samplers(models: Mapping[str, Any], engine: EngineConfig) -> dict[str, Policy]:
    """A policy per name: a Qwen3 model is sampled by a :class:`SamplerPolicy` (models of one
    architecture share one's compiled functions, :meth:`SamplerPolicy.using`); a policy
    object (e.g. a :class:`~agentrl_jax.sampling.ScriptedPolicy`) is used as it is."""
    out: dict[str, Policy] = {}
    compiled: list[SamplerPolicy] = []
    for name, model in models.items():
        if not isinstance(model, Qwen3ForCausalLM):
            out[name] = model
            continue
        graph = nnx.graphdef(model)
        twin = next((s for s in compiled if nnx.graphdef(s.model) == graph), None)
        out[name] = (
            twin.using(nnx.state(model)) if twin else SamplerPolicy.from_engine(model, engine)
        )
        if twin is None:
            compiled.append(out[name])
    return out


@dataclasses.dataclass
class _Run:
    """Everything one analysis needs."""

    out: Path
    env: Any
    task_ids: np.ndarray
    tokenizer: Any
    models: Mapping[str, Any]
    settings: EvalConfig
    engine: EngineConfig
    progress: Callable[[int], None]
    min_turns: np.ndarray  # [tasks of env] fewest turns that can succeed (the structural bound)
    bound_note: str  # what that bound means in this environment
    states: Any = None  # the step diagnostics' states (evaluation.state_diagnostics)
    snapshots: Any = None  # runs' saved snapshots for erosion (Snapshots), None: none

    @property
    def names(self) -> list[str]:
        return list(self.models)

    @property
    def base(self) -> str:
        return self.names[0]

    @property
    def t_max(self) -> int:
        return self.env.t_max

    @functools.cached_property
    def policies(self) -> dict[str, Policy]:
        return _samplers(self.models, self.engine)

    @functools.cached_property
    def config(self) -> RolloutConfig:
        vocab = [
            m.config.vocab_size for m in self.models.values() if isinstance(m, Qwen3ForCausalLM)
        ]
        known = len(self.tokenizer)
        if vocab and known > min(vocab):
            raise ValueError(
                f"the tokenizer has {known} ids but a model's vocab_size is {min(vocab)}"
            )
        # Embedding rows past the tokenizer (Qwen3: 151,936 vs 151,669) are never sampled; with
        # several processes each plays its share of every rollout's rows.
        config = self.settings.rollout_config(known if vocab and known < min(vocab) else None)
        return dataclasses.replace(config, split_processes=True)

    @functools.cached_property
    def play(self) -> drivers.Play:
        return drivers.Play(
            self.env,
            self.tokenizer,
            self.task_ids,
            self.config,
            tasks_per_call=self.settings.tasks_per_call,
            states_per_call=self.settings.states_per_call,
            progress=self.progress,
        )

    def key(self, stream: str) -> jax.Array:
        return drivers.stream_key(self.settings.seed, stream)

    @property
    def pair(self) -> dict[str, Any]:
        """The settings every pairwise state analysis shares."""
        s = self.settings
        return {"group_size": s.group_size, "gamma": self.gamma, "invalid": s.invalid}

    @property
    def gamma(self) -> float | None:
        """The discount of the step quality the state diagnostics score with (FrozenLake's
        Q*: 0.95, §7), where they have one."""
        return getattr(self.states, "gamma", None)

    def header(self, analysis: str) -> dict[str, Any]:
        """The common fields of a raw record."""
        return {
            "analysis": analysis,
            "policies": self.names,
            "base": self.base,
            "counterparts": results.budgetmix_counterparts(self.names),
            "t_max": self.t_max,
            "task_ids": self.task_ids,
            "settings": self.recorded_settings,
        }

    @property
    def recorded_settings(self) -> dict[str, Any]:
        """What a raw record says the analysis ran with: the ``eval`` section, the step
        quality's discount and the sampling engine's cache, in the record's order
        (:data:`RECORDED_SETTINGS`; a field it does not name comes after)."""
        settings = dataclasses.asdict(self.settings)
        sampling = settings.pop("sampling")  # eval.sampling's, flat as records have them
        values = {
            **settings,
            "temperature": sampling["temperature"],
            "top_p": sampling["top_p"],
            **({"top_k": sampling["top_k"]} if sampling["top_k"] else {}),  # where it is on
            "gamma": self.gamma,
            "prefill_chunk": self.engine.prefill_chunk,
            "kv_cache_dtype": self.engine.kv_cache_dtype,
            "kv_page_size": self.engine.kv_page_size,
        }
        ordered = {name: values.pop(name) for name in RECORDED_SETTINGS if name in values}
        return {**ordered, **values}

    def write_raw(self, analysis: str, record: Mapping[str, Any]) -> str:
        path = eval_report.write_json(
            raw_path(self.out, analysis), {**self.header(analysis), **record}
        )
        return path.relative_to(self.out).as_posix()


def _with(
    section: Section, title: str | None = None, text: str = "", files: Sequence[str] = ()
) -> Section:
    """``section`` retitled, with the sentence ``text`` appended and more ``files``."""
    first = section.text if not text or section.text.endswith((".", ")")) else section.text + "."
    return dataclasses.replace(
        section,
        title=title or section.title,
        text=" ".join(t for t in (first, text) if t),
        files=section.files + tuple(files),
    )


# ---------------------------------------------------------------- Pass@T / Table 1 and Pass@K


def _table(run: _Run) -> list[Section]:
    s = run.settings
    budgets = s.table_budgets(run.t_max)
    counts = drivers.pass_at_t_counts(
        run.play, run.policies, run.key("passt"), budgets=budgets, samples=s.samples
    )
    shortest = np.asarray(run.min_turns)[run.task_ids]
    record = {
        "k": s.k,
        "samples": s.samples,
        "budgets": budgets,
        "levels": passk.budget_levels(run.t_max),
        "percents": passk.BUDGET_PERCENTS,
        "bound_note": run.bound_note,
        "shortest_paths": shortest,
        "counts": {
            p: {b: {"n": n, "c": c} for b, (n, c) in by_budget.items()}
            for p, by_budget in counts.items()
        },
    }
    raw = run.write_raw("table", record)
    curve, table = pass_at_t.section(
        run.out, pass_at_t.compute(counts, k=s.k, t_max=run.t_max, shortest_paths=shortest)
    )
    curve = _with(
        curve,
        f"Pass@T at k = {s.k}",
        f"{len(run.task_ids)} tasks x {s.samples} samples per budget. Dashed: the "
        f"structural bound, the share of tasks whose shortest path fits in T "
        f"({run.bound_note}).",
        (raw,),
    )
    saved = results.load_raw(run.out, "table")
    table = report.write_table1(run.out, saved, table)
    return [table, curve, report.write_robustness(run.out, saved)]


def _passk(run: _Run) -> list[Section]:
    s = run.settings
    counts = drivers.pass_at_k_counts(
        run.play, run.policies, run.key("passk"), samples=s.pass_k_samples
    )
    raw = run.write_raw(
        "passk",
        {
            "samples": s.pass_k_samples,
            "counts": {p: {"n": n, "c": c} for p, (n, c) in counts.items()},
        },
    )
    section = pass_at_k.section(
        run.out, pass_at_k.compute(counts, ks=range(1, s.pass_k_samples + 1))
    )
    return [
        _with(
            section,
            f"Pass@K at T_max = {run.t_max}",
            f"{len(run.task_ids)} tasks x {s.pass_k_samples} samples per policy.",
            (raw,),
        )
    ]


# ---------------------------------------------------------------- research instruments


def presentation_budgets(t_max: int) -> tuple[int, ...]:
    """The budgets the presentation analysis plays: 50% and 100% of ``T_max``."""
    levels = passk.budget_levels(t_max)
    return tuple(sorted({levels[1], levels[-1]}))


def _presentation(run: _Run) -> list[Section]:
    s = run.settings
    budgets = presentation_budgets(run.t_max)
    counts = drivers.presentation_counts(
        run.play,
        run.policies,
        run.key("presentation"),
        presentations=s.presentations,
        noise=s.presentation_noise,
        budgets=budgets,
        samples=s.samples,
    )
    raw = run.write_raw(
        "presentation",
        {
            "k": s.k,
            "samples": s.samples,
            "budgets": budgets,
            "noise": s.presentation_noise,
            "counts": {
                mode: {
                    p: {b: {"n": n, "c": c} for b, (n, c) in by_budget.items()}
                    for p, by_budget in by_policy.items()
                }
                for mode, by_policy in counts.items()
            },
        },
    )
    result = presentation.compute(
        results.presentation_counts(results.load_raw(run.out, "presentation")), s.k
    )
    section = presentation.section(
        run.out, result, tasks=len(run.task_ids), samples=s.samples, noise=s.presentation_noise
    )
    return [_with(section, files=(raw,))]


def _splice(run: _Run) -> list[Section]:
    s = run.settings
    pairs = [(a, b) for other in run.names[1:] for a, b in ((run.base, other), (other, run.base))]
    alone, spliced = drivers.splice_successes(
        run.play,
        run.policies,
        run.key("splice"),
        pairs=pairs,
        depths=s.splice_depths,
        samples=s.splice_samples,
    )
    turns = [drivers.switch_turn(d, run.t_max) for d in s.splice_depths]
    raw = run.write_raw(
        "splice",
        {
            "samples": s.splice_samples,
            "depths": s.splice_depths,
            "turns": turns,
            "alone": alone,
            "spliced": {
                label: {str(d): x for d, x in by_depth.items()}
                for label, by_depth in spliced.items()
            },
        },
    )
    result = splice.compute(*results.splice_successes(results.load_raw(run.out, "splice")))
    return [_with(splice.section(run.out, result), files=(raw,))]


class Snapshots(Protocol):
    """Where the erosion analysis finds an RL policy's snapshots over training: ``steps(policy)``
    the saved steps (ascending; [] for none) and ``load(policy, step)`` the model at one of
    them (loaded when scored, one at a time)."""

    def steps(self, policy: str) -> Sequence[int]: ...

    def load(self, policy: str, step: int) -> Any: ...


FINAL_STEP = -1
"""The step the erosion analysis gives a final policy whose run left no snapshots."""


def _state_qualities(run: _Run) -> erosion.StateErosion | None:
    """The state view of the erosion from the ``steps`` and ``errors`` raw records (None
    without ``steps``)."""
    steps, errors = results.load_raw(run.out, "steps"), results.load_raw(run.out, "errors")
    if steps is None:
        return None
    matched = {}
    for other, pair in steps["pairs"].items():
        turn = np.asarray(pair["states"]["turn"], np.int64)
        budget = np.asarray(pair["states"].get("budget", [run.t_max] * len(turn)), np.int64)
        q = pair["quality"]
        matched[other] = (np.asarray(q[steps["base"]]), np.asarray(q[other]), turn, budget)
    at_errors = {
        other: (np.asarray(pair["quality"][errors["base"]]), np.asarray(pair["quality"][other]))
        for other, pair in (errors or {"pairs": {}})["pairs"].items()
    }
    return erosion.compute_states(matched, at_errors)


def _erosion(run: _Run) -> list[Section]:
    s = run.settings
    not_models = [n for n, m in run.models.items() if not isinstance(m, Qwen3ForCausalLM)]
    if not_models:
        raise ValueError(f"erosion: needs a Qwen3 model for every policy; {not_models} are not")
    traj = drivers.likelihood_rollouts(
        run.play,
        {run.base: run.policies[run.base]},
        run.key("erosion"),
        samples=s.likelihood_samples,
        budget=run.t_max,
    )[run.base]
    scored = np.asarray(traj.loss_mask, bool) & np.asarray(traj.token_mask, bool)
    token_turn = np.asarray(traj.token_turn)
    pattern = getattr(run.states, "action_pattern", None)
    classes = erosion.token_classes(
        np.asarray(traj.tokens), scored, token_turn, run.tokenizer.decode, pattern
    )
    rows, cols = np.nonzero(scored)
    n = scored.shape[0]
    depth_of = erosion.depth_class(token_turn[rows, cols], np.asarray(traj.budget)[rows])
    sums = lambda x: erosion.class_sums(x[rows, cols], rows, classes[rows, cols], depth_of, n)  # noqa: E731
    score = functools.partial(
        likelihood.token_scores, trajectory=traj, rows_per_batch=s.likelihood_rows_per_batch
    )
    base_logp, base_entropy = score(run.models[run.base], attention=s.attention)
    entropy_sums, change_sums = {}, {}
    for other in run.names[1:]:
        steps = list(run.snapshots.steps(other)) if run.snapshots is not None else []
        entropy_sums[other] = {0: sums(base_entropy)}
        change_sums[other] = {0: sums(np.zeros_like(base_logp))}
        for step in steps or [FINAL_STEP]:
            model = run.models[other] if not steps else run.snapshots.load(other, step)
            logp, entropy_ = score(model, attention=s.attention)
            entropy_sums[other][int(step)] = sums(entropy_)
            change_sums[other][int(step)] = sums(logp - base_logp)
    run.progress(rollout_units(len(run.task_ids), s.likelihood_samples, run.t_max))
    raw = run.write_raw(
        "erosion",
        {
            "samples": s.likelihood_samples,
            "action_pattern": pattern,
            "counts": sums(np.ones_like(base_logp)),
            "entropy": entropy_sums,
            "logp_change": change_sums,
        },
    )
    saved = results.load_raw(run.out, "erosion")
    tokens = erosion.compute_tokens(*results.erosion_sums(saved))
    section = erosion.section(
        run.out,
        tokens,
        _state_qualities(run),
        quality=getattr(run.states, "quality_name", "step quality"),
        action_note=getattr(run.states, "action_note", "the span the action is read from"),
    )
    return [_with(section, files=(raw,))]


# ---------------------------------------------------------------- step diagnostics (§7.1-7.3)


def _visits(run: _Run) -> dict[str, Any]:
    """The states each policy's trajectories act from at ``T_max``."""
    return run.states.visits(
        run.play,
        run.policies,
        run.key("sources"),
        samples=run.settings.source_samples,
        budget=run.t_max,
    )


POOL_NOTE = (
    "The {states} error states come from this comparison's own pool (§7.1: states "
    "visited by {base} and by {other}, half each), so {base}'s rate differs from one "
    "comparison to the next: each is measured on its own states."
)


def _pool(run: _Run, visits: Mapping[str, Any], other: str) -> Any:
    """§7.1's matched pool of (base, other): half visited by each."""
    return run.states.matched(
        visits[run.base], visits[other], size=run.settings.states, seed=run.settings.seed
    )


def _wording(states: Any) -> dict[str, str]:
    """What the states' quality, errors and success are called (kept in the raw records, so
    the suite's table and the findings word them alike when recomputed)."""
    return {
        field: getattr(states, field)
        for field in ("quality_name", "quality_symbol", "error_note", "success_note", "suite")
    }


def _left_out(record: Mapping[str, Any], what: str) -> str:
    """A sentence on the states left out because their prompt does not fit the context."""
    kept = len(record["states"]["turn"])
    offered = record.get("offered", kept)
    return (
        f" {offered - kept} of the {offered} {what} were left out: their prompt (the "
        "history so far) does not fit eval.max_context."
        if offered > kept
        else ""
    )


def _steps(run: _Run) -> list[Section]:
    s, visits = run.settings, _visits(run)
    sections, pairs = [], {}
    for other in run.names[1:]:
        result, pairs[other] = run.states.steps(
            run.play,
            _pool(run, visits, other),
            run.policies[run.base],
            run.policies[other],
            run.key("steps"),
            names=(run.base, other),
            settings=s,
        )
        run.progress(2 * rollout_units(s.states, s.group_size, 1))
        name = slug(other)
        quality = step_quality.section(
            run.out,
            step_quality.compute(result.pools()),
            name=f"step_quality_{name}",
            policy_names=(run.base, other),
            title=f"Step-level {run.states.quality_name} on matched states: {other} vs {run.base}",
        )
        shares = ", ".join(f"{n} {100 * v:.1f}%" for n, v in result.invalid_share().items())
        sections.append(
            _with(
                quality,
                quality.title,
                f"Invalid responses ({run.states.invalid_note(s)}): {shares}."
                + _left_out(pairs[other], "states"),
            )
        )
        sections.append(
            _with(
                depth.section(
                    run.out,
                    depth.compute(
                        *depth.quality_by_depth(result, run.t_max),
                        bins=s.depth_bins,
                        seed=s.seed,
                    ),
                    name=f"quality_vs_depth_{name}",
                ),
                f"{run.states.quality_name.capitalize()} vs normalised depth: "
                f"{other} vs {run.base}",
            )
        )
    raw = run.write_raw(
        "steps", {"gamma": run.gamma, "invalid": s.invalid, **_wording(run.states), "pairs": pairs}
    )
    return [_with(sections[0], files=(raw,))] + sections[1:]


def _errors(run: _Run) -> list[Section]:
    s, visits = run.settings, _visits(run)
    sections, pairs = [], {}
    for other in run.names[1:]:
        result, pairs[other] = run.states.errors(
            run.play,
            _pool(run, visits, other),
            run.policies[run.base],
            run.policies[other],
            run.key("errors"),
            names=(run.base, other),
            settings=s,
        )
        count = len(result.errors.states)
        run.progress(2 * rollout_units(s.states, s.group_size, run.t_max))
        name = slug(other)
        quality = step_quality.section(
            run.out,
            step_quality.compute(result.quality.pools()),
            name=f"error_step_quality_{name}",
            policy_names=(run.base, other),
            title=f"Step-level {run.states.quality_name} at error states: {other} vs {run.base}",
        )
        sections.append(
            _with(
                quality,
                quality.title,
                f"{count} error states ({run.states.error_note})."
                + _left_out(pairs[other], "error states"),
            )
        )
        paired = result.paired_success().mean_diff
        rates = continuation.section(
            run.out,
            continuation.compute(result.success),
            name=f"continuation_{name}",
            title=f"Continuation success from error states: {other} vs {run.base}",
        )
        sections.append(
            _with(
                rates,
                rates.title,
                f"Paired per-state difference {other} - {run.base}: "
                f"{100 * paired.mean:+.1f} pt [{100 * paired.low:+.1f}, "
                f"{100 * paired.high:+.1f}]. "
                + POOL_NOTE.format(states=count, base=run.base, other=other),
            )
        )
    raw = run.write_raw(
        "errors", {"gamma": run.gamma, "invalid": s.invalid, **_wording(run.states), "pairs": pairs}
    )
    saved = results.load_raw(run.out, "errors")
    suite = error_recovery.section(run.out, error_recovery.compute(saved), saved)
    return [_with(sections[0], files=(raw,))] + sections[1:] + [suite]


# ---------------------------------------------------------------- likelihood (§7.4)


def _likelihood(run: _Run) -> list[Section]:
    s = run.settings
    not_models = [n for n, m in run.models.items() if not isinstance(m, Qwen3ForCausalLM)]
    if not_models:
        raise ValueError(
            f"likelihood: needs a Qwen3 model for every policy (teacher-forced "
            f"log-probs); {not_models} are not"
        )
    trajectories = drivers.likelihood_rollouts(
        run.play,
        run.policies,
        run.key("likelihood"),
        samples=s.likelihood_samples,
        budget=run.t_max,
    )
    sections, pairs = [], {}
    for other in run.names[1:]:
        data = likelihood.likelihood_data(
            run.models[run.base],
            run.models[other],
            {n: trajectories[n] for n in (run.base, other)},
            rows_per_batch=s.likelihood_rows_per_batch,
            attention=s.attention,
        )
        run.progress(2 * rollout_units(len(run.task_ids), s.likelihood_samples, run.t_max))
        section = likelihood_analysis.section(
            run.out,
            likelihood_analysis.compute(data.action_nll(), data.llr_sets()),
            name=f"likelihood_{slug(other)}",
        )
        sections.append(
            _with(
                section,
                f"Likelihood: {other} vs {run.base} (ActionNLL under {run.base}, cumulative LLR)",
            )
        )
        pairs[other] = {
            field: getattr(data, field)
            for field in ("logp_base", "logp_rl", "turn_mask", "action_valid", "success")
        }
    raw = run.write_raw("likelihood", {"pairs": pairs})
    return [_with(sections[0], files=(raw,))] + sections[1:]


# ---------------------------------------------------------------- training dynamics (§7.5)


def _dynamics(run: _Run, training_logs: Mapping[str, Path]) -> list[Section]:
    if not training_logs:
        raise ValueError("dynamics: needs training_logs ({run name: metrics.jsonl})")
    runs, sections = {}, []
    for name, log in training_logs.items():
        if not Path(log).is_file():
            raise ValueError(f"dynamics: the metrics log of run {name!r}, {log}, is not a file")
        curves = dynamics.from_log(log, run=name)
        sections.append(dynamics.section(run.out, curves, name=f"training_dynamics_{slug(name)}"))
        runs[name] = {
            "log": curves.log,
            "step": curves.step,
            "series": curves.series,
            "change": curves.change,
        }
    record = {
        "analysis": "dynamics",
        "runs": runs,
        "counterparts": results.budgetmix_counterparts(list(training_logs)),
    }
    path = eval_report.write_json(raw_path(run.out, "dynamics"), record)
    run.progress(1)
    figures = findings.PaperFigures.load(run.out)
    summary = Section(
        "Training dynamics: start to end",
        "Change of each curve from the mean of its first w logged steps to the mean "
        "of its last w (w: a tenth of the steps, at least 2 from 4 steps on), with a "
        "95% normal CI treating the steps as independent. Paper: full-budget RL "
        f"{figures.text(findings.FULL_BUDGET_DYNAMICS)}; BudgetMix "
        f"{figures.text(findings.BUDGETMIX_DYNAMICS)}.",
        files=(path.relative_to(run.out).as_posix(),),
        markdown=report.dynamics_markdown(results.load_raw(path, "dynamics")),
    )
    return [summary] + sections


# ---------------------------------------------------------------- entry point


def _check_models(models: Mapping[str, Any], name: str) -> None:
    if not isinstance(models, Mapping) or not models:
        raise ValueError("models: must be a non-empty mapping {policy name: model}")
    slugs: dict[str, str] = {}
    for policy, model in models.items():
        if not isinstance(policy, str):
            raise ValueError(f"models: policy names must be strings, got {policy!r}")
        if model is None and name == "dynamics":  # the logs are all it reads
            continue
        if not (isinstance(model, Qwen3ForCausalLM) or _is_policy(model)):
            raise ValueError(
                f"models[{policy!r}]: must be a Qwen3ForCausalLM or a Policy, "
                f"got {type(model).__name__}"
            )
        other = slugs.setdefault(slug(policy), policy)
        if other != policy:
            raise ValueError(f"models: {other!r} and {policy!r} would share file names")
    if name in PAIRWISE and len(models) < 2:
        raise ValueError(f"{name}: compares the base with other policies; got only {list(models)}")


def run_analysis(
    name: str,
    out: str | Path,
    env: Any,
    task_ids: np.ndarray,
    tokenizer: Any,
    models: Mapping[str, Any],
    settings: EvalConfig,
    *,
    engine: EngineConfig | None = None,
    training_logs: Mapping[str, str | Path] | None = None,
    progress: Callable[[int], None] | None = None,
    min_turns: Any = None,
    bound_note: str | None = None,
    states: Any = None,
    snapshots: Snapshots | None = None,
) -> list[Section]:
    """Run one analysis of :data:`ANALYSES` and write its files under ``out``.

    Args:
      name: the analysis.
      out: the results folder.
      env: the evaluation environment (its ``t_max`` the full budget).
      task_ids: ``[tasks]`` indices of the tasks to evaluate on (analyses other than ``table``
        take the first ``settings.diagnostic_tasks`` of them, :meth:`EvalConfig.analysis_tasks`).
      tokenizer: the policies' common tokenizer (with a chat template).
      models: ``{policy name: model}`` in report order, the first the base policy. A value is
        a :class:`Qwen3ForCausalLM` or any :class:`~agentrl_jax.sampling.Policy` (e.g. a
        scripted one; not for ``likelihood``, which scores responses with the models).
      settings: :class:`EvalConfig`.
      engine: the sampling engine (:class:`~agentrl_jax.sampling.config.EngineConfig`, the
        config's ``engine`` section; default: its defaults).
      training_logs: ``{run name: metrics.jsonl}`` (records with ``step``, ``R_multi``,
        ``R_single``), only for ``dynamics``.
      progress: called with a number of finished work units as rollouts finish; the calls
        add up to :func:`analysis_units`.
      min_turns: ``[tasks of env]`` fewest turns each task needs (the structural bound;
        default: the env's ``structural_bounds``, else 1 turn); ``bound_note`` says what
        that bound means there (the study's
        :meth:`~agentrl_jax.reproduce.studies.Study.bound_note_for`).
      states: what ``steps`` and ``errors`` score states with, required by those two
        (:mod:`agentrl_jax.evaluation.state_diagnostics`; the environment study's
        :meth:`~agentrl_jax.reproduce.studies.Study.state_diagnostics`).
      snapshots: the RL policies' saved snapshots over training, for ``erosion``
        (:class:`Snapshots`; None: the base and the final policies only).

    Returns:
      The analysis' report sections (also saved to ``out/sections/<name>.json``).
    """
    results.check_analysis(name)
    if not isinstance(settings, EvalConfig):
        raise ValueError(f"settings: must be an EvalConfig, got {type(settings).__name__}")
    _check_models(models, name)
    task_ids = np.asarray(settings.analysis_tasks(name, np.asarray(task_ids)))
    if min_turns is None and env is not None:
        every = np.arange(env.num_tasks())
        bounds = getattr(env, "structural_bounds", None)
        min_turns = bounds(every) if callable(bounds) else np.ones(len(every), np.int64)
    if bound_note is None:
        bound_note = Study().bound_note_for({})
    if name in ("steps", "errors") and states is None:
        raise ValueError(
            f"{name}: needs the states to score (`states`, from the environment's study: "
            "Study.state_diagnostics)"
        )
    run = _Run(
        Path(out),
        env,
        task_ids,
        tokenizer,
        models,
        settings,
        engine or EngineConfig(),
        progress or (lambda units: None),
        np.asarray(min_turns),
        bound_note,
        states,
        snapshots,
    )
    if name == "dynamics":
        sections = _dynamics(run, dict(training_logs or {}))
    else:
        sections = {
            "table": _table,
            "presentation": _presentation,
            "splice": _splice,
            "erosion": _erosion,
            "passk": _passk,
            "steps": _steps,
            "errors": _errors,
            "likelihood": _likelihood,
        }[name](run)
    report.write_sections(run.out, name, sections)
    return sections


# ---------------------------------------------------------------- work units (progress)


def _policy_count(policies: int | Sequence[str]) -> int:
    return policies if isinstance(policies, numbers.Integral) else len(policies)


def analysis_units(
    name: str, settings: EvalConfig, num_tasks: int, policies: int | Sequence[str], t_max: int
) -> int:
    """Work units of one analysis for a progress bar: trajectory-turns it may play (and, for
    ``likelihood``, score), ``1`` for ``dynamics``. :func:`run_analysis` reports exactly this
    many through ``progress``, in steps as its rollouts finish."""
    p, s = _policy_count(policies), settings
    num_tasks = len(s.analysis_tasks(name, range(num_tasks)))
    sources = p * rollout_units(num_tasks, s.source_samples, t_max)
    pairs = p - 1
    units = {
        "table": lambda: (
            p * sum(rollout_units(num_tasks, s.samples, b) for b in s.table_budgets(t_max))
        ),
        "passk": lambda: p * rollout_units(num_tasks, s.pass_k_samples, t_max),
        "presentation": lambda: (
            p
            * len(s.presentations)
            * sum(rollout_units(num_tasks, s.samples, b) for b in presentation_budgets(t_max))
        ),
        "splice": lambda: (
            (p + pairs * 2 * len(s.splice_depths))
            * rollout_units(num_tasks, s.splice_samples, t_max)
        ),
        "erosion": lambda: rollout_units(num_tasks, s.likelihood_samples, t_max),
        "steps": lambda: sources + pairs * 2 * rollout_units(s.states, s.group_size, 1),
        "errors": lambda: sources + pairs * 2 * rollout_units(s.states, s.group_size, t_max),
        "likelihood": lambda: (
            (p + pairs * 2) * rollout_units(num_tasks, s.likelihood_samples, t_max)
        ),
        "dynamics": lambda: 1,
    }
    return units[results.check_analysis(name)]()
