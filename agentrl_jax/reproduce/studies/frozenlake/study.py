"""FrozenLake's study: what ``agentrl-jax reproduce frozenlake`` knows beyond the rollout.

* **options** (``task.options``): the maps and dynamics
  (:class:`envs.frozenlake.tasks.FrozenLakeOptions`; the tasks are built by its factory).
* **tasks**: train and test maps from disjoint splits (a content hash bit,
  :func:`envs.frozenlake.maps.map_split`), drawn from ``task.seed`` (streams 0 and 1), so no
  evaluation map is trained on.
* **demonstrations**: :class:`QStarDemonstrator`, a scripted Q*-greedy agent with mistakes.
  A pretrained LLM is competent but fallible; a random-init policy is neither. The base policy
  is made by behaviour cloning it: it reads the prompt like a model would (the last grid and the
  remaining budget), plays the move that maximises the probability of reaching the goal within
  the remaining turns (finite-horizon Q* with gamma 1, so it is budget-aware), and with
  probability ``mistake_rate`` plays a uniformly random other move instead.
* **tokenizer corpus**: :func:`frozenlake_corpus`.
* **R_single**: the exact Q* step quality (gamma 0.95, §7), and every analysis, the step
  quality and error-state diagnostics included (they read Q* from the maps).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Sequence

import numpy as np

from agentrl_jax.reproduce.studies.base import ALL_ANALYSES, Study
from envs.frozenlake import grid, qstar
from envs.frozenlake.step_quality import FrozenLakeQStar
from envs.frozenlake.tasks import FrozenLakeOptions
from envs.frozenlake.text import parse_grid, render
from envs.protocol import EnvEntry, EnvTasks

# The last user message of a context: its remaining budget and grid (the default BudgetPrompt).
_LAST_TURN = re.compile(r"\[REMAINING TURNS\] (\d+)\n(.*?)<\|im_end\|>", re.S)


def _map_key(tiles: np.ndarray) -> bytes:
    """Tiles as the prompt shows them: the start cell is plain ice (same dynamics)."""
    tiles = np.asarray(tiles, np.int8)
    return np.where(tiles == grid.START, grid.FROZEN, tiles).astype(np.int8).tobytes()


class QStarDemonstrator:
    """A :data:`~agentrl_jax.sampling.policy.Script`: ``(contexts, live) -> replies``.

    maps: ``int8[M, n, n]``, every map it may be shown (Q* is computed for all at once).
    horizon: the largest remaining budget it may see (``T_max``).
    mistake_rate: probability of a uniformly random move other than the greedy one.
    """

    def __init__(
        self,
        maps: Any,
        horizon: int,
        *,
        is_slippery: bool,
        success_rate: float,
        mistake_rate: float = 0.0,
        seed: int = 0,
    ):
        if not 0.0 <= mistake_rate <= 1.0:
            raise ValueError(f"mistake_rate must be in [0, 1], got {mistake_rate!r}")
        maps = np.asarray(maps, np.int8)
        q = np.asarray(
            qstar.q_star(
                maps, horizon, gamma=1.0, is_slippery=is_slippery, success_rate=success_rate
            )
        )  # [M, H + 1, S, 4]
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


def frozenlake_corpus(
    instructions: str, maps: np.ndarray, t_max: int, prompt: Any = None, grids_per_map: int = 4
) -> list[str]:
    """The texts between the special tokens of a FrozenLake conversation in Qwen3's chat
    format, weighted by how often they recur: the system prompt at every budget, each turn's
    user message (header and grid), the assistant header and the answers (``prompt``: the
    rollout's :class:`~agentrl_jax.prompts.BudgetPrompt`, default the default one)."""
    if prompt is None:
        from agentrl_jax.prompts import BudgetPrompt

        prompt = BudgetPrompt()
    system = [f"system\n{prompt.system_text(instructions, b)}" for b in range(1, t_max + 1)]
    grids = []
    for tiles in maps:
        cells = np.flatnonzero(np.asarray(tiles).reshape(-1) != grid.HOLE)[:grids_per_map]
        grids += [render(tiles, int(pos)) for pos in cells]
    turns = [
        f"user\n{prompt.turn_text(grids[(b * t_max + t) % len(grids)], b, t)}"
        for b in range(1, t_max + 1)
        for t in range(b)
    ]
    answers = [f"\n\n<answer>{name}</answer>" for name in grid.ACTION_NAMES]
    return (
        system * 32
        + turns * 8
        + [f"user\n{g}" for g in grids]
        + (answers + ["assistant\n", "\n\n", "\n"]) * 256
    )


class FrozenLakeStudy(Study):
    """The study of the ``frozenlake`` environment (module docstring)."""

    analyses = ALL_ANALYSES
    demonstrations = "Q* demonstrations"
    records_quality = False  # R_single is Q*, computed from the maps
    # every grid cell (a symbol after a space or a line break) its own token, so each grid has
    # the same token layout; the default merges a whole row into one token
    tokenizer_isolate = r"[ \n][_OPGXW](?=[ \n<]|$)"

    def check_options(self, entry: EnvEntry, options: Mapping[str, Any]) -> dict[str, Any]:
        known = [f.name for f in dataclasses.fields(FrozenLakeOptions)]
        unknown = [k for k in options if k not in known]
        if unknown:
            raise ValueError(
                f"task.options: FrozenLake takes no option "
                f"{', '.join(map(repr, unknown))}; it takes: {', '.join(known)}"
            )
        return dataclasses.asdict(FrozenLakeOptions(**options))

    def has_split(self, entry: EnvEntry) -> bool:
        return True

    def describe(
        self,
        entry: EnvEntry,
        options: Mapping[str, Any],
        *,
        t_max: int,
        train: EnvTasks,
        test: EnvTasks,
    ) -> str:
        o = FrozenLakeOptions(**options)
        dynamics = (
            f"slippery (intended move {o.success_rate:.0%})" if o.slippery else "deterministic"
        )
        return (
            f"{o.map_size}x{o.map_size} FrozenLake, {dynamics}, T_max {t_max}; "
            f"{len(train.names)} train maps, {len(test.names)} test maps (disjoint splits)."
        )

    def bound_note_for(self, options: Mapping[str, Any]) -> str:
        return (
            "a necessary condition only on slippery maps"
            if FrozenLakeOptions(**options).slippery
            else "exact for a Q*-optimal policy on these deterministic maps"
        )

    def demonstrable(self, tasks: EnvTasks, task_ids: Sequence[int]) -> np.ndarray:
        return np.asarray(task_ids, np.int64)  # Q* reads the grid: every map can be played

    def demonstrator(
        self,
        tasks: EnvTasks,
        task_ids: Sequence[int],
        *,
        t_max: int,
        mistake_rate: float,
        seed: int,
    ):
        env = tasks.env
        return QStarDemonstrator(
            env.maps,
            t_max,
            is_slippery=env.config.is_slippery,
            success_rate=env.config.success_rate,
            mistake_rate=mistake_rate,
            seed=seed,
        )

    def corpus(
        self, tasks: EnvTasks, task_ids: Sequence[int], *, t_max: int, prompt: Any
    ) -> list[str]:
        return frozenlake_corpus(tasks.env.instructions(), tasks.env.maps, t_max, prompt)

    def state_diagnostics(self, tasks: EnvTasks):
        from agentrl_jax.reproduce.studies.frozenlake.diagnostics import QStarStates

        return QStarStates(tasks.env)

    def step_scorer(self, tasks: EnvTasks):
        env = tasks.env
        return FrozenLakeQStar(
            env.maps,
            gamma=qstar.DEFAULT_GAMMA,
            is_slippery=env.config.is_slippery,
            success_rate=env.config.success_rate,
        )
