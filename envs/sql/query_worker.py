"""The inside of a SQL worker process: one untrusted query run read-only against a SQLite file.

This file is also run on its own, as the worker process of :mod:`envs.sql.worker_pool`
(``python -I -S query_worker.py MEMORY_BYTES``), so it imports only the standard library.

Guards on each query (every query gets its own connection; opening a file takes well under a
millisecond):

1. the file is opened through the URI ``file:...?mode=ro`` (SQLite opens it read-only);
2. ``PRAGMA query_only=ON`` makes SQLite refuse any statement that would write;
3. an authorizer allows only reading actions (SELECT, reading a column, calling one of an
   allow-list of SQLite's core functions, a recursive CTE), so ATTACH, ``VACUUM INTO``,
   PRAGMA, transactions, temporary tables and every other function are denied before they
   run; ``VACUUM INTO`` would otherwise write a new file even on a read-only connection;
4. a progress handler aborts the query once its deadline has passed (checked between SQLite
   virtual-machine instructions, so one long-running function call can overrun it: the parent
   kills the process at the deadline for that), and ``SQLITE_LIMIT_LENGTH`` caps the size of
   any one string or blob the query builds.

Python's ``sqlite3`` refuses a string holding more than one statement.

The process (:func:`serve`) caps its address space (``RLIMIT_AS``), so a query cannot take
the machine's memory, and before each query sets its CPU-time soft limit to the query's time
limit plus a margin, so a query outlives neither its limit by long nor a parent that died.

Protocol: the process writes one line ``{"ready": true}``, then answers each request line with
one response line, both JSON. A request holds ``db``, ``query``, ``timeout_s``, ``max_rows``
and ``max_value_bytes``; a response holds ``columns``, ``rows`` (cells as JSON values, a blob
as a one-item list holding its base64 text) and ``more_rows``, or ``error`` and ``timed_out``.
Only plain data crosses; the parent decodes it with :func:`decode_cell`.
"""

from __future__ import annotations

import base64
import json
import pathlib
import sqlite3
import sys
import time

