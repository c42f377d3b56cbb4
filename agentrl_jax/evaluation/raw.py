"""The analyses' raw results: where each analysis saves them, and how to read them back
(per-task counts and pass@k, Table 1's values, CIs written as JSON). The numbers made from
them are the analyses' (:mod:`agentrl_jax.evaluation.analyses`: Table 1 with its differences,
budget robustness, training curves' changes) and the findings' (:mod:`.findings`).

Every registered analysis (:mod:`agentrl_jax.evaluation.analyses.registry`) saves everything
needed to recompute its numbers as
``<out>/raw/<analysis>.json`` (counts ``n``, ``c`` per task and budget, per-state qualities,
continuation outcomes, per-turn log-probs, training curves). The report's tables and the
findings (:mod:`.findings`) are computed from these files, so they can be checked, or
recomputed after the fact, without any model.

Policies are named; the first is the base policy. A BudgetMix policy is compared with its
full-budget *counterpart*, which every raw record names (its header's ``counterparts``,
``{BudgetMix policy: counterpart}``). Where the policies are a run's (the reproduction, ``eval``
of a results folder), the run's settings say it (:func:`counterparts_of_runs`): a run drawing
BudgetMix budgets is compared with the first full-budget run of the same algorithm. Policies
named on their own (``eval --policy``) have only their names: the counterpart of a name holding
the word ``BudgetMix`` is the policy named the same without it (``"BudgetMix GRPO"`` ->
``"GRPO"``, ``"BudgetMix GiGPO"`` -> ``"GiGPO"``), or ``"GRPO"`` for a policy named just
``"BudgetMix"``; words before ``BudgetMix`` qualify the variant and are dropped too
(``"Adaptive BudgetMix GRPO"`` -> ``"GRPO"``) (:func:`budgetmix_counterparts`).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from agentrl_jax.evaluation import passk, stats

RAW_DIR = "raw"
BUDGETMIX = "budgetmix"
DEFAULT_FULL_BUDGET = "GRPO"  # the counterpart of a policy named just "BudgetMix"


def raw_path(out: str | Path, analysis: str) -> Path:
    """``<out>/raw/<analysis>.json``."""
    return Path(out) / RAW_DIR / f"{analysis}.json"


def load_raw(path_or_out: str | Path, analysis: str) -> dict[str, Any] | None:
    """The raw record of ``analysis`` from its JSON file or a results folder; None when the
    folder does not hold it."""
    path = Path(path_or_out)
    if path.is_dir():
        path = raw_path(path, analysis)
        if not path.is_file():
            return None
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: cannot read the raw {analysis} results ({error})") from None
    if not isinstance(record, dict) or record.get("analysis") != analysis:
        raise ValueError(f"{path}: not a raw {analysis!r} record")
    return record


def slug(name: str) -> str:
    """A file-name-safe form of a policy or run name: ``"BudgetMix GRPO"`` ->
    ``"budgetmix_grpo"``."""
    text = re.sub(r"[^0-9a-z]+", "_", name.lower()).strip("_")
    if not text:
        raise ValueError(f"policy name {name!r} has no letter or digit to name its files by")
    return text


def counterparts_of_runs(runs: Sequence[Any]) -> dict[str, str]:
    """``{BudgetMix run's label: its full-budget counterpart's}`` from the runs' settings
    (each with ``label``, ``budget_mix`` and ``algorithm``, e.g.
    :class:`~agentrl_jax.train.presets.RunSettings`): a run drawing BudgetMix budgets is paired
    with the first run that does not and trains the same algorithm, where there is one."""
    full = [r for r in runs if not r.budget_mix]
    out = {}
    for run in runs:
        if run.budget_mix:
            same = [r.label for r in full if r.algorithm == run.algorithm]
            if same:
                out[run.label] = same[0]
    return out


def is_budgetmix(name: str, record: Mapping[str, Any] | None = None) -> bool:
    """Whether policy ``name`` draws BudgetMix budgets: the raw ``record``'s ``counterparts``
    say so for one compared with its counterpart; else its name (module docstring)."""
    return name in (record or {}).get("counterparts", {}) or BUDGETMIX in name.lower()


def counterparts(record: Mapping[str, Any]) -> dict[str, str]:
    """``{BudgetMix policy: counterpart}`` of a raw record (its header; from the policies'
    names for a record without one)."""
    if "counterparts" in record:
        return dict(record["counterparts"])
    return budgetmix_counterparts(record["policies"])


def budgetmix_counterparts(names: Sequence[str]) -> dict[str, str]:
    """``{BudgetMix policy: its full-budget counterpart}`` for the BudgetMix names whose
    counterpart is among ``names`` (see the module docstring)."""
    out = {}
    for name in names:
        if not is_budgetmix(name):
            continue
        whole = re.sub(BUDGETMIX, " ", name, flags=re.IGNORECASE)
        after = re.split(BUDGETMIX, name, maxsplit=1, flags=re.IGNORECASE)[1]
        for rest in (whole, after):  # "Adaptive BudgetMix GRPO": "Adaptive GRPO", then "GRPO"
            rest = re.sub(r"[\s_\-+/]+", " ", rest).strip() or DEFAULT_FULL_BUDGET
            match = [
                n for n in names if n != name and not is_budgetmix(n) and n.lower() == rest.lower()
            ]
            if match:
                out[name] = match[0]
                break
    return out


# ---------------------------------------------------------------- budget counts


def budget_counts(
    record: Mapping[str, Any], policy: str
) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """``{T: (n [tasks], c [tasks])}`` of ``policy`` from a raw ``table`` record."""
    try:
        by_budget = record["counts"][policy]
    except KeyError:
        raise ValueError(f"raw table results: no counts for policy {policy!r}") from None
    return {
        int(b): (np.asarray(v["n"], np.int64), np.asarray(v["c"], np.int64))
        for b, v in by_budget.items()
    }


def table1_from_record(record: Mapping[str, Any]) -> dict[str, dict[int, float]]:
    """Table 1 of a raw ``table`` record: ``{policy: {T: Pass@(k, T)}}`` at its levels."""
    counts = {p: budget_counts(record, p) for p in record["policies"]}
    return passk.pass_at_k_table(counts, [int(t) for t in record["levels"]], int(record["k"]))


def table1_from_results(path_or_out: str | Path) -> dict[str, dict[int, float]]:
    """Table 1 recomputed from the saved counts alone: ``{policy: {T: Pass@(k, T)}}`` at the
    25/50/75/100% levels of ``T_max``, for every policy in order (``path_or_out``: the raw
    ``table`` JSON or a results folder)."""
    record = load_raw(path_or_out, "table")
    if record is None:
        raise ValueError(f"{path_or_out}: no raw table results ({RAW_DIR}/table.json)")
    return table1_from_record(record)


def per_task_pass(record: Mapping[str, Any], policy: str, budget: int) -> np.ndarray:
    """``[tasks]`` unbiased pass@k of each task at ``budget`` (k of the record)."""
    n, c = budget_counts(record, policy)[int(budget)]
    return passk.pass_at_k(n, c, int(record["k"]))


def mean_ci_from_json(value: Mapping[str, Any]) -> stats.MeanCI:
    """A :class:`stats.MeanCI` read back from JSON (where NaN was written as null)."""
    return stats.MeanCI(**{k: math.nan if v is None else v for k, v in value.items()})


def presentation_counts(record: Mapping[str, Any]) -> dict[str, dict[str, dict[int, tuple]]]:
    """``{presentation: {policy: {T: (n, c)}}}`` from a raw ``presentation`` record."""
    return {
        mode: {
            policy: {
                int(b): (np.asarray(v["n"], np.int64), np.asarray(v["c"], np.int64))
                for b, v in by_budget.items()
            }
            for policy, by_budget in by_policy.items()
        }
        for mode, by_policy in record["counts"].items()
    }


def splice_successes(record: Mapping[str, Any]) -> tuple:
    """The arguments of :func:`agentrl_jax.evaluation.analyses.splice.compute` from a raw
    ``splice`` record: ``(alone, spliced, base, t_max, turns)``."""
    alone = {p: np.asarray(v, bool) for p, v in record["alone"].items()}
    spliced = {
        label: {float(d): np.asarray(v, bool) for d, v in by_depth.items()}
        for label, by_depth in record["spliced"].items()
    }
    return alone, spliced, record["base"], int(record["t_max"]), list(record["turns"])


def erosion_sums(record: Mapping[str, Any]) -> tuple:
    """The arguments of :func:`agentrl_jax.evaluation.analyses.erosion.compute_tokens` from a
    raw ``erosion`` record: ``(entropy, logp_change, counts)``."""

    def by_step(value: Mapping[str, Any]) -> dict:
        return {
            run: {int(step): np.asarray(x, np.float64) for step, x in steps.items()}
            for run, steps in value.items()
        }

    return (
        by_step(record["entropy"]),
        by_step(record["logp_change"]),
        np.asarray(record["counts"], np.float64),
    )
