"""InterCode-SQL: grammar, read-only guards, timeouts, the verifier, the demo set and Spider data.

References are independent of the code under test: every demo answer is recomputed from the
Python data in plain Python, write attempts are checked against the database file's bytes,
and hand-made result pairs pin the comparison rules.
"""

import collections
import hashlib
import json
import pathlib
import sqlite3
import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs.protocol import PythonTextEnv, text_key
from envs.sql import (
    Execute,
    Invalid,
    SqlConfig,
    SqlEnv,
    SqlTask,
    Submit,
    demo,
    is_ordered,
    load_spider,
    make_env,
    normalise_value,
    parse_response,
    results_match,
    run_query,
)
from envs.sql.database import QueryLimits

HANG = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c"
FAST = SqlConfig(query_timeout_s=0.3)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    return demo.demo_tasks(tmp_path_factory.mktemp("sql-cache"))


@pytest.fixture(scope="module")
def env(tasks):
    return SqlEnv(tasks, FAST)


def play(env, task_id, *responses):
    """Reset ``task_id`` and play ``responses``; the list of Feedbacks."""
    state, _ = env.reset_task(task_id, seed=0)
    out = []
    for response in responses:
        state, feedback = env.step_task(state, response)
        out.append(feedback)
    return out


def file_digest(path):
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


# ---------------------------------------------------------------- the demo task set


def python_answers():
    """Every demo question answered in plain Python from demo.TABLES: (rows, ordered)."""
    t = demo.TABLES
    authors = {a[0]: a for a in t["authors"]}
    books = {b[0]: b for b in t["books"]}
    orders = {o[0]: o for o in t["orders"]}
    sold = collections.Counter()
    for _order_id, book_id, qty in t["order_items"]:
        sold[book_id] += qty
    bought = collections.Counter()
    for order_id, _book_id, qty in t["order_items"]:
        bought[orders[order_id][1]] += qty
    names = {c[0]: c[1] for c in t["customers"]}
    genres = collections.defaultdict(list)
    for b in books.values():
        if b[3] is not None:
            genres[b[3]].append(b[5])
    mean_price = statistics.fmean(b[5] for b in books.values())
    born = [a[3] for a in authors.values() if a[3] is not None]
    in_2023 = [o for o in orders.values() if o[2].startswith("2023")]
    author_genres = collections.defaultdict(set)
    for b in books.values():
        if b[3] is not None:
            author_genres[b[2]].add(b[3])
    return [
        ([(len(books),)], False),
        ([(b[1],) for b in books.values() if b[4] < 1990], False),
        ([(a[1],) for a in authors.values() if a[2] == "Canada"], False),
        ([(city,) for city in {c[2] for c in t["customers"]}], False),
        ([(a[1],) for a in authors.values() if a[3] == min(born)], False),
        ([(g, len(p)) for g, p in genres.items()], False),
        ([(b[1], authors[b[2]][1]) for b in books.values() if authors[b[2]][2] == "Canada"], False),
        ([(statistics.fmean(genres["fantasy"]),)], False),
        ([(b[1],) for b in sorted(books.values(), key=lambda b: -b[5])[:3]], True),
        ([(a[1],) for a in authors.values() if all(b[2] != a[0] for b in books.values())], False),
        ([(c[1],) for c in t["customers"] if all(o[1] != c[0] for o in orders.values())], False),
        ([(len(in_2023),)], False),
        ([(names[c], n) for c, n in sorted(bought.items(), key=lambda kv: -kv[1])], True),
        ([(books[sold.most_common(1)[0][0]][1],)], True),
        (
            [
                (
                    sum(
                        qty * books[b][5]
                        for o, b, qty in t["order_items"]
                        if orders[o][2].startswith("2023")
                    ),
                )
            ],
            False,
        ),
        ([(g,) for g, p in genres.items() if statistics.fmean(p) > mean_price], False),
        ([(authors[a][1],) for a, g in author_genres.items() if len(g) > 1], False),
        (
            [
                (m, n)
                for m, n in sorted(collections.Counter(int(o[2][5:7]) for o in in_2023).items())
            ],
            True,
        ),
    ]


