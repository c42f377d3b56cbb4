"""The reproduction's results folder: ``config.yaml`` (the exact config; a folder made with
another config is refused), ``phases.json`` (each finished phase, written atomically) and
``plugins.json`` (the user plugins the runs were made with). :mod:`.pipeline` runs the phases
into it.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from agentrl_jax.config_io import dump_config
from agentrl_jax.evaluation.evaluate_policies import EvalError
from agentrl_jax.folders import MARKER, FolderGuardError, FolderKind, claim, remove_folder
from agentrl_jax.plugins import loaded_plugins
from agentrl_jax.reproduce.config import ReproduceConfig, load_config
from agentrl_jax.reproduce.machine import machine

PHASES_FILE, CONFIG_FILE, PLUGINS_FILE = "phases.json", "config.yaml", "plugins.json"


class ReproduceError(EvalError):
    """A request the pipeline refuses (the message says why and what to do); an
    :class:`~agentrl_jax.evaluation.evaluate_policies.EvalError` (what ``eval`` refuses) too."""


class ResultsFolderError(ReproduceError):
    """The results folder cannot be used (e.g. it holds a run of another config)."""


def _results_layout(path: Path) -> bool:
    """A results folder made before folders were marked: its ``config.yaml`` and
    ``phases.json``, both plain files."""
    return all(
        (path / name).is_file() and not (path / name).is_symlink()
        for name in (CONFIG_FILE, PHASES_FILE)
    )


RESULTS = FolderKind("results", "results folder", layout=_results_layout)


class Phases:
    """``out/phases.json``: finished phases and what they recorded."""

    def machines(self) -> list[dict[str, Any]]:
        """The machines the finished phases ran on, each once, in order (a resumed run may have
        moved); phases recorded before machines were recorded are left out."""
        seen: list[dict[str, Any]] = []
        for record in self.done.values():
            found = record.get("machine") if isinstance(record, dict) else None
            if isinstance(found, dict) and found not in seen:
                seen.append(found)
        return seen

    def __init__(self, out: Path):
        self.path = out / PHASES_FILE
        self.done: dict[str, dict[str, Any]] = (
            json.loads(self.path.read_text()) if self.path.exists() else {}
        )

    def finish(self, name: str, seconds: float, **info: Any) -> None:
        """Records phase ``name`` as finished (with the machine it ran on, :func:`machine`)."""
        self.done[name] = {"seconds": round(seconds, 2), **info, "machine": machine()}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.done, indent=2))
        tmp.replace(self.path)  # atomic: a kill never leaves half a record


def recorded_plugins(out: Path) -> list[dict[str, Any]]:
    """The plugins ``out/plugins.json`` records ([] if none or unreadable)."""
    try:
        records = json.loads((Path(out) / PLUGINS_FILE).read_text())["plugins"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [r for r in records if isinstance(r, dict) and isinstance(r.get("module"), str)]


def plugins_hint(out: Path) -> str:
    """``""``, or a sentence naming the plugins ``out``'s runs were made with (for an error)."""
    records = recorded_plugins(out)
    if not records:
        return ""
    return (
        f"; {out} was made with the plugins {', '.join(str(r.get('spec')) for r in records)}: "
        "pass them again with --plugin (or AGENTRL_JAX_PLUGINS)"
    )


def record_plugins(out: Path) -> list[dict[str, Any]]:
    """Writes ``out/plugins.json``: the plugins recorded before, then those loaded in this
    process (a plugin loaded again replaces its record; if its file changed, a warning, and
    the old sha256 values stay in ``earlier_sha256``)."""
    records = {r["module"]: r for r in recorded_plugins(out)}
    for record in loaded_plugins():
        before = records.pop(record["module"], None)
        earlier = list(before.get("earlier_sha256", [])) if before is not None else []
        if before is not None and before.get("sha256") != record["sha256"]:
            warnings.warn(
                f"plugin {record['spec']} changed since {out}'s runs began (sha256 "
                f"{str(before.get('sha256'))[:12]} -> {str(record['sha256'])[:12]})",
                stacklevel=2,
            )
            earlier.append(before.get("sha256"))
        records[record["module"]] = {**record, **({"earlier_sha256": earlier} if earlier else {})}
    if records:
        (out / PLUGINS_FILE).write_text(json.dumps({"plugins": list(records.values())}, indent=2))
    return list(records.values())


def prepare_folder(out: Path, config: ReproduceConfig, fresh: bool) -> None:
    """Create ``out`` (or check that it holds this config), and write ``config.yaml`` (and
    ``plugins.json``). ``fresh`` deletes ``out`` first, only if it is a results folder
    (:data:`RESULTS`: one this project made); anything else is refused, untouched."""
    if fresh:
        try:
            remove_folder(out, RESULTS)
        except FolderGuardError as error:
            raise ResultsFolderError(f"--fresh: {error}; choose another --out") from None
    saved = out / CONFIG_FILE
    if saved.exists():
        try:
            previous = load_config(saved)
        except ValueError as error:  # ConfigError, naming the file and the field
            raise ResultsFolderError(
                f"{error}{plugins_hint(out)}; use --fresh or another --out"
            ) from None
        if previous != config:
            before = previous.to_dict()
            changed = [
                f"{s}.{k}"
                for s, fields in config.to_dict().items()
                for k, v in fields.items()
                if before[s][k] != v
            ]
            raise ResultsFolderError(
                f"{out} holds a run of another config (differs in "
                f"{', '.join(changed)}); use --fresh to start over or "
                "another --out"
            )
    elif out.exists() and any(entry.name != MARKER for entry in out.iterdir()):
        raise ResultsFolderError(
            f"{out} is not empty and holds no {CONFIG_FILE}; choose another --out"
        )
    try:
        claim(out, RESULTS)
    except FolderGuardError as error:
        raise ResultsFolderError(f"{error}") from None
    saved.write_text(dump_config(config))
    record_plugins(out)
