"""``agentrl-jax bench ...``: benchmarks against named baselines measured in the same run."""

from __future__ import annotations

import typer

from agentrl_jax.bench.report import emit

app = typer.Typer(help="Benchmarks: ours vs a named baseline, same run, with the ratio.",
                  no_args_is_help=True)

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
    config: list[str] = typer.Option(["tiny", "qwen3-0.6b-2layers"],
                                     help="Model shapes: tiny, qwen3-0.6b-2layers."),
    batch: int = typer.Option(4, help="Sequences per forward."),
    seq_len: int = typer.Option(128, help="Tokens per sequence."),
    dtype: str = typer.Option("float32",
                              help="float32 or bfloat16 (params and compute, both sides)."),
    repeats: int = typer.Option(3, help="Timed runs (median)."),
) -> None:
    """Qwen3 prefill tokens/s: our jitted forward vs transformers on the same random checkpoint."""
    from agentrl_jax.bench import forward

    emit(forward.run(configs=config, batch=batch, seq_len=seq_len, dtype=dtype,
                     repeats=repeats), json_out)
