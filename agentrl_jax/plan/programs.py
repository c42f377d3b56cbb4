"""Will a config fit? Compile every program it runs for a target's devices, without the target.

``plan(config, target)`` builds the config's mesh over the target's devices (with
``mesh.rollout``, the training mesh over the others, and the rollout programs on a mesh of
the rollout devices), makes the model
and the train state as abstract arrays (``jax.ShapeDtypeStruct`` with their final shardings:
no weights are read or allocated), lowers and compiles each program the run executes, and
reads the compiler's per-device memory analysis:

* ``train:<run>``       the train step of each distinct trainer config (policy, KL reference and
                        critic passes are inside it), at the config's rows per micro-batch and
                        ``task.max_context`` tokens;
* ``rollout:init``, ``rollout:append``, ``rollout:decode``   the sampler's programs at the
                        rollout's rows per call, cache length and prefill chunk; with
                        ``engine.kv_page_size`` on the paged cache (a pool for every row in
                        flight at ``task.max_context``), and with ``rl.refill`` also
                        ``rollout:append_rows`` (seating new rows);
* ``sync:weights``      the weight sync on the training devices (the policy cast to the compute
                        dtype and laid out for the sampler, or gathered to be copied onto
                        rollout devices of their own);
* ``eval:append``, ``eval:decode``   the evaluation sampler's;
* ``eval:likelihood``   the teacher-forced forward of the likelihood analysis (§7.4) at
                        ``eval.likelihood_rows_per_batch`` rows of ``eval.max_context`` tokens.

Targets (:mod:`~agentrl_jax.plan.targets`): compile-only NVIDIA GPUs compiled by XLA:GPU
itself (``cuda_target("h100", 8)``, jax's CUDA plugin), compile-only TPU chips (``tpu_target``,
libtpu), or a stand-in compiler for GPUs where the plugin is missing (``gpu_target``: TPU v5p
chips or fake CPU devices; estimates). Programs are traced for the target's platform
(``attention.built_for``), so ``attention: auto``, the paged decode kernel and the layer loop
are what that platform runs; the report names the compiler of every figure.

Each :class:`ProgramPlan` holds arguments, outputs, aliased (donated) and temporary bytes, the
peak, the largest buffers of the partitioned program, whether it compiled (a compiler failure
is reported as a program that did not, with the compiler's message) and fits in the device
memory with the asked headroom, and on a GPU target its roofline prediction
(:mod:`~agentrl_jax.plan.roofline`). The peak is never below arguments + outputs - aliased +
temporaries (what XLA:GPU allocates: :func:`analyse`); the compiler's own peak is kept beside
it.

``agentrl-jax plan`` is the command-line front end (:mod:`agentrl_jax.cli.plan`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from agentrl_jax.models import attention, lora
from agentrl_jax.models.checkpoints import abstract_qwen3
from agentrl_jax.models.config import QWEN3_ARCHITECTURES, Qwen3Config, qwen3_config
from agentrl_jax.plan import roofline
from agentrl_jax.plan.targets import GIB, GpuSpec, Target
from agentrl_jax.sampling import Paging, SamplingConfig
from agentrl_jax.sampling.jitted import Sampler
from agentrl_jax.sampling.sampler import init_state
from agentrl_jax.sampling.weights import copier, sampler_shardings
from agentrl_jax.sharding import (
    BATCH_AXES,
    QWEN3_PARAM_RULES,
    MeshConfig,
    batch_shards,
    build_mesh,
    data_mesh,
    describe_mesh,
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
from agentrl_jax.train.config import loss_position_bound
from agentrl_jax.train.config import train_config as make_train_config
from agentrl_jax.train.jitted_step import batch_shardings
from agentrl_jax.trajectory import Trajectory


@dataclasses.dataclass(frozen=True)
class ProgramPlan:
    """One compiled program's per-device memory (bytes)."""

    name: str
    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    peak: int
    largest: tuple[tuple[str, int], ...]  # (HLO shape, bytes), largest first
    fits: bool
    headroom: float  # 1 - peak / device memory
    compiler_peak: int = 0  # the compiler's peak_memory_in_bytes (0: it gives none)
    error: str = ""  # why the compiler refused it (e.g. out of memory); "" when it compiled
    compiled: bool = True  # False: the compiler failed (``error`` says why)
    compiler: str = ""  # which compiler produced the figures (Target.compiler)
    prediction: dict[str, Any] | None = None  # roofline.Prediction.to_dict() on a GPU target
    float32_copies: tuple[tuple[str, int], ...] = ()  # see float32_copies(), largest first
    # "yes", "NO", or "unknown on this compiler": it does not fit as compiled, but the compiler
    # is a stand-in that made float32 copies of half-precision buffers the target would not
    verdict: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "largest": [list(x) for x in self.largest],
            "float32_copies": [list(x) for x in self.float32_copies],
        }


