"""Grouped-query softmax attention behind one function, with interchangeable implementations.

What it computes
----------------
``out = attention(q, k, v, key_limit, key_valid)`` is, for every batch row ``b``, query ``i`` and
query head ``h`` (reading key/value head ``h // (H // KV)``)::

    out[b, i, h] = sum_j softmax_j(q[b, i, h] . k[b, j, kv] / sqrt(hd)) * v[b, j, kv]

with the softmax taken over the keys ``j`` *visible* to query ``i``. Scores, softmax and
accumulation are float32; the result is cast to ``v.dtype``.

Visibility rule
---------------
Key ``j`` is visible to query ``i`` of row ``b`` iff ``key_start[b, i] <= j < key_limit[b, i]``
and (``key_valid`` is None or ``key_valid[b, j]``); ``key_start`` None means 0. The one rule
covers

* the no-cache (training) forward: ``key_limit = causal_limit(B, L)`` (``i + 1``; passing
  ``key_limit=None`` means exactly this), ``key_valid = attention_mask``, padding anywhere
  (left-padded, ragged, in the middle);
* the KV-cache forward: ``key_limit = cache_limit(lengths, attention_mask)`` (the number of
  filled slots visible to each token), ``key_valid=None``;
* packed rows (several sequences per row, each a contiguous segment): the causal form plus
  ``key_start = segment_starts(segment_ids)``, the index where each token's segment begins,
  so no token sees another segment's.

A query with no visible key (a left-padding token) gets a finite, meaningless result with a
finite gradient; "xla" gives it a uniform average over all keys (as does "cudnn", whose masked
bias is finite too), "blocked" gives zeros (and a zero gradient), "splash" lets padding tokens
attend among themselves. Losses should (and in the model do) put no cotangent on such rows.

Shapes
------
``q [B, L, H, hd]``; ``k, v [B, S, KV, hd]`` with ``H % KV == 0``; ``key_limit [B, L]`` int (or
None: causal by index); ``key_valid [B, S]`` bool (or None: all keys valid). Returns
``out [B, L, H, hd]`` in ``v.dtype``; ``key_start [B, L]`` int (or None).

Implementations (``implementation=``)
-------------------------------------
* ``"xla"`` (any backend): the full ``[B, KV, G, L, S]`` float32 score matrix, masked scores
  set to -1e30, float32 softmax, probabilities cast to ``v.dtype``, one einsum with ``v``;
  bit-identical to ``qwen3.grouped_query_attention`` with the equivalent ``[B, L, S]`` mask.
  Memory O(B * H * L * S) float32 forward, and the backward keeps the probabilities.
* ``"blocked"`` (any backend, pure XLA): FlashAttention-2 style. A ``lax.scan`` over query
  blocks of ``block_q`` and inside it over key blocks of ``block_k`` with an online softmax
  (running max, running sum, float32 accumulator); L and S are padded up to whole blocks with
  invisible entries. A ``jax.custom_vjp`` saves only ``out`` and the log-sum-exp ``[B, H, L]``
  and recomputes the scores block by block in the backward pass (one scan over key blocks,
  each over query blocks, accumulating dq in float32). Key blocks that no query of a query
  block can see (above the causal diagonal, all-padding, past the cache fill) are skipped
  with ``lax.cond`` (under ``vmap`` that becomes a select: still correct, no longer skipped).
  Memory O(B * H * block_q * block_k) for scores, plus O(B * H * L) for the saved
  log-sum-exp and the dq accumulator. Reverse-mode only (no ``jax.jvp``).
* ``"cudnn"`` (NVIDIA GPU only; float16/bfloat16 inputs): ``jax.nn.dot_product_attention(...,
  implementation="cudnn")`` with the visibility passed as a ``[B, 1, L, S]`` bool mask (and
  ``is_causal`` when ``key_limit`` is None). cuDNN's flash kernel keeps no score matrix, but
  the mask becomes a ``[B, 1, L, S]`` additive bias in the input dtype (and the backward
  produces its gradient), i.e. O(B * L * S) half-precision memory shared by all heads. It
  raises elsewhere.
* ``"splash"`` (TPU only): the Pallas splash-attention kernel
  (``jax.experimental.pallas.ops.tpu.splash_attention``) with a causal mask and segment ids
  ``key_valid`` (as int; with ``key_start``, ``key_start + 1`` on valid tokens, so each
  segment is its own), vmapped over the batch. Only the causal no-cache form is expressible
  (``key_limit`` None or concretely equal to ``causal_limit``, ``L == S``); anything else
  raises ValueError. L is padded to whole kernel blocks (multiples of 128). Memory
  O(B * H * L) (the kernel saves out and log-sum-exp). Padding tokens (``key_valid`` False)
  attend to earlier padding tokens instead of following the rule; every real token follows it.
  Runs on one device per call: under a multi-device mesh call it inside ``shard_map``. Compiled
  for a TPU v5p topology (forward and grad) and checked against "xla" in the Pallas
  interpreter on CPU (see the tests).
* ``"auto"``: see :func:`select_implementation`; it chooses for the platform the program is
  built for: the default backend's, or the one named by :func:`built_for` (a plan compiling
  for GPUs or TPUs that are not there, in a process whose backend is the CPU).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Iterator
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Implementation = Literal["auto", "xla", "blocked", "cudnn", "splash"]
IMPLEMENTATIONS: tuple[str, ...] = ("xla", "blocked", "cudnn", "splash", "auto")

# Score of an invisible key. Finite, so a query without visible keys never produces NaN.
_MASKED_SCORE = -1e30
# "auto" leaves the full score matrix ("xla") once L * S exceeds this many entries.
_XLA_MAX_SCORES = 1 << 22
_SPLASH_LANES = 128


# ------------------------------------------------------------------------------- helpers
def causal_limit(batch: int, length: int) -> jax.Array:
    """``[B, L]`` int32 ``i + 1``: query ``i`` sees keys ``0..i`` (causal by index)."""
    return jnp.broadcast_to(jnp.arange(1, length + 1, dtype=jnp.int32), (batch, length))


def cache_limit(lengths: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """``[B, L]`` int32 key limits for a KV-cache forward.

    lengths ``[B]``: filled slots before this call; attention_mask ``[B, L]``: the new real
    tokens, which are written compactly after them. Token ``i`` sees the slots up to and
    including its own: ``lengths + cumsum(attention_mask)``.
    """
    return (lengths[:, None] + jnp.cumsum(attention_mask.astype(jnp.int32), axis=1)).astype(
        jnp.int32
    )


def segment_starts(segment_ids: jax.Array) -> jax.Array:
    """``[B, L]`` int32: the index where each token's segment begins. ``segment_ids [B, L]``
    int, a segment being a run of equal ids (packed rows: 1, 1, 1, 2, 2, 0, 0 with 0 for
    padding; the padding run is a segment of its own, and sees no valid key)."""
    index = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)
    new = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1
    )
    return lax.cummax(jnp.where(new, index, 0), axis=1)


def visibility(
    key_limit: jax.Array | None,
    key_valid: jax.Array | None,
    length: int,
    keys: int,
    key_start: jax.Array | None = None,
) -> jax.Array:
    """``[B, L, S]`` bool: key ``j`` visible to query ``i`` (the rule of the module docstring).

    With every argument None the batch axis is 1.
    """
    if key_limit is None:
        batch = next((x.shape[0] for x in (key_valid, key_start) if x is not None), 1)
        key_limit = causal_limit(batch, length)
    keys_index = jnp.arange(keys)[None, None, :]
    visible = keys_index < key_limit[:, :, None]
    if key_start is not None:
        visible = visible & (keys_index >= key_start[:, :, None])
    if key_valid is not None:
        visible = visible & key_valid.astype(bool)[:, None, :]
    return visible


def _concrete(x: jax.Array) -> np.ndarray | None:
    """``x`` as a NumPy array when its value is known at trace time, else None."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def is_causal_limit(key_limit: jax.Array | None) -> bool:
    """True iff ``key_limit`` is None or concretely equal to :func:`causal_limit`.

    A traced ``key_limit`` is not known to be causal: pass None for the causal no-cache form.
    """
    if key_limit is None:
        return True
    value = _concrete(key_limit)
    return value is not None and bool(np.all(value == np.arange(1, value.shape[1] + 1)))


