"""Pass@K / Pass@T sampled by rollouts: every budget is a fresh rollout whose prompts state that
budget (checked on the contexts a stub policy receives), success counts against exact
references (structural bound on deterministic maps, DP success probability on slippery ones)."""

from __future__ import annotations

import collections

import jax
import numpy as np
import pytest
from eval_helpers import SYSTEM_BUDGET, QStarAgent, turns_in

from agentrl_jax.evaluation import passk, passt
from agentrl_jax.models.tokenizer import load_tokenizer
from agentrl_jax.sampling import ScriptedPolicy
from envs.frozenlake import grid, optimal, qstar
from envs.frozenlake import maps as fl_maps
from envs.frozenlake.text_env import FrozenLakeTextConfig, FrozenLakeTextEnv

CONFIG = passt.eval_rollout_config(max_response_tokens=16, max_context=2048)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def maps():
    """8 maps with random start and goal cells: shortest paths 1..8."""
    return np.asarray(
        fl_maps.generate(jax.random.key(11), 8, size=4, p=0.75, random_start_goal=True)
    )


class RecordingPolicy:
    """A policy that records the contexts of every ``start`` (one per rollout call) and every
    ``respond``, and delegates to a scripted policy."""

    def __init__(self, tokenizer, script):
        self.inner = ScriptedPolicy(tokenizer, script)
        self.tokenizer = tokenizer
        self.starts: list[list[str]] = []

    def start(self, contexts, settings):
        self.starts.append([self.tokenizer.decode(list(c)) for c in contexts])
        self.inner.start(contexts, settings)

    def extend(self, chunks):
        self.inner.extend(chunks)

    def respond(self, live, max_tokens, key):
        return self.inner.respond(live, max_tokens, key)


