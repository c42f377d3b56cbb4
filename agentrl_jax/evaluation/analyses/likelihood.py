"""Likelihood (PAPER.md §7.4, Figures 6-7): ActionNLL under the base policy and the cumulative
log-likelihood ratio of trajectories, split by success.

* ``ActionNLL_B(r) = -log pi_B(r | h)`` of each response (base's own and RL's): a summary per
  source and the overlap of their histograms;
* ``LLR_{1:t} = sum_{i <= t} [log pi_RL(r_i | h_i) - log pi_B(r_i | h_i)]`` along each trajectory
  (:func:`cumulative_llr`): mean curves and final values by outcome, and the
  length-matched comparison.

The per-turn log-probs come from :mod:`agentrl_jax.evaluation.likelihood` (teacher-forced
scoring). ``compute`` -> :class:`Likelihood`; :func:`plot_action_nll_hist` and
:func:`plot_cumulative_llr` draw it; :func:`section` writes its files and its report section.

The ``likelihood`` analysis (:data:`ANALYSIS`, pairwise; Qwen3 models only): ActionNLL under
the base model and the cumulative LLR, base vs each other policy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from matplotlib.ticker import MaxNLocator

from agentrl_jax.evaluation import drivers, figures, raw, stats
from agentrl_jax.evaluation import likelihood as scoring
from agentrl_jax.evaluation.analyses.context import AnalysisRun, with_
from agentrl_jax.evaluation.analyses.registry import Analysis, register
from agentrl_jax.evaluation.report import Section, figure_path, rel, write_csv, write_json
from agentrl_jax.evaluation.result import Result, result
from agentrl_jax.evaluation.stats import DEFAULT_CONFIDENCE, MeanCI

OUTCOMES = ("success", "failure")
_OUTCOME_COLORS = {"success": "tab:green", "failure": "tab:red"}


# ---------------------------------------------------------------- statistics


def sum_token_logprobs(token_logprobs, token_mask) -> np.ndarray:
    """Response log-prob per turn, the sum of its tokens': ``[N, T, L], [N, T, L] -> [N, T]``."""
    lp = np.asarray(token_logprobs, dtype=np.float64)
    m = np.asarray(token_mask, dtype=bool)
    if lp.shape != m.shape or lp.ndim != 3:
        raise ValueError(
            f"sum_token_logprobs: expected matching [N, T, L] arrays, got {lp.shape} and {m.shape}"
        )
    return np.where(m, lp, 0.0).sum(axis=-1)


def cumulative_llr(logp_rl, logp_base, turn_mask) -> np.ndarray:
    """Cumulative log-likelihood ratio of each trajectory (§7.4)::

        LLR_{1:t} = sum_{i<=t} [log pi_RL(r_i | h_i) - log pi_B(r_i | h_i)]

    Args:
      logp_rl: ``[N, T]`` log-prob of each turn's whole response under the RL policy.
      logp_base: ``[N, T]`` the same responses under the base policy (teacher-forced).
      turn_mask: ``[N, T]`` bool prefix mask of turns that happened.

    Returns:
      ``[N, T]`` float64; column t holds LLR_{1:t+1}. Padding turns carry the final value
      forward, so ``[:, -1]`` is every trajectory's total.
    """
    rl, m = stats.turn_arrays("logp_rl", logp_rl, turn_mask)
    base, _ = stats.turn_arrays("logp_base", logp_base, turn_mask)
    # Mask before subtracting: padding may hold -inf/NaN from the model side.
    return np.cumsum(np.where(m, rl, 0.0) - np.where(m, base, 0.0), axis=1)


def trajectory_lengths(turn_mask) -> np.ndarray:
    """Turns per trajectory from a prefix mask: ``[N, T] -> [N]`` int64."""
    return stats.prefix_mask(turn_mask).sum(axis=1).astype(np.int64)


@result
class OutcomeLLR(Result):
    """``curve``: mean LLR_{1:t} over the trajectories of one outcome still running at turn t;
    ``final``: the mean of each such trajectory's total LLR."""

    curve: stats.TurnCurve
    final: MeanCI


