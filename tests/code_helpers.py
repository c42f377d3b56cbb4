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


def _status(pid: str) -> dict[str, str]:
    try:
        text = (pathlib.Path("/proc") / pid / "status").read_text()
    except OSError:  # it ended meanwhile
        return {}
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def _ancestors(fields: dict[str, str]) -> list[tuple[int, int]]:
    """``(pid, parent pid)`` of each ancestor of the process whose status is ``fields``."""
    chain, seen = [], set()
    while (pid := int(fields.get("PPid", "0").strip() or 0)) > 0 and pid not in seen:
        seen.add(pid)
        fields = _status(str(pid))
        chain.append((pid, int(fields.get("PPid", "0").strip() or 0)))
    return chain


def sandbox_processes() -> list[str]:
    """PIDs of living processes that run as a sandbox uid (strict isolation's candidates),
    except those another test worker is running (``pytest -n``: a sibling of this process
    among their ancestors). Orphans, whose parents are gone, always count."""
    me, my_parent = os.getpid(), os.getppid()
    found = []
    for entry in pathlib.Path("/proc").glob("[0-9]*"):
        fields = _status(entry.name)
        uid = int(fields.get("Uid", "0").split()[0])
        if not (UID_RANGE[0] <= uid <= UID_RANGE[1] + 1) or fields.get("State", "").split()[:1] == [
            "Z"
        ]:
            continue
        chain = _ancestors(fields)
        other_worker = all(pid != me for pid, _ in chain) and any(
            parent == my_parent for pid, parent in chain
        )
        if not other_worker:
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
