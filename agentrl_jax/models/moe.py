"""Qwen3 mixture-of-experts feed-forward, as pure functions: the router, dropless experts and
routing replay (PAPER.md §4; issue #58).

Math (matches ``transformers``' ``Qwen3MoeSparseMoeBlock``): per token, router logits
``x @ router.T`` over ``E`` experts; probabilities ``softmax`` in float32; the ``k`` most
probable experts, their probabilities renormalised to sum to 1 when ``normalize``
(``norm_topk_prob``); the output is the weighted sum of those experts' SwiGLU feed-forwards
``down_e(silu(gate_e(x)) * up_e(x))``.

Dropless: every token reaches its ``k`` experts whatever the load. The ``T * k`` (token,
expert) assignments are sorted by expert and each projection is one grouped matmul over the
sorted rows (:func:`grouped_matmul`, the group sizes counted from the routing), so the shapes
depend only on ``T``, ``k`` and the sizes, never on where tokens go: one compile serves every
routing, and a skewed router (every token to one expert) drops nothing. The grouped matmul is
:func:`jax.lax.ragged_dot_general` on TPU, whose compiler has it natively; XLA:CPU and XLA:GPU
expand that op into one full product per expert (``E`` times the work, ``[E, T * k, ...]``
buffers), so there it runs in blocks instead (:func:`blocked_grouped_matmul`: each expert's rows
in blocks of one expert, about the assignments' own work).

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

from agentrl_jax.models.attention import target_platform
from agentrl_jax.sharding import BATCH_AXES, batch_shards, expert_shards

EXPERT_EXCHANGES = ("shard_map", "compiler")
"""How tokens reach the experts of an ``expert`` mesh axis (:func:`moe_ffn`)."""

# recorded expert ids (routing replay): up to 32767 experts, -1 for none
EXPERT_ID_DTYPE = jnp.int16

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


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``lhs [R, K]`` rows sorted by group times their group's ``rhs [G, O, K]`` (contracting
    ``K`` with its last axis): ``[R, O]`` in ``lhs.dtype``; rows past ``sum(group_sizes)`` are
    0. The form for the platform a program is built for
    (:func:`~agentrl_jax.models.attention.target_platform`): :func:`jax.lax.ragged_dot_general`
    on TPU, :func:`blocked_grouped_matmul` elsewhere."""
    if target_platform() == "tpu":
        return jax.lax.ragged_dot_general(
            lhs, rhs, group_sizes, _ROWS_BY_LAST, preferred_element_type=lhs.dtype
        )
    return blocked_grouped_matmul(lhs, rhs, group_sizes)


def blocked_grouped_matmul(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, block: int | None = None
) -> jax.Array:
    """:func:`grouped_matmul` in blocks of ``block`` rows of one group each.

    Each group's rows are cut into blocks (its last one padded), at most ``ceil(R / block) +
    G`` blocks in all whatever the sizes; a block is multiplied by its group's matrix alone,
    a few blocks at a time in a ``lax.scan`` (their matrices gathered, about 2**24 numbers per
    step). Work: ``R`` rows plus the padding, at most ``G * (block - 1)`` rows. ``block``
    (static): by default the rows per group on average, as a power of two in [8, 128].
    """
    rows, depth = lhs.shape
    groups, out_dim, _ = rhs.shape
    if block is None:
        block = min(128, max(8, 1 << max(-(-rows // groups) - 1, 0).bit_length()))
    count = -(-rows // block) + groups  # a bound on the blocks, whatever the group sizes
    per_step = max(1, min(count, (1 << 24) // max(out_dim * depth, 1)))
    count = -(-count // per_step) * per_step
    sizes = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes  # each group's first row
    blocks = -(-sizes // block)
    first_block = jnp.cumsum(blocks) - blocks
    b = jnp.arange(count)
    group = jnp.minimum(jnp.searchsorted(jnp.cumsum(blocks), b, side="right"), groups - 1)
    offset = (b - first_block[group])[:, None] * block + jnp.arange(block)[None, :]
    valid = (offset < sizes[group][:, None]) & (b < jnp.sum(blocks))[:, None]
    x = jnp.where(valid[..., None], lhs[jnp.where(valid, starts[group][:, None] + offset, 0)], 0)

    @functools.partial(jax.checkpoint, prevent_cse=False)  # the backward gathers the
    def step(_, xs):  # matrices again instead of keeping every step's: [count, O, K] in all
        x_blocks, which = xs  # [per_step, block, K], [per_step]
        products = jnp.einsum(
            "sbk,sok->sbo", x_blocks, rhs[which], preferred_element_type=lhs.dtype
        )
        return None, products

    _, out = jax.lax.scan(
        step,
        None,
        (x.reshape(-1, per_step, block, depth), group.reshape(-1, per_step)),
    )
    out = out.reshape(count * block, out_dim)
    # back to the sorted rows: row r, the i-th of its group g, is row i % block of that
    # group's block i // block
    r = jnp.arange(rows)
    row_group = jnp.minimum(jnp.searchsorted(jnp.cumsum(sizes), r, side="right"), groups - 1)
    i = r - starts[row_group]
    here = r < jnp.sum(sizes)
    source = (first_block[row_group] + i // block) * block + i % block
    return jnp.where(here[:, None], out[jnp.where(here, source, 0)], 0).astype(lhs.dtype)


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
        return grouped_matmul(lhs, rhs, group_sizes)

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


def moe_ffn(mesh: Mesh | None, exchange: str = "shard_map"):
    """The experts' computation a forward on ``mesh`` passes to the model
    (``Qwen3ForCausalLM.hidden_states(..., moe_ffn=...)``), or None for the default
    (:func:`experts_ffn` under the caller's ``jit``).

    On a mesh whose ``expert`` axis has more than one device, ``exchange="shard_map"`` gives
    :func:`expert_parallel` over it: each device all-gathers the
    tokens of its expert group (rows split over :data:`BATCH_AXES`), computes the assignments
    to the ``E / expert`` experts it holds, and the partial outputs are reduce-scattered back
    onto the tokens' devices; the expert weights are never gathered over ``expert`` (over
    ``fsdp`` and ``tensor``, where they are split, once per layer as ZeRO does).
    ``exchange="compiler"``: None, the experts' ``E`` split by the partition rules alone and
    the exchange left to XLA's SPMD partitioner (on 8 fake CPU devices it splits the grouped
    matmuls by expert and all-reduces the ``[T * k, H]`` rows over the mesh). The train step
    on Qwen3-30B-A3B measured 56.8 GiB a v5p chip with the first, 117 with the second
    (docs/hardware.md, "Qwen3-30B-A3B"). Without an expert axis: None."""
    if exchange not in EXPERT_EXCHANGES:
        raise ValueError(f"exchange must be one of {EXPERT_EXCHANGES}, got {exchange!r}")
    if expert_shards(mesh) <= 1 or exchange == "compiler":
        return None
    batch = tuple(axis for axis in BATCH_AXES if axis != "expert")
    parallel = expert_parallel(mesh, "expert", batch)
    experts_split, tokens_split = expert_shards(mesh), batch_shards(mesh)

    def ffn(x, experts, weights, gate, up, down):
        if gate.shape[0] % experts_split:
            raise ValueError(
                f"mesh.expert={experts_split} must divide the model's {gate.shape[0]} experts"
            )
        if x.shape[0] % tokens_split:
            raise ValueError(
                f"expert parallelism splits a forward's tokens over data x fsdp x expert "
                f"({tokens_split} devices), which do not divide its {x.shape[0]} tokens"
            )
        return parallel(x, experts, weights, gate, up, down)

    return ffn


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
