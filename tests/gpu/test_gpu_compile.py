"""The GPU path compiled by XLA:GPU itself, for compile-only H100s and A100s (no GPU needed):
the Pallas (Triton) paged-attention kernel in decode, cuDNN's fused attention in a packed
train step, the compiler's buffer figures against hand-computed ones, and
``agentrl-jax plan --gpu h100``.

Each check asserts what the optimized program holds (the Triton or cuDNN custom call, exact
argument bytes, a lower bound on temporaries), and the helper that compiles them
(:func:`xla_gpu.compiles`) is shown to report the compiler's refusal of an illegal Triton block
(``RESOURCE_EXHAUSTED``), so a kernel given a block shape XLA:GPU cannot build fails here, not on
the first GPU run. Needs jax's CUDA plugin (``pip install -e '.[gpu-compile]'``); run as
``JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python -m pytest -q tests/gpu``
(docs/testing.md). Without the plugin the module skips, or fails under
``AGENTRL_JAX_REQUIRE_XLA_GPU=1`` (CI).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import xla_gpu
from flax import nnx
from xla_gpu import CUDNN_FMHA, TRITON, compile_lowered, compiles, custom_call_targets, on

from agentrl_jax.bench.device_figures import TINY_DIMS
from agentrl_jax.models import attention
from agentrl_jax.models.checkpoints import abstract_qwen3
from agentrl_jax.models.config import Qwen3Config
from agentrl_jax.models.paged_kernels import decode_attention
from agentrl_jax.sampling import Paging, SamplingConfig
from agentrl_jax.sharding import MeshConfig, build_mesh
from agentrl_jax.train import RLConfig, TrainBatch, TrainConfig, make_train_step, train_model
from agentrl_jax.train.jitted_step import batch_shardings
from agentrl_jax.train.packing import Packing
from agentrl_jax.trajectory import Trajectory

xla_gpu.skip_or_fail_module()

ROOT = Path(__file__).resolve().parents[2]
BF16 = jnp.bfloat16


def _bytes(*specs: jax.ShapeDtypeStruct) -> int:
    return sum(int(np.prod(s.shape)) * jnp.dtype(s.dtype).itemsize for s in specs)


# ------------------------------------------------------------------ the paged decode kernel
def _decode_inputs(gpu, *, rows, heads, kv_heads, head_dim, layers, pages, page_size, per_row):
    """Abstract ``decode_attention`` inputs: ``q [B, H, hd]``, the pools ``[KV, layers, P, S,
    hd]`` (bfloat16), the page table ``[B, R]``, lengths ``[B]`` and a traced layer index (the
    sampler's is the scan's)."""
    spec = on(gpu)
    pool = (kv_heads, layers, pages, page_size, head_dim)
    return (
        spec((rows, heads, head_dim), BF16),
        spec(pool, BF16),
        spec(pool, BF16),
        spec((), jnp.int32),
        spec((rows, per_row), jnp.int32),
        spec((rows,), jnp.int32),
    )


def _decode(block_pages):
    return lambda q, k, v, layer, table, lengths: decode_attention(
        "pallas_gpu", q, k, v, layer, table, lengths, block_pages
    )


@pytest.mark.parametrize(
    "page_size,pages",
    [(16, 2048), (128, 256)],  # 32768 tokens a layer either way (Qwen3-4B decode)
)
def test_paged_kernel_compiles_at_qwen3_4b_decode_shapes_reading_the_pool_in_place(
    page_size, pages
):
    """64 rows, 32 query heads over 8 KV heads of 128, 4 layers' pools, rows of 16384 tokens
    (each of the kernel's 16 splits reads 1024, so ``block_pages=8`` of 128 tokens would be the
    illegal block below): the decode attention is the Triton kernel (one custom call), its
    arguments exactly the inputs' bytes, and its temporaries under one layer's keys: the pool is
    read in place (the ``[KV, layers * P, S, hd]`` reshape is free), not copied a layer at a
    time."""
    args = _decode_inputs(
        "h100",
        rows=64,
        heads=32,
        kv_heads=8,
        head_dim=128,
        layers=4,
        pages=pages,
        page_size=page_size,
        per_row=16384 // page_size,
    )
    ok, message, compiled = compiles(_decode(8), *args)
    assert ok, message
    assert custom_call_targets(compiled).count(TRITON) == 1, custom_call_targets(compiled)
    memory = compiled.memory_analysis()
    assert memory.argument_size_in_bytes == _bytes(*args)
    assert memory.output_size_in_bytes == 64 * 32 * 128 * 2  # [B, H, hd] bfloat16
    one_layer_keys = 8 * pages * page_size * 128 * 2
    assert memory.temp_size_in_bytes < one_layer_keys, memory


def test_an_illegal_triton_block_is_reported_as_the_compilers_refusal():
    """The same check, given jax's kernel with 8 pages of 128 tokens a block (16 splits of 8
    pages each: 128 pages a row), fails: XLA:GPU asks 548 KiB of shared memory for the block,
    an H100 offers 227 KiB. Our wrapper, at the same pool, table and ``block_pages=8``, caps the
    block (``gpu_block_pages``) and compiles."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    args = _decode_inputs(
        "h100",
        rows=4,
        heads=32,
        kv_heads=8,
        head_dim=128,
        layers=1,
        pages=256,
        page_size=128,
        per_row=128,
    )
    q, k, v, _, table, lengths = args
    flat = jax.ShapeDtypeStruct((8, 256, 128, 128), BF16, sharding=k.sharding)
    illegal = lambda q, k, v, table, lengths: paged_attention(  # noqa: E731
        q, k, v, table, lengths, pages_per_compute_block=8, k_splits=16
    )
    ok, message, compiled = compiles(illegal, q, flat, flat, table, lengths)
    assert not ok and compiled is None
    assert "RESOURCE_EXHAUSTED" in message and "Shared memory size limit exceeded" in message, (
        message
    )
    ok, message, compiled = compiles(_decode(8), *args)
    assert ok, message
    assert TRITON in custom_call_targets(compiled)


