"""What ``agentrl-jax reproduce ENV`` needs from an environment beyond the rollout: a
:class:`Study`.

Every registered environment (:func:`envs.register`) has one
(:func:`~agentrl_jax.reproduce.studies.study_for`): the generic one here works for any
environment, and an environment's own subclass, registered under its name
(:func:`~agentrl_jax.reproduce.studies.register_study`), adds what it knows:

* **tasks** (:meth:`Study.tasks`): the factory called with the config's ``task.options``
  plus ``split`` (``"train"`` / ``"test"``), ``seed``, ``limit`` and ``t_max`` where it takes
  them (:func:`envs.task_set`). An environment whose factory takes no ``split`` trains and
  evaluates on the same tasks, and the report says so (:meth:`Study.describe`).
* **demonstrations** for a random-init policy (:meth:`Study.demonstrator`): a
  :class:`GoldDemonstrator` plays each task's gold plan (:meth:`Study.plan`, the replies of
  one successful episode; by default the environment's own ``demonstration(task_id)``) and
  with probability ``mistake_rate`` another task's reply of the same step instead. It is
  budget-aware: with fewer turns left than plan steps it skips to the last steps.
* **a tokenizer corpus** (:meth:`Study.corpus`): the instructions at every budget, each
  task's first observation and its gold replies.
* **a step scorer** for R_single (:meth:`Study.step_scorer`): where the study declares
  ``records_quality``, the step quality the rollout recorded (``TurnResult.quality``, e.g.
  DeepCoder-MT's test pass share; NaN steps are not scored); otherwise none, and no R_single
  is logged.
* **analyses** (:attr:`Study.analyses`): those that need no oracle (Table 1 / Pass@T,
  Pass@K, likelihood, training dynamics). A study that can score states
  (:meth:`Study.state_diagnostics`) adds the step quality and error-state analyses:
  FrozenLake's with Q* (:mod:`agentrl_jax.reproduce.studies.frozenlake`), DeepCoder-MT's
  with the test pass share and mutated reference programs as errors
  (:mod:`agentrl_jax.reproduce.studies.code`).

Nothing here is keyed on an environment's name: the pipeline asks the environment's study.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Sequence

import numpy as np

from agentrl_jax.evaluation.analyses.context import DEFAULT_BOUND_NOTE
from envs.protocol import EnvEntry, EnvTasks
from envs.registry import task_set

# The analyses every environment supports (they need the rollout and the models only).
GENERIC_ANALYSES = ("table", "passk", "likelihood", "dynamics")
# ... and with the step diagnostics, for a study that scores states (Study.state_diagnostics),
# the erosion localisation, which reads them, and the research instruments beside them
# (budget presentation, splice), which any environment could run but which the studies
# with a step score carry: the built-in analyses (agentrl_jax.evaluation.analyses), in report
# order. An analysis a plugin registers is not among them: every study runs it.
ALL_ANALYSES = (
    "table",
    "presentation",
    "passk",
    "steps",
    "errors",
    "splice",
    "likelihood",
    "erosion",
    "dynamics",
)

_ASSISTANT = re.compile(r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>", re.S)
_REMAINING = re.compile(r"\[REMAINING TURNS\] (\d+)\n")


class StudyError(ValueError):
    """An environment cannot do what the study asks (e.g. no gold answers for demonstrations)."""


def inner_env(env: Any) -> Any:
    """The per-row environment behind a :class:`~envs.protocol.PythonTextEnv` (else ``env``)."""
    return getattr(env, "env", env)


def first_observations(env: Any, task_ids: Sequence[int]) -> list[str]:
    """Each task's first observation, read by resetting it (a Python environment's rows are
    closed again)."""
    inner = inner_env(env)
    if callable(getattr(inner, "reset_task", None)):
        shown = []
        for t in task_ids:
            state, observation = inner.reset_task(int(t), 0)
            inner.close_task(state)
            shown.append(observation)
        return shown
    return list(env.reset(np.asarray(task_ids, np.int64), 0)[1])


class GoldDemonstrator:
    """A :data:`~agentrl_jax.sampling.policy.Script` playing gold plans with mistakes.

    plans: ``{first observation: [reply, ...]}``, the replies of one successful episode of
      each task (the context's first user message names the task).
    mistake_rate: probability that a turn plays another task's reply of the same step (or
      last step) instead; the plan does not advance on a mistake.

    Stateless across calls: the plan step is recovered from the context (the replies so far
    that followed the plan in order), and the remaining budget from its last turn header.
    """

    def __init__(self, plans: Mapping[str, Sequence[str]], *, mistake_rate: float, seed: int = 0):
        if not 0.0 <= mistake_rate <= 1.0:
            raise ValueError(f"mistake_rate must be in [0, 1], got {mistake_rate!r}")
        if not plans or any(len(p) == 0 for p in plans.values()):
            raise StudyError("GoldDemonstrator: every task needs a plan of at least one reply")
        self.plans = {k: tuple(v) for k, v in plans.items()}
        self._keys = sorted(self.plans, key=len, reverse=True)  # longest first: no prefix clash
        self.mistake_rate = mistake_rate
        self.rng = np.random.default_rng(seed)
        self.moves = 0
        self.mistakes = 0

    def _plan(self, context: str) -> tuple[str, ...]:
        for key in self._keys:
            if key in context:
                return self.plans[key]
        raise StudyError("GoldDemonstrator: the context shows no task it has a plan for")

    def reply(self, context: str) -> str:
        plan = self._plan(context)
        done = 0
        for previous in _ASSISTANT.findall(context):
            previous = previous.rsplit("</think>", 1)[
                -1
            ].strip()  # after a chat template's think block
            if done < len(plan) and previous == plan[done]:
                done += 1
        remaining = _REMAINING.findall(context)
        left = int(remaining[-1]) if remaining else len(plan)
        step = min(max(done, len(plan) - left), len(plan) - 1)
        self.moves += 1
        if self.rng.random() < self.mistake_rate:
            others = [p for p in self.plans.values() if p is not plan]
            if others:
                other = others[self.rng.integers(len(others))]
                wrong = other[min(step, len(other) - 1)]
                if wrong != plan[step]:
                    self.mistakes += 1
                    return wrong
        return plan[step]

    def __call__(self, contexts: Sequence[str], live: np.ndarray) -> list[str]:
        return [self.reply(c) if on else "" for c, on in zip(contexts, live)]


@dataclasses.dataclass(frozen=True)
class RecordedQuality:
    """R_single from the step quality the rollout recorded (``Trajectory.step_quality``):
    a :class:`~agentrl_jax.trajectory.StepScorer` that scores the turns with a finite
    value."""

    def __call__(self, trajectory: Any, tasks: Any = None):
        """The scores on the host (NumPy), from the host's copy of the batch."""
        from agentrl_jax.trajectory import StepScores, scored_turns

        quality = np.asarray(trajectory.step_quality, np.float32)
        mask = np.isfinite(quality) & np.asarray(scored_turns(trajectory))
        invalid = ~np.asarray(trajectory.action_valid, bool) & mask
        return StepScores(np.where(mask, quality, np.float32(0.0)), mask, invalid)


