"""Pass@k and Pass@(K, T): the paper's success metrics (PAPER.md §2, §3).

Everything here is a pure NumPy function of per-task sample counts, so it is computed in
float64 on the host after a rollout; nothing is jitted.

Conventions
-----------
* A *task* was sampled ``n`` times and succeeded ``c`` times (``0 <= c <= n``).
* Unbiased estimator of Chen et al. (2021), as in §3::

      pass@k = 1 - C(n - c, k) / C(n, k)              (= 1 when n - c < k)
             = 1 - prod_{i = n-c+1 .. n} (1 - k / i)

  The product is evaluated as ``-expm1(sum log1p(-k / i))``: no binomial coefficient is
  ever formed, so ``n`` in the thousands cannot overflow, and ``expm1``/``log1p`` keep full
  relative precision both for tiny values (``c = 1``, large ``n``) and for values near 1.
* A *budget-keyed results structure* is a mapping ``{T: (n, c)}`` from an integer turn
  budget ``T`` to per-task arrays ``n`` and ``c`` of shape ``[tasks]`` measured with
  that budget in the prompt (each T sampled afresh, never a truncation of longer runs).
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import numpy as np

BUDGET_PERCENTS: tuple[int, ...] = (25, 50, 75, 100)
"""The paper's table budget levels, in percent of ``T_max`` (§3)."""

PASS_AT_K_RANGE: tuple[int, ...] = tuple(range(1, 129))
"""The Pass@K curve's k = 1..128 at full budget (§3)."""

PASS_AT_T_K = 8
"""Pass@T and the budget tables fix k = 8 (§3)."""

BudgetResults = Mapping[int, tuple[np.ndarray, np.ndarray]]
"""``{budget T: (n [tasks], c [tasks])}``."""


def _as_counts(n, c) -> tuple[np.ndarray, np.ndarray]:
    """Validated int64 copies of ``n`` and ``c``, broadcast to one shape ``[tasks]``."""
    n_arr = np.asarray(n)
    c_arr = np.asarray(c)
    for name, arr in (("n", n_arr), ("c", c_arr)):
        if arr.dtype.kind not in "iub":
            if arr.dtype.kind != "f" or not np.all(arr == np.round(arr)):
                raise ValueError(
                    f"pass@k: `{name}` must hold integer counts, got dtype {arr.dtype}"
                )
    n_arr, c_arr = np.broadcast_arrays(n_arr.astype(np.int64), c_arr.astype(np.int64))
    if n_arr.ndim > 1:
        raise ValueError(f"pass@k: `n` and `c` must be scalars or [tasks], got shape {n_arr.shape}")
    n_arr, c_arr = n_arr.reshape(-1), c_arr.reshape(-1)
    if np.any(n_arr < 1):
        raise ValueError(f"pass@k: `n` (samples per task) must be >= 1, got min {n_arr.min()}")
    if np.any(c_arr < 0) or np.any(c_arr > n_arr):
        bad = int(np.flatnonzero((c_arr < 0) | (c_arr > n_arr))[0])
        raise ValueError(
            f"pass@k: `c` (successes) must lie in [0, n]; "
            f"task {bad} has n={n_arr[bad]}, c={c_arr[bad]}"
        )
    return n_arr, c_arr


def _as_ks(k) -> np.ndarray:
    ks = np.atleast_1d(np.asarray(k))
    if ks.ndim != 1 or ks.dtype.kind not in "iu" or np.any(ks < 1):
        raise ValueError(f"pass@k: `k` must be positive integers (scalar or 1-D), got {k!r}")
    return ks.astype(np.int64)


