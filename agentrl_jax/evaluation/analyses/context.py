"""What every analysis runs in: one run's policies, environment, tasks and settings
(:class:`AnalysisRun`), and :func:`run_analysis`, which runs one registered analysis
(:mod:`.registry`) on ``N`` named policies, the first being the base (PAPER.md §3, §7, §9).

``agentrl-jax eval`` (:mod:`agentrl_jax.evaluation.evaluate_policies`) and the reproduction
(:mod:`agentrl_jax.reproduce.pipeline`) both call :func:`run_analysis` once per analysis, in
the registry's order, then write the report
(:func:`agentrl_jax.evaluation.full_report.write_report`).

Each analysis samples its data through the drivers (:mod:`agentrl_jax.evaluation.drivers`:
same seed and settings, same samples), writes ``raw/<analysis>.json`` (everything needed to
recompute its numbers: :mod:`agentrl_jax.evaluation.raw`), its CSVs and figures through its
module's ``section``, and its report sections to ``sections/<analysis>.json``.
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

from agentrl_jax.evaluation import drivers
from agentrl_jax.evaluation import report as eval_report
from agentrl_jax.evaluation.analyses import registry
from agentrl_jax.evaluation.config import EvalConfig
from agentrl_jax.evaluation.raw import budgetmix_counterparts, raw_path, slug
from agentrl_jax.evaluation.report import Section
from agentrl_jax.models.qwen3 import Qwen3ForCausalLM
from agentrl_jax.rollout import RolloutConfig
from agentrl_jax.sampling import Policy, SamplerPolicy
from agentrl_jax.sampling.config import EngineConfig

DEFAULT_BOUND_NOTE = "a necessary condition: a task cannot succeed in fewer turns"
"""What the Pass@T figure's dashed bound means where the caller says nothing else."""

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


class Snapshots(Protocol):
    """Where the erosion analysis finds an RL policy's snapshots over training: ``steps(policy)``
    the saved steps (ascending; [] for none) and ``load(policy, step)`` the model at one of
    them (loaded when scored, one at a time)."""

    def steps(self, policy: str) -> Sequence[int]: ...

    def load(self, policy: str, step: int) -> Any: ...


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
class AnalysisRun:
    """Everything one analysis needs (the arguments of :func:`run_analysis`)."""

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
    training_logs: Mapping[str, Path] = dataclasses.field(default_factory=dict)
    # {BudgetMix policy: its full-budget counterpart} from the runs' settings; None: the
    # policies' names say it (evaluation.raw)
    counterparts: Mapping[str, str] | None = None

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

    def models_only(self, analysis: str, what: str = "") -> None:
        """A ValueError unless every policy is a Qwen3 model (``what``: why it needs them)."""
        not_models = [n for n, m in self.models.items() if not isinstance(m, Qwen3ForCausalLM)]
        if not_models:
            raise ValueError(
                f"{analysis}: needs a Qwen3 model for every policy{what}; {not_models} are not"
            )

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
            "counterparts": self.counterparts_among(self.names),
            "t_max": self.t_max,
            "task_ids": self.task_ids,
            "settings": self.recorded_settings,
        }

    def counterparts_among(self, names: Sequence[str]) -> dict[str, str]:
        """``{BudgetMix policy: counterpart}`` of ``names``, both among them: from the runs'
        settings where the caller gave them, else from the names (:mod:`evaluation.raw`)."""
        if self.counterparts is None:
            return budgetmix_counterparts(names)
        return {m: f for m, f in self.counterparts.items() if m in names and f in names}

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
        """``raw/<analysis>.json``: the header and ``record``; its path under ``out``."""
        path = eval_report.write_json(
            raw_path(self.out, analysis), {**self.header(analysis), **record}
        )
        return path.relative_to(self.out).as_posix()


