"""Exact finite-horizon Q* and BFS distances (envs/frozenlake/qstar.py).

References are independent of the code under test: a float64 NumPy backward induction
over gymnasium's own transition table ``env.unwrapped.P``, a plain Python BFS with its own
move rule, and values worked out by hand.
"""

from collections import deque

import chex
import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gymnasium.envs.toy_text.frozen_lake import generate_random_map

from envs.frozenlake import qstar
from envs.frozenlake.grid import DEFAULT_MAPS, map_from_strings

GAMMA = 0.95
H = 70


# --------------------------------------------------------------------------- references


def gym_reference_q(desc, horizon, gamma=GAMMA, **env_kwargs):
    """float64 backward induction over gymnasium's P: Q[h, s, a], h = 0..horizon."""
    env = gym.make("FrozenLake-v1", desc=list(desc), **env_kwargs)
    table = env.unwrapped.P
    num_states = len(table)
    expected_reward = np.zeros((num_states, 4))
    continue_prob = np.zeros((num_states, 4, num_states))  # P(s', not terminated | s, a)
    for s, by_action in table.items():
        for a, outcomes in by_action.items():
            for prob, s_next, reward, terminated in outcomes:
                expected_reward[s, a] += prob * reward
                if not terminated:
                    continue_prob[s, a, s_next] += prob
    env.close()
    q = np.zeros((horizon + 1, num_states, 4))
    for h in range(1, horizon + 1):
        q[h] = expected_reward + gamma * continue_prob @ q[h - 1].max(axis=1)
    return q


def _step(row, col, action, n):  # gymnasium's inc(), written out again
    if action == 0:
        col = max(col - 1, 0)
    elif action == 1:
        row = min(row + 1, n - 1)
    elif action == 2:
        col = min(col + 1, n - 1)
    else:
        row = max(row - 1, 0)
    return row, col


def python_bfs_distances(rows):
    """Moves from each cell to the goal over non-hole cells; None if unreachable."""
    n = len(rows)
    out = []
    for start in range(n * n):
        r0, c0 = divmod(start, n)
        if rows[r0][c0] == "H":
            out.append(None)
            continue
        seen, queue, found = {(r0, c0)}, deque([((r0, c0), 0)]), None
        while queue:
            (r, c), d = queue.popleft()
            if rows[r][c] == "G":
                found = d
                break
            for a in range(4):
                nr, nc = _step(r, c, a, n)
                if (nr, nc) not in seen and rows[nr][nc] != "H":
                    seen.add((nr, nc))
                    queue.append(((nr, nc), d + 1))
        out.append(found)
    return out


def random_rows(rng, n, p_frozen):
    """Any map (maybe unsolvable), start and goal at random distinct cells."""
    cells = rng.choice(["F", "H"], size=(n, n), p=[p_frozen, 1 - p_frozen])
    start, goal = rng.choice(n * n, size=2, replace=False)
    cells[divmod(start, n)] = "S"
    cells[divmod(goal, n)] = "G"
    return ["".join(r) for r in cells]


def gym_maps(count, size=8, first_seed=0):
    return [generate_random_map(size=size, p=0.8, seed=first_seed + i) for i in range(count)]


def as_tiles(maps):
    return np.stack([map_from_strings(m) for m in maps])


# --------------------------------------------------------------------------- Q* vs gymnasium


def test_q_star_matches_gymnasium_on_random_slippery_8x8():
    maps = gym_maps(16)
    q = np.asarray(qstar.q_star(as_tiles(maps), H))
    assert q.shape == (16, H + 1, 64, 4) and q.dtype == np.float32
    errors = [
        np.abs(q[i] - gym_reference_q(m, H, is_slippery=True)).max() for i, m in enumerate(maps)
    ]
    assert max(errors) <= 1e-6, errors
    assert q[:, H].max() > 0.1  # non-trivial: the goal is worth something from somewhere


