"""The training loop: rollout -> scores -> update, with metrics, progress and checkpoints.

Each iteration of :func:`train`:

1. splits a rollout key off ``state.rng`` and draws the task batch ``task_batches(position)``
   at ``state.data_position`` (a deterministic function of the index, so a resumed run sees
   the same tasks); with DAPO's dynamic sampling (``algorithm.dynamic_sampling``) it keeps
   drawing (a new key, the next position) until the groups whose rewards vary fill a batch,
   at most ``algorithm.max_rollout_batches`` times (:mod:`agentrl_jax.train.dynamic_sampling`);
2. runs the injected ``rollout(policy_params, key, tasks) -> Trajectory`` (and checks that the
   config can train turns sampled from a history window, if any:
   :func:`~agentrl_jax.train.batch.check_step_wise`);
3. scores steps with the optional process scorer (its scores shape the reward when
   ``config.rl.process_reward_coef > 0``) and the optional quality scorer (for R_single; it may
   be the same object, then it runs once);
4. calls ``train_step(state, TrainBatch)`` (see :mod:`agentrl_jax.train.step`): all the
   updates of the batch (``epochs x mini_batches``);
5. logs one record per step (:mod:`agentrl_jax.train.sinks`: JSONL, TensorBoard, W&B),
   updates the progress bar, and saves a checkpoint every ``checkpoint_every`` steps and at
   the end. A metric the step reports per update (``updates/<name>``, when a batch gets more
   than one update) is a JSON list in the record, one value per update, and a TensorBoard
   series indexed by the update's number over the run.

Metrics added by the loop: ``R_multi`` (trajectory success rate over real rows of every rollout
batch of the step, §7.5),
``R_single`` (mean step quality from the quality scorer: Q* on FrozenLake), mean turns,
the policy's entropy estimate (``entropy_estimate``, see :func:`rollout_metrics`),
rollout/scoring/update seconds, sampled tokens and played turns per rollout second
(``rollout_tokens_per_s``, ``rollout_turns_per_s``), trained tokens per second, and with dynamic
sampling ``dynamic_sampling/{rollout_batches,kept_groups,dropped_groups,filler_rows}``. A skipped
(non-finite) update is logged (``update_skipped`` counts them per step, and a line on the progress
bar) and the run continues.

Asynchronous training (``rl.asynchronous.max_staleness`` k > 0, :func:`_asynchronous`): batch ``j``
is sampled by the parameters after ``max(0, j - k)`` updates, so the rollouts of update ``i + k``
run while update ``i`` trains; a pure function of k, never of timing. Such a step also logs
``policy_version`` (the sampling parameters' update count), ``staleness_mean`` /
``staleness_max`` (updates between them and the parameters trained), ``time/idle_s`` (the
loop waiting for the update after its concurrent rollout ended) and
``time/rollout_during_update_s``; the train step adds the importance weights of its
off-policy correction (``off_policy/weight``, ``off_policy/capped``, ``off_policy/weight_max``)
and the sampler-trainer gap as always.

Everything here is a side effect at the edge; the pure pieces are the rollout, the scorers
and the train step.
"""

from __future__ import annotations

import collections
import functools
import sys
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from agentrl_jax import distributed
from agentrl_jax.process_rewards import mean_step_score
from agentrl_jax.train.batch import Produced, TrainBatch, check_step_wise
from agentrl_jax.train.checkpoint import Checkpointer
from agentrl_jax.train.config import TrainConfig
from agentrl_jax.train.dynamic_sampling import Draw, assemble, packed_rows, varied_groups
from agentrl_jax.train.logprobs import check_loss_positions
from agentrl_jax.train.sinks import MetricsLogger
from agentrl_jax.train.state import TrainState, sampler_params
from agentrl_jax.trajectory import StepScorer, StepScores, Trajectory, concatenate_rows
from agentrl_jax.uninterrupted import uninterrupted

Rollout = Callable[[Any, jax.Array, Any], Trajectory]
TrainStep = Callable[[TrainState, TrainBatch], tuple[TrainState, Mapping[str, jax.Array]]]


def host_metrics(metrics: Mapping[str, Any]) -> dict[str, float | list[float]]:
    """Device metrics as Python numbers: scalars as floats, ``[updates]`` arrays as lists."""

    def plain(v):
        v = np.asarray(v)
        return float(v) if v.ndim == 0 else [float(x) for x in v.reshape(-1)]

    return {k: plain(v) for k, v in jax.device_get(dict(metrics)).items()}


# ------------------------------------------------------------------------- rollout metrics


