"""The reproduction's config sections task, model, warm_start and rl: frozen dataclasses,
each field checked on construction by :func:`agentrl_jax.validation.validate` (a
:class:`~agentrl_jax.errors.ConfigError` naming ``section.field``). :mod:`.config` assembles
them, with ``eval`` (:mod:`.eval_settings`) and ``mesh``, into the
:class:`~agentrl_jax.reproduce.config.ReproduceConfig` and reads them from YAML.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any, Mapping, Sequence

from agentrl_jax.algorithms.aggregation import AGGREGATION_MODES
from agentrl_jax.errors import ConfigError
from agentrl_jax.models.attention import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS
from agentrl_jax.models.qwen3 import REMAT_POLICIES
from agentrl_jax.reproduce.eval_settings import KV_PAGE_SIZE
from agentrl_jax.reproduce.presets import (
    RUN_PRESETS,
    RunSettings,
    check_algorithm_overrides,
    resolve_runs,
)
from agentrl_jax.sampling import GENERATION_LAYOUTS
from agentrl_jax.train.config import SCORING
from agentrl_jax.validation import (
    BOOL,
    Check,
    integer,
    is_int,
    is_real,
    one_of,
    optional,
    real,
    short_repr,
    validate,
)

# ---------------------------------------------------------------- checks

_int, _real, _optional, _BOOL = integer, real, optional, BOOL
TENSORBOARD = ("auto", True, False)
# Table 1's 25% level, (25 T_max) // 100, must be a budget of at least one turn.
_T_MAX = (lambda v: is_int(v, 4), "an int >= 4 (the 25% budget level must be >= 1 turn)")


_CLIP_LOW = (lambda v: is_real(v) and 0 < v < 1, "a finite number > 0 and < 1")


def plain_data(value: Any) -> Any:
    """``value`` with mappings as dicts and tuples as lists, all the way down (what YAML holds)."""
    if isinstance(value, Mapping):
        return {k: plain_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_data(v) for v in value]
    return value


def _validate(section: Any, checks: Mapping[str, Check]) -> None:
    validate(_SECTION_NAMES[type(section)], section, checks)


# ---------------------------------------------------------------- sections


@dataclasses.dataclass(frozen=True)
class TaskSettings:
    """The environment and its tasks: any registered one (:mod:`envs.registry`; built in:
    ``frozenlake``, ``sql``, ``code``, ``bfcl``, and those a ``--plugin`` registers).

    ``options`` are the environment's own (FrozenLake: map size, dynamics; sql: a Spider
    folder), checked by its study (:mod:`agentrl_jax.reproduce.studies`), which also fills in its
    defaults. ``train_tasks`` / ``eval_tasks`` tasks come from the environment's train and test
    splits (disjoint where it has them; FrozenLake's by a content hash bit of each map), drawn with
    ``seed``. The rollout owns the budget: ``t_max`` is the largest one.
    """

    env: str = "frozenlake"
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    t_max: int = 12  # largest budget (paper §2: 70 on 8x8 FrozenLake, 10 SQL)
    train_tasks: int = 512
    eval_tasks: int = 288  # held-out tasks: Table 1's Pass@8 cells within +-5.8 pt (95%)
    seed: int = 0
    max_response_tokens: int = 8  # most tokens of one response (a FrozenLake answer is 3 + stop)
    max_context: int = 384  # tokens of context per trajectory (T_max 12 needs ~310)

    def __post_init__(self):
        _validate(
            self,
            {
                "env": (
                    lambda v: isinstance(v, str) and v != "",
                    "a registered environment's name",
                ),
                "options": (
                    lambda v: isinstance(v, Mapping),
                    "a mapping of the environment's options",
                ),
                "t_max": _T_MAX,
                "train_tasks": _int(1),
                "eval_tasks": _int(1),
                "seed": _int(0),
                "max_response_tokens": _int(1),
                "max_context": _int(16),
            },
        )
        import envs  # noqa: PLC0415 (the registry; plugins may have added to it)

        try:
            entry = envs.entry(self.env)
            options = self.study.check_options(entry, plain_data(self.options))
        except ValueError as error:
            message = str(error)
            field = (
                "task"
                if message.startswith("task.")
                else (
                    "task.env"
                    if isinstance(error, envs.EnvOptionError) and "unknown environment" in message
                    else "task.options"
                )
            )
            raise ConfigError(message if field == "task" else f"{field}: {message}") from None
        object.__setattr__(self, "options", options)

    @property
    def entry(self):
        """The environment's registry entry (:class:`envs.protocol.EnvEntry`)."""
        import envs  # noqa: PLC0415

        return envs.entry(self.env)

    @property
    def study(self):
        """The environment's study (:func:`agentrl_jax.reproduce.studies.study_for`)."""
        from agentrl_jax.reproduce.studies import study_for  # noqa: PLC0415

        return study_for(self.env)


DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """The policy. ``model_dir`` (a local Hugging Face Qwen3 directory, e.g. Qwen3-4B) is loaded
    with its tokenizer; without it a Qwen3 of the dimensions below is initialised at random and
    a byte-level BPE tokenizer of ``tokenizer_vocab`` tokens is built from the task's text;
    ``tokenizer_isolate`` makes that tokenizer keep the pieces the environment's study declares
    (:attr:`agentrl_jax.reproduce.studies.Study.tokenizer_isolate`; FrozenLake: every grid cell) as
    tokens of their own instead of merging them with their neighbours."""

    model_dir: str | None = None
    hidden_size: int = 64
    intermediate_size: int = 192
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    tokenizer_vocab: int = 768
    tokenizer_isolate: bool = False
    dtype: str = "float32"  # compute dtype (parameters stay float32)
    seed: int = 0

    def __post_init__(self):
        _validate(
            self,
            {
                "model_dir": (
                    lambda v: v is None or (isinstance(v, str) and v != ""),
                    "null or a path",
                ),
                "hidden_size": _int(2),
                "intermediate_size": _int(1),
                "num_hidden_layers": _int(1),
                "num_attention_heads": _int(1),
                "num_key_value_heads": _int(1),
                "head_dim": (lambda v: _int(2)[0](v) and v % 2 == 0, "an even int >= 2"),
                "tokenizer_vocab": _int(261),
                "tokenizer_isolate": _BOOL,
                "dtype": one_of(DTYPES),
                "seed": _int(0),
            },
        )
        if self.tokenizer_isolate and self.model_dir is not None:
            raise ConfigError(
                "model.tokenizer_isolate: only for the tokenizer built from the task's "
                "text (model.model_dir is null); a loaded model keeps its own"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"model.num_key_value_heads: must divide num_attention_heads "
                f"({self.num_attention_heads}), got {self.num_key_value_heads}"
            )


@dataclasses.dataclass(frozen=True)
class WarmStartSettings:
    """Supervised warm-start of the random policy into a competent but fallible base policy.

    Demonstrations are played in the real rollout by the environment study's budget-aware
    demonstrator (FrozenLake: Q*-greedy under the remaining budget; the others: each task's gold
    replies), which makes a mistake (FrozenLake: a uniformly random other move; the others:
    another task's reply) with probability ``mistake_rate``; budgets are drawn as in BudgetMix so
    the base sees every budget level. ``enabled: false`` keeps the model as it is (a pretrained
    Qwen3).
    """

    enabled: bool = True
    demo_tasks: int = 256  # training tasks demonstrated (the first ones)
    demos_per_task: int = 4
    mistake_rate: float = 0.25
    epochs: int = 3
    batch_size: int = 32
    learning_rate: float = 3e-3
    weight_decay: float = 0.01
    group_by_length: bool = False  # batch demos of similar lengths, each batch at its own width
    seed: int = 0

    def __post_init__(self):
        _validate(
            self,
            {
                "enabled": _BOOL,
                "group_by_length": _BOOL,
                "demo_tasks": _int(1),
                "demos_per_task": _int(1),
                "mistake_rate": _real(0.0, 1.0),
                "epochs": _int(1),
                "batch_size": _int(1),
                "learning_rate": _real(0.0, lo_open=True),
                "weight_decay": _real(0.0),
                "seed": _int(0),
            },
        )


@dataclasses.dataclass(frozen=True)
class RLSettings:
    """The RL runs, all from the same base with the same number of updates and rollouts.

    ``runs`` lists the runs: names of presets (:data:`~agentrl_jax.reproduce.presets.RUN_PRESETS`:
    ``grpo``, ``budgetmix``, ``budgetmix-adaptive``, ``gigpo``, ``gigpo-budgetmix``, ``ppo``,
    ``ppo-budgetmix``, ``dapo``, ``dr-grpo``, ...) or mappings
    ``{name, preset, label, budget_mix, algorithm}`` composing any registered advantage estimator
    and loss terms (:mod:`agentrl_jax.reproduce.presets`). ``algorithm``
    holds :class:`~agentrl_jax.algorithms.AlgorithmConfig` fields applied to every run over its
    preset's (e.g. ``--set rl.algorithm.aggregation=seq-mean-token-mean``). Full-budget runs
    play every group at ``T_max``; BudgetMix runs draw one budget per task group from
    ``{(k T_max) // 10}`` (paper §5), and a BudgetMix run whose estimator reads anchor states
    (GiGPO) anchors on ``(s_t, B - t)``. The hyper-parameters below are the paper's names
    (§4), which the presets read (``clip_low``/``clip_high``: the ratio clip; equal in the
    paper, ``clip_high`` > ``clip_low`` is DAPO's clip-higher); the CPU default raises the
    learning rate for a tiny model.

    ``scoring``: the distribution the update scores sampled tokens under
    (:class:`~agentrl_jax.train.TrainConfig`'s field): ``model`` (temperature 1, whole
    vocabulary) or ``sampling`` (this ``temperature`` and ``top_p`` over the tokenizer's
    vocabulary: the one the rollout drew them from). With ``model`` and a temperature or
    ``top_p`` other than 1, correct the mismatch with the ``policy_clip_tis`` term (README
    "Choosing the algorithms").

    Optimisation per rollout batch: ``epochs`` passes of ``mini_batches`` updates each (PPO
    style; :class:`~agentrl_jax.train.TrainConfig`'s fields of the same names), each
    mini-batch split into ``num_micro_batches`` for gradient accumulation.

    Rollout memory and speed (none changes the paper's settings):
    ``kv_cache_dtype`` is the KV cache's dtype (null: the model's compute dtype);
    ``max_rows_per_call`` plays a step's ``tasks_per_step x group_size`` rows in parts of at
    most this many rows, one after another (a multiple of ``group_size``; null: all at once;
    the tokens do not depend on it); ``prefill_chunk`` feeds prompts to the KV cache this many
    tokens at a time (null: whole); ``generation_layout`` is where the sampler reads the
    weights from: ``auto`` (replicated over ``fsdp`` when the mesh has ``fsdp`` > 1, so decode
    all-gathers no weights), ``replicated`` or ``training`` (the train step's FSDP layout);
    ``kv_page_size`` (default 16; null: one static cache of the whole context per row, the
    reference engine) runs rollouts on the paged KV cache with pages of that many tokens (on a
    mesh with ``tensor`` = 1 each batch shard pages its own rows; ``tensor`` > 1 needs null):
    attention reads only the pages in use and finished rows free theirs (its attention sums in
    blocks, so a draw on a float tie may differ from the static engine's: none did in the
    default run's 40 updates); ``kv_pages`` bounds the pool (null: room for
    every row in flight at ``task.max_context``, the static cache's memory; fewer: the memory
    of the tokens actually cached, a row that finds no page being preempted and its turn
    replayed, with the same tokens, once pages are free); ``refill`` (with ``max_rows_per_call``) is
    continuous batching: a row that ends gives its place to the next waiting row instead of
    parts played one after another (the tokens do not depend on either).

    Live metrics (``metrics.jsonl`` in each run's folder is the record of truth, always
    written): ``tensorboard`` writes every step's metrics as TensorBoard scalars to
    ``runs/<run>/tensorboard`` (``auto``: when ``tensorboardX`` or ``tensorboard`` is installed,
    the ``tensorboard`` extra; ``true``: required; ``false``: never); ``wandb_project`` also logs
    them to Weights & Biases in that project (needs the ``wandb`` package; null: not).

    Update memory (:class:`~agentrl_jax.train.TrainConfig`'s fields of the same names; none
    changes the numbers): ``remat`` (null: none, or ``full``, ``dots``, ``offload``: what
    each layer keeps for the backward pass), ``attention`` (``xla``, ``blocked``, ``cudnn``,
    ``splash``, ``auto``; the warm start's forward uses it too), ``logits_chunk`` (positions
    per chunk of the output head). The head runs only at sampled positions, at most
    ``t_max x max_response_tokens`` per row.
    """

    runs: tuple[Any, ...] = ("grpo", "budgetmix", "budgetmix-adaptive")
    algorithm: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    steps: int = 40
    tasks_per_step: int = 8
    group_size: int = 8  # G (paper: 16)
    temperature: float = 1.0  # rollout temperature (paper: 1.0)
    top_p: float = 1.0
    scoring: str = "model"  # log-probs under the model's or the rollout's distribution
    learning_rate: float = (
        1e-3  # paper: 1e-6 (Qwen3-4B/8B); 2e-3 breaks the tiny default (notebooks/rl_sweep.md)
    )
    weight_decay: float = 0.01
    max_grad_norm: float | None = 1.0
    kl_coef: float = (
        0.05  # paper: 0.001; 0.05 keeps the tiny default's answer format (notebooks/rl_sweep.md)
    )
    # how GRPO, GiGPO, PPO and RLOO average their token losses (presets with their own keep it):
    # GRPO's own per-sequence mean (DeepSeekMath); with token-mean, failed episodes (longer)
    # outweigh successes and push every sampled token down (notebooks/rl_sweep.md)
    aggregation: str = "seq-mean-token-mean"
    clip_low: float = 0.2
    clip_high: float = 0.2
    gigpo_omega: float = 1.0
    gigpo_gamma: float = 0.95
    critic_learning_rate: float = 1e-5
    value_clip: float = 0.5
    gae_gamma: float = 1.0
    gae_lambda: float = 1.0
    epochs: int = 1
    mini_batches: int = 1
    num_micro_batches: int = 1
    checkpoint_every: int = 10
    seed: int = 0
    kv_cache_dtype: str | None = None
    max_rows_per_call: int | None = None
    prefill_chunk: int | None = None
    generation_layout: str = "auto"
    kv_page_size: int | None = KV_PAGE_SIZE
    kv_pages: int | None = None
    refill: bool = False
    remat: str | None = None
    attention: str = "blocked"
    logits_chunk: int = 512
    tensorboard: str | bool = "auto"
    wandb_project: str | None = None

    def __post_init__(self):
        if isinstance(self.runs, str) or not isinstance(self.runs, Sequence) or not self.runs:
            raise ConfigError(
                f"rl.runs: must be a non-empty list of runs, each a preset name "
                f"({', '.join(RUN_PRESETS)}) or a mapping {{name, preset, label, budget_mix, "
                f"algorithm}}, got {short_repr(self.runs)}"
            )
        object.__setattr__(self, "runs", tuple(plain_data(r) for r in self.runs))
        object.__setattr__(
            self, "algorithm", plain_data(check_algorithm_overrides("rl.algorithm", self.algorithm))
        )
        _validate(
            self,
            {
                "steps": _int(1),
                "tasks_per_step": _int(1),
                "group_size": _int(2),
                "temperature": _real(0.0, lo_open=True),
                "top_p": _real(0.0, 1.0, lo_open=True),
                "scoring": one_of(SCORING),
                "learning_rate": _real(0.0, lo_open=True),
                "weight_decay": _real(0.0),
                "max_grad_norm": _optional(_real(0.0, lo_open=True)),
                "kl_coef": _real(0.0),
                "aggregation": one_of(AGGREGATION_MODES),
                "clip_low": _CLIP_LOW,
                "clip_high": _real(0.0, lo_open=True),
                "gigpo_omega": _real(0.0),
                "gigpo_gamma": _real(0.0, 1.0),
                "critic_learning_rate": _real(0.0, lo_open=True),
                "value_clip": _real(0.0, lo_open=True),
                "gae_gamma": _real(0.0, 1.0),
                "gae_lambda": _real(0.0, 1.0),
                "epochs": _int(1),
                "mini_batches": _int(1),
                "num_micro_batches": _int(1),
                "checkpoint_every": _int(1),
                "seed": _int(0),
                "kv_cache_dtype": one_of(DTYPES, nullable=True),
                "max_rows_per_call": _optional(_int(1)),
                "prefill_chunk": _optional(_int(1)),
                "generation_layout": one_of(GENERATION_LAYOUTS),
                "kv_page_size": _optional(_int(1)),
                "kv_pages": _optional(_int(1)),
                "refill": BOOL,
                "remat": one_of(REMAT_POLICIES, nullable=True),
                "attention": one_of(ATTENTION_IMPLEMENTATIONS),
                "logits_chunk": _int(1),
                "tensorboard": one_of(TENSORBOARD),
                "wandb_project": (
                    lambda v: v is None or (isinstance(v, str) and v.strip() != ""),
                    "null or a W&B project name",
                ),
            },
        )
        rows = self.tasks_per_step * self.group_size
        if rows % self.mini_batches:
            raise ConfigError(
                f"rl.mini_batches: must divide tasks_per_step x group_size "
                f"({rows}), got {self.mini_batches}"
            )
        per_update = rows // self.mini_batches
        if per_update % self.num_micro_batches:
            divided = " / mini_batches" if self.mini_batches > 1 else ""
            raise ConfigError(
                f"rl.num_micro_batches: must divide tasks_per_step x group_size{divided} "
                f"({per_update}), got {self.num_micro_batches}"
            )
        if self.max_rows_per_call is not None and self.max_rows_per_call % self.group_size:
            raise ConfigError(
                f"rl.max_rows_per_call: must be a multiple of group_size "
                f"({self.group_size}), so task groups stay whole, got "
                f"{self.max_rows_per_call}"
            )
        from agentrl_jax.train.loop import tensorboard_available  # noqa: PLC0415 (jax, lazily)

        if self.tensorboard is True and not tensorboard_available():
            raise ConfigError(
                "rl.tensorboard: true needs tensorboardX (pip install -e '.[tensorboard]') "
                "or tensorboard with torch; neither is installed ('auto' skips it)"
            )
        if self.wandb_project is not None and importlib.util.find_spec("wandb") is None:
            raise ConfigError(
                f"rl.wandb_project: logging to W&B project {self.wandb_project!r} needs "
                "the wandb package (pip install wandb); it is not installed"
            )
        if self.kv_pages is not None and self.kv_page_size is None:
            raise ConfigError(
                f"rl.kv_pages: a pool of {self.kv_pages} pages needs the paged KV "
                "cache (rl.kv_page_size), got kv_page_size: null"
            )
        if self.refill and self.max_rows_per_call is None:
            raise ConfigError(
                "rl.refill: continuous batching needs rl.max_rows_per_call (the "
                "rows in flight), got refill: true with max_rows_per_call: null"
            )
        self.resolved_runs()  # every run's algorithm builds (errors name rl.runs[i])

    def resolved_runs(self) -> tuple[RunSettings, ...]:
        """``runs`` resolved: each run's name, label, BudgetMix and AlgorithmConfig."""
        return resolve_runs(self)

    @property
    def run_names(self) -> tuple[str, ...]:
        return tuple(run.name for run in self.resolved_runs())


_SECTION_NAMES = {
    TaskSettings: "task",
    ModelSettings: "model",
    WarmStartSettings: "warm_start",
    RLSettings: "rl",
}
