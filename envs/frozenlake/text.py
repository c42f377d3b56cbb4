"""The text interface an LLM sees: the rendered grid, and its response parsed into an action.

Rendering
---------
One line per row, cells separated by one space, using these symbols:

====  =====================================================
``P``  the player (on a frozen or start cell)
``_``  frozen ice (an unoccupied start cell is plain ice too)
``O``  a hole
``G``  the goal
``X``  the player in a hole (the episode is lost)
``W``  the player on the goal (the episode is won)
====  =====================================================

For example the 4x4 default map at the start::

    P _ _ _
    _ O _ O
    _ _ _ O
    O _ _ G

Parsing (the accepted grammar)
------------------------------
:func:`parse_action` maps any string to an action code 0..3 or :data:`INVALID`:

1. Thinking is ignored: everything up to the last ``</think>`` is dropped; if a ``<think>``
   is still open after that (an unfinished thought), everything from it on is dropped too.
2. If what remains contains an ``<answer>`` tag, only the content of the last one counts (up
   to its ``</answer>``, or to the end if it is not closed).
3. In that text the direction words ``left``, ``down``, ``right``, ``up`` are found in any
   case as whole words: not touching another ASCII letter, digit or underscore (so "setup",
   "upward" and "Left2" hold none; non-ASCII characters do not join words).
4. If exactly one distinct direction occurs (it may repeat: "Left. Going left."), that is the
   action; none, or two different ones ("not left, right"), is :data:`INVALID`.

So "Left", " left\\n", "<answer>Left</answer>", "Action: Up", "I'll go Down" and
"<think>left or up?</think><answer>UP</answer>" are accepted; "Up or down", "" and an
unfinished "<think>go left" are invalid. Tags are case-insensitive and may hold spaces
(``</ Think >``). The parser never raises on any ``str``.
"""

from __future__ import annotations

import re

import numpy as np

from envs.frozenlake import grid

INVALID = -1

# Symbol of an unoccupied cell, and of the player, indexed by tile code (FROZEN, HOLE, START, GOAL).
CELL_SYMBOLS = ("_", "O", "_", "G")
PLAYER_SYMBOLS = ("P", "X", "P", "W")

_THINK_OPEN = re.compile(r"<\s{0,4}think\s{0,4}>", re.IGNORECASE | re.ASCII)
_THINK_CLOSE = re.compile(r"<\s{0,4}/\s{0,4}think\s{0,4}>", re.IGNORECASE | re.ASCII)
_ANSWER_OPEN = re.compile(r"<\s{0,4}answer\s{0,4}>", re.IGNORECASE | re.ASCII)
_ANSWER_CLOSE = re.compile(r"<\s{0,4}/\s{0,4}answer\s{0,4}>", re.IGNORECASE | re.ASCII)
_DIRECTION = re.compile(
    r"(?<![A-Za-z0-9_])(left|down|right|up)(?![A-Za-z0-9_])", re.IGNORECASE | re.ASCII
)
_ACTION_OF_WORD = {name.lower(): code for code, name in enumerate(grid.ACTION_NAMES)}


def render(tiles, pos) -> str:
    """The grid as text (symbols in the module docstring). ``tiles``: int[n, n]; ``pos``: flat
    cell."""
    tiles = np.asarray(tiles)
    if tiles.ndim != 2 or tiles.shape[0] != tiles.shape[1]:
        raise ValueError(f"render: tiles must be a square [n, n] map, got shape {tiles.shape}")
    if tiles.size and (tiles.min() < 0 or tiles.max() > grid.GOAL):
        raise ValueError(f"render: tiles hold codes outside 0..{grid.GOAL}")
    pos = int(pos)
    if not 0 <= pos < tiles.size:
        raise ValueError(f"render: pos {pos} is outside the {tiles.shape[0]}x{tiles.shape[1]} map")
    cells = [CELL_SYMBOLS[c] for c in tiles.reshape(-1)]
    cells[pos] = PLAYER_SYMBOLS[tiles.reshape(-1)[pos]]
    n = tiles.shape[1]
    return "\n".join(" ".join(cells[r * n : (r + 1) * n]) for r in range(tiles.shape[0]))


def parse_grid(text: str) -> tuple[np.ndarray, int]:
    """The inverse of :func:`render` for a live player: ``(tiles int8[n, n], pos)``.

    The start cell reads as plain ice (``render`` does not mark it), which has the same
    dynamics. Raises ``ValueError`` on text that is not a square grid with exactly one ``P``.
    """
    rows = [line.split(" ") for line in text.strip("\n").split("\n")]
    n = len(rows)
    if any(len(row) != n for row in rows):
        raise ValueError(f"parse_grid: not a square grid of space-separated cells: {text!r}")
    tile_of = {"_": grid.FROZEN, "P": grid.FROZEN, "O": grid.HOLE, "G": grid.GOAL}
    cells = [c for row in rows for c in row]
    unknown = sorted(set(cells) - set(tile_of))
    if unknown or cells.count("P") != 1:
        raise ValueError(f"parse_grid: expected symbols {sorted(tile_of)} with one P, got {text!r}")
    tiles = np.array([tile_of[c] for c in cells], np.int8).reshape(n, n)
    return tiles, cells.index("P")


def _last_match(pattern: re.Pattern, text: str):
    last = None
    for match in pattern.finditer(text):
        last = match
    return last


def answer_part(text: str) -> str:
    """The part of a response that counts (steps 1 and 2 of the grammar)."""
    close = _last_match(_THINK_CLOSE, text)
    if close is not None:
        text = text[close.end() :]
    unfinished = _THINK_OPEN.search(text)
    if unfinished is not None:
        text = text[: unfinished.start()]
    opening = _last_match(_ANSWER_OPEN, text)
    if opening is not None:
        text = text[opening.end() :]
        end = _ANSWER_CLOSE.search(text)
        if end is not None:
            text = text[: end.start()]
    return text


def parse_action(text: str) -> int:
    """Action code 0..3 (Left, Down, Right, Up) or :data:`INVALID` for any string.

    Raises ``TypeError`` only for a non-``str`` argument (a caller's bug, not model output).
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_action expects a str, got {type(text).__name__}")
    words = {m.group(1).lower() for m in _DIRECTION.finditer(answer_part(text))}
    if len(words) != 1:
        return INVALID
    return _ACTION_OF_WORD[words.pop()]
