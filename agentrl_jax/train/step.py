"""The train step: ``train_step(state, batch) -> (state, metrics)``, pure and jitted.

One call makes all the updates of one rollout batch: ``epochs x mini_batches`` optimizer
updates of the policy (and of the critic, for PPO), as verl's ``ppo_epochs`` and
``ppo_mini_batch_size`` do:

1. once per batch, before the first update (:func:`prepare_batch`): the critic's values,
   advantages from the registry (:func:`~agentrl_jax.algorithms.compute_advantages`) on the
   outcome reward, shaped by process scores if the batch has them
   (:func:`~agentrl_jax.process_rewards.shape_rewards`), the policy's own log-probs of the
   sampled tokens (the "old" log-probs of the importance ratio) and the frozen reference's,
   teacher-forced over the whole conversation. Only what the configured estimator and
   terms declare is computed (:mod:`agentrl_jax.train.inputs`), whatever their names;
2. per epoch, the rows are shuffled with a key split off ``state.rng`` (when there is more
   than one mini-batch) and cut into ``mini_batches`` mini-batches of equal, static shape;
3. per mini-batch, one update: the configured loss
   (:func:`~agentrl_jax.algorithms.compute_loss_with_metrics`) with gradients accumulated
   over ``num_micro_batches`` micro-batches by ``lax.scan``. Each micro-batch contributes the
   gradient of its unreduced loss sum and its denominator; the sum of gradients is divided
   once by the mini-batch's denominator, so the result is exactly the mini-batch gradient
   for every aggregation mode (see :mod:`agentrl_jax.algorithms.aggregation`); then optax
   AdamW (after global-norm clipping) on the policy, and on the critic with its own
   optimizer. If the loss or any gradient is not finite, that update is skipped (parameters
   and optimizer states are kept) and counted in ``state.skipped_updates``; a mini-batch
   without a single loss token (``update_empty``) makes no optimizer step either.

The updates run in one ``lax.scan``, so the step compiles once whatever their number. The
old log-probs are those of the policy before the batch's first update, so the first
update's ratio is exactly 1 and later ones move away from it (and get clipped). With a
single update per batch they are that update's own log-probs under ``stop_gradient``.
``state.step`` counts rollout batches (one per call).

Metrics: batch-level ones (``advantage_mean``, ``loss_tokens``, ``loss_tokens_dropped``,
``value_mean``, ``skipped_updates``) and, per update, ``loss``, ``loss/<term>``, every term's
own metrics (``<term>/<name>``, e.g. ``policy_clip/clip_fraction``), ``ratio_mean``,
``ratio_deviation`` and ``approx_kl`` (when a term reads old log-probs), ``grad_norm``, and
with a critic ``value_loss``, ``explained_variance`` and ``critic_grad_norm``. Each per-update
metric is reported as its mean over the batch's updates under its own name, and, with more
than one update, as the ``[updates]`` array under ``updates/<name>``; ``update_skipped``
counts the skipped updates of the batch.

Context: every sampled token is scored with the whole row before it as its context, which is
what the policy saw when the rollout kept the whole history (:func:`check_full_history`, which
the loop runs on every batch, rejects turns sampled from a history window).

Alignment: the log-prob of token ``p`` comes from the logits at ``p - 1``, and the value of
token ``p`` from the critic's hidden state at ``p - 1`` (the state the token was sampled in);
position 0 (never a sampled token) gets 0.

Micro-batches are strided: micro-batch ``m`` holds rows ``m, m + M, m + 2M, ...``. With rows
split contiguously over devices (the batch sharding along ``data``/``fsdp``), every device then
holds an equal share of every micro-batch and the split moves no data. So ``N`` must be a
multiple of ``mini_batches x M`` (and of that times the number of batch shards on a mesh);
shuffled mini-batches are gathered rows, constrained to rows over the batch axes.

Sharding: :func:`make_train_step` with a mesh jits with the state placed by
:func:`~agentrl_jax.train.state.state_shardings` and the batch split along its first axis; XLA
inserts the reductions, so sums over the batch are global, like the single-device ones.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from agentrl_jax.algorithms import (
    AdvantageInputs,
    LossInputs,
    LossSum,
    aggregation,
    budget_anchor_keys,
    compute_advantages,
    compute_loss_with_metrics,
    overlong_penalty,
    policy_ratio,
)
from agentrl_jax.models.qwen3 import Constrain, positions_from_mask
from agentrl_jax.process_rewards import shape_rewards, turn_rewards_to_tokens
from agentrl_jax.sharding import BATCH_AXES, QWEN3_PARAM_RULES, PartitionRule
from agentrl_jax.train.config import TrainConfig
from agentrl_jax.train.inputs import step_inputs
from agentrl_jax.train.logprobs import kept_mask, position_logprobs
from agentrl_jax.train.state import (
    CriticParams,
    TrainState,
    critic_optimizer,
    policy_optimizer,
    state_shardings,
)
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


def sequence_logprobs(
    model: nnx.Module,
    tokens: jax.Array,
    token_mask: jax.Array,
    *,
    loss_mask: jax.Array | None = None,
    with_entropy: bool = False,
    config: TrainConfig | None = None,
    constrain: Constrain | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Teacher-forced ``log pi(token_p | tokens_<p)`` ``[N, L]`` (and the entropy at each
    position's predicting distribution, ``[N, L]``, if asked); 0 at position 0.

    With ``loss_mask`` the head runs only at those positions (0 elsewhere), in chunks
    (:mod:`agentrl_jax.train.logprobs`; ``config.loss_positions`` bounds them per row,
    ``config.logits_chunk`` sizes the chunks); without it at every position. ``config``'s
    ``remat`` applies to the layers, its ``scoring`` picks the distribution (the model's or
    the rollout's sampling distribution); ``constrain`` to activations (see
    :func:`activation_constraint`).
    """
    config = config or TrainConfig()
    hidden, _ = model.hidden_states(
        tokens,
        positions_from_mask(token_mask),
        token_mask,
        remat=config.remat,
        constrain=constrain,
        attention=config.attention,
    )
    mask = jnp.ones_like(token_mask, bool) if loss_mask is None else loss_mask
    return position_logprobs(
        hidden,
        tokens,
        mask,
        lambda h: model.logits((constrain or _same)(h)),
        width=config.loss_positions,
        chunk=config.logits_chunk,
        with_entropy=with_entropy,
        sampling=config.scoring_sampling,
    )


