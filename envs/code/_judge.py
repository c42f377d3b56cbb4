"""The judge inside the sandbox: runs assert tests' checks against a candidate it never meets.

Started fresh (``python -S -s -B _judge.py``) by the runner under a uid of its own, so no
candidate process can read its memory or descriptors. Descriptors: 3 lines from the runner,
4 lines to the runner, 5 the checks (JSON written by the trusted parent: ``prelude`` and
``tests``: index -> ``{"source", "entry_point"}``), which the runner never reads.

Per ``{"run": i}`` the judge runs test ``i``'s ``check(candidate)`` where ``candidate`` is a
proxy: each call sends ``{"call": <args and kwargs as plain data>}`` and waits for
``{"reply": <the candidate's answer line>}`` or ``{"gone": why}``. The answer is decoded
strictly into built-in values (:mod:`_plain`), so the check's ``==`` is the built-in one;
then the judge sends ``{"i": i, "verdict": {"status", "message", "got", "want"}}``.
"""

import builtins
import json
import os
import sys

import _plain

FROM_RUNNER, TO_RUNNER, CHECKS = 3, 4, 5
MAX_MESSAGE = 500
PRISTINE_BUILTINS = dict(vars(builtins))
ARGUMENT_LIMIT = 64 << 20


def clip(text, limit=MAX_MESSAGE):
    return text if len(text) <= limit else text[:limit] + "..."


def safe_repr(value):
    try:
        return repr(value)
    except Exception as error:
        return f"<unprintable {type(value).__name__}: {type(error).__name__}>"


class CandidateGone(BaseException):
    """The candidate stopped answering (timed out, crashed): the test is not the check's to
    judge. A BaseException, so that a check's ``except Exception`` cannot swallow it."""


class CandidateRaised(Exception):
    """The candidate's function raised; subclassed per built-in exception name, so that a
    check expecting e.g. ``ValueError`` catches it."""

    message = ""


_RAISED = {}


def raised(name, message):
    """A :class:`CandidateRaised` that is also the built-in exception ``name`` if there is one."""
    base = getattr(builtins, name, None)
    if not (isinstance(base, type) and issubclass(base, Exception)) or base is Exception:
        base = RuntimeError
    if name not in _RAISED:
        try:
            _RAISED[name] = type(name, (base, CandidateRaised), {})
        except TypeError:  # a layout conflict between the two bases
            _RAISED[name] = type(name, (RuntimeError, CandidateRaised), {})
    error = _RAISED[name](message)
    error.message = message
    return error


class Line:
    def __init__(self, fd):
        self.fd, self.buffer = fd, b""

    def read(self):
        while b"\n" not in self.buffer:
            data = os.read(self.fd, 1 << 16)
            if not data:
                sys.exit(0)  # the runner is gone
            self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)


def write(message):
    data = (json.dumps(message, allow_nan=True) + "\n").encode("utf-8", "surrogatepass")
    while data:
        data = data[os.write(TO_RUNNER, data) :]


def make_proxy(lines):
    def candidate(*args, **kwargs):
        try:
            payload = _plain.encode([list(args), kwargs], ARGUMENT_LIMIT)
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"the check passed the candidate a value that cannot cross the "
                f"sandbox boundary: {error}"
            ) from None
        write({"call": payload})
        answer = lines.read()
        if "gone" in answer:
            raise CandidateGone(answer["gone"])
        return read_reply(answer.get("reply"))

    return candidate


def read_reply(text):
    """The candidate's answer line, strictly: ``{"value": data}``, ``{"raised": [name,
    message]}`` or ``{"error": message}``; anything else means it stopped answering."""
    try:
        reply = json.loads(text)
        if type(reply) is not dict or len(reply) != 1:
            raise ValueError("not a one-key object")
        ((kind, body),) = reply.items()
        if kind == "value":
            return _plain.from_json(body)
    except (ValueError, TypeError, RecursionError) as error:
        raise CandidateGone(f"a malformed answer: {clip(str(error), 100)}") from None
    if (
        kind == "raised"
        and type(body) is list
        and len(body) == 2
        and all(type(x) is str for x in body)
    ):
        raise raised(body[0][:100], body[1])
    if kind == "error" and type(body) is str:
        raise Unanswerable(body)
    raise CandidateGone("a malformed answer")


class Unanswerable(BaseException):
    """The candidate's function returned something that is not plain data."""


class Reporter:
    """``_sandbox_report(got, want)``: the instrumented asserts call it before comparing,
    so a failure can show both sides."""

    def __init__(self):
        self.got = self.want = None

    def __call__(self, got, want):
        self.got, self.want = clip(safe_repr(got)), clip(safe_repr(want))


def judge(check, prelude, lines):
    """Run one check: the verdict record."""
    reporter = Reporter()
    candidate = make_proxy(lines)
    namespace = {
        "__name__": "check",
        "__builtins__": PRISTINE_BUILTINS,
        "_sandbox_report": reporter,
    }
    try:
        if prelude:
            exec(compile(prelude, "<prelude>", "exec"), namespace)
        namespace[check["entry_point"]] = candidate
        exec(compile(check["source"], "<test>", "exec"), namespace)
        namespace["check"](candidate)
        return {"status": "passed", "message": ""}
    except CandidateGone as gone:
        return {"status": "error", "message": f"the program stopped answering ({gone})"}
    except CandidateRaised as error:
        return {"status": "error", "message": clip(error.message)}
    except Unanswerable as error:
        return {"status": "error", "message": clip(str(error))}
    except AssertionError as error:
        text = clip(str(error))
        message = f"AssertionError: {text}" if text else "the check failed"
        return {"status": "failed", "message": message, "got": reporter.got, "want": reporter.want}
    except BaseException as error:
        return {"status": "error", "message": clip(f"{type(error).__name__} in the check: {error}")}


def main():
    checks_text = b""
    os.lseek(CHECKS, 0, os.SEEK_SET)
    while True:
        data = os.read(CHECKS, 1 << 20)
        if not data:
            break
        checks_text += data
    os.close(CHECKS)
    checks = json.loads(checks_text)
    lines = Line(FROM_RUNNER)
    while True:
        request = lines.read()
        index = request["run"]
        verdict = judge(checks["tests"][str(index)], checks["prelude"], lines)
        write({"i": index, "verdict": verdict})


if __name__ == "__main__":
    main()
