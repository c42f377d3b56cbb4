"""Pass@K at the full budget (PAPER.md §3, Figure 2): the unbiased pass@k of each policy for
k = 1..K, from per-task counts ``n`` (samples) and ``c`` (successes).

``compute`` -> :class:`PassAtK`; :func:`plot_pass_at_k` draws it; :func:`section` writes
``<name>.json``, ``<name>.csv`` and the figure and returns the report section.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from agentrl_jax.evaluation import figures, passk
from agentrl_jax.evaluation.report import Section, figure_path, rel, write_csv, write_json
from agentrl_jax.evaluation.result import Result, result


@result
class Curve(Result):
    """One policy's Pass@K curve: ``k [K]`` int, ``pass_at_k [K]`` float64."""

    k: np.ndarray
    pass_at_k: np.ndarray


@result
class PassAtK(Result):
    """``curves``: ``{policy: Curve}``; ``k_dropped_for_too_few_samples``: ``{policy: ks}``
    above the policy's smallest ``n`` (pass@k is undefined there)."""

    curves: dict[str, Curve]
    k_dropped_for_too_few_samples: dict[str, tuple[int, ...]]


def compute(
    counts_by_policy: Mapping[str, tuple[Any, Any]], ks: Sequence[int] = passk.PASS_AT_K_RANGE
) -> PassAtK:
    """Pass@K curves of ``{policy: (n [tasks], c [tasks])}``; ``ks`` above a policy's smallest
    ``n`` are dropped for that policy (``ValueError`` when that leaves none)."""
    curves, dropped = {}, {}
    for policy, (n, c) in counts_by_policy.items():
        n_min = int(np.min(n))
        usable = [k for k in ks if k <= n_min]
        if not usable:
            raise ValueError(
                f"pass_at_k: policy {policy!r} has n={n_min} samples, fewer than every k"
            )
        dropped[policy] = tuple(k for k in ks if k > n_min)
        curves[policy] = Curve(np.asarray(usable), passk.pass_at_k_curve(n, c, usable))
    return PassAtK(curves, dropped)


def plot_pass_at_k(
    curves: Mapping[str, tuple[Sequence[int], Sequence[float]]],
    out_path: str | Path,
    *,
    bands: Mapping[str, tuple[Sequence[float], Sequence[float]]] | None = None,
    title: str = "Pass@K at full budget",
) -> tuple[Path, Path]:
    """Pass@K curves, one per policy (Figure 2 style), the legend beside the axes.

    Args:
      curves: ``{policy: (ks [K], pass@k [K])}``.
      bands: optional ``{policy: (low [K], high [K])}`` shaded around the curve.
    """
    figures.nonempty("plot_pass_at_k", curves)
    fig, axes = figures.new_figure(width=5.0 + figures.legend_width(curves))
    ax = axes[0, 0]
    for name, pair in curves.items():
        ks, values = figures.xy(name, pair)
        (line,) = ax.plot(ks, values, marker="o", markersize=3, label=name)
        if bands and name in bands:
            low, high = (np.asarray(a, dtype=np.float64) for a in bands[name])
            ax.fill_between(ks, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="k (attempts)", ylabel="Pass@k", title=title, ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    figures.legend_outside(ax)
    return figures.save_figure(fig, out_path)


def k_range(res: PassAtK) -> str:
    """The k the curves plot: ``"1..32"`` (each policy's range where they differ, ``"base
    1..32, RL 1..16"``: a policy with fewer samples stops earlier)."""
    spans = {p: f"{int(c.k[0])}..{int(c.k[-1])}" for p, c in res.curves.items()}
    if len(set(spans.values())) == 1:
        return next(iter(spans.values()))
    return ", ".join(f"{p} {span}" for p, span in spans.items())


def section(folder: str | Path, res: PassAtK, name: str = "pass_at_k") -> Section:
    """Write ``<name>.json`` (the result), ``<name>.csv`` (one column per policy, empty where a
    k was dropped) and the figure; the section "Pass@K (full budget)"."""
    folder = Path(folder)
    json_path = write_json(folder / f"{name}.json", res)
    all_k = sorted({int(k) for c in res.curves.values() for k in c.k})
    columns: dict[str, list] = {"k": all_k}
    for policy, curve in res.curves.items():
        lookup = dict(zip(curve.k.tolist(), curve.pass_at_k.tolist()))
        columns[policy] = [lookup.get(k) for k in all_k]
    csv_path = write_csv(folder / f"{name}.csv", columns)
    png, _ = plot_pass_at_k(
        {p: (c.k, c.pass_at_k) for p, c in res.curves.items()}, figure_path(folder, name)
    )
    summary = f"k = {k_range(res)}. " + ", ".join(
        f"{p}: pass@{int(c.k[0])} {c.pass_at_k[0]:.3f}, pass@{int(c.k[-1])} {c.pass_at_k[-1]:.3f}"
        for p, c in res.curves.items()
    )
    return Section(
        "Pass@K (full budget)",
        summary,
        (rel(folder, png),),
        (rel(folder, json_path), rel(folder, csv_path)),
    )
