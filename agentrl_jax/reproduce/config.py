"""The reproduction's configuration: frozen sections, validated on construction, read from YAML.

A :class:`ReproduceConfig` has six sections (the first four defined in :mod:`.settings`)::

    task:        the environment (a registered name), its options, T_max, task counts, context sizes
    model:       a random-init Qwen3 of given dimensions with a small tokenizer, or a local
                 Qwen3 directory (paper scale)
    warm_start:  supervised warm-start on the study's imperfect demonstrations (the "base" policy)
    rl:          the RL runs (GRPO, BudgetMix GRPO, GiGPO, PPO presets) and their trainer settings
    eval:        :class:`~agentrl_jax.reproduce.evaluate.EvalSettings` (Pass@(K, T), diagnostics)
    mesh:        :class:`~agentrl_jax.sharding.MeshConfig` (data, fsdp, tensor axes)

``ReproduceConfig()`` is the built-in CPU default (``configs/frozenlake_cpu.yaml`` holds the same
values); :func:`load_config` reads a YAML file and applies ``section.field=value`` overrides.
Every bad value raises :class:`~agentrl_jax.errors.ConfigError` (a ``ValueError``) naming the
file, the override if one set it, and the field, e.g. ``config run.yaml: rl.group_size: must be
an int >= 2, got 1``; unknown sections and fields are errors too (a typo never silently falls
back to a default), and so is a file of the wrong structure (``task: 0``, ``rl: false``, a list
where a mapping belongs, a key given twice, an empty file). Fields are checked by the shared
helper :func:`agentrl_jax.validation.validate`.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from agentrl_jax.errors import ConfigError
from agentrl_jax.reproduce.eval_settings import EvalSettings
from agentrl_jax.reproduce.presets import RUN_PRESETS, RunSettings  # noqa: F401  (re-exported)
from agentrl_jax.reproduce.settings import (
    ModelSettings,
    RLSettings,
    TaskSettings,  # noqa: F401
    WarmStartSettings,
    plain_data,
)
from agentrl_jax.sharding import MeshConfig
from agentrl_jax.validation import short_repr

_SECTIONS: dict[str, type] = {
    "task": TaskSettings,
    "model": ModelSettings,
    "warm_start": WarmStartSettings,
    "rl": RLSettings,
    "eval": EvalSettings,
    "mesh": MeshConfig,
}


@dataclasses.dataclass(frozen=True)
class ReproduceConfig:
    """The whole reproduction (see the module docstring)."""

    task: TaskSettings = TaskSettings()
    model: ModelSettings = ModelSettings()
    warm_start: WarmStartSettings = WarmStartSettings()
    rl: RLSettings = RLSettings()
    eval: EvalSettings = EvalSettings(
        max_response_tokens=TaskSettings.max_response_tokens, max_context=TaskSettings.max_context
    )
    mesh: MeshConfig = MeshConfig(data=1)

    def __post_init__(self):
        for name, cls in _SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(
                    f"{name}: must be a {cls.__name__}, got {short_repr(getattr(self, name))}"
                )
        if self.eval.budgets is not None and max(self.eval.budgets) > self.task.t_max:
            raise ConfigError(
                f"eval.budgets: must be <= task.t_max ({self.task.t_max}), "
                f"got {list(self.eval.budgets)}"
            )
        for section in ("rl", "eval"):  # the Sampler refuses it later, after loading models
            if self.mesh.tensor > 1 and getattr(self, section).kv_page_size is not None:
                raise ConfigError(
                    f"{section}.kv_page_size: the paged KV cache splits rows over "
                    f"the data and fsdp axes only, and mesh.tensor is "
                    f"{self.mesh.tensor}; set rl.kv_page_size and "
                    "eval.kv_page_size to null (the static cache) or tensor to 1"
                )
        if self.model.tokenizer_isolate and self.task.study.tokenizer_isolate is None:
            raise ConfigError(
                f"model.tokenizer_isolate: the {self.task.env} environment's study "
                "declares no pieces to isolate (its Study.tokenizer_isolate)"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain data (YAML/JSON), a copy; ``config_from_dict(c.to_dict()) == c``."""
        return {
            name: {
                f.name: plain_data(getattr(getattr(self, name), f.name))
                for f in dataclasses.fields(getattr(self, name))
            }
            for name in _SECTIONS
        }


