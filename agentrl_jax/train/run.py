"""The training entry point: one function that trains a policy on an environment with an
algorithm, under one config (MaxText's ``train.py`` is the model).

    params = train_policy(model, tokenizer, "frozenlake", "grpo", config, out="runs/grpo")

* ``policy``: a Qwen3 (:class:`~agentrl_jax.models.Qwen3ForCausalLM`); its parameters are the
  start and the KL reference; ``tokenizer`` its tokenizer (with a chat template).
* ``env``: a registered environment's name (its training tasks are built from
  ``config.task``: :func:`envs.task_set`), or an :class:`~envs.protocol.EnvTasks` /
  text environment of your own.
* ``algorithm``: a run of ``rl.runs``' kinds (:mod:`agentrl_jax.train.presets`): a preset name
  (``grpo``, ``budgetmix``, ``gigpo``, ``ppo``, ``dapo``, ...), a mapping ``{name, preset,
  label, budget_mix, params, algorithm}`` composing registered estimators and loss terms, or
  an already resolved :class:`~agentrl_jax.train.presets.RunSettings`.
* ``config``: a :class:`~agentrl_jax.train.config.Config` (or the reproduction's, which extends
  it): ``task`` (lengths, T_max, the task set), ``engine`` (the rollouts' sampling engine),
  ``rl`` (rollouts, optimizer, batching, memory, checkpoints, live metrics) and ``mesh``.
* ``process_rewards``: a step scorer (:class:`~agentrl_jax.trajectory.StepScorer`: an
  environment's oracle such as FrozenLake's exact Q*, a judge) whose scores, weighted by
  ``rl.process_reward_coef``, shape the reward (§8); ``quality_scorer``: R_single's (logged,
  never trained on; it may be the same object, then it runs once).

The run lives in ``out``: Orbax checkpoints (``checkpoints/``; a rerun resumes from the newest,
to the same bytes), ``metrics.jsonl`` (one record per update; TensorBoard and W&B as
``rl`` says). Every update plays ``rl.tasks_per_step`` tasks (a pure function of ``rl.seed``
and the update's position, so every run and a resumed one see the same batches) x
``rl.group_size`` trajectories: at ``T_max``, or for a BudgetMix run one budget per task
group from ``{(k T_max) // 10}`` (§5), only budgets each task can meet for an adaptive one.

Placement is decided before the first update: the train state (policy, reference, optimizer,
counters, key) is committed to its final layout (:func:`~agentrl_jax.train.state.place_state`)
and the sampler reshards each update's parameters once into its own layout, so every program
compiles once per shape. Several processes (:mod:`agentrl_jax.distributed`): the train state
lives on the global mesh, rollouts run on each process's part of it with the rows split by
process and gathered, each update's batch is placed on the global mesh from every process's
rows, the checkpoints are written by all, the metrics by the main process only; the
parameters come back as host (NumPy) arrays then.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import envs
from agentrl_jax import distributed
from agentrl_jax.errors import ConfigError
from agentrl_jax.rollout import MultiTurnRollout, RolloutConfig
from agentrl_jax.sampling import SamplerPolicy
from agentrl_jax.sampling.config import kv_cache_bytes
from agentrl_jax.sampling.weights import sync_weights
from agentrl_jax.serve.agents import AgentEnv, serving
from agentrl_jax.sharding import data_mesh, device_memory_bytes, rollout_devices, training_mesh
from agentrl_jax.train.checkpoint import Checkpointer
from agentrl_jax.train.config import Config, train_config
from agentrl_jax.train.jitted_step import make_train_step
from agentrl_jax.train.loop import train
from agentrl_jax.train.presets import RunSettings, resolve_run
from agentrl_jax.train.restore_checks import BatchShape
from agentrl_jax.train.sinks import MetricsLogger, WandbSink, tensorboard_available
from agentrl_jax.train.state import init_train_state, place_state, policy_params, train_model
from agentrl_jax.trajectory import TOKEN_FIELDS, StepScorer, Trajectory, bucket_width, row_lengths


def train_policy(
    policy: nnx.Module,
    tokenizer: Any,
    env: str | envs.EnvTasks | Any,
    algorithm: str | Mapping[str, Any] | RunSettings,
    config: Config,
    *,
    out: str | Path,
    process_rewards: StepScorer | None = None,
    quality_scorer: StepScorer | None = None,
    metadata: Mapping[str, Any] | None = None,
    mesh: Any = "config",
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    progress: bool = False,
    events: list[tuple[str, int]] | None = None,
) -> Any:
    """Train ``policy`` on ``env`` with ``algorithm`` under ``config`` into ``out`` (module
    docstring); returns the final policy parameters (a plain Qwen3's: with ``rl.lora`` the
    adapters merged into the weights, in the base's training dtype). ``mesh``: the devices of
    the train state (default: ``config.mesh``'s; None: one device), on which ``policy``'s
    parameters may already lie. ``on_step(step, metrics)`` runs after every update; ``events``, if
    given, receives the asynchronous loop's order of events (:func:`~agentrl_jax.train.train`)."""
    if not isinstance(config, Config):
        raise TypeError(f"config: must be a Config, got {type(config).__name__}")
    run = (
        algorithm
        if isinstance(algorithm, RunSettings)
        else resolve_run("algorithm", algorithm, config.rl)
    )
    out = Path(out)
    check_rollout_memory(policy, config)  # before anything is allocated
    if isinstance(env, str):
        env = envs.task_set(config.task, split="train", count=config.task.train_tasks)
    text_env = env.env if isinstance(env, envs.EnvTasks) else env
    if mesh == "config":
        mesh = training_mesh(config.mesh)
    vocab = policy.config.vocab_size
    valid = len(tokenizer) if len(tokenizer) < vocab else None
    update = train_config(config, run, valid)
    agent = isinstance(text_env, AgentEnv)  # an agent program, served (serve/agents.py)
    runner = (
        None if agent else MultiTurnRollout(text_env, tokenizer, rollout_config(config, run, valid))
    )
    processes = distributed.is_multiprocess()
    trained = train_model(policy, update)  # with rl.lora: adapters on the shared weights
    sampler = rollout_sampler(trained, config, mesh)  # with rl.lora: applies the adapters
    shape = (
        BatchShape(turns=text_env.max_turns, tokens=config.task.max_context)
        if agent
        else BatchShape(turns=runner.num_turns, tokens=runner.config.record_length)
    )
    state = place_state(init_train_state(trained, update), mesh)
    # the step donates its input state: train on a copy, so the model keeps its parameters (a
    # LoRA run's frozen base is never donated: it stays the model's own weights)
    state = state.replace(policy=jax.tree.map(jnp.copy, state.policy))
    checkpointer = Checkpointer.from_config(out / "checkpoints", update)
    restored = checkpointer.restore_latest(state, update)
    pending = []
    if restored is not None:
        state = restored.state
        pending = [
            dataclasses.replace(p, rng=_like(p.rng, state.rng))
            for p in checkpointer.restore_pending(restored, shape)
        ]
        if (
            config.rl.asynchronous.max_staleness
            and not pending
            and int(state.step) < config.rl.steps
        ):
            warnings.warn(
                f"checkpoint {restored.path} holds no batches sampled ahead (written with "
                "another rl.asynchronous.max_staleness?): the next "
                f"{config.rl.asynchronous.max_staleness} are sampled afresh by the restored "
                "parameters",
                stacklevel=2,
            )
    step_fn = make_train_step(
        nnx.graphdef(trained),
        update,
        mesh=mesh,
        donate=True,
        state_template=state if mesh is not None else None,
    )
    logger = _logger(config, run, out, int(state.step), metadata) if distributed.is_main() else None
    stack = contextlib.ExitStack()
    play = (
        stack.enter_context(serving(trained, tokenizer, text_env, config))
        if agent
        else runner.for_training(sampler)
    )

    def publish(params):  # the parameters the sampler reads, copied on device
        return sync_weights(
            params,
            sampler.mesh,
            layout=sampler.generation_layout,
            device=sampler.device,
            dtype=policy.dtype,
        )

    sampler_devices = (
        set(sampler.mesh.devices.flat) if sampler.mesh is not None else {sampler.device}
    )

    def rollout(params, key, tasks):
        if agent:  # the server's engine places them on its device itself
            return trim_tokens(play(params, key, tasks))
        # the train state's parameters (synchronous loop) to the sampler's devices, where they
        # are not there yet (several processes, rollout devices of their own)
        if jax.tree.leaves(params)[0].sharding.device_set != sampler_devices:
            params = publish(params)
        if processes:  # the global state's key, for this process's devices
            key = distributed.host_key(key)
        return trim_tokens(play(params, key, tasks))

    try:
        state = train(
            state,
            step_fn,  # places each batch once, in its shardings (JittedTrainStep.place)
            rollout,
            task_batch_fn(text_env.num_tasks(), config.rl.tasks_per_step, config.rl.seed),
            update,
            process_scorer=process_rewards,
            quality_scorer=quality_scorer,
            checkpointer=checkpointer,
            checkpoint_metadata=metadata,
            logger=logger,
            progress=progress,
            on_step=None if on_step is None else (lambda s, m: on_step(int(s.step), m)),
            publish=publish,
            pending=pending,
            events=events,
        )
    finally:
        if logger is not None:
            logger.close()
        checkpointer.close()
        stack.close()
    params = policy_params(state, update)  # with LoRA: the adapters merged into the weights
    return distributed.host_value(params) if processes else params


def check_rollout_memory(policy: nnx.Module, config: Config) -> None:
    """Refuses (:class:`~agentrl_jax.errors.ConfigError` naming the fields) rollouts whose KV
    cache cannot fit the devices that sample them, by the rule: the cache of the rows one
    rollout call holds (``rl.max_rows_per_call``, else ``tasks_per_step x group_size``) at
    ``task.max_context`` tokens (:func:`~agentrl_jax.sampling.config.kv_cache_bytes`), split
    evenly over the sampling devices, is at most one device's memory
    (:func:`~agentrl_jax.sharding.device_memory_bytes`). The rest of the rollout (weights,
    logits) comes on top: passing this rule is necessary, not sufficient (``agentrl-jax plan``
    compiles the programs for the whole figure)."""
    rl = config.rl
    rows = rl.max_rows_per_call or rl.tasks_per_step * rl.group_size
    devices = rollout_devices(config.mesh) or jax.local_devices()
    need = kv_cache_bytes(config.engine, policy.config, rows, config.task.max_context, policy.dtype)
    shares = len(devices) * jax.process_count()  # rows are split by process, then by device
    per_device = -(-need // shares)
    have = device_memory_bytes(devices[0])
    if per_device > have:

        def size(n: int) -> str:
            return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"

        raise ConfigError(
            f"rl.tasks_per_step: a rollout's KV cache, {rows:,} rows "
            f"({'rl.max_rows_per_call' if rl.max_rows_per_call else 'tasks_per_step x group_size'})"
            f" x task.max_context {config.task.max_context:,} tokens, is {size(per_device)} "
            f"on each of {shares} device(s), more than one device's {size(have)}; lower "
            "rl.max_rows_per_call, the rows or task.max_context "
            "(or bound the paged pool, engine.kv_pages)"
        )


def rollout_sampler(policy: nnx.Module, config: Config, mesh: Any) -> SamplerPolicy:
    """The rollouts' sampler: on this process's part of the training ``mesh`` (colocated),
    or on its rollout devices (``mesh.rollout``), rows split over them."""
    devices = rollout_devices(config.mesh)
    exact = {"exact_logprobs": True} if config.rl.exact_logprobs else {}
    if devices:
        if len(devices) == 1:
            return SamplerPolicy.from_engine(policy, config.engine, device=devices[0], **exact)
        return SamplerPolicy.from_engine(policy, config.engine, mesh=data_mesh(devices), **exact)
    if distributed.is_multiprocess():
        mesh = distributed.local_mesh(mesh)
    return SamplerPolicy.from_engine(policy, config.engine, mesh=mesh, **exact)


def snapshot_steps(out: str | Path) -> list[int]:
    """The steps of the checkpoints a run saved under ``out`` (ascending; [] if none)."""
    directory = Path(out) / "checkpoints"
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


def snapshot_params(
    policy: Any, tokenizer, config: Config, algorithm: RunSettings, out: str | Path, step: int
) -> Any:
    """The policy parameters (a plain Qwen3's, as :func:`train_policy` returns them) of the
    checkpoint ``train_policy`` saved at ``step`` under ``out``, for a run of ``algorithm``
    (resolved) under ``config`` started from ``policy`` (its base; its structure is the
    template). Read only: nothing under ``out`` changes."""
    vocab = policy.config.vocab_size
    valid = len(tokenizer) if len(tokenizer) < vocab else None
    update = train_config(config, algorithm, valid)
    trained = train_model(policy, update)
    template = init_train_state(trained, update)
    checkpointer = Checkpointer.from_config(Path(out) / "checkpoints", update, async_save=False)
    try:
        state = checkpointer.restore_step(template, step)
    finally:
        checkpointer.close()
    return policy_params(state, update)


def _like(value: Any, template: jax.Array) -> jax.Array:
    """Host ``value`` placed as ``template`` is (on every process's devices of its sharding)."""
    value = np.asarray(value, template.dtype)
    return jax.make_array_from_callback(value.shape, template.sharding, lambda i: value[i])


def rollout_config(
    config: Config, run: RunSettings, valid_vocab_size: int | None = None
) -> RolloutConfig:
    """The training rollouts of ``run``: ``rl.group_size`` trajectories per task at ``T_max``
    (BudgetMix: budgets drawn per group, only those each task can meet for an adaptive run;
    the budget shown as the run's ``presentation`` says),
    the task's lengths, ``rl``'s sampling (over the tokenizer's ``valid_vocab_size``) and
    rows per call."""
    task, rl = config.task, config.rl
    sampling = rl.sampling.config(valid_vocab_size)
    return RolloutConfig(
        split_processes=True,  # several processes: each plays its share of the rows
        group_size=rl.group_size,
        budget=None if run.budget_mix else task.t_max,
        adaptive_budgets=run.budget_mix == "adaptive",
        max_response_tokens=task.max_response_tokens,
        max_context=task.max_context,
        sampling=sampling,
        max_rows_per_call=rl.max_rows_per_call,
        refill=rl.refill,
        history_window=rl.history_window,
        presentation=run.presentation,
    )


def task_batch_fn(num_tasks: int, tasks_per_step: int, seed: int) -> Callable[[int], np.ndarray]:
    """``position -> int[tasks_per_step]`` distinct task ids, a pure function of (seed,
    position), so every run (and a resumed one) sees the same batches."""
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


def _logger(
    config: Config, run: RunSettings, out: Path, step: int, metadata: Mapping[str, Any] | None
) -> MetricsLogger:
    """The run's metrics: ``out/metrics.jsonl``, TensorBoard in ``out/tensorboard`` as
    ``rl.logging.tensorboard`` says (``auto``: when a writer is installed), W&B when
    ``rl.logging.wandb_project`` names a project."""
    rl = config.rl
    tensorboard = rl.logging.tensorboard is True or (
        rl.logging.tensorboard == "auto" and tensorboard_available()
    )
    sinks = []
    if rl.logging.wandb_project is not None:
        sinks.append(
            WandbSink(
                rl.logging.wandb_project, name=run.name, directory=out, config=dict(metadata or {})
            )
        )
    return MetricsLogger(
        out / "metrics.jsonl",
        resume_step=step,
        tensorboard_dir=out / "tensorboard" if tensorboard else None,
        sinks=sinks,
    )
