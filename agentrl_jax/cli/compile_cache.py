"""The commands' persistent XLA compilation cache: a program compiled once is loaded after.

A study compiles the same programs many times over: every training run and every evaluation
phase builds its own sampler, whose jitted functions compile afresh for the same shapes (the
default FrozenLake study: ~125 of its ~310 s of compilation, measured with
``JAX_LOG_COMPILES=1``), and a resumed run or another seed (``--seeds``) compiles them all
again. jax's persistent cache keys each program by its HLO, compile options, devices and jax
version, so a hit loads exactly the executable a compilation would give: no result changes.

Where, in order: ``--compile-cache PATH`` (``off``: none); else ``JAX_COMPILATION_CACHE_DIR``
when set (a user's or the tests' own cache, left as it is); else
``$XDG_CACHE_HOME/agentrl-jax/xla`` (``~/.cache/agentrl-jax/xla``). Programs that took at
least :data:`MIN_COMPILE_SECONDS` to compile are kept; the folder is held to
:data:`MAX_BYTES` (least recently used entries go first). A ``--compile-cache`` folder that cannot
be written is a one-line error when the command starts; a default one that cannot is skipped.
"""

from __future__ import annotations

import os
from pathlib import Path

import typer

from agentrl_jax.cli.paths import output_folder

MIN_COMPILE_SECONDS = 0.5
MAX_BYTES = 4 << 30


def default_folder() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "agentrl-jax" / "xla"


def use_compile_cache(setting: str | None) -> Path | None:
    """Point jax's persistent compilation cache at the folder ``setting`` names (see the module
    docstring) before anything compiles; the folder used, or None (off, or the environment's
    own cache)."""
    import jax  # noqa: PLC0415  (the CLI imports jax lazily)

    if setting is not None and setting.strip().lower() == "off":
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    if setting is None and os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return None
    try:
        folder = output_folder(
            Path(setting) if setting is not None else default_folder(), "--compile-cache"
        )
    except typer.BadParameter:
        if setting is not None:
            raise
        return None  # no writable default (e.g. a read-only home): compile as without one
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    try:  # (a jax without the setting keeps every entry)
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    except AttributeError:
        pass
    return folder
