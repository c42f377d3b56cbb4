"""Hugging Face checkpoints in and out: safetensors <-> :class:`Qwen3ForCausalLM`.

Loading (:func:`load_qwen3`) reads ``config.json`` and either ``model.safetensors`` or a
sharded ``model.safetensors.index.json``. Tensors are memory-mapped and each device shard is
cut straight from the file with ``jax.make_array_from_callback``, so the host only ever holds
one shard of one tensor and a model larger than any device is never gathered whole. Every name,
shape and dtype is checked first; errors name the file and tensor.

Export (:func:`export_qwen3`) writes ``config.json`` plus safetensors (sharded with an index
above ``max_shard_bytes``) that ``transformers.AutoModelForCausalLM.from_pretrained`` loads.
Parameters keep Hugging Face layouts, so exporting unchanged parameters reproduces the original
tensors bit for bit.

Safetensors files are read by :mod:`agentrl_jax.models.safetensors_reader` (our own header
parser, which validates every header field and the shard index before any data is mapped, and
``np.memmap`` for the data). Writing uses ``safetensors.numpy`` (which handles
``ml_dtypes.bfloat16``).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding
from safetensors.numpy import save_file

from agentrl_jax.errors import CheckpointError
from agentrl_jax.models.config import Qwen3Config
from agentrl_jax.models.qwen3 import (
    ATTENTION_PARAM_NAMES,
    MOE_PARAM_NAMES,
    Qwen3ForCausalLM,
    layer_param_names,
)
from agentrl_jax.models.safetensors_reader import (
    INDEX_FILE,
    SINGLE_FILE,
    TensorEntry,
    index_checkpoint,
    read_safetensors_header,
)
from agentrl_jax.sharding import QWEN3_PARAM_RULES, PartitionRule, path_string, tree_shardings

__all__ = [
    "AUXILIARY_FILES",
    "CheckpointError",
    "DEFAULT_MAX_SHARD_BYTES",
    "INDEX_FILE",
    "SINGLE_FILE",
    "TensorEntry",
    "abstract_qwen3",
    "check_tensors",
    "export_qwen3",
    "hf_tensor_names",
    "index_checkpoint",
    "load_qwen3",
    "read_safetensors_header",
]

# Files besides the weights that serving tools want next to them; copied on export if present.
AUXILIARY_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
)
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
_EXPERTS = ("experts_gate", "experts_up", "experts_down")

_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
_TORCH_DTYPE_NAMES = {
    np.dtype(np.float32): "float32",
    np.dtype(ml_dtypes.bfloat16): "bfloat16",
    np.dtype(np.float16): "float16",
}

# Our stacked layer parameter -> its per-layer Hugging Face name after "model.layers.{i}.".
_LAYER_SUFFIX = {
    "input_layernorm": "input_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "o_proj": "self_attn.o_proj.weight",
    "post_attention_layernorm": "post_attention_layernorm.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
    "router": "mlp.gate.weight",
    # the experts': one tensor per layer and expert ("{e}": the expert)
    "experts_gate": "mlp.experts.{e}.gate_proj.weight",
    "experts_up": "mlp.experts.{e}.up_proj.weight",
    "experts_down": "mlp.experts.{e}.down_proj.weight",
}


def stacked_axes(path: str) -> int:
    """How many leading axes of our parameter ``path`` stack Hugging Face tensors: 2 for the
    experts' (layer, expert), 1 for other layer weights, 0 for the rest."""
    if path.startswith("layers/experts_"):
        return 2
    return 1 if path.startswith("layers/") else 0


# ---------------------------------------------------------------------------- name mapping
def hf_tensor_names(config: Qwen3Config) -> dict[str, list[str]]:
    """Our parameter path -> its Hugging Face tensor names: one per layer for stacked weights
    (the layers that have it: a dense MLP's the dense layers, the router the MoE layers), one
    per layer and expert (layer-major) for the experts'."""
    names = {"embed_tokens": ["model.embed_tokens.weight"]}
    kinds = config.moe_layers
    for param in layer_param_names(config):
        suffix = _LAYER_SUFFIX[param]
        if param in ATTENTION_PARAM_NAMES:
            layers = range(config.num_hidden_layers)
        else:  # the layers whose feed-forward it belongs to
            layers = [i for i, is_moe in enumerate(kinds) if is_moe == (param in MOE_PARAM_NAMES)]
        experts = range(config.num_experts) if param in _EXPERTS else [None]
        names[f"layers/{param}"] = [
            f"model.layers.{i}.{suffix.format(e=e)}" for i in layers for e in experts
        ]
    names["norm"] = ["model.norm.weight"]
    if not config.tie_word_embeddings:
        names["lm_head"] = ["lm_head.weight"]
    return names


