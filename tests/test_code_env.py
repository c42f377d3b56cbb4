"""DeepCoder-MT: the response grammar, the task loaders (DeepCoder JSONL, HumanEval), and
the environment through PythonTextEnv, with gold, wrong, malformed, hanging and
misbehaving programs in one batch."""

import json
import re

import numpy as np
import pytest
from code_helpers import make_clean_root

from envs.code import (
    CallTest,
    CodeEnv,
    CodeEnvConfig,
    CodeTask,
    SandboxLimits,
    StdioTest,
    load_deepcoder_jsonl,
    load_humaneval,
    parse_program,
)
from envs.code.env import EMPTY, NO_PROGRAM, UNCLOSED
from envs.protocol import PythonTextEnv, text_key

LIMITS = SandboxLimits(timeout_s=1.5, total_timeout_s=6.0, memory_mb=256, output_bytes=1 << 16)
ADD_GOLD = "a, b = map(int, input().split())\nprint(a + b)\n"
ADD_WRONG = "a, b = map(int, input().split())\nprint(a - b)\n"
# a + b over these: 3, 5, 0, 5; a - b gives -1, 5, 0, -1, so tests 2 and 3 pass: 2/4.
ADD_TESTS = [["1 2\n", "3\n"], ["5 0\n", "5\n"], ["0 0\n", "0\n"], ["2 3\n", "5\n"]]


def fenced(program: str) -> str:
    return f"Here is my solution.\n```python\n{program}```\n"


@pytest.fixture
def root(tmp_path):
    """Where runs make their working directories: left empty and process-free."""
    for root in make_clean_root(tmp_path):
        yield str(root)


@pytest.fixture
def jsonl(tmp_path):
    """A DeepCoder-style file: stdin/stdout, LiveCodeBench functional, TACO call-based."""
    rows = [
        {
            "problem": "Print the sum of two integers.",
            "tests": json.dumps(
                [{"input": i, "output": o, "testtype": "stdin"} for i, o in ADD_TESTS]
            ),
        },
        {
            "question": "Return the largest element.",
            "starter_code": "class Solution:\n    def biggest(self, nums: List[int]) -> int:\n",
            "tests": [
                {"input": "[3, 1, 2]", "output": "3", "testtype": "functional"},
                {"input": "[-5]", "output": "-5", "testtype": "functional"},
            ],
            "metadata": json.dumps({"func_name": "biggest"}),
            "task_id": "lcb-1",
        },
        {
            "problem": "Add the arguments.",
            "tests": json.dumps(
                {"inputs": [[1, 2], [3, 4]], "outputs": [[3], [7]], "fn_name": "add"}
            ),
        },
        {
            "problem": "Echo the lines.",
            "input_output": {"inputs": [["a", "b"]], "outputs": ["a\nb\n"]},
        },
    ]
    path = tmp_path / "tasks.jsonl"
    path.write_text(
        "\n".join(json.dumps(r) for r in rows[:2])
        + "\n\n"
        + "\n".join(json.dumps(r) for r in rows[2:])
        + "\n"
    )
    return path


# ------------------------------------------------------------------ grammar


@pytest.mark.parametrize(
    "response, program",
    [
        ("```python\nprint(1)\n```", "print(1)\n"),
        (
            "draft:\n```python\nprint(0)\n```\nfinal:\n```Python3\nprint(2)\n```\nDone.",
            "print(2)\n",
        ),
        ("<think>```python\nprint(0)\n```</think>\n```py\nprint(3)\n```", "print(3)\n"),
        ("  ```python  \n  if x:\n      y()\n  ```", "if x:\n    y()\n"),
        ("```python\r\nprint(4)\r\n```\r\n", "print(4)\n"),
        ("```python\nprint(5)\n```\n<think>maybe\n```python\nprint(6)\n```", "print(5)\n"),
    ],
)
def test_parse_program_accepts(response, program):
    assert parse_program(response) == (program, "")


@pytest.mark.parametrize(
    "response, why",
    [
        ("print(1)", NO_PROGRAM),
        ("```\nprint(1)\n```", NO_PROGRAM),  # no language tag
        ("```javascript\nconsole.log(1)\n```", NO_PROGRAM),
        ("```python\nprint(1)\n", UNCLOSED),  # cut off
        ("```python\nprint(1)\n```\n```python\nprint(2)", UNCLOSED),
        ("```python\n   \n```", EMPTY),
        ("<think>```python\nprint(1)\n```", NO_PROGRAM),  # only inside an open thought
        ("", NO_PROGRAM),
    ],
)
def test_parse_program_rejects(response, why):
    assert parse_program(response) == (None, why)


