"""``agentrl-jax bench device``: the first run on an accelerator, in one short call.

Correctness, speed and memory on whatever device jax finds first (one NVIDIA GPU is the
target; ``--tiny`` runs the same code at tiny shapes on the CPU, which CI does). Nothing is
downloaded: every model is random, built by ``transformers`` (PyTorch) or by us. Each
measurement prints one JSON line, a :class:`Figure`: what it is, its value, the reference it
is compared with, the ratio, and for correctness the tolerance and whether it holds.

Correctness (``ok`` is whether ``value <= tolerance``):

* ``logits``: our Qwen3 against ``transformers`` ``Qwen3ForCausalLM`` on the same random
  float32 checkpoint at Qwen3-0.6B's real shape (28 layers, vocabulary 151,936); the max abs
  logit difference over a batch of random tokens, both at full float32 matmul precision
  (transformers on the GPU when PyTorch sees one, else on the CPU);
* ``paged_kernel``: the Pallas GPU paged-attention kernel against the XLA paged attention it
  replaces in decode (Qwen3's head_dim 128, pages of 16, ragged rows); on a CPU the kernel runs
  in Pallas' interpreter;
* ``cudnn_attention``: cuDNN's fused attention (bfloat16, causal, with padding) against the XLA
  attention on the same inputs; NVIDIA GPUs only (elsewhere the line says it is unavailable);
* ``train_step``: one GRPO update's loss and gradients on the device against the same
  computation on the CPU (same weights and batch, float32 at full matmul precision).

Speed (``ratio`` = value / reference value):

* ``decode``: tokens/s of the decode step (prefill excluded) at batch 1, 8 and 64 for the
  Qwen3-0.6B, -1.7B and -4B shapes with random bfloat16 weights, against the HBM floor: the
  bytes each step must read (parameters and the cache so far) over the device's measured copy
  bandwidth;
* ``generate``: tokens/s of prefill + decode against PyTorch ``transformers`` ``generate``
  (greedy, same shape, bfloat16, same device) where PyTorch sees the device;
* ``train step``: one GRPO update (policy forward and backward, reference forward, AdamW,
  full rematerialisation, float32 parameters computing in bfloat16) at the Qwen3-4B shape on
  one row of 8,192 tokens, tokens/s and MFU against the chip's dense bfloat16 peak (known for
  H100, H200, A100). The whole 4B's float32 train state (80 GB) does not fit one 80 GB GPU
  beside its activations, so it keeps as many of the 36 layers as fill half the memory jax
  may use (``train_layers``; jax's default limit is 75% of the device); the count is in the
  line;
* ``rollout``: turns/s of the rollout engine (paged cache) on FrozenLake (real tokenizer and
  chat template) with a random Qwen3 of the 0.6B shape, against the same rollouts one task group
  at a time.

On a GPU of :data:`agentrl_jax.plan.GPUS` (H100, H200, A100) the decode, train-step and rollout
figures also carry, in ``settings``, ``predicted``: the roofline of the same shape
(:mod:`agentrl_jax.plan.roofline`: decode at the steps' mean cache, ``prompt + new / 2``
tokens; the update with its KL reference and remat; the rollout with every row playing every
turn, at the measured prompt and observation tokens), and ``of_predicted``: measured over
predicted, the share of the bound reached. Elsewhere (a CPU) both are null.

Memory (``ratio`` = measured / predicted): the peak that :mod:`agentrl_jax.plan` predicts for the
train step and for decode (the compiler's memory analysis of the very programs that run)
against the allocator's measured peak (``Device.memory_stats``; the CPU has none, so there the
line carries the prediction alone).

``--compile-only h100`` runs nothing: it compiles these figures' programs for a GPU that is not
there (:mod:`agentrl_jax.bench.compile_only`), one line per figure under the same names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import tempfile
import time
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from agentrl_jax.bench.forward import CONFIGS as MODEL_SHAPES
from agentrl_jax.plan import roofline
from agentrl_jax.plan.roofline import Prediction, layer_matmul_parameters, model_flops_per_token
from agentrl_jax.plan.targets import GpuSpec, gpu_spec

PARTS = ("memory", "logits", "paged_kernel", "cudnn_attention", "train_step", "decode", "rollout")

TINY_DIMS = dict(MODEL_SHAPES["tiny"], vocab_size=512)


@dataclasses.dataclass(frozen=True)
class Figure:
    """One measured figure and what it is compared with."""

    figure: str  # e.g. "decode qwen3-0.6b batch 8"
    kind: str  # "correctness", "speed" or "memory"
    value: float | None
    unit: str
    reference: str  # what value is compared with
    reference_value: float | None
    tolerance: float | None = None  # correctness: value must be <= tolerance
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool | None:
        if self.kind == "correctness" and "error" in self.settings:
            return False  # the check raised
        if self.kind != "correctness" or self.value is None or self.tolerance is None:
            return None
        return bool(self.value <= self.tolerance)

    @property
    def ratio(self) -> float | None:
        if self.kind == "correctness" or self.value is None or not self.reference_value:
            return None
        return float(self.value / self.reference_value)

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "ok": self.ok, "ratio": self.ratio})


@dataclasses.dataclass(frozen=True)
class Scale:
    """The shapes a run uses: the real ones on an accelerator, tiny ones with ``--tiny``."""

    tiny: bool
    logits_shape: str
    decode_shapes: tuple[str, ...]
    decode_batches: tuple[int, ...]
    prompt_len: int
    new_tokens: int
    train_shape: str
    train_tokens: int
    rollout_shape: str
    rollout_tasks: int
    rollout_group: int
    rollout_budget: int
    repeats: int


FULL = Scale(False, "qwen3-0.6b", ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b"), (1, 8, 64),
             128, 128, "qwen3-4b", 8192, "qwen3-0.6b", 16, 16, 20, 3)  # fmt: skip
TINY = Scale(True, "tiny", ("tiny",), (1, 8, 64), 16, 16, "tiny", 256, "tiny", 2, 4, 6, 2)


def our_config(shape: str):
    """The :class:`~agentrl_jax.models.Qwen3Config` of a shape name (tiny, qwen3-0.6b ..
    qwen3-8b)."""
    from agentrl_jax.models.config import Qwen3Config, qwen3_config  # noqa: PLC0415

    return Qwen3Config(**TINY_DIMS) if shape == "tiny" else qwen3_config(shape)


def dims(shape: str) -> dict[str, Any]:
    """``transformers.Qwen3Config`` fields of a shape name: the same model's config.json."""
    return our_config(shape).to_hf_dict()


