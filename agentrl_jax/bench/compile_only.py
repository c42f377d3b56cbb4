"""``agentrl-jax bench device --compile-only h100``: ``bench device``'s programs, compiled by
XLA:GPU for a GPU that is not there.

Every program :mod:`agentrl_jax.bench.device` runs at its full scale is lowered with abstract
inputs (``jax.ShapeDtypeStruct`` on one compile-only device of
:func:`~agentrl_jax.plan.cuda_target`: no weights exist, nothing model-sized is allocated) and
compiled by the CUDA plugin's XLA:GPU for that GPU; ``attention: auto`` chooses as it would on
the GPU (:func:`~agentrl_jax.models.attention.built_for`). One JSON line per figure ``bench
device`` prints on a GPU, under the same name (join the two outputs on ``figure``)::

    {"figure": "decode qwen3-4b batch 64", "compiled": true, "error": null,
     "compiler": "XLA:GPU", "device": "NVIDIA H100 80GB HBM3",
     "memory": {"program": "decode", "arguments": ..., "temporaries": ..., "peak": ...,
                "fits": true, "limit": ...},
     "predicted": {...roofline.Prediction...}, "programs": [...]}

``memory`` is :func:`~agentrl_jax.plan.analyse`'s figure of the figure's program (of its
largest one where a figure runs several: ``programs`` lists each); ``fits`` is against
``limit``, the 75% of the device jax's allocator may use by default (what ``bench device``
measures against). ``predicted``: the roofline of the decode, train-step and rollout figures
(the same :func:`~agentrl_jax.bench.device_figures.decode_prediction` etc. ``bench device`` compares
its measurements with on a GPU), else null. A program the compiler refuses is a line with
``compiled: false`` and the compiler's first line as ``error``.

The programs, per figure (``bench device``'s docstring says what each measures):

* memory and decode: the sampler's decode (128 new tokens after a 128-token prompt, greedy) of
  the 0.6B, 1.7B and 4B shapes at batch 1, 8 and 64 with bfloat16 weights; ``generate`` adds
  the prompt's append;
* logits: Qwen3-0.6B's float32 forward (2 rows of 64 tokens) at full matmul precision, jitted
  as one program (``bench device`` calls it eagerly, op by op);
* paged_kernel: the Pallas GPU paged-attention kernel and the XLA paged attention it is
  compared with, at the figure's shapes; cudnn_attention: cuDNN's and XLA's attention;
* train_step: the check's gradients (0.6B cut to 2 layers, 4 rows of 256 tokens, float32 at full
  precision), and the GRPO update at the 4B shape on one row of 8,192 tokens with the layers
  :func:`~agentrl_jax.bench.device_speed.train_layers` keeps in ``limit`` (float32 state, bfloat16
  compute, full remat, donated state);
* rollout: the paged sampler's programs of the rollout figure (0.6B, tasks x G rows, the
  real tokenizer's prompt and observation lengths): the shared prompts' append, the
  observations' append at every row, and decode (8 tokens, per-row keys).

The sampler's init and the small row bookkeeping programs (``take_rows``, ``release``) are not
compiled.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from agentrl_jax.bench.device import PARTS
from agentrl_jax.bench.device_checks import (
    CUDNN_SHAPE,
    PAGED_BLOCK_PAGES,
    PAGED_SHAPE,
    logits_tokens,
    train_check_config,
    train_check_tokens,
)
from agentrl_jax.bench.device_figures import (
    CUDNN,
    FULL,
    LOGITS,
    MEMORY_DECODE_BATCH,
    PAGED_KERNEL,
    TINY,
    TRAIN_CHECK,
    Scale,
    _train_batch,
    decode_name,
    decode_prediction,
    generate_name,
    memory_name,
    our_config,
    rollout_name,
    rollout_prediction,
    train_name,
    train_prediction,
)
from agentrl_jax.bench.device_speed import (
    frozenlake_runner,
    train_config,
    train_layers,
    turn_tokens,
)
from agentrl_jax.plan.memory import ProgramPlan, analyse, refused_plan

JAX_MEMORY_FRACTION = 0.75  # the share of a GPU jax's allocator may use by default


@dataclasses.dataclass(frozen=True)
class CompiledFigure:
    """The program(s) behind one figure of ``bench device``, compiled for a target."""

    figure: str
    plans: tuple[ProgramPlan, ...]
    compiler: str
    device: str
    limit: float
    predicted: dict[str, Any] | None = None

    @property
    def compiled(self) -> bool:
        return all(p.compiled for p in self.plans)

    @property
    def fits(self) -> bool:
        return all(p.fits for p in self.plans)

    @property
    def error(self) -> str | None:
        return next((f"{p.name}: {p.error}" for p in self.plans if p.error), None)

    def to_dict(self) -> dict[str, Any]:
        top = max(self.plans, key=lambda p: p.peak)
        return {
            "figure": self.figure,
            "compiled": self.compiled,
            "error": self.error,
            "compiler": self.compiler,
            "device": self.device,
            "memory": {
                "program": top.name,
                "arguments": top.arguments,
                "temporaries": top.temporaries,
                "peak": top.peak,
                "fits": self.fits,
                "limit": self.limit,
            },
            "predicted": self.predicted,
            "programs": [
                {
                    "program": p.name,
                    "compiled": p.compiled,
                    "error": p.error or None,
                    "arguments": p.arguments,
                    "outputs": p.outputs,
                    "temporaries": p.temporaries,
                    "peak": p.peak,
                }
                for p in self.plans
            ],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


class _Compiler:
    """Lowers and compiles programs for one compile-only device; one plan per program key."""

    def __init__(self, target: Any):
        self.target = target
        self.device = target.devices[0]
        self.sharding = jax.sharding.SingleDeviceSharding(self.device)
        self.limit = JAX_MEMORY_FRACTION * target.memory_bytes
        self._plans: dict[Any, ProgramPlan] = {}

    def on_device(self, tree: Any) -> Any:
        """``tree``'s arrays (or abstract arrays) as ShapeDtypeStructs on the device."""
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=self.sharding), tree
        )

    def abstract(self, shape_of: Callable[[], Any]) -> Any:
        """What ``shape_of()`` returns, evaluated abstractly, on the device."""
        return self.on_device(jax.eval_shape(shape_of))

    def plan(self, name: str, lower: Callable[[], Any], key: Any = None) -> ProgramPlan:
        """``lower()``'s program compiled (once per ``key``): a failure to lower or to compile
        is a plan with ``compiled`` False and the first line of the error."""
        if key is not None and key in self._plans:
            return self._plans[key]
        try:
            lowered = lower()
        except Exception as error:  # noqa: BLE001 - every failure is a finding
            out = refused_plan(name, f"{type(error).__name__}: {error}", self.limit)
        else:
            out = analyse(name, lowered, self.limit, 0.0)
        if key is not None:
            self._plans[key] = out
        return out

    def figure(self, name: str, plans: Sequence[ProgramPlan], predicted=None) -> CompiledFigure:
        prediction = predicted.to_dict() if predicted is not None else None
        return CompiledFigure(
            name, tuple(plans), self.target.compiler, self.device.device_kind, self.limit,
            prediction,
        )  # fmt: skip


