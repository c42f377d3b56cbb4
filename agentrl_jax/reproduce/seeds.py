"""The study at several seeds: one results folder per seed, each finding across them.

``agentrl-jax reproduce frozenlake --seeds 0 --seeds 7 --seeds 13`` runs the whole study once
per seed into ``<out>/seed_<s>/`` (every seed of the config set to ``s``:
:func:`seed_overrides`), each resumable on its own, then :func:`write_across_seeds` reads each
folder's ``findings.json`` and writes ``<out>/seeds.md`` and ``<out>/seeds.json``: per headline
and subject, the verdict and the effect at each seed, and how many seeds show it. A claim one
seed shows and another refutes is the seed's, not the method's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from agentrl_jax.evaluation import report as eval_report
from agentrl_jax.reproduce import findings

# Every field that seeds randomness in a ReproduceConfig (maps, init, warm start, RL, evaluation).
SEED_FIELDS = ("task.seed", "model.seed", "warm_start.seed", "rl.seed", "eval.seed")
SEEDS_MD, SEEDS_JSON = "seeds.md", "seeds.json"


def seed_overrides(seed: int) -> list[str]:
    """``--set`` overrides putting every seed of the config at ``seed``."""
    return [f"{field}={int(seed)}" for field in SEED_FIELDS]


def seed_folder(out: str | Path, seed: int) -> Path:
    return Path(out) / f"seed_{int(seed)}"


def across_seeds(out: str | Path, seeds: Sequence[int]) -> list[dict[str, Any]]:
    """One row per (headline, subject) found at any seed: ``verdicts`` and ``observed`` per
    seed (None where that seed's folder has no such finding) and ``shows``, the seeds that
    show it. Reads ``<out>/seed_<s>/findings.json``."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for seed in seeds:
        path = seed_folder(out, seed) / findings.FINDINGS_JSON
        if not path.is_file():
            raise FileNotFoundError(
                f"across_seeds: {path} is missing (the seed-{seed} run has not finished its report)"
            )
        for f in json.loads(path.read_text()):
            row = rows.setdefault(
                (f["headline"], f["subject"]),
                {
                    "headline": f["headline"],
                    "subject": f["subject"],
                    "verdicts": {},
                    "observed": {},
                },
            )
            row["verdicts"][str(seed)] = f["verdict"]
            row["observed"][str(seed)] = f["observed"]
    for row in rows.values():
        row["shows"] = [int(s) for s, v in row["verdicts"].items() if v == findings.SHOWS]
    return list(rows.values())


def write_across_seeds(out: str | Path, seeds: Sequence[int]) -> Path:
    """``<out>/seeds.json`` and ``<out>/seeds.md`` (see the module docstring); returns the
    Markdown's path."""
    out = Path(out)
    rows = across_seeds(out, seeds)
    eval_report.write_json(out / SEEDS_JSON, {"seeds": [int(s) for s in seeds], "findings": rows})
    cell = lambda text: str(text).replace("|", "\\|")  # noqa: E731
    lines = [
        f"# Findings across seeds {', '.join(str(s) for s in seeds)}",
        "",
        "Each seed is a whole run of the study (`seed_<s>/`, every seed of the config set "
        "to s). Verdicts by the findings' rule (see any seed's report); the effects are "
        "each seed's own numbers.",
        "",
        "| Paper headline | Checked on | "
        + " | ".join(f"seed {s}" for s in seeds)
        + " | shows at |",
        "|---|---|" + "---|" * len(seeds) + "---|",
    ]
    for row in rows:
        verdicts = [row["verdicts"].get(str(s), "-") for s in seeds]
        lines.append(
            f"| {cell(row['headline'])} | {cell(row['subject'] or '-')} | "
            + " | ".join(f"**{v}**" for v in verdicts)
            + f" | {len(row['shows'])} of {len(seeds)} |"
        )
    lines += ["", "## Effects per seed", ""]
    for row in rows:
        lines.append(
            f"- **{row['headline']}** ({row['subject'] or '-'}): "
            + "; ".join(f"seed {s}: {row['observed'].get(str(s), 'not run')}" for s in seeds)
        )
    path = out / SEEDS_MD
    path.write_text("\n".join(lines) + "\n")
    return path
