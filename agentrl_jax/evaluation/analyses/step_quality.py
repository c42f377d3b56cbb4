"""Step-level action quality, RL vs base on the same states (PAPER.md §7.1 matched states,
§7.2 error states; Figures 3-4): per state, each policy's mean quality (Q*) over its G sampled
actions; per pool of states, the share of states where RL is better, tied or worse and the mean
difference with its CI (:func:`stats.paired_comparison`).

``compute`` -> :class:`StepQuality`; :func:`plot_step_quality` draws it; :func:`section`
writes its files and returns its report section.

The ``steps`` analysis (:data:`ANALYSIS`, pairwise): step quality on matched states and
against depth (§7.1, §7.3, :mod:`.depth`), base vs each other policy; a pair's pool is half
base-visited, half other-visited states. It scores states with what the environment's study
supplies (:mod:`agentrl_jax.evaluation.state_diagnostics`: FrozenLake's Q*, DeepCoder-MT's
test pass share) and names the quality as it says.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from agentrl_jax.evaluation import drivers, figures, raw, stats
from agentrl_jax.evaluation.analyses import depth
from agentrl_jax.evaluation.analyses.context import AnalysisRun, with_
from agentrl_jax.evaluation.analyses.registry import Analysis, register
from agentrl_jax.evaluation.report import Section, figure_path, rel, write_csv, write_json
from agentrl_jax.evaluation.result import Result, result


@result
class Pool(Result):
    """Per-state quality on one pool: ``q_base [S]``, ``q_rl [S]`` float64, the same states."""

    q_base: np.ndarray
    q_rl: np.ndarray


@result
class StepQuality(Result):
    """``pools``: the qualities compared; ``comparisons``: ``{pool: PairedComparison}`` of RL
    vs base on that pool."""

    pools: dict[str, Pool]
    comparisons: dict[str, stats.PairedComparison]


def compute(pools: Mapping[str, tuple[Any, Any]], *, method: str = "normal") -> StepQuality:
    """Compare ``{pool: (q_base [S], q_rl [S])}`` state by state (``method``: the CI of the mean
    difference, ``"normal"`` or ``"bootstrap"``)."""
    arrays = {
        pool: Pool(np.asarray(q_base, np.float64), np.asarray(q_rl, np.float64))
        for pool, (q_base, q_rl) in pools.items()
    }
    return StepQuality(
        arrays,
        {
            pool: stats.paired_comparison(p.q_rl, p.q_base, method=method)
            for pool, p in arrays.items()
        },
    )


def plot_step_quality(
    pools: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    out_path: str | Path,
    *,
    policy_names: tuple[str, str] = ("base", "RL"),
    title: str = "Step-level action quality",
) -> tuple[Path, Path]:
    """Per-state quality of base vs RL on state pools (Figures 3-4 style).

    One scatter panel per pool (x = base, y = RL; points above the diagonal are states
    where RL is better) and a bar panel with the share of states where RL is better / tied
    / worse, as computed by :func:`stats.paired_comparison` (its legend below the panels).

    Args:
      pools: ``{pool name: (q_base [S], q_rl [S])}``, e.g. ``{"matched": ..., "error": ...}``.
    """
    figures.nonempty("plot_step_quality", pools)
    base_name, rl_name = policy_names
    fig, axes = figures.new_figure(ncols=len(pools) + 1, width=3.8, height=3.6)
    shares = {}
    for ax, (pool, (q_base, q_rl)) in zip(axes[0], pools.items()):
        comparison = stats.paired_comparison(q_rl, q_base)
        shares[pool] = comparison
        qb, qr = np.asarray(q_base, dtype=np.float64), np.asarray(q_rl, dtype=np.float64)
        ax.scatter(qb, qr, s=6, alpha=0.5)
        lo, hi = float(min(qb.min(), qr.min())), float(max(qb.max(), qr.max()))
        pad = 0.02 * (hi - lo or 1.0)
        ax.plot([lo - pad, hi + pad], [lo - pad, hi + pad], color="black", linewidth=0.8)
        ax.set(
            xlabel=f"{base_name} quality",
            ylabel=f"{rl_name} quality",
            title=f"{pool}: mean diff {comparison.mean_diff.mean:+.3f}",
        )
        ax.set_aspect("equal", adjustable="datalim")
    ax = axes[0, -1]
    x = np.arange(len(shares))
    better = np.array([c.share_rl_better for c in shares.values()])
    tie = np.array([c.share_tie for c in shares.values()])
    worse = np.array([c.share_base_better for c in shares.values()])
    ax.bar(x, better, color="tab:blue", label=f"{rl_name} better")
    ax.bar(x, tie, bottom=better, color="lightgrey", label="tie")
    ax.bar(x, worse, bottom=better + tie, color="tab:orange", label=f"{base_name} better")
    ax.axhline(0.5, color="black", linewidth=0.8, linestyle=":")
    ax.set_xticks(x, list(shares))
    ax.set(ylabel="share of states", ylim=(0, 1), title="who is better")
    figures.legend_below(fig, ax, ncols=3)
    fig.suptitle(title)
    return figures.save_figure(fig, out_path)


def section(
    folder: str | Path,
    res: StepQuality,
    *,
    name: str = "step_quality",
    policy_names: tuple[str, str] = ("base", "RL"),
    title: str = "Step-level action quality",
) -> Section:
    """Write ``<name>.json`` (the comparisons), ``<name>_<pool>.csv`` (per-state qualities) and
    the figure; ``title`` names the section and the figure (name the states and the policies:
    the matched-state and error-state figures must not look alike)."""
    folder = Path(folder)
    json_path = write_json(folder / f"{name}.json", res.comparisons)
    files = [rel(folder, json_path)]
    base_name, rl_name = policy_names
    for pool, p in res.pools.items():
        csv_path = write_csv(
            folder / f"{name}_{pool}.csv",
            {
                "state": list(range(len(p.q_base))),
                f"q_{base_name}": list(p.q_base),
                f"q_{rl_name}": list(p.q_rl),
            },
        )
        files.append(rel(folder, csv_path))
    png, _ = plot_step_quality(
        {pool: (p.q_base, p.q_rl) for pool, p in res.pools.items()},
        figure_path(folder, name),
        policy_names=policy_names,
        title=title,
    )
    text = "; ".join(
        f"{pool}: {rl_name} better on {100 * c.share_rl_better:.1f}% of {c.n} states "
        f"(ties {100 * c.share_tie:.1f}%), mean diff {c.mean_diff.mean:+.4f} "
        f"[{c.mean_diff.low:+.4f}, {c.mean_diff.high:+.4f}]"
        for pool, c in res.comparisons.items()
    )
    return Section(title, text, (rel(folder, png),), tuple(files))


# ---------------------------------------------------------------- the steps analysis


def visits(run: AnalysisRun) -> dict[str, Any]:
    """The states each policy's trajectories act from at ``T_max``."""
    return run.states.visits(
        run.play,
        run.policies,
        run.key("sources"),
        samples=run.settings.source_samples,
        budget=run.t_max,
    )


