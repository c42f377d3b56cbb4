"""DAPO dynamic sampling on the host: a batch of varied groups, assembled from rollout batches.

DAPO (Yu et al. 2025, arXiv:2503.14476, §3.2; verl's ``recipe/dapo``) trains only on groups
whose rewards are not all equal (:func:`~agentrl_jax.algorithms.dynamic_sampling_keep`): a
group where every trajectory succeeded, or every one failed, has zero group-relative
advantage and would only dilute a token-mean loss. It keeps rolling out further task batches
until the batch is full of such groups, then cuts it to the usual size. The filter reads
episode rewards only: for episode-level group estimators (``grpo``, ``dr_grpo``, ``rloo``)
the dropped groups are exactly those with zero advantage; under GiGPO's step groups or GAE
an all-equal group can still carry a step-level signal, which the filter discards too.

The loop (:mod:`agentrl_jax.train.loop`) draws up to ``max_rollout_batches`` rollout
batches per update, each with its own key and the next data position, and stops as soon as
the kept groups fill the batch; :func:`assemble` then builds the batch the step trains on:

* the first kept groups, whole, in the order they were drawn, up to the batch's ``N`` rows
  (:func:`pack`; a group that does not fit the rows left is passed over);
* if too few were kept (after ``max_rollout_batches`` draws), the remaining rows are filler:
  rows of the first batch with ``row_mask`` False, so they take no part in the loss, the
  advantages or any denominator (verl raises or keeps sampling; here the update always
  happens, on fewer groups, and the metrics say so);
* group ids renumbered ``0, 1, ...`` (ids of different rollout batches may coincide), every
  field (process scores too) taken along with its rows, widths padded to the widest batch.

So the step always sees ``N`` rows: one compiled program, however many groups were dropped.
Everything here is plain numpy on the host, between the rollout and the update.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from agentrl_jax.algorithms import dynamic_sampling_keep
from agentrl_jax.train.batch import TrainBatch
from agentrl_jax.train.rewards import shaped_rewards
from agentrl_jax.trajectory import TOKEN_FIELDS, Trajectory, concatenate_rows


@dataclasses.dataclass(frozen=True)
class Draw:
    """One rollout batch and what dynamic sampling needs of it: ``keep [N]`` bool (rows of
    kept groups, :func:`~agentrl_jax.algorithms.dynamic_sampling_keep`) and its process
    scores ``[N, T]`` (or None)."""

    trajectory: Trajectory
    keep: np.ndarray
    step_scores: np.ndarray | None = None


def kept_groups(draw: Draw) -> list[np.ndarray]:
    """The kept groups of one draw, each as its row indices, in order of first appearance."""
    keep = np.asarray(draw.keep, bool)
    groups = np.asarray(draw.trajectory.group_id)
    order = []
    for g in groups[keep]:
        if g not in order:
            order.append(g)
    return [np.flatnonzero(keep & (groups == g)) for g in order]


def pack(draws: list[Draw], rows: int) -> tuple[list[int], list[int]]:
    """``(chosen, group_of)``: the kept groups that go into a batch of ``rows`` rows, whole, in
    draw order (a group that no longer fits is passed over): their row indices into the
    draws' rows one after another, and each chosen row's new group number."""
    offsets = np.cumsum([0] + [d.trajectory.row_mask.shape[0] for d in draws])
    chosen, group_of = [], []
    for draw, offset in zip(draws, offsets):
        for members in kept_groups(draw):
            if len(chosen) + len(members) <= rows:
                group_of += [len(set(group_of))] * len(members)
                chosen += [int(i) for i in offset + members]
    return chosen, group_of


def packed_rows(draws: list[Draw], rows: int) -> int:
    """Rows :func:`assemble` fills with kept groups (the loop stops drawing once it is ``rows``)."""
    return len(pack(draws, rows)[0])


def assemble(draws: list[Draw]) -> tuple[Trajectory, np.ndarray | None, dict[str, float]]:
    """The batch to train on from ``draws`` (see the module docstring): ``(trajectory,
    step_scores or None, metrics)``, with as many rows as the first draw.

    metrics: ``dynamic_sampling/rollout_batches`` (draws used), ``/kept_groups`` (groups
    trained on), ``/dropped_groups`` (all-equal groups seen), ``/filler_rows`` (masked rows
    that fill a batch short of kept groups).
    """
    first = draws[0]
    rows = first.trajectory.row_mask.shape[0]
    chosen, group_of = pack(draws, rows)
    groups_seen = sum(
        len(np.unique(np.asarray(d.trajectory.group_id)[np.asarray(d.trajectory.row_mask, bool)]))
        for d in draws
    )
    kept = len(set(group_of))
    filler = rows - len(chosen)
    # filler: rows of the first draw not chosen, masked out (any rows would do: they are not real)
    taken = set(chosen)
    unused = [i for i in range(rows) if i not in taken][:filler]
    index = np.asarray(chosen + unused, np.int64)
    merged = concatenate_rows([d.trajectory for d in draws])
    picked = jax.tree.map(lambda x: np.take(x, index, axis=0), merged)
    # as wide as the draws rows were taken from (the first gives the filler), not wider
    sizes = np.cumsum([d.trajectory.row_mask.shape[0] for d in draws])
    width = max(
        draws[int(np.searchsorted(sizes, i, side="right"))].trajectory.tokens.shape[1]
        for i in index
    )
    picked = picked.replace(**{f: getattr(picked, f)[:, :width] for f in TOKEN_FIELDS})
    row_mask = np.arange(rows) < len(chosen)
    group_id = np.concatenate(
        [np.asarray(group_of, np.int32), kept + np.arange(filler, dtype=np.int32)]
    )
    trajectory = picked.replace(
        row_mask=row_mask & np.asarray(picked.row_mask, bool), group_id=group_id
    )
    scores = None
    if first.step_scores is not None:
        scores = np.take(np.concatenate([np.asarray(d.step_scores) for d in draws]), index, axis=0)
        scores = np.where(row_mask[:, None], scores, 0.0).astype(np.float32)
    metrics = {
        "dynamic_sampling/rollout_batches": float(len(draws)),
        "dynamic_sampling/kept_groups": float(kept),
        "dynamic_sampling/dropped_groups": float(
            groups_seen - sum(len(kept_groups(d)) for d in draws)
        ),
        "dynamic_sampling/filler_rows": float(filler),
    }
    return trajectory, scores, metrics


def varied_groups(trajectory: Trajectory, step_scores: Any, config: Any) -> np.ndarray:
    """``bool[N]``: the rows of groups whose rewards vary (DAPO's filter,
    :func:`~agentrl_jax.algorithms.dynamic_sampling_keep`, on the rewards the step will
    train on, :func:`~agentrl_jax.train.rewards.shaped_rewards`). Computed on the host's CPU
    device from an explicit copy: the batch itself stays on the host until the step places
    it."""
    cpu = jax.local_devices(backend="cpu")[0]
    batch = jax.device_put(TrainBatch(trajectory, step_scores), cpu)
    with jax.default_device(cpu):
        return np.asarray(_varied_groups(batch, config))


@functools.partial(jax.jit, static_argnums=1)
def _varied_groups(batch: TrainBatch, config: Any) -> jax.Array:
    episode, _ = shaped_rewards(batch, config)
    return dynamic_sampling_keep(
        episode, batch.trajectory.group_id, batch.trajectory.row_mask.astype(bool)
    )
