"""Results folders: JSON + CSV per analysis, figures, and a Markdown report (side effects).

Layout of a results folder::

    <folder>/<analysis>.json        numbers of one analysis (NaN / inf written as null)
    <folder>/<analysis>.csv         the same in a flat table (one or more CSVs)
    <folder>/figures/<analysis>.png and .pdf
    <folder>/report.md              short report embedding the PNGs and linking the rest

Each ``write_*`` analysis takes the arrays the rollout-driven code produces, computes the
statistics with :mod:`passk` / :mod:`stats`, draws with :mod:`figures`, writes its files,
and returns a :class:`Section`; :func:`write_report` turns sections into ``report.md``.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from agentrl_jax.evaluation import figures, passk, stats
from agentrl_jax.evaluation.dynamics import start_to_end
from agentrl_jax.evaluation.html import write_html

FIGURES_DIR = "figures"
REPORT_NAME = "report.md"


@dataclasses.dataclass(frozen=True)
class Section:
    """One analysis in the report. Paths are relative to the results folder."""

    title: str
    text: str = ""
    figures: tuple[str, ...] = ()  # PNG paths; the PDF sibling is linked too
    files: tuple[str, ...] = ()  # JSON / CSV paths
    markdown: str = ""  # e.g. a table, inserted verbatim


# ---------------------------------------------------------------- plain writers


def to_jsonable(obj: Any) -> Any:
    """Plain JSON types from results: numpy arrays/scalars, result records (``to_dict``),
    dataclasses, mappings, sequences, Paths. Non-finite floats become ``None`` (JSON has
    no NaN)."""
    if hasattr(obj, "to_dict") and callable(obj.to_dict):
        return to_jsonable(obj.to_dict())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable(dataclasses.asdict(obj))
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, np.ndarray):
        return to_jsonable(obj.tolist())
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    if obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"to_jsonable: cannot write {type(obj).__name__} as JSON")


def write_json(path: str | Path, obj: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_jsonable(obj), indent=2, allow_nan=False) + "\n")
    return path


def write_csv(path: str | Path, columns: Mapping[str, Sequence[Any]]) -> Path:
    """Write equal-length columns ``{header: values [R]}`` as a CSV with a header row."""
    lengths = {name: len(values) for name, values in columns.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"write_csv {path}: columns differ in length: {lengths}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(list(columns))
        for row in zip(*(to_jsonable(list(v)) for v in columns.values())):
            writer.writerow(["" if cell is None else cell for cell in row])
    return path


SECTIONS_DIR = "sections"  # <folder>/sections/<analysis>.json: an analysis' report sections


def write_sections(folder: str | Path, analysis: str, sections: Sequence[Section]) -> Path:
    """``folder/sections/<analysis>.json``: the sections an analysis contributes to a report."""
    return write_json(Path(folder) / SECTIONS_DIR / f"{analysis}.json",
                      {"analysis": analysis, "sections": [dataclasses.asdict(s) for s in sections]})


def read_sections(path: str | Path) -> tuple[str, list[Section]]:
    """``(analysis, sections)`` of a file :func:`write_sections` wrote; ``ValueError`` naming the
    file when it is not such a record."""
    path = Path(path)
    try:
        record = json.loads(path.read_text())
        sections = [Section(**{k: tuple(v) if isinstance(v, list) else v for k, v in s.items()})
                    for s in record["sections"]]
        return record["analysis"], sections
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a section record ({error})") from None


def read_training_log(
    path: str | Path, keys: Sequence[str] = ("R_multi", "R_single"), step_key: str = "step"
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Read the trainer's JSONL metrics log: ``(steps [S], {key: values [S]})``.

    Lines without ``step_key`` or without any of ``keys`` are skipped (other metric
    records share the file); a key missing on a kept line is NaN. Blank lines are ignored.

    Raises:
      ValueError: naming the file and line for malformed JSON, or when no line has data.
    """
    path = Path(path)
    steps: list[float] = []
    values: dict[str, list[float]] = {k: [] for k in keys}
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({err.msg})") from None
            if not isinstance(record, dict) or step_key not in record:
                continue
            if not any(k in record for k in keys):
                continue
            try:
                step = float(record[step_key])
                row = [float("nan") if record.get(k) is None else float(record[k]) for k in keys]
            except (TypeError, ValueError):
                raise ValueError(
                    f"{path}:{line_no}: {step_key!r} or {list(keys)} is not a number"
                ) from None
            steps.append(step)
            for k, v in zip(keys, row):
                values[k].append(v)
    if not steps:
        raise ValueError(f"{path}: no line has {step_key!r} and any of {list(keys)}")
    return np.asarray(steps), {k: np.asarray(v) for k, v in values.items()}