def test_demo_gold_queries_agree_with_a_python_reference(env):
    reference = python_answers()
    assert env.num_tasks() == len(demo.QUESTIONS) == len(reference) == 18
    for task_id, (rows, ordered) in enumerate(reference):
        gold = env.gold_answer(task_id)
        assert gold.ordered == ordered, task_id
        assert len(gold.rows) == len(rows) > 0, task_id
        assert results_match(rows, gold.rows, ordered), (task_id, rows, gold.rows)
    # The order-sensitive answers have no ties to break, so "ordered" is well defined.
    assert [r[1] for r in reference[12][0]] == [9, 7, 6, 3, 2, 1]


def test_demo_database_is_built_once_per_definition(tmp_path):
    first = demo.database_path(tmp_path)
    mtime = first.stat().st_mtime_ns
    assert demo.database_path(tmp_path) == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no scratch file left behind


def test_every_gold_query_submitted_gets_reward_1(env):
    for task_id, (_, gold) in enumerate(demo.QUESTIONS):
        (fb,) = play(env, task_id, f"<submit>{gold};</submit>")
        assert (fb.reward, fb.done, fb.success, fb.action_valid) == (1.0, True, True, True), task_id
        assert "matches" in fb.observation


def test_wrong_answers_get_0(env):
    for task_id, (_, gold) in enumerate(demo.QUESTIONS):
        missing_row = f"SELECT * FROM ({gold}) LIMIT -1 OFFSET 1"
        n = len(env.gold_answer(task_id).rows)
        extra_row = f"SELECT * FROM ({gold}) UNION ALL SELECT * FROM ({gold}) LIMIT {n + 1}"
        for wrong in (missing_row, extra_row, "SELECT 'nothing like it'"):
            (fb,) = play(env, task_id, f"<submit>{wrong}</submit>")
            assert (fb.reward, fb.done, fb.success) == (0.0, True, False), (task_id, wrong)
            assert "does not match" in fb.observation
    # The traps: a NULL birth year sorts first; a book without a genre forms its own group.
    trap = {
        4: "SELECT name FROM authors ORDER BY birth_year LIMIT 1",
        5: "SELECT genre, COUNT(*) FROM books GROUP BY genre",
        8: "SELECT title FROM books ORDER BY price ASC LIMIT 3",
    }
    for task_id, wrong in trap.items():
        assert play(env, task_id, f"<submit>{wrong}</submit>")[0].reward == 0.0, task_id
    # A submitted query that fails is wrong, and says why.
    (fb,) = play(env, 0, "<submit>SELECT COUNT(*) FROM nowhere</submit>")
    assert (fb.reward, fb.done) == (0.0, True) and "no such table: nowhere" in fb.observation


def test_row_order_columns_and_value_rules(env):
    def reward(task_id, query):
        return play(env, task_id, f"<submit>{query}</submit>")[0].reward

    # Unordered gold (task 2): any order; ordered gold (task 12): only the gold's order.
    assert reward(2, "SELECT name FROM authors WHERE country = 'Canada' ORDER BY name DESC") == 1
    assert (
        reward(12, demo.QUESTIONS[12][1].replace("ORDER BY total DESC", "ORDER BY total ASC")) == 0
    )
    assert (
        reward(12, demo.QUESTIONS[12][1].replace("ORDER BY total DESC", "ORDER BY 2 DESC, 1")) == 1
    )
    # INTEGER equals an integral REAL; TEXT never equals a number; rounding absorbs float noise.
    assert reward(0, "SELECT COUNT(*) * 1.0 FROM books") == 1
    assert reward(0, "SELECT 16.0") == 1
    assert reward(0, "SELECT '16'") == 0
    assert reward(7, "SELECT SUM(price) / COUNT(*) FROM books WHERE genre = 'fantasy'") == 1
    assert reward(7, "SELECT 14.58") == 0
    # Column names do not matter, column order does.
    assert (
        reward(5, "SELECT genre AS g, COUNT(*) AS n FROM books WHERE genre IS NOT NULL GROUP BY g")
        == 1
    )
    assert (
        reward(5, "SELECT COUNT(*), genre FROM books WHERE genre IS NOT NULL GROUP BY genre") == 0
    )


