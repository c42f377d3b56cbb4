"""``agentrl-jax bench device --tiny``: the accelerator check's code path, run on this CPU.

Every line is one JSON figure naming what it measures and its reference; every correctness
figure this CPU can compute holds its tolerance; the ones it cannot (cuDNN) say why. The FLOP
count and the layer budget are checked by hand. On a GPU the speed figures carry the roofline
prediction (checked here with an H100's spec standing in for the CPU's); ``--compile-only``
names the same figures and refuses cleanly where the CUDA plugin is missing (its compilation
itself needs the plugin: tests/gpu).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from agentrl_jax.bench import compile_only, device, device_checks, device_figures, device_speed
from agentrl_jax.cli import app
from agentrl_jax.plan import GPUS, gpu_spec, roofline, targets

# The --tiny run made cheaper, every figure and code path kept: 4 new tokens a decode (not 16),
# one timed repeat after the warm-up (not 2), and the paged kernel's check on 4 rows x 4 heads
# over 2 KV heads (not 8 x 16 over 8; the same head_dim 128, pages of 16, 8 pages a row, grouped
# queries, ragged rows, a shuffled page table).
CHEAP_TINY = dict(new_tokens=4, repeats=1)
CHEAP_PAGED_SHAPE = (4, 4, 2, 2, 48, 16, 8, 128)


@pytest.fixture
def one_torch_thread():
    """PyTorch's references (transformers' logits and ``generate``) on one thread: at tiny
    shapes its intra-op threads only contend, with each other and with the other test worker
    (with the second core busy, its ``generate`` took ~10x longer on two threads than on one).
    The references and every check are the same; the thread count is restored afterwards."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_bench_device_tiny_prints_one_named_figure_per_line_and_every_check_holds(
    monkeypatch, one_torch_thread
):
    monkeypatch.setattr(device, "TINY", dataclasses.replace(device.TINY, **CHEAP_TINY))
    monkeypatch.setattr(device_checks, "PAGED_SHAPE", CHEAP_PAGED_SHAPE)
    result = CliRunner().invoke(app, ["bench", "device", "--tiny"])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    names = [f["figure"] for f in lines]
    assert len(names) == len(set(names))
    for figure in lines:
        assert figure["figure"] and figure["reference"] and figure["unit"], figure
        assert figure["kind"] in ("correctness", "speed", "memory")
    by_kind = {k: [f for f in lines if f["kind"] == k] for k in ("correctness", "speed", "memory")}
    checks = {f["figure"]: f for f in by_kind["correctness"]}
    assert set(checks) == {
        "logits tiny vs transformers",
        "paged attention: Pallas GPU kernel vs XLA",
        "attention: cuDNN vs XLA",
        "train step: loss and gradients vs CPU",
    }
    for name, figure in checks.items():
        if name.startswith("attention: cuDNN"):  # needs an NVIDIA GPU
            assert figure["ok"] is None and "NVIDIA GPU" in figure["settings"]["unavailable"]
        else:
            assert figure["ok"] is True and figure["value"] <= figure["tolerance"], figure
    speeds = {f["figure"] for f in by_kind["speed"]}
    for batch in (1, 8, 64):
        assert {f"decode tiny batch {batch}", f"generate tiny batch {batch}"} <= speeds
    assert "train step tiny L 256" in speeds
    assert any(name.startswith("rollout FrozenLake") for name in speeds)
    for figure in by_kind["speed"]:
        assert figure["value"] > 0
        if figure["reference_value"]:
            assert figure["ratio"] == figure["value"] / figure["reference_value"]
        if not figure["figure"].startswith("generate"):  # no roofline for this CPU
            assert figure["settings"]["predicted"] is None, figure
            assert figure["settings"]["of_predicted"] is None, figure
    memory = {f["figure"]: f for f in by_kind["memory"]}
    assert set(memory) == {
        "memory decode tiny batch 64: measured vs plan",
        "memory train step tiny L 256: measured vs plan",
    }
    for figure in memory.values():  # the CPU has no allocator statistics: the prediction only
        assert figure["reference_value"] > 0 and figure["value"] is None
        assert "no memory statistics" in figure["settings"]["unavailable"]
    # --compile-only prints the same names, so its lines join these
    planned = [n for part in device.PARTS for n in compile_only.figure_names(device.TINY, part)]
    assert sorted(planned) == sorted(names)


def test_a_correctness_figure_outside_its_tolerance_is_not_ok():
    inside = device.Figure("x", "correctness", 1e-5, "abs", "ref", 1.0, tolerance=1e-4)
    outside = device.Figure("x", "correctness", 1e-3, "abs", "ref", 1.0, tolerance=1e-4)
    speed = device.Figure("y", "speed", 30.0, "tokens/s", "floor", 60.0)
    assert (inside.ok, outside.ok, speed.ok) == (True, False, None)
    assert speed.ratio == 0.5 and inside.ratio is None
    assert json.loads(outside.to_json())["ok"] is False


