"""``agentrl-jax plan``: compiles every program of a config for a target and reports its memory.

The command runs in a child process (it restarts itself with 8 fake CPU devices for ``--gpus
8``; most tests start it with them, so it need not: ``_cpu_stand_in_env``), on the CI config
with FSDP over the 8 devices; against a TPU topology when libtpu is
installed (the ``tpu`` extra), where the figures are the compiler's for the real chip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl_jax.plan import (
    GIB,
    QWEN3_ARCHITECTURES,
    largest_buffers,
    model_config,
    refused_plan,
)
from agentrl_jax.reproduce.settings import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
CI = [
    "--config",
    str(ROOT / "configs/frozenlake_ci.yaml"),
    "--set",
    "mesh.data=1",
    "--set",
    "mesh.fsdp=8",
    "--set",
    "rl.tasks_per_step=4",
]
PROGRAMS = {
    "train:grpo",
    "sync:weights",
    "rollout:init",
    "rollout:append",
    "rollout:decode",
    "eval:append",
    "eval:decode",
    "eval:likelihood",
}


def _cpu_stand_in_env(args: tuple[str, ...], env: dict[str, str]) -> dict[str, str]:
    """``env`` as ``agentrl-jax plan --gpus N`` restarts itself with when it plans on the
    XLA:CPU stand-in (agentrl_jax/cli/plan.py, ``_restart_for``: N fake CPU devices, jax on
    the CPU), so that the command plans in the process started (it restarts only where the
    devices are not there yet) instead of starting a second one; unchanged where it would
    compile for XLA:GPU or a TPU, or plan no --gpus. The restart itself is tested by
    test_plan_on_eight_estimated_gpus_compiles_every_program and
    test_plan_names_itself_agentrl_jax_also_after_restarting_with_fake_devices."""
    from agentrl_jax.plan import targets

    stand_in = args[args.index("--gpu-stand-in") + 1] if "--gpu-stand-in" in args else None
    auto = None if targets.cuda_plugin_version() or targets.libtpu_installed() else "cpu"
    if "--gpus" not in args or "--topology" in args or (stand_in or auto) != "cpu":
        return env
    flag = f"--xla_force_host_platform_device_count={args[args.index('--gpus') + 1]}"
    return {
        **env,
        "XLA_FLAGS": f"{env.get('XLA_FLAGS', '')} {flag}".strip(),
        "JAX_PLATFORMS": "cpu",
    }


def _plan(*args: str, restart: bool = False) -> tuple[int, dict]:
    """The plan's exit code and report; ``restart``: as a user starts it (it then restarts
    itself with the devices it plans for), else started with them (``_cpu_stand_in_env``)."""
    # compile-only TPU devices: the child may load libtpu while this process holds it too, and
    # is given none of the suite's CPU compile flags (tests/conftest.py); a CPU stand-in keeps
    # them: they move its peaks by under 0.4% (the CI config on 8 GPUs, 2026-12-06), well
    # inside what these tests check
    tpu = "--topology" in args or "tpu" in args
    env = {
        **{k: v for k, v in os.environ.items() if not (tpu and k == "XLA_FLAGS")},
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    }
    if not restart:
        env = _cpu_stand_in_env(args, env)
    child = subprocess.run(
        [sys.executable, "-m", "agentrl_jax.cli", "plan", *CI, *args, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert child.returncode in (0, 1), child.stderr[-3000:]
    return child.returncode, json.loads(child.stdout[child.stdout.index("{") :])


def test_largest_buffers_reads_hlo_shapes():
    text = (
        "%a = f32[4,8]{1,0} add(f32[4,8] %x, f32[4,8] %y)\n"
        "%b = bf16[2,1024]{1,0} copy(%c), s32[] %i"
    )
    assert largest_buffers(text) == (("bf16[2,1024]", 4096), ("f32[4,8]", 128), ("s32[]", 4))


def test_model_config_from_known_sizes_and_from_the_random_init_settings():
    four_b = model_config(ModelConfig(model_dir="/nowhere/Qwen3-4B"))
    assert (four_b.hidden_size, four_b.num_hidden_layers, four_b.vocab_size) == (2560, 36, 151936)
    assert model_config(ModelConfig(model_dir="/x"), "qwen3-8b").tie_word_embeddings is False
    tiny = model_config(ModelConfig())
    assert (tiny.hidden_size, tiny.vocab_size) == (64, 768)
    with pytest.raises(ValueError, match="no known size"):
        model_config(ModelConfig(model_dir="/nowhere/llama"))
    assert set(QWEN3_ARCHITECTURES) == {
        "qwen3-0.6b",
        "qwen3-1.7b",
        "qwen3-4b",
        "qwen3-8b",
        "qwen3-30b-a3b",
    }
    # Qwen3-30B-A3B's config.json, read from a folder's name (a fine-tune's too)
    moe = model_config(ModelConfig(model_dir="/models/Qwen3-30B-A3B-Instruct-2507"))
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (128, 8, 768)
    assert (moe.hidden_size, moe.num_hidden_layers, moe.num_key_value_heads) == (2048, 48, 4)
    assert moe.norm_topk_prob and moe.moe_layers == (True,) * 48
    assert not moe.tie_word_embeddings and moe.rope_theta == 1e6
    assert model_config(ModelConfig(model_dir="/models/Qwen3-8B")).num_experts == 0


def test_the_roofline_counts_an_moe_tokens_experts_and_reads_the_ones_its_rows_reach():
    from agentrl_jax.plan import qwen3_config, roofline

    moe, dense = qwen3_config("qwen3-30b-a3b"), qwen3_config("qwen3-8b")
    active = roofline.matmul_parameters(moe)  # a token's: attention, router, 8 experts, head
    expert = 3 * 2048 * 768
    assert active == 48 * (2048 * (4096 + 1024) + 4096 * 2048 + 2048 * 128 + 8 * expert) + (
        2048 * 151936
    )
    every = roofline.stored_matmul_parameters(moe)
    assert every == active + 48 * 120 * expert  # a train step reads all 128 experts
    assert roofline.stored_matmul_parameters(moe, 1) == active  # one token: its 8
    assert active < roofline.stored_matmul_parameters(moe, 64) < every
    assert roofline.stored_matmul_parameters(dense, 7) == roofline.matmul_parameters(dense)


def test_plan_on_eight_estimated_gpus_compiles_every_program():
    code, report = _plan(
        "--gpus", "8", "--gpu-memory-gib", "80", "--gpu-stand-in", "cpu", restart=True
    )
    assert code == 0 and report["fits"] and report["estimate"] and report["stand_in"] == "cpu"
    # every figure names its compiler; --gpus alone plans H100s, so the roofline is an H100's
    assert report["compiler"] == "XLA:CPU (stand-in for GPU)" and report["gpu"] == "h100"
    assert all(p["compiler"] == report["compiler"] and p["compiled"] for p in report["programs"])
    headline = [x["name"].split(" ")[0] for x in report["predictions"]]
    assert headline == ["decode", "decode", "decode", "train", "rollout"]
    decode = next(p for p in report["programs"] if p["name"] == "rollout:decode")
    assert decode["prediction"]["unit"] == "tokens/s" and decode["prediction"]["value"] > 0
    assert report["mesh"].startswith("data=1 fsdp=8 tensor=1")
    names = {p["name"] for p in report["programs"]}
    assert names == PROGRAMS, names
    for p in report["programs"]:
        assert 0 < p["peak"] < 80 * GIB * 0.85 and p["fits"] and p["largest"], p
    train = next(p for p in report["programs"] if p["name"] == "train:grpo")
    assert train["aliased"] > 0  # the state is donated


def test_plan_with_rollout_devices_of_their_own_plans_both_groups():
    """``mesh.rollout: 4`` of 8 devices: the train step on a 4-device mesh, the rollout's
    programs on the other 4 (rows split over them), the weight sync gathering the policy whole
    on the training devices."""
    split = ("--set", "mesh.fsdp=4", "--set", "mesh.rollout=4")
    programs = ("--program", "train", "--program", "sync", "--program", "rollout")
    code, report = _plan("--gpus", "8", "--gpu-memory-gib", "80", *split, *programs)
    assert code == 0 and report["fits"], report
    assert report["mesh"].startswith("data=1 fsdp=4 tensor=1")
    assert report["rollout_mesh"].startswith("data=4 fsdp=1 tensor=1")
    names = {p["name"] for p in report["programs"]}
    assert names == {n for n in PROGRAMS if n.split(":")[0] in ("train", "sync", "rollout")}
    sync = next(p for p in report["programs"] if p["name"] == "sync:weights")
    # the policy split 4 ways over fsdp in, whole on each device out (the CI model computes
    # in float32, so no cast halves it)
    assert sync["outputs"] == pytest.approx(4 * sync["arguments"], rel=0.05), sync


def test_plan_reports_a_program_that_does_not_fit():
    code, report = _plan("--gpus", "8", "--gpu-memory-gib", "1e-7", "--program", "rollout:init")
    assert code == 1 and not report["fits"]
    assert [p["name"] for p in report["programs"]] == ["rollout:init"]


def test_plan_for_a_tpu_topology():
    pytest.importorskip("libtpu")
    code, report = _plan("--topology", "v5p:2x2x2")
    assert code == 0 and report["fits"] and not report["estimate"]
    assert "TPU v5" in report["target"] and {p["name"] for p in report["programs"]} == PROGRAMS


def test_float32_copies_of_half_precision_buffers_are_found_in_the_hlo():
    from agentrl_jax.plan import memory

    text = "bf16[8,4,16] %a; f32[8,4,16] %b = convert(%a); f32[2,3] %c; bf16[5] %d; f32[5,1] %e"
    assert memory.float32_copies(text) == (("f32[8,4,16]", 8 * 4 * 16 * 4),)
    assert memory.float32_copies("f32[8,4,16] %b; s32[8,4,16] %i") == ()


def test_a_plan_the_cpu_stand_in_inflates_is_unknown_not_no_and_names_the_buffer():
    """The one-GPU 0.6B config without extras (the XLA:CPU stand-in): decode holds a float32
    copy of the 56 GiB bfloat16 KV cache, which only XLA:CPU makes, so it does not fit as
    compiled (283 GiB); the verdict is "unknown on this compiler", exit 0, the buffer named and
    the command that gives the verdict said. docs/hardware.md: XLA:GPU plans it at 57 GiB."""
    args = (
        *["--config", str(ROOT / "configs/frozenlake_qwen3_0.6b_1gpu.yaml"), "--gpus", "1"],
        *["--gpu-stand-in", "cpu", "--program", "rollout:decode", "--json"],
    )
    child = subprocess.run(
        [sys.executable, "-m", "agentrl_jax.cli", "plan", *args],
        env=_cpu_stand_in_env(args, dict(os.environ)),
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout[child.stdout.index("{") :])
    assert report["verdict"] == "unknown on this compiler" and report["fits"] is None
    assert "pip install -e '.[cuda]'" in report["real_verdict"]
    (decode,) = report["programs"]
    assert decode["verdict"] == "unknown on this compiler" and not decode["fits"]
    assert decode["float32_copies"][0] == ["f32[8,28,4096,128,128]", 56 * GIB]


def test_the_tpu_stand_in_without_libtpu_names_only_the_option_passed():
    from agentrl_jax.plan import gpu_target

    try:
        import libtpu  # noqa: F401

        pytest.skip("libtpu is installed here")
    except ImportError:
        pass
    with pytest.raises(ValueError) as refused:
        gpu_target(1, 80, stand_in="tpu")
    assert "--gpu-stand-in tpu" in str(refused.value) and "--topology" not in str(refused.value)
    assert "pip install -e '.[tpu]'" in str(refused.value)


def test_plan_refuses_an_unknown_gpu_naming_the_known_ones():
    from typer.testing import CliRunner

    from agentrl_jax.cli import app

    result = CliRunner().invoke(app, ["plan", *CI, "--gpu", "b200"], env={"COLUMNS": "1000"})
    assert result.exit_code == 2 and "h100, h200, a100" in result.output, result.output


def test_xla_gpu_without_the_cuda_plugin_says_what_to_install():
    from agentrl_jax.plan import cuda_plugin_version, cuda_target

    if cuda_plugin_version() is not None:
        pytest.skip("the CUDA plugin is installed here (tests/gpu/ compiles with it)")
    with pytest.raises(ValueError, match=r"pip install -e '\.\[cuda\]'"):
        cuda_target("h100", 8)
    with pytest.raises(ValueError, match="unknown GPU; known: h100, h200, a100"):
        cuda_target("v100")


def test_auto_attention_chooses_for_the_platform_a_program_is_built_for():
    """A plan for GPUs runs in a CPU process: ``built_for`` makes "auto" choose cuDNN there
    (bfloat16, no cache), splash for a TPU, and the default backend's choice outside it."""
    import jax.numpy as jnp

    from agentrl_jax.models import attention

    q = jnp.zeros((1, 256, 4, 128), jnp.bfloat16)
    assert attention.select_implementation(q, q, None) == "xla"
    with attention.built_for("gpu"):
        assert attention.target_platform() == "gpu"
        assert attention.select_implementation(q, q, None) == "cudnn"
        with attention.built_for("tpu"):
            assert attention.select_implementation(q, q, None) == "splash"
            # a program XLA splits over a mesh cannot hold a Mosaic kernel: not splash there
            with attention.partitioned():
                assert attention.select_implementation(q, q, None) == "xla"
        assert attention.select_implementation(q.astype(jnp.float32), q, None) == "xla"
    assert attention.target_platform() == "cpu"


