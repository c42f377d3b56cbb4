"""The sampling engine's settings (the ``engine`` section of a config): one for the training
rollouts and the evaluation alike. None of them changes the tokens sampled; they trade memory
and speed. And how tokens are drawn (:class:`SamplingSettings`: ``rl.sampling`` and
``eval.sampling``, one class for both).

``kv_cache_dtype`` is the KV cache's dtype (null: the model's compute dtype);
``prefill_chunk`` feeds prompts to the KV cache this many tokens at a time (null: whole);
``kv_page_size`` (default 16; null: one static cache of the whole context per row, the
reference engine) runs rollouts on the paged KV cache with pages of that many tokens (on a
mesh with ``tensor`` = 1 each batch shard pages its own rows; ``tensor`` > 1 needs null):
attention reads only the pages in use and finished rows free theirs; ``kv_pages`` bounds the
pool (null: room for every row in flight at ``task.max_context``; fewer: a row that finds no
page is preempted and its turn replayed, with the same tokens, once pages are free);
``generation_layout`` is where the sampler reads the weights from: ``auto`` (replicated over
``fsdp`` when the mesh has ``fsdp`` > 1, so decode all-gathers no weights), ``replicated`` or
``training`` (the train step's FSDP layout).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from agentrl_jax.errors import ConfigError
from agentrl_jax.sampling.filters import SamplingConfig
from agentrl_jax.sampling.sampler import Paging
from agentrl_jax.sharding import GENERATION_LAYOUTS
from agentrl_jax.validation import (
    MAX_CONTEXT,
    MAX_TEMPERATURE,
    MAX_TOKENS,
    MAX_VOCAB,
    check_fields,
    integer,
    one_of,
    optional,
    real,
    setting,
)

KV_CACHE_DTYPES = ("float32", "bfloat16")
KV_PAGE_SIZE = 16  # the page size the reproduction and the evaluation use by default


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The sampling engine (module docstring), validated on construction."""

    kv_cache_dtype: str | None = setting(None, one_of(KV_CACHE_DTYPES, nullable=True))
    prefill_chunk: int | None = setting(None, optional(integer(1, MAX_CONTEXT)))
    kv_page_size: int | None = setting(KV_PAGE_SIZE, optional(integer(1, MAX_CONTEXT)))
    # pages of the pool: at most one per token of MAX_TOKENS' rows x context
    kv_pages: int | None = setting(None, optional(integer(1, MAX_TOKENS)))
    generation_layout: str = setting("auto", one_of(GENERATION_LAYOUTS))

    def __post_init__(self):
        check_fields("engine", self)
        if self.kv_pages is not None and self.kv_page_size is None:
            raise ConfigError(
                f"engine.kv_pages: a pool of {self.kv_pages} pages needs the paged KV cache "
                "(engine.kv_page_size), got kv_page_size: null"
            )

    @property
    def paging(self) -> Paging | None:
        """The paged cache's settings (None: the static cache)."""
        if self.kv_page_size is None:
            return None
        return Paging(page_size=self.kv_page_size, num_pages=self.kv_pages)


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """How a rollout turns logits into tokens, as a config states it: ``rl.sampling`` (the
    training rollouts; paper §4: temperature 1) and ``eval.sampling`` (the evaluation's
    decoding; paper §3: temperature 0.6, top-p 0.9), one class. ``temperature`` 0 is greedy;
    ``top_k`` 0 and ``top_p`` 1 are off. :meth:`config` gives the engine's
    :class:`~agentrl_jax.sampling.filters.SamplingConfig`."""

    temperature: float = setting(1.0, real(0.0, MAX_TEMPERATURE))
    top_k: int = setting(
        0, integer(0, MAX_VOCAB)._replace(expect=f"an int in [0, {MAX_VOCAB}] (0: off)")
    )
    top_p: float = setting(1.0, real(0.0, 1.0, lo_open=True))

    def __post_init__(self):
        check_fields("sampling", self)

    def config(self, valid_vocab_size: int | None = None) -> SamplingConfig:
        """The engine's sampling config (``valid_vocab_size``: the tokenizer's vocabulary where
        it is below the model's)."""
        return SamplingConfig(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            valid_vocab_size=valid_vocab_size,
        )


def kv_cache_bytes(engine: EngineConfig, model: Any, rows: int, context: int, dtype: Any) -> int:
    """Bytes of the KV cache a rollout of ``rows`` rows of ``context`` tokens holds: K and V of
    every layer, key-value head and head dimension per token, in the cache's dtype
    (``engine.kv_cache_dtype``, else ``dtype``, the model's compute dtype); the paged pool's
    ``kv_pages x kv_page_size`` tokens where ``engine.kv_pages`` bounds it. ``model`` is a
    :class:`~agentrl_jax.models.config.Qwen3Config`."""
    tokens = rows * context
    if engine.kv_pages is not None:
        tokens = engine.kv_pages * engine.kv_page_size
    itemsize = np.dtype(engine.kv_cache_dtype or dtype).itemsize
    return (
        2 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim * tokens * itemsize
    )
