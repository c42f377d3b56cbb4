"""Loading and exporting Hugging Face checkpoints; every bad input gets a precise error."""

from __future__ import annotations

import json
import re
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from hf_qwen3 import hf_logits, load_hf_qwen3, save_random_hf_qwen3
from safetensors.torch import load_file, save_file

from agentrl_jax.models import (
    CheckpointError,
    ConfigError,
    Qwen3Config,
    UnsupportedArchitectureError,
    export_qwen3,
    load_qwen3,
    positions_from_mask,
)
from agentrl_jax.models.checkpoints import INDEX_FILE, index_checkpoint, read_safetensors_header

TOKENS = np.random.default_rng(0).integers(0, 250, (2, 10))


def _ours(model, tokens=TOKENS):
    mask = jnp.ones(tokens.shape, bool)
    return np.asarray(model(jnp.asarray(tokens), positions_from_mask(mask), mask)[0])


def _bits(t: torch.Tensor) -> np.ndarray:
    """A tensor's raw bits (so -0.0 != 0.0 and NaN payloads count)."""
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).numpy()


def _tensors(model_dir) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(path))
    return out


# ---------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("tied,dtype", [(True, torch.float32), (False, torch.bfloat16)])
def test_export_of_unchanged_params_is_bit_exact_and_transformers_reloads_it(tmp_path, tied, dtype):
    save_random_hf_qwen3(tmp_path / "src", tie_word_embeddings=tied, dtype=dtype)
    jax_dtype = jnp.bfloat16 if dtype == torch.bfloat16 else jnp.float32
    model = load_qwen3(tmp_path / "src", param_dtype=jax_dtype)
    export_qwen3(model, tmp_path / "out", copy_files_from=tmp_path / "src")

    original, exported = _tensors(tmp_path / "src"), _tensors(tmp_path / "out")
    assert set(exported) == set(original)  # tied: no lm_head in either
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype, name
        np.testing.assert_array_equal(_bits(exported[name]), _bits(tensor), err_msg=name)
    assert (tmp_path / "out" / "generation_config.json").is_file()

    np.testing.assert_array_equal(
        hf_logits(load_hf_qwen3(tmp_path / "out", dtype), TOKENS),
        hf_logits(load_hf_qwen3(tmp_path / "src", dtype), TOKENS),
    )


def test_exported_trained_params_reach_transformers(tmp_path):
    """Changed parameters land under the right names: transformers computes what we compute."""
    save_random_hf_qwen3(tmp_path / "src", tie_word_embeddings=False)
    model = load_qwen3(tmp_path / "src")
    state = nnx.state(model, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(0), 64))
    nnx.update(
        model, jax.tree.map(lambda w: w + 0.05 * jax.random.normal(next(keys), w.shape), state)
    )
    export_qwen3(model, tmp_path / "out")
    np.testing.assert_allclose(
        hf_logits(load_hf_qwen3(tmp_path / "out"), TOKENS), _ours(model), atol=1e-4, rtol=0
    )


def test_sharded_export_writes_an_index_that_both_loaders_read(tmp_path):
    hf = save_random_hf_qwen3(tmp_path / "src", tie_word_embeddings=False)
    model = load_qwen3(tmp_path / "src")
    export_qwen3(model, tmp_path / "out", max_shard_bytes=40_000)
    files = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert len(files) > 3 and all(f.startswith("model-0") for f in files)
    index = json.loads((tmp_path / "out" / INDEX_FILE).read_text())
    assert set(index["weight_map"].values()) == set(files)
    for path in (tmp_path / "out").glob("*.safetensors"):
        sizes = [t.numel() * t.element_size() for t in load_file(path).values()]
        assert sum(sizes) <= 40_000 or len(sizes) == 1
    for name, tensor in _tensors(tmp_path / "src").items():
        np.testing.assert_array_equal(_bits(_tensors(tmp_path / "out")[name]), _bits(tensor))
    np.testing.assert_array_equal(
        hf_logits(load_hf_qwen3(tmp_path / "out"), TOKENS), hf_logits(hf, TOKENS)
    )
    np.testing.assert_array_equal(_ours(load_qwen3(tmp_path / "out")), _ours(model))


