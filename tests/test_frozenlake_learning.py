"""Short GRPO, PPO and DAPO runs learn FrozenLake 4x4 (issues #6 and #16), end to end through the
real pieces: the real Qwen3 tokenizer and chat template, the multi-turn rollout
(``MultiTurnRollout.for_training``), a tiny random Qwen3 policy, the train step and the training
loop.

Setting (fixed seeds throughout; tests/frozenlake_learning.py builds it):

* tasks: 4x4 maps from ``envs.frozenlake.maps.generate`` (random start and goal, holes with
  probability 0.2, deterministic moves) whose goal is one step right of or below the start,
  half of each: gymnasium's layout (goal down-right of the start) shrunk to one step, so that
  a random policy sometimes succeeds. Each batch holds two tasks of each kind;
* the policy: a Qwen3 of width 16 whose vocabulary is the tokenizer ids a rollout can meet
  (a :class:`~agentrl_jax.sampling.TokenMap`, as in ``bench.rollout``), answering one token
  per turn within a budget of 5 turns. About 10% of its answers are a direction word, so it
  moves now and then at random, and about 1 row in 10 reaches the goal: rewards are neither
  all 0 nor all 1 and the algorithms have mixed groups to learn from;
* what it can learn: to answer with a move, and with Right or Down;
* the trainer's attention is "blocked" (the same gradients as the default "xla" up to float
  rounding, tests/test_train_memory.py; about twice as fast on a CPU at these 512-token rows);
* the sampler keeps all 32 rows of a batch to its end instead of compacting its cache to the
  live rows as rows finish (``SamplerPolicy(compact=False)``): each row samples the same tokens
  either way (its own keys; compaction is tested in tests/test_rollout_qwen3.py),
  and the runs then compile one decode program instead of one per row bucket (32, 16, 8), at
  -O1 about 2 s each (the same R_multi, step by step, and held-out rates as compacted).

The checks, for each algorithm: every update is finite; R_multi over the last steps beats the
first steps by far more than in a control (the same loop, rollout keys and task batches, with
an update that leaves the parameters as they are, i.e. learning rate 0; one control serves
both, as does the initial parameters' held-out play); and on held-out maps, played by the
initial and by the final parameters with the same sampling key, success and the valid-move
rate rise. The margins are a fraction of the effect measured over several seeds (GRPO's
R_multi rises from about 0.15 to about 0.5), not tuned numbers.

GRPO: the default terms, one update per rollout batch (LoRA GRPO and MoE GRPO with routing
replay: tests/test_frozenlake_learning_lora_moe.py). PPO: the paper's (GAE
on a learned critic, clipped ratio 0.2, KL 0.001, clipped value loss 0.5) with 2 epochs x 2
mini-batches per rollout batch: 4 updates per batch, rows shuffled per epoch; each batch's first
update has ratio exactly 1 and later ones move off it (some clipped).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from frozenlake_learning import (
    STEPS,
    Run,
    assert_held_out_success_rises,
    assert_learns_beyond_the_control,
    learning_run,
)

from agentrl_jax.algorithms import AlgorithmConfig, LossTermConfig
from agentrl_jax.train import RLConfig, TrainConfig

# ~3 min on the shared 2-core CPU, a third of it compiling; at -O1 (tests/conftest.py): the rollouts
# and updates run twice as fast as at the suite's -O0
pytestmark = [pytest.mark.slow, pytest.mark.optimized]

# Adam on a width-16 model: 3e-2 learns within 10 steps (the paper's 1e-6 is for 4B models).
GRPO = TrainConfig(
    rl=RLConfig(
        optimizer={"learning_rate": 3e-2}, memory={"attention": "blocked"}, steps=STEPS, seed=0
    )
)
EPOCHS, MINI_BATCHES = 2, 2
# 4 Adam steps per batch: a third of GRPO's 3e-2 per update.
PPO = TrainConfig(
    rl=RLConfig(
        optimizer={"learning_rate": 1e-2},
        batching={"epochs": EPOCHS, "mini_batches": MINI_BATCHES},
        memory={"attention": "blocked"},
        steps=STEPS,
        seed=0,
    ),
    algorithm=AlgorithmConfig(
        advantage="gae",
        loss_terms=(
            LossTermConfig("policy_clip"),
            LossTermConfig("kl", 0.001),
            LossTermConfig("value_clip"),
        ),
    ),
)


# DAPO: clip-higher (0.2 / 0.28), token-mean, no KL, dynamic sampling over up to 3 rollout
# batches per update, and the soft overlong punishment (L_max = 5 sampled tokens, one per turn;
# L_cache = 2: -0.5 for a row of 4 moves, -1 for 5). One update per batch, as GRPO.
DAPO = TrainConfig(
    rl=RLConfig(
        optimizer={"learning_rate": 3e-2}, memory={"attention": "blocked"}, steps=STEPS, seed=0
    ),
    max_response_length=5,
    algorithm=AlgorithmConfig(
        advantage="grpo",
        aggregation="token-mean",
        dynamic_sampling=True,
        max_rollout_batches=3,
        overlong_buffer=0.4,
        loss_terms=(LossTermConfig("policy_clip", params={"clip_low": 0.2, "clip_high": 0.28}),),
    ),
)


# GRPO with rollouts one update behind (asynchronous training, rl.asynchronous.max_staleness: 1):
# batch j is sampled by the parameters after j - 1 updates and corrected by the truncated importance
# weight. The lag delays the start (at 3e-2 R_multi over the 10 steps was 0.06 ... 0.19, 0.38
# against synchronous GRPO's 0.06 ... 0.41, 0.38, on this CPU); 5e-2 makes up for it within the 10
# steps.
ASYNC_GRPO = dataclasses.replace(
    GRPO,
    rl=dataclasses.replace(
        GRPO.rl,
        asynchronous=dataclasses.replace(GRPO.rl.asynchronous, max_staleness=1),
        optimizer=dataclasses.replace(GRPO.rl.optimizer, learning_rate=5e-2),
    ),
)


@pytest.fixture(scope="module")
def grpo() -> Run:
    return learning_run(GRPO)


@pytest.fixture(scope="module")
def ppo() -> Run:
    return learning_run(PPO)


@pytest.fixture(scope="module")
def dapo() -> Run:
    return learning_run(DAPO)


def test_grpo_updates_are_finite_and_the_control_replays_the_first_rollout(grpo):
    assert [m["update_skipped"] for m in grpo.trained] == [0.0] * STEPS
    # One update per batch: the old log-probs are the updated policy's own, every ratio is 1.
    assert all(m["policy_clip/clip_fraction"] == 0 and m["ratio_mean"] == 1 for m in grpo.trained)
    assert all(m["overflow_rate"] == 0 for m in grpo.trained + grpo.control)
    # Step 1 rolls out the same parameters with the same key and tasks in both runs.
    assert grpo.trained[0]["R_multi"] == grpo.control[0]["R_multi"]
    # The untrained policy succeeds sometimes, not always: GRPO has something to learn from.
    assert 0.02 < grpo.r_multi("control").mean() < 0.4, grpo.r_multi("control")


def test_grpo_mean_reward_rises_far_beyond_the_control(grpo):
    assert_learns_beyond_the_control(grpo)


def test_grpo_held_out_maps_are_solved_more_often_with_the_same_sampling_key(grpo):
    assert_held_out_success_rises(grpo)


def test_ppo_updates_are_finite_and_each_batch_starts_at_ratio_one(ppo):
    updates = EPOCHS * MINI_BATCHES
    assert [m["update_skipped"] for m in ppo.trained] == [0.0] * STEPS
    for m in ppo.trained:
        assert (
            len(m["updates/ratio_mean"]) == updates
            and m["updates/update_skipped"] == [0.0] * updates
        )
        assert m["updates/ratio_mean"][0] == 1.0 and m["updates/ratio_deviation"][0] == 0.0
        assert min(m["updates/ratio_deviation"][1:]) > 0
        assert np.isfinite(m["updates/explained_variance"]).all()
    assert max(max(m["updates/policy_clip/clip_fraction"]) for m in ppo.trained) > 0
    assert ppo.trained[0]["R_multi"] == ppo.control[0]["R_multi"]  # the same first rollout


def test_ppo_mean_reward_rises_far_beyond_the_control(ppo):
    assert_learns_beyond_the_control(ppo)


def test_ppo_held_out_maps_are_solved_more_often_with_the_same_sampling_key(ppo):
    assert_held_out_success_rises(ppo)


def test_dapo_trains_only_on_varied_groups_and_refills_its_batches(dapo):
    assert [m["update_skipped"] for m in dapo.trained] == [0.0] * STEPS
    draws = [m["dynamic_sampling/rollout_batches"] for m in dapo.trained]
    assert max(draws) > 1, draws  # some steps needed a second rollout batch
    assert all(m["dynamic_sampling/kept_groups"] >= 1 for m in dapo.trained)
    assert all(m["overlong_penalty_mean"] <= 0 for m in dapo.trained)
    assert min(m["overlong_penalty_mean"] for m in dapo.trained[:3]) < 0  # the early wanderers pay


def test_dapo_mean_reward_rises_far_beyond_the_control(dapo):
    assert_learns_beyond_the_control(dapo)


def test_dapo_held_out_maps_are_solved_more_often_with_the_same_sampling_key(dapo):
    assert_held_out_success_rises(dapo)


@pytest.fixture(scope="module")
def async_grpo() -> Run:
    return learning_run(ASYNC_GRPO)


def test_async_grpo_samples_one_update_behind_and_learns_beyond_the_control(async_grpo):
    """Same keys and tasks as the control; every batch after the first sampled by the
    parameters one update old, corrected, and the policy still learns as synchronous GRPO does."""
    trained = async_grpo.trained
    assert [m["staleness_max"] for m in trained] == [0.0] + [1.0] * (STEPS - 1)
    assert [m["update_skipped"] for m in trained] == [0.0] * STEPS
    assert trained[0]["R_multi"] == async_grpo.control[0]["R_multi"]
    assert all(0 < m["off_policy/weight"] <= 2.0 for m in trained)
    assert_learns_beyond_the_control(async_grpo)