def _is_ignorable(name: str, config: Qwen3Config) -> bool:
    # Tied checkpoints may still store lm_head (the official Qwen3-0.6B does); transformers ties
    # it to the embedding and ignores it, and so do we. Old exports may store RoPE buffers.
    return (name == "lm_head.weight" and config.tie_word_embeddings) or name.endswith(
        ".rotary_emb.inv_freq"
    )


def check_tensors(
    entries: Mapping[str, TensorEntry],
    config: Qwen3Config,
    expected_shapes: Mapping[str, tuple[int, ...]],
    where: str,
) -> None:
    """Raise :class:`CheckpointError` for missing, unexpected, mis-shaped or non-float tensors.

    ``expected_shapes`` maps our parameter path to its shape (stacked layers included).
    """
    names = hf_tensor_names(config)
    wanted = {hf for hfs in names.values() for hf in hfs}
    missing = sorted(wanted - set(entries))
    if missing:
        raise CheckpointError(
            f"{where}: missing {len(missing)} tensor(s) that config.json "
            f"requires, e.g. {missing[:5]}"
        )
    unexpected = sorted(n for n in set(entries) - wanted if not _is_ignorable(n, config))
    if unexpected:
        listed = [f"{n!r} in {entries[n].file.name}" for n in unexpected[:5]]
        raise CheckpointError(
            f"{where}: {len(unexpected)} unexpected tensor(s) not part of a "
            f"Qwen3 with this config.json: {', '.join(listed)}"
        )
    for path, hfs in names.items():
        shape = expected_shapes[path][stacked_axes(path) :]
        for hf in hfs:
            entry = entries[hf]
            if entry.shape != tuple(shape):
                raise CheckpointError(
                    f"{entry.file}: tensor {hf!r} has shape {list(entry.shape)}, "
                    f"but config.json implies {list(shape)}"
                )
            if entry.dtype_name not in _FLOAT_DTYPES:
                raise CheckpointError(
                    f"{entry.file}: tensor {hf!r} has dtype {entry.dtype_name}, "
                    f"expected one of {list(_FLOAT_DTYPES)}"
                )


# ---------------------------------------------------------------------------- loading
def abstract_qwen3(
    config: Qwen3Config,
    *,
    dtype: Any = jnp.float32,
    param_dtype: Any = jnp.float32,
    remat: bool = False,
) -> Qwen3ForCausalLM:
    """The model's structure with ``ShapeDtypeStruct`` leaves; allocates nothing."""
    return nnx.eval_shape(
        lambda: Qwen3ForCausalLM(
            config, dtype=dtype, param_dtype=param_dtype, remat=remat, rngs=nnx.Rngs(0)
        )
    )


def load_qwen3(
    model_dir: str | Path,
    *,
    dtype: Any = jnp.float32,
    param_dtype: Any = jnp.float32,
    mesh: Mesh | None = None,
    rules: Sequence[PartitionRule] = QWEN3_PARAM_RULES,
    remat: bool = False,
) -> Qwen3ForCausalLM:
    """Load a Hugging Face Qwen3 directory into a :class:`Qwen3ForCausalLM`.

    Parameters are cast to ``param_dtype`` on the host, shard by shard, and placed on ``mesh``
    by ``rules`` (on the first local device when ``mesh`` is None).
    """
    model_dir = Path(model_dir)
    config = Qwen3Config.from_model_dir(model_dir)
    entries = index_checkpoint(model_dir)
    graphdef, state = nnx.split(
        abstract_qwen3(config, dtype=dtype, param_dtype=param_dtype, remat=remat)
    )
    abstract = nnx.to_pure_dict(state)
    where = str(model_dir / (INDEX_FILE if (model_dir / INDEX_FILE).is_file() else SINGLE_FILE))
    shapes = {
        path_string(path): leaf.shape
        for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]
    }
    check_tensors(entries, config, shapes, where)
    if mesh is None:
        device = jax.local_devices()[0]
        shardings = jax.tree.map(lambda _: SingleDeviceSharding(device), abstract)
    else:
        shardings = tree_shardings(abstract, mesh, rules)
    names = hf_tensor_names(config)

    def place(keypath, leaf, sharding):
        path = path_string(keypath)
        return _array_from_tensors(
            [entries[n] for n in names[path]], stacked_axes(path), leaf, sharding
        )

    params = jax.tree_util.tree_map_with_path(place, abstract, shardings)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def _array_from_tensors(
    tensors: list[TensorEntry],
    stacked: int,
    leaf: jax.ShapeDtypeStruct,
    sharding: jax.sharding.Sharding,
) -> jax.Array:
    """One parameter whose ``stacked`` leading axes stack the ``tensors`` (row-major: layer,
    then expert), each device shard read from the files directly."""
    dtype = np.dtype(leaf.dtype)

    def read_shard(index: tuple[slice, ...] | None) -> np.ndarray:
        index = tuple(index) if index is not None else (slice(None),) * len(leaf.shape)
        if not stacked:
            return tensors[0].read(index, dtype)
        picked = [range(size)[i] for size, i in zip(leaf.shape[:stacked], index[:stacked])]
        rest = index[stacked:]
        shard = np.empty((*map(len, picked), *tensors[0].mmap()[rest].shape), dtype)
        for row in np.ndindex(*shard.shape[:stacked]):  # the host holds the shard, no more
            at = [r[i] for r, i in zip(picked, row)]
            shard[row] = tensors[int(np.ravel_multi_index(at, leaf.shape[:stacked]))].mmap()[rest]
        return shard

    return jax.make_array_from_callback(leaf.shape, sharding, read_shard, dtype=dtype)


