"""The boundary around model-written code: a bubblewrap sandbox, a uid of its own, seccomp.

:func:`sandbox_command` is the command line that starts the runner (``_harness.py``) in
``strict`` isolation, the default of :func:`envs.code.sandbox.run_tests`. Each layer and what
it stops (the threat model is in ``envs/code/SANDBOX.md``):

* **bubblewrap** (``bwrap``, Debian's ``bubblewrap``) makes new mount, PID, network, IPC, UTS
  and cgroup namespaces. The root file system is an empty tmpfs holding, read-only, ``/usr``,
  the Python installation (its ``site-packages`` hidden: the standard library only), and the
  runner's three scripts; ``/work`` is a size-limited tmpfs, the only writable place, gone
  when the run ends. The project, the data, the tests' expected outputs, ``/etc``, ``/home``,
  ``/root`` and the host's ``/proc`` are not there. The network namespace has only a loopback
  of its own; ``--die-with-parent`` and the PID namespace end every process of the run with it.
* **uids**: the runner starts as root of the sandbox with only ``CAP_SETUID``,
  ``CAP_SETGID`` and ``CAP_KILL``; each candidate process switches to a fresh uid (random
  per run, in no group, owning nothing on the host) before it runs a line of the program, so
  it cannot read the runner's or the judge's memory or descriptors through ``/proc``, signal
  them, or keep any capability. ``RLIMIT_NPROC`` on that uid bounds its processes.
* **seccomp** (libseccomp through ``pyseccomp``, loaded by bwrap before the runner starts):
  ``ptrace``, ``process_vm_*``, mounting, namespace creation (``unshare``, ``setns``,
  ``clone`` with namespace flags), ``bpf``, ``perf_event_open``, ``io_uring``, ``keyctl``,
  ``userfaultfd``, kernel modules, ``mknod`` and sockets other than ``AF_UNIX`` fail with
  ``EPERM``; a foreign system-call ABI (x32, i386 on x86-64) kills the process.

Where any of these is missing (no ``bwrap``, not root, no libseccomp, a kernel or container
that refuses the namespaces), :func:`resolve_isolation` refuses with
:class:`SandboxUnavailable` naming what is missing. The only other mode,
``"unsafe-no-isolation"``, must be asked for by name: the program then runs as the caller's
user on the host, behind resource limits and a Python audit hook that an attacker can switch off.
"""

from __future__ import annotations

import errno
import functools
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

STRICT = "strict"
UNSAFE = "unsafe-no-isolation"
ISOLATIONS = (STRICT, UNSAFE)
HARNESS_DIR = Path(__file__).parent
SCRIPTS = ("_harness.py", "_judge.py", "_plain.py")
INSIDE_SCRIPTS = "/sandbox"  # where the scripts are mounted
WORK = "/work"
# Candidate uids are drawn per run from a range no distribution hands out to users.
UID_RANGE = (0x4000_0000, 0x7FFF_0000)
# Denied with EPERM by the seccomp filter (names libseccomp knows; absent ones are skipped).
DENIED_SYSCALLS = (
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "unshare",
    "setns",
    "bpf",
    "perf_event_open",
    "keyctl",
    "add_key",
    "request_key",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "acct",
    "swapon",
    "swapoff",
    "reboot",
    "syslog",
    "quotactl",
    "mknod",
    "mknodat",
    "open_by_handle_at",
    "name_to_handle_at",
    "fanotify_init",
    "lookup_dcookie",
    "iopl",
    "ioperm",
    "vhangup",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsmount",
    "fsconfig",
    "fspick",
    "mount_setattr",
)
# clone(2) flags that make namespaces.
NAMESPACE_FLAGS = (
    0x00020000
    | 0x02000000
    | 0x04000000
    | 0x08000000
    | 0x10000000
    | 0x20000000
    | 0x40000000
    | 0x00000080
)
AF_UNIX = 1


class SandboxUnavailable(RuntimeError):
    """Strict isolation is not possible on this machine (the message says why and what to do)."""


def resolve_isolation(isolation: str | None) -> str:
    """The isolation to run with: ``None`` and ``"strict"`` need every layer of this module
    (else :class:`SandboxUnavailable`); ``"unsafe-no-isolation"`` is taken as asked."""
    if isolation is None or isolation == STRICT:
        problems = strict_problems()
        if problems:
            raise SandboxUnavailable(
                "the code sandbox cannot isolate model-written code here: "
                + "; ".join(problems)
                + f". Fix that, or pass isolation={UNSAFE!r} (CodeEnvConfig.isolation; "
                "task.options.isolation in a config) to run programs as your own user on this "
                "host, behind limits and a Python audit hook that the program can switch off"
            )
        return STRICT
    if isolation == UNSAFE:
        return UNSAFE
    raise ValueError(f"isolation must be one of {ISOLATIONS}, got {isolation!r}")


