"""Rewrite configs stored in an earlier layout into the current one, once, in place.

The package reads only the current layout (:mod:`agentrl_jax.config_io`); a stored config of
an earlier version (a results folder's ``config.yaml``, a file in ``configs/``, a test's
fixture) is upgraded by this script, the one documented way::

    python notebooks/migrate_configs.py configs/*.yaml notebooks/**/config.yaml
    python notebooks/migrate_configs.py --check configs/*.yaml   # exit 1 if any would change

A file already in the current layout is left byte for byte as it is. A changed one keeps its
text, comments included, where only fields of a section move into subsections of it (each
moved field, with the comment lines just above it, goes into its subsection, written where
the first of them stood; :func:`nest_text`); otherwise it is written as ``yaml.safe_dump``
writes it (sections and fields in their order, moved fields at the end of their new section;
comments are not kept); a file ``yaml.safe_dump`` wrote (a results folder's ``config.yaml``) is
written again in the order the package writes its fields. Either way the file reads as
:func:`migrate` says. What moves (:func:`migrate`, pure, on plain data):

* the engine's section: ``rl``'s and ``eval``'s engine fields (``kv_cache_dtype``,
  ``prefill_chunk``, ``generation_layout``, ``kv_page_size``, ``kv_pages``) become
  ``engine``'s (``rl`` and ``eval`` must agree where both give one);
* the presets' hyper-parameters: ``rl.kl_coef``, ``rl.aggregation``, ``rl.clip_*``,
  ``rl.gigpo_*``, ``rl.gae_*`` and ``rl.value_clip`` become ``rl.preset_params`` (those no
  run's preset declares are dropped: they never had an effect);
* ``eval.gamma`` (the step-quality discount, the environment's own now) is dropped; a value
  other than the one it always was (0.95) is refused;
* ``rl``'s flat fields go to the subsections of their concern (:data:`NESTED`):
  ``rl.sampling`` (``temperature``, ``top_k``, ``top_p``), ``rl.optimizer`` (``learning_rate``,
  ``weight_decay``, ``adam_*``, ``max_grad_norm``, ``critic_*``), ``rl.batching`` (``epochs``,
  ``mini_batches``, ``num_micro_batches``), ``rl.memory`` (``remat``, ``attention``,
  ``logits_chunk``, ``packing``), ``rl.asynchronous`` (``max_staleness``, ``off_policy_cap``),
  ``rl.checkpoint`` (``checkpoint_every`` and ``checkpoint_keep`` as ``every`` and ``keep``),
  ``rl.logging`` (``tensorboard``, ``wandb_project``); ``eval.temperature`` and ``eval.top_p``
  go to ``eval.sampling``, with ``top_k: 0`` (the evaluation never truncated to the top k; the
  class is ``rl.sampling``'s, which has the field).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path
from typing import Any, Mapping

import yaml

from agentrl_jax.train.presets import declared_defaults
from agentrl_jax.validation import short_repr

_TO_ENGINE = ("kv_cache_dtype", "prefill_chunk", "generation_layout", "kv_page_size", "kv_pages")
_EVAL_TO_ENGINE = ("kv_cache_dtype", "prefill_chunk", "kv_page_size")
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


# section -> {old field: (subsection, field there)}
NESTED: dict[str, dict[str, tuple[str, str]]] = {
    "rl": {
        **{f: ("sampling", f) for f in ("temperature", "top_k", "top_p")},
        **{
            f: ("optimizer", f)
            for f in (
                "learning_rate",
                "weight_decay",
                "adam_b1",
                "adam_b2",
                "adam_eps",
                "max_grad_norm",
                "critic_learning_rate",
                "critic_weight_decay",
            )
        },
        **{f: ("batching", f) for f in ("epochs", "mini_batches", "num_micro_batches")},
        **{f: ("memory", f) for f in ("remat", "attention", "logits_chunk", "packing")},
        **{f: ("asynchronous", f) for f in ("max_staleness", "off_policy_cap")},
        "checkpoint_every": ("checkpoint", "every"),
        "checkpoint_keep": ("checkpoint", "keep"),
        **{f: ("logging", f) for f in ("tensorboard", "wandb_project")},
    },
    "eval": {f: ("sampling", f) for f in ("temperature", "top_p")},
}


# what a nested subsection holds that the flat fields did not state: the evaluation never
# truncated to the top k (eval.sampling is rl.sampling's class, which has top_k)
IMPLIED = {"eval": {"sampling": {"top_k": 0}}}
_ORDER = {"temperature": 0, "top_k": 1, "top_p": 2}  # sampling's fields, as its class has them


class MigrationError(ValueError):
    """A stored config this script cannot move without changing what it ran."""


def migrate(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` (sections of plain data) with the fields of earlier versions moved to where
    they live now (module docstring); a config without them is returned as it is. Pure."""
    return _nest(_move_to_engine_and_params(data))