def _rel(folder: Path, path: Path) -> str:
    return path.relative_to(folder).as_posix()


def _figure_path(folder: Path, name: str) -> Path:
    return folder / FIGURES_DIR / name


# ---------------------------------------------------------------- analyses (§3)


def write_pass_at_k(
    folder: str | Path,
    counts_by_policy: Mapping[str, tuple[Any, Any]],
    ks: Sequence[int] = passk.PASS_AT_K_RANGE,
    name: str = "pass_at_k",
) -> Section:
    """Pass@K curves at full budget.

    Args:
      counts_by_policy: ``{policy: (n [tasks], c [tasks])}``; ``ks`` above a policy's
        smallest ``n`` are dropped for that policy (recorded in the JSON).
    """
    folder = Path(folder)
    curves, dropped = {}, {}
    for policy, (n, c) in counts_by_policy.items():
        n_min = int(np.min(n))
        usable = [k for k in ks if k <= n_min]
        if not usable:
            raise ValueError(
                f"write_pass_at_k: policy {policy!r} has n={n_min} samples, fewer than every k"
            )
        dropped[policy] = [k for k in ks if k > n_min]
        curves[policy] = (np.asarray(usable), passk.pass_at_k_curve(n, c, usable))
    json_path = write_json(
        folder / f"{name}.json",
        {
            "curves": {p: {"k": k, "pass_at_k": v} for p, (k, v) in curves.items()},
            "k_dropped_for_too_few_samples": dropped,
        },
    )
    all_k = sorted({int(k) for k_arr, _ in curves.values() for k in k_arr})
    columns: dict[str, list] = {"k": all_k}
    for policy, (k_arr, values) in curves.items():
        lookup = dict(zip(k_arr.tolist(), values.tolist()))
        columns[policy] = [lookup.get(k) for k in all_k]
    csv_path = write_csv(folder / f"{name}.csv", columns)
    png, _ = figures.plot_pass_at_k(curves, _figure_path(folder, name))
    summary = ", ".join(
        f"{p}: pass@1 {v[0]:.3f}, pass@{int(k[-1])} {v[-1]:.3f}" for p, (k, v) in curves.items()
    )
    return Section(
        "Pass@K (full budget)",
        summary,
        (_rel(folder, png),),
        (_rel(folder, json_path), _rel(folder, csv_path)),
    )