def device_name(device: Any = None) -> str:
    device = device or jax.devices()[0]
    return f"{device.platform}:{device.device_kind}"


# ---------------------------------------------------------------------------- names
# One place for the figures' names: ``--compile-only`` (agentrl_jax.bench.compile_only) prints
# the same ones, so its lines join this run's.
LOGITS = "logits {shape} vs transformers"
PAGED_KERNEL = "paged attention: Pallas GPU kernel vs XLA"
CUDNN = "attention: cuDNN vs XLA"
TRAIN_CHECK = "train step: loss and gradients vs CPU"


def decode_name(shape: str, batch: int) -> str:
    return f"decode {shape} batch {batch}"


def generate_name(shape: str, batch: int) -> str:
    return f"generate {shape} batch {batch}"


def train_name(scale: Scale) -> str:
    return f"train step {scale.train_shape} L {scale.train_tokens}"


def memory_name(name: str) -> str:
    """The memory figure of the program behind figure ``name`` (e.g. a decode's)."""
    return f"memory {name}: measured vs plan"


def rollout_name(scale: Scale) -> str:
    return (
        f"rollout FrozenLake {scale.rollout_shape}, {scale.rollout_tasks} tasks x G "
        f"{scale.rollout_group}"
    )


MEMORY_DECODE_BATCH = 64  # the memory figure's decode program: the widest decode batch
ROLLOUT_RESPONSE_TOKENS = 8  # the rollout figure's max_response_tokens
ROLLOUT_CONTEXT = 1536  # and its max_context


# ---------------------------------------------------------------------------- predicted
def gpu_here() -> GpuSpec | None:
    """The :class:`~agentrl_jax.plan.GpuSpec` of the device measured (jax's first), None where
    it is not a GPU of :data:`agentrl_jax.plan.GPUS` (a CPU): no roofline there."""
    return gpu_spec(jax.devices()[0].device_kind)


def decode_prediction(config, spec: GpuSpec, batch: int, scale: Scale) -> Prediction:
    """The roofline of a decode figure: ``batch`` rows at the mean cache length of its steps,
    ``prompt_len + new_tokens / 2`` tokens."""
    return roofline.decode_step(config, spec, batch, scale.prompt_len + scale.new_tokens / 2)


def train_prediction(config, spec: GpuSpec, scale: Scale, rows: int = 1) -> Prediction:
    """The roofline of the train-step figure (``config`` with the layers it keeps): ``rows`` rows
    of ``train_tokens``, a KL reference, full rematerialisation."""
    return roofline.train_step(config, spec, rows, scale.train_tokens, reference=True, remat=True)


