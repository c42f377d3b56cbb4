"""The JAX FrozenLake against gymnasium's FrozenLake-v1 (the reference), exactly."""

import copy

import chex
import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv

from envs.frozenlake import env, grid, maps

SETTINGS = [  # (is_slippery, success_rate)
    (False, 1.0 / 3.0),
    (True, 1.0 / 3.0),
    (True, 0.6),
    (True, 1.0),
]


def _parity_maps():
    """The two default maps and 22 random ones: corner and random start/goal, sizes 4 to 8."""
    out = [maps.default_map("4x4"), maps.default_map("8x8")]
    for i, (size, p, rsg) in enumerate(
        [(4, 0.7, False), (6, 0.75, True), (8, 0.8, False), (8, 0.7, True)]
    ):
        batch = maps.generate(
            jax.random.key(100 + i), 6 if size == 8 else 5, size=size, p=p, random_start_goal=rsg
        )
        out += list(np.asarray(batch))
    return out


PARITY_MAPS = _parity_maps()
# Slices of PARITY_MAPS reused as pools (each generate() shape compiles once, ~1 s).
POOL_4_CORNER = np.stack(PARITY_MAPS[2:7])
POOL_6_RANDOM_START_GOAL = np.stack(PARITY_MAPS[7:12])
POOL_8_CORNER = np.stack(PARITY_MAPS[12:18])
POOL_8_RANDOM_START_GOAL = np.stack(PARITY_MAPS[18:24])


@jax.jit
def _all_outcomes(tiles, params):
    """Next cell, reward and terminated for every (cell, action, branch) from our step_branch."""
    n2 = tiles.size
    cells, actions, branches = jnp.meshgrid(
        jnp.arange(n2), jnp.arange(4), jnp.arange(3), indexing="ij"
    )
    state = env.EnvState(tiles=tiles, pos=jnp.int32(0), t=jnp.int32(0), done=jnp.bool_(False))

    def one(pos, action, branch):
        obs, _, reward, _, info = env.step_branch(state.replace(pos=pos), action, branch, params)
        return obs, reward, info["terminated"]

    f = jax.vmap(jax.vmap(jax.vmap(one)))
    return f(cells.astype(jnp.int32), actions.astype(jnp.int32), branches.astype(jnp.int32))


def _ours_kernel(tiles, is_slippery, success_rate):
    params = env.make_params(
        tiles, is_slippery=is_slippery, success_rate=success_rate, max_steps=None
    )
    nxt, rew, term = map(np.asarray, _all_outcomes(jnp.asarray(tiles), params))
    probs = env.branch_probabilities(params)
    n2 = tiles.size
    P = np.zeros((n2, 4, n2))
    R = np.full((n2, 4, n2), np.nan)
    T = np.zeros((n2, 4, n2), bool)
    for s in range(n2):
        for a in range(4):
            for b in range(3):  # gymnasium's entry order, so float sums round identically
                if not is_slippery and b != 1:
                    continue
                P[s, a, nxt[s, a, b]] += probs[b]
                R[s, a, nxt[s, a, b]] = rew[s, a, b]
                T[s, a, nxt[s, a, b]] = term[s, a, b]
    return P, R, T, (nxt, rew, term)


def _gym_kernel(tiles, is_slippery, success_rate):
    genv = FrozenLakeEnv(
        desc=grid.map_to_strings(tiles), is_slippery=is_slippery, success_rate=success_rate
    )
    n2 = tiles.size
    P = np.zeros((n2, 4, n2))
    R = np.full((n2, 4, n2), np.nan)
    T = np.zeros((n2, 4, n2), bool)
    for s in range(n2):
        for a in range(4):
            for prob, s2, r, t in genv.P[s][a]:
                P[s, a, s2] += prob
                R[s, a, s2] = r
                T[s, a, s2] = t
    return P, R, T, genv.P


