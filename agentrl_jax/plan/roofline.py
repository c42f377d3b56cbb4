"""How fast a program can run on a GPU: a roofline from its FLOPs and the bytes it moves.

A program that does ``F`` floating-point operations and moves ``Q`` bytes through device
memory takes at least ``max(F / peak, Q / bandwidth)`` seconds on a GPU of dense bfloat16
``peak`` FLOP/s and HBM ``bandwidth`` bytes/s (:class:`~agentrl_jax.plan.targets.GpuSpec`).
Every figure here is that bound: an *upper* bound on speed, which a real run reaches a share
of (``agentrl-jax bench device`` prints measured against predicted: that share).

FLOPs are counted analytically, as ``bench device`` counts them: a matmul of ``n`` weights
costs ``2 n`` FLOPs a token; attention ``4 H hd`` a token per visible key per layer (scores and
values). Bytes are the unavoidable traffic: weights read once per pass, the KV cache read once
per decode step, the train state read and written once per update, activations a layer keeps
for the backward pass written and read once. Caches (L2) and overlap are ignored, so memory-
bound figures are bounds too.

Mixture-of-experts models (Qwen3 MoE): a token's FLOPs are those of the router and its ``k``
experts (:func:`matmul_parameters`); the bytes a pass reads are every dense weight and, of each
MoE layer, the experts its tokens reach: all of them for a train step or a long prefill, the
expected ``E (1 - (1 - k/E)^n)`` for ``n`` tokens routed uniformly at random in a decode step
(:func:`stored_matmul_parameters`). A dense model's figures are as before.

Shapes: ``config`` is a :class:`~agentrl_jax.models.config.Qwen3Config`; counts are plain
Python numbers; every function is pure.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from agentrl_jax.plan.targets import GpuSpec


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One roofline figure: ``value`` ``unit`` (e.g. tokens/s) at ``seconds`` a call, bound by
    ``bound`` ("compute" or "memory"); ``mfu``: model FLOPs over the peak at that speed (train
    steps; None elsewhere). ``assumes``: what the figure takes as given, in words."""

    name: str
    value: float
    unit: str
    seconds: float
    flops: float
    bytes: float
    bound: str
    mfu: float | None = None
    assumes: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------- counts
def layer_matmul_parameters(config: Any, moe: bool = False) -> int:
    """Weights of one layer's matmuls a token multiplies by: q, k, v, o and the three MLP
    projections; of an MoE layer (``moe``) the router and the three projections of each of
    the ``k`` experts the token is routed to."""
    d, f = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    if moe:
        return d * (q + 2 * kv) + q * d + d * config.num_experts + _active_expert_weights(config)
    return d * (q + 2 * kv) + q * d + 3 * d * f


def _moe_layer_count(config: Any) -> int:
    return sum(getattr(config, "moe_layers", ())) if getattr(config, "num_experts", 0) else 0


def _expert_weights(config: Any) -> int:
    """One expert's weights (gate, up, down)."""
    return 3 * config.hidden_size * config.moe_intermediate_size


def _active_expert_weights(config: Any) -> int:
    return config.num_experts_per_tok * _expert_weights(config)


def matmul_parameters(config: Any) -> int:
    """Weights every token multiplies by (its FLOPs are twice this): all layers' matmuls (of an
    MoE layer the router and the token's ``k`` experts) and the output head (the embedding
    lookup reads one row a token, so its table is not counted)."""
    moe = _moe_layer_count(config)
    layers = (config.num_hidden_layers - moe) * layer_matmul_parameters(config)
    layers += moe * layer_matmul_parameters(config, moe=True)
    return layers + config.hidden_size * config.vocab_size


def stored_matmul_parameters(config: Any, tokens: float | None = None) -> float:
    """Weights a pass over ``tokens`` tokens reads: :func:`matmul_parameters` for a dense
    model; for an MoE model every dense weight and, of each MoE layer, the experts the tokens
    reach, ``E (1 - (1 - k/E)^tokens)`` expected under uniform routing (all ``E`` for
    ``tokens`` None: a train step)."""
    moe = _moe_layer_count(config)
    if not moe:
        return matmul_parameters(config)
    experts = config.num_experts
    reached = (
        experts
        if tokens is None
        else experts * (1 - (1 - config.num_experts_per_tok / experts) ** tokens)
    )
    dense = matmul_parameters(config) - moe * _active_expert_weights(config)
    return dense + moe * reached * _expert_weights(config)


