"""The runner that executes inside the sandbox (a standalone script: standard library only).

:mod:`envs.code.sandbox` starts ``python -s -B _harness.py`` with a throwaway directory as
its working directory, writes one JSON job to its stdin, and reads one JSON line per test
from its stdout. For each test this runner forks a child that: redirects stdin/stdout/stderr
to unnamed files in the directory, lowers its CPU-time and file-size limits, installs the
audit-hook guard, executes the program, and writes its outcome to file descriptor 3. The
runner waits with a wall-clock deadline, kills what is left, and reports.

Job fields: ``program``, ``prelude`` (source run before the program), ``tests`` (list of
``{"kind": "stdio", "input"}``, ``{"kind": "call", "fn_name", "args"}`` or
``{"kind": "assert", "source", "entry_point"}``), ``timeout_s``, ``cpu_s``,
``total_timeout_s``, ``memory_bytes``, ``output_bytes``, ``pid_namespace``, ``guard``.

The runner never sees expected outputs of stdio and call tests: the caller compares them,
outside the sandbox. Assert tests (HumanEval ``check``) must run in the program's process;
their pass record is a random nonce, so that a program that exits early or writes a record
itself cannot pass, though code that searches the interpreter's memory could find it.
"""

import builtins
import itertools
import json
import os
import resource
import signal
import sys
import tempfile
import time
import types

SUBMISSION = "<submission>"
PRELUDE = "<prelude>"
RESULT_FD = 3
MAX_MESSAGE = 500

# Audit events that programs may never raise (prefixes end with ".").
BLOCKED_EVENTS = frozenset({
    "os.fork", "os.forkpty", "os.exec", "os.spawn", "os.posix_spawn", "os.system",
    "os.kill", "os.killpg", "signal.pthread_kill", "subprocess.Popen", "pty.spawn",
    "resource.setrlimit", "resource.prlimit", "os.setxattr", "os.removexattr",
})
BLOCKED_PREFIXES = ("socket.", "ctypes.")
# Modules that reach native process or memory control around the events above.
BLOCKED_MODULES = frozenset({"ctypes", "_ctypes", "_posixsubprocess", "_cffi_backend", "cffi"})
# Events that change the filesystem: argument positions holding paths (and dir_fd).
PATH_EVENTS = {
    "os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),),
    "os.chmod": ((0, 2),), "os.chown": ((0, 3),), "os.truncate": ((0, None),),
    "os.utime": ((0, 3),), "os.chflags": ((0, None),), "os.lchflags": ((0, None),),
    "os.symlink": ((1, 2),), "os.link": ((0, 2), (1, 3)), "os.rename": ((0, 2), (1, 3)),
}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
PRISTINE_BUILTINS = dict(vars(builtins))  # taken before any program runs


def install_guard(root):
    """Reject, in this process, writes outside ``root``, sockets, new processes, signals,
    limit changes and native-code modules. Not a security boundary (see sandbox.py)."""
    realpath, fsdecode, join, isabs, sep = (os.path.realpath, os.fsdecode, os.path.join,
                                            os.path.isabs, os.sep)
    root = realpath(root)

    def inside(path, dir_fd=None, root_too=False):
        if isinstance(path, int):  # an already open descriptor
            return True
        path = fsdecode(path)
        if dir_fd is not None and dir_fd >= 0 and not isabs(path):
            path = join(realpath(f"/proc/self/fd/{dir_fd}"), path)
        path = realpath(path)
        return path.startswith(root + sep) or (root_too and path == root)

    def deny(what):
        raise PermissionError(f"sandbox: {what} is not allowed")

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            writing = ((isinstance(mode, str) and any(c in mode for c in "wax+"))
                       or (isinstance(flags, int) and flags & WRITE_FLAGS))
            # The root itself may be opened (O_TMPFILE makes unnamed files in it), but
            # not removed, renamed or changed below.
            if writing and not inside(path, root_too=True):
                deny(f"writing {path!r} outside the working directory")
        elif event in PATH_EVENTS:
            for path_at, dir_fd_at in PATH_EVENTS[event]:
                dir_fd = args[dir_fd_at] if dir_fd_at is not None else None
                if not inside(args[path_at], dir_fd):
                    deny(f"{event} on {args[path_at]!r} outside the working directory")
        elif event in BLOCKED_EVENTS or event.startswith(BLOCKED_PREFIXES):
            deny(event)
        elif event == "import" and str(args[0]).partition(".")[0] in BLOCKED_MODULES:
            deny(f"importing {args[0]}")

    for name in list(sys.modules):  # so that importing them raises the "import" event
        if name.partition(".")[0] in BLOCKED_MODULES | {"subprocess"}:
            del sys.modules[name]
    sys.addaudithook(hook)


