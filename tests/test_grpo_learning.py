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

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from agentrl_jax.bench.rollout import frozenlake_token_map
from agentrl_jax.models.tokenizer import load_tokenizer
from agentrl_jax.policy import SamplerPolicy
from agentrl_jax.rollout import MultiTurnRollout, RolloutConfig
from agentrl_jax.train import TrainConfig, init_train_state, make_train_step, train
from envs.frozenlake import grid
from envs.frozenlake import maps as fl_maps
from envs.frozenlake.text_env import FrozenLakeTextConfig, FrozenLakeTextEnv
from train_fakes import tiny_model

pytestmark = pytest.mark.slow  # about 40 s on a 2-core CPU, most of it compiling

BUDGET = 5
GROUP = 8
TASKS_PER_STEP = 4
TRAIN_MAPS = 8  # half with the goal right of the start, half with it below
HELD_OUT_MAPS = 16  # played in 4 batches of TASKS_PER_STEP: 128 rows
STEPS = 10
# Adam on a width-16 model: 3e-2 learns within 10 steps (the paper's 1e-6 is for 4B models).
LEARNING_RATE = 3e-2
WINDOW = 3  # steps averaged at each end of the run


def one_step_maps(key: jax.Array, count: int, candidates: int = 640) -> np.ndarray:
    """``count`` distinct 4x4 maps whose goal is the cell right of the start (even indices) or
    below it (odd indices), from ``generate``'s random start/goal maps, in generation order."""
    maps = np.asarray(fl_maps.generate(key, candidates, size=4, p=0.8, random_start_goal=True))
    flat = maps.reshape(candidates, -1)
    _, first = np.unique(flat, axis=0, return_index=True)
    maps, flat = maps[np.sort(first)], flat[np.sort(first)]
    start, goal = np.argmax(flat == grid.START, 1), np.argmax(flat == grid.GOAL, 1)
    right = (goal == start + 1) & (start % 4 < 3)
    below = goal == start + 4
    half = count // 2
    right_maps, below_maps = maps[right][:half], maps[below][:half]
    assert len(right_maps) == len(below_maps) == half, "too few candidates; raise `candidates`"
    return np.stack([right_maps, below_maps], 1).reshape(count, 4, 4)


@dataclasses.dataclass(frozen=True)
class Run:
    trained: list[dict[str, float]]   # the loop's metrics, one dict per step
    control: list[dict[str, float]]
    held_out: dict[str, dict[str, float]]  # "initial"/"final" -> success and valid-move rate

    def r_multi(self, which: str) -> np.ndarray:
        return np.array([m["R_multi"] for m in getattr(self, which)])


def held_out_rates(runner: MultiTurnRollout, policy: SamplerPolicy, params, tasks: np.ndarray
                   ) -> dict[str, float]:
    """Success rate and share of valid moves over ``tasks`` (batches of TASKS_PER_STEP), each
    batch with its own fixed key, the same for whatever ``params``."""
    success, valid, turns = 0.0, 0.0, 0.0
    for k, batch in enumerate(tasks.reshape(-1, TASKS_PER_STEP)):
        traj = jax.device_get(runner(policy.using(params), batch, jax.random.key(100 + k)).trajectory)
        success += traj.success.sum()
        valid += (traj.action_valid & traj.turn_mask).sum()
        turns += traj.turn_mask.sum()
    return {"success": float(success / (len(tasks) * GROUP)), "valid": float(valid / turns)}


@pytest.fixture(scope="module")
def run() -> Run:
    maps = one_step_maps(jax.random.key(0), TRAIN_MAPS + HELD_OUT_MAPS)  # distinct maps
    train_ids, held_out_ids = np.arange(TRAIN_MAPS), np.arange(TRAIN_MAPS, len(maps))
    env = FrozenLakeTextEnv(maps, FrozenLakeTextConfig(t_max=BUDGET, is_slippery=False))
    runner = MultiTurnRollout(env, load_tokenizer(), RolloutConfig(
        group_size=GROUP, budget=BUDGET, max_response_tokens=1, max_context=512))
    token_map = frozenlake_token_map(runner, [BUDGET])
    model = tiny_model(seed=0, vocab_size=len(token_map))
    policy = SamplerPolicy(model, token_map=token_map)
    rollout = runner.for_training(policy)

    def task_batches(position: int) -> np.ndarray:  # two "right" and two "below" maps each
        return train_ids[(position * TASKS_PER_STEP + np.arange(TASKS_PER_STEP)) % TRAIN_MAPS]

    config = TrainConfig(learning_rate=LEARNING_RATE, total_steps=STEPS, seed=0)  # GRPO
    initial = init_train_state(model, config)

    def loop(train_step) -> tuple[object, list[dict[str, float]]]:
        metrics = []
        final = train(initial, train_step, rollout, task_batches, config, progress=False,
                      on_step=lambda state, m: metrics.append(m))
        return final, metrics

    final, trained = loop(make_train_step(nnx.graphdef(model), config))

    def unchanged(state, batch):  # the control's update: learning rate 0
        return state.replace(step=state.step + 1), {"update_skipped": jnp.zeros(())}

    _, control = loop(unchanged)
    held_out = {name: held_out_rates(runner, policy, params, held_out_ids)
                for name, params in (("initial", initial.policy), ("final", final.policy))}
    return Run(trained, control, held_out)


def test_updates_are_finite_and_the_control_replays_the_first_rollout(run):
    assert [m["update_skipped"] for m in run.trained] == [0.0] * STEPS
    # Step 1 trains the sampling policy itself: re-scored, every sampled token has ratio 1
    # (the trainer sees the model's ids, not the tokenizer's), so none is clipped.
    assert run.trained[0]["clip_fraction"] == 0
    assert all(m["overflow_rate"] == 0 for m in run.trained + run.control)
    # Step 1 rolls out the same parameters with the same key and tasks in both runs.
    assert run.trained[0]["R_multi"] == run.control[0]["R_multi"]
    # The untrained policy succeeds sometimes, not always: GRPO has something to learn from.
    assert 0.02 < run.r_multi("control").mean() < 0.4, run.r_multi("control")


def test_mean_reward_rises_over_the_first_steps_far_beyond_the_control(run):
    trained, control = run.r_multi("trained"), run.r_multi("control")
    gain = trained[-WINDOW:].mean() - trained[:WINDOW].mean()
    control_gain = control[-WINDOW:].mean() - control[:WINDOW].mean()
    report = f"trained R_multi {np.round(trained, 2)}, control {np.round(control, 2)}"
    assert gain > control_gain + 0.2, report
    # Paired: the same rollout keys and task batches, only the updates differ.
    assert trained[-WINDOW:].mean() > control[-WINDOW:].mean() + 0.2, report


def test_held_out_maps_are_solved_more_often_with_the_same_sampling_key(run):
    initial, final = run.held_out["initial"], run.held_out["final"]
    assert final["success"] > initial["success"] + 0.15, run.held_out
    assert final["valid"] > 2 * initial["valid"], run.held_out  # it learned to answer with a move