def test_verifier_rules_on_hand_made_results():
    assert results_match([(1, "a"), (2, "b")], [(2, "b"), (1, "a")], ordered=False)
    assert not results_match([(1, "a"), (2, "b")], [(2, "b"), (1, "a")], ordered=True)
    assert not results_match([(1,), (1,), (2,)], [(1,), (2,), (2,)], ordered=False)  # multisets
    assert not results_match([(1,)], [(1,), (1,)], ordered=False)
    assert results_match([(0.1 + 0.2,)], [(0.3,)], ordered=True)
    assert results_match([(None, b"\x00")], [(None, b"\x00")], ordered=True)
    assert not results_match([(1,)], [("1",)], ordered=True)
    assert not results_match([(1, 2)], [(1,)], ordered=True)
    assert normalise_value(3.0) == 3 and type(normalise_value(3.0)) is int
    assert (
        normalise_value(2.5) == 2.5
        and normalise_value("x") == "x"
        and normalise_value(None) is None
    )
    assert is_ordered("SELECT a FROM t ORDER BY a")
    assert is_ordered("select a from t union select b from u order\n by 1")
    assert not is_ordered("SELECT a FROM t WHERE a = (SELECT a FROM t ORDER BY a LIMIT 1)")
    assert not is_ordered("SELECT ROW_NUMBER() OVER (ORDER BY a) FROM t")
    assert not is_ordered("SELECT 'order by' FROM t -- order by a")
    assert not is_ordered('SELECT "order by" FROM t /* ORDER BY a */')
    assert not is_ordered("SELECT border_by FROM t")


# ---------------------------------------------------------------- the grammar


@pytest.mark.parametrize(
    "response, action",
    [
        ("<sql>SELECT 1</sql>", Execute("SELECT 1")),
        ("< SQL >\n  SELECT 1;;\n</ sql >", Execute("SELECT 1")),
        ("<sql>SELECT 1", Execute("SELECT 1")),  # unclosed: to the end
        ("<sql>\n```sql\nSELECT 1;\n```\n</sql>", Execute("SELECT 1")),
        ("Let me look.\n```sql\nSELECT name\nFROM t\n```", Execute("SELECT name\nFROM t")),
        ("```python\nx = 1\n```\n```SQL\nSELECT 2\n```", Execute("SELECT 2")),
        (
            "<think>maybe <submit>SELECT 0</submit>?</think><submit>SELECT 1</submit>",
            Submit("SELECT 1"),
        ),
        ("<submit>  </submit>", Submit(None)),
        ("<SUBMIT></SUBMIT>", Submit(None)),
    ],
)
def test_grammar_accepts(response, action):
    assert parse_response(response) == action


@pytest.mark.parametrize(
    "response, reason",
    [
        ("SELECT 1", "no action found"),
        ("", "no action found"),
        ("<think><sql>SELECT 1</sql>", "no action found"),  # an unfinished thought hides it
        ("<sql></sql>", "holds no query"),
        ("```sql\n```", "holds no query"),
        ("<sql>SELECT 1</sql><submit>SELECT 1</submit>", "found 2 actions"),
        ("```sql\nSELECT 1\n```\n```sql\nSELECT 2\n```", "found 2 ```sql blocks"),
    ],
)
def test_grammar_rejects(response, reason):
    action = parse_response(response)
    assert isinstance(action, Invalid) and reason in action.reason


def test_malformed_responses_are_invalid_actions_and_play_goes_on(env):
    feedbacks = play(
        env,
        0,
        "16",
        "<sql></sql>",
        "<sql>SELECT 1</sql><sql>SELECT 2</sql>",
        "<submit></submit>",
        "<submit>SELECT COUNT(*) FROM books</submit>",
    )
    for fb in feedbacks[:4]:
        assert (fb.action_valid, fb.done, fb.reward) == (False, False, 0.0)
        assert fb.observation.startswith("Invalid action:") and "<sql>" in fb.observation
    assert "<sql>...</sql>" in feedbacks[0].observation
    assert "none has" in feedbacks[3].observation  # empty submit before any query ran
    assert feedbacks[4].reward == 1.0


