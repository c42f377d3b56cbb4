"""InterCode-SQL as a :class:`~envs.protocol.PythonEnv` (paper §2: T_max 10).

An episode is one question about one SQLite database. The first observation shows the
database's schema and the question. Each turn the agent writes one action (grammar in
:mod:`envs.sql.grammar`):

* ``<sql>QUERY</sql>``: the query runs read-only (:mod:`envs.sql.database`) and the agent sees
  the result rows, at most ``SqlConfig.display_rows`` of them with the total count and a note
  when truncated, or the error message (a query past its time limit is stopped and says so;
  it runs in a worker process that is killed at the deadline, so the limit holds for any query).
  The episode goes on.
* ``<submit>QUERY</submit>``: the episode ends; reward 1 if the query's result equals the gold
  query's result (:mod:`envs.sql.verify`), else 0. ``<submit></submit>`` submits the last
  query that ran without error.

Budgets: an observation is at most ``SqlConfig.max_observation_chars`` characters (the
environment's declared budget, :func:`envs.protocol.observation_budget`, which the rollout also
cuts every observation to: the schema too). The result table holds at most ``display_rows``
rows and ``display_columns`` columns, names and values cut to ``max_cell_chars``, and as many
of those rows as fit the budget; its first line says what it leaves out. The worker process
answers in at most ``max_response_bytes`` bytes (it leaves out what the table cannot show), so
a query cannot grow the trainer by more than that; the reward is judged on digests of the
whole results that the worker computes (:mod:`envs.sql.verify`), so it does not depend on
what the answer left out.

A response without one well-formed action is an invalid action (``action_valid`` False) whose
observation says what was wrong; the episode goes on. A query that parses but fails in the
database (syntax error, write attempt, time limit) is a valid action with the error as its
observation. The rollout, not this environment, owns the turn budget and ends the episode.

The anchor key (GiGPO) of a row is the task and the last observation: two trajectories of one
task that saw the same result share an anchor.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import threading
from typing import Any, Callable, Sequence

from envs.protocol import MIN_OBSERVATION_CHARS, Feedback, PythonEnv, cut_observation, text_key
from envs.sql import grammar, query_worker
from envs.sql.database import Cut, QueryLimits, QueryResult, run_query, schema_text
from envs.sql.verify import digest_rule, is_ordered, round_real

INSTRUCTIONS = """\
You answer questions about a SQLite database by writing SQL queries. The first message shows \
the database schema and the question. Each turn, write exactly one action:
- <sql>QUERY</sql> runs one read-only SQL query (a single SELECT statement; WITH and VALUES \
also work) and shows you its result rows (up to {display_rows}) or its error message.
- <submit>QUERY</submit> submits QUERY as your final answer and ends the episode. \
<submit></submit> submits the last query you ran without error.
Your answer is correct when its result has the same rows and columns, in the same column \
order, as the reference answer's; row order counts only if the question asks for an order. \
Column names do not matter. Queries are stopped after {timeout_s:g} seconds. You may think \
before acting; only the action is read."""


@dataclasses.dataclass(frozen=True)
class SqlTask:
    """One question: ``gold_query`` run on ``db_path`` gives the reference result."""

    db_id: str
    db_path: pathlib.Path
    question: str
    gold_query: str

    def __post_init__(self):
        object.__setattr__(self, "db_path", pathlib.Path(self.db_path))
        for field in ("db_id", "question", "gold_query"):
            value = getattr(self, field)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"SqlTask.{field} must be a non-empty string, got {value!r}")


