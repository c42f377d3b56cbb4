"""The initial policy: a random Qwen3 of small dimensions with a tokenizer built offline for the
FrozenLake text, or a local Qwen3 directory (paper scale). Either way the result is a Hugging
Face model directory (config, safetensors, tokenizer), which every later phase loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
from flax import nnx

from agentrl_jax.models import Qwen3Config, Qwen3ForCausalLM, export_qwen3
from agentrl_jax.models.small_tokenizer import build_small_tokenizer, save_small_tokenizer
from agentrl_jax.prompts import BudgetPrompt
from envs.frozenlake import grid
from envs.frozenlake.text import render

def frozenlake_corpus(instructions: str, maps: np.ndarray, t_max: int,
                      prompt: BudgetPrompt = BudgetPrompt(), grids_per_map: int = 4) -> list[str]:
    """The texts between the special tokens of a FrozenLake conversation in Qwen3's chat
    format, weighted by how often they recur: the system prompt at every budget, each turn's
    user message (header and grid), the assistant header and the answers."""
    system = [f"system\n{prompt.system_text(instructions, b)}" for b in range(1, t_max + 1)]
    grids = []
    for tiles in maps:
        cells = np.flatnonzero(np.asarray(tiles).reshape(-1) != grid.HOLE)[:grids_per_map]
        grids += [render(tiles, int(pos)) for pos in cells]
    turns = [f"user\n{prompt.turn_text(grids[(b * t_max + t) % len(grids)], b, t)}"
             for b in range(1, t_max + 1) for t in range(b)]
    answers = [f"\n\n<answer>{name}</answer>" for name in grid.ACTION_NAMES]
    return (system * 32 + turns * 8 + [f"user\n{g}" for g in grids]
            + (answers + ["assistant\n", "\n\n", "\n"]) * 256)


def build_frozenlake_tokenizer(instructions: str, maps: np.ndarray, t_max: int, vocab_size: int):
    """A small byte-level BPE with Qwen3's chat format, trained on :func:`frozenlake_corpus`."""
    return build_small_tokenizer(frozenlake_corpus(instructions, maps, t_max), vocab_size=vocab_size,
                                 split_words=False)


def random_qwen3(vocab_size: int, *, hidden_size: int, intermediate_size: int,
                 num_hidden_layers: int, num_attention_heads: int, num_key_value_heads: int,
                 head_dim: int, max_position_embeddings: int, seed: int = 0,
                 eos_token_ids: Sequence[int] = ()) -> Qwen3ForCausalLM:
    """A randomly initialised Qwen3 (untied head) of the given dimensions."""
    config = Qwen3Config(vocab_size=vocab_size, hidden_size=hidden_size,
                         intermediate_size=intermediate_size, num_hidden_layers=num_hidden_layers,
                         num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, head_dim=head_dim,
                         max_position_embeddings=max_position_embeddings,
                         eos_token_ids=tuple(eos_token_ids))
    return Qwen3ForCausalLM(config, rngs=nnx.Rngs(seed))


def save_policy(model: Qwen3ForCausalLM, tokenizer, out_dir: str | Path) -> Path:
    """``model`` and ``tokenizer`` as one Hugging Face directory (replacing an older one)."""
    out_dir = Path(out_dir)
    export_qwen3(model, out_dir, overwrite=True)
    save_small_tokenizer(tokenizer, out_dir)
    return out_dir
