"""The environments (FrozenLake, InterCode-SQL, DeepCoder-MT, BFCL v3) and their registry:
``envs.make(name, **options)`` builds one over its tasks, ``envs.register`` adds one (see
:mod:`envs.registry`)."""

from envs.registry import (
    EnvEntry,
    EnvOptionError,
    EnvTasks,
    entry,
    make,
    names,
    python_env,
    register,
)

__all__ = [
    "EnvEntry",
    "EnvOptionError",
    "EnvTasks",
    "entry",
    "make",
    "names",
    "python_env",
    "register",
]
