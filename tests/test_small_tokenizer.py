"""The small FrozenLake tokenizer keeps Qwen3's chat format and round-trips any text."""

from hypothesis import given, settings, strategies as st

from agentrl_jax.models.small_tokenizer import build_small_tokenizer, save_small_tokenizer
from agentrl_jax.models.tokenizer import load_tokenizer, render_chat
from agentrl_jax.prompts import BudgetPrompt, ChatTokens

CORPUS = ["P _ _ O\n_ O _ G", "<answer>Left</answer>", "<answer>Down</answer>",
          "[MAX TURNS] 20 [CURRENT TURN] 3 [REMAINING TURNS] 17"] * 50

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
    assert len(tok("<answer>Left</answer>", add_special_tokens=False)["input_ids"]) <= 8  # of 21 bytes


@settings(max_examples=50, deadline=None)
@given(st.text())
def test_any_text_round_trips(text):
    ids = _TOK(text, add_special_tokens=False)["input_ids"]
    assert all(0 <= i < len(_TOK) for i in ids)
    if not any(s in text for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")):
        assert _TOK.decode(ids) == text


def test_budget_prompt_encodes_compactly():
    turn = BudgetPrompt().turn_text("P _ _ O\n_ O _ G", budget=20, turn=3)
    assert _TOK.decode(_TOK(turn, add_special_tokens=False)["input_ids"]) == turn
