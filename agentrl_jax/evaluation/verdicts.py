"""What a finding is and how it is judged: the paper's headlines (PAPER.md §9, §7.5) and its
figures, :class:`Finding`, :class:`Effect` and the one rule (:func:`judge`).

Each analysis checks its headlines on the raw records (:mod:`.raw`, never a report section;
:meth:`~agentrl_jax.evaluation.analyses.registry.Analysis.findings`), recomputes its numbers,
and returns a :class:`Finding` per policy (or run) it applies to. A headline is
one or more tested effects (:class:`Effect`: a 95% CI, the paper's direction and, where the
paper gives it, the paper's size), each judged by one rule (:func:`judge`):

* ``shows``: the whole CI lies on the side the paper predicts (zero excluded);
* ``refuted``: the whole CI lies on the other side;
* ``does not show``: the CI contains zero, although the run could have detected an effect of
  the paper's size (its smallest detectable effect, :func:`detectable`, is at most that size);
* ``underpowered``: the CI contains zero and the run could not have detected an effect of the
  paper's size (or the paper gives no size, or there is no CI, or the CI is [0, 0]: every
  difference exactly 0, e.g. both policies fail every task): it says nothing.

A headline's verdict is its weakest effect's (refuted < does not show < underpowered <
shows); ``not measured``: the analyses it needs were not run (or do not apply). A "keeps"
headline (BudgetMix keeps R_single) tests non-inferiority: "no effect" is then a fall as large
as the paper's full-budget one. CIs are normal 95% intervals of paired per-task (or per-state)
differences (:func:`stats.paired_difference`), or of a difference of two means.

The report's section (:func:`agentrl_jax.evaluation.findings.write_findings`) opens with the
count of each verdict, then the table, then the rule in plain words with a worked example.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from statistics import NormalDist
from typing import Any, Mapping

from agentrl_jax.evaluation import raw, stats
from agentrl_jax.evaluation import report as eval_report

SHOWS, UNDERPOWERED, NOT_SHOWN, REFUTED, NOT_MEASURED = (
    "shows",
    "underpowered",
    "does not show",
    "refuted",
    "not measured",
)
VERDICT_ORDER = (REFUTED, NOT_SHOWN, UNDERPOWERED, SHOWS)  # weakest first
VERDICTS = (SHOWS, REFUTED, NOT_SHOWN, UNDERPOWERED, NOT_MEASURED)  # as the summary counts them
Z95 = NormalDist().inv_cdf(0.975)
POWER_Z = Z95 + NormalDist().inv_cdf(0.80)  # 80% power at a two-sided 5% level: 2.80 SE

PASS_AT_K = "RL beats base at every k of Pass@K"
LEAD_GROWS = "RL's lead over base grows with T (shrinks or reverses at 25% of T_max)"
BUDGETMIX_SMALL = "BudgetMix beats full-budget RL at small budgets (25%, 50%)"
ERROR_RECOVERY = "Error recovery, not single-step quality, is where RL gains"
FULL_BUDGET_DYNAMICS = "Full-budget RL: R_multi rises while R_single falls"
BUDGETMIX_DYNAMICS = "BudgetMix keeps R_single"
# open questions the paper leaves (its §9 discussion), measured by this stack's instruments
HIDDEN_BUDGET = "Hiding the budget costs the policy (open question)"
SPLICE_CONTINUATION = "RL's advantage lies in how it continues, not in where it got (open question)"

# short names of the headlines (PaperFigures.texts, a study's paper_figures)
HEADLINES = {
    "pass_at_k": PASS_AT_K,
    "lead_grows": LEAD_GROWS,
    "budgetmix_small": BUDGETMIX_SMALL,
    "error_recovery": ERROR_RECOVERY,
    "full_budget_dynamics": FULL_BUDGET_DYNAMICS,
    "budgetmix_dynamics": BUDGETMIX_DYNAMICS,
    "hidden_budget": HIDDEN_BUDGET,
    "splice_continuation": SPLICE_CONTINUATION,
}

PAPER = {
    PASS_AT_K: "RL above base for k = 1..128 (§9)",
    LEAD_GROWS: "FrozenLake 4B at 25%: GRPO 28.7% vs base 30.3%; the lead grows with T (§9)",
    BUDGETMIX_SMALL: "+7.5 pt at 25%, +5.3 at 50% (+4.0 at 75%, +1.1 at 100%), averaged; "
    "FrozenLake GRPO 4B at 25%: 37.6 vs 28.7 (§9)",
    ERROR_RECOVERY: "FrozenLake: RL better on 42.8% of matched states (mean -0.018) but 65.7% of "
    "error states; continuation 51.3% vs 38.6% (§7.1, §7.2)",
    FULL_BUDGET_DYNAMICS: "FrozenLake R_multi +0.568, R_single -0.091 (§7.5)",
    BUDGETMIX_DYNAMICS: "R_single +0.006 with R_multi +0.323 (§7.5)",
    HIDDEN_BUDGET: "not tested: every prompt states the budget (§6); the budget-aware prompt is "
    "what BudgetMix relies on",
    SPLICE_CONTINUATION: "argued from correlational evidence (ActionNLL overlap, cumulative "
    "LLR, §7.4): RL composes locally reasonable actions more reliably",
}


# The paper's effect sizes the verdicts measure power against (PAPER's numbers).
BUDGETMIX_SMALL_SIZES = (0.075, 0.053)  # BudgetMix - full budget at 25%, 50% of T_max
ERROR_RECOVERY_GAIN = 0.513 - 0.386  # continuation from error states, RL - base
FULL_BUDGET_R_MULTI, FULL_BUDGET_R_SINGLE = 0.568, 0.091  # |change| over training
PAPER_JSON = "paper.json"  # under raw/: the figures a run's findings cite (PaperFigures)


@dataclasses.dataclass(frozen=True)
class PaperFigures:
    """What the paper reports on one environment: the text each headline cites (``texts``,
    over :data:`PAPER`) and the effect sizes the verdicts measure power against. The defaults
    are the paper's headline figures (§9, §7; where it gives them for one environment,
    FrozenLake's); an environment's study gives its own
    (a study's ``paper_figures``), and a run keeps them in
    ``raw/paper.json``, so its findings recompute with the figures it was compared with."""

    texts: Mapping[str, str] = dataclasses.field(default_factory=dict)  # {HEADLINES key: text}
    budgetmix_small: tuple[float, float] = BUDGETMIX_SMALL_SIZES
    error_recovery_gain: float = ERROR_RECOVERY_GAIN
    r_multi: float = FULL_BUDGET_R_MULTI
    r_single: float = FULL_BUDGET_R_SINGLE

    def __post_init__(self):
        unknown = sorted(set(self.texts) - set(HEADLINES))
        if unknown:
            raise ValueError(
                f"PaperFigures.texts: unknown headlines {unknown}; known: {list(HEADLINES)}"
            )
        object.__setattr__(self, "texts", dict(self.texts))
        object.__setattr__(self, "budgetmix_small", tuple(float(x) for x in self.budgetmix_small))

    def text(self, headline: str) -> str:
        """What the paper reports for ``headline`` (one of :data:`PAPER`)."""
        key = next(k for k, h in HEADLINES.items() if h == headline)
        return self.texts.get(key, PAPER[headline])

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "PaperFigures":
        return cls(**(data or {}))

    @classmethod
    def load(cls, out: str | Path) -> "PaperFigures":
        """A run's figures (``raw/paper.json``; the defaults for a run that has none)."""
        path = Path(out) / raw.RAW_DIR / PAPER_JSON
        if not path.is_file():
            return cls()
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError) as error:
            raise ValueError(f"{path}: not the paper's figures ({error})") from None

    def write(self, out: str | Path) -> Path:
        return eval_report.write_json(
            Path(out) / raw.RAW_DIR / PAPER_JSON, dataclasses.asdict(self)
        )