@pytest.mark.parametrize("gpu", ["h100", "a100"])
@pytest.mark.parametrize("page_size", [16, 32, 64, 128, 256])
def test_our_block_rule_compiles_for_every_page_size(gpu, page_size):
    """``decode_attention`` asked for 64-page blocks over rows of 32768 tokens (each of the
    kernel's 16 splits reads 2048, so the blocks are as large as the cap lets them be: 64 pages
    of 16 tokens would ask several times an H100's shared memory) compiles on H100 and A100 at
    every page size the kernel serves (head_dim 128, bfloat16: 256-token pages are the
    largest, one 64 KiB tile)."""
    args = _decode_inputs(
        gpu,
        rows=8,
        heads=32,
        kv_heads=8,
        head_dim=128,
        layers=2,
        pages=64,
        page_size=page_size,
        per_row=32768 // page_size,
    )
    ok, message, compiled = compiles(_decode(64), *args)
    assert ok, f"{gpu}, {page_size}-token pages: {message}"
    assert TRITON in custom_call_targets(compiled)


@pytest.mark.parametrize("per_row", [48, 40, 24])
def test_our_block_rule_compiles_when_a_split_reads_no_power_of_two_pages(per_row):
    """Rows whose pages per split are not a power of two (48 pages: 16 splits of 3, the rollout
    figure of ``bench device`` at 1,536 tokens of 32-token pages): Triton's arrays must be
    powers of two, so a block of 3 pages fails to lower; the rule takes the largest power of
    two dividing them: 1 for 48 = 16 splits x 3, 40 = 8 x 5 and 24 = 8 x 3."""
    args = _decode_inputs(
        "h100", rows=8, heads=16, kv_heads=8, head_dim=128, layers=2, pages=64, page_size=32,
        per_row=per_row,
    )  # fmt: skip
    ok, message, compiled = compiles(_decode(8), *args)
    assert ok, f"{per_row} pages a row: {message}"
    assert TRITON in custom_call_targets(compiled)


