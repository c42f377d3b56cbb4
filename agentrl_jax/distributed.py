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

Launching: ``ClusterConfig(coordinator="host:port", num_processes=N, process_id=i)`` for a
hand-started cluster (several processes on one machine test the same code path a pod takes,
each with its own fake CPU devices), or ``ClusterConfig(auto=True)`` where jax detects the
cluster itself (Cloud TPU pods, SLURM). When a process dies, the others' next collective fails
and jax's heartbeat ends them within ``heartbeat_timeout_s``: no process waits forever.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from agentrl_jax.errors import ConfigError

_ADDRESS = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+:\d{1,5}$")


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """How this process joins the others (module docstring). All of ``coordinator``,
    ``num_processes`` and ``process_id`` (a hand-started cluster), or ``auto`` (jax detects
    the cluster), or none of them (one process, nothing to join)."""

    coordinator: str | None = None   # "host:port" of process 0's coordinator service
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False
    heartbeat_timeout_s: int = 100   # a process silent this long is taken as dead
    init_timeout_s: int = 300        # how long to wait for every process to join

    def __post_init__(self):
        given = [f for f in ("coordinator", "num_processes", "process_id")
                 if getattr(self, f) is not None]
        if given and len(given) < 3:
            missing = sorted({"coordinator", "num_processes", "process_id"} - set(given))
            raise ConfigError(f"cluster: {', '.join(given)} given without {', '.join(missing)}: "
                              "a hand-started cluster needs all three")
        if given and self.auto:
            raise ConfigError("cluster: auto detects the coordinator and process ids itself; "
                              "give either auto or coordinator / num_processes / process_id")
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
    options = dict(initialization_timeout=config.init_timeout_s,
                   heartbeat_timeout_seconds=config.heartbeat_timeout_s)
    if config.auto:
        jax.distributed.initialize(**options)
    else:
        jax.distributed.initialize(config.coordinator, num_processes=config.num_processes,
                                   process_id=config.process_id, **options)


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
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)
    return jax.tree.map(fetch, tree)
