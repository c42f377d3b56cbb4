"""Process rewards (§8): per-step scores of a trajectory, from any source, in one shape.

A *step scorer* is any callable ``scorer(trajectory, tasks) -> StepScores`` (the
:class:`StepScorer` protocol): it reads a :class:`~agentrl_jax.trajectory.Trajectory` batch
(and, if it needs them, the task batch the rollout was given) and returns a score for every
real turn, ``[N, T]`` float32 with a mask. The trainer never looks inside a scorer, so an
oracle, a learned judge, or a user's function plug in the same way:

* an environment's oracle, e.g. FrozenLake's exact ``Q*(s_t, a_t)`` with ``B - t`` moves left
  (:class:`envs.frozenlake.step_quality.FrozenLakeQStar`, the step quality of §7);
* :class:`JudgeScorer`: wraps any ``judge(prompts, responses) -> scores`` over text; each
  real turn becomes one (history before the turn, the turn's response) pair, decoded with the
  caller's ``decode``. :class:`LocalModelJudge` is such a judge backed by a local Qwen3
  directory: the score is ``P(Yes) / (P(Yes) + P(No))`` of the judge's next token after a
  question about the step.

Scores are used twice: as a training signal (:func:`shape_rewards`, weighted by
``TrainConfig.process_reward_coef``) and as the paper's training-dynamics metric R_single
(:func:`mean_step_score`, the mean step quality; on FrozenLake Q*).

An invalid step (an unparsable action; a judge answer that is not a finite number) gets
``invalid_score`` and is flagged in ``StepScores.invalid``; it never raises.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from agentrl_jax.algorithms import place_at_last_valid
from agentrl_jax.models.qwen3 import positions_from_mask
from agentrl_jax.trajectory import StepScores, Trajectory, scored_turns

# ------------------------------------------------------------------------- using scores


def mean_step_score(scores: StepScores) -> jax.Array:
    """R_single: the mean score over all scored turns of the batch (0 if there are none)."""
    weight = scores.mask.astype(jnp.float32)
    count = jnp.sum(weight)
    return jnp.where(count > 0, jnp.sum(scores.scores * weight) / jnp.maximum(count, 1.0), 0.0)


def shape_rewards(
    outcome: jax.Array, step_scores: jax.Array | None, turn_mask: jax.Array, coef: float
) -> tuple[jax.Array, jax.Array]:
    """Outcome plus weighted step scores, at the episode and at the turn level.

    outcome [N], step_scores [N, T] (0 off turn_mask) or None, turn_mask [N, T] ->
    ``(episode [N], per_turn [N, T])``:

    * ``per_turn[i, t] = coef * score[i, t] + (outcome[i] on row i's last real turn)``, the
      step rewards of GiGPO's step advantage and of GAE;
    * ``episode[i] = outcome[i] + coef * mean_t score[i, t]``, the reward of the
      group-relative episode advantage. The mean, not the sum, so a longer trajectory does
      not earn more by taking more steps.

    With ``step_scores`` None or ``coef == 0`` this is the outcome reward alone.
    """
    outcome = outcome.astype(jnp.float32)
    per_turn = place_at_last_valid(outcome, turn_mask)
    if step_scores is None or coef == 0:
        return outcome, per_turn
    weight = turn_mask.astype(jnp.float32)
    scores = step_scores.astype(jnp.float32) * weight
    turns = jnp.sum(weight, axis=-1)
    mean = jnp.sum(scores, axis=-1) / jnp.maximum(turns, 1.0)
    return outcome + coef * mean, per_turn + coef * scores


def turn_rewards_to_tokens(per_turn: jax.Array, token_turn: jax.Array) -> jax.Array:
    """Puts each turn's reward on the last token of that turn's response: ``[N, L]``.

    per_turn [N, T], token_turn [N, L] (turn of each sampled token, -1 elsewhere). The token
    rewards GAE reads (rewards on other tokens are 0).
    """
    n, length = token_turn.shape
    nxt = jnp.concatenate([token_turn[:, 1:], jnp.full((n, 1), -1, token_turn.dtype)], axis=1)
    last_of_turn = (token_turn >= 0) & (nxt != token_turn)
    safe = jnp.clip(token_turn, 0, per_turn.shape[1] - 1)
    return jnp.where(last_of_turn, jnp.take_along_axis(per_turn, safe, axis=1), 0.0).astype(
        jnp.float32
    )


def _check_score(name: str, value) -> None:
    if not (isinstance(value, numbers.Real) and math.isfinite(value)):
        raise ValueError(f"{name}: must be a finite number, got {value!r}")


# ------------------------------------------------------------------------- judges over text


def turn_texts(
    trajectory: Trajectory, decode: Callable[[Sequence[int]], str]
) -> tuple[list[tuple[int, int]], list[str], list[str]]:
    """The (row, turn) of every scored turn, its history text and its response text.

    The history is every real token before the turn's first sampled token (system prompt,
    task, earlier responses and observations); the response is the turn's sampled tokens.
    Runs on the host (NumPy).
    """
    tokens, token_mask = np.asarray(trajectory.tokens), np.asarray(trajectory.token_mask, bool)
    token_turn = np.asarray(trajectory.token_turn)
    mask = np.asarray(scored_turns(trajectory))
    where, prompts, responses = [], [], []
    for row, turn in zip(*np.nonzero(mask)):
        positions = np.flatnonzero(token_turn[row] == turn)
        if positions.size == 0:  # a turn that sampled nothing still gets a (empty) response
            first = int(np.flatnonzero(token_mask[row]).max(initial=-1)) + 1
        else:
            first = int(positions[0])
        history = tokens[row, :first][token_mask[row, :first]]
        where.append((int(row), int(turn)))
        prompts.append(decode(history.tolist()))
        responses.append(decode(tokens[row, positions].tolist()))
    return where, prompts, responses


class JudgeScorer:
    """A step scorer from any judge over text: ``judge(prompts, responses) -> scores``.

    ``judge`` gets two equal-length lists of strings (at most ``batch_size`` pairs per call)
    and returns one number per pair. ``decode`` turns token ids into text (e.g.
    ``lambda ids: tokenizer.decode(ids)``). A returned value that is not a finite real
    number is an invalid step: it scores ``invalid_score`` and is flagged.
    """

    def __init__(
        self,
        judge: Callable[[list[str], list[str]], Sequence[Any]],
        decode: Callable[[Sequence[int]], str],
        *,
        batch_size: int = 64,
        invalid_score: float = 0.0,
    ):
        if not callable(judge) or not callable(decode):
            raise ValueError("JudgeScorer: judge and decode must be callables")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"JudgeScorer batch_size: must be an int >= 1, got {batch_size!r}")
        _check_score("JudgeScorer invalid_score", invalid_score)
        self.judge, self.decode = judge, decode
        self.batch_size, self.invalid_score = batch_size, float(invalid_score)

    def __call__(self, trajectory: Trajectory, tasks: Any = None) -> StepScores:
        shape = tuple(trajectory.turn_mask.shape)
        scores, invalid = np.zeros(shape, np.float32), np.zeros(shape, bool)
        where, prompts, responses = turn_texts(trajectory, self.decode)
        for start in range(0, len(where), self.batch_size):
            stop = start + self.batch_size
            got = list(self.judge(prompts[start:stop], responses[start:stop]))
            if len(got) != len(prompts[start:stop]):
                raise ValueError(
                    f"JudgeScorer: the judge returned {len(got)} scores for "
                    f"{len(prompts[start:stop])} (prompt, response) pairs"
                )
            for (row, turn), value in zip(where[start:stop], got):
                score = _as_score(value)
                scores[row, turn] = self.invalid_score if score is None else score
                invalid[row, turn] = score is None
        return StepScores(jnp.asarray(scores), scored_turns(trajectory), jnp.asarray(invalid))


def _as_score(value: Any) -> float | None:
    """A finite real number (Python, NumPy or 0-d JAX) as a float; anything else None."""
    if isinstance(value, (bool, np.bool_)):
        return None
    try:
        array = np.asarray(value)
    except Exception:  # noqa: BLE001 - whatever a judge returned, it is not a score
        return None
    if array.shape != () or not (
        np.issubdtype(array.dtype, np.integer) or np.issubdtype(array.dtype, np.floating)
    ):
        return None
    score = float(array)
    return score if math.isfinite(score) else None


DEFAULT_JUDGE_QUESTION = (
    "You are judging one step of an agent solving a task.\n\n"
    "Conversation so far:\n{prompt}\n\nThe agent's next response:\n{response}\n\n"
    "Is this response a good step towards solving the task? Answer Yes or No."
)


class LocalModelJudge:
    """A judge ``(prompts, responses) -> P(Yes | Yes or No)`` backed by a local Qwen3.

    The question (``question.format(prompt=..., response=...)``) goes through the
    tokenizer's chat template when it has one (thinking disabled), else as plain text;
    the score is ``sigmoid(logit[yes] - logit[no])`` of the next token. Inputs longer than
    ``max_len`` tokens keep their last ``max_len`` tokens. Batches are padded to a multiple
    of ``pad_to`` tokens so few shapes compile.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        question: str = DEFAULT_JUDGE_QUESTION,
        yes: str = "Yes",
        no: str = "No",
        max_len: int = 4096,
        pad_to: int = 64,
    ):
        self.tokenizer, self.question = tokenizer, question
        self.yes_id, self.no_id = _single_token(tokenizer, yes), _single_token(tokenizer, no)
        self.max_len, self.pad_to = max_len, pad_to
        graphdef, self.params = nnx.split(model)

        def next_token_logits(params, tokens, mask):
            model = nnx.merge(graphdef, params)
            hidden, _ = model.hidden_states(tokens, positions_from_mask(mask), mask)
            last = jnp.sum(mask, axis=1) - 1
            return model.logits(hidden[jnp.arange(tokens.shape[0]), last])  # [B, V]

        self._logits = jax.jit(next_token_logits)

    @classmethod
    def from_model_dir(cls, model_dir, **kwargs) -> "LocalModelJudge":
        """Loads the model and tokenizer from a local Hugging Face directory (offline)."""
        from agentrl_jax.models.checkpoints import load_qwen3
        from agentrl_jax.models.tokenizer import load_tokenizer

        return cls(load_qwen3(model_dir), load_tokenizer(model_dir), **kwargs)

    def encode(self, prompt: str, response: str) -> list[int]:
        text = self.question.format(prompt=prompt, response=response)
        if getattr(self.tokenizer, "chat_template", None):
            from agentrl_jax.models.tokenizer import encode_chat

            ids = encode_chat(
                self.tokenizer, [{"role": "user", "content": text}], enable_thinking=False
            )
        else:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return list(ids)[-self.max_len :]

    def __call__(self, prompts: list[str], responses: list[str]) -> np.ndarray:
        encoded = [self.encode(p, r) for p, r in zip(prompts, responses)]
        if not encoded:
            return np.zeros((0,), np.float32)
        width = -(-max(len(ids) for ids in encoded) // self.pad_to) * self.pad_to
        tokens = np.zeros((len(encoded), width), np.int32)
        mask = np.zeros((len(encoded), width), bool)
        for i, ids in enumerate(encoded):
            tokens[i, : len(ids)], mask[i, : len(ids)] = ids, True
        logits = self._logits(self.params, jnp.asarray(tokens), jnp.asarray(mask))
        return np.asarray(jax.nn.sigmoid(logits[:, self.yes_id] - logits[:, self.no_id]))


def _single_token(tokenizer, word: str) -> int:
    ids = tokenizer(word, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(
            f"LocalModelJudge: the answer word {word!r} must be one token, got ids {ids}"
        )
    return int(ids[0])
