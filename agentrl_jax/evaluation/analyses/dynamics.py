"""Training dynamics (PAPER.md §7.5, Figure 8): R_multi and R_single (or any logged keys) over
training, from the trainer's JSONL metrics log, and how each curve changed.

One computation, :func:`start_to_end`, serves every place the change is shown (the training
dynamics section and its figure, the reproduction's start-to-end table, the findings): the
mean of the last ``w`` logged values minus the mean of the first ``w`` (``w``:
:func:`change_window`), with a normal CI (:func:`stats.difference_of_means`).

``compute`` -> :class:`Dynamics` (:func:`from_log` reads the log first);
:func:`plot_training_dynamics` draws it; :func:`section` writes its files and report section.

The ``dynamics`` analysis (:data:`ANALYSIS`): R_multi and R_single over training from each
run's metrics log (it reads no policy); it checks the paper's "full-budget RL: R_multi rises
while R_single falls" and "BudgetMix keeps R_single".
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from matplotlib.ticker import MaxNLocator

from agentrl_jax.evaluation import figures, raw, stats
from agentrl_jax.evaluation.analyses.context import AnalysisRun
from agentrl_jax.evaluation.analyses.registry import Analysis, register
from agentrl_jax.evaluation.report import Section, figure_path, rel, write_csv, write_json
from agentrl_jax.evaluation.result import Result, result
from agentrl_jax.evaluation.verdicts import (
    BUDGETMIX_DYNAMICS,
    DEFAULT_FIGURES,
    FULL_BUDGET_DYNAMICS,
    Effect,
    Finding,
    PaperFigures,
    absent,
    effects_json,
    num,
    power,
    verdict,
)


def change_window(count: int) -> int:
    """Logged steps averaged at each end of a training curve: a tenth of them, at least 2
    when there are 4 or more (so the change has a CI), else 1."""
    if count < 1:
        raise ValueError("change_window: no logged values")
    return max(1, min(2, count // 2), count // 10)


@result
class Change(Result):
    """A curve's start-to-end change: the means of its first and last ``window`` logged values
    and their difference with its CI (``change``: None with fewer than 2 values; ``start`` and
    ``end`` None with none)."""

    window: int
    start: float | None
    end: float | None
    change: stats.MeanCI | None


def start_to_end(values: np.ndarray) -> Change:
    """Change of a training curve from its start to its end: the mean of the last ``w``
    logged (finite) values minus the mean of the first ``w`` (:func:`change_window`), with the
    CI of :func:`stats.difference_of_means`. Averaging a few steps at each end keeps one noisy batch
    from deciding the sign."""
    v = np.asarray(values, np.float64)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return Change(0, None, None, None)
    w = change_window(v.size)
    change = stats.difference_of_means(v[:w], v[-w:]) if v.size >= 2 else None
    return Change(w, float(v[:w].mean()), float(v[-w:].mean()), change)


def change_text(change: Change) -> str:
    """A :func:`start_to_end` result as text: ``0.293 -> 0.277: -0.016 [-0.08, +0.05] (means of
    the first and last 4 logged steps)``."""
    if change.change is None:
        return "n/a" if change.start is None else f"{change.start:.3f} (one logged step)"
    ci = change.change
    interval = "" if not np.isfinite(ci.low) else f" [{ci.low:+.3f}, {ci.high:+.3f}]"
    w = change.window
    return (
        f"{change.start:.3f} -> {change.end:.3f}: {ci.mean:+.3f}{interval} "
        f"(means of the first and last {w} logged step{'s' if w > 1 else ''})"
    )


# ---------------------------------------------------------------- the analysis


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


@result
class Dynamics(Result):
    """One run's logged curves: ``step [S]``, ``series {key: [S]}`` (NaN where not logged),
    each curve's :class:`Change`; ``log`` and ``run`` name where they came from."""

    log: str
    run: str
    step_key: str
    step: np.ndarray
    series: dict[str, np.ndarray]
    change: dict[str, Change]


def compute(
    steps, series: Mapping[str, np.ndarray], *, log: str = "", run: str = "", step_key: str = "step"
) -> Dynamics:
    """The start-to-end change of each of ``series`` (``{key: [S]}`` against ``steps [S]``)."""
    arrays = {k: np.asarray(v, np.float64) for k, v in series.items()}
    return Dynamics(
        log,
        run,
        step_key,
        np.asarray(steps, np.float64),
        arrays,
        {k: start_to_end(v) for k, v in arrays.items()},
    )


