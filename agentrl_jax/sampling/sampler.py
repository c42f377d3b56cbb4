"""Batched, jitted prefill / decode / continuation over a static-shape KV cache.

A multi-turn rollout is a sequence of calls on one :class:`SamplerState`::

    sampler = Sampler(model, max_new_tokens=64, stop_token_ids=eos_ids)
    params = nnx.state(model)
    state = sampler.init(batch_size=8, max_len=1024)
    state = sampler.append(params, state, prompt_tokens, prompt_mask)      # prefill
    for turn in range(turns):
        state, out = sampler.decode(params, state, keys[turn], SamplingConfig(top_p=0.9))
        state = sampler.append(params, state, observation_tokens, observation_mask)

``append`` writes each row's real tokens (mask True; padding may sit anywhere) after that row's
cached tokens and keeps the final hidden state of its last one, so prefill and an environment
observation in a later turn are the same call and the prefix is never re-encoded. ``decode``
samples up to ``max_new_tokens`` tokens per row in one ``lax.while_loop`` that ends once every
row has stopped (a stop token, its budget, or a full cache); every sampled token, the last
included, is written to the cache, so the next ``append`` continues right after it.

Shapes are static: the cache is ``[B, max_len]`` per layer, decode output ``[B,
max_new_tokens]``; a different per-row budget, prompt length or observation length inside a
chunk width changes no shape. Each distinct chunk width ``L`` of ``append`` compiles once (pad
chunks to a few widths with :func:`agentrl_jax.sampling.padding.pad_rows`), ``decode`` once per
``SamplingConfig`` and ``init`` once per ``(batch, max_len)``; so a 10-turn rollout compiles a
fixed handful of times. Decode steps run :mod:`agentrl_jax.sampling.decode_step`, the model's
one-token forward with matrix products ordered for small batches.

Rows never overflow silently: a chunk that does not fit in a row's free slots is not written at
all, and a row with no free slot for its next sampled token stops with
``StopReason.CONTEXT_FULL``; either sets the row's sticky ``overflowed`` flag, after which
``append`` and ``decode`` leave the row untouched. Rows that stopped, are inactive or have
overflowed still flow through the batched matmuls (static shapes) but never write the cache.

Randomness comes only from ``key``: step ``t`` of a decode uses ``fold_in(key, t)``, so the same
key and inputs give the same tokens, on one device or sharded (threefry is partitionable).
"""

from __future__ import annotations

import collections
import enum
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from agentrl_jax.models.config import Qwen3Config
from agentrl_jax.models.qwen3 import KVCache, Qwen3ForCausalLM, positions_from_mask
from agentrl_jax.sampling.decode_step import decode_hidden, next_token_logits, split_layers
from agentrl_jax.sampling.filters import SamplingConfig, model_log_probs, sample
from agentrl_jax.sharding import BATCH_AXES, KV_CACHE_RULES, tree_shardings


class StopReason(enum.IntEnum):
    """Why a row's decode ended (``SampleOutput.stop_reason``, int32)."""

    NOT_RUN = 0       # inactive, overflowed earlier, nothing cached, or a budget of 0
    STOP_TOKEN = 1    # sampled a stop token (it is the row's last output token)
    BUDGET = 2        # produced its budget of tokens
    CONTEXT_FULL = 3  # no cache slot left for the next token; the row is now ``overflowed``


@struct.dataclass
class SamplerState:
    """Everything a row needs to continue: its cache and its pending next-token state."""

    cache: KVCache
    hidden: jax.Array      # [B, hidden_size] final hidden state of each row's last cached token
    overflowed: jax.Array  # [B] bool, sticky: a chunk or a sampled token did not fit

    @property
    def lengths(self) -> jax.Array:
        """``[B]`` int32: tokens cached per row."""
        return self.cache.lengths


