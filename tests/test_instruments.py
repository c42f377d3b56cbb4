"""The research instruments (issue: questions the paper leaves open) against hand-computed
values: budget presentation (exact prompt texts, what a scripted policy is shown, the
robustness numbers), the splice (two scripted policies whose success at each hand-over turn is
known in closed form on deterministic maps), the erosion localisation (class sums, CIs over
trajectories, state contributions, token classes), their findings and JSON round trips."""

from __future__ import annotations

import math
import re

import jax
import numpy as np
import pytest
from eval_helpers import SYSTEM_BUDGET, QStarAgent, turns_in

from agentrl_jax.errors import ConfigError
from agentrl_jax.evaluation import drivers, findings, passt, stats
from agentrl_jax.evaluation.analyses import erosion, presentation, splice
from agentrl_jax.evaluation.analyses.presentation import check_hidden_budget
from agentrl_jax.evaluation.splicing import SplicedPolicy
from agentrl_jax.models.tokenizer import load_tokenizer
from agentrl_jax.prompts import HIDDEN, BudgetPresentation, BudgetPrompt
from agentrl_jax.rollout import RolloutConfig
from agentrl_jax.sampling import ScriptedPolicy
from envs.frozenlake import maps as fl_maps
from envs.frozenlake import qstar
from envs.frozenlake.text_env import FrozenLakeTextConfig, FrozenLakeTextEnv

T_MAX = 10
CONFIG = passt.eval_rollout_config(max_response_tokens=16, max_context=2048)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def maps():
    """8 maps with random start and goal cells: shortest paths 1..8."""
    return np.asarray(
        fl_maps.generate(jax.random.key(11), 8, size=4, p=0.75, random_start_goal=True)
    )


class Recording:
    """A scripted policy that records the decoded context of every row at every respond."""

    def __init__(self, tokenizer, script):
        self.inner, self.tokenizer, self.seen = ScriptedPolicy(tokenizer, script), tokenizer, []

    def start(self, contexts, settings):
        self.inner.start(contexts, settings)

    def restart(self, contexts, which):
        self.inner.restart(contexts, which)

    def extend(self, chunks):
        self.inner.extend(chunks)

    def respond(self, live, max_tokens, key):
        self.seen.append([t for t, on in zip(self.inner._texts, live) if on])
        return self.inner.respond(live, max_tokens, key)


# ---------------------------------------------------------------- budget presentation


def test_prompt_text_of_each_presentation():
    p = BudgetPrompt()
    exact = "[MAX TURNS] 12 [CURRENT TURN] 3 [REMAINING TURNS] 9\nGRID"
    assert p.turn_text("GRID", 12, 3) == exact
    assert p.turn_text("GRID", 12, 3, shown=12) == exact
    assert p.turn_text("GRID", 12, 3, shown=HIDDEN) == "GRID"
    assert p.turn_text("GRID", 12, 3, shown=10) == (
        "[MAX TURNS] 10 [CURRENT TURN] 3 [REMAINING TURNS] 7\nGRID"
    )
    # an understated budget runs out before the episode does: the turns left stop at 0
    assert p.turn_text("GRID", 12, 11, shown=9) == (
        "[MAX TURNS] 9 [CURRENT TURN] 11 [REMAINING TURNS] 0\nGRID"
    )
    assert p.system_text("DO IT", 12, shown=HIDDEN) == "DO IT"
    assert p.system_text("DO IT", 12, shown=14).startswith("DO IT\n\nYou have at most 14 turns")
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="shown budget"):
            p.turn_text("GRID", 12, 3, shown=bad)
    with pytest.raises(ValueError, match="hidden_turn"):
        BudgetPrompt(hidden_turn="[MAX TURNS] {max_turns}\n{observation}")


def test_shown_budgets_per_mode():
    budgets = np.array([12, 12, 6, 3, 12, 9, 1, 12] * 16)
    key = jax.random.key(3)
    np.testing.assert_array_equal(BudgetPresentation("exact").shown_budgets(key, budgets), budgets)
    assert np.all(BudgetPresentation("hidden").shown_budgets(key, budgets) == HIDDEN)
    approx = BudgetPresentation("approximate", noise=0.25).shown_budgets(key, budgets)
    assert np.all(approx >= np.maximum(1, np.rint(budgets * 0.75)))
    assert np.all(approx <= np.rint(budgets * 1.25))
    assert np.any(approx != budgets)  # perturbed, not exact
    np.testing.assert_array_equal(
        approx, BudgetPresentation("approximate", noise=0.25).shown_budgets(key, budgets)
    )
    mixed = BudgetPresentation("mixed").shown_budgets(key, budgets)
    kinds = {
        ("hidden" if s == HIDDEN else "exact" if s == b else "other")
        for s, b in zip(mixed, budgets)
    }
    assert {"hidden", "exact"} <= kinds
    for bad in ({"mode": "vague"}, {"mode": "approximate", "noise": 1.0}, {"modes": ["x"]}):
        with pytest.raises(ValueError, match="presentation"):
            BudgetPresentation.from_value(bad)
    with pytest.raises(ValueError, match="RolloutConfig.presentation"):
        RolloutConfig(presentation="fuzzy")


