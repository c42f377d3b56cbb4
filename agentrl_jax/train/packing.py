"""Sequence packing for the train step: several trajectories per row, so an update does not
spend its FLOPs on padding.

A batch's rows are right-padded to one width ``W`` (the longest row's bucket), and multi-turn
episodes vary a lot in length (FrozenLake: one turn to ``T_max``), so most of a padded batch
can be padding. :func:`plan_packing` (host, NumPy) places sequences whole into packed rows of
width ``W`` (first fit, longest first) and gives, per packed slot, the source row and
position. A sequence is a trajectory's tokens ``[0, n)`` (:func:`row_sequences`), or, for a
rollout that showed the policy a window of its history, each turn's own context
(:func:`turn_sequences`: step-wise training, every turn scored under what it saw).
:func:`pack` gathers any ``[N, L]`` per-token array into the packed ``[P, W]`` layout and
:func:`unpack` scatters back. In a packed row each sequence is a segment of its own
(``segment_ids``, 1, 2, ... and 0 on empty slots): attention stays within it (every
implementation, :mod:`agentrl_jax.models.attention`), positions restart at it
(:func:`~agentrl_jax.models.qwen3.packed_positions`), and the sequence modes of loss
aggregation count it as one sequence (:mod:`agentrl_jax.algorithms.aggregation`). Advantages
are computed per trajectory before packing. So with whole rows the losses and gradients equal
the unpacked step's (to float rounding), whatever the micro-batching: the packed row count
``P`` is a multiple of the step's micro-batch count (and of the mesh's batch shards), rounded
up to an eighth of the unpacked row count so that few shapes compile
(:func:`packed_row_count`). Step-wise sequences train each response token once, in its own
turn's sequence (``trains``); a sequence mode of aggregation would count turns, not
trajectories, so the trainer takes step-wise batches with ``token-mean`` only.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class Packing:
    """Where each packed slot's token comes from, all ``[P, W]``: ``rows`` and ``cols`` (int32,
    the source row and position), ``valid`` (bool, the slot holds a token), ``segment_ids``
    (int32, 1, 2, ... per sequence within the row, 0 on empty slots) and ``trains`` (bool,
    the slot's token may be a loss token of its sequence: a windowed turn's sequence repeats
    earlier responses as context, trained in their own turn's sequence only)."""

    rows: jax.Array
    cols: jax.Array
    valid: jax.Array
    segment_ids: jax.Array
    trains: jax.Array

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.rows.shape)


