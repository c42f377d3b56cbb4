"""``agentrl-jax bench forward``: Qwen3 prefill tokens/s, our jitted forward vs transformers.

Both sides run the same random checkpoint (written by ``transformers.save_pretrained`` and
loaded by our loader) on the same token batch, computing logits for every position. The logits
are compared before timing, so the ratio compares the same computation.

A shape with ``num_experts`` is a Qwen3 MoE (``qwen3_moe``): ``transformers``'
``Qwen3MoeForCausalLM`` writes the checkpoint and is the baseline (its experts implementation,
e.g. ``grouped_mm``, is named in the result). "qwen3-30b-a3b-1layer" is Qwen3-30B-A3B's
``config.json`` (128 experts of 768, 8 per token) with its 48 layers cut to 1, not 2: at 2
layers the two float32 copies (ours and transformers', 7.5 GB each) and the checkpoint between
them leave too little of a 24 GiB machine; at 1 layer they are 5.0 + 5.0 GB.
"""

from __future__ import annotations

import tempfile
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from agentrl_jax.bench.report import BenchResult, median_time
from agentrl_jax.models.config import MOE_MODEL_TYPE, qwen3_hf_config

# Model shapes (``transformers`` config fields; with ``num_experts``, a Qwen3 MoE).
# "qwen3-0.6b-2layers" is Qwen3-0.6B's config.json with 28 layers cut to 2,
# "qwen3-30b-a3b-1layer" Qwen3-30B-A3B's with 48 cut to 1 (the module docstring says why 1).
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
    "qwen3-0.6b-2layers": qwen3_hf_config("qwen3-0.6b", num_hidden_layers=2),
    "tiny-moe": dict(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    ),
    "qwen3-30b-a3b-1layer": qwen3_hf_config("qwen3-30b-a3b", num_hidden_layers=1),
}
DENSE_CONFIGS = ("tiny", "qwen3-0.6b-2layers")  # run()'s default (the MoE sizes are opt-in)
DTYPES = {"float32": (jnp.float32, "float32"), "bfloat16": (jnp.bfloat16, "bfloat16")}


def run(
    *,
    configs: Sequence[str] = DENSE_CONFIGS,
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


def is_moe(dims: dict) -> bool:
    """Whether the shape ``dims`` (``transformers`` config fields) is a Qwen3 MoE."""
    return bool(dims.get("num_experts"))


def random_hf_model(dims: dict):
    """A randomly initialised ``transformers`` model of shape ``dims``: ``Qwen3MoeForCausalLM``
    when it has experts (:func:`is_moe`), else ``Qwen3ForCausalLM``."""
    import transformers

    if is_moe(dims):
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**dims))
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**dims))


def hf_implementation(hf) -> str:
    """The kernels a loaded ``transformers`` model runs: its attention implementation, and a
    MoE's experts implementation (e.g. ``"sdpa, grouped_mm experts"``)."""
    attention = hf.config._attn_implementation
    if hf.config.model_type != MOE_MODEL_TYPE:
        return attention
    return f"{attention}, {hf.config._experts_implementation} experts"


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
        random = random_hf_model(CONFIGS[name])
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
        f"{hf_implementation(hf)})",
        settings={
            "config": name,
            "model_type": hf.config.model_type,
            "batch": batch,
            "seq_len": seq_len,
            "dtype": dtype,
            "repeats": repeats,
            "logits_max_abs_diff": max_diff,
            "jax_backend": jax.default_backend(),
            "torch_threads": torch.get_num_threads(),
        },
    )
