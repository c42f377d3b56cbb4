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

Each :class:`~agentrl_jax.plan.memory.ProgramPlan` holds arguments, outputs, aliased
(donated) and temporary bytes, the peak, the largest buffers of the partitioned program, whether
it compiled (a compiler failure is reported as a program that did not, with the compiler's
message) and fits in the device memory with the asked headroom, and on a GPU target its roofline
prediction (:mod:`~agentrl_jax.plan.roofline`). The peak is never below arguments + outputs -
aliased + temporaries (what XLA:GPU allocates: :func:`~agentrl_jax.plan.memory.analyse`); the
compiler's own peak is kept beside it. Each program is compiled by
:mod:`~agentrl_jax.plan.programs`.

``agentrl-jax plan`` is the command-line front end (:mod:`agentrl_jax.cli.plan`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from agentrl_jax.models import attention
from agentrl_jax.models.checkpoints import abstract_qwen3
from agentrl_jax.models.config import QWEN3_ARCHITECTURES, Qwen3Config, qwen3_config
from agentrl_jax.plan import roofline
from agentrl_jax.plan.memory import ProgramPlan
from agentrl_jax.plan.programs import (
    eval_rows,
    plan_likelihood,
    plan_lora_merge,
    plan_sampler,
    plan_train_step,
    plan_weight_sync,
)
from agentrl_jax.plan.targets import GIB, GpuSpec, Target
from agentrl_jax.sharding import (
    MeshConfig,
    batch_shards,
    build_mesh,
    data_mesh,
    describe_mesh,
)
from agentrl_jax.train import (
    train_model,
)
from agentrl_jax.train.config import loss_position_bound
from agentrl_jax.train.config import train_config as make_train_config


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
        critic=train.uses_critic, remat=config.rl.memory.remat is not None,
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
        sampling=rl.sampling.config(),
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
        sampling=ev.sampling.config(),
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
        train_rows=rows // rl.batching.mini_batches // batch_devices,
        micro_batches=rl.batching.num_micro_batches,
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
        // rl.batching.mini_batches
        // batch_devices
        // rl.batching.num_micro_batches,
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
