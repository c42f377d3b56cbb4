"""A short GRPO run learns FrozenLake 4x4 (issue #6), end to end through the real pieces: the
real Qwen3 tokenizer and chat template, the multi-turn rollout (``MultiTurnRollout.for_training``),
a tiny random Qwen3 policy, the default GRPO train step and the training loop.

Setting (fixed seeds throughout):

* tasks: 4x4 maps from ``envs.frozenlake.maps.generate`` (random start and goal, holes with
  probability 0.2, deterministic moves) whose goal is one step right of or below the start,
  half of each: gymnasium's layout (goal down-right of the start) shrunk to one step, so that
  a random policy sometimes succeeds. Each batch holds two tasks of each kind;
* the policy: a Qwen3 of width 16 whose vocabulary is the tokenizer ids a rollout can meet
  (a :class:`~agentrl_jax.policy.TokenMap`, as in ``bench.rollout``), answering one token
  per turn within a budget of 5 turns. About 10% of its answers are a direction word, so it
  moves now and then at random, and about 1 row in 10 reaches the goal: rewards are neither
  all 0 nor all 1 and GRPO has mixed groups to learn from;
* what it can learn: to answer with a move, and with Right or Down.

The checks: every update is finite; R_multi over the last steps beats the first steps by far
more than in a control (the same loop, rollout keys and task batches, with an update that leaves
the parameters as they are, i.e. learning rate 0); and on held-out maps, played by the initial
and by the final parameters with the same sampling key, success and the valid-move rate rise.
The margins are a fraction of the effect measured over several seeds (R_multi rises from about
0.15 to about 0.5), not tuned numbers.
"""

from __future__ import annotations

import pytest

from agentrl_jax.train import TrainConfig
from frozenlake_learning import (Run, assert_held_out_success_rises, assert_learns_beyond_the_control,
                                 learning_run)

pytestmark = pytest.mark.slow  # about 40 s on a 2-core CPU, most of it compiling

STEPS = 10
# Adam on a width-16 model: 3e-2 learns within 10 steps (the paper's 1e-6 is for 4B models).
LEARNING_RATE = 3e-2


@pytest.fixture(scope="module")
def run() -> Run:
    return learning_run(TrainConfig(learning_rate=LEARNING_RATE, total_steps=STEPS, seed=0))  # GRPO


def test_updates_are_finite_and_the_control_replays_the_first_rollout(run):
    assert [m["update_skipped"] for m in run.trained] == [0.0] * STEPS
    # One update per batch: the old log-probs are the updated policy's own, every ratio is 1.
    assert all(m["policy_clip/clip_fraction"] == 0 and m["ratio_mean"] == 1 for m in run.trained)
    assert all(m["overflow_rate"] == 0 for m in run.trained + run.control)
    # Step 1 rolls out the same parameters with the same key and tasks in both runs.
    assert run.trained[0]["R_multi"] == run.control[0]["R_multi"]
    # The untrained policy succeeds sometimes, not always: GRPO has something to learn from.
    assert 0.02 < run.r_multi("control").mean() < 0.4, run.r_multi("control")


def test_mean_reward_rises_over_the_first_steps_far_beyond_the_control(run):
    assert_learns_beyond_the_control(run)


def test_held_out_maps_are_solved_more_often_with_the_same_sampling_key(run):
    assert_held_out_success_rises(run)
