"""Run a Python program against unit tests in a sandboxed subprocess.

:func:`run_tests` runs one program against a list of tests and returns one
:class:`TestResult` per test: ``passed``, ``failed`` (wrong answer or failed assert),
``error`` (exception, crash, memory or output limit, forbidden operation) or ``timeout``
(wall clock or CPU time), with a short message, what the test ran, and expected / got.

Three kinds of test:

* :class:`StdioTest`: the program runs as ``__main__`` with ``input`` on stdin; its stdout
  must match ``output`` (see :func:`outputs_match`). DeepCoder, LiveCodeBench, Codeforces.
* :class:`CallTest`: the program is loaded, then ``fn_name(*args)`` is called (a global
  function or a method of a ``Solution`` class); the JSON value returned must equal
  ``expected`` (see :func:`values_match`). LiveCodeBench "functional", TACO ``fn_name``.
* :class:`AssertTest`: HumanEval style, ``check(candidate)`` from ``source`` is called with the
  program's ``entry_point``; the test passes when no assert fails.

How a run is contained
----------------------
By default (``isolation="strict"``) the runner starts inside a bubblewrap sandbox, each
candidate process under a fresh uid, with a seccomp filter (:mod:`envs.code.isolation`, whose
docstring lists each layer and what it stops; the threat model is ``envs/code/SANDBOX.md``).
Where a layer is missing, :func:`run_tests` raises :class:`SandboxUnavailable` rather than run
the program with less; ``isolation="unsafe-no-isolation"`` runs it on the host as the
caller's user (resource limits, process groups and an audit hook only), for trusted programs.

Verdicts are computed outside the candidate's process. Expected outputs of stdio and call
tests never enter the sandbox: the runner returns what the program printed or returned (JSON
data) and it is compared here. The checks of assert tests run in a separate judge process
that the candidate cannot reach; each ``candidate(...)`` call and its value cross as plain
data (:mod:`envs.code._plain`), so neither an object with a forged ``==`` nor a record
written by the program can pass a test. Every record from the sandbox is validated here:
a malformed, duplicated or unexpected record makes that test an ``error``, never an
exception and never a pass.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pathlib
import signal
import subprocess
import tempfile
import time
from typing import Any, Sequence, Union

from agentrl_jax.folders import FolderKind, remove_folder
from envs.code.isolation import (
    INSIDE_SCRIPTS,
    STRICT,
    SandboxUnavailable,
    candidate_uids,
    python_paths,
    resolve_isolation,
    sandbox_command,
    seccomp_fd,
    strict_problems,
)

__all__ = [
    "AssertTest",
    "CallTest",
    "SandboxLimits",
    "SandboxUnavailable",
    "StdioTest",
    "Test",
    "TestResult",
    "outputs_match",
    "run_tests",
    "strict_problems",
    "values_match",
]

HARNESS = pathlib.Path(__file__).with_name("_harness.py")
STATUSES = ("passed", "failed", "error", "timeout")
# Extra wall-clock seconds a run gets beyond ``total_timeout_s`` to start and report.
STARTUP_GRACE_S = 10.0
REAL_TOLERANCE = 1e-6


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run (a program against a task's tests).

    Attributes:
      timeout_s: wall-clock seconds per test.
      total_timeout_s: wall-clock seconds for all tests of a run; tests not started in time
        are reported as ``timeout``.
      memory_mb: address-space limit of each test process (``RLIMIT_AS``), MiB.
      output_bytes: most bytes of stdout (and of any file written) per test.
      processes: most processes and threads of the candidate at once (``RLIMIT_NPROC`` on
        its uid; strict isolation only). Its memory is at most ``processes * memory_mb``.
      work_mb: size of the writable in-memory ``/work`` (strict isolation).
    """

    timeout_s: float = 4.0
    total_timeout_s: float = 30.0
    memory_mb: int = 1024
    output_bytes: int = 1 << 20
    processes: int = 32
    work_mb: int = 64

    def __post_init__(self):
        if not self.timeout_s > 0:
            raise ValueError(f"SandboxLimits.timeout_s must be > 0, got {self.timeout_s}")
        if not self.total_timeout_s >= self.timeout_s:
            raise ValueError(
                f"SandboxLimits.total_timeout_s must be >= timeout_s "
                f"({self.timeout_s}), got {self.total_timeout_s}"
            )
        if self.memory_mb < 64:
            raise ValueError(
                f"SandboxLimits.memory_mb must be >= 64 (Python needs it), got {self.memory_mb}"
            )
        if self.output_bytes < 1024:
            raise ValueError(f"SandboxLimits.output_bytes must be >= 1024, got {self.output_bytes}")
        if self.processes < 1:
            raise ValueError(f"SandboxLimits.processes must be >= 1, got {self.processes}")
        if self.work_mb < 1:
            raise ValueError(f"SandboxLimits.work_mb must be >= 1, got {self.work_mb}")

    @property
    def cpu_s(self) -> int:
        """CPU-time limit per test process (whole seconds, as ``RLIMIT_CPU`` counts)."""
        return max(1, math.ceil(self.timeout_s))


