"""``agentrl-jax bench ...``: benchmarks against named baselines measured in the same run."""

from __future__ import annotations

from typing import List, Optional

import typer

from agentrl_jax.bench.report import emit

app = typer.Typer(
    help="Benchmarks: ours vs a named baseline, same run, with the ratio.", no_args_is_help=True
)

JSON_OPT = typer.Option(False, "--json", help="One JSON object per line instead of a table.")


@app.command("env")
def bench_env(
    json_out: bool = JSON_OPT,
    batch: list[int] = typer.Option([4096, 65536], help="Parallel env counts."),
    steps: int = typer.Option(200, help="Steps per timed run."),
    repeats: int = typer.Option(5, help="Timed runs (median)."),
) -> None:
    """FrozenLake 8x8 slippery env steps/s vs gymnasium SyncVectorEnv and a NumPy step."""
    from agentrl_jax.bench import env

    emit(env.run(batch_sizes=batch, steps=steps, repeats=repeats), json_out)


@app.command("serve")
def bench_serve(
    json_out: bool = JSON_OPT,
    shape: str = typer.Option("tiny", help="The model's shape: tiny or qwen3-0.6b-2layers."),
    clients: int = typer.Option(32, min=1, help="Concurrent multi-turn clients."),
    turns: int = typer.Option(3, min=1, help="Turns per conversation."),
    max_tokens: int = typer.Option(16, min=1, help="Tokens per completion."),
    slots: int = typer.Option(32, min=1, help="The engine's rows."),
) -> None:
    """The policy server under concurrent multi-turn clients vs the engine alone (same work)."""
    from agentrl_jax.bench import serve

    if shape not in ("tiny", "qwen3-0.6b-2layers"):
        raise typer.BadParameter(f"--shape: tiny or qwen3-0.6b-2layers, got {shape!r}")
    emit(
        serve.run(shape=shape, clients=clients, turns=turns, max_tokens=max_tokens, slots=slots),
        json_out,
    )


@app.command("qstar")
def bench_qstar(
    json_out: bool = JSON_OPT,
    maps: int = typer.Option(1024, help="Number of random 8x8 slippery maps."),
    horizon: int = typer.Option(70, help="Horizon H."),
    repeats: int = typer.Option(5, help="Timed runs (median)."),
) -> None:
    """Finite-horizon Q* for many maps vs per-map and batched NumPy backward induction."""
    from agentrl_jax.bench import qstar

    emit(qstar.run(num_maps=maps, horizon=horizon, repeats=repeats), json_out)


@app.command("maps")
def bench_maps(
    json_out: bool = JSON_OPT,
    count: int = typer.Option(4096, help="Maps generated at once."),
    size: int = typer.Option(8, help="Map side n."),
    repeats: int = typer.Option(5, help="Timed runs (median)."),
) -> None:
    """Random solvable map generation vs gymnasium's generate_random_map."""
    from agentrl_jax.bench import maps

    emit(maps.run(count=count, size=size, repeats=repeats), json_out)


@app.command("forward")
def bench_forward(
    json_out: bool = JSON_OPT,
    config: list[str] = typer.Option(
        ["tiny", "qwen3-0.6b-2layers"],
        help="Model shapes: tiny, qwen3-0.6b-2layers; Qwen3 MoE: tiny-moe, qwen3-30b-a3b-1layer "
        "(Qwen3-30B-A3B, 1 of its 48 layers).",
    ),
    batch: int = typer.Option(4, help="Sequences per forward."),
    seq_len: int = typer.Option(128, help="Tokens per sequence."),
    dtype: str = typer.Option(
        "float32", help="float32 or bfloat16 (params and compute, both sides)."
    ),
    repeats: int = typer.Option(3, help="Timed runs (median)."),
) -> None:
    """Qwen3 prefill tokens/s: our jitted forward vs transformers on the same random checkpoint."""
    from agentrl_jax.bench import forward

    emit(
        forward.run(configs=config, batch=batch, seq_len=seq_len, dtype=dtype, repeats=repeats),
        json_out,
    )


@app.command("sample")
def bench_sample(
    json_out: bool = JSON_OPT,
    config: list[str] = typer.Option(
        ["tiny", "qwen3-0.6b-2layers"], help="Model shapes: tiny, qwen3-0.6b-2layers."
    ),
    repeats: int = typer.Option(3, help="Timed runs (median)."),
    torch_threads: int = typer.Option(
        0,
        help="transformers' intra-op threads (0: torch's "
        "default; 1 is steadier on a busy machine).",
    ),
) -> None:
    """Top-p sampling tokens/s vs transformers generate, decode vs weight-streaming floor,
    and a 10-turn rollout with KV-cache continuation vs re-encoding."""
    from agentrl_jax.bench import sample

    emit(sample.run(configs=config, repeats=repeats, torch_threads=torch_threads), json_out)


