"""KV-cache path: prefill, decode and appended chunks equal one full forward per row."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from agentrl_jax.models import KVCache, Qwen3Config, Qwen3ForCausalLM, positions_from_mask

CONFIG = Qwen3Config(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    rope_theta=1e4,
)


@pytest.fixture(scope="module")
def model():
    model = Qwen3ForCausalLM(CONFIG, rngs=nnx.Rngs(0))
    # Larger weights than the 0.02 init, so attention is far from uniform and a misplaced key
    # would change the logits.
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda w: w * 5.0 if w.ndim > 2 else w, state))
    return model


def _chunk(rows: list[np.ndarray], width: int, left: bool) -> tuple[np.ndarray, np.ndarray]:
    """Pad ragged token rows into ``[B, width]`` tokens (pad id -1) and a mask."""
    tokens = np.full((len(rows), width), -1, np.int32)
    mask = np.zeros((len(rows), width), bool)
    for b, row in enumerate(rows):
        where = slice(width - len(row), width) if left else slice(0, len(row))
        tokens[b, where], mask[b, where] = row, True
    return tokens, mask


def test_prefill_decode_and_appended_chunks_match_full_forward(model):
    graphdef, state = nnx.split(model)
    traces = []

    @jax.jit
    def step(state, tokens, mask, cache):
        traces.append(tokens.shape)
        mask = mask.astype(bool)
        positions = positions_from_mask(mask, cache.lengths)
        return nnx.merge(graphdef, state)(tokens, positions, mask, cache)

    rng = np.random.default_rng(0)
    history = [[] for _ in range(3)]  # each row's real tokens so far
    outputs = [[] for _ in range(3)]  # our logits for each of those tokens
    cache = KVCache.empty(CONFIG, batch_size=3, max_len=40, dtype=jnp.float32)

    def feed(rows, width, left):
        nonlocal cache
        tokens, mask = _chunk(rows, width, left)
        logits, cache = step(state, tokens, mask, cache)
        for b, row in enumerate(rows):
            history[b].extend(row)
            outputs[b].extend(np.asarray(logits)[b][mask[b]])

    feed([rng.integers(0, 97, n) for n in (5, 9, 1)], 9, left=False)  # ragged prompts
    for _ in range(4):  # decode: one token per row
        feed([rng.integers(0, 97, 1) for _ in range(3)], 1, left=False)
    feed([rng.integers(0, 97, n) for n in (2, 0, 4)], 4, left=True)  # observations, a row idle
    for _ in range(3):
        feed([rng.integers(0, 97, 1) for _ in range(3)], 1, left=False)

    assert np.asarray(cache.lengths).tolist() == [len(h) for h in history] == [14, 16, 12]
    assert traces.count((3, 1)) == 1, "decode steps must not retrace"
    for b in range(3):
        tokens = jnp.asarray(history[b])[None]
        mask = jnp.ones(tokens.shape, bool)
        full, _ = model(tokens, positions_from_mask(mask), mask)
        np.testing.assert_allclose(np.stack(outputs[b]), np.asarray(full)[0], atol=1e-5, rtol=0)


def test_prefill_into_empty_cache_equals_forward_without_cache(model):
    rng = np.random.default_rng(1)
    tokens, mask = _chunk([rng.integers(0, 97, n) for n in (7, 3)], 7, left=True)
    mask_j = jnp.asarray(mask)
    positions = positions_from_mask(mask_j)
    plain, none = model(jnp.asarray(tokens), positions, mask_j)
    cached, cache = model(
        jnp.asarray(tokens), positions, mask_j, KVCache.empty(CONFIG, 2, 12, jnp.float32)
    )
    assert none is None
    np.testing.assert_allclose(np.asarray(cached)[mask], np.asarray(plain)[mask], atol=1e-5)
    assert np.asarray(cache.lengths).tolist() == [7, 3]
    # Real tokens sit compactly at slots 0..n-1; nothing was written past them.
    k = np.asarray(cache.k)
    assert np.abs(k[:, 1, :3]).min() > 0 and not k[:, 1, 3:].any() and not k[:, 0, 7:].any()


def test_writes_past_the_end_are_dropped_not_wrapped(model):
    cache = KVCache.empty(CONFIG, 1, 6, jnp.float32)
    first = jnp.arange(5, dtype=jnp.int32)[None]
    mask = jnp.ones((1, 5), bool)
    _, cache = model(first, positions_from_mask(mask), mask, cache)
    before = np.asarray(cache.k)
    extra = jnp.array([[5, 6, 7]], jnp.int32)
    mask3 = jnp.ones((1, 3), bool)
    _, cache = model(extra, positions_from_mask(mask3, cache.lengths), mask3, cache)
    after = np.asarray(cache.k)
    np.testing.assert_array_equal(after[:, :, :5], before[:, :, :5])  # untouched
    assert after[:, :, 5].any()  # the one slot left was written


def test_cache_dtype_and_shapes():
    cache = KVCache.empty(CONFIG, batch_size=4, max_len=32)
    assert cache.k.shape == cache.v.shape == (2, 4, 32, 2, 16)
    assert cache.k.dtype == jnp.bfloat16 and cache.lengths.dtype == jnp.int32
    assert cache.max_len == 32
