"""``agentrl-jax bench lora``: what a LoRA run's rollouts pay for applying the adapters.

A LoRA run's rollouts decode with the adapters applied to the frozen base
(:func:`~agentrl_jax.train.state.sampler_params`): no second copy of the weights, at the cost of
the adapters' low-rank products in every projection. The baseline, in the same run on the same
prompts: the same sampler on the merged weights (``W + (alpha / r) B A``, what merging once per
update would decode with). Both decode ``new`` tokens per row after a prefill of
``prompt_len``, float32, on this backend; the figure is decode time per token position (prefill
excluded), in ms, and ``ratio`` = merged time / adapters time (1 = free, below 1 = the
adapters' cost).
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from flax import nnx

from agentrl_jax.bench.forward import CONFIGS as MODEL_SHAPES
from agentrl_jax.bench.forward import is_moe
from agentrl_jax.bench.report import BenchResult
from agentrl_jax.bench.sample import TOP_P, _median_of, time_decode_only
from agentrl_jax.models import Qwen3Config, Qwen3ForCausalLM, lora
from agentrl_jax.sampling import Sampler, pad_rows


def run(
    *,
    sizes: Sequence[str] = ("qwen3-0.6b-2layers",),
    batch: int = 8,
    prompt_len: int = 64,
    new: int = 32,
    rank: int = 16,
    repeats: int = 3,
    seed: int = 0,
) -> list[BenchResult]:
    known = [s for s, dims in MODEL_SHAPES.items() if not is_moe(dims)]  # no LoRA on experts
    unknown = [s for s in sizes if s not in known]
    if unknown:
        raise ValueError(f"unknown size {unknown[0]!r}; known: {', '.join(known)}")
    results = []
    key = jax.random.key(seed)
    for size in sizes:
        config = Qwen3Config(**MODEL_SHAPES[size])
        base = Qwen3ForCausalLM(config, rngs=nnx.Rngs(seed))
        adapted = lora.with_adapters(base, lora.LoraConfig(rank=rank), jax.random.key(seed + 1))
        graphdef, adapters, frozen = lora.split_adapters(adapted)
        # B at random (at 0 the adapters are a no-op numerically, not in cost)
        pure = nnx.to_pure_dict(adapters)
        for name, value in pure["layers"]["lora"].items():
            if name.endswith("_b"):
                pure["layers"]["lora"][name] = 0.01 * np.ones(value.shape, np.float32)
        nnx.replace_by_pure_dict(adapters, pure)
        adapted = nnx.merge(graphdef, adapters, frozen)
        merged = lora.merged_model(adapted)
        rng = np.random.default_rng(seed)
        prompt = pad_rows(
            [rng.integers(0, config.vocab_size, prompt_len).tolist() for _ in range(batch)],
            prompt_len,
        )
        times = {}
        for label, model in (("adapters", adapted), ("merged", merged)):
            sampler = Sampler(model, max_new_tokens=new, stop_token_ids=())
            timer = time_decode_only(sampler, nnx.state(model), prompt, new, TOP_P, key)
            times[label] = _median_of(timer, repeats)
        results.append(
            BenchResult(  # ms per decoded token position (lower is better)
                name=f"LoRA decode, {size}, rank {rank}, batch {batch}: adapters applied",
                unit="ms",
                ours=1e3 * times["adapters"],
                baseline=1e3 * times["merged"],
                baseline_name="the same sampler on the merged weights",
                settings={
                    "size": size,
                    "rank": rank,
                    "targets": list(lora.PROJECTIONS),
                    "batch": batch,
                    "prompt_len": prompt_len,
                    "new_tokens": new,
                    "repeats": repeats,
                    "statistic": "median",
                    "backend": jax.default_backend(),
                    "dtype": "float32",
                },
            )
        )
    return results
