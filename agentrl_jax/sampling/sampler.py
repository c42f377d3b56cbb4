"""Batched, jitted prefill / decode / continuation over a static-shape or paged KV cache.

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
fixed handful of times. A decode step is the model's own cache forward of one token per row
(``Qwen3ForCausalLM.hidden_states(..., few_rows=True)``: matrix products ordered for small
batches; on CPU the layers unrolled from per-layer weights).

Memory: the cache's dtype is a choice of ``init`` (e.g. bfloat16 for a float32 model; the
default is the model's compute dtype). With ``prefill_chunk`` an ``append`` wider than the
chunk runs as successive appends of ``prefill_chunk`` columns (one ``lax.scan``), which is
one wide append (appends are compact: a row's real tokens go after its cached ones wherever
they sit in the chunk; equal up to the rounding of differently shaped matrix products) but
bounds the attention temporaries to ``[B, heads, chunk, max_len]``.

Paged (``Sampler(paging=Paging(...))``): the state holds a
:class:`~agentrl_jax.models.paged_cache.PagedKVCache` instead; every write first allocates the
pages it needs (a row that finds none left is flagged ``overflowed``, in decode with
``StopReason.NO_PAGE``: a policy can release it and replay it later), attention reads only
the pages in use, :meth:`Sampler.release` frees finished rows and :meth:`Sampler.append_rows`
prefills a few rows without touching the others (seating new rows in continuous batching).
On a mesh (``tensor`` = 1) each batch shard is a whole one-device engine: its rows, and an
equal share of the pool's pages, live on its device (:func:`paged_state_specs`) and every
paged program runs per shard (``shard_map``; parameters replicated), so no page ever crosses
devices; a row can be copied only within its shard, and decode needs per-row keys.

Rows never overflow silently: a chunk that does not fit in a row's free slots is not written at
all, and a row with no free slot for its next sampled token stops with
``StopReason.CONTEXT_FULL``; either sets the row's sticky ``overflowed`` flag, after which
``append`` and ``decode`` leave the row untouched. Rows that stopped, are inactive or have
overflowed still flow through the batched matmuls (static shapes) but never write the cache.

Randomness comes only from ``key``: step ``t`` of a decode uses ``fold_in(key, t)``, so the same
key and inputs give the same tokens, on one device or sharded (threefry is partitionable).
``key`` is one key for the batch, or one key per row (``[B]`` typed keys or their ``[B, 2]``
uint32 data): then a row's tokens depend only on its own key and cache, not on its position
in the batch or the batch's size (so compacting or splitting a batch changes no row).

Placement (decided once, so no program compiles twice for one shape): every array the
Sampler makes or is given (states from ``init``, tokens, masks, budgets, keys) is committed
to one placement, the mesh's (``KV_CACHE_RULES`` for the cache, rows over ``BATCH_AXES``) or
one device's. Parameters are the caller's: :func:`generation_params` puts them in the
layout decode reads them from. On a mesh with ``fsdp`` > 1 the training layout shards every
weight over ``fsdp``, so each decode step would all-gather the whole model;
:func:`generation_rules` (the Qwen3 rules with ``fsdp`` dropped) replicates the weights over
``fsdp`` instead (each device holds them whole, split only over ``tensor``), and rows stay
split over ``data`` x ``fsdp``, so decode needs no weight collectives. That copy costs one
full set of weights per ``tensor`` shard per device while it lives (one update). With per-row
keys each step's sampling runs on each device's own rows (:func:`rows_local_sample`), so the
``[B, V]`` logits are not gathered for the top-k either.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from agentrl_jax.models import paged_cache, paged_kernels
from agentrl_jax.models.config import Qwen3Config
from agentrl_jax.models.paged_cache import PagedKVCache
from agentrl_jax.models.paged_kernels import select_kernel
from agentrl_jax.models.qwen3 import KVCache, Qwen3ForCausalLM, positions_from_mask
from agentrl_jax.sampling.filters import SamplingConfig, model_log_probs, sample
from agentrl_jax.sharding import (
    BATCH_AXES,
    KV_CACHE_RULES,
    QWEN3_PARAM_RULES,
    PartitionRule,
    tree_shardings,
)
from agentrl_jax.validation import integer, one_of, optional, validate

GENERATION_LAYOUTS = ("auto", "replicated", "training")


class StopReason(enum.IntEnum):
    """Why a row's decode ended (``SampleOutput.stop_reason``, int32)."""

    NOT_RUN = 0  # inactive, overflowed earlier, nothing cached, or a budget of 0
    STOP_TOKEN = 1  # sampled a stop token (it is the row's last output token)
    BUDGET = 2  # produced its budget of tokens
    CONTEXT_FULL = 3  # no cache slot left for the next token; the row is now ``overflowed``
    NO_PAGE = 4  # a paged cache had no free page for the next token (the row's context had
    # room); the row is now ``overflowed`` (a caller may release and replay it)


