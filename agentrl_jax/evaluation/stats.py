"""Generic statistics behind the analyses (PAPER.md §7), as pure NumPy functions: confidence
intervals (normal, bootstrap, Wilson), paired comparisons, binned curves, per-turn curves.
What belongs to one analysis lives with it (:mod:`agentrl_jax.evaluation.analyses`).

Array in, small frozen result records out; no files, no plotting. Randomness (bootstrap)
comes only from an explicit ``seed`` so every number in a report is reproducible.

Conventions
-----------
* Confidence intervals are two-sided at ``confidence`` (default 0.95).
* "normal" CIs are ``mean +- z * sd / sqrt(n)`` with the sample sd (ddof = 1) and the
  standard normal quantile z (1.95996 at 95%); with fewer than 2 values the bounds are NaN.
* "bootstrap" CIs are percentile bootstrap intervals of the mean: ``n_resamples`` resamples
  of the values with replacement. Values are treated as independent; states taken from the
  same trajectory are not, so such bands are somewhat narrow (a per-trajectory cluster
  bootstrap would widen them).
* Per-turn arrays are padded ``[trajectories, turns]`` with a bool ``turn_mask`` that is
  True on turns that happened; every turn mask must be a prefix (turns 0..L-1 valid).
"""

from __future__ import annotations

import dataclasses
import math
import statistics

import numpy as np

DEFAULT_CONFIDENCE = 0.95
DEFAULT_RESAMPLES = 2000


@dataclasses.dataclass(frozen=True)
class MeanCI:
    """A mean with a two-sided confidence interval over ``n`` values."""

    mean: float
    low: float
    high: float
    n: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _z(confidence: float) -> float:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"`confidence` must lie in (0, 1), got {confidence!r}")
    return statistics.NormalDist().inv_cdf(0.5 + confidence / 2.0)


def finite_1d(x, name: str) -> np.ndarray:
    """``x`` flattened to float64 ``[N]``; ``ValueError`` naming ``name`` if any is not finite."""
    arr = np.asarray(x, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(arr)):
        raise ValueError(
            f"`{name}` holds non-finite values ({int((~np.isfinite(arr)).sum())} of {arr.size})"
        )
    return arr


def mean_ci_normal(x, confidence: float = DEFAULT_CONFIDENCE) -> MeanCI:
    """Mean of ``x`` (any shape, flattened) with a normal-approximation CI."""
    z = _z(confidence)
    v = finite_1d(x, "x")
    if v.size == 0:
        return MeanCI(float("nan"), float("nan"), float("nan"), 0)
    mean = float(v.mean())
    if v.size < 2:
        return MeanCI(mean, float("nan"), float("nan"), 1)
    half = z * float(v.std(ddof=1)) / np.sqrt(v.size)
    return MeanCI(mean, mean - half, mean + half, int(v.size))


