"""Field checks for the frozen, validated-on-construction config dataclasses.

A check is a pair ``(predicate, expectation)``: ``predicate(value)`` says whether the value is
acceptable, ``expectation`` completes the sentence "must be ...". :func:`validate` applies a
table of them to an object's fields and raises :class:`~agentrl_jax.errors.ConfigError`
``"<prefix>.<field>: must be <expectation>, got <value>"`` for the first that fails. Every config
class (reproduction sections, :class:`~agentrl_jax.models.config.Qwen3Config`,
:class:`~agentrl_jax.train.config.TrainConfig`, evaluation settings) validates through it, so
messages read the same everywhere and a check is written once.

All checks are pure and never raise on a value of an unexpected type (a list where a number
belongs is a failed check, not a ``TypeError``).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Iterable, Mapping

from agentrl_jax.errors import ConfigError

Check = tuple[Callable[[Any], bool], str]


def is_int(value: Any, lo: int | None = None) -> bool:
    """An integer (not a bool), at least ``lo`` if given."""
    return (
        isinstance(value, numbers.Integral)
        and not isinstance(value, bool)
        and (lo is None or value >= lo)
    )


def is_real(value: Any) -> bool:
    """A finite real number (not a bool; not an int too large for a float)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def integer(lo: int | None = None, hi: int | None = None) -> Check:
    if hi is not None:
        return (lambda v: is_int(v, lo) and v <= hi), f"an int in [{lo}, {hi}]"
    return (lambda v: is_int(v, lo)), "an int" + (f" >= {lo}" if lo is not None else "")


def real(lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> Check:
    def check(v: Any) -> bool:
        if not is_real(v):
            return False
        if lo is not None and (v <= lo if lo_open else v < lo):
            return False
        return hi is None or v <= hi

    bounds = [
        f"{'>' if lo_open else '>='} {lo}" if lo is not None else "",
        f"<= {hi}" if hi is not None else "",
    ]
    return check, "a finite number" + "".join(f" {b}" for b in bounds if b)


BOOL: Check = (lambda v: isinstance(v, bool), "true or false")


def optional(check: Check) -> Check:
    return (lambda v: v is None or check[0](v)), f"null or {check[1]}"


def one_of(options: Iterable[Any], *, nullable: bool = False) -> Check:
    """One of ``options`` (compared by type and value, so ``1`` is not ``True``)."""
    options = tuple(options)

    def check(v: Any) -> bool:
        if v is None:
            return nullable
        return any(type(v) is type(o) and v == o for o in options)

    return check, f"{'null or ' if nullable else ''}one of {options}"


def validate(prefix: str, obj: Any, checks: Mapping[str, Check]) -> None:
    """Raise :class:`ConfigError` for the first field of ``obj`` failing its check.

    The message is ``"<prefix>.<field>: must be <expectation>, got <value>"`` (``"<field>: ..."``
    when ``prefix`` is empty).
    """
    for field, (check, expect) in checks.items():
        value = getattr(obj, field)
        if not check(value):
            name = f"{prefix}.{field}" if prefix else field
            raise ConfigError(f"{name}: must be {expect}, got {short_repr(value)}")


def short_repr(value: Any, limit: int = 200) -> str:
    """``repr(value)``, cut to ``limit`` characters (a config value may be a huge list)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class FrozenDict(Mapping):
    """An immutable, hashable mapping: what a frozen config holds where it holds a mapping, so
    the config stays hashable (a jitted function may take it as a static argument). Equal to
    any mapping with the same items; :func:`freeze` makes one all the way down."""

    __slots__ = ("_items", "_hash")

    def __init__(self, items: Any = ()):
        object.__setattr__(self, "_items", dict(items))
        object.__setattr__(self, "_hash", None)

    def __getitem__(self, key: Any) -> Any:
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        if self._hash is None:
            object.__setattr__(self, "_hash", hash(frozenset(self._items.items())))
        return self._hash

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("FrozenDict is immutable")

    def __repr__(self) -> str:
        return repr(self._items)


def freeze(value: Any) -> Any:
    """``value`` with every mapping a :class:`FrozenDict` and every list a tuple, all the way
    down (hashable where its leaves are)."""
    if isinstance(value, Mapping):
        return FrozenDict({k: freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value
