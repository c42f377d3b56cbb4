"""The pure sampling engine: batched prefill / decode / continuation over a static-shape or paged
KV cache, as functions of a model and a :class:`SamplerState` (no placement, no jit; the
jitted class that places them is :class:`agentrl_jax.sampling.jitted.Sampler`)::

    state = init_state(config, batch_size=8, max_len=1024)
    state = append(model, state, prompt_tokens, prompt_mask)               # prefill
    state, out = decode(model, state, key, budget, active, sampling=SamplingConfig(top_p=0.9),
                        max_new_tokens=64, stop_token_ids=eos_ids)
    state = append(model, state, observation_tokens, observation_mask)     # next turn

``append`` writes each row's real tokens (mask True; padding may sit anywhere) after that row's
cached tokens and keeps the final hidden state of its last one, so prefill and an environment
observation in a later turn are the same call and the prefix is never re-encoded. ``decode``
samples up to ``max_new_tokens`` tokens per row in one ``lax.while_loop`` that ends once every
row has stopped (a stop token, its budget, or a full cache); every sampled token, the last
included, is written to the cache, so the next ``append`` continues right after it.

Memory: the cache's dtype is a choice of :func:`init_state` (e.g. bfloat16 for a float32 model; the
default is the model's compute dtype). With ``prefill_chunk`` an ``append`` wider than the
chunk runs as successive appends of ``prefill_chunk`` columns (one ``lax.scan``), which is
one wide append (appends are compact: a row's real tokens go after its cached ones wherever
they sit in the chunk; equal up to the rounding of differently shaped matrix products) but
bounds the attention temporaries to ``[B, heads, chunk, max_len]``.

Paged (``init_state(..., paging=Paging(...))``): the state holds a
:class:`~agentrl_jax.models.paged_cache.PagedKVCache` instead; every write first allocates the
pages it needs (a row that finds none left is flagged ``overflowed``, in decode with
``StopReason.NO_PAGE``: a policy can release it and replay it later), attention reads only
the pages in use, :func:`release_rows` frees finished rows and :func:`append_rows` prefills a
few rows without touching the others (seating new rows in continuous batching).

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
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from agentrl_jax.models import paged_cache, paged_kernels
from agentrl_jax.models.config import Qwen3Config
from agentrl_jax.models.moe import EXPERT_ID_DTYPE
from agentrl_jax.models.paged_cache import PagedKVCache
from agentrl_jax.models.qwen3 import KVCache, Qwen3ForCausalLM, positions_from_mask
from agentrl_jax.sampling import exact
from agentrl_jax.sampling.filters import SamplingConfig, model_log_probs, sample
from agentrl_jax.sharding import (
    BATCH_AXES,
)
from agentrl_jax.validation import integer, one_of, optional, validate


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
    :class:`~agentrl_jax.sampling.SamplerPolicy` then preempts it: released, replayed later);
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
    # MoE models: [B, N, M, k] int16, the experts each sampled token went through in each of
    # the M MoE layers when the engine cached it (-1 on padding), for routing replay; else None
    experts: jax.Array | None = None
    # with decode's ``top_logprobs`` K > 0: [B, N, K] the K most likely ids at each step under
    # the model (temperature 1, untruncated) and their log-probs, most likely first; else None
    top_ids: jax.Array | None = None
    top_log_probs: jax.Array | None = None

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


def step_keys(key: jax.Array, t: jax.Array, offset: jax.Array | None = None) -> jax.Array:
    """Decode step ``t``'s key(s): ``fold_in(key, t)`` of one key, or of each of ``[B]`` keys;
    with ``offset [B]`` (per-row keys only) ``fold_in(key[b], t + offset[b])``."""
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) and key.ndim == 1:
        if offset is not None:
            return jax.vmap(jax.random.fold_in)(key, t + offset.astype(jnp.int32))
        return jax.vmap(jax.random.fold_in, in_axes=(0, None))(key, t)
    if offset is not None:
        raise ValueError("decode: a step offset needs one key per row")
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
    offset: jax.Array | None = None,
    top_logprobs: int = 0,
    history: jax.Array | None = None,
) -> tuple[SamplerState, SampleOutput]:
    """Sample up to ``min(budget[b], max_new_tokens)`` tokens for each ``active`` row.

    key: one key, or ``[B]`` typed keys (one per row); budget: ``[B]`` int; active: ``[B]``
    bool. Rows with nothing cached or already overflowed do not run. Returns the state with
    every sampled token cached, and the samples.
    ``unroll_layers``: run the layers unrolled from :meth:`Qwen3ForCausalLM.split_layers`.
    ``sample_fn``: draws each step's tokens (default :func:`sample`; see
    :func:`rows_local_sample`). ``offset``: ``[B]`` int, with per-row keys: row ``b``'s step
    ``t`` draws with ``fold_in(key[b], offset[b] + t)``, so a response decoded in pieces of
    ``k`` tokens (offsets 0, k, 2k, ...) is the one a single call samples (continuous
    batching, :mod:`agentrl_jax.serve.engine`). ``top_logprobs`` K > 0: the output also
    holds each step's K most likely tokens under the model and their log-probs
    (``SampleOutput.top_ids`` / ``top_log_probs``).

    ``history``: ``[B, L]`` int, each row's cached tokens at ``[0, lengths[b])`` (exact
    log-probs, :mod:`agentrl_jax.sampling.exact`): each step's logits are then the canonical
    forward's of the row's history (:func:`~agentrl_jax.sampling.exact.next_token_logits`),
    the recorded log-probs :func:`~agentrl_jax.sampling.exact.token_logprobs` of them, and
    each sampled token joins the history (a row stops with ``CONTEXT_FULL`` at ``L`` tokens).
    None: the cache's own logits (the fast path).
    """
    layers = model.split_layers() if unroll_layers else None
    batch = state.hidden.shape[0]
    max_len = state.cache.max_len if history is None else min(state.cache.max_len, history.shape[1])
    stop_ids = jnp.asarray(tuple(stop_token_ids) or (-1,), jnp.int32)
    budget = jnp.minimum(budget.astype(jnp.int32), max_new_tokens)
    running = active.astype(bool) & ~state.overflowed & (state.cache.lengths > 0) & (budget > 0)
    config = model.config
    moe_layers = sum(config.moe_layers)
    out = SampleOutput(
        tokens=jnp.full((batch, max_new_tokens), pad_token_id, jnp.int32),
        log_probs=jnp.zeros((batch, max_new_tokens), jnp.float32),
        sampling_log_probs=jnp.zeros((batch, max_new_tokens), jnp.float32),
        lengths=jnp.zeros((batch,), jnp.int32),
        stop_reason=jnp.full((batch,), StopReason.NOT_RUN, jnp.int32),
        experts=jnp.full(
            (batch, max_new_tokens, moe_layers, config.num_experts_per_tok), -1, EXPERT_ID_DTYPE
        )
        if moe_layers
        else None,
        top_ids=jnp.zeros((batch, max_new_tokens, top_logprobs), jnp.int32)
        if top_logprobs
        else None,
        top_log_probs=jnp.zeros((batch, max_new_tokens, top_logprobs), jnp.float32)
        if top_logprobs
        else None,
    )

    def step(carry):
        t, state, running, out, history = carry
        if history is None:
            logits = model.logits(state.hidden, few_rows=True)  # [B, V] float32
        else:  # the canonical forward of each row's history
            logits = exact.next_token_logits(model, history, state.cache.lengths)
        no_room = running & (state.cache.lengths >= max_len)
        no_page = jnp.zeros_like(no_room)
        if isinstance(state.cache, PagedKVCache):  # a page for the token if it starts one
            cache, got = paged_cache.allocate(
                state.cache, state.cache.lengths + (running & ~no_room)
            )
            state, no_page = state.replace(cache=cache), running & ~no_room & ~got
        running = running & ~no_room & ~no_page
        tokens, sampling_lp = sample_fn(step_keys(key, t, offset), logits, sampling)
        if history is None:
            model_lp = model_log_probs(logits, tokens)
        else:
            model_lp = exact.token_logprobs(logits, tokens, None)
            sampling_lp = exact.token_logprobs(logits, tokens, sampling)
            at = jnp.where(running, state.cache.lengths, history.shape[1])  # else dropped
            history = history.at[jnp.arange(batch), at].set(tokens, mode="drop")

        def column(buffer, values):
            old = jax.lax.dynamic_index_in_dim(buffer, t, axis=1, keepdims=False)
            return jax.lax.dynamic_update_index_in_dim(
                buffer,
                jnp.where(running.reshape(-1, *[1] * (values.ndim - 1)), values, old),
                t,
                axis=1,
            )

        hidden, cache, *routing = model.hidden_states(
            tokens[:, None],
            state.cache.lengths[:, None],
            running[:, None],
            state.cache,
            few_rows=True,
            layers=layers,
            routing=bool(moe_layers),
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
            log_probs=column(out.log_probs, model_lp),
            sampling_log_probs=column(out.sampling_log_probs, sampling_lp),
            lengths=lengths,
            stop_reason=reason.astype(jnp.int32),
            experts=column(out.experts, routing[0].experts[:, 0].astype(EXPERT_ID_DTYPE))
            if moe_layers
            else None,
            **(top_columns(out, logits, top_logprobs, column) if top_logprobs else {}),
        )
        state = constrain(
            SamplerState(
                cache=cache,
                hidden=jnp.where(running[:, None], hidden.astype(state.hidden.dtype), state.hidden),
                overflowed=state.overflowed | no_room | no_page,
            )
        )
        return t + 1, state, running & ~hit_stop & ~spent, out, history

    def not_done(carry):
        t, _, running, _, _ = carry
        return (t < max_new_tokens) & jnp.any(running)

    carry = (jnp.int32(0), state, running, out, history)
    _, state, _, out, _ = jax.lax.while_loop(not_done, step, carry)
    return state, out


def top_columns(out: SampleOutput, logits: jax.Array, k: int, column: Callable) -> dict:
    """``out``'s ``top_ids`` / ``top_log_probs`` with this step's column: the ``k`` most
    likely ids of ``logits [B, V]`` under the model (log-softmax, temperature 1)."""
    values, ids = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), k)
    return {
        "top_ids": column(out.top_ids, ids.astype(jnp.int32)),
        "top_log_probs": column(out.top_log_probs, values),
    }


def paged_state_specs(state: SamplerState) -> SamplerState:
    """The ``PartitionSpec`` of each leaf of a paged state on a mesh: rows, and the pool's
    pages, split over ``BATCH_AXES``. Each batch shard is then a whole one-device engine: its
    rows' page tables name pages of its own part of the pool (local ids), so the sampler runs
    every paged program per shard (``shard_map``) and no page ever crosses devices."""
    rows = P(BATCH_AXES)
    pages = P(None, None, BATCH_AXES)  # [KV, layers, P, S, hd]
    cache = state.cache.replace(k=pages, v=pages, page_table=rows, lengths=rows, free=rows)
    return SamplerState(cache=cache, hidden=rows, overflowed=rows)
