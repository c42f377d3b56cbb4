"""InterCode-SQL (paper §2): answer questions about SQLite databases by running SQL queries.

Modules: :mod:`~envs.sql.grammar` (response -> action), :mod:`~envs.sql.database` (read-only,
time- and row-limited queries, each run in a worker process that is killed at its deadline:
:mod:`~envs.sql.worker_pool` and, inside the process, :mod:`~envs.sql.query_worker`),
:mod:`~envs.sql.verify` (result comparison), :mod:`~envs.sql.env`
(the :class:`~envs.protocol.PythonEnv`), :mod:`~envs.sql.spider` (Spider-format data) and
:mod:`~envs.sql.demo` (a bookshop task set built by code).
"""

from __future__ import annotations

import pathlib

from envs.protocol import PythonTextEnv
from envs.sql.database import QueryLimits, QueryResult, run_query, schema_text
from envs.sql.demo import demo_tasks
from envs.sql.env import INSTRUCTIONS, SqlConfig, SqlEnv, SqlRowState, SqlTask, render_result
from envs.sql.grammar import Execute, Invalid, Submit, parse_response
from envs.sql.spider import SPLITS, load_spider
from envs.sql.verify import is_ordered, normalise_value, results_match


def make_env(
    spider_dir: str | pathlib.Path | None = None,
    split: str = "dev",
    *,
    limit: int | None = None,
    config: SqlConfig = SqlConfig(),
    workers: int = 8,
    step_timeout_s: float = 60.0,
) -> PythonTextEnv:
    """The rollout's text environment: Spider data from ``spider_dir`` (its ``split``, first
    ``limit`` tasks), or the bookshop demo tasks when ``spider_dir`` is None."""
    tasks = demo_tasks() if spider_dir is None else load_spider(spider_dir, split, limit=limit)
    if spider_dir is None and limit is not None:
        tasks = tasks[:limit]
    return PythonTextEnv(SqlEnv(tasks, config), workers=workers, step_timeout_s=step_timeout_s)


from envs.registry import register  # noqa: E402
from envs.sql.tasks import make_tasks  # noqa: E402

register("sql", make_tasks, label="InterCode-SQL", max_response_tokens=512, max_context=8192)

__all__ = [
    "INSTRUCTIONS",
    "SPLITS",
    "Execute",
    "Invalid",
    "QueryLimits",
    "QueryResult",
    "SqlConfig",
    "SqlEnv",
    "SqlRowState",
    "SqlTask",
    "Submit",
    "demo_tasks",
    "is_ordered",
    "load_spider",
    "make_env",
    "normalise_value",
    "parse_response",
    "render_result",
    "results_match",
    "run_query",
    "schema_text",
]
