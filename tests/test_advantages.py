"""Advantage estimators against hand-computed numbers and plain Python references."""

from collections import defaultdict

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax.algorithms import advantages as adv
from agentrl_jax.algorithms.budgetmix import budget_anchor_keys

SQRT_HALF = np.sqrt(0.5)  # 0.70711


# ------------------------------------------------------------------------- references


def grpo_reference(rewards, group_ids, traj_mask, *, eps=1e-6, ddof=1, scale_by_std=True):
    """Plain loop: verl's formula, except that a group of one gets 0."""
    out = np.zeros(len(rewards))
    members = defaultdict(list)
    for i, g in enumerate(group_ids):
        if traj_mask[i]:
            members[g].append(i)
    for idx in members.values():
        r = np.asarray([rewards[i] for i in idx], np.float64)
        if len(idx) == 1:
            continue
        centered = r - r.mean()
        out[idx] = centered / (r.std(ddof=ddof) + eps) if scale_by_std else centered
    return out


def returns_reference(rewards, mask, gamma):
    out = np.zeros_like(rewards, dtype=np.float64)
    for i in range(rewards.shape[0]):
        g = 0.0
        for t in reversed(range(rewards.shape[1])):
            if mask[i, t]:
                g = rewards[i, t] + gamma * g
                out[i, t] = g
    return out


def gigpo_step_reference(step_rewards, group_ids, keys, turn_mask, traj_mask, gamma, eps=1e-6):
    valid = turn_mask & traj_mask[:, None]
    returns = returns_reference(step_rewards, valid, gamma)
    anchors = defaultdict(list)
    n, t = step_rewards.shape
    for i in range(n):
        for s in range(t):
            if valid[i, s]:
                anchors[(group_ids[i], keys[i, s])].append((i, s))
    out = np.zeros((n, t))
    for cells in anchors.values():
        if len(cells) < 2:
            continue
        g = np.asarray([returns[c] for c in cells])
        for c, a in zip(cells, (g - g.mean()) / (g.std(ddof=1) + eps)):
            out[c] = a
    return out


def gae_reference(rewards, values, mask, gamma, lam):
    """Textbook GAE on the subsequence of masked-in positions of each row."""
    adv_out = np.zeros_like(rewards, dtype=np.float64)
    for i in range(rewards.shape[0]):
        pos = [p for p in range(rewards.shape[1]) if mask[i, p]]
        last = 0.0
        for k in reversed(range(len(pos))):
            p = pos[k]
            next_v = values[i, pos[k + 1]] if k + 1 < len(pos) else 0.0
            last = rewards[i, p] + gamma * next_v - values[i, p] + gamma * lam * last
            adv_out[i, p] = last
    return adv_out, np.where(mask, adv_out + values, 0.0)


# ------------------------------------------------------------------------- GRPO


def test_grpo_hand_computed():
    # group 7: R = [1, 0, 1], mean 2/3, deviations [1/3, -2/3, 1/3];
    #   ddof=1: var = (1/9 + 4/9 + 1/9) / 2 = 1/3, std = 0.57735 -> A = [0.57735, -1.1547, 0.57735]
    # group -3: R = [1, 0] interleaved with group 7: mean 0.5, std(ddof=1) = sqrt(0.5)
    #   -> A = +-0.70711
    # group 42: a single trajectory -> 0; the masked row (reward 100) enters no statistic.
    rewards = jnp.array([1.0, 1.0, 0.0, 0.0, 1.0, 2.0, 100.0])
    groups = jnp.array([7, -3, 7, -3, 7, 42, 7])
    mask = jnp.array([True, True, True, True, True, True, False])
    got = adv.grpo_advantages(rewards, groups, mask)
    want = [0.57735, SQRT_HALF, -1.1547, -SQRT_HALF, 0.57735, 0.0, 0.0]
    np.testing.assert_allclose(got, want, atol=1e-5)

    # ddof=0: std of [1, 0, 1] = sqrt(2/9) = 0.47140 -> A = (1/3) / 0.4714 = 0.70711, -1.41421
    got0 = adv.grpo_advantages(rewards, groups, mask, ddof=0)
    np.testing.assert_allclose(np.asarray(got0)[[0, 2]], [SQRT_HALF, -np.sqrt(2)], atol=1e-5)
    # mean-only: the raw deviations
    got_mean = adv.grpo_advantages(rewards, groups, mask, scale_by_std=False)
    np.testing.assert_allclose(got_mean, [1 / 3, 0.5, -2 / 3, -0.5, 1 / 3, 0, 0], atol=1e-6)


