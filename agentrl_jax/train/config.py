"""The trainer's configuration: the config sections it reads, and one run's static update.

A config is one tree of frozen sections, each a class of the library validated on
construction by :func:`agentrl_jax.validation.validate` (a bad value raises
:class:`~agentrl_jax.errors.ConfigError`, a ``ValueError``, naming ``section.field``):

* ``task`` (:class:`TaskConfig`): the environment (a registered name), its options, its tasks
  and the rollout's lengths;
* ``engine`` (:class:`~agentrl_jax.sampling.config.EngineConfig`): the sampling engine, shared
  by the training rollouts and the evaluation;
* ``rl`` (:class:`RLConfig`): the runs (:mod:`agentrl_jax.train.presets`), the rollouts'
  sampling, the optimizer, batching, memory, checkpoints and live metrics;
* ``mesh`` (:class:`~agentrl_jax.sharding.MeshConfig`): the devices.

:class:`Config` holds these four, the sections the training entry point reads
(:func:`agentrl_jax.train.run.train_policy`); the reproduction's config extends it with its
own (``model``, ``warm_start``, ``eval``). Nothing is copied from one section into another:
the jitted step reads a :class:`TrainConfig`, which *holds* the ``rl`` section beside one
run's resolved algorithm and what follows from the task and tokenizer.

Defaults are the library's, the paper's where it gives them (§4: AdamW with learning rate
1e-6 and weight decay 0.01, critic learning rate 1e-5, G = 16, rollout temperature 1, KL
0.001 in the presets); an environment's reproduction defaults (CPU-sized) are its study's
(:attr:`agentrl_jax.reproduce.studies.Study.config_defaults`), and ``configs/*.yaml`` only
override.

Consistent log-probs: a rollout draws tokens from a tempered, top-k/top-p truncated
distribution over the tokenizer's vocabulary, while the model's own distribution is
temperature 1 over every embedding row. The ratio and the KL of the loss are only what they
claim when the trainer scores tokens under the distribution they were drawn from. Two options:
``rl.scoring: sampling`` scores every log-prob (current, old, reference) under the rollout's
distribution (``rl.sampling.temperature``, ``rl.sampling.top_k``, ``rl.sampling.top_p``, the
tokenizer's vocabulary; the kept top-p set is chosen without gradient, the sampled token always in
it), so the old log-probs equal the sampler's ``Trajectory.sampling_logprobs``; or keep
``rl.scoring: model`` and correct the mismatch with truncated importance sampling, the
``policy_clip_tis`` loss term. Either way the step logs ``sampler_gap_mean``/``sampler_gap_max``.

PPO-style optimisation: each rollout batch is used for ``rl.batching.epochs`` passes, each split
into ``rl.batching.mini_batches`` mini-batches (rows shuffled per epoch), one optimizer update per
mini-batch; ``rl.batching.num_micro_batches`` then splits each mini-batch for gradient accumulation.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from agentrl_jax.algorithms import AlgorithmConfig, LossTermConfig
from agentrl_jax.errors import ConfigError, did_you_mean
from agentrl_jax.models.lora import LoraConfig
from agentrl_jax.sampling.config import EngineConfig, SamplingSettings
from agentrl_jax.sampling.filters import SamplingConfig
from agentrl_jax.sharding import MeshConfig
from agentrl_jax.train.inputs import check_inputs, step_inputs
from agentrl_jax.train.presets import (
    RUN_PRESETS,
    RunSettings,
    check_algorithm_overrides,
    check_preset_params,
    declared_defaults,
    resolve_runs,
)
from agentrl_jax.train.scoring import Forward
from agentrl_jax.train.sections import (
    AsynchronousConfig,
    BatchingConfig,
    CheckpointConfig,
    LoggingConfig,
    MemoryConfig,
    OptimizerConfig,
)
from agentrl_jax.validation import (
    BOOL,
    MAX_COEF,
    MAX_CONTEXT,
    MAX_COUNT,
    MAX_ROWS,
    MAX_SAMPLES,
    MAX_SEED,
    MAX_STEPS,
    MAX_TEMPERATURE,
    MAX_TOKENS,
    MAX_TURNS,
    SAFE_DIGITS,
    Check,
    check_fields,
    freeze,
    integer,
    one_of,
    optional,
    real,
    setting,
    short_repr,
    subsection,
    unprintable,
)

SCORING = ("model", "sampling")
PROCESS_REWARDS = ("oracle", "judge")
# Table 1's 25% level, (25 T_max) // 100, must be a budget of at least one turn.
_T_MAX = integer(4, MAX_TURNS)._replace(
    expect=f"an int in [4, {MAX_TURNS}] (the 25% budget level must be >= 1 turn)"
)


def plain_data(value: Any) -> Any:
    """``value`` with mappings as dicts and tuples as lists, all the way down (what YAML holds);
    a nested section (``rl.optimizer``, ``rl.lora``, ...: a dataclass) as the mapping of its
    fields."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {k: plain_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_data(v) for v in value]
    return value


