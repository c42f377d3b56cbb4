"""The paper's step-level diagnostics on FrozenLake (PAPER.md §7.1-7.3), driven by rollouts.

* Step quality on matched states (§7.1): from each state of a pool (half visited by the
  base policy, half by the RL one:
  :func:`~agentrl_jax.reproduce.studies.frozenlake.states.matched_pool`), each policy samples ``G``
  actions; an action's quality is the exact ``Q*(s, a)`` with the remaining horizon ``B - t``
  (finite-horizon DP, ``gamma = 0.95``); a policy's quality at a state is the mean over its ``G``
  actions. Reported: the share of states where RL is better and the mean difference with a 95% CI
  (:func:`stats.paired_comparison`).
* Error states (§7.2): one distance-increasing move is injected into each state
  (:func:`~agentrl_jax.reproduce.studies.frozenlake.states.inject_errors`); both policies then play
  ``G`` episodes from each error state with the budget that is left. The first turn of those
  episodes gives the action quality at the error state; their outcomes give each policy's
  continuation success (same states, same environment randomness for both policies).
* Depth (§7.3): per-state quality against the normalised depth ``t / T_max``.

How a policy is asked to act from a state (a fresh conversation stating the state at turn
``t``) is documented in :mod:`agentrl_jax.reproduce.studies.frozenlake.states`.

Invalid responses: the environment plays an unparsable response as a no-op that uses the
turn (the player stays). Its quality is by default that move's exact value, ``Q*`` of staying:
``gamma * V*(s)`` with ``B - t - 1`` moves left (``invalid="noop"``); ``invalid="zero"``
scores it 0 instead. Either way it counts as one of the ``G`` samples, and the share of
invalid responses is reported next to the quality.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import numpy as np

from agentrl_jax.evaluation import drivers, stats
from agentrl_jax.evaluation.state_diagnostics import INVALID_SCORES, columns
from agentrl_jax.reproduce.studies.frozenlake.states import (
    ErrorStates,
    StatePlay,
    StatePool,
    StateStarts,
    inject_errors,
    matched_pool,
    visited_states,
)
from agentrl_jax.sampling import Policy
from envs.frozenlake import qstar
from envs.frozenlake.text_env import FrozenLakeTextEnv

DEFAULT_GAMMA = qstar.DEFAULT_GAMMA  # §7.1: gamma = 0.95
VALUE_TOL = 1e-6  # Q* comes from a float32 DP: smaller differences between actions are rounding


@dataclasses.dataclass(frozen=True)
class StateValues:
    """Exact values at each state of a pool: ``action_values [S, 4]`` = Q*(s, a) with
    ``B - t`` moves left, and ``noop_value [S]`` = gamma * V*(s) with ``B - t - 1`` left
    (what an invalid response, a no-op using the turn, is worth)."""

    action_values: np.ndarray
    noop_value: np.ndarray
    gamma: float

    @property
    def spread(self) -> np.ndarray:
        """``[S]`` max - min Q* over the 4 actions: 0 where the choice of action cannot matter."""
        return self.action_values.max(axis=1) - self.action_values.min(axis=1)

    def quality(self, actions: np.ndarray, invalid: str = "noop") -> np.ndarray:
        """``[S, G]`` quality of sampled ``actions`` (``[S, G]``, -1 = invalid response)."""
        if invalid not in INVALID_SCORES:
            raise ValueError(f"`invalid` must be one of {INVALID_SCORES}, got {invalid!r}")
        a = np.asarray(actions)
        if a.ndim != 2 or a.shape[0] != self.action_values.shape[0]:
            raise ValueError(f"`actions` must be [{self.action_values.shape[0]}, G], got {a.shape}")
        picked = np.take_along_axis(self.action_values, np.clip(a, 0, 3), axis=1)
        fallback = self.noop_value[:, None] if invalid == "noop" else 0.0
        return np.where(a >= 0, picked, fallback)


def state_values(
    env: FrozenLakeTextEnv, pool: StatePool, *, gamma: float = DEFAULT_GAMMA
) -> StateValues:
    """Q* of every state of ``pool`` on ``env``'s maps and dynamics (:func:`qstar.q_star`)."""
    tasks, which = np.unique(pool.task_id, return_inverse=True)
    horizon = int(pool.budget.max())
    q = np.asarray(
        qstar.q_star(
            env.maps[tasks],
            horizon,
            gamma=gamma,
            is_slippery=env.config.is_slippery,
            success_rate=env.config.success_rate,
        ),
        np.float64,
    )
    remaining = pool.budget - pool.turn
    values = q[which, remaining, pool.pos]  # [S, 4]
    noop = gamma * q[which, remaining - 1, pool.pos].max(axis=1)  # V* one move later, same cell
    return StateValues(values, noop, float(gamma))


