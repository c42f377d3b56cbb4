"""Diagnostics statistics against hand-computed values and seeded simulations."""

import math

import numpy as np
import pytest

from agentrl_jax.evaluation import stats
from agentrl_jax.evaluation.analyses import likelihood

Z95 = 1.959963984540054


def test_mean_ci_normal_by_hand():
    ci = stats.mean_ci_normal([1.0, 2.0, 3.0, 4.0])
    sd = math.sqrt(((1.5**2) * 2 + (0.5**2) * 2) / 3)  # sample sd, ddof = 1
    half = Z95 * sd / 2.0
    assert (ci.mean, ci.n) == (2.5, 4)
    assert ci.low == pytest.approx(2.5 - half, rel=1e-12)
    assert ci.high == pytest.approx(2.5 + half, rel=1e-12)
    one = stats.mean_ci_normal([7.0])
    assert one.mean == 7.0 and math.isnan(one.low) and math.isnan(one.high)
    assert stats.mean_ci_normal([]).n == 0
    with pytest.raises(ValueError, match="non-finite"):
        stats.mean_ci_normal([1.0, np.nan])
    with pytest.raises(ValueError, match="confidence"):
        stats.mean_ci_normal([1.0, 2.0], confidence=1.5)


def test_normal_ci_at_other_confidence_matches_scipy():
    from scipy import stats as scipy_stats

    x = np.array([0.3, 1.2, 0.7, 2.2, 0.1])
    ci = stats.mean_ci_normal(x, confidence=0.9)
    low, high = scipy_stats.norm.interval(0.9, loc=x.mean(), scale=scipy_stats.sem(x))
    assert (ci.low, ci.high) == pytest.approx((low, high), rel=1e-12)


@pytest.mark.parametrize("k, n", [(0, 10), (3, 10), (10, 10), (37, 512)])
def test_wilson_matches_scipy(k, n):
    from scipy import stats as scipy_stats

    outcomes = np.r_[np.ones(k), np.zeros(n - k)]
    ci = stats.mean_ci(outcomes, method="wilson")
    ref = scipy_stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    assert ci.mean == k / n and ci.n == n
    assert (ci.low, ci.high) == pytest.approx((ref.low, ref.high), rel=1e-12, abs=1e-15)
    with pytest.raises(ValueError, match="0/1"):
        stats.proportion_ci_wilson([0.5, 1.0])


def test_bootstrap_is_seeded_and_matches_a_plain_loop():
    x = np.array([0.1, 0.4, 0.35, 0.8, 0.9, 0.05])
    a = stats.bootstrap_means(x, n_resamples=300, seed=3)
    b = stats.bootstrap_means(x, n_resamples=300, seed=3)
    np.testing.assert_array_equal(a, b)
    rng = np.random.default_rng(3)
    plain = [x[rng.integers(0, x.size, size=x.size)].mean() for _ in range(300)]
    np.testing.assert_allclose(a, plain)
    ci = stats.mean_ci_bootstrap(x, n_resamples=300, seed=3)
    assert ci.mean == pytest.approx(x.mean())
    assert (ci.low, ci.high) == pytest.approx(tuple(np.quantile(plain, [0.025, 0.975])))


@pytest.mark.parametrize("method", ["normal", "bootstrap"])
def test_ci_covers_the_truth_in_a_seeded_simulation(method):
    # Exponential(1) data, true mean 1: a 95% interval should cover it ~95% of the time.
    rng = np.random.default_rng(0)
    trials = 300
    covered = 0
    for trial in range(trials):
        x = rng.exponential(1.0, size=60)
        ci = stats.mean_ci(x, method=method, seed=trial)
        covered += ci.low <= 1.0 <= ci.high
    # Binomial(300, 0.95) sd ~ 1.3 pt; skewed data under-covers slightly at n = 60.
    assert 0.88 <= covered / trials <= 0.99


def test_masked_mean():
    v = np.array([[1.0, 2.0, 100.0], [3.0, 5.0, 7.0], [9.0, 9.0, 9.0]])
    m = np.array([[1, 1, 0], [1, 1, 1], [0, 0, 0]], dtype=bool)
    out = stats.masked_mean(v, m)
    np.testing.assert_allclose(out[:2], [1.5, 5.0])
    assert math.isnan(out[2])


