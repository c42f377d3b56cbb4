"""The evaluation of several policies by the registered analyses (agentrl_jax.evaluation:
analyses.context, raw, full_report, findings).

Scripted FrozenLake agents with known outcomes play on deterministic 4x4 maps: a Q*-greedy
agent ("GRPO") succeeds exactly when the shortest path (breadth-first search here) fits the
budget, acts optimally at every state, and recovers from an error state exactly when the
distance left fits the turns left. Table 1 is recomputed by hand (math.comb) from the saved
counts and read back from report.md; the findings' verdicts are checked on synthetic raw
results whose verdicts are known by construction; tiny random Qwen3 models check the
likelihood wiring against the log-probs the sampler recorded."""

from __future__ import annotations

import collections
import csv
import dataclasses
import json
import math
import struct
import zlib
from pathlib import Path

import jax
import numpy as np
import pytest
from eval_helpers import QStarAgent, frozenlake_corpus
from flax import nnx
from markdown_it import MarkdownIt
from markdown_tables import first_table

from agentrl_jax.evaluation import findings, full_report, passt, verdicts
from agentrl_jax.evaluation import raw as raw_results
from agentrl_jax.evaluation import report as eval_report
from agentrl_jax.evaluation.analyses import context, error_recovery, pass_at_k, registry
from agentrl_jax.evaluation.analyses.context import analysis_units, run_analysis
from agentrl_jax.evaluation.config import EvalConfig
from agentrl_jax.models import Qwen3Config, Qwen3ForCausalLM
from agentrl_jax.models.small_tokenizer import build_small_tokenizer
from agentrl_jax.reproduce.studies.frozenlake.diagnostics import QStarStates
from agentrl_jax.sampling import SamplerPolicy, ScriptedPolicy
from agentrl_jax.sampling.config import EngineConfig
from envs.frozenlake import grid
from envs.frozenlake import maps as fl_maps
from envs.frozenlake.text_env import FrozenLakeTextConfig, FrozenLakeTextEnv

T_MAX = 6
TASKS = 6
NAMES = ("base", "GRPO", "BudgetMix GRPO")
SETTINGS = EvalConfig(
    budgets=None,
    samples=4,
    k=2,
    pass_k_samples=4,
    states=8,
    group_size=2,
    source_samples=2,
    depth_bins=3,
    max_response_tokens=16,
    max_context=512,
)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tokenizer():
    return build_small_tokenizer(frozenlake_corpus(range(1, T_MAX + 1)), vocab_size=600)


@pytest.fixture(scope="module")
def env():
    maps = fl_maps.generate(jax.random.key(0), TASKS, size=4, p=0.9, random_start_goal=True)
    return FrozenLakeTextEnv(np.asarray(maps), FrozenLakeTextConfig(t_max=T_MAX, is_slippery=False))


def bfs_distance(tiles: np.ndarray, cell: int) -> float:
    """Fewest deterministic moves from ``cell`` to the goal, never through a hole (inf if none)."""
    n = tiles.shape[0]
    flat = tiles.reshape(-1)
    seen, frontier = {cell: 0}, collections.deque([cell])
    while frontier:
        here = frontier.popleft()
        if flat[here] == grid.GOAL:
            return float(seen[here])
        if flat[here] == grid.HOLE:
            continue
        row, col = divmod(here, n)
        for dr, dc in ((0, -1), (1, 0), (0, 1), (-1, 0)):
            r, c = min(max(row + dr, 0), n - 1), min(max(col + dc, 0), n - 1)
            if r * n + c not in seen:
                seen[r * n + c] = seen[here] + 1
                frontier.append(r * n + c)
    return math.inf


def start_distances(env) -> np.ndarray:
    return np.array(
        [bfs_distance(m, int(np.flatnonzero(m.reshape(-1) == grid.START)[0])) for m in env.maps]
    )


def write_log(path: Path, r_multi, r_single) -> Path:
    path.write_text(
        "".join(
            json.dumps({"step": i, "R_multi": m, "R_single": s}) + "\n"
            for i, (m, s) in enumerate(zip(r_multi, r_single))
        )
    )
    return path


def check_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100 and height > 100, path
    assert path.with_suffix(".pdf").read_bytes()[:5] == b"%PDF-"


# ---------------------------------------------------------------- settings and names


def test_settings_are_validated_naming_the_field():
    for bad, field in (
        ({"samples": 0}, "samples"),
        ({"k": 9}, "k"),
        ({"states": 1}, "states"),
        ({"budgets": [0, 3]}, "budgets"),
        ({"budgets": "17"}, "budgets"),
        ({"sampling": {"top_p": 0.0}}, r"sampling\.top_p"),
        ({"invalid": "nan"}, "invalid"),
        ({"tasks_per_call": 0}, "tasks_per_call"),
        ({"diagnostic_tasks": 0}, "diagnostic_tasks"),
        ({"diagnostic_tasks": "32"}, "diagnostic_tasks"),
        ({"enable_thinking": 1}, "enable_thinking"),
        ({"seed": -1}, "seed"),
    ):
        with pytest.raises(ValueError, match=rf"^eval\.{field}: "):
            EvalConfig(**bad)
    settings = EvalConfig(budgets=[7, 3, 3])
    assert settings.budgets == (3, 7)
    assert settings.table_budgets(70) == (3, 7, 17, 35, 52, 70)  # the Table 1 levels added
    assert EvalConfig().table_budgets(4) == (1, 2, 3, 4)
    with pytest.raises(ValueError, match=r"eval\.budgets: must be <= T_max \(5\)"):
        settings.table_budgets(5)