@app.command("lora")
def bench_lora(
    json_out: bool = JSON_OPT,
    size: list[str] = typer.Option(
        ["qwen3-0.6b-2layers"], help="Model shapes: tiny, qwen3-0.6b-2layers."
    ),
    batch: int = typer.Option(8, help="Rows decoded at once."),
    rank: int = typer.Option(16, help="LoRA rank (every attention and MLP projection)."),
    repeats: int = typer.Option(3, help="Timed runs (median)."),
) -> None:
    """Decode time with a LoRA run's adapters applied vs the same sampler on merged weights."""
    from agentrl_jax.bench import lora

    emit(lora.run(sizes=size, batch=batch, rank=rank, repeats=repeats), json_out)


@app.command("exact")
def bench_exact(
    json_out: bool = JSON_OPT,
    size: list[str] = typer.Option(["tiny"], help="Model shapes: tiny, qwen3-0.6b-2layers."),
    batch: int = typer.Option(8, help="Rows sampled, and trained on, at once."),
    prompt_len: int = typer.Option(64, help="Prompt tokens per row."),
    new: int = typer.Option(32, help="Tokens sampled per row."),
    repeats: int = typer.Option(3, help="Timed runs (median)."),
) -> None:
    """Decode tokens/s and train-step time with rl.exact_logprobs vs the fast path."""
    from agentrl_jax.bench import exact

    emit(
        exact.run(sizes=size, batch=batch, prompt_len=prompt_len, new=new, repeats=repeats),
        json_out,
    )


@app.command("train-step")
def bench_train_step(
    json_out: bool = JSON_OPT,
    size: list[str] = typer.Option(
        ["tiny", "qwen3-0.6b-2l"],
        help="Model sizes: tiny, qwen3-0.6b-2l; Qwen3 MoE: tiny-moe, qwen3-30b-a3b-1l-32e-v16k "
        "(Qwen3-30B-A3B cut to 1 layer, 32 experts, 16k vocabulary; use --rows 4 on 24 GiB).",
    ),
    rows: int = typer.Option(8, help="Conversations per batch (a multiple of 4)."),
    tokens: int = typer.Option(256, help="Tokens per conversation."),
    repeats: int = typer.Option(3, help="Timed runs (median)."),
    mask: list[str] = typer.Option(
        ["synthetic", "frozenlake"],
        help="Loss masks: synthetic (~55% sampled tokens), frozenlake (~8 of every 105), "
        "frozenlake-ragged (FrozenLake's spread of episode lengths; padded and packed rows).",
    ),
) -> None:
    """Tokens/s of one GRPO update vs the same update in PyTorch transformers."""
    from agentrl_jax.bench import train_step

    emit(
        train_step.run(sizes=size, rows=rows, tokens=tokens, repeats=repeats, masks=mask), json_out
    )


@app.command("rollout")
def bench_rollout(
    json_out: bool = JSON_OPT,
    tasks: int = typer.Option(64, help="FrozenLake maps (tasks) per rollout."),
    group_size: int = typer.Option(16, help="Trajectories per task (G)."),
    budget: int = typer.Option(20, help="Turn budget B."),
    map_size: int = typer.Option(4, help="Map side n."),
    response_tokens: int = typer.Option(8, help="Most tokens per response."),
    max_context: int = typer.Option(1536, help="Context (KV cache) tokens per row."),
    compare_tasks: int = typer.Option(4, help="Tasks of the KV-cache vs re-encoding comparison."),
    repeats: int = typer.Option(1, help="Timed runs after a warm-up (median)."),
    decode_rows: int = typer.Option(64, help="Rows of the decode-step comparison."),
    seats: int = typer.Option(256, help="Seats (rows in flight) of the continuous-batching run."),
    decode_len: int = typer.Option(
        4096, help="Cache tokens per row of the decode-step comparison."
    ),
    overlap_tasks: int = typer.Option(
        8, help="Tasks of the lanes comparison (environment steps overlapping decoding)."
    ),
    step_ms: float = typer.Option(
        20.0,
        help="Milliseconds per row of each environment step in the lanes comparison (8 workers).",
    ),
) -> None:
    """Multi-turn FrozenLake rollouts of a tiny random Qwen3: turns/s and tokens/s and the time
    in model vs environment, vs one task group at a time; the paged engine vs the static one;
    the paged decode step at a quarter-filled vs a full cache; KV-cache continuation vs
    re-encoding the history every turn; a group's first prefill with and without sharing;
    slow environment steps overlapping decoding in 2 lanes vs 1."""
    from agentrl_jax.bench import rollout

    emit(
        rollout.run(
            num_tasks=tasks,
            group_size=group_size,
            budget=budget,
            map_size=map_size,
            max_response_tokens=response_tokens,
            max_context=max_context,
            compare_tasks=compare_tasks,
            repeats=repeats,
            decode_rows=decode_rows,
            decode_len=decode_len,
            seats=seats,
            overlap_tasks=overlap_tasks,
            step_ms=step_ms,
        ),
        json_out,
    )


