"""Field checks for the frozen, validated-on-construction config dataclasses.

A check (:class:`Check`) is a predicate, the expectation that completes the sentence "must be
...", and, for a number, its declared range ``[lo, hi]``. A config field declares its check
beside itself with :func:`setting`::

    group_size: int = setting(16, integer(2, MAX_GROUP))

and the class's ``__post_init__`` applies every declared check with :func:`check_fields`,
which raises :class:`~agentrl_jax.errors.ConfigError`
``"<prefix>.<field>: must be <expectation>, got <value>"`` for the first that fails (the value
cut to 120 characters). Every numeric field of a config section declares both bounds, from
what it means (a test walks the sections, :func:`declared_range`); the bounds that name no
other field live here as constants, each with its rule. :func:`validate` applies a table of
checks where a class checks fields that are not its own.

All checks are pure and never raise on a value of an unexpected type (a list where a number
belongs is a failed check, not a ``TypeError``), an integer of any length (its decimal form
may be too long for Python to print) or a float that is NaN or infinite.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import typing
from typing import Any, Callable, Iterable, Mapping, NamedTuple

from agentrl_jax.errors import ConfigError, did_you_mean

# ------------------------------------------------------------------- the declared bounds
# Each bound a field declares without naming another field, and the rule it follows.
MAX_SEED = 2**32 - 1  # a seed is a uint32 (jax.random.key's, NumPy's)
MAX_CONTEXT = 2**20  # tokens of one conversation: 1,048,576, 8x Qwen3's longest (131,072)
MAX_TURNS = 4096  # a turn budget: every turn takes context tokens, and 4,096 turns of the
# shortest real turn (a FrozenLake move, ~25 tokens) already need ~100k tokens of context
MAX_COUNT = 2**20  # tasks, states, demonstrations: ~1M, past any data set this project reads
MAX_SAMPLES = 4096  # trajectories drawn per task or state (the paper's most: 128)
MAX_ROWS = 2**20  # rows of one batch; a step's tokens are bounded by MAX_TOKENS below too
MAX_TOKENS = 2**31 - 1  # rows x context of one batch: int32 indexing of its token buffers
MAX_STEPS = 10**7  # optimizer updates or epochs of one run
MAX_STALENESS = 64  # rollout batches sampled ahead (each is held in memory until its update)
MAX_VOCAB = 2**20  # token ids (Qwen3: 151,936)
MAX_WIDTH = 2**17  # a model's hidden or MLP width (Qwen3-235B's MLP: 12,288)
MAX_LAYERS = 1024  # a model's layers or heads
MAX_DEVICES = 2**16  # devices along a mesh axis
MAX_RATE = 10.0  # a learning rate or weight decay (the paper's: 1e-6 and 0.01)
MAX_TEMPERATURE = 100.0  # a sampling temperature (past ~10 the distribution is uniform)
MAX_COEF = 1e6  # a coefficient or cap on a loss or reward
SAFE_DIGITS = 4000  # decimal digits an integer may have and still be printed (Python: 4,300)


class Check(NamedTuple):
    """A field's check: ``test(value)`` says whether the value is acceptable, ``expect``
    completes "must be ...", and ``lo`` / ``hi`` are a number's declared range (None: the
    field is not a number, or the bound is not declared)."""

    test: Callable[[Any], bool]
    expect: str
    lo: float | None = None
    hi: float | None = None


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
    """An int (not a bool) in ``[lo, hi]`` (a bound left None is not checked; a config
    section's field declares both)."""
    if hi is not None:
        return Check(lambda v: is_int(v, lo) and v <= hi, f"an int in [{lo}, {hi}]", lo, hi)
    return Check(
        lambda v: is_int(v, lo), "an int" + (f" >= {lo}" if lo is not None else ""), lo, None
    )


def real(
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
) -> Check:
    """A finite real number (not a bool) in ``[lo, hi]`` (``(lo`` / ``hi)`` where open; a
    bound left None is not checked; a config section's field declares both)."""

    def check(v: Any) -> bool:
        if not is_real(v):
            return False
        if lo is not None and (v <= lo if lo_open else v < lo):
            return False
        return hi is None or (v < hi if hi_open else v <= hi)

    if lo is not None and hi is not None:
        bounds = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        return Check(check, f"a number in {bounds}", lo, hi)
    bounds = [
        f"{'>' if lo_open else '>='} {lo}" if lo is not None else "",
        f"{'<' if hi_open else '<='} {hi}" if hi is not None else "",
    ]
    return Check(check, "a finite number" + "".join(f" {b}" for b in bounds if b), lo, hi)


BOOL = Check(lambda v: isinstance(v, bool), "true or false")


def optional(check: Check) -> Check:
    """``check`` or null (its declared range kept)."""
    check = Check(*check)
    return Check(
        lambda v: v is None or check.test(v), f"null or {check.expect}", check.lo, check.hi
    )


def setting(default: Any = dataclasses.MISSING, check: Check | None = None, **field: Any) -> Any:
    """A config field declared with its check: ``rank: int = setting(16, integer(1, 4096))``
    (``field`` as for :func:`dataclasses.field`, e.g. ``default_factory``). The class applies
    it with :func:`check_fields`."""
    if check is None:
        raise TypeError("setting(): a field declares its check")
    return dataclasses.field(default=default, metadata={"check": Check(*check)}, **field)


def declared_check(field: dataclasses.Field) -> Check | None:
    """The check ``field`` declares (:func:`setting`), or None."""
    return field.metadata.get("check")


def declared_range(field: dataclasses.Field) -> tuple[float, float] | None:
    """The range ``[lo, hi]`` a numeric ``field`` declares (None: it declares none or only one
    bound)."""
    check = declared_check(field)
    if check is None or check.lo is None or check.hi is None:
        return None
    return check.lo, check.hi


def numeric_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of dataclass ``cls`` that hold a number or numbers (an int or a float,
    optional or in a tuple; not a bool): those that must declare a range."""

    def holds_numbers(hint: Any) -> bool:
        if hint in (int, float):
            return True
        return any(holds_numbers(a) for a in typing.get_args(hint) if a is not Ellipsis)

    hints = typing.get_type_hints(cls)
    return [f for f in dataclasses.fields(cls) if holds_numbers(hints[f.name])]


def undeclared_ranges(cls: type) -> list[str]:
    """The numeric fields of ``cls`` (:func:`numeric_fields`) declaring no ``[lo, hi]``."""
    return [f.name for f in numeric_fields(cls) if declared_range(f) is None]


def check_fields(prefix: str, obj: Any) -> None:
    """Applies the checks ``obj``'s fields declare (:func:`setting`), in field order
    (:func:`validate`'s message)."""
    validate(
        prefix,
        obj,
        {f.name: c for f in dataclasses.fields(obj) if (c := declared_check(f)) is not None},
    )


def subsection(path: str, cls: type, value: Any, default: Any) -> Any:
    """A section nested in another (``rl.optimizer``, ``eval.sampling``) as written: an
    instance of ``cls`` as it is; a mapping of some of its fields (null: none) over those of
    ``default`` (the field's default in the section that holds it). Errors name the full
    ``path``: ``rl.optimizer.learning_rate: must be ...``, ``rl.optimizer.lr: unknown field``.
    The class checks its own fields under its last name (``optimizer.learning_rate: ...``)."""
    if isinstance(value, cls):
        return value
    names = [f.name for f in dataclasses.fields(cls)]
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"{path}: must be a mapping of fields ({', '.join(names)}), got {short_repr(value)}"
        )
    unknown = [key for key in value if key not in names]
    if unknown:
        raise ConfigError(
            f"{path}.{unknown[0]}: unknown field; known: {', '.join(sorted(names))}"
            f"{did_you_mean(unknown[0], names)}"
        )
    try:
        return cls(**{**{name: getattr(default, name) for name in names}, **value})
    except ValueError as error:
        message, (above, _, name) = str(error), path.rpartition(".")
        if message.startswith(f"{name}."):
            raise ConfigError(f"{above}.{message}" if above else message) from None
        raise ConfigError(f"{path}: {message}") from None


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
    for field, check in checks.items():
        test, expect = check[0], check[1]
        value = getattr(obj, field)
        if not test(value):
            name = f"{prefix}.{field}" if prefix else field
            raise ConfigError(f"{name}: must be {expect}, got {short_repr(value, 120)}")


def short_repr(value: Any, limit: int = 200) -> str:
    """``repr(value)``, cut to ``limit`` characters (a config value may be a huge list); an
    integer too long to print is described (``an integer of 5,000 digits``), never printed."""
    text = _safe_repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _safe_repr(value: Any) -> str:
    """``repr(value)``, with each integer too long to print described instead."""
    try:
        return repr(value)
    except ValueError:  # Python refuses to print an int of more than 4,300 digits
        pass
    if isinstance(value, int):
        return describe_long_int(value)
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_safe_repr(k)}: {_safe_repr(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_safe_repr(v) for v in value) + "]"
    return f"a {type(value).__name__}"


def describe_long_int(value: int) -> str:
    """``an integer of N digits`` (N approximate to one digit), without printing it."""
    digits = int(abs(value).bit_length() * math.log10(2)) + 1
    return f"{'a negative' if value < 0 else 'an'} integer of about {digits:,} digits"


class UnreadableNumber:
    """A number a config file writes with more digits than Python reads (4,300), kept as what
    it is so the field it sits in is named in the error: it fails every numeric check."""

    __slots__ = ("digits",)

    def __init__(self, digits: int):
        self.digits = digits

    def __repr__(self) -> str:
        return f"an integer of {self.digits:,} digits"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, UnreadableNumber) and other.digits == self.digits

    def __hash__(self) -> int:
        return hash(("UnreadableNumber", self.digits))


def unprintable(value: Any, path: str = "") -> str | None:
    """The path (``"a.b[2]"``, under ``path``) of the first value nested in ``value`` that no
    config may hold whatever its field: an :class:`UnreadableNumber`, an integer of more than
    :data:`SAFE_DIGITS` digits, a NaN; None if there is none."""
    if isinstance(value, UnreadableNumber):
        return path
    if isinstance(value, int) and not isinstance(value, bool):
        return path if value.bit_length() > SAFE_DIGITS * 3.32 else None
    if isinstance(value, float):
        return path if math.isnan(value) else None
    if isinstance(value, Mapping):
        items = ((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    return next((found for p, v in items if (found := unprintable(v, p)) is not None), None)


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
