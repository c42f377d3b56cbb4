"""Exact log-probs (``rl.exact_logprobs``): one canonical per-sequence computation that the
sampler and the trainer both use, so the log-prob the sampler records for a token and the one
the trainer scores it with are the same float32 number, bit for bit.

Why the fast paths differ: a decode step multiplies ``[B, D]`` rows (M = batch size) and
attends over a (paged) KV cache, the training forward multiplies ``[N, T, D]`` rows (M = T)
and attends over the whole row (packed, blocked, flash); XLA picks blockings and vectorised
reductions by shape, so the same token's log-prob is summed in different orders (~1e-6).

The canonical form fixes every shape a number passes through:

* a sequence is computed alone (``lax.map`` over rows, never a product across rows), its
  tokens at offset 0 of a row of fixed length ``L`` (the run's ``max_context``), positions
  ``0..L-1``, causal attention over the whole row (:func:`canonical_hidden`). Position ``p``
  then does not depend on what lies after it: later keys are masked, ``exp(-inf) = 0`` and
  ``x + 0 == x``, and every product and reduction has the same shape whatever follows;
* the head and the log-softmax run on one position at a time (``[1, D] x [D, V]``,
  :func:`head_logits`, :func:`token_logprob`), under the distribution the trainer scores
  (the model's, or the sampling one: :func:`~agentrl_jax.sampling.filters.scoring_logits`).

The sampler (:func:`next_token_logits`) recomputes the canonical forward of each row's whole
history at every decode step, reads the position of its last token and samples from those
logits; the trainer (:func:`target_logprobs`) runs the same forward once per trajectory and
the same head at each sampled token. ``O(L)`` work per sampled token: the cost of exactness
(the KV cache still runs, for everything else the engine does).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from agentrl_jax.sampling.filters import SamplingConfig, scoring_logits


def canonical_hidden(model, tokens: jax.Array) -> jax.Array:
    """The final hidden states ``[L, D]`` of one sequence, ``tokens [L]`` int at offset 0
    (what follows its last real token is arbitrary: position ``p`` reads positions ``<= p``
    only), positions ``0..L-1``, causal attention (the XLA implementation)."""
    length = tokens.shape[0]
    hidden, _ = model.hidden_states(
        tokens[None].astype(jnp.int32),
        jnp.arange(length, dtype=jnp.int32)[None],
        jnp.ones((1, length), bool),
        attention="xla",
    )
    return hidden[0]


def head_logits(model, state: jax.Array) -> jax.Array:
    """``[1, V]`` float32 logits of one position's final hidden state ``state [D]``."""
    return model.logits(state[None])


def token_logprob(
    logits: jax.Array, token: jax.Array, sampling: SamplingConfig | None
) -> jax.Array:
    """``log softmax(logits)[token]`` ``[1]`` of ``logits [1, V]``, ``token [1]``, under the
    model's distribution (``sampling`` None) or the sampling one (greedy: 0)."""
    if sampling is not None:
        if sampling.greedy:
            return jnp.zeros((1,), jnp.float32)
        logits = scoring_logits(logits, token, sampling)
    picked = jnp.take_along_axis(logits, token[:, None], axis=-1)[:, 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)


def next_token_logits(model, history: jax.Array, lengths: jax.Array) -> jax.Array:
    """``[B, V]``: each row's next-token logits, from the canonical forward of its history
    ``history [B, L]`` (tokens ``[0, lengths[b])`` real) at its last token (a row with none
    gets those of position 0, for the caller to ignore)."""

    def row(xs):
        tokens, length = xs
        state = canonical_hidden(model, tokens)[jnp.maximum(length - 1, 0)]
        return head_logits(model, state)[0]

    return jax.lax.map(row, (history, lengths))


def token_logprobs(
    logits: jax.Array, tokens: jax.Array, sampling: SamplingConfig | None
) -> jax.Array:
    """:func:`token_logprob` of each row: ``logits [B, V]``, ``tokens [B]`` -> ``[B]``."""
    return jax.lax.map(
        lambda xs: token_logprob(xs[0][None], xs[1][None], sampling)[0], (logits, tokens)
    )


def target_logprobs(
    model, tokens: jax.Array, targets: jax.Array, sampling: SamplingConfig | None
) -> jax.Array:
    """The canonical log-probs ``[R]`` of the tokens at positions ``targets [R]`` (each >= 1;
    other slots give numbers to ignore) of one sequence ``tokens [L]``: the head at
    ``p - 1``, the position the sampler sampled token ``p`` from."""
    hidden = canonical_hidden(model, tokens)

    def one(p):
        logits = head_logits(model, hidden[jnp.maximum(p - 1, 0)])
        return token_logprob(logits, tokens[p][None], sampling)[0]

    return jax.lax.map(one, targets)


@jax.custom_jvp
def valued(fast: jax.Array, value: jax.Array) -> jax.Array:
    """``value``, differentiated as ``fast``: the trainer's exact log-probs carry the fast
    forward's gradient (equal to it up to rounding), their values are the canonical ones."""
    return value


@valued.defjvp
def _valued_jvp(primals, tangents):
    return primals[1], tangents[0]