def config_from_dict(
    d: Mapping[str, Any] | None, *, source: str | None = None, overrides: Sequence[str] = ()
) -> ReproduceConfig:
    """A :class:`ReproduceConfig` from plain data; missing sections and fields take defaults.

    ``source`` (e.g. ``"config path/run.yaml"``) and the ``overrides`` already applied to ``d``
    name where a bad value came from: each :class:`ConfigError` reads
    ``"<source> with override '<item>': <section>.<field>: ..."``, naming the overrides of the
    section at fault (the source alone when none touched it; neither when both are absent).
    """
    where = _Where(source, overrides)
    sections = _sections(d, where)
    built, defaults = {}, ReproduceConfig()
    for name, cls in _SECTIONS.items():
        default = getattr(defaults, name)
        values = {
            k: tuple(v) if isinstance(v, list) else v for k, v in sections.get(name, {}).items()
        }
        if name == "task" and values.get("env", default.env) != default.env:
            values.setdefault("options", {})  # another environment: none of the default's options
        try:
            built[name] = cls(
                **{**{f.name: getattr(default, f.name) for f in dataclasses.fields(cls)}, **values}
            )
        except ValueError as error:  # the sections' own checks (and MeshConfig's, EvalSettings')
            message = str(error)
            raise ConfigError(
                where.prefix(name)
                + (message if message.startswith(f"{name}.") else f"{name}: {message}")
            ) from None
    try:
        return ReproduceConfig(**built)
    except ValueError as error:
        raise ConfigError(where.prefix("task", "eval") + str(error)) from None


@dataclasses.dataclass(frozen=True)
class _Where:
    """Where a config's values came from (a file, overrides), for the prefix of its errors."""

    source: str | None
    overrides: Sequence[str] = ()

    def prefix(self, *sections: str) -> str:
        items = [
            o for o in self.overrides if o.partition("=")[0].strip().partition(".")[0] in sections
        ]
        named = " with ".join(
            filter(
                None,
                [self.source, f"override {', '.join(repr(o) for o in items)}" if items else ""],
            )
        )
        return f"{named}: " if named else ""


def _sections(d: Any, where: _Where) -> dict[str, dict[str, Any]]:
    """``d``'s sections as ``{name: {field: value}}``, after checking its structure: a mapping of
    known section names, each a mapping (or null) of known field names."""
    if d is None:
        return {}
    if not isinstance(d, Mapping):
        raise ConfigError(
            f"{where.prefix()}must be a mapping of sections ({', '.join(_SECTIONS)}), "
            f"got {_kind(d)}"
        )
    out = {}
    for name, values in d.items():
        if name not in _SECTIONS or not isinstance(name, str):
            raise ConfigError(
                f"{where.prefix(str(name))}unknown section {name!r}; known: {', '.join(_SECTIONS)}"
            )
        if values is None:
            values = {}
        if not isinstance(values, Mapping):
            raise ConfigError(
                f"{where.prefix(name)}{name}: must be a mapping of fields, got {_kind(values)}"
            )
        known = [f.name for f in dataclasses.fields(_SECTIONS[name])]
        for field in values:
            if field not in known or not isinstance(field, str):
                raise ConfigError(
                    f"{where.prefix(name)}{name}: unknown field {field!r}; known: "
                    f"{', '.join(sorted(known))}"
                )
        out[name] = dict(values)
    return out


def _kind(value: Any) -> str:
    """A YAML value's kind and value, for messages: ``a list [1, 2]``, ``an int 0``."""
    kinds = (
        (bool, "a boolean"),
        (int, "an int"),
        (float, "a number"),
        (str, "a string"),
        (list, "a list"),
        (Mapping, "a mapping"),
    )
    kind = next((name for cls, name in kinds if isinstance(value, cls)), type(value).__name__)
    return f"{kind} {short_repr(value)}"


