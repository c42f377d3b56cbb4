"""pass@k against brute force and exact rational arithmetic; Pass@(K, T) helpers by hand."""

import itertools
import math
import warnings
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl_jax.evaluation import passk


def brute_force_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """Share of all k-subsets of n samples (the first c successful) holding a success."""
    subsets = list(itertools.combinations(range(n), k))
    hits = sum(any(i < c for i in subset) for subset in subsets)
    return Fraction(hits, len(subsets))


def exact_pass_at_k(n: int, c: int, k: int) -> Fraction:
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def test_equals_brute_force_over_all_k_subsets():
    cases = [(n, c, k) for n in range(1, 9) for c in range(n + 1) for k in range(1, n + 1)]
    n, c, k = (np.array(col) for col in zip(*cases))
    for kk in range(1, 9):
        rows = k == kk
        got = passk.pass_at_k_matrix(n[rows], c[rows], kk)[:, 0]
        want = [float(brute_force_pass_at_k(a, b, kk)) for a, b in zip(n[rows], c[rows])]
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=0)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 40).flatmap(
        lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))
    )
)
def test_matches_exact_fraction_small_n(nck):
    n, c, k = nck
    assert passk.pass_at_k(n, c, k)[0] == pytest.approx(
        float(exact_pass_at_k(n, c, k)), rel=1e-13, abs=0
    )


def test_n_1000_no_overflow_and_matches_exact_and_product_formula():
    n = 1000
    cs = np.array([0, 1, 2, 5, 50, 500, 871, 872, 873, 990, 999, 1000])
    ks = np.arange(1, 129)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any overflow / invalid-value warning fails the test
        got = passk.pass_at_k_matrix(np.full(cs.size, n), cs, ks)
    assert np.all(np.isfinite(got))
    for row, c in enumerate(cs):
        for col, k in enumerate(ks):
            exact = float(exact_pass_at_k(n, int(c), int(k)))
            # Relative precision also for tiny values such as c = 1, k = 1 (= 0.001).
            assert got[row, col] == pytest.approx(exact, rel=1e-12, abs=1e-300), (c, k)
            # The plain product formula of §3, in Python floats.
            product = 1.0
            for i in range(n - int(c) + 1, n + 1):
                product *= 1.0 - k / i
            assert got[row, col] == pytest.approx(1.0 - product, rel=1e-9, abs=1e-15), (c, k)


def test_n_5000_exact():
    n, c, k = 5000, 3, 128
    assert passk.pass_at_k(n, c, k)[0] == pytest.approx(float(exact_pass_at_k(n, c, k)), rel=1e-12)


def test_monotone_in_k_and_in_c():
    rng = np.random.default_rng(0)
    n = rng.integers(128, 300, size=200)
    c = rng.integers(0, n + 1)
    m = passk.pass_at_k_matrix(n, c, np.arange(1, 129))
    assert np.all(np.diff(m, axis=1) >= -1e-15)
    more = passk.pass_at_k_matrix(n, np.minimum(c + 1, n), np.arange(1, 129))
    assert np.all(more >= m - 1e-15)
    assert np.all((m >= 0) & (m <= 1))


def test_edge_cases():
    ks = [1, 3, 8]
    np.testing.assert_array_equal(passk.pass_at_k_matrix([8, 20], [0, 0], ks), 0.0)
    assert not np.signbit(passk.pass_at_k_matrix([8], [0], 1)).any()  # +0.0, not -0.0
    np.testing.assert_array_equal(passk.pass_at_k_matrix([8, 20], [8, 20], ks), 1.0)
    # n - c < k: every k-subset must contain a success -> exactly 1.
    np.testing.assert_array_equal(passk.pass_at_k_matrix([10, 10], [8, 3], [3, 8])[:, 1], 1.0)
    assert passk.pass_at_k(10, 8, 3)[0] == 1.0
    assert passk.pass_at_k(10, 7, 3)[0] == pytest.approx(1 - 1 / 120)
    # pass@1 is the success rate.
    np.testing.assert_allclose(passk.pass_at_k([16, 16, 16], [0, 5, 16], 1), [0, 5 / 16, 1])


