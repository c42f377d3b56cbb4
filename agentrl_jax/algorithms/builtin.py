"""The built-in advantage estimators and loss terms, registered (:mod:`agentrl_jax.algorithms.
registry`) when :mod:`agentrl_jax.algorithms` is imported.

* Advantage estimators: ``"grpo"``, ``"dr_grpo"``, ``"rloo"``, ``"gigpo"``, ``"gae"``.
* Loss terms of the ``"policy"``: ``"policy_clip"``, ``"policy_clip_tis"``, ``"gspo_clip"``,
  ``"kl"``, ``"entropy"``, and for an MoE model the router's ``"router_balance"`` and
  ``"router_z"``; of the ``"critic"``: ``"value_clip"``.

Each hyper-parameter is checked by one of :mod:`agentrl_jax.validation`'s checks
(:meth:`~agentrl_jax.algorithms.registry.Param.of`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from agentrl_jax.algorithms import advantages as adv
from agentrl_jax.algorithms import losses, router
from agentrl_jax.algorithms.registry import (
    AdvantageInputs,
    AdvantageOutput,
    LossInputs,
    Param,
    TermOutput,
    register_advantage,
    register_loss_term,
)
from agentrl_jax.validation import BOOL, one_of, optional, real

_EPS = Param.of(1e-6, real(0, lo_open=True))
_DDOF = Param.of(1, one_of((0, 1)))
_FLAG_TRUE = Param.of(True, BOOL)


@register_advantage(
    "grpo",
    required=("rewards", "group_ids"),
    params={"eps": _EPS, "ddof": _DDOF, "scale_by_std": _FLAG_TRUE},
)
def _grpo(inputs: AdvantageInputs, *, eps, ddof, scale_by_std) -> AdvantageOutput:
    a = adv.grpo_advantages(
        inputs.rewards,
        inputs.group_ids,
        inputs.traj_mask,
        eps=eps,
        ddof=ddof,
        scale_by_std=scale_by_std,
    )
    return AdvantageOutput(adv.broadcast_trajectories_to_tokens(a, inputs.loss_mask), None)


@register_advantage("dr_grpo", required=("rewards", "group_ids"))
def _dr_grpo(inputs: AdvantageInputs) -> AdvantageOutput:
    """Dr. GRPO: ``A_i = R_i - mean_g R`` (no std),
    :func:`~agentrl_jax.algorithms.advantages.dr_grpo_advantages`."""
    a = adv.dr_grpo_advantages(inputs.rewards, inputs.group_ids, inputs.traj_mask)
    return AdvantageOutput(adv.broadcast_trajectories_to_tokens(a, inputs.loss_mask), None)


@register_advantage("rloo", required=("rewards", "group_ids"))
def _rloo(inputs: AdvantageInputs) -> AdvantageOutput:
    """RLOO: ``A_i = R_i - mean_{j != i} R_j``,
    :func:`~agentrl_jax.algorithms.advantages.rloo_advantages`."""
    a = adv.rloo_advantages(inputs.rewards, inputs.group_ids, inputs.traj_mask)
    return AdvantageOutput(adv.broadcast_trajectories_to_tokens(a, inputs.loss_mask), None)


@register_advantage(
    "gigpo",
    required=("rewards", "group_ids", "turn_mask", "anchor_keys", "token_turn_index"),
    params={
        "omega": Param.of(1.0, real(0)),
        "gamma": Param.of(0.95, real(0, 1)),
        "eps": _EPS,
        "ddof": _DDOF,
        "episode_scale_by_std": _FLAG_TRUE,
        "step_scale_by_std": _FLAG_TRUE,
    },
)
def _gigpo(
    inputs: AdvantageInputs, *, omega, gamma, eps, ddof, episode_scale_by_std, step_scale_by_std
):
    """Step rewards default to the outcome reward on each trajectory's last real turn."""
    step_rewards = inputs.step_rewards
    if step_rewards is None:
        step_rewards = adv.place_at_last_valid(inputs.rewards, inputs.turn_mask)
    per_turn = adv.gigpo_advantages(
        inputs.rewards,
        step_rewards,
        inputs.group_ids,
        inputs.anchor_keys,
        inputs.turn_mask,
        inputs.traj_mask,
        omega=omega,
        gamma=gamma,
        eps=eps,
        ddof=ddof,
        episode_scale_by_std=episode_scale_by_std,
        step_scale_by_std=step_scale_by_std,
    )
    per_token = adv.broadcast_turns_to_tokens(per_turn, inputs.token_turn_index)
    return AdvantageOutput(per_token * inputs.loss_mask.astype(per_token.dtype), None)