def test_refuses_to_overwrite_a_checkpoint_unless_asked(tmp_path):
    save_random_hf_qwen3(tmp_path / "src")
    model = load_qwen3(tmp_path / "src")
    export_qwen3(model, tmp_path / "out", max_shard_bytes=40_000)
    with pytest.raises(FileExistsError, match="already holds a checkpoint"):
        export_qwen3(model, tmp_path / "out")
    export_qwen3(model, tmp_path / "out", overwrite=True)  # stale shards and index removed
    assert [p.name for p in (tmp_path / "out").glob("*.safetensors")] == ["model.safetensors"]
    assert not (tmp_path / "out" / INDEX_FILE).exists()


def test_tied_checkpoint_that_also_stores_lm_head_loads(tmp_path):
    """Like the official Qwen3-0.6B: tied embeddings, yet lm_head.weight is in the file."""
    hf = save_random_hf_qwen3(tmp_path, tie_word_embeddings=True)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    np.testing.assert_allclose(_ours(load_qwen3(tmp_path)), hf_logits(hf, TOKENS), atol=1e-4)


def test_bfloat16_params_from_float32_file_round_like_torch(tmp_path):
    save_random_hf_qwen3(tmp_path)
    model = load_qwen3(tmp_path, param_dtype=jnp.bfloat16)
    expected = load_file(tmp_path / "model.safetensors")["model.layers.1.mlp.up_proj.weight"]
    ours = np.asarray(model.layers.up_proj[...][1])
    np.testing.assert_array_equal(ours.view(np.int16), _bits(expected.to(torch.bfloat16)))


def test_float32_params_from_bfloat16_file_are_exact_upcasts(tmp_path):
    save_random_hf_qwen3(tmp_path, dtype=torch.bfloat16)
    model = load_qwen3(tmp_path, param_dtype=jnp.float32)
    tensors = load_file(tmp_path / "model.safetensors")
    for layer in range(2):
        expected = tensors[f"model.layers.{layer}.self_attn.o_proj.weight"].float()
        np.testing.assert_array_equal(np.asarray(model.layers.o_proj[...][layer]), expected.numpy())
    np.testing.assert_array_equal(
        np.asarray(model.embed_tokens[...]), tensors["model.embed_tokens.weight"].float().numpy()
    )


def test_reader_matches_safetensors_library_including_bfloat16_slices(tmp_path):
    tensors = {
        "a": torch.randn(5, 7).to(torch.bfloat16),
        "b": torch.randn(3, 4, 2),
        "c": torch.randn(6).half(),
    }
    save_file(tensors, tmp_path / "t.safetensors")
    entries = read_safetensors_header(tmp_path / "t.safetensors")
    for name, tensor in tensors.items():
        assert entries[name].shape == tuple(tensor.shape)
        np.testing.assert_array_equal(entries[name].read().view(_bits(tensor).dtype), _bits(tensor))
    part = entries["a"].read((slice(1, 4), slice(2, 5)))
    assert part.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(part.view(np.int16), _bits(tensors["a"][1:4, 2:5]))


def test_both_config_json_forms_give_the_same_config(tmp_path):
    save_random_hf_qwen3(
        tmp_path,
        rope_parameters=dict(
            rope_type="yarn", factor=4.0, rope_theta=1e6, original_max_position_embeddings=64
        ),
    )
    new_form = json.loads((tmp_path / "config.json").read_text())
    hub_form = {k: v for k, v in new_form.items() if k != "rope_parameters"}
    hub_form["rope_theta"] = 1e6
    hub_form["rope_scaling"] = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    a = Qwen3Config.from_hf_dict(new_form)
    b = Qwen3Config.from_hf_dict(hub_form)
    assert a == b and a.rope_theta == 1e6 and a.rope_scaling.rope_type == "yarn"
    plain = dict(hub_form, rope_scaling=None, rope_theta=5e5)
    assert Qwen3Config.from_hf_dict(plain).rope_scaling is None
    assert Qwen3Config.from_hf_dict(plain).rope_theta == 5e5
    # And what we write reads back as the same config.
    assert Qwen3Config.from_hf_dict(a.to_hf_dict()) == a


