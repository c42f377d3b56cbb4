"""A local cluster for tests: ``N`` processes of one script, each with ``D`` fake CPU devices,
joined through jax's distributed runtime (:mod:`agentrl_jax.distributed`).

:func:`launch` starts them with ``--coordinator localhost:PORT --num-processes N
--process-id I`` appended to the script's arguments (and ``XLA_FLAGS`` giving each ``D``
devices), waits for all, and returns each process's exit code and output; a cluster still
running after ``timeout`` seconds is killed (the test then fails on its codes, never hangs).

With several processes, process ``i`` is pinned to CPU ``i`` (modulo the CPUs this process
may use), so each runs its XLA thread pools on one core: on a 2-core CI machine two children
with a pool per core each, beside the other test worker, otherwise pre-empt each other. In
the suite (``-n 2``) the killed-process reproduction test took 123 s unpinned (2026-12-04,
when the code end-to-end test took 150-175 s) and 116 s pinned on a day this machine ran
about 2x slower (the code end-to-end test: 339 s).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

from fake_devices import fake_devices_env


@dataclasses.dataclass
class Finished:
    code: int | None  # None: killed at the timeout
    output: str
    seconds: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def slurm_job() -> int:
    """A SLURM job id whose coordinator port (jax: ``id % 4096 + 61440``) is free here."""
    for port in range(61440 + os.getpid() % 4096, 61440 + 4096):
        with socket.socket() as s:
            try:
                s.bind(("localhost", port))
            except OSError:
                continue
            return port - 61440
    raise RuntimeError("no free port in 61440..65535")


def _pinned(i: int) -> Callable[[], None]:
    """Run in the child before it starts: keep it to one of the CPUs this process may use."""
    cpus = sorted(os.sched_getaffinity(0))
    cpu = cpus[i % len(cpus)]
    return lambda: os.sched_setaffinity(0, {cpu})


def launch(
    script: str | Path,
    args: Sequence[str],
    *,
    processes: int,
    devices: int,
    timeout: float = 300.0,
    kill: tuple[int, Callable[[], bool]] | None = None,
    slurm: bool = False,
) -> list[Finished]:
    """Run ``script args`` as a cluster of ``processes`` x ``devices`` (module docstring).
    ``kill=(i, when)``: SIGKILL process ``i`` as soon as ``when()`` is true (polled every
    20 ms), as a lost host. ``slurm``: instead of the cluster flags, each process gets the
    variables ``srun`` sets (one node, ``localhost``) and ``--cluster-auto``, so jax finds
    the cluster itself."""
    port = free_port()
    job = slurm_job() if slurm else None
    began = time.monotonic()
    running, logs = [], []
    for i in range(processes):
        env = fake_devices_env(devices)
        if slurm:
            env.update(
                SLURM_JOB_ID=str(job),
                SLURM_STEP_NODELIST="localhost",
                SLURM_NTASKS=str(processes),
                SLURM_PROCID=str(i),
                SLURM_LOCALID=str(i),
                SLURM_STEP_NUM_NODES="1",
            )
            cluster = ["--cluster-auto"]
        else:
            cluster = (
                [
                    "--coordinator",
                    f"localhost:{port}",
                    "--num-processes",
                    str(processes),
                    "--process-id",
                    str(i),
                ]
                if processes > 1
                else []
            )
        logs.append(tempfile.TemporaryFile("w+"))  # a pipe could fill and block the child
        running.append(
            subprocess.Popen(
                [sys.executable, str(script), *args, *cluster],
                env=env,
                stdout=logs[i],
                stderr=subprocess.STDOUT,
                text=True,
                preexec_fn=_pinned(i) if processes > 1 else None,
            )
        )
    codes: list[tuple[int | None, float] | None] = [None] * processes
    while any(c is None for c in codes):
        if kill is not None and codes[kill[0]] is None and kill[1]():
            running[kill[0]].send_signal(signal.SIGKILL)
            kill = None
        for i, child in enumerate(running):
            if codes[i] is None and child.poll() is not None:
                codes[i] = (child.returncode, time.monotonic() - began)
        if time.monotonic() - began > timeout:
            for i, child in enumerate(running):
                if codes[i] is None:
                    child.kill()
                    child.wait()
                    codes[i] = (None, time.monotonic() - began)
        time.sleep(0.02)
    out = []
    for (code, seconds), log in zip(codes, logs):
        log.seek(0)
        out.append(Finished(code, log.read(), seconds))
        log.close()
    return out
