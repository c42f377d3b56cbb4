"""FrozenLake in pure JAX (gymnax style), its maps, text interface and exact Q*."""

from envs.frozenlake.env import (
    EnvParams,
    EnvState,
    Transition,
    branch_probabilities,
    make_params,
    reset,
    reset_to_map,
    rollout,
    step,
    step_autoreset_batch,
    step_batch,
    step_branch,
)
from envs.frozenlake.grid import (
    ACTION_NAMES,
    DOWN,
    FROZEN,
    GOAL,
    HOLE,
    LEFT,
    RIGHT,
    START,
    UP,
    map_from_strings,
    map_to_strings,
)
from envs.frozenlake.gym_adapter import ENV_ID, FrozenLakeJaxEnv, register_env
from envs.frozenlake.maps import default_map, generate, is_solvable, map_split
from envs.frozenlake.text import INVALID, parse_action, render

register_env()

from envs.frozenlake.tasks import FrozenLakeOptions, make_tasks  # noqa: E402
from envs.registry import register  # noqa: E402

register(
    "frozenlake",
    make_tasks,
    label="FrozenLake",
    max_response_tokens=512,
    max_context=16384,
    option_type=FrozenLakeOptions,
)

__all__ = [
    "ACTION_NAMES",
    "DOWN",
    "ENV_ID",
    "FROZEN",
    "GOAL",
    "HOLE",
    "INVALID",
    "LEFT",
    "RIGHT",
    "START",
    "UP",
    "EnvParams",
    "EnvState",
    "FrozenLakeJaxEnv",
    "Transition",
    "branch_probabilities",
    "default_map",
    "generate",
    "is_solvable",
    "make_params",
    "map_from_strings",
    "map_split",
    "map_to_strings",
    "parse_action",
    "register_env",
    "render",
    "reset",
    "reset_to_map",
    "rollout",
    "step",
    "step_autoreset_batch",
    "step_batch",
    "step_branch",
]
