"""The RL runs of the reproduction: one trainer config per run, task batches, and a run
that resumes from its newest checkpoint.

Every run starts from the same base parameters and does the same number of updates on the
same task batches (``task_batch(position)`` depends only on the seed and the step), with the
same rollout settings; only the algorithm and the budget differ. The runs and their
algorithms come from ``rl.runs`` (presets or compositions of registered estimators and
terms, :mod:`agentrl_jax.reproduce.presets`); nothing here is keyed on an algorithm's name:

* full-budget runs play every task group at ``T_max``;
* BudgetMix runs draw one budget per group from ``{(k T_max) // 10 : k = 1..10}`` (§5), and
  anchor on ``(s_t, B - t)`` when their estimator reads anchor states (GiGPO).

R_multi (success) and R_single (mean step quality from the environment study's scorer:
FrozenLake's Q*, gamma 0.95) are logged every step (§7.5). Everything a run needs to continue is in
its Orbax checkpoints (:mod:`agentrl_jax.train`).

The rollout's memory settings (``rl.kv_cache_dtype``, ``rl.max_rows_per_call``,
``rl.prefill_chunk``, ``rl.generation_layout``) go to the :class:`SamplerPolicy` and the
:class:`RolloutConfig` (:func:`rollout_config`, :func:`sampler_policy`). Placement is decided
before the first update: the train state (policy, reference, optimizer, counters and key) is
committed to its final layout (:func:`agentrl_jax.train.state.place_state`) and the policy
reshards each update's parameters once into the sampler's layout, so every program compiles
once per shape, never again because an input moved.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from agentrl_jax import distributed
from agentrl_jax.errors import ConfigError
from agentrl_jax.policy import SamplerPolicy
from agentrl_jax.reproduce.config import RLSettings
from agentrl_jax.rollout import MultiTurnRollout, RolloutConfig
from agentrl_jax.sampling import Paging, SamplingConfig
from agentrl_jax.sharding import BATCH_AXES
from agentrl_jax.train import (
    Checkpointer,
    MetricsLogger,
    TrainConfig,
    init_train_state,
    make_train_step,
    train,
)
from agentrl_jax.train.inputs import step_inputs
from agentrl_jax.train.loop import WandbSink, tensorboard_available
from agentrl_jax.train.state import place_state
from agentrl_jax.trajectory import TOKEN_FIELDS, Trajectory, bucket_width, row_lengths


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One RL run: its name (folder), label (tables), trainer config and budget mode."""

    name: str
    label: str
    train_config: TrainConfig
    budget_mix: bool | str  # False, True (BudgetMix) or "adaptive" (budgets each task can meet)


def loss_position_bound(t_max: int, max_response_tokens: int, max_context: int) -> int | None:
    """The most sampled tokens a row can hold, ``t_max x max_response_tokens``: the static
    bound at which the update runs the output head (None when it is not below the context)."""
    bound = t_max * max_response_tokens
    return bound if bound < max_context - 1 else None


def run_specs(
    rl: RLSettings, loss_positions: int | None = None, max_response_length: int | None = None
) -> list[RunSpec]:
    """The runs of ``rl.runs``, in order; ``loss_positions``: see :func:`loss_position_bound`;
    ``max_response_length``: the most sampled tokens a row can hold (``t_max x
    max_response_tokens``; DAPO's overlong ``L_max``, Dr. GRPO's constant)."""
    specs = []
    for run in rl.resolved_runs():
        config = TrainConfig(
            algorithm=run.algorithm,
            learning_rate=rl.learning_rate,
            weight_decay=rl.weight_decay,
            max_grad_norm=rl.max_grad_norm,
            critic_learning_rate=rl.critic_learning_rate,
            epochs=rl.epochs,
            mini_batches=rl.mini_batches,
            num_micro_batches=rl.num_micro_batches,
            budget_anchors=bool(run.budget_mix)
            and "anchor_keys" in step_inputs(run.algorithm).advantage,
            total_steps=rl.steps,
            checkpoint_every=rl.checkpoint_every,
            checkpoint_keep=2,
            seed=rl.seed,
            remat=rl.remat,
            attention=rl.attention,
            logits_chunk=rl.logits_chunk,
            loss_positions=loss_positions,
            max_response_length=max_response_length,
            scoring=rl.scoring,
            sampling_temperature=rl.temperature,
            sampling_top_p=rl.top_p,
        )
        specs.append(RunSpec(run.name, run.label, config, run.budget_mix))
    return specs


