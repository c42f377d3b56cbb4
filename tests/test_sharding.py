"""Partition rules, mesh building, and the model sharded over 8 fake CPU devices.

JAX reads ``XLA_FLAGS`` once, at import, and other test files import it in the same pytest
process; so the 8-device check runs this file as a script in a subprocess with
``--xla_force_host_platform_device_count=8`` and reads its JSON report.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

from agentrl_jax.sharding import (
    KV_CACHE_RULES,
    MESH_AXES,
    QWEN3_PARAM_RULES,
    MeshConfig,
    build_mesh,
    describe_mesh,
    device_grid,
    per_process_mesh_shape,
    per_slice_mesh_shape,
    spec_for,
)

MESH_SHAPES = [(8, 1, 1), (2, 1, 4), (1, 2, 4), (2, 2, 2)]


def _mesh(data: int, fsdp: int, tensor: int, expert: int = 1) -> AbstractMesh:
    return AbstractMesh((data, fsdp, expert, tensor), MESH_AXES)


def test_rules_split_heads_and_mlp_columns_over_tensor_and_features_over_fsdp():
    mesh = _mesh(1, 2, 4)
    n, d, q, kv, i, v = 28, 1024, 2048, 1024, 3072, 151936  # Qwen3-0.6B shapes

    def spec(path, shape):
        return spec_for(path, shape, mesh, QWEN3_PARAM_RULES)

    assert spec("layers/q_proj", (n, q, d)) == P(None, "tensor", "fsdp")
    assert spec("layers/k_proj", (n, kv, d)) == P(None, "tensor", "fsdp")
    assert spec("layers/up_proj", (n, i, d)) == P(None, "tensor", "fsdp")
    assert spec("layers/o_proj", (n, d, q)) == P(None, "fsdp", "tensor")
    assert spec("layers/down_proj", (n, d, i)) == P(None, "fsdp", "tensor")
    assert spec("embed_tokens", (v, d)) == P("tensor", "fsdp")
    assert spec("lm_head", (v, d)) == P("tensor", "fsdp")
    for norm in (
        "norm",
        "layers/input_layernorm",
        "layers/q_norm",
        "layers/k_norm",
        "layers/post_attention_layernorm",
    ):
        assert spec(norm, (n, d)) == P()
    assert spec_for("k", (n, 8, 4096, 8, 128), mesh, KV_CACHE_RULES) == P(
        None, ("data", "fsdp"), None, "tensor", None
    )


def test_axes_that_do_not_divide_a_dimension_are_replicated():
    mesh = _mesh(2, 1, 4)
    # 250 vocab rows do not split 4 ways; 6 kv features do not either; size-1 axes are dropped.
    assert spec_for("embed_tokens", (250, 64), mesh, QWEN3_PARAM_RULES) == P(None, None)
    assert spec_for("layers/k_proj", (2, 6, 64), mesh, QWEN3_PARAM_RULES) == P(None, None, None)
    assert spec_for("lengths", (5,), mesh, KV_CACHE_RULES) == P(None)
    assert spec_for("lengths", (8,), mesh, KV_CACHE_RULES) == P(("data", "fsdp"))


def test_unknown_parameter_path_is_a_clear_error():
    with pytest.raises(ValueError, match="no partition rule matches parameter 'layers/new_proj'"):
        spec_for("layers/new_proj", (2, 4, 4), _mesh(8, 1, 1), QWEN3_PARAM_RULES)


def test_mesh_config_validation_and_resolution():
    assert MeshConfig().resolve(8) == (8, 1, 1)
    assert MeshConfig(data=-1, tensor=4).resolve(8) == (2, 1, 4)
    assert MeshConfig(data=2, fsdp=2, tensor=2).resolve(8) == (2, 2, 2)
    with pytest.raises(ValueError, match=r"mesh\.tensor: must be -1"):
        MeshConfig(tensor=0)
    with pytest.raises(ValueError, match="at most one axis may be -1"):
        MeshConfig(data=-1, fsdp=-1)
    with pytest.raises(ValueError, match="needs 6 devices, but 8"):
        MeshConfig(data=3, tensor=2).resolve(8)
    with pytest.raises(ValueError, match="not divisible"):
        MeshConfig(tensor=3).resolve(8)
    assert not MeshConfig().ordered_sums and MeshConfig(ordered_sums=True).ordered_sums
    with pytest.raises(ValueError, match=r"mesh\.ordered_sums: must be true or false"):
        MeshConfig(ordered_sums=1)
    with pytest.raises(ValueError, match=r"mesh\.ordered_sums: .* got mesh\.expert 2"):
        MeshConfig(ordered_sums=True, expert=2)


def test_hosts_are_laid_along_data():
    assert per_process_mesh_shape((4, 2, 4), num_processes=2) == (2, 2, 4)
    assert per_process_mesh_shape((4, 1, 2, 1), num_processes=2) == (2, 1, 2, 1)  # MESH_AXES
    with pytest.raises(ValueError, match="multiple of the process count"):
        per_process_mesh_shape((1, 2, 4), num_processes=2)
    assert per_slice_mesh_shape((4, 2, 4), num_slices=4) == (1, 2, 4)
    with pytest.raises(ValueError, match=r"2 slices the data axis \(1\) must be a multiple"):
        per_slice_mesh_shape((1, 8, 1), num_slices=2)


def test_single_device_mesh():
    mesh = build_mesh()
    assert mesh.axis_names == MESH_AXES and mesh.devices.size == len(mesh.devices.flat)
    assert mesh.axis_types == (AxisType.Auto,) * 4 and MESH_AXES[2] == "expert"
    assert describe_mesh(mesh).startswith("data=1 fsdp=1 tensor=1: 1 cpu devices, 1 process,")


def test_gpu_processes_are_laid_along_data():
    # Stand-ins for 2 nodes of 4 GPUs: mesh_utils only reads these attributes off a GPU device.
    devices = [
        SimpleNamespace(platform="gpu", device_kind="H200", id=i, process_index=i // 4)
        for i in range(8)
    ]
    grid = device_grid((4, 2, 1), devices)
    assert grid.shape == (4, 2, 1)
    assert [{d.process_index for d in grid[i].flat} for i in range(4)] == [{0}, {0}, {1}, {1}]
    with pytest.raises(ValueError, match=r"data axis \(1\) must be a multiple of the process"):
        device_grid((1, 8, 1), devices)
    one_node = device_grid((1, 2, 2), devices[:4])
    assert sorted(d.id for d in one_node.flat) == [0, 1, 2, 3]


@pytest.fixture(scope="module")
def eight_devices(tmp_path_factory) -> subprocess.CompletedProcess:
    """This file run as a script under 8 fake CPU devices (one start for the two tests below):
    it prints the meshes of test_meshes_on_8_fake_cpu_devices (``MESHES {json}``), then
    ``_child``'s report (the last line)."""
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=(
            os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
        ).strip(),
    )
    return subprocess.run(
        [sys.executable, __file__, str(tmp_path_factory.mktemp("sharding"))],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def _meshes() -> None:
    """Runs under 8 fake devices: print the meshes of a few configs, one JSON line."""
    from agentrl_jax.sharding import MeshConfig, build_mesh

    configs = [(-1, 1, 1), (-1, 8, 1), (2, 4, 1), (1, 4, 2), (2, 2, 2), (-1, 1, 4)]
    meshes = [build_mesh(MeshConfig(*c)) for c in configs]
    meshes += [build_mesh(MeshConfig(fsdp=2, expert=4)), build_mesh(MeshConfig(expert=2, tensor=2))]
    described = [
        [list(m.devices.shape), [d.id for d in m.devices.flat], list(m.axis_names)]
        + [[str(t) for t in m.axis_types]]
        for m in meshes
    ]
    print("MESHES " + json.dumps(described), flush=True)


def test_meshes_on_8_fake_cpu_devices(eight_devices):
    """One process: the whole mesh is node-local, every device exactly once."""
    done = eight_devices
    lines = [line for line in done.stdout.splitlines() if line.startswith("MESHES ")]
    assert lines, done.stderr[-4000:]
    report = json.loads(lines[0][len("MESHES ") :])
    assert [tuple(shape) for shape, *_ in report] == [  # (data, fsdp, expert, tensor)
        (8, 1, 1, 1),
        (1, 8, 1, 1),
        (2, 4, 1, 1),
        (1, 4, 1, 2),
        (2, 2, 1, 2),
        (2, 1, 1, 4),
        (1, 2, 4, 1),
        (2, 1, 2, 2),
    ]
    for _, ids, names, types in report:
        assert sorted(ids) == list(range(8)) and tuple(names) == MESH_AXES
        assert types == [str(AxisType.Auto)] * 4


# --- TPU topologies (compile-only devices from libtpu; skipped where libtpu is absent) ---


@functools.cache
def _tpu_devices(topology: str, **options) -> tuple:
    pytest.importorskip("libtpu")
    from jax.experimental import topologies

    return tuple(topologies.get_topology_desc(topology, "tpu", **options).devices)


V4_MEGACORE = {"chip_config_name": "megacore"}  # v4's default: one device per chip


def _assert_tpu_mesh(mesh, devices, shape: tuple[int, int, int]):
    """Checks a mesh of ``shape`` = (data, fsdp, tensor), expert 1; returns its devices as a
    (data, fsdp, tensor) grid."""
    data, fsdp, tensor = shape
    assert mesh.devices.shape == (data, fsdp, 1, tensor) and mesh.axis_names == MESH_AXES
    assert mesh.axis_types == (AxisType.Auto,) * 4
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)
    return mesh.devices[:, :, 0, :]