def _same(x):
    return x


def activation_constraint(mesh: Mesh | None) -> Constrain | None:
    """Rows of an activation ``[N, ...]`` over the mesh's batch axes (None without a mesh), so
    under FSDP each device holds its share of the micro-batch, never all of it."""
    if mesh is None:
        return None

    def constrain(x: jax.Array) -> jax.Array:
        return jax.lax.with_sharding_constraint(
            x, NamedSharding(mesh, P(BATCH_AXES, *([None] * (x.ndim - 1))))
        )

    return constrain


def critic_values(
    model: nnx.Module,
    head: dict[str, jax.Array],
    tokens: jax.Array,
    token_mask: jax.Array,
    *,
    config: TrainConfig | None = None,
    constrain: Constrain | None = None,
) -> jax.Array:
    """``V`` of the state each token was sampled in, ``[N, L]`` float32 (0 at position 0)."""
    config = config or TrainConfig()
    hidden, _ = model.hidden_states(
        tokens,
        positions_from_mask(token_mask),
        token_mask,
        remat=config.remat,
        constrain=constrain,
        attention=config.attention,
    )
    values = (
        jnp.einsum("nld,d->nl", hidden[:, :-1].astype(jnp.float32), head["kernel"]) + head["bias"]
    )
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


def _add(a: Any, b: Any) -> Any:
    return jax.tree.map(jnp.add, a, b)


def accumulate_gradients(
    loss_fn: Callable[[Any, Any], tuple[jax.Array, Any]],
    params: Any,
    data: Any,
    num: int,
    combine: Callable[[Any, Any], Any] = _add,
) -> tuple[Any, Any]:
    """Sums ``grad(loss_fn)(params, micro_batch)`` over ``num`` micro-batches, and combines
    their aux with ``combine`` (default: summed; pass :class:`~agentrl_jax.algorithms.LossSum`
    parts). ``loss_fn(params, batch) -> (value to differentiate, aux pytree)``. One
    micro-batch skips the scan.
    """
    grad_fn = jax.grad(loss_fn, has_aux=True)
    if num == 1:
        return grad_fn(params, data)
    micro = split_micro_batches(data, num)

    def body(carry, batch):
        grads, aux = grad_fn(params, batch)
        return (_add(carry[0], grads), combine(carry[1], aux)), None

    first = jax.tree.map(lambda x: x[0], micro)
    zeros = jax.tree.map(
        lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(grad_fn, params, first)
    )
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
    windowed = real & (
        np.asarray(trajectory.context_start) != np.asarray(trajectory.prefix_len)[:, None]
    )
    if windowed.any():
        row, turn = (int(i[0]) for i in np.nonzero(windowed))
        raise ValueError(
            f"Trajectory.context_start: {int(windowed.sum())} turns were sampled from a "
            f"windowed history "
            f"(first: row {row}, turn {turn}); the train step scores each response with the whole "
            "conversation as its context, so it needs rollouts with the whole history kept "
            "(history_window=None)"
        )