def _model(shape: str, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, config=None):
    from agentrl_jax.models.checkpoints import abstract_qwen3  # noqa: PLC0415

    return abstract_qwen3(config or our_config(shape), dtype=dtype, param_dtype=param_dtype)


# ---------------------------------------------------------------------------- sampler
def _sampler_state(c: _Compiler, sampler: Any, model: Any, rows: int, max_len: int, pool_rows=None):
    from agentrl_jax.sampling.sampler import init_state  # noqa: PLC0415

    pool = sampler.pool(rows, max_len, pool_rows, model.dtype)
    return c.abstract(
        lambda: init_state(model.config, rows, max_len, model.dtype, model.dtype, pool)
    )


def _append(c: _Compiler, name: str, sampler: Any, params: Any, state: Any, width: int, key=None):
    rows = state.hidden.shape[0]
    tokens = jax.ShapeDtypeStruct((rows, width), jnp.int32, sharding=c.sharding)
    mask = jax.ShapeDtypeStruct((rows, width), jnp.bool_, sharding=c.sharding)
    return c.plan(name, lambda: sampler._append.lower(params, state, tokens, mask), key)


def _decode(c: _Compiler, name: str, sampler, params, state, sampling, row_keys: bool, key=None):
    rows = state.hidden.shape[0]
    if row_keys:  # a rollout's: [B, 2] uint32 key data, one per row
        keys = jax.ShapeDtypeStruct((rows, 2), jnp.uint32, sharding=c.sharding)
    else:  # bench device's: one typed key
        keys = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=c.sharding)
    budget = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=c.sharding)
    active = jax.ShapeDtypeStruct((rows,), jnp.bool_, sharding=c.sharding)
    lower = lambda: sampler._decode.lower(params, state, keys, budget, active, sampling=sampling)  # noqa: E731
    return c.plan(name, lower, key)


