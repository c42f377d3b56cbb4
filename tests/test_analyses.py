"""Each analysis' ``compute`` against numbers worked out by hand on a small fixed input, and its
result's JSON round trip (``Result.from_json(json of r.to_json()) == r``)."""

import csv
import dataclasses
import json
import math

import numpy as np
import pytest

from agentrl_jax.evaluation import report
from agentrl_jax.evaluation.analyses import (
    continuation,
    depth,
    dynamics,
    error_recovery,
    likelihood,
    pass_at_k,
    pass_at_t,
    robustness,
    step_quality,
    table1,
)
from agentrl_jax.evaluation.result import Result, same

Z95 = 1.959963984540054


def round_trip(res: Result) -> Result:
    """``res`` through JSON text and back; asserts it is equal and returns the copy."""
    back = type(res).from_json(json.loads(json.dumps(res.to_json(), allow_nan=False)))
    assert back == res
    return back


def test_pass_at_k_by_hand():
    res = pass_at_k.compute({"a": ([4, 4], [1, 0]), "b": ([2, 2], [2, 1])}, ks=(1, 2, 3))
    # a, task 1 (n=4, c=1): pass@1 = 1/4; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 1/2;
    # pass@3 = 1 - C(3,3)/C(4,3) = 1 - 1/4 = 3/4; task 2 (c=0): 0. Means over the 2 tasks:
    np.testing.assert_array_equal(res.curves["a"].k, [1, 2, 3])
    np.testing.assert_allclose(res.curves["a"].pass_at_k, [0.125, 0.25, 0.375])
    # b: n = 2 < 3, so k = 3 is dropped; pass@1 = (2/2 + 1/2) / 2 = 0.75; pass@2: both tasks
    # have a success among their 2 samples (1 - C(0,2)/C(2,2) = 1, 1 - C(1,2)/C(2,2) = 1): 1
    np.testing.assert_array_equal(res.curves["b"].k, [1, 2])
    np.testing.assert_allclose(res.curves["b"].pass_at_k, [0.75, 1.0])
    assert res.k_dropped_for_too_few_samples == {"a": (), "b": (3,)}
    round_trip(res)


COUNTS = {1: ([2, 2], [0, 1]), 2: ([2, 2], [1, 2]), 3: ([2, 2], [2, 2]), 4: ([2, 2], [2, 2])}
SHORTEST = [1, 3]


def test_pass_at_t_with_its_bound_and_table_by_hand():
    res = pass_at_t.compute({"a": COUNTS}, k=1, t_max=4, shortest_paths=SHORTEST)
    # pass@1 = c / n per task, averaged: T=1 (0 + 1/2) / 2, T=2 (1/2 + 1) / 2, T=3 and 4: 1
    np.testing.assert_array_equal(res.curves["a"].budget, [1, 2, 3, 4])
    np.testing.assert_allclose(res.curves["a"].value, [0.25, 0.75, 1.0, 1.0])
    # bound: the share of shortest paths (1, 3) <= T, at every budget 1..4
    np.testing.assert_array_equal(res.bound.budget, [1, 2, 3, 4])
    np.testing.assert_allclose(res.bound.value, [0.5, 0.5, 1.0, 1.0])
    # Table 1 levels of T_max = 4: (p * 4) // 100 for p = 25, 50, 75, 100 -> 1, 2, 3, 4
    assert res.table == {"a": {1: 0.25, 2: 0.75, 3: 1.0, 4: 1.0}}
    assert round_trip(res).table == res.table
    bare = pass_at_t.compute({"a": COUNTS}, k=1)
    assert bare.bound is None and bare.table is None and bare.t_max is None
    round_trip(bare)


def test_robustness_by_hand():
    res = robustness.compute({"a": COUNTS}, 1, SHORTEST)
    # achieved per task, the sum over T = 1..4 of pass@1: task 1 0 + 1/2 + 1 + 1 = 2.5,
    # task 2 1/2 + 1 + 1 + 1 = 3.5; allowed (shortest <= T): task 1 4, task 2 2 (T = 3, 4).
    # R = mean(2.5, 3.5) / mean(4, 2) = 3 / 3 = 1. Delta method: a - R d = (-1.5, +1.5),
    # var (ddof 1) = 4.5, half = z * sqrt(4.5 / 2) / 3 = z / 2.
    score = res.scores["a"]
    assert (score.mean, score.n) == (1.0, 2)
    assert (score.low, score.high) == pytest.approx((1 - Z95 / 2, 1 + Z95 / 2))
    assert res.budgets == (1, 2, 3, 4) and res.k == 1
    round_trip(res)


