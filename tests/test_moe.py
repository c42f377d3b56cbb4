"""The Qwen3 mixture-of-experts block (agentrl_jax/models/moe.py) against ``transformers``'
``Qwen3MoeSparseMoeBlock`` on random weights at odd sizes: routing choices equal for every
token, outputs to 1e-5 in float32, with and without renormalised top-k weights. Dropless: a
router that sends every token to one expert drops none (checked against a dense per-token
reference). Routing replay: given experts are used, weighted by the router's own
probabilities, with the router's gradient flowing through them. One compile serves every
routing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from compile_counter import count_backend_compiles
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from agentrl_jax.models import moe

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 20, 12, 6, 2


def reference_block(normalize: bool, seed: int = 0) -> Qwen3MoeSparseMoeBlock:
    config = Qwen3MoeConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTERMEDIATE,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=normalize,
    )
    torch.manual_seed(seed)
    block = Qwen3MoeSparseMoeBlock(config).float()
    for parameter in block.parameters():
        torch.nn.init.normal_(parameter, std=0.5)
    return block


def our_weights(block: Qwen3MoeSparseMoeBlock) -> dict[str, jax.Array]:
    """The block's weights in Hugging Face's per-expert layouts, stacked over experts."""
    gate_up = block.experts.gate_up_proj.detach().numpy()  # [E, 2I, H]
    return {
        "router": jnp.asarray(block.gate.weight.detach().numpy()),
        "gate": jnp.asarray(gate_up[:, :INTERMEDIATE]),
        "up": jnp.asarray(gate_up[:, INTERMEDIATE:]),
        "down": jnp.asarray(block.experts.down_proj.detach().numpy()),
    }


@pytest.mark.parametrize("normalize", [True, False], ids=["norm_topk", "raw_topk"])
def test_the_block_equals_transformers(normalize):
    block = reference_block(normalize)
    x = np.random.default_rng(1).standard_normal((3, 7, HIDDEN)).astype(np.float32)
    with torch.no_grad():
        want = block(torch.from_numpy(x)).numpy()
        _, want_weights, want_experts = block.gate(torch.from_numpy(x).reshape(-1, HIDDEN))
    w = our_weights(block)
    out, logits, experts = moe.moe_block(
        jnp.asarray(x), w["router"], w["gate"], w["up"], w["down"], k=TOP_K, normalize=normalize
    )
    np.testing.assert_array_equal(np.asarray(experts), want_experts.numpy())  # every token
    weights, _ = moe.route(logits, TOP_K, normalize=normalize)
    np.testing.assert_allclose(np.asarray(weights), want_weights.numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
    # every expert was used by some token, so every group of the grouped matmul was exercised
    assert set(np.asarray(experts).ravel()) == set(range(EXPERTS))


def dense_reference(x, experts, weights, w) -> np.ndarray:
    """Each token through each of its experts, one at a time, in float64."""
    x, gate, up, down = (np.asarray(a, np.float64) for a in (x, w["gate"], w["up"], w["down"]))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e, weight in zip(np.asarray(experts)[t], np.asarray(weights, np.float64)[t]):
            g, u = gate[e] @ x[t], up[e] @ x[t]
            out[t] += weight * (down[e] @ (g / (1 + np.exp(-g)) * u))
    return out


def test_a_skewed_router_drops_no_token():
    """Every token's first choice is expert 4 (no capacity limit: all 40 reach it)."""
    w = our_weights(reference_block(True))
    x = np.random.default_rng(2).standard_normal((40, HIDDEN)).astype(np.float32)
    x[:, 0] = 5.0  # a feature every token has ...
    router = np.asarray(w["router"]).copy()
    router[4] = 0.0
    router[4, 0] = 20.0  # ... that expert 4 reads: logit 100 for every token
    w["router"] = jnp.asarray(router)
    out, _, experts = moe.moe_block(
        jnp.asarray(x), w["router"], w["gate"], w["up"], w["down"], k=TOP_K, normalize=True
    )
    assert (np.asarray(experts)[:, 0] == 4).all()
    weights, _ = moe.route(jnp.asarray(x) @ w["router"].T, TOP_K, normalize=True)
    np.testing.assert_allclose(
        np.asarray(out), dense_reference(x, experts, weights, w), rtol=1e-4, atol=1e-5
    )


