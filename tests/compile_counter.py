"""Counts XLA backend compilations, so tests can prove that something does not recompile."""

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
