"""Step-wise training with a windowed history (issue #47): a rollout that shows the policy only
its last turns records where each turn's context began (``context_start``); the train step
scores every turn under that context (its own packed sequence: the system header and the
window), so its log-probs are the sampler's, and a 4-turn window still learns FrozenLake."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from frozenlake_learning import (
    STEPS,
    _setting,
    assert_held_out_success_rises,
    assert_learns_beyond_the_control,
    learning_run,
)

from agentrl_jax.train import RLConfig, TrainConfig, make_train_step
from agentrl_jax.train.batch import TrainBatch, windowed_turns
from agentrl_jax.train.packing import pack, turn_sequences
from agentrl_jax.train.scoring import sequence_logprobs


def _windowed_batch(window: int):
    setting = _setting(0.1, window)
    tasks = setting.train_ids[:4]
    play = setting.runner.for_training(setting.policy)  # tokens as the model's ids
    traj = jax.device_get(play(nnx.state(setting.model), jax.random.key(3), tasks))
    return setting, traj


def test_turn_sequences_are_what_each_turn_saw():
    _, traj = _windowed_batch(window=1)
    windowed = windowed_turns(traj)
    assert windowed.sum() > 10  # turns 2.. of rows that played them
    row, turn = (int(i[0]) for i in np.nonzero(windowed))
    prefix, start = int(traj.prefix_len[row]), int(traj.context_start[row, turn])
    sequence = next(
        cols
        for r, cols, trains in turn_sequences(traj)
        if r == row and trains.any() and (traj.token_turn[row, cols[trains]] == turn).all()
    )
    response = np.flatnonzero(np.asarray(traj.loss_mask[row]) & (traj.token_turn[row] == turn))
    np.testing.assert_array_equal(
        sequence, np.r_[np.arange(prefix), np.arange(start, response[-1] + 1)]
    )


def test_the_step_scores_each_turn_under_its_window_as_the_sampler_did():
    setting, traj = _windowed_batch(window=1)
    config = TrainConfig(rl=RLConfig())
    step = make_train_step(nnx.graphdef(setting.model), config)
    batch = step.packed(TrainBatch(traj))
    packing = batch.packing
    loss_mask = pack(np.asarray(traj.loss_mask, bool), packing) & packing.trains
    trained = np.asarray(traj.loss_mask, bool) & np.asarray(traj.row_mask, bool)[:, None]
    assert int(loss_mask.sum()) == int(trained.sum())  # every response token trained once
    with jax.default_matmul_precision("highest"):
        logprobs, _ = jax.jit(sequence_logprobs)(
            setting.model,
            pack(traj.tokens, packing),
            pack(traj.token_mask, packing),
            loss_mask=loss_mask,
            segment_ids=packing.segment_ids,
        )
    recorded = pack(traj.logprobs, packing)
    gap = np.abs(np.where(loss_mask, np.asarray(logprobs) - np.asarray(recorded), 0.0))
    assert gap.max() < 1e-5, gap.max()
    # and scored as if the whole history were the context, the windowed turns differ
    whole, _ = jax.jit(sequence_logprobs)(
        setting.model, traj.tokens, traj.token_mask, loss_mask=traj.loss_mask
    )
    windowed = windowed_turns(traj)[np.arange(len(traj.tokens))[:, None], traj.token_turn]
    on = np.asarray(traj.loss_mask, bool) & windowed & (traj.token_turn >= 0)
    assert np.abs(np.asarray(whole) - np.asarray(traj.logprobs))[on].max() > 1e-3


@pytest.mark.slow
@pytest.mark.optimized
def test_grpo_with_a_four_turn_window_learns_beyond_the_control():
    config = TrainConfig(
        rl=RLConfig(
            optimizer={"learning_rate": 3e-2}, memory={"attention": "blocked"}, steps=STEPS, seed=0
        )
    )
    run = learning_run(config, window=4)
    assert all(np.isfinite(m["loss"]) for m in run.trained)
    assert max(m.get("sampler_gap_max", 0.0) for m in run.trained) < 1e-4
    assert_learns_beyond_the_control(run)
    assert_held_out_success_rises(run)
