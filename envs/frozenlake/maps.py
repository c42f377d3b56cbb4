"""Random solvable FrozenLake maps generated in JAX, and the train/test split.

A candidate ``n x n`` map has each cell frozen with probability ``p`` and a hole otherwise
(gymnasium's ``generate_random_map``), then START and GOAL written over two cells: the corners
0 and ``n*n - 1`` (gymnasium's layout) or, with ``random_start_goal``, two distinct cells drawn
uniformly (RAGEN's layout). A candidate is kept only if the goal is reachable from the start
(4-neighbour flood fill in ``lax``; holes block). So an accepted map is distributed as a
candidate *conditioned on being solvable* (which favours frozen cells), exactly as
gymnasium's rejection loop; with ``split``, also conditioned on its split (a hash bit, so
in effect a pseudo-random half of the solvable maps).

Generation is in bulk and inside ``jit``: each round draws a pool of ``oversample * num_maps``
candidates with one key, flood-fills them all at once and fills the still-empty output slots
with the accepted ones in pool order; rounds repeat (``lax.while_loop``) until every slot is
filled. The result is a deterministic function of ``(key, num_maps, settings)``.

Train/test split, provably disjoint
-----------------------------------
:func:`map_split` assigns every map to train (0) or test (1) by a hash bit of its content
alone (size and all tile codes, START and GOAL included). ``generate(..., split="train")``
accepts only candidates with ``map_split == 0`` and ``split="test"`` only those with
``map_split == 1``. Hence every train map lies in ``{m : map_split(m) = 0}`` and every test
map in ``{m : map_split(m) = 1}``; these sets are disjoint, so no choice of keys, sizes of
sets or other settings can ever put one map in both. (The hash is integer arithmetic on
uint32 with explicit dtypes, so it is the same on every platform and JAX configuration.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from envs.frozenlake import grid

SPLITS = ("train", "test")


def default_map(name: str) -> np.ndarray:
    """gymnasium's built-in map ``"4x4"`` or ``"8x8"`` as ``int8[n, n]``."""
    if name not in grid.DEFAULT_MAPS:
        raise ValueError(f"unknown map name {name!r}; known: {sorted(grid.DEFAULT_MAPS)}")
    return grid.map_from_strings(grid.DEFAULT_MAPS[name])


def _shift(x, drow: int, dcol: int):
    """``out[..., r, c] = x[..., r - drow, c - dcol]``, False where that is off the grid."""
    n = x.shape[-1]
    pad = [(0, 0)] * (x.ndim - 2) + [(max(drow, 0), max(-drow, 0)), (max(dcol, 0), max(-dcol, 0))]
    padded = jnp.pad(x, pad)
    r0, c0 = max(-drow, 0), max(-dcol, 0)
    return padded[..., r0 : r0 + n, c0 : c0 + n]


def reachable(tiles):
    """bool[..., n, n]: cells the player can enter from START without passing a hole or goal.

    Flood fill: start from START, spread 4-neighbour from reached cells that are not terminal,
    into cells that are not holes (so a reachable goal is marked; holes never are).
    """
    passable = tiles != grid.HOLE
    spreads = ~grid.is_terminal_tile(tiles)

    def grow(reach):
        src = reach & spreads
        near = _shift(src, 1, 0) | _shift(src, -1, 0) | _shift(src, 0, 1) | _shift(src, 0, -1)
        return reach | (near & passable)

    def body(carry):
        reach, _ = carry
        new = grow(reach)
        return new, jnp.any(new != reach)

    start = tiles == grid.START
    reach, _ = jax.lax.while_loop(lambda c: c[1], body, (start, jnp.array(True)))
    return reach


def is_solvable(tiles):
    """bool[...]: some goal cell is reachable from the start."""
    return jnp.any(reachable(tiles) & (tiles == grid.GOAL), axis=(-2, -1))