def llr_by_outcome(
    cum_llr, turn_mask, success, confidence: float = DEFAULT_CONFIDENCE
) -> dict[str, OutcomeLLR]:
    """``{"success": OutcomeLLR, "failure": OutcomeLLR}`` of ``cum_llr`` ``[N, T]``
    (:func:`cumulative_llr`) with its ``[N, T]`` prefix mask and ``success`` ``[N]``."""
    v, m = stats.turn_arrays("cum_llr", cum_llr, turn_mask)
    ok = np.asarray(success, dtype=bool).reshape(-1)
    if ok.size != v.shape[0]:
        raise ValueError(
            f"llr_by_outcome: `success` has {ok.size} entries for {v.shape[0]} trajectories"
        )
    return {
        label: OutcomeLLR(
            stats.turn_curve(v, m, sel, confidence), stats.mean_ci_normal(v[sel, -1], confidence)
        )
        for label, sel in zip(OUTCOMES, (ok, ~ok))
    }


@result
class LengthMatched(Result):
    """``groups``: ``{name: MeanCI of LLR_{1:length}}`` over the group's trajectories that ran
    at least ``length`` turns (n = 0 and NaN when none did)."""

    length: int
    groups: dict[str, MeanCI]


def length_matched_llr(
    cum_llr,
    turn_mask,
    groups: Mapping[str, np.ndarray],
    length: int | None = None,
    confidence: float = DEFAULT_CONFIDENCE,
) -> LengthMatched:
    """Length-matched cumulative LLR: every group compared after the same number of turns.

    Total LLR grows with length, so comparing totals of, say, long successful and short failed
    trajectories mixes "more turns" with "more RL-like turns"; truncating all to a common
    length L removes the length effect. By default L is the smallest of the groups' median
    lengths (floored, at least 1), so every group keeps about half its trajectories or more.

    Args:
      cum_llr: ``[N, T]`` from :func:`cumulative_llr`.
      turn_mask: ``[N, T]`` prefix mask.
      groups: ``{name: [N] bool}`` e.g. ``{"success": s, "failure": ~s}``.
      length: L, or None for the default above.
    """
    v, m = stats.turn_arrays("cum_llr", cum_llr, turn_mask)
    lengths = m.sum(axis=1)
    selections = {}
    for name, sel in groups.items():
        s = np.asarray(sel, dtype=bool).reshape(-1)
        if s.size != v.shape[0]:
            raise ValueError(
                f"length_matched_llr: group {name!r} has {s.size} entries "
                f"for {v.shape[0]} trajectories"
            )
        selections[name] = s
    if length is None:
        medians = [np.median(lengths[s]) for s in selections.values() if s.any()]
        if not medians:
            raise ValueError("length_matched_llr: every group is empty")
        length = max(1, int(np.floor(min(medians))))
    if not 1 <= length <= v.shape[1]:
        raise ValueError(
            f"length_matched_llr: `length` must lie in [1, {v.shape[1]}], got {length}"
        )
    return LengthMatched(
        int(length),
        {
            name: stats.mean_ci_normal(v[s & (lengths >= length), length - 1], confidence)
            for name, s in selections.items()
        },
    )


@result
class NLLSummary(Result):
    """Distribution summary of per-response negative log-likelihoods (nats)."""

    n: int
    mean: MeanCI
    std: float
    median: float
    q05: float
    q95: float


def action_nll_summary(nll, mask=None, confidence: float = DEFAULT_CONFIDENCE) -> NLLSummary:
    """Summary of ActionNLL_B values, any shape (e.g. ``[N, T]``), only where the optional
    ``mask`` (same shape) is True."""
    v = np.asarray(nll, dtype=np.float64)
    if mask is not None:
        m = np.asarray(mask, dtype=bool)
        if m.shape != v.shape:
            raise ValueError(f"action_nll_summary: `mask` shape {m.shape} != `nll` shape {v.shape}")
        v = v[m]
    v = stats.finite_1d(v, "nll")
    if v.size == 0:
        raise ValueError("action_nll_summary: no values")
    q05, median, q95 = np.quantile(v, [0.05, 0.5, 0.95])
    return NLLSummary(
        n=int(v.size),
        mean=stats.mean_ci_normal(v, confidence),
        std=float(v.std(ddof=1)) if v.size > 1 else float("nan"),
        median=float(median),
        q05=float(q05),
        q95=float(q95),
    )


