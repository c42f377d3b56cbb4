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

Memory (``ratio`` = measured / predicted): the peak that :mod:`agentrl_jax.plan` predicts for the
train step and for decode (the compiler's memory analysis of the very programs that run)
against the allocator's measured peak (``Device.memory_stats``; the CPU has none, so there the
line carries the prediction alone).
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

PARTS = ("memory", "logits", "paged_kernel", "cudnn_attention", "train_step", "decode", "rollout")

# Dense bfloat16 peak FLOP/s by device kind (NVIDIA's data sheets, SXM parts).
PEAK_BF16_FLOPS = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}

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
    from agentrl_jax.models import Qwen3Config  # noqa: PLC0415
    from agentrl_jax.plan import qwen3_config  # noqa: PLC0415

    return Qwen3Config(**TINY_DIMS) if shape == "tiny" else qwen3_config(shape)


def dims(shape: str) -> dict[str, Any]:
    """``transformers.Qwen3Config`` fields of a shape name: the same model's config.json."""
    return our_config(shape).to_hf_dict()


def layer_matmul_parameters(config) -> int:
    """The parameters of one layer's matmuls: q, k, v, o and the three MLP projections."""
    d, f = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    return d * (q + 2 * kv) + q * d + 3 * d * f


def device_name(device: Any = None) -> str:
    device = device or jax.devices()[0]
    return f"{device.platform}:{device.device_kind}"


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
    batch, length = (2, 64) if not scale.tiny else (2, 16)
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
        f"logits {scale.logits_shape} vs transformers",
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


