"""``report.html``: the report's sections as one self-contained page.

The same :class:`~agentrl_jax.evaluation.report.Section` objects as ``report.md``, rendered by
markdown-it-py (CommonMark with tables; raw HTML in the text is escaped, not passed through),
the figures inline (PNG data URIs, so the page can be mailed or opened anywhere, each with its
PDF linked), the data files linked relative to the results folder. ``first`` puts one section
(the findings) at the top. Every section's ``id`` is :func:`anchor` of its title, the anchor
GitHub gives the same heading in ``report.md``, so a link ``[..](#anchor)`` in a section's
Markdown works in both.
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path
from typing import Iterable, Sequence

from markdown_it import MarkdownIt

HTML_NAME = "report.html"

_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 70rem; margin: 2rem auto; padding: 0 1rem;
       line-height: 1.45; color: #1b1b1b; }
table { border-collapse: collapse; margin: 0.8rem 0; font-size: 0.9rem; }
th, td { border: 1px solid #ccc; padding: 0.3rem 0.5rem; vertical-align: top; }
th { background: #f2f2f2; }
figure { margin: 1rem 0; }
figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption, .data { font-size: 0.85rem; color: #555; }
section { border-top: 1px solid #ddd; padding-top: 0.5rem; }
"""


def anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation other than ``-`` and ``_`` dropped,
    spaces as ``-`` (``"Pass@K at T_max = 4"`` -> ``"passk-at-t_max--4"``)."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def _markdown() -> MarkdownIt:
    return MarkdownIt("commonmark", {"html": False}).enable("table")


def _figure(folder: Path, png: str) -> str:
    data = base64.b64encode((folder / png).read_bytes()).decode("ascii")
    pdf = Path(png).with_suffix(".pdf").as_posix()
    name = html.escape(Path(png).stem)
    return (
        f'<figure><img src="data:image/png;base64,{data}" alt="{name}">'
        f'<figcaption>{name} · <a href="{html.escape(pdf)}">PDF</a></figcaption></figure>'
    )


def write_html(
    folder: str | Path, sections: Iterable, title: str, preamble: str = "", first: str | None = None
) -> Path:
    """Write ``folder/report.html`` from ``sections`` (see the module docstring); returns its
    path. ``first``: the title of the section to put first (if present)."""
    folder = Path(folder)
    sections: Sequence = list(sections)
    if first is not None:
        sections = [s for s in sections if s.title == first] + [
            s for s in sections if s.title != first
        ]
    md = _markdown()
    body = [f"<h1>{html.escape(title)}</h1>"]
    if preamble.strip():
        body.append(md.render(preamble))
    contents = "".join(
        f'<li><a href="#{anchor(s.title)}">{html.escape(s.title)}</a></li>' for s in sections
    )
    body.append(f"<nav><ul>{contents}</ul></nav>")
    for section in sections:
        parts = [f'<section id="{anchor(section.title)}"><h2>{html.escape(section.title)}</h2>']
        if section.text:
            parts.append(md.render(section.text))
        if section.markdown:
            parts.append(md.render(section.markdown))
        parts += [_figure(folder, png) for png in section.figures]
        if section.files:
            links = " · ".join(
                f'<a href="{html.escape(p)}">{html.escape(Path(p).name)}</a>' for p in section.files
            )
            parts.append(f'<p class="data">Data: {links}</p>')
        body.append("".join(parts) + "</section>")
    page = (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head>\n"
        f"<body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
    path = folder / HTML_NAME
    path.write_text(page)
    return path
