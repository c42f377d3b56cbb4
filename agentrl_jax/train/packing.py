"""Sequence packing for the train step: several trajectories per row, so an update does not
spend its FLOPs on padding.

A batch's rows are right-padded to one width ``W`` (the longest row's bucket), and multi-turn
episodes vary a lot in length (FrozenLake: one turn to ``T_max``), so most of a padded batch
can be padding. :func:`plan_packing` (host, NumPy) places each trajectory's tokens ``[0, n)``
whole into packed rows of width ``W`` (first fit, longest first) and gives, per packed slot,
the source row and position; :func:`pack` gathers any ``[N, L]`` per-token array into the
packed ``[P, W]`` layout and :func:`unpack` scatters back. In a packed row each trajectory is
a segment of its own (``segment_ids``, 1, 2, ... and 0 on empty slots): attention stays
within it (every implementation, :mod:`agentrl_jax.models.attention`), positions restart at
it (:func:`~agentrl_jax.models.qwen3.packed_positions`), and the sequence modes of loss
aggregation count it as one sequence (:mod:`agentrl_jax.algorithms.aggregation`). Advantages
are computed per trajectory before packing. So losses and gradients equal the unpacked step's
(to float rounding), whatever the micro-batching: the packed row count ``P`` is a multiple of
the step's micro-batch count (and of the mesh's batch shards), rounded up to a power of two
times it so that few shapes compile.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class Packing:
    """Where each packed slot's token comes from, all ``[P, W]``: ``rows`` and ``cols`` (int32,
    the source row and position), ``valid`` (bool, the slot holds a token) and
    ``segment_ids`` (int32, 1, 2, ... per trajectory within the row, 0 on empty slots)."""

    rows: jax.Array
    cols: jax.Array
    valid: jax.Array
    segment_ids: jax.Array

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.rows.shape)


def packed_row_count(needed: int, multiple: int, most: int | None = None) -> int:
    """The packed rows for ``needed`` full ones: ``multiple x 2^k``, the smallest that holds
    them (at most ``most`` rounded up to ``multiple``, e.g. the unpacked row count)."""
    count = multiple
    while count < needed:
        count *= 2
    if most is not None:
        count = min(count, -(-most // multiple) * multiple)
    return max(count, -(-needed // multiple) * multiple)


def plan_packing(
    token_mask: np.ndarray, row_mask: np.ndarray, width: int | None = None, multiple: int = 1
) -> Packing:
    """Pack the real rows of ``token_mask [N, L]`` into rows of ``width`` (default ``L``).

    A row's sequence is its positions ``[0, last real token]`` (what the model reads; padding
    inside it travels along, masked as before); rows with ``row_mask`` 0 or no real token are
    left out (they hold no loss tokens). First fit, longest first; ties keep row order, so the
    plan is a pure function of the masks. Returns NumPy arrays.
    """
    token_mask = np.asarray(token_mask, bool)
    n, length = token_mask.shape
    width = length if width is None else width
    real = np.asarray(row_mask, bool) & token_mask.any(axis=1)
    lengths = np.where(real, length - np.argmax(token_mask[:, ::-1], axis=1), 0)
    if lengths.max(initial=0) > width:
        raise ValueError(f"a row of {lengths.max()} tokens does not fit packed rows of {width}")
    order = sorted((i for i in range(n) if lengths[i] > 0), key=lambda i: (-lengths[i], i))
    fill: list[int] = []
    members: list[list[int]] = []
    for i in order:
        slot = next((b for b, used in enumerate(fill) if used + lengths[i] <= width), None)
        if slot is None:
            fill.append(0)
            members.append([])
            slot = len(fill) - 1
        members[slot].append(i)
        fill[slot] += int(lengths[i])
    count = packed_row_count(max(len(fill), 1), multiple, n)
    rows = np.zeros((count, width), np.int32)
    cols = np.zeros((count, width), np.int32)
    segments = np.zeros((count, width), np.int32)
    for b, row_members in enumerate(members):
        at = 0
        for s, i in enumerate(row_members):
            size = int(lengths[i])
            rows[b, at : at + size] = i
            cols[b, at : at + size] = np.arange(size)
            segments[b, at : at + size] = s + 1
            at += size
    return Packing(rows, cols, segments > 0, segments)


def pack(x: jax.Array, packing: Packing) -> jax.Array:
    """``x [N, L, ...]`` per token -> ``[P, W, ...]`` in the packed layout (zero/False on
    empty slots)."""
    gathered = x[packing.rows, packing.cols]
    valid = packing.valid.reshape(packing.valid.shape + (1,) * (x.ndim - 2))
    return jnp.where(valid, gathered, jnp.zeros((), x.dtype))


def unpack(y: jax.Array, packing: Packing, rows: int, length: int) -> jax.Array:
    """``y [P, W]`` packed -> ``[rows, length]`` (0 where no slot came from)."""
    target = jnp.where(packing.valid, packing.rows, rows)  # empty slots: out of range, dropped
    return jnp.zeros((rows, length), y.dtype).at[target, packing.cols].set(y, mode="drop")


def padding_share(token_mask: np.ndarray, packing: Packing | None = None) -> float:
    """The share of the positions a step computes that hold no token (host; the packed
    layout's when ``packing`` is given)."""
    real = float(np.asarray(token_mask, bool).sum())
    total = np.asarray(token_mask).size if packing is None else np.asarray(packing.valid).size
    return 1.0 - real / max(total, 1)