# ---------------------------------------------------------------- task


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """The environment and its tasks: any registered one (:mod:`envs.registry`; built in:
    ``frozenlake``, ``sql``, ``code``, ``bfcl``, and those a ``--plugin`` registers).

    ``options`` are the environment's own (FrozenLake: map size, dynamics; sql: a Spider
    folder), checked by its registry entry (:meth:`envs.protocol.EnvEntry.check_options`),
    which also fills in their defaults where it declares them. ``train_tasks`` /
    ``eval_tasks`` tasks come from the environment's train and test splits (disjoint where it
    has them; FrozenLake's by a content hash bit of each map), drawn with ``seed``. The
    rollout owns the budget: ``t_max`` is the largest one. ``max_response_tokens`` and
    ``max_context`` bound a response and a conversation, in tokens.
    """

    env: str = setting(
        "frozenlake",
        Check(lambda v: isinstance(v, str) and v != "", "a registered environment's name"),
    )
    options: Mapping[str, Any] = setting(
        check=Check(lambda v: isinstance(v, Mapping), "a mapping of the environment's options"),
        default_factory=dict,
    )
    t_max: int = setting(12, _T_MAX)  # largest budget (paper §2: 70 on 8x8 FrozenLake, 10 SQL)
    train_tasks: int = setting(512, integer(1, MAX_COUNT))
    # held-out tasks: Table 1's Pass@8 cells within +-5.8 pt (95%)
    eval_tasks: int = setting(288, integer(1, MAX_COUNT))
    seed: int = setting(0, integer(0, MAX_SEED))
    # most tokens of one response (a FrozenLake answer is 3 + stop)
    max_response_tokens: int = setting(8, integer(1, MAX_CONTEXT))
    # tokens of context per trajectory (T_max 12 needs ~310)
    max_context: int = setting(384, integer(16, MAX_CONTEXT))

    def __post_init__(self):
        check_fields("task", self)
        for field, value in (
            ("t_max", self.t_max),
            ("max_response_tokens", self.max_response_tokens),
        ):
            if value > self.max_context:  # every turn takes at least one token of the context
                raise ConfigError(
                    f"task.{field}: must be <= task.max_context ({self.max_context}): every "
                    f"turn takes at least one token of the context, got {value}"
                )
        import envs  # noqa: PLC0415 (the registry; plugins may have added to it)

        try:
            options = envs.entry(self.env).check_options(plain_data(self.options))
        except ValueError as error:
            message = str(error)
            if message.startswith("task."):
                raise ConfigError(message) from None
            field = "task.env" if "unknown environment" in message else "task.options"
            raise ConfigError(f"{field}: {message}") from None
        object.__setattr__(self, "options", freeze(options))

    @property
    def entry(self):
        """The environment's registry entry (:class:`envs.protocol.EnvEntry`)."""
        import envs  # noqa: PLC0415

        return envs.entry(self.env)

    @property
    def max_response_length(self) -> int:
        """The most sampled tokens a row can hold, ``t_max x max_response_tokens`` (DAPO's
        overlong ``L_max``, Dr. GRPO's constant)."""
        return self.t_max * self.max_response_tokens

    @property
    def loss_positions(self) -> int | None:
        """The static bound at which the update runs the output head
        (:func:`loss_position_bound`)."""
        return loss_position_bound(self.t_max, self.max_response_tokens, self.max_context)