def test_empty_submit_submits_the_last_query_that_ran(env):
    gold = demo.QUESTIONS[2][1]
    fbs = play(
        env, 2, f"<sql>{gold}</sql>", "<sql>SELECT nonsense FROM authors</sql>", "<submit></submit>"
    )
    assert "2 rows:" in fbs[0].observation and "Hollis Grant" in fbs[0].observation
    assert fbs[1].observation.startswith("Error: no such column: nonsense") and fbs[1].action_valid
    assert (fbs[2].reward, fbs[2].done) == (1.0, True)


@settings(max_examples=60, deadline=None)
@given(
    st.one_of(
        st.text(max_size=60),
        st.builds(
            lambda tag, body: f"<{tag}>{body}",
            st.sampled_from(["sql", "submit"]),
            st.text(max_size=40),
        ),
    )
)
def test_any_text_is_handled_without_raising(env, response):
    state, _ = env.reset_task(1, seed=0)
    state, fb = env.step_task(state, response)
    action = parse_response(response)
    # An empty <submit> is valid only once a query has run, and none has on a fresh row.
    assert fb.action_valid == (not isinstance(action, Invalid) and action != Submit(None))
    assert isinstance(fb.observation, str) and fb.observation


def test_text_sqlite_cannot_take_is_an_error_observation(env):
    for query in ("SELECT 'a\x00b'", "SELECT '\ud800'", "SELECT ?", "-- only a comment"):
        (fb,) = play(env, 0, f"<sql>{query}</sql>")
        assert fb.action_valid and fb.observation.startswith("Error:") and not fb.done, query


# ---------------------------------------------------------------- observations


def test_result_rows_are_truncated_and_say_so(tasks):
    small = SqlEnv(tasks, SqlConfig(display_rows=3, max_rows=10, max_cell_chars=12))
    fb = play(small, 0, "<sql>SELECT title, price, genre FROM books ORDER BY book_id</sql>")[0]
    lines = fb.observation.splitlines()
    assert lines[0] == "more than 10 rows (truncated: showing the first 3):"
    assert lines[1:] == [
        "title | price | genre",
        "The Salt Roa... | 12.5 | fantasy",
        "Harbor of Gl... | 14.0 | fantasy",
        "Cold Ledger | 9.99 | crime",
    ]
    fb = play(small, 0, "<sql>SELECT name FROM authors WHERE author_id <= 5</sql>")[0]
    assert fb.observation.splitlines()[0] == "5 rows (truncated: showing the first 3):"
    fb = play(small, 0, "<sql>SELECT NULL AS a, x'00ff' AS b, 0.1 + 0.2 AS c</sql>")[0]
    assert fb.observation == "1 row:\na | b | c\nNULL | <blob of 2 bytes> | 0.3"
    fb = play(small, 0, "<sql>SELECT * FROM books WHERE price > 100</sql>")[0]
    assert fb.observation.startswith("The query returned no rows. Columns: book_id | title")
    # A submitted result longer than max_rows cannot match (gold results must fit).
    assert play(small, 0, "<submit>SELECT book_id FROM books</submit>")[0].reward == 0.0


def test_first_observation_shows_schema_and_question(env):
    _, obs = env.reset_task(3, seed=0)
    assert obs.startswith("Database 'bookshop' has this schema:")
    assert "CREATE TABLE order_items" in obs and obs.endswith("Question: " + demo.QUESTIONS[3][0])
    assert "intercode" in env.name and env.t_max == 10
    text = env.instructions()
    assert "<sql>QUERY</sql>" in text and "<submit>QUERY</submit>" in text
    assert "turn" not in text.replace("Each turn", "")  # the budget belongs to the rollout


