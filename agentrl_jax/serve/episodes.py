"""What the server records of each episode, and an episode as a training row.

Every completion the server returns is a :class:`Turn`: the exact prompt token ids, the
sampled completion's ids with their log-probs (under the model, and under the distribution
they were drawn from), an MoE policy's experts, the parameters' version, and which earlier
turn its prompt continues (``parent``; :mod:`agentrl_jax.serve.chat`). :class:`EpisodeStore`
keeps them per episode id, bounded.

:func:`episode_row` lays an episode out as one row of a :class:`~agentrl_jax.trajectory.
Trajectory`:

* turns that form one chain (each continues the one before: the client kept its history) are
  one conversation: ``prompt_0 completion_0 observation_1 completion_1 ...``, where an
  observation is the tokens between a completion and the next one, exactly as the next prompt
  holds them; every turn sees the row before it (``context_start = prefix_len = 0``);
* any other episode (a client that dropped or rewrote earlier turns, ``n > 1`` choices) is
  its turns one after another, each ``prompt completion`` with ``context_start`` at its own
  prompt: the trainer scores each turn under its own context (step-wise,
  :func:`~agentrl_jax.train.batch.check_step_wise`).

Only sampled tokens are trained on (``loss_mask``); turns that do not fit the row's width or
turn count are left out and the row is marked ``overflow``.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Sequence

import numpy as np

from agentrl_jax.models.moe import EXPERT_ID_DTYPE


@dataclasses.dataclass(frozen=True)
class Turn:
    """One recorded completion (one choice of one request). Token ids are the tokenizer's."""

    parent: int | None  # the turn whose prompt and completion this prompt continues
    messages: tuple[str, ...]  # the request's messages, canonical (chat.message_key)
    tools: str  # the request's tools, canonical
    reply: str  # the reply as returned, canonical (chat.reply_key)
    prompt_ids: np.ndarray  # int32
    completion_ids: np.ndarray  # int32
    logprobs: np.ndarray  # float32, under the model (temperature 1, untruncated)
    sampling_logprobs: np.ndarray  # float32, under the distribution each token was drawn from
    finish_reason: str
    weight_version: int
    closed: bool  # the completion ends with a stop token
    experts: np.ndarray | None = None  # [completion, M, k] int16 (MoE policies)

    def as_json(self) -> dict:
        return {
            "parent": self.parent,
            "prompt_token_ids": self.prompt_ids.tolist(),
            "completion_token_ids": self.completion_ids.tolist(),
            "logprobs": self.logprobs.tolist(),
            "sampling_logprobs": self.sampling_logprobs.tolist(),
            "finish_reason": self.finish_reason,
            "weight_version": self.weight_version,
        }


class EpisodeStore:
    """Turns per episode id (thread-safe), at most ``max_episodes`` episodes of at most
    ``max_turns`` turns each, ``max_tokens`` prompt and completion tokens in all (the memory a
    client naming episodes at will can take): the oldest episode is forgotten first
    (``forgotten_episodes``), a turn past an episode's limit is not recorded
    (``dropped_turns``). Token ids are kept as int32 arrays."""

    def __init__(
        self, max_episodes: int = 10_000, max_turns: int = 256, max_tokens: int = 50_000_000
    ):
        self.max_episodes, self.max_turns, self.max_tokens = max_episodes, max_turns, max_tokens
        self._episodes: collections.OrderedDict[str, list[Turn]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.tokens = 0
        self.dropped_turns = 0
        self.forgotten_episodes = 0

    @staticmethod
    def _size(turns: Sequence[Turn]) -> int:
        return sum(len(t.prompt_ids) + len(t.completion_ids) for t in turns)

    def turns(self, episode: str) -> list[Turn]:
        with self._lock:
            return list(self._episodes.get(episode, ()))

    def add(self, episode: str, turn: Turn) -> int | None:
        """Record ``turn``; its index in the episode (None: over the limit, not recorded)."""
        with self._lock:
            turns = self._episodes.get(episode)
            if turns is not None and len(turns) >= self.max_turns:
                self.dropped_turns += 1
                return None
            size = self._size([turn])
            while self._episodes and (
                self.tokens + size > self.max_tokens
                or (turns is None and len(self._episodes) >= self.max_episodes)
            ):
                name, forgotten = self._episodes.popitem(last=False)
                self.tokens -= self._size(forgotten)
                self.forgotten_episodes += 1
                if name == episode:
                    turns = None
            if turns is None:
                turns = self._episodes[episode] = []
            turns.append(turn)
            self.tokens += size
            return len(turns) - 1

    def pop(self, episode: str) -> list[Turn]:
        with self._lock:
            turns = self._episodes.pop(episode, [])
            self.tokens -= self._size(turns)
            return turns

    def __len__(self) -> int:
        return len(self._episodes)


def is_chain(turns: Sequence[Turn]) -> bool:
    """Whether each turn continues the one before it (one conversation)."""
    return (
        bool(turns)
        and all(t.parent == i - 1 for i, t in enumerate(turns) if i)
        and (turns[0].parent is None)
    )


@dataclasses.dataclass
class Row:
    """One episode's row of a Trajectory (host arrays; see :func:`episode_row`)."""

    tokens: np.ndarray  # [L] int32
    loss_mask: np.ndarray  # [L] bool
    token_turn: np.ndarray  # [L] int32
    logprobs: np.ndarray  # [L] float32
    sampling_logprobs: np.ndarray  # [L] float32
    experts: np.ndarray  # [L, M, k] int16
    length: int
    turns: int
    context_start: np.ndarray  # [T] int32
    overflow: bool


def episode_row(
    turns: Sequence[Turn], length: int, max_turns: int, routing: tuple[int, int] = (0, 0)
) -> Row:
    """``turns`` (one episode's, not aborted) as one row of ``length`` tokens and at most
    ``max_turns`` turns (module docstring); ``routing``: an MoE policy's ``(M, k)``."""
    turns = [t for t in turns if t.finish_reason != "abort"]
    row = Row(
        tokens=np.zeros(length, np.int32),
        loss_mask=np.zeros(length, bool),
        token_turn=np.full(length, -1, np.int32),
        logprobs=np.zeros(length, np.float32),
        sampling_logprobs=np.zeros(length, np.float32),
        experts=np.full((length, *routing), -1, EXPERT_ID_DTYPE),
        length=0,
        turns=0,
        context_start=np.zeros(max_turns, np.int32),
        overflow=False,
    )
    chain = is_chain(turns)
    for index, turn in enumerate(turns):
        if chain and index:  # the observation: the new part of this prompt
            before = turns[index - 1]
            seen = len(before.prompt_ids) + len(before.completion_ids)
            context, start = turn.prompt_ids[seen:], 0
        else:
            context, start = turn.prompt_ids, row.length
        need = len(context) + len(turn.completion_ids)
        if row.turns >= max_turns or row.length + need > length:
            row.overflow = True
            break
        at = row.length
        row.tokens[at : at + len(context)] = context
        at += len(context)
        end = at + len(turn.completion_ids)
        row.tokens[at:end] = turn.completion_ids
        row.loss_mask[at:end] = True
        row.token_turn[at:end] = row.turns
        row.logprobs[at:end] = turn.logprobs
        row.sampling_logprobs[at:end] = turn.sampling_logprobs
        if turn.experts is not None and routing != (0, 0):
            row.experts[at:end] = turn.experts
        row.context_start[row.turns] = start
        row.length, row.turns = end, row.turns + 1
    return row
