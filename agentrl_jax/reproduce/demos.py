"""Demonstrations for the warm-start: a scripted Q*-greedy FrozenLake agent with mistakes.

A pretrained LLM is competent but fallible; a random-init policy is neither. The reproduction
makes its base policy by behaviour cloning :class:`QStarDemonstrator`, which reads the prompt
like a model would (the last grid and the remaining budget), plays the move that maximises the
probability of reaching the goal within the remaining turns (finite-horizon Q* with gamma 1,
so it is budget-aware), and with probability ``mistake_rate`` plays a uniformly random other
move instead. :func:`collect_demos` plays it through the real rollout, so the demonstrations
are token for token what a policy sees and samples (chat template, budget prompt, stop token).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

import jax
import numpy as np

from agentrl_jax.policy import ScriptedPolicy
from agentrl_jax.rollout import MultiTurnRollout, RolloutConfig
from agentrl_jax.trajectory import Trajectory
from envs.frozenlake import grid, qstar
from envs.frozenlake.text import parse_grid

# The last user message of a context: its remaining budget and grid (the default BudgetPrompt).
_LAST_TURN = re.compile(r"\[REMAINING TURNS\] (\d+)\n(.*?)<\|im_end\|>", re.S)


def _map_key(tiles: np.ndarray) -> bytes:
    """Tiles as the prompt shows them: the start cell is plain ice (same dynamics)."""
    tiles = np.asarray(tiles, np.int8)
    return np.where(tiles == grid.START, grid.FROZEN, tiles).astype(np.int8).tobytes()


class QStarDemonstrator:
    """A :data:`~agentrl_jax.policy.Script`: ``(contexts, live) -> replies``.

    maps: ``int8[M, n, n]``, every map it may be shown (Q* is computed for all at once).
    horizon: the largest remaining budget it may see (``T_max``).
    mistake_rate: probability of a uniformly random move other than the greedy one.
    """

    def __init__(self, maps: Any, horizon: int, *, is_slippery: bool, success_rate: float,
                 mistake_rate: float = 0.0, seed: int = 0):
        if not 0.0 <= mistake_rate <= 1.0:
            raise ValueError(f"mistake_rate must be in [0, 1], got {mistake_rate!r}")
        maps = np.asarray(maps, np.int8)
        q = np.asarray(qstar.q_star(maps, horizon, gamma=1.0, is_slippery=is_slippery,
                                    success_rate=success_rate))  # [M, H + 1, S, 4]
        self._q = {_map_key(m): q[i] for i, m in enumerate(maps)}
        self.horizon, self.mistake_rate = horizon, mistake_rate
        self.rng = np.random.default_rng(seed)
        self.moves = 0
        self.mistakes = 0

    def action(self, tiles: np.ndarray, pos: int, remaining: int) -> int:
        """The greedy move (ties to the lowest code), or with ``mistake_rate`` another one."""
        table = self._q.get(_map_key(tiles))
        if table is None:
            raise ValueError("QStarDemonstrator: shown a map it was not given")
        best = int(np.argmax(table[min(remaining, self.horizon), pos]))
        self.moves += 1
        if self.rng.random() < self.mistake_rate:
            self.mistakes += 1
            return int((best + 1 + self.rng.integers(grid.NUM_ACTIONS - 1)) % grid.NUM_ACTIONS)
        return best

    def reply(self, context: str) -> str:
        turns = _LAST_TURN.findall(context)
        if not turns:
            raise ValueError("QStarDemonstrator: no turn message in the context")
        remaining, text = turns[-1]
        tiles, pos = parse_grid(text)
        return f"<answer>{grid.ACTION_NAMES[self.action(tiles, pos, int(remaining))]}</answer>"

    def __call__(self, contexts: Sequence[str], live: np.ndarray) -> list[str]:
        return [self.reply(c) if on else "" for c, on in zip(contexts, live)]


def concat_trajectories(parts: Sequence[Trajectory]) -> Trajectory:
    """Rows of several trajectories (same record length and turns) as one, on the host."""
    return jax.tree.map(lambda *x: np.concatenate([np.asarray(a) for a in x]), *parts)


def collect_demos(env, tokenizer, demonstrator: QStarDemonstrator, task_ids: Sequence[int],
                  key: jax.Array, *, demos_per_task: int, max_response_tokens: int,
                  max_context: int, tasks_per_call: int = 32,
                  on_call: Callable[[], None] | None = None) -> Trajectory:
    """``demos_per_task`` demonstrations of each task, budgets drawn as in BudgetMix.

    Returns the concatenated :class:`Trajectory` (host arrays). ``on_call`` runs after each
    rollout call of ``tasks_per_call`` tasks (a progress hook).
    """
    runner = MultiTurnRollout(env, tokenizer, RolloutConfig(
        group_size=demos_per_task, budget=None, max_response_tokens=max_response_tokens,
        max_context=max_context))
    policy = ScriptedPolicy(tokenizer, demonstrator)
    task_ids = np.asarray(task_ids)
    parts = []
    for i, start in enumerate(range(0, len(task_ids), tasks_per_call)):
        result = runner(policy, task_ids[start:start + tasks_per_call], jax.random.fold_in(key, i))
        parts.append(jax.device_get(result.trajectory))
        if on_call is not None:
            on_call()
    return concat_trajectories(parts)


def demo_calls(num_tasks: int, tasks_per_call: int = 32) -> int:
    """How many rollout calls :func:`collect_demos` makes (for a progress bar)."""
    return -(-num_tasks // tasks_per_call)
