"""``agentrl-jax bench forward``: Qwen3 prefill tokens/s, our jitted forward vs transformers.

Both sides run the same random checkpoint (written by ``transformers.save_pretrained`` and
loaded by our loader) on the same token batch, computing logits for every position. The logits
are compared before timing, so the ratio compares the same computation.
"""

from __future__ import annotations

import tempfile
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from agentrl_jax.bench.report import BenchResult, median_time

# Model shapes. "qwen3-0.6b-2layers" is Qwen3-0.6B's config.json with 28 layers cut to 2.
CONFIGS = {
    "tiny": dict(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
    "qwen3-0.6b-2layers": dict(
        vocab_size=151_936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        max_position_embeddings=40_960,
        rms_norm_eps=1e-6,
    ),
}
DTYPES = {"float32": (jnp.float32, "float32"), "bfloat16": (jnp.bfloat16, "bfloat16")}


def run(
    *,
    configs: Sequence[str] = tuple(CONFIGS),
    batch: int = 4,
    seq_len: int = 128,
    dtype: str = "float32",
    repeats: int = 3,
    seed: int = 0,
) -> list[BenchResult]:
    """One :class:`BenchResult` (prefill tokens/s) per config name in ``configs``."""
    unknown = [name for name in configs if name not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown config(s) {unknown}; choose from {list(CONFIGS)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if batch < 1 or seq_len < 1 or repeats < 1:
        raise ValueError("batch, seq_len and repeats must be >= 1")
    return [_prefill(name, batch, seq_len, dtype, repeats, seed) for name in configs]


def _prefill(
    name: str, batch: int, seq_len: int, dtype: str, repeats: int, seed: int
) -> BenchResult:
    """Time both forwards on one random checkpoint of shape ``CONFIGS[name]``."""
    import torch
    import transformers

    from agentrl_jax.models import load_qwen3, positions_from_mask

    jax_dtype, torch_dtype_name = DTYPES[dtype]
    with tempfile.TemporaryDirectory() as model_dir:
        torch.manual_seed(seed)
        random = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**CONFIGS[name]))
        random.save_pretrained(model_dir)
        del random
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, torch_dtype_name)
        ).eval()
        ours = load_qwen3(model_dir, dtype=jax_dtype, param_dtype=jax_dtype)

    tokens = np.random.default_rng(seed).integers(0, CONFIGS[name]["vocab_size"], (batch, seq_len))
    tokens_jax, tokens_torch = jnp.asarray(tokens, jnp.int32), torch.tensor(tokens)
    graphdef, state = nnx.split(ours)

    @jax.jit
    def forward(state, tokens):
        mask = jnp.ones(tokens.shape, bool)
        return nnx.merge(graphdef, state)(tokens, positions_from_mask(mask), mask)[0]

    def run_ours():
        return jax.block_until_ready(forward(state, tokens_jax))

    def run_theirs():
        with torch.inference_mode():
            return hf(tokens_torch).logits

    max_diff = float(np.abs(np.asarray(run_ours()) - run_theirs().float().numpy()).max())
    ours_s = median_time(run_ours, repeats=repeats)
    theirs_s = median_time(run_theirs, repeats=repeats)
    return BenchResult(
        name=f"Qwen3 prefill {name}, {batch}x{seq_len} tokens, {dtype}",
        unit="tokens/s",
        ours=batch * seq_len / ours_s,
        baseline=batch * seq_len / theirs_s,
        baseline_name=f"transformers {transformers.__version__} (torch {torch.__version__}, "
        f"{hf.config._attn_implementation})",
        settings={
            "config": name,
            "batch": batch,
            "seq_len": seq_len,
            "dtype": dtype,
            "repeats": repeats,
            "logits_max_abs_diff": max_diff,
            "jax_backend": jax.default_backend(),
            "torch_threads": torch.get_num_threads(),
        },
    )