def test_vectorised_equals_per_task():
    rng = np.random.default_rng(1)
    n = rng.integers(16, 64, size=50)
    c = rng.integers(0, n + 1)
    ks = [1, 2, 4, 8, 16]
    m = passk.pass_at_k_matrix(n, c, ks)
    for t in range(n.size):
        for j, k in enumerate(ks):
            assert m[t, j] == pytest.approx(
                float(exact_pass_at_k(int(n[t]), int(c[t]), k)), rel=1e-12
            )


def test_curve_is_mean_over_tasks():
    n, c = [16, 16], [4, 0]
    curve = passk.pass_at_k_curve(n, c, [1, 2, 16])
    np.testing.assert_allclose(curve, [(0.25 + 0) / 2, (float(exact_pass_at_k(16, 4, 2))) / 2, 0.5])
    assert passk.pass_at_k_curve([128], [1]).shape == (128,)


@pytest.mark.parametrize(
    "n, c, k, message",
    [
        ([4], [5], 1, "`c`"),
        ([4], [-1], 1, "`c`"),
        ([0], [0], 1, "`n`"),
        ([4], [1], 5, "exceeds"),
        ([4], [1], 0, "`k`"),
        ([4.5], [1], 1, "integer"),
        ([[4, 4]], [[1, 1]], 1, "shape"),
    ],
)
def test_bad_input_names_the_field(n, c, k, message):
    with pytest.raises(ValueError, match=message):
        passk.pass_at_k_matrix(n, c, k)


def test_counts_from_successes():
    s = np.array([[1, 0, 1, 1], [0, 0, 0, 1]], dtype=bool)
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=bool)
    n, c = passk.counts_from_successes(s)
    np.testing.assert_array_equal(n, [4, 4])
    np.testing.assert_array_equal(c, [3, 1])
    n, c = passk.counts_from_successes(s, mask)
    np.testing.assert_array_equal(n, [3, 4])
    np.testing.assert_array_equal(c, [2, 1])
    with pytest.raises(ValueError, match="mask"):
        passk.counts_from_successes(s, mask[:, :2])


def test_budget_levels_integer_arithmetic():
    assert passk.budget_levels(70) == (17, 35, 52, 70)
    assert passk.budget_levels(10) == (2, 5, 7, 10)
    assert passk.budget_levels(24) == (6, 12, 18, 24)
    assert passk.budget_levels(70, (10, 100)) == (7, 70)
    with pytest.raises(ValueError, match="floors to 0"):
        passk.budget_levels(3)
    with pytest.raises(ValueError, match="t_max"):
        passk.budget_levels(0)
    with pytest.raises(ValueError, match="percent"):
        passk.budget_levels(70, (0, 50))


def test_pass_at_t_and_table():
    # Two tasks, 8 samples each; at T=2 one task solved once, at T=4 both solved always.
    results = {4: ([8, 8], [8, 8]), 2: ([8, 8], [1, 0])}
    budgets, values = passk.pass_at_t_curve(results, k=1)
    np.testing.assert_array_equal(budgets, [2, 4])
    np.testing.assert_allclose(values, [1 / 16, 1.0])
    by_budget = passk.pass_at_k_by_budget(results, k=8)
    assert by_budget == {2: 0.5, 4: 1.0}
    table = passk.pass_at_k_table(
        {"base": results, "rl": {2: ([8, 8], [0, 0]), 4: ([8, 8], [8, 0])}}, [2, 4], k=8
    )
    assert table == {"base": {2: 0.5, 4: 1.0}, "rl": {2: 0.0, 4: 0.5}}
    with pytest.raises(ValueError, match="'rl'.*\\[3\\]"):
        passk.pass_at_k_table({"rl": results}, [3])
    with pytest.raises(ValueError, match="T=2"):
        passk.pass_at_k_by_budget({2: ([4], [1])}, k=8)


def test_structural_upper_bound():
    d = np.array([3, 5, 5, 9, np.inf])
    np.testing.assert_allclose(
        passk.structural_upper_bound(d, [1, 3, 4, 5, 9, 100]), [0, 0.2, 0.2, 0.6, 0.8, 0.8]
    )
    # envs/frozenlake/qstar.py marks unreachable goals with int32 max: above every budget.
    unreachable = np.iinfo(np.int32).max
    np.testing.assert_allclose(passk.structural_upper_bound([3, unreachable], [70]), [0.5])
    with pytest.raises(ValueError, match="np.inf"):
        passk.structural_upper_bound([3, -1], [5])