def _decoder(c: _Compiler, shape: str, batch: int, scale: Scale):
    """``bench device``'s decode programs of ``shape`` at ``batch``: (append, decode) plans."""
    from agentrl_jax.sampling import Sampler, SamplingConfig  # noqa: PLC0415

    model = _model(shape)
    sampler = Sampler(model, max_new_tokens=scale.new_tokens, stop_token_ids=(), device=c.device)
    params = c.on_device(nnx.state(model))
    state = _sampler_state(c, sampler, model, batch, scale.prompt_len + scale.new_tokens)
    greedy = SamplingConfig(temperature=0.0)
    append = _append(
        c, "append", sampler, params, state, scale.prompt_len, ("append", shape, batch)
    )
    decode = _decode(c, "decode", sampler, params, state, greedy, False, ("decode", shape, batch))
    return append, decode


def memory_figures(c: _Compiler, scale: Scale) -> list[CompiledFigure]:
    shape, batch = scale.decode_shapes[0], MEMORY_DECODE_BATCH
    _, decode = _decoder(c, shape, batch, scale)
    return [c.figure(memory_name(decode_name(shape, batch)), [decode])]


def decode_figures(c: _Compiler, scale: Scale) -> list[CompiledFigure]:
    spec = c.target.gpu
    out = []
    for shape in scale.decode_shapes:
        config = our_config(shape)
        for batch in scale.decode_batches:
            append, decode = _decoder(c, shape, batch, scale)
            predicted = decode_prediction(config, spec, batch, scale)
            out.append(c.figure(decode_name(shape, batch), [decode], predicted))
            out.append(c.figure(generate_name(shape, batch), [append, decode]))
    return out


# ---------------------------------------------------------------------------- correctness
def logits_figures(c: _Compiler, scale: Scale) -> list[CompiledFigure]:
    from agentrl_jax.models import positions_from_mask  # noqa: PLC0415

    model = _model(scale.logits_shape, jnp.float32, jnp.float32)
    graphdef, params = nnx.split(model)
    rows, length = logits_tokens(scale)
    tokens = jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=c.sharding)
    mask = jax.ShapeDtypeStruct((rows, length), jnp.bool_, sharding=c.sharding)
    forward = jax.jit(lambda p, t, m: nnx.merge(graphdef, p)(t, positions_from_mask(m), m)[0])

    def lower():
        with jax.default_matmul_precision("highest"):
            return forward.lower(c.on_device(params), tokens, mask)

    name = LOGITS.format(shape=scale.logits_shape)
    return [c.figure(name, [c.plan("forward float32", lower)])]


def paged_kernel_figures(c: _Compiler, scale: Scale) -> list[CompiledFigure]:
    from agentrl_jax.models import paged_cache, paged_kernels  # noqa: PLC0415

    batch, heads, kv_heads, layers, pages, size, per_row, hd = PAGED_SHAPE
    f32 = lambda shape, dtype=jnp.float32: jax.ShapeDtypeStruct(shape, dtype, sharding=c.sharding)  # noqa: E731
    args = (
        f32((batch, heads, hd)),
        f32((kv_heads, layers, pages, size, hd)),
        f32((kv_heads, layers, pages, size, hd)),
        f32((batch, per_row), jnp.int32),
        f32((batch,), jnp.int32),
    )
    blocks = PAGED_BLOCK_PAGES
    kernel = jax.jit(
        lambda q, k, v, table, lengths: paged_kernels.decode_attention(
            "pallas_gpu", q, k, v, 1, table, lengths, block_pages=blocks, interpret=False
        )
    )
    reference = jax.jit(
        lambda q, k, v, table, lengths: paged_cache.paged_attention(
            q[:, None], k, v, 1, table, lengths[:, None], block_pages=blocks
        )[:, 0]
    )

    def lower(program):
        with jax.default_matmul_precision("highest"):
            return program.lower(*args)

    plans = [
        c.plan("pallas_gpu kernel", lambda: lower(kernel)),
        c.plan("xla paged attention", lambda: lower(reference)),
    ]
    return [c.figure(PAGED_KERNEL, plans)]