def test_state_key_is_task_and_last_observation(env):
    a, _ = env.reset_task(0, seed=0)
    b, _ = env.reset_task(0, seed=5)
    c, _ = env.reset_task(1, seed=0)
    assert env.state_key(a) == env.state_key(b) != env.state_key(c)
    a, _ = env.step_task(a, "<sql>SELECT 1</sql>")
    b, _ = env.step_task(b, '<sql>SELECT 1 AS "1"</sql>')  # another query, the same result
    assert env.state_key(a) == env.state_key(b) == text_key(0, "1 row:\n1\n1")
    b, _ = env.step_task(b, "<sql>SELECT 2</sql>")
    assert env.state_key(a) != env.state_key(b)


# ---------------------------------------------------------------- limits and guards


def test_hanging_query_times_out_and_the_env_stays_usable(env):
    fbs = play(env, 0, f"<sql>{HANG}</sql>", "<submit>SELECT COUNT(*) FROM books</submit>")
    assert fbs[0].observation == "Error: the query ran longer than the 0.3 s limit and was stopped"
    assert (fbs[0].done, fbs[0].action_valid) == (False, True)
    assert fbs[1].reward == 1.0
    (fb,) = play(env, 0, f"<submit>{HANG}</submit>")
    assert (fb.reward, fb.done) == (0.0, True) and "0.3 s limit" in fb.observation
    # A query that builds one huge value fails fast instead of exhausting memory.
    result = run_query(env.tasks[0].db_path, "SELECT zeroblob(100000000)", QueryLimits(timeout_s=5))
    assert not result.ok and "too big" in result.error


WRITES = [
    "INSERT INTO books VALUES (99, 'x', 1, 'y', 2000, 1.0)",
    "REPLACE INTO customers VALUES (1, 'x', 'y')",
    "UPDATE books SET price = 0",
    "DELETE FROM orders",
    "DELETE FROM orders RETURNING *",
    "WITH x AS (SELECT 1) INSERT INTO customers SELECT 50, 'a', 'b' FROM x",
    "DROP TABLE books",
    "DROP TABLE IF EXISTS nothing_here",
    "CREATE TABLE t (x)",
    "CREATE TEMP TABLE t (x)",
    "CREATE INDEX i ON books (price)",
    "CREATE VIEW v AS SELECT 1",
    "CREATE TRIGGER g AFTER INSERT ON books BEGIN DELETE FROM orders; END",
    "ALTER TABLE books RENAME TO volumes",
    "ATTACH DATABASE '{dir}/attached.sqlite' AS other",
    "VACUUM",
    "VACUUM INTO '{dir}/copy.sqlite'",
    "PRAGMA user_version = 7",
    "PRAGMA journal_mode = WAL",
    "PRAGMA query_only = OFF",
    "BEGIN IMMEDIATE",
    "ANALYZE",
    "REINDEX",
    "SELECT 1; DROP TABLE books",
    "SELECT 1; SELECT 2",
]


def test_statements_that_would_write_fail_and_the_file_is_unchanged(tmp_path):
    db = demo.build_database(
        tmp_path / "shop.sqlite"
    )  # a writable file: only the guards protect it
    before, listing = file_digest(db), sorted(p.name for p in tmp_path.iterdir())
    env = SqlEnv([SqlTask("shop", db, "How many books?", "SELECT COUNT(*) FROM books")], FAST)
    for statement in WRITES:
        statement = statement.format(dir=tmp_path)
        ran = play(env, 0, f"<sql>{statement}</sql>")
        submitted = play(env, 0, f"<submit>{statement}</submit>")
        assert ran[0].observation.startswith("Error:") and ran[0].action_valid, statement
        assert (submitted[0].reward, submitted[0].done) == (0.0, True), statement
    assert play(env, 0, "<sql>DELETE FROM orders</sql>")[0].observation.startswith(
        "Error: not allowed: the database is read-only"
    )
    assert (
        "one statement at a time"
        in play(env, 0, "<sql>SELECT 1; DROP TABLE books</sql>")[0].observation
    )
    assert (
        "not a query" in play(env, 0, "<sql>DROP TABLE IF EXISTS nothing_here</sql>")[0].observation
    )
    assert file_digest(db) == before
    assert (
        sorted(p.name for p in tmp_path.iterdir()) == listing
    )  # no journal, attached or copied file
    with sqlite3.connect(db) as conn:  # and the data is all there
        for table, rows in demo.TABLES.items():
            assert conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0] == len(rows)
    assert play(env, 0, "<submit>SELECT COUNT(*) FROM books</submit>")[0].reward == 1.0