def test_routing_replay_uses_the_given_experts_and_trains_the_router():
    w = our_weights(reference_block(True))
    x = jnp.asarray(np.random.default_rng(3).standard_normal((9, HIDDEN)).astype(np.float32))
    _, logits, own = moe.moe_block(
        x, w["router"], w["gate"], w["up"], w["down"], k=2, normalize=True
    )
    replayed = (own + 1) % EXPERTS  # experts the router did not choose
    out, _, used = moe.moe_block(
        x, w["router"], w["gate"], w["up"], w["down"], k=2, normalize=True, experts=replayed
    )
    np.testing.assert_array_equal(np.asarray(used), np.asarray(replayed))
    probs = np.asarray(jax.nn.softmax(logits, axis=-1), np.float64)
    weights = np.take_along_axis(probs, np.asarray(replayed), axis=-1)
    weights /= weights.sum(-1, keepdims=True)  # the router's own probabilities, renormalised
    np.testing.assert_allclose(
        np.asarray(out), dense_reference(x, replayed, weights, w), rtol=1e-4, atol=1e-5
    )

    def loss(router):
        y, _, _ = moe.moe_block(
            x, router, w["gate"], w["up"], w["down"], k=2, normalize=False, experts=replayed
        )
        return jnp.sum(y**2)

    grad = np.asarray(jax.grad(loss)(w["router"]))
    assert np.isfinite(grad).all() and np.abs(grad).sum() > 0  # the router learns under replay


def test_one_compile_serves_every_routing():
    w = our_weights(reference_block(True))
    block = jax.jit(
        lambda x, r: moe.moe_block(x, r, w["gate"], w["up"], w["down"], k=2, normalize=True)
    )
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((16, HIDDEN)).astype(np.float32))
    block(x, w["router"])  # compiled here
    routers = [  # uniform, mixed, skewed routings
        jnp.asarray(scale * rng.standard_normal((EXPERTS, HIDDEN)).astype(np.float32))
        for scale in (0.0, 1.0, 30.0)
    ]
    routings = set()
    with count_backend_compiles() as compiles:
        for router in routers:
            _, _, experts = block(x, router)
            routings.add(tuple(np.bincount(np.asarray(experts).ravel(), minlength=EXPERTS)))
    assert compiles == [] and len(routings) == 3


_EXPERT_PARALLEL_CHILD = r"""
import jax, jax.numpy as jnp, numpy as np, re
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from agentrl_jax.models import moe

E, H, I, T, K = 8, 12, 10, 32, 2
rng = np.random.default_rng(0)
w = {n: jnp.asarray(rng.standard_normal(s).astype(np.float32) * 0.5)
     for n, s in (("router", (E, H)), ("gate", (E, I, H)), ("up", (E, I, H)), ("down", (E, H, I)))}
x = rng.standard_normal((T, H)).astype(np.float32)
x[:, 0] += 3.0  # a feature every token has: a router reading it sends them all one way
x = jnp.asarray(x)
skewed = np.asarray(w["router"]).copy()
skewed[5] = 0.0
skewed[5, 0] = 8.0  # expert 5 first for (nearly) every token

def loss(ffn, x, router, gate, up, down):
    out, _, experts = moe.moe_block(x, router, gate, up, down, k=K, normalize=True, ffn=ffn)
    return jnp.sum(jnp.sin(out)), (out, experts)

grad = jax.grad(loss, argnums=(1, 2, 3, 4, 5), has_aux=True)
for router in (w["router"], jnp.asarray(skewed)):
    (want_grads, (want, want_experts)) = jax.jit(lambda *a: grad(moe.experts_ffn, *a))(
        x, router, w["gate"], w["up"], w["down"])
    for shape, names, batch in (((8,), ("expert",), ()), ((2, 4), ("data", "expert"), ("data",))):
        mesh = Mesh(np.array(jax.devices()).reshape(shape), names)
        ffn = moe.expert_parallel(mesh, "expert", batch)
        tokens = NamedSharding(mesh, P((*batch, "expert")))
        experts_split = NamedSharding(mesh, P("expert"))
        args = (jax.device_put(x, tokens), router,
                *(jax.device_put(w[n], experts_split) for n in ("gate", "up", "down")))
        run = jax.jit(lambda *a: grad(ffn, *a))
        (got_grads, (got, got_experts)) = run(*args)
        np.testing.assert_array_equal(np.asarray(got_experts), np.asarray(want_experts))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
        for g, h in zip(got_grads, want_grads):  # summed in another order: to 1e-5 of the scale
            scale = float(np.abs(np.asarray(h)).max())
            np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-5, atol=1e-5 * scale)
        hlo = run.lower(*args).compile().as_text()
        gathered = re.findall(r"= (\w+\[[\d,]*\])[^=]*? all-gather\(", hlo)
        weights = (f",{I},{H}]", f",{H},{I}]")
        assert gathered and not [g for g in gathered if g.endswith(weights)], gathered
    counts = np.bincount(np.asarray(want_experts).ravel(), minlength=E)
    print("OK", counts.tolist())
"""


