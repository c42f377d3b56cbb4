"""User plugins: Python modules imported before a config is read, so what they register counts.

A plugin is an ordinary module that registers things at import time: loss terms
(:func:`~agentrl_jax.algorithms.register_loss_term`), advantage estimators
(:func:`~agentrl_jax.algorithms.register_advantage`), run presets
(:func:`~agentrl_jax.train.presets.register_run_preset`), environments
(:func:`envs.register`), analyses
(:func:`~agentrl_jax.evaluation.analyses.registry.register`: ``eval`` and ``reproduce`` run and
report them after the built-in ones). The command line imports them before it reads the
config (so ``rl.runs`` may name them):

* ``--plugin PATH.py`` or ``--plugin package.module`` (repeatable), on
  ``agentrl-jax reproduce``, ``train``, ``eval`` and ``plan``;
* the environment variable ``AGENTRL_JAX_PLUGINS``: the same, separated by ``os.pathsep``
  (``:`` on Linux and macOS), read before the options.

Both are imported before ``--help`` is shown too, so the help's lists of environments, run
presets and analyses name what they register (:mod:`agentrl_jax.cli.registries`).

A path is imported as a file (from anywhere; its directory need not be on ``sys.path``); any
other string as a module name (installed, or on ``PYTHONPATH``). A plugin already imported,
by name or from the same file (e.g. a test module that registers its own term and then runs
the CLI with ``--plugin`` on itself), is not imported again, so nothing registers twice.
Errors are :class:`PluginError` naming the plugin.

Every plugin imported is remembered (:func:`loaded_plugins`: what was asked for, the module,
its file and the file's sha256), so a run can record the code it was made with: the
reproduction writes them to ``plugins.json`` in its results folder, its checkpoints'
metadata and its report, and names them when a resumed folder's config needs them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterable, Mapping

from agentrl_jax.errors import ConfigError

PLUGINS_ENV = "AGENTRL_JAX_PLUGINS"


class PluginError(ConfigError):
    """A plugin could not be found or failed while being imported."""


@dataclasses.dataclass(frozen=True)
class PluginRecord:
    """A plugin this process imported: ``spec`` as given, the ``module``'s name, its ``file``
    and the file's ``sha256`` (None for a module without a file)."""

    spec: str
    module: str
    file: str | None
    sha256: str | None


_LOADED: dict[str, PluginRecord] = {}  # by module name, in import order


def _remember(spec: str, module: ModuleType) -> ModuleType:
    file = getattr(module, "__file__", None)
    digest = None
    if file is not None:
        try:
            digest = hashlib.sha256(Path(file).read_bytes()).hexdigest()
        except OSError:
            pass
    _LOADED.setdefault(module.__name__, PluginRecord(spec, module.__name__, file, digest))
    return module


def loaded_plugins() -> list[dict[str, str | None]]:
    """The plugins imported so far, as plain data (see :class:`PluginRecord`), in import order."""
    return [dataclasses.asdict(r) for r in _LOADED.values()]


def env_plugins(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The plugins named by ``AGENTRL_JAX_PLUGINS`` (``os.pathsep``-separated; blanks ignored)."""
    return [part.strip() for part in environ.get(PLUGINS_ENV, "").split(os.pathsep) if part.strip()]


def is_path(spec: str) -> bool:
    """Whether ``spec`` names a file (ends in ``.py`` or holds a path separator) rather than a
    module."""
    return spec.endswith(".py") or "/" in spec or os.sep in spec


def _imported_from(path: Path) -> ModuleType | None:
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file is not None:
            try:
                if Path(file).resolve() == path:
                    return module
            except (OSError, ValueError):
                continue
    return None


def _module_name(path: Path) -> str:
    stem = re.sub(r"\W", "_", path.stem)
    return f"agentrl_jax_plugin_{stem}_{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"


def load_plugin(spec: str) -> ModuleType:
    """Imports one plugin (a file path or a module name; see the module docstring)."""
    if not isinstance(spec, str) or not spec.strip():
        raise PluginError(f"plugin {spec!r}: must be a file path or a module name")
    spec = spec.strip()
    if not is_path(spec):
        try:
            return _remember(spec, importlib.import_module(spec))
        except ModuleNotFoundError as error:
            if error.name is not None and spec.startswith(error.name):
                raise PluginError(
                    f"plugin {spec!r}: no module named {error.name!r} (give a file path "
                    "ending in .py, or put the module on PYTHONPATH)"
                ) from None
            raise PluginError(f"plugin {spec!r}: importing it failed: {error}") from error
        except Exception as error:  # noqa: BLE001 - the user's code: report which plugin failed
            raise PluginError(
                f"plugin {spec!r}: importing it failed: {type(error).__name__}: {error}"
            ) from error
    path = Path(spec).expanduser().resolve()
    if not path.is_file():
        raise PluginError(f"plugin {spec}: no such file")
    module = _imported_from(path)
    if module is not None:
        return _remember(spec, module)
    name = _module_name(path)
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise PluginError(f"plugin {spec}: not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:  # noqa: BLE001 - the user's code: report which plugin failed
        del sys.modules[name]
        raise PluginError(
            f"plugin {spec}: importing it failed: {type(error).__name__}: {error}"
        ) from error
    return _remember(spec, module)


def load_plugins(
    specs: Iterable[str] = (), *, environ: Mapping[str, str] = os.environ
) -> list[ModuleType]:
    """Imports the plugins of ``AGENTRL_JAX_PLUGINS``, then ``specs``, in order."""
    return [load_plugin(spec) for spec in [*env_plugins(environ), *specs]]
