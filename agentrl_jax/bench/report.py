"""Timing and reporting shared by every benchmark.

Convention: a benchmark returns a list of :class:`BenchResult`, one per (metric, baseline)
pair, with ours and the baseline measured in the same run. ``ratio`` is always
"how many times better ours is": ours / baseline for throughput units (``.../s``), and
baseline / ours for time units (``s``, ``ms``).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from typing import Any, Callable, Sequence

TIME_UNITS = ("s", "ms", "us")


@dataclasses.dataclass(frozen=True)
class BenchResult:
    name: str  # what is measured, e.g. "env steps 8x8 slippery, 4096 envs"
    unit: str  # e.g. "steps/s" (higher is better) or "ms" (lower is better)
    ours: float
    baseline: float
    baseline_name: str  # e.g. "gymnasium SyncVectorEnv(64)"
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def ratio(self) -> float:
        if self.unit in TIME_UNITS:
            return self.baseline / self.ours if self.ours > 0 else float("inf")
        return self.ours / self.baseline if self.baseline > 0 else float("inf")

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["ratio"] = self.ratio
        return json.dumps(d, sort_keys=False)


def median_time(fn: Callable[[], Any], *, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall-clock seconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs.

    ``fn`` must block until its work is done (call ``jax.block_until_ready`` inside).
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fmt(x: float) -> str:
    if x == 0 or 1e-3 <= abs(x) < 1e7:
        return f"{x:,.4g}" if abs(x) < 1e4 else f"{x:,.0f}"
    return f"{x:.3e}"


def format_table(results: Sequence[BenchResult]) -> str:
    """A plain-text table for people."""
    header = ("benchmark", "unit", "ours", "baseline", "baseline value", "ratio (x better)")
    rows = [
        (r.name, r.unit, _fmt(r.ours), r.baseline_name, _fmt(r.baseline), f"{r.ratio:,.2f}x")
        for r in results
    ]
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    out = [line(header), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    return "\n".join(out)


def emit(results: Sequence[BenchResult], as_json: bool) -> None:
    """Print results: one JSON object per line with ``as_json``, else a table."""
    if as_json:
        for r in results:
            print(r.to_json(), flush=True)
    else:
        print(format_table(results), flush=True)
