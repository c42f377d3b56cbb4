"""Pass@K and Pass@T from rollouts (PAPER.md §2, §3): sampling, not statistics.

:mod:`passk` computes the metrics from counts; this module produces the counts by playing a
policy (:class:`~agentrl_jax.sampling.Policy`) on a task set with
:class:`~agentrl_jax.rollout.MultiTurnRollout`:

* Pass@K: ``n`` (default 128) trajectories per task at the full budget ``T_max``;
* Pass@T: ``n`` (default 8) trajectories per task at each budget ``T``. Every budget is a
  separate rollout whose runner has that budget fixed, so its prompts state it (system
  prompt and every turn); a shorter budget is sampled afresh, never cut from longer runs.

Both return the budget-keyed structure :data:`passk.BudgetResults` ``{T: (n [tasks],
c [tasks])}``. Decoding defaults to the paper's evaluation setting, temperature 0.6 and
top-p 0.9 (:data:`EVAL_SAMPLING`).

Randomness: budget ``T`` uses ``fold_in(key, T)`` and its ``c``-th call of tasks
``fold_in(that, c)``; so runs with the same key give two policies the same environment
randomness (slips), and a budget's samples do not depend on which other budgets are run.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import jax
import numpy as np

from agentrl_jax.algorithms.budgetmix import budget_set
from agentrl_jax.evaluation import passk
from agentrl_jax.rollout import MultiTurnRollout, RolloutConfig
from agentrl_jax.sampling import Policy, SamplingConfig
from agentrl_jax.trajectory import Trajectory

EVAL_SAMPLING = SamplingConfig(temperature=0.6, top_p=0.9)
"""Evaluation decoding (§3): temperature 0.6, top-p 0.9."""

PASS_AT_K_SAMPLES = max(passk.PASS_AT_K_RANGE)  # 128: every k of the Pass@K curve is defined


def eval_rollout_config(**overrides) -> RolloutConfig:
    """A :class:`RolloutConfig` with evaluation decoding (:data:`EVAL_SAMPLING`) unless
    ``overrides`` say otherwise."""
    return RolloutConfig(**{"sampling": EVAL_SAMPLING, **overrides})


def _task_ids(task_ids, num_tasks: int) -> np.ndarray:
    tasks = np.asarray(task_ids)
    if (
        tasks.ndim != 1
        or tasks.size == 0
        or tasks.dtype.kind not in "iu"
        or tasks.min() < 0
        or tasks.max() >= num_tasks
    ):
        raise ValueError(
            f"task_ids must be a non-empty 1-D int array in [0, {num_tasks}), got {task_ids!r}"
        )
    return tasks.astype(np.int64)


def _calls(tasks: np.ndarray, tasks_per_call: int | None):
    """``(call index, padded task chunk, real count)``: chunks of ``tasks_per_call`` tasks, the
    last padded by repeating its final task, so every call has the same shapes."""
    if tasks_per_call is not None and tasks_per_call < 1:
        raise ValueError(f"`tasks_per_call` must be >= 1, got {tasks_per_call}")
    size = tasks_per_call or tasks.size
    for call, start in enumerate(range(0, tasks.size, size)):
        chunk = tasks[start : start + size]
        yield call, np.concatenate([chunk, np.full(size - chunk.size, chunk[-1])]), chunk.size


def _runner(env, tokenizer, budget: int, samples: int, config: RolloutConfig | None):
    if samples < 1:
        raise ValueError(f"`samples` must be >= 1, got {samples}")
    config = dataclasses.replace(
        config or eval_rollout_config(), group_size=samples, budget=int(budget)
    )
    return MultiTurnRollout(env, tokenizer, config)


def sample_successes(
    env,
    tokenizer,
    policy: Policy,
    task_ids,
    key: jax.Array,
    *,
    budget: int,
    samples: int,
    config: RolloutConfig | None = None,
    tasks_per_call: int | None = None,
) -> np.ndarray:
    """``samples`` trajectories of every task at ``budget``: ``[tasks, samples]`` bool success.

    Args:
      env: a text environment (:class:`envs.protocol.TextEnv`).
      tokenizer: the policy's tokenizer (with a chat template).
      policy: what samples the responses.
      task_ids: ``[tasks]`` indices into the environment's task set.
      budget: the turn budget ``T`` stated in the prompt and enforced.
      samples: ``n``, trajectories per task (the rollout's group size).
      config: rollout settings (default :func:`eval_rollout_config`); its ``group_size`` and
        ``budget`` are replaced by ``samples`` and ``budget``.
      tasks_per_call: tasks per rollout call (bounds memory: one call holds ``tasks_per_call
        * samples`` rows); every call is padded to this many tasks (repeating one) so all
        calls have the same shapes. Default: all tasks in one call.
    """
    tasks = _task_ids(task_ids, env.num_tasks())
    runner = _runner(env, tokenizer, budget, samples, config)
    out = np.zeros((tasks.size, samples), bool)
    done = 0
    for call, chunk, real in _calls(tasks, tasks_per_call):
        result = runner(policy, chunk, jax.random.fold_in(key, call))
        success = np.asarray(jax.device_get(result.trajectory.success)).reshape(chunk.size, samples)
        out[done : done + real] = success[:real]
        done += real
    return out


def rollout_tasks(
    env,
    tokenizer,
    policy: Policy,
    task_ids,
    key: jax.Array,
    *,
    budget: int,
    samples: int,
    config: RolloutConfig | None = None,
    tasks_per_call: int | None = None,
) -> Trajectory:
    """The trajectories themselves (host NumPy leaves), ``samples`` per task, rows of task
    ``i`` at ``i * samples ...``; arguments and keys as :func:`sample_successes`, so with the
    same key these are the trajectories whose successes it counts. ``group_id`` restarts at
    0 in each call."""
    tasks = _task_ids(task_ids, env.num_tasks())
    runner = _runner(env, tokenizer, budget, samples, config)
    parts = []
    for call, chunk, real in _calls(tasks, tasks_per_call):
        traj = jax.device_get(runner(policy, chunk, jax.random.fold_in(key, call)).trajectory)
        parts.append(jax.tree.map(lambda x: np.asarray(x)[: real * samples], traj))
    return jax.tree.map(lambda *xs: np.concatenate(xs), *parts)


def successes_by_budget(
    env,
    tokenizer,
    policy: Policy,
    task_ids,
    key: jax.Array,
    *,
    budgets: Iterable[int],
    samples: int,
    config: RolloutConfig | None = None,
    tasks_per_call: int | None = None,
) -> dict[int, np.ndarray]:
    """``{T: [tasks, samples] success}``: one fresh rollout per budget (see the module doc),
    the successes :func:`counts_by_budget` counts. (Not BudgetMix's
    :func:`~agentrl_jax.algorithms.budgetmix.sample_budgets`, which draws training budgets.)"""
    budgets = sorted({int(b) for b in budgets})
    if not budgets or budgets[0] < 1 or budgets[-1] > env.t_max:
        raise ValueError(f"budgets must be non-empty, in [1, t_max={env.t_max}], got {budgets}")
    return {
        b: sample_successes(
            env,
            tokenizer,
            policy,
            task_ids,
            jax.random.fold_in(key, b),
            budget=b,
            samples=samples,
            config=config,
            tasks_per_call=tasks_per_call,
        )
        for b in budgets
    }


def counts_by_budget(successes: dict[int, np.ndarray]) -> passk.BudgetResults:
    """``{T: [tasks, samples] bool}`` -> ``{T: (n [tasks], c [tasks])}``."""
    return {b: passk.counts_from_successes(s) for b, s in sorted(successes.items())}


def pass_at_k_results(
    env,
    tokenizer,
    policy: Policy,
    task_ids,
    key: jax.Array,
    *,
    samples: int = PASS_AT_K_SAMPLES,
    budget: int | None = None,
    config: RolloutConfig | None = None,
    tasks_per_call: int | None = None,
) -> passk.BudgetResults:
    """Pass@K data: ``{T: (n, c)}`` at the one budget ``T`` (default the full ``T_max``)."""
    budget = env.t_max if budget is None else budget
    return counts_by_budget(
        successes_by_budget(
            env,
            tokenizer,
            policy,
            task_ids,
            key,
            budgets=[budget],
            samples=samples,
            config=config,
            tasks_per_call=tasks_per_call,
        )
    )


def pass_at_t_results(
    env,
    tokenizer,
    policy: Policy,
    task_ids,
    key: jax.Array,
    *,
    budgets: Sequence[int] | None = None,
    samples: int = passk.PASS_AT_T_K,
    config: RolloutConfig | None = None,
    tasks_per_call: int | None = None,
) -> passk.BudgetResults:
    """Pass@T data: ``{T: (n, c)}`` for every budget (default :func:`default_budgets`)."""
    budgets = default_budgets(env.t_max) if budgets is None else budgets
    return counts_by_budget(
        successes_by_budget(
            env,
            tokenizer,
            policy,
            task_ids,
            key,
            budgets=budgets,
            samples=samples,
            config=config,
            tasks_per_call=tasks_per_call,
        )
    )


def default_budgets(t_max: int) -> tuple[int, ...]:
    """The Pass@T sweep: BudgetMix's budget set (every 10% of ``T_max``, §5:
    :func:`~agentrl_jax.algorithms.budgetmix.budget_set`) and the four table levels
    25/50/75/100% (§3), ascending. FrozenLake's 70 gives 7, 14, 17, 21, 28, 35, ..."""
    return tuple(sorted(set(budget_set(t_max)) | set(passk.budget_levels(t_max))))


# ---------------------------------------------------------------- structural bound (§2)


def structural_bound(min_turns, budgets: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """``(budgets [B], share of tasks whose fewest turns are <= T [B])`` (§2): ``min_turns``
    ``[tasks]`` from the environment (its ``structural_bounds``; FrozenLake: each map's
    shortest path, unreachable goals above any budget)."""
    budgets = np.asarray(sorted({int(b) for b in budgets}), np.int64)
    return budgets, passk.structural_upper_bound(np.asarray(min_turns), budgets)
