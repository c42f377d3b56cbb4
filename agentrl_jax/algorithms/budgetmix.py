"""BudgetMix (§5): sampled turn budgets, shared per task group.

The budget set of a task with maximum budget ``T_max`` is
``T(x) = unique{(k * T_max) // 10 : k = 1..10} \\ {0}`` (integer arithmetic). Each task
group draws one budget B uniformly from its set; all G trajectories of the group share B,
so group-relative advantages compare like with like. A trajectory that has not succeeded
within B turns gets reward 0, and GiGPO anchors become (state, B - t).

Shapes: ``K`` task groups, ``N`` trajectories, ``T`` turns. ``group_index [N]`` maps each
trajectory to its task group in ``[0, K)`` (dense, unlike the free-form group ids of
:mod:`.advantages`; ``jnp.unique(ids, return_inverse=True)`` outside jit densifies).

Adaptive option (the paper suggests it, does not test it): given each task's structural
bound (FrozenLake: shortest start-to-goal path in moves; a budget below it cannot succeed),
budgets below the bound are dropped from the set before drawing. If every budget is below
the bound (including the task being unsolvable, bound > T_max), the draw falls back to the
largest budget, T_max itself, i.e. ordinary full-budget training for that task, and the
group is flagged in ``BudgetDraw.fell_back`` so the caller can count or skip it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

NUM_FRACTIONS = 10  # budgets are k/10 of T_max, k = 1..10


def budget_set(t_max: int) -> tuple[int, ...]:
    """The budget set of one task, ascending, as Python ints (for configs and evaluation).

    >>> budget_set(70)
    (7, 14, 21, 28, 35, 42, 49, 56, 63, 70)
    >>> budget_set(5)
    (1, 2, 3, 4, 5)
    """
    if isinstance(t_max, bool) or not isinstance(t_max, int) or t_max < 1:
        raise ValueError(f"t_max: must be an int >= 1, got {t_max!r}")
    return tuple(sorted({(k * t_max) // NUM_FRACTIONS for k in range(1, NUM_FRACTIONS + 1)} - {0}))


def budget_candidates(t_max: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Jittable budget sets: t_max [K] int -> (budgets [K, 10] int32, valid [K, 10] bool).

    ``budgets[:, k-1] = (k * t_max) // 10``; ``valid`` drops 0 and repeats (the sequence is
    non-decreasing in k, so a repeat equals its left neighbour). Row k's valid entries are
    exactly ``budget_set(t_max[k])``.
    """
    t_max = jnp.asarray(t_max, jnp.int32)
    if t_max.ndim != 1:
        raise ValueError(f"t_max: expected shape [K], got {tuple(t_max.shape)}")
    k = jnp.arange(1, NUM_FRACTIONS + 1, dtype=jnp.int32)
    budgets = (k[None, :] * t_max[:, None]) // NUM_FRACTIONS
    previous = jnp.concatenate([jnp.zeros_like(budgets[:, :1]), budgets[:, :-1]], axis=1)
    return budgets, (budgets > 0) & (budgets != previous)


class BudgetDraw(NamedTuple):
    budgets: jax.Array  # [K] int32, one budget per task group
    fell_back: jax.Array  # [K] bool, True where the adaptive filter left nothing (B = T_max)


def sample_budgets(
    key: jax.Array, t_max: jax.Array, structural_bound: jax.Array | None = None
) -> BudgetDraw:
    """Draws one budget per task group, uniformly from its (optionally filtered) budget set.

    key: a JAX PRNG key; t_max [K] int; structural_bound [K] int or None (no filter).
    With a bound, budgets ``< bound`` are excluded; see the module docstring for the fallback.
    """
    budgets, valid = budget_candidates(t_max)
    fell_back = jnp.zeros(budgets.shape[0], bool)
    if structural_bound is not None:
        structural_bound = jnp.asarray(structural_bound, jnp.int32)
        if structural_bound.shape != budgets.shape[:1]:
            raise ValueError(
                f"structural_bound: expected shape {budgets.shape[:1]}, "
                f"got {tuple(structural_bound.shape)}"
            )
        feasible = valid & (budgets >= structural_bound[:, None])
        fell_back = ~jnp.any(feasible, axis=1)
        largest = jnp.arange(NUM_FRACTIONS) == NUM_FRACTIONS - 1  # (10 * T_max) // 10 == T_max
        valid = jnp.where(fell_back[:, None], largest[None, :], feasible)
    logits = jnp.where(valid, 0.0, -jnp.inf)
    choice = jax.random.categorical(key, logits, axis=-1)
    return BudgetDraw(jnp.take_along_axis(budgets, choice[:, None], axis=1)[:, 0], fell_back)


def budgets_per_trajectory(group_budgets: jax.Array, group_index: jax.Array) -> jax.Array:
    """Shares each group's budget with its trajectories: [K], group_index [N] -> [N]."""
    return group_budgets[group_index]


def timeout_reward(
    rewards: jax.Array, succeeded: jax.Array, turns_used: jax.Array, budgets: jax.Array
) -> jax.Array:
    """Reward under budget B: the reward if the trajectory succeeded within B turns, else 0.

    rewards [N] float, succeeded [N] bool, turns_used [N] int (turns taken up to success
    or stop), budgets [N] int -> [N] float32.
    """
    on_time = succeeded.astype(bool) & (turns_used <= budgets)
    return jnp.where(on_time, rewards, 0.0).astype(jnp.float32)


def remaining_budget(budgets: jax.Array, num_turns: int) -> jax.Array:
    """``B - t`` for turn t = 0..T-1 (t = turns already completed): budgets [N] -> [N, T] int32."""
    return budgets.astype(jnp.int32)[:, None] - jnp.arange(num_turns, dtype=jnp.int32)[None, :]


def budget_anchor_keys(state_keys: jax.Array, budgets: jax.Array) -> jax.Array:
    """GiGPO anchor under BudgetMix, (s_t, B - t), as a composite key ``[N, T, 2]`` int32.

    state_keys [N, T] int (the caller's state id per turn, e.g. the FrozenLake cell),
    budgets [N] int. Two steps share an anchor iff both columns are equal, so no hashing
    and no collisions; pass the result as ``anchor_keys`` to the GiGPO functions. State
    keys of up to 32 bits are fine (int32 or uint32: the cast to int32 is one-to-one).
    """
    if state_keys.ndim != 2 or budgets.shape != state_keys.shape[:1]:
        raise ValueError(
            f"budget_anchor_keys: state_keys must be [N, T] and budgets [N], "
            f"got {tuple(state_keys.shape)} and {tuple(budgets.shape)}"
        )
    remaining = remaining_budget(budgets, state_keys.shape[1])
    return jnp.stack([state_keys.astype(jnp.int32), remaining], axis=-1)
