"""Losses and aggregation against hand-computed values; micro-batch and multi-device exactness."""

import functools
import math
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fake_devices import fake_devices_env

from agentrl_jax.algorithms import aggregation as agg
from agentrl_jax.algorithms import losses

LN2 = math.log(2.0)


def _logs(ratios):
    """(logprobs, old_logprobs) whose ratio pi / pi_old is ``ratios``, with old = log 0.5."""
    old = jnp.full(len(ratios), math.log(0.5))
    return old + jnp.log(jnp.asarray(ratios)), old


# ------------------------------------------------------------------------- policy


def test_clipped_surrogate_clip_higher_hand_computed():
    # clip_low = 0.2, clip_high = 0.28 -> clip range [0.8, 1.28]; l = max(-A r, -A clip(r))
    ratios = [1.5, 0.5, 1.5, 0.5, 1.25]
    advantages = jnp.array([1.0, 1.0, -1.0, -1.0, 2.0])
    logp, old = _logs(ratios)
    got = losses.clipped_surrogate(logp, old, advantages, clip_low=0.2, clip_high=0.28)
    want = [
        -1.28,  # A=+1, r=1.5: max(-1.5, -1.28)      -> clipped above
        -0.5,  # A=+1, r=0.5: max(-0.5, -0.8)       -> unclipped (pessimistic)
        1.5,  # A=-1, r=1.5: max(1.5, 1.28)        -> unclipped
        0.8,  # A=-1, r=0.5: max(0.5, 0.8)         -> clipped below
        -2.5,  # A=+2, r=1.25: inside [0.8, 1.28]   -> -2 * 1.25
    ]
    np.testing.assert_allclose(got, want, atol=1e-6)
    # symmetric 0.2 clips the last one: max(-2.5, -2 * 1.2) = -2.4
    sym = losses.clipped_surrogate(logp, old, advantages, clip_low=0.2, clip_high=0.2)
    np.testing.assert_allclose(sym[4], -2.4, atol=1e-6)
    # gradient w.r.t. logprobs: d(-A r)/dlogp = -A r where unclipped, 0 where clipped
    grad = jax.grad(
        lambda lp: jnp.sum(
            losses.clipped_surrogate(lp, old, advantages, clip_low=0.2, clip_high=0.28)
        )
    )(logp)
    np.testing.assert_allclose(grad, [0.0, -0.5, 1.5, 0.0, -2.5], atol=1e-6)
    frac = losses.clip_indicator(logp, old, advantages, clip_low=0.2, clip_high=0.28)
    np.testing.assert_array_equal(frac, [1, 0, 0, 1, 0])


def test_dual_clip_hand_computed():
    # dual_clip c = 3 caps the loss of A < 0 tokens at -A c = 3 * |A|.
    ratios = [4.0, 4.0, 2.0]
    advantages = jnp.array([-1.0, 1.0, -1.0])
    logp, old = _logs(ratios)
    plain = losses.clipped_surrogate(logp, old, advantages)
    dual = losses.clipped_surrogate(logp, old, advantages, dual_clip=3.0)
    # A=-1, r=4: max(4, 1.2) = 4 -> capped to 3;  A=+1, r=4: max(-4, -1.2) = -1.2 either way;
    # A=-1, r=2: max(2, 1.2) = 2 < 3 -> unchanged.
    np.testing.assert_allclose(plain, [4.0, -1.2, 2.0], atol=1e-5)
    np.testing.assert_allclose(dual, [3.0, -1.2, 2.0], atol=1e-5)
    grad = jax.grad(
        lambda lp: jnp.sum(losses.clipped_surrogate(lp, old, advantages, dual_clip=3.0))
    )(logp)
    np.testing.assert_allclose(grad, [0.0, 0.0, 2.0], atol=1e-5)  # capped token gets no gradient
    np.testing.assert_array_equal(
        losses.clip_indicator(logp, old, advantages, dual_clip=3.0), [1, 1, 0]
    )


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"clip_low": 1.0}, "clip_low"),
        ({"clip_high": -0.1}, "clip_high"),
        ({"dual_clip": 1.0}, "dual_clip"),
    ],
)
def test_policy_clip_arguments_are_validated(kwargs, field):
    with pytest.raises(ValueError, match=field):
        losses.clipped_surrogate(jnp.zeros(2), jnp.zeros(2), jnp.ones(2), **kwargs)


