"""The text-environment protocol: everything the multi-turn rollout needs from an environment.

An environment serves a batch of ``N`` rows (trajectories). The rollout renders each row's
observation into the budget-aware prompt, samples a response, and hands the responses back::

    state, observations = env.reset(task_ids, seed)            # N first observations
    state, result = env.step(state, responses, live)            # one turn for the live rows

Rows the rollout has ended (``live`` False) must be left unchanged and report ``done``.
Parsing belongs to the environment: a response it cannot parse is an invalid action
(``action_valid`` False), never an exception.

Two kinds of environment satisfy the protocol:

* JAX environments (FrozenLake) step the whole batch in one jitted call.
* Python environments (SQL, code, function calling) implement the per-row
  :class:`PythonEnv` and are wrapped by :class:`PythonTextEnv`, which runs the rows in a
  worker pool with a per-step timeout: a row whose step does not return in time ends, with
  ``info["timeout"]`` set, and the rest of the batch goes on.

The environment never sees the turn budget: the rollout owns the budget, states it in the
prompt (paper §6), and ends a row after ``B`` turns with reward 0 unless it succeeded.

Every observation has a character budget: an environment declares ``max_observation_chars``
(default :data:`DEFAULT_OBSERVATION_CHARS`; read by :func:`observation_budget`), and the rollout
cuts each observation to it before it becomes tokens (:func:`cut_observation`), saying in the
text how much was cut. An environment should shape its own texts to fit (the SQL environment's
result table does); the cut is the backstop that holds for any environment.

The registry's types live here too (:mod:`envs.registry` keeps the names): an
:class:`EnvEntry` is a registered environment (its factory and what the rollout must know
of its texts), and a factory returns :class:`EnvTasks`, an environment over its tasks.
"""

from __future__ import annotations

import abc
import concurrent.futures as futures
import dataclasses
import inspect
import os
import pathlib
import threading
import time
import zlib
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from agentrl_jax.errors import did_you_mean


@dataclasses.dataclass(frozen=True)
class TurnResult:
    """The outcome of one turn for a batch of ``N`` rows (NumPy arrays, leading axis N).

    Attributes:
      observations: ``N`` texts shown to the agent next turn ("" where done).
      reward: ``float32[N]`` reward of this turn.
      done: ``bool[N]`` the episode ended (success, failure, or the row was not live).
      success: ``bool[N]`` the verifier's outcome, True once the task is solved.
      action: ``int32[N]`` the environment's action code where actions are discrete
        (FrozenLake: 0..3); -1 for an invalid response or a text action.
      action_valid: ``bool[N]`` the response parsed into an action.
      anchor_key: ``int32[N]`` key of the state the turn acted from: equal keys mean the same
        environment state within a task (GiGPO anchors, paper §4).
      quality: ``float32[N]`` a step-quality signal where the environment defines one
        (DeepCoder-MT: share of unit tests passed); NaN elsewhere. The rollout records it
        (``Trajectory.step_quality``).
      state_id: ``int32[N]`` the environment's id of the state each row acted from, for
        diagnostics that revisit states (FrozenLake: the flat cell); None where it has none
        (the record then holds -1: ``Trajectory.state_id``).
      info: environment-specific ``[N]`` arrays (Python environments: ``"timeout"``).
    """

    observations: list[str]
    reward: np.ndarray
    done: np.ndarray
    success: np.ndarray
    action: np.ndarray
    action_valid: np.ndarray
    anchor_key: np.ndarray
    quality: np.ndarray
    state_id: np.ndarray | None = None
    info: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)


class TextEnv(Protocol):
    """What the rollout calls. ``t_max`` is the paper's largest budget for the environment.

    An environment may also declare ``max_observation_chars``, the most characters of one
    observation the rollout shows (:func:`observation_budget`; the module docstring).
    """

    name: str
    t_max: int

    def instructions(self) -> str:
        """The task description that opens the system prompt (the budget is added by the
        prompt template, not here)."""

    def num_tasks(self) -> int:
        """Size of the task set; ``task_ids`` index it."""

    def reset(self, task_ids: np.ndarray, seed: int) -> tuple[Any, list[str]]:
        """Start one episode per row on ``task_ids`` (``int[N]``): ``(state, observations)``."""

    def step(
        self, state: Any, responses: Sequence[str], live: np.ndarray
    ) -> tuple[Any, TurnResult]:
        """Parse and play ``responses`` for rows where ``live``; others stay as they are."""


