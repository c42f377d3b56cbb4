"""Running one untrusted query against a SQLite file: read-only, time-limited, row-limited.

:func:`run_query` runs each query in a worker process (:mod:`envs.sql.worker_pool`) under the
read-only guards of :mod:`envs.sql.query_worker` (a read-only file URI, ``query_only``, an
authorizer that allows only reading actions, a cap on the size of any one value). The worker
stops a query at its deadline between SQLite instructions; one that overruns it inside a
single expensive call is killed with its process at the deadline (plus a fraction of a
second), so the time limit holds for any statement and no thread waits for long. Either way
the result is the same timed-out :class:`QueryResult`. Only plain data crosses back: rows of
None, int, float, str and bytes.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sqlite3
from typing import Any

from envs.sql import query_worker, worker_pool
from envs.sql.query_worker import connect_read_only

__all__ = ["QueryLimits", "QueryResult", "connect_read_only", "run_query", "schema_text"]


@dataclasses.dataclass(frozen=True)
class QueryLimits:
    """Limits of one query.

    Attributes:
      timeout_s: wall-clock seconds before the query is aborted.
      max_rows: rows fetched at most; a result with more is reported as ``more_rows``.
      max_value_bytes: the largest string or blob the query may build (``SQLITE_LIMIT_LENGTH``).
    """

    timeout_s: float = 2.0
    max_rows: int = 10_000
    max_value_bytes: int = 1_000_000

    def __post_init__(self):
        if not self.timeout_s > 0:
            raise ValueError(f"QueryLimits.timeout_s must be > 0, got {self.timeout_s}")
        if self.max_rows < 1:
            raise ValueError(f"QueryLimits.max_rows must be >= 1, got {self.max_rows}")
        if self.max_value_bytes < 1:
            raise ValueError(
                f"QueryLimits.max_value_bytes must be >= 1, got {self.max_value_bytes}"
            )


@dataclasses.dataclass(frozen=True)
class QueryResult:
    """What a query returned, or why it did not.

    Attributes:
      columns: result column names (empty on error).
      rows: up to ``max_rows`` rows as tuples of Python values (None, int, float, str, bytes).
      more_rows: the result had more than ``max_rows`` rows; only the first were fetched.
      error: the error message, or None on success.
      timed_out: the query was aborted at its deadline (``error`` says so too).
    """

    columns: tuple[str, ...] = ()
    rows: tuple[tuple[Any, ...], ...] = ()
    more_rows: bool = False
    error: str | None = None
    timed_out: bool = False

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
        }
    )
    return result_of(response)


def result_of(response: dict) -> QueryResult:
    """The :class:`QueryResult` of a worker's response dict; a malformed one is an error result."""
    if "error" in response:
        return QueryResult(error=str(response["error"]), timed_out=bool(response.get("timed_out")))
    try:
        columns = tuple(str(c) for c in response["columns"])
        rows = tuple(
            tuple(query_worker.decode_cell(v) for v in _list(row)) for row in response["rows"]
        )
        return QueryResult(columns, rows, more_rows=bool(response["more_rows"]))
    except (KeyError, TypeError, ValueError) as error:
        return QueryResult(error=f"the database worker answered nonsense ({error})")


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
