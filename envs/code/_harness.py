"""The runner inside the sandbox (a standalone script: standard library and ``_plain`` only).

:mod:`envs.code.sandbox` starts ``python -S -s -B _harness.py`` (inside bubblewrap in strict
isolation, see :mod:`envs.code.isolation`), writes one JSON job to its stdin and reads one
JSON record per test from its stdout. The job holds what the candidate may see and nothing
else: the program, the prelude, each test's input (stdin text, or the function and its
arguments), never an expected output and never a check's source.

Per test the runner forks a candidate process that, before running a line of the program,
points stdin/stdout/stderr at unnamed in-memory files, sets its limits (CPU seconds, address
space, file size, open files and, isolated, processes), drops to the run's candidate uid and
installs the audit-hook guard (friendly messages for ordinary misbehaviour; not a boundary).

* stdio test: the program runs as ``__main__``; the runner returns what it printed.
* call test: the candidate writes ``{"status", "message", "value"}`` (JSON) on fd 3.
* assert test: the check runs in the *judge* (``_judge.py``), a separate interpreter started
  fresh under its own uid that reads the checks from a descriptor the runner never reads.
  Each ``candidate(...)`` call in a check crosses to the candidate process as plain data
  (:mod:`_plain`) relayed by the runner, and the value comes back the same way; the judge
  compares and sends its verdict. The candidate can answer calls, nothing else.

After each test every process of the candidate uid is killed. Job fields: ``program``,
``prelude``, ``tests``, ``timeout_s``, ``cpu_s``, ``total_timeout_s``, ``memory_bytes``,
``output_bytes``, ``processes``, ``isolated``, ``uid``, ``judge_uid``, ``judge_fd``,
``guard``, ``python``.
"""

import builtins
import fcntl
import json
import os
import resource
import select
import signal
import sys
import time
import types

import _plain

SUBMISSION = "<submission>"
PRELUDE = "<prelude>"
RESULT_FD, REQUEST_FD = 3, 4
CANDIDATE_FILES = 64  # RLIMIT_NOFILE of a candidate process
MAX_MESSAGE = 500
JUDGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_judge.py")

# Audit events that programs may never raise (prefixes end with ".").
BLOCKED_EVENTS = frozenset(
    {
        "os.fork",
        "os.forkpty",
        "os.exec",
        "os.spawn",
        "os.posix_spawn",
        "os.system",
        "os.kill",
        "os.killpg",
        "signal.pthread_kill",
        "subprocess.Popen",
        "pty.spawn",
        "resource.setrlimit",
        "resource.prlimit",
        "os.setxattr",
        "os.removexattr",
    }
)
BLOCKED_PREFIXES = ("socket.", "ctypes.")
BLOCKED_MODULES = frozenset({"ctypes", "_ctypes", "_posixsubprocess", "_cffi_backend", "cffi"})
PATH_EVENTS = {
    "os.remove": ((0, 1),),
    "os.rmdir": ((0, 1),),
    "os.mkdir": ((0, 2),),
    "os.chmod": ((0, 2),),
    "os.chown": ((0, 3),),
    "os.truncate": ((0, None),),
    "os.utime": ((0, 3),),
    "os.chflags": ((0, None),),
    "os.lchflags": ((0, None),),
    "os.symlink": ((1, 2),),
    "os.link": ((0, 2), (1, 3)),
    "os.rename": ((0, 2), (1, 3)),
}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def install_guard(root):
    """Reject, in this process, writes outside ``root``, sockets, new processes, signals,
    limit changes and native-code modules, with a clear message. A courtesy for ordinary
    programs, not a boundary: the isolation layers are (see isolation.py)."""
    realpath, fsdecode, join, isabs, sep = (
        os.path.realpath,
        os.fsdecode,
        os.path.join,
        os.path.isabs,
        os.sep,
    )
    root = realpath(root)

    def inside(path, dir_fd=None, root_too=False):
        if isinstance(path, int):
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
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & WRITE_FLAGS
            )
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

    for name in list(sys.modules):
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
    except BaseException:  # a user exception whose __str__ fails
        detail = ""
    if detail:
        text += f": {detail}"
    return clip(text) + (f" (line {line})" if line is not None else "")


def resolve(namespace, name):
    """The function ``name``: a global, or a method of a ``Solution`` class (LeetCode style)."""
    if callable(namespace.get(name)):
        return namespace[name]
    solution = namespace.get("Solution")
    if isinstance(solution, type) and hasattr(solution, name):
        return getattr(solution(), name)
    raise NameError(f"the program does not define a function {name!r}")


