"""The train step: ``train_step(state, batch) -> (state, metrics)``, pure and jitted.

One call performs one update of the policy (and of the critic, for PPO) from one rollout
batch:

1. teacher-forced log-probs of the sampled tokens under the policy, over the whole
   conversation (``token_mask`` is the attention mask, positions count real tokens); the
   reference policy's log-probs the same way (frozen, no gradient) when the config has a KL
   term; the critic's values (PPO) before its update;
2. advantages from the registry (:func:`~agentrl_jax.algorithms.compute_advantages`) on the
   outcome reward, shaped by process scores if the batch has them
   (:func:`~agentrl_jax.process_rewards.shape_rewards`);
3. the configured loss (:func:`~agentrl_jax.algorithms.compute_loss`), with gradients
   accumulated over ``num_micro_batches`` micro-batches by ``lax.scan``. Each micro-batch
   contributes the gradient of its unreduced loss sum and its denominator; the sum of
   gradients is divided once by the global denominator, so the result is exactly the
   full-batch gradient for every aggregation mode (see :mod:`agentrl_jax.algorithms.aggregation`);
4. optax AdamW (after global-norm clipping) on the policy, and on the critic with its own
   optimizer. If the loss or any gradient is not finite, neither is updated (parameters and
   optimizer states are kept), ``metrics["update_skipped"]`` is 1 and
   ``state.skipped_updates`` counts it; the step counter still advances.

Context: every sampled token is scored with the whole row before it as its context, which is
what the policy saw when the rollout kept the whole history (:func:`check_full_history`, which
the loop runs on every batch, rejects turns sampled from a history window).

Alignment: the log-prob of token ``p`` comes from the logits at ``p - 1``, and the value of
token ``p`` from the critic's hidden state at ``p - 1`` (the state the token was sampled in);
position 0 (never a sampled token) gets 0.

Micro-batches are strided: micro-batch ``m`` holds rows ``m, m + M, m + 2M, ...``. With rows
split contiguously over devices (the batch sharding along ``data``/``fsdp``), every device then
holds an equal share of every micro-batch and the split moves no data. So ``N`` must be a
multiple of ``M`` (and of ``M`` times the number of batch shards on a mesh).

Sharding: :func:`make_train_step` with a mesh jits with the state placed by
:func:`~agentrl_jax.train.state.state_shardings` and the batch split along its first axis; XLA
inserts the reductions, so sums over the batch are global, like the single-device ones.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from agentrl_jax.algorithms import (
    AdvantageInputs,
    LossInputs,
    aggregation,
    budget_anchor_keys,
    clip_indicator,
    compute_advantages,
    compute_loss,
)
from agentrl_jax.models.qwen3 import Constrain, positions_from_mask
from agentrl_jax.process_rewards import shape_rewards, turn_rewards_to_tokens
from agentrl_jax.sharding import BATCH_AXES, QWEN3_PARAM_RULES, PartitionRule
from agentrl_jax.train.config import TrainConfig
from agentrl_jax.train.logprobs import kept_mask, position_logprobs
from agentrl_jax.train.state import CriticParams, TrainState, critic_optimizer, policy_optimizer, state_shardings
from agentrl_jax.trajectory import Trajectory


@struct.dataclass
class TrainBatch:
    """One rollout batch and, optionally, its process scores ``[N, T]`` (0 off real turns)."""

    trajectory: Trajectory
    step_scores: jax.Array | None = None


# ------------------------------------------------------------------------- model pieces


def _shift_right(x: jax.Array) -> jax.Array:
    """``[N, L-1]`` predictions for tokens 1..L-1 -> ``[N, L]`` aligned with the tokens (0 at 0)."""
    return jnp.pad(x, ((0, 0), (1, 0)))


def sequence_logprobs(model: nnx.Module, tokens: jax.Array, token_mask: jax.Array, *,
                      loss_mask: jax.Array | None = None, with_entropy: bool = False,
                      config: TrainConfig | None = None, constrain: Constrain | None = None
                      ) -> tuple[jax.Array, jax.Array | None]:
    """Teacher-forced ``log pi(token_p | tokens_<p)`` ``[N, L]`` (and the entropy at each
    position's predicting distribution, ``[N, L]``, if asked); 0 at position 0.

    With ``loss_mask`` the head runs only at those positions (0 elsewhere), in chunks
    (:mod:`agentrl_jax.train.logprobs`; ``config.loss_positions`` bounds them per row,
    ``config.logits_chunk`` sizes the chunks); without it at every position. ``config``'s
    ``remat`` applies to the layers; ``constrain`` to activations (see :func:`activation_constraint`).
    """
    config = config or TrainConfig()
    hidden, _ = model.hidden_states(tokens, positions_from_mask(token_mask), token_mask,
                                    remat=config.remat, constrain=constrain, attention=config.attention)
    mask = jnp.ones_like(token_mask, bool) if loss_mask is None else loss_mask
    return position_logprobs(hidden, tokens, mask, lambda h: model.logits((constrain or _same)(h)),
                             width=config.loss_positions, chunk=config.logits_chunk,
                             with_entropy=with_entropy)


def _same(x):
    return x


def activation_constraint(mesh: Mesh | None) -> Constrain | None:
    """Rows of an activation ``[N, ...]`` over the mesh's batch axes (None without a mesh), so
    under FSDP each device holds its share of the micro-batch, never all of it."""
    if mesh is None:
        return None

    def constrain(x: jax.Array) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(BATCH_AXES, *([None] * (x.ndim - 1)))))

    return constrain


def critic_values(model: nnx.Module, head: dict[str, jax.Array], tokens: jax.Array,
                  token_mask: jax.Array, *, config: TrainConfig | None = None,
                  constrain: Constrain | None = None) -> jax.Array:
    """``V`` of the state each token was sampled in, ``[N, L]`` float32 (0 at position 0)."""
    config = config or TrainConfig()
    hidden, _ = model.hidden_states(tokens, positions_from_mask(token_mask), token_mask,
                                    remat=config.remat, constrain=constrain, attention=config.attention)
    values = jnp.einsum("nld,d->nl", hidden[:, :-1].astype(jnp.float32), head["kernel"]) + head["bias"]
    return _shift_right(values)


# ------------------------------------------------------------------------- micro-batching


def split_micro_batches(tree: Any, num: int) -> Any:
    """``[N, ...]`` leaves -> ``[num, N / num, ...]``; micro-batch m holds rows m, m + num, ..."""
    def split(x):
        if x.shape[0] % num:
            raise ValueError(f"num_micro_batches={num} must divide the batch's {x.shape[0]} rows")
        return jnp.swapaxes(x.reshape(x.shape[0] // num, num, *x.shape[1:]), 0, 1)

    return jax.tree.map(split, tree)


def merge_micro_batches(tree: Any) -> Any:
    """Inverse of :func:`split_micro_batches`: ``[num, N / num, ...]`` -> ``[N, ...]``."""
    return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:]), tree)


def map_micro_batches(fn: Callable[[Any], Any], data: Any, num: int) -> Any:
    """``fn`` over micro-batches of ``data`` (``lax.map``), results reassembled row-aligned."""
    if num == 1:
        return fn(data)
    return merge_micro_batches(jax.lax.map(fn, split_micro_batches(data, num)))


def accumulate_gradients(loss_fn: Callable[[Any, Any], tuple[jax.Array, Any]], params: Any,
                         data: Any, num: int) -> tuple[Any, Any]:
    """Sums ``grad(loss_fn)(params, micro_batch)`` and its aux over ``num`` micro-batches.

    ``loss_fn(params, batch) -> (value to differentiate, aux pytree)``; aux is summed too
    (pass :class:`~agentrl_jax.algorithms.LossSum` parts). One micro-batch skips the scan.
    """
    grad_fn = jax.grad(loss_fn, has_aux=True)
    if num == 1:
        return grad_fn(params, data)
    micro = split_micro_batches(data, num)

    def body(carry, batch):
        return jax.tree.map(jnp.add, carry, grad_fn(params, batch)), None

    first = jax.tree.map(lambda x: x[0], micro)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(grad_fn, params, first))
    total, _ = jax.lax.scan(body, zeros, micro)
    return total


def _divide(tree: Any, denom: jax.Array) -> Any:
    safe = jnp.where(denom > 0, denom, 1.0)
    return jax.tree.map(lambda g: jnp.where(denom > 0, g / safe, jnp.zeros_like(g)), tree)


def _all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def _keep_if(ok: jax.Array, new: Any, old: Any) -> Any:
    return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)


# ------------------------------------------------------------------------- the step


def batch_loss_mask(trajectory: Trajectory) -> jax.Array:
    """Sampled tokens of real rows: the tokens the loss is taken over, ``[N, L]`` bool."""
    return trajectory.loss_mask.astype(bool) & trajectory.row_mask.astype(bool)[:, None]


def check_full_history(trajectory: Trajectory) -> None:
    """Raises ValueError if a turn was sampled from a windowed history (host-side check).

    The step scores every sampled token with the whole row before it as its context, which
    reproduces the sampling log-probs only if each turn saw the whole history, i.e.
    ``context_start == prefix_len`` on every real turn. A history window (the rollout's
    ``history_window``) changes positions and attention per turn; training on such rows would
    need each turn re-scored on its own context, which this step does not do.
    """
    real = np.asarray(trajectory.turn_mask, bool) & np.asarray(trajectory.row_mask, bool)[:, None]
    windowed = real & (np.asarray(trajectory.context_start) != np.asarray(trajectory.prefix_len)[:, None])
    if windowed.any():
        row, turn = (int(i[0]) for i in np.nonzero(windowed))
        raise ValueError(
            f"Trajectory.context_start: {int(windowed.sum())} turns were sampled from a windowed history "
            f"(first: row {row}, turn {turn}); the train step scores each response with the whole "
            "conversation as its context, so it needs rollouts with the whole history kept "
            "(history_window=None)")


def advantage_inputs(batch: TrainBatch, config: TrainConfig, old_values: jax.Array | None) -> AdvantageInputs:
    """What the configured estimator reads, from a batch (rewards shaped by process scores)."""
    traj = batch.trajectory
    turn_mask = traj.turn_mask.astype(bool) & traj.row_mask.astype(bool)[:, None]
    episode, per_turn = shape_rewards(traj.outcome_reward, batch.step_scores, turn_mask,
                                      config.process_reward_coef)
    anchors = budget_anchor_keys(traj.anchor_key, traj.budget) if config.budget_anchors else traj.anchor_key
    return AdvantageInputs(
        loss_mask=batch_loss_mask(traj), rewards=episode, group_ids=traj.group_id,
        traj_mask=traj.row_mask.astype(bool), step_rewards=per_turn, turn_mask=turn_mask,
        anchor_keys=anchors, token_turn_index=traj.token_turn,
        token_rewards=turn_rewards_to_tokens(per_turn, traj.token_turn) if old_values is not None else None,
        values=old_values,
    )


def _policy_term_params(config: TrainConfig, name: str) -> dict[str, Any] | None:
    return next((dict(t.params) for t in config.algorithm.terms_for("policy") if t.name == name), None)


def compute_gradients(graphdef: nnx.GraphDef, config: TrainConfig, state: TrainState,
                      batch: TrainBatch, mesh: Mesh | None = None
                      ) -> tuple[Any, CriticParams | None, dict[str, jax.Array]]:
    """The full-batch mean gradients of the policy (and critic) losses, and metrics.

    Pure; :func:`train_step` applies them. Returns ``(policy_grads, critic_grads or None,
    metrics)`` where the metrics hold the losses as means over the whole batch. ``mesh``
    (static) adds sharding constraints on activations (rows over the batch axes).
    """
    algorithm, num = config.algorithm, config.num_micro_batches
    constrain = activation_constraint(mesh)
    traj = batch.trajectory
    full_mask = batch_loss_mask(traj)
    loss_mask = full_mask if config.loss_positions is None else kept_mask(full_mask, config.loss_positions)
    sequences = {"tokens": traj.tokens, "token_mask": traj.token_mask.astype(bool)}

    old_values = None
    if config.uses_critic:
        backbone = nnx.merge(graphdef, state.critic.backbone)
        old_values = map_micro_batches(
            lambda mb: critic_values(backbone, state.critic.head, mb["tokens"], mb["token_mask"],
                                     config=config, constrain=constrain), sequences, num)
    advantages = compute_advantages(algorithm, advantage_inputs(batch, config, old_values))

    with_entropy = _policy_term_params(config, "entropy") is not None
    clip_params = _policy_term_params(config, "policy_clip")
    data = {**sequences, "loss_mask": loss_mask, "old_logprobs": traj.logprobs,
            "advantages": advantages.advantages}

    def policy_loss(params, mb):
        scoring = {"loss_mask": mb["loss_mask"], "config": config, "constrain": constrain}
        logprobs, entropy = sequence_logprobs(nnx.merge(graphdef, params), mb["tokens"], mb["token_mask"],
                                              with_entropy=with_entropy, **scoring)
        ref_logprobs = None
        if config.uses_reference:
            reference = nnx.merge(graphdef, jax.lax.stop_gradient(state.reference))
            ref_logprobs, _ = sequence_logprobs(reference, mb["tokens"], mb["token_mask"], **scoring)
        inputs = LossInputs(loss_mask=mb["loss_mask"], logprobs=logprobs, old_logprobs=mb["old_logprobs"],
                            ref_logprobs=ref_logprobs, advantages=mb["advantages"], entropy=entropy)
        total, parts = compute_loss(algorithm, inputs, "policy")
        extras = {}
        if clip_params is not None:  # a metric: the share of tokens whose gradient clipping zeroes
            clipped = clip_indicator(jax.lax.stop_gradient(logprobs), mb["old_logprobs"], mb["advantages"],
                                     **clip_params)
            extras["clip_fraction"] = aggregation.aggregate(clipped, mb["loss_mask"])
        return total.total, (total, parts, extras)

    grads, (total, parts, extras) = accumulate_gradients(policy_loss, state.policy, data, num)
    policy_grads = _divide(grads, total.denom)
    weights = loss_mask.astype(jnp.float32)
    metrics = {
        "loss": aggregation.mean(total),
        **{f"loss/{name}": aggregation.mean(part) for name, part in parts.items()},
        **{name: aggregation.mean(part) for name, part in extras.items()},
        "grad_norm": optax.tree.norm(policy_grads),
        "advantage_mean": jnp.sum(advantages.advantages * weights) / jnp.maximum(jnp.sum(weights), 1.0),
        "loss_tokens": jnp.sum(weights),
        "loss_tokens_dropped": jnp.sum(full_mask) - jnp.sum(loss_mask),
    }

    critic_grads = None
    if config.uses_critic:
        critic_data = {**sequences, "loss_mask": loss_mask, "old_values": old_values,
                       "returns": advantages.returns}

        def value_loss(critic, mb):
            values = critic_values(nnx.merge(graphdef, critic.backbone), critic.head, mb["tokens"], mb["token_mask"],
                                   config=config, constrain=constrain)
            inputs = LossInputs(loss_mask=mb["loss_mask"], values=values, old_values=mb["old_values"],
                                returns=mb["returns"])
            total, _ = compute_loss(algorithm, inputs, "critic")
            return total.total, total

        grads, critic_total = accumulate_gradients(value_loss, state.critic, critic_data, num)
        critic_grads = _divide(grads, critic_total.denom)
        metrics.update({
            "value_loss": aggregation.mean(critic_total),
            "critic_grad_norm": optax.tree.norm(critic_grads),
            "value_mean": jnp.sum(old_values * weights) / jnp.maximum(jnp.sum(weights), 1.0),
        })
    return policy_grads, critic_grads, metrics


def train_step(graphdef: nnx.GraphDef, config: TrainConfig, state: TrainState,
               batch: TrainBatch, mesh: Mesh | None = None) -> tuple[TrainState, dict[str, jax.Array]]:
    """One update (see the module docstring). Pure; jit it with :func:`make_train_step`."""
    policy_grads, critic_grads, metrics = compute_gradients(graphdef, config, state, batch, mesh)
    finite = jnp.isfinite(metrics["loss"]) & _all_finite(policy_grads)
    if critic_grads is not None:
        finite = finite & jnp.isfinite(metrics["value_loss"]) & _all_finite(critic_grads)

    updates, policy_opt = policy_optimizer(config).update(policy_grads, state.policy_opt, state.policy)
    policy = optax.apply_updates(state.policy, updates)
    new = state.replace(policy=_keep_if(finite, policy, state.policy),
                        policy_opt=_keep_if(finite, policy_opt, state.policy_opt))
    if critic_grads is not None:
        updates, critic_opt = critic_optimizer(config).update(critic_grads, state.critic_opt, state.critic)
        critic = optax.apply_updates(state.critic, updates)
        new = new.replace(critic=_keep_if(finite, critic, state.critic),
                          critic_opt=_keep_if(finite, critic_opt, state.critic_opt))
    skipped = (~finite).astype(jnp.int32)
    new = new.replace(step=state.step + 1, skipped_updates=state.skipped_updates + skipped)
    metrics = {**metrics, "update_skipped": skipped.astype(jnp.float32),
               "skipped_updates": new.skipped_updates.astype(jnp.float32)}
    return new, metrics


def batch_shardings(batch: Any, mesh: Mesh) -> Any:
    """Every leaf split along its first (row) axis over the mesh's batch axes."""
    return jax.tree.map(lambda x: NamedSharding(mesh, P(BATCH_AXES, *([None] * (x.ndim - 1)))), batch)


class JittedTrainStep:
    """The jitted train step of one model structure, config and placement.

    Call it as ``step(state, batch) -> (state, metrics)``. :meth:`jitted` gives the
    ``jax.jit`` object for a batch's structure (step scores present or not), so the step can
    be lowered and compiled ahead of time with abstract inputs, e.g.
    ``step.jitted(batch).lower(abstract_state, abstract_batch).compile().memory_analysis()``
    (:mod:`agentrl_jax.plan` does this for a target's devices). ``trace_counts`` counts traces
    (= compilations) per batch structure.
    """

    def __init__(self, graphdef: nnx.GraphDef, config: TrainConfig, *, mesh: Mesh | None = None,
                 state_template: TrainState | None = None,
                 rules: Sequence[PartitionRule] = QWEN3_PARAM_RULES, donate: bool = False):
        if mesh is not None and state_template is None:
            raise ValueError("make_train_step: a mesh needs state_template to lay out the state")
        self.graphdef, self.config, self.mesh, self.donate = graphdef, config, mesh, donate
        self.state_shardings = None if mesh is None else state_shardings(state_template, mesh, rules)
        self.traces = 0
        self._jitted: dict[Any, Any] = {}

    def _step(self, state, batch):
        self.traces += 1
        return train_step(self.graphdef, self.config, state, batch, self.mesh)

    def jitted(self, batch: Any):
        """The ``jax.jit`` of the step for ``batch``'s tree structure (arrays or abstract)."""
        key = jax.tree.structure(batch)
        if key not in self._jitted:
            donate = (0,) if self.donate else ()
            if self.mesh is None:
                self._jitted[key] = jax.jit(self._step, donate_argnums=donate)
            else:
                self._jitted[key] = jax.jit(
                    self._step, in_shardings=(self.state_shardings, batch_shardings(batch, self.mesh)),
                    out_shardings=(self.state_shardings, NamedSharding(self.mesh, P())),
                    donate_argnums=donate)
        return self._jitted[key]

    def __call__(self, state: TrainState, batch: TrainBatch) -> tuple[TrainState, dict[str, jax.Array]]:
        return self.jitted(batch)(state, batch)

    def compiled_count(self) -> int:
        """Programs compiled so far, over every batch structure (jit cache entries)."""
        return sum(j._cache_size() for j in self._jitted.values())


def make_train_step(graphdef: nnx.GraphDef, config: TrainConfig, *, mesh: Mesh | None = None,
                    state_template: TrainState | None = None,
                    rules: Sequence[PartitionRule] = QWEN3_PARAM_RULES, donate: bool = False
                    ) -> JittedTrainStep:
    """The jitted :func:`train_step` for one model structure and config (a :class:`JittedTrainStep`).

    With ``mesh`` (and a ``state_template``, arrays or ShapeDtypeStructs, for the layout),
    the state keeps :func:`~agentrl_jax.train.state.state_shardings` in and out, batch
    leaves are split along rows and activations are constrained to rows over the batch
    axes; place the inputs with ``shard_state``/``jax.device_put`` first. ``donate`` reuses
    the input state's buffers for the output state (the caller must not use them again).
    """
    return JittedTrainStep(graphdef, config, mesh=mesh, state_template=state_template, rules=rules,
                           donate=donate)