def test_the_registry_holds_each_analysis_once_in_report_order():
    """One object per analysis, registered in report order; a taken or malformed name and an
    unknown analysis are refused with the names known."""
    assert registry.names() == (
        "table",
        "presentation",
        "passk",
        "steps",
        "errors",
        "splice",
        "likelihood",
        "erosion",
        "dynamics",
    )
    assert registry.pairwise() == ("steps", "errors", "splice", "likelihood", "erosion")
    assert [a.name for a in registry.analyses() if not a.needs_models] == ["dynamics"]
    table = registry.get("table")
    with pytest.raises(ValueError, match="'table' is already registered"):
        registry.register(table)
    assert registry.register(table, replace=True) is table and registry.names()[0] == "table"
    with pytest.raises(ValueError, match="analysis name: must match"):
        registry.register(type("Bad", (registry.Analysis,), {"name": "Bad name"})())
    with pytest.raises(ValueError, match="an Analysis instance"):
        registry.register("table")
    with pytest.raises(ValueError, match="unknown analysis 'tabel'; known: table, .*table"):
        registry.get("tabel")
    # a plugin's analysis draws from a stream named after itself, apart from the built-in ones
    from agentrl_jax.evaluation.drivers import STREAMS, stream_number

    assert [stream_number(s) for s in STREAMS] == list(STREAMS.values())
    number = stream_number("solved_once")
    assert number == 65536 + zlib.crc32(b"solved_once") % (2**32 - 65536) and number < 2**32
    assert number not in STREAMS.values() and stream_number("solved_twice") != number


def test_budgetmix_counterparts_from_the_runs_settings():
    """A run's BudgetMix comes from its settings, not its label: each run drawing BudgetMix
    budgets is paired with the first full-budget run of the same algorithm, whatever either is
    called; a raw record's counterparts say which policies are BudgetMix."""
    from agentrl_jax.reproduce.config import load_config

    ci = Path(__file__).parents[1] / "configs" / "frozenlake_ci.yaml"
    runs = load_config(ci).rl.resolved_runs()
    assert raw_results.counterparts_of_runs(runs) == {
        "BudgetMix GRPO": "GRPO",
        "Presentation-mixed BudgetMix GRPO": "GRPO",
    }
    grpo, mix = runs[0], runs[1]
    renamed = [dataclasses.replace(grpo, label="plain"), dataclasses.replace(mix, label="mixed")]
    assert raw_results.counterparts_of_runs(renamed) == {"mixed": "plain"}
    (gigpo,) = load_config(ci, ["rl.runs=[gigpo]"]).rl.resolved_runs()
    other = dataclasses.replace(grpo, algorithm=gigpo.algorithm)  # another algorithm
    assert raw_results.counterparts_of_runs([other, mix]) == {}
    record = {"policies": ["base", "plain", "mixed"], "counterparts": {"mixed": "plain"}}
    assert raw_results.is_budgetmix("mixed", record)
    assert not raw_results.is_budgetmix("plain", record)
    assert raw_results.counterparts(record) == {"mixed": "plain"}
    assert raw_results.counterparts({"policies": ["GRPO", "BudgetMix GRPO"]}) == {
        "BudgetMix GRPO": "GRPO"
    }


def test_budgetmix_counterparts_and_file_names():
    names = ["base", "GRPO", "BudgetMix GRPO", "GiGPO", "BudgetMix-GiGPO", "BudgetMix PPO"]
    assert raw_results.budgetmix_counterparts(names) == {
        "BudgetMix GRPO": "GRPO",
        "BudgetMix-GiGPO": "GiGPO",
    }
    assert raw_results.budgetmix_counterparts(["base", "GRPO", "BudgetMix"]) == {
        "BudgetMix": "GRPO"
    }
    # a qualifier before "BudgetMix" names a variant of the same full-budget run
    assert raw_results.budgetmix_counterparts(
        ["base", "GRPO", "BudgetMix GRPO", "Adaptive BudgetMix GRPO", "Adaptive GRPO"]
    ) == {"BudgetMix GRPO": "GRPO", "Adaptive BudgetMix GRPO": "Adaptive GRPO"}
    assert raw_results.budgetmix_counterparts(
        ["base", "GRPO", "BudgetMix GRPO", "Adaptive BudgetMix GRPO"]
    ) == {"BudgetMix GRPO": "GRPO", "Adaptive BudgetMix GRPO": "GRPO"}
    assert raw_results.slug("BudgetMix GRPO") == "budgetmix_grpo"
    with pytest.raises(ValueError, match="share file names"):
        run_analysis(
            "passk",
            "unused",
            None,
            np.arange(1),
            None,
            {"base": ScriptedPolicy(None, None), "Base": ScriptedPolicy(None, None)},
            SETTINGS,
        )
    with pytest.raises(ValueError, match="compares the base with other policies"):
        run_analysis(
            "steps",
            "unused",
            None,
            np.arange(1),
            None,
            {"base": ScriptedPolicy(None, None)},
            SETTINGS,
        )
    with pytest.raises(ValueError, match="unknown analysis 'pass'"):
        analysis_units("pass", SETTINGS, 4, 3, T_MAX)