def test_table1_with_a_difference_row_by_hand():
    other = {1: ([2, 2], [1, 1]), 2: ([2, 2], [1, 1]), 3: ([2, 2], [2, 2]), 4: ([2, 2], [2, 2])}
    res = table1.compute(
        {"a": COUNTS, "b": other}, k=1, t_max=4, levels=(1, 2, 3, 4), pairs=[("b", "a")]
    )
    assert list(res.rows) == ["a", "b", "b - a (pt)"]
    # T = 1: a's per-task pass@1 (0, 1/2): mean 1/4, sd (ddof 1) sqrt(2 * 0.25^2) = 0.3536,
    # half = z * 0.3536 / sqrt(2) = z / 4; b - a per task (1/2, 0): the same mean and CI
    half = Z95 / 4
    for label in ("a", "b - a (pt)"):
        ci = res.rows[label][1]
        assert (ci.mean, ci.low, ci.high, ci.n) == pytest.approx(
            (0.25, 0.25 - half, 0.25 + half, 2)
        )
    # T = 3: both solve every task every time: 100% each, a difference of exactly 0
    assert res.rows["b"][3].mean == 1.0 and res.rows["b - a (pt)"][3].mean == 0.0
    # shown in points: 25 -/+ 100 * z / 4 = 25 -/+ 49.0 -> "+25.0 [-24.0, +74.0]"; a policy's
    # cell the same interval unsigned (a at T = 2: per task (1/2, 1), 75 -/+ 49.0; at T = 3
    # and 4 every task solved: a zero-width interval)
    lines = table1.markdown(res).splitlines()
    assert lines[0] == "| Pass@1 (%) | 25% (T=1) | 50% (T=2) | 75% (T=3) | 100% (T=4) |"
    assert lines[2] == (
        "| a | 25.0 [-24.0, 74.0] | 75.0 [26.0, 124.0] | 100.0 [100.0, 100.0] "
        "| 100.0 [100.0, 100.0] |"
    )
    assert lines[4].startswith("| b - a (pt) | +25.0 [-24.0, +74.0] | -25.0 [")
    round_trip(res)


def test_table1_markdown_cells_are_the_csv_values_and_intervals(tmp_path):
    """Every cell of Table 1's Markdown, policy rows and difference rows, is ``table1.csv``'s
    value and 95% interval of that row and level, rounded to one decimal."""
    other = {1: ([4, 4], [1, 3]), 2: ([4, 4], [2, 4]), 3: ([4, 4], [3, 4]), 4: ([4, 4], [4, 4])}
    res = table1.compute(
        {"a": COUNTS, "b": other}, k=1, t_max=4, levels=(1, 2, 3, 4), pairs=[("b", "a")]
    )
    sec = table1.section(tmp_path, res, report.Section("Table 1"), tasks=2, samples=4)
    header, *rows = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in sec.markdown.splitlines()
        if not line.startswith("|---")
    ]
    stored = {r["row"]: r for r in csv.DictReader((tmp_path / table1.TABLE1_CSV).open())}
    assert [r[0] for r in rows] == list(stored) == ["a", "b", "b - a (pt)"]
    for label, *cells in rows:
        row = stored[label]
        form = "{:+.1f}" if row["kind"] == "difference" else "{:.1f}"
        for level, cell in zip(header[1:], cells):
            value, low, high = (float(row[level + s]) for s in ("", " ci_low", " ci_high"))
            expected = f"{form.format(value)} [{form.format(low)}, {form.format(high)}]"
            assert cell == expected, (label, level)


def test_step_quality_by_hand():
    res = step_quality.compute({"p": ([0.5, 0.2, 0.3], [0.7, 0.2, 0.1])})
    c = res.comparisons["p"]
    # RL - base = (+0.2, 0, -0.2): one state each better, tied, worse; win rate 1/3 + 1/3 / 2
    assert (c.n, c.share_rl_better, c.share_tie, c.share_base_better) == pytest.approx(
        (3, 1 / 3, 1 / 3, 1 / 3)
    )
    assert c.win_rate == pytest.approx(0.5)
    # mean 0, sd (ddof 1) sqrt((0.04 + 0 + 0.04) / 2) = 0.2, half = z * 0.2 / sqrt(3)
    half = Z95 * 0.2 / math.sqrt(3)
    assert (c.mean_diff.mean, c.mean_diff.low, c.mean_diff.high) == pytest.approx((0, -half, half))
    round_trip(res)


