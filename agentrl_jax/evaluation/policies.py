"""Policies named by a directory, so users can compare a base model with its RL descendant.

A policy path is either

* a **Hugging Face model directory** (``config.json`` + safetensors, e.g. ``Qwen/Qwen3-4B``
  downloaded, or an exported run): the model via :func:`agentrl_jax.models.load_qwen3`, the
  tokenizer from the same directory (or Qwen3's bundled one, see
  :func:`agentrl_jax.models.tokenizer.load_tokenizer`); or
* a **training checkpoint** of :class:`agentrl_jax.train.Checkpointer`: a run's checkpoint
  directory (its newest step is used) or one step directory ``<dir>/<step>`` (items ``state``
  and ``config``). Only the policy parameters are read from ``state`` (an Orbax partial
  restore: optimizer moments, reference and critic are never loaded); the architecture and
  the tokenizer come from the Hugging Face directory the run started from, which the trainer
  records as ``"model_dir"`` in the checkpoint's ``config`` item, or which the caller passes
  as ``model_dir`` (that wins).

Every failure is a :class:`PolicyLoadError` naming the path and what is wrong with it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from agentrl_jax.models import (
    CheckpointError,
    ConfigError,
    Qwen3Config,
    Qwen3ForCausalLM,
    load_qwen3,
)
from agentrl_jax.models.checkpoints import abstract_qwen3
from agentrl_jax.models.tokenizer import load_tokenizer
from agentrl_jax.sampling import SamplerPolicy, SamplingConfig
from agentrl_jax.validation import short_repr

MODEL_DIR_KEY = "model_dir"  # the checkpoint metadata naming the run's Hugging Face directory
_ITEMS = ("state", "config")


class PolicyLoadError(ValueError):
    """A policy path that cannot be loaded (the message names the path and the reason)."""


@dataclasses.dataclass(frozen=True)
class LoadedPolicy:
    """A model and its tokenizer, and where they came from."""

    path: Path
    kind: str  # "huggingface" or "checkpoint"
    model_dir: Path  # the Hugging Face directory of the architecture and tokenizer
    model: Qwen3ForCausalLM
    tokenizer: Any
    step: int | None = None  # training step of a checkpoint

    @property
    def valid_vocab_size(self) -> int | None:
        """The tokenizer's size when the embedding has extra (never trained) rows, else None."""
        known = len(self.tokenizer)
        return known if known < self.model.config.vocab_size else None

    def sampling(self, sampling: SamplingConfig) -> SamplingConfig:
        """``sampling`` restricted to ids the tokenizer can decode."""
        return dataclasses.replace(sampling, valid_vocab_size=self.valid_vocab_size)

    def describe(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "kind": self.kind,
            "model_dir": str(self.model_dir),
            "step": self.step,
        }


def is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


def _is_step_dir(path: Path) -> bool:
    return all((path / item).is_dir() for item in _ITEMS)


def checkpoint_step_dir(path: str | Path) -> Path | None:
    """The step directory a checkpoint path names (the newest step of a run directory), or
    None if ``path`` is not a checkpoint."""
    path = Path(path)
    if _is_step_dir(path):
        return path
    steps = (
        [p for p in path.iterdir() if p.name.isdigit() and _is_step_dir(p)] if path.is_dir() else []
    )
    return max(steps, key=lambda p: int(p.name)) if steps else None


def _load_hf(path: Path, dtype, param_dtype) -> tuple[Qwen3ForCausalLM, Any]:
    try:
        model = load_qwen3(path, dtype=dtype, param_dtype=param_dtype)
        tokenizer = load_tokenizer(path)
    except (CheckpointError, ConfigError, OSError, ValueError) as error:
        raise PolicyLoadError(
            f"policy {path}: cannot load the Hugging Face model: {error}"
        ) from None
    if len(tokenizer) > model.config.vocab_size:
        raise PolicyLoadError(
            f"policy {path}: the tokenizer has {len(tokenizer)} ids but the "
            f"model's vocab_size is {model.config.vocab_size}"
        )
    return model, tokenizer


def _checkpoint_metadata(step_dir: Path) -> dict[str, Any]:
    try:
        config = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(step_dir / "config")
    except Exception as error:  # noqa: BLE001 - any failure: unreadable item
        raise PolicyLoadError(
            f"policy {step_dir}: cannot read the checkpoint's config item "
            f"({type(error).__name__}: {error})"
        ) from None
    if not isinstance(config, dict):
        raise PolicyLoadError(
            f"policy {step_dir}: the checkpoint's config item is not a JSON object"
        )
    return config


