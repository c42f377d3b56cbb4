"""The code sandbox: verdicts against hand-checked cases, limits, and containment of
programs that misbehave (writes outside, sockets, forks, unbounded memory and output), in
strict isolation (the default) and, where said, in the unsafe mode. Hostile programs that try
to escape or forge a reward are in test_sandbox_attacks.py."""

import socket

import pytest
from code_helpers import make_clean_root

from envs.code.datasets import split_check
from envs.code.sandbox import (
    AssertTest,
    CallTest,
    SandboxLimits,
    StdioTest,
    outputs_match,
    run_tests,
    values_match,
)

FAST = SandboxLimits(timeout_s=2.0, total_timeout_s=8.0, memory_mb=256, output_bytes=1 << 16)
ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
MODES = ["strict", "unsafe-no-isolation"]


@pytest.fixture
def root(tmp_path):
    """Where runs make their working directories: left empty and process-free."""
    yield from make_clean_root(tmp_path)


def run(program, tests, root, limits=FAST, **kwargs):
    return run_tests(program, tests, limits, tmp_root=root, **kwargs)


def test_stdio_verdicts(root):
    tests = [
        StdioTest("1 2\n", "3\n"),
        StdioTest("2 2\n", "5\n"),
        StdioTest("x y\n", "0\n"),
        StdioTest("10 -4", "  6  "),
    ]
    results = run(ADD, tests, root)
    assert [r.status for r in results] == ["passed", "failed", "error", "passed"]
    assert (results[1].expected, results[1].got) == ("5\n", "4\n")
    assert results[1].message == "wrong answer"
    assert results[2].message == "ValueError: invalid literal for int() with base 10: 'x' (line 1)"
    assert results[0].kind == "stdio" and results[0].test == "1 2\n"


def test_outputs_match_like_a_judge():
    assert outputs_match("3\n", "3") and outputs_match("1 2\n3  \n\n", "1 2 3")
    assert not outputs_match("3 4", "3") and not outputs_match("", "0")
    assert outputs_match("0.3333333", "0.333333333") and outputs_match("1e-7", "0.0")
    assert not outputs_match("0.3334", "0.3333")
    # Integer tokens are exact; tolerance applies only where the expected token is real.
    assert not outputs_match("1000001", "1000000") and not outputs_match("3.0", "3")
    assert not outputs_match("YES", "yes")


def test_values_match_json_data():
    assert values_match([1, [2.0000000001]], [1, [2.0]]) and values_match(3.0, 3)
    assert not values_match(True, 1) and not values_match(1, True)
    assert not values_match([1, 2], [1, 2, 3]) and not values_match({"a": 1}, {"b": 1})
    assert values_match({"a": [0.1 + 0.2]}, {"a": [0.3]}) and not values_match("1", 1)


def test_call_verdicts(root):
    program = (
        "def double(x):\n    return x * 2\n"
        "class Solution:\n    def pair(self, a, b):\n        return (a, b)\n"
        "def odd():\n    return {1, 2}\n"
        "if __name__ == '__main__':\n    input()  # not run: tests load the module\n"
    )
    tests = [
        CallTest("double", (21,), 42),
        CallTest("double", ("ab",), "abab"),
        CallTest("pair", (1, 2), [1, 2]),
        CallTest("double", (2,), [4], wrapped_expected=True),
        CallTest("double", (2,), 5),
        CallTest("missing", (), 0),
        CallTest("odd", (), [1, 2]),
    ]
    results = run(program, tests, root)
    assert [r.status for r in results] == ["passed"] * 4 + ["failed", "error", "error"]
    assert results[0].test == "double(21)" and results[4].got == "4" and results[4].expected == "5"
    assert "does not define a function 'missing'" in results[5].message
    assert "returned a set, which is not JSON" in results[6].message


def test_assert_tests_show_what_the_candidate_returned(root):
    check = (
        "def check(candidate):\n"
        "    assert True, 'not a test'\n"
        "    assert candidate(2) == 4\n"
        "    assert candidate(3) == 9, 'message'\n"
        "    for x in range(3):\n"
        "        assert candidate(x) >= 0\n"
    )
    tests = split_check(check, "square")
    assert [t.description for t in tests] == [
        "assert candidate(2) == 4",
        "assert candidate(3) == 9",
        "for x in range(3):\n    assert candidate(x) >= 0",
    ]
    results = run("def square(x):\n    return x * 2\n", tests, root)
    assert [r.status for r in results] == ["passed", "failed", "passed"]
    assert (results[1].expected, results[1].got) == ("9", "6")
    assert results[1].message == "the check failed"
    # An exception in the candidate is an error, not a failed check.
    assert run("def square(x):\n    return 1 / (x - 2)\n", tests[:1], root)[0].status == "error"


