"""Several processes, one program: jax's multi-controller runtime (PAPER.md §4).

A TPU pod slice or a GPU cluster runs one process per host. Each calls :func:`initialize`
(jax's own distributed runtime: a coordinator, heartbeats, collectives; no home-made
coordination), after which ``jax.devices()`` lists every process's devices and a mesh built
from them (:func:`agentrl_jax.sharding.build_mesh`, processes laid along ``data``) is global.
Every process then runs the same program:

* a batch's rows are split by process (:func:`process_rows`): each process supplies the rows
  its devices hold and :func:`global_batch` makes one global array of them
  (``jax.make_array_from_process_local_data``), so the jitted train step runs on the global
  mesh as it does on one host;
* :func:`host_value` brings a global array back to every host (an all-gather where it is
  not fully addressable), e.g. parameters to save or metrics to log;
* side effects that must happen once (metrics, reports, ``phases.json``) are written by the
  main process only (:func:`is_main`); Orbax checkpoints are written and restored by every
  process together (:mod:`agentrl_jax.train.checkpoint`).

Rollouts run on each process's own devices (:func:`local_mesh`): a
:class:`~agentrl_jax.rollout.MultiTurnRollout` whose config asks it to split its rows
(``RolloutConfig.split_processes``) plays only this process's share of them
(:func:`row_shares`) and then gathers the other processes' rows (:func:`allgather_blobs`, over
one of the policy's devices per process, :func:`peer_devices`: on rollout devices of their own
the gather waits for nothing the training devices run), so every process holds the whole
result, the same as one process would have made: a row's samples are keyed by its index in
the whole batch, never by which process played it. Sums over the devices in an order that
does not depend on the process count: :mod:`agentrl_jax.ordered_sums` (``mesh.ordered_sums``).

Launching: ``ClusterConfig(coordinator="host:port", num_processes=N, process_id=i)`` for a
hand-started cluster (several processes on one machine test the same code path a pod takes,
each with its own fake CPU devices), or ``ClusterConfig(auto=True)`` where jax detects the
cluster itself (Cloud TPU pods, SLURM). When a process dies, the others' next collective fails
and jax's heartbeat ends them within ``heartbeat_timeout_s``: no process waits forever.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import math
import os
import re
import sys
import traceback
from typing import Any, Iterator

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from agentrl_jax.errors import ConfigError
from agentrl_jax.sharding import MeshConfig, build_mesh, per_process_mesh_shape

_ADDRESS = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+:\d{1,5}$")


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """How this process joins the others (module docstring). All of ``coordinator``,
    ``num_processes`` and ``process_id`` (a hand-started cluster), or ``auto`` (jax detects
    the cluster), or none of them (one process, nothing to join)."""

    coordinator: str | None = None  # "host:port" of process 0's coordinator service
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False
    heartbeat_timeout_s: int = 100  # a process silent this long is taken as dead
    init_timeout_s: int = 300  # how long to wait for every process to join

    def __post_init__(self):
        given = [
            f
            for f in ("coordinator", "num_processes", "process_id")
            if getattr(self, f) is not None
        ]
        if given and len(given) < 3:
            missing = sorted({"coordinator", "num_processes", "process_id"} - set(given))
            raise ConfigError(
                f"cluster: {', '.join(given)} given without {', '.join(missing)}: "
                "a hand-started cluster needs all three"
            )
        if given and self.auto:
            raise ConfigError(
                "cluster: auto detects the coordinator and process ids itself; "
                "give either auto or coordinator / num_processes / process_id"
            )
        if self.coordinator is not None and not _ADDRESS.match(self.coordinator):
            raise ConfigError(f"cluster.coordinator: must be HOST:PORT, got {self.coordinator!r}")
        n, i = self.num_processes, self.process_id
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ConfigError(f"cluster.num_processes: must be an int >= 1, got {n!r}")
        if i is not None and (isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n):
            raise ConfigError(f"cluster.process_id: must be an int in [0, {n}), got {i!r}")
        for name in ("heartbeat_timeout_s", "init_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"cluster.{name}: must be an int >= 1, got {value!r}")

    @property
    def enabled(self) -> bool:
        return self.auto or self.coordinator is not None


def initialize(config: ClusterConfig) -> None:
    """Join the cluster ``config`` describes (nothing for a single process). Must run before
    anything else touches jax's devices. On CPU the collectives go through gloo."""
    if not config.enabled:
        return
    if jax.config.jax_platforms in (None, "", "cpu") or "cpu" in str(jax.config.jax_platforms):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    options = dict(
        initialization_timeout=config.init_timeout_s,
        heartbeat_timeout_seconds=config.heartbeat_timeout_s,
    )
    if config.auto:
        jax.distributed.initialize(**options)
    else:
        jax.distributed.initialize(
            config.coordinator,
            num_processes=config.num_processes,
            process_id=config.process_id,
            **options,
        )