@pytest.mark.parametrize("is_slippery,success_rate", SETTINGS)
def test_transition_kernel_equals_gymnasium(is_slippery, success_rate):
    assert len(PARITY_MAPS) >= 22
    for i, tiles in enumerate(PARITY_MAPS):
        P, R, T, (nxt, rew, term) = _ours_kernel(tiles, is_slippery, success_rate)
        gP, gR, gT, raw = _gym_kernel(tiles, is_slippery, success_rate)
        np.testing.assert_array_equal(P, gP, err_msg=f"map {i} kernel")
        np.testing.assert_array_equal(R, gR, err_msg=f"map {i} rewards")
        np.testing.assert_array_equal(T, gT, err_msg=f"map {i} terminals")
        # Stronger: branch b of ours is gymnasium's b-th entry (not only the same sums).
        for s in range(tiles.size):
            for a in range(4):
                entries = raw[s][a]
                if len(entries) == 3:
                    got = [
                        (int(nxt[s, a, b]), float(rew[s, a, b]), bool(term[s, a, b]))
                        for b in range(3)
                    ]
                    assert got == [(e[1], float(e[2]), bool(e[3])) for e in entries], (i, s, a)


def test_branch_probabilities_match_gymnasium_entries():
    for success_rate in (1.0 / 3.0, 0.6, 0.0, 1.0):
        params = env.make_params("4x4", success_rate=success_rate)
        genv = FrozenLakeEnv(map_name="4x4", success_rate=success_rate)
        np.testing.assert_array_equal(
            env.branch_probabilities(params), [e[0] for e in genv.P[0][2]]
        )
    params = env.make_params("4x4", is_slippery=False)
    np.testing.assert_array_equal(env.branch_probabilities(params), [0.0, 1.0, 0.0])


@pytest.mark.parametrize("success_rate", [1.0 / 3.0, 0.6, 0.0])
def test_branch_from_uniform_is_gymnasium_rule_exactly(success_rate):
    """For float32 u (what we draw), our branch equals gymnasium's argmax(cumsum > u) in float64,
    including the float32 neighbours of the thresholds 1/3 and 2/3."""
    params = env.make_params("4x4", success_rate=success_rate)
    probs = env.branch_probabilities(params)
    cums = np.cumsum(probs)
    near = []
    for c in cums[:2]:
        f = np.float32(c)
        near += [np.nextafter(f, np.float32(0)), f, np.nextafter(f, np.float32(1))]
    u = np.concatenate(
        [
            np.array(near, np.float32),
            np.random.default_rng(0).random(5000).astype(np.float32),
            np.float32([0.0, np.nextafter(np.float32(1), np.float32(0))]),
        ]
    )
    expected = np.array([np.argmax(cums > np.float64(x)) for x in u])
    np.testing.assert_array_equal(
        np.asarray(env.branch_from_uniform(jnp.asarray(u), params)), expected
    )


def _jit_step_branch():
    return jax.jit(env.step_branch)


@pytest.mark.parametrize(
    "map_index,success_rate", [(1, 1.0 / 3.0), (0, 1.0 / 3.0), (1, 0.6), (5, 1.0 / 3.0), (13, 0.75)]
)
def test_stochastic_trajectory_equals_gymnasium_step_by_step(map_index, success_rate):
    """Feed the branch gymnasium's np_random is about to pick into step_branch; compare
    everything."""
    tiles = PARITY_MAPS[map_index]
    genv = gym.make(
        "FrozenLake-v1",
        desc=grid.map_to_strings(tiles),
        is_slippery=True,
        success_rate=success_rate,
        max_episode_steps=100,
    )
    params = env.make_params(tiles, success_rate=success_rate, max_steps=100)
    step_branch = _jit_step_branch()
    rng = np.random.default_rng(map_index)
    obs, _ = genv.reset(seed=map_index)
    _, state = env.reset_to_map(tiles)
    assert int(state.pos) == obs
    episodes = 0
    for _ in range(1500):
        a = int(rng.integers(4))
        # gymnasium's categorical_sample on a copy of its generator, in float64.
        probs = [e[0] for e in genv.unwrapped.P[obs][a]]
        u = copy.deepcopy(genv.unwrapped.np_random).random()
        branch = int(np.argmax(np.cumsum(probs) > u))
        obs, reward, terminated, truncated, _ = genv.step(a)
        ours_obs, state, ours_reward, done, info = step_branch(state, a, branch, params)
        assert (
            int(ours_obs),
            float(ours_reward),
            bool(info["terminated"]),
            bool(info["truncated"]),
        ) == (obs, reward, terminated, truncated)
        assert bool(done) == (terminated or truncated)
        if terminated or truncated:
            episodes += 1
            obs, _ = genv.reset()
            _, state = env.reset_to_map(tiles)
    assert episodes >= 10


