import numpy as np

from envs.frozenlake import grid


def test_move_matches_gymnasium_inc():
    # gymnasium's inc(): LEFT col-1, DOWN row+1, RIGHT col+1, UP row-1, clipped.
    n = 4
    assert grid.move(0, grid.LEFT, n) == 0
    assert grid.move(0, grid.UP, n) == 0
    assert grid.move(0, grid.RIGHT, n) == 1
    assert grid.move(0, grid.DOWN, n) == 4
    assert grid.move(15, grid.DOWN, n) == 15
    assert grid.move(15, grid.RIGHT, n) == 15
    assert grid.move(5, grid.UP, n) == 1


def test_slip_actions_order():
    np.testing.assert_array_equal(grid.slip_actions(0), [3, 0, 1])
    np.testing.assert_array_equal(grid.slip_actions(3), [2, 3, 0])


def test_map_round_trip():
    rows = list(grid.DEFAULT_MAPS["8x8"])
    assert grid.map_to_strings(grid.map_from_strings(rows)) == rows