@dataclasses.dataclass(frozen=True)
class Paging:
    """A paged KV cache (:mod:`agentrl_jax.models.paged_cache`) instead of a static one.

    ``page_size`` tokens per page; ``num_pages`` in the shared pool (None: enough for every row
    at ``max_len``, i.e. the static cache's memory; fewer bounds the memory by the tokens
    cached at once, and a row that finds no free page stops with ``StopReason.NO_PAGE``;
    :class:`~agentrl_jax.policy.SamplerPolicy` then preempts it: released, replayed later);
    ``block_pages`` pages read per step of the attention loop. ``kernel``: the decode step's
    attention, ``auto`` (the device platform's Pallas kernel where its constraints hold,
    :func:`~agentrl_jax.models.paged_kernels.select_kernel`, else the XLA version), ``xla``,
    ``pallas_tpu`` or ``pallas_gpu``; ``interpret`` runs a Pallas kernel by its interpreter
    (any backend: tests).
    """

    page_size: int = 32
    num_pages: int | None = None
    block_pages: int = 8  # 256-token blocks: fastest of 64-1024 on this CPU (decode, 64 rows)
    kernel: str = "auto"
    interpret: bool = False

    def __post_init__(self) -> None:
        validate(
            "paging",
            self,
            {
                "page_size": integer(1),
                "num_pages": optional(integer(1)),
                "block_pages": integer(1),
                "kernel": one_of(("auto",) + paged_kernels.KERNELS),
                "interpret": one_of((False, True)),
            },
        )


@struct.dataclass
class SamplerState:
    """Everything a row needs to continue: its cache and its pending next-token state."""

    cache: KVCache | PagedKVCache
    hidden: jax.Array  # [B, hidden_size] final hidden state of each row's last cached token
    overflowed: jax.Array  # [B] bool, sticky: a chunk or a sampled token did not fit

    @property
    def lengths(self) -> jax.Array:
        """``[B]`` int32: tokens cached per row."""
        return self.cache.lengths


@struct.dataclass
class SampleOutput:
    """One decode call's result; entries at or after ``lengths[b]`` are padding."""

    tokens: jax.Array  # [B, N] int32, pad_token_id after the row's length
    log_probs: jax.Array  # [B, N] float32: under the model (temperature 1, untruncated)
    sampling_log_probs: jax.Array  # [B, N] float32: under the sampling distribution (greedy: 0)
    lengths: jax.Array  # [B] int32
    stop_reason: jax.Array  # [B] int32, a StopReason

    @property
    def mask(self) -> jax.Array:
        """``[B, N]`` bool, True for sampled tokens."""
        return jnp.arange(self.tokens.shape[1]) < self.lengths[:, None]


# ---------------------------------------------------------------------------- pure functions
def init_state(
    config: Qwen3Config,
    batch_size: int,
    max_len: int,
    dtype: Any = jnp.float32,
    hidden_dtype: Any = None,
    paging: Paging | None = None,
) -> SamplerState:
    """An empty state: ``batch_size`` rows of ``max_len`` cache slots in ``dtype`` (a static
    cache, or pages when ``paging`` is given; ``max_len`` then rounds up to whole pages); the
    pending hidden states in ``hidden_dtype`` (default ``dtype``; the Sampler uses the compute
    dtype)."""
    if batch_size < 1 or max_len < 1:
        raise ValueError(f"batch_size and max_len must be >= 1, got {batch_size}, {max_len}")
    if paging is None:
        cache = KVCache.empty(config, batch_size, max_len, dtype)
    else:
        cache = PagedKVCache.empty(
            config,
            batch_size,
            max_len,
            page_size=paging.page_size,
            num_pages=paging.num_pages,
            block_pages=paging.block_pages,
            kernel="xla" if paging.kernel == "auto" else paging.kernel,
            interpret=paging.interpret,
            dtype=dtype,
        )
    return SamplerState(
        cache=cache,
        hidden=jnp.zeros((batch_size, config.hidden_size), hidden_dtype or dtype),
        overflowed=jnp.zeros((batch_size,), bool),
    )


def _reserve(
    state: SamplerState, count: jax.Array, fits: jax.Array
) -> tuple[SamplerState, jax.Array]:
    """A paged cache's pages for ``count [B]`` new tokens of the rows that ``fits`` and are not
    overflowed; a row that finds none left no longer fits. A static cache: unchanged."""
    if not isinstance(state.cache, PagedKVCache):
        return state, fits
    lengths = state.cache.lengths
    writes = fits & ~state.overflowed
    cache, got = paged_cache.allocate(state.cache, jnp.where(writes, lengths + count, lengths))
    return state.replace(cache=cache), fits & got


def append(
    model: Qwen3ForCausalLM,
    state: SamplerState,
    tokens: jax.Array,
    mask: jax.Array,
    constrain: Callable[[Any], Any] = lambda x: x,
    chunk: int | None = None,
) -> SamplerState:
    """Cache each row's real tokens after its existing ones (prefill and continuation).

    tokens: ``[B, L]`` int; mask: ``[B, L]`` bool (True = real token, anywhere in the row).
    A row whose real tokens do not all fit in its free slots gets none of them and is flagged
    ``overflowed``; overflowed rows are left unchanged. ``chunk``: with ``L > chunk`` the
    columns are appended ``chunk`` at a time (:func:`append_in_chunks`), the same result.
    """
    mask = mask.astype(bool)
    if chunk is not None and mask.shape[1] > chunk:
        return append_in_chunks(model, state, tokens, mask, chunk, constrain)
    lengths = state.cache.lengths
    count = jnp.sum(mask, axis=1, dtype=jnp.int32)
    fits = lengths + count <= state.cache.max_len
    state, fits = _reserve(state, count, fits)
    mask = mask & (fits & ~state.overflowed)[:, None]
    positions = positions_from_mask(mask, lengths)
    hidden, cache = model.hidden_states(tokens.astype(jnp.int32), positions, mask, state.cache)
    last = mask.shape[1] - 1 - jnp.argmax(mask[:, ::-1], axis=1)  # each row's last real token
    last_hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    wrote = jnp.any(mask, axis=1)
    return constrain(
        SamplerState(
            cache=cache,
            hidden=jnp.where(wrote[:, None], last_hidden.astype(state.hidden.dtype), state.hidden),
            overflowed=state.overflowed | ~fits,
        )
    )