# ---------------------------------------------------------------- step quality (§7.1)


@dataclasses.dataclass(frozen=True)
class StepQuality:
    """Per-state quality of two policies on one pool of states.

    ``quality[name]``: ``[S]`` mean quality over the ``G`` actions; ``actions[name]``:
    ``[S, G]`` (-1 invalid); ``names``: ``(base, RL)``.
    """

    names: tuple[str, str]
    pool: StatePool
    values: StateValues
    actions: dict[str, np.ndarray]
    quality: dict[str, np.ndarray]
    invalid: str

    @property
    def informative(self) -> np.ndarray:
        """``[S]`` states where the actions differ in value (by more than :data:`VALUE_TOL`);
        at the others every policy ties by construction."""
        return self.values.spread > VALUE_TOL

    def invalid_share(self) -> dict[str, float]:
        return {name: float(np.mean(a < 0)) for name, a in self.actions.items()}

    def comparison(self, informative_only: bool = False) -> stats.PairedComparison:
        base, rl = self.names
        keep = self.informative if informative_only else np.ones(len(self.pool), bool)
        if not keep.any():
            raise ValueError("StepQuality.comparison: no state where the actions differ in value")
        return stats.paired_comparison(self.quality[rl][keep], self.quality[base][keep])

    def pools(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """``{pool: (q_base [S'], q_rl [S'])}`` for :mod:`~agentrl_jax.evaluation.analyses.
        step_quality`: all states and, if some states are ties by construction, those where the
        actions differ."""
        base, rl = self.names
        out = {"all": (self.quality[base], self.quality[rl])}
        keep = self.informative
        if keep.any() and not keep.all():
            out["actions_differ"] = (self.quality[base][keep], self.quality[rl][keep])
        return out

    def summary(self) -> dict[str, Any]:
        record = {
            "states": len(self.pool),
            "gamma": self.values.gamma,
            "invalid_scored_as": self.invalid,
            "invalid_share": self.invalid_share(),
            "states_where_actions_differ": int(self.informative.sum()),
            "comparison": self.comparison().to_dict(),
        }
        if self.informative.any():
            record["comparison_where_actions_differ"] = self.comparison(True).to_dict()
        return record


def _check_names(names: tuple[str, str]) -> tuple[str, str]:
    if len(names) != 2 or names[0] == names[1]:
        raise ValueError(f"`names` must be two distinct policy names (base, RL), got {names!r}")
    return tuple(names)


def compare_actions(
    names: tuple[str, str],
    pool: StatePool,
    values: StateValues,
    actions: dict[str, np.ndarray],
    invalid: str = "noop",
) -> StepQuality:
    """:class:`StepQuality` from sampled actions ``{name: [S, G]}`` of both policies."""
    names = _check_names(names)
    missing = [n for n in names if n not in actions]
    if missing:
        raise ValueError(f"compare_actions: no actions for {missing}")
    quality = {n: values.quality(actions[n], invalid).mean(axis=1) for n in names}
    return StepQuality(
        names, pool, values, {n: np.asarray(actions[n]) for n in names}, quality, invalid
    )


def step_quality(
    starts: StateStarts,
    values: StateValues,
    base: Policy,
    rl: Policy,
    key: jax.Array,
    *,
    names: tuple[str, str] = ("base", "RL"),
    invalid: str = "noop",
) -> StepQuality:
    """§7.1: ``G`` one-turn samples of each policy from every state of ``starts.pool``.

    ``G`` is ``starts.config.group_size``. Both policies are played with the same key.
    """
    names = _check_names(names)
    played = {n: starts.play(p, key, first_turn_only=True) for n, p in zip(names, (base, rl))}
    return compare_actions(
        names, starts.pool, values, {n: p.action for n, p in played.items()}, invalid
    )


# ---------------------------------------------------------------- error states (§7.2)


@dataclasses.dataclass(frozen=True)
class ErrorStateResult:
    """Action quality at error states and continuation success from them.

    ``quality``: the :class:`StepQuality` of the first turns at the error states;
    ``success[name]``: ``[E, G]`` bool, whether each continuation reached the goal within the
    remaining budget; ``overflow[name]``: ``[E, G]`` it ran out of context (and ended);
    ``errors``: how the states were made.
    """

    errors: ErrorStates
    quality: StepQuality
    success: dict[str, np.ndarray]
    overflow: dict[str, np.ndarray]

    def continuation(self) -> dict[str, stats.MeanCI]:
        """Each policy's continuation success rate with a Wilson 95% CI over all ``E * G``
        continuations (states weigh equally: each has ``G``)."""
        return {n: stats.proportion_ci_wilson(s) for n, s in self.success.items()}

    def paired_success(self) -> stats.PairedComparison:
        """Per-state continuation success of RL vs base on the same error states."""
        base, rl = self.quality.names
        return stats.paired_comparison(
            self.success[rl].mean(axis=1), self.success[base].mean(axis=1)
        )

    def summary(self) -> dict[str, Any]:
        return {
            "error_states": len(self.errors.states),
            "quality": self.quality.summary(),
            "continuation_success": {n: c.to_dict() for n, c in self.continuation().items()},
            "continuation_paired": self.paired_success().to_dict(),
            "continuation_overflow_share": {n: float(o.mean()) for n, o in self.overflow.items()},
        }


def error_state_analysis(
    starts: StateStarts,
    errors: ErrorStates,
    values: StateValues,
    base: Policy,
    rl: Policy,
    key: jax.Array,
    *,
    names: tuple[str, str] = ("base", "RL"),
    invalid: str = "noop",
) -> ErrorStateResult:
    """§7.2 on error states: ``starts`` must be built on ``errors.states`` and ``values`` be
    their :func:`state_values`. Each policy plays ``G`` whole continuations from every error
    state (same key for both); the first turn of each is its action sample."""
    names = _check_names(names)
    if len(starts.pool) != len(errors.states) or not np.array_equal(
        starts.pool.pos, errors.states.pos
    ):
        raise ValueError("error_state_analysis: `starts` is not built on `errors.states`")
    played: dict[str, StatePlay] = {
        n: starts.play(p, key, first_turn_only=False) for n, p in zip(names, (base, rl))
    }
    quality = compare_actions(
        names, errors.states, values, {n: p.action for n, p in played.items()}, invalid
    )
    return ErrorStateResult(
        errors,
        quality,
        {n: p.success for n, p in played.items()},
        {n: p.overflow for n, p in played.items()},
    )


# ---------------------------------------------------------------- playing states (§7.1-7.3)


def play_visits(
    play: drivers.Play, policies: Mapping[str, Policy], key: jax.Array, *, samples: int, budget: int
) -> dict[str, StatePool]:
    """``{policy: the states its trajectories act from}``: ``samples`` per task at ``budget``,
    what §7.1's matched pools are drawn from
    (:func:`~agentrl_jax.reproduce.studies.frozenlake.states.matched_pool`)."""
    out = {}
    for name, policy in policies.items():
        play.echo(f"Source trajectories: {name}, {play.tasks} tasks x {samples} at T={budget}")
        out[name] = visited_states(play.rollout(policy, key, samples=samples, budget=budget))
    return out


def play_step_quality(
    play: drivers.Play,
    pool: StatePool,
    base: Policy,
    rl: Policy,
    key: jax.Array,
    *,
    names: tuple[str, str],
    group_size: int,
    gamma: float,
    invalid: str,
) -> tuple[StateValues, StepQuality]:
    """Q* of every action at the states of ``pool`` and each policy's ``group_size`` actions
    there, scored (:func:`diagnostics.step_quality`; ``result.pools()`` feeds
    :mod:`~agentrl_jax.evaluation.analyses.step_quality`, :func:`diagnostics.quality_by_depth`
    :mod:`~agentrl_jax.evaluation.analyses.depth`)."""
    values = state_values(play.env, pool, gamma=gamma)
    result = step_quality(
        _starts(play, pool, group_size), values, base, rl, key, names=names, invalid=invalid
    )
    return values, result


def play_error_states(
    play: drivers.Play,
    errors: ErrorStates,
    base: Policy,
    rl: Policy,
    key: jax.Array,
    *,
    names: tuple[str, str],
    group_size: int,
    gamma: float,
    invalid: str,
) -> tuple[StateValues, ErrorStateResult]:
    """Action quality and ``group_size`` continuations of each policy from injected error
    states (:func:`diagnostics.error_state_analysis`; ``result.quality.pools()`` feeds
    :mod:`~agentrl_jax.evaluation.analyses.step_quality`, ``result.success``
    :mod:`~agentrl_jax.evaluation.analyses.continuation`)."""
    values = state_values(play.env, errors.states, gamma=gamma)
    result = error_state_analysis(
        _starts(play, errors.states, group_size),
        errors,
        values,
        base,
        rl,
        key,
        names=names,
        invalid=invalid,
    )
    return values, result


def _starts(play: drivers.Play, pool: StatePool, group_size: int) -> StateStarts:
    """Plays from the states of ``pool``, ``group_size`` per state."""
    return StateStarts(
        play.env,
        play.tokenizer,
        pool,
        dataclasses.replace(play.config, group_size=group_size),
        states_per_call=play.states_per_call,
    )


# ---------------------------------------------------------------- the study's state diagnostics


class QStarStates:
    """FrozenLake's states and exact Q* (the module docstring) on ``env``, a
    :class:`~envs.frozenlake.text_env.FrozenLakeTextEnv`."""

    quality_name = "action quality"  # Q*(s, a) with the remaining horizon
    quality_symbol = "Q*"
    suite = "frozenlake-error-recovery/v1"
    error_note = "one injected move that lengthens the shortest path to the goal"
    success_note = "reaching the goal within the remaining budget"
    gamma = DEFAULT_GAMMA  # the discount of Q*, the step quality (§7)
    # the span of a response the action is read from (the erosion's action tokens): the last
    # <answer> tag and its content (envs.frozenlake.text)
    action_pattern = r"(?i)<\s{0,4}answer\s{0,4}>.*?(?:<\s{0,4}/\s{0,4}answer\s{0,4}>|$)"
    action_note = "the last <answer>...</answer> tag, tags included"

    def __init__(self, env: Any):
        self.env = env

    def invalid_note(self, settings: Any) -> str:
        return f"{settings.invalid}-scored"

    def visits(
        self,
        play: drivers.Play,
        policies: Mapping[str, Policy],
        key: jax.Array,
        *,
        samples: int,
        budget: int,
    ) -> dict[str, Any]:
        return play_visits(play, policies, key, samples=samples, budget=budget)

    def matched(self, base: Any, other: Any, *, size: int, seed: int) -> Any:
        return matched_pool(base, other, size=size, seed=seed)

    def steps(
        self,
        play: drivers.Play,
        pool: Any,
        base: Policy,
        rl: Policy,
        key: jax.Array,
        *,
        names: tuple[str, str],
        settings: Any,
    ) -> tuple[Any, dict[str, Any]]:
        values, result = play_step_quality(
            play,
            pool,
            base,
            rl,
            key,
            names=names,
            group_size=settings.group_size,
            gamma=self.gamma,
            invalid=settings.invalid,
        )
        return result, {
            "states": columns(pool, names),
            "action_values": values.action_values,
            "noop_value": values.noop_value,
            "actions": result.actions,
            "quality": result.quality,
        }

    def errors(
        self,
        play: drivers.Play,
        pool: Any,
        base: Policy,
        rl: Policy,
        key: jax.Array,
        *,
        names: tuple[str, str],
        settings: Any,
    ) -> tuple[Any, dict[str, Any]]:
        errors = inject_errors(self.env.maps, pool, seed=settings.seed)
        if len(errors.states) == 0:
            raise ValueError(
                f"errors: no state of the {names} pool admits an error move with a turn left"
            )
        values, result = play_error_states(
            play,
            errors,
            base,
            rl,
            key,
            names=names,
            group_size=settings.group_size,
            gamma=self.gamma,
            invalid=settings.invalid,
        )
        return result, {
            "states": columns(errors.states, names),
            "origin": errors.origin,
            "injected_action": errors.action,
            "action_values": values.action_values,
            "noop_value": values.noop_value,
            "actions": result.quality.actions,
            "quality": result.quality.quality,
            "success": result.success,
            "overflow": result.overflow,
        }
