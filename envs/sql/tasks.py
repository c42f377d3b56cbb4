"""InterCode-SQL's task sets (the factory ``envs.make("sql", ...)`` calls): the 18 bundled
bookshop questions split in two by a hash of each question, or a Spider folder."""

from __future__ import annotations

from envs.protocol import EnvDataError, EnvOptionError, EnvTasks, data_path, python_env
from envs.splits import split_tasks
from envs.sql.demo import demo_tasks
from envs.sql.env import SqlEnv
from envs.sql.spider import SPLITS, load_spider


def make_tasks(
    *,
    data: str | None = None,
    split: str | None = None,
    limit: int | None = None,
    workers: int = 8,
    step_timeout_s: float = 60.0,
) -> EnvTasks:
    """The 18 bundled bookshop questions (``split`` "train" or "test": two disjoint halves by
    a hash of each question, :func:`envs.splits.hash_split`), or ``data`` a Spider folder
    (``split`` a Spider split, default dev); a folder that cannot be read as Spider's is an
    :class:`~envs.protocol.EnvDataError`."""
    if data is None:
        bundled = demo_tasks()
        try:
            tasks = split_tasks(bundled, [t.question for t in bundled], split)[:limit]
        except EnvOptionError as error:
            raise EnvOptionError(f"{error} (a Spider split needs data, a Spider folder)") from None
    else:
        split = split or "dev"
        if split not in SPLITS:  # an option's error, not the data's
            raise EnvOptionError(
                f"split: a Spider split is one of {', '.join(SPLITS)}, got {split!r}"
            )
        root = data_path(data, "folder", "a Spider folder")  # EnvDataError: one line
        try:
            tasks = load_spider(root, split, limit=limit)
        except (OSError, ValueError) as error:  # a missing or malformed file in it
            raise EnvDataError(str(error)) from None
    return python_env(
        SqlEnv(tasks),
        [f"{t.db_id}: {t.question}" for t in tasks],
        workers=workers,
        step_timeout_s=step_timeout_s,
    )
