"""FrozenLake states for the diagnostics (PAPER.md §7): pools of visited states, injected
errors, and episodes that start at a state.

A *state* is ``(task, pos, t, B)``: map ``task`` of the environment's task set, the player's
flat cell ``pos``, the turns already played ``t`` and the trajectory's budget ``B``
(``0 <= t < B``). Its step quality is ``Q*(pos, a)`` with ``B - t`` moves left.

What a policy sees when it acts from a state
--------------------------------------------
A fresh conversation: the system prompt states the budget ``B``, and its one user message
is the budget-aware message of turn ``t`` (``[MAX TURNS] B [CURRENT TURN] t [REMAINING
TURNS] B - t`` and the grid with the player at ``pos``). Earlier turns are not shown.
FrozenLake is Markov in (map, position, remaining budget), which that message states in
full, so both policies are asked about exactly the same state whichever trajectory it came
from. Left out is the conversation that led there: an error state, for instance, is not
presented as the policy's own mistake. Later turns of a continued episode are appended as the
rollout always does (the response, then turn ``t + 1``'s message, ...).

How (the rollout is reused unchanged):

1. each state becomes a task of a derived :class:`FrozenLakeTextEnv` whose map is the state's
   map with START moved to ``pos`` (START and ice render alike and have the same dynamics, so
   grid text, Q* and slips are those of the state);
2. the rollout's budget for the state's group is the remaining ``B - t``, so the episode
   stops after ``B - t`` turns, as the original one would have;
3. :class:`StatePrompt` renders the episode's turn ``k`` as turn ``t + k`` of ``B``.

``StatePrompt`` knows ``B`` as a constant, so states are played in one rollout call per
distinct budget ``B`` (usually one: the source trajectories share a budget).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from agentrl_jax.evaluation.state_prompt import SOURCES, FirstTurnOnly, StatePrompt
from agentrl_jax.rollout import MultiTurnRollout, RolloutConfig
from agentrl_jax.sampling import Policy
from agentrl_jax.trajectory import Trajectory
from envs.frozenlake import grid, qstar
from envs.frozenlake.text_env import FrozenLakeTextEnv

# ---------------------------------------------------------------- pools of states


@dataclasses.dataclass(frozen=True)
class StatePool:
    """``S`` states as parallel ``[S]`` int arrays (see the module docstring)."""

    task_id: np.ndarray
    pos: np.ndarray
    turn: np.ndarray
    budget: np.ndarray
    source: np.ndarray  # index into SOURCES, -1 when not from a labelled pool

    def __post_init__(self):
        arrays = {f.name: np.asarray(getattr(self, f.name)) for f in dataclasses.fields(self)}
        shapes = {name: a.shape for name, a in arrays.items()}
        if any(len(s) != 1 for s in shapes.values()) or len(set(shapes.values())) != 1:
            raise ValueError(f"StatePool: fields must be 1-D arrays of one length, got {shapes}")
        for name, a in arrays.items():
            if a.size and a.dtype.kind not in "iu":
                raise ValueError(f"StatePool.{name} must hold integers, got dtype {a.dtype}")
            object.__setattr__(self, name, a.astype(np.int64))
        if np.any(self.turn < 0) or np.any(self.turn >= self.budget):
            raise ValueError("StatePool: every state needs 0 <= turn < budget")

    def __len__(self) -> int:
        return int(self.task_id.size)

    def take(self, index: Any) -> "StatePool":
        return StatePool(**{f.name: getattr(self, f.name)[index] for f in dataclasses.fields(self)})

    def to_columns(self) -> dict[str, list[int]]:
        """``{field: values}`` for a CSV (``source`` as its label)."""
        columns = {f.name: getattr(self, f.name).tolist() for f in dataclasses.fields(self)}
        columns["source"] = [SOURCES[s] if s >= 0 else "" for s in self.source]
        return columns


def concat_pools(pools: Sequence[StatePool]) -> StatePool:
    return StatePool(
        **{
            f.name: np.concatenate([getattr(p, f.name) for p in pools])
            for f in dataclasses.fields(StatePool)
        }
    )


def visited_states(trajectory: Trajectory, source: int = -1) -> StatePool:
    """Every state a rollout acted from: one per real turn of each real row (a state visited
    twice counts twice, so sampling the pool weights states by how often they are visited).

    Reads ``task_id``, ``state_id`` (the cell before the turn's move), ``budget`` and the turn
    index; the trajectory must come from a FrozenLake rollout (``state_id`` >= 0 on real turns).
    """
    traj = jax.device_get(trajectory)
    turn_mask = np.asarray(traj.turn_mask, bool) & np.asarray(traj.row_mask, bool)[:, None]
    rows, turns = np.nonzero(turn_mask)
    pos = np.asarray(traj.state_id)[rows, turns]
    if np.any(pos < 0):
        raise ValueError(
            "visited_states: the trajectory has real turns without a state_id "
            "(not a FrozenLake rollout?)"
        )
    return StatePool(
        task_id=np.asarray(traj.task_id)[rows],
        pos=pos,
        turn=turns,
        budget=np.asarray(traj.budget)[rows],
        source=np.full(rows.size, source),
    )


def matched_pool(base: StatePool, rl: StatePool, size: int, seed: int = 0) -> StatePool:
    """A pool of ``size`` states, half visited by the base policy and half by the RL one
    (§7.1), each half drawn uniformly without replacement from that policy's visits.

    If a policy visited fewer than ``size // 2`` states, both halves shrink to the smaller
    count, so the pool stays balanced. Sources are recorded in ``source`` (0 base, 1 RL).
    """
    if size < 2:
        raise ValueError(f"matched_pool: `size` must be >= 2, got {size}")
    half = min(size // 2, len(base), len(rl))
    if half == 0:
        raise ValueError(f"matched_pool: no states to draw from (base {len(base)}, RL {len(rl)})")
    rng = np.random.default_rng(seed)
    halves = []
    for code, pool in enumerate((base, rl)):
        chosen = np.sort(rng.choice(len(pool), half, replace=False))
        halves.append(dataclasses.replace(pool.take(chosen), source=np.full(half, code)))
    return concat_pools(halves)


# ---------------------------------------------------------------- error states (§7.2)


@dataclasses.dataclass(frozen=True)
class ErrorStates:
    """States reached by injecting one error into states of a pool.

    ``states``: the error states ``(task, pos', t + 1, B)``; ``origin``: ``[E]`` index of the
    state each was made from; ``action``: ``[E]`` the injected action.
    """

    states: StatePool
    origin: np.ndarray
    action: np.ndarray


def inject_errors(maps: np.ndarray, pool: StatePool, seed: int = 0) -> ErrorStates:
    """From each state of ``pool``, take one action that increases the shortest-path distance
    to the goal (:func:`envs.frozenlake.qstar.error_actions`: a deterministic move, never
    into a hole or the border) and return the state it leads to, one turn later.

    The action is drawn uniformly among the state's error actions. States with no error
    action, or with no turn left after it (``t + 1 == B``), are skipped.
    """
    maps = np.asarray(maps)
    errors = np.asarray(qstar.error_actions(maps[pool.task_id], pool.pos))  # [S, 4]
    eligible = errors.any(axis=1) & (pool.turn + 1 < pool.budget)
    origin = np.flatnonzero(eligible)
    rng = np.random.default_rng(seed)
    action = np.array([rng.choice(np.flatnonzero(errors[i])) for i in origin], np.int64)
    source = pool.take(origin)
    n = maps.shape[-1]
    states = dataclasses.replace(source, pos=grid.move(source.pos, action, n), turn=source.turn + 1)
    return ErrorStates(states, origin, action)


# ---------------------------------------------------------------- episodes from states


def maps_at_states(maps: np.ndarray, pool: StatePool) -> np.ndarray:
    """``int8[S, n, n]``: each state's map with START moved to the state's cell."""
    maps = np.asarray(maps)
    out = maps[pool.task_id].copy()
    flat = out.reshape(len(pool), -1)
    if np.any(pool.pos < 0) or np.any(pool.pos >= flat.shape[1]):
        raise ValueError(f"maps_at_states: positions must be cells 0..{flat.shape[1] - 1}")
    if np.any(grid.is_terminal_tile(flat[np.arange(len(pool)), pool.pos])):
        raise ValueError(
            "maps_at_states: a state stands on a hole or the goal (a finished "
            "episode has no state to act from)"
        )
    flat[flat == grid.START] = grid.FROZEN
    flat[np.arange(len(pool)), pool.pos] = grid.START
    return out


@dataclasses.dataclass(frozen=True)
class StatePlay:
    """``G`` episodes from each state: ``[S, G]`` arrays.

    ``action``: the first turn's parsed action (-1 invalid); ``success``: reached the goal
    within the remaining budget (always False for first-turn-only play unless that move
    entered the goal); ``turns``: turns played; ``overflow``: the episode ran out of context
    (it ended there, unsuccessful unless it had already succeeded).
    """

    action: np.ndarray
    success: np.ndarray
    turns: np.ndarray
    overflow: np.ndarray


class StateStarts:
    """Episodes of any policy started at the states of ``pool`` (see the module docstring).

    Build it once per pool and play every policy with it (the derived environment and the
    rollout runners are shared, so are their compilations). ``config`` supplies the rollout
    settings: ``group_size`` is ``G`` (episodes per state); its ``budget`` is ignored (each
    state has its own) and its ``prompt`` wording is kept. ``states_per_call`` bounds the
    states of one rollout call; every call is then padded to that many states (repeating
    one), so every call has the same shapes.
    """

    def __init__(
        self,
        env: FrozenLakeTextEnv,
        tokenizer,
        pool: StatePool,
        config: RolloutConfig,
        *,
        states_per_call: int | None = None,
    ):
        if not isinstance(env, FrozenLakeTextEnv):
            raise TypeError(f"StateStarts needs a FrozenLakeTextEnv, got {type(env).__name__}")
        if len(pool) == 0:
            raise ValueError("StateStarts: the pool has no states")
        if np.any(pool.budget > env.t_max):
            raise ValueError(
                f"StateStarts: budgets up to {pool.budget.max()} exceed the "
                f"environment's t_max={env.t_max}"
            )
        if states_per_call is not None and states_per_call < 1:
            raise ValueError(f"StateStarts: `states_per_call` must be >= 1, got {states_per_call}")
        self.pool, self.tokenizer, self.states_per_call = pool, tokenizer, states_per_call
        self.config = dataclasses.replace(config, budget=None)
        self.env = FrozenLakeTextEnv(maps_at_states(env.maps, pool), env.config)
        self._first_turn_env = FirstTurnOnly(self.env)
        self._runners: dict[tuple[int, bool], MultiTurnRollout] = {}

    def runner(self, budget: int, first_turn_only: bool) -> MultiTurnRollout:
        """The rollout runner of the states whose budget is ``budget``."""
        key = (int(budget), bool(first_turn_only))
        if key not in self._runners:
            config = dataclasses.replace(
                self.config, prompt=StatePrompt.of(self.config.prompt, budget)
            )
            env = self._first_turn_env if first_turn_only else self.env
            self._runners[key] = MultiTurnRollout(env, self.tokenizer, config)
        return self._runners[key]

    def calls(self) -> list[tuple[int, np.ndarray, int]]:
        """``(budget B, state indices, real count)`` of each rollout call, padded as documented."""
        out = []
        for budget in np.unique(self.pool.budget):
            index = np.flatnonzero(self.pool.budget == budget)
            size = self.states_per_call or index.size
            for start in range(0, index.size, size):
                chunk = index[start : start + size]
                padded = np.concatenate([chunk, np.full(size - chunk.size, chunk[-1])])
                out.append((int(budget), padded, int(chunk.size)))
        return out

    def play(self, policy: Policy, key: jax.Array, *, first_turn_only: bool) -> StatePlay:
        """``G`` episodes of ``policy`` from every state (one turn each if ``first_turn_only``).

        Call ``c`` uses ``fold_in(key, c)``: two policies played with the same key meet the same
        environment randomness (slips), which makes their comparison paired.

        Raises:
          ValueError: when a state's prompt does not fit ``max_context`` (no action could be
            sampled; it would otherwise look like an invalid response).
        """
        size, g = len(self.pool), self.config.group_size
        fields = {
            "action": np.full((size, g), -1, np.int64),
            "success": np.zeros((size, g), bool),
            "turns": np.zeros((size, g), np.int64),
            "overflow": np.zeros((size, g), bool),
        }
        for call, (budget, index, real) in enumerate(self.calls()):
            remaining = budget - self.pool.turn[index]
            result = self.runner(budget, first_turn_only)(
                policy, index, jax.random.fold_in(key, call), budgets=remaining
            )
            traj = jax.device_get(result.trajectory)
            per_row = {
                "action": np.asarray(traj.action)[:, 0],
                "success": traj.success,
                "turns": traj.turns_used,
                "overflow": traj.overflow,
            }
            for name, values in per_row.items():
                fields[name][index[:real]] = np.asarray(values).reshape(-1, g)[:real]
        if np.any(fields["turns"] == 0):
            raise ValueError(
                f"StateStarts.play: the prompt of a state does not fit max_context="
                f"{self.config.max_context}; raise it"
            )
        return StatePlay(**fields)