# ----------------------------------------------------------------------------- candidate side


def load(kind, code, prelude):
    """Run the prelude and the program in a module of their own; its namespace."""
    module = types.ModuleType("__main__" if kind == "stdio" else "solution")
    sys.modules["__main__"] = sys.modules[module.__name__] = module
    namespace = module.__dict__
    namespace["__builtins__"] = builtins
    if prelude is not None:
        exec(prelude, namespace)
    exec(code, namespace)
    return namespace


def run_test(job, test, code, prelude):
    """In the candidate process: run a stdio or call test; returns its record."""
    record = {"status": "ok", "message": ""}
    try:
        namespace = load(test["kind"], code, prelude)
        if test["kind"] == "call":
            value = resolve(namespace, test["fn_name"])(*test["args"])
            try:
                encoded = json.dumps(value, allow_nan=True)
            except (TypeError, ValueError, RecursionError):
                raise TypeError(
                    f"the function returned a {type(value).__name__}, which is "
                    "not JSON data (lists, dicts, strings, numbers, booleans, "
                    "None)"
                ) from None
            if len(encoded) > job["output_bytes"] // 2:
                raise ValueError(f"the returned value is too large ({len(encoded)} bytes as JSON)")
            record["value"] = value
    except SystemExit as exit_:
        if test["kind"] != "stdio":
            record = {
                "status": "error",
                "message": "the program exited (SystemExit) before the test finished",
            }
        elif exit_.code not in (None, 0):
            record = {
                "status": "error",
                "message": f"the program exited with status {exit_.code!r}",
            }
    except MemoryError:
        record = {
            "status": "error",
            "message": f"MemoryError: the memory limit is {job['memory_bytes'] >> 20} MiB",
        }
    except BaseException as error:
        record = {"status": "error", "message": describe(error)}
    try:
        sys.stdout.flush()
    except BaseException as error:
        if record["status"] == "ok":
            record = {"status": "error", "message": f"writing the output failed: {error}"}
    return record


def read_line(fd, limit):
    """One line from ``fd`` (without the newline), b"" at end of file."""
    chunks, size = [], 0
    while True:
        byte = os.read(fd, 1)
        if not byte or byte == b"\n":
            return b"".join(chunks)
        chunks.append(byte)
        size += 1
        if size > limit:
            raise ValueError("request too long")


def serve_calls(job, test, code, prelude):
    """In the candidate process of an assert test: answer the judge's calls, one line each."""
    limit = job["output_bytes"]
    try:
        candidate = resolve(load("assert", code, prelude), test["entry_point"])
    except BaseException as error:
        os.write(
            RESULT_FD, (json.dumps({"loaded": False, "message": describe(error)}) + "\n").encode()
        )
        return
    os.write(RESULT_FD, b'{"loaded": true}\n')
    while True:
        line = read_line(REQUEST_FD, 64 << 20)
        if not line:
            return
        try:
            args, kwargs = _plain.decode(line.decode("utf-8", "surrogatepass"))
            value = candidate(*args, **kwargs)
            try:
                reply = '{"value":' + _plain.encode(value, limit) + "}"
            except (TypeError, ValueError, RecursionError) as error:
                reply = json.dumps(
                    {"error": f"the function returned a value that cannot be checked: {error}"}
                )
        except MemoryError:
            reply = json.dumps(
                {
                    "raised": [
                        "MemoryError",
                        f"MemoryError: the memory limit is {job['memory_bytes'] >> 20} MiB",
                    ]
                }
            )
        except BaseException as error:
            reply = json.dumps({"raised": [type(error).__name__, describe(error)]})
        os.write(RESULT_FD, reply.encode("utf-8", "surrogatepass") + b"\n")


def place_fds(targets):
    """Make descriptor ``target`` a copy of ``source`` for each ``(source, target)``, whatever
    their numbers (copies go through free high numbers first), and close every other one."""
    high = [fcntl.fcntl(source, fcntl.F_DUPFD, 128) for source, _ in targets]
    for copy, (_, target) in zip(high, targets):
        os.dup2(copy, target)
    os.closerange(max(target for _, target in targets) + 1, 1 << 16)


