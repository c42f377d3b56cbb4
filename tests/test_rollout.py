"""The multi-turn rollout with scripted policies: exact replay of the environment, budgets in
prompts, masks, malformed responses, overflow, history windows, a Python environment.
(A real Qwen3 policy: tests/test_rollout_qwen3.py.)"""

from __future__ import annotations

import dataclasses
import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl_jax.algorithms.budgetmix import budget_set
from agentrl_jax.models.tokenizer import load_tokenizer
from agentrl_jax.rollout import MultiTurnRollout, RolloutConfig, lane_seats, row_parts
from agentrl_jax.sampling import ScriptedPolicy
from envs.frozenlake import grid, optimal, qstar
from envs.frozenlake import maps as fl_maps
from envs.frozenlake.text import parse_action, render
from envs.frozenlake.text_env import FrozenLakeTextConfig, FrozenLakeTextEnv
from envs.protocol import Feedback, PythonEnv, PythonTextEnv, text_key

TURN = re.compile(
    r"\[MAX TURNS\] (\d+) \[CURRENT TURN\] (\d+) \[REMAINING TURNS\] (\d+)\n(.*?)<\|im_end\|>", re.S
)
SYMBOL_TILE = {"_": grid.FROZEN, "P": grid.FROZEN, "O": grid.HOLE, "G": grid.GOAL}
IM_END = 151645


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def slippery_env():
    maps = fl_maps.generate(jax.random.key(7), 16, size=4, p=0.8)
    return FrozenLakeTextEnv(maps, FrozenLakeTextConfig(t_max=10, success_rate=0.8))


@pytest.fixture(scope="module")
def lake():
    """gymnasium's 4x4 map, no slips: the shortest path to the goal is 6 moves."""
    return FrozenLakeTextEnv("4x4", FrozenLakeTextConfig(t_max=10, is_slippery=False))


def latest_turn(context: str) -> tuple[int, int, int, np.ndarray, int]:
    """``(B, t, B - t, tiles, pos)`` of the last user message of a context, read off its text."""
    budget, turn, remaining, text = TURN.findall(context)[-1]
    rows = [line.split(" ") for line in text.split("\n")]
    tiles = np.array([[SYMBOL_TILE[c] for c in row] for row in rows], np.int8)
    pos = [c for row in rows for c in row].index("P")
    return int(budget), int(turn), int(remaining), tiles, pos


class QStarAgent:
    """Reads the grid and the remaining budget off the prompt; answers argmax Q*(remaining)."""

    def __init__(self, horizon: int, is_slippery: bool, success_rate: float = 1.0 / 3.0):
        self.horizon, self.is_slippery, self.success_rate = horizon, is_slippery, success_rate
        self.q = {}

    def __call__(self, contexts, live):
        replies = []
        for context, on in zip(contexts, live):
            if not on:
                replies.append("")
                continue
            _, _, remaining, tiles, pos = latest_turn(context)
            key = tiles.tobytes()
            if key not in self.q:
                self.q[key] = np.asarray(
                    qstar.q_star(
                        tiles,
                        self.horizon,
                        gamma=1.0,
                        is_slippery=self.is_slippery,
                        success_rate=self.success_rate,
                    )
                )
            action = int(
                np.argmax(self.q[key][remaining, pos])
            )  # ties: lowest code, as greedy_action
            replies.append(f"I go <answer>{grid.ACTION_NAMES[action]}</answer>")
        return replies


def constant(text):
    return lambda contexts, live: [text] * len(live)


def runner_for(env, tokenizer, **overrides):
    config = dict(group_size=4, max_response_tokens=16, max_context=2048)
    return MultiTurnRollout(env, tokenizer, RolloutConfig(**{**config, **overrides}))


