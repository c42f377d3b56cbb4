"""The one writer of results folders: JSON, CSV, report sections and the Markdown report
(side effects).

Layout of a results folder::

    <folder>/<analysis>.json        numbers of one analysis (NaN / inf written as null)
    <folder>/<analysis>.csv         the same in a flat table (one or more CSVs)
    <folder>/figures/<analysis>.png and .pdf
    <folder>/sections/<analysis>.json  the report sections an analysis contributed
    <folder>/report.md              short report embedding the PNGs and linking the rest

Each analysis of :mod:`agentrl_jax.evaluation.analyses` computes its result and writes its
files through this module (``section(folder, result)`` returns a :class:`Section`);
:func:`write_report` turns sections into ``report.md`` and ``report.html``.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from agentrl_jax.evaluation.html import write_html
from agentrl_jax.evaluation.result import to_jsonable  # noqa: F401  (the writers' JSON form)

FIGURES_DIR = "figures"
REPORT_NAME = "report.md"


@dataclasses.dataclass(frozen=True)
class Section:
    """One analysis in the report. Paths are relative to the results folder."""

    title: str
    text: str = ""
    figures: tuple[str, ...] = ()  # PNG paths; the PDF sibling is linked too
    files: tuple[str, ...] = ()  # JSON / CSV paths
    markdown: str = ""  # e.g. a table, inserted verbatim


# ---------------------------------------------------------------- plain writers


def write_json(path: str | Path, obj: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_jsonable(obj), indent=2, allow_nan=False) + "\n")
    return path


def write_csv(path: str | Path, columns: Mapping[str, Sequence[Any]]) -> Path:
    """Write equal-length columns ``{header: values [R]}`` as a CSV with a header row."""
    lengths = {name: len(values) for name, values in columns.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"write_csv {path}: columns differ in length: {lengths}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(list(columns))
        for row in zip(*(to_jsonable(list(v)) for v in columns.values())):
            writer.writerow(["" if cell is None else cell for cell in row])
    return path


SECTIONS_DIR = "sections"  # <folder>/sections/<analysis>.json: an analysis' report sections


def write_sections(folder: str | Path, analysis: str, sections: Sequence[Section]) -> Path:
    """``folder/sections/<analysis>.json``: the sections an analysis contributes to a report."""
    return write_json(
        Path(folder) / SECTIONS_DIR / f"{analysis}.json",
        {"analysis": analysis, "sections": [dataclasses.asdict(s) for s in sections]},
    )


def read_sections(path: str | Path) -> tuple[str, list[Section]]:
    """``(analysis, sections)`` of a file :func:`write_sections` wrote; ``ValueError`` naming the
    file when it is not such a record."""
    path = Path(path)
    try:
        record = json.loads(path.read_text())
        sections = [
            Section(**{k: tuple(v) if isinstance(v, list) else v for k, v in s.items()})
            for s in record["sections"]
        ]
        return record["analysis"], sections
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a section record ({error})") from None


def rel(folder: Path, path: Path) -> str:
    """``path`` relative to the results ``folder``, as a section links it."""
    return path.relative_to(folder).as_posix()


def figure_path(folder: Path, name: str) -> Path:
    """Where a figure ``name`` goes: ``<folder>/figures/<name>`` (``.png`` and ``.pdf``)."""
    return folder / FIGURES_DIR / name


# ---------------------------------------------------------------- the report


def write_report(
    folder: str | Path,
    sections: Iterable[Section],
    title: str = "Evaluation report",
    preamble: str = "",
    first: str | None = None,
) -> Path:
    """Write ``report.md`` embedding each section's PNGs and linking its PDFs and data files,
    and ``report.html`` beside it, the same sections as one page (:mod:`agentrl_jax.evaluation.
    html`; ``first``: the title of the section it shows first).

    ``preamble``: Markdown inserted verbatim between the title and the first section (e.g. a
    description of the run).

    Raises:
      FileNotFoundError: when a section names a file that is not in the folder, so a report
        never carries a broken link.
    """
    folder = Path(folder)
    sections = list(sections)
    lines = [f"# {title}", ""]
    if preamble.strip():
        lines += [preamble.strip("\n"), ""]
    for section in sections:
        linked = list(section.figures) + [str(Path(p).with_suffix(".pdf")) for p in section.figures]
        linked += list(section.files)
        for rel in linked:
            if Path(rel).is_absolute() or not (folder / rel).is_file():
                raise FileNotFoundError(
                    f"write_report: section {section.title!r} links {rel!r}, "
                    f"which is not a file under {folder}"
                )
        lines += [f"## {section.title}", ""]
        if section.text:
            lines += [section.text, ""]
        if section.markdown:
            lines += [section.markdown.rstrip("\n"), ""]
        for png in section.figures:
            stem = Path(png).stem
            lines += [
                f"![{stem}]({png})",
                "",
                f"[PDF]({Path(png).with_suffix('.pdf').as_posix()})",
                "",
            ]
        if section.files:
            lines += ["Data: " + " · ".join(f"[{Path(p).name}]({p})" for p in section.files), ""]
    path = folder / REPORT_NAME
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    write_html(folder, sections, title, preamble, first=first)
    return path