def rollout_prediction(
    config, spec: GpuSpec, scale: Scale, prompt_tokens: float, observation_tokens: float
) -> Prediction:
    """The roofline of the rollout figure: every row (tasks x G) playing every turn of the
    budget, ``ROLLOUT_RESPONSE_TOKENS`` a response, the measured prompt and observation
    tokens (:func:`turn_tokens`)."""
    return roofline.rollout_turns(
        config, spec, scale.rollout_tasks * scale.rollout_group, turns=scale.rollout_budget,
        response_tokens=ROLLOUT_RESPONSE_TOKENS, observation_tokens=round(observation_tokens),
        prompt_tokens=round(prompt_tokens), max_context=ROLLOUT_CONTEXT,
    )  # fmt: skip


def against(prediction: Prediction | None, measured: float | None) -> dict[str, Any]:
    """A speed figure's ``settings`` entries ``predicted`` (the roofline's
    :meth:`~agentrl_jax.plan.roofline.Prediction.to_dict`) and ``of_predicted`` (measured over
    predicted value: the share of the bound reached); both None without a prediction (a CPU)."""
    if prediction is None:
        return {"predicted": None, "of_predicted": None}
    share = None if measured is None else float(measured / prediction.value)
    return {"predicted": prediction.to_dict(), "of_predicted": share}


def _sync(tree: Any) -> Any:
    return jax.block_until_ready(tree)


def _median(fn: Callable[[], float], repeats: int) -> float:
    fn()  # compiles, warms
    return float(np.median([fn() for _ in range(repeats)]))


def _torch_device():
    """``"cuda"`` when PyTorch sees a GPU, else ``"cpu"``; None without PyTorch."""
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return None
    return "cuda" if torch.cuda.is_available() else "cpu"


# ---------------------------------------------------------------------------- correctness
def logits_tokens(scale: Scale) -> tuple[int, int]:
    """Rows and tokens of the logits figure's batch."""
    return (2, 16) if scale.tiny else (2, 64)


def logits_figure(scale: Scale, seed: int = 0) -> Figure:
    """Our float32 logits against transformers' on the same random checkpoint."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    from agentrl_jax.models import load_qwen3, positions_from_mask  # noqa: PLC0415

    where = _torch_device()
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(**dims(scale.logits_shape))
    hf = transformers.Qwen3ForCausalLM(config).eval()
    rng = np.random.default_rng(seed)
    batch, length = logits_tokens(scale)
    tokens = rng.integers(0, config.vocab_size, (batch, length))
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        ours = load_qwen3(folder)
    torch.backends.cuda.matmul.allow_tf32 = False
    hf = hf.to(where)
    with torch.no_grad():
        want = hf(torch.tensor(tokens, device=where)).logits.float().cpu().numpy()
    del hf
    mask = jnp.ones(tokens.shape, bool)
    with jax.default_matmul_precision("highest"):
        got, _ = ours(jnp.asarray(tokens), positions_from_mask(mask), mask)
    got = np.asarray(got)
    return Figure(
        LOGITS.format(shape=scale.logits_shape),
        "correctness",
        float(np.abs(got - want).max()),
        "max abs logit difference",
        f"transformers Qwen3ForCausalLM float32 on {where}, same random checkpoint",
        float(np.abs(want).max()),
        tolerance=2e-3,
        settings={
            "shape": scale.logits_shape,
            "batch": batch,
            "length": length,
            "logit_std": float(want.std()),
        },  # fmt: skip
    )


# the paged-kernel figure's batch, heads, KV heads, layers, pages, page size, pages a row, head_dim
PAGED_SHAPE = (8, 16, 8, 2, 96, 16, 8, 128)
PAGED_BLOCK_PAGES = 2


def paged_kernel_figure(seed: int = 0) -> Figure:
    """The Pallas GPU paged-attention kernel against the XLA paged attention."""
    from agentrl_jax.models import paged_cache, paged_kernels  # noqa: PLC0415

    on_gpu = jax.default_backend() in ("gpu", "cuda")
    rng = np.random.default_rng(seed)
    batch, heads, kv_heads, layers, pages, size, per_row, hd = PAGED_SHAPE
    pools = [
        jnp.asarray(rng.normal(size=(kv_heads, layers, pages, size, hd)), jnp.float32)
        for _ in range(2)
    ]
    lengths = rng.integers(1, per_row * size + 1, batch).astype(np.int32)
    table = np.full((batch, per_row), pages, np.int32)
    order, used = rng.permutation(pages), 0
    for b, n in enumerate(lengths):
        need = -(-int(n) // size)
        table[b, :need] = order[used : used + need]
        used += need
    q = jnp.asarray(rng.normal(size=(batch, heads, hd)), jnp.float32)
    with jax.default_matmul_precision("highest"):
        want = paged_cache.paged_attention(
            q[:, None], *pools, 1, jnp.asarray(table), jnp.asarray(lengths)[:, None],
            block_pages=PAGED_BLOCK_PAGES,
        )[:, 0]  # fmt: skip
        got = paged_kernels.decode_attention(
            "pallas_gpu", q, *pools, 1, jnp.asarray(table), jnp.asarray(lengths),
            block_pages=PAGED_BLOCK_PAGES, interpret=not on_gpu,
        )  # fmt: skip
    return Figure(
        PAGED_KERNEL,
        "correctness",
        float(jnp.abs(got - want).max()),
        "max abs difference",
        "XLA paged attention (agentrl_jax.models.paged_cache), same pool and page table",
        float(jnp.abs(want).max()),
        tolerance=1e-4 if on_gpu else 2e-6,
        settings={
            "interpret": not on_gpu,
            "head_dim": hd,
            "page_size": size,
            "lengths": lengths.tolist(),
        },  # fmt: skip
    )


CUDNN_SHAPE = (2, 512, 16, 8, 128)  # the cuDNN figure's batch, length, heads, KV heads, head_dim


def cudnn_figure(seed: int = 0) -> Figure:
    """cuDNN's fused attention against the XLA attention (bfloat16, causal, padded rows)."""
    from agentrl_jax.models.attention import attention  # noqa: PLC0415

    reference = "XLA attention (agentrl_jax.models.attention), same bfloat16 inputs"
    if jax.default_backend() not in ("gpu", "cuda"):
        return Figure(CUDNN, "correctness", None, "max abs difference",
                      reference, None, tolerance=2e-2,
                      settings={"unavailable": f"cuDNN needs an NVIDIA GPU, this is "
                                               f"{device_name()}"})  # fmt: skip
    rng = np.random.default_rng(seed)
    b, length, heads, kv, hd = CUDNN_SHAPE
    q, k, v = (
        jnp.asarray(rng.normal(size=(b, length, n, hd)), jnp.bfloat16) for n in (heads, kv, kv)
    )
    valid = jnp.asarray(np.arange(length)[None] < np.array([[length], [length - 100]]))
    got = attention(q, k, v, None, valid, implementation="cudnn").astype(jnp.float32)
    want = attention(q, k, v, None, valid, implementation="xla").astype(jnp.float32)
    rows = valid[:, :, None, None]  # padded queries' outputs are discarded by every caller
    diff = jnp.where(rows, jnp.abs(got - want), 0.0)
    return Figure(CUDNN, "correctness", float(diff.max()),
                  "max abs difference", reference, float(jnp.abs(want).max()), tolerance=2e-2,
                  settings={"batch": b, "length": length, "heads": heads, "kv_heads": kv,
                            "head_dim": hd})  # fmt: skip


