"""Ctrl-C held back around a step that must not stop half-way.

Orbax saves a checkpoint by running an asyncio loop and background threads; a
``KeyboardInterrupt`` raised inside that (Ctrl-C, or SIGTERM as the command line turns it)
closes the loop while tensorstore still completes writes into it, and the process prints
``Event loop is closed`` tracebacks from C++ threads, leaves a half-made checkpoint folder, or
times out waiting for a signal that never comes. :func:`uninterrupted` holds SIGINT and SIGTERM
for the length of such a step and delivers the first one that arrived once it has finished, so
the run stops right after it, as it would have before it.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

HELD = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """Runs the block with SIGINT and SIGTERM held; the first that arrived is then delivered
    to the handler that was in place (``KeyboardInterrupt`` for SIGINT by default; the command
    line's for SIGTERM). Only the main thread receives signals, so elsewhere this does nothing.
    A further signal while held is ignored: the block runs to its end (a checkpoint's
    synchronous part: copying arrays to host memory, or waiting for files being written)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[tuple[int, object]] = []

    def hold(signum, frame):
        if not arrived:
            arrived.append((signum, frame))

    previous = {s: signal.signal(s, hold) for s in HELD}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if arrived:
        signum, frame = arrived[0]
        handler = previous[signum]
        if callable(handler):
            handler(signum, frame)
        elif handler == signal.SIG_DFL:  # the default: Ctrl-C raises, SIGTERM ends the process
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.raise_signal(signum)
