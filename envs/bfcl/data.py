"""BFCL v3 multi-turn tasks, read offline from the files the PyPI package ``bfcl-eval`` ships.

The package's ``data`` folder holds, for each multi-turn category ``C``:

* ``BFCL_v<N>_<C>.json``: one task per line: ``id``, ``question`` (the user turns, each a list of
  ``{"role", "content"}`` messages), ``initial_config`` (the scenario each API class loads),
  ``involved_classes``, and in ``multi_turn_miss_func`` ``missed_function`` (turn -> names of
  functions held out until that turn, whose user turn is then empty);
* ``possible_answer/BFCL_v<N>_<C>.json``: the same ids with ``ground_truth``, one list of call
  strings per user turn (an empty list where the right answer is to call nothing);
* ``multi_turn_func_doc/<api>.json``: the function documentation of each API class, one JSON
  object per line.

The v4 release keeps the v3 multi-turn categories unchanged under the ``BFCL_v4_`` prefix; the
highest version present is read. As in the package's own loader, a task's functions are the docs
of all its involved classes, less the held-out ones, which join at their turn.

The package's declared dependencies are heavy and pin an old numpy, so it is installed without
them (``pip install --no-deps bfcl-eval``); executing the multi-turn APIs needs only ``mpmath``
besides the standard library.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import pathlib
import re
from typing import Any, Mapping, Sequence

CATEGORIES = (
    "multi_turn_base",
    "multi_turn_miss_func",
    "multi_turn_miss_param",
    "multi_turn_long_context",
)

INSTALL_HINT = (
    "the BFCL environment needs the bfcl-eval package installed without its declared "
    "dependencies: pip install --no-deps bfcl-eval && pip install mpmath"
)

_BACKEND_CONFIG = "bfcl_eval.constants.executable_backend_config"


@dataclasses.dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclasses.dataclass(frozen=True)
class BfclTask:
    """One multi-turn task. Treat the dicts as read-only: episodes load deep copies.

    Attributes:
      id: the BFCL id, e.g. ``"multi_turn_base_0"``.
      category: one of :data:`CATEGORIES`.
      turns: the user turns; each a tuple of messages (empty where a miss-func turn only adds
        functions).
      initial_config: class name -> the scenario its instance loads (``_load_scenario``).
      involved_classes: the API classes instantiated for the task, in the data's order.
      functions: docs of the functions offered from the first turn.
      added_functions: turn index -> docs of the functions offered from that turn on.
      ground_truth: per user turn, the annotated call strings (``"cd(folder='x')"``).
    """

    id: str
    category: str
    turns: tuple[tuple[Message, ...], ...]
    initial_config: Mapping[str, Any]
    involved_classes: tuple[str, ...]
    functions: tuple[Mapping[str, Any], ...]
    added_functions: Mapping[int, tuple[Mapping[str, Any], ...]]
    ground_truth: tuple[tuple[str, ...], ...]

    @property
    def long_context(self) -> bool:
        """The official executor loads long-context scenarios (extra files, bigger state) here."""
        return "long_context" in self.category

    @property
    def min_turns(self) -> int:
        """Fewest model turns that can succeed: every user turn needs one response to end it,
        and a turn with annotated calls also needs at least one response that calls (the checker
        fails a turn without calls). Replaying the annotation takes exactly this many."""
        return len(self.turns) + sum(1 for calls in self.ground_truth if calls)


def package_data_dir() -> pathlib.Path:
    """The ``data`` folder of the installed ``bfcl_eval`` package (found without importing it)."""
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"bfcl_eval is not installed: {INSTALL_HINT}")
    return pathlib.Path(next(iter(spec.submodule_search_locations))) / "data"


def backend_config():
    """The package's ``executable_backend_config`` module (class -> module and doc file)."""
    try:
        return importlib.import_module(_BACKEND_CONFIG)
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(f"{error}: {INSTALL_HINT}") from error


def load_tasks(
    categories: Sequence[str] = ("multi_turn_base",), data_dir: str | pathlib.Path | None = None
) -> list[BfclTask]:
    """All tasks of ``categories``, in the order given and, within one, the file's order.

    ``data_dir``: a folder laid out like the package's ``data`` (default: the installed one).
    """
    if isinstance(categories, str):
        categories = (categories,)
    for category in categories:
        if category not in CATEGORIES:
            raise ValueError(f"unknown BFCL category {category!r}; expected one of {CATEGORIES}")
    root = pathlib.Path(data_dir) if data_dir is not None else package_data_dir()
    docs = _DocCache(root / "multi_turn_func_doc")
    tasks = []
    for category in categories:
        questions = _read_jsonl(_versioned_file(root, category))
        answers = _read_jsonl(_versioned_file(root / "possible_answer", category))
        if len(questions) != len(answers):
            raise ValueError(
                f"{category}: {len(questions)} tasks but {len(answers)} possible answers"
            )
        for (where, question), (answer_where, answer) in zip(questions, answers):
            tasks.append(_make_task(category, where, question, answer_where, answer, docs))
    return tasks


