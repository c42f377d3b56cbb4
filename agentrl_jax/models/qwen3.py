"""Qwen3 dense decoder in Flax NNX, with an optional static-shape KV cache.

Math (matches ``transformers``' ``Qwen3ForCausalLM``): token embedding; per layer
``x += o_proj(attention(rope(q_norm(q)), rope(k_norm(k)), v))`` on the RMS-normed input, then
``x += down(silu(gate(h)) * up(h))`` on the RMS-normed result; final RMSNorm; output head
(the embedding matrix itself when ``tie_word_embeddings``). Attention is grouped-query
(query head ``h`` reads key/value head ``h // num_query_groups``), RoPE is the
non-interleaved rotate-half form over the full ``head_dim``, and RMSNorm normalises in float32,
casts back to the input dtype, then multiplies by its weight.

Public API
----------
``model = Qwen3ForCausalLM(config, dtype=jnp.float32, param_dtype=jnp.float32, remat=False,
rngs=nnx.Rngs(0))`` builds a randomly initialised model (``load_qwen3`` in
:mod:`agentrl_jax.models.checkpoints` loads one). ``dtype`` is the compute dtype, ``param_dtype``
the storage dtype; logits are always float32.

``logits, cache = model(tokens, positions, attention_mask, cache=None)``

* ``tokens``         ``[B, L]`` int   token ids (ids of padding are ignored but must be ints).
* ``positions``      ``[B, L]`` int   RoPE positions (``positions_from_mask`` gives the usual ones).
* ``attention_mask`` ``[B, L]`` bool  True for real tokens; padding may sit anywhere (left, right,
  in the middle). Causality is by index: real token ``i`` attends to real tokens ``j <= i``.
* ``cache``          ``KVCache`` or None.
* ``logits``         ``[B, L, vocab_size]`` float32; rows of padding tokens are finite but
  meaningless. ``cache`` is the updated cache (None when none was given).

``model.hidden_states(...)`` returns ``(hidden [B, L, hidden_size], cache)`` and
``model.logits(hidden)`` the float32 logits, so a caller can take logits of a few positions only.

KV cache
--------
``KVCache.empty(config, batch_size, max_len, dtype)`` holds

* ``k``, ``v``  ``[num_hidden_layers, B, max_len, num_key_value_heads, head_dim]`` (post-RoPE keys),
* ``lengths``   ``[B]`` int32, the number of filled slots per row (rows advance independently).

A forward with a cache appends each row's *real* tokens compactly at slots
``lengths[b], lengths[b]+1, ...`` (padding is never written), attends every real token to the
row's filled slots up to and including its own, and returns ``lengths + attention_mask.sum(1)``.
So a prefill of ragged prompts, a one-token decode step, and an observation chunk appended in a
later turn are all the same call, and their logits equal those of one forward over each row's
whole real sequence. With ``positions = positions_from_mask(attention_mask, cache.lengths)``
the RoPE position of a token is its slot index. The caller keeps ``lengths + new real tokens <=
max_len``: writes past the end are dropped (never wrapped onto earlier slots) while ``lengths``
still counts them. Resetting a row is ``lengths.at[b].set(0)``; stale slots past ``lengths``
are never read. A :class:`~agentrl_jax.models.paged_cache.PagedKVCache` (pages from a shared
pool, attention over the used pages only) is accepted in its place with the same meaning; the
caller allocates its pages before the call (:func:`~agentrl_jax.models.paged_cache.allocate`).

Jitting: ``graphdef, state = nnx.split(model)`` once, then ``jax.jit(lambda state, *a:
nnx.merge(graphdef, state)(*a))``. Layers are stacked along a leading axis and run by one
``lax.scan``, so compile time does not grow with depth. ``remat`` (the constructor's, or
``hidden_states(..., remat=...)`` per call) names what each layer keeps for the backward pass
(:data:`REMAT_POLICIES`: ``"none"``, ``"full"``, ``"dots"``, ``"offload"``; ``True`` is
``"full"``), and ``constrain`` is applied to the residual stream at every layer boundary (the
train step passes a sharding constraint, rows over the batch axes). A frozen reference policy is a
kept copy of the parameters, ``jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))`` (a real copy,
in case a training step donates the live buffers), used through ``nnx.merge(graphdef, reference)``.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from agentrl_jax.models import moe, paged_cache, paged_kernels
from agentrl_jax.models.attention import _xla_attention as xla_attention
from agentrl_jax.models.attention import attention as attention_fn
from agentrl_jax.models.attention import segment_starts
from agentrl_jax.models.config import Qwen3Config
from agentrl_jax.models.paged_cache import PagedKVCache

# Stacked per-layer parameter names (Hugging Face leaf names), in checkpoint order: those of
# every layer (attention, norms), then a dense MLP's (stacked over the dense layers only) and
# the experts' (over the MoE layers only; :mod:`agentrl_jax.models.moe`'s layouts).
ATTENTION_PARAM_NAMES = (
    "input_layernorm",
    "q_proj",
    "k_proj",
    "v_proj",
    "q_norm",
    "k_norm",
    "o_proj",
    "post_attention_layernorm",
)
MLP_PARAM_NAMES = ("gate_proj", "up_proj", "down_proj")
MOE_PARAM_NAMES = ("router", "experts_gate", "experts_up", "experts_down")
LAYER_PARAM_NAMES = ATTENTION_PARAM_NAMES + MLP_PARAM_NAMES
"""A dense model's stacked parameters (an MoE model's: :func:`layer_param_names`)."""


def layer_param_names(config: Qwen3Config) -> tuple[str, ...]:
    """The stacked parameters of a model of ``config``, in checkpoint order: the dense MLP's
    where some layer has one, the experts' where some layer has them."""
    kinds = config.moe_layers
    return (
        ATTENTION_PARAM_NAMES
        + (MLP_PARAM_NAMES if not all(kinds) else ())
        + (MOE_PARAM_NAMES if any(kinds) else ())
    )