# ---------------------------------------------------------------------------- exact replay
@pytest.mark.parametrize(
    "seats",
    [
        {},
        {"max_rows_per_call": 8, "refill": True},
        {"lanes": 2},
        {"max_rows_per_call": 8, "refill": True, "lanes": 3},
        {"max_rows_per_call": 8, "lanes": 2},
    ],
    ids=[
        "all_rows",
        "continuous_8_seats",
        "2_lanes",
        "8_seats_in_3_lanes",
        "parts_of_8_in_2_lanes",
    ],
)
def test_qstar_greedy_agent_reproduces_play_greedy_exactly(slippery_env, tokenizer, seats):
    """Also under continuous batching: 64 rows through 8 seats, each ended row's seat taken
    by the next row, rows at different turns stepping together; and in lanes, whose
    environment steps run on a thread of their own while the next lane samples."""
    runner = runner_for(slippery_env, tokenizer, **seats)  # BudgetMix: budgets 1..10
    tasks = np.arange(16)
    result = runner(ScriptedPolicy(tokenizer, QStarAgent(10, True, 0.8)), tasks, jax.random.key(0))
    traj = jax.device_get(result.trajectory)

    maps = slippery_env.maps[traj.task_id]
    q = qstar.q_star(maps, 10, gamma=1.0, success_rate=0.8)
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(result.env_seed), i))(
        jnp.arange(len(traj.task_id))
    )
    play = jax.jit(
        jax.vmap(functools.partial(optimal.play_greedy, params=slippery_env.params, max_turns=10))
    )
    success, turns, positions, actions = jax.device_get(play(keys, maps, q, traj.budget))

    np.testing.assert_array_equal(traj.success, success)
    assert traj.success.mean() == success.mean()  # the acceptance statement, exactly
    np.testing.assert_array_equal(traj.turns_used, turns)
    for r in range(len(turns)):
        used = turns[r]
        np.testing.assert_array_equal(traj.state_id[r, :used], positions[r, :used])
        np.testing.assert_array_equal(traj.anchor_key[r, :used], positions[r, :used])
        np.testing.assert_array_equal(traj.action[r, :used], actions[r, :used])
    assert traj.action_valid[traj.turn_mask].all() and not traj.overflow.any()
    assert 0 < success.mean() < 1  # slips and budgets make it a real test
    # the groups drew BudgetMix budgets, shared by their G rows
    assert set(traj.budget.tolist()) <= set(budget_set(10)) and len(set(traj.budget.tolist())) > 1
    assert (traj.budget.reshape(16, 4) == traj.budget.reshape(16, 4)[:, :1]).all()
    np.testing.assert_array_equal(traj.group_id, np.repeat(np.arange(16), 4))


# ---------------------------------------------------------------------------- budgets
def test_every_prompt_shows_the_budget_and_no_row_exceeds_it(slippery_env, tokenizer):
    runner = runner_for(slippery_env, tokenizer)
    rng = np.random.default_rng(0)
    script = lambda contexts, live: [
        rng.choice(["<answer>Left</answer>", "Down", "right!", "??", "Up"]) for _ in live
    ]  # noqa: E731
    result = runner(ScriptedPolicy(tokenizer, script), np.arange(16), jax.random.key(1))
    traj = jax.device_get(result.trajectory)
    assert (traj.turns_used <= traj.budget).all() and (traj.turns_used == traj.budget).any()
    np.testing.assert_array_equal(traj.turn_mask.sum(1), traj.turns_used)
    for r in range(traj.tokens.shape[0]):
        text = tokenizer.decode(traj.tokens[r][traj.token_mask[r]])
        budget, used = int(traj.budget[r]), int(traj.turns_used[r])
        assert text.count(f"You have at most {budget} turns") == 1
        shown = [tuple(map(int, m[:3])) for m in TURN.findall(text)]
        assert shown == [(budget, t, budget - t) for t in range(used)]


def test_explicit_budgets_override_the_config(lake, tokenizer):
    runner = runner_for(lake, tokenizer, group_size=2, budget=7)
    result = runner(
        ScriptedPolicy(tokenizer, constant("Up")),
        np.array([0, 0]),
        jax.random.key(0),
        budgets=np.array([3, 5]),
    )
    assert result.trajectory.budget.tolist() == [3, 3, 5, 5]
    assert result.trajectory.turn_mask.shape == (4, 7)  # T: room for the config's budget
    with pytest.raises(ValueError, match="budgets"):
        runner(
            ScriptedPolicy(tokenizer, constant("Up")),
            np.array([0]),
            jax.random.key(0),
            budgets=np.array([8]),
        )


