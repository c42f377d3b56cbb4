"""Weight sync: the trainer's parameters, as the sampler reads them, copied device to device.

The sampler decodes from its own copy of the parameters, in its own layout
(:func:`~agentrl_jax.sharding.generation_params`: the model's compute dtype, laid out for
decode) and on its own devices: the training devices (colocated, the default) or devices that
only sample (``mesh.rollout``). :func:`sync_weights` makes that copy without a trip through
host memory, and never as an alias of its input, so the train step may donate the state it
came from while the copy samples the next batches (asynchronous training):

* one process: the cast to the compute dtype and one jitted copy into the sampler's
  shardings on the same devices; onto rollout devices of their own, each parameter whole on
  one training device, copied from there to each rollout device, laid out there;
* several processes (the parameters on a mesh spanning them; each process samples on its own
  devices): one jitted copy, cast, whose output is replicated over the training mesh (XLA's
  all-gather across processes), then this process's shards as an array on its own devices,
  then as for one process. The replicated intermediate is one copy in the
  compute dtype per device, what the sampler's decode layout holds anyway.

Tests run it on 2 processes x 4 devices and onto rollout devices of their own under
``jax.transfer_guard_device_to_host`` and ``_host_to_device`` at ``"disallow_explicit"``.
Every jitted copy is cached per (tree, layout, dtype): nothing compiles again per update.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from agentrl_jax.sharding import (
    QWEN3_PARAM_RULES,
    generation_rules,
    resolve_layout,
    tree_shardings,
)


def sampler_shardings(params: Any, mesh: Mesh | None, layout: str, device: Any = None) -> Any:
    """Where the sampler reads each parameter from: a ``NamedSharding`` per leaf on ``mesh``
    (its generation layout, :func:`~agentrl_jax.sharding.generation_rules`; the training rules
    for ``layout="training"``), or ``device`` (default: this process's first) without one."""
    if mesh is None:
        one = jax.sharding.SingleDeviceSharding(device or jax.local_devices()[0])
        return jax.tree.map(lambda _: one, params)
    rules = QWEN3_PARAM_RULES
    if resolve_layout(layout, mesh) != "training":
        rules = generation_rules(rules)
    return tree_shardings(params, mesh, rules)


def sync_weights(
    params: Any,
    mesh: Mesh | None = None,
    *,
    layout: str = "auto",
    device: Any = None,
    dtype: Any = None,
) -> Any:
    """A copy of ``params`` (the train state's, anywhere) where the sampler reads them: on
    ``mesh`` (this process's devices) in ``layout``, or on ``device``; floating leaves cast to
    ``dtype`` if given. Device to device only (module docstring); never aliases ``params``."""
    dtype = None if dtype is None else jnp.dtype(dtype)
    leaves = jax.tree.leaves(params)
    if leaves and not all(x.is_fully_addressable for x in leaves):
        params, dtype = _this_process_copy(params, dtype), None  # cast on the way
    targets = sampler_shardings(params, mesh, layout, device)
    if all(
        x.sharding.device_set == t.device_set
        for x, t in zip(jax.tree.leaves(params), jax.tree.leaves(targets))
    ):  # a reshard on the same devices: one jitted copy (device_put might go via the host)
        return _copy_into(params, jax.tree.leaves(targets), dtype)
    return _onto_other_devices(params, targets, dtype)


def _copy_into(params: Any, shardings: Any, dtype: Any = None) -> Any:
    """``params`` copied (floating leaves cast to ``dtype`` if given) into ``shardings``, a
    list of one per leaf, on the devices ``params`` lie on: one jitted program."""
    return copier(jax.tree.structure(params), tuple(shardings), dtype)(params)


@functools.lru_cache(maxsize=16)
def copier(treedef: Any, shardings: tuple[Any, ...], dtype: Any = None) -> Any:
    """The jitted copy of a ``treedef`` tree into ``shardings`` (one per leaf), floating
    leaves cast to ``dtype`` if given; cached, so each layout compiles once. ``plan``
    compiles the weight sync's program from it."""

    def copy(x):  # always a copy_p: an output that is its input would alias it (no copy)
        if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(dtype)
        return jnp.copy(x)

    return jax.jit(
        lambda tree: jax.tree.map(copy, tree), out_shardings=jax.tree.unflatten(treedef, shardings)
    )


def _onto_other_devices(params: Any, targets: Any, dtype: Any = None) -> Any:
    """``params`` copied onto the devices of ``targets`` (the rollout devices of a split
    mesh), device to device: each leaf whole on one of its devices (a jitted all-gather where
    it is split, cast there), copied from there to every target device (``device_put`` between
    two single devices, which never goes through the host, unlike one between two meshes),
    assembled as an array replicated over them, then laid out by one jitted copy there."""

    def replicated(x):
        if isinstance(x.sharding, NamedSharding) and not x.is_fully_replicated:
            return NamedSharding(x.sharding.mesh, P())
        return x.sharding

    params = _copy_into(params, [replicated(x) for x in jax.tree.leaves(params)], dtype)

    def spread(x, target):
        one = x.addressable_data(0) if len(x.sharding.device_set) > 1 else x
        devices = sorted(target.device_set, key=lambda d: d.id)
        copies = [jax.device_put(one, d, may_alias=False) for d in devices]
        if len(devices) == 1:
            return copies[0]
        sharding = NamedSharding(Mesh(np.array(devices), ("local",)), P())
        return jax.make_array_from_single_device_arrays(x.shape, sharding, copies)

    spread_out = jax.tree.map(spread, params, targets)
    if all(x.sharding == t for x, t in zip(jax.tree.leaves(spread_out), jax.tree.leaves(targets))):
        return spread_out
    return _copy_into(spread_out, jax.tree.leaves(targets))


def _this_process_copy(params: Any, dtype: Any = None) -> Any:
    """``params`` laid out across processes as whole arrays on this process's devices: an
    all-gather on device (a jitted copy, cast to ``dtype`` if given, replicated over the
    parameters' devices), then this process's shards of it as an array replicated over its
    own devices."""

    def gather(x):
        if not isinstance(x.sharding, NamedSharding):
            raise ValueError(
                f"sync_weights: a leaf across processes must be on a mesh, got {x.sharding}"
            )
        return NamedSharding(x.sharding.mesh, P())

    replicated = _copy_into(params, [gather(x) for x in jax.tree.leaves(params)], dtype)

    def local(x):
        shards = x.addressable_shards
        devices = np.array([s.device for s in shards])
        sharding = NamedSharding(Mesh(devices, ("local",)), P())
        return jax.make_array_from_single_device_arrays(x.shape, sharding, [s.data for s in shards])

    return jax.tree.map(local, replicated)