# ---------------------------------------------------------------------------- bad input
def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory .*nowhere.* does not exist"):
        load_qwen3(tmp_path / "nowhere")


def test_missing_config_and_missing_weights(tmp_path):
    save_random_hf_qwen3(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "elsewhere.bin")
    expected = "expected model.safetensors or model.safetensors.index.json"
    with pytest.raises(FileNotFoundError, match=re.escape(expected)):
        load_qwen3(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        load_qwen3(tmp_path)


def test_missing_tensor_is_named(tmp_path):
    save_random_hf_qwen3(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    message = (
        "missing 1 tensor(s) that config.json requires, e.g. "
        "['model.layers.1.self_attn.k_norm.weight']"
    )
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_qwen3(tmp_path)


def test_untied_checkpoint_without_lm_head_is_missing_a_tensor(tmp_path):
    save_random_hf_qwen3(tmp_path, tie_word_embeddings=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, tie_word_embeddings=False)))
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load_qwen3(tmp_path)


def test_unexpected_tensor_is_named_with_its_file(tmp_path):
    save_random_hf_qwen3(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.2.mlp.up_proj.weight"] = torch.zeros(96, 64)  # a third layer
    save_file(tensors, tmp_path / "model.safetensors")
    message = (
        "unexpected tensor(s) not part of a Qwen3 with this config.json: "
        "'model.layers.2.mlp.up_proj.weight' in model.safetensors"
    )
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_qwen3(tmp_path)


def test_wrong_shape_is_named(tmp_path):
    save_random_hf_qwen3(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 95)
    save_file(tensors, tmp_path / "model.safetensors")
    message = (
        "model.safetensors: tensor 'model.layers.0.mlp.down_proj.weight' has shape "
        "[64, 95], but config.json implies [64, 96]"
    )
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_qwen3(tmp_path)


def test_integer_tensor_is_rejected(tmp_path):
    save_random_hf_qwen3(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(64, dtype=torch.int32)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="'model.norm.weight' has dtype I32"):
        load_qwen3(tmp_path)


@pytest.mark.parametrize(
    "model_type,arch",
    [
        ("llama", "LlamaForCausalLM"),
        ("qwen2_moe", "Qwen2MoeForCausalLM"),
        ("qwen3_moe", "Qwen3ForCausalLM"),  # a MoE config naming the dense class
        ("qwen3", "Qwen3ForSequenceClassification"),
    ],
)
def test_unsupported_architecture(tmp_path, model_type, arch):
    save_random_hf_qwen3(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type=model_type, architectures=[arch])
    (tmp_path / "config.json").write_text(json.dumps(config))
    message = f"config.json: unsupported architecture.*{arch}"
    with pytest.raises(UnsupportedArchitectureError, match=message):
        load_qwen3(tmp_path)


def test_index_pointing_at_a_missing_shard(tmp_path):
    save_random_hf_qwen3(tmp_path / "src")
    export_qwen3(load_qwen3(tmp_path / "src"), tmp_path / "out", max_shard_bytes=40_000)
    second = sorted((tmp_path / "out").glob("model-*.safetensors"))[1]
    second.unlink()
    tensor = next(
        n
        for n, f in json.loads((tmp_path / "out" / INDEX_FILE).read_text())["weight_map"].items()
        if f == second.name
    )
    with pytest.raises(CheckpointError) as error:
        index_checkpoint(tmp_path / "out")
    assert str(error.value) == (
        f"{tmp_path / 'out' / INDEX_FILE}: weight_map[{tensor!r}] = "
        f"{second.name!r}, which does not exist in {tmp_path / 'out'}"
    )


def test_truncated_file_names_file_and_tensor(tmp_path):
    save_random_hf_qwen3(tmp_path)
    path = tmp_path / "model.safetensors"
    raw = path.read_bytes()
    path.write_bytes(raw[:-100])
    n = int.from_bytes(raw[:8], "little")
    last = max(
        (v["data_offsets"], k) for k, v in json.loads(raw[8 : 8 + n]).items() if k != "__metadata__"
    )
    with pytest.raises(CheckpointError) as error:
        load_qwen3(tmp_path)
    assert str(error.value) == (
        f"{path}: tensor {last[1]!r}: data_offsets {last[0]} run past the end of the data "
        f"({len(raw) - 108 - n} bytes after the header); the file is truncated or corrupt"
    )
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError) as error:
        load_qwen3(tmp_path)
    assert str(error.value) == (
        f"{path}: not a safetensors file: header length "
        f"{int.from_bytes(b'not a sa', 'little')} is over the "
        "100000000-byte limit"
    )


