"""RL algorithms as pure functions on padded arrays: advantages, losses, aggregation, BudgetMix.

No model and no environment inside (see ARCHITECTURE.md); an MoE router's auxiliary losses
(:mod:`.router`) read the router logits and routing a forward hands them. Shapes and masks
follow the conventions in :mod:`agentrl_jax.algorithms.advantages`; losses return
:class:`LossSum` pairs, added with ``combine`` (micro-batches) or ``aggregation.psum``
(devices) and divided once with ``aggregation.mean``.

Estimators and loss terms are registered by name (:mod:`.registry`; the built-ins in
:mod:`.builtin`, registered on import of this package), picked by an
:class:`AlgorithmConfig` (:mod:`.algorithm_config`) and run by :mod:`.compute`.
"""

from agentrl_jax.algorithms import aggregation, builtin, router  # noqa: F401 (builtin registers)
from agentrl_jax.algorithms.advantages import (
    broadcast_trajectories_to_tokens,
    broadcast_turns_to_tokens,
    discounted_returns,
    dr_grpo_advantages,
    gae_advantages,
    gigpo_advantages,
    gigpo_step_advantages,
    group_center,
    group_normalize,
    grpo_advantages,
    masked_whiten,
    place_at_last_valid,
    rloo_advantages,
)
from agentrl_jax.algorithms.aggregation import AGGREGATION_MODES, LossSum, aggregate, combine
from agentrl_jax.algorithms.algorithm_config import AlgorithmConfig, LossTermConfig
from agentrl_jax.algorithms.budgetmix import (
    BudgetDraw,
    budget_anchor_keys,
    budget_candidates,
    budget_set,
    budgets_per_trajectory,
    remaining_budget,
    sample_budgets,
    timeout_reward,
)
from agentrl_jax.algorithms.compute import (
    LossResult,
    compute_advantages,
    compute_loss,
    compute_loss_with_metrics,
    metric_sum,
)
from agentrl_jax.algorithms.dapo import dynamic_sampling_keep, overlong_penalty
from agentrl_jax.algorithms.losses import (
    KL_ESTIMATORS,
    approx_kl,
    clip_indicator,
    clipped_surrogate,
    clipped_value_loss,
    entropy_bonus,
    entropy_from_logits,
    entropy_loss,
    gspo_clip_indicator,
    gspo_loss,
    gspo_ratio,
    gspo_surrogate,
    kl_loss,
    kl_penalty,
    logprobs_from_logits,
    policy_loss,
    policy_ratio,
    sequence_log_ratio,
    tis_weight,
    value_loss,
)
from agentrl_jax.algorithms.registry import (
    ADVANTAGE_ESTIMATORS,
    LOSS_TERMS,
    AdvantageInputs,
    AdvantageOutput,
    LossInputs,
    Param,
    TermOutput,
    register_advantage,
    register_loss_term,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATION_MODES",
    "aggregation",
    "KL_ESTIMATORS",
    "LOSS_TERMS",
    "AdvantageInputs",
    "AdvantageOutput",
    "AlgorithmConfig",
    "BudgetDraw",
    "LossInputs",
    "LossResult",
    "LossSum",
    "LossTermConfig",
    "Param",
    "TermOutput",
    "aggregate",
    "approx_kl",
    "broadcast_trajectories_to_tokens",
    "broadcast_turns_to_tokens",
    "budget_anchor_keys",
    "budget_candidates",
    "budget_set",
    "budgets_per_trajectory",
    "clip_indicator",
    "clipped_surrogate",
    "clipped_value_loss",
    "combine",
    "compute_advantages",
    "compute_loss",
    "compute_loss_with_metrics",
    "discounted_returns",
    "dr_grpo_advantages",
    "dynamic_sampling_keep",
    "entropy_bonus",
    "entropy_from_logits",
    "entropy_loss",
    "gae_advantages",
    "gigpo_advantages",
    "gigpo_step_advantages",
    "group_center",
    "group_normalize",
    "grpo_advantages",
    "gspo_clip_indicator",
    "gspo_loss",
    "gspo_ratio",
    "gspo_surrogate",
    "kl_loss",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_whiten",
    "metric_sum",
    "overlong_penalty",
    "place_at_last_valid",
    "policy_loss",
    "policy_ratio",
    "register_advantage",
    "register_loss_term",
    "remaining_budget",
    "rloo_advantages",
    "router",
    "sample_budgets",
    "sequence_log_ratio",
    "timeout_reward",
    "tis_weight",
    "value_loss",
]
