"""Expert parallelism (issue #58): the ``expert`` mesh axis (``MeshConfig.expert``), the partition
rules that split the experts over it, and :func:`agentrl_jax.models.moe.moe_ffn`, the experts'
computation a forward on such a mesh runs (``moe.expert_parallel`` under ``shard_map``).

On 8 fake CPU devices (a child process: JAX fixes its device count at import), with the real
mesh (``build_mesh``) and the real partition rules: the MoE layer on ``fsdp`` 2 x ``expert`` 4
and on ``expert`` 8 gives the one-device outputs and gradients (tokens, router, every expert
weight), for a spread router and for a skewed one that sends every token to one expert
(dropless: the result is also the per-token float64 reference, so no token was dropped on the
expert's device); no expert weight is gathered whole over the expert axis; and a whole tiny
MoE train step's gradients on ``fsdp`` 2 x ``expert`` 4 equal the one-device step's.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from fake_devices import fake_devices_env
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from agentrl_jax.errors import ConfigError
from agentrl_jax.sharding import (
    BATCH_AXES,
    KV_CACHE_RULES,
    MESH_AXES,
    QWEN3_PARAM_RULES,
    MeshConfig,
    generation_rules,
    resolve_layout,
    spec_for,
)


def test_the_expert_axis_is_validated_like_the_others():
    assert MeshConfig(data=1, fsdp=2, expert=4).sizes(8) == (1, 2, 4, 1)
    assert MeshConfig(fsdp=2, expert=4).sizes(16) == (2, 2, 4, 1)  # data -1: the rest
    assert MeshConfig(data=1, fsdp=2, expert=-1).sizes(8) == (1, 2, 4, 1)
    assert MeshConfig(data=1, fsdp=2, expert=4).resolve(8) == (1, 2, 1)  # (data, fsdp, tensor)
    assert MeshConfig(2, 2, 2).sizes(8) == (2, 2, 1, 2)  # positional: data, fsdp, tensor
    for bad in (0, -2, 1.5, "4", True):
        with pytest.raises(ConfigError, match="mesh.expert: must be -1"):
            MeshConfig(expert=bad)
    with pytest.raises(ConfigError, match="at most one axis may be -1"):
        MeshConfig(expert=-1)  # data is -1 by default
    with pytest.raises(ValueError, match=r"\(data, fsdp, expert, tensor\)=\(1, 1, 3, 1\) needs 3"):
        MeshConfig(data=1, expert=3).sizes(8)
    with pytest.raises(ValueError, match="not divisible"):
        MeshConfig(expert=3).sizes(8)


def test_the_rules_split_the_experts_over_expert_and_the_rest_over_fsdp_and_expert():
    mesh = AbstractMesh((1, 2, 4, 1), MESH_AXES)
    m, e, i, h, q, v = 48, 128, 768, 2048, 4096, 151936  # Qwen3-30B-A3B

    def spec(path, shape, rules=QWEN3_PARAM_RULES):
        return spec_for(path, shape, mesh, rules)

    assert spec("layers/experts_gate", (m, e, i, h)) == P(None, "expert", None, "fsdp")
    assert spec("layers/experts_down", (m, e, h, i)) == P(None, "expert", "fsdp", None)
    assert spec("layers/router", (m, e, h)) == P()
    assert spec("layers/q_proj", (m, q, h)) == P(None, None, ("fsdp", "expert"))
    assert spec("layers/o_proj", (m, h, q)) == P(None, ("fsdp", "expert"), None)
    assert spec("embed_tokens", (v, h)) == P(None, ("fsdp", "expert"))
    assert spec_for("k", (m, 8, 64, 4, 128), mesh, KV_CACHE_RULES)[1] == BATCH_AXES
    # decode's copy: the ZeRO split gone, whole experts over fsdp x expert
    generation = generation_rules()
    zero = ("fsdp", "expert")
    assert spec("layers/experts_up", (m, e, i, h), generation) == P(None, zero, None, None)
    assert spec("layers/experts_down", (m, e, h, i), generation) == P(None, zero, None, None)
    assert spec("layers/q_proj", (m, q, h), generation) == P(None, None, None)
    fsdp_only = AbstractMesh((1, 8, 1, 1), MESH_AXES)  # no expert axis: experts over fsdp
    assert spec_for("layers/experts_up", (m, e, i, h), fsdp_only, generation)[1] == "fsdp"
    assert resolve_layout("auto", mesh) == "replicated"
    # an expert axis of 1: the specs of the mesh without it
    dense = AbstractMesh((2, 2, 1, 2), MESH_AXES)
    assert spec_for("layers/q_proj", (m, q, h), dense, QWEN3_PARAM_RULES) == P(
        None, "tensor", "fsdp"
    )
    assert spec_for("lengths", (8,), dense, KV_CACHE_RULES) == P(("data", "fsdp"))
    assert resolve_layout("auto", AbstractMesh((8, 1, 1, 1), MESH_AXES)) == "training"
    assert BATCH_AXES == ("data", "fsdp", "expert")


def test_moe_ffn_is_expert_parallel_only_on_an_expert_axis():
    from agentrl_jax.models.moe import moe_ffn

    assert moe_ffn(None) is None
    assert moe_ffn(AbstractMesh((8, 1, 1, 1), MESH_AXES)) is None
    with pytest.raises(ValueError, match="exchange must be one of"):
        moe_ffn(None, "all-to-all")


_CHILD = r"""
import dataclasses, functools, re
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from agentrl_jax.models import moe
from agentrl_jax.models.moe import moe_ffn
from agentrl_jax.sharding import (BATCH_AXES, QWEN3_PARAM_RULES, MeshConfig, build_mesh,
                                  tree_shardings)

