"""Device meshes and partition rules (data / fsdp / expert / tensor parallel).

A mesh has four named axes:

* ``data``   - batch split across replicas of the parameters;
* ``fsdp``   - batch split *and* parameters split (gathered per use, ZeRO-3 style);
* ``expert`` - a mixture-of-experts model's experts split (each device holds ``E / expert`` of
  every MoE layer's experts, whole). For everything else it is a second ``fsdp``: the batch
  (and so every activation's rows) is split over it, and the other weights' ZeRO dimension
  over ``fsdp`` x ``expert``. A token meets the experts it is routed to on their devices
  (:func:`agentrl_jax.models.moe.moe_ffn`); a dense model gains nothing from it (size 1, the
  default);
* ``tensor`` - attention heads and MLP columns split (Megatron style).

Partition rules map a parameter's path (``"layers/q_proj"``, ``"embed_tokens"``, ...) to a
``PartitionSpec`` over these axes, first matching regex wins. A dimension whose size a mesh axis
does not divide is replicated along that axis instead (e.g. 2 KV heads on 4 tensor devices),
so every rule set works on every mesh; results are identical, only the layout changes.

Layout (:func:`build_mesh`; ``jax.devices()`` lists every process's devices after
``jax.distributed.initialize()``):

* TPU, one slice: the whole mesh is ICI. ``(data, fsdp x expert, tensor)`` is laid over the
  slice's physical torus (``mesh_utils.create_device_mesh``, physical axes split where needed),
  however many hosts the slice has; e.g. fsdp=8 on a v5p 2x2x2 (2 hosts of 4 chips) is the
  whole cube.
  v4 / v5p need one device per chip (megacore mode, their default). ``expert`` is the inner
  part of the ``fsdp x expert`` axis (an expert group's devices are neighbours), so a mesh with
  ``expert`` 1 is laid out exactly as the ``(data, fsdp, tensor)`` mesh it always was.
* TPU, several slices: slices are joined over DCN along ``data`` only; inside a slice as above.
* GPU / CPU: one process -> one node-local mesh; several processes -> processes along ``data``
  (the only axis whose collectives are rare enough for the network between hosts), ``fsdp`` x
  ``expert`` x ``tensor`` and the rest of ``data`` inside a process.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from agentrl_jax.errors import ConfigError
from agentrl_jax.validation import BOOL, MAX_DEVICES, Check, check_fields, integer, is_int, setting

MESH_AXES = ("data", "fsdp", "expert", "tensor")
BATCH_AXES = ("data", "fsdp", "expert")  # a batch dimension is split over all three
# where a weight is split ZeRO-style (gathered per use): fsdp, and expert beside it
ZERO = ("fsdp", "expert")

PartitionRule = tuple[str, P]

# Qwen3ForCausalLM parameters (Hugging Face [out, in] layouts; layer weights have a leading
# layer axis). Column-parallel q/k/v/gate/up split their output features over `tensor`,
# row-parallel o/down split their input features, so each layer needs one reduction per block.
# The hidden dimension is split ZeRO-style over fsdp x expert (on a mesh whose expert axis is 1,
# over fsdp alone, as before the expert axis). The experts [M, E, I, H] / [M, E, H, I] split E
# over `expert`, I over `tensor` and H over `fsdp`.
QWEN3_PARAM_RULES: tuple[PartitionRule, ...] = (
    (r"^(embed_tokens|lm_head)$", P("tensor", ZERO)),
    (r"^layers/(q_proj|k_proj|v_proj|gate_proj|up_proj)$", P(None, "tensor", ZERO)),
    (r"^layers/(o_proj|down_proj)$", P(None, ZERO, "tensor")),
    (r"^(layers/)?\w*norm$", P()),
    (r"^layers/lora/\w+$", P()),  # LoRA adapters (models/lora.py): small, replicated
    (r"^layers/router$", P()),  # MoE routers [layers, experts, hidden]: small, replicated
    (r"^layers/(experts_gate|experts_up)$", P(None, "expert", "tensor", "fsdp")),
    (r"^layers/experts_down$", P(None, "expert", "fsdp", "tensor")),
)

# KVCache fields: k/v [layers, batch, slots, kv_heads, head_dim], lengths [batch].
KV_CACHE_RULES: tuple[PartitionRule, ...] = (
    (r"^(k|v)$", P(None, BATCH_AXES, None, "tensor", None)),
    (r"^lengths$", P(BATCH_AXES)),
)


# a mesh axis' size: a number of devices, or -1 for all those the other axes leave
_AXIS = Check(
    lambda v: integer(1, MAX_DEVICES).test(v) or (is_int(v) and v == -1),
    f"-1 (all remaining devices) or an int in [1, {MAX_DEVICES}]",
    -1,
    MAX_DEVICES,
)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes; at most one may be -1, meaning "all remaining devices".

    ``rollout``: devices of each process that only sample rollouts (the last ones of each
    process's devices); the axes lay out the training devices, the rest. 0 (the default):
    rollouts share the training devices (colocated).

    ``expert``: the expert axis (see the module docstring; a keyword after ``rollout``, so
    ``MeshConfig(data, fsdp, tensor)`` means what it always did). The experts' count must
    divide by it; the batch is split over ``data`` x ``fsdp`` x ``expert``.

    ``ordered_sums``: the gradients and the losses' sums over the batch's devices added in a
    fixed order (:mod:`agentrl_jax.ordered_sums`), so runs on different process counts (2 x 4
    devices, 1 x 8) give the same bits; off: XLA's all-reduce (faster, and less memory)."""

    data: int = setting(-1, _AXIS)
    fsdp: int = setting(1, _AXIS)
    tensor: int = setting(1, _AXIS)
    rollout: int = setting(0, integer(0, MAX_DEVICES))
    expert: int = setting(1, _AXIS)
    ordered_sums: bool = setting(False, BOOL)

    def __post_init__(self) -> None:
        check_fields("mesh", self)
        sizes = self.axes()
        if list(sizes.values()).count(-1) > 1:
            raise ConfigError(f"mesh: at most one axis may be -1, got {sizes}")
        if self.ordered_sums and self.expert != 1:
            raise ConfigError(
                f"mesh.ordered_sums: each device sums its own rows with the batch axes manual, "
                f"where the experts' exchange over mesh.expert cannot run; got mesh.expert "
                f"{self.expert} (set it to 1, or ordered_sums to false)"
            )

    def axes(self) -> dict[str, int]:
        """The configured size of each mesh axis (-1 unresolved), in ``MESH_AXES`` order."""
        return {axis: getattr(self, axis) for axis in MESH_AXES}

    def sizes(self, num_devices: int) -> tuple[int, ...]:
        """Concrete sizes of every axis of ``MESH_AXES`` (data, fsdp, expert, tensor) for
        ``num_devices`` devices."""
        sizes = tuple(self.axes().values())
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % known:
                raise ValueError(
                    f"MeshConfig {self._show(sizes, named=False)}: {num_devices} devices are "
                    f"not divisible by the fixed axes' product {known}"
                )
            sizes = tuple(num_devices // known if s == -1 else s for s in sizes)
        if math.prod(sizes) != num_devices:
            raise ValueError(
                f"MeshConfig {self._show(sizes)} needs {math.prod(sizes)} "
                f"devices, but {num_devices} are available"
            )
        return sizes

    def resolve(self, num_devices: int) -> tuple[int, int, int]:
        """Concrete ``(data, fsdp, tensor)`` sizes for ``num_devices`` devices (the expert
        axis, ``self.expert`` or what -1 resolves to, is :meth:`sizes`'s third)."""
        data, fsdp, _, tensor = self.sizes(num_devices)
        return data, fsdp, tensor

    def _show(self, sizes: tuple[int, ...], named: bool = True) -> str:
        """``(data, fsdp, tensor)=(2, 2, 2)`` (``named``) or ``(2, 2, 2)``, with ``expert``
        only where it is not 1 (named then, whatever ``named`` asks)."""
        names = [a for a, s in zip(MESH_AXES, sizes) if a != "expert" or s != 1]
        kept = tuple(s for a, s in zip(MESH_AXES, sizes) if a in names)
        return f"({', '.join(names)})={kept}" if named or "expert" in names else str(kept)


def device_memory_bytes(device: Any) -> int:
    """The memory one device may allocate: its allocator's limit (``memory_stats()``'s
    ``bytes_limit``, GPU and TPU), else, for a CPU, the machine's physical memory."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def training_devices(config: MeshConfig, devices: Sequence[Any] | None = None) -> list[Any]:
    """``devices`` (default: all global devices) less each process's last ``config.rollout``,
    which sample rollouts only (:func:`rollout_devices`)."""
    devices = list(jax.devices() if devices is None else devices)
    if not config.rollout:
        return devices
    out = []
    for process in sorted({d.process_index for d in devices}):
        own = [d for d in devices if d.process_index == process]
        if len(own) <= config.rollout:
            raise ValueError(
                f"mesh.rollout: {config.rollout} rollout devices leave none of process "
                f"{process}'s {len(own)} devices to train on"
            )
        out += own[: len(own) - config.rollout]
    return out


def rollout_devices(config: MeshConfig) -> list[Any]:
    """This process's devices that sample rollouts only (the last ``config.rollout`` of its
    devices; [] when rollouts share the training devices)."""
    if not config.rollout:
        return []
    own = [d for d in jax.devices() if d.process_index == jax.process_index()]
    return own[len(own) - config.rollout :]


def build_mesh(config: MeshConfig = MeshConfig(), devices: Sequence[Any] | None = None) -> Mesh:
    """A ``("data", "fsdp", "expert", "tensor")`` mesh over ``devices`` (default: all global
    devices but the rollout devices, :func:`training_devices`), laid out as the ``(data, fsdp
    x expert, tensor)`` grid of :func:`device_grid` (the module docstring)."""
    devices = training_devices(config, devices)
    sizes = config.sizes(len(devices))
    data, fsdp, expert, tensor = sizes
    if config.rollout:  # part of each host's devices (holey for the torus layouts): in order,
        # hosts along data
        order = sorted(devices, key=lambda d: (d.process_index, d.id))
        grid = np.array(order, dtype=object).reshape(sizes)
    else:
        grid = device_grid((data, fsdp * expert, tensor), devices).reshape(sizes)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def training_mesh(config: MeshConfig) -> Mesh | None:
    """The train state's mesh (:func:`build_mesh` over the training devices), or None where
    it would be one device."""
    if math.prod(config.sizes(len(training_devices(config)))) == 1:
        return None
    return build_mesh(config)


def data_mesh(devices: Sequence[Any]) -> Mesh:
    """A mesh of ``devices`` along ``data`` only (rows split, parameters replicated): the
    rollout devices of a split mesh. Laid out by :func:`build_mesh` where its device layout
    takes them, else in the given order (a holey set of TPU chips)."""
    try:
        return build_mesh(MeshConfig(data=-1), devices)
    except (AssertionError, ValueError):
        grid = np.array(list(devices), dtype=object).reshape(len(devices), 1, 1, 1)
        return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def device_grid(shape: tuple[int, int, int], devices: Sequence[Any]) -> np.ndarray:
    """``devices`` as an array of ``shape`` = (data, fsdp, tensor), laid out as the module says
    (:func:`build_mesh` passes ``fsdp x expert`` as the middle axis and splits it after)."""
    if devices[0].platform == "tpu":
        return _tpu_grid(shape, devices)
    num_processes = len({d.process_index for d in devices})
    if num_processes == 1:
        return mesh_utils.create_device_mesh(shape, devices)
    return mesh_utils.create_hybrid_device_mesh(
        per_process_mesh_shape(shape, num_processes),
        (num_processes, 1, 1),
        devices,
        process_is_granule=True,
    )


def _tpu_grid(shape: tuple[int, int, int], devices: Sequence[Any]) -> np.ndarray:
    """ICI torus layout inside each slice; several slices stacked along ``data`` (DCN)."""
    num_slices = len({slice_index(d) for d in devices})
    try:
        if num_slices == 1:
            return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        return mesh_utils.create_hybrid_device_mesh(
            per_slice_mesh_shape(shape, num_slices),
            (num_slices, 1, 1),
            devices,
            allow_split_physical_axes=True,
        )
    except AssertionError as error:  # mesh_utils asserts on megacore and holey device sets
        hint = (
            "; use one device per chip (megacore mode: the runtime's default, or "
            "chip_config_name='megacore' for compile-only topologies)"
            if any(getattr(d, "core_on_chip", 0) for d in devices)
            else ""
        )
        raise ValueError(
            f"cannot lay mesh (data, fsdp, tensor)={shape} over {len(devices)} "
            f"{devices[0].device_kind} devices in {num_slices} slice(s): "
            f"{error}{hint}"
        ) from error


def slice_index(device: Any) -> int:
    """The TPU slice ``device`` belongs to (0 where the device has no ``slice_index``)."""
    return getattr(device, "slice_index", 0)


def per_process_mesh_shape(shape: tuple[int, ...], num_processes: int) -> tuple[int, ...]:
    """The part of a mesh of ``shape`` (``data`` first: ``(data, fsdp, tensor)`` or ``MESH_AXES``'
    four) that lives on one host (processes on data)."""
    return _split_data(shape, num_processes, ("process", "processes"), "hosts are laid along data")


def per_slice_mesh_shape(shape: tuple[int, ...], num_slices: int) -> tuple[int, ...]:
    """The part of a mesh of ``shape`` (``data`` first) inside one TPU slice (slices on data)."""
    return _split_data(
        shape, num_slices, ("slice", "slices"), "TPU slices are laid along data (DCN)"
    )


def _split_data(
    shape: tuple[int, ...], parts: int, unit: tuple[str, str], why: str
) -> tuple[int, ...]:
    """``shape`` with ``data`` (its first) divided by ``parts`` (``unit``: singular and plural
    name)."""
    data, *rest = shape
    if data % parts:
        raise ValueError(
            f"with {parts} {unit[1]} the data axis ({data}) must be a "
            f"multiple of the {unit[0]} count: {why}"
        )
    return (data // parts, *rest)


def describe_mesh(mesh: Mesh) -> str:
    """One line for logs: ``"data=1 fsdp=8 tensor=1: 8 TPU v5 devices, 2 processes, 1 slice"``
    (``expert=N`` between fsdp and tensor where N is not 1)."""
    devices = list(mesh.devices.flat)
    kinds = "/".join(sorted({d.device_kind for d in devices}))
    processes = len({d.process_index for d in devices})
    slices = len({slice_index(d) for d in devices})
    axes = " ".join(
        f"{name}={size}" for name, size in mesh.shape.items() if name != "expert" or size != 1
    )
    return (
        f"{axes}: {len(devices)} {kinds} devices, {processes} process"
        f"{'es' * (processes > 1)}, {slices} slice{'s' * (slices > 1)}"
    )


def spec_for(path: str, shape: Sequence[int], mesh: Mesh, rules: Sequence[PartitionRule]) -> P:
    """The first matching rule's spec for ``path``, replicating dims an axis does not divide.

    A dimension split over several axes (``("fsdp", "expert")``) is split over those of them
    the mesh has, less ``expert`` where it is 1 (one axis left: named alone), so a mesh whose
    ``expert`` axis is 1 gives the specs it gave before that axis existed."""
    matched = next(((pattern, spec) for pattern, spec in rules if re.search(pattern, path)), None)
    if matched is None:
        raise ValueError(
            f"no partition rule matches parameter {path!r} (shape {tuple(shape)}); "
            f"rules: {[pattern for pattern, _ in rules]}"
        )
    pattern, spec = matched
    if len(spec) > len(shape):
        raise ValueError(
            f"partition rule {pattern!r} gives {spec} with {len(spec)} dims for "
            f"{path!r} of shape {tuple(shape)}"
        )
    fitted = []
    for dim, axes in zip(shape, spec, strict=False):  # trailing dims beyond spec: replicated
        fitted.append(_fit_axes(dim, axes, mesh))
    return P(*fitted)


def _fit_axes(dim: int, axes: Any, mesh: Mesh) -> Any:
    """One dimension's spec entry fitted to ``mesh`` (see :func:`spec_for`)."""
    if axes is None:
        return None
    if isinstance(axes, str):
        ways = mesh.shape.get(axes, 1)
        return axes if ways > 1 and dim % ways == 0 else None
    names = [
        name
        for name in axes
        if name in mesh.shape and not (name == "expert" and mesh.shape[name] == 1)
    ]
    ways = math.prod(mesh.shape[name] for name in names)
    if ways <= 1 or dim % ways:
        return None
    return names[0] if len(names) == 1 else tuple(names)


