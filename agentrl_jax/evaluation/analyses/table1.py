"""Table 1 with its differences (PAPER.md §3, §9): each policy's Pass@(k, T) at the budget levels
25/50/75/100% of ``T_max`` -- the mean over tasks of the unbiased per-task pass@k with a normal
95% CI over tasks -- and, for chosen pairs of policies, the paired per-task difference with its
CI (the same tasks), shown in points.

``compute`` -> :class:`Table1`; :func:`markdown` renders it; :func:`section` writes
``table1.csv`` and fills a report section (the table is its figure).

The ``table`` analysis (:data:`ANALYSIS`): Pass@(k, T) at every budget (each sampled afresh
with T in the prompt), the Pass@T figure with the structural bound
(:mod:`.pass_at_t`), Table 1 with the RL - base and BudgetMix - full-budget differences, and
budget robustness (:mod:`.robustness`); it checks the paper's "lead grows with T" and
"BudgetMix beats full-budget RL at small budgets".
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from agentrl_jax.evaluation import drivers, passk, raw, stats
from agentrl_jax.evaluation.analyses import pass_at_t, robustness
from agentrl_jax.evaluation.analyses.context import AnalysisRun, with_
from agentrl_jax.evaluation.analyses.pass_at_t import budget_level_labels
from agentrl_jax.evaluation.analyses.registry import Analysis, register
from agentrl_jax.evaluation.report import Section, rel, write_csv
from agentrl_jax.evaluation.result import Result, result
from agentrl_jax.evaluation.verdicts import (
    BUDGETMIX_SMALL,
    DEFAULT_FIGURES,
    LEAD_GROWS,
    Effect,
    Finding,
    PaperFigures,
    absent,
    effects_json,
    power,
    pt,
    verdict,
)

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


# ---------------------------------------------------------------- the table analysis


def write_table1(out: str | Path, record: Mapping[str, Any], into: Section) -> Section:
    """Table 1 of the raw ``table`` record (each policy, then every policy after the base
    minus the base and every BudgetMix policy minus its counterpart): ``table1.csv`` and
    ``into`` (Pass@T's Table 1 section) with its Markdown."""
    policies = list(record["policies"])
    pairs = [(p, policies[0]) for p in policies[1:]] + list(raw.counterparts(record).items())
    res = compute(
        {p: raw.budget_counts(record, p) for p in policies},
        k=int(record["k"]),
        t_max=int(record["t_max"]),
        levels=record["levels"],
        pairs=pairs,
    )
    return section(
        out,
        res,
        into,
        tasks=len(record["task_ids"]),
        samples=record["samples"],
        files=(raw.RAW_DIR + "/table.json",),
    )


def write_robustness(out: str | Path, record: Mapping[str, Any]) -> Section:
    """Each policy's budget-robustness score (:mod:`.robustness`) over the raw ``table``
    record's budgets, with its CI: ``budget_robustness.json`` and a section."""
    counts = {p: raw.budget_counts(record, p) for p in record["policies"]}
    return robustness.section(
        out, robustness.compute(counts, int(record["k"]), record["shortest_paths"])
    )


def _level_differences(record, a: str, b: str) -> list[np.ndarray]:
    return [
        raw.per_task_pass(record, a, t) - raw.per_task_pass(record, b, t) for t in record["levels"]
    ]


def check_lead_grows(
    record: Mapping[str, Any], figures: PaperFigures = DEFAULT_FIGURES
) -> list[Finding]:
    """The lead over base at 100% minus the lead at 25% of T_max (per-task, paired), for the
    full-budget RL policies (all others if none is full-budget)."""
    base, others = record["policies"][0], record["policies"][1:]
    subjects = [p for p in others if not raw.is_budgetmix(p, record)] or others
    out = []
    for policy in subjects:
        diffs = _level_differences(record, policy, base)
        leads = [float(d.mean()) for d in diffs]
        growth = stats.paired_difference(diffs[-1], diffs[0])
        monotone = all(x < y for x, y in zip(leads, leads[1:]))
        small = (
            "reverses (<= 0)"
            if leads[0] <= 0
            else "shrinks"
            if leads[0] < leads[-1]
            else "does not shrink"
        )
        observed = (
            f"lead at 25/50/75/100%: {', '.join(f'{100 * v:+.1f}' for v in leads)} pt "
            f"({'increasing' if monotone else 'not monotone'}); at 25% it {small}; "
            f"lead at 100% minus lead at 25%: {pt(growth)}"
        )
        effect = Effect("lead growth", growth)
        out.append(
            Finding(
                LEAD_GROWS,
                policy,
                figures.text(LEAD_GROWS),
                observed + power(effect),
                verdict(effect),
                {
                    "levels": record["levels"],
                    "lead": leads,
                    "growth": growth,
                    "effects": effects_json(effect),
                },
            )
        )
    return out


def check_budgetmix_small(
    record: Mapping[str, Any], figures: PaperFigures = DEFAULT_FIGURES
) -> list[Finding]:
    """BudgetMix minus its full-budget counterpart at 25% and 50% of T_max (paired per task);
    75% and 100% are reported alongside."""
    pairs = raw.counterparts(record)
    if not pairs:
        return [
            absent(
                BUDGETMIX_SMALL,
                "no BudgetMix policy evaluated with its full-budget counterpart",
                figures=figures,
            )
        ]
    out = []
    for mix, full in pairs.items():
        deltas = [stats.mean_ci_normal(d) for d in _level_differences(record, mix, full)]
        effects = [
            Effect(f"{p}%", d, size=size)
            for p, d, size in zip(record["percents"][:2], deltas[:2], figures.budgetmix_small)
        ]
        observed = "; ".join(f"{p}%: {pt(d)}" for p, d in zip(record["percents"], deltas))
        out.append(
            Finding(
                BUDGETMIX_SMALL,
                f"{mix} vs {full}",
                figures.text(BUDGETMIX_SMALL),
                observed + power(*effects),
                verdict(*effects),
                {
                    "levels": record["levels"],
                    "difference": deltas,
                    "effects": effects_json(*effects),
                },
            )
        )
    return out


class Table(Analysis):
    """Pass@T, Table 1 and budget robustness on every task, at every budget."""

    name = "table"
    unit_seconds = 1.0e-3  # fit on the stored default run (reproduce.progress)
    findings_rank = 1  # the paper's order: after Pass@K
    sources = {LEAD_GROWS: "Table 1", BUDGETMIX_SMALL: "Table 1"}

    def tasks(self, settings: Any, task_ids: Sequence[int]) -> Sequence[int]:
        return task_ids  # Table 1's and Pass@T's intervals need every task

    def units(self, settings: Any, num_tasks: int, policies: int, t_max: int) -> int:
        budgets = settings.table_budgets(t_max)
        return policies * sum(
            drivers.rollout_units(num_tasks, settings.samples, b) for b in budgets
        )

    def run(self, run: AnalysisRun) -> list[Section]:
        s = run.settings
        budgets = s.table_budgets(run.t_max)
        counts = drivers.pass_at_t_counts(
            run.play, run.policies, run.key("passt"), budgets=budgets, samples=s.samples
        )
        shortest = np.asarray(run.min_turns)[run.task_ids]
        record = {
            "k": s.k,
            "samples": s.samples,
            "budgets": budgets,
            "levels": passk.budget_levels(run.t_max),
            "percents": passk.BUDGET_PERCENTS,
            "bound_note": run.bound_note,
            "shortest_paths": shortest,
            "counts": {
                p: {b: {"n": n, "c": c} for b, (n, c) in by_budget.items()}
                for p, by_budget in counts.items()
            },
        }
        raw_file = run.write_raw("table", record)
        curve, table = pass_at_t.section(
            run.out, pass_at_t.compute(counts, k=s.k, t_max=run.t_max, shortest_paths=shortest)
        )
        curve = with_(
            curve,
            f"Pass@T at k = {s.k}",
            f"{len(run.task_ids)} tasks x {s.samples} samples per budget. Dashed: the "
            f"structural bound, the share of tasks whose shortest path fits in T "
            f"({run.bound_note}).",
            (raw_file,),
        )
        saved = raw.load_raw(run.out, "table")
        table = write_table1(run.out, saved, table)
        return [table, curve, write_robustness(run.out, saved)]

    def findings(self, records: Mapping[str, Any], figures: PaperFigures) -> list[Finding]:
        record = records.get("table")
        if record is not None and len(record["policies"]) > 1:
            return check_lead_grows(record, figures) + check_budgetmix_small(record, figures)
        return [
            absent(LEAD_GROWS, "Pass@T of base and an RL policy not run", figures=figures),
            absent(BUDGETMIX_SMALL, "Pass@T not run", figures=figures),
        ]


ANALYSIS = register(Table())
