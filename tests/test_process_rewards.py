"""Process rewards: oracle Q* against gymnasium's own dynamics, judges over text (a stub, and a
local model against transformers), and the reward shaping the trainer applies."""

from __future__ import annotations

import gymnasium as gym
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_qwen3 import load_hf_qwen3, save_random_hf_qwen3

from agentrl_jax.models import load_qwen3
from agentrl_jax.models.tokenizer import encode_chat, load_tokenizer
from agentrl_jax.process_rewards import (
    JudgeScorer,
    LocalModelJudge,
    mean_step_score,
    shape_rewards,
    turn_rewards_to_tokens,
    turn_texts,
)
from agentrl_jax.trajectory import StepScores, Trajectory
from envs.frozenlake.grid import map_from_strings
from envs.frozenlake.step_quality import FrozenLakeQStar

MAPS = (["SFFF", "FHFH", "FFFH", "HFFG"], ["SFFH", "FFFF", "HFHF", "FFFG"])
GAMMA = 0.95


def _gym_q(desc, horizon: int) -> np.ndarray:
    """Q[h, s, a] by float64 backward induction over gymnasium's transition table (slippery)."""
    env = gym.make("FrozenLake-v1", desc=list(desc), is_slippery=True)
    table = env.unwrapped.P
    q = np.zeros((horizon + 1, len(table), 4))
    for h in range(1, horizon + 1):
        v = q[h - 1].max(axis=1)
        for s, by_action in table.items():
            for a, outcomes in by_action.items():
                q[h, s, a] = sum(
                    p * (r + (0.0 if done else GAMMA * v[s2])) for p, s2, r, done in outcomes
                )
    env.close()
    return q


def _trajectory(turns: int, **fields) -> Trajectory:
    """A 3-row record (token fields unused here); turn fields [3, k] are padded to ``turns``."""
    t = Trajectory.zeros(3, 8, turns)

    def pad(v):
        v = np.asarray(v)
        return v if v.ndim == 1 else np.pad(v, ((0, 0), (0, turns - v.shape[1])))

    return t.replace(**{k: jnp.asarray(pad(v)) for k, v in fields.items()})


# ------------------------------------------------------------------------- oracle Q*


def test_qstar_scores_are_gymnasiums_q_with_the_remaining_budget():
    maps = np.stack([map_from_strings(m) for m in MAPS])
    turn_mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]], bool)
    state_id = np.array([[0, 4, 8, 0], [0, 1, 2, 6], [0, 1, 0, 0]])
    action = np.array([[1, 1, -1, 0], [2, 2, 1, 3], [2, 0, 0, 0]])
    budget = np.array([8, 6, 3])  # the turn axis is 8 long: the largest budget
    task_id = np.array([0, 1, 1])
    row_mask = np.array([True, True, False])  # the last row is padding: never scored
    traj = _trajectory(
        8,
        turn_mask=turn_mask,
        state_id=state_id,
        action=action,
        action_valid=action >= 0,
        budget=budget,
        task_id=task_id,
        row_mask=row_mask,
    )
    scores = FrozenLakeQStar(maps, invalid_score=-0.5)(traj)

    q = [_gym_q(m, 8) for m in MAPS]
    want = np.zeros((3, 8))
    for i in range(2):
        for t in range(4):
            if turn_mask[i, t]:
                a = action[i, t]
                want[i, t] = -0.5 if a < 0 else q[task_id[i]][budget[i] - t, state_id[i, t], a]
    np.testing.assert_allclose(scores.scores, want, atol=1e-6)
    scored = np.pad(turn_mask & row_mask[:, None], ((0, 0), (0, 4)))
    np.testing.assert_array_equal(scores.mask, scored)
    np.testing.assert_array_equal(scores.invalid, scored & (np.pad(action, ((0, 0), (0, 4))) < 0))
    assert (want[:2, :4][turn_mask[:2] & (action[:2] >= 0)] > 1e-3).all()  # real values, not zeros
    np.testing.assert_allclose(mean_step_score(scores), want[scores.mask].mean(), rtol=1e-6)