def append_in_chunks(
    model: Qwen3ForCausalLM,
    state: SamplerState,
    tokens: jax.Array,
    mask: jax.Array,
    chunk: int,
    constrain: Callable[[Any], Any] = lambda x: x,
) -> SamplerState:
    """:func:`append` of ``[B, L]`` as successive appends of ``[B, chunk]`` (``L`` padded up to
    a multiple of ``chunk`` with padding columns), in one ``lax.scan``.

    Equal to one append of the whole width: which rows fit is decided on the whole chunk
    first (a row that does not fit gets none of its tokens, as in one append), and each
    piece writes its real tokens after those of the pieces before. The forward's attention
    temporaries are ``[B, heads, chunk, max_len]`` instead of ``[B, heads, L, max_len]``.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    mask = mask.astype(bool)
    batch, width = mask.shape
    count = jnp.sum(mask, axis=1, dtype=jnp.int32)
    fits = state.cache.lengths + count <= state.cache.max_len
    state, fits = _reserve(state, count, fits)  # the whole chunk's pages, before any piece
    mask = mask & (fits & ~state.overflowed)[:, None]
    pieces = -(-width // chunk)
    pad = ((0, 0), (0, pieces * chunk - width))
    split = lambda x: jnp.swapaxes(jnp.pad(x, pad).reshape(batch, pieces, chunk), 0, 1)  # noqa: E731

    def piece(state, columns):
        return append(model, state, *columns, constrain), None

    state, _ = jax.lax.scan(piece, state, (split(tokens.astype(jnp.int32)), split(mask)))
    return constrain(state.replace(overflowed=state.overflowed | ~fits))


def append_rows(
    model: Qwen3ForCausalLM,
    state: SamplerState,
    rows: jax.Array,
    tokens: jax.Array,
    mask: jax.Array,
    constrain: Callable[[Any], Any] = lambda x: x,
    chunk: int | None = None,
) -> SamplerState:
    """:func:`append` to the rows ``rows int[k]`` only (distinct; ``-1``: padding, writes
    nothing); ``tokens``, ``mask`` ``[k, L]``. Paged caches only: the rows' page tables are
    taken out, appended to over the shared pool, and put back, so the work is that of ``k``
    rows however many the state holds (a prefill of newly seated rows)."""
    cache = state.cache
    if not isinstance(cache, PagedKVCache):
        raise TypeError("append_rows needs a paged KV cache")
    batch = cache.lengths.shape[0]
    valid = rows >= 0
    index = jnp.where(valid, rows, 0)
    sub = SamplerState(
        cache=cache.replace(
            page_table=jnp.where(valid[:, None], cache.page_table[index], cache.num_pages),
            lengths=jnp.where(valid, cache.lengths[index], 0),
        ),
        hidden=state.hidden[index],
        overflowed=~valid | state.overflowed[index],
    )
    sub = append(model, sub, tokens, mask.astype(bool) & valid[:, None], chunk=chunk)
    put = jnp.where(valid, rows, batch)  # padding rows: dropped
    cache = sub.cache.replace(
        page_table=cache.page_table.at[put].set(sub.cache.page_table, mode="drop"),
        lengths=cache.lengths.at[put].set(sub.cache.lengths, mode="drop"),
    )
    return constrain(
        SamplerState(
            cache=cache,
            hidden=state.hidden.at[put].set(sub.hidden, mode="drop"),
            overflowed=state.overflowed.at[put].set(sub.overflowed, mode="drop"),
        )
    )


def copy_rows(state: SamplerState, dst: jax.Array, src: jax.Array) -> SamplerState:
    """Row ``dst[i]`` of a paged state becomes a copy of row ``src[i]`` (its pages copied;
    see :func:`agentrl_jax.models.paged_cache.copy_rows`); a copy without room in the pool is
    an empty, overflowed row."""
    cache, copied = paged_cache.copy_rows(state.cache, dst, src)
    batch = cache.lengths.shape[0]
    put = jnp.where(dst >= 0, dst, batch)
    source = jnp.where(dst >= 0, src, 0)
    return SamplerState(
        cache=cache,
        hidden=state.hidden.at[put].set(state.hidden[source], mode="drop"),
        overflowed=state.overflowed.at[put].set(state.overflowed[source] | ~copied, mode="drop"),
    )


def release_rows(state: SamplerState, rows: jax.Array) -> SamplerState:
    """``state`` with the rows where ``rows [B]`` is True emptied: nothing cached, not
    overflowed (a paged cache returns their pages to the pool)."""
    rows = rows.astype(bool)
    cache = state.cache
    if isinstance(cache, PagedKVCache):
        cache = paged_cache.release(cache, rows)
    else:
        cache = cache.replace(lengths=jnp.where(rows, 0, cache.lengths))
    return SamplerState(
        cache=cache,
        hidden=jnp.where(rows[:, None], 0, state.hidden).astype(state.hidden.dtype),
        overflowed=state.overflowed & ~rows,
    )


def step_keys(key: jax.Array, t: jax.Array) -> jax.Array:
    """Decode step ``t``'s key(s): ``fold_in(key, t)`` of one key, or of each of ``[B]`` keys."""
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) and key.ndim == 1:
        return jax.vmap(jax.random.fold_in, in_axes=(0, None))(key, t)
    return jax.random.fold_in(key, t)


Sample = Callable[[jax.Array, jax.Array, SamplingConfig], tuple[jax.Array, jax.Array]]