def histogram_overlap(a, b, bins: int = 50) -> float:
    """Overlap coefficient ``sum_bins min(p_a, p_b)`` of two samples on shared bins, in [0, 1]:
    1 means identical histograms, 0 disjoint support ("heavily overlapping" ActionNLL, §7.4)."""
    av, bv = stats.finite_1d(a, "a"), stats.finite_1d(b, "b")
    if av.size == 0 or bv.size == 0:
        raise ValueError("histogram_overlap: both samples need values")
    lo, hi = min(av.min(), bv.min()), max(av.max(), bv.max())
    if lo == hi:
        return 1.0
    edges = np.linspace(lo, hi, bins + 1)
    pa = np.histogram(av, edges)[0] / av.size
    pb = np.histogram(bv, edges)[0] / bv.size
    return float(np.minimum(pa, pb).sum())


# ---------------------------------------------------------------- the analysis


@result
class LLRSet(Result):
    """One set of trajectories: ``cum_llr [N, T]``, ``turn_mask [N, T]``, ``success [N]`` and
    their statistics."""

    cum_llr: np.ndarray
    turn_mask: np.ndarray
    success: np.ndarray
    by_outcome: dict[str, OutcomeLLR]
    length_matched: LengthMatched


@result
class Likelihood(Result):
    """``action_nll``: ``{source: nll [M]}``; ``nll_summary``: their summaries; ``overlap``: the
    histogram overlap of exactly two sources (else None); ``llr``: ``{set: LLRSet}``."""

    action_nll: dict[str, np.ndarray]
    nll_summary: dict[str, NLLSummary]
    overlap: float | None
    llr: dict[str, LLRSet]


def compute(
    action_nll: Mapping[str, Any],
    llr_sets: Mapping[str, tuple[Any, Any, Any, Any]],
    *,
    match_length: int | None = None,
) -> Likelihood:
    """The likelihood statistics.

    Args:
      action_nll: ``{label: nll [M]}`` of valid responses, e.g. base's and RL's own.
      llr_sets: ``{label: (logp_rl [N, T], logp_base [N, T], turn_mask [N, T], success [N])}``
        per-turn response log-probs of one policy's trajectories under both policies.
      match_length: L of the length-matched LLR (default: see :func:`length_matched_llr`).
    """
    nll = {k: np.asarray(v, dtype=np.float64) for k, v in action_nll.items()}
    labels = list(nll)
    overlap = histogram_overlap(nll[labels[0]], nll[labels[1]]) if len(labels) == 2 else None
    sets = {}
    for label, (logp_rl, logp_base, mask, success) in llr_sets.items():
        cum = cumulative_llr(logp_rl, logp_base, mask)
        ok, m = np.asarray(success, dtype=bool), np.asarray(mask, dtype=bool)
        sets[label] = LLRSet(
            cum,
            m,
            ok,
            llr_by_outcome(cum, m, ok),
            length_matched_llr(cum, m, {"success": ok, "failure": ~ok}, match_length),
        )
    return Likelihood(nll, {k: action_nll_summary(v) for k, v in nll.items()}, overlap, sets)


# ---------------------------------------------------------------- figures


def plot_action_nll_hist(
    samples: Mapping[str, Sequence[float]],
    out_path: str | Path,
    *,
    bins: int = 50,
    title: str = "ActionNLL under the base policy",
) -> tuple[Path, Path]:
    """Overlaid density histograms of ActionNLL per response source (Figure 6 style), the
    legend (each source with its mean) beside the axes.

    Args:
      samples: ``{label: nll [M]}``, e.g. ``{"base responses": ..., "RL responses": ...}``.
    """
    figures.nonempty("plot_action_nll_hist", samples)
    arrays = {k: np.asarray(v, dtype=np.float64).reshape(-1) for k, v in samples.items()}
    for name, values in arrays.items():
        if values.size == 0 or not np.all(np.isfinite(values)):
            raise ValueError(
                f"plot_action_nll_hist: samples[{name!r}] must be non-empty and finite"
            )
    everything = np.concatenate(list(arrays.values()))
    lo, hi = everything.min(), everything.max()
    edges = np.linspace(lo, hi if hi > lo else lo + 1.0, bins + 1)
    labels = {name: f"{name} (mean {values.mean():.2f})" for name, values in arrays.items()}
    fig, axes = figures.new_figure(width=5.0 + figures.legend_width(labels.values()))
    ax = axes[0, 0]
    for name, values in arrays.items():
        ax.hist(values, bins=edges, density=True, alpha=0.45, label=labels[name])
    ax.set(xlabel=r"$-\log\pi_{B}(r \mid h)$  [nats]", ylabel="density", title=title)
    figures.legend_outside(ax)
    return figures.save_figure(fig, out_path)