def layer_segments(config: Qwen3Config) -> list[tuple[int, int, bool, int]]:
    """The layers as runs of one kind: ``(first layer, end, is MoE, first index in that
    kind's stack)`` each. A dense model, or Qwen3-30B-A3B (every layer MoE), is one run."""
    runs: list[tuple[int, int, bool, int]] = []
    counts = {False: 0, True: 0}
    for layer, kind in enumerate(config.moe_layers):
        if runs and runs[-1][2] == kind:
            first, _, _, index = runs[-1]
            runs[-1] = (first, layer + 1, kind, index)
        else:
            runs.append((layer, layer + 1, kind, counts[kind]))
        counts[kind] += 1
    return runs


# ---------------------------------------------------------------------------- pure pieces
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis: normalise in float32, cast back, then scale.

    x: ``[..., D]``; weight: ``[D]``. Returns ``[..., D]`` in ``x.dtype``.
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


def rope_inverse_frequencies(config: Qwen3Config) -> tuple[np.ndarray, float]:
    """``(inv_freq [head_dim // 2] float32, attention_scale)`` for the config's RoPE variant.

    Mirrors ``transformers.modeling_rope_utils`` for "default", "linear" and "yarn" (computed in
    float64, then rounded once to float32).
    """
    dim, base = config.head_dim, config.rope_theta
    exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
    inv_freq = 1.0 / base**exponents
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq.astype(np.float32), 1.0
    if scaling.rope_type == "linear":
        return (inv_freq / scaling.factor).astype(np.float32), 1.0

    # yarn: keep high frequencies (many rotations over the original context), interpolate low
    # ones by `factor`, and blend linearly in between.
    def correction_dim(rotations: float) -> float:
        return (
            dim
            * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(base))
        )

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep_original = 1.0 - ramp
    blended = inv_freq / scaling.factor * ramp + inv_freq * keep_original
    return blended.astype(np.float32), _yarn_attention_scale(scaling)


def _yarn_attention_scale(scaling) -> float:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)
    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.factor, scaling.mscale) / mscale(
            scaling.factor, scaling.mscale_all_dim
        )
    return mscale(scaling.factor)


def rope_cos_sin(
    positions: jax.Array, inv_freq: np.ndarray, attention_scale: float, dtype: jnp.dtype
) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables ``[B, L, head_dim]`` (each half repeated), computed in float32."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return (
        (jnp.cos(angles) * attention_scale).astype(dtype),
        (jnp.sin(angles) * attention_scale).astype(dtype),
    )


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE. x: ``[B, L, N, head_dim]``; cos, sin: ``[B, L, head_dim]``."""
    first, second = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-second, first], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


def grouped_query_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax attention where each key/value head serves a group of query heads.

    q: ``[B, L, H, hd]``; k, v: ``[B, S, KV, hd]`` with ``H % KV == 0``; mask: ``[B, L, S]`` bool
    (True = may attend). Scores and softmax are float32. Returns ``[B, L, H, hd]`` in v's dtype.
    The full-score-matrix implementation of :mod:`agentrl_jax.models.attention`.
    """
    return xla_attention(q, k, v, mask)