def test_qstar_scorer_rejects_bad_maps_and_scores():
    with pytest.raises(ValueError, match=r"FrozenLakeQStar maps: expected int\[M, n, n\]"):
        FrozenLakeQStar(np.zeros((2, 4, 3), np.int8))
    with pytest.raises(ValueError, match="FrozenLakeQStar invalid_score: must be a finite number"):
        FrozenLakeQStar(np.zeros((1, 4, 4), np.int8), invalid_score=float("nan"))


# ------------------------------------------------------------------------- shaping


def test_shape_rewards_adds_weighted_scores_to_the_outcome():
    outcome = jnp.array([1.0, 0.0])
    turn_mask = jnp.array([[1, 1, 1], [1, 0, 0]], bool)
    scores = jnp.array([[0.2, 0.4, 0.9], [0.5, 0.0, 0.0]])
    episode, per_turn = shape_rewards(outcome, scores, turn_mask, 0.5)
    # episode: R + 0.5 * mean score; per turn: 0.5 * score, plus R on the last real turn
    np.testing.assert_allclose(episode, [1.0 + 0.5 * 0.5, 0.0 + 0.5 * 0.5], rtol=1e-6)
    np.testing.assert_allclose(per_turn, [[0.1, 0.2, 0.45 + 1.0], [0.25, 0.0, 0.0]], rtol=1e-6)
    episode, per_turn = shape_rewards(outcome, None, turn_mask, 0.5)
    np.testing.assert_allclose(episode, outcome)
    np.testing.assert_allclose(per_turn, [[0, 0, 1], [0, 0, 0]])


def test_turn_rewards_land_on_the_last_token_of_each_turn():
    token_turn = jnp.array([[-1, -1, 0, 0, -1, 1, 1, 1, -1], [-1, 0, -1, 1, 1, -1, -1, -1, -1]])
    per_turn = jnp.array([[2.0, 3.0], [5.0, 7.0]])
    got = turn_rewards_to_tokens(per_turn, token_turn)
    np.testing.assert_array_equal(got, [[0, 0, 0, 2, 0, 0, 0, 3, 0], [0, 5, 0, 0, 7, 0, 0, 0, 0]])


# ------------------------------------------------------------------------- judges over text

# Two rows: row 0 = prompt [5, 6], turn 0 [7, 8], observation [9], turn 1 [10];
# row 1 = prompt [5], turn 0 [11], padding.
TOKENS = [[5, 6, 7, 8, 9, 10, 0, 0], [5, 11, 0, 0, 0, 0, 0, 0]]
TOKEN_TURN = [[-1, -1, 0, 0, -1, 1, -1, -1], [-1, 0, -1, -1, -1, -1, -1, -1]]


def _text_trajectory() -> Trajectory:
    token_mask = np.array([[1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0]], bool)
    t = Trajectory.zeros(2, 8, 2)
    return t.replace(
        tokens=jnp.asarray(TOKENS),
        token_mask=jnp.asarray(token_mask),
        token_turn=jnp.asarray(TOKEN_TURN),
        turn_mask=jnp.asarray([[1, 1], [1, 0]], bool),
        row_mask=jnp.ones(2, bool),
    )


def _decode(ids) -> str:
    return " ".join(f"t{i}" for i in ids)


def test_turn_texts_split_history_and_response():
    where, prompts, responses = turn_texts(_text_trajectory(), _decode)
    assert where == [(0, 0), (0, 1), (1, 0)]
    assert prompts == ["t5 t6", "t5 t6 t7 t8 t9", "t5"]
    assert responses == ["t7 t8", "t10", "t11"]