def from_log(
    log_path: str | Path,
    keys: Sequence[str] = ("R_multi", "R_single"),
    step_key: str = "step",
    run: str | None = None,
) -> Dynamics:
    """:func:`compute` of a metrics log (:func:`read_training_log`); ``run`` names the run
    (default: the log's folder)."""
    steps, series = read_training_log(log_path, keys, step_key)
    return compute(
        steps,
        series,
        log=str(log_path),
        step_key=step_key,
        run=run or Path(log_path).parent.name or str(log_path),
    )


def plot_training_dynamics(
    steps: Sequence[float],
    series: Mapping[str, Sequence[float]],
    out_path: str | Path,
    *,
    title: str = "Training dynamics",
    changes: Mapping[str, Change] | None = None,
) -> tuple[Path, Path]:
    """One panel per logged series against the training step (Figure 8 style).

    Args:
      steps: ``[S]`` training steps.
      series: ``{name: [S] values}``, e.g. ``{"R_multi": ..., "R_single": ...}``; NaN entries
        (steps where a value was not logged) are skipped.
      changes: ``{name: start_to_end(values)}`` (the default computes it): each panel's title
        states it and the start and end means are drawn over the first and last ``window``
        logged steps, so the figure says what the report's text and tables say.
    """
    figures.nonempty("plot_training_dynamics", series)
    x = np.asarray(steps, dtype=np.float64)
    fig, axes = figures.new_figure(nrows=len(series), width=6.0, height=2.6)
    for ax, (name, values) in zip(axes[:, 0], series.items()):
        _, y = figures.xy(name, (x, values))
        keep = np.isfinite(y)
        ax.plot(x[keep], y[keep], marker=".", markersize=3)
        change = (changes or {}).get(name) or start_to_end(y)
        if change.change is not None:
            w, xs = change.window, x[keep]
            for span, level in ((xs[:w], change.start), (xs[-w:], change.end)):
                ax.hlines(level, span[0], span[-1], colors="C1", linewidth=2)
            ax.set_title(
                f"{name}: {change.start:.3f} -> {change.end:.3f} "
                f"({change.change.mean:+.3f}; means of the first and last {w})",
                fontsize=9,
            )
        ax.set(ylabel=name)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("training step")
    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(title)
    return figures.save_figure(fig, out_path)


def section(folder: str | Path, res: Dynamics, *, name: str = "training_dynamics") -> Section:
    """Write ``<name>.json``, ``<name>.csv`` and the figure; the section "Training dynamics:
    <run>" states each curve's change (one computation for the text, the figure and the
    JSON)."""
    folder = Path(folder)
    json_path = write_json(
        folder / f"{name}.json",
        {
            "log": res.log,
            "run": res.run,
            "step": res.step,
            "series": res.series,
            "change_start_to_end": res.change,
        },
    )
    csv_path = write_csv(
        folder / f"{name}.csv",
        {res.step_key: res.step.tolist(), **{k: v.tolist() for k, v in res.series.items()}},
    )
    png, _ = plot_training_dynamics(
        res.step,
        res.series,
        figure_path(folder, name),
        title=f"Training dynamics: {res.run}",
        changes=res.change,
    )
    text = "; ".join(f"{k}: {change_text(c)}" for k, c in res.change.items())
    return Section(
        f"Training dynamics: {res.run}",
        text,
        (rel(folder, png),),
        (rel(folder, json_path), rel(folder, csv_path)),
    )


# ---------------------------------------------------------------- the dynamics analysis


def _change(entry: Mapping[str, Any] | None) -> str:
    if not entry or entry.get("change") is None:
        return "n/a"
    c = raw.mean_ci_from_json(entry["change"])
    span = f"{entry['start']:.3f} -> {entry['end']:.3f}: {c.mean:+.3f}"
    return span + (f" [{c.low:+.3f}, {c.high:+.3f}]" if math.isfinite(c.low) else "")


def dynamics_markdown(record: Mapping[str, Any]) -> str:
    """One row per run: R_multi and R_single start -> end and the change with its CI."""
    lines = [
        "| run | steps | R_multi start -> end: change | R_single start -> end: change |",
        "|---|---|---|---|",
    ]
    for run, entry in record["runs"].items():
        change = entry["change"]
        steps = len(entry["step"])
        lines.append(
            f"| {run.replace('|', chr(92) + '|')} | {steps} | "
            f"{_change(change.get('R_multi'))} | {_change(change.get('R_single'))} |"
        )
    return "\n".join(lines) + "\n"


def _changes(entry: Mapping[str, Any]) -> dict[str, stats.MeanCI | None]:
    out = {}
    for key in ("R_multi", "R_single"):
        c = entry["change"].get(key)
        out[key] = None if not c or c.get("change") is None else raw.mean_ci_from_json(c["change"])
    return out