@pytest.mark.parametrize("slippery", [True, False])
@pytest.mark.parametrize("name", ["4x4", "8x8"])
def test_q_star_matches_gymnasium_on_default_maps(name, slippery):
    rows = DEFAULT_MAPS[name]
    q = np.asarray(qstar.q_star(map_from_strings(rows), H, is_slippery=slippery))
    np.testing.assert_allclose(q, gym_reference_q(rows, H, is_slippery=slippery), atol=1e-6, rtol=0)


def test_q_star_matches_gymnasium_deterministic_random_maps():
    maps = gym_maps(8, first_seed=100)
    q = np.asarray(qstar.q_star(as_tiles(maps), H, is_slippery=False))
    for i, m in enumerate(maps):
        np.testing.assert_allclose(
            q[i], gym_reference_q(m, H, is_slippery=False), atol=1e-6, rtol=0
        )


@pytest.mark.parametrize("success_rate", [0.75, 0.1])
def test_q_star_success_rate_matches_gymnasium(success_rate):
    maps = gym_maps(4, first_seed=200)
    q = np.asarray(qstar.q_star(as_tiles(maps), H, success_rate=success_rate))
    for i, m in enumerate(maps):
        ref = gym_reference_q(m, H, is_slippery=True, success_rate=success_rate)
        np.testing.assert_allclose(q[i], ref, atol=1e-6, rtol=0)


def test_other_gamma_and_sizes_match_gymnasium():
    rng = np.random.default_rng(0)
    for n in (3, 5, 6):
        rows = random_rows(rng, n, 0.75)
        q = np.asarray(qstar.q_star(map_from_strings(rows), 12, gamma=0.8))
        np.testing.assert_allclose(q, gym_reference_q(rows, 12, gamma=0.8), atol=1e-6, rtol=0)


def test_float64_path_matches_reference_tightly():
    maps = gym_maps(2, first_seed=300)
    with pytest.raises(ValueError, match="jax_enable_x64"):
        qstar.q_star(as_tiles(maps), 5, dtype=jnp.float64)
    with jax.enable_x64(True):
        q = np.asarray(qstar.q_star(as_tiles(maps), H, dtype=jnp.float64))
    assert q.dtype == np.float64
    for i, m in enumerate(maps):
        np.testing.assert_allclose(q[i], gym_reference_q(m, H), atol=1e-12, rtol=0)


@pytest.mark.parametrize("slippery, success_rate", [(True, 1 / 3), (True, 0.6), (False, 1 / 3)])
def test_transition_operator_is_gymnasium_kernel(slippery, success_rate):
    rows = ["SFFFF", "FFFFF", "FFFFF", "FFFFF", "FFFFG"]  # every cell but G is non-terminal
    env = gym.make("FrozenLake-v1", desc=rows, is_slippery=slippery, success_rate=success_rate)
    expected = np.zeros((25, 25, 4))  # [s', s, a]
    for s, by_action in env.unwrapped.P.items():
        for a, outcomes in by_action.items():
            for prob, s_next, _, _ in outcomes:
                expected[s_next, s, a] += prob
    got = np.asarray(qstar.transition_operator(5, success_rate, is_slippery=slippery))
    np.testing.assert_allclose(got.reshape(25, 25, 4)[:, :24], expected[:, :24], atol=1e-7)


# --------------------------------------------------------------------------- by hand


def test_hand_computed_deterministic_2x2():
    # cells: 0 S, 1 F (top right), 2 F, 3 G.  Actions: 0 Left 1 Down 2 Right 3 Up.
    q = np.asarray(qstar.q_star(map_from_strings(["SF", "FG"]), 3, is_slippery=False))
    g = GAMMA
    np.testing.assert_array_equal(q[0], 0)
    np.testing.assert_allclose(q[1, 0], [0, 0, 0, 0])  # one move cannot reach G from S
    np.testing.assert_allclose(q[1, 1], [0, 1, 0, 0])  # Down enters G
    np.testing.assert_allclose(q[1, 2], [0, 0, 1, 0])  # Right enters G
    np.testing.assert_allclose(q[2, 0], [0, g, g, 0], rtol=1e-7)  # bump = stay, V[1, S] = 0
    np.testing.assert_allclose(q[3, 0], [g * g, g, g, g * g], rtol=1e-7)
    np.testing.assert_array_equal(q[:, 3], 0)  # the goal is absorbing