@dataclasses.dataclass(frozen=True)
class StdioTest:
    """Run the program with ``input`` on stdin; its stdout must match ``output``."""

    input: str
    output: str
    __test__ = False  # not a pytest class


@dataclasses.dataclass(frozen=True)
class CallTest:
    """Call ``fn_name(*args)``; the value returned must equal ``expected`` (JSON data).

    ``wrapped_expected``: the APPS/TACO convention, where expected values are often wrapped
    in a one-element list; ``[got] == expected`` is accepted too.
    """

    fn_name: str
    args: tuple
    expected: Any
    wrapped_expected: bool = False
    __test__ = False


@dataclasses.dataclass(frozen=True)
class AssertTest:
    """Run ``check(candidate)`` defined by ``source`` on the program's ``entry_point``.

    ``description`` is what feedback shows of the test (e.g. the assert's source).
    ``source`` may call ``_sandbox_report(got, want)`` before comparing, so a failure shows
    both values (see :func:`envs.code.datasets.split_check`).
    """

    source: str
    entry_point: str
    description: str = ""
    __test__ = False


Test = Union[StdioTest, CallTest, AssertTest]


@dataclasses.dataclass(frozen=True)
class TestResult:
    """The outcome of one test.

    ``status`` is one of :data:`STATUSES`; ``kind`` is ``"stdio"``, ``"call"`` or
    ``"assert"``; ``test`` says what ran (the stdin text, the call, the assert's source);
    ``expected``/``got`` are given where known. Strings are not cut here (stdout is capped
    at ``output_bytes``); feedback rendering clips them.
    """

    status: str
    message: str
    kind: str
    test: str
    expected: str | None = None
    got: str | None = None
    __test__ = False

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def run_tests(
    program: str,
    tests: Sequence[Test],
    limits: SandboxLimits = SandboxLimits(),
    *,
    prelude: str = "",
    isolation: str | None = None,
    python_guard: bool = True,
    tmp_root: str | os.PathLike | None = None,
) -> list[TestResult]:
    """Run ``program`` against ``tests``: one :class:`TestResult` per test, in order.

    Args:
      program: Python source.
      tests: the tests; all run in one sandboxed runner, each in a fresh process.
      limits: time, memory, process and output limits.
      prelude: source executed before the program, in its namespace, and in the namespace
        of assert tests' ``check`` (HumanEval: the prompt, so the helpers it defines exist;
        LiveCodeBench: ``from typing import *``).
      isolation: ``"strict"`` (the default, None) or ``"unsafe-no-isolation"``; see the
        module docstring. Strict raises :class:`SandboxUnavailable` where it cannot hold.
      python_guard: install the audit-hook guard. False only to test the other layers.
      tmp_root: where the unsafe mode's throwaway directory is made (default: the system's
        temp dir); strict runs write only inside the sandbox's own in-memory ``/work``.

    Never raises on anything the program does; raises ``ValueError`` on a bad test list and
    :class:`SandboxUnavailable` as said.
    """
    tests = list(tests)
    for i, test in enumerate(tests):
        if not isinstance(test, (StdioTest, CallTest, AssertTest)):
            raise ValueError(
                f"run_tests: tests[{i}] is a {type(test).__name__}, not a "
                "StdioTest, CallTest or AssertTest"
            )
    isolation = resolve_isolation(isolation)
    if not tests:
        return []
    strict = isolation == STRICT
    workdir = None if strict else tempfile.mkdtemp(prefix=_WORKDIR_PREFIX, dir=tmp_root)
    uid, judge_uid = candidate_uids()
    job = dict(
        program=program,
        prelude=prelude,
        tests=[_job_test(t) for t in tests],
        timeout_s=limits.timeout_s,
        cpu_s=limits.cpu_s,
        total_timeout_s=limits.total_timeout_s,
        memory_bytes=limits.memory_mb << 20,
        output_bytes=limits.output_bytes,
        processes=limits.processes,
        isolated=strict,
        uid=uid,
        judge_uid=judge_uid,
        guard=python_guard,
        python=python_paths()[1],
    )
    checks = {
        "prelude": prelude,
        "tests": {
            str(i): {"source": t.source, "entry_point": t.entry_point}
            for i, t in enumerate(tests)
            if isinstance(t, AssertTest)
        },
    }
    try:
        records, missing = _launch(job, checks, workdir, limits)
    finally:
        if workdir is not None:
            _remove_tree(workdir)
    return [_verdict(test, records.get(i), missing) for i, test in enumerate(tests)]


