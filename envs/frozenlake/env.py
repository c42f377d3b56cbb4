"""FrozenLake-v1 as pure JAX functions, in the gymnax style.

``reset(key, params) -> (obs, state)`` and ``step(key, state, action, params) -> (obs, state,
reward, done, info)``; the state is a pytree dataclass, ``vmap`` gives the batch, ``lax.scan``
the rollout, and everything is jittable with static shapes.

Semantics are gymnasium's ``FrozenLake-v1`` (``toy_text/frozen_lake.py``) wrapped in its
``TimeLimit``:

* The observation is the flat cell ``row * n + col`` of the player (int32).
* A step from a frozen/start cell moves by :func:`envs.frozenlake.grid.move`; a slippery step
  takes branch ``b`` of ``(a - 1) % 4, a, (a + 1) % 4`` with probabilities
  ``((1 - s) / 2, s, (1 - s) / 2)`` where ``s = success_rate`` (``1/3`` gives gymnasium's
  default uniform form). A non-slippery step always takes ``a``.
* Holes and the goal are absorbing: a step from them stays, with reward 0 (gymnasium's
  ``P[s][a] = [(1.0, s, 0, True)]``). Reward 1 is paid only on *entering* the goal.
* ``max_steps`` plays ``TimeLimit``: the step that brings the step count to ``max_steps`` is
  truncated (``gym.make("FrozenLake-v1", map_name="8x8")`` uses 100, ``FrozenLake8x8-v1`` 200).
* Once ``done``, a state is absorbing: further steps keep it and pay 0. This differs from
  gymnasium only where gymnasium has no defined behaviour (stepping after truncation).

Branch sampling reproduces gymnasium's ``categorical_sample``: with ``u ~ U[0, 1)`` the branch
is the first ``i`` with ``cumsum(probs)[i] > u``. :func:`step_branch` takes the branch index
directly, so tests can replay the exact branch gymnasium picks.

For throughput, :func:`step_batch` draws the randomness of a whole batch with one key
(cheaper than splitting a key per env and vmapping), and :func:`step_autoreset_batch` resets
finished envs from the pre-generated map pool in ``params`` (generating maps inside the step
would be far slower; see :mod:`envs.frozenlake.maps` for making pools in bulk).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.extend.random import threefry_2x32

from envs.frozenlake import grid


@struct.dataclass
class EnvParams:
    """Environment parameters. Build with :func:`make_params`, which validates the maps.

    ``maps`` (int8[M, n, n]) is the pool :func:`reset` samples from, uniformly; it is a pytree
    leaf, so new maps of the same shape do not recompile. The other fields are static (part of
    the compiled program).
    """

    maps: jax.Array
    is_slippery: bool = struct.field(pytree_node=False, default=True)
    success_rate: float = struct.field(pytree_node=False, default=1.0 / 3.0)
    max_steps: int | None = struct.field(pytree_node=False, default=100)

    def __post_init__(self):
        if not isinstance(self.is_slippery, (bool, np.bool_)):
            raise TypeError(f"EnvParams.is_slippery must be a bool, got {self.is_slippery!r}")
        if not 0.0 <= float(self.success_rate) <= 1.0:
            raise ValueError(f"EnvParams.success_rate must be in [0, 1], got {self.success_rate!r}")
        if self.max_steps is not None and (
            not isinstance(self.max_steps, (int, np.integer)) or self.max_steps < 1
        ):
            raise ValueError(
                f"EnvParams.max_steps must be a positive int or None, got {self.max_steps!r}"
            )
        # Leaves may be tracers or placeholders when JAX rebuilds the pytree: check only shapes.
        shape = getattr(self.maps, "shape", None)
        if shape is not None and (len(shape) != 3 or shape[1] != shape[2] or shape[0] < 1):
            raise ValueError(f"EnvParams.maps must have shape [M, n, n] with M >= 1, got {shape}")

    @property
    def size(self) -> int:
        """Side ``n`` of the maps."""
        return self.maps.shape[-1]

    @property
    def num_maps(self) -> int:
        return self.maps.shape[0]


@struct.dataclass
class EnvState:
    """One environment (add a leading axis for a batch).

    tiles: int8[n, n] the map; pos: int32 flat cell of the player; t: int32 steps taken;
    done: bool, True once the player is on a hole or the goal or the time limit is hit.
    """

    tiles: jax.Array
    pos: jax.Array
    t: jax.Array
    done: jax.Array


@struct.dataclass
class Transition:
    """What :func:`rollout` records per step (stacked on a leading time axis)."""

    obs: jax.Array  # int32, observation after the step
    action: jax.Array  # int32, the intended action
    reward: jax.Array  # float32
    done: jax.Array  # bool


def _as_map_pool(maps) -> np.ndarray:
    if isinstance(maps, str):
        if maps not in grid.DEFAULT_MAPS:
            raise ValueError(f"unknown map name {maps!r}; known: {sorted(grid.DEFAULT_MAPS)}")
        maps = grid.DEFAULT_MAPS[maps]
    if isinstance(maps, (list, tuple)) and maps and isinstance(maps[0], str):
        maps = grid.map_from_strings(maps)
    pool = np.asarray(maps)
    if pool.ndim == 2:
        pool = pool[None]
    if pool.ndim != 3 or pool.shape[1] != pool.shape[2] or pool.shape[0] < 1 or pool.shape[1] < 1:
        raise ValueError(f"maps must be one map [n, n] or a pool [M, n, n], got shape {pool.shape}")
    if not np.issubdtype(pool.dtype, np.integer):
        raise ValueError(f"maps must hold integer tile codes, got dtype {pool.dtype}")
    if pool.min() < 0 or pool.max() > grid.GOAL:
        raise ValueError(f"maps hold tile codes outside 0..{grid.GOAL}: {np.unique(pool)}")
    starts = (pool == grid.START).reshape(len(pool), -1).sum(-1)
    bad = np.flatnonzero(starts != 1)
    if bad.size:
        raise ValueError(
            f"every map needs exactly one START tile; map {int(bad[0])} has {int(starts[bad[0]])}"
        )
    return pool.astype(np.int8)


def make_params(
    maps: Any = "4x4",
    *,
    is_slippery: bool = True,
    success_rate: float = 1.0 / 3.0,
    max_steps: int | None = 100,
) -> EnvParams:
    """Validated :class:`EnvParams`.

    ``maps``: a default map name (``"4x4"``, ``"8x8"``), a gymnasium list of strings, one
    ``int8[n, n]`` map or a pool ``int8[M, n, n]`` (e.g. from :mod:`envs.frozenlake.maps`).
    Every map needs exactly one START tile. ``max_steps=None`` disables the time limit.
    """
    return EnvParams(
        maps=jnp.asarray(_as_map_pool(maps)),
        is_slippery=bool(is_slippery),
        success_rate=float(success_rate),
        max_steps=max_steps,
    )


def branch_probabilities(params: EnvParams) -> np.ndarray:
    """float64[3]: probabilities of branches ``(a - 1) % 4, a, (a + 1) % 4`` (gymnasium's)."""
    if not params.is_slippery:
        return np.array([0.0, 1.0, 0.0])
    fail = (1.0 - params.success_rate) / 2.0
    return np.array([fail, params.success_rate, fail])


def branch_from_uniform(u, params: EnvParams):
    """Branch index (int32) for uniforms ``u`` in [0, 1), as gymnasium's categorical_sample.

    gymnasium picks ``argmax(cumsum(probs) > u)``, i.e. the number of cumulative sums
    ``<= u`` among the first two (the third is 1 > u). The float64 sums are compared exactly
    against float32 ``u``.
    """
    c0, c1 = (_float32_ceil(c) for c in np.cumsum(branch_probabilities(params))[:2])
    return (u >= c0).astype(jnp.int32) + (u >= c1).astype(jnp.int32)


def _float32_ceil(x: float) -> np.float32:
    """Smallest float32 >= ``x``: for float32 ``u``, ``u >= _float32_ceil(x)`` iff ``u >= x``
    exactly, so the float64 threshold (e.g. 1/3) is never flipped by rounding."""
    f = np.float32(x)
    return np.nextafter(f, np.float32(np.inf)) if float(f) < x else f


def sample_branch(key, shape: tuple[int, ...], params: EnvParams):
    """int32 branches of the given shape, one uniform each (constant 1 when not slippery)."""
    if not params.is_slippery:
        return jnp.ones(shape, jnp.int32)
    return branch_from_uniform(jax.random.uniform(key, shape), params)


@functools.cache
def _next_cell_table(n: int) -> np.ndarray:
    """int32[n*n, 4]: :func:`grid.move` for every cell and action (one lookup per step is
    cheaper than the division, modulo and clipping inside ``move``)."""
    cells, actions = np.arange(n * n)[:, None], np.arange(grid.NUM_ACTIONS)[None, :]
    return np.asarray(grid.move(cells, actions, n), np.int32)


def reset_to_map(tiles) -> tuple[jax.Array, EnvState]:
    """Start an episode on the given ``int8[n, n]`` map (the player on its START tile)."""
    tiles = jnp.asarray(tiles, jnp.int8)
    pos = grid.start_cell(tiles)
    state = EnvState(tiles=tiles, pos=pos, t=jnp.zeros((), jnp.int32), done=jnp.zeros((), bool))
    return pos, state


def reset(key, params: EnvParams) -> tuple[jax.Array, EnvState]:
    """Start an episode on a map drawn uniformly from ``params.maps``."""
    index = jax.random.randint(key, (), 0, params.num_maps)
    return reset_to_map(params.maps[index])


def step_branch(state: EnvState, action, branch, params: EnvParams):
    """One step with the slip branch given (0, 1, 2 = ``(a-1)%4, a, (a+1)%4``).

    ``branch`` is ignored when the map is not slippery. Returns ``(obs, state, reward, done,
    info)`` with ``info = {"terminated", "truncated"}`` describing the new state.
    """
    n = state.tiles.shape[-1]
    flat = state.tiles.reshape(-1)
    action = jnp.asarray(action, jnp.int32)
    taken = (action + branch - 1) % grid.NUM_ACTIONS if params.is_slippery else action
    # A hole or the goal is absorbing even when ``done`` was not set (gymnasium's P there).
    frozen = state.done | grid.is_terminal_tile(flat[state.pos])
    moved = jnp.asarray(_next_cell_table(n))[state.pos, taken]
    pos = jnp.where(frozen, state.pos, moved).astype(jnp.int32)
    tile = flat[pos]
    reward = jnp.where(~frozen & (tile == grid.GOAL), 1.0, 0.0).astype(jnp.float32)
    t = state.t + jnp.where(frozen, 0, 1).astype(jnp.int32)
    terminated = grid.is_terminal_tile(tile)
    truncated = jnp.zeros((), bool) if params.max_steps is None else t >= params.max_steps
    done = state.done | terminated | truncated
    new_state = EnvState(tiles=state.tiles, pos=pos, t=t, done=done)
    return pos, new_state, reward, done, {"terminated": terminated, "truncated": truncated}


def step(key, state: EnvState, action, params: EnvParams):
    """One step, drawing the slip branch from ``key`` (gymnax signature)."""
    return step_branch(state, action, sample_branch(key, (), params), params)


def step_batch(key, states: EnvState, actions, params: EnvParams):
    """:func:`step` for a batch (leading axis of ``states``/``actions``) with one key.

    The uniforms of the whole batch come from one draw instead of one split key per env.
    """
    branches = sample_branch(key, actions.shape, params)
    return jax.vmap(step_branch, in_axes=(0, 0, 0, None))(states, actions, branches, params)


def step_autoreset_batch(key, states: EnvState, actions, params: EnvParams):
    """:func:`step_batch`, then envs that finished restart on a map drawn from the pool.

    As in gymnax, ``obs`` and the state are those after the reset where ``done``; reward,
    done and info are those of the step itself. For speed, one draw of two uint32 words per
    env gives both the slip uniform and the pool index (``word % M``: each index has
    probability ``1/M`` up to a relative error below ``M / 2**32``).
    """
    words = _two_words_each(key, actions.shape)
    branches = branch_from_uniform(_unit_float(words[0]), params)
    _, stepped, reward, done, info = jax.vmap(step_branch, in_axes=(0, 0, 0, None))(
        states, actions, branches, params
    )
    index = (words[1] % jnp.uint32(params.num_maps)).astype(jnp.int32)
    # START cells of the pool once per call, not an argmax over every env's new map.
    pool_starts = grid.start_cell(params.maps)
    fresh = EnvState(
        tiles=params.maps[index],
        pos=pool_starts[index],
        t=jnp.zeros_like(stepped.t),
        done=jnp.zeros_like(done),
    )

    def keep(new, old):
        return jnp.where(done.reshape(done.shape + (1,) * (new.ndim - 1)), new, old)

    states = jax.tree.map(keep, fresh, stepped)
    return states.pos, states, reward, done, info


def _two_words_each(key, shape: tuple[int, ...]):
    """uint32[2, *shape]: two independent uniform words per element.

    With a threefry key (JAX's default) both 32-bit halves of each threefry2x32 hash are
    used: half the hashing of ``jax.random.bits(key, (2, *shape))``, which keeps one word per
    hash (hashing is most of the cost of a batched step on CPU). Other keys fall back to ``bits``.
    """
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    if not typed or str(jax.random.key_impl(key)) != "threefry2x32":
        return jax.random.bits(key, (2,) + shape, jnp.uint32)
    halves = jax.random.key_data(key)
    counts = jnp.arange(2 * math.prod(shape), dtype=jnp.uint32)  # distinct counter pairs
    return threefry_2x32((halves[0], halves[1]), counts).reshape((2,) + shape)


def _unit_float(words):
    """float32 uniforms on the grid k * 2**-23 in [0, 1) from the top 23 bits of uint32 words
    (the resolution of ``jax.random.uniform``)."""
    return (words >> 9).astype(jnp.float32) * np.float32(2.0**-23)


def rollout(key, state: EnvState, actions, params: EnvParams) -> tuple[EnvState, Transition]:
    """Play the given int32[T] actions from ``state`` with ``lax.scan``.

    Returns the final state and a :class:`Transition` stacked on a leading axis of T. Steps
    after ``done`` keep the state and pay 0. ``vmap`` it for a batch.
    """

    def body(state, inputs):
        step_key, action = inputs
        obs, state, reward, done, _ = step(step_key, state, action, params)
        return state, Transition(obs=obs, action=action, reward=reward, done=done)

    actions = jnp.asarray(actions, jnp.int32)
    keys = jax.random.split(key, actions.shape[0])
    return jax.lax.scan(body, state, (keys, actions))
