"""Qwen3 architecture configuration, read from a Hugging Face ``config.json``.

Only the fields that change the math are kept, plus the special token ids a sampler needs.
Both ``config.json`` forms are read:

* hub files (``transformers`` < 5): top-level ``rope_theta`` and ``rope_scaling`` (or null);
* newer ``transformers``: a ``rope_parameters`` dict holding ``rope_theta`` and the scaling.

:meth:`Qwen3Config.to_hf_dict` writes both forms, so the exported file loads in either.

The Qwen3 models known by name (:data:`QWEN3_ARCHITECTURES`: their ``config.json`` values, for
planning and benchmarks without the files) are the one table of their shapes:
:func:`qwen3_config` and :func:`qwen3_hf_config` (cut, e.g. to fewer layers) read it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

from agentrl_jax.errors import ConfigError
from agentrl_jax.models.strict_json import json_kind, load_json_object
from agentrl_jax.validation import (
    BOOL,
    Check,
    integer,
    is_int,
    optional,
    real,
    short_repr,
    validate,
)

SUPPORTED_ARCHITECTURE = "Qwen3ForCausalLM"
SUPPORTED_MODEL_TYPE = "qwen3"
MOE_ARCHITECTURE = "Qwen3MoeForCausalLM"
MOE_MODEL_TYPE = "qwen3_moe"
SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn")


class UnsupportedArchitectureError(ConfigError):
    """``config.json`` describes a model other than a Qwen3 (dense or MoE) causal LM."""


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
                f"rope_scaling.rope_type: {short_repr(self.rope_type)} is not supported; "
                f"supported: {[t for t in SUPPORTED_ROPE_TYPES if t != 'default']} (or no scaling)"
            )
        validate(
            "rope_scaling",
            self,
            {
                "factor": real(0, lo_open=True),
                "original_max_position_embeddings": _POSITIVE_INT
                if self.rope_type == "yarn"
                else optional(_POSITIVE_INT),
                "beta_fast": real(),
                "beta_slow": real(),
                "attention_factor": optional(real(0, lo_open=True)),
                "mscale": optional(real()),
                "mscale_all_dim": optional(real()),
                "truncate": BOOL,
            },
        )

    def to_hf_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type == "yarn":
            out.update(
                original_max_position_embeddings=self.original_max_position_embeddings,
                beta_fast=self.beta_fast,
                beta_slow=self.beta_slow,
                truncate=self.truncate,
            )
            for key in ("attention_factor", "mscale", "mscale_all_dim"):
                if getattr(self, key) is not None:
                    out[key] = getattr(self, key)
        return out


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """A Qwen3 decoder, dense or mixture-of-experts. Field names follow ``config.json``.

    MoE (``qwen3_moe``): ``num_experts > 0`` experts of ``moe_intermediate_size``, each token
    routed to ``num_experts_per_tok`` of them (their weights renormalised when
    ``norm_topk_prob``), in layer ``i`` unless ``i`` is in ``mlp_only_layers`` or ``(i + 1) %
    decoder_sparse_step`` (those keep a dense MLP of ``intermediate_size``), as
    ``transformers`` decides; :attr:`moe_layers` says which."""

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
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("eos_token_ids", "mlp_only_layers"):  # lists, e.g. from JSON
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        validate("", self, _CHECKS)
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok: must be in [1, num_experts={self.num_experts}], "
                f"got {self.num_experts_per_tok}"
            )
        if self.num_experts and self.moe_intermediate_size < 1:
            raise ConfigError(
                "moe_intermediate_size: must be >= 1 with experts, got "
                f"{self.moe_intermediate_size}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_key_value_heads: must divide num_attention_heads "
                f"({self.num_attention_heads}), got {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim: must be even for rotate-half RoPE, got {self.head_dim}")
        for name, ids in (
            ("bos_token_id", (self.bos_token_id,)),
            ("pad_token_id", (self.pad_token_id,)),
            ("eos_token_id", self.eos_token_ids),
        ):
            for token_id in ids:
                if token_id is not None and token_id >= self.vocab_size:
                    raise ConfigError(
                        f"{name}: {token_id} is not a token of vocab_size="
                        f"{self.vocab_size} (ids run 0..{self.vocab_size - 1})"
                    )

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Per layer, whether its feed-forward is the experts' (else a dense MLP)."""
        return tuple(
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
            for i in range(self.num_hidden_layers)
        )

    @property
    def num_query_groups(self) -> int:
        """Query heads per key/value head (grouped-query attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    # ------------------------------------------------------------------ reading
    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], *, source: str = "config.json") -> "Qwen3Config":
        """Build from a parsed ``config.json``; ``source`` names the file in errors.

        Every error is a :class:`ConfigError` ``"<source>: <field>: ..."``, the field named as in
        ``config.json``.
        """
        if not isinstance(d, Mapping):
            raise ConfigError(f"{source}: must be a JSON object of fields, got {json_kind(d)}")
        try:
            _check_architecture(d)
            _reject_unsupported_features(d)
            rope_theta, rope_scaling = _read_rope(d)
            heads = _required(d, "num_attention_heads")
            hidden = _required(d, "hidden_size")
            head_dim = _given(d, "head_dim")
            return cls(
                vocab_size=_required(d, "vocab_size"),
                hidden_size=hidden,
                intermediate_size=_required(d, "intermediate_size"),
                num_hidden_layers=_required(d, "num_hidden_layers"),
                num_attention_heads=heads,
                num_key_value_heads=_given(d, "num_key_value_heads", heads),
                head_dim=_derived_head_dim(hidden, heads) if head_dim is None else head_dim,
                rms_norm_eps=_given(d, "rms_norm_eps", 1e-6),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                tie_word_embeddings=_given(d, "tie_word_embeddings", False),
                max_position_embeddings=_given(d, "max_position_embeddings", 32_768),
                bos_token_id=_given(d, "bos_token_id"),
                eos_token_ids=_eos_ids(d),
                pad_token_id=_given(d, "pad_token_id"),
                **(_moe_fields(d) if d.get("model_type") == MOE_MODEL_TYPE else {}),
            )
        except ConfigError as e:
            raise type(e)(f"{source}: {e}") from None

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "Qwen3Config":
        """Read ``<model_dir>/config.json``."""
        path = Path(model_dir) / "config.json"
        if not Path(model_dir).is_dir():
            raise FileNotFoundError(f"model directory {str(model_dir)!r} does not exist")
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: a Hugging Face model directory needs config.json"
            )
        d = load_json_object(
            path.read_bytes(), source=str(path), what="the file", error=ConfigError
        )
        return cls.from_hf_dict(d, source=str(path))

    # ------------------------------------------------------------------ writing
    def to_hf_dict(self, *, torch_dtype: str = "float32") -> dict[str, Any]:
        """A ``config.json`` dict that ``transformers`` (old and new) loads as this model."""
        scaling = self.rope_scaling.to_hf_dict() if self.rope_scaling else None
        eos: int | list[int] | None
        eos = (
            None
            if not self.eos_token_ids
            else self.eos_token_ids[0]
            if len(self.eos_token_ids) == 1
            else list(self.eos_token_ids)
        )
        moe = self.num_experts > 0
        return {
            "architectures": [MOE_ARCHITECTURE if moe else SUPPORTED_ARCHITECTURE],
            "model_type": MOE_MODEL_TYPE if moe else SUPPORTED_MODEL_TYPE,
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
            "rope_parameters": {
                "rope_theta": self.rope_theta,
                **(scaling or {"rope_type": "default"}),
            },
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": torch_dtype,
            "use_cache": True,
            **(
                {
                    "num_experts": self.num_experts,  # and as transformers >= 5 names it:
                    "num_local_experts": self.num_experts,
                    "num_experts_per_tok": self.num_experts_per_tok,
                    "moe_intermediate_size": self.moe_intermediate_size,
                    "norm_topk_prob": self.norm_topk_prob,
                    "decoder_sparse_step": self.decoder_sparse_step,
                    "mlp_only_layers": list(self.mlp_only_layers),
                    "output_router_logits": False,
                }
                if moe
                else {}
            ),
        }


_POSITIVE_INT = integer(1, 2**31 - 1)  # sizes are int32 in JAX shapes and indexing
_TOKEN_ID = optional(integer(0))
_CHECKS = {
    "vocab_size": _POSITIVE_INT,
    "hidden_size": _POSITIVE_INT,
    "intermediate_size": _POSITIVE_INT,
    "num_hidden_layers": _POSITIVE_INT,
    "num_attention_heads": _POSITIVE_INT,
    "num_key_value_heads": _POSITIVE_INT,
    "head_dim": _POSITIVE_INT,
    "max_position_embeddings": _POSITIVE_INT,
    "rms_norm_eps": real(0, lo_open=True),
    "rope_theta": real(1, lo_open=True),
    "tie_word_embeddings": BOOL,
    "rope_scaling": ((lambda v: v is None or isinstance(v, RopeScaling)), "null or a RopeScaling"),
    "bos_token_id": _TOKEN_ID,
    "pad_token_id": _TOKEN_ID,
    "eos_token_ids": (
        (lambda v: isinstance(v, tuple) and all(is_int(i, 0) for i in v)),
        "a tuple of ints >= 0",
    ),  # read from config.json's eos_token_id
    "num_experts": integer(0, 2**16),
    "num_experts_per_tok": integer(0, 2**16),
    "moe_intermediate_size": integer(0, 2**31 - 1),
    "norm_topk_prob": BOOL,
    "decoder_sparse_step": integer(1, 2**16),
    "mlp_only_layers": (
        (lambda v: isinstance(v, tuple) and all(is_int(i, 0) for i in v)),
        "a list of layer indices >= 0",
    ),
}


def _moe_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """The MoE fields of a ``qwen3_moe`` ``config.json`` (checked by :class:`Qwen3Config`)."""
    only = _given(d, "mlp_only_layers", [])
    return {
        # hub files say num_experts, transformers >= 5 writes num_local_experts
        "num_experts": _given(d, "num_experts") or _required(d, "num_local_experts"),
        "num_experts_per_tok": _required(d, "num_experts_per_tok"),
        "moe_intermediate_size": _required(d, "moe_intermediate_size"),
        "norm_topk_prob": _given(d, "norm_topk_prob", False),
        "decoder_sparse_step": _given(d, "decoder_sparse_step", 1),
        "mlp_only_layers": tuple(only) if isinstance(only, list) else only,
    }


def _given(d: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """``d[key]``, or ``default`` when the key is absent or null (never when it is 0 or "")."""
    value = d.get(key)
    return default if value is None else value


def _required(d: Mapping[str, Any], key: str) -> Any:
    if d.get(key) is None:
        raise ConfigError(f"{key}: required field is missing")
    return d[key]


def _derived_head_dim(hidden: Any, heads: Any) -> Any:
    """``hidden_size // num_attention_heads`` when ``head_dim`` is absent (older configs)."""
    for key, value in (("hidden_size", hidden), ("num_attention_heads", heads)):
        if not is_int(value, 1):  # reported in the field's own words
            raise ConfigError(f"{key}: must be {_POSITIVE_INT[1]}, got {short_repr(value)}")
    if hidden % heads:
        raise ConfigError(
            f"hidden_size: must be a multiple of num_attention_heads ({heads}) "
            f"when head_dim is not given, got {hidden}"
        )
    return hidden // heads