def rows_local_sample(mesh: Mesh) -> Sample:
    """:func:`~agentrl_jax.sampling.filters.sample` with per-row keys, run on each device's
    own rows (``shard_map`` over ``BATCH_AXES``): XLA would otherwise gather the whole
    ``[B, V]`` logits onto every device for the top-k/sort of each step. Needs ``[B]`` keys
    and ``B`` divisible by the batch shards."""

    def local(keys, logits, sampling):
        rows = P(BATCH_AXES)
        return jax.shard_map(
            lambda k, x: sample(k, x, sampling),
            mesh=mesh,
            in_specs=(rows, P(BATCH_AXES, None)),
            out_specs=(rows, rows),
            check_vma=False,
        )(keys, logits)

    return local


def decode(
    model: Qwen3ForCausalLM,
    state: SamplerState,
    key: jax.Array,
    budget: jax.Array,
    active: jax.Array,
    *,
    sampling: SamplingConfig,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    pad_token_id: int = 0,
    unroll_layers: bool = False,
    constrain: Callable[[Any], Any] = lambda x: x,
    sample_fn: Sample = sample,
) -> tuple[SamplerState, SampleOutput]:
    """Sample up to ``min(budget[b], max_new_tokens)`` tokens for each ``active`` row.

    key: one key, or ``[B]`` typed keys (one per row); budget: ``[B]`` int; active: ``[B]``
    bool. Rows with nothing cached or already overflowed do not run. Returns the state with
    every sampled token cached, and the samples.
    ``unroll_layers``: run the layers unrolled from :meth:`Qwen3ForCausalLM.split_layers`.
    ``sample_fn``: draws each step's tokens (default :func:`sample`; see
    :func:`rows_local_sample`).
    """
    layers = model.split_layers() if unroll_layers else None
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
        stop_reason=jnp.full((batch,), StopReason.NOT_RUN, jnp.int32),
    )

    def step(carry):
        t, state, running, out = carry
        logits = model.logits(state.hidden, few_rows=True)  # [B, V] float32
        no_room = running & (state.cache.lengths >= max_len)
        no_page = jnp.zeros_like(no_room)
        if isinstance(state.cache, PagedKVCache):  # a page for the token if it starts one
            cache, got = paged_cache.allocate(
                state.cache, state.cache.lengths + (running & ~no_room)
            )
            state, no_page = state.replace(cache=cache), running & ~no_room & ~got
        running = running & ~no_room & ~no_page
        tokens, sampling_lp = sample_fn(step_keys(key, t), logits, sampling)

        def column(buffer, values):
            old = jax.lax.dynamic_index_in_dim(buffer, t, axis=1, keepdims=False)
            return jax.lax.dynamic_update_index_in_dim(
                buffer, jnp.where(running, values, old), t, axis=1
            )

        hidden, cache = model.hidden_states(
            tokens[:, None],
            state.cache.lengths[:, None],
            running[:, None],
            state.cache,
            few_rows=True,
            layers=layers,
        )
        hidden = hidden[:, 0]
        lengths = out.lengths + running
        hit_stop = running & jnp.isin(tokens, stop_ids)
        spent = running & ~hit_stop & (lengths >= budget)
        reason = jnp.select(
            [no_room, no_page, hit_stop, spent],
            [StopReason.CONTEXT_FULL, StopReason.NO_PAGE, StopReason.STOP_TOKEN, StopReason.BUDGET],
            out.stop_reason,
        )
        out = SampleOutput(
            tokens=column(out.tokens, tokens),
            log_probs=column(out.log_probs, model_log_probs(logits, tokens)),
            sampling_log_probs=column(out.sampling_log_probs, sampling_lp),
            lengths=lengths,
            stop_reason=reason.astype(jnp.int32),
        )
        state = constrain(
            SamplerState(
                cache=cache,
                hidden=jnp.where(running[:, None], hidden.astype(state.hidden.dtype), state.hidden),
                overflowed=state.overflowed | no_room | no_page,
            )
        )
        return t + 1, state, running & ~hit_stop & ~spent, out

    def not_done(carry):
        t, _, running, _ = carry
        return (t < max_new_tokens) & jnp.any(running)

    _, state, _, out = jax.lax.while_loop(not_done, step, (jnp.int32(0), state, running, out))
    return state, out


# ---------------------------------------------------------------------------- parameter layout
def _drop_axis(axes: Any, axis: str) -> Any:
    """One dimension's entry of a PartitionSpec without mesh axis ``axis``."""
    if axes is None or axes == axis:
        return None
    if isinstance(axes, str):
        return axes
    kept = tuple(a for a in axes if a != axis)
    return kept[0] if len(kept) == 1 else (kept or None)


def generation_rules(
    rules: Sequence[PartitionRule] = QWEN3_PARAM_RULES, drop: str = "fsdp"
) -> tuple[PartitionRule, ...]:
    """``rules`` with mesh axis ``drop`` removed from every spec: the parameters replicated
    over that axis (``P(None, "tensor", "fsdp")`` -> ``P(None, "tensor", None)``)."""
    return tuple(
        (pattern, P(*(_drop_axis(axes, drop) for axes in spec))) for pattern, spec in rules
    )


def resolve_layout(layout: str, mesh: Mesh | None) -> str:
    """``"auto"``: ``"replicated"`` on a mesh whose ``fsdp`` axis has more than one device,
    else ``"training"`` (nothing to gain: the training layout has no ``fsdp`` split)."""
    if layout not in GENERATION_LAYOUTS:
        raise ValueError(f"generation_layout must be one of {GENERATION_LAYOUTS}, got {layout!r}")
    if layout == "auto":
        return "replicated" if mesh is not None and mesh.shape["fsdp"] > 1 else "training"
    return layout