# ------------------------------------------------------------------------------- selection
_BUILT_FOR: contextvars.ContextVar[str | None] = contextvars.ContextVar("built_for", default=None)


@contextlib.contextmanager
def built_for(platform: str | None) -> Iterator[None]:
    """Within the block, ``"auto"`` chooses for ``platform`` (``jax.Device.platform``: "gpu",
    "tpu", "cpu"; None: the default backend's) when a program is traced."""
    token = _BUILT_FOR.set(platform)
    try:
        yield
    finally:
        _BUILT_FOR.reset(token)


_PARTITIONED: contextvars.ContextVar[bool] = contextvars.ContextVar("partitioned", default=False)


@contextlib.contextmanager
def partitioned(on: bool = True) -> Iterator[None]:
    """Within the block, the program traced is split over several devices by XLA's partitioner
    (``jit`` with shardings over a mesh of more than one device, not ``shard_map``): ``"auto"``
    then chooses no Pallas Mosaic kernel ("splash"), which XLA cannot partition ("Mosaic kernels
    cannot be automatically partitioned")."""
    token = _PARTITIONED.set(on)
    try:
        yield
    finally:
        _PARTITIONED.reset(token)


def target_platform() -> str:
    """The platform ``"auto"`` chooses for: :func:`built_for`'s, else the default backend."""
    return _BUILT_FOR.get() or jax.default_backend()