# Functions a SQLite build may register that no question needs: native pointers
# (fts3_tokenizer), native code (load_extension), the build's internals, JSON.
UNLISTED_FUNCTIONS = [
    "SELECT fts3_tokenizer('simple')",
    "SELECT load_extension('/tmp/evil.so')",
    "SELECT sqlite_compileoption_get(0)",
    "SELECT sqlite_source_id()",
    "SELECT json_extract('{\"a\": 1}', '$.a')",
    "SELECT title FROM books WHERE Upper(title) = 'X' OR FTS3_TOKENIZER('simple') IS NULL",
    "SELECT (SELECT sqlite_version())",
    "WITH x AS (SELECT load_extension('e')) SELECT * FROM x",
]


@pytest.mark.parametrize("query", UNLISTED_FUNCTIONS)
def test_functions_outside_the_allow_list_are_refused_by_name(tmp_path, query):
    db = demo.build_database(tmp_path / "shop.sqlite")
    result = run_query(db, query, QueryLimits(timeout_s=5))
    assert not result.ok and result.error.startswith("not allowed: "), result
    assert "is not a function queries may call here" in result.error
    refused = result.error[len("not allowed: ") :].split("()")[0]
    assert refused.lower() in query.lower()


def test_the_core_functions_run_and_every_bundled_gold_query_is_allowed(tmp_path):
    db = demo.build_database(tmp_path / "shop.sqlite")
    query = (
        "SELECT count(*), max(price), min(year), avg(price), sum(year), total(price), "
        "group_concat(title), upper(title), lower(title), length(title), substr(title, 1, 2), "
        "round(price, 1), abs(-year), coalesce(NULL, 1), ifnull(NULL, 2), nullif(1, 2), "
        "instr(title, 'a'), replace(title, 'a', 'b'), trim(title), typeof(year), "
        "strftime('%Y', '2020-01-02'), date('2020-01-02', '+1 day'), julianday('2020-01-02'), "
        "row_number() OVER (ORDER BY year), title LIKE 'A%', title GLOB 'A*', "
        "CAST(year AS TEXT), year BETWEEN 1 AND 3000 FROM books GROUP BY genre"
    )
    assert run_query(db, query, QueryLimits(timeout_s=5)).ok
    for _question, gold in demo.QUESTIONS:
        assert run_query(db, gold, QueryLimits(timeout_s=5)).ok, gold


# ---------------------------------------------------------------- the rollout wrapper


def test_a_batch_through_python_text_env_goes_on_past_a_hanging_query(tasks):
    env = PythonTextEnv(SqlEnv(tasks, FAST), workers=4, step_timeout_s=20)
    ids = np.array([0, 8, 12, 16, 8])
    rows, obs = env.reset(ids, seed=0)
    assert all(o.endswith(demo.QUESTIONS[i][0]) for o, i in zip(obs, ids))
    gold = {i: demo.QUESTIONS[i][1] for i in ids.tolist()}
    first = [
        f"<submit>{gold[0]}</submit>",
        f"<sql>{HANG}</sql>",
        "I would count the orders.",
        "<sql>DROP TABLE authors</sql>",
        f"<sql>{HANG}</sql>",
    ]
    rows, r = env.step(rows, first, np.ones(5, bool))
    np.testing.assert_array_equal(r.reward, [1, 0, 0, 0, 0])
    np.testing.assert_array_equal(r.done, [True, False, False, False, False])
    np.testing.assert_array_equal(r.action_valid, [True, True, False, True, True])
    np.testing.assert_array_equal(
        r.info["timeout"], np.zeros(5, bool)
    )  # the env's limit, not the wrapper's
    assert "0.3 s limit" in r.observations[1] and r.observations[1] == r.observations[4]
    assert r.anchor_key[1] == r.anchor_key[4] != r.anchor_key[0]  # same task, same state
    second = ["<sql>SELECT 1</sql>"] + [f"<submit>{gold[i]}</submit>" for i in ids[1:].tolist()]
    rows, r = env.step(rows, second, np.ones(5, bool))
    np.testing.assert_array_equal(r.reward, [0, 1, 1, 1, 1])
    np.testing.assert_array_equal(r.done, np.ones(5, bool))
    np.testing.assert_array_equal(r.success, np.ones(5, bool))
    assert r.observations[0] == ""  # the finished row was left alone
    env.close()


