"""Where a run's metrics go: one JSON object per step in ``metrics.jsonl`` (the record of truth,
:class:`MetricsLogger`), and optionally TensorBoard scalars and Weights & Biases
(:class:`WandbSink`). The loop (:mod:`agentrl_jax.train.loop`) hands every step's record to a
logger; nothing here runs jax.

On resume, ``metrics.jsonl`` keeps every line up to the restored step; records of later steps
(logged after the last checkpoint by a run that was killed, and computed again now) move to
``metrics.jsonl.superseded``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np


def tensorboard_available() -> bool:
    """Whether :func:`tensorboard_writer` can make a writer (without importing anything)."""
    found = lambda name: importlib.util.find_spec(name) is not None  # noqa: E731
    return found("tensorboardX") or (found("torch") and found("tensorboard"))


class WandbSink:
    """Each step's record to a Weights & Biases run in ``project`` (``wandb.log(record,
    step=step)``; a metric with one value per update is logged as their mean). The run is
    named ``name`` and resumes (``resume="allow"``) under an id derived from ``directory``,
    where W&B keeps its files; steps a resumed run logs again are ignored by W&B (its steps
    only grow), so ``metrics.jsonl`` stays the record of truth."""

    def __init__(
        self,
        project: str,
        *,
        name: str,
        directory: str | Path,
        config: Mapping[str, Any] | None = None,
    ):
        import wandb  # optional: only when asked for

        directory = Path(directory)
        run_id = hashlib.sha1(str(directory.resolve()).encode()).hexdigest()[:16]
        self.run = wandb.init(
            project=project,
            name=name,
            dir=str(directory),
            id=run_id,
            resume="allow",
            config=dict(config or {}),
        )

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        values = {}
        for name, value in metrics.items():
            number = (
                _json_number(float(np.mean(value)))
                if isinstance(value, (list, tuple))
                else _json_number(value)
            )
            if number is not None:
                values[name] = number
        self.run.log(values, step=int(step))

    def close(self) -> None:
        self.run.finish()


def tensorboard_writer(logdir: str | Path):
    """A TensorBoard ``SummaryWriter`` from tensorboardX or torch, or None if neither works."""
    for module in ("tensorboardX", "torch.utils.tensorboard"):
        try:
            return __import__(module, fromlist=["SummaryWriter"]).SummaryWriter(str(logdir))
        except ImportError:
            continue
    return None


SUPERSEDED_SUFFIX = ".superseded"


class MetricsLogger:
    """Writes one JSON object per step to ``path`` (and scalars to a TensorBoard writer).

    ``resume_step``: the step the run resumes from (its restored checkpoint's; 0 when it starts
    over). Every line of the file up to that step is kept as it is, never rewritten or lost.
    Records of *later* steps were written by a run killed after its last checkpoint; the
    resumed run computes those steps again (bit for bit, resume is exact) and logs them anew,
    so they leave ``path`` (a file with each step once is what the readers and the training
    curves need) and are appended to ``<path>.superseded``, where nothing is lost either. So
    is a last line cut short by the kill. The file is replaced atomically (a kill during the
    rewrite leaves the old file or the new one, never a truncated one), and not touched at all
    when nothing follows ``resume_step``. ``superseded`` counts the lines moved. ``writer`` is
    any object with ``add_scalar(tag, value, step)`` (and optionally ``flush``/``close``);
    by default one is made in ``tensorboard_dir`` if TensorBoard is installed. ``sinks``:
    objects with ``log(step, metrics)`` and ``close()`` getting every record too (e.g.
    :class:`WandbSink`).
    """

    def __init__(
        self,
        path: str | Path | None,
        *,
        tensorboard_dir: str | Path | None = None,
        resume_step: int | None = None,
        writer: Any = None,
        sinks: Sequence[Any] = (),
    ):
        self.path = None if path is None else Path(path)
        self.sinks = tuple(sinks)
        self.superseded = 0
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resume_step is not None and self.path.exists():
                self.superseded = _supersede_after(self.path, resume_step)
        self.writer = writer
        if writer is None and tensorboard_dir is not None:
            self.writer = tensorboard_writer(tensorboard_dir)
            if self.writer is None:
                warnings.warn(
                    "TensorBoard logging asked for but neither tensorboardX nor tensorboard is "
                    "installed; writing JSONL only",
                    stacklevel=2,
                )

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """One record: numbers, and lists of numbers (one per update of the step, see the
        module docstring). TensorBoard gets a list's value ``i`` at update
        ``(step - 1) x len + i + 1``."""
        record = {"step": int(step), **{k: _json_value(v) for k, v in metrics.items()}}
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for name, value in metrics.items():
                if isinstance(value, (list, tuple)):
                    for i, v in enumerate(value):
                        self.writer.add_scalar(name, float(v), (int(step) - 1) * len(value) + i + 1)
                else:
                    self.writer.add_scalar(name, float(value), int(step))
            if hasattr(self.writer, "flush"):
                self.writer.flush()
        for sink in self.sinks:
            sink.log(int(step), metrics)

    def close(self) -> None:
        if self.writer is not None and hasattr(self.writer, "close"):
            self.writer.close()
        for sink in self.sinks:
            sink.close()


def _json_number(v: Any) -> float | None:
    v = float(v)
    return v if math.isfinite(v) else None  # JSON has no NaN; null marks a non-finite value


def _json_value(v: Any) -> float | list[float | None] | None:
    return [_json_number(x) for x in v] if isinstance(v, (list, tuple)) else _json_number(v)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics JSONL file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def split_after_step(text: str, step: int) -> tuple[list[str], list[str]]:
    """``(kept, later)``: the lines of a metrics JSONL text that stay, and those that go.

    A line goes if it is a record of a step after ``step``, or the last line and unterminated
    (cut by a kill, so not a whole record). Everything else stays, in order: records up to
    ``step`` and any line that is not a record. Pure.
    """
    lines = text.split("\n")
    complete, cut = lines[:-1], lines[-1]  # cut == "" when the text ends with a newline
    kept, later = [], []
    for line in complete:
        (later if _step_of(line) > step else kept).append(line)
    if cut:
        later.append(cut)
    return kept, later


def _step_of(line: str) -> float:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return -math.inf
    value = record.get("step") if isinstance(record, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else -math.inf


def _supersede_after(path: Path, step: int) -> int:
    """Move the lines of ``path`` past ``step`` to ``<path>.superseded`` (see MetricsLogger)."""
    text = path.read_bytes().decode("utf-8", "surrogateescape")  # any byte survives the round trip
    kept, later = split_after_step(text, step)
    if not later:
        return 0
    with open(f"{path}{SUPERSEDED_SUFFIX}", "a", encoding="utf-8", errors="surrogateescape") as f:
        # first, so a kill from here on loses nothing
        f.write("".join(f"{line}\n" for line in later))
        f.flush()
        os.fsync(f.fileno())
    tmp = path.with_name(f"{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write("".join(f"{line}\n" for line in kept))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(later)
