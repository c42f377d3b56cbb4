"""Every observation and every SQL worker answer has a budget (issue #55, part 4).

* Observations: an environment declares ``max_observation_chars``; the rollout cuts every
  observation to it before tokenising, saying how much it cut; the SQL environment's own table
  fits its budget in the first place (column names cut, columns and rows beyond it counted).
* The SQL worker's answer is at most its byte cap (the worker leaves out what does not fit);
  the caller reads at most that much of a line, so a query that amplifies its result cannot
  grow the caller. Rewards are judged on digests of the whole results, so they do not depend
  on what the answer left out.
* A table-valued function is refused by its name.
* Normal queries keep their observations and rewards (hand-written expectations).

The hostile payloads are this file's own: long column aliases, wide selects, recursive CTEs.
"""

import json
import re
import sqlite3
import subprocess
import sys
import time
import tracemalloc

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl_jax.models.tokenizer import load_tokenizer
from agentrl_jax.rollout import MultiTurnRollout, RolloutConfig
from agentrl_jax.sampling import ScriptedPolicy
from envs.protocol import (
    DEFAULT_OBSERVATION_CHARS,
    MIN_OBSERVATION_CHARS,
    Feedback,
    PythonEnv,
    PythonTextEnv,
    cut_observation,
    observation_budget,
    text_key,
)
from envs.sql import SqlConfig, SqlEnv, SqlTask, demo, query_worker, run_query, worker_pool
from envs.sql.verify import result_digests, results_match

CONFIG = SqlConfig(query_timeout_s=20.0)  # hostile queries take seconds on a loaded machine
BUDGET = CONFIG.max_observation_chars
CUT_NOTE = re.compile(r"\.\.\. \[observation cut: ([\d,]+) more characters\]\Z")


def recursive_rows(rows: int, select: str) -> str:
    """A query of ``rows`` rows (``n`` = 1..rows) selecting ``select``."""
    return (
        f"WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r WHERE n < {rows}) "
        f"SELECT {select} FROM r"
    )


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    return demo.demo_tasks(tmp_path_factory.mktemp("sql-cache"))


@pytest.fixture(scope="module")
def env(tasks):
    return SqlEnv(tasks, CONFIG)


def observe(env, query: str) -> str:
    state, _ = env.reset_task(0, seed=0)
    _, feedback = env.step_task(state, f"<sql>{query}</sql>")
    assert feedback.action_valid and not feedback.done
    return feedback.observation


# ---------------------------------------------------------------- the generic cut


def test_cut_observation_keeps_short_texts_and_states_the_cut():
    assert cut_observation("abc", MIN_OBSERVATION_CHARS) == "abc"
    text = "0123456789" * 20_000  # 200,000 characters
    for budget in (MIN_OBSERVATION_CHARS, 1_000, 12_345):
        out = cut_observation(text, budget)
        cut = int(CUT_NOTE.search(out).group(1).replace(",", ""))
        head = out[: CUT_NOTE.search(out).start()].removesuffix("\n")
        assert len(out) <= budget and text.startswith(head)
        assert len(head) + cut == len(text)  # the note states exactly what is missing
    exact = "x" * 500
    assert cut_observation(exact, 500) == exact
    with pytest.raises(ValueError, match="max_chars must be >= 100"):
        cut_observation(text, 99)


def test_each_environment_declares_its_budget(tasks):
    class Quiet(PythonEnv):
        def instructions(self):
            return ""

        def num_tasks(self):
            return 1

        def reset_task(self, task_id, seed):
            return 0, ""

        def step_task(self, row_state, response):
            return row_state, Feedback("")

        def state_key(self, row_state):
            return 0

    assert observation_budget(object()) == DEFAULT_OBSERVATION_CHARS == 16_000
    quiet = PythonTextEnv(Quiet(), workers=1)
    sql = PythonTextEnv(SqlEnv(tasks[:1]), workers=1)
    quiet.close(), sql.close()
    assert observation_budget(quiet) == DEFAULT_OBSERVATION_CHARS
    assert observation_budget(sql) == SqlConfig().max_observation_chars == 12_000
    Quiet.max_observation_chars = 5
    with pytest.raises(ValueError, match=r"'python-env': max_observation_chars must be an int"):
        PythonTextEnv(Quiet(), workers=1)
    with pytest.raises(ValueError, match="max_observation_chars must be >= 100"):
        SqlConfig(max_observation_chars=50)


class Flood(PythonEnv):
    """Every observation is 50,000 characters: the first ``F`` then ``x``s, the next ``S``
    then ``y``s; a budget of 300 characters."""

    name, t_max, max_observation_chars = "flood", 3, 300

    def instructions(self):
        return "Answer."

    def num_tasks(self):
        return 1

    def reset_task(self, task_id, seed):
        return 0, "F" + "x" * 49_999

    def step_task(self, row_state, response):
        return row_state + 1, Feedback("S" + "y" * 49_999, done=row_state == 1)

    def state_key(self, row_state):
        return text_key(row_state)


