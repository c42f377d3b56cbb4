"""``agentrl-jax bench qstar``: exact finite-horizon Q* for many random maps.

Ours: :func:`envs.frozenlake.qstar.q_star`, jitted and warm, on all maps at once.
Baselines, measured in the same run on the same maps and producing the same
``float32[maps, H + 1, n * n, 4]`` table:

- per-map NumPy: a Python loop over maps, each doing the textbook backward induction
  over h with NumPy (gather the next cells' values, weight the slips, max over actions);
- batched NumPy: all maps at once, one ``[maps, S] @ [S, 4 S]`` product per step with the same
  map-independent move kernel ours uses (built here in NumPy) (the fastest NumPy form we found, so
  the comparison is JAX vs NumPy on one algorithm, not two algorithms).

Maps are gymnasium's ``generate_random_map(size, p=0.8, seed=seed + i)``. Before timing,
each baseline's table is checked against ours.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from gymnasium.envs.toy_text.frozen_lake import generate_random_map

from agentrl_jax.bench.report import BenchResult, median_time
from envs.frozenlake.grid import (
    GOAL,
    NUM_ACTIONS,
    is_terminal_tile,
    map_from_strings,
    move,
    slip_actions,
)
from envs.frozenlake.qstar import DEFAULT_GAMMA, q_star

AGREEMENT_ATOL = 1e-5  # float32 tables computed in a different order


def random_maps(num_maps: int, size: int = 8, p: float = 0.8, seed: int = 0) -> np.ndarray:
    """``int8[num_maps, size, size]`` from gymnasium's solvable-map generator."""
    return np.stack(
        [
            map_from_strings(generate_random_map(size=size, p=p, seed=seed + i))
            for i in range(num_maps)
        ]
    )


def _slip_tables(n: int, success_rate: float):
    """Next cell of each slip ``[S, 4, 3]`` and the slip probabilities ``[3]``."""
    cells, actions = np.arange(n * n), np.arange(NUM_ACTIONS)
    next_cell = move(cells[:, None, None], slip_actions(actions)[None], n)
    fail = (1.0 - success_rate) / 2.0
    return next_cell, np.array([fail, success_rate, fail], np.float32)


def numpy_q_star_per_map(
    tiles: np.ndarray, horizon: int, gamma: float = DEFAULT_GAMMA, success_rate: float = 1 / 3
) -> np.ndarray:
    """Slippery Q* one map at a time: ``tiles`` ``[B, n, n]`` -> ``float32[B, H+1, S, 4]``."""
    num_maps, n = tiles.shape[0], tiles.shape[-1]
    next_cell, probs = _slip_tables(n, success_rate)
    out = np.zeros((num_maps, horizon + 1, n * n, NUM_ACTIONS), np.float32)
    for b in range(num_maps):
        flat = tiles[b].reshape(-1)
        reward = (flat == GOAL).astype(np.float32)
        live = (~is_terminal_tile(flat)).astype(np.float32)[:, None]
        v = np.zeros(n * n, np.float32)
        for h in range(1, horizon + 1):
            next_value = reward + np.float32(gamma) * v  # v is 0 on terminal cells
            q = next_value[next_cell] @ probs  # [S, 4]
            q *= live  # Q of a hole or the goal is 0
            out[b, h] = q
            v = q.max(axis=1)
    return out


