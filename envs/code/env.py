"""DeepCoder-MT (paper §2): submit a whole program each turn, see unit-test feedback.

Each turn the agent submits a complete Python program; it runs against the task's unit
tests in the sandbox (:mod:`envs.code.sandbox`). The observation lists the failing tests
(input, expected, got; long fields cut, and said so). Reward 1 and the episode ends when
every test passes; otherwise the episode goes on until the rollout's turn budget (which the
rollout owns and states; this environment never mentions it). The step quality used by the
§7 diagnostics is the share of tests passed (0 for a response without a program).

Response grammar (:func:`parse_program`)
---------------------------------------
1. Thinking is ignored: everything up to the last ``</think>`` is dropped; a ``<think>``
   still open after that (an unfinished thought) drops everything from it on.
2. A program is a fenced block: a line ```` ```python ```` (or ``py``, ``python3``; any
   case; spaces allowed around the tag), the code, and a line holding only ```` ``` ````.
   Fences may be indented; the block is dedented.
3. The last such block counts (earlier ones are drafts). It must not be empty.
4. Invalid actions, each with an observation saying what was wrong: no block; a block left
   open at the end (a response cut off; an earlier closed draft does not stand in for it);
   an empty block.
"""

from __future__ import annotations

import dataclasses
import re
import textwrap
from typing import Sequence

from envs.code.datasets import CodeTask
from envs.code.isolation import ISOLATIONS
from envs.code.sandbox import SandboxLimits, TestResult, run_tests
from envs.protocol import Feedback, PythonEnv, text_key

_THINK_OPEN = re.compile(r"<\s{0,4}think\s{0,4}>", re.IGNORECASE)
_THINK_CLOSE = re.compile(r"<\s{0,4}/\s{0,4}think\s{0,4}>", re.IGNORECASE)
_FENCE_TAG = re.compile(r"python3?|py", re.IGNORECASE)  # fullmatched against one line's tag

NO_PROGRAM = (
    "No program found. Submit your complete Python program in one fenced block: "
    "a line ```python, the code, then a line ```."
)
UNCLOSED = (
    "Your ```python block is not closed (was the response cut off?). End the program "
    "with a line holding only ```."
)
EMPTY = "Your ```python block is empty. Put your complete program inside it."


def parse_program(response: str) -> tuple[str | None, str]:
    """``(program, "")`` from a response, or ``(None, why)`` (grammar in the module doc).

    A scanner: only lines holding ```` ``` ```` are looked at, each once, so the time is linear
    in the response's length whatever it holds.
    """
    response = response.replace("\r\n", "\n")
    last_close = None
    for match in _THINK_CLOSE.finditer(response):
        last_close = match
    text = response[last_close.end() :] if last_close is not None else response
    still_thinking = _THINK_OPEN.search(text)
    if still_thinking:
        text = text[: still_thinking.start()]
    program, opened_at = None, None  # opened_at: where the body of an open block starts
    for line_start, line_end in _fence_lines(text):
        line = text[line_start:line_end].strip(" \t")
        if opened_at is None and _FENCE_TAG.fullmatch(line[3:].lstrip(" \t")):
            opened_at = line_end + 1
        elif opened_at is not None and line == "```":
            program, opened_at = text[opened_at:line_start], None
    if opened_at is not None:  # the final answer was cut off: do not fall back to a draft
        return None, UNCLOSED
    if program is None:
        return None, NO_PROGRAM
    program = textwrap.dedent(program)
    if not program.strip():
        return None, EMPTY
    return program, ""


def _fence_lines(text: str):
    """``(start, end)`` of each line (split at ``\\n``) whose text without surrounding spaces and
    tabs starts with ```` ``` ````: the only lines that can open or close a block."""
    position = 0
    while (found := text.find("```", position)) >= 0:
        line_start = text.rfind("\n", position, found) + 1 or position
        line_end = text.find("\n", found)
        line_end = len(text) if line_end < 0 else line_end
        if not text[line_start:found].strip(" \t"):
            yield line_start, line_end
        position = line_end


@dataclasses.dataclass(frozen=True)
class CodeEnvConfig:
    """Settings of :class:`CodeEnv`.

    Attributes:
      limits: the sandbox's limits for each submission.
      failures_shown: how many failing tests the feedback details.
      field_chars: longest input / expected / got text shown before it is cut.
      isolation: the sandbox's isolation, ``"strict"`` (the default; refuses to run where a
        layer is missing) or ``"unsafe-no-isolation"`` (programs run as your user on this
        host: only for trusted programs). See :mod:`envs.code.isolation`.
    """

    limits: SandboxLimits = SandboxLimits()
    failures_shown: int = 3
    field_chars: int = 600
    isolation: str = "strict"

    def __post_init__(self):
        if not isinstance(self.limits, SandboxLimits):
            raise ValueError(
                f"CodeEnvConfig.limits must be a SandboxLimits, got {type(self.limits).__name__}"
            )
        if self.failures_shown < 1:
            raise ValueError(
                f"CodeEnvConfig.failures_shown must be >= 1, got {self.failures_shown}"
            )
        if self.field_chars < 20:
            raise ValueError(f"CodeEnvConfig.field_chars must be >= 20, got {self.field_chars}")
        if self.isolation not in ISOLATIONS:
            raise ValueError(
                f"CodeEnvConfig.isolation must be one of {ISOLATIONS}, got {self.isolation!r}"
            )


