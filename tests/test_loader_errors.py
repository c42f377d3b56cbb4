"""Loaders that name what is wrong: every malformed safetensors header, shard index, config.json
and reproduction YAML raises CheckpointError / ConfigError with the exact message below, which
names the file and the field; none is read as valid and none escapes as a library's own error.

The bad files are built by hand (bytes) in tmp_path; the model-level cases start from a tiny
valid checkpoint written by ``export_qwen3``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file
from train_fakes import tiny_model

from agentrl_jax.errors import CheckpointError, ConfigError
from agentrl_jax.models import Qwen3Config, export_qwen3, load_qwen3
from agentrl_jax.models.checkpoints import INDEX_FILE, index_checkpoint, read_safetensors_header
from agentrl_jax.reproduce.config import default_config, load_config

DTYPE_LIST = "F64, F32, F16, BF16, F8_E4M3, F8_E5M2, I64, I32, I16, I8, U64, U32, U16, U8, BOOL"


def _raises(error: type[Exception], call, *args) -> str:
    """The message of the ``error`` that ``call(*args)`` raises."""
    with pytest.raises(error) as info:
        call(*args)
    return str(info.value)


# ---------------------------------------------------------------------------- safetensors headers
def _st(path: Path, header: dict | bytes, data: bytes = b"", *, length: int | None = None) -> Path:
    """A safetensors file: 8-byte little-endian header length, the header, then the data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes((len(raw) if length is None else length).to_bytes(8, "little") + raw + data)
    return path


def _f32(begin: int, end: int, shape=(2,)) -> dict:
    return {"dtype": "F32", "shape": list(shape), "data_offsets": [begin, end]}


HEADER_CASES = {
    # name: (file contents as (header, data, length) or raw bytes, message after "<path>: ")
    "shorter than the length field": (
        b"abc",
        "not a safetensors file: 3 bytes, fewer than the 8 of the header length",
    ),
    "header length 0": (
        ({}, b"", 0),
        "not a safetensors file: header length 0 is too small for a JSON object",
    ),
    "header length past the file": (
        ({"a": _f32(0, 8)}, b"\0" * 8, 1000),
        "not a safetensors file: header length 1000 is more than the "
        "69 bytes after the length field",
    ),
    "header length over the limit": (
        ({}, b"", 2**40),
        "not a safetensors file: header length 1099511627776 is over the 100000000-byte limit",
    ),
    "bad JSON": (
        (b'{"a": ', b"", None),
        "safetensors header is not valid JSON (Expecting value at line 1, column 7)",
    ),
    "not UTF-8": (
        (b'{"\xff": 1}', b"", None),
        "safetensors header is not UTF-8 text (invalid start byte at byte 2)",
    ),
    "NaN": (
        (b'{"a": NaN}', b"", None),
        "safetensors header is not valid JSON (NaN is not a JSON value)",
    ),
    "a key twice": ((b'{"a": {}, "a": {}}', b"", None), "safetensors header has the key 'a' twice"),
    "an array": ((b"[1, 2]", b"", None), "safetensors header must be a JSON object, got an array"),
    "metadata not strings": (
        ({"__metadata__": {"format": 1}}, b"", None),
        "safetensors header field '__metadata__' must be an object of strings, got {'format': 1}",
    ),
    "entry not an object": (
        ({"a": 5}, b"", None),
        "tensor 'a': header entry must be an object "
        "with dtype, shape and data_offsets, got a number",
    ),
    "no data_offsets": (
        ({"a": {"dtype": "F32", "shape": [2]}}, b"", None),
        "tensor 'a': header entry has no 'data_offsets'",
    ),
    "unknown dtype": (
        ({"a": {**_f32(0, 8), "dtype": "F128"}}, b"\0" * 8, None),
        f"tensor 'a': dtype 'F128' is not a supported safetensors dtype ({DTYPE_LIST})",
    ),
    "dtype not a string": (
        ({"a": {**_f32(0, 8), "dtype": 4}}, b"\0" * 8, None),
        f"tensor 'a': dtype 4 is not a supported safetensors dtype ({DTYPE_LIST})",
    ),
    "negative dimension": (
        ({"a": _f32(0, 8, shape=(-2, -1))}, b"\0" * 8, None),
        "tensor 'a': shape must be a list of ints >= 0, got [-2, -1]",
    ),
    "shape not a list": (
        ({"a": {**_f32(0, 8), "shape": "2"}}, b"\0" * 8, None),
        "tensor 'a': shape must be a list of ints >= 0, got '2'",
    ),
    "float dimension": (
        ({"a": _f32(0, 8, shape=(2.0,))}, b"\0" * 8, None),
        "tensor 'a': shape must be a list of ints >= 0, got [2.0]",
    ),
    "negative offsets": (
        ({"a": _f32(-8, 0)}, b"\0" * 8, None),
        "tensor 'a': data_offsets must be [begin, end] with 0 <= begin <= end, got [-8, 0]",
    ),
    "reversed offsets": (
        ({"a": _f32(8, 0)}, b"\0" * 8, None),
        "tensor 'a': data_offsets must be [begin, end] with 0 <= begin <= end, got [8, 0]",
    ),
    "one offset": (
        ({"a": {**_f32(0, 8), "data_offsets": [0]}}, b"\0" * 8, None),
        "tensor 'a': data_offsets must be [begin, end] with 0 <= begin <= end, got [0]",
    ),
    "size x shape is not the byte count": (
        ({"a": _f32(0, 8, shape=(3,))}, b"\0" * 8, None),
        "tensor 'a': shape [3] of F32 needs 12 bytes, but data_offsets [0, 8] hold 8",
    ),
    "offsets past the data": (
        ({"a": _f32(0, 8)}, b"\0" * 4, None),
        "tensor 'a': data_offsets [0, 8] run past the end of the data (4 "
        "bytes after the header); the file is truncated or corrupt",
    ),
    "overlapping tensors": (
        ({"a": _f32(0, 8), "b": _f32(4, 12)}, b"\0" * 12, None),
        "tensors 'a' (data_offsets [0, 8]) and 'b' (data_offsets [4, 12]) overlap",
    ),
    "the same bytes twice": (
        ({"a": _f32(0, 8), "b": _f32(0, 8)}, b"\0" * 8, None),
        "tensors 'a' (data_offsets [0, 8]) and 'b' (data_offsets [0, 8]) overlap",
    ),
    "a gap between tensors": (
        ({"a": _f32(0, 8), "b": _f32(12, 20)}, b"\0" * 20, None),
        "tensor 'b': data_offsets [12, 20] leave bytes [8, 12) after tensor "
        "'a' unused; tensors must be contiguous",
    ),
    "a gap at the start": (
        ({"a": _f32(4, 12)}, b"\0" * 12, None),
        "tensor 'a': data_offsets [4, 12] leave bytes [0, 4) at the start of "
        "the data unused; tensors must be contiguous",
    ),
    "bytes after the last tensor": (
        ({"a": _f32(0, 8)}, b"\0" * 12, None),
        "4 bytes after the last tensor's data (which ends at 8) belong to no tensor",
    ),
}


