"""The config that picks an algorithm from the registry (:mod:`agentrl_jax.algorithms.registry`).

An :class:`AlgorithmConfig` names one advantage estimator and a set of weighted loss terms
(:class:`LossTermConfig`); it is frozen, hashable (usable as a static ``jax.jit`` argument) and
validated on construction, so an unknown name or a bad value fails at once with an error naming
the field. The config's coefficients weight the terms and one aggregation mode reduces their sum
to a :class:`~agentrl_jax.algorithms.aggregation.LossSum`
(:mod:`agentrl_jax.algorithms.compute`).

:meth:`AlgorithmConfig.required_loss_inputs` and :attr:`AlgorithmConfig.required_advantage_inputs`
collect the inputs the configured entries declare (``required=``), so a trainer computes what
the configured terms need, whatever their names.

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
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from agentrl_jax.algorithms.aggregation import AGGREGATION_MODES, validate_mode
from agentrl_jax.algorithms.registry import (
    ADVANTAGE_ESTIMATORS,
    LOSS_TERMS,
    TARGETS,
    LossTerm,
    Param,
)
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
