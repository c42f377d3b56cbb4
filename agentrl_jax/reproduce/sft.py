"""Supervised warm-start: behaviour cloning on recorded trajectories (the reproduction's base).

The loss is the mean negative log-likelihood of the policy's own tokens (``loss_mask``: the
responses, stop tokens included) given everything before them, teacher-forced on the recorded
conversation -- the same tokens, positions and template the rollout produced. The step is one
jitted function of ``(params, opt_state, batch)``. Every batch has the same shape, so it compiles
once, unless ``group_by_length`` gives each batch its own width (long conversations: a few
compilations, and far less padding; see :func:`sft_batches`). On a mesh each batch's rows are
split over its batch axes, every process supplying its share (:func:`place_batch`), and with
``mesh.ordered_sums`` the gradient is added over the devices in a fixed order
(:func:`make_sft_step`), so any process count gives the same bits.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from agentrl_jax import distributed
from agentrl_jax.ordered_sums import ordered_over_rows
from agentrl_jax.sharding import BATCH_AXES, batch_shards
from agentrl_jax.train.scoring import Forward
from agentrl_jax.train.step import sequence_logprobs
from agentrl_jax.trajectory import Trajectory, bucket_width, row_lengths


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SFTBatch:
    """``tokens``, ``token_mask``, ``loss_mask``: ``[B, L]`` (rows of zero masks are padding)."""

    tokens: jax.Array
    token_mask: jax.Array
    loss_mask: jax.Array


def nll_sum(
    graphdef: nnx.GraphDef, params: Any, batch: SFTBatch, attention: str = "xla"
) -> tuple[jax.Array, jax.Array]:
    """``(sum of -log pi over loss-mask tokens, their count)`` -- unreduced, so micro-batches and
    devices add up exactly. ``attention``: the forward's implementation
    (:mod:`agentrl_jax.models.attention`; "blocked" keeps no ``L x L`` score matrix)."""
    model = nnx.merge(graphdef, params)
    logprobs, _ = sequence_logprobs(
        model, batch.tokens, batch.token_mask, forward=Forward(attention=attention)
    )
    mask = batch.loss_mask.astype(jnp.float32)
    return -jnp.sum(logprobs * mask), jnp.sum(mask)


def make_sft_step(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    attention: str = "xla",
    mesh: Mesh | None = None,
    ordered: bool = False,
    layout: tuple[Any, Any] | None = None,
) -> Callable[[Any, Any, SFTBatch], tuple[Any, Any, dict[str, jax.Array]]]:
    """``step(params, opt_state, batch) -> (params, opt_state, {"nll", "tokens"})`` (jitted).
    On a ``mesh`` the batch's rows are split over its batch axes (XLA sums the gradient over
    them); ``ordered``: each device sums its own rows' gradient, NLL and tokens, added over
    the devices in a fixed order (:mod:`agentrl_jax.ordered_sums`), then divided. ``layout``:
    the shardings of ``(params, opt_state)``, kept in the outputs (so the next step's inputs
    have the first's, and the step compiles once)."""

    def loss(params, batch):
        total, count = nll_sum(graphdef, params, batch, attention)
        return total / jnp.maximum(count, 1.0), count

    def sums(params, rows):  # -> ((grads, nll sum, tokens), no peaks), on this device's rows
        grad_fn = jax.value_and_grad(lambda p: nll_sum(graphdef, p, rows, attention), has_aux=True)
        (total, count), grads = grad_fn(params)
        return (grads, total, count), {}

    def step(params, opt_state, batch):
        if ordered and mesh is not None and batch_shards(mesh) > 1:
            (grads, total, count), _ = ordered_over_rows(sums, mesh, params, batch)
            denom = jnp.maximum(count, 1.0)
            value, grads = total / denom, jax.tree.map(lambda g: g / denom, grads)
        else:
            (value, count), grads = jax.value_and_grad(loss, has_aux=True)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"nll": value, "tokens": count}

    if layout is None or mesh is None:
        return jax.jit(step)
    return jax.jit(step, out_shardings=(*layout, NamedSharding(mesh, P())))


def place_batch(batch: SFTBatch, mesh: Mesh | None) -> SFTBatch:
    """``batch`` (every process's whole batch, on the host) as the step takes it: without a
    mesh as it is; on one, padded with all-zero-mask rows to a multiple of the mesh's batch
    shards and split over them, each process supplying its own rows
    (:func:`~agentrl_jax.distributed.global_batch`)."""
    if mesh is None:
        return batch
    shards = batch_shards(mesh)
    pad = -batch.tokens.shape[0] % shards
    if pad:
        batch = jax.tree.map(
            lambda x: np.concatenate([x, np.zeros((pad, *x.shape[1:]), x.dtype)]), batch
        )
    return distributed.global_batch(batch, mesh, (BATCH_AXES,))


LENGTH_WINDOW = 16  # batches per window sorted by length (group_by_length)


