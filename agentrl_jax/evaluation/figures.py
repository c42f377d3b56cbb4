"""What every analysis' figure shares (the figures themselves, in the spirit of the paper's
Figures 2-8, live with their analysis in :mod:`agentrl_jax.evaluation.analyses`).

Each analysis' ``plot_*`` function takes plain arrays / dicts and an output path, writes
``<stem>.png`` and ``<stem>.pdf`` (any ``.png``/``.pdf`` suffix on the path is replaced,
:func:`save_figure`), and returns ``(png_path, pdf_path)``. Figures are built on
``matplotlib.figure.Figure`` with an explicit Agg canvas (:func:`new_figure`): no pyplot, no
global backend switch, nothing left open. A legend goes beside or below the panels
(:func:`legend_outside`, :func:`legend_below`, :func:`legend_under`), never over the data, at
:data:`LEGEND_FONTSIZE`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import matplotlib.transforms as mtransforms
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

_DPI = 120
LEGEND_FONTSIZE = 9  # points: every legend's text, readable at the report's width


def new_figure(ncols: int = 1, nrows: int = 1, width: float = 5.0, height: float = 3.6):
    """A figure of ``nrows x ncols`` panels of ``width x height`` inches each and its axes
    ``[nrows, ncols]``, on its own Agg canvas."""
    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def legend_width(labels, fontsize: float = LEGEND_FONTSIZE) -> float:
    """Inches a one-column legend of ``labels`` takes beside the axes: its handles and padding
    and the longest label at about 0.6 em a character (what a figure widens by for
    :func:`legend_outside`)."""
    longest = max((len(str(label)) for label in labels), default=0)
    return 0.9 + 0.6 * longest * fontsize / 72


def legend_outside(ax, fontsize: float = LEGEND_FONTSIZE, **kwargs):
    """``ax``'s legend to the right of its frame, top-aligned, covering no data (the
    constrained layout makes room for it; widen the figure by :func:`legend_width`)."""
    return ax.legend(
        loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=fontsize, **kwargs
    )


def legend_below(fig: Figure, ax, ncols: int = 2, fontsize: float = LEGEND_FONTSIZE, **kwargs):
    """One legend for the whole figure, below its panels, from ``ax``'s labelled artists (the
    panels share their series; the constrained layout makes room for it). ``kwargs`` go to
    ``fig.legend`` (e.g. ``title``)."""
    handles, labels = ax.get_legend_handles_labels()
    return fig.legend(
        handles, labels, loc="outside lower center", ncols=ncols, fontsize=fontsize, **kwargs
    )


def legend_under(ax, ncols: int = 1, fontsize: float = LEGEND_FONTSIZE, **kwargs):
    """``ax``'s own legend centred under its frame, below its x tick labels and x label (for
    panels whose series are their own, e.g. labels carrying the panel's numbers; the
    constrained layout makes room for it). Set the x label before calling."""
    fig = ax.get_figure()
    ticks = ax.xaxis.get_ticklabels()
    tick_size = ticks[0].get_fontsize() if ticks else ax.xaxis.label.get_fontsize()
    major = ax.xaxis.get_major_ticks()
    tick = (major[0].get_tick_padding() + major[0].get_pad()) if major else 7.0
    label = ax.xaxis.labelpad + 1.4 * ax.xaxis.label.get_fontsize() if ax.get_xlabel() else 0.0
    below = tick + 1.4 * tick_size + label + 4.0  # points under the frame's bottom edge
    anchor = mtransforms.offset_copy(ax.transAxes, fig=fig, y=-below, units="points")
    return ax.legend(
        loc="upper center",
        bbox_to_anchor=(0.5, 0.0),
        bbox_transform=anchor,
        borderaxespad=0.0,
        ncols=ncols,
        fontsize=fontsize,
        **kwargs,
    )


def save_figure(fig: Figure, out_path: str | Path) -> tuple[Path, Path]:
    """Write ``fig`` as PNG and PDF next to each other; returns both paths."""
    path = Path(out_path)
    stem = path.with_suffix("") if path.suffix.lower() in (".png", ".pdf") else path
    stem.parent.mkdir(parents=True, exist_ok=True)
    png, pdf = stem.with_name(stem.name + ".png"), stem.with_name(stem.name + ".pdf")
    fig.savefig(png, dpi=_DPI)
    fig.savefig(pdf)
    return png, pdf


def field(obj: Any, name: str) -> np.ndarray:
    """``obj.name`` or ``obj[name]`` as an array (accepts result records or their dicts)."""
    value = obj[name] if isinstance(obj, Mapping) else getattr(obj, name)
    return np.asarray(value, dtype=np.float64)


def xy(name: str, pair) -> tuple[np.ndarray, np.ndarray]:
    """A series ``(x [N], y [N])`` as float64 arrays; ``ValueError`` naming it otherwise."""
    x, y = (np.asarray(a, dtype=np.float64) for a in pair)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(
            f"series {name!r}: x and y must be 1-D of equal length, got {x.shape} and {y.shape}"
        )
    return x, y


def nonempty(name: str, mapping: Mapping) -> None:
    """``ValueError`` "<name>: nothing to plot" for an empty mapping."""
    if not mapping:
        raise ValueError(f"{name}: nothing to plot")
