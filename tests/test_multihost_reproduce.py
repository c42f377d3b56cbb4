"""The reproduction on a local cluster (issue: multi-host for real): ``agentrl-jax reproduce
frozenlake`` at CI scale (configs/frozenlake_ci.yaml, all devices on ``data``) as
2 processes x 1 fake CPU device (as hosts with one GPU each), against 1 process x 2 devices;
``--full-scale``: 2 x 4 against 1 x 8 (tests/test_multihost.py trains on 2 x 4 at CI scale).

The RL runs train on the global mesh with each process's rollouts on its own devices (rows
split by process and gathered), the evaluation's rollouts split the same way, and the main
process writes the folder. The exported policies must agree to 1e-6, Table 1 and the raw
counts of every rollout-based analysis must be the same bytes, the likelihood the same to
float rounding. CI stops after Table 1 (training and the evaluation's first analysis);
``--full-scale`` runs every phase and compares every analysis.

At CI scale the rollouts earn no reward, so the updates move the policies little: what moves
them is the KL term's gradient near ratio 1, rounding noise that Adam scales up to the learning
rate. It is the same in both layouts with XLA's own (default) fusion emitters, not with the older
ones the rest of the suite compiles with for speed (tests/conftest.py), so the clusters here run
with the default ones. The train step's agreement under a real loss is tests/test_multihost.py's,
as is a dead process ending the others with an error. Resuming a killed reproduction to the
same bytes is tested once, for the pipeline, in tests/test_reproduce_pipeline.py (and once for
the training loop's checkpoints, in tests/test_train_checkpoint.py).
"""

from __future__ import annotations

import filecmp
import json
import os
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from multihost import launch
from safetensors.numpy import load_file

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
CLI = Path(__file__).parent / "multihost_cli.py"
CONFIG = ROOT / "configs" / "frozenlake_ci.yaml"


def _reproduce(out: Path, processes: int, devices: int, until: list[str]):
    flags = " ".join(
        f for f in os.environ.get("XLA_FLAGS", "").split() if "fusion_emitters" not in f
    )
    with mock.patch.dict(os.environ, {"XLA_FLAGS": flags}):  # the default emitters (docstring)
        done = _launch(out, processes, devices, until)
    for i, p in enumerate(done):
        assert p.code == 0, f"process {i} of {processes}:\n{p.output[-4000:]}"
    return done


def _launch(out: Path, processes: int, devices: int, until: list[str]):
    return launch(
        CLI,
        [
            "reproduce",
            "frozenlake",
            "--config",
            str(CONFIG),
            "--out",
            str(out),
            "--no-progress",
            "--set",
            "mesh.data=-1",
            *until,
        ],
        processes=processes,
        devices=devices,
        timeout=1200,
    )


def _weights(folder: Path) -> dict[str, np.ndarray]:
    files = sorted(folder.glob("*.safetensors"))
    assert files, f"no weights in {folder}"
    return {k: v for f in files for k, v in load_file(f).items()}


def _numbers(tree, path=""):
    if isinstance(tree, dict):
        for k, v in sorted(tree.items()):
            yield from _numbers(v, f"{path}/{k}")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _numbers(v, f"{path}[{i}]")
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        yield path, float(tree)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, full_scale):
    """The reproduction by 1 process x 2 devices and by 2 x 1, or at full scale 1 x 8 and 2 x 4
    (its main process' output)."""
    folder = tmp_path_factory.mktemp("multihost_reproduce")
    one, two = folder / "one", folder / "two"
    # CI: the GRPO run of the three, up to Table 1
    until = [] if full_scale else ["--until", "eval:table", "--set", "rl.runs=[grpo]"]
    devices = 4 if full_scale else 1  # per process of the pair
    _reproduce(one, 1, 2 * devices, until)
    pair = _reproduce(two, 2, devices, until)
    return one, two, pair[0].output


def test_two_processes_reproduce_what_one_does(runs, full_scale):
    one, two, output = runs
    assert "reproduce: done" in output or "stopped after eval:table" in output
    phases = list(json.loads((two / "phases.json").read_text()))
    assert phases == list(json.loads((one / "phases.json").read_text()))
    assert phases[-1] == ("report" if full_scale else "eval:table")
    # trained (and warm-started) policies agree to 1e-6
    runs = sorted(p.name for p in (one / "models").iterdir())
    assert {"base", "grpo"} <= set(runs) and runs == sorted(
        p.name for p in (two / "models").iterdir()
    )
    for run in runs:
        a, b = _weights(one / "models" / run), _weights(two / "models" / run)
        assert a.keys() == b.keys()
        for name in a:
            np.testing.assert_allclose(
                b[name], a[name], atol=1e-6, rtol=1e-6, err_msg=f"{run}: {name}"
            )
    # the same Table 1 (every cell's successes of the same samples), the same raw counts
    assert (one / "table1.csv").read_bytes() == (two / "table1.csv").read_bytes()
    raw = sorted(p.name for p in (one / "raw").iterdir())
    assert raw == sorted(p.name for p in (two / "raw").iterdir()) and "table.json" in raw
    for name in raw:
        if name in ("likelihood.json", "dynamics.json"):  # float sums; the logs' paths
            continue
        assert filecmp.cmp(one / "raw" / name, two / "raw" / name, shallow=False), name
    if full_scale:
        a, b = (
            dict(_numbers(json.loads((f / "raw" / "likelihood.json").read_text())))
            for f in (one, two)
        )
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-5), key
        assert "in 2 processes" in (two / "report.md").read_text()
    # metrics logged once, by the main process: one record per update
    for run in ("grpo", "budgetmix") if full_scale else ("grpo",):
        records = (two / "runs" / run / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(r)["step"] for r in records] == [1, 2]


def test_asynchronous_training_in_two_processes_is_that_of_one(tmp_path):
    """``rl.max_staleness: 1`` (the rollout of update i + 1 sampled while update i trains, by
    the parameters it starts from) on 2 processes x 1 device against 1 x 2: the same trained
    policy and the same metrics, staleness 1 after the first update."""
    until = ["--until", "train:grpo", "--set", "rl.runs=[grpo]", "--set", "rl.max_staleness=1"]
    until += ["--set", "warm_start.enabled=false"]  # the RL run only (the above checks the rest)
    one, two = tmp_path / "one", tmp_path / "two"
    _reproduce(one, 1, 2, until)
    _reproduce(two, 2, 1, until)
    a, b = _weights(one / "models" / "grpo"), _weights(two / "models" / "grpo")
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(b[name], a[name], atol=1e-6, rtol=1e-6, err_msg=name)

    def untimed(folder):
        records = [json.loads(r) for r in (folder / "runs/grpo/metrics.jsonl").open()]
        return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in records]

    got, want = untimed(two), untimed(one)
    assert [r["staleness_max"] for r in got] == [0.0, 1.0]
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for key in g:
            if not key.endswith("_per_s"):
                assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-6), key