def _parse_value(text: str) -> Any:
    """YAML, except that numbers like ``1e-6`` are floats (YAML 1.1 wants ``1.0e-6``)."""
    try:
        value = _load_yaml(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"not valid YAML ({_yaml_reason(error)})") from None
    if isinstance(value, str) and re.fullmatch(
        r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", value.strip()
    ):
        return float(value)
    return value


def apply_overrides(d: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """``d`` with ``section.field=value`` overrides applied (values parsed as YAML).

    A longer key reaches into a mapping field: ``rl.algorithm.advantage=gigpo`` sets
    ``advantage`` in ``rl.algorithm`` (creating the mapping if needed). ``d`` is a mapping of
    sections (:func:`config_from_dict` checks the rest); it is not modified.
    """
    out = {k: _copy_mappings(v) for k, v in d.items()}
    for item in overrides:
        key, sep, text = item.partition("=")
        path = [part.strip() for part in key.strip().split(".")]
        if not sep or len(path) < 2 or not all(path):
            raise ConfigError(f"override {item!r}: expected section.field=value")
        try:
            value = _parse_value(text)
        except ConfigError as error:
            raise ConfigError(f"override {item!r}: {error}") from None
        target = out
        for depth, part in enumerate(path[:-1]):
            if target.get(part) is None:
                target[part] = {}
            if not isinstance(target[part], Mapping):
                where = ".".join(path[: depth + 1])
                what = "a mapping of fields" if depth == 0 else "a mapping"
                raise ConfigError(
                    f"override {item!r}: {where}: must be {what}, got {_kind(target[part])}"
                )
            target = target[part]
        target[path[-1]] = value
    return out


def _copy_mappings(value: Any) -> Any:
    """``value`` with every nested mapping copied (overrides write into the copies)."""
    return {k: _copy_mappings(v) for k, v in value.items()} if isinstance(value, Mapping) else value


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    defaults: Mapping[str, Mapping[str, Any]] | None = None,
) -> ReproduceConfig:
    """The config in the YAML file ``path`` (None: the built-in default), with overrides.

    ``defaults`` (sections of fields, e.g. an environment study's
    :attr:`~agentrl_jax.reproduce.studies.Study.config_defaults`) replace the built-in default's
    values under the file's: a field the file does not give takes its value there first.

    Every problem is a :class:`ConfigError` naming the file (and the override, if one is
    involved) and the field: a missing, unreadable or empty file, YAML syntax errors, a key
    given twice, a top level that is not a mapping of sections, a section that is not a mapping
    of fields (``task: 0``, ``rl: false``, a list), unknown sections or fields, bad values.
    """
    data: Any = {}
    source = None
    if path is not None:
        path = Path(path)
        source = f"config {path}"
        data = read_yaml(path)
        _sections(data, _Where(source))  # the file's own structure, before overrides touch it
    if defaults:
        data = {
            name: {**dict(defaults.get(name) or {}), **dict(data.get(name) or {})}
            for name in {**defaults, **data}
        }
    data = apply_overrides(data, overrides)
    return config_from_dict(data, source=source, overrides=overrides)


def read_yaml(path: Path) -> Any:
    """The YAML document in ``path``; :class:`ConfigError` for a missing, unreadable or empty
    file, bad syntax or a key given twice."""
    if not path.is_file():
        raise ConfigError(f"config {path}: no such file")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"config {path}: not UTF-8 text ({error.reason} at byte {error.start})"
        ) from None
    try:
        data = _load_yaml(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"config {path}: not valid YAML ({_yaml_reason(error)})") from None
    if data is None:
        raise ConfigError(
            f"config {path}: the file is empty (no sections); give no config "
            "file for the built-in default, or {} for a file of defaults"
        )
    return data


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (PyYAML keeps the
    last silently, so a second ``rl:`` block would hide the first)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key; the base class reports it
                break
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader


def _yaml_reason(error: yaml.YAMLError) -> str:
    """A YAML error in one line: what is wrong and where (line and column, 1-based)."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else problem


def dump_config(config: ReproduceConfig) -> str:
    """YAML text of ``config`` (what a results folder stores as ``config.yaml``)."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