def _train_batch(rows: int, tokens: int, vocab: int, seed: int = 0):
    from agentrl_jax.bench.train_step import synthetic_batch  # noqa: PLC0415
    from agentrl_jax.train import TrainBatch  # noqa: PLC0415

    return TrainBatch(synthetic_batch(rows, tokens, vocab, seed))


def train_check_config(scale: Scale):
    """The train-step check's model: the 0.6B shape cut to 2 layers (the CPU side stays
    seconds), float32."""
    if scale.tiny:
        return our_config("tiny")
    return dataclasses.replace(our_config("qwen3-0.6b"), num_hidden_layers=2)


def train_check_tokens(scale: Scale) -> tuple[int, int]:
    """Rows and tokens of the train-step check's batch."""
    return (4, 64) if scale.tiny else (4, 256)


def train_step_figure(scale: Scale, seed: int = 0) -> Figure:
    """One GRPO update's loss and gradients on the device against the same on the CPU."""
    from agentrl_jax.models import Qwen3ForCausalLM  # noqa: PLC0415
    from agentrl_jax.train import TrainConfig, init_train_state  # noqa: PLC0415
    from agentrl_jax.train.step import compute_gradients  # noqa: PLC0415

    config = train_check_config(scale)
    model = Qwen3ForCausalLM(config, rngs=nnx.Rngs(seed))
    train = TrainConfig()
    state = init_train_state(model, train)
    batch = _train_batch(*train_check_tokens(scale), config.vocab_size, seed)
    graphdef = nnx.graphdef(model)
    grads = jax.jit(lambda s, b: compute_gradients(graphdef, train, s, b)[::2])
    cpu = jax.devices("cpu")[0]
    out = {}
    with jax.default_matmul_precision("highest"):
        for name, device in (("device", jax.devices()[0]), ("cpu", cpu)):
            g, metrics = grads(jax.device_put(state, device), jax.device_put(batch, device))
            out[name] = (jax.device_get(g), float(metrics["loss"]))
    (g_dev, loss_dev), (g_cpu, loss_cpu) = out["device"], out["cpu"]
    scale_g = max(float(np.abs(x).max()) for x in jax.tree.leaves(g_cpu))
    diff = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(g_dev),
                                                            jax.tree.leaves(g_cpu)))  # fmt: skip
    return Figure(
        TRAIN_CHECK,
        "correctness",
        max(diff / scale_g, abs(loss_dev - loss_cpu) / max(abs(loss_cpu), 1e-6)),
        "max relative difference (gradients: over the largest gradient; loss)",
        "the same GRPO update's compute_gradients on the CPU, float32",
        0.0,
        tolerance=1e-4,
        settings={
            "loss": loss_dev,
            "cpu_loss": loss_cpu,
            "grad_max_abs_diff": diff,
            "grad_max_abs": scale_g,
            "layers": config.num_hidden_layers,
            "device": device_name(),
        },  # fmt: skip
    )