# ------------------------------------------------------------------ loaders


def test_deepcoder_jsonl_formats(jsonl, root):
    tasks = load_deepcoder_jsonl(jsonl)
    assert [t.task_id for t in tasks] == [
        "tasks.jsonl:1",
        "lcb-1",
        "tasks.jsonl:4",
        "tasks.jsonl:5",
    ]
    assert tasks[0].tests == tuple(StdioTest(i, o) for i, o in ADD_TESTS)
    assert tasks[0].function_name is None and tasks[0].prelude == ""
    assert tasks[1].tests[0] == CallTest("biggest", ([3, 1, 2],), 3)
    assert tasks[1].prelude == "from typing import *\n"  # List in the starter code resolves
    assert tasks[2].tests[1] == CallTest("add", (3, 4), [7], wrapped_expected=True)
    assert tasks[3].tests == (StdioTest("a\nb\n", "a\nb\n"),)
    assert len(load_deepcoder_jsonl(jsonl, limit=2)) == 2
    gold = {
        1: (
            "class Solution:\n    def biggest(self, nums: List[int]) -> int:\n"
            "        return max(nums)\n"
        ),
        2: "def add(a, b):\n    return a + b\n",
        3: "import sys\nsys.stdout.write(sys.stdin.read())\n",
    }
    env = CodeEnv(tasks, CodeEnvConfig(limits=LIMITS), tmp_root=root)
    for index, program in gold.items():
        assert all(r.passed for r in env.run_program(index, program)), tasks[index].task_id


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", r"tasks.jsonl:2: not valid JSON"),
        ('["a list"]', r"tasks.jsonl:2: expected a JSON object"),
        ('{"tests": []}', r"tasks.jsonl:2: no problem statement"),
        ('{"problem": "p"}', r"tasks.jsonl:2: no 'tests'"),
        (
            '{"problem": "p", "tests": "[{"}',
            r"tasks.jsonl:2: tests: a string that is not valid JSON",
        ),
        ('{"problem": "p", "tests": []}', r"tasks.jsonl:2: tests holds no tests"),
        (
            '{"problem": "p", "tests": [{"input": "1"}]}',
            r"tasks.jsonl:2: tests\[0\]: a test must be",
        ),
        (
            '{"problem": "p", "tests": [{"input": "1", "output": "1", "testtype": "magic"}]}',
            r"tests\[0\]: unknown test type 'magic'",
        ),
        (
            '{"problem": "p", "tests": [{"input": "1", "output": "1", "testtype": "functional"}]}',
            r"tests\[0\]: a functional test needs a function name",
        ),
        (
            '{"problem": "p", "tests": {"inputs": ["1"], "outputs": []}}',
            r"tasks.jsonl:2: tests: inputs and outputs must be lists of the same length",
        ),
        (
            '{"problem": "p", "tests": [{"input": 5, "output": "1"}]}',
            r"tests\[0\].input: expected text",
        ),
    ],
)
def test_deepcoder_jsonl_errors_name_file_line_and_field(tmp_path, line, message):
    path = tmp_path / "tasks.jsonl"
    good = json.dumps({"problem": "ok", "tests": [{"input": "", "output": ""}]})
    path.write_text(f"{good}\n{line}\n")
    with pytest.raises(ValueError, match=message):
        load_deepcoder_jsonl(path)


def test_deepcoder_jsonl_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_deepcoder_jsonl(tmp_path / "nope.jsonl")


def test_humaneval_loads_offline_and_splits_checks():
    tasks = load_humaneval()
    assert len(tasks) == 164 and len({t.task_id for t in tasks}) == 164
    assert all(t.tests and t.reference and t.prelude == t.starter_code for t in tasks)
    first = tasks[0]
    assert first.task_id == "HumanEval/0" and first.function_name == "has_close_elements"
    # HumanEval/0's check holds seven asserts on the candidate: seven tests.
    assert [t.description for t in first.tests][:2] == [
        "assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) == True",
        "assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.05) == False",
    ]
    assert len(first.tests) == 7
    assert len(load_humaneval(limit=5)) == 5


# ------------------------------------------------------------------ the environment


