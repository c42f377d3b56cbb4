"""FrozenLakeTextEnv against the JAX environment it wraps, stepped with the same keys."""

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envs.frozenlake import env as fl_env
from envs.frozenlake import grid
from envs.frozenlake import maps as fl_maps
from envs.frozenlake.text import parse_action, render
from envs.frozenlake.text_env import FrozenLakeTextConfig, FrozenLakeTextEnv

T_MAX = 12
ANSWER = [f"<answer>{name}</answer>" for name in grid.ACTION_NAMES]


@pytest.fixture(scope="module")
def slippery():
    maps = fl_maps.generate(jax.random.key(3), 6, size=4, p=0.8)
    return FrozenLakeTextEnv(maps, FrozenLakeTextConfig(t_max=T_MAX))


@pytest.fixture(scope="module")
def deterministic():
    return FrozenLakeTextEnv("4x4", FrozenLakeTextConfig(t_max=T_MAX, is_slippery=False))


def row_key(seed, row):
    return jax.random.fold_in(jax.random.key(seed), row)


def test_reset_renders_the_start_and_keys_each_row(slippery):
    tasks = np.array([0, 3, 3, 5])
    rows, obs = slippery.reset(tasks, seed=11)
    for i, task in enumerate(tasks):
        start = int(np.flatnonzero(slippery.maps[task].reshape(-1) == grid.START)[0])
        assert obs[i] == render(slippery.maps[task], start)
        np.testing.assert_array_equal(
            jax.random.key_data(rows.keys[i]), jax.random.key_data(row_key(11, i))
        )
    assert slippery.num_tasks() == 6


def test_steps_replay_the_jax_environment_with_the_same_keys(slippery):
    """Every row plays a random action sequence through text; fl_env.rollout with the row's key
    (split into T_MAX turn keys, as the text env does) gives the same cells, rewards and ends."""
    tasks, seed = np.array([0, 1, 2, 3, 4, 5, 0, 1]), 5
    actions = np.random.default_rng(0).integers(0, 4, (len(tasks), T_MAX))
    rows, _ = slippery.reset(tasks, seed)
    params = slippery.params
    reference = []
    for i, task in enumerate(tasks):
        _, state = fl_env.reset_to_map(slippery.maps[task])
        _, trans = fl_env.rollout(row_key(seed, i), state, actions[i], params)
        reference.append(jax.device_get(trans))
    done_before = np.zeros(len(tasks), bool)
    pos_before = np.asarray(rows.env.pos)
    for t in range(T_MAX):
        texts = [ANSWER[a] for a in actions[:, t]]
        rows, res = slippery.step(rows, texts, np.ones(len(tasks), bool))
        if t == 0:
            traces = dict(slippery.trace_counts)
        for i, ref in enumerate(reference):
            if done_before[i]:
                assert not res.action_valid[i] and res.reward[i] == 0 and res.observations[i] == ""
                continue
            assert res.anchor_key[i] == res.state_id[i] == pos_before[i]
            assert res.action[i] == actions[i, t] and res.action_valid[i]
            assert res.reward[i] == ref.reward[t]
            assert res.done[i] == (ref.done[t] or t == T_MAX - 1)  # t_max ends the rest
            assert res.success[i] == (ref.reward[: t + 1].sum() > 0)
            new_pos = int(np.asarray(rows.env.pos)[i])
            assert new_pos == ref.obs[t]
            if not res.done[i]:
                assert res.observations[i] == render(slippery.maps[tasks[i]], new_pos)
        done_before = np.asarray(res.done)
        pos_before = np.asarray(rows.env.pos)
    assert done_before.all()
    assert dict(slippery.trace_counts) == traces  # one compilation serves every turn