def model_config(settings: Any, name: str | None = None) -> Qwen3Config:
    """The architecture of a config's ``model`` section: ``model_dir``'s config.json if it
    exists; else a known Qwen3 size named by ``name`` or found in the directory's name
    (``.../Qwen3-4B`` -> qwen3-4b, ``.../Qwen3-30B-A3B-Instruct-2507`` -> qwen3-30b-a3b: the
    longest known name found wins); without ``model_dir`` the random-init model's dimensions
    (vocabulary: ``tokenizer_vocab``)."""
    model_dir = settings.model_dir
    if model_dir and (Path(model_dir) / "config.json").is_file():
        return Qwen3Config.from_model_dir(model_dir)
    if model_dir is None and name is None:
        return Qwen3Config(
            vocab_size=settings.tokenizer_vocab,
            hidden_size=settings.hidden_size,
            intermediate_size=settings.intermediate_size,
            num_hidden_layers=settings.num_hidden_layers,
            num_attention_heads=settings.num_attention_heads,
            num_key_value_heads=settings.num_key_value_heads,
            head_dim=settings.head_dim,
        )
    key = (name or Path(model_dir).name).lower()
    for arch in sorted(QWEN3_ARCHITECTURES, key=len, reverse=True):
        if arch in key:
            return qwen3_config(arch)
    raise ValueError(
        f"model.model_dir {model_dir!r}: no config.json there and no known size in its name "
        f"(pass --model one of {sorted(QWEN3_ARCHITECTURES)})"
    )


def fit_mesh(config: MeshConfig, devices: Sequence[Any]) -> tuple[MeshConfig, str | None]:
    """``config`` if it lays out ``devices``; else the same mesh with the fsdp axis (then the
    data axis) taking the devices the others leave, and a note naming the ``--set`` that runs
    it. ValueError naming the fields when neither lays them out."""
    try:
        build_mesh(config, devices)
        return config, None
    except ValueError as error:
        refused = str(error)
    candidates = [
        (axis, dataclasses.replace(config, **{axis: -1}))
        for axis in ("fsdp", "data")
        if -1 not in [v for a, v in config.axes().items() if a != axis]
    ]
    for axis, candidate in candidates:
        try:
            mesh = build_mesh(candidate, devices)
        except ValueError:
            continue
        return candidate, (
            f"the config's mesh does not lay out the {len(devices)} devices ({refused}); "
            f"planned with {axis}={mesh.shape[axis]} (run it with --set mesh.{axis}=-1)"
        )
    raise ValueError(
        f"{refused}; give a mesh for {len(devices)} devices, e.g. --set mesh.fsdp=-1 "
        "(or mesh.data, mesh.fsdp and mesh.tensor whose product is the device count)"
    )


# ------------------------------------------------------------------------- memory


_SHAPE = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|bf16|f16|f32|f64)\[([0-9,]*)\]")
_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "bf16": 2,
    "f16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}


