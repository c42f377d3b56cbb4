"""What the train step computes for an algorithm: the inputs its registered entries declare.

Every advantage estimator and loss term declares the fields of
:class:`~agentrl_jax.algorithms.AdvantageInputs` / :class:`~agentrl_jax.algorithms.LossInputs`
it reads (``required=`` in :func:`~agentrl_jax.algorithms.register_loss_term`). The step
computes exactly the union of those, whatever the entries are called: a term registered
under any name that needs ``entropy`` and ``ref_logprobs`` gets the current policy's entropy
and the frozen reference's log-probs; no term needing them, and neither is computed (nor is
the reference kept in the train state).

The step can provide, for the terms of each target:

* **live** inputs, recomputed from the parameters being updated at every update (and
  differentiated): ``logprobs`` and ``entropy`` for policy terms (and, on an MoE model, the
  forward's ``router_logits`` and ``router_experts``), ``values`` for critic terms;
* **batch** inputs, computed once per rollout batch before its first update, for terms of
  either target: ``old_logprobs`` (the policy before the batch's first update), ``ref_logprobs``
  (the frozen reference), ``advantages`` (the configured estimator), ``old_values`` (the
  critic before the first update), ``returns`` (the estimator's critic targets) and
  ``sampler_logprobs`` (the behaviour log-probs the sampler recorded,
  ``Trajectory.sampling_logprobs``).

``old_values`` needs a critic, which the step trains when the estimator uses one
(``uses_critic``) or a critic term is configured; ``returns`` need an estimator that uses a
critic (only those produce them). :func:`check_inputs` refuses, naming the entry and the
field, an algorithm asking for anything else, so a missing input is a config error at
construction, not a ``None`` deep inside a jitted step. The router's inputs exist only for an
MoE model, which the config does not know: :func:`check_model_inputs` refuses them for a
dense one, given the model.
"""

from __future__ import annotations

import dataclasses

from agentrl_jax.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    AlgorithmConfig,
    LossInputs,
)

TARGETS = ("policy", "critic")
LIVE_INPUTS: dict[str, frozenset[str]] = {
    "policy": frozenset({"logprobs", "entropy", "router_logits", "router_experts"}),
    "critic": frozenset({"values"}),
}
BATCH_INPUTS = frozenset(
    {"old_logprobs", "ref_logprobs", "advantages", "old_values", "returns", "sampler_logprobs"}
)
CRITIC_BATCH_INPUTS = frozenset({"old_values", "returns"})  # need a critic
ADVANTAGE_INPUTS = frozenset(
    f.name for f in dataclasses.fields(AdvantageInputs)
)  # the step fills all
CRITIC_ADVANTAGE_INPUTS = frozenset({"values", "token_rewards"})  # filled only with a critic


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """The inputs one :class:`~agentrl_jax.algorithms.AlgorithmConfig` needs computed.

    ``policy`` / ``critic``: the :class:`~agentrl_jax.algorithms.LossInputs` fields (besides
    ``loss_mask``) that the terms of that target read; ``advantage``: the
    :class:`~agentrl_jax.algorithms.AdvantageInputs` fields the estimator reads; ``critic_model``:
    whether the step trains a critic.
    """

    policy: frozenset[str]
    critic: frozenset[str]
    advantage: frozenset[str]
    critic_model: bool

    @property
    def batch(self) -> frozenset[str]:
        """The batch inputs (computed once per rollout batch) any term reads."""
        return (self.policy | self.critic) & BATCH_INPUTS

    def live(self, target: str) -> frozenset[str]:
        """The live inputs (recomputed at each update) ``target``'s terms read."""
        return getattr(self, target) & LIVE_INPUTS[target]

    @property
    def reference(self) -> bool:
        """Whether the frozen reference policy is needed (a term reads ``ref_logprobs``)."""
        return "ref_logprobs" in self.batch