@register_advantage(
    "gae",
    required=("token_rewards", "values"),
    uses_critic=True,
    params={
        "gamma": Param.of(1.0, real(0, 1)),
        "lam": Param.of(1.0, real(0, 1)),
        "whiten": _FLAG_TRUE,
    },
)
def _gae(inputs: AdvantageInputs, *, gamma, lam, whiten) -> AdvantageOutput:
    """Whitening (verl's default for GAE) applies to advantages only; returns stay raw targets."""
    a, returns = adv.gae_advantages(
        inputs.token_rewards, inputs.values, inputs.loss_mask, gamma=gamma, lam=lam
    )
    if whiten:
        a = adv.masked_whiten(a, inputs.loss_mask)
    return AdvantageOutput(a, returns)


@register_loss_term(
    "policy_clip",
    required=("logprobs", "old_logprobs", "advantages"),
    params={
        "clip_low": Param.of(0.2, real(0, 1, hi_open=True)),
        "clip_high": Param.of(0.2, real(0)),
        "dual_clip": Param.of(None, optional(real(1, lo_open=True))),
    },
)
def _policy_clip(inputs: LossInputs, *, clip_low, clip_high, dual_clip) -> TermOutput:
    """PPO clip (:func:`~agentrl_jax.algorithms.losses.clipped_surrogate`); DAPO clip-higher with
    clip_high > clip_low.

    Metrics: ``clip_fraction`` (share of loss tokens whose gradient the clip zeroes) and
    ``approx_kl`` (token mean of ``(r - 1) - log r``).
    """
    clips = dict(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
    loss = losses.clipped_surrogate(
        inputs.logprobs, inputs.old_logprobs, inputs.advantages, **clips
    )
    logprobs = jax.lax.stop_gradient(inputs.logprobs)
    return TermOutput(
        loss,
        {
            "clip_fraction": losses.clip_indicator(
                logprobs, inputs.old_logprobs, inputs.advantages, **clips
            ),
            "approx_kl": losses.approx_kl(logprobs, inputs.old_logprobs),
        },
    )


@register_loss_term(
    "policy_clip_tis",
    required=("logprobs", "old_logprobs", "advantages", "sampler_logprobs"),
    params={
        "clip_low": Param.of(0.2, real(0, 1, hi_open=True)),
        "clip_high": Param.of(0.2, real(0)),
        "dual_clip": Param.of(None, optional(real(1, lo_open=True))),
        "cap": Param.of(2.0, real(0, lo_open=True)),
    },
)
def _policy_clip_tis(inputs: LossInputs, *, clip_low, clip_high, dual_clip, cap) -> TermOutput:
    """``policy_clip`` with truncated importance sampling: each token's loss times
    ``w = min(pi_old / mu, cap)`` (:func:`~agentrl_jax.algorithms.losses.tis_weight`), ``mu``
    the sampler's recorded probability (``sampler_logprobs``). The choice for a trainer that
    scores under the model's distribution (``TrainConfig.scoring="model"``) while the rollout
    samples from a tempered or truncated one.

    Metrics: ``policy_clip``'s, ``tis_weight`` (token mean of ``w``) and ``tis_capped`` (share
    of loss tokens whose ratio exceeds ``cap``).
    """
    plain = _policy_clip(inputs, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
    weight = losses.tis_weight(inputs.old_logprobs, inputs.sampler_logprobs, cap)
    return TermOutput(
        plain.loss * weight,
        {**plain.metrics, "tis_weight": weight, "tis_capped": (weight >= cap).astype(jnp.float32)},
    )


@register_loss_term(
    "gspo_clip",
    required=("logprobs", "old_logprobs", "advantages"),
    whole_rows=True,
    params={
        "clip_low": Param.of(3e-4, real(0, 1, hi_open=True)),
        "clip_high": Param.of(4e-4, real(0)),
    },
)
def _gspo_clip(inputs: LossInputs, *, clip_low, clip_high) -> TermOutput:
    """GSPO (:func:`~agentrl_jax.algorithms.losses.gspo_surrogate`): sequence-level ratio, clipped
    per sequence.

    Metrics: ``clip_fraction`` (share of loss tokens whose gradient the clip zeroes: all the
    tokens of a clipped sequence), ``seq_clip_fraction`` (share of sequences with a clipped
    token), ``approx_kl`` (from the token ratios, as for ``policy_clip``) and ``seq_ratio``
    (mean over sequences of ``s_i``).
    """
    mask = inputs.loss_mask
    loss = losses.gspo_surrogate(
        inputs.logprobs,
        inputs.old_logprobs,
        inputs.advantages,
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
    )
    logprobs = jax.lax.stop_gradient(inputs.logprobs)
    clipped = losses.gspo_clip_indicator(
        logprobs,
        inputs.old_logprobs,
        inputs.advantages,
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
    )
    weights = mask.astype(clipped.dtype)
    return TermOutput(
        loss,
        {
            "clip_fraction": clipped,
            "seq_clip_fraction": jnp.max(clipped * weights, axis=-1),
            "approx_kl": losses.approx_kl(logprobs, inputs.old_logprobs),
            "seq_ratio": jnp.exp(
                jnp.clip(
                    losses.sequence_log_ratio(logprobs, inputs.old_logprobs, mask),
                    -losses.LOG_RATIO_CLAMP,
                    losses.LOG_RATIO_CLAMP,
                )
            ),
        },
    )


@register_loss_term(
    "kl",
    required=("logprobs", "ref_logprobs"),
    params={
        "estimator": Param.of("k3", one_of(losses.KL_ESTIMATORS)),
        "k3_max": Param.of(10.0, optional(real(0, lo_open=True))),
    },
)
def _kl(inputs: LossInputs, *, estimator, k3_max):
    return losses.kl_penalty(inputs.logprobs, inputs.ref_logprobs, estimator, k3_max=k3_max)


@register_loss_term("entropy", required=("entropy",))
def _entropy(inputs: LossInputs):
    return losses.entropy_bonus(inputs.entropy)


@register_loss_term("router_balance", required=("router_logits", "router_experts", "loss_mask"))
def _router_balance(inputs: LossInputs) -> TermOutput:
    """An MoE router's sequence-wise load-balancing loss
    (:func:`~agentrl_jax.algorithms.router.balance_loss`): per token ``mean_m E * sum_e
    f[s, m, e] * p[t, m, e]``, ``f`` the expert loads of the token's sequence over its loss
    tokens (summing to ``k``; each packed sequence its own, by ``segment_ids``), ``p`` the
    router's probabilities. A sequence's token mean is transformers' ``load_balancing_loss_func``
    for it, per layer, averaged over the layers (``k`` when balanced); Qwen3-MoE's coefficient
    (``router_aux_loss_coef``) is 0.001.

    Metric: ``max_load`` (the share of its sequence's assignments its busiest expert took,
    averaged over layers; ``1 / E`` when balanced).
    """
    loss, max_load = router.balance_loss(
        inputs.router_logits, inputs.router_experts, inputs.loss_mask, inputs.segment_ids
    )
    return TermOutput(loss, {"max_load": max_load})


@register_loss_term("router_z", required=("router_logits",))
def _router_z(inputs: LossInputs):
    """ST-MoE's router z-loss (:func:`~agentrl_jax.algorithms.router.z_loss`): per token
    ``mean_m logsumexp(router_logits[t, m])^2``; ST-MoE's coefficient is 0.001."""
    return router.z_loss(inputs.router_logits)


@register_loss_term(
    "value_clip",
    required=("values", "old_values", "returns"),
    target="critic",
    params={"clip": Param.of(0.5, real(0, lo_open=True))},
)
def _value_clip(inputs: LossInputs, *, clip):
    return losses.clipped_value_loss(inputs.values, inputs.old_values, inputs.returns, clip=clip)