# ---------------------------------------------------------------- scripted policies


@pytest.fixture(scope="module")
def scripted(tmp_path_factory, tokenizer, env):
    """Every analysis but likelihood on scripted agents: (results folder, units reported)."""
    out = tmp_path_factory.mktemp("scripted")

    def agent(epsilon: float, seed: int) -> ScriptedPolicy:
        return ScriptedPolicy(
            tokenizer, QStarAgent(T_MAX, epsilon=epsilon, seed=seed, is_slippery=False)
        )

    models = dict(zip(NAMES, (agent(0.6, 1), agent(0.0, 0), agent(0.2, 2))))
    steps = np.arange(10)
    logs = {
        "GRPO": write_log(out / "grpo.jsonl", 0.1 * steps, 0.5 - 0.01 * steps),
        "BudgetMix GRPO": write_log(out / "mix.jsonl", 0.1 * steps, 0.5 + 0.01 * steps),
    }
    reported = {}
    for name in registry.names():
        if name in ("likelihood", "erosion"):  # these score with the models
            continue
        done = []
        run_analysis(
            name,
            out,
            env,
            np.arange(TASKS),
            tokenizer,
            models,
            SETTINGS,
            training_logs=logs,
            progress=done.append,
            states=QStarStates(env) if name in ("steps", "errors") else None,
        )
        reported[name] = sum(done)
    return out, reported


def test_every_analysis_writes_its_files_and_reports_its_units(scripted):
    out, reported = scripted
    for name, units in reported.items():
        assert units == analysis_units(name, SETTINGS, TASKS, len(NAMES), T_MAX), name
        assert raw_results.load_raw(out, name)["analysis"] == name
        sections = full_report.read_sections(out, [name])[name]
        assert sections
        for section in sections:
            for rel in section.files + section.figures:
                assert (out / rel).is_file(), rel
            for png in section.figures:
                check_png(out / png)
    titles = [s.title for s in full_report.read_sections(out, ["steps"])["steps"]]
    assert titles == [
        "Step-level action quality on matched states: GRPO vs base",
        "Action quality vs normalised depth: GRPO vs base",
        "Step-level action quality on matched states: BudgetMix GRPO vs base",
        "Action quality vs normalised depth: BudgetMix GRPO vs base",
    ]


def test_the_error_recovery_suite_tables_every_policy_from_the_raw_errors(scripted):
    out, _ = scripted
    suite = full_report.read_sections(out, ["errors"])["errors"][-1]
    assert suite.title == "Error-recovery suite"
    saved = json.loads((out / error_recovery.ERROR_RECOVERY_JSON).read_text())
    assert saved["suite"] == error_recovery.SUITE and list(saved["rows"]) == list(NAMES[1:])
    assert error_recovery.ErrorRecovery.from_json(saved) == error_recovery.compute(
        raw_results.load_raw(out, "errors")
    )
    assert list(first_table(suite.markdown)[1]) == list(NAMES[1:])


def test_diagnostic_tasks_cap_every_analysis_but_the_table(tmp_path, tokenizer, env):
    settings = dataclasses.replace(SETTINGS, diagnostic_tasks=2)
    models = {
        "base": ScriptedPolicy(
            tokenizer, QStarAgent(T_MAX, epsilon=0.5, seed=1, is_slippery=False)
        ),
        "GRPO": ScriptedPolicy(tokenizer, QStarAgent(T_MAX, is_slippery=False)),
    }
    # each analysis declares its tasks: Table 1 (and Pass@T) every task, the presentation and
    # the splice their own counts, the others the first diagnostic_tasks
    counts = {"table": TASKS, "presentation": settings.presentation_tasks}
    counts["splice"] = settings.splice_tasks
    every = np.arange(TASKS)
    for name in registry.names():
        count = min(TASKS, counts.get(name, settings.diagnostic_tasks))
        assert list(registry.get(name).tasks(settings, every)) == list(range(count)), name
    for name, tasks in (("table", TASKS), ("passk", 2)):
        done = []
        run_analysis(
            name,
            tmp_path,
            env,
            np.arange(TASKS),
            tokenizer,
            models,
            settings,
            progress=done.append,
            states=QStarStates(env) if name in ("steps", "errors") else None,
        )
        assert raw_results.load_raw(tmp_path, name)["task_ids"] == list(range(tasks))
        assert sum(done) == analysis_units(name, settings, TASKS, 2, T_MAX)
    assert analysis_units("passk", settings, TASKS, 2, T_MAX) == analysis_units(
        "passk", SETTINGS, 2, 2, T_MAX
    )


