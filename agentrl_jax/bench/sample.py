"""``agentrl-jax bench sample``: batched top-p sampling with a KV cache, and multi-turn reuse.

Checkpoints: one random Hugging Face Qwen3 per config, written by ``transformers`` and loaded
by both sides, so both run the same weights in float32 on the CPU:

* ``tiny``: 2 layers, width 64, vocabulary 1,000 (overhead-bound: loop and dispatch costs);
* ``qwen3-0.6b-2layers``: Qwen3-0.6B's shapes (width 1,024, 16/8 heads of 128, MLP 3,072,
  151,936-row tied embedding, tokenizer vocabulary 151,669) with 2 of its 28 layers
  (bandwidth-bound: the 622 MB output head is read every step).

The final norm weight is set so the logits have a standard deviation of about 4, as peaked as
a trained model's (a random model's are nearly flat, which no real sampler sees); ``settings``
reports how often the first top-p nucleus fit each prefilter stage (``nucleus_fit_fraction``:
``{"k=32": share, ...}``).

Results:

1. tokens/s, prefill + ``new`` tokens for ``batch`` prompts of ``prompt_len`` tokens, top-p
   sampling (temperature 0.6, top-p 0.9, no stop token), vs ``transformers``
   ``generate(do_sample=True, top_k=0)`` on the same checkpoint and prompts;
2. ms per generated token position (the same runs, time / new tokens);
3. the 0.6B-shaped config's decode-step time at batch 1 and 8 (prefill excluded) vs its
   weight-streaming floor: parameter bytes / memory bandwidth of a large NumPy copy (bytes
   read + written per second, best of 5), the time just to read every weight once;
4. a 10-turn rollout (observation chunk, then decode, per turn) with cache continuation vs
   the same sampler re-encoding the whole history every turn.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from agentrl_jax.bench.forward import CONFIGS as MODEL_SHAPES
from agentrl_jax.bench.report import BenchResult
from agentrl_jax.models import load_qwen3, positions_from_mask
from agentrl_jax.sampling import Sampler, SamplingConfig, nucleus_fits_prefilter, pad_rows

TOP_P = SamplingConfig(temperature=0.6, top_p=0.9)
LOGIT_STD = 4.0
ROLLOUT_BATCH = 8
ROLLOUT_PROMPT_MAX = 64
HF_BASELINE = "transformers generate (top-p, same checkpoint)"
FLOOR_BASELINE = "weight-streaming floor (param bytes / copy bandwidth)"


@dataclasses.dataclass(frozen=True)
class BenchModel:
    name: str
    dims: dict  # transformers.Qwen3Config fields
    valid_vocab_size: int | None = None  # the tokenizer's vocabulary, if smaller


# The model shapes of ``bench forward``; Qwen3-0.6B's tokenizer has 151,669 ids.
CONFIGS = {
    "tiny": BenchModel("tiny", MODEL_SHAPES["tiny"]),
    "qwen3-0.6b-2layers": BenchModel(
        "qwen3-0.6b-2layers", MODEL_SHAPES["qwen3-0.6b-2layers"], valid_vocab_size=151_669
    ),
}


# ---------------------------------------------------------------------------- setup
def make_checkpoint(spec: BenchModel, path: Path, seed: int = 0):
    """Write a random float32 HF checkpoint to ``path``; return the transformers model."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3Config(**spec.dims)
    hf = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # logit std ~4 (|h| * initializer_range): peaked, like a trained model
        hidden_norm = config.hidden_size**0.5
        hf.model.norm.weight.fill_(LOGIT_STD / (hidden_norm * config.initializer_range))
    hf.save_pretrained(path)
    return hf


def copy_bandwidth(num_bytes: int = 1 << 29, repeats: int = 5) -> float:
    """Bytes moved per second (read + written) by a large NumPy copy, best of ``repeats``."""
    source = np.ones(num_bytes // 8)
    target = np.zeros_like(source)  # touched: page faults are not part of the copy
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - start)
    return 2 * source.nbytes / best


def parameter_bytes(params) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))


def _median_of(run: Callable[[], float], repeats: int, warmup: int = 1) -> float:
    """Median of the seconds ``run()`` reports (it times its own critical section)."""
    for _ in range(warmup):
        run()
    return float(np.median([run() for _ in range(repeats)]))


# ---------------------------------------------------------------------------- measurements
def time_ours(
    sampler: Sampler, params, prompt, new: int, sampling: SamplingConfig, key: jax.Array
) -> Callable[[], float]:
    """Seconds for init + prefill + decode of ``new`` tokens (what ``generate`` does)."""
    tokens, mask = prompt
    batch = tokens.shape[0]

    def run() -> float:
        start = time.perf_counter()
        state = sampler.append(params, sampler.init(batch, tokens.shape[1] + new), tokens, mask)
        state, out = sampler.decode(params, state, key, sampling, budget=np.full(batch, new))
        jax.block_until_ready(out)
        elapsed = time.perf_counter() - start
        if int(np.asarray(out.lengths).min()) != new:
            raise RuntimeError(f"ours produced {out.lengths} tokens, expected {new} per row")
        return elapsed

    return run


