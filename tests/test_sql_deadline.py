"""Hostile SQL: the query deadline holds for any statement, and a killed query harms nothing.

SQLite checks a deadline only between its virtual-machine instructions, and some single
calls run for many seconds (a ``printf`` width of a billion, ``instr`` over long strings). Each
query runs in a worker process that is killed at the deadline; these tests play such queries
through the environment with a 1 s limit and assert that the step returns within 3 s (a bound
on a hang, not a benchmark), that the observation is the ordinary timed-out one, and that the
worker is replaced: the next query runs normally on a fresh process.
"""

import os
import re
import signal
import threading
import time

import numpy as np
import pytest

from envs.protocol import PythonTextEnv
from envs.sql import SqlConfig, SqlEnv, demo, run_query, worker_pool
from envs.sql.database import QueryLimits, result_of

LIMIT_S = 1.0
BOUND_S = 3.0  # the limit, the kill and a fresh worker's start-up fit well within this
TIMED_OUT = f"Error: the query ran longer than the {LIMIT_S:g} s limit and was stopped"
GOLD = "SELECT COUNT(*) FROM books"  # task 0's answer

# Single SQLite calls that run far past a 1 s limit (about 8 s and 3 s here, in one call each).
ONE_LONG_CALL = {
    "printf width": "SELECT printf('%.*c', 1000000000, 'x')",
    "instr over long strings": (
        "SELECT instr(printf('%.*c', 999999, 'a'), printf('%.*c', 99999, 'a') || 'b')"
    ),
}
# Other hostile queries: each fails fast (a value over the size cap) or times out.
HOSTILE = {
    "huge zeroblob": "SELECT zeroblob(1000000000)",
    "huge randomblob": "SELECT randomblob(1000000000)",
    "recursive CTE of huge rows": (
        "WITH RECURSIVE r(n, s) AS (SELECT 1, printf('%.*c', 500000, 'x') "
        "UNION ALL SELECT n + 1, s FROM r WHERE n < 10000000) "
        "SELECT count(*) FROM r"
    ),
    "doubling strings": (
        "WITH RECURSIVE r(s) AS (SELECT 'x' UNION ALL SELECT s || s FROM r) SELECT length(s) FROM r"
    ),
    "replace growing a huge string": "SELECT replace(printf('%.*c', 999999, 'a'), 'a', 'aa')",
    "LIKE on a huge string": "SELECT printf('%.*c', 999999, 'a') LIKE '%a%a%a%a%a%a%a%a%a%b'",
    "a cross join of huge strings": (
        "SELECT count(*) FROM (SELECT replace(printf('%.*c', 999999, 'a'), "
        "'a', 'b') FROM books a, books b, books c, books d)"
    ),
}


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    return demo.demo_tasks(tmp_path_factory.mktemp("sql-cache"))


@pytest.fixture()
def pool():
    """A fresh shared pool for each test, so counts of started workers are this test's own."""
    saved = worker_pool._pool, worker_pool._pool_pid
    fresh = worker_pool.WorkerPool()
    worker_pool._pool, worker_pool._pool_pid = fresh, os.getpid()
    yield fresh
    fresh.close()
    worker_pool._pool, worker_pool._pool_pid = saved


@pytest.fixture()
def env(tasks, pool):
    return SqlEnv(tasks, SqlConfig(query_timeout_s=LIMIT_S))


def timed_step(env, state, response):
    start = time.monotonic()
    state, feedback = env.step_task(state, response)
    return state, feedback, time.monotonic() - start


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("name", list(ONE_LONG_CALL))
def test_one_long_call_is_killed_at_the_deadline_and_its_worker_replaced(env, pool, name):
    state, _ = env.reset_task(0, seed=0)  # the gold query runs: one idle worker now
    (pid,) = pool.pids()
    started = pool.started
    state, fb, elapsed = timed_step(env, state, f"<sql>{ONE_LONG_CALL[name]}</sql>")
    assert elapsed < BOUND_S, f"{name}: the step took {elapsed:.1f} s"
    assert fb.observation == TIMED_OUT
    assert (fb.action_valid, fb.done, fb.reward) == (True, False, 0.0)
    assert not alive(pid) and pool.pids() == []  # killed and reaped
    state, fb, _ = timed_step(env, state, f"<submit>{GOLD}</submit>")
    assert (fb.reward, fb.done) == (1.0, True)
    assert pool.started == started + 1 and len(pool.pids()) == 1  # a fresh worker ran it


def test_a_long_call_submitted_scores_0_within_the_limit(env):
    state, _ = env.reset_task(0, seed=0)
    _, fb, elapsed = timed_step(env, state, f"<submit>{ONE_LONG_CALL['printf width']}</submit>")
    assert elapsed < BOUND_S
    assert (fb.reward, fb.done, fb.success) == (0.0, True, False)
    assert fb.observation == (
        "Submitted. The query failed, so the answer is wrong. Error: "
        f"the query ran longer than the {LIMIT_S:g} s limit and was stopped"
    )


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_queries_fail_or_time_out_within_the_limit(env, name):
    state, _ = env.reset_task(0, seed=0)
    state, fb, elapsed = timed_step(env, state, f"<sql>{HOSTILE[name]}</sql>")
    assert elapsed < BOUND_S, f"{name}: the step took {elapsed:.1f} s"
    assert fb.action_valid and not fb.done
    assert fb.observation.startswith("Error:") or re.fullmatch(
        r"1 row:\n.*\n\d+", fb.observation
    ), fb.observation[:200]
    _, fb, _ = timed_step(env, state, f"<submit>{GOLD}</submit>")
    assert fb.reward == 1.0