def test_approx_kl_hand_computed():
    # (r - 1) - log r: r = 2 -> 1 - ln 2 = 0.306853; r = 0.5 -> -0.5 + ln 2 = 0.193147; r = 1 -> 0
    logp, old = _logs([2.0, 0.5, 1.0])
    np.testing.assert_allclose(losses.approx_kl(logp, old), [1 - LN2, LN2 - 0.5, 0.0], atol=1e-6)


# ------------------------------------------------------------------------- GSPO


def _gspo_example():
    """Two sequences; masked positions hold garbage log-probs that must not matter.

    row 0: response tokens 0, 1 with ratios [2, 1] -> s_0 = sqrt(2) = 1.414214, A = +1;
    row 1: tokens 0, 1, 2 with ratios [1.331, 1/1.1, 1.1] -> s_1 = 1.331^(1/3) = 1.1, A = -2.
    """
    old = jnp.full((2, 3), math.log(0.5))
    ratios = jnp.array([[2.0, 1.0, 1.0], [1.331, 1 / 1.1, 1.1]])
    logp = (old + jnp.log(ratios)).at[0, 2].set(3.0)  # garbage on the masked position
    mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    advantages = jnp.array([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    return logp, old, advantages, mask


def test_gspo_hand_computed():
    logp, old, advantages, mask = _gspo_example()
    np.testing.assert_allclose(
        losses.sequence_log_ratio(logp, old, mask), [LN2 / 2, math.log(1.1)], atol=1e-6
    )
    clips = dict(clip_low=0.2, clip_high=0.28)
    got = losses.gspo_surrogate(logp, old, advantages, mask, **clips)
    # row 0: max(-1.414214, -clip(1.414214, 0.8, 1.28) = -1.28) = -1.28 (clipped, whole sequence)
    # row 1: 1.1 is inside [0.8, 1.28]: -(-2) * 1.1 = 2.2 on every token
    np.testing.assert_allclose(
        np.asarray(got) * np.asarray(mask), [[-1.28, -1.28, 0.0], [2.2, 2.2, 2.2]], atol=1e-6
    )
    np.testing.assert_array_equal(
        losses.gspo_clip_indicator(logp, old, advantages, mask, **clips) * mask,
        [[1, 1, 0], [0, 0, 0]],
    )
    # the paper's sequence mean: (-1.28 + 2.2) / 2 = 0.46
    part = losses.gspo_loss(logp, old, advantages, mask, **clips)
    assert float(part.total) == pytest.approx(0.92, abs=1e-6) and float(part.denom) == 2.0
    # gradient of that mean: row 0 clipped -> 0;
    # row 1: d/dlogp_t (1/2)(-A s_1) = (1/2) * 2 * 1.1 / 3
    grad = jax.grad(lambda lp: agg.mean(losses.gspo_loss(lp, old, advantages, mask, **clips)))(logp)
    np.testing.assert_allclose(grad, [[0.0, 0.0, 0.0], [1.1 / 3] * 3], atol=1e-6)
    # default clip range (3e-4, 4e-4): row 0 is clipped at 1 + 4e-4 -> -1.0004; row 1 (A < 0, s > 1)
    # keeps max(2.2, 2 * 1.0004) = 2.2: the pessimistic term is the unclipped one
    default = losses.gspo_surrogate(logp, old, advantages, mask)
    np.testing.assert_allclose(np.asarray(default)[:, 0], [-(1 + 4e-4), 2.2], atol=1e-6)


def _sequence_gspo_reference(logp, old, adv_seq, mask, clip_low, clip_high, weights):
    """Sequence-level GSPO written from the paper: s_i = exp(mean_t log r_it) differentiated
    whole."""
    m = mask
    s = jnp.exp(jnp.sum((logp - old) * m, -1) / jnp.sum(m, -1))
    seq_loss = jnp.maximum(-adv_seq * s, -adv_seq * jnp.clip(s, 1 - clip_low, 1 + clip_high))
    return jnp.sum(weights * seq_loss)


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"])
def test_gspo_gradient_equals_the_sequence_level_objective(mode):
    """With one advantage per sequence, GSPO-token's gradient is that of sequence-level GSPO."""
    rng = np.random.default_rng(3)
    n, length = 6, 7
    lengths = np.array([1, 7, 3, 5, 2, 6])
    mask = jnp.asarray((np.arange(length)[None] < lengths[:, None]).astype(np.float32))
    old = jnp.asarray(rng.normal(size=(n, length)) * 0.3 - 1.0, jnp.float32)
    logp = old + jnp.asarray(rng.normal(size=(n, length)) * 0.1, jnp.float32)
    adv_seq = jnp.asarray(rng.normal(size=n), jnp.float32)
    advantages = jnp.broadcast_to(adv_seq[:, None], (n, length))
    clips = dict(clip_low=0.05, clip_high=0.08)  # some sequences clipped, some not
    tokens = lengths.astype(np.float32)
    weights = {
        "seq-mean-token-mean": np.full(n, 1 / n),  # each sequence 1/G
        "token-mean": tokens / tokens.sum(),  # |y_i| identical token losses over all tokens
        "seq-mean-token-sum": tokens / 7.0 / n,
    }[mode]  # |y_i| / C per sequence, over G
    ours = lambda lp: agg.mean(
        losses.gspo_loss(lp, old, advantages, mask, mode=mode, norm_constant=7.0, **clips)
    )  # noqa: E731
    ref = lambda lp: _sequence_gspo_reference(
        lp, old, adv_seq, mask, weights=jnp.asarray(weights), **clips
    )  # noqa: E731
    np.testing.assert_allclose(ours(logp), ref(logp), rtol=1e-5)
    np.testing.assert_allclose(jax.grad(ours)(logp), jax.grad(ref)(logp), atol=1e-6)
    clipped = np.asarray(losses.gspo_clip_indicator(logp, old, advantages, mask, **clips))[:, 0]
    assert 0 < clipped.sum() < n


# ------------------------------------------------------------------------- KL


def test_kl_estimators_hand_computed():
    # token 0: pi = 0.5, pi_ref = 0.25 -> d = log(pi_ref / pi) = -ln 2
    #   k1 = ln 2 = 0.693147; k2 = (ln 2)^2 / 2 = 0.240227; k3 = 0.5 + ln 2 - 1 = 0.193147
    # token 1: pi = 0.25, pi_ref = 0.5 -> d = +ln 2
    #   k1 = -0.693147; k2 = 0.240227; k3 = 2 - ln 2 - 1 = 0.306853
    logp = jnp.log(jnp.array([0.5, 0.25]))
    ref = jnp.log(jnp.array([0.25, 0.5]))
    np.testing.assert_allclose(losses.kl_penalty(logp, ref, "k1"), [LN2, -LN2], atol=1e-6)
    np.testing.assert_allclose(
        losses.kl_penalty(logp, ref, "k2"), [LN2**2 / 2, LN2**2 / 2], atol=1e-6
    )
    np.testing.assert_allclose(losses.kl_penalty(logp, ref, "k3"), [LN2 - 0.5, 1 - LN2], atol=1e-6)
    # d k3 / d logp = 1 - exp(d): token 0 -> 1 - 0.5 = 0.5; token 1 -> 1 - 2 = -1
    grad = jax.grad(lambda lp: jnp.sum(losses.kl_penalty(lp, ref, "k3")))(logp)
    np.testing.assert_allclose(grad, [0.5, -1.0], atol=1e-6)


def test_k3_cap():
    # d = 5: exp(5) - 5 - 1 = 142.41 -> capped at 10 (and its gradient is 0); uncapped with None.
    logp, ref = jnp.array([0.0]), jnp.array([5.0])
    np.testing.assert_allclose(losses.kl_penalty(logp, ref, "k3"), [10.0])
    np.testing.assert_allclose(
        losses.kl_penalty(logp, ref, "k3", k3_max=None), [math.exp(5) - 6], rtol=1e-6
    )
    assert jax.grad(lambda lp: losses.kl_penalty(lp, ref, "k3")[0])(logp)[0] == 0.0
    with pytest.raises(ValueError, match="estimator"):
        losses.kl_penalty(logp, ref, "k4")


def test_k1_k3_are_unbiased_and_k2_is_not():
    # Exact expectation over a small vocabulary (weights pi): E_pi[k1] = E_pi[k3] = KL(pi || ref).
    pi = jnp.array([0.5, 0.3, 0.2])
    ref = jnp.array([0.2, 0.2, 0.6])
    kl = float(jnp.sum(pi * jnp.log(pi / ref)))
    expect = {
        e: float(jnp.sum(pi * losses.kl_penalty(jnp.log(pi), jnp.log(ref), e)))
        for e in ("k1", "k2", "k3")
    }
    assert expect["k1"] == pytest.approx(kl, abs=1e-6)
    assert expect["k3"] == pytest.approx(kl, abs=1e-6)
    assert abs(expect["k2"] - kl) > 1e-3


# ------------------------------------------------------------------------- entropy, logits


def test_logprobs_and_entropy_from_logits_match_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 5)).astype(np.float32)
    tokens = rng.integers(0, 5, size=(2, 3))
    log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want_lp = np.take_along_axis(log_softmax, tokens[..., None], -1)[..., 0]
    want_h = -(np.exp(log_softmax) * log_softmax).sum(-1)
    np.testing.assert_allclose(
        losses.logprobs_from_logits(jnp.asarray(logits), jnp.asarray(tokens)), want_lp, atol=1e-6
    )
    np.testing.assert_allclose(losses.entropy_from_logits(jnp.asarray(logits)), want_h, atol=1e-6)
    # uniform over 4 -> ln 4
    np.testing.assert_allclose(
        losses.entropy_from_logits(jnp.zeros((1, 1, 4))), [[math.log(4)]], atol=1e-6
    )


