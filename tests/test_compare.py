"""``agentrl-jax compare``: a results folder against the stored reference of its CPU's vector
features. The stored default run reproduces its own reference; a tampered copy is caught and
every change named; a run made without AVX-512 is compared with the AVX2 reference; a run of
another config, or a broken reference file, gets a reason, not a verdict."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentrl_jax.cli import app
from agentrl_jax.reproduce import compare

ROOT = Path(__file__).resolve().parent.parent
STORED = ROOT / "notebooks" / "results_cpu_default"


def run_compare(*args: str):
    return CliRunner().invoke(app, ["compare", *args], terminal_width=200)


@pytest.fixture
def copy(tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(STORED, folder, ignore=shutil.ignore_patterns("*.png"))
    return folder


def test_the_stored_run_reproduces_its_reference():
    result = run_compare(str(STORED))
    assert result.exit_code == 0, result.output
    out = result.output
    assert "Reference: frozenlake-default-avx512" in out
    assert "AVX-512 (`avx512f`) present" in out
    assert "Same: Table 1: 12 of 12 rows identical" in out
    assert "Same: verdicts: 25 of 25 identical" in out
    assert "Reproduced: yes" in out
    # the stored folder keeps no models: what the reference holds beyond it is listed, not failed
    reference = compare.Reference.read(compare.REFERENCES / "frozenlake_default_avx512.json")
    absent = [f for f in reference.files if not (STORED / f).is_file()]
    assert all(f.startswith("models/") for f in absent)
    assert (f"not in this folder: {', '.join(absent)}" in out) == bool(absent)


def test_a_tampered_copy_names_every_change(copy):
    table = copy / "table1.csv"
    lines = table.read_text().splitlines(keepends=True)
    assert lines[2].startswith("GRPO,policy,41.66666666666667,")
    lines[2] = lines[2].replace("41.66666666666667", "43.75", 1)
    table.write_text("".join(lines))
    found = json.loads((copy / "findings.json").read_text())
    flipped = f"{found[3]['headline']} | {found[3]['subject']}"
    found[3]["verdict"] = "refuted" if found[3]["verdict"] != "refuted" else "shows"
    (copy / "findings.json").write_text(json.dumps(found))
    raw = copy / "raw" / "passk.json"
    raw.write_bytes(raw.read_bytes() + b" ")
    result = run_compare(str(copy))
    assert result.exit_code == 1, result.output
    out = result.output
    assert "differ: raw/passk.json, table1.csv, findings.json" in out
    assert "Table 1: 11 of 12 rows identical\n    GRPO: 25% (T=3) 43.8 vs 41.7\n" in out
    assert f"verdicts: 24 of 25 identical\n    {flipped}: {found[3]['verdict']} here" in out
    assert "Reproduced: no" in out


def _without_avx512(folder: Path) -> None:
    phases = json.loads((folder / "phases.json").read_text())
    for record in phases.values():
        record["machine"]["cpu_flags"] = ["avx2", "fma"]
        record["machine"]["cpu_id"] = "AuthenticAMD family 25 model 1 stepping 1"
    (folder / "phases.json").write_text(json.dumps(phases))


def test_a_run_without_avx512_is_compared_with_the_avx2_reference(copy):
    _without_avx512(copy)
    result = run_compare(str(copy))
    out = result.output
    assert "AVX-512 (`avx512f`) absent" in out
    assert "Reference: frozenlake-default-avx2" in out
    # the AVX-512 run's RL rows are not the AVX2 ones; the base row (no RL update) is
    assert "Table 1: 1 of 9 rows identical\n    GRPO: 25% (T=3) 41.7 vs 39.9;" in out
    assert "Not compared: bytes: the reference records none" in out
    assert "Presentation-mixed BudgetMix GRPO" in out.split("Table 1 rows the reference lacks")[1]
    assert result.exit_code == 1


def test_another_config_or_a_broken_reference_gets_a_reason(copy, tmp_path):
    (copy / "config.yaml").write_text((copy / "config.yaml").read_text() + "# edited\n")
    result = run_compare(str(copy))
    assert result.exit_code == 2
    assert (
        "No reference to compare with: no stored reference has this run's config" in result.output
    )
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    result = run_compare(str(copy), "--reference", str(broken))
    assert result.exit_code == 2 and f"{broken}: not a reference file" in result.output
    result = run_compare(str(tmp_path / "nowhere"))
    assert result.exit_code == 2 and "no config.yaml, so not a results folder" in result.output


@pytest.mark.parametrize(
    "name, text, said",
    [
        ("table1.csv", "a,b\n1,2\n", "table1.csv: not Table 1 (no 'row' column)"),
        ("table1.csv", "row,kind,x\nbase,policy,1,2,3\n", "line 2 does not match the header"),
        ("table1.csv", b"row\n\xff\xfe\n", "table1.csv: not text"),
        ("findings.json", "{not json", "findings.json: not JSON"),
        ("findings.json", '{"headline": "x"}', "findings.json: not a list of findings"),
        ("findings.json", '[{"headline": 1, "subject": "s", "verdict": "v"}]', "not a list"),
        ("findings.json", "[null]", "findings.json: not a list of findings"),
    ],
)
def test_a_hostile_results_file_is_named_not_a_crash(copy, name, text, said):
    path = copy / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    result = run_compare(str(copy))
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "compare: " in result.output and said in result.output


@pytest.mark.parametrize("flags", ["avx512f", None, [1, 2], {"avx512f": True}])
def test_cpu_flags_phases_json_cannot_read_are_not_guessed(copy, flags):
    """A run whose phases.json records no readable CPU flags is matched with no reference
    (a string "avx512f" is not read as the flag list it is not)."""
    phases = json.loads((copy / "phases.json").read_text())
    for record in phases.values():
        record["machine"].update(cpu_flags=flags, cpu_id=7, processes="two")
    (copy / "phases.json").write_text(json.dumps(phases))
    result = run_compare(str(copy))
    assert result.exit_code == 2, result.output
    assert "phases.json records no CPU features of the run" in result.output
    (copy / "phases.json").write_text("[1, 2")  # not JSON at all: no machine known either
    assert "records no CPU features" in run_compare(str(copy)).output


def test_the_stored_references_are_of_todays_built_in_default():
    """A new config field changes the default run's config.yaml, and `compare` then finds no
    reference for it: rerun `agentrl-jax reproduce frozenlake`, check that `compare` finds
    everything else identical against the reference given the new sha256, and store that."""
    import hashlib

    from agentrl_jax.config_io import dump_config
    from agentrl_jax.reproduce.config import default_config

    today = hashlib.sha256(dump_config(default_config("frozenlake")).encode()).hexdigest()
    assert {r.config_sha256 for r in compare.references()} == {today}