def cudnn_figures(c: _Compiler, scale: Scale) -> list[CompiledFigure]:
    from agentrl_jax.models.attention import attention  # noqa: PLC0415

    b, length, heads, kv, hd = CUDNN_SHAPE
    bf16 = lambda n: jax.ShapeDtypeStruct((b, length, n, hd), jnp.bfloat16, sharding=c.sharding)  # noqa: E731
    valid = jax.ShapeDtypeStruct((b, length), jnp.bool_, sharding=c.sharding)

    def program(implementation: str):
        run = jax.jit(lambda q, k, v, m: attention(q, k, v, None, m, implementation=implementation))
        return c.plan(implementation, lambda: run.lower(bf16(heads), bf16(kv), bf16(kv), valid))

    return [c.figure(CUDNN, [program("cudnn"), program("xla")])]


def _train_inputs(c: _Compiler, model: Any, train: Any, rows: int, length: int):
    """The abstract train state of ``model`` and ``bench device``'s synthetic batch."""
    from agentrl_jax.train import init_train_state  # noqa: PLC0415

    graphdef, params = nnx.split(model)
    state = c.abstract(lambda: init_train_state(nnx.merge(graphdef, params), train))
    batch = _train_batch(rows, length, model.config.vocab_size)  # small host arrays
    return graphdef, state, c.on_device(batch)


def train_step_figures(c: _Compiler, scale: Scale) -> list[CompiledFigure]:
    """The train-step check's gradients, then the update of the speed and memory figures."""
    from agentrl_jax.train import TrainConfig  # noqa: PLC0415
    from agentrl_jax.train.jitted_step import make_train_step  # noqa: PLC0415
    from agentrl_jax.train.step import compute_gradients  # noqa: PLC0415

    check = _model("", jnp.float32, jnp.float32, train_check_config(scale))
    train = TrainConfig()
    graphdef, state, batch = _train_inputs(c, check, train, *train_check_tokens(scale))
    grads = jax.jit(lambda s, b: compute_gradients(graphdef, train, s, b)[::2])

    def lower_check():
        with jax.default_matmul_precision("highest"):
            return grads.lower(state, batch)

    out = [c.figure(TRAIN_CHECK, [c.plan("gradients float32", lower_check)])]
    shape = scale.train_shape
    layers = train_layers(shape, c.limit)
    config = dataclasses.replace(our_config(shape), num_hidden_layers=layers)
    model = _model(shape, jnp.bfloat16, jnp.float32, config)
    train = train_config(scale)
    graphdef, state, batch = _train_inputs(c, model, train, 1, scale.train_tokens)
    step = make_train_step(graphdef, train, donate=True)
    plan = c.plan(f"train ({layers} layers)", lambda: step.lower(state, batch))
    predicted = train_prediction(config, c.target.gpu, scale)
    name = train_name(scale)
    return out + [c.figure(name, [plan], predicted), c.figure(memory_name(name), [plan])]