def loss_position_bound(t_max: int, max_response_tokens: int, max_context: int) -> int | None:
    """The most sampled tokens a row can hold, ``t_max x max_response_tokens``: the static
    bound at which a forward runs the output head (None when it is not below the context)."""
    bound = t_max * max_response_tokens
    return bound if bound < max_context - 1 else None


# ---------------------------------------------------------------- rl


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """The RL runs, all from the same policy with the same number of updates and rollouts.

    ``runs`` lists them: names of presets (:data:`~agentrl_jax.train.presets.RUN_PRESETS`:
    ``grpo``, ``budgetmix``, ``budgetmix-adaptive``, ``gigpo``, ``ppo``, ``dapo``,
    ``dr-grpo``, ...) or mappings ``{name, preset, label, budget_mix, presentation, params,
    algorithm}``
    composing any registered advantage estimator and loss terms. ``preset_params`` sets the
    presets' declared hyper-parameters for every run that declares them (e.g. ``kl_coef``,
    ``aggregation``, ``clip_low``, ``gigpo_gamma``); ``algorithm`` holds
    :class:`~agentrl_jax.algorithms.AlgorithmConfig` fields applied to every run over its
    preset's (:mod:`agentrl_jax.train.presets`). Full-budget runs play every group at
    ``T_max``; BudgetMix runs draw one budget per task group from ``{(k T_max) // 10}``
    (paper §5), and a BudgetMix run whose estimator reads anchor states (GiGPO) anchors on
    ``(s_t, B - t)``.

    Rollouts: ``steps`` updates of ``tasks_per_step`` tasks x ``group_size`` trajectories,
    sampled as ``sampling`` says (:class:`~agentrl_jax.sampling.config.SamplingSettings`, the
    class ``eval.sampling`` is too: ``temperature``, > 0 here, ``top_k``, ``top_p``);
    ``max_rows_per_call`` plays a step's rows in parts of at most this many rows (a multiple
    of ``group_size``; null: all at once; the tokens do not depend on it), ``refill`` (with it)
    is continuous batching. ``scoring``: the distribution the update scores sampled tokens
    under, ``model`` (temperature 1, whole vocabulary) or ``sampling`` (the rollout's; module
    docstring). ``history_window`` k (null: the whole history) shows the policy only the
    system header and its last k turns in the training rollouts; the update then trains each
    turn under the context it saw (step-wise, :mod:`agentrl_jax.train.packing`; token-mean
    aggregation, no critic). The evaluation keeps the whole history.

    The update: ``optimizer`` (:class:`~agentrl_jax.train.sections.OptimizerConfig`: AdamW,
    clipping, the critic's AdamW), ``batching`` (:class:`~agentrl_jax.train.sections.
    BatchingConfig`: per rollout batch ``epochs`` passes of ``mini_batches`` updates, each
    split in ``num_micro_batches`` for gradient accumulation), ``memory``
    (:class:`~agentrl_jax.train.sections.MemoryConfig`: remat, attention, logits chunks,
    packing; none changes the numbers), ``asynchronous``
    (:class:`~agentrl_jax.train.sections.AsynchronousConfig`: rollouts sampled up to
    ``max_staleness`` updates ahead, corrected up to ``off_policy_cap``). Process rewards
    (§8): ``process_reward_coef`` x each step's score is added to the reward, the scores from
    the step scorer the trainer is given, or, in the reproduction, the one ``process_rewards``
    names: ``oracle`` (the environment study's step scorer, e.g. FrozenLake's exact Q*) or
    ``judge`` (a local Qwen3 in ``judge_model_dir`` asked whether each step is good).

    MoE policies: the sampler records the experts of every token it samples
    (``Trajectory.experts``); ``routing_replay`` makes the train step's forwards (the live one
    and the old log-probs') route those tokens through the recorded experts instead of their
    routers' current choice (R3; the router still learns through the recorded experts' weights).
    Either way the step reports ``routing_differs``, the share of (sampled token, MoE layer)
    pairs whose router picks other experts than the sampler did.

    ``exact_logprobs``: the sampler and the trainer compute the log-probs of sampled tokens by
    one canonical per-sequence computation (:mod:`agentrl_jax.sampling.exact`), so they are
    equal bit for bit and the first update's importance ratios are exactly 1; the trainer's
    gradient is still the fast forward's. Costs a forward of the row's whole history per
    sampled token; one device, the whole history, no LoRA.

    LoRA: ``lora`` (null: every parameter trains) is a mapping ``{rank, alpha, targets,
    base_dtype}`` (:class:`~agentrl_jax.models.lora.LoraConfig`): adapters on the targeted
    projections train, the base weights stay frozen (stored in ``base_dtype``), the optimizer
    holds the adapters' moments only, the KL reference is the base (adapters off, no second
    copy), the rollouts decode with the adapters merged into the weights (on device, once per
    update) and checkpoints hold the adapters, not the base. Not with a critic (PPO).

    ``checkpoint`` (:class:`~agentrl_jax.train.sections.CheckpointConfig`: every ``every``
    updates, the newest ``keep`` kept) and ``logging``
    (:class:`~agentrl_jax.train.sections.LoggingConfig`: TensorBoard, W&B; each run's
    ``metrics.jsonl`` is always written). A subsection is given as a mapping of some of its
    fields (the others keep their defaults) or as its class.
    """

    runs: tuple[Any, ...] = ("grpo",)
    preset_params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    algorithm: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    steps: int = setting(100, integer(1, MAX_STEPS))
    tasks_per_step: int = setting(8, integer(1, MAX_ROWS))
    group_size: int = setting(16, integer(2, MAX_SAMPLES))  # G (paper §4: 16)
    sampling: SamplingSettings = SamplingSettings()  # rollout temperature (paper §4: 1.0)
    scoring: str = setting("model", one_of(SCORING))
    max_rows_per_call: int | None = setting(None, optional(integer(1, MAX_ROWS)))
    refill: bool = setting(False, BOOL)
    history_window: int | None = setting(None, optional(integer(1, MAX_TURNS)))
    optimizer: OptimizerConfig = OptimizerConfig()
    batching: BatchingConfig = BatchingConfig()
    memory: MemoryConfig = MemoryConfig()
    asynchronous: AsynchronousConfig = AsynchronousConfig()
    process_rewards: str | None = setting(None, one_of(PROCESS_REWARDS, nullable=True))
    process_reward_coef: float = setting(0.0, real(0.0, MAX_COEF))
    judge_model_dir: str | None = setting(
        None, Check(lambda v: v is None or (isinstance(v, str) and v != ""), "null or a path")
    )
    routing_replay: bool = setting(False, BOOL)
    exact_logprobs: bool = setting(False, BOOL)
    lora: LoraConfig | None = None
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    seed: int = setting(0, integer(0, MAX_SEED))

    def __post_init__(self):
        for name, cls in SUBSECTIONS.items():
            default = next(f.default for f in dataclasses.fields(self) if f.name == name)
            object.__setattr__(
                self, name, subsection(f"rl.{name}", cls, getattr(self, name), default)
            )
        object.__setattr__(self, "lora", LoraConfig.from_value(self.lora))
        if isinstance(self.runs, str) or not isinstance(self.runs, Sequence) or not self.runs:
            raise ConfigError(
                f"rl.runs: must be a non-empty list of runs, each a preset name "
                f"({', '.join(RUN_PRESETS)}) or a mapping {{name, preset, label, budget_mix, "
                f"presentation, params, algorithm}}, got {short_repr(self.runs)}"
            )
        object.__setattr__(self, "runs", freeze(plain_data(self.runs)))
        object.__setattr__(
            self, "algorithm", freeze(check_algorithm_overrides("rl.algorithm", self.algorithm))
        )
        object.__setattr__(
            self,
            "preset_params",
            freeze(check_preset_params("rl.preset_params", self.preset_params)),
        )
        check_fields("rl", self)
        if self.sampling.temperature == 0:
            raise ConfigError(
                f"rl.sampling.temperature: must be a number in (0, {MAX_TEMPERATURE:g}] "
                "(greedy rollouts have no distribution to score under), got 0"
            )
        rows = self.tasks_per_step * self.group_size
        batching = self.batching
        if rows % batching.mini_batches:
            raise ConfigError(
                f"rl.batching.mini_batches: must divide tasks_per_step x group_size ({rows}), "
                f"got {batching.mini_batches}"
            )
        per_update = rows // batching.mini_batches
        if per_update % batching.num_micro_batches:
            divided = " / mini_batches" if batching.mini_batches > 1 else ""
            raise ConfigError(
                f"rl.batching.num_micro_batches: must divide tasks_per_step x group_size"
                f"{divided} ({per_update}), got {batching.num_micro_batches}"
            )
        if self.max_rows_per_call is not None and self.max_rows_per_call % self.group_size:
            raise ConfigError(
                f"rl.max_rows_per_call: must be a multiple of group_size ({self.group_size}), "
                f"so task groups stay whole, got {self.max_rows_per_call}"
            )
        if self.refill and self.max_rows_per_call is None:
            raise ConfigError(
                "rl.refill: continuous batching needs rl.max_rows_per_call (the rows in "
                "flight), got refill: true with max_rows_per_call: null"
            )
        if (self.process_rewards == "judge") != (self.judge_model_dir is not None):
            raise ConfigError(
                "rl.judge_model_dir: the judge's Qwen3 directory, given exactly when "
                f"rl.process_rewards is judge (got process_rewards: {self.process_rewards!r}, "
                f"judge_model_dir: {self.judge_model_dir!r})"
            )
        runs = self.resolved_runs()  # every run's algorithm builds (errors name rl.runs[i])
        for run in runs if self.history_window is not None else ():
            problem = step_wise_problem(run.algorithm)
            if problem is None:
                continue
            raise ConfigError(
                f"rl.history_window: run {run.name!r} trains each windowed turn under its own "
                f"context (step-wise), which it cannot with {problem}; set "
                "rl.history_window: null to keep the whole history"
            )
        for run in runs:
            check_run(self, run.algorithm, run.name)
        if self.exact_logprobs and (self.history_window is not None or self.lora is not None):
            raise ConfigError(
                "rl.exact_logprobs: exact log-probs score every token under the whole history "
                "with the full weights; not with rl.history_window or rl.lora (got "
                f"history_window: {self.history_window!r}, lora: "
                f"{'set' if self.lora is not None else 'null'})"
            )
        # every hyper-parameter the runs' presets declare, with its value (given, else the
        # default), so configs that state a default and configs that do not are equal, and a
        # written config reads back the same under any defaults
        values = {}
        for name, defaults in sorted(declared_defaults(self.runs).items()):
            if name in self.preset_params:
                values[name] = self.preset_params[name]
            elif len(defaults) == 1:  # presets that disagree on a default: each keeps its own
                values[name] = _declared_default(self.runs, name)
        object.__setattr__(self, "preset_params", freeze(values))

    def resolved_runs(self) -> tuple[RunSettings, ...]:
        """``runs`` resolved: each run's name, label, BudgetMix and AlgorithmConfig."""
        return resolve_runs(self)

    @property
    def run_names(self) -> tuple[str, ...]:
        return tuple(run.name for run in self.resolved_runs())

    @property
    def updates_per_batch(self) -> int:
        """Optimizer updates per rollout batch: ``epochs x mini_batches``."""
        return self.batching.updates_per_batch


