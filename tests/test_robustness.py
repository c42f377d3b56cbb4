"""The budget-robustness score against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from agentrl_jax.evaluation.analyses.robustness import robustness_from_counts, robustness_score


def test_the_score_is_the_ratio_of_the_two_areas_with_a_delta_method_ci():
    # 3 tasks with shortest paths 1, 2, 5 over budgets 2 and 4: the bound allows tasks 0, 1 at
    # both budgets and task 2 at neither: area 2/3 + 2/3 = 4/3 per budget sum
    pass_by_budget = {2: np.array([1.0, 0.0, 0.0]), 4: np.array([1.0, 0.5, 0.0])}
    score = robustness_score(pass_by_budget, [1, 2, 5])
    achieved, allowed = np.array([2.0, 0.5, 0.0]), np.array([2.0, 2.0, 0.0])
    r = achieved.mean() / allowed.mean()  # (2.5 / 3) / (4 / 3) = 0.625
    assert score.mean == pytest.approx(0.625) == pytest.approx(r)
    half = (
        1.959963984540054 * math.sqrt(np.var(achieved - r * allowed, ddof=1) / 3) / allowed.mean()
    )
    assert (score.low, score.high, score.n) == (pytest.approx(r - half), pytest.approx(r + half), 3)


def test_an_optimal_policy_scores_one_and_counts_give_the_same_score():
    shortest = np.array([2, 3, 9])
    perfect = {t: (shortest <= t).astype(float) for t in (2, 4, 6)}
    assert robustness_score(perfect, shortest).mean == pytest.approx(1.0)
    counts = {t: (np.full(3, 8), np.array([8, 4, 0])) for t in (2, 4)}  # pass@1 = c / n
    expected = robustness_score({t: np.array([1.0, 0.5, 0.0]) for t in (2, 4)}, shortest)
    assert robustness_from_counts(counts, 1, shortest).mean == pytest.approx(expected.mean)
    nothing_fits = robustness_score({1: np.zeros(2)}, [5, 6])
    assert math.isnan(nothing_fits.mean)