def with_(
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


# ---------------------------------------------------------------- entry point


def _check_models(models: Mapping[str, Any], analysis: registry.Analysis) -> None:
    name = analysis.name
    if not isinstance(models, Mapping) or not models:
        raise ValueError("models: must be a non-empty mapping {policy name: model}")
    slugs: dict[str, str] = {}
    for policy, model in models.items():
        if not isinstance(policy, str):
            raise ValueError(f"models: policy names must be strings, got {policy!r}")
        if model is None and not analysis.needs_models:  # what was saved is all it reads
            continue
        if not (isinstance(model, Qwen3ForCausalLM) or _is_policy(model)):
            raise ValueError(
                f"models[{policy!r}]: must be a Qwen3ForCausalLM or a Policy, "
                f"got {type(model).__name__}"
            )
        other = slugs.setdefault(slug(policy), policy)
        if other != policy:
            raise ValueError(f"models: {other!r} and {policy!r} would share file names")
    if analysis.pairwise and len(models) < 2:
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
    counterparts: Mapping[str, str] | None = None,
) -> list[Section]:
    """Run one registered analysis (:mod:`.registry`) and write its files under ``out``.

    Args:
      name: the analysis.
      out: the results folder.
      env: the evaluation environment (its ``t_max`` the full budget).
      task_ids: ``[tasks]`` indices of the tasks to evaluate on (the analysis plays those of
        :meth:`~.registry.Analysis.tasks`: ``table`` all of them, most the first
        ``settings.diagnostic_tasks``).
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
        that bound means there (the study's ``bound_note_for``; default
        :data:`DEFAULT_BOUND_NOTE`).
      states: what ``steps`` and ``errors`` score states with, required by those two
        (:mod:`agentrl_jax.evaluation.state_diagnostics`; the environment study's
        ``state_diagnostics``).
      snapshots: the RL policies' saved snapshots over training, for ``erosion``
        (:class:`Snapshots`; None: the base and the final policies only).
      counterparts: ``{BudgetMix policy: its full-budget counterpart}`` from the runs'
        settings (:func:`agentrl_jax.evaluation.raw.counterparts_of_runs`); None: from the
        policies' names.

    Returns:
      The analysis' report sections (also saved to ``out/sections/<name>.json``).
    """
    analysis = registry.get(name)
    if not isinstance(settings, EvalConfig):
        raise ValueError(f"settings: must be an EvalConfig, got {type(settings).__name__}")
    _check_models(models, analysis)
    task_ids = np.asarray(analysis.tasks(settings, np.asarray(task_ids)))
    if min_turns is None and env is not None:
        every = np.arange(env.num_tasks())
        bounds = getattr(env, "structural_bounds", None)
        min_turns = bounds(every) if callable(bounds) else np.ones(len(every), np.int64)
    run = AnalysisRun(
        Path(out),
        env,
        task_ids,
        tokenizer,
        models,
        settings,
        engine or EngineConfig(),
        progress or (lambda units: None),
        np.asarray(min_turns),
        DEFAULT_BOUND_NOTE if bound_note is None else bound_note,
        states,
        snapshots,
        dict(training_logs or {}),
        None if counterparts is None else dict(counterparts),
    )
    sections = analysis.run(run)
    eval_report.write_sections(run.out, name, sections)
    return sections


# ---------------------------------------------------------------- work units (progress)


def analysis_units(
    name: str, settings: EvalConfig, num_tasks: int, policies: int | Sequence[str], t_max: int
) -> int:
    """Work units of one analysis for a progress bar (:meth:`~.registry.Analysis.units`:
    trajectory-turns it may play, and score, ``1`` for ``dynamics``). :func:`run_analysis`
    reports exactly this many through ``progress``, in steps as its rollouts finish."""
    analysis = registry.get(name)
    count = policies if isinstance(policies, numbers.Integral) else len(policies)
    tasks = len(analysis.tasks(settings, range(num_tasks)))
    return analysis.units(settings, tasks, count, t_max)
