"""Continuation from error states (PAPER.md §7.2): each policy's success rate continuing from
the same injected error states, with a CI (Wilson by default: a rate in [0, 1]).

``compute`` -> :class:`Continuation`; :func:`plot_rates_with_ci` draws it; :func:`section`
writes its files and returns its report section.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from agentrl_jax.evaluation import figures, stats
from agentrl_jax.evaluation.report import Section, figure_path, rel, write_csv, write_json
from agentrl_jax.evaluation.result import Result, result


@result
class Continuation(Result):
    """``rates``: ``{policy: MeanCI}`` success rate over its continuations."""

    rates: dict[str, stats.MeanCI]


def compute(successes: Mapping[str, Any], *, method: str = "wilson") -> Continuation:
    """Success rates of ``{policy: [E] bool}`` (or ``[E, G]`` for G continuations per state,
    flattened: the CI then treats continuations as independent); ``method``: the CI method of
    :func:`stats.mean_ci`."""
    return Continuation(
        {
            p: stats.mean_ci(np.asarray(s, dtype=np.float64), method=method)
            for p, s in successes.items()
        }
    )


def plot_rates_with_ci(
    rates: Mapping[str, Any],
    out_path: str | Path,
    *,
    ylabel: str = "continuation success",
    title: str = "Continuation from error states",
) -> tuple[Path, Path]:
    """Bars with 95% CI whiskers, e.g. each policy's success continuing from error states.

    Args:
      rates: ``{label: MeanCI}`` or ``{label: {"mean", "low", "high"}}``.
    """
    figures.nonempty("plot_rates_with_ci", rates)
    fig, axes = figures.new_figure()
    ax = axes[0, 0]
    means = np.array([float(figures.field(r, "mean")) for r in rates.values()])
    lows = np.array([float(figures.field(r, "low")) for r in rates.values()])
    highs = np.array([float(figures.field(r, "high")) for r in rates.values()])
    yerr = np.nan_to_num(np.stack([means - lows, highs - means]), nan=0.0)
    x = np.arange(len(rates))
    bars = ax.bar(x, means, yerr=yerr, capsize=4, color=[f"C{i}" for i in range(len(rates))])
    # each value above its whisker, with room under the frame for it
    tops = np.nan_to_num(np.maximum(highs, means), nan=0.0)
    top = float(max(tops.max(initial=0.0), 1e-9))
    for bar, y, mean in zip(bars, tops, means):
        ax.annotate(
            f"{mean:.3f}",
            (bar.get_x() + bar.get_width() / 2, y),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylim(0, top * 1.2)
    ax.set_xticks(x, list(rates))
    ax.set(ylabel=ylabel, title=title)
    return figures.save_figure(fig, out_path)


def section(
    folder: str | Path,
    res: Continuation,
    *,
    name: str = "continuation",
    title: str = "Continuation from error states",
) -> Section:
    """Write ``<name>.json`` (the rates), ``<name>.csv`` and the figure; the section ``title``."""
    folder = Path(folder)
    rates = res.rates
    json_path = write_json(folder / f"{name}.json", rates)
    csv_path = write_csv(
        folder / f"{name}.csv",
        {
            "policy": list(rates),
            "success_rate": [r.mean for r in rates.values()],
            "ci_low": [r.low for r in rates.values()],
            "ci_high": [r.high for r in rates.values()],
            "n": [r.n for r in rates.values()],
        },
    )
    png, _ = plot_rates_with_ci(rates, figure_path(folder, name), title=title)
    text = "; ".join(
        f"{p}: {r.mean:.3f} [{r.low:.3f}, {r.high:.3f}] (n={r.n})" for p, r in rates.items()
    )
    return Section(
        title, text, (rel(folder, png),), (rel(folder, json_path), rel(folder, csv_path))
    )
