"""The error-recovery suite: what each policy does after a mistake, in one table (PAPER.md §7.2).

The suite is named (:data:`SUITE`) so that other work reports the same figures the same way.
Its states and samples are those of the ``errors`` analysis: per compared policy ``P``,
§7.1's matched pool of base- and ``P``-visited states, each with one injected move that
lengthens the shortest path to the goal, and ``G`` samples per state and policy with the same
keys. Per policy ``P`` (against the base ``B``, on that pair's error states):

* ``better_share``: the share of error states where ``P``'s mean Q* action quality is strictly
  above ``B``'s (ties are counted apart, ``tie_share``);
* ``quality_diff``: the mean per-state Q* quality difference ``P - B`` with a normal 95% CI;
* ``continuation`` and ``base_continuation``: the success rate continuing from the error
  states within the remaining budget (Wilson 95% CI over all ``E x G`` continuations);
* ``continuation_gain``: the paired per-state difference of success rates ``P - B`` (normal
  95% CI over states), the figure the paper's "51.3% vs 38.6%" compares.

``compute(errors_record)`` reads a raw ``errors`` record (``raw/errors.json``);
:func:`section` writes ``error_recovery.json``, ``error_recovery.csv`` and the table.

The ``errors`` analysis (:data:`ANALYSIS`, pairwise): step quality at injected error states
(:mod:`.step_quality`) and continuation success (:mod:`.continuation`, §7.2), base vs each
other policy, then this suite's table of every policy. It scores states with what the
environment's study supplies (:mod:`agentrl_jax.evaluation.state_diagnostics`) and names the
quality, the injected error and the suite as it says; it checks the paper's "error recovery,
not single-step quality, is where RL gains" (with the ``steps`` analysis' matched states).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from agentrl_jax.evaluation import drivers, raw, stats
from agentrl_jax.evaluation.analyses import continuation, step_quality
from agentrl_jax.evaluation.analyses.context import AnalysisRun, with_
from agentrl_jax.evaluation.analyses.registry import Analysis, register
from agentrl_jax.evaluation.report import Section, rel, write_csv, write_json
from agentrl_jax.evaluation.result import Result, result
from agentrl_jax.evaluation.verdicts import (
    DEFAULT_FIGURES,
    ERROR_RECOVERY,
    Effect,
    Finding,
    PaperFigures,
    absent,
    difference,
    effects_json,
    num,
    power,
    pt,
    verdict,
)

SUITE = "frozenlake-error-recovery/v1"
ERROR_RECOVERY_JSON, ERROR_RECOVERY_CSV = "error_recovery.json", "error_recovery.csv"


@result
class Recovery(Result):
    """One policy against the base on their error states (see the module docstring)."""

    states: int
    better_share: float
    tie_share: float
    quality_diff: stats.MeanCI
    continuation: stats.MeanCI
    base_continuation: stats.MeanCI
    continuation_gain: stats.MeanCI


@result
class ErrorRecovery(Result):
    """``rows``: ``{policy: Recovery}`` against ``base``, in the record's policy order."""

    suite: str
    base: str
    rows: dict[str, Recovery]


def recovery(
    quality_base: Any, quality_policy: Any, success_base: Any, success_policy: Any
) -> Recovery:
    """One row from per-state qualities ``[E]`` and continuation successes ``[E, G]``."""
    compared = stats.paired_comparison(quality_policy, quality_base)
    base_s = np.asarray(success_base, np.float64)
    policy_s = np.asarray(success_policy, np.float64)
    if base_s.ndim != 2 or base_s.shape != policy_s.shape or base_s.shape[0] != compared.n:
        raise ValueError(
            f"error_recovery: successes must be [E, G] for the {compared.n} states "
            f"of both policies, got {base_s.shape} and {policy_s.shape}"
        )
    return Recovery(
        states=compared.n,
        better_share=compared.share_rl_better,
        tie_share=compared.share_tie,
        quality_diff=compared.mean_diff,
        continuation=stats.proportion_ci_wilson(policy_s.reshape(-1)),
        base_continuation=stats.proportion_ci_wilson(base_s.reshape(-1)),
        continuation_gain=stats.paired_difference(policy_s.mean(axis=1), base_s.mean(axis=1)),
    )