# Characters of one observation the rollout shows where an environment declares no budget: about
# 4,000 tokens at ~4 characters a token, a quarter of the 16,384-token context the built-in
# environments other than SQL run with.
DEFAULT_OBSERVATION_CHARS = 16_000
# The smallest budget an environment may declare: room for the note that says what was cut.
MIN_OBSERVATION_CHARS = 100


def observation_budget(env: Any) -> int:
    """The most characters of one observation of ``env`` the rollout shows: its
    ``max_observation_chars`` where it declares one, else :data:`DEFAULT_OBSERVATION_CHARS`.

    Raises ``ValueError`` naming the environment if the declared value is not an int
    >= :data:`MIN_OBSERVATION_CHARS`.
    """
    budget = getattr(env, "max_observation_chars", DEFAULT_OBSERVATION_CHARS)
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < MIN_OBSERVATION_CHARS:
        name = getattr(env, "name", type(env).__name__)
        raise ValueError(
            f"environment {name!r}: max_observation_chars must be an int >= "
            f"{MIN_OBSERVATION_CHARS}, got {budget!r}"
        )
    return budget


def _cut_note(count: int) -> str:
    return f"\n... [observation cut: {count:,} more characters]"


def cut_observation(text: str, max_chars: int) -> str:
    """``text`` if it has at most ``max_chars`` characters, else its head and a note stating how
    many characters were cut (``"... [observation cut: 123,456 more characters]"``), the whole
    at most ``max_chars`` characters long (``max_chars`` >= :data:`MIN_OBSERVATION_CHARS`)."""
    if max_chars < MIN_OBSERVATION_CHARS:
        raise ValueError(
            f"cut_observation: max_chars must be >= {MIN_OBSERVATION_CHARS}, got {max_chars}"
        )
    if len(text) <= max_chars:
        return text
    # The note for len(text) is at least as long as the note for the count actually cut.
    keep = max_chars - len(_cut_note(len(text)))
    return text[:keep] + _cut_note(len(text) - keep)


def text_key(*parts: object) -> int:
    """A stable non-negative int32 key of some text (anchor keys of Python environments).

    CRC-32 of the parts' ``repr``: stable across processes and runs, unlike ``hash``.
    """
    return zlib.crc32(repr(parts).encode("utf-8", "surrogatepass")) & 0x7FFFFFFF


@dataclasses.dataclass(frozen=True)
class Feedback:
    """One row's outcome of :meth:`PythonEnv.step_task`."""

    observation: str
    reward: float = 0.0
    done: bool = False
    success: bool = False
    action_valid: bool = True
    quality: float = float("nan")


class PythonEnv(abc.ABC):
    """A per-row environment in plain Python (SQL, code, function calling).

    Implement :meth:`instructions`, :meth:`num_tasks`, :meth:`reset_task`, :meth:`step_task`
    and :meth:`state_key`; wrap it with :class:`PythonTextEnv` for the rollout. ``step_task``
    must enforce its own limits (query timeouts, sandboxed processes); the wrapper's step
    timeout is the last line of defence.
    """

    name: str = "python-env"
    t_max: int = 10
    max_observation_chars: int = DEFAULT_OBSERVATION_CHARS

    @abc.abstractmethod
    def instructions(self) -> str: ...

    @abc.abstractmethod
    def num_tasks(self) -> int: ...

    @abc.abstractmethod
    def reset_task(self, task_id: int, seed: int) -> tuple[Any, str]:
        """``(row_state, first_observation)`` for one task."""

    @abc.abstractmethod
    def step_task(self, row_state: Any, response: str) -> tuple[Any, Feedback]:
        """Play one response; must not raise on any response text."""

    @abc.abstractmethod
    def state_key(self, row_state: Any) -> int:
        """Anchor key of the row's current state (e.g. :func:`text_key` of what it shows)."""

    def close_task(self, row_state: Any) -> None:
        """Release what a row holds (temporary folders, connections). Optional."""
        return None


