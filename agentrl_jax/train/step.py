"""The pure train step: ``train_step(graphdef, config, state, batch) -> (state, metrics)``
(no placement, no jit; the jitted class that places it is
:class:`agentrl_jax.train.jitted_step.JittedTrainStep`, made by
:func:`~agentrl_jax.train.jitted_step.make_train_step`).

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
single update per batch they are that update's own log-probs under ``stop_gradient``. With
``rl.exact_logprobs`` the old log-probs, and the value of the first update's live ones, are the
canonical log-probs of :mod:`agentrl_jax.sampling.exact` (``exact_logprobs`` in the data), which
equal the sampler's records bit for bit; the gradient stays the fast forward's
(:func:`~agentrl_jax.sampling.exact.valued`), and later updates score with the fast forward.
``state.step`` counts rollout batches (one per call).

Metrics: batch-level ones (``advantage_mean``, ``loss_tokens``, ``loss_tokens_dropped``,
``value_mean``, ``skipped_updates``) and, per update, ``loss``, ``loss/<term>``, every term's
own metrics (``<term>/<name>``, e.g. ``policy_clip/clip_fraction``), ``ratio_mean``,
``ratio_deviation`` and ``approx_kl`` (when a term reads old log-probs), ``grad_norm``, and
with a critic ``value_loss``, ``explained_variance`` and ``critic_grad_norm``. Each per-update
metric is reported as its mean over the batch's updates under its own name, and, with more
than one update, as the ``[updates]`` array under ``updates/<name>``; ``update_skipped``
counts the skipped updates of the batch.

Context: every sampled token is scored under the context the policy sampled it with: the whole
row before it, or for a turn sampled from a history window (the rollout's ``history_window``)
the system header and that window. Such batches are trained step-wise: each windowed turn is
a sequence of its own, packed with the others (:func:`~agentrl_jax.train.packing.
turn_sequences`, :meth:`~agentrl_jax.train.jitted_step.JittedTrainStep.packed`), its response
the only loss tokens in it.
``rl.memory.packing`` packs whole rows the same way.

Alignment: the log-prob of token ``p`` comes from the logits at ``p - 1``, and the value of
token ``p`` from the critic's hidden state at ``p - 1`` (the state the token was sampled in);
position 0 (never a sampled token) gets 0.

Micro-batches are strided: micro-batch ``m`` holds rows ``m, m + M, m + 2M, ...``. With rows
split contiguously over devices (the batch sharding along ``data``/``fsdp``), every device then
holds an equal share of every micro-batch and the split moves no data. So ``N`` must be a
multiple of ``mini_batches x M`` (and of that times the number of batch shards on a mesh);
shuffled mini-batches are gathered rows, constrained to rows over the batch axes.

Sharding: ``mesh`` (static) adds sharding constraints on activations (rows over the batch
axes); :func:`~agentrl_jax.train.jitted_step.make_train_step` with a mesh jits with the state
placed by :func:`~agentrl_jax.train.state.state_shardings` and the batch split along its first
axis; XLA inserts the reductions, so sums over the batch are global, like the single-device ones.
With ``mesh.ordered_sums`` (:func:`ordered_sums`) the gradients' and the losses' sums are each
device's own, added over the devices in a fixed order (:mod:`agentrl_jax.ordered_sums`), so any
process count gives the same bits.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from agentrl_jax.algorithms import (
    LossInputs,
    LossSum,
    aggregation,
    compute_advantages,
    compute_loss_with_metrics,
    metric_sum,
    tis_weight,
)
from agentrl_jax.models.moe import Routing
from agentrl_jax.models.qwen3 import Constrain
from agentrl_jax.ordered_sums import ordered_over_rows
from agentrl_jax.sampling.exact import valued
from agentrl_jax.sharding import batch_shards
from agentrl_jax.train.batch import TrainBatch, batch_loss_mask
from agentrl_jax.train.config import TrainConfig
from agentrl_jax.train.inputs import step_inputs
from agentrl_jax.train.logprobs import kept_mask
from agentrl_jax.train.micro_batches import (
    accumulate_gradients,
    add_trees,
    all_finite,
    divide_tree,
    keep_if,
    map_micro_batches,
)
from agentrl_jax.train.packing import pack, packed_loss_bound, unpack
from agentrl_jax.train.rewards import advantage_inputs, overlong_rewards
from agentrl_jax.train.scoring import (
    activation_constraint,
    critic_values,
    exact_logprobs,
    identity,
    sequence_logprobs,
)
from agentrl_jax.train.state import (
    CriticParams,
    TrainState,
    critic_optimizer,
    policy_optimizer,
)
from agentrl_jax.train.step_metrics import (
    explained_variance,
    explained_variance_sums,
    ratio_sums,
    routing_differs,
    sampler_gap,
)
from agentrl_jax.trajectory import Trajectory

# ------------------------------------------------------------------------- model pieces


# ------------------------------------------------------------------------- micro-batching


# ------------------------------------------------------------------------- the step


def recorded_logprobs(trajectory: Trajectory, config: TrainConfig) -> jax.Array:
    """What the sampler recorded for the distribution the trainer scores under ``[N, L]``:
    ``sampling_logprobs`` (``scoring="sampling"``) or the model distribution's ``logprobs``."""
    return trajectory.sampling_logprobs if config.rl.scoring == "sampling" else trajectory.logprobs


