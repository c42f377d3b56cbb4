"""BudgetMix budget sets, sampling, sharing, the adaptive filter and timeout rewards."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax.algorithms import budgetmix as bm


def test_budget_sets_of_the_papers_environments():
    # (k * T_max) // 10 for k = 1..10, zero dropped, duplicates merged
    assert bm.budget_set(70) == (7, 14, 21, 28, 35, 42, 49, 56, 63, 70)  # FrozenLake
    assert bm.budget_set(10) == (1, 2, 3, 4, 5, 6, 7, 8, 9, 10)  # DeepCoder-MT, InterCode-SQL
    assert bm.budget_set(24) == (
        2,
        4,
        7,
        9,
        12,
        14,
        16,
        19,
        21,
        24,
    )  # BFCL: 2.4 -> 2, 7.2 -> 7, ...
    assert bm.budget_set(5) == (1, 2, 3, 4, 5)  # 0, 1, 1, 2, 2, ... merged
    assert bm.budget_set(3) == (1, 2, 3)  # k=1..3 give 0 (dropped)
    assert bm.budget_set(1) == (1,)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "70"])
def test_budget_set_rejects_bad_t_max(bad):
    with pytest.raises(ValueError, match="t_max"):
        bm.budget_set(bad)


def test_jittable_candidates_equal_the_python_sets():
    t_max = np.arange(1, 101)
    budgets, valid = jax.jit(bm.budget_candidates)(jnp.asarray(t_max))
    for row, t in enumerate(t_max):
        assert tuple(
            int(b) for b in np.asarray(budgets[row])[np.asarray(valid[row])]
        ) == bm.budget_set(int(t))


def test_sampling_is_uniform_over_the_set_and_reproducible():
    k = 20_000
    draw = bm.sample_budgets(jax.random.key(0), jnp.full(k, 5))
    counts = np.bincount(np.asarray(draw.budgets), minlength=6)
    assert counts[0] == 0 and counts.sum() == k
    # each of 1..5 has p = 0.2: mean 4000, sd sqrt(20000 * 0.2 * 0.8) = 56.6; allow 5 sd
    assert np.all(np.abs(counts[1:] - 4000) < 5 * 56.6), counts
    assert not np.any(draw.fell_back)
    again = bm.sample_budgets(jax.random.key(0), jnp.full(k, 5))
    np.testing.assert_array_equal(draw.budgets, again.budgets)
    other = bm.sample_budgets(jax.random.key(1), jnp.full(k, 5))
    assert np.any(np.asarray(draw.budgets) != np.asarray(other.budgets))


def test_groups_draw_independently_from_their_own_sets():
    t_max = jnp.array([70, 10, 24, 1] * 500)
    draw = bm.sample_budgets(jax.random.key(2), t_max)
    budgets = np.asarray(draw.budgets)
    for j, t in enumerate([70, 10, 24, 1]):
        drawn = set(budgets[j::4].tolist())
        assert drawn == set(bm.budget_set(t)), (
            t,
            drawn,
        )  # every member seen in 500 draws, nothing else


def test_trajectories_share_their_groups_budget():
    group_budgets = jnp.array([7, 63, 21])
    group_index = jnp.array([0, 0, 1, 1, 2, 2, 1])  # G = 2 per task, plus one out of order
    np.testing.assert_array_equal(
        bm.budgets_per_trajectory(group_budgets, group_index), [7, 7, 63, 63, 21, 21, 63]
    )


def test_adaptive_filter_drops_budgets_below_the_structural_bound():
    # T_max = 10, shortest path 7 -> only {7, 8, 9, 10} remain
    draw = bm.sample_budgets(
        jax.random.key(3), jnp.full(2000, 10), structural_bound=jnp.full(2000, 7)
    )
    assert set(np.asarray(draw.budgets).tolist()) == {7, 8, 9, 10}
    assert not np.any(draw.fell_back)
    # bound 0 or 1 removes nothing
    loose = bm.sample_budgets(
        jax.random.key(3), jnp.full(2000, 10), structural_bound=jnp.ones(2000, jnp.int32)
    )
    assert set(np.asarray(loose.budgets).tolist()) == set(range(1, 11))


def test_adaptive_fallback_uses_t_max_and_flags_the_group():
    # bound above every budget (11 > T_max = 10, or unsolvable): fall back to T_max = 10
    t_max = jnp.array([10, 10, 70])
    bound = jnp.array([11, 10, 2**30])
    draw = bm.sample_budgets(jax.random.key(4), t_max, structural_bound=bound)
    np.testing.assert_array_equal(draw.budgets, [10, 10, 70])
    np.testing.assert_array_equal(draw.fell_back, [True, False, True])
    with pytest.raises(ValueError, match="structural_bound"):
        bm.sample_budgets(jax.random.key(4), t_max, structural_bound=jnp.array([1, 2]))


def test_sample_budgets_traces_once():
    fn = jax.jit(chex.assert_max_traces(bm.sample_budgets, n=1))
    for seed in range(3):
        fn(jax.random.key(seed), jnp.array([70, 10]), jnp.array([3, 4]))


def test_timeout_reward():
    # budget 4: success at turn 3 keeps its reward; success at turn 5 (past B) and failure get 0
    rewards = jnp.array([1.0, 1.0, 0.0, 1.0])
    succeeded = jnp.array([True, True, False, True])
    turns_used = jnp.array([3, 5, 4, 4])
    budgets = jnp.array([4, 4, 4, 4])
    np.testing.assert_array_equal(
        bm.timeout_reward(rewards, succeeded, turns_used, budgets), [1, 0, 0, 1]
    )


def test_remaining_budget_and_anchor_keys():
    np.testing.assert_array_equal(bm.remaining_budget(jnp.array([3, 7]), 3), [[3, 2, 1], [7, 6, 5]])
    keys = bm.budget_anchor_keys(jnp.array([[4, 9, 9]], jnp.uint32), jnp.array([7]))
    assert keys.shape == (1, 3, 2) and keys.dtype == jnp.int32
    np.testing.assert_array_equal(keys[0], [[4, 7], [9, 6], [9, 5]])
    with pytest.raises(ValueError, match="budget_anchor_keys"):
        bm.budget_anchor_keys(jnp.zeros((2, 3), jnp.int32), jnp.zeros(3, jnp.int32))