@dataclasses.dataclass
class _Rows:
    states: list[Any]
    done: np.ndarray
    success: np.ndarray


class PythonTextEnv:
    """:class:`TextEnv` over a :class:`PythonEnv`: rows run in a thread pool of ``workers``
    threads, each step with a timeout of ``step_timeout_s`` counted from when that step starts
    running (a step queued behind others is not charged for their time). A step past its time
    ends its row (``info["timeout"]``) and is left to finish on its own thread; while every
    worker holds such a step, steps still queued cannot start and end their rows the same way,
    so a hung environment never hangs the rollout."""

    def __init__(self, env: PythonEnv, *, workers: int = 8, step_timeout_s: float = 60.0):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if not step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0, got {step_timeout_s}")
        self.env = env
        self.name, self.t_max = env.name, env.t_max
        self.max_observation_chars = observation_budget(env)
        self.step_timeout_s = step_timeout_s
        self.workers = workers
        self._pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=env.name)
        self._lock = threading.Lock()
        self._running: dict[object, float] = {}  # every step running on a worker: its start

    def _timed_step(self, started: dict[int, float], i: int, state: Any, response: str):
        """Runs row ``i``'s step on a worker, recording when it began."""
        token = object()
        with self._lock:
            started[i] = self._running[token] = time.monotonic()
        try:
            return self.env.step_task(state, response)
        finally:
            with self._lock:
                del self._running[token]

    def _wait(self, jobs: dict[int, futures.Future], started: dict[int, float]) -> None:
        """Returns once every job is done, past its time, or unable to start (every worker
        holds a step past its time)."""
        limit = self.step_timeout_s
        pending = [job for job in jobs.values() if not job.done()]
        while pending:
            now = time.monotonic()
            with self._lock:
                began = {i: started[i] for i, job in jobs.items() if i in started}
                overdue = sum(now - t >= limit for t in self._running.values())
            deadlines = [
                t + limit for i, t in began.items() if not jobs[i].done() and now < t + limit
            ]
            queued = sum(not job.done() for i, job in jobs.items() if i not in began)
            if not deadlines and (not queued or overdue >= self.workers):
                return
            # Wake at the first deadline; poll while steps wait for a worker to start them.
            wake = min(deadlines) - now if deadlines else limit
            if queued:
                wake = min(wake, 0.05)
            futures.wait(pending, timeout=max(wake, 0.0), return_when=futures.FIRST_COMPLETED)
            pending = [job for job in pending if not job.done()]

    def instructions(self) -> str:
        return self.env.instructions()

    def num_tasks(self) -> int:
        return self.env.num_tasks()

    def reset(self, task_ids: np.ndarray, seed: int) -> tuple[_Rows, list[str]]:
        task_ids = np.asarray(task_ids)
        if task_ids.ndim != 1 or np.any(task_ids < 0) or np.any(task_ids >= self.num_tasks()):
            raise ValueError(
                f"task_ids must be a 1-D array in [0, {self.num_tasks()}), got {task_ids}"
            )
        started = list(
            self._pool.map(
                lambda i: self.env.reset_task(int(task_ids[i]), seed + i), range(len(task_ids))
            )
        )
        n = len(task_ids)
        rows = _Rows([s for s, _ in started], np.zeros(n, bool), np.zeros(n, bool))
        return rows, [obs for _, obs in started]

    def step(
        self, rows: _Rows, responses: Sequence[str], live: np.ndarray
    ) -> tuple[_Rows, TurnResult]:
        n = len(rows.states)
        live = np.asarray(live, bool) & ~rows.done
        anchor = np.array([self.env.state_key(s) for s in rows.states], np.int32)
        started: dict[int, float] = {}
        jobs = {
            i: self._pool.submit(self._timed_step, started, i, rows.states[i], responses[i])
            for i in np.flatnonzero(live)
        }
        self._wait(jobs, started)
        out = dict(
            observations=[""] * n,
            reward=np.zeros(n, np.float32),
            done=rows.done.copy(),
            success=rows.success.copy(),
            action=np.full(n, -1, np.int32),
            action_valid=np.zeros(n, bool),
            quality=np.full(n, np.nan, np.float32),
        )
        timeout = np.zeros(n, bool)
        states = list(rows.states)
        for i, job in jobs.items():
            if not job.done():  # the row ends; its thread is left to finish on its own
                never_ran = job.cancel()
                timeout[i], out["done"][i] = True, True
                out["observations"][i] = (
                    "The step could not start: every worker was busy with a step past its "
                    f"{self.step_timeout_s:g} s."
                    if never_ran
                    else f"The step timed out after {self.step_timeout_s:g} s."
                )
                continue
            try:
                states[i], fb = job.result()
            except Exception as error:  # a bug in the environment must not kill the rollout
                out["done"][i] = True
                out["observations"][i] = f"The environment failed: {type(error).__name__}: {error}"
                continue
            out["observations"][i] = fb.observation
            out["reward"][i], out["done"][i] = fb.reward, fb.done
            out["success"][i] = fb.success or rows.success[i]
            out["action_valid"][i], out["quality"][i] = fb.action_valid, fb.quality
        for i in np.flatnonzero(out["done"] & ~rows.done):
            self.env.close_task(states[i])
        new_rows = _Rows(states, out["done"], out["success"])
        return new_rows, TurnResult(anchor_key=anchor, info={"timeout": timeout}, **out)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# ---------------------------------------------------------------- the registry's types