def test_timeouts_get_reward_zero_and_the_last_turn_counts(lake, tokenizer):
    runner = runner_for(lake, tokenizer, group_size=2)
    agent = ScriptedPolicy(tokenizer, QStarAgent(10, False))
    traj = jax.device_get(
        runner(
            agent, np.array([0, 0, 0]), jax.random.key(0), budgets=np.array([6, 5, 10])
        ).trajectory
    )
    # B = 6 = the shortest path: success on the 6th and last turn
    assert (
        traj.success[:2].all()
        and (traj.turns_used[:2] == 6).all()
        and (traj.reward[:2, 5] == 1).all()
    )
    # B = 5 < 6: the budget runs out; reward 0 everywhere
    assert not traj.success[2:4].any() and (traj.turns_used[2:4] == 5).all()
    assert traj.reward[2:4].sum() == 0 and np.asarray(runner_outcome(traj))[2:4].sum() == 0
    assert traj.success[4:].all() and (traj.reward[4:].sum(1) == 1).all()  # ends at the goal
    # standing still ("Up" at the top edge) times out too
    stuck = jax.device_get(
        runner(
            ScriptedPolicy(tokenizer, constant("<answer>Up</answer>")),
            np.array([0]),
            jax.random.key(0),
            budgets=np.array([4]),
        ).trajectory
    )
    assert (
        stuck.turns_used.tolist() == [4, 4] and not stuck.success.any() and stuck.reward.sum() == 0
    )
    assert stuck.action_valid[:, :4].all()


def runner_outcome(traj):
    return traj.success.astype(np.float32)


# ---------------------------------------------------------------------------- masks
@pytest.mark.parametrize("thinking", [False, True])
def test_loss_mask_is_exactly_the_sampled_tokens(lake, tokenizer, thinking):
    """Rebuild each row from the prompt pieces and the script's replies; compare token for token,
    and the decoded text with the tokenizer's own chat template."""
    replies = ["<answer>Down</answer>", "Hmm. " * 20 + "Right", "<think>go</think>Right"]
    script = lambda contexts, live: [
        replies[latest_turn(c)[1] % 3] if on else "" for c, on in zip(contexts, live)
    ]  # noqa: E731
    runner = runner_for(
        lake, tokenizer, group_size=2, budget=5, max_response_tokens=12, enable_thinking=thinking
    )
    traj = jax.device_get(
        runner(ScriptedPolicy(tokenizer, script), np.array([0]), jax.random.key(0)).trajectory
    )
    chat, prompt = runner.chat, runner.config.prompt
    for r in range(2):
        used = int(traj.turns_used[r])
        messages = [{"role": "system", "content": prompt.system_text(runner.instructions, 5)}]
        expected, sampled_mask, turn_of = [], [], []

        def add(ids, sampled=False, turn=-1):
            expected.extend(ids)
            sampled_mask.extend([sampled] * len(ids))
            turn_of.extend([turn] * len(ids))

        for t in range(used):
            user = prompt.turn_text(render(lake.maps[0], traj.state_id[r, t]), 5, t)
            messages.append({"role": "user", "content": user})
            add(
                chat.first_prompt(messages[0]["content"], user)
                if t == 0
                else chat.next_prompt(user)
            )
            ids = (tokenizer(replies[t % 3], add_special_tokens=False)["input_ids"] + [IM_END])[:12]
            add(ids, sampled=True, turn=t)
            messages.append(
                {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
            )
            if t + 1 < used:
                add(chat.close_response(ids))
        real = traj.token_mask[r]
        assert traj.tokens[r][real].tolist() == expected
        assert traj.loss_mask[r][real].tolist() == sampled_mask
        assert traj.token_turn[r][real].tolist() == turn_of
        assert (
            not traj.loss_mask[r][~real].any() and (traj.logprobs[r][~traj.loss_mask[r]] == 0).all()
        )
        # the cut reply (turn 1: 12 tokens, no stop token) got an end-of-turn that is not trained
        assert IM_END not in traj.tokens[r][traj.token_turn[r] == 1].tolist()
        # The template drops or reformats <think> blocks of earlier turns (the reason the record
        # is kept as tokens); compare the rest.
        template = tokenizer.apply_chat_template(messages, tokenize=False, enable_thinking=thinking)
        strip = lambda s: re.sub(r"<think>.*?</think>\s*", "", s, flags=re.S).rstrip("\n")  # noqa: E731
        assert strip(tokenizer.decode(traj.tokens[r][real])) == strip(template)


# ---------------------------------------------------------------------------- malformed output
@pytest.fixture(scope="module")
def small_runner(lake, tokenizer):
    return runner_for(lake, tokenizer, group_size=2, budget=3, max_response_tokens=24)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.text(max_size=40), min_size=6, max_size=6))
