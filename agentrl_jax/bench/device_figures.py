"""What ``bench device`` (:mod:`agentrl_jax.bench.device`) measures with: one figure's record
(:class:`Figure`), the shapes of a run (:class:`Scale`: :data:`FULL` on an accelerator,
:data:`TINY` with ``--tiny``), the figures' names (which ``--compile-only``,
:mod:`agentrl_jax.bench.compile_only`, prints too) and their roofline predictions on a known GPU.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

import jax
import numpy as np

from agentrl_jax.bench.forward import CONFIGS as MODEL_SHAPES
from agentrl_jax.plan import roofline
from agentrl_jax.plan.roofline import Prediction
from agentrl_jax.plan.targets import GpuSpec, gpu_spec

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


def _train_batch(rows: int, tokens: int, vocab: int, seed: int = 0):
    from agentrl_jax.bench.train_step import synthetic_batch  # noqa: PLC0415
    from agentrl_jax.train import TrainBatch  # noqa: PLC0415

    return TrainBatch(synthetic_batch(rows, tokens, vocab, seed))


def _torch_device():
    """``"cuda"`` when PyTorch sees a GPU, else ``"cpu"``; None without PyTorch."""
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return None
    return "cuda" if torch.cuda.is_available() else "cpu"