DEFAULT_FIGURES = PaperFigures()


@dataclasses.dataclass(frozen=True)
class Finding:
    """One headline checked on one policy (or run, or pair): the claim, the paper's numbers,
    this run's, the verdict and the numbers behind it (for ``findings.json``)."""

    headline: str
    subject: str
    paper: str
    observed: str
    verdict: str
    numbers: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Effect:
    """One tested effect of a headline: its 95% CI, the paper's direction (+1: up, -1: down)
    and the paper's size in the CI's units (None where the paper gives none); ``margin``: a
    non-inferiority test (the paper says "keeps"), "no effect" being a change of ``-margin``
    (in the paper's direction); ``points``: a difference of rates, shown in points."""

    name: str
    ci: stats.MeanCI
    direction: int = 1
    size: float | None = None
    margin: float = 0.0
    points: bool = True


def detectable(ci: stats.MeanCI) -> float:
    """The smallest true effect this CI's run would detect with 80% power at the 5% level:
    2.80 standard errors (the SE read off the 95% interval); NaN without a CI."""
    if not (math.isfinite(ci.low) and math.isfinite(ci.high)):
        return math.nan
    return POWER_Z * (ci.high - ci.low) / (2 * Z95)


def judge(effect: Effect) -> str:
    """The verdict on one effect (see the module docstring)."""
    ci, d = effect.ci, effect.direction
    if not (math.isfinite(ci.low) and math.isfinite(ci.high)):
        return UNDERPOWERED
    if ci.low == ci.high == 0:  # every difference exactly 0 (e.g. both fail every task, or a
        return UNDERPOWERED  # metric stuck at 0): a zero-width interval at 0 says nothing
    low, high = sorted((d * ci.low, d * ci.high))  # in the paper's direction
    if high < 0:  # a "keeps" effect that significantly falls is refuted too (not kept)
        return REFUTED
    if low > -effect.margin:
        return SHOWS
    reference = effect.size if effect.margin == 0 else effect.margin
    if reference is None or detectable(ci) > reference:
        return UNDERPOWERED
    return NOT_SHOWN


