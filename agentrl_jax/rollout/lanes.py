"""Environment steps in lanes: while one lane's step runs on a thread of its own, the next
lane samples (:class:`EnvSteps`); a turn in flight (:class:`Turn`) and where the time went
(:class:`Timer`)."""

from __future__ import annotations

import concurrent.futures as futures
import contextlib
import dataclasses
import time
from typing import Any

import numpy as np

from agentrl_jax.sampling import Responses
from envs.protocol import TextEnv, TurnResult


class Timer:
    """Seconds spent in the policy and in the environment: ``with timer("env"): ...``."""

    def __init__(self):
        self.seconds: dict[str, float] = {"policy": 0.0, "env": 0.0}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start


@dataclasses.dataclass(frozen=True)
class Turn:
    """One lane's turn between its responses and the environment's answer (``[n]`` arrays:
    rows that sampled, rows whose response is played, rows whose response was cut)."""

    out: Responses
    live: np.ndarray
    playing: np.ndarray
    cut: np.ndarray
    step: futures.Future  # -> TurnResult


class EnvSteps:
    """The environment's steps in the order they are submitted, each from the state the one
    before left: at once, or (``background``) on one thread of their own, so that a lane's
    step runs while the other lanes sample. ``busy``: seconds spent stepping."""

    def __init__(self, env: TextEnv, state: Any, background: bool):
        self.env, self.state, self.busy = env, state, 0.0
        self._thread = (
            futures.ThreadPoolExecutor(1, thread_name_prefix="env-steps") if background else None
        )

    def _step(self, replies: list[str], playing: np.ndarray) -> TurnResult:
        begin = time.perf_counter()
        self.state, result = self.env.step(self.state, replies, playing)
        self.busy += time.perf_counter() - begin
        return result

    def submit(self, replies: list[str], playing: np.ndarray) -> futures.Future:
        if self._thread is not None:
            return self._thread.submit(self._step, replies, playing)
        done: futures.Future = futures.Future()
        done.set_result(self._step(replies, playing))
        return done

    def __enter__(self) -> "EnvSteps":
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:  # a step in flight finishes first (it owns the state)
            self._thread.shutdown(wait=True, cancel_futures=True)