def _eos_ids(d: Mapping[str, Any]) -> tuple[Any, ...]:
    eos = d.get("eos_token_id")
    ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    if not all(is_int(i, 0) for i in ids):
        raise ConfigError(
            f"eos_token_id: must be null, an int >= 0 or a list of them, got {short_repr(eos)}"
        )
    return ids


def _check_architecture(d: Mapping[str, Any]) -> None:
    archs = _given(d, "architectures", [])
    if not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise ConfigError(f"architectures: must be a list of strings, got {short_repr(archs)}")
    model_type = d.get("model_type")
    supported = {SUPPORTED_MODEL_TYPE: SUPPORTED_ARCHITECTURE, MOE_MODEL_TYPE: MOE_ARCHITECTURE}
    known = isinstance(model_type, str) and model_type in supported
    if not known or (archs and supported[model_type] not in archs):
        raise UnsupportedArchitectureError(
            f"unsupported architecture (model_type={model_type!r}, "
            f"architectures={archs!r}); only model_type={SUPPORTED_MODEL_TYPE!r} "
            f"{SUPPORTED_ARCHITECTURE} (dense Qwen3) and {MOE_MODEL_TYPE!r} "
            f"{MOE_ARCHITECTURE} (Qwen3 MoE) are implemented"
        )


