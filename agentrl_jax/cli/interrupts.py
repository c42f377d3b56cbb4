"""Ctrl-C and SIGTERM at the command line: a run stops where it is, says so in one line (the
command's own message: where, what is saved, how to go on) and exits 130 or 143."""

from __future__ import annotations

import contextlib
import shlex
import signal
import threading
from typing import Any, Iterator, Sequence

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


def command_line(words: Sequence[str], options: Sequence[tuple[str, Any]]) -> str:
    """A command as the user would type it again: ``words`` (``agentrl-jax train``, any
    arguments), then each ``(flag, value)`` of ``options`` whose value is not None, a list
    value once per item (a repeatable option), shell-quoted."""
    out = list(words)
    for flag, value in options:
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if item is not None:
                out += [flag, str(item)]
    return shlex.join(out)
