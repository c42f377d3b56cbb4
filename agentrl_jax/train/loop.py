"""The training loop: rollout -> scores -> update, with metrics, progress and checkpoints.

Each iteration of :func:`train`:

1. splits a rollout key off ``state.rng`` and draws the task batch ``task_batches(position)``
   at ``state.data_position`` (a deterministic function of the index, so a resumed run sees
   the same tasks); with DAPO's dynamic sampling (``algorithm.dynamic_sampling``) it keeps
   drawing (a new key, the next position) until the groups whose rewards vary fill a batch,
   at most ``algorithm.max_rollout_batches`` times (:mod:`agentrl_jax.train.dynamic_sampling`);
2. runs the injected ``rollout(policy_params, key, tasks) -> Trajectory`` (and checks that its
   turns saw the whole history, see :func:`~agentrl_jax.train.step.check_full_history`);
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

Everything here is a side effect at the edge; the pure pieces are the rollout, the scorers
and the train step.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from agentrl_jax.process_rewards import mean_step_score
from agentrl_jax.train.batch import TrainBatch, check_full_history
from agentrl_jax.train.checkpoint import Checkpointer
from agentrl_jax.train.config import TrainConfig
from agentrl_jax.train.dynamic_sampling import Draw, assemble, packed_rows, varied_groups
from agentrl_jax.train.logprobs import check_loss_positions
from agentrl_jax.train.sinks import MetricsLogger
from agentrl_jax.train.state import TrainState
from agentrl_jax.trajectory import StepScorer, StepScores, Trajectory, concatenate_rows

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
) -> TrainState:
    """Trains from ``state.step`` until ``config.rl.steps`` (see the module docstring).

    ``on_step(state, metrics)`` runs after each step (after its checkpoint, if any).
    Returns the final state; pending checkpoint writes are finished before returning.
    """
    if process_scorer is None and config.rl.process_reward_coef > 0:
        raise ValueError("train: config.rl.process_reward_coef > 0 needs a process_scorer")
    bar = tqdm(
        total=config.rl.steps,
        initial=int(state.step),
        disable=not progress,
        desc="train",
        dynamic_ncols=True,
    )
    try:
        while int(state.step) < config.rl.steps:
            state, metrics = _iteration(
                state, train_step, rollout, task_batches, config, process_scorer, quality_scorer
            )
            step = int(state.step)
            if metrics["update_skipped"]:
                bar.write(
                    f"step {step}: non-finite loss or gradient, "
                    f"{int(metrics['update_skipped'])} of {config.updates_per_batch} "
                    f"updates skipped ({int(metrics['skipped_updates'])} so far)",
                    file=sys.stderr,
                )
            if logger is not None:
                logger.log(step, metrics)
            if checkpointer is not None and checkpointer.should_save(step, config.rl.steps):
                checkpointer.save(state, config, checkpoint_metadata)
            bar.update(1)
            bar.set_postfix(
                {k: f"{metrics[k]:.3g}" for k in ("R_multi", "R_single", "loss") if k in metrics}
            )
            if on_step is not None:
                on_step(state, metrics)
    finally:
        bar.close()
        if checkpointer is not None:
            checkpointer.wait()
    return state


def _iteration(state, train_step, rollout, task_batches, config, process_scorer, quality_scorer):
    """One step: rollout batches (one, or with DAPO's dynamic sampling up to
    ``max_rollout_batches``, each with its own key and data position), scores, one train step."""
    algorithm = config.algorithm
    rng, position = state.rng, int(state.data_position)
    draws, qualities, rolling, scoring = [], [], 0.0, 0.0
    for _ in range(algorithm.max_rollout_batches if algorithm.dynamic_sampling else 1):
        start = time.perf_counter()
        rng, rollout_key = jax.random.split(rng)
        tasks = task_batches(position)
        position += 1
        trajectory = jax.block_until_ready(rollout(state.policy, rollout_key, tasks))
        check_full_history(trajectory)
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

    before_update = time.perf_counter()
    # the new position goes where the old one was: a step whose inputs change placement recompiles
    data_position = jax.device_put(np.asarray(position, np.int32), state.data_position.sharding)
    state = state.replace(rng=rng, data_position=data_position)
    state, step_metrics = train_step(state, TrainBatch(trajectory, step_scores))
    metrics = host_metrics(step_metrics)
    updated = time.perf_counter()

    # rollout metrics over every row rolled out in this step (all draws), not only those trained on
    rolled_out, quality = _all_draws(draws, qualities)
    metrics.update(rollout_metrics(rolled_out, quality))
    metrics.update(extra)
    real_rows = np.asarray(rolled_out.row_mask, bool)
    sampled = float((np.asarray(rolled_out.loss_mask, bool) & real_rows[:, None]).sum())
    played = float((np.asarray(rolled_out.turn_mask, bool) & real_rows[:, None]).sum())
    metrics["rollout_tokens_per_s"] = sampled / max(rolling, 1e-9)
    metrics["rollout_turns_per_s"] = played / max(rolling, 1e-9)
    metrics["time/rollout_s"] = rolling
    metrics["time/score_s"] = scoring
    metrics["time/update_s"] = updated - before_update
    real_tokens = (
        np.asarray(trajectory.token_mask, bool) & np.asarray(trajectory.row_mask, bool)[:, None]
    )
    metrics["train_tokens_per_s"] = float(real_tokens.sum()) / max(updated - before_update, 1e-9)
    return state, metrics


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