def _job_test(test: Test) -> dict:
    """What the runner gets of a test: never an expected output, never a check's source."""
    if isinstance(test, StdioTest):
        return {"kind": "stdio", "input": test.input}
    if isinstance(test, CallTest):
        return {"kind": "call", "fn_name": test.fn_name, "args": list(test.args)}
    return {"kind": "assert", "entry_point": test.entry_point}


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, 0)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _launch(
    job: dict, checks: dict, workdir: str | None, limits: SandboxLimits
) -> tuple[dict[int, dict], tuple[str, str]]:
    """Run the runner: ``(records by test index, (status, message) of tests without one)``."""
    fds = [
        _memfd(
            "agentrl-checks", json.dumps(checks, allow_nan=True).encode("utf-8", "surrogatepass")
        )
    ]
    job["judge_fd"] = fds[0]
    if job["isolated"]:
        fds.append(seccomp_fd())
        command = sandbox_command(seccomp=fds[1], work_bytes=limits.work_mb << 20) + [
            f"{INSIDE_SCRIPTS}/_harness.py"
        ]
        cwd, env = "/", {}
    else:
        command = [job["python"], "-S", "-s", "-B", str(HARNESS)]
        cwd = workdir
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "HOME": workdir,
            "TMPDIR": workdir,
            "PYTHONHASHSEED": "0",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONIOENCODING": "utf-8",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
    payload = json.dumps(job, allow_nan=True).encode("utf-8", "surrogatepass")
    try:
        process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=env,
            pass_fds=fds,
            start_new_session=True,
        )
    finally:
        for fd in fds:
            os.close(fd)
    timed_out = False
    try:
        out, err = process.communicate(payload, timeout=limits.total_timeout_s + STARTUP_GRACE_S)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        _kill_session(process.pid)
    if timed_out:
        out, err = process.communicate()
    records = _read_records(out, len(job["tests"]))
    if isinstance(records, str):
        return {}, ("error", records)
    if not timed_out and process.returncode != 0:
        detail = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
        return records, (
            "error",
            f"the sandbox stopped unexpectedly (exit status "
            f"{process.returncode}) {detail[0][:300]}".strip(),
        )
    return records, (
        "timeout",
        f"not run: the run's total time limit ({limits.total_timeout_s:g} s) ran out",
    )


