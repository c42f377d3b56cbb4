"""The paper's headline results (PAPER.md §9, §7.5) checked against this run's raw results.

Each check reads the raw records of :mod:`.results` (never a report section), recomputes
its numbers, and returns a :class:`Finding` per policy (or run) it applies to. A headline is
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

The report's section (:func:`write_findings`) opens with the count of each verdict
(:func:`verdict_summary`), then the table, then the rule in plain words with a worked example
(:data:`VERDICT_RULE`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from statistics import NormalDist
from typing import Any, Mapping, Sequence

import numpy as np

from agentrl_jax.evaluation import passk, stats
from agentrl_jax.evaluation import report as eval_report
from agentrl_jax.evaluation.report import Section
from agentrl_jax.reproduce import results
from agentrl_jax.reproduce.results import ANALYSES

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
FINDINGS_JSON = "findings.json"
FINDINGS_TITLE = "Paper findings vs this run"

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
    (:attr:`agentrl_jax.reproduce.studies.Study.paper_figures`), and a run keeps them in
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
        path = Path(out) / results.RAW_DIR / PAPER_JSON
        if not path.is_file():
            return cls()
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError) as error:
            raise ValueError(f"{path}: not the paper's figures ({error})") from None

    def write(self, out: str | Path) -> Path:
        return eval_report.write_json(
            Path(out) / results.RAW_DIR / PAPER_JSON, dataclasses.asdict(self)
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


def _verdict(*effects: Effect) -> str:
    """The weakest of the effects' verdicts."""
    return min((judge(e) for e in effects), key=VERDICT_ORDER.index)


def _power(*effects: Effect) -> str:
    """``; smallest detectable: ...`` for the observed text (points for rates)."""
    parts = []
    for e in effects:
        mde = detectable(e.ci)
        if math.isfinite(mde):
            parts.append(f"{e.name} {100 * mde:.1f} pt" if e.points else f"{e.name} {mde:.3f}")
    return f"; smallest detectable: {', '.join(parts)}" if parts else ""


def _effects_json(*effects: Effect) -> dict[str, Any]:
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


def _difference(a: stats.MeanCI, b: stats.MeanCI) -> stats.MeanCI:
    """``a - b`` of two independent estimates with their normal CIs combined."""
    diff = a.mean - b.mean
    if not all(math.isfinite(x) for x in (a.low, a.high, b.low, b.high)):
        return stats.MeanCI(diff, math.nan, math.nan, a.n + b.n)
    half = math.hypot((a.high - a.low) / 2, (b.high - b.low) / 2)
    return stats.MeanCI(diff, diff - half, diff + half, a.n + b.n)


def _pt(ci: stats.MeanCI) -> str:
    """``+3.1 pt [-0.4, +6.6]`` (fractions shown in points)."""
    text = f"{100 * ci.mean:+.1f} pt"
    return text + (f" [{100 * ci.low:+.1f}, {100 * ci.high:+.1f}]" if math.isfinite(ci.low) else "")


def _num(ci: stats.MeanCI, digits: int = 3) -> str:
    text = f"{ci.mean:+.{digits}f}"
    return text + (
        f" [{ci.low:+.{digits}f}, {ci.high:+.{digits}f}]" if math.isfinite(ci.low) else ""
    )


def _absent(headline: str, why: str, figures: PaperFigures = DEFAULT_FIGURES) -> Finding:
    return Finding(headline, "", figures.text(headline), why, NOT_MEASURED)


# ---------------------------------------------------------------- Pass@K and Pass@T (§9)


