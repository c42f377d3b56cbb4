"""The trajectory record: what a multi-turn rollout produces and what training consumes.

A :class:`Trajectory` batch is a pytree of fixed-shape arrays, so it can be jitted over,
sharded along its leading axis and micro-batched without recompiling. Sizes:

* ``N`` rows (trajectories; ``G`` per task group, rows of a group need not be adjacent),
* ``L`` tokens: the whole conversation of a row, prompt + responses + observations, stored
  left-aligned from slot 0 and right-padded (``token_mask`` marks real tokens),
* ``T`` turns: room for the largest budget the rollout may draw (turn ``t`` is 0-based), fixed
  per rollout configuration so that batches of different budgets share one shape.

Token-level fields (``[N, L]``):
  ``tokens``        int32  token ids (padding ids are 0 and meaningless)
  ``token_mask``    bool   real tokens
  ``loss_mask``     bool   tokens the policy itself sampled (the only ones trained on)
  ``token_turn``    int32  turn of each sampled token, -1 on prompt/observation/padding
  ``logprobs``      float32 log-prob of each sampled token under the sampling policy's
                    unmodified distribution (temperature 1, no truncation); 0 elsewhere
  ``sampling_logprobs`` float32 log-prob of each sampled token under the distribution it was
                    drawn from (temperature, top-k/top-p, valid vocabulary: the behaviour
                    policy); 0 elsewhere. Equal to ``logprobs`` at temperature 1 without
                    truncation; records written before it existed get ``logprobs``
                    (:meth:`Trajectory.from_arrays`)
  ``experts``       int16 ``[N, L, M, k]``: an MoE policy's experts for each sampled token in
                    each of its ``M`` MoE layers (the router's top-k when the sampler cached
                    the token), -1 on tokens it did not sample, for routing replay. ``M = k =
                    0`` for a dense policy (and records written before it existed)

Turn-level fields (``[N, T]``):
  ``turn_mask``     bool   turns that happened (a prefix of each row)
  ``action``        int32  parsed action, -1 when the response was invalid
  ``action_valid``  bool
  ``reward``        float32 environment reward of the turn (FrozenLake: 1 on entering the goal)
  ``anchor_key``    int32  key of the state the turn acted from (GiGPO anchors; FrozenLake:
                    the flat cell, with the map identified by ``group_id``)
  ``state_id``      int32  the environment's id of the state the turn acted from, for
                    diagnostics that revisit states (FrozenLake: the flat cell before the
                    move); -1 where the environment gives none
  ``step_quality``  float32 the environment's own score of the turn where it defines one
                    (DeepCoder-MT: the share of unit tests the submitted program passes); NaN
                    elsewhere
  ``context_start`` int32  where the history turn ``t`` was sampled from starts in ``tokens``:
                    the policy saw ``tokens[:prefix_len] + tokens[context_start:]`` up to its
                    response. With the whole history kept it equals ``prefix_len`` (so the
                    context is a prefix of the row); with a window of ``k`` turns it is the start
                    of turn ``t - k``'s user message, and each turn must be re-scored on its own
                    context to reproduce ``logprobs``

Row-level fields (``[N]``):
  ``group_id``      int32  task group (rows of one task and one budget share it)
  ``task_id``       int32  index of the task in its task set (e.g. the map)
  ``budget``        int32  the turn budget B stated in the prompt
  ``turns_used``    int32  turns taken (<= budget)
  ``success``       bool   the verifier's binary outcome R(tau)
  ``overflow``      bool   the row ran out of context and was ended (never silently cut)
  ``row_mask``      bool   real rows (padding rows of a batch are False)
  ``prefix_len``    int32  tokens of the system header every context starts with (the chat
                    template's system message; 0 if the template cannot be split there)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class Trajectory:
    tokens: jax.Array
    token_mask: jax.Array
    loss_mask: jax.Array
    token_turn: jax.Array
    logprobs: jax.Array
    sampling_logprobs: jax.Array
    experts: jax.Array
    turn_mask: jax.Array
    action: jax.Array
    action_valid: jax.Array
    reward: jax.Array
    anchor_key: jax.Array
    state_id: jax.Array
    step_quality: jax.Array
    group_id: jax.Array
    task_id: jax.Array
    budget: jax.Array
    turns_used: jax.Array
    success: jax.Array
    overflow: jax.Array
    row_mask: jax.Array
    prefix_len: jax.Array
    context_start: jax.Array

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def outcome_reward(self) -> jax.Array:
        """``float32[N]``: the binary final reward R(tau) (0 on timeout or failure)."""
        return self.success.astype(jnp.float32)

    @classmethod
    def from_arrays(cls, arrays: Any) -> "Trajectory":
        """A record from a mapping of its fields' arrays (e.g. an ``np.load``-ed ``.npz``).
        A record saved before ``sampling_logprobs`` existed gets ``logprobs`` for it, one saved
        before ``experts`` existed none (``M = k = 0``). Unknown
        or missing fields raise ValueError naming them."""
        data = {k: arrays[k] for k in arrays.keys()} if hasattr(arrays, "keys") else dict(arrays)
        if "sampling_logprobs" not in data and "logprobs" in data:
            data["sampling_logprobs"] = data["logprobs"]
        if "experts" not in data and "tokens" in data:
            data["experts"] = no_experts(np.shape(data["tokens"]))
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown, missing = sorted(set(data) - fields), sorted(fields - set(data))
        if unknown or missing:
            raise ValueError(f"Trajectory: unknown fields {unknown}, missing fields {missing}")
        return cls(**data)

    def turns_only(self) -> "Trajectory":
        """This record without its tokens: every ``[N, L]`` field cut to width 0. A step scorer
        that reads turns only places this on a device, not the whole conversation."""
        return self.replace(**{f: getattr(self, f)[:, :0] for f in TOKEN_FIELDS})

    @classmethod
    def zeros(
        cls, num_rows: int, num_tokens: int, num_turns: int, routing: tuple[int, int] = (0, 0)
    ) -> "Trajectory":
        """An all-padding record of the given sizes (a template for tests and buffers);
        ``routing``: ``(M, k)``, an MoE policy's MoE layers and experts per token."""
        i32, f32, b = jnp.int32, jnp.float32, bool
        tok = lambda dt: jnp.zeros((num_rows, num_tokens), dt)  # noqa: E731
        turn = lambda dt: jnp.zeros((num_rows, num_turns), dt)  # noqa: E731
        row = lambda dt: jnp.zeros((num_rows,), dt)  # noqa: E731
        return cls(
            tokens=tok(i32),
            token_mask=tok(b),
            loss_mask=tok(b),
            token_turn=jnp.full((num_rows, num_tokens), -1, i32),
            logprobs=tok(f32),
            sampling_logprobs=tok(f32),
            experts=jnp.full((num_rows, num_tokens, *routing), -1, jnp.int16),
            turn_mask=turn(b),
            action=jnp.full((num_rows, num_turns), -1, i32),
            action_valid=turn(b),
            reward=turn(f32),
            anchor_key=turn(i32),
            state_id=jnp.full((num_rows, num_turns), -1, i32),
            step_quality=jnp.full((num_rows, num_turns), jnp.nan, f32),
            group_id=row(i32),
            task_id=row(i32),
            budget=row(i32),
            turns_used=row(i32),
            success=row(b),
            overflow=row(b),
            row_mask=row(b),
            prefix_len=row(i32),
            context_start=turn(i32),
        )


