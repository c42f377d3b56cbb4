"""Findings across seeds (``reproduce --seeds``): each effect's estimate per seed, the mean with
a 95% t-interval across the seeds, how many seeds agree with the paper and show it, the
findings' rule on the across-seed interval, ``seeds.md`` / ``seeds.json`` and the multi-seed
``report.md`` that leads with them, all against values computed by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from agentrl_jax.evaluation import findings, verdicts
from agentrl_jax.evaluation import raw as results
from agentrl_jax.evaluation.findings import Effect, Finding
from agentrl_jax.evaluation.result import to_jsonable
from agentrl_jax.evaluation.stats import MeanCI
from agentrl_jax.reproduce import machine, seeds

SEEDS = (0, 7, 13)
T2 = 4.302652730  # Student's t 97.5% quantile at 2 degrees of freedom
T1 = 12.706204736  # ... at 1
MACHINE_A = {
    "cpu": "Test CPU A",
    "cpu_id": "GenuineIntel family 6 model 1 stepping 1",
    "cpu_flags": ["avx2", "fma"],
    "cores": 2,
    "arch": "x86_64",
    "devices": "1 x cpu",
    "processes": 1,
    "jax": "0.0.1",
    "jaxlib": "0.0.2",
    "python": "3.11.7",
}
MACHINE_B = {**MACHINE_A, "cpu": "Test CPU B", "cpu_flags": ["avx2", "fma", "avx512f"]}

# Per seed: the CI of each effect (mean, low, high).
LEAD = {0: (0.01, -0.02, 0.04), 7: (0.03, 0.01, 0.05), 13: (0.05, -0.01, 0.11)}
R_MULTI = {0: (0.5, 0.4, 0.6), 7: (0.6, 0.5, 0.7), 13: (0.7, 0.6, 0.8)}
R_SINGLE = {0: (-0.1, -0.15, -0.05), 7: (0.02, -0.01, 0.05), 13: (-0.04, -0.2, 0.12)}
KEPT = {0: (-0.03, -0.08, 0.02), 7: (0.01, -0.01, 0.03)}  # BudgetMix run at seeds 0 and 7 only


def _finding(headline: str, subject: str, *effects: Effect) -> Finding:
    return Finding(
        headline,
        subject,
        findings.PAPER[headline],
        f"{subject} observed",
        verdicts.verdict(*effects),
        {"effects": verdicts.effects_json(*effects)},
    )


def _seed_findings(seed: int) -> list[Finding]:
    ci = lambda values: MeanCI(*values, 20)  # noqa: E731
    found = [
        _finding(findings.PASS_AT_K, "GRPO", Effect("lead at k = 1", ci(LEAD[seed]))),
        _finding(
            findings.FULL_BUDGET_DYNAMICS,
            "grpo",
            Effect("R_multi", ci(R_MULTI[seed]), size=0.568, points=False),
            Effect("R_single", ci(R_SINGLE[seed]), direction=-1, size=0.091, points=False),
        ),
        Finding(findings.ERROR_RECOVERY, "", "", "not run", findings.NOT_MEASURED),
    ]
    if seed in KEPT:
        found.append(
            _finding(
                findings.BUDGETMIX_DYNAMICS,
                "budgetmix",
                Effect("R_single", ci(KEPT[seed]), margin=0.091, points=False),
            )
        )
    return found


@pytest.fixture
def out(tmp_path):
    """Three finished seed folders: seed 0 ran on machine A, seed 7 on A then (resumed) on
    B, seed 13 recorded no machine; seed 0 also has an HTML report."""
    phases = {
        0: {"warm_start": {"seconds": 1.0, "machine": MACHINE_A}},
        7: {
            "warm_start": {"seconds": 1.0, "machine": MACHINE_A},
            "train:grpo": {"seconds": 2.0, "machine": MACHINE_B},
            "eval:table": {"seconds": 2.0, "machine": MACHINE_B},
        },
    }
    for seed in SEEDS:
        folder = seeds.seed_folder(tmp_path, seed)
        findings.write_findings(folder, _seed_findings(seed))
        (folder / "report.md").write_text("# a seed's report\n")
        if seed in phases:
            (folder / "phases.json").write_text(json.dumps(phases[seed]))
    (seeds.seed_folder(tmp_path, 0) / "report.html").write_text("<html></html>")
    return tmp_path


def _row(rows, headline):
    (row,) = [r for r in rows if r["headline"] == headline]
    return row


def _effect(row, name):
    (effect,) = [e for e in row["effects"] if e["name"] == name]
    return effect


def test_findings_json_keeps_each_effects_estimate_interval_and_direction(tmp_path):
    found = [
        _finding(
            findings.FULL_BUDGET_DYNAMICS,
            "grpo",
            Effect("R_single", MeanCI(-0.1, -0.15, -0.05, 20), direction=-1, size=0.091),
            Effect("R_multi", MeanCI(0.02, math.nan, math.nan, 1), points=False),
        )
    ]
    findings.write_findings(tmp_path, found)
    (written,) = json.loads((tmp_path / findings.FINDINGS_JSON).read_text())
    effects = written["numbers"]["effects"]
    assert effects["R_single"] == {
        "verdict": findings.SHOWS,
        "detectable": pytest.approx(findings.POWER_Z * 0.1 / (2 * findings.Z95)),
        "paper_size": 0.091,
        "margin": 0.0,
        "estimate": -0.1,
        "low": -0.15,
        "high": -0.05,
        "n": 20,
        "direction": -1,
        "points": True,
    }
    multi = effects["R_multi"]  # one value: no interval, written null
    assert (multi["estimate"], multi["low"], multi["high"], multi["detectable"]) == (
        0.02,
        None,
        None,
        None,
    )
    assert (multi["direction"], multi["points"], multi["verdict"]) == (
        1,
        False,
        findings.UNDERPOWERED,
    )


def test_t_quantiles_and_the_interval_across_seeds():
    assert seeds.t_quantile_975(2) == pytest.approx(T2, abs=1e-9)
    assert seeds.t_quantile_975(1) == pytest.approx(T1, abs=1e-9)
    assert seeds.t_quantile_975(31) == pytest.approx(2.039513446, abs=1e-6)  # the expansion
    assert seeds.t_quantile_975(120) == pytest.approx(1.979930405, abs=1e-6)
    with pytest.raises(ValueError, match="df must be >= 1"):
        seeds.t_quantile_975(0)
    ci = seeds.across_interval([0.01, 0.03, 0.05])
    half = T2 * 0.02 / math.sqrt(3)  # sd 0.02 over 3 seeds
    assert (ci.mean, ci.n) == (pytest.approx(0.03), 3)
    assert (ci.low, ci.high) == (pytest.approx(0.03 - half), pytest.approx(0.03 + half))
    ci = seeds.across_interval([0.02, None, math.nan])  # one seed with an estimate
    assert ci.mean == 0.02 and ci.n == 1 and math.isnan(ci.low) and math.isnan(ci.high)
    assert seeds.across_interval([None]).n == 0


def test_on_the_papers_side():
    assert seeds.on_papers_side(0.01, 1) and not seeds.on_papers_side(-0.01, 1)
    assert seeds.on_papers_side(-0.01, -1) and not seeds.on_papers_side(0.0, 1)
    assert seeds.on_papers_side(-0.05, 1, margin=0.091)  # keeps: a fall smaller than the margin
    assert not seeds.on_papers_side(-0.1, 1, margin=0.091)
    assert not seeds.on_papers_side(None, 1) and not seeds.on_papers_side(math.nan, 1)


def test_each_effect_across_seeds_against_hand_computed_values(out):
    rows = seeds.across_seeds(out, SEEDS)
    assert [(r["headline"], r["subject"]) for r in rows] == [
        (findings.PASS_AT_K, "GRPO"),
        (findings.FULL_BUDGET_DYNAMICS, "grpo"),
        (findings.ERROR_RECOVERY, ""),
        (findings.BUDGETMIX_DYNAMICS, "budgetmix"),
    ]
    lead = _effect(rows[0], "lead at k = 1")
    half = T2 * 0.02 / math.sqrt(3)
    assert lead["estimates"] == {"0": 0.01, "7": 0.03, "13": 0.05}
    assert lead["verdicts"] == {"0": "underpowered", "7": "shows", "13": "underpowered"}
    assert (lead["mean"], lead["low"], lead["high"], lead["n"]) == (
        pytest.approx(0.03),
        pytest.approx(0.03 - half),
        pytest.approx(0.03 + half),
        3,
    )
    assert lead["paper_side"] == [0, 7, 13] and lead["shows"] == [7]
    assert lead["verdict"] == findings.UNDERPOWERED  # no size from the paper, CI holds 0
    assert rows[0]["shows"] == [7]

    multi, single = (_effect(rows[1], n) for n in ("R_multi", "R_single"))
    half = T2 * 0.1 / math.sqrt(3)  # 0.5, 0.6, 0.7: sd 0.1
    assert (multi["low"], multi["high"]) == (pytest.approx(0.6 - half), pytest.approx(0.6 + half))
    assert multi["shows"] == [0, 7, 13] and multi["verdict"] == findings.SHOWS
    half = T2 * 0.06 / math.sqrt(3)  # -0.1, 0.02, -0.04: sd 0.06
    assert (single["mean"], single["low"], single["high"]) == (
        pytest.approx(-0.04),
        pytest.approx(-0.04 - half),
        pytest.approx(-0.04 + half),
    )
    assert single["direction"] == -1 and single["paper_side"] == [0, 13]
    assert single["shows"] == [0]
    # judge: the interval holds 0 and could not detect the paper's 0.091 (detectable ~0.21)
    assert (
        single["verdict"]
        == findings.UNDERPOWERED
        == findings.judge(
            Effect(
                "R_single",
                MeanCI(-0.04, -0.04 - half, -0.04 + half, 3),
                direction=-1,
                size=0.091,
                points=False,
            )
        )
    )
    assert rows[2]["effects"] == [] and rows[2]["verdicts"] == dict.fromkeys(
        ("0", "7", "13"), findings.NOT_MEASURED
    )


def test_a_finding_present_at_only_some_seeds(out):
    row = _row(seeds.across_seeds(out, SEEDS), findings.BUDGETMIX_DYNAMICS)
    assert row["verdicts"]["13"] is None and row["observed"]["13"] is None
    kept = _effect(row, "R_single")
    half = T1 * math.sqrt(2 * 0.02**2) / math.sqrt(2)  # -0.03, 0.01: sd 0.0283 over 2 seeds
    assert kept["estimates"] == {"0": -0.03, "7": 0.01, "13": None}
    assert kept["verdicts"] == {"0": "shows", "7": "shows", "13": None}
    assert (kept["mean"], kept["low"], kept["high"], kept["n"]) == (
        pytest.approx(-0.01),
        pytest.approx(-0.01 - half),
        pytest.approx(-0.01 + half),
        2,
    )
    assert kept["paper_side"] == [0, 7]  # a fall smaller than full-budget RL's (0.091)
    assert kept["shows"] == [0, 7] and kept["margin"] == 0.091
    assert kept["verdict"] == findings.UNDERPOWERED
    line = seeds.effect_line(kept, 3)
    assert line == (
        "R_single: shows at 2 of 3 seeds; effect on the paper's side at 2 of 3; "
        "mean -0.010 [-0.264, +0.244] across 2 seeds; across-seed verdict: underpowered"
    )


def test_seeds_md_lines(out):
    path = seeds.write_across_seeds(out, SEEDS)
    assert path == out / seeds.SEEDS_MD
    lines = path.read_text().splitlines()
    assert lines[0] == "# Findings across seeds 0, 7, 13"
    assert f"- seed 0: {machine.describe(MACHINE_A)}" in lines
    assert f"- seed 7: {machine.describe(MACHINE_A)} then {machine.describe(MACHINE_B)}" in lines
    assert "- seed 13: not recorded" in lines
    assert (
        "Test CPU A (GenuineIntel family 6 model 1 stepping 1; avx2 fma; 2 cores, x86_64)"
        in (lines[lines.index("- seed 0: " + machine.describe(MACHINE_A))])
    )
    assert "jax 0.0.1, jaxlib 0.0.2" in machine.describe(MACHINE_A)
    header = (
        "| Paper headline | Checked on | Effect | seed 0 | seed 7 | seed 13 | Across seeds "
        "(mean [95% interval]) | On the paper's side | Shows at | Across-seed verdict |"
    )
    table = lines[lines.index(header) :]
    assert table[2] == (
        f"| {findings.PASS_AT_K} | GRPO | lead at k = 1 | +1.0 pt (underpowered) | "
        "+3.0 pt (shows) | +5.0 pt (underpowered) | +3.0 pt [-2.0, +8.0] | 3 of 3 | 1 of 3 | "
        "**underpowered** |"
    )
    assert table[3] == (
        f"| {findings.FULL_BUDGET_DYNAMICS} | grpo | R_multi | +0.500 (shows) | +0.600 (shows) "
        "| +0.700 (shows) | +0.600 [+0.352, +0.848] | 3 of 3 | 3 of 3 | **shows** |"
    )
    assert table[4] == (
        f"| {findings.FULL_BUDGET_DYNAMICS} | grpo | R_single | -0.100 (shows) | "
        "+0.020 (does not show) | -0.040 (underpowered) | -0.040 [-0.189, +0.109] | 2 of 3 | "
        "1 of 3 | **underpowered** |"
    )
    assert table[5] == (
        f"| {findings.ERROR_RECOVERY} | - | - | not measured | not measured | not measured "
        "| - | - | 0 of 3 | **not measured** |"
    )
    assert table[6] == (
        f"| {findings.BUDGETMIX_DYNAMICS} | budgetmix | R_single | -0.030 (shows) | "
        "+0.010 (shows) | - | -0.010 [-0.264, +0.244] (2 seeds) | 2 of 3 | 2 of 3 | "
        "**underpowered** |"
    )
    assert (
        f"| {findings.PASS_AT_K} | GRPO | **underpowered** | **shows** | **underpowered** | "
        "1 of 3 |"
    ) in lines
    assert (
        f"- **{findings.PASS_AT_K}** (GRPO): seed 0: GRPO observed; seed 7: GRPO observed; "
        "seed 13: GRPO observed"
    ) in lines
    assert (
        "  - lead at k = 1: shows at 1 of 3 seeds; effect on the paper's side at 3 of 3; "
        "mean +3.0 pt [-2.0, +8.0] across seeds; across-seed verdict: underpowered"
    ) in lines
    assert (
        f"- **{findings.BUDGETMIX_DYNAMICS}** (budgetmix): seed 0: budgetmix observed; "
        "seed 7: budgetmix observed; seed 13: not run"
    ) in lines


def test_seeds_json_round_trip(out):
    seeds.write_across_seeds(out, SEEDS)
    summary = seeds.read_across_seeds(out)
    assert summary == seeds.summarize(out, SEEDS)
    assert summary["seeds"] == [0, 7, 13]
    assert summary["machines"] == {"0": [MACHINE_A], "7": [MACHINE_A, MACHINE_B], "13": []}
    lead = _effect(_row(summary["findings"], findings.PASS_AT_K), "lead at k = 1")
    assert lead["mean"] == pytest.approx(0.03) and lead["paper_side"] == [0, 7, 13]


def test_the_report_of_a_multi_seed_run_leads_with_the_table(out):
    table = seeds.write_across_seeds(out, SEEDS).read_text()
    (seeds.seed_folder(out, 13) / "report.md").unlink()
    path = seeds.write_seeds_report(out, SEEDS)
    assert path == out / "report.md"
    text = path.read_text()
    assert text.startswith(table)  # the findings across seeds first, as in seeds.md
    links = text[len(table) :].splitlines()
    assert links == [
        "",
        "## Each seed's report",
        "",
        "- seed 0: [report.md](seed_0/report.md), [report.html](seed_0/report.html)",
        "- seed 7: [report.md](seed_7/report.md)",
        "- seed 13: no report yet",
    ]


def test_a_folder_holding_a_run_of_its_own_keeps_its_report(out):
    (out / "config.yaml").write_text("task: {}\n")
    (out / "report.md").write_text("the single run's report\n")
    assert seeds.write_seeds_report(out, SEEDS) is None
    assert (out / "report.md").read_text() == "the single run's report\n"


def test_a_seed_without_findings_is_a_clear_error(out):
    (seeds.seed_folder(out, 13) / findings.FINDINGS_JSON).unlink()
    message = r"seed_13/findings\.json is missing \(the seed-13 run has not finished its report\)"
    for write in (seeds.write_across_seeds, seeds.write_seeds_report):
        with pytest.raises(FileNotFoundError, match=message):
            write(out, SEEDS)
    assert not (out / seeds.SEEDS_MD).exists() and not (out / "report.md").exists()


def test_the_cli_prints_the_table_and_the_report(tmp_path, monkeypatch):
    """``reproduce --seeds``: after the seeds' runs, the paths of ``seeds.md`` and of the
    ``report.md`` that leads with it."""
    from typer.testing import CliRunner

    import agentrl_jax.reproduce.pipeline as pipeline
    from agentrl_jax.cli import app

    def fake_reproduce(settings, folder, **kwargs):  # writes the findings a run would
        seed = settings.rl.seed
        findings.write_findings(folder, _seed_findings(seed)[:1])
        (folder / "report.md").write_text("")
        return folder / "report.md"

    monkeypatch.setattr(pipeline, "reproduce", fake_reproduce)
    args = ["reproduce", "frozenlake", "--out", str(tmp_path)]
    for seed in (0, 7):
        args += ["--seeds", str(seed)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert f"Findings across seeds: {tmp_path / 'seeds.md'}" in result.output
    assert f"Report across seeds: {tmp_path / 'report.md'}" in result.output
    report = (tmp_path / "report.md").read_text()
    assert report.startswith("# Findings across seeds 0, 7")
    assert "| +1.0 pt (underpowered) | +3.0 pt (shows) | +2.0 pt [-10.7, +14.7] |" in report


def test_the_stored_three_seed_study_recomputes_from_its_seeds_findings():
    """``notebooks/results_cpu_seeds``: the cross-seed table (``seeds.json``, ``seeds.md``)
    is what the three stored seeds' ``findings.json`` and ``phases.json`` give, and each seed's
    budget-presentation and splice verdicts recompute from its stored raw records."""
    from agentrl_jax.evaluation.analyses.presentation import check_hidden_budget
    from agentrl_jax.evaluation.analyses.splice import check_splice

    stored = Path(__file__).resolve().parents[1] / "notebooks" / "results_cpu_seeds"
    summary = seeds.summarize(stored, [0, 7, 13])
    assert json.loads((stored / seeds.SEEDS_JSON).read_text()) == json.loads(
        json.dumps(to_jsonable(summary))
    )
    assert (stored / seeds.SEEDS_MD).read_text() == seeds.seeds_markdown(summary)
    for seed in (0, 7, 13):
        folder = stored / f"seed_{seed}"
        saved = {
            (f["headline"], f["subject"]): f["verdict"]
            for f in json.loads((folder / "findings.json").read_text())
        }
        for f in check_hidden_budget(results.load_raw(folder, "presentation")) + check_splice(
            results.load_raw(folder, "splice")
        ):
            assert saved[f.headline, f.subject] == f.verdict
