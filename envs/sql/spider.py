"""Loading Spider-format text-to-SQL data from a local folder the user supplies.

The folder is Spider's release unpacked (this project downloads nothing)::

    ROOT/train_spider.json        split "train"        (the paper's training data, §2)
    ROOT/train_others.json        split "train_others"
    ROOT/dev.json                 split "dev"          (InterCode-SQL's evaluation set)
    ROOT/test.json                split "test"         (databases under ROOT/test_database/)
    ROOT/database/<db_id>/<db_id>.sqlite

Each JSON file is a list of objects; the fields used are ``db_id``, ``question`` and ``query``
(the gold SQL). Any other data in the same layout loads too. Gold queries run only when a task
is first reset, so loading stays fast; a broken one is reported then, naming the task.
"""

from __future__ import annotations

import json
import pathlib

from envs.sql.env import SqlTask

# split -> (questions file, databases folder)
SPLITS: dict[str, tuple[str, str]] = {
    "train": ("train_spider.json", "database"),
    "train_others": ("train_others.json", "database"),
    "dev": ("dev.json", "database"),
    "test": ("test.json", "test_database"),
}
_FIELDS = ("db_id", "question", "query")


def load_spider(
    root: str | pathlib.Path, split: str = "dev", *, limit: int | None = None
) -> list[SqlTask]:
    """The tasks of one split of a Spider-format folder, in file order.

    Args:
      root: the unpacked Spider folder (layout in the module docstring).
      split: one of :data:`SPLITS`.
      limit: keep only the first ``limit`` tasks (small runs).

    Raises:
      FileNotFoundError: naming the missing folder, questions file or database file.
      ValueError: naming the file, the entry index and the bad field.
    """
    if split not in SPLITS:
        raise ValueError(f"load_spider: split must be one of {sorted(SPLITS)}, got {split!r}")
    if limit is not None and limit < 1:
        raise ValueError(f"load_spider: limit must be >= 1 or None, got {limit}")
    root = pathlib.Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"load_spider: Spider folder not found: {root}")
    questions_name, databases_name = SPLITS[split]
    questions_file = root / questions_name
    if not questions_file.is_file():
        raise FileNotFoundError(
            f"load_spider: split {split!r} needs {questions_file}, which is missing"
        )
    try:
        entries = json.loads(questions_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"load_spider: {questions_file} is not valid JSON: {error}") from error
    if not isinstance(entries, list):
        raise ValueError(
            f"load_spider: {questions_file} must hold a JSON list, got {type(entries).__name__}"
        )
    tasks = []
    for index, entry in enumerate(entries[:limit]):
        for field in _FIELDS:
            value = entry.get(field) if isinstance(entry, dict) else None
            if not isinstance(value, str) or not value.strip():
                raise ValueError(
                    f"load_spider: {questions_file} entry {index}: field {field!r} "
                    f"must be a non-empty string, got {value!r}"
                )
        db_path = root / databases_name / entry["db_id"] / f"{entry['db_id']}.sqlite"
        if not db_path.is_file():
            raise FileNotFoundError(
                f"load_spider: {questions_file} entry {index}: database "
                f"{entry['db_id']!r} not found at {db_path}"
            )
        tasks.append(SqlTask(entry["db_id"], db_path, entry["question"], entry["query"]))
    if not tasks:
        raise ValueError(f"load_spider: {questions_file} holds no tasks")
    return tasks
