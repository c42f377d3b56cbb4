"""The model's pure pieces against hand-computed values and independent formulations."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from agentrl_jax.models import Qwen3Config, positions_from_mask
from agentrl_jax.models.qwen3 import (
    apply_rope,
    grouped_query_attention,
    rms_norm,
    rope_cos_sin,
    rope_inverse_frequencies,
    swiglu_mlp,
)

BASE = dict(
    vocab_size=32,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
)


def test_rms_norm_hand_computed():
    # [3, 4]: mean square 12.5, so [3, 4] / sqrt(12.5) = [0.848528, 1.131371]; weights [1, 2].
    out = rms_norm(jnp.array([[3.0, 4.0]]), jnp.array([1.0, 2.0]), eps=0.0)
    np.testing.assert_allclose(np.asarray(out), [[0.8485281, 2.2627417]], rtol=1e-6)


def test_rms_norm_casts_back_before_the_weight_in_bfloat16():
    x = jnp.array([[1.0, 2.0, 3.0, 4.0]], jnp.bfloat16)
    w = jnp.array([1.1, 0.9, 1.3, 0.7], jnp.bfloat16)
    x32 = np.array([[1.0, 2.0, 3.0, 4.0]])
    normed = (x32 / np.sqrt((x32**2).mean() + 1e-6)).astype(jnp.bfloat16)
    expected = np.asarray(w) * normed  # bfloat16 product of bfloat16 operands
    out = rms_norm(x, w, 1e-6)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out), expected)


def test_rope_is_a_complex_rotation_of_half_split_pairs():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 4, 8)).astype(np.float32)  # [B, L, heads, head_dim]
    positions = np.array([[0, 1, 7], [3, 3, 100]])
    inv_freq = 1.0 / 10_000 ** (np.arange(0, 8, 2) / 8)
    cos, sin = rope_cos_sin(jnp.asarray(positions), inv_freq.astype(np.float32), 1.0, jnp.float32)
    ours = np.asarray(apply_rope(jnp.asarray(x), cos, sin))
    pairs = x[..., :4] + 1j * x[..., 4:]  # dims i and i + head_dim/2 form one complex number
    rotated = pairs * np.exp(1j * positions[:, :, None, None] * inv_freq)
    np.testing.assert_allclose(ours, np.concatenate([rotated.real, rotated.imag], -1), atol=2e-5)
    # position 0 is the identity
    np.testing.assert_allclose(ours[0, 0], x[0, 0], atol=1e-7)


@pytest.mark.parametrize(
    "rope_parameters",
    [
        dict(rope_type="default", rope_theta=1e6),
        dict(rope_type="linear", factor=3.0, rope_theta=5e5),
        dict(rope_type="yarn", factor=4.0, rope_theta=1e6, original_max_position_embeddings=1024),
        dict(
            rope_type="yarn",
            factor=8.0,
            rope_theta=1e6,
            original_max_position_embeddings=512,
            mscale=1.0,
            mscale_all_dim=0.5,
            truncate=False,
            beta_fast=16,
            beta_slow=2,
        ),
        dict(
            rope_type="yarn",
            factor=2.0,
            rope_theta=1e4,
            original_max_position_embeddings=256,
            attention_factor=1.5,
        ),
    ],
)
def test_rope_frequencies_match_transformers_init_functions(rope_parameters):
    hf_config = transformers.Qwen3Config(**BASE, rope_parameters=dict(rope_parameters))
    ours = Qwen3Config.from_hf_dict(hf_config.to_dict())
    inv_freq, scale = rope_inverse_frequencies(ours)
    rope_type = rope_parameters["rope_type"]
    if rope_type == "default":
        theta = rope_parameters["rope_theta"]
        expected, expected_scale = 1.0 / theta ** (np.arange(0, 16, 2) / 16), 1.0
    else:
        expected, expected_scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config)
        expected = expected.numpy()
    np.testing.assert_allclose(inv_freq, expected, rtol=2e-6)
    assert scale == pytest.approx(expected_scale, rel=1e-12)


def _naive_attention(q, k, v, mask):
    batch, length, heads, hd = q.shape
    group = heads // k.shape[2]
    out = np.zeros_like(q)
    for b in range(batch):
        for h in range(heads):
            scores = q[b, :, h] @ k[b, :, h // group].T / np.sqrt(hd)  # [L, S]
            scores = np.where(mask[b], scores, -np.inf)
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            out[b, :, h] = (weights / weights.sum(-1, keepdims=True)) @ v[b, :, h // group]
    return out


def test_grouped_query_attention_matches_a_per_head_loop():
    rng = np.random.default_rng(1)
    q = rng.normal(size=(2, 5, 6, 4)).astype(np.float32)  # 6 query heads
    k = rng.normal(size=(2, 7, 2, 4)).astype(np.float32)  # 2 kv heads: groups of 3
    v = rng.normal(size=(2, 7, 2, 4)).astype(np.float32)
    mask = rng.random((2, 5, 7)) < 0.6
    mask[:, :, 0] = True  # every query sees something
    ours = grouped_query_attention(*map(jnp.asarray, (q, k, v, mask)))
    np.testing.assert_allclose(np.asarray(ours), _naive_attention(q, k, v, mask), atol=1e-5)


def test_a_query_that_sees_nothing_gets_finite_output():
    q = jnp.ones((1, 1, 2, 4))
    kv = jnp.arange(8.0).reshape(1, 2, 1, 4)
    out = grouped_query_attention(q, kv, kv, jnp.zeros((1, 1, 2), bool))
    np.testing.assert_allclose(np.asarray(out)[0, 0, 0], np.asarray(kv[0, :, 0]).mean(0))


def test_swiglu_hand_computed():
    x = jnp.array([[1.0, -2.0]])
    gate = jnp.array([[1.0, 0.0], [0.0, 1.0]])  # [I=2, D=2]
    up = jnp.array([[2.0, 0.0], [1.0, 1.0]])
    down = jnp.array([[1.0, 1.0], [0.0, 1.0]])  # [D=2, I=2]
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    hidden = np.array([silu(1.0) * 2.0, silu(-2.0) * -1.0])
    np.testing.assert_allclose(
        np.asarray(swiglu_mlp({"gate_proj": gate, "up_proj": up, "down_proj": down}, x)),
        [[hidden.sum(), hidden[1]]],
        rtol=1e-6,
    )


def test_positions_count_only_real_tokens():
    mask = jnp.array([[0, 0, 1, 1, 0, 1], [1, 1, 1, 1, 1, 1]], bool)
    expected = [[0, 0, 0, 1, 1, 2], [0, 1, 2, 3, 4, 5]]
    assert np.asarray(positions_from_mask(mask)).tolist() == expected
    shifted = positions_from_mask(mask, jnp.array([5, 0]))
    assert np.asarray(shifted).tolist() == [[5, 5, 5, 6, 6, 7], [0, 1, 2, 3, 4, 5]]
