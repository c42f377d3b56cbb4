"""The environment registry (envs.registry): built-in entries, what an entry declares and
refuses, and a user environment registered in this file that the evaluation CLI plays with no
change to the package (``--plugin`` on this very file)."""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path

import numpy as np
import pytest
from eval_helpers import save_answering_policy, save_tiny_policy
from typer.testing import CliRunner

import envs
from agentrl_jax.cli import app
from agentrl_jax.models.small_tokenizer import build_small_tokenizer
from agentrl_jax.prompts import BudgetPrompt
from envs.protocol import Feedback, PythonEnv, text_key

WORDS = ("apple", "river")  # task i is solved by a response containing WORDS[i]


class Guess(PythonEnv):
    """A user environment: guess the task's word; each wrong guess is told "no"."""

    name, t_max = "guess", 4

    def __init__(self, words):
        self.words = tuple(words)

    def instructions(self) -> str:
        return "Guess the secret word."

    def num_tasks(self) -> int:
        return len(self.words)

    def reset_task(self, task_id: int, seed: int):
        return {"task": int(task_id), "wrong": 0}, "Your guess?"

    def step_task(self, row_state, response: str):
        if self.words[row_state["task"]] in response:
            return row_state, Feedback("", reward=1.0, done=True, success=True)
        row_state = {**row_state, "wrong": row_state["wrong"] + 1}
        return row_state, Feedback("no", quality=0.0)

    def state_key(self, row_state) -> int:
        return text_key(row_state["task"], row_state["wrong"])


def make_guess(*, words=WORDS, limit=None, workers=8, step_timeout_s=60.0) -> envs.EnvTasks:
    chosen = tuple(words)[:limit]
    return envs.python_env(
        Guess(chosen),
        [f"guess {w}" for w in chosen],
        np.ones(len(chosen), np.int64),
        workers=workers,
        step_timeout_s=step_timeout_s,
    )


if "guess" not in envs.names():  # imported once by pytest, maybe again as a --plugin
    envs.register("guess", make_guess, label="Guess", max_response_tokens=6, max_context=512)


def test_the_built_in_environments_are_registered_with_their_limits():
    assert envs.names()[:4] == ("frozenlake", "sql", "code", "bfcl")
    code = envs.entry("code")
    assert (code.label, code.max_response_tokens, code.max_context, code.lanes) == (
        "DeepCoder-MT",
        1024,
        16384,
        2,
    )
    assert envs.entry("sql").options == ("data", "split", "limit", "workers", "step_timeout_s")
    assert "categories" in envs.entry("bfcl").options
    assert "isolation" in envs.entry("code").options


def _bfs_shortest(tiles: np.ndarray, start: tuple[int, int]) -> int:
    """Fewest moves from ``start`` to the goal avoiding holes (a plain BFS, independent of
    envs.frozenlake's Q* and distance code)."""
    from envs.frozenlake.grid import GOAL, HOLE

    n = tiles.shape[0]
    seen, queue = {start: 0}, deque([start])
    while queue:
        r, c = queue.popleft()
        if tiles[r, c] == GOAL:
            return seen[(r, c)]
        for dr, dc in ((0, 1), (1, 0), (0, -1), (-1, 0)):
            nxt = (r + dr, c + dc)
            if 0 <= nxt[0] < n and 0 <= nxt[1] < n and nxt not in seen and tiles[nxt] != HOLE:
                seen[nxt] = seen[(r, c)] + 1
                queue.append(nxt)
    raise AssertionError("unreachable goal")


def test_frozenlake_tasks_carry_their_shortest_paths():
    from envs.frozenlake.grid import START

    loaded = envs.make("frozenlake", limit=6, map_size=4, random_start_goal=True, t_max=12, seed=3)
    assert loaded.env.t_max == 12 and loaded.env.num_tasks() == 6
    assert loaded.names == tuple(f"test map {i}" for i in range(6))
    for tiles, fewest in zip(np.asarray(loaded.env.maps), loaded.min_turns):
        [start] = np.argwhere(tiles == START)
        assert fewest == _bfs_shortest(tiles, tuple(int(x) for x in start))
    assert envs.make("frozenlake", map_size=4, limit=2).env.num_tasks() == 2
    loaded.close()  # nothing to release: no error


