"""The environment registry: a name, how to build the environment over its tasks, and what the
rollout needs to know about its texts.

    loaded = envs.make("sql", limit=3)           # EnvTasks: the env, its task names, bounds
    envs.register("maze", make_maze, label="Maze", max_response_tokens=32, max_context=2048)

An entry (:class:`~envs.protocol.EnvEntry`) declares what it needs; its factory's keyword
parameters are the options it takes: an option it does not take is refused, naming those it
does (:class:`~envs.protocol.EnvOptionError`), before anything is loaded. A factory returns
:class:`~envs.protocol.EnvTasks`: an environment ready for the rollout (a
:class:`~envs.protocol.TextEnv`: FrozenLake's jitted one, or a Python environment in its
worker pool, :func:`~envs.protocol.python_env`), the task names, and each task's fewest turns
that can succeed where known.

Each environment package registers its own factory when it is imported (``envs/frozenlake``,
``envs/sql``, ``envs/code``, ``envs/bfcl``; importing :mod:`envs` imports them, in that
order); their heavy imports wait until they are made. A user environment is registered from
its own module (e.g. a ``--plugin`` file), with no change here. What the paper's study of an
environment needs beyond the rollout is :mod:`agentrl_jax.reproduce.studies`'.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from agentrl_jax.errors import did_you_mean
from agentrl_jax.validation import undeclared_ranges
from envs.protocol import EnvEntry, EnvOptionError, EnvTasks

_REGISTRY: dict[str, EnvEntry] = {}


def register(
    name: str,
    factory: Callable[..., EnvTasks],
    *,
    label: str,
    max_response_tokens: int,
    max_context: int,
    lanes: int = 1,
    option_type: type | None = None,
    replace: bool = False,
) -> EnvEntry:
    """Register ``factory(**options) -> EnvTasks`` as ``name``; a name already taken is refused
    unless ``replace``. ``option_type``: a frozen dataclass declaring the options a config may
    set, their defaults and checks (:meth:`~envs.protocol.EnvEntry.check_options`). Returns
    the entry."""
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
    if option_type is not None and not dataclasses.is_dataclass(option_type):
        raise EnvOptionError(f"envs.register({name!r}): option_type must be a dataclass")
    undeclared = [] if option_type is None else undeclared_ranges(option_type)
    if undeclared:
        raise EnvOptionError(
            f"envs.register({name!r}): option_type's numeric options must declare their range "
            f"(agentrl_jax.validation.setting(default, integer(lo, hi)) or real(lo, hi)); "
            f"{', '.join(undeclared)} do not"
        )
    entry = EnvEntry(name, factory, label, max_response_tokens, max_context, lanes, option_type)
    _REGISTRY[name] = entry
    return entry


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
            f"{did_you_mean(name, _REGISTRY)}"
        ) from None


def check_options(name: str, options: Sequence[str]) -> EnvEntry:
    """``name``'s entry, after checking it takes every option in ``options``."""
    found = entry(name)
    unknown = [o for o in options if o not in found.options]
    if unknown:
        raise EnvOptionError(
            f"environment {name!r} takes no option {', '.join(map(repr, unknown))}"
            f"; it takes: {', '.join(found.options) or 'none'}"
            f"{did_you_mean(unknown[0], found.options) if len(unknown) == 1 else ''}"
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


def task_set(task: Any, *, split: str, count: int) -> EnvTasks:
    """The ``split`` tasks (at most ``count``) of a config's task section ``task`` (its
    ``env``, ``options``, ``seed`` and ``t_max``): the factory gets ``split``, ``seed``,
    ``limit`` and ``t_max`` where it takes them; an environment that keeps its own ``t_max``
    (a Python environment's wrapper) gets the task's (:func:`with_t_max`)."""
    found = entry(task.env)
    given = {"split": split, "seed": task.seed, "limit": count, "t_max": task.t_max}
    extra = {name: value for name, value in given.items() if name in found.options}
    return with_t_max(make(task.env, **{**task.options, **extra}), task.t_max)


def with_t_max(tasks: EnvTasks, t_max: int) -> EnvTasks:
    """``tasks`` with its environment's ``t_max`` (the rollout's full budget, BudgetMix's
    largest) set to ``t_max``: a Python environment's wrapper holds its own copy of the
    paper's value (SQL 10), which a config may lower (a CI-sized run) or raise."""
    if getattr(tasks.env, "t_max", t_max) != t_max:
        tasks.env.t_max = int(t_max)
    return tasks