def task_batch_fn(num_tasks: int, tasks_per_step: int, seed: int) -> Callable[[int], np.ndarray]:
    """``position -> int[tasks_per_step]`` distinct task ids, a pure function of (seed, position),
    so every run (and a resumed one) sees the same batches."""
    if tasks_per_step > num_tasks:
        raise ValueError(
            f"tasks_per_step ({tasks_per_step}) exceeds the {num_tasks} training tasks"
        )

    def batch(position: int) -> np.ndarray:
        rng = np.random.default_rng([seed, position])
        return np.sort(rng.choice(num_tasks, tasks_per_step, replace=False))

    return batch


def trim_tokens(trajectory: Trajectory, smallest: int = 64) -> Trajectory:
    """``trajectory`` with its ``[N, L]`` fields cut to the longest row, rounded up to a power
    of two times ``smallest`` (:func:`~agentrl_jax.trajectory.bucket_width`): the update's cost
    grows with ``L`` (attention with ``L^2``), and conversations are usually far shorter than
    the context they may use. A handful of widths, so the train step compiles a few times."""
    length = trajectory.tokens.shape[1]
    width = bucket_width(
        int(np.max(row_lengths(trajectory.token_mask), initial=1)), length, smallest
    )
    if width == length:
        return trajectory
    return trajectory.replace(**{f: getattr(trajectory, f)[:, :width] for f in TOKEN_FIELDS})


def rollout_config(
    spec: RunSpec,
    rl: RLSettings,
    *,
    t_max: int,
    max_response_tokens: int,
    max_context: int,
    valid_vocab_size: int | None,
) -> RolloutConfig:
    return RolloutConfig(
        group_size=rl.group_size,
        budget=None if spec.budget_mix else t_max,
        adaptive_budgets=spec.budget_mix == "adaptive",
        max_response_tokens=max_response_tokens,
        max_context=max_context,
        sampling=SamplingConfig(
            temperature=rl.temperature, top_p=rl.top_p, valid_vocab_size=valid_vocab_size
        ),
        max_rows_per_call=rl.max_rows_per_call,
        refill=rl.refill,
    )


def sampler_policy(model: nnx.Module, rl: RLSettings, mesh=None) -> SamplerPolicy:
    """The rollouts' policy with ``rl``'s memory settings; on a mesh its compacted batches are
    multiples of the batch shards (``data`` x ``fsdp``), so rows always split evenly."""
    paging = None
    if rl.kv_page_size is not None:
        if mesh is not None and mesh.shape["tensor"] > 1:
            raise ConfigError(
                f"rl.kv_page_size: the paged KV cache splits rows over the batch "
                f"axes only, this run's mesh has tensor={mesh.shape['tensor']}; "
                "set it to null or use tensor: 1"
            )
        paging = Paging(page_size=rl.kv_page_size, num_pages=rl.kv_pages)
    return SamplerPolicy(
        model,
        mesh=mesh,
        cache_dtype=rl.kv_cache_dtype,
        prefill_chunk=rl.prefill_chunk,
        generation_layout=rl.generation_layout,
        paging=paging,
    )


def _tensorboard(rl: RLSettings) -> bool:
    """Whether ``rl.tensorboard`` writes event files (``auto``: when a writer is installed)."""
    return rl.tensorboard is True or (rl.tensorboard == "auto" and tensorboard_available())