def test_an_optimal_policy_meets_the_structural_bound_exactly(scripted, env):
    out, _ = scripted
    distance = start_distances(env)
    record = raw_results.load_raw(out, "table")
    assert record["levels"] == [1, 3, 4, 6] and record["budgets"] == [1, 2, 3, 4, 5, 6]
    for budget in record["budgets"]:  # deterministic maps: greedy succeeds iff d <= T
        n, c = raw_results.budget_counts(record, "GRPO")[budget]
        np.testing.assert_array_equal(c, np.where(distance <= budget, n, 0))
    curves = json.loads((out / "pass_at_t.json").read_text())
    bound = dict(
        zip(curves["structural_bound"]["budget"], curves["structural_bound"]["share_solvable"])
    )
    assert curves["curves"]["GRPO"]["pass"] == [bound[b] for b in record["budgets"]]
    table = raw_results.table1_from_results(out)
    assert table["GRPO"] == {t: float(np.mean(distance <= t)) for t in (1, 3, 4, 6)}
    passk_record = raw_results.load_raw(out, "passk")
    np.testing.assert_array_equal(
        passk_record["counts"]["GRPO"]["c"], np.where(distance <= T_MAX, SETTINGS.pass_k_samples, 0)
    )


def test_table1_is_recomputed_from_the_saved_counts(scripted):
    out, _ = scripted
    record = json.loads((out / "raw" / "table.json").read_text())

    def hand(n: int, c: int, k: int) -> float:
        return 1.0 - math.comb(n - c, k) / math.comb(n, k)

    by_hand = {
        p: {
            t: [
                hand(n, c, record["k"])
                for n, c in zip(record["counts"][p][str(t)]["n"], record["counts"][p][str(t)]["c"])
            ]
            for t in record["levels"]
        }
        for p in NAMES
    }
    table = raw_results.table1_from_results(out / "raw" / "table.json")
    assert list(table) == list(NAMES)
    for policy in NAMES:
        for t in record["levels"]:
            assert table[policy][t] == pytest.approx(np.mean(by_hand[policy][t]), abs=1e-12)

    # The report's Table 1 shows exactly these numbers (and the differences in points).
    path = full_report.write_report(out, header_markdown="## Run\n\nscripted agents")
    text = path.read_text()
    header, shown = first_table(text[text.index("## Table 1") :])
    assert header == ["Pass@2 (%)", "25% (T=1)", "50% (T=3)", "75% (T=4)", "100% (T=6)"]
    assert len(shown) == 6  # 3 policies, 3 differences
    for policy in NAMES:
        values = [cell.split(" ")[0] for cell in shown[policy]]
        assert values == [f"{100 * table[policy][t]:.1f}" for t in record["levels"]]
    for a, b in (("GRPO", "base"), ("BudgetMix GRPO", "base"), ("BudgetMix GRPO", "GRPO")):
        cells = shown[f"{a} - {b} (pt)"]
        for cell, t in zip(cells, record["levels"]):
            diff = np.mean(np.subtract(by_hand[a][t], by_hand[b][t]))
            assert cell.split(" ")[0] == f"{100 * diff:+.1f}", (a, b, t, cell)
    csv_rows = (out / "table1.csv").read_text().splitlines()
    assert csv_rows[0].startswith("row,kind,25% (T=1),25% (T=1) ci_low,25% (T=1) ci_high")
    assert [r.split(",")[0] for r in csv_rows[1:]] == list(shown)
    # every cell, a policy's too, is the CSV's value and 95% interval to one decimal
    for row in csv.DictReader(csv_rows):
        form = "{:+.1f}" if row["kind"] == "difference" else "{:.1f}"
        for level, cell in zip(header[1:], shown[row["row"]]):
            value, low, high = (float(row[level + s]) for s in ("", " ci_low", " ci_high"))
            assert cell == f"{form.format(value)} [{form.format(low)}, {form.format(high)}]"


def test_step_diagnostics_of_an_optimal_policy(scripted, env):
    out, _ = scripted
    steps = raw_results.load_raw(out, "steps")
    for other in NAMES[1:]:
        pair = steps["pairs"][other]
        sources = pair["states"]["source"]
        assert sources.count("base") == sources.count(other) == SETTINGS.states // 2
    pair = steps["pairs"]["GRPO"]
    best = np.max(pair["action_values"], axis=1)
    np.testing.assert_allclose(pair["quality"]["GRPO"], best, atol=1e-6)  # every action optimal
    assert np.all(np.asarray(pair["quality"]["base"]) <= best + 1e-6)

    errors = raw_results.load_raw(out, "errors")["pairs"]["GRPO"]
    states = errors["states"]
    for i, (task, pos, turn, budget) in enumerate(
        zip(states["task_id"], states["pos"], states["turn"], states["budget"])
    ):
        fits = bfs_distance(env.maps[task], pos) <= budget - turn  # greedy recovers iff it fits
        assert errors["success"]["GRPO"][i] == [fits] * SETTINGS.group_size, (i, task, pos)


