"""Orbax checkpoints of a whole run, and resuming from the latest good one.

A checkpoint ``<directory>/<step>/`` holds two Orbax items:

* ``state``: the :class:`~agentrl_jax.train.state.TrainState` pytree (policy, reference and
  critic parameters, both optimizer states, step, PRNG key, data position, skip count);
* ``config``: JSON with the :class:`~agentrl_jax.train.config.TrainConfig` (``to_dict``) and
  any caller metadata (e.g. the model directory).

:class:`Checkpointer` saves every ``every`` steps (and at the last step), keeps the newest
``keep``, and writes asynchronously (Orbax copies the arrays to the host before ``save``
returns, then writes in the background; a step directory only appears once complete).

Restoring (:meth:`Checkpointer.restore_latest`) tries the newest step first. A checkpoint
that fails to restore (files missing or truncated, unreadable data, a tree that no longer
matches the state) is reported with a :class:`CorruptCheckpointWarning` naming its path and
the reason, moved aside to ``<step>.corrupt`` (so the resumed run can write that step again),
and the next older one is tried. Leftovers of an interrupted save (Orbax's temporary
directories) are reported the same way and removed. If checkpoints exist but none restores,
:class:`CheckpointRestoreError` lists every path and reason.
"""

from __future__ import annotations

import dataclasses
import gc
import shutil
import warnings
from pathlib import Path
from typing import Any, Mapping

import jax
import orbax.checkpoint as ocp

from agentrl_jax.train.config import TrainConfig
from agentrl_jax.train.state import TrainState

CORRUPT_SUFFIX = ".corrupt"
_TMP_MARKER = ".orbax-checkpoint-tmp"


class CorruptCheckpointWarning(UserWarning):
    """A checkpoint could not be used and was skipped (the message names its path)."""


class CheckpointRestoreError(RuntimeError):
    """Checkpoints exist but none could be restored."""


@dataclasses.dataclass(frozen=True)
class Restored:
    state: TrainState
    step: int
    path: Path
    config: dict[str, Any]                     # the saved JSON: {"train_config": ..., **metadata}
    skipped: tuple[tuple[Path, str], ...] = ()  # (path, reason) of newer checkpoints that failed

    @property
    def train_config(self) -> TrainConfig:
        return TrainConfig.from_dict(self.config["train_config"])


class Checkpointer:
    """Saves and restores :class:`TrainState` checkpoints under ``directory`` (see module doc)."""

    def __init__(self, directory: str | Path, *, every: int, keep: int, async_save: bool = True):
        for name, value in (("every", every), ("keep", keep)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Checkpointer {name}: must be an int >= 1, got {value!r}")
        self.directory = Path(directory).absolute()
        self.every, self.keep, self.async_save = every, keep, async_save
        self.directory.mkdir(parents=True, exist_ok=True)
        self._report_interrupted_saves()
        self._manager = self._open()

    @classmethod
    def from_config(cls, directory: str | Path, config: TrainConfig, **kwargs) -> "Checkpointer":
        return cls(directory, every=config.checkpoint_every, keep=config.checkpoint_keep, **kwargs)

    def _open(self) -> ocp.CheckpointManager:
        options = ocp.CheckpointManagerOptions(max_to_keep=self.keep, create=True,
                                               enable_async_checkpointing=self.async_save)
        return ocp.CheckpointManager(self.directory, options=options)

    def _report_interrupted_saves(self) -> None:
        for tmp in sorted(self.directory.glob(f"*{_TMP_MARKER}*")):
            warnings.warn(f"checkpoint {tmp}: an interrupted save (incomplete); removing it",
                          CorruptCheckpointWarning, stacklevel=3)
            shutil.rmtree(tmp, ignore_errors=True)

    # ------------------------------------------------------------------ saving
    def path(self, step: int) -> Path:
        return self.directory / str(step)

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints on disk, ascending."""
        return sorted(self._manager.all_steps())

    def should_save(self, step: int, total_steps: int | None = None) -> bool:
        return step % self.every == 0 or step == total_steps

    def save(self, state: TrainState, config: TrainConfig, metadata: Mapping[str, Any] | None = None) -> Path:
        """Saves ``state`` at its step; returns the step's directory.

        Returns once the arrays are copied to host memory; files are written in the background
        (:meth:`wait` blocks until they are). So the next train step may donate ``state``.
        """
        step = int(state.step)
        payload = {"train_config": config.to_dict(), **dict(metadata or {})}
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                         config=ocp.args.JsonSave(payload)), force=True)
        return self.path(step)

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ restoring
    def restore_latest(self, template: TrainState) -> Restored | None:
        """The newest checkpoint that restores into ``template``'s structure, or None if none exist.

        ``template`` is a state of the same run (arrays or ShapeDtypeStructs; their shardings,
        if any, are where the restored arrays go), e.g. ``init_train_state(model, config)``.
        """
        self.wait()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        skipped: list[tuple[Path, str]] = []
        for step in sorted(self._manager.all_steps(), reverse=True):
            path = self.path(step)
            try:
                restored = self._manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), config=ocp.args.JsonRestore()))
                _check_restored(restored.state, abstract, restored.config)
            except Exception as e:  # noqa: BLE001 - any failure means this checkpoint is unusable
                reason = f"{type(e).__name__}: {str(e).splitlines()[0][:500] if str(e) else ''}"
                skipped.append((path, reason))
                warnings.warn(f"checkpoint {path} is corrupt or incomplete and was skipped ({reason}); "
                              f"moving it to {path}{CORRUPT_SUFFIX} and trying the previous one",
                              CorruptCheckpointWarning, stacklevel=2)
                self._set_aside(path)
                # Orbax leaves the failed restore's pending read coroutines behind; collect them
                # now, so Python's "exception ignored" reports come here, not at a random later time.
                gc.collect()
                continue
            return Restored(restored.state, step, path, dict(restored.config), tuple(skipped))
        if skipped:
            details = "; ".join(f"{p}: {r}" for p, r in skipped)
            raise CheckpointRestoreError(f"no checkpoint under {self.directory} could be restored: {details}")
        return None

    def _set_aside(self, path: Path) -> None:
        target = Path(f"{path}{CORRUPT_SUFFIX}")
        n = 1
        while target.exists():
            target, n = Path(f"{path}{CORRUPT_SUFFIX}{n}"), n + 1
        self._manager.close()
        shutil.move(str(path), str(target))
        self._manager = self._open()


def _check_restored(state: Any, abstract: Any, config: Any) -> None:
    if jax.tree.structure(state) != jax.tree.structure(abstract):
        raise ValueError("restored state tree does not match the run's state structure")
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(abstract)):
        if got.shape != want.shape or got.dtype != want.dtype:
            raise ValueError(f"restored array {got.shape} {got.dtype} does not match {want.shape} {want.dtype}")
    if not isinstance(config, Mapping) or "train_config" not in config:
        raise ValueError("the config item has no 'train_config'")