# the rl section's subsections given as mappings (lora, which may be null, has its own reader)
SUBSECTIONS: dict[str, type] = {
    "sampling": SamplingSettings,
    "optimizer": OptimizerConfig,
    "batching": BatchingConfig,
    "memory": MemoryConfig,
    "asynchronous": AsynchronousConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
}


def check_run(rl: RLConfig, algorithm: AlgorithmConfig, name: str | None = None) -> None:
    """What the ``rl`` settings refuse of a run's algorithm (``name``: the run's, for the
    message), naming the field: LoRA with a critic (PPO trains a full copy of the policy as its
    value model; LoRA runs train without one), packing with a loss term that reads each row as
    one sequence. :class:`RLConfig` checks every run, :class:`TrainConfig` the one it holds."""
    run = f"run {name!r}" if name is not None else "a run"
    if rl.lora is not None and step_inputs(algorithm).critic_model:
        raise ConfigError(
            f"rl.lora: {run} with a critic (PPO) trains a full copy of the policy as its "
            "value model; LoRA runs train without one (set rl.lora: null for this run)"
        )
    whole_rows = [t.name for t in algorithm.loss_terms if t.term.whole_rows]
    if rl.memory.packing and whole_rows:
        raise ConfigError(
            f"rl.memory.packing: loss term {whole_rows[0]!r} of {run} reads each row as one "
            "sequence, so its rows cannot hold several (set rl.memory.packing: false for "
            "this run)"
        )