def test_grpo_equal_rewards_give_zero_not_nan():
    got = adv.grpo_advantages(jnp.ones(4), jnp.zeros(4, jnp.int32))
    np.testing.assert_array_equal(got, np.zeros(4))


@pytest.mark.parametrize("ddof,scale", [(1, True), (0, True), (1, False)])
def test_grpo_matches_python_reference(ddof, scale):
    rng = np.random.default_rng(0)
    n = 40
    rewards = rng.normal(size=n).astype(np.float32)
    groups = rng.choice([3, 11, -5, 1000, 2**30], size=n)  # sparse, unsorted ids
    mask = rng.random(n) > 0.2
    got = adv.grpo_advantages(
        jnp.asarray(rewards),
        jnp.asarray(groups, jnp.int32),
        jnp.asarray(mask),
        ddof=ddof,
        scale_by_std=scale,
    )
    want = grpo_reference(rewards, groups, mask, ddof=ddof, scale_by_std=scale)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_grpo_traces_once_per_shape():
    fn = jax.jit(chex.assert_max_traces(adv.grpo_advantages, n=1))
    for seed in range(3):
        r = jax.random.normal(jax.random.key(seed), (16,))
        fn(r, jnp.arange(16) // 4, jnp.ones(16, bool))


# ------------------------------------------------------------------------- Dr. GRPO, RLOO


def _loo_example():
    # group 5: R = [1, 0, 1, 1] plus a masked row (reward 100, no one's baseline);
    # group -1: R = [2, 5]; group 9: a single trajectory; group 4: three equal returns 0.9025.
    rewards = jnp.array([1.0, 2.0, 0.0, 100.0, 1.0, 7.0, 5.0, 1.0, 0.9025, 0.9025, 0.9025])
    groups = jnp.array([5, -1, 5, 5, 5, 9, -1, 5, 4, 4, 4])
    mask = jnp.array([True, True, True, False, True, True, True, True, True, True, True])
    return rewards, groups, mask


def test_rloo_hand_computed():
    rewards, groups, mask = _loo_example()
    got = adv.rloo_advantages(rewards, groups, mask)
    # group 5: a success's other three are [0, 1, 1] -> baseline 2/3 -> A = 1/3;
    #          the failure's others are [1, 1, 1] -> baseline 1 -> A = -1
    # group -1: 2 - 5 = -3 and 5 - 2 = 3; group 9 (alone) and the masked row: 0;
    # group 4: ties, exactly 0
    want = [1 / 3, -3.0, -1.0, 0.0, 1 / 3, 0.0, 3.0, 1 / 3, 0.0, 0.0, 0.0]
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert np.all(np.asarray(got)[8:] == 0.0)


def test_dr_grpo_hand_computed():
    rewards, groups, mask = _loo_example()
    got = adv.dr_grpo_advantages(rewards, groups, mask)
    # group 5: mean 3/4 -> [1/4, -3/4, 1/4, 1/4]; group -1: mean 3.5 -> [-1.5, 1.5]; no std division
    want = [0.25, -1.5, -0.75, 0.0, 0.25, 0.0, 1.5, 0.25, 0.0, 0.0, 0.0]
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert np.all(np.asarray(got)[8:] == 0.0)
    # RLOO is Dr. GRPO scaled by n / (n - 1): 4/3 for group 5, 2 for group -1
    np.testing.assert_allclose(
        adv.rloo_advantages(rewards, groups, mask),
        np.asarray(got) * np.array([4 / 3, 2, 4 / 3, 0, 4 / 3, 0, 2, 4 / 3, 0, 0, 0]),
        atol=1e-6,
    )


def test_rloo_and_dr_grpo_are_jittable_and_trace_once():
    for fn in (adv.rloo_advantages, adv.dr_grpo_advantages):
        counted = jax.jit(chex.assert_max_traces(fn, n=1))
        for seed in range(3):
            r = jax.random.normal(jax.random.key(seed), (16,))
            counted(r, jnp.arange(16) // 4, jnp.ones(16, bool))


# ------------------------------------------------------------------------- GiGPO


def _gigpo_example():
    """Task group 0: trajectories 0 and 1; task group 1: trajectory 2 and a padded row 3."""
    keys = jnp.array(
        [
            [10, 20, 30],
            [10, 20, 20],  # revisits state 20
            [10, 10, 10],  # revisits state 10; turn 2 is padding
            [10, 10, 10],
        ]
    )  # padded row
    step_rewards = jnp.array([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 100.0], [5.0, 5.0, 5.0]])
    turn_mask = jnp.array([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1]], bool)
    traj_mask = jnp.array([True, True, True, False])
    groups = jnp.array([0, 0, 1, 1])
    return keys, step_rewards, turn_mask, traj_mask, groups