def run_training(
    spec: RunSpec,
    model: nnx.Module,
    env,
    tokenizer,
    rl: RLSettings,
    *,
    run_dir: Path,
    t_max: int,
    max_response_tokens: int,
    max_context: int,
    metadata: dict[str, Any],
    quality_scorer=None,
    mesh=None,
    sample_mesh=None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> Any:
    """Train ``spec`` from ``model``'s parameters (or from the newest checkpoint in
    ``run_dir/checkpoints``); metrics go to ``run_dir/metrics.jsonl`` (R_single from
    ``quality_scorer``, the environment study's step scorer, where given). Returns the final
    policy parameters.

    On resume, ``metrics.jsonl`` keeps every line up to the restored step; records of later
    steps (logged after the last checkpoint by the run that was killed, and computed again now)
    move to ``metrics.jsonl.superseded`` (:class:`~agentrl_jax.train.MetricsLogger`). A checkpoint
    written by another config raises :class:`~agentrl_jax.train.CheckpointMismatchError` before
    the metrics are touched, and is left in place.

    Several processes (:mod:`agentrl_jax.distributed`): the train state lives on the global
    ``mesh``, rollouts run on each process's ``sample_mesh`` (its part of ``mesh``) with the
    rows split by process and gathered, each update's batch is placed on the global mesh from
    every process's rows, the checkpoints are written by all, the metrics by the main process
    only. Returns host (NumPy) parameters then."""
    vocab = model.config.vocab_size
    valid = len(tokenizer) if len(tokenizer) < vocab else None
    config = spec.train_config
    if config.scoring == "sampling":  # the rollout never samples embedding rows past the tokenizer
        config = dataclasses.replace(config, valid_vocab_size=valid)
    runner = MultiTurnRollout(
        env,
        tokenizer,
        rollout_config(
            spec,
            rl,
            t_max=t_max,
            max_response_tokens=max_response_tokens,
            max_context=max_context,
            valid_vocab_size=valid,
        ),
    )
    processes = distributed.is_multiprocess()
    policy = sampler_policy(model, rl, sample_mesh if processes else mesh)
    state = place_state(init_train_state(model, config), mesh)
    # the step donates its input state: train on a copy, so the model keeps its parameters
    state = state.replace(policy=jax.tree.map(jnp.copy, state.policy))
    checkpointer = Checkpointer.from_config(run_dir / "checkpoints", config)
    restored = checkpointer.restore_latest(state, config)
    if restored is not None:
        state = restored.state
    step_fn = make_train_step(
        nnx.graphdef(model),
        config,
        mesh=mesh,
        donate=True,
        state_template=state if mesh is not None else None,
    )
    logger = (
        None
        if not distributed.is_main()
        else MetricsLogger(
            run_dir / "metrics.jsonl",
            resume_step=int(state.step),
            tensorboard_dir=run_dir / "tensorboard" if _tensorboard(rl) else None,
            sinks=[]
            if rl.wandb_project is None
            else [WandbSink(rl.wandb_project, name=spec.name, directory=run_dir, config=metadata)],
        )
    )
    callback = None if on_step is None else (lambda s, m: on_step(int(s.step), m))
    play = runner.for_training(policy)

    def rollout(params, key, tasks):
        if processes:  # the global state's parameters and key, for this process's devices
            params, key = distributed.host_value(params), distributed.host_key(key)
        with distributed.split_rollouts():
            return trim_tokens(play(params, key, tasks))

    def step(state, batch):
        if processes:  # every process holds the whole batch; each places its rows
            batch = distributed.global_batch(batch, mesh, (BATCH_AXES,))
        return step_fn(state, batch)

    try:
        state = train(
            state,
            step,
            rollout,
            task_batch_fn(env.num_tasks(), rl.tasks_per_step, rl.seed),
            config,
            quality_scorer=quality_scorer,
            checkpointer=checkpointer,
            checkpoint_metadata=metadata,
            logger=logger,
            progress=False,
            on_step=callback,
        )
    finally:
        if logger is not None:
            logger.close()
        checkpointer.close()
    return distributed.host_value(state.policy) if processes else state.policy
