"""The attention implementations agree with each other and with an independent reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax.models.attention import (
    attention,
    cache_limit,
    causal_limit,
    is_causal_limit,
    select_implementation,
    visibility,
)
from agentrl_jax.models.qwen3 import grouped_query_attention

TOL = dict(atol=1e-6, rtol=1e-5)


def _qkv(seed, batch, length, keys, heads, kv_heads, head_dim=8, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, length, heads, head_dim))
    k = rng.normal(size=(batch, keys, kv_heads, head_dim))
    v = rng.normal(size=(batch, keys, kv_heads, head_dim))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _left_padded(pads, length):
    return jnp.asarray(np.arange(length)[None, :] >= np.asarray(pads)[:, None])


def _real_rows(batch, key_limit, key_valid, length, keys):
    """``[B, L]`` bool: queries with at least one visible key."""
    visible = np.asarray(visibility(key_limit, key_valid, length, keys)).any(-1)
    return np.broadcast_to(visible, (batch, length))


def _run(implementation, q, k, v, key_limit, key_valid, block_q, block_k, weights):
    """jitted (out, grads of sum(out * weights) w.r.t. q, k, v)."""

    def loss(q, k, v):
        out = attention(
            q,
            k,
            v,
            key_limit,
            key_valid,
            implementation=implementation,
            block_q=block_q,
            block_k=block_k,
        )
        return jnp.sum(out * weights), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


def _cases():
    """(name, q, k, v, key_limit, key_valid, block_q, block_k)."""
    B, L = 4, 10
    q, k, v = _qkv(0, B, L, L, 4, 2)
    left = _left_padded([0, 3, 9, 6], L)  # ragged; one row with a single real token
    middle = jnp.asarray(
        np.array([[1, 1, 0, 0, 1, 1, 1, 0, 1, 1]] * 2 + [[0, 1, 0, 1] * 2 + [1, 0]] * 2, bool)
    )
    causal = causal_limit(B, L)
    qm, km, vm = _qkv(1, 2, 9, 9, 2, 2)  # H == KV
    # cache form: S = 16 slots, rows filled to [0, 5, 11]; 4 new tokens with ragged padding
    lengths = jnp.array([0, 5, 11], jnp.int32)
    new_mask = jnp.asarray(np.array([[1, 1, 1, 1], [0, 1, 1, 1], [0, 0, 1, 1]], bool))
    qc, kc, vc = _qkv(2, 3, 4, 16, 4, 2)
    return [
        ("left_padded_ragged", q, k, v, causal, left, 4, 4),
        ("left_padded_uneven_blocks", q, k, v, causal, left, 3, 4),
        ("padding_in_middle", q, k, v, causal, middle, 4, 3),
        ("causal_no_mask", q, k, v, None, None, 4, 4),
        ("mha_heads_equal_kv", qm, km, vm, causal_limit(2, 9), _left_padded([2, 0], 9), 4, 4),
        ("single_block", q, k, v, causal, left, 512, 512),
        ("cache_ragged", qc, kc, vc, cache_limit(lengths, new_mask), None, 3, 5),
        ("cache_ragged_single_block", qc, kc, vc, cache_limit(lengths, new_mask), None, 64, 64),
    ]


CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_blocked_matches_xla_forward_and_gradients(case):
    _, q, k, v, key_limit, key_valid, block_q, block_k = case
    real = _real_rows(q.shape[0], key_limit, key_valid, q.shape[1], k.shape[1])
    # cotangent only on real rows: padding rows differ by design (values "don't matter")
    weights = jnp.asarray(np.random.default_rng(9).normal(size=q.shape)) * real[:, :, None, None]
    out_x, grads_x = _run("xla", q, k, v, key_limit, key_valid, block_q, block_k, weights)
    out_b, grads_b = _run("blocked", q, k, v, key_limit, key_valid, block_q, block_k, weights)
    assert out_b.shape == q.shape and out_b.dtype == v.dtype
    np.testing.assert_allclose(np.asarray(out_b)[real], np.asarray(out_x)[real], **TOL)
    for name, gx, gb in zip("qkv", grads_x, grads_b):
        np.testing.assert_allclose(np.asarray(gb), np.asarray(gx), err_msg=f"d{name}", **TOL)


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[6]], ids=["left", "middle", "cache"])
def test_xla_is_bit_identical_to_grouped_query_attention(case):
    _, q, k, v, key_limit, key_valid, *_ = case
    mask = visibility(key_limit, key_valid, q.shape[1], k.shape[1])
    ours = jax.jit(lambda q, k, v: attention(q, k, v, key_limit, key_valid))(q, k, v)
    theirs = jax.jit(grouped_query_attention)(q, k, v, mask)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def test_causal_none_equals_explicit_causal_limit_and_the_qwen3_mask():
    _, q, k, v, _, valid, *_ = CASES[0]
    L = q.shape[1]
    explicit = jax.jit(lambda q, k, v: attention(q, k, v, causal_limit(q.shape[0], L), valid))
    implicit = jax.jit(lambda q, k, v: attention(q, k, v, None, valid))
    explicit, implicit = explicit(q, k, v), implicit(q, k, v)
    np.testing.assert_array_equal(np.asarray(explicit), np.asarray(implicit))
    qwen3_mask = jnp.tril(jnp.ones((L, L), bool))[None] & valid[:, None, :]
    np.testing.assert_array_equal(np.asarray(visibility(None, valid, L, L)), np.asarray(qwen3_mask))


@pytest.mark.parametrize("implementation", ["xla", "blocked"])
def test_all_padding_query_rows_are_finite_with_finite_gradients(implementation):
    B, L = 3, 9
    q, k, v = _qkv(3, B, L, L, 4, 2)
    valid = jnp.asarray(np.array([[0] * 9, [0] * 8 + [1], [0, 0, 1, 1, 0, 1, 1, 1, 1]], bool))
    weights = jnp.ones(q.shape)  # cotangent on every row, padding rows included
    out, grads = _run(implementation, q, k, v, None, valid, 4, 4, weights)
    assert np.isfinite(np.asarray(out)).all()
    for g in grads:
        assert np.isfinite(np.asarray(g)).all()


def _numpy_reference(q, k, v, key_limit, key_valid):
    """float64 loops: softmax over the visible keys only; NaN for rows without any."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, L, H, hd = q.shape
    S, KV = k.shape[1], k.shape[2]
    out = np.full(q.shape, np.nan)
    for b in range(B):
        for i in range(L):
            keys = [
                j
                for j in range(min(int(key_limit[b, i]), S))
                if key_valid is None or key_valid[b, j]
            ]
            if not keys:
                continue
            for h in range(H):
                kv = h // (H // KV)
                scores = np.array([q[b, i, h] @ k[b, j, kv] for j in keys]) / np.sqrt(hd)
                w = np.exp(scores - scores.max())
                out[b, i, h] = (w / w.sum()) @ v[b, keys, kv]
    return out


