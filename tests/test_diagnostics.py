"""The §7 diagnostics driven by rollouts, with scripted agents of known quality: a Q*-optimal
agent and an epsilon-random one, both reading the state off the prompt. References are
independent: Q* and exact success probabilities by dynamic programming over gymnasium's own
transition table, BFS distances, the rendered text."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from eval_helpers import (
    SYSTEM_BUDGET,
    QStarAgent,
    agent_policy,
    gym_q_star,
    policy_success,
    turns_in,
)

from agentrl_jax.evaluation import stats
from agentrl_jax.evaluation.analyses import continuation
from agentrl_jax.evaluation.analyses.depth import quality_by_depth
from agentrl_jax.evaluation.passt import eval_rollout_config
from agentrl_jax.evaluation.state_prompt import StatePrompt
from agentrl_jax.models.tokenizer import load_tokenizer
from agentrl_jax.prompts import BudgetPrompt
from agentrl_jax.reproduce.studies.frozenlake import diagnostics
from agentrl_jax.reproduce.studies.frozenlake.states import (
    StatePool,
    StateStarts,
    inject_errors,
    maps_at_states,
    matched_pool,
    visited_states,
)
from agentrl_jax.rollout import MultiTurnRollout
from agentrl_jax.sampling import ScriptedPolicy
from envs.frozenlake import grid, qstar
from envs.frozenlake import maps as fl_maps
from envs.frozenlake.text import render
from envs.frozenlake.text_env import FrozenLakeTextConfig, FrozenLakeTextEnv

T_MAX = 12
SUCCESS_RATE = 0.8  # slippery, but the goal is often reachable: informative success rates
G = 16
EPSILON = 0.75
CONFIG = eval_rollout_config(group_size=G, max_response_tokens=16, max_context=2048)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def env():
    maps = fl_maps.generate(jax.random.key(3), 6, size=4, p=0.8)
    return FrozenLakeTextEnv(maps, FrozenLakeTextConfig(t_max=T_MAX, success_rate=SUCCESS_RATE))


@pytest.fixture(scope="module")
def agents():
    """(base, RL): epsilon-random and Q*-optimal scripted agents."""
    return (
        QStarAgent(T_MAX, epsilon=EPSILON, seed=1, success_rate=SUCCESS_RATE),
        QStarAgent(T_MAX, epsilon=0.0, success_rate=SUCCESS_RATE),
    )


@pytest.fixture(scope="module")
def pool(env, tokenizer, agents):
    """24 matched states from 4 trajectories per map of each agent at the full budget."""
    runner = MultiTurnRollout(
        env, tokenizer, dataclasses.replace(CONFIG, group_size=4, budget=T_MAX)
    )
    visits = [
        visited_states(
            runner(ScriptedPolicy(tokenizer, agent), np.arange(6), jax.random.key(k)).trajectory,
            source=k,
        )
        for k, agent in enumerate(agents)
    ]
    return matched_pool(*visits, size=24, seed=0)


class Recorder:
    """A script that records each call's contexts and always moves ``move``."""

    def __init__(self, move: str = "Down"):
        self.calls: list[list[str]] = []
        self.move = move

    def __call__(self, contexts, live):
        self.calls.append([c for c, on in zip(contexts, live) if on])
        return [f"<answer>{self.move}</answer>"] * len(contexts)


# ---------------------------------------------------------------- pools and states


def test_visited_states_and_matched_pool(env, tokenizer, agents):
    runner = MultiTurnRollout(
        env, tokenizer, dataclasses.replace(CONFIG, group_size=2, budget=T_MAX)
    )
    traj = jax.device_get(
        runner(ScriptedPolicy(tokenizer, agents[1]), np.arange(6), jax.random.key(5)).trajectory
    )
    visits = visited_states(traj, source=1)
    assert len(visits) == int(traj.turns_used.sum())
    # Each visit is the cell the turn acted from: the start at t = 0, never a terminal cell.
    starts = visits.turn == 0
    start_cells = np.asarray(grid.start_cell(env.maps))
    np.testing.assert_array_equal(visits.pos[starts], start_cells[visits.task_id[starts]])
    tiles_here = env.maps.reshape(6, -1)[visits.task_id, visits.pos]
    assert not np.any(grid.is_terminal_tile(tiles_here))
    assert np.all(visits.budget == T_MAX) and np.all(visits.source == 1)

    base = dataclasses.replace(visits, source=np.zeros(len(visits), np.int64))
    pool = matched_pool(base, visits.take(np.arange(5)), size=40, seed=0)
    assert len(pool) == 10 and np.array_equal(np.bincount(pool.source), [5, 5])  # balanced
    rows = {tuple(r) for r in np.stack([visits.task_id, visits.pos, visits.turn], 1).tolist()}
    assert {tuple(r) for r in np.stack([pool.task_id, pool.pos, pool.turn], 1).tolist()} <= rows


