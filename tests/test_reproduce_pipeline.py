"""``agentrl-jax reproduce frozenlake`` end to end at CI scale (configs/frozenlake_ci.yaml):
the results folder and its report, Table 1 recomputed from the saved counts, and resuming.

One uninterrupted run (the module fixture) is the reference. A second run of the same config
is stopped after the warm start (``--until``), continued by ``agentrl-jax train`` in a
subprocess that gets SIGINT (Ctrl-C) once the GRPO run has checkpointed (it must say where it
stopped, what is saved and the command that resumes, and exit 130), and resumed by that
command in-process (which must say from where), then evaluated: it must reuse the finished
phases untouched and end with the very same bytes (exported models, Table 1 counts).
(A SIGKILLed training run resuming to the same bits: tests/test_train_checkpoint.py.)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import jax
import nbformat
import numpy as np
import pytest
import yaml
from markdown_it import MarkdownIt
from markdown_tables import first_table
from nbclient import NotebookClient
from typer.testing import CliRunner

from agentrl_jax.cli import app
from agentrl_jax.config_io import dump_config
from agentrl_jax.evaluation.analyses.registry import names as analysis_names
from agentrl_jax.evaluation.raw import table1_from_results
from agentrl_jax.models.tokenizer import load_tokenizer
from agentrl_jax.reproduce import machine, pipeline, sft
from agentrl_jax.reproduce.config import load_config
from agentrl_jax.reproduce.folder import ResultsFolderError
from agentrl_jax.reproduce.pipeline import reproduce

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
CI_CONFIG = ROOT / "configs" / "frozenlake_ci.yaml"
NOTEBOOK = ROOT / "notebooks" / "frozenlake_reproduction.ipynb"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
KILL_TIMEOUT_S = 900  # generous: CI machines are slow and busy; a pass takes far less


def run_reproduction(config_path: Path, out: Path) -> None:
    """Run the reproduction of ``config_path`` into ``out`` by executing the notebook
    notebooks/frozenlake_reproduction.ipynb (nbclient, a real kernel), so CI runs the notebook
    end to end; every test below reads only ``out``. A failing cell fails the test with the
    cell's error."""
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    env = {"AGENTRL_REPRO_CONFIG": str(config_path), "AGENTRL_REPRO_OUT": str(out)}
    with mock.patch.dict(os.environ, env):
        NotebookClient(
            notebook,
            timeout=KILL_TIMEOUT_S,
            kernel_name="python3",
            resources={"metadata": {"path": str(ROOT)}},
        ).execute()
    figures = [
        o
        for c in notebook.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.output_type == "display_data" and "image/png" in o.get("data", {})
    ]
    assert len(figures) >= 8, "the notebook should display the run's figures"


@pytest.fixture(scope="module")
def config():
    return load_config(CI_CONFIG)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """The results folder of one uninterrupted CI-scale run."""
    out = tmp_path_factory.mktemp("reproduce") / "uninterrupted"
    run_reproduction(CI_CONFIG, out)
    return out


def expected_phases(config) -> list[str]:
    return (
        ["setup", "demos", "warm_start"]
        + [f"train:{r}" for r in config.rl.runs]
        + [f"eval:{a}" for a in analysis_names()]
        + ["report"]
    )


def snapshot(paths) -> dict[str, tuple[str, int]]:
    """``{path: (sha256 of the bytes, mtime in ns)}`` of every file under ``paths``."""
    files = []
    for path in paths:
        files += [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {
        str(p): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns) for p in files
    }


def read_phases(out: Path) -> dict:
    return json.loads((out / "phases.json").read_text())


def training_log(out: Path, run: str) -> list[dict]:
    """The records of ``runs/<run>/metrics.jsonl`` without the timings (which vary)."""
    lines = (out / "runs" / run / "metrics.jsonl").read_text().splitlines()
    return [
        {
            k: v
            for k, v in json.loads(line).items()
            if not k.startswith("time/") and not k.endswith("_per_s")
        }
        for line in lines
    ]


# ---------------------------------------------------------------- the results folder