# ---------------------------------------------------------------------------- memory
@contextlib.contextmanager
def measured_peak(arguments: int) -> Iterator[dict[str, Any]]:
    """The allocator's peak while the block runs one program, as that program's own: the peak
    minus what was in use on entry plus the program's ``arguments`` bytes (already in use on
    entry). ``out["bytes"]`` is None on devices without memory statistics (the CPU) or when an
    earlier, higher peak in this process hides this one."""
    device = jax.devices()[0]
    before = device.memory_stats()
    out: dict[str, Any] = {"bytes": None}
    yield out
    after = device.memory_stats()
    if not (before and after):
        out["unavailable"] = f"{device_name(device)} reports no memory statistics"
    elif after["peak_bytes_in_use"] > before["peak_bytes_in_use"]:
        out["bytes"] = int(after["peak_bytes_in_use"] - before["bytes_in_use"] + arguments)
    else:
        out["hidden"] = "an earlier, higher peak in this process hides this program's"


def _memory_figure(name: str, predicted: Any, measured: dict[str, Any], settings) -> Figure:
    return Figure(
        memory_name(name),
        "memory",
        None if measured["bytes"] is None else float(measured["bytes"]),
        "bytes",
        "agentrl_jax.plan's predicted peak (plan.analyse: the compiler's memory analysis of "
        "this very program)",
        float(predicted.peak),
        settings={
            **settings,
            "predicted_arguments": predicted.arguments,
            "predicted_temporaries": predicted.temporaries,
            **{k: v for k, v in measured.items() if k != "bytes"},
        },  # fmt: skip
    )


def _device_memory() -> float:
    stats = jax.devices()[0].memory_stats() or {}
    return float(stats.get("bytes_limit", 80 * 1024**3))


def decode_memory_figure(scale: Scale, batch: int = MEMORY_DECODE_BATCH) -> Figure:
    """Plan's figure for the decode program (cache for ``prompt + new`` tokens) against the
    measured peak of the same compiled program."""
    from agentrl_jax.plan import analyse  # noqa: PLC0415
    from agentrl_jax.sampling import SamplingConfig  # noqa: PLC0415

    shape = scale.decode_shapes[0]
    model = _random_model(shape)
    max_len = scale.prompt_len + scale.new_tokens
    greedy = SamplingConfig(temperature=0.0)
    sampler, params, prompt = _decoder(model, batch, scale)
    state = _sync(sampler.append(params, sampler.init(batch, max_len), *prompt))
    key = jax.random.key(0)
    compiled = sampler.lower_decode(params, state, key, greedy).compile()
    predicted = analyse("decode", compiled, _device_memory(), 0.0)
    args = sampler._decode_args(params, state, key, None, None)
    with measured_peak(predicted.arguments) as measured:
        _sync(compiled(*args))
    return _memory_figure(decode_name(shape, batch), predicted, measured,
                          {"shape": shape, "batch": batch, "max_len": max_len})  # fmt: skip


# ---------------------------------------------------------------------------- speed
def _random_model(shape: str, seed: int = 0, param_dtype=jnp.bfloat16, layers: int | None = None):
    """A random Qwen3 of ``shape`` computing in bfloat16 (``layers`` of its layers)."""
    from agentrl_jax.models import Qwen3ForCausalLM  # noqa: PLC0415

    config = our_config(shape)
    if layers is not None:
        config = dataclasses.replace(config, num_hidden_layers=layers)
    return Qwen3ForCausalLM(
        config, dtype=jnp.bfloat16, param_dtype=param_dtype, rngs=nnx.Rngs(seed)
    )


def train_config(scale: Scale):
    """The train-step figure's :class:`~agentrl_jax.train.TrainConfig`: full rematerialisation,
    ``attention: auto`` (cuDNN on an NVIDIA GPU; XLA's at tiny shapes)."""
    from agentrl_jax.train import RLConfig, TrainConfig  # noqa: PLC0415

    return TrainConfig(rl=RLConfig(remat="full", attention="xla" if scale.tiny else "auto"))