assert jax.device_count() == 8
E, H, I, T, K = 8, 16, 12, 64, 2
rng = np.random.default_rng(0)
w = {n: (rng.standard_normal(s) * 0.5).astype(np.float32) for n, s in (
    ("router", (1, E, H)), ("experts_gate", (1, E, I, H)), ("experts_up", (1, E, I, H)),
    ("experts_down", (1, E, H, I)))}
x = rng.standard_normal((T, H)).astype(np.float32)
x[:, 0] += 3.0  # a feature every token has: a router reading it sends them all one way
skewed = w["router"].copy()
skewed[0, 5] = 0.0
skewed[0, 5, 0] = 30.0  # expert 5 first for every token


def loss(ffn, x, p):  # p: {"layers": ...}, laid out by the model's rules (one MoE layer)
    p = {n: a[0] for n, a in p["layers"].items()}
    out, _, experts = moe.moe_block(x, p["router"], p["experts_gate"], p["experts_up"],
                                    p["experts_down"], k=K, normalize=True, ffn=ffn)
    return jnp.sum(jnp.sin(out)), (out, experts)


def dense_reference(x, experts, weights, p):
    x = np.asarray(x, np.float64)
    gate, up, down = (np.asarray(p[n][0], np.float64)
                      for n in ("experts_gate", "experts_up", "experts_down"))
    out = np.zeros_like(x)
    for t in range(len(x)):
        for e, weight in zip(experts[t], np.asarray(weights, np.float64)[t]):
            g, u = gate[e] @ x[t], up[e] @ x[t]
            out[t] += weight * (down[e] @ (g / (1 + np.exp(-g)) * u))
    return out


grad = jax.grad(loss, argnums=(1, 2), has_aux=True)
for name, router in (("spread", w["router"]), ("skewed", skewed)):
    params = {"layers": {**w, "router": router}}
    (want_gx, want_gp), (want, want_experts) = jax.jit(
        lambda x, p: grad(moe.experts_ffn, x, p))(x, params)
    want_experts = np.asarray(want_experts)
    weights, _ = moe.route(x @ router[0].T, K, normalize=True)
    reference = dense_reference(x, want_experts, weights, params["layers"])
    np.testing.assert_allclose(np.asarray(want), reference, rtol=1e-4, atol=1e-4)
    for shape in ((1, 2, 4), (1, 1, 8)):
        mesh = build_mesh(MeshConfig(data=shape[0], fsdp=shape[1], expert=shape[2]))
        placed_x = jax.device_put(x, NamedSharding(mesh, P(BATCH_AXES)))
        placed_p = jax.device_put(params, tree_shardings(params, mesh, QWEN3_PARAM_RULES))
        for exchange in ("shard_map", "compiler"):
            ffn = moe_ffn(mesh, exchange) or moe.experts_ffn
            run = jax.jit(lambda x, p: grad(ffn, x, p))
            (gx, gp), (got, experts) = run(placed_x, placed_p)
            case = (name, shape, exchange)
            np.testing.assert_array_equal(np.asarray(experts), want_experts, err_msg=str(case))
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5,
                                       err_msg=str(case))
            for g, h in zip(jax.tree.leaves((gx, gp)), jax.tree.leaves((want_gx, want_gp))):
                scale = float(np.abs(np.asarray(h)).max())  # summed in another order
                np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-5,
                                           atol=1e-5 * scale, err_msg=str(case))
            if exchange == "shard_map":  # the experts' weights are never gathered whole
                hlo = run.lower(placed_x, placed_p).compile().as_text()
                assert "reduce-scatter" in hlo, case
                gathered = re.findall(r"= \w+\[([\d,]*)\][^=\n]*? all-gather\(", hlo)
                whole = [g for g in gathered if g.startswith(f"{E},") or g.startswith(f"1,{E},")]
                assert gathered and not whole, (case, gathered)
    counts = np.bincount(want_experts.ravel(), minlength=E)
    print("ROUTED", name, counts.tolist())