@pytest.mark.parametrize("mode", ["exact", "hidden", "approximate"])
def test_what_a_policy_is_shown_under_each_presentation(tokenizer, maps, mode):
    env = FrozenLakeTextEnv(maps, FrozenLakeTextConfig(t_max=T_MAX, is_slippery=False))
    policy = Recording(tokenizer, lambda contexts, live: ["<answer>Left</answer>"] * len(live))
    config = RolloutConfig(
        group_size=2, budget=8, max_response_tokens=16, max_context=2048, presentation=mode
    )
    from agentrl_jax.rollout import MultiTurnRollout

    result = MultiTurnRollout(env, tokenizer, config)(policy, np.arange(8), jax.random.key(0))
    assert np.all(np.asarray(result.trajectory.turns_used) <= 8)  # B whatever is shown
    last = policy.seen[-1]
    for context in last:
        shown = turns_in(context)
        if mode == "hidden":
            assert shown == [] and SYSTEM_BUDGET.search(context) is None
            continue
        stated = {b for b, _, _, _ in shown}
        assert len(stated) == 1 and SYSTEM_BUDGET.search(context).group(1) == str(*stated)
        for b, t, r, _ in shown:
            assert r == max(b - t, 0)
        if mode == "exact":
            assert stated == {8}
        else:
            assert 6 <= stated.pop() <= 10


def test_run_presets_carry_their_presentation():
    from agentrl_jax.train.config import RLConfig
    from agentrl_jax.train.presets import resolve_run

    rl = RLConfig()
    mixed = resolve_run("rl.runs[0]", "budgetmix-presentation", rl)
    assert mixed.presentation.mode == "mixed" and mixed.budget_mix is True
    assert resolve_run("rl.runs[0]", "grpo", rl).presentation.mode == "exact"
    custom = resolve_run(
        "rl.runs[0]", {"name": "g", "preset": "grpo", "presentation": {"mode": "hidden"}}, rl
    )
    assert custom.presentation.mode == "hidden"
    with pytest.raises(ConfigError, match=r"rl.runs\[0\].presentation"):
        resolve_run("rl.runs[0]", {"name": "g", "presentation": "vague"}, rl)


def test_presentation_robustness_numbers():
    n = np.array([4, 4, 4])
    counts = {
        "exact": {"base": {6: (n, np.array([4, 2, 0]))}},
        "hidden": {"base": {6: (n, np.array([2, 2, 0]))}},
    }
    res = presentation.compute(counts, k=1)
    assert res.rates["exact"]["base"][6].mean == pytest.approx((1 + 0.5 + 0) / 3)
    drop = res.drops["hidden"]["base"][6]
    diffs = np.array([-0.5, 0.0, 0.0])
    half = 1.959963984540054 * diffs.std(ddof=1) / math.sqrt(3)
    assert drop.mean == pytest.approx(diffs.mean())
    assert (drop.low, drop.high) == pytest.approx((diffs.mean() - half, diffs.mean() + half))
    assert presentation.PresentationRobustness.from_json(res.to_json()) == res
    with pytest.raises(ValueError, match="exact"):
        presentation.compute({"hidden": counts["hidden"]}, k=1)


def test_hidden_budget_finding():
    record = {
        "policies": ["base"],
        "k": 1,
        "budgets": [6],
        "counts": {
            m: {"base": {"6": {"n": [4, 4, 4, 4], "c": c}}}
            for m, c in (("exact", [4, 4, 4, 4]), ("hidden", [0, 0, 1, 0]))
        },
    }
    (found,) = check_hidden_budget(record)
    assert found.verdict == findings.SHOWS  # hiding costs 0.9375 with every task agreeing
    assert found.numbers["hidden_minus_exact"].mean == pytest.approx(-15 / 16)


# ---------------------------------------------------------------- splice


def good(tokenizer):
    """Q*-optimal on deterministic maps: reads its cell and the turns left off the prompt."""
    return Recording(tokenizer, QStarAgent(T_MAX, is_slippery=False))


def idle(tokenizer):
    """Never gives a valid move (a no-op turn each time)."""
    return Recording(tokenizer, lambda contexts, live: ["I wait."] * len(live))


