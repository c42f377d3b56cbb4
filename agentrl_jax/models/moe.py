"""Qwen3 mixture-of-experts feed-forward, as pure functions: the router, dropless experts and
routing replay (PAPER.md §4; issue #58).

Math (matches ``transformers``' ``Qwen3MoeSparseMoeBlock``): per token, router logits
``x @ router.T`` over ``E`` experts; probabilities ``softmax`` in float32; the ``k`` most
probable experts, their probabilities renormalised to sum to 1 when ``normalize``
(``norm_topk_prob``); the output is the weighted sum of those experts' SwiGLU feed-forwards
``down_e(silu(gate_e(x)) * up_e(x))``.

Dropless: every token reaches its ``k`` experts whatever the load. The ``T * k`` (token,
expert) assignments are sorted by expert and each projection is one grouped matmul over the
sorted rows (:func:`jax.lax.ragged_dot_general`, the group sizes counted from the routing), so
the shapes depend only on ``T``, ``k`` and the sizes, never on where tokens go: one compile
serves every routing, and a skewed router (every token to one expert) drops nothing.

Routing replay: :func:`route` with ``experts`` given uses those experts (the ones the sampler
chose) instead of its own top-k, weighted by the router's own probabilities of them, so the
trainer computes the sampled tokens through the sampled experts while the router's gradient
still flows through the weights of the experts it is given.

Expert parallelism (:func:`expert_parallel`): the experts split over a mesh axis, each
device computing the assignments to its own experts for the tokens of its group.

Parameters keep Hugging Face's per-expert layouts, stacked over experts: ``gate`` and ``up``
``[E, I, H]`` (each expert's ``gate_proj.weight`` / ``up_proj.weight``), ``down`` ``[E, H,
I]``, ``router`` ``[E, H]`` (``mlp.gate.weight``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

# rows [T*k, H] x expert weights [E, I, H], contracting H with the weights' last axis; the
# rows are ragged along their first axis, grouped by the weights' first (expert) axis
_ROWS_BY_LAST = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)


@struct.dataclass
class Routing:
    """A forward's routing over its ``M`` MoE layers (``Qwen3ForCausalLM.hidden_states(...,
    routing=True)``): ``experts [B, L, M, k]`` int32, the experts each token used (its
    router's top-k, or the replayed ones); ``logits [B, L, M, E]``, the router logits (in the
    compute dtype), for the router's auxiliary losses and the replay metrics."""

    experts: jax.Array
    logits: jax.Array

    @classmethod
    def from_layers(cls, runs: list[tuple[jax.Array, jax.Array]]) -> "Routing | None":
        """From each run of MoE layers' ``(experts [n, B, L, k], logits [n, B, L, E])``, in
        layer order; None when there are none (a dense model)."""
        if not runs:
            return None
        experts, logits = (jnp.moveaxis(jnp.concatenate(part, axis=0), 0, 2) for part in zip(*runs))
        return cls(experts=experts, logits=logits)


def top_experts(router_logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The router's own choice: ``(probs [T, E] float32, their top-k [T, k] float32, experts
    [T, k] int32)``, most probable first (ties: the lower index first)."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    top, experts = jax.lax.top_k(probs, k)
    return probs, top, experts.astype(jnp.int32)