def test_malformed_responses_are_invalid_actions_never_errors(small_runner, tokenizer, texts):
    calls = iter(range(100))
    script = lambda contexts, live: [texts[(next(calls)) % 6] for _ in live]  # noqa: E731
    result = small_runner(ScriptedPolicy(tokenizer, script), np.array([0, 0]), jax.random.key(0))
    traj = jax.device_get(result.trajectory)
    for r in range(4):
        for t in range(int(traj.turns_used[r])):
            code = parse_action(result.responses[r][t])
            cut = traj.overflow[r] and t == traj.turns_used[r] - 1
            assert traj.action_valid[r, t] == (code >= 0 and not cut)
            assert traj.action[r, t] == (code if traj.action_valid[r, t] else -1)
            if not traj.action_valid[r, t] and t + 1 < traj.turns_used[r]:
                assert traj.state_id[r, t + 1] == traj.state_id[r, t]  # a no-op


def test_invalid_action_policy(lake, tokenizer):
    base = dict(group_size=2, budget=4)
    noop = runner_for(lake, tokenizer, **base, invalid_penalty=-0.5)
    traj = noop(
        ScriptedPolicy(tokenizer, constant("no idea")), np.array([0]), jax.random.key(0)
    ).trajectory
    assert traj.turns_used.tolist() == [4, 4] and (traj.reward[:, :4] == -0.5).all()
    end = runner_for(lake, tokenizer, **base, end_on_invalid=True)
    traj = end(
        ScriptedPolicy(tokenizer, constant("no idea")), np.array([0]), jax.random.key(0)
    ).trajectory
    assert traj.turns_used.tolist() == [1, 1] and not traj.action_valid.any()


# ---------------------------------------------------------------------------- overflow
def test_context_overflow_ends_and_flags_rows_never_truncating(lake, tokenizer):
    first = runner_for(lake, tokenizer, budget=6)
    ids, _ = first._first_prompt(6, render(lake.maps[0], 0))
    prompt_len = len(ids)
    reply = "<answer>Right</answer>"
    reply_len = len(tokenizer(reply)["input_ids"]) + 1  # and the stop token
    # 1) room for the prompt and one reply, not for the next user message
    runner = runner_for(lake, tokenizer, group_size=1, budget=6, max_context=prompt_len + 20)
    traj = jax.device_get(
        runner(
            ScriptedPolicy(tokenizer, constant(reply)), np.array([0]), jax.random.key(0)
        ).trajectory
    )
    assert traj.overflow.tolist() == [True] and traj.turns_used.tolist() == [1]
    assert traj.action_valid[0, 0] and traj.token_mask.sum() == prompt_len + reply_len
    # 2) a reply longer than the room left is cut there: not played, flagged
    runner = runner_for(lake, tokenizer, group_size=1, budget=6, max_context=prompt_len + 4)
    traj = jax.device_get(
        runner(
            ScriptedPolicy(tokenizer, constant(reply)), np.array([0]), jax.random.key(0)
        ).trajectory
    )
    assert traj.overflow.tolist() == [True] and traj.turns_used.tolist() == [1]
    assert not traj.action_valid[0, 0] and traj.loss_mask.sum() == 4
    assert traj.token_mask.sum() == prompt_len + 4 and not traj.success.any()
    # 3) a prompt that does not fit: no turns at all
    runner = runner_for(lake, tokenizer, group_size=1, budget=6, max_context=prompt_len - 1)
    traj = runner(
        ScriptedPolicy(tokenizer, constant(reply)), np.array([0]), jax.random.key(0)
    ).trajectory
    assert traj.overflow.tolist() == [True] and traj.turns_used.tolist() == [0]
    assert not traj.token_mask.any()
    # a roomy context overflows nothing
    traj = first(
        ScriptedPolicy(tokenizer, constant(reply)), np.array([0]), jax.random.key(0)
    ).trajectory
    assert not traj.overflow.any()


