"""Several ``agentrl-jax`` commands one after another in each process of a local cluster
(tests/multihost.py appends the cluster flags to the arguments):
``python multihost_cli_sequence.py reproduce frozenlake ... ++ reproduce frozenlake ...``.

The first command joins the cluster (the appended flags are moved to it); the later ones run in
the cluster it joined (a process joins once), so the commands share one start of each process.
After each command the process prints ``command <i> of <n>: exit <code>`` and goes on to the
next whatever the code; it exits with the first nonzero code (0 when all succeeded). A
multi-process command that fails ends its process at once (``agentrl_jax.distributed.fail_fast``),
so the later commands then do not run and print nothing.
"""

from __future__ import annotations

import re
import sys
import traceback

SEPARATOR = "++"
CLUSTER_FLAGS = ("--coordinator", "--num-processes", "--process-id", "--cluster-auto")
STATUS = re.compile(r"^command (\d+) of (\d+): exit (-?\d+)$", re.MULTILINE)


def split(argv: list[str]) -> list[list[str]]:
    """The commands of ``argv`` (separated by ``++``), the trailing cluster flags moved to the
    first one."""
    commands: list[list[str]] = [[]]
    for arg in argv:
        if arg == SEPARATOR:
            commands.append([])
        else:
            commands[-1].append(arg)
    last = commands[-1]
    at = next((i for i, a in enumerate(last) if a in CLUSTER_FLAGS), len(last))
    commands[-1], cluster = last[:at], last[at:]
    commands[0] += cluster
    return commands


def statuses(output: str) -> dict[int, int]:
    """``{command number (1-based): exit code}`` of the commands a process's output reports."""
    return {int(m.group(1)): int(m.group(3)) for m in STATUS.finditer(output)}


def main(argv: list[str]) -> int:
    from agentrl_jax.cli import app

    commands = split(argv)
    codes = []
    for i, args in enumerate(commands, 1):
        try:
            app(args, prog_name="agentrl-jax")
            code = 0
        except SystemExit as done:  # click ends a command this way, 0 included
            code = done.code if isinstance(done.code, int) else int(done.code is not None)
        except Exception:  # one process: the error is this command's, the next still runs
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        print(f"\ncommand {i} of {len(commands)}: exit {code}", flush=True)  # on a line of its own
        codes.append(code)
    return next((c for c in codes if c), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