def overlong_rewards(trajectory: Trajectory, config: TrainConfig) -> jax.Array:
    """DAPO's soft overlong punishment of each row, ``float32 [N]`` (<= 0; all 0 when the
    algorithm's ``overlong_buffer`` is 0): :func:`~agentrl_jax.algorithms.overlong_penalty` of
    the row's sampled tokens, with ``L_max = config.max_response_length`` and
    ``L_cache = max(1, floor(overlong_buffer x L_max + 1/2))``."""
    algorithm = config.algorithm
    if algorithm.overlong_buffer == 0:
        return jnp.zeros(trajectory.row_mask.shape, jnp.float32)
    length = config.max_response_length
    return overlong_penalty(
        jnp.sum(batch_loss_mask(trajectory), axis=-1),
        max_length=length,
        cache_length=max(1, int(algorithm.overlong_buffer * length + 0.5)),
        penalty=algorithm.overlong_penalty,
    )


def shaped_rewards(batch: TrainBatch, config: TrainConfig) -> tuple[jax.Array, jax.Array]:
    """The rewards the estimator sees: ``(episode [N], per_turn [N, T])`` float32.

    The outcome reward plus the overlong penalty (:func:`overlong_rewards`), shaped by the
    batch's process scores (:func:`~agentrl_jax.process_rewards.shape_rewards`; the penalty
    lands on the row's last turn, like the outcome). DAPO's dynamic sampling compares these
    episode rewards within groups: the groups it drops are those whose episode-level group
    advantages (GRPO, Dr. GRPO, RLOO) would be 0.
    """
    traj = batch.trajectory
    turn_mask = traj.turn_mask.astype(bool) & traj.row_mask.astype(bool)[:, None]
    outcome = traj.outcome_reward + overlong_rewards(traj, config)
    return shape_rewards(outcome, batch.step_scores, turn_mask, config.process_reward_coef)


def advantage_inputs(
    batch: TrainBatch, config: TrainConfig, old_values: jax.Array | None
) -> AdvantageInputs:
    """What the configured estimator reads, from a batch (:func:`shaped_rewards`).

    Every field is filled (estimators also read optional ones, such as ``traj_mask``, that
    they do not declare); ``values`` and ``token_rewards`` only with a critic."""
    traj = batch.trajectory
    turn_mask = traj.turn_mask.astype(bool) & traj.row_mask.astype(bool)[:, None]
    episode, per_turn = shaped_rewards(batch, config)
    anchors = (
        budget_anchor_keys(traj.anchor_key, traj.budget)
        if config.budget_anchors
        else traj.anchor_key
    )
    return AdvantageInputs(
        loss_mask=batch_loss_mask(traj),
        rewards=episode,
        group_ids=traj.group_id,
        traj_mask=traj.row_mask.astype(bool),
        step_rewards=per_turn,
        turn_mask=turn_mask,
        anchor_keys=anchors,
        token_turn_index=traj.token_turn,
        token_rewards=turn_rewards_to_tokens(per_turn, traj.token_turn)
        if old_values is not None
        else None,
        values=old_values,
    )


def recorded_logprobs(trajectory: Trajectory, config: TrainConfig) -> jax.Array:
    """What the sampler recorded for the distribution the trainer scores under ``[N, L]``:
    ``sampling_logprobs`` (``scoring="sampling"``) or the model distribution's ``logprobs``."""
    return trajectory.sampling_logprobs if config.scoring == "sampling" else trajectory.logprobs


def sampler_gap(
    trainer: jax.Array, sampler: jax.Array, mask: jax.Array
) -> tuple[LossSum, jax.Array]:
    """The sampler-trainer log-prob gap ``|trainer - sampler|`` over ``mask``: its token-mean
    sum (:class:`LossSum`, exact over micro-batches) and its maximum (0 for an empty mask)."""
    gap = jnp.abs(trainer - sampler)
    return _token_mean_sum(gap, mask), jnp.max(jnp.where(mask, gap, 0.0), initial=0.0)


