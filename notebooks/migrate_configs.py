"""Rewrite configs stored in an earlier layout into the current one, once, in place.

The package reads only the current layout (:mod:`agentrl_jax.config_io`); a stored config of
an earlier version (a results folder's ``config.yaml``, a file in ``configs/``, a test's
fixture) is upgraded by this script, the one documented way::

    python notebooks/migrate_configs.py configs/*.yaml notebooks/**/config.yaml
    python notebooks/migrate_configs.py --check configs/*.yaml   # exit 1 if any would change

A file already in the current layout is left byte for byte as it is; a changed one is written
as ``yaml.dump`` writes it (sections and fields in their order, moved fields at the end of
their new section; comments are not kept). What moves (:func:`migrate`, pure, on plain data):

* the engine's section: ``rl``'s and ``eval``'s engine fields (``kv_cache_dtype``,
  ``prefill_chunk``, ``generation_layout``, ``kv_page_size``, ``kv_pages``) become
  ``engine``'s (``rl`` and ``eval`` must agree where both give one);
* the presets' hyper-parameters: ``rl.kl_coef``, ``rl.aggregation``, ``rl.clip_*``,
  ``rl.gigpo_*``, ``rl.gae_*`` and ``rl.value_clip`` become ``rl.preset_params`` (those no
  run's preset declares are dropped: they never had an effect);
* ``eval.gamma`` (the step-quality discount, the environment's own now) is dropped; a value
  other than the one it always was (0.95) is refused.
"""

from __future__ import annotations

import argparse
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


class MigrationError(ValueError):
    """A stored config this script cannot move without changing what it ran."""


def migrate(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` (sections of plain data) with the fields of earlier versions moved to where
    they live now (module docstring); a config without them is returned as it is. Pure."""
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


def migrate_file(path: Path, *, write: bool = True) -> bool:
    """Migrate the YAML config in ``path`` in place (unless not ``write``); whether it
    changed (or would)."""
    text = path.read_text()
    data = yaml.safe_load(text)
    if not isinstance(data, Mapping):
        raise MigrationError(f"{path}: not a mapping of sections")
    new = migrate(data)
    if new == data:
        return False
    if write:
        path.write_text(yaml.safe_dump(new, sort_keys=False))
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
            print(f"{path}: {error}", file=sys.stderr)
            return 2
    for path in changed:
        print(f"{'would migrate' if args.check else 'migrated'} {path}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    raise SystemExit(main())