def step_wise_problem(algorithm: AlgorithmConfig) -> str | None:
    """Why ``algorithm`` cannot train turns sampled from a history window each under its own
    context (None: it can). A response is then a loss token in its turn's sequence and context
    in later ones, so the aggregation must be token-mean (a sequence mode would count turns,
    not trajectories), and no critic (its values would be read on several contexts)."""
    if algorithm.aggregation != "token-mean":
        return f"aggregation {algorithm.aggregation!r} (use token-mean)"
    if step_inputs(algorithm).critic_model:
        return "a critic (PPO: train with the whole history)"
    return None


def _declared_default(runs: Sequence[Any], name: str) -> Any:
    """The default of hyper-parameter ``name`` in the first of ``runs``' presets declaring it."""
    from agentrl_jax.train.presets import _preset_of  # noqa: PLC0415

    return next(_preset_of(r).params[name].default for r in runs if name in _preset_of(r).params)


# ---------------------------------------------------------------- the root of the tree


@dataclasses.dataclass(frozen=True)
class Config:
    """The sections the training entry point reads (module docstring)."""

    task: TaskConfig = TaskConfig()
    engine: EngineConfig = EngineConfig()
    rl: RLConfig = RLConfig()
    mesh: MeshConfig = MeshConfig(data=1)

    def __post_init__(self):
        for f in dataclasses.fields(Config):
            value = getattr(self, f.name)
            if not isinstance(value, SECTIONS[f.name]):
                raise ConfigError(
                    f"{f.name}: must be a {SECTIONS[f.name].__name__}, got {short_repr(value)}"
                )
        found = unprintable(self.plain_sections())
        if found is not None:
            raise ConfigError(
                f"{found}: a NaN or an integer too long to print ({SAFE_DIGITS:,}+ digits) is "
                "no setting's value"
            )
        rows = self.rl.tasks_per_step * self.rl.group_size
        if rows * self.task.max_context > MAX_TOKENS:
            raise ConfigError(
                f"rl.tasks_per_step: a step's rows (tasks_per_step x group_size = {rows:,}) "
                f"times task.max_context ({self.task.max_context:,}) is "
                f"{rows * self.task.max_context:,} tokens, more than one batch can index "
                f"({MAX_TOKENS:,}, int32); lower tasks_per_step, group_size or max_context"
            )
        if self.mesh.tensor > 1 and self.engine.kv_page_size is not None:
            raise ConfigError(
                f"engine.kv_page_size: the paged KV cache splits rows over the data and fsdp "
                f"axes only, and mesh.tensor is {self.mesh.tensor}; set engine.kv_page_size "
                "to null (the static cache) or tensor to 1"
            )

    def plain_sections(self) -> dict[str, dict[str, Any]]:
        """Every section as plain data (``{section: {field: value}}``, what YAML holds)."""
        return {
            f.name: {
                g.name: plain_data(getattr(getattr(self, f.name), g.name))
                for g in dataclasses.fields(getattr(self, f.name))
            }
            for f in dataclasses.fields(self)
        }


