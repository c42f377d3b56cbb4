"""Worker processes that run SQL queries where they can be killed (parent side).

SQLite checks a query's deadline only between virtual-machine instructions, so one expensive
function call (a huge ``printf`` width, ``instr`` or ``LIKE`` over long strings) can run far past
it while holding the thread that waits. So each query runs in a worker process
(:mod:`envs.sql.query_worker`), and the caller waits for its answer until the deadline plus
:data:`GRACE_S`; a worker that has not answered by then is killed (SIGKILL) and reaped, and the
query is reported as timed out, exactly as if the worker had stopped it itself. A worker that
dies (out of memory, a crash) gives an error result; neither case raises.

:class:`WorkerPool` keeps idle workers for reuse: a query takes an idle one or starts one, and
gives it back when the answer came in time; a killed worker is replaced by starting a fresh one
when a later query finds no idle worker. So concurrent queries (the rollout's worker threads)
each have a process of their own, and a query costs a pipe round trip; a start costs one
interpreter start-up (``python -I -S``, stdlib only: tens of milliseconds), paid before the
query's clock starts.

A worker's answer is one line of at most the request's byte cap
(:func:`~envs.sql.query_worker.response_cap`; the worker leaves out what does not fit and says
so): the caller reads at most that many bytes of it, and a longer line is an error, never
decoded, so a query cannot grow this process by more than about the cap (and the objects
decoded from it), whatever its result.

Workers run with ``-I`` (no environment variables, user site or working directory on the path)
and an address-space cap (``memory_bytes``). They exit when their stdin closes, so they do not
outlive this process; :func:`shutdown` (registered with ``atexit``) kills any that are left.
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import select
import subprocess
import sys
import threading
import time

from envs.sql import query_worker

GRACE_S = 0.1  # how long past its deadline a query's worker may take to stop it itself
START_TIMEOUT_S = 30.0  # a worker that is not ready by then is killed and its query fails
MEMORY_BYTES = 1 << 30  # address space of one worker process
MAX_IDLE = 16  # idle workers kept for reuse; more are closed when given back
_WORKER_FILE = str(pathlib.Path(query_worker.__file__).resolve())
_READ_CHUNK = 1 << 20


class _Worker:
    """One worker process and its pipes. Used by one thread at a time."""

    def __init__(self, memory_bytes: int):
        self.process = subprocess.Popen(
            [sys.executable, "-I", "-S", _WORKER_FILE, str(memory_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            close_fds=True,
        )
        try:
            ready = self.read_line(time.monotonic() + START_TIMEOUT_S, 1024)
        except (EOFError, OverflowError):
            ready = b"(it exited or wrote too much)"
        if ready != b'{"ready": true}':
            self.kill()
            raise OSError(
                "the SQL worker process did not start: "
                + ("no answer" if ready is None else f"it said {ready[:200]!r}")
            )

    def send(self, request: dict) -> None:
        """Write one request; raises ``OSError`` if the process is gone."""
        self.process.stdin.write(json.dumps(request, ensure_ascii=True).encode("ascii") + b"\n")

    def read_line(self, deadline: float, max_bytes: int) -> bytes | None:
        """The next line written (at most ``max_bytes`` bytes before its newline), or None once
        ``deadline`` (monotonic) passes. Reads at most ``max_bytes + 1`` bytes.

        Raises ``EOFError`` if the process closed its output (it died) and ``OverflowError``
        if the line is longer than ``max_bytes``.
        """
        fd = self.process.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        buffer = bytearray()
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if not poller.poll(max(1, int(remaining * 1000) + 1)):
                continue
            chunk = os.read(fd, min(_READ_CHUNK, max_bytes + 1 - len(buffer)))
            if not chunk:
                raise EOFError
            start = len(buffer)
            buffer += chunk
            end = buffer.find(b"\n", start)
            if end >= 0:
                return bytes(buffer[:end])
            if len(buffer) > max_bytes:
                raise OverflowError

    def kill(self) -> None:
        """SIGKILL the process, reap it and close its pipes."""
        try:
            self.process.kill()
        except OSError:
            pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:  # stuck in the kernel; Popen reaps it later
            pass
        self.close_pipes()

    def close(self) -> None:
        """Ask the process to exit (its stdin closes), then make sure it has."""
        self.close_pipes()
        try:
            self.process.wait(timeout=1)
        except subprocess.TimeoutExpired:
            self.kill()

    def close_pipes(self) -> None:
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class WorkerPool:
    """Worker processes for queries from any number of threads (module docstring)."""

    def __init__(self, memory_bytes: int = MEMORY_BYTES, max_idle: int = MAX_IDLE):
        if memory_bytes < 64 * 1024 * 1024:
            raise ValueError(f"WorkerPool.memory_bytes must be >= 64 MiB, got {memory_bytes}")
        self.memory_bytes, self.max_idle = memory_bytes, max_idle
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self.started = 0  # workers started so far (tests read it to see a replacement)

    def run(self, request: dict) -> dict:
        """The response dict of ``request`` (see :mod:`envs.sql.query_worker`); never raises.

        ``request["timeout_s"]`` is the query's time limit: its worker is killed once the limit
        and :data:`GRACE_S` have passed without an answer.
        """
        worker, failure = None, None
        for _ in range(2):  # an idle worker may have died since; then one fresh try
            try:
                worker = self._take()
                worker.send(request)
                break
            except OSError as error:
                if worker is not None:
                    self._drop(worker)
                worker, failure = None, error
        if worker is None:
            return {"error": f"the query could not run: {failure}", "timed_out": False}
        timeout_s = float(request["timeout_s"])
        cap = query_worker.response_cap(request)
        try:
            line = worker.read_line(time.monotonic() + timeout_s + GRACE_S, cap)
        except EOFError:
            self._drop(worker)  # reaps it, so its exit status is known
            return {
                "error": "the database worker died during the query (exit status "
                f"{worker.process.returncode})",
                "timed_out": False,
            }
        except OverflowError:  # the worker broke its cap: nothing past the cap was read
            self._drop(worker)
            return {
                "error": f"the database worker's answer was longer than its {cap:,}-byte cap",
                "timed_out": False,
            }
        if line is None:  # past the deadline: the query is stopped by killing its process
            self._drop(worker)
            return {"error": query_worker.timeout_message(timeout_s), "timed_out": True}
        try:
            response = json.loads(line)
            if not isinstance(response, dict):
                raise ValueError("not an object")
        except ValueError as error:
            self._drop(worker)
            return {"error": f"the database worker answered nonsense ({error})", "timed_out": False}
        self._give_back(worker)
        return response

    def _take(self) -> _Worker:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        worker = _Worker(self.memory_bytes)
        with self._lock:
            self._all.add(worker)
            self.started += 1
        return worker

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            if len(self._idle) < self.max_idle:
                self._idle.append(worker)
                return
            self._all.discard(worker)
        worker.close()

    def _drop(self, worker: _Worker) -> None:
        with self._lock:
            self._all.discard(worker)
        worker.kill()

    def pids(self) -> list[int]:
        """Process ids of the live workers, idle or busy."""
        with self._lock:
            return sorted(w.process.pid for w in self._all)

    def close(self) -> None:
        """Kill every worker, idle or busy; later queries start new ones."""
        with self._lock:
            workers, self._all, self._idle = list(self._all), set(), []
        for worker in workers:
            worker.kill()


_pool: WorkerPool | None = None
_pool_pid = -1
_pool_lock = threading.Lock()


def shared_pool() -> WorkerPool:
    """The process-wide pool (a forked child gets a pool of its own, not its parent's workers)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool, _pool_pid = WorkerPool(), os.getpid()
        return _pool


def shutdown() -> None:
    """Kill the shared pool's workers (run at interpreter exit)."""
    with _pool_lock:
        pool = _pool if _pool_pid == os.getpid() else None
    if pool is not None:
        pool.close()


atexit.register(shutdown)
