"""The study at several seeds: one results folder per seed, each finding across them.

``agentrl-jax reproduce frozenlake --seeds 0 --seeds 7 --seeds 13`` runs the whole study once
per seed into ``<out>/seed_<s>/`` (every seed of the config set to ``s``:
:func:`seed_overrides`), each resumable on its own, then :func:`write_across_seeds` reads each
folder's ``findings.json`` (and the machines its ``phases.json`` records) and writes
``<out>/seeds.json`` and ``<out>/seeds.md``: per headline, subject and tested effect, the
estimate and verdict at each seed, the mean across seeds with a 95% t-interval over the seeds,
how many seeds put the effect on the paper's side and how many show it, and the verdict the
findings' rule (:func:`findings.judge`) gives the across-seed interval.
:func:`write_seeds_report` writes ``<out>/report.md``, which leads with that table and links
each seed's own report. A claim one seed shows and another refutes is the seed's, not the
method's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from statistics import NormalDist
from typing import Any, Mapping, Sequence

from agentrl_jax.evaluation import findings, stats, verdicts
from agentrl_jax.evaluation import report as eval_report
from agentrl_jax.reproduce import machine
from agentrl_jax.reproduce.folder import CONFIG_FILE, PHASES_FILE, Phases

# Every field that seeds randomness in a ReproduceConfig (maps, init, warm start, RL, evaluation).
SEED_FIELDS = ("task.seed", "model.seed", "warm_start.seed", "rl.seed", "eval.seed")
SEEDS_MD, SEEDS_JSON = "seeds.md", "seeds.json"
NOT_RECORDED = "not recorded"

# Student's t 97.5% quantiles (two-sided 95%) at 1..30 degrees of freedom.
T975 = (
    12.706204736,
    4.302652730,
    3.182446305,
    2.776445105,
    2.570581836,
    2.446911851,
    2.364624252,
    2.306004135,
    2.262157163,
    2.228138852,
    2.200985160,
    2.178812830,
    2.160368656,
    2.144786688,
    2.131449546,
    2.119905299,
    2.109815578,
    2.100922040,
    2.093024054,
    2.085963447,
    2.079613845,
    2.073873068,
    2.068657610,
    2.063898562,
    2.059538553,
    2.055529439,
    2.051830516,
    2.048407142,
    2.045229642,
    2.042272456,
)


def seed_overrides(seed: int) -> list[str]:
    """``--set`` overrides putting every seed of the config at ``seed``."""
    return [f"{field}={int(seed)}" for field in SEED_FIELDS]


def seed_folder(out: str | Path, seed: int) -> Path:
    return Path(out) / f"seed_{int(seed)}"


# ---------------------------------------------------------------- the interval across seeds


def t_quantile_975(df: int) -> float:
    """Student's t 97.5% quantile at ``df`` degrees of freedom: :data:`T975` up to 30, the
    Cornish-Fisher expansion in 1/df beyond (within 1e-6 of the exact value there)."""
    if df < 1:
        raise ValueError(f"t_quantile_975: df must be >= 1, got {df}")
    if df <= len(T975):
        return T975[df - 1]
    z = NormalDist().inv_cdf(0.975)
    terms = (
        (z**3 + z) / 4,
        (5 * z**5 + 16 * z**3 + 3 * z) / 96,
        (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384,
        (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160,
    )
    return z + sum(term / df ** (i + 1) for i, term in enumerate(terms))


def across_interval(estimates: Sequence[float | None]) -> stats.MeanCI:
    """The mean of the seeds' finite estimates (None or NaN: a seed without one) with a 95%
    t-interval across them (``n - 1`` degrees of freedom); NaN bounds below two estimates, a
    NaN mean with none."""
    values = [float(x) for x in estimates if x is not None and math.isfinite(x)]
    n = len(values)
    if n == 0:
        return stats.MeanCI(math.nan, math.nan, math.nan, 0)
    mean = sum(values) / n
    if n == 1:
        return stats.MeanCI(mean, math.nan, math.nan, 1)
    sd = math.sqrt(sum((x - mean) ** 2 for x in values) / (n - 1))
    half = t_quantile_975(n - 1) * sd / math.sqrt(n)
    return stats.MeanCI(mean, mean - half, mean + half, n)


def on_papers_side(estimate: float | None, direction: int, margin: float = 0.0) -> bool:
    """Whether one seed's estimate lies on the paper's side of "no effect": ``estimate *
    direction > 0``, or, for a "keeps" effect (``margin > 0``), ``> -margin``."""
    return estimate is not None and math.isfinite(estimate) and direction * estimate > -margin


def _finite(value: Any) -> float | None:
    """A float as JSON keeps it: None for a missing or non-finite value."""
    return float(value) if value is not None and math.isfinite(value) else None


def across_effect(
    name: str, per_seed: Mapping[str, Mapping[str, Any]], seeds: Sequence[int]
) -> dict[str, Any]:
    """One effect across seeds, from each seed's ``findings.json`` entry of it (``per_seed``:
    seed -> ``numbers["effects"][name]``; a seed without it is left out): ``estimates`` and
    ``verdicts`` per seed (None where missing), the across-seed ``mean``, ``low``, ``high``,
    ``n`` (None where undefined), ``paper_side`` and ``shows`` (the seeds on the paper's side,
    the seeds that show it) and ``verdict``: :func:`findings.judge` on the across-seed interval
    (``not measured`` if no seed has an estimate)."""
    first = next(iter(per_seed.values()))
    direction, margin = int(first.get("direction", 1)), float(first.get("margin") or 0.0)
    keys = [str(s) for s in seeds]
    estimates = {s: _finite(per_seed[s].get("estimate")) if s in per_seed else None for s in keys}
    ci = across_interval(list(estimates.values()))
    effect = findings.Effect(
        name,
        ci,
        direction=direction,
        size=first.get("paper_size"),
        margin=margin,
        points=bool(first.get("points", True)),
    )
    return {
        "name": name,
        "direction": direction,
        "points": effect.points,
        "paper_size": effect.size,
        "margin": margin,
        "estimates": estimates,
        "verdicts": {s: per_seed[s].get("verdict") if s in per_seed else None for s in keys},
        "mean": _finite(ci.mean),
        "low": _finite(ci.low),
        "high": _finite(ci.high),
        "n": ci.n,
        "paper_side": [int(s) for s in keys if on_papers_side(estimates[s], direction, margin)],
        "shows": [
            int(s) for s in keys if s in per_seed and per_seed[s]["verdict"] == findings.SHOWS
        ],
        "verdict": findings.judge(effect) if ci.n else findings.NOT_MEASURED,
    }


# ---------------------------------------------------------------- reading the seed folders


def _read_findings(out: str | Path, seed: int) -> list[dict[str, Any]]:
    path = seed_folder(out, seed) / findings.FINDINGS_JSON
    if not path.is_file():
        raise FileNotFoundError(
            f"across_seeds: {path} is missing (the seed-{seed} run has not finished its report)"
        )
    return json.loads(path.read_text())


def across_seeds(out: str | Path, seeds: Sequence[int]) -> list[dict[str, Any]]:
    """One row per (headline, subject) found at any seed: ``verdicts`` and ``observed`` per
    seed (None where that seed's folder has no such finding), ``shows``, the seeds that show
    it, and ``effects``: each tested effect across the seeds (:func:`across_effect`). Reads
    ``<out>/seed_<s>/findings.json``; plain JSON values (None for NaN)."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    effects: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for seed in seeds:
        for f in _read_findings(out, seed):
            key = (f["headline"], f["subject"])
            row = rows.setdefault(
                key,
                {
                    "headline": f["headline"],
                    "subject": f["subject"],
                    "verdicts": {},
                    "observed": {},
                },
            )
            row["verdicts"][str(seed)] = f["verdict"]
            row["observed"][str(seed)] = f["observed"]
            for name, effect in ((f.get("numbers") or {}).get("effects") or {}).items():
                effects.setdefault(key, {}).setdefault(name, {})[str(seed)] = effect
    for key, row in rows.items():
        for field in ("verdicts", "observed"):
            row[field] = {str(s): row[field].get(str(s)) for s in seeds}
        row["shows"] = [int(s) for s, v in row["verdicts"].items() if v == findings.SHOWS]
        row["effects"] = [
            across_effect(name, per_seed, seeds) for name, per_seed in effects.get(key, {}).items()
        ]
    return list(rows.values())


def seed_machines(out: str | Path, seeds: Sequence[int]) -> dict[str, list[dict[str, Any]]]:
    """The machines each seed's finished phases ran on (its ``phases.json``, :meth:`Phases.
    machines`; [] where none is recorded)."""
    return {str(s): Phases(seed_folder(out, s)).machines() for s in seeds}


def summarize(out: str | Path, seeds: Sequence[int]) -> dict[str, Any]:
    """What ``seeds.json`` holds: ``seeds``, ``machines`` (:func:`seed_machines`) and
    ``findings`` (:func:`across_seeds`)."""
    return {
        "seeds": [int(s) for s in seeds],
        "machines": seed_machines(out, seeds),
        "findings": across_seeds(out, seeds),
    }


def read_across_seeds(out: str | Path) -> dict[str, Any]:
    """``<out>/seeds.json`` read back (what :func:`summarize` gave when it was written)."""
    return json.loads((Path(out) / SEEDS_JSON).read_text())


# ---------------------------------------------------------------- Markdown


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|")


def _value(effect: Mapping[str, Any], mean: float | None, low=None, high=None) -> str:
    """``+4.1 pt [-2.0, +10.2]`` for a rate (in points), ``+0.041 [-0.020, +0.102]``
    otherwise; the interval only where both bounds are known; ``-`` without a value."""
    if mean is None:
        return "-"
    nan = math.nan
    ci = stats.MeanCI(mean, nan if low is None else low, nan if high is None else high, 0)
    return verdicts.pt(ci) if effect["points"] else verdicts.num(ci)


def _seed_cell(effect: Mapping[str, Any], seed: str) -> str:
    """One seed's estimate and verdict (``+3.0 pt (shows)``), ``-`` for a seed without it."""
    verdict = effect["verdicts"][seed]
    if verdict is None:
        return "-"
    return f"{_value(effect, effect['estimates'][seed])} ({verdict})"


def _across(effect: Mapping[str, Any], n_seeds: int) -> str:
    """The across-seed mean and interval, naming how many seeds it is over if not all."""
    text = _value(effect, effect["mean"], effect["low"], effect["high"])
    return text if effect["n"] in (0, n_seeds) else f"{text} ({effect['n']} seeds)"


def effect_line(effect: Mapping[str, Any], n_seeds: int) -> str:
    """``lead at k = 1: shows at 1 of 3 seeds; effect on the paper's side at 3 of 3; mean
    +4.1 pt [-2.0, +10.2] across seeds; across-seed verdict: underpowered``."""
    over = "across seeds" if effect["n"] == n_seeds else f"across {effect['n']} seeds"
    return (
        f"{effect['name']}: shows at {len(effect['shows'])} of {n_seeds} seeds; effect on "
        f"the paper's side at {len(effect['paper_side'])} of {n_seeds}; mean "
        f"{_value(effect, effect['mean'], effect['low'], effect['high'])} {over}; "
        f"across-seed verdict: {effect['verdict']}"
    )


def _machine_lines(machines: Mapping[str, list[dict[str, Any]]]) -> list[str]:
    """One bullet per seed: the machine(s) it ran on (:func:`machine.describe`)."""
    return [
        f"- seed {s}: "
        + (" then ".join(machine.describe(m) for m in records) if records else NOT_RECORDED)
        for s, records in machines.items()
    ]


def _table_lines(rows: Sequence[Mapping[str, Any]], seeds: Sequence[str]) -> list[str]:
    """The findings across seeds: a line per tested effect (a finding without effects, e.g.
    not measured, gets one line with its verdict per seed)."""
    n = len(seeds)
    lines = [
        "| Paper headline | Checked on | Effect | "
        + " | ".join(f"seed {s}" for s in seeds)
        + " | Across seeds (mean [95% interval]) | On the paper's side | Shows at "
        "| Across-seed verdict |",
        "|---|---|---|" + "---|" * n + "---|---|---|---|",
    ]
    for row in rows:
        head = f"| {_cell(row['headline'])} | {_cell(row['subject'] or '-')} | "
        for effect in row["effects"]:
            lines.append(
                head
                + f"{_cell(effect['name'])} | "
                + " | ".join(_seed_cell(effect, s) for s in seeds)
                + f" | {_across(effect, n)} | {len(effect['paper_side'])} of {n} | "
                f"{len(effect['shows'])} of {n} | **{effect['verdict']}** |"
            )
        if not row["effects"]:
            verdicts = [row["verdicts"][s] for s in seeds]
            same = verdicts[0] if len(set(verdicts)) == 1 and verdicts[0] else "-"
            lines.append(
                head
                + "- | "
                + " | ".join(v or "-" for v in verdicts)
                + f" | - | - | {len(row['shows'])} of {n} | **{same}** |"
            )
    return lines


def seeds_markdown(summary: Mapping[str, Any]) -> str:
    """``seeds.md`` from :func:`summarize`'s record: what a seed is, the machines, the
    findings across seeds (:func:`_table_lines`), each headline's verdict per seed and each
    seed's own numbers."""
    seeds = [str(s) for s in summary["seeds"]]
    rows, n = summary["findings"], len(seeds)
    lines = [
        f"# Findings across seeds {', '.join(seeds)}",
        "",
        "Each seed is a whole run of the study (`seed_<s>/`, every seed of the config set to s: "
        "task maps, model init, warm start, RL and evaluation). Each effect is shown at each "
        "seed with that seed's verdict (the findings' rule, see any seed's report), then its "
        "mean across the seeds with a 95% t-interval over them; on the paper's side: the seeds "
        "whose estimate is in the paper's direction (for BudgetMix keeping R_single: a fall "
        "smaller than full-budget RL's); the across-seed verdict applies the findings' rule "
        "to the across-seed interval. Rates are in points.",
        "",
        "Machines:",
        "",
        *_machine_lines(summary["machines"]),
        "",
        *_table_lines(rows, seeds),
        "",
        "## Headline verdicts per seed",
        "",
        "| Paper headline | Checked on | "
        + " | ".join(f"seed {s}" for s in seeds)
        + " | shows at |",
        "|---|---|" + "---|" * n + "---|",
    ]
    for row in rows:
        verdicts = [row["verdicts"][s] or "-" for s in seeds]
        lines.append(
            f"| {_cell(row['headline'])} | {_cell(row['subject'] or '-')} | "
            + " | ".join(f"**{v}**" for v in verdicts)
            + f" | {len(row['shows'])} of {n} |"
        )
    lines += ["", "## Effects per seed", ""]
    for row in rows:
        observed = (row["observed"][s] or "not run" for s in seeds)
        lines.append(
            f"- **{row['headline']}** ({row['subject'] or '-'}): "
            + "; ".join(f"seed {s}: {text}" for s, text in zip(seeds, observed))
        )
        lines += [f"  - {effect_line(effect, n)}" for effect in row["effects"]]
    return "\n".join(lines) + "\n"


def write_across_seeds(out: str | Path, seeds: Sequence[int]) -> Path:
    """``<out>/seeds.json`` (:func:`summarize`) and ``<out>/seeds.md`` (:func:`seeds_markdown`);
    returns the Markdown's path."""
    out = Path(out)
    summary = summarize(out, seeds)
    eval_report.write_json(out / SEEDS_JSON, summary)
    path = out / SEEDS_MD
    path.write_text(seeds_markdown(summary))
    return path


def _report_links(out: Path, seeds: Sequence[int]) -> list[str]:
    """A bullet per seed linking its ``report.md`` (and ``report.html`` where written)."""
    lines = []
    for seed in seeds:
        folder = seed_folder(out, seed)
        links = [
            f"[{name}]({folder.name}/{name})"
            for name in (eval_report.REPORT_NAME, "report.html")
            if (folder / name).is_file()
        ]
        lines.append(f"- seed {seed}: {', '.join(links) if links else 'no report yet'}")
    return lines


def holds_a_run(out: str | Path) -> bool:
    """Whether ``out`` is itself a run's results folder (its own config and phases), whose
    ``report.md`` the across-seed report must not replace."""
    return any((Path(out) / name).exists() for name in (CONFIG_FILE, PHASES_FILE))


def write_seeds_report(out: str | Path, seeds: Sequence[int]) -> Path | None:
    """``<out>/report.md`` of a run at several seeds: the findings across seeds (as
    ``seeds.md``), then a link to each seed's own report. None, writing nothing, where ``out``
    holds a run of its own (:func:`holds_a_run`)."""
    out = Path(out)
    if holds_a_run(out):
        return None
    text = seeds_markdown(summarize(out, seeds))
    text += "\n## Each seed's report\n\n" + "\n".join(_report_links(out, seeds)) + "\n"
    path = out / eval_report.REPORT_NAME
    path.write_text(text)
    return path