def route(
    router_logits: jax.Array, k: int, *, normalize: bool, experts: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Each token's experts and their weights.

    Args:
      router_logits: ``[T, E]`` (any float dtype).
      k: experts per token (``num_experts_per_tok``).
      normalize: renormalise the ``k`` probabilities to sum to 1 (``norm_topk_prob``).
      experts: ``[T, k]`` int, experts to use instead of the router's top-k (routing replay);
        a token whose row holds a negative id routes itself (a token with nothing recorded).
        None: every token routes itself, by its top-k (:func:`top_experts`).

    Returns:
      ``(weights [T, k] in router_logits.dtype, experts [T, k] int32)``.
    """
    probs, top, own = top_experts(router_logits, k)
    if experts is not None:
        given = experts.astype(jnp.int32)
        replayed = jnp.all(given >= 0, axis=-1, keepdims=True)
        experts = jnp.where(replayed, given, own)
        top = jnp.take_along_axis(probs, experts, axis=-1)
    else:
        experts = own
    if normalize:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top.astype(router_logits.dtype), experts


def differs(router_logits: jax.Array, experts: jax.Array) -> jax.Array:
    """``[T]`` bool: the router's own top-k (:func:`top_experts`) is not the set ``experts``
    ``[T, k]`` (order ignored; rows with a negative id: False), the routing-replay metric."""
    _, _, own = top_experts(router_logits, experts.shape[-1])
    given = experts.astype(jnp.int32)
    same = jnp.all(jnp.sort(own, axis=-1) == jnp.sort(given, axis=-1), axis=-1)
    return jnp.all(given >= 0, axis=-1) & ~same


def experts_ffn(
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    first: jax.Array | int = 0,
) -> jax.Array:
    """The weighted sum of each token's experts' SwiGLU feed-forwards, dropless.

    Args:
      x: ``[T, H]`` tokens.
      experts: ``[T, k]`` int, each token's experts (:func:`route`).
      weights: ``[T, k]``, their weights.
      gate, up: ``[E_here, I, H]``; down: ``[E_here, H, I]``: experts ``first`` ..
        ``first + E_here - 1`` (all of them by default). Assignments to other experts add
        nothing here: another device computes them (:func:`expert_parallel`).
      first: the index of this device's first expert.

    Returns:
      ``[T, H]`` in ``x.dtype``. The largest buffers are the ``[T * k, I]`` activations.
    """
    tokens, k = experts.shape
    here = gate.shape[0]
    flat = experts.reshape(-1) - first
    # experts held here in order, then every other assignment (its rows come out zero: the
    # grouped matmul leaves rows past the sum of the group sizes at 0)
    key = jnp.where((flat >= 0) & (flat < here), flat, here)
    order = jnp.argsort(key, stable=True)
    token = order // k
    group_sizes = jnp.bincount(key, length=here + 1)[:here].astype(jnp.int32)
    rows = x[token]  # [T*k, H]

    def grouped(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        return jax.lax.ragged_dot_general(
            lhs, rhs, group_sizes, _ROWS_BY_LAST, preferred_element_type=x.dtype
        )

    hidden = jax.nn.silu(grouped(rows, gate)) * grouped(rows, up)  # [T*k, I]
    out = grouped(hidden, down) * weights.reshape(-1)[order][:, None].astype(x.dtype)
    return jnp.zeros_like(x).at[token].add(out)


def expert_parallel(mesh: Mesh, axis: str = "expert", batch_axes: tuple[str, ...] = ()):
    """:func:`experts_ffn` with the experts split over the mesh axis ``axis``: a function of
    the same arguments (no ``first``) for ``jit``, its tokens ``[T, ...]`` split over
    ``batch_axes + (axis,)`` and its expert weights ``[E, ...]`` over ``axis``.

    Each device gathers the tokens of its ``axis`` group (all-gather), computes the
    assignments to the experts it holds, and the partial outputs are summed back onto the
    tokens' own devices (reduce-scatter): a token routed to an expert on another device is
    computed there, whatever the load, with static shapes. ``T`` must divide by the devices
    the tokens are split over, ``E`` by the size of ``axis``.
    """
    tokens_spec = P((*batch_axes, axis))
    experts_spec = P(axis)

    def local(x, experts, weights, gate, up, down):
        first = jax.lax.axis_index(axis) * gate.shape[0]
        gather = functools.partial(jax.lax.all_gather, axis_name=axis, axis=0, tiled=True)
        out = experts_ffn(gather(x), gather(experts), gather(weights), gate, up, down, first)
        return jax.lax.psum_scatter(out, axis, scatter_dimension=0, tiled=True)

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(tokens_spec, tokens_spec, tokens_spec, experts_spec, experts_spec, experts_spec),
        out_specs=tokens_spec,
    )


def moe_block(
    x: jax.Array,
    router: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    *,
    k: int,
    normalize: bool,
    experts: jax.Array | None = None,
    ffn=experts_ffn,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A Qwen3 sparse MoE block on ``x`` ``[..., H]``: ``(out [..., H], router_logits [T, E],
    experts [T, k])`` with ``T`` the tokens of ``x``. ``experts`` (``[T, k]``): replay those
    (see :func:`route`); the router logits are returned for auxiliary losses. ``ffn``: the
    experts' computation, :func:`experts_ffn` or an :func:`expert_parallel` one."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    logits = flat @ router.T.astype(flat.dtype)
    weights, chosen = route(logits, k, normalize=normalize, experts=experts)
    return ffn(flat, chosen, weights, gate, up, down).reshape(shape), logits, chosen