def test_the_rollout_cuts_every_observation_before_tokenising():
    tokenizer = load_tokenizer()
    env = PythonTextEnv(Flood(), workers=1)
    seen = []

    def respond(contexts, live):
        seen.append(contexts[0])
        return ["ok"] * len(live)

    try:
        runner = MultiTurnRollout(
            env, tokenizer, RolloutConfig(group_size=1, budget=3, max_response_tokens=8)
        )
        traj = runner(ScriptedPolicy(tokenizer, respond), np.arange(1), jax.random.key(0))
    finally:
        env.close()
    assert traj.trajectory.turns_used.tolist() == [2]
    last = seen[-1]
    assert last.count("x") < 300 and last.count("y") < 300  # the first and a step observation
    notes = [int(n.replace(",", "")) for n in re.findall(r"observation cut: ([\d,]+) more", last)]
    assert len(notes) == 2 and all(49_700 < n < 50_000 for n in notes)


# ---------------------------------------------------------------- (a) amplified observations


def test_a_long_column_alias_is_cut(env):
    alias = "a" * 100_000
    obs = observe(env, f'SELECT 1 AS "{alias}"')
    assert obs == "1 row:\n" + "a" * CONFIG.max_cell_chars + "...\n1"
    assert len(obs) <= BUDGET


def test_a_wide_select_of_long_aliases_is_bounded_and_counts_its_columns(env):
    columns = 500
    select = ", ".join(f'n AS "{i:04d}{"b" * 996}"' for i in range(columns))  # 1,000-char names
    obs = observe(env, recursive_rows(3, select))
    lines = obs.splitlines()
    assert len(obs) <= BUDGET
    assert lines[0] == f"3 rows (truncated: showing {CONFIG.display_columns} of {columns} columns):"
    names = lines[1].split(" | ")
    assert len(names) == CONFIG.display_columns and names[1] == "0001" + "b" * 96 + "..."
    assert lines[2:] == [" | ".join([str(n)] * CONFIG.display_columns) for n in (1, 2, 3)]


def test_wide_rows_of_long_values_fit_the_budget_and_say_what_is_left_out(env):
    cell = "printf('%.*c', 500, 'z')"
    obs = observe(env, recursive_rows(30, ", ".join([cell] * 60)))
    lines = obs.splitlines()
    head = re.fullmatch(
        r"30 rows \(truncated: showing the first (\d+) rows and (\d+) of 60 columns\):",
        lines[0],
    )
    assert head, lines[0]
    shown_rows = int(head.group(1))
    assert head.group(2) == str(CONFIG.display_columns)
    # 50 cut values of 103 characters a row: only what fits the budget is shown, whole rows.
    assert 0 < shown_rows < CONFIG.display_rows and len(lines) == 2 + shown_rows
    assert len(obs) <= BUDGET
    assert lines[2] == " | ".join(["z" * 100 + "..."] * CONFIG.display_columns)


def test_many_rows_are_counted_not_shown(env):
    obs = observe(env, recursive_rows(1_000_000, "n"))
    lines = obs.splitlines()
    assert lines[0] == "more than 10000 rows (truncated: showing the first 20):"
    assert lines[1:] == ["n", *map(str, range(1, 21))] and len(obs) <= BUDGET


def test_an_error_that_echoes_a_long_query_is_cut_and_says_so(env):
    name = "c" * 100_000
    obs = observe(env, f"SELECT {name}")
    assert obs.startswith("Error: no such column: ccc") and len(obs) <= BUDGET
    cut = int(CUT_NOTE.search(obs).group(1).replace(",", ""))
    assert cut > 80_000


# ---------------------------------------------------------------- (b) amplified caller memory


@pytest.fixture()
def pool():
    """A pool of this test's own (so the hostile queries' workers end with it)."""
    saved = worker_pool._pool, worker_pool._pool_pid
    fresh = worker_pool.WorkerPool()
    worker_pool._pool, worker_pool._pool_pid = fresh, worker_pool.os.getpid()
    yield fresh
    fresh.close()
    worker_pool._pool, worker_pool._pool_pid = saved


CAP = CONFIG.max_response_bytes
# What a caller may hold while decoding one answer of CAP bytes: the line read (bytearray and
# bytes), the JSON objects and the rows' tuples. Small decoded values cost ~16x their bytes in
# Python objects at worst (a 2-character string: 5 bytes of JSON, ~70 bytes of objects), so the
# stated bound is 16 x CAP plus 1 MiB of slack for the rest of the call.
PEAK_BOUND = 16 * CAP + (1 << 20)