def time_decode_only(
    sampler: Sampler, params, prompt, new: int, sampling: SamplingConfig, key: jax.Array
) -> Callable[[], float]:
    """Seconds per decode step, prefill excluded."""
    tokens, mask = prompt

    def run() -> float:
        state = sampler.append(
            params, sampler.init(tokens.shape[0], tokens.shape[1] + new), tokens, mask
        )
        jax.block_until_ready(state)
        start = time.perf_counter()
        _, out = sampler.decode(params, state, key, sampling)
        jax.block_until_ready(out)
        return (time.perf_counter() - start) / new

    return run


def time_transformers(hf, prompt, new: int, sampling: SamplingConfig) -> Callable[[], float]:
    import torch

    tokens = torch.tensor(prompt[0], dtype=torch.long)
    mask = torch.tensor(prompt[1], dtype=torch.long)

    def run() -> float:
        start = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(
                tokens,
                attention_mask=mask,
                do_sample=True,
                max_new_tokens=new,
                min_new_tokens=new,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=0,
                eos_token_id=None,
                pad_token_id=0,
            )
        elapsed = time.perf_counter() - start
        if out.shape[1] != tokens.shape[1] + new:
            raise RuntimeError(f"transformers produced {out.shape[1] - tokens.shape[1]} tokens")
        return elapsed

    return run


def time_rollout(
    sampler: Sampler,
    params,
    prompts,
    observations,
    new: int,
    sampling: SamplingConfig,
    key: jax.Array,
    *,
    continuation: bool,
    max_len: int,
) -> Callable[[], float]:
    """Seconds for a ``len(observations) + 1``-turn rollout (``observations[turn][row]``
    token lists). Without ``continuation`` every
    turn starts from an empty cache and prefills the whole history, padded to the next power
    of two (so it compiles a few times, all in the warm-up run)."""
    batch = len(prompts)
    buckets = [max_len] + [2**i for i in range(4, max_len.bit_length()) if 2**i < max_len]
    keys = jax.random.split(key, len(observations) + 1)

    def run() -> float:
        start = time.perf_counter()
        history = [list(p) for p in prompts]
        state = sampler.append(
            params, sampler.init(batch, max_len), *pad_rows(prompts, ROLLOUT_PROMPT_MAX)
        )
        for turn in range(len(observations) + 1):
            if turn:
                obs = observations[turn - 1]
                history = [h + o for h, o in zip(history, obs)]
                if continuation:
                    state = sampler.append(params, state, *pad_rows(obs, new))
                else:
                    state = sampler.append(
                        params, sampler.init(batch, max_len), *pad_rows(history, buckets)
                    )
            state, out = sampler.decode(params, state, keys[turn], sampling)
            tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
            history = [h + tokens[b, : lengths[b]].tolist() for b, h in enumerate(history)]
        jax.block_until_ready(state)
        return time.perf_counter() - start

    return run


