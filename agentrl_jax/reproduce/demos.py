"""Demonstrations for the warm start, played through the real rollout.

A pretrained LLM is competent but fallible; a random-init policy is neither. The reproduction
makes its base policy by behaviour cloning the environment study's demonstrator
(:meth:`agentrl_jax.reproduce.studies.Study.demonstrator`: FrozenLake's Q*-greedy agent, the other
environments' gold answers, each with mistakes). :func:`collect_demos` plays it through the real
rollout, so the demonstrations are token for token what a policy sees and samples (chat template,
budget prompt, stop token), at budgets drawn as in BudgetMix.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import numpy as np

from agentrl_jax.rollout import MultiTurnRollout, RolloutConfig
from agentrl_jax.sampling import ScriptedPolicy
from agentrl_jax.sampling.policy import Script
from agentrl_jax.trajectory import Trajectory


def concat_trajectories(parts: Sequence[Trajectory]) -> Trajectory:
    """Rows of several trajectories (same record length and turns) as one, on the host."""
    return jax.tree.map(lambda *x: np.concatenate([np.asarray(a) for a in x]), *parts)


def collect_demos(
    env,
    tokenizer,
    demonstrator: Script,
    task_ids: Sequence[int],
    key: jax.Array,
    *,
    demos_per_task: int,
    max_response_tokens: int,
    max_context: int,
    tasks_per_call: int = 32,
    on_call: Callable[[], None] | None = None,
) -> Trajectory:
    """``demos_per_task`` demonstrations of each task, budgets drawn as in BudgetMix.

    Returns the concatenated :class:`Trajectory` (host arrays). ``on_call`` runs after each
    rollout call of ``tasks_per_call`` tasks (a progress hook).
    """
    runner = MultiTurnRollout(
        env,
        tokenizer,
        RolloutConfig(
            group_size=demos_per_task,
            budget=None,
            max_response_tokens=max_response_tokens,
            max_context=max_context,
        ),
    )
    policy = ScriptedPolicy(tokenizer, demonstrator)
    task_ids = np.asarray(task_ids)
    parts = []
    for i, start in enumerate(range(0, len(task_ids), tasks_per_call)):
        result = runner(
            policy, task_ids[start : start + tasks_per_call], jax.random.fold_in(key, i)
        )
        parts.append(jax.device_get(result.trajectory))
        if on_call is not None:
            on_call()
    return concat_trajectories(parts)


def demo_calls(num_tasks: int, tasks_per_call: int = 32) -> int:
    """How many rollout calls :func:`collect_demos` makes (for a progress bar)."""
    return -(-num_tasks // tasks_per_call)