def rollout_figures(c: _Compiler, scale: Scale) -> list[CompiledFigure]:
    """The rollout's sampler programs at its widest calls: the shared prompts (one row per task,
    rounded up to a row bucket) appended, then every row's observations and decode."""
    from agentrl_jax.sampling import Paging, SamplerPolicy  # noqa: PLC0415
    from agentrl_jax.sampling.scheduler import row_buckets, width_buckets  # noqa: PLC0415

    runner, _ = frozenlake_runner(scale)
    first, after = turn_tokens(runner, scale.rollout_budget)
    if scale.tiny:  # as bench device: a tiny model over the ids FrozenLake uses
        from agentrl_jax.bench.rollout import frozenlake_token_map, tiny_policy_model  # noqa

        token_map = frozenlake_token_map(runner, [scale.rollout_budget])
        model = nnx.eval_shape(lambda: tiny_policy_model(len(token_map)))
        policy_args = {"token_map": token_map}
    else:
        model, policy_args = _model(scale.rollout_shape), {}
    policy = SamplerPolicy(model, device=c.device, paging=Paging(), **policy_args)
    sampler = policy._sampler(runner.settings)  # the very Sampler the rollout builds
    params = c.on_device(nnx.state(model))
    rows, max_len = scale.rollout_tasks * scale.rollout_group, runner.settings.max_context
    widths = width_buckets(max_len)
    width = lambda n: min(w for w in widths if w >= n)  # noqa: E731
    # SamplerPolicy.start: each task's prompt once (when that is at most half the rows)
    shared = min(b for b in row_buckets(rows, 1, policy.row_multiple) if b >= scale.rollout_tasks)
    shared = rows if shared > rows // 2 else shared
    state = _sampler_state(c, sampler, model, shared, max_len, pool_rows=rows)
    plans = [
        _append(c, f"append prompts ({shared} rows)", sampler, params, state, width(max(first)))
    ]
    state = _sampler_state(c, sampler, model, rows, max_len)
    plans.append(_append(c, "append observations", sampler, params, state, width(max(after))))
    plans.append(_decode(c, "decode", sampler, params, state, runner.settings.sampling, True))
    predicted = rollout_prediction(
        model.config, c.target.gpu, scale, float(np.mean(first)), float(np.mean(after))
    )
    return [c.figure(rollout_name(scale), plans, predicted)]


# ---------------------------------------------------------------------------- the run
def figure_names(scale: Scale, part: str) -> list[str]:
    """The figures ``bench device`` prints for ``part`` on a GPU (and this module too)."""
    decode = [(s, b) for s in scale.decode_shapes for b in scale.decode_batches]
    memory = decode_name(scale.decode_shapes[0], MEMORY_DECODE_BATCH)
    return {
        "memory": [memory_name(memory)],
        "logits": [LOGITS.format(shape=scale.logits_shape)],
        "paged_kernel": [PAGED_KERNEL],
        "cudnn_attention": [CUDNN],
        "train_step": [
            TRAIN_CHECK,
            train_name(scale),
            memory_name(train_name(scale)),
        ],
        "decode": [n for s, b in decode for n in (decode_name(s, b), generate_name(s, b))],
        "rollout": [rollout_name(scale)],
    }[part]


STEPS: dict[str, Callable[[_Compiler, Scale], list[CompiledFigure]]] = {
    "memory": memory_figures,
    "logits": logits_figures,
    "paged_kernel": paged_kernel_figures,
    "cudnn_attention": cudnn_figures,
    "train_step": train_step_figures,
    "decode": decode_figures,
    "rollout": rollout_figures,
}


def run(
    gpu: str,
    tiny: bool = False,
    parts: Sequence[str] = PARTS,
    emit: Callable[[CompiledFigure], None] | None = None,
) -> list[CompiledFigure]:
    """Compile ``parts``' programs for one ``gpu`` (a key of :data:`agentrl_jax.plan.GPUS`) in
    this process, which must be a CUDA-compile one (:data:`agentrl_jax.plan.CUDA_COMPILE_ENV`;
    ValueError naming what is missing), each figure passed to ``emit`` as soon as it is
    compiled. A part that raises gives its figures' lines, not compiled, naming the error."""
    from agentrl_jax.models.attention import built_for  # noqa: PLC0415
    from agentrl_jax.plan import cuda_target  # noqa: PLC0415

    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"unknown part(s) {unknown}; known: {', '.join(PARTS)}")
    compiler = _Compiler(cuda_target(gpu, 1))
    scale = TINY if tiny else FULL
    figures: list[CompiledFigure] = []
    for part in PARTS:  # bench device's order
        if part not in parts:
            continue
        try:
            with built_for(compiler.target.platform):
                new = STEPS[part](compiler, scale)
        except Exception as error:  # noqa: BLE001 - the other parts still compile
            message = f"{type(error).__name__}: {error}"
            new = [
                compiler.figure(name, [refused_plan(part, message, compiler.limit)])
                for name in figure_names(scale, part)
            ]
        for figure in new:
            figures.append(figure)
            if emit is not None:
                emit(figure)
    return figures
