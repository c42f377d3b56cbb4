"""Opt-in pytest plugin: where the suite's time goes into compiling.

``python -m pytest -p compile_report ...`` records, per test, every backend compilation jax
reports (a compile, or a load from the persistent cache) with the program's name and seconds,
plus the tracing and lowering time, and writes them as JSON lines to
``$AGENTRL_JAX_COMPILE_REPORT`` (default ``compile_report.jsonl`` in the working directory;
under ``pytest -n`` each worker appends its own lines). At the end it prints the programs that
cost the most, summed over the tests, and the share of test time spent compiling. Child
processes (8-device tests, the notebook kernel) are not seen.

The suite's time is mostly compilation (a tiny Qwen3's train step takes ~15 s to compile on a
2-core CPU, its execution milliseconds), so this is the first thing to read before making the
suite faster: the same program compiled by many tests is the cheapest time to win back.
"""

from __future__ import annotations

import collections
import json
import os
import time

import jax.monitoring

_EVENTS = ("backend_compile_duration", "jaxpr_trace_duration", "jaxpr_to_mlir_module_duration")
_current = {"test": "<collection>"}
_rows: list[dict] = []
_test_seconds: dict[str, float] = {}  # test -> seconds from setup to teardown
_started: dict[str, float] = {}


def _listen(event: str, duration: float, **kwargs) -> None:
    kind = event.rsplit("/", 1)[-1]
    if kind in _EVENTS:
        _rows.append(
            {
                "test": _current["test"],
                "kind": kind.removesuffix("_duration"),
                "program": kwargs.get("fun_name"),
                "seconds": duration,
            }
        )


jax.monitoring.register_event_duration_secs_listener(_listen)


def pytest_runtest_protocol(item, nextitem):
    _current["test"] = item.nodeid
    _started[item.nodeid] = time.perf_counter()


def pytest_runtest_logfinish(nodeid, location):
    if nodeid in _started:
        _test_seconds[nodeid] = time.perf_counter() - _started.pop(nodeid)


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("AGENTRL_JAX_COMPILE_REPORT", "compile_report.jsonl")
    with open(path, "a") as f:
        for row in _rows:
            f.write(json.dumps(row) + "\n")
        for test, seconds in _test_seconds.items():
            f.write(
                json.dumps({"test": test, "kind": "test", "program": None, "seconds": seconds})
                + "\n"
            )


def pytest_terminal_summary(terminalreporter):
    programs = collections.defaultdict(lambda: [0, 0.0, set()])
    for row in _rows:
        if row["kind"] == "backend_compile":
            entry = programs[row["program"]]
            entry[0] += 1
            entry[1] += row["seconds"]
            entry[2].add(row["test"].split("::")[0])
    if not programs:
        return
    compiling = sum(r["seconds"] for r in _rows)
    testing = sum(_test_seconds.values())
    write = terminalreporter.write_line
    write(
        f"compile report: {compiling:.0f} s tracing, lowering and compiling "
        f"in {testing:.0f} s of tests "
        f"(this process; child processes not seen)"
    )
    for name, (count, seconds, files) in sorted(programs.items(), key=lambda kv: -kv[1][1])[:15]:
        write(f"  {seconds:7.1f} s  {count:4d} x  {name}  ({len(files)} files)")
