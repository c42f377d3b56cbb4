"""Budget prompt wording checks, and chat token pieces vs the tokenizer's own template."""

import pytest

from agentrl_jax.models.tokenizer import load_tokenizer
from agentrl_jax.prompts import BudgetPrompt, ChatTokens


def test_budget_values_appear_in_every_turn():
    prompt = BudgetPrompt()
    assert "at most 20 turns" in prompt.system_text("Reach the goal.", 20)
    text = prompt.turn_text("P _\n_ G", budget=20, turn=7)
    assert (
        "[MAX TURNS] 20" in text and "[CURRENT TURN] 7" in text and "[REMAINING TURNS] 13" in text
    )
    assert text.endswith("P _\n_ G")


@pytest.mark.parametrize(
    "field, template, message",
    [
        ("turn", "{observation} {max_turns} {current_turn}", "remaining_turns"),
        ("system", "{instructions}", "max_turns"),
        ("turn", "{observation} {max_turns} {current_turn} {remaining_turns} {oops}", "unknown"),
        ("turn", "{observation", "not a format string"),
    ],
)
def test_bad_templates_name_the_field(field, template, message):
    with pytest.raises(ValueError, match=f"BudgetPrompt.{field}.*{message}|{message}"):
        BudgetPrompt(**{field: template})


def test_bad_turns_are_rejected():
    with pytest.raises(ValueError, match="turn must be"):
        BudgetPrompt().turn_text("x", budget=5, turn=5)
    with pytest.raises(ValueError, match="budget"):
        BudgetPrompt().system_text("x", 0)


@pytest.mark.parametrize("thinking", [False, True])
def test_token_pieces_concatenate_to_the_chat_template(thinking):
    tok = load_tokenizer()  # the real Qwen3 tokenizer, bundled
    chat = ChatTokens(tok, enable_thinking=thinking)
    assert chat.end_of_turn == (tok.convert_tokens_to_ids("<|im_end|>"),)
    assert set(chat.stop_token_ids) == {151645}  # <|im_end|>, also the tokenizer's EOS
    responses = ["Go <answer>Left</answer>", "Down"]
    users = ["first grid\nP _", "second grid", "third"]
    ids = chat.first_prompt("SYS", users[0])
    messages = [{"role": "system", "content": "SYS"}, {"role": "user", "content": users[0]}]
    for response, user in zip(responses, users[1:]):
        # what the policy samples when thinking is off starts after the empty think block
        sampled = tok(response, add_special_tokens=False)["input_ids"] + list(chat.end_of_turn)
        ids += sampled + chat.close_response(sampled) + chat.next_prompt(user)
        messages += [{"role": "assistant", "content": response}, {"role": "user", "content": user}]
    expected = tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking
    )
    if thinking:
        assert tok.decode(ids) == expected
    else:
        # The template re-renders earlier assistant turns without their empty think block;
        # our tokens keep what was really in context, so compare after removing it.
        assert tok.decode(ids).replace("<think>\n\n</think>\n\n", "") == expected.replace(
            "<think>\n\n</think>\n\n", ""
        )
        assert tok.decode(ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_close_response_only_when_open():
    chat = ChatTokens(load_tokenizer())
    assert chat.close_response([1, 2, *chat.end_of_turn]) == []
    assert chat.close_response([1, 2]) == list(chat.end_of_turn)
