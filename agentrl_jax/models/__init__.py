"""Qwen3 in Flax NNX: configuration, model and KV cache, Hugging Face checkpoints, tokenizer."""

from agentrl_jax.models.checkpoints import CheckpointError, export_qwen3, load_qwen3
from agentrl_jax.models.config import ConfigError, Qwen3Config, UnsupportedArchitectureError
from agentrl_jax.models.paged_cache import PagedKVCache
from agentrl_jax.models.qwen3 import KVCache, Qwen3ForCausalLM, positions_from_mask

__all__ = [
    "CheckpointError",
    "ConfigError",
    "KVCache",
    "PagedKVCache",
    "Qwen3Config",
    "Qwen3ForCausalLM",
    "UnsupportedArchitectureError",
    "export_qwen3",
    "load_qwen3",
    "positions_from_mask",
]
