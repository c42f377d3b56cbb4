"""Pass@T with the structural bound, and Table 1 (PAPER.md §2, §3): Pass@(k, T) of each policy
against the turn budget T (every budget sampled afresh with T in the prompt), the share of
tasks whose shortest path fits in T (no policy beats it on deterministic maps), and Pass@k at
the budget levels 25/50/75/100% of ``T_max``.

``compute`` -> :class:`PassAtT`; :func:`plot_pass_at_t` and :func:`plot_budget_table` draw
it; :func:`section` writes its files and returns its report sections.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from matplotlib.ticker import MaxNLocator

from agentrl_jax.evaluation import figures, passk
from agentrl_jax.evaluation.passk import BUDGET_PERCENTS, PASS_AT_T_K, budget_levels
from agentrl_jax.evaluation.report import Section, figure_path, rel, write_csv, write_json
from agentrl_jax.evaluation.result import Result, result


@result
class BudgetCurve(Result):
    """``budget [B]`` int and the value at each budget, ``value [B]`` float64."""

    budget: np.ndarray
    value: np.ndarray


@result
class PassAtT(Result):
    """Pass@(k, T) curves ``{policy: BudgetCurve}``; ``bound``: the structural bound at every
    integer budget 1..max (None without shortest paths); ``table``: ``{policy: {T: Pass@(k, T)}}``
    at :func:`passk.budget_levels` of ``t_max`` (None without ``t_max``)."""

    k: int
    curves: dict[str, BudgetCurve]
    bound: BudgetCurve | None = None
    t_max: int | None = None
    table: dict[str, dict[int, float]] | None = None


def compute(
    results_by_policy: Mapping[str, passk.BudgetResults],
    *,
    k: int = PASS_AT_T_K,
    t_max: int | None = None,
    shortest_paths: Any = None,
) -> PassAtT:
    """Pass@T of ``{policy: {T: (n [tasks], c [tasks])}}``.

    Args:
      t_max: when given, Table 1 at ``passk.budget_levels(t_max)`` (every policy must have
        results at those budgets).
      shortest_paths: optional ``[tasks]`` fewest turns each task needs, for the bound
        (FrozenLake: the shortest start-to-goal path; BFCL: the annotated trajectory).
    """
    curves = {p: BudgetCurve(*passk.pass_at_t_curve(r, k)) for p, r in results_by_policy.items()}
    bound = None
    if shortest_paths is not None:
        budgets = [int(b) for c in curves.values() for b in c.budget]
        # Every integer budget up to the largest one, so the bound plots as a full step curve.
        every = np.arange(1, max(budgets + [t_max or 0]) + 1)
        bound = BudgetCurve(every, passk.structural_upper_bound(shortest_paths, every))
    table = None
    if t_max is not None:
        table = passk.pass_at_k_table(results_by_policy, budget_levels(t_max), k)
    return PassAtT(k, curves, bound, t_max, table)


# ---------------------------------------------------------------- figures and Table 1 text


def plot_pass_at_t(
    curves: Mapping[str, tuple[Sequence[int], Sequence[float]]],
    out_path: str | Path,
    *,
    bound: tuple[Sequence[int], Sequence[float]] | None = None,
    k: int = PASS_AT_T_K,
    t_max: int | None = None,
    title: str | None = None,
) -> tuple[Path, Path]:
    """Pass@(k, T) against the budget T, one curve per policy, with the structural bound; the
    legend beside the axes.

    Args:
      curves: ``{policy: (budgets [B], pass@(k, T) [B])}``.
      bound: optional ``(budgets [B'], share of tasks with shortest path <= T [B'])``.
      t_max: when given, marks the full budget with a vertical line.
    """
    figures.nonempty("plot_pass_at_t", curves)
    labels = list(curves) + (["structural bound"] if bound is not None else [])
    fig, axes = figures.new_figure(width=5.0 + figures.legend_width(labels))
    ax = axes[0, 0]
    for name, pair in curves.items():
        budgets, values = figures.xy(name, pair)
        ax.plot(budgets, values, marker="o", markersize=3, label=name)
    if bound is not None:
        budgets, values = figures.xy("structural bound", bound)
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
    figures.legend_outside(ax)
    return figures.save_figure(fig, out_path)


def _budget_columns(table: Mapping[str, Mapping[int, float]]) -> list[int]:
    figures.nonempty("budget table", table)
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
    """Grouped bars of Pass@k at each budget level (Table 1 as a figure), the legend beside
    the axes.

    Args:
      table: ``{policy: {T: pass@(k, T)}}`` (e.g. from ``passk.pass_at_k_table``).
      labels: optional ``{T: column label}``, e.g. :func:`budget_level_labels`; default ``"T=17"``.
    """
    budgets = _budget_columns(table)
    fig, axes = figures.new_figure(width=max(5.0, 1.4 * len(budgets)) + figures.legend_width(table))
    ax = axes[0, 0]
    width = 0.8 / len(table)
    x = np.arange(len(budgets))
    for i, (policy, row) in enumerate(table.items()):
        values = [row[b] for b in budgets]
        bars = ax.bar(x + (i - (len(table) - 1) / 2) * width, values, width, label=policy)
        ax.bar_label(bars, labels=[f"{100 * v:.1f}" for v in values], fontsize=7)
    ax.set_xticks(x, _budget_header(budgets, labels))
    ax.set(ylabel=f"Pass@{k}", ylim=(0, 1.1), title=title or f"Pass@{k} by budget")
    figures.legend_outside(ax)
    return figures.save_figure(fig, out_path)


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


# ---------------------------------------------------------------- files and sections


def _curve_columns(res: PassAtT) -> dict[str, list]:
    """``budget`` and one column per policy (empty where it has no value), and the bound."""
    budgets = sorted({int(b) for c in res.curves.values() for b in c.budget})
    columns: dict[str, list] = {"budget": budgets}
    for policy, curve in res.curves.items():
        lookup = dict(zip(curve.budget.tolist(), curve.value.tolist()))
        columns[policy] = [lookup.get(b) for b in budgets]
    if res.bound is not None:
        lookup = dict(zip(res.bound.budget.tolist(), res.bound.value.tolist()))
        columns["structural_bound"] = [lookup[b] for b in budgets]
    return columns


def budget_list(res: PassAtT) -> str:
    """The budgets the curves plot: ``"1, 2, 3, 6, 9, 12"``."""
    return ", ".join(
        str(b) for b in sorted({int(b) for c in res.curves.values() for b in c.budget})
    )


def section(folder: str | Path, res: PassAtT, name: str = "pass_at_t") -> list[Section]:
    """Write ``<name>.json``/``.csv`` and the Pass@T figure, and with a table
    ``<name>_table.json``/``.csv`` and its figure; the sections "Pass@T at k = ..." and
    (with a table) Table 1."""
    folder = Path(folder)
    record: dict[str, Any] = {
        "k": res.k,
        "curves": {p: {"budget": c.budget, "pass": c.value} for p, c in res.curves.items()},
    }
    if res.bound is not None:
        record["structural_bound"] = {"budget": res.bound.budget, "share_solvable": res.bound.value}
    json_path = write_json(folder / f"{name}.json", record)
    csv_path = write_csv(folder / f"{name}.csv", _curve_columns(res))
    bound = None if res.bound is None else (res.bound.budget, res.bound.value)
    png, _ = plot_pass_at_t(
        {p: (c.budget, c.value) for p, c in res.curves.items()},
        figure_path(folder, name),
        bound=bound,
        k=res.k,
        t_max=res.t_max,
    )
    sections = [
        Section(
            f"Pass@T at k = {res.k}",
            f"Budgets T = {budget_list(res)}, each sampled afresh with its own budget in "
            "the prompt.",
            (rel(folder, png),),
            (rel(folder, json_path), rel(folder, csv_path)),
        )
    ]
    if res.table is not None:
        k, t_max, table = res.k, res.t_max, res.table
        table_name = f"{name}_table"
        table_json = write_json(
            folder / f"{table_name}.json",
            {"k": k, "t_max": t_max, "budgets": budget_levels(t_max), "table": table},
        )
        table_csv = folder / f"{table_name}.csv"
        labels = budget_level_labels(t_max)
        table_csv.write_text(budget_table_csv(table, labels=labels))
        table_png, _ = plot_budget_table(table, figure_path(folder, table_name), k=k, labels=labels)
        sections.append(
            Section(
                f"Pass@{k} at 25/50/75/100% of T_max = {t_max} (Table 1)",
                "Budgets are (p * T_max) // 100.",
                (rel(folder, table_png),),
                (rel(folder, table_json), rel(folder, table_csv)),
                budget_table_markdown(table, k=k, labels=labels),
            )
        )
    return sections