def test_expert_parallel_on_8_devices_equals_one_device(tmp_path):
    """The experts split over 8 fake devices (an ``expert`` axis of 8, and ``data`` 2 x
    ``expert`` 4): the outputs and the gradients (tokens, router, every expert weight) of one
    device's computation, for a spread router and for one that sends most tokens to expert 5
    (dropless: all of them computed on its device); no expert weight is all-gathered."""
    import subprocess
    import sys

    from fake_devices import fake_devices_env

    child = subprocess.run(
        [sys.executable, "-c", _EXPERT_PARALLEL_CHILD],
        env=fake_devices_env(8),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    spread, skewed = (eval(line[3:]) for line in child.stdout.splitlines() if line.startswith("OK"))
    # of 32 tokens x top-2: the spread router uses most experts, the skewed one sends every
    # token to expert 5 (one device's expert computes 32 rows, its neighbours' a few)
    assert sum(c > 0 for c in spread) >= 6 and skewed[5] == 32, (spread, skewed)


@pytest.mark.parametrize("sizes", [[9, 0, 17, 1, 0, 14], [0, 41, 0, 0, 0, 0], [3, 3, 3, 3, 3, 20]])
def test_the_blocked_grouped_matmul_is_ragged_dot(sizes):
    """The CPU/GPU form of the grouped matmul equals ``jax.lax.ragged_dot_general`` (the TPU
    form) in values and gradients, for spread, skewed and lopsided groups, with 3 rows past
    the groups (assignments to experts on other devices) left at 0."""
    rng = np.random.default_rng(sum(sizes))
    lhs = jnp.asarray(rng.normal(size=(44, 20)), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=(6, 12, 20)), jnp.float32)
    sizes = jnp.asarray(sizes, jnp.int32)

    def ragged(lhs, rhs):
        return jax.lax.ragged_dot_general(lhs, rhs, sizes, moe._ROWS_BY_LAST)

    for block in (None, 8, 16):
        blocked = lambda lhs, rhs: moe.blocked_grouped_matmul(lhs, rhs, sizes, block)  # noqa: E731
        got = blocked(lhs, rhs)
        np.testing.assert_allclose(np.asarray(got), np.asarray(ragged(lhs, rhs)), atol=1e-5)
        assert np.all(np.asarray(got)[41:] == 0)
        for want, grad in zip(
            jax.grad(lambda *a: jnp.sum(jnp.sin(ragged(*a))), (0, 1))(lhs, rhs),
            jax.grad(lambda *a: jnp.sum(jnp.sin(blocked(*a))), (0, 1))(lhs, rhs),
        ):
            np.testing.assert_allclose(np.asarray(grad), np.asarray(want), atol=1e-5)


def test_the_blocked_experts_do_the_assignments_work_not_every_experts():
    """XLA:CPU expands ragged_dot into one full product per expert; the blocked form's
    temporaries at 64 experts, 8 per token, 256 tokens (float32) are a small part of it."""
    tokens, k, experts, hidden, inner = 256, 8, 64, 64, 32
    args = (
        jax.ShapeDtypeStruct((tokens * k, hidden), jnp.float32),
        jax.ShapeDtypeStruct((experts, inner, hidden), jnp.float32),
        jax.ShapeDtypeStruct((experts,), jnp.int32),
    )

    def temporaries(fn):
        return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes

    ragged = temporaries(lambda x, w, s: jax.lax.ragged_dot_general(x, w, s, moe._ROWS_BY_LAST))
    blocked = temporaries(moe.blocked_grouped_matmul)
    assert ragged >= experts * tokens * k * inner * 4  # the [E, T*k, I] product
    assert blocked < ragged / 8, (blocked, ragged)
