"""Action quality against normalised depth ``t / T_max`` (PAPER.md §7.3, Figure 5): the mean
quality of each series (base, RL, RL - base) in equal depth bins with 95% percentile-bootstrap
bands (:func:`stats.binned_curve`).

``compute`` -> :class:`Depth`; :func:`plot_quality_vs_depth` draws it; :func:`section`
writes its files and returns its report section.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from agentrl_jax.evaluation import figures, stats
from agentrl_jax.evaluation.report import Section, figure_path, rel, write_csv, write_json
from agentrl_jax.evaluation.result import Result, result


def quality_by_depth(result: Any, t_max: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """``(depth [S], {label: [S]})`` for :func:`compute` from a step-quality result (its
    ``names``, ``pool.turn`` and ``quality``, any environment's state diagnostics): each
    policy's per-state quality and the difference ``RL - base`` against ``d_t = t / T_max``."""
    base, rl = result.names
    depth = stats.normalised_depth(result.pool.turn, t_max)
    q = result.quality
    return depth, {base: q[base], rl: q[rl], f"{rl} - {base}": q[rl] - q[base]}


@result
class Depth(Result):
    """``curves``: ``{label: BinnedCurve}``, all over the same bins."""

    curves: dict[str, stats.BinnedCurve]


def compute(depth: Any, quality: Mapping[str, Any], *, bins: int = 10, seed: int = 0) -> Depth:
    """Binned curves of ``quality`` (``{label: [N]}``, e.g. ``{"base": ..., "RL": ...,
    "RL - base": ...}``) against ``depth`` (``[N]`` normalised depth of each state,
    :func:`stats.normalised_depth`) in ``bins`` equal bins over [0, 1]; each label's bin ``b``
    bootstraps with seed ``seed + b``."""
    return Depth(
        {label: stats.binned_curve(depth, q, bins=bins, seed=seed) for label, q in quality.items()}
    )


def plot_quality_vs_depth(
    curves: Mapping[str, Any],
    out_path: str | Path,
    *,
    ylabel: str = "action quality Q*",
    title: str = "Action quality vs normalised depth t / T_max",
) -> tuple[Path, Path]:
    """Binned curves with 95% bands against normalised depth (Figure 5 style), the legend
    beside the axes.

    Args:
      curves: ``{label: stats.BinnedCurve}`` (or its ``to_dict()``): ``centers``, ``mean``,
        ``low``, ``high`` arrays of shape ``[bins]``; NaN bins are gaps.
    """
    figures.nonempty("plot_quality_vs_depth", curves)
    fig, axes = figures.new_figure(width=5.0 + figures.legend_width(curves))
    ax = axes[0, 0]
    for name, curve in curves.items():
        x, mean = figures.field(curve, "centers"), figures.field(curve, "mean")
        (line,) = ax.plot(x, mean, marker="o", markersize=3, label=name)
        ax.fill_between(
            x,
            figures.field(curve, "low"),
            figures.field(curve, "high"),
            color=line.get_color(),
            alpha=0.2,
            linewidth=0,
        )
    ax.set(xlabel="normalised depth t / T_max", ylabel=ylabel, title=title, xlim=(0, 1))
    ax.grid(alpha=0.3)
    figures.legend_outside(ax)
    return figures.save_figure(fig, out_path)


def section(folder: str | Path, res: Depth, *, name: str = "quality_vs_depth") -> Section:
    """Write ``<name>.json`` (the curves), ``<name>.csv`` (bin edges, then mean, CI and count
    per label) and the figure; the section "Action quality vs normalised depth"."""
    folder = Path(folder)
    json_path = write_json(folder / f"{name}.json", res.curves)
    first = next(iter(res.curves.values()))
    columns: dict[str, list] = {
        "bin_low": first.edges[:-1].tolist(),
        "bin_high": first.edges[1:].tolist(),
    }
    for label, curve in res.curves.items():
        columns[f"{label}_mean"] = curve.mean.tolist()
        columns[f"{label}_ci_low"] = curve.low.tolist()
        columns[f"{label}_ci_high"] = curve.high.tolist()
        columns[f"{label}_count"] = curve.count.tolist()
    csv_path = write_csv(folder / f"{name}.csv", columns)
    png, _ = plot_quality_vs_depth(res.curves, figure_path(folder, name))
    return Section(
        "Action quality vs normalised depth",
        "Bands: 95% percentile bootstrap per bin.",
        (rel(folder, png),),
        (rel(folder, json_path), rel(folder, csv_path)),
    )