def test_entropy_bonus_sign():
    # entropies [1, 2] on both tokens -> loss -1.5 (token-mean): minimising raises entropy.
    s = losses.entropy_loss(jnp.array([[1.0, 2.0]]), jnp.ones((1, 2)))
    assert float(agg.mean(s)) == pytest.approx(-1.5)


# ------------------------------------------------------------------------- value


def test_clipped_value_loss_hand_computed():
    # old value 1.0, clip 0.5 -> clipped prediction in [0.5, 1.5]; l = 0.5 max((V-R)^2, (Vc-R)^2)
    values = jnp.array([1.2, 2.0, 0.0, 0.4])
    returns = jnp.array([2.0, 2.0, 2.0, 0.0])
    old = jnp.ones(4)
    got = losses.clipped_value_loss(values, old, returns, clip=0.5)
    want = [
        0.32,  # V=1.2 inside the range: 0.5 * 0.8^2
        0.125,  # V=2.0 hits R but is clipped to 1.5: 0.5 * max(0, 0.25)
        2.0,  # V=0.0: 0.5 * max(4, (0.5-2)^2 = 2.25)
        0.125,  # V=0.4, R=0: 0.5 * max(0.16, 0.5^2)
    ]
    np.testing.assert_allclose(got, want, atol=1e-6)
    # gradient: V - R where the unclipped branch wins, 0 where the clipped one does
    grad = jax.grad(lambda v: jnp.sum(losses.clipped_value_loss(v, old, returns, clip=0.5)))(values)
    np.testing.assert_allclose(grad, [-0.8, 0.0, -2.0, 0.0], atol=1e-6)


