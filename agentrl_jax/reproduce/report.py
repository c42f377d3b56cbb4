"""The reproduction's report: Table 1 with its difference rows, the saved sections of each
analysis, and ``report.md`` with a "Paper findings vs this run" section (side effects).

``report.md`` reads: the title, the caller's header (run description, configuration,
timings), Table 1, the sections of the analyses present in :data:`~.results.ANALYSES` order,
and the findings of :mod:`.findings`, all computed from the raw results under ``raw/``.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from agentrl_jax.evaluation import report as eval_report
from agentrl_jax.evaluation import stats
from agentrl_jax.evaluation.analyses import robustness
from agentrl_jax.evaluation.analyses.pass_at_t import budget_level_labels
from agentrl_jax.evaluation.report import Section
from agentrl_jax.reproduce import findings, results
from agentrl_jax.reproduce.results import ANALYSES

SECTIONS_DIR = eval_report.SECTIONS_DIR
TABLE1_CSV = "table1.csv"
TABLE1_PREFIX = "Table 1"


# ---------------------------------------------------------------- sections of each analysis


def write_sections(out: str | Path, analysis: str, sections: Sequence[Section]) -> Path:
    """``out/sections/<analysis>.json``: the sections an analysis contributes to the report."""
    return eval_report.write_sections(out, analysis, sections)


def read_sections(out: str | Path, analyses: Sequence[str] = ANALYSES) -> dict[str, list[Section]]:
    """``{analysis: sections}`` of the ``analyses`` saved under ``out`` (absent ones left out)."""
    paths = {a: Path(out) / SECTIONS_DIR / f"{a}.json" for a in analyses}
    return {a: eval_report.read_sections(path)[1] for a, path in paths.items() if path.is_file()}


# ---------------------------------------------------------------- Table 1


def _points(ci: stats.MeanCI, signed: bool) -> str:
    value = f"{100 * ci.mean:+.1f}" if signed else f"{100 * ci.mean:.1f}"
    if not signed or not (math.isfinite(ci.low) and math.isfinite(ci.high)):
        return value
    return f"{value} [{100 * ci.low:+.1f}, {100 * ci.high:+.1f}]"


def table1_rows(record: Mapping[str, Any]) -> dict[str, dict[int, stats.MeanCI]]:
    """``{row label: {T: MeanCI}}`` of Table 1, fractions: each policy's Pass@(k, T) (the mean
    over tasks of the unbiased per-task pass@k, normal 95% CI over tasks), then the difference
    rows of :func:`results.table1_deltas` (labels ending in `` (pt)``)."""
    levels = [int(t) for t in record["levels"]]
    rows: dict[str, dict[int, stats.MeanCI]] = {
        policy: {t: stats.mean_ci_normal(results.per_task_pass(record, policy, t)) for t in levels}
        for policy in record["policies"]}
    for label, by_level in results.table1_deltas(record).items():
        rows[f"{label} (pt)"] = by_level
    return rows


def table1_markdown(record: Mapping[str, Any]) -> str:
    """Table 1 as Markdown: Pass@k in % per policy and budget level, then the differences in
    points with their 95% CIs."""
    labels = budget_level_labels(int(record["t_max"]))
    levels = [int(t) for t in record["levels"]]
    header = [f"Pass@{record['k']} (%)"] + [labels[t] for t in levels]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, by_level in table1_rows(record).items():
        signed = label.endswith(" (pt)")
        cells = [label.replace("|", "\\|")] + [_points(by_level[t], signed) for t in levels]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_table1(out: str | Path, record: Mapping[str, Any], section: Section) -> Section:
    """``table1.csv`` (wide: one row per policy and difference, a value and CI bounds in %
    per level) and ``section`` (Table 1 of :func:`agentrl_jax.evaluation.analyses.pass_at_t.section`) with the Markdown
    of :func:`table1_markdown`."""
    out = Path(out)
    labels = budget_level_labels(int(record["t_max"]))
    rows = table1_rows(record)
    columns: dict[str, list] = {"row": list(rows),
                                "kind": ["difference" if r.endswith(" (pt)") else "policy" for r in rows]}
    for t in (int(t) for t in record["levels"]):
        for field in ("mean", "low", "high"):
            name = labels[t] if field == "mean" else f"{labels[t]} ci_{field}"
            columns[name] = [100 * getattr(by_level[t], field) for by_level in rows.values()]
    csv_path = eval_report.write_csv(out / TABLE1_CSV, columns)
    tasks, samples = len(record["task_ids"]), record["samples"]
    text = (f"Pass@{record['k']} at 25/50/75/100% of T_max = {record['t_max']} (budgets "
            f"(p * T_max) // 100), {tasks} tasks x {samples} samples per budget, each budget sampled "
            "afresh with it in the prompt. Rows ending in (pt): mean per-task difference in "
            "points with a 95% normal CI over tasks (paired: the same tasks).")
    return dataclasses.replace(
        section, title=f"{TABLE1_PREFIX}: Pass@{record['k']} by budget level", text=text,
        markdown=table1_markdown(record),
        files=section.files + (results.RAW_DIR + "/table.json", csv_path.relative_to(out).as_posix()))


def write_robustness(out: str | Path, record: Mapping[str, Any]) -> Section:
    """Each policy's budget-robustness score (:mod:`agentrl_jax.evaluation.analyses.robustness`)
    over the raw ``table`` record's budgets, with its CI: ``budget_robustness.json`` and a
    section."""
    counts = {p: results.budget_counts(record, p) for p in record["policies"]}
    return robustness.section(out, robustness.compute(counts, int(record["k"]),
                                                      record["shortest_paths"]))


# ---------------------------------------------------------------- training dynamics


def _change(entry: Mapping[str, Any] | None) -> str:
    if not entry or entry.get("change") is None:
        return "n/a"
    c = results.mean_ci_from_json(entry["change"])
    span = f"{entry['start']:.3f} -> {entry['end']:.3f}: {c.mean:+.3f}"
    return span + (f" [{c.low:+.3f}, {c.high:+.3f}]" if math.isfinite(c.low) else "")


def dynamics_markdown(record: Mapping[str, Any]) -> str:
    """One row per run: R_multi and R_single start -> end and the change with its CI."""
    lines = ["| run | steps | R_multi start -> end: change | R_single start -> end: change |",
             "|---|---|---|---|"]
    for run, entry in record["runs"].items():
        change = entry["change"]
        steps = len(entry["step"])
        lines.append(f"| {run.replace('|', chr(92) + '|')} | {steps} | "
                     f"{_change(change.get('R_multi'))} | {_change(change.get('R_single'))} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- report.md


def write_report(out: str | Path, *, header_markdown: str = "",
                 analyses: Sequence[str] = ANALYSES,
                 title: str = "FrozenLake reproduction") -> Path:
    """Assemble ``out/report.md`` (see the module docstring) and ``out/findings.json``.

    Args:
      out: the results folder the analyses wrote.
      header_markdown: Markdown placed under the title (run description, config, timings).
      analyses: the analyses to include, in this order (those not run are skipped).

    Raises:
      ValueError: when ``out`` holds none of ``analyses``.
    """
    out = Path(out)
    unknown = [a for a in analyses if a not in ANALYSES]
    if unknown:
        raise ValueError(f"write_report: unknown analyses {unknown}; known: {', '.join(ANALYSES)}")
    by_analysis = read_sections(out, analyses)
    if not by_analysis:
        raise ValueError(f"write_report: {out} holds none of the analyses {list(analyses)}")
    ordered = [s for a in analyses for s in by_analysis.get(a, [])]
    table1 = [s for s in ordered if s.title.startswith(TABLE1_PREFIX)]
    rest = [s for s in ordered if not s.title.startswith(TABLE1_PREFIX)]
    checked = findings.check_findings(out, [a for a in analyses if a in by_analysis])
    sections = table1 + rest
    found = findings.write_findings(out, checked, [s.title for s in sections])
    return eval_report.write_report(out, sections + [found], title=title,
                                    preamble=header_markdown, first=findings.FINDINGS_TITLE)