def test_exiting_early_does_not_pass_checks(root):
    tests = [AssertTest("def check(candidate):\n    assert candidate() == 1\n", "f")]
    for program in (
        "import os\nos._exit(0)\n",
        "import sys\nsys.exit(0)\n",
        "def f():\n    import os\n    os._exit(0)\n",
    ):
        [result] = run(program, tests, root)
        assert result.status == "error", program


def test_forged_passes_are_refused(root):
    check = split_check(
        "def check(candidate):\n    assert candidate(1) == 2\n    assert [candidate(1)] == [2]\n",
        "f",
    )
    always_equal = (
        "class Anything:\n    def __eq__(self, other):\n        return True\n"
        "def f(x):\n    return Anything()\n"
    )
    results = run(always_equal, check, root)
    # Only plain data crosses to the judge: the object never reaches its ==.
    assert [r.status for r in results] == ["error", "error"]
    assert "a Anything is not plain data" in results[0].message
    nested = always_equal.replace("return Anything()", "return [Anything()]")
    assert run(nested, check[:1], root)[0].status == "error"
    forged_record = (
        'import os\nos.write(3, b\'{"status": "passed", "message": ""}\')\nos._exit(0)\n'
    )
    patched_json = (
        "import json\nreal = json.dumps\n"
        "json.dumps = lambda record, **k: real(dict(record, status='passed'), **k)\n"
        "def f(x):\n    return 0\n"
    )
    for program in (forged_record, patched_json):
        assert run(program, check[:1], root)[0].status in ("error", "failed"), program
    # The check sees the prelude's helper and the builtins, not the program's versions.
    helper_check = [
        AssertTest("def check(candidate):\n    assert abs(helper(candidate())) < 1\n", "f")
    ]
    prelude = "def helper(x):\n    return x - 10\n"
    honest = run("def f():\n    return 10\n", helper_check, root, prelude=prelude)
    assert honest[0].status == "passed"
    for program in (
        "def helper(x):\n    return 0\ndef f():\n    return 99\n",
        "import builtins\nbuiltins.abs = lambda x: 0\ndef f():\n    return 99\n",
    ):
        assert run(program, helper_check, root, prelude=prelude)[0].status == "failed", program


def test_the_program_is_its_own_main_module(root):
    program = "import __main__\nx = 5\nprint(__main__.x, __name__)\n"
    [result] = run(program, [StdioTest("", "5 __main__")], root)
    assert result.status == "passed", result


def test_syntax_error_is_reported_for_every_test(root):
    results = run("print(1\n", [StdioTest("", "1")] * 2, root)
    assert [r.status for r in results] == ["error", "error"]
    assert results[0].message == "SyntaxError: '(' was never closed (line 1)"


def test_limits_are_set_in_the_test_process(root):
    program = (
        "import os, resource\n"
        "limit = resource.getrlimit\n"
        "print(limit(resource.RLIMIT_CPU), limit(resource.RLIMIT_AS), "
        "limit(resource.RLIMIT_FSIZE))\n"
        "print(os.getcwd() == os.environ['HOME'] == os.environ['TMPDIR'])\n"
    )
    [result] = run(program, [StdioTest("", "")], root)
    memory, output = 256 << 20, (1 << 16) + 1
    assert result.got == f"(2, 3) ({memory}, {memory}) ({output}, {output})\nTrue\n"


def test_hanging_programs_time_out_and_the_run_budget_holds(root):
    limits = SandboxLimits(timeout_s=1.0, total_timeout_s=2.0, memory_mb=256)
    results = run("while True:\n    pass\n", [StdioTest("", "")] * 3, root, limits)
    assert [r.status for r in results] == ["timeout"] * 3
    # A busy loop meets the 1 s CPU limit or the 1 s wall-clock limit first, by scheduling.
    assert results[0].message in (
        "timed out after 1 s (wall clock)",
        "the CPU time limit (1 s) was exceeded",
    )
    assert results[2].message.startswith("not run: the run's total time limit (2 s)")
    [sleeper] = run("import time\ntime.sleep(30)\n", [StdioTest("", "")], root, limits)
    assert sleeper.status == "timeout"


# Each misbehaviour: (program, expected status, a part of the message). With the guard on.
MISBEHAVIOURS = {
    "write_outside": (
        "open({outside!r}, 'w').write('x')\n",
        "error",
        "PermissionError: sandbox: writing",
    ),
    "remove_outside": ("import os\nos.remove({victim!r})\n", "error", "os.remove"),
    "remove_workdir": ("import os\nos.rmdir(os.getcwd())\n", "error", "os.rmdir on"),
    "socket": (
        "import socket\nsocket.socket().connect(('127.0.0.1', {port}))\n",
        "error",
        "socket.__new__ is not allowed",
    ),
    "fork_loop": (
        "import os\nfailed = 0\nfor _ in range(300):\n    try:\n        os.fork()\n"
        "    except OSError:\n        failed += 1\nprint(failed)\n",
        "failed",
        "wrong answer",
    ),
    "subprocess": ("import subprocess\nsubprocess.run(['true'])\n", "error", "not allowed"),
    "ctypes": ("import ctypes\n", "error", "importing ctypes is not allowed"),
    "memory": (
        "blocks = []\nwhile True:\n    blocks.append(bytearray(10 ** 7))\n",
        "error",
        "MemoryError: the memory limit is 256 MiB",
    ),
    "output_flood": (
        "while True:\n    print('x' * 1000)\n",
        "error",
        "the output limit (65536 bytes) was exceeded",
    ),
    "signal_init": ("import os\nos.kill(1, 9)\n", "error", "os.kill is not allowed"),
    "raise_limits": (
        "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (99, 99))\n",
        "error",
        "resource.setrlimit is not allowed",
    ),
}