def _nest(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with the flat fields of :data:`NESTED` moved into their subsections."""
    out = dict(data)
    for section, moves in NESTED.items():
        fields = out.get(section)
        if not isinstance(fields, Mapping) or not any(f in fields for f in moves):
            continue
        nested: dict[str, Any] = {}
        for field, value in fields.items():
            if field in moves:
                group, name = moves[field]
                if group in fields and not isinstance(fields[group], Mapping):
                    raise MigrationError(
                        f"{section}.{group}: {short_repr(fields[group])}, but {section}.{field} "
                        f"belongs in it ({section}.{group}.{name})"
                    )
                below = nested.setdefault(group, dict(fields.get(group) or {}))
                if name in below and below[name] != value:
                    raise MigrationError(
                        f"{section}.{field}: {short_repr(value)}, but {section}.{group}.{name} is "
                        f"{short_repr(below[name])}"
                    )
                below[name] = value
        for group, implied in IMPLIED.get(section, {}).items():
            if group in nested:
                nested[group] = {**implied, **nested[group]}
        out[section] = {
            **{k: v for k, v in fields.items() if k not in moves and k not in nested},
            **{
                group: dict(sorted(values.items(), key=lambda kv: _ORDER.get(kv[0], 99)))
                for group, values in nested.items()
            },
        }
    return out


def _move_to_engine_and_params(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with the engine's fields and the presets' hyper-parameters moved out of ``rl``
    and ``eval`` (module docstring)."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in data.items()}
    rl, ev = out.get("rl"), out.get("eval")
    rl = rl if isinstance(rl, dict) else {}
    ev = ev if isinstance(ev, dict) else {}
    old_rl = [f for f in (*_TO_ENGINE, *_TO_PRESET_PARAMS) if f in rl]
    old_eval = [f for f in (*_EVAL_TO_ENGINE, "gamma") if f in ev]
    if not (old_rl or old_eval):
        return out
    engine = dict(out.get("engine") or {})
    for field in _TO_ENGINE:
        if field in rl:
            engine[field] = rl.pop(field)
    for field in _EVAL_TO_ENGINE:
        if field in ev:
            value = ev.pop(field)
            if field in engine and engine[field] != value:
                raise MigrationError(
                    f"eval.{field}: {short_repr(value)}, but rl.{field} is "
                    f"{short_repr(engine[field])}: the sampling engine is one section now "
                    f"(engine.{field}), shared by the rollouts and the evaluation"
                )
            engine[field] = value
    if "gamma" in ev:
        gamma = ev.pop("gamma")
        if gamma != _STEP_QUALITY_GAMMA:
            raise MigrationError(
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


def nest_text(text: str) -> str:
    """``text`` (a block-style YAML config) with :data:`NESTED`'s flat fields moved into their
    subsections as text: each moved field's lines (the comment lines just above it, the key,
    its deeper lines) indented two more spaces under ``  subsection:``, which stands where the
    first of them stood (:data:`IMPLIED`'s fields last); every other line, comments included,
    as it was. A subsection already
    written in the section is left alone (:func:`migrate_text` then dumps instead)."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    i = 0
    while i < len(lines):
        header = re.match(r"([A-Za-z_]+):\s*(#.*)?$", lines[i])
        out.append(lines[i])
        i += 1
        if header is None or header.group(1) not in NESTED:
            continue
        moves = NESTED[header.group(1)]
        end = i
        while end < len(lines) and (not lines[end].strip() or lines[end].startswith(" ")):
            end += 1
        items: list[tuple[str | None, list[str]]] = []  # (field, lines), comments above kept
        pending: list[str] = []
        for line in lines[i:end]:
            key = re.match(r"  ([A-Za-z_]+):", line)
            if key and not line.startswith("   "):
                items.append((key.group(1), [*pending, line]))
                pending = []
            elif line.strip().startswith("#") or not line.strip():
                pending.append(line)
            else:  # a deeper line of the item above
                items[-1][1].append(line) if items else pending.append(line)
        groups: dict[str, list[str]] = {}
        placed: list[tuple[str | None, list[str]]] = []
        for field, item in items:
            if field in moves:
                group, name = moves[field]
                if group not in groups:
                    groups[group] = [f"  {group}:\n"]
                    placed.append((group, groups[group]))
                for line in item:
                    if line.strip() and re.match(rf"  {field}:", line):
                        line = f"    {name}:" + line[len(f"  {field}:") :]
                    elif line.strip():
                        line = "  " + line
                    groups[group].append(line)
            else:
                placed.append((None, item))
        section = header.group(1)
        for group, lines_of_group in groups.items():
            given = {moves[f][1] for f, _ in items if f in moves and moves[f][0] == group}
            for name, value in IMPLIED.get(section, {}).get(group, {}).items():
                if name not in given:
                    lines_of_group.append(f"    {name}: {yaml.safe_dump(value).split()[0]}\n")
        out += [line for _, item in placed for line in item] + pending
        i = end
    return "".join(out)


def migrate_text(text: str) -> str:
    """The YAML config ``text`` migrated (:func:`migrate`): its own text with the fields moved
    (:func:`nest_text`) where that reads as :func:`migrate` says, else ``yaml.safe_dump``'s."""
    data = yaml.safe_load(text)
    if not isinstance(data, Mapping):
        raise MigrationError("not a mapping of sections")
    new = migrate(data)
    if new == data:
        return text
    if text == yaml.safe_dump(data, sort_keys=False):  # written by the package: write it so
        return yaml.safe_dump(_in_field_order(new), sort_keys=False)
    nested = nest_text(text)
    try:
        if yaml.safe_load(nested) == new:
            return nested
    except yaml.YAMLError:
        pass
    return yaml.safe_dump(new, sort_keys=False)


def _in_field_order(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with the fields of ``rl`` and ``eval`` in the order of the package's classes
    (those it does not know last), as a results folder's ``config.yaml`` is written."""
    from agentrl_jax.evaluation.config import EvalConfig  # noqa: PLC0415
    from agentrl_jax.train.config import RLConfig  # noqa: PLC0415

    out = dict(data)
    for section, cls in (("rl", RLConfig), ("eval", EvalConfig)):
        fields = out.get(section)
        if isinstance(fields, Mapping):
            order = {f.name: i for i, f in enumerate(dataclasses.fields(cls))}
            out[section] = dict(sorted(fields.items(), key=lambda kv: order.get(kv[0], len(order))))
    return out


def migrate_file(path: Path, *, write: bool = True) -> bool:
    """Migrate the YAML config in ``path`` in place (unless not ``write``); whether it
    changed (or would)."""
    text = path.read_text()
    try:
        new = migrate_text(text)
    except MigrationError as error:
        raise MigrationError(f"{path}: {error}") from None
    if new == text:
        return False
    if write:
        path.write_text(new)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path, help="YAML config files")
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if any file would change"
    )
    args = parser.parse_args(argv)
    changed = []
    for path in args.paths:
        try:
            if migrate_file(path, write=not args.check):
                changed.append(path)
        except MigrationError as error:
            print(error, file=sys.stderr)
            return 2
    for path in changed:
        print(f"{'would migrate' if args.check else 'migrated'} {path}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    raise SystemExit(main())
