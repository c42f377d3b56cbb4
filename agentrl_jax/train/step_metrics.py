"""The train step's diagnostics as unreduced sums (so micro-batches add up exactly): the
importance ratio against the old policy, the critic's explained variance, the gap between
the sampler's and the trainer's log-probs, and (MoE) how often their routings differ.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

from agentrl_jax.algorithms import LossSum, aggregation, policy_ratio
from agentrl_jax.models import moe


def sampler_gap(
    trainer: jax.Array, sampler: jax.Array, mask: jax.Array
) -> tuple[LossSum, jax.Array]:
    """The sampler-trainer log-prob gap ``|trainer - sampler|`` over ``mask``: its token-mean
    sum (:class:`LossSum`, exact over micro-batches) and its maximum (0 for an empty mask)."""
    gap = jnp.abs(trainer - sampler)
    return _token_mean_sum(gap, mask), jnp.max(jnp.where(mask, gap, 0.0), initial=0.0)


def routing_differs(logits: jax.Array, recorded: jax.Array, mask: jax.Array) -> LossSum:
    """The share of (token, MoE layer) pairs whose router's own top-k (from ``logits [N, L, M,
    E]``) is another set of experts than the sampler recorded (``recorded [N, L, M, k]``), over
    the tokens of ``mask [N, L]`` that have a record: a token-mean sum (exact over
    micro-batches) of each token's share of differing layers."""
    n, length, layers, experts = logits.shape
    differs = moe.differs(logits.reshape(-1, experts), recorded.reshape(-1, recorded.shape[-1]))
    share = jnp.mean(differs.reshape(n, length, layers).astype(jnp.float32), axis=-1)
    return _token_mean_sum(share, mask & jnp.all(recorded >= 0, axis=(-2, -1)))


def _token_mean_sum(x: jax.Array, mask: jax.Array) -> LossSum:
    return aggregation.aggregate(x, mask)  # token-mean: (sum m x, sum m), exact under any split


def ratio_sums(logprobs: jax.Array, old_logprobs: jax.Array, mask: jax.Array) -> dict[str, LossSum]:
    """Token-mean sums of the importance ratio ``r = pi / pi_old`` (clamped as in the loss):
    ``ratio_mean``; ``ratio_deviation``, mean ``|r - 1|`` (exactly 0 iff every ratio is 1);
    ``approx_kl``, mean ``(r - 1) - log r`` (an estimate of KL(pi_old || pi), k3)."""
    ratio = policy_ratio(logprobs, old_logprobs)
    log_ratio = jnp.log(ratio)
    return {
        "ratio_mean": _token_mean_sum(ratio, mask),
        "ratio_deviation": _token_mean_sum(jnp.abs(ratio - 1.0), mask),
        "approx_kl": _token_mean_sum((ratio - 1.0) - log_ratio, mask),
    }


def explained_variance_sums(
    values: jax.Array, returns: jax.Array, mask: jax.Array
) -> dict[str, jax.Array]:
    """Sums over ``mask`` from which :func:`explained_variance` follows (add them over
    micro-batches)."""
    w = mask.astype(jnp.float32)
    residual = returns - values
    return {
        "count": jnp.sum(w),
        "returns": jnp.sum(w * returns),
        "returns_sq": jnp.sum(w * returns**2),
        "residual": jnp.sum(w * residual),
        "residual_sq": jnp.sum(w * residual**2),
    }


EV_RELATIVE_FLOOR = (
    1e-4  # Var(returns) below this share of E[returns^2] is rounding: constant returns
)


def explained_variance(sums: Mapping[str, jax.Array]) -> jax.Array:
    """``1 - Var(returns - values) / Var(returns)`` over the loss tokens.

    0 when the returns do not vary: the variance comes from summed moments (so it adds over
    micro-batches), whose float32 cancellation leaves ~1e-7 of ``E[returns^2]`` for constant
    returns, so a variance under ``EV_RELATIVE_FLOOR`` of it counts as none (GAE with
    gamma = lambda = 1 gives every token of a row the same return: a mini-batch of equal
    outcomes has constant returns)."""
    n = jnp.maximum(sums["count"], 1.0)
    mean_sq = sums["returns_sq"] / n
    var_returns = mean_sq - (sums["returns"] / n) ** 2
    var_residual = jnp.maximum(sums["residual_sq"] / n - (sums["residual"] / n) ** 2, 0.0)
    varies = var_returns > EV_RELATIVE_FLOOR * mean_sq + 1e-12
    return jnp.where(varies, 1.0 - var_residual / jnp.where(varies, var_returns, 1.0), 0.0)
