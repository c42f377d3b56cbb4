"""FrozenLake's task sets: random solvable maps of one split, as :class:`~envs.protocol.EnvTasks`
(the factory :func:`make_tasks` that ``envs.make("frozenlake", ...)`` calls, and the one path
that builds FrozenLake tasks from a seed).

The options (:class:`FrozenLakeOptions`, ``task.options`` of a config) are the maps and the
dynamics; their defaults are this project's FrozenLake: 4x4 maps with random start and goal
cells and slippery moves that go where intended 80% of the time. Train and test maps come
from disjoint splits (a content hash bit of each map, :func:`envs.frozenlake.maps.map_split`),
drawn from streams 0 and 1 of ``seed``, so no test map is ever trained on.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from agentrl_jax.validation import BOOL, check_fields, integer, real, setting
from envs.protocol import EnvOptionError, EnvTasks

SPLIT_STREAMS = {"train": 0, "test": 1}  # each split's stream of the seed
# The largest map: its observation is map_size^2 cells (a token each under the isolating
# tokenizer), and exact Q* multiplies by an [S, 4 S] kernel, S = map_size^2: at 32 that is
# 1,024 cells per observation and a 16 MB kernel, at 64 already 4,096 cells and 268 MB.
MAX_MAP_SIZE = 32


@dataclasses.dataclass(frozen=True)
class FrozenLakeOptions:
    """FrozenLake's options (``task.options``), validated on construction."""

    map_size: int = setting(4, integer(2, MAX_MAP_SIZE))
    # probability that a cell is frozen
    frozen_p: float = setting(0.8, real(0.0, 1.0, lo_open=True))
    # else start top-left, goal bottom-right
    random_start_goal: bool = setting(True, BOOL)
    slippery: bool = setting(True, BOOL)
    # P(intended move) when slippery (gymnasium: 1/3)
    success_rate: float = setting(0.8, real(0.0, 1.0))

    def __post_init__(self):
        check_fields("task.options", self)


_DEFAULTS = FrozenLakeOptions()


def make_tasks(
    *,
    map_size: int = _DEFAULTS.map_size,
    frozen_p: float = _DEFAULTS.frozen_p,
    random_start_goal: bool = _DEFAULTS.random_start_goal,
    slippery: bool = _DEFAULTS.slippery,
    success_rate: float = _DEFAULTS.success_rate,
    t_max: int = 70,
    seed: int = 0,
    split: str = "test",
    limit: int = 32,
) -> EnvTasks:
    """``limit`` maps of ``split`` ("train" or "test": disjoint) from ``seed``, as a jitted text
    environment whose largest budget is ``t_max`` (paper §2: 70); ``min_turns`` are the maps'
    shortest paths."""
    import jax  # noqa: PLC0415 (the registry imports this module; jax waits for a call)

    from envs.frozenlake import maps as fl_maps  # noqa: PLC0415
    from envs.frozenlake.text_env import FrozenLakeTextConfig, FrozenLakeTextEnv  # noqa: PLC0415

    options = FrozenLakeOptions(map_size, frozen_p, random_start_goal, slippery, success_rate)
    if split not in SPLIT_STREAMS:
        raise EnvOptionError(f"split: must be one of {', '.join(SPLIT_STREAMS)}, got {split!r}")
    tiles = np.asarray(
        fl_maps.generate(
            jax.random.fold_in(jax.random.key(seed), SPLIT_STREAMS[split]),
            limit,
            size=options.map_size,
            p=options.frozen_p,
            random_start_goal=options.random_start_goal,
            split=split,
        )
    )
    env = FrozenLakeTextEnv(
        tiles,
        FrozenLakeTextConfig(
            t_max=t_max, is_slippery=options.slippery, success_rate=options.success_rate
        ),
    )
    return EnvTasks(
        env,
        tuple(f"{split} map {i}" for i in range(limit)),
        np.asarray(env.structural_bounds(np.arange(limit)), np.int64),
    )