def train_layers(shape: str, memory_bytes: float) -> int:
    """The layers of ``shape`` whose float32 train state (parameters, gradients, two AdamW
    moments and the KL reference: 20 bytes a parameter) fills at most half the device."""
    config = our_config(shape)
    per_layer = layer_matmul_parameters(config)
    embed = config.hidden_size * config.vocab_size * (1 if config.tie_word_embeddings else 2)
    fit = int((memory_bytes / 2 / 20 - embed) // per_layer)
    return max(1, min(config.num_hidden_layers, fit))


def _decoder(model, batch: int, scale: Scale):
    from agentrl_jax.sampling import Sampler, pad_rows  # noqa: PLC0415

    rng = np.random.default_rng(batch)
    prompts = [
        rng.integers(0, model.config.vocab_size, scale.prompt_len).tolist() for _ in range(batch)
    ]
    sampler = Sampler(model, max_new_tokens=scale.new_tokens, stop_token_ids=())
    return sampler, nnx.state(model), pad_rows(prompts, scale.prompt_len)


def copy_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes read + written per second by a large on-device copy, best of ``repeats``."""
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 1)
    _sync(copy(x))
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        _sync(copy(x))
        best = min(best, time.perf_counter() - start)
    return 2 * x.nbytes / best


def _parameter_bytes(params) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))


def decode_figures(scale: Scale, bandwidth: float) -> list[Figure]:
    """Decode tokens/s against the HBM floor, generate tokens/s against transformers."""
    from agentrl_jax.sampling import SamplingConfig  # noqa: PLC0415

    greedy = SamplingConfig(temperature=0.0)
    spec = gpu_here()
    out = []
    for shape in scale.decode_shapes:
        model = _random_model(shape)
        config = model.config
        param_bytes = _parameter_bytes(nnx.state(model))
        for batch in scale.decode_batches:
            sampler, params, prompt = _decoder(model, batch, scale)
            max_len = scale.prompt_len + scale.new_tokens

            def decode_only() -> float:
                state = _sync(sampler.append(params, sampler.init(batch, max_len), *prompt))
                start = time.perf_counter()
                _sync(sampler.decode(params, state, jax.random.key(0), greedy))
                return (time.perf_counter() - start) / scale.new_tokens

            def generate() -> float:
                start = time.perf_counter()
                state = sampler.append(params, sampler.init(batch, max_len), *prompt)
                _sync(sampler.decode(params, state, jax.random.key(0), greedy))
                return time.perf_counter() - start

            step_s = _median(decode_only, scale.repeats)
            # a step reads every weight and the cache so far (K and V, bfloat16), on average
            # half way through the new tokens
            cached = scale.prompt_len + scale.new_tokens / 2
            cache_bytes = (
                2 * batch * cached * config.num_hidden_layers * config.num_key_value_heads
                * config.head_dim * 2
            )  # fmt: skip
            floor_s = (param_bytes + cache_bytes) / bandwidth
            settings = {"shape": shape, "batch": batch, "prompt_len": scale.prompt_len,
                        "new_tokens": scale.new_tokens, "param_bytes": param_bytes,
                        "copy_bandwidth_bytes_per_s": bandwidth, "step_ms": step_s * 1e3,
                        "device": device_name()}  # fmt: skip
            prediction = None if spec is None else decode_prediction(config, spec, batch, scale)
            out.append(Figure(decode_name(shape, batch), "speed", batch / step_s,
                              "tokens/s", "HBM floor: (parameter + cache bytes) per step over "
                              "the measured copy bandwidth", batch / floor_s,
                              settings={**settings,
                                        **against(prediction, batch / step_s)}))  # fmt: skip
            ours_s = _median(generate, scale.repeats)
            theirs_s = _transformers_generate_s(shape, prompt, scale)
            tokens = batch * scale.new_tokens
            out.append(Figure(generate_name(shape, batch), "speed", tokens / ours_s,
                              "tokens/s", f"PyTorch transformers generate (greedy, bfloat16, "
                              f"{_torch_device()}, same shape)",
                              None if theirs_s is None else tokens / theirs_s,
                              settings={**settings, "ours_s": ours_s,
                                        "transformers_s": theirs_s}))  # fmt: skip
    return out


def _transformers_generate_s(shape: str, prompt, scale: Scale) -> float | None:
    """Median seconds of transformers' greedy ``generate`` at ``shape`` (random bfloat16
    weights) on the device PyTorch sees; None without PyTorch."""
    where = _torch_device()
    if where is None:
        return None
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    config = transformers.Qwen3Config(**dims(shape))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(where):
            hf = transformers.Qwen3ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    tokens = torch.tensor(np.asarray(prompt[0]), dtype=torch.long, device=where)
    mask = torch.tensor(np.asarray(prompt[1]), dtype=torch.long, device=where)

    def run() -> float:
        if where == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            hf.generate(tokens, attention_mask=mask, do_sample=False,
                        max_new_tokens=scale.new_tokens, min_new_tokens=scale.new_tokens,
                        eos_token_id=None, pad_token_id=0)  # fmt: skip
        if where == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    seconds = _median(run, scale.repeats)
    if where == "cuda":
        torch.cuda.empty_cache()
    return seconds


def train_figures(scale: Scale) -> list[Figure]:
    """One GRPO update at the train shape: tokens/s, MFU; plan's peak against the measured."""
    from agentrl_jax.plan import analyse  # noqa: PLC0415
    from agentrl_jax.train import init_train_state  # noqa: PLC0415
    from agentrl_jax.train.jitted_step import make_train_step  # noqa: PLC0415

    shape, length = scale.train_shape, scale.train_tokens
    layers = train_layers(shape, _device_memory())
    model = _random_model(shape, param_dtype=jnp.float32, layers=layers)
    train = train_config(scale)
    attention = train.rl.attention
    state = init_train_state(model, train)
    step = make_train_step(nnx.graphdef(model), train, donate=True)
    batch = step.place(_train_batch(1, length, model.config.vocab_size), state)
    tokens = int(np.asarray(batch.trajectory.token_mask).sum())
    compiled = step.lower(state, batch).compile()
    predicted = analyse("train", compiled, _device_memory(), 0.0)
    with measured_peak(predicted.arguments) as measured:  # the step's own calling convention
        new, metrics = compiled(state.replace(base=None), batch, state.base)
        state = new.replace(base=state.base)
        _sync(metrics)

    def update() -> float:
        nonlocal state
        start = time.perf_counter()
        state, m = step(state, batch)
        _sync(m)
        return time.perf_counter() - start

    seconds = _median(update, scale.repeats)
    # policy forward + backward (3x forward) and the reference forward: 4x forward FLOPs
    flops = 4 * model_flops_per_token(model.config, length) * length
    spec = gpu_here()
    peak = None if spec is None else spec.peak_bf16_flops
    prediction = None if spec is None else train_prediction(model.config, spec, scale)
    settings = {"shape": shape, "layers": layers, "length": length, "rows": 1,
                "remat": "full", "attention": attention, "param_dtype": "float32",
                "compute_dtype": "bfloat16", "update_s": seconds,
                "model_flops": flops, "device": device_name()}  # fmt: skip
    del state
    return [
        Figure(
            train_name(scale),
            "speed",
            tokens / seconds,
            "tokens/s",
            "the chip's dense bfloat16 peak, as tokens/s at these model FLOPs",
            None if peak is None else peak * tokens / flops,
            settings={
                **settings,
                "mfu": None if peak is None else flops / seconds / peak,
                "peak_flops": peak,
                **against(prediction, tokens / seconds),
            },
        ),  # fmt: skip
        _memory_figure(train_name(scale), predicted, measured, settings),
    ]


