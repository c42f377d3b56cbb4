"""Orbax checkpoints of a whole run, and resuming from the latest good one.

A checkpoint ``<directory>/<step>/`` holds two Orbax items:

* ``state``: the :class:`~agentrl_jax.train.state.TrainState` pytree (policy, reference and
  critic parameters, both optimizer states, step, PRNG key, data position, skip count); with
  LoRA the policy is the adapters and the frozen base is not saved: a resumed run takes it
  from the model it is started with, as the first run did (the JSON keeps a fingerprint of the
  base, and a resume on another base raises :class:`CheckpointMismatchError`);
* ``config``: JSON with the :class:`~agentrl_jax.train.config.TrainConfig` (``to_dict``) and
  any caller metadata (e.g. the model directory);
* ``pending`` (asynchronous runs only, ``rl.asynchronous.max_staleness > 0``): the batches sampled
ahead
  of the saved step (:class:`~agentrl_jax.train.loop.Produced`: trajectory, step scores and
  key as arrays; their logged metrics, data position and policy version in ``config``'s
  JSON), so a resumed run trains on exactly the batches the uninterrupted one would have.
  :meth:`Checkpointer.restore_pending` checks them against the resuming run before it uses
  them (:func:`pending_description_problem`, :func:`pending_arrays_problem`): their count
  against its ``rl.asynchronous.max_staleness``, each batch's arrays (names, rows, turns, width,
  dtypes, key) against the batches its rollouts produce (:class:`BatchShape`), each data position
  and policy version against the restored state's and the staleness bound; a batch that
  does not fit raises :class:`CheckpointMismatchError` and the checkpoint stays in place.

:class:`Checkpointer` saves every ``every`` steps (and at the last step), keeps the newest
``keep``, and writes asynchronously (Orbax copies the arrays to the host before ``save``
returns, then writes in the background; a step directory only appears once complete).

Restoring (:meth:`Checkpointer.restore_latest`) tries the newest step first. A checkpoint
whose saved arrays (names, shapes, dtypes, read from its metadata) differ from the run's state
was written by a different config (another model size, optimizer, critic): that raises
:class:`CheckpointMismatchError` ("checkpoint step N at PATH was written by a different config:
...") and the checkpoint is left in place, since it is not damaged and the run pointed at the
wrong directory or config. A checkpoint that fails to restore otherwise (files missing or
truncated, unreadable data) is reported with a :class:`CorruptCheckpointWarning` naming its
path and the reason, moved aside to ``<step>.corrupt`` (so the resumed run can write that step
again), and the next older one is tried. Leftovers of an interrupted save (Orbax's temporary
directories) are reported the same way and removed. If checkpoints exist but none restores,
:class:`CheckpointRestoreError` lists every path and reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import shutil
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp

from agentrl_jax import distributed
from agentrl_jax.folders import FolderKind, remove_folder
from agentrl_jax.train.batch import Produced, TrainBatch
from agentrl_jax.train.config import TrainConfig
from agentrl_jax.train.restore_checks import (
    BatchShape,
    PendingExpectation,
    array_spec,
    fingerprint_problem,
    pending_arrays_problem,
    pending_description_problem,
    shown_value,
)
from agentrl_jax.train.state import TrainState
from agentrl_jax.trajectory import Trajectory
from agentrl_jax.uninterrupted import uninterrupted

CORRUPT_SUFFIX = ".corrupt"
_TMP_MARKER = ".orbax-checkpoint-tmp"
# an interrupted save: the temporary folder Orbax writes a checkpoint into, by Orbax's name
INTERRUPTED_SAVE = FolderKind(
    "interrupted-save", "interrupted checkpoint save", layout=lambda p: _TMP_MARKER in p.name
)


class CorruptCheckpointWarning(UserWarning):
    """A checkpoint could not be used and was skipped (the message names its path)."""


class CheckpointRestoreError(RuntimeError):
    """Checkpoints exist but none could be restored."""


class CheckpointMismatchError(CheckpointRestoreError):
    """The newest checkpoint holds another run's state: its arrays (names, shapes, dtypes) differ
    from the template's, e.g. another model size or optimizer; or an item does not fit the run
    restoring it (batches sampled ahead of another shape, count or position; LoRA adapters of
    another base, or without a readable fingerprint of theirs). It is left in place."""


@dataclasses.dataclass(frozen=True)
class Restored:
    state: TrainState
    step: int
    path: Path
    config: dict[str, Any]  # the saved JSON: {"train_config": ..., **metadata}
    skipped: tuple[tuple[Path, str], ...] = ()  # (path, reason) of newer checkpoints that failed
    # the config of the run restoring it (restore_latest's), which restore_pending checks the
    # batches sampled ahead against; None: only the checks that need no config
    run_config: TrainConfig | None = None

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
        return cls(
            directory, every=config.rl.checkpoint.every, keep=config.rl.checkpoint.keep, **kwargs
        )

    def _open(self) -> ocp.CheckpointManager:
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self.keep, create=True, enable_async_checkpointing=self.async_save
        )
        # Handlers named up front, so a freshly opened manager can read the items' metadata.
        handlers = {
            "state": ocp.StandardCheckpointHandler(),
            "config": ocp.JsonCheckpointHandler(),
            "pending": ocp.StandardCheckpointHandler(),
        }
        return ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def _report_interrupted_saves(self) -> None:
        for tmp in sorted(self.directory.glob(f"*{_TMP_MARKER}*")):
            warnings.warn(
                f"checkpoint {tmp}: an interrupted save (incomplete); removing it",
                CorruptCheckpointWarning,
                stacklevel=3,
            )
            with contextlib.suppress(OSError):
                remove_folder(tmp, INTERRUPTED_SAVE)

    # ------------------------------------------------------------------ saving
    def path(self, step: int) -> Path:
        return self.directory / str(step)

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints on disk, ascending."""
        return sorted(self._manager.all_steps())

    def should_save(self, step: int, total_steps: int | None = None) -> bool:
        return step % self.every == 0 or step == total_steps

    def save(
        self,
        state: TrainState,
        config: TrainConfig,
        metadata: Mapping[str, Any] | None = None,
        *,
        pending: Sequence[Any] = (),
    ) -> Path:
        """Saves ``state`` at its step (and an asynchronous run's ``pending`` batches,
        :class:`~agentrl_jax.train.loop.Produced`); returns the step's directory.

        Returns once the arrays are copied to host memory; files are written in the background
        (:meth:`wait` blocks until they are). So the next train step may donate ``state``.
        """
        step = int(state.step)
        payload = {"train_config": config.to_dict(), **dict(metadata or {})}
        # LoRA: the frozen base is the model the run started from, not saved again
        items = {"state": ocp.args.StandardSave(state.replace(base=None))}
        if state.base is not None:
            payload["base_fingerprint"] = base_fingerprint(state.base)
        if pending:
            arrays, payload["pending"] = _pending_arrays(pending)
            items["pending"] = ocp.args.StandardSave(arrays)
        with uninterrupted():  # Ctrl-C lands after the save's synchronous part, not inside it
            self._manager.save(
                step,
                args=ocp.args.Composite(config=ocp.args.JsonSave(payload), **items),
                force=True,
            )
        return self.path(step)

    def restore_pending(self, restored: "Restored", batch: BatchShape | None = None) -> list[Any]:
        """The batches an asynchronous run had sampled ahead of ``restored``'s step (in
        order; [] if it saved none), each a :class:`~agentrl_jax.train.loop.Produced` with its
        key on the host (place it where the state's key lies).

        They are checked first (see the module docstring) against ``restored``'s state, the
        config of the run restoring it (``restored.run_config``: its
        ``rl.asynchronous.max_staleness``, rows, data draws per batch, step scores, loss positions;
        without one, only what needs none) and ``batch``, the sizes of the batches the run's
        rollouts produce. A batch that does not fit raises :class:`CheckpointMismatchError`, one
        that cannot be read
        :class:`CheckpointRestoreError`; either names the checkpoint, which stays in place."""
        described = restored.config.get("pending")
        if described is None or described == []:
            return []
        expected = _expected_pending(restored, batch or BatchShape())
        arrays = None
        problem = pending_description_problem(described, expected)
        if not problem:  # the arrays are read only for a description that fits
            arrays = self._read_pending(restored)
            problem = pending_arrays_problem(arrays, len(described), expected)
        if problem:
            raise CheckpointMismatchError(
                f"checkpoint {restored.path}: its batches sampled ahead (pending) do not fit "
                f"this run: {problem}. It is left as it is: resume with the config that wrote "
                "it, or give this run another checkpoint directory"
            )
        return _pending_batches(arrays, described)

    def _read_pending(self, restored: "Restored") -> Any:
        try:  # a damaged item is an error naming it, never a half-read queue
            return self._manager.restore(
                restored.step, args=ocp.args.Composite(pending=ocp.args.StandardRestore())
            ).pending
        except Exception as e:  # noqa: BLE001 - any failure: the resumed run cannot be exact
            reason = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            raise CheckpointRestoreError(
                f"checkpoint {restored.path}: its batches sampled ahead (pending) cannot be "
                f"read ({reason}); an asynchronous run resumes exactly only with them"
            ) from None

    def wait(self) -> None:
        with uninterrupted():  # a checkpoint being written is finished, not left half-made
            self._manager.wait_until_finished()

    def close(self) -> None:
        with uninterrupted():
            self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ restoring
    def restore_latest(
        self, template: TrainState, config: TrainConfig | None = None
    ) -> Restored | None:
        """The newest checkpoint that restores into ``template``'s structure, or None if none exist.

        ``template`` is a state of the same run (arrays or ShapeDtypeStructs; their shardings,
        if any, are where the restored arrays go), e.g. ``init_train_state(model, config)``.
        A checkpoint whose arrays differ from the template's (another config: model size,
        optimizer, critic) raises :class:`CheckpointMismatchError` and is left in place;
        ``config``, the run's, makes that message list the trainer settings that differ, and
        is what :meth:`restore_pending` checks the batches sampled ahead against.
        """
        self.wait()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template.replace(base=None))
        skipped: list[tuple[Path, str]] = []
        for step in sorted(self._manager.all_steps(), reverse=True):
            path = self.path(step)
            mismatch = self._mismatch(step, abstract, config)
            if mismatch:
                raise CheckpointMismatchError(
                    f"checkpoint step {step} at {path} was written by a different config: "
                    f"{mismatch}. It is left as it is (it is not corrupt): resume with the config "
                    "that wrote it, or give this run another checkpoint directory"
                )
            try:
                restored = self._read(step, abstract)
            except Exception as e:  # noqa: BLE001 - any failure means this checkpoint is unusable
                reason = f"{type(e).__name__}: {str(e).splitlines()[0][:500] if str(e) else ''}"
                skipped.append((path, reason))
                warnings.warn(
                    f"checkpoint {path} is corrupt or incomplete and was skipped ({reason}); "
                    f"moving it to {path}{CORRUPT_SUFFIX} and trying the previous one",
                    CorruptCheckpointWarning,
                    stacklevel=2,
                )
                self._set_aside(path)
                # Orbax leaves the failed restore's pending read coroutines behind; collect them
                # now, so Python's "exception ignored" reports come here, not at a random later
                # time.
                gc.collect()
                continue
            state = restored.state.replace(base=template.base)  # LoRA: the run's own base
            _check_base(template, dict(restored.config), step, path)
            return Restored(
                state, step, path, dict(restored.config), tuple(skipped), run_config=config
            )
        if skipped:
            details = "; ".join(f"{p}: {r}" for p, r in skipped)
            raise CheckpointRestoreError(
                f"no checkpoint under {self.directory} could be restored: {details}"
            )
        return None

    def restore_step(self, template: TrainState, step: int) -> TrainState:
        """The state saved at ``step`` (read only: a checkpoint that does not restore into
        ``template``'s structure raises :class:`CheckpointRestoreError` and stays in place),
        e.g. to score a run's snapshots after training."""
        self.wait()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template.replace(base=None))
        mismatch = self._mismatch(step, abstract, None)
        if mismatch:
            raise CheckpointMismatchError(f"checkpoint step {step}: {mismatch}")
        try:
            restored = self._read(step, abstract)
        except Exception as e:  # noqa: BLE001 - reported as one error naming the checkpoint
            raise CheckpointRestoreError(
                f"checkpoint {self.path(step)} cannot be restored: {type(e).__name__}: "
                f"{str(e).splitlines()[0][:300] if str(e) else ''}"
            ) from None
        _check_base(template, dict(restored.config), step, self.path(step))
        return restored.state.replace(base=template.base)

    def _read(self, step: int, abstract: Any) -> Any:
        """The checkpoint at ``step`` (its state restored into ``abstract``, and its config),
        checked against ``abstract``; raises whatever the read raises."""
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), config=ocp.args.JsonRestore()
            ),
        )
        _check_restored(restored.state, abstract, restored.config)
        return restored

    def _mismatch(self, step: int, abstract: Any, config: TrainConfig | None) -> str:
        """How the saved state's arrays differ from ``abstract``'s ("" if they agree, or if the
        checkpoint's metadata cannot be read: then the restore itself decides)."""
        try:
            saved = self._manager.item_metadata(step)["state"]
            saved = None if saved is None else ocp.tree.to_flat_dict(getattr(saved, "tree", saved))
        except Exception:  # noqa: BLE001 - unreadable metadata: a damaged checkpoint, not another config
            return ""
        if not saved:
            return ""
        wanted = ocp.tree.to_flat_dict(ocp.tree.serialize_tree(abstract, keep_empty_nodes=True))
        differences = tree_differences(saved, wanted)
        if differences and config is not None:
            differences += self._config_differences(step, config)
        return "; ".join(differences)

    def _config_differences(self, step: int, config: TrainConfig) -> list[str]:
        try:
            saved = self._manager.restore(
                step, args=ocp.args.Composite(config=ocp.args.JsonRestore())
            ).config["train_config"]
        except Exception:  # noqa: BLE001 - the arrays' differences are reported anyway
            return []
        if not isinstance(saved, Mapping):
            return [f"its train_config is {shown_value(saved)}, not a JSON object"]
        return config_differences(saved, config.to_dict())

    def _set_aside(self, path: Path) -> None:
        target = Path(f"{path}{CORRUPT_SUFFIX}")
        n = 1
        while target.exists():
            target, n = Path(f"{path}{CORRUPT_SUFFIX}{n}"), n + 1
        self._manager.close()
        shutil.move(str(path), str(target))
        self._manager = self._open()