def attention_flops(config: Any, keys: float) -> float:
    """FLOPs of attention over ``keys`` (query, key) pairs summed over the tokens, all layers:
    ``q . k`` and ``p v`` at 2 FLOPs a multiply-add each, for every query head."""
    return 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * keys


def causal_pairs(length: int) -> float:
    """(query, key) pairs of one causal sequence of ``length`` tokens: ``L (L + 1) / 2``."""
    return length * (length + 1) / 2


def forward_flops(config: Any, tokens: float, pairs: float) -> float:
    """FLOPs of one forward pass over ``tokens`` tokens attending ``pairs`` (query, key)
    pairs in all."""
    return 2 * matmul_parameters(config) * tokens + attention_flops(config, pairs)


def model_flops_per_token(config: Any, length: int) -> float:
    """Forward FLOPs per token of a causal sequence of ``length`` tokens (what MFU counts)."""
    return forward_flops(config, length, causal_pairs(length)) / length


def kv_bytes_per_token(config: Any, itemsize: int = 2) -> int:
    """KV-cache bytes one token holds: keys and values of every layer's KV heads."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * itemsize


def _roofline(
    name: str, work: float, unit: str, flops: float, moved: float, spec: GpuSpec, **extra
) -> Prediction:
    compute, memory = flops / spec.peak_bf16_flops, moved / spec.bandwidth
    seconds = max(compute, memory)
    bound = "compute" if compute >= memory else "memory"
    return Prediction(name, work / seconds, unit, seconds, flops, moved, bound, **extra)


# ------------------------------------------------------------------------- programs
def decode_step(
    config: Any, spec: GpuSpec, rows: int, context: float, *, weight_bytes: int = 2,
    cache_bytes: int = 2,
) -> Prediction:  # fmt: skip
    """Tokens/s of decode steps of ``rows`` rows, each attending ``context`` cached tokens: a
    step reads every weight (``weight_bytes`` each; of an MoE layer the experts the rows
    reach) and each row's cache."""
    flops = rows * forward_flops(config, 1, context)
    moved = stored_matmul_parameters(
        config, rows
    ) * weight_bytes + rows * context * kv_bytes_per_token(config, cache_bytes)
    return _roofline(
        f"decode {rows} rows at {context:g} cached tokens", rows, "tokens/s", flops, moved, spec,
        assumes="weights and each row's cache read once a step",
    )  # fmt: skip


def prefill(
    config: Any, spec: GpuSpec, rows: int, tokens: int, context: float, *,
    weight_bytes: int = 2, cache_bytes: int = 2,
) -> Prediction:  # fmt: skip
    """Tokens/s of appending ``tokens`` tokens to each of ``rows`` rows that hold ``context``
    cached tokens (prompts, observations): weights read once, the cache read and the new
    tokens' keys and values written."""
    pairs = rows * (tokens * context + causal_pairs(tokens))
    flops = forward_flops(config, rows * tokens, pairs)
    moved = stored_matmul_parameters(config, rows * tokens) * weight_bytes + rows * (
        context + tokens
    ) * (kv_bytes_per_token(config, cache_bytes))
    return _roofline(
        f"append {rows} x {tokens} tokens at {context:g} cached", rows * tokens, "tokens/s",
        flops, moved, spec, assumes="weights read once; the cache read, the new keys written",
    )  # fmt: skip


def forward(
    config: Any, spec: GpuSpec, rows: int, length: int, *, weight_bytes: int = 4
) -> Prediction:
    """Tokens/s of one teacher-forced forward over ``rows`` causal rows of ``length`` tokens
    (scoring: the likelihood analysis): the weights read once (float32 by default), the
    logits written and read once (float32)."""
    tokens = rows * length
    flops = forward_flops(config, tokens, rows * causal_pairs(length))
    moved = stored_matmul_parameters(config) * weight_bytes + 2 * 4 * tokens * config.vocab_size
    return _roofline(
        f"forward {rows} x {length} tokens", tokens, "tokens/s", flops, moved, spec,
        assumes="every row full; weights read once, float32 logits written and read once",
    )  # fmt: skip


