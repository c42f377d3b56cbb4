"""``agentrl-jax bench rl-loop``: the default FrozenLake RL loop, synchronous against
asynchronous training (``rl.asynchronous.max_staleness`` 1 and 2), with environment steps that take
time.

Setting: the built-in default's FrozenLake task, policy size (random initialisation: no warm
start, so its answers are mostly invalid and episodes run from one turn to ``T_max``, the long
tail of a multi-turn batch) and RL settings (GRPO, 8 tasks x G 8 = 64 rows per update,
``T_max`` 12), for ``steps`` updates, whose environment also waits ``step_ms`` per live row of
each step over 8 workers (:class:`~agentrl_jax.bench.rollout.SlowSteps`, as the lanes
comparison of ``bench rollout``: a stand-in for a query or a sandboxed test run).

Devices: with ``split`` (the default) rollouts sample on a device of their own
(``mesh.rollout: 1``) and the updates train on the other; on a CPU, XLA's host platform is
split into two devices, one per core, so the two can run at once, as on two accelerators. The
synchronous loop (``max_staleness: 0``), the baseline of every row, runs on the same devices.

Each setting runs in a fresh process (its own compilations, none shared). turns/s: environment
turns played by the batches the updates trained on, over the loop's wall time from the end of
update ``warmup`` (compilation done) to the end of the last; updates/s the same way. ``ratio``:
against the synchronous row. Each row's settings also hold the order of the loop's first
events (``rollout j``: batch j sampled; ``update i``: dispatched; ``done i``: its results
waited for), the overlap without timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from agentrl_jax.bench.report import BenchResult

_SHORT = {"update_done": "done"}
SYNC = "the synchronous loop (max_staleness 0) on the same devices"


def measure(
    staleness: int,
    *,
    steps: int,
    warmup: int,
    step_ms: float,
    split: bool,
    out: Path,
    overrides: Sequence[str] = (),
) -> dict[str, Any]:
    """One setting in this process: the default FrozenLake RL loop with ``max_staleness`` =
    ``staleness`` (module docstring; ``overrides``: ``--set`` items over it, e.g. a smaller
    batch for a test); its figures as a dict."""
    import jax

    from agentrl_jax.bench.rollout import SlowSteps
    from agentrl_jax.reproduce.config import default_config
    from agentrl_jax.reproduce.pipeline import Reproduction
    from agentrl_jax.train.run import train_policy

    overrides = [
        f"rl.steps={steps}",
        f"rl.asynchronous.max_staleness={staleness}",
        f"rl.checkpoint.every={steps}",
        "rl.runs=[grpo]",
        "warm_start.enabled=false",
        f"mesh.rollout={1 if split else 0}",
        "mesh.data=1",
        *overrides,
    ]
    config = default_config("frozenlake", overrides)
    setup = Reproduction(config, out / "setup", fresh=True, progress=False, log=lambda _: None)
    setup.setup()
    model = setup.load_model(setup.init_dir)
    slow = SlowSteps(setup.tasks.train.env, step_ms)
    ends, turns, events = [], [], []
    rows = config.rl.tasks_per_step * config.rl.group_size

    def on_step(step: int, metrics: dict) -> None:
        ends.append(time.perf_counter())
        turns.append(metrics["turns_mean"] * rows)

    train_policy(
        model,
        setup.tokenizer,
        slow,
        "grpo",
        config,
        out=out / f"k{staleness}",
        on_step=on_step,
        events=events,
    )
    seconds = ends[-1] - ends[warmup - 1]
    return {
        "max_staleness": staleness,
        "turns_per_s": sum(turns[warmup:]) / seconds,
        "updates_per_s": (steps - warmup) / seconds,
        "seconds": seconds,
        "timed_updates": steps - warmup,
        "rows": rows,
        "events": " | ".join(f"{_SHORT.get(name, name)} {i}" for name, i in events[:9]),
        "devices": [str(d) for d in jax.devices()],
    }


def run(
    staleness: Sequence[int] = (1, 2),
    *,
    steps: int = 8,
    warmup: int = 2,
    step_ms: float = 20.0,
    split: bool = True,
    overrides: Sequence[str] = (),
) -> list[BenchResult]:
    """Every setting in a fresh process (module docstring): a turns/s and an updates/s row per
    ``max_staleness`` in ``staleness``, each against the synchronous loop (``overrides``:
    ``--set`` items over the default config, e.g. a smaller batch for a test)."""
    if warmup < 1 or steps <= warmup:
        raise ValueError(f"steps ({steps}) must exceed warmup ({warmup}) >= 1")
    figures = {
        k: _in_fresh_process(k, steps, warmup, step_ms, split, overrides) for k in (0, *staleness)
    }
    sync = figures[0]
    settings = {
        "steps": steps,
        "warmup": warmup,
        "step_ms": step_ms,
        "rows_per_update": sync["rows"],
        "overrides": list(overrides),
        "split_devices": split,
        "devices": sync["devices"],
        "events_sync": sync["events"],
    }
    out = []
    for k in staleness:
        mine = figures[k]
        extra = {**settings, "events": mine["events"], "seconds": mine["seconds"]}
        for unit, key in (("turns/s", "turns_per_s"), ("updates/s", "updates_per_s")):
            out.append(
                BenchResult(
                    f"FrozenLake RL loop, max_staleness {k}, env {step_ms:g} ms/row-step",
                    unit,
                    mine[key],
                    sync[key],
                    SYNC,
                    extra,
                )
            )
    return out


def _in_fresh_process(
    k: int, steps: int, warmup: int, step_ms: float, split: bool, overrides: Sequence[str]
) -> dict:
    env = dict(os.environ)
    if split:
        flags = env.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=2".strip()
    with tempfile.TemporaryDirectory(prefix="bench-rl-loop-") as folder:
        args = [str(k), str(steps), str(warmup), str(step_ms), str(int(split)), folder]
        args.append(json.dumps(list(overrides)))
        done = subprocess.run(
            [sys.executable, "-m", "agentrl_jax.bench.rl_loop", *args],
            env=env,
            capture_output=True,
            text=True,
        )
    if done.returncode != 0:
        raise RuntimeError(f"bench rl-loop, max_staleness {k}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    k, steps, warmup, step_ms, split, folder, overrides = sys.argv[1:]
    figures = measure(
        int(k),
        steps=int(steps),
        warmup=int(warmup),
        step_ms=float(step_ms),
        split=bool(int(split)),
        out=Path(folder),
        overrides=json.loads(overrides),
    )
    print(json.dumps(figures))