def test_bench_device_compile_only_compiles_every_figure_under_bench_devices_names():
    """``agentrl-jax bench device --compile-only h100 --tiny``: one line per figure ``bench
    device`` prints, under the same names and in the same order, each compiled by XLA:GPU for
    the H100 and fitting; the decode, train-step and rollout lines carry their roofline."""
    from agentrl_jax.bench import compile_only, device

    child = subprocess.run(
        [sys.executable, "-m", "agentrl_jax.cli", "bench", "device", "--compile-only", "h100",
         "--tiny"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    lines = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
    want = [n for part in device.PARTS for n in compile_only.figure_names(device.TINY, part)]
    assert [line["figure"] for line in lines] == want, child.stderr[-3000:]
    for line in lines:
        assert line["compiler"] == "XLA:GPU", line
        assert line["device"] == "NVIDIA H100 80GB HBM3", line
        assert line["compiled"] is True, line["error"]
        assert line["memory"]["peak"] > 0 and line["memory"]["fits"] is True, line
        roofline = line["figure"].startswith(("decode ", "train step tiny", "rollout "))
        assert (line["predicted"] is not None) == roofline, line
    assert child.returncode == 0, child.stderr[-3000:]


# ---------------------------------------------------------------- cuDNN in a packed train step
def _packed_batch(rows: int, length: int, turns: int, mesh) -> TrainBatch:
    """An abstract batch whose rows are packed (``segment_ids`` and the rest of a
    :class:`Packing`, ``[rows, length]``) in the step's shardings."""

    def make():
        ints, flags = jnp.zeros((rows, length), jnp.int32), jnp.zeros((rows, length), bool)
        return TrainBatch(
            Trajectory.zeros(rows, length, turns), packing=Packing(ints, ints, flags, ints, flags)
        )

    batch = jax.eval_shape(make)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        batch,
        batch_shardings(batch, mesh),
    )


@pytest.mark.parametrize("implementation", ["cudnn", "auto"])
def test_packed_train_step_runs_cudnn_attention_forward_and_backward(implementation):
    """A tiny Qwen3 computing in bfloat16, trained on packed rows (each sequence a segment of
    its own) with ``rl.memory.attention`` "cudnn" (and "auto", traced for a GPU), compiles for an
    H100 with cuDNN's fused attention in the forward and in the backward."""
    from agentrl_jax.plan.programs import abstract_train_state

    mesh = build_mesh(MeshConfig(), xla_gpu.target("h100").devices)
    config = TrainConfig(rl=RLConfig(memory={"attention": implementation, "packing": True}))
    model = abstract_qwen3(Qwen3Config(**TINY_DIMS), dtype=BF16)
    with attention.built_for("gpu"):
        state = abstract_train_state(model, config, mesh)
        step = make_train_step(
            nnx.graphdef(train_model(model, config)), config, mesh=mesh, state_template=state
        )
        lowered = step.lower(state, _packed_batch(8, 128, 3, mesh))
    ok, message, compiled = compile_lowered(lowered)
    assert ok, message
    cudnn = [t for t in custom_call_targets(compiled) if t.startswith(CUDNN_FMHA)]
    forward = [t for t in cudnn if not t.endswith("Backward")]
    backward = [t for t in cudnn if t.endswith("Backward")]
    assert forward and backward, custom_call_targets(compiled)


# ------------------------------------------------------------------------- the decode program
@pytest.mark.parametrize("page_size,kernel", [(16, TRITON), (8, None)])
def test_tiny_qwen3_decode_program_runs_the_triton_kernel(monkeypatch, page_size, kernel):
    """``plan_sampler``'s decode of a tiny Qwen3 (head_dim 16) on a paged bfloat16 cache for an
    H100: the sampler picks the Pallas GPU kernel from the mesh's platform, so the program holds
    the Triton call; with 8-token pages (not a multiple of 16) it falls back to the XLA paged
    attention and holds none."""
    from agentrl_jax.plan import programs

    compiled = {}
    analyse = programs.analyse

    def keep(name, lowered, *args, **kwargs):
        ok, message, compiled[name] = compile_lowered(lowered)
        assert ok, f"{name}: {message}"
        return analyse(name, compiled[name], *args, **kwargs)

    monkeypatch.setattr(programs, "analyse", keep)
    target = xla_gpu.target("h100")
    mesh = build_mesh(MeshConfig(), target.devices)
    assert mesh.devices.flat[0].platform == "gpu"
    plans = programs.plan_sampler(
        "rollout",
        abstract_qwen3(Qwen3Config(**TINY_DIMS), dtype=BF16),
        mesh,
        rows=8,
        max_len=256,
        max_new_tokens=32,
        prefill_chunk=None,
        cache_dtype=BF16,
        layout="auto",
        sampling=SamplingConfig(),
        memory_bytes=target.memory_bytes,
        headroom=0.15,
        wanted=lambda name: name.endswith(":decode"),
        init=False,
        paging=Paging(page_size=page_size),
    )
    assert [p.name for p in plans] == ["rollout:decode"] and plans[0].fits
    targets = custom_call_targets(compiled["rollout:decode"])
    if kernel is None:
        assert TRITON not in targets, targets
    else:
        assert kernel in targets, targets


# ------------------------------------------------------------------ buffers against the hand
def test_planned_temporaries_hold_the_gemm_output():
    """``sum(tanh(a @ b), axis=0)`` for ``a [M, K]``, ``b [K, N]`` bfloat16 on an H100.

    Arguments are exactly ``(M*K + K*N) * 2`` bytes and the output ``N * 2``. XLA:GPU runs the
    matmul as a GEMM kernel (a Triton GEMM fusion, with the tanh as its epilogue; or cuBLAS)
    whose ``[M, N]`` bfloat16 result goes to device memory, and the sum over ``M`` as a second
    kernel: a reduction across the GEMM's output tiles needs every tile written first, and
    neither cuBLAS nor XLA's GEMM emitter fuses one. That ``[M, N]`` buffer is neither an
    argument nor the output, so the temporaries hold at least ``M * N * 2`` bytes (bfloat16
    being what the dot yields; the memory analysis must not lose it)."""
    m, k, n = 1024, 512, 2048
    spec = on("h100")
    a, b = spec((m, k), BF16), spec((k, n), BF16)
    ok, message, compiled = compiles(lambda a, b: jnp.sum(jnp.tanh(a @ b), axis=0), a, b)
    assert ok, message
    memory = compiled.memory_analysis()
    assert memory.argument_size_in_bytes == (m * k + k * n) * 2
    assert memory.output_size_in_bytes == n * 2
    assert memory.alias_size_in_bytes == 0
    assert memory.temp_size_in_bytes >= m * n * 2, memory
    assert f"bf16[{m},{n}]" in compiled.as_text()  # the GEMM's output, as the bound says


# ----------------------------------------------------------------------- agentrl-jax plan
def test_plan_cli_compiles_every_program_with_xla_gpu():
    """``agentrl-jax plan --gpu h100 --json`` on the CI config: the report and every program
    name XLA:GPU as their compiler, and every program compiled."""
    child = subprocess.run(
        [
            sys.executable,
            "-m",
            "agentrl_jax.cli",
            "plan",
            "--config",
            str(ROOT / "configs/frozenlake_ci.yaml"),
            "--gpu",
            "h100",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert child.returncode in (0, 1), child.stderr[-3000:]
    report = json.loads(child.stdout[child.stdout.index("{") :])
    assert report["compiler"] == "XLA:GPU", report
    assert report["programs"], report
    for program in report["programs"]:
        assert program["compiler"] == "XLA:GPU", program
        assert program["compiled"] is True, program
