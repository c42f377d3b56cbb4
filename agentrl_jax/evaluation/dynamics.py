"""Training dynamics (§7.5): how a logged curve (R_multi, R_single) changed over training.

One computation, :func:`start_to_end`, serves every place the change is shown (the training
dynamics section and its figure, the reproduction's start-to-end table, the findings): the
mean of the last ``w`` logged values minus the mean of the first ``w`` (``w``:
:func:`change_window`), with a normal CI (:func:`difference_of_means`).
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any

import numpy as np

from agentrl_jax.evaluation import stats


def difference_of_means(before: np.ndarray, after: np.ndarray,
                        confidence: float = stats.DEFAULT_CONFIDENCE) -> stats.MeanCI:
    """``mean(after) - mean(before)`` of two independent samples with a normal (Welch) CI,
    ``z * sqrt(var_a / n_a + var_b / n_b)``; NaN bounds when either has fewer than 2 values.
    ``n`` is the total number of values."""
    a = np.asarray(before, np.float64).reshape(-1)
    b = np.asarray(after, np.float64).reshape(-1)
    if a.size == 0 or b.size == 0:
        raise ValueError("difference_of_means: both samples need values")
    diff = float(b.mean() - a.mean())
    if a.size < 2 or b.size < 2:
        return stats.MeanCI(diff, math.nan, math.nan, int(a.size + b.size))
    z = NormalDist().inv_cdf(0.5 + confidence / 2.0)
    half = z * math.sqrt(a.var(ddof=1) / a.size + b.var(ddof=1) / b.size)
    return stats.MeanCI(diff, diff - half, diff + half, int(a.size + b.size))


def change_window(count: int) -> int:
    """Logged steps averaged at each end of a training curve: a tenth of them, at least 2
    when there are 4 or more (so the change has a CI), else 1."""
    if count < 1:
        raise ValueError("change_window: no logged values")
    return max(1, min(2, count // 2), count // 10)


def start_to_end(values: np.ndarray) -> dict[str, Any]:
    """Change of a training curve from its start to its end: the mean of the last ``w``
    logged (finite) values minus the mean of the first ``w`` (:func:`change_window`), with the
    CI of :func:`difference_of_means`. Averaging a few steps at each end keeps one noisy batch
    from deciding the sign."""
    v = np.asarray(values, np.float64)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return {"window": 0, "start": None, "end": None, "change": None}
    w = change_window(v.size)
    change = difference_of_means(v[:w], v[-w:]) if v.size >= 2 else None
    return {"window": w, "start": float(v[:w].mean()), "end": float(v[-w:].mean()),
            "change": change}
