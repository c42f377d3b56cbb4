"""A mixture-of-experts router's auxiliary losses, per token: load balance and z-loss.

Shapes: ``N`` rows of ``L`` positions, an MoE model's ``M`` MoE layers, ``E`` experts, ``k``
experts per token. ``router_logits [N, L, M, E]`` are the router's logits at each MoE layer
(any float dtype; the math is float32, as the router's softmax,
:func:`agentrl_jax.models.moe.top_experts`); ``router_experts [N, L, M, k]`` int are the
experts each token was routed to (its router's top-k, or the replayed ones under routing
replay). Like every loss in :mod:`agentrl_jax.algorithms`, each function returns a per-token
loss ``[N, L]`` that the configured aggregation reduces over the loss mask
(:mod:`~agentrl_jax.algorithms.aggregation`), so micro-batching and packing stay exact.

**Load balance** (:func:`balance_loss`), sequence-wise: for each sequence ``s`` and MoE layer
``m``, the expert loads ::

    f[s, m, e] = sum_{t in s} w_t * #{j : experts[t, m, j] = e} / sum_{t in s} w_t

over the sequence's loss tokens (``w`` the loss mask), which sum to ``k`` over ``e``
(no gradient: they come from integer routing), and per token ::

    loss[t] = mean_m  E * sum_e f[s(t), m, e] * p[t, m, e],   p = softmax(router_logits) (f32)

so the token mean of ``loss`` over a sequence's loss tokens is
``mean_m E * sum_e f[s, m, e] * P[s, m, e]``, ``P`` the sequence's mean router probabilities:
transformers' ``load_balancing_loss_func`` (Switch Transformer's loss with its top-k counts,
Qwen3-MoE's auxiliary loss) for that sequence's tokens, one layer at a time, averaged over
the layers. (transformers pools the layers instead: ``E * sum_e mean_m f * mean_m P``; the
two agree for one MoE layer, and ours is the mean of transformers' value for each layer
alone.) A balanced router (``f = k / E``, ``p = 1 / E``) scores ``k``. This is DeepSeek-V3's
complementary sequence-wise balance loss ``L_Bal`` times ``k`` (its ``f_i`` is ours times
``E / k``, it sums to ``E``). The loads only ever mix the tokens of one sequence (a row, or a
run of equal ``segment_ids`` in a packed row), so any split of the batch along rows, and any
packing, gives the same per-token loss.

**Router z-loss** (:func:`z_loss`, ST-MoE): per token, ``mean_m logsumexp(router_logits[t,
m])^2`` in float32; its token mean is ST-MoE's ``L_z`` averaged over the layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from agentrl_jax.algorithms.aggregation import sequence_index


def z_loss(router_logits: jax.Array) -> jax.Array:
    """ST-MoE's router z-loss per token: ``router_logits [N, L, M, E]`` -> ``[N, L]`` float32,
    the mean over the ``M`` layers of ``logsumexp_e(logits)^2`` (in float32)."""
    lse = jax.nn.logsumexp(router_logits.astype(jnp.float32), axis=-1)
    return jnp.mean(jnp.square(lse), axis=-1)


def sequence_loads(
    router_experts: jax.Array,
    loss_mask: jax.Array,
    num_experts: int,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Each token's sequence's expert loads ``f`` ``[N, L, M, E]`` float32 (no gradient).

    Args:
      router_experts: ``[N, L, M, k]`` int, the experts each token used; a negative id counts
        for no expert.
      loss_mask: ``[N, L]`` bool or float weights: the tokens that count.
      num_experts: ``E``.
      segment_ids: ``[N, L]`` packed rows (a run of equal ids is one sequence), or None (each
        row one sequence).

    Returns:
      ``f[n, t, m, e]``: the loss-mask-weighted mean over the tokens of position ``(n, t)``'s
      sequence of how many of their ``k`` assignments at layer ``m`` went to expert ``e``;
      sums to ``k`` over ``e`` (0 for a sequence with no loss tokens).
    """
    n, length = loss_mask.shape
    weights = loss_mask.astype(jnp.float32)
    counts = jnp.sum(jax.nn.one_hot(router_experts, num_experts, dtype=jnp.float32), axis=-2)
    if segment_ids is None:
        tokens = jnp.sum(weights, axis=-1)  # [N]
        loads = jnp.einsum("nl,nlme->nme", weights, counts)
        loads = loads / jnp.where(tokens > 0, tokens, 1.0)[:, None, None]
        loads = jnp.broadcast_to(loads[:, None], counts.shape)
    else:
        index = sequence_index(segment_ids).reshape(-1)  # [N*L] a sequence's first position
        sums = jax.ops.segment_sum(
            (weights[..., None, None] * counts).reshape(n * length, *counts.shape[2:]),
            index,
            num_segments=n * length,
        )
        tokens = jax.ops.segment_sum(weights.reshape(-1), index, num_segments=n * length)
        sums = sums / jnp.where(tokens > 0, tokens, 1.0)[:, None, None]
        loads = sums[index].reshape(counts.shape)
    return jax.lax.stop_gradient(loads)


def balance_loss(
    router_logits: jax.Array,
    router_experts: jax.Array,
    loss_mask: jax.Array,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The sequence-wise load-balancing loss per token, and its sequence's busiest expert.

    Args:
      router_logits: ``[N, L, M, E]`` (differentiated; any float dtype, read in float32).
      router_experts: ``[N, L, M, k]`` int, the experts each token used.
      loss_mask: ``[N, L]``: the tokens whose routing counts in the loads.
      segment_ids: ``[N, L]`` packed rows, or None (see :func:`sequence_loads`).

    Returns:
      ``(loss [N, L], max_load [N, L])`` float32: ``loss[t] = mean_m E * sum_e f[s(t), m, e] *
      softmax(logits[t, m])_e`` (the module docstring; the gradient flows through the
      softmax only), and ``max_load[t] = mean_m max_e f[s(t), m, e] / k``, the share of the
      sequence's assignments that its busiest expert took (``1 / E`` when balanced, at most
      ``1 / k``), averaged over the layers.
    """
    num_experts, k = router_logits.shape[-1], router_experts.shape[-1]
    loads = sequence_loads(router_experts, loss_mask, num_experts, segment_ids)
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    loss = num_experts * jnp.mean(jnp.sum(loads * probs, axis=-1), axis=-1)
    max_load = jnp.mean(jnp.max(loads, axis=-1), axis=-1) / k
    return loss, max_load