def _term_inputs(algorithm: AlgorithmConfig, target: str) -> frozenset[str]:
    return frozenset(f for t in algorithm.terms_for(target) for f in t.term.required) - {
        "loss_mask"
    }


def step_inputs(algorithm: AlgorithmConfig) -> StepInputs:
    """The inputs ``algorithm``'s estimator and terms declare (pure; see the module docstring)."""
    estimator = ADVANTAGE_ESTIMATORS[algorithm.advantage]
    return StepInputs(
        policy=_term_inputs(algorithm, "policy"),
        critic=_term_inputs(algorithm, "critic"),
        advantage=frozenset(estimator.required) - {"loss_mask"},
        critic_model=bool(estimator.uses_critic or algorithm.terms_for("critic")),
    )


def _missing(field: str, target: str, inputs: StepInputs, uses_critic: bool) -> str | None:
    """Why the step cannot give ``field`` to a ``target`` term, or None if it can."""
    if field in LIVE_INPUTS[target]:
        return None
    other = next((t for t in TARGETS if field in LIVE_INPUTS[t]), None)
    if other is not None:
        return f"the train step computes it only for {other} terms"
    if field not in BATCH_INPUTS:
        known = ", ".join(sorted(BATCH_INPUTS | LIVE_INPUTS[target]))
        return f"the train step does not compute it (it provides {target} terms with: {known})"
    if field == "returns" and not uses_critic:
        return "only an advantage estimator that uses a critic (uses_critic=True) produces returns"
    if field in CRITIC_BATCH_INPUTS and not inputs.critic_model:
        return "it needs a critic: configure a critic term or an estimator with uses_critic=True"
    return None


def check_inputs(algorithm: AlgorithmConfig) -> None:
    """Raises ValueError naming the entry and the field if the step cannot compute an input
    ``algorithm``'s estimator or terms declare."""
    inputs = step_inputs(algorithm)
    estimator = ADVANTAGE_ESTIMATORS[algorithm.advantage]
    for i, term_config in enumerate(algorithm.loss_terms):
        term = term_config.term
        for field in sorted(set(term.required) - {"loss_mask"}):
            reason = _missing(field, term.target, inputs, estimator.uses_critic)
            if reason is not None:
                raise ValueError(
                    f"loss_terms[{i}]: loss term {term.name!r} ({term.target}) needs "
                    f"{LossInputs.__name__}.{field}, but {reason}"
                )
    for field in sorted(inputs.advantage):
        if field not in ADVANTAGE_INPUTS:
            raise ValueError(
                f"advantage: estimator {estimator.name!r} "
                f"needs {AdvantageInputs.__name__}.{field}, "
                "which the train step does not compute"
            )
        if field in CRITIC_ADVANTAGE_INPUTS and not inputs.critic_model:
            raise ValueError(
                f"advantage: estimator {estimator.name!r} "
                f"needs {AdvantageInputs.__name__}.{field}, "
                "which needs a critic: register the estimator with uses_critic=True"
            )


ROUTER_INPUTS = ("router_logits", "router_experts")  # an MoE model's forward only


def check_model_inputs(algorithm: AlgorithmConfig, moe_layers: int) -> None:
    """Raises ValueError naming the entry and the field if ``algorithm``'s terms read the
    router (:data:`ROUTER_INPUTS`, e.g. ``router_balance``, ``router_z``) of a model with no
    MoE layers (``moe_layers``: ``sum(model.config.moe_layers)``; 0 for a dense Qwen3)."""
    if moe_layers > 0:
        return
    for i, term_config in enumerate(algorithm.loss_terms):
        term = term_config.term
        field = next((f for f in ROUTER_INPUTS if f in term.required), None)
        if field is not None:
            raise ValueError(
                f"loss_terms[{i}]: loss term {term.name!r} ({term.target}) needs "
                f"{LossInputs.__name__}.{field}, but the model has no MoE layers (a dense "
                "model has no router): drop the term or train an MoE model"
            )
