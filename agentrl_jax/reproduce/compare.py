"""Did a results folder reproduce? Its run compared with the stored reference made on a CPU
like the one it ran on: the bytes of its deterministic outputs, Table 1 row by row and every
finding's verdict (``agentrl-jax compare``).

On CPU a run's numbers are a function of its config, the jax version and the CPU's vector
instructions: the same command gives the same bytes on every machine that shares them, and
other bytes after a few RL updates where they differ. Measured so far (docs/reproduction.md),
the feature that decides is AVX-512 (the ``avx512f`` flag): an AMD EPYC with it gives one set
of results, an Intel Xeon and an AMD EPYC without it (AVX2 only) give another, the same on
both. So each stored reference records the vector features of the machine that made it
(:data:`DECIDING`), and :func:`find_reference` picks the one whose deciding features, config
and jax version are the run's.

A reference (``references/*.json``, :class:`Reference`) is a :func:`fingerprint` of a run:
the sha256 of the files a rerun must reproduce byte for byte (:data:`COMPARED`: the models,
the raw records, Table 1 and the findings; not the figures, whose bytes follow matplotlib,
nor the logs, which hold times and paths), Table 1's cells as written in ``table1.csv`` and
each finding's verdict. A reference may hold less than a full fingerprint (what it lacks is
not compared, and the comparison says so). ``notebooks/references.py`` makes them from
stored runs.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import json
from pathlib import Path
from typing import Any, Mapping, Sequence

REFERENCES = Path(__file__).parent / "references"

DECIDING = {"avx512f": "AVX-512"}
"""The CPU features a CPU run's bytes depend on (flag: name), as far as measured: a run and
a reference agree on these or are not comparable."""

COMPARED = (
    "models/*/model.safetensors",
    "raw/*.json",
    "table1.csv",
    "findings.json",
    "budget_robustness.json",
    "error_recovery.json",
)
"""The files compared byte for byte (globs under the results folder). ``raw/dynamics.json`` is
left out: it names the folder's training logs by path."""

_NOT_COMPARED = {"raw/dynamics.json"}


@dataclasses.dataclass(frozen=True)
class Reference:
    """A stored run's fingerprint (see the module docstring): ``name``; ``made_on`` (the
    machine, as :func:`agentrl_jax.reproduce.machine.describe` writes it); ``features`` (its
    deciding features, e.g. ``["avx512f"]``, none for AVX2 only); ``jax``; ``config_sha256``
    (of ``config.yaml``); ``files`` (``{path: sha256}``); ``table1`` (``{row: {column:
    cell}}``); ``verdicts`` (``{"headline | subject": verdict}``); ``source`` (where it comes
    from, in words)."""

    name: str
    made_on: str
    features: tuple[str, ...]
    jax: str
    config_sha256: str
    files: Mapping[str, str]
    table1: Mapping[str, Mapping[str, str]]
    verdicts: Mapping[str, str]
    source: str = ""

    @classmethod
    def read(cls, path: str | Path) -> "Reference":
        """A reference file; a clear ``ValueError`` for one that is not."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
            return cls(
                name=str(data["name"]),
                made_on=str(data["made_on"]),
                features=tuple(str(f) for f in data["features"]),
                jax=str(data["jax"]),
                config_sha256=str(data["config_sha256"]),
                files={str(k): str(v) for k, v in data.get("files", {}).items()},
                table1={
                    str(r): {str(c): str(v) for c, v in cells.items()}
                    for r, cells in data.get("table1", {}).items()
                },
                verdicts={str(k): str(v) for k, v in data.get("verdicts", {}).items()},
                source=str(data.get("source", "")),
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"{path}: not a reference file ({error})") from None

    def to_json(self) -> str:
        record = dataclasses.asdict(self)
        record["features"] = list(self.features)
        return json.dumps(record, indent=1) + "\n"  # Table 1's rows in table order


def references(folder: Path = REFERENCES) -> list[Reference]:
    """The stored references, by file name."""
    return [Reference.read(p) for p in sorted(Path(folder).glob("*.json"))]


# ---------------------------------------------------------------- a run's fingerprint


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def compared_files(folder: Path) -> dict[str, str]:
    """``{path under folder: sha256}`` of the :data:`COMPARED` files it holds."""
    found = {}
    for pattern in COMPARED:
        for path in sorted(folder.glob(pattern)):
            name = path.relative_to(folder).as_posix()
            if path.is_file() and name not in _NOT_COMPARED:
                found[name] = _sha256(path)
    return found


def table1_cells(text: str, source: str = "table1.csv") -> dict[str, dict[str, str]]:
    """``table1.csv``'s text as ``{row: {column: cell}}`` (cells as written); a ``ValueError``
    naming ``source`` for a file that is not such a table."""
    reader = csv.DictReader(io.StringIO(text))
    if not reader.fieldnames or "row" not in reader.fieldnames:
        raise ValueError(f"{source}: not Table 1 (no 'row' column)")
    cells = {}
    for r in reader:
        if None in r or None in r.values():  # a line with more or fewer cells than the header
            raise ValueError(f"{source}: line {reader.line_num} does not match the header")
        cells[r["row"]] = {c: v for c, v in r.items() if c not in ("row", "kind")}
    return cells


def verdicts(findings: Any, source: str = "findings.json") -> dict[str, str]:
    """``findings.json``'s records as ``{"headline | subject": verdict}``; a ``ValueError``
    naming ``source`` for anything but a list of records holding those three strings."""
    keys = ("headline", "subject", "verdict")
    if not isinstance(findings, list) or not all(
        isinstance(f, dict) and all(isinstance(f.get(k), str) for k in keys) for f in findings
    ):
        raise ValueError(f"{source}: not a list of findings (headline, subject, verdict)")
    return {f"{f['headline']} | {f['subject']}": f["verdict"] for f in findings}


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not text ({error})") from None


def _json(path: Path) -> Any:
    try:
        return json.loads(_text(path))
    except ValueError as error:
        raise ValueError(f"{path}: not JSON ({error})") from None


def run_machines(folder: Path) -> list[dict[str, Any]]:
    """The machines ``phases.json`` says the run's phases ran on, each once."""
    try:
        phases = json.loads((folder / "phases.json").read_text())
    except (OSError, ValueError):
        return []
    seen: list[dict[str, Any]] = []
    for record in phases.values() if isinstance(phases, dict) else ():
        found = record.get("machine") if isinstance(record, dict) else None
        if isinstance(found, dict) and found not in seen:
            seen.append(found)
    return seen


