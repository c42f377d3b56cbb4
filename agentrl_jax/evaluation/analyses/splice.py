"""The splice analysis: where RL's advantage lies, tested by intervention.

The paper argues (§7.4, §9) that RL "composes locally reasonable actions into long
trajectories more reliably", from correlational evidence. Here the base policy ``b`` and an
RL policy ``R`` hand their episodes to each other at normalised depth ``d`` (the turn
``k = round(d T_max)``, :func:`~agentrl_jax.evaluation.drivers.switch_turn`): ``b>R`` plays
b's first ``k`` turns, then R continues with the whole history
(:class:`~agentrl_jax.evaluation.splicing.SplicedPolicy`). With ``S_X`` the success of X alone
and ``S_{X>Y}(d)`` of the splice, per task ``i`` (the mean over its samples):

* continuation effect at d: ``[(S_{b>R} - S_b) + (S_R - S_{R>b})] / 2``: R rather than b
  finishing, from b's prefixes and from R's (each pair from matched prefixes);
* prefix effect at d: ``[(S_{R>b} - S_b) + (S_R - S_{b>R})] / 2``: R's rather than b's first
  k turns, with b finishing and with R finishing.

At every depth the two add up to ``S_R - S_b``, the whole advantage. Averaged over the
depths, each gets a 95% CI over tasks (normal, paired): the advantage lies *in the
continuation* when only the continuation effect's CI is above 0, *in the prefix* when only
the prefix effect's is, *in both* or *in neither* (:func:`where`).

``compute`` -> :class:`Splice`; :func:`section` writes ``splice.json``, ``splice.csv``, the
figure (success against d for the four ways of playing, per RL policy) and the section.

The ``splice`` analysis (:data:`ANALYSIS`, pairwise): the base and each other policy handing
episodes to each other at ``eval.splice_depths``, on the first ``eval.splice_tasks`` tasks; it
checks the open question "RL's advantage lies in how it continues".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from agentrl_jax.evaluation import drivers, raw, stats
from agentrl_jax.evaluation.analyses.context import AnalysisRun, with_
from agentrl_jax.evaluation.analyses.registry import Analysis, register
from agentrl_jax.evaluation.figures import legend_below, new_figure, save_figure
from agentrl_jax.evaluation.report import Section, figure_path, rel, write_csv, write_json
from agentrl_jax.evaluation.result import Result, result
from agentrl_jax.evaluation.verdicts import (
    DEFAULT_FIGURES,
    SPLICE_CONTINUATION,
    Effect,
    Finding,
    PaperFigures,
    effects_json,
    power,
    pt,
    verdict,
)

SPLICE_JSON, SPLICE_CSV = "splice.json", "splice.csv"
IN_CONTINUATION, IN_PREFIX, IN_BOTH, IN_NEITHER = (
    "in the continuation",
    "in the prefix",
    "in both",
    "in neither",
)


def pair_label(first: str, then: str) -> str:
    """The key of a splice: ``first``'s prefix, ``then``'s continuation."""
    return f"{first}>{then}"


@result
class SpliceComparison(Result):
    """One RL policy against the base: success rates per depth ``[D]`` (means over tasks) of
    ``b>R`` and ``R>b``, the policies alone, and the effects (module docstring): per depth and
    averaged over the depths, each with its CI."""

    depths: np.ndarray  # [D]
    turns: np.ndarray  # [D] the switch turn of each depth
    base_alone: stats.MeanCI
    rl_alone: stats.MeanCI
    base_then_rl: list[stats.MeanCI]  # [D]
    rl_then_base: list[stats.MeanCI]  # [D]
    continuation: list[stats.MeanCI]  # [D]
    prefix: list[stats.MeanCI]  # [D]
    continuation_mean: stats.MeanCI
    prefix_mean: stats.MeanCI
    where: str


@result
class Splice(Result):
    """``comparisons[RL policy]`` against ``base``; ``tasks`` x ``samples`` episodes each."""

    base: str
    t_max: int
    tasks: int
    samples: int
    comparisons: dict[str, SpliceComparison]


def effects(
    base: np.ndarray, rl: np.ndarray, base_then_rl: np.ndarray, rl_then_base: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``(continuation, prefix)`` per task (module docstring) from per-task success rates:
    ``base``, ``rl`` ``[tasks]`` alone, ``base_then_rl``, ``rl_then_base`` ``[tasks]`` spliced
    at one depth. Their sum is ``rl - base``."""
    continuation = ((base_then_rl - base) + (rl - rl_then_base)) / 2.0
    prefix = ((rl_then_base - base) + (rl - base_then_rl)) / 2.0
    return continuation, prefix