def test_state_pool_validates():
    with pytest.raises(ValueError, match="0 <= turn < budget"):
        StatePool(*(np.array([v]) for v in (0, 0, 5, 5, -1)))
    with pytest.raises(ValueError, match="one length"):
        StatePool(np.array([0, 1]), *(np.array([v]) for v in (0, 0, 5, -1)))


def test_maps_at_states_keep_the_text_and_the_values(env, pool):
    derived = maps_at_states(env.maps, pool)
    for i in range(len(pool)):
        assert int(grid.start_cell(derived[i])) == pool.pos[i]
        assert render(derived[i], pool.pos[i]) == render(env.maps[pool.task_id[i]], pool.pos[i])
    q_orig = np.asarray(qstar.q_star(env.maps[pool.task_id], T_MAX, success_rate=SUCCESS_RATE))
    np.testing.assert_array_equal(
        np.asarray(qstar.q_star(derived, T_MAX, success_rate=SUCCESS_RATE)), q_orig
    )


def test_state_values_match_gymnasium_dp(env, pool):
    values = diagnostics.state_values(env, pool, gamma=0.95)
    for i in range(len(pool)):
        q = gym_q_star(env.maps[pool.task_id[i]], T_MAX, 0.95, SUCCESS_RATE)
        h = pool.budget[i] - pool.turn[i]
        np.testing.assert_allclose(values.action_values[i], q[h, pool.pos[i]], atol=1e-5)
        np.testing.assert_allclose(
            values.noop_value[i], 0.95 * q[h - 1, pool.pos[i]].max(), atol=1e-5
        )
    actions = np.array([[0, -1, 3]] * len(pool))
    quality = values.quality(actions)
    np.testing.assert_array_equal(quality[:, 0], values.action_values[:, 0])
    np.testing.assert_array_equal(quality[:, 1], values.noop_value)
    assert np.all(values.quality(actions, invalid="zero")[:, 1] == 0)
    with pytest.raises(ValueError, match="invalid"):
        values.quality(actions, invalid="skip")


def test_inject_errors_moves_one_step_further(env, pool):
    errors = inject_errors(env.maps, pool, seed=0)
    dist = np.asarray(qstar.distance_to_goal(env.maps))
    allowed = np.asarray(qstar.error_actions(env.maps[pool.task_id], pool.pos))
    expected = np.flatnonzero(allowed.any(1) & (pool.turn + 1 < pool.budget))
    np.testing.assert_array_equal(errors.origin, expected)
    assert len(errors.states) > 0
    src = pool.take(errors.origin)
    assert allowed[errors.origin, errors.action].all()
    before = dist[src.task_id, src.pos]
    after = dist[errors.states.task_id, errors.states.pos]
    np.testing.assert_array_equal(after, before + 1)  # one move further, never into a hole
    np.testing.assert_array_equal(errors.states.turn, src.turn + 1)
    np.testing.assert_array_equal(errors.states.budget, src.budget)
    np.testing.assert_array_equal(errors.states.source, src.source)


# ---------------------------------------------------------------- what the policy sees


def test_state_prompt_states_turn_t_of_budget_b():
    prompt = StatePrompt.of(BudgetPrompt(), 20)
    assert prompt.turn_text("GRID", budget=7, turn=2) == BudgetPrompt().turn_text("GRID", 20, 15)
    assert prompt.system_text("I", 7) == BudgetPrompt().system_text("I", 20)
    with pytest.raises(ValueError, match="remaining budget 21"):
        prompt.turn_text("GRID", budget=21, turn=0)
    with pytest.raises(ValueError, match="stated_budget"):
        StatePrompt(stated_budget=0)