@struct.dataclass
class SampleOutput:
    """One decode call's result; entries at or after ``lengths[b]`` are padding."""

    tokens: jax.Array              # [B, N] int32, pad_token_id after the row's length
    log_probs: jax.Array           # [B, N] float32: under the model (temperature 1, untruncated)
    sampling_log_probs: jax.Array  # [B, N] float32: under the sampling distribution (greedy: 0)
    lengths: jax.Array             # [B] int32
    stop_reason: jax.Array         # [B] int32, a StopReason

    @property
    def mask(self) -> jax.Array:
        """``[B, N]`` bool, True for sampled tokens."""
        return jnp.arange(self.tokens.shape[1]) < self.lengths[:, None]


# ---------------------------------------------------------------------------- pure functions
def init_state(config: Qwen3Config, batch_size: int, max_len: int,
               dtype: Any = jnp.float32) -> SamplerState:
    """An empty state: ``batch_size`` rows of ``max_len`` cache slots in ``dtype``."""
    if batch_size < 1 or max_len < 1:
        raise ValueError(f"batch_size and max_len must be >= 1, got {batch_size}, {max_len}")
    return SamplerState(cache=KVCache.empty(config, batch_size, max_len, dtype),
                        hidden=jnp.zeros((batch_size, config.hidden_size), dtype),
                        overflowed=jnp.zeros((batch_size,), bool))


def append(model: Qwen3ForCausalLM, state: SamplerState, tokens: jax.Array, mask: jax.Array,
           constrain: Callable[[Any], Any] = lambda x: x) -> SamplerState:
    """Cache each row's real tokens after its existing ones (prefill and continuation).

    tokens: ``[B, L]`` int; mask: ``[B, L]`` bool (True = real token, anywhere in the row).
    A row whose real tokens do not all fit in its free slots gets none of them and is flagged
    ``overflowed``; overflowed rows are left unchanged.
    """
    mask = mask.astype(bool)
    lengths = state.cache.lengths
    count = jnp.sum(mask, axis=1, dtype=jnp.int32)
    fits = lengths + count <= state.cache.max_len
    mask = mask & (fits & ~state.overflowed)[:, None]
    positions = positions_from_mask(mask, lengths)
    hidden, cache = model.hidden_states(tokens.astype(jnp.int32), positions, mask, state.cache)
    last = mask.shape[1] - 1 - jnp.argmax(mask[:, ::-1], axis=1)  # each row's last real token
    last_hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    wrote = jnp.any(mask, axis=1)
    return constrain(SamplerState(
        cache=cache,
        hidden=jnp.where(wrote[:, None], last_hidden.astype(state.hidden.dtype), state.hidden),
        overflowed=state.overflowed | ~fits))