@dataclasses.dataclass(frozen=True)
class CodeRowState:
    """One row: its task and the observation it last showed (its anchor state)."""

    task_index: int
    observation: str
    submissions: int = 0


class CodeEnv(PythonEnv):
    """DeepCoder-MT over a list of :class:`CodeTask` (wrap with ``PythonTextEnv``)."""

    t_max = 10

    def __init__(
        self,
        tasks: Sequence[CodeTask],
        config: CodeEnvConfig = CodeEnvConfig(),
        *,
        name: str = "deepcoder-mt",
        tmp_root: str | None = None,
    ):
        if not tasks:
            raise ValueError("CodeEnv: tasks must not be empty")
        for i, task in enumerate(tasks):
            if not isinstance(task, CodeTask):
                raise ValueError(f"CodeEnv: tasks[{i}] is a {type(task).__name__}, not a CodeTask")
        self.tasks = tuple(tasks)
        self.config = config
        self.name = name
        self.tmp_root = tmp_root

    def instructions(self) -> str:
        return (
            "You are solving a programming problem in Python. Submit your complete "
            "program in one fenced block (```python ... ```). It is run against the "
            "problem's unit tests, and you are shown which tests fail, with the input, the "
            "expected output and your program's output; you may then submit a corrected "
            "program. The problem is solved when every test passes. Each submission is "
            "run from scratch, so always submit the whole program."
        )

    def num_tasks(self) -> int:
        return len(self.tasks)

    def reset_task(self, task_id: int, seed: int) -> tuple[CodeRowState, str]:
        observation = self.first_observation(self.tasks[task_id])
        return CodeRowState(int(task_id), observation), observation

    def step_task(self, row_state: CodeRowState, response: str) -> tuple[CodeRowState, Feedback]:
        program, why = parse_program(response)
        if program is None:
            feedback = Feedback(why, action_valid=False, quality=0.0)
        else:
            results = self.run_program(row_state.task_index, program)
            passed = sum(r.passed for r in results)
            solved = passed == len(results)
            feedback = Feedback(
                self.feedback_text(results),
                reward=float(solved),
                done=solved,
                success=solved,
                quality=passed / len(results),
            )
        state = dataclasses.replace(
            row_state, observation=feedback.observation, submissions=row_state.submissions + 1
        )
        return state, feedback

    def state_key(self, row_state: CodeRowState) -> int:
        return text_key(self.tasks[row_state.task_index].task_id, row_state.observation)

    def run_program(self, task_index: int, program: str) -> list[TestResult]:
        """Run ``program`` against task ``task_index``'s tests (also for diagnostics)."""
        task = self.tasks[task_index]
        return run_tests(
            program,
            task.tests,
            self.config.limits,
            prelude=task.prelude,
            isolation=self.config.isolation,
            tmp_root=self.tmp_root,
        )

    # ------------------------------------------------------------------ text

    def first_observation(self, task: CodeTask) -> str:
        parts = [task.prompt.strip()]
        function = task.function_name
        if function is None:
            parts.append(
                "Your program reads the input from standard input and prints the "
                "answer to standard output."
            )
        else:
            parts.append(
                f"Your program must define `{function}` (a function, or a method of "
                "a `Solution` class); the tests call it directly."
            )
        if task.starter_code.strip():
            parts.append(f"Starter code:\n```python\n{task.starter_code.rstrip()}\n```")
        return "\n\n".join(parts)

    def feedback_text(self, results: Sequence[TestResult]) -> str:
        n = len(results)
        failing = [(i, r) for i, r in enumerate(results, start=1) if not r.passed]
        if not failing:
            return f"All {n} tests passed."
        lines = [f"Your program passed {n - len(failing)} of {n} tests."]
        messages = {(r.status, r.message) for _, r in failing}
        if len(failing) == n and len(messages) == 1 and failing[0][1].status == "error":
            lines.append(f"Every test failed with the same error: {failing[0][1].message}")
            shown = failing[:1]
        else:
            shown = failing[: self.config.failures_shown]
            lines.append(f"Failing tests ({len(shown)} of {len(failing)} shown):")
        for i, result in shown:
            lines.append(self._describe_failure(i, result))
        return "\n\n".join(lines)

    def _describe_failure(self, index: int, result: TestResult) -> str:
        headline = {"failed": "failed", "error": "error", "timeout": "time limit"}[result.status]
        text = f"Test {index}: {headline}"
        if result.message:
            text += f": {result.message}"
        what = {"stdio": "Input", "call": "Call", "assert": "Check"}[result.kind]
        for label, value in (
            (what, result.test),
            ("Expected", result.expected),
            ("Got", result.got),
        ):
            # An error's output so far is shown only when there is some.
            if value is not None and (value or label != "Got" or result.status == "failed"):
                text += f"\n{label}:\n{self._clip(value)}"
        return text

    def _clip(self, value: str) -> str:
        limit = self.config.field_chars
        if value == "":
            return "(empty)"
        if len(value) <= limit:
            return value.rstrip("\n")
        return f"{value[:limit]}\n... ({len(value) - limit} more characters not shown)"