def test_episodes_start_at_the_state_with_its_turn_in_the_prompt(env, tokenizer, pool):
    starts = StateStarts(env, tokenizer, pool, dataclasses.replace(CONFIG, group_size=2))
    ((budget, index, real),) = starts.calls()
    recorder = Recorder()
    played = starts.play(
        ScriptedPolicy(tokenizer, recorder), jax.random.key(0), first_turn_only=True
    )
    assert len(recorder.calls) == 1 and np.all(played.turns == 1)
    for row, context in enumerate(recorder.calls[0]):
        s = index[row // 2]
        ((b, t, r, text),) = turns_in(context)  # one user message: no earlier history
        assert (b, t, r) == (pool.budget[s], pool.turn[s], pool.budget[s] - pool.turn[s])
        assert SYSTEM_BUDGET.findall(context) == [str(pool.budget[s])]
        assert text == render(env.maps[pool.task_id[s]], pool.pos[s])
    np.testing.assert_array_equal(played.action, np.full((len(pool), 2), grid.DOWN))

    recorder = Recorder("Up")
    played = starts.play(
        ScriptedPolicy(tokenizer, recorder), jax.random.key(0), first_turn_only=False
    )
    remaining = (pool.budget - pool.turn)[:, None]
    assert np.all(played.turns <= remaining) and np.any(played.turns > 1)
    assert not played.overflow.any()
    for contexts in recorder.calls:
        for context in contexts:
            messages = turns_in(context)
            b, t0, _, _ = messages[0]
            for k, (bk, tk, rk, _) in enumerate(messages):  # turns advance from the state's t
                assert (bk, tk, rk) == (b, t0 + k, b - t0 - k)


def test_a_prompt_that_does_not_fit_is_an_error(env, tokenizer, pool):
    starts = StateStarts(env, tokenizer, pool, dataclasses.replace(CONFIG, max_context=64))
    with pytest.raises(ValueError, match="does not fit max_context=64"):
        starts.play(ScriptedPolicy(tokenizer, Recorder()), jax.random.key(0), first_turn_only=True)


def test_states_per_call_pads_every_call_to_one_shape(env, tokenizer, pool):
    starts = StateStarts(
        env, tokenizer, pool, dataclasses.replace(CONFIG, group_size=2), states_per_call=10
    )
    calls = starts.calls()
    assert [len(i) for _, i, _ in calls] == [10, 10, 10] and [r for *_, r in calls] == [10, 10, 4]
    whole = StateStarts(env, tokenizer, pool, dataclasses.replace(CONFIG, group_size=2))
    policy = ScriptedPolicy(tokenizer, QStarAgent(T_MAX, success_rate=SUCCESS_RATE))
    a = starts.play(policy, jax.random.key(0), first_turn_only=True)
    b = whole.play(policy, jax.random.key(0), first_turn_only=True)
    np.testing.assert_array_equal(a.action, b.action)  # the optimal agent is deterministic


# ---------------------------------------------------------------- known-quality policies


@pytest.fixture(scope="module")
def step_result(env, tokenizer, pool, agents):
    values = diagnostics.state_values(env, pool)
    starts = StateStarts(env, tokenizer, pool, CONFIG)
    base, rl = (ScriptedPolicy(tokenizer, a) for a in agents)
    return diagnostics.step_quality(starts, values, base, rl, jax.random.key(1))


def test_optimal_agent_is_better_on_almost_every_state(step_result):
    result = step_result
    best = result.values.action_values.max(axis=1)
    np.testing.assert_allclose(result.quality["RL"], best, atol=1e-6)  # every sample optimal
    differ = result.comparison(informative_only=True)
    assert result.informative.sum() >= 12
    assert differ.share_rl_better >= 0.95 and differ.share_base_better == 0.0
    assert result.comparison().share_base_better == 0.0
    assert differ.mean_diff.low > 0
    # The epsilon-random agent's mean quality matches its exact distribution: a z-test of the
    # summed deviations with the exactly known variance of a mean of G draws.
    v = result.values.action_values
    probs = EPSILON / 4 + (1 - EPSILON) * np.eye(4)[v.argmax(1)]
    mean = (probs * v).sum(1)
    var = (probs * v**2).sum(1) - mean**2
    z = (result.quality["base"] - mean).sum() / np.sqrt((var / G).sum())
    assert abs(z) < 4, z
    assert result.invalid_share() == {"base": 0.0, "RL": 0.0}
    pools = result.pools()
    assert set(pools) <= {"all", "actions_differ"} and len(pools["all"][0]) == len(result.pool)


def test_quality_by_depth(step_result):
    depth, curves = quality_by_depth(step_result, T_MAX)
    np.testing.assert_allclose(depth, step_result.pool.turn / T_MAX)
    np.testing.assert_allclose(curves["RL - base"], curves["RL"] - curves["base"])


def test_error_states_recover_the_exact_continuation_success(env, tokenizer, pool, agents):
    errors = inject_errors(env.maps, pool, seed=0)
    values = diagnostics.state_values(env, errors.states)
    starts = StateStarts(env, tokenizer, errors.states, CONFIG)
    base, rl = (ScriptedPolicy(tokenizer, a) for a in agents)
    result = diagnostics.error_state_analysis(starts, errors, values, base, rl, jax.random.key(2))

    continuation = result.continuation()
    states = errors.states
    exact = {}
    for name, epsilon in (("base", EPSILON), ("RL", 0.0)):
        per_state = []
        for i in range(len(states)):
            tiles = env.maps[states.task_id[i]]
            q = np.asarray(qstar.q_star(tiles, T_MAX, gamma=0.95, success_rate=SUCCESS_RATE))
            success = policy_success(tiles, agent_policy(q, epsilon), T_MAX, SUCCESS_RATE)
            per_state.append(success[states.budget[i] - states.turn[i], states.pos[i]])
        exact[name] = np.mean(per_state)  # each state has G continuations: equal weights
        rate = continuation[name]
        assert rate.n == len(states) * G
        assert rate.low <= exact[name] <= rate.high, (name, rate, exact[name])
    # Informative: the two known rates are far apart, and the intervals tell them apart.
    assert exact["RL"] > 0.4 and exact["base"] < exact["RL"] - 0.3
    assert continuation["base"].high < continuation["RL"].low
    assert not np.any(result.overflow["RL"]) and not np.any(result.overflow["base"])
    differ = result.quality.comparison(informative_only=True)
    assert differ.share_rl_better >= 0.95 and differ.share_base_better == 0.0
    summary = result.summary()
    assert summary["error_states"] == len(states)


def test_error_state_analysis_checks_its_inputs(env, tokenizer, pool, agents):
    errors = inject_errors(env.maps, pool, seed=0)
    starts = StateStarts(env, tokenizer, pool, CONFIG)
    policy = ScriptedPolicy(tokenizer, agents[1])
    with pytest.raises(ValueError, match="not built on"):
        diagnostics.error_state_analysis(
            starts,
            errors,
            diagnostics.state_values(env, errors.states),
            policy,
            policy,
            jax.random.key(0),
        )
    with pytest.raises(ValueError, match="two distinct"):
        diagnostics.step_quality(
            starts,
            diagnostics.state_values(env, pool),
            policy,
            policy,
            jax.random.key(0),
            names=("a", "a"),
        )


def test_continuation_rates_at_zero_and_one_plot(tmp_path):
    """All-failed or all-succeeded continuations: the Wilson interval must bracket the rate (at
    n = 10 rounding once put its lower bound 2.8e-17 above 0, which broke the error bars)."""
    for n in (4, 10, 1000):
        for p in (0.0, 1.0):
            ci = stats.proportion_ci_wilson(np.full(n, p))
            assert ci.low <= ci.mean == p <= ci.high
    section = continuation.section(
        tmp_path, continuation.compute({"base": np.zeros((5, 2)), "RL": np.ones((5, 2))})
    )
    assert (tmp_path / section.figures[0]).read_bytes()[:4] == b"\x89PNG"
