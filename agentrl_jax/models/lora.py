"""LoRA adapters on the Qwen3 projections: ``W x`` becomes ``W x + (alpha / rank) B (A x)``.

For each targeted projection (:data:`PROJECTIONS`, Hugging Face names, weight ``W [out, in]``)
every layer gets ``A [rank, in]`` (uniform in ``+-1/sqrt(in)``, PEFT's default) and
``B [out, rank]`` (zeros), stacked over the layers like the weights they adapt:
``A [num_layers, rank, in]``, ``B [num_layers, out, rank]``. With ``B = 0`` the model computes
exactly the base model's numbers (each projection adds an exact zero). The adapters are
``nnx.LoRAParam`` variables of a :class:`LoraAdapters` module at ``model.layers.lora``
(paths ``layers/lora/q_proj_a``, ``layers/lora/q_proj_b``, ...), so
``nnx.split(model, nnx.LoRAParam, ...)`` separates them from the base weights as flax's own
LoRA does. The forward (:meth:`~agentrl_jax.models.qwen3.Qwen3ForCausalLM.hidden_states`)
applies them inside the one ``lax.scan`` over the layers; ``adapters=False`` there computes the
base model from the same weights (the KL reference without a second copy).

Why not a library: qwix's ``LoraProvider`` and flax's ``nnx.LoRA`` adapt the matrix product a
module makes with its own weight, keyed by the module's path. Here all layers run as one
``lax.scan`` over stacked ``[num_layers, out, in]`` weights inside one module, so neither sees
a per-layer weight: they would need the layers unstacked (compile time linear in depth) or give
every layer the same adapter. The adapters are a few lines of pure code on the stacked
weights instead, with the same variable type and the same math as PEFT (so
:func:`peft_tensors` is a renaming).

Public API: :class:`LoraConfig` (``rl.lora`` of the config tree), :func:`with_adapters`
(a model sharing the base weights, plus adapters), :func:`merged_params` / :func:`merged_model`
(``W + scale B A``: what a run returns and export writes), :func:`peft_tensors`
and :func:`export_peft` (the adapters in PEFT's format).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from agentrl_jax.errors import ConfigError, did_you_mean
from agentrl_jax.validation import (
    MAX_COEF,
    MAX_WIDTH,
    Check,
    check_fields,
    integer,
    one_of,
    real,
    setting,
    short_repr,
)

# The projections an adapter may target, and the Hugging Face module each lives in.
PROJECTIONS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
BASE_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """``rank`` r, ``alpha`` (the update is scaled by ``alpha / rank``), ``targets`` (names of
    :data:`PROJECTIONS`; default all seven, attention and MLP) and ``base_dtype`` (the frozen
    base weights' storage dtype in training, null: the model's own; ``bfloat16`` halves them,
    as Qwen3-8B on one GPU needs). Validated on construction, errors name ``rl.lora.<field>``."""

    rank: int = setting(16, integer(1, MAX_WIDTH))  # also <= min(in, out): check_rank
    alpha: float = setting(32.0, real(0.0, MAX_COEF, lo_open=True))
    targets: tuple[str, ...] = setting(
        tuple(PROJECTIONS),
        Check(
            lambda v: (
                isinstance(v, tuple)
                and len(v) > 0
                and len(set(v)) == len(v)
                and all(t in PROJECTIONS for t in v)
            ),
            f"a non-empty list of distinct projections from {list(PROJECTIONS)}",
        ),
    )
    base_dtype: str | None = setting(None, one_of(BASE_DTYPES, nullable=True))

    def __post_init__(self):
        targets = self.targets
        if isinstance(targets, (list, tuple)) and all(isinstance(t, str) for t in targets):
            object.__setattr__(self, "targets", tuple(targets))
        check_fields("rl.lora", self)

    def check_rank(self, shapes: Mapping[str, tuple[int, int]]) -> None:
        """Refuses (:class:`ConfigError` naming ``rl.lora.rank``) a rank above ``min(in,
        out)`` of a targeted projection, ``shapes[name] = (out, in)`` (:func:`projection_shapes`;
        each target must be a key):
        such an adapter holds more numbers than the weight it adapts, and no more rank."""
        bound, name = min((min(shapes[t]), t) for t in self.targets)
        if self.rank > bound:
            out, in_ = shapes[name]
            raise ConfigError(
                f"rl.lora.rank: must be <= {bound}, min(in, out) of the targeted projections "
                f"({name} is [{out}, {in_}]), got {self.rank}"
            )

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.rank

    @classmethod
    def from_value(cls, value: Any) -> "LoraConfig | None":
        """``rl.lora`` as written: null (no adapters), a mapping of fields, or a LoraConfig."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"rl.lora: must be null or a mapping {{rank, alpha, targets, base_dtype}}, "
                f"got {short_repr(value)}"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(
                f"rl.lora.{unknown[0]}: unknown field; known: {', '.join(sorted(known))}"
                f"{did_you_mean(unknown[0], known)}"
            )
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "alpha": self.alpha,
            "targets": list(self.targets),
            "base_dtype": self.base_dtype,
        }


