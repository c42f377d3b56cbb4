"""What every analysis' figure shares (the figures themselves, in the spirit of the paper's
Figures 2-8, live with their analysis in :mod:`agentrl_jax.evaluation.analyses`).

Each analysis' ``plot_*`` function takes plain arrays / dicts and an output path, writes
``<stem>.png`` and ``<stem>.pdf`` (any ``.png``/``.pdf`` suffix on the path is replaced,
:func:`save_figure`), and returns ``(png_path, pdf_path)``. Figures are built on
``matplotlib.figure.Figure`` with an explicit Agg canvas (:func:`new_figure`): no pyplot, no
global backend switch, nothing left open.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

_DPI = 120


def new_figure(ncols: int = 1, nrows: int = 1, width: float = 5.0, height: float = 3.6):
    """A figure of ``nrows x ncols`` panels of ``width x height`` inches each and its axes
    ``[nrows, ncols]``, on its own Agg canvas."""
    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


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
