"""Ctrl-C and SIGTERM at the command line: a run stops where it is, says so in one line (the
command's own message: where, what is saved, how to go on) and exits 130 or 143."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

import typer


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C's KeyboardInterrupt would be, so both stop a run alike."""


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Around a run: SIGTERM raises :class:`Terminated` as SIGINT raises KeyboardInterrupt;
    the running code says where it stopped, what is saved and how to go on (the pipeline's
    :class:`~agentrl_jax.reproduce.pipeline.Reproduction`, ``eval``'s analyses), and the
    command exits 130 (SIGINT) or 143 (SIGTERM) without a traceback."""
    main_thread = threading.current_thread() is threading.main_thread()

    def terminate(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminate) if main_thread else None
    try:
        yield
    except KeyboardInterrupt as stop:
        raise typer.Exit(143 if isinstance(stop, Terminated) else 130) from None
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