def rollout_metrics(trajectory: Trajectory, quality: StepScores | None) -> dict[str, float]:
    """R_multi (success rate of real rows), mean turns, overflow rate, the policy's entropy
    estimate, and R_single if scored: from the host's copy of the batch (NumPy; the rates in
    float32, as a jitted mean computes them), R_single from the scorer's output.

    ``entropy_estimate``: the mean of ``-log pi(token)`` over the sampled tokens of real rows,
    ``log pi`` the model's own (temperature 1, untruncated) as the rollout recorded it. With
    rollouts sampled at temperature 1 and no truncation (the paper's training setting) it is
    an unbiased Monte-Carlo estimate of the policy's per-token entropy, at no cost; at other
    sampling settings it is the cross-entropy of the sampling distribution to the policy."""
    f32 = np.float32
    rows = np.asarray(trajectory.row_mask, f32)
    count = max(rows.sum(dtype=f32), f32(1.0))

    def rate(values) -> float:
        return float(f32((np.asarray(values, f32) * rows).sum(dtype=f32)) / count)

    sampled = np.asarray(trajectory.loss_mask, f32) * rows[:, None]
    entropy = -(np.asarray(trajectory.logprobs, f32) * sampled).sum(dtype=f32)
    out = {
        "R_multi": rate(trajectory.success),
        "turns_mean": rate(trajectory.turns_used),
        "overflow_rate": rate(trajectory.overflow),
        "entropy_estimate": float(entropy / max(sampled.sum(dtype=f32), f32(1.0))),
    }
    if quality is not None:  # the scorer's arrays, wherever it computed them
        scored = jnp.maximum(jnp.sum(quality.mask.astype(jnp.float32)), 1.0)
        scores = {
            "R_single": mean_step_score(quality),
            "invalid_step_rate": jnp.sum(quality.invalid.astype(jnp.float32)) / scored,
        }
        out.update({k: float(v) for k, v in jax.device_get(scores).items()})
    return out


# ------------------------------------------------------------------------- the loop


def train(
    state: TrainState,
    train_step: TrainStep,
    rollout: Rollout,
    task_batches: Callable[[int], Any],
    config: TrainConfig,
    *,
    process_scorer: StepScorer | None = None,
    quality_scorer: StepScorer | None = None,
    checkpointer: Checkpointer | None = None,
    checkpoint_metadata: Mapping[str, Any] | None = None,
    logger: MetricsLogger | None = None,
    progress: bool = True,
    on_step: Callable[[TrainState, dict[str, float]], None] | None = None,
    publish: Callable[[Any], Any] | None = None,
    pending: Sequence[Produced] = (),
    events: list[tuple[str, int]] | None = None,
) -> TrainState:
    """Trains from ``state.step`` until ``config.rl.steps`` (see the module docstring).

    ``on_step(state, metrics)`` runs after each step (after its checkpoint, if any).
    Asynchronous runs (``rl.asynchronous.max_staleness > 0``): ``publish(params)`` gives the
    parameters the next rollouts sample with, a copy that outlives the train step's donation of the
    state (default: a copy on the same devices); ``pending`` are the batches a resumed run's
    checkpoint held (:meth:`Checkpointer.restore_pending`); ``events``, if given, receives
    ``("rollout", batch)``, ``("update", step)`` and ``("update_done", step)`` in the order
    they happen (the overlap, without timing).
    Returns the final state; pending checkpoint writes are finished before returning.
    """
    if process_scorer is None and config.rl.process_reward_coef > 0:
        raise ValueError("train: config.rl.process_reward_coef > 0 needs a process_scorer")
    produce = functools.partial(
        produce_batch,
        rollout=rollout,
        task_batches=task_batches,
        config=config,
        process_scorer=process_scorer,
        quality_scorer=quality_scorer,
    )
    if config.rl.asynchronous.max_staleness == 0:
        iterations = _synchronous(state, train_step, produce, config)
    else:
        iterations = _asynchronous(
            state, train_step, produce, config, publish or _copy, pending, events
        )
    bar = tqdm(
        total=config.rl.steps,
        initial=int(state.step),
        disable=not progress,
        desc="train",
        dynamic_ncols=True,
    )
    try:
        for state, metrics, queued in iterations:
            step = int(state.step)
            if metrics["update_skipped"]:
                bar.write(
                    f"step {step}: non-finite loss or gradient, "
                    f"{int(metrics['update_skipped'])} of {config.updates_per_batch} "
                    f"updates skipped ({int(metrics['skipped_updates'])} so far)",
                    file=sys.stderr,
                )
            # An update's record is kept whole: Ctrl-C or SIGTERM here lands after its metrics
            # line, its checkpoint's synchronous part and ``on_step``, so what the interrupt
            # reports as done is on disk (or being written: closing the checkpointer waits).
            with uninterrupted():
                if logger is not None:
                    logger.log(step, metrics)
                if checkpointer is not None and checkpointer.should_save(step, config.rl.steps):
                    checkpointer.save(state, config, checkpoint_metadata, pending=queued)
                bar.update(1)
                bar.set_postfix(
                    {
                        k: f"{metrics[k]:.3g}"
                        for k in ("R_multi", "R_single", "loss")
                        if k in metrics
                    }
                )
                if on_step is not None:
                    on_step(state, metrics)
    finally:
        bar.close()
        if checkpointer is not None:
            checkpointer.wait()
    return state