@pytest.mark.parametrize("case", HEADER_CASES)
def test_a_malformed_safetensors_header_is_named(tmp_path, case):
    contents, message = HEADER_CASES[case]
    path = tmp_path / "t.safetensors"
    if isinstance(contents, bytes):
        path.write_bytes(contents)
    else:
        header, data, length = contents
        _st(path, header, data, length=length)
    assert _raises(CheckpointError, read_safetensors_header, path) == f"{path}: {message}"


def test_a_valid_hand_made_header_reads_with_metadata_and_empty_tensors(tmp_path):
    data = np.arange(2, dtype=np.float32).tobytes() + np.arange(3, dtype=np.int8).tobytes()
    path = _st(
        tmp_path / "t.safetensors",
        {
            "__metadata__": {"format": "pt"},
            "b": {"dtype": "I8", "shape": [3], "data_offsets": [8, 11]},
            "empty": {"dtype": "F32", "shape": [0, 4], "data_offsets": [8, 8]},
            "a": _f32(0, 8),
        },
        data,
    )
    entries = read_safetensors_header(path)
    assert sorted(entries) == ["a", "b", "empty"]
    np.testing.assert_array_equal(entries["a"].read(), [0.0, 1.0])
    np.testing.assert_array_equal(entries["b"].read(), [0, 1, 2])
    assert entries["empty"].read().shape == (0, 4)


def test_a_missing_safetensors_file_is_named(tmp_path):
    path = tmp_path / "gone.safetensors"
    assert (
        _raises(CheckpointError, read_safetensors_header, path)
        == f"{path}: safetensors file does not exist"
    )