def test_judge_scorer_places_scores_and_flags_malformed_answers():
    calls = []

    def judge(prompts, responses):
        calls.append(len(prompts))
        return [
            {"t7 t8": jnp.float32(0.75), "t10": "0.9", "t11": float("inf")}[r] for r in responses
        ]

    scores = JudgeScorer(judge, _decode, batch_size=2, invalid_score=-1.0)(_text_trajectory())
    assert calls == [2, 1]
    np.testing.assert_allclose(scores.scores, [[0.75, -1.0], [-1.0, 0.0]])
    np.testing.assert_array_equal(scores.mask, [[1, 1], [1, 0]])
    np.testing.assert_array_equal(scores.invalid, [[0, 1], [1, 0]])
    for malformed in (None, True, [0.5], "nan"):
        scores = JudgeScorer(lambda p, r, v=malformed: [v] * len(p), _decode)(_text_trajectory())
        np.testing.assert_array_equal(scores.invalid, [[1, 1], [1, 0]])


def test_judge_scorer_rejects_a_judge_returning_the_wrong_count():
    with pytest.raises(ValueError, match="the judge returned 1 scores for 3"):
        JudgeScorer(lambda p, r: [0.5], _decode)(_text_trajectory())


class _CharTokenizer:
    """A tokenizer stub: 'Yes' -> 1, 'No' -> 2, any other text one id per character."""

    chat_template = None

    def __call__(self, text, add_special_tokens=False):
        special = {"Yes": [1], "No": [2]}
        return {"input_ids": special.get(text, [3 + ord(c) % 240 for c in text])}


def _hf_yes_probability(model, ids: list[int], yes: int, no: int) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].double()
    return float(torch.sigmoid(logits[yes] - logits[no]))


def test_local_model_judge_matches_transformers(tmp_path):
    save_random_hf_qwen3(tmp_path)
    reference = load_hf_qwen3(tmp_path)
    judge = LocalModelJudge(
        load_qwen3(tmp_path), _CharTokenizer(), question="Q: {prompt} | {response}?", pad_to=16
    )
    prompts, responses = ["go left", "a much longer history here"], ["Left", "Down"]
    got = judge(prompts, responses)
    for p, r, score in zip(prompts, responses, got):
        ids = _CharTokenizer()(f"Q: {p} | {r}?")["input_ids"]
        assert abs(score - _hf_yes_probability(reference, ids, 1, 2)) < 1e-5
    assert 0 < got.min() and got.max() < 1 and abs(got[0] - got[1]) > 1e-6


def test_local_model_judge_from_a_model_directory_uses_its_chat_template(tmp_path):
    """A tiny random model with Qwen3's vocabulary, the bundled Qwen3 tokenizer, the chat path."""
    save_random_hf_qwen3(
        tmp_path,
        vocab_size=151936,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        tie_word_embeddings=True,
    )
    judge = LocalModelJudge.from_model_dir(tmp_path, pad_to=64)
    tokenizer = load_tokenizer(tmp_path)
    (score,) = judge(["You are on S. Reach G."], ["<answer>Right</answer>"])
    text = judge.question.format(prompt="You are on S. Reach G.", response="<answer>Right</answer>")
    ids = encode_chat(tokenizer, [{"role": "user", "content": text}], enable_thinking=False)
    yes, no = tokenizer("Yes")["input_ids"][0], tokenizer("No")["input_ids"][0]
    assert abs(score - _hf_yes_probability(load_hf_qwen3(tmp_path), ids, yes, no)) < 1e-5


def test_local_model_judge_needs_single_token_answers(tmp_path):
    save_random_hf_qwen3(tmp_path)
    with pytest.raises(ValueError, match="the answer word 'Yes please' must be one token"):
        LocalModelJudge(load_qwen3(tmp_path), _CharTokenizer(), yes="Yes please")


def test_step_scores_is_a_pytree():
    import jax

    s = StepScores(jnp.zeros((2, 3)), jnp.ones((2, 3), bool), jnp.zeros((2, 3), bool))
    assert len(jax.tree.leaves(s)) == 3