def _model_scores(
    graphdef: nnx.GraphDef,
    config: TrainConfig,
    params: Any,
    mb: Mapping[str, jax.Array],
    constrain: Constrain | None,
    with_entropy: bool = False,
    base: Any = None,
    adapters: bool = True,
) -> tuple[jax.Array, jax.Array | None, Routing | None]:
    """``(logprobs, entropy or None, routing)`` ``[n, L]`` of a (micro-)batch's tokens under
    ``params`` (with LoRA: the adapters, on the frozen ``base``; ``adapters=False`` scores the
    base); ``routing``: an MoE model's (None if dense), through the sampler's recorded experts
    (``mb["recorded_experts"]``) with ``rl.routing_replay`` (the policy only, not the base)."""
    model = nnx.merge(graphdef, params) if base is None else nnx.merge(graphdef, params, base)
    replay = mb.get("recorded_experts") if config.rl.routing_replay and adapters else None
    return sequence_logprobs(
        model,
        mb["tokens"],
        mb["token_mask"],
        loss_mask=mb["loss_mask"],
        with_entropy=with_entropy,
        forward=config.forward if adapters else dataclasses.replace(config.forward, adapters=False),
        constrain=constrain,
        segment_ids=mb.get("segment_ids"),
        replay=replay,
        with_routing=True,
    )


def for_batch(config: TrainConfig, batch: TrainBatch) -> TrainConfig:
    """``config`` for ``batch``'s rows: packed rows hold several rows' loss tokens, so the
    bound on loss positions per row becomes :func:`~agentrl_jax.train.packing.packed_loss_bound`
    (static: from the batch's shapes; the packing plan keeps every packed row within it)."""
    if batch.packing is None or config.loss_positions is None:
        return config
    rows = batch.trajectory.tokens.shape[0]
    packed_rows, width = batch.packing.shape
    bound = packed_loss_bound(config.loss_positions, rows, packed_rows, width)
    return dataclasses.replace(config, loss_positions=bound)


def update_chunks(config: TrainConfig) -> int:
    """Pieces of the batch the per-batch scoring runs on: the updates' micro-batch shape (a
    packed batch's rows are planned to a multiple of it, :meth:`~agentrl_jax.train.jitted_step.
    JittedTrainStep.packed`)."""
    return config.rl.batching.mini_batches * config.rl.batching.num_micro_batches


def _records_old_logprobs(config: TrainConfig) -> bool:
    """Whether the old log-probs are scored before the first update. With one update per
    batch they are the policy's own log-probs in that update's forward (``stop_gradient``,
    see :func:`policy_gradients`): the same numbers, without a second forward."""
    return config.updates_per_batch > 1 and "old_logprobs" in step_inputs(config.algorithm).batch


def ordered_sums(config: TrainConfig, mesh: Mesh | None) -> bool:
    """Whether the gradients' and losses' sums over the batch's devices are added in a fixed
    order (``mesh.ordered_sums``, :mod:`agentrl_jax.ordered_sums`): on a mesh that splits the
    batch over more than one device."""
    return config.ordered_sums and mesh is not None and batch_shards(mesh) > 1