def check_pass_at_k(
    record: Mapping[str, Any], figures: PaperFigures = DEFAULT_FIGURES
) -> list[Finding]:
    """RL above base at every k: the lead at each k and, at the k where it is smallest, the
    CI of the paired per-task difference (the weakest point decides). The leads at k = 1 and
    at the largest k are recorded beside it (``effects``; they do not enter the verdict), so
    the same effects can be compared across seeds whichever k is the weakest. The paper's
    cell names the k this run measured (1..the fewest samples of a task), beside the paper's
    range."""
    base, out = record["policies"][0], []
    counts = {p: (np.asarray(v["n"]), np.asarray(v["c"])) for p, v in record["counts"].items()}
    ks = np.arange(1, int(min(n.min() for n, _ in counts.values())) + 1)
    per_task = {p: passk.pass_at_k_matrix(n, c, ks) for p, (n, c) in counts.items()}  # [tasks, K]
    for policy in record["policies"][1:]:
        lead = per_task[policy].mean(axis=0) - per_task[base].mean(axis=0)
        weakest = int(np.argmin(lead))
        ci = stats.paired_difference(per_task[policy][:, weakest], per_task[base][:, weakest])
        ahead = int((lead > 0).sum())
        curve = {p: per_task[p].mean(axis=0) for p in (base, policy)}
        observed = (
            f"pass@1 {curve[policy][0]:.3f} vs {base} {curve[base][0]:.3f}; "
            f"pass@{ks[-1]} {curve[policy][-1]:.3f} vs {curve[base][-1]:.3f}; ahead at "
            f"{ahead} of {ks.size} k; smallest lead at k = {ks[weakest]}: {_pt(ci)}"
        )
        effect = Effect("smallest lead over k", ci)
        ends = [
            Effect(
                f"lead at k = {ks[i]}",
                stats.paired_difference(per_task[policy][:, i], per_task[base][:, i]),
            )
            for i in sorted({0, ks.size - 1})
        ]
        out.append(
            Finding(
                PASS_AT_K,
                policy,
                f"{figures.text(PASS_AT_K)}; this run: k = {ks[0]}..{ks[-1]}",
                observed + _power(effect),
                _verdict(effect),
                {
                    "k": ks,
                    "lead": lead,
                    "weakest_k": int(ks[weakest]),
                    "weakest_lead": ci,
                    "effects": _effects_json(effect, *ends),
                },
            )
        )
    return out


def _level_differences(record, a: str, b: str) -> list[np.ndarray]:
    return [
        results.per_task_pass(record, a, t) - results.per_task_pass(record, b, t)
        for t in record["levels"]
    ]


def check_lead_grows(
    record: Mapping[str, Any], figures: PaperFigures = DEFAULT_FIGURES
) -> list[Finding]:
    """The lead over base at 100% minus the lead at 25% of T_max (per-task, paired), for the
    full-budget RL policies (all others if none is full-budget)."""
    base, others = record["policies"][0], record["policies"][1:]
    subjects = [p for p in others if not results.is_budgetmix(p)] or others
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
            f"lead at 100% minus lead at 25%: {_pt(growth)}"
        )
        effect = Effect("lead growth", growth)
        out.append(
            Finding(
                LEAD_GROWS,
                policy,
                figures.text(LEAD_GROWS),
                observed + _power(effect),
                _verdict(effect),
                {
                    "levels": record["levels"],
                    "lead": leads,
                    "growth": growth,
                    "effects": _effects_json(effect),
                },
            )
        )
    return out