def decode(model: Qwen3ForCausalLM, state: SamplerState, key: jax.Array, budget: jax.Array,
           active: jax.Array, *, sampling: SamplingConfig, max_new_tokens: int,
           stop_token_ids: Sequence[int], pad_token_id: int = 0, unroll_layers: bool = False,
           constrain: Callable[[Any], Any] = lambda x: x) -> tuple[SamplerState, SampleOutput]:
    """Sample up to ``min(budget[b], max_new_tokens)`` tokens for each ``active`` row.

    budget: ``[B]`` int; active: ``[B]`` bool. Rows with nothing cached or already overflowed
    do not run. Returns the state with every sampled token cached, and the samples.
    ``unroll_layers``: see :func:`agentrl_jax.sampling.decode_step.split_layers`.
    """
    layers = split_layers(model) if unroll_layers else None
    batch = state.hidden.shape[0]
    max_len = state.cache.max_len
    stop_ids = jnp.asarray(tuple(stop_token_ids) or (-1,), jnp.int32)
    budget = jnp.minimum(budget.astype(jnp.int32), max_new_tokens)
    running = active.astype(bool) & ~state.overflowed & (state.cache.lengths > 0) & (budget > 0)
    out = SampleOutput(
        tokens=jnp.full((batch, max_new_tokens), pad_token_id, jnp.int32),
        log_probs=jnp.zeros((batch, max_new_tokens), jnp.float32),
        sampling_log_probs=jnp.zeros((batch, max_new_tokens), jnp.float32),
        lengths=jnp.zeros((batch,), jnp.int32),
        stop_reason=jnp.full((batch,), StopReason.NOT_RUN, jnp.int32))

    def step(carry):
        t, state, running, out = carry
        logits = next_token_logits(model, state.hidden)  # [B, V] float32
        no_room = running & (state.cache.lengths >= max_len)
        running = running & ~no_room
        tokens, sampling_lp = sample(jax.random.fold_in(key, t), logits, sampling)

        def column(buffer, values):
            old = jax.lax.dynamic_index_in_dim(buffer, t, axis=1, keepdims=False)
            return jax.lax.dynamic_update_index_in_dim(
                buffer, jnp.where(running, values, old), t, axis=1)

        hidden, cache = decode_hidden(model, tokens, running, state.cache, layers)
        lengths = out.lengths + running
        hit_stop = running & jnp.isin(tokens, stop_ids)
        spent = running & ~hit_stop & (lengths >= budget)
        reason = jnp.select([no_room, hit_stop, spent],
                            [StopReason.CONTEXT_FULL, StopReason.STOP_TOKEN, StopReason.BUDGET],
                            out.stop_reason)
        out = SampleOutput(tokens=column(out.tokens, tokens),
                           log_probs=column(out.log_probs, model_log_probs(logits, tokens)),
                           sampling_log_probs=column(out.sampling_log_probs, sampling_lp),
                           lengths=lengths, stop_reason=reason.astype(jnp.int32))
        state = constrain(SamplerState(
            cache=cache,
            hidden=jnp.where(running[:, None], hidden.astype(state.hidden.dtype), state.hidden),
            overflowed=state.overflowed | no_room))
        return t + 1, state, running & ~hit_stop & ~spent, out

    def not_done(carry):
        t, _, running, _ = carry
        return (t < max_new_tokens) & jnp.any(running)

    _, state, _, out = jax.lax.while_loop(not_done, step, (jnp.int32(0), state, running, out))
    return state, out