@app.command("rl-loop")
def bench_rl_loop(
    json_out: bool = JSON_OPT,
    staleness: list[int] = typer.Option([1, 2], help="max_staleness settings against 0."),
    steps: int = typer.Option(8, help="Updates per setting."),
    warmup: int = typer.Option(2, help="Updates not timed (compilation)."),
    step_ms: float = typer.Option(
        20.0, help="Milliseconds per live row of each environment step (8 workers)."
    ),
    split: bool = typer.Option(
        True,
        help="Rollouts on a device of their own (mesh.rollout: 1; on a CPU, two host devices).",
    ),
) -> None:
    """The default FrozenLake RL loop: asynchronous (max_staleness 1, 2) vs synchronous
    turns/s and updates/s, with slow environment steps; each setting in a fresh process."""
    from agentrl_jax.bench import rl_loop

    emit(
        rl_loop.run(staleness, steps=steps, warmup=warmup, step_ms=step_ms, split=split),
        json_out,
    )


@app.command("device")
def bench_device(
    tiny: bool = typer.Option(
        False, help="Tiny shapes on any device (CI runs this on the CPU): the same code, fast."
    ),
    part: Optional[List[str]] = typer.Option(
        None,
        help="Only these parts (repeatable): memory, logits, paged_kernel, cudnn_attention, "
        "train_step, decode, rollout. Default: all.",
    ),
    compile_only: Optional[str] = typer.Option(
        None,
        "--compile-only",
        metavar="GPU",
        help="Run nothing: compile every program for this GPU (h100, h200, a100) with XLA:GPU, "
        "no GPU needed (needs the cuda extra); one JSON line per figure, its memory and "
        "roofline prediction.",
    ),
) -> None:
    """The first run on an accelerator: correctness against references, speed against the
    HBM floor, the chip's peak and PyTorch, plan's memory against the measured. One JSON line
    per figure (docs/hardware.md, "The first run on a GPU"); exit 1 if a correctness figure is
    outside its tolerance. With --compile-only GPU: the same figures' programs compiled for
    that GPU; exit 1 if one does not compile or fit."""
    import os

    if compile_only is not None:
        _compile_only(compile_only.lower(), tiny, part)
    # jax reserves 75% of a GPU's memory up front unless told not to: PyTorch's reference
    # runs need room beside it, and the measured peaks are the allocator's real ones.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from agentrl_jax.bench import device

    try:
        figures = device.run(
            tiny=tiny, parts=part or device.PARTS, emit=lambda f: print(f.to_json(), flush=True)
        )
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    raise typer.Exit(1 if any(f.ok is False for f in figures) else 0)


def _compile_only(gpu: str, tiny: bool, parts: Optional[List[str]]) -> None:
    """``bench device --compile-only GPU``: in a process started as XLA:GPU's compile-only
    devices need (this command restarts itself so, as ``agentrl-jax plan`` does); exits."""
    import os
    import subprocess
    import sys

    from agentrl_jax.bench.device import PARTS
    from agentrl_jax.plan import targets

    if gpu not in targets.GPUS:
        raise typer.BadParameter(
            f"--compile-only {gpu!r}: unknown GPU; known: {', '.join(targets.GPUS)}"
        )
    unknown = [p for p in parts or () if p not in PARTS]
    if unknown:
        raise typer.BadParameter(f"unknown part(s) {unknown}; known: {', '.join(PARTS)}")
    if targets.cuda_plugin_version() is None:
        typer.echo(
            f"Error: --compile-only {gpu}: XLA:GPU needs jax's CUDA plugin: "
            "pip install -e '.[cuda]' (no GPU needed)",
            err=True,
        )
        raise typer.Exit(2)
    if not targets.in_cuda_compile_process():
        argv = ["bench", "device", "--compile-only", gpu, *(["--tiny"] if tiny else [])]
        argv += [f"--part={p}" for p in parts or ()]
        child = subprocess.run(
            [sys.executable, "-m", "agentrl_jax.cli", *argv],
            env={**os.environ, **targets.CUDA_COMPILE_ENV},
        )
        raise typer.Exit(child.returncode)
    from agentrl_jax.bench import compile_only

    try:
        figures = compile_only.run(
            gpu, tiny=tiny, parts=parts or PARTS, emit=lambda f: print(f.to_json(), flush=True)
        )
    except ValueError as error:
        typer.echo(f"Error: {error}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(0 if all(f.compiled and f.fits for f in figures) else 1)