class EnvOptionError(ValueError):
    """An unknown environment, or an option its factory does not take."""


class EnvDataError(EnvOptionError):
    """The tasks an environment's ``data`` option names cannot be read: the path is missing,
    empty, a file where a folder is expected (or the reverse), unreadable, or its content is
    malformed. The message names the path (or the file and line within it) and what is wrong;
    a config's error prefixes the field, ``task.options.data``."""


def data_path(data: Any, kind: str, expected: str) -> pathlib.Path:
    """``data`` (a ``data`` option) as the path of an existing, readable, non-empty ``kind``
    (``"file"`` or ``"folder"``), else :class:`EnvDataError` naming it and what is wrong;
    ``expected`` says what the environment reads there (``"a Spider folder"``). A factory
    checks its data with this before loading it, so each problem is one line, not a loader's
    own error from deep inside."""
    if kind not in ("file", "folder"):
        raise ValueError(f"data_path: kind must be 'file' or 'folder', got {kind!r}")
    if not isinstance(data, (str, os.PathLike)) or not str(data).strip():
        raise EnvDataError(f"expected the path of {expected}, got {data!r}")
    path = pathlib.Path(data).expanduser()
    try:
        if not path.exists():
            raise EnvDataError(f"{path} does not exist; expected {expected}")
        if kind == "folder" and not path.is_dir():
            raise EnvDataError(f"{path} is a file, not a folder; expected {expected}")
        if kind == "file" and path.is_dir():
            raise EnvDataError(f"{path} is a folder, not a file; expected {expected}")
        if kind == "file" and not path.is_file():
            raise EnvDataError(f"{path} is not a regular file; expected {expected}")
        if kind == "folder":
            empty = next(iter(path.iterdir()), None) is None
        else:
            with path.open("rb") as file:
                empty = not file.read(1)
    except PermissionError as error:
        raise EnvDataError(f"{path} cannot be read ({error.strerror})") from None
    except OSError as error:  # a broken mount, a name too long, ...
        raise EnvDataError(f"{path} cannot be read ({error.strerror or error})") from None
    if empty:
        raise EnvDataError(f"{path} is an empty {kind}; expected {expected}")
    return path


def split_of_data(tasks: Sequence[Any], path: pathlib.Path, total: int, split: str | None):
    """``tasks``, the ``split`` of the ``total`` tasks read from ``path``: an
    :class:`EnvDataError` if it holds none (too few tasks for both halves of the hash split)."""
    if not tasks:
        raise EnvDataError(
            f"{path}: none of its {total} task(s) falls in the {split!r} split (a fixed hash "
            "of each task id splits them in two halves); it needs more tasks"
        )
    return tasks