def _is_cuboid(devices) -> bool:
    """Whether the chips' coordinates fill a box: a physically contiguous ICI block."""
    coords = {tuple(d.coords) for d in devices}
    box = math.prod(max(c[i] for c in coords) - min(c[i] for c in coords) + 1 for i in range(3))
    return len(coords) == len(devices) == box


@pytest.mark.parametrize(
    "topology, options, config, shape",
    [
        ("v5p:2x2x2", {}, MeshConfig(data=-1, fsdp=8, tensor=1), (1, 8, 1)),
        ("v5p:2x2x2", {}, MeshConfig(data=2, fsdp=4, tensor=1), (2, 4, 1)),
        ("v5p:2x2x2", {}, MeshConfig(data=1, fsdp=4, tensor=2), (1, 4, 2)),
        ("v5p:2x2x2", {}, MeshConfig(data=2, fsdp=2, tensor=2), (2, 2, 2)),
        ("v4:2x2x2", V4_MEGACORE, MeshConfig(data=-1, fsdp=8, tensor=1), (1, 8, 1)),
        ("v4:2x2x2", V4_MEGACORE, MeshConfig(data=2, fsdp=4, tensor=1), (2, 4, 1)),
        ("v5e:2x4", {}, MeshConfig(data=-1, fsdp=8, tensor=1), (1, 8, 1)),
        ("v5e:2x4", {}, MeshConfig(data=1, fsdp=4, tensor=2), (1, 4, 2)),
        ("v6e:2x4", {}, MeshConfig(data=-1, fsdp=8, tensor=1), (1, 8, 1)),
        ("v6e:2x4", {}, MeshConfig(data=2, fsdp=2, tensor=2), (2, 2, 2)),
        ("v5p:2x2x4", {}, MeshConfig(data=-1, fsdp=16, tensor=1), (1, 16, 1)),
    ],
)
def test_one_tpu_slice_is_all_ici_across_its_hosts(topology, options, config, shape):
    devices = _tpu_devices(topology, **options)
    assert len({d.process_index for d in devices}) > 1  # hosts of 4 chips: several processes
    mesh = build_mesh(config, devices)
    grid = _assert_tpu_mesh(mesh, devices, shape)
    data, fsdp, tensor = shape
    groups = [grid[i, :, j] for i in range(data) for j in range(tensor)]
    if data == tensor == 1:  # fsdp spans the whole slice, both hosts included
        assert set(groups[0]) == set(devices)
    if topology.startswith(("v5p", "v4")):  # 3-D tori: every axis group is a contiguous block
        assert all(_is_cuboid(group) for group in groups)
        assert all(_is_cuboid(grid[i, j, :]) for i in range(data) for j in range(fsdp))
    assert describe_mesh(mesh).endswith(
        f"{len(devices)} {devices[0].device_kind} devices, "
        f"{len({d.process_index for d in devices})} processes, "
        "1 slice"
    )