def frozenlake_runner(scale: Scale, seed: int = 0):
    """The rollout figure's FrozenLake runner (real tokenizer and chat template, 4x4 maps,
    budget and group of ``scale``) and the key of its rollouts."""
    from agentrl_jax.models.tokenizer import load_tokenizer  # noqa: PLC0415
    from agentrl_jax.rollout import MultiTurnRollout, RolloutConfig  # noqa: PLC0415
    from envs.frozenlake import maps as fl_maps  # noqa: PLC0415
    from envs.frozenlake.text_env import FrozenLakeTextConfig, FrozenLakeTextEnv  # noqa: PLC0415

    budget = scale.rollout_budget
    key_maps, key_run = jax.random.split(jax.random.key(seed))
    env = FrozenLakeTextEnv(fl_maps.generate(key_maps, scale.rollout_tasks, size=4),
                            FrozenLakeTextConfig(t_max=budget))  # fmt: skip
    config = RolloutConfig(group_size=scale.rollout_group, budget=budget,
                           max_response_tokens=ROLLOUT_RESPONSE_TOKENS,
                           max_context=ROLLOUT_CONTEXT)  # fmt: skip
    return MultiTurnRollout(env, load_tokenizer(), config), key_run


def turn_tokens(runner, budget: int) -> tuple[list[int], list[int]]:
    """Tokens of each task's first prompt (system, rules, the first grid) and of the message
    that follows a response on its first grid (closing the response, the next user turn), as
    ``runner`` builds them: what a rollout of ``runner`` prefills, turn after turn."""
    from envs.protocol import cut_observation  # noqa: PLC0415

    tasks = np.arange(runner.env.num_tasks())
    _, observations = runner.env.reset(tasks, 0)
    chat, prompt = runner.chat, runner.config.prompt
    first, after = [], []
    for text in observations:
        text = cut_observation(text, runner.observation_chars)
        system = prompt.system_text(runner.instructions, budget)
        first.append(len(chat.first_prompt(system, prompt.turn_text(text, budget, 0))))
        user = prompt.turn_text(text, budget, 1)
        after.append(len(chat.close_response([])) + len(chat.next_prompt(user)))
    return first, after


