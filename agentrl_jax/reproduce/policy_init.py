"""The initial policy: a random Qwen3 of small dimensions with a tokenizer built offline from the
environment's text (its study's corpus, :meth:`agentrl_jax.reproduce.studies.Study.corpus`), or a
local Qwen3 directory (paper scale). Either way the result is a Hugging Face model directory
(config, safetensors, tokenizer), which every later phase loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from flax import nnx

from agentrl_jax.models import Qwen3Config, Qwen3ForCausalLM, export_qwen3
from agentrl_jax.models.small_tokenizer import save_small_tokenizer


def random_qwen3(
    vocab_size: int,
    *,
    hidden_size: int,
    intermediate_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
    max_position_embeddings: int,
    seed: int = 0,
    eos_token_ids: Sequence[int] = (),
) -> Qwen3ForCausalLM:
    """A randomly initialised Qwen3 (untied head) of the given dimensions."""
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        eos_token_ids=tuple(eos_token_ids),
    )
    return Qwen3ForCausalLM(config, rngs=nnx.Rngs(seed))


def save_policy(model: Qwen3ForCausalLM, tokenizer, out_dir: str | Path) -> Path:
    """``model`` and ``tokenizer`` as one Hugging Face directory (replacing an older one)."""
    out_dir = Path(out_dir)
    export_qwen3(model, out_dir, overwrite=True)
    save_small_tokenizer(tokenizer, out_dir)
    return out_dir
