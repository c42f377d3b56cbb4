"""Loss aggregation as (sum, denominator) pairs.

Every loss in :mod:`agentrl_jax.algorithms` reduces its per-token values ``[N, L]`` (N
sequences, L padded token positions, a loss mask ``[N, L]`` that is 1 on the policy's own
sampled tokens) to a :class:`LossSum` ``(total, denom)`` instead of a mean. The mean is
``total / denom``, taken once, after the pairs of all micro-batches (and all devices) have
been added together. Because both parts are plain sums over sequences, this gives exactly
the full-batch mean for every mode below, and the gradient of the mean is the sum of the
micro-batch gradients of ``total`` divided by the global ``denom`` (``denom`` never depends
on parameters).

Modes (``norm_constant`` is only used by the last one):

``"token-mean"``
    total = sum_{i,t} m_it l_it,  denom = sum_{i,t} m_it.
    Every token weighs the same. Exact under any split of the batch.
``"seq-mean-token-mean"``
    total = sum_i (sum_t m_it l_it / sum_t m_it),  denom = #{i : sum_t m_it > 0}.
    Each sequence's token mean is taken within the sequence, so the pair is exact when
    micro-batches (or devices) split the batch along sequences, which is how they split.
``"seq-mean-token-sum"``
    total = sum_{i,t} m_it l_it / norm_constant,  denom = #{i : sum_t m_it > 0}.
    Token sums per sequence scaled by a constant (e.g. the maximum response length, as in
    Dr. GRPO); ``norm_constant=1`` is the plain sequence-mean of token sums.

In the sequence modes a row with no loss tokens (a padded row) is not counted.

Packed rows (several sequences per row, the train step's ``rl.memory.packing``): with
``segment_ids [N, L]`` (a run of equal ids is one sequence) the sequence modes take each
sequence within its row as ``i`` above, so a packed batch gives the pair of the unpacked one.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

import jax
import jax.numpy as jnp

AGGREGATION_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


class LossSum(NamedTuple):
    """An unreduced loss: ``total`` (scalar sum) and ``denom`` (scalar count) of one batch part.

    A pytree, so ``jax.lax.psum`` and ``jax.tree.map`` apply to it directly. Use
    :func:`combine` to add parts (``+`` on a NamedTuple concatenates, it does not add).
    """

    total: jax.Array
    denom: jax.Array


def validate_mode(mode: str, norm_constant: float = 1.0) -> None:
    """Raises ValueError naming the bad argument if ``mode`` or ``norm_constant`` is invalid."""
    if mode not in AGGREGATION_MODES:
        raise ValueError(
            f"aggregation mode: unknown {mode!r}; known: {', '.join(AGGREGATION_MODES)}"
        )
    if not (
        isinstance(norm_constant, (int, float))
        and norm_constant > 0
        and norm_constant != float("inf")
    ):
        raise ValueError(
            f"aggregation norm_constant: must be a finite number > 0, got {norm_constant!r}"
        )


def aggregate(
    per_token: jax.Array,
    mask: jax.Array,
    mode: str = "token-mean",
    norm_constant: float = 1.0,
    segment_ids: jax.Array | None = None,
) -> LossSum:
    """Reduces per-token values ``[N, L]`` under ``mask [N, L]`` to a :class:`LossSum`.

    ``mask`` may be bool or float (weights). See the module docstring for the modes and for
    ``segment_ids`` (packed rows).
    """
    validate_mode(mode, norm_constant)
    if per_token.shape != mask.shape or per_token.ndim != 2:
        raise ValueError(
            f"aggregate: per_token {per_token.shape} and mask {mask.shape} must both be [N, L]"
        )
    weights = mask.astype(per_token.dtype)
    masked = per_token * weights
    if mode == "token-mean":
        return LossSum(jnp.sum(masked), jnp.sum(weights))
    if segment_ids is not None:  # one "row" per sequence: sums per (row, segment start)
        index = sequence_index(segment_ids).reshape(-1)
        size = per_token.size
        masked = jax.ops.segment_sum(masked.reshape(-1), index, num_segments=size)[:, None]
        weights = jax.ops.segment_sum(weights.reshape(-1), index, num_segments=size)[:, None]
    tokens_per_seq = jnp.sum(weights, axis=-1)
    has_tokens = tokens_per_seq > 0
    num_seqs = jnp.sum(has_tokens.astype(per_token.dtype))
    seq_sums = jnp.sum(masked, axis=-1)
    if mode == "seq-mean-token-mean":
        seq_means = seq_sums / jnp.where(has_tokens, tokens_per_seq, 1.0)
        return LossSum(jnp.sum(seq_means), num_seqs)
    return LossSum(jnp.sum(seq_sums) / norm_constant, num_seqs)


def sequence_index(segment_ids: jax.Array) -> jax.Array:
    """``[N, L]`` int32: a distinct index in ``[0, N x L)`` per sequence of packed rows, the
    flat position of its first token (a run of equal ``segment_ids`` is one sequence)."""
    n, length = segment_ids.shape
    position = jnp.arange(length, dtype=jnp.int32)
    new = jnp.concatenate(
        [jnp.ones((n, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    start = jax.lax.cummax(jnp.where(new, position, 0), axis=1)
    return jnp.arange(n, dtype=jnp.int32)[:, None] * length + start


def combine(parts: Iterable[LossSum]) -> LossSum:
    """Adds the totals and the denominators of several parts (micro-batches)."""
    parts = list(parts)
    if not parts:
        raise ValueError("combine: no LossSum parts given")
    return LossSum(sum(p.total for p in parts), sum(p.denom for p in parts))


def psum(part: LossSum, axis_name: str) -> LossSum:
    """Sums a :class:`LossSum` over a mapped device axis (inside ``shard_map``/``pmap``)."""
    return LossSum(*jax.lax.psum(tuple(part), axis_name))


def mean(part: LossSum) -> jax.Array:
    """``total / denom``; 0 when ``denom`` is 0 (nothing to average, e.g. all rows padded)."""
    safe = jnp.where(part.denom > 0, part.denom, 1.0)
    return jnp.where(part.denom > 0, part.total / safe, 0.0)
