"""A policy that hands its episodes to another part-way: :class:`SplicedPolicy`.

``SplicedPolicy(first, then, switch_turn=k)`` plays turns ``0 .. k-1`` of every episode with
``first`` and the rest with ``then``, which receives the whole conversation so far (the system
prompt, every earlier prompt and ``first``'s own responses) as its context: the history, not
a summary of the state. It is an ordinary :class:`~agentrl_jax.sampling.Policy`, so the
rollout, the environment and the keys are the ones every other evaluation uses, and:

* with the same rollout key, the first ``k`` turns are those ``first`` plays alone (each
  row's sampling key depends on its row and turn only, the environment's on the rollout key),
  so "A's prefix, B's continuation" and "A alone" start from matched prefixes (exactly for
  scripted policies; for models, up to float-level differences between batch shapes);
* ``k = 0`` is ``then`` alone, ``k >= T`` is ``first`` alone.

Turns are counted per row from what the rollout hands over: a context it starts or restarts a
row from is looked up among the contexts this policy has seen end a turn, so a row replayed
after preemption or seated by continuous batching keeps its count.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from agentrl_jax.sampling import Policy
from agentrl_jax.sampling.policy import PolicySettings, Responses


def _key(context: Sequence[int]) -> bytes:
    return np.asarray(context, np.int32).tobytes()


class SplicedPolicy:
    """``first`` for turns ``< switch_turn``, ``then`` from there on (module docstring)."""

    def __init__(self, first: Policy, then: Policy, switch_turn: int):
        if isinstance(switch_turn, bool) or not isinstance(switch_turn, (int, np.integer)):
            raise ValueError(f"SplicedPolicy: switch_turn must be an int, got {switch_turn!r}")
        if switch_turn < 0:
            raise ValueError(f"SplicedPolicy: switch_turn must be >= 0, got {switch_turn}")
        if getattr(then, "restart", None) is None:
            raise ValueError("SplicedPolicy: `then` must have restart() (it takes over rows)")
        self.first, self.then, self.switch_turn = first, then, int(switch_turn)
        self._turns_at: dict[bytes, int] = {}  # context (int32 bytes) -> turns completed there

    def _seat(self, contexts: Sequence[Sequence[int]], rows: np.ndarray) -> None:
        for r in rows:
            self.contexts[r] = list(contexts[r])
            self.turn[r] = self._turns_at.get(_key(self.contexts[r]), 0)
            self.switched[r] = False

    def start(self, contexts: Sequence[Sequence[int]], settings: PolicySettings) -> None:
        n = len(contexts)
        self.settings = settings
        self.contexts: list[list[int]] = [[] for _ in range(n)]
        self.turn = np.zeros(n, np.int64)
        self.switched = np.zeros(n, bool)
        self._seat(contexts, np.arange(n))
        own = self.turn < self.switch_turn
        self.first.start([c if o else () for c, o in zip(contexts, own)], settings)
        self.then.start([()] * n, settings)

    def restart(self, contexts: Sequence[Sequence[int]], which: np.ndarray) -> None:
        rows = np.flatnonzero(np.asarray(which, bool))
        self._seat(contexts, rows)
        mine = np.zeros(len(self.turn), bool)
        mine[rows] = self.turn[rows] < self.switch_turn
        restart = getattr(self.first, "restart", None)
        if mine.any():
            if restart is None:
                raise ValueError("SplicedPolicy: `first` has no restart(); cannot reseat rows")
            restart([c if m else () for c, m in zip(contexts, mine)], mine)

    def respond(self, live: np.ndarray, max_tokens: np.ndarray, key: jax.Array) -> Responses:
        live = np.asarray(live, bool)
        before = live & (self.turn < self.switch_turn)
        after = live & ~before
        handover = after & ~self.switched
        if handover.any():  # `then` takes these rows over with their whole history
            self.then.restart(
                [self.contexts[r] if h else () for r, h in enumerate(handover)], handover
            )
            self.switched |= handover
        parts = [
            (mask, policy.respond(mask, np.where(mask, max_tokens, 0), key))
            for mask, policy in ((before, self.first), (after, self.then))
            if mask.any()
        ]
        n, width = len(live), self.settings.max_response_tokens
        out = Responses(
            np.zeros((n, width), np.int32),
            np.zeros(n, np.int32),
            np.zeros((n, width), np.float32),
            np.zeros((n, width), np.float32),
            np.zeros(n, bool),
        )
        for mask, part in parts:
            out.tokens[mask] = part.tokens[mask]
            out.lengths[mask] = part.lengths[mask]
            out.logprobs[mask] = part.logprobs[mask]
            out.sampling_logprobs[mask] = part.behaviour_logprobs[mask]
            if part.preempted is not None:
                out.preempted[mask] = part.preempted[mask]
        played = live & ~out.preempted
        for r in np.flatnonzero(played):
            self.contexts[r].extend(out.tokens[r, : out.lengths[r]].tolist())
        self.turn += played
        return dataclasses.replace(out, preempted=out.preempted if out.preempted.any() else None)

    def extend(self, chunks: Sequence[Sequence[int]]) -> None:
        n = len(chunks)
        to_first = [()] * n
        to_then = [()] * n
        for r, chunk in enumerate(chunks):
            if not len(chunk):
                continue
            self.contexts[r].extend(chunk)
            self._turns_at[_key(self.contexts[r])] = int(self.turn[r])
            if self.switched[r]:
                to_then[r] = chunk
            elif self.turn[r] < self.switch_turn:
                to_first[r] = chunk
            # else: handed over at its next turn, with the whole context
        if any(len(c) for c in to_first):
            self.first.extend(to_first)
        if any(len(c) for c in to_then):
            self.then.extend(to_then)
