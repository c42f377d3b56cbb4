"""Smoke tests of the env and maps benchmarks at tiny sizes (fields only, never timings), and
a check that the NumPy baseline steps like our env."""

import math

import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax.bench import env as bench_env
from agentrl_jax.bench import maps as bench_maps
from agentrl_jax.bench.report import BenchResult
from envs.frozenlake import env, maps


def _sane(result: BenchResult, unit: str):
    assert result.unit == unit
    assert math.isfinite(result.ours) and result.ours > 0
    assert math.isfinite(result.baseline) and result.baseline > 0
    assert result.ratio == result.ours / result.baseline
    assert result.name and result.baseline_name


def test_env_benchmark_fields():
    results = bench_env.run(batch_sizes=[8], steps=3, repeats=1)
    assert len(results) == 2
    for r in results:
        _sane(r, "steps/s")
        assert r.settings["envs"] == 8 and r.settings["steps"] == 3
    assert {r.baseline_name.split()[0] for r in results} == {"gymnasium", "NumPy"}


def test_maps_benchmark_fields():
    (result,) = bench_maps.run(count=8, size=4, repeats=1)
    _sane(result, "maps/s")
    assert result.settings["count"] == 8 and result.settings["size"] == 4


class _FixedDraws:
    """Stands in for the baseline's NumPy generator: given uniforms, pool index 0."""

    def __init__(self, u):
        self.u = u

    def random(self, n):
        return self.u[:n]

    def integers(self, high, size):
        return np.zeros(size, np.int64)


def test_numpy_baseline_steps_like_our_env():
    pool = np.asarray(maps.generate(jax.random.key(0), 1, size=8))
    batch = 3000
    rng = np.random.default_rng(0)
    baseline = bench_env.NumpyFrozenLake(pool, batch, success_rate=1.0 / 3.0, max_steps=100, seed=0)
    params = env.make_params(pool, max_steps=100)
    _, one = env.reset_to_map(pool[0])
    states = jax.tree.map(lambda x: jnp.broadcast_to(x, (batch,) + x.shape), one)
    step_all = jax.jit(jax.vmap(env.step_branch, in_axes=(0, 0, 0, None)))
    for _ in range(30):
        actions = rng.integers(4, size=batch)
        u = rng.random(batch).astype(np.float32)  # float32 values, so both compare them exactly
        baseline.rng = _FixedDraws(u.astype(np.float64))
        reward = baseline.step(actions)
        branch = env.branch_from_uniform(jnp.asarray(u), params)
        obs, stepped, ours_reward, done, _ = step_all(
            states, jnp.asarray(actions, jnp.int32), branch, params
        )
        np.testing.assert_array_equal(reward, np.asarray(ours_reward))
        live = ~np.asarray(done)
        np.testing.assert_array_equal(baseline.pos[live], np.asarray(obs)[live])
        # Finished envs restart on pool map 0 in both.
        _, fresh = env.reset_to_map(pool[0])
        restart = done.reshape((-1, 1, 1))
        states = stepped.replace(
            tiles=jnp.where(restart, fresh.tiles, stepped.tiles),
            pos=jnp.where(done, fresh.pos, stepped.pos),
            t=jnp.where(done, fresh.t, stepped.t),
            done=jnp.zeros_like(done),
        )
        np.testing.assert_array_equal(baseline.pos, np.asarray(states.pos))
        np.testing.assert_array_equal(baseline.t, np.asarray(states.t))