# What every environment's CPU default starts from: a random-init Qwen3 of ~0.2M parameters
# warm-started on a CPU (:attr:`Study.config_defaults`; an environment's study adds its own
# with :func:`cpu_defaults`). The classes' own defaults are the paper's (Qwen3-4B/8B): these
# raise the learning rate for a tiny model and keep its answer format with a larger KL
# (notebooks/rl_sweep.md).
CPU_DEFAULTS: Mapping[str, Mapping[str, Any]] = {
    "rl": {
        # the paper's two, the adaptive variant, and BudgetMix with the budget's presentation
        # randomised per group (exact, hidden, approximate): the budget-presentation study
        "runs": ["grpo", "budgetmix", "budgetmix-adaptive", "budgetmix-presentation"],
        "steps": 40,
        "group_size": 8,
        # paper: 1e-6 (Qwen3-4B/8B); 2e-3 breaks the tiny default
        "optimizer": {"learning_rate": 1e-3},
        # the warm start's and the updates': faster than xla here
        "memory": {"attention": "blocked"},
        # steps 10, 20, 30, 40: the erosion analysis' snapshots
        "checkpoint": {"keep": 4},
        "preset_params": {
            "kl_coef": 0.05,  # paper: 0.001; 0.05 keeps the tiny policy's answer format
            # GRPO's own per-sequence mean (DeepSeekMath); with token-mean, failed episodes
            # (longer) outweigh successes and push every sampled token down
            "aggregation": "seq-mean-token-mean",
        },
    },
}