class LoraAdapters(nnx.Module):
    """Stacked adapters ``{name}_a [n, r, in]`` and ``{name}_b [n, out, r]`` per target, and
    the static ``scale`` and ``targets``."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], config: LoraConfig, key: jax.Array):
        self.scale = config.scale
        self.targets = tuple(config.targets)
        for name, key_t in zip(self.targets, jax.random.split(key, len(self.targets))):
            layers, out, inp = shapes[name]
            bound = 1.0 / np.sqrt(inp)
            a = jax.random.uniform(key_t, (layers, config.rank, inp), jnp.float32, -bound, bound)
            setattr(self, f"{name}_a", nnx.LoRAParam(a))
            setattr(self, f"{name}_b", nnx.LoRAParam(jnp.zeros((layers, out, config.rank))))

    def stacked(self) -> dict[str, jax.Array]:
        """``{"{name}_a": A, "{name}_b": scale * B}`` per target (the scale folded into B)."""
        out = {}
        for name in self.targets:
            out[f"{name}_a"] = getattr(self, f"{name}_a")[...]
            out[f"{name}_b"] = getattr(self, f"{name}_b")[...] * self.scale
        return out


def has_adapters(model: nnx.Module) -> bool:
    return getattr(getattr(model, "layers", None), "lora", None) is not None


def projection_shapes(
    hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int
) -> dict[str, tuple[int, int]]:
    """Each of :data:`PROJECTIONS`' weight shape ``(out, in)`` in a Qwen3 of these sizes."""
    return {
        "q_proj": (heads * head_dim, hidden),
        "k_proj": (kv_heads * head_dim, hidden),
        "v_proj": (kv_heads * head_dim, hidden),
        "o_proj": (hidden, heads * head_dim),
        "gate_proj": (intermediate, hidden),
        "up_proj": (intermediate, hidden),
        "down_proj": (hidden, intermediate),
    }


def with_adapters(model: nnx.Module, config: LoraConfig, key: jax.Array) -> nnx.Module:
    """A Qwen3 sharing ``model``'s weights (no copy; ``model`` itself is unchanged) with fresh
    adapters on ``config.targets`` (``B = 0``: it computes what ``model`` does)."""
    if has_adapters(model):
        raise ValueError("the model already has LoRA adapters")
    graphdef, state = nnx.split(model)
    adapted = nnx.merge(graphdef, state)
    absent = [name for name in config.targets if not hasattr(adapted.layers, name)]
    if absent:  # a dense MLP's projections in a model whose every layer has experts
        raise ValueError(
            f"rl.lora.targets: {absent} are not projections of this model (every layer's "
            "feed-forward is a mixture of experts); target the attention's projections"
        )
    shapes = {name: getattr(adapted.layers, name).get_value().shape for name in config.targets}
    config.check_rank({name: shape[-2:] for name, shape in shapes.items()})  # before allocating
    adapted.layers.lora = LoraAdapters(shapes, config, key)
    return adapted


