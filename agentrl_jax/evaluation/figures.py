"""Figures in the spirit of the paper's Figures 2-8 and Table 1 (PAPER.md §3, §7).

Each ``plot_*`` function takes plain arrays / dicts and an output path, writes
``<stem>.png`` and ``<stem>.pdf`` (any ``.png``/``.pdf`` suffix on the path is replaced),
and returns ``(png_path, pdf_path)``. Figures are built on ``matplotlib.figure.Figure`` with
an explicit Agg canvas: no pyplot, no global backend switch, nothing left open.

The Table-1 helpers (``budget_table_markdown``, ``budget_table_csv``) return strings; the
caller (``report.py``) writes them.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from agentrl_jax.evaluation import stats
from agentrl_jax.evaluation.passk import BUDGET_PERCENTS, PASS_AT_T_K, budget_levels

_DPI = 120
_OUTCOME_COLORS = {"success": "tab:green", "failure": "tab:red"}


def _new_figure(ncols: int = 1, nrows: int = 1, width: float = 5.0, height: float = 3.6):
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


def _field(obj: Any, name: str) -> np.ndarray:
    """``obj.name`` or ``obj[name]`` as an array (accepts result records or their dicts)."""
    value = obj[name] if isinstance(obj, Mapping) else getattr(obj, name)
    return np.asarray(value, dtype=np.float64)


def _xy(name: str, pair) -> tuple[np.ndarray, np.ndarray]:
    x, y = (np.asarray(a, dtype=np.float64) for a in pair)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(
            f"series {name!r}: x and y must be 1-D of equal length, got {x.shape} and {y.shape}"
        )
    return x, y


def _nonempty(name: str, mapping: Mapping) -> None:
    if not mapping:
        raise ValueError(f"{name}: nothing to plot")


# ---------------------------------------------------------------- Pass@K, Pass@T, Table 1


def plot_pass_at_k(
    curves: Mapping[str, tuple[Sequence[int], Sequence[float]]],
    out_path: str | Path,
    *,
    bands: Mapping[str, tuple[Sequence[float], Sequence[float]]] | None = None,
    title: str = "Pass@K at full budget",
) -> tuple[Path, Path]:
    """Pass@K curves, one per policy (Figure 2 style).

    Args:
      curves: ``{policy: (ks [K], pass@k [K])}``.
      bands: optional ``{policy: (low [K], high [K])}`` shaded around the curve.
    """
    _nonempty("plot_pass_at_k", curves)
    fig, axes = _new_figure()
    ax = axes[0, 0]
    for name, pair in curves.items():
        ks, values = _xy(name, pair)
        (line,) = ax.plot(ks, values, marker="o", markersize=3, label=name)
        if bands and name in bands:
            low, high = (np.asarray(a, dtype=np.float64) for a in bands[name])
            ax.fill_between(ks, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="k (attempts)", ylabel="Pass@k", title=title, ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, out_path)


def plot_pass_at_t(
    curves: Mapping[str, tuple[Sequence[int], Sequence[float]]],
    out_path: str | Path,
    *,
    bound: tuple[Sequence[int], Sequence[float]] | None = None,
    k: int = PASS_AT_T_K,
    t_max: int | None = None,
    title: str | None = None,
) -> tuple[Path, Path]:
    """Pass@(k, T) against the budget T, one curve per policy, with the structural bound.

    Args:
      curves: ``{policy: (budgets [B], pass@(k, T) [B])}``.
      bound: optional ``(budgets [B'], share of tasks with shortest path <= T [B'])``.
      t_max: when given, marks the full budget with a vertical line.
    """
    _nonempty("plot_pass_at_t", curves)
    fig, axes = _new_figure()
    ax = axes[0, 0]
    for name, pair in curves.items():
        budgets, values = _xy(name, pair)
        ax.plot(budgets, values, marker="o", markersize=3, label=name)
    if bound is not None:
        budgets, values = _xy("structural bound", bound)
        ax.step(
            budgets, values, where="post", color="black", linestyle="--", label="structural bound"
        )
    if t_max is not None:
        ax.axvline(t_max, color="grey", linewidth=0.8, linestyle=":")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(
        xlabel="turn budget T",
        ylabel=f"Pass@({k}, T)",
        ylim=(0, 1.02),
        title=title or f"Pass@T at k = {k}",
    )
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, out_path)


def _budget_columns(table: Mapping[str, Mapping[int, float]]) -> list[int]:
    _nonempty("budget table", table)
    columns = sorted({int(b) for row in table.values() for b in row})
    for policy, row in table.items():
        missing = [b for b in columns if b not in row]
        if missing:
            raise ValueError(f"budget table: policy {policy!r} lacks budgets {missing}")
    return columns


def budget_level_labels(t_max: int, percents: Sequence[int] = BUDGET_PERCENTS) -> dict[int, str]:
    """Column labels for the budget levels of ``T_max``: ``{17: "25% (T=17)", ...}`` for 70."""
    return {
        level: f"{p}% (T={level})" for p, level in zip(percents, budget_levels(t_max, percents))
    }


def _budget_header(budgets: list[int], labels: Mapping[int, str] | None) -> list[str]:
    labels = labels or {}
    return [labels.get(b, f"T={b}") for b in budgets]


def plot_budget_table(
    table: Mapping[str, Mapping[int, float]],
    out_path: str | Path,
    *,
    k: int = PASS_AT_T_K,
    labels: Mapping[int, str] | None = None,
    title: str | None = None,
) -> tuple[Path, Path]:
    """Grouped bars of Pass@k at each budget level (Table 1 as a figure).

    Args:
      table: ``{policy: {T: pass@(k, T)}}`` (e.g. from ``passk.pass_at_k_table``).
      labels: optional ``{T: column label}``, e.g. :func:`budget_level_labels`; default ``"T=17"``.
    """
    budgets = _budget_columns(table)
    fig, axes = _new_figure(width=max(5.0, 1.4 * len(budgets)))
    ax = axes[0, 0]
    width = 0.8 / len(table)
    x = np.arange(len(budgets))
    for i, (policy, row) in enumerate(table.items()):
        values = [row[b] for b in budgets]
        bars = ax.bar(x + (i - (len(table) - 1) / 2) * width, values, width, label=policy)
        ax.bar_label(bars, labels=[f"{100 * v:.1f}" for v in values], fontsize=7)
    ax.set_xticks(x, _budget_header(budgets, labels))
    ax.set(ylabel=f"Pass@{k}", ylim=(0, 1.1), title=title or f"Pass@{k} by budget")
    ax.legend(fontsize=8)
    return save_figure(fig, out_path)


def budget_table_markdown(
    table: Mapping[str, Mapping[int, float]],
    *,
    k: int = PASS_AT_T_K,
    labels: Mapping[int, str] | None = None,
) -> str:
    """Table 1 as Markdown: one row per policy, Pass@k in percent with one decimal.

    ``labels``: optional ``{T: column label}`` (see :func:`budget_level_labels`).
    """
    budgets = _budget_columns(table)
    header = [f"policy (Pass@{k}, %)"] + _budget_header(budgets, labels)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for policy, row in table.items():
        cells = [policy.replace("|", "\\|")] + [f"{100 * row[b]:.1f}" for b in budgets]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def budget_table_csv(
    table: Mapping[str, Mapping[int, float]], *, labels: Mapping[int, str] | None = None
) -> str:
    """Table 1 as CSV (long form): ``policy,budget,level,pass_at_k`` with pass@k a fraction
    and ``level`` the column label (empty without ``labels``)."""
    budgets = _budget_columns(table)
    labels = labels or {}
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["policy", "budget", "level", "pass_at_k"])
    for policy, row in table.items():
        for b in budgets:
            writer.writerow([policy, b, labels.get(b, ""), repr(float(row[b]))])
    return buffer.getvalue()


# ---------------------------------------------------------------- step quality (§7.1, §7.2)


def plot_step_quality(
    pools: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    out_path: str | Path,
    *,
    policy_names: tuple[str, str] = ("base", "RL"),
    title: str = "Step-level action quality",
) -> tuple[Path, Path]:
    """Per-state quality of base vs RL on state pools (Figures 3-4 style).

    One scatter panel per pool (x = base, y = RL; points above the diagonal are states
    where RL is better) and a bar panel with the share of states where RL is better / tied
    / worse, as computed by :func:`stats.paired_comparison`.

    Args:
      pools: ``{pool name: (q_base [S], q_rl [S])}``, e.g. ``{"matched": ..., "error": ...}``.
    """
    _nonempty("plot_step_quality", pools)
    base_name, rl_name = policy_names
    fig, axes = _new_figure(ncols=len(pools) + 1, width=3.8, height=3.6)
    shares = {}
    for ax, (pool, (q_base, q_rl)) in zip(axes[0], pools.items()):
        comparison = stats.paired_comparison(q_rl, q_base)
        shares[pool] = comparison
        qb, qr = np.asarray(q_base, dtype=np.float64), np.asarray(q_rl, dtype=np.float64)
        ax.scatter(qb, qr, s=6, alpha=0.5)
        lo, hi = float(min(qb.min(), qr.min())), float(max(qb.max(), qr.max()))
        pad = 0.02 * (hi - lo or 1.0)
        ax.plot([lo - pad, hi + pad], [lo - pad, hi + pad], color="black", linewidth=0.8)
        ax.set(
            xlabel=f"{base_name} quality",
            ylabel=f"{rl_name} quality",
            title=f"{pool}: mean diff {comparison.mean_diff.mean:+.3f}",
        )
        ax.set_aspect("equal", adjustable="datalim")
    ax = axes[0, -1]
    x = np.arange(len(shares))
    better = np.array([c.share_rl_better for c in shares.values()])
    tie = np.array([c.share_tie for c in shares.values()])
    worse = np.array([c.share_base_better for c in shares.values()])
    ax.bar(x, better, color="tab:blue", label=f"{rl_name} better")
    ax.bar(x, tie, bottom=better, color="lightgrey", label="tie")
    ax.bar(x, worse, bottom=better + tie, color="tab:orange", label=f"{base_name} better")
    ax.axhline(0.5, color="black", linewidth=0.8, linestyle=":")
    ax.set_xticks(x, list(shares))
    ax.set(ylabel="share of states", ylim=(0, 1), title="who is better")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncols=3)
    fig.suptitle(title)
    return save_figure(fig, out_path)


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
    _nonempty("plot_rates_with_ci", rates)
    fig, axes = _new_figure()
    ax = axes[0, 0]
    means = np.array([float(_field(r, "mean")) for r in rates.values()])
    lows = np.array([float(_field(r, "low")) for r in rates.values()])
    highs = np.array([float(_field(r, "high")) for r in rates.values()])
    yerr = np.nan_to_num(np.stack([means - lows, highs - means]), nan=0.0)
    x = np.arange(len(rates))
    bars = ax.bar(x, means, yerr=yerr, capsize=4, color=[f"C{i}" for i in range(len(rates))])
    # each value above its whisker, with room under the frame for it
    tops = np.nan_to_num(np.maximum(highs, means), nan=0.0)
    top = float(max(tops.max(initial=0.0), 1e-9))
    for bar, y, mean in zip(bars, tops, means):
        ax.annotate(f"{mean:.3f}", (bar.get_x() + bar.get_width() / 2, y), xytext=(0, 3),
                    textcoords="offset points", ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, top * 1.2)
    ax.set_xticks(x, list(rates))
    ax.set(ylabel=ylabel, title=title)
    return save_figure(fig, out_path)


# ---------------------------------------------------------------- depth (§7.3)


def plot_quality_vs_depth(
    curves: Mapping[str, Any],
    out_path: str | Path,
    *,
    ylabel: str = "action quality Q*",
    title: str = "Action quality vs normalised depth t / T_max",
) -> tuple[Path, Path]:
    """Binned curves with 95% bands against normalised depth (Figure 5 style).

    Args:
      curves: ``{label: stats.BinnedCurve}`` (or its ``to_dict()``): ``centers``, ``mean``,
        ``low``, ``high`` arrays of shape ``[bins]``; NaN bins are gaps.
    """
    _nonempty("plot_quality_vs_depth", curves)
    fig, axes = _new_figure()
    ax = axes[0, 0]
    for name, curve in curves.items():
        x, mean = _field(curve, "centers"), _field(curve, "mean")
        (line,) = ax.plot(x, mean, marker="o", markersize=3, label=name)
        ax.fill_between(
            x,
            _field(curve, "low"),
            _field(curve, "high"),
            color=line.get_color(),
            alpha=0.2,
            linewidth=0,
        )
    ax.set(xlabel="normalised depth t / T_max", ylabel=ylabel, title=title, xlim=(0, 1))
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, out_path)


# ---------------------------------------------------------------- likelihood (§7.4)


def plot_action_nll_hist(
    samples: Mapping[str, Sequence[float]],
    out_path: str | Path,
    *,
    bins: int = 50,
    title: str = "ActionNLL under the base policy",
) -> tuple[Path, Path]:
    """Overlaid density histograms of ActionNLL per response source (Figure 6 style).

    Args:
      samples: ``{label: nll [M]}``, e.g. ``{"base responses": ..., "RL responses": ...}``.
    """
    _nonempty("plot_action_nll_hist", samples)
    arrays = {k: np.asarray(v, dtype=np.float64).reshape(-1) for k, v in samples.items()}
    for name, values in arrays.items():
        if values.size == 0 or not np.all(np.isfinite(values)):
            raise ValueError(
                f"plot_action_nll_hist: samples[{name!r}] must be non-empty and finite"
            )
    everything = np.concatenate(list(arrays.values()))
    lo, hi = everything.min(), everything.max()
    edges = np.linspace(lo, hi if hi > lo else lo + 1.0, bins + 1)
    fig, axes = _new_figure()
    ax = axes[0, 0]
    for name, values in arrays.items():
        ax.hist(
            values, bins=edges, density=True, alpha=0.45, label=f"{name} (mean {values.mean():.2f})"
        )
    ax.set(xlabel=r"$-\log\pi_{B}(r \mid h)$  [nats]", ylabel="density", title=title)
    ax.legend(fontsize=8)
    return save_figure(fig, out_path)


def plot_cumulative_llr(
    sets: Mapping[str, tuple[Any, Any, Any]],
    out_path: str | Path,
    *,
    max_lines: int = 60,
    title: str = r"Cumulative log-likelihood ratio "
    r"$\sum_{i \leq t} \log\pi_{RL}(r_i|h_i) - \log\pi_{B}(r_i|h_i)$",
) -> tuple[Path, Path]:
    """Cumulative LLR per trajectory, split by success (Figure 7 style).

    One panel per trajectory set (e.g. ``{"RL trajectories": ..., "base trajectories": ...}``):
    thin lines for up to ``max_lines`` trajectories per outcome, and the mean over
    trajectories still running at each turn with its 95% band.

    Args:
      sets: ``{label: (cum_llr [N, T], turn_mask [N, T], success [N])}`` with ``cum_llr``
        from :func:`stats.cumulative_llr`.
    """
    _nonempty("plot_cumulative_llr", sets)
    fig, axes = _new_figure(ncols=len(sets), width=4.6)
    for ax, (name, (cum, mask, success)) in zip(axes[0], sets.items()):
        cum = np.asarray(cum, dtype=np.float64)
        mask = np.asarray(mask, dtype=bool)
        by_outcome = stats.llr_by_outcome(cum, mask, success)
        ok = np.asarray(success, dtype=bool).reshape(-1)
        turns = np.arange(1, cum.shape[1] + 1)
        for outcome, sel in (("success", ok), ("failure", ~ok)):
            color = _OUTCOME_COLORS[outcome]
            for row in np.flatnonzero(sel)[:max_lines]:
                ax.plot(
                    turns[mask[row]], cum[row, mask[row]], color=color, alpha=0.15, linewidth=0.6
                )
            curve = by_outcome[outcome]["curve"]
            if np.any(curve.count > 0):
                final = by_outcome[outcome]["final"]
                ax.plot(
                    curve.turn,
                    curve.mean,
                    color=color,
                    linewidth=2,
                    label=f"{outcome} (n={int(sel.sum())}): mean of those still playing",
                )
                # the report's "final" is each trajectory's own last value, averaged: drawn
                # at their mean last turn (the curve's end holds only the longest ones)
                last = np.where(mask[sel].any(axis=1), mask[sel].shape[1] - np.argmax(
                    mask[sel][:, ::-1], axis=1), 0)
                ax.plot([last[last > 0].mean()], [final.mean], marker="D", markersize=7,
                        color=color, markeredgecolor="black", linestyle="none",
                        label=f"{outcome}: mean at each one's last turn {final.mean:+.1f}")
                ax.fill_between(
                    curve.turn, curve.low, curve.high, color=color, alpha=0.25, linewidth=0
                )
        ax.axhline(0, color="black", linewidth=0.8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(xlabel="turn t", ylabel=r"$\mathrm{LLR}_{1:t}$  [nats]", title=name)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return save_figure(fig, out_path)


# ---------------------------------------------------------------- training dynamics (§7.5)


def plot_training_dynamics(
    steps: Sequence[float],
    series: Mapping[str, Sequence[float]],
    out_path: str | Path,
    *,
    title: str = "Training dynamics",
    changes: Mapping[str, Mapping[str, Any]] | None = None,
) -> tuple[Path, Path]:
    """One panel per logged series against the training step (Figure 8 style).

    Args:
      steps: ``[S]`` training steps.
      series: ``{name: [S] values}``, e.g. ``{"R_multi": ..., "R_single": ...}``; NaN entries
        (steps where a value was not logged) are skipped.
      changes: ``{name: start_to_end(values)}`` (:mod:`agentrl_jax.evaluation.dynamics`; the
        default computes it): each panel's title states it and the start and end means are
        drawn over the first and last ``window`` logged steps, so the figure says what the
        report's text and tables say.
    """
    from agentrl_jax.evaluation.dynamics import start_to_end

    _nonempty("plot_training_dynamics", series)
    x = np.asarray(steps, dtype=np.float64)
    fig, axes = _new_figure(nrows=len(series), width=6.0, height=2.6)
    for ax, (name, values) in zip(axes[:, 0], series.items()):
        _, y = _xy(name, (x, values))
        keep = np.isfinite(y)
        ax.plot(x[keep], y[keep], marker=".", markersize=3)
        change = (changes or {}).get(name) or start_to_end(y)
        if change["change"] is not None:
            w, xs = change["window"], x[keep]
            for span, level in ((xs[:w], change["start"]), (xs[-w:], change["end"])):
                ax.hlines(level, span[0], span[-1], colors="C1", linewidth=2)
            ax.set_title(f"{name}: {change['start']:.3f} -> {change['end']:.3f} "
                         f"({change['change'].mean:+.3f}; means of the first and last {w})",
                         fontsize=9)
        ax.set(ylabel=name)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("training step")
    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(title)
    return save_figure(fig, out_path)
