"""Running one untrusted query against a SQLite file: read-only, time-limited, row-limited.

Every query gets its own connection (opening a SQLite file takes well under a millisecond),
so rows running in different threads share nothing and a row holds no resource to release.
Three independent guards keep the file unchanged:

1. the file is opened through the URI ``file:...?mode=ro`` (SQLite opens it read-only);
2. ``PRAGMA query_only=ON`` makes SQLite refuse any statement that would write;
3. an authorizer allows only reading actions (SELECT, reading a column, calling a function,
   a recursive CTE), so ATTACH, ``VACUUM INTO``, PRAGMA, transactions and temporary tables
   are denied before they run; ``VACUUM INTO`` would otherwise write a new file even on a
   read-only connection.

Python's ``sqlite3`` refuses a string holding more than one statement. A progress handler
aborts a query once its deadline has passed, and ``SQLITE_LIMIT_LENGTH`` caps the size of any
one string or blob the query builds, so one huge value cannot exhaust memory before the
deadline.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sqlite3
import time
from typing import Any

# Authorizer action codes a reading query needs; everything else is denied.
_READ_ACTIONS = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION,
                           sqlite3.SQLITE_RECURSIVE})
# Names of the actions a write attempt is refused for, to tell the agent what was refused.
_ACTION_NAMES = {getattr(sqlite3, f"SQLITE_{name}"): name.replace("_", " ") for name in (
    "INSERT", "UPDATE", "DELETE", "ALTER_TABLE", "ATTACH", "DETACH", "PRAGMA", "TRANSACTION",
    "SAVEPOINT", "ANALYZE", "REINDEX", "CREATE_TABLE", "CREATE_TEMP_TABLE", "CREATE_INDEX",
    "CREATE_TEMP_INDEX", "CREATE_VIEW", "CREATE_TEMP_VIEW", "CREATE_TRIGGER",
    "CREATE_TEMP_TRIGGER", "CREATE_VTABLE", "DROP_TABLE", "DROP_TEMP_TABLE", "DROP_INDEX",
    "DROP_TEMP_INDEX", "DROP_VIEW", "DROP_TEMP_VIEW", "DROP_TRIGGER", "DROP_TEMP_TRIGGER",
    "DROP_VTABLE")}
_PROGRESS_EVERY = 1000  # SQLite virtual-machine instructions between deadline checks


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
            raise ValueError(f"QueryLimits.max_value_bytes must be >= 1, got {self.max_value_bytes}")


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


def connect_read_only(db_path: str | pathlib.Path) -> sqlite3.Connection:
    """A connection that cannot change the database (the three guards of the module docstring).

    Raises ``FileNotFoundError`` naming the path if there is no such file.
    """
    path = pathlib.Path(db_path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"SQLite database not found: {path}")
    conn = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, check_same_thread=False)
    # Some public databases hold text that is not valid UTF-8; show it rather than fail.
    conn.text_factory = lambda raw: raw.decode("utf-8", "replace")
    conn.execute("PRAGMA query_only=ON")
    _set_limit(conn, "SQLITE_LIMIT_ATTACHED", 0)
    return conn


def _set_limit(conn: sqlite3.Connection, name: str, value: int) -> None:
    # Connection.setlimit is new in Python 3.11; on 3.10 these extra caps are skipped and the
    # authorizer and the deadline still hold.
    if hasattr(conn, "setlimit"):
        conn.setlimit(getattr(sqlite3, name), value)


def _deny_writes(denied: list[str]):
    def authorize(action, arg1, arg2, db_name, trigger):
        if action in _READ_ACTIONS:
            return sqlite3.SQLITE_OK
        what = _ACTION_NAMES.get(action, f"action {action}")
        denied.append(f"{what} on {arg1}" if arg1 else what)
        return sqlite3.SQLITE_DENY
    return authorize


def run_query(db_path: str | pathlib.Path, query: str, limits: QueryLimits) -> QueryResult:
    """Run one untrusted ``query`` read-only against ``db_path``; never raises on the query.

    A missing database file is the caller's error and raises ``FileNotFoundError``.
    """
    conn = connect_read_only(db_path)
    denied: list[str] = []
    deadline = time.monotonic() + limits.timeout_s
    stopped = []

    def past_deadline() -> bool:
        if not stopped and time.monotonic() > deadline:
            stopped.append(True)
        return bool(stopped)

    try:
        _set_limit(conn, "SQLITE_LIMIT_LENGTH", limits.max_value_bytes)
        conn.set_authorizer(_deny_writes(denied))
        conn.set_progress_handler(past_deadline, _PROGRESS_EVERY)
        cursor = conn.execute(query)
        if cursor.description is None:  # a statement that yields no rows: a no-op, or nothing at all
            return QueryResult(error="not a query: only a single SELECT statement (WITH and VALUES "
                                     "also work) may run")
        columns = tuple(d[0] for d in cursor.description)
        rows = cursor.fetchmany(limits.max_rows + 1)
        return QueryResult(columns, tuple(rows[:limits.max_rows]), more_rows=len(rows) > limits.max_rows)
    except (sqlite3.Error, ValueError) as error:  # ValueError: a NUL or lone surrogate in the text
        if stopped:
            return QueryResult(error=f"the query ran longer than the {limits.timeout_s:g} s limit "
                                     "and was stopped", timed_out=True)
        if denied:
            return QueryResult(error=f"not allowed: the database is read-only and only a reading "
                                     f"query may run (refused: {denied[0]})")
        return QueryResult(error=str(error) or type(error).__name__)
    finally:
        conn.close()


def schema_text(db_path: str | pathlib.Path) -> str:
    """The ``CREATE`` statements of the database's tables and views, one per paragraph."""
    conn = connect_read_only(db_path)
    try:
        rows = conn.execute("SELECT sql FROM sqlite_master WHERE type IN ('table', 'view') "
                            "AND sql IS NOT NULL AND name NOT LIKE 'sqlite_%' ORDER BY rowid").fetchall()
    except sqlite3.Error as error:
        raise ValueError(f"cannot read the schema of {db_path}: {error}") from error
    finally:
        conn.close()
    return "\n\n".join(sql.strip() + ";" for (sql,) in rows)
