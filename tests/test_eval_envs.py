"""``agentrl-jax eval env-passk`` / ``env-passt`` end to end through typer on InterCode-SQL,
DeepCoder-MT and BFCL v3, with tiny Qwen3 policies written here (a small tokenizer learned from
the environment's own text) playing two tasks through the real rollout; the written JSON is
checked against what the rollouts did.

On SQL the RL policy is a Qwen3 whose weights make it a bigram model that, at every turn, either
submits the answer of task 0 (``<submit>SELECT COUNT(*) FROM books``) or says nothing (an
invalid action), each with probability 1/2; so it succeeds on task 0 with probability
1 - 2^-T and never on task 1, and the counts it writes are compared with the successes of the
same rollouts replayed outside the CLI. The base policies are random. BFCL runs on a data folder
holding two real tasks with only the functions they use, so its first message stays short.
Gold-answer replays and exact Pass@K / Pass@T values are in test_env_prompts.py."""

from __future__ import annotations

import json
from math import comb
from pathlib import Path

import jax
import numpy as np
import pytest
from env_agents import AGENTS, replay_observations
from eval_helpers import save_answering_policy, save_tiny_policy
from typer.testing import CliRunner

import envs
from agentrl_jax.cli import app
from agentrl_jax.evaluation import passk, passt
from agentrl_jax.evaluation.policies import load_policy
from agentrl_jax.models.small_tokenizer import build_small_tokenizer
from agentrl_jax.policy import SamplerPolicy
from agentrl_jax.prompts import BudgetPrompt
from envs.bfcl import package_data_dir
from envs.bfcl.data import backend_config

ANSWER = "<submit>SELECT COUNT(*) FROM books"  # task 0's answer; an unclosed tag is accepted
MAX_CONTEXT = {"sql": 2048, "code": 2048, "bfcl": 4096}
# Rollouts over 2-4k-token contexts: at -O1 (tests/conftest.py) the file runs in 129 s, not 154 s.
pytestmark = pytest.mark.optimized


def _run(*args) -> str:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, f"{args[:2]}: {result.output}\n{result.exception!r}"
    return result.output


def _tiny(name: str) -> list:
    return [
        "--tasks",
        2,
        "--max-response-tokens",
        12,
        "--max-context",
        MAX_CONTEXT[name],
        "--seed",
        0,
        "--workers",
        2,
    ]


def env_corpus(name: str, data: Path | None = None) -> list[str]:
    """The texts of the first two tasks' gold plays and the prompt around them."""
    loaded = envs.make(name, data=data, limit=2)
    env, prompt = loaded.env, BudgetPrompt()
    agent = AGENTS[name](env.env.tasks)
    texts = [prompt.system_text(env.instructions(), b) for b in (1, env.t_max)]
    texts += [prompt.turn_text("", b, t) for b in range(1, env.t_max + 1) for t in range(b)]
    for task in range(2):
        gold = [agent.gold(task, t) for t in range(agent.needed(task))]
        texts += gold + replay_observations(env.env, task, gold)
    env.close()
    return texts


def trimmed_bfcl_data(root: Path, tasks: int = 2) -> Path:
    """A folder laid out like bfcl-eval's data: the first ``tasks`` multi_turn_base tasks and
    their answers as shipped, each API's documentation cut to the functions they call."""
    source = package_data_dir()
    [questions] = source.glob("BFCL_v*_multi_turn_base.json")
    [answers] = (source / "possible_answer").glob("BFCL_v*_multi_turn_base.json")
    kept = {path: path.read_text().splitlines()[:tasks] for path in (questions, answers)}
    for path, lines in kept.items():
        target = root / path.relative_to(source)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("\n".join(lines) + "\n")
    used = {
        call.split("(")[0]
        for line in kept[answers]
        for turn in json.loads(line)["ground_truth"]
        for call in turn
    }
    apis = {api for line in kept[questions] for api in json.loads(line)["involved_classes"]}
    (root / "multi_turn_func_doc").mkdir()
    for api in apis:
        name = backend_config().MULTI_TURN_FUNC_DOC_FILE_MAPPING[api]
        docs = (source / "multi_turn_func_doc" / name).read_text().splitlines()
        (root / "multi_turn_func_doc" / name).write_text(
            "".join(
                line + "\n" for line in docs if line.strip() and json.loads(line)["name"] in used
            )
        )
    return root


def _replay(tokenizer, policy, name: str, *, stream: int, budget: int, samples: int) -> np.ndarray:
    """``[2, samples]`` successes of the rollouts the CLI played, replayed with its keys
    (stream 1: passk, 2: passt; seed 0) and its rollout settings."""
    loaded = envs.make(name, limit=2, workers=2)
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(0), stream), budget)
    config = passt.eval_rollout_config(max_response_tokens=12, max_context=MAX_CONTEXT[name])
    try:
        return passt.sample_successes(
            loaded.env,
            tokenizer,
            policy,
            np.arange(2),
            key,
            budget=budget,
            samples=samples,
            config=config,
        )
    finally:
        loaded.env.close()


