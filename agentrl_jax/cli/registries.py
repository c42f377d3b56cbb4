"""Help texts that name what is registered, read from the registries when the help is shown.

A command's help (its docstring) or an option's ``help`` may hold these placeholders:

* ``{environments}``: the registered environments (:func:`envs.names`);
* ``{presets}``: the registered run presets (:data:`agentrl_jax.train.presets.RUN_PRESETS`);
* ``{analyses}``: the registered analyses (:mod:`agentrl_jax.evaluation.analyses.registry`).

A command made with :class:`RegistryHelpCommand` (and the top-level group,
:class:`RegistryHelpGroup`, which lists the commands' summaries) replaces them with the names,
comma-separated, each time its help is rendered, after importing the plugins
(:mod:`agentrl_jax.plugins`) of ``AGENTRL_JAX_PLUGINS`` and, for a command that takes
``--plugin``, those its command line names: ``agentrl-jax reproduce --plugin maze.py --help``
lists the environment and presets ``maze.py`` registers. (click shows ``--help`` while it
parses, before any option's value is taken, so the ``--plugin`` values are read from the
arguments themselves.) A plugin that cannot be imported is a usage error naming it, as it is
when the command runs. Running a command imports nothing more than before: the registries are
read only to render help.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import typer
from typer.core import TyperCommand, TyperGroup


def environments() -> tuple[str, ...]:
    """The registered environments' names, in registration order."""
    import envs

    return tuple(envs.names())


def presets() -> tuple[str, ...]:
    """The registered run presets' names, in registration order."""
    from agentrl_jax.train.presets import RUN_PRESETS

    return tuple(RUN_PRESETS)


def analyses() -> tuple[str, ...]:
    """The registered analyses' names, in report order."""
    from agentrl_jax.evaluation.analyses import registry

    return registry.names()


PLACEHOLDERS: dict[str, Callable[[], Sequence[str]]] = {
    "{environments}": environments,
    "{presets}": presets,
    "{analyses}": analyses,
}


def fill(text: str | None) -> str | None:
    """``text`` with each placeholder of :data:`PLACEHOLDERS` replaced by the names registered
    now (other braces are left as they are)."""
    if not text:
        return text
    for token, names in PLACEHOLDERS.items():
        if token in text:
            text = text.replace(token, ", ".join(names()))
    return text


def _has_placeholder(text: str | None) -> bool:
    return bool(text) and any(token in text for token in PLACEHOLDERS)


def _reflowed(text: str | None) -> str | None:
    """``text`` with each paragraph on one line: the names filled in make its source lines
    uneven, and rich keeps a paragraph's line breaks (it wraps each line to the terminal)."""
    if not text:
        return text
    return "\n\n".join(" ".join(p.split()) for p in text.split("\n\n"))


def plugin_arguments(args: Sequence[str]) -> list[str]:
    """The values of ``--plugin`` in a command's arguments (``--plugin X`` and
    ``--plugin=X``, up to a ``--``), in order."""
    found, words = [], iter(args)
    for word in words:
        if word == "--":
            break
        if word == "--plugin":
            value = next(words, None)
            if value is not None:
                found.append(value)
        elif word.startswith("--plugin="):
            found.append(word.partition("=")[2])
    return found


def load_help_plugins(ctx: Any, specs: Sequence[str] = ()) -> None:
    """Import the plugins of ``AGENTRL_JAX_PLUGINS`` and ``specs`` (a command line's
    ``--plugin`` values) before a help text lists the registries; one that fails is a usage
    error naming it."""
    from agentrl_jax.plugins import PLUGINS_ENV, env_plugins, load_plugin

    for hint, plugins in ((PLUGINS_ENV, env_plugins()), ("'--plugin'", specs)):
        for spec in plugins:
            try:
                load_plugin(spec)
            except ValueError as error:
                raise typer.BadParameter(str(error), ctx=ctx, param_hint=hint) from None


_PLUGINS_META = "agentrl_jax.help_plugins"  # ctx.meta key: the --plugin values of the arguments


class RegistryHelpCommand(TyperCommand):
    """A command whose help and options' help may name the registries (the placeholders of
    :data:`PLACEHOLDERS`), filled in when the help is rendered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._help_templates = {
            id(param): param.help
            for param in self.params
            if _has_placeholder(getattr(param, "help", None))
        }

    @property
    def help(self) -> str | None:  # click reads it for the help page and the group's list
        return _reflowed(fill(self._help)) if _has_placeholder(self._help) else self._help

    @help.setter
    def help(self, value: str | None) -> None:
        self._help = value

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        # --help is shown while parsing, before --plugin's values are taken: keep them now
        if any(param.name == "plugin" for param in self.params):
            ctx.meta[_PLUGINS_META] = plugin_arguments(args)
        return super().parse_args(ctx, args)

    def format_help(self, ctx: Any, formatter: Any) -> None:
        load_help_plugins(ctx, ctx.meta.get(_PLUGINS_META, ()))
        for param in self.params:
            template = self._help_templates.get(id(param))
            if template is not None:
                param.help = fill(template)
        super().format_help(ctx, formatter)


class RegistryHelpGroup(TyperGroup):
    """The top-level group: imports ``AGENTRL_JAX_PLUGINS``' plugins before it lists the
    commands, so that their summaries (:class:`RegistryHelpCommand`) name what those
    register."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        load_help_plugins(ctx)
        super().format_help(ctx, formatter)