def test_report_leads_with_the_findings_then_table1(scripted):
    out, _ = scripted
    path = full_report.write_report(
        out, header_markdown="## Run\n\nscripted agents on 4x4 maps", title="Tiny reproduction"
    )
    text = path.read_text()
    tokens = MarkdownIt().parse(text)
    headings = [tokens[i + 1].content for i, t in enumerate(tokens) if t.type == "heading_open"]
    assert headings[:4] == [
        "Tiny reproduction",
        "Run",
        findings.FINDINGS_TITLE,
        "Table 1: Pass@2 by budget level",
    ]
    assert headings.count(findings.FINDINGS_TITLE) == 1
    # the section opens with the count of each verdict, the table's verdicts counted
    section = text[text.index(f"## {findings.FINDINGS_TITLE}") : text.index("## Table 1")]
    summary = section.splitlines()[2]
    rows = [
        [c.strip() for c in line.strip("|").split(" | ")]
        for line in section.splitlines()[5:]
        if line.startswith("| ")
    ]  # the findings table after its header and separator lines
    assert section.splitlines()[4].startswith("| Paper headline | Checked on | Paper |")
    shown = collections.Counter(r[-1].split("**")[1] for r in rows)
    assert sum(shown.values()) == len(json.loads((out / "findings.json").read_text()))
    assert summary == (
        f"**Of {sum(shown.values())} findings: "
        + ", ".join(f"{shown[v]} {v}" for v in findings.VERDICTS)
        + ".**"
    )
    # the Pass@K finding and section name the k this run measured (1..samples per task)
    samples = raw_results.load_raw(out, "passk")["samples"]
    papers = [r[2] for r in rows if r[0] == findings.PASS_AT_K]
    assert papers and all(p.endswith(f"; this run: k = 1..{samples}") for p in papers)
    assert f"k = 1..{samples}. " in text[text.index("## Pass@K at T_max") :]
    assert "Training dynamics: start to end" in headings and "Pass@K at T_max = 6" in headings
    images = [
        c.attrs["src"]
        for t in tokens
        if t.type == "inline"
        for c in t.children
        if c.type == "image"
    ]
    assert len(images) >= 12
    for image in images:
        check_png(out / image)
    verdicts = {
        (f["headline"], f["subject"]): f["verdict"]
        for f in json.loads((out / "findings.json").read_text())
    }
    assert verdicts[(findings.FULL_BUDGET_DYNAMICS, "GRPO")] == findings.SHOWS
    assert verdicts[(findings.BUDGETMIX_DYNAMICS, "BudgetMix GRPO")] == findings.SHOWS
    assert verdicts[(findings.ERROR_RECOVERY, "GRPO")] in findings.VERDICT_ORDER
    with pytest.raises(ValueError, match="unknown analyses"):
        full_report.write_report(out, analyses=("table", "plots"))


# ---------------------------------------------------------------- findings on synthetic results


def _cycle(values, tasks: int) -> list[int]:
    return [values[i % len(values)] for i in range(tasks)]


def synthetic_results(out: Path, *, flip: bool = False) -> Path:
    """Raw results where GRPO beats base at every k, its lead grows from negative at 25% to
    positive, BudgetMix beats GRPO at 25% and 50%, continuation gains exceed the step-quality
    gains, R_single falls under GRPO and not under BudgetMix; ``flip`` swaps every role."""
    n, tasks, policies = 8, 30, ["base", "GRPO", "BudgetMix GRPO"]
    counts = {  # successes of 8 per task at T = 2, 4, 6, 8 (levels of T_max = 8)
        "base": [(3, 4, 5)] * 4,
        "GRPO": [(1, 2, 3), (3, 4, 5), (5, 6, 7), (6, 7, 8)],
        "BudgetMix GRPO": [(3, 4, 5), (5, 6, 7), (5, 6, 7), (6, 7, 8)],
    }
    passk_c = {"base": (0, 2, 3), "GRPO": (2, 4, 6), "BudgetMix GRPO": (2, 4, 6)}
    if flip:
        counts = {"base": counts["GRPO"], "GRPO": counts["base"], "BudgetMix GRPO": counts["base"]}
        passk_c = {"base": (2, 4, 6), "GRPO": (0, 2, 3), "BudgetMix GRPO": (0, 2, 3)}
    header = {
        "policies": policies,
        "base": "base",
        "t_max": 8,
        "task_ids": list(range(tasks)),
        "counterparts": {"BudgetMix GRPO": "GRPO"},
    }
    eval_report.write_json(
        raw_results.raw_path(out, "table"),
        {
            **header,
            "analysis": "table",
            "k": 2,
            "samples": n,
            "budgets": [2, 4, 6, 8],
            "levels": [2, 4, 6, 8],
            "percents": [25, 50, 75, 100],
            "counts": {
                p: {
                    t: {"n": [n] * tasks, "c": _cycle(cs, tasks)}
                    for t, cs in zip((2, 4, 6, 8), counts[p])
                }
                for p in policies
            },
        },
    )
    eval_report.write_json(
        raw_results.raw_path(out, "passk"),
        {
            **header,
            "analysis": "passk",
            "samples": n,
            "counts": {p: {"n": [n] * tasks, "c": _cycle(passk_c[p], tasks)} for p in policies},
        },
    )
    states = 50
    q_base = np.linspace(0.2, 0.8, states)
    step = np.where(np.arange(states) % 5 < 2, 0.05, -0.05)  # RL better on 40% of states
    error_step = np.where(np.arange(states) % 10 < 7, 0.05, -0.05)  # ... on 70%
    good = np.tile([True, True, True, False], (states, 1))
    bad = np.tile([True, False, False, False], (states, 1))
    pair = {"quality": {"base": q_base, "RL": q_base + step}}
    error_pair = {
        "quality": {"base": q_base, "RL": q_base + error_step},
        "success": {"base": bad, "RL": good},
    }
    if flip:
        pair["quality"] = {"base": q_base + step, "RL": q_base}
        error_pair = {
            "quality": {"base": q_base + error_step, "RL": q_base},
            "success": {"base": good, "RL": bad},
        }
    rename = lambda d, p: {("base" if k == "base" else p): v for k, v in d.items()}  # noqa: E731
    for analysis, raw_pair in (("steps", pair), ("errors", error_pair)):
        eval_report.write_json(
            raw_results.raw_path(out, analysis),
            {
                **header,
                "analysis": analysis,
                "pairs": {p: {k: rename(v, p) for k, v in raw_pair.items()} for p in policies[1:]},
            },
        )
    steps = np.arange(20)
    wiggle = 0.01 * (steps % 2)
    sign = -1 if flip else 1
    logs = {
        "GRPO": write_log(
            out / "grpo.jsonl",
            0.5 + sign * 0.02 * steps + wiggle,
            0.6 - sign * 0.005 * steps + wiggle,
        ),
        "BudgetMix GRPO": write_log(
            out / "mix.jsonl", 0.5 + 0.02 * steps + wiggle, 0.6 + sign * 0.002 * steps + wiggle
        ),
    }
    scripted = {p: ScriptedPolicy(None, None) for p in policies}
    run_analysis("dynamics", out, None, np.arange(1), None, scripted, SETTINGS, training_logs=logs)
    return out