def select_implementation(q: jax.Array, k: jax.Array, key_limit: jax.Array | None) -> str:
    """The implementation ``"auto"`` runs for these inputs on :func:`target_platform`.

    TPU: "splash" for the causal no-cache form (``key_limit`` None, L == S, hd a multiple of
    128) in a program on one device (not within :func:`partitioned`). NVIDIA GPU: "cudnn" for
    the no-cache form in float16/bfloat16 with hd <= 128 and a multiple of 8. Otherwise
    "blocked" when L * S exceeds ``_XLA_MAX_SCORES``, else "xla".
    """
    backend = target_platform()
    length, keys, head_dim = q.shape[1], k.shape[1], q.shape[-1]
    if (
        backend == "tpu"
        and not _PARTITIONED.get()
        and key_limit is None
        and length == keys
        and head_dim % _SPLASH_LANES == 0
    ):
        return "splash"
    if (
        backend in ("gpu", "cuda")
        and key_limit is None
        and q.dtype in (jnp.bfloat16, jnp.float16)
        and head_dim <= 128
        and head_dim % 8 == 0
    ):
        return "cudnn"
    return "blocked" if length * keys > _XLA_MAX_SCORES else "xla"


# ------------------------------------------------------------------------------- entry point
def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    key_limit: jax.Array | None,
    key_valid: jax.Array | None = None,
    *,
    key_start: jax.Array | None = None,
    implementation: Implementation = "xla",
    block_q: int = 512,
    block_k: int = 512,
) -> jax.Array:
    """Grouped-query attention under the module's visibility rule.

    q ``[B, L, H, hd]``; k, v ``[B, S, KV, hd]``; key_limit ``[B, L]`` int or None (causal);
    key_valid ``[B, S]`` bool or None; key_start ``[B, L]`` int or None (packed rows:
    :func:`segment_starts`). ``block_q``/``block_k`` size the tiles of "blocked" and
    "splash". Returns ``[B, L, H, hd]`` in ``v.dtype``.
    """
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads {q.shape[2]} not a multiple of key/value heads {k.shape[2]}")
    if implementation == "auto":
        implementation = select_implementation(q, k, key_limit)
    if implementation == "xla":
        visible = visibility(key_limit, key_valid, q.shape[1], k.shape[1], key_start)
        return _xla_attention(q, k, v, visible)
    if implementation == "blocked":
        return _blocked_attention(q, k, v, key_limit, key_valid, block_q, block_k, key_start)
    if implementation == "cudnn":
        return _cudnn_attention(q, k, v, key_limit, key_valid, key_start)
    if implementation == "splash":
        return _splash_attention(
            q, k, v, key_limit, key_valid, block_q, block_k, key_start=key_start
        )
    raise ValueError(f"unknown attention implementation {implementation!r}")


