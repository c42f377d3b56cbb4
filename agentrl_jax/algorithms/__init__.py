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
    gae_advantages,
    gigpo_advantages,
    gigpo_step_advantages,
    group_normalize,
    grpo_advantages,
    masked_whiten,
    place_at_last_valid,
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
from agentrl_jax.algorithms.losses import (
    KL_ESTIMATORS,
    clip_indicator,
    clipped_surrogate,
    clipped_value_loss,
    entropy_bonus,
    entropy_from_logits,
    entropy_loss,
    kl_loss,
    kl_penalty,
    logprobs_from_logits,
    policy_loss,
    policy_ratio,
    value_loss,
)
from agentrl_jax.algorithms.registry import (
    ADVANTAGE_ESTIMATORS,
    LOSS_TERMS,
    AdvantageInputs,
    AdvantageOutput,
    AlgorithmConfig,
    LossInputs,
    LossTermConfig,
    Param,
    compute_advantages,
    compute_loss,
    register_advantage,
    register_loss_term,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGGREGATION_MODES", "aggregation", "KL_ESTIMATORS", "LOSS_TERMS",
    "AdvantageInputs", "AdvantageOutput", "AlgorithmConfig", "BudgetDraw", "LossInputs", "LossSum",
    "LossTermConfig", "Param",
    "aggregate", "broadcast_trajectories_to_tokens", "broadcast_turns_to_tokens", "budget_anchor_keys",
    "budget_candidates", "budget_set", "budgets_per_trajectory", "clip_indicator", "clipped_surrogate",
    "clipped_value_loss", "combine", "compute_advantages", "compute_loss", "discounted_returns",
    "entropy_bonus", "entropy_from_logits", "entropy_loss", "gae_advantages", "gigpo_advantages",
    "gigpo_step_advantages", "group_normalize", "grpo_advantages", "kl_loss", "kl_penalty",
    "logprobs_from_logits", "masked_whiten", "place_at_last_valid", "policy_loss", "policy_ratio",
    "register_advantage", "register_loss_term", "remaining_budget", "sample_budgets",
    "timeout_reward", "value_loss",
]
