"""DAPO's batch-level parts in the trainer (issue #16): dynamic sampling (groups whose rewards
are all equal dropped, the batch refilled from further rollout batches) and the soft overlong
punishment added to the reward; the Dr. GRPO constant; the new AlgorithmConfig fields."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from train_fakes import make_fake_rollout, random_trajectory, task_batches, tiny_model

from agentrl_jax.algorithms import (
    AlgorithmConfig,
    LossTermConfig,
    dynamic_sampling_keep,
    grpo_advantages,
)
from agentrl_jax.train import RLConfig, TrainConfig, init_train_state, make_train_step, train
from agentrl_jax.train.batch import TrainBatch, batch_loss_mask
from agentrl_jax.train.dynamic_sampling import Draw, assemble, pack
from agentrl_jax.train.rewards import overlong_rewards, shaped_rewards
from agentrl_jax.train.step import prepare_batch
from agentrl_jax.trajectory import concatenate_rows

DAPO = AlgorithmConfig(
    advantage="grpo",
    aggregation="token-mean",
    dynamic_sampling=True,
    max_rollout_batches=3,
    loss_terms=(LossTermConfig("policy_clip", params={"clip_low": 0.2, "clip_high": 0.28}),),
)


def _with_success(trajectory, success):
    return trajectory.replace(success=jnp.asarray(success, bool))


def _draw(trajectory) -> Draw:
    keep = dynamic_sampling_keep(
        trajectory.outcome_reward, trajectory.group_id, trajectory.row_mask
    )
    return Draw(trajectory, np.asarray(keep))


def test_whole_varied_groups_are_kept_in_draw_order_and_the_batch_is_refilled_from_the_next_draw():
    # Draw 1: group 0 all succeeded (dropped), group 1 mixed (kept). Draw 2 (wider rows):
    # group 0 mixed (kept), group 1 all failed (dropped).
    first = _with_success(random_trajectory(1, rows=8, tokens=24), [1, 1, 1, 1, 1, 0, 0, 1])
    second = _with_success(random_trajectory(2, rows=8, tokens=32), [0, 1, 0, 0, 0, 0, 0, 0])
    trajectory, scores, metrics = assemble([_draw(first), _draw(second)])
    assert scores is None
    assert metrics == {
        "dynamic_sampling/rollout_batches": 2.0,
        "dynamic_sampling/kept_groups": 2.0,
        "dynamic_sampling/dropped_groups": 2.0,
        "dynamic_sampling/filler_rows": 0.0,
    }
    assert trajectory.tokens.shape == (8, 32)  # padded to the wider draw
    np.testing.assert_array_equal(trajectory.group_id, [0, 0, 0, 0, 1, 1, 1, 1])  # renumbered
    np.testing.assert_array_equal(trajectory.row_mask, [True] * 8)
    np.testing.assert_array_equal(trajectory.success, [1, 0, 0, 1, 0, 1, 0, 0])
    np.testing.assert_array_equal(trajectory.tokens[:4, :24], first.tokens[4:])
    np.testing.assert_array_equal(trajectory.tokens[:4, 24:], 0)
    np.testing.assert_array_equal(trajectory.token_turn[:4, 24:], -1)  # padding is not a turn
    assert not np.asarray(trajectory.token_mask[:4, 24:]).any()
    np.testing.assert_array_equal(trajectory.tokens[4:], second.tokens[:4])
    np.testing.assert_array_equal(trajectory.reward[4:], second.reward[:4])
    # Every group trained on has rewards that vary: a nonzero GRPO advantage somewhere in it.
    advantages = np.asarray(
        grpo_advantages(trajectory.outcome_reward, trajectory.group_id, trajectory.row_mask)
    )
    assert all(np.abs(advantages[trajectory.group_id == g]).max() > 0.5 for g in (0, 1))


def test_a_batch_short_of_varied_groups_is_filled_with_masked_rows_that_take_no_part():
    first = _with_success(
        random_trajectory(3, rows=8), [1, 1, 1, 1, 0, 1, 0, 1]
    )  # only group 1 varies
    scores = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    trajectory, picked_scores, metrics = assemble(
        [Draw(first, np.asarray(_draw(first).keep), scores)]
    )
    assert (
        metrics["dynamic_sampling/filler_rows"] == 4
        and metrics["dynamic_sampling/kept_groups"] == 1
    )
    np.testing.assert_array_equal(trajectory.row_mask, [True] * 4 + [False] * 4)
    assert (
        len(set(np.asarray(trajectory.group_id).tolist())) == 5
    )  # the filler rows are groups of none
    np.testing.assert_array_equal(picked_scores[:4], scores[4:])
    np.testing.assert_array_equal(picked_scores[4:], 0)
    assert not np.asarray(batch_loss_mask(trajectory))[4:].any()
    # The kept group's advantages are what GRPO gives it alone; the filler rows get none.
    advantages = np.asarray(
        grpo_advantages(trajectory.outcome_reward, trajectory.group_id, trajectory.row_mask)
    )
    alone = np.asarray(grpo_advantages(first.outcome_reward[4:], jnp.zeros(4, jnp.int32)))
    np.testing.assert_allclose(advantages[:4], alone, atol=1e-6)
    np.testing.assert_array_equal(advantages[4:], 0)


def test_rows_of_batches_of_different_widths_concatenate_and_turn_counts_must_agree():
    a, b = random_trajectory(4, rows=4, tokens=16), random_trajectory(5, rows=8, tokens=20)
    both = concatenate_rows([a, b])
    assert both.tokens.shape == (12, 20) and both.reward.shape == (12, 3)
    np.testing.assert_array_equal(both.logprobs[4:], b.logprobs)
    with pytest.raises(ValueError, match="Trajectory.turn_mask shapes differ"):
        concatenate_rows([a, random_trajectory(6, rows=4, turns=2)])


# ------------------------------------------------------------------------- in the loop

GROUP, GROUPS = 4, 2


def test_the_loop_draws_until_varied_groups_fill_the_batch_and_a_resumed_run_is_exact():
    """A tiny random policy on the fake task succeeds ~12% of the time: a group of 4 is often
    all failures, so steps need a second or third rollout batch (and some stay short)."""
    config = TrainConfig(rl=RLConfig(optimizer={"learning_rate": 1e-2}, steps=4), algorithm=DAPO)
    model = tiny_model()
    graphdef = nnx.graphdef(model)
    fake = make_fake_rollout(graphdef, group_size=GROUP)
    calls, trained = [], []

    def rollout(params, key, tasks):
        calls.append((np.asarray(jax.random.key_data(key)).tobytes(), np.asarray(tasks).tolist()))
        return fake(params, key, tasks)

    step = make_train_step(graphdef, config)

    def spy_step(state, batch):
        trained.append(jax.device_get(batch))
        return step(state, batch)

    metrics = []
    final = train(
        init_train_state(model, config),
        spy_step,
        rollout,
        task_batches(8, GROUPS),
        config,
        progress=False,
        on_step=lambda s, m: metrics.append(m),
    )
    draws = [m["dynamic_sampling/rollout_batches"] for m in metrics]
    assert len(calls) == sum(draws) and int(final.data_position) == sum(draws)
    assert max(draws) > 1 and all(1 <= d <= 3 for d in draws)
    assert len({key for key, _ in calls}) == len(calls)  # every draw has its own key
    assert [tasks for _, tasks in calls] == [
        np.asarray(task_batches(8, GROUPS)(i)).tolist() for i in range(len(calls))
    ]  # consecutive positions
    for batch, m in zip(trained, metrics):
        traj = batch.trajectory
        real = np.asarray(traj.row_mask, bool)
        assert traj.tokens.shape[0] == GROUP * GROUPS  # one shape: one compiled step
        assert (
            real.sum()
            == GROUP * m["dynamic_sampling/kept_groups"]
            == GROUP * GROUPS - m["dynamic_sampling/filler_rows"]
        )
        for g in np.unique(traj.group_id[real]):  # every trained group's rewards vary
            members = real & (traj.group_id == g)
            assert members.sum() == GROUP and 0 < traj.success[members].sum() < GROUP
        if m["dynamic_sampling/filler_rows"] > 0:  # the loop stops short only when out of draws
            assert m["dynamic_sampling/rollout_batches"] == DAPO.max_rollout_batches
    # Resume: two steps, then the rest from that state, equals the straight run bit for bit.
    half = train(
        init_train_state(model, config),
        step,
        fake,
        task_batches(8, GROUPS),
        TrainConfig(rl=RLConfig(optimizer={"learning_rate": 1e-2}, steps=2), algorithm=DAPO),
        progress=False,
    )
    resumed = train(half, step, fake, task_batches(8, GROUPS), config, progress=False)
    assert int(resumed.data_position) == int(final.data_position)
    for a, b in zip(jax.tree.leaves(final.policy), jax.tree.leaves(resumed.policy)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------------- overlong shaping


def test_the_overlong_punishment_is_added_to_the_outcome_before_the_advantages():
    trajectory = random_trajectory(7, rows=8, tokens=24, padded_rows=1)
    algorithm = AlgorithmConfig(overlong_buffer=0.5, overlong_penalty=0.8)
    config = TrainConfig(
        algorithm=algorithm, max_response_length=6
    )  # L_cache 3: 0 up to 3 tokens, -0.8 at 6
    lengths = np.asarray(trajectory.loss_mask).sum(-1)
    expected = [0.8 * min(max((3 - n) / 3, -1.0), 0.0) for n in lengths]
    expected[-1] = 0.0  # the padded row
    assert len(set(lengths[:-1].tolist())) > 2  # rows of several lengths, some past 3
    np.testing.assert_allclose(overlong_rewards(trajectory, config), expected, atol=1e-7)
    episode, per_turn = shaped_rewards(TrainBatch(trajectory), config)
    outcome = np.asarray(trajectory.success, np.float32)
    np.testing.assert_allclose(episode, outcome + expected, atol=1e-7)
    last = (
        np.asarray(trajectory.turns_used)[:-1] - 1
    )  # it lands on each row's last turn, like the outcome
    np.testing.assert_allclose(
        np.asarray(per_turn)[np.arange(7), last], (outcome + expected)[:-1], atol=1e-7
    )
    assert np.asarray(per_turn).sum() == pytest.approx(
        float(np.sum((outcome + expected)[:-1])), abs=1e-5
    )
    model = tiny_model()
    _, metrics = prepare_batch(
        nnx.graphdef(model), config, init_train_state(model, config), TrainBatch(trajectory)
    )
    assert float(metrics["overlong_penalty_mean"]) == pytest.approx(
        np.mean(expected[:-1]), abs=1e-6
    )
    # Off by default: the reward is the outcome alone.
    np.testing.assert_array_equal(shaped_rewards(TrainBatch(trajectory), TrainConfig())[0], outcome)


def test_settings_that_read_the_response_length_need_it_and_dr_grpo_gets_it_as_its_constant():
    with pytest.raises(
        ValueError, match=r"TrainConfig.max_response_length: must be set .* overlong_buffer"
    ):
        TrainConfig(algorithm=AlgorithmConfig(overlong_buffer=0.2))
    dr = AlgorithmConfig(
        advantage="dr_grpo", aggregation="seq-mean-token-sum", aggregation_constant=None
    )
    with pytest.raises(
        ValueError, match=r"max_response_length: must be set .* aggregation_constant"
    ):
        TrainConfig(algorithm=dr)
    config = TrainConfig(algorithm=dr, max_response_length=96)
    assert config.algorithm.aggregation_constant == 96.0
    assert TrainConfig.from_dict(config.to_dict()) == config
    assert TrainConfig.from_dict(
        {
            **config.to_dict(),
            "algorithm": {**config.to_dict()["algorithm"], "dynamic_sampling": True},
        }
    ).algorithm.dynamic_sampling


@pytest.mark.parametrize(
    "field, value",
    [
        ("dynamic_sampling", 1),
        ("max_rollout_batches", 0),
        ("max_rollout_batches", True),
        ("overlong_buffer", 1.5),
        ("overlong_buffer", -0.1),
        ("overlong_penalty", -1.0),
        ("overlong_penalty", float("nan")),
    ],
)
def test_bad_batch_level_settings_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"AlgorithmConfig\.{field}: must be"):
        AlgorithmConfig(**{field: value})


def test_a_batch_with_no_loss_token_makes_no_optimizer_step():
    """All groups dropped and the batch filled with masked rows: weight decay and Adam's
    momentum would still move the parameters; the update is not applied, and says so."""
    model = tiny_model()
    config = TrainConfig(
        rl=RLConfig(optimizer={"learning_rate": 1e-2, "weight_decay": 0.1}), algorithm=DAPO
    )
    step = make_train_step(nnx.graphdef(model), config)
    live = TrainBatch(random_trajectory(8, rows=8))
    state, metrics = step(init_train_state(model, config), live)  # Adam now has momentum
    assert float(metrics["update_empty"]) == 0
    before = jax.tree.map(np.asarray, (state.policy, state.policy_opt))
    empty = TrainBatch(random_trajectory(9, rows=8).replace(row_mask=jnp.zeros(8, bool)))
    after, metrics = step(state, empty)
    assert float(metrics["update_empty"]) == 1 and float(metrics["update_skipped"]) == 0
    assert int(after.step) == 2
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves((after.policy, after.policy_opt))):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_groups_are_packed_whole_and_the_batch_is_only_as_wide_as_the_draws_it_takes_from():
    """A draw whose groups were all dropped does not widen the batch; a group that no longer
    fits the rows left is passed over for a later one that does (row counts of groups differ
    when some of their rows are padding)."""
    first = _with_success(
        random_trajectory(10, rows=8, tokens=16, padded_rows=1), [1, 0, 1, 0, 1, 0, 1, 0]
    )
    wide = _with_success(random_trajectory(11, rows=8, tokens=64), [1] * 8)  # all equal: dropped
    third = _with_success(random_trajectory(12, rows=8, tokens=24), [0, 1, 0, 0, 1, 0, 1, 1])
    draws = [_draw(first), _draw(wide), _draw(third)]
    chosen, group_of = pack(draws, 8)
    # first: group 0 (4 rows) and group 1 (3 real rows); third's groups of 4 no longer fit 1 row
    assert chosen == [0, 1, 2, 3, 4, 5, 6] and group_of == [0] * 4 + [1] * 3
    trajectory, _, metrics = assemble(draws)
    assert trajectory.tokens.shape == (8, 16) and metrics["dynamic_sampling/filler_rows"] == 1
    np.testing.assert_array_equal(trajectory.row_mask, [True] * 7 + [False])