def test_tpu_slices_are_laid_along_data():
    devices = _tpu_devices("v5p:2x2x2", num_slices=2)
    assert sorted({d.slice_index for d in devices}) == [0, 1]
    for config, shape in [
        (MeshConfig(data=-1, fsdp=8), (2, 8, 1)),
        (MeshConfig(data=2, fsdp=4, tensor=2), (2, 4, 2)),
        (MeshConfig(data=4, fsdp=4), (4, 4, 1)),
    ]:
        mesh = build_mesh(config, devices)
        grid = _assert_tpu_mesh(mesh, devices, shape)
        half = shape[0] // 2
        assert {d.slice_index for d in mesh.devices[:half].flat} == {0}
        assert {d.slice_index for d in mesh.devices[half:].flat} == {1}
        assert all(_is_cuboid(grid[i, :, j]) for i in range(shape[0]) for j in range(shape[2]))
    assert describe_mesh(build_mesh(MeshConfig(), devices)).endswith("2 slices")
    with pytest.raises(
        ValueError,
        match=r"2 slices the data axis \(1\) must be a multiple of "
        "the slice count",
    ):
        build_mesh(MeshConfig(data=1, fsdp=16), devices)


def test_an_expert_axis_is_the_inner_part_of_fsdp_x_expert_on_the_torus():
    """fsdp 2 x expert 8 on a v5p 2x2x4 (16 chips, 4 hosts): the devices of the fsdp 16 mesh,
    in the same order; every expert group (the devices that exchange tokens in each MoE
    layer) a contiguous block of the torus."""
    devices = _tpu_devices("v5p:2x2x4")
    mesh = build_mesh(MeshConfig(data=1, fsdp=2, expert=8), devices)
    assert mesh.devices.shape == (1, 2, 8, 1) and mesh.axis_names == MESH_AXES
    flat = build_mesh(MeshConfig(data=1, fsdp=16), devices)
    assert [d.id for d in mesh.devices.flat] == [d.id for d in flat.devices.flat]
    assert all(_is_cuboid(mesh.devices[0, f, :, 0]) for f in range(2))
    assert describe_mesh(mesh).startswith("data=1 fsdp=2 expert=8 tensor=1: 16 TPU v5")


