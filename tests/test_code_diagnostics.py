"""DeepCoder-MT's step diagnostics (PAPER.md §7): matched-state and error-state step quality,
continuation from error states, on the real code environment and sandbox.

Scripted policies submit programs whose test pass shares are known by hand (the task
``clip(x) = max(0, min(10, x))`` with four tests): on its first turn ``base`` submits
``return 0`` (passes 1 of 4) and ``RL`` ``return max(0, x)`` (3 of 4); on later turns ``base``
submits ``return x`` (2 of 4) and ``RL`` the correct program (4 of 4). So at every state the
step quality of each policy is 0.25 / 0.75 at turn 0 and 0.5 / 1.0 later, whoever visited it,
and from every error state ``RL`` solves the task on its next turn and ``base`` never does.
"""

from __future__ import annotations

import json
import re

import jax
import numpy as np
import pytest

from agentrl_jax.evaluation import raw as results
from agentrl_jax.evaluation.analyses.context import run_analysis
from agentrl_jax.evaluation.config import EvalConfig
from agentrl_jax.evaluation.state_diagnostics import RecordedQualityStates
from agentrl_jax.evaluation.text_states import (
    HISTORY_HEADER,
    ReplayedEnv,
    TextStatePool,
    inject_text_errors,
    matched_text_pool,
)
from agentrl_jax.models.small_tokenizer import build_small_tokenizer
from agentrl_jax.prompts import BudgetPrompt
from agentrl_jax.reproduce.studies.code import MutatedReference, fenced
from agentrl_jax.sampling import ScriptedPolicy
from envs.code import CodeEnv
from envs.code.datasets import CodeTask
from envs.code.mutation import failing_mutant, mutants
from envs.code.sandbox import CallTest
from envs.protocol import PythonTextEnv

T_MAX = 3
REFERENCE = "def clip(x):\n    return max(0, min(10, x))"
TESTS = (
    CallTest("clip", (-5,), 0),
    CallTest("clip", (5,), 5),
    CallTest("clip", (15,), 10),
    CallTest("clip", (10,), 10),
)
PROGRAMS = {  # program: its pass share on TESTS, by hand
    "def clip(x):\n    return 0": 0.25,  # -5 -> 0 only
    "def clip(x):\n    return x": 0.5,  # 5 and 10
    "def clip(x):\n    return max(0, x)": 0.75,  # all but 15
    REFERENCE: 1.0,
}
FIRST = {"base": "def clip(x):\n    return 0", "RL": "def clip(x):\n    return max(0, x)"}
LATER = {"base": "def clip(x):\n    return x", "RL": REFERENCE}
EXPECTED = {"base": (0.25, 0.5), "RL": (0.75, 1.0)}  # step quality at turn 0, at later turns
SETTINGS = EvalConfig(
    budgets=None,
    samples=2,
    k=1,
    pass_k_samples=2,
    states=6,
    group_size=2,
    source_samples=2,
    depth_bins=2,
    max_response_tokens=64,
    max_context=2048,
    diagnostic_tasks=None,
)
_TURN = re.compile(r"\[CURRENT TURN\] (\d+)")


def script(name: str):
    def reply(contexts, live):
        out = []
        for context in contexts:
            turn = int(_TURN.findall(context)[-1])
            out.append(fenced(FIRST[name] if turn == 0 else LATER[name]))
        return out

    return reply


@pytest.fixture(scope="module")
def code_env():
    tasks = [CodeTask("clip", "Write clip(x): x clipped to [0, 10].", TESTS, reference=REFERENCE)]
    return CodeEnv(tasks)


@pytest.fixture(scope="module")
def tokenizer(code_env):
    prompt = BudgetPrompt()
    first = code_env.first_observation(code_env.tasks[0])
    corpus = (
        [f"system\n{prompt.system_text(code_env.instructions(), b)}" for b in range(1, T_MAX + 1)]
        + [f"user\n{prompt.turn_text(first, b, t)}" for b in range(1, T_MAX + 1) for t in range(b)]
        + [fenced(p) for p in PROGRAMS] * 16
        + [HISTORY_HEADER, "[TURN 0 RESPONSE]", "[TURN 0 RESULT]", "failed", "passed"] * 8
    )
    return build_small_tokenizer(corpus, vocab_size=1024, split_words=False)