AMPLIFIERS = {
    # The reproducer: 4,000 rows x 2,000 columns, 8 million cells from 6 KB of SQL. On
    # main (a 64 MB answer, decoded whole) one run grew the caller's peak RSS by 378 MB.
    "4000 x 2000 cells": recursive_rows(4000, ", ".join(["n"] * 2000)),
    "10,000 rows of short texts": recursive_rows(20_000, ", ".join(["'ab'"] * 50)),
    "a cross join of long texts": (
        "SELECT a.title || printf('%.*c', 5000, 'q'), b.* FROM books a, books b, books c"
    ),
}


@pytest.mark.parametrize("query", AMPLIFIERS.values(), ids=AMPLIFIERS.keys())
def test_an_amplifying_query_cannot_grow_the_caller_past_the_cap(tasks, pool, query):
    db = tasks[0].db_path
    limits = CONFIG.limits()
    run_query(db, "SELECT 1", limits)  # the worker starts outside the measurement
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        result = run_query(db, query, limits)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.ok and result.truncated, result.error
    assert peak <= PEAK_BOUND, f"the caller's traced peak was {peak:,} bytes"
    assert len(result.columns) <= CONFIG.display_columns
    assert len(result.digest["ordered"]) == 64  # the whole result was digested


def test_the_worker_answer_is_at_most_its_cap(tasks):
    """The worker itself, in this process, with the smallest cap: names, columns and rows are
    left out to fit, and it says so."""
    cap = query_worker.MIN_RESPONSE_BYTES
    request = {
        "db": str(tasks[0].db_path),
        "query": recursive_rows(300, ", ".join(f'n AS "{"w" * 300}{i}"' for i in range(60))),
        "timeout_s": 10,
        "max_rows": 10_000,
        "max_value_bytes": 1_000_000,
        "max_columns": 2000,
        "max_text_chars": 1000,
        "max_response_bytes": cap,
    }
    line = query_worker.answer(json.dumps(request).encode())
    assert len(line) <= cap + 1 and line.endswith(b"\n")
    response = json.loads(line)
    assert response["truncated"] and response["row_count"] == 300
    assert response["column_count"] == 60 and 0 < len(response["columns"]) < 60
    assert 0 < len(response["rows"]) < 300


def test_the_caller_reads_at_most_the_cap_of_a_line(monkeypatch):
    """A worker that breaks its cap: the caller stops reading one byte past it."""
    writer = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdout.buffer.write(b'x' * 5_000_000 + b'\\n')"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    worker = object.__new__(worker_pool._Worker)
    worker.process = writer
    read = []
    real_read = worker_pool.os.read
    monkeypatch.setattr(
        worker_pool.os, "read", lambda fd, n: read.append(real_read(fd, n)) or read[-1]
    )
    try:
        with pytest.raises(OverflowError):
            worker.read_line(time.monotonic() + 10, 4096)
    finally:
        monkeypatch.undo()
        worker.kill()
    assert sum(map(len, read)) == 4097


# ---------------------------------------------------------------- (c) table-valued functions


@pytest.mark.parametrize(
    "query, function",
    [
        ("SELECT * FROM pragma_table_info('x')", "pragma_table_info"),
        ("SELECT * FROM json_each('[1]')", "json_each"),
        ("SELECT value FROM json_tree('[1, [2]]')", "json_tree"),
        ("SELECT 'json_each' FROM books JOIN pragma_index_list('books')", "pragma_index_list"),
        (
            "SELECT title FROM books WHERE book_id IN (SELECT value FROM json_each('[1]'))",
            "json_each",
        ),
        ("SELECT * FROM dbstat", "dbstat"),
    ],
)
def test_a_table_valued_function_is_refused_by_name(env, query, function):
    obs = observe(env, query)
    assert obs == (
        f"Error: not allowed: the table-valued function {function} cannot be used here; "
        "queries may read the database's tables and views (and sqlite_master, the schema)"
    )
    assert "UPDATE" not in obs


