"""DAPO pieces: dynamic-sampling mask, overlong shaping, clip-higher with token-level
aggregation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax.algorithms import advantages as adv
from agentrl_jax.algorithms import aggregation as agg
from agentrl_jax.algorithms.algorithm_config import AlgorithmConfig, LossTermConfig
from agentrl_jax.algorithms.compute import compute_advantages, compute_loss
from agentrl_jax.algorithms.dapo import dynamic_sampling_keep, overlong_penalty
from agentrl_jax.algorithms.registry import AdvantageInputs, LossInputs

# ------------------------------------------------------------------------- dynamic sampling


def _groups_example():
    near = float(np.nextafter(np.float32(0.9025), np.float32(1)))
    # group 3 (all solved; the masked 0 does not count)
    #          group 3             group 8   group -2  9    group 4       group 6
    rewards = [1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 5.0, 0.9025, near, np.nan, 1.0]
    groups = [3, 3, 3, 3, 8, 8, -2, -2, 9, 4, 4, 6, 6]
    mask = [True, True, False, True, True, True, True, True, True, True, True, True, True]
    return jnp.array(rewards, jnp.float32), jnp.array(groups), jnp.array(mask)


def test_dynamic_sampling_keep_hand_computed():
    rewards, groups, mask = _groups_example()
    keep = np.asarray(dynamic_sampling_keep(rewards, groups, mask))
    # group 3: three 1s (masked row not counted, never kept) -> drop; group 8 [0, 1] -> keep;
    # group -2 [0, 0] -> drop; group 9 alone -> drop; group 4: one ulp apart -> keep;
    # group 6 has a NaN -> drop
    want = [False, False, False, False, True, True, False, False, False, True, True, False, False]
    np.testing.assert_array_equal(keep, want)
    singles = np.asarray(dynamic_sampling_keep(rewards, groups, mask, keep_singletons=True))
    np.testing.assert_array_equal(singles, np.array(want) | (np.arange(13) == 8))


def test_dynamic_sampling_keeps_exactly_the_groups_with_a_nonzero_advantage():
    """Kept groups are exactly those where GRPO (and so Dr. GRPO and RLOO) gives someone A != 0."""
    rng = np.random.default_rng(7)
    fn = jax.jit(dynamic_sampling_keep)
    for _ in range(5):
        n = 64
        rewards = rng.choice([0.0, 1.0, 0.95**3, 0.95**4], size=n, p=[0.6, 0.3, 0.05, 0.05]).astype(
            np.float32
        )
        groups = rng.integers(0, 12, size=n)
        mask = rng.random(n) > 0.1
        keep = np.asarray(fn(jnp.asarray(rewards), jnp.asarray(groups), jnp.asarray(mask)))
        a = np.asarray(
            adv.grpo_advantages(jnp.asarray(rewards), jnp.asarray(groups), jnp.asarray(mask))
        )
        for g in np.unique(groups):
            rows = (groups == g) & mask
            distinct = len(set(rewards[rows].tolist()))
            assert np.all(keep[rows] == (distinct > 1))
            assert np.any(a[rows] != 0) == (distinct > 1)
        assert not np.any(keep[~mask])


# ------------------------------------------------------------------------- overlong shaping


def test_overlong_penalty_hand_computed():
    # L_max = 20, L_cache = 4: free up to 16, then (16 - |y|) / 4 down to -1 at 20, -1 beyond
    lengths = jnp.array([0, 10, 16, 17, 18, 19, 20, 21, 100])
    got = overlong_penalty(lengths, max_length=20, cache_length=4)
    np.testing.assert_allclose(got, [0, 0, 0, -0.25, -0.5, -0.75, -1, -1, -1], atol=1e-7)
    half = overlong_penalty(lengths.astype(jnp.float32), max_length=20, cache_length=4, penalty=0.5)
    np.testing.assert_allclose(half, [0, 0, 0, -0.125, -0.25, -0.375, -0.5, -0.5, -0.5], atol=1e-7)
    # DAPO's setting: 20480 / 4096 -> free up to 16384; 18432 is half way
    dapo = overlong_penalty(jnp.array([16384, 18432, 20480]), max_length=20480, cache_length=4096)
    np.testing.assert_allclose(dapo, [0, -0.5, -1], atol=1e-7)
    jitted = jax.jit(lambda x: overlong_penalty(x, max_length=20, cache_length=4))
    np.testing.assert_allclose(jitted(lengths), got)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(max_length=0, cache_length=1), "max_length"),
        (dict(max_length=10, cache_length=0), "cache_length"),
        (dict(max_length=10, cache_length=11), "cache_length"),
        (dict(max_length=10, cache_length=2.5), "cache_length"),
        (dict(max_length=10, cache_length=True), "cache_length"),
        (dict(max_length=10, cache_length=2, penalty=-1.0), "penalty"),
    ],
)
def test_overlong_penalty_arguments_are_validated(kwargs, field):
    with pytest.raises(ValueError, match=f"overlong_penalty: {field} must be"):
        overlong_penalty(jnp.array([1, 2]), **kwargs)


# -------------------------------------------------------------------- clip-higher, token-level loss


def test_dapo_loss_settings_hand_computed():
    """GRPO advantages, clip [0.8, 1.28] (clip-higher), token-mean over the whole batch, no KL."""
    config = AlgorithmConfig(
        loss_terms=(LossTermConfig("policy_clip", 1.0, {"clip_low": 0.2, "clip_high": 0.28}),),
        aggregation="token-mean",
    )
    mask = jnp.array([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    a = compute_advantages(
        config,
        AdvantageInputs(loss_mask=mask, rewards=jnp.array([1.0, 0.0]), group_ids=jnp.array([0, 0])),
    ).advantages
    # group [1, 0]: +-0.5 / std(ddof=1) = +-0.5 / sqrt(0.5) = +-0.707107 on each row's tokens
    s = float(np.sqrt(0.5))
    np.testing.assert_allclose(a, [[s, s, 0, 0], [-s] * 4], atol=1e-5)
    # row 0, token 0 has ratio 1.25: inside [0.8, 1.28] -> -1.25 s
    # (a symmetric 0.2 clip would give -1.2 s)
    old = jnp.zeros((2, 4))
    logp = old.at[0, 0].set(float(np.log(1.25)))
    x = LossInputs(loss_mask=mask, logprobs=logp, old_logprobs=old, advantages=a)
    total, parts = compute_loss(config, x)
    # token-level: (-1.25 s - s + 4 s) / 6 tokens = 1.75 s / 6; the sequence mean would be
    # ((-2.25 s) / 2 + s) / 2 = -0.0625 s: the long failing row weighs by its tokens
    assert (float(total.total), float(total.denom)) == pytest.approx((1.75 * s, 6.0), rel=1e-5)
    assert set(parts) == {"policy_clip"}
    sym = AlgorithmConfig(loss_terms=(LossTermConfig("policy_clip"),), aggregation="token-mean")
    assert float(compute_loss(sym, x)[0].total) == pytest.approx(1.8 * s, rel=1e-5)
    assert float(agg.mean(total)) == pytest.approx(1.75 * s / 6, rel=1e-5)
