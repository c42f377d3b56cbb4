"""Tiny random Hugging Face Qwen3 checkpoints for the model tests (made with transformers)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers

TINY = dict(
    vocab_size=250,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


def save_random_hf_qwen3(
    path: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides
) -> transformers.Qwen3ForCausalLM:
    """Save a random ``Qwen3ForCausalLM`` (``TINY`` updated by ``overrides``) to ``path``.

    Weights use std 0.1 (not the default 0.02) and norm weights are perturbed around 1, so
    every parameter matters and logits are O(1): a 1e-4 tolerance then means something.
    """
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(**{**TINY, "initializer_range": 0.1, **overrides})
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    model = model.to(dtype)
    model.save_pretrained(path)
    return model


def load_hf_qwen3(path: Path, dtype: torch.dtype = torch.float32) -> transformers.Qwen3ForCausalLM:
    """``from_pretrained`` in ``dtype``. (Unlike ``model.to(dtype)``, this keeps the RoPE
    inverse frequencies in float32, as real bfloat16 inference does.)"""
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def hf_logits(
    model: transformers.Qwen3ForCausalLM,
    tokens: np.ndarray,
    attention_mask: np.ndarray | None = None,
    position_ids: np.ndarray | None = None,
) -> np.ndarray:
    """transformers' logits ``[B, L, V]`` as float32 NumPy."""
    kwargs = {}
    if attention_mask is not None:
        kwargs["attention_mask"] = torch.tensor(attention_mask, dtype=torch.long)
    if position_ids is not None:
        kwargs["position_ids"] = torch.tensor(position_ids, dtype=torch.long)
    with torch.no_grad():
        out = model(torch.tensor(tokens, dtype=torch.long), **kwargs).logits
    return out.float().numpy()


def hf_greedy(
    model: transformers.PreTrainedModel,
    tokens: np.ndarray,
    attention_mask: np.ndarray,
    new: int,
    eos_token_id: int | None = None,
) -> np.ndarray:
    """``generate``'s greedy continuation ``[B, new]`` of left-padded ``tokens`` (pad id 0)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(attention_mask, dtype=torch.long),
            do_sample=False,
            max_new_tokens=new,
            eos_token_id=eos_token_id,
            pad_token_id=0,
        )
    return out[:, tokens.shape[1] :].numpy()
