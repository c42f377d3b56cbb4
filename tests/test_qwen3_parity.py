"""Our Qwen3 against transformers' Qwen3ForCausalLM on tiny random checkpoints.

bfloat16 tolerance (documented): with parameters and compute in bfloat16, our logits' max abs
error against transformers in float32 is at most 2x transformers' own bfloat16 error
(``from_pretrained(..., dtype=torch.bfloat16)``), and our bfloat16 logits are within 0.1 of
transformers' bfloat16 logits, for logits of std ~0.8. Measured over 3 seeds x 3 configs: our
error / transformers' error 0.68..1.20, ours vs transformers bfloat16 at most 0.054.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_qwen3 import hf_logits, load_hf_qwen3, save_random_hf_qwen3

from agentrl_jax.models import load_qwen3, positions_from_mask

CASES = {
    # tied head; head_dim 24 != hidden 64 / 4 heads; kv ratio 1
    "tied_headdim24_kv1": dict(
        tie_word_embeddings=True,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=24,
        vocab_size=250,
    ),
    # untied; kv ratio 2; prime vocab
    "untied_kv2_vocab257": dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=257
    ),
    # kv ratio 4; Qwen3's rope_theta; yarn scaling with a small original context so the ramp
    # between kept and interpolated frequencies falls inside head_dim
    "untied_kv4_yarn": dict(
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=300,
        rope_parameters=dict(
            rope_type="yarn", factor=4.0, rope_theta=1e6, original_max_position_embeddings=16
        ),
    ),
    "tied_kv2_linear": dict(
        tie_word_embeddings=True,
        vocab_size=251,
        rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=500.0),
    ),
}


def _ours(model, tokens, mask=None):
    mask = np.ones(tokens.shape, bool) if mask is None else mask
    mask = jnp.asarray(mask)
    logits, _ = model(jnp.asarray(tokens), positions_from_mask(mask), mask)
    return np.asarray(logits)


@pytest.mark.parametrize("case", CASES)
def test_float32_logits_match_transformers(tmp_path, case):
    hf = save_random_hf_qwen3(tmp_path, seed=1, **CASES[case])
    tokens = np.random.default_rng(0).integers(0, hf.config.vocab_size, (2, 24))
    ours = _ours(load_qwen3(tmp_path), tokens)
    expected = hf_logits(hf, tokens)
    assert ours.shape == expected.shape == (2, 24, hf.config.vocab_size)
    assert expected.std() > 0.3, "logits too small for the tolerance to mean anything"
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", ["tied_headdim24_kv1", "untied_kv4_yarn"])
def test_bfloat16_logits_within_documented_tolerance(tmp_path, case):
    hf = save_random_hf_qwen3(tmp_path, seed=2, **CASES[case])
    tokens = np.random.default_rng(1).integers(0, hf.config.vocab_size, (2, 24))
    truth = hf_logits(hf, tokens)
    hf_bf16 = hf_logits(load_hf_qwen3(tmp_path, torch.bfloat16), tokens)
    model = load_qwen3(tmp_path, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    assert model.embed_tokens[...].dtype == jnp.bfloat16
    ours = _ours(model, tokens)
    their_error = np.abs(hf_bf16 - truth).max()
    assert 0 < np.abs(ours - truth).max() <= 2 * their_error
    assert np.abs(ours - hf_bf16).max() <= 0.1


def test_left_padded_batch_matches_rows_alone_and_transformers(tmp_path):
    hf = save_random_hf_qwen3(tmp_path, seed=3, **CASES["untied_kv2_vocab257"])
    model = load_qwen3(tmp_path)
    rng = np.random.default_rng(2)
    lengths = [11, 4, 8]
    rows = [rng.integers(0, 257, n) for n in lengths]
    width = max(lengths)
    tokens = np.zeros((3, width), np.int64)  # pad id 0 on the left
    mask = np.zeros((3, width), bool)
    for b, row in enumerate(rows):
        tokens[b, width - len(row) :] = row
        mask[b, width - len(row) :] = True
    batch = _ours(model, tokens, mask)
    assert np.isfinite(batch).all()  # padding rows are finite, never NaN
    for b, row in enumerate(rows):
        alone = _ours(model, row[None])[0]
        np.testing.assert_allclose(batch[b, width - len(row) :], alone, atol=1e-5, rtol=0)
        np.testing.assert_allclose(alone, hf_logits(hf, row[None])[0], atol=1e-4, rtol=0)


def test_gradients_match_torch_autograd(tmp_path):
    """d(sum of target log-probs)/d(params) against torch's backward (training path)."""
    hf = save_random_hf_qwen3(tmp_path, seed=4, **CASES["untied_kv2_vocab257"])
    tokens = np.random.default_rng(3).integers(0, 257, (2, 12))
    model = load_qwen3(tmp_path, remat=True)
    from flax import nnx

    graphdef, state = nnx.split(model)

    def loss(state):
        m = nnx.merge(graphdef, state)
        mask = jnp.ones(tokens.shape, bool)
        logits, _ = m(jnp.asarray(tokens), positions_from_mask(mask), mask)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        return jnp.take_along_axis(logp, jnp.asarray(tokens)[:, 1:, None], axis=-1).sum()

    grads = nnx.to_pure_dict(jax.grad(loss)(state))
    logits = hf(torch.tensor(tokens)).logits
    targets = torch.tensor(tokens)[:, 1:, None]
    torch.log_softmax(logits[:, :-1], -1).gather(-1, targets).sum().backward()
    layer1 = hf.model.layers[1]
    pairs = {
        "embed": (grads["embed_tokens"], hf.model.embed_tokens.weight.grad),
        "lm_head": (grads["lm_head"], hf.lm_head.weight.grad),
        "q_proj[1]": (grads["layers"]["q_proj"][1], layer1.self_attn.q_proj.weight.grad),
        "k_norm[1]": (grads["layers"]["k_norm"][1], layer1.self_attn.k_norm.weight.grad),
        "down_proj[1]": (grads["layers"]["down_proj"][1], layer1.mlp.down_proj.weight.grad),
        "norm": (grads["norm"], hf.model.norm.weight.grad),
    }
    for name, (ours, theirs) in pairs.items():
        theirs = theirs.numpy()
        scale = np.abs(theirs).max()
        assert scale > 0, name
        np.testing.assert_allclose(
            np.asarray(ours), theirs, atol=1e-4 * max(scale, 1.0), rtol=0, err_msg=name
        )
