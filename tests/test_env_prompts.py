"""The budget-aware prompt (PAPER.md §6) on InterCode-SQL, DeepCoder-MT and BFCL v3, checked on
the real decoded contexts of rollouts, and the Pass@K / Pass@T counts and analyses (the
evaluation drivers) against known outcomes: scripted agents replaying the gold answers (SQL gold
query, HumanEval canonical solution, BFCL annotated calls) succeed exactly when the budget
covers their play, and agents told to fail on chosen samples give known success counts.

The tasks come from the CLI's task sources (the environment registry, :func:`envs.make`):
the first three of the bundled SQL questions, of HumanEval and of BFCL's multi_turn_base."""

from __future__ import annotations

import json
import re
from math import comb

import jax
import numpy as np
import pytest
from env_agents import AGENTS, SqlGold, replay_observations
from eval_helpers import SYSTEM_BUDGET, turns_in

import envs
from agentrl_jax.evaluation import drivers, passk, passt
from agentrl_jax.evaluation.analyses import pass_at_k, pass_at_t
from agentrl_jax.models.tokenizer import load_tokenizer
from agentrl_jax.rollout import MultiTurnRollout, RolloutConfig
from agentrl_jax.sampling import ScriptedPolicy

T_MAX = {"sql": 10, "code": 10, "bfcl": 24}
CONFIG = passt.eval_rollout_config(max_response_tokens=1024, max_context=16384)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()  # Qwen3's own


@pytest.fixture(scope="module", params=["sql", "code", "bfcl"])
def tasks(request):
    loaded = envs.make(request.param, limit=3, workers=4)
    yield request.param, loaded
    loaded.env.close()


def _agent(name, env, **kwargs):
    return AGENTS[name](env.env.tasks, **kwargs)


def test_every_turn_states_the_budget_and_gold_play_succeeds_when_it_fits(tasks, tokenizer):
    name, loaded = tasks
    env = loaded.env
    assert env.t_max == T_MAX[name] and env.num_tasks() == 3
    agent = _agent(name, env, group_size=2)
    needed = np.array([agent.needed(i) for i in range(3)])
    # Each task twice: one budget a turn short of the gold play, and the full T_max.
    task_ids = np.repeat(np.arange(3), 2)
    budgets = np.stack([needed - 1, np.full(3, env.t_max)], axis=1).reshape(-1)
    runner = MultiTurnRollout(
        env, tokenizer, RolloutConfig(group_size=2, max_response_tokens=1024, max_context=16384)
    )
    traj = jax.device_get(
        runner(
            ScriptedPolicy(tokenizer, agent), task_ids, jax.random.key(0), budgets=budgets
        ).trajectory
    )

    row_task, row_budget = np.repeat(task_ids, 2), np.repeat(budgets, 2)
    np.testing.assert_array_equal(traj.budget, row_budget)
    np.testing.assert_array_equal(traj.success, row_budget >= needed[row_task])
    np.testing.assert_array_equal(traj.turns_used, np.minimum(row_budget, needed[row_task]))
    np.testing.assert_array_equal(traj.reward.sum(axis=1), traj.success)  # reward 1 at the end
    assert not traj.overflow.any()

    # What each row was shown, against a fresh environment playing the gold answers directly.
    shown = {
        i: replay_observations(env.env, i, [agent.gold(i, t) for t in range(needed[i])])
        for i in range(3)
    }
    seen_turns = np.zeros(len(row_task), int)
    for row, context in agent.contexts:
        task, budget = row_task[row], int(row_budget[row])
        turns = turns_in(context)
        assert agent.task_of(turns[0][3]) == task
        assert [t[:3] for t in turns] == [(budget, t, budget - t) for t in range(len(turns))]
        assert [t[3] for t in turns] == shown[task][: len(turns)]
        assert SYSTEM_BUDGET.findall(context) == [str(budget)]
        system = context[: context.index("<|im_end|>")]
        assert env.instructions() in system and f"at most {budget} turns" in system
        # No other limit on turns or steps competes with the budget (BFCL's own loop caps a
        # request at 20 steps; this environment does not, and must not say so).
        assert re.findall(r"(\d+) (?:turns?|steps?)\b", system) == [str(budget)]
        seen_turns[row] = max(seen_turns[row], len(turns))
    np.testing.assert_array_equal(seen_turns, traj.turns_used)  # a prompt at every turn played