def split_adapters(model: nnx.Module) -> tuple[nnx.GraphDef, Any, Any]:
    """``(graphdef, adapters, base)``: the model's ``nnx.LoRAParam`` state and everything else;
    ``nnx.merge(graphdef, adapters, base)`` rebuilds it."""
    return nnx.split(model, nnx.LoRAParam, ...)


def _delta(a: jax.Array, b: jax.Array) -> jax.Array:
    """``B @ A`` per layer, float32: ``[n, out, r] x [n, r, in] -> [n, out, in]``."""
    return jnp.einsum(
        "nor,nri->noi", b.astype(jnp.float32), a.astype(jnp.float32), precision="highest"
    )


def merged_params(base: Any, adapters: Any, scale: float, dtype: Any = None) -> Any:
    """The plain Qwen3's parameters (no adapters), ``W + scale B A`` for every adapted
    projection, as an ``nnx.State`` shaped like a model without adapters (its ``graphdef``
    merges it). Summed in float32 and stored in ``dtype`` (default: the base weight's). Jit it
    to merge on device."""
    flat = nnx.to_pure_dict(base)
    ad = nnx.to_pure_dict(adapters)["layers"]["lora"]
    layers = dict(flat["layers"])
    for name in _targets(ad):
        w = layers[name]
        summed = w.astype(jnp.float32) + scale * _delta(ad[f"{name}_a"], ad[f"{name}_b"])
        layers[name] = summed.astype(dtype or w.dtype)
    return nnx.State(_as_params({**flat, "layers": layers}))


def _targets(ad: Mapping[str, Any]) -> list[str]:
    return [name for name in PROJECTIONS if f"{name}_a" in ad]


def _as_params(tree: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (_as_params(v) if isinstance(v, Mapping) else nnx.Param(v)) for k, v in tree.items()}


def plain_graphdef(model: nnx.Module) -> nnx.GraphDef:
    """The graphdef of ``model`` without its adapters (what :func:`merged_params` merges into)."""
    plain = nnx.merge(*nnx.split(model))
    if has_adapters(plain):
        del plain.layers.lora
    return nnx.graphdef(plain)


def merged_model(model: nnx.Module, dtype: Any = None) -> nnx.Module:
    """``model`` (with adapters) as a plain Qwen3 with merged weights (for export, evaluation)."""
    _, adapters, base = split_adapters(model)
    params = merged_params(base, adapters, model.layers.lora.scale, dtype)
    return nnx.merge(plain_graphdef(model), params)


def _rank(adapters: Any, name: str) -> int:
    return nnx.to_pure_dict(adapters)["layers"]["lora"][f"{name}_a"].shape[1]


def peft_tensors(adapters: Any, targets: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The adapters under PEFT's tensor names
    (``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight [r, in]``, ``lora_B``
    ``[out, r]``), float32 host arrays."""
    ad = nnx.to_pure_dict(adapters)["layers"]["lora"]
    out = {}
    for name in targets:
        a, b = np.asarray(ad[f"{name}_a"], np.float32), np.asarray(ad[f"{name}_b"], np.float32)
        for i in range(a.shape[0]):
            prefix = f"base_model.model.model.layers.{i}.{PROJECTIONS[name]}.{name}"
            out[f"{prefix}.lora_A.weight"] = a[i]
            out[f"{prefix}.lora_B.weight"] = b[i]
    return out


def export_peft(
    model: nnx.Module, out_dir: str | Path, base_model_name_or_path: str | None = None
) -> Path:
    """Write ``model``'s adapters as a PEFT folder (``adapter_model.safetensors``,
    ``adapter_config.json``): ``PeftModel.from_pretrained(base, out_dir)`` loads them."""
    from safetensors.numpy import save_file  # noqa: PLC0415

    _, adapters, _ = split_adapters(model)
    lora = model.layers.lora
    rank = _rank(adapters, lora.targets[0])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(
        peft_tensors(adapters, lora.targets),
        out_dir / "adapter_model.safetensors",
        metadata={"format": "pt"},
    )
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": lora.scale * rank,
        "target_modules": list(lora.targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "base_model_name_or_path": base_model_name_or_path,
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir
