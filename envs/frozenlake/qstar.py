"""Exact finite-horizon Q* of FrozenLake, and BFS distances to the goal (paper §2, §7).

``Q[h, s, a]`` is the optimal expected discounted return of taking action ``a`` in cell
``s`` with ``h`` moves left, under gymnasium FrozenLake-v1's dynamics:

    Q[0] = 0
    Q[h, s, a] = sum_{s'} P(s' | s, a) * (r(s') + gamma * live(s') * V[h - 1, s'])
    V[h, s]    = max_a Q[h, s, a]

with ``r(s') = 1`` when ``s'`` is the goal (reward on entering it) and ``live(s') = 0`` on
holes and the goal (absorbing: no further reward). Terminal cells themselves have
``Q = 0``. The paper's step quality (§7.1) for a state at turn ``t`` of budget ``B`` is
``Q[B - t, s, a]``; see :func:`action_quality`.

How it is computed (why it is fast): the grid moves do not depend on the map, only the
rewards and terminals do. So one small map-independent operator
``M[s', s * 4 + a] = P(s' | s, a)`` (3 non-zeros per column) turns the values of the next
cells of all maps, ``W[b, s']``, into all their Q-values with one matrix product per
step, ``W @ M``, with maps on the rows: the output comes out in the final
``[map, h, cell, action]`` layout with no transpose. On a 2-core CPU this was ~3x faster
than a batch-minor gather formulation once its output is transposed to that layout (the
gather itself is as fast, the transpose is not). The operator has ``4 n^4`` entries, fine
for the paper's grid sizes.

Distances (:func:`distance_to_goal`) are shortest numbers of deterministic moves over
non-hole cells, computed by repeated relaxation in ``lax.while_loop`` (a BFS in layers).
Cells that cannot reach the goal, and holes, get :data:`UNREACHABLE`.

Everything takes maps ``int8[..., n, n]`` with any leading batch dims (tile codes of
:mod:`envs.frozenlake.grid`) and is jittable with static shapes.
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from envs.frozenlake.grid import (
    GOAL,
    HOLE,
    NUM_ACTIONS,
    TILE_LETTERS,
    is_terminal_tile,
    move,
    slip_actions,
    start_cell,
)

UNREACHABLE = int(np.iinfo(np.int32).max)
"""Distance of holes and of cells with no hole-free path to the goal (``> any budget``)."""

DEFAULT_GAMMA = 0.95  # paper §7: finite-horizon DP with gamma = 0.95


# --------------------------------------------------------------------------- validation


def _check_tiles(tiles, name: str = "tiles") -> None:
    """Shape/dtype checks always; value checks only when ``tiles`` is concrete."""
    shape = np.shape(tiles)
    if len(shape) < 2 or shape[-1] != shape[-2] or shape[-1] == 0:
        raise ValueError(f"{name} must have shape [..., n, n] with n >= 1, got {shape}")
    if not jnp.issubdtype(jnp.result_type(tiles), jnp.integer):
        raise ValueError(f"{name} must hold integer tile codes, got dtype {jnp.result_type(tiles)}")
    if not isinstance(tiles, jax.core.Tracer):
        values = np.asarray(tiles)
        if values.size and (values.min() < 0 or values.max() >= len(TILE_LETTERS)):
            raise ValueError(
                f"{name} holds codes outside 0..{len(TILE_LETTERS) - 1} ({TILE_LETTERS}): "
                f"min {values.min()}, max {values.max()}"
            )


def _check_unit_interval(value, name: str) -> None:
    if isinstance(value, numbers.Real) and not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


# --------------------------------------------------------------------------- Q*


def transition_operator(n: int, success_rate, *, is_slippery: bool, dtype=jnp.float32):
    """The map-independent move kernel ``M[s', s * 4 + a] = P(s' | s, a)``: ``[S, 4 S]``.

    Gymnasium's dynamics from a non-terminal cell: deterministic, or slippery with
    ``success_rate`` on the intended action and ``(1 - success_rate) / 2`` on each of
    the two perpendicular ones; a move into the border stays (two slips that both hit
    the border add up on the same cell). ``success_rate`` may be traced.
    """
    num_cells = n * n
    cells = np.arange(num_cells)
    actions = np.arange(NUM_ACTIONS)
    if is_slippery:
        # next cell of each of the 3 slip directions: [S, 4, 3], gymnasium's slip order
        nxt = move(cells[:, None, None], slip_actions(actions)[None], n)
        fail = (1.0 - success_rate) / 2.0
        probs = jnp.stack([fail, success_rate, fail]).astype(dtype)  # [3]
    else:
        nxt = move(cells[:, None], actions[None], n)[..., None]  # [S, 4, 1]
        probs = jnp.ones((1,), dtype)
    one_hot = nxt[None] == cells[:, None, None, None]  # [S', S, 4, k]
    # A plain weighted sum, not a matmul: exact weights even where matmuls default to TF32.
    kernel = jnp.sum(jnp.where(one_hot, probs, 0), axis=-1, dtype=dtype)
    return kernel.reshape(num_cells, num_cells * NUM_ACTIONS)


def backward_induction(
    tiles, horizon: int, gamma, success_rate, *, is_slippery: bool, dtype=jnp.float32
):
    """Unjitted core of :func:`q_star` for ``tiles`` ``[B, n, n]``: ``Q`` ``[B, H+1, S, 4]``.

    Maps are rows of every array, so each step is one ``[B, S] @ [S, 4 S]`` product.
    """
    num_maps, n = tiles.shape[0], tiles.shape[-1]
    num_cells = n * n
    flat = tiles.reshape(num_maps, num_cells)
    entry_reward = (flat == GOAL).astype(dtype)  # r(s'): 1 on entering the goal
    # Q of a terminal source cell is 0: mask every (s, a) column of a hole or the goal.
    live_source = jnp.repeat((~is_terminal_tile(flat)).astype(dtype), NUM_ACTIONS, axis=1)
    operator = transition_operator(n, success_rate, is_slippery=is_slippery, dtype=dtype)
    gamma = jnp.asarray(gamma, dtype)

    def step(h, carry):
        v_prev, q = carry  # v_prev: V[h-1] [B, S]; q: the whole output [B, H+1, 4 S]
        # Value of entering s' with h-1 moves left afterwards. V is already 0 on terminal
        # cells (their Q is masked), which ends the return there as live(s') requires.
        next_value = entry_reward + gamma * v_prev
        q_h = jnp.dot(next_value, operator, precision=lax.Precision.HIGHEST) * live_source
        q = lax.dynamic_update_index_in_dim(q, q_h, h, axis=1)
        return q_h.reshape(num_maps, num_cells, NUM_ACTIONS).max(axis=-1), q

    q0 = jnp.zeros((num_maps, horizon + 1, num_cells * NUM_ACTIONS), dtype)
    v0 = jnp.zeros((num_maps, num_cells), dtype)
    # Writing each step in place (instead of stacking scan outputs and transposing)
    # keeps the [map, h, ...] layout free.
    _, q = lax.fori_loop(1, horizon + 1, step, (v0, q0))
    return q.reshape(num_maps, horizon + 1, num_cells, NUM_ACTIONS)


_backward_induction_jit = jax.jit(
    backward_induction, static_argnames=("horizon", "is_slippery", "dtype")
)


def q_star(
    tiles,
    horizon: int,
    *,
    gamma=DEFAULT_GAMMA,
    is_slippery: bool = True,
    success_rate=1.0 / 3.0,
    dtype=jnp.float32,
):
    """Exact finite-horizon ``Q[..., h, s, a]`` for ``h = 0..horizon`` (see module doc).

    Args:
      tiles: ``int[..., n, n]`` tile codes; any leading batch dims.
      horizon: ``H >= 0``, the most moves left that is needed (e.g. the largest budget).
      gamma: discount in [0, 1] (may be traced).
      is_slippery: gymnasium's slippery dynamics (else deterministic).
      success_rate: probability of the intended move when slippery, gymnasium's
        ``success_rate`` (may be traced); the two perpendicular moves share the rest.
      dtype: ``jnp.float32``, or ``jnp.float64`` with ``jax_enable_x64`` on.

    Returns:
      ``Q`` of shape ``[..., H + 1, n * n, 4]``. It is jitted once per
      (batch shape, n, horizon, is_slippery, dtype); gamma and success_rate do not retrace.
    """
    _check_tiles(tiles)
    if isinstance(horizon, bool) or not isinstance(horizon, numbers.Integral) or horizon < 0:
        raise ValueError(f"horizon must be an int >= 0, got {horizon!r}")
    _check_unit_interval(gamma, "gamma")
    _check_unit_interval(success_rate, "success_rate")
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.float32, jnp.float64):
        raise ValueError(f"dtype must be float32 or float64, got {dtype}")
    if dtype == jnp.float64 and not jax.config.jax_enable_x64:
        raise ValueError("dtype float64 needs jax_enable_x64 (e.g. jax.experimental.enable_x64())")
    tiles = jnp.asarray(tiles)
    batch_shape, n = tiles.shape[:-2], tiles.shape[-1]
    q = _backward_induction_jit(
        tiles.reshape(-1, n, n),
        int(horizon),
        gamma,
        success_rate,
        is_slippery=bool(is_slippery),
        dtype=dtype,
    )
    return q.reshape(*batch_shape, *q.shape[1:])


def state_values(q):
    """``V[..., h, s] = max_a Q[..., h, s, a]`` (0 on terminal cells and at ``h = 0``)."""
    return jnp.max(q, axis=-1)


def v_star(tiles, horizon: int, **kwargs):
    """``V[..., h, s]`` for ``h = 0..horizon``; keyword arguments as :func:`q_star`."""
    return state_values(q_star(tiles, horizon, **kwargs))


# The accessors read one map's table; jnp.vectorize broadcasts them over batch dims.


def _action_values_one(q, remaining, pos):
    horizon_plus_one, num_cells = q.shape[-3], q.shape[-2]
    inside = (remaining >= 0) & (remaining < horizon_plus_one) & (pos >= 0) & (pos < num_cells)
    values = q[jnp.clip(remaining, 0, horizon_plus_one - 1), jnp.clip(pos, 0, num_cells - 1)]
    return jnp.where(inside, values, jnp.nan)


@functools.partial(jnp.vectorize, signature="(h,s,a),(),()->(a)")
def action_values(q, remaining, pos):
    """``Q[..., remaining, pos, :]``: the 4 action values with ``remaining`` moves left.

    ``remaining`` and ``pos`` broadcast against ``q``'s batch dims. Out of range
    (``remaining`` not in ``0..H``, ``pos`` not a cell) gives NaN rather than a clamped,
    wrong value.
    """
    return _action_values_one(q, remaining, pos)


@functools.partial(jnp.vectorize, signature="(h,s,a),(),(),()->()")
def action_quality(q, remaining, pos, action):
    """Step quality of §7: ``Q*(pos, action)`` with ``remaining`` moves left (incl. this one).

    For a state at turn ``t`` (moves already made) under budget ``B``, ``remaining =
    B - t``. An out-of-range ``remaining``/``pos``, or an ``action`` outside 0..3 (e.g. an
    unparsable response's sentinel), gives NaN; the caller decides how to score it.
    """
    values = _action_values_one(q, remaining, pos)
    valid = (action >= 0) & (action < NUM_ACTIONS)
    return jnp.where(valid, values[jnp.clip(action, 0, NUM_ACTIONS - 1)], jnp.nan)


@functools.partial(jnp.vectorize, signature="(h,s,a),(),()->()")
def greedy_action(q, remaining, pos):
    """``argmax_a Q[remaining, pos, a]`` (int32; ties go to the lowest action code).

    Returns -1 when ``remaining``/``pos`` is out of range. Where every action is worth 0
    (terminal cell, or no way to score in time) the answer is 0 (Left) and means nothing.
    """
    values = _action_values_one(q, remaining, pos)
    return jnp.where(jnp.isnan(values[0]), -1, jnp.argmax(values)).astype(jnp.int32)


# --------------------------------------------------------------------------- BFS


def _neighbour_min(dist):
    """Min over the 4 grid neighbours of ``dist`` ``[..., n, n]`` (border: UNREACHABLE).

    A move into the border stays in place, which can never shorten a path, so the border
    counts as unreachable.
    """
    pad = [(0, 0)] * (dist.ndim - 2) + [(1, 1), (1, 1)]
    p = jnp.pad(dist, pad, constant_values=UNREACHABLE)
    return jnp.minimum(
        jnp.minimum(p[..., 1:-1, :-2], p[..., 1:-1, 2:]),  # left, right
        jnp.minimum(p[..., :-2, 1:-1], p[..., 2:, 1:-1]),  # up, down
    )


@jax.jit
def _distance_grid(tiles):
    passable = tiles != HOLE
    dist0 = jnp.where(tiles == GOAL, 0, UNREACHABLE).astype(jnp.int32)

    def relax(carry):
        dist, _ = carry
        nb = _neighbour_min(dist)
        one_more = jnp.where(nb < UNREACHABLE, nb + 1, UNREACHABLE)  # saturating +1
        new = jnp.where(passable, jnp.minimum(dist, one_more), dist)
        return new, jnp.any(new != dist)

    # Each pass extends the settled frontier by one move; stop when nothing changes
    # (at most n*n passes; under vmap, until every map has settled).
    dist, _ = lax.while_loop(lambda carry: carry[1], relax, (dist0, jnp.array(True)))
    return dist


def distance_to_goal(tiles):
    """Fewest deterministic moves from each cell to the goal: ``int32[..., n * n]``.

    Paths go over non-hole cells and end on entering the goal (distance 0 there). Holes
    and cells with no such path get :data:`UNREACHABLE`. A map with several goals gets
    the distance to the nearest.
    """
    _check_tiles(tiles)
    tiles = jnp.asarray(tiles)
    return _distance_grid(tiles).reshape(*tiles.shape[:-2], -1)


def shortest_path_length(tiles, distance=None):
    """Fewest moves from the start to the goal, ``int32[...]`` (UNREACHABLE if none).

    The §2 structural bound: a map can be solved within budget ``T`` only if this is
    ``<= T``. Maps are expected to have exactly one start tile (cell 0 is used if none).
    ``distance`` may pass a precomputed :func:`distance_to_goal`.
    """
    _check_tiles(tiles)
    tiles = jnp.asarray(tiles)
    dist = distance_to_goal(tiles) if distance is None else jnp.asarray(distance)
    return jnp.take_along_axis(dist, start_cell(tiles)[..., None], axis=-1)[..., 0]


def solvable_within(tiles, budget, distance=None):
    """The §2 necessary condition ``shortest_path_length(tiles) <= budget``: ``bool[...]``."""
    return shortest_path_length(tiles, distance) <= jnp.asarray(budget)


def error_actions(tiles, pos, *, include_holes: bool = False, distance=None):
    """Actions from ``pos`` whose deterministic move increases the distance to the goal.

    For §7.2 error injection: ``bool[..., 4]`` indexed by action code, for maps
    ``[..., n, n]`` and cells ``pos`` ``int[...]``. Definitions:

    - the distance is :func:`distance_to_goal` (deterministic moves; slipping is not
      considered, an injected error is a chosen move);
    - a move into the border leaves the distance unchanged, so it is never an error;
    - a move into a hole ends the episode, leaving no state to continue from, so it is
      not counted unless ``include_holes`` (then it counts: its distance is UNREACHABLE);
    - from a terminal cell (hole, goal) or one that cannot reach the goal, no action is
      an error (there is no distance to increase).

    On a grid, a move between two reachable cells changes the distance by exactly +-1,
    so without holes an error puts the agent exactly one move further from the goal.
    ``distance`` may pass a precomputed :func:`distance_to_goal`.
    """
    _check_tiles(tiles)
    tiles = jnp.asarray(tiles)
    n = tiles.shape[-1]
    dist = distance_to_goal(tiles) if distance is None else jnp.asarray(distance)
    flat = tiles.reshape(*tiles.shape[:-2], -1)
    pos = jnp.broadcast_to(jnp.asarray(pos, jnp.int32), flat.shape[:-1])[..., None]
    nxt = move(pos, jnp.arange(NUM_ACTIONS), n)  # [..., 4]
    d_here = jnp.take_along_axis(dist, pos, axis=-1)
    d_next = jnp.take_along_axis(dist, nxt, axis=-1)
    tile_here = jnp.take_along_axis(flat, pos, axis=-1)
    into_hole = jnp.take_along_axis(flat, nxt, axis=-1) == HOLE
    can_move = ~is_terminal_tile(tile_here) & (d_here < UNREACHABLE)
    return can_move & (d_next > d_here) & (include_holes | ~into_hole)