def test_deterministic_long_sequence_visits_same_states():
    tiles = maps.default_map("8x8")
    genv = gym.make("FrozenLake-v1", map_name="8x8", is_slippery=False)  # TimeLimit 100
    params = env.make_params("8x8", is_slippery=False, max_steps=100)
    jstep = jax.jit(env.step)
    rng = np.random.default_rng(1)
    obs, _ = genv.reset(seed=0)
    _, state = env.reset_to_map(tiles)
    key = jax.random.key(0)
    outcomes = {"terminated": 0, "truncated": 0}
    for i in range(3000):
        a = int(rng.integers(4))
        obs, reward, terminated, truncated, _ = genv.step(a)
        ours_obs, state, ours_reward, _, info = jstep(jax.random.fold_in(key, i), state, a, params)
        assert (
            int(ours_obs),
            float(ours_reward),
            bool(info["terminated"]),
            bool(info["truncated"]),
        ) == (obs, reward, terminated, truncated), i
        if terminated or truncated:
            outcomes["terminated"] += terminated
            outcomes["truncated"] += truncated and not terminated
            obs, _ = genv.reset()
            _, state = env.reset_to_map(tiles)
    assert outcomes["terminated"] > 10


def test_rollout_matches_gymnasium_then_stays_absorbed():
    tiles = maps.default_map("4x4")
    params = env.make_params("4x4", is_slippery=False, max_steps=None)
    actions = np.random.default_rng(3).integers(4, size=60)
    genv = FrozenLakeEnv(map_name="4x4", is_slippery=False)
    genv.reset(seed=0)
    _, state = env.reset_to_map(tiles)
    final, traj = jax.jit(env.rollout)(jax.random.key(0), state, jnp.asarray(actions), params)
    obs, rewards, dones = map(np.asarray, (traj.obs, traj.reward, traj.done))
    end = None
    for t, a in enumerate(actions):
        s2, r, term, _, _ = genv.step(int(a))
        assert (obs[t], rewards[t], dones[t]) == (s2, r, term)
        if term:
            end = t
            break
    assert end is not None and end < len(actions) - 1
    assert np.all(obs[end:] == obs[end]) and np.all(rewards[end + 1 :] == 0) and np.all(dones[end:])
    assert int(final.pos) == obs[end] and int(final.t) == end + 1


def test_rollout_equals_step_loop_and_vmaps():
    params = env.make_params("8x8", max_steps=20)
    _, state = env.reset_to_map(maps.default_map("8x8"))
    actions = jnp.asarray(np.random.default_rng(0).integers(4, size=30), jnp.int32)
    key = jax.random.key(7)
    rollout, jstep = jax.jit(env.rollout), jax.jit(env.step)
    final, traj = rollout(key, state, actions, params)
    s = state
    for t, k in enumerate(jax.random.split(key, 30)):
        obs, s, r, d, _ = jstep(k, s, actions[t], params)
        assert (int(obs), float(r), bool(d)) == (
            int(traj.obs[t]),
            float(traj.reward[t]),
            bool(traj.done[t]),
        )
    chex.assert_trees_all_equal(final, s)
    assert bool(final.done) and int(final.t) <= 20  # hole, goal or the 20-step limit
    keys = jax.random.split(jax.random.key(1), 3)
    states = jax.tree.map(lambda x: jnp.stack([x] * 3), state)
    finals, trajs = jax.jit(jax.vmap(env.rollout, in_axes=(0, 0, None, None)))(
        keys, states, actions, params
    )
    for i in range(3):
        f_i, t_i = rollout(keys[i], state, actions, params)
        chex.assert_trees_all_equal(jax.tree.map(lambda x, i=i: x[i], finals), f_i)
        chex.assert_trees_all_equal(jax.tree.map(lambda x, i=i: x[i], trajs), t_i)