def test_gigpo_step_advantage_hand_computed():
    keys, step_rewards, turn_mask, traj_mask, groups = _gigpo_example()
    # gamma = 0.5. Returns-to-go: traj 0: [0.25, 0.5, 1]; traj 1: [0, 0, 0];
    #   traj 2: [0.5, 1] (padding skipped).
    # Group 0, key 10: {0.25, 0} mean 0.125, std(ddof=1) = 0.17678 -> +-0.70711
    # Group 0, key 20: {0.5 (traj 0), 0, 0 (traj 1 twice)} mean 1/6, deviations [1/3, -1/6, -1/6],
    #   var = (1/9 + 1/36 + 1/36) / 2 = 1/12, std = 0.28868 -> [1.1547, -0.57735, -0.57735]
    # Group 0, key 30: singleton -> 0
    # Group 1, key 10: traj 2 twice {0.5, 1}: mean 0.75, std = 0.35355 -> [-0.70711, 0.70711];
    #   the padded turn and the padded row do not join it.
    got = adv.gigpo_step_advantages(step_rewards, groups, keys, turn_mask, traj_mask, gamma=0.5)
    want = [
        [SQRT_HALF, 1.1547, 0.0],
        [-SQRT_HALF, -0.57735, -0.57735],
        [-SQRT_HALF, SQRT_HALF, 0.0],
        [0.0, 0.0, 0.0],
    ]
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_gigpo_combined_hand_computed():
    keys, step_rewards, turn_mask, traj_mask, groups = _gigpo_example()
    rewards = jnp.array([1.0, 0.0, 1.0, 0.0])
    # Episode advantages: group 0 R = [1, 0] -> +-0.70711; group 1 has one real trajectory -> 0.
    # A = A^E + omega * A^S with omega = 2:
    got = adv.gigpo_advantages(
        rewards, step_rewards, groups, keys, turn_mask, traj_mask, omega=2.0, gamma=0.5
    )
    want = [
        [SQRT_HALF + 2 * SQRT_HALF, SQRT_HALF + 2 * 1.1547, SQRT_HALF],
        [-SQRT_HALF - 2 * SQRT_HALF, -SQRT_HALF - 2 * 0.57735, -SQRT_HALF - 2 * 0.57735],
        [-2 * SQRT_HALF, 2 * SQRT_HALF, 0.0],
        [0.0, 0.0, 0.0],
    ]
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_gigpo_budget_anchor_separates_same_state_at_different_remaining_budget():
    # Both trajectories (one task group, shared budget B = 4) visit state 5, at turns 0 and 1.
    # By state alone they share an anchor: returns (gamma 0.5) traj 0 [0.5, 1], traj 1 [0, 0];
    #   state 5 = {0.5 (t=0, traj 0), 0 (t=1, traj 1)} -> +-0.70711; state 6 (traj 0, t=1) and
    #   state 7 (traj 1, t=0) are singletons.
    # With (s, B - t) keys, (5, 4) and (5, 3) differ: every step is a singleton -> all 0.
    state = jnp.array([[5, 6], [7, 5]])
    step_rewards = jnp.array([[0.0, 1.0], [0.0, 0.0]])
    turn_mask = jnp.ones((2, 2), bool)
    groups = jnp.array([0, 0])
    by_state = adv.gigpo_step_advantages(step_rewards, groups, state, turn_mask, gamma=0.5)
    np.testing.assert_allclose(by_state, [[SQRT_HALF, 0.0], [0.0, -SQRT_HALF]], atol=1e-5)
    budget_keys = budget_anchor_keys(state, jnp.array([4, 4]))
    np.testing.assert_array_equal(budget_keys[..., 1], [[4, 3], [4, 3]])
    by_state_and_budget = adv.gigpo_step_advantages(
        step_rewards, groups, budget_keys, turn_mask, gamma=0.5
    )
    np.testing.assert_array_equal(by_state_and_budget, np.zeros((2, 2)))

    # Same state at the same turn index shares (s, B - t): traj 1 now visits 5 at t = 0 too.
    state2 = jnp.array([[5, 6], [5, 7]])
    got = adv.gigpo_step_advantages(
        step_rewards, groups, budget_anchor_keys(state2, jnp.array([4, 4])), turn_mask, gamma=0.5
    )
    np.testing.assert_allclose(got, [[SQRT_HALF, 0.0], [-SQRT_HALF, 0.0]], atol=1e-5)