def linear(x: jax.Array, weight: jax.Array, few_rows: bool = False) -> jax.Array:
    """``x @ weight.T`` with the Hugging Face ``[out_features, in_features]`` weight layout.

    ``few_rows``: the same product for a handful of rows (a decode step) computed as
    ``(weight @ x.T).T``, output features major, with float32 accumulation. For a few rows
    XLA:CPU runs the plain form ~8x slower (batch 8, a 3,072 x 1,024 weight: 5.5 ms against
    0.7 ms); the transpose sits behind an optimisation barrier, or XLA folds it back.
    """
    if not few_rows:
        return jnp.einsum("...i,oi->...o", x, weight)
    rows = x.reshape(-1, x.shape[-1])
    transposed = jnp.einsum("oi,ni->on", weight, rows, preferred_element_type=jnp.float32)
    out = jax.lax.optimization_barrier(transposed).T.astype(x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def project(p: dict[str, jax.Array], name: str, x: jax.Array, few_rows: bool = False) -> jax.Array:
    """One layer's projection ``name`` of ``x``: ``linear(x, p[name])``, plus the LoRA update
    ``B (A x)`` where ``p`` holds ``{name}_a [r, in]`` and ``{name}_b [out, r]`` (the scale
    folded into B; :mod:`agentrl_jax.models.lora`). With ``B = 0`` the sum is the base
    projection exactly, but XLA may fuse the addition into what reads it (a norm's reduction)
    and round that differently; a forward with ``adapters=False`` is the base model bitwise."""
    out = linear(x, p[name], few_rows)
    a = p.get(f"{name}_a")
    if a is None:
        return out
    return out + linear(linear(x, a, few_rows), p[f"{name}_b"], few_rows)


def swiglu_mlp(p: dict[str, jax.Array], x: jax.Array, few_rows: bool = False) -> jax.Array:
    """``down(silu(gate(x)) * up(x))``; x ``[..., D]``, ``p``'s gate/up ``[I, D]``, down
    ``[D, I]`` (each with its adapter, if any)."""
    hidden = jax.nn.silu(project(p, "gate_proj", x, few_rows)) * project(p, "up_proj", x, few_rows)
    return project(p, "down_proj", hidden, few_rows)


def attention_inputs(
    p: dict[str, jax.Array],
    x: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    config: Qwen3Config,
    few_rows: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer's ``q [B, L, H, hd]`` and ``k, v [B, L, KV, hd]`` (q, k normed and rotated)."""
    batch, length, _ = x.shape
    hd, eps = config.head_dim, config.rms_norm_eps
    h = rms_norm(x, p["input_layernorm"], eps)
    q = project(p, "q_proj", h, few_rows).reshape(batch, length, config.num_attention_heads, hd)
    k = project(p, "k_proj", h, few_rows).reshape(batch, length, config.num_key_value_heads, hd)
    v = project(p, "v_proj", h, few_rows).reshape(batch, length, config.num_key_value_heads, hd)
    q = apply_rope(rms_norm(q, p["q_norm"], eps), cos, sin)
    k = apply_rope(rms_norm(k, p["k_norm"], eps), cos, sin)
    return q, k, v


def layer_output(
    p: dict[str, jax.Array],
    x: jax.Array,
    attended: jax.Array,
    config: Qwen3Config,
    few_rows: bool = False,
    replay: jax.Array | None = None,
    moe_ffn: Callable | None = None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    """Residual stream after one layer, given its attention output ``attended [B, L, H, hd]``:
    its feed-forward a dense MLP, or the experts where ``p`` holds a router. Also the layer's
    routing, ``(experts [B, L, k] int32, router logits [B, L, E])``, None for a dense layer.
    ``replay [B, L, k]``: experts to use instead of the router's (:func:`moe.route`);
    ``moe_ffn``: the experts' computation (:func:`moe.experts_ffn` by default, or an
    :func:`moe.expert_parallel` one)."""
    x = x + project(p, "o_proj", attended.reshape(*x.shape[:2], -1), few_rows)
    h = rms_norm(x, p["post_attention_layernorm"], config.rms_norm_eps)
    if "router" not in p:
        return x + swiglu_mlp(p, h, few_rows), None
    rows = x.shape[:2]
    out, logits, chosen = moe.moe_block(
        h,
        p["router"],
        p["experts_gate"],
        p["experts_up"],
        p["experts_down"],
        k=config.num_experts_per_tok,
        normalize=config.norm_topk_prob,
        experts=None if replay is None else replay.reshape(-1, replay.shape[-1]),
        ffn=moe_ffn or moe.experts_ffn,
    )
    return x + out, (chosen.reshape(*rows, -1), logits.reshape(*rows, -1))


def positions_from_mask(attention_mask: jax.Array, offset: jax.Array | None = None) -> jax.Array:
    """RoPE positions counting only real tokens: ``offset[b] + #real tokens before i`` ``[B, L]``.

    With ``offset = cache.lengths`` this is each token's cache slot. Padding gets its
    neighbour's position (any value works: padding is never attended to).
    """
    positions = jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=1) - 1, 0)
    return positions if offset is None else positions + offset[:, None].astype(jnp.int32)


def packed_positions(attention_mask: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """RoPE positions of packed rows ``[B, L]``: :func:`positions_from_mask` restarted at each
    segment (a run of equal ``segment_ids``), so every sequence sees the positions it has alone."""
    counts = jnp.cumsum(attention_mask.astype(jnp.int32), axis=1)
    starts = segment_starts(segment_ids)
    rows = jnp.arange(counts.shape[0])[:, None]
    before = counts[rows, starts] - attention_mask.astype(jnp.int32)[rows, starts]
    return jnp.maximum(counts - before - 1, 0)


Constrain = Callable[[jax.Array], jax.Array]

# What a layer keeps for the backward pass. "none": everything autodiff saves (no
# rematerialisation); "full": only the layer's input, the rest is recomputed; "dots": the
# outputs of the weight matmuls, recomputing norms, RoPE, attention and activations;
# "offload": like "dots" but the saved matmul outputs go to host memory (platforms with a
# pinned_host memory space: TPU, GPU).
REMAT_POLICIES = ("none", "full", "dots", "offload")


def remat_layer(body: Callable, policy: bool | str) -> Callable:
    """``body`` under the named :data:`REMAT_POLICIES` policy (True = "full", False = "none")."""
    if isinstance(policy, bool):
        policy = "full" if policy else "none"
    if policy == "none":
        return body
    if policy == "full":
        return jax.checkpoint(body, prevent_cse=False)
    if policy == "dots":
        return jax.checkpoint(
            body, prevent_cse=False, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        )
    if policy == "offload":
        return jax.checkpoint(
            body,
            prevent_cse=False,
            policy=jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
        )
    raise ValueError(f"remat policy must be one of {REMAT_POLICIES} (or a bool), got {policy!r}")


# ---------------------------------------------------------------------------- KV cache
@struct.dataclass
class KVCache:
    """Static-shape per-layer keys/values plus each row's fill level (see module docstring)."""

    k: jax.Array  # [num_layers, B, max_len, kv_heads, head_dim]
    v: jax.Array  # [num_layers, B, max_len, kv_heads, head_dim]
    lengths: jax.Array  # [B] int32: slots [0, lengths[b]) of row b hold real tokens

    @classmethod
    def empty(
        cls, config: Qwen3Config, batch_size: int, max_len: int, dtype: jnp.dtype = jnp.bfloat16
    ) -> "KVCache":
        shape = (
            config.num_hidden_layers,
            batch_size,
            max_len,
            config.num_key_value_heads,
            config.head_dim,
        )
        return cls(
            k=jnp.zeros(shape, dtype),
            v=jnp.zeros(shape, dtype),
            lengths=jnp.zeros((batch_size,), jnp.int32),
        )

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


# ---------------------------------------------------------------------------- the module
class Qwen3DecoderLayers(nnx.Module):
    """All decoder layers' weights, stacked along a leading ``num_hidden_layers`` axis.

    Projections keep the Hugging Face ``[out_features, in_features]`` layout, so loading and
    export are copies, not transposes.
    """

    def __init__(self, config: Qwen3Config, *, param_dtype: jnp.dtype, rngs: nnx.Rngs):
        self.names = layer_param_names(config)
        for name, shape in layer_param_shapes(config).items():
            if name in ("input_layernorm", "q_norm", "k_norm", "post_attention_layernorm"):
                value = jnp.ones(shape, param_dtype)
            else:
                value = _normal_init(rngs.params(), shape, param_dtype)
            setattr(self, name, nnx.Param(value))

    def stacked(self, adapters: bool = True) -> dict[str, jax.Array]:
        """Every stacked weight by name, plus the LoRA adapters' (``{name}_a``, ``{name}_b``)
        when the layers have them (``lora``) and ``adapters``."""
        out = {name: getattr(self, name)[...] for name in self.names}
        lora = getattr(self, "lora", None)
        if adapters and lora is not None:
            out.update(lora.stacked())
        return out


def layer_param_shapes(config: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """Each stacked parameter's shape (:func:`layer_param_names`, in that order)."""
    n, d, i = config.num_hidden_layers, config.hidden_size, config.intermediate_size
    q_out = config.num_attention_heads * config.head_dim
    kv_out = config.num_key_value_heads * config.head_dim
    moe_layers = sum(config.moe_layers)
    dense, e, mi = n - moe_layers, config.num_experts, config.moe_intermediate_size
    shapes = {
        "input_layernorm": (n, d),
        "q_proj": (n, q_out, d),
        "k_proj": (n, kv_out, d),
        "v_proj": (n, kv_out, d),
        "q_norm": (n, config.head_dim),
        "k_norm": (n, config.head_dim),
        "o_proj": (n, d, q_out),
        "post_attention_layernorm": (n, d),
        "gate_proj": (dense, i, d),
        "up_proj": (dense, i, d),
        "down_proj": (dense, d, i),
        "router": (moe_layers, e, d),
        "experts_gate": (moe_layers, e, mi, d),
        "experts_up": (moe_layers, e, mi, d),
        "experts_down": (moe_layers, e, d, mi),
    }
    return {name: shapes[name] for name in layer_param_names(config)}


def segment_params(
    stacked: dict[str, jax.Array], segment: tuple[int, int, bool, int]
) -> dict[str, jax.Array]:
    """The stacked weights of one run of layers (:func:`layer_segments`): the attention's and
    norms' of its layers, and the feed-forward's of its kind (adapters follow their weight)."""
    first, end, is_moe, index = segment
    feed_forward = MOE_PARAM_NAMES if is_moe else MLP_PARAM_NAMES
    out = {}
    for name, w in stacked.items():
        base = name[:-2] if name.endswith(("_a", "_b")) else name
        if base in ATTENTION_PARAM_NAMES:
            out[name] = w if (first, end) == (0, w.shape[0]) else w[first:end]
        elif base in feed_forward:
            size = end - first
            out[name] = w if (index, size) == (0, w.shape[0]) else w[index : index + size]
    return out


def _normal_init(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
    """N(0, 0.02), transformers' default ``initializer_range`` for Qwen3."""
    return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


class Qwen3ForCausalLM(nnx.Module):
    """Qwen3 causal LM. See the module docstring for the call signature and the cache."""

    def __init__(
        self,
        config: Qwen3Config,
        *,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32,
        remat: bool = False,
        rngs: nnx.Rngs,
    ):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.param_dtype = jnp.dtype(param_dtype)
        self.remat = remat
        shape = (config.vocab_size, config.hidden_size)
        self.embed_tokens = nnx.Param(_normal_init(rngs.params(), shape, param_dtype))
        self.layers = Qwen3DecoderLayers(config, param_dtype=param_dtype, rngs=rngs)
        self.norm = nnx.Param(jnp.ones((config.hidden_size,), param_dtype))
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nnx.Param(_normal_init(rngs.params(), shape, param_dtype))
        )

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        attention_mask: jax.Array,
        cache: KVCache | PagedKVCache | None = None,
        **options,
    ) -> tuple[jax.Array, KVCache | None]:
        hidden, cache = self.hidden_states(tokens, positions, attention_mask, cache, **options)
        return self.logits(hidden), cache

    def logits(self, hidden: jax.Array, few_rows: bool = False) -> jax.Array:
        """``[..., hidden_size]`` final hidden states -> ``[..., vocab_size]`` float32 logits.

        ``few_rows``: the product in the form for a handful of rows (see :func:`linear`;
        Qwen3-0.6B's head at batch 8: 50 ms against 108 ms on CPU)."""
        head = (self.embed_tokens if self.lm_head is None else self.lm_head)[...].astype(self.dtype)
        if not few_rows:
            return jnp.einsum("...d,vd->...v", hidden, head, preferred_element_type=jnp.float32)
        rows = hidden.reshape(-1, hidden.shape[-1]).astype(self.dtype)
        transposed = jnp.einsum("vd,nd->vn", head, rows, preferred_element_type=jnp.float32)
        return jax.lax.optimization_barrier(transposed).T.reshape(*hidden.shape[:-1], -1)

    def split_layers(self) -> list[dict[str, jax.Array]]:
        """Each layer's weights as separate arrays in the compute dtype, for
        ``hidden_states(..., layers=...)``. Call it once outside a decode loop: inside a loop
        XLA:CPU copies a layer's slice of the stacked weights on every use (a decode step then
        moves each weight twice) but keeps arrays made before the loop in place. Costs one
        copy of the layer weights while they live."""
        stacked = self.layers.stacked()
        return [
            {name: w[i - first].astype(self.dtype) for name, w in segment.items()}
            for first, end, is_moe, index in layer_segments(self.config)
            for segment in [segment_params(stacked, (first, end, is_moe, index))]
            for i in range(first, end)
        ]

    def hidden_states(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        attention_mask: jax.Array,
        cache: KVCache | PagedKVCache | None = None,
        *,
        remat: bool | str | None = None,
        constrain: Constrain | None = None,
        attention: str = "xla",
        few_rows: bool = False,
        layers: Sequence[dict[str, jax.Array]] | None = None,
        adapters: bool = True,
        segment_ids: jax.Array | None = None,
        replay: jax.Array | None = None,
        routing: bool = False,
        moe_ffn: Callable | None = None,
    ) -> tuple[jax.Array, KVCache | None] | tuple[jax.Array, KVCache | None, moe.Routing | None]:
        """Final (normed) hidden states ``[B, L, hidden_size]`` and the updated cache (and,
        with ``routing``, the MoE layers' routing: see below).

        ``remat``: a :data:`REMAT_POLICIES` name (or a bool), overriding the model's own.
        ``constrain``: applied to the residual stream ``[B, L, D]`` at every layer boundary
        (e.g. a sharding constraint putting rows on the batch axes), None for none.
        ``attention``: the implementation of the no-cache forward's attention
        (:data:`agentrl_jax.models.attention.IMPLEMENTATIONS`; all compute the same).
        ``few_rows``: matrix products in the form for a handful of rows (:func:`linear`; a
        decode step). ``layers``: :meth:`split_layers` output, to run the cache forward's
        layers unrolled from separate arrays (faster on CPU inside a decode loop; compile
        time linear in depth) instead of one ``lax.scan`` over the stacked weights.
        ``adapters``: apply the LoRA adapters, if the model has them (False: the base model from
        the same weights, e.g. the KL reference). ``segment_ids [B, L]`` (no-cache forward only):
        packed rows, a run of equal ids one sequence that attends only within itself (give
        each its own positions: :func:`packed_positions`).

        MoE models: ``replay [B, L, M, k]`` int, the experts each token uses in each of the
        ``M`` MoE layers instead of its router's choice (routing replay; a row of negative ids:
        the router's own), None for none. ``routing``: also return the routing, a third value
        :class:`~agentrl_jax.models.moe.Routing` (the experts used ``[B, L, M, k]`` and the
        router logits ``[B, L, M, E]``; None for a dense model). ``moe_ffn``: the experts'
        computation (:func:`layer_output`).
        """
        config, dtype = self.config, self.dtype
        constrain = constrain or (lambda x: x)
        policy = self.remat if remat is None else remat
        valid = attention_mask.astype(bool)
        x = constrain(jnp.take(self.embed_tokens[...], tokens, axis=0, mode="clip").astype(dtype))
        inv_freq, attention_scale = rope_inverse_frequencies(config)
        cos, sin = rope_cos_sin(positions, inv_freq, attention_scale, dtype)
        layer_params = self.layers.stacked(adapters)

        def cast(p: dict[str, jax.Array]) -> dict[str, jax.Array]:
            return {name: w.astype(dtype) for name, w in p.items()}

        moe_index = np.cumsum([0, *config.moe_layers])  # layer -> its index among MoE layers
        by_layer = None if replay is None else jnp.moveaxis(replay.astype(jnp.int32), 2, 0)

        def segment_replay(segment):  # [layers of the run, B, L, k] or None
            first, end, is_moe, index = segment
            return by_layer[index : index + end - first] if is_moe and replay is not None else None

        def feed_forward(p, x, attended, replay_l, few_rows=False):
            return layer_output(p, x, attended, config, few_rows, replay_l, moe_ffn)

        traces = []  # each MoE run's (experts [n, B, L, k], logits [n, B, L, E])
        if segment_ids is not None and cache is not None:
            raise ValueError("segment_ids (packed rows) is for the no-cache forward only")
        if cache is None:
            starts = None if segment_ids is None else segment_starts(segment_ids)

            def body(x, xs):
                p, replay_l = xs
                p = cast(p)
                q, k, v = attention_inputs(p, x, cos, sin, config)
                attended = attention_fn(  # causal, within each segment
                    q, k, v, None, valid, key_start=starts, implementation=attention
                )
                out, trace = feed_forward(p, x, attended, replay_l)
                return constrain(out), trace

            for segment in layer_segments(config):  # one scan per run of one layer kind
                x, trace = jax.lax.scan(
                    remat_layer(body, policy),
                    x,
                    (segment_params(layer_params, segment), segment_replay(segment)),
                )
                traces.append(trace)
        else:
            filled = cache.lengths[:, None] + jnp.cumsum(valid.astype(jnp.int32), axis=1)  # [B, L]
            slots = jnp.where(valid, filled - 1, cache.max_len)  # padding -> out of range: dropped
            if isinstance(cache, PagedKVCache):  # rows' pages; attention reads only used ones
                page, offset = paged_cache.physical_slots(cache, slots)

                kernel = cache.kernel if tokens.shape[1] == 1 else "xla"  # Pallas: decode only

                def store_and_attend(q, k, v, k_all, v_all, layer):
                    k_all = paged_cache.write(k_all, layer, page, offset, k)
                    v_all = paged_cache.write(v_all, layer, page, offset, v)
                    if kernel == "xla":
                        attended = paged_cache.paged_attention(
                            q, k_all, v_all, layer, cache.page_table, filled, cache.block_pages
                        )
                    else:
                        attended = paged_kernels.decode_attention(
                            kernel,
                            q[:, 0],
                            k_all,
                            v_all,
                            layer,
                            cache.page_table,
                            filled[:, 0],
                            cache.block_pages,
                            cache.interpret,
                        )[:, None]
                    return attended, k_all, v_all
            else:
                mask = jnp.arange(cache.max_len)[None, None, :] < filled[:, :, None]  # [B, L, T]
                rows = jnp.arange(tokens.shape[0])[:, None]

                def store_and_attend(q, k, v, k_all, v_all, layer):
                    k_all = k_all.at[layer, rows, slots].set(k.astype(k_all.dtype), mode="drop")
                    v_all = v_all.at[layer, rows, slots].set(v.astype(v_all.dtype), mode="drop")
                    attended = grouped_query_attention(
                        q, k_all[layer].astype(dtype), v_all[layer].astype(dtype), mask
                    )
                    return attended, k_all, v_all

            def body(carry, xs):
                x, k_all, v_all = carry
                p, layer, replay_l = xs
                p = cast(p)
                q, k, v = attention_inputs(p, x, cos, sin, config, few_rows)
                attended, k_all, v_all = store_and_attend(q, k, v, k_all, v_all, layer)
                out, trace = feed_forward(p, x, attended, replay_l, few_rows)
                return (constrain(out), k_all, v_all), trace

            carry = (x, cache.k, cache.v)
            if layers is None:
                for segment in layer_segments(config):  # one scan per run of one layer kind
                    xs = (segment_params(layer_params, segment), jnp.arange(*segment[:2]))
                    carry, trace = jax.lax.scan(
                        remat_layer(body, policy), carry, (*xs, segment_replay(segment))
                    )
                    traces.append(trace)
            else:
                for index, p in enumerate(layers):
                    replayed = config.moe_layers[index] and replay is not None
                    replay_l = by_layer[moe_index[index]] if replayed else None
                    carry, trace = body(carry, (p, index, replay_l))
                    traces.append(None if trace is None else jax.tree.map(lambda t: t[None], trace))
            x, k_all, v_all = carry
            cache = cache.replace(k=k_all, v=v_all, lengths=filled[:, -1])
        hidden = constrain(rms_norm(x, self.norm[...], config.rms_norm_eps))
        if not routing:
            return hidden, cache
        return hidden, cache, moe.Routing.from_layers([t for t in traces if t is not None])