# ---------------------------------------------------------------------------- jitted front end
class Sampler:
    """Jitted :func:`append` / :func:`decode` for one model architecture.

    ``params`` (``nnx.state(model)``, or any state of the same structure, e.g. after a train
    step) is an argument of every call, so one Sampler serves a changing policy. Calls consume
    the ``state`` passed in (its buffers are donated, so the cache is updated in place).

    With ``mesh``: states are laid out by ``KV_CACHE_RULES`` (batch over ``data`` x ``fsdp``,
    KV heads over ``tensor``), inputs and outputs by batch; place ``params`` by their partition
    rules (``load_qwen3(..., mesh=mesh)``). ``trace_counts`` counts traces (= compilations)
    per function, for tests and logs. ``unroll_layers`` (default: on CPU only) decodes with
    unrolled layers from per-layer copies of the weights made once per decode call
    (:func:`agentrl_jax.sampling.decode_step.split_layers`).
    """

    def __init__(self, model: Qwen3ForCausalLM, *, max_new_tokens: int,
                 stop_token_ids: Sequence[int] | None = None, pad_token_id: int = 0,
                 mesh: Mesh | None = None, unroll_layers: bool | None = None):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.graphdef = nnx.graphdef(model)
        self.config: Qwen3Config = model.config
        self.dtype = model.dtype
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = tuple(model.config.eos_token_ids if stop_token_ids is None
                                    else stop_token_ids)
        for token in self.stop_token_ids:
            if not 0 <= token < self.config.vocab_size:
                raise ValueError(f"stop token id {token} is outside vocab_size="
                                 f"{self.config.vocab_size}")
        self.pad_token_id = pad_token_id
        self.mesh = mesh
        self.unroll_layers = (jax.default_backend() == "cpu" if unroll_layers is None
                              else unroll_layers)
        self.trace_counts: collections.Counter[str] = collections.Counter()
        self._init = jax.jit(self._init_impl, static_argnums=(0, 1, 2))
        self._append = jax.jit(self._append_impl, donate_argnums=1)
        self._decode = jax.jit(self._decode_impl, static_argnames="sampling", donate_argnums=1)

    # -- layout
    def _constrain(self, tree: Any) -> Any:
        if self.mesh is None:
            return tree
        return jax.lax.with_sharding_constraint(tree, self.state_shardings(tree))

    def state_shardings(self, state: SamplerState) -> SamplerState:
        """The mesh layout of a state (cache by KV_CACHE_RULES, the rest by batch)."""
        batch = NamedSharding(self.mesh, P(BATCH_AXES))
        return SamplerState(cache=tree_shardings(state.cache, self.mesh, KV_CACHE_RULES),
                            hidden=NamedSharding(self.mesh, P(BATCH_AXES, None)),
                            overflowed=batch)

    def _batch_put(self, x: Any, dtype: Any) -> jax.Array:
        """A batch-major input on device (host inputs converted on the host: no compile)."""
        x = x.astype(dtype) if isinstance(x, jax.Array) else np.asarray(x, dtype)
        if self.mesh is None:
            return jax.device_put(x)  # unlike jnp.asarray, compiles nothing
        return jax.device_put(x, NamedSharding(self.mesh, P(BATCH_AXES, *[None] * (x.ndim - 1))))

    # -- calls
    def init(self, batch_size: int, max_len: int, dtype: Any = None) -> SamplerState:
        """An empty state (cache dtype defaults to the model's compute dtype); one compiled
        program per (batch_size, max_len, dtype)."""
        if batch_size < 1 or max_len < 1:
            raise ValueError(f"batch_size and max_len must be >= 1, got {batch_size}, {max_len}")
        return self._init(batch_size, max_len, jnp.dtype(dtype or self.dtype))

    def append(self, params: nnx.State, state: SamplerState, tokens: Any,
               mask: Any) -> SamplerState:
        """Jitted :func:`append` (prefill or an observation). tokens, mask: ``[B, L]``."""
        batch = state.hidden.shape[0]
        shape, mask_shape = np.shape(tokens), np.shape(mask)
        if len(shape) != 2 or shape != mask_shape or shape[0] != batch:
            raise ValueError(f"append: tokens {shape} and mask {mask_shape} must both be "
                             f"[batch={batch}, L]")
        return self._append(params, state, self._batch_put(tokens, jnp.int32),
                            self._batch_put(mask, bool))

    prefill = append

    def decode(self, params: nnx.State, state: SamplerState, key: jax.Array,
               sampling: SamplingConfig, budget: Any = None, active: Any = None
               ) -> tuple[SamplerState, SampleOutput]:
        """Jitted :func:`decode`. budget: ``[B]`` int (default ``max_new_tokens``); active:
        ``[B]`` bool (default all rows)."""
        batch = state.hidden.shape[0]
        budget = np.full(batch, self.max_new_tokens) if budget is None else budget
        active = np.ones(batch, bool) if active is None else active
        if np.shape(budget) != (batch,) or np.shape(active) != (batch,):
            raise ValueError(f"decode: budget {np.shape(budget)} and active {np.shape(active)} "
                             f"must be [batch={batch}]")
        return self._decode(params, state, key, self._batch_put(budget, jnp.int32),
                            self._batch_put(active, bool), sampling=sampling)

    def _init_impl(self, batch_size, max_len, dtype):
        self.trace_counts["init"] += 1
        return self._constrain(init_state(self.config, batch_size, max_len, dtype))

    def _append_impl(self, params, state, tokens, mask):
        self.trace_counts["append"] += 1
        return append(nnx.merge(self.graphdef, params), state, tokens, mask, self._constrain)

    def _decode_impl(self, params, state, key, budget, active, *, sampling):
        self.trace_counts["decode"] += 1
        return decode(nnx.merge(self.graphdef, params), state, key, budget, active,
                      sampling=sampling, max_new_tokens=self.max_new_tokens,
                      stop_token_ids=self.stop_token_ids, pad_token_id=self.pad_token_id,
                      unroll_layers=self.unroll_layers, constrain=self._constrain)
