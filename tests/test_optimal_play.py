"""Optimal play under a budget: the DP success probability vs independent references."""

import json

import jax
import numpy as np
from typer.testing import CliRunner

from agentrl_jax.cli import app
from envs.frozenlake import env as fl_env
from envs.frozenlake import maps as fl_maps
from envs.frozenlake import optimal, qstar


def _play_all(tiles, q, budget, params, episodes, t_max, seed=0):
    play = jax.jit(
        jax.vmap(
            jax.vmap(optimal.play_greedy, in_axes=(0, None, None, None, None, None)),
            in_axes=(0, 0, 0, None, None, None),
        ),
        static_argnums=(5,),
    )
    keys = jax.random.split(jax.random.key(seed), tiles.shape[0] * episodes)
    return play(keys.reshape(tiles.shape[0], episodes), tiles, q, budget, params, t_max)


def test_deterministic_success_is_the_structural_bound():
    # Without slips, the goal is reachable within B moves iff the BFS shortest path is <= B.
    # With gamma = 1 every in-budget path is worth 1; with gamma < 1 the greedy episode takes
    # exactly the shortest path.
    tiles = fl_maps.generate(jax.random.key(1), 32, size=6, p=0.7)
    t_max = 20
    q = qstar.q_star(tiles, t_max, gamma=1.0, is_slippery=False)
    q_discounted = qstar.q_star(tiles, t_max, gamma=0.95, is_slippery=False)
    shortest = np.asarray(qstar.shortest_path_length(tiles))
    params = fl_env.make_params(tiles, is_slippery=False, max_steps=None)
    for budget in (5, 8, 10, 20):
        exact = np.asarray(optimal.success_probability(q, tiles, budget))
        np.testing.assert_array_equal(exact, (shortest <= budget).astype(np.float32))
        success, turns, _, _ = _play_all(tiles, q, budget, params, 1, t_max)
        np.testing.assert_array_equal(success[:, 0], shortest <= budget)
        assert np.all(np.asarray(turns) <= budget)
        success, turns, _, _ = _play_all(tiles, q_discounted, budget, params, 1, t_max)
        np.testing.assert_array_equal(success[:, 0], shortest <= budget)
        np.testing.assert_array_equal(
            np.asarray(turns)[:, 0][shortest <= budget], shortest[shortest <= budget]
        )


def test_slippery_greedy_episodes_match_the_dp_probability():
    # The Q*-greedy policy (gamma = 1, remaining budget) attains V[B, start] in expectation.
    tiles = fl_maps.generate(jax.random.key(2), 16, size=6, p=0.8)
    t_max, episodes = 30, 400
    q = qstar.q_star(tiles, t_max, gamma=1.0, is_slippery=True)
    params = fl_env.make_params(tiles, is_slippery=True, max_steps=None)
    for budget in (12, 30):
        exact = np.asarray(optimal.success_probability(q, tiles, budget))
        success, turns, _, _ = _play_all(tiles, q, budget, params, episodes, t_max, seed=budget)
        rate = np.asarray(success).mean(axis=1)
        sigma = np.sqrt(np.maximum(exact * (1 - exact), 1e-4) / episodes)
        assert np.all(np.abs(rate - exact) <= 5 * sigma + 1e-6), (rate, exact)
        assert np.all(np.asarray(turns) <= budget)


def test_solve_cli_reports_consistent_numbers(tmp_path):
    out = tmp_path / "solve.json"
    result = CliRunner().invoke(
        app,
        [
            "solve",
            "frozenlake",
            "--maps",
            "8",
            "--size",
            "5",
            "--t-max",
            "20",
            "--episodes",
            "32",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "Q*-greedy play with budget 20" in result.output
    rows = json.loads(out.read_text())["budgets"]
    assert [r["budget"] for r in rows] == [5, 10, 15, 20]
    for r in rows:
        # Optimal success can never beat the structural bound (§2: a necessary condition).
        assert r["optimal_success_exact"] <= r["structural_bound"] + 1e-6
        low, high = r["greedy_success_ci"]
        assert low - 0.05 <= r["optimal_success_exact"] <= high + 0.05