@pytest.mark.parametrize("name", sorted(MISBEHAVIOURS))
def test_misbehaving_programs_are_stopped_and_reported(name, root, tmp_path):
    outside = tmp_path / "outside.txt"
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.2)
        template, status, message = MISBEHAVIOURS[name]
        program = template.format(
            outside=str(outside), victim=str(victim), port=server.getsockname()[1]
        )
        results = run(program, [StdioTest("", "")], root)
        with pytest.raises(socket.timeout):
            server.accept()
    assert results[0].status == status, results[0]
    assert message in results[0].message, results[0].message
    assert not outside.exists() and victim.read_text() == "keep me"
    if name == "fork_loop":  # every one of the 300 forks was refused
        assert results[0].got == "300\n"


def test_one_bad_test_does_not_sink_the_others(root):
    program = (
        "n = int(input())\nif n == 1:\n    hog = []\n    while True:\n"
        "        hog.append(bytearray(10 ** 7))\nif n == 2:\n    while True:\n        pass\n"
        "print(n)\n"
    )
    results = run(
        program,
        [StdioTest(f"{n}\n", f"{n}\n") for n in (1, 2, 3)],
        root,
        SandboxLimits(timeout_s=1.0, total_timeout_s=5.0, memory_mb=256),
    )
    assert [r.status for r in results] == ["error", "timeout", "passed"]


def test_writing_inside_the_working_directory_is_allowed(root):
    program = (
        "import os, tempfile\nopen('a.txt', 'w').write('hi')\nos.mkdir('d')\n"
        "os.rename('a.txt', 'd/b.txt')\nwith tempfile.TemporaryFile() as f:\n"
        "    f.write(b'x')\nprint(open('d/b.txt').read())\n"
    )
    [result] = run(program, [StdioTest("", "hi")], root)
    assert result.status == "passed", result


@pytest.mark.parametrize("isolation", MODES)
def test_fork_bomb_without_the_guard_leaves_no_process(isolation, root):
    """The OS layers alone: sleeping children and a spinning parent are all killed; strict
    isolation also bounds how many there are (SandboxLimits.processes)."""
    program = (
        "import os, time\nforked = 0\nfor _ in range(150):\n    try:\n"
        "        if os.fork() == 0:\n            time.sleep(60)\n            os._exit(0)\n"
        "        forked += 1\n    except OSError:\n        pass\n"
        "print(forked, flush=True)\nwhile True:\n    pass\n"
    )
    limits = SandboxLimits(timeout_s=1.5, total_timeout_s=4.0, memory_mb=256, processes=20)
    results = run(
        program, [StdioTest("", "")] * 2, root, limits, python_guard=False, isolation=isolation
    )
    assert [r.status for r in results] == ["timeout", "timeout"]
    assert results[0].got == ("19\n" if isolation == "strict" else "150\n")
    # The root fixture then checks that no process is left.


@pytest.mark.parametrize("isolation", MODES)
def test_network_without_the_guard(isolation, root):
    """Strict: no socket but AF_UNIX can be made; the unsafe mode leaves only the guard."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.5)
        program = (
            f"import socket\nsocket.create_connection(('127.0.0.1', "
            f"{server.getsockname()[1]}), timeout=1)\nprint('connected')\n"
        )
        [result] = run(
            program, [StdioTest("", "connected")], root, python_guard=False, isolation=isolation
        )
        if isolation == "strict":
            assert result.status == "error" and "Operation not permitted" in result.message
            with pytest.raises(socket.timeout):
                server.accept()
        else:
            assert result.status == "passed"
            server.accept()[0].close()


def test_limits_are_validated():
    with pytest.raises(ValueError, match="timeout_s"):
        SandboxLimits(timeout_s=0)
    with pytest.raises(ValueError, match="total_timeout_s"):
        SandboxLimits(timeout_s=5, total_timeout_s=1)
    with pytest.raises(ValueError, match="memory_mb"):
        SandboxLimits(memory_mb=8)
    with pytest.raises(ValueError, match="output_bytes"):
        SandboxLimits(output_bytes=10)
    with pytest.raises(ValueError, match=r"tests\[1\]"):
        run_tests("", [StdioTest("", ""), "not a test"])
    assert run_tests("", []) == []