def _verdicts(out: Path) -> dict[tuple[str, str], str]:
    return {(f.headline, f.subject): f.verdict for f in findings.check_findings(out)}


def test_findings_follow_the_numbers(tmp_path):
    shows = _verdicts(synthetic_results(tmp_path / "shows"))
    assert shows == {
        (findings.PASS_AT_K, "GRPO"): findings.SHOWS,
        (findings.PASS_AT_K, "BudgetMix GRPO"): findings.SHOWS,
        (findings.LEAD_GROWS, "GRPO"): findings.SHOWS,
        (findings.BUDGETMIX_SMALL, "BudgetMix GRPO vs GRPO"): findings.SHOWS,
        (findings.ERROR_RECOVERY, "GRPO"): findings.SHOWS,
        (findings.ERROR_RECOVERY, "BudgetMix GRPO"): findings.SHOWS,
        (findings.FULL_BUDGET_DYNAMICS, "GRPO"): findings.SHOWS,
        (findings.BUDGETMIX_DYNAMICS, "BudgetMix GRPO"): findings.SHOWS,
    }
    # every role swapped: each effect significantly the other way (refuted), except BudgetMix
    # vs GRPO, equal by construction there: every paired difference exactly 0, a CI of [0, 0]
    # whose standard error of 0 is no measure of what the run could detect: underpowered
    flipped = _verdicts(synthetic_results(tmp_path / "flipped", flip=True))
    assert flipped == {
        key: findings.UNDERPOWERED if key[0] == findings.BUDGETMIX_SMALL else findings.REFUTED
        for key in shows
    }

    found = {f.headline: f for f in findings.check_findings(tmp_path / "shows")}
    # The numbers quoted are the hand-computed ones: pass@2 with c of 8 successes is
    # 1 - C(8 - c, 2) / C(8, 2); at 25% base has c = 3, 4, 5 and GRPO c = 1, 2, 3 (cycling).
    base_25 = np.mean([1 - math.comb(8 - c, 2) / 28 for c in (3, 4, 5)])
    grpo_25 = np.mean([1 - math.comb(8 - c, 2) / 28 for c in (1, 2, 3)])
    assert found[findings.LEAD_GROWS].numbers["lead"][0] == pytest.approx(grpo_25 - base_25)
    assert f"{100 * (grpo_25 - base_25):+.1f}" in found[findings.LEAD_GROWS].observed
    assert "reverses" in found[findings.LEAD_GROWS].observed
    gain = found[findings.ERROR_RECOVERY].numbers["continuation_gain"]
    assert gain.mean == pytest.approx(0.5) and gain.low > 0

    # Two tasks: GRPO ahead at every k (1 vs 0 successes on one task, tied on the other), but
    # the CI of the smallest lead (k = 1: differences 1/8 and 0) includes no effect.
    few = {
        "policies": ["base", "GRPO"],
        "counts": {"base": {"n": [8, 8], "c": [0, 3]}, "GRPO": {"n": [8, 8], "c": [1, 3]}},
    }
    (finding,) = pass_at_k.check_pass_at_k(few)
    assert finding.verdict == findings.UNDERPOWERED and finding.numbers["weakest_k"] == 1
    assert finding.numbers["weakest_lead"].mean == pytest.approx(1 / 16)

    # Nothing run: every headline is "not measured"; the report section renders the table.
    (tmp_path / "empty").mkdir()
    empty = findings.check_findings(tmp_path / "empty")
    assert {f.verdict for f in empty} == {findings.NOT_MEASURED} and len(empty) == 6
    section = findings.write_findings(tmp_path / "empty", empty)
    table = findings.findings_markdown(empty)
    assert table.count("\n") == 2 + len(empty)
    assert section.markdown == table + "\n" + findings.VERDICT_RULE
    assert section.text == (
        "**Of 6 findings: 0 shows, 0 refuted, 0 does not show, 0 underpowered, 6 not measured.**"
    )


