"""The response grammar of the SQL environment: a model's text parsed into one action.

Grammar
-------
:func:`parse_response` maps any string to :class:`Execute`, :class:`Submit` or :class:`Invalid`:

1. Thinking is ignored: everything up to the last ``</think>`` is dropped; if a ``<think>`` is
   still open after that (an unfinished thought), everything from it on is dropped too.
2. Action tags are ``<sql>...</sql>`` (run the query and see its result) and
   ``<submit>...</submit>`` (submit the query as the final answer). Tags are case-insensitive
   and may hold spaces (``< SQL >``). The text must hold exactly one opening action tag; its
   query runs to the matching closing tag, or to the end of the text if it is not closed.
3. Without any tag, a single fenced code block labelled sql (```` ```sql ... ``` ````) is run
   as if it were in ``<sql>`` tags; two or more such blocks are ambiguous and invalid.
4. The query is trimmed: a code fence wrapped around it inside a tag is removed, then
   surrounding whitespace and trailing semicolons.
5. An empty ``<sql></sql>`` is invalid. An empty ``<submit></submit>`` submits the last query
   that ran without error (:class:`Submit` with ``query=None``; the environment decides).

So ``<sql>SELECT 1</sql>``, ``<think>hmm</think><submit>SELECT 1;</submit>`` and
```` ```sql\\nSELECT 1\\n``` ```` are accepted; ``SELECT 1`` (no tag or fence), an unfinished
``<think><sql>SELECT 1</sql>``, and ``<sql>SELECT 1</sql><submit>SELECT 1</submit>`` are invalid.
The parser never raises on any ``str`` and takes time linear in its length (fences are found by
scanners, not backtracking regexes); whether the query itself is valid SQL is for the database
to say.
"""

from __future__ import annotations

import dataclasses
import re

_THINK_OPEN = re.compile(r"<\s{0,4}think\s{0,4}>", re.IGNORECASE | re.ASCII)
_THINK_CLOSE = re.compile(r"<\s{0,4}/\s{0,4}think\s{0,4}>", re.IGNORECASE | re.ASCII)
_TAG_OPEN = re.compile(r"<\s{0,4}(sql|submit)\s{0,4}>", re.IGNORECASE | re.ASCII)
_TAG_CLOSE = {
    name: re.compile(rf"<\s{{0,4}}/\s{{0,4}}{name}\s{{0,4}}>", re.IGNORECASE | re.ASCII)
    for name in ("sql", "submit")
}
# Fences are found by hand-written scanners (str.find and these single runs, which cannot
# backtrack), so parsing takes time linear in the text's length whatever it holds.
_SPACES = re.compile(r"[ \t]*")
_LABEL = re.compile(r"[A-Za-z0-9_+-]*")
_SEMICOLONS_AND_SPACE = re.compile(r"[;\s]*")  # matched at the start of the reversed query

EXAMPLE = "<sql>SELECT COUNT(*) FROM some_table</sql>"


@dataclasses.dataclass(frozen=True)
class Execute:
    """Run ``query`` and show its result."""

    query: str


@dataclasses.dataclass(frozen=True)
class Submit:
    """Submit ``query`` as the final answer; ``None``: the last query that ran without error."""

    query: str | None


@dataclasses.dataclass(frozen=True)
class Invalid:
    """The response holds no single well-formed action; ``reason`` tells the agent why."""

    reason: str


Action = Execute | Submit | Invalid


def strip_thinking(text: str) -> str:
    """``text`` without its thinking (rule 1 of the module docstring)."""
    last_close = None
    for match in _THINK_CLOSE.finditer(text):
        last_close = match
    if last_close is not None:
        text = text[last_close.end() :]
    still_open = _THINK_OPEN.search(text)
    return text[: still_open.start()] if still_open else text


def fenced_blocks(text: str):
    """``(label, body)`` of each fenced block of ``text``, in order.

    A block opens at ```` ``` ````; spaces and tabs after it are skipped, and the run of
    ``[A-Za-z0-9_+-]`` characters that follows is its label (maybe empty). Its body runs from
    there to the next ```` ``` ```` (which closes it) or to the end of the text. The search for
    the next block starts after the closing fence.
    """
    start = text.find("```")
    while start >= 0:
        label_start = _SPACES.match(text, start + 3).end()
        label_end = _LABEL.match(text, label_start).end()
        close = text.find("```", label_end)
        yield text[label_start:label_end], text[label_end : len(text) if close < 0 else close]
        if close < 0:
            return
        start = text.find("```", close + 3)


def unfence(query: str) -> str | None:
    """The inside of a code fence wrapped around the whole of ``query``, or None if it is not.

    Fenced means: after leading whitespace, ```` ``` ```` and the rest of that line (a label,
    anything) up to a newline; then the body; then ```` ``` ```` and only whitespace to the end.
    The body is what lies between, less the whitespace before the closing fence.
    """
    text = query.lstrip()
    if not text.startswith("```"):
        return None
    newline = text.find("\n", 3)
    if newline < 0:
        return None
    rest = text[newline + 1 :].rstrip()
    if not rest.endswith("```"):
        return None
    return rest[:-3].rstrip()


def clean_query(query: str) -> str:
    """Rule 4: drop a code fence around the whole query, surrounding space, trailing ``;``."""
    inside = unfence(query)
    query = (query if inside is None else inside).strip()
    # Trailing semicolons and the whitespace around them; the query ends in neither otherwise.
    trailing = _SEMICOLONS_AND_SPACE.match(query[::-1]).end()
    return query[: len(query) - trailing]


def parse_response(text: str) -> Action:
    """Parse a model response into one action (grammar in the module docstring)."""
    text = strip_thinking(text)
    first = _TAG_OPEN.search(text)
    if first is not None and _TAG_OPEN.search(text, first.end()) is not None:
        names = [f"<{t.group(1).lower()}>" for t in _TAG_OPEN.finditer(text)]
        return Invalid(
            f"found {len(names)} actions ({', '.join(names)}); write exactly one per turn"
        )
    if first is not None:
        name = first.group(1).lower()
        body = text[first.end() :]
        close = _TAG_CLOSE[name].search(body)
        query = clean_query(body[: close.start()] if close else body)
        if name == "submit":
            return Submit(query or None)
        return Execute(query) if query else Invalid("the <sql> tag holds no query")
    sql_blocks = [body for label, body in fenced_blocks(text) if label.lower() == "sql"]
    if len(sql_blocks) == 1:
        query = clean_query(sql_blocks[0])
        return Execute(query) if query else Invalid("the ```sql block holds no query")
    if sql_blocks:
        return Invalid(f"found {len(sql_blocks)} ```sql blocks; write exactly one action per turn")
    return Invalid(
        "no action found: put one query in <sql>...</sql> to run it, "
        "or in <submit>...</submit> to submit your final answer"
    )
