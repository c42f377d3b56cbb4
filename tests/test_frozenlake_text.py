"""Rendering the grid for the LLM and parsing its responses into actions."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs.frozenlake import grid, maps, text
from envs.frozenlake.text import INVALID, parse_action, render

LEFT, DOWN, RIGHT, UP = grid.LEFT, grid.DOWN, grid.RIGHT, grid.UP


def test_render_default_4x4_at_start():
    assert render(maps.default_map("4x4"), 0) == ("P _ _ _\n_ O _ O\n_ _ _ O\nO _ _ G")


def test_render_player_elsewhere_on_hole_and_on_goal():
    tiles = grid.map_from_strings(["SFH", "FHF", "FFG"])
    assert render(tiles, 1) == "_ P O\n_ O _\n_ _ G"  # start cell unoccupied is ice
    assert render(tiles, 2) == "_ _ X\n_ O _\n_ _ G"  # fell into a hole
    assert render(tiles, 8) == "_ _ O\n_ O _\n_ _ W"  # reached the goal
    assert render(np.asarray(tiles, np.int32), 0).startswith("P _ O")


def test_render_rejects_bad_input():
    tiles = maps.default_map("4x4")
    with pytest.raises(ValueError, match="pos 16"):
        render(tiles, 16)
    with pytest.raises(ValueError, match="square"):
        render(tiles[:3], 0)
    with pytest.raises(ValueError, match="codes"):
        render(np.full((2, 2), 9), 0)


ACCEPTED = [
    ("Left", LEFT),
    ("left", LEFT),
    ("  LEFT \n", LEFT),
    ("Down", DOWN),
    ("right", RIGHT),
    ("UP", UP),
    ("<answer>Left</answer>", LEFT),
    ("<answer> down </answer>", DOWN),
    ("<ANSWER>Right</ANSWER>", RIGHT),
    ("Action: Up", UP),
    ("I'll go Down", DOWN),
    ("Left. Going left.", LEFT),
    ("Move: right!", RIGHT),
    ("<think>left or up? the hole is left</think><answer>Up</answer>", UP),
    ("<think>I should go left</think>\n\nRight", RIGHT),
    ("thinking without an opening tag... left? </think> Down", DOWN),  # Qwen3 prompt opened <think>
    ("<think>a</think><think>b up</think> <answer>left</answer>", LEFT),
    ("<answer>Up</answer> wait, no: down", UP),  # only the tag's content counts
    ("<answer>up", UP),  # unclosed answer: to the end
    ("< /think >Left", LEFT),
    ("<answer >left</ answer>", LEFT),
]
INVALID_FORMS = [
    "",
    "   ",
    "hello",
    "Up or down",
    "not left, right",
    "<think>go left",
    "<think>left</think>",
    "<answer></answer> left",
    "upward",
    "setup",
    "leftover",
    "downtown",
    "rightly",
    "Left2",
    "<answer>north</answer>",
    "0",
    "2",
    "<answer>left</answer><answer>sideways</answer>",
]


@pytest.mark.parametrize("response,action", ACCEPTED)
def test_accepted_forms(response, action):
    assert parse_action(response) == action


def test_non_ascii_letters_do_not_glue_words():
    # Word boundaries are ASCII: a following accented letter does not extend "Up" into a word.
    assert parse_action("Up\u00e9") == UP
    assert parse_action("Up\u00e9 ... down") == INVALID


@pytest.mark.parametrize("response", INVALID_FORMS)
def test_invalid_forms(response):
    assert parse_action(response) == INVALID


def test_answer_part_steps():
    assert text.answer_part("<think>x</think>y") == "y"
    assert text.answer_part("a<think>b") == "a"
    assert text.answer_part("<think>x</think> <answer>Up</answer> tail") == "Up"


def test_non_str_is_a_type_error():
    with pytest.raises(TypeError, match="str"):
        parse_action(b"Left")
    with pytest.raises(TypeError):
        parse_action(None)


@settings(max_examples=500, deadline=None)
@given(st.text())
def test_never_raises_on_any_text(response):
    assert parse_action(response) in (INVALID, LEFT, DOWN, RIGHT, UP)


TOKENS = st.sampled_from(
    [
        "<think>",
        "</think>",
        "<answer>",
        "</answer>",
        "< think >",
        "</ANSWER>",
        "Left",
        "left",
        "DOWN",
        "Right",
        "up",
        "Up!",
        " ",
        "\n",
        "go",
        "not",
        "<",
        ">",
        "/",
        "\u0000",
        "\ud800",
        "\U0001f600",
    ]
)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.one_of(TOKENS, st.text(max_size=5)), max_size=30).map("".join))
def test_never_raises_on_tag_and_word_soup(response):
    assert parse_action(response) in (INVALID, LEFT, DOWN, RIGHT, UP)


NOISE = st.text(
    alphabet=st.characters(blacklist_characters="<>", blacklist_categories=("Cs",)), max_size=20
).filter(lambda s: text._DIRECTION.search(s) is None)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(grid.ACTION_NAMES),
    st.sampled_from([str.lower, str.upper, str.title]),
    NOISE,
    NOISE,
)
def test_a_single_tagged_direction_is_found_whatever_the_thinking(name, case, thought, pad):
    response = (
        f"<think>{thought} left up down right</think>{pad}<answer> {case(name)} </answer>{pad}"
    )
    assert parse_action(response) == grid.ACTION_NAMES.index(name)
