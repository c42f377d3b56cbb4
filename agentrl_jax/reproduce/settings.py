"""The reproduction's own config sections: ``model`` (:class:`ModelConfig`, the initial policy)
and ``warm_start`` (:class:`WarmStartConfig`, behaviour cloning into the base policy): frozen
dataclasses, each field checked on construction by :func:`agentrl_jax.validation.validate` (a
:class:`~agentrl_jax.errors.ConfigError` naming ``section.field``). :mod:`.config` assembles
them with the library's sections into :class:`~agentrl_jax.reproduce.config.ReproduceConfig`.
"""

from __future__ import annotations

import dataclasses

from agentrl_jax.errors import ConfigError
from agentrl_jax.validation import (
    BOOL,
    MAX_COUNT,
    MAX_LAYERS,
    MAX_RATE,
    MAX_ROWS,
    MAX_SAMPLES,
    MAX_SEED,
    MAX_STEPS,
    MAX_VOCAB,
    MAX_WIDTH,
    Check,
    check_fields,
    integer,
    one_of,
    real,
    setting,
)

DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The policy. ``model_dir`` (a local Hugging Face Qwen3 directory, e.g. Qwen3-4B) is loaded
    with its tokenizer; without it a Qwen3 of the dimensions below is initialised at random and
    a byte-level BPE tokenizer of ``tokenizer_vocab`` tokens is built from the task's text;
    ``tokenizer_isolate`` makes that tokenizer keep the pieces the environment's study declares
    (:attr:`agentrl_jax.reproduce.studies.Study.tokenizer_isolate`; FrozenLake: every grid cell) as
    tokens of their own instead of merging them with their neighbours."""

    model_dir: str | None = setting(
        None, Check(lambda v: v is None or (isinstance(v, str) and v != ""), "null or a path")
    )
    hidden_size: int = setting(64, integer(2, MAX_WIDTH))
    intermediate_size: int = setting(192, integer(1, MAX_WIDTH))
    num_hidden_layers: int = setting(2, integer(1, MAX_LAYERS))
    num_attention_heads: int = setting(4, integer(1, MAX_LAYERS))
    num_key_value_heads: int = setting(2, integer(1, MAX_LAYERS))
    head_dim: int = setting(
        16,
        Check(
            lambda v: integer(2, 1024).test(v) and v % 2 == 0, "an even int in [2, 1024]", 2, 1024
        ),
    )
    # a byte-level BPE: its 256 bytes and special tokens, then merges
    tokenizer_vocab: int = setting(768, integer(261, MAX_VOCAB))
    tokenizer_isolate: bool = setting(False, BOOL)
    dtype: str = setting("float32", one_of(DTYPES))  # compute dtype (parameters stay float32)
    seed: int = setting(0, integer(0, MAX_SEED))

    def __post_init__(self):
        check_fields("model", self)
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
class WarmStartConfig:
    """Supervised warm-start of the random policy into a competent but fallible base policy.

    Demonstrations are played in the real rollout by the environment study's budget-aware
    demonstrator (FrozenLake: Q*-greedy under the remaining budget; the others: each task's gold
    replies), which makes a mistake (FrozenLake: a uniformly random other move; the others:
    another task's reply) with probability ``mistake_rate``; budgets are drawn as in BudgetMix so
    the base sees every budget level. ``enabled: false`` keeps the model as it is (a pretrained
    Qwen3).
    """

    enabled: bool = setting(True, BOOL)
    demo_tasks: int = setting(256, integer(1, MAX_COUNT))  # training tasks demonstrated (the first)
    demos_per_task: int = setting(4, integer(1, MAX_SAMPLES))
    mistake_rate: float = setting(0.25, real(0.0, 1.0))
    epochs: int = setting(3, integer(1, MAX_STEPS))
    batch_size: int = setting(32, integer(1, MAX_ROWS))
    learning_rate: float = setting(3e-3, real(0.0, MAX_RATE, lo_open=True))
    weight_decay: float = setting(0.01, real(0.0, MAX_RATE))
    # batch demos of similar lengths, each batch at its own width
    group_by_length: bool = setting(False, BOOL)
    seed: int = setting(0, integer(0, MAX_SEED))

    def __post_init__(self):
        check_fields("warm_start", self)