def clip(text, limit=MAX_MESSAGE):
    return text if len(text) <= limit else text[:limit] + "..."


def describe(error):
    """``"ValueError: bad (line 3)"``: the exception and its last line in the submission."""
    line = None
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == SUBMISSION:
            line = tb.tb_lineno
        tb = tb.tb_next
    text = type(error).__name__
    try:
        detail = str(error)
    except Exception:  # a user exception whose __str__ fails
        detail = ""
    if detail:
        text += f": {detail}"
    return clip(text) + (f" (line {line})" if line is not None else "")


class Reporter:
    """``_sandbox_report(got, want)``: the instrumented HumanEval asserts call it before
    comparing, so a failure can show what the candidate returned. It also fails a value whose
    class defines ``__eq__`` in Python (searched a few levels into containers): an object
    that equals everything would otherwise pass every ``assert got == want``."""

    def __init__(self):
        self.got = self.want = None

    def __call__(self, got, want):
        self.got, self.want = clip(safe_repr(got)), clip(safe_repr(want))
        cheat = python_equality(got)
        if cheat is not None:
            raise AssertionError(f"the candidate returned a {cheat} object, whose == is written "
                                 "in Python; checks compare built-in values")


def python_equality(value, depth=3):
    """Name of a class in ``value`` whose ``__eq__`` is a Python function, or None."""
    if isinstance(getattr(type(value), "__eq__", None), types.FunctionType):
        return type(value).__name__
    if depth and type(value) in (list, tuple, set, frozenset, dict):
        items = value.items() if type(value) is dict else value
        for item in itertools.islice(items, 10_000):
            found = python_equality(item, depth - 1)
            if found is not None:
                return found
    return None


def safe_repr(value):
    try:
        return repr(value)
    except Exception as error:
        return f"<unprintable {type(value).__name__}: {type(error).__name__}>"


def resolve(namespace, name):
    """The function ``name``: a global, or a method of a ``Solution`` class (LeetCode style)."""
    if callable(namespace.get(name)):
        return namespace[name]
    solution = namespace.get("Solution")
    if isinstance(solution, type) and hasattr(solution, name):
        return getattr(solution(), name)
    raise NameError(f"the program does not define a function {name!r}")


