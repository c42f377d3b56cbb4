"""The findings of this run: every registered analysis' headlines checked on the raw results
(:meth:`~agentrl_jax.evaluation.analyses.registry.Analysis.findings`), in the paper's order,
and the report's section that leads with them.

A finding is judged by one rule (:mod:`.verdicts`: :func:`~.verdicts.judge`, re-exported here
with the headlines and the paper's figures). The analyses are asked in the order of their
``findings_rank`` (the paper's: Pass@K, Table 1, error recovery, training dynamics, then the
open questions of the instruments; a plugin's after them), ties in report order; each is given
every analysis' raw record (None for those not run), so a headline that needs two (error
recovery: ``steps`` and ``errors``) is checked by one of them.

The report's section (:func:`write_findings`) opens with the count of each verdict
(:func:`verdict_summary`), then the table, then the rule in plain words with a worked example
(:data:`VERDICT_RULE`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

from agentrl_jax.evaluation import raw
from agentrl_jax.evaluation import report as eval_report
from agentrl_jax.evaluation.analyses import registry
from agentrl_jax.evaluation.report import Section
from agentrl_jax.evaluation.verdicts import (  # noqa: F401  (re-exported: the findings' words)
    BUDGETMIX_DYNAMICS,
    BUDGETMIX_SMALL,
    DEFAULT_FIGURES,
    ERROR_RECOVERY,
    FULL_BUDGET_DYNAMICS,
    HEADLINES,
    HIDDEN_BUDGET,
    LEAD_GROWS,
    NOT_MEASURED,
    NOT_SHOWN,
    PAPER,
    PAPER_JSON,
    PASS_AT_K,
    POWER_Z,
    REFUTED,
    SHOWS,
    SPLICE_CONTINUATION,
    UNDERPOWERED,
    VERDICT_ORDER,
    VERDICTS,
    Z95,
    Effect,
    Finding,
    PaperFigures,
    detectable,
    judge,
)

FINDINGS_JSON = "findings.json"
FINDINGS_TITLE = "Paper findings vs this run"


def check_findings(
    out: str | Path, analyses: Sequence[str] | None = None, figures: PaperFigures | None = None
) -> list[Finding]:
    """Every headline of the registered analyses, checked on the raw results of ``analyses``
    (default: all) saved under ``out``, against ``figures`` (default: the run's own,
    :meth:`PaperFigures.load`)."""
    figures = PaperFigures.load(out) if figures is None else figures
    every = registry.analyses()
    chosen = set(registry.names() if analyses is None else analyses)
    records = {a.name: raw.load_raw(out, a.name) if a.name in chosen else None for a in every}
    ranked = sorted(range(len(every)), key=lambda i: (every[i].findings_rank, i))
    return [f for i in ranked for f in every[i].findings(records, figures)]


def sources() -> dict[str, str]:
    """``{headline: section title prefix}``: the report section each headline is checked on,
    as its analysis declares it (``sources``; a section naming the finding's subject is
    preferred), so each verdict links to the numbers behind it."""
    return {h: prefix for a in registry.analyses() for h, prefix in a.sources.items()}


def source_anchor(finding: Finding, titles: Sequence[str]) -> str | None:
    """The anchor (:func:`~agentrl_jax.evaluation.html.anchor`) of the section among ``titles``
    a finding was checked on, None if the report has none."""
    from agentrl_jax.evaluation.html import anchor

    prefix = sources().get(finding.headline)
    candidates = [t for t in titles if prefix is not None and t.startswith(prefix)]
    named = [t for t in candidates if finding.subject and finding.subject.split(" vs ")[0] in t]
    return anchor((named or candidates)[0]) if candidates else None


def findings_markdown(found: Sequence[Finding], titles: Sequence[str] = ()) -> str:
    """The findings table; with the report's section ``titles`` each verdict links to the
    section it was checked on."""
    lines = [
        "| Paper headline | Checked on | Paper | This run | Verdict |",
        "|---|---|---|---|---|",
    ]
    for f in found:
        target = source_anchor(f, titles)
        verdict = f"**{f.verdict}**" if target is None else f"[**{f.verdict}**](#{target})"
        cells = [f.headline, f.subject or "-", f.paper, f.observed, verdict]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def verdict_summary(found: Sequence[Finding]) -> str:
    """One line counting the findings' verdicts: ``Of 25 findings: 0 shows, 0 refuted, 10 does
    not show, 15 underpowered, 0 not measured.`` (every verdict named, in :data:`VERDICTS`
    order)."""
    counts = [f"{sum(f.verdict == v for f in found)} {v}" for v in VERDICTS]
    return f"Of {len(found)} findings: {', '.join(counts)}."


# The rule of :func:`judge` in plain words, one sentence a verdict, and a worked example whose
# numbers are made up but judged as :func:`judge` and :func:`detectable` judge them (a test
# checks it).
VERDICT_RULE = """\
**How to read a verdict.** Each §9 / §7.5 headline is checked in kind on this run's raw \
results, as one or more effects, each with its 95% interval:

- **shows**: the whole 95% interval lies on the side the paper predicts.
- **refuted**: the whole interval lies on the other side.
- **does not show**: the interval contains zero, although the run was large enough to detect \
an effect of the paper's size: its smallest detectable effect (80% power at the 5% level) is \
at most that size.
- **underpowered**: the interval contains zero and the run was too small to tell (its \
smallest detectable effect is larger than the paper's, or the paper gives no size, or every \
difference is exactly 0). It says nothing either way.
- **not measured**: the analysis it needs was not run.

Example (made-up numbers): the paper reports RL ahead of base by 10 pt. A lead of \
+5.2 pt [+0.3, +10.1] shows "RL beats base". A lead of +5.2 pt [-0.7, +11.1] does not show \
it: the interval contains zero, and its smallest detectable effect, 8.4 pt, is below the \
paper's 10 pt. A lead of +5.2 pt [-6.8, +17.2] is underpowered: its smallest detectable \
effect is 17.2 pt.

A headline with several effects takes its weakest effect's verdict (refuted, then does not \
show, then underpowered, then shows). "BudgetMix keeps R_single" is tested against a fall as \
large as full-budget RL's in the paper: that fall, not zero, is the line the interval must \
stay above. Differences are paired per task (Pass@k) or per state (continuation); training \
changes compare the means of the first and last tenth of the logged steps. A small model on a \
few tasks can miss effects the paper measured at scale: a verdict describes this run only.
"""


def write_findings(
    out: str | Path, found: Sequence[Finding], titles: Sequence[str] = ()
) -> Section:
    """``findings.json`` and the report's section: the count of each verdict
    (:func:`verdict_summary`), the findings table (its verdicts linking to the sections among
    ``titles`` they were checked on), then how to read a verdict (:data:`VERDICT_RULE`)."""
    out = Path(out)
    path = eval_report.write_json(out / FINDINGS_JSON, [dataclasses.asdict(f) for f in found])
    return Section(
        FINDINGS_TITLE,
        f"**{verdict_summary(found)}**",
        files=(path.relative_to(out).as_posix(),),
        markdown=findings_markdown(found, titles) + "\n" + VERDICT_RULE,
    )