# ---------------------------------------------------------------------------- the benchmark
def run(
    configs: Sequence[str] = ("tiny", "qwen3-0.6b-2layers"),
    shapes: Sequence[tuple[int, int]] = ((8, 64), (256, 16)),
    prompt_len: int = 32,
    floor_configs: Sequence[str] = ("qwen3-0.6b-2layers",),
    floor_batches: Sequence[int] = (1, 8),
    floor_steps: int = 16,
    turns: int = 10,
    turn_tokens: int = 16,
    repeats: int = 3,
    torch_threads: int = 0,
    bandwidth_bytes: int = 1 << 29,
    seed: int = 0,
) -> list[BenchResult]:
    """Every measurement described in the module docstring, for each of ``configs``.

    ``torch_threads`` > 0 sets transformers' intra-op threads (on a busy machine, 2 threads
    on 2 cores can be 10x slower than 1); 0 keeps torch's default.
    """
    import torch

    unknown = [c for c in (*configs, *floor_configs) if c not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown config(s) {unknown}; choose from {list(CONFIGS)}")
    if min(repeats, prompt_len, turns, turn_tokens, floor_steps) < 1 or torch_threads < 0:
        raise ValueError(
            "repeats, prompt_len, turns, turn_tokens and floor_steps must be >= 1 "
            f"and torch_threads >= 0; got {repeats}, {prompt_len}, {turns}, "
            f"{turn_tokens}, {floor_steps}, {torch_threads}"
        )
    if torch_threads:
        torch.set_num_threads(torch_threads)
    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    common = {
        "backend": jax.default_backend(),
        "dtype": "float32",
        "prompt_len": prompt_len,
        "temperature": TOP_P.temperature,
        "top_p": TOP_P.top_p,
        "repeats": repeats,
        "statistic": "median",
        "torch_threads": torch.get_num_threads(),
    }
    results: list[BenchResult] = []
    for name in configs:
        spec = CONFIGS[name]
        sampling = dataclasses.replace(TOP_P, valid_vocab_size=spec.valid_vocab_size)
        with tempfile.TemporaryDirectory() as tmp:
            hf = make_checkpoint(spec, Path(tmp), seed)
            model = load_qwen3(tmp)
        params = nnx.state(model)
        vocab = spec.valid_vocab_size or spec.dims["vocab_size"]
        settings = {
            **common,
            "config": name,
            "layers": spec.dims["num_hidden_layers"],
            "hidden_size": spec.dims["hidden_size"],
            "vocab_size": spec.dims["vocab_size"],
            "param_bytes": parameter_bytes(params),
        }

        def prompts(batch: int):
            return pad_rows(
                [rng.integers(0, vocab, prompt_len).tolist() for _ in range(batch)], prompt_len
            )

        for batch, new in shapes:
            prompt = prompts(batch)
            sampler = Sampler(model, max_new_tokens=new, stop_token_ids=())
            ours = _median_of(time_ours(sampler, params, prompt, new, sampling, key), repeats)
            theirs = _median_of(time_transformers(hf, prompt, new, sampling), repeats)
            fits = _nucleus_fit_fraction(model, params, prompt, sampling)
            shape = {**settings, "batch": batch, "new_tokens": new, "nucleus_fit_fraction": fits}
            label = f"sample {name}, batch {batch} x {new} new tokens, top-p"
            results.append(
                BenchResult(
                    label, "tokens/s", batch * new / ours, batch * new / theirs, HF_BASELINE, shape
                )
            )
            results.append(
                BenchResult(
                    label + ", time per token position",
                    "ms",
                    ours / new * 1e3,
                    theirs / new * 1e3,
                    HF_BASELINE,
                    shape,
                )
            )
        if name in floor_configs:
            bandwidth = copy_bandwidth(bandwidth_bytes)
            floor = settings["param_bytes"] / bandwidth
            for batch in floor_batches:
                sampler = Sampler(model, max_new_tokens=floor_steps, stop_token_ids=())
                step = _median_of(
                    time_decode_only(sampler, params, prompts(batch), floor_steps, sampling, key),
                    repeats,
                )
                results.append(
                    BenchResult(
                        f"decode step {name}, batch {batch}, top-p (prefill excluded)",
                        "ms",
                        step * 1e3,
                        floor * 1e3,
                        FLOOR_BASELINE,
                        {
                            **settings,
                            "batch": batch,
                            "steps": floor_steps,
                            "copy_bandwidth_GBps": bandwidth / 1e9,
                        },
                    )
                )
        results.append(
            _rollout_result(
                model,
                params,
                name,
                settings,
                sampling,
                vocab,
                rng,
                key,
                turns,
                turn_tokens,
                repeats,
            )
        )
    return results


def _nucleus_fit_fraction(model, params, prompt, sampling: SamplingConfig) -> dict[str, float]:
    """Per prefilter stage ``k``: the share of the prompts whose first top-p nucleus fits in
    ``k`` candidates (the batch takes the first stage all its rows fit)."""
    tokens, mask = (jnp.asarray(x) for x in prompt)
    merged = nnx.merge(nnx.graphdef(model), params)
    hidden, _ = merged.hidden_states(tokens, positions_from_mask(mask), mask)
    logits = merged.logits(hidden[:, -1])
    return {
        f"k={k}": float(np.mean(np.asarray(nucleus_fits_prefilter(logits, sampling, k=k))))
        for k in sampling.prefilter_stages(logits.shape[-1])
    }


def _rollout_result(
    model, params, name, settings, sampling, vocab, rng, key, turns, turn_tokens, repeats
) -> BenchResult:
    batch = ROLLOUT_BATCH
    prompts = [
        rng.integers(0, vocab, int(n)).tolist()
        for n in rng.integers(16, ROLLOUT_PROMPT_MAX + 1, batch)
    ]
    observations = [
        [
            rng.integers(0, vocab, int(n)).tolist()  # [turn - 1][row]
            for n in rng.integers(1, turn_tokens + 1, batch)
        ]
        for _ in range(turns - 1)
    ]
    max_len = ROLLOUT_PROMPT_MAX + (2 * turns - 1) * turn_tokens
    sampler = Sampler(model, max_new_tokens=turn_tokens, stop_token_ids=())
    timings = {}
    for continuation in (True, False):
        timings[continuation] = _median_of(
            time_rollout(
                sampler,
                params,
                prompts,
                observations,
                turn_tokens,
                sampling,
                key,
                continuation=continuation,
                max_len=max_len,
            ),
            repeats,
        )
    return BenchResult(
        f"{turns}-turn rollout {name}, batch {batch}, {turn_tokens} new tokens/turn, "
        "cache continuation",
        "s",
        timings[True],
        timings[False],
        "same sampler re-encoding the history each turn",
        {
            **settings,
            "batch": batch,
            "turns": turns,
            "max_len": max_len,
            "observation_tokens": f"1..{turn_tokens}",
            "prompt_tokens": f"16..{ROLLOUT_PROMPT_MAX}",
        },
    )