# Authorizer action codes a reading query needs; everything else is denied.
_READ_ACTIONS = frozenset(
    {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
)
# The SQL functions a query may call: SQLite's core scalar, aggregate, date and time, window
# and math functions, what InterCode-SQL's (Spider's) queries use and more. Every other
# function is refused by name (e.g. fts3_tokenizer, which hands out and takes native pointers,
# load_extension, sqlite_compileoption_*), whatever the SQLite build registers.
_ALLOWED_FUNCTIONS = frozenset(
    """
    abs changes char coalesce concat concat_ws format glob hex ifnull iif instr last_insert_rowid
    length like likelihood likely lower ltrim max min nullif octet_length printf quote random
    randomblob replace round rtrim sign soundex substr substring total_changes trim typeof
    unhex unicode unlikely upper zeroblob
    avg count group_concat string_agg sum total
    date time datetime julianday strftime unixepoch timediff
    row_number rank dense_rank percent_rank cume_dist ntile lag lead first_value last_value
    nth_value
    acos acosh asin asinh atan atan2 atanh ceil ceiling cos cosh degrees exp floor ln log log10
    log2 mod pi pow power radians sin sinh sqrt tan tanh trunc
    """.split()
)
# Names of the actions a write attempt is refused for, to tell the agent what was refused.
_ACTION_NAMES = {
    getattr(sqlite3, f"SQLITE_{name}"): name.replace("_", " ")
    for name in (
        "INSERT",
        "UPDATE",
        "DELETE",
        "ALTER_TABLE",
        "ATTACH",
        "DETACH",
        "PRAGMA",
        "TRANSACTION",
        "SAVEPOINT",
        "ANALYZE",
        "REINDEX",
        "CREATE_TABLE",
        "CREATE_TEMP_TABLE",
        "CREATE_INDEX",
        "CREATE_TEMP_INDEX",
        "CREATE_VIEW",
        "CREATE_TEMP_VIEW",
        "CREATE_TRIGGER",
        "CREATE_TEMP_TRIGGER",
        "CREATE_VTABLE",
        "DROP_TABLE",
        "DROP_TEMP_TABLE",
        "DROP_INDEX",
        "DROP_TEMP_INDEX",
        "DROP_VIEW",
        "DROP_TEMP_VIEW",
        "DROP_TRIGGER",
        "DROP_TEMP_TRIGGER",
        "DROP_VTABLE",
    )
}
_PROGRESS_EVERY = 1000  # SQLite virtual-machine instructions between deadline checks
MAX_RESPONSE_BYTES = 64 * 1024 * 1024  # a larger result is an error, not a response
_CPU_MARGIN_S = 5  # CPU seconds a query may use past its time limit before SIGXCPU ends the process


def timeout_message(timeout_s: float) -> str:
    return f"the query ran longer than the {timeout_s:g} s limit and was stopped"


def connect_read_only(db_path: str) -> sqlite3.Connection:
    """A connection that cannot change the database (guards 1 and 2 of the module docstring).

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


def _deny_writes(denied: list):
    def authorize(action, arg1, arg2, db_name, trigger):
        if action == sqlite3.SQLITE_FUNCTION:  # arg2: the function's name
            if str(arg2).lower() in _ALLOWED_FUNCTIONS:
                return sqlite3.SQLITE_OK
            denied.append(f"function {arg2}()")
            return sqlite3.SQLITE_DENY
        if action in _READ_ACTIONS:
            return sqlite3.SQLITE_OK
        what = _ACTION_NAMES.get(action, f"action {action}")
        denied.append(f"{what} on {arg1}" if arg1 else what)
        return sqlite3.SQLITE_DENY

    return authorize


def execute(
    db_path: str, query: str, timeout_s: float, max_rows: int, max_value_bytes: int
) -> dict:
    """Run ``query`` under the guards; the response dict (module docstring), cells undecoded.

    Never raises on the query; a missing or unreadable file is an ``error`` too.
    """
    try:
        conn = connect_read_only(db_path)
    except (OSError, sqlite3.Error) as error:
        return {"error": f"cannot open the database: {error}", "timed_out": False}
    denied: list = []
    deadline = time.monotonic() + timeout_s
    stopped = []

    def past_deadline() -> bool:
        if not stopped and time.monotonic() > deadline:
            stopped.append(True)
        return bool(stopped)

    try:
        _set_limit(conn, "SQLITE_LIMIT_LENGTH", max_value_bytes)
        conn.set_authorizer(_deny_writes(denied))
        conn.set_progress_handler(past_deadline, _PROGRESS_EVERY)
        cursor = conn.execute(query)
        if (
            cursor.description is None
        ):  # a statement that yields no rows: a no-op, or nothing at all
            return {
                "error": "not a query: only a single SELECT statement (WITH and VALUES also "
                "work) may run",
                "timed_out": False,
            }
        columns = [d[0] for d in cursor.description]
        rows = cursor.fetchmany(max_rows + 1)
        return {
            "columns": columns,
            "rows": [[encode_cell(v) for v in row] for row in rows[:max_rows]],
            "more_rows": len(rows) > max_rows,
        }
    except (sqlite3.Error, ValueError) as error:  # ValueError: a NUL or lone surrogate in the text
        if stopped:
            return {"error": timeout_message(timeout_s), "timed_out": True}
        if denied and denied[0].startswith("function "):
            return {
                "error": f"not allowed: {denied[0][len('function ') :]} is not a function "
                "queries may call here (SQLite's core scalar, aggregate, date, window and math "
                "functions are)",
                "timed_out": False,
            }
        if denied:
            return {
                "error": "not allowed: the database is read-only and only a reading query "
                f"may run (refused: {denied[0]})",
                "timed_out": False,
            }
        return {"error": str(error) or type(error).__name__, "timed_out": False}
    finally:
        conn.close()


def encode_cell(value):
    """A cell as a JSON value: a blob becomes ``[base64 text]``; None, int, float, str stay."""
    if isinstance(value, bytes):
        return [base64.b64encode(value).decode("ascii")]
    return value


def decode_cell(value):
    """The inverse of :func:`encode_cell`. Raises ``ValueError`` on anything it never writes."""
    if isinstance(value, list):
        if len(value) != 1 or not isinstance(value[0], str):
            raise ValueError(f"malformed blob cell: {str(value)[:80]}")
        return base64.b64decode(value[0], validate=True)
    if value is None or isinstance(value, (int, float, str)):
        return value
    raise ValueError(f"malformed cell of type {type(value).__name__}")


def answer(line: bytes, before_query=None) -> bytes:
    """The response line (ending in a newline) to one request line; never raises.

    ``before_query(request)``, if given, runs once the request is read, before the query.
    """
    out_of_memory = False
    try:
        request = json.loads(line)
        if before_query is not None:
            before_query(request)
        response = execute(
            request["db"],
            request["query"],
            float(request["timeout_s"]),
            int(request["max_rows"]),
            int(request["max_value_bytes"]),
        )
        text = json.dumps(response, ensure_ascii=True, allow_nan=True)
        response = None
    except MemoryError:
        out_of_memory = True  # answered below, once the frames holding the rows are gone
    except Exception as error:  # a malformed request: the parent's bug, reported, not fatal
        text = json.dumps(
            {
                "error": f"the database worker failed: {type(error).__name__}: {error}",
                "timed_out": False,
            }
        )
    if out_of_memory:
        text = json.dumps(
            {
                "error": "out of memory: the query needed more memory than the "
                "database worker may use",
                "timed_out": False,
            }
        )
    if len(text) > MAX_RESPONSE_BYTES:
        text = json.dumps(
            {
                "error": f"the result is too large ({len(text) // 1_000_000} MB "
                f"encoded; at most {MAX_RESPONSE_BYTES // 1_000_000} MB): "
                "select fewer rows or columns",
                "timed_out": False,
            }
        )
    return text.encode("ascii") + b"\n"


def serve(memory_bytes: int, stdin=None, stdout=None) -> None:
    """The worker loop: cap memory, say ready, answer requests until stdin closes."""
    import resource
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _, as_hard = resource.getrlimit(resource.RLIMIT_AS)
    if as_hard != resource.RLIM_INFINITY:  # an unprivileged process cannot raise its hard limit
        memory_bytes = min(memory_bytes, as_hard)
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    stdin = stdin or sys.stdin.buffer
    stdout = stdout or sys.stdout.buffer
    _, cpu_hard = resource.getrlimit(resource.RLIMIT_CPU)

    def limit_cpu(request: dict) -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        soft = int(usage.ru_utime + usage.ru_stime + float(request["timeout_s"])) + _CPU_MARGIN_S
        if cpu_hard != resource.RLIM_INFINITY:
            soft = min(soft, cpu_hard)
        resource.setrlimit(resource.RLIMIT_CPU, (soft, cpu_hard))

    try:
        stdout.write(b'{"ready": true}\n')
        stdout.flush()
        for line in stdin:
            stdout.write(answer(line, limit_cpu))
            stdout.flush()
    except (BrokenPipeError, KeyboardInterrupt):  # the parent went away
        pass


if __name__ == "__main__":
    serve(int(sys.argv[1]))
