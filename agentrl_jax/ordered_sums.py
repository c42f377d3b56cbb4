"""Sums over a mesh's batch shards in a fixed order (``mesh.ordered_sums``): the same bits
whatever the number of processes the devices belong to.

A gradient (and a loss's numerator and denominator) is a sum over the batch's rows. Under
``jit`` XLA adds the devices' partial sums with an all-reduce whose order is the runtime's:
one process adds its devices' partials in one order, a cluster of processes (gloo, NCCL, ICI
across hosts) in another, so 2 processes x 4 devices and 1 process x 8 devices differ by float
rounding, which training amplifies (at 2 x 4 against 1 x 8, 3e-5 in the warm-started and
trained policies instead of agreeing to 1e-6).

Here every device first sums its own rows (the same program on the same rows, whichever
process it is in), then the ``D`` per-device partials are added in one fixed order over the
global index of the batch shard (``data`` major, the order the rows are split in): a binary
tree, pairs ``(0, 1), (2, 3), ...`` then pairs of those (:func:`tree_sum`). No arithmetic
depends on which process holds which device, so the result is the same bits for every
grouping of the ``D`` devices into processes.

The exchange moves no more than an all-reduce would (:func:`ordered_sum`), leaf by leaf: the
partial's ``D`` chunks scattered so that device ``j`` receives every device's chunk ``j``
(``all_to_all``, ``[D, size / D]``), the chunk summed in the fixed order, then the sums gathered
(``all_gather``, the whole sum on every device). Memory per device: the whole partial (the
gradient of the whole parameters) and the whole sum, each ``4 P`` bytes for ``P`` float32
parameters (Qwen3-4B, 4.02e9 parameters: 16.1 GB; Qwen3-8B, 8.19e9: 32.8 GB), and while a leaf
is exchanged two more buffers of its size: the largest leaf is a layer-stacked MLP weight
(``[36, 2560, 9728]`` for 4B: 3.6 GB; ``[36, 4096, 12288]`` for 8B: 7.2 GB). The fast path (an
all-reduce into the gradient's own buffer, or under FSDP a reduce-scatter of each layer's
gradient as the backward makes it) needs neither the whole sum beside the partial nor, under
FSDP, the parameters gathered whole on every device (``ordered_over_rows`` runs the partial on
the whole parameters): that is the cost. One process is already deterministic,
so ``mesh.ordered_sums`` is off by default; turn it on where runs on different process counts
must agree.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from agentrl_jax.sharding import BATCH_AXES

SMALL = 1 << 16  # leaves of fewer elements are exchanged together, one vector per dtype


def tree_sum(parts: Sequence[jax.Array]) -> jax.Array:
    """``parts[0] + parts[1] + ...`` as a fixed binary tree over their index: pairs ``(0, 1),
    (2, 3), ...`` (an odd last one carried up), then pairs of those, so the order of additions
    depends only on ``len(parts)``."""
    parts = list(parts)
    if not parts:
        raise ValueError("tree_sum: nothing to add")
    while len(parts) > 1:
        paired = [parts[i] + parts[i + 1] for i in range(0, len(parts) - 1, 2)]
        parts = paired + parts[len(parts) - len(parts) % 2 :]
    return parts[0]


def _axis_size(axes: Sequence[str]) -> int:
    return math.prod(jax.lax.axis_size(a) for a in axes)


def _ordered_vector(x: jax.Array, axes: tuple[str, ...], shards: int) -> jax.Array:
    """A 1-D ``x`` (each device's partial) summed over ``axes`` in :func:`tree_sum`'s order."""
    size = x.shape[0]
    chunk = -(-size // shards)
    x = jnp.pad(x, (0, chunk * shards - size)).reshape(shards, chunk)
    got = jax.lax.all_to_all(x, axes, 0, 0)  # row j: device j's partial of my chunk
    mine = tree_sum([got[j] for j in range(shards)])
    return jax.lax.all_gather(mine, axes, axis=0, tiled=True)[:size]


def ordered_sum(tree: Any, axes: tuple[str, ...] = BATCH_AXES) -> Any:
    """Inside ``shard_map`` with ``axes`` manual: every leaf of ``tree`` (this device's partial
    sum) summed over the devices of ``axes`` in a fixed order (module docstring); the result
    is the same on every device. Leaves of :data:`SMALL` or more elements go one by one; the
    smaller ones together, one vector per dtype."""
    shards = _axis_size(axes)
    leaves, treedef = jax.tree.flatten(tree)
    if shards == 1:
        return tree
    out: list[Any] = [None] * len(leaves)
    small: dict[Any, list[int]] = {}
    for i, leaf in enumerate(leaves):
        if leaf.size >= SMALL:
            out[i] = _ordered_vector(leaf.reshape(-1), axes, shards).reshape(leaf.shape)
        else:
            small.setdefault(leaf.dtype, []).append(i)
    for indices in small.values():
        flat = jnp.concatenate([leaves[i].reshape(-1) for i in indices])
        summed, at = _ordered_vector(flat, axes, shards), 0
        for i in indices:
            out[i] = summed[at : at + leaves[i].size].reshape(leaves[i].shape)
            at += leaves[i].size
    return jax.tree.unflatten(treedef, out)


def ordered_over_rows(
    fn: Callable[..., tuple[Any, Any]],
    mesh: Mesh,
    replicated: Any,
    rows: Any,
) -> tuple[Any, Any]:
    """``fn(replicated, rows) -> (sums, peaks)`` run on each device's own rows (``rows``'
    leaves ``[N, ...]``, split over the mesh's batch axes; ``replicated`` whole on every
    device), its ``sums`` added over the devices by :func:`ordered_sum` and its ``peaks``
    by their maximum (exact in any order). Both come back replicated. Inside ``fn`` the batch
    axes are manual: it must not constrain activations to them (other axes stay XLA's)."""

    def local(replicated, rows):
        sums, peaks = fn(replicated, rows)
        return ordered_sum(sums), jax.tree.map(lambda x: jax.lax.pmax(x, BATCH_AXES), peaks)

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), P(BATCH_AXES)),
        out_specs=P(),
        axis_names=set(BATCH_AXES),
        check_vma=False,
    )(replicated, rows)


__all__ = ["SMALL", "ordered_over_rows", "ordered_sum", "tree_sum"]
