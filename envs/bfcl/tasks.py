"""BFCL v3 multi-turn's task sets (the factory ``envs.make("bfcl", ...)`` calls): bfcl-eval's
categories, or a folder laid out like its data, split in two by a hash of each task id."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from envs.bfcl.data import load_tasks
from envs.bfcl.env import BfclConfig, BfclEnv
from envs.protocol import EnvDataError, EnvTasks, data_path, python_env, split_of_data
from envs.splits import split_tasks


def make_tasks(
    *,
    data: str | None = None,
    categories: Sequence[str] | None = None,
    split: str | None = None,
    limit: int | None = None,
    workers: int = 8,
    step_timeout_s: float = 60.0,
) -> EnvTasks:
    """bfcl-eval's ``categories`` (default ``multi_turn_base``), or ``data`` a folder laid out
    like the package's ``data`` (``split`` "train" or "test": two disjoint halves by a hash of
    each task id); ``min_turns`` from the annotated trajectories. A ``data`` folder that cannot
    be read as tasks is an :class:`~envs.protocol.EnvDataError`."""
    if data is not None:
        data = data_path(data, "folder", "a folder laid out like bfcl-eval's data")
    config = BfclConfig(
        categories=tuple(categories or ("multi_turn_base",)),
        data_dir=None if data is None else str(data),
    )
    try:
        tasks = load_tasks(config.categories, config.data_dir)
    except (OSError, ValueError) as error:
        if data is None:  # the installed package's own data
            raise
        raise EnvDataError(str(error)) from None  # a missing or malformed file in the folder
    total, tasks = len(tasks), split_tasks(tasks, [t.id for t in tasks], split)[:limit]
    if data is not None:
        tasks = split_of_data(tasks, data, total, split)
    return python_env(
        BfclEnv(config, tasks=tasks),
        [t.id for t in tasks],
        np.array([t.min_turns for t in tasks], np.int64),
        workers=workers,
        step_timeout_s=step_timeout_s,
    )
