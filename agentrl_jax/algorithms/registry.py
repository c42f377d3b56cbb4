"""Name-keyed registry of advantage estimators and loss terms, and the config that picks them.

An :class:`AlgorithmConfig` names one advantage estimator and a set of weighted loss terms;
it is frozen, hashable (usable as a static ``jax.jit`` argument) and validated on
construction, so an unknown name or a bad value fails at once with an error naming the field.

* Advantage estimators map :class:`AdvantageInputs` to per-token advantages ``[N, L]``
  (and returns, for a critic): ``"grpo"``, ``"dr_grpo"``, ``"rloo"``, ``"gigpo"``,
  ``"gae"``.
* Loss terms map :class:`LossInputs` to a per-token loss ``[N, L]``, or to a
  :class:`TermOutput` ``(loss, metrics)`` that also carries the term's own metrics; the
  config's coefficients weight them and one aggregation mode reduces their sum to a
  :class:`~agentrl_jax.algorithms.aggregation.LossSum`. Each term trains either the
  ``"policy"`` (``"policy_clip"``, ``"policy_clip_tis"``, ``"gspo_clip"``, ``"kl"``, ``"entropy"``,
  and for an MoE model the router's ``"router_balance"`` and ``"router_z"``) or the
  ``"critic"`` (``"value_clip"``), which has its own optimizer.

Every estimator and term declares the inputs it reads (``required=``);
:meth:`AlgorithmConfig.required_loss_inputs` and
:attr:`AlgorithmConfig.required_advantage_inputs` collect them, so a trainer computes
what the configured terms need, whatever their names. :func:`compute_loss_with_metrics`
returns the terms' metrics next to the loss.

DAPO is a combination, not an entry: ``"grpo"`` advantages, ``"policy_clip"`` with
``clip_low=0.2, clip_high=0.28``, ``"token-mean"`` aggregation, no KL term, plus two
batch-level settings of the config that the trainer applies: ``dynamic_sampling`` (drop
groups whose rewards are all equal and refill the batch from further rollouts, at most
``max_rollout_batches`` of them; :func:`~agentrl_jax.algorithms.dapo.dynamic_sampling_keep`)
and ``overlong_buffer`` / ``overlong_penalty`` (DAPO's soft overlong punishment added to the
reward, :func:`~agentrl_jax.algorithms.dapo.overlong_penalty`, with ``L_max`` the trainer's
``max_response_length`` and ``L_cache = overlong_buffer x L_max``). Dr. GRPO is
``"dr_grpo"`` with the ``"seq-mean-token-sum"`` aggregation and ``aggregation_constant`` =
the maximum response length (``None``: the trainer fills in its ``max_response_length``).

New estimators and terms are added with :func:`register_advantage` and
:func:`register_loss_term`; see the built-ins at the bottom of this module.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp

from agentrl_jax.algorithms import advantages as adv
from agentrl_jax.algorithms import losses, router
from agentrl_jax.algorithms.aggregation import AGGREGATION_MODES, LossSum, aggregate, validate_mode
from agentrl_jax.errors import did_you_mean
from agentrl_jax.validation import (
    BOOL,
    MAX_COEF,
    MAX_CONTEXT,
    MAX_TURNS,
    check_fields,
    integer,
    optional,
    real,
    setting,
    short_repr,
)

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


def _real(
    lo: float | None = None, hi: float | None = None, *, lo_open=False, hi_open=False
) -> Callable[[Any], bool]:
    """The predicate of :func:`agentrl_jax.validation.real` (a finite number in the range; an
    integer too large for a float fails it, it never raises)."""
    return real(lo, hi, lo_open=lo_open, hi_open=hi_open).test


def _is_bool(v) -> bool:
    return isinstance(v, bool)


def _one_of(*choices) -> Callable[[Any], bool]:
    return lambda v: any(v == c and type(v) is type(c) for c in choices)


def _none_or(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


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
    Metrics are not differentiated (``stop_gradient``); see :func:`compute_loss_with_metrics`.
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


# ------------------------------------------------------------------------- configs


def _resolve_params(where: str, specs: Mapping[str, Param], given) -> tuple[tuple[str, Any], ...]:
    """Validates ``given`` (mapping or pairs) against ``specs``; fills defaults; sorted pairs."""
    try:
        given = dict(given or {})
    except (TypeError, ValueError):
        raise ValueError(
            f"{where}: must be a mapping of parameter names to values, got {short_repr(given, 120)}"
        ) from None
    unknown = sorted(set(given) - set(specs))
    if unknown:
        raise ValueError(
            f"{where}: unknown parameter {unknown[0]!r}; "
            f"known: {', '.join(sorted(specs)) or 'none'}{did_you_mean(unknown[0], specs)}"
        )
    resolved = {}
    for key, spec in specs.items():
        value = given.get(key, spec.default)
        if not spec.check(value):
            shown = short_repr(value, 120)
            raise ValueError(f"{where}[{key!r}]: must be {spec.expect}, got {shown}")
        resolved[key] = value
    return tuple(sorted(resolved.items()))


def _known(table) -> str:
    return ", ".join(sorted(table))


def _terms_of(target: str) -> str:
    return _known(name for name, term in LOSS_TERMS.items() if term.target == target)


@dataclasses.dataclass(frozen=True)
class LossTermConfig:
    """One weighted loss term: ``coef * term(inputs, **params)``. ``params`` becomes sorted
    pairs."""

    name: str
    coef: float = setting(1.0, real(0.0, MAX_COEF))
    params: Any = ()

    def __post_init__(self):
        if self.name not in LOSS_TERMS:
            raise ValueError(
                f"LossTermConfig.name: unknown loss term {self.name!r}; known: {_known(LOSS_TERMS)}"
                f"{did_you_mean(self.name, LOSS_TERMS)}"
            )
        check_fields(f"LossTermConfig(name={self.name!r})", self)
        where = f"LossTermConfig(name={self.name!r}).params"
        object.__setattr__(
            self, "params", _resolve_params(where, LOSS_TERMS[self.name].params, self.params)
        )

    @property
    def term(self) -> LossTerm:
        return LOSS_TERMS[self.name]


def _default_loss_terms() -> tuple[LossTermConfig, ...]:
    return (
        LossTermConfig("policy_clip"),
        LossTermConfig("kl", 0.001),
    )  # paper: KL coefficient 0.001


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    """Which advantage estimator and which loss terms to combine, and how to aggregate them.

    The default is the paper's GRPO: group-relative advantages, clipped surrogate (0.2),
    KL to the reference (k3, coefficient 0.001), token-mean aggregation.

    ``aggregation_constant`` None stands for the trainer's ``max_response_length``
    (:class:`~agentrl_jax.train.TrainConfig` fills it in; Dr. GRPO's constant). The batch-level
    settings (DAPO, see the module docstring): ``dynamic_sampling``, ``max_rollout_batches``
    (the most rollout batches one update may draw to fill its batch with varied groups),
    ``overlong_buffer`` (0: off; else ``L_cache / L_max`` in (0, 1]) and ``overlong_penalty``.
    """

    advantage: str = "grpo"
    advantage_params: Any = ()
    loss_terms: tuple[LossTermConfig, ...] = dataclasses.field(default_factory=_default_loss_terms)
    aggregation: str = "token-mean"
    # Dr. GRPO's constant: at most MAX_TURNS x MAX_CONTEXT sampled tokens a row can hold
    aggregation_constant: float | None = setting(
        1.0, optional(real(0.0, float(MAX_TURNS * MAX_CONTEXT), lo_open=True))
    )
    dynamic_sampling: bool = setting(False, BOOL)
    # rollout batches one update may draw (each a whole batch of rollouts)
    max_rollout_batches: int = setting(4, integer(1, 1024))
    overlong_buffer: float = setting(
        0.0, real(0.0, 1.0)._replace(expect="a number in [0, 1] (0: off)")
    )
    overlong_penalty: float = setting(1.0, real(0.0, MAX_COEF))

    def __post_init__(self):
        check_fields("AlgorithmConfig", self)
        if self.advantage not in ADVANTAGE_ESTIMATORS:
            raise ValueError(
                f"AlgorithmConfig.advantage: unknown advantage estimator {self.advantage!r}; "
                f"known: {_known(ADVANTAGE_ESTIMATORS)}"
                f"{did_you_mean(self.advantage, ADVANTAGE_ESTIMATORS)}"
            )
        estimator = ADVANTAGE_ESTIMATORS[self.advantage]
        object.__setattr__(
            self,
            "advantage_params",
            _resolve_params(
                "AlgorithmConfig.advantage_params", estimator.params, self.advantage_params
            ),
        )
        object.__setattr__(self, "loss_terms", self._resolve_terms(self.loss_terms))
        try:
            validate_mode(
                self.aggregation,
                1.0 if self.aggregation_constant is None else self.aggregation_constant,
            )
        except ValueError as e:
            field = (
                "aggregation"
                if self.aggregation not in AGGREGATION_MODES
                else "aggregation_constant"
            )
            raise ValueError(f"AlgorithmConfig.{field}: {e}") from None
        if not self.terms_for("policy"):
            raise ValueError(
                "AlgorithmConfig.loss_terms: needs at least one policy term "
                f"(policy terms: {_terms_of('policy')})"
            )
        if estimator.uses_critic and not self.terms_for("critic"):
            raise ValueError(
                f"AlgorithmConfig.loss_terms: advantage {self.advantage!r} uses a critic, "
                f"so a critic term is needed (critic terms: {_terms_of('critic')})"
            )

    @staticmethod
    def _resolve_terms(terms) -> tuple[LossTermConfig, ...]:
        if isinstance(terms, (str, Mapping, LossTermConfig)) or not hasattr(terms, "__iter__"):
            raise ValueError(
                "AlgorithmConfig.loss_terms: must be a sequence of loss terms, got "
                f"{short_repr(terms, 120)}"
            )
        resolved, seen = [], set()
        for i, term in enumerate(terms):
            if isinstance(term, Mapping):
                extra = sorted(set(term) - {"name", "coef", "params"})
                if extra or "name" not in term:
                    raise ValueError(
                        f"AlgorithmConfig.loss_terms[{i}]: needs 'name' and only name/coef/params, "
                        f"got {short_repr(dict(term), 120)}"
                    )
                try:
                    term = LossTermConfig(**term)
                except ValueError as e:
                    raise ValueError(f"AlgorithmConfig.loss_terms[{i}]: {e}") from None
            if not isinstance(term, LossTermConfig):
                raise ValueError(
                    f"AlgorithmConfig.loss_terms[{i}]: must be a LossTermConfig or mapping, "
                    f"got {short_repr(term, 120)}"
                )
            if term.name in seen:
                raise ValueError(
                    f"AlgorithmConfig.loss_terms[{i}]: term {term.name!r} appears twice"
                )
            seen.add(term.name)
            resolved.append(term)
        return tuple(resolved)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "AlgorithmConfig":
        """Builds from plain data (a YAML section); unknown keys are errors."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(
                f"AlgorithmConfig: unknown field {unknown[0]!r}; known: {', '.join(sorted(known))}"
                f"{did_you_mean(unknown[0], known)}"
            )
        return cls(**d)

    def terms_for(self, target: str) -> tuple[LossTermConfig, ...]:
        if target not in TARGETS:
            raise ValueError(f"target: must be one of {TARGETS}, got {target!r}")
        return tuple(t for t in self.loss_terms if t.term.target == target)

    @property
    def uses_critic(self) -> bool:
        return ADVANTAGE_ESTIMATORS[self.advantage].uses_critic

    def required_loss_inputs(self, target: str) -> frozenset[str]:
        """The :class:`LossInputs` fields that ``target``'s configured terms read (``loss_mask``
        aside).

        E.g. ``{"logprobs", "old_logprobs", "advantages", "ref_logprobs"}`` for the default
        GRPO; a trainer computes ``entropy`` or ``ref_logprobs`` iff they appear here.
        """
        return frozenset(name for t in self.terms_for(target) for name in t.term.required) - {
            "loss_mask"
        }

    @property
    def required_advantage_inputs(self) -> frozenset[str]:
        """The :class:`AdvantageInputs` fields the configured estimator reads (``loss_mask``
        aside)."""
        return frozenset(ADVANTAGE_ESTIMATORS[self.advantage].required) - {"loss_mask"}