# ------------------------------------------------------------------------------- xla
def _xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array) -> jax.Array:
    """Full score matrix. q ``[B, L, H, hd]``, k/v ``[B, S, KV, hd]``, visible ``[B|1, L, S]``."""
    batch, length, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    grouped = q.reshape(batch, length, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("blkgd,bskd->bkgls", grouped, k, preferred_element_type=jnp.float32)
    scores = jnp.where(visible[:, None, None], scores * head_dim**-0.5, _MASKED_SCORE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgls,bskd->blkgd", probs, v)
    return out.reshape(batch, length, heads, head_dim)


# ------------------------------------------------------------------------------- blocked
def _tiling(n: int, block: int) -> tuple[int, int]:
    """``(size, count)`` of the fewest tiles of at most ``block`` covering ``n``, balanced."""
    count = max(1, -(-n // max(1, block)))
    return -(-n // count), count


def _pad_axis(x: jax.Array, axis: int, target: int, value=0) -> jax.Array:
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, target - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def _to_blocks(x: jax.Array, axis: int, size: int) -> jax.Array:
    """Split ``axis`` (a multiple of ``size``) into tiles and move the tile index to the front."""
    shape = x.shape
    x = x.reshape(shape[:axis] + (shape[axis] // size, size) + shape[axis + 1 :])
    return jnp.moveaxis(x, axis, 0)


def _from_blocks(x: jax.Array, axis: int) -> jax.Array:
    """Inverse of :func:`_to_blocks`."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2 :])


def _blocked_attention(q, k, v, key_limit, key_valid, block_q, block_k, key_start=None):
    """Pads, moves heads in front of the sequence axes, and runs the flash kernel.

    Inside: q ``[B, KV, G, Lp, hd]``, k/v ``[B, KV, Sp, hd]``, limit and start ``[B, Lp]``,
    valid ``[B, Sp]``; padded queries have limit 0, padded keys are invalid.
    """
    batch, length, heads, head_dim = q.shape
    keys, kv_heads = k.shape[1], k.shape[2]
    bq, nq = _tiling(length, block_q)
    bk, nk = _tiling(keys, block_k)
    limit = causal_limit(batch, length) if key_limit is None else key_limit.astype(jnp.int32)
    limit = _pad_axis(jnp.minimum(limit, keys), 1, bq * nq)
    start = jnp.zeros((batch, length), jnp.int32) if key_start is None else key_start
    start = _pad_axis(start.astype(jnp.int32), 1, bq * nq)
    valid = jnp.ones((batch, keys), bool) if key_valid is None else key_valid.astype(bool)
    valid = _pad_axis(valid, 1, bk * nk, False)
    grouped = q.reshape(batch, length, kv_heads, heads // kv_heads, head_dim)
    qh = _pad_axis(grouped.transpose(0, 2, 3, 1, 4), 3, bq * nq)
    kh = _pad_axis(k.transpose(0, 2, 1, 3), 2, bk * nk)
    vh = _pad_axis(v.transpose(0, 2, 1, 3), 2, bk * nk)
    # Tie the masks to this call's queries. Inside a differentiated scan over layers the masks
    # are loop-invariant, and JAX would hoist everything computed from them alone (every
    # block pair's visibility, O(L x S)) out of the loop and keep it for all block pairs.
    limit, start, valid, qh = lax.optimization_barrier((limit, start, valid, qh))
    out = _flash(qh, kh, vh, (limit, start), valid, bq, bk)  # [B, KV, G, Lp, hd]
    out = out[:, :, :, :length].transpose(0, 3, 1, 2, 4)
    return out.reshape(batch, length, heads, head_dim)


def _block_scores(q_blk, k_blk, limit_blk, valid_blk, k_start):
    """Scaled float32 scores with invisible ones at -1e30, and the visibility.

    q_blk ``[B, KV, G, bq, hd]``, k_blk ``[B, KV, bk, hd]``, limit_blk a pair
    ``(limit, start)`` of ``[B, bq]``, valid_blk ``[B, bk]``, k_start: index of the block's
    first key. Returns scores ``[B, KV, G, bq, bk]`` and visible ``[B, 1, 1, bq, bk]``.
    """
    limit_blk, start_blk = limit_blk
    scores = jnp.einsum("bkgqd,bksd->bkgqs", q_blk, k_blk, preferred_element_type=jnp.float32)
    key_index = (k_start + jnp.arange(k_blk.shape[2]))[None, None, :]
    visible = (key_index < limit_blk[:, :, None]) & (key_index >= start_blk[:, :, None])
    visible = (visible & valid_blk[:, None, :])[:, None, None]
    return jnp.where(visible, scores * q_blk.shape[-1] ** -0.5, _MASKED_SCORE), visible


def _pair_visible(limit_blk, valid_blk, k_start):
    """Scalar bool: some query of the query block may see some key of the key block."""
    limit_blk, start_blk = limit_blk
    k_end = k_start + valid_blk.shape[-1]
    return (k_start < jnp.max(limit_blk)) & (k_end > jnp.min(start_blk)) & jnp.any(valid_blk)


def _flash_forward(q, k, v, limit, valid, bq, bk):
    """Online-softmax forward on padded head-major inputs (see ``_blocked_attention``).

    Returns out ``[B, KV, G, Lp, hd]`` in v.dtype and the log-sum-exp ``[B, KV, G, Lp]``
    float32 (0 for queries with no visible key, whose output is 0).
    """
    q_blocks = _to_blocks(q, 3, bq)
    limit_blocks = jax.tree.map(lambda x: _to_blocks(x, 1, bq), limit)
    k_blocks, v_blocks = _to_blocks(k, 2, bk), _to_blocks(v, 2, bk)
    valid_blocks = _to_blocks(valid, 1, bk)
    k_starts = jnp.arange(k_blocks.shape[0]) * bk

    def query_block(_, xs):
        q_blk, limit_blk = xs
        stats = q_blk.shape[:-1]  # [B, KV, G, bq]
        init = (
            jnp.full(stats, _MASKED_SCORE, jnp.float32),
            jnp.zeros(stats, jnp.float32),
            jnp.zeros(q_blk.shape, jnp.float32),
        )

        def key_block(carry, ys):
            k_blk, v_blk, valid_blk, k_start = ys

            def update(carry):
                m, denom, acc = carry
                scores, visible = _block_scores(q_blk, k_blk, limit_blk, valid_blk, k_start)
                m_new = jnp.maximum(m, scores.max(-1))
                p = jnp.where(visible, jnp.exp(scores - m_new[..., None]), 0.0)
                rescale = jnp.exp(m - m_new)
                pv = jnp.einsum(
                    "bkgqs,bksd->bkgqd",
                    p.astype(v.dtype),
                    v_blk,
                    preferred_element_type=jnp.float32,
                )
                return m_new, denom * rescale + p.sum(-1), acc * rescale[..., None] + pv

            touched = _pair_visible(limit_blk, valid_blk, k_start)
            return lax.cond(touched, update, lambda c: c, carry), None

        (m, denom, acc), _ = lax.scan(key_block, init, (k_blocks, v_blocks, valid_blocks, k_starts))
        seen = denom > 0
        out = acc / jnp.where(seen, denom, 1.0)[..., None]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1.0)), 0.0)
        return None, (out.astype(v.dtype), lse)

    _, (out, lse) = lax.scan(query_block, None, (q_blocks, limit_blocks))
    return _from_blocks(out, 3), _from_blocks(lse, 3)


def _flash_backward(q, k, v, limit, valid, out, lse, dout, bq, bk):
    """FlashAttention-2 backward: recompute the probabilities tile by tile.

    One scan over key blocks (yielding that block's dk, dv), each a scan over query blocks
    that adds into a float32 dq ``[nq, B, KV, G, bq, hd]``. Returns dq, dk, dv in the dtypes
    of q, k, v.
    """
    q_blocks = _to_blocks(q, 3, bq)
    limit_blocks = jax.tree.map(lambda x: _to_blocks(x, 1, bq), limit)
    dout_blocks, lse_blocks = _to_blocks(dout, 3, bq), _to_blocks(lse, 3, bq)
    # D_i = do_i . out_i, the softmax-Jacobian term shared by the query's row.
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    delta_blocks = _to_blocks(delta, 3, bq)
    k_blocks, v_blocks = _to_blocks(k, 2, bk), _to_blocks(v, 2, bk)
    valid_blocks = _to_blocks(valid, 1, bk)
    k_starts = jnp.arange(k_blocks.shape[0]) * bk
    q_index = jnp.arange(q_blocks.shape[0])
    scale = q.shape[-1] ** -0.5

    def key_block(dq, xs):
        k_blk, v_blk, valid_blk, k_start = xs
        init = (dq, jnp.zeros(k_blk.shape, jnp.float32), jnp.zeros(v_blk.shape, jnp.float32))

        def query_block(carry, ys):
            q_blk, do_blk, lse_blk, delta_blk, limit_blk, qi = ys

            def update(carry):
                dq, dk, dv = carry
                scores, visible = _block_scores(q_blk, k_blk, limit_blk, valid_blk, k_start)
                p = jnp.where(visible, jnp.exp(scores - lse_blk[..., None]), 0.0)
                dv = dv + jnp.einsum(
                    "bkgqs,bkgqd->bksd",
                    p.astype(do_blk.dtype),
                    do_blk,
                    preferred_element_type=jnp.float32,
                )
                dp = jnp.einsum(
                    "bkgqd,bksd->bkgqs", do_blk, v_blk, preferred_element_type=jnp.float32
                )
                ds = p * (dp - delta_blk[..., None]) * scale
                dq_blk = jnp.einsum(
                    "bkgqs,bksd->bkgqd",
                    ds.astype(k_blk.dtype),
                    k_blk,
                    preferred_element_type=jnp.float32,
                )
                dq = lax.dynamic_update_index_in_dim(
                    dq, lax.dynamic_index_in_dim(dq, qi, 0, keepdims=False) + dq_blk, qi, 0
                )
                dk = dk + jnp.einsum(
                    "bkgqs,bkgqd->bksd",
                    ds.astype(q_blk.dtype),
                    q_blk,
                    preferred_element_type=jnp.float32,
                )
                return dq, dk, dv

            touched = _pair_visible(limit_blk, valid_blk, k_start)
            return lax.cond(touched, update, lambda c: c, carry), None

        (dq, dk, dv), _ = lax.scan(
            query_block,
            init,
            (q_blocks, dout_blocks, lse_blocks, delta_blocks, limit_blocks, q_index),
        )
        return dq, (dk.astype(k.dtype), dv.astype(v.dtype))

    dq0 = jnp.zeros(q_blocks.shape, jnp.float32)
    dq, (dk, dv) = lax.scan(key_block, dq0, (k_blocks, v_blocks, valid_blocks, k_starts))
    return _from_blocks(dq, 3).astype(q.dtype), _from_blocks(dk, 2), _from_blocks(dv, 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _flash(q, k, v, limit, valid, bq, bk):
    """Blocked attention on padded head-major inputs; saves only out and log-sum-exp.
    ``limit``: the pair ``(key_limit, key_start)`` ``[B, Lp]``."""
    return _flash_forward(q, k, v, limit, valid, bq, bk)[0]


def _flash_fwd(q, k, v, limit, valid, bq, bk):
    out, lse = _flash_forward(q, k, v, limit, valid, bq, bk)
    return out, (q, k, v, limit, valid, out, lse)


def _flash_bwd(bq, bk, residuals, dout):
    q, k, v, limit, valid, out, lse = residuals
    dq, dk, dv = _flash_backward(q, k, v, limit, valid, out, lse, dout, bq, bk)
    return dq, dk, dv, (None, None), None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ------------------------------------------------------------------------------- cudnn
def _cudnn_attention(q, k, v, key_limit, key_valid, key_start=None):
    """cuDNN flash attention with the visibility as a ``[B, 1, L, S]`` mask (NVIDIA GPU only)."""
    length, keys = q.shape[1], k.shape[1]
    visible = jnp.broadcast_to(
        visibility(key_limit, key_valid, length, keys, key_start), (q.shape[0], length, keys)
    )
    out = jax.nn.dot_product_attention(
        q,
        k,
        v,
        mask=visible[:, None],
        is_causal=key_limit is None and length == keys,
        implementation="cudnn",
    )
    return out.astype(v.dtype)


# ------------------------------------------------------------------------------- splash
def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@functools.lru_cache(maxsize=32)
def _splash_kernel(heads: int, length: int, bq: int, bk: int, interpret: bool = False):
    """A causal splash-attention kernel for ``[heads, length, hd]`` queries (one batch row).

    ``interpret=True`` runs the Pallas interpreter instead (any backend, slow; for tests).
    """
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    mask = splash.MultiHeadMask([splash.CausalMask((length, length))] * heads)
    blocks = splash.BlockSizes(
        block_q=bq,
        block_kv=bk,
        block_kv_compute=bk,
        block_q_dkv=bq,
        block_kv_dkv=bk,
        block_kv_dkv_compute=bk,
        use_fused_bwd_kernel=True,
    )
    return splash.make_splash_mha(
        mask, block_sizes=blocks, head_shards=1, q_seq_shards=1, interpret=interpret
    )


def _splash_attention(
    q, k, v, key_limit, key_valid, block_q, block_k, interpret=False, key_start=None
):
    """TPU splash attention for the causal no-cache form; segment ids are ``key_valid`` (and
    with ``key_start``, each segment's start + 1 on its valid tokens)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    batch, length, heads, head_dim = q.shape
    if not is_causal_limit(key_limit):
        raise ValueError(
            "splash attention expresses only the causal no-cache form: pass "
            "key_limit=None (a traced or non-causal key_limit, e.g. a KV cache's, "
            "is not supported; use 'blocked' or 'xla')"
        )
    if k.shape[1] != length:
        raise ValueError(
            f"splash attention needs as many keys as queries, got {k.shape[1]} "
            f"keys for {length} queries"
        )
    if block_q % _SPLASH_LANES or block_k % _SPLASH_LANES:
        raise ValueError(
            f"splash block sizes must be multiples of {_SPLASH_LANES}, got {block_q}, {block_k}"
        )
    bq = min(block_q, _round_up(length, _SPLASH_LANES))
    bk = min(block_k, _round_up(length, _SPLASH_LANES))
    padded = _round_up(length, math.lcm(bq, bk))
    valid = jnp.ones((batch, length), bool) if key_valid is None else key_valid.astype(bool)
    # Padding tokens (segment 0) attend among themselves, so no query row is empty.
    ids = valid.astype(jnp.int32) if key_start is None else jnp.where(valid, key_start + 1, 0)
    segments = _pad_axis(ids.astype(jnp.int32), 1, padded)
    scaled = (q * head_dim**-0.5).astype(q.dtype)
    qh = _pad_axis(scaled.transpose(0, 2, 1, 3), 2, padded)  # [B, H, Lp, hd]
    kh = _pad_axis(k.transpose(0, 2, 1, 3), 2, padded)  # [B, KV, Lp, hd]
    vh = _pad_axis(v.transpose(0, 2, 1, 3), 2, padded)
    kernel = _splash_kernel(heads, padded, bq, bk, interpret)

    def one_row(q_row, k_row, v_row, seg_row):
        return kernel(q_row, k_row, v_row, segment_ids=SegmentIds(q=seg_row, kv=seg_row))

    out = jax.vmap(one_row)(qh, kh, vh, segments)  # [B, H, Lp, hd]
    return out[:, :, :length].transpose(0, 2, 1, 3).astype(v.dtype)