def test_splice_of_two_scripted_policies_matches_the_closed_form(tokenizer, maps):
    env = FrozenLakeTextEnv(maps, FrozenLakeTextConfig(t_max=T_MAX, is_slippery=False))
    shortest = np.asarray(qstar.shortest_path_length(maps))
    play = drivers.Play(env, tokenizer, np.arange(len(maps)), CONFIG)
    depths = (0.25, 0.5, 0.75)
    turns = [drivers.switch_turn(d, T_MAX) for d in depths]
    assert turns == [2, 5, 8]  # round(2.5) = 2: half to even
    policies = {"idle": idle(tokenizer), "good": good(tokenizer)}
    alone, spliced = drivers.splice_successes(
        play,
        policies,
        jax.random.key(0),
        pairs=[("idle", "good"), ("good", "idle")],
        depths=depths,
        samples=2,
    )
    assert alone["good"].all() and not alone["idle"].any()
    for d, k in zip(depths, turns):
        # the idle policy wastes k turns, then the optimal one has T - k left; the other way
        # round, the optimal one must arrive within its k turns
        np.testing.assert_array_equal(
            spliced["idle>good"][d], np.repeat((shortest <= T_MAX - k)[:, None], 2, 1)
        )
        np.testing.assert_array_equal(
            spliced["good>idle"][d], np.repeat((shortest <= k)[:, None], 2, 1)
        )
    # the optimal policy took over with the whole history: k idle turns, then its own
    handed = [c for call in policies["good"].seen for c in call if "I wait." in c]
    assert handed and all(c.count("I wait.") in turns for c in handed)

    res = splice.compute(alone, spliced, "idle", T_MAX, turns)
    c = res.comparisons["good"]
    b_r = [(shortest <= T_MAX - k).mean() for k in turns]
    r_b = [(shortest <= k).mean() for k in turns]
    for i in range(3):
        assert c.continuation[i].mean == pytest.approx((b_r[i] + 1 - r_b[i]) / 2)
        assert c.prefix[i].mean == pytest.approx((r_b[i] + 1 - b_r[i]) / 2)
        assert c.continuation[i].mean + c.prefix[i].mean == pytest.approx(1.0)
    assert splice.Splice.from_json(res.to_json()) == res


def test_spliced_policy_at_the_ends_is_each_policy_alone(tokenizer, maps):
    env = FrozenLakeTextEnv(maps, FrozenLakeTextConfig(t_max=T_MAX))  # slippery: keyed slips
    play = drivers.Play(env, tokenizer, np.arange(len(maps)), CONFIG)
    key = jax.random.key(5)
    alone = play.rollout(good(tokenizer), key, samples=3, budget=T_MAX)
    first = play.rollout(
        SplicedPolicy(good(tokenizer), idle(tokenizer), T_MAX), key, samples=3, budget=T_MAX
    )
    np.testing.assert_array_equal(alone.success, first.success)
    np.testing.assert_array_equal(alone.tokens, first.tokens)
    then = play.rollout(
        SplicedPolicy(idle(tokenizer), good(tokenizer), 0), key, samples=3, budget=T_MAX
    )
    np.testing.assert_array_equal(alone.tokens, then.tokens)
    with pytest.raises(ValueError, match="switch_turn"):
        SplicedPolicy(good(tokenizer), idle(tokenizer), -1)


def test_splice_effects_and_where():
    ci = lambda m, lo, hi: stats.MeanCI(m, lo, hi, 10)  # noqa: E731
    assert splice.where(ci(0.1, 0.02, 0.2), ci(0.0, -0.1, 0.1)) == splice.IN_CONTINUATION
    assert splice.where(ci(0.0, -0.1, 0.1), ci(0.1, 0.02, 0.2)) == splice.IN_PREFIX
    assert splice.where(ci(0.1, 0.02, 0.2), ci(0.1, 0.02, 0.2)) == splice.IN_BOTH
    assert (
        splice.where(ci(0.0, -0.1, 0.1), ci(0.0, float("nan"), float("nan"))) == splice.IN_NEITHER
    )
    cont, prefix = splice.effects(
        np.array([0.0, 0.5]), np.array([1.0, 0.5]), np.array([1.0, 0.0]), np.array([0.0, 1.0])
    )
    np.testing.assert_allclose(cont, [1.0, -0.5])
    np.testing.assert_allclose(prefix, [0.0, 0.5])


# ---------------------------------------------------------------- erosion