def _make_task(category, where, question, answer_where, answer, docs) -> BfclTask:
    task_id = _field(question, "id", str, where)
    if _field(answer, "id", str, answer_where) != task_id:
        raise ValueError(
            f"{answer_where}: possible answer id {answer['id']!r} does not match "
            f"the task id {task_id!r} at {where}"
        )
    raw_turns = _field(question, "question", list, where)
    truth = _field(answer, "ground_truth", list, answer_where)
    if len(truth) != len(raw_turns):
        raise ValueError(
            f"{answer_where}: {len(truth)} ground-truth turns for {len(raw_turns)} "
            f"user turns of {task_id}"
        )
    turns = tuple(_messages(turn, f"{where}: question[{k}]") for k, turn in enumerate(raw_turns))
    for k, calls in enumerate(truth):
        if not isinstance(calls, list) or not all(isinstance(c, str) for c in calls):
            raise ValueError(f"{answer_where}: ground_truth[{k}] must be a list of call strings")
    classes = tuple(_field(question, "involved_classes", list, where))
    if not classes or not all(isinstance(name, str) for name in classes):
        raise ValueError(f"{where}: field 'involved_classes' must be a non-empty list of names")
    functions = [doc for name in classes for doc in docs.of(name, where)]
    added: dict[int, tuple] = {}
    missed = question.get("missed_function", {})
    if not isinstance(missed, dict):
        raise ValueError(f"{where}: field 'missed_function' must be a dict")
    for turn, names in missed.items():
        if not (turn.isdigit() and int(turn) < len(turns)) or turns[int(turn)]:
            raise ValueError(f"{where}: missed_function turn {turn!r} must name an empty user turn")
        if not isinstance(names, list):
            raise ValueError(f"{where}: missed_function[{turn!r}] must be a list of names")
        held = [doc for doc in functions if doc["name"] in names]
        if len(held) != len(names):
            raise ValueError(f"{where}: missed_function {names} names functions not documented")
        functions = [doc for doc in functions if doc["name"] not in names]
        added[int(turn)] = tuple(held)
    return BfclTask(
        id=task_id,
        category=category,
        turns=turns,
        initial_config=_field(question, "initial_config", dict, where),
        involved_classes=classes,
        functions=tuple(functions),
        added_functions=added,
        ground_truth=tuple(tuple(calls) for calls in truth),
    )


def _messages(turn, where: str) -> tuple[Message, ...]:
    if not isinstance(turn, list) or not all(isinstance(m, dict) for m in turn):
        raise ValueError(f"{where} must be a list of {{'role', 'content'}} messages")
    return tuple(
        Message(_field(m, "role", str, where), _field(m, "content", str, where)) for m in turn
    )


class _DocCache:
    """Function docs per API class, read once per load."""

    def __init__(self, folder: pathlib.Path):
        self.folder, self.docs = folder, {}

    def of(self, class_name: str, where: str) -> list[dict]:
        if class_name not in self.docs:
            files = backend_config().MULTI_TURN_FUNC_DOC_FILE_MAPPING
            if class_name not in files:
                raise ValueError(
                    f"{where}: unknown API class {class_name!r}; known: {sorted(files)}"
                )
            docs = [doc for _, doc in _read_jsonl(self.folder / files[class_name])]
            for doc in docs:
                _field(doc, "name", str, str(self.folder / files[class_name]))
            self.docs[class_name] = docs
        return self.docs[class_name]


def _versioned_file(folder: pathlib.Path, category: str) -> pathlib.Path:
    """``folder/BFCL_v<N>_<category>.json`` with the highest ``N``."""
    pattern = re.compile(rf"BFCL_v(\d+)_{re.escape(category)}\.json")
    found = sorted(
        (int(m.group(1)), path)
        for path in folder.glob(f"BFCL_v*_{category}.json")
        if (m := pattern.fullmatch(path.name))
    )
    if not found:
        raise FileNotFoundError(f"no BFCL_v<N>_{category}.json in {folder}")
    return found[-1][1]


def _read_jsonl(path: pathlib.Path) -> list[tuple[str, dict]]:
    """``(where, object)`` per non-empty line; ``where`` is ``file:line`` for error messages."""
    if not path.is_file():
        raise FileNotFoundError(f"BFCL data file {path} does not exist")
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not valid JSON ({error.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
        rows.append((where, row))
    return rows


def _field(row: Mapping, key: str, kind: type, where: str):
    if key not in row:
        raise ValueError(f"{where}: missing field {key!r}")
    if not isinstance(row[key], kind):
        raise ValueError(
            f"{where}: field {key!r} must be a {kind.__name__}, got {type(row[key]).__name__}"
        )
    return row[key]