def _synchronous(state, train_step, produce, config) -> Iterator[tuple[TrainState, dict, tuple]]:
    """Each step samples with the parameters it then updates: rollout, then update."""
    while int(state.step) < config.rl.steps:
        produced = produce(
            sampler_params(state),
            state.rng,
            int(state.data_position),
            version=int(state.step),
        )
        start = time.perf_counter()
        state, step_metrics = _apply(state, train_step, produced)
        yield state, _record(step_metrics, produced, start), ()


def _asynchronous(
    state, train_step, produce, config, publish, pending, events
) -> Iterator[tuple[TrainState, dict, tuple]]:
    """Bounded staleness ``k = rl.asynchronous.max_staleness``: batch ``j`` is sampled by the
    parameters after ``max(0, j - k)`` updates, so while update ``i`` runs (dispatched, not
    waited for) the loop samples batch ``i + k`` with the parameters update ``i`` starts from. On
    devices of their own (``mesh.rollout``) the two run at once; on shared devices the
    rollout's host work (environment steps, tokenising) overlaps the update. The batches
    sampled ahead (at most ``k``) are the queue a checkpoint saves, so a resumed run trains on
    exactly what the uninterrupted one would have. Which parameters sample which batch is
    fixed by ``k`` alone, never by timing: the run is deterministic."""
    k, steps = config.rl.asynchronous.max_staleness, config.rl.steps
    queue = collections.deque(pending)
    cursor = (queue[-1].rng, queue[-1].position) if queue else (state.rng, int(state.data_position))

    sampled = int(state.step) + len(queue)  # batches sampled so far (never read off the
    # state in flight: that would wait for its update)

    def sample(params, version: int) -> None:
        nonlocal cursor, sampled
        if events is not None:
            events.append(("rollout", sampled))
        sampled += 1
        # the keys split where the rollout samples: on the training devices a split would
        # wait for the update in flight there
        where = _devices_of(params)
        rng = cursor[0]
        if not rng.is_fully_addressable:  # the global state's key: this process's replica
            rng = rng.addressable_data(0)
        rng = jax.device_put(rng, where)
        # and so does the rest of its work (an environment in JAX, a scorer): on the default
        # device it would queue behind the update there
        with jax.default_device(min(where.device_set, key=lambda d: d.id)):
            produced = produce(params, rng, cursor[1], version=version)
        cursor = (produced.rng, produced.position)
        queue.append(produced)

    step = int(state.step)
    if len(queue) < min(k, steps - step):  # a fresh run: the first k batches, from the start
        params = publish(sampler_params(state))
        while len(queue) < min(k, steps - step):
            sample(params, step)
        del params
    while int(state.step) < steps:
        i = int(state.step)
        produced = queue.popleft()
        # before the step donates it
        params = publish(sampler_params(state)) if i + k < steps else None
        start = time.perf_counter()
        state, step_metrics = _apply(state, train_step, produced, copy_key=True)
        if events is not None:
            events.append(("update", i))
        dispatched = time.perf_counter()
        if params is not None:
            sample(params, i)
            del params
        rolled = time.perf_counter()
        metrics = _record(step_metrics, produced, start)  # waits for the update
        if events is not None:
            events.append(("update_done", i))
        staleness = float(i - produced.version)
        metrics.update(
            {
                "policy_version": float(produced.version),
                "staleness_mean": staleness,  # every row of a batch has one version
                "staleness_max": staleness,
                "time/rollout_during_update_s": rolled - dispatched,
                "time/idle_s": time.perf_counter() - rolled,
            }
        )
        yield state, metrics, tuple(queue)


def _copy(params: Any) -> Any:
    return jax.tree.map(jnp.copy, params)


def _devices_of(params: Any) -> jax.sharding.Sharding:
    """A sharding replicated over the devices ``params`` lie on."""
    sharding = jax.tree.leaves(params)[0].sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return jax.sharding.SingleDeviceSharding(min(sharding.device_set, key=lambda d: d.id))


def _key_like(key: jax.Array, template: jax.Array) -> jax.Array:
    """``key`` (on the rollout's devices) as a copy laid out as ``template`` (the state's)."""
    if template.sharding.is_fully_addressable:
        return jax.device_put(key, template.sharding, may_alias=False)
    value = distributed.host_value(key)  # 8 bytes through the host, once per update
    return jax.make_array_from_callback(value.shape, template.sharding, lambda i: value[i])


