"""The response parsers take time linear in the response's length, and parse as they did.

Each parser (SQL actions, BFCL calls, DeepCoder program fences, FrozenLake actions) gets
adversarial inputs of 1e4, 1e5 and 1e6 characters: a fence followed by a sea of whitespace,
unclosed fences, thousands of ``<think`` fragments, deep nesting, runs of quotes. No wall-clock
bound is asserted; the minimum of a few runs at 1 MB must be under 30 times that at 100 KB
(linear is 10, quadratic 100). Every call runs under a SIGALRM guard (the regex engine checks
signals), so a regression fails the test instead of hanging the suite.

The second half pins the behaviour of the scanners that replaced backtracking regexes: each is
compared, on generated short texts, with the regex it replaced (kept here as the reference).
"""

import re
import signal
import textwrap
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs.bfcl import calls
from envs.code.env import EMPTY, NO_PROGRAM, UNCLOSED, parse_program
from envs.frozenlake.text import parse_action
from envs.sql import grammar

SIZES = (10_000, 100_000, 1_000_000)
MAX_RATIO = 40.0  # CPU time(1 MB) / CPU time(100 KB): linear is 10, quadratic 100 (on a busy
#                   machine linear cases reached 35-51 in wall time: preemption, caches)
GUARD_S = 10.0  # a call at 1 MB takes milliseconds; this long means it would hang


class ParserHung(Exception):
    pass


def guarded(parse, text):
    """``parse(text)``, failing with ParserHung after GUARD_S seconds."""

    def on_alarm(signum, frame):
        raise ParserHung(f"a parser ran past {GUARD_S:g} s on {len(text):,} characters")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, GUARD_S)
    try:
        return parse(text)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def best_time(parse, text, repeats):
    """The least CPU time of this thread over ``repeats`` parses: time the process spends
    preempted by others (a busy machine) does not count, the parser's own work does."""
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        guarded(parse, text)
        best = min(best, time.thread_time() - start)
    return best


