"""Reward preparation of the train step: the episode and per-turn rewards (outcome, shaped by
process scores and DAPO's overlong penalty where configured) and the inputs of the advantage
estimator.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from agentrl_jax.algorithms import AdvantageInputs, budget_anchor_keys, overlong_penalty
from agentrl_jax.process_rewards import shape_rewards, turn_rewards_to_tokens
from agentrl_jax.train.batch import TrainBatch, batch_loss_mask
from agentrl_jax.train.config import TrainConfig
from agentrl_jax.trajectory import Trajectory


def overlong_rewards(trajectory: Trajectory, config: TrainConfig) -> jax.Array:
    """DAPO's soft overlong punishment of each row, ``float32 [N]`` (<= 0; all 0 when the
    algorithm's ``overlong_buffer`` is 0): :func:`~agentrl_jax.algorithms.overlong_penalty` of
    the row's sampled tokens, with ``L_max = config.max_response_length`` and
    ``L_cache = max(1, floor(overlong_buffer x L_max + 1/2))``."""
    algorithm = config.algorithm
    if algorithm.overlong_buffer == 0:
        return jnp.zeros(trajectory.row_mask.shape, jnp.float32)
    length = config.max_response_length
    return overlong_penalty(
        jnp.sum(batch_loss_mask(trajectory), axis=-1),
        max_length=length,
        cache_length=max(1, int(algorithm.overlong_buffer * length + 0.5)),
        penalty=algorithm.overlong_penalty,
    )


def shaped_rewards(batch: TrainBatch, config: TrainConfig) -> tuple[jax.Array, jax.Array]:
    """The rewards the estimator sees: ``(episode [N], per_turn [N, T])`` float32.

    The outcome reward plus the overlong penalty (:func:`overlong_rewards`), shaped by the
    batch's process scores (:func:`~agentrl_jax.process_rewards.shape_rewards`; the penalty
    lands on the row's last turn, like the outcome). DAPO's dynamic sampling compares these
    episode rewards within groups: the groups it drops are those whose episode-level group
    advantages (GRPO, Dr. GRPO, RLOO) would be 0.
    """
    traj = batch.trajectory
    turn_mask = traj.turn_mask.astype(bool) & traj.row_mask.astype(bool)[:, None]
    outcome = traj.outcome_reward + overlong_rewards(traj, config)
    return shape_rewards(outcome, batch.step_scores, turn_mask, config.rl.process_reward_coef)


def advantage_inputs(
    batch: TrainBatch, config: TrainConfig, old_values: jax.Array | None
) -> AdvantageInputs:
    """What the configured estimator reads, from a batch (:func:`shaped_rewards`).

    Every field is filled (estimators also read optional ones, such as ``traj_mask``, that
    they do not declare); ``values`` and ``token_rewards`` only with a critic."""
    traj = batch.trajectory
    turn_mask = traj.turn_mask.astype(bool) & traj.row_mask.astype(bool)[:, None]
    episode, per_turn = shaped_rewards(batch, config)
    anchors = (
        budget_anchor_keys(traj.anchor_key, traj.budget)
        if config.budget_anchors
        else traj.anchor_key
    )
    return AdvantageInputs(
        loss_mask=batch_loss_mask(traj),
        rewards=episode,
        group_ids=traj.group_id,
        traj_mask=traj.row_mask.astype(bool),
        step_rewards=per_turn,
        turn_mask=turn_mask,
        anchor_keys=anchors,
        token_turn_index=traj.token_turn,
        token_rewards=turn_rewards_to_tokens(per_turn, traj.token_turn)
        if old_values is not None
        else None,
        values=old_values,
    )