def test_done_state_is_absorbing_and_reward_only_on_entering_goal():
    params = env.make_params(["SG", "FF"], is_slippery=False, max_steps=None)
    _, state = env.reset_to_map(grid.map_from_strings(["SG", "FF"]))
    obs, state, reward, done, info = env.step(jax.random.key(0), state, grid.RIGHT, params)
    assert (int(obs), float(reward), bool(done), bool(info["terminated"])) == (1, 1.0, True, True)
    for a in range(4):
        obs2, state2, reward2, done2, _ = env.step(jax.random.key(a), state, a, params)
        assert (int(obs2), float(reward2), bool(done2)) == (1, 0.0, True)
        chex.assert_trees_all_equal(state2, state)


def test_time_limit_truncates_like_gymnasium_timelimit():
    params = env.make_params("4x4", is_slippery=False, max_steps=5)
    genv = gym.make("FrozenLake-v1", is_slippery=False, max_episode_steps=5)
    genv.reset(seed=0)
    _, state = env.reset_to_map(maps.default_map("4x4"))
    for i in range(5):  # walk into the left wall: stays on the start cell
        g = genv.step(grid.LEFT)
        obs, state, reward, done, info = env.step(jax.random.key(i), state, grid.LEFT, params)
        assert (int(obs), float(reward), bool(info["terminated"]), bool(info["truncated"])) == g[:4]
    assert bool(done) and int(state.t) == 5
    _, after, _, _, _ = env.step(jax.random.key(9), state, grid.RIGHT, params)
    chex.assert_trees_all_equal(after, state)


def test_sampled_branches_follow_probabilities():
    """step_batch / step_autoreset_batch from an open cell: the three outcomes at the right
    rates."""
    tiles = grid.map_from_strings(["FFF", "FSF", "FFG"])
    num = 200_000
    _, one = env.reset_to_map(tiles)
    states = jax.tree.map(lambda x: jnp.broadcast_to(x, (num,) + x.shape), one)
    actions = jnp.full((num,), grid.UP, jnp.int32)  # branches: Right(5), Up(1), Left(3)
    for success_rate in (1.0 / 3.0, 0.6):
        params = env.make_params(tiles, success_rate=success_rate, max_steps=None)
        probs = env.branch_probabilities(params)
        for fn in (env.step_batch, env.step_autoreset_batch):
            obs, *_ = jax.jit(fn)(jax.random.key(0), states, actions, params)
            counts = np.bincount(np.asarray(obs), minlength=9)
            freq = np.array([counts[5], counts[1], counts[3]]) / num  # RIGHT, UP, LEFT
            sigma = np.sqrt(probs * (1 - probs) / num)
            assert np.all(np.abs(freq - probs) <= 5 * sigma + 1e-12), (fn.__name__, freq, probs)


def test_reset_samples_pool_uniformly():
    pool = POOL_4_CORNER
    params = env.make_params(pool)
    num = 50_000
    obs, states = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))(
        jax.random.split(jax.random.key(0), num), params
    )
    index = _pool_index(np.asarray(states.tiles), pool)
    assert np.all(np.asarray(obs) == 0) and not np.any(np.asarray(states.done))
    counts = np.bincount(index, minlength=5)
    assert np.all(np.abs(counts / num - 0.2) <= 5 * np.sqrt(0.2 * 0.8 / num)), counts


def _pool_index(tiles, pool):
    flat = pool.reshape(len(pool), -1)
    match = (tiles.reshape(len(tiles), 1, -1) == flat[None]).all(-1)
    assert np.all(match.sum(1) == 1)
    return match.argmax(1)