def run_test(job, test, code, prelude, output_bytes):
    """In the forked child: run one test; returns the outcome record."""
    kind = test["kind"]
    # The program's own module; ``import __main__`` must not reach the runner.
    module = types.ModuleType("__main__" if kind == "stdio" else "solution")
    sys.modules["__main__"] = sys.modules[module.__name__] = module
    namespace = module.__dict__
    namespace["__builtins__"] = builtins
    reporter = Reporter()
    record = {"status": "ok", "message": ""}
    try:
        if prelude is not None:
            exec(prelude, namespace)
        exec(code, namespace)
        if kind == "call":
            value = resolve(namespace, test["fn_name"])(*test["args"])
            try:
                encoded = json.dumps(value, allow_nan=True)
            except (TypeError, ValueError, RecursionError):
                raise TypeError(f"the function returned a {type(value).__name__}, which is "
                                "not JSON data (lists, dicts, strings, numbers, booleans, "
                                "None)") from None
            if len(encoded) > output_bytes // 2:
                raise ValueError(f"the returned value is too large ({len(encoded)} bytes as JSON)")
            record["value"] = value
        elif kind == "assert":
            candidate = resolve(namespace, test["entry_point"])
            # The check sees the prelude's helpers (HumanEval's poly), not the program's
            # versions of them, builtins as they were before the program ran, and the
            # candidate under its own name too (HumanEval/33's check calls it by name).
            checks = {"__name__": "check", "__builtins__": PRISTINE_BUILTINS,
                      "_sandbox_report": reporter}
            if prelude is not None:
                exec(prelude, checks)
            checks[test["entry_point"]] = candidate
            exec(compile(test["source"], "<test>", "exec"), checks)
            checks["check"](candidate)
            record["status"] = "passed"
    except SystemExit as exit_:
        if kind != "stdio":
            record = {"status": "error", "message": "the program exited (SystemExit) before the "
                      "test finished"}
        elif exit_.code not in (None, 0):
            record = {"status": "error",
                      "message": f"the program exited with status {exit_.code!r}"}
    except AssertionError as error:
        namespace.clear()
        message = describe(error)
        if kind == "assert" and message == "AssertionError":  # the check's own bare assert
            message = "the check failed"
        record = {"status": "failed" if kind == "assert" else "error", "message": message,
                  "got": reporter.got, "want": reporter.want}
    except MemoryError:
        namespace.clear()  # free what the program holds before formatting anything
        record = {"status": "error",
                  "message": f"MemoryError: the memory limit is {job['memory_bytes'] >> 20} MiB"}
    except BaseException as error:
        namespace.clear()
        record = {"status": "error", "message": describe(error)}
    try:
        sys.stdout.flush()
    except OSError as error:
        if record["status"] in ("ok", "passed"):
            record = {"status": "error", "message": f"writing the output failed: {error}"}
    return record


def child(job, test, files, nonce, code, prelude):
    """The forked child: never returns. A passed check is reported by writing ``nonce``
    with functions bound before the program runs (so patching ``json`` or ``os`` from the
    program cannot forge it)."""
    status, write, dumps, passed = 70, os.write, json.dumps, f"{nonce} passed".encode()
    try:
        for fd, f in enumerate(files):
            os.dup2(f.fileno(), fd)
        os.closerange(RESULT_FD + 1, 1 << 16)
        if not job["pid_namespace"]:
            os.setpgid(0, 0)  # the runner kills this group after the test
        cpu = job["cpu_s"]
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        # One byte over the limit, so that reaching past it is seen.
        fsize = job["output_bytes"] + 1
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over-long writes fail instead of killing
        sys.stdin = sys.__stdin__ = open(0, "r", encoding="utf-8", closefd=False)
        sys.stdout = sys.__stdout__ = open(1, "w", encoding="utf-8", closefd=False)
        sys.stderr = sys.__stderr__ = open(2, "w", encoding="utf-8", closefd=False, buffering=1)
        sys.argv = ["solution.py"]
        if job["guard"]:
            install_guard(os.getcwd())
        record = run_test(job, test, code, prelude, job["output_bytes"])
        write(RESULT_FD, passed if record["status"] == "passed" else
              dumps(record, allow_nan=True).encode())
        status = 0
    finally:
        os._exit(status)


def wait_for(pid, deadline):
    """Wait for the child until ``deadline``: ``(wait status, CPU seconds)``, or None if it is
    still running. Reaps every other child too (as PID 1 of a namespace the runner inherits
    orphans)."""
    pause = 0.0005
    while True:
        try:
            done, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return None
        if done == pid:
            return status, usage.ru_utime + usage.ru_stime
        if done == 0:
            if time.monotonic() >= deadline:
                return None
            time.sleep(pause)
            pause = min(pause * 2, 0.01)


def kill_leftovers(job, pid):
    """Kill the test's process and anything it started."""
    if job["pid_namespace"] and os.getpid() == 1:
        try:  # as init of our own namespace, -1 means every other process in it
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break
    else:
        for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
            try:
                kill()
            except (ProcessLookupError, PermissionError):
                pass
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def read_file(f, limit):
    f.seek(0)
    return f.read(limit + 1)