def test_continuation_by_hand():
    res = continuation.compute({"a": [[1, 0], [1, 1]], "b": [[0, 0], [0, 0]]})
    # a: 3 of 4 continuations; Wilson with z^2 = 3.8415: denominator 1 + z^2 / 4 = 1.9604,
    # centre (0.75 + z^2 / 8) / 1.9604 = 0.6275, half z / 1.9604 * sqrt(0.75 * 0.25 / 4
    # + z^2 / 64) = 0.3269 -> [0.3006, 0.9544]
    a = res.rates["a"]
    assert (a.mean, a.n) == (0.75, 4)
    assert (a.low, a.high) == pytest.approx((0.3006, 0.9544), abs=1e-4)
    # b: none of 4 -> the interval starts at 0: [0, (z^2 / 4) / (1 + z^2 / 4)] = [0, 0.4899]
    b = res.rates["b"]
    assert (b.mean, b.low) == (0.0, 0.0) and b.high == pytest.approx(0.4899, abs=1e-4)
    round_trip(res)


def test_error_recovery_suite_by_hand(tmp_path):
    record = {
        "policies": ["base", "RL", "other"],
        "pairs": {
            "RL": {
                # 3 error states: RL better on the first, tied on the second, worse on the third
                "quality": {"base": [0.5, 0.2, 0.9], "RL": [0.7, 0.2, 0.6]},
                # 2 continuations per state
                "success": {"base": [[0, 0], [1, 0], [0, 0]], "RL": [[1, 1], [1, 0], [0, 1]]},
            }
        },
    }
    res = error_recovery.compute(record)
    assert res.suite == error_recovery.SUITE and res.base == "base"
    assert list(res.rows) == ["RL"]  # "other" has no pair in the record: no row
    row = res.rows["RL"]
    assert row.states == 3
    assert (row.better_share, row.tie_share) == pytest.approx((1 / 3, 1 / 3))
    # quality differences +0.2, 0, -0.3: mean -0.1/3, sd sqrt(((0.2 + 1/30)^2 + (1/30)^2
    # + (0.3 - 1/30)^2) / 2) = 0.2517, half width 1.96 * 0.2517 / sqrt(3) = 0.2848
    assert row.quality_diff.mean == pytest.approx(-1 / 30)
    assert row.quality_diff.high - row.quality_diff.mean == pytest.approx(0.2848, abs=1e-4)
    # continuations: RL 4 of 6, base 1 of 6 (Wilson intervals); per-state gains 1, 0, 0.5:
    # mean 0.5, sd 0.5, half width 1.96 * 0.5 / sqrt(3) = 0.5658
    assert (row.continuation.mean, row.continuation.n) == (pytest.approx(4 / 6), 6)
    assert row.base_continuation.mean == pytest.approx(1 / 6)
    assert 0 < row.continuation.low < 4 / 6 < row.continuation.high < 1
    assert row.continuation_gain.mean == pytest.approx(0.5)
    assert row.continuation_gain.low == pytest.approx(0.5 - 0.5658, abs=1e-4)
    round_trip(res)
    section = error_recovery.section(tmp_path, res)
    assert "| RL | 3 | 33.3% (33.3%) | -0.033 [" in section.markdown
    assert "| 66.7 [" in section.markdown and "+50.0 [-6.6, +106.6]" in section.markdown
    lines = (tmp_path / error_recovery.ERROR_RECOVERY_CSV).read_text().splitlines()
    assert lines[0].startswith("policy,states,quality_diff_mean") and lines[1].startswith("RL,3,")
    with pytest.raises(ValueError, match=r"successes must be \[E, G\]"):
        error_recovery.recovery([0.1], [0.2], [[1, 0]], [[1]])


def test_depth_by_hand():
    res = depth.compute([0.1, 0.2, 0.6, 0.9], {"q": [1.0, 3.0, 5.0, 7.0]}, bins=2)
    curve = res.curves["q"]
    # bins [0, 0.5) and [0.5, 1]: (1, 3) and (5, 7); means 2 and 6. A bootstrap mean of two
    # values is one of (lowest, middle, highest) with chances 1/4, 1/2, 1/4, so the 2.5% and
    # 97.5% quantiles of 2000 resamples are the lowest and the highest value.
    np.testing.assert_allclose(curve.edges, [0.0, 0.5, 1.0])
    np.testing.assert_allclose(curve.centers, [0.25, 0.75])
    np.testing.assert_allclose(curve.mean, [2.0, 6.0])
    np.testing.assert_allclose(curve.low, [1.0, 5.0])
    np.testing.assert_allclose(curve.high, [3.0, 7.0])
    np.testing.assert_array_equal(curve.count, [2, 2])
    round_trip(res)
    gap = depth.compute([0.1, 0.2], {"q": [1.0, 3.0]}, bins=2)  # nothing in [0.5, 1]: NaN
    assert gap.curves["q"].count.tolist() == [2, 0] and np.isnan(gap.curves["q"].mean[1])
    round_trip(gap)