def test_hand_computed_slippery_2x2():
    # cells: 0 S, 1 F, 2 H, 3 G.  From 1: Left->0, Down->G, Right/Up bump (stay at 1).
    # Slips of a are (a-1)%4, a, (a+1)%4, each 1/3.
    q = np.asarray(qstar.q_star(map_from_strings(["SF", "HG"]), 2))
    g, third = GAMMA, 1 / 3
    np.testing.assert_allclose(q[1, 1], [third, third, third, 0], rtol=1e-6)
    np.testing.assert_allclose(q[1, 0], 0)
    # h = 2: V[1] = [0, 1/3, 0, 0].  From 0, Left slips to {0, 0, H}: 0; the other three
    # reach cell 1 w.p. 1/3 -> g/9.  From 1: Down {0, G, 1}, Right {G, 1, 1}, Left {1, 0, G}.
    np.testing.assert_allclose(q[2, 0], [0, g / 9, g / 9, g / 9], rtol=1e-6)
    np.testing.assert_allclose(
        q[2, 1],
        [third * (1 + g / 3), third * (1 + g / 3), third * (1 + 2 * g / 3), 2 * g / 9],
        rtol=1e-6,
    )
    np.testing.assert_array_equal(q[:, 2], 0)  # hole
    np.testing.assert_array_equal(q[:, 3], 0)  # goal