def check_budgetmix_small(
    record: Mapping[str, Any], figures: PaperFigures = DEFAULT_FIGURES
) -> list[Finding]:
    """BudgetMix minus its full-budget counterpart at 25% and 50% of T_max (paired per task);
    75% and 100% are reported alongside."""
    pairs = results.budgetmix_counterparts(record["policies"])
    if not pairs:
        return [
            _absent(
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
        observed = "; ".join(f"{p}%: {_pt(d)}" for p, d in zip(record["percents"], deltas))
        out.append(
            Finding(
                BUDGETMIX_SMALL,
                f"{mix} vs {full}",
                figures.text(BUDGETMIX_SMALL),
                observed + _power(*effects),
                _verdict(*effects),
                {
                    "levels": record["levels"],
                    "difference": deltas,
                    "effects": _effects_json(*effects),
                },
            )
        )
    return out


# ---------------------------------------------------------------- error recovery (§7.1, §7.2)


def _comparison(pair: Mapping[str, Any], base: str, policy: str) -> stats.PairedComparison:
    return stats.paired_comparison(pair["quality"][policy], pair["quality"][base])


def check_error_recovery(
    steps: Mapping[str, Any], errors: Mapping[str, Any], figures: PaperFigures = DEFAULT_FIGURES
) -> list[Finding]:
    """Per policy: continuation success from error states above base's (paired per state), and
    RL better on a larger share of error states than of matched states."""
    base, out = errors["policies"][0], []
    for policy in errors["policies"][1:]:
        if policy not in steps["pairs"] or policy not in errors["pairs"]:
            continue
        matched = _comparison(steps["pairs"][policy], base, policy)
        pair = errors["pairs"][policy]
        at_errors = _comparison(pair, base, policy)
        success = {p: np.asarray(pair["success"][p], np.float64) for p in (base, policy)}
        gain = stats.paired_difference(success[policy].mean(axis=1), success[base].mean(axis=1))
        rates = {p: float(s.mean()) for p, s in success.items()}
        symbol = errors.get("quality_symbol", "Q*")
        observed = (
            f"better on {100 * matched.share_rl_better:.1f}% of matched states (mean "
            f"{symbol} diff {_num(matched.mean_diff)}) vs "
            f"{100 * at_errors.share_rl_better:.1f}% of error states "
            f"({_num(at_errors.mean_diff)}); continuation "
            f"{100 * rates[policy]:.1f}% vs {base} {100 * rates[base]:.1f}%: {_pt(gain)}"
        )
        advantage = _difference(at_errors.mean_diff, matched.mean_diff)
        effects = (
            Effect("continuation gain", gain, size=figures.error_recovery_gain),
            Effect("error-state minus matched-state quality gain", advantage, points=False),
        )
        observed += f"; error-state minus matched-state quality gain {_num(advantage)}"
        out.append(
            Finding(
                ERROR_RECOVERY,
                policy,
                figures.text(ERROR_RECOVERY),
                observed + _power(*effects),
                _verdict(*effects),
                {
                    "matched": matched,
                    "error_states": at_errors,
                    "continuation": rates,
                    "continuation_gain": gain,
                    "quality_gain_difference": advantage,
                    "effects": _effects_json(*effects),
                },
            )
        )
    return out


# ---------------------------------------------------------------- training dynamics (§7.5)


def _changes(entry: Mapping[str, Any]) -> dict[str, stats.MeanCI | None]:
    out = {}
    for key in ("R_multi", "R_single"):
        c = entry["change"].get(key)
        out[key] = (
            None if not c or c.get("change") is None else results.mean_ci_from_json(c["change"])
        )
    return out


def check_dynamics(
    record: Mapping[str, Any], figures: PaperFigures = DEFAULT_FIGURES
) -> list[Finding]:
    """Full-budget runs: R_multi up and R_single down; BudgetMix runs: R_single kept (its
    change >= 0, inconclusive if negative with a CI reaching 0)."""
    out, changes = [], {run: _changes(entry) for run, entry in record["runs"].items()}
    for run, change in changes.items():
        multi, single = change["R_multi"], change["R_single"]
        if results.is_budgetmix(run):
            if single is None:
                out.append(
                    _absent(BUDGETMIX_DYNAMICS, f"{run}: no R_single in its log", figures=figures)
                )
                continue
            full = record.get("counterparts", {}).get(run)
            versus = (
                f"; {full}: {_num(changes[full]['R_single'])}"
                if full and changes[full]["R_single"] is not None
                else ""
            )
            kept = Effect("R_single", single, margin=figures.r_single, points=False)
            out.append(
                Finding(
                    BUDGETMIX_DYNAMICS,
                    run,
                    figures.text(BUDGETMIX_DYNAMICS),
                    f"R_single {_num(single)}{versus}{_power(kept)}",
                    _verdict(kept),
                    {"R_single": single, "effects": _effects_json(kept)},
                )
            )
            continue
        if multi is None or single is None:
            out.append(
                _absent(
                    FULL_BUDGET_DYNAMICS,
                    f"{run}: R_multi and R_single need two logged values each",
                    figures=figures,
                )
            )
            continue
        effects = (
            Effect("R_multi", multi, size=figures.r_multi, points=False),
            Effect("R_single", single, direction=-1, size=figures.r_single, points=False),
        )
        out.append(
            Finding(
                FULL_BUDGET_DYNAMICS,
                run,
                figures.text(FULL_BUDGET_DYNAMICS),
                f"R_multi {_num(multi)}, R_single {_num(single)}{_power(*effects)}",
                _verdict(*effects),
                {"R_multi": multi, "R_single": single, "effects": _effects_json(*effects)},
            )
        )
    return out


# ---------------------------------------------------------------- open questions (instruments)


def check_hidden_budget(
    record: Mapping[str, Any], figures: PaperFigures = DEFAULT_FIGURES
) -> list[Finding]:
    """Per policy: Pass@k with the budget hidden minus shown exactly, at ``T_max`` (paired per
    task; the hypothesis' direction: down). No paper size: it never measured it."""
    from agentrl_jax.evaluation.analyses import presentation

    if "hidden" not in record["counts"]:
        return []
    counts, k, t_max = results.presentation_counts(record), int(record["k"]), max(record["budgets"])
    out = []
    for policy in record["policies"]:
        hidden = presentation.per_task(counts, "hidden", policy, t_max, k)
        exact = presentation.per_task(counts, "exact", policy, t_max, k)
        drop = stats.paired_difference(hidden, exact)
        effect = Effect(f"hidden - exact at T = {t_max}", drop, direction=-1)
        observed = (
            f"Pass@{k} at T = {t_max}: hidden {100 * hidden.mean():.1f}% vs exact "
            f"{100 * exact.mean():.1f}%: {_pt(drop)}"
        )
        out.append(
            Finding(
                HIDDEN_BUDGET,
                policy,
                figures.text(HIDDEN_BUDGET),
                observed + _power(effect),
                _verdict(effect),
                {"hidden_minus_exact": drop, "effects": _effects_json(effect)},
            )
        )
    return out


def check_splice(
    record: Mapping[str, Any], figures: PaperFigures = DEFAULT_FIGURES
) -> list[Finding]:
    """Per RL policy: the splice's continuation effect averaged over depths above 0 (the
    prefix effect reported beside it; :mod:`~agentrl_jax.evaluation.analyses.splice`)."""
    from agentrl_jax.evaluation.analyses import splice

    res = splice.compute(*results.splice_successes(record))
    out = []
    for policy, c in res.comparisons.items():
        effect = Effect("continuation effect", c.continuation_mean)
        observed = (
            f"continuation effect {_pt(c.continuation_mean)}, prefix effect "
            f"{_pt(c.prefix_mean)} (averaged over d = "
            f"{', '.join(f'{d:g}' for d in c.depths)}): the advantage lies {c.where}"
        )
        out.append(
            Finding(
                SPLICE_CONTINUATION,
                policy,
                figures.text(SPLICE_CONTINUATION),
                observed + _power(effect),
                _verdict(effect),
                {
                    "continuation": c.continuation_mean,
                    "prefix": c.prefix_mean,
                    "where": c.where,
                    "effects": _effects_json(effect),
                },
            )
        )
    return out


# ---------------------------------------------------------------- all of them


def check_findings(
    out: str | Path, analyses: Sequence[str] = ANALYSES, figures: PaperFigures | None = None
) -> list[Finding]:
    """Every headline, checked on the raw results of ``analyses`` saved under ``out``, against
    ``figures`` (default: the run's own, :meth:`PaperFigures.load`)."""
    figures = PaperFigures.load(out) if figures is None else figures
    raw = {a: results.load_raw(out, a) if a in analyses else None for a in ANALYSES}
    found: list[Finding] = []
    if raw["passk"] is not None and len(raw["passk"]["policies"]) > 1:
        found += check_pass_at_k(raw["passk"], figures)
    else:
        found.append(_absent(PASS_AT_K, "Pass@K of base and an RL policy not run", figures=figures))
    if raw["table"] is not None and len(raw["table"]["policies"]) > 1:
        found += check_lead_grows(raw["table"], figures) + check_budgetmix_small(
            raw["table"], figures
        )
    else:
        found += [
            _absent(LEAD_GROWS, "Pass@T of base and an RL policy not run", figures=figures),
            _absent(BUDGETMIX_SMALL, "Pass@T not run", figures=figures),
        ]
    recovery = (
        check_error_recovery(raw["steps"], raw["errors"], figures)
        if raw["steps"] is not None and raw["errors"] is not None
        else []
    )
    found += recovery or [
        _absent(
            ERROR_RECOVERY,
            "needs both the steps and errors analyses of the same policies",
            figures=figures,
        )
    ]
    dynamics = check_dynamics(raw["dynamics"], figures) if raw["dynamics"] is not None else []
    if not any(f.headline == FULL_BUDGET_DYNAMICS for f in dynamics):
        dynamics.append(
            _absent(FULL_BUDGET_DYNAMICS, "no full-budget run's training log", figures=figures)
        )
    if not any(f.headline == BUDGETMIX_DYNAMICS for f in dynamics):
        dynamics.append(
            _absent(BUDGETMIX_DYNAMICS, "no BudgetMix run's training log", figures=figures)
        )
    # the instruments' open questions, where their analyses ran (no "not measured" rows: a
    # run without them answers nothing the paper claimed)
    if raw["presentation"] is not None:
        dynamics += check_hidden_budget(raw["presentation"], figures)
    if raw["splice"] is not None:
        dynamics += check_splice(raw["splice"], figures)
    return found + dynamics


# The report section each headline is checked on (a title prefix; a section naming the finding's
# subject is preferred), so each verdict links to the numbers behind it.
SOURCES = {
    PASS_AT_K: "Pass@K",
    LEAD_GROWS: "Table 1",
    BUDGETMIX_SMALL: "Table 1",
    ERROR_RECOVERY: "Continuation success from error states",
    FULL_BUDGET_DYNAMICS: "Training dynamics",
    BUDGETMIX_DYNAMICS: "Training dynamics",
    HIDDEN_BUDGET: "Budget presentation",
    SPLICE_CONTINUATION: "Splice",
}


def source_anchor(finding: Finding, titles: Sequence[str]) -> str | None:
    """The anchor (:func:`~agentrl_jax.evaluation.html.anchor`) of the section among ``titles``
    a finding was checked on, None if the report has none."""
    from agentrl_jax.evaluation.html import anchor

    prefix = SOURCES.get(finding.headline)
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