# ---------------------------------------------------------------------------- model checkpoints
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A valid tiny Hugging Face Qwen3 directory (single file, untied embeddings)."""
    out = tmp_path_factory.mktemp("tiny") / "model"
    export_qwen3(tiny_model(), out)
    return out


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _tensors(path: Path) -> dict[str, np.ndarray]:
    return {name: entry.read() for name, entry in read_safetensors_header(path).items()}


def _edit_weights(model_dir: Path, edit) -> Path:
    path = model_dir / "model.safetensors"
    tensors = _tensors(path)
    edit(tensors)
    save_file(tensors, path)
    return path


def test_the_tiny_checkpoint_loads(tiny_dir):
    assert load_qwen3(tiny_dir).config == tiny_model().config


def test_a_tensor_missing_for_the_model_is_named(tiny_dir, tmp_path):
    model_dir = _copy(tiny_dir, tmp_path / "m")
    path = _edit_weights(model_dir, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    assert _raises(CheckpointError, load_qwen3, model_dir) == (
        f"{path}: missing 1 tensor(s) that config.json requires, e.g. "
        "['model.layers.1.self_attn.k_norm.weight']"
    )


def test_a_tensor_of_the_wrong_shape_for_the_model_is_named(tiny_dir, tmp_path):
    model_dir = _copy(tiny_dir, tmp_path / "m")
    path = _edit_weights(
        model_dir,
        lambda t: t.update({"model.layers.0.mlp.down_proj.weight": np.zeros((16, 31), np.float32)}),
    )
    assert _raises(CheckpointError, load_qwen3, model_dir) == (
        f"{path}: tensor 'model.layers.0.mlp.down_proj.weight' has shape [16, 31], but "
        "config.json implies [16, 32]"
    )


def test_a_tensor_the_model_does_not_have_is_named(tiny_dir, tmp_path):
    model_dir = _copy(tiny_dir, tmp_path / "m")
    path = _edit_weights(
        model_dir,
        lambda t: t.update({"model.layers.2.mlp.up_proj.weight": np.zeros((32, 16), np.float32)}),
    )
    assert _raises(CheckpointError, load_qwen3, model_dir) == (
        f"{path}: 1 unexpected tensor(s) not part of a Qwen3 with this config.json: "
        "'model.layers.2.mlp.up_proj.weight' in model.safetensors"
    )


def test_an_integer_tensor_is_named(tiny_dir, tmp_path):
    model_dir = _copy(tiny_dir, tmp_path / "m")
    path = _edit_weights(
        model_dir, lambda t: t.update({"model.norm.weight": np.ones(16, np.int32)})
    )
    assert _raises(CheckpointError, load_qwen3, model_dir) == (
        f"{path}: tensor 'model.norm.weight' has dtype I32, expected one of "
        "['F64', 'F32', 'F16', 'BF16']"
    )


def test_a_malformed_header_in_a_model_directory_is_named(tiny_dir, tmp_path):
    model_dir = _copy(tiny_dir, tmp_path / "m")
    path = model_dir / "model.safetensors"
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    begin, end = header["model.norm.weight"]["data_offsets"]
    before = next(
        k for k, v in header.items() if k != "__metadata__" and v["data_offsets"][1] == begin
    )
    header["model.norm.weight"]["data_offsets"] = [begin - 4, end - 4]  # into the tensor before it
    _st(path, json.dumps(header).encode().ljust(n), raw[8 + n :])
    lo, hi = header[before]["data_offsets"]
    assert _raises(CheckpointError, load_qwen3, model_dir) == (
        f"{path}: tensors {before!r} (data_offsets [{lo}, {hi}]) and 'model.norm.weight' "
        f"(data_offsets [{begin - 4}, {end - 4}]) overlap"
    )


# ---------------------------------------------------------------------------- the shard index
@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sharded") / "model"
    export_qwen3(tiny_model(), out, max_shard_bytes=4_000)
    return out


def _with_index(sharded_dir: Path, dst: Path, edit) -> tuple[Path, Path]:
    model_dir = _copy(sharded_dir, dst)
    index_path = model_dir / INDEX_FILE
    index = json.loads(index_path.read_text())
    edit(index["weight_map"])
    index_path.write_text(json.dumps(index))
    return model_dir, index_path


FIRST = "model.embed_tokens.weight"


def test_the_sharded_checkpoint_loads(sharded_dir, tiny_dir):
    assert len(list(sharded_dir.glob("model-*.safetensors"))) > 2
    assert set(index_checkpoint(sharded_dir)) == set(index_checkpoint(tiny_dir))


def test_an_index_entry_leaving_the_directory_is_refused(sharded_dir, tmp_path):
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(
        (
            sharded_dir / json.loads((sharded_dir / INDEX_FILE).read_text())["weight_map"][FIRST]
        ).read_bytes()
    )  # a real shard: refused all the same
    model_dir, index_path = _with_index(
        sharded_dir, tmp_path / "m", lambda m: m.update({FIRST: "../outside.safetensors"})
    )
    assert _raises(CheckpointError, index_checkpoint, model_dir) == (
        f"{index_path}: weight_map['{FIRST}'] = '../outside.safetensors' resolves to "
        f"{outside.resolve()}, outside the model directory {model_dir.resolve()}"
    )


def test_an_absolute_index_entry_is_refused(sharded_dir, tmp_path):
    model_dir, index_path = _with_index(
        sharded_dir, tmp_path / "m", lambda m: m.update({FIRST: "/etc/passwd"})
    )
    assert _raises(CheckpointError, index_checkpoint, model_dir) == (
        f"{index_path}: weight_map['{FIRST}'] = '/etc/passwd' is an absolute path; shard files "
        "must be named relative to the model directory"
    )


def test_an_index_entry_through_a_symlink_out_of_the_directory_is_refused(sharded_dir, tmp_path):
    outside = tmp_path / "elsewhere" / "shard.safetensors"
    outside.parent.mkdir()
    outside.write_bytes(b"anything")
    model_dir, index_path = _with_index(
        sharded_dir, tmp_path / "m", lambda m: m.update({FIRST: "link.safetensors"})
    )
    (model_dir / "link.safetensors").symlink_to(outside)
    assert _raises(CheckpointError, index_checkpoint, model_dir) == (
        f"{index_path}: weight_map['{FIRST}'] = 'link.safetensors' resolves to "
        f"{outside.resolve()}, outside the model directory {model_dir.resolve()}"
    )


def test_a_single_file_symlinked_out_of_the_directory_is_refused(tiny_dir, tmp_path):
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "config.json").write_bytes((tiny_dir / "config.json").read_bytes())
    (model_dir / "model.safetensors").symlink_to(tiny_dir / "model.safetensors")
    assert _raises(CheckpointError, load_qwen3, model_dir) == (
        f"{model_dir / 'model.safetensors'} resolves to "
        f"{(tiny_dir / 'model.safetensors').resolve()}, "
        f"outside the model directory {model_dir.resolve()}"
    )


def test_a_hub_cache_snapshot_linking_to_its_blobs_loads(tiny_dir, tmp_path):
    """Hugging Face's cache: snapshots/<rev>/<file> are links to ../../blobs/<hash>."""
    repo = tmp_path / "models--Qwen--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for name in ("config.json", "model.safetensors"):
        (blobs / f"hash-{name}").write_bytes((tiny_dir / name).read_bytes())
        (snapshot / name).symlink_to(Path("../../blobs") / f"hash-{name}")
    model = load_qwen3(snapshot)
    assert model.config == tiny_model().config


