"""Playing an episode from a state part-way through one: the budget-aware prompt that states
the original turn and budget (:class:`StatePrompt`), and an environment whose episodes end
after their first turn (:class:`FirstTurnOnly`, to sample one action at a state). Shared by
every environment's state diagnostics (:mod:`agentrl_jax.evaluation.state_diagnostics`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from agentrl_jax.prompts import BudgetPrompt

SOURCES = ("base", "RL")
"""Labels of :attr:`StatePool.source` codes 0 and 1 (-1: no source)."""


@dataclasses.dataclass(frozen=True)
class StatePrompt(BudgetPrompt):
    """The budget-aware prompt of an episode started at turn ``B - b`` of budget ``B``.

    The rollout calls it with its own budget ``b`` (the turns left at the start) and its own
    turn ``k``; it states ``B`` (``stated_budget``), current turn ``B - b + k`` and remaining
    ``b - k``, exactly what the original episode would have stated at that turn.
    """

    stated_budget: int = 1

    def __post_init__(self):
        super().__post_init__()
        b = self.stated_budget
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1:
            raise ValueError(f"StatePrompt.stated_budget must be an int >= 1, got {b!r}")

    @classmethod
    def of(cls, prompt: BudgetPrompt, stated_budget: int) -> "StatePrompt":
        return cls(
            system=prompt.system,
            turn=prompt.turn,
            hidden_system=prompt.hidden_system,
            hidden_turn=prompt.hidden_turn,
            stated_budget=int(stated_budget),
        )

    def _check(self, budget: int, shown: int | None = None) -> None:
        if shown is not None and shown != budget:
            raise ValueError("StatePrompt states the original budget: an exact presentation only")
        if not 1 <= budget <= self.stated_budget:
            raise ValueError(
                f"StatePrompt: remaining budget {budget} is not in [1, {self.stated_budget}]"
            )

    def system_text(self, instructions: str, budget: int, shown: int | None = None) -> str:
        self._check(budget, shown)
        return super().system_text(instructions, self.stated_budget)

    def turn_text(self, observation: str, budget: int, turn: int, shown: int | None = None) -> str:
        self._check(budget, shown)
        start = self.stated_budget - budget
        return super().turn_text(observation, self.stated_budget, start + turn)


class FirstTurnOnly:
    """A text environment whose episodes all end after their first turn."""

    def __init__(self, env):
        self.env, self.name, self.t_max = env, env.name, env.t_max

    def instructions(self) -> str:
        return self.env.instructions()

    def num_tasks(self) -> int:
        return self.env.num_tasks()

    def reset(self, task_ids, seed):
        return self.env.reset(task_ids, seed)

    def step(self, state, responses, live):
        state, result = self.env.step(state, responses, live)
        return state, dataclasses.replace(result, done=np.ones_like(result.done))
