"""Table 1 with its differences (PAPER.md §3, §9): each policy's Pass@(k, T) at the budget levels
25/50/75/100% of ``T_max`` -- the mean over tasks of the unbiased per-task pass@k with a normal
95% CI over tasks -- and, for chosen pairs of policies, the paired per-task difference with its
CI (the same tasks), shown in points.

``compute`` -> :class:`Table1`; :func:`markdown` renders it; :func:`section` writes
``table1.csv`` and fills a report section (the table is its figure).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Mapping, Sequence

from agentrl_jax.evaluation import passk, stats
from agentrl_jax.evaluation.analyses.pass_at_t import budget_level_labels
from agentrl_jax.evaluation.report import Section, rel, write_csv
from agentrl_jax.evaluation.result import Result, result

TABLE1_CSV = "table1.csv"
TABLE1_PREFIX = "Table 1"
DIFFERENCE = " (pt)"  # the end of a difference row's label


@result
class Table1(Result):
    """``rows``: ``{label: {T: MeanCI}}`` in fractions at ``levels``: one per policy, then one
    per pair ``"<a> - <b> (pt)"`` (a difference)."""

    k: int
    t_max: int
    levels: tuple[int, ...]
    rows: dict[str, dict[int, stats.MeanCI]]


def compute(
    counts_by_policy: Mapping[str, passk.BudgetResults],
    *,
    k: int,
    t_max: int,
    levels: Sequence[int],
    pairs: Sequence[tuple[str, str]],
) -> Table1:
    """Table 1 of ``{policy: {T: (n [tasks], c [tasks])}}`` at ``levels`` (the budget levels of
    ``t_max``) with the difference rows of ``pairs`` ``(a, b)``: a - b per task."""
    levels = tuple(int(t) for t in levels)
    per_task = {
        p: {t: passk.pass_at_k(*counts[t], k) for t in levels}
        for p, counts in counts_by_policy.items()
    }
    rows = {
        p: {t: stats.mean_ci_normal(by_level[t]) for t in levels}
        for p, by_level in per_task.items()
    }
    for a, b in pairs:
        rows[f"{a} - {b}{DIFFERENCE}"] = {
            t: stats.paired_difference(per_task[a][t], per_task[b][t]) for t in levels
        }
    return Table1(int(k), int(t_max), levels, rows)


def _points(ci: stats.MeanCI, signed: bool) -> str:
    """``64.2 [58.6, 69.7]`` (a policy's Pass@k in %) or ``+5.2 [+0.3, +10.1]`` (a difference
    in points): the value and its 95% CI, as ``table1.csv`` holds them, to one decimal; the
    value alone without a CI."""
    form = "{:+.1f}" if signed else "{:.1f}"
    value = form.format(100 * ci.mean)
    if not (math.isfinite(ci.low) and math.isfinite(ci.high)):
        return value
    return f"{value} [{form.format(100 * ci.low)}, {form.format(100 * ci.high)}]"


def markdown(res: Table1) -> str:
    """Table 1 as Markdown: Pass@k in % per policy and budget level, then the differences in
    points, each cell with its 95% CI."""
    labels = budget_level_labels(res.t_max)
    header = [f"Pass@{res.k} (%)"] + [labels[t] for t in res.levels]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, by_level in res.rows.items():
        signed = label.endswith(DIFFERENCE)
        cells = [label.replace("|", "\\|")] + [_points(by_level[t], signed) for t in res.levels]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def section(
    folder: str | Path,
    res: Table1,
    into: Section,
    *,
    tasks: int,
    samples: int,
    files: Sequence[str] = (),
) -> Section:
    """Write ``table1.csv`` (wide: one row per policy and difference, a value and CI bounds in
    % per level) and return ``into`` (e.g. Pass@T's Table 1 section) retitled, with the
    Markdown of :func:`markdown`, and linking ``files`` and the CSV."""
    folder = Path(folder)
    labels = budget_level_labels(res.t_max)
    columns: dict[str, list] = {
        "row": list(res.rows),
        "kind": ["difference" if r.endswith(DIFFERENCE) else "policy" for r in res.rows],
    }
    for t in res.levels:
        for field in ("mean", "low", "high"):
            name = labels[t] if field == "mean" else f"{labels[t]} ci_{field}"
            columns[name] = [100 * getattr(by_level[t], field) for by_level in res.rows.values()]
    csv_path = write_csv(folder / TABLE1_CSV, columns)
    text = (
        f"Pass@{res.k} at 25/50/75/100% of T_max = {res.t_max} (budgets "
        f"(p * T_max) // 100), {tasks} tasks x {samples} samples per budget, each budget sampled "
        "afresh with it in the prompt. Each cell: the value [its 95% normal CI over tasks]. "
        "Policy rows: Pass@k in %; rows ending in (pt): the mean per-task difference in "
        "points (paired: the same tasks)."
    )
    return dataclasses.replace(
        into,
        title=f"{TABLE1_PREFIX}: Pass@{res.k} by budget level",
        text=text,
        markdown=markdown(res),
        files=into.files + tuple(files) + (rel(folder, csv_path),),
    )
