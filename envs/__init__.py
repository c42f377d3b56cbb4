"""The environments (FrozenLake, InterCode-SQL, DeepCoder-MT, BFCL v3) and their registry:
``envs.make(name, **options)`` builds one over its tasks, ``envs.register`` adds one (see
:mod:`envs.registry`; the protocol and the registry's types are :mod:`envs.protocol`'s)."""

from envs.protocol import EnvDataError, EnvEntry, EnvOptionError, EnvTasks, python_env
from envs.registry import check_options, entry, make, names, register, task_set, with_t_max

# Each built-in package registers its own factory when imported, in this order (isort: off
# keeps it: the registry lists environments in registration order).
# isort: off
from envs import frozenlake  # noqa: E402, F401
from envs import sql  # noqa: E402, F401
from envs import code  # noqa: E402, F401
from envs import bfcl  # noqa: E402, F401

# isort: on

__all__ = [
    "EnvDataError",
    "EnvEntry",
    "EnvOptionError",
    "EnvTasks",
    "check_options",
    "entry",
    "make",
    "names",
    "python_env",
    "register",
    "task_set",
    "with_t_max",
]
