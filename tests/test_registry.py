"""The registry and AlgorithmConfig: validation errors, composition, and agreement with direct calls."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax.algorithms import advantages as adv
from agentrl_jax.algorithms import aggregation as agg
from agentrl_jax.algorithms import losses
from agentrl_jax.algorithms import registry as reg
from agentrl_jax.algorithms.registry import (
    AdvantageInputs,
    AlgorithmConfig,
    LossInputs,
    LossTermConfig,
    compute_advantages,
    compute_loss,
)


def test_builtins_are_registered():
    assert set(reg.ADVANTAGE_ESTIMATORS) >= {"grpo", "gigpo", "gae"}
    assert set(reg.LOSS_TERMS) >= {"policy_clip", "kl", "entropy", "value_clip"}
    assert reg.LOSS_TERMS["value_clip"].target == "critic"


def test_default_config_is_the_papers_grpo_and_is_hashable():
    c = AlgorithmConfig()
    assert c.advantage == "grpo" and dict(c.advantage_params) == {"eps": 1e-6, "ddof": 1, "scale_by_std": True}
    kl = c.loss_terms[1]
    assert (kl.name, kl.coef, dict(kl.params)["estimator"]) == ("kl", 0.001, "k3")
    assert dict(c.loss_terms[0].params) == {"clip_low": 0.2, "clip_high": 0.2, "dual_clip": None}
    assert hash(c) == hash(AlgorithmConfig()) and c == AlgorithmConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.advantage = "gae"


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(advantage="grp"), r"AlgorithmConfig\.advantage: unknown advantage estimator 'grp'; known: gae, gigpo, grpo"),
        (dict(advantage_params={"epsilon": 1.0}), r"AlgorithmConfig\.advantage_params: unknown parameter 'epsilon'"),
        (dict(advantage_params={"ddof": 2}), r"AlgorithmConfig\.advantage_params\['ddof'\]: must be 0 or 1"),
        (dict(advantage="gigpo", advantage_params={"gamma": 1.5}),
         r"AlgorithmConfig\.advantage_params\['gamma'\]: must be a number in \[0, 1\]"),
        (dict(advantage="gigpo", advantage_params={"omega": float("nan")}), r"\['omega'\]"),
        (dict(aggregation="mean"), r"AlgorithmConfig\.aggregation: .*unknown 'mean'"),
        (dict(aggregation="seq-mean-token-sum", aggregation_constant=0), r"AlgorithmConfig\.aggregation_constant"),
        (dict(loss_terms=(LossTermConfig("value_clip"),)), r"AlgorithmConfig\.loss_terms: needs at least one policy term"),
        (dict(loss_terms=(LossTermConfig("policy_clip"), LossTermConfig("policy_clip"))),
         r"AlgorithmConfig\.loss_terms\[1\]: term 'policy_clip' appears twice"),
        (dict(advantage="gae"), r"advantage 'gae' uses a critic, so a critic term is needed"),
        (dict(loss_terms="policy_clip"), r"AlgorithmConfig\.loss_terms: must be a sequence"),
        (dict(loss_terms=({"name": "kl", "coef": -1.0}, {"name": "policy_clip"})),
         r"AlgorithmConfig\.loss_terms\[0\]: LossTermConfig\(name='kl'\)\.coef: must be a finite number >= 0"),
        (dict(loss_terms=({"name": "policy_clip", "weight": 1.0},)), r"AlgorithmConfig\.loss_terms\[0\]: needs 'name'"),
    ],
)
def test_config_errors_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AlgorithmConfig(**kwargs)


@pytest.mark.parametrize(
    "args,message",
    [
        (("polcy_clip",), r"LossTermConfig\.name: unknown loss term 'polcy_clip'; known: entropy, kl, policy_clip"),
        (("policy_clip", float("inf")), r"LossTermConfig\(name='policy_clip'\)\.coef"),
        (("policy_clip", 1.0, {"clip_low": 1.2}), r"\.params\['clip_low'\]: must be a number in \[0, 1\), got 1\.2"),
        (("policy_clip", 1.0, {"dual_clip": 0.5}), r"\.params\['dual_clip'\]: must be None or a finite number > 1"),
        (("kl", 0.001, {"estimator": "k4"}), r"LossTermConfig\(name='kl'\)\.params\['estimator'\]: must be one of"),
        (("value_clip", 1.0, {"clip": 0.0}), r"\.params\['clip'\]"),
        (("entropy", 0.01, {"scale": 2}), r"LossTermConfig\(name='entropy'\)\.params: unknown parameter 'scale'; known: none"),
        (("kl", 0.001, "k3"), r"LossTermConfig\(name='kl'\)\.params: must be a mapping"),
    ],
)
def test_loss_term_errors_name_the_field(args, message):
    with pytest.raises(ValueError, match=message):
        LossTermConfig(*args)


def test_from_dict_yaml_style():
    c = AlgorithmConfig.from_dict({
        "advantage": "gae",
        "advantage_params": {"gamma": 1.0, "lam": 0.95},
        "loss_terms": [{"name": "policy_clip", "params": {"clip_high": 0.28, "dual_clip": 3.0}},
                       {"name": "kl", "coef": 0.001, "params": {"estimator": "k1"}},
                       {"name": "value_clip", "params": {"clip": 0.5}}],
    })
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
        loss_mask=loss_mask, token_turn_index=token_turn_index,
        rewards=jnp.array([1.0, 0.0, 1.0]), group_ids=jnp.array([0, 0, 1]),
        turn_mask=jnp.ones((3, 2), bool), anchor_keys=jnp.array([[1, 2], [1, 3], [1, 2]]),
    )


def test_compute_advantages_grpo_broadcasts_to_loss_tokens():
    t = _trajectories()
    out = compute_advantages(AlgorithmConfig(), AdvantageInputs(**{k: t[k] for k in ("loss_mask", "rewards", "group_ids")}))
    # group 0 R = [1, 0] -> +-0.70711; group 1 singleton -> 0; on loss tokens only
    a = float(np.sqrt(0.5))
    np.testing.assert_allclose(out.advantages, [[0, a, a, 0, a, 0], [0, -a, -a, 0, -a, 0], [0] * 6], atol=1e-5)
    assert out.returns is None


def test_compute_advantages_gigpo_matches_direct_call():
    t = _trajectories()
    config = AlgorithmConfig(advantage="gigpo", advantage_params={"gamma": 0.9})
    out = compute_advantages(config, AdvantageInputs(**t))
    step_rewards = adv.place_at_last_valid(t["rewards"], t["turn_mask"])
    per_turn = adv.gigpo_advantages(t["rewards"], step_rewards, t["group_ids"], t["anchor_keys"], t["turn_mask"],
                                    gamma=0.9)
    want = adv.broadcast_turns_to_tokens(per_turn, t["token_turn_index"]) * t["loss_mask"]
    np.testing.assert_allclose(out.advantages, want, atol=1e-6)
    # by hand: task 0, turn 0 shares key 1 with returns (0.9, 0) -> +-0.70711; turn 1 keys differ -> 0;
    # A^E = +-0.70711 -> trajectory 0 turn 0: 1.41421, turn 1: 0.70711
    np.testing.assert_allclose(out.advantages[0, 1:5], [2 * 0.70711, 2 * 0.70711, 0, 0.70711], atol=1e-4)


def test_compute_advantages_gae_whitens_advantages_not_returns():
    t = _trajectories()
    values = jnp.array([[0.0, 0.2, 0.4, 9.0, 0.6, 0.0]] * 3)
    token_rewards = adv.place_at_last_valid(t["rewards"], t["loss_mask"])
    config = AlgorithmConfig(advantage="gae", loss_terms=(LossTermConfig("policy_clip"), LossTermConfig("value_clip")))
    out = compute_advantages(config, AdvantageInputs(loss_mask=t["loss_mask"], token_rewards=token_rewards, values=values))
    raw, returns = adv.gae_advantages(token_rewards, values, t["loss_mask"])
    np.testing.assert_allclose(out.advantages, adv.masked_whiten(raw, t["loss_mask"]), atol=1e-6)
    np.testing.assert_allclose(out.returns, returns, atol=1e-6)
    # gamma = lam = 1: returns are the outcome reward on every response token
    np.testing.assert_allclose(out.returns[0], [0, 1, 1, 0, 1, 0], atol=1e-6)


def test_missing_inputs_are_named():
    t = _trajectories()
    with pytest.raises(ValueError, match=r"advantage estimator 'gigpo' needs AdvantageInputs\.anchor_keys"):
        compute_advantages(AlgorithmConfig(advantage="gigpo"),
                           AdvantageInputs(**{k: v for k, v in t.items() if k != "anchor_keys"}))
    with pytest.raises(ValueError, match=r"loss term 'kl' needs LossInputs\.ref_logprobs"):
        compute_loss(AlgorithmConfig(), LossInputs(loss_mask=jnp.ones((1, 2)), logprobs=jnp.zeros((1, 2)),
                                                   old_logprobs=jnp.zeros((1, 2)), advantages=jnp.ones((1, 2))))


# ------------------------------------------------------------------------- compute_loss


def _loss_inputs():
    rng = np.random.default_rng(0)
    f = lambda: jnp.asarray(rng.normal(size=(4, 5)), jnp.float32)  # noqa: E731
    mask = jnp.asarray(rng.random((4, 5)) > 0.3, jnp.float32)
    return LossInputs(loss_mask=mask, logprobs=f() - 1, old_logprobs=f() - 1, ref_logprobs=f() - 1,
                      advantages=f(), entropy=jnp.abs(f()), values=f(), old_values=f(), returns=f())


def test_compute_loss_is_the_weighted_sum_of_direct_losses():
    x = _loss_inputs()
    config = AlgorithmConfig(
        advantage="gae", aggregation="seq-mean-token-mean",
        loss_terms=(LossTermConfig("policy_clip", 1.0, {"clip_high": 0.28}), LossTermConfig("kl", 0.001),
                    LossTermConfig("entropy", 0.01), LossTermConfig("value_clip", 0.5)),
    )
    total, parts = compute_loss(config, x)
    mode = dict(mode="seq-mean-token-mean")
    pol = losses.policy_loss(x.logprobs, x.old_logprobs, x.advantages, x.loss_mask, clip_high=0.28, **mode)
    kl = losses.kl_loss(x.logprobs, x.ref_logprobs, x.loss_mask, **mode)
    ent = losses.entropy_loss(x.entropy, x.loss_mask, **mode)
    assert set(parts) == {"policy_clip", "kl", "entropy"}  # the critic term is not in the policy loss
    for got, want in ((parts["policy_clip"], pol), (parts["kl"], kl), (parts["entropy"], ent)):
        np.testing.assert_allclose(got.total, want.total, rtol=1e-6)
        np.testing.assert_allclose(got.denom, want.denom)
    np.testing.assert_allclose(total.total, pol.total + 0.001 * kl.total + 0.01 * ent.total, rtol=1e-6)
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
        @reg.register_loss_term(name, required=("advantages",),
                                params={"scale": reg.Param(1.0, lambda v: isinstance(v, float) and v > 0, "a float > 0")})
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
