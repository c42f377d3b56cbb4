"""Random map generation: solvable (independent BFS), right frozen rate, disjoint splits."""

import itertools
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gymnasium.envs.toy_text.frozen_lake import MAPS, is_valid

from envs.frozenlake import grid, maps


def bfs_solvable(tiles) -> bool:
    """Independent reference: plain BFS from S over non-hole cells, stopping at G."""
    tiles = np.asarray(tiles)
    n = tiles.shape[0]
    (start,) = zip(*np.nonzero(tiles == grid.START))
    seen, queue = {start}, deque([start])
    while queue:
        r, c = queue.popleft()
        if tiles[r, c] == grid.GOAL:
            return True
        for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1)):
            rr, cc = r + dr, c + dc
            if 0 <= rr < n and 0 <= cc < n and (rr, cc) not in seen and tiles[rr, cc] != grid.HOLE:
                seen.add((rr, cc))
                queue.append((rr, cc))
    return False


CASES = [  # (size, p, random_start_goal, split)
    (8, 0.8, False, None),
    (8, 0.7, True, None),
    (5, 0.6, False, "train"),
    (4, 0.5, True, "test"),
]


@pytest.mark.parametrize("size,p,random_start_goal,split", CASES)
def test_every_generated_map_is_solvable_and_well_formed(size, p, random_start_goal, split):
    out = np.asarray(
        maps.generate(
            jax.random.key(0), 300, size=size, p=p, random_start_goal=random_start_goal, split=split
        )
    )
    assert out.shape == (300, size, size) and out.dtype == np.int8
    for tiles in out:
        assert bfs_solvable(tiles)
        assert (tiles == grid.START).sum() == 1 and (tiles == grid.GOAL).sum() == 1
        assert set(np.unique(tiles)) <= {grid.FROZEN, grid.HOLE, grid.START, grid.GOAL}
    starts = np.argmax(out.reshape(300, -1) == grid.START, axis=1)
    goals = np.argmax(out.reshape(300, -1) == grid.GOAL, axis=1)
    if random_start_goal:
        assert len(set(starts)) > size * size // 2 and len(set(goals)) > size * size // 2
    else:
        assert np.all(starts == 0) and np.all(goals == size * size - 1)
    if split is not None:
        assert np.all(np.asarray(maps.map_split(jnp.asarray(out))) == maps.SPLITS.index(split))


def test_is_solvable_agrees_with_bfs_and_gymnasium_on_raw_candidates():
    for size, rsg in ((4, False), (6, True), (8, False)):
        cands = np.asarray(maps.candidate_maps(jax.random.key(size), 400, size, 0.6, rsg))
        ours = np.asarray(maps.is_solvable(jnp.asarray(cands)))
        ref = np.array([bfs_solvable(t) for t in cands])
        np.testing.assert_array_equal(ours, ref)
        assert 0.05 < ref.mean() < 0.95  # both outcomes are exercised
        if not rsg:  # gymnasium's own DFS check assumes S at (0, 0)
            gym_ref = [is_valid([list(r) for r in grid.map_to_strings(t)], size) for t in cands]
            np.testing.assert_array_equal(ours, gym_ref)


def test_candidate_cells_are_frozen_with_probability_p():
    """Before the solvability check every non-S/G cell is Bernoulli(p) frozen."""
    for p, rsg in ((0.8, False), (0.55, True)):
        cands = np.asarray(maps.candidate_maps(jax.random.key(1), 5000, 8, p, rsg))
        cells = cands[(cands == grid.FROZEN) | (cands == grid.HOLE)]
        assert cells.size == 5000 * 62
        frac = (cells == grid.FROZEN).mean()
        assert abs(frac - p) <= 5 * np.sqrt(p * (1 - p) / cells.size), frac


def _exact_conditional_frozen_fraction(size, p, random_start_goal):
    """E[frozen fraction of the non-S/G cells | solvable] by enumerating every map (Python BFS)."""
    cells = size * size
    placements = (
        [(s, g) for s in range(cells) for g in range(cells) if s != g]
        if random_start_goal
        else [(0, cells - 1)]
    )
    num, den = 0.0, 0.0
    for s, g in placements:
        others = [c for c in range(cells) if c not in (s, g)]
        for holes in itertools.product((False, True), repeat=len(others)):
            flat = np.full(cells, grid.FROZEN, np.int8)
            flat[[c for c, h in zip(others, holes) if h]] = grid.HOLE
            flat[s], flat[g] = grid.START, grid.GOAL
            if bfs_solvable(flat.reshape(size, size)):
                frozen = len(others) - sum(holes)
                weight = p**frozen * (1 - p) ** (len(others) - frozen)
                num += weight * frozen / len(others)
                den += weight
    return num / den