# ---------------------------------------------------------------- Qwen3 models


@pytest.fixture(scope="module")
def tiny_models(tokenizer):
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=1024,
    )
    return {name: Qwen3ForCausalLM(config, rngs=nnx.Rngs(seed)) for seed, name in enumerate(NAMES)}


def test_models_share_compilations_and_likelihood_scores_each_pair(
    tmp_path, tokenizer, env, tiny_models
):
    env = FrozenLakeTextEnv(env.maps, FrozenLakeTextConfig(t_max=3, is_slippery=False))
    settings = EvalConfig(
        samples=2,
        k=2,
        likelihood_samples=2,
        likelihood_rows_per_batch=4,
        max_response_tokens=4,
        max_context=256,
        seed=3,
    )
    config = settings.rollout_config()
    key = jax.random.fold_in(jax.random.key(settings.seed), 6)  # the likelihood stream
    policies = context._samplers(tiny_models, EngineConfig())
    assert isinstance(policies["base"], SamplerPolicy)
    trajectories = {}
    for name in NAMES:  # what run_analysis samples (same policies, same key)
        trajectories[name] = passt.rollout_tasks(
            env,
            tokenizer,
            policies[name],
            np.arange(2),
            key,
            budget=env.t_max,
            samples=2,
            config=config,
        )
        if name == "base":
            traces = dict(policies["base"].trace_counts)
    assert dict(policies["BudgetMix GRPO"].trace_counts) == traces  # one model's compilations

    done = []
    run_analysis(
        "likelihood",
        tmp_path,
        env,
        np.arange(2),
        tokenizer,
        tiny_models,
        settings,
        progress=done.append,
    )
    assert sum(done) == analysis_units("likelihood", settings, 2, 3, env.t_max)
    raw = raw_results.load_raw(tmp_path, "likelihood")
    assert list(raw["pairs"]) == ["GRPO", "BudgetMix GRPO"]
    for name, traj in trajectories.items():
        recorded = np.zeros(traj.turn_mask.shape)  # the sampler's log-probs, summed per turn
        rows, cols = np.nonzero(traj.loss_mask)
        np.add.at(recorded, (rows, traj.token_turn[rows, cols]), traj.logprobs[rows, cols])
        for other in NAMES[1:]:
            pair = raw["pairs"][other]
            if name in (other, "base"):  # each policy's responses under its own model
                own = pair["logp_base" if name == "base" else "logp_rl"][name]
                mask = np.asarray(pair["turn_mask"][name])
                np.testing.assert_array_equal(mask, traj.turn_mask)
                np.testing.assert_allclose(np.where(mask, own, 0.0), recorded, atol=2e-3)
    sections = full_report.read_sections(tmp_path, ["likelihood"])["likelihood"]
    assert [s.title for s in sections] == [
        "Likelihood: GRPO vs base (ActionNLL under base, cumulative LLR)",
        "Likelihood: BudgetMix GRPO vs base (ActionNLL under base, cumulative LLR)",
    ]
    for png in (p for s in sections for p in s.figures):
        check_png(tmp_path / png)

    scripted = {**tiny_models, "GRPO": ScriptedPolicy(tokenizer, QStarAgent(T_MAX))}
    with pytest.raises(ValueError, match=r"needs a Qwen3 model for every policy.*'GRPO'"):
        run_analysis("likelihood", tmp_path, env, np.arange(2), tokenizer, scripted, settings)


def test_a_run_keeps_the_paper_figures_its_findings_cite(tmp_path):
    """An environment's figures (raw/paper.json) replace the texts and the effect sizes the
    verdicts measure power against; a run without the file uses the paper's headline ones."""
    out = synthetic_results(tmp_path / "run")
    default = {f.headline: f for f in findings.check_findings(out)}
    assert (
        default[findings.FULL_BUDGET_DYNAMICS].paper
        == findings.PAPER[findings.FULL_BUDGET_DYNAMICS]
    )
    figures = findings.PaperFigures(
        texts={"full_budget_dynamics": "elsewhere: +0.3 (§7.5)"}, r_multi=100.0, r_single=100.0
    )
    figures.write(out)
    assert findings.PaperFigures.load(out) == figures
    own = {f.headline: f for f in findings.check_findings(out)}
    assert own[findings.FULL_BUDGET_DYNAMICS].paper == "elsewhere: +0.3 (§7.5)"
    assert own[findings.PASS_AT_K].paper == default[findings.PASS_AT_K].paper
    # the verdicts measure power against the run's sizes
    effects = own[findings.FULL_BUDGET_DYNAMICS].numbers["effects"]
    assert effects["R_multi"]["paper_size"] == effects["R_single"]["paper_size"] == 100.0
    assert own[findings.BUDGETMIX_DYNAMICS].numbers["effects"]["R_single"]["margin"] == 100.0
    assert (
        default[findings.FULL_BUDGET_DYNAMICS].numbers["effects"]["R_multi"]["paper_size"]
        == verdicts.FULL_BUDGET_R_MULTI
    )
    with pytest.raises(ValueError, match="unknown headlines"):
        findings.PaperFigures(texts={"lead grows": "x"})
    (out / "raw" / "paper.json").write_text('{"sizes": 1}')
    with pytest.raises(ValueError, match="not the paper's figures"):
        findings.PaperFigures.load(out)


