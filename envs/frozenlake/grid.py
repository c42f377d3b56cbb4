"""Tile and action codes of FrozenLake, and the one move rule everything shares.

The codes and the move rule are gymnasium's FrozenLake-v1 (``toy_text/frozen_lake.py``):
actions 0 Left, 1 Down, 2 Right, 3 Up; a move into the border leaves the agent in place;
a slippery step goes in the intended direction or one of its two perpendicular neighbours
``(a - 1) % 4`` and ``(a + 1) % 4``.

A map is an ``int8[n, n]`` array of tile codes; a position is the flat cell index
``row * n + col`` (gymnasium's observation).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

# Tile codes (int8). Letters are gymnasium's map characters.
FROZEN, HOLE, START, GOAL = 0, 1, 2, 3
TILE_LETTERS = "FHSG"  # TILE_LETTERS[code] is gymnasium's letter

# Action codes, as in gymnasium.
LEFT, DOWN, RIGHT, UP = 0, 1, 2, 3
NUM_ACTIONS = 4
ACTION_NAMES = ("Left", "Down", "Right", "Up")

# Row/col displacement of each action, indexed by action code.
ACTION_DROW = (0, 1, 0, -1)
ACTION_DCOL = (-1, 0, 1, 0)


def move(pos, action, n: int):
    """Cell reached from flat cell ``pos`` by ``action`` on an ``n x n`` grid (walls stay).

    Works elementwise on any broadcastable integer arrays (JAX or NumPy).
    """
    xp = jnp if isinstance(pos, jnp.ndarray) or isinstance(action, jnp.ndarray) else np
    row, col = pos // n, pos % n
    drow = xp.asarray(ACTION_DROW)[action]
    dcol = xp.asarray(ACTION_DCOL)[action]
    row = xp.clip(row + drow, 0, n - 1)
    col = xp.clip(col + dcol, 0, n - 1)
    return row * n + col


def slip_actions(action):
    """The three actions a slippery step may take: ``(a - 1) % 4, a, (a + 1) % 4``.

    Returns an array with a trailing axis of 3 in gymnasium's order.
    """
    xp = jnp if isinstance(action, jnp.ndarray) else np
    action = xp.asarray(action)
    return xp.stack([(action - 1) % NUM_ACTIONS, action, (action + 1) % NUM_ACTIONS], axis=-1)


def is_terminal_tile(tile):
    """Holes and the goal are absorbing."""
    return (tile == HOLE) | (tile == GOAL)


def map_from_strings(rows: list[str] | tuple[str, ...]) -> np.ndarray:
    """Gymnasium's list-of-strings map (e.g. ``["SFFF", "FHFH", ...]``) to an int8 array."""
    n = len(rows)
    if n == 0 or any(len(r) != n for r in rows):
        raise ValueError(
            f"map must be square and non-empty, got row lengths {[len(r) for r in rows]}"
        )
    try:
        return np.array([[TILE_LETTERS.index(c) for c in r] for r in rows], dtype=np.int8)
    except ValueError as e:
        raise ValueError(f"map has a letter outside {TILE_LETTERS!r}: {rows}") from e


def map_to_strings(tiles) -> list[str]:
    """Inverse of :func:`map_from_strings`."""
    return ["".join(TILE_LETTERS[int(c)] for c in row) for row in np.asarray(tiles)]


# gymnasium's built-in maps (MAPS in frozen_lake.py).
DEFAULT_MAPS = {
    "4x4": ("SFFF", "FHFH", "FFFH", "HFFG"),
    "8x8": (
        "SFFFFFFF",
        "FFFFFFFF",
        "FFFHFFFF",
        "FFFFFHFF",
        "FFFHFFFF",
        "FHHFFFHF",
        "FHFFHFHF",
        "FFFHFFFG",
    ),
}


def start_cell(tiles):
    """Flat index of the START tile of ``int8[..., n, n]`` maps: ``int32[...]`` (0 if none)."""
    flat = jnp.asarray(tiles).reshape(*jnp.shape(tiles)[:-2], -1)
    return jnp.argmax(flat == START, axis=-1).astype(jnp.int32)
