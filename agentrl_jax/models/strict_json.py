"""Strict JSON objects for the checkpoint loaders (``config.json``, the shard index, safetensors
headers): UTF-8, standard JSON (no ``NaN``/``Infinity``), an object at the top, no key twice,
no integer of more than :data:`MAX_INT_DIGITS` digits.

``json.loads`` alone accepts ``NaN``, keeps the last of two equal keys silently and raises its own
error types; :func:`load_json_object` raises the caller's error class with a message that names
the source, and never returns anything but a ``dict``.
"""

from __future__ import annotations

import json
from typing import Any


class _Rejected(Exception):
    """Raised inside ``json.loads`` hooks; turned into the caller's error."""


def load_json_object(
    data: bytes | str, *, source: str, what: str, error: type[ValueError]
) -> dict[str, Any]:
    """``data`` parsed as a JSON object; ``error(f"{source}: {what} ...")`` if it is not one."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise error(
                f"{source}: {what} is not UTF-8 text ({e.reason} at byte {e.start})"
            ) from None
    try:
        value = json.loads(
            data,
            object_pairs_hook=_unique_keys,
            parse_constant=_no_constants,
            parse_int=_bounded_int,
        )
    except json.JSONDecodeError as e:
        raise error(
            f"{source}: {what} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})"
        ) from None
    except _Rejected as e:
        raise error(f"{source}: {what} {e}") from None
    except RecursionError:
        raise error(f"{source}: {what} is nested too deeply to be read") from None
    if not isinstance(value, dict):
        raise error(f"{source}: {what} must be a JSON object, got {json_kind(value)}")
    return value


def json_kind(value: Any) -> str:
    """The JSON name of ``value``'s type ("an array", "a string", ...), for messages."""
    kinds = (
        (bool, "a boolean"),
        (int, "a number"),
        (float, "a number"),
        (str, "a string"),
        (list, "an array"),
        (dict, "an object"),
        (type(None), "null"),
    )
    return next((name for kind, name in kinds if isinstance(value, kind)), type(value).__name__)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Rejected(f"has the key {key!r} twice")
        out[key] = value
    return out


# Digits an integer may have: more than any size, count or offset a checkpoint holds (Python
# itself refuses to read more than 4,300, with a ValueError of its own).
MAX_INT_DIGITS = 100


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise _Rejected(f"holds an integer of {digits:,} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _no_constants(name: str) -> Any:
    raise _Rejected(f"is not valid JSON ({name} is not a JSON value)")