# ---------------------------------------------------------------------------- history window
def test_history_window_keeps_the_header_and_the_last_turns(lake, tokenizer):
    seen = []

    def script(contexts, live):
        seen.append(contexts[0])
        return ["<answer>Up</answer>"] * len(live)

    runner = runner_for(
        lake, tokenizer, group_size=1, budget=6, history_window=2, record_tokens=4096
    )
    traj = jax.device_get(
        runner(ScriptedPolicy(tokenizer, script), np.array([0]), jax.random.key(0)).trajectory
    )
    tokens, prefix = traj.tokens[0], int(traj.prefix_len[0])
    assert tokenizer.decode(tokens[:prefix]).startswith("<|im_start|>system")
    assert tokenizer.decode(tokens[:prefix]).endswith("<|im_end|>")
    for t, context in enumerate(seen):
        turns = [int(m[1]) for m in TURN.findall(context)]
        assert turns == list(range(max(0, t - 2), t + 1))  # the last 2 turns + this one
        start = int(traj.context_start[0, t])
        end = int(np.flatnonzero(traj.token_turn[0] == t)[0])  # where turn t's reply begins
        assert tokenizer.decode(np.concatenate([tokens[:prefix], tokens[start:end]])) == context
    # the record keeps the whole conversation
    shown = [int(m[1]) for m in TURN.findall(tokenizer.decode(tokens[traj.token_mask[0]]))]
    assert shown == list(range(6))


def test_continuous_batching_with_a_sliding_window_plays_the_whole_batchs_conversations(
    slippery_env, tokenizer
):
    """A policy whose reply is a function of the context it sees (so any seat gives the
    same reply): 5 groups of 2 with BudgetMix budgets through 4 seats, refilled as rows end,
    a history window of 2 sliding per row; the record equals the whole batch played at once,
    and every context the policy saw at a turn is the one the whole batch saw."""
    import hashlib

    words = [
        "<answer>Left</answer>",
        "<answer>Down</answer>",
        "<answer>Right</answer>",
        "<answer>Up</answer>",
        "hmm",
    ]
    seen: list[set[str]] = [set(), set()]

    def script(which):
        def reply(contexts, live):
            out = []
            for context, on in zip(contexts, live):
                if on:
                    seen[which].add(context)
                digest = hashlib.sha256(context.encode()).digest()[0]
                out.append(words[digest % len(words)])
            return out

        return reply

    overrides = dict(group_size=2, history_window=2, record_tokens=4096)
    tasks, key = np.array([0, 3, 1, 4, 2]), jax.random.key(4)
    whole = runner_for(slippery_env, tokenizer, **overrides)(
        ScriptedPolicy(tokenizer, script(0)), tasks, key
    )
    seated = runner_for(slippery_env, tokenizer, max_rows_per_call=4, refill=True, **overrides)(
        ScriptedPolicy(tokenizer, script(1)), tasks, key
    )
    a, b = jax.device_get(whole.trajectory), jax.device_get(seated.trajectory)
    assert len(set(a.turns_used.tolist())) > 1 and a.turns_used.max() > 3  # windows slide
    for field in dataclasses.fields(a):
        np.testing.assert_array_equal(
            getattr(b, field.name), getattr(a, field.name), err_msg=field.name
        )
    assert seated.responses == whole.responses and seen[0] == seen[1]
    assert seated.stats.live_rows == whole.stats.live_rows

    class StartOnly:  # a policy without restart: seating re-starts every seat, same record
        def __init__(self, inner):
            self.inner = inner
            self.start, self.extend, self.respond = inner.start, inner.extend, inner.respond

    seen.append(set())  # in 2 lanes of 2 seats: the same record, the same contexts seen
    laned = runner_for(
        slippery_env, tokenizer, max_rows_per_call=4, refill=True, lanes=2, **overrides
    )(ScriptedPolicy(tokenizer, script(2)), tasks, key)
    c = jax.device_get(laned.trajectory)
    for field in dataclasses.fields(a):
        np.testing.assert_array_equal(
            getattr(c, field.name), getattr(a, field.name), err_msg=field.name
        )
    assert laned.responses == whole.responses and seen[2] == seen[0]

    seen.append(set())
    fallback = runner_for(slippery_env, tokenizer, max_rows_per_call=4, refill=True, **overrides)(
        StartOnly(ScriptedPolicy(tokenizer, script(3))), tasks, key
    )
    c = jax.device_get(fallback.trajectory)
    for field in dataclasses.fields(a):
        np.testing.assert_array_equal(
            getattr(c, field.name), getattr(a, field.name), err_msg=field.name
        )


