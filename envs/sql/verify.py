"""The verifier: does a submitted query's result equal the gold query's result?

Comparison rules
----------------
* Rows are compared as tuples, column by column in order; column names do not matter
  (``SELECT name AS n`` equals ``SELECT name``), the number and order of columns do.
* Order: if the gold query has a top-level ``ORDER BY`` (not one inside parentheses, a
  subquery's), rows must come in the same order. Otherwise the results are compared as
  multisets: any order, but each row as many times as in the gold result.
* Values, after :func:`normalise_value`: NULL equals NULL; a REAL is rounded to 10
  significant digits, and one with an integral value equals that INTEGER (``COUNT(*)``
  equals ``COUNT(*) * 1.0``; ``0.1 + 0.2`` equals ``0.3``). TEXT is compared exactly (case
  and spaces count) and never equals a number (``'1'`` is not ``1``); BLOBs byte for byte.

Judging by digest
-----------------
The SQL worker process answers with only as much of a result as fits its byte cap
(:mod:`envs.sql.query_worker`), so the environment judges a submission on digests the worker
computes over the whole result (:func:`result_digests`): two results match under the rules
above exactly when their digests for the gold query's order rule are equal (SHA-256 of each
normalised row's ``repr``, in order or sorted; a collision is the only way to differ).
:func:`results_match` is the same rule on rows in hand.

This module imports only the standard library: the worker process, which runs with ``-I -S``,
loads it from its file.
"""

from __future__ import annotations

import collections
import hashlib
import math
import re
from typing import Any, Sequence

# Possessive: backtracking into the whitespace could never let "by" match, so it is not tried.
_ORDER_BY = re.compile(r"\border\s++by\b", re.IGNORECASE)
_SIGNIFICANT_DIGITS = 10


def round_real(value: float) -> float:
    """``value`` rounded to the significant digits compared (float sums differ in the last bits
    with the order of addition, so equal answers computed differently would not compare equal)."""
    return float(f"{value:.{_SIGNIFICANT_DIGITS}g}") if math.isfinite(value) else value


def normalise_value(value: Any) -> Any:
    """A value in the form compared (rules in the module docstring)."""
    if isinstance(value, float):
        rounded = round_real(value)
        return int(rounded) if rounded.is_integer() else rounded
    return value


def normalise_rows(rows: Sequence[Sequence[Any]]) -> list[tuple[Any, ...]]:
    return [tuple(normalise_value(v) for v in row) for row in rows]


def top_level_text(query: str) -> str:
    """``query`` with comments, quoted strings and identifiers, and everything inside
    parentheses removed: what is left is the outermost statement's own clauses."""
    out: list[str] = []
    depth, i, n = 0, 0, len(query)
    closers = {"'": "'", '"': '"', "`": "`", "[": "]"}
    while i < n:
        c = query[i]
        if query.startswith("--", i):
            end = query.find("\n", i)
            i = n if end < 0 else end
            out.append(" ")
        elif query.startswith("/*", i):
            end = query.find("*/", i + 2)
            i = n if end < 0 else end + 2
            out.append(" ")
        elif c in closers:  # a doubled closer ('it''s') simply starts the next quoted run
            end = query.find(closers[c], i + 1)
            i = n if end < 0 else end + 1
            out.append(" ")
        elif c == "(":
            depth, i = depth + 1, i + 1
        elif c == ")":
            depth, i = max(depth - 1, 0), i + 1
            out.append(" ")
        else:
            if depth == 0:
                out.append(c)
            i += 1
    return "".join(out)


def is_ordered(gold_query: str) -> bool:
    """Whether the gold query fixes the row order: it has a top-level ``ORDER BY``."""
    return bool(_ORDER_BY.search(top_level_text(gold_query)))


def results_match(
    gold_rows: Sequence[Sequence[Any]], rows: Sequence[Sequence[Any]], ordered: bool
) -> bool:
    """Whether ``rows`` equal ``gold_rows`` under the rules of the module docstring."""
    gold, mine = normalise_rows(gold_rows), normalise_rows(rows)
    if ordered:
        return gold == mine
    return collections.Counter(gold) == collections.Counter(mine)


def row_key(row: Sequence[Any]) -> bytes:
    """The 32-byte key of one row in the form compared: two rows have equal keys exactly when
    they compare equal (``repr`` of the normalised tuple tells apart every pair of normalised
    values that differ: ``1`` and ``'1'``, ``b'a'`` and ``'a'``; an integral REAL is an int)."""
    values = tuple(row)
    if float in map(type, values):  # only REALs change (a C-speed test: results can be wide)
        values = tuple(map(normalise_value, values))
    return hashlib.sha256(repr(values).encode("utf-8", "surrogatepass")).digest()


def result_digests(rows: Sequence[Sequence[Any]]) -> dict[str, str]:
    """``{"ordered": hex, "unordered": hex}``: SHA-256 of ``rows``' keys (:func:`row_key`) in
    their order, and sorted (a multiset: each row as many times as it occurs). For any results
    ``a`` and ``b``, ``results_match(a, b, ordered)`` equals
    ``result_digests(a)[k] == result_digests(b)[k]`` with ``k`` the order rule's name."""
    keys = [row_key(row) for row in rows]
    return {
        "ordered": hashlib.sha256(b"".join(keys)).hexdigest(),
        "unordered": hashlib.sha256(b"".join(sorted(keys))).hexdigest(),
    }


def digest_rule(ordered: bool) -> str:
    """The name of the digest (:func:`result_digests`) an ``ordered`` gold result is judged on."""
    return "ordered" if ordered else "unordered"
