"""The jitted host wrapper of the train step (:mod:`agentrl_jax.train.step`): one
:class:`JittedTrainStep` per model structure, config and placement jits
:func:`~agentrl_jax.train.step.train_step` and does what the pure step cannot: it plans the
batch's packing on the host (``rl.memory.packing``, or a rollout's history window: turns trained
step-wise, :meth:`JittedTrainStep.packed`), places the batch on device once in its final
shardings (:meth:`JittedTrainStep.place`; across processes each supplies its share), keeps one
jitted program per batch structure and donates the input state (``donate``), a LoRA run's
frozen base aside.

Sharding: :func:`make_train_step` with a mesh jits with the state placed by
:func:`~agentrl_jax.train.state.state_shardings` and the batch split along its first axis
(:func:`batch_shardings`); XLA inserts the reductions, so sums over the batch are global, like
the single-device ones.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from agentrl_jax import distributed
from agentrl_jax.models.attention import partitioned
from agentrl_jax.sharding import BATCH_AXES, QWEN3_PARAM_RULES, PartitionRule, batch_shards
from agentrl_jax.train.batch import TrainBatch, batch_loss_mask, check_step_wise, windowed_turns
from agentrl_jax.train.config import TrainConfig
from agentrl_jax.train.packing import plan_packing, row_sequences, turn_sequences
from agentrl_jax.train.state import TrainState, state_shardings
from agentrl_jax.train.step import train_step, update_chunks


def batch_shardings(batch: Any, mesh: Mesh) -> Any:
    """Every leaf split along its first (row) axis over the mesh's batch axes."""
    return jax.tree.map(
        lambda x: NamedSharding(mesh, P(BATCH_AXES, *([None] * (x.ndim - 1))) if x.ndim else P()),
        batch,
    )


class JittedTrainStep:
    """The jitted train step of one model structure, config and placement.

    Call it as ``step(state, batch) -> (state, metrics)``. :meth:`jitted` gives the
    ``jax.jit`` object for a batch's structure (step scores present or not), so the step can
    be lowered and compiled ahead of time with abstract inputs, e.g.
    ``step.lower(abstract_state, abstract_batch).compile().memory_analysis()``
    (:mod:`agentrl_jax.plan` does this for a target's devices, through :meth:`lower`).
    ``traces`` counts traces (= compilations). With ``donate`` the input state is donated,
    except a LoRA run's frozen base (an argument of its own).
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

    def _step(self, state, batch, base=None):
        self.traces += 1
        with partitioned(self.mesh is not None and self.mesh.size > 1):
            new, metrics = train_step(
                self.graphdef, self.config, state.replace(base=base), batch, self.mesh
            )
        return new.replace(base=None), metrics

    def jitted(self, batch: Any):
        """The ``jax.jit`` of the step for ``batch``'s tree structure (arrays or abstract), called
        as ``(state without its base, batch, base)``: with LoRA the frozen base is an argument
        of its own, never donated (it may be the caller's model's own weights) and never an
        output; :meth:`lower` and calling the step hide this."""
        key = jax.tree.structure(batch)
        if key not in self._jitted:
            donate = (0,) if self.donate else ()
            if self.mesh is None:
                self._jitted[key] = jax.jit(self._step, donate_argnums=donate)
            else:
                rest = self.state_shardings.replace(base=None)
                self._jitted[key] = jax.jit(
                    self._step,
                    in_shardings=(
                        rest,
                        batch_shardings(batch, self.mesh),
                        self.state_shardings.base,
                    ),
                    out_shardings=(rest, NamedSharding(self.mesh, P())),
                    donate_argnums=donate,
                )
        return self._jitted[key]

    def lower(self, state: TrainState, batch: TrainBatch):
        """The step lowered for ``state`` and ``batch`` (arrays or ShapeDtypeStructs):
        ``.compile().memory_analysis()`` gives its memory (:mod:`agentrl_jax.plan`)."""
        return self.jitted(batch).lower(state.replace(base=None), batch, state.base)

    def __call__(
        self, state: TrainState, batch: TrainBatch
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        batch = self.packed(batch)
        placed = self.place(batch, state)
        new, metrics = self.jitted(batch)(state.replace(base=None), placed, state.base)
        return new.replace(base=state.base), metrics

    def packed(self, batch: TrainBatch) -> TrainBatch:
        """``batch`` with its packing planned on the host (``rl.memory.packing``; else as it is):
        trajectories into rows of the batch's width, the row count a multiple of the
        micro-batch count times the mesh's batch shards (:mod:`agentrl_jax.train.packing`).
        With several processes each plans the whole batch (the same plan: the same rows, a
        deterministic plan) and then places its share of the packed rows (:meth:`place`)."""
        if batch.packing is not None:
            return batch
        traj = batch.trajectory
        # a batch already placed over several processes is no host array: the plan needs the
        # whole batch, which every process holds before placing its share (the loop's batches)
        placed = isinstance(traj.context_start, jax.Array) and not (
            traj.context_start.is_fully_addressable
        )
        step_wise = not placed and windowed_turns(traj).any()
        if not (self.config.rl.memory.packing or step_wise):
            return batch
        if placed:
            raise ValueError(
                "rl.memory.packing: packing plans the whole batch on the host, and this one is "
                "already placed over several processes; pass every process the whole host "
                "batch (each then places its share of the packed rows)"
            )
        check_step_wise(traj, self.config)
        sequences = (
            turn_sequences(traj)
            if step_wise
            else row_sequences(np.asarray(traj.token_mask), np.asarray(traj.row_mask))
        )
        rows, width = traj.tokens.shape
        multiple = update_chunks(self.config) * (
            1 if self.mesh is None else batch_shards(self.mesh)
        )
        plan = plan_packing(
            sequences,
            rows,
            width,
            multiple,
            loss_mask=np.asarray(batch_loss_mask(traj)),
            loss_bound=self.config.loss_positions,
        )
        return batch.replace(packing=plan)

    def place(self, batch: TrainBatch, state: TrainState) -> TrainBatch:
        """``batch`` on device, once, in its final shardings: the one place the trajectory
        crosses from the host (where the rollout, the checks, trimming, dynamic sampling and
        the metrics keep it) to the devices. On a mesh its rows split over the batch axes
        (several processes: each supplies its share of the whole batch,
        :func:`~agentrl_jax.distributed.global_batch`); else on the state's device. An explicit
        transfer: nothing implicit moves the batch (a test runs the loop under
        ``jax.transfer_guard_host_to_device("disallow")``)."""
        if self.mesh is None:
            return jax.device_put(batch, state.step.sharding)
        on_host = not all(isinstance(x, jax.Array) for x in jax.tree.leaves(batch))
        if distributed.is_multiprocess() and on_host:
            return distributed.global_batch(batch, self.mesh, (BATCH_AXES,))
        return jax.device_put(batch, batch_shardings(batch, self.mesh))

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