def cpu_defaults(own: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """An environment's CPU default: :data:`CPU_DEFAULTS` with ``own`` over it, section by
    section and field by field (a mapping field key by key)."""
    out = {name: dict(fields) for name, fields in CPU_DEFAULTS.items()}
    for name, fields in own.items():
        section = out.setdefault(name, {})
        for field, value in fields.items():
            below = section.get(field)
            both = isinstance(value, Mapping) and isinstance(below, Mapping)
            section[field] = {**below, **value} if both else value
    return out


class Study:
    """The default study of a registered environment (module docstring). Subclass it and
    register an instance under the environment's name
    (:func:`~agentrl_jax.reproduce.studies.register_study`) to add what an environment knows."""

    analyses: tuple[str, ...] = GENERIC_ANALYSES
    # `agentrl-jax reproduce ENV`'s defaults under --config and --set, {section: {field:
    # value}}: the one place an environment's defaults live (a CPU-sized study; FrozenLake's
    # are CPU_DEFAULTS with the classes' own, another environment's add its T_max, context
    # sizes and sample sizes: cpu_defaults)
    config_defaults: Mapping[str, Mapping[str, Any]] = CPU_DEFAULTS
    # what the warm start's demonstrations are, for the report
    demonstrations: str = "gold-answer demonstrations"
    # whether the environment records a step quality (TurnResult.quality) for R_single
    records_quality: bool = False
    # what the paper reports on this environment, for the findings (fields of
    # agentrl_jax.evaluation.verdicts.PaperFigures: texts {headline key: text}, effect sizes);
    # {}: the paper's headline figures
    paper_figures: Mapping[str, Any] = {}
    # a regular expression whose matches the small tokenizer keeps as pre-tokens of their own
    # (model.tokenizer_isolate; build_small_tokenizer's `isolate`); None: nothing to isolate
    tokenizer_isolate: str | None = None

    # -- tasks
    def tasks(self, task: Any, *, split: str, count: int) -> EnvTasks:
        """The ``split`` tasks (at most ``count``) of the config's task section ``task``
        (:func:`envs.task_set`: its environment, options, seed and ``t_max``, the rollout's
        full budget and BudgetMix's largest)."""
        return task_set(task, split=split, count=count)

    def has_split(self, entry: EnvEntry) -> bool:
        """Whether the train and test tasks are disjoint (the factory takes ``split``)."""
        return "split" in entry.options

    def min_turns(self, tasks: EnvTasks) -> np.ndarray:
        """``int[tasks]`` fewest turns that can succeed: the environment's, else 1 (no bound)."""
        if tasks.min_turns is not None:
            return np.asarray(tasks.min_turns, np.int64)
        return np.ones(len(tasks.names), np.int64)

    def describe(
        self,
        entry: EnvEntry,
        options: Mapping[str, Any],
        *,
        t_max: int,
        train: EnvTasks,
        test: EnvTasks,
    ) -> str:
        """One line for the report: the tasks and how they split."""
        shown = ", ".join(f"{k}={v!r}" for k, v in options.items())
        split = (
            "disjoint splits"
            if self.has_split(entry)
            else "the same tasks: the environment has no split, so this is not held-out"
        )
        return (
            f"{entry.label}{f' ({shown})' if shown else ''}, T_max {t_max}; "
            f"{len(train.names)} train tasks, {len(test.names)} test tasks ({split})."
        )

    def bound_note_for(self, options: Mapping[str, Any]) -> str:
        """What the Pass@T figure's dashed bound (:meth:`min_turns` within T) means here."""
        return DEFAULT_BOUND_NOTE

    # -- demonstrations and tokenizer
    def plan(self, tasks: EnvTasks, task_id: int) -> list[str]:
        """The replies of one successful episode of ``task_id``: the environment's own
        ``demonstration(task_id)``; an environment without one cannot warm-start."""
        demo = getattr(inner_env(tasks.env), "demonstration", None)
        if not callable(demo):
            raise StudyError(
                f"{type(inner_env(tasks.env)).__name__} has no demonstration(task_id) "
                "(gold replies) for the warm start; give a pretrained model "
                "(model.model_dir) with warm_start.enabled: false"
            )
        return [str(r) for r in demo(int(task_id))]

    def demonstrable(self, tasks: EnvTasks, task_ids: Sequence[int]) -> np.ndarray:
        """The ``task_ids`` the demonstrator can play: those no task with another plan shares a
        first observation with (the demonstrator tells tasks apart by it; BFCL's
        multi_turn_base_40 and _43 open alike)."""
        task_ids = np.asarray(task_ids, np.int64)
        plans: dict[str, list] = {}
        for obs, t in zip(first_observations(tasks.env, task_ids), task_ids):
            plans.setdefault(obs, []).append((int(t), tuple(self.plan(tasks, t))))
        clear = {t for group in plans.values() if len({p for _, p in group}) == 1 for t, _ in group}
        return np.array([t for t in task_ids if int(t) in clear], np.int64)

    def demonstrator(
        self,
        tasks: EnvTasks,
        task_ids: Sequence[int],
        *,
        t_max: int,
        mistake_rate: float,
        seed: int,
    ):
        """The warm start's demonstrator (a :data:`~agentrl_jax.sampling.policy.Script`) for
        ``task_ids``."""
        del t_max
        observations = first_observations(tasks.env, task_ids)
        plans: dict[str, list[str]] = {}
        for obs, t in zip(observations, task_ids):
            plan = self.plan(tasks, t)
            if plans.setdefault(obs, plan) != plan:
                raise StudyError(
                    f"tasks with different gold plans open with the same observation "
                    f"({obs[:60]!r}...): the demonstrator cannot tell them apart"
                )
        return GoldDemonstrator(plans, mistake_rate=mistake_rate, seed=seed)

    def corpus(
        self, tasks: EnvTasks, task_ids: Sequence[int], *, t_max: int, prompt: Any
    ) -> list[str]:
        """Texts between the special tokens of this environment's conversations, for a small
        tokenizer: the system prompt at every budget, turn headers, first observations, gold
        replies (``prompt``: the rollout's :class:`~agentrl_jax.prompts.BudgetPrompt`)."""
        instructions = tasks.env.instructions()
        observations = first_observations(tasks.env, task_ids)
        system = [f"system\n{prompt.system_text(instructions, b)}" for b in range(1, t_max + 1)]
        turns = [
            f"user\n{prompt.turn_text(observations[(b + t) % len(observations)], b, t)}"
            for b in range(1, t_max + 1)
            for t in range(b)
        ]
        try:
            replies = [f"\n\n{r}" for t in task_ids for r in self.plan(tasks, t)]
        except StudyError:
            replies = []
        # weights: BPE merges go to what recurs most, so the short texts every turn repeats
        # (role headers, replies) are weighted up against the long, rarer ones
        return (
            system
            + turns * 2
            + [f"user\n{o}" for o in observations] * 4
            + replies * 64
            + ["user\n", "assistant\n", "\n\n", "\n"] * 256
        )

    # -- training and evaluation
    def step_scorer(self, tasks: EnvTasks):
        """R_single's scorer for training on ``tasks`` (None: not logged)."""
        del tasks
        return RecordedQuality() if self.records_quality else None

    def state_diagnostics(self, tasks: EnvTasks) -> Any:
        """What the ``steps`` and ``errors`` analyses score ``tasks``' states with
        (:mod:`agentrl_jax.evaluation.state_diagnostics`); None where the study has nothing
        to score them with (it then leaves those analyses out of :attr:`analyses`)."""
        del tasks
        return None

    def analyses_for(self, names: Sequence[str]) -> tuple[str, ...]:
        """The analyses of ``names`` this study supports, in that order: its own
        :attr:`analyses` of the built-in ones, and every analysis a plugin registered."""
        return tuple(n for n in names if n in self.analyses or n not in ALL_ANALYSES)