def write_pass_at_t(
    folder: str | Path,
    results_by_policy: Mapping[str, passk.BudgetResults],
    *,
    k: int = passk.PASS_AT_T_K,
    t_max: int | None = None,
    shortest_paths: Any = None,
    name: str = "pass_at_t",
) -> list[Section]:
    """Pass@(k, T) curves with the structural bound, and Table 1 at the budget levels.

    Args:
      results_by_policy: ``{policy: {T: (n [tasks], c [tasks])}}``, each T sampled afresh.
      t_max: when given, Table 1 is written for ``passk.budget_levels(t_max)`` (every policy
        must have results at those budgets).
      shortest_paths: optional ``[tasks]`` fewest turns each task needs, for the bound
        (FrozenLake: the shortest start-to-goal path; BFCL: the annotated trajectory).
    """
    folder = Path(folder)
    curves = {p: passk.pass_at_t_curve(r, k) for p, r in results_by_policy.items()}
    record: dict[str, Any] = {
        "k": k,
        "curves": {p: {"budget": b, "pass": v} for p, (b, v) in curves.items()},
    }
    budgets = sorted({int(b) for b_arr, _ in curves.values() for b in b_arr})
    bound = None
    if shortest_paths is not None:
        # Every integer budget up to the largest one, so the bound plots as a full step curve.
        bound_budgets = np.arange(1, max(budgets + [t_max or 0]) + 1)
        bound = (bound_budgets, passk.structural_upper_bound(shortest_paths, bound_budgets))
        record["structural_bound"] = {"budget": bound[0], "share_solvable": bound[1]}
    json_path = write_json(folder / f"{name}.json", record)
    columns: dict[str, list] = {"budget": budgets}
    for policy, (b_arr, values) in curves.items():
        lookup = dict(zip(b_arr.tolist(), values.tolist()))
        columns[policy] = [lookup.get(b) for b in budgets]
    if bound is not None:
        lookup = dict(zip(bound[0].tolist(), bound[1].tolist()))
        columns["structural_bound"] = [lookup[b] for b in budgets]
    csv_path = write_csv(folder / f"{name}.csv", columns)
    png, _ = figures.plot_pass_at_t(
        curves, _figure_path(folder, name), bound=bound, k=k, t_max=t_max
    )
    sections = [
        Section(
            f"Pass@T at k = {k}",
            "Each budget sampled afresh with its own budget in the prompt.",
            (_rel(folder, png),),
            (_rel(folder, json_path), _rel(folder, csv_path)),
        )
    ]
    if t_max is not None:
        levels = passk.budget_levels(t_max)
        table = passk.pass_at_k_table(results_by_policy, levels, k)
        table_name = f"{name}_table"
        table_json = write_json(
            folder / f"{table_name}.json",
            {"k": k, "t_max": t_max, "budgets": levels, "table": table},
        )
        table_csv = folder / f"{table_name}.csv"
        labels = figures.budget_level_labels(t_max)
        table_csv.write_text(figures.budget_table_csv(table, labels=labels))
        table_png, _ = figures.plot_budget_table(
            table, _figure_path(folder, table_name), k=k, labels=labels
        )
        sections.append(
            Section(
                f"Pass@{k} at 25/50/75/100% of T_max = {t_max} (Table 1)",
                "Budgets are (p * T_max) // 100.",
                (_rel(folder, table_png),),
                (_rel(folder, table_json), _rel(folder, table_csv)),
                figures.budget_table_markdown(table, k=k, labels=labels),
            )
        )
    return sections


# ---------------------------------------------------------------- analyses (§7)


def write_step_quality(
    folder: str | Path,
    pools: Mapping[str, tuple[Any, Any]],
    *,
    name: str = "step_quality",
    policy_names: tuple[str, str] = ("base", "RL"),
    method: str = "normal",
    title: str = "Step-level action quality",
) -> Section:
    """Per-state action quality of RL vs base on state pools (matched states, error states).

    Args:
      pools: ``{pool: (q_base [S], q_rl [S])}``, per-state mean quality over G actions.
      title: the section's and the figure's title (name the states and the policies: the
        matched-state and error-state figures must not look alike).
    """
    folder = Path(folder)
    comparisons = {
        pool: stats.paired_comparison(q_rl, q_base, method=method)
        for pool, (q_base, q_rl) in pools.items()
    }
    json_path = write_json(folder / f"{name}.json", comparisons)
    files = [_rel(folder, json_path)]
    base_name, rl_name = policy_names
    for pool, (q_base, q_rl) in pools.items():
        csv_path = write_csv(
            folder / f"{name}_{pool}.csv",
            {
                "state": list(range(len(q_base))),
                f"q_{base_name}": list(q_base),
                f"q_{rl_name}": list(q_rl),
            },
        )
        files.append(_rel(folder, csv_path))
    png, _ = figures.plot_step_quality(pools, _figure_path(folder, name), policy_names=policy_names,
                                       title=title)
    text = "; ".join(
        f"{pool}: {rl_name} better on {100 * c.share_rl_better:.1f}% of {c.n} states "
        f"(ties {100 * c.share_tie:.1f}%), mean diff {c.mean_diff.mean:+.4f} "
        f"[{c.mean_diff.low:+.4f}, {c.mean_diff.high:+.4f}]"
        for pool, c in comparisons.items()
    )
    return Section(title, text, (_rel(folder, png),), tuple(files))