def test_paired_comparison_by_hand_with_ties():
    q_rl = [1.0, 0.5, 0.2, 0.3]
    q_base = [0.5, 0.5, 0.4, 0.1]  # diffs: +0.5, 0 (tie), -0.2, +0.2
    c = stats.paired_comparison(q_rl, q_base)
    assert c.n == 4
    assert (c.share_rl_better, c.share_tie, c.share_base_better) == (0.5, 0.25, 0.25)
    assert c.win_rate == 0.625
    assert c.mean_diff.mean == pytest.approx(0.125)
    diffs = np.array([0.5, 0.0, -0.2, 0.2])
    half = Z95 * diffs.std(ddof=1) / 2.0
    assert (c.mean_diff.low, c.mean_diff.high) == pytest.approx((0.125 - half, 0.125 + half))
    # A wider tie tolerance turns the +-0.2 differences into ties.
    wide = stats.paired_comparison(q_rl, q_base, tie_tol=0.25)
    assert (wide.share_rl_better, wide.share_tie, wide.share_base_better) == (0.25, 0.75, 0.0)
    with pytest.raises(ValueError, match="q_base"):
        stats.paired_comparison([1.0, 2.0], [1.0])


def test_paired_comparison_optimal_vs_epsilon_random():
    # Scripted qualities: per state, Q* of 4 actions; "optimal" always picks the best
    # action, "epsilon-random" (eps = 0.5) picks uniformly half the time.
    rng = np.random.default_rng(0)
    q = rng.uniform(0, 1, size=(512, 4))
    g = 16
    optimal = np.repeat(q.max(axis=1, keepdims=True), g, axis=1)
    greedy = rng.uniform(size=(512, g)) >= 0.5
    picks = np.where(greedy, q.argmax(axis=1)[:, None], rng.integers(0, 4, size=(512, g)))
    eps_random = np.take_along_axis(q, picks, axis=1)
    mask = np.ones((512, g), dtype=bool)
    c = stats.paired_comparison(
        stats.masked_mean(optimal, mask), stats.masked_mean(eps_random, mask)
    )
    assert c.share_rl_better > 0.99
    assert c.share_base_better == 0.0
    expected_gap = 0.5 * (q.max(axis=1) - q.mean(axis=1)).mean()
    assert c.mean_diff.low <= expected_gap + 0.01 and expected_gap - 0.01 <= c.mean_diff.high


def test_normalised_depth():
    np.testing.assert_allclose(stats.normalised_depth([0, 35, 70], 70), [0, 0.5, 1])
    with pytest.raises(ValueError, match="turn"):
        stats.normalised_depth([71], 70)


def test_binned_curve_by_hand():
    x = np.array([0.0, 0.1, 0.3, 0.49, 0.5, 1.0, 0.99])
    y = np.array([1.0, 3.0, 10.0, 20.0, 5.0, 7.0, 9.0])
    curve = stats.binned_curve(x, y, bins=4, n_resamples=500)
    np.testing.assert_allclose(curve.edges, [0, 0.25, 0.5, 0.75, 1.0])
    np.testing.assert_allclose(curve.centers, [0.125, 0.375, 0.625, 0.875])
    np.testing.assert_array_equal(
        curve.count, [2, 2, 1, 2]
    )  # 0.5 opens bin 3; 1.0 joins the last bin
    np.testing.assert_allclose(curve.mean[[0, 1, 3]], [2.0, 15.0, 8.0])
    assert curve.mean[2] == 5.0 and curve.low[2] == 5.0 and curve.high[2] == 5.0
    assert np.all(curve.low <= curve.mean) and np.all(curve.mean <= curve.high)
    # An empty bin is NaN with count 0.
    sparse = stats.binned_curve([0.1, 0.9], [1.0, 2.0], bins=3, n_resamples=50)
    assert sparse.count.tolist() == [1, 0, 1] and math.isnan(sparse.mean[1])
    with pytest.raises(ValueError, match="outside"):
        stats.binned_curve([1.2], [1.0])


def test_binned_curve_bands_cover_the_truth():
    # Quality grows linearly with depth plus noise; the band of each bin should cover the
    # bin's true mean in (almost) every bin.
    rng = np.random.default_rng(5)
    x = rng.uniform(0, 1, size=4000)
    y = 0.2 + 0.5 * x + rng.normal(0, 0.3, size=x.size)
    curve = stats.binned_curve(x, y, bins=10, n_resamples=1000, seed=1)
    truth = 0.2 + 0.5 * curve.centers
    assert np.sum((curve.low <= truth) & (truth <= curve.high)) >= 8


def test_cumulative_llr_by_hand():
    logp_rl = np.array([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0]])
    logp_base = np.array([[-2.0, -2.0, -1.0], [-1.5, np.nan, -np.inf]])  # padding may be junk
    mask = np.array([[1, 1, 1], [1, 0, 0]], dtype=bool)
    cum = likelihood.cumulative_llr(logp_rl, logp_base, mask)
    np.testing.assert_allclose(cum, [[1.0, 1.0, -1.0], [1.0, 1.0, 1.0]])
    np.testing.assert_array_equal(likelihood.trajectory_lengths(mask), [3, 1])
    with pytest.raises(ValueError, match="prefix"):
        likelihood.cumulative_llr(logp_rl, logp_base, np.array([[1, 0, 1], [1, 0, 0]], dtype=bool))
    with pytest.raises(ValueError, match="non-finite"):
        likelihood.cumulative_llr(logp_rl, logp_base, np.ones((2, 3), dtype=bool))


