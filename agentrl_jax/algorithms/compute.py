"""Running the configured algorithm (:class:`~agentrl_jax.algorithms.AlgorithmConfig`): the
entry points a trainer calls.

:func:`compute_advantages` runs the configured estimator; :func:`compute_loss_with_metrics` the
weighted sum of the configured terms, aggregated once, each term unweighted beside it, and the
terms' own metrics (:func:`metric_sum`), all :class:`~agentrl_jax.algorithms.aggregation.LossSum`
pairs that add over micro-batches and devices.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp

from agentrl_jax.algorithms.aggregation import LossSum, aggregate
from agentrl_jax.algorithms.algorithm_config import AlgorithmConfig
from agentrl_jax.algorithms.registry import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    AdvantageOutput,
    LossInputs,
    LossTerm,
)


def _require_inputs(where: str, required: tuple[str, ...], inputs) -> None:
    for name in required:
        if getattr(inputs, name) is None:
            raise ValueError(f"{where} needs {type(inputs).__name__}.{name}, which is None")


def compute_advantages(config: AlgorithmConfig, inputs: AdvantageInputs) -> AdvantageOutput:
    """Runs the configured estimator: per-token advantages ``[N, L]`` (and returns, or None)."""
    estimator = ADVANTAGE_ESTIMATORS[config.advantage]
    _require_inputs(f"advantage estimator {estimator.name!r}", estimator.required, inputs)
    return estimator.fn(inputs, **dict(config.advantage_params))


class LossResult(NamedTuple):
    """What :func:`compute_loss_with_metrics` returns; every value is a ``LossSum`` (add over parts,
    then divide).

    ``total``: the weighted loss to differentiate; ``parts[term]``: each term unweighted;
    ``metrics["term/metric"]``: each term's own metrics (:class:`TermOutput`).
    """

    total: LossSum
    parts: dict[str, LossSum]
    metrics: dict[str, LossSum]


def metric_sum(value: jax.Array, loss_mask: jax.Array) -> LossSum:
    """A metric as a :class:`LossSum`, so it adds over micro-batches and devices like a loss.

    ``value [N, L]``: ``(sum m x, sum m)`` over ``loss_mask [N, L]`` (its token mean, exact
    under any split); ``[N]``: ``(sum_i h_i x_i, sum_i h_i)`` with ``h_i`` = row i has loss
    tokens (its mean over real sequences, exact under row splits); scalar: ``(x, 1)``
    (summed parts give the mean over micro-batches). Divide with ``aggregation.mean``.
    """
    value = jnp.asarray(value)
    weights = loss_mask.astype(jnp.float32)
    if value.shape == loss_mask.shape:  # off-mask entries may hold anything, even NaN
        return LossSum(jnp.sum(jnp.where(weights > 0, value * weights, 0.0)), jnp.sum(weights))
    if value.shape == loss_mask.shape[:1]:
        rows = (jnp.sum(weights, axis=-1) > 0).astype(jnp.float32)
        return LossSum(jnp.sum(jnp.where(rows > 0, value, 0.0)), jnp.sum(rows))
    if value.ndim == 0:
        return LossSum(value.astype(jnp.float32), jnp.ones((), jnp.float32))
    raise ValueError(
        f"metric: expected shape {tuple(loss_mask.shape)}, {tuple(loss_mask.shape[:1])} "
        f"or a scalar, got {tuple(value.shape)}"
    )


def _term_output(term: LossTerm, out, loss_mask: jax.Array) -> tuple[jax.Array, dict[str, LossSum]]:
    """Splits a term's return (bare loss or ``(loss, metrics)``) and checks its shapes."""
    where = f"loss term {term.name!r}"
    metrics = {}
    if isinstance(out, tuple):
        if len(out) != 2 or not isinstance(out[1], Mapping):
            raise ValueError(
                f"{where}: must return a per-token loss or (loss, metrics mapping), got a tuple of "
                f"{len(out)}"
            )
        out, raw = out
        for key, value in raw.items():
            if not isinstance(key, str) or not key or "/" in key:
                raise ValueError(
                    f"{where}: metric names must be non-empty strings without '/', got {key!r}"
                )
            try:
                metrics[f"{term.name}/{key}"] = metric_sum(jax.lax.stop_gradient(value), loss_mask)
            except ValueError as e:
                raise ValueError(f"{where}: {key!r} {e}") from None
    if getattr(out, "shape", None) != loss_mask.shape:
        raise ValueError(
            f"{where}: per-token loss must have the loss mask's shape {tuple(loss_mask.shape)}, "
            f"got {getattr(out, 'shape', type(out).__name__)}"
        )
    return out, metrics


def compute_loss_with_metrics(
    config: AlgorithmConfig,
    inputs: LossInputs,
    target: str = "policy",
    token_weights: jax.Array | None = None,
) -> LossResult:
    """The weighted sum of ``target``'s terms, aggregated once, each term unweighted, and their
    metrics.

    Returns a :class:`LossResult` ``(total, parts, metrics)``: ``total`` is the
    :class:`LossSum` of ``sum_k coef_k * loss_k`` (per token) to differentiate;
    ``parts[name]`` the term's own :class:`LossSum`; ``metrics["name/key"]`` the
    :func:`metric_sum` of each metric a term returned in its :class:`TermOutput` (e.g.
    ``"policy_clip/clip_fraction"``, ``"policy_clip/approx_kl"``). Aggregation is linear,
    so ``total.total == sum_k coef_k * parts[k].total`` with a shared denominator. All
    three are pytrees of ``LossSum``: sum them over micro-batches (and ``psum`` over
    devices), then ``aggregation.mean`` each.

    ``token_weights`` ``[N, L]`` (no gradient), if given, multiply every term's per-token loss
    before aggregation (the denominators stay the loss mask's): an importance weight per token,
    e.g. the trainer's correction of batches sampled by an older policy.
    """
    terms = config.terms_for(target)
    if not terms:
        raise ValueError(f"compute_loss: config has no {target} loss terms")
    if config.aggregation_constant is None:
        raise ValueError(
            "compute_loss: aggregation_constant is None (the trainer's max_response_length); "
            "resolve it first, e.g. through TrainConfig(max_response_length=...)"
        )
    weighted, parts, metrics = None, {}, {}
    for term_config in terms:  # a few configured terms, not data
        term = term_config.term
        _require_inputs(f"loss term {term.name!r}", term.required, inputs)
        per_token, term_metrics = _term_output(
            term, term.fn(inputs, **dict(term_config.params)), inputs.loss_mask
        )
        metrics.update(term_metrics)
        if token_weights is not None:
            per_token = per_token * token_weights
        parts[term.name] = aggregate(
            per_token,
            inputs.loss_mask,
            config.aggregation,
            config.aggregation_constant,
            inputs.segment_ids,
        )
        scaled = term_config.coef * per_token
        weighted = scaled if weighted is None else weighted + scaled
    total = aggregate(
        weighted,
        inputs.loss_mask,
        config.aggregation,
        config.aggregation_constant,
        inputs.segment_ids,
    )
    return LossResult(total, parts, metrics)


def compute_loss(
    config: AlgorithmConfig, inputs: LossInputs, target: str = "policy"
) -> tuple[LossSum, dict[str, LossSum]]:
    """:func:`compute_loss_with_metrics` without the metrics: ``(total, parts)``, as before.

    ``total`` is the :class:`LossSum` of ``sum_k coef_k * loss_k`` (per token) to
    differentiate; ``parts[name]`` the term's own :class:`LossSum`, for metrics.
    """
    result = compute_loss_with_metrics(config, inputs, target)
    return result.total, result.parts
