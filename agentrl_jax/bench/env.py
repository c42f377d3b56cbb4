"""``agentrl-jax bench env``: FrozenLake 8x8 slippery env steps per second.

Ours: :func:`envs.frozenlake.env.step_autoreset_batch` in a jitted ``lax.scan`` of ``steps``
steps over ``B`` parallel envs, uniformly random actions, finished envs restarting on a map
drawn from a pool of random solvable 8x8 maps. Baselines, measured in the same run:

* gymnasium's ``SyncVectorEnv`` of 64 ``FrozenLake-v1`` (8x8, slippery, 100-step limit), the
  usual way to run many gymnasium envs (its own auto-reset);
* a plain vectorized NumPy step over the same ``B`` envs and map pool with the same
  semantics (slip, walls, absorbing holes/goal, time limit, auto-reset from the pool).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax.bench.report import BenchResult, median_time
from envs.frozenlake import env as fl_env
from envs.frozenlake import grid, maps

SIZE = 8
POOL_SIZE = 1024
MAX_STEPS = 100
GYM_ENVS = 64


def _random_actions(key, shape):
    """Uniform actions in 0..3 from the top two bits of one uint32 word each."""
    return (jax.random.bits(key, shape, jnp.uint32) >> 30).astype(jnp.int32)


@jax.jit
def _run_ours(keys, states, params):
    """One auto-reset step per key in ``keys``; returns the end state and the total reward
    (so no step is dead code)."""

    def body(carry, step_key):
        states, total = carry
        action_key, env_key = jax.random.split(step_key)
        actions = _random_actions(action_key, states.pos.shape)
        _, states, reward, _, _ = fl_env.step_autoreset_batch(env_key, states, actions, params)
        return (states, total + reward.sum()), None

    (states, total), _ = jax.lax.scan(body, (states, jnp.float32(0)), keys)
    return states, total


def ours_runner(pool: np.ndarray, batch: int, steps: int, seed: int = 0) -> Callable[[], None]:
    """A function running ``steps`` steps of ``batch`` JAX envs, continuing from the last call."""
    params = fl_env.make_params(pool, is_slippery=True, max_steps=MAX_STEPS)
    key = jax.random.key(seed)
    key, reset_key = jax.random.split(key)
    _, states = jax.vmap(fl_env.reset, in_axes=(0, None))(
        jax.random.split(reset_key, batch), params
    )
    carry = {"key": key, "states": states}

    def run():
        carry["key"], run_key = jax.random.split(carry["key"])
        carry["states"], total = _run_ours(
            jax.random.split(run_key, steps), carry["states"], params
        )
        jax.block_until_ready(total)

    return run


class NumpyFrozenLake:
    """The same batched, auto-resetting env as plain vectorized NumPy (the baseline)."""

    def __init__(
        self, pool: np.ndarray, batch: int, success_rate: float, max_steps: int, seed: int
    ):
        self.n = pool.shape[-1]
        self.pool = pool.reshape(len(pool), -1)
        self.pool_starts = np.argmax(self.pool == grid.START, axis=1)
        self.rng = np.random.default_rng(seed)
        fail = (1.0 - success_rate) / 2.0
        self.thresholds = np.array([fail, fail + success_rate], np.float64)
        self.max_steps = max_steps
        self.rows = np.arange(batch)
        self.drow = np.asarray(grid.ACTION_DROW)
        self.dcol = np.asarray(grid.ACTION_DCOL)
        index = self.rng.integers(len(pool), size=batch)
        self.tiles = self.pool[index].copy()
        self.pos = self.pool_starts[index].copy()
        self.t = np.zeros(batch, np.int64)

    def step(self, actions: np.ndarray) -> np.ndarray:
        """Step every env (all are live: finished ones were reset); returns rewards."""
        u = self.rng.random(len(actions))
        branch = (u >= self.thresholds[0]).astype(np.int64) + (u >= self.thresholds[1])
        taken = (actions + branch - 1) % grid.NUM_ACTIONS
        row = np.clip(self.pos // self.n + self.drow[taken], 0, self.n - 1)
        col = np.clip(self.pos % self.n + self.dcol[taken], 0, self.n - 1)
        self.pos = row * self.n + col
        tile = self.tiles[self.rows, self.pos]
        reward = (tile == grid.GOAL).astype(np.float32)
        self.t += 1
        done = (tile == grid.HOLE) | (tile == grid.GOAL) | (self.t >= self.max_steps)
        finished = np.flatnonzero(done)
        index = self.rng.integers(len(self.pool), size=finished.size)
        self.tiles[finished] = self.pool[index]
        self.pos[finished] = self.pool_starts[index]
        self.t[finished] = 0
        return reward


def numpy_runner(pool: np.ndarray, batch: int, steps: int, seed: int = 0) -> Callable[[], None]:
    envs = NumpyFrozenLake(pool, batch, success_rate=1.0 / 3.0, max_steps=MAX_STEPS, seed=seed)

    def run():
        for _ in range(steps):
            envs.step(envs.rng.integers(grid.NUM_ACTIONS, size=batch))

    return run


def gymnasium_runner(steps: int, seed: int = 0) -> Callable[[], None]:
    """``steps`` steps of gymnasium's SyncVectorEnv over 64 FrozenLake-v1 8x8 slippery envs."""
    vec = gym.vector.SyncVectorEnv(
        [lambda: gym.make("FrozenLake-v1", map_name="8x8", is_slippery=True)] * GYM_ENVS
    )
    vec.reset(seed=seed)
    actions = np.random.default_rng(seed).integers(grid.NUM_ACTIONS, size=(steps, GYM_ENVS))

    def run():
        for a in actions:
            vec.step(a)

    return run


def run(
    batch_sizes: Sequence[int] = (4096, 65536), steps: int = 200, repeats: int = 5
) -> list[BenchResult]:
    """Ours vs gymnasium's vector env and vs the NumPy step, one pair of rows per batch size."""
    pool = np.asarray(maps.generate(jax.random.key(0), POOL_SIZE, size=SIZE, p=0.8))
    gym_seconds = median_time(gymnasium_runner(steps), repeats=repeats)
    gym_rate = GYM_ENVS * steps / gym_seconds
    results = []
    for batch in batch_sizes:
        settings = {
            "map_size": SIZE,
            "slippery": True,
            "envs": batch,
            "steps": steps,
            "map_pool": POOL_SIZE,
            "max_steps": MAX_STEPS,
            "repeats": repeats,
            "jax_backend": jax.default_backend(),
        }
        ours_rate = batch * steps / median_time(ours_runner(pool, batch, steps), repeats=repeats)
        numpy_rate = batch * steps / median_time(numpy_runner(pool, batch, steps), repeats=repeats)
        results.append(
            BenchResult(
                name=f"env steps 8x8 slippery, {batch} envs",
                unit="steps/s",
                ours=ours_rate,
                baseline=gym_rate,
                baseline_name=f"gymnasium SyncVectorEnv({GYM_ENVS}) FrozenLake-v1",
                settings=settings,
            )
        )
        results.append(
            BenchResult(
                name=f"env steps 8x8 slippery, {batch} envs",
                unit="steps/s",
                ours=ours_rate,
                baseline=numpy_rate,
                baseline_name=f"NumPy vectorized step ({batch} envs)",
                settings=settings,
            )
        )
    return results
