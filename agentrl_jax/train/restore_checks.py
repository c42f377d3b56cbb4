"""What a restored checkpoint item must be before a run uses it: pure checks, each returning
how an item differs from what the resuming run expects ("" when it fits), which
:mod:`agentrl_jax.train.checkpoint` turns into :class:`~.checkpoint.CheckpointMismatchError`
naming the checkpoint (left in place).

* the batches an asynchronous run sampled ahead (``pending``): their JSON description
  (:func:`pending_description_problem`: count within ``rl.asynchronous.max_staleness``, each batch's
  metrics, data position and policy version within what the restored state allows) and their
  arrays (:func:`pending_arrays_problem`: names, rows, turns, width, dtypes, key, step scores,
  against :class:`BatchShape` and the run's config);
* a LoRA checkpoint's fingerprint of its frozen base (:func:`fingerprint_problem`: missing,
  null or malformed fails closed).

Values from the checkpoint are shown cut to 120 characters by :func:`shown_value`, which never
raises (an integer too long to print, data nested too deep).

Pure: they read the checkpoint's JSON and arrays already restored, and write nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Mapping, NamedTuple

import jax
import numpy as np

from agentrl_jax.train.batch import check_step_wise
from agentrl_jax.train.config import TrainConfig
from agentrl_jax.train.logprobs import check_loss_positions
from agentrl_jax.trajectory import Trajectory
from agentrl_jax.validation import is_int, is_real


@dataclasses.dataclass(frozen=True)
class BatchShape:
    """The sizes of the batches a run's rollouts produce, which the batches sampled ahead in a
    checkpoint must have to be trained on by that run: ``rows`` (N), ``turns`` (T: room for
    the largest budget, the rollout's ``num_turns``) and at most ``tokens`` columns (L: the
    rollout's record length, ``task.max_context`` unless a history window keeps more; a batch
    may be cut narrower). None: not checked, except ``rows``, which then comes from the run's
    ``rl.tasks_per_step x rl.group_size`` when :meth:`Checkpointer.restore_latest` was given
    its config, and ``turns``, which every batch must share with the first."""

    rows: int | None = None
    turns: int | None = None
    tokens: int | None = None


# ------------------------------------------------------------------ checks of the batches ahead

_DESCRIPTION_KEYS = ("metrics", "position", "version")
_ITEM_KEYS = ("trajectory", "rng")


class ArraySpec(NamedTuple):
    """An array's shape and dtype (by name), as messages show them: ``int32[8, 24]``."""

    shape: tuple[int, ...]
    dtype: str

    def __str__(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


def array_spec(value: Any) -> ArraySpec | None:
    """``value``'s :class:`ArraySpec`, or None if it is not an array."""
    try:
        return ArraySpec(tuple(int(d) for d in value.shape), str(value.dtype))
    except (AttributeError, TypeError, ValueError):
        return None


@dataclasses.dataclass(frozen=True)
class PendingExpectation:
    """What a resuming run expects of the batches sampled ahead in its checkpoint: the
    restored state's ``step``, ``data_position`` (and the largest its dtype holds) and key
    (``rng``: shape and dtype), the ``batch`` sizes its rollouts produce, and its ``config``
    (None: the checks that need none)."""

    step: int
    data_position: int
    position_max: int
    rng: ArraySpec
    batch: BatchShape
    config: TrainConfig | None = None

    @property
    def rows(self) -> tuple[int | None, str]:
        """The rows of a batch, and where that number comes from (for messages)."""
        if self.batch.rows is not None:
            return self.batch.rows, "this run's rollouts"
        if self.config is not None:
            rl = self.config.rl
            return (
                rl.tasks_per_step * rl.group_size,
                f"this run's rl.tasks_per_step {rl.tasks_per_step} x rl.group_size {rl.group_size}",
            )
        return None, "batch 0's"

    @property
    def draws(self) -> int | None:
        """Data positions one batch may take: the run's rollout batches per update (DAPO's
        dynamic sampling draws up to ``max_rollout_batches``)."""
        if self.config is None:
            return None
        algorithm = self.config.algorithm
        return algorithm.max_rollout_batches if algorithm.dynamic_sampling else 1


def pending_description_problem(described: Any, expected: PendingExpectation) -> str:
    """How the JSON description of the batches sampled ahead (``[{metrics, position,
    version}, ...]``) differs from what the resuming run expects ("" if it fits). Pure.

    Always: a list of objects with exactly those keys, ``metrics`` an object of numbers, the
    data position an int in ``[0, position_max]``, the policy version an int in ``[0, step]``
    (no parameters newer than the checkpoint's sampled them). With the run's config: at most
    ``rl.asynchronous.max_staleness`` batches; each data position 1 to ``draws`` past the one before
    it (the restored state's for the first); each version no older than the one before it and
    at most ``rl.asynchronous.max_staleness`` updates behind the step the batch trains at."""
    if not isinstance(described, list):
        return f"its description is {shown_value(described)}, expected a list of batches"
    config = expected.config
    if config is not None and len(described) > config.rl.asynchronous.max_staleness:
        return (
            f"it holds {len(described)} batch(es), expected at most this run's "
            f"rl.asynchronous.max_staleness ({config.rl.asynchronous.max_staleness}) sampled ahead"
        )
    position, version = expected.data_position, 0
    for i, about in enumerate(described):
        problem = _description_problem(i, about, position, version, expected)
        if problem:
            return problem
        position, version = about["position"], about["version"]
    return ""


def _description_problem(
    i: int, about: Any, position: int, version: int, expected: PendingExpectation
) -> str:
    """Batch ``i``'s description against the one before it (``position``, ``version``: the
    restored state's and 0 for the first)."""
    keys = ", ".join(_DESCRIPTION_KEYS)
    if not isinstance(about, Mapping) or set(about) != set(_DESCRIPTION_KEYS):
        return f"batch {i}'s description is {shown_value(about)}, expected an object of {keys}"
    metrics = about["metrics"]
    if not isinstance(metrics, Mapping) or not all(_is_metric(v) for v in metrics.values()):
        return f"batch {i}'s metrics are {shown_value(metrics)}, expected an object of numbers"
    draws = expected.draws
    if draws is None:
        low, high, why = 0, expected.position_max, "a data position the state can hold"
    else:
        low, high = position + 1, min(position + draws, expected.position_max)
        before = "the restored state's" if i == 0 else f"batch {i - 1}'s"
        why = f"{draws} draw(s) per batch after {before} data position {position}"
    if not (is_int(about["position"]) and low <= about["position"] <= high):
        return (
            f"batch {i}'s data position is {shown_value(about['position'])}, expected an int in "
            f"[{low}, {high}] ({why})"
        )
    step, low = expected.step, 0
    why = [f"no newer than the checkpoint's step {step}"]
    if expected.config is not None:
        k = expected.config.rl.asynchronous.max_staleness
        low = max(version, step + i - k, 0)
        why.append(
            f"at most rl.asynchronous.max_staleness {k} behind step {step + i}, where it trains"
        )
        if i:
            why.append(f"no older than batch {i - 1}'s")
    if not (is_int(about["version"]) and low <= about["version"] <= step):
        return (
            f"batch {i}'s policy version is {shown_value(about['version'])}, expected an int in "
            f"[{low}, {step}] ({'; '.join(why)})"
        )
    return ""


def pending_arrays_problem(arrays: Any, count: int, expected: PendingExpectation) -> str:
    """How the arrays of ``count`` batches sampled ahead (``{"<i>": {trajectory, rng,
    step_scores?}}``) differ from what the resuming run expects ("" if they fit). Pure.

    Each batch: exactly the :class:`~agentrl_jax.trajectory.Trajectory` fields, each of the
    dtype and rank a rollout gives it, ``expected.rows`` rows (or the first batch's), the
    first batch's turns (or ``expected.batch.turns``), one width of at most
    ``expected.batch.tokens`` columns for the token fields; the key of the state's shape and
    dtype; step scores ``float32[rows, turns]``, present exactly when the run's
    ``rl.process_reward_coef`` > 0. With the run's config its rows must also pass the checks
    the loop runs on every batch it samples (loss positions, step-wise training)."""
    names = sorted(str(i) for i in range(count))
    if not isinstance(arrays, Mapping) or sorted(map(str, arrays)) != names:
        got = sorted(map(str, arrays)) if isinstance(arrays, Mapping) else arrays
        return (
            f"its arrays hold batches {shown_value(got)}, expected {shown_value(names)} as its "
            "description lists"
        )
    rows, rows_from = expected.rows
    turns, turns_from = expected.batch.turns, "this run's rollouts"
    for i in range(count):
        problem = _batch_problem(
            i, arrays[str(i)], (rows, rows_from), (turns, turns_from), expected
        )
        if problem:
            return problem
        if rows is None or turns is None:  # the first batch's, for the others
            first = array_spec(arrays[str(i)]["trajectory"]["turn_mask"]).shape
            if rows is None:
                rows = first[0]
            if turns is None:
                turns, turns_from = first[1], "batch 0's"
    return ""


def _batch_problem(
    i: int,
    item: Any,
    rows: tuple[int | None, str],
    turns: tuple[int | None, str],
    expected: PendingExpectation,
) -> str:
    """Batch ``i``'s arrays against ``rows`` and ``turns`` (each ``(number or None: this
    batch's own, where it comes from)``) and ``expected``."""
    config = expected.config
    keys = sorted(map(str, item)) if isinstance(item, Mapping) else None
    if keys is None or keys not in (sorted(_ITEM_KEYS), sorted((*_ITEM_KEYS, "step_scores"))):
        return (
            f"batch {i} holds {shown_value(keys if keys is not None else item)}, expected "
            f"{sorted(_ITEM_KEYS)} and, with process rewards, step_scores"
        )
    scored = "step_scores" in keys
    if config is not None and scored != (config.rl.process_reward_coef > 0):
        return (
            f"batch {i} has {'step scores' if scored else 'no step scores'}, expected "
            f"{'none' if scored else 'them'}: this run's rl.process_reward_coef is "
            f"{config.rl.process_reward_coef}"
        )
    trajectory = item["trajectory"]
    fields = [f.name for f in dataclasses.fields(Trajectory)]
    if not isinstance(trajectory, Mapping):
        shown = shown_value(trajectory)
        return f"batch {i}'s trajectory is {shown}, expected a Trajectory's arrays"
    names = set(map(str, trajectory))
    if "experts" not in names:  # a dense policy's: saved without them (no MoE layers)
        fields.remove("experts")
    missing, unknown = sorted(set(fields) - names), sorted(names - set(fields))
    if missing or unknown:
        return (
            f"batch {i}'s trajectory has other fields than a Trajectory: missing "
            f"{shown_value(missing)}, unknown {shown_value(unknown)}"
        )
    got = {name: array_spec(trajectory[name]) for name in fields}
    if any(spec is None for spec in got.values()):
        name = next(name for name in fields if got[name] is None)
        shown = shown_value(trajectory[name])
        return f"batch {i}'s trajectory.{name} is {shown}, expected an array"
    shape = {name: spec.shape for name, spec in got.items()}
    n = rows[0] if rows[0] is not None else _dim(shape["tokens"], 0)
    t = turns[0] if turns[0] is not None else _dim(shape["turn_mask"], 1)
    width = _dim(shape["tokens"], 1)
    limit = expected.batch.tokens
    if limit is not None and width > limit:
        return (
            f"batch {i}'s trajectory.tokens is {got['tokens']}, expected at most "
            f"{limit} tokens wide (this run's rollouts)"
        )
    for name, want in _trajectory_spec(n, width, t).items():
        if name == "experts" and name in got:  # [N, L, M, k] int16: M and k the model's
            spec = got[name]
            if spec.dtype != want.dtype or len(spec.shape) != 4 or spec.shape[:2] != (n, width):
                return (
                    f"batch {i}'s trajectory.experts is {spec}, expected {want.dtype}[{n}, "
                    f"{width}, M, k] ({n} rows, {width} tokens; M, k: the model's MoE layers "
                    "and experts per token)"
                )
            continue
        if name not in got:
            continue
        if got[name] != want:
            return (
                f"batch {i}'s trajectory.{name} is {got[name]}, expected {want} ({n} rows: "
                f"{rows[1]}; {t} turns: {turns[1]})"
            )
    problem = _key_and_scores_problem(i, item, n, t, expected)
    if problem or config is None:
        return problem
    try:  # what the loop checks of every batch it samples
        batch = Trajectory.from_arrays({name: np.asarray(trajectory[name]) for name in fields})
        check_step_wise(batch, config)
        check_loss_positions(batch, config.loss_positions)
    except ValueError as e:
        return f"batch {i}: {e}"
    return ""


def _key_and_scores_problem(
    i: int, item: Mapping[str, Any], rows: int, turns: int, expected: PendingExpectation
) -> str:
    key = array_spec(item["rng"])
    if key != expected.rng:
        return (
            f"batch {i}'s key is {key or shown_value(item['rng'])}, expected {expected.rng} (the "
            "run's state's key)"
        )
    if "step_scores" not in item:
        return ""
    scores, want = array_spec(item["step_scores"]), ArraySpec((rows, turns), "float32")
    if scores != want:
        return (
            f"batch {i}'s step_scores is {scores or shown_value(item['step_scores'])}, expected "
            f"{want} (a score per turn of each row)"
        )
    return ""


@functools.lru_cache(maxsize=64)
def _trajectory_spec(rows: int, tokens: int, turns: int) -> dict[str, ArraySpec]:
    """The shape and dtype of every field of a rollout's trajectory of these sizes."""
    spec = jax.eval_shape(lambda: Trajectory.zeros(rows, tokens, turns))
    return {f.name: array_spec(getattr(spec, f.name)) for f in dataclasses.fields(spec)}


def _dim(shape: tuple[int, ...], axis: int) -> int:
    return shape[axis] if len(shape) > axis else 0


def _is_metric(value: Any) -> bool:
    """A number a metrics record holds: a float (NaN and infinities too), or an int that
    fits one."""
    return isinstance(value, float) or is_real(value)


def shown_value(value: Any, limit: int = 120) -> str:
    """``value`` as JSON (repr if it is not JSON data), cut to ``limit`` characters; never
    raises (an int too long to print, data nested too deep)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        try:
            text = repr(value)
        except (ValueError, RecursionError):
            text = f"a {type(value).__name__} too large to show"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def fingerprint_problem(saved: Mapping[str, Any], length: int) -> str:
    """How a LoRA checkpoint's JSON fails to hold a base fingerprint (:func:`base_fingerprint`)
    of ``length`` numbers ("" if it holds one): missing, null, not a list, another length, an
    entry that is not a finite number (a string, a bool, infinity, an int too large for a
    float). Pure."""
    wanted = f"expected a list of {length} finite numbers (the sum and sum of squares of each"
    wanted += " of this run's base weights)"
    if "base_fingerprint" not in saved:
        return f"it has no base_fingerprint, {wanted}"
    value = saved["base_fingerprint"]
    if not isinstance(value, list):
        return f"its base_fingerprint is {shown_value(value)}, {wanted}"
    if len(value) != length:
        return f"its base_fingerprint holds {len(value)} numbers, {wanted}"
    bad = next((i for i, v in enumerate(value) if not is_real(v)), None)
    if bad is not None:
        return f"its base_fingerprint[{bad}] is {shown_value(value[bad])}, {wanted}"
    return ""