# a whole tiny-MoE train step: fsdp 2 x expert 4 against one device
import sys
sys.path.insert(0, "tests")
from train_fakes import random_trajectory, tiny_model
from agentrl_jax.train import (RLConfig, TrainBatch, TrainConfig, compute_gradients,
                               init_train_state)
from agentrl_jax.train.scoring import activation_constraint
from agentrl_jax.train.state import shard_state, state_shardings
from agentrl_jax.train.jitted_step import batch_shardings

model = tiny_model(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=8,
                   norm_topk_prob=True)
graphdef = nnx.graphdef(model)
config = TrainConfig(rl=RLConfig(memory={"remat": "full", "logits_chunk": 8},
                                  batching={"num_micro_batches": 2}))
state = init_train_state(model, config)
batch = TrainBatch(random_trajectory(3, rows=16, padded_rows=1))
want, _, want_metrics = jax.jit(functools.partial(compute_gradients, graphdef, config))(
    state, batch)
mesh = build_mesh(MeshConfig(data=1, fsdp=2, expert=4))
assert activation_constraint(mesh).moe_ffn is not None  # the train step's forward runs EP
step = jax.jit(functools.partial(compute_gradients, graphdef, config, mesh=mesh),
               in_shardings=(state_shardings(state, mesh), batch_shardings(batch, mesh)))
placed = (shard_state(state, mesh), jax.device_put(batch, batch_shardings(batch, mesh)))
assert "shard_map" in str(jax.make_jaxpr(step)(*placed))
got, _, metrics = step(*placed)
for g, h in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    scale = float(np.abs(np.asarray(h)).max())
    np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-5, atol=1e-5 * scale + 1e-7)
np.testing.assert_allclose(float(metrics["loss"]), float(want_metrics["loss"]), rtol=1e-5,
                           atol=1e-7)