def _fmix32(x):
    """MurmurHash3's 32-bit finaliser (a bijective avalanche mix), on uint32."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def map_split(tiles):
    """int32[...]: 0 (train) or 1 (test), a hash bit of the map's size and tile codes.

    Each cell contributes ``fmix32(4 * cell + code)``; the sum (mod 2^32) is mixed with ``n``
    and its top bit is the split. A pure function of the content: see the module docstring.
    """
    n = tiles.shape[-1]
    codes = tiles.reshape(tiles.shape[:-2] + (n * n,)).astype(jnp.uint32)
    cells = jnp.arange(n * n, dtype=jnp.uint32)
    h = jnp.sum(_fmix32(cells * jnp.uint32(4) + codes), axis=-1, dtype=jnp.uint32)
    h = _fmix32(h ^ jnp.uint32(n * 0x9E3779B9 & 0xFFFFFFFF))
    return (h >> 31).astype(jnp.int32)


def candidate_maps(key, num: int, size: int, p: float, random_start_goal: bool):
    """int8[num, size, size] maps before the solvability check (frozen with probability p)."""
    k_tiles, k_start, k_goal = jax.random.split(key, 3)
    cells = size * size
    frozen = jax.random.bernoulli(k_tiles, p, (num, cells))
    tiles = jnp.where(frozen, grid.FROZEN, grid.HOLE).astype(jnp.int8)
    if random_start_goal:
        start = jax.random.randint(k_start, (num,), 0, cells)
        goal = jax.random.randint(k_goal, (num,), 0, cells - 1)
        goal = goal + (goal >= start)  # uniform over the cells other than start
    else:
        start = jnp.zeros((num,), jnp.int32)
        goal = jnp.full((num,), cells - 1, jnp.int32)
    rows = jnp.arange(num)
    tiles = tiles.at[rows, start].set(grid.START).at[rows, goal].set(grid.GOAL)
    return tiles.reshape(num, size, size)


def _check_args(num_maps, size, p, split, oversample, max_rounds):
    if not isinstance(num_maps, int) or num_maps < 1:
        raise ValueError(f"num_maps must be a positive int, got {num_maps!r}")
    if not isinstance(size, int) or size < 2:
        raise ValueError(f"size must be an int >= 2, got {size!r}")
    if not 0.0 < p <= 1.0:
        raise ValueError(f"p (frozen probability) must be in (0, 1], got {p!r}")
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be None or one of {SPLITS}, got {split!r}")
    if not isinstance(oversample, int) or oversample < 1:
        raise ValueError(f"oversample must be a positive int, got {oversample!r}")
    if not isinstance(max_rounds, int) or max_rounds < 1:
        raise ValueError(f"max_rounds must be a positive int, got {max_rounds!r}")


@functools.partial(
    jax.jit,
    static_argnames=(
        "num_maps",
        "size",
        "p",
        "random_start_goal",
        "split",
        "oversample",
        "max_rounds",
    ),
)
def generate_with_status(
    key,
    num_maps: int,
    *,
    size: int = 8,
    p: float = 0.8,
    random_start_goal: bool = False,
    split: str | None = None,
    oversample: int = 2,
    max_rounds: int = 1000,
):
    """Jitted core of :func:`generate`: ``(int8[num_maps, size, size], bool[num_maps] filled)``.

    A slot stays unfilled (all zeros) only if ``max_rounds`` rounds of ``oversample *
    num_maps`` candidates did not yield enough acceptable maps.
    """
    _check_args(num_maps, size, p, split, oversample, max_rounds)
    pool = oversample * num_maps

    def acceptable(candidates):
        ok = is_solvable(candidates)
        if split is not None:
            ok = ok & (map_split(candidates) == SPLITS.index(split))
        return ok

    def body(carry):
        round_, maps, filled = carry
        candidates = candidate_maps(
            jax.random.fold_in(key, round_), pool, size, p, random_start_goal
        )
        ok = acceptable(candidates)
        slot = filled + jnp.cumsum(ok) - 1  # accepted candidates fill slots in pool order
        slot = jnp.where(ok, slot, num_maps)  # out of range => dropped
        maps = maps.at[slot].set(candidates, mode="drop")
        return round_ + 1, maps, jnp.minimum(filled + jnp.sum(ok), num_maps)

    def cond(carry):
        round_, _, filled = carry
        return (filled < num_maps) & (round_ < max_rounds)

    init = (jnp.int32(0), jnp.zeros((num_maps, size, size), jnp.int8), jnp.int32(0))
    _, maps, filled = jax.lax.while_loop(cond, body, init)
    return maps, jnp.arange(num_maps) < filled


def generate(
    key,
    num_maps: int,
    *,
    size: int = 8,
    p: float = 0.8,
    random_start_goal: bool = False,
    split: str | None = None,
    oversample: int = 2,
    max_rounds: int = 1000,
) -> jax.Array:
    """``num_maps`` random solvable maps, ``int8[num_maps, size, size]``.

    ``split="train"``/``"test"`` keeps only maps of that split (disjoint, see the module
    docstring); ``oversample`` sets candidates per round per requested map. Raises
    ``ValueError`` if ``max_rounds`` rounds do not suffice (p too small for the size).
    """
    maps, filled = generate_with_status(
        key,
        num_maps,
        size=size,
        p=p,
        random_start_goal=random_start_goal,
        split=split,
        oversample=oversample,
        max_rounds=max_rounds,
    )
    if not bool(jnp.all(filled)):
        raise ValueError(
            f"only {int(jnp.sum(filled))} of {num_maps} solvable {size}x{size} maps with p={p} "
            f"after max_rounds={max_rounds} rounds; raise p, oversample or max_rounds"
        )
    return maps