def test_an_index_entry_pointing_at_a_missing_file_is_named(sharded_dir, tmp_path):
    model_dir, index_path = _with_index(
        sharded_dir, tmp_path / "m", lambda m: m.update({FIRST: "model-09999.safetensors"})
    )
    assert _raises(CheckpointError, index_checkpoint, model_dir) == (
        f"{index_path}: weight_map['{FIRST}'] = 'model-09999.safetensors', which does not exist "
        f"in {model_dir}"
    )


def test_an_index_entry_pointing_at_a_directory_is_named(sharded_dir, tmp_path):
    model_dir, index_path = _with_index(
        sharded_dir, tmp_path / "m", lambda m: m.update({FIRST: "sub"})
    )
    (model_dir / "sub").mkdir()
    assert _raises(CheckpointError, index_checkpoint, model_dir) == (
        f"{index_path}: weight_map['{FIRST}'] = 'sub' is not a regular file"
    )


def test_an_index_entry_pointing_at_a_shard_without_the_tensor_is_named(sharded_dir, tmp_path):
    def swap(weight_map):
        other = next(f for f in sorted(set(weight_map.values())) if f != weight_map[FIRST])
        weight_map[FIRST] = other

    model_dir, index_path = _with_index(sharded_dir, tmp_path / "m", swap)
    shard = json.loads(index_path.read_text())["weight_map"][FIRST]
    assert _raises(CheckpointError, index_checkpoint, model_dir) == (
        f"{index_path}: weight_map['{FIRST}'] = '{shard}', but that file holds no tensor '{FIRST}'"
    )


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "{not json",
            "the index is not valid JSON (Expecting property name enclosed in double "
            "quotes at line 1, column 2)",
        ),
        ("[]", "the index must be a JSON object, got an array"),
        ('{"metadata": {}}', "field 'weight_map' is missing"),
        (
            '{"weight_map": ["a"]}',
            "field 'weight_map' must be an object of tensor name -> file name, got an array",
        ),
        ('{"weight_map": {"x": 3}}', "weight_map['x'] must be a file name, got 3"),
        ('{"weight_map": {"x": ""}}', "weight_map['x'] must be a file name, got ''"),
        (
            '{"weight_map": {"x": "a"}, "weight_map": {}}',
            "the index has the key 'weight_map' twice",
        ),
    ],
    ids=[
        "bad JSON",
        "an array",
        "no weight_map",
        "weight_map a list",
        "a number as file",
        "an empty file name",
        "weight_map twice",
    ],
)
def test_a_malformed_index_is_named(tmp_path, text, message):
    (tmp_path / INDEX_FILE).write_text(text)
    assert (
        _raises(CheckpointError, index_checkpoint, tmp_path)
        == f"{tmp_path / INDEX_FILE}: {message}"
    )


# ---------------------------------------------------------------------------- config.json
def _config_json(tmp_path: Path, text: str | None = None, **changes) -> Path:
    if text is None:
        d = tiny_model().config.to_hf_dict()
        for key, value in changes.items():
            if value is _DELETE:
                d.pop(key)
            else:
                d[key] = value
        text = json.dumps(d)
    (tmp_path / "config.json").write_text(text)
    return tmp_path


_DELETE = object()

