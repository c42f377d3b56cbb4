"""The one guarded way this project deletes a folder.

Every folder the project removes goes through :func:`remove_folder`, which deletes only a
folder of the kind the caller names, recognised by what this project leaves in it, never
follows a symbolic link, and otherwise refuses with one line saying what it found and how to
proceed (:class:`FolderGuardError`), touching nothing. A mistyped ``--out --fresh`` (``.``,
``~``, a repository, a folder of one's own files) is refused, never emptied.

A folder this project makes and may delete later is *claimed* when it is made
(:func:`claim`): a marker file :data:`MARKER` naming its kind. Kinds whose folders are made
by another library (Orbax's interrupted saves) or were made before markers existed (results
folders of earlier versions) are recognised by their layout instead (:class:`FolderKind`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Callable

MARKER = ".agentrl-jax"  # {"kind": NAME}: the project made this folder as a NAME


class FolderGuardError(ValueError):
    """A folder the project was asked to delete is not one it may delete (the message says
    what was found there and that nothing was touched)."""


@dataclasses.dataclass(frozen=True)
class FolderKind:
    """A kind of folder the project makes and deletes: its ``name`` (the marker's ``kind``),
    what it is in words (``what``, for messages), and ``layout``: how a folder of this kind
    made without a marker is recognised (None: only by its marker)."""

    name: str
    what: str
    layout: Callable[[Path], bool] | None = None

    def holds(self, path: Path) -> bool:
        """Whether the real (not symlinked) folder ``path`` is of this kind."""
        return marked_kind(path) == self.name or (self.layout is not None and self.layout(path))


def claim(path: str | Path, kind: FolderKind) -> Path:
    """Makes ``path`` (and its parents) if needed and marks it as a folder of ``kind``, so that
    :func:`remove_folder` may delete it later. A folder marked with another kind is refused."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    found = marked_kind(path)
    if found not in (None, kind.name):
        raise FolderGuardError(
            f"{path} is marked as a {found} folder of agentrl-jax, not a {kind.what}; "
            "choose another folder"
        )
    if found is None:
        (path / MARKER).write_text(json.dumps({"kind": kind.name}) + "\n")
    return path


def marked_kind(path: str | Path) -> str | None:
    """The kind ``path``'s marker names (None: no readable marker; a symlinked marker is no
    marker)."""
    marker = Path(path) / MARKER
    try:
        if marker.is_symlink() or not marker.is_file() or marker.stat().st_size > 4096:
            return None
        kind = json.loads(marker.read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return None
    return kind if isinstance(kind, str) else None


def remove_folder(path: str | Path, kind: FolderKind) -> bool:
    """Deletes the folder ``path`` if it is a folder of ``kind`` or empty (False: there was
    nothing to delete). Refuses, with :class:`FolderGuardError` and nothing touched: a symbolic link
    (never followed), a file, a folder of another kind or of no kind (e.g. a user's own files).
    The folder's contents are removed without following the links inside it."""
    path = Path(path)
    if path.is_symlink():
        raise FolderGuardError(
            f"{path} is a symbolic link (to {os.readlink(path)}), not a {kind.what}; nothing "
            "was deleted; name the folder itself"
        )
    if not path.exists():
        return False
    if not path.is_dir():
        raise FolderGuardError(f"{path} is a file, not a {kind.what}; nothing was deleted")
    if not any(path.iterdir()):  # an empty folder: nothing to lose (a mkdir made ahead)
        path.rmdir()
        return True
    if not kind.holds(path):
        raise FolderGuardError(
            f"{path} is not a {kind.what} made by agentrl-jax ({_found(path)}); nothing was deleted"
        )
    shutil.rmtree(
        path
    )  # fd-based where the platform allows: links inside are unlinked, not followed
    return True


def _found(path: Path, shown: int = 3) -> str:
    """What ``path`` holds, in a few words: ``it holds a.txt, b/ and 3 more``."""
    try:
        names = sorted(e.name + ("/" if e.is_dir() else "") for e in os.scandir(path))
    except OSError as error:
        return f"it cannot be read: {error.strerror or error}"
    listed = ", ".join(names[:shown]) + (
        f" and {len(names) - shown} more" if len(names) > shown else ""
    )
    return f"it holds {listed}"


SCRATCH = FolderKind("scratch", "scratch folder")