SECTIONS: dict[str, type] = {
    "task": TaskConfig,
    "engine": EngineConfig,
    "rl": RLConfig,
    "mesh": MeshConfig,
}


# ---------------------------------------------------------------- one run's update


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What the jitted step and the loop need for one run: the ``rl`` section, the run's
    resolved ``algorithm``, and what follows from the task and the tokenizer. Built by
    :func:`train_config` from a :class:`Config` and a run; tests build it directly.

    ``budget_anchors``: GiGPO anchors ``(s_t, B - t)`` instead of ``s_t`` (BudgetMix, §5).
    ``loss_positions``: the static bound on sampled tokens per row at which the head runs
    (None: every position). ``max_response_length``: the most sampled tokens a row can hold
    (DAPO's overlong ``L_max`` and Dr. GRPO's constant, an algorithm's
    ``aggregation_constant`` None, which is filled in on construction). ``valid_vocab_size``:
    the tokenizer's vocabulary where it is below the model's (``rl.scoring: sampling`` never
    scores the embedding rows past it). ``context_length``: the rows the rollout's sampler
    holds (``task.max_context``), the canonical length of ``rl.exact_logprobs`` (None: the
    batch's row width). ``ordered_sums``: ``mesh.ordered_sums`` (on a mesh, the
    gradients and the losses' sums added over the batch's devices in a fixed order,
    :mod:`agentrl_jax.ordered_sums`).

    The KL coefficient lives in ``algorithm`` (the ``"kl"`` loss term), so there is one source
    of truth; :attr:`kl_coef` reads it. What the step computes (entropy, reference
    log-probs, a critic) follows from the inputs the configured estimator and terms declare
    (:mod:`agentrl_jax.train.inputs`), whatever their names. ``to_dict`` gives plain data
    (what checkpoints store).
    """

    rl: RLConfig = RLConfig()
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    budget_anchors: bool = setting(False, BOOL)
    loss_positions: int | None = setting(None, optional(integer(1)))
    max_response_length: int | None = setting(None, optional(integer(1)))
    valid_vocab_size: int | None = setting(None, optional(integer(1)))
    context_length: int | None = setting(None, optional(integer(1)))
    ordered_sums: bool = setting(False, BOOL)

    def __post_init__(self):
        if isinstance(self.algorithm, Mapping):
            try:
                object.__setattr__(self, "algorithm", AlgorithmConfig.from_dict(self.algorithm))
            except ValueError as e:
                raise ConfigError(f"TrainConfig.algorithm: {e}") from None
        if not isinstance(self.algorithm, AlgorithmConfig):
            raise ConfigError(
                f"TrainConfig.algorithm: must be an AlgorithmConfig or mapping, "
                f"got {short_repr(self.algorithm)}"
            )
        if not isinstance(self.rl, RLConfig):
            raise ConfigError(f"TrainConfig.rl: must be an RLConfig, got {short_repr(self.rl)}")
        check_fields("TrainConfig", self)
        if self.max_response_length is None:
            for field, used in (
                ("aggregation_constant", self.algorithm.aggregation_constant is None),
                ("overlong_buffer", self.algorithm.overlong_buffer > 0),
            ):
                if used:
                    raise ConfigError(
                        f"TrainConfig.max_response_length: must be set (an int >= 1) when the "
                        f"algorithm's {field} reads it, got None"
                    )
        elif self.algorithm.aggregation_constant is None:
            object.__setattr__(
                self,
                "algorithm",
                dataclasses.replace(
                    self.algorithm, aggregation_constant=float(self.max_response_length)
                ),
            )
        try:
            check_inputs(self.algorithm)
        except ValueError as e:
            raise ConfigError(f"TrainConfig.algorithm.{e}") from None
        check_run(self.rl, self.algorithm)

    @property
    def kl_coef(self) -> float:
        """Coefficient of the ``"kl"`` loss term (0.0 when the algorithm has none)."""
        return next((t.coef for t in self.algorithm.loss_terms if t.name == "kl"), 0.0)

    @property
    def uses_reference(self) -> bool:
        """Whether the step needs the frozen reference policy: a configured term (of any name)
        declares ``ref_logprobs``."""
        return step_inputs(self.algorithm).reference

    @property
    def uses_critic(self) -> bool:
        """Whether the step trains a critic: the estimator uses one or a critic term is
        configured."""
        return step_inputs(self.algorithm).critic_model

    @property
    def scoring_sampling(self) -> SamplingConfig | None:
        """The sampling distribution log-probs are scored under (``rl.scoring: sampling``),
        or None for the model's own distribution."""
        if self.rl.scoring == "model":
            return None
        return self.rl.sampling.config(self.valid_vocab_size)

    @property
    def updates_per_batch(self) -> int:
        """Optimizer updates per rollout batch: ``rl.batching``'s ``epochs x mini_batches``."""
        return self.rl.updates_per_batch

    @property
    def forward(self) -> Forward:
        """The teacher-forced forward the step scores tokens with."""
        return Forward(
            remat=self.rl.memory.remat,
            attention=self.rl.memory.attention,
            loss_positions=self.loss_positions,
            logits_chunk=self.rl.memory.logits_chunk,
            sampling=self.scoring_sampling,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (checkpoints store it)."""
        out = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("rl", "algorithm")
        }
        out["rl"] = {
            f.name: plain_data(getattr(self.rl, f.name)) for f in dataclasses.fields(RLConfig)
        }
        out["algorithm"] = algorithm_to_dict(self.algorithm)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TrainConfig":
        """Builds from :meth:`to_dict`'s plain data (a checkpoint's JSON); unknown keys are
        errors; ``TrainConfig.from_dict(c.to_dict()) == c``."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(
                f"TrainConfig: unknown field {unknown[0]!r}; known: {', '.join(sorted(known))}"
                f"{did_you_mean(unknown[0], known)}"
            )
        rl = d.get("rl", {})
        return cls(**{**d, "rl": rl if isinstance(rl, RLConfig) else RLConfig(**rl)})