def features(machine: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The :data:`DECIDING` features a machine record has; None where it records no
    readable CPU flags (then nothing is known of them)."""
    flags = machine.get("cpu_flags")
    if not (isinstance(flags, list) and all(isinstance(f, str) for f in flags)):
        return None
    return tuple(f for f in DECIDING if f in flags)


def fingerprint(folder: str | Path, name: str = "", source: str = "") -> Reference:
    """A results folder as a :class:`Reference` (of its first machine; see :func:`compare`
    for a run that moved)."""
    from agentrl_jax.reproduce.machine import describe

    folder = Path(folder)
    config = folder / "config.yaml"
    if not config.is_file():
        raise ValueError(f"{folder}: no config.yaml, so not a results folder")
    machines = run_machines(folder)
    table = folder / "table1.csv"
    found = folder / "findings.json"
    return Reference(
        name=name or folder.name,
        made_on=" then ".join(describe(m) for m in machines) or "unknown",
        features=(features(machines[0]) if machines else None) or (),
        jax=str(machines[0].get("jax")) if machines else "unknown",
        config_sha256=_sha256(config),
        files=compared_files(folder),
        table1=table1_cells(_text(table), str(table)) if table.is_file() else {},
        verdicts=verdicts(_json(found), str(found)) if found.is_file() else {},
        source=source,
    )


# ---------------------------------------------------------------- the comparison


def find_reference(run: Reference, stored: Sequence[Reference]) -> Reference | None:
    """The stored reference of the run's config made with its deciding features and jax
    version (the first such), or None."""
    for ref in stored:
        if (ref.config_sha256, set(ref.features), ref.jax) == (
            run.config_sha256,
            set(run.features),
            run.jax,
        ):
            return ref
    return None


def why_none(run: Reference, stored: Sequence[Reference]) -> str:
    """Why :func:`find_reference` found nothing, in words."""
    same_config = [r for r in stored if r.config_sha256 == run.config_sha256]
    if not same_config:
        return (
            "no stored reference has this run's config (config.yaml): references are of the "
            "built-in default, `agentrl-jax reproduce frozenlake`"
        )
    same_cpu = [r for r in same_config if set(r.features) == set(run.features)]
    if not same_cpu:
        return f"no stored reference was made on a CPU {_isa(run.features)}; stored: " + ", ".join(
            f"{r.name} ({_isa(r.features)})" for r in same_config
        )
    return f"no stored reference was made with jax {run.jax}; stored: " + ", ".join(
        f"{r.name} (jax {r.jax})" for r in same_cpu
    )


def _isa(found: Sequence[str]) -> str:
    have = [DECIDING[f] for f in found]
    lacking = [name for f, name in DECIDING.items() if f not in found]
    return "with " + ", ".join(have) if have else "without " + ", ".join(lacking)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """What :func:`compare` found: lines of what agrees, what differs, and what one side lacks
    (so was not compared)."""

    same: list[str]
    differ: list[str]
    not_compared: list[str]
    """Each a line; a Table 1 or verdict line is followed by one indented line per row or
    verdict that differs."""

    @property
    def reproduced(self) -> bool:
        return not self.differ and bool(self.same)


def _cells(mine: str, theirs: str) -> str:
    """Two differing cells, to one decimal unless that hides the difference."""
    try:
        a, b = float(mine), float(theirs)
    except ValueError:
        return f"{mine} vs {theirs}"
    return f"{a:.1f} vs {b:.1f}" if f"{a:.1f}" != f"{b:.1f}" else f"{mine} vs {theirs}"


def _row_change(mine: Mapping[str, str], theirs: Mapping[str, str]) -> str | None:
    """How a Table 1 row differs: its estimates (here vs reference), or that only its
    intervals do; None where it does not."""
    changed = [c for c, v in theirs.items() if mine.get(c) != v]
    if not changed:
        return None
    points = [c for c in changed if not c.endswith(("ci_low", "ci_high"))]
    if not points:
        return "intervals only (" + ", ".join(changed) + ")"
    return "; ".join(f"{c} {_cells(mine.get(c, '?'), theirs[c])}" for c in points)


def compare(run: Reference, ref: Reference) -> Comparison:
    """The run's fingerprint against the reference's (pure): bytes of each file both hold,
    Table 1 cells of each row both hold, each verdict both hold."""
    same, differ, missing = [], [], []
    both = [f for f in ref.files if f in run.files]
    changed = [f for f in both if run.files[f] != ref.files[f]]
    if both:
        (differ if changed else same).append(
            f"bytes: {len(both) - len(changed)} of {len(both)} files identical"
            + (f"; differ: {', '.join(changed)}" if changed else "")
        )
    absent = [f for f in ref.files if f not in run.files]
    if absent:
        missing.append(f"not in this folder: {', '.join(absent)}")
    if not ref.files:
        missing.append("bytes: the reference records none")

    rows = [r for r in ref.table1 if r in run.table1]
    changed_rows = [
        f"{row}: {change}"
        for row in rows
        if (change := _row_change(run.table1[row], ref.table1[row])) is not None
    ]
    if rows:
        (differ if changed_rows else same).append(
            f"Table 1: {len(rows) - len(changed_rows)} of {len(rows)} rows identical"
            + "".join(f"\n    {line}" for line in changed_rows)
        )
    only_ref = [r for r in ref.table1 if r not in run.table1]
    if only_ref:
        missing.append(f"Table 1 rows not in this run: {', '.join(only_ref)}")
    only_run = [r for r in run.table1 if r not in ref.table1]
    if only_run and ref.table1:
        missing.append(f"Table 1 rows the reference lacks: {', '.join(only_run)}")

    keys = [k for k in ref.verdicts if k in run.verdicts]
    flipped = [
        f"{k}: {run.verdicts[k]} here, {ref.verdicts[k]} in the reference"
        for k in keys
        if run.verdicts[k] != ref.verdicts[k]
    ]
    if keys:
        (differ if flipped else same).append(
            f"verdicts: {len(keys) - len(flipped)} of {len(keys)} identical"
            + "".join(f"\n    {line}" for line in flipped)
        )
    if not ref.verdicts:
        missing.append("verdicts: the reference records none")
    elif len(keys) < len(ref.verdicts):
        missing.append(f"verdicts not in this run: {len(ref.verdicts) - len(keys)}")
    return Comparison(same, differ, missing)


def report(folder: str | Path, reference: Reference | None = None) -> tuple[str, int]:
    """The comparison of a results folder as text, and the exit status: 0 reproduced, 1
    differs, 2 no reference to compare with (``reference``: this one rather than the stored
    one :func:`find_reference` picks)."""
    folder = Path(folder)
    run = fingerprint(folder)
    machines = run_machines(folder)
    lines = [f"Run: {folder}, made on {run.made_on}"]
    if len(machines) > 1 and len({features(m) for m in machines}) > 1:
        lines.append(
            "Its phases ran on CPUs with different vector features: no reference can match it"
        )
        return "\n".join(lines), 2
    if reference is None and (not machines or features(machines[0]) is None):
        lines.append(
            "No reference to compare with: phases.json records no CPU features of the run "
            "(name one with --reference)"
        )
        return "\n".join(lines), 2
    lines.append(
        "The CPU features that decide byte equality, on this run's CPU: "
        + ", ".join(
            f"{name} (`{flag}`) {'present' if flag in run.features else 'absent'}"
            for flag, name in DECIDING.items()
        )
    )
    ref = reference or find_reference(run, references())
    if ref is None:
        lines.append(f"No reference to compare with: {why_none(run, references())}")
        return "\n".join(lines), 2
    lines.append(
        f"Reference: {ref.name}, made on {ref.made_on}" + (f"; {ref.source}" if ref.source else "")
    )
    if reference is not None:
        for what, mine, theirs in (
            ("features", _isa(run.features), _isa(ref.features)),
            ("jax", run.jax, ref.jax),
            ("config sha256", run.config_sha256[:12], ref.config_sha256[:12]),
        ):
            if mine != theirs:
                lines.append(f"Warning: {what} differ ({mine} here, {theirs} there)")
    result = compare(run, ref)
    lines += [f"Same: {line}" for line in result.same]
    lines += [f"Differs: {line}" for line in result.differ]
    lines += [f"Not compared: {line}" for line in result.not_compared]
    lines.append(
        "Reproduced: yes, everything compared is identical"
        if result.reproduced
        else "Reproduced: no"
        if result.differ
        else "Reproduced: nothing to compare"
    )
    return "\n".join(lines), 0 if result.reproduced else 1 if result.differ else 2
