"""Reading and writing a config tree: YAML files, ``section.field=value`` overrides, the
structure of a tree of sections, building it from plain data, and writing it back.

A config *tree* is a frozen dataclass whose fields are sections, each a frozen config class
of the library that checks its own fields on construction (their declared ranges,
:mod:`agentrl_jax.validation`); ``sections`` maps each section's name to its class (the
training entry point's: :data:`agentrl_jax.train.config.SECTIONS`; the reproduction's:
:data:`agentrl_jax.reproduce.config.SECTIONS`). This module knows no section: it reads, checks
the structure, layers defaults, a file and overrides, builds, and dumps, for any tree.

Every problem is a :class:`~agentrl_jax.errors.ConfigError` (a ``ValueError``) naming the
file, the override if one set the value, and the field, e.g. ``config run.yaml: rl.group_size:
must be an int >= 2, got 1``: a missing, unreadable or empty file, YAML syntax errors, a key
given twice, a document nested too deep or using an alias, a top level that is not a mapping
of sections, a section that is not a mapping of fields (``task: 0``, ``rl: false``, a list),
unknown sections or fields (with the nearest known name), bad values.

Configs of earlier layouts are not read here: ``notebooks/migrate_configs.py`` rewrites a
stored one once into the current layout.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from agentrl_jax.errors import ConfigError, did_you_mean
from agentrl_jax.validation import UnreadableNumber, short_repr

# ---------------------------------------------------------------- building a tree


def build(
    root: type,
    sections: Mapping[str, type],
    d: Mapping[str, Any] | None,
    *,
    source: str | None = None,
    overrides: Sequence[str] = (),
) -> Any:
    """The tree ``root`` (its sections' classes in ``sections``) from plain data ``d``
    (``{section: {field: value}}``); missing sections and fields take ``root()``'s values.

    ``source`` (e.g. ``"config path/run.yaml"``) and the ``overrides`` already applied to ``d``
    name where a bad value came from: each :class:`ConfigError` reads
    ``"<source> with override '<item>': <section>.<field>: ..."``, naming the overrides of the
    section at fault (the source alone when none touched it; neither when both are absent).
    """
    where = Where(source, overrides)
    given = check_structure(d, sections, where)
    built, defaults = {}, root()
    for name, cls in sections.items():
        default = getattr(defaults, name)
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in given.get(name, {}).items()}
        try:
            built[name] = cls(
                **{**{f.name: getattr(default, f.name) for f in dataclasses.fields(cls)}, **values}
            )
        except ValueError as error:  # the section's own checks
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
        return root(**built)
    except ValueError as error:  # the checks across sections
        raise ConfigError(where.prefix(*sections) + str(error)) from None


@dataclasses.dataclass(frozen=True)
class Where:
    """Where a config's values came from (a file, overrides), for the prefix of its errors."""

    source: str | None
    overrides: Sequence[str] = ()

    def prefix(self, *sections: str) -> str:
        """``"<source> with override <items>: "``, the overrides those of ``sections`` (all
        of them when none is named); ``""`` when neither is known."""
        items = [
            o
            for o in self.overrides
            if not sections or o.partition("=")[0].strip().partition(".")[0] in sections
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


def check_structure(
    d: Any, sections: Mapping[str, type], where: Where = Where(None)
) -> dict[str, dict[str, Any]]:
    """``d``'s sections as ``{name: {field: value}}`` (a null section: ``{}``), after checking
    its structure: a mapping of the names in ``sections``, each a mapping (or null) of the
    field names of its class."""
    if d is None:
        return {}
    if not isinstance(d, Mapping):
        raise ConfigError(
            f"{where.prefix()}must be a mapping of sections ({', '.join(sections)}), got {kind(d)}"
        )
    out = {}
    for name, values in d.items():
        if name not in sections or not isinstance(name, str):
            raise ConfigError(
                f"{where.prefix(str(name))}unknown section {name!r}; known: {', '.join(sections)}"
                f"{did_you_mean(name, sections)}"
            )
        if values is None:
            values = {}
        if not isinstance(values, Mapping):
            raise ConfigError(
                f"{where.prefix(name)}{name}: must be a mapping of fields, got {kind(values)}"
            )
        fields = [f.name for f in dataclasses.fields(sections[name])]
        for field in values:
            if not isinstance(field, str) or field not in fields:
                raise ConfigError(
                    f"{where.prefix(name)}{name}: unknown field {field!r}; known: "
                    f"{', '.join(sorted(fields))}{did_you_mean(field, fields)}"
                )
        out[name] = dict(values)
    return out


def kind(value: Any) -> str:
    """A YAML value's kind and value, for messages: ``a list [1, 2]``, ``an int 0``."""
    kinds = (
        (bool, "a boolean"),
        (int, "an int"),
        (float, "a number"),
        (str, "a string"),
        (list, "a list"),
        (Mapping, "a mapping"),
    )
    name = next((name for cls, name in kinds if isinstance(value, cls)), type(value).__name__)
    return f"{name} {short_repr(value)}"


# ---------------------------------------------------------------- overrides and layers


def parse_value(text: str) -> Any:
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
    sections (:func:`build` checks the rest); it is not modified.
    """
    out = {k: _copy_mappings(v) for k, v in d.items()}
    for item in overrides:
        key, sep, text = item.partition("=")
        shown = short_repr(item, 120)  # errors quote the override, a huge value cut
        path = [part.strip() for part in key.strip().split(".")]
        if not sep or len(path) < 2 or not all(path):
            raise ConfigError(f"override {shown}: expected section.field=value")
        try:
            value = parse_value(text)
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
                    f"override {shown}: {where}: must be {what}, got {kind(target[part])}"
                )
            target = target[part]
        target[path[-1]] = value
    return out


def _copy_mappings(value: Any) -> Any:
    """``value`` with every nested mapping copied (overrides write into the copies)."""
    return {k: _copy_mappings(v) for k, v in value.items()} if isinstance(value, Mapping) else value


def merged(under: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` on ``under``, mappings merged key by key all the way down (a copy)."""
    out = {k: _copy_mappings(v) for k, v in under.items()}
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merged(out[key], value)
        else:
            out[key] = _copy_mappings(value)
    return out


# ---------------------------------------------------------------- YAML in and out


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


def dump_config(config: Any) -> str:
    """YAML text of ``config`` (what a results folder stores as ``config.yaml``), every value
    written out (no aliases: :func:`read_yaml` refuses them)."""
    return yaml.dump(config.to_dict(), Dumper=_NoAliasDumper, sort_keys=False)


class _NoAliasDumper(yaml.SafeDumper):
    def ignore_aliases(self, data):
        return True
