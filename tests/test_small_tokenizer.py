"""The small FrozenLake tokenizer keeps Qwen3's chat format and round-trips any text."""

import jax
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl_jax.models.small_tokenizer import build_small_tokenizer, save_small_tokenizer
from agentrl_jax.models.tokenizer import load_tokenizer, render_chat
from agentrl_jax.prompts import BudgetPrompt, ChatTokens
from agentrl_jax.reproduce.studies.frozenlake import FrozenLakeStudy, frozenlake_corpus
from envs.frozenlake import maps as fl_maps
from envs.frozenlake.text import render
from envs.frozenlake.text_env import FrozenLakeTextConfig, FrozenLakeTextEnv

CORPUS = [
    "P _ _ O\n_ O _ G",
    "<answer>Left</answer>",
    "<answer>Down</answer>",
    "[MAX TURNS] 20 [CURRENT TURN] 3 [REMAINING TURNS] 17",
] * 50

_TOK = build_small_tokenizer(CORPUS, vocab_size=300)


def test_special_tokens_and_chat_template_match_qwen3(tmp_path):
    save_small_tokenizer(_TOK, tmp_path)
    tok = load_tokenizer(tmp_path)
    qwen = load_tokenizer()
    assert 261 < len(tok) <= 300  # bytes + specials + learned merges (fewer if the corpus runs out)
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "P _ G"}]
    for thinking in (True, False):
        text = render_chat(tok, messages, enable_thinking=thinking)
        assert text == render_chat(qwen, messages, enable_thinking=thinking)
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    chat = ChatTokens(tok)
    assert chat.end_of_turn == (2,) and chat.stop_token_ids == (2,)
    # Frequent corpus strings became single tokens: the vocabulary was learned.
    assert (
        len(tok("<answer>Left</answer>", add_special_tokens=False)["input_ids"]) <= 8
    )  # of 21 bytes


@settings(max_examples=50, deadline=None)
@given(st.text())
def test_any_text_round_trips(text):
    ids = _TOK(text, add_special_tokens=False)["input_ids"]
    assert all(0 <= i < len(_TOK) for i in ids)
    if not any(
        s in text for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
    ):
        assert _TOK.decode(ids) == text


def test_budget_prompt_encodes_compactly():
    turn = BudgetPrompt().turn_text("P _ _ O\n_ O _ G", budget=20, turn=3)
    assert _TOK.decode(_TOK(turn, add_special_tokens=False)["input_ids"]) == turn


def _grid_tokenizers():
    """FrozenLake's small tokenizer built from its real corpus, without and with the study's
    ``tokenizer_isolate`` (every grid cell its own pre-token)."""
    tiles = fl_maps.generate(jax.random.key(0), 32, size=4, p=0.8, random_start_goal=True)
    env = FrozenLakeTextEnv(
        tiles, FrozenLakeTextConfig(t_max=6, is_slippery=True, success_rate=0.8)
    )
    corpus = frozenlake_corpus(env.instructions(), env.maps, 6)
    return (
        build_small_tokenizer(corpus, 512, split_words=False),
        build_small_tokenizer(
            corpus, 512, split_words=False, isolate=FrozenLakeStudy.tokenizer_isolate
        ),
    )


_MERGED, _CELLS = _grid_tokenizers()


def test_isolating_the_grid_cells_keeps_every_token_within_one_cell(tmp_path):
    save_small_tokenizer(_CELLS, tmp_path)
    loaded = load_tokenizer(tmp_path)  # the pre-tokenizer travels in tokenizer.json
    tiles = np.array([[0, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 1], [1, 0, 0, 3]])
    single = 0
    for pos in (
        0,
        1,
        6,
        14,
    ):  # P in each column, at the grid's first cell, next to a hole and the goal
        grid_text = render(tiles, pos)
        turn = BudgetPrompt().turn_text(grid_text, budget=6, turn=2)
        start = len(turn) - len(grid_text) - 1  # the grid's cells: "\nP", " _", ..., "\n_", ...
        cell_edges = {start + 2 * i for i in range(17)}
        for tok in (_CELLS, loaded):
            ids = tok(turn, add_special_tokens=False)["input_ids"]
            pieces = [tok.decode([i]) for i in ids]
            assert "".join(pieces) == turn
            ends = np.cumsum([len(p) for p in pieces])
            edges = {0, *ends.tolist()}
            assert cell_edges <= edges, "a token spans two grid cells"
            single += sum(e - 2 in edges for e in cell_edges - {start})  # cells that are one token
        # without isolation merges cross cells: the grid is fewer tokens than cells
        assert len(_MERGED(grid_text, add_special_tokens=False)["input_ids"]) < 16
    assert single >= 0.75 * 2 * 4 * 16  # this corpus merges most cells ("\nO" stays two bytes)


@settings(max_examples=30, deadline=None)
@given(st.text(alphabet=st.sampled_from(list(" \n_OPGXW<>abc")), max_size=40))
def test_an_isolating_tokenizer_round_trips_grid_like_text(text):
    ids = _CELLS(text, add_special_tokens=False)["input_ids"]
    assert _CELLS.decode(ids) == text