def exit_outcome(job, waited):
    """``(status, message)`` of a child that left no outcome record."""
    if waited is None:
        return "timeout", f"timed out after {job['timeout_s']:g} s (wall clock)"
    status, cpu_s = waited
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s >= job["cpu_s"]):
            return "timeout", f"the CPU time limit ({job['cpu_s']} s) was exceeded"
        return "error", f"the program was killed by signal {signal.Signals(sig).name}"
    return "error", f"the program exited with status {os.WEXITSTATUS(status)}"


def run_one(job, index, test, code, prelude, deadline):
    """Fork, run and judge the child's run of one test: the record sent to the caller."""
    limit = job["output_bytes"]
    files = [tempfile.TemporaryFile(dir=".") for _ in range(4)]  # stdin, stdout, stderr, result
    try:
        if test["kind"] == "stdio":
            files[0].write(test["input"].encode("utf-8", "surrogatepass"))
            files[0].seek(0)
        nonce = os.urandom(16).hex()
        sys.stdout.flush()  # a forked child must not inherit unwritten runner output
        try:
            pid = os.fork()
        except OSError as error:
            return {"i": index, "stdout": "", "status": "error",
                    "message": f"the sandbox could not start the test's process: {error}"}
        if pid == 0:
            child(job, test, files, nonce, code, prelude)
        if not job["pid_namespace"]:
            try:
                os.setpgid(pid, pid)
            except OSError:  # the child already did, or already exited
                pass
        waited = wait_for(pid, min(time.monotonic() + job["timeout_s"], deadline))
        timed_out = waited is None
        kill_leftovers(job, pid)
        stdout = read_file(files[1], limit)
        raw = read_file(files[3], limit)
    finally:
        for f in files:
            f.close()
    record = {"i": index, "stdout": stdout[:limit].decode("utf-8", "replace")}
    outcome = read_outcome(raw, nonce)
    if len(stdout) > limit:
        record.update(status="error", message=f"the output limit ({limit} bytes) was exceeded")
    elif outcome is not None and not timed_out:
        record.update(outcome)
    elif not timed_out and os.WIFEXITED(waited[0]) and os.WEXITSTATUS(waited[0]) == 0:
        if test["kind"] == "stdio":  # the program ended itself with os._exit(0)
            record.update(status="ok", message="")
        else:
            record.update(status="error", message="the program ended before the test finished")
    else:
        record["status"], record["message"] = exit_outcome(job, waited)
    return record


def read_outcome(raw, nonce):
    """The child's outcome record: ``{"status": "passed"}`` only from the nonce; a record
    claiming ``passed`` otherwise (written by the program) is ignored."""
    if raw == f"{nonce} passed".encode():
        return {"status": "passed", "message": ""}
    try:
        outcome = json.loads(raw) if raw else None
    except ValueError:
        return None
    if not isinstance(outcome, dict) or outcome.get("status") not in ("ok", "failed", "error"):
        return None
    return outcome


def set_limits(job):
    resource.setrlimit(resource.RLIMIT_AS, (job["memory_bytes"], job["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))


def emit(record):
    sys.stdout.write(json.dumps(record, allow_nan=True) + "\n")
    sys.stdout.flush()


def main():
    job = json.loads(sys.stdin.buffer.read())
    deadline = time.monotonic() + job["total_timeout_s"]
    set_limits(job)
    try:
        prelude = compile(job["prelude"], PRELUDE, "exec") if job["prelude"] else None
        code = compile(job["program"], SUBMISSION, "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError) as error:
        message = describe(error)
        if isinstance(error, SyntaxError) and error.lineno:
            message = clip(f"SyntaxError: {error.msg}") + f" (line {error.lineno})"
        emit({"compile_error": message})
        return
    for index, test in enumerate(job["tests"]):
        if time.monotonic() >= deadline:
            break  # the caller reports the tests that were not run
        emit(run_one(job, index, test, code, prelude, deadline))


if __name__ == "__main__":
    main()
