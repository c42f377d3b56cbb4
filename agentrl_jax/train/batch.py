"""The batch one train step takes: a rollout's trajectories and, optionally, their process
scores; and the checks the loop runs on it before it is placed on device.

Context: every sampled token is scored under the context the policy saw: the row before it
when the rollout kept the whole history, else its turn's window (:func:`windowed_turns`,
trained step-wise; :func:`check_step_wise` says when a config cannot).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import struct

from agentrl_jax.train.config import step_wise_problem
from agentrl_jax.train.packing import Packing
from agentrl_jax.trajectory import Trajectory


@struct.dataclass
class TrainBatch:
    """One rollout batch and, optionally, its process scores ``[N, T]`` (0 off real turns) and
    its packing (:class:`~agentrl_jax.train.packing.Packing`: the step runs the model on rows
    holding several trajectories; None: one trajectory per row)."""

    trajectory: Trajectory
    step_scores: jax.Array | None = None
    packing: Packing | None = None


def batch_loss_mask(trajectory: Trajectory) -> jax.Array:
    """Sampled tokens of real rows: the tokens the loss is taken over, ``[N, L]`` bool."""
    return trajectory.loss_mask.astype(bool) & trajectory.row_mask.astype(bool)[:, None]


def windowed_turns(trajectory: Trajectory) -> np.ndarray:
    """``[N, T]`` bool (host): real turns sampled from a history window
    (``context_start != prefix_len``), which the step trains under their own context."""
    real = np.asarray(trajectory.turn_mask, bool) & np.asarray(trajectory.row_mask, bool)[:, None]
    return real & (
        np.asarray(trajectory.context_start) != np.asarray(trajectory.prefix_len)[:, None]
    )


def check_step_wise(trajectory: Trajectory, config: Any) -> None:
    """Raises ValueError if ``trajectory`` has turns sampled from a history window that
    ``config`` (a :class:`~agentrl_jax.train.config.TrainConfig`) cannot train step-wise
    (host-side; the loop runs it on every batch).

    Such turns are trained each under its own context (:func:`~agentrl_jax.train.packing.
    turn_sequences`): the algorithm must allow it
    (:func:`~agentrl_jax.train.config.step_wise_problem`).
    """
    windowed = windowed_turns(trajectory)
    if not windowed.any():
        return
    problem = step_wise_problem(config.algorithm)
    if problem is not None:
        row, turn = (int(i[0]) for i in np.nonzero(windowed))
        raise ValueError(
            f"Trajectory.context_start: {int(windowed.sum())} turns were sampled from a "
            f"windowed history (first: row {row}, turn {turn}); the step trains each of them "
            f"under its own context, which it cannot with {problem}"
        )


@dataclasses.dataclass
class Produced:
    """One rollout batch ready for its update: the :class:`TrainBatch`, what the loop logs of
    its rollout (``metrics``: R_multi, ..., ``time/rollout_s``, ``time/score_s``), the key
    and data position after its draws, and ``version``: how many updates the parameters that
    sampled it had made."""

    batch: TrainBatch
    metrics: dict[str, float]
    rng: Any
    position: int
    version: int