# ---------------------------------------------------------------- (d) normal queries unchanged


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A three-row database and two questions on it (one ordered)."""
    path = tmp_path_factory.mktemp("tiny") / "tiny.sqlite"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE pets (id INTEGER PRIMARY KEY, name TEXT, weight REAL, tag BLOB)")
        conn.executemany(
            "INSERT INTO pets VALUES (?, ?, ?, ?)",
            [(1, "Rex", 12.5, b"\x01\x02"), (2, "Tom\ncat", None, None), (3, "Ada", 4.0, None)],
        )
    conn.close()
    return SqlEnv(
        [
            SqlTask("tiny", path, "Names of pets?", "SELECT name FROM pets"),
            SqlTask("tiny", path, "Pets by weight?", "SELECT name, weight FROM pets ORDER BY id"),
        ],
        SqlConfig(query_timeout_s=5.0),
    )


def test_normal_observations_are_as_before(tiny):
    assert observe(tiny, "SELECT * FROM pets") == (
        "3 rows:\n"
        "id | name | weight | tag\n"
        "1 | Rex | 12.5 | <blob of 2 bytes>\n"
        "2 | Tom\\ncat | NULL | NULL\n"
        "3 | Ada | 4.0 | NULL"
    )
    assert observe(tiny, "SELECT COUNT(*) FROM pets") == "1 row:\nCOUNT(*)\n3"
    assert observe(tiny, "SELECT name FROM pets WHERE id > 9") == (
        "The query returned no rows. Columns: name"
    )
    assert observe(tiny, "SELECT nope FROM pets") == "Error: no such column: nope"
    small = SqlEnv(tiny.tasks, SqlConfig(display_rows=2))
    assert observe(small, "SELECT name, printf('%.*c', 150, 'x') AS long FROM pets") == (
        "3 rows (truncated: showing the first 2):\n"
        "name | long\n"
        f"Rex | {'x' * 100}...\n"
        f"Tom\\ncat | {'x' * 100}..."
    )
    # The one change: a column name is cut like a value (main showed names whole).
    tight = SqlEnv(tiny.tasks, SqlConfig(max_cell_chars=3))
    assert observe(tight, "SELECT COUNT(*) FROM pets") == "1 row:\nCOU...\n3"


def test_normal_rewards_are_as_before(tiny):
    def reward(task_id, query):
        state, _ = tiny.reset_task(task_id, seed=0)
        return tiny.step_task(state, f"<submit>{query}</submit>")[1].reward

    assert reward(0, "SELECT name FROM pets") == 1.0
    assert reward(0, "SELECT name FROM pets ORDER BY name DESC") == 1.0  # any order
    assert reward(0, "SELECT name FROM pets WHERE id < 3") == 0.0
    assert reward(0, "SELECT name, id FROM pets") == 0.0
    assert reward(1, "SELECT name, weight * 1.0 FROM pets ORDER BY id") == 1.0
    assert reward(1, "SELECT name, weight FROM pets ORDER BY id DESC") == 0.0  # order counts
    assert (
        reward(1, "SELECT 'Rex', 12.5 UNION ALL SELECT 'Tom\ncat', NULL UNION ALL SELECT 'Ada', 4")
        == 1.0
    )


def test_rewards_judge_the_whole_result_past_what_the_answer_carries(tmp_path):
    """A gold result of 5,000 rows of 300-character texts is ~1.5 MB of JSON, far over the
    answer's cap: a submission that differs only in the last row's tail, which no answer
    carries, is still wrong, and one that reorders it is still right."""
    path = tmp_path / "big.sqlite"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE t (n INTEGER)")
        conn.executemany("INSERT INTO t VALUES (?)", [(i,) for i in range(1, 5001)])
    conn.close()
    gold = "SELECT n, printf('%.*c', 300, 'g') FROM t"
    env = SqlEnv([SqlTask("big", path, "All?", gold)], SqlConfig(query_timeout_s=10.0))
    assert env.gold_answer(0).truncated and len(env.gold_answer(0).rows) < 5000

    def reward(query):
        state, _ = env.reset_task(0, seed=0)
        return env.step_task(state, f"<submit>{query}</submit>")[1].reward

    assert reward(gold) == 1.0
    assert reward(gold + " ORDER BY n DESC") == 1.0
    tail = "SELECT n, printf('%.*c', 300, 'g') || iif(n = 5000, '!', '') FROM t"
    assert reward(tail) == 0.0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.lists(
            st.one_of(
                st.none(),
                st.integers(-3, 3),
                st.sampled_from([0.1 + 0.2, 0.3, 2.0, -0.0, 1e308 * 10]),
                st.sampled_from(["1", "a", "b", ""]),
                st.sampled_from([b"", b"a", b"\x00"]),
            ),
            min_size=1,
            max_size=2,
        ).map(tuple),
        max_size=4,
    ),
    st.lists(st.integers(0, 3), max_size=4),
    st.booleans(),
)
def test_digests_agree_with_the_verifier(rows, picks, ordered):
    """Judging on digests is the verifier's rule: for results built from each other (shuffled,
    rows repeated or dropped), digests are equal exactly when ``results_match`` says so."""
    other = [rows[i % len(rows)] for i in picks] if rows else []
    for a, b in ((rows, rows[::-1]), (rows, other), (rows, rows + rows[:1])):
        rule = "ordered" if ordered else "unordered"
        same = result_digests(a)[rule] == result_digests(b)[rule]
        assert same == results_match(a, b, ordered), (a, b, ordered)
