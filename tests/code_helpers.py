"""Shared by the code-sandbox tests: a run root that must be left empty and process-free."""

import os
import pathlib

from envs.code.isolation import UID_RANGE


def processes_under(root: pathlib.Path) -> list[str]:
    """PIDs of the processes whose working directory is inside ``root``."""
    found = []
    for entry in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            cwd = os.readlink(entry / "cwd")
        except OSError:  # it ended meanwhile
            continue
        if cwd.startswith(str(root)):
            found.append(entry.name)
    return found


def sandbox_processes() -> list[str]:
    """PIDs of living processes that run as a sandbox uid (strict isolation's candidates)."""
    found = []
    for entry in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        uid = int(fields.get("Uid", "0").split()[0])
        if UID_RANGE[0] <= uid <= UID_RANGE[1] + 1 and fields.get("State", "").split()[:1] != ["Z"]:
            found.append(entry.name)
    return found


def make_clean_root(tmp_path: pathlib.Path):
    """Yield a directory for runs' working directories; afterwards check that it is empty
    and that no process is left running in it or as a sandbox uid (use as a pytest fixture
    body)."""
    root = tmp_path / "runs"
    root.mkdir()
    yield root
    assert list(root.iterdir()) == [], "a run left its working directory behind"
    assert processes_under(root) == [], "a run left processes behind"
    assert sandbox_processes() == [], "a run left sandboxed processes behind"