def pass_at_k_matrix(n, c, ks: int | Sequence[int] | np.ndarray) -> np.ndarray:
    """Unbiased pass@k of every task at every k.

    Args:
      n: ``[tasks]`` int, samples drawn per task (broadcasts with ``c``).
      c: ``[tasks]`` int, successes among them, ``0 <= c <= n``.
      ks: int or ``[K]`` ints, each ``1 <= k <= min(n)``.

    Returns:
      ``[tasks, K]`` float64 in [0, 1].

    Raises:
      ValueError: on a bad count, or a ``k`` larger than some task's ``n`` (the estimator
        is undefined there; resample more or drop the task).
    """
    n_arr, c_arr = _as_counts(n, c)
    ks_arr = _as_ks(ks)
    if n_arr.size and ks_arr.max() > n_arr.min():
        raise ValueError(
            f"pass@k: k={int(ks_arr.max())} exceeds the smallest sample count n={int(n_arr.min())}"
        )
    out = np.ones((n_arr.size, ks_arr.size), dtype=np.float64)
    if n_arr.size == 0:
        return out
    # Ragged ranges i = n-c+1 .. n become a padded [tasks, max_c] grid with a mask; the loop
    # below is over the (at most 128) k values, each step vectorised over all tasks.
    max_c = int(c_arr.max())
    j = np.arange(max_c, dtype=np.int64)
    i = (n_arr - c_arr + 1)[:, None] + j[None, :]  # [tasks, max_c]
    in_range = j[None, :] < c_arr[:, None]
    i_float = i.astype(np.float64)
    for col, k in enumerate(ks_arr):
        defined = n_arr - c_arr >= k  # else pass@k = 1 exactly; also keeps every i > k
        use = in_range & defined[:, None]
        terms = np.where(use, np.log1p(-k / np.where(use, i_float, np.inf)), 0.0)
        out[:, col] = np.where(defined, 0.0 - np.expm1(terms.sum(axis=1)), 1.0)  # 0.0 - : no -0.0
    return out


def pass_at_k(n, c, k: int) -> np.ndarray:
    """Unbiased pass@k per task for one ``k``: ``[tasks]`` float64 (see ``pass_at_k_matrix``)."""
    if not np.isscalar(k):
        raise ValueError("pass_at_k: `k` must be one integer; use pass_at_k_matrix for many")
    return pass_at_k_matrix(n, c, k)[:, 0]


def pass_at_k_curve(n, c, ks: Sequence[int] | np.ndarray = PASS_AT_K_RANGE) -> np.ndarray:
    """Pass@K curve: mean over tasks of pass@k, ``[K]`` float64 (default k = 1..128)."""
    return pass_at_k_matrix(n, c, ks).mean(axis=0)


