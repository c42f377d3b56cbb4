"""Regenerate the stored plans in this folder with today's code: ``agentrl-jax plan --json``
for each entry of ``PLANS``, written to ``<name>.json`` with the command, the date and the jax
and libtpu versions that compiled it.

    python notebooks/plans/regenerate.py                 # every plan (tens of minutes)
    python notebooks/plans/regenerate.py 0.6b 1.7b       # the plans whose name holds these

GPU plans (``_xla-gpu``) are compiled by XLA:GPU itself for compile-only H100s: run them with a
Python that has the ``cuda`` extra (``pip install -e ".[cuda]"``; no GPU needed). TPU plans
compile through libtpu's compile-only devices: a Python with the ``tpu`` extra
(``pip install -e ".[tpu]"``). No accelerator, no weights. ``tests/test_plans_stored.py`` checks
that every JSON here is listed below and is consistent in itself.

    python notebooks/plans/regenerate.py xla-gpu         # the GPU plans (cuda extra)
    python notebooks/plans/regenerate.py v5              # the TPU plans (tpu extra)
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

H100_8 = ["--gpu", "h100", "--gpus", "8"]
H100_1 = ["--gpu", "h100", "--gpus", "1"]
V5P_64 = ["--topology", "v5p:4x4x2"]  # v5p-64: 32 chips (64 TensorCores)
V5P_64_COLOCATED = ["--topology", "v5p:4x4x2", "--set", "mesh.data=8", "--set", "mesh.fsdp=4"]
V5P_64_SPLIT = [
    *["--topology", "v5p:4x4x2", "--set", "mesh.data=4", "--set", "mesh.fsdp=4"],
    *["--set", "mesh.rollout=2"],
]

# name -> (config, plan arguments)
PLANS: dict[str, tuple[str, list[str]]] = {
    "frozenlake_qwen3_0.6b_1gpu_h100_xla-gpu": ("frozenlake_qwen3_0.6b_1gpu", H100_1),
    "frozenlake_qwen3_1.7b_1gpu_h100_xla-gpu": ("frozenlake_qwen3_1.7b_1gpu", H100_1),
    "frozenlake_qwen3_8b_lora_1gpu_h100_xla-gpu": ("frozenlake_qwen3_8b_lora_1gpu", H100_1),
    # the LoRA config on a v5e-8 (16 GiB a chip): the base sharded 8 ways and read as trained
    # by decode, the static KV cache without refill (with the paged one and refill a sampling
    # program needs 20.6 GiB a chip), 1 row per chip per micro-batch, 8,192-token rows (at
    # 16,384 the train step needs 15.8 of the 15.75 GiB)
    "frozenlake_qwen3_8b_lora_1gpu_v5e-2x4_8k": (
        "frozenlake_qwen3_8b_lora_1gpu",
        [
            *["--topology", "v5e:2x4", "--set", "engine.generation_layout=training"],
            *["--set", "engine.kv_page_size=null", "--set", "rl.refill=false"],
            *["--set", "rl.batching.num_micro_batches=32", "--set", "task.max_context=8192"],
            *["--set", "eval.max_context=8192"],
        ],
    ),
    "frozenlake_qwen3_4b_gpu_8xh100_xla-gpu": ("frozenlake_qwen3_4b_gpu", H100_8),
    "frozenlake_qwen3_8b_gpu_8xh100_xla-gpu": ("frozenlake_qwen3_8b_gpu", H100_8),
    "sql_qwen3_4b_gpu_8xh100_xla-gpu": ("sql_qwen3_4b_gpu", H100_8),
    "code_qwen3_4b_gpu_8xh100_xla-gpu": ("code_qwen3_4b_gpu", H100_8),
    "bfcl_qwen3_4b_gpu_8xh100_xla-gpu": ("bfcl_qwen3_4b_gpu", H100_8),
    "frozenlake_qwen3_4b_tpu_v5p-2x2x2": ("frozenlake_qwen3_4b_tpu", ["--topology", "v5p:2x2x2"]),
    "frozenlake_qwen3_8b_tpu_v5p-2x2x2": ("frozenlake_qwen3_8b_tpu", ["--topology", "v5p:2x2x2"]),
    "frozenlake_qwen3_4b_tpu_v5p-4x4x2_colocated": ("frozenlake_qwen3_4b_tpu", V5P_64_COLOCATED),
    "frozenlake_qwen3_4b_tpu_v5p-4x4x2_split": ("frozenlake_qwen3_4b_tpu", V5P_64_SPLIT),
    "frozenlake_qwen3_8b_tpu_v5p-4x4x2_colocated": ("frozenlake_qwen3_8b_tpu", V5P_64_COLOCATED),
    # 8B split: 1 row per training chip per micro-batch (2 rows: 85.5 GiB, over 85% of a chip)
    "frozenlake_qwen3_8b_tpu_v5p-4x4x2_split": (
        "frozenlake_qwen3_8b_tpu",
        [*V5P_64_SPLIT, "--set", "rl.batching.num_micro_batches=32"],
    ),
    # Qwen3-30B-A3B (issue #58): a v5p-64 slice (32 chips) with expert parallelism (fsdp 4 x
    # expert 8), full-parameter; eight H100s full-parameter (does NOT fit: DOES_NOT_FIT) and LoRA;
    # the LoRA config on the v5p-64 slice with the TPU config's mesh
    "frozenlake_qwen3_30b_a3b_tpu_v5p-4x4x2": ("frozenlake_qwen3_30b_a3b_tpu", V5P_64),
    "frozenlake_qwen3_30b_a3b_gpu_8xh100_xla-gpu": ("frozenlake_qwen3_30b_a3b_gpu", H100_8),
    "frozenlake_qwen3_30b_a3b_lora_gpu_8xh100_xla-gpu": (
        "frozenlake_qwen3_30b_a3b_lora_gpu",
        H100_8,
    ),
    "frozenlake_qwen3_30b_a3b_lora_gpu_v5p-4x4x2": (
        "frozenlake_qwen3_30b_a3b_lora_gpu",
        [
            *V5P_64,
            "--set",
            "mesh.fsdp=4",
            "--set",
            "mesh.expert=8",
            "--set",
            "rl.batching.num_micro_batches=16",
        ],
    ),
}

# Plans stored to show that a config does NOT fit its target, and why (every other stored plan
# fits with 15% headroom: tests/test_plans_stored.py).
DOES_NOT_FIT: dict[str, str] = {
    "frozenlake_qwen3_30b_a3b_gpu_8xh100_xla-gpu": (
        "full-parameter Qwen3-30B-A3B on 8 x 80 GB: the train state alone (float32 policy, "
        "AdamW moments and KL reference, 16 bytes a parameter) is 56.8 GiB a GPU; the train "
        "step needs more than the 67.2 GiB that leave 15%"
    ),
}


def command(name: str) -> list[str]:
    """The ``agentrl-jax plan`` arguments of one stored plan."""
    config, args = PLANS[name]
    return ["plan", "--config", f"configs/{config}.yaml", *args, "--json"]


def regenerate(name: str) -> dict:
    """Compile one plan and write its JSON; returns the report."""
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "agentrl_jax.cli", *command(name)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    try:  # exit 1 is also "compiled, but some program does not fit": the report says which
        report = json.loads(out.stdout)
    except json.JSONDecodeError:
        raise RuntimeError(
            f"{name}: plan failed ({out.returncode}):\n{out.stderr[-3000:]}"
        ) from None
    report["command"] = "agentrl-jax " + " ".join(command(name))
    report["generated"] = {
        "date": datetime.date.today().isoformat(),
        "jax": importlib.metadata.version("jax"),
        "libtpu": _version("libtpu"),
        "jax_cuda12_plugin": _version("jax-cuda12-plugin"),
        "seconds": round(time.perf_counter() - start),
    }
    (HERE / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(patterns: list[str]) -> None:
    names = [n for n in PLANS if not patterns or any(p in n for p in patterns)]
    for name in names:
        report = regenerate(name)
        worst = max(report["programs"], key=lambda p: p["peak"])
        print(
            f"{name}: fits={report['fits']} worst {worst['name']} "
            f"{worst['peak'] / 1024**3:.1f} GiB ({worst['headroom']:.0%} headroom), "
            f"{report['generated']['seconds']} s",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
