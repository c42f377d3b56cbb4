"""Qwen3 architecture configuration, read from a Hugging Face ``config.json``.

Only the fields that change the math are kept, plus the special token ids a sampler needs.
Both ``config.json`` forms are read:

* hub files (``transformers`` < 5): top-level ``rope_theta`` and ``rope_scaling`` (or null);
* newer ``transformers``: a ``rope_parameters`` dict holding ``rope_theta`` and the scaling.

:meth:`Qwen3Config.to_hf_dict` writes both forms, so the exported file loads in either.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Mapping

SUPPORTED_ARCHITECTURE = "Qwen3ForCausalLM"
SUPPORTED_MODEL_TYPE = "qwen3"
SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn")


class ConfigError(ValueError):
    """A config field is missing, malformed, or describes something we do not implement."""


class UnsupportedArchitectureError(ConfigError):
    """``config.json`` describes a model other than a dense Qwen3 causal LM."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, as ``transformers.modeling_rope_utils`` defines it.

    ``rope_type`` "linear" divides every inverse frequency by ``factor``; "yarn" blends
    interpolated and original frequencies over a ramp (``beta_fast``/``beta_slow``) and
    scales cos/sin by ``attention_factor`` (derived from ``factor`` when absent).
    """

    rope_type: str
    factor: float
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES or self.rope_type == "default":
            raise ConfigError(
                f"rope scaling rope_type={self.rope_type!r} is not supported; supported: "
                f"{[t for t in SUPPORTED_ROPE_TYPES if t != 'default']} (or no scaling)")
        if not self.factor > 0:
            raise ConfigError(f"rope scaling factor must be > 0, got {self.factor}")
        if self.rope_type == "yarn" and not (self.original_max_position_embeddings or 0) > 0:
            raise ConfigError("yarn rope scaling needs original_max_position_embeddings > 0")

    def to_hf_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type == "yarn":
            out.update(original_max_position_embeddings=self.original_max_position_embeddings,
                       beta_fast=self.beta_fast, beta_slow=self.beta_slow, truncate=self.truncate)
            for key in ("attention_factor", "mscale", "mscale_all_dim"):
                if getattr(self, key) is not None:
                    out[key] = getattr(self, key)
        return out


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """A dense Qwen3 decoder. Field names follow ``config.json``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32_768
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotate-half RoPE, got {self.head_dim}")
        if not (isinstance(self.rms_norm_eps, (int, float)) and self.rms_norm_eps > 0):
            raise ConfigError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 1):
            raise ConfigError(f"rope_theta must be > 1, got {self.rope_theta!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ConfigError("tie_word_embeddings must be true/false, "
                              f"got {self.tie_word_embeddings!r}")
        for token_id in (self.bos_token_id, self.pad_token_id, *self.eos_token_ids):
            if token_id is not None and not 0 <= token_id < self.vocab_size:
                raise ConfigError(
                    f"special token id {token_id} is outside vocab_size={self.vocab_size}")

    @property
    def num_query_groups(self) -> int:
        """Query heads per key/value head (grouped-query attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    # ------------------------------------------------------------------ reading
    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], *, source: str = "config.json") -> "Qwen3Config":
        """Build from a parsed ``config.json``; ``source`` names the file in errors."""
        _check_architecture(d, source)
        _reject_unsupported_features(d, source)
        try:
            rope_theta, rope_scaling = _read_rope(d, source)
            eos = d.get("eos_token_id")
            eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
            heads = _required(d, "num_attention_heads", source)
            return cls(
                vocab_size=_required(d, "vocab_size", source),
                hidden_size=_required(d, "hidden_size", source),
                intermediate_size=_required(d, "intermediate_size", source),
                num_hidden_layers=_required(d, "num_hidden_layers", source),
                num_attention_heads=heads,
                num_key_value_heads=d.get("num_key_value_heads") or heads,
                head_dim=d.get("head_dim") or _required(d, "hidden_size", source) // heads,
                rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                tie_word_embeddings=d.get("tie_word_embeddings", False),
                max_position_embeddings=d.get("max_position_embeddings", 32_768),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
                pad_token_id=d.get("pad_token_id"),
            )
        except ConfigError as e:
            if str(e).startswith(source):
                raise
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "Qwen3Config":
        """Read ``<model_dir>/config.json``."""
        path = Path(model_dir) / "config.json"
        if not Path(model_dir).is_dir():
            raise FileNotFoundError(f"model directory {str(model_dir)!r} does not exist")
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: a Hugging Face model directory needs config.json")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_hf_dict(d, source=str(path))

    # ------------------------------------------------------------------ writing
    def to_hf_dict(self, *, torch_dtype: str = "float32") -> dict[str, Any]:
        """A ``config.json`` dict that ``transformers`` (old and new) loads as this model."""
        scaling = self.rope_scaling.to_hf_dict() if self.rope_scaling else None
        eos: int | list[int] | None
        eos = (None if not self.eos_token_ids else self.eos_token_ids[0]
               if len(self.eos_token_ids) == 1 else list(self.eos_token_ids))
        return {
            "architectures": [SUPPORTED_ARCHITECTURE],
            "model_type": SUPPORTED_MODEL_TYPE,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": self.num_hidden_layers,
            # Old form (hub files, transformers < 5, most serving stacks) ...
            "rope_theta": self.rope_theta,
            "rope_scaling": scaling,
            # ... and the form transformers >= 5 writes.
            "rope_parameters": {"rope_theta": self.rope_theta,
                                **(scaling or {"rope_type": "default"})},
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": torch_dtype,
            "use_cache": True,
        }


def _required(d: Mapping[str, Any], key: str, source: str) -> Any:
    if key not in d or d[key] is None:
        raise ConfigError(f"{source}: required field {key!r} is missing")
    return d[key]


def _check_architecture(d: Mapping[str, Any], source: str) -> None:
    archs = d.get("architectures") or []
    model_type = d.get("model_type")
    if model_type != SUPPORTED_MODEL_TYPE or (archs and SUPPORTED_ARCHITECTURE not in archs):
        raise UnsupportedArchitectureError(
            f"{source}: unsupported architecture (model_type={model_type!r}, "
            f"architectures={archs!r}); only model_type={SUPPORTED_MODEL_TYPE!r} "
            f"{SUPPORTED_ARCHITECTURE} (dense Qwen3) is implemented")


def _reject_unsupported_features(d: Mapping[str, Any], source: str) -> None:
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(
            f"{source}: hidden_act={d['hidden_act']!r} is not supported (only 'silu')")
    if d.get("attention_bias", False):
        raise ConfigError(
            f"{source}: attention_bias=true is not supported (Qwen3 has no q/k/v/o bias)")
    if d.get("use_sliding_window", False) or "sliding_attention" in (d.get("layer_types") or []):
        raise ConfigError(f"{source}: sliding-window attention (use_sliding_window/layer_types) "
                          "is not supported")


def _read_rope(d: Mapping[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from either config form; ``rope_parameters`` wins if both exist."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"{source}: rope_parameters/rope_scaling must be an object, "
                          f"got {params!r}")
    if params and all(isinstance(v, Mapping) for v in params.values()):
        raise ConfigError(f"{source}: per-layer-type rope_parameters are not supported")
    theta = float(params.get("rope_theta", d.get("rope_theta", 10_000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"{source}: rope_type={rope_type!r} is not supported; "
                          f"supported: {list(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{source}: partial_rotary_factor != 1 is not supported")
    factor = params.get("factor")
    original = params.get("original_max_position_embeddings", d.get("max_position_embeddings"))
    if factor is None and rope_type == "yarn" and original:
        factor = d.get("max_position_embeddings", original) / original
    if factor is None or not math.isfinite(float(factor)):
        raise ConfigError(f"{source}: rope scaling ({rope_type}) needs a numeric 'factor'")
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(factor),
        original_max_position_embeddings=original if rope_type == "yarn" else None,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )
