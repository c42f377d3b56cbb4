"""The registry and AlgorithmConfig: validation errors, composition, and agreement with direct
calls."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax.algorithms import advantages as adv
from agentrl_jax.algorithms import aggregation as agg
from agentrl_jax.algorithms import losses
from agentrl_jax.algorithms import registry as reg
from agentrl_jax.algorithms.algorithm_config import AlgorithmConfig, LossTermConfig
from agentrl_jax.algorithms.compute import (
    compute_advantages,
    compute_loss,
    compute_loss_with_metrics,
)
from agentrl_jax.algorithms.registry import AdvantageInputs, LossInputs


def test_builtins_are_registered():
    assert set(reg.ADVANTAGE_ESTIMATORS) >= {"grpo", "gigpo", "gae"}
    assert set(reg.LOSS_TERMS) >= {"policy_clip", "kl", "entropy", "value_clip"}
    assert reg.LOSS_TERMS["value_clip"].target == "critic"


def test_default_config_is_the_papers_grpo_and_is_hashable():
    c = AlgorithmConfig()
    assert c.advantage == "grpo" and dict(c.advantage_params) == {
        "eps": 1e-6,
        "ddof": 1,
        "scale_by_std": True,
    }
    kl = c.loss_terms[1]
    assert (kl.name, kl.coef, dict(kl.params)["estimator"]) == ("kl", 0.001, "k3")
    assert dict(c.loss_terms[0].params) == {"clip_low": 0.2, "clip_high": 0.2, "dual_clip": None}
    assert hash(c) == hash(AlgorithmConfig()) and c == AlgorithmConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.advantage = "gae"


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            dict(advantage="grp"),
            r"AlgorithmConfig\.advantage: unknown advantage estimator 'grp'; "
            r"known: dr_grpo, gae, gigpo, grpo, rloo",
        ),
        (
            dict(advantage_params={"epsilon": 1.0}),
            r"AlgorithmConfig\.advantage_params: unknown parameter 'epsilon'",
        ),
        (
            dict(advantage_params={"ddof": 2}),
            r"AlgorithmConfig\.advantage_params\['ddof'\]: must be one of \(0, 1\)",
        ),
        (
            dict(advantage="gigpo", advantage_params={"gamma": 1.5}),
            r"AlgorithmConfig\.advantage_params\['gamma'\]: must be a number in \[0, 1\]",
        ),
        (dict(advantage="gigpo", advantage_params={"omega": float("nan")}), r"\['omega'\]"),
        (dict(aggregation="mean"), r"AlgorithmConfig\.aggregation: .*unknown 'mean'"),
        (
            dict(aggregation="seq-mean-token-sum", aggregation_constant=0),
            r"AlgorithmConfig\.aggregation_constant",
        ),
        (
            dict(loss_terms=(LossTermConfig("value_clip"),)),
            r"AlgorithmConfig\.loss_terms: needs at least one policy term",
        ),
        (
            dict(loss_terms=(LossTermConfig("policy_clip"), LossTermConfig("policy_clip"))),
            r"AlgorithmConfig\.loss_terms\[1\]: term 'policy_clip' appears twice",
        ),
        (dict(advantage="gae"), r"advantage 'gae' uses a critic, so a critic term is needed"),
        (dict(loss_terms="policy_clip"), r"AlgorithmConfig\.loss_terms: must be a sequence"),
        (
            dict(loss_terms=({"name": "kl", "coef": -1.0}, {"name": "policy_clip"})),
            r"AlgorithmConfig\.loss_terms\[0\]: LossTermConfig\(name='kl'\)\.coef: "
            r"must be a number in \[0, 1e\+06\], got -1\.0",
        ),
        (
            dict(loss_terms=({"name": "policy_clip", "weight": 1.0},)),
            r"AlgorithmConfig\.loss_terms\[0\]: needs 'name'",
        ),
    ],
)
def test_config_errors_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AlgorithmConfig(**kwargs)


@pytest.mark.parametrize(
    "args,message",
    [
        # Other test modules register terms of their own in the same process: any may be listed.
        (
            ("polcy_clip",),
            r"LossTermConfig\.name: unknown loss term 'polcy_clip'; "
            r"known: (.+, )?entropy, (.+, )?gspo_clip, kl, policy_clip\b",
        ),
        (("policy_clip", float("inf")), r"LossTermConfig\(name='policy_clip'\)\.coef"),
        (
            ("policy_clip", 1.0, {"clip_low": 1.2}),
            r"\.params\['clip_low'\]: must be a number in \[0, 1\), got 1\.2",
        ),
        (
            ("policy_clip", 1.0, {"dual_clip": 0.5}),
            r"\.params\['dual_clip'\]: must be null or a finite number > 1",
        ),
        (
            ("kl", 0.001, {"estimator": "k4"}),
            r"LossTermConfig\(name='kl'\)\.params\['estimator'\]: must be one of",
        ),
        (("value_clip", 1.0, {"clip": 0.0}), r"\.params\['clip'\]"),
        (
            ("entropy", 0.01, {"scale": 2}),
            r"LossTermConfig\(name='entropy'\)\.params: unknown parameter 'scale'; known: none",
        ),
        (("kl", 0.001, "k3"), r"LossTermConfig\(name='kl'\)\.params: must be a mapping"),
    ],
)
def test_loss_term_errors_name_the_field(args, message):
    with pytest.raises(ValueError, match=message):
        LossTermConfig(*args)


def test_from_dict_yaml_style():
    c = AlgorithmConfig.from_dict(
        {
            "advantage": "gae",
            "advantage_params": {"gamma": 1.0, "lam": 0.95},
            "loss_terms": [
                {"name": "policy_clip", "params": {"clip_high": 0.28, "dual_clip": 3.0}},
                {"name": "kl", "coef": 0.001, "params": {"estimator": "k1"}},
                {"name": "value_clip", "params": {"clip": 0.5}},
            ],
        }
    )
    assert c.uses_critic and [t.name for t in c.terms_for("critic")] == ["value_clip"]
    assert dict(c.terms_for("policy")[0].params)["dual_clip"] == 3.0
    with pytest.raises(ValueError, match="AlgorithmConfig: unknown field 'advantages'"):
        AlgorithmConfig.from_dict({"advantages": "grpo"})


def test_config_is_a_valid_static_jit_argument():
    calls = []

    def f(config, x):
        calls.append(config)
        return x * dict(config.loss_terms[0].params)["clip_low"]

    jf = jax.jit(f, static_argnums=0)
    jf(AlgorithmConfig(), jnp.ones(2))
    jf(AlgorithmConfig(), jnp.ones(2))  # equal config: cache hit
    assert len(calls) == 1


# ------------------------------------------------------------------------- compute_advantages


def _trajectories():
    """3 trajectories (tasks 0, 0, 1), 2 turns, 6 tokens: [prompt, t0, t0, obs, t1, pad]."""
    loss_mask = jnp.array([[0, 1, 1, 0, 1, 0]] * 3, jnp.float32)
    token_turn_index = jnp.array([[-1, 0, 0, -1, 1, -1]] * 3)
    return dict(
        loss_mask=loss_mask,
        token_turn_index=token_turn_index,
        rewards=jnp.array([1.0, 0.0, 1.0]),
        group_ids=jnp.array([0, 0, 1]),
        turn_mask=jnp.ones((3, 2), bool),
        anchor_keys=jnp.array([[1, 2], [1, 3], [1, 2]]),
    )


def test_compute_advantages_grpo_broadcasts_to_loss_tokens():
    t = _trajectories()
    out = compute_advantages(
        AlgorithmConfig(),
        AdvantageInputs(**{k: t[k] for k in ("loss_mask", "rewards", "group_ids")}),
    )
    # group 0 R = [1, 0] -> +-0.70711; group 1 singleton -> 0; on loss tokens only
    a = float(np.sqrt(0.5))
    np.testing.assert_allclose(
        out.advantages, [[0, a, a, 0, a, 0], [0, -a, -a, 0, -a, 0], [0] * 6], atol=1e-5
    )
    assert out.returns is None


def test_compute_advantages_gigpo_matches_direct_call():
    t = _trajectories()
    config = AlgorithmConfig(advantage="gigpo", advantage_params={"gamma": 0.9})
    out = compute_advantages(config, AdvantageInputs(**t))
    step_rewards = adv.place_at_last_valid(t["rewards"], t["turn_mask"])
    per_turn = adv.gigpo_advantages(
        t["rewards"], step_rewards, t["group_ids"], t["anchor_keys"], t["turn_mask"], gamma=0.9
    )
    want = adv.broadcast_turns_to_tokens(per_turn, t["token_turn_index"]) * t["loss_mask"]
    np.testing.assert_allclose(out.advantages, want, atol=1e-6)
    # by hand: task 0, turn 0 shares key 1 with returns (0.9, 0) -> +-0.70711;
    # turn 1 keys differ -> 0;
    # A^E = +-0.70711 -> trajectory 0 turn 0: 1.41421, turn 1: 0.70711
    np.testing.assert_allclose(
        out.advantages[0, 1:5], [2 * 0.70711, 2 * 0.70711, 0, 0.70711], atol=1e-4
    )


def test_compute_advantages_gae_whitens_advantages_not_returns():
    t = _trajectories()
    values = jnp.array([[0.0, 0.2, 0.4, 9.0, 0.6, 0.0]] * 3)
    token_rewards = adv.place_at_last_valid(t["rewards"], t["loss_mask"])
    config = AlgorithmConfig(
        advantage="gae", loss_terms=(LossTermConfig("policy_clip"), LossTermConfig("value_clip"))
    )
    out = compute_advantages(
        config,
        AdvantageInputs(loss_mask=t["loss_mask"], token_rewards=token_rewards, values=values),
    )
    raw, returns = adv.gae_advantages(token_rewards, values, t["loss_mask"])
    np.testing.assert_allclose(out.advantages, adv.masked_whiten(raw, t["loss_mask"]), atol=1e-6)
    np.testing.assert_allclose(out.returns, returns, atol=1e-6)
    # gamma = lam = 1: returns are the outcome reward on every response token
    np.testing.assert_allclose(out.returns[0], [0, 1, 1, 0, 1, 0], atol=1e-6)


def test_missing_inputs_are_named():
    t = _trajectories()
    with pytest.raises(
        ValueError, match=r"advantage estimator 'gigpo' needs AdvantageInputs\.anchor_keys"
    ):
        compute_advantages(
            AlgorithmConfig(advantage="gigpo"),
            AdvantageInputs(**{k: v for k, v in t.items() if k != "anchor_keys"}),
        )
    with pytest.raises(ValueError, match=r"loss term 'kl' needs LossInputs\.ref_logprobs"):
        compute_loss(
            AlgorithmConfig(),
            LossInputs(
                loss_mask=jnp.ones((1, 2)),
                logprobs=jnp.zeros((1, 2)),
                old_logprobs=jnp.zeros((1, 2)),
                advantages=jnp.ones((1, 2)),
            ),
        )


# ------------------------------------------------------------------------- compute_loss


def _loss_inputs():
    rng = np.random.default_rng(0)
    f = lambda: jnp.asarray(rng.normal(size=(4, 5)), jnp.float32)  # noqa: E731
    mask = jnp.asarray(rng.random((4, 5)) > 0.3, jnp.float32)
    return LossInputs(
        loss_mask=mask,
        logprobs=f() - 1,
        old_logprobs=f() - 1,
        ref_logprobs=f() - 1,
        advantages=f(),
        entropy=jnp.abs(f()),
        values=f(),
        old_values=f(),
        returns=f(),
    )


def test_compute_loss_is_the_weighted_sum_of_direct_losses():
    x = _loss_inputs()
    config = AlgorithmConfig(
        advantage="gae",
        aggregation="seq-mean-token-mean",
        loss_terms=(
            LossTermConfig("policy_clip", 1.0, {"clip_high": 0.28}),
            LossTermConfig("kl", 0.001),
            LossTermConfig("entropy", 0.01),
            LossTermConfig("value_clip", 0.5),
        ),
    )
    total, parts = compute_loss(config, x)
    mode = dict(mode="seq-mean-token-mean")
    pol = losses.policy_loss(
        x.logprobs, x.old_logprobs, x.advantages, x.loss_mask, clip_high=0.28, **mode
    )
    kl = losses.kl_loss(x.logprobs, x.ref_logprobs, x.loss_mask, **mode)
    ent = losses.entropy_loss(x.entropy, x.loss_mask, **mode)
    assert set(parts) == {
        "policy_clip",
        "kl",
        "entropy",
    }  # the critic term is not in the policy loss
    for got, want in ((parts["policy_clip"], pol), (parts["kl"], kl), (parts["entropy"], ent)):
        np.testing.assert_allclose(got.total, want.total, rtol=1e-6)
        np.testing.assert_allclose(got.denom, want.denom)
    np.testing.assert_allclose(
        total.total, pol.total + 0.001 * kl.total + 0.01 * ent.total, rtol=1e-6
    )
    critic_total, critic_parts = compute_loss(config, x, target="critic")
    vl = losses.value_loss(x.values, x.old_values, x.returns, x.loss_mask, **mode)
    np.testing.assert_allclose(critic_total.total, 0.5 * vl.total, rtol=1e-6)
    np.testing.assert_allclose(critic_parts["value_clip"].total, vl.total, rtol=1e-6)
    with pytest.raises(ValueError, match="no critic loss terms"):
        compute_loss(AlgorithmConfig(), x, target="critic")


def test_compute_loss_under_jit_and_grad():
    x = _loss_inputs()
    config = AlgorithmConfig()

    @jax.jit
    def loss(logp, inputs):
        total, _ = compute_loss(config, dataclasses.replace(inputs, logprobs=logp))
        return agg.mean(total)

    g = jax.grad(loss)(x.logprobs, x)
    assert g.shape == (4, 5) and bool(jnp.all(jnp.where(x.loss_mask == 0, g == 0, True)))


def test_custom_terms_can_be_registered():
    name = "test_squared_advantage"
    try:

        @reg.register_loss_term(
            name,
            required=("advantages",),
            params={
                "scale": reg.Param(1.0, lambda v: isinstance(v, float) and v > 0, "a float > 0")
            },
        )
        def _sq(inputs, *, scale):
            return scale * inputs.advantages**2

        config = AlgorithmConfig(loss_terms=(LossTermConfig(name, 2.0, {"scale": 0.5}),))
        x = LossInputs(loss_mask=jnp.ones((1, 2)), advantages=jnp.array([[1.0, 3.0]]))
        total, _ = compute_loss(config, x)
        assert float(agg.mean(total)) == pytest.approx(2.0 * 0.5 * (1 + 9) / 2)
        with pytest.raises(ValueError, match="already registered"):
            reg.register_loss_term(name, required=())(_sq)
        with pytest.raises(ValueError, match=r"\['scale'\]: must be a float > 0"):
            LossTermConfig(name, 1.0, {"scale": -1.0})
    finally:
        reg.LOSS_TERMS.pop(name, None)
    with pytest.raises(ValueError, match="are not LossInputs fields"):
        reg.register_loss_term("test_bad", required=("logits",))(lambda inputs: inputs)


# ------------------------------------------------------------------------- new entries


def test_new_entries_are_registered_with_their_inputs():
    assert reg.ADVANTAGE_ESTIMATORS["dr_grpo"].required == ("rewards", "group_ids")
    assert reg.ADVANTAGE_ESTIMATORS["rloo"].required == ("rewards", "group_ids")
    gspo = reg.LOSS_TERMS["gspo_clip"]
    assert (gspo.required, gspo.target) == (("logprobs", "old_logprobs", "advantages"), "policy")
    assert dict(LossTermConfig("gspo_clip").params) == {"clip_low": 3e-4, "clip_high": 4e-4}
    with pytest.raises(
        ValueError, match=r"LossTermConfig\(name='gspo_clip'\)\.params\['clip_low'\]: must be"
    ):
        LossTermConfig("gspo_clip", 1.0, {"clip_low": 1.5})
    with pytest.raises(ValueError, match=r"unknown parameter 'eps'; known: none"):
        AlgorithmConfig(advantage="rloo", advantage_params={"eps": 1e-6})


def test_compute_advantages_rloo_and_dr_grpo_hand_computed():
    t = _trajectories()
    inputs = AdvantageInputs(
        loss_mask=t["loss_mask"], rewards=jnp.array([1.0, 0.0, 1.0]), group_ids=t["group_ids"]
    )
    # group 0 R = [1, 0]: RLOO 1 - 0 = 1 and 0 - 1 = -1; Dr. GRPO: +-0.5 (no std); group 1 alone: 0
    tokens = np.array([0, 1, 1, 0, 1, 0], np.float32)
    rloo = compute_advantages(AlgorithmConfig(advantage="rloo"), inputs)
    np.testing.assert_allclose(rloo.advantages, [tokens, -tokens, 0 * tokens], atol=1e-6)
    dr = compute_advantages(AlgorithmConfig(advantage="dr_grpo"), inputs)
    np.testing.assert_allclose(dr.advantages, [0.5 * tokens, -0.5 * tokens, 0 * tokens], atol=1e-6)
    assert rloo.returns is None and dr.returns is None


def test_dr_grpo_combination_hand_computed():
    """Dr. GRPO: mean-only advantages and token sums divided by a constant (max length 4)."""
    config = AlgorithmConfig(
        advantage="dr_grpo",
        loss_terms=(LossTermConfig("policy_clip"),),
        aggregation="seq-mean-token-sum",
        aggregation_constant=4.0,
    )
    mask = jnp.array([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    a = compute_advantages(
        config,
        AdvantageInputs(loss_mask=mask, rewards=jnp.array([1.0, 0.0]), group_ids=jnp.array([3, 3])),
    ).advantages
    x = LossInputs(
        loss_mask=mask, logprobs=jnp.zeros((2, 4)), old_logprobs=jnp.zeros((2, 4)), advantages=a
    )
    total, _ = compute_loss(config, x)
    # ratio 1 -> per-token loss -A: row 0 -0.5 on 2 tokens (sum -1), row 1 +0.5 on 4 tokens (sum 2);
    # (-1 + 2) / 4 = 0.25 over 2 sequences -> 0.125 (token-mean would be 1/6, seq-mean-token-mean 0)
    assert (float(total.total), float(total.denom)) == pytest.approx((0.25, 2.0))
    assert float(agg.mean(total)) == pytest.approx(0.125)


def test_gspo_term_matches_the_loss_and_reports_sequence_metrics():
    old = jnp.full((2, 3), np.log(0.5))
    ratios = np.array([[2.0, 1.0, 1.0], [1.331, 1 / 1.1, 1.1]])
    logp = (old + jnp.log(jnp.asarray(ratios, jnp.float32))).at[0, 2].set(3.0)
    mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    x = LossInputs(
        loss_mask=mask,
        logprobs=logp,
        old_logprobs=old,
        advantages=jnp.array([[1.0] * 3, [-2.0] * 3]),
    )
    config = AlgorithmConfig(
        loss_terms=(LossTermConfig("gspo_clip", 1.0, {"clip_low": 0.2, "clip_high": 0.28}),),
        aggregation="seq-mean-token-mean",
    )
    result = compute_loss_with_metrics(config, x)
    # s_0 = sqrt(2) clipped to 1.28 (A = +1): -1.28; s_1 = 1.1 (A = -2): 2.2 -> (-1.28 + 2.2) / 2
    assert float(agg.mean(result.total)) == pytest.approx(0.46, abs=1e-6)
    m = {k: float(agg.mean(v)) for k, v in result.metrics.items()}
    assert m["gspo_clip/clip_fraction"] == pytest.approx(2 / 5)  # row 0's 2 tokens of 5
    assert m["gspo_clip/seq_clip_fraction"] == pytest.approx(1 / 2)  # 1 sequence of 2
    assert m["gspo_clip/seq_ratio"] == pytest.approx((np.sqrt(2) + 1.1) / 2, rel=1e-6)
    r = ratios[np.asarray(mask) > 0]
    assert m["gspo_clip/approx_kl"] == pytest.approx(np.mean((r - 1) - np.log(r)), rel=1e-5)


# ------------------------------------------------------------------------- metrics


def test_policy_clip_returns_clip_fraction_and_approx_kl():
    # ratios [1.5, 0.5, 1.5, 0.5, 1.25], A [1, 1, -1, -1, 2], clip [0.8, 1.28]:
    # clipped [1, 0, 0, 1, 0]; the last token is masked out -> clip fraction 2/4
    ratios = np.array([1.5, 0.5, 1.5, 0.5, 1.25])
    old = jnp.full((1, 5), np.log(0.5))
    x = LossInputs(
        loss_mask=jnp.array([[1.0, 1, 1, 1, 0]]),
        logprobs=old + jnp.log(jnp.asarray([ratios], jnp.float32)),
        old_logprobs=old,
        advantages=jnp.array([[1.0, 1.0, -1.0, -1.0, 2.0]]),
    )
    config = AlgorithmConfig(loss_terms=(LossTermConfig("policy_clip", 1.0, {"clip_high": 0.28}),))
    result = compute_loss_with_metrics(config, x)
    assert set(result.metrics) == {"policy_clip/clip_fraction", "policy_clip/approx_kl"}
    assert float(agg.mean(result.metrics["policy_clip/clip_fraction"])) == pytest.approx(0.5)
    kl = (0.5 - np.log(1.5)) + (
        -0.5 - np.log(0.5)
    )  # (r - 1) - log r for r = 1.5 and 0.5, each twice
    assert float(agg.mean(result.metrics["policy_clip/approx_kl"])) == pytest.approx(
        2 * kl / 4, rel=1e-5
    )
    # the old entry point is unchanged: (total, parts), the same numbers
    total, parts = compute_loss(config, x)
    assert float(total.total) == float(result.total.total) and set(parts) == set(result.parts) == {
        "policy_clip"
    }
    # loss by hand: [-1.28, -0.5, 1.5, 0.8] over 4 tokens
    assert float(agg.mean(total)) == pytest.approx((-1.28 - 0.5 + 1.5 + 0.8) / 4, abs=1e-6)
    # a LossResult unpacks into its three fields
    t, p, mets = result
    assert t is result.total and p is result.parts and mets is result.metrics


def _metric_term(name):
    @reg.register_loss_term(name, required=("advantages",))
    def _term(inputs):
        a = inputs.advantages
        return reg.TermOutput(
            a**2, {"tok": jnp.abs(a), "seq": jnp.sum(a, axis=-1), "scalar": jnp.max(a)}
        )

    return _term


def test_custom_term_metrics_token_sequence_and_scalar():
    name = "test_metric_term"
    try:
        _metric_term(name)
        config = AlgorithmConfig(loss_terms=(LossTermConfig(name, 3.0),))
        mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # row 2 is padding
        a = jnp.array([[1.0, -2.0, 9.0], [3.0, 9.0, 9.0], [9.0, 9.0, 9.0]])
        result = compute_loss_with_metrics(config, LossInputs(loss_mask=mask, advantages=a))
        m = result.metrics
        assert set(m) == {f"{name}/tok", f"{name}/seq", f"{name}/scalar"}
        assert tuple(map(float, m[f"{name}/tok"])) == (6.0, 3.0)  # |1| + |-2| + |3| over 3 tokens
        assert tuple(map(float, m[f"{name}/seq"])) == (
            29.0,
            2.0,
        )  # row sums 8 + 21, padded row 2 left out
        assert tuple(map(float, m[f"{name}/scalar"])) == (9.0, 1.0)  # a scalar counts once per part
        assert float(agg.mean(result.total)) == pytest.approx(3.0 * (1 + 4 + 9) / 3)
    finally:
        reg.LOSS_TERMS.pop(name, None)


def test_metrics_add_over_micro_batches_exactly():
    x = _loss_inputs()
    config = AlgorithmConfig(
        loss_terms=(
            LossTermConfig("policy_clip", 1.0, {"clip_high": 0.28}),
            LossTermConfig("gspo_clip", 0.5, {"clip_low": 0.1, "clip_high": 0.1}),
        )
    )
    full = compute_loss_with_metrics(config, x)
    parts = [
        compute_loss_with_metrics(config, jax.tree.map(lambda v, r=r: v[r], x))
        for r in (slice(0, 1), slice(1, 4))
    ]
    summed = jax.tree.map(lambda *v: sum(v), *[p.metrics for p in parts])
    assert set(full.metrics) == {
        "policy_clip/clip_fraction",
        "policy_clip/approx_kl",
        "gspo_clip/clip_fraction",
        "gspo_clip/seq_clip_fraction",
        "gspo_clip/approx_kl",
        "gspo_clip/seq_ratio",
    }
    for key, want in full.metrics.items():
        np.testing.assert_allclose(agg.mean(summed[key]), agg.mean(want), rtol=1e-6, err_msg=key)


def test_metrics_under_jit_do_not_change_the_gradient():
    x = _loss_inputs()
    config = AlgorithmConfig()

    @jax.jit
    def with_metrics(logp):
        result = compute_loss_with_metrics(config, dataclasses.replace(x, logprobs=logp))
        return result.total.total, result.metrics

    @jax.jit
    def plain(logp):
        return compute_loss(config, dataclasses.replace(x, logprobs=logp))[0].total

    g, metrics = jax.grad(with_metrics, has_aux=True)(x.logprobs)
    np.testing.assert_allclose(g, jax.grad(plain)(x.logprobs), atol=1e-7)
    assert 0.0 <= float(agg.mean(metrics["policy_clip/clip_fraction"])) <= 1.0
    assert float(agg.mean(metrics["policy_clip/approx_kl"])) >= 0.0


@pytest.mark.parametrize(
    "output,message",
    [
        (
            lambda a: (a, {"x/y": a}),
            r"loss term 'test_bad_metrics': metric names must be non-empty strings without '/'",
        ),
        (
            lambda a: (a, {"m": a[:, :1]}),
            r"loss term 'test_bad_metrics': 'm' metric: "
            r"expected shape \(1, 2\), \(1,\) or a scalar",
        ),
        (lambda a: (a, a), r"must return a per-token loss or \(loss, metrics mapping\)"),
        (lambda a: a[0], r"per-token loss must have the loss mask's shape \(1, 2\), got \(2,\)"),
    ],
)
def test_bad_term_outputs_name_the_term(output, message):
    name = "test_bad_metrics"
    try:
        reg.register_loss_term(name, required=("advantages",))(
            lambda inputs: output(inputs.advantages)
        )
        config = AlgorithmConfig(loss_terms=(LossTermConfig(name),))
        with pytest.raises(ValueError, match=message):
            compute_loss_with_metrics(
                config, LossInputs(loss_mask=jnp.ones((1, 2)), advantages=jnp.ones((1, 2)))
            )
    finally:
        reg.LOSS_TERMS.pop(name, None)


# ------------------------------------------------------------------------- declared inputs


def test_required_inputs_follow_the_configured_terms_whatever_their_names():
    assert AlgorithmConfig().required_loss_inputs("policy") == {
        "logprobs",
        "old_logprobs",
        "advantages",
        "ref_logprobs",
    }
    assert AlgorithmConfig().required_advantage_inputs == {"rewards", "group_ids"}
    gigpo = AlgorithmConfig(advantage="gigpo", loss_terms=(LossTermConfig("gspo_clip"),))
    assert gigpo.required_loss_inputs("policy") == {"logprobs", "old_logprobs", "advantages"}
    assert gigpo.required_advantage_inputs == {
        "rewards",
        "group_ids",
        "turn_mask",
        "anchor_keys",
        "token_turn_index",
    }
    assert gigpo.required_loss_inputs("critic") == frozenset()
    name = "test_needs_entropy_and_reference"
    try:

        @reg.register_loss_term(name, required=("entropy", "ref_logprobs"))
        def _t(inputs):
            return inputs.ref_logprobs - inputs.entropy

        config = AlgorithmConfig(
            loss_terms=(LossTermConfig("policy_clip"), LossTermConfig(name, 0.1))
        )
        assert config.required_loss_inputs("policy") == {
            "logprobs",
            "old_logprobs",
            "advantages",
            "entropy",
            "ref_logprobs",
        }
    finally:
        reg.LOSS_TERMS.pop(name, None)
    ppo = AlgorithmConfig(
        advantage="gae", loss_terms=(LossTermConfig("policy_clip"), LossTermConfig("value_clip"))
    )
    assert ppo.required_loss_inputs("critic") == {"values", "old_values", "returns"}