def test_the_wrappers_step_timeout_is_the_last_line_of_defence(tasks):
    # A query limit longer than the wrapper's step limit: the wrapper ends that row, the rest go
    # on, and the abandoned query still ends at its own deadline.
    env = PythonTextEnv(
        SqlEnv(tasks, SqlConfig(query_timeout_s=1.0)), workers=2, step_timeout_s=0.2
    )
    rows, _ = env.reset(np.array([0, 0]), seed=0)
    rows, r = env.step(rows, [f"<sql>{HANG}</sql>", "<submit>SELECT 16</submit>"], np.ones(2, bool))
    np.testing.assert_array_equal(r.info["timeout"], [True, False])
    np.testing.assert_array_equal(r.done, [True, True])
    np.testing.assert_array_equal(r.reward, [0, 1])
    env.close()


# ---------------------------------------------------------------- Spider-format data


def make_spider(root, *, split_file="dev.json", databases="database"):
    """A tiny Spider-format folder: two databases and three questions."""
    defs = {
        "concert_singer": (
            "CREATE TABLE singer (singer_id INTEGER PRIMARY KEY, name TEXT, age INTEGER);"
            "INSERT INTO singer VALUES (1, 'Joe', 52), (2, 'Ann', 29), (3, 'Lee', 41);"
        ),
        "pets_1": (
            "CREATE TABLE pets (pet_id INTEGER PRIMARY KEY, kind TEXT, weight REAL);"
            "INSERT INTO pets VALUES (1, 'dog', 12.5), (2, 'cat', 3.0), (3, 'dog', 9.5);"
        ),
    }
    for db_id, script in defs.items():
        folder = root / databases / db_id
        folder.mkdir(parents=True)
        with sqlite3.connect(folder / f"{db_id}.sqlite") as conn:
            conn.executescript(script)
    entries = [
        {
            "db_id": "concert_singer",
            "question": "How many singers do we have?",
            "query": "SELECT count(*) FROM singer",
            "query_toks": ["..."],
        },
        {
            "db_id": "concert_singer",
            "question": "List singer names from oldest to youngest.",
            "query": "SELECT name FROM singer ORDER BY age DESC",
        },
        {
            "db_id": "pets_1",
            "question": "What is the average weight of dogs?",
            "query": 'SELECT avg(weight) FROM pets WHERE kind = "dog"',
        },
    ]
    (root / split_file).write_text(json.dumps(entries))
    return entries


