"""What a run ran on: the CPU model and the vector instructions XLA compiles for, the devices,
and the jax / jaxlib versions (:func:`machine`). Results on CPU depend on all of them: the
same command on another x86 CPU (e.g. with AVX-512 where the stored run had none) rounds
differently after a few RL updates, so every report and ``phases.json`` says where it ran."""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import jax
import jaxlib

VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "neon", "sve")
"""The CPU features recorded: the ones XLA's CPU code generation chooses between."""


def _cpuinfo(text: str) -> dict[str, Any]:
    """The CPU model, identity and recorded vector features from ``/proc/cpuinfo``'s text
    (its first processor)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    model = fields.get("model name") or fields.get("Hardware") or fields.get("cpu model") or ""
    ident = " ".join(
        f"{label} {fields[key]}"
        for label, key in (("family", "cpu family"), ("model", "model"), ("stepping", "stepping"))
        if key in fields
    )
    if ident and fields.get("vendor_id"):
        ident = f"{fields['vendor_id']} {ident}"
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    return {
        "cpu": model or platform.processor() or "unknown",
        "cpu_id": ident,
        "cpu_flags": [f for f in VECTOR_FLAGS if f in flags],
    }


def _cpu() -> dict[str, Any]:
    proc = Path("/proc/cpuinfo")
    if proc.exists():
        try:
            return _cpuinfo(proc.read_text(errors="replace"))
        except OSError:
            pass
    if platform.system() == "Darwin":
        try:
            brand = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"],
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            brand = ""
        return {"cpu": brand or platform.processor() or "unknown", "cpu_id": "", "cpu_flags": []}
    return {"cpu": platform.processor() or "unknown", "cpu_id": "", "cpu_flags": []}


@functools.lru_cache(maxsize=1)
def machine() -> dict[str, Any]:
    """This process's machine, as JSON-ready values: ``cpu`` (model name), ``cpu_id``
    (vendor, family, model, stepping), ``cpu_flags`` (of :data:`VECTOR_FLAGS`), ``cores``,
    ``arch``, ``devices`` (count x kind, all processes), ``processes``, ``jax``, ``jaxlib``,
    ``python``."""
    devices = jax.devices()
    return {
        **_cpu(),
        "cores": os.cpu_count(),
        "arch": platform.machine(),
        "devices": f"{len(devices)} x {devices[0].device_kind}",
        "processes": jax.process_count(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "python": platform.python_version(),
    }


def describe(record: dict[str, Any]) -> str:
    """One line for a report: ``Intel(R) Xeon(R) Processor (GenuineIntel family 6 model 167
    stepping 1; avx2 fma avx512f ...; 2 cores, x86_64), 1 x cpu; jax 0.10.2, jaxlib 0.10.2``
    (a record read back from ``phases.json``: fields of other types are written as they are,
    never a crash)."""
    flags = record.get("cpu_flags")
    detail = "; ".join(
        part
        for part in (
            str(record.get("cpu_id", "")),
            " ".join(str(f) for f in flags) if isinstance(flags, list) else "",
            f"{record.get('cores')} cores, {record.get('arch')}",
        )
        if part
    )
    processes = record.get("processes", 1)
    processes = processes if isinstance(processes, int) else 1
    return (
        f"{record.get('cpu', 'unknown')} ({detail}), {record.get('devices')}"
        f"{f' in {processes} processes' if processes and processes > 1 else ''}; "
        f"jax {record.get('jax')}, jaxlib {record.get('jaxlib')}"
    )