def _read_records(out: bytes, count: int) -> dict[int, dict] | str:
    """The runner's records by test index, validated (a compile error: its message).

    A line that is not a JSON object with a valid, not yet seen index is dropped (its test
    then counts as not reported); a record with fields of the wrong type is replaced by an
    error record for its test."""
    records: dict[int, dict] = {}
    for line in out.decode("utf-8", "replace").splitlines():
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # a last line cut off by a kill, or hostile
            continue
        if not isinstance(record, dict):
            continue
        if "compile_error" in record:
            message = record["compile_error"]
            return message if isinstance(message, str) else "the program does not compile"
        index = record.get("i")
        if type(index) is not int or not 0 <= index < count or index in records:
            continue
        records[index] = (
            record
            if _well_formed(record)
            else {"status": "error", "message": "the sandbox sent a malformed record for this test"}
        )
    return records


def _well_formed(record: dict) -> bool:
    strings = ("message", "stdout", "got", "want")
    return record.get("status") in ("ok", "passed", "failed", "error", "timeout") and all(
        record.get(k) is None or isinstance(record[k], str) for k in strings
    )


def _kill_session(sid: int, settle_s: float = 2.0) -> None:
    """SIGKILL the process group ``sid`` and every process in session ``sid``, and wait (up to
    ``settle_s``) until none is left alive, so no process outlives the run.

    Safe after the leader is reaped: Linux does not hand out a PID again while it still
    names a living session or group.
    """
    try:
        os.killpg(sid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    deadline = time.monotonic() + settle_s
    # A process forked while the scan runs escapes one pass, and a killed one takes a moment
    # to die: repeat until a pass finds no living member of the session.
    while _signal_session(sid) and time.monotonic() < deadline:
        time.sleep(0.01)


def _signal_session(sid: int) -> int:
    """SIGKILL every living (not zombie) process of session ``sid``; returns how many."""
    alive = 0
    for entry in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it ended meanwhile
            continue
        # Fields after the command name: state, ppid, pgrp, session, ...
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 3 and int(fields[3]) == sid and fields[0] not in ("Z", "X"):
            alive += 1
            try:
                os.kill(int(entry.name), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    return alive


# a program's working directory: made by run_tests with this prefix, deleted after it
_WORKDIR_PREFIX = "agentrl-code-"
WORKDIR = FolderKind(
    "code-workdir",
    "program working directory",
    layout=lambda p: p.name.startswith(_WORKDIR_PREFIX),
)


def _remove_tree(path: str) -> None:
    """Delete the working directory, whatever permissions the program left on it."""
    for root, dirs, _ in os.walk(path):
        for name in dirs:
            directory = os.path.join(root, name)
            try:
                if not os.path.islink(directory):
                    os.chmod(directory, 0o700)
            except OSError:
                pass
    with contextlib.suppress(OSError):
        remove_folder(path, WORKDIR)


def _verdict(test: Test, record: dict | None, missing: tuple[str, str]) -> TestResult:
    """Judge one test from the runner's record (None: the runner never reported it; then
    ``missing`` is the status and message to give). Never raises: a record that cannot be
    judged is an ``error``."""
    try:
        return _judge(test, record, missing)
    except (RecursionError, ValueError, TypeError, OverflowError):
        return TestResult(
            "error", "the sandbox sent a record that cannot be judged", _kind(test), _describe(test)
        )


def _judge(test: Test, record: dict | None, missing: tuple[str, str]) -> TestResult:
    kind, shown = _kind(test), _describe(test)
    expected = (
        test.output
        if isinstance(test, StdioTest)
        else _show(test.expected)
        if isinstance(test, CallTest)
        else None
    )
    if record is None:
        return TestResult(*missing, kind, shown, expected)
    status, message = record.get("status"), record.get("message", "")
    if isinstance(test, AssertTest):
        if status not in STATUSES:
            status, message = (
                "error",
                f"the sandbox reported an unknown status {str(status)[:40]!r}",
            )
        return TestResult(status, message, kind, shown, record.get("want"), record.get("got"))
    if status not in ("ok", "error", "timeout"):  # only the caller decides a pass
        return TestResult(
            "error",
            f"the sandbox reported an unknown status {str(status)[:40]!r}",
            kind,
            shown,
            expected,
            None,
        )
    if isinstance(test, StdioTest):
        got = record.get("stdout", "")
        if status != "ok":
            return TestResult(status, message, kind, shown, expected, got)
        if outputs_match(got, test.output):
            return TestResult("passed", "", kind, shown, expected, got)
        return TestResult("failed", "wrong answer", kind, shown, expected, got)
    if status != "ok":
        return TestResult(status, message, kind, shown, expected, None)
    got_value = record.get("value")
    if values_match(got_value, test.expected) or (
        test.wrapped_expected and values_match([got_value], test.expected)
    ):
        return TestResult("passed", "", kind, shown, expected, _show(got_value))
    return TestResult("failed", "wrong answer", kind, shown, expected, _show(got_value))


def _kind(test: Test) -> str:
    return (
        "stdio"
        if isinstance(test, StdioTest)
        else "call"
        if isinstance(test, CallTest)
        else "assert"
    )


def _describe(test: Test) -> str:
    if isinstance(test, StdioTest):
        return test.input
    if isinstance(test, CallTest):
        return f"{test.fn_name}({', '.join(_show(a) for a in test.args)})"
    return test.description or test.source


def _show(value: Any) -> str:
    return json.dumps(value, allow_nan=True)


def outputs_match(got: str, expected: str) -> bool:
    """Does printed output ``got`` match ``expected``, as competitive-programming judges do?

    Whitespace-separated tokens must be equal; where the expected token is a real number
    (has a ``.`` or an exponent), a token within ``1e-6`` absolute or relative error also
    matches. So line breaks, trailing spaces and final newlines do not matter; integer
    tokens must match exactly.
    """
    got_tokens, want_tokens = got.split(), expected.split()
    if len(got_tokens) != len(want_tokens):
        return False
    return all(g == w or _reals_close(g, w) for g, w in zip(got_tokens, want_tokens))


def _reals_close(got: str, want: str) -> bool:
    if not any(c in want for c in ".eE"):
        return False
    try:
        g, w = float(got), float(want)
    except ValueError:
        return False
    return math.isfinite(w) and math.isclose(g, w, rel_tol=REAL_TOLERANCE, abs_tol=REAL_TOLERANCE)


def values_match(got: Any, expected: Any) -> bool:
    """Equality of JSON data, except that numbers where either is a float match within
    ``1e-6`` (absolute or relative) and a boolean never equals a number (``True != 1``)."""
    if isinstance(expected, bool) or isinstance(got, bool):
        return type(got) is type(expected) and got == expected
    numbers = (int, float)
    if isinstance(expected, numbers) and isinstance(got, numbers):
        if isinstance(expected, int) and isinstance(got, int):
            return got == expected
        return math.isclose(got, expected, rel_tol=REAL_TOLERANCE, abs_tol=REAL_TOLERANCE) or (
            math.isnan(got) and math.isnan(expected)
        )
    if isinstance(expected, list) and isinstance(got, list):
        return len(got) == len(expected) and all(map(values_match, got, expected))
    if isinstance(expected, dict) and isinstance(got, dict):
        return got.keys() == expected.keys() and all(
            values_match(got[k], expected[k]) for k in expected
        )
    return type(got) is type(expected) and got == expected