experts = np.asarray(want["layers"]["experts_up"])  # [layers, experts, I, H]
print("TRAINED", int((np.abs(experts).reshape(2, 8, -1).max(-1) > 0).sum()))
"""


def test_expert_parallel_on_8_fake_devices_equals_one_device():
    """The MoE layer on fsdp 2 x expert 4 and on expert 8 (the real mesh and rules; both the
    shard_map exchange and the compiler's): one device's outputs and gradients; a skewed
    router's tokens all computed on expert 5's device (= the float64 per-token reference); the
    whole train step's gradients on fsdp 2 x expert 4 = one device's."""
    child = subprocess.run(
        [sys.executable, "-c", _CHILD],
        env=fake_devices_env(8),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert child.returncode == 0, child.stderr[-4000:]
    lines = child.stdout.splitlines()
    routed = {
        line.split()[1]: eval(line.split(maxsplit=2)[2])
        for line in lines
        if line.startswith("ROUTED")
    }
    assert sum(c > 0 for c in routed["spread"]) >= 6, routed
    assert routed["skewed"][5] == 64, routed  # every token's first choice: expert 5
    trained = [int(line.split()[1]) for line in lines if line.startswith("TRAINED")]
    assert trained and trained[0] >= 10, lines  # most of the 2 x 8 experts got a gradient


# ---------------------------------------------------------------- the Qwen3-30B-A3B configs
CONFIGS = Path(__file__).resolve().parent.parent / "configs"
MOE_CONFIGS = sorted(CONFIGS.glob("frozenlake_qwen3_30b_a3b_*.yaml"))


def test_the_30b_a3b_configs_hold_the_papers_numbers_on_an_expert_mesh():
    from agentrl_jax.plan import model_config
    from agentrl_jax.reproduce.config import load_config
    from agentrl_jax.train.config import train_config

    assert [p.name for p in MOE_CONFIGS] == [
        "frozenlake_qwen3_30b_a3b_gpu.yaml",
        "frozenlake_qwen3_30b_a3b_lora_gpu.yaml",
        "frozenlake_qwen3_30b_a3b_tpu.yaml",
    ]
    for path in MOE_CONFIGS:
        config = load_config(path)
        arch = model_config(config.model)  # from the folder's name: no config.json there
        assert (arch.num_experts, arch.num_experts_per_tok, arch.num_hidden_layers) == (128, 8, 48)
        assert arch.num_experts % config.mesh.expert == 0
        assert (config.task.t_max, config.rl.group_size) == (70, 16)
        assert config.rl.routing_replay  # R3 on every MoE config
        assert config.eval.pass_k_samples == 128 and config.engine.kv_page_size is None
        for spec in config.rl.resolved_runs():
            tc = train_config(config, spec)
            assert tc.kl_coef == 0.001 and (tc.rl.batching.epochs, tc.rl.batching.mini_batches) == (
                1,
                1,
            )
        lora = config.rl.lora
        if "lora" in path.name:  # the attention's projections only: the MLPs are the experts
            assert lora.targets == ("q_proj", "k_proj", "v_proj", "o_proj")
            assert config.rl.optimizer.learning_rate == 1e-5 and lora.base_dtype == "bfloat16"
        else:
            assert lora is None and config.rl.optimizer.learning_rate == 1e-6
        if path.name.endswith("_tpu.yaml"):  # a v5p-64 slice (32 chips), or any multiple
            assert config.mesh.sizes(32) == (1, 4, 8, 1)
            assert config.mesh.sizes(64) == (2, 4, 8, 1)
        else:  # one 8-GPU node: no expert axis (docs/hardware.md, "Qwen3-30B-A3B")
            assert config.mesh.sizes(8) == (1, 8, 1, 1)
        rows = config.rl.tasks_per_step * config.rl.group_size
        devices = 32 if path.name.endswith("_tpu.yaml") else 8
        assert (
            rows // devices // config.rl.batching.num_micro_batches == 1
        )  # 1 row a device at a time


# ---------------------------------------------------------------- several processes
_WORKER = r"""
import argparse
parser = argparse.ArgumentParser()
parser.add_argument("--coordinator")
parser.add_argument("--num-processes", type=int)
parser.add_argument("--process-id", type=int)
args = parser.parse_args()
from agentrl_jax.distributed import ClusterConfig, initialize
initialize(ClusterConfig(args.coordinator, args.num_processes, args.process_id,
                         heartbeat_timeout_s=10))
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from agentrl_jax import distributed
from agentrl_jax.models import moe
from agentrl_jax.models.moe import moe_ffn
from agentrl_jax.sharding import (BATCH_AXES, QWEN3_PARAM_RULES, MeshConfig, build_mesh,
                                  tree_shardings)

me = jax.process_index()
assert jax.device_count() == 8 and jax.local_device_count() == 4
mesh = build_mesh(MeshConfig(data=2, expert=4))  # processes along data: an expert group each
assert [{d.process_index for d in mesh.devices[i].flat} for i in range(2)] == [{0}, {1}]
local = distributed.local_mesh(mesh)  # the rollouts' mesh: this process's expert group
assert dict(local.shape) == {"data": 1, "fsdp": 1, "expert": 4, "tensor": 1}, local.shape
E, H, I, T, K = 8, 16, 12, 64, 2
rng = np.random.default_rng(0)  # the same numbers on both processes
w = {n: (rng.standard_normal(s) * 0.5).astype(np.float32) for n, s in (
    ("router", (1, E, H)), ("experts_gate", (1, E, I, H)), ("experts_up", (1, E, I, H)),
    ("experts_down", (1, E, H, I)))}
x = rng.standard_normal((T, H)).astype(np.float32)


def loss(ffn, x, p):
    p = {n: a[0] for n, a in p["layers"].items()}
    out, _, _ = moe.moe_block(x, p["router"], p["experts_gate"], p["experts_up"],
                              p["experts_down"], k=K, normalize=True, ffn=ffn)
    return jnp.sum(jnp.sin(out)), out


grad = jax.grad(loss, argnums=(1, 2), has_aux=True)
params = {"layers": w}
one = jax.local_devices()[0]
want = jax.jit(lambda x, p: grad(moe.experts_ffn, x, p))(
    jax.device_put(x, one), jax.device_put(params, one))


def placed(value, sharding):
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


got = jax.jit(lambda x, p: grad(moe_ffn(mesh), x, p))(
    placed(x, NamedSharding(mesh, P(BATCH_AXES))),
    jax.tree.map(placed, params, tree_shardings(params, mesh, QWEN3_PARAM_RULES)))
for g, h in zip(jax.tree.leaves(distributed.host_value(got)), jax.tree.leaves(want)):
    scale = float(np.abs(np.asarray(h)).max())
    np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-5, atol=1e-5 * scale)
print(f"process {me} expert-parallel ok", flush=True)
"""


def test_expert_parallel_across_two_processes_equals_one_device(tmp_path):
    """2 processes x 4 fake CPU devices, ``data`` 2 x ``expert`` 4 (processes along data: each
    expert group inside one process): the MoE layer's outputs and gradients are one device's,
    and each process's own mesh (the rollouts') keeps its expert axis."""
    from multihost import launch

    worker = tmp_path / "expert_parallel_worker.py"
    worker.write_text(_WORKER)
    pair = launch(worker, [], processes=2, devices=4, timeout=300)
    for i, p in enumerate(pair):
        assert p.code == 0, f"process {i}:\n{p.output[-3000:]}"
        assert f"process {i} expert-parallel ok" in p.output