# ------------------------------------------------------------------------- entry points


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


# ------------------------------------------------------------------------- built-ins

_EPS = Param(1e-6, _real(0, lo_open=True), "a finite number > 0")
_DDOF = Param(1, _one_of(0, 1), "0 or 1 (int)")
_FLAG_TRUE = Param(True, _is_bool, "a bool")
_UNIT = "a number in [0, 1]"


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
        "omega": Param(1.0, _real(0), "a finite number >= 0"),
        "gamma": Param(0.95, _real(0, 1), _UNIT),
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
        "gamma": Param(1.0, _real(0, 1), _UNIT),
        "lam": Param(1.0, _real(0, 1), _UNIT),
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


_CLIP_LOW = "a number in [0, 1)"


@register_loss_term(
    "policy_clip",
    required=("logprobs", "old_logprobs", "advantages"),
    params={
        "clip_low": Param(0.2, _real(0, 1, hi_open=True), _CLIP_LOW),
        "clip_high": Param(0.2, _real(0), "a finite number >= 0"),
        "dual_clip": Param(None, _none_or(_real(1, lo_open=True)), "None or a finite number > 1"),
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
        "clip_low": Param(0.2, _real(0, 1, hi_open=True), _CLIP_LOW),
        "clip_high": Param(0.2, _real(0), "a finite number >= 0"),
        "dual_clip": Param(None, _none_or(_real(1, lo_open=True)), "None or a finite number > 1"),
        "cap": Param(2.0, _real(0, lo_open=True), "a finite number > 0"),
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
        "clip_low": Param(3e-4, _real(0, 1, hi_open=True), _CLIP_LOW),
        "clip_high": Param(4e-4, _real(0), "a finite number >= 0"),
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
        "estimator": Param("k3", _one_of(*losses.KL_ESTIMATORS), f"one of {losses.KL_ESTIMATORS}"),
        "k3_max": Param(10.0, _none_or(_real(0, lo_open=True)), "None or a finite number > 0"),
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
    params={"clip": Param(0.5, _real(0, lo_open=True), "a finite number > 0")},
)
def _value_clip(inputs: LossInputs, *, clip):
    return losses.clipped_value_loss(inputs.values, inputs.old_values, inputs.returns, clip=clip)