def bootstrap_means(x, *, n_resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> np.ndarray:
    """Means of ``n_resamples`` bootstrap resamples of ``x``: ``[n_resamples]`` float64."""
    v = finite_1d(x, "x")
    if v.size == 0:
        raise ValueError("bootstrap_means: `x` is empty")
    if n_resamples < 1:
        raise ValueError(f"bootstrap_means: `n_resamples` must be >= 1, got {n_resamples}")
    rng = np.random.default_rng(seed)
    # Chunked so that memory stays ~8 MB whatever n is.
    chunk = max(1, 1_000_000 // v.size)
    means = np.empty(n_resamples)
    for start in range(0, n_resamples, chunk):
        stop = min(n_resamples, start + chunk)
        idx = rng.integers(0, v.size, size=(stop - start, v.size))
        means[start:stop] = v[idx].mean(axis=1)
    return means


def mean_ci_bootstrap(
    x,
    confidence: float = DEFAULT_CONFIDENCE,
    *,
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> MeanCI:
    """Mean of ``x`` with a percentile-bootstrap CI (NaN bounds when ``x`` is empty)."""
    _z(confidence)
    v = finite_1d(x, "x")
    if v.size == 0:
        return MeanCI(float("nan"), float("nan"), float("nan"), 0)
    means = bootstrap_means(v, n_resamples=n_resamples, seed=seed)
    alpha = 1.0 - confidence
    low, high = np.quantile(means, [alpha / 2.0, 1.0 - alpha / 2.0])
    return MeanCI(float(v.mean()), float(low), float(high), int(v.size))


def proportion_ci_wilson(successes, confidence: float = DEFAULT_CONFIDENCE) -> MeanCI:
    """Success rate of 0/1 outcomes (any shape, flattened) with the Wilson score interval.

    Preferred for rates such as continuation success: unlike the normal interval it stays
    inside [0, 1] and does not collapse to a point at 0% or 100%.
    """
    z = _z(confidence)
    v = finite_1d(successes, "successes")
    if not np.all((v == 0) | (v == 1)):
        raise ValueError("proportion_ci_wilson: `successes` must be 0/1 outcomes")
    n = v.size
    if n == 0:
        return MeanCI(float("nan"), float("nan"), float("nan"), 0)
    p = float(v.mean())
    denom = 1.0 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z / denom * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    # Rounding can leave a bound a hair past p (2.8e-17 above p = 0 at n = 10): clamp it.
    return MeanCI(p, min(p, max(0.0, center - half)), max(p, min(1.0, center + half)), n)


def mean_ci(
    x, confidence: float = DEFAULT_CONFIDENCE, *, method: str = "normal", seed: int = 0
) -> MeanCI:
    """Mean with a CI by ``method`` = ``"normal"``, ``"bootstrap"`` or ``"wilson"`` (0/1 data)."""
    if method == "normal":
        return mean_ci_normal(x, confidence)
    if method == "bootstrap":
        return mean_ci_bootstrap(x, confidence, seed=seed)
    if method == "wilson":
        return proportion_ci_wilson(x, confidence)
    raise ValueError(f"mean_ci: `method` must be 'normal', 'bootstrap' or 'wilson', got {method!r}")


def masked_mean(values, mask, axis: int = -1) -> np.ndarray:
    """Mean of ``values`` over ``axis`` counting only entries where ``mask`` is True.

    E.g. the per-state quality from ``G`` sampled actions: ``values [S, G]``, ``mask [S, G]``
    (False for invalid or absent actions) -> ``[S]``. Rows with no valid entry give NaN.
    """
    v = np.asarray(values, dtype=np.float64)
    m = np.asarray(mask, dtype=bool)
    if v.shape != m.shape:
        raise ValueError(f"masked_mean: `values` shape {v.shape} != `mask` shape {m.shape}")
    total = np.where(m, v, 0.0).sum(axis=axis)
    count = m.sum(axis=axis)
    return np.where(count > 0, total / np.maximum(count, 1), np.nan)


# ---------------------------------------------------------------- paired comparisons


@dataclasses.dataclass(frozen=True)
class PairedComparison:
    """RL vs base on the same states (§7.1, §7.2).

    ``share_rl_better`` counts states where ``q_rl - q_base > tie_tol`` (strictly better);
    states with ``|q_rl - q_base| <= tie_tol`` are ties and are counted in ``share_tie``,
    never as wins, so ``share_rl_better + share_tie + share_base_better == 1``.
    ``win_rate`` = share_rl_better + share_tie / 2 is the tie-neutral summary (0.5 = no edge).
    ``mean_diff`` is the mean of ``q_rl - q_base`` with its CI.
    """

    n: int
    share_rl_better: float
    share_tie: float
    share_base_better: float
    win_rate: float
    mean_diff: MeanCI

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["mean_diff"] = self.mean_diff.to_dict()
        return d


def paired_comparison(
    q_rl,
    q_base,
    *,
    tie_tol: float = 1e-9,
    confidence: float = DEFAULT_CONFIDENCE,
    method: str = "normal",
    seed: int = 0,
) -> PairedComparison:
    """Compare two policies' per-state quality on matched states.

    Args:
      q_rl: ``[S]`` per-state quality of the RL policy (e.g. mean Q* over G actions).
      q_base: ``[S]`` the base policy's quality on the same states, same order.
      tie_tol: differences with absolute value ``<= tie_tol`` are ties. The default absorbs
        float rounding only; Q* values from the same DP are compared exactly.
      method: CI of the mean difference, ``"normal"`` or ``"bootstrap"``.
    """
    rl = finite_1d(q_rl, "q_rl")
    base = finite_1d(q_base, "q_base")
    if rl.shape != base.shape:
        raise ValueError(
            f"paired_comparison: `q_rl` has {rl.size} states but `q_base` has {base.size}"
        )
    if rl.size == 0:
        raise ValueError("paired_comparison: no states")
    if tie_tol < 0:
        raise ValueError(f"paired_comparison: `tie_tol` must be >= 0, got {tie_tol}")
    diff = rl - base
    better = float(np.mean(diff > tie_tol))
    worse = float(np.mean(diff < -tie_tol))
    tie = 1.0 - better - worse
    return PairedComparison(
        n=int(diff.size),
        share_rl_better=better,
        share_tie=tie,
        share_base_better=worse,
        win_rate=better + tie / 2.0,
        mean_diff=mean_ci(diff, confidence, method=method, seed=seed),
    )


def paired_difference(a, b, confidence: float = DEFAULT_CONFIDENCE) -> MeanCI:
    """Mean over units (tasks, states) of ``a - b`` (both ``[N]``, the same units in the same
    order, so the difference is paired) with a normal CI: :func:`paired_comparison`'s."""
    return paired_comparison(a, b, confidence=confidence).mean_diff


def difference_of_means(
    before: np.ndarray, after: np.ndarray, confidence: float = DEFAULT_CONFIDENCE
) -> MeanCI:
    """``mean(after) - mean(before)`` of two independent samples with a normal (Welch) CI,
    ``z * sqrt(var_a / n_a + var_b / n_b)``; NaN bounds when either has fewer than 2 values.
    ``n`` is the total number of values."""
    a = np.asarray(before, np.float64).reshape(-1)
    b = np.asarray(after, np.float64).reshape(-1)
    if a.size == 0 or b.size == 0:
        raise ValueError("difference_of_means: both samples need values")
    diff = float(b.mean() - a.mean())
    if a.size < 2 or b.size < 2:
        return MeanCI(diff, math.nan, math.nan, int(a.size + b.size))
    z = _z(confidence)
    half = z * math.sqrt(a.var(ddof=1) / a.size + b.var(ddof=1) / b.size)
    return MeanCI(diff, diff - half, diff + half, int(a.size + b.size))


# ---------------------------------------------------------------- curves over depth


def normalised_depth(turn, t_max) -> np.ndarray:
    """``d_t = t / T_max`` (§7.3), float64 of ``turn``'s shape. ``t`` counts completed turns."""
    t = np.asarray(turn, dtype=np.float64)
    t_max_arr = np.asarray(t_max, dtype=np.float64)
    if np.any(t_max_arr <= 0):
        raise ValueError("normalised_depth: `t_max` must be > 0")
    if np.any(t < 0) or np.any(t > t_max_arr):
        raise ValueError("normalised_depth: `turn` must lie in [0, t_max]")
    return t / t_max_arr


@dataclasses.dataclass(frozen=True)
class BinnedCurve:
    """Per-bin means with CI bands; all arrays ``[bins]``; empty bins hold NaN and count 0."""

    edges: np.ndarray  # [bins + 1]
    centers: np.ndarray
    mean: np.ndarray
    low: np.ndarray
    high: np.ndarray
    count: np.ndarray

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name).tolist() for f in dataclasses.fields(self)}


def binned_curve(
    x,
    y,
    *,
    bins: int | np.ndarray = 10,
    value_range: tuple[float, float] = (0.0, 1.0),
    confidence: float = DEFAULT_CONFIDENCE,
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> BinnedCurve:
    """Mean of ``y`` in bins of ``x`` with percentile-bootstrap bands (quality vs depth, §7.3).

    Args:
      x: ``[N]`` positions, e.g. :func:`normalised_depth` of each state.
      y: ``[N]`` values, e.g. per-state quality or the RL - base difference.
      bins: number of equal bins over ``value_range`` or explicit ``[bins + 1]`` edges.
        Bins are half-open ``[lo, hi)`` except the last, which includes its right edge
        (so depth 1.0 = the last turn lands in the last bin). Points outside are an error.
      seed: each bin uses ``seed + bin index``, so bands do not depend on other bins.
    """
    xv = finite_1d(x, "x")
    yv = finite_1d(y, "y")
    if xv.shape != yv.shape:
        raise ValueError(f"binned_curve: `x` has {xv.size} points but `y` has {yv.size}")
    if np.isscalar(bins):
        if int(bins) < 1:
            raise ValueError(f"binned_curve: `bins` must be >= 1, got {bins}")
        edges = np.linspace(value_range[0], value_range[1], int(bins) + 1)
    else:
        edges = np.asarray(bins, dtype=np.float64)
        if edges.ndim != 1 or edges.size < 2 or np.any(np.diff(edges) <= 0):
            raise ValueError("binned_curve: explicit `bins` must be >= 2 strictly increasing edges")
    if np.any(xv < edges[0]) or np.any(xv > edges[-1]):
        raise ValueError(f"binned_curve: `x` has points outside [{edges[0]}, {edges[-1]}]")
    n_bins = edges.size - 1
    which = np.clip(np.searchsorted(edges, xv, side="right") - 1, 0, n_bins - 1)
    mean, low, high = (np.full(n_bins, np.nan) for _ in range(3))
    count = np.bincount(which, minlength=n_bins)
    for b in range(n_bins):  # a handful of bins; each bootstrap is vectorised
        if count[b]:
            ci = mean_ci_bootstrap(
                yv[which == b], confidence, n_resamples=n_resamples, seed=seed + b
            )
            mean[b], low[b], high[b] = ci.mean, ci.low, ci.high
    return BinnedCurve(edges, (edges[:-1] + edges[1:]) / 2.0, mean, low, high, count)


# ---------------------------------------------------------------- per-turn arrays (§7.4)


def prefix_mask(turn_mask) -> np.ndarray:
    """``turn_mask`` ``[N, T]`` as bool, checked to be a prefix mask (turns 0..L-1 valid)."""
    m = np.asarray(turn_mask, dtype=bool)
    if m.ndim != 2:
        raise ValueError(f"`turn_mask` must be [trajectories, turns], got shape {m.shape}")
    if np.any(m[:, 1:] & ~m[:, :-1]):
        raise ValueError("`turn_mask` must be a prefix mask (turns 0..L-1 valid, the rest padding)")
    return m


def turn_arrays(name: str, values, turn_mask) -> tuple[np.ndarray, np.ndarray]:
    """``(values [N, T] float64, turn_mask [N, T] bool)``, checked: same shape, a prefix mask,
    finite values on valid turns."""
    v = np.asarray(values, dtype=np.float64)
    m = prefix_mask(turn_mask)
    if v.shape != m.shape:
        raise ValueError(
            f"`{name}` must be [trajectories, turns] like `turn_mask`; got {v.shape} vs {m.shape}"
        )
    if not np.all(np.isfinite(v[m])):
        raise ValueError(f"`{name}` holds non-finite values on valid turns")
    return v, m


@dataclasses.dataclass(frozen=True)
class TurnCurve:
    """Mean over trajectories still running at each turn; arrays ``[T]``, NaN where count < 1."""

    turn: np.ndarray  # 1-based turn index t (LLR_{1:t})
    mean: np.ndarray
    low: np.ndarray
    high: np.ndarray
    count: np.ndarray

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name).tolist() for f in dataclasses.fields(self)}