def test_an_invalid_response_is_a_noop_that_uses_its_turn(slippery):
    tasks, seed = np.array([2]), 9
    rows, _ = slippery.reset(tasks, seed)
    start = int(rows.env.pos[0])
    rows, res = slippery.step(rows, ["I am not sure."], np.ones(1, bool))
    assert (res.action[0], res.action_valid[0], res.reward[0], res.done[0]) == (
        -1,
        False,
        0.0,
        False,
    )
    assert int(rows.env.pos[0]) == start and int(rows.turn[0]) == 1
    assert res.observations[0] == render(slippery.maps[2], start)
    # the next (valid) move draws its slip from the key of turn 1, not turn 0
    rows, res = slippery.step(rows, ["<answer>Right</answer>"], np.ones(1, bool))
    _, state = fl_env.reset_to_map(slippery.maps[2])
    turn_key = jax.random.split(row_key(seed, 0), T_MAX)[1]
    expected, *_ = fl_env.step(turn_key, state, grid.RIGHT, slippery.params)
    assert int(rows.env.pos[0]) == int(expected)


def test_goal_holes_done_rows_and_rows_that_are_not_live(deterministic):
    # gymnasium's 4x4: S F F F / F H F H / F F F H / H F F G; cells 5, 7, 11, 12 are holes.
    rows, _ = deterministic.reset(np.array([0, 0, 0]), seed=0)
    path = ["Down", "Down", "Right", "Right", "Down", "Right"]  # start -> goal, 6 moves
    live = np.array([True, True, False])
    for t, move in enumerate(path):
        texts = [f"<answer>{move}</answer>", "Right" if t == 0 else "Down", "Down"]
        rows, res = deterministic.step(rows, texts, live)
        if t == 1:  # row 1: Right to cell 1, then Down into the hole at cell 5
            assert res.done[1] and not res.success[1] and res.reward[1] == 0
        if t > 1:
            assert not res.action_valid[1] and res.observations[1] == ""
        assert not res.action_valid[2] and res.done[2] == False  # noqa: E712 (never live)
    assert res.reward[0] == 1 and res.success[0] and res.done[0]
    assert np.asarray(rows.env.pos).tolist() == [15, 5, 0]
    assert np.asarray(rows.turn).tolist() == [6, 2, 0]


def test_t_max_ends_rows_that_keep_answering_garbage(deterministic):
    rows, _ = deterministic.reset(np.array([0, 0]), seed=1)
    for t in range(T_MAX):
        rows, res = deterministic.step(rows, ["hmm", "Up"], np.ones(2, bool))
        assert res.done.tolist() == [t == T_MAX - 1] * 2
    assert not res.success.any() and int(rows.env.pos[1]) == 0  # "Up" at the top edge stays


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.text(max_size=60), min_size=3, max_size=3))
def test_any_text_is_an_action_or_invalid_never_an_error(deterministic, texts):
    rows, _ = deterministic.reset(np.array([0, 0, 0]), seed=2)
    rows, res = deterministic.step(rows, texts, np.ones(3, bool))
    expected = [parse_action(t) for t in texts]
    assert res.action.tolist() == expected
    assert res.action_valid.tolist() == [a >= 0 for a in expected]


def test_instructions_describe_the_dynamics(slippery, deterministic):
    assert "slippery" in slippery.instructions() and "33%" in slippery.instructions()
    assert "slippery" not in deterministic.instructions()
    assert "<answer>Left</answer>" in deterministic.instructions()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"t_max": 0}, "t_max"),
        ({"is_slippery": 1}, "is_slippery"),
        ({"success_rate": 1.5}, "success_rate"),
    ],
)
def test_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FrozenLakeTextConfig(**kwargs)


def test_bad_task_ids_seeds_and_batches_are_rejected(deterministic):
    with pytest.raises(ValueError, match="task_ids"):
        deterministic.reset(np.array([1]), seed=0)  # one map only
    with pytest.raises(ValueError, match="seed"):
        deterministic.reset(np.array([0]), seed=-1)
    rows, _ = deterministic.reset(np.array([0, 0]), seed=0)
    with pytest.raises(ValueError, match="responses"):
        deterministic.step(rows, ["Left"], np.ones(2, bool))