CONFIG_JSON_CASES = {
    "not JSON": (
        dict(text='{"vocab_size": 16,}'),
        "the file is not valid JSON (Expecting "
        "property name enclosed in double quotes at line 1, column 19)",
    ),
    "NaN": (
        dict(text='{"rms_norm_eps": NaN}'),
        "the file is not valid JSON (NaN is not a JSON value)",
    ),
    "a key twice": (
        dict(text='{"vocab_size": 16, "vocab_size": 32}'),
        "the file has the key 'vocab_size' twice",
    ),
    "an array": (dict(text="[16, 16]"), "the file must be a JSON object, got an array"),
    "negative size": (
        dict(hidden_size=-16),
        "hidden_size: must be an int in [1, 2147483647], got -16",
    ),
    "zero layers": (
        dict(num_hidden_layers=0),
        "num_hidden_layers: must be an int in [1, 2147483647], got 0",
    ),
    "huge size": (
        dict(intermediate_size=2**40),
        "intermediate_size: must be an int in [1, 2147483647], got 1099511627776",
    ),
    "zero kv heads": (
        dict(num_key_value_heads=0),
        "num_key_value_heads: must be an int in [1, 2147483647], got 0",
    ),
    "zero head_dim": (dict(head_dim=0), "head_dim: must be an int in [1, 2147483647], got 0"),
    "odd head_dim": (dict(head_dim=7), "head_dim: must be even for rotate-half RoPE, got 7"),
    "kv heads not dividing heads": (
        dict(num_attention_heads=3, num_key_value_heads=2),
        "num_key_value_heads: must divide num_attention_heads (3), got 2",
    ),
    "heads not dividing hidden size": (
        dict(head_dim=_DELETE, hidden_size=17),
        "hidden_size: must be a multiple of num_attention_heads (2) "
        "when head_dim is not given, got 17",
    ),
    "a string for an int": (
        dict(hidden_size="16"),
        "hidden_size: must be an int in [1, 2147483647], got '16'",
    ),
    "a string for an int, head_dim derived": (
        dict(head_dim=_DELETE, num_attention_heads="2"),
        "num_attention_heads: must be an int in [1, 2147483647], got '2'",
    ),
    "a bool for an int": (
        dict(vocab_size=True),
        "vocab_size: must be an int in [1, 2147483647], got True",
    ),
    "a float for an int": (
        dict(num_hidden_layers=2.0),
        "num_hidden_layers: must be an int in [1, 2147483647], got 2.0",
    ),
    "missing vocab_size": (dict(vocab_size=_DELETE), "vocab_size: required field is missing"),
    "null hidden_size": (dict(hidden_size=None), "hidden_size: required field is missing"),
    "eos beyond the vocab": (
        dict(eos_token_id=16),
        "eos_token_id: 16 is not a token of vocab_size=16 (ids run 0..15)",
    ),
    "bos beyond the vocab": (
        dict(bos_token_id=[1]),
        "bos_token_id: must be null or an int >= 0, got [1]",
    ),
    "pad beyond the vocab": (
        dict(pad_token_id=99),
        "pad_token_id: 99 is not a token of vocab_size=16 (ids run 0..15)",
    ),
    "negative eos": (
        dict(eos_token_id=[1, -1]),
        "eos_token_id: must be null, an int >= 0 or a list of them, got [1, -1]",
    ),
    "string eos": (
        dict(eos_token_id="</s>"),
        "eos_token_id: must be null, an int >= 0 or a list of them, got '</s>'",
    ),
    "zero eps": (dict(rms_norm_eps=0), "rms_norm_eps: must be a finite number > 0, got 0"),
    "string eps": (
        dict(rms_norm_eps="1e-6"),
        "rms_norm_eps: must be a finite number > 0, got '1e-6'",
    ),
    "rope_theta 1": (
        dict(rope_theta=1, rope_parameters=None),
        "rope_theta: must be a finite number > 1, got 1",
    ),
    "rope_theta a string": (
        dict(rope_parameters={"rope_type": "default", "rope_theta": "big"}),
        "rope_parameters.rope_theta: must be a finite number > 1, got 'big'",
    ),
    "tie a string": (
        dict(tie_word_embeddings="yes"),
        "tie_word_embeddings: must be true or false, got 'yes'",
    ),
    "max positions 0": (
        dict(max_position_embeddings=0),
        "max_position_embeddings: must be an int in [1, 2147483647], got 0",
    ),
    "rope_parameters a list": (
        dict(rope_parameters=[1]),
        "rope_parameters: must be an object or null, got [1]",
    ),
    "rope_scaling a string": (
        dict(rope_parameters=None, rope_scaling="linear"),
        "rope_scaling: must be an object or null, got 'linear'",
    ),
    "rope factor a string": (
        dict(rope_parameters={"rope_type": "linear", "factor": "2"}),
        "rope_parameters.factor: rope scaling (linear) needs a finite number > 0, got '2'",
    ),
    "rope factor negative": (
        dict(rope_parameters={"rope_type": "linear", "factor": -2}),
        "rope_parameters.factor: rope scaling (linear) needs a finite number > 0, got -2",
    ),
    "yarn beta a string": (
        dict(
            rope_parameters={
                "rope_type": "yarn",
                "factor": 2.0,
                "original_max_position_embeddings": 64,
                "beta_fast": "x",
            }
        ),
        "rope_parameters.beta_fast: must be a finite number, got 'x'",
    ),
    "yarn original 0": (
        dict(
            rope_parameters={
                "rope_type": "yarn",
                "factor": 2.0,
                "original_max_position_embeddings": 0,
            }
        ),
        "rope_parameters.original_max_position_embeddings: must be an int in "
        "[1, 2147483647], got 0",
    ),
    "unsupported rope": (
        dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}),
        "rope_parameters.rope_type: 'dynamic' is not supported; supported: "
        "['default', 'linear', 'yarn']",
    ),
    "architectures a string": (
        dict(architectures="Qwen3ForCausalLM"),
        "architectures: must be a list of strings, got 'Qwen3ForCausalLM'",
    ),
    "attention_bias a string": (
        dict(attention_bias="false"),
        "attention_bias: must be true or false, got 'false'",
    ),
    "attention_bias true": (
        dict(attention_bias=True),
        "attention_bias: true is not supported (Qwen3 has no q/k/v/o bias)",
    ),
    "layer_types a number": (dict(layer_types=3), "layer_types: must be a list of strings, got 3"),
    "sliding window": (
        dict(use_sliding_window=True),
        "use_sliding_window/layer_types: sliding-window attention is not supported",
    ),
}