@contextlib.contextmanager
def fail_fast() -> Iterator[None]:
    """Around a multi-process program: an exception in this process prints its traceback and
    ends the process at once (exit code 1), so the others' next collective fails on the lost
    peer within seconds, instead of this process waiting in jax's shutdown barrier for
    processes that wait in a collective for it. One process: exceptions propagate."""
    try:
        yield
    except BaseException as error:
        if not is_multiprocess() or isinstance(error, SystemExit) and error.code in (0, None):
            raise
        traceback.print_exc()
        print(
            f"process {jax.process_index()} failed; ending it so the others stop too",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(1)


def is_main() -> bool:
    """Whether this process writes what is written once (logs, reports, ``phases.json``)."""
    return jax.process_index() == 0


def process_rows(rows: int, mesh: Mesh) -> slice:
    """The rows of a ``rows``-row batch this process supplies: processes lie along the batch
    axes in order (:func:`agentrl_jax.sharding.build_mesh`), each holding an equal share."""
    processes = len({d.process_index for d in mesh.devices.flat})
    if rows % processes:
        raise ValueError(f"a batch of {rows} rows does not split over {processes} processes")
    share = rows // processes
    index = sorted({d.process_index for d in mesh.devices.flat}).index(jax.process_index())
    return slice(index * share, (index + 1) * share)


def global_batch(tree: Any, mesh: Mesh, spec: P, *, whole: bool = True) -> Any:
    """Every leaf (``[rows, ...]`` host arrays) as one global array split by rows with
    ``spec`` over ``mesh``. ``whole``: every process holds the whole batch (each contributes
    its :func:`process_rows`); else each holds only its own rows."""

    def place(x):
        x = np.asarray(x)
        sharding = NamedSharding(mesh, P(*spec, *([None] * (x.ndim - len(spec)))))
        local = x[process_rows(x.shape[0], mesh)] if whole else x
        return jax.make_array_from_process_local_data(sharding, local)

    return jax.tree.map(place, tree)


def host_value(tree: Any) -> Any:
    """Every leaf as a host NumPy array on every process (gathered across processes where a
    leaf is not fully addressable from this one)."""

    def fetch(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            if x.is_fully_replicated:
                return np.asarray(x.addressable_data(0))
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(fetch, tree)


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def barrier(name: str) -> None:
    """Every process waits here until all have arrived (e.g. until the main process has
    written a file the others read next). A no-op for one process."""
    if is_multiprocess():
        multihost_utils.sync_global_devices(name)


def local_mesh(mesh: Mesh | None) -> Mesh | None:
    """This process's part of the global ``mesh`` (processes lie along ``data``): the mesh
    rollouts and evaluation run on. ``mesh`` itself for one process; None where this process
    has one device."""
    if mesh is None or not is_multiprocess():
        return mesh
    shape = per_process_mesh_shape(
        tuple(mesh.shape[a] for a in mesh.axis_names), jax.process_count()
    )
    if math.prod(shape) == 1:
        return None
    return build_mesh(MeshConfig(**dict(zip(mesh.axis_names, shape))), jax.local_devices())


def host_key(key: jax.Array) -> jax.Array:
    """A (typed) random key held by the global mesh as a key on this process's default
    device, for programs that run on local devices."""
    if not is_multiprocess():
        return key
    data = jax.random.key_data(key)
    if data.is_fully_replicated:  # this process's copy, device to device
        data = data.addressable_data(0)
    else:
        data = host_value(data)
    return jax.random.wrap_key_data(
        jax.device_put(data, jax.local_devices()[0]), impl=jax.random.key_impl(key)
    )


# ---------------------------------------------------------------- rollouts split by process


def row_shares(rows: int) -> list[np.ndarray] | None:
    """With several processes, the row indices each process plays of a ``rows``-row batch
    (contiguous, as equal as they can be; a process may get none); None for one process. A
    rollout asked to split its rows (``RolloutConfig.split_processes``) plays its share."""
    if not is_multiprocess():
        return None
    return np.array_split(np.arange(rows), jax.process_count())


def peer_devices(device: Any) -> list[Any]:
    """One device per process, in process order: ``device`` (one of this process's) for this
    process and, for every other, its device at the same position among its own (as
    ``jax.devices()`` lists them). Every process names the same list when each passes its
    device at the same position, e.g. the first of its rollout devices (``mesh.rollout``: the
    last devices of each process)."""
    processes = sorted({d.process_index for d in jax.devices()})
    own = [d for d in jax.devices() if d.process_index == jax.process_index()]
    at = own.index(device)
    return [[d for d in jax.devices() if d.process_index == p][at] for p in processes]


def _process_allgather(x: np.ndarray, devices: list[Any] | None) -> np.ndarray:
    """``[processes, *x.shape]``: every process's ``x``, over ``devices`` (one per process,
    :func:`peer_devices`) only, or over every device (None)."""
    if devices is None:
        return np.asarray(multihost_utils.process_allgather(x)).reshape(-1, *x.shape)
    mesh, replicate = _replicator(tuple(devices))
    here = [i for i, d in enumerate(devices) if d.process_index == jax.process_index()]
    local = jax.device_put(x[None], devices[here[0]])
    whole = jax.make_array_from_single_device_arrays(
        (len(devices), *x.shape), NamedSharding(mesh, P("processes")), [local]
    )
    return np.asarray(replicate(whole).addressable_data(0))


@functools.lru_cache(maxsize=8)
def _replicator(devices: tuple[Any, ...]) -> tuple[Mesh, Any]:
    """A mesh over ``devices`` and the jitted copy of an array split over it to every one of
    them (one per device set: compiled once per shape)."""
    mesh = Mesh(np.array(devices, dtype=object), ("processes",))
    return mesh, jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, P()))


