"""Plain data across the sandbox boundary (standard library only: it runs inside too).

A value crosses between the candidate's process and the judge (or the trusted parent) as one
line of JSON that :func:`decode` turns back into built-in objects of exactly these types:
``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``, ``bytes``, ``list``,
``tuple``, ``dict``, ``set``, ``frozenset``. Nothing else can cross: no subclass, no object
with an ``__eq__`` of its own, no reference to the sender's memory. So whatever the candidate
does, the judge compares values it built itself, with the built-in ``==``.

JSON's own types stand for themselves (``null``, booleans, numbers, strings, lists); the rest
are one-key objects: ``{"tuple": [...]}``, ``{"dict": [[key, value], ...]}``,
``{"set": [...]}``, ``{"frozenset": [...]}``, ``{"bytes": "hex"}``, ``{"complex": [re, im]}``.
:func:`decode` rejects anything else with ``ValueError``: it is the half that must be strict,
since the sender may be hostile.
"""

import json

MAX_DEPTH = 64
_TAGS = ("tuple", "dict", "set", "frozenset", "bytes", "complex")


class NotPlainData(TypeError):
    """The value holds an object that cannot cross the boundary."""


def encode(value, limit):
    """``value`` as one line of JSON of at most ``limit`` characters (``NotPlainData`` or
    ``ValueError`` when it is not plain data or too large)."""
    text = json.dumps(_to_json(value, 0), allow_nan=True, separators=(",", ":"))
    if len(text) > limit:
        raise ValueError(
            f"the value is too large ({len(text)} bytes as data; the limit is {limit})"
        )
    return text


def _to_json(value, depth):
    if depth > MAX_DEPTH:
        raise NotPlainData(f"the value is nested more than {MAX_DEPTH} levels deep")
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return [_to_json(v, depth + 1) for v in value]
    if kind in (tuple, set, frozenset):
        items = [_to_json(v, depth + 1) for v in value]
        return {kind.__name__: items}
    if kind is dict:
        return {
            "dict": [[_to_json(k, depth + 1), _to_json(v, depth + 1)] for k, v in value.items()]
        }
    if kind is bytes:
        return {"bytes": value.hex()}
    if kind is complex:
        return {"complex": [value.real, value.imag]}
    raise NotPlainData(
        f"a {kind.__name__} is not plain data (None, bool, int, float, complex, "
        "str, bytes, list, tuple, dict, set, frozenset)"
    )


def decode(text):
    """The value a line from :func:`encode` stands for; ``ValueError`` on anything else."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as error:  # includes overlong integer literals
        raise ValueError(f"not JSON: {type(error).__name__}") from None
    return from_json(data)


def from_json(data, depth=0):
    """The value that parsed JSON ``data`` stands for; ``ValueError`` on anything else."""
    if depth > MAX_DEPTH:
        raise ValueError(f"nested more than {MAX_DEPTH} levels deep")
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is list:
        return [from_json(v, depth + 1) for v in data]
    if type(data) is not dict or len(data) != 1:
        raise ValueError("an object that is not a one-key tagged value")
    ((tag, body),) = data.items()
    if tag not in _TAGS:
        raise ValueError(f"unknown tag {tag[:40]!r}")
    if tag == "bytes":
        if type(body) is not str:
            raise ValueError("bytes not given as a hex string")
        return bytes.fromhex(body)
    if type(body) is not list:
        raise ValueError(f"{tag} not given as a list")
    if tag == "complex":
        if len(body) != 2 or not all(type(x) in (int, float) for x in body):
            raise ValueError("complex not given as [real, imag]")
        return complex(*body)
    if tag == "dict":
        out = {}
        for pair in body:
            if type(pair) is not list or len(pair) != 2:
                raise ValueError("a dict item that is not a [key, value] pair")
            key = from_json(pair[0], depth + 1)
            try:
                out[key] = from_json(pair[1], depth + 1)
            except TypeError:
                raise ValueError("an unhashable dict key") from None
        return out
    items = [from_json(v, depth + 1) for v in body]
    try:
        return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
    except TypeError:
        raise ValueError(f"an unhashable {tag} member") from None
