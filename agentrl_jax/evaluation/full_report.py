"""The whole report: ``report.md`` (and ``report.html``) led by a "Paper findings vs this run"
section, then Table 1 and the sections of every analysis that ran (side effects).

``report.md`` reads: the title, the caller's header (run description, configuration,
timings), the findings of :mod:`.findings` (the count of each verdict, the table, how to read
a verdict), Table 1, then the sections of the analyses present in the registry's order
(:mod:`agentrl_jax.evaluation.analyses.registry`), all computed from the raw results under
``raw/``; ``report.html`` the same, in the same order. ``agentrl-jax eval`` and the
reproduction both end with :func:`write_report`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from agentrl_jax.evaluation import findings
from agentrl_jax.evaluation import report as eval_report
from agentrl_jax.evaluation.analyses import registry
from agentrl_jax.evaluation.analyses.table1 import TABLE1_PREFIX
from agentrl_jax.evaluation.report import Section

SECTIONS_DIR = eval_report.SECTIONS_DIR


def read_sections(
    out: str | Path, analyses: Sequence[str] | None = None
) -> dict[str, list[Section]]:
    """``{analysis: sections}`` of the ``analyses`` (default: every registered one) saved
    under ``out`` (absent ones left out)."""
    names = registry.names() if analyses is None else analyses
    paths = {a: Path(out) / SECTIONS_DIR / f"{a}.json" for a in names}
    return {a: eval_report.read_sections(path)[1] for a, path in paths.items() if path.is_file()}


def write_report(
    out: str | Path,
    *,
    header_markdown: str = "",
    analyses: Sequence[str] | None = None,
    title: str = "Reproduction",
) -> Path:
    """Assemble ``out/report.md`` (see the module docstring) and ``out/findings.json``.

    Args:
      out: the results folder the analyses wrote.
      header_markdown: Markdown placed under the title (run description, config, timings).
      analyses: the analyses to include, in this order (default: every registered one, in
        report order; those not run are skipped).

    Raises:
      ValueError: when ``out`` holds none of ``analyses``.
    """
    out = Path(out)
    analyses = registry.names() if analyses is None else tuple(analyses)
    known = registry.names()
    unknown = [a for a in analyses if a not in known]
    if unknown:
        raise ValueError(f"write_report: unknown analyses {unknown}; known: {', '.join(known)}")
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