def where(continuation: stats.MeanCI, prefix: stats.MeanCI) -> str:
    """Where the advantage lies, by which effects' CIs lie above 0."""
    above = [bool(np.isfinite(ci.low) and ci.low > 0) for ci in (continuation, prefix)]
    return {
        (True, False): IN_CONTINUATION,
        (False, True): IN_PREFIX,
        (True, True): IN_BOTH,
    }.get(tuple(above), IN_NEITHER)


def compare(
    base: np.ndarray,
    rl: np.ndarray,
    base_then_rl: Mapping[float, np.ndarray],
    rl_then_base: Mapping[float, np.ndarray],
    turns: Sequence[int],
) -> SpliceComparison:
    """One RL policy against the base from ``bool[tasks, samples]`` successes (``alone`` and
    the splices ``{depth: ...}``) at the switch ``turns`` of the depths."""
    rate = lambda x: np.asarray(x, np.float64).mean(axis=1)  # noqa: E731  per task
    depths = sorted(base_then_rl)
    b, r = rate(base), rate(rl)
    br = [rate(base_then_rl[d]) for d in depths]
    rb = [rate(rl_then_base[d]) for d in depths]
    per_depth = [effects(b, r, x, y) for x, y in zip(br, rb)]
    continuation = np.mean([c for c, _ in per_depth], axis=0)
    prefix = np.mean([p for _, p in per_depth], axis=0)
    cont_ci, prefix_ci = stats.mean_ci_normal(continuation), stats.mean_ci_normal(prefix)
    return SpliceComparison(
        depths=np.asarray(depths, np.float64),
        turns=np.asarray(turns, np.int64),
        base_alone=stats.mean_ci_normal(b),
        rl_alone=stats.mean_ci_normal(r),
        base_then_rl=[stats.mean_ci_normal(x) for x in br],
        rl_then_base=[stats.mean_ci_normal(y) for y in rb],
        continuation=[stats.mean_ci_normal(c) for c, _ in per_depth],
        prefix=[stats.mean_ci_normal(p) for _, p in per_depth],
        continuation_mean=cont_ci,
        prefix_mean=prefix_ci,
        where=where(cont_ci, prefix_ci),
    )


def compute(
    alone: Mapping[str, np.ndarray],
    spliced: Mapping[str, Mapping[float, np.ndarray]],
    base: str,
    t_max: int,
    turns: Sequence[int],
) -> Splice:
    """Every RL policy of ``alone`` (all but ``base``) against ``base``; ``spliced`` holds
    ``pair_label(base, R)`` and ``pair_label(R, base)`` for each."""
    shape = np.asarray(alone[base]).shape
    comparisons = {
        policy: compare(
            alone[base],
            alone[policy],
            spliced[pair_label(base, policy)],
            spliced[pair_label(policy, base)],
            turns,
        )
        for policy in alone
        if policy != base
    }
    return Splice(base, int(t_max), int(shape[0]), int(shape[1]), comparisons)


def _pt(ci: stats.MeanCI, sign: bool = True) -> str:
    fmt = "+.1f" if sign else ".1f"
    if not np.isfinite(ci.low):
        return f"{100 * ci.mean:{fmt}}"
    return f"{100 * ci.mean:{fmt}} [{100 * ci.low:{fmt}}, {100 * ci.high:{fmt}}]"


