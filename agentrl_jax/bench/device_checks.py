"""``bench device``'s correctness figures (:mod:`agentrl_jax.bench.device`): our logits against
``transformers``', the Pallas GPU paged-attention kernel and cuDNN's fused attention against
XLA's, and one GRPO update's loss and gradients on the device against the CPU's.
"""

from __future__ import annotations

import dataclasses
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from agentrl_jax.bench.device_figures import (
    CUDNN,
    LOGITS,
    PAGED_KERNEL,
    TRAIN_CHECK,
    Figure,
    Scale,
    _torch_device,
    _train_batch,
    device_name,
    dims,
    our_config,
)


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
