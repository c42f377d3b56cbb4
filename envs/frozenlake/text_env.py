"""FrozenLake as a :class:`~envs.protocol.TextEnv`: a task set of maps, played as text.

A task is one map of the set (``task_ids`` index it). A batch of ``N`` rows is reset and
stepped in one jitted call each (static shapes: the batch size, the map size and ``t_max``;
compiled once per batch size, counted in :attr:`FrozenLakeTextEnv.trace_counts`). The host
side only parses responses (:func:`envs.frozenlake.text.parse_action`) and renders grids
(:func:`envs.frozenlake.text.render`).

Per turn and row:

* the observation is the rendered grid (``P`` marks the player; see :mod:`.text`);
* a response that does not parse is an invalid action: a no-op (the player stays, no slip is
  drawn) with ``action_valid`` False and ``action`` -1; it still uses the turn;
* ``anchor_key`` is the flat cell the turn acted from (``row * n + col``): within a task group
  (one map) equal keys are the same environment state, which is what GiGPO's anchors need;
  across maps keys collide, so the trainer groups anchors per task group (and, under BudgetMix,
  adds ``B - t``, see :func:`agentrl_jax.algorithms.budgetmix.budget_anchor_keys`);
* ``state_id`` is that same cell (the Q* diagnostics read it, as ``Trajectory.state_id``);
* ``reward`` is 1 on entering the goal; ``success`` is having reached it; a row is ``done``
  on a hole or the goal, or after ``t_max`` turns (a safety net: the rollout ends rows at
  their budget ``B <= t_max`` first).

Randomness, designed for exact replay: row ``i`` of ``reset(task_ids, seed)`` owns the key
``fold_in(key(seed), i)``, and its turn ``t`` draws the slip from
``split(row_key, t_max)[t]`` with :func:`envs.frozenlake.env.step`, exactly the keys
:func:`envs.frozenlake.optimal.play_greedy` uses with ``max_turns = t_max``. So a Q*-greedy
agent played through text reproduces ``play_greedy`` episode for episode.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from envs.frozenlake import env as fl_env
from envs.frozenlake import qstar as fl_qstar
from envs.frozenlake import text as fl_text
from envs.protocol import TurnResult

INSTRUCTIONS = """\
You are on a frozen lake, shown as a grid with one line per row:
P is you, _ is frozen ice, O is a hole, G is the goal.
Reach the goal without falling into a hole. Each turn, move one cell: Left, Down, Right or Up \
(moving into the edge leaves you in place).{slip}
Reply with your move inside answer tags, for example <answer>Left</answer>. You may think \
before answering; only the answer is read."""

SLIP_TEXT = (
    " The ice is slippery: you move in the intended direction with probability "
    "{intended:.0%}, otherwise to one of the two directions at right angles to it."
)


@dataclasses.dataclass(frozen=True)
class FrozenLakeTextConfig:
    """Dynamics and the largest budget (paper §2: ``t_max`` 70)."""

    t_max: int = 70
    is_slippery: bool = True
    success_rate: float = 1.0 / 3.0

    def __post_init__(self):
        if isinstance(self.t_max, bool) or not isinstance(self.t_max, int) or self.t_max < 1:
            raise ValueError(f"FrozenLakeTextConfig.t_max must be an int >= 1, got {self.t_max!r}")
        if not isinstance(self.is_slippery, bool):
            raise ValueError(
                f"FrozenLakeTextConfig.is_slippery must be a bool, got {self.is_slippery!r}"
            )
        if not 0.0 <= float(self.success_rate) <= 1.0:
            raise ValueError(
                f"FrozenLakeTextConfig.success_rate must be in [0, 1], got {self.success_rate!r}"
            )


@struct.dataclass
class FrozenLakeRows:
    """The batch state: ``N`` environments (leading axis), their keys, turns and outcomes."""

    env: fl_env.EnvState  # tiles [N, n, n], pos [N], t [N], done [N]
    keys: jax.Array  # [N] typed PRNG keys, one per row
    turn: jax.Array  # [N] int32 turns played (invalid ones included)
    done: jax.Array  # [N] bool
    success: jax.Array  # [N] bool
    task_id: jax.Array  # [N] int32


@struct.dataclass
class _StepOut:
    reward: jax.Array  # [N] float32
    valid: jax.Array  # [N] bool: the row acted with a parsed action
    pos_before: jax.Array  # [N] int32


def reset_rows(maps: jax.Array, task_ids: jax.Array, seed: jax.Array) -> FrozenLakeRows:
    """Rows on ``maps[task_ids]``, row ``i`` keyed ``fold_in(key(seed), i)``."""
    _, env = jax.vmap(fl_env.reset_to_map)(maps[task_ids])
    base = jax.random.key(seed)
    keys = jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.arange(task_ids.shape[0]))
    n = task_ids.shape[0]
    return FrozenLakeRows(
        env=env,
        keys=keys,
        turn=jnp.zeros(n, jnp.int32),
        done=jnp.zeros(n, bool),
        success=jnp.zeros(n, bool),
        task_id=task_ids.astype(jnp.int32),
    )


def step_rows(
    rows: FrozenLakeRows, actions: jax.Array, live: jax.Array, params: fl_env.EnvParams, t_max: int
) -> tuple[FrozenLakeRows, _StepOut]:
    """One turn for ``live`` rows that are not done; ``actions`` ``int32[N]``, -1 = invalid."""
    acting = live & ~rows.done
    moving = acting & (actions >= 0)
    turn_key = lambda key, t: jax.random.split(key, t_max)[t]  # noqa: E731  (play_greedy's keys)
    keys = jax.vmap(turn_key)(rows.keys, jnp.minimum(rows.turn, t_max - 1))
    _, stepped, reward, _, _ = jax.vmap(fl_env.step, in_axes=(0, 0, 0, None))(
        keys, rows.env, jnp.maximum(actions, 0), params
    )
    env = jax.tree.map(
        lambda new, old: jnp.where(moving.reshape(moving.shape + (1,) * (new.ndim - 1)), new, old),
        stepped,
        rows.env,
    )
    reward = jnp.where(moving, reward, 0.0)
    turn = rows.turn + acting.astype(jnp.int32)
    success = rows.success | (reward > 0)
    done = rows.done | (moving & env.done) | (acting & (turn >= t_max))
    new = rows.replace(env=env, turn=turn, done=done, success=success)
    return new, _StepOut(reward=reward, valid=moving, pos_before=rows.env.pos)


class FrozenLakeTextEnv:
    """FrozenLake maps as a text task set (see the module docstring)."""

    name = "frozenlake"

    def __init__(self, maps: Any, config: FrozenLakeTextConfig = FrozenLakeTextConfig()):
        """``maps``: ``int8[M, n, n]`` (e.g. :func:`envs.frozenlake.maps.generate`), one map
        ``[n, n]``, or a default map name."""
        self.config = config
        self.t_max = config.t_max
        # max_steps=None: only the rollout's budget (and t_max) ends an episode by time.
        self.params = fl_env.make_params(
            maps, is_slippery=config.is_slippery, success_rate=config.success_rate, max_steps=None
        )
        self.maps = np.asarray(self.params.maps)
        self.trace_counts: collections.Counter[str] = collections.Counter()
        self._reset = jax.jit(self._traced("reset", reset_rows))
        self._step = jax.jit(self._traced("step", step_rows), static_argnames="t_max")
        self._render = functools.lru_cache(maxsize=1 << 16)(self._render_uncached)

    def _traced(self, name, fn):
        def counted(*args, **kwargs):
            self.trace_counts[name] += 1
            return fn(*args, **kwargs)

        return counted

    def instructions(self) -> str:
        slip = (
            SLIP_TEXT.format(intended=self.config.success_rate) if self.config.is_slippery else ""
        )
        return INSTRUCTIONS.format(slip=slip)

    def num_tasks(self) -> int:
        return self.maps.shape[0]

    @functools.cached_property
    def _shortest_paths(self) -> np.ndarray:
        return np.asarray(fl_qstar.shortest_path_length(self.maps))

    def structural_bounds(self, task_ids: Any) -> np.ndarray:
        """``int[K]``: the fewest moves from start to goal of each task's map (§2): a budget
        below it cannot succeed (adaptive BudgetMix draws none; unreachable goals are a large
        number, above any budget)."""
        return self._shortest_paths[np.asarray(task_ids)]

    def _render_uncached(self, task_id: int, pos: int) -> str:
        return fl_text.render(self.maps[task_id], pos)

    def reset(self, task_ids: np.ndarray, seed: int) -> tuple[FrozenLakeRows, list[str]]:
        task_ids = np.asarray(task_ids)
        if (
            task_ids.ndim != 1
            or not np.issubdtype(task_ids.dtype, np.integer)
            or np.any(task_ids < 0)
            or np.any(task_ids >= self.num_tasks())
        ):
            raise ValueError(
                f"task_ids must be a 1-D int array in [0, {self.num_tasks()}), got {task_ids!r}"
            )
        if (
            isinstance(seed, bool)
            or not isinstance(seed, (int, np.integer))
            or not 0 <= seed < 2**31
        ):
            raise ValueError(f"seed must be an int in [0, 2**31), got {seed!r}")
        rows = self._reset(
            jnp.asarray(self.maps), jnp.asarray(task_ids, jnp.int32), jnp.asarray(seed, jnp.int32)
        )
        pos = np.asarray(rows.env.pos)
        return rows, [self._render(int(t), int(p)) for t, p in zip(task_ids, pos)]

    def parse(self, responses: Sequence[str], live: np.ndarray) -> np.ndarray:
        """``int32[N]`` action codes of the live rows' responses (-1: invalid or not live)."""
        return np.array(
            [fl_text.parse_action(r) if on else fl_text.INVALID for r, on in zip(responses, live)],
            np.int32,
        )

    def step(
        self, rows: FrozenLakeRows, responses: Sequence[str], live: np.ndarray
    ) -> tuple[FrozenLakeRows, TurnResult]:
        live = np.asarray(live, bool)
        if len(responses) != live.shape[0] or live.shape != rows.done.shape:
            raise ValueError(
                f"step: {len(responses)} responses and live {live.shape} must match "
                f"the {rows.done.shape[0]} rows"
            )
        actions = self.parse(responses, live)
        rows, out = self._step(
            rows, jnp.asarray(actions), jnp.asarray(live), self.params, t_max=self.t_max
        )
        done, success, pos, task, out = jax.device_get(
            (rows.done, rows.success, rows.env.pos, rows.task_id, out)
        )
        observations = [
            self._render(int(task[i]), int(pos[i])) if live[i] and not done[i] else ""
            for i in range(live.shape[0])
        ]
        return rows, TurnResult(
            observations=observations,
            reward=out.reward.astype(np.float32),
            done=done,
            success=success,
            action=np.where(out.valid, actions, -1).astype(np.int32),
            action_valid=out.valid,
            anchor_key=out.pos_before.astype(np.int32),
            quality=np.full(live.shape[0], np.nan, np.float32),
            state_id=out.pos_before.astype(np.int32),
        )