def _model_scores(
    graphdef: nnx.GraphDef,
    config: TrainConfig,
    params: Any,
    mb: Mapping[str, jax.Array],
    constrain: Constrain | None,
    with_entropy: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """``(logprobs, entropy or None)`` ``[n, L]`` of a (micro-)batch's tokens under ``params``."""
    return sequence_logprobs(
        nnx.merge(graphdef, params),
        mb["tokens"],
        mb["token_mask"],
        loss_mask=mb["loss_mask"],
        with_entropy=with_entropy,
        config=config,
        constrain=constrain,
    )


def _chunks(config: TrainConfig) -> int:
    """Pieces of the batch the per-batch scoring runs on: the updates' micro-batch shape."""
    return config.mini_batches * config.num_micro_batches


def _records_old_logprobs(config: TrainConfig) -> bool:
    """Whether the old log-probs are scored before the first update. With one update per
    batch they are the policy's own log-probs in that update's forward (``stop_gradient``,
    see :func:`policy_gradients`): the same numbers, without a second forward."""
    return config.updates_per_batch > 1 and "old_logprobs" in step_inputs(config.algorithm).batch


def prepare_batch(
    graphdef: nnx.GraphDef,
    config: TrainConfig,
    state: TrainState,
    batch: TrainBatch,
    mesh: Mesh | None = None,
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """What one rollout batch's updates share, computed once before the first: ``(data, metrics)``.

    ``data`` holds ``[N, ...]`` rows: ``tokens``, ``token_mask``, ``loss_mask`` and the batch
    inputs the configured terms declare (:mod:`agentrl_jax.train.inputs`), from the state
    before any update: ``old_values`` (the critic), ``advantages`` and ``returns`` (the
    estimator, on old values), ``old_logprobs`` (the policy; see :func:`_records_old_logprobs`),
    ``ref_logprobs`` (the frozen reference), ``sampler_logprobs`` (the sampler's behaviour
    log-probs), and ``recorded_logprobs`` (:func:`recorded_logprobs`, for the sampler-trainer
    gap metrics). Scoring runs in pieces of the updates'
    micro-batch shape (``N / (mini_batches x num_micro_batches)`` rows, so it never holds
    more activations than an update). ``metrics``: batch-level scalars.
    """
    needs = step_inputs(config.algorithm)
    constrain = activation_constraint(mesh)
    traj = batch.trajectory
    full_mask = batch_loss_mask(traj)
    loss_mask = (
        full_mask if config.loss_positions is None else kept_mask(full_mask, config.loss_positions)
    )
    data = {
        "tokens": traj.tokens,
        "token_mask": traj.token_mask.astype(bool),
        "loss_mask": loss_mask,
        "recorded_logprobs": recorded_logprobs(traj, config),
    }
    chunks = _chunks(config)
    weights = loss_mask.astype(jnp.float32)
    tokens = jnp.sum(weights)
    metrics = {"loss_tokens": tokens, "loss_tokens_dropped": jnp.sum(full_mask) - tokens}

    def token_mean(x):
        return jnp.sum(x * weights) / jnp.maximum(tokens, 1.0)

    old_values = None
    if needs.critic_model:
        backbone = nnx.merge(graphdef, state.critic.backbone)
        old_values = map_micro_batches(
            lambda mb: critic_values(
                backbone,
                state.critic.head,
                mb["tokens"],
                mb["token_mask"],
                config=config,
                constrain=constrain,
            ),
            data,
            chunks,
        )
        metrics["value_mean"] = token_mean(old_values)
    computed = {"old_values": old_values, "sampler_logprobs": traj.sampling_logprobs}
    if needs.batch & {"advantages", "returns"}:
        advantages = compute_advantages(
            config.algorithm, advantage_inputs(batch, config, old_values)
        )
        computed.update(advantages=advantages.advantages, returns=advantages.returns)
        metrics["advantage_mean"] = token_mean(advantages.advantages)
    if config.algorithm.overlong_buffer > 0:
        rows = traj.row_mask.astype(jnp.float32)
        metrics["overlong_penalty_mean"] = jnp.sum(
            overlong_rewards(traj, config) * rows
        ) / jnp.maximum(jnp.sum(rows), 1.0)
    if _records_old_logprobs(config):
        computed["old_logprobs"] = map_micro_batches(
            lambda mb: _model_scores(graphdef, config, state.policy, mb, constrain)[0], data, chunks
        )
        gap_sum, metrics["sampler_gap_max"] = sampler_gap(
            computed["old_logprobs"], data["recorded_logprobs"], loss_mask
        )
        metrics["sampler_gap_mean"] = aggregation.mean(gap_sum)
    if needs.reference:
        reference = jax.lax.stop_gradient(state.reference)
        computed["ref_logprobs"] = map_micro_batches(
            lambda mb: _model_scores(graphdef, config, reference, mb, constrain)[0], data, chunks
        )
    data.update(
        {name: jax.lax.stop_gradient(computed[name]) for name in needs.batch if name in computed}
    )
    return data, metrics


def update_rows(key: jax.Array, rows: int, epochs: int, mini_batches: int) -> jax.Array:
    """The rows of each update, ``int32 [epochs x mini_batches, rows / mini_batches]``: per
    epoch a fresh permutation of the rows (its own key, split off ``key``), cut into
    ``mini_batches`` equal mini-batches, in update order."""
    if rows % mini_batches:
        raise ValueError(f"mini_batches={mini_batches} must divide the batch's {rows} rows")
    perms = jax.vmap(lambda k: jax.random.permutation(k, rows))(jax.random.split(key, epochs))
    return perms.reshape(epochs * mini_batches, rows // mini_batches).astype(jnp.int32)


def select_rows(data: Any, rows: jax.Array, mesh: Mesh | None = None) -> Any:
    """``data``'s ``[N, ...]`` leaves at ``rows`` (a mini-batch), rows over the mesh's batch
    axes."""
    constrain = activation_constraint(mesh) or _same
    return jax.tree.map(lambda x: constrain(jnp.take(x, rows, axis=0)), data)


def _token_mean_sum(x: jax.Array, mask: jax.Array) -> LossSum:
    return aggregation.aggregate(x, mask)  # token-mean: (sum m x, sum m), exact under any split


def ratio_sums(logprobs: jax.Array, old_logprobs: jax.Array, mask: jax.Array) -> dict[str, LossSum]:
    """Token-mean sums of the importance ratio ``r = pi / pi_old`` (clamped as in the loss):
    ``ratio_mean``; ``ratio_deviation``, mean ``|r - 1|`` (exactly 0 iff every ratio is 1);
    ``approx_kl``, mean ``(r - 1) - log r`` (an estimate of KL(pi_old || pi), k3)."""
    ratio = policy_ratio(logprobs, old_logprobs)
    log_ratio = jnp.log(ratio)
    return {
        "ratio_mean": _token_mean_sum(ratio, mask),
        "ratio_deviation": _token_mean_sum(jnp.abs(ratio - 1.0), mask),
        "approx_kl": _token_mean_sum((ratio - 1.0) - log_ratio, mask),
    }


def explained_variance_sums(
    values: jax.Array, returns: jax.Array, mask: jax.Array
) -> dict[str, jax.Array]:
    """Sums over ``mask`` from which :func:`explained_variance` follows (add them over
    micro-batches)."""
    w = mask.astype(jnp.float32)
    residual = returns - values
    return {
        "count": jnp.sum(w),
        "returns": jnp.sum(w * returns),
        "returns_sq": jnp.sum(w * returns**2),
        "residual": jnp.sum(w * residual),
        "residual_sq": jnp.sum(w * residual**2),
    }


EV_RELATIVE_FLOOR = (
    1e-4  # Var(returns) below this share of E[returns^2] is rounding: constant returns
)


def explained_variance(sums: Mapping[str, jax.Array]) -> jax.Array:
    """``1 - Var(returns - values) / Var(returns)`` over the loss tokens.

    0 when the returns do not vary: the variance comes from summed moments (so it adds over
    micro-batches), whose float32 cancellation leaves ~1e-7 of ``E[returns^2]`` for constant
    returns, so a variance under ``EV_RELATIVE_FLOOR`` of it counts as none (GAE with
    gamma = lambda = 1 gives every token of a row the same return: a mini-batch of equal
    outcomes has constant returns)."""
    n = jnp.maximum(sums["count"], 1.0)
    mean_sq = sums["returns_sq"] / n
    var_returns = mean_sq - (sums["returns"] / n) ** 2
    var_residual = jnp.maximum(sums["residual_sq"] / n - (sums["residual"] / n) ** 2, 0.0)
    varies = var_returns > EV_RELATIVE_FLOOR * mean_sq + 1e-12
    return jnp.where(varies, 1.0 - var_residual / jnp.where(varies, var_returns, 1.0), 0.0)


def _term_sums(result: Any) -> dict[str, LossSum]:
    """A :class:`~agentrl_jax.algorithms.LossResult`'s parts (``loss/<term>``) and term metrics."""
    return {**{f"loss/{name}": part for name, part in result.parts.items()}, **result.metrics}


def policy_gradients(
    graphdef: nnx.GraphDef,
    config: TrainConfig,
    params: Any,
    data: Mapping[str, jax.Array],
    mesh: Mesh | None = None,
    *,
    first_update: bool | jax.Array = False,
) -> tuple[Any, dict[str, jax.Array]]:
    """Mean gradient of the policy loss over ``data`` (one update's rows) at ``params``, and
    metrics.

    ``data``: rows of :func:`prepare_batch`'s data. Gradients are accumulated over
    ``num_micro_batches`` micro-batches of unreduced sums and divided once by the global
    denominator, so they are exactly the gradient of ``data``'s mean loss. The live inputs
    (``logprobs``, ``entropy``) are computed only if a policy term declares them.

    Old log-probs: ``data["old_logprobs"]`` (recorded before the batch's first update), except
    on the first update (``first_update``, may be traced) or when none were recorded (one
    update per batch): there ``params`` are the policy before the first update, and its own
    log-probs in this forward (``stop_gradient``) are the old ones, bitwise, so the ratio is
    exactly 1 (a separately compiled forward agrees only to float rounding).

    Metrics: ``loss``, ``loss/<term>``, each term's own metrics ``<term>/<name>``, the ratio's
    (:func:`ratio_sums`) when a term reads old log-probs, ``grad_norm``, and the
    sampler-trainer gap (:func:`sampler_gap`) when this is the batch's only update at the
    rollout's parameters (``first_update`` True, no recorded old log-probs; with recorded
    ones :func:`prepare_batch` reports it).
    """
    needs = step_inputs(config.algorithm)
    constrain = activation_constraint(mesh)
    live = needs.live("policy")
    batch_fields = needs.policy & needs.batch
    track_gap = first_update is True and "old_logprobs" not in data and "recorded_logprobs" in data

    def loss_fn(params, mb):
        logprobs, entropy = _model_scores(
            graphdef, config, params, mb, constrain, "entropy" in live
        )
        fields = {name: mb[name] for name in batch_fields if name in mb}
        if "old_logprobs" in batch_fields:
            own = jax.lax.stop_gradient(logprobs)
            fields["old_logprobs"] = (
                jnp.where(first_update, own, mb["old_logprobs"]) if "old_logprobs" in mb else own
            )
        fields.update(
            {
                name: value
                for name, value in (("logprobs", logprobs), ("entropy", entropy))
                if name in live
            }
        )
        result = compute_loss_with_metrics(
            config.algorithm, LossInputs(loss_mask=mb["loss_mask"], **fields), "policy"
        )
        sums, peaks = _term_sums(result), {}
        if "old_logprobs" in fields:
            sums.update(
                ratio_sums(jax.lax.stop_gradient(logprobs), fields["old_logprobs"], mb["loss_mask"])
            )
        if track_gap:
            sums["sampler_gap_mean"], peaks["sampler_gap_max"] = sampler_gap(
                jax.lax.stop_gradient(logprobs), mb["recorded_logprobs"], mb["loss_mask"]
            )
        return result.total.total, (result.total, sums, peaks)

    def combine(a, b):  # sums add over micro-batches, peaks take the maximum
        return _add(a[0], b[0]), _add(a[1], b[1]), jax.tree.map(jnp.maximum, a[2], b[2])

    grads, (total, sums, peaks) = accumulate_gradients(
        loss_fn, params, data, config.num_micro_batches, combine
    )
    grads = _divide(grads, total.denom)
    metrics = {
        "loss": aggregation.mean(total),
        **{k: aggregation.mean(v) for k, v in sums.items()},
        **peaks,
        "grad_norm": optax.tree.norm(grads),
    }
    return grads, metrics


def critic_gradients(
    graphdef: nnx.GraphDef,
    config: TrainConfig,
    critic: CriticParams,
    data: Mapping[str, jax.Array],
    mesh: Mesh | None = None,
) -> tuple[CriticParams, dict[str, jax.Array]]:
    """Mean gradient of the critic loss over ``data`` at ``critic``, and metrics: ``value_loss``,
    ``loss/<term>``, term metrics, ``explained_variance`` (of the returns by the values before
    this update, when the terms read returns) and ``critic_grad_norm``."""
    needs = step_inputs(config.algorithm)
    constrain = activation_constraint(mesh)
    batch_fields = needs.critic & needs.batch

    def loss_fn(critic, mb):
        values = critic_values(
            nnx.merge(graphdef, critic.backbone),
            critic.head,
            mb["tokens"],
            mb["token_mask"],
            config=config,
            constrain=constrain,
        )
        fields = {name: mb[name] for name in batch_fields}
        fields.update({"values": values} if "values" in needs.critic else {})
        result = compute_loss_with_metrics(
            config.algorithm, LossInputs(loss_mask=mb["loss_mask"], **fields), "critic"
        )
        ev = (
            explained_variance_sums(jax.lax.stop_gradient(values), mb["returns"], mb["loss_mask"])
            if "returns" in mb
            else {}
        )
        return result.total.total, (result.total, _term_sums(result), ev)

    grads, (total, sums, ev) = accumulate_gradients(loss_fn, critic, data, config.num_micro_batches)
    grads = _divide(grads, total.denom)
    metrics = {
        "value_loss": aggregation.mean(total),
        **{k: aggregation.mean(v) for k, v in sums.items()},
        "critic_grad_norm": optax.tree.norm(grads),
    }
    if ev:
        metrics["explained_variance"] = explained_variance(ev)
    return grads, metrics


def compute_gradients(
    graphdef: nnx.GraphDef,
    config: TrainConfig,
    state: TrainState,
    batch: TrainBatch,
    mesh: Mesh | None = None,
) -> tuple[Any, CriticParams | None, dict[str, jax.Array]]:
    """The gradients of one update on the whole batch at ``state``'s parameters, and metrics.

    Pure: :func:`prepare_batch`, then :func:`policy_gradients` (and :func:`critic_gradients`)
    on all rows. With one update per batch (``epochs = mini_batches = 1``) this is exactly
    the update :func:`train_step` applies. Returns ``(policy_grads, critic_grads or None,
    metrics)``, the losses as means over the batch. ``mesh`` (static) adds sharding
    constraints on activations (rows over the batch axes).
    """
    data, metrics = prepare_batch(graphdef, config, state, batch, mesh)
    policy_grads, policy_metrics = policy_gradients(
        graphdef, config, state.policy, data, mesh, first_update=True
    )
    metrics = {**metrics, **policy_metrics}
    critic_grads = None
    if config.uses_critic:
        critic_grads, critic_metrics = critic_gradients(graphdef, config, state.critic, data, mesh)
        metrics.update(critic_metrics)
    return policy_grads, critic_grads, metrics


def _apply(
    optimizer: optax.GradientTransformation, ok: jax.Array, grads: Any, opt_state: Any, params: Any
):
    """One optimizer step, kept only if ``ok``: ``(params, opt_state)``."""
    updates, new_opt = optimizer.update(grads, opt_state, params)
    return _keep_if(ok, optax.apply_updates(params, updates), params), _keep_if(
        ok, new_opt, opt_state
    )


def _update_fn(
    graphdef: nnx.GraphDef, config: TrainConfig, data: Mapping[str, jax.Array], mesh: Mesh | None
):
    """``(carry, (index, rows or None)) -> (carry, metrics)``: update number ``index`` on
    ``data`` at ``rows`` (all rows if None).

    ``carry = (policy, policy_opt, critic, critic_opt)``. If the loss or any gradient is not
    finite, nothing is updated and the metric ``update_skipped`` is 1.
    """

    def update(carry, xs):
        (policy, policy_opt, critic, critic_opt), (index, rows) = carry, xs
        mb = data if rows is None else select_rows(data, rows, mesh)
        policy_grads, metrics = policy_gradients(
            graphdef, config, policy, mb, mesh, first_update=index == 0
        )
        finite = jnp.isfinite(metrics["loss"]) & _all_finite(policy_grads)
        if critic is not None:
            critic_grads, critic_metrics = critic_gradients(graphdef, config, critic, mb, mesh)
            metrics.update(critic_metrics)
            finite = finite & jnp.isfinite(metrics["value_loss"]) & _all_finite(critic_grads)
        # nothing to learn from (e.g. dynamic sampling kept no group): no optimizer step either,
        # which would still move the parameters (weight decay, Adam's momentum)
        empty = ~jnp.any(mb["loss_mask"])
        ok = finite & ~empty
        if critic is not None:
            critic, critic_opt = _apply(
                critic_optimizer(config), ok, critic_grads, critic_opt, critic
            )
        policy, policy_opt = _apply(policy_optimizer(config), ok, policy_grads, policy_opt, policy)
        metrics["update_skipped"] = (~finite).astype(jnp.float32)
        metrics["update_empty"] = empty.astype(jnp.float32)
        return (policy, policy_opt, critic, critic_opt), metrics

    return update


def train_step(
    graphdef: nnx.GraphDef,
    config: TrainConfig,
    state: TrainState,
    batch: TrainBatch,
    mesh: Mesh | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """All the updates of one rollout batch (see the module docstring). Pure; jit it with
    :func:`make_train_step`."""
    rows = batch.trajectory.tokens.shape[0]
    if rows % _chunks(config):
        raise ValueError(
            f"mini_batches={config.mini_batches} x num_micro_batches={config.num_micro_batches} "
            f"must divide the batch's {rows} rows"
        )
    data, batch_metrics = prepare_batch(graphdef, config, state, batch, mesh)
    update = _update_fn(graphdef, config, data, mesh)
    carry = (state.policy, state.policy_opt, state.critic, state.critic_opt)
    rng, count = state.rng, config.updates_per_batch
    if count == 1:
        carry, per_update = update(carry, (0, None))
        per_update = jax.tree.map(lambda x: x[None], per_update)
    else:
        order = None
        if config.mini_batches > 1:  # shuffled: a key of its own, split off the state's
            rng, key = jax.random.split(state.rng)
            order = update_rows(key, rows, config.epochs, config.mini_batches)
        carry, per_update = jax.lax.scan(update, carry, (jnp.arange(count), order))
    policy, policy_opt, critic, critic_opt = carry
    skipped = jnp.sum(per_update["update_skipped"]).astype(jnp.int32)
    new = state.replace(
        policy=policy,
        policy_opt=policy_opt,
        critic=critic,
        critic_opt=critic_opt,
        rng=rng,
        step=state.step + 1,
        skipped_updates=state.skipped_updates + skipped,
    )
    metrics = {
        **batch_metrics,
        **{name: jnp.mean(v) for name, v in per_update.items()},
        "update_skipped": skipped.astype(jnp.float32),
        "skipped_updates": new.skipped_updates.astype(jnp.float32),
    }
    if count > 1:
        metrics.update({f"{UPDATES_PREFIX}{name}": v for name, v in per_update.items()})
    return new, metrics


UPDATES_PREFIX = "updates/"


def batch_shardings(batch: Any, mesh: Mesh) -> Any:
    """Every leaf split along its first (row) axis over the mesh's batch axes."""
    return jax.tree.map(
        lambda x: NamedSharding(mesh, P(BATCH_AXES, *([None] * (x.ndim - 1)))), batch
    )


class JittedTrainStep:
    """The jitted train step of one model structure, config and placement.

    Call it as ``step(state, batch) -> (state, metrics)``. :meth:`jitted` gives the
    ``jax.jit`` object for a batch's structure (step scores present or not), so the step can
    be lowered and compiled ahead of time with abstract inputs, e.g.
    ``step.jitted(batch).lower(abstract_state, abstract_batch).compile().memory_analysis()``
    (:mod:`agentrl_jax.plan` does this for a target's devices). ``trace_counts`` counts traces
    (= compilations) per batch structure.
    """

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        config: TrainConfig,
        *,
        mesh: Mesh | None = None,
        state_template: TrainState | None = None,
        rules: Sequence[PartitionRule] = QWEN3_PARAM_RULES,
        donate: bool = False,
    ):
        if mesh is not None and state_template is None:
            raise ValueError("make_train_step: a mesh needs state_template to lay out the state")
        self.graphdef, self.config, self.mesh, self.donate = graphdef, config, mesh, donate
        self.state_shardings = (
            None if mesh is None else state_shardings(state_template, mesh, rules)
        )
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
                    self._step,
                    in_shardings=(self.state_shardings, batch_shardings(batch, self.mesh)),
                    out_shardings=(self.state_shardings, NamedSharding(self.mesh, P())),
                    donate_argnums=donate,
                )
        return self._jitted[key]

    def __call__(
        self, state: TrainState, batch: TrainBatch
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        return self.jitted(batch)(state, batch)

    def compiled_count(self) -> int:
        """Programs compiled so far, over every batch structure (jit cache entries)."""
        return sum(j._cache_size() for j in self._jitted.values())


def make_train_step(
    graphdef: nnx.GraphDef,
    config: TrainConfig,
    *,
    mesh: Mesh | None = None,
    state_template: TrainState | None = None,
    rules: Sequence[PartitionRule] = QWEN3_PARAM_RULES,
    donate: bool = False,
) -> JittedTrainStep:
    """The jitted :func:`train_step` for one model structure and config (a
    :class:`JittedTrainStep`).

    With ``mesh`` (and a ``state_template``, arrays or ShapeDtypeStructs, for the layout),
    the state keeps :func:`~agentrl_jax.train.state.state_shardings` in and out, batch
    leaves are split along rows and activations are constrained to rows over the batch
    axes; place the inputs with ``shard_state``/``jax.device_put`` first. ``donate`` reuses
    the input state's buffers for the output state (the caller must not use them again).
    """
    return JittedTrainStep(
        graphdef, config, mesh=mesh, state_template=state_template, rules=rules, donate=donate
    )