def buffer_sizes(hlo_text: str) -> dict[str, int]:
    """Every distinct array shape named in an HLO module (``"bf16[8,28]"``) with its bytes."""
    sizes = {}
    for dtype, dims in _SHAPE.findall(hlo_text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        sizes[f"{dtype}[{dims}]"] = n * _BYTES[dtype]
    return sizes


def largest_buffers(
    hlo_text: str, count: int = 5, sizes: dict[str, int] | None = None
) -> tuple[tuple[str, int], ...]:
    """The ``count`` largest distinct array shapes named in an HLO module, with their bytes
    (``sizes``: :func:`buffer_sizes` of it, where already read)."""
    sizes = buffer_sizes(hlo_text) if sizes is None else sizes
    return tuple(sorted(sizes.items(), key=lambda kv: -kv[1])[:count])


def float32_copies(
    hlo_text: str, sizes: dict[str, int] | None = None
) -> tuple[tuple[str, int], ...]:
    """The float32 arrays of an HLO module with the dimensions of a bfloat16 or float16 array
    of it, largest first, with their bytes: the copies XLA:CPU makes to compute half precision
    in float32 (XLA:GPU and XLA:TPU compute it as it is), e.g. ``f32[8,28,4096,128,128]`` of a
    bfloat16 KV cache. ``sizes``: :func:`buffer_sizes` of it, where already read."""
    sizes = buffer_sizes(hlo_text) if sizes is None else sizes
    half = {shape[shape.index("[") :] for shape in sizes if shape.startswith(("bf16[", "f16["))}
    return tuple(
        (shape, size)
        for shape, size in largest_buffers(hlo_text, len(sizes), sizes)
        if shape.startswith("f32[") and shape[3:] in half and size
    )


def analyse(name: str, compiled: Any, memory_bytes: float, headroom: float) -> ProgramPlan:
    """A :class:`ProgramPlan` from a compiled program (``jitted.lower(...).compile()``), or
    from a lowered one (``jitted.lower(...)``), compiled here: a compiler that runs out of
    device memory (XLA:TPU refuses such a program) gives a plan that does not fit, its peak
    the compiler's figure of what it needed (:func:`refused_plan`), instead of an error.

    The peak is the larger of the compiler's ``peak_memory_in_bytes`` and the bound
    arguments + outputs - aliased + temporaries: XLA:GPU allocates a program's temporaries as
    one block beside its arguments, so on a GPU the bound is what is allocated, even where
    XLA:TPU's simulated heap gives a lower peak; XLA:CPU's peak leaves temporaries out.
    ``compiler_peak`` keeps the compiler's own figure."""
    if not hasattr(compiled, "memory_analysis"):  # lowered: compile it here
        try:
            compiled = compiled.compile()
        except Exception as e:  # noqa: BLE001 - every compiler failure is a finding
            return refused_plan(name, f"{type(e).__name__}: {e}", memory_bytes)
    m = compiled.memory_analysis()
    bound = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )
    compiler_peak = int(getattr(m, "peak_memory_in_bytes", 0) or 0)
    peak = max(compiler_peak, bound)
    text = compiled.as_text()
    sizes = buffer_sizes(text)  # the HLO read once for both lists
    return ProgramPlan(
        name,
        int(m.argument_size_in_bytes),
        int(m.output_size_in_bytes),
        int(m.alias_size_in_bytes),
        int(m.temp_size_in_bytes),
        int(peak),
        largest_buffers(text, sizes=sizes),
        bool(peak <= memory_bytes * (1 - headroom)),
        float(1 - peak / memory_bytes),
        compiler_peak,
        float32_copies=float32_copies(text, sizes)[:3],
    )


_NEEDED = re.compile(r"required for HLO temporaries \((\d+(?:\.\d+)?)([KMGT])\)")


