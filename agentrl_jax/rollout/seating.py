"""Seating rows in a policy's cache: the parts a large batch is played in, the seats of each
lane, every row's key per turn, and a lane's seats (:class:`Seats`: which row sits where,
seating new rows, vacating ended ones)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax.sampling import Policy, PolicySettings, Responses


def row_parts(groups: int, group_size: int, max_rows: int | None) -> list[np.ndarray]:
    """The rows (global indices) of each policy call: whole task groups, contiguous, in as
    even parts as possible of at most ``max_rows`` rows each (None: one part, every row)."""
    rows = np.arange(groups * group_size)
    if max_rows is None or groups * group_size <= max_rows:
        return [rows]
    count = -(-groups // (max_rows // group_size))
    return [
        rows[g[0] * group_size : (g[-1] + 1) * group_size]
        for g in np.array_split(np.arange(groups), count)
    ]


def lane_seats(seats: int, group_size: int, lanes: int) -> list[int]:
    """The seats of each of ``lanes`` lanes (``lanes <= seats``), as even as they can be: in
    whole task groups when there are at least as many groups as lanes (so a group seated at
    once shares one prefill of its prompt), else seat by seat."""
    groups = seats // group_size
    if seats % group_size == 0 and groups >= lanes:
        return [len(share) * group_size for share in np.array_split(np.arange(groups), lanes)]
    return [len(share) for share in np.array_split(np.arange(seats), lanes)]


@jax.jit
def row_keys(key: jax.Array, turn: Any, rows: Any) -> jax.Array:
    """The sampling keys of ``rows`` (global row indices ``int[R]``) at ``turn`` (one turn, or
    each row's own ``int[R]``): ``fold_in(fold_in(key, turn), row)``, a function of the row
    and its turn only, not of the part or the seat."""
    turns = jnp.broadcast_to(jnp.asarray(turn, jnp.int32), jnp.shape(rows))
    return jax.vmap(lambda t, row: jax.random.fold_in(jax.random.fold_in(key, t), row))(
        turns, jnp.asarray(rows, jnp.int32)
    )


class Seats:
    """The policy's rows ("seats") and the rollout rows sitting in them: the policy is called
    with its seats only; responses come back as the rollout's ``n`` rows (empty for rows not
    seated). A row keeps its seat from its first prompt to its last turn."""

    def __init__(self, policy: Policy, seats: int, n: int, settings: PolicySettings):
        self.policy, self.n, self.settings = policy, n, settings
        self.row = np.full(seats, -1, np.int64)  # the row in each seat, -1: empty

    def seat(self, rows: np.ndarray, contexts: Callable[[int], Sequence[int]], fresh: bool) -> None:
        """Seat ``rows`` in empty seats and prefill their ``contexts(row)`` (each row's context
        so far): a fresh ``start`` of every seat (``fresh``, or a policy without ``restart``:
        the rows already seated start again from theirs), else ``restart`` of the new seats
        only."""
        empty = np.flatnonzero(self.row < 0)[: len(rows)]
        self.row[empty] = rows
        restart = getattr(self.policy, "restart", None)
        if fresh or restart is None:
            self.policy.start([() if r < 0 else contexts(r) for r in self.row], self.settings)
        else:
            which = np.zeros(len(self.row), bool)
            which[empty] = True
            restart([contexts(r) if w else () for r, w in zip(self.row, which)], which)

    def restart(self, rows: np.ndarray, contexts: Callable[[int], Sequence[int]]) -> bool:
        """Prefill seated ``rows`` afresh from ``contexts(row)`` (a sliding history window).
        A policy without ``restart`` gets a ``start`` of every seat instead (``contexts`` must
        then give every seated row's whole context); returns whether that happened."""
        restart = getattr(self.policy, "restart", None)
        if restart is None:
            self.policy.start([contexts(r) if r >= 0 else () for r in self.row], self.settings)
            return True
        which = np.isin(self.row, rows) & (self.row >= 0)
        restart([contexts(r) if w else () for r, w in zip(self.row, which)], which)
        return False

    def vacate(self, rows: np.ndarray) -> None:
        self.row[np.isin(self.row, rows)] = -1

    def holds(self) -> np.ndarray:
        """``bool[n]``: the rows seated here."""
        seated = np.zeros(self.n, bool)
        seated[self.row[self.row >= 0]] = True
        return seated

    def extend(self, chunks: Sequence[Sequence[int]]) -> None:
        self.policy.extend([chunks[r] if r >= 0 else () for r in self.row])

    def respond(self, live: np.ndarray, max_tokens: np.ndarray, keys: jax.Array) -> Responses:
        """``live``, ``max_tokens``: ``[n]``; ``keys``: one per seat."""
        seated = self.row >= 0
        row = np.where(seated, self.row, 0)
        out = self.policy.respond(seated & live[row], np.where(seated, max_tokens[row], 0), keys)
        full = Responses(
            np.zeros((self.n,) + out.tokens.shape[1:], out.tokens.dtype),
            np.zeros(self.n, out.lengths.dtype),
            np.zeros((self.n,) + out.logprobs.shape[1:], out.logprobs.dtype),
            np.zeros((self.n,) + out.logprobs.shape[1:], out.logprobs.dtype),
            experts=None
            if out.experts is None
            else np.full((self.n,) + out.experts.shape[1:], -1, out.experts.dtype),
        )
        rows = self.row[seated]
        full.tokens[rows], full.lengths[rows] = out.tokens[seated], out.lengths[seated]
        full.logprobs[rows] = out.logprobs[seated]
        full.sampling_logprobs[rows] = out.behaviour_logprobs[seated]
        if out.experts is not None:
            full.experts[rows] = out.experts[seated]
        if out.preempted is None:
            return full
        preempted = np.zeros(self.n, bool)
        preempted[rows] = np.asarray(out.preempted, bool)[seated]
        return dataclasses.replace(full, preempted=preempted)