# ---------------------------------------------------------------------------- a Python env
def test_a_python_environment_plays_through_the_same_loop(tokenizer):
    from envs.sql import demo_tasks, make_env

    env = make_env(limit=3, workers=2)
    try:
        gold = [task.gold_query for task in demo_tasks()[:3]]
        runner = MultiTurnRollout(
            env, tokenizer, RolloutConfig(group_size=2, budget=3, max_response_tokens=128)
        )
        submit = lambda contexts, live: [
            f"<submit>{gold[r // 2]}</submit>" for r in range(len(live))
        ]  # noqa: E731
        traj = runner(ScriptedPolicy(tokenizer, submit), np.arange(3), jax.random.key(0)).trajectory
        assert traj.success.all() and traj.turns_used.tolist() == [1] * 6
        assert traj.action_valid[:, 0].all() and (traj.state_id[:, 0] == -1).all()

        def explore_then_submit(contexts, live):
            return [
                f"<submit>{gold[r // 2]}</submit>"
                if "<sql>SELECT 1</sql>" in contexts[r]
                else "<sql>SELECT 1</sql>"
                for r in range(len(live))
            ]

        traj = runner(
            ScriptedPolicy(tokenizer, explore_then_submit), np.arange(3), jax.random.key(1)
        ).trajectory
        assert traj.success.all() and traj.turns_used.tolist() == [2] * 6
    finally:
        env.close()


class Graded(PythonEnv):
    """Each turn is graded: the response's length in characters over 10 (its "test pass
    share"), except that "skip" has no grade (NaN); "done" ends the episode."""

    name, t_max = "graded", 4

    def instructions(self):
        return "Answer."

    def num_tasks(self):
        return 2

    def reset_task(self, task_id, seed):
        return task_id, "Go."

    def step_task(self, row_state, response):
        text = response.strip()
        grade = float("nan") if text == "skip" else len(text) / 10
        return row_state, Feedback("Again.", done=text == "done", quality=grade)

    def state_key(self, row_state):
        return text_key(row_state)


def test_the_record_keeps_each_turns_environment_quality_and_no_state_id(tokenizer):
    """TurnResult.quality reaches Trajectory.step_quality turn by turn (NaN where the
    environment gives none, and on turns that did not happen); an environment without state
    ids leaves state_id at -1."""
    scripts = {0: ["abc", "skip", "done"], 1: ["abcdefgh", "ab", "a", "abcd"]}
    env = PythonTextEnv(Graded(), workers=2)
    try:
        runner = MultiTurnRollout(
            env, tokenizer, RolloutConfig(group_size=1, budget=4, max_response_tokens=16)
        )
        turn_of = lambda context: context.count("Again.")  # noqa: E731
        respond = lambda contexts, live: [
            scripts[r][turn_of(contexts[r])] if live[r] else ""  # noqa: E731
            for r in range(len(live))
        ]
        traj = jax.device_get(
            runner(ScriptedPolicy(tokenizer, respond), np.arange(2), jax.random.key(0)).trajectory
        )
    finally:
        env.close()
    assert traj.turns_used.tolist() == [3, 4]
    np.testing.assert_array_equal(
        traj.step_quality, np.array([[0.3, np.nan, 0.4, np.nan], [0.8, 0.2, 0.1, 0.4]], np.float32)
    )
    assert (traj.state_id == -1).all()


