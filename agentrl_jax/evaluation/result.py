"""What an analysis' ``compute`` returns: a frozen dataclass of arrays and numbers, and its one
JSON round trip.

* :func:`to_jsonable`: plain JSON types from any result (arrays become lists, records with a
  ``to_dict`` or dataclasses become objects, non-finite floats become ``None``: JSON has no NaN).
* :class:`Result` (declare subclasses with :func:`result`): ``to_json()`` is
  :func:`to_jsonable`; ``from_json(data)`` rebuilds the record from the field annotations
  (arrays, numbers, strings, nested dataclasses, ``dict``, ``tuple``, ``X | None``), a ``None``
  float or array entry reading back as NaN; ``==`` compares arrays by value with NaN equal to
  NaN, so ``Result.from_json(r.to_json()) == r``.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, Mapping

import numpy as np


def to_jsonable(obj: Any) -> Any:
    """Plain JSON types from results: numpy arrays/scalars, result records (``to_dict``),
    dataclasses, mappings, sequences, Paths. Non-finite floats become ``None`` (JSON has
    no NaN)."""
    if hasattr(obj, "to_dict") and callable(obj.to_dict):
        return to_jsonable(obj.to_dict())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable(dataclasses.asdict(obj))
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, np.ndarray):
        return to_jsonable(obj.tolist())
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    if obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"to_jsonable: cannot write {type(obj).__name__} as JSON")


def _array(value: Any) -> np.ndarray:
    """A JSON list as an array; ``None`` entries (written NaN) make it float64 with NaN."""
    arr = np.asarray(value)
    return np.asarray(value, dtype=np.float64) if arr.dtype == object or arr.size == 0 else arr


def from_jsonable(hint: Any, value: Any) -> Any:
    """``value`` (plain JSON) as the type ``hint`` (a field annotation) describes."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return from_jsonable(inner, value)
    if hint is Any:
        return value
    if hint is np.ndarray:
        return _array(value)
    if hint is float:
        return math.nan if value is None else float(value)
    if hint in (int, str, bool):
        return hint(value)
    if origin in (dict, Mapping, typing.Mapping) or hint is dict:
        key, item = args or (Any, Any)
        return {from_jsonable(key, k): from_jsonable(item, v) for k, v in value.items()}
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(from_jsonable(args[0], v) for v in value)
        return tuple(from_jsonable(a, v) for a, v in zip(args, value, strict=True))
    if origin is list:
        return [from_jsonable(args[0] if args else Any, v) for v in value]
    if dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        return hint(
            **{
                f.name: from_jsonable(hints[f.name], value[f.name])
                for f in dataclasses.fields(hint)
                if f.init
            }
        )
    raise TypeError(f"from_jsonable: cannot read {hint!r} from JSON")


def same(a: Any, b: Any) -> bool:
    """Equality of results: arrays and floats by value with NaN == NaN, mappings with the same
    keys in the same order, dataclasses field by field."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        numeric = a.dtype.kind in "fc" and b.dtype.kind in "fc"
        return a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=numeric))
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(
            same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
        )
    if isinstance(a, Mapping):
        return isinstance(b, Mapping) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(same(x, y) for x, y in zip(a, b))
        )
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


class Result:
    """Base of the analyses' results (see the module docstring); declare with :func:`result`."""

    def to_json(self) -> dict:
        return to_jsonable(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]):
        return from_jsonable(cls, data)

    def __eq__(self, other: object) -> bool:
        return same(self, other)

    __hash__ = None  # arrays inside: not hashable


def result(cls: type) -> type:
    """``@result class X(Result)``: a frozen dataclass keeping :class:`Result`'s ``==``."""
    return dataclasses.dataclass(frozen=True, eq=False)(cls)
