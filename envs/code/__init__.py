"""DeepCoder-MT (paper §2): multi-turn code generation against unit tests in a sandbox.

* :mod:`envs.code.sandbox`: run a program against tests in a sandbox (:mod:`envs.code.isolation`).
* :mod:`envs.code.datasets`: DeepCoder-style JSONL from a local file; HumanEval from PyPI.
* :mod:`envs.code.env`: the :class:`~envs.protocol.PythonEnv` (wrap it with
  :class:`~envs.protocol.PythonTextEnv` for the rollout).
"""

from envs.code.datasets import CodeTask, load_deepcoder_jsonl, load_humaneval, split_check
from envs.code.env import CodeEnv, CodeEnvConfig, CodeRowState, parse_program
from envs.code.sandbox import (
    AssertTest,
    CallTest,
    SandboxLimits,
    SandboxUnavailable,
    StdioTest,
    TestResult,
    outputs_match,
    run_tests,
    strict_problems,
    values_match,
)
from envs.code.tasks import make_tasks  # noqa: E402
from envs.registry import register  # noqa: E402

register(
    "code", make_tasks, label="DeepCoder-MT", max_response_tokens=1024, max_context=16384, lanes=2
)

__all__ = [
    "AssertTest",
    "CallTest",
    "CodeEnv",
    "CodeEnvConfig",
    "CodeRowState",
    "CodeTask",
    "SandboxLimits",
    "SandboxUnavailable",
    "StdioTest",
    "TestResult",
    "load_deepcoder_jsonl",
    "load_humaneval",
    "outputs_match",
    "parse_program",
    "run_tests",
    "split_check",
    "strict_problems",
    "values_match",
]