def corrects_off_policy(config: TrainConfig) -> bool:
    """Whether the policy terms' per-token losses are weighted for the policy that sampled the
    batch (``min(pi_old / mu, rl.asynchronous.off_policy_cap)``, ``mu`` the sampler's recorded
    log-prob in the trainer's scoring distribution, ``pi_old`` the policy before the batch's first
    update): an asynchronous run (``rl.asynchronous.max_staleness > 0``, whose batches may come from
    older parameters) whose policy terms do not read ``sampler_logprobs`` and correct for it
    themselves."""
    return (
        config.rl.asynchronous.max_staleness > 0
        and "sampler_logprobs" not in step_inputs(config.algorithm).policy
    )


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
    log-probs), ``recorded_logprobs`` (:func:`recorded_logprobs`, for the sampler-trainer
    gap metrics) and, with ``rl.exact_logprobs``, ``exact_logprobs`` (the canonical log-probs,
    :func:`~agentrl_jax.train.scoring.exact_logprobs`, on the unpacked trajectories). Scoring
    runs in pieces of the updates' micro-batch shape (``N / (mini_batches x
    num_micro_batches)`` rows, so it never holds more activations than an update).
    ``metrics``: batch-level scalars.

    With ``batch.packing`` every ``[N, L]`` field is packed into the ``[P, W]`` rows the model
    runs on (plus ``segment_ids``; the loss mask keeps each turn's tokens in its own sequence
    only), the advantages are still computed per trajectory (from the unpacked critic values)
    and then packed, and the metrics count each trajectory's tokens once.
    """
    needs = step_inputs(config.algorithm)
    constrain = activation_constraint(mesh)
    traj = batch.trajectory
    full_mask = batch_loss_mask(traj)
    packing = batch.packing  # the rows the model runs on: the trajectories, or packed ones

    def bounded(mask):  # the loss positions the head runs at, per row it runs on
        return mask if config.loss_positions is None else kept_mask(mask, config.loss_positions)

    data = {
        "tokens": traj.tokens,
        "token_mask": traj.token_mask.astype(bool),
        "loss_mask": bounded(full_mask) if packing is None else full_mask,
        "recorded_logprobs": recorded_logprobs(traj, config),
    }
    if traj.experts.shape[2]:  # an MoE policy's sampled routing (replay, routing_differs)
        data["recorded_experts"] = traj.experts
    to_rows = (lambda x: x) if packing is None else (lambda x: pack(x, packing))
    from_rows = (
        (lambda y: y) if packing is None else (lambda y: unpack(y, packing, *full_mask.shape))
    )
    if packing is not None:
        data = {name: pack(x, packing) for name, x in data.items()}
        if "recorded_experts" in data:  # empty slots record no experts (-1), not expert 0
            data["recorded_experts"] = pack(traj.experts + 1, packing) - 1
        # a turn trains in its own sequence only
        data["loss_mask"] = bounded(data["loss_mask"] & packing.trains)
        data["segment_ids"] = packing.segment_ids
        loss_mask = unpack(data["loss_mask"], packing, *full_mask.shape)
    else:
        loss_mask = data["loss_mask"]
    chunks = update_chunks(config)
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
                forward=config.forward,
                constrain=constrain,
                segment_ids=mb.get("segment_ids"),
            ),
            data,
            chunks,
        )
        metrics["value_mean"] = token_mean(from_rows(old_values))
    computed = {"old_values": old_values, "sampler_logprobs": to_rows(traj.sampling_logprobs)}
    if needs.batch & {"advantages", "returns"}:
        advantages = compute_advantages(  # per trajectory, on its own row
            config.algorithm,
            advantage_inputs(batch, config, None if old_values is None else from_rows(old_values)),
        )
        computed.update(
            advantages=to_rows(advantages.advantages),
            returns=None if advantages.returns is None else to_rows(advantages.returns),
        )
        metrics["advantage_mean"] = token_mean(advantages.advantages)
    if config.algorithm.overlong_buffer > 0:
        rows = traj.row_mask.astype(jnp.float32)
        metrics["overlong_penalty_mean"] = jnp.sum(
            overlong_rewards(traj, config) * rows
        ) / jnp.maximum(jnp.sum(rows), 1.0)
    if config.rl.exact_logprobs:  # the canonical values, per trajectory (sampling.exact)
        data["exact_logprobs"] = to_rows(
            exact_logprobs(
                nnx.merge(graphdef, state.policy),
                traj.tokens,
                traj.token_mask,
                full_mask,
                length=config.context_length,
                width=config.loss_positions,
                sampling=config.scoring_sampling,
            )
        )
    if _records_old_logprobs(config) and config.rl.exact_logprobs:
        computed["old_logprobs"] = data["exact_logprobs"]
    elif _records_old_logprobs(config):
        computed["old_logprobs"] = map_micro_batches(
            lambda mb: _model_scores(
                graphdef, config, state.policy, mb, constrain, base=state.base
            )[0],
            data,
            chunks,
        )
    if _records_old_logprobs(config):
        gap_sum, metrics["sampler_gap_max"] = sampler_gap(
            computed["old_logprobs"], data["recorded_logprobs"], data["loss_mask"]
        )
        metrics["sampler_gap_mean"] = aggregation.mean(gap_sum)
    if needs.reference:
        if state.base is None:
            reference, base, adapters = jax.lax.stop_gradient(state.reference), None, True
        else:  # LoRA: the frozen base is the reference, adapters off
            reference, base, adapters = state.policy, state.base, False
        computed["ref_logprobs"] = map_micro_batches(
            lambda mb: _model_scores(
                graphdef, config, reference, mb, constrain, base=base, adapters=adapters
            )[0],
            data,
            chunks,
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
    constrain = activation_constraint(mesh) or identity
    return jax.tree.map(lambda x: constrain(jnp.take(x, rows, axis=0)), data)


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
    base: Any = None,
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

    LoRA: ``params`` are the adapters and ``base`` the frozen weights; gradients are the
    adapters' only.
    """
    needs = step_inputs(config.algorithm)
    ordered = ordered_sums(config, mesh)
    constrain = None if ordered else activation_constraint(mesh)
    live = needs.live("policy")
    batch_fields = needs.policy & needs.batch
    track_gap = first_update is True and "old_logprobs" not in data and "recorded_logprobs" in data
    off_policy = corrects_off_policy(config)

    def loss_fn(params, mb, base, first_update):
        logprobs, entropy, routing = _model_scores(
            graphdef, config, params, mb, constrain, "entropy" in live, base=base
        )
        if "exact_logprobs" in mb:  # the first update: the canonical values, fast gradient
            own = jax.lax.stop_gradient(logprobs)
            logprobs = valued(logprobs, jnp.where(first_update, mb["exact_logprobs"], own))
        fields = {name: mb[name] for name in batch_fields if name in mb}
        fields["segment_ids"] = mb.get("segment_ids")
        if "old_logprobs" in batch_fields:
            own = jax.lax.stop_gradient(logprobs)
            fields["old_logprobs"] = (
                jnp.where(first_update, own, mb["old_logprobs"]) if "old_logprobs" in mb else own
            )
        router = (None, None) if routing is None else (routing.logits, routing.experts)
        fields.update(
            {
                name: value
                for name, value in (
                    ("logprobs", logprobs),
                    ("entropy", entropy),
                    ("router_logits", router[0]),
                    ("router_experts", router[1]),
                )
                if name in live
            }
        )
        weights = None
        if off_policy:  # proximal policy: the old log-probs, else this forward's own
            old = fields.get("old_logprobs", jax.lax.stop_gradient(logprobs))
            weights = tis_weight(
                old, mb["recorded_logprobs"], config.rl.asynchronous.off_policy_cap
            )
        result = compute_loss_with_metrics(
            config.algorithm, LossInputs(loss_mask=mb["loss_mask"], **fields), "policy", weights
        )
        sums, peaks = _term_sums(result), {}
        if off_policy:
            sums["off_policy/weight"] = metric_sum(weights, mb["loss_mask"])
            sums["off_policy/capped"] = metric_sum(
                (weights >= config.rl.asynchronous.off_policy_cap).astype(jnp.float32),
                mb["loss_mask"],
            )
            peaks["off_policy/weight_max"] = jnp.max(jnp.where(mb["loss_mask"], weights, 0.0))
        if "old_logprobs" in fields:
            sums.update(
                ratio_sums(jax.lax.stop_gradient(logprobs), fields["old_logprobs"], mb["loss_mask"])
            )
        if routing is not None and "recorded_experts" in mb:
            sums["routing_differs"] = routing_differs(
                jax.lax.stop_gradient(routing.logits), mb["recorded_experts"], mb["loss_mask"]
            )
        if track_gap:
            sums["sampler_gap_mean"], peaks["sampler_gap_max"] = sampler_gap(
                jax.lax.stop_gradient(logprobs), mb["recorded_logprobs"], mb["loss_mask"]
            )
        return result.total.total, (result.total, sums, peaks)

    def combine(a, b):  # sums add over micro-batches, peaks take the maximum
        return add_trees(a[0], b[0]), add_trees(a[1], b[1]), jax.tree.map(jnp.maximum, a[2], b[2])

    def gradients(replicated, rows):  # -> ((grads, total, sums), peaks)
        params, base, first_update = replicated
        grads, (total, sums, peaks) = accumulate_gradients(
            functools.partial(loss_fn, base=base, first_update=first_update),
            params,
            rows,
            config.rl.batching.num_micro_batches,
            combine,
        )
        return (grads, total, sums), peaks

    if ordered:  # each device's own rows, then its sums added in a fixed order
        (grads, total, sums), peaks = ordered_over_rows(
            gradients, mesh, (params, base, jnp.asarray(first_update)), data
        )
    else:
        (grads, total, sums), peaks = gradients((params, base, first_update), data)
    grads = divide_tree(grads, total.denom)
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
    ordered = ordered_sums(config, mesh)
    constrain = None if ordered else activation_constraint(mesh)
    batch_fields = needs.critic & needs.batch

    def loss_fn(critic, mb):
        values = critic_values(
            nnx.merge(graphdef, critic.backbone),
            critic.head,
            mb["tokens"],
            mb["token_mask"],
            forward=config.forward,
            constrain=constrain,
            segment_ids=mb.get("segment_ids"),
        )
        fields = {name: mb[name] for name in batch_fields}
        fields["segment_ids"] = mb.get("segment_ids")
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

    def gradients(critic, rows):  # -> ((grads, total, sums, ev), no peaks)
        return accumulate_gradients(loss_fn, critic, rows, config.rl.batching.num_micro_batches), {}

    if ordered:
        (grads, (total, sums, ev)), _ = ordered_over_rows(gradients, mesh, critic, data)
    else:
        (grads, (total, sums, ev)), _ = gradients(critic, data)
    grads = divide_tree(grads, total.denom)
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
    config = for_batch(config, batch)
    data, metrics = prepare_batch(graphdef, config, state, batch, mesh)
    policy_grads, policy_metrics = policy_gradients(
        graphdef, config, state.policy, data, mesh, first_update=True, base=state.base
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
    return keep_if(ok, optax.apply_updates(params, updates), params), keep_if(
        ok, new_opt, opt_state
    )


def _update_fn(
    graphdef: nnx.GraphDef,
    config: TrainConfig,
    data: Mapping[str, jax.Array],
    mesh: Mesh | None,
    base: Any = None,
):
    """``(carry, (index, rows or None)) -> (carry, metrics)``: update number ``index`` on
    ``data`` at ``rows`` (all rows if None).

    ``carry = (policy, policy_opt, critic, critic_opt)`` (with LoRA ``policy`` is the adapters,
    on the frozen ``base``). If the loss or any gradient is not finite, nothing is updated and
    the metric ``update_skipped`` is 1.
    """

    def update(carry, xs):
        (policy, policy_opt, critic, critic_opt), (index, rows) = carry, xs
        mb = data if rows is None else select_rows(data, rows, mesh)
        policy_grads, metrics = policy_gradients(
            graphdef, config, policy, mb, mesh, first_update=index == 0, base=base
        )
        finite = jnp.isfinite(metrics["loss"]) & all_finite(policy_grads)
        if critic is not None:
            critic_grads, critic_metrics = critic_gradients(graphdef, config, critic, mb, mesh)
            metrics.update(critic_metrics)
            finite = finite & jnp.isfinite(metrics["value_loss"]) & all_finite(critic_grads)
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
    :func:`~agentrl_jax.train.jitted_step.make_train_step`."""
    config = for_batch(config, batch)
    rows = batch.trajectory.tokens.shape[0] if batch.packing is None else batch.packing.shape[0]
    if rows % update_chunks(config):
        raise ValueError(
            f"mini_batches={config.rl.batching.mini_batches} x "
            f"num_micro_batches={config.rl.batching.num_micro_batches} must divide the batch's "
            f"{rows} rows"
        )
    data, batch_metrics = prepare_batch(graphdef, config, state, batch, mesh)
    update = _update_fn(graphdef, config, data, mesh, state.base)
    carry = (state.policy, state.policy_opt, state.critic, state.critic_opt)
    rng, count = state.rng, config.updates_per_batch
    if count == 1:
        carry, per_update = update(carry, (0, None))
        per_update = jax.tree.map(lambda x: x[None], per_update)
    else:
        order = None
        if config.rl.batching.mini_batches > 1:  # shuffled: a key of its own, split off the state's
            rng, key = jax.random.split(state.rng)
            order = update_rows(
                key, rows, config.rl.batching.epochs, config.rl.batching.mini_batches
            )
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
