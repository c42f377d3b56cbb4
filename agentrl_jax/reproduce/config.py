"""The reproduction's configuration: one tree of frozen sections, validated on construction,
read from YAML.

A :class:`ReproduceConfig` is the library's :class:`~agentrl_jax.train.config.Config` (the
sections the training entry point reads) and the reproduction's own::

    task:        the environment (a registered name), its options, T_max, task counts, lengths
    model:       a random-init Qwen3 of given dimensions with a small tokenizer, or a local
                 Qwen3 directory (paper scale)                       (:mod:`.settings`)
    warm_start:  behaviour cloning on the study's imperfect demonstrations (the "base" policy)
    engine:      the sampling engine, shared by the RL rollouts and the evaluation
    rl:          the RL runs (presets and compositions) and their trainer settings
    eval:        :class:`~agentrl_jax.evaluation.config.EvalConfig` (Pass@(K, T), diagnostics)
    mesh:        :class:`~agentrl_jax.sharding.MeshConfig` (data, fsdp, tensor axes)

Defaults come in one order: the classes' own (the library's: the paper's where it gives them),
then the environment's study (:attr:`~agentrl_jax.reproduce.studies.Study.config_defaults`:
``agentrl-jax reproduce ENV``'s CPU-sized default, the one place an environment's defaults
live; :func:`default_config`), then a file (``configs/*.yaml`` only override), then
``section.field=value`` overrides (:func:`load_config`). Every bad value raises
:class:`~agentrl_jax.errors.ConfigError` (a ``ValueError``) naming the file, the override if one
set it, and the field, e.g. ``config run.yaml: rl.group_size: must be an int >= 2, got 1``;
unknown sections and fields are errors too (a typo never silently falls back to a default),
and so is a file of the wrong structure (``task: 0``, ``rl: false``, a list where a mapping
belongs, a key given twice, an empty file).

Configs written before the engine had a section of its own and before the presets declared
their hyper-parameters (stored results folders' ``config.yaml``) are read through
:func:`migrate`: ``rl``'s and ``eval``'s engine fields become ``engine``'s, ``rl.kl_coef``,
``rl.aggregation``, ``rl.clip_*``, ``rl.gigpo_*``, ``rl.gae_*`` and ``rl.value_clip`` become
``rl.preset_params`` (those no run's preset reads are dropped: they never had an effect), and
``eval.gamma`` (the step-quality discount, now the environment's own) is dropped.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from agentrl_jax.errors import ConfigError, did_you_mean
from agentrl_jax.evaluation.config import EvalConfig
from agentrl_jax.models.lora import projection_shapes
from agentrl_jax.reproduce.settings import ModelConfig, WarmStartConfig
from agentrl_jax.sampling.config import EngineConfig
from agentrl_jax.sharding import MeshConfig
from agentrl_jax.train.config import Config, RLConfig, TaskConfig
from agentrl_jax.train.presets import declared_defaults
from agentrl_jax.validation import UnreadableNumber, short_repr

_SECTIONS: dict[str, type] = {
    "task": TaskConfig,
    "model": ModelConfig,
    "warm_start": WarmStartConfig,
    "engine": EngineConfig,
    "rl": RLConfig,
    "eval": EvalConfig,
    "mesh": MeshConfig,
}


@dataclasses.dataclass(frozen=True)
class ReproduceConfig(Config):
    """The whole reproduction (see the module docstring)."""

    model: ModelConfig = ModelConfig()
    warm_start: WarmStartConfig = WarmStartConfig()
    eval: EvalConfig = EvalConfig(
        max_response_tokens=TaskConfig.max_response_tokens, max_context=TaskConfig.max_context
    )

    def __post_init__(self):
        super().__post_init__()
        for name in ("model", "warm_start", "eval"):
            if not isinstance(getattr(self, name), _SECTIONS[name]):
                raise ConfigError(
                    f"{name}: must be a {_SECTIONS[name].__name__}, "
                    f"got {short_repr(getattr(self, name))}"
                )
        if self.eval.budgets is not None and max(self.eval.budgets) > self.task.t_max:
            raise ConfigError(
                f"eval.budgets: must be <= task.t_max ({self.task.t_max}), "
                f"got {list(self.eval.budgets)}"
            )
        if self.rl.process_reward_coef > 0 and self.rl.process_rewards is None:
            raise ConfigError(
                f"rl.process_reward_coef: {self.rl.process_reward_coef} weighs process rewards, "
                "but rl.process_rewards names none (oracle or judge)"
            )
        if self.rl.lora is not None and self.model.model_dir is None:  # a loaded model: at setup
            m = self.model
            self.rl.lora.check_rank(
                projection_shapes(
                    m.hidden_size,
                    m.intermediate_size,
                    m.num_attention_heads,
                    m.num_key_value_heads,
                    m.head_dim,
                )
            )
        if self.model.tokenizer_isolate and self.study.tokenizer_isolate is None:
            raise ConfigError(
                f"model.tokenizer_isolate: the {self.task.env} environment's study "
                "declares no pieces to isolate (its Study.tokenizer_isolate)"
            )

    @property
    def study(self):
        """The environment's study (:func:`agentrl_jax.reproduce.studies.study_for`)."""
        from agentrl_jax.reproduce.studies import study_for  # noqa: PLC0415

        return study_for(self.task.env)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (YAML/JSON), a copy; ``config_from_dict(c.to_dict()) == c``."""
        sections = self.plain_sections()
        return {name: sections[name] for name in _SECTIONS}


def env_defaults(env: str) -> dict[str, dict[str, Any]]:
    """The defaults of ``agentrl-jax reproduce ENV``: the environment's study's
    (:attr:`~agentrl_jax.reproduce.studies.Study.config_defaults`), with ``task.env``."""
    import envs  # noqa: PLC0415
    from agentrl_jax.reproduce.studies import study_for  # noqa: PLC0415

    envs.entry(env)  # an unregistered name is refused, naming the registered ones
    defaults = study_for(env).config_defaults
    return {**defaults, "task": {**defaults.get("task", {}), "env": env}}


def default_config(env: str = "frozenlake", overrides: Sequence[str] = ()) -> ReproduceConfig:
    """The built-in default of ``agentrl-jax reproduce ENV`` (its study's defaults over the
    classes'), with ``section.field=value`` overrides."""
    return load_config(None, overrides, env=env)


# ---------------------------------------------------------------- configs of earlier versions

_TO_ENGINE = ("kv_cache_dtype", "prefill_chunk", "generation_layout", "kv_page_size", "kv_pages")
_TO_PRESET_PARAMS = (
    "kl_coef",
    "aggregation",
    "clip_low",
    "clip_high",
    "gigpo_omega",
    "gigpo_gamma",
    "gae_gamma",
    "gae_lambda",
    "value_clip",
)
_STEP_QUALITY_GAMMA = 0.95  # the one step-quality discount eval.gamma once repeated (§7)


def migrate(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` (sections of plain data) with the fields of earlier versions moved to where
    they live now (module docstring); a config without them is returned as it is. Pure."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in data.items()}
    rl, ev = out.get("rl"), out.get("eval")
    rl = rl if isinstance(rl, dict) else {}
    ev = ev if isinstance(ev, dict) else {}
    old_rl = [f for f in (*_TO_ENGINE, *_TO_PRESET_PARAMS) if f in rl]
    old_eval = [f for f in ("kv_cache_dtype", "prefill_chunk", "kv_page_size", "gamma") if f in ev]
    if not (old_rl or old_eval):
        return out
    engine = dict(out.get("engine") or {})
    for field in _TO_ENGINE:
        if field in rl:
            engine[field] = rl.pop(field)
    for field in ("kv_cache_dtype", "prefill_chunk", "kv_page_size"):
        if field in ev:
            value = ev.pop(field)
            if field in engine and engine[field] != value:
                raise ConfigError(
                    f"eval.{field}: {short_repr(value)}, but rl.{field} is "
                    f"{short_repr(engine[field])}: the sampling engine is one section now "
                    f"(engine.{field}), shared by the rollouts and the evaluation"
                )
            engine[field] = value
    if "gamma" in ev:
        gamma = ev.pop("gamma")
        if gamma != _STEP_QUALITY_GAMMA:
            raise ConfigError(
                f"eval.gamma: {short_repr(gamma)}; the step quality's discount is the "
                f"environment's own now ({_STEP_QUALITY_GAMMA}, §7), not a setting"
            )
    declared = declared_defaults(rl.get("runs", ()))
    params = dict(rl.get("preset_params") or {})
    for field in _TO_PRESET_PARAMS:
        if field in rl:
            value = rl.pop(field)
            if field in declared:  # the others no run read: they never had an effect
                params[field] = value
    if params:
        rl["preset_params"] = params
    out["rl"], out["eval"], out["engine"] = rl, ev, engine
    return {k: v for k, v in out.items() if v != {} or k in data}


# ---------------------------------------------------------------- building and reading


def config_from_dict(
    d: Mapping[str, Any] | None, *, source: str | None = None, overrides: Sequence[str] = ()
) -> ReproduceConfig:
    """A :class:`ReproduceConfig` from plain data; missing sections and fields take the
    classes' defaults; fields of earlier versions are moved first (:func:`migrate`).

    ``source`` (e.g. ``"config path/run.yaml"``) and the ``overrides`` already applied to ``d``
    name where a bad value came from: each :class:`ConfigError` reads
    ``"<source> with override '<item>': <section>.<field>: ..."``, naming the overrides of the
    section at fault (the source alone when none touched it; neither when both are absent).
    """
    where = _Where(source, overrides)
    d = _sections(d, where, known=_OLD_FIELDS)
    try:
        d = migrate(d)
    except ConfigError as error:
        raise ConfigError(where.prefix("rl", "eval", "engine") + str(error)) from None
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
        except ValueError as error:  # the sections' own checks (and MeshConfig's, EvalConfig's)
            message = str(error)
            raise ConfigError(
                where.prefix(name)
                + (
                    message
                    if message.startswith((f"{name}.", f"{name}:"))
                    else f"{name}: {message}"
                )
            ) from None
    try:
        return ReproduceConfig(**built)
    except ValueError as error:
        raise ConfigError(
            where.prefix("task", "eval", "engine", "model", "rl") + str(error)
        ) from None


# fields of earlier versions, accepted by the structure check before migrate() moves them
_OLD_FIELDS = {
    "rl": (*_TO_ENGINE, *_TO_PRESET_PARAMS),
    "eval": ("kv_cache_dtype", "prefill_chunk", "kv_page_size", "gamma"),
}


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
                [
                    self.source,
                    f"override {', '.join(short_repr(o, 120) for o in items)}" if items else "",
                ],
            )
        )
        return f"{named}: " if named else ""


def _sections(
    d: Any, where: _Where, known: Mapping[str, Sequence[str]] | None = None
) -> dict[str, dict[str, Any]]:
    """``d``'s sections as ``{name: {field: value}}``, after checking its structure: a mapping of
    known section names, each a mapping (or null) of known field names (and ``known``'s
    extra fields of each section)."""
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
                f"{did_you_mean(name, _SECTIONS)}"
            )
        if values is None:
            values = {}
        if not isinstance(values, Mapping):
            raise ConfigError(
                f"{where.prefix(name)}{name}: must be a mapping of fields, got {_kind(values)}"
            )
        fields = [f.name for f in dataclasses.fields(_SECTIONS[name])]
        extra = (known or {}).get(name, ())
        for field in values:
            if not isinstance(field, str) or (field not in fields and field not in extra):
                raise ConfigError(
                    f"{where.prefix(name)}{name}: unknown field {field!r}; known: "
                    f"{', '.join(sorted(fields))}{did_you_mean(field, [*fields, *extra])}"
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
    except _Refused as error:
        raise ConfigError(str(error)) from None
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
        shown = short_repr(item, 120)  # errors quote the override, a huge value cut
        path = [part.strip() for part in key.strip().split(".")]
        if not sep or len(path) < 2 or not all(path):
            raise ConfigError(f"override {shown}: expected section.field=value")
        try:
            value = _parse_value(text)
        except ConfigError as error:
            raise ConfigError(f"override {shown}: {error}") from None
        target = out
        for depth, part in enumerate(path[:-1]):
            if target.get(part) is None:
                target[part] = {}
            if not isinstance(target[part], Mapping):
                where = ".".join(path[: depth + 1])
                what = "a mapping of fields" if depth == 0 else "a mapping"
                raise ConfigError(
                    f"override {shown}: {where}: must be {what}, got {_kind(target[part])}"
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
    env: str | None = None,
    defaults: Mapping[str, Mapping[str, Any]] | None = None,
) -> ReproduceConfig:
    """The config in the YAML file ``path`` (None: the built-in default) with ``overrides``,
    over the defaults of its environment: ``env``, else the one the file (or an override)
    names in ``task.env``, else ``frozenlake`` (:func:`env_defaults`; ``defaults`` replaces
    them). A field the file does not give takes its value there first (a mapping field, e.g.
    ``rl.preset_params``, key by key); the overrides come last.

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
        # the file's own structure, before overrides touch it
        _sections(data, _Where(source), known=_OLD_FIELDS)
    if defaults is None:
        named = (apply_overrides(data, overrides).get("task") or {}).get("env")
        env = env or (named if isinstance(named, str) else None) or "frozenlake"
        try:
            defaults = env_defaults(env)
        except ValueError as error:  # an unregistered environment
            raise ConfigError(
                f"{_Where(source, overrides).prefix('task')}task.env: {error}"
            ) from None
    data = {
        name: {} if fields is None else fields for name, fields in data.items()
    }  # null: none set
    given = apply_overrides(data, overrides)
    data = apply_overrides(_merged(defaults, data), overrides)
    _drop_undeclared_default_params(data, given)
    return config_from_dict(data, source=source, overrides=overrides)


def _drop_undeclared_default_params(data: dict[str, Any], given: Mapping[str, Any]) -> None:
    """Drops from ``data``'s ``rl.preset_params`` the hyper-parameters the defaults set that
    none of its runs' presets declares (the CPU default's ``kl_coef`` under ``rl.runs=[dapo]``):
    a default applies where it can. One the file or an override sets stays, and is refused if
    no preset declares it."""
    rl, mine = data.get("rl"), given.get("rl")
    params = rl.get("preset_params") if isinstance(rl, Mapping) else None
    if not isinstance(params, Mapping) or not isinstance(rl.get("runs"), (list, tuple)):
        return
    stated = mine.get("preset_params") if isinstance(mine, Mapping) else None
    stated = stated if isinstance(stated, Mapping) else {}
    try:
        declared = declared_defaults(rl["runs"])
    except (TypeError, AttributeError):  # a malformed run: the config's checks will name it
        return
    rl["preset_params"] = {
        name: value for name, value in params.items() if name in declared or name in stated
    }


def _merged(under: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` on ``under``, mappings merged key by key all the way down (a copy)."""
    out = {k: _copy_mappings(v) for k, v in under.items()}
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merged(out[key], value)
        else:
            out[key] = _copy_mappings(value)
    return out


def read_yaml(path: Path) -> Any:
    """The YAML document in ``path``; :class:`ConfigError` for a missing, unreadable or empty
    file (or a folder), bad syntax or a key given twice."""
    try:
        if path.is_dir():
            raise ConfigError(f"config {path}: is a folder, not a file")
        if not path.is_file():
            raise ConfigError(f"config {path}: no such file")
        raw = path.read_bytes()
    except OSError as error:  # permissions, a broken mount
        raise ConfigError(f"config {path}: cannot be read ({error.strerror or error})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"config {path}: not UTF-8 text ({error.reason} at byte {error.start})"
        ) from None
    try:
        data = _load_yaml(text)
    except _Refused as error:
        raise ConfigError(f"config {path}: {error}") from None
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
    last silently, so a second ``rl:`` block would hide the first), and reads an integer too
    long for Python (more than 4,300 decimal digits) as an
    :class:`~agentrl_jax.validation.UnreadableNumber`, which the field it is given to refuses
    by name (PyYAML would end in a traceback)."""

    def construct_yaml_int(self, node):
        try:
            return super().construct_yaml_int(node)
        except ValueError:
            return UnreadableNumber(sum(c.isdigit() for c in str(node.value)))

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


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_yaml_int)

MAX_DEPTH = 32  # nested collections a config may hold (the deepest real one: 5)


class _Refused(yaml.YAMLError):
    """A document this reader refuses although YAML allows it: one nested deeper than
    :data:`MAX_DEPTH` (PyYAML composes recursively: Python's recursion would run out), or
    one with an alias (a collection could hold itself, or expand a billionfold)."""


def _load_yaml(text: str) -> Any:
    """The YAML document in ``text``, after an iterative scan of its tokens has checked that
    no collection lies more than :data:`MAX_DEPTH` deep and that no alias (``*name``) is used
    (configs, :func:`dump_config`'s included, write each value out)."""
    depth = 0
    opening = (yaml.BlockMappingStartToken, yaml.BlockSequenceStartToken)
    opening += (yaml.FlowMappingStartToken, yaml.FlowSequenceStartToken)
    closing = (yaml.BlockEndToken, yaml.FlowMappingEndToken, yaml.FlowSequenceEndToken)
    for token in yaml.scan(text, Loader=_StrictLoader):
        where = f"at line {token.start_mark.line + 1}, column {token.start_mark.column + 1}"
        if isinstance(token, opening):
            depth += 1
            if depth > MAX_DEPTH:
                raise _Refused(f"nested more than {MAX_DEPTH} levels deep {where}")
        elif isinstance(token, closing):
            depth -= 1
        elif isinstance(token, yaml.AliasToken):
            raise _Refused(f"a YAML alias (*{token.value}) {where}: write the value out")
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader


def _yaml_reason(error: yaml.YAMLError) -> str:
    """A YAML error in one line: what is wrong and where (line and column, 1-based)."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else problem


def dump_config(config: ReproduceConfig) -> str:
    """YAML text of ``config`` (what a results folder stores as ``config.yaml``), every value
    written out (no aliases: :func:`read_yaml` refuses them)."""
    return yaml.dump(config.to_dict(), Dumper=_NoAliasDumper, sort_keys=False)


class _NoAliasDumper(yaml.SafeDumper):
    def ignore_aliases(self, data):
        return True
