"""The reproduction's report: Table 1 with its difference rows, the saved sections of each
analysis, and ``report.md`` led by a "Paper findings vs this run" section (side effects).

``report.md`` reads: the title, the caller's header (run description, configuration,
timings), the findings of :mod:`.findings` (the count of each verdict, the table, how to read
a verdict), Table 1, then the sections of the analyses present in
:data:`~.results.ANALYSES` order, all computed from the raw results under ``raw/``;
``report.html`` the same, in the same order.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from agentrl_jax.evaluation import report as eval_report
from agentrl_jax.evaluation.analyses import robustness, table1
from agentrl_jax.evaluation.report import Section
from agentrl_jax.reproduce import findings, results
from agentrl_jax.reproduce.results import ANALYSES

SECTIONS_DIR = eval_report.SECTIONS_DIR
TABLE1_CSV, TABLE1_PREFIX = table1.TABLE1_CSV, table1.TABLE1_PREFIX


# ---------------------------------------------------------------- sections of each analysis


def write_sections(out: str | Path, analysis: str, sections: Sequence[Section]) -> Path:
    """``out/sections/<analysis>.json``: the sections an analysis contributes to the report."""
    return eval_report.write_sections(out, analysis, sections)


def read_sections(out: str | Path, analyses: Sequence[str] = ANALYSES) -> dict[str, list[Section]]:
    """``{analysis: sections}`` of the ``analyses`` saved under ``out`` (absent ones left out)."""
    paths = {a: Path(out) / SECTIONS_DIR / f"{a}.json" for a in analyses}
    return {a: eval_report.read_sections(path)[1] for a, path in paths.items() if path.is_file()}


# ---------------------------------------------------------------- Table 1 and robustness


def write_table1(out: str | Path, record: Mapping[str, Any], section: Section) -> Section:
    """Table 1 of the raw ``table`` record (:mod:`agentrl_jax.evaluation.analyses.table1`: each
    policy, then every policy after the base minus the base and every BudgetMix policy minus
    its counterpart): ``table1.csv`` and ``section`` (Pass@T's Table 1) with its Markdown."""
    policies = list(record["policies"])
    pairs = [(p, policies[0]) for p in policies[1:]] + list(
        results.budgetmix_counterparts(policies).items()
    )
    res = table1.compute(
        {p: results.budget_counts(record, p) for p in policies},
        k=int(record["k"]),
        t_max=int(record["t_max"]),
        levels=record["levels"],
        pairs=pairs,
    )
    return table1.section(
        out,
        res,
        section,
        tasks=len(record["task_ids"]),
        samples=record["samples"],
        files=(results.RAW_DIR + "/table.json",),
    )


def write_robustness(out: str | Path, record: Mapping[str, Any]) -> Section:
    """Each policy's budget-robustness score (:mod:`agentrl_jax.evaluation.analyses.robustness`)
    over the raw ``table`` record's budgets, with its CI: ``budget_robustness.json`` and a
    section."""
    counts = {p: results.budget_counts(record, p) for p in record["policies"]}
    return robustness.section(
        out, robustness.compute(counts, int(record["k"]), record["shortest_paths"])
    )


# ---------------------------------------------------------------- training dynamics


def _change(entry: Mapping[str, Any] | None) -> str:
    if not entry or entry.get("change") is None:
        return "n/a"
    c = results.mean_ci_from_json(entry["change"])
    span = f"{entry['start']:.3f} -> {entry['end']:.3f}: {c.mean:+.3f}"
    return span + (f" [{c.low:+.3f}, {c.high:+.3f}]" if math.isfinite(c.low) else "")


def dynamics_markdown(record: Mapping[str, Any]) -> str:
    """One row per run: R_multi and R_single start -> end and the change with its CI."""
    lines = [
        "| run | steps | R_multi start -> end: change | R_single start -> end: change |",
        "|---|---|---|---|",
    ]
    for run, entry in record["runs"].items():
        change = entry["change"]
        steps = len(entry["step"])
        lines.append(
            f"| {run.replace('|', chr(92) + '|')} | {steps} | "
            f"{_change(change.get('R_multi'))} | {_change(change.get('R_single'))} |"
        )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- report.md


def write_report(
    out: str | Path,
    *,
    header_markdown: str = "",
    analyses: Sequence[str] = ANALYSES,
    title: str = "Reproduction",
) -> Path:
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
    return eval_report.write_report(
        out,
        [found] + sections,
        title=title,
        preamble=header_markdown,
        first=findings.FINDINGS_TITLE,
    )
