"""The trainer: config, state, the pure jitted train step, the loop, metric sinks, Orbax
checkpoints, and the one entry point that trains a policy on an environment.

``train_step(state, batch) -> (state, metrics)`` (:mod:`.step`, every update of one rollout
batch: ``epochs x mini_batches``) is pure, jitted and placed by :mod:`.jitted_step`
(:func:`make_train_step`); it scores tokens (:mod:`.scoring`),
prepares rewards (:mod:`.rewards`), accumulates gradients over micro-batches
(:mod:`.micro_batches`) and reports its diagnostics (:mod:`.step_metrics`), computing what the
configured estimator and terms declare (:mod:`.inputs`); the loop (:mod:`.loop`) injects the
rollout and does the side effects (metrics to :mod:`.sinks`, progress, checkpoints).
"""

from agentrl_jax.train.batch import TrainBatch, batch_loss_mask, check_step_wise
from agentrl_jax.train.checkpoint import (
    Checkpointer,
    CheckpointMismatchError,
    CheckpointRestoreError,
    CorruptCheckpointWarning,
    Restored,
)
from agentrl_jax.train.config import (
    Config,
    RLConfig,
    TaskConfig,
    TrainConfig,
    algorithm_to_dict,
    train_config,
)
from agentrl_jax.train.inputs import StepInputs, check_inputs, step_inputs
from agentrl_jax.train.jitted_step import JittedTrainStep, batch_shardings, make_train_step
from agentrl_jax.train.logprobs import check_loss_positions, position_logprobs
from agentrl_jax.train.loop import rollout_metrics, train
from agentrl_jax.train.micro_batches import accumulate_gradients, split_micro_batches
from agentrl_jax.train.rewards import advantage_inputs
from agentrl_jax.train.scoring import (
    Forward,
    activation_constraint,
    critic_values,
    sequence_logprobs,
)
from agentrl_jax.train.sinks import MetricsLogger, read_metrics, tensorboard_writer
from agentrl_jax.train.state import (
    CriticParams,
    TrainState,
    critic_optimizer,
    init_critic,
    init_train_state,
    policy_optimizer,
    policy_params,
    shard_state,
    state_shardings,
    train_model,
)
from agentrl_jax.train.step import (
    compute_gradients,
    critic_gradients,
    policy_gradients,
    prepare_batch,
    select_rows,
    train_step,
    update_rows,
)

__all__ = [
    "CheckpointMismatchError",
    "CheckpointRestoreError",
    "Checkpointer",
    "Config",
    "CorruptCheckpointWarning",
    "CriticParams",
    "Forward",
    "JittedTrainStep",
    "MetricsLogger",
    "RLConfig",
    "Restored",
    "StepInputs",
    "TaskConfig",
    "TrainBatch",
    "TrainConfig",
    "TrainState",
    "accumulate_gradients",
    "activation_constraint",
    "advantage_inputs",
    "algorithm_to_dict",
    "batch_loss_mask",
    "batch_shardings",
    "check_step_wise",
    "check_inputs",
    "check_loss_positions",
    "compute_gradients",
    "critic_gradients",
    "critic_optimizer",
    "critic_values",
    "init_critic",
    "init_train_state",
    "policy_params",
    "train_model",
    "make_train_step",
    "policy_gradients",
    "policy_optimizer",
    "position_logprobs",
    "prepare_batch",
    "read_metrics",
    "rollout_metrics",
    "select_rows",
    "sequence_logprobs",
    "shard_state",
    "split_micro_batches",
    "state_shardings",
    "step_inputs",
    "tensorboard_writer",
    "train",
    "train_config",
    "train_step",
    "update_rows",
]