def compute(errors_record: Mapping[str, Any]) -> ErrorRecovery:
    """The suite's table from a raw ``errors`` record (``policies``, and per compared policy
    ``pairs[P]`` with ``quality`` and ``success`` of both; ``suite``: the suite's name, by
    default :data:`SUITE`)."""
    base = errors_record["policies"][0]
    rows = {}
    for policy in errors_record["policies"][1:]:
        pair = errors_record["pairs"].get(policy)
        if pair is None:
            continue
        rows[policy] = recovery(
            pair["quality"][base],
            pair["quality"][policy],
            pair["success"][base],
            pair["success"][policy],
        )
    return ErrorRecovery(errors_record.get("suite", SUITE), base, rows)


def _ci(c: stats.MeanCI, points: bool = True, signed: bool = False) -> str:
    """``mean [low, high]``: rates in percent (points), signed for differences; else 3 places."""
    scale = 100.0 if points else 1.0
    fmt = ("{:+.1f}" if signed else "{:.1f}") if points else "{:+.3f}"
    return (
        f"{fmt.format(scale * c.mean)} [{fmt.format(scale * c.low)}, {fmt.format(scale * c.high)}]"
    )


_INTERVALS = ("quality_diff", "continuation", "base_continuation", "continuation_gain")
_CSV_COLUMNS = (
    "states",
    *(f"{field}_{part}" for field in _INTERVALS for part in ("mean", "low", "high")),
    "better_share",
    "tie_share",
)


def _csv_row(r: Recovery) -> dict[str, Any]:
    """``r``'s values by CSV column (:data:`_CSV_COLUMNS`)."""
    row = {"states": r.states, "better_share": r.better_share, "tie_share": r.tie_share}
    row.update(
        {
            f"{field}_{part}": getattr(getattr(r, field), part)
            for field in _INTERVALS
            for part in ("mean", "low", "high")
        }
    )
    return row


FROZENLAKE_WORDING = {
    "quality_symbol": "Q*",
    "quality_name": "action quality",
    "error_note": "one injected move that lengthens the shortest path",
    "success_note": "reaching the goal within the remaining budget",
}


def section(
    folder: str | Path, res: ErrorRecovery, wording: Mapping[str, str] | None = None
) -> Section:
    """``error_recovery.json`` (the result), ``error_recovery.csv`` and the section;
    ``wording``: what the quality (``quality_symbol``, ``quality_name``), the injected error
    (``error_note``) and success (``success_note``) are called (default FrozenLake's, what a
    raw ``errors`` record without them holds)."""
    words = {
        **FROZENLAKE_WORDING,
        **{k: v for k, v in (wording or {}).items() if k in FROZENLAKE_WORDING},
    }
    folder = Path(folder)
    json_path = write_json(folder / ERROR_RECOVERY_JSON, res)
    rows = [_csv_row(r) for r in res.rows.values()]
    columns = {"policy": list(res.rows), **{c: [row[c] for row in rows] for c in _CSV_COLUMNS}}
    csv_path = write_csv(folder / ERROR_RECOVERY_CSV, columns)
    cell = lambda text: str(text).replace("|", "\\|")  # noqa: E731
    symbol, name = words["quality_symbol"], words["quality_name"]
    quality = name if symbol in name else f"{symbol} {name}"
    lines = [
        f"| policy | error states | better than {cell(res.base)} (ties) | mean "
        f"{cell(words['quality_symbol'])} diff "
        f"[95% CI] | continuation % [95% CI] | {cell(res.base)} continuation % | "
        "gain (pt) [95% CI] |",
        "|---|---|---|---|---|---|---|",
    ]
    for policy, r in res.rows.items():
        lines.append(
            f"| {cell(policy)} | {r.states} | {100 * r.better_share:.1f}% "
            f"({100 * r.tie_share:.1f}%) | {_ci(r.quality_diff, points=False)} | "
            f"{_ci(r.continuation)} | {_ci(r.base_continuation)} | "
            f"{_ci(r.continuation_gain, signed=True)} |"
        )
    text = (
        f"Suite `{res.suite}`: each policy against {res.base} on their own error states "
        f"(§7.1's matched pool, half visited by each, with {words['error_note']}; the errors "
        f"analysis' samples). Better: strictly higher mean {quality} at the state. "
        f"Continuation: {words['success_note']} "
        "(Wilson CI over all continuations); gain: the paired per-state difference "
        "(normal CI over states)."
    )
    return Section(
        "Error-recovery suite",
        text,
        files=(rel(folder, json_path), rel(folder, csv_path)),
        markdown="\n".join(lines) + "\n",
    )


# ---------------------------------------------------------------- the errors analysis