def batch_width(trajectory: Trajectory, multiple: int = 64) -> int:
    """The recorded length every row fits in, rounded up to ``multiple`` (the record may be
    much longer than any conversation; training on the padding would waste compute)."""
    used = int(np.max(row_lengths(trajectory.token_mask), initial=1))
    return min(-(-used // multiple) * multiple, np.asarray(trajectory.tokens).shape[1])


def batch_rows(
    order: np.ndarray,
    lengths: np.ndarray,
    batch_size: int,
    group_by_length: bool,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """One epoch's batches of row indices from the shuffled ``order``. With
    ``group_by_length`` each window of :data:`LENGTH_WINDOW` batches is sorted by length and cut,
    and the batches are then shuffled: rows of a batch have similar lengths, so a batch at its
    own width wastes little on padding (every row is still seen once per epoch)."""
    if not group_by_length:
        return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    window, batches = batch_size * LENGTH_WINDOW, []
    for start in range(0, len(order), window):
        chunk = order[start : start + window]
        chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))]


def sft_batches(
    trajectory: Trajectory, batch_size: int, epochs: int, seed: int, group_by_length: bool = False
):
    """``(epoch, SFTBatch)`` over shuffled rows; the last batch of an epoch (of a window, with
    ``group_by_length``) is padded with all-zero-mask rows, so every batch has ``batch_size``
    rows. Without ``group_by_length`` every batch has the record's width
    (:func:`batch_width`: one compilation); with it each batch has its own
    (:func:`~agentrl_jax.trajectory.bucket_width` of its longest row: a few compilations, and
    rows of similar lengths batched together, see :func:`batch_rows`)."""
    lengths = row_lengths(trajectory.token_mask)
    width = batch_width(trajectory)
    tokens = np.asarray(trajectory.tokens)[:, :width]
    token_mask = np.asarray(trajectory.token_mask)[:, :width]
    loss_mask = np.asarray(trajectory.loss_mask)[:, :width]
    rows = np.flatnonzero(np.asarray(trajectory.row_mask) & loss_mask.any(axis=1))
    rng = np.random.default_rng(seed)
    for epoch in range(epochs):
        order = rng.permutation(rows)
        for take in batch_rows(order, lengths, batch_size, group_by_length, rng):
            cols = bucket_width(int(lengths[take].max()), width) if group_by_length else width
            pad = batch_size - len(take)
            pick = lambda x: np.concatenate([x[take, :cols], np.zeros((pad, cols), x.dtype)])  # noqa: E731
            yield epoch, SFTBatch(pick(tokens), pick(token_mask), pick(loss_mask))


def num_sft_steps(
    num_rows: int, batch_size: int, epochs: int, group_by_length: bool = False
) -> int:
    """Optimizer steps of :func:`sft_batches` over ``num_rows`` rows."""
    if not group_by_length:
        return epochs * -(-num_rows // batch_size)
    window = batch_size * LENGTH_WINDOW
    full, rest = divmod(num_rows, window)
    return epochs * (full * LENGTH_WINDOW + -(-rest // batch_size))


def warm_start(
    model: nnx.Module,
    demos: Trajectory,
    *,
    batch_size: int,
    epochs: int,
    learning_rate: float,
    weight_decay: float = 0.0,
    seed: int = 0,
    group_by_length: bool = False,
    attention: str = "xla",
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    mesh: Mesh | None = None,
    ordered: bool = False,
) -> tuple[Any, list[dict]]:
    """Behaviour-clone ``demos`` into ``model``'s parameters (AdamW with a cosine decay).
    ``group_by_length``: see :func:`sft_batches`; ``attention``: see :func:`nll_sum`;
    ``mesh`` (the model's parameters placed on it) and ``ordered``: see :func:`make_sft_step`
    (with several processes, each supplies its share of every batch's rows).

    Returns ``(params, history)``; ``history`` has one ``{"step", "epoch", "nll"}`` per step.
    """
    graphdef, params = nnx.split(model)
    rows = int(np.sum(np.asarray(demos.row_mask) & np.asarray(demos.loss_mask).any(axis=1)))
    if rows == 0:
        raise ValueError("warm_start: no demonstration has a response token to learn from")
    total = num_sft_steps(rows, batch_size, epochs, group_by_length)
    schedule = optax.cosine_decay_schedule(learning_rate, max(total, 1), alpha=0.1)
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=weight_decay)
    )
    # on a mesh one program makes the optimizer's state, not one per leaf (each a
    # multi-process program, compiled and dispatched on its own)
    opt_state = optimizer.init(params) if mesh is None else jax.jit(optimizer.init)(params)
    layout = None
    if mesh is not None:  # as placed on the mesh; the rest (the step count): replicated
        layout = jax.tree.map(
            lambda x: (
                x.sharding
                if isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh
                else NamedSharding(mesh, P())
            ),
            (params, opt_state),
        )
        params, opt_state = jax.device_put((params, opt_state), layout)
    step = make_sft_step(graphdef, optimizer, attention, mesh, ordered, layout)
    history = []
    for i, (epoch, batch) in enumerate(
        sft_batches(demos, batch_size, epochs, seed, group_by_length)
    ):
        params, opt_state, metrics = step(params, opt_state, place_batch(batch, mesh))
        nll = distributed.host_value(metrics["nll"])
        record = {"step": i + 1, "epoch": epoch, "nll": float(nll)}
        history.append(record)
        if on_step is not None:
            on_step(i + 1, record)
    return params, history
