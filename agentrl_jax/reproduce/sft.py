"""Supervised warm-start: behaviour cloning on recorded trajectories (the reproduction's base).

The loss is the mean negative log-likelihood of the policy's own tokens (``loss_mask``: the
responses, stop tokens included) given everything before them, teacher-forced on the recorded
conversation -- the same tokens, positions and template the rollout produced. The step is one
jitted function of ``(params, opt_state, batch)`` with a fixed batch shape, so it compiles once.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from agentrl_jax.train.step import sequence_logprobs
from agentrl_jax.trajectory import Trajectory


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SFTBatch:
    """``tokens``, ``token_mask``, ``loss_mask``: ``[B, L]`` (rows of zero masks are padding)."""

    tokens: jax.Array
    token_mask: jax.Array
    loss_mask: jax.Array


def nll_sum(graphdef: nnx.GraphDef, params: Any, batch: SFTBatch) -> tuple[jax.Array, jax.Array]:
    """``(sum of -log pi over loss-mask tokens, their count)`` -- unreduced, so micro-batches and
    devices add up exactly."""
    model = nnx.merge(graphdef, params)
    logprobs, _ = sequence_logprobs(model, batch.tokens, batch.token_mask)
    mask = batch.loss_mask.astype(jnp.float32)
    return -jnp.sum(logprobs * mask), jnp.sum(mask)


def make_sft_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation
                  ) -> Callable[[Any, Any, SFTBatch], tuple[Any, Any, dict[str, jax.Array]]]:
    """``step(params, opt_state, batch) -> (params, opt_state, {"nll", "tokens"})`` (jitted)."""
    def loss(params, batch):
        total, count = nll_sum(graphdef, params, batch)
        return total / jnp.maximum(count, 1.0), count

    @jax.jit
    def step(params, opt_state, batch):
        (value, count), grads = jax.value_and_grad(loss, has_aux=True)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"nll": value, "tokens": count}

    return step


def batch_width(trajectory: Trajectory, multiple: int = 64) -> int:
    """The recorded length every row fits in, rounded up to ``multiple`` (the record may be
    much longer than any conversation; training on the padding would waste compute)."""
    used = int(np.max(np.sum(np.asarray(trajectory.token_mask), axis=1), initial=1))
    return min(-(-used // multiple) * multiple, np.asarray(trajectory.tokens).shape[1])


def sft_batches(trajectory: Trajectory, batch_size: int, epochs: int, seed: int):
    """``(epoch, SFTBatch)`` over shuffled rows; the last batch of an epoch is padded with
    all-zero-mask rows, so every batch has the same shape."""
    width = batch_width(trajectory)
    tokens = np.asarray(trajectory.tokens)[:, :width]
    token_mask = np.asarray(trajectory.token_mask)[:, :width]
    loss_mask = np.asarray(trajectory.loss_mask)[:, :width]
    rows = np.flatnonzero(np.asarray(trajectory.row_mask) & loss_mask.any(axis=1))
    rng = np.random.default_rng(seed)
    for epoch in range(epochs):
        order = rng.permutation(rows)
        for start in range(0, len(order), batch_size):
            take = order[start:start + batch_size]
            pad = batch_size - len(take)
            pick = lambda x: np.concatenate([x[take], np.zeros((pad, width), x.dtype)])  # noqa: E731
            yield epoch, SFTBatch(pick(tokens), pick(token_mask), pick(loss_mask))


def num_sft_steps(num_rows: int, batch_size: int, epochs: int) -> int:
    return epochs * -(-num_rows // batch_size)


def warm_start(model: nnx.Module, demos: Trajectory, *, batch_size: int, epochs: int,
               learning_rate: float, weight_decay: float = 0.0, seed: int = 0,
               on_step: Callable[[int, dict[str, float]], None] | None = None) -> tuple[Any, list[dict]]:
    """Behaviour-clone ``demos`` into ``model``'s parameters (AdamW with a cosine decay).

    Returns ``(params, history)``; ``history`` has one ``{"step", "epoch", "nll"}`` per step.
    """
    graphdef, params = nnx.split(model)
    rows = int(np.sum(np.asarray(demos.row_mask) & np.asarray(demos.loss_mask).any(axis=1)))
    if rows == 0:
        raise ValueError("warm_start: no demonstration has a response token to learn from")
    total = num_sft_steps(rows, batch_size, epochs)
    schedule = optax.cosine_decay_schedule(learning_rate, max(total, 1), alpha=0.1)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(schedule, weight_decay=weight_decay))
    opt_state = optimizer.init(params)
    step = make_sft_step(graphdef, optimizer)
    history = []
    for i, (epoch, batch) in enumerate(sft_batches(demos, batch_size, epochs, seed)):
        params, opt_state, metrics = step(params, opt_state, batch)
        record = {"step": i + 1, "epoch": epoch, "nll": float(metrics["nll"])}
        history.append(record)
        if on_step is not None:
            on_step(i + 1, record)
    return params, history
