"""Policy (PPO clip, GSPO), KL, entropy and value losses.

Each loss comes in two forms:

* a per-token function (``clipped_surrogate``, ``gspo_surrogate``, ``kl_penalty``,
  ``entropy_bonus``, ``clipped_value_loss``) mapping ``[N, L]`` arrays to a per-token loss
  ``[N, L]`` to be minimised; and
* an aggregated one (``policy_loss``, ``gspo_loss``, ``kl_loss``, ``entropy_loss``,
  ``value_loss``) that also takes the loss mask ``[N, L]`` and an aggregation mode and
  returns a :class:`~agentrl_jax.algorithms.aggregation.LossSum` ``(total, denom)``, to be
  summed over micro-batches and devices before dividing (see :mod:`.aggregation`).

Log-probabilities are of the sampled tokens, ``[N, L]``; masked positions may hold
anything finite (they are multiplied by 0).
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

from agentrl_jax.algorithms.aggregation import LossSum, aggregate

# exp() of a log-ratio beyond this overflows float32 gradients long before it means anything;
# verl clamps at the same value.
LOG_RATIO_CLAMP = 20.0
KL_ESTIMATORS = ("k1", "k2", "k3")


def _require(name: str, value, ok: bool, what: str) -> None:
    """Validates a static (Python number) hyper-parameter; traced values pass unchecked."""
    if isinstance(value, numbers.Number) and not ok:
        raise ValueError(f"{name}: must be {what}, got {value!r}")


# ------------------------------------------------------------------------- from logits


def logprobs_from_logits(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """log softmax(logits)[token]: logits [N, L, V], tokens [N, L] int -> [N, L] float32."""
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)


def entropy_from_logits(logits: jax.Array) -> jax.Array:
    """Entropy of softmax(logits) per position: logits [N, L, V] -> [N, L] float32 (nats)."""
    logits = logits.astype(jnp.float32)
    log_p = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)


# ------------------------------------------------------------------------- policy


def policy_ratio(logprobs: jax.Array, old_logprobs: jax.Array) -> jax.Array:
    """pi / pi_old per token, with the log-ratio clamped to +-LOG_RATIO_CLAMP."""
    return jnp.exp(jnp.clip(logprobs - old_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _check_clips(clip_low, clip_high, dual_clip) -> None:
    _require("clip_low", clip_low, 0 <= clip_low < 1, "in [0, 1)")
    _require("clip_high", clip_high, clip_high >= 0, ">= 0")
    if dual_clip is not None:
        _require("dual_clip", dual_clip, dual_clip > 1, "> 1 (or None)")


def _clip_losses(ratio, advantages, clip_low, clip_high):
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return unclipped, clipped


def clipped_surrogate(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> jax.Array:
    """PPO clipped surrogate loss per token, ``[N, L]``.

    ``l = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`` with ``r = pi / pi_old``.
    ``clip_high > clip_low`` is clip-higher (DAPO: Yu et al. 2025, arXiv:2503.14476, Eq. 10,
    ``clip_low = 0.2``, ``clip_high = 0.28``). With ``dual_clip = c > 1`` a token with
    ``A < 0`` has its loss capped at ``-A c`` (dual-clip PPO), which bounds the update when
    r is far above 1 on a bad action; ``A >= 0`` tokens are unaffected.
    """
    _check_clips(clip_low, clip_high, dual_clip)
    unclipped, clipped = _clip_losses(
        policy_ratio(logprobs, old_logprobs), advantages, clip_low, clip_high
    )
    loss = jnp.maximum(unclipped, clipped)
    if dual_clip is not None:
        loss = jnp.where(advantages < 0, jnp.minimum(loss, -advantages * dual_clip), loss)
    return loss


def clip_indicator(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> jax.Array:
    """1.0 where clipping zeroes the token's policy gradient, else 0.0 (for a clip-fraction
    metric)."""
    _check_clips(clip_low, clip_high, dual_clip)
    ratio = policy_ratio(logprobs, old_logprobs)
    unclipped, clipped = _clip_losses(ratio, advantages, clip_low, clip_high)
    active = clipped > unclipped
    if dual_clip is not None:
        active = active | ((advantages < 0) & (ratio > dual_clip))
    return active.astype(jnp.float32)


def approx_kl(logprobs: jax.Array, old_logprobs: jax.Array) -> jax.Array:
    """Per-token ``(r - 1) - log r``, ``r = pi / pi_old``: an estimate of KL(pi_old || pi),
    ``[N, L]``.

    Unbiased and >= 0 on tokens sampled from pi_old (Schulman's k3 with the roles of the
    two policies as in PPO's "approx_kl" diagnostic); the log-ratio is clamped as in
    :func:`policy_ratio`. For a metric, not a loss.
    """
    log_ratio = jnp.clip(logprobs - old_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return jnp.expm1(log_ratio) - log_ratio


def tis_weight(old_logprobs: jax.Array, sampler_logprobs: jax.Array, cap: float) -> jax.Array:
    """Truncated importance weight ``min(pi_old / mu, cap)`` per token, ``[N, L]``, no gradient.

    ``pi_old``: the trainer's probability of the token at the rollout's parameters;
    ``mu``: the probability the sampler drew it with (its recorded log-prob). Corrects a
    trainer/sampler mismatch (another temperature, truncation, numerics) while bounding the
    variance (Yao et al., 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
    Training"; verl's ``tis_imp_ratio_cap``). The log-ratio is clamped as in :func:`policy_ratio`.
    """
    _require("cap", cap, cap > 0, "> 0")
    log_ratio = jnp.clip(old_logprobs - sampler_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return jax.lax.stop_gradient(jnp.minimum(jnp.exp(log_ratio), cap))


def policy_loss(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    mode: str = "token-mean",
    norm_constant: float = 1.0,
) -> LossSum:
    """:func:`clipped_surrogate` aggregated under ``mask`` (see :mod:`.aggregation`)."""
    per_token = clipped_surrogate(
        logprobs,
        old_logprobs,
        advantages,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
    )
    return aggregate(per_token, mask, mode, norm_constant)


# ------------------------------------------------------------------------- GSPO


def sequence_log_ratio(logprobs: jax.Array, old_logprobs: jax.Array, mask: jax.Array) -> jax.Array:
    """``(1 / |y_i|) sum_t m_it (log pi - log pi_old)`` per sequence, ``[N]`` (0 for a row without
    tokens).

    logprobs, old_logprobs, mask: ``[N, L]``; ``|y_i| = sum_t m_it``. ``exp`` of it is
    GSPO's sequence importance ratio, the geometric mean of the token ratios.
    """
    weights = mask.astype(jnp.float32)
    tokens = jnp.sum(weights, axis=-1)
    total = jnp.sum((logprobs - old_logprobs) * weights, axis=-1)
    return jnp.where(tokens > 0, total / jnp.where(tokens > 0, tokens, 1.0), 0.0)


def gspo_ratio(logprobs: jax.Array, old_logprobs: jax.Array, mask: jax.Array) -> jax.Array:
    """GSPO-token ratio per token, ``[N, L]``: ``s_it = sg[s_i] * pi_t / sg[pi_t]``.

    ``s_i = exp(sequence_log_ratio)`` (:func:`sequence_log_ratio`), log clamped to
    +-LOG_RATIO_CLAMP. The value of every token's ratio is the sequence ratio ``s_i``; its
    gradient is ``s_i * grad log pi_t``, the token's own share of ``grad s_i``. ``sg`` is
    ``jax.lax.stop_gradient``.
    """
    seq = jax.lax.stop_gradient(sequence_log_ratio(logprobs, old_logprobs, mask))
    log_ratio = logprobs - jax.lax.stop_gradient(logprobs) + seq[:, None]
    return jnp.exp(jnp.clip(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def gspo_surrogate(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> jax.Array:
    """GSPO clipped surrogate per token, ``[N, L]``, with the sequence-level importance ratio.

    ``s_i = exp((1 / |y_i|) sum_t m_it (log pi_t - log pi_old_t))`` (geometric mean of the
    token ratios over the sequence's response tokens, ``mask [N, L]``), and
    ``l_it = max(-A_it s_it, -A_it clip(s_it, 1 - clip_low, 1 + clip_high))`` with
    ``s_it = sg[s_i] pi_t / sg[pi_t]`` (:func:`gspo_ratio`): GSPO-token. With one advantage
    per sequence (GRPO, RLOO, Dr. GRPO) every token of sequence i has the same loss
    ``max(-A_i s_i, -A_i clip(s_i, ...))``, clipped or not as a whole, and since every
    aggregation mode weighs a sequence's tokens equally, the gradient is exactly that of the
    sequence-level GSPO objective; per-token advantages (GiGPO) give GSPO-token. Use the
    ``"seq-mean-token-mean"`` aggregation for the paper's ``(1/G) sum_i``.

    Source: Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071),
    Eqs. 5-7 and 13-14; clip range 3e-4 / 4e-4 as in its experiments; verl's
    ``compute_policy_loss_gspo`` (``policy_loss.loss_mode=gspo``).
    """
    _check_clips(clip_low, clip_high, None)
    ratio = gspo_ratio(logprobs, old_logprobs, mask)
    return jnp.maximum(*_clip_losses(ratio, advantages, clip_low, clip_high))


def gspo_clip_indicator(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> jax.Array:
    """1.0 on the tokens whose GSPO gradient the sequence-level clip zeroes, ``[N, L]``."""
    _check_clips(clip_low, clip_high, None)
    ratio = gspo_ratio(logprobs, old_logprobs, mask)
    unclipped, clipped = _clip_losses(ratio, advantages, clip_low, clip_high)
    return (clipped > unclipped).astype(jnp.float32)


def gspo_loss(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    mode: str = "seq-mean-token-mean",
    norm_constant: float = 1.0,
) -> LossSum:
    """:func:`gspo_surrogate` aggregated under ``mask`` (default: the paper's sequence mean)."""
    per_token = gspo_surrogate(
        logprobs, old_logprobs, advantages, mask, clip_low=clip_low, clip_high=clip_high
    )
    return aggregate(per_token, mask, mode, norm_constant)


# ------------------------------------------------------------------------- KL


def kl_penalty(
    logprobs: jax.Array,
    ref_logprobs: jax.Array,
    estimator: str = "k3",
    *,
    k3_max: float | None = 10.0,
) -> jax.Array:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled by pi, ``[N, L]``.

    With ``d = log pi_ref - log pi`` (Schulman's estimators):
      k1 = -d                      unbiased, high variance, can be negative;
      k2 = d^2 / 2                 biased, low variance, >= 0;
      k3 = exp(d) - d - 1          unbiased, low variance, >= 0 ("low_var_kl" in verl).
    For k3, d is clamped to +-LOG_RATIO_CLAMP and the result to ``k3_max`` (verl uses 10),
    which zeroes the gradient of tokens past the cap; ``k3_max=None`` disables the cap.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(
            f"estimator: unknown KL estimator {estimator!r}; known: {', '.join(KL_ESTIMATORS)}"
        )
    d = ref_logprobs - logprobs
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d**2
    if k3_max is not None:
        _require("k3_max", k3_max, k3_max > 0, "> 0 (or None)")
    d = jnp.clip(d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    k3 = jnp.exp(d) - d - 1.0
    return k3 if k3_max is None else jnp.minimum(k3, k3_max)


def kl_loss(
    logprobs: jax.Array,
    ref_logprobs: jax.Array,
    mask: jax.Array,
    *,
    estimator: str = "k3",
    k3_max: float | None = 10.0,
    mode: str = "token-mean",
    norm_constant: float = 1.0,
) -> LossSum:
    """:func:`kl_penalty` aggregated under ``mask``."""
    return aggregate(
        kl_penalty(logprobs, ref_logprobs, estimator, k3_max=k3_max), mask, mode, norm_constant
    )


# ------------------------------------------------------------------------- entropy


def entropy_bonus(entropy: jax.Array) -> jax.Array:
    """Per-token loss ``-H`` ``[N, L]``: minimising it with a positive coefficient raises
    entropy."""
    return -entropy


def entropy_loss(
    entropy: jax.Array, mask: jax.Array, *, mode: str = "token-mean", norm_constant: float = 1.0
) -> LossSum:
    """:func:`entropy_bonus` aggregated under ``mask``."""
    return aggregate(entropy_bonus(entropy), mask, mode, norm_constant)


# ------------------------------------------------------------------------- value


def clipped_value_loss(
    values: jax.Array, old_values: jax.Array, returns: jax.Array, *, clip: float = 0.5
) -> jax.Array:
    """PPO clipped value loss per token, ``[N, L]``.

    ``0.5 * max((V - R)^2, (clip(V, V_old - clip, V_old + clip) - R)^2)``: the critic may
    not move its prediction more than ``clip`` (paper: 0.5) from the rollout-time value to
    reduce the loss. The factor 0.5 is verl's.
    """
    _require("clip", clip, clip > 0, "> 0")
    clipped_values = jnp.clip(values, old_values - clip, old_values + clip)
    return 0.5 * jnp.maximum((values - returns) ** 2, (clipped_values - returns) ** 2)


def value_loss(
    values: jax.Array,
    old_values: jax.Array,
    returns: jax.Array,
    mask: jax.Array,
    *,
    clip: float = 0.5,
    mode: str = "token-mean",
    norm_constant: float = 1.0,
) -> LossSum:
    """:func:`clipped_value_loss` aggregated under ``mask``."""
    return aggregate(
        clipped_value_loss(values, old_values, returns, clip=clip), mask, mode, norm_constant
    )