def test_gpu_targets_refuse_what_they_cannot_stand_in_for():
    from agentrl_jax.plan import gpu_target

    with pytest.raises(ValueError, match="--gpus must be >= 1"):
        gpu_target(0, 80, stand_in="tpu")
    with pytest.raises(ValueError, match="'cpu' or 'tpu'"):
        gpu_target(8, 80, stand_in="gpu")


def test_one_gpu_with_the_tpu_stand_in_is_one_chip_of_the_smallest_topology():
    pytest.importorskip("libtpu")
    from agentrl_jax.plan import gpu_target

    for count, topology in ((1, "v5p:2x2x1"), (6, "v5p:2x2x2")):
        target = gpu_target(count, 80, stand_in="tpu")
        assert len(target.devices) == count and topology in target.name


_FIT_MESH = """
import json
import jax
from agentrl_jax.plan import fit_mesh
from agentrl_jax.sharding import MeshConfig
out = {}
for name, mesh in {
    "fits": MeshConfig(data=2, fsdp=2),
    "default": MeshConfig(data=1, fsdp=1, tensor=1),
    "data 3": MeshConfig(data=3, fsdp=1, tensor=1),
    "tensor 3": MeshConfig(data=1, fsdp=-1, tensor=3),
}.items():
    try:
        fitted, note = fit_mesh(mesh, jax.devices())
        out[name] = [fitted.data, fitted.fsdp, fitted.tensor, note]
    except ValueError as error:
        out[name] = str(error)
print(json.dumps(out))
"""


