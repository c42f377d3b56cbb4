"""Scripted agents that replay the gold answers of the text environments, reading the task and
the turn off the decoded prompt, and an independent replay of what each environment shows.

Each agent is a :class:`~agentrl_jax.sampling.ScriptedPolicy` script: it finds its task in the
first user message and its turn in the last one's ``[CURRENT TURN]`` field, so a prompt that
states the task or the turn wrongly makes it answer wrongly. ``needed`` is the number of turns
its gold play takes: it succeeds exactly when the budget is at least that.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).parent))  # eval_helpers

from eval_helpers import turns_in  # noqa: E402

from envs.bfcl import reference_responses  # noqa: E402


class GoldAgent:
    """Base: ``gold(task, turn)`` is the gold play; ``fail`` names tasks and samples
    (``(task index, sample index within its group)``) to answer wrongly instead, so a test can
    fix each task's success count. Records every ``(row, context)`` it is shown."""

    def __init__(
        self, tasks: Sequence, group_size: int = 1, fail: set[tuple[int, int]] = frozenset()
    ):
        self.tasks, self.group_size, self.fail = list(tasks), group_size, set(fail)
        self.contexts: list[tuple[int, str]] = []

    def task_of(self, first_observation: str) -> int:
        raise NotImplementedError

    def gold(self, task: int, turn: int) -> str:
        raise NotImplementedError

    def wrong(self, task: int, turn: int) -> str:
        raise NotImplementedError

    def needed(self, task: int) -> int:
        raise NotImplementedError

    def __call__(self, contexts: list[str], live) -> list[str]:
        replies = []
        for row, (context, on) in enumerate(zip(contexts, live)):
            if not on:
                replies.append("")
                continue
            self.contexts.append((row, context))
            turns = turns_in(context)
            task, turn = self.task_of(turns[0][3]), turns[-1][1]
            failing = (task, row % self.group_size) in self.fail
            replies.append(self.wrong(task, turn) if failing else self.gold(task, turn))
        return replies


class SqlGold(GoldAgent):
    """Runs the gold query (turn 0), then submits it with ``<submit></submit>`` (turn 1)."""

    def task_of(self, first_observation):
        question = re.search(r"\nQuestion: (.*)\Z", first_observation, re.S).group(1)
        return [t.question for t in self.tasks].index(question)

    def gold(self, task, turn):
        return f"<sql>{self.tasks[task].gold_query}</sql>" if turn == 0 else "<submit></submit>"

    def wrong(self, task, turn):
        return "<submit>SELECT 'not the answer'</submit>"

    def needed(self, task):
        return 2


class CodeGold(GoldAgent):
    """Submits the starter code, a stub that fails every test (turn 0), then the canonical
    solution (turn 1)."""

    def task_of(self, first_observation):
        entry = re.match(r"Complete the Python function `(\w+)`", first_observation).group(1)
        return [t.function_name for t in self.tasks].index(entry)

    def gold(self, task, turn):
        program = self.tasks[task].starter_code if turn == 0 else self.tasks[task].reference
        return f"```python\n{program}\n```"

    def wrong(self, task, turn):
        return f"```python\n{self.tasks[task].starter_code}\n```"

    def needed(self, task):
        return 2


class BfclGold(GoldAgent):
    """Replays the annotated trajectory (:func:`envs.bfcl.reference_responses`)."""

    def task_of(self, first_observation):
        requests = [
            "\n\n" + "\n".join(f"{m.role.capitalize()}: {m.content}" for m in t.turns[0])
            for t in self.tasks
        ]
        matches = [i for i, request in enumerate(requests) if first_observation.endswith(request)]
        assert len(matches) == 1, first_observation[-300:]
        return matches[0]

    def gold(self, task, turn):
        return reference_responses(self.tasks[task])[turn]

    def wrong(self, task, turn):
        return ""  # ends the first request without a call: the check fails

    def needed(self, task):
        return self.tasks[task].min_turns


AGENTS = {"sql": SqlGold, "code": CodeGold, "bfcl": BfclGold}  # by --env name


def replay_observations(env, task_id: int, responses: Sequence[str]) -> list[str]:
    """What a fresh :class:`~envs.protocol.PythonEnv` shows for ``responses``: the first
    observation and each one after a response, played directly (no rollout, no prompt)."""
    state, observation = env.reset_task(task_id, seed=0)
    shown = [observation]
    for response in responses:
        state, feedback = env.step_task(state, response)
        shown.append(feedback.observation)
    env.close_task(state)
    return shown
