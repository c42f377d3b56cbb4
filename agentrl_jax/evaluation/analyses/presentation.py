"""Budget presentation robustness: each policy's Pass@k when the budget is shown exactly,
hidden, or approximately (an open question of the paper, whose prompts always state it, §6).

The same tasks are played under every presentation with the same key, so per-task differences
are paired: ``pass_i(mode, T) - pass_i(exact, T)`` over tasks ``i``, a normal 95% CI
(:func:`~agentrl_jax.evaluation.stats.paired_difference`). A policy trained under one
presentation and evaluated under another is the *mismatch* (e.g. every exact-trained policy
under ``hidden``); a policy trained with the presentation randomised per group
(``budgetmix-presentation``) should lose least.

``compute`` -> :class:`PresentationRobustness`; :func:`section` writes ``presentation.json``,
``presentation.csv``, the figure (Pass@k per presentation and policy at each budget) and the
report section.

The ``presentation`` analysis (:data:`ANALYSIS`): Pass@(k, T) at 50% and 100% of ``T_max``
with the budget shown exactly, hidden and approximately, on the first
``eval.presentation_tasks`` tasks; it checks the open question "hiding the budget costs the
policy".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from agentrl_jax.evaluation import drivers, passk, raw, stats
from agentrl_jax.evaluation.analyses.context import AnalysisRun, with_
from agentrl_jax.evaluation.analyses.registry import Analysis, register
from agentrl_jax.evaluation.figures import legend_below, new_figure, save_figure
from agentrl_jax.evaluation.report import Section, figure_path, rel, write_csv, write_json
from agentrl_jax.evaluation.result import Result, result
from agentrl_jax.evaluation.verdicts import (
    DEFAULT_FIGURES,
    HIDDEN_BUDGET,
    Effect,
    Finding,
    PaperFigures,
    effects_json,
    power,
    pt,
    verdict,
)

PRESENTATION_JSON, PRESENTATION_CSV = "presentation.json", "presentation.csv"
REFERENCE = "exact"

Counts = Mapping[str, Mapping[str, Mapping[int, tuple[np.ndarray, np.ndarray]]]]
"""``{presentation: {policy: {T: (n [tasks], c [tasks])}}}``."""


@result
class PresentationRobustness(Result):
    """``rates[mode][policy][T]``: Pass@k over tasks with its CI; ``drops[mode][policy][T]``:
    the paired per-task difference ``mode - exact`` (absent for ``exact`` itself)."""

    k: int
    modes: tuple[str, ...]
    budgets: tuple[int, ...]
    policies: tuple[str, ...]
    rates: dict[str, dict[str, dict[int, stats.MeanCI]]]
    drops: dict[str, dict[str, dict[int, stats.MeanCI]]]


def per_task(counts: Counts, mode: str, policy: str, budget: int, k: int) -> np.ndarray:
    """``[tasks]`` pass@k of ``policy`` under ``mode`` at ``budget``."""
    n, c = counts[mode][policy][budget]
    return passk.pass_at_k(np.asarray(n), np.asarray(c), k)


def compute(counts: Counts, k: int) -> PresentationRobustness:
    """Every policy's Pass@k under every presentation of ``counts`` (which must hold
    ``exact``, the reference) and its paired difference from ``exact``."""
    if REFERENCE not in counts:
        raise ValueError(f"presentation.compute: needs the {REFERENCE!r} presentation")
    modes = tuple(counts)
    policies = tuple(counts[REFERENCE])
    budgets = tuple(sorted({int(b) for b in counts[REFERENCE][policies[0]]}))
    rates: dict = {}
    drops: dict = {}
    for mode in modes:
        rates[mode], drops[mode] = {}, {}
        for policy in policies:
            rates[mode][policy], drops[mode][policy] = {}, {}
            for budget in budgets:
                values = per_task(counts, mode, policy, budget, k)
                rates[mode][policy][budget] = stats.mean_ci_normal(values)
                if mode != REFERENCE:
                    exact = per_task(counts, REFERENCE, policy, budget, k)
                    drops[mode][policy][budget] = stats.paired_difference(values, exact)
    return PresentationRobustness(int(k), modes, budgets, policies, rates, drops)


def _pt(ci: stats.MeanCI, sign: bool = False) -> str:
    fmt = "+.1f" if sign else ".1f"
    if not np.isfinite(ci.low):
        return f"{100 * ci.mean:{fmt}}"
    return f"{100 * ci.mean:{fmt}} [{100 * ci.low:{fmt}}, {100 * ci.high:{fmt}}]"


def markdown(res: PresentationRobustness, trained: Mapping[str, str] | None = None) -> str:
    """One row per policy and budget: Pass@k under each presentation, then each
    presentation's difference from exact (points, 95% CI). ``trained``: ``{policy: the
    presentation it was trained under}``, shown beside its name."""
    trained = dict(trained or {})
    others = [m for m in res.modes if m != REFERENCE]
    head = (
        ["policy (trained under)" if trained else "policy", "T"]
        + [f"{m} (%)" for m in res.modes]
        + [f"{m} - exact (pt)" for m in others]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for policy in res.policies:
        name = policy.replace("|", "\\|") + (f" ({trained[policy]})" if policy in trained else "")
        for budget in res.budgets:
            cells = [name, str(budget)]
            cells += [_pt(res.rates[m][policy][budget]) for m in res.modes]
            cells += [_pt(res.drops[m][policy][budget], sign=True) for m in others]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(res: PresentationRobustness, out_path: str | Path) -> tuple[Path, Path]:
    """Pass@k per policy (groups) and presentation (bars) at each budget (panels), with CIs;
    one legend (the presentations) below the panels."""
    fig, axes = new_figure(ncols=len(res.budgets), width=max(4.0, 1.3 * len(res.policies)))
    width = 0.8 / len(res.modes)
    x = np.arange(len(res.policies))
    for ax, budget in zip(axes[0], res.budgets):
        for i, mode in enumerate(res.modes):
            cis = [res.rates[mode][p][budget] for p in res.policies]
            mean = np.array([c.mean for c in cis])
            err = np.array(
                [[c.mean - c.low, c.high - c.mean] if np.isfinite(c.low) else [0, 0] for c in cis]
            ).T
            ax.bar(x + (i - (len(res.modes) - 1) / 2) * width, mean, width, yerr=err, label=mode)
        ax.set_xticks(x, res.policies, rotation=20, ha="right", fontsize=7)
        ax.set_title(f"T = {budget}")
        ax.set_ylabel(f"Pass@{res.k}")
        ax.set_ylim(0, 1)
    legend_below(fig, axes[0][0], ncols=len(res.modes), title="budget shown")
    return save_figure(fig, out_path)


def section(
    folder: str | Path,
    res: PresentationRobustness,
    *,
    tasks: int,
    samples: int,
    noise: float,
    trained: Mapping[str, str] | None = None,
) -> Section:
    """``presentation.json``, ``presentation.csv``, the figure and the section."""
    folder = Path(folder)
    path = write_json(folder / PRESENTATION_JSON, res)
    rows: dict[str, list] = {"policy": [], "presentation": [], "budget": [], "pass_at_k": []}
    rows.update({"low": [], "high": [], "minus_exact": [], "minus_low": [], "minus_high": []})
    for mode in res.modes:
        for policy in res.policies:
            for budget in res.budgets:
                rate, drop = res.rates[mode][policy][budget], res.drops[mode][policy].get(budget)
                rows["policy"].append(policy)
                rows["presentation"].append(mode)
                rows["budget"].append(budget)
                rows["pass_at_k"].append(rate.mean)
                rows["low"].append(rate.low)
                rows["high"].append(rate.high)
                rows["minus_exact"].append(drop.mean if drop else 0.0)
                rows["minus_low"].append(drop.low if drop else 0.0)
                rows["minus_high"].append(drop.high if drop else 0.0)
    csv = write_csv(folder / PRESENTATION_CSV, rows)
    png, _ = plot(res, figure_path(folder, "presentation"))
    text = (
        f"Pass@{res.k} of every policy with the budget shown exactly (the paper's prompt), "
        f"hidden (no budget line, no budget in the system prompt) and approximately (the "
        f"budget shown as round(B (1 + e)), e uniform in [-{noise:g}, {noise:g}] per task "
        f"group, the turns left counted from it); the episode ends after B turns whatever is "
        f"shown. {tasks} tasks x {samples} samples per presentation and budget, the same key "
        f"for every presentation, so differences are paired per task (normal 95% CIs). A "
        f"policy evaluated under a presentation it was not trained under is the mismatch."
    )
    return Section(
        "Budget presentation",
        text,
        files=(rel(folder, path), rel(folder, csv)),
        figures=(rel(folder, png),),
        markdown=markdown(res, trained),
    )


# ---------------------------------------------------------------- the presentation analysis


def presentation_budgets(t_max: int) -> tuple[int, ...]:
    """The budgets the presentation analysis plays: 50% and 100% of ``T_max``."""
    levels = passk.budget_levels(t_max)
    return tuple(sorted({levels[1], levels[-1]}))


def check_hidden_budget(
    record: Mapping[str, Any], figures: PaperFigures = DEFAULT_FIGURES
) -> list[Finding]:
    """Per policy: Pass@k with the budget hidden minus shown exactly, at ``T_max`` (paired per
    task; the hypothesis' direction: down). No paper size: it never measured it."""
    if "hidden" not in record["counts"]:
        return []
    counts, k, t_max = raw.presentation_counts(record), int(record["k"]), max(record["budgets"])
    out = []
    for policy in record["policies"]:
        hidden = per_task(counts, "hidden", policy, t_max, k)
        exact = per_task(counts, "exact", policy, t_max, k)
        drop = stats.paired_difference(hidden, exact)
        effect = Effect(f"hidden - exact at T = {t_max}", drop, direction=-1)
        observed = (
            f"Pass@{k} at T = {t_max}: hidden {100 * hidden.mean():.1f}% vs exact "
            f"{100 * exact.mean():.1f}%: {pt(drop)}"
        )
        out.append(
            Finding(
                HIDDEN_BUDGET,
                policy,
                figures.text(HIDDEN_BUDGET),
                observed + power(effect),
                verdict(effect),
                {"hidden_minus_exact": drop, "effects": effects_json(effect)},
            )
        )
    return out


class Presentation(Analysis):
    """Pass@(k, T) with the budget shown exactly, hidden and approximately."""

    name = "presentation"
    unit_seconds = 0.5e-3  # fit on the stored default run (reproduce.progress)
    findings_rank = 4  # an open question, after the paper's headlines
    sources = {HIDDEN_BUDGET: "Budget presentation"}

    def tasks(self, settings: Any, task_ids: Sequence[int]) -> Sequence[int]:
        count = settings.presentation_tasks
        return task_ids if count is None else task_ids[:count]

    def units(self, settings: Any, num_tasks: int, policies: int, t_max: int) -> int:
        return (
            policies
            * len(settings.presentations)
            * sum(
                drivers.rollout_units(num_tasks, settings.samples, b)
                for b in presentation_budgets(t_max)
            )
        )

    def run(self, run: AnalysisRun) -> list[Section]:
        s = run.settings
        budgets = presentation_budgets(run.t_max)
        counts = drivers.presentation_counts(
            run.play,
            run.policies,
            run.key("presentation"),
            presentations=s.presentations,
            noise=s.presentation_noise,
            budgets=budgets,
            samples=s.samples,
        )
        raw_file = run.write_raw(
            "presentation",
            {
                "k": s.k,
                "samples": s.samples,
                "budgets": budgets,
                "noise": s.presentation_noise,
                "counts": {
                    mode: {
                        p: {b: {"n": n, "c": c} for b, (n, c) in by_budget.items()}
                        for p, by_budget in by_policy.items()
                    }
                    for mode, by_policy in counts.items()
                },
            },
        )
        result = compute(raw.presentation_counts(raw.load_raw(run.out, "presentation")), s.k)
        written = section(
            run.out, result, tasks=len(run.task_ids), samples=s.samples, noise=s.presentation_noise
        )
        return [with_(written, files=(raw_file,))]

    def findings(self, records: Mapping[str, Any], paper: PaperFigures) -> list[Finding]:
        record = records.get("presentation")
        return [] if record is None else check_hidden_budget(record, paper)


ANALYSIS = register(Presentation())
