"""Budget robustness: how much of what the budgets allow a policy achieves, in one number.

The score of a policy over budgets ``T_1..T_m`` is the area under its Pass@(k, T) curve divided
by the area under the structural bound's (the share of tasks whose shortest path fits in T,
§2), both summed over the same budgets:

    R = sum_T mean_i pass_i(T) / sum_T mean_i bound_i(T),   bound_i(T) = [shortest_i <= T]

i.e. the ratio of two means over tasks, ``mean_i a_i / mean_i d_i`` with ``a_i = sum_T
pass_i(T)`` and ``d_i = sum_T bound_i(T)``. 1 is a policy that solves every task whenever
its budget allows (on deterministic maps, exactly the Q*-optimal policy); a policy that only
succeeds with slack scores low at small budgets and so overall. The 95% CI is the delta
method's for a ratio of means over tasks (``var(a_i - R d_i) / (n mean(d)^2)``).

``compute`` -> :class:`Robustness` (every policy's score over the same budgets);
:func:`section` writes ``budget_robustness.json`` and the report section (a table, no figure).
"""

from __future__ import annotations

import math
from pathlib import Path
from statistics import NormalDist
from typing import Mapping, Sequence

import numpy as np

from agentrl_jax.evaluation import passk, stats
from agentrl_jax.evaluation.report import Section, rel, write_json
from agentrl_jax.evaluation.result import Result, result

ROBUSTNESS_JSON = "budget_robustness.json"


def robustness_score(
    pass_by_budget: Mapping[int, np.ndarray],
    shortest_paths: Sequence[int],
    confidence: float = stats.DEFAULT_CONFIDENCE,
) -> stats.MeanCI:
    """``R`` with its CI (module docstring). ``pass_by_budget``: ``{T: [tasks] pass@k}``;
    ``shortest_paths``: ``[tasks]`` fewest moves per task. ``n`` is the number of tasks."""
    budgets = sorted(pass_by_budget)
    if not budgets:
        raise ValueError("robustness_score: no budgets")
    shortest = np.asarray(shortest_paths, np.float64)
    achieved = np.sum([np.asarray(pass_by_budget[b], np.float64) for b in budgets], axis=0)
    allowed = np.sum([(shortest <= b).astype(np.float64) for b in budgets], axis=0)
    if achieved.shape != shortest.shape:
        raise ValueError(
            f"robustness_score: {achieved.shape[0]} tasks of pass@k but "
            f"{shortest.shape[0]} shortest paths"
        )
    n, mean_allowed = shortest.size, float(allowed.mean())
    if mean_allowed == 0:
        return stats.MeanCI(math.nan, math.nan, math.nan, n)
    score = float(achieved.mean()) / mean_allowed
    if n < 2:
        return stats.MeanCI(score, math.nan, math.nan, n)
    z = NormalDist().inv_cdf(0.5 + confidence / 2.0)
    half = z * math.sqrt(np.var(achieved - score * allowed, ddof=1) / n) / mean_allowed
    return stats.MeanCI(score, score - half, score + half, n)


def robustness_from_counts(
    counts: Mapping[int, tuple[np.ndarray, np.ndarray]], k: int, shortest_paths: Sequence[int]
) -> stats.MeanCI:
    """:func:`robustness_score` of ``{T: (n [tasks], c [tasks])}`` success counts at pass@``k``."""
    return robustness_score(
        {int(b): passk.pass_at_k(n, c, k) for b, (n, c) in counts.items()}, shortest_paths
    )


@result
class Robustness(Result):
    """``scores``: ``{policy: MeanCI}`` of :func:`robustness_score` at pass@``k`` over
    ``budgets``."""

    k: int
    budgets: tuple[int, ...]
    scores: dict[str, stats.MeanCI]


def compute(
    counts_by_policy: Mapping[str, passk.BudgetResults], k: int, shortest_paths: Sequence[int]
) -> Robustness:
    """Each policy's score from ``{policy: {T: (n [tasks], c [tasks])}}`` (all at the same
    budgets) and the tasks' ``[tasks]`` shortest paths."""
    scores = {
        p: robustness_from_counts(counts, k, shortest_paths)
        for p, counts in counts_by_policy.items()
    }
    budgets = sorted({int(b) for counts in counts_by_policy.values() for b in counts})
    return Robustness(int(k), tuple(budgets), scores)


def section(folder: str | Path, res: Robustness) -> Section:
    """``budget_robustness.json`` (the result) and the section "Budget robustness"."""
    folder = Path(folder)
    path = write_json(folder / ROBUSTNESS_JSON, res)
    rows = ["| policy | robustness [95% CI] |", "|---|---|"]
    rows += [
        f"| {p.replace('|', chr(92) + '|')} | {s.mean:.3f} [{s.low:.3f}, {s.high:.3f}] |"
        for p, s in res.scores.items()
    ]
    budgets = res.budgets
    text = (
        f"Area under each policy's Pass@{res.k} curve over the budgets T = {budgets[0]}.."
        f"{budgets[-1]} ({len(budgets)} budgets) divided by the structural bound's area (the "
        "share of tasks whose shortest path fits in T): 1 solves every task whenever its "
        "budget allows. 95% CI: delta method over tasks (a ratio of two means)."
    )
    return Section(
        "Budget robustness", text, files=(rel(folder, path),), markdown="\n".join(rows) + "\n"
    )
