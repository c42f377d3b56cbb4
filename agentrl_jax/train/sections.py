"""The ``rl`` section's subsections, each a frozen class validated on construction (its fields'
declared checks beside them; a :class:`~agentrl_jax.errors.ConfigError` names the full path,
e.g. ``rl.optimizer.learning_rate``, once :class:`~agentrl_jax.train.config.RLConfig` holds
it): ``optimizer`` (AdamW and the critic's), ``batching`` (epochs, mini-batches,
micro-batches), ``memory`` (what the update keeps, none changes the numbers),
``asynchronous`` (sampling ahead of the updates), ``checkpoint`` and ``logging`` (live
metrics). The rollouts' ``sampling`` is :class:`~agentrl_jax.sampling.config.SamplingSettings`,
the class ``eval`` holds too; ``lora`` is :class:`~agentrl_jax.models.lora.LoraConfig`."""

from __future__ import annotations

import dataclasses
import importlib.util

from agentrl_jax.errors import ConfigError
from agentrl_jax.models.attention import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS
from agentrl_jax.models.qwen3 import REMAT_POLICIES
from agentrl_jax.validation import (
    BOOL,
    MAX_COEF,
    MAX_CONTEXT,
    MAX_RATE,
    MAX_ROWS,
    MAX_STALENESS,
    MAX_STEPS,
    Check,
    check_fields,
    integer,
    one_of,
    optional,
    real,
    setting,
)

TENSORBOARD = ("auto", True, False)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW (``learning_rate``, ``weight_decay``, ``adam_*``) after global-norm clipping at
    ``max_grad_norm`` (null: none); a critic (PPO) has its own AdamW (``critic_learning_rate``,
    ``critic_weight_decay``). Paper §4: learning rate 1e-6, weight decay 0.01, critic 1e-5."""

    learning_rate: float = setting(1e-6, real(0.0, MAX_RATE, lo_open=True))
    weight_decay: float = setting(0.01, real(0.0, MAX_RATE))
    adam_b1: float = setting(0.9, real(0.0, 1.0, hi_open=True))
    adam_b2: float = setting(0.999, real(0.0, 1.0, hi_open=True))
    adam_eps: float = setting(1e-8, real(0.0, 1.0, lo_open=True))
    max_grad_norm: float | None = setting(1.0, optional(real(0.0, MAX_COEF, lo_open=True)))
    critic_learning_rate: float = setting(1e-5, real(0.0, MAX_RATE, lo_open=True))
    critic_weight_decay: float = setting(0.01, real(0.0, MAX_RATE))

    def __post_init__(self):
        check_fields("optimizer", self)


@dataclasses.dataclass(frozen=True)
class BatchingConfig:
    """Each rollout batch is used for ``epochs`` passes, each split into ``mini_batches``
    mini-batches (rows shuffled per epoch), one optimizer update per mini-batch;
    ``num_micro_batches`` splits each mini-batch for gradient accumulation (the same gradient,
    less memory). That they divide the step's rows is :class:`RLConfig`'s check, which knows
    the rows."""

    epochs: int = setting(1, integer(1, MAX_STEPS))
    mini_batches: int = setting(1, integer(1, MAX_ROWS))
    num_micro_batches: int = setting(1, integer(1, MAX_ROWS))

    def __post_init__(self):
        check_fields("batching", self)

    @property
    def updates_per_batch(self) -> int:
        """Optimizer updates per rollout batch: ``epochs x mini_batches``."""
        return self.epochs * self.mini_batches


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
    """What the update keeps in memory; none changes the numbers. ``remat`` (null, ``full``,
    ``dots``, ``offload``: what each layer keeps for the backward pass), ``attention``
    (``xla``, ``blocked``, ``cudnn``, ``splash``, ``auto``), ``logits_chunk`` (positions per
    chunk of the output head, which runs only at sampled positions), ``packing`` (several
    trajectories per row of the update, each attending within itself:
    :mod:`agentrl_jax.train.packing`; the same losses and gradients with fewer padded
    positions)."""

    remat: str | None = setting(None, one_of(REMAT_POLICIES, nullable=True))
    attention: str = setting("xla", one_of(ATTENTION_IMPLEMENTATIONS))
    logits_chunk: int = setting(512, integer(1, MAX_CONTEXT))
    packing: bool = setting(False, BOOL)

    def __post_init__(self):
        check_fields("memory", self)


@dataclasses.dataclass(frozen=True)
class AsynchronousConfig:
    """Asynchronous training (§4): ``max_staleness`` k lets the rollouts of the next k updates
    be sampled by parameters up to k updates old, so they run while an update trains (0: the
    synchronous loop; :mod:`agentrl_jax.train.loop`). Each policy term's per-token loss of such
    a batch is weighted by the truncated importance weight ``min(pi_old / mu, off_policy_cap)``
    (``mu`` the sampler's recorded log-prob), unless a term reads ``sampler_logprobs`` and
    corrects itself."""

    max_staleness: int = setting(0, integer(0, MAX_STALENESS))
    off_policy_cap: float = setting(2.0, real(0.0, MAX_COEF, lo_open=True))

    def __post_init__(self):
        check_fields("asynchronous", self)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints every ``every`` updates, the newest ``keep`` kept."""

    every: int = setting(10, integer(1, MAX_STEPS))
    keep: int = setting(2, integer(1, 1000))

    def __post_init__(self):
        check_fields("checkpoint", self)


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """Live metrics (each run's ``metrics.jsonl`` is the record of truth, always written):
    ``tensorboard`` (``auto``: when ``tensorboardX`` or ``tensorboard`` is installed; ``true``:
    required; ``false``: never) and ``wandb_project`` (Weights & Biases; null: not)."""

    tensorboard: str | bool = setting("auto", one_of(TENSORBOARD))
    wandb_project: str | None = setting(
        None,
        Check(
            lambda v: v is None or (isinstance(v, str) and v.strip() != ""),
            "null or a W&B project name",
        ),
    )

    def __post_init__(self):
        check_fields("logging", self)
        from agentrl_jax.train.sinks import tensorboard_available  # noqa: PLC0415

        if self.tensorboard is True and not tensorboard_available():
            raise ConfigError(
                "logging.tensorboard: true needs tensorboardX (pip install -e '.[tensorboard]') "
                "or tensorboard with torch; neither is installed ('auto' skips it)"
            )
        if self.wandb_project is not None and importlib.util.find_spec("wandb") is None:
            raise ConfigError(
                f"logging.wandb_project: logging to W&B project {self.wandb_project!r} needs "
                "the wandb package (pip install wandb); it is not installed"
            )