def drop_to(uid):
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def candidate(job, test, files, code, prelude, pipes):
    """The forked candidate process: never returns."""
    status = 70
    try:
        place_fds([*zip(files, (0, 1, 2)), *zip(pipes, (RESULT_FD, REQUEST_FD))])
        if not job["isolated"]:
            os.setpgid(0, 0)  # the runner kills this group after the test
        cpu = job["cpu_s"]
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        fsize = job["output_bytes"] + 1  # one byte over, so that reaching past it is seen
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_AS, (job["memory_bytes"], job["memory_bytes"]))
        # Few descriptors: each in-memory file (memfd) may hold up to the file-size limit.
        resource.setrlimit(resource.RLIMIT_NOFILE, (CANDIDATE_FILES, CANDIDATE_FILES))
        if job["isolated"]:
            resource.setrlimit(resource.RLIMIT_NPROC, (job["processes"], job["processes"]))
            drop_to(job["uid"])
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over-long writes fail instead of killing
        sys.stdin = sys.__stdin__ = open(0, "r", encoding="utf-8", closefd=False)
        sys.stdout = sys.__stdout__ = open(1, "w", encoding="utf-8", closefd=False)
        sys.stderr = sys.__stderr__ = open(2, "w", encoding="utf-8", closefd=False, buffering=1)
        sys.argv = ["solution.py"]
        if job["guard"]:
            install_guard(os.getcwd())
        if test["kind"] == "assert":
            serve_calls(job, test, code, prelude)
        else:
            record = run_test(job, test, code, prelude)
            os.write(RESULT_FD, json.dumps(record, allow_nan=True).encode("utf-8", "surrogatepass"))
        status = 0
    finally:
        os._exit(status)


# ----------------------------------------------------------------------------- runner side


class Channel:
    """Lines from a descriptor, read with a deadline and a size bound."""

    def __init__(self, fd, limit):
        self.fd, self.limit, self.buffer, self.closed = fd, limit, b"", False

    def line(self, deadline):
        """The next line; None at end of file or when the deadline passes ("eof"/"timeout"
        in ``self.why``), or when a line exceeds the bound ("long")."""
        while True:
            cut = self.buffer.find(b"\n")
            if cut >= 0:
                line, self.buffer = self.buffer[:cut], self.buffer[cut + 1 :]
                return line
            if len(self.buffer) > self.limit:
                self.why = "long"
                return None
            if self.closed or not self.fill(deadline):
                self.why = "eof" if self.closed else "timeout"
                return None

    def fill(self, deadline):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        ready, _, _ = select.select([self.fd], [], [], left)
        if not ready:
            return False
        data = os.read(self.fd, 1 << 16)
        if not data:
            self.closed = True
        self.buffer += data
        return True


def send(fd, text):
    """Write a whole line; False when the reader is gone."""
    data = text.encode("utf-8", "surrogatepass") + b"\n"
    try:
        while data:
            data = data[os.write(fd, data) :]
    except (BrokenPipeError, OSError):
        return False
    return True


class Judge:
    """The judge process (``_judge.py``) and the lines to and from it."""

    def __init__(self, job):
        self.job, self.pid = job, None

    def start(self):
        from_runner, to_judge = os.pipe()
        from_judge, to_runner = os.pipe()
        pid = os.fork()
        if pid == 0:
            status = 70
            try:
                null = os.open(os.devnull, os.O_RDWR)
                # stderr stays the runner's: the judge's own errors are seen.
                place_fds(
                    [
                        (null, 0),
                        (null, 1),
                        (2, 2),
                        (from_runner, 3),
                        (to_runner, 4),
                        (self.job["judge_fd"], 5),
                    ]
                )
                resource.setrlimit(
                    resource.RLIMIT_AS, (max(self.job["memory_bytes"], 1 << 30),) * 2
                )
                if self.job["isolated"]:
                    resource.setrlimit(resource.RLIMIT_NPROC, (1, 1))
                    drop_to(self.job["judge_uid"])
                else:
                    os.setpgid(0, 0)
                os.execv(self.job["python"], [self.job["python"], "-S", "-s", "-B", JUDGE])
            except BaseException as error:
                os.write(2, f"the sandbox could not start the judge: {error!r}\n".encode())
            finally:
                os._exit(status)
        os.close(from_runner)
        os.close(to_runner)
        self.pid, self.to, self.lines = pid, to_judge, Channel(from_judge, 256 << 20)

    def stop(self):
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
            os.close(self.to)
            os.close(self.lines.fd)
            self.pid = None

    def check(self, index, replies, requests, deadline):
        """Run test ``index``'s check against the candidate behind ``replies``/``requests``:
        ``(verdict record or None, why the candidate stopped answering or None)``."""
        if self.pid is None:
            self.start()
        candidate_gone = None
        loaded = replies.line(deadline)
        try:
            loaded = json.loads(loaded) if loaded is not None else None
        except ValueError:
            loaded = None
        if not isinstance(loaded, dict) or loaded.get("loaded") is not True:
            why = getattr(replies, "why", "eof") if loaded is None else "eof"
            message = loaded.get("message") if isinstance(loaded, dict) else None
            return None, (why, message if isinstance(message, str) else None)
        if not send(self.to, json.dumps({"run": index})):
            self.stop()
            return None, None
        while True:
            line = self.lines.line(deadline)
            if line is None:  # the check ran out of time, or the judge died
                self.stop()
                return None, candidate_gone
            try:
                message = json.loads(line)
            except ValueError:
                self.stop()
                return None, candidate_gone
            if "verdict" in message:
                if message.get("i") != index:
                    continue
                return message["verdict"], candidate_gone
            if candidate_gone is None and send(requests, message.get("call", "")):
                reply = replies.line(deadline)
                if reply is not None:
                    answer = {"reply": reply.decode("utf-8", "replace")}
                else:
                    candidate_gone = (replies.why, None)
            elif candidate_gone is None:
                candidate_gone = ("eof", None)
            if candidate_gone is not None:
                answer = {"gone": candidate_gone[0]}
            if not send(self.to, json.dumps(answer)):
                self.stop()
                return None, candidate_gone


