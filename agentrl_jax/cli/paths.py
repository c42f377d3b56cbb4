"""Output paths checked before any work: a one-line error for a ``--out`` that cannot be written.

A results folder must be a folder (or not exist yet) under a writable folder; a results file
must not be a folder, and its folder must be writable. Checked when the command starts, so an
hour of computing never ends in a traceback from ``mkdir`` or ``open``.
"""

from __future__ import annotations

import os
from pathlib import Path

import typer


def _writable_ancestor(path: Path, option: str) -> None:
    """The nearest existing folder above (or at) ``path`` is a folder we may write into."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise typer.BadParameter(
            f"{option} {path}: {probe} is a file, so no folder can be made there"
        )
    if not os.access(probe, os.W_OK | os.X_OK):
        raise typer.BadParameter(
            f"{option} {path}: {probe} is not writable (read-only file system or permissions)"
        )


def output_folder(path: Path, option: str = "--out") -> Path:
    """``path`` if it is, or can be made, a writable folder; else a one-line ``BadParameter``.
    A symbolic link to a folder is resolved (the folder it points to is returned); a link to
    nothing is refused."""
    if path.is_symlink():
        if not path.exists():
            raise typer.BadParameter(
                f"{option} {path}: is a symbolic link to {os.readlink(path)}, which does not "
                "exist; name a folder"
            )
        path = path.resolve()
    if path.exists() and not path.is_dir():
        raise typer.BadParameter(f"{option} {path}: is a file, not a folder")
    _writable_ancestor(path, option)
    return path


def output_file(path: Path, option: str = "--out") -> Path:
    """``path`` if a file can be written there; else a one-line ``BadParameter``."""
    if path.is_dir():
        raise typer.BadParameter(f"{option} {path}: is a folder, not a file")
    if path.exists() and not os.access(path, os.W_OK):
        raise typer.BadParameter(f"{option} {path}: is not writable")
    _writable_ancestor(path.parent, option)
    return path
