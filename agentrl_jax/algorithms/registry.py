"""Name-keyed registry of advantage estimators and loss terms: what they read and return, and
how one is registered.

* Advantage estimators map :class:`AdvantageInputs` to per-token advantages ``[N, L]``
  (and returns, for a critic).
* Loss terms map :class:`LossInputs` to a per-token loss ``[N, L]``, or to a
  :class:`TermOutput` ``(loss, metrics)`` that also carries the term's own metrics. Each term
  trains either the ``"policy"`` or the ``"critic"``, which has its own optimizer.

Every estimator and term declares the inputs it reads (``required=``) and its hyper-parameters
(:class:`Param`, each with its check, e.g. one of :mod:`agentrl_jax.validation`'s:
:meth:`Param.of`). New estimators and terms are added with :func:`register_advantage` and
:func:`register_loss_term`; the built-ins are registered by :mod:`agentrl_jax.algorithms.builtin`
when the package is imported. The config that picks them is
:class:`~agentrl_jax.algorithms.algorithm_config.AlgorithmConfig`; what runs them,
:mod:`agentrl_jax.algorithms.compute`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple

import jax

from agentrl_jax.validation import Check

TARGETS = ("policy", "critic")

# ------------------------------------------------------------------------- inputs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdvantageInputs:
    """What advantage estimators read; fields an estimator does not need may be None."""

    loss_mask: jax.Array  # [N, L] 1 on the policy's sampled tokens
    rewards: jax.Array | None = None  # [N] outcome reward per trajectory
    group_ids: jax.Array | None = None  # [N] int task group
    traj_mask: jax.Array | None = None  # [N] bool real rows (None: all)
    step_rewards: jax.Array | None = None  # [N, T] per-turn rewards (process signal)
    turn_mask: jax.Array | None = None  # [N, T] bool real turns
    anchor_keys: jax.Array | None = None  # [N, T] or [N, T, K] int anchor state keys
    token_turn_index: jax.Array | None = None  # [N, L] int turn of each token, -1 if none
    token_rewards: jax.Array | None = None  # [N, L] reward per response token (GAE)
    values: jax.Array | None = None  # [N, L] critic values at rollout time (GAE)


class AdvantageOutput(NamedTuple):
    advantages: jax.Array  # [N, L], 0 off the loss mask
    returns: jax.Array | None  # [N, L] critic targets, or None without a critic


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LossInputs:
    """What loss terms read, all per token ``[N, L]`` (the router's ``[N, L, M, ...]``, over
    an MoE model's ``M`` MoE layers); unneeded fields may be None."""

    loss_mask: jax.Array
    logprobs: jax.Array | None = None  # current policy (differentiated)
    old_logprobs: jax.Array | None = None  # policy that sampled the tokens
    ref_logprobs: jax.Array | None = None  # frozen reference policy
    advantages: jax.Array | None = None
    entropy: jax.Array | None = None  # current policy entropy per position
    values: jax.Array | None = None  # current critic (differentiated)
    old_values: jax.Array | None = None  # critic at rollout time
    returns: jax.Array | None = None  # critic targets
    sampler_logprobs: jax.Array | None = None  # behaviour policy as the sampler recorded it
    #                                            (Trajectory.sampling_logprobs): what TIS weighs by
    segment_ids: jax.Array | None = None  # packed rows: a run of equal ids is one sequence
    #                                       (aggregation's sequence modes count each one)
    router_logits: jax.Array | None = None  # [N, L, M, E] current policy's router logits per
    #                                         MoE layer (differentiated; MoE models only)
    router_experts: jax.Array | None = None  # [N, L, M, k] int32 the experts each token used


# ------------------------------------------------------------------------- registry


@dataclasses.dataclass(frozen=True)
class Param:
    """A hyper-parameter: its default, a check, and what the check expects (for errors)."""

    default: Any
    check: Callable[[Any], bool]
    expect: str

    @classmethod
    def of(cls, default: Any, check: Check) -> Param:
        """A hyper-parameter checked by one of :mod:`agentrl_jax.validation`'s checks (e.g.
        ``Param.of(0.2, real(0, 1))``), its expectation the check's."""
        return cls(default, check[0], check[1])


@dataclasses.dataclass(frozen=True)
class AdvantageEstimator:
    name: str
    fn: Callable[..., AdvantageOutput]  # fn(inputs: AdvantageInputs, **params)
    required: tuple[str, ...]
    params: Mapping[str, Param]
    uses_critic: bool


class TermOutput(NamedTuple):
    """What a loss term may return instead of a bare per-token loss.

    ``loss`` is the per-token loss ``[N, L]``; ``metrics`` maps short names (no ``/``) to
    per-token arrays ``[N, L]`` (averaged over the loss mask), per-sequence arrays ``[N]``
    (averaged over the rows that have loss tokens) or scalars (averaged over micro-batches).
    Metrics are not differentiated (``stop_gradient``); see
    :func:`~agentrl_jax.algorithms.compute.compute_loss_with_metrics`.
    """

    loss: jax.Array
    metrics: Mapping[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class LossTerm:
    name: str
    fn: Callable[..., Any]  # fn(inputs: LossInputs, **params) -> [N, L] or TermOutput
    required: tuple[str, ...]
    params: Mapping[str, Param]
    target: str
    whole_rows: bool = False  # reads each row as one sequence (packed rows would mix them)


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}
LOSS_TERMS: dict[str, LossTerm] = {}


def _check_registration(kind, table, name, required, inputs_cls, params) -> dict[str, Param]:
    if name in table:
        raise ValueError(f"{kind} {name!r} is already registered")
    fields = {f.name for f in dataclasses.fields(inputs_cls)}
    unknown = [r for r in required if r not in fields]
    if unknown:
        raise ValueError(
            f"{kind} {name!r}: required {unknown} are not {inputs_cls.__name__} fields"
        )
    params = dict(params or {})
    for key, spec in params.items():
        if not spec.check(spec.default):
            raise ValueError(
                f"{kind} {name!r}: default of {key!r} fails its own check ({spec.expect})"
            )
    return params


def register_advantage(
    name: str,
    *,
    required: tuple[str, ...],
    params: Mapping[str, Param] | None = None,
    uses_critic: bool = False,
):
    """Decorator registering ``fn(inputs: AdvantageInputs, **params) -> AdvantageOutput``."""

    def decorator(fn):
        specs = _check_registration(
            "advantage estimator", ADVANTAGE_ESTIMATORS, name, required, AdvantageInputs, params
        )
        ADVANTAGE_ESTIMATORS[name] = AdvantageEstimator(
            name, fn, tuple(required), specs, uses_critic
        )
        return fn

    return decorator


def register_loss_term(
    name: str,
    *,
    required: tuple[str, ...],
    params: Mapping[str, Param] | None = None,
    target: str = "policy",
    whole_rows: bool = False,
):
    """Decorator registering ``fn(inputs: LossInputs, **params) -> per-token loss [N, L]``.

    ``fn`` may instead return a :class:`TermOutput` (or any pair) ``(loss [N, L], metrics)``
    to report its own metrics. ``required`` names the :class:`LossInputs` fields it reads
    (``loss_mask`` is always there). ``whole_rows``: the term reads each row as one sequence
    (e.g. a sequence-level ratio), so the trainer does not pack several into a row for it.
    """
    if target not in TARGETS:
        raise ValueError(f"loss term {name!r}: target must be one of {TARGETS}, got {target!r}")

    def decorator(fn):
        specs = _check_registration("loss term", LOSS_TERMS, name, required, LossInputs, params)
        LOSS_TERMS[name] = LossTerm(name, fn, tuple(required), specs, target, whole_rows)
        return fn

    return decorator