def test_model_flops_and_the_train_layer_budget_by_hand():
    config = device_figures.our_config("tiny")  # d 64, f 128, 4 heads x 16, 2 kv heads, vocab 512
    matmul = 2 * (64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128) + 64 * 512
    # causal attention over 100 tokens: 100 x 101 / 2 (query, key) pairs, 4 x 64 FLOPs each
    # per layer, over the 100 tokens
    assert roofline.model_flops_per_token(config, 100) == 2 * matmul + 2 * 2 * 64 * 101
    # Qwen3-4B: 100.9M parameters a layer, 389M in the tied embedding, 20 bytes each
    per_layer = 2560 * (4096 + 2048) + 4096 * 2560 + 3 * 2560 * 9728
    assert per_layer == 100_925_440
    assert device_speed.train_layers("qwen3-4b", 60 * 1024**3) == 12  # jax's 75% of an 80 GB H100
    assert device_speed.train_layers("qwen3-4b", 1e15) == 36
    assert device_speed.train_layers("qwen3-4b", 1.0) == 1


def test_unknown_parts_are_refused_by_name():
    result = CliRunner().invoke(app, ["bench", "device", "--tiny", "--part", "warp"])
    assert result.exit_code == 2 and "unknown part(s) ['warp']" in result.output


def test_a_part_that_raises_is_one_line_naming_the_error_and_the_others_still_run(monkeypatch):
    def broken(seed: int = 0):
        raise RuntimeError("no kernel for this device\nsecond line")

    monkeypatch.setattr(device, "paged_kernel_figure", broken)
    figures = device.run(tiny=True, parts=["paged_kernel", "cudnn_attention"])
    assert [f.figure for f in figures] == [
        "paged_kernel (correctness): failed",
        "attention: cuDNN vs XLA",
    ]
    assert figures[0].ok is False and figures[0].value is None
    assert figures[0].settings["error"] == "RuntimeError: no kernel for this device"


def test_speed_figures_carry_the_roofline_and_the_share_of_it_reached_on_a_known_gpu(monkeypatch):
    h100 = gpu_spec("NVIDIA H100 80GB HBM3")  # the device kind an H100 reports
    assert h100 is GPUS["h100"] and gpu_spec("cpu") is None
    monkeypatch.setattr(device_speed, "gpu_here", lambda: h100)  # this CPU, as if it were an H100
    monkeypatch.setattr(device_speed, "_transformers_generate_s", lambda *a: None)
    monkeypatch.setattr(device, "TINY", dataclasses.replace(device.TINY, decode_batches=(8,)))
    (decode, generate) = device.run(tiny=True, parts=["decode"])
    config, scale = device_figures.our_config("tiny"), device.TINY
    # decode: the same rows at the steps' mean cache, prompt_len + new_tokens / 2 tokens
    want = roofline.decode_step(config, h100, 8, scale.prompt_len + scale.new_tokens / 2)
    assert decode.figure == "decode tiny batch 8"
    assert decode.settings["predicted"] == want.to_dict()
    assert decode.settings["of_predicted"] == pytest.approx(decode.value / want.value)
    assert "predicted" not in generate.settings
    # the train step: the figure's rows and length, a KL reference, full remat
    train = device_figures.train_prediction(config, h100, scale)
    assert train == roofline.train_step(config, h100, 1, 256, reference=True, remat=True)
    assert train.mfu is not None
    # the rollout: every row of tasks x G playing every turn of the budget
    rollout = device_figures.rollout_prediction(config, h100, scale, 223.4, 51.6)
    assert rollout == roofline.rollout_turns(
        config, h100, 8, turns=6, response_tokens=8, observation_tokens=52, prompt_tokens=223,
        max_context=1536,
    )  # fmt: skip


def test_against_a_prediction_is_the_measured_share_of_it_and_null_without_one():
    spec = dataclasses.replace(GPUS["h100"], peak_bf16_flops=1e12, bandwidth=1e9)  # a fake GPU
    prediction = roofline.decode_step(device_figures.our_config("tiny"), spec, 4, 100)
    entries = device_figures.against(prediction, prediction.value / 4)
    assert entries == {"predicted": prediction.to_dict(), "of_predicted": 0.25}
    assert device_figures.against(None, 5.0) == {"predicted": None, "of_predicted": None}
    assert device_figures.against(prediction, None)["of_predicted"] is None


def test_compile_only_without_the_cuda_plugin_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(targets, "cuda_plugin_version", lambda: None)
    result = CliRunner().invoke(app, ["bench", "device", "--compile-only", "h100"])
    assert result.exit_code == 2
    assert result.output.strip().count("\n") == 0, result.output
    assert "pip install -e '.[cuda]'" in result.output and "CUDA plugin" in result.output


def test_compile_only_refuses_gpus_and_parts_it_does_not_know():
    result = CliRunner().invoke(app, ["bench", "device", "--compile-only", "v100"])
    assert result.exit_code == 2 and "unknown GPU; known: h100, h200, a100" in result.output
    result = CliRunner().invoke(
        app, ["bench", "device", "--compile-only", "H200", "--part", "warp"]
    )
    assert result.exit_code == 2 and "unknown part(s) ['warp']" in result.output