def refused_plan(name: str, message: str, memory_bytes: float) -> ProgramPlan:
    """The plan of a program the compiler refused: not compiled, not fitting, its temporaries
    and peak what the compiler says it needed (XLA:TPU: "the total memory required for HLO
    temporaries (20.61G) exceeds available HBM (15.75G)"; 0 if it says nothing), and the
    compiler's first line as ``error`` (e.g. XLA:GPU's "RESOURCE_EXHAUSTED: Shared memory size
    limit exceeded" for a Triton kernel whose blocks do not fit)."""
    found = _NEEDED.search(message)
    needed = 0
    if found:
        needed = int(float(found.group(1)) * 1024 ** "KMGT".index(found.group(2)) * 1024)
    first = next((line.strip() for line in message.splitlines() if line.strip()), message)
    return ProgramPlan(
        name,
        0,
        0,
        0,
        needed,
        needed,
        (),
        False,
        float(1 - needed / memory_bytes),
        0,
        first[:300],
        compiled=False,
    )


def _abstract(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


# ------------------------------------------------------------------------- programs


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


UNKNOWN = "unknown on this compiler"
REAL_VERDICT = (
    "rerun the same command with jax's CUDA plugin installed (pip install -e '.[cuda]'; no GPU "
    "needed): XLA:GPU compiles it for the GPU itself (or with libtpu, pip install -e '.[tpu]', "
    "and --gpu-stand-in tpu)"
)


def program_verdict(p: ProgramPlan, target: Target) -> str:
    """Whether ``p`` fits, as far as ``target``'s compiler can tell: "yes", "NO", or
    :data:`UNKNOWN` where it does not fit as compiled by the XLA:CPU stand-in but holds float32
    copies of half-precision buffers (:func:`float32_copies`) that a GPU would not make."""
    if p.fits:
        return "yes"
    if target.cpu_stand_in and p.compiled and p.float32_copies:
        return UNKNOWN
    return "NO"


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Rows one device holds in each program of a plan (what its predictions are for)."""

    train_rows: int  # per update (all micro-batches)
    micro_batches: int
    rollout_rows: int  # per rollout call
    eval_rows: int
    likelihood_rows: int


# What the rollout prediction assumes of a turn where the config does not say: the chat
# prompt (system, rules, the first observation) and one observation, in tokens (FrozenLake
# 8x8 with Qwen3's tokenizer is of this order; a prediction names what it assumes).
PROMPT_TOKENS = 512
OBSERVATION_TOKENS = 128


def _train_prediction(
    config: Any, run: Any, model: Qwen3Config, gpu: GpuSpec, shape: Shapes
) -> roofline.Prediction:
    """One update of ``run`` on one device: its rows at ``task.max_context`` tokens, with the
    passes the run's step makes (KL reference, critic, recompute, LoRA's frozen base)."""
    train = make_train_config(config, run)
    rows = max(1, shape.train_rows)
    return roofline.train_step(
        model, gpu, rows, config.task.max_context,
        micro_batches=min(shape.micro_batches, rows), reference=train.uses_reference,
        critic=train.uses_critic, remat=config.rl.remat is not None,
        full_weights=config.rl.lora is None,
    )  # fmt: skip


def _predict(
    name: str, config: Any, model: Qwen3Config, gpu: GpuSpec, shape: Shapes
) -> dict[str, Any] | None:
    """The roofline prediction of one planned program (per device), None where there is none
    to make (init, seating rows)."""
    task, ev = config.task, config.eval
    weights = roofline.stored_matmul_parameters(model)  # every weight (every expert)
    if name.startswith("train:"):
        run = next(r for r in config.rl.resolved_runs() if f"train:{r.name}" == name)
        return _train_prediction(config, run, model, gpu, shape).to_dict()
    for prefix, rows, length in (
        ("rollout", shape.rollout_rows, task.max_context),
        ("eval", shape.eval_rows, ev.max_context),
    ):
        if name == f"{prefix}:decode":
            return roofline.decode_step(model, gpu, rows, length / 2).to_dict()
        if name == f"{prefix}:append":
            chunk = config.engine.prefill_chunk or length
            return roofline.prefill(model, gpu, rows, chunk, length / 2).to_dict()
    if name == "eval:likelihood":
        return roofline.forward(model, gpu, shape.likelihood_rows, ev.max_context).to_dict()
    if name == "sync:weights":  # float32 read, the compute dtype written
        return roofline.bytes_moved(name, gpu, 6 * weights, weights, "weights/s").to_dict()
    if name == "lora:merge":
        return roofline.bytes_moved(name, gpu, 4 * weights, weights, "weights/s").to_dict()
    return None


def predictions(
    config: Any, model: Qwen3Config, gpu: GpuSpec, shape: Shapes
) -> list[roofline.Prediction]:
    """The headline roofline figures of a config on one ``gpu``: decode tokens/s at batch 1, 8
    and 64 (half of ``task.max_context`` cached), one update's tokens/s and MFU per device,
    and the rollout's turns/s per device (``task.t_max`` turns of ``max_response_tokens``)."""
    task = config.task
    out = [roofline.decode_step(model, gpu, b, task.max_context / 2) for b in (1, 8, 64)]
    out.append(_train_prediction(config, config.rl.resolved_runs()[0], model, gpu, shape))
    out.append(
        roofline.rollout_turns(
            model, gpu, shape.rollout_rows, turns=task.t_max,
            response_tokens=task.max_response_tokens, observation_tokens=OBSERVATION_TOKENS,
            prompt_tokens=PROMPT_TOKENS, max_context=task.max_context,
        )
    )  # fmt: skip
    return out