POOL_NOTE = (
    "The {states} error states come from this comparison's own pool (§7.1: states "
    "visited by {base} and by {other}, half each), so {base}'s rate differs from one "
    "comparison to the next: each is measured on its own states."
)


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
            f"{symbol} diff {num(matched.mean_diff)}) vs "
            f"{100 * at_errors.share_rl_better:.1f}% of error states "
            f"({num(at_errors.mean_diff)}); continuation "
            f"{100 * rates[policy]:.1f}% vs {base} {100 * rates[base]:.1f}%: {pt(gain)}"
        )
        advantage = difference(at_errors.mean_diff, matched.mean_diff)
        effects = (
            Effect("continuation gain", gain, size=figures.error_recovery_gain),
            Effect("error-state minus matched-state quality gain", advantage, points=False),
        )
        observed += f"; error-state minus matched-state quality gain {num(advantage)}"
        out.append(
            Finding(
                ERROR_RECOVERY,
                policy,
                figures.text(ERROR_RECOVERY),
                observed + power(*effects),
                verdict(*effects),
                {
                    "matched": matched,
                    "error_states": at_errors,
                    "continuation": rates,
                    "continuation_gain": gain,
                    "quality_gain_difference": advantage,
                    "effects": effects_json(*effects),
                },
            )
        )
    return out


class Errors(Analysis):
    """Step quality at injected error states and continuation success, base vs each other
    policy, and the error-recovery suite's table."""

    name = "errors"
    unit_seconds = 8.2e-4  # fit on the stored default run (reproduce.progress)
    pairwise = True
    findings_rank = 2  # the paper's order: after Pass@K and Table 1
    sources = {ERROR_RECOVERY: "Continuation success from error states"}

    def units(self, settings: Any, num_tasks: int, policies: int, t_max: int) -> int:
        pairs = (
            (policies - 1) * 2 * drivers.rollout_units(settings.states, settings.group_size, t_max)
        )
        return step_quality.source_units(settings, num_tasks, policies, t_max) + pairs

    def run(self, run: AnalysisRun) -> list[Section]:
        step_quality.check_states(run, "errors")
        s, visited = run.settings, step_quality.visits(run)
        sections, pairs = [], {}
        for other in run.names[1:]:
            result, pairs[other] = run.states.errors(
                run.play,
                step_quality.pool(run, visited, other),
                run.policies[run.base],
                run.policies[other],
                run.key("errors"),
                names=(run.base, other),
                settings=s,
            )
            count = len(result.errors.states)
            run.progress(2 * drivers.rollout_units(s.states, s.group_size, run.t_max))
            name = raw.slug(other)
            quality = step_quality.section(
                run.out,
                step_quality.compute(result.quality.pools()),
                name=f"error_step_quality_{name}",
                policy_names=(run.base, other),
                title=(
                    f"Step-level {run.states.quality_name} at error states: {other} vs {run.base}"
                ),
            )
            sections.append(
                with_(
                    quality,
                    quality.title,
                    f"{count} error states ({run.states.error_note})."
                    + step_quality.left_out(pairs[other], "error states"),
                )
            )
            paired = result.paired_success().mean_diff
            rates = continuation.section(
                run.out,
                continuation.compute(result.success),
                name=f"continuation_{name}",
                title=f"Continuation success from error states: {other} vs {run.base}",
            )
            sections.append(
                with_(
                    rates,
                    rates.title,
                    f"Paired per-state difference {other} - {run.base}: "
                    f"{100 * paired.mean:+.1f} pt [{100 * paired.low:+.1f}, "
                    f"{100 * paired.high:+.1f}]. "
                    + POOL_NOTE.format(states=count, base=run.base, other=other),
                )
            )
        record = {"gamma": run.gamma, "invalid": s.invalid, **step_quality.wording(run.states)}
        raw_file = run.write_raw("errors", {**record, "pairs": pairs})
        saved = raw.load_raw(run.out, "errors")
        suite = section(run.out, compute(saved), saved)
        return [with_(sections[0], files=(raw_file,))] + sections[1:] + [suite]

    def findings(self, records: Mapping[str, Any], paper: PaperFigures) -> list[Finding]:
        steps, errors = records.get("steps"), records.get("errors")
        found = (
            check_error_recovery(steps, errors, paper)
            if steps is not None and errors is not None
            else []
        )
        return found or [
            absent(
                ERROR_RECOVERY,
                "needs both the steps and errors analyses of the same policies",
                figures=paper,
            )
        ]


ANALYSIS = register(Errors())