def write_continuation(
    folder: str | Path,
    successes: Mapping[str, Any],
    *,
    name: str = "continuation",
    method: str = "wilson",
    title: str = "Continuation from error states",
) -> Section:
    """Success rate of each policy continuing from the same error states.

    Args:
      successes: ``{policy: [E] bool}`` (or ``[E, G]`` for G continuations per state;
        flattened, so the CI then treats continuations as independent).
      method: CI method of ``stats.mean_ci``; Wilson by default (a rate in [0, 1]).
    """
    folder = Path(folder)
    rates = {
        p: stats.mean_ci(np.asarray(s, dtype=np.float64), method=method)
        for p, s in successes.items()
    }
    json_path = write_json(folder / f"{name}.json", rates)
    csv_path = write_csv(
        folder / f"{name}.csv",
        {
            "policy": list(rates),
            "success_rate": [r.mean for r in rates.values()],
            "ci_low": [r.low for r in rates.values()],
            "ci_high": [r.high for r in rates.values()],
            "n": [r.n for r in rates.values()],
        },
    )
    png, _ = figures.plot_rates_with_ci(rates, _figure_path(folder, name), title=title)
    text = "; ".join(
        f"{p}: {r.mean:.3f} [{r.low:.3f}, {r.high:.3f}] (n={r.n})" for p, r in rates.items()
    )
    return Section(
        title,
        text,
        (_rel(folder, png),),
        (_rel(folder, json_path), _rel(folder, csv_path)),
    )


def write_quality_vs_depth(
    folder: str | Path,
    depth: Any,
    quality: Mapping[str, Any],
    *,
    bins: int = 10,
    seed: int = 0,
    name: str = "quality_vs_depth",
) -> Section:
    """Quality against normalised depth with 95% bootstrap bands.

    Args:
      depth: ``[N]`` normalised depth t / T_max of each state (``stats.normalised_depth``).
      quality: ``{label: [N]}``, e.g. ``{"base": ..., "RL": ..., "RL - base": ...}``.
    """
    folder = Path(folder)
    curves = {
        label: stats.binned_curve(depth, q, bins=bins, seed=seed) for label, q in quality.items()
    }
    json_path = write_json(folder / f"{name}.json", curves)
    first = next(iter(curves.values()))
    columns: dict[str, list] = {
        "bin_low": first.edges[:-1].tolist(),
        "bin_high": first.edges[1:].tolist(),
    }
    for label, curve in curves.items():
        columns[f"{label}_mean"] = curve.mean.tolist()
        columns[f"{label}_ci_low"] = curve.low.tolist()
        columns[f"{label}_ci_high"] = curve.high.tolist()
        columns[f"{label}_count"] = curve.count.tolist()
    csv_path = write_csv(folder / f"{name}.csv", columns)
    png, _ = figures.plot_quality_vs_depth(curves, _figure_path(folder, name))
    return Section(
        "Action quality vs normalised depth",
        "Bands: 95% percentile bootstrap per bin.",
        (_rel(folder, png),),
        (_rel(folder, json_path), _rel(folder, csv_path)),
    )


