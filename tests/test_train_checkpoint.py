"""Orbax checkpoints of the training state: exact round trip, keep/every, corrupt and partial
checkpoints skipped with a clear report, checkpoints of another config refused and left in place,
metrics kept on resume, and exact resume after a real SIGKILL.

The resume test runs this file as a script in subprocesses (modes ``straight``, ``killed``,
``resume``): one process makes a straight N-step run and then a run that is killed with SIGKILL
after its N/2 checkpoint, then a fresh process resumes the killed run for the remaining N/2
steps; the final states must be identical bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

sys.path.insert(0, str(Path(__file__).parent))  # train_fakes, also when run as a script

from train_fakes import make_fake_rollout, task_batches, tiny_model  # noqa: E402

from agentrl_jax.algorithms import AlgorithmConfig, LossTermConfig  # noqa: E402
from agentrl_jax.train import (  # noqa: E402
    Checkpointer,
    CheckpointMismatchError,
    CheckpointRestoreError,
    CorruptCheckpointWarning,
    MetricsLogger,
    RLConfig,
    TrainConfig,
    init_train_state,
    make_train_step,
    read_metrics,
    train,
)

# A restore that fails mid-read leaves Orbax's pending read coroutines to be closed with its
# event loop, whenever the garbage collector gets to them (possibly during a later test);
# Python reports them as "unraisable" exceptions. They are Orbax's and harmless.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

PPO = TrainConfig(
    rl=RLConfig(checkpoint={"every": 1, "keep": 2}),
    algorithm=AlgorithmConfig(
        advantage="gae",
        loss_terms=(
            LossTermConfig("policy_clip"),
            LossTermConfig("kl", 0.001),
            LossTermConfig("value_clip"),
        ),
    ),
)


@functools.lru_cache(maxsize=None)
def _ppo_state():
    """A PPO state (policy, reference, critic, both optimizers) with non-trivial values."""
    state = init_train_state(tiny_model(), PPO)
    rng = np.random.default_rng(0)
    noisy = jax.tree.map(
        lambda x: (
            jnp.asarray(np.asarray(x) + rng.standard_normal(x.shape), x.dtype)
            if jnp.issubdtype(x.dtype, jnp.floating)
            else x
        ),
        state,
    )
    return noisy.replace(
        rng=jax.random.PRNGKey(123),
        data_position=jnp.asarray(17, jnp.int32),
        skipped_updates=jnp.asarray(2, jnp.int32),
    )


def _at_step(state, step: int):
    return state.replace(step=jnp.asarray(step, jnp.int32))


def _bits(x) -> np.ndarray:
    """The raw bytes of an array (so -0.0 != 0.0 and NaN payloads count)."""
    return np.frombuffer(np.ascontiguousarray(np.asarray(x)).tobytes(), np.uint8)


def _assert_identical(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        assert np.asarray(x).dtype == np.asarray(y).dtype, path
        np.testing.assert_array_equal(_bits(x), _bits(y), err_msg=jax.tree_util.keystr(path))


def _save_steps(directory, steps, *, keep=5):
    checkpointer = Checkpointer(directory, every=1, keep=keep)
    for step in steps:
        checkpointer.save(_at_step(_ppo_state(), step), PPO, {"model_dir": "/models/tiny"})
    checkpointer.wait()
    return checkpointer


# ------------------------------------------------------------------------- round trip, keep, every


def test_round_trip_restores_everything_bit_for_bit(tmp_path):
    _save_steps(tmp_path, [3]).close()
    restored = Checkpointer(tmp_path, every=1, keep=2).restore_latest(
        init_train_state(tiny_model(seed=1), PPO)
    )
    assert restored.step == 3 and restored.path == tmp_path / "3" and restored.skipped == ()
    _assert_identical(restored.state, _at_step(_ppo_state(), 3))
    assert restored.train_config == PPO
    assert restored.config["model_dir"] == "/models/tiny"


def test_keeps_the_newest_and_saves_every_k_steps(tmp_path):
    checkpointer = _save_steps(tmp_path, [1, 2, 3, 4, 5], keep=2)
    assert checkpointer.steps() == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["4", "5"]
    every_3 = Checkpointer(tmp_path / "other", every=3, keep=1)
    assert [s for s in range(1, 11) if every_3.should_save(s, total_steps=10)] == [3, 6, 9, 10]


def test_no_checkpoint_restores_to_none(tmp_path):
    assert Checkpointer(tmp_path, every=1, keep=1).restore_latest(_ppo_state()) is None


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="Checkpointer keep: must be an int >= 1, got 0"):
        Checkpointer(tmp_path, every=1, keep=0)


# ------------------------------------------------------------------------- corrupt and partial


def _garble_data(step_dir: Path) -> None:
    for f in (step_dir / "state" / "d").iterdir():
        f.write_bytes(b"not a checkpoint" * 4)


@pytest.mark.parametrize(
    "damage", ["corrupt data", "missing manifest", "missing state", "missing config"]
)
def test_a_damaged_latest_checkpoint_is_reported_and_the_previous_one_used(tmp_path, damage):
    _save_steps(tmp_path, [1, 2]).close()
    latest = tmp_path / "2"
    if damage == "corrupt data":
        _garble_data(latest)
    elif damage == "missing manifest":
        (latest / "state" / "manifest.ocdbt").unlink()
    elif damage == "missing state":
        import shutil

        shutil.rmtree(latest / "state")
    else:
        (latest / "config" / "metadata").unlink()
    checkpointer = Checkpointer(tmp_path, every=1, keep=5)
    with pytest.warns(
        CorruptCheckpointWarning, match=f"checkpoint {latest} is corrupt or incomplete"
    ):
        restored = checkpointer.restore_latest(_ppo_state())
    assert restored.step == 1 and restored.skipped[0][0] == latest
    _assert_identical(restored.state, _at_step(_ppo_state(), 1))
    # The bad one is set aside (kept for inspection), so the resumed run can save step 2 again.
    assert (tmp_path / "2.corrupt").is_dir() and not latest.exists()
    checkpointer.save(_at_step(_ppo_state(), 2), PPO)
    checkpointer.wait()
    assert checkpointer.steps() == [1, 2]


def test_an_interrupted_save_is_reported_and_removed(tmp_path):
    _save_steps(tmp_path, [1]).close()
    leftover = tmp_path / "2.orbax-checkpoint-tmp-1234567"
    (leftover / "state").mkdir(parents=True)
    with pytest.warns(
        CorruptCheckpointWarning, match=f"checkpoint {leftover}: an interrupted save"
    ):
        checkpointer = Checkpointer(tmp_path, every=1, keep=5)
    assert not leftover.exists()
    assert checkpointer.restore_latest(_ppo_state()).step == 1


def test_when_every_checkpoint_is_damaged_the_error_lists_them(tmp_path):
    _save_steps(tmp_path, [1, 2]).close()
    for step in ("1", "2"):
        _garble_data(tmp_path / step)
    checkpointer = Checkpointer(tmp_path, every=1, keep=5)
    with pytest.warns(CorruptCheckpointWarning):
        with pytest.raises(
            CheckpointRestoreError, match=f"{tmp_path / '2'}: .*; {tmp_path / '1'}: "
        ):
            checkpointer.restore_latest(_ppo_state())


def _mismatch(directory, template, config=None) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("error", CorruptCheckpointWarning)  # not reported as corrupt
        with pytest.raises(CheckpointMismatchError) as error:
            Checkpointer(directory, every=1, keep=5).restore_latest(template, config)
    return str(error.value)


LEFT = (
    "It is left as it is (it is not corrupt): resume with the config that wrote it, or give "
    "this run another checkpoint directory"
)


def test_a_checkpoint_of_another_model_size_is_reported_as_such_and_left_in_place(tmp_path):
    _save_steps(tmp_path, [1]).close()
    other = init_train_state(tiny_model(hidden_size=32, head_dim=16), PPO)
    assert _mismatch(tmp_path, other) == (
        f"checkpoint step 1 at {tmp_path / '1'} was written by a different config: 101 array(s) "
        "of another shape or dtype, e.g. critic.backbone.embed_tokens.value is float32[16, 16] in "
        f"the checkpoint, float32[16, 32] in the run's state. {LEFT}"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]  # not moved aside as corrupt
    restored = Checkpointer(tmp_path, every=1, keep=5).restore_latest(_ppo_state())
    _assert_identical(restored.state, _at_step(_ppo_state(), 1))  # and still good for its run


def test_a_checkpoint_of_another_optimizer_is_reported_with_the_settings_that_differ(tmp_path):
    _save_steps(tmp_path, [1, 2]).close()
    unclipped = dataclasses.replace(
        PPO,
        rl=dataclasses.replace(
            PPO.rl, optimizer=dataclasses.replace(PPO.rl.optimizer, max_grad_norm=None)
        ),
    )
    assert _mismatch(tmp_path, init_train_state(tiny_model(), unclipped), unclipped) == (
        f"checkpoint step 2 at {tmp_path / '2'} was written by a different config: 62 array(s) "
        "only in the checkpoint, e.g. critic_opt.1.0.count; 62 array(s) only in the run's state, "
        "e.g. critic_opt.0.count; its train_config differs in rl.optimizer.max_grad_norm (1.0 "
        f"there, null here). {LEFT}"
    )
    grpo = TrainConfig(rl=RLConfig(checkpoint={"every": 1, "keep": 2}))  # no critic
    message = _mismatch(tmp_path, init_train_state(tiny_model(), grpo), grpo)
    assert message.startswith(
        f"checkpoint step 2 at {tmp_path / '2'} was written by a different "
        "config: 49 array(s) only in the checkpoint, e.g. "
        "critic.backbone.embed_tokens.value; its train_config differs in "
        'algorithm.advantage ("gae" there, "grpo" here), '
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]


# ------------------------------------------------------------------------- metrics on resume


def _lines(*steps) -> str:
    return "".join(json.dumps({"step": s, "loss": s / 10}) + "\n" for s in steps)


def test_resuming_keeps_every_line_up_to_the_restored_step_and_moves_later_ones(tmp_path):
    path = tmp_path / "metrics.jsonl"
    cut = '{"step": 6, "lo'  # the line a kill interrupted
    path.write_text(_lines(1, 2) + "not json, kept\n" + _lines(3, 4, 5) + cut)
    logger = MetricsLogger(path, resume_step=3)
    assert path.read_text() == _lines(1, 2) + "not json, kept\n" + _lines(3)
    assert logger.superseded == 3
    assert (tmp_path / "metrics.jsonl.superseded").read_text() == _lines(4, 5) + cut + "\n"
    logger.log(4, {"loss": 0.4})
    assert path.read_text().endswith('{"step": 4, "loss": 0.4}\n')
    # A second resume from the same step changes nothing before it and appends what it moves.
    MetricsLogger(path, resume_step=3)
    assert path.read_text() == _lines(1, 2) + "not json, kept\n" + _lines(3)
    assert (tmp_path / "metrics.jsonl.superseded").read_text() == (
        _lines(4, 5) + cut + "\n" + '{"step": 4, "loss": 0.4}\n'
    )


def test_resuming_at_the_last_step_leaves_the_file_untouched(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(_lines(1, 2, 3))
    before = path.stat().st_mtime_ns, path.stat().st_ino
    assert MetricsLogger(path, resume_step=3).superseded == 0
    assert path.read_text() == _lines(1, 2, 3)
    assert (path.stat().st_mtime_ns, path.stat().st_ino) == before  # not even rewritten
    assert not (tmp_path / "metrics.jsonl.superseded").exists()


def test_split_after_step_is_pure_and_keeps_non_records():
    from agentrl_jax.train.sinks import split_after_step

    text = _lines(1) + '["a list"]\n{"no_step": 1}\n{"step": true}\n' + _lines(2) + '{"st'
    kept, later = split_after_step(text, 1)
    assert kept == [_lines(1).strip(), '["a list"]', '{"no_step": 1}', '{"step": true}']
    assert later == [_lines(2).strip(), '{"st']
    assert split_after_step("", 0) == ([], [])


# ----------------------------------------------------------------------- exact resume after SIGKILL

STEPS = 4  # N; the killed run is stopped after its N/2 checkpoint
MARKER = "CHECKPOINTED"


def _config(staleness: int) -> TrainConfig:
    return TrainConfig(
        rl=RLConfig(
            optimizer={"learning_rate": 1e-2},
            checkpoint={"every": STEPS // 2, "keep": 2},
            asynchronous={"max_staleness": staleness},
            steps=STEPS,
        )
    )


RUN_CONFIG = _config(0)


def _run(mode: str, workdir: Path, staleness: int = 0) -> None:
    """Script entry: one training process of the resume test (see the module docstring)."""
    RUN_CONFIG = _config(staleness)  # noqa: N806 - the module's, with this run's staleness
    model = tiny_model()
    graphdef = nnx.split(model)[0]
    rollout = make_fake_rollout(graphdef, group_size=4)
    tasks = task_batches(num_tasks=5, groups_per_batch=2)
    state = init_train_state(model, RUN_CONFIG)
    step = make_train_step(graphdef, RUN_CONFIG, donate=True)
    checkpointer = (
        Checkpointer.from_config(workdir / "checkpoints", RUN_CONFIG)
        if mode != "straight"
        else None
    )
    resume_step, pending = None, []
    if mode == "resume":
        restored = checkpointer.restore_latest(state)
        state, resume_step = restored.state, restored.step
        pending = [
            dataclasses.replace(p, rng=jnp.asarray(p.rng))
            for p in checkpointer.restore_pending(restored)
        ]
        assert len(pending) == staleness  # the batches sampled ahead of the checkpoint

    def on_step(state, metrics):
        if mode == "killed" and int(state.step) == STEPS // 2:
            checkpointer.wait()
            print(MARKER, flush=True)
            time.sleep(600)  # the parent kills us here

    logger = MetricsLogger(workdir / "metrics.jsonl", resume_step=resume_step)
    state = train(
        state,
        step,
        rollout,
        tasks,
        RUN_CONFIG,
        checkpointer=checkpointer,
        logger=logger,
        progress=False,
        on_step=on_step,
        pending=pending,
    )
    leaves = {f"{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(state))}
    np.savez(workdir / "final.npz", **leaves)
    (workdir / "resumed_from.json").write_text(json.dumps(resume_step))


def _spawn(runs: list[tuple[str, Path]], staleness: int) -> subprocess.Popen:
    """One process making the ``(mode, workdir)`` runs one after another."""
    for _, workdir in runs:
        workdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    args = [str(arg) for run in runs for arg in run]
    return subprocess.Popen(
        [sys.executable, __file__, *args, str(staleness)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
@pytest.mark.parametrize("staleness", [0, 1], ids=["synchronous", "max_staleness_1"])
def test_resume_after_sigkill_is_bit_for_bit_the_straight_run(tmp_path, staleness):
    """Asynchronous (``max_staleness`` 1): the checkpoint holds the batch sampled ahead of it,
    so the resumed run trains on the same batches and ends with the same bits and metrics."""
    # The straight run, then the killed one, in one process (one start for both; the straight
    # run is the reference, and nothing it leaves in the process can reach the resumed run,
    # which starts afresh from the checkpoint); the resumed run loads the programs they
    # compiled from the test session's compilation cache instead of compiling them too.
    straight = tmp_path / "straight"
    killed = _spawn([("straight", straight), ("killed", tmp_path / "killed")], staleness)
    line = killed.stdout.readline()  # blocks until the N/2 checkpoint is on disk
    assert line.strip() == MARKER, killed.communicate()[1][-3000:]
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert killed.returncode == -signal.SIGKILL
    assert Checkpointer(tmp_path / "killed" / "checkpoints", every=1, keep=5).steps() == [
        STEPS // 2
    ]

    resumed = _spawn([("resume", tmp_path / "killed")], staleness)
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    assert (straight / "final.npz").is_file()  # the straight run finished before the kill
    assert json.loads((tmp_path / "killed" / "resumed_from.json").read_text()) == STEPS // 2
    want, got = (
        np.load(tmp_path / "straight" / "final.npz"),
        np.load(tmp_path / "killed" / "final.npz"),
    )
    assert sorted(want.files) == sorted(got.files)
    for name in want.files:  # params, optimizer moments, step, key, data position: every bit
        np.testing.assert_array_equal(_bits(got[name]), _bits(want[name]), err_msg=f"leaf {name}")
    resumed_metrics = read_metrics(tmp_path / "killed" / "metrics.jsonl")
    assert [r["step"] for r in resumed_metrics] == list(range(1, STEPS + 1))

    def untimed(records):  # everything but wall-clock times and rates
        return [
            {k: v for k, v in r.items() if not k.startswith("time/") and not k.endswith("_per_s")}
            for r in records
        ]

    assert untimed(resumed_metrics) == untimed(
        read_metrics(tmp_path / "straight" / "metrics.jsonl")
    )
    if staleness:
        assert [r["staleness_max"] for r in resumed_metrics] == [0.0] + [1.0] * (STEPS - 1)
    initial = jax.tree.leaves(init_train_state(tiny_model(), RUN_CONFIG))  # same leaf order
    assert int(want["0"]) == STEPS  # leaf 0 is the step counter
    assert all(
        not np.array_equal(want[str(i)], initial[i])
        for i in range(
            1, 1 + len(jax.tree.leaves(init_train_state(tiny_model(), RUN_CONFIG).policy))
        )
    )  # every policy parameter was trained


if __name__ == "__main__":
    *_runs, _staleness = sys.argv[1:]
    for _mode, _workdir in zip(_runs[::2], _runs[1::2]):  # (mode, workdir) pairs, in order
        _run(_mode, Path(_workdir), int(_staleness))


# ----------------------------------------------------------------------- batches sampled ahead


def _pending_checkpoint(directory):
    """A step-3 checkpoint holding one batch sampled ahead; that batch."""
    from train_fakes import random_trajectory

    from agentrl_jax.train.batch import Produced, TrainBatch

    ahead = Produced(
        TrainBatch(random_trajectory(5)), {"R_multi": 0.25}, jax.random.PRNGKey(9), 4, 2
    )
    checkpointer = Checkpointer(directory, every=1, keep=2)
    checkpointer.save(_at_step(_ppo_state(), 3), PPO, pending=[ahead])
    checkpointer.wait()
    return checkpointer, ahead


def test_batches_sampled_ahead_round_trip_and_damage_is_named(tmp_path):
    """An asynchronous run's queue comes back bit for bit; a checkpoint whose queue is gone
    or whose description was tampered with is a clear error naming it, not a crash or a
    misread queue."""
    checkpointer, ahead = _pending_checkpoint(tmp_path)
    restored = checkpointer.restore_latest(init_train_state(tiny_model(seed=1), PPO))
    (got,) = checkpointer.restore_pending(restored)
    _assert_identical(got.batch.trajectory, ahead.batch.trajectory)
    np.testing.assert_array_equal(got.rng, np.asarray(ahead.rng))
    assert (got.metrics, got.position, got.version) == ({"R_multi": 0.25}, 4, 2)

    bad = dict(restored.config, pending=[{"metrics": {}, "position": "4", "version": 2}])
    with pytest.raises(CheckpointRestoreError, match=r"checkpoint .*3: its batches sampled ahead"):
        checkpointer.restore_pending(dataclasses.replace(restored, config=bad))
    shutil.rmtree(tmp_path / "3" / "pending")
    with pytest.raises(CheckpointRestoreError, match="cannot be read"):
        checkpointer.restore_pending(restored)