@dataclasses.dataclass(frozen=True)
class EnvTasks:
    """An environment ready for the rollout, and what reports say about its tasks.

    ``names``: one per task (``env.num_tasks()`` of them); ``min_turns``: ``[tasks]`` int, the
    fewest turns that can succeed where known (§2's structural bound: FrozenLake's shortest
    paths, BFCL's annotated trajectories), else None.
    """

    env: Any
    names: tuple[str, ...]
    min_turns: np.ndarray | None = None

    def __post_init__(self):
        if len(self.names) != self.env.num_tasks():
            raise ValueError(
                f"EnvTasks: {len(self.names)} task names for {self.env.num_tasks()} tasks"
            )
        if self.min_turns is not None and np.shape(self.min_turns) != (len(self.names),):
            raise ValueError(
                f"EnvTasks.min_turns: shape {np.shape(self.min_turns)}, expected "
                f"({len(self.names)},)"
            )

    def close(self) -> None:
        """Release the environment's workers and sandboxes (if it has a ``close``)."""
        close = getattr(self.env, "close", None)
        if close is not None:
            close()


@dataclasses.dataclass(frozen=True)
class EnvEntry:
    """A registered environment (:func:`envs.register`).

    ``factory(**options) -> EnvTasks`` builds it over its tasks; its keyword parameters are the
    options it takes. ``label`` names it in reports, ``max_response_tokens`` and
    ``max_context`` are the token limits its texts need (a DeepCoder-MT turn is a whole
    program; BFCL's first message lists every function as JSON) and ``lanes`` the rollout
    lanes that suit it (2 where a step runs tests in a sandbox, long enough to hide behind
    decoding; 1 where a step is a query or a function call, so decode batches stay whole).
    ``option_type``: a frozen dataclass of the options a user sets (their defaults and checks,
    e.g. FrozenLake's map size and dynamics), or None: the factory's keyword parameters, as
    they are.
    """

    name: str
    factory: Callable[..., EnvTasks]
    label: str
    max_response_tokens: int
    max_context: int
    lanes: int = 1
    option_type: type | None = None

    @property
    def options(self) -> tuple[str, ...]:
        """The keyword options the factory takes, in its order."""
        return tuple(
            p.name
            for p in inspect.signature(self.factory).parameters.values()
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        )

    def check_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """A config's ``options`` checked (:class:`EnvOptionError` or the option type's
        ``ValueError``, naming the bad one) and, with an ``option_type``, completed with its
        defaults. The options a task set is drawn with (:data:`TASK_OPTIONS`) are the
        config's own fields, not options."""
        reserved = [o for o in options if o in TASK_OPTIONS]
        if reserved:
            raise EnvOptionError(
                f"{', '.join(map(repr, reserved))}: set from the task section (task.seed, "
                "task.t_max, train_tasks / eval_tasks), not an option"
            )
        takes = [o for o in self.options if o not in TASK_OPTIONS]
        unknown = [o for o in options if o not in takes]
        if unknown:
            raise EnvOptionError(
                f"environment {self.name!r} takes no option {', '.join(map(repr, unknown))}; "
                f"it takes: {', '.join(takes) or 'none'}"
                f"{did_you_mean(unknown[0], takes) if len(unknown) == 1 else ''}"
            )
        if self.option_type is None:
            return dict(options)
        return dataclasses.asdict(self.option_type(**options))


# The keyword parameters of a factory that draw its task set, set from a config's task section.
TASK_OPTIONS = ("split", "seed", "limit", "t_max")


def python_env(
    inner: PythonEnv,
    names: Sequence[str],
    min_turns: np.ndarray | None = None,
    *,
    workers: int = 8,
    step_timeout_s: float = 60.0,
) -> EnvTasks:
    """A per-row :class:`PythonEnv` in its worker pool (``workers`` threads; a step that takes
    longer than ``step_timeout_s`` ends its row), as :class:`EnvTasks`."""
    return EnvTasks(
        PythonTextEnv(inner, workers=workers, step_timeout_s=step_timeout_s),
        tuple(names),
        min_turns,
    )