def verdict(*effects: Effect) -> str:
    """The weakest of the effects' verdicts."""
    return min((judge(e) for e in effects), key=VERDICT_ORDER.index)


def power(*effects: Effect) -> str:
    """``; smallest detectable: ...`` for the observed text (points for rates)."""
    parts = []
    for e in effects:
        mde = detectable(e.ci)
        if math.isfinite(mde):
            parts.append(f"{e.name} {100 * mde:.1f} pt" if e.points else f"{e.name} {mde:.3f}")
    return f"; smallest detectable: {', '.join(parts)}" if parts else ""


def effects_json(*effects: Effect) -> dict[str, Any]:
    """Each effect's verdict and what it was judged on, by name (``findings.json``'s
    ``numbers["effects"]``): ``estimate``, ``low``, ``high`` and ``n`` (its 95% CI; a missing
    bound is NaN, written null), ``direction``, ``points``, ``paper_size``, ``margin`` and
    ``detectable``; :mod:`.seeds` reads them across seeds."""
    return {
        e.name: {
            "verdict": judge(e),
            "detectable": detectable(e.ci),
            "paper_size": e.size,
            "margin": e.margin,
            "estimate": float(e.ci.mean),
            "low": float(e.ci.low),
            "high": float(e.ci.high),
            "n": int(e.ci.n),
            "direction": int(e.direction),
            "points": bool(e.points),
        }
        for e in effects
    }


def difference(a: stats.MeanCI, b: stats.MeanCI) -> stats.MeanCI:
    """``a - b`` of two independent estimates with their normal CIs combined."""
    diff = a.mean - b.mean
    if not all(math.isfinite(x) for x in (a.low, a.high, b.low, b.high)):
        return stats.MeanCI(diff, math.nan, math.nan, a.n + b.n)
    half = math.hypot((a.high - a.low) / 2, (b.high - b.low) / 2)
    return stats.MeanCI(diff, diff - half, diff + half, a.n + b.n)


def pt(ci: stats.MeanCI) -> str:
    """``+3.1 pt [-0.4, +6.6]`` (fractions shown in points)."""
    text = f"{100 * ci.mean:+.1f} pt"
    return text + (f" [{100 * ci.low:+.1f}, {100 * ci.high:+.1f}]" if math.isfinite(ci.low) else "")


def num(ci: stats.MeanCI, digits: int = 3) -> str:
    text = f"{ci.mean:+.{digits}f}"
    return text + (
        f" [{ci.low:+.{digits}f}, {ci.high:+.{digits}f}]" if math.isfinite(ci.low) else ""
    )


def absent(headline: str, why: str, figures: PaperFigures = DEFAULT_FIGURES) -> Finding:
    return Finding(headline, "", figures.text(headline), why, NOT_MEASURED)