def plot_cumulative_llr(
    sets: Mapping[str, LLRSet],
    out_path: str | Path,
    *,
    max_lines: int = 60,
    title: str = r"Cumulative log-likelihood ratio "
    r"$\sum_{i \leq t} \log\pi_{RL}(r_i|h_i) - \log\pi_{B}(r_i|h_i)$",
) -> tuple[Path, Path]:
    """Cumulative LLR per trajectory, split by success (Figure 7 style).

    One panel per :class:`LLRSet` (e.g. ``{"RL trajectories": ..., "base trajectories": ...}``):
    thin lines for up to ``max_lines`` trajectories per outcome, the mean over trajectories
    still running at each turn with its 95% band, and the mean final value (the report's)
    drawn at the trajectories' mean last turn. Each panel's legend (its own counts and final
    values) sits under it.
    """
    figures.nonempty("plot_cumulative_llr", sets)
    fig, axes = figures.new_figure(ncols=len(sets), width=4.6)
    for ax, (name, llr) in zip(axes[0], sets.items()):
        cum, mask, ok = llr.cum_llr, llr.turn_mask, llr.success.reshape(-1)
        turns = np.arange(1, cum.shape[1] + 1)
        for outcome, sel in zip(OUTCOMES, (ok, ~ok)):
            color = _OUTCOME_COLORS[outcome]
            for row in np.flatnonzero(sel)[:max_lines]:
                ax.plot(
                    turns[mask[row]], cum[row, mask[row]], color=color, alpha=0.15, linewidth=0.6
                )
            curve = llr.by_outcome[outcome].curve
            if np.any(curve.count > 0):
                final = llr.by_outcome[outcome].final
                ax.plot(
                    curve.turn,
                    curve.mean,
                    color=color,
                    linewidth=2,
                    label=f"{outcome} (n={int(sel.sum())}): mean of those still playing",
                )
                # the report's "final" is each trajectory's own last value, averaged: drawn
                # at their mean last turn (the curve's end holds only the longest ones)
                last = np.where(
                    mask[sel].any(axis=1),
                    mask[sel].shape[1] - np.argmax(mask[sel][:, ::-1], axis=1),
                    0,
                )
                ax.plot(
                    [last[last > 0].mean()],
                    [final.mean],
                    marker="D",
                    markersize=7,
                    color=color,
                    markeredgecolor="black",
                    linestyle="none",
                    label=f"{outcome}: mean at each one's last turn {final.mean:+.1f}",
                )
                ax.fill_between(
                    curve.turn, curve.low, curve.high, color=color, alpha=0.25, linewidth=0
                )
        ax.axhline(0, color="black", linewidth=0.8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(xlabel="turn t", ylabel=r"$\mathrm{LLR}_{1:t}$  [nats]", title=name)
        figures.legend_under(ax)
    fig.suptitle(title)
    return figures.save_figure(fig, out_path)


# ---------------------------------------------------------------- files and section

_LLR_COLUMNS = (
    "set",
    "outcome",
    "final_llr_mean",
    "ci_low",
    "ci_high",
    "n",
    "matched_length",
    "matched_llr_mean",
    "matched_n",
)


def _llr_rows(res: Likelihood) -> dict[str, list]:
    """``<name>_llr.csv``: one row per trajectory set and outcome."""
    rows: dict[str, list] = {c: [] for c in _LLR_COLUMNS}
    for label, llr in res.llr.items():
        for outcome in OUTCOMES:
            final = llr.by_outcome[outcome].final
            matched = llr.length_matched.groups[outcome]
            for key, value in zip(
                _LLR_COLUMNS,
                (
                    label,
                    outcome,
                    final.mean,
                    final.low,
                    final.high,
                    final.n,
                    llr.length_matched.length,
                    matched.mean,
                    matched.n,
                ),
            ):
                rows[key].append(value)
    return rows


def section(folder: str | Path, res: Likelihood, *, name: str = "likelihood") -> Section:
    """Write ``<name>.json`` (summaries, overlap, LLR statistics), ``<name>_action_nll.csv``,
    ``<name>_llr.csv`` and the figures; the section "Likelihood: ActionNLL and cumulative LLR"."""
    folder = Path(folder)
    record: dict[str, Any] = {"action_nll": res.nll_summary}
    if res.overlap is not None:
        record["action_nll_overlap"] = res.overlap
    record["cumulative_llr"] = {
        label: {"by_outcome": llr.by_outcome, "length_matched": llr.length_matched}
        for label, llr in res.llr.items()
    }
    json_path = write_json(folder / f"{name}.json", record)
    nll_csv = write_csv(
        folder / f"{name}_action_nll.csv",
        {
            "source": [k for k, v in res.action_nll.items() for _ in np.ravel(v)],
            "nll": [float(x) for v in res.action_nll.values() for x in np.ravel(v)],
        },
    )
    llr_csv = write_csv(folder / f"{name}_llr.csv", _llr_rows(res))
    pngs = [plot_action_nll_hist(res.action_nll, figure_path(folder, f"{name}_action_nll"))[0]]
    if res.llr:
        pngs.append(plot_cumulative_llr(res.llr, figure_path(folder, f"{name}_cumulative_llr"))[0])
    text = "; ".join(f"ActionNLL {k}: mean {s.mean.mean:.2f}" for k, s in res.nll_summary.items())
    if res.overlap is not None:
        text += f"; histogram overlap {res.overlap:.2f}"
    return Section(
        "Likelihood: ActionNLL and cumulative LLR",
        text,
        tuple(rel(folder, p) for p in pngs),
        (rel(folder, json_path), rel(folder, nll_csv), rel(folder, llr_csv)),
    )


# ---------------------------------------------------------------- the likelihood analysis


class LikelihoodAnalysis(Analysis):
    """ActionNLL and the cumulative LLR of base vs each other policy (§7.4)."""

    name = "likelihood"
    unit_seconds = 1.8e-3  # fit on the stored default run (reproduce.progress)
    pairwise = True

    def units(self, settings: Any, num_tasks: int, policies: int, t_max: int) -> int:
        plays = policies + (policies - 1) * 2  # rollouts, then each pair's scoring
        return plays * drivers.rollout_units(num_tasks, settings.likelihood_samples, t_max)

    def run(self, run: AnalysisRun) -> list[Section]:
        s = run.settings
        run.models_only("likelihood", " (teacher-forced log-probs)")
        trajectories = drivers.likelihood_rollouts(
            run.play,
            run.policies,
            run.key("likelihood"),
            samples=s.likelihood_samples,
            budget=run.t_max,
        )
        sections, pairs = [], {}
        for other in run.names[1:]:
            data = scoring.likelihood_data(
                run.models[run.base],
                run.models[other],
                {n: trajectories[n] for n in (run.base, other)},
                rows_per_batch=s.likelihood_rows_per_batch,
                attention=s.attention,
            )
            run.progress(
                2 * drivers.rollout_units(len(run.task_ids), s.likelihood_samples, run.t_max)
            )
            written = section(
                run.out,
                compute(data.action_nll(), data.llr_sets()),
                name=f"likelihood_{raw.slug(other)}",
            )
            sections.append(
                with_(
                    written,
                    f"Likelihood: {other} vs {run.base} (ActionNLL under {run.base}, "
                    "cumulative LLR)",
                )
            )
            pairs[other] = {
                field: getattr(data, field)
                for field in ("logp_base", "logp_rl", "turn_mask", "action_valid", "success")
            }
        raw_file = run.write_raw("likelihood", {"pairs": pairs})
        return [with_(sections[0], files=(raw_file,))] + sections[1:]


ANALYSIS = register(LikelihoodAnalysis())
