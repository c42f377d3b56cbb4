"""Each program a run executes, compiled for a mesh from abstract inputs
(``jax.ShapeDtypeStruct`` with their final shardings: no weights are read or allocated) and
read by :func:`~agentrl_jax.plan.memory.analyse` into a
:class:`~agentrl_jax.plan.memory.ProgramPlan`: the train step (:func:`plan_train_step`), a LoRA
run's merge (:func:`plan_lora_merge`), the weight sync (:func:`plan_weight_sync`), the sampler's
init, append, append_rows and decode (:func:`plan_sampler`) and the likelihood analysis's
forward (:func:`plan_likelihood`). :func:`~agentrl_jax.plan.planner.plan` picks them for a
config.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from agentrl_jax.models import lora
from agentrl_jax.plan.memory import ProgramPlan, analyse
from agentrl_jax.sampling import Paging, SamplingConfig
from agentrl_jax.sampling.jitted import Sampler
from agentrl_jax.sampling.sampler import init_state
from agentrl_jax.sampling.weights import copier, sampler_shardings
from agentrl_jax.sharding import (
    BATCH_AXES,
    QWEN3_PARAM_RULES,
    batch_shards,
    generation_rules,
    resolve_layout,
    tree_shardings,
)
from agentrl_jax.train import (
    TrainBatch,
    TrainConfig,
    init_train_state,
    make_train_step,
    state_shardings,
    train_model,
)
from agentrl_jax.train.jitted_step import batch_shardings
from agentrl_jax.trajectory import Trajectory


def _abstract(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def abstract_train_state(model: nnx.Module, config: TrainConfig, mesh) -> Any:
    """The train state as ShapeDtypeStructs in their mesh layout (nothing allocated)."""
    graphdef, params = nnx.split(model)
    state = jax.eval_shape(
        lambda p: init_train_state(train_model(nnx.merge(graphdef, p), config), config), params
    )
    return _abstract(state, state_shardings(state, mesh))


def abstract_batch(
    rows: int, length: int, turns: int, mesh, routing: tuple[int, int] = (0, 0)
) -> TrainBatch:
    """A rollout batch's shapes in their mesh layout; ``routing``: an MoE policy's ``(M, k)``
    (its trajectories carry the experts of every sampled token, ``Trajectory.experts``)."""
    batch = jax.eval_shape(lambda: TrainBatch(Trajectory.zeros(rows, length, turns, routing)))
    return _abstract(batch, batch_shardings(batch, mesh))


def plan_train_step(
    name: str,
    model: nnx.Module,
    config: TrainConfig,
    mesh,
    *,
    rows: int,
    length: int,
    turns: int,
    memory_bytes: float,
    headroom: float,
) -> ProgramPlan:
    """Compile the (donating) train step for ``rows x length`` batches on ``mesh``."""
    state = abstract_train_state(model, config, mesh)
    moe_layers = sum(model.config.moe_layers)
    routing = (moe_layers, model.config.num_experts_per_tok) if moe_layers else (0, 0)
    batch = abstract_batch(rows, length, turns, mesh, routing)
    step = make_train_step(
        nnx.graphdef(train_model(model, config)),
        config,
        mesh=mesh,
        state_template=state,
        donate=True,
    )
    return analyse(name, step.lower(state, batch), memory_bytes, headroom)


def plan_lora_merge(
    name: str,
    model: nnx.Module,
    config: TrainConfig,
    mesh,
    *,
    memory_bytes: float,
    headroom: float,
) -> ProgramPlan:
    """Compile a LoRA run's merge (:func:`~agentrl_jax.train.state.policy_params`, once, for
    the run's result): the frozen base and the adapters in their training layout -> the plain
    weights ``W + scale B A``, laid out as the base is."""
    state = abstract_train_state(model, config, mesh)
    shardings = state_shardings(state, mesh)
    merge = jax.jit(
        lambda base, adapters: lora.merged_params(base, adapters, config.rl.lora.scale),
        in_shardings=(shardings.base, shardings.policy),
        out_shardings=tree_shardings(
            jax.eval_shape(lambda: nnx.state(model)), mesh, QWEN3_PARAM_RULES
        ),
    )
    return analyse(name, merge.lower(state.base, state.policy), memory_bytes, headroom)


def plan_weight_sync(
    name: str,
    model: nnx.Module,
    mesh,
    rollout_mesh,
    *,
    layout: str,
    memory_bytes: float,
    headroom: float,
) -> ProgramPlan:
    """Compile the weight sync's program on the training devices
    (:func:`~agentrl_jax.sampling.weights.sync_weights`): the policy, in its training layout
    and float32, cast to the compute dtype and laid out as the sampler reads it (colocated), or
    gathered whole on every training device to be copied onto rollout devices of their own
    (``rollout_mesh`` another mesh); across processes the same gather."""
    params = nnx.state(model)
    source = _abstract(params, tree_shardings(params, mesh, QWEN3_PARAM_RULES))
    if rollout_mesh is mesh:
        targets = jax.tree.leaves(sampler_shardings(params, mesh, layout))
    else:
        targets = [NamedSharding(mesh, P())] * len(jax.tree.leaves(params))
    copy = copier(jax.tree.structure(params), tuple(targets), jnp.dtype(model.dtype))
    return analyse(name, copy.lower(source), memory_bytes, headroom)


def plan_sampler(
    prefix: str,
    model: nnx.Module,
    mesh,
    *,
    rows: int,
    max_len: int,
    max_new_tokens: int,
    prefill_chunk: int | None,
    cache_dtype: Any,
    layout: str,
    sampling: SamplingConfig,
    memory_bytes: float,
    headroom: float,
    wanted=lambda name: True,
    init: bool = True,
    paging: Paging | None = None,
    refill: bool = False,
) -> list[ProgramPlan]:
    """Compile the sampler's init, widest append (``max_len`` columns, fed in chunks of
    ``prefill_chunk``) and decode for ``rows`` rows, parameters in the generation ``layout``;
    with ``paging`` on its paged KV cache (a pool for every row at ``max_len``), and with
    ``refill`` also the widest ``append_rows`` (seating new rows: all ``rows`` at once)."""
    sampler = Sampler(
        model, max_new_tokens=max_new_tokens, mesh=mesh, prefill_chunk=prefill_chunk, paging=paging
    )
    params = nnx.state(model)
    if (
        resolve_layout(layout, mesh) == "replicated"
    ):  # a copy in the compute dtype (generation_params)
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, model.dtype), params)
        params = _abstract(params, tree_shardings(params, mesh, generation_rules()))
    else:
        params = _abstract(params, tree_shardings(params, mesh, QWEN3_PARAM_RULES))
    pool = sampler.pool(rows, max_len, dtype=cache_dtype)
    state = jax.eval_shape(
        lambda: init_state(model.config, rows, max_len, cache_dtype, model.dtype, pool)
    )
    state = _abstract(state, sampler.state_shardings(state))

    def rows_of(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sampler.rows_sharding(len(shape)))

    out = []
    if init and wanted(f"{prefix}:init"):
        lowered = sampler._init.lower(rows, max_len, cache_dtype, pool)
        out.append(analyse(f"{prefix}:init", lowered, memory_bytes, headroom))
    if wanted(f"{prefix}:append"):
        lowered = sampler._append.lower(
            params, state, rows_of((rows, max_len), jnp.int32), rows_of((rows, max_len), jnp.bool_)
        )
        out.append(analyse(f"{prefix}:append", lowered, memory_bytes, headroom))
    if refill and wanted(f"{prefix}:append_rows"):
        lowered = sampler._append_rows.lower(
            params,
            state,
            rows_of((rows,), jnp.int32),
            rows_of((rows, max_len), jnp.int32),
            rows_of((rows, max_len), jnp.bool_),
        )
        out.append(analyse(f"{prefix}:append_rows", lowered, memory_bytes, headroom))
    if wanted(f"{prefix}:decode"):
        lowered = sampler._decode.lower(
            params,
            state,
            rows_of((rows, 2), jnp.uint32),
            rows_of((rows,), jnp.int32),
            rows_of((rows,), jnp.bool_),
            sampling=sampling,
        )
        out.append(analyse(f"{prefix}:decode", lowered, memory_bytes, headroom))
    return out


def plan_likelihood(
    name: str,
    model: nnx.Module,
    mesh,
    *,
    rows: int,
    length: int,
    loss_positions: int | None,
    attention: str,
    memory_bytes: float,
    headroom: float,
) -> ProgramPlan:
    """Compile the likelihood analysis's teacher-forced forward
    (:func:`~agentrl_jax.evaluation.likelihood.scoring_program`) for ``rows x length`` batches
    (rows rounded up to the mesh's batch shards), parameters in the train layout."""
    from agentrl_jax.evaluation.likelihood import scoring_config, scoring_program

    shards = batch_shards(mesh)
    rows = -(-rows // shards) * shards
    params = nnx.state(model)
    params = _abstract(params, tree_shardings(params, mesh, QWEN3_PARAM_RULES))
    program = scoring_program(nnx.graphdef(model), scoring_config(attention, loss_positions), mesh)
    row_sharding = NamedSharding(mesh, P(BATCH_AXES, None))
    tokens, mask = (
        jax.ShapeDtypeStruct((rows, length), d, sharding=row_sharding)
        for d in (jnp.int32, jnp.bool_)
    )
    return analyse(name, program.lower(params, tokens, mask, mask), memory_bytes, headroom)


def eval_rows(ev: Any, eval_maps: int) -> int:
    """The most rows one evaluation rollout call holds: tasks per call x the largest sample
    count (Table 1 / Pass@T, Pass@K, state sources, likelihood), or states per call x actions."""
    tasks = ev.tasks_per_call or eval_maps
    samples = max(ev.samples, ev.pass_k_samples, ev.source_samples, ev.likelihood_samples)
    return max(tasks * samples, (ev.states_per_call or ev.states) * ev.group_size)