def packed_row_count(needed: int, multiple: int, most: int) -> int:
    """The packed rows for ``needed`` full ones: rounded up to a multiple of ``multiple``
    (the micro-batches x batch shards) and to an eighth of ``most`` (the unpacked row count),
    so a run compiles the step for at most 8 row counts per width."""
    step = multiple * max(1, -(-most // (8 * multiple)))
    return -(-max(needed, 1) // step) * step


Sequence = tuple[int, np.ndarray, np.ndarray]  # (source row, its positions, trained flags)


def row_sequences(token_mask: np.ndarray, row_mask: np.ndarray) -> list[Sequence]:
    """Each real row's positions ``[0, last real token]`` as one sequence (padding inside it
    travels along, masked as before), every position trainable; rows with ``row_mask`` 0 or
    no real token are left out (they hold no loss tokens)."""
    token_mask = np.asarray(token_mask, bool)
    length = token_mask.shape[1]
    real = np.asarray(row_mask, bool) & token_mask.any(axis=1)
    ends = length - np.argmax(token_mask[:, ::-1], axis=1)
    return [(i, np.arange(ends[i]), np.ones(ends[i], bool)) for i in np.flatnonzero(real)]


def turn_sequences(trajectory: Any) -> list[Sequence]:
    """Each real row's sequences as the policy saw them: the turns sampled with the whole
    history as one sequence ``[0, end of the last such turn's response]``, then one per turn
    sampled from a history window (``context_start != prefix_len``): the system header
    ``[0, prefix_len)`` and the window ``[context_start, end of the turn's response]``, only
    that turn's response trainable in it (:class:`~agentrl_jax.trajectory.Trajectory`)."""
    t = jax.tree.map(np.asarray, trajectory)
    out: list[Sequence] = []
    for i in np.flatnonzero(t.row_mask.astype(bool) & t.token_mask.any(axis=1)):
        prefix = int(t.prefix_len[i])
        response = t.loss_mask[i].astype(bool)
        whole_end, windowed = None, []
        for turn in np.flatnonzero(t.turn_mask[i]):
            positions = np.flatnonzero(response & (t.token_turn[i] == turn))
            if not len(positions):
                continue
            end = int(positions[-1]) + 1
            if int(t.context_start[i, turn]) == prefix:
                whole_end = end
            else:
                windowed.append((int(t.context_start[i, turn]), end, turn))
        if whole_end is not None:
            out.append((i, np.arange(whole_end), np.ones(whole_end, bool)))
        for start, end, turn in windowed:
            cols = np.concatenate([np.arange(prefix), np.arange(start, end)])
            out.append((i, cols, t.token_turn[i, cols] == turn))
    return out


def packed_loss_bound(bound: int | None, rows: int, packed_rows: int, width: int) -> int | None:
    """The loss positions per packed row at which the step runs the output head: a packed row
    stands for ``rows / packed_rows`` rows of ``bound`` each (at most ``width - 1``), so the
    head runs at as many positions in all as unpacked (None: every position)."""
    if bound is None:
        return None
    return min(width - 1, bound * -(-rows // packed_rows))


def plan_packing(
    sequences: list[Sequence],
    rows: int,
    width: int,
    multiple: int = 1,
    *,
    loss_mask: np.ndarray | None = None,
    loss_bound: int | None = None,
) -> Packing:
    """Pack ``sequences`` (:func:`row_sequences`, :func:`turn_sequences`) of a batch of
    ``rows`` rows into rows of ``width``: first fit, longest first (ties keep their order, so
    the plan is a pure function of its input). With ``loss_bound`` (the step's loss positions
    per unpacked row) and the batch's ``loss_mask``, a packed row also holds at most
    :func:`packed_loss_bound` loss tokens, so the step's output head runs at no more positions
    than unpacked. Returns NumPy arrays."""
    longest = max((len(cols) for _, cols, _ in sequences), default=0)
    if longest > width:
        raise ValueError(f"a sequence of {longest} tokens does not fit packed rows of {width}")
    order = sorted(range(len(sequences)), key=lambda k: (-len(sequences[k][1]), k))
    losses = [0] * len(sequences)
    if loss_bound is not None and loss_mask is not None:
        mask = np.asarray(loss_mask, bool)
        losses = [int((mask[row, cols] & trains).sum()) for row, cols, trains in sequences]
    count = packed_row_count(len(_first_fit(sequences, order, losses, width, None)), multiple, rows)
    while True:  # a loss cap per row may need more rows, which lowers the cap: to a fixed point
        cap = packed_loss_bound(loss_bound, rows, count, width)
        members = _first_fit(sequences, order, losses, width, cap)
        if len(members) <= count:
            break
        count = packed_row_count(len(members), multiple, rows)
    source = np.zeros((count, width), np.int32)
    cols = np.zeros((count, width), np.int32)
    segments = np.zeros((count, width), np.int32)
    trains = np.zeros((count, width), bool)
    for b, row_members in enumerate(members):
        at = 0
        for s, k in enumerate(row_members):
            row, positions, trained = sequences[k]
            size = len(positions)
            source[b, at : at + size] = row
            cols[b, at : at + size] = positions
            segments[b, at : at + size] = s + 1
            trains[b, at : at + size] = trained
            at += size
    return Packing(source, cols, segments > 0, segments, trains)


def _first_fit(
    sequences: list[Sequence], order: list[int], losses: list[int], width: int, cap: int | None
) -> list[list[int]]:
    """Sequence indices per packed row: each, in ``order``, into the first row with room for
    its tokens (and, with ``cap``, its loss tokens)."""
    fill: list[tuple[int, int]] = []
    members: list[list[int]] = []
    for k in order:
        size, loss = len(sequences[k][1]), losses[k]
        slot = next(
            (
                b
                for b, (used, used_loss) in enumerate(fill)
                if used + size <= width and (cap is None or used_loss + loss <= cap)
            ),
            None,
        )
        if slot is None:
            fill.append((0, 0))
            members.append([])
            slot = len(fill) - 1
        members[slot].append(k)
        fill[slot] = (fill[slot][0] + size, fill[slot][1] + loss)
    return members


def pack(x: jax.Array, packing: Packing) -> jax.Array:
    """``x [N, L, ...]`` per token -> ``[P, W, ...]`` in the packed layout (zero/False on
    empty slots)."""
    gathered = x[packing.rows, packing.cols]
    valid = packing.valid.reshape(packing.valid.shape + (1,) * (x.ndim - 2))
    return jnp.where(valid, gathered, jnp.zeros((), x.dtype))


def unpack(y: jax.Array, packing: Packing, rows: int, length: int) -> jax.Array:
    """``y [P, W]`` packed -> ``[rows, length]`` (0 where no slot came from; of several slots
    of one token, a trained one's)."""
    target = jnp.where(packing.valid & packing.trains, packing.rows, rows)  # else dropped
    return jnp.zeros((rows, length), y.dtype).at[target, packing.cols].set(y, mode="drop")