def paged_kernel_figure(seed: int = 0) -> Figure:
    """The Pallas GPU paged-attention kernel against the XLA paged attention."""
    from agentrl_jax.models import paged_cache, paged_kernels  # noqa: PLC0415

    on_gpu = jax.default_backend() in ("gpu", "cuda")
    rng = np.random.default_rng(seed)
    batch, heads, kv_heads, layers, pages, size, per_row, hd = 8, 16, 8, 2, 96, 16, 8, 128
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
            q[:, None], *pools, 1, jnp.asarray(table), jnp.asarray(lengths)[:, None], block_pages=2
        )[:, 0]
        got = paged_kernels.decode_attention(
            "pallas_gpu", q, *pools, 1, jnp.asarray(table), jnp.asarray(lengths),
            block_pages=2, interpret=not on_gpu,
        )  # fmt: skip
    return Figure(
        "paged attention: Pallas GPU kernel vs XLA",
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


def cudnn_figure(seed: int = 0) -> Figure:
    """cuDNN's fused attention against the XLA attention (bfloat16, causal, padded rows)."""
    from agentrl_jax.models.attention import attention  # noqa: PLC0415

    reference = "XLA attention (agentrl_jax.models.attention), same bfloat16 inputs"
    if jax.default_backend() not in ("gpu", "cuda"):
        return Figure("attention: cuDNN vs XLA", "correctness", None, "max abs difference",
                      reference, None, tolerance=2e-2,
                      settings={"unavailable": f"cuDNN needs an NVIDIA GPU, this is "
                                               f"{device_name()}"})  # fmt: skip
    rng = np.random.default_rng(seed)
    b, length, heads, kv, hd = 2, 512, 16, 8, 128
    q, k, v = (
        jnp.asarray(rng.normal(size=(b, length, n, hd)), jnp.bfloat16) for n in (heads, kv, kv)
    )
    valid = jnp.asarray(np.arange(length)[None] < np.array([[length], [length - 100]]))
    got = attention(q, k, v, None, valid, implementation="cudnn").astype(jnp.float32)
    want = attention(q, k, v, None, valid, implementation="xla").astype(jnp.float32)
    rows = valid[:, :, None, None]  # padded queries' outputs are discarded by every caller
    diff = jnp.where(rows, jnp.abs(got - want), 0.0)
    return Figure("attention: cuDNN vs XLA", "correctness", float(diff.max()),
                  "max abs difference", reference, float(jnp.abs(want).max()), tolerance=2e-2,
                  settings={"batch": b, "length": length, "heads": heads, "kv_heads": kv,
                            "head_dim": hd})  # fmt: skip


def _train_batch(rows: int, tokens: int, vocab: int, seed: int = 0):
    from agentrl_jax.bench.train_step import synthetic_batch  # noqa: PLC0415
    from agentrl_jax.train import TrainBatch  # noqa: PLC0415

    return TrainBatch(synthetic_batch(rows, tokens, vocab, seed))


def train_step_figure(scale: Scale, seed: int = 0) -> Figure:
    """One GRPO update's loss and gradients on the device against the same on the CPU."""
    from agentrl_jax.models import Qwen3ForCausalLM  # noqa: PLC0415
    from agentrl_jax.train import TrainConfig, init_train_state  # noqa: PLC0415
    from agentrl_jax.train.step import compute_gradients  # noqa: PLC0415

    config = our_config("tiny" if scale.tiny else "qwen3-0.6b")
    if not scale.tiny:  # the 0.6B shape cut to 2 layers: the CPU side stays seconds
        config = dataclasses.replace(config, num_hidden_layers=2)
    model = Qwen3ForCausalLM(config, rngs=nnx.Rngs(seed))
    train = TrainConfig()
    state = init_train_state(model, train)
    batch = _train_batch(4, 64 if scale.tiny else 256, config.vocab_size, seed)
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
        "train step: loss and gradients vs CPU",
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
        f"memory {name}: measured vs plan",
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


def decode_memory_figure(scale: Scale, batch: int = 64) -> Figure:
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
    return _memory_figure(f"decode {shape} batch {batch}", predicted, measured,
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
            out.append(Figure(f"decode {shape} batch {batch}", "speed", batch / step_s,
                              "tokens/s", "HBM floor: (parameter + cache bytes) per step over "
                              "the measured copy bandwidth", batch / floor_s,
                              settings=settings))  # fmt: skip
            ours_s = _median(generate, scale.repeats)
            theirs_s = _transformers_generate_s(shape, prompt, scale)
            tokens = batch * scale.new_tokens
            out.append(Figure(f"generate {shape} batch {batch}", "speed", tokens / ours_s,
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


def model_flops_per_token(config, length: int) -> float:
    """Forward FLOPs per token: 2 x matmul parameters (the output head included) plus
    causal attention's scores and values (2 x 2 x heads x head_dim x length / 2 per layer)."""
    layers, d = config.num_hidden_layers, config.hidden_size
    matmul = layers * layer_matmul_parameters(config) + d * config.vocab_size
    # (QK^T + PV) x 2 FLOPs x length / 2 (causal) per layer
    attention = layers * 2 * config.num_attention_heads * config.head_dim * length
    return 2 * matmul + attention


def train_figures(scale: Scale) -> list[Figure]:
    """One GRPO update at the train shape: tokens/s, MFU; plan's peak against the measured."""
    from agentrl_jax.plan import analyse  # noqa: PLC0415
    from agentrl_jax.train import RLConfig, TrainConfig, init_train_state  # noqa: PLC0415
    from agentrl_jax.train.step import make_train_step  # noqa: PLC0415

    shape, length = scale.train_shape, scale.train_tokens
    layers = train_layers(shape, _device_memory())
    model = _random_model(shape, param_dtype=jnp.float32, layers=layers)
    attention = "auto" if not scale.tiny else "xla"
    train = TrainConfig(rl=RLConfig(remat="full", attention=attention))
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
    kind = jax.devices()[0].device_kind
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in kind), None)
    settings = {"shape": shape, "layers": layers, "length": length, "rows": 1,
                "remat": "full", "attention": attention, "param_dtype": "float32",
                "compute_dtype": "bfloat16", "update_s": seconds,
                "model_flops": flops, "device": device_name()}  # fmt: skip
    del state
    return [
        Figure(
            f"train step {shape} L {length}",
            "speed",
            tokens / seconds,
            "tokens/s",
            "the chip's dense bfloat16 peak, as tokens/s at these model FLOPs",
            None if peak is None else peak * tokens / flops,
            settings={
                **settings,
                "mfu": None if peak is None else flops / seconds / peak,
                "peak_flops": peak,
            },
        ),  # fmt: skip
        _memory_figure(f"train step {shape} L {length}", predicted, measured, settings),
    ]


def rollout_figure(scale: Scale, seed: int = 0) -> Figure:
    """The rollout engine's turns/s on FrozenLake against one task group at a time."""
    from agentrl_jax.models.tokenizer import load_tokenizer  # noqa: PLC0415
    from agentrl_jax.rollout import MultiTurnRollout, RolloutConfig  # noqa: PLC0415
    from agentrl_jax.sampling import Paging, SamplerPolicy  # noqa: PLC0415
    from envs.frozenlake import maps as fl_maps  # noqa: PLC0415
    from envs.frozenlake.text_env import FrozenLakeTextConfig, FrozenLakeTextEnv  # noqa: PLC0415

    budget, group = scale.rollout_budget, scale.rollout_group
    key_maps, key_run = jax.random.split(jax.random.key(seed))
    env = FrozenLakeTextEnv(fl_maps.generate(key_maps, scale.rollout_tasks, size=4),
                            FrozenLakeTextConfig(t_max=budget))  # fmt: skip
    config = RolloutConfig(group_size=group, budget=budget, max_response_tokens=8,
                           max_context=1536)  # fmt: skip
    runner = MultiTurnRollout(env, load_tokenizer(), config)
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
    return Figure(
        f"rollout FrozenLake {scale.rollout_shape}, {len(tasks)} tasks x G {group}",
        "speed",
        turns / batched_s,
        "turns/s",
        "the same rollouts one task group (G rows) at a time",
        one_turns / one_s,
        settings={
            "budget": budget,
            "max_response_tokens": 8,
            "paged": True,
            "turns": turns,
            "seconds": batched_s,
            "device": device_name(),
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
