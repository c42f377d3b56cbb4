"""``agentrl-jax reproduce ENV`` beyond FrozenLake: the environment studies
(agentrl_jax.reproduce.studies; what the pipeline needs of each is tests/test_study_contracts.py),
every gold plan of the Python environments played through the real environment, and a user
environment registered in this file that trains, reproduces and evaluates end to end through the
same CLI with no change to the package (``--plugin`` on this very file): the pipeline is
environment-agnostic, so this fast environment is its end-to-end test beyond FrozenLake's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

import envs
from agentrl_jax.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AdvantageOutput,
    Param,
    register_advantage,
    register_loss_term,
)
from agentrl_jax.cli import app
from agentrl_jax.prompts import BudgetPrompt
from agentrl_jax.reproduce.config import default_config, load_config
from agentrl_jax.reproduce.studies import (
    GoldDemonstrator,
    Study,
    StudyError,
    register_study,
    study_for,
)
from agentrl_jax.train.config import TaskConfig
from envs.protocol import Feedback, PythonEnv, text_key

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
WORDS = ("amber", "birch", "cedar", "delta", "ember", "fjord", "grove", "heron", "inlet", "juniper")


# ---------------------------------------------------------------- a user environment


class TwoWords(PythonEnv):
    """Say the task's two words, one per turn, in order. A wrong word is told "no" (the row
    goes on); the first right word has step quality 0.5, the second 1.0 and ends the episode."""

    name, t_max = "two-words", 4

    def __init__(self, pairs):
        self.pairs = tuple(pairs)

    def instructions(self) -> str:
        return "Say the two words you are shown, one per turn, in order."

    def num_tasks(self) -> int:
        return len(self.pairs)

    def first_observation(self, task_id: int) -> str:
        return "Words: {} {}".format(*self.pairs[task_id])

    def reset_task(self, task_id: int, seed: int):
        return {"task": int(task_id), "said": 0}, self.first_observation(task_id)

    def step_task(self, row_state, response: str):
        want = self.pairs[row_state["task"]][row_state["said"]]
        if response.strip() != want:
            return row_state, Feedback("no", quality=0.0)
        row_state = {**row_state, "said": row_state["said"] + 1}
        done = row_state["said"] == 2
        return row_state, Feedback(
            "yes", reward=float(done), done=done, success=done, quality=0.5 * row_state["said"]
        )

    def state_key(self, row_state) -> int:
        return text_key(row_state["task"], row_state["said"])

    def demonstration(self, task_id: int) -> list[str]:
        return list(self.pairs[task_id])


def make_two_words(*, split: str | None = None, limit: int | None = None) -> envs.EnvTasks:
    """Pairs of consecutive words; ``split`` "train" the even pairs, "test" the odd ones."""
    pairs = [(WORDS[i], WORDS[(i + 1) % len(WORDS)]) for i in range(len(WORDS))]
    if split is not None:
        pairs = pairs[{"train": 0, "test": 1}[split] :: 2]
    pairs = pairs[:limit]
    return envs.python_env(TwoWords(pairs), [" ".join(p) for p in pairs], np.full(len(pairs), 2))


class TwoWordsStudy(Study):
    records_quality = True  # R_single from TurnResult.quality


if "two_words" not in envs.names():  # imported once by pytest, maybe again as a --plugin
    envs.register(
        "two_words",
        make_two_words,
        label="Two words",
        max_response_tokens=8,
        max_context=256,
    )
    register_study("two_words", TwoWordsStudy)


# ... and, from the same file, an advantage estimator and a loss term of the user's own
if "test_centered" not in ADVANTAGE_ESTIMATORS:

    @register_advantage("test_centered", required=("rewards", "group_ids"))
    def _centered(inputs):
        """Each trajectory's reward minus its group's mean, on every sampled token."""
        same = inputs.group_ids[:, None] == inputs.group_ids[None, :]
        mean = (same * inputs.rewards[None, :]).sum(1) / same.sum(1)
        return AdvantageOutput((inputs.rewards - mean)[:, None] * inputs.loss_mask, None)

    @register_loss_term(
        "test_drift",
        required=("logprobs", "old_logprobs"),
        params={"scale": Param(1.0, lambda v: isinstance(v, float) and v > 0, "a float > 0")},
    )
    def _drift(inputs, scale):
        """A squared penalty on the log-ratio to the sampling policy."""
        return scale * (inputs.logprobs - inputs.old_logprobs) ** 2


# ---------------------------------------------------------------- the gold demonstrator


def _context(observation: str, replies=(), remaining: int = 4) -> str:
    """A Qwen3-style context: the first message, earlier replies (think blocks included)."""
    text = f"<|im_start|>user\n[REMAINING TURNS] {remaining}\n{observation}<|im_end|>\n"
    for reply in replies:
        text += f"<|im_start|>assistant\n<think>\n\n</think>\n\n{reply}<|im_end|>\n"
        remaining -= 1
        text += f"<|im_start|>user\n[REMAINING TURNS] {remaining}\nno<|im_end|>\n"
    return text + "<|im_start|>assistant\n"


def test_the_gold_demonstrator_follows_the_plan_and_skips_to_the_end_when_short_of_turns():
    demo = GoldDemonstrator({"task A": ["a1", "a2", "a3"], "task B": ["b1"]}, mistake_rate=0.0)
    assert demo.reply(_context("task A")) == "a1"
    assert demo.reply(_context("task A", ["a1"], remaining=4)) == "a2"
    assert demo.reply(_context("task A", ["a1", "a2"], remaining=4)) == "a3"
    assert demo.reply(_context("task A", ["x"], remaining=4)) == "a1"  # "x" did not advance it
    # budget-aware: with 2 turns left and 3 steps to go, it starts at the second step
    assert demo.reply(_context("task A", remaining=2)) == "a2"
    assert demo.reply(_context("task A", remaining=1)) == "a3"
    assert demo.reply(_context("task B")) == "b1"
    assert demo(["task A", "task B"], np.array([False, True])) == ["", "b1"]
    with pytest.raises(StudyError, match="no task it has a plan for"):
        demo.reply(_context("task C"))


def test_mistakes_are_another_tasks_reply_at_the_rate_asked():
    plans = {f"task {i}": [f"q{i}", f"s{i}"] for i in range(5)}
    demo = GoldDemonstrator(plans, mistake_rate=0.3, seed=1)
    replies = [demo.reply(_context("task 2")) for _ in range(4000)]
    wrong = [r for r in replies if r != "q2"]
    assert set(wrong) <= {"q0", "q1", "q3", "q4"}  # the same step of other tasks
    assert abs(len(wrong) / len(replies) - 0.3) < 0.03
    assert demo.mistakes == len(wrong) and demo.moves == len(replies)


def test_a_study_refuses_what_it_cannot_do():
    tasks = make_two_words()
    study = Study()
    with pytest.raises(envs.EnvOptionError, match="set from the task section"):
        envs.entry("two_words").check_options({"split": "train"})
    same = envs.python_env(TwoWords([("a", "b"), ("a", "c")]), ["x", "y"])
    same.env.env.reset_task = lambda task_id, seed: ({}, "Words?")  # both tasks open alike
    with pytest.raises(StudyError, match="cannot tell them apart"):
        study.demonstrator(same, [0, 1], t_max=4, mistake_rate=0.0, seed=0)
    assert study.demonstrable(same, [0, 1]).tolist() == []  # the pipeline demonstrates neither
    np.testing.assert_array_equal(study.demonstrable(tasks, np.arange(10)), np.arange(10))
    without = envs.python_env(
        type("NoGold", (TwoWords,), {"demonstration": None})([("a", "b")]), ["x"]
    )
    with pytest.raises(StudyError, match="no demonstration"):
        study.plan(without, 0)
    for t in (tasks, same, without):
        t.close()


# ---------------------------------------------------------------- the SQL study


def test_the_bundled_sql_questions_split_in_two_disjoint_halves():
    train, test = envs.make("sql", split="train"), envs.make("sql", split="test")
    every = envs.make("sql")
    try:
        assert set(train.names).isdisjoint(test.names)
        assert sorted(train.names + test.names) == sorted(every.names)
        assert min(len(train.names), len(test.names)) >= 5
        entry = envs.entry("sql")
        plan = study_for(entry.name).plan(train, 0)
        gold = train.env.env.tasks[0].gold_query.strip()
        assert plan == [f"<sql>{gold}</sql>", f"<submit>{gold}</submit>"]
    finally:
        for t in (train, test, every):
            t.close()


@pytest.mark.parametrize("name", ["sql", "code", "bfcl"])
def test_each_environments_default_is_its_study_over_the_classes(name):
    config = default_config(name)
    assert config.task.env == name
    assert config.task.t_max == study_for(name).config_defaults["task"]["t_max"]
    # the CPU base every environment's default starts from
    assert config.rl.optimizer.learning_rate == 1e-3 and config.rl.preset_params["kl_coef"] == 0.05


@pytest.mark.parametrize("name, t_max, tasks", [("sql", 10, 100), ("code", 10, 6), ("bfcl", 24, 6)])
def test_every_gold_plan_solves_its_task_in_the_real_environment(name, t_max, tasks):
    """The warm start's demonstrator without mistakes, through the real rollout and
    environment: every task succeeds, in the turns its plan takes (BFCL: the structural bound)."""
    import jax

    from agentrl_jax.models.small_tokenizer import build_small_tokenizer
    from agentrl_jax.rollout import MultiTurnRollout, RolloutConfig
    from agentrl_jax.sampling import ScriptedPolicy

    entry = envs.entry(name)
    task = TaskConfig(env=name, t_max=t_max)
    loaded = study_for(entry.name).tasks(task, split="train", count=tasks)
    try:
        ids = np.arange(len(loaded.names))
        corpus = study_for(entry.name).corpus(loaded, ids, t_max=t_max, prompt=BudgetPrompt())
        tokenizer = build_small_tokenizer(
            corpus, vocab_size=1024
        )  # word-split: ~1 s (BFCL: ~50 s unsplit)
        demo = study_for(entry.name).demonstrator(
            loaded, ids, t_max=t_max, mistake_rate=0.0, seed=0
        )
        runner = MultiTurnRollout(
            loaded.env,
            tokenizer,
            RolloutConfig(group_size=1, budget=t_max, max_response_tokens=512, max_context=16384),
        )
        result = runner(ScriptedPolicy(tokenizer, demo), ids, jax.random.key(0))
        trajectory = jax.device_get(result.trajectory)
        failed = np.flatnonzero(~np.asarray(trajectory.success))
        if failed.size:  # say which task, at which turn, refused what (it once failed under load)
            row = int(failed[0])
            valid = np.asarray(trajectory.action_valid)[row]
            used = int(trajectory.turns_used[row])
            shown = tokenizer.decode(
                np.asarray(trajectory.tokens)[row][np.asarray(trajectory.token_mask)[row]][-600:]
            )
            pytest.fail(
                f"{name}: {failed.size} of {len(ids)} gold plans failed; first: task "
                f"{loaded.names[row]!r} after {used} turns (valid actions {valid[:used]}, "
                f"overflow {bool(trajectory.overflow[row])}), responses "
                f"{result.responses[row]!r}; the conversation's end: {shown!r}"
            )
        plans = [len(study_for(entry.name).plan(loaded, t)) for t in ids]
        np.testing.assert_array_equal(trajectory.turns_used, plans)
        if loaded.min_turns is not None:
            np.testing.assert_array_equal(trajectory.turns_used, loaded.min_turns)
        if study_for(entry.name).records_quality:  # the code env's step quality: all tests pass
            np.testing.assert_array_equal(np.asarray(trajectory.step_quality)[:, 0], 1.0)
    finally:
        loaded.close()


# ---------------------------------------------------------------- a user environment, end to end


@pytest.mark.slow
def test_a_user_environment_estimator_and_loss_train_and_evaluate_through_the_cli(tmp_path):
    """This file, given as a --plugin, registers an environment (two_words), an advantage
    estimator (test_centered) and a loss term (test_drift): with no change to the package,
    ``agentrl-jax train`` trains a run composed of them on that environment, ``agentrl-jax
    reproduce`` goes on from the trained folder to the evaluation and report, and
    ``agentrl-jax eval`` evaluates the folder again, at its own settings, to the same bytes."""
    config = tmp_path / "two_words.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "task": {
                    "env": "two_words",
                    "t_max": 4,
                    "train_tasks": 5,
                    "eval_tasks": 5,
                    "max_response_tokens": 8,
                    "max_context": 256,
                },
                "model": {
                    "hidden_size": 32,
                    "intermediate_size": 64,
                    "num_hidden_layers": 1,
                    "num_attention_heads": 2,
                    "num_key_value_heads": 1,
                    "head_dim": 16,
                    "tokenizer_vocab": 400,
                },
                "warm_start": {"demo_tasks": 5, "demos_per_task": 8, "epochs": 2, "batch_size": 8},
                "rl": {
                    "runs": [
                        "grpo",
                        {
                            "name": "mine",
                            "label": "Centered, drift",
                            "algorithm": {
                                "advantage": "test_centered",
                                "loss_terms": [
                                    "policy_clip",
                                    {"name": "test_drift", "coef": 0.5, "params": {"scale": 2.0}},
                                ],
                            },
                        },
                    ],
                    "steps": 2,
                    "tasks_per_step": 2,
                    "group_size": 4,
                },
                "eval": {
                    "samples": 2,
                    "k": 2,
                    "pass_k_samples": 2,
                    "likelihood_samples": 1,
                    "max_response_tokens": 8,
                    "max_context": 256,
                },
            }
        )
    )
    out = tmp_path / "out"
    common = ["--plugin", __file__, "--config", str(config), "--out", str(out), "--no-progress"]
    result = CliRunner().invoke(app, ["train", *common])
    assert result.exit_code == 0, result.output
    assert (out / "models" / "mine" / "config.json").is_file() and not (out / "report.md").exists()
    logged = [
        json.loads(x) for x in (out / "runs" / "mine" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in logged] == [1, 2]
    assert all(r["loss/test_drift"] >= 0 and np.isfinite(r["loss"]) for r in logged)
    phases = json.loads((out / "phases.json").read_text())
    assert list(phases)[-1] == "train:mine" and phases["demos"]["success_rate"] > 0.3

    result = CliRunner().invoke(app, ["reproduce", "two_words", *common])
    assert result.exit_code == 0, result.output
    phases = json.loads((out / "phases.json").read_text())
    assert phases["train:mine"]["resumed_from_step"] == 0 and "report" in phases  # not redone
    report = (out / "report.md").read_text()
    assert report.startswith("# Two words reproduction") and "Centered, drift" in report
    assert "5 train tasks, 5 test tasks (disjoint splits)" in report
    logged = [
        json.loads(x) for x in (out / "runs" / "grpo" / "metrics.jsonl").read_text().splitlines()
    ]
    assert all(0.0 <= r["R_single"] <= 1.0 for r in logged)  # the recorded step quality
    plugins = json.loads((out / "plugins.json").read_text())["plugins"]
    assert [Path(p["file"]).name for p in plugins] == [Path(__file__).name]

    again = tmp_path / "again"
    result = CliRunner().invoke(
        app, ["eval", str(out), "--plugin", __file__, "--analysis", "passk", "--out", str(again)]
    )
    assert result.exit_code == 0, result.output
    assert "Evaluating base, GRPO, Centered, drift on Two words, T_max 4" in result.output
    assert (again / "raw" / "passk.json").read_bytes() == (out / "raw" / "passk.json").read_bytes()


def test_a_config_for_another_environment_is_refused(tmp_path):
    result = CliRunner().invoke(
        app,
        [
            "reproduce",
            "frozenlake",
            "--config",
            str(CONFIGS / "sql_ci.yaml"),
            "--out",
            str(tmp_path / "x"),
        ],
    )
    assert result.exit_code != 0
    assert _squeezed("sets task.env: sql, but this command reproduces frozenlake") in _squeezed(
        result.output
    )
    result = CliRunner().invoke(app, ["reproduce", "chess", "--out", str(tmp_path / "y")])
    assert result.exit_code != 0 and _squeezed("unknown environment 'chess'") in _squeezed(
        result.output
    )


def _squeezed(text: str) -> str:
    """``text`` without whitespace and the error box's frame (rich wraps long lines)."""
    return "".join(c for c in text if not c.isspace() and c not in "│╭╮╰╯─")


@pytest.mark.parametrize("name, t_max", [("sql", 10), ("code", 10), ("bfcl", 24)])
def test_the_paper_configs_of_the_other_environments_hold_the_papers_settings(name, t_max):
    """configs/<env>_qwen3_4b_gpu.yaml: the paper's T_max (§2) and G 16 (§4), a pretrained
    local Qwen3 as the base (no warm start), every test task evaluated."""
    config = load_config(CONFIGS / f"{name}_qwen3_4b_gpu.yaml")
    assert (config.task.env, config.task.t_max, config.rl.group_size) == (name, t_max, 16)
    assert config.model.model_dir is not None and not config.warm_start.enabled
    assert (config.rl.optimizer.learning_rate, config.rl.preset_params["kl_coef"]) == (1e-6, 0.001)
    assert (
        config.eval.k == 8
        and config.eval.sampling.temperature == 0.6
        and config.eval.sampling.top_p == 0.9
    )
