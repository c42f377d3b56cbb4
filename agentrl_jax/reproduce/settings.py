"""The reproduction's own config sections: ``model`` (:class:`ModelConfig`, the initial policy)
and ``warm_start`` (:class:`WarmStartConfig`, behaviour cloning into the base policy): frozen
dataclasses, each field checked on construction by :func:`agentrl_jax.validation.validate` (a
:class:`~agentrl_jax.errors.ConfigError` naming ``section.field``). :mod:`.config` assembles
them with the library's sections into :class:`~agentrl_jax.reproduce.config.ReproduceConfig`.
"""

from __future__ import annotations

import dataclasses

from agentrl_jax.errors import ConfigError
from agentrl_jax.validation import BOOL, integer, one_of, real, validate

DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
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
        validate(
            "model",
            self,
            {
                "model_dir": (
                    lambda v: v is None or (isinstance(v, str) and v != ""),
                    "null or a path",
                ),
                "hidden_size": integer(2),
                "intermediate_size": integer(1),
                "num_hidden_layers": integer(1),
                "num_attention_heads": integer(1),
                "num_key_value_heads": integer(1),
                "head_dim": (lambda v: integer(2)[0](v) and v % 2 == 0, "an even int >= 2"),
                "tokenizer_vocab": integer(261),
                "tokenizer_isolate": BOOL,
                "dtype": one_of(DTYPES),
                "seed": integer(0),
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
class WarmStartConfig:
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
        validate(
            "warm_start",
            self,
            {
                "enabled": BOOL,
                "group_by_length": BOOL,
                "demo_tasks": integer(1),
                "demos_per_task": integer(1),
                "mistake_rate": real(0.0, 1.0),
                "epochs": integer(1),
                "batch_size": integer(1),
                "learning_rate": real(0.0, lo_open=True),
                "weight_decay": real(0.0),
                "seed": integer(0),
            },
        )
