"""States of a Python text environment for the step diagnostics (PAPER.md §7), where the
environment scores each turn itself (``TurnResult.quality``: DeepCoder-MT's share of unit
tests passed).

A *text state* is ``(task, history, B)``: task ``task`` of the environment, the responses
``history`` played so far (``t = len(history)`` turns) and the trajectory's budget ``B``
(``0 <= t < B``). A response's step quality at the state is the quality the environment
gives it there (for code: the pass share of the program it submits).

What a policy sees when it acts from a state
--------------------------------------------
As for FrozenLake's states (:mod:`agentrl_jax.reproduce.studies.frozenlake.states`), a fresh
conversation of one user message at turn ``t`` of ``B``
(:class:`~agentrl_jax.evaluation.state_prompt.StatePrompt`): the system prompt states ``B``,
and the message states turn ``t`` and ``B - t`` remaining, around the task's first
observation followed by every earlier turn, its response and the environment's answer
(:func:`render_history`). Unlike FrozenLake, the history is the state
here (the feedback on earlier programs is what a good next program uses), so all of it is
shown, as text in that one message rather than as chat turns. Both policies are asked about
exactly the same text. Later turns of a continued episode are appended as the rollout always
does.

How (the rollout is reused unchanged): each state becomes a task of :class:`ReplayedEnv`,
which resets the state's task and replays its history through the environment (so the
environment's state is the one the episode was in: feedback, submissions), and the rollout's
budget for the state is the remaining ``B - t``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np

from agentrl_jax.evaluation import stats
from agentrl_jax.evaluation.state_prompt import SOURCES, FirstTurnOnly, StatePrompt
from agentrl_jax.rollout import MultiTurnRollout, RolloutConfig, RolloutResult
from agentrl_jax.sampling import Policy
from envs.protocol import Feedback, PythonEnv, PythonTextEnv

# ---------------------------------------------------------------- pools of states


@dataclasses.dataclass(frozen=True)
class TextStatePool:
    """``S`` states: ``[S]`` int arrays ``task_id``, ``budget``, ``source`` (index into
    :data:`~agentrl_jax.evaluation.state_prompt.SOURCES`, -1 when unlabelled) and ``history``, the
    ``S`` tuples of responses played before each state (``turn = len(history)``)."""

    task_id: np.ndarray
    budget: np.ndarray
    source: np.ndarray
    history: tuple[tuple[str, ...], ...]

    def __post_init__(self):
        history = tuple(tuple(str(r) for r in h) for h in self.history)
        object.__setattr__(self, "history", history)
        for name in ("task_id", "budget", "source"):
            a = np.asarray(getattr(self, name))
            if a.ndim != 1 or a.shape[0] != len(history) or (a.size and a.dtype.kind not in "iu"):
                raise ValueError(
                    f"TextStatePool.{name}: must be {len(history)} integers, got "
                    f"shape {a.shape} dtype {a.dtype}"
                )
            object.__setattr__(self, name, a.astype(np.int64))
        if np.any(self.turn >= self.budget):
            raise ValueError("TextStatePool: every state needs fewer turns played than its budget")

    @property
    def turn(self) -> np.ndarray:
        """``[S]`` turns played before each state."""
        return np.array([len(h) for h in self.history], np.int64)

    def __len__(self) -> int:
        return len(self.history)

    def take(self, index: Any) -> "TextStatePool":
        index = np.arange(len(self))[index]
        return TextStatePool(
            self.task_id[index],
            self.budget[index],
            self.source[index],
            tuple(self.history[i] for i in index),
        )

    def to_columns(self) -> dict[str, list]:
        """``{field: values}`` for a JSON record (``source`` as its label)."""
        return {
            "task_id": self.task_id.tolist(),
            "turn": self.turn.tolist(),
            "budget": self.budget.tolist(),
            "source": [SOURCES[s] if s >= 0 else "" for s in self.source],
            "history": [list(h) for h in self.history],
        }


def concat_text_pools(pools: Sequence[TextStatePool]) -> TextStatePool:
    return TextStatePool(
        np.concatenate([p.task_id for p in pools]),
        np.concatenate([p.budget for p in pools]),
        np.concatenate([p.source for p in pools]),
        tuple(h for p in pools for h in p.history),
    )


def visited_text_states(
    result: RolloutResult, source: int = -1, rows: int | None = None
) -> TextStatePool:
    """Every state a rollout acted from: one per played turn of each real row (a state
    visited twice counts twice), its history the row's responses before that turn. ``rows``:
    only the first ``rows`` rows (a padded call's repeats left out)."""
    traj = jax.device_get(result.trajectory)
    turn_mask = np.asarray(traj.turn_mask, bool) & np.asarray(traj.row_mask, bool)[:, None]
    if rows is not None:
        turn_mask[rows:] = False
    rows, turns = np.nonzero(turn_mask)
    history = tuple(tuple(result.responses[r][:t]) for r, t in zip(rows, turns))
    return TextStatePool(
        np.asarray(traj.task_id)[rows],
        np.asarray(traj.budget)[rows],
        np.full(rows.size, source),
        history,
    )


def matched_text_pool(
    base: TextStatePool, rl: TextStatePool, size: int, seed: int = 0
) -> TextStatePool:
    """§7.1's matched pool: ``size // 2`` states drawn from each policy's visits without
    replacement (both halves shrink to the smaller count); ``source`` 0 base, 1 RL."""
    if size < 2:
        raise ValueError(f"matched_text_pool: `size` must be >= 2, got {size}")
    half = min(size // 2, len(base), len(rl))
    if half == 0:
        raise ValueError(
            f"matched_text_pool: no states to draw from (base {len(base)}, RL {len(rl)})"
        )
    rng = np.random.default_rng(seed)
    halves = []
    for code, pool in enumerate((base, rl)):
        chosen = pool.take(np.sort(rng.choice(len(pool), half, replace=False)))
        halves.append(dataclasses.replace(chosen, source=np.full(half, code)))
    return concat_text_pools(halves)


# ---------------------------------------------------------------- error states (§7.2)


ErrorReply = Callable[[int, np.random.Generator], "str | None"]
"""``error_reply(task_id, rng)``: an erroneous response for the task (for code, the reference
program mutated to fail a test), or None when the task has none."""


@dataclasses.dataclass(frozen=True)
class TextErrorStates:
    """``states``: the error states (each a pool state with one injected response, one turn
    later); ``origin``: ``[E]`` the pool state each was made from; ``reply``: the injected
    responses."""

    states: TextStatePool
    origin: np.ndarray
    reply: tuple[str, ...]


def inject_text_errors(
    pool: TextStatePool, error_reply: ErrorReply, seed: int = 0
) -> TextErrorStates:
    """From each state of ``pool`` with a turn left after the error (``t + 1 < B``), play
    ``error_reply(task, rng)`` as its next response. States whose task has no error reply are
    skipped."""
    rng = np.random.default_rng(seed)
    origin, replies = [], []
    for i in np.flatnonzero(pool.turn + 1 < pool.budget):
        reply = error_reply(int(pool.task_id[i]), rng)
        if reply is not None:
            origin.append(i)
            replies.append(str(reply))
    origin = np.asarray(origin, np.int64)
    source = pool.take(origin)
    states = dataclasses.replace(
        source, history=tuple(h + (r,) for h, r in zip(source.history, replies))
    )
    return TextErrorStates(states, origin, tuple(replies))


# ---------------------------------------------------------------- episodes from states


HISTORY_HEADER = "Your earlier turns in this episode:"


def render_history(first_observation: str, turns: Sequence[tuple[str, str]]) -> str:
    """The text of a state: the task's first observation, then each earlier ``(response,
    environment's answer)``."""
    if not turns:
        return first_observation
    parts = [first_observation, HISTORY_HEADER]
    for k, (response, answer) in enumerate(turns):
        parts.append(f"[TURN {k} RESPONSE]\n{response}\n[TURN {k} RESULT]\n{answer}")
    return "\n\n".join(parts)


class ReplayedEnv(PythonEnv):
    """A :class:`~envs.protocol.PythonEnv` whose task ``i`` is state ``i`` of ``pool`` on
    ``env``: reset replays the state's history (:func:`render_history` is its observation),
    steps are ``env``'s.

    Raises ``ValueError`` on reset when the history ended the episode before the state (it
    cannot be a state a trajectory acted from)."""

    def __init__(self, env: PythonEnv, pool: TextStatePool):
        self.env, self.pool = env, pool
        self.name, self.t_max = env.name, env.t_max

    def instructions(self) -> str:
        return self.env.instructions()

    def num_tasks(self) -> int:
        return len(self.pool)

    def reset_task(self, task_id: int, seed: int) -> tuple[Any, str]:
        state, first = self.env.reset_task(int(self.pool.task_id[task_id]), seed)
        turns = []
        for k, response in enumerate(self.pool.history[task_id]):
            state, feedback = self.env.step_task(state, response)
            if feedback.done:
                self.env.close_task(state)
                raise ValueError(
                    f"ReplayedEnv: state {task_id}'s history ends the episode at "
                    f"turn {k}; it has no turn {len(self.pool.history[task_id])}"
                )
            turns.append((response, feedback.observation))
        return state, render_history(first, turns)

    def step_task(self, row_state: Any, response: str) -> tuple[Any, Feedback]:
        return self.env.step_task(row_state, response)

    def state_key(self, row_state: Any) -> int:
        return self.env.state_key(row_state)

    def close_task(self, row_state: Any) -> None:
        self.env.close_task(row_state)


@dataclasses.dataclass(frozen=True)
class TextStatePlay:
    """``G`` episodes from each state: ``[S, G]`` arrays. ``quality``: the first turn's step
    quality (the environment's score); ``valid``: it parsed into an action; ``success``: the
    task was solved within the remaining budget; ``turns``: turns played (0: the state's
    prompt does not fit ``max_context``, :attr:`fits`); ``overflow``: the episode ran out of
    context."""

    quality: np.ndarray
    valid: np.ndarray
    success: np.ndarray
    turns: np.ndarray
    overflow: np.ndarray

    @property
    def fits(self) -> np.ndarray:
        """``[S]`` the state's prompt fits the context (the same for every policy: the prompt
        is the state's, not the policy's)."""
        return (self.turns > 0).all(axis=1)


class TextStateStarts:
    """Episodes of any policy started at the states of ``pool`` on the Python environment
    ``env`` (the module docstring). ``config`` as for
    :class:`~agentrl_jax.reproduce.studies.frozenlake.states.StateStarts` (``group_size`` =
    ``G``, its budget ignored); ``states_per_call`` bounds (and pads) the states of one rollout
    call."""

    def __init__(
        self,
        env: PythonEnv,
        tokenizer,
        pool: TextStatePool,
        config: RolloutConfig,
        *,
        states_per_call: int | None = None,
        workers: int = 8,
        step_timeout_s: float = 60.0,
    ):
        if not isinstance(env, PythonEnv):
            raise TypeError(f"TextStateStarts needs a PythonEnv, got {type(env).__name__}")
        if len(pool) == 0:
            raise ValueError("TextStateStarts: the pool has no states")
        if np.any(pool.budget > env.t_max):
            raise ValueError(
                f"TextStateStarts: budgets up to {pool.budget.max()} exceed the "
                f"environment's t_max={env.t_max}"
            )
        if states_per_call is not None and states_per_call < 1:
            raise ValueError(
                f"TextStateStarts: `states_per_call` must be >= 1, got {states_per_call}"
            )
        self.pool, self.tokenizer, self.states_per_call = pool, tokenizer, states_per_call
        self.config = dataclasses.replace(config, budget=None)
        self.env = PythonTextEnv(
            ReplayedEnv(env, pool), workers=workers, step_timeout_s=step_timeout_s
        )

    def close(self) -> None:
        self.env.close()

    def calls(self) -> list[tuple[int, np.ndarray, int]]:
        """``(budget B, state indices, real count)`` of each rollout call, padded by repeating
        a call's last state."""
        out = []
        for budget in np.unique(self.pool.budget):
            index = np.flatnonzero(self.pool.budget == budget)
            size = self.states_per_call or index.size
            for start in range(0, index.size, size):
                chunk = index[start : start + size]
                out.append(
                    (
                        int(budget),
                        np.concatenate([chunk, np.full(size - chunk.size, chunk[-1])]),
                        int(chunk.size),
                    )
                )
        return out

    def play(self, policy: Policy, key: jax.Array, *, first_turn_only: bool) -> TextStatePlay:
        """``G`` episodes of ``policy`` from every state (one turn each if
        ``first_turn_only``); call ``c`` uses ``fold_in(key, c)``, so two policies played with
        the same key are paired."""
        size, g = len(self.pool), self.config.group_size
        fields = {
            "quality": np.full((size, g), np.nan),
            "valid": np.zeros((size, g), bool),
            "success": np.zeros((size, g), bool),
            "turns": np.zeros((size, g), np.int64),
            "overflow": np.zeros((size, g), bool),
        }
        env = FirstTurnOnly(self.env) if first_turn_only else self.env
        runners: dict[int, MultiTurnRollout] = {}
        for call, (budget, index, real) in enumerate(self.calls()):
            if budget not in runners:
                config = dataclasses.replace(
                    self.config, prompt=StatePrompt.of(self.config.prompt, budget)
                )
                runners[budget] = MultiTurnRollout(env, self.tokenizer, config)
            remaining = budget - self.pool.turn[index]
            result = runners[budget](
                policy, index, jax.random.fold_in(key, call), budgets=remaining
            )
            traj = jax.device_get(result.trajectory)
            per_row = {
                "quality": np.asarray(traj.step_quality)[:, 0],
                "valid": np.asarray(traj.action_valid)[:, 0],
                "success": traj.success,
                "turns": traj.turns_used,
                "overflow": traj.overflow,
            }
            for name, values in per_row.items():
                fields[name][index[:real]] = np.asarray(values).reshape(-1, g)[:real]
        # a turn the environment could not score (a step that timed out) counts as 0
        fields["quality"] = np.where(np.isfinite(fields["quality"]), fields["quality"], 0.0)
        return TextStatePlay(**fields)


# ---------------------------------------------------------------- step quality and errors


@dataclasses.dataclass(frozen=True)
class TextStepQuality:
    """Per-state quality of two policies on one pool: ``quality[name]`` ``[S]`` the mean over
    the ``G`` responses, ``samples[name]`` ``[S, G]`` each response's quality, ``valid[name]``
    ``[S, G]``; ``names`` = ``(base, RL)``."""

    names: tuple[str, str]
    pool: TextStatePool
    samples: dict[str, np.ndarray]
    valid: dict[str, np.ndarray]

    @property
    def quality(self) -> dict[str, np.ndarray]:
        return {n: s.mean(axis=1) for n, s in self.samples.items()}

    def invalid_share(self) -> dict[str, float]:
        return {n: float(np.mean(~v)) for n, v in self.valid.items()}

    def comparison(self) -> stats.PairedComparison:
        base, rl = self.names
        return stats.paired_comparison(self.quality[rl], self.quality[base])

    def pools(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """``{"all": (q_base [S], q_rl [S])}`` for :mod:`~agentrl_jax.evaluation.analyses.
        step_quality` (every response can differ in quality: no ties by construction)."""
        base, rl = self.names
        return {"all": (self.quality[base], self.quality[rl])}


@dataclasses.dataclass(frozen=True)
class TextErrorResult:
    """Response quality at error states and continuation success from them (as
    the FrozenLake study's ``ErrorStateResult``)."""

    errors: TextErrorStates
    quality: TextStepQuality
    success: dict[str, np.ndarray]
    overflow: dict[str, np.ndarray]

    def paired_success(self) -> stats.PairedComparison:
        base, rl = self.quality.names
        return stats.paired_comparison(
            self.success[rl].mean(axis=1), self.success[base].mean(axis=1)
        )


def _fitting(starts: TextStateStarts, played: dict[str, TextStatePlay]) -> np.ndarray:
    """The states whose prompt fits the context (a long history may not: those states are
    left out for every policy alike); raises when none does."""
    fits = np.logical_and.reduce([p.fits for p in played.values()])
    if not fits.any():
        raise ValueError(
            f"no state's prompt fits max_context={starts.config.max_context} "
            f"(of {len(fits)} states); raise it"
        )
    return np.flatnonzero(fits)


def text_step_quality(
    starts: TextStateStarts, base: Policy, rl: Policy, key: jax.Array, *, names: tuple[str, str]
) -> TextStepQuality:
    """§7.1 on text states: ``G`` one-turn samples of each policy from every state (same key),
    each scored by the environment; states whose prompt does not fit the context are left
    out (``result.pool`` is those kept)."""
    played = {n: starts.play(p, key, first_turn_only=True) for n, p in zip(names, (base, rl))}
    keep = _fitting(starts, played)
    return TextStepQuality(
        tuple(names),
        starts.pool.take(keep),
        {n: p.quality[keep] for n, p in played.items()},
        {n: p.valid[keep] for n, p in played.items()},
    )


def text_error_states(
    starts: TextStateStarts,
    errors: TextErrorStates,
    base: Policy,
    rl: Policy,
    key: jax.Array,
    *,
    names: tuple[str, str],
) -> TextErrorResult:
    """§7.2 on text states: ``starts`` built on ``errors.states``; each policy plays ``G``
    whole continuations from every error state (same key), the first turn of each its
    response sample. Error states whose prompt does not fit are left out (``result.errors``
    is those kept)."""
    if starts.pool is not errors.states:
        raise ValueError("text_error_states: `starts` is not built on `errors.states`")
    played = {n: starts.play(p, key, first_turn_only=False) for n, p in zip(names, (base, rl))}
    keep = _fitting(starts, played)
    kept = TextErrorStates(
        errors.states.take(keep), errors.origin[keep], tuple(errors.reply[i] for i in keep)
    )
    quality = TextStepQuality(
        tuple(names),
        kept.states,
        {n: p.quality[keep] for n, p in played.items()},
        {n: p.valid[keep] for n, p in played.items()},
    )
    return TextErrorResult(
        kept,
        quality,
        {n: p.success[keep] for n, p in played.items()},
        {n: p.overflow[keep] for n, p in played.items()},
    )