def rollout_figure(scale: Scale, seed: int = 0) -> Figure:
    """The rollout engine's turns/s on FrozenLake against one task group at a time."""
    from agentrl_jax.sampling import Paging, SamplerPolicy  # noqa: PLC0415

    budget = scale.rollout_budget
    runner, key_run = frozenlake_runner(scale, seed)
    if scale.tiny:
        from agentrl_jax.bench.rollout import frozenlake_token_map, tiny_policy_model  # noqa

        token_map = frozenlake_token_map(runner, [budget])
        model, policy_args = tiny_policy_model(len(token_map), seed), {"token_map": token_map}
    else:
        model, policy_args = _random_model(scale.rollout_shape), {}
    policy = SamplerPolicy(model, paging=Paging(), **policy_args)
    tasks = np.arange(scale.rollout_tasks)

    def timed(run: Callable[[], list]) -> tuple[float, int]:
        run()  # compiles
        start = time.perf_counter()
        results = run()
        seconds = time.perf_counter() - start
        return seconds, sum(r.stats.turns_played for r in results)

    batched_s, turns = timed(lambda: [runner(policy, tasks, key_run)])
    one_s, one_turns = timed(
        lambda: [
            runner(policy, tasks[k : k + 1], jax.random.fold_in(key_run, k))
            for k in range(len(tasks))
        ]  # fmt: skip
    )
    first, after = turn_tokens(runner, budget)
    prompt_tokens, observation_tokens = float(np.mean(first)), float(np.mean(after))
    spec = gpu_here()
    prediction = None if spec is None else rollout_prediction(
        model.config, spec, scale, prompt_tokens, observation_tokens
    )  # fmt: skip
    return Figure(
        rollout_name(scale),
        "speed",
        turns / batched_s,
        "turns/s",
        "the same rollouts one task group (G rows) at a time",
        one_turns / one_s,
        settings={
            "budget": budget,
            "max_response_tokens": ROLLOUT_RESPONSE_TOKENS,
            "paged": True,
            "turns": turns,
            "seconds": batched_s,
            "prompt_tokens": prompt_tokens,
            "observation_tokens": observation_tokens,
            "device": device_name(),
            **against(prediction, turns / batched_s),
        },  # fmt: skip
    )


# ---------------------------------------------------------------------------- the run
def failed(part: str, kind: str, error: BaseException) -> Figure:
    """The line of a part that raised, naming the error: no value; a correctness part is
    then not ok (:attr:`Figure.ok`)."""
    message = f"{type(error).__name__}: {error}".splitlines()[0][:500]
    return Figure(
        f"{part} ({kind}): failed",
        kind,
        None,
        "-",
        "-",
        None,
        settings={"error": message, "device": device_name()},
    )


def run(
    tiny: bool = False, parts: Sequence[str] = PARTS, emit: Callable[[Figure], None] | None = None
) -> list[Figure]:
    """Every figure of the module docstring for ``parts``, each passed to ``emit`` as soon as
    it is measured (a long run shows its lines as they come). Memory first: a program's peak is
    measurable only while no earlier program's was higher."""
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"unknown part(s) {unknown}; known: {', '.join(PARTS)}")
    scale = TINY if tiny else FULL
    figures: list[Figure] = []

    def add(new: Figure | list[Figure]) -> None:
        for figure in new if isinstance(new, list) else [new]:
            figures.append(figure)
            if emit is not None:
                emit(figure)

    steps: list[tuple[str, str, Callable[[], Figure | list[Figure]]]] = [
        ("memory", "memory", lambda: decode_memory_figure(scale)),
        ("logits", "correctness", lambda: logits_figure(scale)),
        ("paged_kernel", "correctness", paged_kernel_figure),
        ("cudnn_attention", "correctness", cudnn_figure),
        ("train_step", "correctness", lambda: train_step_figure(scale)),
        ("train_step", "speed", lambda: train_figures(scale)),
        (
            "decode",
            "speed",
            lambda: decode_figures(scale, copy_bandwidth(1 << 24 if tiny else 1 << 30)),
        ),
        ("rollout", "speed", lambda: rollout_figure(scale)),
    ]
    for part, kind, measure in steps:
        if part not in parts:
            continue
        try:
            add(measure())
        except Exception as error:  # one line, and the other parts still run
            add(failed(part, kind, error))
    return figures