@functools.cache
def strict_problems() -> tuple[str, ...]:
    """What strict isolation lacks on this machine (empty when it works); probed once."""
    problems = []
    if shutil.which("bwrap") is None:
        problems.append("bubblewrap is not installed (Debian: apt-get install bubblewrap)")
    if os.geteuid() != 0:
        problems.append("the process is not root, so programs cannot run as a uid of their own")
    try:
        seccomp_program()
    except Exception as error:  # pyseccomp missing, libseccomp missing or too old
        problems.append(
            f"no seccomp filter ({type(error).__name__}: {error}; "
            "pip install pyseccomp, and libseccomp2 from the system)"
        )
    if problems:
        return tuple(problems)
    fd = seccomp_fd()
    try:
        command = sandbox_command(seccomp=fd, work_bytes=1 << 20) + ["-c", "pass"]
        done = subprocess.run(command, capture_output=True, timeout=60, pass_fds=(fd,), cwd="/")
    except (OSError, subprocess.SubprocessError) as error:
        return (f"bwrap could not start ({type(error).__name__}: {error})",)
    finally:
        os.close(fd)
    if done.returncode != 0:
        detail = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
        return (
            f"bwrap cannot make a sandbox here (exit status {done.returncode}: {detail[0][:200]})",
        )
    return ()


@functools.cache
def seccomp_program() -> bytes:
    """The seccomp BPF program (bytes), built with libseccomp's bindings."""
    import pyseccomp as seccomp

    deny = seccomp.ERRNO(errno.EPERM)
    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    for name in DENIED_SYSCALLS:
        try:
            rules.add_rule(deny, name)
        except (RuntimeError, OSError, ValueError):  # not a system call of this architecture
            pass
    for flag in _bits(NAMESPACE_FLAGS):
        rules.add_rule(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    # clone3 passes its flags in memory, where a filter cannot look: ENOSYS makes the C
    # library fall back to clone, which is filtered.
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    rules.add_rule(deny, "socket", seccomp.Arg(0, seccomp.NE, AF_UNIX))
    rules.add_rule(deny, "socketpair", seccomp.Arg(0, seccomp.NE, AF_UNIX))
    with os.fdopen(os.memfd_create("agentrl-seccomp-build", 0), "w+b") as sink:
        rules.export_bpf(sink)
        sink.seek(0)
        return sink.read()


def _bits(mask: int) -> list[int]:
    return [1 << i for i in range(mask.bit_length()) if mask >> i & 1]


def seccomp_fd() -> int:
    """A fresh descriptor holding :func:`seccomp_program` (for ``bwrap --seccomp FD``)."""
    fd = os.memfd_create("agentrl-seccomp", 0)
    os.write(fd, seccomp_program())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def candidate_uids() -> tuple[int, int]:
    """Two fresh uids for one run: the candidate's and the judge's."""
    low, high = UID_RANGE
    uid = low + 2 * secrets.randbelow((high - low) // 2)
    return uid, uid + 1


def python_paths() -> tuple[str, str]:
    """(installation prefix, interpreter path) of the Python running this process, outside a
    virtual environment (the sandbox gets the standard library, not the project's packages)."""
    prefix = os.path.realpath(sys.base_prefix)
    real = os.path.realpath(sys.executable)
    if not real.startswith(prefix + os.sep):
        real = os.path.join(
            prefix, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}"
        )
    return prefix, real


def _mkdirs(path: str) -> list[str]:
    """bwrap options that make every parent of ``path`` a world-readable directory."""
    out, parent = [], ""
    for part in Path(path).parts[1:-1]:
        parent += "/" + part
        out += ["--perms", "0755", "--dir", parent]
    return out


def sandbox_command(*, seccomp: int, work_bytes: int) -> list[str]:
    """``bwrap ... python -S -s -B`` (append the script and its arguments): see the module
    docstring. ``seccomp``: a descriptor from :func:`seccomp_fd`, inherited by bwrap;
    ``work_bytes``: size of the writable ``/work``."""
    prefix, python = python_paths()
    command = [
        "bwrap",
        "--unshare-ipc",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--die-with-parent",
        "--new-session",
        "--hostname",
        "sandbox",
        "--ro-bind",
        "/usr",
        "/usr",
    ]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = Path("/") / name
        if path.is_symlink():
            command += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            command += ["--ro-bind", str(path), str(path)]
    if not prefix.startswith("/usr/"):
        command += [*_mkdirs(prefix + "/x"), "--ro-bind", prefix, prefix]
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for site in (
        f"{prefix}/lib/{version}/site-packages",
        f"{prefix}/local/lib/{version}/dist-packages",
        f"{prefix}/lib/python3/dist-packages",
    ):
        if os.path.isdir(site):
            command += ["--tmpfs", site]  # the standard library only
    command += ["--perms", "0755", "--dir", INSIDE_SCRIPTS]
    for script in SCRIPTS:
        command += ["--ro-bind", str(HARNESS_DIR / script), f"{INSIDE_SCRIPTS}/{script}"]
    command += [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--perms",
        "1777",
        "--size",
        str(int(work_bytes)),
        "--tmpfs",
        WORK,
        "--chdir",
        WORK,
        "--clearenv",
        "--setenv",
        "PATH",
        "/usr/bin:/bin",
        "--setenv",
        "HOME",
        WORK,
        "--setenv",
        "TMPDIR",
        WORK,
        "--setenv",
        "LANG",
        "C.UTF-8",
        "--setenv",
        "LC_ALL",
        "C.UTF-8",
        "--setenv",
        "PYTHONHASHSEED",
        "0",
        "--setenv",
        "PYTHONIOENCODING",
        "utf-8",
        "--setenv",
        "OMP_NUM_THREADS",
        "1",
        "--cap-drop",
        "ALL",
        "--cap-add",
        "CAP_SETUID",
        "--cap-add",
        "CAP_SETGID",
        "--cap-add",
        "CAP_KILL",
        "--seccomp",
        str(seccomp),
        python,
        "-S",
        "-s",
        "-B",
    ]
    return command
