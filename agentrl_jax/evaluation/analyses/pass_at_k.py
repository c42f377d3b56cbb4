"""Pass@K at the full budget (PAPER.md §3, Figure 2): the unbiased pass@k of each policy for
k = 1..K, from per-task counts ``n`` (samples) and ``c`` (successes).

``compute`` -> :class:`PassAtK`; :func:`plot_pass_at_k` draws it; :func:`section` writes
``<name>.json``, ``<name>.csv`` and the figure and returns the report section.

The ``passk`` analysis (:data:`ANALYSIS`): the Pass@K curve, k = 1..``eval.pass_k_samples``,
at ``T_max``; it checks the paper's "RL beats base at every k".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from agentrl_jax.evaluation import drivers, figures, passk, stats
from agentrl_jax.evaluation.analyses.context import AnalysisRun, with_
from agentrl_jax.evaluation.analyses.registry import Analysis, register
from agentrl_jax.evaluation.report import Section, figure_path, rel, write_csv, write_json
from agentrl_jax.evaluation.result import Result, result
from agentrl_jax.evaluation.verdicts import (
    DEFAULT_FIGURES,
    PASS_AT_K,
    Effect,
    Finding,
    PaperFigures,
    absent,
    effects_json,
    power,
    pt,
    verdict,
)


@result
class Curve(Result):
    """One policy's Pass@K curve: ``k [K]`` int, ``pass_at_k [K]`` float64."""

    k: np.ndarray
    pass_at_k: np.ndarray


@result
class PassAtK(Result):
    """``curves``: ``{policy: Curve}``; ``k_dropped_for_too_few_samples``: ``{policy: ks}``
    above the policy's smallest ``n`` (pass@k is undefined there)."""

    curves: dict[str, Curve]
    k_dropped_for_too_few_samples: dict[str, tuple[int, ...]]


def compute(
    counts_by_policy: Mapping[str, tuple[Any, Any]], ks: Sequence[int] = passk.PASS_AT_K_RANGE
) -> PassAtK:
    """Pass@K curves of ``{policy: (n [tasks], c [tasks])}``; ``ks`` above a policy's smallest
    ``n`` are dropped for that policy (``ValueError`` when that leaves none)."""
    curves, dropped = {}, {}
    for policy, (n, c) in counts_by_policy.items():
        n_min = int(np.min(n))
        usable = [k for k in ks if k <= n_min]
        if not usable:
            raise ValueError(
                f"pass_at_k: policy {policy!r} has n={n_min} samples, fewer than every k"
            )
        dropped[policy] = tuple(k for k in ks if k > n_min)
        curves[policy] = Curve(np.asarray(usable), passk.pass_at_k_curve(n, c, usable))
    return PassAtK(curves, dropped)