def test_gigpo_mean_only_step_normalisation():
    keys, step_rewards, turn_mask, traj_mask, groups = _gigpo_example()
    got = adv.gigpo_step_advantages(
        step_rewards, groups, keys, turn_mask, traj_mask, gamma=0.5, scale_by_std=False
    )
    # deviations from the anchor means computed in test_gigpo_step_advantage_hand_computed
    want = [[0.125, 1 / 3, 0.0], [-0.125, -1 / 6, -1 / 6], [-0.25, 0.25, 0.0], [0.0, 0.0, 0.0]]
    np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("key_dtype", [jnp.int32, jnp.uint32])
def test_gigpo_step_matches_python_reference(key_dtype):
    rng = np.random.default_rng(1)
    n, t = 24, 7
    groups = rng.integers(0, 4, size=n)
    lengths = rng.integers(0, t + 1, size=n)
    turn_mask = np.arange(t)[None, :] < lengths[:, None]
    traj_mask = rng.random(n) > 0.1
    base = 4_000_000_000 if key_dtype == jnp.uint32 else 0  # hash-like values above 2**31
    keys = (base + rng.integers(0, 4, size=(n, t))).astype(
        np.uint32 if key_dtype == jnp.uint32 else np.int32
    )
    step_rewards = rng.normal(size=(n, t)).astype(np.float32)
    got = adv.gigpo_step_advantages(
        jnp.asarray(step_rewards),
        jnp.asarray(groups, jnp.int32),
        jnp.asarray(keys, key_dtype),
        jnp.asarray(turn_mask),
        jnp.asarray(traj_mask),
        gamma=0.95,
    )
    want = gigpo_step_reference(step_rewards, groups, keys, turn_mask, traj_mask, 0.95)
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_gigpo_is_jittable_and_traces_once():
    keys, step_rewards, turn_mask, traj_mask, groups = _gigpo_example()
    fn = jax.jit(chex.assert_max_traces(adv.gigpo_advantages, n=1))
    for shift in range(3):
        fn(
            jnp.array([1.0, 0.0, 1.0, 0.0]),
            step_rewards + shift,
            groups,
            keys + shift,
            turn_mask,
            traj_mask,
        )


# ------------------------------------------------------------------------- helpers


def test_discounted_returns_skip_masked_positions():
    # gamma 0.5, mask [1, 0, 1, 1]: G3 = 1, G2 = 0 + 0.5 * 1 = 0.5, G0 = 2 + 0.5 * 0.5 = 2.25;
    # the masked reward 7 is ignored.
    got = adv.discounted_returns(
        jnp.array([[2.0, 7.0, 0.0, 1.0]]), jnp.array([[1, 0, 1, 1]], bool), 0.5
    )
    np.testing.assert_allclose(got, [[2.25, 0.0, 0.5, 1.0]])
    rng = np.random.default_rng(2)
    r, m = rng.normal(size=(5, 9)), rng.random((5, 9)) > 0.3
    np.testing.assert_allclose(
        adv.discounted_returns(jnp.asarray(r, jnp.float32), jnp.asarray(m), 0.9),
        returns_reference(r, m, 0.9),
        atol=1e-5,
    )


def test_place_at_last_valid():
    got = adv.place_at_last_valid(
        jnp.array([1.0, 2.0, 3.0]), jnp.array([[1, 1, 0], [0, 0, 0], [1, 0, 1]], bool)
    )
    np.testing.assert_array_equal(got, [[0, 1, 0], [0, 0, 0], [0, 0, 3]])


def test_broadcast_turns_to_tokens():
    turn_values = jnp.array([[1.0, 2.0], [3.0, 4.0]])
    index = jnp.array([[-1, 0, 0, -1, 1], [-1, -1, 1, 1, -1]])
    np.testing.assert_array_equal(
        adv.broadcast_turns_to_tokens(turn_values, index), [[0, 1, 1, 0, 2], [0, 0, 4, 4, 0]]
    )
    bad = adv.broadcast_turns_to_tokens(turn_values, jnp.array([[0, 2], [0, 0]]))
    assert np.isnan(bad[0, 1])  # out-of-range turn index is loud, not clamped
    with pytest.raises(ValueError, match="token_turn_index"):
        adv.broadcast_turns_to_tokens(turn_values, jnp.zeros((3, 4), jnp.int32))