def test_one_rule_decides_every_verdict():
    """By hand: the smallest detectable effect is 2.80 standard errors (80% power, 5% level,
    the SE read off the 95% CI); an interval including no effect is underpowered when that
    exceeds the paper's size and does not show otherwise; a headline takes its weakest effect."""
    from agentrl_jax.evaluation.stats import MeanCI
    from agentrl_jax.evaluation.verdicts import Effect, detectable, judge

    z = 1.959963984540054
    assert detectable(MeanCI(0.0, -z, z, 10)) == pytest.approx(z + 0.8416212335729143)
    # BudgetMix vs full budget at 25% and 50%: +0.0 pt [-2.0, +2.0] and +9.4 pt [-11.0, +29.7]
    # against the paper's +7.5 and +5.3 (the second was "does not show" before this rule)
    small = (
        Effect("25%", MeanCI(0.0, -0.02, 0.02, 32), size=0.075),
        Effect("50%", MeanCI(0.094, -0.110, 0.297, 32), size=0.053),
    )
    assert [judge(e) for e in small] == [findings.NOT_SHOWN, findings.UNDERPOWERED]
    assert verdicts.verdict(*small) == findings.NOT_SHOWN
    assert verdicts.verdict(small[1]) == findings.UNDERPOWERED  # 2.8 SE = 29 pt > 5.3 pt
    # error recovery: the continuation gain excludes 0, the error-vs-matched quality gain
    # does not (and the paper gives no size for it): not "shows"
    recovery = (
        Effect("continuation gain", MeanCI(0.12, 0.05, 0.19, 100), size=0.127),
        Effect("quality gain difference", MeanCI(0.01, -0.02, 0.04, 100), points=False),
    )
    assert judge(recovery[0]) == findings.SHOWS
    assert verdicts.verdict(*recovery) == findings.UNDERPOWERED
    assert judge(Effect("x", MeanCI(-0.15, -0.2, -0.1, 9))) == findings.REFUTED
    assert judge(Effect("x", MeanCI(-0.15, -0.2, -0.1, 9), direction=-1)) == findings.SHOWS
    assert judge(Effect("x", MeanCI(0.1, math.nan, math.nan, 1), size=0.5)) == findings.UNDERPOWERED
    # every difference exactly 0 (both policies fail every task): a CI of [0, 0] shows nothing,
    # neither a lead nor that a metric was kept
    assert judge(Effect("x", MeanCI(0.0, 0.0, 0.0, 11), size=0.075)) == findings.UNDERPOWERED
    assert judge(Effect("x", MeanCI(1.0, 1.0, 1.0, 11), size=0.075)) == findings.SHOWS
    # non-inferiority (BudgetMix keeps R_single): no effect = the full-budget fall of 0.091
    keeps = lambda low, high: judge(
        Effect(
            "R_single",
            MeanCI((low + high) / 2, low, high, 8),  # noqa: E731
            margin=0.091,
            points=False,
        )
    )
    assert keeps(-0.02, 0.03) == findings.SHOWS
    assert keeps(-0.12, -0.01) == findings.REFUTED
    assert keeps(-0.2, 0.05) == findings.UNDERPOWERED  # 2.8 SE = 0.18 > 0.091
    assert keeps(-0.1, 0.0) == findings.NOT_SHOWN  # 2.8 SE = 0.071 <= 0.091
    assert keeps(0.0, 0.0) == findings.UNDERPOWERED  # R_single 0 throughout: kept nothing


def test_the_verdict_rules_worked_example_is_judged_as_it_says():
    """The report's made-up example (a paper size of 10 pt, a lead of +5.2 pt) gets from
    :func:`judge` the verdicts the text gives it, with the smallest detectable effects it
    quotes; the rule names every verdict once, in bold."""
    from agentrl_jax.evaluation.findings import VERDICT_RULE, Effect, detectable, judge
    from agentrl_jax.evaluation.stats import MeanCI

    rule = " ".join(VERDICT_RULE.split())
    for low, high, verdict, quoted in (
        (0.3, 10.1, findings.SHOWS, 'A lead of +5.2 pt [+0.3, +10.1] shows "RL beats base"'),
        (-0.7, 11.1, findings.NOT_SHOWN, "A lead of +5.2 pt [-0.7, +11.1] does not show it"),
        (-6.8, 17.2, findings.UNDERPOWERED, "A lead of +5.2 pt [-6.8, +17.2] is underpowered"),
    ):
        ci = MeanCI((low + high) / 200, low / 100, high / 100, 50)
        assert judge(Effect("lead", ci, size=0.10)) == verdict, (low, high)
        assert quoted in rule
    assert "smallest detectable effect, 8.4 pt" in rule
    assert f"{100 * detectable(MeanCI(0.052, -0.007, 0.111, 50)):.1f}" == "8.4"
    assert "smallest detectable effect is 17.2 pt" in rule
    assert f"{100 * detectable(MeanCI(0.052, -0.068, 0.172, 50)):.1f}" == "17.2"
    for verdict in findings.VERDICTS:
        assert rule.count(f"- **{verdict}**:") == 1, verdict