def turn_curve(
    per_turn, turn_mask, select=None, confidence: float = DEFAULT_CONFIDENCE
) -> TurnCurve:
    """Mean of ``per_turn[:, t]`` over selected trajectories that reached turn t, normal CI.

    Args:
      per_turn: ``[N, T]`` e.g. :func:`cumulative_llr`.
      turn_mask: ``[N, T]`` prefix mask.
      select: optional ``[N]`` bool, the trajectories to include (e.g. ``success``).
    """
    v, m = turn_arrays("per_turn", per_turn, turn_mask)
    if select is not None:
        sel = np.asarray(select, dtype=bool).reshape(-1)
        if sel.size != v.shape[0]:
            raise ValueError(
                f"turn_curve: `select` has {sel.size} entries for {v.shape[0]} trajectories"
            )
        m = m & sel[:, None]
    count = m.sum(axis=0)
    z = _z(confidence)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(m, v, 0.0).sum(axis=0) / count
        sq = np.where(m, (v - mean) ** 2, 0.0).sum(axis=0)
        half = z * np.sqrt(sq / (count - 1)) / np.sqrt(count)
    half = np.where(count >= 2, half, np.nan)
    mean = np.where(count >= 1, mean, np.nan)
    return TurnCurve(np.arange(1, v.shape[1] + 1), mean, mean - half, mean + half, count)