def train_config(
    config: Config, run: RunSettings, valid_vocab_size: int | None = None
) -> TrainConfig:
    """The update of ``run`` (one of ``config.rl``'s resolved runs) under ``config``:
    ``valid_vocab_size`` is the tokenizer's vocabulary where it is below the model's."""
    return TrainConfig(
        rl=config.rl,
        algorithm=run.algorithm,
        budget_anchors=bool(run.budget_mix)
        and "anchor_keys" in step_inputs(run.algorithm).advantage,
        loss_positions=config.task.loss_positions,
        max_response_length=config.task.max_response_length,
        valid_vocab_size=valid_vocab_size if config.rl.scoring == "sampling" else None,
        context_length=config.task.max_context if config.rl.exact_logprobs else None,
        ordered_sums=config.mesh.ordered_sums,
    )


def algorithm_to_dict(config: AlgorithmConfig) -> dict[str, Any]:
    """An :class:`AlgorithmConfig` as plain data that ``AlgorithmConfig.from_dict`` reads back."""

    def term(t: LossTermConfig) -> dict[str, Any]:
        return {"name": t.name, "coef": t.coef, "params": dict(t.params)}

    return {
        "advantage": config.advantage,
        "advantage_params": dict(config.advantage_params),
        "loss_terms": [term(t) for t in config.loss_terms],
        "aggregation": config.aggregation,
        "aggregation_constant": config.aggregation_constant,
        "dynamic_sampling": config.dynamic_sampling,
        "max_rollout_batches": config.max_rollout_batches,
        "overlong_buffer": config.overlong_buffer,
        "overlong_penalty": config.overlong_penalty,
    }
