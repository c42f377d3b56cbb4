"""The reproduction on a local cluster (issue: multi-host for real): ``agentrl-jax reproduce
frozenlake`` at CI scale (configs/frozenlake_ci.yaml, all devices on ``data``) as
2 processes x 1 fake CPU device (as hosts with one GPU each), against 1 process x 2 devices;
``--full-scale``: 2 x 4 against 1 x 8 (tests/test_multihost.py trains on 2 x 4 at CI scale).

The RL runs train on the global mesh with each process's rollouts on its own devices (rows
split by process and gathered), the evaluation's rollouts split the same way, and the main
process writes the folder. The exported policies must agree to 1e-6, Table 1 and the raw
counts of every rollout-based analysis must be the same bytes, the likelihood the same to
float rounding. CI stops after Table 1 (training and the evaluation's first analysis);
``--full-scale`` runs every phase and compares every analysis. At CI scale the same two
clusters then also run the asynchronous training the second test compares (one start of each
process serves both commands: tests/multihost_cli_sequence.py).

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
from multihost_cli_sequence import SEPARATOR, statuses
from safetensors.numpy import load_file

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
CLI = Path(__file__).parent / "multihost_cli_sequence.py"
CONFIG = ROOT / "configs" / "frozenlake_ci.yaml"
# test_asynchronous_training_in_two_processes_is_that_of_one's run: the RL run only (the
# fixture's reproduction checks the rest)
ASYNC = [
    "--until",
    "train:grpo",
    "--set",
    "rl.runs=[grpo]",
    "--set",
    "rl.asynchronous.max_staleness=1",
]
ASYNC += ["--set", "warm_start.enabled=false"]


def _command(out: Path, until: list[str]) -> list[str]:
    return [
        "reproduce",
        "frozenlake",
        "--config",
        str(CONFIG),
        "--out",
        str(out),
        "--no-progress",
        "--set",
        "mesh.data=-1",
        "--set",
        "mesh.ordered_sums=true",
        *until,
    ]


def _launch(commands: list[list[str]], processes: int, devices: int):
    """``commands`` one after another in each process of a cluster of ``processes`` x
    ``devices`` (tests/multihost_cli_sequence.py: one start of each process serves them all),
    with XLA's default fusion emitters (docstring)."""
    flags = " ".join(
        f for f in os.environ.get("XLA_FLAGS", "").split() if "fusion_emitters" not in f
    )
    args = [arg for i, command in enumerate(commands) for arg in [SEPARATOR] * (i > 0) + command]
    with mock.patch.dict(os.environ, {"XLA_FLAGS": flags}):
        return launch(CLI, args, processes=processes, devices=devices, timeout=1200)


def _succeeded(done, command: int) -> None:
    """Command ``command`` (1-based) of a launch exited 0 in every process, and every process
    then exited by itself, with the code its commands gave (the first nonzero one, else 0)."""
    for i, p in enumerate(done):
        codes = statuses(p.output)
        first_error = next((code for _, code in sorted(codes.items()) if code), 0)
        assert codes.get(command) == 0 and p.code == first_error, (
            f"process {i} of {len(done)}:\n{p.output[-4000:]}"
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
    """The reproduction by 1 process x 2 devices and by 2 x 1, or at full scale 1 x 8 and 2 x 4:
    ``(folder, {"one": processes, "two": processes})``, each reproduction in ``folder/one`` and
    ``folder/two``. At CI scale the same processes then run the asynchronous RL run of
    test_asynchronous_training_in_two_processes_is_that_of_one (into ``folder/async_one`` and
    ``folder/async_two``): one start of each process for both."""
    folder = tmp_path_factory.mktemp("multihost_reproduce")
    # CI: the GRPO run of the three, up to Table 1
    until = [] if full_scale else ["--until", "eval:table", "--set", "rl.runs=[grpo]"]
    devices = 4 if full_scale else 1  # per process of the pair
    done = {}
    for name, processes in (("one", 1), ("two", 2)):
        commands = [_command(folder / name, until)]
        if not full_scale:
            commands.append(_command(folder / f"async_{name}", ASYNC))
        done[name] = _launch(commands, processes, 2 * devices // processes)
    return folder, done


def test_two_processes_reproduce_what_one_does(runs, full_scale):
    folder, done = runs
    for processes in done.values():
        _succeeded(processes, 1)
    one, two = folder / "one", folder / "two"
    output = done["two"][0].output.split("\ncommand 1 of ")[0]  # the main process', this run's
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


def test_asynchronous_training_in_two_processes_is_that_of_one(request, full_scale, tmp_path):
    """``rl.asynchronous.max_staleness: 1`` (the rollout of update i + 1 sampled while update i
    trains, by the parameters it starts from) on 2 processes x 1 device against 1 x 2: the same
    trained policy and the same metrics, staleness 1 after the first update. At CI scale the
    fixture's processes run it after their reproduction; at full scale (other layouts) it runs
    alone."""
    if full_scale:
        folder, command, done = tmp_path, 1, {}
        for name, processes in (("one", 1), ("two", 2)):
            done[name] = _launch(
                [_command(folder / f"async_{name}", ASYNC)], processes, 2 // processes
            )
    else:
        (folder, done), command = request.getfixturevalue("runs"), 2
    for processes in done.values():
        _succeeded(processes, command)
    one, two = folder / "async_one", folder / "async_two"
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
