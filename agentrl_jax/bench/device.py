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

The figures live in :mod:`~agentrl_jax.bench.device_checks` (correctness) and
:mod:`~agentrl_jax.bench.device_speed` (speed, memory); what they share (the record, the scales,
the names, the predictions) in :mod:`~agentrl_jax.bench.device_figures`.
"""

from __future__ import annotations

from typing import Callable, Sequence

from agentrl_jax.bench.device_checks import (
    cudnn_figure,
    logits_figure,
    paged_kernel_figure,
    train_step_figure,
)
from agentrl_jax.bench.device_figures import FULL, TINY, Figure, device_name
from agentrl_jax.bench.device_speed import (
    copy_bandwidth,
    decode_figures,
    decode_memory_figure,
    rollout_figure,
    train_figures,
)

PARTS = ("memory", "logits", "paged_kernel", "cudnn_attention", "train_step", "decode", "rollout")


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