def generation_params(
    params: Any,
    mesh: Mesh | None = None,
    layout: str = "auto",
    device: Any = None,
    rules: Sequence[PartitionRule] = QWEN3_PARAM_RULES,
    dtype: Any = None,
) -> Any:
    """``params`` placed where decode reads them from (one ``device_put`` per update).

    Without a mesh: committed to ``device`` (default ``jax.local_devices()[0]``; a no-op for
    parameters already there). On a mesh, ``layout`` (see :func:`resolve_layout`):
    ``"replicated"`` lays them out by :func:`generation_rules` (no all-gather of weights
    in decode), as a copy in ``dtype`` if given (pass the model's compute dtype: the model
    casts every weight to it before use, so the tokens are the same and a float32 model
    computing in bfloat16 needs half the memory for the copy; cast while still sharded);
    ``"training"`` keeps them as they are (the caller placed them by ``rules``).
    """
    if mesh is None:
        return jax.device_put(
            params, jax.sharding.SingleDeviceSharding(device or jax.local_devices()[0])
        )
    if resolve_layout(layout, mesh) == "training":
        return params
    if dtype is not None:
        params = jax.tree.map(
            lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params
        )
    return jax.device_put(params, tree_shardings(params, mesh, generation_rules(rules)))


def paged_state_specs(state: SamplerState) -> SamplerState:
    """The ``PartitionSpec`` of each leaf of a paged state on a mesh: rows, and the pool's
    pages, split over ``BATCH_AXES``. Each batch shard is then a whole one-device engine: its
    rows' page tables name pages of its own part of the pool (local ids), so the sampler runs
    every paged program per shard (``shard_map``) and no page ever crosses devices."""
    rows = P(BATCH_AXES)
    pages = P(None, None, BATCH_AXES)  # [KV, layers, P, S, hd]
    cache = state.cache.replace(k=pages, v=pages, page_table=rows, lengths=rows, free=rows)
    return SamplerState(cache=cache, hidden=rows, overflowed=rows)


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def batch_shards(mesh: Mesh) -> int:
    """How many ways a mesh splits a batch (``data`` x ``fsdp``)."""
    return int(np.prod([mesh.shape[axis] for axis in BATCH_AXES]))


