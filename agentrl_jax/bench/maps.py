"""``agentrl-jax bench maps``: random solvable FrozenLake maps per second.

Ours: :func:`envs.frozenlake.maps.generate_with_status` making ``count`` maps at once (jitted
bulk rejection sampling, start and goal at the corners). Baseline, in the same run:
gymnasium's ``generate_random_map`` (one map per call, its own DFS rejection loop) with the
same size and frozen probability.
"""

from __future__ import annotations

import itertools

import jax
from gymnasium.envs.toy_text.frozen_lake import generate_random_map

from agentrl_jax.bench.report import BenchResult, median_time
from envs.frozenlake import maps

FROZEN_PROBABILITY = 0.8  # gymnasium's default
MAX_BASELINE_MAPS = 1024  # the baseline's rate is per map; more maps only cost time


def run(count: int = 4096, size: int = 8, repeats: int = 5) -> list[BenchResult]:
    seeds = itertools.count()

    def ours():
        key = jax.random.key(next(seeds))
        maps_, filled = maps.generate_with_status(key, count, size=size, p=FROZEN_PROBABILITY)
        jax.block_until_ready((maps_, filled))

    baseline_count = min(count, MAX_BASELINE_MAPS)

    def gymnasium():
        for _ in range(baseline_count):
            generate_random_map(size=size, p=FROZEN_PROBABILITY, seed=next(seeds))

    ours_rate = count / median_time(ours, repeats=repeats)
    baseline_rate = baseline_count / median_time(gymnasium, repeats=repeats)
    return [
        BenchResult(
            name=f"random solvable {size}x{size} maps, {count} at once",
            unit="maps/s",
            ours=ours_rate,
            baseline=baseline_rate,
            baseline_name="gymnasium generate_random_map",
            settings={
                "count": count,
                "size": size,
                "p": FROZEN_PROBABILITY,
                "baseline_maps_per_run": baseline_count,
                "repeats": repeats,
                "jax_backend": jax.default_backend(),
            },
        )
    ]