def test_the_registry_and_the_study_build_the_same_frozenlake_maps():
    """One task-building path: ``envs.make`` and the reproduction's study give the same maps
    for the same seed and split (they once drew them from different streams)."""
    from agentrl_jax.reproduce.studies import study_for
    from agentrl_jax.train.config import TaskConfig

    for split in ("train", "test"):
        made = envs.make("frozenlake", split=split, seed=5, limit=4, t_max=8)
        task = TaskConfig(env="frozenlake", seed=5, t_max=8)
        study = study_for("frozenlake").tasks(task, split=split, count=4)
        np.testing.assert_array_equal(made.env.maps, study.env.maps)
        assert made.names == study.names and study.env.t_max == 8


def test_options_and_names_are_checked_before_anything_loads():
    with pytest.raises(
        envs.EnvOptionError,
        match="unknown environment 'chess'; registered: frozenlake, sql, code, bfcl",
    ):
        envs.make("chess")
    with pytest.raises(
        envs.EnvOptionError,
        match=r"environment 'sql' takes no option 'categories'; "
        r"it takes: data, split, limit, workers, step_timeout_s",
    ):
        envs.make("sql", categories=("multi_turn_base",))
    with pytest.raises(
        envs.EnvOptionError,
        match=r"split: must be 'train' or 'test' \(a hash split "
        r"of the tasks\), got 'dev' \(a Spider split needs data",
    ):
        envs.make("sql", split="dev")
    for name in ("code", "bfcl"):
        with pytest.raises(envs.EnvOptionError, match="split: must be 'train' or 'test'"):
            envs.make(name, split="validation")


def test_a_misspelt_environment_or_option_gets_the_closest_registered_one():
    with pytest.raises(envs.EnvOptionError) as error:
        envs.entry("FrozenLake")
    assert str(error.value).startswith("unknown environment 'FrozenLake'; registered: frozenlake")
    assert str(error.value).endswith("; did you mean 'frozenlake'?")
    with pytest.raises(envs.EnvOptionError, match=r"it takes: .*; did you mean 'slippery'\?$"):
        envs.check_options("frozenlake", ["slipery"])
    with pytest.raises(envs.EnvOptionError) as error:
        envs.make("xyzzy")
    assert "did you mean" not in str(error.value)


def test_register_refuses_what_it_cannot_serve():
    with pytest.raises(envs.EnvOptionError, match="'guess' is already registered"):
        envs.register("guess", make_guess, label="x", max_response_tokens=1, max_context=8)
    with pytest.raises(envs.EnvOptionError, match="must be an identifier"):
        envs.register("two words", make_guess, label="x", max_response_tokens=1, max_context=8)
    with pytest.raises(envs.EnvOptionError, match="max_context must be an int >= 1, got 0"):
        envs.register("other", make_guess, label="x", max_response_tokens=1, max_context=0)
    with pytest.raises(envs.EnvOptionError, match="lanes must be an int >= 1, got True"):
        envs.register(
            "other", make_guess, label="x", max_response_tokens=1, max_context=8, lanes=True
        )
    assert "other" not in envs.names()
    envs.register(
        "wrong_type", lambda: "not tasks", label="x", max_response_tokens=1, max_context=8
    )
    with pytest.raises(TypeError, match="returned str, not EnvTasks"):
        envs.make("wrong_type")
    with pytest.raises(ValueError, match="1 task names for 2 tasks"):
        envs.EnvTasks(Guess(WORDS), ("one",))
    with pytest.raises(ValueError, match=r"min_turns: shape \(3,\), expected \(2,\)"):
        envs.EnvTasks(Guess(WORDS), ("a", "b"), np.ones(3))