def test_phases_json_records_every_phase_in_order(finished, config):
    phases = read_phases(finished)
    assert list(phases) == expected_phases(config)
    assert all(p["seconds"] >= 0 for p in phases.values())
    ws = config.warm_start
    demos = min(ws.demo_tasks, config.task.train_tasks) * ws.demos_per_task
    assert phases["demos"]["trajectories"] == demos
    assert (
        0.0 <= phases["demos"]["mistake_share"] <= 1.0 and phases["demos"]["overflow_rate"] == 0.0
    )
    assert phases["warm_start"]["steps"] == sft.num_sft_steps(demos, ws.batch_size, ws.epochs)
    for run, label in (
        ("grpo", "GRPO"),
        ("budgetmix", "BudgetMix GRPO"),
        ("budgetmix-presentation", "Presentation-mixed BudgetMix GRPO"),
    ):
        assert phases[f"train:{run}"]["resumed_from_step"] == 0
        assert phases[f"train:{run}"]["label"] == label
    # Every phase says where it ran (the numbers on CPU depend on it), and so does the report.
    here = machine.machine()
    assert all(p["machine"] == here for p in phases.values())
    assert here["jax"] == jax.__version__ and here["cpu"]
    assert f"Machine: {machine.describe(here)};" in (finished / "report.md").read_text()
    # The folder holds the exact config, and every run logged each step once.
    assert (finished / "config.yaml").read_text() == dump_config(config)
    for run in config.rl.runs:
        assert [r["step"] for r in training_log(finished, run)] == list(
            range(1, config.rl.steps + 1)
        )
        assert sorted((finished / "models" / run).glob("*.safetensors"))


def markdown_tokens(path: Path):
    return MarkdownIt("commonmark").enable("table").parse(path.read_text())


def test_report_renders_with_table1_and_valid_figures(finished, config):
    report = finished / "report.md"
    tokens = markdown_tokens(report)
    headings = [
        t.content
        for i, t in enumerate(tokens)
        if t.type == "inline" and tokens[i - 1].type == "heading_open"
    ]
    assert headings[0] == "FrozenLake reproduction"
    # the findings first, then Table 1, then the analyses
    assert headings[1:3] == ["Paper findings vs this run", "Table 1: Pass@2 by budget level"]
    assert any(h.startswith("Paper findings vs this run") for h in headings)
    assert sum(t.type == "table_open" for t in tokens) >= 2  # Table 1 and training dynamics
    # the base's continuation rate is measured once per comparison, on that pair's states: said
    text = report.read_text()
    assert text.count("so base's rate differs from one comparison to the next") == len(
        config.rl.runs
    )
    # and the error-recovery suite tables every policy against the base
    assert "Error-recovery suite" in headings and "frozenlake-error-recovery/v1" in text
    # report.html: the findings first, each verdict linking to the section it was checked on
    from test_figures import read_page

    page = read_page(finished / "report.html")
    assert page.ids[0] == "paper-findings-vs-this-run" and len(page.ids) == len(headings) - 1
    verdicts = [h for h in page.links if h.startswith("#")][len(page.ids) :]  # after the contents
    assert len(verdicts) >= 6 and all(h[1:] in page.ids for h in verdicts), verdicts
    assert "#continuation-success-from-error-states-grpo-vs-base" in verdicts
    # each policy's budget robustness, recomputed from the raw counts
    from agentrl_jax.evaluation.analyses.robustness import robustness_from_counts
    from agentrl_jax.evaluation.raw import budget_counts, load_raw

    assert "Budget robustness" in headings
    raw = load_raw(finished, "table")
    scores = json.loads((finished / "budget_robustness.json").read_text())["scores"]
    assert list(scores) == raw["policies"]
    for policy, score in scores.items():
        again = robustness_from_counts(budget_counts(raw, policy), raw["k"], raw["shortest_paths"])
        assert (
            score["mean"] == pytest.approx(again.mean) and f"| {policy} | {again.mean:.3f}" in text
        )
    # every figure names its analysis and its run
    for run in ("GRPO", "BudgetMix GRPO", "Presentation-mixed BudgetMix GRPO"):
        for title in (
            f"Training dynamics: {run}",
            f"Step-level action quality on matched states: {run} vs base",
            f"Step-level action quality at error states: {run} vs base",
        ):
            assert title in headings, title

    images, links = [], []
    for token in tokens:
        for child in token.children or ():
            if child.type == "image":
                images.append(child.attrGet("src"))
            elif child.type == "link_open":
                links.append(child.attrGet("href"))
    assert {"figures/pass_at_t_table.png", "figures/pass_at_t.png", "figures/pass_at_k.png"} <= set(
        images
    )
    assert any("training_dynamics" in i for i in images) and len(images) >= 10
    for image in images:
        data = (finished / image).read_bytes()
        assert data[:8] == PNG_SIGNATURE, image
        assert data[12:16] == b"IHDR"
        width, height = struct.unpack(">II", data[16:24])
        assert width > 100 and height > 100, image
    # Every local link (data files, PDFs, config.yaml) points at a file in the folder, every
    # in-page link (a verdict's) at a heading (GitHub's anchors).
    from agentrl_jax.evaluation.html import anchor

    assert "config.yaml" in links and "raw/table.json" in links
    for link in links:
        if link.startswith("#"):
            assert link[1:] in {anchor(h) for h in headings}, link
        else:
            assert (finished / link).is_file(), link