def train_step(
    config: Any,
    spec: GpuSpec,
    rows: int,
    length: int,
    *,
    micro_batches: int = 1,
    reference: bool = True,
    critic: bool = False,
    remat: bool = True,
    full_weights: bool = True,
) -> Prediction:
    """Tokens/s and MFU of one update on ``rows`` rows of ``length`` tokens.

    Model FLOPs (what MFU counts): the policy's forward and backward (3 forwards; a LoRA run,
    ``full_weights=False``, computes no weight gradients: 2), the KL reference's forward
    (``reference``), a PPO critic's forward and backward (``critic``: 3). The hardware also
    recomputes each layer's forward under ``remat`` (one more forward of each trained model).
    Bytes: per micro-batch each pass reads the float32 weights, the trained weights' gradients
    are accumulated (float32, read and written); each layer's saved input (bfloat16) is
    written and read; once per update AdamW reads weights, gradients and two moments and
    writes weights and moments (28 bytes a weight)."""
    tokens = rows * length
    forward = forward_flops(config, tokens, rows * causal_pairs(length))
    trained = 1 + critic
    model = forward * ((3 if full_weights else 2) + reference + 3 * critic)
    hardware = model + forward * trained * remat
    weights = stored_matmul_parameters(config)  # every expert: a micro-batch reaches them all
    passes = (3 + remat) * trained + reference  # weight reads per micro-batch
    grads = 8 * weights * trained if full_weights else 0
    saved = 2 * 2 * config.num_hidden_layers * tokens * config.hidden_size * trained
    moved = micro_batches * (passes * 4 * weights + grads) + saved
    moved += 28 * weights * trained if full_weights else 0
    prediction = _roofline(
        f"train step {rows} x {length} tokens", tokens, "tokens/s", hardware, moved, spec,
        assumes="every row full; MFU counts model FLOPs (no recompute)",
    )  # fmt: skip
    return dataclasses.replace(prediction, mfu=model / prediction.seconds / spec.peak_bf16_flops)


def rollout_turns(
    config: Any,
    spec: GpuSpec,
    rows: int,
    *,
    turns: int,
    response_tokens: int,
    observation_tokens: int,
    prompt_tokens: int,
    max_context: int,
) -> Prediction:
    """Turns/s of a multi-turn rollout of ``rows`` rows in flight: the prompt appended, then
    per turn ``response_tokens`` decode steps and the next ``observation_tokens`` appended,
    each at the context the row holds by then (at most ``max_context``)."""
    parts = [(prefill(config, spec, rows, prompt_tokens, 0), 1)]
    context = prompt_tokens
    for _ in range(turns):
        step = decode_step(config, spec, rows, min(max_context, context + response_tokens / 2))
        context = min(max_context, context + response_tokens)
        observe = prefill(config, spec, rows, observation_tokens, context)
        context = min(max_context, context + observation_tokens)
        parts += [(step, response_tokens), (observe, 1)]
    seconds = sum(p.seconds * n for p, n in parts)
    flops = sum(p.flops * n for p, n in parts)
    moved = sum(p.bytes * n for p, n in parts)
    memory = sum(p.seconds * n for p, n in parts if p.bound == "memory")
    return Prediction(
        f"rollout {rows} rows x {turns} turns", rows * turns / seconds, "turns/s", seconds,
        flops, moved, "memory" if memory >= seconds / 2 else "compute",
        assumes=f"{prompt_tokens}-token prompt, {response_tokens} tokens a response, "
        f"{observation_tokens} an observation, every row playing every turn",
    )  # fmt: skip


def bytes_moved(name: str, spec: GpuSpec, moved: float, unit_work: float, unit: str) -> Prediction:
    """A program that only moves ``moved`` bytes (weight sync, LoRA merge)."""
    return _roofline(name, unit_work, unit, 0.0, moved, spec, assumes="bytes read and written once")


__all__ = [
    "Prediction",
    "attention_flops",
    "bytes_moved",
    "causal_pairs",
    "decode_step",
    "forward",
    "forward_flops",
    "kv_bytes_per_token",
    "layer_matmul_parameters",
    "matmul_parameters",
    "model_flops_per_token",
    "prefill",
    "rollout_turns",
    "stored_matmul_parameters",
    "train_step",
]
