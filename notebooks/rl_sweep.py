"""The RL settings sweep behind the CPU default (issue: reproduction power).

One point: train the first run of ``rl.runs`` (GRPO in the default) from a finished
reproduction's base policy with ``--set``-style overrides, then play base and trained on
``--eval-maps`` held-out maps at ``T_max`` (8 samples each, evaluation decoding) and record
pass@1 and Pass@8 with paired 95% CIs over maps, R_multi's and R_single's last-10 minus
first-10 update means (normal CIs), and the training time. Each point appends one JSON line
to ``--log``; ``table`` rewrites the Markdown table of every line logged so far, marking
``--chosen``, and keeps the notes written below it.

    python notebooks/rl_sweep.py point results/frozenlake lr1e-3 --set
    rl.optimizer.learning_rate=0.001 python notebooks/rl_sweep.py table --chosen lr1e-3

The base folder is any finished (or ``--until warm_start``) ``agentrl-jax reproduce
frozenlake`` run; its config, with the overrides, gives the RL settings and the maps.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from agentrl_jax.evaluation import passt, stats
from agentrl_jax.evaluation.evaluate_policies import make_tasks
from agentrl_jax.models import load_qwen3
from agentrl_jax.models.tokenizer import load_tokenizer
from agentrl_jax.reproduce.config import load_config
from agentrl_jax.sampling import SamplerPolicy
from agentrl_jax.train.run import train_policy

HERE = Path(__file__).parent
LOG, TABLE = HERE / "rl_sweep.jsonl", HERE / "rl_sweep.md"


def _ci(c: stats.MeanCI) -> list[float]:
    return [round(c.mean, 4), round(c.low, 4), round(c.high, 4)]


def point(base: Path, tag: str, overrides: list[str], eval_maps: int, log: Path) -> dict:
    config = load_config(base / "config.yaml", [*overrides, f"task.eval_tasks={eval_maps}"])
    task = config.task
    tasks = make_tasks(config)
    tokenizer = load_tokenizer(base / "models" / "init")
    spec = config.rl.resolved_runs()[0]
    run_dir = base / "sweep" / tag
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    model = load_qwen3(base / "models" / "base")
    start = time.perf_counter()
    params = train_policy(
        model,
        tokenizer,
        tasks.train,
        spec,
        config,
        out=run_dir,
        quality_scorer=config.study.step_scorer(tasks.train),
    )
    train_s = time.perf_counter() - start
    trained = load_qwen3(base / "models" / "base")
    nnx.update(trained, params)
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = min(10, len(logged) // 2)
    changes = {}
    for key in ("R_multi", "R_single"):
        values = np.array([r[key] for r in logged], np.float64)
        changes[key] = _ci(stats.difference_of_means(values[:first], values[-first:]))
    policy = SamplerPolicy.from_engine(model, config.engine)
    successes = {}
    for name, m in (("base", model), ("trained", trained)):
        s = passt.sample_successes(
            tasks.test.env,
            tokenizer,
            policy.using(nnx.state(m)),
            np.arange(eval_maps),
            jax.random.key(config.eval.seed),
            budget=task.t_max,
            samples=8,
            config=config.eval.rollout_config(None),
        )
        successes[name] = np.asarray(s, np.float64).reshape(eval_maps, 8)
    row = {
        "tag": tag,
        "overrides": overrides,
        "steps": len(logged),
        "train_s": round(train_s, 1),
        "eval_maps": eval_maps,
        "R_multi_change": changes["R_multi"],
        "R_single_change": changes["R_single"],
    }
    for metric, per_map in (("pass1", lambda s: s.mean(1)), ("pass8", lambda s: s.max(1))):
        b, t = per_map(successes["base"]), per_map(successes["trained"])
        row[metric] = {
            "base": round(float(b.mean()), 4),
            "trained": round(float(t.mean()), 4),
            "difference": _ci(stats.paired_difference(t, b)),
        }
    with open(log, "a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def table(log: Path, chosen: str | None) -> str:
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    pt = lambda c: f"{100 * c[0]:+.1f} [{100 * c[1]:+.1f}, {100 * c[2]:+.1f}]"  # noqa: E731
    num = lambda c: f"{c[0]:+.3f} [{c[1]:+.3f}, {c[2]:+.3f}]"  # noqa: E731
    lines = [
        "# RL settings sweep (CPU default)",
        "",
        "Each point trains the first run of `rl.runs` (GRPO) from one base policy with the "
        "overrides shown, then plays base and trained policy on held-out maps at T_max (8 "
        "samples per map, evaluation decoding). Differences are paired over maps (95% "
        "normal CIs); R_multi / R_single: the last-10 minus first-10 update means of the "
        "run's training log (95% Welch CIs). Written by `python notebooks/rl_sweep.py "
        "table`; see its docstring.",
        "",
        "| point | overrides | updates | train s | pass@1 base -> trained: diff (pt) | "
        "Pass@8 base -> trained: diff (pt) | R_multi last10 - first10 | "
        "R_single last10 - first10 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mark = " **(chosen)**" if r["tag"] == chosen else ""
        over = ", ".join(f"`{o}`" for o in r["overrides"]) or "(the config's)"
        p1, p8 = r["pass1"], r["pass8"]
        lines.append(
            f"| {r['tag']}{mark} | {over} | {r['steps']} | {r['train_s']} | "
            f"{100 * p1['base']:.1f} -> {100 * p1['trained']:.1f}: {pt(p1['difference'])} | "
            f"{100 * p8['base']:.1f} -> {100 * p8['trained']:.1f}: {pt(p8['difference'])} | "
            f"{num(r['R_multi_change'])} | {num(r['R_single_change'])} |"
        )
    return "\n".join(lines) + "\n"


def _notes(path: Path) -> str:
    """The hand-written text after the table in ``path`` (kept when the table is rewritten)."""
    if not path.exists():
        return ""
    lines = path.read_text().splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.startswith("|")), len(lines))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "".join(lines[end:])  # the notes may hold tables of their own


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("point")
    one.add_argument("base", type=Path)
    one.add_argument("tag")
    one.add_argument("--set", dest="overrides", action="append", default=[])
    one.add_argument("--eval-maps", type=int, default=256)
    one.add_argument("--log", type=Path, default=LOG)
    tab = sub.add_parser("table")
    tab.add_argument("--log", type=Path, default=LOG)
    tab.add_argument("--out", type=Path, default=TABLE)
    tab.add_argument("--chosen")
    args = parser.parse_args()
    if args.command == "point":
        print(json.dumps(point(args.base, args.tag, args.overrides, args.eval_maps, args.log)))
    else:
        args.out.write_text(table(args.log, args.chosen) + _notes(args.out))
        print(args.out.read_text())


if __name__ == "__main__":
    main()