def sized(unit, n, head="", tail=""):
    """``head``, ``unit`` repeated to about ``n`` characters, ``tail``."""
    return head + unit * max(1, n // len(unit)) + tail


sql = grammar.parse_response
bfcl = calls.parse_response
CASES = {
    # the SQL action grammar
    "sql: fence then spaces": (sql, lambda n: sized(" ", n, "```")),
    "sql: fence in a tag then spaces": (sql, lambda n: sized(" ", n, "<sql>```", "x")),
    "sql: fence, spaces, a fence not at the end": (
        sql,
        lambda n: sized(" ", n, "<sql>```\n", "```x"),
    ),
    "sql: fence, tabs and newlines": (sql, lambda n: sized("\t\n", n, "<sql>```sql\n", "```;")),
    "sql: many unclosed fences": (sql, lambda n: sized("```sql ", n)),
    "sql: many semicolons": (sql, lambda n: sized("; ", n, "<sql>SELECT 1", "</sql>")),
    "sql: many <think fragments": (sql, lambda n: sized("<think", n)),
    "sql: many spaced <think fragments": (sql, lambda n: sized("< think ", n, "", "</think>")),
    "sql: many action tags": (sql, lambda n: sized("<sql>", n)),
    "sql: many quotes": (sql, lambda n: sized("'", n, "<sql>SELECT ")),
    # the BFCL call parser
    "bfcl: fence then spaces": (bfcl, lambda n: sized(" ", n, "```", "x")),
    "bfcl: fence then spaces then a fence": (bfcl, lambda n: sized(" ", n, "```\n", "x```")),
    "bfcl: fence, tabs and newlines": (bfcl, lambda n: sized(" \t\n", n, "```python\t", "```")),
    "bfcl: nested brackets": (bfcl, lambda n: sized("[", n)),
    "bfcl: nested parentheses": (bfcl, lambda n: sized("(", n, "f(")),
    "bfcl: nested brackets in an argument": (bfcl, lambda n: sized("[", n, "[f(a=", ")]")),
    "bfcl: many quotes": (bfcl, lambda n: sized("'", n, "[f(a='", ")]")),
    "bfcl: many escaped quotes": (bfcl, lambda n: sized('\\"', n, 'f(a="', '")')),
    "bfcl: unclosed triple quotes": (bfcl, lambda n: sized("''", n, "f(a='''")),
    "bfcl: many minus signs": (bfcl, lambda n: sized("-", n, "f(a=", "1)")),
    "bfcl: many <think> tags": (bfcl, lambda n: sized("<think>", n)),
    "bfcl: a long name": (bfcl, lambda n: sized("a", n, "", "(")),
    # the DeepCoder program fences
    "code: fence then spaces": (parse_program, lambda n: sized(" ", n, "```python", "x")),
    "code: unclosed fence, blank lines": (
        parse_program,
        lambda n: sized(" \t\n", n, "```python\n"),
    ),
    "code: many opening fences": (parse_program, lambda n: sized("```python\n", n)),
    "code: many backticks": (parse_program, lambda n: sized("`", n)),
    "code: spaces before a fence": (
        parse_program,
        lambda n: sized(" ", n, "", "```python\nx\n```"),
    ),
    "code: a blank line of spaces": (
        parse_program,
        lambda n: sized(" ", n, "```python\n", "\n```"),
    ),
    "code: many <think fragments": (parse_program, lambda n: sized("<think", n)),
    # the FrozenLake action parser
    "frozenlake: answer then spaces": (parse_action, lambda n: sized(" ", n, "<answer>")),
    "frozenlake: many <answer fragments": (parse_action, lambda n: sized("< answer", n)),
    "frozenlake: many <think fragments": (parse_action, lambda n: sized("<think", n)),
    "frozenlake: words glued to letters": (parse_action, lambda n: sized("leftx", n)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_parse_time_grows_linearly(name):
    parse, make = CASES[name]
    texts = {n: make(n) for n in SIZES}
    times = {n: best_time(parse, texts[n], repeats=3 if n == SIZES[-1] else 4) for n in SIZES}
    ratio = times[SIZES[-1]] / max(times[SIZES[1]], 1e-7)
    assert ratio < MAX_RATIO, (
        f"{name}: {times[SIZES[1]] * 1e3:.2f} ms at 100 KB, "
        f"{times[SIZES[-1]] * 1e3:.2f} ms at 1 MB (x{ratio:.0f})"
    )


# ---------------------------------------------------------------- the same behaviour as before

# The regexes the scanners replaced, kept as references (they backtrack: short texts only).
OLD_SQL_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)(.*?)(?:```|\Z)", re.DOTALL)
OLD_SQL_WHOLE_FENCE = re.compile(
    r"\A\s*```[ \t]*[A-Za-z0-9_+-]*[^\n]*\n(.*?)\n?\s*```\s*\Z", re.DOTALL
)
OLD_BFCL_WHOLE_FENCE = re.compile(
    r"\A```[ \t]*[A-Za-z0-9_+-]*[ \t]*\n?(.*?)\n?[ \t]*```\Z", re.DOTALL
)
OLD_THINK_OPEN = re.compile(r"<\s{0,4}think\s{0,4}>", re.IGNORECASE)
OLD_THINK_CLOSE = re.compile(r"<\s{0,4}/\s{0,4}think\s{0,4}>", re.IGNORECASE)
OLD_CODE_OPEN = re.compile(r"^[ \t]*```[ \t]*(?:python3?|py)[ \t]*$", re.IGNORECASE | re.MULTILINE)
OLD_CODE_CLOSE = re.compile(r"^[ \t]*```[ \t]*$", re.MULTILINE)


def old_clean_query(query):
    fenced = OLD_SQL_WHOLE_FENCE.match(query)
    if fenced:
        query = fenced.group(1)
    query = query.strip()
    while query.endswith(";"):
        query = query[:-1].rstrip()
    return query


def old_parse_program(response):
    response = response.replace("\r\n", "\n")
    closes = list(OLD_THINK_CLOSE.finditer(response))
    text = response[closes[-1].end() :] if closes else response
    still_thinking = OLD_THINK_OPEN.search(text)
    if still_thinking:
        text = text[: still_thinking.start()]
    program, position = None, 0
    while (opening := OLD_CODE_OPEN.search(text, position)) is not None:
        closing = OLD_CODE_CLOSE.search(text, opening.end())
        if closing is None:
            return None, UNCLOSED
        program = text[opening.end() + 1 : closing.start()]
        position = closing.end()
    if program is None:
        return None, NO_PROGRAM
    program = textwrap.dedent(program)
    if not program.strip():
        return None, EMPTY
    return program, ""


def texts_of(*pieces, max_pieces=16):
    """Short texts built from ``pieces``: the places where fences and whitespace interact."""
    return st.lists(st.sampled_from(pieces), max_size=max_pieces).map("".join)


SQL_PIECES = (
    "```",
    "`",
    " ",
    "\t",
    "\n",
    "\u00a0",
    "sql",
    "SQL",
    "py",
    "-",
    "x",
    ";",
    " ;",
    "<sql>",
    "</sql>",
    "<submit>",
    "<think>",
    "</think>",
)
BFCL_PIECES = (
    "```",
    "`",
    " ",
    "\t",
    "\n",
    "\u00a0",
    "py",
    "f(",
    ")",
    "[",
    "]",
    "a=1",
    "'",
    ",",
    "<think>",
    "</think>",
)
CODE_PIECES = (
    "```",
    "`",
    " ",
    "\t",
    "\n",
    "\r\n",
    "\r",
    "python",
    "PYTHON",
    "py",
    "Py3",
    "3",
    "x",
    "  print(1)",
    "<think>",
    "</think>",
    "\u00a0",
)


@settings(max_examples=100, deadline=None)
@given(texts_of(*SQL_PIECES))
def test_sql_fence_scanners_match_the_regexes_they_replaced(text):
    assert grammar.clean_query(text) == old_clean_query(text)
    old_blocks = [(m.group(1), m.group(2)) for m in OLD_SQL_FENCE.finditer(text)]
    assert list(grammar.fenced_blocks(text)) == old_blocks


@settings(max_examples=100, deadline=None)
@given(texts_of(*BFCL_PIECES))
def test_bfcl_fence_scanner_matches_the_regex_it_replaced(text):
    text = text.strip()
    fenced = OLD_BFCL_WHOLE_FENCE.match(text)
    assert calls._unfence(text) == (fenced.group(1) if fenced else None)


@settings(max_examples=100, deadline=None)
@given(texts_of(*CODE_PIECES))
def test_code_fence_scanner_matches_the_regexes_it_replaced(text):
    assert parse_program(text) == old_parse_program(text)


def test_known_fence_edge_cases_parse_as_before():
    for text in [
        "```",
        "``````",
        "```sql```",
        "```sql\n```",
        "  ```sql x\nSELECT 1 ;; \n ```  \n",
        "```\nSELECT 1\n```x",
        "```;\n;```",
        "\u00a0```\nSELECT 2\u00a0\n```\u2003",
    ]:
        assert grammar.clean_query(text) == old_clean_query(text), text
    for text in [
        "``````",
        "```py```",
        "```python3.9```",
        "```\n\n```",
        "```py \t\n x \n\t```",
        "````````",
        "```\t\t```",
    ]:
        fenced = OLD_BFCL_WHOLE_FENCE.match(text)
        assert calls._unfence(text) == (fenced.group(1) if fenced else None), text
    for text in [
        "```python\nx\n```",
        "  ```Python3 \nx\n```\t",
        "```python\r\nx\r\n```",
        "```python\rx\n```",
        "````python\nx\n```",
        "```py\n```",
        "x```python\ny\n```",
        "```python\na\n```\n```python\nb",
    ]:
        assert parse_program(text) == old_parse_program(text), text