def test_broadcast_trajectories_to_tokens():
    got = adv.broadcast_trajectories_to_tokens(
        jnp.array([2.0, -1.0]), jnp.array([[0, 1, 1], [1, 0, 0]])
    )
    np.testing.assert_array_equal(got, [[0, 2, 2], [-1, 0, 0]])


def test_shape_errors_name_the_tensor():
    with pytest.raises(ValueError, match="group_ids"):
        adv.grpo_advantages(jnp.zeros(4), jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match="anchor_keys"):
        adv.gigpo_step_advantages(
            jnp.zeros((2, 3)),
            jnp.zeros(2, jnp.int32),
            jnp.zeros((2, 4), jnp.int32),
            jnp.ones((2, 3), bool),
        )
    with pytest.raises(ValueError, match="anchor_keys: must be an integer"):
        adv.gigpo_step_advantages(
            jnp.zeros((2, 3)), jnp.zeros(2, jnp.int32), jnp.zeros((2, 3)), jnp.ones((2, 3), bool)
        )


# ------------------------------------------------------------------------- GAE


def test_gae_hand_computed_skips_observation_tokens():
    # Response tokens at 0, 1, 4; tokens 2, 3 are an observation
    # (their reward 9 and value 7 are ignored).
    # gamma = lam = 0.5:
    #   A4 = 1 - 0.5 = 0.5                       (last response token: next V = 0)
    #   A1 = (0 + 0.5 * 0.5 - 0.25) + 0.25 * 0.5 = 0 + 0.125 = 0.125       (next is token 4)
    #   A0 = (0 + 0.5 * 0.25 - 0.5) + 0.25 * 0.125 = -0.375 + 0.03125 = -0.34375
    # returns = A + V: [0.15625, 0.375, 0, 0, 1.0]
    rewards = jnp.array([[0.0, 0.0, 9.0, 9.0, 1.0]])
    values = jnp.array([[0.5, 0.25, 7.0, 7.0, 0.5]])
    mask = jnp.array([[1, 1, 0, 0, 1]], bool)
    a, ret = adv.gae_advantages(rewards, values, mask, gamma=0.5, lam=0.5)
    np.testing.assert_allclose(a, [[-0.34375, 0.125, 0, 0, 0.5]], atol=1e-7)
    np.testing.assert_allclose(ret, [[0.15625, 0.375, 0, 0, 1.0]], atol=1e-7)
    # gamma = lam = 1: A = (sum of later rewards) - V = [1 - 0.5, 1 - 0.25, ., ., 1 - 0.5]
    a1, _ = adv.gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    np.testing.assert_allclose(a1, [[0.5, 0.75, 0, 0, 0.5]], atol=1e-7)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_gae_matches_python_loop(gamma, lam):
    rng = np.random.default_rng(3)
    r = rng.normal(size=(6, 20)).astype(np.float32)
    v = rng.normal(size=(6, 20)).astype(np.float32)
    m = rng.random((6, 20)) > 0.4
    m[0] = False  # a row with no response tokens
    a, ret = adv.gae_advantages(
        jnp.asarray(r), jnp.asarray(v), jnp.asarray(m), gamma=gamma, lam=lam
    )
    want_a, want_ret = gae_reference(r, v, m, gamma, lam)
    np.testing.assert_allclose(a, want_a, atol=1e-5)
    np.testing.assert_allclose(ret, want_ret, atol=1e-5)


def test_masked_whiten_matches_numpy():
    rng = np.random.default_rng(4)
    x = rng.normal(3.0, 2.0, size=(4, 7)).astype(np.float32)
    m = rng.random((4, 7)) > 0.3
    sel = x[m].astype(np.float64)
    want = np.where(m, (x - sel.mean()) / np.sqrt(sel.var(ddof=1) + 1e-8), 0.0)
    np.testing.assert_allclose(adv.masked_whiten(jnp.asarray(x), jnp.asarray(m)), want, atol=1e-5)
    scale_only = adv.masked_whiten(jnp.asarray(x), jnp.asarray(m), shift_mean=False)
    np.testing.assert_allclose(scale_only, np.where(m, want + sel.mean(), 0.0), atol=1e-5)