def test_pass_at_t_of_gold_play_is_the_share_of_tasks_it_fits(tasks, tokenizer, tmp_path):
    name, loaded = tasks
    env = loaded.env
    agent = _agent(name, env, group_size=2)
    needed = np.array([agent.needed(i) for i in range(3)])
    around = {int(b) for n in needed for b in (n - 1, n) if b >= 1}
    budgets = tuple(sorted({1, *around, *passk.budget_levels(env.t_max)}))
    play = drivers.Play(env, tokenizer, np.arange(3), CONFIG)
    counts = drivers.pass_at_t_counts(
        play,
        {"gold": ScriptedPolicy(tokenizer, agent)},
        jax.random.key(1),
        budgets=budgets,
        samples=2,
    )
    shortest = None if loaded.min_turns is None else loaded.min_turns[:3]
    result = pass_at_t.compute(counts, k=2, t_max=env.t_max, shortest_paths=shortest)
    sections = pass_at_t.section(tmp_path, result)
    expected = [float(np.mean(needed <= b)) for b in budgets]
    curve = json.loads((tmp_path / "pass_at_t.json").read_text())["curves"]["gold"]
    assert curve["budget"] == list(budgets)
    np.testing.assert_allclose(curve["pass"], expected, atol=1e-12)
    assert {b: (list(n), list(c)) for b, (n, c) in counts["gold"].items()} == {
        b: ([2, 2, 2], [2 * int(n <= b) for n in needed]) for b in budgets
    }
    table = json.loads((tmp_path / "pass_at_t_table.json").read_text())
    levels = passk.budget_levels(env.t_max)
    assert table["table"]["gold"] == {str(b): float(np.mean(needed <= b)) for b in levels}
    assert [s.title for s in sections] == [
        "Pass@T at k = 2",
        f"Pass@2 at 25/50/75/100% of T_max = {env.t_max} (Table 1)",
    ]
    record = json.loads((tmp_path / "pass_at_t.json").read_text())
    if name == "bfcl":  # §2's bound from the annotated trajectories, met by replaying them
        bound = dict(
            zip(record["structural_bound"]["budget"], record["structural_bound"]["share_solvable"])
        )
        assert [bound[b] for b in budgets] == expected
        np.testing.assert_array_equal(loaded.min_turns, needed)
    else:
        assert "structural_bound" not in record


def test_pass_at_k_files_hold_the_known_success_counts(tokenizer, tmp_path):
    loaded = envs.make("sql", limit=3)
    tasks = loaded.env.env.tasks
    samples = 4
    # base succeeds 4, 1, 0 times on the three tasks; RL 4, 4, 2.
    fail = {"base": {(1, 1), (1, 2), (1, 3), *((2, s) for s in range(4))}, "RL": {(2, 0), (2, 1)}}
    policies = {n: ScriptedPolicy(tokenizer, SqlGold(tasks, samples, fail[n])) for n in fail}
    try:
        play = drivers.Play(loaded.env, tokenizer, np.arange(3), CONFIG, tasks_per_call=2)
        counts = drivers.pass_at_k_counts(play, policies, jax.random.key(2), samples=samples)
    finally:
        loaded.env.close()
    section = pass_at_k.section(tmp_path, pass_at_k.compute(counts, ks=range(1, samples + 1)))
    assert {p: (list(n), list(c)) for p, (n, c) in counts.items()} == {
        "base": ([4, 4, 4], [4, 1, 0]),
        "RL": ([4, 4, 4], [4, 4, 2]),
    }
    curves = json.loads((tmp_path / "pass_at_k.json").read_text())["curves"]

    def unbiased(n, c, k):  # 1 - C(n - c, k) / C(n, k), by hand
        return 1 - comb(n - c, k) / comb(n, k)

    for policy, c in (("base", [4, 1, 0]), ("RL", [4, 4, 2])):
        assert curves[policy]["k"] == [1, 2, 3, 4]
        np.testing.assert_allclose(
            curves[policy]["pass_at_k"],
            [np.mean([unbiased(4, ci, k) for ci in c]) for k in range(1, 5)],
        )
    assert "pass_at_k.json" in section.files