def test_a_query_the_worker_stops_itself_keeps_the_worker(env, pool):
    hang = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c"
    state, _ = env.reset_task(0, seed=0)
    pids = pool.pids()
    state, fb, elapsed = timed_step(env, state, f"<sql>{hang}</sql>")
    assert fb.observation == TIMED_OUT and elapsed < BOUND_S
    assert pool.pids() == pids  # stopped between instructions: no kill, no restart


def test_concurrent_hostile_rows_through_the_rollout_wrapper(tasks, pool):
    env = PythonTextEnv(
        SqlEnv(tasks, SqlConfig(query_timeout_s=LIMIT_S)), workers=4, step_timeout_s=30
    )
    rows, _ = env.reset(np.zeros(4, int), seed=0)
    responses = [
        f"<sql>{ONE_LONG_CALL['printf width']}</sql>",
        f"<sql>{ONE_LONG_CALL['instr over long strings']}</sql>",
        f"<submit>{GOLD}</submit>",
        f"<sql>{HOSTILE['recursive CTE of huge rows']}</sql>",
    ]
    start = time.monotonic()
    rows, r = env.step(rows, responses, np.ones(4, bool))
    elapsed = time.monotonic() - start
    env.close()
    assert elapsed < BOUND_S, f"the batch took {elapsed:.1f} s"
    np.testing.assert_array_equal(r.info["timeout"], np.zeros(4, bool))  # the query limit fired
    assert [r.observations[i] for i in (0, 1, 3)] == [TIMED_OUT] * 3
    np.testing.assert_array_equal(r.reward, [0, 0, 1, 0])


def test_worker_memory_is_capped(env, pool):
    state, _ = env.reset_task(0, seed=0)
    (pid,) = pool.pids()
    with open(f"/proc/{pid}/limits") as f:
        limits = f.read()
    cap = re.search(r"Max address space\s+(\d+)\s+(\d+)", limits)
    assert cap and int(cap.group(1)) == int(cap.group(2)) == worker_pool.MEMORY_BYTES
    # 5000 rows of 900 KB each: more than a worker may hold (a small cap here, to be quick).
    # An error, not a crash, and the worker lives on.
    small = worker_pool.WorkerPool(memory_bytes=160 << 20)
    worker_pool._pool = small  # the fixture puts the saved pool back
    many = (
        "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r WHERE n < 5000) "
        "SELECT zeroblob(900000) FROM r"
    )
    try:
        state, fb, elapsed = timed_step(env, state, f"<sql>{many}</sql>")
        assert elapsed < BOUND_S
        assert fb.observation == (
            "Error: out of memory: the query needed more memory than the database worker may use"
        )
        (small_pid,) = small.pids()
        _, fb, _ = timed_step(env, state, f"<submit>{GOLD}</submit>")
        assert fb.reward == 1.0 and small.pids() == [small_pid]
    finally:
        small.close()


def test_a_worker_that_dies_is_replaced_and_never_raises(tasks, pool):
    db = tasks[0].db_path
    limits = QueryLimits(timeout_s=5.0)
    assert run_query(db, "SELECT 1", limits).rows == ((1,),)
    (idle,) = pool.pids()
    os.kill(idle, signal.SIGKILL)  # dies while idle: the next query retries on a fresh one
    time.sleep(0.05)
    assert run_query(db, "SELECT 2", limits).rows == ((2,),)
    (busy,) = pool.pids()
    killer = threading.Timer(0.3, os.kill, (busy, signal.SIGKILL))  # dies mid-query
    killer.start()
    start = time.monotonic()
    hang = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c"
    result = run_query(db, hang, limits)
    killer.join()
    assert time.monotonic() - start < 2.0
    assert not result.ok and not result.timed_out
    assert result.error == "the database worker died during the query (exit status -9)"
    assert run_query(db, "SELECT 3", limits).rows == ((3,),)


def test_results_cross_as_plain_data(tasks, pool):
    result = run_query(
        tasks[0].db_path,
        "SELECT x'00ff', 1.5, NULL, 'é\n', 9223372036854775807, -0.0, 1e308 * 10",
        QueryLimits(),
    )
    assert result.rows == (
        (b"\x00\xff", 1.5, None, "é\n", 9223372036854775807, -0.0, float("inf")),
    )
    assert result.columns[0] == "x'00ff'"


@pytest.mark.parametrize(
    "response",
    [
        {},
        {"columns": ["a"]},
        {"columns": ["a"], "rows": "ab", "more_rows": False},
        {"columns": ["a"], "rows": [[{"x": 1}]], "more_rows": False},
        {"columns": ["a"], "rows": [[["not base64!"]]], "more_rows": False},
        {"columns": ["a"], "rows": [[[1, 2]]], "more_rows": False},
    ],
)
def test_a_malformed_worker_answer_is_an_error_result(response):
    result = result_of(response)
    assert not result.ok and "answered nonsense" in result.error