def tree_shardings(tree: Any, mesh: Mesh, rules: Sequence[PartitionRule]) -> Any:
    """A ``NamedSharding`` for every array leaf of ``tree`` (arrays or ShapeDtypeStructs).

    Paths join dict keys / attribute names with "/", e.g. ``layers/q_proj``; the ``value``
    attribute of an NNX Variable is not part of the path.
    """

    def sharding(path, leaf):
        return NamedSharding(mesh, spec_for(path_string(path), leaf.shape, mesh, rules))

    return jax.tree_util.tree_map_with_path(sharding, tree)


def path_string(path: Sequence[Any]) -> str:
    """``(DictKey('layers'), DictKey('q_proj'), GetAttrKey('value'))`` -> ``"layers/q_proj"``."""
    parts = []
    for entry in path:
        if isinstance(entry, jax.tree_util.DictKey):
            parts.append(str(entry.key))
        elif isinstance(entry, jax.tree_util.GetAttrKey):
            parts.append(entry.name)
        elif isinstance(entry, jax.tree_util.SequenceKey):
            parts.append(str(entry.idx))
        else:
            parts.append(str(entry))
    if parts and parts[-1] == "value" and isinstance(path[-1], jax.tree_util.GetAttrKey):
        parts.pop()
    return "/".join(parts)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Leading (batch) dimension split over ``data`` x ``fsdp``, the rest replicated."""
    return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def shard_tree(tree: Any, mesh: Mesh, rules: Sequence[PartitionRule]) -> Any:
    """``jax.device_put`` every leaf of ``tree`` onto its rule-given sharding."""
    return jax.device_put(tree, tree_shardings(tree, mesh, rules))


def describe(tree: Any) -> dict[str, str]:
    """``{path: str(PartitionSpec)}`` of a tree of sharded arrays, for logs and tests."""
    return {
        path_string(path): str(getattr(leaf.sharding, "spec", leaf.sharding))
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


__all__ = [
    "BATCH_AXES",
    "KV_CACHE_RULES",
    "MESH_AXES",
    "MeshConfig",
    "QWEN3_PARAM_RULES",
    "ZERO",
    "batch_sharding",
    "build_mesh",
    "describe",
    "describe_mesh",
    "device_grid",
    "expert_shards",
    "per_process_mesh_shape",
    "per_slice_mesh_shape",
    "shard_tree",
    "slice_index",
    "spec_for",
    "tree_shardings",
]


# ---------------------------------------------------------------------------- generation layout
GENERATION_LAYOUTS = ("auto", "replicated", "training")
"""Where decode reads the parameters from (:func:`resolve_layout`)."""


def _drop_axis(axes: Any, axis: str) -> Any:
    """One dimension's entry of a PartitionSpec without mesh axis ``axis`` (a ZeRO split
    over ``fsdp`` x ``expert``, :data:`ZERO`, is dropped whole with either); without ``fsdp``,
    the experts' ``E`` split over ``expert`` spreads over ``fsdp`` x ``expert``."""
    if axis == "fsdp" and axes == "expert":
        return ZERO
    if axes is None or axes == axis or (axis in ZERO and tuple(axes) == ZERO):
        return None
    if isinstance(axes, str):
        return axes
    kept = tuple(a for a in axes if a != axis)
    return kept[0] if len(kept) == 1 else (kept or None)