def wait_for(pid, deadline):
    """Wait for ``pid`` until ``deadline``: ``(wait status, CPU seconds)``, or None if it is
    still running. Reaps every other child too (orphans may be reparented here)."""
    pause = 0.0005
    while True:
        try:
            done, status, usage = os.wait4(pid, os.WNOHANG)
        except ChildProcessError:
            return None
        if done == pid:
            return status, usage.ru_utime + usage.ru_stime
        if time.monotonic() >= deadline:
            return None
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


def collect(pid, channel, deadline):
    """Read ``channel`` (bounded) while waiting for ``pid`` to end: its ``(wait status, CPU
    seconds)``, or None at the deadline."""
    while True:
        if len(channel.buffer) <= channel.limit and not channel.closed:
            channel.fill(min(deadline, time.monotonic() + 0.01))
        waited = wait_for(pid, 0)
        if waited is not None:
            while (
                len(channel.buffer) <= channel.limit
                and not channel.closed
                and channel.fill(time.monotonic() + 0.001)
            ):
                pass
            return waited
        if time.monotonic() >= deadline:
            return None


def kill_candidate(job, pid):
    """Kill the test's process and everything it started."""
    if job["isolated"]:
        # A process of the candidate uid: kill(-1) reaches every process of that uid at
        # once (it also "succeeds" on processes it may not signal, so survivors are counted
        # through this namespace's /proc until there are none).
        killer = os.fork()
        if killer == 0:
            try:
                drop_to(job["uid"])
                for _ in range(2000):
                    os.kill(-1, signal.SIGKILL)
                    if not living(job["uid"]):
                        break
                    time.sleep(0.001)
            finally:
                os._exit(0)
        os.waitpid(killer, 0)
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
    while True:  # orphans reparented to the runner
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break


def living(uid):
    """Whether a process other than this one, of ``uid`` and not a zombie, is alive."""
    me = str(os.getpid())
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or entry == me:
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                status = f.read()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("Uid", "").split()[:1] == [str(uid)] and fields.get("State", "").split()[
            :1
        ] != ["Z"]:
            return True
    return False


def exit_outcome(job, waited):
    """``(status, message)`` of a candidate that left no record."""
    if waited is None:
        return "timeout", f"timed out after {job['timeout_s']:g} s (wall clock)"
    status, cpu_s = waited
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s >= job["cpu_s"]):
            return "timeout", f"the CPU time limit ({job['cpu_s']} s) was exceeded"
        return "error", f"the program was killed by signal {signal.Signals(sig).name}"
    return "error", f"the program exited with status {os.WEXITSTATUS(status)}"


def read_file(fd, limit):
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, limit + 1)


