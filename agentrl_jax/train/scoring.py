"""Scoring: the teacher-forced forward of the train step (and of the warm start and the
likelihood analysis): log-probs of the sampled tokens, the entropy, the critic's values.

Alignment: the log-prob of token ``p`` comes from the logits at ``p - 1``, and the value of
token ``p`` from the critic's hidden state at ``p - 1`` (the state the token was sampled in);
position 0 (never a sampled token) gets 0. :class:`Forward` holds the forward's static
settings (hashable: a jitted program may be cached by it).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from agentrl_jax.models.moe import Routing, moe_ffn
from agentrl_jax.models.qwen3 import Constrain, packed_positions, positions_from_mask
from agentrl_jax.sampling import exact
from agentrl_jax.sampling.filters import SamplingConfig
from agentrl_jax.sharding import BATCH_AXES
from agentrl_jax.train.logprobs import gather_positions, position_logprobs, scatter_positions


@dataclasses.dataclass(frozen=True)
class Forward:
    """The teacher-forced forward's settings: ``remat`` (what each layer keeps for the
    backward pass, a :data:`~agentrl_jax.models.qwen3.REMAT_POLICIES` name; None: the
    model's own), ``attention`` (:data:`~agentrl_jax.models.attention.IMPLEMENTATIONS`),
    ``loss_positions`` (the static bound on sampled positions per row at which the head runs;
    None: every position), ``logits_chunk`` (positions per chunk of the head) and
    ``sampling`` (score under this sampling distribution; None: the model's own) and
    ``adapters`` (apply the model's LoRA adapters, if it has them; False: the base model)."""

    remat: str | None = None
    attention: str = "xla"
    loss_positions: int | None = None
    logits_chunk: int = 512
    sampling: SamplingConfig | None = None
    adapters: bool = True


def _shift_right(x: jax.Array) -> jax.Array:
    """``[N, L-1]`` predictions for tokens 1..L-1 -> ``[N, L]`` aligned with the tokens (0 at 0)."""
    return jnp.pad(x, ((0, 0), (1, 0)))


def _hidden_states(
    model, tokens, token_mask, forward: Forward, constrain, segment_ids=None, replay=None
) -> tuple[jax.Array, Routing | None]:
    """The last layer's hidden states ``[N, L, D]`` under ``forward``'s remat and attention
    (packed rows: ``segment_ids``, each sequence with its own positions), and an MoE model's
    routing (None for a dense one; ``replay [N, L, M, k]``: recorded experts to use)."""
    positions = (
        positions_from_mask(token_mask)
        if segment_ids is None
        else packed_positions(token_mask, segment_ids)
    )
    hidden, _, routing = model.hidden_states(
        tokens,
        positions,
        token_mask,
        segment_ids=segment_ids,
        remat=forward.remat,
        constrain=constrain,
        attention=forward.attention,
        adapters=forward.adapters,
        replay=replay,
        routing=True,
        moe_ffn=getattr(constrain, "moe_ffn", None),  # activation_constraint's, from its mesh
    )
    return hidden, routing


def sequence_logprobs(
    model: nnx.Module,
    tokens: jax.Array,
    token_mask: jax.Array,
    *,
    loss_mask: jax.Array | None = None,
    with_entropy: bool = False,
    forward: Forward | None = None,
    constrain: Constrain | None = None,
    segment_ids: jax.Array | None = None,
    replay: jax.Array | None = None,
    with_routing: bool = False,
) -> tuple[jax.Array, jax.Array | None] | tuple[jax.Array, jax.Array | None, Routing | None]:
    """Teacher-forced ``log pi(token_p | tokens_<p)`` ``[N, L]`` (and the entropy at each
    position's predicting distribution, ``[N, L]``, if asked); 0 at position 0.
    MoE models: ``replay [N, L, M, k]`` routes tokens through recorded experts
    (:meth:`~agentrl_jax.models.qwen3.Qwen3ForCausalLM.hidden_states`); ``with_routing``
    also returns the forward's :class:`~agentrl_jax.models.moe.Routing` (None if dense).

    With ``loss_mask`` the head runs only at those positions (0 elsewhere), in chunks
    (:mod:`agentrl_jax.train.logprobs`; ``forward.loss_positions`` bounds them per row,
    ``forward.logits_chunk`` sizes the chunks); without it at every position. ``forward``'s
    ``remat`` applies to the layers, its ``sampling`` picks the distribution (the model's or
    the rollout's sampling distribution); ``constrain`` to activations (see
    :func:`activation_constraint`). ``segment_ids``: packed rows (several sequences per row,
    each attending within itself at its own positions; its first token is never a loss
    token, so no log-prob reads across a boundary).
    """
    forward = forward or Forward()
    hidden, routing = _hidden_states(
        model, tokens, token_mask, forward, constrain, segment_ids, replay
    )
    mask = jnp.ones_like(token_mask, bool) if loss_mask is None else loss_mask
    scores = position_logprobs(
        hidden,
        tokens,
        mask,
        lambda h: model.logits((constrain or identity)(h)),
        width=forward.loss_positions,
        chunk=forward.logits_chunk,
        with_entropy=with_entropy,
        sampling=forward.sampling,
    )
    return (*scores, routing) if with_routing else scores


def exact_logprobs(
    model: nnx.Module,
    tokens: jax.Array,
    token_mask: jax.Array,
    loss_mask: jax.Array,
    *,
    length: int | None = None,
    width: int | None = None,
    sampling: SamplingConfig | None = None,
) -> jax.Array:
    """The canonical log-probs ``[N, T]`` of the loss tokens of trajectories ``tokens [N, T]``
    (``rl.exact_logprobs``, :mod:`agentrl_jax.sampling.exact`): each row alone, its real tokens
    (``token_mask``) moved to offset 0 of a row of ``length`` (the sampler's ``max_context``;
    None: ``T``), the head at each loss token (at most ``width`` per row, as
    :func:`~agentrl_jax.train.logprobs.gather_positions`); 0 elsewhere. No gradient: the
    values the sampler recorded, bit for bit, when it sampled under these parameters."""
    n, width_t = tokens.shape
    length = width_t if length is None else length
    if width_t > length:
        raise ValueError(f"exact log-probs: rows of {width_t} tokens exceed the {length} canonical")
    token_mask = token_mask.astype(bool)
    index = jnp.cumsum(token_mask, axis=1, dtype=jnp.int32) - 1  # each real token's offset
    rows = jnp.arange(n)[:, None]
    compact = (
        jnp.zeros((n, length), jnp.int32)
        .at[rows, jnp.where(token_mask, index, length)]
        .set(tokens.astype(jnp.int32), mode="drop")
    )
    width = max(1, width_t - 1) if width is None else max(1, min(width, width_t - 1))
    positions, valid = gather_positions(loss_mask.astype(bool) & token_mask, width)
    targets = jnp.take_along_axis(index, positions, axis=1)
    values = jax.lax.map(
        lambda xs: exact.target_logprobs(model, xs[0], xs[1], sampling),
        (compact, targets),
    )
    return jax.lax.stop_gradient(scatter_positions(values, positions, valid, width_t))


def identity(x):
    return x


def activation_constraint(mesh: Mesh | None) -> Constrain | None:
    """Rows of an activation ``[N, ...]`` over the mesh's batch axes (None without a mesh), so
    under FSDP each device holds its share of the micro-batch, never all of it."""
    if mesh is None:
        return None

    def constrain(x: jax.Array) -> jax.Array:
        return jax.lax.with_sharding_constraint(
            x, NamedSharding(mesh, P(BATCH_AXES, *([None] * (x.ndim - 1))))
        )

    constrain.moe_ffn = moe_ffn(mesh)  # the experts' computation on this mesh (models.moe.moe_ffn)
    return constrain


def critic_values(
    model: nnx.Module,
    head: dict[str, jax.Array],
    tokens: jax.Array,
    token_mask: jax.Array,
    *,
    forward: Forward | None = None,
    constrain: Constrain | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """``V`` of the state each token was sampled in, ``[N, L]`` float32 (0 at position 0;
    packed rows: ``segment_ids``)."""
    forward = forward or Forward()
    hidden, _ = _hidden_states(model, tokens, token_mask, forward, constrain, segment_ids)
    values = (
        jnp.einsum("nld,d->nl", hidden[:, :-1].astype(jnp.float32), head["kernel"]) + head["bias"]
    )
    return _shift_right(values)
