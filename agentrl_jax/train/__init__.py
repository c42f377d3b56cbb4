"""The trainer: config, state, the pure jitted train step, the loop, and Orbax checkpoints.

``train_step(state, batch) -> (state, metrics)`` (:mod:`.step`, every update of one rollout
batch: ``epochs x mini_batches``) is pure and jitted; it computes what the configured
estimator and terms declare (:mod:`.inputs`); the loop
(:mod:`.loop`) injects the rollout and does the side effects (metrics, progress, checkpoints).
"""

from agentrl_jax.train.checkpoint import (
    Checkpointer,
    CheckpointMismatchError,
    CheckpointRestoreError,
    CorruptCheckpointWarning,
    Restored,
)
from agentrl_jax.train.config import TrainConfig, algorithm_to_dict
from agentrl_jax.train.inputs import StepInputs, check_inputs, step_inputs
from agentrl_jax.train.logprobs import check_loss_positions, position_logprobs
from agentrl_jax.train.loop import (
    MetricsLogger,
    read_metrics,
    rollout_metrics,
    tensorboard_writer,
    train,
)
from agentrl_jax.train.state import (
    CriticParams,
    TrainState,
    critic_optimizer,
    init_critic,
    init_train_state,
    policy_optimizer,
    shard_state,
    state_shardings,
)
from agentrl_jax.train.step import (
    JittedTrainStep,
    TrainBatch,
    accumulate_gradients,
    activation_constraint,
    advantage_inputs,
    batch_loss_mask,
    batch_shardings,
    check_full_history,
    compute_gradients,
    critic_gradients,
    critic_values,
    make_train_step,
    policy_gradients,
    prepare_batch,
    select_rows,
    sequence_logprobs,
    split_micro_batches,
    train_step,
    update_rows,
)

__all__ = [
    "CheckpointMismatchError",
    "CheckpointRestoreError",
    "Checkpointer",
    "CorruptCheckpointWarning",
    "CriticParams",
    "MetricsLogger",
    "JittedTrainStep",
    "Restored",
    "StepInputs",
    "TrainBatch",
    "activation_constraint",
    "check_loss_positions",
    "position_logprobs",
    "TrainConfig",
    "TrainState",
    "accumulate_gradients",
    "advantage_inputs",
    "algorithm_to_dict",
    "batch_loss_mask",
    "batch_shardings",
    "check_full_history",
    "check_inputs",
    "compute_gradients",
    "critic_gradients",
    "critic_optimizer",
    "critic_values",
    "init_critic",
    "init_train_state",
    "make_train_step",
    "policy_gradients",
    "policy_optimizer",
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
    "train_step",
    "update_rows",
]
