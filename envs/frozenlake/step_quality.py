"""FrozenLake's step quality, the oracle process reward (§7, §8): the exact optimal
``Q*(s_t, a_t)`` of every turn with ``B - t`` moves left (finite-horizon DP with the
step-quality discount :data:`~envs.frozenlake.qstar.DEFAULT_GAMMA`), from the row's map
(``task_id`` indexes the scorer's maps), the cell before the move (``state_id``), the parsed
``action`` and the row's ``budget``.

:class:`FrozenLakeQStar` is a step scorer (:class:`~agentrl_jax.trajectory.StepScorer`): R_single
of FrozenLake's training dynamics, and a process reward to train with
(:mod:`agentrl_jax.process_rewards`).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp

from agentrl_jax.trajectory import StepScores, Trajectory, scored_turns
from envs.frozenlake.qstar import DEFAULT_GAMMA, action_quality, q_star


def qstar_step_quality(
    maps: jax.Array,
    trajectory: Trajectory,
    *,
    gamma: float = DEFAULT_GAMMA,
    is_slippery: bool = True,
    success_rate: float = 1.0 / 3.0,
    invalid_score: float = 0.0,
) -> StepScores:
    """Q*(s_t, a_t) with ``B - t`` moves left for every real turn (pure; jittable).

    maps: int8[M, n, n], the task set ``trajectory.task_id`` indexes. The horizon is the
    trajectory's turn axis T (no budget exceeds it). A turn whose action is invalid gets
    ``invalid_score`` (Q* is >= 0, so the default 0 ranks it with the worst moves).
    """
    n, t = trajectory.turn_mask.shape
    q = q_star(
        maps[trajectory.task_id], t, gamma=gamma, is_slippery=is_slippery, success_rate=success_rate
    )  # [N, T+1, S, 4]
    remaining = trajectory.budget[:, None] - jnp.arange(t, dtype=jnp.int32)[None, :]
    quality = action_quality(
        q[:, None], remaining, trajectory.state_id, trajectory.action
    )  # [N, T]
    mask = scored_turns(trajectory)
    invalid = mask & ~trajectory.action_valid.astype(bool)
    quality = jnp.where(invalid, invalid_score, quality)
    return StepScores(jnp.where(mask, quality, 0.0).astype(jnp.float32), mask, invalid)


class FrozenLakeQStar:
    """Oracle step scorer for FrozenLake: the exact Q* of each step (see
    :func:`qstar_step_quality`).

    ``maps`` int8[M, n, n] is the task set (``trajectory.task_id`` indexes it); the dynamics
    (``is_slippery``, ``success_rate``) must be the rollout environment's.
    """

    def __init__(
        self,
        maps,
        *,
        gamma: float = DEFAULT_GAMMA,
        is_slippery: bool = True,
        success_rate: float = 1.0 / 3.0,
        invalid_score: float = 0.0,
    ):
        maps = jnp.asarray(maps)
        if (
            maps.ndim != 3
            or maps.shape[1] != maps.shape[2]
            or not jnp.issubdtype(maps.dtype, jnp.integer)
        ):
            raise ValueError(
                f"FrozenLakeQStar maps: expected int[M, n, n] tile codes, "
                f"got {maps.dtype}{maps.shape}"
            )
        if not (isinstance(invalid_score, numbers.Real) and math.isfinite(invalid_score)):
            raise ValueError(
                f"FrozenLakeQStar invalid_score: must be a finite number, got {invalid_score!r}"
            )
        self.maps = maps
        self._score = jax.jit(
            lambda maps, trajectory: qstar_step_quality(
                maps,
                trajectory,
                gamma=gamma,
                is_slippery=is_slippery,
                success_rate=success_rate,
                invalid_score=invalid_score,
            )
        )

    def __call__(self, trajectory: Trajectory, tasks: Any = None) -> StepScores:
        # the turns only, placed explicitly: the conversation stays where it is (the host)
        return self._score(self.maps, jax.device_put(trajectory.turns_only()))