def test_tpu_layouts_mesh_utils_cannot_build_are_clear_errors():
    two_cores_per_chip = _tpu_devices("v4:2x2x2")  # v4 outside megacore mode: 16 devices
    assert len(two_cores_per_chip) == 16
    with pytest.raises(ValueError, match=r"over 16 TPU v4 devices .*chip_config_name='megacore'"):
        build_mesh(MeshConfig(data=-1, fsdp=8), two_cores_per_chip)
    with pytest.raises(ValueError, match="cannot lay mesh"):  # 3 chips are no box of the torus
        build_mesh(MeshConfig(), _tpu_devices("v5p:2x2x2")[:3])


def test_sharded_forward_and_cache_equal_single_device_on_8_fake_devices(eight_devices):
    done = eight_devices
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["devices"] == 8
    assert [tuple(r["mesh"]) for r in report["meshes"]] == MESH_SHAPES
    assert report["logit_std"] > 0.3  # logits big enough for 1e-5 to be a real test
    for r in report["meshes"]:
        assert r["forward_max_diff"] <= 1e-5, r
        assert r["cache_max_diff"] <= 1e-5, r
        assert r["param_devices"] == 8, r
    by_shape = {tuple(r["mesh"]): r for r in report["meshes"]}
    # Each device reads only its shard of a file tensor, never the whole tensor: q_proj
    # [heads*hd, hidden] is split 4 ways on tensor, and 2 more on fsdp where fsdp is 2.
    assert by_shape[(2, 1, 4)]["q_proj_largest_read"] == 1 / 4
    assert by_shape[(1, 2, 4)]["q_proj_largest_read"] == 1 / 8
    assert by_shape[(2, 2, 2)]["q_proj_largest_read"] == 1 / 4
    # 2 x 4 data x tensor: heads and MLP columns split 4 ways, batch split 2 ways.
    assert by_shape[(2, 1, 4)]["specs"]["layers/q_proj"] == str(P(None, "tensor", None))
    assert by_shape[(2, 1, 4)]["specs"]["layers/down_proj"] == str(P(None, None, "tensor"))
    assert by_shape[(1, 2, 4)]["specs"]["layers/q_proj"] == str(P(None, "tensor", "fsdp"))
    assert all(r["cache_layout_kept"] for r in report["meshes"])  # a step keeps the cache's layout
    assert by_shape[(8, 1, 1)]["specs"]["layers/q_proj"] == str(P(None, None, None))