def test_a_user_environment_is_evaluated_through_the_cli(tmp_path):
    """``--plugin`` this file, ``--env guess``: a policy that answers "apple" (or stops at
    once, each with probability 1/2 per turn) solves task 0 in 1 - 2^-T of its samples and task
    1 never; the random base rarely. The settings given reach the run and are printed."""
    prompt, loaded = BudgetPrompt(), envs.make("guess")
    corpus = [prompt.system_text(loaded.env.instructions(), b) for b in (1, 2, 3, 4)]
    corpus += [
        prompt.turn_text(o, b, t)
        for o in ("Your guess?", "no")
        for b in (1, 2, 3, 4)
        for t in range(b)
    ]
    loaded.close()
    tokenizer = build_small_tokenizer(corpus + ["apple"] * 8, vocab_size=512)
    base = save_tiny_policy(tmp_path / "base", tokenizer, seed=0)
    rl = save_answering_policy(tmp_path / "rl", tokenizer, "apple")
    out = tmp_path / "results"
    settings = {
        "task.t_max": 4,
        "task.eval_tasks": 2,
        "task.max_response_tokens": 6,
        "task.max_context": 512,
        "eval.max_response_tokens": 6,
        "eval.max_context": 512,
        "eval.samples": 16,
        "eval.k": 2,
    }
    args = ["eval", "--env", "guess", "--plugin", str(Path(__file__)), "--analysis", "table"]
    args += ["--policy", f"base={base}", "--policy", f"RL={rl}", "--out", str(out)]
    for field, value in settings.items():
        args += ["--set", f"{field}={value}"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    assert "Settings: T_max 4, 2 test tasks; 16 samples" in result.output
    assert "lengths 6/512 tokens" in result.output
    record = json.loads((out / "raw" / "table.json").read_text())
    assert record["budgets"] == [1, 2, 3, 4]
    counts = record["counts"]
    apple = 0  # the test tasks are both of the environment's, in order
    for policy in ("base", "RL"):
        for budget in ("1", "4"):
            assert counts[policy][budget]["n"] == [16, 16]
            assert counts[policy][budget]["c"][1 - apple] == 0  # "river" is never said
    assert 1 <= counts["RL"]["1"]["c"][apple] < counts["RL"]["4"]["c"][apple]  # ~8 of 16, ~15
    assert counts["RL"]["4"]["c"][apple] > counts["base"]["4"]["c"][apple]  # base: by chance
    assert (out / "table1.csv").exists() and (out / "report.md").exists()


def test_the_readme_guide_registers_an_environment_that_plays(tmp_path):
    """README "Add your own environment": its file, loaded as a plugin, registers ``secret``,
    whose first task is solved by a response naming its word and refuses an unknown option."""
    import re

    from agentrl_jax.plugins import load_plugin

    readme = (Path(__file__).resolve().parents[1] / "docs" / "extending.md").read_text()
    section = readme.split("## Add your own environment", 1)[1].split("\n## ", 1)[0]
    source = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (tmp_path / "my_env.py").write_text(source)
    if "secret" not in envs.names():
        load_plugin(str(tmp_path / "my_env.py"))
    loaded = envs.make("secret", limit=1, workers=1)
    try:
        assert loaded.names == ("secret apple",) and loaded.env.t_max == 4
        state, observations = loaded.env.reset(np.array([0, 0]), seed=0)
        assert observations == ["Your guess?", "Your guess?"]
        _, result = loaded.env.step(state, ["pear", "an apple"], np.array([True, True]))
        assert result.success.tolist() == [False, True] and result.observations[0] == "no"
    finally:
        loaded.close()
    with pytest.raises(envs.EnvOptionError, match="takes no option 'data'"):
        envs.make("secret", data="x")