def _check_pass_at_k(out: Path, samples: int) -> dict:
    """The Pass@K files: counts for both policies, curves equal to the unbiased estimator of
    those counts, monotone in k."""
    counts = json.loads((out / "pass_at_k_counts.json").read_text())
    curves = json.loads((out / "pass_at_k.json").read_text())["curves"]
    assert set(counts) == set(curves) == {"base", "RL"}
    for policy, record in curves.items():
        n, c = counts[policy]["n"], counts[policy]["c"]
        assert n == [samples, samples] and all(0 <= ci <= samples for ci in c)
        assert record["k"] == list(range(1, samples + 1))
        expected = [
            np.mean([1 - comb(ni - ci, k) / comb(ni, k) for ni, ci in zip(n, c)])
            for k in record["k"]
        ]
        np.testing.assert_allclose(record["pass_at_k"], expected)
        assert np.all(np.diff(record["pass_at_k"]) >= 0)
    return counts


@pytest.fixture(scope="module")
def sql_policies(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_sql")
    tokenizer = build_small_tokenizer(env_corpus("sql") + [ANSWER] * 8, vocab_size=768)
    return (
        save_tiny_policy(root / "base", tokenizer, seed=0),
        save_answering_policy(root / "rl", tokenizer, ANSWER),
    )


@pytest.mark.slow
def test_sql_counts_are_those_of_the_rollouts(sql_policies, tmp_path):
    base_dir, rl_dir = sql_policies
    out = tmp_path / "results"
    # 2 lanes (sql's default is 1): the counts are still those of the one-lane replays below
    common = [
        "--env",
        "sql",
        "--base",
        base_dir,
        "--rl",
        rl_dir,
        "--out",
        out,
        *_tiny("sql"),
        "--lanes",
        2,
    ]
    # Three samples in both commands: the replays below then compile one set of shapes.
    printed = _run("eval", "env-passk", *common, "--samples", 3)
    _run("eval", "env-passt", *common, "--samples", 3, "--k", 2, "--budgets", "1,3")
    _run("eval", "report", "--out", out)

    counts = _check_pass_at_k(out, samples=3)
    by_budget = json.loads((out / "pass_at_t_counts.json").read_text())
    rl = load_policy(rl_dir)
    sampler = SamplerPolicy(rl.model)
    assert (
        counts["RL"]["c"]
        == _replay(rl.tokenizer, sampler, "sql", stream=1, budget=10, samples=3)
        .sum(axis=1)
        .tolist()
    )
    curves = json.loads((out / "pass_at_t.json").read_text())["curves"]
    for budget in (1, 3):
        replayed = _replay(rl.tokenizer, sampler, "sql", stream=2, budget=budget, samples=3)
        assert by_budget["RL"][str(budget)] == {"n": [3, 3], "c": replayed.sum(axis=1).tolist()}
        for policy in ("base", "RL"):  # Pass@(2, T) is the estimator of those counts
            c = by_budget[policy][str(budget)]["c"]
            at = curves[policy]["budget"].index(budget)
            assert curves[policy]["pass"][at] == pytest.approx(
                np.mean([1 - comb(3 - ci, 2) / comb(3, 2) for ci in c])
            )
    # The answering policy solves task 0 only (1 - 2^-T per sample); the random base, nothing.
    assert counts["RL"]["c"][1] == 0 and counts["RL"]["c"][0] > 0
    assert all(v["c"][1] == 0 for v in by_budget["RL"].values())
    assert counts["base"]["c"] == [0, 0]
    assert "InterCode-SQL: Pass@K (full budget): base: pass@1 0.000" in printed

    settings = json.loads((out / "settings" / "passt.json").read_text())
    loaded = envs.make("sql", limit=2)
    loaded.env.close()
    assert (settings["env"], settings["t_max"], settings["command"]) == ("sql", 10, "env-passt")
    assert settings["task_names"] == list(loaded.names) and settings["budgets"] == "1,3"
    assert settings["lanes"] == 2
    assert set(settings["policies"]) == {"base", "RL"}
    report = (out / "report.md").read_text()
    assert "## InterCode-SQL: Pass@K (full budget)" in report
    assert "## InterCode-SQL: Pass@T at k = 2" in report and "Table 1" not in report


@pytest.mark.slow
def test_code_env_passk(tmp_path):
    tokenizer = build_small_tokenizer(env_corpus("code"), vocab_size=768)
    base = save_tiny_policy(tmp_path / "base", tokenizer, seed=0)
    rl = save_tiny_policy(tmp_path / "rl", tokenizer, seed=1)
    out = tmp_path / "results"
    _run(
        "eval",
        "env-passk",
        "--env",
        "code",
        "--base",
        base,
        "--rl",
        rl,
        "--out",
        out,
        *_tiny("code"),
        "--samples",
        2,
    )
    counts = _check_pass_at_k(out, samples=2)
    assert counts["base"]["c"] == counts["RL"]["c"] == [0, 0]  # random text is no program
    settings = json.loads((out / "settings" / "passk.json").read_text())
    assert settings["task_names"] == ["HumanEval/0", "HumanEval/1"] and settings["t_max"] == 10
    assert settings["lanes"] == 2  # code's default: its steps run tests in the sandbox
    sections = json.loads((out / "sections" / "passk.json").read_text())["sections"]
    assert sections[0]["title"] == "DeepCoder-MT: Pass@K (full budget)"


@pytest.mark.slow
def test_bfcl_env_passt_with_table_and_structural_bound(tmp_path):
    data = trimmed_bfcl_data(tmp_path / "bfcl")
    tokenizer = build_small_tokenizer(env_corpus("bfcl", data), vocab_size=768)
    base = save_tiny_policy(tmp_path / "base", tokenizer, seed=0)
    rl = save_tiny_policy(tmp_path / "rl", tokenizer, seed=1)
    out = tmp_path / "results"
    levels = passk.budget_levels(24)
    _run(
        "eval",
        "env-passt",
        "--env",
        "bfcl",
        "--data",
        data,
        "--base",
        base,
        "--rl",
        rl,
        "--out",
        out,
        *_tiny("bfcl"),
        "--samples",
        2,
        "--k",
        2,
        "--budgets",
        ",".join(map(str, levels)),
    )
    by_budget = json.loads((out / "pass_at_t_counts.json").read_text())
    assert set(by_budget) == {"base", "RL"}
    for policy in by_budget:
        assert sorted(map(int, by_budget[policy])) == list(levels)
        assert all(v == {"n": [2, 2], "c": [0, 0]} for v in by_budget[policy].values())
    record = json.loads((out / "pass_at_t.json").read_text())
    # The fewest turns: one answer ending each request, plus one calling in each annotated one.
    [questions] = data.glob("BFCL_v*_multi_turn_base.json")
    [answers] = (data / "possible_answer").glob("BFCL_v*_multi_turn_base.json")
    fewest = [
        len(json.loads(q)["question"]) + sum(map(bool, json.loads(a)["ground_truth"]))
        for q, a in zip(questions.read_text().splitlines(), answers.read_text().splitlines())
    ]
    assert record["structural_bound"]["budget"] == list(range(1, 25))
    assert record["structural_bound"]["share_solvable"] == [
        float(np.mean([f <= b for f in fewest])) for b in range(1, 25)
    ]
    table = json.loads((out / "pass_at_t_table.json").read_text())
    assert table["budgets"] == list(levels) and set(table["table"]) == {"base", "RL"}


def _fails(*args) -> str:
    result = CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "1000"})
    assert result.exit_code != 0, result.output
    return " ".join(result.output.split())