def produce_batch(
    params: Any,
    rng: jax.Array,
    position: int,
    *,
    version: int,
    rollout: Rollout,
    task_batches: Callable[[int], Any],
    config: TrainConfig,
    process_scorer: StepScorer | None,
    quality_scorer: StepScorer | None,
) -> Produced:
    """One update's rollouts sampled by ``params`` (one batch, or with DAPO's dynamic sampling
    up to ``max_rollout_batches``, each with its own key split off ``rng`` and the next data
    position from ``position``), scored, with their metrics."""
    algorithm = config.algorithm
    draws, qualities, rolling, scoring = [], [], 0.0, 0.0
    for _ in range(algorithm.max_rollout_batches if algorithm.dynamic_sampling else 1):
        start = time.perf_counter()
        rng, rollout_key = jax.random.split(rng)
        tasks = task_batches(position)
        position += 1
        trajectory = jax.block_until_ready(rollout(params, rollout_key, tasks))
        check_step_wise(trajectory, config)
        check_loss_positions(trajectory, config.loss_positions)
        rolled = time.perf_counter()
        process = process_scorer(trajectory, tasks) if process_scorer is not None else None
        if quality_scorer is None:
            quality = None
        elif quality_scorer is process_scorer:
            quality = process
        else:
            quality = quality_scorer(trajectory, tasks)
        scoring += time.perf_counter() - rolled
        rolling += rolled - start
        step_scores = (
            process.scores if process is not None and config.rl.process_reward_coef > 0 else None
        )
        qualities.append(quality)
        if not algorithm.dynamic_sampling:
            draws.append(Draw(trajectory, np.ones(trajectory.row_mask.shape, bool), step_scores))
            break
        keep = varied_groups(trajectory, step_scores, config)
        draws.append(
            Draw(trajectory, keep, None if step_scores is None else np.asarray(step_scores))
        )
        if (
            packed_rows(draws, draws[0].trajectory.row_mask.shape[0])
            == draws[0].trajectory.row_mask.shape[0]
        ):
            break
    extra = {}
    if algorithm.dynamic_sampling:
        trajectory, step_scores, extra = assemble(draws)
    else:
        trajectory, step_scores = draws[0].trajectory, draws[0].step_scores

    # rollout metrics over every row rolled out in this step (all draws), not only those trained on
    rolled_out, quality = _all_draws(draws, qualities)
    metrics = rollout_metrics(rolled_out, quality)
    metrics.update(extra)
    real_rows = np.asarray(rolled_out.row_mask, bool)
    sampled = float((np.asarray(rolled_out.loss_mask, bool) & real_rows[:, None]).sum())
    played = float((np.asarray(rolled_out.turn_mask, bool) & real_rows[:, None]).sum())
    metrics["rollout_tokens_per_s"] = sampled / max(rolling, 1e-9)
    metrics["rollout_turns_per_s"] = played / max(rolling, 1e-9)
    metrics["time/rollout_s"] = rolling
    metrics["time/score_s"] = scoring
    return Produced(TrainBatch(trajectory, step_scores), metrics, rng, position, version)


def _apply(state: TrainState, train_step: TrainStep, produced: Produced, copy_key: bool = False):
    """Dispatches ``produced``'s update (does not wait for it): the state takes the batch's
    key (``copy_key``: a copy, where the key lives on as the next rollouts' and the step
    donates the state) and data position, then the train step."""
    # the new position goes where the old one was: a step whose inputs change placement recompiles
    data_position = jax.device_put(
        np.asarray(produced.position, np.int32), state.data_position.sharding
    )
    rng = _key_like(produced.rng, state.rng) if copy_key else produced.rng
    state = state.replace(rng=rng, data_position=data_position)
    return train_step(state, produced.batch)


def _record(step_metrics: Mapping[str, Any], produced: Produced, start: float) -> dict:
    """The step's metrics record (waits for the update): the update's, the rollout's, times."""
    metrics = host_metrics(step_metrics)
    updated = time.perf_counter()
    metrics.update(produced.metrics)
    metrics["time/update_s"] = updated - start
    trajectory = produced.batch.trajectory
    real_tokens = (
        np.asarray(trajectory.token_mask, bool) & np.asarray(trajectory.row_mask, bool)[:, None]
    )
    metrics["train_tokens_per_s"] = float(real_tokens.sum()) / max(updated - start, 1e-9)
    return metrics


def _all_draws(
    draws: list[Draw], qualities: list[StepScores | None]
) -> tuple[Trajectory, StepScores | None]:
    if len(draws) == 1:
        return draws[0].trajectory, qualities[0]
    quality = (
        None
        if qualities[0] is None
        else jax.tree.map(lambda *x: np.concatenate([np.asarray(v) for v in x]), *qualities)
    )
    return concatenate_rows([d.trajectory for d in draws]), quality