def numpy_q_star_batched(
    tiles: np.ndarray, horizon: int, gamma: float = DEFAULT_GAMMA, success_rate: float = 1 / 3
) -> np.ndarray:
    """Slippery Q* for all maps at once: ``[B, n, n]`` -> ``float32[B, H+1, S, 4]``."""
    num_maps, n = tiles.shape[0], tiles.shape[-1]
    num_cells = n * n
    next_cell, probs = _slip_tables(n, success_rate)
    operator = np.zeros((num_cells, num_cells, NUM_ACTIONS), np.float32)  # [s', s, a]
    cells, actions = np.ogrid[:num_cells, :NUM_ACTIONS]
    for k in range(3):  # unbuffered add: two slips into the same wall add up
        np.add.at(operator, (next_cell[..., k], cells, actions), probs[k])
    operator = operator.reshape(num_cells, num_cells * NUM_ACTIONS)
    flat = tiles.reshape(num_maps, num_cells)
    reward = (flat == GOAL).astype(np.float32)
    live_source = np.repeat(~is_terminal_tile(flat), NUM_ACTIONS, axis=1).astype(np.float32)
    out = np.zeros((num_maps, horizon + 1, num_cells * NUM_ACTIONS), np.float32)
    v = np.zeros((num_maps, num_cells), np.float32)
    for h in range(1, horizon + 1):
        q = (reward + np.float32(gamma) * v) @ operator
        q *= live_source
        out[:, h] = q
        v = q.reshape(num_maps, num_cells, NUM_ACTIONS).max(axis=2)
    return out.reshape(num_maps, horizon + 1, num_cells, NUM_ACTIONS)


def run(
    num_maps: int = 1024,
    horizon: int = 70,
    repeats: int = 5,
    *,
    size: int = 8,
    per_map_limit: int | None = None,
    seed: int = 0,
) -> list[BenchResult]:
    """Median wall time of Q* for ``num_maps`` random slippery maps, ours vs both baselines.

    ``per_map_limit`` times the per-map loop on only that many maps and scales its time
    linearly to ``num_maps`` (it is a loop over independent maps); ``settings`` says so.
    """
    if num_maps < 1 or horizon < 0 or repeats < 1:
        raise ValueError(
            f"need num_maps >= 1, horizon >= 0, repeats >= 1; got {num_maps}, {horizon}, {repeats}"
        )
    tiles = random_maps(num_maps, size=size, seed=seed)
    tiles_device = jnp.asarray(tiles)
    per_map_count = num_maps if per_map_limit is None else max(1, min(per_map_limit, num_maps))

    ours_q = np.asarray(q_star(tiles_device, horizon))
    diffs = {
        "batched": np.abs(numpy_q_star_batched(tiles, horizon) - ours_q).max(),
        "per_map": np.abs(
            numpy_q_star_per_map(tiles[:per_map_count], horizon) - ours_q[:per_map_count]
        ).max(),
    }
    for name, diff in diffs.items():
        if not diff <= AGREEMENT_ATOL:
            raise RuntimeError(f"{name} NumPy Q* differs from ours by {diff} (> {AGREEMENT_ATOL})")

    ours_s = median_time(
        lambda: jax.block_until_ready(q_star(tiles_device, horizon)), repeats=repeats
    )
    batched_s = median_time(lambda: numpy_q_star_batched(tiles, horizon), repeats=repeats)
    per_map_s = median_time(
        lambda: numpy_q_star_per_map(tiles[:per_map_count], horizon), repeats=repeats
    ) * (num_maps / per_map_count)

    settings = {
        "maps": num_maps,
        "size": size,
        "p_frozen": 0.8,
        "horizon": horizon,
        "gamma": DEFAULT_GAMMA,
        "is_slippery": True,
        "dtype": "float32",
        "output": f"Q[{num_maps}, {horizon + 1}, {size * size}, 4]",
        "map_source": f"gymnasium generate_random_map, seeds {seed}..{seed + num_maps - 1}",
        "repeats": repeats,
        "statistic": "median",
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0]),
    }
    name = f"Q* {num_maps} random {size}x{size} slippery maps, H={horizon}"
    return [
        BenchResult(
            name,
            "ms",
            ours_s * 1e3,
            per_map_s * 1e3,
            "NumPy per-map loop",
            {
                **settings,
                "per_map_timed_maps": per_map_count,
                "per_map_scaled": per_map_count != num_maps,
                "max_abs_diff": float(diffs["per_map"]),
            },
        ),
        BenchResult(
            name,
            "ms",
            ours_s * 1e3,
            batched_s * 1e3,
            "NumPy batched",
            {**settings, "max_abs_diff": float(diffs["batched"])},
        ),
    ]
