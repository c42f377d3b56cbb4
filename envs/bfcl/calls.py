"""Function calls: the response grammar, and their execution against BFCL's stateful APIs.

Grammar
-------
:func:`parse_response` maps any string to :class:`Calls`, :class:`NoCall` or :class:`Malformed`:

1. Thinking is ignored: everything up to the last ``</think>`` is dropped. A ``<think>`` still
   open after that (the model stopped mid-thought) is :class:`Malformed`: it must not be read as
   "no call", which would end the user's request.
2. A code fence around the whole answer (```` ```python ... ``` ````) is removed, then the
   surrounding whitespace (:func:`_unfence`; every step of the parse takes time linear in
   the response's length).
3. An empty answer, or ``[]``, is :class:`NoCall`: the current user request is finished.
4. An answer starting with ``[`` or with ``name(`` is a call list, BFCL's own prompting format:
   the whole answer must be one Python list of calls, ``[cd(folder='docs'), ls(a=True)]``; as
   in BFCL's decoder the brackets may be left out (``ls(a=True)``). Each function is a plain
   name; arguments are keyword or positional *literals* (strings, numbers, True/False/None and
   lists, tuples, dicts and sets of them, read with :func:`ast.literal_eval`). Anything else
   (broken syntax, text around the list, a variable or an expression as an argument,
   ``*args``) is :class:`Malformed`, with the reason.
5. Any other text is a message to the user: :class:`NoCall`.

Nothing is ever evaluated: the text is parsed with :mod:`ast` and only literals are read.

Execution
---------
:class:`ApiSet` holds one episode's instances of the package's API classes, each loaded with
its scenario (``_load_scenario`` on a deep copy of the task's ``initial_config``, as the official
executor does), and dispatches a parsed call to the public method of that name. Results are
turned into text exactly as the official executor does (a ``str`` as is, a ``dict`` as JSON, or
``str`` of it when it is not serialisable, anything else ``str``; an exception becomes
``"Error during execution: <message>"``), since the response check compares these texts.
Unlike the official executor (which ``eval``-s the call text), only the API's public methods
can be called; any other name gives the error ``eval`` would give for an undefined name.
Calls into ``MathAPI`` run one at a time across threads (it sets mpmath's process-wide
precision); the price is that a ``MathAPI`` call that never returns also holds up the other
rows' ``MathAPI`` calls until it does.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import importlib
import inspect
import json
import re
import threading
import uuid
from typing import Any, Callable, Mapping, Sequence

from envs.bfcl import data

_THINK_OPEN = re.compile(r"<\s{0,4}think\s{0,4}>", re.IGNORECASE | re.ASCII)
_THINK_CLOSE = re.compile(r"<\s{0,4}/\s{0,4}think\s{0,4}>", re.IGNORECASE | re.ASCII)
# Single runs matched at a known position: they cannot backtrack (see _unfence).
_SPACES = re.compile(r"[ \t]*")
_LABEL = re.compile(r"[A-Za-z0-9_+-]*")
_CALL_START = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\(")

ERROR_PREFIX = "Error during execution: "
# Classes whose methods change process-wide state: MathAPI.logarithm sets mpmath's global
# precision, which also decides how its result prints. Their calls (and the printing of the
# result) run one at a time so that concurrent rows cannot change each other's results.
_PROCESS_STATE_CLASSES = frozenset({"MathAPI"})
_PROCESS_STATE_LOCK = threading.Lock()
_NOT_LITERAL = object()


@dataclasses.dataclass(frozen=True)
class Call:
    """One parsed call. ``text``: its canonical source (``ast.unparse``), shown with its result."""

    name: str
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]
    text: str


@dataclasses.dataclass(frozen=True)
class Calls:
    """A response that calls functions, in order."""

    calls: tuple[Call, ...]


@dataclasses.dataclass(frozen=True)
class NoCall:
    """A response without a call: the current user request is finished. ``text``: the answer."""

    text: str


@dataclasses.dataclass(frozen=True)
class Malformed:
    """A response that tried to call functions but does not parse; ``reason`` says why."""

    reason: str


# One thread at a time in ast.parse: CPython 3.11's AST constructor counts its recursion depth
# in state that threads share, so two parses at once (PythonTextEnv's worker threads) can
# fail with "SystemError: AST constructor recursion depth mismatch" (CPython gh-106905); the
# BFCL replay tests' rare failure under load was this.
_AST_LOCK = threading.Lock()


def parse_response(response: str) -> Calls | NoCall | Malformed:
    """The action of a model response (grammar in the module docstring); never raises."""
    answer = _drop_thinking(response)
    if answer is None:
        return Malformed("the response ended inside <think> (no closing </think>)")
    inside = _unfence(answer.strip())
    answer = (answer if inside is None else inside).strip()
    if not answer.startswith("[") and not _CALL_START.match(answer):
        return NoCall(answer)
    source = answer if answer.startswith("[") else f"[{answer}]"
    try:
        with _AST_LOCK:
            tree = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError) as error:
        return Malformed(f"not a valid Python list of calls ({_error_text(error)})")
    if not isinstance(tree, ast.List):
        return Malformed("the answer must be a list of calls, e.g. [ls(a=True)]")
    calls = []
    for node in tree.elts:
        call = _call_of(node)
        if isinstance(call, Malformed):
            return call
        calls.append(call)
    return Calls(tuple(calls)) if calls else NoCall(answer)


def parse_call(source: str) -> Call:
    """One call from its source text (the ground truth's ``"cd(folder='x')"``).

    Raises:
      ValueError: ``source`` is not exactly one call with literal arguments.
    """
    try:
        with _AST_LOCK:
            node = ast.parse(source.strip(), mode="eval").body
    except (SyntaxError, ValueError) as error:
        raise ValueError(f"{source!r} is not a call: {_error_text(error)}") from None
    call = _call_of(node)
    if isinstance(call, Malformed):
        raise ValueError(f"{source!r}: {call.reason}")
    return call


def _unfence(text: str) -> str | None:
    """The inside of a code fence that is the whole of ``text`` (already stripped), or None.

    Fenced means ``text`` starts and ends with ```` ``` ```` (two distinct fences). The opening is
    followed by spaces/tabs, a label (``[A-Za-z0-9_+-]*``), spaces/tabs and one optional newline;
    the inside is what follows up to the closing fence, less the spaces/tabs and one newline
    just before it. A scanner, not a regex, so the time is linear in the length of ``text``.
    """
    if len(text) < 6 or not text.startswith("```") or not text.endswith("```"):
        return None
    start = _SPACES.match(text, 3).end()
    start = _SPACES.match(text, _LABEL.match(text, start).end()).end()
    if text.startswith("\n", start):
        start += 1
    # None of those runs can cross the closing backticks, so start <= len(text) - 3.
    inside = text[start : len(text) - 3].rstrip(" \t")
    return inside[:-1] if inside.endswith("\n") else inside


def _drop_thinking(response: str) -> str | None:
    """The text after the last ``</think>``; None if a ``<think>`` is still open there."""
    last_close = None
    for match in _THINK_CLOSE.finditer(response):
        last_close = match
    answer = response[last_close.end() :] if last_close is not None else response
    return None if _THINK_OPEN.search(answer) else answer


def _call_of(node: ast.expr) -> Call | Malformed:
    if not isinstance(node, ast.Call):
        return Malformed(f"{_unparse(node)} is not a function call")
    if not isinstance(node.func, ast.Name):
        return Malformed(f"{_unparse(node.func)} is not a plain function name")
    args, kwargs = [], []
    for arg in node.args:
        if isinstance(arg, ast.Starred):
            return Malformed(f"{node.func.id}: *arguments are not allowed")
        value = _literal(arg)
        if value is _NOT_LITERAL:
            return Malformed(f"{node.func.id}: argument {_unparse(arg)} is not a literal value")
        args.append(value)
    for keyword in node.keywords:
        if keyword.arg is None:
            return Malformed(f"{node.func.id}: **arguments are not allowed")
        value = _literal(keyword.value)
        if value is _NOT_LITERAL:
            return Malformed(
                f"{node.func.id}: argument {keyword.arg}={_unparse(keyword.value)} "
                "is not a literal value"
            )
        kwargs.append((keyword.arg, value))
    return Call(node.func.id, tuple(args), tuple(kwargs), _unparse(node))


def _literal(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NOT_LITERAL


def _unparse(node: ast.AST) -> str:
    try:
        return ast.unparse(node)
    except (ValueError, RecursionError):  # e.g. an int too long to print
        return "<unprintable>"


def _error_text(error: BaseException) -> str:
    if isinstance(error, SyntaxError):
        return f"{error.msg} at column {error.offset}" if error.offset else str(error.msg)
    return f"{type(error).__name__}: {error}"


def result_text(value: Any) -> str:
    """A call's result as the official executor writes it (the response check compares these)."""
    if type(value) is str:
        return value
    if type(value) is dict:
        try:
            return json.dumps(value)
        except Exception:  # e.g. a value that JSON cannot hold (an mpmath number)
            return str(value)
    return str(value)


class ApiSet:
    """The API instances of one episode, and the public methods the calls dispatch to."""

    def __init__(
        self, class_names: Sequence[str], initial_config: Mapping[str, Any], long_context: bool
    ):
        config = data.backend_config()
        self.instances: dict[str, Any] = {}
        self._methods: dict[str, tuple[str, Callable]] = {}
        for class_name in class_names:
            if class_name not in config.CLASS_FILE_PATH_MAPPING:
                raise ValueError(f"unknown BFCL API class {class_name!r}")
            module = importlib.import_module(config.CLASS_FILE_PATH_MAPPING[class_name])
            instance = getattr(module, class_name)()
            if class_name not in config.STATELESS_CLASSES:
                scenario = copy.deepcopy(dict(initial_config.get(class_name, {})))
                instance._load_scenario(scenario, long_context=long_context)
            self.instances[class_name] = instance
            for name, method in inspect.getmembers(instance, predicate=inspect.ismethod):
                if not name.startswith("_"):
                    self._methods[name] = (class_name, method)

    def run(self, calls: Sequence[Call]) -> list[str]:
        """Execute ``calls`` in order; one result text each (errors included, never raises)."""
        return [self.execute(call) for call in calls]

    def execute(self, call: Call) -> str:
        if call.name not in self._methods:
            return f"{ERROR_PREFIX}name '{call.name}' is not defined"
        class_name, method = self._methods[call.name]
        # Fresh argument objects per call: an API may keep (and later mutate) what it is given.
        args, kwargs = copy.deepcopy((call.args, dict(call.kwargs)))
        if class_name in _PROCESS_STATE_CLASSES:
            with _PROCESS_STATE_LOCK:
                return _run_one(method, args, kwargs)
        return _run_one(method, args, kwargs)

    def state_text(self) -> str:
        """The public attributes of every instance (what the state check compares), as text."""
        state = {
            name: {key: value for key, value in vars(instance).items() if not key.startswith("_")}
            for name, instance in self.instances.items()
        }
        try:
            return repr(state)
        except (ValueError, RecursionError):  # e.g. an int too long to print
            # A text no other state has: anchor keys may miss a match, never make a false one.
            return f"<unprintable state {uuid.uuid4()}>"


def _run_one(method: Callable, args: list, kwargs: dict) -> str:
    try:
        return result_text(method(*args, **kwargs))
    except Exception as error:
        return f"{ERROR_PREFIX}{error}"