def test_plan_picks_a_mesh_that_uses_the_devices_or_names_the_set_to_add():
    """4 devices: a mesh that lays them out is kept; (1, 1, 1) gets fsdp over all 4, (3, 1, 1)
    data over all 4 (fsdp=-1 would need 4/3), each with the --set that runs it; a mesh no axis
    can stretch is refused naming the fields."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    child = subprocess.run(
        [sys.executable, "-c", _FIT_MESH], env=env, capture_output=True, text=True, cwd=ROOT
    )
    assert child.returncode == 0, child.stderr[-2000:]
    out = json.loads(child.stdout)
    assert out["fits"] == [2, 2, 1, None]
    assert out["default"][:3] == [1, -1, 1]
    assert out["default"][3] == (
        "the config's mesh does not lay out the 4 devices (MeshConfig (data, fsdp, tensor)="
        "(1, 1, 1) needs 1 devices, but 4 are available); planned with fsdp=4 "
        "(run it with --set mesh.fsdp=-1)"
    )
    assert out["data 3"][:3] == [-1, 1, 1] and "--set mesh.data=-1" in out["data 3"][3]
    assert out["tensor 3"] == (
        "MeshConfig (1, -1, 3): 4 devices are not divisible by the fixed axes' product 3; "
        "give a mesh for 4 devices, e.g. --set mesh.fsdp=-1 (or mesh.data, mesh.fsdp and "
        "mesh.tensor whose product is the device count)"
    )


def test_plan_names_itself_agentrl_jax_also_after_restarting_with_fake_devices():
    child = subprocess.run(
        [sys.executable, "-m", "agentrl_jax.cli", "plan", "--gpus", "2", "--set", "rl.nope=1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert child.returncode == 2
    assert child.stderr.startswith("Usage: agentrl-jax plan [OPTIONS]"), child.stderr


def test_plan_for_gpus_with_the_tpu_compiler_standing_in():
    pytest.importorskip("libtpu")
    code, report = _plan("--gpus", "8", "--gpu-memory-gib", "80", "--gpu-stand-in", "tpu")
    assert code == 0 and report["fits"] and report["estimate"] and report["stand_in"] == "tpu"
    assert (
        "8 x NVIDIA H100 80GB HBM3 80 GiB" in report["target"]  # --gpus alone: H100s
        and {p["name"] for p in report["programs"]} == PROGRAMS
    )


def test_plan_compiles_the_paged_engine_on_the_mesh():
    """``engine.kv_page_size`` + ``rl.refill``: the paged programs (seating rows too), each shard's
    pages of the pool on its own device."""
    code, report = _plan(
        "--gpus",
        "8",
        "--program",
        "rollout",
        "--set",
        "engine.kv_page_size=16",
        "--set",
        "rl.refill=true",
        "--set",
        "rl.max_rows_per_call=16",
    )
    assert code == 0 and report["fits"]
    programs = {p["name"]: p for p in report["programs"]}
    assert set(programs) == {
        "rollout:init",
        "rollout:append",
        "rollout:append_rows",
        "rollout:decode",
    }
    # the pool [kv heads, layers, pages, 16, head dim]: 16 rows x 16 pages split over 8 devices
    shape, _ = programs["rollout:init"]["largest"][0]
    assert shape.split("[")[1].split(",")[2:4] == ["32", "16"], shape


def test_plan_refuses_a_pool_that_cannot_hold_one_row_per_device():
    """``engine.kv_pages`` shares the pool among the 8 devices: 64 pages are 8 per device, fewer
    than one 256-token row's 16; the plan says so before compiling anything."""
    args = (
        *CI,
        *["--gpus", "8", "--program", "rollout"],
        *["--set", "engine.kv_page_size=16", "--set", "engine.kv_pages=64"],
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    child = subprocess.run(
        [sys.executable, "-m", "agentrl_jax.cli", "plan", *args],
        env=_cpu_stand_in_env(args, env),
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert child.returncode == 2  # a one-line usage error, no traceback
    squeezed = "".join((child.stdout + child.stderr).replace("│", "").split())
    assert "num_pages=64(8shard(s))cannotholdonerowofmax_len=256" in squeezed


def test_a_program_the_compiler_refuses_for_memory_is_planned_as_not_fitting():
    message = (
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
        "temporaries (20.61G) exceeds available HBM (15.75G).\nmore"
    )
    refused = refused_plan("rollout:decode", message, 16 * GIB)
    assert refused.fits is False and refused.temporaries == refused.peak
    assert refused.peak == int(20.61 * GIB)
    assert refused.error.startswith("RESOURCE_EXHAUSTED: Ran out of memory on HBM")
    assert round(refused.headroom, 3) == round(1 - 20.61 / 16, 3)
