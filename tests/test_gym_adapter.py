"""The gymnasium adapter: registered, passes gymnasium's checker, behaves like FrozenLake-v1."""

import gymnasium as gym
import jax
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import envs.frozenlake as fl
from envs.frozenlake import grid, maps, text


def test_registered_with_the_usual_time_limit():
    env = gym.make(fl.ENV_ID)
    assert env.spec.max_episode_steps == 100
    assert isinstance(env.unwrapped, fl.FrozenLakeJaxEnv)
    assert env.observation_space == gym.spaces.Discrete(
        16
    ) and env.action_space == gym.spaces.Discrete(4)
    fl.register_env()  # idempotent
    assert gym.make(fl.ENV_ID, maps="8x8").observation_space == gym.spaces.Discrete(64)


def test_passes_gymnasium_env_checker():
    check_env(
        gym.make(fl.ENV_ID, maps="8x8", render_mode="ansi").unwrapped, skip_render_check=False
    )


def test_deterministic_play_equals_frozenlake_v1_including_time_limit():
    ours = gym.make(fl.ENV_ID, maps="8x8", is_slippery=False)
    ref = gym.make("FrozenLake-v1", map_name="8x8", is_slippery=False)
    assert ours.reset(seed=0)[0] == ref.reset(seed=0)[0]
    rng = np.random.default_rng(0)
    ends = 0
    for _ in range(600):
        a = int(rng.integers(4))
        got, want = ours.step(a), ref.step(a)
        assert got[:4] == want[:4]
        if want[2] or want[3]:
            ends += 1
            assert ours.reset()[0] == ref.reset()[0]
    assert ends >= 5


def test_seeded_resets_reproduce_episodes():
    def episode(seed):
        env = gym.make(fl.ENV_ID, maps="4x4")
        obs, _ = env.reset(seed=seed)
        trace = [obs]
        for a in [2, 2, 1, 1, 1, 2, 0, 3] * 3:
            obs, _, term, trunc, _ = env.step(a)
            trace.append(obs)
            if term or trunc:
                break
        return trace

    assert episode(1) == episode(1)
    assert len({tuple(episode(s)) for s in range(8)}) > 1  # slippery: seeds matter


def test_reset_samples_from_a_pool_and_renders_ansi():
    pool = np.asarray(maps.generate(jax.random.key(0), 4, size=5, random_start_goal=True))
    env = gym.make(fl.ENV_ID, maps=pool, render_mode="ansi")
    seen = set()
    for seed in range(12):
        obs, _ = env.reset(seed=seed)
        tiles = np.asarray(env.unwrapped._state.tiles)
        seen.add(tiles.tobytes())
        assert obs == int(np.argmax(tiles.reshape(-1) == grid.START))
        assert env.render() == text.render(tiles, obs)
    assert len(seen) > 1


def test_bad_render_mode_and_step_before_reset():
    with pytest.raises(ValueError, match="render_mode"):
        fl.FrozenLakeJaxEnv(render_mode="human")
    with pytest.raises(gym.error.ResetNeeded):
        fl.FrozenLakeJaxEnv().step(0)
