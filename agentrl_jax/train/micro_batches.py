"""Micro-batching: a mini-batch's rows split into micro-batches, and gradients accumulated over
them exactly.

Micro-batches are strided: micro-batch ``m`` holds rows ``m, m + M, m + 2M, ...``. With rows
split contiguously over devices (the batch sharding along ``data``/``fsdp``), every device then
holds an equal share of every micro-batch and the split moves no data. Each micro-batch
contributes the gradient of its unreduced loss sum and its denominator; the sum of gradients is
divided once by the mini-batch's denominator, so the result is exactly the mini-batch gradient
for every aggregation mode (see :mod:`agentrl_jax.algorithms.aggregation`).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp


def split_micro_batches(tree: Any, num: int) -> Any:
    """``[N, ...]`` leaves -> ``[num, N / num, ...]``; micro-batch m holds rows m, m + num, ..."""

    def split(x):
        if x.shape[0] % num:
            raise ValueError(f"num_micro_batches={num} must divide the batch's {x.shape[0]} rows")
        return jnp.swapaxes(x.reshape(x.shape[0] // num, num, *x.shape[1:]), 0, 1)

    return jax.tree.map(split, tree)


def merge_micro_batches(tree: Any) -> Any:
    """Inverse of :func:`split_micro_batches`: ``[num, N / num, ...]`` -> ``[N, ...]``."""
    return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:]), tree)


def map_micro_batches(fn: Callable[[Any], Any], data: Any, num: int) -> Any:
    """``fn`` over micro-batches of ``data`` (``lax.map``), results reassembled row-aligned."""
    if num == 1:
        return fn(data)
    return merge_micro_batches(jax.lax.map(fn, split_micro_batches(data, num)))


def add_trees(a: Any, b: Any) -> Any:
    return jax.tree.map(jnp.add, a, b)


def accumulate_gradients(
    loss_fn: Callable[[Any, Any], tuple[jax.Array, Any]],
    params: Any,
    data: Any,
    num: int,
    combine: Callable[[Any, Any], Any] = add_trees,
) -> tuple[Any, Any]:
    """Sums ``grad(loss_fn)(params, micro_batch)`` over ``num`` micro-batches, and combines
    their aux with ``combine`` (default: summed; pass :class:`~agentrl_jax.algorithms.LossSum`
    parts). ``loss_fn(params, batch) -> (value to differentiate, aux pytree)``. One
    micro-batch skips the scan.
    """
    grad_fn = jax.grad(loss_fn, has_aux=True)
    if num == 1:
        return grad_fn(params, data)
    micro = split_micro_batches(data, num)

    def body(carry, batch):
        grads, aux = grad_fn(params, batch)
        return (add_trees(carry[0], grads), combine(carry[1], aux)), None

    first = jax.tree.map(lambda x: x[0], micro)
    zeros = jax.tree.map(
        lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(grad_fn, params, first)
    )
    total, _ = jax.lax.scan(body, zeros, micro)
    return total


def divide_tree(tree: Any, denom: jax.Array) -> Any:
    safe = jnp.where(denom > 0, denom, 1.0)
    return jax.tree.map(lambda g: jnp.where(denom > 0, g / safe, jnp.zeros_like(g)), tree)


def all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def keep_if(ok: jax.Array, new: Any, old: Any) -> Any:
    return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
