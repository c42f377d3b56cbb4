"""The trainer's configuration: a frozen, validated, hashable dataclass.

:class:`TrainConfig` holds everything the train step and loop need besides the model: the
algorithm (advantage estimator and loss terms, :class:`~agentrl_jax.algorithms.AlgorithmConfig`),
the optimizers, micro-batching, process-reward shaping, run length, checkpointing and the seed.
It is validated on construction (a bad value raises :class:`~agentrl_jax.errors.ConfigError`, a
``ValueError``, naming the field, through :func:`agentrl_jax.validation.validate`) and is
hashable, so a jitted step can close over it. Defaults are the paper's (§4): AdamW with
learning rate 1e-6 and weight decay 0.01, critic learning rate 1e-5, KL coefficient 0.001 (in
``algorithm``), group-relative GRPO.

The KL coefficient lives in ``algorithm`` (the ``"kl"`` loss term), so there is one source of
truth; :attr:`TrainConfig.kl_coef` reads it. What the step computes (entropy, reference
log-probs, a critic) follows from the inputs the configured estimator and terms declare
(:mod:`agentrl_jax.train.inputs`), whatever their names; an algorithm asking for an input the
step cannot compute is refused here. ``to_dict``/``from_dict`` round-trip through plain
JSON/YAML data, which is how checkpoints store the config.

Consistent log-probs: a rollout draws tokens from a tempered, top-k/top-p truncated
distribution over the tokenizer's vocabulary (``SamplingConfig``), while the model's own
distribution is temperature 1 over every embedding row. The ratio and the KL of the loss are
only what they claim when the trainer scores tokens under the distribution they were drawn
from. Two options: ``scoring="sampling"`` scores every log-prob (current, old, reference)
under the rollout's distribution (``sampling_*``, ``valid_vocab_size``; the kept top-p set is
chosen without gradient, the sampled token always in it), so the old log-probs equal the
sampler's ``Trajectory.sampling_logprobs``; or keep ``scoring="model"`` and correct the
mismatch with truncated importance sampling, the ``"policy_clip_tis"`` loss term (weights
``min(pi_old / mu, cap)`` with ``mu`` the sampler's recorded probabilities). Either way the
step logs ``sampler_gap_mean``/``sampler_gap_max``, the ``|log-prob|`` gap between the sampler
and the trainer on the same distribution at the rollout's parameters.

PPO-style optimisation: each rollout batch is used for ``epochs`` passes, each split into
``mini_batches`` mini-batches (rows shuffled per epoch), one optimizer update per
mini-batch, so ``epochs x mini_batches`` updates per batch (verl's ``ppo_epochs`` and
``ppo_mini_batch_size`` = rows / ``mini_batches``); ``num_micro_batches`` then splits each
mini-batch for gradient accumulation.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Mapping

from agentrl_jax.algorithms import AlgorithmConfig, LossTermConfig
from agentrl_jax.errors import ConfigError
from agentrl_jax.models.attention import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS
from agentrl_jax.models.qwen3 import REMAT_POLICIES
from agentrl_jax.sampling.filters import SamplingConfig
from agentrl_jax.train.inputs import check_inputs, step_inputs
from agentrl_jax.validation import validate

SCORING = ("model", "sampling")


def _is_real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Trainer settings. See the module docstring; each field's check is in ``_CHECKS``."""

    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    # policy optimizer: optax.adamw after global-norm clipping
    learning_rate: float = 1e-6
    weight_decay: float = 0.01
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    max_grad_norm: float | None = 1.0  # None: no clipping
    # critic optimizer (PPO): its own AdamW, same betas/eps/clipping
    critic_learning_rate: float = 1e-5
    critic_weight_decay: float = 0.01
    # PPO-style optimisation: passes over each rollout batch, and mini-batches (one update
    # each) per pass, rows shuffled per pass (see step.py)
    epochs: int = 1
    mini_batches: int = 1
    # gradient accumulation: each mini-batch's rows split into this many micro-batches
    # (strided, see step.py)
    num_micro_batches: int = 1
    # memory (see step.py): what each layer keeps for the backward pass (a REMAT_POLICIES
    # name of agentrl_jax.models.qwen3; None: the model's own setting); the static bound on
    # loss (sampled) tokens per row at which the head runs (None: every position); positions
    # per chunk of the head's log-softmax; the attention implementation of the no-cache
    # forward (agentrl_jax.models.attention.IMPLEMENTATIONS)
    remat: str | None = None
    loss_positions: int | None = None
    logits_chunk: int = 512
    attention: str = "xla"
    # the distribution sampled tokens are scored under (the policy's, the old and the
    # reference log-probs alike): "model", the model's own (temperature 1, whole vocabulary);
    # "sampling", the rollout's (the sampling_* fields and valid_vocab_size below: set them to
    # the rollout's SamplingConfig), the one the tokens were drawn from. See the module doc.
    scoring: str = "model"
    sampling_temperature: float = 1.0
    sampling_top_k: int = 0
    sampling_top_p: float = 1.0
    valid_vocab_size: int | None = None
    # the most sampled (response) tokens a row can hold, e.g. T_max x max response tokens per
    # turn: DAPO's overlong L_max and Dr. GRPO's constant (an algorithm's aggregation_constant
    # None) are this length; None when no such setting is used. The constant is filled in on
    # construction: a dataclasses.replace of this field later keeps the one filled in first.
    max_response_length: int | None = None
    # process rewards (§8): weight of the per-step scores added to the outcome reward
    process_reward_coef: float = 0.0
    # GiGPO anchors (s_t, B - t) instead of s_t (BudgetMix, §5)
    budget_anchors: bool = False
    # run
    total_steps: int = 100
    checkpoint_every: int = 10
    checkpoint_keep: int = 3
    seed: int = 0

    def __post_init__(self):
        if isinstance(self.algorithm, Mapping):
            try:
                object.__setattr__(self, "algorithm", AlgorithmConfig.from_dict(self.algorithm))
            except ValueError as e:
                raise ValueError(f"TrainConfig.algorithm: {e}") from None
        if not isinstance(self.algorithm, AlgorithmConfig):
            raise ValueError(
                f"TrainConfig.algorithm: must be an AlgorithmConfig or mapping, "
                f"got {self.algorithm!r}"
            )
        validate("TrainConfig", self, _CHECKS)
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
        """The sampling distribution log-probs are scored under (``scoring="sampling"``), or
        None for the model's own distribution."""
        if self.scoring == "model":
            return None
        return SamplingConfig(
            temperature=self.sampling_temperature,
            top_k=self.sampling_top_k,
            top_p=self.sampling_top_p,
            valid_vocab_size=self.valid_vocab_size,
        )

    @property
    def updates_per_batch(self) -> int:
        """Optimizer updates per rollout batch: ``epochs x mini_batches``."""
        return self.epochs * self.mini_batches

    # ------------------------------------------------------------------ plain data
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data; ``TrainConfig.from_dict(c.to_dict()) == c``."""
        out = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "algorithm"
        }
        out["algorithm"] = algorithm_to_dict(self.algorithm)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TrainConfig":
        """Builds from plain data (YAML, a checkpoint's JSON); unknown keys are errors."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(
                f"TrainConfig: unknown field {unknown[0]!r}; known: {', '.join(sorted(known))}"
            )
        return cls(**d)


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