def policies(tokenizer):
    return {name: ScriptedPolicy(tokenizer, script(name)) for name in ("base", "RL")}


def test_hand_computed_pass_shares(code_env):
    """The premise of the test: each program's pass share in the real sandbox."""
    for program, share in PROGRAMS.items():
        results_ = code_env.run_program(0, program)
        assert sum(r.passed for r in results_) / len(results_) == share, program


def test_mutants_change_one_site_and_a_failing_one_lowers_the_pass_share(code_env):
    found = mutants(REFERENCE)
    # min/max calls have no operator to flip: the constants 0 and 10 (+1 each) and the return
    assert found == [
        "def clip(x):\n    return",
        "def clip(x):\n    return max(1, min(10, x))",
        "def clip(x):\n    return max(0, min(11, x))",
    ]
    assert mutants("def broken(:") == []
    share = lambda p: sum(r.passed for r in code_env.run_program(0, p)) / 4  # noqa: E731
    program, lowered = failing_mutant(REFERENCE, share, np.random.default_rng(0))
    assert program in found and lowered < 1.0 and lowered == share(program)
    # a mutant that passes every test is never returned: only when none fails, None
    assert (
        failing_mutant(
            "def clip(x):\n    return 0 if x < 0 else x", lambda p: 1.0, np.random.default_rng(0)
        )
        is None
    )


def test_replayed_state_shows_the_history_and_continues_the_episode(code_env):
    pool = TextStatePool(np.array([0]), np.array([3]), np.array([-1]), ((fenced(FIRST["base"]),),))
    env = ReplayedEnv(code_env, pool)
    state, text = env.reset_task(0, seed=0)
    assert text.startswith(code_env.first_observation(code_env.tasks[0]))
    assert HISTORY_HEADER in text and FIRST["base"] in text and "[TURN 0 RESULT]" in text
    assert state.submissions == 1  # the environment replayed the history
    _, feedback = env.step_task(state, fenced(REFERENCE))
    assert feedback.success and feedback.quality == 1.0
    solved = TextStatePool(np.array([0]), np.array([3]), np.array([-1]), ((fenced(REFERENCE),),))
    with pytest.raises(ValueError, match="ends the episode at turn 0"):
        ReplayedEnv(code_env, solved).reset_task(0, seed=0)


def _expected(pool_turns: np.ndarray, name: str) -> np.ndarray:
    first, later = EXPECTED[name]
    return np.where(pool_turns == 0, first, later)


