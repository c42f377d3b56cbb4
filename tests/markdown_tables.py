"""Reading tables back out of a generated Markdown report (markdown-it-py), for the tests that
check a report shows the numbers its raw results give."""

from __future__ import annotations

from markdown_it import MarkdownIt


def first_table(text: str) -> tuple[list[str], dict[str, list[str]]]:
    """Header cells and ``{row label: the other cells}`` of the first table in ``text``."""
    rows, row = [], None
    for token in MarkdownIt("commonmark").enable("table").parse(text):
        if token.type == "table_close":
            break
        if token.type == "tr_open":
            row = []
        elif token.type == "inline" and row is not None:
            row.append(token.content)
        elif token.type == "tr_close":
            rows.append(row)
            row = None
    if not rows:
        raise AssertionError("no table in the Markdown text")
    return rows[0], {r[0]: r[1:] for r in rows[1:]}