def _positive_real(v) -> bool:
    return _is_real(v) and v > 0


def _non_negative_real(v) -> bool:
    return _is_real(v) and v >= 0


def _positive_int(v) -> bool:
    return _is_int(v) and v >= 1


_CHECKS: dict[str, tuple[Any, str]] = {
    "learning_rate": (_positive_real, "a finite number > 0"),
    "weight_decay": (_non_negative_real, "a finite number >= 0"),
    "adam_b1": (lambda v: _is_real(v) and 0 <= v < 1, "a number in [0, 1)"),
    "adam_b2": (lambda v: _is_real(v) and 0 <= v < 1, "a number in [0, 1)"),
    "adam_eps": (_positive_real, "a finite number > 0"),
    "max_grad_norm": (lambda v: v is None or _positive_real(v), "None or a finite number > 0"),
    "critic_learning_rate": (_positive_real, "a finite number > 0"),
    "critic_weight_decay": (_non_negative_real, "a finite number >= 0"),
    "epochs": (_positive_int, "an int >= 1"),
    "mini_batches": (_positive_int, "an int >= 1"),
    "num_micro_batches": (_positive_int, "an int >= 1"),
    "remat": (lambda v: v is None or v in REMAT_POLICIES, f"None or one of {REMAT_POLICIES}"),
    "loss_positions": (lambda v: v is None or _positive_int(v), "None or an int >= 1"),
    "logits_chunk": (_positive_int, "an int >= 1"),
    "attention": (lambda v: v in ATTENTION_IMPLEMENTATIONS, f"one of {ATTENTION_IMPLEMENTATIONS}"),
    "scoring": (lambda v: v in SCORING, f"one of {SCORING}"),
    "sampling_temperature": (
        _positive_real,
        "a finite number > 0 (greedy rollouts have no distribution to score under)",
    ),
    "sampling_top_k": (lambda v: _is_int(v) and v >= 0, "an int >= 0 (0: off)"),
    "sampling_top_p": (lambda v: _is_real(v) and 0 < v <= 1, "a number in (0, 1]"),
    "valid_vocab_size": (lambda v: v is None or _positive_int(v), "None or an int >= 1"),
    "max_response_length": (lambda v: v is None or _positive_int(v), "None or an int >= 1"),
    "process_reward_coef": (_non_negative_real, "a finite number >= 0"),
    "budget_anchors": (lambda v: isinstance(v, bool), "a bool"),
    "total_steps": (_positive_int, "an int >= 1"),
    "checkpoint_every": (_positive_int, "an int >= 1"),
    "checkpoint_keep": (_positive_int, "an int >= 1"),
    "seed": (lambda v: _is_int(v) and 0 <= v < 2**32, "an int in [0, 2**32)"),
}