# ---------------------------------------------------------------------------- export
def export_qwen3(
    model: Qwen3ForCausalLM,
    out_dir: str | Path,
    *,
    dtype: Any = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    copy_files_from: str | Path | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` as a Hugging Face directory; returns ``out_dir``.

    ``dtype`` (default: the parameters' own) is the stored dtype. Tensors are fetched to the
    host one at a time (gathered across processes when sharded over hosts); only process 0
    writes. ``copy_files_from`` copies tokenizer and generation files that exist there.
    """
    out_dir = Path(out_dir)
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    old = list(out_dir.glob("*.safetensors")) + list(out_dir.glob(INDEX_FILE))
    if old and not overwrite:
        raise FileExistsError(
            f"{out_dir} already holds a checkpoint ({old[0].name}); "
            "pass overwrite=True to replace it"
        )
    config = model.config
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    out_dtype = np.dtype(dtype if dtype is not None else model.param_dtype)
    if out_dtype not in _TORCH_DTYPE_NAMES:
        raise ValueError(
            f"export dtype must be one of {list(_TORCH_DTYPE_NAMES.values())}, got {out_dtype}"
        )
    tensors = list(_hf_tensors(params, config))  # nothing fetched yet
    itemsize = out_dtype.itemsize
    sizes = [math.prod(shape) * itemsize for _, shape, _ in tensors]
    shards = _group_into_shards(sizes, max_shard_bytes)
    writer = jax.process_index() == 0
    if writer:
        out_dir.mkdir(parents=True, exist_ok=True)
        for stale in old:
            stale.unlink()
    count = len(shards)
    file_names = (
        [SINGLE_FILE]
        if count == 1
        else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    )
    weight_map = {}
    for file_name, members in zip(file_names, shards, strict=True):
        arrays = {}
        for i in members:
            name, _, fetch = tensors[i]
            arrays[name] = fetch().astype(out_dtype)  # every process joins cross-host gathers
            weight_map[name] = file_name
        if writer:
            save_file(arrays, out_dir / file_name, metadata={"format": "pt"})
    if writer:
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
            (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        hf_config = config.to_hf_dict(torch_dtype=_TORCH_DTYPE_NAMES[out_dtype])
        (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        if copy_files_from is not None:
            for name in AUXILIARY_FILES:
                source = Path(copy_files_from) / name
                if source.is_file():
                    shutil.copyfile(source, out_dir / name)
    return out_dir


def _hf_tensors(params: Mapping[str, Any], config: Qwen3Config):
    """(Hugging Face name, shape, fetch-to-host thunk) for every tensor, in checkpoint order."""
    for path, hfs in hf_tensor_names(config).items():
        array = _lookup(params, path)
        stacked = stacked_axes(path)
        if stacked:
            for i, hf in enumerate(hfs):
                at = np.unravel_index(i, array.shape[:stacked])
                yield hf, array.shape[stacked:], (lambda a=array, at=at: _to_host(a[at]))
        else:
            yield hfs[0], array.shape, (lambda a=array: _to_host(a))


def _lookup(tree: Mapping[str, Any], path: str) -> Any:
    for key in path.split("/"):
        tree = tree[key]
    return tree


def _to_host(x: jax.Array | np.ndarray) -> np.ndarray:
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _group_into_shards(sizes: Sequence[int], max_bytes: int) -> list[list[int]]:
    """Greedy, order-preserving grouping of tensors into files of at most ``max_bytes``
    (a single tensor larger than that gets a file of its own)."""
    shards: list[list[int]] = [[]]
    used = 0
    for i, size in enumerate(sizes):
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += size
    return shards