# the [N, L] fields, and what a padded token slot holds in each
TOKEN_FIELDS = (
    "tokens",
    "token_mask",
    "loss_mask",
    "token_turn",
    "logprobs",
    "sampling_logprobs",
    "experts",
)
TOKEN_PADDING = {"token_turn": -1, "experts": -1}  # the others: 0 / False


def no_experts(shape: tuple[int, ...]) -> np.ndarray:
    """``Trajectory.experts`` of a dense policy's record of ``[N, L]`` tokens: ``[N, L, 0, 0]``."""
    return np.zeros((*shape[:2], 0, 0), np.int16)


def bucket_width(used: int, limit: int, smallest: int = 64) -> int:
    """Columns a program needs for rows of at most ``used`` tokens: the smallest
    ``smallest x 2^k >= used``, at most ``limit`` (the record's width). Conversations are usually
    far shorter than the context they may use, and a forward's cost grows with the width
    (attention with its square); a handful of widths means a handful of compilations."""
    width = smallest
    while width < used:
        width *= 2
    return min(width, limit)


def row_lengths(token_mask) -> np.ndarray:
    """``[N]`` int: each row's width up to and including its last real token (0 for none)."""
    mask = np.asarray(token_mask, bool)
    last = mask.shape[1] - np.argmax(mask[:, ::-1], axis=1)
    return np.where(mask.any(axis=1), last, 0)


def concatenate_rows(records: "list[Trajectory]") -> "Trajectory":
    """The rows of ``records`` one after another, as host (numpy) arrays: ``[sum N_i, ...]``.

    Records may differ in width ``L`` (e.g. cut to their longest row): the narrower ones are
    right-padded to the widest (padded slots are not real tokens). Turn counts ``T`` must
    agree (a ValueError names the field otherwise).
    """
    if not records:
        raise ValueError("concatenate_rows: needs at least one record")
    records = [jax.device_get(r) for r in records]
    width = max(r.tokens.shape[1] for r in records)
    out = {}
    for f in dataclasses.fields(Trajectory):
        parts = [np.asarray(getattr(r, f.name)) for r in records]
        if f.name in TOKEN_FIELDS:
            parts = [
                np.pad(
                    x,
                    ((0, 0), (0, width - x.shape[1])) + ((0, 0),) * (x.ndim - 2),
                    constant_values=TOKEN_PADDING.get(f.name, 0),
                )
                for x in parts
            ]
        elif len({x.shape[1:] for x in parts}) > 1:
            raise ValueError(
                f"concatenate_rows: Trajectory.{f.name} shapes differ past the rows: "
                f"{sorted({x.shape for x in parts})}"
            )
        out[f.name] = np.concatenate(parts, axis=0)
    return Trajectory(**out)


# ---------------------------------------------------------------- per-turn scores


@struct.dataclass
class StepScores:
    """Per-turn scores of a batch: ``scores [N, T]`` float32 (0 off ``mask``), ``mask [N, T]``
    bool (the real turns of real rows that were scored), ``invalid [N, T]`` bool (scored
    turns that got the scorer's ``invalid_score``)."""

    scores: jax.Array
    mask: jax.Array
    invalid: jax.Array


class StepScorer(Protocol):
    def __call__(self, trajectory: Trajectory, tasks: Any = None) -> StepScores: ...


def scored_turns(trajectory: Trajectory) -> jax.Array:
    """``[N, T]`` bool: turns that happened, in real rows."""
    return trajectory.turn_mask.astype(bool) & trajectory.row_mask.astype(bool)[:, None]
