"""A ``gymnasium.Env`` over the JAX FrozenLake, for people used to gymnasium.

Importing :mod:`envs.frozenlake` registers it as :data:`ENV_ID`::

    import gymnasium as gym
    import envs.frozenlake  # noqa: F401  (registers the id)

    env = gym.make("agentrl_jax/FrozenLakeJax-v0", maps="8x8", render_mode="ansi")
    obs, info = env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(2)
    print(env.render())

Like ``gym.make("FrozenLake-v1")``, ``gym.make`` adds a 100-step ``TimeLimit`` (pass
``max_episode_steps`` to change it); the wrapped JAX env runs without its own limit. The
JAX key is drawn from gymnasium's ``np_random`` at every ``reset``, so ``reset(seed=s)``
makes an episode reproducible.
"""

from __future__ import annotations

from typing import Any, ClassVar

import gymnasium as gym
import jax
import numpy as np
from gymnasium import spaces

from envs.frozenlake import env as jax_env
from envs.frozenlake import text

ENV_ID = "agentrl_jax/FrozenLakeJax-v0"


@jax.jit
def _reset(key, params):
    key, reset_key = jax.random.split(key)
    obs, state = jax_env.reset(reset_key, params)
    return key, obs, state


@jax.jit
def _step(key, state, action, params):
    key, step_key = jax.random.split(key)
    return (key,) + jax_env.step(step_key, state, action, params)


class FrozenLakeJaxEnv(gym.Env):
    """FrozenLake-v1 dynamics from :mod:`envs.frozenlake.env`, one env at a time.

    ``maps``: anything :func:`envs.frozenlake.env.make_params` takes (a default map name, a
    list of strings, one map or a pool of maps that ``reset`` samples from).
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(
        self,
        render_mode: str | None = None,
        maps: Any = "4x4",
        is_slippery: bool = True,
        success_rate: float = 1.0 / 3.0,
    ):
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.render_mode = render_mode
        self.params = jax_env.make_params(
            maps, is_slippery=is_slippery, success_rate=success_rate, max_steps=None
        )
        self.observation_space = spaces.Discrete(self.params.size**2)
        self.action_space = spaces.Discrete(4)
        self._key = None
        self._state = None

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        seed_word = int(self.np_random.integers(0, 2**32, dtype=np.uint64))
        self._key, obs, self._state = _reset(jax.random.key(seed_word), self.params)
        return int(obs), {}

    def step(self, action):
        if self._state is None:
            raise gym.error.ResetNeeded("call reset() before step()")
        if not self.action_space.contains(action):
            raise ValueError(f"action must be in 0..3, got {action!r}")
        self._key, obs, self._state, reward, _, info = _step(
            self._key, self._state, np.int32(action), self.params
        )
        obs, reward, terminated, truncated = jax.device_get(
            (obs, reward, info["terminated"], info["truncated"])
        )
        return int(obs), float(reward), bool(terminated), bool(truncated), {}

    def render(self) -> str | None:
        if self.render_mode is None:
            gym.logger.warn("render() without render_mode; create the env with render_mode='ansi'")
            return None
        if self._state is None:
            raise gym.error.ResetNeeded("call reset() before render()")
        return text.render(self._state.tiles, self._state.pos)


def register_env() -> None:
    """Register :data:`ENV_ID` with gymnasium (idempotent)."""
    if ENV_ID not in gym.registry:
        gym.register(
            id=ENV_ID,
            entry_point="envs.frozenlake.gym_adapter:FrozenLakeJaxEnv",
            max_episode_steps=100,
        )