def run_one(job, index, test, code, prelude, deadline, judge):
    """Fork, run and judge one test: the record sent to the caller."""
    limit = job["output_bytes"]
    test_deadline = min(time.monotonic() + job["timeout_s"], deadline)
    files = [os.memfd_create(name, 0) for name in ("stdin", "stdout", "stderr")]
    replies_r, replies_w = os.pipe()
    requests_r, requests_w = os.pipe()
    try:
        if test["kind"] == "stdio":
            os.write(files[0], test["input"].encode("utf-8", "surrogatepass"))
            os.lseek(files[0], 0, os.SEEK_SET)
        sys.stdout.flush()
        try:
            pid = os.fork()
        except OSError as error:
            return {
                "i": index,
                "stdout": "",
                "status": "error",
                "message": f"the sandbox could not start the test's process: {error}",
            }
        if pid == 0:
            candidate(job, test, files, code, prelude, (replies_w, requests_r))
        os.close(replies_w)
        os.close(requests_r)
        replies = Channel(replies_r, 2 * limit)
        verdict = gone = raw = None
        if test["kind"] == "assert":
            verdict, gone = judge.check(index, replies, requests_w, test_deadline)
            os.close(requests_w)
            # A candidate that stopped answering gets a moment to exit, to tell how it ended.
            waited = wait_for(
                pid,
                test_deadline
                if gone is None or gone[0] != "eof"
                else min(test_deadline, time.monotonic() + 1.0),
            )
        else:
            os.close(requests_w)
            waited = collect(pid, replies, test_deadline)
            raw = replies.buffer
        timed_out = waited is None or time.monotonic() >= test_deadline
        kill_candidate(job, pid)
        stdout = read_file(files[1], limit)
    finally:
        for fd in files + [replies_r]:
            os.close(fd)
    record = {"i": index, "stdout": stdout[:limit].decode("utf-8", "replace")}
    if len(stdout) > limit:
        record.update(status="error", message=f"the output limit ({limit} bytes) was exceeded")
    elif test["kind"] == "assert":
        record.update(assert_outcome(job, verdict, gone, waited, timed_out))
    else:
        outcome = read_outcome(raw)
        if outcome is not None and not timed_out:
            record.update(outcome)
        elif not timed_out and os.WIFEXITED(waited[0]) and os.WEXITSTATUS(waited[0]) == 0:
            if test["kind"] == "stdio":  # the program ended itself with os._exit(0)
                record.update(status="ok", message="")
            else:
                record.update(status="error", message="the program ended before the test finished")
        else:
            record["status"], record["message"] = exit_outcome(job, waited)
    return record


def assert_outcome(job, verdict, gone, waited, timed_out):
    """``{"status", "message", ...}`` of an assert test from the judge's verdict, or from how
    the candidate stopped answering (``gone``: (why, message or None))."""
    if verdict is not None and gone is None:
        return verdict
    if gone is not None and gone[1] is not None:  # the program raised while loading
        return {"status": "error", "message": gone[1]}
    if gone is not None and gone[0] == "long":
        return {"status": "error", "message": "the program's answer exceeded the output limit"}
    if gone is None and not timed_out:
        return {"status": "error", "message": "the check stopped unexpectedly"}
    if waited is not None and not (os.WIFEXITED(waited[0]) and os.WEXITSTATUS(waited[0]) == 0):
        return dict(zip(("status", "message"), exit_outcome(job, waited)))
    if timed_out:
        return dict(zip(("status", "message"), exit_outcome(job, None)))
    return {"status": "error", "message": "the program ended before the test finished"}


def read_outcome(raw):
    """The candidate's record of a stdio or call test, if well formed: only ``ok``/``error``
    (a pass is decided by the caller, never by the candidate)."""
    try:
        outcome = json.loads(raw) if raw else None
        if not isinstance(outcome, dict) or outcome.get("status") not in ("ok", "error"):
            return None
        message = outcome.get("message", "")
        clean = {
            "status": outcome["status"],
            "message": clip(message) if isinstance(message, str) else "",
        }
        if "value" in outcome:
            json.dumps(outcome["value"], allow_nan=True)  # it can be sent on (not too deep)
            clean["value"] = outcome["value"]
        return clean
    except (ValueError, RecursionError, TypeError):
        return {"status": "error", "message": "the program's result record is malformed"}


def emit(record):
    sys.stdout.write(json.dumps(record, allow_nan=True) + "\n")
    sys.stdout.flush()


def main():
    job = json.loads(sys.stdin.buffer.read())
    deadline = time.monotonic() + job["total_timeout_s"]
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    try:
        import site

        site.setquit()  # exit() and quit(), which -S leaves out
    except Exception:
        pass
    try:
        prelude = compile(job["prelude"], PRELUDE, "exec") if job["prelude"] else None
        code = compile(job["program"], SUBMISSION, "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError) as error:
        message = describe(error)
        if isinstance(error, SyntaxError) and error.lineno:
            message = clip(f"SyntaxError: {error.msg}") + f" (line {error.lineno})"
        emit({"compile_error": message})
        return
    judge = Judge(job)
    try:
        for index, test in enumerate(job["tests"]):
            if time.monotonic() >= deadline:
                break  # the caller reports the tests that were not run
            emit(run_one(job, index, test, code, prelude, deadline, judge))
    finally:
        judge.stop()


if __name__ == "__main__":
    main()