def pool(run: AnalysisRun, visited: Mapping[str, Any], other: str) -> Any:
    """§7.1's matched pool of (base, other): half visited by each."""
    return run.states.matched(
        visited[run.base], visited[other], size=run.settings.states, seed=run.settings.seed
    )


def wording(states: Any) -> dict[str, str]:
    """What the states' quality, errors and success are called (kept in the raw records, so
    the suite's table and the findings word them alike when recomputed)."""
    return {
        field: getattr(states, field)
        for field in ("quality_name", "quality_symbol", "error_note", "success_note", "suite")
    }


def left_out(record: Mapping[str, Any], what: str) -> str:
    """A sentence on the states left out because their prompt does not fit the context."""
    kept = len(record["states"]["turn"])
    offered = record.get("offered", kept)
    return (
        f" {offered - kept} of the {offered} {what} were left out: their prompt (the "
        "history so far) does not fit eval.max_context."
        if offered > kept
        else ""
    )


def check_states(run: AnalysisRun, name: str) -> None:
    """A ValueError unless the run has the states to score (``steps``, ``errors``)."""
    if run.states is None:
        raise ValueError(
            f"{name}: needs the states to score (`states`, from the environment's study: "
            "Study.state_diagnostics)"
        )


def source_units(settings: Any, num_tasks: int, policies: int, t_max: int) -> int:
    """The work of playing the trajectories the state pools are drawn from."""
    return policies * drivers.rollout_units(num_tasks, settings.source_samples, t_max)


class Steps(Analysis):
    """Step quality on matched states and against depth, base vs each other policy."""

    name = "steps"
    unit_seconds = 2.0e-3  # fit on the stored default run (reproduce.progress)
    pairwise = True

    def units(self, settings: Any, num_tasks: int, policies: int, t_max: int) -> int:
        pairs = (policies - 1) * 2 * drivers.rollout_units(settings.states, settings.group_size, 1)
        return source_units(settings, num_tasks, policies, t_max) + pairs

    def run(self, run: AnalysisRun) -> list[Section]:
        check_states(run, "steps")
        s, visited = run.settings, visits(run)
        sections, pairs = [], {}
        for other in run.names[1:]:
            result, pairs[other] = run.states.steps(
                run.play,
                pool(run, visited, other),
                run.policies[run.base],
                run.policies[other],
                run.key("steps"),
                names=(run.base, other),
                settings=s,
            )
            run.progress(2 * drivers.rollout_units(s.states, s.group_size, 1))
            name = raw.slug(other)
            quality = section(
                run.out,
                compute(result.pools()),
                name=f"step_quality_{name}",
                policy_names=(run.base, other),
                title=(
                    f"Step-level {run.states.quality_name} on matched states: {other} vs {run.base}"
                ),
            )
            shares = ", ".join(f"{n} {100 * v:.1f}%" for n, v in result.invalid_share().items())
            sections.append(
                with_(
                    quality,
                    quality.title,
                    f"Invalid responses ({run.states.invalid_note(s)}): {shares}."
                    + left_out(pairs[other], "states"),
                )
            )
            sections.append(
                with_(
                    depth.section(
                        run.out,
                        depth.compute(
                            *depth.quality_by_depth(result, run.t_max),
                            bins=s.depth_bins,
                            seed=s.seed,
                        ),
                        name=f"quality_vs_depth_{name}",
                    ),
                    f"{run.states.quality_name.capitalize()} vs normalised depth: "
                    f"{other} vs {run.base}",
                )
            )
        raw_file = run.write_raw(
            "steps",
            {"gamma": run.gamma, "invalid": s.invalid, **wording(run.states), "pairs": pairs},
        )
        return [with_(sections[0], files=(raw_file,))] + sections[1:]


ANALYSIS = register(Steps())