# ------------------------------------------------------------------------- aggregation


def test_aggregation_hand_computed():
    per_token = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = jnp.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # row 2 is padding
    tm = agg.aggregate(per_token, mask, "token-mean")
    assert (float(tm.total), float(tm.denom)) == (7.0, 3.0)  # (1 + 2 + 4) over 3 tokens
    smtm = agg.aggregate(per_token, mask, "seq-mean-token-mean")
    assert (float(smtm.total), float(smtm.denom)) == (5.5, 2.0)  # means 1.5 and 4, over 2 sequences
    smts = agg.aggregate(per_token, mask, "seq-mean-token-sum", norm_constant=4.0)
    assert (float(smts.total), float(smts.denom)) == (1.75, 2.0)  # (3 + 4) / 4, over 2 sequences
    assert float(agg.mean(smts)) == pytest.approx(0.875)
    assert float(agg.mean(agg.aggregate(per_token, jnp.zeros((3, 3)), "token-mean"))) == 0.0
    with pytest.raises(ValueError, match="aggregation mode"):
        agg.aggregate(per_token, mask, "token-sum")
    with pytest.raises(ValueError, match="norm_constant"):
        agg.aggregate(per_token, mask, "seq-mean-token-sum", norm_constant=0.0)


def _batch(seed=0, n=8, length=6):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, length + 1, size=n)
    lengths[3] = 0  # an empty (padded) row
    start = rng.integers(0, 2, size=n)
    pos = np.arange(length)[None, :]
    mask = ((pos >= start[:, None]) & (pos < start[:, None] + lengths[:, None])).astype(np.float32)
    f = lambda *s: jnp.asarray(rng.normal(size=s).astype(np.float32))  # noqa: E731
    return dict(
        logp=0.3 * f(n, length) - 1.0,
        old=0.3 * f(n, length) - 1.0,
        ref=0.3 * f(n, length) - 1.0,
        adv=f(n, length),
        mask=jnp.asarray(mask),
    )