def _is_key_array(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


# ---------------------------------------------------------------------------- jitted front end
class Sampler:
    """Jitted :func:`append` / :func:`decode` for one model architecture.

    ``params`` (``nnx.state(model)``, or any state of the same structure, e.g. after a train
    step) is an argument of every call, so one Sampler serves a changing policy. Calls consume
    the ``state`` passed in (its buffers are donated, so the cache is updated in place).

    With ``mesh``: states are laid out by ``KV_CACHE_RULES`` (batch over ``data`` x ``fsdp``,
    KV heads over ``tensor``), inputs and outputs by batch; place ``params`` with
    :func:`generation_params` (or by their partition rules, ``load_qwen3(..., mesh=mesh)``).
    Without: everything is committed to ``device`` (default ``jax.local_devices()[0]``; put
    ``params`` there too, :func:`generation_params`). ``prefill_chunk``: appends wider than it
    run in chunks of that width (:func:`append_in_chunks`; None: never).
    ``paging``: states from :meth:`init` hold a paged KV cache (:class:`Paging`; on a mesh per batch
    shard, see the module docstring): attention reads only the pages rows use, and :meth:`release`
    returns a finished row's pages to the pool. ``trace_counts`` counts traces per function, for
    tests and logs (a trace is a compilation as long as the placement of the inputs stays the same).
    ``unroll_layers`` (default: on CPU only) decodes with unrolled layers from per-layer copies of
    the weights made once per decode call (:meth:`Qwen3ForCausalLM.split_layers`).
    """

    def __init__(
        self,
        model: Qwen3ForCausalLM,
        *,
        max_new_tokens: int,
        stop_token_ids: Sequence[int] | None = None,
        pad_token_id: int = 0,
        mesh: Mesh | None = None,
        unroll_layers: bool | None = None,
        prefill_chunk: int | None = None,
        device: Any = None,
        paging: Paging | None = None,
    ):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if prefill_chunk is not None and (
            isinstance(prefill_chunk, bool)
            or not isinstance(prefill_chunk, int)
            or prefill_chunk < 1
        ):
            raise ValueError(f"prefill_chunk must be None or an int >= 1, got {prefill_chunk!r}")
        self.graphdef = nnx.graphdef(model)
        self.config: Qwen3Config = model.config
        self.dtype = model.dtype
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = tuple(
            model.config.eos_token_ids if stop_token_ids is None else stop_token_ids
        )
        for token in self.stop_token_ids:
            if not 0 <= token < self.config.vocab_size:
                raise ValueError(
                    f"stop token id {token} is outside vocab_size={self.config.vocab_size}"
                )
        self.pad_token_id = pad_token_id
        self.mesh = mesh
        self.device = None if mesh is not None else (device or jax.local_devices()[0])
        self.prefill_chunk = prefill_chunk
        if paging is not None and mesh is not None and mesh.shape["tensor"] > 1:
            raise NotImplementedError(
                f"a paged KV cache on a mesh splits rows and pages over {BATCH_AXES} only; this "
                f"mesh has tensor={mesh.shape['tensor']}: use tensor=1 or the static cache "
                "(paging=None)"
            )
        self.paging = paging
        self.platform = (mesh.devices.flat[0] if mesh is not None else self.device).platform
        self.sharded_pages = paging is not None and mesh is not None
        self.unroll_layers = (
            jax.default_backend() == "cpu" if unroll_layers is None else unroll_layers
        )
        self.trace_counts: collections.Counter[str] = collections.Counter()
        self._init = jax.jit(self._init_impl, static_argnums=(0, 1, 2, 3))
        self._release = jax.jit(self._release_impl, donate_argnums=0)
        self._append_rows = jax.jit(self._append_rows_impl, donate_argnums=1)
        self._copy_rows = jax.jit(self._copy_rows_impl, donate_argnums=0)
        self._append = jax.jit(self._append_impl, donate_argnums=1)
        self._decode = jax.jit(self._decode_impl, static_argnames="sampling", donate_argnums=1)

    # -- layout
    def _constrain(self, tree: Any) -> Any:
        if self.mesh is None:
            return tree
        return jax.lax.with_sharding_constraint(tree, self.state_shardings(tree))

    def state_shardings(self, state: SamplerState) -> SamplerState:
        """The layout of a state (on a mesh: cache by KV_CACHE_RULES, the rest by batch; a
        paged state by :func:`paged_state_specs`)."""
        if self.mesh is None:
            return jax.tree.map(lambda _: self.replicated, state)
        if isinstance(state.cache, PagedKVCache):
            return jax.tree.map(
                lambda spec: NamedSharding(self.mesh, spec),
                paged_state_specs(state),
                is_leaf=_is_spec,
            )
        batch = NamedSharding(self.mesh, P(BATCH_AXES))
        return SamplerState(
            cache=tree_shardings(state.cache, self.mesh, KV_CACHE_RULES),
            hidden=NamedSharding(self.mesh, P(BATCH_AXES, None)),
            overflowed=batch,
        )

    @property
    def replicated(self) -> jax.sharding.Sharding:
        """Where unbatched inputs go: the whole mesh (replicated), or the device."""
        if self.mesh is None:
            return jax.sharding.SingleDeviceSharding(self.device)
        return NamedSharding(self.mesh, P())

    def rows_sharding(self, ndim: int) -> jax.sharding.Sharding:
        """Where batch-major inputs of ``ndim`` dimensions go (rows over ``BATCH_AXES``)."""
        if self.mesh is None:
            return self.replicated
        return NamedSharding(self.mesh, P(BATCH_AXES, *[None] * (ndim - 1)))

    def _batch_put(self, x: Any, dtype: Any) -> jax.Array:
        """A batch-major input, committed (host inputs converted on the host: no compile)."""
        x = x.astype(dtype) if isinstance(x, jax.Array) else np.asarray(x, dtype)
        return jax.device_put(x, self.rows_sharding(x.ndim))  # unlike jnp.asarray, compiles nothing

    def _key_put(self, key: Any, batch: int) -> jax.Array:
        """One key (replicated), or per-row keys as ``[B, 2]`` uint32 data (rows split)."""
        if _is_key_array(key) and key.ndim == 0:
            return jax.device_put(key, self.replicated)
        data = np.asarray(jax.random.key_data(key) if _is_key_array(key) else key, np.uint32)
        if data.shape == (2,):  # a raw (uint32[2]) key
            return jax.device_put(data, self.replicated)
        if data.shape != (batch, 2):
            raise ValueError(
                f"decode: key must be one key or [batch={batch}] keys (threefry), "
                f"got key data of shape {data.shape}"
            )
        return self._batch_put(data, np.uint32)

    # -- calls
    def init(
        self, batch_size: int, max_len: int, dtype: Any = None, pool_rows: int | None = None
    ) -> SamplerState:
        """An empty state, cache in ``dtype`` (default: the model's compute dtype; e.g.
        bfloat16 halves a float32 model's cache), pending hidden states in the compute dtype;
        paged when the Sampler was made with ``paging`` (a pool of ``paging.num_pages``, or by
        default enough pages for ``pool_rows`` rows at ``max_len``, ``pool_rows`` defaulting to
        ``batch_size``: a state that will be copied to more rows needs the larger pool; on a
        mesh each batch shard holds an equal share of the rows and of the pages); one
        compiled program per (batch_size, max_len, dtype, pool size)."""
        if batch_size < 1 or max_len < 1:
            raise ValueError(f"batch_size and max_len must be >= 1, got {batch_size}, {max_len}")
        dtype = jnp.dtype(dtype or self.dtype)
        state = self._init(
            batch_size, max_len, dtype, self.pool(batch_size, max_len, pool_rows, dtype)
        )
        return jax.device_put(state, self.state_shardings(state))  # committed: see the module doc

    def pool(
        self, batch_size: int, max_len: int, pool_rows: int | None = None, dtype: Any = None
    ) -> Paging | None:
        """The paging of a state from ``init(batch_size, max_len, dtype, pool_rows=...)``, its
        ``num_pages`` and ``kernel`` resolved (None for a static cache). A pool must hold one
        row of ``max_len`` tokens (per batch shard): a row alone can always play."""
        paging = self.paging
        if paging is None:
            return None
        shape = dict(
            page_size=paging.page_size,
            head_dim=self.config.head_dim,
            dtype=jnp.dtype(dtype or self.dtype),
        )
        if paging.kernel == "auto":
            paging = dataclasses.replace(paging, kernel=select_kernel(self.platform, **shape))
        elif (why := paged_kernels.unmet(paging.kernel, **shape)) is not None:
            raise ValueError(
                f"paging.kernel={paging.kernel!r} cannot serve this cache: {why}; "
                "use kernel='auto' (the XLA version where no kernel fits)"
            )
        shards = batch_shards(self.mesh) if self.sharded_pages else 1
        if paging.num_pages is None:
            rows = batch_size if pool_rows is None else max(pool_rows, 1)
            pages = -(-rows * -(-max_len // paging.page_size) // shards) * shards
            paging = dataclasses.replace(paging, num_pages=pages)
        if batch_size % shards or paging.num_pages % shards:
            raise ValueError(
                f"a paged state on this mesh needs batch_size and paging.num_pages "
                f"divisible by its {shards} batch shards (each holds its share of "
                f"rows and pages), got {batch_size} and {paging.num_pages}"
            )
        need = -(-max_len // paging.page_size)
        if paging.num_pages // shards < need:  # a row alone must fit, so preemption can end
            raise ValueError(
                f"paging.num_pages={paging.num_pages} ({shards} shard(s)) cannot hold "
                f"one row of max_len={max_len} tokens: it needs {need} pages of "
                f"{paging.page_size} per shard"
            )
        return paging

    def append_rows(
        self, params: nnx.State, state: SamplerState, rows: Any, tokens: Any, mask: Any
    ) -> SamplerState:
        """Jitted :func:`append_rows` (paged states): ``rows int[k]`` (``-1`` padding),
        tokens and mask ``[k, L]``; one program per ``(k, L)``."""
        rows = np.asarray(rows)
        if (
            rows.ndim != 1
            or np.shape(tokens) != np.shape(mask)
            or np.shape(tokens)[:1] != rows.shape
        ):
            raise ValueError(
                f"append_rows: rows {rows.shape}, tokens {np.shape(tokens)} and mask "
                f"{np.shape(mask)} must be [k] and [k, L]"
            )
        if self.sharded_pages:
            rows, (tokens, mask) = self._by_shard(state, rows, np.asarray(tokens), np.asarray(mask))
        return self._append_rows(
            params,
            state,
            self._batch_put(rows, jnp.int32),
            self._batch_put(tokens, jnp.int32),
            self._batch_put(mask, bool),
        )

    def copy_rows(self, state: SamplerState, dst: Any, src: Any) -> SamplerState:
        """Jitted :func:`copy_rows` (paged states): ``dst``, ``src`` ``int[k]``. On a mesh a
        row can only be copied within its batch shard (pages never cross devices)."""
        dst, src = np.asarray(dst), np.asarray(src)
        if self.sharded_pages:
            local = state.hidden.shape[0] // batch_shards(self.mesh)
            crossing = (dst >= 0) & (dst // local != src // local)
            if crossing.any():
                i = int(np.flatnonzero(crossing)[0])
                raise ValueError(
                    f"copy_rows: row {src[i]} cannot be copied to row {dst[i]}: "
                    f"they are on different batch shards ({local} rows each)"
                )
            dst, (src,) = self._by_shard(state, dst, src)
            src = np.where(dst >= 0, src % local, 0)
        return self._copy_rows(
            state, self._batch_put(dst, jnp.int32), self._batch_put(src, jnp.int32)
        )

    def _by_shard(
        self, state: SamplerState, rows: np.ndarray, *columns: np.ndarray
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """Rows ``int[k]`` (``-1``: padding) of a paged state on a mesh, regrouped so that each
        batch shard's block of ``k'`` entries (``k'``: the most rows any shard gets, rounded up
        to a power of two) names that shard's rows by their local index; ``columns`` (``[k,
        ...]``) follow their rows, padding entries zero."""
        shards = batch_shards(self.mesh)
        local = state.hidden.shape[0] // shards
        shard = np.where(rows >= 0, rows // local, -1)
        most = int(np.bincount(shard[shard >= 0], minlength=shards).max(initial=0))
        width = 1 << max(most - 1, 0).bit_length()
        out = np.full(shards * width, -1, np.int32)
        outs = [np.zeros((shards * width,) + c.shape[1:], c.dtype) for c in columns]
        for s in range(shards):
            picked = np.flatnonzero(shard == s)
            at = s * width + np.arange(len(picked))
            out[at] = rows[picked] - s * local
            for o, c in zip(outs, columns):
                o[at] = c[picked]
        return out, outs

    def release(self, state: SamplerState, rows: Any) -> SamplerState:
        """Empty the rows where ``rows [B]`` is True (a paged cache's pages go back to the
        pool; a static cache's rows are reset); consumes ``state``."""
        return self._release(state, self._batch_put(rows, bool))

    def append(
        self, params: nnx.State, state: SamplerState, tokens: Any, mask: Any
    ) -> SamplerState:
        """Jitted :func:`append` (prefill or an observation). tokens, mask: ``[B, L]``."""
        batch = state.hidden.shape[0]
        shape, mask_shape = np.shape(tokens), np.shape(mask)
        if len(shape) != 2 or shape != mask_shape or shape[0] != batch:
            raise ValueError(
                f"append: tokens {shape} and mask {mask_shape} must both be [batch={batch}, L]"
            )
        return self._append(
            params, state, self._batch_put(tokens, jnp.int32), self._batch_put(mask, bool)
        )

    prefill = append

    def decode(
        self,
        params: nnx.State,
        state: SamplerState,
        key: jax.Array,
        sampling: SamplingConfig,
        budget: Any = None,
        active: Any = None,
    ) -> tuple[SamplerState, SampleOutput]:
        """Jitted :func:`decode`. key: one key, or one per row (``[B]`` typed keys or their
        ``[B, 2]`` uint32 data); budget: ``[B]`` int (default ``max_new_tokens``); active:
        ``[B]`` bool (default all rows)."""
        return self._decode(
            *self._decode_args(params, state, key, budget, active), sampling=sampling
        )

    def lower_decode(
        self,
        params: nnx.State,
        state: SamplerState,
        key: jax.Array,
        sampling: SamplingConfig,
        budget: Any = None,
        active: Any = None,
    ) -> jax.stages.Lowered:
        """The decode program for these inputs, lowered but not run (``.compile().as_text()``
        shows its collectives, ``.compile().memory_analysis()`` its memory)."""
        return self._decode.lower(
            *self._decode_args(params, state, key, budget, active), sampling=sampling
        )

    def _decode_args(self, params, state, key, budget, active) -> tuple:
        batch = state.hidden.shape[0]
        budget = np.full(batch, self.max_new_tokens) if budget is None else budget
        active = np.ones(batch, bool) if active is None else active
        if np.shape(budget) != (batch,) or np.shape(active) != (batch,):
            raise ValueError(
                f"decode: budget {np.shape(budget)} and active {np.shape(active)} "
                f"must be [batch={batch}]"
            )
        return (
            params,
            state,
            self._key_put(key, batch),
            self._batch_put(budget, jnp.int32),
            self._batch_put(active, bool),
        )

    def _per_shard(
        self, fn: Callable, params: Any, state: SamplerState, *rows: Any, with_output: bool = False
    ) -> Any:
        """``fn(params, state, *rows)`` (no ``params`` when None) run by each batch shard on its
        own rows and pages (a paged state on a mesh, :func:`paged_state_specs`): parameters
        replicated, ``rows`` batch-major. Returns the state, or ``(state, batch-major output)``
        with ``with_output``."""
        state_specs = paged_state_specs(state)
        specs = (state_specs,) + (P(BATCH_AXES),) * len(rows)
        inputs = (state, *rows)
        if params is not None:
            specs, inputs = (P(),) + specs, (params,) + inputs
        out_specs = (state_specs, P(BATCH_AXES)) if with_output else state_specs
        return jax.shard_map(
            fn, mesh=self.mesh, in_specs=specs, out_specs=out_specs, check_vma=False
        )(*inputs)

    def _init_impl(self, batch_size, max_len, dtype, paging):
        self.trace_counts["init"] += 1
        if self.sharded_pages:  # each batch shard: its rows over its own share of the pages
            shards = batch_shards(self.mesh)
            local = dataclasses.replace(paging, num_pages=paging.num_pages // shards)
            make = lambda: init_state(
                self.config,
                batch_size // shards,
                max_len,
                dtype,  # noqa: E731
                self.dtype,
                local,
            )
            return jax.shard_map(
                make,
                mesh=self.mesh,
                in_specs=(),
                out_specs=paged_state_specs(jax.eval_shape(make)),
                check_vma=False,
            )()
        return self._constrain(
            init_state(self.config, batch_size, max_len, dtype, self.dtype, paging)
        )

    def _append_rows_impl(self, params, state, rows, tokens, mask):
        self.trace_counts["append_rows"] += 1
        if self.sharded_pages:
            return self._per_shard(
                lambda p, *a: append_rows(
                    nnx.merge(self.graphdef, p), *a, chunk=self.prefill_chunk
                ),
                params,
                state,
                rows,
                tokens,
                mask,
            )
        return append_rows(
            nnx.merge(self.graphdef, params),
            state,
            rows,
            tokens,
            mask,
            self._constrain,
            self.prefill_chunk,
        )

    def _copy_rows_impl(self, state, dst, src):
        self.trace_counts["copy_rows"] += 1
        if self.sharded_pages:
            return self._per_shard(copy_rows, None, state, dst, src)
        return self._constrain(copy_rows(state, dst, src))

    def _release_impl(self, state, rows):
        self.trace_counts["release"] += 1
        if self.sharded_pages:
            return self._per_shard(release_rows, None, state, rows)
        return self._constrain(release_rows(state, rows))

    def _append_impl(self, params, state, tokens, mask):
        self.trace_counts["append"] += 1
        if self.sharded_pages:
            return self._per_shard(
                lambda p, *a: append(nnx.merge(self.graphdef, p), *a, chunk=self.prefill_chunk),
                params,
                state,
                tokens,
                mask,
            )
        return append(
            nnx.merge(self.graphdef, params),
            state,
            tokens,
            mask,
            self._constrain,
            self.prefill_chunk,
        )

    def _decode_impl(self, params, state, key, budget, active, *, sampling):
        self.trace_counts["decode"] += 1
        run = functools.partial(self._decode_local, sampling=sampling)
        if self.sharded_pages:
            if key.ndim != 2:
                raise ValueError(
                    "decode: a paged KV cache on a mesh samples each row with its "
                    "own key: pass [B] keys (one key would be split per shard)"
                )
            return self._per_shard(run, params, state, key, budget, active, with_output=True)
        sample_fn = sample
        if key.ndim == 2 and self.mesh is not None and key.shape[0] % batch_shards(self.mesh) == 0:
            sample_fn = rows_local_sample(self.mesh)
        return run(
            params, state, key, budget, active, constrain=self._constrain, sample_fn=sample_fn
        )

    def _decode_local(
        self,
        params,
        state,
        key,
        budget,
        active,
        *,
        sampling,
        constrain=lambda x: x,
        sample_fn=sample,
    ):
        if key.ndim == 2:  # per-row key data
            key = jax.random.wrap_key_data(key)
        return decode(
            nnx.merge(self.graphdef, params),
            state,
            key,
            budget,
            active,
            sampling=sampling,
            max_new_tokens=self.max_new_tokens,
            stop_token_ids=self.stop_token_ids,
            pad_token_id=self.pad_token_id,
            unroll_layers=self.unroll_layers,
            constrain=constrain,
            sample_fn=sample_fn,
        )