def _pending_arrays(pending: Sequence[Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Batches sampled ahead as ``({index: {trajectory, step_scores, rng}}, [JSON of each])``,
    the arrays on the host (every process holds every batch's rows). A dense policy's
    ``experts`` (``[N, L, 0, 0]``: Orbax saves no empty array) are left out; reading the
    batch back restores them (:meth:`~agentrl_jax.trajectory.Trajectory.from_arrays`)."""
    arrays, described = {}, []
    for i, produced in enumerate(pending):
        batch = produced.batch
        trajectory = {
            f.name: np.asarray(getattr(batch.trajectory, f.name))
            for f in dataclasses.fields(batch.trajectory)
        }
        if trajectory["experts"].size == 0:
            del trajectory["experts"]
        item = {
            "trajectory": trajectory,
            "rng": distributed.host_value(produced.rng),
        }
        if batch.step_scores is not None:
            item["step_scores"] = np.asarray(batch.step_scores)
        arrays[str(i)] = item
        described.append(
            {
                "metrics": produced.metrics,
                "position": int(produced.position),
                "version": int(produced.version),
            }
        )
    return arrays, described


def _pending_batches(
    arrays: Mapping[str, Any], described: Sequence[Mapping[str, Any]]
) -> list[Produced]:
    """The checked batches sampled ahead (:func:`pending_description_problem`,
    :func:`pending_arrays_problem`) as :class:`Produced`."""
    out = []
    for i, about in enumerate(described):
        item = arrays[str(i)]
        batch = TrainBatch(Trajectory.from_arrays(item["trajectory"]), item.get("step_scores"))
        out.append(
            Produced(
                batch,
                dict(about["metrics"]),
                item["rng"],
                int(about["position"]),
                int(about["version"]),
            )
        )
    return out


def _expected_pending(restored: "Restored", batch: BatchShape) -> PendingExpectation:
    state = restored.state
    return PendingExpectation(
        step=restored.step,
        data_position=int(state.data_position),
        position_max=int(np.iinfo(np.dtype(state.data_position.dtype)).max),
        rng=array_spec(state.rng),
        batch=batch,
        config=restored.run_config,
    )


@jax.jit
def _leaf_moments(base: Any) -> Any:
    return [
        jax.numpy.stack(
            [
                jax.numpy.sum(x.astype(jax.numpy.float32)),
                jax.numpy.sum(jax.numpy.square(x.astype(jax.numpy.float32))),
            ]
        )
        for x in jax.tree.leaves(base)
    ]


def base_fingerprint(base: Any) -> list[float]:
    """A LoRA run's frozen base in a few numbers: each weight's sum and sum of squares
    (float32, in leaf order). Another model differs in them by far more than the float
    rounding of another device or layout."""
    return [float(v) for pair in jax.device_get(_leaf_moments(base)) for v in np.asarray(pair)]


def _check_base(template: TrainState, saved: Mapping[str, Any], step: int, path: Path) -> None:
    """Raises :class:`CheckpointMismatchError` if a LoRA run's checkpoint was trained on another
    base than ``template``'s (its saved fingerprint, :func:`base_fingerprint`, differs) or its
    fingerprint is missing or malformed (fails closed: the base cannot be checked)."""
    if template.base is None:
        return
    problem = fingerprint_problem(saved, 2 * len(jax.tree.leaves(template.base)))
    if problem:
        raise CheckpointMismatchError(
            f"checkpoint step {step} at {path} holds LoRA adapters, but {problem}: the base "
            "model they were trained on cannot be checked, and may be another base model than "
            "this run's. It is left as it is; resume from a checkpoint this project wrote for "
            "this base, or give this run another checkpoint directory"
        )
    got = base_fingerprint(template.base)
    wanted = np.asarray(saved["base_fingerprint"], np.float64)
    if not np.allclose(got, wanted, rtol=1e-4, atol=1e-6):
        raise CheckpointMismatchError(
            f"checkpoint step {step} at {path} holds LoRA adapters trained on another base "
            "model (its weights' sums differ from this run's): it is left as it is; resume "
            "with the base model it was trained on, or give this run another checkpoint "
            "directory"
        )


def _check_restored(state: Any, abstract: Any, config: Any) -> None:
    if jax.tree.structure(state) != jax.tree.structure(abstract):
        raise ValueError("restored state tree does not match the run's state structure")
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(abstract)):
        if got.shape != want.shape or got.dtype != want.dtype:
            raise ValueError(
                f"restored array {got.shape} {got.dtype} does not match {want.shape} {want.dtype}"
            )
    if not isinstance(config, Mapping) or "train_config" not in config:
        raise ValueError("the config item has no 'train_config'")


def _path_name(key: tuple[Any, ...]) -> str:
    return ".".join(str(k) for k in key)


def _describe(leaf: Any) -> str:
    return f"{np.dtype(leaf.dtype).name}{list(leaf.shape)}"


def tree_differences(saved: Mapping[tuple, Any], wanted: Mapping[tuple, Any]) -> list[str]:
    """How the arrays of a saved tree (flat ``{key path: metadata}``) differ from the wanted
    ones (``{key path: ShapeDtypeStruct}``): arrays only in one of them, then arrays of another
    shape or dtype, each with a count and the first example. Pure; entries without a shape
    (empty nodes such as an absent critic) are not arrays and are ignored."""
    saved = {k: v for k, v in saved.items() if hasattr(v, "shape")}
    wanted = {k: v for k, v in wanted.items() if hasattr(v, "shape")}
    out = []
    for keys, where in (
        (sorted(set(saved) - set(wanted)), "only in the checkpoint"),
        (sorted(set(wanted) - set(saved)), "only in the run's state"),
    ):
        if keys:
            out.append(f"{len(keys)} array(s) {where}, e.g. {_path_name(keys[0])}")
    changed = [
        k
        for k in sorted(set(saved) & set(wanted))
        if tuple(saved[k].shape) != tuple(wanted[k].shape)
        or np.dtype(saved[k].dtype) != np.dtype(wanted[k].dtype)
    ]
    if changed:
        k = changed[0]
        out.append(
            f"{len(changed)} array(s) of another shape or dtype, e.g. {_path_name(k)} is "
            f"{_describe(saved[k])} in the checkpoint, {_describe(wanted[k])} in the run's state"
        )
    return out


def config_differences(
    saved: Mapping[str, Any], current: Mapping[str, Any], limit: int = 8
) -> list[str]:
    """``["its train_config differs in <field> (<saved> there, <current> here), ..."]`` with
    nested fields dotted (``algorithm.advantage``), compared as plain JSON data; ``[]`` when
    they agree. At most ``limit`` fields are listed."""
    saved, current = _flat_json(saved), _flat_json(json.loads(json.dumps(current)))
    changed = [
        f"{f} ({_short_json(saved.get(f))} there, {_short_json(current.get(f))} here)"
        for f in sorted(set(saved) | set(current))
        if saved.get(f) != current.get(f)
    ]
    if not changed:
        return []
    more = f" and {len(changed) - limit} more" if len(changed) > limit else ""
    return [f"its train_config differs in {', '.join(changed[:limit])}{more}"]


def _flat_json(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, Mapping) and value:
            out.update(_flat_json(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _short_json(value: Any, limit: int = 80) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