def generation_rules(
    rules: Sequence[PartitionRule] = QWEN3_PARAM_RULES, drop: str = "fsdp"
) -> tuple[PartitionRule, ...]:
    """``rules`` with mesh axis ``drop`` removed from every spec: the parameters replicated
    over that axis (``P(None, "tensor", "fsdp")`` -> ``P(None, "tensor", None)``). The ZeRO
    split of the dense weights over ``fsdp`` x ``expert`` goes whole (``P(None, "tensor",
    ("fsdp", "expert"))`` -> ``P(None, "tensor", None)``). An MoE model's experts stay split,
    whole experts over ``fsdp`` x ``expert`` (``P(None, "expert", "tensor", "fsdp")`` ->
    ``P(None, ("fsdp", "expert"), "tensor", None)``; on a mesh without an expert axis, over
    ``fsdp``): all of Qwen3-30B-A3B's experts on every device would be 57 GiB. The experts'
    computation is then partitioned by XLA (each device's assignments to its experts)."""
    return tuple(
        (pattern, P(*(_drop_axis(axes, drop) for axes in spec))) for pattern, spec in rules
    )


def resolve_layout(layout: str, mesh: Mesh | None) -> str:
    """``"auto"``: ``"replicated"`` on a mesh whose ``fsdp`` or ``expert`` axis has more than
    one device, else ``"training"`` (nothing to gain: the training layout has no ZeRO split)."""
    if layout not in GENERATION_LAYOUTS:
        raise ValueError(f"generation_layout must be one of {GENERATION_LAYOUTS}, got {layout!r}")
    if layout == "auto":
        zero = mesh is not None and any(mesh.shape.get(axis, 1) > 1 for axis in ZERO)
        return "replicated" if zero else "training"
    return layout