def write_likelihood(
    folder: str | Path,
    action_nll: Mapping[str, Any],
    llr_sets: Mapping[str, tuple[Any, Any, Any, Any]],
    *,
    match_length: int | None = None,
    name: str = "likelihood",
) -> Section:
    """ActionNLL under the base policy and cumulative LLR split by success.

    Args:
      action_nll: ``{label: nll [M]}`` of valid responses, e.g. base's and RL's own.
      llr_sets: ``{label: (logp_rl [N, T], logp_base [N, T], turn_mask [N, T], success [N])}``
        per-turn response log-probs of one policy's trajectories under both policies.
      match_length: L of the length-matched LLR (default: see ``stats.length_matched_llr``).
    """
    folder = Path(folder)
    record: dict[str, Any] = {
        "action_nll": {k: stats.action_nll_summary(v) for k, v in action_nll.items()}
    }
    labels = list(action_nll)
    if len(labels) == 2:
        record["action_nll_overlap"] = stats.histogram_overlap(
            action_nll[labels[0]], action_nll[labels[1]]
        )
    plot_sets, llr_record = {}, {}
    for label, (logp_rl, logp_base, mask, success) in llr_sets.items():
        cum = stats.cumulative_llr(logp_rl, logp_base, mask)
        ok = np.asarray(success, dtype=bool)
        llr_record[label] = {
            "by_outcome": stats.llr_by_outcome(cum, mask, ok),
            "length_matched": stats.length_matched_llr(
                cum, mask, {"success": ok, "failure": ~ok}, match_length
            ),
        }
        plot_sets[label] = (cum, mask, ok)
    record["cumulative_llr"] = llr_record
    json_path = write_json(folder / f"{name}.json", record)
    nll_csv = write_csv(
        folder / f"{name}_action_nll.csv",
        {
            "source": [k for k, v in action_nll.items() for _ in np.ravel(v)],
            "nll": [float(x) for v in action_nll.values() for x in np.ravel(v)],
        },
    )
    rows: dict[str, list] = {
        "set": [],
        "outcome": [],
        "final_llr_mean": [],
        "ci_low": [],
        "ci_high": [],
        "n": [],
        "matched_length": [],
        "matched_llr_mean": [],
        "matched_n": [],
    }
    for label, rec in llr_record.items():
        for outcome in ("success", "failure"):
            final = rec["by_outcome"][outcome]["final"]
            matched = rec["length_matched"]["groups"][outcome]
            for key, value in (
                ("set", label),
                ("outcome", outcome),
                ("final_llr_mean", final.mean),
                ("ci_low", final.low),
                ("ci_high", final.high),
                ("n", final.n),
                ("matched_length", rec["length_matched"]["length"]),
                ("matched_llr_mean", matched.mean),
                ("matched_n", matched.n),
            ):
                rows[key].append(value)
    llr_csv = write_csv(folder / f"{name}_llr.csv", rows)
    pngs = [figures.plot_action_nll_hist(action_nll, _figure_path(folder, f"{name}_action_nll"))[0]]
    if plot_sets:
        pngs.append(
            figures.plot_cumulative_llr(plot_sets, _figure_path(folder, f"{name}_cumulative_llr"))[
                0
            ]
        )
    text = "; ".join(
        f"ActionNLL {k}: mean {s.mean.mean:.2f}" for k, s in record["action_nll"].items()
    )
    if "action_nll_overlap" in record:
        text += f"; histogram overlap {record['action_nll_overlap']:.2f}"
    return Section(
        "Likelihood: ActionNLL and cumulative LLR",
        text,
        tuple(_rel(folder, p) for p in pngs),
        (_rel(folder, json_path), _rel(folder, nll_csv), _rel(folder, llr_csv)),
    )