def test_each_budget_is_a_fresh_rollout_whose_prompts_state_it(tokenizer, maps):
    env = FrozenLakeTextEnv(maps, FrozenLakeTextConfig(t_max=10))
    agent = QStarAgent(10)
    policy = RecordingPolicy(tokenizer, agent)
    budgets = (3, 6, 10)
    results = passt.pass_at_t_results(
        env,
        tokenizer,
        policy,
        np.arange(8),
        jax.random.key(0),
        budgets=budgets,
        samples=2,
        config=CONFIG,
        tasks_per_call=3,
    )
    assert sorted(results) == list(budgets)
    # 3 calls of 3 tasks (the last padded) per budget, in increasing budget order.
    assert len(policy.starts) == 9
    for i, contexts in enumerate(policy.starts):
        budget = budgets[i // 3]
        assert len(contexts) == 6  # 3 tasks x 2 samples, every call the same shape
        for context in contexts:
            assert SYSTEM_BUDGET.findall(context) == [str(budget)]
            assert [m[:3] for m in turns_in(context)] == [(budget, 0, budget)]
    # Every context any turn of budget T showed states T, and turns never exceed T.
    by_budget = collections.defaultdict(set)
    for context in agent.contexts:
        b = {m[0] for m in turns_in(context)}
        assert len(b) == 1
        b = b.pop()
        by_budget[b].add(len(turns_in(context)))
        assert SYSTEM_BUDGET.findall(context) == [str(b)]
    assert set(by_budget) == set(budgets)
    assert all(max(lengths) <= b for b, lengths in by_budget.items())
    for _budget, (n, c) in results.items():
        assert np.all(n == 2) and n.shape == (8,) and np.all((0 <= c) & (c <= 2))


def test_deterministic_optimal_agent_meets_the_structural_bound(tokenizer, maps):
    env = FrozenLakeTextEnv(maps, FrozenLakeTextConfig(t_max=10, is_slippery=False))
    budgets = passt.default_budgets(10)
    results = passt.pass_at_t_results(
        env,
        tokenizer,
        ScriptedPolicy(tokenizer, QStarAgent(10, is_slippery=False)),
        np.arange(8),
        jax.random.key(0),
        budgets=budgets,
        samples=1,
        config=CONFIG,
    )
    _, curve = passk.pass_at_t_curve(results, k=1)
    bound_budgets, bound = passt.structural_bound(
        env.structural_bounds(np.arange(len(maps))), budgets
    )
    np.testing.assert_array_equal(bound_budgets, budgets)
    np.testing.assert_array_equal(curve, bound)  # success exactly when shortest path <= T
    assert len(np.unique(bound)) >= 5  # not vacuous: the budget decides on many maps


def test_pass_at_k_success_rate_matches_the_exact_optimum(tokenizer, maps):
    """Slippery maps, the gamma = 1 Q*-greedy agent: its success rate at budget T is the exact
    optimal success probability V*(T, start)."""
    env = FrozenLakeTextEnv(maps, FrozenLakeTextConfig(t_max=8))
    agent = QStarAgent(8, gamma=1.0)
    results = passt.pass_at_k_results(
        env,
        tokenizer,
        ScriptedPolicy(tokenizer, agent),
        np.arange(8),
        jax.random.key(1),
        samples=32,
        config=CONFIG,
    )
    ((budget, (n, c)),) = results.items()
    assert budget == 8 and np.all(n == 32)
    q = qstar.q_star(maps, 8, gamma=1.0)
    exact = np.asarray(optimal.success_probability(q, maps, 8))
    # Per-task binomial counts: a z-test of the total with the exactly known variance.
    z = (c.sum() - (n * exact).sum()) / np.sqrt((n * exact * (1 - exact)).sum())
    assert abs(z) < 4, z
    curve = passk.pass_at_k_curve(n, c, ks=[1, 8, 32])
    assert np.all(np.diff(curve) >= 0)


def test_tasks_per_call_pads_without_changing_results(tokenizer, maps):
    env = FrozenLakeTextEnv(maps, FrozenLakeTextConfig(t_max=6, is_slippery=False))
    policy = ScriptedPolicy(tokenizer, QStarAgent(6, is_slippery=False))
    whole = passt.sample_successes(
        env, tokenizer, policy, np.arange(8), jax.random.key(0), budget=6, samples=2, config=CONFIG
    )
    chunked = passt.sample_successes(
        env,
        tokenizer,
        policy,
        np.arange(8),
        jax.random.key(0),
        budget=6,
        samples=2,
        config=CONFIG,
        tasks_per_call=5,
    )
    assert whole.shape == (8, 2)
    np.testing.assert_array_equal(whole, chunked)
    traj = passt.rollout_tasks(
        env,
        tokenizer,
        policy,
        np.arange(8),
        jax.random.key(0),
        budget=6,
        samples=2,
        config=CONFIG,
        tasks_per_call=5,
    )
    assert traj.tokens.shape[0] == 16 and traj.turn_mask.shape == (16, 6)
    np.testing.assert_array_equal(traj.task_id, np.repeat(np.arange(8), 2))
    np.testing.assert_array_equal(traj.success.reshape(8, 2), chunked)


def test_defaults_and_errors(tokenizer, maps):
    assert passt.EVAL_SAMPLING.temperature == 0.6 and passt.EVAL_SAMPLING.top_p == 0.9
    assert passt.eval_rollout_config().sampling == passt.EVAL_SAMPLING
    assert passt.default_budgets(70) == (7, 14, 17, 21, 28, 35, 42, 49, 52, 56, 63, 70)
    assert passt.default_budgets(4) == (1, 2, 3, 4)
    env = FrozenLakeTextEnv(maps, FrozenLakeTextConfig(t_max=6))
    policy = ScriptedPolicy(tokenizer, QStarAgent(6))
    with pytest.raises(ValueError, match="t_max=6"):
        passt.pass_at_t_results(
            env, tokenizer, policy, np.arange(2), jax.random.key(0), budgets=[7]
        )
    with pytest.raises(ValueError, match="task_ids"):
        passt.sample_successes(
            env, tokenizer, policy, np.array([8]), jax.random.key(0), budget=2, samples=1
        )
    with pytest.raises(ValueError, match="tasks_per_call"):
        passt.sample_successes(
            env,
            tokenizer,
            policy,
            np.arange(2),
            jax.random.key(0),
            budget=2,
            samples=1,
            tasks_per_call=0,
        )
    with pytest.raises(ValueError, match="samples"):
        passt.sample_successes(
            env, tokenizer, policy, np.arange(2), jax.random.key(0), budget=2, samples=0
        )


def test_shortest_paths_against_a_python_bfs(maps):
    def bfs(tiles):
        n = tiles.shape[0]
        start = int(np.flatnonzero(tiles.reshape(-1) == grid.START)[0])
        seen, frontier, steps = {start}, [start], 0
        while frontier:
            if any(tiles.reshape(-1)[c] == grid.GOAL for c in frontier):
                return steps
            nxt = []
            for c in frontier:
                for a in range(4):
                    m = int(grid.move(c, a, n))
                    if m not in seen and tiles.reshape(-1)[m] != grid.HOLE:
                        seen.add(m)
                        nxt.append(m)
            frontier, steps = nxt, steps + 1
        return np.inf

    blocked = np.full((4, 4), grid.HOLE, np.int8)
    blocked.reshape(-1)[[0, 15]] = grid.START, grid.GOAL  # no path
    tiles = np.concatenate([maps, blocked[None]])
    reference = np.array([bfs(t) for t in tiles])
    env = FrozenLakeTextEnv(tiles, FrozenLakeTextConfig(t_max=10))
    paths = env.structural_bounds(np.arange(len(tiles)))
    np.testing.assert_array_equal(paths[:-1], reference[:-1])
    assert paths[-1] > 100  # unreachable: above any budget
    budgets, share = passt.structural_bound(paths, [4, 1, 100])
    np.testing.assert_array_equal(budgets, [1, 4, 100])
    np.testing.assert_allclose(share, [np.mean(reference <= b) for b in (1, 4, 100)])
    assert share[-1] == 8 / 9