# Every other config.json case, with its exact message: tests/test_loader_errors.py.
@pytest.mark.parametrize(
    "field,value,message",
    [
        (
            "num_key_value_heads",
            3,
            "num_key_value_heads: must divide num_attention_heads (4), got 3",
        ),
        ("hidden_size", 0, "hidden_size: must be an int in [1, 2147483647], got 0"),
        ("vocab_size", None, "vocab_size: required field is missing"),
        (
            "rope_parameters",
            {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
            "rope_parameters.rope_type: 'dynamic' is not supported; supported: "
            "['default', 'linear', 'yarn']",
        ),
        (
            "attention_bias",
            True,
            "attention_bias: true is not supported (Qwen3 has no q/k/v/o bias)",
        ),
        (
            "use_sliding_window",
            True,
            "use_sliding_window/layer_types: sliding-window attention is not supported",
        ),
    ],
)
def test_bad_config_fields_are_named(tmp_path, field, value, message):
    save_random_hf_qwen3(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as error:
        load_qwen3(tmp_path)
    assert str(error.value) == f"{tmp_path / 'config.json'}: {message}"


def test_model_directory_can_be_moved(tmp_path):
    """Nothing in a loaded model points back at the files (they are read once)."""
    hf = save_random_hf_qwen3(tmp_path / "a")
    model = load_qwen3(tmp_path / "a")
    shutil.rmtree(tmp_path / "a")
    np.testing.assert_allclose(_ours(model), hf_logits(hf, TOKENS), atol=1e-4)


# config.json of the official checkpoints (hub form), as published with the weights.
def _hub_config(hidden, intermediate, layers, heads, tied, kv_heads=8):
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": intermediate,
        "max_position_embeddings": 40960,
        "max_window_layers": layers,
        "model_type": "qwen3",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": tied,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }


@pytest.mark.parametrize(
    "hub,non_embedding_billions",
    [  # model cards' figures, as rounded there
        (_hub_config(1024, 3072, 28, 16, tied=True), "0.44"),  # Qwen3-0.6B
        (_hub_config(2560, 9728, 36, 32, tied=True), "3.6"),  # Qwen3-4B
        (_hub_config(4096, 12288, 36, 32, tied=False), "6.95"),  # Qwen3-8B
    ],
)
def test_official_configs_parse_to_the_published_model_sizes(hub, non_embedding_billions):
    from agentrl_jax.models.checkpoints import abstract_qwen3

    config = Qwen3Config.from_hf_dict(hub)
    assert config.rope_theta == 1e6 and config.rope_scaling is None
    assert config.eos_token_ids == (151645,) and config.num_query_groups == heads_per_kv(hub)
    params = nnx.to_pure_dict(nnx.state(abstract_qwen3(config), nnx.Param))  # no allocation
    total = sum(np.prod(leaf.shape) for leaf in jax.tree.leaves(params))
    embedding = 151936 * hub["hidden_size"] * (1 if hub["tie_word_embeddings"] else 2)
    digits = len(non_embedding_billions.split(".")[1])
    assert f"{(total - embedding) / 1e9:.{digits}f}" == non_embedding_billions


def heads_per_kv(hub):
    return hub["num_attention_heads"] // hub["num_key_value_heads"]