def test_humaneval_gold_solutions_score_one(root):
    tasks = load_humaneval()
    sample = list(range(0, 160, 16))  # ten tasks, HumanEval/0, /16, ..., /144
    env = PythonTextEnv(CodeEnv(tasks, CodeEnvConfig(limits=LIMITS), tmp_root=root), workers=2)
    rows, observations = env.reset(np.array(sample), seed=0)
    assert all(tasks[i].starter_code.strip() in obs for i, obs in zip(sample, observations))
    rows, result = env.step(rows, [fenced(tasks[i].reference) for i in sample], np.ones(10, bool))
    np.testing.assert_array_equal(result.reward, np.ones(10))
    assert result.done.all() and result.success.all() and result.action_valid.all()
    np.testing.assert_array_equal(result.quality, np.ones(10))
    assert all(o.startswith("All ") and o.endswith(" tests passed.") for o in result.observations)
    env.close()


def test_wrong_humaneval_program_scores_share_of_asserts(root):
    env = CodeEnv(load_humaneval(limit=1), CodeEnvConfig(limits=LIMITS), tmp_root=root)
    state, _ = env.reset_task(0, seed=0)
    # HumanEval/0's seven expected values are True, False, True, False, True, True, False:
    # always answering False passes three.
    state, feedback = env.step_task(
        state, fenced("def has_close_elements(numbers, threshold):\n    return False\n")
    )
    assert feedback.quality == pytest.approx(3 / 7)
    assert (feedback.reward, feedback.done, feedback.success) == (0.0, False, False)
    assert feedback.action_valid
    assert feedback.observation.startswith("Your program passed 3 of 7 tests.")
    assert "Failing tests (3 of 4 shown):" in feedback.observation
    assert (
        "Test 1: failed: the check failed\nCheck:\nassert candidate([1.0, 2.0, 3.9, 4.0, 5.0, "
        "2.2], 0.3) == True\nExpected:\nTrue\nGot:\nFalse"
    ) in feedback.observation


def test_stdio_task_gold_wrong_malformed_and_hanging(jsonl, root):
    env = CodeEnv(
        load_deepcoder_jsonl(jsonl, limit=1),
        CodeEnvConfig(limits=SandboxLimits(timeout_s=1.0, total_timeout_s=3.0, memory_mb=256)),
        tmp_root=root,
    )
    start, observation = env.reset_task(0, seed=0)
    assert observation.startswith("Print the sum of two integers.")
    assert "standard input" in observation
    _, gold = env.step_task(start, fenced(ADD_GOLD))
    assert (gold.reward, gold.done, gold.success, gold.quality) == (1.0, True, True, 1.0)
    _, wrong = env.step_task(start, fenced(ADD_WRONG))
    assert (wrong.reward, wrong.done, wrong.quality) == (0.0, False, 0.5)
    assert "Test 1: failed: wrong answer\nInput:\n1 2\nExpected:\n3\nGot:\n-1" in wrong.observation
    _, malformed = env.step_task(start, "print(1 + 2)")
    assert (malformed.action_valid, malformed.reward, malformed.done) == (False, 0.0, False)
    assert malformed.quality == 0.0
    assert malformed.observation == NO_PROGRAM
    _, broken = env.step_task(start, fenced("print(1 +\n"))
    assert (broken.action_valid, broken.quality) == (True, 0.0)
    assert broken.observation.startswith(
        "Your program passed 0 of 4 tests.\n\nEvery test failed with the same error: "
        "SyntaxError: '(' was never closed (line 1)\n\nTest 1: error"
    )
    _, hanging = env.step_task(start, fenced("while True:\n    pass\n"))
    assert (hanging.reward, hanging.done, hanging.quality) == (0.0, False, 0.0)
    assert hanging.action_valid
    # A busy loop meets the 1 s CPU limit or the 1 s wall-clock limit first, by scheduling.
    assert re.search(
        r"Test 1: time limit: (timed out after 1 s \(wall clock\)|the CPU time limit)",
        hanging.observation,
    ), hanging.observation


def test_feedback_cuts_long_fields_and_says_so(root):
    task = CodeTask("long", "Print 5000 x.", (StdioTest("", "x" * 5000),))
    env = CodeEnv([task], CodeEnvConfig(limits=LIMITS, field_chars=100), tmp_root=root)
    state, _ = env.reset_task(0, seed=0)
    _, feedback = env.step_task(state, fenced("print('y' * 5000)\n"))
    assert "x" * 100 + "\n... (4900 more characters not shown)" in feedback.observation
    assert "x" * 101 not in feedback.observation