@pytest.mark.parametrize("case", [CASES[2], CASES[6]], ids=["middle", "cache"])
def test_matches_independent_float64_reference_on_real_rows(case):
    _, q, k, v, key_limit, key_valid, block_q, block_k = case
    limit = np.asarray(causal_limit(q.shape[0], q.shape[1]) if key_limit is None else key_limit)
    expected = _numpy_reference(
        q, k, v, limit, None if key_valid is None else np.asarray(key_valid)
    )
    real = ~np.isnan(expected[:, :, 0, 0])
    assert real.any()
    for implementation in ("xla", "blocked"):
        out = jax.jit(
            lambda q, k, v: attention(
                q,
                k,
                v,
                key_limit,
                key_valid,
                implementation=implementation,
                block_q=block_q,
                block_k=block_k,
            )
        )(q, k, v)
        np.testing.assert_allclose(
            np.asarray(out)[real], expected[real], atol=2e-6, err_msg=implementation
        )


def test_blocked_under_vmap_matches_the_unbatched_calls():
    _, q, k, v, _, valid, *_ = CASES[0]

    def one(q, k, v, valid):  # one batch row at a time, vmapped back over the batch
        return attention(
            q[None],
            k[None],
            v[None],
            None,
            valid[None],
            implementation="blocked",
            block_q=4,
            block_k=4,
        )[0]

    def loss(q, k, v):
        return jnp.sum(jnp.sin(jax.vmap(one)(q, k, v, valid)) * valid[:, :, None, None])

    def loss_ref(q, k, v):
        out = attention(q, k, v, None, valid, implementation="xla")
        return jnp.sum(jnp.sin(out) * valid[:, :, None, None])

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    grads_ref = jax.jit(jax.grad(loss_ref, argnums=(0, 1, 2)))(q, k, v)
    for g, r in zip(grads, grads_ref):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), **TOL)


def test_blocked_bfloat16_is_close_to_xla_and_keeps_the_dtype():
    _, q, k, v, _, valid, *_ = CASES[0]
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    run = jax.jit(
        lambda q, k, v, impl: attention(
            q, k, v, None, valid, implementation=impl, block_q=4, block_k=4
        ),
        static_argnums=3,
    )
    blocked, xla = run(q, k, v, "blocked"), run(q, k, v, "xla")
    assert blocked.dtype == jnp.bfloat16
    real = np.asarray(valid)
    np.testing.assert_allclose(
        np.asarray(blocked, np.float32)[real], np.asarray(xla, np.float32)[real], atol=3e-2
    )


def test_blocked_keeps_no_score_matrix_in_forward_and_backward():
    B, L, H, hd = 1, 4096, 4, 32
    spec = jax.ShapeDtypeStruct((B, L, H, hd), jnp.float32)
    valid = jax.ShapeDtypeStruct((B, L), jnp.bool_)

    def temp_bytes(implementation):
        def loss(q, k, v, valid):
            return jnp.sum(attention(q, k, v, None, valid, implementation=implementation))

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        return grad.lower(spec, spec, spec, valid).compile().memory_analysis().temp_size_in_bytes

    xla, blocked = temp_bytes("xla"), temp_bytes("blocked")
    print(f"temp bytes: xla {xla}, blocked {blocked}")
    assert xla >= H * L * L * 4  # at least one float32 [H, L, S] score matrix
    assert blocked < xla / 4