def test_sum_token_logprobs():
    lp = np.array([[[-1.0, -2.0, -9.0], [-0.5, -9.0, -9.0]]])
    m = np.array([[[1, 1, 0], [1, 0, 0]]], dtype=bool)
    np.testing.assert_allclose(likelihood.sum_token_logprobs(lp, m), [[-3.0, -0.5]])


def test_llr_by_outcome_and_turn_curve():
    cum = np.array([[1.0, 1.0, -1.0], [1.0, 1.0, 1.0], [2.0, 4.0, 4.0], [0.0, 0.0, 0.0]])
    mask = np.array([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=bool)
    success = np.array([True, False, True, False])
    out = likelihood.llr_by_outcome(cum, mask, success)
    ok = out["success"].curve
    np.testing.assert_array_equal(ok.turn, [1, 2, 3])
    np.testing.assert_array_equal(ok.count, [2, 2, 1])
    np.testing.assert_allclose(ok.mean, [1.5, 2.5, -1.0])
    # Column CIs equal the normal CI of the values in that column.
    col = stats.mean_ci_normal([1.0, 4.0])
    assert (ok.low[1], ok.high[1]) == pytest.approx((col.low, col.high))
    assert math.isnan(ok.low[2])  # one trajectory: no interval
    assert out["success"].final.mean == pytest.approx((-1.0 + 4.0) / 2)
    bad = out["failure"].curve
    np.testing.assert_array_equal(bad.count, [2, 1, 1])
    np.testing.assert_allclose(bad.mean, [0.5, 0.0, 0.0])
    assert out["failure"].final.mean == pytest.approx(0.5)


def test_length_matched_llr_by_hand():
    cum = np.array(
        [
            [1.0, 2.0, 3.0, 4.0],  # success, length 4
            [2.0, 4.0, 6.0, 6.0],  # success, length 3
            [0.5, 0.5, 0.5, 0.5],  # failure, length 1
            [-1.0, -2.0, -2.0, -2.0],  # failure, length 2
            [1.0, 1.0, 1.0, 1.0],  # failure, length 4
        ]
    )
    lengths = [4, 3, 1, 2, 4]
    mask = np.arange(4)[None, :] < np.array(lengths)[:, None]
    success = np.array([True, True, False, False, False])
    groups = {"success": success, "failure": ~success}
    # Medians: success 3.5, failure 2 -> L = 2.
    out = likelihood.length_matched_llr(cum, mask, groups)
    assert out.length == 2
    assert out.groups["success"].mean == pytest.approx((2.0 + 4.0) / 2)
    assert out.groups["failure"].mean == pytest.approx((-2.0 + 1.0) / 2)  # length-1 one left out
    assert out.groups["failure"].n == 2
    at3 = likelihood.length_matched_llr(cum, mask, groups, length=3)
    assert at3.groups["success"].mean == pytest.approx(4.5)
    assert at3.groups["failure"].mean == 1.0 and at3.groups["failure"].n == 1
    empty = likelihood.length_matched_llr(cum, mask, groups, length=4)
    assert empty.groups["success"].n == 1
    with pytest.raises(ValueError, match="length"):
        likelihood.length_matched_llr(cum, mask, groups, length=5)


def test_action_nll_summary_and_overlap():
    nll = np.array([[10.0, 12.0, 99.0], [14.0, 16.0, 99.0]])
    mask = np.array([[1, 1, 0], [1, 1, 0]], dtype=bool)
    s = likelihood.action_nll_summary(nll, mask)
    valid = np.array([10.0, 12.0, 14.0, 16.0])
    assert s.n == 4 and s.mean.mean == 13.0 and s.median == 13.0
    assert s.std == pytest.approx(valid.std(ddof=1))
    assert (s.q05, s.q95) == pytest.approx(tuple(np.quantile(valid, [0.05, 0.95])))
    a = np.array([1.0, 2.0, 3.0, 4.0])
    assert likelihood.histogram_overlap(a, a, bins=4) == pytest.approx(1.0)
    assert likelihood.histogram_overlap([0.0, 0.1], [9.9, 10.0], bins=10) == 0.0
    # Half of b's mass in a's bins, half outside.
    assert likelihood.histogram_overlap([0.0, 0.0], [0.0, 10.0], bins=2) == pytest.approx(0.5)
