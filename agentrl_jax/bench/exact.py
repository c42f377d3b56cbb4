"""``agentrl-jax bench exact``: what ``rl.exact_logprobs`` costs, against the fast path in the
same process, on the same model and inputs.

1. decode: ``batch`` rows of ``prompt_len`` random tokens, ``new`` tokens sampled per row
   (temperature 0.7, top-p 0.9), the cache holding ``prompt_len + new`` tokens (the canonical
   length); sampled tokens per second, prefill excluded, with exact log-probs (each step a
   canonical forward over every row's history, :mod:`agentrl_jax.sampling.exact`) vs without;
2. the train step (GRPO, 2 epochs x 2 mini-batches) on ``batch`` such rows, ``new`` loss
   tokens each: seconds per step with ``rl.exact_logprobs`` (a canonical forward per
   trajectory and the head at each sampled token, once per batch) vs without.

Both on this backend in float32; the ratio is exact / fast (below 1: exactness' cost).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from agentrl_jax.bench.forward import CONFIGS as MODEL_SHAPES
from agentrl_jax.bench.forward import is_moe
from agentrl_jax.bench.report import BenchResult
from agentrl_jax.models import Qwen3Config, Qwen3ForCausalLM
from agentrl_jax.sampling import Sampler, SamplingConfig
from agentrl_jax.train import RLConfig, TrainBatch, TrainConfig, init_train_state, make_train_step
from agentrl_jax.trajectory import Trajectory

SAMPLING = SamplingConfig(temperature=0.7, top_p=0.9)


def run(
    *,
    sizes: Sequence[str] = ("tiny",),
    batch: int = 8,
    prompt_len: int = 64,
    new: int = 32,
    repeats: int = 3,
    seed: int = 0,
) -> list[BenchResult]:
    known = [s for s, dims in MODEL_SHAPES.items() if not is_moe(dims)]
    unknown = [s for s in sizes if s not in known]
    if unknown:
        raise ValueError(f"unknown size {unknown[0]!r}; known: {', '.join(known)}")
    results = []
    for size in sizes:
        model = Qwen3ForCausalLM(Qwen3Config(**MODEL_SHAPES[size]), rngs=nnx.Rngs(seed))
        settings = {"size": size, "batch": batch, "prompt_len": prompt_len, "new": new}
        decode = _decode_seconds(model, batch, prompt_len, new, repeats, seed)
        results.append(
            BenchResult(
                name=f"decode with exact log-probs, {size}, batch {batch}",
                unit="tokens/s",
                ours=batch * new / decode[True],
                baseline=batch * new / decode[False],
                baseline_name="the same sampler without (the fast path)",
                settings=settings,
            )
        )
        step = _step_seconds(model, batch, prompt_len, new, repeats, seed)
        results.append(
            BenchResult(
                name=f"train step with rl.exact_logprobs, {size}, batch {batch}",
                unit="s",
                ours=step[True],
                baseline=step[False],
                baseline_name="the same step without (the fast path)",
                settings={**settings, "updates": 4},
            )
        )
    return results


def _decode_seconds(model, batch, prompt_len, new, repeats, seed) -> dict[bool, float]:
    """Seconds of one decode of ``new`` tokens per row (prefill excluded), exact and fast."""
    params = nnx.state(model)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, model.config.vocab_size, (batch, prompt_len)).astype(np.int32)
    history = np.zeros((batch, prompt_len + new), np.int32)
    history[:, :prompt_len] = tokens
    sampler = Sampler(model, max_new_tokens=new, stop_token_ids=())
    keys = jax.random.split(jax.random.key(seed), batch)

    def once(exact):
        state = sampler.append(
            params, sampler.init(batch, prompt_len + new), tokens, np.ones_like(tokens, bool)
        )
        jax.block_until_ready(state)
        start = time.perf_counter()
        _, out = sampler.decode(params, state, keys, SAMPLING, history=history if exact else None)
        jax.block_until_ready(out)
        return time.perf_counter() - start

    return _interleaved(once, repeats)


def _interleaved(once, repeats: int) -> dict[bool, float]:
    """Median seconds of ``once(exact)`` for both settings, each compiled first, then timed in
    turn (fast, exact, fast, ...), so a busy machine slows both alike."""
    once(False), once(True)
    times = {False: [], True: []}
    for _ in range(repeats):
        for exact in (False, True):
            times[exact].append(once(exact))
    return {exact: float(np.median(t)) for exact, t in times.items()}


def _step_seconds(model, batch, prompt_len, new, repeats, seed) -> dict[bool, float]:
    """Seconds of one train step (4 updates) on ``batch`` rows, exact and fast."""
    rng = np.random.default_rng(seed + 1)
    length = prompt_len + new
    sampled = np.zeros((batch, length), bool)
    sampled[:, prompt_len:] = True
    traj = Trajectory.zeros(batch, length, 1).replace(
        tokens=jnp.asarray(rng.integers(1, model.config.vocab_size, (batch, length)), jnp.int32),
        token_mask=jnp.ones((batch, length), bool),
        loss_mask=jnp.asarray(sampled),
        token_turn=jnp.asarray(np.where(sampled, 0, -1), jnp.int32),
        logprobs=jnp.asarray(np.where(sampled, -2.0, 0.0), jnp.float32),
        sampling_logprobs=jnp.asarray(np.where(sampled, -2.0, 0.0), jnp.float32),
        turn_mask=jnp.ones((batch, 1), bool),
        group_id=jnp.arange(batch, dtype=jnp.int32) // 2,
        success=jnp.asarray(np.arange(batch) % 2 == 0),
        row_mask=jnp.ones(batch, bool),
    )
    rl = RLConfig(
        tasks_per_step=batch // 2,
        group_size=2,
        batching={"epochs": 2, "mini_batches": 2},
    )
    steps, states = {}, {}
    for exact in (False, True):
        config = TrainConfig(
            rl=dataclasses.replace(rl, exact_logprobs=exact), context_length=length
        )
        steps[exact] = make_train_step(nnx.graphdef(model), config)
        states[exact] = init_train_state(model, config)

    def once(exact):
        start = time.perf_counter()
        jax.block_until_ready(steps[exact](states[exact], TrainBatch(traj))[1])
        return time.perf_counter() - start

    return _interleaved(once, repeats)