@functools.partial(jax.jit, static_argnames="mode")
def _part_total(logp, old, adv, ref, mask, mode):
    """Policy + 0.001 KL loss of one micro-batch as a LossSum (jitted: one compile per shape)."""
    pol = losses.policy_loss(
        logp, old, adv, mask, clip_high=0.28, dual_clip=3.0, mode=mode, norm_constant=6.0
    )
    kl = losses.kl_loss(logp, ref, mask, mode=mode, norm_constant=6.0)
    return agg.LossSum(pol.total + 0.001 * kl.total, pol.denom)


def _part(logp, b, rows, mode):
    s = slice(*rows)
    return _part_total(logp, b["old"][s], b["adv"][s], b["ref"][s], b["mask"][s], mode)


@pytest.mark.parametrize("mode", agg.AGGREGATION_MODES)
def test_micro_batches_give_the_full_batch_mean_and_gradient(mode):
    b = _batch()
    full_loss = lambda lp: agg.mean(_part(lp, b, (0, 8), mode))  # noqa: E731
    full_value, full_grad = jax.value_and_grad(full_loss)(b["logp"])
    for splits in ([(0, 2), (2, 4), (4, 6), (6, 8)], [(0, 3), (3, 4), (4, 8)]):
        parts = [_part(b["logp"][slice(*r)], b, r, mode) for r in splits]
        combined = agg.combine(parts)
        np.testing.assert_allclose(agg.mean(combined), full_value, rtol=1e-6)
        # accumulate gradients of each part's unreduced total; divide once by the global denominator
        grads = [
            jax.grad(lambda lp, r=r: _part(lp, b, r, mode).total)(b["logp"][slice(*r)])
            for r in splits
        ]
        micro_grad = jnp.concatenate(grads) / combined.denom
        np.testing.assert_allclose(micro_grad, full_grad, atol=1e-6)


def test_multi_device_psum_gives_the_full_batch_gradient():
    """8 fake CPU devices (fresh process: the device count is fixed at JAX start-up)."""
    script = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import PartitionSpec as P
        from agentrl_jax.algorithms import aggregation as agg, losses
        assert jax.device_count() == 8, jax.devices()
        rng = np.random.default_rng(0)
        n, L = 16, 5
        mask = jnp.asarray(rng.random((n, L)) > 0.4, jnp.float32).at[5].set(0.0)
        logp, old, adv = (jnp.asarray(rng.normal(size=(n, L)), jnp.float32) for _ in range(3))
        mesh = jax.make_mesh((8,), ("data",))
        shard = lambda x: jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data")))
        logp_d, old_d, adv_d, mask_d = (shard(x) for x in (logp, old, adv, mask))
        for mode in agg.AGGREGATION_MODES:
            def local(lp, o, a, m):
                s = losses.policy_loss(lp, o, a, m, clip_high=0.28, mode=mode, norm_constant=5.0)
                return agg.mean(agg.psum(s, "data"))
            sharded = jax.shard_map(local, mesh=mesh, in_specs=(P("data"),) * 4, out_specs=P())
            full = lambda lp: agg.mean(losses.policy_loss(
                lp, old, adv, mask, clip_high=0.28, mode=mode, norm_constant=5.0))
            v_dev, g_dev = jax.jit(
                jax.value_and_grad(lambda lp: sharded(lp, old_d, adv_d, mask_d)))(logp_d)
            v_full, g_full = jax.value_and_grad(full)(logp)
            np.testing.assert_allclose(v_dev, v_full, rtol=1e-6)
            np.testing.assert_allclose(g_dev, g_full, atol=1e-6)
        print("OK")
    """)
    env = fake_devices_env(8)
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]