@dataclasses.dataclass(frozen=True)
class SqlConfig:
    """Limits of the environment.

    Attributes:
      query_timeout_s: seconds an agent's query may run.
      gold_timeout_s: seconds a gold query may run (it must finish, or reset fails).
      display_rows: result rows shown to the agent per query.
      max_rows: rows fetched per query; results longer than this are only counted as "more".
        A submitted result longer than this cannot match (a gold result must fit).
      max_cell_chars: characters shown of one value or column name; longer ones are cut
        with "...".
      max_value_bytes: the largest string or blob a query may build.
      display_columns: result columns shown; the rest are counted in the table's first line.
      max_observation_chars: characters of one observation at most (the environment's
        declared budget; module docstring). 12,000 characters are about 3,000 to 4,000
        tokens, under half of the 8,192-token context the registry gives SQL.
      max_response_bytes: the byte cap of the worker process's answer to one query
        (:class:`~envs.sql.database.QueryLimits`), which bounds what a query adds to the
        trainer's memory.
    """

    query_timeout_s: float = 2.0
    gold_timeout_s: float = 30.0
    display_rows: int = 20
    max_rows: int = 10_000
    max_cell_chars: int = 100
    max_value_bytes: int = 1_000_000
    display_columns: int = 50
    max_observation_chars: int = 12_000
    max_response_bytes: int = query_worker.DEFAULT_RESPONSE_BYTES

    def __post_init__(self):
        for field in ("query_timeout_s", "gold_timeout_s"):
            if not getattr(self, field) > 0:
                raise ValueError(f"SqlConfig.{field} must be > 0, got {getattr(self, field)}")
        for field in (
            "display_rows",
            "max_rows",
            "max_cell_chars",
            "max_value_bytes",
            "display_columns",
        ):
            if getattr(self, field) < 1:
                raise ValueError(f"SqlConfig.{field} must be >= 1, got {getattr(self, field)}")
        if self.max_observation_chars < MIN_OBSERVATION_CHARS:
            raise ValueError(
                f"SqlConfig.max_observation_chars must be >= {MIN_OBSERVATION_CHARS}, got "
                f"{self.max_observation_chars}"
            )
        low, high = query_worker.MIN_RESPONSE_BYTES, query_worker.MAX_RESPONSE_BYTES
        if not low <= self.max_response_bytes <= high:
            raise ValueError(
                f"SqlConfig.max_response_bytes must be in [{low}, {high}], got "
                f"{self.max_response_bytes}"
            )

    def limits(self, *, gold: bool = False) -> QueryLimits:
        """One query's limits: the worker sends back the columns and value heads the table
        can show (``display_columns``, ``max_cell_chars``) within ``max_response_bytes``."""
        timeout = self.gold_timeout_s if gold else self.query_timeout_s
        return QueryLimits(
            timeout,
            self.max_rows,
            self.max_value_bytes,
            max_columns=self.display_columns,
            max_text_chars=self.max_cell_chars,
            max_response_bytes=self.max_response_bytes,
        )


@dataclasses.dataclass(frozen=True)
class SqlRowState:
    """One row's state: the task, what the agent saw last, the last query that ran."""

    task_id: int
    last_observation: str
    last_ok_query: str | None = None


@dataclasses.dataclass(frozen=True)
class GoldAnswer:
    """A task's gold result: ``rows``, what the worker sent of it (all of them unless
    ``truncated``), whether its order counts, and its digest under that rule, which
    submissions are judged against (:mod:`envs.sql.verify`)."""

    rows: tuple[tuple[Any, ...], ...]
    ordered: bool
    digest: str
    truncated: bool = False


def _format_value(value: Any, max_chars: int) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, Cut):  # cut by the worker: longer than anything shown
        if isinstance(value.head, bytes):
            return f"<blob of {value.size} bytes>"
        return value.head.replace("\n", "\\n")[:max_chars] + "..."
    if isinstance(value, bytes):
        return f"<blob of {len(value)} bytes>"
    text = repr(round_real(value)) if isinstance(value, float) else str(value)
    text = text.replace("\n", "\\n")
    return text if len(text) <= max_chars else text[:max_chars] + "..."


