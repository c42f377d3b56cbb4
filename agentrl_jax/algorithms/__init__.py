"""RL algorithms as pure functions on padded arrays: advantages, losses, aggregation, BudgetMix.

No model and no environment inside (see ARCHITECTURE.md). Shapes and masks follow the
conventions in :mod:`agentrl_jax.algorithms.advantages`; losses return
:class:`LossSum` pairs, added with ``combine`` (micro-batches) or ``aggregation.psum``
(devices) and divided once with ``aggregation.mean``.
"""

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
from agentrl_jax.algorithms import aggregation
from agentrl_jax.algorithms.aggregation import AGGREGATION_MODES, LossSum, aggregate, combine
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
    tis_weight,
    kl_penalty,
    logprobs_from_logits,
    policy_loss,
    policy_ratio,
    sequence_log_ratio,
    value_loss,
)
from agentrl_jax.algorithms.registry import (
    ADVANTAGE_ESTIMATORS,
    LOSS_TERMS,
    AdvantageInputs,
    AdvantageOutput,
    AlgorithmConfig,
    LossInputs,
    LossResult,
    LossTermConfig,
    Param,
    TermOutput,
    compute_advantages,
    compute_loss,
    compute_loss_with_metrics,
    metric_sum,
    register_advantage,
    register_loss_term,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGGREGATION_MODES", "aggregation", "KL_ESTIMATORS", "LOSS_TERMS",
    "AdvantageInputs", "AdvantageOutput", "AlgorithmConfig", "BudgetDraw", "LossInputs", "LossResult",
    "LossSum", "LossTermConfig", "Param", "TermOutput",
    "aggregate", "approx_kl", "broadcast_trajectories_to_tokens", "broadcast_turns_to_tokens",
    "budget_anchor_keys", "budget_candidates", "budget_set", "budgets_per_trajectory", "clip_indicator",
    "clipped_surrogate", "clipped_value_loss", "combine", "compute_advantages", "compute_loss",
    "compute_loss_with_metrics", "discounted_returns", "dr_grpo_advantages", "dynamic_sampling_keep",
    "entropy_bonus", "entropy_from_logits", "entropy_loss", "gae_advantages", "gigpo_advantages",
    "gigpo_step_advantages", "group_center", "group_normalize", "grpo_advantages", "gspo_clip_indicator",
    "gspo_loss", "gspo_ratio", "gspo_surrogate", "kl_loss", "kl_penalty", "logprobs_from_logits",
    "masked_whiten", "metric_sum", "overlong_penalty", "place_at_last_valid", "policy_loss", "policy_ratio",
    "register_advantage", "register_loss_term", "remaining_budget", "rloo_advantages", "sample_budgets",
    "sequence_log_ratio", "timeout_reward", "tis_weight", "value_loss",
]