class SlowCounter(PythonEnv):
    """A Python environment whose steps take ``seconds`` (a stand-in for a query, a test run,
    a sandbox): the row must say the number of its task plus its turn; a wrong number is an
    invalid action; three right ones end the episode with success. Records when it stepped."""

    name, t_max = "slow-counter", 6

    def __init__(self, seconds: float):
        self.seconds, self.steps = seconds, []

    def instructions(self):
        return "Say the next number."

    def num_tasks(self):
        return 8

    def reset_task(self, task_id, seed):
        return (task_id, 0, 0), f"Start at {task_id}."

    def step_task(self, row_state, response):
        begin = time.perf_counter()
        time.sleep(self.seconds)
        task, turn, right = row_state
        valid = response.strip() == str(task + turn)
        right += valid
        self.steps.append((begin, time.perf_counter()))
        return (task, turn + 1, right), Feedback(
            f"Turn {turn + 1}.",
            reward=float(valid),
            done=right == 3,
            success=right == 3,
            action_valid=valid,
        )

    def state_key(self, row_state):
        return text_key(*row_state)


def test_lanes_overlap_environment_steps_with_sampling_and_play_the_same_conversations(tokenizer):
    """8 groups of 2 rows; each row answers right or wrong by a hash of its context. With 2
    lanes, a lane samples while the other lane's environment step (20 ms) runs: some
    ``respond`` begins and ends inside a step. With 1 lane none can. Both give the same
    Trajectory, and the stats count the steps' time wherever they ran."""
    import hashlib

    def script(calls):
        def reply(contexts, live):
            begin = time.perf_counter()
            out = []
            for context in contexts:
                task = (
                    int(re.search(r"Start at (\d+)", context).group(1)) if "Start" in context else 0
                )
                turn = context.count("Turn ")
                wrong = hashlib.sha256(context.encode()).digest()[0] % 3 == 0
                out.append(str(task + turn + wrong))
            calls.append((begin, time.perf_counter()))
            return out

        return reply

    results, inside = [], []
    for lanes in (1, 2):
        env, calls = SlowCounter(0.02), []
        text_env = PythonTextEnv(env, workers=2)
        try:
            runner = MultiTurnRollout(
                text_env,
                tokenizer,
                RolloutConfig(
                    group_size=2, budget=6, max_response_tokens=8, max_context=1024, lanes=lanes
                ),
            )
            results.append(
                runner(ScriptedPolicy(tokenizer, script(calls)), np.arange(8), jax.random.key(3))
            )
        finally:
            text_env.close()
        inside.append(sum(any(a <= b0 and b1 <= b for a, b in env.steps) for b0, b1 in calls))
    one, two = results
    a, b = jax.device_get(one.trajectory), jax.device_get(two.trajectory)
    assert a.success.any() and not a.success.all() and a.action_valid[a.turn_mask].mean() < 1
    for field in dataclasses.fields(a):
        np.testing.assert_array_equal(
            getattr(b, field.name), getattr(a, field.name), err_msg=field.name
        )
    assert two.responses == one.responses and two.stats.live_rows == one.stats.live_rows
    assert inside[0] == 0 and inside[1] > 0
    steps = sum(one.stats.live_rows)  # every turn of a row stepped once; 2 workers per step
    for stats in (one.stats, two.stats):
        assert stats.env_step_s >= 0.02 * steps / 2