def _table_head(count: str, rows: int, shown_rows: int, columns: int, shown_columns: int) -> str:
    """The first line of a result table: ``count`` rows (``rows`` of them fetched) and what is
    left out of the table (``shown_rows`` rows, ``shown_columns`` of ``columns`` columns)."""
    noun = "row" if count == "1" else "rows"
    rows_cut, columns_cut = shown_rows < rows or not count.isdigit(), shown_columns < columns
    if rows_cut and columns_cut:
        return (
            f"{count} {noun} (truncated: showing the first {shown_rows} rows and "
            f"{shown_columns} of {columns} columns):"
        )
    if rows_cut:
        return f"{count} {noun} (truncated: showing the first {shown_rows}):"
    if columns_cut:
        return f"{count} {noun} (truncated: showing {shown_columns} of {columns} columns):"
    return f"{count} {noun}:"


def render_result(result: QueryResult, config: SqlConfig) -> str:
    """The observation of an executed query: an error line, or a count and a table of at most
    ``display_rows`` rows (as many as fit ``max_observation_chars``) and ``display_columns``
    columns, names and values cut to ``max_cell_chars``; its first line says what is left
    out. At most ``config.max_observation_chars`` characters."""
    budget = config.max_observation_chars
    if not result.ok:
        return cut_observation(f"Error: {result.error}", budget)
    shown_columns = result.columns[: config.display_columns]
    header = " | ".join(_format_value(c, config.max_cell_chars) for c in shown_columns)
    hidden = result.column_count - len(shown_columns)
    if not result.row_count:
        more = f" (and {hidden} more columns)" if hidden > 0 else ""
        return cut_observation(f"The query returned no rows. Columns: {header}{more}", budget)
    count = f"more than {config.max_rows}" if result.more_rows else str(result.row_count)
    lines = [
        " | ".join(_format_value(v, config.max_cell_chars) for v in row[: len(shown_columns)])
        for row in result.rows[: config.display_rows]
    ]
    head = functools.partial(
        _table_head,
        count,
        result.row_count,
        columns=result.column_count,
        shown_columns=len(shown_columns),
    )
    shown = _rows_that_fit([len(line) for line in lines], len(header), head, budget)
    text = "\n".join([head(shown), header, *lines[:shown]])
    return cut_observation(text, budget)  # a no-op unless the header alone overflows


def _rows_that_fit(
    line_chars: list[int], header_chars: int, head: Callable[[int], str], budget: int
) -> int:
    """The most leading rows (of ``len(line_chars)``) whose table, ``head(k)`` line, header
    line and ``k`` row lines joined by newlines, has at most ``budget`` characters; 0 if none
    does."""
    total = header_chars + 1 + sum(line_chars) + len(line_chars)
    for k in range(len(line_chars), 0, -1):
        if len(head(k)) + total <= budget:
            return k
        total -= line_chars[k - 1] + 1
    return 0


