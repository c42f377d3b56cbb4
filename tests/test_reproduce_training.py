"""The reproduction's RL plumbing: trimming trajectories to buckets, task batches, run specs."""

from __future__ import annotations

import numpy as np
import pytest

from agentrl_jax.reproduce import training
from agentrl_jax.reproduce.config import RLSettings
from agentrl_jax.trajectory import Trajectory


def _trajectory(lengths, width=384, turns=3):
    traj = Trajectory.zeros(len(lengths), width, turns)
    mask = np.arange(width)[None, :] < np.asarray(lengths)[:, None]
    tokens = np.where(mask, np.arange(1, width + 1)[None, :], 0).astype(np.int32)
    return traj.replace(tokens=tokens, token_mask=mask, loss_mask=mask & (np.arange(width) % 2 == 1),
                        token_turn=np.where(mask, 0, -1).astype(np.int32),
                        logprobs=np.where(mask, -0.5, 0.0).astype(np.float32))


@pytest.mark.parametrize("used, width", [(1, 64), (64, 64), (65, 128), (129, 256), (300, 384), (384, 384)])
def test_trim_tokens_to_power_of_two_buckets_keeps_every_real_token(used, width):
    traj = _trajectory([used, max(used // 2, 1)])
    trimmed = training.trim_tokens(traj)
    assert trimmed.tokens.shape == (2, width)
    for field in training.TOKEN_FIELDS:
        full, cut = np.asarray(getattr(traj, field)), np.asarray(getattr(trimmed, field))
        np.testing.assert_array_equal(cut, full[:, :width])
        assert not np.any(np.asarray(traj.token_mask)[:, width:])  # nothing real was cut
    np.testing.assert_array_equal(trimmed.turn_mask, traj.turn_mask)  # per-turn fields untouched


def test_task_batches_are_a_pure_function_of_seed_and_position():
    batch = training.task_batch_fn(20, 8, seed=3)
    first = batch(5)
    assert len(set(first.tolist())) == 8 and first.min() >= 0 and first.max() < 20
    np.testing.assert_array_equal(first, training.task_batch_fn(20, 8, seed=3)(5))
    assert not np.array_equal(batch(5), batch(6))
    with pytest.raises(ValueError, match="exceeds"):
        training.task_batch_fn(4, 8, seed=0)


def test_run_specs_same_updates_different_budget_and_algorithm():
    rl = RLSettings(runs=("grpo", "budgetmix", "gigpo-budgetmix", "ppo"), steps=7)
    specs = {s.name: s for s in training.run_specs(rl)}
    assert [s.train_config.total_steps for s in specs.values()] == [7] * 4
    assert not specs["grpo"].budget_mix and specs["budgetmix"].budget_mix
    assert specs["grpo"].train_config.algorithm == specs["budgetmix"].train_config.algorithm
    assert specs["gigpo-budgetmix"].train_config.budget_anchors
    assert not specs["budgetmix"].train_config.budget_anchors  # GRPO has no anchors
    assert specs["ppo"].train_config.uses_critic and not specs["grpo"].train_config.uses_critic
    config = training.rollout_config(specs["budgetmix"], rl, t_max=12, max_response_tokens=8,
                                     max_context=384, valid_vocab_size=None)
    assert config.budget is None  # BudgetMix draws per group
    assert training.rollout_config(specs["grpo"], rl, t_max=12, max_response_tokens=8,
                                   max_context=384, valid_vocab_size=None).budget == 12