def check_dynamics(
    record: Mapping[str, Any], figures: PaperFigures = DEFAULT_FIGURES
) -> list[Finding]:
    """Full-budget runs: R_multi up and R_single down; BudgetMix runs: R_single kept (its
    change >= 0, inconclusive if negative with a CI reaching 0)."""
    out, changes = [], {run: _changes(entry) for run, entry in record["runs"].items()}
    for run, change in changes.items():
        multi, single = change["R_multi"], change["R_single"]
        if raw.is_budgetmix(run, record):
            if single is None:
                out.append(
                    absent(BUDGETMIX_DYNAMICS, f"{run}: no R_single in its log", figures=figures)
                )
                continue
            full = record.get("counterparts", {}).get(run)
            versus = (
                f"; {full}: {num(changes[full]['R_single'])}"
                if full and changes[full]["R_single"] is not None
                else ""
            )
            kept = Effect("R_single", single, margin=figures.r_single, points=False)
            out.append(
                Finding(
                    BUDGETMIX_DYNAMICS,
                    run,
                    figures.text(BUDGETMIX_DYNAMICS),
                    f"R_single {num(single)}{versus}{power(kept)}",
                    verdict(kept),
                    {"R_single": single, "effects": effects_json(kept)},
                )
            )
            continue
        if multi is None or single is None:
            out.append(
                absent(
                    FULL_BUDGET_DYNAMICS,
                    f"{run}: R_multi and R_single need two logged values each",
                    figures=figures,
                )
            )
            continue
        effects = (
            Effect("R_multi", multi, size=figures.r_multi, points=False),
            Effect("R_single", single, direction=-1, size=figures.r_single, points=False),
        )
        out.append(
            Finding(
                FULL_BUDGET_DYNAMICS,
                run,
                figures.text(FULL_BUDGET_DYNAMICS),
                f"R_multi {num(multi)}, R_single {num(single)}{power(*effects)}",
                verdict(*effects),
                {"R_multi": multi, "R_single": single, "effects": effects_json(*effects)},
            )
        )
    return out


class TrainingDynamics(Analysis):
    """R_multi and R_single over training, from the runs' metrics logs."""

    name = "dynamics"
    unit_seconds = 0.5  # fit on the stored default run (reproduce.progress)
    needs_models = False  # the logs are all it reads
    findings_rank = 3  # the paper's order: after error recovery
    sources = {FULL_BUDGET_DYNAMICS: "Training dynamics", BUDGETMIX_DYNAMICS: "Training dynamics"}

    def units(self, settings: Any, num_tasks: int, policies: int, t_max: int) -> int:
        return 1

    def run(self, run: AnalysisRun) -> list[Section]:
        training_logs = run.training_logs
        if not training_logs:
            raise ValueError("dynamics: needs training_logs ({run name: metrics.jsonl})")
        runs, sections = {}, []
        for name, log in training_logs.items():
            if not Path(log).is_file():
                raise ValueError(f"dynamics: the metrics log of run {name!r}, {log}, is not a file")
            curves = from_log(log, run=name)
            sections.append(section(run.out, curves, name=f"training_dynamics_{raw.slug(name)}"))
            runs[name] = {
                "log": curves.log,
                "step": curves.step,
                "series": curves.series,
                "change": curves.change,
            }
        record = {
            "analysis": "dynamics",
            "runs": runs,
            "counterparts": run.counterparts_among(list(training_logs)),
        }
        path = write_json(raw.raw_path(run.out, "dynamics"), record)
        run.progress(1)
        paper = PaperFigures.load(run.out)
        summary = Section(
            "Training dynamics: start to end",
            "Change of each curve from the mean of its first w logged steps to the mean "
            "of its last w (w: a tenth of the steps, at least 2 from 4 steps on), with a "
            "95% normal CI treating the steps as independent. Paper: full-budget RL "
            f"{paper.text(FULL_BUDGET_DYNAMICS)}; BudgetMix "
            f"{paper.text(BUDGETMIX_DYNAMICS)}.",
            files=(path.relative_to(run.out).as_posix(),),
            markdown=dynamics_markdown(raw.load_raw(path, "dynamics")),
        )
        return [summary] + sections

    def findings(self, records: Mapping[str, Any], paper: PaperFigures) -> list[Finding]:
        record = records.get("dynamics")
        found = check_dynamics(record, paper) if record is not None else []
        if not any(f.headline == FULL_BUDGET_DYNAMICS for f in found):
            found.append(
                absent(FULL_BUDGET_DYNAMICS, "no full-budget run's training log", figures=paper)
            )
        if not any(f.headline == BUDGETMIX_DYNAMICS for f in found):
            found.append(
                absent(BUDGETMIX_DYNAMICS, "no BudgetMix run's training log", figures=paper)
            )
        return found


ANALYSIS = register(TrainingDynamics())