def _reject_unsupported_features(d: Mapping[str, Any]) -> None:
    for key in ("attention_bias", "use_sliding_window"):
        if not isinstance(_given(d, key, False), bool):
            raise ConfigError(f"{key}: must be true or false, got {short_repr(d[key])}")
    layer_types = _given(d, "layer_types", [])
    if not (isinstance(layer_types, list) and all(isinstance(t, str) for t in layer_types)):
        raise ConfigError(f"layer_types: must be a list of strings, got {short_repr(layer_types)}")
    if _given(d, "hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act: {d['hidden_act']!r} is not supported (only 'silu')")
    if _given(d, "attention_bias", False):
        raise ConfigError("attention_bias: true is not supported (Qwen3 has no q/k/v/o bias)")
    if _given(d, "use_sliding_window", False) or "sliding_attention" in layer_types:
        raise ConfigError(
            "use_sliding_window/layer_types: sliding-window attention is not supported"
        )


def _read_rope(d: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from either config form; ``rope_parameters`` wins if both exist."""
    # An empty rope_parameters ({}) defers to rope_scaling, as before; anything else wins.
    key = "rope_parameters" if d.get("rope_parameters") not in (None, {}) else "rope_scaling"
    params = _given(d, key, {})
    if not isinstance(params, Mapping):
        raise ConfigError(f"{key}: must be an object or null, got {short_repr(params)}")
    if params and all(isinstance(v, Mapping) for v in params.values()):
        raise ConfigError(f"{key}: per-layer-type rope parameters are not supported")

    def field(name: str, check: Check, default: Any = None) -> Any:
        value = _given(params, name, default)
        if not check[0](value):
            raise ConfigError(f"{key}.{name}: must be {check[1]}, got {short_repr(value)}")
        return value

    if key == "rope_parameters" and not isinstance(_given(d, "rope_scaling", {}), Mapping):
        raise ConfigError(
            f"rope_scaling: must be an object or null, got {short_repr(d['rope_scaling'])}"
        )
    theta_check = real(1, lo_open=True)
    for theta_key, theta in (
        ("rope_theta", d.get("rope_theta")),
        (f"{key}.rope_theta", params.get("rope_theta")),
    ):
        if theta is not None and not theta_check[0](theta):
            raise ConfigError(f"{theta_key}: must be {theta_check[1]}, got {short_repr(theta)}")
    theta = _given(params, "rope_theta", _given(d, "rope_theta", 10_000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"{key}.rope_type: {short_repr(rope_type)} is not supported; "
            f"supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    if field("partial_rotary_factor", real(), 1.0) != 1.0:
        raise ConfigError(f"{key}.partial_rotary_factor: values other than 1 are not supported")
    original = None
    if rope_type == "yarn":
        original = params.get(
            "original_max_position_embeddings", _given(d, "max_position_embeddings")
        )
        if not _POSITIVE_INT[0](original):
            raise ConfigError(
                f"{key}.original_max_position_embeddings: must be "
                f"{_POSITIVE_INT[1]}, got {short_repr(original)}"
            )
    factor = params.get("factor")
    if factor is None and rope_type == "yarn":  # the context it was stretched to / the original
        longest = _given(d, "max_position_embeddings", original)
        if not is_int(longest, 1):
            raise ConfigError(
                f"max_position_embeddings: must be an int >= 1, got {short_repr(longest)}"
            )
        factor = longest / original
    if not real(0, lo_open=True)[0](factor):
        raise ConfigError(
            f"{key}.factor: rope scaling ({rope_type}) needs a finite number > 0, "
            f"got {short_repr(factor)}"
        )
    positive_or_null = optional(real(0, lo_open=True))
    return float(theta), RopeScaling(
        rope_type=rope_type,
        factor=float(factor),
        original_max_position_embeddings=original,
        beta_fast=float(field("beta_fast", real(), 32.0)),
        beta_slow=float(field("beta_slow", real(), 1.0)),
        attention_factor=field("attention_factor", positive_or_null),
        mscale=field("mscale", optional(real())),
        mscale_all_dim=field("mscale_all_dim", optional(real())),
        truncate=field("truncate", BOOL, True),
    )


# ------------------------------------------------------------------------- known models
# Hugging Face config.json values of the Qwen3 models (for planning without the files): the
# dense sizes, and Qwen3-30B-A3B (qwen3_moe: every layer's feed-forward 128 experts, 8 a token).
QWEN3_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
    "qwen3-1.7b": dict(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
    "qwen3-4b": dict(
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "qwen3-30b-a3b": dict(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=(),
    ),
}
_COMMON = dict(
    vocab_size=151936,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    max_position_embeddings=40960,
    eos_token_ids=(151645, 151643),
)


def qwen3_hf_config(name: str, **cuts: Any) -> dict[str, Any]:
    """The ``config.json`` fields of the Qwen3 model ``name`` (a key of
    ``QWEN3_ARCHITECTURES``) with ``cuts`` over them (e.g. ``num_hidden_layers=1``): the one
    table benchmarks take a real model's shapes from."""
    common = {k: v for k, v in _COMMON.items() if k != "eos_token_ids"}  # not a config.json field
    fields = {**common, **QWEN3_ARCHITECTURES[name], **cuts}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}  # JSON lists


def qwen3_config(name: str) -> Qwen3Config:
    """The architecture of a Qwen3 model by name (a key of ``QWEN3_ARCHITECTURES``)."""
    return Qwen3Config(**_COMMON, **QWEN3_ARCHITECTURES[name])