def plan(
    config: Any,
    target: Target,
    *,
    headroom: float = 0.15,
    model_name: str | None = None,
    programs: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Compile the programs of a :class:`~agentrl_jax.reproduce.config.ReproduceConfig` for
    ``target`` and report their memory (see the module docstring). ``programs``: name
    prefixes to keep (e.g. ``["train"]``), None for all.

    Every program is traced for ``target.platform`` (``attention: auto`` picks cuDNN for a GPU,
    splash for a TPU, even in a process whose backend is the CPU) and compiled by
    ``target.compiler``, which the report names; on a GPU target each program also carries a
    roofline prediction (:mod:`~agentrl_jax.plan.roofline`) and the report the headline ones
    (:func:`predictions`)."""
    with attention.built_for(target.platform):
        return _plan(config, target, headroom, model_name, programs)


def _plan(
    config: Any,
    target: Target,
    headroom: float,
    model_name: str | None,
    programs: Sequence[str] | None,
) -> dict[str, Any]:
    model_cfg = model_config(config.model, model_name)
    dtype = jnp.dtype(config.model.dtype)
    lora_config = config.rl.lora
    # a LoRA run loads its frozen base in rl.lora.base_dtype (the pipeline does)
    param_dtype = jnp.dtype((lora_config and lora_config.base_dtype) or jnp.float32)
    model = abstract_qwen3(model_cfg, dtype=dtype, param_dtype=param_dtype)
    mesh_config, mesh_note = fit_mesh(config.mesh, target.devices)
    config = dataclasses.replace(config, mesh=mesh_config)
    mesh = build_mesh(config.mesh, target.devices)
    trained = set(mesh.devices.flat)
    rollout_mesh = (  # mesh.rollout: the rollout devices of every process, rows split over them
        data_mesh([d for d in target.devices if d not in trained]) if config.mesh.rollout else mesh
    )
    rl, task = config.rl, config.task
    rows = rl.tasks_per_step * rl.group_size
    wanted = lambda name: programs is None or any(name.startswith(p) for p in programs)
    results: list[ProgramPlan] = []
    seen: set[str] = set()  # runs of one update share its program
    for spec in rl.resolved_runs():
        train_config = make_train_config(config, spec)
        key = json.dumps(train_config.to_dict(), sort_keys=True, default=str)
        if key in seen or not wanted(f"train:{spec.name}"):
            continue
        seen.add(key)
        results.append(
            plan_train_step(
                f"train:{spec.name}",
                model,
                train_config,
                mesh,
                rows=rows,
                length=task.max_context,
                turns=task.t_max,
                memory_bytes=target.memory_bytes,
                headroom=headroom,
            )
        )
    # with LoRA the rollouts apply the adapters to the frozen base (no merged copy of the
    # weights: train.state.sampler_params); the weights are merged once, for the run's result
    rollout_model = model
    if rl.lora is not None:
        lora_train = make_train_config(config, rl.resolved_runs()[0])
        rollout_model = train_model(model, lora_train)
        if wanted("lora:merge"):
            results.append(
                plan_lora_merge(
                    "lora:merge",
                    model,
                    lora_train,
                    mesh,
                    memory_bytes=target.memory_bytes,
                    headroom=headroom,
                )
            )
    rollout_rows = rl.max_rows_per_call or rows
    engine = config.engine
    cache_dtype = jnp.dtype(engine.kv_cache_dtype or config.model.dtype)
    if wanted("sync:weights"):
        results.append(
            plan_weight_sync(
                "sync:weights",
                model,
                mesh,
                rollout_mesh,
                layout=engine.generation_layout,
                memory_bytes=target.memory_bytes,
                headroom=headroom,
            )
        )
    results += plan_sampler(
        "rollout",
        rollout_model,
        rollout_mesh,
        rows=rollout_rows,
        max_len=task.max_context,
        max_new_tokens=task.max_response_tokens,
        prefill_chunk=engine.prefill_chunk,
        cache_dtype=cache_dtype,
        layout=engine.generation_layout,
        sampling=rl.sampling,
        memory_bytes=target.memory_bytes,
        headroom=headroom,
        wanted=wanted,
        paging=engine.paging,
        refill=rl.refill,
    )
    ev = config.eval
    results += plan_sampler(
        "eval",
        model,
        mesh,
        rows=eval_rows(ev, task.eval_tasks),
        max_len=ev.max_context,
        max_new_tokens=ev.max_response_tokens,
        prefill_chunk=engine.prefill_chunk,
        cache_dtype=cache_dtype,
        layout=engine.generation_layout,
        sampling=SamplingConfig(temperature=ev.temperature, top_p=ev.top_p),
        memory_bytes=target.memory_bytes,
        headroom=headroom,
        wanted=wanted,
        init=False,
        paging=engine.paging,
    )
    if wanted("eval:likelihood"):
        results.append(
            plan_likelihood(
                "eval:likelihood",
                model,
                mesh,
                rows=ev.likelihood_rows_per_batch,
                length=ev.max_context,
                loss_positions=loss_position_bound(
                    task.t_max, ev.max_response_tokens, ev.max_context
                ),
                attention=ev.attention,
                memory_bytes=target.memory_bytes,
                headroom=headroom,
            )
        )
    batch_devices = batch_shards(mesh)
    shape = Shapes(
        train_rows=rows // rl.mini_batches // batch_devices,
        micro_batches=rl.num_micro_batches,
        rollout_rows=-(-rollout_rows // batch_shards(rollout_mesh)),
        eval_rows=-(-eval_rows(ev, task.eval_tasks) // batch_shards(mesh)),
        likelihood_rows=-(-ev.likelihood_rows_per_batch // batch_shards(mesh)),
    )
    headline: list[dict[str, Any]] = []
    if target.gpu is not None:
        predict = lambda name: _predict(name, config, model_cfg, target.gpu, shape)  # noqa: E731
        results = [dataclasses.replace(p, prediction=predict(p.name)) for p in results]
        headline = [x.to_dict() for x in predictions(config, model_cfg, target.gpu, shape)]
    results = [
        dataclasses.replace(p, compiler=target.compiler, verdict=program_verdict(p, target))
        for p in results
    ]
    verdicts = {p.verdict for p in results}
    unknown = [p for p in results if p.verdict == UNKNOWN]
    return {
        "target": target.name,
        "compiler": target.compiler,
        "gpu": target.gpu.name if target.gpu is not None else None,
        "estimate": target.estimate,
        "stand_in": ("cpu" if target.cpu_stand_in else "tpu") if target.estimate else None,
        "mesh": describe_mesh(mesh),
        "mesh_note": mesh_note,
        "rollout_mesh": describe_mesh(rollout_mesh) if config.mesh.rollout else "the training mesh",
        "device_memory_bytes": target.memory_bytes,
        "headroom": headroom,
        "model": {
            "layers": model_cfg.num_hidden_layers,
            "hidden": model_cfg.hidden_size,
            "parameters": sum(x.size for x in jax.tree.leaves(nnx.state(model))),
        },
        "train_rows_per_device_per_micro_batch": rows
        // rl.mini_batches
        // batch_devices
        // rl.num_micro_batches,
        "length": task.max_context,
        "programs": [p.to_dict() for p in results],
        "predictions": headline,
        "compiled": all(p.compiled for p in results),
        # True, False, or None: not known on this compiler (see "verdict", "real_verdict")
        "fits": False if "NO" in verdicts else None if unknown else True,
        "verdict": "does not fit" if "NO" in verdicts else UNKNOWN if unknown else "fits",
        "real_verdict": REAL_VERDICT if unknown else None,
    }


def format_table(report: dict[str, Any]) -> str:
    """``report`` (from :func:`plan`) as Markdown tables, GiB per device; on a GPU target the
    roofline predictions beside the memory."""

    def gib(b):
        return f"{b / GIB:.3g}"

    def speed(p):
        if not p:
            return "-"
        mfu = f", MFU {p['mfu']:.0%}" if p.get("mfu") is not None else ""
        return f"{p['value']:.4g} {p['unit']} ({p['bound']}{mfu})"

    gpu = report.get("gpu") is not None
    lines = [
        f"target: {report['target']}; mesh {report['mesh']}; "
        f"{gib(report['device_memory_bytes'])} GiB "
        f"per device, headroom asked {report['headroom']:.0%}",
        f"compiler: {report['compiler']}"
        + (" (an ESTIMATE: not the target's own compiler)" if report["estimate"] else ""),
        f"train rows per device per micro-batch: "
        f"{report['train_rows_per_device_per_micro_batch']}, "
        f"length {report['length']}",
        *([f"mesh: {report['mesh_note']}"] if report.get("mesh_note") else []),
        "",
        (
            "| program | arguments | outputs | aliased | temporaries | peak (GiB) | headroom "
            "| fits | largest buffer |" + (" roofline per device |" if gpu else "")
        ),
        "|---|---|---|---|---|---|---|---|---|" + ("---|" if gpu else ""),
    ]
    for p in report["programs"]:
        big = p["largest"][0] if p["largest"] else ("-", 0)
        lines.append(
            f"| {p['name']} | {gib(p['arguments'])} | {gib(p['outputs'])} | {gib(p['aliased'])} | "
            f"{gib(p['temporaries'])} | {gib(p['peak'])} | {p['headroom']:.0%} | "
            f"{p.get('verdict') or ('yes' if p['fits'] else 'NO')} | {big[0]} {gib(big[1])} |"
            + (f" {speed(p.get('prediction'))} |" if gpu else "")
        )
        if p.get("error"):
            lines.append(f"|  | {p['name']}: the compiler refused it: {p['error']} |||||||")
        if p.get("verdict") == UNKNOWN:
            copy, size = p["float32_copies"][0]
            lines.append(
                f"|  | {p['name']}: {copy} ({gib(size)} GiB) is XLA:CPU's float32 copy of a "
                f"bfloat16 buffer, which a GPU keeps in bfloat16 |||||||"
            )
    if report.get("predictions"):
        lines += ["", f"roofline on one {report['gpu']} (upper bounds; what each assumes):", ""]
        for x in report["predictions"]:
            lines.append(f"- {x['name']}: {speed(x)}; {x['assumes']}")
    lines.append("")
    if report.get("verdict") == UNKNOWN:
        lines.append(
            f"whether some programs fit is {UNKNOWN} (a stand-in, see above); for the verdict: "
            + report["real_verdict"]
        )
    else:
        lines.append("all programs fit" if report["fits"] else "some programs do NOT fit")
    return "\n".join(lines)
