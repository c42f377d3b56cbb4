"""Every restored item is checked against what the run expects (issue #55, part 3), with
hostile inputs: the batches sampled ahead (``pending``) of another run's shapes, count or
settings, or with a tampered description; a LoRA checkpoint whose base fingerprint is missing,
null or malformed; a safetensors shard index naming odd files. Each is refused with the
project's error naming the checkpoint (or index) and what differs, and a refused checkpoint is
left byte for byte as it was; the untampered checkpoint still resumes.

Cheap on purpose: one tiny state saved once per module and copied per case, no train step
compiled (the batches ahead are built by hand as the loop lays them out: positions one past
the state's, versions ``max(0, j - k)``)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import shutil
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from train_fakes import random_trajectory, tiny_model

from agentrl_jax.algorithms import AlgorithmConfig, LossTermConfig
from agentrl_jax.errors import CheckpointError
from agentrl_jax.models import load_qwen3, lora
from agentrl_jax.models.checkpoints import export_qwen3
from agentrl_jax.models.safetensors_reader import INDEX_FILE, index_checkpoint
from agentrl_jax.train import RLConfig, TrainConfig, init_train_state
from agentrl_jax.train.batch import Produced, TrainBatch
from agentrl_jax.train.checkpoint import (
    BatchShape,
    Checkpointer,
    CheckpointMismatchError,
    CorruptCheckpointWarning,
)
from agentrl_jax.train.state import train_model

# A failed Orbax read leaves coroutines for the garbage collector (see test_train_checkpoint).
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

NO_KL = AlgorithmConfig(loss_terms=(LossTermConfig("policy_clip"),))  # no reference: small
CONFIG = TrainConfig(
    rl=RLConfig(
        tasks_per_step=2,
        group_size=4,
        asynchronous={"max_staleness": 2},
        checkpoint={"every": 1, "keep": 2},
    ),
    algorithm=NO_KL,
)
SHAPE = BatchShape(rows=8, turns=3, tokens=24)  # what this run's rollouts produce
STEP, POSITION = 3, 5  # the saved state's step and data position
LEFT = (
    "It is left as it is: resume with the config that wrote it, or give this run another "
    "checkpoint directory"
)


def _rl(**changes) -> TrainConfig:
    return dataclasses.replace(CONFIG, rl=dataclasses.replace(CONFIG.rl, **changes))


@functools.lru_cache(maxsize=None)
def _template():
    return init_train_state(tiny_model(seed=1), CONFIG)


def _ahead() -> list[Produced]:
    """The queue of a run with max_staleness 2 saved after 3 updates: batches 3 and 4, drawn
    at positions 6 and 7 by the parameters after updates 1 and 2 (the second cut narrower, as
    the run's rollouts cut batches to their longest row)."""
    return [
        Produced(
            TrainBatch(random_trajectory(seed, rows=8, tokens=tokens, turns=3)),
            {"R_multi": 0.25 * seed},
            jax.random.PRNGKey(seed),
            POSITION + 1 + i,
            max(0, STEP + i - 2),
        )
        for i, (seed, tokens) in enumerate([(1, 24), (2, 16)])
    ]


def _digest(directory: Path) -> str:
    """Every file's relative path and bytes, hashed: a checkpoint left exactly as it was."""
    h = hashlib.sha256()
    for path in sorted(directory.rglob("*")):
        h.update(str(path.relative_to(directory)).encode())
        if path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("pending") / "checkpoints"
    state = init_train_state(tiny_model(), CONFIG).replace(
        step=jnp.asarray(STEP, jnp.int32),
        data_position=jnp.asarray(POSITION, jnp.int32),
        rng=jax.random.PRNGKey(123),
    )
    with Checkpointer(directory, every=1, keep=2) as checkpointer:
        checkpointer.save(state, CONFIG, pending=_ahead())
        checkpointer.wait()
    return directory


@pytest.fixture
def copy(saved, tmp_path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / "checkpoints"))


def _restore(directory: Path, config: TrainConfig | None = CONFIG, shape=SHAPE) -> list:
    with warnings.catch_warnings():
        warnings.simplefilter("error", CorruptCheckpointWarning)  # never set aside as corrupt
        with Checkpointer(directory, every=1, keep=2) as checkpointer:
            restored = checkpointer.restore_latest(_template(), config)
            return checkpointer.restore_pending(restored, shape)