def generation_params(
    params: Any,
    mesh: Mesh | None = None,
    layout: str = "auto",
    device: Any = None,
    rules: Sequence[PartitionRule] = QWEN3_PARAM_RULES,
    dtype: Any = None,
) -> Any:
    """``params`` placed where decode reads them from (one ``device_put`` per update).

    Without a mesh: committed to ``device`` (default ``jax.local_devices()[0]``; a no-op for
    parameters already there). On a mesh, ``layout`` (see :func:`resolve_layout`):
    ``"replicated"`` lays them out by :func:`generation_rules` (no all-gather of weights
    in decode), as a copy in ``dtype`` if given (pass the model's compute dtype: the model
    casts every weight to it before use, so the tokens are the same and a float32 model
    computing in bfloat16 needs half the memory for the copy; cast while still sharded);
    ``"training"`` keeps them as they are (the caller placed them by ``rules``).
    """
    if mesh is None:
        return jax.device_put(
            params, jax.sharding.SingleDeviceSharding(device or jax.local_devices()[0])
        )
    if resolve_layout(layout, mesh) == "training":
        return params
    if dtype is not None:
        params = jax.tree.map(
            lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params
        )
    return jax.device_put(params, tree_shardings(params, mesh, generation_rules(rules)))


def batch_shards(mesh: Mesh) -> int:
    """How many ways a mesh splits a batch (``data`` x ``fsdp`` x ``expert``)."""
    return int(np.prod([mesh.shape.get(axis, 1) for axis in BATCH_AXES]))


# ---------------------------------------------------------------------------- expert parallelism
def expert_shards(mesh: Mesh | None) -> int:
    """The size of a mesh's ``expert`` axis (1 without a mesh or without the axis)."""
    return 1 if mesh is None else int(mesh.shape.get("expert", 1))