def test_a_spider_format_directory_loads_and_plays(tmp_path):
    entries = make_spider(tmp_path)
    tasks = load_spider(tmp_path, "dev")
    assert [(t.db_id, t.question, t.gold_query) for t in tasks] == [
        (e["db_id"], e["question"], e["query"]) for e in entries
    ]
    assert tasks[2].db_path == tmp_path / "database" / "pets_1" / "pets_1.sqlite"
    env = SqlEnv(tasks, FAST)
    state, obs = env.reset_task(2, seed=0)
    assert "CREATE TABLE pets" in obs and obs.endswith("What is the average weight of dogs?")
    state, fb = env.step_task(state, "<sql>SELECT kind, weight FROM pets</sql>")
    assert fb.observation == "3 rows:\nkind | weight\ndog | 12.5\ncat | 3.0\ndog | 9.5"
    state, fb = env.step_task(state, "<submit>SELECT (12.5 + 9.5) / 2</submit>")
    assert fb.reward == 1.0
    assert play(env, 1, "<submit>SELECT name FROM singer ORDER BY age</submit>")[0].reward == 0.0
    assert (
        play(env, 1, "<submit>SELECT name FROM singer ORDER BY age DESC</submit>")[0].reward == 1.0
    )
    assert (
        play(env, 0, "<submit>SELECT count(*) FROM singer WHERE age > 30</submit>")[0].reward == 0.0
    )
    assert len(load_spider(tmp_path, "dev", limit=2)) == 2
    text_env = make_env(tmp_path, "dev", limit=2, config=FAST)
    assert (text_env.name, text_env.t_max, text_env.num_tasks()) == ("intercode-sql", 10, 2)
    text_env.close()


def test_spider_test_split_uses_its_own_database_folder(tmp_path):
    make_spider(tmp_path, split_file="test.json", databases="test_database")
    tasks = load_spider(tmp_path, "test")
    assert (
        tasks[0].db_path == tmp_path / "test_database" / "concert_singer" / "concert_singer.sqlite"
    )


def test_spider_errors_name_what_is_missing_or_bad(tmp_path):
    with pytest.raises(FileNotFoundError, match="Spider folder not found"):
        load_spider(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="train_spider.json"):
        load_spider(tmp_path, "train")
    with pytest.raises(ValueError, match="split must be one of"):
        load_spider(tmp_path, "validation")
    entries = make_spider(tmp_path)
    (tmp_path / "train_spider.json").write_text("[{")
    with pytest.raises(ValueError, match="train_spider.json is not valid JSON"):
        load_spider(tmp_path, "train")
    bad = [dict(entries[0]), {k: v for k, v in entries[1].items() if k != "query"}]
    (tmp_path / "train_spider.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"entry 1: field 'query' must be a non-empty string"):
        load_spider(tmp_path, "train")
    missing = [dict(entries[0], db_id="flights")]
    (tmp_path / "train_spider.json").write_text(json.dumps(missing))
    with pytest.raises(
        FileNotFoundError, match=r"entry 0: database 'flights' not found at .*flights\.sqli"
    ):
        load_spider(tmp_path, "train")


# ---------------------------------------------------------------- configuration and bad data


def test_bad_configuration_and_data_are_named(tmp_path, tasks):
    with pytest.raises(ValueError, match="query_timeout_s"):
        SqlConfig(query_timeout_s=0)
    with pytest.raises(ValueError, match="display_rows"):
        SqlConfig(display_rows=0)
    with pytest.raises(ValueError, match="SqlTask.question"):
        SqlTask("db", tmp_path / "x.sqlite", " ", "SELECT 1")
    with pytest.raises(ValueError, match="tasks is empty"):
        SqlEnv([])
    with pytest.raises(FileNotFoundError, match=r"task 0 \('db'\).*x\.sqlite"):
        SqlEnv([SqlTask("db", tmp_path / "x.sqlite", "q?", "SELECT 1")])
    broken = SqlEnv([SqlTask("bookshop", tasks[0].db_path, "q?", "SELECT nope FROM books")])
    with pytest.raises(
        ValueError, match=r"gold query of task 0 \('bookshop'\) fails: no such column: nope"
    ):
        broken.reset_task(0, seed=0)
    with pytest.raises(
        ValueError, match=r"task 12 \('bookshop'\) fails: returns more than max_rows=5"
    ):
        SqlEnv(tasks, SqlConfig(max_rows=5)).reset_task(12, seed=0)  # its gold has 6 rows
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"not a database" * 100)
    with pytest.raises(ValueError, match=r"task 0 \('junk'\) fails: file is not a database"):
        SqlEnv([SqlTask("junk", junk, "q?", "SELECT * FROM t")]).reset_task(0, seed=0)