def plot_pass_at_k(
    curves: Mapping[str, tuple[Sequence[int], Sequence[float]]],
    out_path: str | Path,
    *,
    bands: Mapping[str, tuple[Sequence[float], Sequence[float]]] | None = None,
    title: str = "Pass@K at full budget",
) -> tuple[Path, Path]:
    """Pass@K curves, one per policy (Figure 2 style), the legend beside the axes.

    Args:
      curves: ``{policy: (ks [K], pass@k [K])}``.
      bands: optional ``{policy: (low [K], high [K])}`` shaded around the curve.
    """
    figures.nonempty("plot_pass_at_k", curves)
    fig, axes = figures.new_figure(width=5.0 + figures.legend_width(curves))
    ax = axes[0, 0]
    for name, pair in curves.items():
        ks, values = figures.xy(name, pair)
        (line,) = ax.plot(ks, values, marker="o", markersize=3, label=name)
        if bands and name in bands:
            low, high = (np.asarray(a, dtype=np.float64) for a in bands[name])
            ax.fill_between(ks, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="k (attempts)", ylabel="Pass@k", title=title, ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    figures.legend_outside(ax)
    return figures.save_figure(fig, out_path)


def k_range(res: PassAtK) -> str:
    """The k the curves plot: ``"1..32"`` (each policy's range where they differ, ``"base
    1..32, RL 1..16"``: a policy with fewer samples stops earlier)."""
    spans = {p: f"{int(c.k[0])}..{int(c.k[-1])}" for p, c in res.curves.items()}
    if len(set(spans.values())) == 1:
        return next(iter(spans.values()))
    return ", ".join(f"{p} {span}" for p, span in spans.items())


def section(folder: str | Path, res: PassAtK, name: str = "pass_at_k") -> Section:
    """Write ``<name>.json`` (the result), ``<name>.csv`` (one column per policy, empty where a
    k was dropped) and the figure; the section "Pass@K (full budget)"."""
    folder = Path(folder)
    json_path = write_json(folder / f"{name}.json", res)
    all_k = sorted({int(k) for c in res.curves.values() for k in c.k})
    columns: dict[str, list] = {"k": all_k}
    for policy, curve in res.curves.items():
        lookup = dict(zip(curve.k.tolist(), curve.pass_at_k.tolist()))
        columns[policy] = [lookup.get(k) for k in all_k]
    csv_path = write_csv(folder / f"{name}.csv", columns)
    png, _ = plot_pass_at_k(
        {p: (c.k, c.pass_at_k) for p, c in res.curves.items()}, figure_path(folder, name)
    )
    summary = f"k = {k_range(res)}. " + ", ".join(
        f"{p}: pass@{int(c.k[0])} {c.pass_at_k[0]:.3f}, pass@{int(c.k[-1])} {c.pass_at_k[-1]:.3f}"
        for p, c in res.curves.items()
    )
    return Section(
        "Pass@K (full budget)",
        summary,
        (rel(folder, png),),
        (rel(folder, json_path), rel(folder, csv_path)),
    )


# ---------------------------------------------------------------- the passk analysis


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
            f"{ahead} of {ks.size} k; smallest lead at k = {ks[weakest]}: {pt(ci)}"
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
                observed + power(effect),
                verdict(effect),
                {
                    "k": ks,
                    "lead": lead,
                    "weakest_k": int(ks[weakest]),
                    "weakest_lead": ci,
                    "effects": effects_json(effect, *ends),
                },
            )
        )
    return out


class PassK(Analysis):
    """The Pass@K curve at the full budget."""

    name = "passk"
    unit_seconds = 1.0e-3  # fit on the stored default run (reproduce.progress)
    findings_rank = 0  # the paper's first headline
    sources = {PASS_AT_K: "Pass@K"}

    def units(self, settings: Any, num_tasks: int, policies: int, t_max: int) -> int:
        return policies * drivers.rollout_units(num_tasks, settings.pass_k_samples, t_max)

    def run(self, run: AnalysisRun) -> list[Section]:
        s = run.settings
        counts = drivers.pass_at_k_counts(
            run.play, run.policies, run.key("passk"), samples=s.pass_k_samples
        )
        raw_file = run.write_raw(
            "passk",
            {
                "samples": s.pass_k_samples,
                "counts": {p: {"n": n, "c": c} for p, (n, c) in counts.items()},
            },
        )
        res = compute(counts, ks=range(1, s.pass_k_samples + 1))
        return [
            with_(
                section(run.out, res),
                f"Pass@K at T_max = {run.t_max}",
                f"{len(run.task_ids)} tasks x {s.pass_k_samples} samples per policy.",
                (raw_file,),
            )
        ]

    def findings(self, records: Mapping[str, Any], paper: PaperFigures) -> list[Finding]:
        record = records.get("passk")
        if record is not None and len(record["policies"]) > 1:
            return check_pass_at_k(record, paper)
        return [absent(PASS_AT_K, "Pass@K of base and an RL policy not run", figures=paper)]


ANALYSIS = register(PassK())
