"""Running one untrusted query against a SQLite file: read-only, time-limited, row-limited.

:func:`run_query` runs each query in a worker process (:mod:`envs.sql.worker_pool`) under the
read-only guards of :mod:`envs.sql.query_worker` (a read-only file URI, ``query_only``, an
authorizer that allows only reading actions, a cap on the size of any one value). The worker
stops a query at its deadline between SQLite instructions; one that overruns it inside a
single expensive call is killed with its process at the deadline (plus a fraction of a
second), so the time limit holds for any statement and no thread waits for long. Either way
the result is the same timed-out :class:`QueryResult`. Only plain data crosses back: rows of
None, int, float, str and bytes, and :class:`~envs.sql.query_worker.Cut` values.

The worker answers in at most ``QueryLimits.max_response_bytes`` bytes, whatever the result: it
sends the first ``max_columns`` columns, values cut to ``max_text_chars``, and the first rows
that fit, and says so (``QueryResult.truncated``), with the counts and the digests of the
whole result (judging uses those: :mod:`envs.sql.verify`).
"""

from __future__ import annotations

import dataclasses
import pathlib
import sqlite3
from typing import Any, Mapping

from envs.sql import query_worker, worker_pool
from envs.sql.query_worker import Cut, connect_read_only

__all__ = ["Cut", "QueryLimits", "QueryResult", "connect_read_only", "run_query", "schema_text"]


@dataclasses.dataclass(frozen=True)
class QueryLimits:
    """Limits of one query.

    Attributes:
      timeout_s: wall-clock seconds before the query is aborted.
      max_rows: rows fetched at most; a result with more is reported as ``more_rows``.
      max_value_bytes: the largest string or blob the query may build (``SQLITE_LIMIT_LENGTH``).
      max_columns: columns whose names and cells come back (the rest are only counted).
      max_text_chars: characters of a text (bytes of a blob) that come back; a longer value
        comes back as a :class:`~envs.sql.query_worker.Cut`, and a longer column name as its
        head followed by ``"..."``.
      max_response_bytes: the byte cap of the worker's answer (JSON): the rows that do not fit
        are left out (``QueryResult.truncated``). It bounds what a query adds to this process.
    """

    timeout_s: float = 2.0
    max_rows: int = 10_000
    max_value_bytes: int = 1_000_000
    max_columns: int = 100
    max_text_chars: int = 1_000
    max_response_bytes: int = query_worker.DEFAULT_RESPONSE_BYTES

    def __post_init__(self):
        if not self.timeout_s > 0:
            raise ValueError(f"QueryLimits.timeout_s must be > 0, got {self.timeout_s}")
        for field in ("max_rows", "max_value_bytes", "max_columns", "max_text_chars"):
            if getattr(self, field) < 1:
                raise ValueError(f"QueryLimits.{field} must be >= 1, got {getattr(self, field)}")
        low, high = query_worker.MIN_RESPONSE_BYTES, query_worker.MAX_RESPONSE_BYTES
        if not low <= self.max_response_bytes <= high:
            raise ValueError(
                f"QueryLimits.max_response_bytes must be in [{low}, {high}], "
                f"got {self.max_response_bytes}"
            )


@dataclasses.dataclass(frozen=True)
class QueryResult:
    """What a query returned, or why it did not.

    Attributes:
      columns: result column names (empty on error), at most ``max_columns``; a name longer
        than ``max_text_chars`` is cut and ends in ``"..."``.
      rows: the first rows as tuples of Python values (None, int, float, str, bytes, or a
        :class:`~envs.sql.query_worker.Cut` text or blob), each with a value per column of
        ``columns``: all ``row_count`` of them unless ``truncated``.
      more_rows: the result had more than ``max_rows`` rows; only the first were fetched.
      error: the error message, or None on success.
      timed_out: the query was aborted at its deadline (``error`` says so too).
      row_count: rows fetched (at most ``max_rows``).
      column_count: columns of the result.
      truncated: ``rows`` or ``columns`` leave some out, or hold a cut value.
      digest: :func:`envs.sql.verify.result_digests` of the ``row_count`` fetched rows, whole
        (empty on error).
    """

    columns: tuple[str, ...] = ()
    rows: tuple[tuple[Any, ...], ...] = ()
    more_rows: bool = False
    error: str | None = None
    timed_out: bool = False
    row_count: int = 0
    column_count: int = 0
    truncated: bool = False
    digest: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None


def run_query(db_path: str | pathlib.Path, query: str, limits: QueryLimits) -> QueryResult:
    """Run one untrusted ``query`` read-only against ``db_path``; never raises on the query.

    A missing database file is the caller's error and raises ``FileNotFoundError``.
    """
    path = pathlib.Path(db_path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"SQLite database not found: {path}")
    response = worker_pool.shared_pool().run(
        {
            "db": str(path),
            "query": query,
            "timeout_s": limits.timeout_s,
            "max_rows": limits.max_rows,
            "max_value_bytes": limits.max_value_bytes,
            "max_columns": limits.max_columns,
            "max_text_chars": limits.max_text_chars,
            "max_response_bytes": limits.max_response_bytes,
        }
    )
    return result_of(response)


def result_of(response: dict) -> QueryResult:
    """The :class:`QueryResult` of a worker's response dict; a malformed one is an error result."""
    if "error" in response:
        return QueryResult(error=str(response["error"]), timed_out=bool(response.get("timed_out")))
    try:
        columns = tuple(_column_name(c) for c in _list(response["columns"]))
        rows = tuple(
            tuple(query_worker.decode_cell(v) for v in _list(row)) for row in response["rows"]
        )
        if any(len(row) != len(columns) for row in rows):
            raise ValueError(f"a row has not {len(columns)} cells")
        digest = response["digest"]
        if not isinstance(digest, dict) or set(digest) != {"ordered", "unordered"}:
            raise ValueError(f"malformed digest: {str(digest)[:80]}")
        return QueryResult(
            columns,
            rows,
            more_rows=bool(response["more_rows"]),
            row_count=_count(response["row_count"], len(rows)),
            column_count=_count(response["column_count"], len(columns)),
            truncated=bool(response["truncated"]),
            digest={rule: str(value) for rule, value in digest.items()},
        )
    except (KeyError, TypeError, ValueError) as error:
        return QueryResult(error=f"the database worker answered nonsense ({error})")


def _column_name(value) -> str:
    """A column name as the worker sent it: a cut one is its head and ``"..."``."""
    name = query_worker.decode_cell(value)
    if isinstance(name, Cut) and isinstance(name.head, str):
        return name.head + "..."
    if not isinstance(name, str):
        raise ValueError(f"a column name is a {type(name).__name__}")
    return name


def _count(value, at_least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < at_least:
        raise ValueError(f"a count is {value!r}, expected an int >= {at_least}")
    return value


def _list(value) -> list:
    if not isinstance(value, list):
        raise ValueError(f"a row is a {type(value).__name__}, not a list")
    return value


def schema_text(db_path: str | pathlib.Path) -> str:
    """The ``CREATE`` statements of the database's tables and views, one per paragraph."""
    conn = connect_read_only(db_path)
    try:
        rows = conn.execute(
            "SELECT sql FROM sqlite_master WHERE type IN ('table', 'view') "
            "AND sql IS NOT NULL AND name NOT LIKE 'sqlite_%' ORDER BY rowid"
        ).fetchall()
    except sqlite3.Error as error:
        raise ValueError(f"cannot read the schema of {db_path}: {error}") from error
    finally:
        conn.close()
    return "\n\n".join(sql.strip() + ";" for (sql,) in rows)
