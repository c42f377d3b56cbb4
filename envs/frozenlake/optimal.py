"""Optimal play on FrozenLake under a turn budget: the exact success probability and
episodes of the Q*-greedy policy.

With ``gamma = 1`` the finite-horizon value ``V[B, start]`` of :mod:`envs.frozenlake.qstar`
is exactly the highest probability, over all policies, of reaching the goal within ``B``
moves (reward 1 on entering the goal, 0 otherwise, no discount). Playing greedily on that
``Q`` with the *remaining* budget ``B - t`` attains it, so the success rate of
:func:`play_greedy` episodes estimates the same number: the solve job prints both, which
checks the environment and the dynamic programme against each other.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from envs.frozenlake import env as fl_env
from envs.frozenlake import grid, qstar


def success_probability(q_undiscounted, tiles, budget):
    """``V[budget, start]`` of a ``gamma = 1`` Q table: ``float32[...]``.

    ``q_undiscounted``: ``[..., H + 1, n * n, 4]`` from ``q_star(..., gamma=1.0)``;
    ``tiles``: ``int8[..., n, n]``; ``budget``: int in ``0..H`` (broadcasts).
    """
    start = grid.start_cell(tiles)
    return jnp.max(qstar.action_values(q_undiscounted, budget, start), axis=-1)


def play_greedy(key, tiles, q, budget, params: fl_env.EnvParams, max_turns: int):
    """One episode of the Q*-greedy policy with remaining budget ``budget - t`` at turn t.

    Args:
      key: PRNG key for the slips.
      tiles: ``int8[n, n]`` map; ``q``: its ``[H + 1, n * n, 4]`` table (``H >= budget``).
      budget: the turn budget B (may be traced); no move is made at turns ``t >= B``.
      params: dynamics (``is_slippery``, ``success_rate``); its ``max_steps`` should be
        ``None`` or ``>= max_turns`` so that only the budget ends the episode.
      max_turns: static length of the returned arrays (``>= budget``).

    Returns:
      ``(success bool[], turns int32[], positions int32[max_turns + 1], actions
      int32[max_turns])``; positions after the end repeat the last one, actions there are -1.
      ``vmap`` it over maps and keys.
    """
    obs, state = fl_env.reset_to_map(tiles)

    def body(carry, inputs):
        state, success = carry
        t, step_key = inputs
        live = (t < budget) & ~state.done
        action = qstar.greedy_action(q, budget - t, state.pos)
        _, stepped, reward, _, _ = fl_env.step(step_key, state, jnp.maximum(action, 0), params)
        state = jax.tree.map(lambda new, old: jnp.where(live, new, old), stepped, state)
        success = success | (live & (reward > 0))
        return (state, success), (state.pos, jnp.where(live, action, -1))

    steps = (jnp.arange(max_turns), jax.random.split(key, max_turns))
    (state, success), (positions, actions) = jax.lax.scan(body, (state, jnp.zeros((), bool)), steps)
    positions = jnp.concatenate([obs[None], positions])
    return success, state.t, positions, actions