def test_autoreset_restarts_from_pool_uniformly():
    """With max_steps=1 every env finishes every step, so every env restarts on a pool map."""
    pool = POOL_6_RANDOM_START_GOAL
    params = env.make_params(pool, max_steps=1)
    num = 50_000
    _, start = env.reset_to_map(pool[0])
    states = jax.tree.map(lambda x: jnp.broadcast_to(x, (num,) + x.shape), start)
    actions = jnp.zeros((num,), jnp.int32)
    obs, new, _, done, info = jax.jit(env.step_autoreset_batch)(
        jax.random.key(1), states, actions, params
    )
    assert np.all(np.asarray(done)) and np.all(
        np.asarray(info["truncated"]) | np.asarray(info["terminated"])
    )
    assert not np.any(np.asarray(new.done)) and np.all(np.asarray(new.t) == 0)
    index = _pool_index(np.asarray(new.tiles), pool)
    starts = np.argmax(pool.reshape(5, -1) == grid.START, axis=1)
    np.testing.assert_array_equal(np.asarray(new.pos), starts[index])
    np.testing.assert_array_equal(np.asarray(obs), starts[index])
    counts = np.bincount(index, minlength=5)
    assert np.all(np.abs(counts / num - 0.2) <= 5 * np.sqrt(0.2 * 0.8 / num)), counts


def test_autoreset_keeps_live_envs_like_step_branch():
    pool = POOL_8_CORNER
    params = env.make_params(pool, max_steps=100)
    num = 4096
    _, states = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))(
        jax.random.split(jax.random.key(0), num), params
    )
    actions = jax.random.randint(jax.random.key(1), (num,), 0, 4)
    obs, new, _, done, _ = jax.jit(env.step_autoreset_batch)(
        jax.random.key(3), states, actions, params
    )
    # Every live env's new cell is one of its three slip outcomes, reached by step_branch.
    step_all = jax.jit(jax.vmap(env.step_branch, in_axes=(0, 0, None, None)))
    outcomes = jnp.stack([step_all(states, actions, b, params)[0] for b in range(3)], axis=1)
    live = ~np.asarray(done)
    assert live.sum() > num // 2
    assert np.all((np.asarray(outcomes)[live] == np.asarray(obs)[live, None]).any(1))
    np.testing.assert_array_equal(np.asarray(new.t)[live], 1)
    np.testing.assert_array_equal(np.asarray(new.tiles)[live], np.asarray(states.tiles)[live])


def test_step_compiles_once():
    @jax.jit
    @chex.assert_max_traces(n=1)
    def jstep(key, state, action, params):
        return env.step(key, state, action, params)

    pool_a, pool_b = POOL_8_CORNER[:4], POOL_8_RANDOM_START_GOAL[:4]
    for i in range(12):
        params = env.make_params(pool_a if i % 2 else pool_b, max_steps=100)
        _, state = env.reset(jax.random.key(i), params)
        for a in range(4):
            _, state, _, _, _ = jstep(jax.random.key(1000 + i), state, jnp.int32(a), params)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def jbatch(key, states, actions, params):
        return env.step_autoreset_batch(key, states, actions, params)

    params = env.make_params(pool_a)
    _, states = jax.vmap(env.reset, in_axes=(0, None))(
        jax.random.split(jax.random.key(0), 32), params
    )
    for i in range(20):
        _, states, _, _, _ = jbatch(
            jax.random.key(i), states, jnp.full((32,), i % 4, jnp.int32), params
        )


def test_make_params_validates():
    with pytest.raises(ValueError, match="exactly one START"):
        env.make_params(["FF", "FG"])
    with pytest.raises(ValueError, match="exactly one START"):
        env.make_params(["SS", "FG"])
    with pytest.raises(ValueError, match="square"):
        env.make_params(["SFF", "FG"])
    with pytest.raises(ValueError, match="outside"):
        env.make_params(np.full((3, 3), 7, np.int8))
    with pytest.raises(ValueError, match="unknown map name"):
        env.make_params("5x5")
    with pytest.raises(ValueError, match="success_rate"):
        env.make_params("4x4", success_rate=1.5)
    with pytest.raises(ValueError, match="max_steps"):
        env.make_params("4x4", max_steps=0)
    with pytest.raises(ValueError, match="maps must have shape"):
        env.EnvParams(maps=jnp.zeros((4, 4), jnp.int8))
    params = env.make_params("8x8")
    assert params.maps.shape == (1, 8, 8) and params.maps.dtype == jnp.int8 and params.size == 8
