"""Counts XLA backend compilations, so tests can prove that something does not recompile."""

import collections
import contextlib

import jax


@contextlib.contextmanager
def count_backend_compiles():
    """Yield a list that collects one entry per backend compilation inside the block."""
    events = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


@contextlib.contextmanager
def count_backend_compiles_by_name():
    """Yield a Counter of backend compilations per compiled function's name (``jit(f)``: "f")."""
    counts = collections.Counter()

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            counts[kwargs.get("fun_name", "?")] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