@pytest.mark.parametrize("size,p,random_start_goal", [(4, 0.6, False), (3, 0.5, True)])
def test_accepted_maps_have_the_solvability_conditioned_frozen_fraction(size, p, random_start_goal):
    """Rejection sampling favours frozen cells; the mean frozen fraction of accepted maps must be
    the exact conditional expectation (enumerated), within 5 standard errors."""
    expected = _exact_conditional_frozen_fraction(size, p, random_start_goal)
    assert expected > p + 0.03  # the conditioning is visible, so the test can tell it apart from p
    out = np.asarray(
        maps.generate(jax.random.key(3), 20000, size=size, p=p, random_start_goal=random_start_goal)
    )
    free = (out == grid.FROZEN) | (out == grid.HOLE)
    per_map = (out == grid.FROZEN).sum((1, 2)) / free.sum((1, 2))
    stderr = per_map.std() / np.sqrt(len(per_map))
    assert abs(per_map.mean() - expected) <= 5 * stderr, (per_map.mean(), expected, stderr)


def test_train_and_test_sets_never_share_a_map():
    kwargs = {"size": 4, "p": 0.7}  # small maps, so collisions within a split do happen
    train = [
        np.asarray(maps.generate(jax.random.key(s), 2000, split="train", **kwargs)) for s in (0, 1)
    ]
    test = [
        np.asarray(maps.generate(jax.random.key(s), 2000, split="test", **kwargs)) for s in (0, 2)
    ]

    def as_set(batches):
        return {m.tobytes() for b in batches for m in b}

    train_set, test_set = as_set(train), as_set(test)
    assert len(train_set) > 1000 and len(test_set) > 1000
    assert len(as_set(train[:1]) & as_set(train[1:])) > 0  # the same map recurs within a split...
    assert not train_set & test_set  # ...but never across splits, even for the same seed


def _reference_split(tiles) -> int:
    """map_split re-derived with Python ints (mod 2**32), as documented."""
    mask = 0xFFFFFFFF

    def fmix32(x):
        x ^= x >> 16
        x = (x * 0x85EBCA6B) & mask
        x ^= x >> 13
        x = (x * 0xC2B2AE35) & mask
        return x ^ (x >> 16)

    flat = [int(c) for c in np.asarray(tiles).reshape(-1)]
    n = np.asarray(tiles).shape[0]
    h = sum(fmix32(4 * i + c) for i, c in enumerate(flat)) & mask
    return fmix32(h ^ ((n * 0x9E3779B9) & mask)) >> 31


def test_map_split_is_a_balanced_platform_independent_hash():
    cands = maps.candidate_maps(jax.random.key(9), 4000, 6, 0.7, True)
    split = np.asarray(maps.map_split(cands))
    assert abs(split.mean() - 0.5) <= 5 * np.sqrt(0.25 / 4000)
    assert [_reference_split(t) for t in np.asarray(cands[:200])] == split[:200].tolist()
    with jax.enable_x64(True):  # wider default integers must not change the hash
        np.testing.assert_array_equal(np.asarray(maps.map_split(cands)), split)


def test_same_key_same_maps_and_compiles_once():
    a = maps.generate(jax.random.key(11), 64, size=6, p=0.75)
    before = maps.generate_with_status._cache_size()
    b = maps.generate(jax.random.key(11), 64, size=6, p=0.75)
    c = maps.generate(jax.random.key(12), 64, size=6, p=0.75)
    assert maps.generate_with_status._cache_size() == before
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))


def test_impossible_settings_raise_clear_errors():
    with pytest.raises(ValueError, match="max_rounds"):
        maps.generate(jax.random.key(0), 8, size=8, p=0.05, max_rounds=2)
    with pytest.raises(ValueError, match="p "):
        maps.generate(jax.random.key(0), 8, p=0.0)
    with pytest.raises(ValueError, match="size"):
        maps.generate(jax.random.key(0), 8, size=1)
    with pytest.raises(ValueError, match="split"):
        maps.generate(jax.random.key(0), 8, split="validation")


def test_default_maps_are_gymnasiums():
    for name in ("4x4", "8x8"):
        assert grid.map_to_strings(maps.default_map(name)) == MAPS[name]
    with pytest.raises(ValueError, match="unknown map name"):
        maps.default_map("16x16")
