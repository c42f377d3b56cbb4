"""PPO with epochs learns FrozenLake 4x4: the setting of tests/test_grpo_learning.py (one-step
maps, a tiny Qwen3 through the real multi-turn rollout and training loop, a no-update control
on the same rollout keys and task batches), trained by the paper's PPO (GAE on a learned
critic, clipped ratio 0.2, KL 0.001, clipped value loss 0.5) with 2 epochs x 2 mini-batches per
rollout batch: 4 updates per batch, rows shuffled per epoch.

The checks: every update is finite; each batch's first update has ratio exactly 1 and later
ones move off it (some clipped); R_multi over the last steps beats the first steps by far more
than in the control; held-out maps, played with the same sampling keys, are solved more often
by the final parameters than by the initial ones.
"""

from __future__ import annotations

import numpy as np
import pytest

from agentrl_jax.algorithms import AlgorithmConfig, LossTermConfig
from agentrl_jax.train import TrainConfig
from frozenlake_learning import (Run, assert_held_out_success_rises, assert_learns_beyond_the_control,
                                 learning_run)

pytestmark = pytest.mark.slow  # ~2.5 min on the shared 2-core CPU (the GRPO one: ~1.5), half of it compiling

STEPS = 10
EPOCHS, MINI_BATCHES = 2, 2
# 4 Adam steps per batch: a third of GRPO's 3e-2 (tests/test_grpo_learning.py) per update.
LEARNING_RATE = 1e-2
PPO = TrainConfig(learning_rate=LEARNING_RATE, total_steps=STEPS, seed=0, epochs=EPOCHS, mini_batches=MINI_BATCHES,
                  algorithm=AlgorithmConfig(advantage="gae", loss_terms=(
                      LossTermConfig("policy_clip"), LossTermConfig("kl", 0.001), LossTermConfig("value_clip"))))


@pytest.fixture(scope="module")
def run() -> Run:
    return learning_run(PPO)


def test_updates_are_finite_and_each_batch_starts_at_ratio_one(run):
    updates = EPOCHS * MINI_BATCHES
    assert [m["update_skipped"] for m in run.trained] == [0.0] * STEPS
    for m in run.trained:
        assert len(m["updates/ratio_mean"]) == updates and m["updates/update_skipped"] == [0.0] * updates
        assert m["updates/ratio_mean"][0] == 1.0 and m["updates/ratio_deviation"][0] == 0.0
        assert min(m["updates/ratio_deviation"][1:]) > 0
        assert np.isfinite(m["updates/explained_variance"]).all()
    assert max(max(m["updates/policy_clip/clip_fraction"]) for m in run.trained) > 0
    assert run.trained[0]["R_multi"] == run.control[0]["R_multi"]  # the same first rollout


def test_mean_reward_rises_far_beyond_the_control(run):
    assert_learns_beyond_the_control(run)


def test_held_out_maps_are_solved_more_often_with_the_same_sampling_key(run):
    assert_held_out_success_rises(run)
