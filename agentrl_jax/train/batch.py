"""The batch one train step takes: a rollout's trajectories and, optionally, their process
scores; and the checks the loop runs on it before it is placed on device.

Context: every sampled token is scored with the whole row before it as its context, which is
what the policy saw when the rollout kept the whole history (:func:`check_full_history`
rejects turns sampled from a history window).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import struct

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


def check_full_history(trajectory: Trajectory) -> None:
    """Raises ValueError if a turn was sampled from a windowed history (host-side check).

    The step scores every sampled token with the whole row before it as its context, which
    reproduces the sampling log-probs only if each turn saw the whole history, i.e.
    ``context_start == prefix_len`` on every real turn. A history window (the rollout's
    ``history_window``) changes positions and attention per turn; training on such rows would
    need each turn re-scored on its own context, which this step does not do.
    """
    real = np.asarray(trajectory.turn_mask, bool) & np.asarray(trajectory.row_mask, bool)[:, None]
    windowed = real & (
        np.asarray(trajectory.context_start) != np.asarray(trajectory.prefix_len)[:, None]
    )
    if windowed.any():
        row, turn = (int(i[0]) for i in np.nonzero(windowed))
        raise ValueError(
            f"Trajectory.context_start: {int(windowed.sum())} turns were sampled from a "
            f"windowed history "
            f"(first: row {row}, turn {turn}); the train step scores each response with the whole "
            "conversation as its context, so it needs rollouts with the whole history kept "
            "(history_window=None)"
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