def test_token_classes_follow_the_action_span():
    # one character per token: "ab<answer>L</answer>" then "x" in a second turn
    text = "ab<a>L</a>"
    tokens = np.array([[0] + [ord(ch) for ch in text] + [ord("x"), 0]])
    scored = np.array([[False] + [True] * len(text) + [True, False]])
    turn = np.array([[-1] + [0] * len(text) + [1, -1]])
    decode = lambda ids: "".join(chr(i) for i in ids)  # noqa: E731
    got = erosion.token_classes(tokens, scored, turn, decode, r"<a>.*?(?:</a>|$)")
    assert got[0].tolist() == [-1, 1, 1] + [0] * 8 + [1, -1]
    assert set(erosion.token_classes(tokens, scored, turn, decode, None)[0][1:-1]) == {1}


def test_erosion_token_view_is_a_mean_over_trajectories():
    rows = np.array([0, 0, 0, 1, 1])
    klass = np.array([0, 1, 1, 1, 0])  # action, other, other, other, action
    depth = np.array([0, 0, 2, 1, 1])
    counts = erosion.class_sums(np.ones(5), rows, klass, depth, 2)
    assert counts[0, 1].tolist() == [1, 0, 1] and counts[1, 0].tolist() == [0, 1, 0]
    entropy = {"GRPO": {0: erosion.class_sums(np.array([1, 2, 3, 4, 5.0]), rows, klass, depth, 2)}}
    change = {"GRPO": {0: erosion.class_sums(np.array([0, -1, -3, 2, 1.0]), rows, klass, depth, 2)}}
    res = erosion.compute_tokens(entropy, change, counts)
    by = {(c.token_class, c.depth): c for c in res.curves["GRPO"]}
    other = by["other", "all"]  # row 0: (2 + 3) / 2 = 2.5, row 1: 4; CI over the two rows
    assert other.tokens == 3
    assert other.entropy[0].mean == pytest.approx((2.5 + 4) / 2)
    assert other.logp_change[0].mean == pytest.approx(((-1 - 3) / 2 + 2) / 2)
    assert by["action", "first third"].entropy[0].mean == 1
    assert ("action", "last third") not in by  # no token there
    assert erosion.TokenErosion.from_json(res.to_json()) == res
    np.testing.assert_array_equal(erosion.depth_class(np.arange(6), 6), [0, 0, 1, 1, 2, 2])


def test_erosion_state_contributions_add_up():
    q_base = np.array([1.0, 1.0, 0.5, 0.5])
    q_rl = np.array([0.8, 0.6, 0.5, 0.7])
    turn, budget = np.array([0, 1, 5, 11]), np.array([12, 12, 12, 12])
    errors = (np.array([0.2, 0.4]), np.array([0.3, 0.3]))
    res = erosion.compute_states({"GRPO": (q_base, q_rl, turn, budget)}, {"GRPO": errors})
    classes = {c.name: c for c in res.classes["GRPO"]}
    assert classes["first third"].states == 2 and classes["first third"].weight == pytest.approx(
        2 / 6
    )
    assert classes["first third"].change.mean == pytest.approx(-0.3)
    assert classes["error states"].change.mean == pytest.approx(0.0)
    total = (2 / 6) * -0.3 + (1 / 6) * 0.0 + (1 / 6) * 0.2 + (2 / 6) * 0.0
    assert res.total["GRPO"] == pytest.approx(total)
    assert classes["first third"].share == pytest.approx((2 / 6) * -0.3 / total)
    assert erosion.StateErosion.from_json(res.to_json()) == res


def test_patterns_match_the_environments_actions():
    from agentrl_jax.reproduce.studies.frozenlake.diagnostics import QStarStates

    pattern = re.compile(QStarStates.action_pattern, re.S)
    assert pattern.search("think\n\n<answer>Left</answer>").group(0) == "<answer>Left</answer>"
    assert pattern.search("< ANSWER >up").group(0) == "< ANSWER >up"


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("presentations", ["hidden"], "eval.presentations"),  # no exact reference
        ("presentations", "exact", "eval.presentations"),
        ("presentations", ["exact", "exact"], "eval.presentations"),
        ("presentations", ["exact", "vague"], "eval.presentations"),
        ("presentation_noise", 1.0, "eval.presentation_noise"),
        ("presentation_noise", float("nan"), "eval.presentation_noise"),
        ("presentation_noise", "0.1", "eval.presentation_noise"),
        ("splice_depths", [0.0], "eval.splice_depths"),
        ("splice_depths", [1.0], "eval.splice_depths"),
        ("splice_depths", [], "eval.splice_depths"),
        ("splice_depths", [True], "eval.splice_depths"),
        ("splice_depths", "0.5", "eval.splice_depths"),
        ("splice_samples", 0, "eval.splice_samples"),
        ("splice_tasks", -1, "eval.splice_tasks"),
    ],
)
def test_hostile_instrument_settings_name_their_field(field, value, message):
    from agentrl_jax.evaluation.config import EvalConfig

    with pytest.raises(ConfigError, match=re.escape(message)):
        EvalConfig(**{field: value})
