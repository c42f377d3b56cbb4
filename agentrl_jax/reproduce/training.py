"""The RL runs of the reproduction: one trainer config per preset, task batches, and a run
that resumes from its newest checkpoint.

Every run starts from the same base parameters and does the same number of updates on the
same task batches (``task_batch(position)`` depends only on the seed and the step), with the
same rollout settings; only the algorithm and the budget differ:

* full-budget runs play every task group at ``T_max``;
* BudgetMix runs draw one budget per group from ``{(k T_max) // 10 : k = 1..10}`` (§5), and
  for GiGPO anchor on ``(s_t, B - t)``.

R_multi (success) and R_single (mean Q* step quality, gamma 0.95) are logged every step
(§7.5). Everything a run needs to continue is in its Orbax checkpoints (:mod:`agentrl_jax.train`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import numpy as np
from flax import nnx

from agentrl_jax.algorithms import AlgorithmConfig, LossTermConfig
from agentrl_jax.policy import SamplerPolicy
from agentrl_jax.process_rewards import FrozenLakeQStar
from agentrl_jax.reproduce.config import RUN_PRESETS, RLSettings
from agentrl_jax.rollout import MultiTurnRollout, RolloutConfig
from agentrl_jax.sampling import SamplingConfig
from agentrl_jax.trajectory import Trajectory
from agentrl_jax.train import (Checkpointer, MetricsLogger, TrainConfig, init_train_state,
                               make_train_step, shard_state, train)

STEP_QUALITY_GAMMA = 0.95  # paper §7: Q* with gamma 0.95


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One RL run: its name (folder), label (tables), trainer config and budget mode."""

    name: str
    label: str
    train_config: TrainConfig
    budget_mix: bool


def algorithm_for(advantage: str, rl: RLSettings) -> AlgorithmConfig:
    """The preset's estimator with the paper's loss terms: clipped ratio, KL to the reference,
    and for PPO the clipped value loss."""
    params = {"grpo": {}, "gigpo": {"omega": rl.gigpo_omega, "gamma": rl.gigpo_gamma},
              "gae": {"gamma": rl.gae_gamma, "lam": rl.gae_lambda}}[advantage]
    terms = [LossTermConfig("policy_clip", 1.0, {"clip_low": rl.clip, "clip_high": rl.clip})]
    if rl.kl_coef > 0:
        terms.append(LossTermConfig("kl", rl.kl_coef))
    if advantage == "gae":
        terms.append(LossTermConfig("value_clip", 1.0, {"clip": rl.value_clip}))
    return AlgorithmConfig(advantage=advantage, advantage_params=params, loss_terms=tuple(terms))


def run_specs(rl: RLSettings) -> list[RunSpec]:
    """The runs ``rl.runs`` names, in order."""
    specs = []
    for name in rl.runs:
        label, advantage, mix = RUN_PRESETS[name]
        config = TrainConfig(
            algorithm=algorithm_for(advantage, rl), learning_rate=rl.learning_rate,
            weight_decay=rl.weight_decay, max_grad_norm=rl.max_grad_norm,
            critic_learning_rate=rl.critic_learning_rate, num_micro_batches=rl.num_micro_batches,
            budget_anchors=mix and advantage == "gigpo", total_steps=rl.steps,
            checkpoint_every=rl.checkpoint_every, checkpoint_keep=2, seed=rl.seed)
        specs.append(RunSpec(name, label, config, mix))
    return specs


def task_batch_fn(num_tasks: int, tasks_per_step: int, seed: int) -> Callable[[int], np.ndarray]:
    """``position -> int[tasks_per_step]`` distinct task ids, a pure function of (seed, position),
    so every run (and a resumed one) sees the same batches."""
    if tasks_per_step > num_tasks:
        raise ValueError(f"tasks_per_step ({tasks_per_step}) exceeds the {num_tasks} training tasks")

    def batch(position: int) -> np.ndarray:
        rng = np.random.default_rng([seed, position])
        return np.sort(rng.choice(num_tasks, tasks_per_step, replace=False))
    return batch


TOKEN_FIELDS = ("tokens", "token_mask", "loss_mask", "token_turn", "logprobs")


def trim_tokens(trajectory: Trajectory, smallest: int = 64) -> Trajectory:
    """``trajectory`` with its ``[N, L]`` fields cut to the longest row, rounded up to a power
    of two times ``smallest`` (at most ``L``): the update's cost grows with ``L`` (attention
    with ``L^2``), and conversations are usually far shorter than the context they may use.
    Widths come from a handful of buckets, so the train step compiles a few times at most."""
    length = trajectory.tokens.shape[1]
    used = int(np.max(np.sum(np.asarray(trajectory.token_mask), axis=1), initial=1))
    width = smallest
    while width < used:
        width *= 2
    width = min(width, length)
    if width == length:
        return trajectory
    return trajectory.replace(**{f: getattr(trajectory, f)[:, :width] for f in TOKEN_FIELDS})


def rollout_config(spec: RunSpec, rl: RLSettings, *, t_max: int, max_response_tokens: int,
                   max_context: int, valid_vocab_size: int | None) -> RolloutConfig:
    return RolloutConfig(
        group_size=rl.group_size, budget=None if spec.budget_mix else t_max,
        max_response_tokens=max_response_tokens, max_context=max_context,
        sampling=SamplingConfig(temperature=rl.temperature, top_p=rl.top_p,
                                valid_vocab_size=valid_vocab_size))


def run_training(spec: RunSpec, model: nnx.Module, env, tokenizer, rl: RLSettings, *,
                 run_dir: Path, t_max: int, max_response_tokens: int, max_context: int,
                 metadata: dict[str, Any], mesh=None,
                 on_step: Callable[[int, dict[str, float]], None] | None = None) -> Any:
    """Train ``spec`` from ``model``'s parameters (or from the newest checkpoint in
    ``run_dir/checkpoints``); metrics go to ``run_dir/metrics.jsonl``. Returns the final
    policy parameters."""
    config = spec.train_config
    vocab = model.config.vocab_size
    valid = len(tokenizer) if len(tokenizer) < vocab else None
    runner = MultiTurnRollout(env, tokenizer, rollout_config(
        spec, rl, t_max=t_max, max_response_tokens=max_response_tokens, max_context=max_context,
        valid_vocab_size=valid))
    policy = SamplerPolicy(model, mesh=mesh, row_multiple=1 if mesh is None else mesh.shape["data"])
    state = init_train_state(model, config)
    if mesh is not None:
        state = shard_state(state, mesh)
    checkpointer = Checkpointer.from_config(run_dir / "checkpoints", config)
    restored = checkpointer.restore_latest(state)
    if restored is not None:
        state = restored.state
    step_fn = make_train_step(nnx.graphdef(model), config, mesh=mesh,
                              state_template=state if mesh is not None else None)
    scorer = FrozenLakeQStar(env.maps, gamma=STEP_QUALITY_GAMMA, is_slippery=env.config.is_slippery,
                             success_rate=env.config.success_rate)
    logger = MetricsLogger(run_dir / "metrics.jsonl", resume_step=int(state.step))
    callback = None if on_step is None else (lambda s, m: on_step(int(s.step), m))
    try:
        play = runner.for_training(policy)
        state = train(state, step_fn, lambda params, key, tasks: trim_tokens(play(params, key, tasks)),
                      task_batch_fn(env.num_tasks(), rl.tasks_per_step, rl.seed), config,
                      quality_scorer=scorer, checkpointer=checkpointer,
                      checkpoint_metadata=metadata, logger=logger, progress=False, on_step=callback)
    finally:
        logger.close()
        checkpointer.close()
    return state.policy