def change_text(change: Mapping[str, Any]) -> str:
    """A :func:`~agentrl_jax.evaluation.dynamics.start_to_end` result as text: ``0.293 ->
    0.277: -0.016 [-0.08, +0.05] (means of the first and last 4 logged steps)``."""
    if change["change"] is None:
        return "n/a" if change["start"] is None else f"{change['start']:.3f} (one logged step)"
    ci = change["change"]
    interval = "" if not np.isfinite(ci.low) else f" [{ci.low:+.3f}, {ci.high:+.3f}]"
    w = change["window"]
    return (f"{change['start']:.3f} -> {change['end']:.3f}: {ci.mean:+.3f}{interval} "
            f"(means of the first and last {w} logged step{'s' if w > 1 else ''})")


def write_training_dynamics(
    folder: str | Path,
    log_path: str | Path,
    keys: Sequence[str] = ("R_multi", "R_single"),
    step_key: str = "step",
    name: str = "training_dynamics",
    run: str | None = None,
) -> Section:
    """R_multi and R_single (or any logged keys) over training, from the trainer's JSONL log,
    with each curve's start-to-end change (:func:`~agentrl_jax.evaluation.dynamics.
    start_to_end`: one computation for the text, the figure and the JSON). ``run`` names the
    run in the figure's title and the section (default: the log's folder)."""
    folder = Path(folder)
    run = run or Path(log_path).parent.name or str(log_path)
    steps, series = read_training_log(log_path, keys, step_key)
    change = {k: start_to_end(v) for k, v in series.items()}
    json_path = write_json(
        folder / f"{name}.json",
        {"log": str(log_path), "run": run, "step": steps, "series": series,
         "change_start_to_end": change},
    )
    csv_path = write_csv(
        folder / f"{name}.csv",
        {step_key: steps.tolist(), **{k: v.tolist() for k, v in series.items()}},
    )
    png, _ = figures.plot_training_dynamics(steps, series, _figure_path(folder, name),
                                            title=f"Training dynamics: {run}", changes=change)
    text = "; ".join(f"{k}: {change_text(c)}" for k, c in change.items())
    return Section(
        f"Training dynamics: {run}",
        text,
        (_rel(folder, png),),
        (_rel(folder, json_path), _rel(folder, csv_path)),
    )


# ---------------------------------------------------------------- the report


def write_report(
    folder: str | Path,
    sections: Iterable[Section],
    title: str = "Evaluation report",
    preamble: str = "",
    first: str | None = None,
) -> Path:
    """Write ``report.md`` embedding each section's PNGs and linking its PDFs and data files,
    and ``report.html`` beside it, the same sections as one page (:mod:`agentrl_jax.evaluation.
    html`; ``first``: the title of the section it shows first).

    ``preamble``: Markdown inserted verbatim between the title and the first section (e.g. a
    description of the run).

    Raises:
      FileNotFoundError: when a section names a file that is not in the folder, so a report
        never carries a broken link.
    """
    folder = Path(folder)
    sections = list(sections)
    lines = [f"# {title}", ""]
    if preamble.strip():
        lines += [preamble.strip("\n"), ""]
    for section in sections:
        linked = list(section.figures) + [str(Path(p).with_suffix(".pdf")) for p in section.figures]
        linked += list(section.files)
        for rel in linked:
            if Path(rel).is_absolute() or not (folder / rel).is_file():
                raise FileNotFoundError(
                    f"write_report: section {section.title!r} links {rel!r}, "
                    f"which is not a file under {folder}"
                )
        lines += [f"## {section.title}", ""]
        if section.text:
            lines += [section.text, ""]
        if section.markdown:
            lines += [section.markdown.rstrip("\n"), ""]
        for png in section.figures:
            stem = Path(png).stem
            lines += [
                f"![{stem}]({png})",
                "",
                f"[PDF]({Path(png).with_suffix('.pdf').as_posix()})",
                "",
            ]
        if section.files:
            lines += ["Data: " + " · ".join(f"[{Path(p).name}]({p})" for p in section.files), ""]
    path = folder / REPORT_NAME
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    write_html(folder, sections, title, preamble, first=first)
    return path
