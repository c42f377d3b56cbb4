"""The rollout's record: every row's conversation as tokens and its turns as they are played
(:class:`Record`), the play's running state (:class:`Play`), and the rows other processes
played (:func:`gather_rows`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from agentrl_jax import distributed
from agentrl_jax.sampling import Responses


def host_array(x: Any) -> np.ndarray:
    """``x`` as a NumPy array in the dtype jax would give it (int64 as int32 without x64)."""
    x = np.asarray(x)
    return x.astype(jax.dtypes.canonicalize_dtype(x.dtype), copy=False)


@dataclasses.dataclass
class Play:
    """What the parts of one rollout share: the record and the per-row outcome so far."""

    rec: "Record"
    budget: np.ndarray
    context_len: np.ndarray
    overflow: np.ndarray
    success: np.ndarray
    turns_used: np.ndarray
    texts: list[list[str]]
    shown: np.ndarray | None = None  # the budget each row is shown (prompts.HIDDEN: none)
    live_rows: list[int] = dataclasses.field(default_factory=list)  # per turn, over all parts
    sampled: int = 0

    def count_live(self, turns: np.ndarray) -> None:
        """Count rows sampling at their turns ``turns`` (one entry per live row)."""
        counts = np.bincount(turns, minlength=len(self.live_rows))
        self.live_rows.extend([0] * (len(counts) - len(self.live_rows)))
        for turn in np.flatnonzero(counts):
            self.live_rows[turn] += int(counts[turn])


def gather_rows(play: Play, shares: list[np.ndarray], device: Any = None) -> None:
    """Fill ``play`` with the rows the other processes played (``shares[p]``: process ``p``'s
    rows), so every process holds the whole rollout; live-row and token counts add up.
    ``device``: this process's device the gather runs on, with each other process's at the
    same position (:func:`~agentrl_jax.distributed.allgather_blobs`; None: every device)."""
    rec, own = play.rec, shares[jax.process_index()]
    recorded = {name: value for name, value in vars(rec).items() if value is not None}
    arrays = {f"rec.{name}": value[own] for name, value in recorded.items()}
    arrays.update(
        success=play.success[own],
        turns_used=play.turns_used[own],
        overflow=play.overflow[own],
        live_rows=np.asarray(play.live_rows, np.int64),
        sampled=np.asarray([play.sampled], np.int64),
    )
    live_rows = np.zeros(0, np.int64)
    play.sampled = 0
    gathered = distributed.allgather_blobs(arrays, [play.texts[r] for r in own], device)
    for rows, (theirs, texts) in zip(shares, gathered):
        if "rec.experts" in theirs and rec.experts is None:  # only the others' rows sampled
            part = theirs["rec.experts"]
            rec.experts = np.full(rec.tokens.shape + part.shape[2:], -1, part.dtype)
            recorded["experts"] = rec.experts
        for name, value in recorded.items():
            if f"rec.{name}" in theirs:
                value[rows] = theirs[f"rec.{name}"]
        for name in ("success", "turns_used", "overflow"):
            getattr(play, name)[rows] = theirs[name]
        for row, text in zip(rows, texts):
            play.texts[row] = list(text)
        counts = theirs["live_rows"]
        live_rows = np.pad(live_rows, (0, max(0, len(counts) - len(live_rows))))
        live_rows[: len(counts)] += counts
        play.sampled += int(theirs["sampled"][0])
    play.live_rows = live_rows.tolist()


class Record:
    """Host buffers of the Trajectory under construction, with a write position per row."""

    def __init__(self, rows: int, length: int, turns: int):
        self.tokens = np.zeros((rows, length), np.int32)
        self.loss_mask = np.zeros((rows, length), bool)
        self.token_turn = np.full((rows, length), -1, np.int32)
        self.logprobs = np.zeros((rows, length), np.float32)
        self.sampling_logprobs = np.zeros((rows, length), np.float32)
        self.length = np.zeros(rows, np.int64)
        self.turn_mask = np.zeros((rows, turns), bool)
        self.action = np.full((rows, turns), -1, np.int32)
        self.action_valid = np.zeros((rows, turns), bool)
        self.reward = np.zeros((rows, turns), np.float32)
        self.anchor_key = np.zeros((rows, turns), np.int32)
        self.state_id = np.full((rows, turns), -1, np.int32)  # -1: no turn, or no id
        self.step_quality = np.full((rows, turns), np.nan, np.float32)
        self.context_start = np.zeros((rows, turns), np.int32)
        # where turn t's user message starts (the next-prompt form, separator included)
        self.turn_start = np.zeros((rows, turns + 1), np.int64)
        self.prefix_len = np.zeros(rows, np.int32)
        # an MoE policy's experts per token [rows, length, M, k] (-1: not sampled), from its
        # first responses that carry them (routing replay); None until then
        self.experts: np.ndarray | None = None

    def write(self, row: int, ids: Sequence[int]) -> None:
        start = self.length[row]
        self.tokens[row, start : start + len(ids)] = ids
        self.length[row] += len(ids)

    def write_responses(self, out: Responses, turn: np.ndarray) -> None:
        """Every row's response (empty for rows that did not sample) at its write position;
        ``turn [rows]``: each row's turn."""
        width = out.tokens.shape[1]
        rows, offsets = np.nonzero(np.arange(width)[None, :] < out.lengths[:, None])
        slots = self.length[rows] + offsets
        self.tokens[rows, slots] = out.tokens[rows, offsets]
        self.loss_mask[rows, slots] = True
        self.token_turn[rows, slots] = turn[rows]
        self.logprobs[rows, slots] = out.logprobs[rows, offsets]
        self.sampling_logprobs[rows, slots] = out.behaviour_logprobs[rows, offsets]
        if out.experts is not None:
            if self.experts is None:
                shape = self.tokens.shape + out.experts.shape[2:]
                self.experts = np.full(shape, -1, out.experts.dtype)
            self.experts[rows, slots] = out.experts[rows, offsets]
        self.length += out.lengths

    def context(self, row: int, turn: int, window: int) -> list[int]:
        """The tokens row ``row`` sees at ``turn`` with a window: header + kept turns."""
        start = self.turn_start[row, max(0, turn - window)]
        return (
            self.tokens[row, : self.prefix_len[row]].tolist()
            + self.tokens[row, start : self.length[row]].tolist()
        )