def test_an_environment_error_in_a_lanes_background_step_reaches_the_caller(lake, tokenizer):
    """The second step raises on the background thread: the rollout raises that error (it does
    not hang or swallow it), after the step threads have finished."""

    class Failing:
        def __init__(self, env):
            self.env, self.calls = env, 0

        def __getattr__(self, name):
            return getattr(self.env, name)

        def step(self, state, responses, live):
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("the environment broke")
            return self.env.step(state, responses, live)

    runner = MultiTurnRollout(
        Failing(lake),
        tokenizer,
        RolloutConfig(group_size=4, budget=5, max_response_tokens=16, max_context=2048, lanes=2),
    )
    with pytest.raises(RuntimeError, match="the environment broke"):
        runner(
            ScriptedPolicy(tokenizer, constant("<answer>Up</answer>")),
            np.array([0]),
            jax.random.key(0),
        )


@pytest.mark.parametrize(
    "seats, group_size, lanes, want",
    [
        (16, 4, 2, [8, 8]),
        (12, 4, 2, [8, 4]),
        (10, 2, 3, [4, 4, 2]),  # whole groups
        (4, 4, 2, [2, 2]),
        (6, 2, 4, [2, 2, 1, 1]),  # fewer groups than lanes: seat by seat
    ],
)
def test_lane_seats_are_whole_groups_where_they_can_be(seats, group_size, lanes, want):
    assert lane_seats(seats, group_size, lanes) == want


def test_lanes_need_a_policy_that_forks(lake, tokenizer):
    class NoFork:
        def __init__(self, inner):
            self.start, self.extend, self.respond = inner.start, inner.extend, inner.respond

    runner = runner_for(lake, tokenizer, budget=2, lanes=2)
    with pytest.raises(ValueError, match="lanes=2 needs a policy with fork"):
        runner(NoFork(ScriptedPolicy(tokenizer, constant("Up"))), np.array([0]), jax.random.key(0))


# ---------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"group_size": 0}, "group_size"),
        ({"budget": 0}, "budget"),
        ({"max_response_tokens": 1.5}, "max_response_tokens"),
        ({"history_window": 0}, "history_window"),
        ({"record_tokens": 10, "max_context": 20}, "record_tokens"),
        ({"invalid_penalty": 1.0}, "invalid_penalty"),
        ({"end_on_invalid": 1}, "end_on_invalid"),
        ({"sampling": None}, "sampling"),
        ({"prompt": "x"}, "prompt"),
        ({"max_rows_per_call": 0}, "max_rows_per_call"),
        ({"lanes": 0}, "lanes"),
        ({"lanes": True}, "lanes"),
        (
            {"group_size": 4, "max_rows_per_call": 6},
            "max_rows_per_call must be a multiple of group_size",
        ),
    ],
)
def test_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RolloutConfig(**kwargs)


@pytest.mark.parametrize(
    "groups, size, max_rows, sizes",
    [
        (4, 2, None, [8]),
        (4, 2, 8, [8]),
        (4, 2, 100, [8]),
        (5, 2, 8, [6, 4]),
        (5, 2, 4, [4, 4, 2]),
        (32, 16, 128, [128] * 4),
        (9, 16, 64, [48, 48, 48]),
    ],
)
def test_row_parts_are_whole_groups_in_order_and_even(groups, size, max_rows, sizes):
    parts = row_parts(groups, size, max_rows)
    assert [len(p) for p in parts] == sizes
    np.testing.assert_array_equal(np.concatenate(parts), np.arange(groups * size))
    assert all(p[0] % size == 0 and len(p) % size == 0 for p in parts)
    assert max_rows is None or max(len(p) for p in parts) <= max_rows


def test_budgets_beyond_t_max_and_bad_tasks_are_rejected(lake, tokenizer):
    with pytest.raises(ValueError, match="t_max"):
        runner_for(lake, tokenizer, budget=11)
    with pytest.raises(ValueError, match="task_ids"):
        runner_for(lake, tokenizer, budget=3)(
            ScriptedPolicy(tokenizer, constant("Up")), np.array([1]), jax.random.key(0)
        )