def test_likelihood_by_hand():
    logp_rl = [[-1.0, -1.0], [-2.0, 0.0]]
    logp_base = [[-2.0, -3.0], [-1.0, 0.0]]
    mask = [[True, True], [True, False]]
    res = likelihood.compute(
        {"base": [2.0, 3.0, 1.0], "RL": [1.0, 1.0, 2.0]},
        {"set": (logp_rl, logp_base, mask, [True, False])},
    )
    llr = res.llr["set"]
    # per-turn RL - base: row 0 (+1, +2) -> cumulative (1, 3); row 1 (-1, padding) -> (-1, -1)
    np.testing.assert_allclose(llr.cum_llr, [[1.0, 3.0], [-1.0, -1.0]])
    ok, bad = llr.by_outcome["success"], llr.by_outcome["failure"]
    np.testing.assert_allclose(ok.curve.mean, [1.0, 3.0])
    assert ok.final.mean == 3.0 and bad.final.mean == -1.0
    # the failed trajectory ran 1 turn: its curve has no value at turn 2
    np.testing.assert_array_equal(bad.curve.count, [1, 0])
    assert bad.curve.mean[0] == -1.0 and np.isnan(bad.curve.mean[1])
    # lengths 2 and 1: medians 2 (success) and 1 (failure) -> L = 1, LLR_{1:1} = 1 and -1
    assert llr.length_matched.length == 1
    assert [g.mean for g in llr.length_matched.groups.values()] == [1.0, -1.0]
    # ActionNLL: base (2, 3, 1) mean 2, median 2; 50 bins over [1, 3]: base 1/3 in the bins
    # of 1, 2 and 3, RL 2/3 in 1's and 1/3 in 2's -> overlap 1/3 + 1/3 = 2/3
    assert (res.nll_summary["base"].mean.mean, res.nll_summary["base"].median) == (2.0, 2.0)
    assert res.overlap == pytest.approx(2 / 3)
    round_trip(res)


def test_dynamics_by_hand():
    res = dynamics.compute([0, 1, 2, 3], {"r": [0.0, 1.0, 2.0, 5.0]}, run="run")
    change = res.change["r"]
    # 4 logged steps: window max(1, min(2, 4 // 2), 4 // 10) = 2; start (0 + 1) / 2 = 0.5,
    # end (2 + 5) / 2 = 3.5, change 3. Welch: var (0, 1) = 0.5, var (2, 5) = 4.5 (ddof 1),
    # half = z * sqrt(0.5 / 2 + 4.5 / 2) = z * sqrt(2.5)
    assert (change.window, change.start, change.end) == (2, 0.5, 3.5)
    half = Z95 * math.sqrt(2.5)
    assert (
        change.change.mean,
        change.change.low,
        change.change.high,
        change.change.n,
    ) == pytest.approx((3.0, 3.0 - half, 3.0 + half, 4))
    assert dynamics.change_text(change) == (
        f"0.500 -> 3.500: +3.000 [{3 - half:+.3f}, {3 + half:+.3f}] "
        "(means of the first and last 2 logged steps)"
    )
    round_trip(res)
    one = dynamics.compute([0], {"r": [0.25]})
    assert (
        one.change["r"].change is None
        and dynamics.change_text(one.change["r"]) == "0.250 (one logged step)"
    )
    round_trip(one)


def test_equality_treats_nan_as_equal_and_arrays_by_value():
    a = pass_at_k.Curve(np.array([1, 2]), np.array([0.5, np.nan]))
    assert a == pass_at_k.Curve(np.array([1, 2]), np.array([0.5, np.nan]))
    assert a != pass_at_k.Curve(np.array([1, 2]), np.array([0.5, 0.6]))
    assert a != pass_at_k.Curve(np.array([1, 2, 3]), np.array([0.5, np.nan, 1.0]))
    assert same({"x": 1.0, "y": float("nan")}, {"x": 1.0, "y": float("nan")})
    assert not same({"x": 1, "y": 2}, {"y": 2, "x": 1})  # order is part of a report
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.k = np.array([3])  # frozen