def counts_from_successes(successes, mask=None) -> tuple[np.ndarray, np.ndarray]:
    """Per-task ``(n, c)`` from a padded ``[tasks, samples]`` success array.

    Args:
      successes: ``[tasks, samples]`` bool (or 0/1).
      mask: optional ``[tasks, samples]`` bool, True where a sample exists (ragged counts).

    Returns:
      ``(n, c)``: two ``[tasks]`` int64 arrays.
    """
    s = np.asarray(successes)
    if s.ndim != 2:
        raise ValueError(
            f"counts_from_successes: `successes` must be [tasks, samples], got shape {s.shape}"
        )
    if not np.all((s == 0) | (s == 1)):
        raise ValueError("counts_from_successes: `successes` must be boolean / 0-1")
    m = np.ones(s.shape, dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
    if m.shape != s.shape:
        raise ValueError(
            f"counts_from_successes: `mask` shape {m.shape} != `successes` shape {s.shape}"
        )
    return m.sum(axis=1).astype(np.int64), (s.astype(bool) & m).sum(axis=1).astype(np.int64)


def budget_levels(t_max: int, percents: Iterable[int] = BUDGET_PERCENTS) -> tuple[int, ...]:
    """Turn budgets at the given percentages of ``T_max``: ``(p * T_max) // 100`` each.

    Integer floor division, like BudgetMix's ``(k * T_max) // 10`` (§5), so the levels are
    exact and reproducible: FrozenLake's ``T_max = 70`` gives ``(17, 35, 52, 70)``.

    Raises:
      ValueError: when ``t_max < 1``, a percent is outside (0, 100], or a level floors to 0.
    """
    if int(t_max) != t_max or t_max < 1:
        raise ValueError(f"budget_levels: `t_max` must be a positive integer, got {t_max!r}")
    levels = []
    for p in percents:
        if int(p) != p or not 0 < p <= 100:
            raise ValueError(
                f"budget_levels: each percent must be an integer in (0, 100], got {p!r}"
            )
        level = (int(p) * int(t_max)) // 100
        if level < 1:
            raise ValueError(f"budget_levels: {p}% of T_max={t_max} floors to 0 turns")
        levels.append(level)
    return tuple(levels)


def pass_at_k_by_budget(results: BudgetResults, k: int = PASS_AT_T_K) -> dict[int, float]:
    """Pass@(k, T) for every budget in a budget-keyed results structure.

    Args:
      results: ``{T: (n [tasks], c [tasks])}``.
      k: the number of attempts (default 8, as in §3).

    Returns:
      ``{T: mean over tasks of pass@k}``, in increasing T.
    """
    out = {}
    for budget in sorted(results):
        n, c = results[budget]
        try:
            out[int(budget)] = float(pass_at_k(n, c, k).mean())
        except ValueError as err:
            raise ValueError(f"pass_at_k_by_budget: budget T={budget}: {err}") from None
    return out


def pass_at_t_curve(results: BudgetResults, k: int = PASS_AT_T_K) -> tuple[np.ndarray, np.ndarray]:
    """Pass@T curve at fixed ``k``: ``(budgets [B] int64, pass@(k, T) [B] float64)`` by T."""
    by_budget = pass_at_k_by_budget(results, k)
    return np.array(list(by_budget), dtype=np.int64), np.array(list(by_budget.values()))


def pass_at_k_table(
    results_by_policy: Mapping[str, BudgetResults],
    budgets: Sequence[int],
    k: int = PASS_AT_T_K,
) -> dict[str, dict[int, float]]:
    """Table-1-style Pass@k at given budgets: ``{policy: {T: pass@(k, T)}}``.

    Every policy must have results at every requested budget; a missing one is an error
    naming the policy and budget (a table with holes would silently mislead).
    """
    table: dict[str, dict[int, float]] = {}
    for policy, results in results_by_policy.items():
        missing = [b for b in budgets if b not in results]
        if missing:
            raise ValueError(
                f"pass_at_k_table: policy {policy!r} has no results at budgets {missing}"
            )
        row = pass_at_k_by_budget({b: results[b] for b in budgets}, k)
        table[policy] = {int(b): row[int(b)] for b in budgets}
    return table


def structural_upper_bound(shortest_paths, budgets) -> np.ndarray:
    """Share of tasks whose shortest start-to-goal path is ``<= T``, for each budget T (§2).

    No policy can beat this at budget T on deterministic maps (on slippery maps it is a
    necessary condition only).

    Args:
      shortest_paths: ``[tasks]`` shortest path length in moves; unreachable goals are
        ``np.inf`` (or any value above every budget). Negative values are rejected, so a
        ``-1`` "unreachable" sentinel cannot silently count as solvable.
      budgets: ``[B]`` turn budgets.

    Returns:
      ``[B]`` float64 in [0, 1].
    """
    d = np.asarray(shortest_paths, dtype=np.float64).reshape(-1)
    t = np.asarray(budgets, dtype=np.float64).reshape(-1)
    if d.size == 0:
        raise ValueError("structural_upper_bound: `shortest_paths` is empty")
    if np.any(np.isnan(d)) or np.any(d < 0):
        raise ValueError(
            "structural_upper_bound: `shortest_paths` must be >= 0 "
            "(use np.inf for unreachable goals)"
        )
    return (d[None, :] <= t[:, None]).mean(axis=1)