def _refused(directory: Path, config: TrainConfig | None = CONFIG, shape=SHAPE) -> str:
    """The message of the refusal; the checkpoint must be unchanged, in place."""
    before = _digest(directory)
    with pytest.raises(CheckpointMismatchError) as error:
        _restore(directory, config, shape)
    assert _digest(directory) == before
    assert sorted(p.name for p in directory.iterdir()) == [str(STEP)]
    return str(error.value)


def _pending_message(directory: Path, problem: str = "") -> str:
    """The refusal's message, or with no ``problem`` its start."""
    start = (
        f"checkpoint {directory / str(STEP)}: its batches sampled ahead (pending) do not fit "
        "this run: "
    )
    return f"{start}{problem}. {LEFT}" if problem else start


# ------------------------------------------------------------------ the batches sampled ahead


def test_the_untampered_checkpoint_resumes_with_its_batches(copy):
    got = _restore(copy)
    want = _ahead()
    assert [(p.position, p.version, p.metrics) for p in got] == [
        (p.position, p.version, p.metrics) for p in want
    ]
    for a, b in zip(got, want, strict=True):
        for x, y in zip(jax.tree.leaves(a.batch), jax.tree.leaves(b.batch), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        np.testing.assert_array_equal(np.asarray(a.rng), np.asarray(b.rng))
    assert len(_restore(copy, config=None, shape=None)) == 2  # the checks that need no config


@pytest.mark.parametrize(
    "config, shape, problem",
    [
        (
            _rl(tasks_per_step=4),
            BatchShape(turns=3, tokens=24),  # rows: the run's tasks_per_step x group_size
            "batch 0's trajectory.tokens is int32[8, 24], expected int32[16, 24] (16 rows: this "
            "run's rl.tasks_per_step 4 x rl.group_size 4; 3 turns: this run's rollouts)",
        ),
        (
            CONFIG,
            BatchShape(rows=8, turns=3, tokens=16),  # another max_context
            "batch 0's trajectory.tokens is int32[8, 24], expected at most 16 tokens wide "
            "(this run's rollouts)",
        ),
        (
            CONFIG,
            BatchShape(rows=8, turns=4, tokens=24),  # another t_max
            "batch 0's trajectory.turn_mask is bool[8, 3], expected bool[8, 4] (8 rows: this "
            "run's rollouts; 4 turns: this run's rollouts)",
        ),
        (
            _rl(asynchronous={"max_staleness": 1}),
            SHAPE,
            "it holds 2 batch(es), expected at most this run's rl.asynchronous.max_staleness "
            "(1) sampled ahead",
        ),
        (
            _rl(asynchronous={"max_staleness": 0}),  # a synchronous run would drop them silently
            SHAPE,
            "it holds 2 batch(es), expected at most this run's rl.asynchronous.max_staleness "
            "(0) sampled ahead",
        ),
        (
            _rl(process_reward_coef=0.5),
            SHAPE,
            "batch 0 has no step scores, expected them: this run's rl.process_reward_coef is 0.5",
        ),
        (
            dataclasses.replace(CONFIG, loss_positions=4),
            SHAPE,
            "batch 0: TrainConfig.loss_positions=4 is below the 6 sampled tokens of row 6: raise "
            "it (at least turns x response tokens per row)",
        ),
    ],
    ids=["tasks_per_step", "max_context", "t_max", "max_staleness", "synchronous", "scores",
         "loss_positions"],
)  # fmt: skip
def test_batches_of_another_run_are_refused_and_left_in_place(copy, config, shape, problem):
    assert _refused(copy, config, shape) == _pending_message(copy, problem)


def _tamper(directory: Path, edit, raw: str | None = None, step: int = STEP) -> None:
    """Edits the saved JSON of ``step`` (``edit(payload)``); ``raw`` replaces the string "RAW"
    in the written text (numbers JSON writers never write, such as 1e400)."""
    path = directory / str(step) / "config" / "metadata"
    payload = json.loads(path.read_text())
    edit(payload)
    text = json.dumps(payload)
    path.write_text(text if raw is None else text.replace('"RAW"', raw))


def _set(key: str, value, batch: int = 0):
    return lambda payload: payload["pending"][batch].__setitem__(key, value)


@pytest.mark.parametrize(
    "edit, raw, problem",
    [
        (
            _set("position", -1),
            None,
            "batch 0's data position is -1, expected an int in [6, 6] (1 draw(s) per batch "
            "after the restored state's data position 5)",
        ),
        (
            _set("position", 10**400),
            None,
            "batch 0's data position is 1" + "0" * 116 + "..., expected an int in [6, 6]",
        ),
        (_set("position", "RAW"), "1e400", "batch 0's data position is Infinity, expected"),
        (_set("position", "RAW"), "NaN", "batch 0's data position is NaN, expected"),
        (_set("position", "6"), None, "batch 0's data position is \"6\", expected"),
        (_set("position", True), None, "batch 0's data position is true, expected"),
        (
            _set("position", 8, batch=1),
            None,
            "batch 1's data position is 8, expected an int in [7, 7] (1 draw(s) per batch "
            "after batch 0's data position 6)",
        ),
        (
            _set("version", 10**6),
            None,
            "batch 0's policy version is 1000000, expected an int in [1, 3] (no newer than the "
            "checkpoint's step 3; at most rl.asynchronous.max_staleness 2 behind step 3, where it "
            "trains)",
        ),
        (_set("version", -1), None, "batch 0's policy version is -1, expected an int in [1, 3]"),
        (
            _set("version", 0, batch=1),
            None,
            "batch 1's policy version is 0, expected an int in [2, 3] (no newer than the "
            "checkpoint's step 3; at most rl.asynchronous.max_staleness 2 behind step 4, where it "
            "trains; no older than batch 0's)",
        ),
        (
            _set("metrics", {"R_multi": [[["deep"]]]}),
            None,
            "batch 0's metrics are {\"R_multi\": [[[\"deep\"]]]}, expected an object of numbers",
        ),
        (_set("metrics", {"R_multi": 10**400}), None, "batch 0's metrics are {\"R_multi\": 1000"),
        (_set("extra", 1), None, "batch 0's description is {"),
        (
            lambda payload: payload.__setitem__("pending", "abc"),
            None,
            "its description is \"abc\", expected a list of batches",
        ),
        (
            lambda payload: payload.__setitem__("pending", {"0": 1}),
            None,
            "its description is {\"0\": 1}, expected a list of batches",
        ),
        (
            lambda payload: payload["pending"].__setitem__(1, [5]),
            None,
            "batch 1's description is [5], expected an object of metrics, position, version",
        ),
    ],
    ids=["position -1", "position 10**400", "position 1e400", "position NaN",
         "position string", "position bool", "position skips a draw", "version 10**6",
         "version -1", "version goes back", "metrics nested", "metrics huge int",
         "extra key", "a string", "an object", "a list"],
)  # fmt: skip
def test_a_tampered_description_is_refused_and_left_in_place(copy, edit, raw, problem):
    _tamper(copy, edit, raw)
    message = _refused(copy)
    assert message.startswith(_pending_message(copy) + problem), message
    assert message.endswith(LEFT) and len(message) < 600


def test_without_the_runs_config_the_description_is_still_bounded(copy):
    _tamper(copy, _set("version", 10**6))
    assert _refused(copy, config=None, shape=None) == _pending_message(
        copy,
        "batch 0's policy version is 1000000, expected an int in [0, 3] (no newer than the "
        "checkpoint's step 3)",
    )
    _tamper(copy, _set("version", 1))
    _tamper(copy, _set("position", 2**31))  # past what the state's int32 position holds
    assert _refused(copy, config=None, shape=None) == _pending_message(
        copy,
        "batch 0's data position is 2147483648, expected an int in [0, 2147483647] (a data "
        "position the state can hold)",
    )


@pytest.mark.parametrize("value", [None, 10**400, "", ["/models/tiny"]])
def test_an_evaluated_checkpoint_naming_no_model_directory_is_the_policy_error(copy, value):
    from agentrl_jax.evaluation.policies import PolicyLoadError, load_policy

    _tamper(copy, lambda payload: payload.__setitem__("model_dir", value))
    with pytest.raises(PolicyLoadError) as error:
        load_policy(copy)
    assert str(error.value).startswith(
        f"policy {copy / str(STEP)}: the checkpoint's 'model_dir' is "
    )
    assert str(error.value).endswith(
        "not a directory name; pass the Hugging Face directory of the model it was trained from"
    )
    assert len(str(error.value)) < 400


# ------------------------------------------------------------------ a LoRA base's fingerprint

LORA_CONFIG = TrainConfig(
    rl=RLConfig(lora=lora.LoraConfig(rank=2), checkpoint={"every": 1, "keep": 2}),
    algorithm=NO_KL,
)


@functools.lru_cache(maxsize=None)
def _lora_template():
    return init_train_state(train_model(tiny_model(seed=6), LORA_CONFIG), LORA_CONFIG)


@pytest.fixture(scope="module")
def lora_saved(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("lora") / "checkpoints"
    with Checkpointer(directory, every=1, keep=2) as checkpointer:
        checkpointer.save(_lora_template(), LORA_CONFIG)
        checkpointer.wait()
    return directory


def _fingerprint(value):
    def edit(payload):
        if value == "delete":
            del payload["base_fingerprint"]
        else:
            n = len(payload["base_fingerprint"])
            payload["base_fingerprint"] = value(n) if callable(value) else value

    return edit


@pytest.mark.parametrize(
    "value, raw, problem",
    [
        ("delete", None, "it has no base_fingerprint"),
        (None, None, "its base_fingerprint is null"),
        (lambda n: ["RAW"] * n, "1e400", "its base_fingerprint[0] is Infinity"),
        (lambda n: [10**400] * n, None, "its base_fingerprint[0] is 1000000000"),
        (lambda n: [float("nan")] * n, None, "its base_fingerprint[0] is NaN"),
        (lambda n: [1.0] * (n + 1), None, "its base_fingerprint holds <n + 1> numbers"),
        (lambda n: [1.0] * (n - 1) + [True], None, "its base_fingerprint[<n - 1>] is true"),
        (lambda n: ["1.0"] * n, None, 'its base_fingerprint[0] is "1.0"'),
        ({"sums": [1.0]}, None, 'its base_fingerprint is {"sums": [1.0]}'),
        ("a" * 1000, None, 'its base_fingerprint is "aaaa'),
    ],
    ids=["deleted", "null", "1e400", "10**400", "NaN", "one too many", "a bool", "strings",
         "an object", "a long string"],
)  # fmt: skip
def test_a_lora_checkpoint_without_a_usable_fingerprint_is_refused_and_kept(
    lora_saved, tmp_path, value, raw, problem
):
    directory = Path(shutil.copytree(lora_saved, tmp_path / "checkpoints"))
    n = 2 * len(jax.tree.leaves(_lora_template().base))
    _tamper(directory, _fingerprint(value), raw, step=0)
    before = _digest(directory)
    wanted = (
        f"expected a list of {n} finite numbers (the sum and sum of squares of each of this "
        "run's base weights)"
    )
    for restore in ("latest", "step"):
        with Checkpointer(directory, every=1, keep=2) as checkpointer:
            with pytest.raises(CheckpointMismatchError) as error:
                if restore == "latest":
                    checkpointer.restore_latest(_lora_template(), LORA_CONFIG)
                else:
                    checkpointer.restore_step(_lora_template(), 0)
        message = str(error.value)
        assert message.startswith(
            f"checkpoint step 0 at {directory / '0'} holds LoRA adapters, but "
            + problem.replace("<n + 1>", str(n + 1)).replace("<n - 1>", str(n - 1))
        )
        assert message.endswith(
            f"{wanted}: the base model they were trained on cannot be checked, and may be "
            "another base model than this run's. It is left as it is; resume from a checkpoint "
            "this project wrote for this base, or give this run another checkpoint directory"
        )
        assert len(message) < 700
        assert _digest(directory) == before


def test_the_untampered_lora_checkpoint_resumes(lora_saved, tmp_path):
    directory = Path(shutil.copytree(lora_saved, tmp_path / "checkpoints"))
    with Checkpointer(directory, every=1, keep=2) as checkpointer:
        assert checkpointer.restore_latest(_lora_template(), LORA_CONFIG).step == 0


# ------------------------------------------------------------------ the safetensors shard index

FIRST = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sharded") / "model"
    export_qwen3(tiny_model(), out, max_shard_bytes=4_000)
    return out


@pytest.mark.parametrize(
    "value, problem",
    [
        ("model\x00.safetensors", " = 'model\\x00.safetensors' holds a NUL byte"),
        ("/etc/passwd", " = '/etc/passwd' is an absolute path"),
        ("..", " = '..' resolves to"),
        ("../x.safetensors", " = '../x.safetensors' resolves to"),
        ("sub/x.safetensors", " = 'sub/x.safetensors' is a path, not a file name"),
        (".", " = '.' is a path, not a file name"),
        ("a\\b.safetensors", " = 'a\\\\b.safetensors' is a path, not a file name"),
        ("\ud800.safetensors", " = '\\ud800.safetensors' holds characters no file name can hold"),
        ("x" * 5000, " = '" + "x" * 116 + "... cannot be looked up (File name too long)"),
        (5, " must be a file name, got 5"),
        (None, " must be a file name, got None"),
        ({"a": 1}, " must be a file name, got {'a': 1}"),
    ],
    ids=["NUL", "absolute", "dotdot", "up and back", "separator", "dot", "backslash",
         "surrogate", "long", "a number", "null", "an object"],
)  # fmt: skip
def test_odd_shard_names_are_the_loaders_error_naming_the_index(sharded, tmp_path, value, problem):
    model_dir = Path(shutil.copytree(sharded, tmp_path / "model"))
    (model_dir / "sub").mkdir()
    (model_dir / "sub" / "x.safetensors").write_bytes((sharded / INDEX_FILE).read_bytes())
    index_path = model_dir / INDEX_FILE
    index = json.loads(index_path.read_text())
    index["weight_map"][FIRST] = value
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as error:
        load_qwen3(model_dir)
    message = str(error.value)
    assert message.startswith(f"{index_path}: weight_map['{FIRST}']{problem}"), message
    assert len(message) < 400


def test_a_weight_map_that_is_not_names_to_names_is_named(tmp_path):
    index_path = tmp_path / INDEX_FILE
    for weight_map, problem in [
        (["a"], "field 'weight_map' must be an object of tensor name -> file name, got an array"),
        ("a", "field 'weight_map' must be an object of tensor name -> file name, got a string"),
        ({"w" * 500: 7}, f"weight_map['{'w' * 116}...] must be a file name, got 7"),
    ]:
        index_path.write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(CheckpointError) as error:
            index_checkpoint(tmp_path)
        assert str(error.value) == f"{index_path}: {problem}"
    index_path.write_text('{"weight_map": {"x": 1' + "0" * 5000 + "}}")  # past json's digits
    with pytest.raises(CheckpointError, match=r"the index holds an integer of 5,001 digits"):
        index_checkpoint(tmp_path)


def test_the_untampered_sharded_index_loads(sharded):
    assert FIRST in index_checkpoint(sharded)


@pytest.mark.parametrize(
    "experts, problem",
    [
        (np.full((8, 24, 2, 2), -1, np.int16), ""),  # an MoE policy's record: M = k = 2
        (None, ""),  # a dense policy's: left out of the checkpoint, restored empty
        (
            np.zeros((8, 24, 2, 2), np.float32),
            "batch 0's trajectory.experts is float32[8, 24, 2, 2]",
        ),
        (np.zeros((8, 24, 2), np.int16), "batch 0's trajectory.experts is int16[8, 24, 2]"),
        (np.zeros((4, 24, 2, 2), np.int16), "batch 0's trajectory.experts is int16[4, 24, 2, 2]"),
        ("experts", 'batch 0\'s trajectory.experts is "experts", expected an array'),
    ],
    ids=["moe", "dense", "float", "rank 3", "other rows", "a string"],
)
def test_the_recorded_experts_of_a_batch_ahead_are_checked(experts, problem):
    """A batch sampled ahead by an MoE policy carries the experts of its sampled tokens
    (routing replay): ``int16[N, L, M, k]``; anything else is named, never read."""
    from agentrl_jax.train.checkpoint import _pending_arrays
    from agentrl_jax.train.restore_checks import (
        PendingExpectation,
        array_spec,
        pending_arrays_problem,
    )

    arrays, _ = _pending_arrays(_ahead()[:1])
    if experts is None:
        arrays["0"]["trajectory"].pop("experts", None)
    else:
        arrays["0"]["trajectory"]["experts"] = experts
    expected = PendingExpectation(
        step=STEP,
        data_position=POSITION,
        position_max=2**31 - 1,
        rng=array_spec(np.asarray(jax.random.PRNGKey(0))),
        batch=BatchShape(rows=8, turns=3, tokens=24),
    )
    got = pending_arrays_problem(arrays, 1, expected)
    assert got.startswith(problem) if problem else got == "", got