def test_bad_task_options_are_named_before_any_policy_loads(tmp_path):
    common = ["--base", tmp_path / "never-loaded", "--out", tmp_path, "--samples", 1]
    assert "--env sql takes no --category (its task options: --data, --split, --tasks)" in _fails(
        "eval", "env-passk", "--env", "sql", *common, "--category", "multi_turn_base"
    )
    assert (
        "split: must be 'train' or 'test' (a hash split of the tasks), got 'dev' (a Spider "
        "split needs data, a Spider folder)"
        in _fails("eval", "env-passk", "--env", "sql", *common, "--split", "dev")
    )
    assert "--env code takes no --category" in _fails(
        "eval", "env-passk", "--env", "code", *common, "--category", "multi_turn_base"
    )
    missing = tmp_path / "missing.jsonl"
    assert f"--env code (--data {missing}): DeepCoder task file not found" in _fails(
        "eval", "env-passk", "--env", "code", *common, "--data", missing
    )
    assert "unknown category 'nope'" in _fails(
        "eval", "env-passk", "--env", "bfcl", *common, "--category", "nope"
    )
    assert "unknown environment 'chess'; registered: frozenlake, sql, code, bfcl" in _fails(
        "eval", "env-passk", "--env", "chess", *common
    )
    # With good task options, the policy is what fails.
    assert f"{tmp_path / 'never-loaded'}: no such file" in _fails(
        "eval", "env-passt", "--env", "sql", *common, "--tasks", 1
    )
