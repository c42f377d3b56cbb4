"""``agentrl-jax solve ...``: solve environments exactly and show the optimal play."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from agentrl_jax.cli.paths import output_file

app = typer.Typer(
    help="Solve environments exactly and show the optimal play.", no_args_is_help=True
)

SHOWCASE_EPISODES = 64  # episodes played per shown map; the first success is shown


@app.command("frozenlake")
def frozenlake(
    maps: int = typer.Option(256, min=1, help="Random maps to solve (test split)."),
    size: int = typer.Option(8, min=2, help="Map side n."),
    p: float = typer.Option(0.8, min=0.0, max=1.0, help="Probability that a cell is frozen."),
    t_max: int = typer.Option(70, min=1, help="Largest turn budget T_max (paper §2: 70)."),
    slippery: bool = typer.Option(True, help="gymnasium's slippery dynamics."),
    episodes: int = typer.Option(64, min=1, help="Q*-greedy episodes per map and budget."),
    seed: int = typer.Option(0, help="Seed of the maps and the slips."),
    show: int = typer.Option(1, min=0, help="Maps to print with one optimal episode."),
    out: Path | None = typer.Option(None, help="Also write the results as JSON to this file."),
) -> None:
    """Generate random maps, solve them with exact Q*, and play optimally within budgets.

    For each budget level (25/50/75/100% of T_max) it prints the structural upper bound
    (share of maps whose shortest path fits the budget, §2), the exact optimal success
    probability (finite-horizon DP, gamma = 1) and the success rate of Q*-greedy episodes
    played in the JAX environment, which must agree with the DP within its interval.
    """
    if out is not None:
        output_file(out)
    import jax
    import numpy as np

    from agentrl_jax.evaluation.passk import budget_levels
    from agentrl_jax.evaluation.stats import proportion_ci_wilson
    from envs.frozenlake import env as fl_env
    from envs.frozenlake import grid, optimal, qstar, text
    from envs.frozenlake import maps as fl_maps

    t0 = time.perf_counter()
    key_maps, key_play = jax.random.split(jax.random.key(seed))
    tiles = fl_maps.generate(key_maps, maps, size=size, p=p, split="test")
    q = qstar.q_star(tiles, t_max, gamma=1.0, is_slippery=slippery)
    shortest = np.asarray(qstar.shortest_path_length(tiles))
    params = fl_env.make_params(tiles, is_slippery=slippery, max_steps=None)
    jax.block_until_ready(q)
    t_solve = time.perf_counter() - t0

    play = jax.jit(
        jax.vmap(
            jax.vmap(optimal.play_greedy, in_axes=(0, None, None, None, None, None)),
            in_axes=(0, 0, 0, None, None, None),
        ),
        static_argnums=(5,),
    )
    kind = "slippery" if slippery else "deterministic"
    typer.echo(
        f"FrozenLake {size}x{size} {kind}: {maps} random solvable maps (test split, p={p}), "
        f"seed {seed}; exact Q* for H = 0..{t_max} in {t_solve:.2f} s.\n"
    )
    header = (
        f"{'budget T':>9}  {'structural bound':>16}  {'optimal success (DP)':>20}  "
        f"{'Q*-greedy episodes [95% CI]':>30}  {'mean turns':>10}"
    )
    typer.echo(header)
    typer.echo("-" * len(header))
    rows = []
    for budget in budget_levels(t_max):
        keys = jax.random.split(jax.random.fold_in(key_play, budget), maps * episodes)
        success, turns, _, _ = play(keys.reshape(maps, episodes), tiles, q, budget, params, t_max)
        success = np.asarray(success)
        exact = float(np.mean(optimal.success_probability(q, tiles, budget)))
        ci = proportion_ci_wilson(success.reshape(-1))
        row = {
            "budget": int(budget),
            "structural_bound": float(np.mean(shortest <= budget)),
            "optimal_success_exact": exact,
            "greedy_success": ci.mean,
            "greedy_success_ci": [ci.low, ci.high],
            "greedy_mean_turns": float(np.mean(turns)),
        }
        rows.append(row)
        typer.echo(
            f"{budget:>9}  {row['structural_bound']:>16.3f}  {exact:>20.3f}  "
            f"{ci.mean:>8.3f} [{ci.low:.3f}, {ci.high:.3f}]{'':>12}  "
            f"{row['greedy_mean_turns']:>10.1f}"
        )

    showcase = jax.jit(
        jax.vmap(optimal.play_greedy, in_axes=(0, None, None, None, None, None)), static_argnums=5
    )
    for i in range(min(show, maps)):
        # the first of SHOWCASE_EPISODES episodes that reaches the goal, if any does
        keys = jax.random.split(jax.random.fold_in(key_play, 10_000 + i), SHOWCASE_EPISODES)
        success, turns, positions, actions = jax.device_get(
            showcase(keys, tiles[i], q[i], t_max, params, t_max)
        )
        wins = np.flatnonzero(success)
        pick = int(wins[0]) if len(wins) else 0
        steps = int(turns[pick])
        moves = _run_lengths([grid.ACTION_NAMES[a] for a in actions[pick][:steps]])
        typer.echo(f"\nMap {i} (shortest path {int(shortest[i])} moves), start:")
        typer.echo(text.render(tiles[i], positions[pick][0]))
        which = (
            f"the first to reach the goal, as {len(wins)} of them did"
            if len(wins)
            else "none of them reached the goal"
        )
        typer.echo(
            f"Q*-greedy play with budget {t_max}, episode {pick + 1} of "
            f"{SHOWCASE_EPISODES} ({which}): {moves or '(none)'}"
        )
        typer.echo(
            f"{'reached the goal' if bool(success[pick]) else 'did not reach the goal'} "
            f"after {steps} moves; final state:"
        )
        typer.echo(text.render(tiles[i], positions[pick][steps]))
    typer.echo(
        "\nSymbols: P player, _ ice, O hole, G goal, X player in a hole, W player on the goal."
    )

    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        settings = dict(
            maps=maps, size=size, p=p, t_max=t_max, slippery=slippery, episodes=episodes, seed=seed
        )
        out.write_text(json.dumps({"settings": settings, "budgets": rows}, indent=2))
        typer.echo(f"Wrote {out}")


def _run_lengths(words: list[str]) -> str:
    """``["Left", "Left", "Down"]`` -> ``"Left x2, Down"``."""
    runs: list[list] = []
    for w in words:
        if runs and runs[-1][0] == w:
            runs[-1][1] += 1
        else:
            runs.append([w, 1])
    return ", ".join(w if k == 1 else f"{w} x{k}" for w, k in runs)