def _restore_policy_params(
    step_dir: Path, config: Qwen3Config, dtype, param_dtype
) -> Qwen3ForCausalLM:
    graphdef, abstract = nnx.split(abstract_qwen3(config, dtype=dtype, param_dtype=param_dtype))
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract
    )
    restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
    args = ocp.args.PyTreeRestore(
        item={"policy": abstract}, restore_args={"policy": restore_args}, partial_restore=True
    )
    try:
        restored = ocp.PyTreeCheckpointer().restore(step_dir / "state", args=args)["policy"]
        for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(abstract), strict=True):
            if got.shape != want.shape:
                raise ValueError(f"array of shape {got.shape} where the model has {want.shape}")
    except Exception as error:  # noqa: BLE001 - any failure: the checkpoint does not fit the model
        raise PolicyLoadError(
            f"policy {step_dir}: cannot restore the policy parameters into the "
            f"model of its config ({type(error).__name__}: "
            f"{str(error).splitlines()[0][:300] if str(error) else ''})"
        ) from None
    return nnx.merge(graphdef, restored)


def load_policy(
    path: str | Path,
    *,
    model_dir: str | Path | None = None,
    dtype: Any = jnp.float32,
    param_dtype: Any = jnp.float32,
) -> LoadedPolicy:
    """Load the policy a path names (see the module docstring).

    Args:
      path: a Hugging Face model directory, a training run's checkpoint directory or one of
        its step directories.
      model_dir: for a checkpoint, the Hugging Face directory of its architecture and
        tokenizer (default: the one recorded in the checkpoint as ``"model_dir"``).
      dtype, param_dtype: compute and parameter dtypes of the model.
    """
    path = Path(path)
    if not path.exists():
        raise PolicyLoadError(f"policy {path}: no such file or directory")
    if not path.is_dir():
        raise PolicyLoadError(
            f"policy {path}: not a directory (expected a Hugging Face model "
            "directory or a training checkpoint)"
        )
    if is_model_dir(path):
        model, tokenizer = _load_hf(path, dtype, param_dtype)
        return LoadedPolicy(path, "huggingface", path, model, tokenizer)
    step_dir = checkpoint_step_dir(path)
    if step_dir is None:
        raise PolicyLoadError(
            f"policy {path}: neither a Hugging Face model directory (no "
            "config.json) nor a training checkpoint (no <step>/state and "
            "<step>/config)"
        )
    metadata = _checkpoint_metadata(step_dir)
    if model_dir is None:
        if MODEL_DIR_KEY not in metadata:
            raise PolicyLoadError(
                f"policy {step_dir}: the checkpoint does not record its "
                f"{MODEL_DIR_KEY!r}; pass the Hugging Face directory of the "
                "model it was trained from"
            )
        model_dir = metadata[MODEL_DIR_KEY]
        if not (isinstance(model_dir, str) and model_dir):  # JSON of any type: not a crash
            raise PolicyLoadError(
                f"policy {step_dir}: the checkpoint's {MODEL_DIR_KEY!r} is "
                f"{short_repr(model_dir, 120)}, not a directory name; pass the Hugging Face "
                "directory of the model it was trained from"
            )
    model_dir = Path(model_dir)
    if not is_model_dir(model_dir):
        raise PolicyLoadError(
            f"policy {step_dir}: its model directory {model_dir} has no config.json"
        )
    try:
        config = Qwen3Config.from_model_dir(model_dir)
        tokenizer = load_tokenizer(model_dir)
    except (ConfigError, OSError, ValueError) as error:
        raise PolicyLoadError(
            f"policy {step_dir}: cannot read model directory {model_dir}: {error}"
        ) from None
    model = _restore_policy_params(step_dir, config, dtype, param_dtype)
    step = int(step_dir.name) if step_dir.name.isdigit() else None
    return LoadedPolicy(path, "checkpoint", model_dir, model, tokenizer, step)


def same_tokenizer(a: LoadedPolicy, b: LoadedPolicy) -> bool:
    """Whether both policies map text to the same ids (needed to score one's responses under
    the other) and share the chat template."""
    return (
        a.tokenizer.get_vocab() == b.tokenizer.get_vocab()
        and a.tokenizer.chat_template == b.tokenizer.chat_template
    )


def sampler_policies(
    base: LoadedPolicy, rl: LoadedPolicy, **kwargs
) -> tuple[SamplerPolicy, SamplerPolicy]:
    """Samplers of both policies; when the two models share an architecture the RL one reuses
    the base sampler's compiled functions (:meth:`SamplerPolicy.using`)."""
    base_policy = SamplerPolicy(base.model, **kwargs)
    if nnx.graphdef(base.model) == nnx.graphdef(rl.model):
        return base_policy, base_policy.using(nnx.state(rl.model))
    return base_policy, SamplerPolicy(rl.model, **kwargs)
