"""The roofline predictions (agentrl_jax/plan/roofline.py) against counts done by hand, and the
GPUs known by name (agentrl_jax/plan/targets.py) against NVIDIA's published figures."""

from __future__ import annotations

import dataclasses

import pytest

from agentrl_jax.models.config import Qwen3Config
from agentrl_jax.plan import GPUS, gpu_spec, qwen3_config, roofline
from agentrl_jax.plan.targets import GpuSpec

# a toy model whose counts are easy by hand: d=4, f=8, 2 layers, 2 heads of 2, 1 KV head, V=10
TOY = Qwen3Config(
    vocab_size=10,
    hidden_size=4,
    intermediate_size=8,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=2,
)
# a GPU of 100 FLOP/s and 10 bytes/s: compute time = FLOPs / 100, memory time = bytes / 10
TOY_GPU = GpuSpec("toy", "toy", 1000, 10.0, 100.0, "")


def test_parameter_and_flop_counts_by_hand():
    # q: 4x4, k and v: 4x2 each, o: 4x4, MLP: 3 x 4x8 -> 16 + 16 + 16 + 96 = 144 a layer
    assert roofline.layer_matmul_parameters(TOY) == 144
    # 2 layers + the head 4 x 10
    assert roofline.matmul_parameters(TOY) == 2 * 144 + 40
    # 3 tokens, causal: 1 + 2 + 3 = 6 (query, key) pairs
    assert roofline.causal_pairs(3) == 6
    # attention: 4 FLOPs x 2 layers x 2 heads x head_dim 2 = 32 a pair
    assert roofline.attention_flops(TOY, 6) == 32 * 6
    assert roofline.forward_flops(TOY, 3, 6) == 2 * 328 * 3 + 32 * 6
    # K and V, 2 layers, 1 KV head of 2, bfloat16
    assert roofline.kv_bytes_per_token(TOY) == 2 * 2 * 1 * 2 * 2


def test_qwen3_0_6b_counts_match_its_published_size():
    """Qwen3-0.6B: 0.44B non-embedding parameters (its model card); the tied head is 151,936 x
    1,024 = 0.156B more; the matmuls are all of those but the norms."""
    config = qwen3_config("qwen3-0.6b")
    body = config.num_hidden_layers * roofline.layer_matmul_parameters(config)
    assert body == pytest.approx(0.44e9, rel=0.01)
    assert roofline.matmul_parameters(config) - body == 151936 * 1024


def test_decode_is_memory_bound_at_one_row_and_counts_weights_and_cache():
    p = roofline.decode_step(TOY, TOY_GPU, rows=1, context=5)
    flops = 2 * 328 + 32 * 5  # one token: matmuls + 5 visible keys
    moved = 328 * 2 + 5 * 16  # bfloat16 weights + 5 cached tokens of 16 bytes
    assert (p.flops, p.bytes) == (flops, moved)
    assert p.seconds == pytest.approx(max(flops / 100, moved / 10))
    assert p.bound == "memory" and p.value == pytest.approx(1 / p.seconds)


def test_more_rows_share_the_weights_and_raise_tokens_per_second():
    one = roofline.decode_step(qwen3_config("qwen3-4b"), GPUS["h100"], 1, 1024)
    many = roofline.decode_step(qwen3_config("qwen3-4b"), GPUS["h100"], 64, 1024)
    assert many.value > 10 * one.value
    # one row of Qwen3-4B on an H100: ~8 GB of bfloat16 weights at 3.35 TB/s: ~400 tokens/s
    assert 300 < one.value < 450


def test_train_step_by_hand():
    """1 row of 3 tokens, GRPO with a KL reference and full remat: model FLOPs are 4 forwards
    (policy forward + backward = 3, reference 1), the hardware does one more (recompute)."""
    p = roofline.train_step(TOY, TOY_GPU, rows=1, length=3)
    forward = roofline.forward_flops(TOY, 3, 6)
    assert p.flops == 5 * forward
    weights = 328
    # per micro-batch: 4 policy passes + 1 reference pass read float32 weights, gradients
    # accumulated (8 bytes); saved layer inputs (bfloat16, written and read); AdamW 28 bytes
    moved = 5 * 4 * weights + 8 * weights + 2 * 2 * 2 * 3 * 4 + 28 * weights
    assert p.bytes == moved
    assert p.seconds == pytest.approx(max(5 * forward / 100, moved / 10))
    assert p.mfu == pytest.approx(4 * forward / p.seconds / 100)


def test_train_step_mfu_is_model_over_hardware_flops_when_compute_bound():
    p = roofline.train_step(qwen3_config("qwen3-4b"), GPUS["h100"], rows=1, length=8192)
    assert p.bound == "compute"
    assert p.mfu == pytest.approx(4 / 5)  # 4 forwards of model FLOPs, 5 done
    lora = roofline.train_step(qwen3_config("qwen3-4b"), GPUS["h100"], 1, 8192, full_weights=False)
    assert lora.mfu == pytest.approx(3 / 4)  # no weight gradients: 2 + 1 of 2 + 1 + 1


def test_rollout_turns_sum_the_prefills_and_decode_steps():
    p = roofline.rollout_turns(
        TOY, TOY_GPU, 2, turns=2, response_tokens=3, observation_tokens=4, prompt_tokens=5,
        max_context=100,
    )  # fmt: skip
    parts = [
        roofline.prefill(TOY, TOY_GPU, 2, 5, 0),
        *[roofline.decode_step(TOY, TOY_GPU, 2, 5 + 1.5)] * 3,
        roofline.prefill(TOY, TOY_GPU, 2, 4, 8),
        *[roofline.decode_step(TOY, TOY_GPU, 2, 12 + 1.5)] * 3,
        roofline.prefill(TOY, TOY_GPU, 2, 4, 15),
    ]
    seconds = sum(x.seconds for x in parts)
    assert p.seconds == pytest.approx(seconds)
    assert p.value == pytest.approx(2 * 2 / seconds)


def test_known_gpus_carry_nvidias_published_figures():
    h100, h200, a100 = GPUS["h100"], GPUS["h200"], GPUS["a100"]
    assert h100.description == "NVIDIA H100 80GB HBM3"
    assert h100.bandwidth == pytest.approx(3.35e12, rel=0.01)
    assert h200.bandwidth == 4.8e12 and h200.memory_bytes > 140 * 1024**3
    assert a100.bandwidth == 2.039e12 and a100.peak_bf16_flops == 312e12
    assert h100.peak_bf16_flops == h200.peak_bf16_flops == 989.4e12
    assert "cuda_compute_capability { major: 8 }" in a100.target_config


def test_gpu_spec_maps_device_kinds_and_names():
    assert gpu_spec("NVIDIA H100 80GB HBM3") is GPUS["h100"]
    assert gpu_spec("NVIDIA H200") is GPUS["h200"]
    assert gpu_spec("NVIDIA A100-SXM4-80GB") is GPUS["a100"]
    assert gpu_spec("H100") is GPUS["h100"]
    assert gpu_spec("cpu") is None and gpu_spec("TPU v5p") is None


def test_predictions_are_plain_data():
    p = roofline.decode_step(TOY, TOY_GPU, 1, 1)
    assert dataclasses.asdict(p) == p.to_dict()