def _child(workdir: Path) -> None:
    """Runs under 8 fake devices: compare sharded and single-device runs, print a JSON report."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from agentrl_jax.models import (
        KVCache,
        Qwen3Config,
        Qwen3ForCausalLM,
        checkpoints,
        export_qwen3,
        load_qwen3,
        positions_from_mask,
    )
    from agentrl_jax.sharding import batch_sharding, describe, tree_shardings

    config = Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16,
    )
    random = Qwen3ForCausalLM(config, rngs=nnx.Rngs(0))
    # Weights 5x the 0.02 init (norms kept), so attention is far from uniform and logits O(1).
    state = nnx.state(random, nnx.Param)
    nnx.replace_by_pure_dict(
        state,
        jax.tree_util.tree_map_with_path(
            lambda path, w: w if "norm" in jax.tree_util.keystr(path) else 5.0 * w,
            nnx.to_pure_dict(state),
        ),
    )
    nnx.update(random, state)
    export_qwen3(random, workdir / "model")

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (8, 12)).astype(np.int32)
    mask = np.ones((8, 12), bool)
    mask[:4, :5] = False  # half the rows left-padded
    step_tokens = rng.integers(0, 256, (8, 1)).astype(np.int32)

    def run(model, mesh):
        graphdef, state = nnx.split(model)

        @jax.jit
        def forward(state, tokens, mask):
            return nnx.merge(graphdef, state)(tokens, positions_from_mask(mask), mask)[0]

        @jax.jit
        def cached(state, tokens, mask, cache):
            positions = positions_from_mask(mask, cache.lengths)
            return nnx.merge(graphdef, state)(tokens, positions, mask, cache)

        def place(x):
            return x if mesh is None else jax.device_put(x, batch_sharding(mesh, x.ndim))

        empty = KVCache.empty(config, 8, 20, jnp.float32)
        if mesh is not None:
            empty = jax.device_put(empty, tree_shardings(empty, mesh, KV_CACHE_RULES))
        logits = forward(state, place(tokens), place(mask))
        prefill, cache = cached(state, place(tokens), place(mask), empty)
        decode, cache = cached(state, place(step_tokens), place(np.ones((8, 1), bool)), cache)
        cached_logits = np.concatenate([np.asarray(prefill)[mask], np.asarray(decode)[:, 0]])
        return np.asarray(logits), cached_logits, cache

    # Record how much of each file tensor every read touches.
    reads: list[tuple[str, float]] = []
    memory_map = checkpoints.TensorEntry.mmap

    class RecordingMap:
        def __init__(self, entry):
            self.entry, self.array = entry, memory_map(entry)

        def __getitem__(self, index):
            part = self.array[index]
            reads.append((self.entry.name, part.size / self.array.size))
            return part

    checkpoints.TensorEntry.mmap = lambda entry: RecordingMap(entry)

    reference, reference_cache, _ = run(load_qwen3(workdir / "model"), None)
    report = {"devices": len(jax.devices()), "logit_std": float(reference.std()), "meshes": []}
    for shape in MESH_SHAPES:
        mesh = build_mesh(MeshConfig(*shape))
        reads.clear()
        model = load_qwen3(workdir / "model", mesh=mesh)
        q_proj_reads = [fraction for name, fraction in reads if name.endswith("q_proj.weight")]
        logits, cache_logits, cache = run(model, mesh)
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        report["meshes"].append(
            {
                "mesh": shape,
                "forward_max_diff": float(np.abs(logits - reference).max()),
                "cache_max_diff": float(np.abs(cache_logits - reference_cache).max()),
                "param_devices": len(params["layers"]["q_proj"].sharding.device_set),
                "q_proj_largest_read": max(q_proj_reads),
                "specs": describe(params),
                "cache_layout_kept": all(
                    leaf.sharding.is_equivalent_to(want, leaf.ndim)
                    for leaf, want in zip(
                        jax.tree.leaves(cache),
                        jax.tree.leaves(tree_shardings(cache, mesh, KV_CACHE_RULES)),
                        strict=True,
                    )
                ),
            }
        )
    print(json.dumps(report))


if __name__ == "__main__":
    _meshes()
    _child(Path(sys.argv[1]))
