"""Teacher-forced log-probs (and entropy) of the tokens a loss reads, without ``[N, L, V]``.

A multi-turn row is mostly prompt and observation tokens: in FrozenLake ~8 sampled tokens per
~105-token turn. The loss reads only the sampled ones, so the output head (~80% of a small
Qwen3's parameters, and the ``[N, L, V]`` float32 logits that dominate a step's memory) runs
only there:

1. :func:`gather_positions` picks each row's loss positions ``p`` (sampled tokens, ``p >= 1``)
   into a static ``[N, R]`` index, in order, padded with invalid slots; ``R`` is a static
   bound (``TrainConfig.loss_positions``; ``L - 1`` when unset, which is exact for any mask).
2. The final hidden states at ``p - 1`` (the state the token was sampled in) are gathered:
   ``[N, R, D]``.
3. :func:`head_logprobs` runs the head and its log-softmax on chunks of ``C`` positions
   (``TrainConfig.logits_chunk``) under ``jax.checkpoint``: the forward keeps one
   ``[N, C, V]`` chunk at a time, and the backward recomputes each chunk's logits instead of
   saving them. So the largest buffer of the head is ``N x C x V x 4`` bytes, whatever ``L``.
4. :func:`scatter_positions` puts the results back at their positions, ``[N, L]`` float32,
   0 elsewhere, which is what the loss terms read.

Rows with more than ``R`` loss tokens cannot be represented: the train step drops the excess
from its loss mask and reports ``loss_tokens_dropped``; the loop rejects such batches before
the step (:func:`check_loss_positions`), so a correctly sized ``R`` never drops anything.
Every function is pure and works under ``jit``, ``vmap`` and ``grad``.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax.sampling.filters import SamplingConfig, scoring_logits


def gather_positions(loss_mask: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
    """Each row's loss positions in order: ``(positions [N, R] int32, valid [N, R] bool)``.

    loss_mask: ``[N, L]`` bool. Position 0 is never a loss position (nothing predicts it).
    Invalid slots hold position 0. Positions past the ``width``-th of a row are dropped.
    """
    n, length = loss_mask.shape
    mask = loss_mask.astype(bool) & (jnp.arange(length) > 0)[None, :]
    rank = jnp.cumsum(mask, axis=1, dtype=jnp.int32) - 1  # slot of each loss position
    slot = jnp.where(mask, rank, width)  # width = out of range: dropped
    rows = jnp.arange(n)[:, None]
    positions = (
        jnp.zeros((n, width), jnp.int32)
        .at[rows, slot]
        .set(jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (n, length)), mode="drop")
    )
    count = jnp.sum(mask, axis=1, dtype=jnp.int32)
    valid = jnp.arange(width)[None, :] < jnp.minimum(count, width)[:, None]
    return positions, valid


def kept_mask(loss_mask: jax.Array, width: int) -> jax.Array:
    """``loss_mask [N, L]`` less the positions :func:`gather_positions` drops (past the
    ``width``-th of a row, and position 0)."""
    length = loss_mask.shape[1]
    mask = loss_mask.astype(bool) & (jnp.arange(length) > 0)[None, :]
    return mask & (jnp.cumsum(mask, axis=1) <= width)


def scatter_positions(
    values: jax.Array, positions: jax.Array, valid: jax.Array, length: int
) -> jax.Array:
    """Inverse of the gather: ``values [N, R]`` at ``positions`` -> ``[N, L]``, 0 elsewhere."""
    n, width = values.shape
    target = jnp.where(valid, positions, length)  # invalid slots: out of range, dropped
    rows = jnp.arange(n)[:, None]
    return jnp.zeros((n, length), values.dtype).at[rows, target].set(values, mode="drop")


def head_logprobs(
    hidden: jax.Array,
    targets: jax.Array,
    logits_fn: Callable[[jax.Array], jax.Array],
    *,
    chunk: int,
    with_entropy: bool = False,
    sampling: SamplingConfig | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """``log softmax(logits_fn(hidden))[target]`` (and the entropy) per position, in chunks.

    hidden: ``[N, R, D]``; targets: ``[N, R]`` int; logits_fn: ``[N, C, D] -> [N, C, V]``
    float32 (the model's head). Returns ``[N, R]`` float32 (entropy ``[N, R]`` or None).
    Chunks of ``chunk`` positions run one after another under ``jax.checkpoint`` (see the
    module docstring); ``R`` is padded up to a multiple of ``chunk`` (padding is discarded).
    ``sampling``: score under that sampling distribution (temperature, top-k/top-p, valid
    vocabulary; :func:`~agentrl_jax.sampling.filters.scoring_logits`) instead of the model's
    own; the entropy is then that distribution's.
    """
    n, width, dim = hidden.shape
    chunk = max(1, min(chunk, width))
    num = -(-width // chunk)
    pad = num * chunk - width

    @jax.checkpoint
    def one(h, t):
        logits = logits_fn(h).astype(jnp.float32)  # [N, C, V]
        if sampling is not None:  # -inf outside the sampling distribution's support
            logits = scoring_logits(
                logits.reshape(-1, logits.shape[-1]), t.reshape(-1), sampling
            ).reshape(logits.shape)
        normaliser = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0] - normaliser
        if not with_entropy:
            return picked, jnp.zeros_like(picked)
        log_p = logits - normaliser[..., None]
        finite_log_p = jnp.where(jnp.isfinite(log_p), log_p, 0.0)  # p log p = 0 off the support
        return picked, -jnp.sum(jnp.exp(log_p) * finite_log_p, axis=-1)

    if num == 1:
        picked, entropy = one(hidden, targets)
    else:
        h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(n, num, chunk, dim)
        t = jnp.pad(targets, ((0, 0), (0, pad))).reshape(n, num, chunk)
        picked, entropy = jax.lax.map(
            lambda xs: one(*xs), (jnp.swapaxes(h, 0, 1), jnp.swapaxes(t, 0, 1))
        )
        picked = jnp.swapaxes(picked, 0, 1).reshape(n, num * chunk)[:, :width]
        entropy = jnp.swapaxes(entropy, 0, 1).reshape(n, num * chunk)[:, :width]
    return picked, (entropy if with_entropy else None)


def position_logprobs(
    hidden: jax.Array,
    tokens: jax.Array,
    loss_mask: jax.Array,
    logits_fn: Callable[[jax.Array], jax.Array],
    *,
    width: int | None = None,
    chunk: int = 512,
    with_entropy: bool = False,
    sampling: SamplingConfig | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Teacher-forced ``log pi(token_p | tokens_<p)`` at the loss positions, ``[N, L]``.

    hidden: ``[N, L, D]`` final hidden states; tokens, loss_mask: ``[N, L]``. Values at
    positions outside the (kept) loss mask are 0, as is the entropy there (``[N, L]`` or None).
    ``width``: the static bound ``R`` on loss positions per row (default ``L - 1``: all).
    ``sampling``: see :func:`head_logprobs`.
    """
    n, length = tokens.shape
    width = max(1, length - 1) if width is None else max(1, min(width, length - 1))
    positions, valid = gather_positions(loss_mask, width)
    states = jnp.take_along_axis(hidden, jnp.maximum(positions - 1, 0)[..., None], axis=1)
    targets = jnp.take_along_axis(tokens, positions, axis=1)
    picked, entropy = head_logprobs(
        states, targets, logits_fn, chunk=chunk, with_entropy=with_entropy, sampling=sampling
    )
    logprobs = scatter_positions(picked, positions, valid, length)
    return logprobs, None if entropy is None else scatter_positions(
        entropy, positions, valid, length
    )


def check_loss_positions(trajectory, width: int | None) -> None:
    """Raises ValueError if a real row of ``trajectory`` has more sampled tokens than the
    bound ``width`` (host-side; the loop runs it on every batch)."""
    if width is None:
        return
    mask = (
        np.asarray(trajectory.loss_mask, bool) & np.asarray(trajectory.row_mask, bool)[:, None]
    )[:, 1:]
    counts = mask.sum(axis=1)
    if counts.size and counts.max() > width:
        row = int(np.argmax(counts))
        raise ValueError(
            f"TrainConfig.loss_positions={width} is below the {int(counts[row])} sampled "
            f"tokens of row {row}: raise it (at least turns x response tokens per row)"
        )