def test_matched_and_error_state_step_quality_equal_the_hand_computed_pass_shares(
    code_env, tokenizer
):
    from agentrl_jax.evaluation import drivers
    from agentrl_jax.evaluation.passt import eval_rollout_config

    env = PythonTextEnv(code_env, workers=4)
    try:
        play = drivers.Play(
            env,
            tokenizer,
            np.array([0]),
            eval_rollout_config(max_response_tokens=64, max_context=2048),
        )
        states = RecordedQualityStates(code_env, error_reply=MutatedReference(code_env))
        pols = policies(tokenizer)
        visits = states.visits(play, pols, jax.random.key(0), samples=2, budget=T_MAX)
        # base never solves: turns 0, 1, 2 of each sample; RL solves on turn 1: turns 0, 1
        assert sorted(visits["base"].turn.tolist()) == [0, 0, 1, 1, 2, 2]
        assert sorted(visits["RL"].turn.tolist()) == [0, 0, 1, 1]
        assert visits["base"].history[np.argmax(visits["base"].turn)] == (
            fenced(FIRST["base"]),
            fenced(LATER["base"]),
        )
        pool = states.matched(visits["base"], visits["RL"], size=6, seed=0)
        assert len(pool) == 6 and sorted(pool.source.tolist()) == [0, 0, 0, 1, 1, 1]

        names = ("base", "RL")
        result, record = states.steps(
            play, pool, pols["base"], pols["RL"], jax.random.key(1), names=names, settings=SETTINGS
        )
        for name in names:
            np.testing.assert_array_equal(result.quality[name], _expected(pool.turn, name))
            np.testing.assert_array_equal(
                result.samples[name], np.repeat(_expected(pool.turn, name)[:, None], 2, axis=1)
            )
        assert result.invalid_share() == {"base": 0.0, "RL": 0.0}
        assert record["states"]["source"] == [names[s] for s in pool.source]

        errors, record = states.errors(
            play, pool, pols["base"], pols["RL"], jax.random.key(2), names=names, settings=SETTINGS
        )
        e = errors.errors
        # every pool state with a turn left after the error (t + 1 < 3) has one
        np.testing.assert_array_equal(e.origin, np.flatnonzero(pool.turn + 1 < T_MAX))
        np.testing.assert_array_equal(e.states.turn, pool.turn[e.origin] + 1)
        injected = e.reply[0]
        assert set(e.reply) == {injected} and injected[
            len("```python\n") : -len("\n```")
        ] in mutants(REFERENCE)
        share = sum(r.passed for r in code_env.run_program(0, injected[10:-4])) / 4
        assert share < 1.0  # the mutation lowers the pass count
        for name in names:  # error states are at turn >= 1
            np.testing.assert_array_equal(errors.quality.quality[name], EXPECTED[name][1])
        np.testing.assert_array_equal(errors.success["RL"], True)  # solves on its next turn
        np.testing.assert_array_equal(errors.success["base"], False)
        assert errors.paired_success().mean_diff.mean == 1.0
        assert record["injected_reply"] == list(e.reply)
    finally:
        env.close()


def test_steps_and_errors_analyses_on_code(code_env, tokenizer, tmp_path):
    """The reproduction's ``steps`` and ``errors`` analyses with the code study's states: the
    raw records hold the hand-computed qualities, the suite table the continuation rates."""
    env = PythonTextEnv(code_env, workers=4)
    states = RecordedQualityStates(
        code_env, error_reply=MutatedReference(code_env), quality_name="test pass share"
    )
    try:
        for name in ("steps", "errors"):
            sections = run_analysis(
                name,
                tmp_path,
                env,
                np.array([0]),
                tokenizer,
                policies(tokenizer),
                SETTINGS,
                states=states,
            )
            assert sections
    finally:
        env.close()
    steps = results.load_raw(tmp_path, "steps")
    pair = steps["pairs"]["RL"]
    turns = np.asarray(pair["states"]["turn"])
    for name in ("base", "RL"):
        np.testing.assert_array_equal(pair["quality"][name], _expected(turns, name))
    errors = results.load_raw(tmp_path, "errors")
    assert errors["quality_name"] == "test pass share"
    np.testing.assert_array_equal(errors["pairs"]["RL"]["quality"]["RL"], 1.0)
    np.testing.assert_array_equal(errors["pairs"]["RL"]["quality"]["base"], 0.5)
    suite = json.loads((tmp_path / "error_recovery.json").read_text())
    row = suite["rows"]["RL"]
    assert row["continuation"]["mean"] == 1.0 and row["base_continuation"]["mean"] == 0.0
    assert row["better_share"] == 1.0
    report = json.loads((tmp_path / "sections" / "steps.json").read_text())
    assert "test pass share" in json.dumps(report)


def test_inject_skips_states_without_a_turn_left_or_a_reply():
    pool = TextStatePool(
        np.array([0, 0, 1]), np.array([2, 2, 2]), np.array([0, 1, 0]), ((), ("a",), ())
    )
    errors = inject_text_errors(pool, lambda task, rng: None if task == 1 else "wrong")
    np.testing.assert_array_equal(errors.origin, [0])
    assert errors.states.history == (("wrong",),) and errors.states.turn.tolist() == [1]
    with pytest.raises(ValueError, match="fewer turns played than its budget"):
        TextStatePool(np.array([0]), np.array([1]), np.array([0]), (("a",),))
    small = matched_text_pool(pool, pool.take([0]), size=4, seed=0)
    assert len(small) == 2 and small.source.tolist() == [0, 1]