class SqlEnv(PythonEnv):
    """InterCode-SQL over a list of :class:`SqlTask` (module docstring)."""

    name = "intercode-sql"
    t_max = 10

    def __init__(self, tasks: Sequence[SqlTask], config: SqlConfig = SqlConfig()):
        if not tasks:
            raise ValueError("SqlEnv: tasks is empty")
        for i, task in enumerate(tasks):
            if not task.db_path.is_file():
                raise FileNotFoundError(
                    f"SqlEnv: task {i} ({task.db_id!r}): database file not found: {task.db_path}"
                )
        self.tasks = tuple(tasks)
        self.config = config
        self.max_observation_chars = config.max_observation_chars  # the declared budget
        self._gold: dict[int, GoldAnswer] = {}
        self._schemas: dict[pathlib.Path, str] = {}
        self._lock = threading.Lock()  # guards the two caches across worker threads

    def instructions(self) -> str:
        return INSTRUCTIONS.format(
            display_rows=self.config.display_rows, timeout_s=self.config.query_timeout_s
        )

    def num_tasks(self) -> int:
        return len(self.tasks)

    def gold_answer(self, task_id: int) -> GoldAnswer:
        """The gold result of a task (cached). Raises ``ValueError`` naming the task if its
        gold query fails or returns more than ``max_rows`` rows: the data is at fault."""
        with self._lock:
            cached = self._gold.get(task_id)
        if cached is not None:
            return cached
        task = self.tasks[task_id]
        result = run_query(task.db_path, task.gold_query, self.config.limits(gold=True))
        if not result.ok or result.more_rows:
            problem = result.error or f"returns more than max_rows={self.config.max_rows} rows"
            raise ValueError(
                f"SqlEnv: the gold query of task {task_id} ({task.db_id!r}) "
                f"fails: {problem}; query: {task.gold_query}"
            )
        ordered = is_ordered(task.gold_query)
        answer = GoldAnswer(
            result.rows, ordered, result.digest[digest_rule(ordered)], result.truncated
        )
        with self._lock:
            self._gold[task_id] = answer
        return answer

    def first_observation(self, task_id: int) -> str:
        task = self.tasks[task_id]
        with self._lock:
            schema = self._schemas.get(task.db_path)
        if schema is None:
            schema = schema_text(task.db_path)
            with self._lock:
                self._schemas[task.db_path] = schema
        return f"Database {task.db_id!r} has this schema:\n\n{schema}\n\nQuestion: {task.question}"

    def reset_task(self, task_id: int, seed: int) -> tuple[SqlRowState, str]:
        del seed  # the task fully determines the episode
        self.gold_answer(task_id)  # a broken gold query fails here, naming the task
        observation = self.first_observation(task_id)
        return SqlRowState(task_id, observation), observation

    def step_task(self, row_state: SqlRowState, response: str) -> tuple[SqlRowState, Feedback]:
        action = grammar.parse_response(response)
        if isinstance(action, grammar.Invalid):
            observation = f"Invalid action: {action.reason}. Example: {grammar.EXAMPLE}"
            return (
                dataclasses.replace(row_state, last_observation=observation),
                Feedback(observation, action_valid=False),
            )
        if isinstance(action, grammar.Execute):
            return self._execute(row_state, action.query)
        return self._submit(row_state, action.query)

    def _execute(self, row_state: SqlRowState, query: str) -> tuple[SqlRowState, Feedback]:
        task = self.tasks[row_state.task_id]
        result = run_query(task.db_path, query, self.config.limits())
        observation = render_result(result, self.config)
        last_ok = query if result.ok else row_state.last_ok_query
        return SqlRowState(row_state.task_id, observation, last_ok), Feedback(observation)

    def _submit(self, row_state: SqlRowState, query: str | None) -> tuple[SqlRowState, Feedback]:
        query = query or row_state.last_ok_query
        if query is None:
            observation = (
                "Invalid action: <submit></submit> submits the last query that ran "
                "without error, and none has. Run one with <sql>QUERY</sql> first, "
                "or put your answer inside the tags: <submit>QUERY</submit>."
            )
            return (
                dataclasses.replace(row_state, last_observation=observation),
                Feedback(observation, action_valid=False),
            )
        task = self.tasks[row_state.task_id]
        gold = self.gold_answer(row_state.task_id)
        result = run_query(task.db_path, query, self.config.limits())
        # Judged on the digests of the whole results (the worker's answer may leave rows out).
        correct = (
            result.ok
            and not result.more_rows
            and result.digest[digest_rule(gold.ordered)] == gold.digest
        )
        if not result.ok:
            observation = (
                f"Submitted. The query failed, so the answer is wrong. Error: {result.error}"
            )
        elif correct:
            observation = "Submitted. The result matches the reference answer."
        else:
            observation = "Submitted. The result does not match the reference answer."
        feedback = Feedback(observation, reward=float(correct), done=True, success=correct)
        return SqlRowState(row_state.task_id, observation, row_state.last_ok_query), feedback

    def state_key(self, row_state: SqlRowState) -> int:
        return text_key(row_state.task_id, row_state.last_observation)
