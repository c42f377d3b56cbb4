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
The parser never raises on any ``str``; whether the query itself is valid SQL is for the
database to say.
"""

from __future__ import annotations

import dataclasses
import re

_THINK_OPEN = re.compile(r"<\s{0,4}think\s{0,4}>", re.IGNORECASE | re.ASCII)
_THINK_CLOSE = re.compile(r"<\s{0,4}/\s{0,4}think\s{0,4}>", re.IGNORECASE | re.ASCII)
_TAG_OPEN = re.compile(r"<\s{0,4}(sql|submit)\s{0,4}>", re.IGNORECASE | re.ASCII)
_TAG_CLOSE = {name: re.compile(rf"<\s{{0,4}}/\s{{0,4}}{name}\s{{0,4}}>", re.IGNORECASE | re.ASCII)
              for name in ("sql", "submit")}
# A fenced block: ``` with an optional language label, up to the next fence or the end.
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)(.*?)(?:```|\Z)", re.DOTALL)
_WHOLE_FENCE = re.compile(r"\A\s*```[ \t]*[A-Za-z0-9_+-]*[^\n]*\n(.*?)\n?\s*```\s*\Z", re.DOTALL)

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
    closes = list(_THINK_CLOSE.finditer(text))
    if closes:
        text = text[closes[-1].end():]
    still_open = _THINK_OPEN.search(text)
    return text[:still_open.start()] if still_open else text


def clean_query(query: str) -> str:
    """Rule 4: drop a code fence around the whole query, surrounding space, trailing ``;``."""
    fenced = _WHOLE_FENCE.match(query)
    if fenced:
        query = fenced.group(1)
    query = query.strip()
    while query.endswith(";"):
        query = query[:-1].rstrip()
    return query


def parse_response(text: str) -> Action:
    """Parse a model response into one action (grammar in the module docstring)."""
    text = strip_thinking(text)
    tags = list(_TAG_OPEN.finditer(text))
    if len(tags) > 1:
        names = ", ".join(f"<{t.group(1).lower()}>" for t in tags)
        return Invalid(f"found {len(tags)} actions ({names}); write exactly one per turn")
    if tags:
        name = tags[0].group(1).lower()
        body = text[tags[0].end():]
        close = _TAG_CLOSE[name].search(body)
        query = clean_query(body[:close.start()] if close else body)
        if name == "submit":
            return Submit(query or None)
        return Execute(query) if query else Invalid("the <sql> tag holds no query")
    sql_blocks = [m.group(2) for m in _FENCE.finditer(text) if m.group(1).lower() == "sql"]
    if len(sql_blocks) == 1:
        query = clean_query(sql_blocks[0])
        return Execute(query) if query else Invalid("the ```sql block holds no query")
    if sql_blocks:
        return Invalid(f"found {len(sql_blocks)} ```sql blocks; write exactly one action per turn")
    return Invalid("no action found: put one query in <sql>...</sql> to run it, "
                   "or in <submit>...</submit> to submit your final answer")