def test_rollout_goes_on_when_rows_misbehave(jsonl, root, tmp_path):
    """One batch: gold, wrong, malformed, a fork loop, a memory hog, a network and
    file-system intruder, and a hang. Every row gets its feedback; the wrapper never times
    out; the next turn plays normally."""
    outside = tmp_path / "intruder.txt"
    programs = [
        fenced(ADD_GOLD),
        fenced(ADD_WRONG),
        "I would add the numbers.",
        fenced("import os\nfor _ in range(200):\n    os.fork()\n"),
        fenced("hog = []\nwhile True:\n    hog.append(bytearray(10 ** 7))\n"),
        fenced(
            f"open({str(outside)!r}, 'w').write('x')\nimport socket\n"
            "socket.socket().connect(('127.0.0.1', 9))\n"
        ),
        fenced("import time\ntime.sleep(60)\n"),
    ]
    n = len(programs)
    config = CodeEnvConfig(limits=SandboxLimits(timeout_s=1.0, total_timeout_s=2.0, memory_mb=256))
    env = PythonTextEnv(
        CodeEnv(load_deepcoder_jsonl(jsonl, limit=1), config, tmp_root=root),
        workers=4,
        step_timeout_s=30,
    )
    rows, _ = env.reset(np.zeros(n, int), seed=0)
    rows, result = env.step(rows, programs, np.ones(n, bool))
    np.testing.assert_array_equal(result.reward, [1, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(result.done, [1, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(result.action_valid, [1, 1, 0, 1, 1, 1, 1])
    np.testing.assert_allclose(result.quality, [1, 0.5, 0, 0, 0, 0, 0])
    assert not result.info["timeout"].any()
    observations = result.observations
    assert "os.fork is not allowed" in observations[3]
    assert "MemoryError: the memory limit is 256 MiB" in observations[4]
    assert "writing" in observations[5] and "outside the working directory" in observations[5]
    assert "time limit" in observations[6]
    assert not outside.exists()
    # The rollout goes on: the same rows now submit the gold program.
    rows, result = env.step(rows, [fenced(ADD_GOLD)] * n, ~rows.done)
    np.testing.assert_array_equal(result.reward, [0, 1, 1, 1, 1, 1, 1])
    assert rows.done.all() and rows.success.all()
    env.close()


def test_state_keys_follow_what_the_agent_sees(jsonl, root):
    env = CodeEnv(load_deepcoder_jsonl(jsonl), CodeEnvConfig(limits=LIMITS), tmp_root=root)
    a, obs_a = env.reset_task(0, seed=0)
    b, _ = env.reset_task(0, seed=7)
    c, _ = env.reset_task(2, seed=0)
    assert env.state_key(a) == env.state_key(b) == text_key("tasks.jsonl:1", obs_a)
    assert env.state_key(a) != env.state_key(c)
    a1, fb = env.step_task(a, fenced(ADD_WRONG))
    b1, _ = env.step_task(b, fenced("a, b = map(int, input().split())\nprint(a - b)  # same\n"))
    assert env.state_key(a1) == env.state_key(b1) != env.state_key(a)  # same feedback, same state
    assert a1.submissions == 1 and a.submissions == 0  # states are values: a is unchanged


def test_the_environment_leaves_the_budget_to_the_rollout(jsonl):
    env = CodeEnv(load_deepcoder_jsonl(jsonl))
    _, observation = env.reset_task(0, seed=0)
    for text in (env.instructions(), observation):
        assert "turn" not in text.lower() and "budget" not in text.lower()
    assert env.name == "deepcoder-mt" and env.t_max == 10 and env.num_tasks() == 4


def test_bad_configuration_is_named():
    with pytest.raises(ValueError, match="failures_shown"):
        CodeEnvConfig(failures_shown=0)
    with pytest.raises(ValueError, match="field_chars"):
        CodeEnvConfig(field_chars=1)
    with pytest.raises(ValueError, match="tasks must not be empty"):
        CodeEnv([])
    with pytest.raises(ValueError, match=r"tasks\[0\]"):
        CodeEnv(["not a task"])
    with pytest.raises(ValueError, match="tests must not be empty"):
        CodeTask("t", "p", ())
