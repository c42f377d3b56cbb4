"""A small byte-level BPE tokenizer with Qwen3's chat format, built offline from a corpus.

The CPU reproduction trains a small Qwen3-architecture policy from scratch; the real Qwen3
vocabulary (151,936 rows) would make its embedding and output head dominate everything. This
tokenizer keeps the code paths of a real Qwen3 (same special tokens, the bundled Qwen3 chat
template with thinking on/off, byte-level BPE so every string encodes) with a vocabulary of a
few hundred tokens learned from the environment's own text.

It is built with the ``tokenizers`` library (the one ``transformers`` uses) and saved with
``save_pretrained``, so :func:`agentrl_jax.models.tokenizer.load_tokenizer` loads it from a
model directory like any other.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from agentrl_jax.models.tokenizer import bundled_tokenizer_dir

# Qwen3's special tokens that its chat template uses, in Qwen3's id order; pad is <|endoftext|>.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Added (non-special) tokens of the chat template: kept whole, decoded as text.
THINK_TOKENS = ("<think>", "</think>")


def qwen3_chat_template() -> str:
    """The chat template of the bundled Qwen3 tokenizer (thinking on/off)."""
    config = json.loads((bundled_tokenizer_dir() / "tokenizer_config.json").read_text())
    return config["chat_template"]


def build_small_tokenizer(
    corpus: Iterable[str],
    vocab_size: int = 512,
    *,
    split_words: bool = True,
    isolate: str | None = None,
) -> transformers.PreTrainedTokenizerFast:
    """Train a byte-level BPE of ``vocab_size`` tokens (specials included) on ``corpus``.

    Every string encodes (the 256 byte tokens are always in the vocabulary); ids 0..2 are
    ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, then ``<think>``, ``</think>``.

    ``split_words``: merges stay within words (GPT-2's pre-tokenizer regex), as in real LLM
    tokenizers; False lets merges cross spaces and punctuation, so text that recurs verbatim
    (a system prompt, a grid row, a turn header) becomes a few tokens -- much shorter
    sequences for a model trained from scratch on one environment's text.

    ``isolate``: a regular expression (Oniguruma syntax, as ``tokenizers`` reads it) whose
    matches are pre-tokens of their own: no merge crosses their edges, so each match becomes
    one token or a few (FrozenLake's grid cells:
    :attr:`agentrl_jax.reproduce.studies.Study.tokenizer_isolate`).
    """
    reserved = len(SPECIAL_TOKENS) + len(THINK_TOKENS)
    if vocab_size < 256 + reserved:
        raise ValueError(
            f"vocab_size must be >= {256 + reserved} (bytes + special tokens), got {vocab_size}"
        )
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split_words)
    if isolate is not None:
        core.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(isolate), behavior="isolated"), core.pre_tokenizer]
        )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS + THINK_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(list(corpus), trainer=trainer)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = qwen3_chat_template()
    return tok


def save_small_tokenizer(
    tokenizer: transformers.PreTrainedTokenizerBase, model_dir: str | Path
) -> None:
    """Write the tokenizer files into ``model_dir`` (next to a model's config and weights)."""
    Path(model_dir).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(model_dir))