def markdown_table1(path: Path) -> tuple[list[str], dict[str, list[str]]]:
    """Header and ``{row label: cells}`` of Table 1 in a report (its section's first table)."""
    text = path.read_text()
    return first_table(text[text.index("## Table 1") :])


def test_table1_is_recomputed_from_the_saved_counts(finished, config):
    record = json.loads((finished / "raw" / "table.json").read_text())
    policies = ["base", "GRPO", "BudgetMix GRPO", "Presentation-mixed BudgetMix GRPO"]
    assert record["policies"] == policies
    levels = [(p * config.task.t_max) // 100 for p in (25, 50, 75, 100)]
    assert record["levels"] == levels and record["k"] == config.eval.k

    def hand_pass(n: int, c: int, k: int) -> float:
        return 1.0 - math.comb(n - c, k) / math.comb(n, k)

    hand = {}
    for policy in policies:
        for t in levels:
            counts = record["counts"][policy][str(t)]
            assert counts["n"] == [config.eval.samples] * config.task.eval_tasks
            assert all(0 <= c <= n for n, c in zip(counts["n"], counts["c"]))
            hand[policy, t] = float(
                np.mean([hand_pass(n, c, record["k"]) for n, c in zip(counts["n"], counts["c"])])
            )
    table = table1_from_results(finished)
    assert list(table) == policies
    header, shown = markdown_table1(finished / "report.md")
    assert header == [f"Pass@{record['k']} (%)"] + [
        f"{p}% (T={t})" for p, t in zip((25, 50, 75, 100), levels)
    ]
    for policy in policies:
        assert [table[policy][t] for t in levels] == pytest.approx(
            [hand[policy, t] for t in levels], abs=1e-12
        )
        assert [cell.split(" ")[0] for cell in shown[policy]] == [
            f"{100 * hand[policy, t]:.1f}" for t in levels
        ]
    for a, b in (("GRPO", "base"), ("BudgetMix GRPO", "base"), ("BudgetMix GRPO", "GRPO")):
        diffs = [f"{100 * (hand[a, t] - hand[b, t]):+.1f}" for t in levels]
        assert [cell.split(" ")[0] for cell in shown[f"{a} - {b} (pt)"]] == diffs


# ---------------------------------------------------------------- refusing and not redoing


def test_a_rerun_of_a_finished_folder_does_nothing(finished, config, monkeypatch):
    before = snapshot([finished])
    config_file = str(finished / "config.yaml")

    def no_phase(self, phase):
        raise AssertionError(f"phase {phase} was run again")

    monkeypatch.setattr(pipeline.Reproduction, "_run_phase", no_phase)
    assert reproduce(config, finished, progress=False) == finished / "report.md"
    after = snapshot([finished])
    # config.yaml is rewritten with the same text; nothing else is touched.
    assert after[config_file][0] == before[config_file][0]
    del before[config_file], after[config_file]
    assert after == before


def test_a_plugin_analysis_is_run_and_reported_by_reproduce(finished, config, tmp_path):
    """An analysis a user's plugin registers (tests/eval_helpers.py: PLUGIN_ANALYSIS) is a phase
    of the reproduction after the built-in ones: on a copy of the finished folder (its report
    to be written again) only it and the report run; its raw record, its report section and
    its claim in findings.json are there, and every built-in analysis' files are untouched."""
    import shutil

    from eval_helpers import plugin_analysis

    from agentrl_jax.plugins import load_plugins

    out = tmp_path / "out"
    shutil.copytree(finished, out)
    phases = read_phases(out)
    del phases["report"]
    (out / "phases.json").write_text(json.dumps(phases))
    before = snapshot([out / "raw", out / "sections", out / "table1.csv"])
    with plugin_analysis(tmp_path) as plugin:
        load_plugins([str(plugin)])
        assert pipeline.phase_names(config)[-3:] == ["eval:dynamics", "eval:solved_once", "report"]
        assert reproduce(config, out, progress=False) == out / "report.md"
    assert list(read_phases(out))[-3:] == ["eval:dynamics", "eval:solved_once", "report"]
    after = snapshot([out / "raw", out / "sections", out / "table1.csv"])
    kept = {k: sha for k, (sha, _) in after.items() if "solved_once" not in k}
    assert kept == {k: sha for k, (sha, _) in before.items()}  # paper.json: rewritten the same
    raw = json.loads((out / "raw" / "solved_once.json").read_text())
    assert raw["policies"] == ["base"] + [r.label for r in config.rl.resolved_runs()]
    report = (out / "report.md").read_text()
    assert report.index("## Training dynamics") < report.index("## Solved once")
    found = json.loads((out / "findings.json").read_text())
    stored = json.loads((finished / "findings.json").read_text())
    assert found[: len(stored)] == stored  # the paper's findings first, unchanged
    assert [f["subject"] for f in found[len(stored) :]] == raw["policies"]


def test_a_folder_of_another_config_is_refused(finished, tmp_path):
    before = snapshot([finished])
    other = load_config(CI_CONFIG, ["rl.steps=3", "eval.seed=1"])
    with pytest.raises(
        ResultsFolderError,
        match=r"holds a run of another config \(differs in rl\.steps, eval\.seed\); "
        r"use --fresh",
    ):
        reproduce(other, finished, progress=False)
    assert snapshot([finished]) == before
    crowded = tmp_path / "crowded"
    crowded.mkdir()
    (crowded / "notes.txt").write_text("mine")
    with pytest.raises(ResultsFolderError, match="is not empty and holds no config.yaml"):
        reproduce(other, crowded, progress=False)
    assert [p.name for p in crowded.iterdir()] == ["notes.txt"]


# ---------------------------------------------------------------- the CLI


def cli(*args: str):
    return CliRunner().invoke(
        app, ["reproduce", "frozenlake", *args, "--no-progress"], env={"COLUMNS": "1000"}
    )


def cli_error(*args: str) -> str:
    result = cli(*args)
    assert result.exit_code == 2, (result.exit_code, result.output)  # a usage error
    return " ".join(result.output.split())


def test_cli_overrides_refusal_and_fresh_start(tmp_path):
    out = tmp_path / "cli"
    result = cli(
        "--config",
        str(CI_CONFIG),
        "--out",
        str(out),
        "--set",
        "rl.steps=1",
        "--set",
        "model.seed=2",
        "--until",
        "setup",
    )
    assert result.exit_code == 0, result.output
    assert "Stopped after setup" in result.output
    saved = load_config(out / "config.yaml")
    assert saved == load_config(CI_CONFIG, ["rl.steps=1", "model.seed=2"])
    assert list(read_phases(out)) == ["setup"]
    init = (out / "models" / "init" / "model.safetensors").read_bytes()

    # The same folder with other settings is refused, naming what differs ...
    message = cli_error("--config", str(CI_CONFIG), "--out", str(out), "--set", "rl.steps=1")
    assert "holds a run of another config (differs in model.seed); use --fresh" in message
    assert load_config(out / "config.yaml") == saved
    # ... unless --fresh: it starts over with the new settings.
    result = cli(
        "--config",
        str(CI_CONFIG),
        "--out",
        str(out),
        "--set",
        "rl.steps=1",
        "--until",
        "setup",
        "--fresh",
    )
    assert result.exit_code == 0, result.output
    assert load_config(out / "config.yaml") == load_config(CI_CONFIG, ["rl.steps=1"])
    assert list(read_phases(out)) == ["setup"]
    assert (out / "models" / "init" / "model.safetensors").read_bytes() != init  # model.seed 0


def test_tokenizer_isolate_builds_a_tokenizer_with_one_token_per_grid_cell(tmp_path):
    out = tmp_path / "cells"
    result = cli(
        "--config",
        str(CI_CONFIG),
        "--out",
        str(out),
        "--set",
        "model.tokenizer_isolate=true",
        "--until",
        "setup",
    )
    assert result.exit_code == 0, result.output
    grid = "\nP _ O _\n_ O _ _\n_ _ _ O\nO _ _ G"
    tok = load_tokenizer(out / "models" / "init")
    pieces = [tok.decode([i]) for i in tok(grid, add_special_tokens=False)["input_ids"]]
    assert "".join(pieces) == grid and len(pieces) == 16, pieces  # each cell one token
    # the built-in default merges across cells
    result = cli("--config", str(CI_CONFIG), "--out", str(tmp_path / "rows"), "--until", "setup")
    assert result.exit_code == 0, result.output
    rows = load_tokenizer(tmp_path / "rows" / "models" / "init")
    assert len(rows(grid, add_special_tokens=False)["input_ids"]) < 16
    assert "model.tokenizer_isolate: the sql environment's study declares no pieces" in " ".join(
        CliRunner()
        .invoke(
            app,
            [
                "reproduce",
                "sql",
                "--out",
                str(tmp_path / "sql"),
                "--no-progress",
                "--set",
                "model.tokenizer_isolate=true",
                "--until",
                "setup",
            ],
            env={"COLUMNS": "1000"},
        )
        .output.split()
    )


def test_cli_errors_name_the_problem(tmp_path):
    out = ["--config", str(CI_CONFIG), "--out", str(tmp_path / "never")]
    assert "rl.steps: must be an int in [1, 10000000], got 0" in cli_error(
        *out, "--set", "rl.steps=0"
    )
    assert "override 'rlsteps=3': expected section.field=value" in cli_error(
        *out, "--set", "rlsteps=3"
    )
    assert "rl: unknown field 'stepz'" in cli_error(*out, "--set", "rl.stepz=3")
    missing = tmp_path / "missing.yaml"
    assert f"config {missing}: no such file" in cli_error("--config", str(missing))
    assert not (tmp_path / "never").exists()  # a bad config never touches the folder
    message = cli_error(*out, "--until", "train:ppo")
    assert "--until: unknown phase 'train:ppo'; phases: setup, demos, warm_start" in message


# ---------------------------------------------------------------- killed and resumed


def test_a_killed_run_resumes_to_the_same_bytes(finished, config, tmp_path):
    out = tmp_path / "killed"
    # 1. Stop after the warm start (the CLI, in-process).
    result = cli("--config", str(CI_CONFIG), "--out", str(out), "--until", "warm_start")
    assert result.exit_code == 0, result.output
    assert "Stopped after warm_start; rerun without --until to go on" in result.output
    assert list(read_phases(out)) == ["setup", "demos", "warm_start"]
    assert not (out / "runs").exists() and not (out / "report.md").exists()
    first_phases = read_phases(out)
    kept = snapshot([out / "models" / "init", out / "models" / "base", out / "warm_start"])

    # 2. Go on with `train` in a subprocess and interrupt it (SIGINT, as Ctrl-C) once GRPO has
    # begun checkpointing update 1.
    log = tmp_path / "child.log"
    checkpoints = out / "runs" / "grpo" / "checkpoints"
    train = ["train", "--config", str(CI_CONFIG), "--out", str(out)]
    with log.open("w") as sink:
        child = subprocess.Popen(
            [sys.executable, "-c", "from agentrl_jax.cli import main; main()", *train],
            stdout=sink,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        try:
            deadline = time.monotonic() + KILL_TIMEOUT_S
            # Update 1's save has begun (Orbax writes "1.orbax-checkpoint-tmp..." and renames
            # it "1" when done, possibly only once the next save starts). An interrupt from here
            # on lands after that save, which the run then finishes and keeps
            # (agentrl_jax/uninterrupted.py), and before update 2's.
            while not any(
                p.name.split(".")[0] == "1"
                for p in (checkpoints.iterdir() if checkpoints.is_dir() else ())
            ):
                assert child.poll() is None, (
                    f"the run ended before a checkpoint:\n{log.read_text()[-3000:]}"
                )
                assert time.monotonic() < deadline, (
                    f"no checkpoint in time:\n{log.read_text()[-3000:]}"
                )
                time.sleep(0.02)
            os.kill(child.pid, signal.SIGINT)
            child.wait(timeout=120)
        finally:
            if child.poll() is None:
                child.kill()
            child.wait()
    said = log.read_text()
    assert child.returncode == 130, said[-3000:]
    assert "Traceback" not in said, said[-3000:]
    killed_at = max(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
    stopped = [line for line in said.splitlines() if line.startswith("train: interrupted")]
    assert len(stopped) == 1, said[-3000:]
    match = re.fullmatch(
        re.escape("train: interrupted during train:grpo at update ")
        + r"(\d+)"
        + re.escape(
            f"/{config.rl.steps}; saved: 3 finished phases (setup, demos, warm_start); "
            f"train:grpo from its checkpoint at update {killed_at}/{config.rl.steps}; "
            f"resume with: agentrl-jax {' '.join(train)}"
        ),
        stopped[0],
    )
    assert match and int(match.group(1)) >= killed_at, stopped[0]
    # Killed between checkpoints (steps take seconds, the poll 20 ms): the rerun must really
    # continue training from a restored state, not just export a finished one.
    assert killed_at < config.rl.steps, f"killed too late: checkpoint {killed_at} was the last"
    interrupted = read_phases(out)
    assert "train:grpo" not in interrupted
    assert interrupted == first_phases  # the subprocess redid none of them

    # 3. Resume with the command the interrupt named (in-process), then Table 1.
    result = CliRunner().invoke(app, [*train, "--no-progress"], env={"COLUMNS": "1000"})
    assert result.exit_code == 0, result.output
    assert (
        f"train: resuming {out}: 3 finished phases (setup, demos, warm_start); train:grpo from "
        f"its checkpoint at update {killed_at}/{config.rl.steps}\n"
    ) in result.output
    assert "train: done in " in result.output and "stopped after" not in result.output
    reproduce(config, out, progress=False, until="eval:table")
    phases = read_phases(out)
    assert (
        list(phases) == expected_phases(config)[: expected_phases(config).index("eval:table") + 1]
    )
    assert {p: phases[p] for p in first_phases} == first_phases
    assert snapshot([out / "models" / "init", out / "models" / "base", out / "warm_start"]) == kept
    assert phases["train:grpo"]["resumed_from_step"] == killed_at >= 1
    assert phases["train:budgetmix"]["resumed_from_step"] == 0
    assert not (out / "report.md").exists()

    # 4. The same result, bit for bit, as the uninterrupted run.
    def same_bytes(relative: str) -> None:
        mine, reference = out / relative, finished / relative
        assert mine.read_bytes() == reference.read_bytes(), f"{relative} differs after resuming"

    same_bytes("models/base/model.safetensors")  # the warm start (before any resume)
    for run in config.rl.runs:
        files = sorted(p.name for p in (finished / "models" / run).glob("*.safetensors"))
        assert files and files == sorted(
            p.name for p in (out / "models" / run).glob("*.safetensors")
        )
        for name in files:
            same_bytes(f"models/{run}/{name}")
    same_bytes("raw/table.json")
    # The resumed log has each step once, with the uninterrupted run's rewards and losses.
    for run in config.rl.runs:
        assert training_log(out, run) == training_log(finished, run), run
    assert yaml.safe_load((out / "config.yaml").read_text()) == config.to_dict()


def test_the_eta_of_the_stored_default_run_holds_within_2x_after_its_first_minute(tmp_path):
    """The bar counts predicted seconds (``reproduce.progress``): at every phase boundary past
    the first minute of the stored default run with at least 5 s left, (rest of the work) x
    (seconds so far / work so far) is within 2x of the seconds it really had left. Counting work
    units (turns) instead, the first ETA after ``setup`` (one unit of 1.7 s) was over a day."""
    stored = json.loads((ROOT / "notebooks/results_cpu_default/phases.json").read_text())
    run = pipeline.Reproduction(load_config(None), tmp_path / "out", progress=False)
    names = run.phase_names()
    seconds = [stored[name]["seconds"] for name in names]
    total_work, total_seconds = sum(run.work.seconds(n) for n in names), sum(seconds)
    work = elapsed = 0.0
    checked = 0
    for name, took in zip(names, seconds):
        work, elapsed = work + run.work.seconds(name), elapsed + took
        if elapsed >= 60 and total_seconds - elapsed >= 5:  # a bar's last seconds are noise
            eta = (total_work - work) * elapsed / work
            assert 0.5 <= eta / (total_seconds - elapsed) <= 2, (name, eta, total_seconds - elapsed)
            checked += 1
    assert checked >= 6
    first = run.work.units(names[0]) / sum(map(run.work.units, names))  # units' view after setup
    assert (1 - first) / first * seconds[0] > 24 * 3600


def test_readme_table1_is_the_stored_default_runs():
    """README's Table 1 is notebooks/results_cpu_default/table1.csv, rounded as shown, and
    every policy cell's 95% interval is within +-6 points (the default's design)."""
    import csv

    stored = {
        row["row"]: row
        for row in csv.DictReader(
            (ROOT / "notebooks/results_cpu_default/table1.csv").read_text().splitlines()
        )
    }
    readme = (ROOT / "docs" / "reproduction.md").read_text()
    table = readme[readme.index("| Pass@8 (%) | 25% (T=3)") :].split("\n\n")[0].splitlines()
    levels = ["25% (T=3)", "50% (T=6)", "75% (T=9)", "100% (T=12)"]
    assert table[0] == "| Pass@8 (%) | " + " | ".join(levels) + " |"
    for line in table[2:]:
        label, *cells = [c.strip() for c in line.strip("|").split("|")]
        row = stored[label if label in stored else f"{label} (pt)"]
        for level, cell in zip(levels, cells):
            value = float(row[level])
            low, high = float(row[f"{level} ci_low"]), float(row[f"{level} ci_high"])
            if label in stored:
                assert cell == f"{value:.1f} [{low:.1f}, {high:.1f}]", (label, level)
                assert (high - low) / 2 <= 6.0, (label, level)
            else:
                assert cell == f"{value:+.1f} [{low:+.1f}, {high:+.1f}]", (label, level)


def test_readme_table1_of_the_larger_config_is_its_stored_runs():
    """README's Table 1 of the 8x8 / T_max 70 config is notebooks/results_cpu_large/table1.csv,
    rounded as shown."""
    import csv

    stored = {
        row["row"]: row
        for row in csv.DictReader(
            (ROOT / "notebooks/results_cpu_large/table1.csv").read_text().splitlines()
        )
    }
    readme = (ROOT / "docs" / "reproduction.md").read_text()
    levels = ["25% (T=17)", "50% (T=35)", "75% (T=52)", "100% (T=70)"]
    table = readme[readme.index("| Pass@8 (%) | 25% (T=17)") :].split("\n\n")[0].splitlines()
    assert table[0] == "| Pass@8 (%) | " + " | ".join(levels) + " |"
    assert len(table[2:]) == len(stored) == 6
    for line in table[2:]:
        label, *cells = [c.strip() for c in line.strip("|").split("|")]
        row = stored[label if label in stored else f"{label} (pt)"]
        for level, cell in zip(levels, cells):
            value, low, high = (float(row[f"{level}{s}"]) for s in ("", " ci_low", " ci_high"))
            form = "{:.1f}" if label in stored else "{:+.1f}"
            assert cell == f"{form.format(value)} [{form.format(low)}, {form.format(high)}]", (
                label,
                level,
            )


def _same_numbers(a, b, rel: float = 1e-12) -> bool:
    """``a == b`` for parsed JSON, floats within ``rel`` (relative) or 1e-15 (absolute)."""
    if isinstance(a, float) or isinstance(b, float):
        return (
            isinstance(a, (int, float))
            and isinstance(b, (int, float))
            and (
                math.isclose(a, b, rel_tol=rel, abs_tol=1e-15) or (math.isnan(a) and math.isnan(b))
            )
        )
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and a.keys() == b.keys()
            and all(_same_numbers(a[k], b[k], rel) for k in a)
        )
    if isinstance(a, list):
        return (
            isinstance(b, list)
            and len(a) == len(b)
            and all(_same_numbers(x, y, rel) for x, y in zip(a, b))
        )
    return a == b


@pytest.mark.parametrize("folder", ["results_cpu_default", "results_cpu_large"])
def test_the_stored_runs_table1_and_findings_recompute_from_their_raw(tmp_path, folder):
    """notebooks/<folder>/raw/ holds the run's raw records (the likelihood's left out: no
    stored file derives from it). Table 1 (``table1.csv``), the budget robustness and the
    error-recovery suite recomputed from them by today's analyses are the stored files, byte
    for byte, and the verdicts (``findings.json``) are the stored ones with every number to
    1e-12: the report cannot drift from the numbers it was computed from. Both stored runs:
    the CPU default and the larger 8x8 config."""
    from agentrl_jax.evaluation import findings
    from agentrl_jax.evaluation.analyses import error_recovery
    from agentrl_jax.evaluation.analyses.table1 import write_robustness, write_table1
    from agentrl_jax.evaluation.raw import load_raw
    from agentrl_jax.evaluation.report import Section

    stored = ROOT / "notebooks" / folder
    write_table1(tmp_path, load_raw(stored, "table"), Section("Table 1", ""))
    write_robustness(tmp_path, load_raw(stored, "table"))
    error_recovery.section(tmp_path, error_recovery.compute(load_raw(stored, "errors")))
    findings.write_findings(tmp_path, findings.check_findings(stored))
    for name in (
        "table1.csv",
        "budget_robustness.json",
        error_recovery.ERROR_RECOVERY_JSON,
        error_recovery.ERROR_RECOVERY_CSV,
    ):
        assert (tmp_path / name).read_bytes() == (stored / name).read_bytes(), name
    # The verdicts' numbers to the last few bits: the Pass@K leads sum NumPy's log1p over
    # many terms, and one of results_cpu_large's came out 6e-17 away on another machine (an
    # AMD EPYC without AVX-512; NumPy 2.4.1 and 2.4.6 agree there, so NumPy's SIMD path for
    # the CPU, not its release, is the likely cause). Every text, verdict and key must match.
    assert _same_numbers(
        json.loads((tmp_path / "findings.json").read_text()),
        json.loads((stored / "findings.json").read_text()),
    )
    verdicts = {
        f["headline"]: f["verdict"] for f in json.loads((stored / "findings.json").read_text())
    }
    assert "not measured" not in verdicts.values()  # every analysis behind a finding is stored


@pytest.mark.parametrize("folder", ["results_sql_cpu", "results_code_cpu", "results_bfcl_cpu"])
def test_the_stored_runs_of_other_environments_recompute_from_their_raw(tmp_path, folder):
    """The stored CPU-default runs of ``reproduce sql``, ``code`` and ``bfcl``: Table 1, the
    budget robustness, the verdicts (and code's error-recovery suite) recomputed from ``raw/``
    are the stored files, byte for byte; the report names the environment and its held-out
    split."""
    from agentrl_jax.evaluation import findings
    from agentrl_jax.evaluation.analyses import error_recovery
    from agentrl_jax.evaluation.analyses.table1 import write_robustness, write_table1
    from agentrl_jax.evaluation.raw import load_raw
    from agentrl_jax.evaluation.report import Section

    stored = ROOT / "notebooks" / folder
    write_table1(tmp_path, load_raw(stored, "table"), Section("Table 1", ""))
    write_robustness(tmp_path, load_raw(stored, "table"))
    findings.write_findings(tmp_path, findings.check_findings(stored))
    names = ["table1.csv", "findings.json", "budget_robustness.json"]
    if (stored / "raw" / "errors.json").is_file():  # code: its step diagnostics' suite
        errors = load_raw(stored, "errors")
        error_recovery.section(tmp_path, error_recovery.compute(errors), errors)
        names += [error_recovery.ERROR_RECOVERY_JSON, error_recovery.ERROR_RECOVERY_CSV]
    for name in names:
        assert (tmp_path / name).read_bytes() == (stored / name).read_bytes(), name
    config = yaml.safe_load((stored / "config.yaml").read_text())
    assert "(disjoint splits)" in (stored / "report.md").read_text()
    assert config["task"]["env"] == folder.split("_")[1]
    if folder == "results_code_cpu":  # compared with DeepCoder-MT's own figures (raw/paper.json)
        assert "DeepCoder-MT R_multi +0.331" in (stored / "report.md").read_text()


@pytest.mark.parametrize(
    "folder", ["results_cpu_large", "results_sql_cpu", "results_code_cpu", "results_bfcl_cpu"]
)
def test_the_stored_reports_lead_with_their_findings(folder):
    """A stored run's ``report.md`` opens (after its header) with the findings: a line counting
    the verdicts of its ``findings.json``, the Pass@K rows naming the k it measured; then
    Table 1, every cell (a policy's too) ``table1.csv``'s value and 95% interval."""
    import csv

    from agentrl_jax.evaluation import findings

    stored = ROOT / "notebooks" / folder
    text = (stored / "report.md").read_text()
    headings = re.findall(r"^## (.*)$", text, flags=re.MULTILINE)
    assert headings[0] == findings.FINDINGS_TITLE and headings[1].startswith("Table 1: Pass@")
    rows = json.loads((stored / findings.FINDINGS_JSON).read_text())
    counts = ", ".join(f"{sum(r['verdict'] == v for r in rows)} {v}" for v in findings.VERDICTS)
    section = text[text.index("## " + headings[0]) : text.index("## " + headings[1])]
    assert section.splitlines()[2] == f"**Of {len(rows)} findings: {counts}.**"
    samples = json.loads((stored / "raw" / "passk.json").read_text())["samples"]
    assert all(
        r["paper"].endswith(f"; this run: k = 1..{samples}")
        for r in rows
        if r["headline"] == findings.PASS_AT_K
    )
    header, shown = first_table(text[text.index("## Table 1") :])
    table = list(csv.DictReader((stored / "table1.csv").read_text().splitlines()))
    assert list(shown) == [r["row"] for r in table]
    for row in table:
        form = "{:+.1f}" if row["kind"] == "difference" else "{:.1f}"
        for level, cell in zip(header[1:], shown[row["row"]]):
            value, low, high = (float(row[level + s]) for s in ("", " ci_low", " ci_high"))
            assert cell == f"{form.format(value)} [{form.format(low)}, {form.format(high)}]"