def allgather_blobs(
    arrays: dict[str, np.ndarray], texts: Any, device: Any = None
) -> list[tuple[dict[str, np.ndarray], Any]]:
    """Every process's ``(arrays, texts)`` (NumPy arrays by name, and JSON-able values), in
    process order: one blob per process (``.npz`` without pickles, the JSON as bytes), of any
    size, through jax's collectives: over every device, or with ``device`` (this process's,
    at the same position among its devices as every other process's) over those devices
    only (:func:`peer_devices`), so the gather waits for nothing the other devices run (a
    rollout's gather on the rollout devices, beside the update in flight on the training
    devices)."""
    devices = None if device is None else peer_devices(device)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays, __texts__=np.frombuffer(json.dumps(texts).encode(), np.uint8))
    blob = np.frombuffer(buffer.getvalue(), np.uint8)
    sizes = _process_allgather(np.array([blob.size], np.int64), devices).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: blob.size] = blob
    blobs = _process_allgather(padded, devices).reshape(len(sizes), -1)
    out = []
    for blob, size in zip(blobs, sizes):
        with np.load(io.BytesIO(blob[:size].tobytes()), allow_pickle=False) as data:
            named = {k: data[k] for k in data.files if k != "__texts__"}
            out.append((named, json.loads(data["__texts__"].tobytes().decode())))
    return out
