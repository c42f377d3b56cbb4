"""The inside of a SQL worker process: one untrusted query run read-only against a SQLite file.

This file is also run on its own, as the worker process of :mod:`envs.sql.worker_pool`
(``python -I -S query_worker.py MEMORY_BYTES``), so it imports only the standard library and
its sibling :mod:`envs.sql.verify` (standard library only; loaded from its file there).

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
one response line, both JSON. A request holds ``db``, ``query``, ``timeout_s``, ``max_rows``,
``max_value_bytes``, ``max_columns``, ``max_text_chars`` and ``max_response_bytes``. A response
holds ``error`` and ``timed_out``, or a result:

* ``columns``: the names of the first ``max_columns`` columns; ``column_count``: how many the
  result has;
* ``rows``: the first rows, each with the cells of those columns, as many as fit the answer's
  byte cap (cells as JSON values, a blob as a one-item list holding its base64 text, a text or
  blob longer than ``max_text_chars`` as ``{"head": cell, "size": n}``: its first
  ``max_text_chars`` characters or bytes and its full length); ``row_count``: how many rows
  were fetched (at most ``max_rows``), ``more_rows``: the result had more;
* ``truncated``: some rows, columns or values were left out or cut to fit;
* ``digest``: :func:`envs.sql.verify.result_digests` of every fetched row, whole, for judging.

The response line is at most ``max_response_bytes`` bytes (:func:`response_cap`), whatever the
query, so a caller reads at most that much per line (:mod:`envs.sql.worker_pool`) and decodes
nothing larger. Only plain data crosses; the parent decodes cells with :func:`decode_cell`.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import pathlib
import re
import sqlite3
import sys
import time


def _load_sibling(name: str):
    """The module in this folder's ``name``.py, loaded from its file (the worker process runs
    with ``-I``, so this folder is not on its path)."""
    import importlib.util

    path = pathlib.Path(__file__).resolve().with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_sql_worker_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __package__:
    from envs.sql import verify
else:  # the worker process: python -I -S query_worker.py
    verify = _load_sibling("verify")

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
# The byte cap of one response line (a request's max_response_bytes, clamped to these bounds):
# the worker leaves out rows, columns and the tails of values to fit it.
DEFAULT_RESPONSE_BYTES = 256 * 1024
MIN_RESPONSE_BYTES = 4 * 1024  # room for an error message and a result's fixed fields
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
_FIXED_BYTES = 1024  # a result's fields other than columns and rows, encoded, at most
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


@dataclasses.dataclass(frozen=True)
class Cut:
    """A text or blob value cut to fit an answer: its first characters (a text) or bytes (a
    blob), ``head``, and its full length in the same unit, ``size`` (> ``len(head)``)."""

    head: str | bytes
    size: int


def cut_value(value, max_chars: int):
    """``value``, or a :class:`Cut` of its first ``max_chars`` characters (bytes of a blob)
    where it is a text (blob) longer than that."""
    if isinstance(value, (str, bytes)) and len(value) > max_chars:
        return Cut(value[:max_chars], len(value))
    return value


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=True, allow_nan=True, separators=(",", ":"))


def response_cap(request) -> int:
    """The byte cap of the answer to ``request`` (a dict, or anything a malformed line gave):
    its ``max_response_bytes``, else :data:`DEFAULT_RESPONSE_BYTES`, within
    [:data:`MIN_RESPONSE_BYTES`, :data:`MAX_RESPONSE_BYTES`]. The worker and the caller both
    read it with this function, so they agree."""
    cap = request.get("max_response_bytes") if isinstance(request, dict) else None
    if isinstance(cap, bool) or not isinstance(cap, int):
        cap = DEFAULT_RESPONSE_BYTES
    return min(max(cap, MIN_RESPONSE_BYTES), MAX_RESPONSE_BYTES)


def bounded_result(
    columns: list, rows: list, more_rows: bool, max_columns: int, max_text_chars: int, cap: int
) -> dict:
    """The response of a result of ``len(rows)`` fetched rows (module docstring), at most
    ``cap`` bytes encoded: the first ``max_columns`` columns' names, then the rows whose cells
    (of those columns) fit, in order, every text or blob longer than ``max_text_chars`` cut
    (:class:`Cut`). The names take at most half of the room; the digest covers every row whole.
    """
    room = cap - _FIXED_BYTES
    names, used, cut = [], 2, False  # 2: the list's brackets
    for name in columns[:max_columns]:
        cell = encode_cell(cut_value(name, max_text_chars))
        size = len(_json(cell)) + 1  # and its comma
        if used + size > room // 2:
            break
        names.append(cell)
        used, cut = used + size, cut or isinstance(cell, dict)
    shipped, used = [], used + 2
    for row in rows:
        cells = [encode_cell(cut_value(v, max_text_chars)) for v in row[: len(names)]]
        size = len(_json(cells)) + 1
        if used + size > room:
            break
        shipped.append(cells)
        used, cut = used + size, cut or any(isinstance(c, dict) for c in cells)
    return {
        "columns": names,
        "column_count": len(columns),
        "rows": shipped,
        "row_count": len(rows),
        "more_rows": more_rows,
        "truncated": cut or len(names) < len(columns) or len(shipped) < len(rows),
        "digest": verify.result_digests(rows),
    }


_SCHEMA_UPDATE = "UPDATE on sqlite_master"  # how a table-valued function is refused
_TABLE_FUNCTIONS: frozenset | None = None  # filled on first use (a connection's modules)
_STRING_LITERAL = re.compile(r"'(?:[^']|'')*'")
_VTAB_FAILED = re.compile(r"vtable constructor failed: (\w+)")


def table_function_names() -> frozenset:
    """The lower-case names of the table-valued functions (eponymous virtual tables) SQLite
    offers here: its modules (``json_each``, ``json_tree``, ``dbstat``, ...) and a
    ``pragma_NAME`` for each pragma."""
    global _TABLE_FUNCTIONS
    if _TABLE_FUNCTIONS is None:
        conn = sqlite3.connect(":memory:")
        try:
            modules = [row[0] for row in conn.execute("PRAGMA module_list")]
            pragmas = [f"pragma_{row[0]}" for row in conn.execute("PRAGMA pragma_list")]
        except sqlite3.Error:  # a build without these pragmas: names are found by error only
            modules, pragmas = [], []
        finally:
            conn.close()
        _TABLE_FUNCTIONS = frozenset(name.lower() for name in modules + pragmas)
    return _TABLE_FUNCTIONS


def table_function_in(query: str, error: str) -> str | None:
    """The table-valued function a refused query used, or None if it names none: the one
    SQLite's error names, else the first known name (:func:`table_function_names`) in the
    query outside its string literals. SQLite refuses one through the authorizer as an UPDATE
    on sqlite_master (the virtual table's constructor declares its schema), so the name comes
    from here."""
    named = _VTAB_FAILED.search(error)
    if named:
        return named.group(1)
    text = _STRING_LITERAL.sub("''", query).lower()
    found = [
        (match.start(), name)
        for name in table_function_names()
        for match in [re.search(rf"(?<![\w$]){re.escape(name)}(?![\w$])", text)]
        if match
    ]
    return min(found)[1] if found else None


def _refusal(denied: list, query: str, error: str) -> str:
    """The error message of a query the authorizer refused (``denied``: what, in order)."""
    first = denied[0]
    if first.startswith("function "):
        return (
            f"not allowed: {first[len('function ') :]} is not a function queries may call "
            "here (SQLite's core scalar, aggregate, date, window and math functions are)"
        )
    table_function = table_function_in(query, error) if first == _SCHEMA_UPDATE else None
    if table_function is not None:
        return (
            f"not allowed: the table-valued function {table_function} cannot be used here; "
            "queries may read the database's tables and views (and sqlite_master, the schema)"
        )
    return (
        "not allowed: the database is read-only and only a reading query may run "
        f"(refused: {first})"
    )


def execute(
    db_path: str,
    query: str,
    timeout_s: float,
    max_rows: int,
    max_value_bytes: int,
    max_columns: int,
    max_text_chars: int,
    cap: int,
) -> dict:
    """Run ``query`` under the guards; the response dict (module docstring), cells undecoded,
    a result bounded to ``cap`` bytes encoded (:func:`bounded_result`).

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
        more_rows = len(rows) > max_rows
        del rows[max_rows:]
        return bounded_result(columns, rows, more_rows, max_columns, max_text_chars, cap)
    except (sqlite3.Error, ValueError) as error:  # ValueError: a NUL or lone surrogate in the text
        if stopped:
            return {"error": timeout_message(timeout_s), "timed_out": True}
        if denied:
            return {"error": _refusal(denied, query, str(error)), "timed_out": False}
        return {"error": str(error) or type(error).__name__, "timed_out": False}
    finally:
        conn.close()


def encode_cell(value):
    """A cell as a JSON value: a blob becomes ``[base64 text]``, a :class:`Cut` value
    ``{"head": its head's cell, "size": n}``; None, int, float, str stay."""
    if isinstance(value, Cut):
        return {"head": encode_cell(value.head), "size": value.size}
    if isinstance(value, bytes):
        return [base64.b64encode(value).decode("ascii")]
    return value


def decode_cell(value):
    """The inverse of :func:`encode_cell`. Raises ``ValueError`` on anything it never writes."""
    if isinstance(value, dict):
        size = value.get("size")
        head = decode_cell(value["head"]) if set(value) == {"head", "size"} else None
        if (
            not isinstance(head, (str, bytes))
            or isinstance(size, bool)
            or not isinstance(size, int)
            or size <= len(head)
        ):
            raise ValueError(f"malformed cut cell: {str(value)[:80]}")
        return Cut(head, size)
    if isinstance(value, list):
        if len(value) != 1 or not isinstance(value[0], str):
            raise ValueError(f"malformed blob cell: {str(value)[:80]}")
        return base64.b64decode(value[0], validate=True)
    if value is None or isinstance(value, (int, float, str)):
        return value
    raise ValueError(f"malformed cell of type {type(value).__name__}")


def fit(response: dict, cap: int) -> str:
    """``response`` encoded in at most ``cap`` bytes (>= :data:`MIN_RESPONSE_BYTES`): a result
    fits by construction (:func:`bounded_result`); an error message that echoes a long query is
    cut, saying so; anything else over the cap becomes an error naming its size."""
    text = _json(response)
    if len(text) <= cap:
        return text
    message = response.get("error")
    if isinstance(message, str):
        keep = (cap - _FIXED_BYTES) // 12  # a character is at most 12 bytes (a \uXXXX pair)
        cut = f"{message[:keep]} ... [{len(message) - keep:,} more characters cut]"
        return _json({**response, "error": cut})
    return _json(
        {
            "error": f"the database worker's answer is {len(text):,} bytes encoded, over its "
            f"{cap:,}-byte cap",
            "timed_out": False,
        }
    )


def answer(line: bytes, before_query=None) -> bytes:
    """The response line (ending in a newline, at most :func:`response_cap` bytes before it) to
    one request line; never raises.

    ``before_query(request)``, if given, runs once the request is read, before the query.
    """
    out_of_memory, cap = False, DEFAULT_RESPONSE_BYTES
    try:
        request = json.loads(line)
        cap = response_cap(request)
        if before_query is not None:
            before_query(request)
        response = execute(
            request["db"],
            request["query"],
            float(request["timeout_s"]),
            int(request["max_rows"]),
            int(request["max_value_bytes"]),
            int(request["max_columns"]),
            int(request["max_text_chars"]),
            cap,
        )
        text = fit(response, cap)
        response = None
    except MemoryError:
        out_of_memory = True  # answered below, once the frames holding the rows are gone
    except Exception as error:  # a malformed request: the parent's bug, reported, not fatal
        text = fit(
            {
                "error": f"the database worker failed: {type(error).__name__}: {error}",
                "timed_out": False,
            },
            cap,
        )
    if out_of_memory:
        text = _json(
            {
                "error": "out of memory: the query needed more memory than the "
                "database worker may use",
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