def test_deterministic_values_are_discounted_distances():
    # With deterministic moves V[h, s] = gamma^(d(s) - 1) if 1 <= d(s) <= h else 0.
    rng = np.random.default_rng(1)
    for _ in range(6):
        rows = random_rows(rng, 6, 0.7)
        tiles = map_from_strings(rows)
        v = np.asarray(qstar.v_star(tiles, 40, is_slippery=False), np.float64)
        dist = python_bfs_distances(rows)
        for s, d in enumerate(dist):
            terminal = rows[s // 6][s % 6] in "HG"
            expected = [
                0.0 if terminal or d is None or d > h else GAMMA ** (d - 1) for h in range(41)
            ]
            np.testing.assert_allclose(v[:, s], expected, rtol=2e-6, atol=0)


def test_batch_dims_and_single_map_agree():
    tiles = as_tiles(gym_maps(6, first_seed=400))
    q_flat = np.asarray(qstar.q_star(tiles, 10))
    q_nested = np.asarray(qstar.q_star(tiles.reshape(2, 3, 8, 8), 10))
    q_single = np.asarray(qstar.q_star(tiles[4], 10))
    assert q_nested.shape == (2, 3, 11, 64, 4) and q_single.shape == (11, 64, 4)
    np.testing.assert_array_equal(q_nested.reshape(q_flat.shape), q_flat)
    np.testing.assert_allclose(q_single, q_flat[4], atol=1e-7)
    # ... and q_star composes with vmap and jit.
    q_vmapped = jax.jit(jax.vmap(lambda t: qstar.q_star(t, 10)))(tiles)
    np.testing.assert_allclose(np.asarray(q_vmapped), q_flat, atol=1e-7)
    assert qstar.q_star(tiles, 0).shape == (6, 1, 64, 4)


def test_compiles_once_for_same_shapes(monkeypatch):
    chex.clear_trace_counter()
    counted = jax.jit(
        chex.assert_max_traces(qstar.backward_induction, n=1),
        static_argnames=("horizon", "is_slippery", "dtype"),
    )
    monkeypatch.setattr(qstar, "_backward_induction_jit", counted)
    for seed, gamma, success_rate in [(0, 0.95, 1 / 3), (10, 0.9, 0.5), (20, 0.99, 0.8)]:
        qstar.q_star(
            as_tiles(gym_maps(4, first_seed=seed)), 20, gamma=gamma, success_rate=success_rate
        ).block_until_ready()
    with pytest.raises(AssertionError):  # a new shape is a new trace, which the counter sees
        qstar.q_star(as_tiles(gym_maps(3)), 20)


# --------------------------------------------------------------------------- greedy play


def test_greedy_policy_takes_a_shortest_path_on_deterministic_maps():
    maps = gym_maps(6, first_seed=500)
    tiles = as_tiles(maps)
    lengths = np.asarray(qstar.shortest_path_length(tiles))
    q = qstar.q_star(tiles, H, is_slippery=False)
    for i, rows in enumerate(maps):
        shortest = python_bfs_distances(rows)[0]
        assert lengths[i] == shortest
        for budget in (H, shortest):  # generous, and exactly tight
            pos, moves = 0, 0
            while rows[pos // 8][pos % 8] not in "HG" and moves < budget:
                action = int(qstar.greedy_action(q[i], budget - moves, pos))
                assert qstar.action_quality(q[i], budget - moves, pos, action) == pytest.approx(
                    GAMMA ** (shortest - moves - 1), rel=1e-6
                )
                pos = int(np.ravel_multi_index(_step(pos // 8, pos % 8, action, 8), (8, 8)))
                moves += 1
            assert rows[pos // 8][pos % 8] == "G" and moves == shortest
        # One move short of the shortest path, nothing is worth anything.
        assert float(qstar.state_values(q[i])[shortest - 1, 0]) == 0.0


def test_accessors_broadcast_and_flag_out_of_range():
    q = qstar.q_star(map_from_strings(["SF", "HG"]), 2)
    np.testing.assert_allclose(qstar.action_values(q, 2, 1), np.asarray(q)[2, 1])
    got = qstar.action_quality(
        q,
        jnp.array([1, 2, 3, -1, 2, 2]),
        jnp.array([1, 1, 1, 1, 4, 1]),
        jnp.array([0, 2, 0, 0, 0, 4]),
    )
    np.testing.assert_allclose(got[:2], [np.asarray(q)[1, 1, 0], np.asarray(q)[2, 1, 2]])
    assert np.isnan(np.asarray(got[2:])).all()  # h > H, h < 0, pos off the map, bad action
    assert int(qstar.greedy_action(q, 2, 1)) == 2  # Right: 1/3 (1 + 2 gamma / 3) is best
    np.testing.assert_array_equal(qstar.greedy_action(q, jnp.array([2, 3]), 1), [2, -1])
    batched = qstar.q_star(np.stack([map_from_strings(["SF", "HG"])] * 3), 2)
    np.testing.assert_array_equal(qstar.greedy_action(batched, 2, jnp.array([1, 1, 1])), [2, 2, 2])


# --------------------------------------------------------------------------- BFS


def test_distance_to_goal_matches_python_bfs():
    rng = np.random.default_rng(2)
    for n, p_frozen in [(2, 0.8), (3, 0.6), (5, 0.7), (8, 0.8), (8, 0.55)]:
        batch = [random_rows(rng, n, p_frozen) for _ in range(8)]
        got = np.asarray(qstar.distance_to_goal(as_tiles(batch)))
        assert got.shape == (8, n * n) and got.dtype == np.int32
        for rows, dist in zip(batch, got):
            expected = [qstar.UNREACHABLE if d is None else d for d in python_bfs_distances(rows)]
            np.testing.assert_array_equal(dist, expected, err_msg="\n".join(rows))


def test_shortest_path_and_structural_bound():
    rng = np.random.default_rng(3)
    batch = [random_rows(rng, 6, 0.6) for _ in range(24)]
    tiles = as_tiles(batch)
    lengths = np.asarray(qstar.shortest_path_length(tiles))
    for rows, length in zip(batch, lengths):
        start = "".join(rows).index("S")
        d = python_bfs_distances(rows)[start]
        assert length == (qstar.UNREACHABLE if d is None else d)
    assert (lengths == qstar.UNREACHABLE).any() and (lengths < qstar.UNREACHABLE).any()
    np.testing.assert_array_equal(qstar.solvable_within(tiles, 7), lengths <= 7)
    # The bound is necessary: no value from the start before the shortest path fits.
    v = np.asarray(qstar.v_star(tiles, 12))
    starts = np.array(["".join(r).index("S") for r in batch])
    for h in range(13):
        reachable_value = v[np.arange(24), h, starts] > 0
        assert not (reachable_value & (lengths > h)).any()


def test_error_actions_by_hand():
    rows = ["SFF", "FHF", "FFG"]  # distances: 0:4 1:3 2:2 / 3:3 4:- 5:1 / 6:2 7:1 8:0
    tiles = map_from_strings(rows)
    np.testing.assert_array_equal(
        qstar.distance_to_goal(tiles), [4, 3, 2, 3, qstar.UNREACHABLE, 1, 2, 1, 0]
    )
    # From 1 (top middle): Left -> 0 is further; Down is the hole; Right closer; Up bumps.
    np.testing.assert_array_equal(qstar.error_actions(tiles, 1), [True, False, False, False])
    np.testing.assert_array_equal(
        qstar.error_actions(tiles, 1, include_holes=True), [True, True, False, False]
    )
    # From 0 every move is toward the goal or a bump: no error.
    np.testing.assert_array_equal(qstar.error_actions(tiles, 0), [False] * 4)
    # Terminal cells have no errors.
    np.testing.assert_array_equal(qstar.error_actions(tiles, 4, include_holes=True), [False] * 4)
    np.testing.assert_array_equal(qstar.error_actions(tiles, 8), [False] * 4)


def test_error_actions_match_python_definition():
    rng = np.random.default_rng(4)
    batch = [random_rows(rng, 5, 0.7) for _ in range(10)]
    tiles = as_tiles(batch)
    for include_holes in (False, True):
        for pos in range(25):
            got = np.asarray(
                qstar.error_actions(tiles, np.full(10, pos), include_holes=include_holes)
            )
            for rows, row_got in zip(batch, got):
                dist = python_bfs_distances(rows)
                r, c = divmod(pos, 5)
                expected = []
                for a in range(4):
                    nr, nc = _step(r, c, a, 5)
                    here, there = dist[pos], dist[nr * 5 + nc]
                    live = rows[r][c] not in "HG" and here is not None
                    hole = rows[nr][nc] == "H"
                    expected.append(
                        live
                        and (
                            (hole and include_holes)
                            or (not hole and there is not None and there > here)
                        )
                    )
                np.testing.assert_array_equal(
                    row_got, expected, err_msg=f"pos {pos}\n" + "\n".join(rows)
                )


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tiles=np.zeros((3, 4), np.int8)), "shape"),
        (dict(tiles=np.zeros((4, 4), np.float32)), "integer"),
        (dict(tiles=np.full((4, 4), 7, np.int8)), "codes"),
        (dict(horizon=-1), "horizon"),
        (dict(horizon=2.5), "horizon"),
        (dict(gamma=1.5), "gamma"),
        (dict(success_rate=-0.1), "success_rate"),
        (dict(dtype=jnp.int32), "dtype"),
    ],
)
def test_bad_input_names_the_field(kwargs, match):
    args = dict(tiles=map_from_strings(DEFAULT_MAPS["4x4"]), horizon=3)
    args.update(kwargs)
    tiles, horizon = args.pop("tiles"), args.pop("horizon")
    with pytest.raises(ValueError, match=match):
        qstar.q_star(tiles, horizon, **args)