def test_helpers():
    np.testing.assert_array_equal(np.asarray(causal_limit(2, 3)), [[1, 2, 3], [1, 2, 3]])
    limit = cache_limit(jnp.array([0, 4]), jnp.array([[1, 1, 0], [0, 1, 1]], bool))
    np.testing.assert_array_equal(np.asarray(limit), [[1, 2, 2], [4, 5, 6]])
    assert is_causal_limit(None) and is_causal_limit(causal_limit(2, 5))
    assert not is_causal_limit(limit)


def test_auto_selection_on_cpu():
    if jax.default_backend() != "cpu":
        pytest.skip("selection below is the CPU one")
    small = jnp.zeros((1, 64, 2, 8))
    large = jax.ShapeDtypeStruct((1, 4096, 2, 8), jnp.float32)
    assert select_implementation(small, small, None) == "xla"
    assert select_implementation(large, large, None) == "blocked"
    _, q, k, v, _, valid, *_ = CASES[0]
    np.testing.assert_array_equal(
        np.asarray(attention(q, k, v, None, valid, implementation="auto")),
        np.asarray(attention(q, k, v, None, valid, implementation="xla")),
    )


def test_splash_rejects_the_cache_form_and_unknown_names_raise():
    _, q, k, v, key_limit, *_ = CASES[6]
    with pytest.raises(ValueError, match="causal no-cache"):
        attention(q, k, v, key_limit, implementation="splash")
    with pytest.raises(ValueError, match="unknown"):
        attention(q, k, v, key_limit, implementation="flash")


def test_splash_in_the_pallas_interpreter_matches_xla_on_real_tokens():
    # The TPU kernel itself, run by the Pallas interpreter on any backend: L = 200 pads to
    # 2 x 2 blocks of 128; left padding plus holes in the middle; grouped-query heads.
    from agentrl_jax.models.attention import _splash_attention

    B, L, H, KV, hd = 2, 200, 2, 1, 128
    q, k, v = _qkv(4, B, L, L, H, KV, hd)
    positions = np.arange(L)[None]
    valid = jnp.asarray((positions >= np.array([[0], [37]])) & (positions % 17 != 5))
    weights = jnp.asarray(np.random.default_rng(5).normal(size=q.shape)) * valid[:, :, None, None]

    def run(fn):
        def loss(q, k, v):
            out = fn(q, k, v)
            return jnp.sum(out * weights), out

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    (_, out_s), grads_s = run(
        lambda q, k, v: _splash_attention(q, k, v, None, valid, 128, 128, interpret=True)
    )
    (_, out_x), grads_x = run(lambda q, k, v: attention(q, k, v, None, valid))
    real = np.asarray(valid)
    assert np.isfinite(np.asarray(out_s)).all()
    np.testing.assert_allclose(np.asarray(out_s)[real], np.asarray(out_x)[real], atol=1e-5)
    for name, gs, gx in zip("qkv", grads_s, grads_x):
        np.testing.assert_allclose(np.asarray(gs), np.asarray(gx), atol=2e-5, err_msg=f"d{name}")


def test_cudnn_raises_off_gpu():
    if jax.default_backend() == "gpu":
        pytest.skip("runs for real on a GPU")
    _, q, k, v, _, valid, *_ = CASES[0]
    with pytest.raises((RuntimeError, NotImplementedError), match="(?i)cudnn"):
        attention(
            q.astype(jnp.bfloat16),
            k.astype(jnp.bfloat16),
            v.astype(jnp.bfloat16),
            None,
            valid,
            implementation="cudnn",
        )


def test_blocked_keeps_no_block_pair_buffer_inside_a_scan_over_layers():
    """Inside a differentiated scan over layers the masks are loop-invariant; nothing computed
    from them alone may be hoisted out of the loop and kept for every (query, key) block pair."""
    batch, length, heads, kv_heads, dim = 2, 64, 4, 2, 8
    valid = jnp.ones((batch, length), bool)

    def layer(x, w):
        q = (x @ w).reshape(batch, length, heads, dim)
        out = attention(
            q,
            q[:, :, :kv_heads],
            q[:, :, kv_heads : 2 * kv_heads],
            None,
            valid,
            implementation="blocked",
            block_q=16,
            block_k=16,
        )
        return x + out.reshape(batch, length, heads * dim) @ w.T, None

    weights, x = jnp.full((3, 32, 32), 0.01), jnp.ones((batch, length, 32))
    for body in (layer, jax.checkpoint(layer, prevent_cse=False)):
        jaxpr = str(
            jax.make_jaxpr(jax.grad(lambda w, x: jnp.sum(jax.lax.scan(body, x, w)[0] ** 2)))(
                weights, x
            )
        )
        assert "[4,4,2,2,2,16,16]" not in jaxpr  # [query blocks, key blocks, B, KV, G, bq, bk]