@pytest.mark.parametrize("case", CONFIG_JSON_CASES)
def test_a_nonsense_config_json_is_named(tmp_path, case):
    changes, message = CONFIG_JSON_CASES[case]
    model_dir = _config_json(tmp_path, **changes)
    assert (
        _raises(ConfigError, Qwen3Config.from_model_dir, model_dir)
        == f"{model_dir / 'config.json'}: {message}"
    )


def test_config_json_that_is_not_utf8_is_named(tmp_path):
    (tmp_path / "config.json").write_bytes(b'{"vocab_size": "\xe9"}')
    assert _raises(ConfigError, Qwen3Config.from_model_dir, tmp_path) == (
        f"{tmp_path / 'config.json'}: the file is not UTF-8 text (invalid continuation byte at "
        "byte 16)"
    )


def test_the_loader_reports_config_json_before_reading_weights(tiny_dir, tmp_path):
    model_dir = _copy(tiny_dir, tmp_path / "m")
    _config_json(model_dir, num_key_value_heads=0)
    assert _raises(ConfigError, load_qwen3, model_dir) == (
        f"{model_dir / 'config.json'}: num_key_value_heads: must be an int in [1, 2147483647], "
        "got 0"
    )


# ---------------------------------------------------------------------------- reproduction YAML
def _yaml(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "run.yaml"
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


SECTIONS = "task, model, warm_start, engine, rl, eval, mesh"
YAML_CASES = {
    "task: 0": ("task: 0\n", "task: must be a mapping of fields, got an int 0"),
    "rl: false": ("rl: false\n", "rl: must be a mapping of fields, got a boolean False"),
    "a list for a section": (
        "rl:\n  - steps\n  - 3\n",
        "rl: must be a mapping of fields, got a list ['steps', 3]",
    ),
    "a list of pairs for a section": (
        "rl: [[steps, 3]]\n",
        "rl: must be a mapping of fields, got a list [['steps', 3]]",
    ),
    "a string for a section": (
        "eval: samples=3\n",
        "eval: must be a mapping of fields, got a string 'samples=3'",
    ),
    "a top-level scalar": ("5\n", f"must be a mapping of sections ({SECTIONS}), got an int 5"),
    "a top-level string": (
        "rl.steps=3\n",
        f"must be a mapping of sections ({SECTIONS}), got a string 'rl.steps=3'",
    ),
    "a top-level list": (
        "- rl\n- task\n",
        f"must be a mapping of sections ({SECTIONS}), got a list ['rl', 'task']",
    ),
    "an empty file": (
        "",
        "the file is empty (no sections); give no config file for the built-in "
        "default, or {} for a file of defaults",
    ),
    "only comments": (
        "# nothing\n",
        "the file is empty (no sections); give no config file for "
        "the built-in default, or {} for a file of defaults",
    ),
    "invalid syntax": (
        "rl: [unclosed\n",
        "not valid YAML (expected ',' or ']', but got '<stream end>' at line 2, column 1)",
    ),
    "bad indentation": (
        "rl:\n  steps: 3\n bad: 1\n",
        "not valid YAML (expected <block end>, but "
        "found '<block mapping start>' at line 3, "
        "column 2)",
    ),
    "a tab": (
        "rl:\n\tsteps: 3\n",
        "not valid YAML (found character '\\t' that cannot start any token at line 2, column 1)",
    ),
    "a section twice": (
        "rl:\n  steps: 3\nrl:\n  steps: 4\n",
        "not valid YAML (key 'rl' is given twice at line 3, column 1)",
    ),
    "a field twice": (
        "rl:\n  steps: 3\n  steps: 4\n",
        "not valid YAML (key 'steps' is given twice at line 3, column 3)",
    ),
    "an unknown section": (
        "training:\n  steps: 3\n",
        f"unknown section 'training'; known: {SECTIONS}",
    ),
    "a non-string section": ("1: {}\n", f"unknown section 1; known: {SECTIONS}"),
    "an unknown field": (
        "warm_start:\n  epoch: 2\n",
        "warm_start: unknown field 'epoch'; known: "
        "batch_size, demo_tasks, demos_per_task, enabled, epochs, group_by_length, "
        "learning_rate, mistake_rate, seed, weight_decay; did you mean 'epochs'?",
    ),
    "a non-string field": (
        "mesh:\n  1: 2\n",
        "mesh: unknown field 1; known: data, expert, fsdp, ordered_sums, rollout, tensor",
    ),
    "a string for an int": (
        "rl:\n  steps: '3'\n",
        "rl.steps: must be an int in [1, 10000000], got '3'",
    ),
    "a float for an int": (
        "task:\n  train_tasks: 2.5\n",
        "task.train_tasks: must be an int in [1, 1048576], got 2.5",
    ),
    "a string for a bool": (
        "task:\n  options: {slippery: 'yes'}\n",
        "task.options.slippery: must be true or false, got 'yes'",
    ),
    "an int for a bool": (
        "warm_start:\n  enabled: 1\n",
        "warm_start.enabled: must be true or false, got 1",
    ),
    "a mapping for a number": (
        "rl:\n  optimizer:\n    learning_rate: {a: 1}\n",
        "rl.optimizer.learning_rate: must be a number in (0, 10], got {'a': 1}",
    ),
    "a list for a string": (
        "model:\n  dtype: [float32]\n",
        "model.dtype: must be one of ('float32', 'bfloat16'), got ('float32',)",
    ),
    "a number for the runs": (
        "rl:\n  runs: 3\n",
        "rl.runs: must be a non-empty list of runs, each a preset name (grpo, budgetmix, "
        "budgetmix-adaptive, budgetmix-presentation, gigpo, gigpo-budgetmix, ppo, "
        "ppo-budgetmix, dapo, dapo-budgetmix, dr-grpo, rloo, gspo) or a mapping {name, preset, "
        "label, budget_mix, presentation, params, algorithm}, got 3",
    ),
    "a list in the runs": (
        "rl:\n  runs: [[grpo]]\n",
        "rl.runs[0]: must be a preset name (grpo, budgetmix, budgetmix-adaptive, "
        "budgetmix-presentation, gigpo, gigpo-budgetmix, ppo, ppo-budgetmix, dapo, "
        "dapo-budgetmix, dr-grpo, rloo, gspo) or a mapping {name, preset, label, budget_mix, "
        "presentation, params, algorithm}, got ['grpo']",
    ),
    "a huge int for a number": (
        "eval:\n  sampling:\n    top_p: " + "9" * 400 + "\n",
        "eval.sampling.top_p: must be a number in (0, 1], got " + "9" * 117 + "...",
    ),
    "a bad mesh": (
        "mesh:\n  data: 0\n",
        "mesh.data: must be -1 (all remaining devices) or an int in [1, 65536], got 0",
    ),
    "budgets past t_max": (
        "eval:\n  budgets: [13]\n",
        "eval.budgets: must be <= task.t_max (12), got [13]",
    ),
    "pages on a tensor mesh": (
        "mesh:\n  tensor: 2\n",
        "engine.kv_page_size: the paged KV cache "
        "splits rows over the data and fsdp axes only, and mesh.tensor is "
        "2; set engine.kv_page_size to null (the static cache) or tensor to 1",
    ),
    # nesting and aliases PyYAML would compose recursively (a RecursionError) or expand
    "a flow list 100k deep": (
        "rl:\n  runs: " + "[" * 100_000 + "]" * 100_000 + "\n",
        "nested more than 32 levels deep at line 2, column 39",
    ),
    "block mappings 40 deep": (
        "".join("  " * i + f"k{i}:\n" for i in range(40)) + "  " * 40 + "x: 1\n",
        "nested more than 32 levels deep at line 33, column 65",
    ),
    "a mapping that holds itself": (
        "rl:\n  preset_params: &x {a: *x}\n",
        "a YAML alias (*x) at line 2, column 25: write the value out",
    ),
    "a billion laughs": (
        "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
        + "".join(
            f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n"
            for i in range(8)
        ),
        "a YAML alias (*a) at line 2, column 8: write the value out",
    ),
}


@pytest.mark.parametrize("case", YAML_CASES)
def test_a_yaml_config_of_the_wrong_structure_is_named(tmp_path, case):
    text, message = YAML_CASES[case]
    path = _yaml(tmp_path, text)
    assert _raises(ConfigError, load_config, path) == f"config {path}: {message}"


def test_an_override_of_any_depth_is_one_short_line():
    """``--set`` values parse as YAML too: a 100k-deep list is refused like a file's, and the
    error quotes the override cut to 120 characters, not 200k of brackets."""
    item = "rl.runs=" + "[" * 100_000 + "]" * 100_000
    message = _raises(ConfigError, load_config, None, [item])
    where = "nested more than 32 levels deep at line 1, column 33"
    assert message == f"override {repr(item)[:117]}...: {where}"


def test_a_yaml_file_that_is_missing_or_not_utf8_is_named(tmp_path):
    missing = tmp_path / "missing.yaml"
    assert _raises(ConfigError, load_config, missing) == f"config {missing}: no such file"
    path = _yaml(tmp_path, b"rl:\n  steps: \xff\n")
    assert _raises(ConfigError, load_config, path) == (
        f"config {path}: not UTF-8 text (invalid start byte at byte 13)"
    )


def test_null_and_empty_sections_and_an_empty_mapping_are_the_defaults(tmp_path):
    assert load_config(_yaml(tmp_path, "rl:\ntask: {}\n")) == default_config()
    assert load_config(_yaml(tmp_path, "{}\n")) == default_config()


@pytest.mark.parametrize(
    "text, overrides, message",
    [
        (
            "rl:\n  steps: 3\n",
            ["rl.steps=three"],
            "config {path} with override 'rl.steps=three': "
            "rl.steps: must be an int in [1, 10000000], got 'three'",
        ),
        (
            "rl:\n  steps: 3\n",
            ["rl.stepz=3"],
            "config {path} with override 'rl.stepz=3': rl: unknown field 'stepz'; known: "
            "algorithm, asynchronous, batching, checkpoint, exact_logprobs, group_size, "
            "history_window, judge_model_dir, logging, lora, max_rows_per_call, memory, optimizer, "
            "preset_params, process_reward_coef, process_rewards, refill, routing_replay, "
            "runs, sampling, scoring, seed, steps, tasks_per_step; did you mean 'steps'?",
        ),
        (
            "rl:\n  steps: 3\n",
            ["rll.steps=3"],
            f"config {{path}} with override 'rll.steps=3': unknown section 'rll'; "
            f"known: {SECTIONS}; did you mean 'rl'?",
        ),
        (
            "task:\n  t_max: 8\n",
            ["rl.steps=4", "rl.batching.num_micro_batches=3"],
            "config {path} with override 'rl.steps=4', 'rl.batching.num_micro_batches=3': "
            "rl.batching.num_micro_batches: must divide tasks_per_step x group_size (64), got 3",
        ),
        (
            "task:\n  t_max: 8\n",
            ["eval.budgets=[9]"],
            "config {path} with override 'eval.budgets=[9]': "
            "eval.budgets: must be <= task.t_max (8), got [9]",
        ),
        (
            "rl:\n  steps: 0\n",
            ["task.t_max=8"],
            "config {path}: rl.steps: must be an int in [1, 10000000], got 0",
        ),
        ("rl: 5\n", ["rl.steps=3"], "config {path}: rl: must be a mapping of fields, got an int 5"),
        (
            "{}\n",
            ["rl.runs=[grpo"],
            "override 'rl.runs=[grpo': not valid YAML (expected ',' or ']', but got '<stream end>' "
            "at line 1, column 6)",
        ),
        ("{}\n", ["rl.steps"], "override 'rl.steps': expected section.field=value"),
    ],
    ids=[
        "bad value",
        "unknown field",
        "unknown section",
        "cross-field",
        "cross-section",
        "the file's own value",
        "the file's structure",
        "bad override YAML",
        "no '='",
    ],
)
def test_a_bad_value_names_the_file_and_the_override_that_set_it(
    tmp_path, text, overrides, message
):
    path = _yaml(tmp_path, text)
    assert _raises(ConfigError, load_config, path, overrides) == message.format(path=path)


def test_overrides_without_a_file_name_only_the_override():
    assert _raises(ConfigError, load_config, None, ["rl.group_size=1"]) == (
        "override 'rl.group_size=1': rl.group_size: must be an int in [2, 4096], got 1"
    )


def test_errors_are_never_raw_library_errors():
    """Hostile shapes of every kind, in every field: only ConfigError, never KeyError etc."""
    import dataclasses

    from agentrl_jax.reproduce.config import SECTIONS as _SECTIONS
    from agentrl_jax.reproduce.config import config_from_dict

    weird = [
        10**400,
        {},
        {"a": 1},
        [1],
        [],
        "x",
        1.5,
        True,
        -1,
        None,
        float("nan"),
        [[1]],
        {"a": [1]},
        b"x",
    ]
    for name, cls in _SECTIONS.items():
        for field in dataclasses.fields(cls):
            for value in weird:
                try:
                    config_from_dict({name: {field.name: value}})
                except ConfigError:
                    pass
    base = tiny_model().config.to_hf_dict()
    for key in [*base, "layer_types"]:
        for value in weird[:-1]:
            try:
                Qwen3Config.from_hf_dict({**base, key: value})
            except ConfigError:
                pass