def markdown(res: Splice) -> str:
    """Per RL policy and depth: success of the four ways of playing, and the two effects."""
    b = res.base.replace("|", "\\|")
    lines = []
    for policy, c in res.comparisons.items():
        r = policy.replace("|", "\\|")
        lines += [
            f"**{r}** (alone {_pt(c.rl_alone, False)}%, {b} alone {_pt(c.base_alone, False)}%): "
            f"the advantage lies **{c.where}** (continuation effect "
            f"{_pt(c.continuation_mean)} pt, prefix effect {_pt(c.prefix_mean)} pt, averaged "
            "over the depths).",
            "",
            f"| d (turn) | {b} then {r} (%) | {r} then {b} (%) | continuation effect (pt) | "
            "prefix effect (pt) |",
            "|---|---|---|---|---|",
        ]
        for i, (d, t) in enumerate(zip(c.depths, c.turns)):
            lines.append(
                f"| {d:g} ({int(t)}) | {_pt(c.base_then_rl[i], False)} | "
                f"{_pt(c.rl_then_base[i], False)} | {_pt(c.continuation[i])} | "
                f"{_pt(c.prefix[i])} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(res: Splice, out_path: str | Path) -> tuple[Path, Path]:
    """Success against d per RL policy (a panel each, two to a row): the two splices, the
    policies alone (flat); one legend below the panels, its series named by the panel's
    policy where there are several."""
    n = max(1, len(res.comparisons))
    fig, axes = new_figure(ncols=min(n, 2), nrows=(n + 1) // 2)
    panels = list(axes.flat)
    rl = next(iter(res.comparisons)) if n == 1 else "the panel's RL policy"
    for ax, (policy, c) in zip(panels, res.comparisons.items()):
        for series, label in (
            (c.base_then_rl, f"{res.base} then {rl}"),
            (c.rl_then_base, f"{rl} then {res.base}"),
        ):
            mean = np.array([s.mean for s in series])
            low = np.array([s.low for s in series])
            high = np.array([s.high for s in series])
            ax.plot(c.depths, mean, marker="o", label=label)
            ax.fill_between(c.depths, low, high, alpha=0.15)
        for alone, label, style in ((c.base_alone, res.base, ":"), (c.rl_alone, rl, "--")):
            ax.axhline(alone.mean, linestyle=style, color="grey", label=f"{label} alone")
        ax.set_xlabel("hand-over depth d (turn round(d T_max))")
        ax.set_ylabel(f"success at T = {res.t_max}")
        ax.set_title(policy, fontsize=10)
    for ax in panels[len(res.comparisons) :]:
        ax.remove()
    if res.comparisons:
        legend_below(fig, panels[0], ncols=2 if n > 1 else 1)
    return save_figure(fig, out_path)


def section(folder: str | Path, res: Splice) -> Section:
    """``splice.json``, ``splice.csv``, the figure and the section."""
    folder = Path(folder)
    path = write_json(folder / SPLICE_JSON, res)
    rows: dict[str, list] = {
        k: [] for k in ("policy", "depth", "turn", "base_then_rl", "rl_then_base", "continuation")
    }
    rows["prefix"] = []
    for policy, c in res.comparisons.items():
        for i, (d, t) in enumerate(zip(c.depths, c.turns)):
            rows["policy"].append(policy)
            rows["depth"].append(float(d))
            rows["turn"].append(int(t))
            rows["base_then_rl"].append(c.base_then_rl[i].mean)
            rows["rl_then_base"].append(c.rl_then_base[i].mean)
            rows["continuation"].append(c.continuation[i].mean)
            rows["prefix"].append(c.prefix[i].mean)
    csv = write_csv(folder / SPLICE_CSV, rows)
    png, _ = plot(res, figure_path(folder, "splice"))
    text = (
        f"Each RL policy and {res.base} hand their episodes to each other at turn "
        f"round(d T_max) of T_max = {res.t_max}: the second policy continues with the whole "
        f"conversation so far. {res.tasks} tasks x {res.samples} episodes per way of playing, "
        "all with the same key, so a splice's prefix is the one its first policy plays alone "
        "(matched prefixes). Continuation effect: the RL policy rather than the base finishing "
        "(from the base's prefixes and from the RL policy's, averaged); prefix effect: the RL "
        "policy's rather than the base's first turns (with either finishing); the two add up "
        "to the whole advantage at every depth. 95% CIs over tasks (normal, paired). The "
        "advantage lies where an effect's interval is above 0."
    )
    return Section(
        "Splice: where the RL advantage lies",
        text,
        files=(rel(folder, path), rel(folder, csv)),
        figures=(rel(folder, png),),
        markdown=markdown(res),
    )


# ---------------------------------------------------------------- the splice analysis


def check_splice(
    record: Mapping[str, Any], figures: PaperFigures = DEFAULT_FIGURES
) -> list[Finding]:
    """Per RL policy: the splice's continuation effect averaged over depths above 0 (the
    prefix effect reported beside it; :mod:`~agentrl_jax.evaluation.analyses.splice`)."""
    res = compute(*raw.splice_successes(record))
    out = []
    for policy, c in res.comparisons.items():
        effect = Effect("continuation effect", c.continuation_mean)
        observed = (
            f"continuation effect {pt(c.continuation_mean)}, prefix effect "
            f"{pt(c.prefix_mean)} (averaged over d = "
            f"{', '.join(f'{d:g}' for d in c.depths)}): the advantage lies {c.where}"
        )
        out.append(
            Finding(
                SPLICE_CONTINUATION,
                policy,
                figures.text(SPLICE_CONTINUATION),
                observed + power(effect),
                verdict(effect),
                {
                    "continuation": c.continuation_mean,
                    "prefix": c.prefix_mean,
                    "where": c.where,
                    "effects": effects_json(effect),
                },
            )
        )
    return out


class SpliceAnalysis(Analysis):
    """The base and each other policy handing episodes to each other part-way."""

    name = "splice"
    unit_seconds = 1.8e-3  # fit on the stored default run (reproduce.progress)
    pairwise = True
    findings_rank = 5  # an open question, after the paper's headlines
    sources = {SPLICE_CONTINUATION: "Splice"}

    def tasks(self, settings: Any, task_ids: Sequence[int]) -> Sequence[int]:
        count = settings.splice_tasks
        return task_ids if count is None else task_ids[:count]

    def units(self, settings: Any, num_tasks: int, policies: int, t_max: int) -> int:
        plays = policies + (policies - 1) * 2 * len(settings.splice_depths)
        return plays * drivers.rollout_units(num_tasks, settings.splice_samples, t_max)

    def run(self, run: AnalysisRun) -> list[Section]:
        s = run.settings
        pairs = [
            (a, b) for other in run.names[1:] for a, b in ((run.base, other), (other, run.base))
        ]
        alone, spliced = drivers.splice_successes(
            run.play,
            run.policies,
            run.key("splice"),
            pairs=pairs,
            depths=s.splice_depths,
            samples=s.splice_samples,
        )
        turns = [drivers.switch_turn(d, run.t_max) for d in s.splice_depths]
        raw_file = run.write_raw(
            "splice",
            {
                "samples": s.splice_samples,
                "depths": s.splice_depths,
                "turns": turns,
                "alone": alone,
                "spliced": {
                    label: {str(d): x for d, x in by_depth.items()}
                    for label, by_depth in spliced.items()
                },
            },
        )
        result = compute(*raw.splice_successes(raw.load_raw(run.out, "splice")))
        return [with_(section(run.out, result), files=(raw_file,))]

    def findings(self, records: Mapping[str, Any], paper: PaperFigures) -> list[Finding]:
        record = records.get("splice")
        return [] if record is None else check_splice(record, paper)


ANALYSIS = register(SpliceAnalysis())
