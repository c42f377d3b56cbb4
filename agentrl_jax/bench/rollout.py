"""``agentrl-jax bench rollout``: multi-turn FrozenLake rollouts of a tiny random Qwen3 policy.

The setting of the issue: ``tasks`` random solvable maps x ``G`` trajectories, budget ``B``,
the real Qwen3 tokenizer and chat template, a random Qwen3 with a tiny width. Its vocabulary
is the tokenizer ids the rollout can meet (:func:`frozenlake_token_map`), mapped one to one, so
the 151,936-row output head does not drown the rollout's own costs (on a 2-core CPU it would
be most of the time at this width). The random policy answers mostly gibberish: invalid moves
(no-ops) keep rows alive, valid words now and then move the player, so rows end at different
turns.

Results (each pair measured in the same run, same maps, policy and settings):

1. turns/s and sampled tokens/s of the whole batch (``tasks x G`` rows), with the share of our
   time spent in the model, the environment and the host loop in the name; baseline: the
   same rollouts one task group (``G`` rows) at a time, i.e. without batching across tasks;
2. turns/s on ``compare_tasks x G`` rows against the same rollout re-encoding every live row's
   whole history each turn instead of continuing its KV cache
   (``SamplerPolicy(reuse_cache=False)``). Re-encoding costs ``O(rows x context^2)`` attention
   per turn and a ``rows x context^2`` score buffer, too much for the whole batch on a CPU,
   hence the smaller batch (both sides on the same one);
3. the same whole batch through the paged engine (``SamplerPolicy(paging=Paging())``: pages
   released as rows finish, attention over the used pages only), all rows at once and with
   continuous batching in ``seats`` seats (``RolloutConfig(refill=True)``), against the static
   engine (one ``max_context`` cache per row, attention over all of it): turns/s, same run;
4. the paged engine's decode step (``decode_rows`` rows, 4,096-token rows, prefill excluded,
   ms per step of an 8-token decode, median of 5) with the cache a quarter filled against
   full; the static engine's two figures are in the settings;
5. the first turn's prefill of one task group (``G`` rows, one shared first prompt) with prefix
   sharing (the prompt prefilled once, its cache copied to the ``G`` rows) against every row
   prefilling its own copy (``SamplerPolicy(share_prefixes=False)``): seconds of
   ``policy.start``, median of at least 5 timed calls after a compiling one;
6. environment steps overlapping decoding: ``overlap_tasks x G`` rows on the paged engine,
   whose environment also waits ``step_ms`` per live row and step, over 8 workers
   (:class:`SlowSteps`: a stand-in for a Python environment's query or test run, which runs
   off the device that decodes), in ``RolloutConfig(lanes=2)`` against one lane: turns/s.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from agentrl_jax.bench.report import BenchResult
from agentrl_jax.models import Qwen3Config, Qwen3ForCausalLM
from agentrl_jax.models.tokenizer import load_tokenizer
from agentrl_jax.rollout import MultiTurnRollout, RolloutConfig, RolloutResult
from agentrl_jax.sampling import Paging, Sampler, SamplerPolicy, SamplingConfig, TokenMap
from agentrl_jax.sampling.scheduler import row_buckets
from envs.frozenlake import grid
from envs.frozenlake import maps as fl_maps
from envs.frozenlake.text import render
from envs.frozenlake.text_env import FrozenLakeTextConfig, FrozenLakeTextEnv

PER_GROUP = "same rollouts one task group (G rows) at a time"
STATIC = "same rollout through the static-cache engine (one max_context cache per row)"
FULL_CACHE = "the same engine's decode step at a full cache"
DECODE_LEN, DECODE_STEPS = 4096, 8
REENCODE = "same rollout re-encoding each row's whole history every turn (no KV reuse)"
UNSHARED = "the same group's rows each prefilling their own copy of the prompt"
ONE_LANE = "the same rollout in one lane (each environment step after the decode it answers)"
TINY_DIMS = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
)


class SlowSteps:
    """``env`` (a :class:`~envs.protocol.TextEnv`) whose every step also waits ``row_ms`` per
    live row, the rows spread over ``workers`` workers: the time a Python environment's step
    takes in its worker pool (a query, a test run in a sandbox), spent off the device that
    decodes. Everything else is ``env``'s."""

    def __init__(self, env, row_ms: float, workers: int = 8):
        self.env, self.row_ms, self.workers = env, row_ms, workers

    def __getattr__(self, name: str):
        return getattr(self.env, name)

    def step(self, state, responses, live):
        out = self.env.step(state, responses, live)
        time.sleep(self.row_ms / 1e3 * -(-int(np.sum(live)) // self.workers))
        return out


def frozenlake_token_map(runner: MultiTurnRollout, budgets: Sequence[int]) -> TokenMap:
    """Every tokenizer id a FrozenLake rollout of ``runner`` can feed the policy, plus the
    answer words: first prompts, every grid of every map, every turn header of ``budgets``."""
    env, chat, prompt = runner.env, runner.chat, runner.config.prompt
    texts = [f"<answer>{name}</answer>" for name in grid.ACTION_NAMES]
    texts += [f" {name.lower()}" for name in grid.ACTION_NAMES]
    grids = sorted({render(tiles, pos) for tiles in env.maps for pos in range(tiles.size)})
    for budget in budgets:
        system = prompt.system_text(runner.instructions, budget)
        first = chat.first_prompt(system, prompt.turn_text(grids[0], budget, 0))
        texts.append(chat.tokenizer.decode(first))
        texts += [prompt.turn_text("", budget, t) for t in range(budget)]
    texts += [chat.tokenizer.decode(chat.next_prompt(prompt.turn_text(g, 1, 0))) for g in grids]
    return TokenMap.from_texts(
        chat.tokenizer, texts, extra_ids=chat.stop_token_ids + chat.end_of_turn
    )


def tiny_policy_model(vocab_size: int, seed: int = 0, **dims) -> Qwen3ForCausalLM:
    """A random Qwen3 of ``TINY_DIMS`` (overridden by ``dims``) with ``vocab_size`` ids."""
    config = Qwen3Config(vocab_size=vocab_size, **{**TINY_DIMS, **dims})
    return Qwen3ForCausalLM(config, rngs=nnx.Rngs(seed))


@dataclasses.dataclass(frozen=True)
class Measured:
    """Totals of one or more rollouts timed together."""

    seconds: float
    turns: int
    tokens: int
    result: RolloutResult  # the first rollout (for the time shares and settings)


def _measure(rollouts, repeats: int, warmup=None) -> Measured:
    """``rollouts()`` returns a list of RolloutResult; a warm-up (``warmup()``, default
    ``rollouts()``: it compiles), then the median of ``repeats`` calls by wall time."""
    (warmup or rollouts)()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        results = rollouts()
        runs.append(
            Measured(
                time.perf_counter() - start,
                sum(r.stats.turns_played for r in results),
                sum(r.stats.sampled_tokens for r in results),
                results[0],
            )
        )
    runs.sort(key=lambda m: m.seconds)
    return runs[(len(runs) - 1) // 2]


def _start_seconds(policy: SamplerPolicy, contexts, settings, repeats: int) -> float:
    """Median seconds of ``policy.start(contexts, settings)`` (it blocks until the cache is
    filled), after one call that compiles."""
    policy.start(contexts, settings)
    times = []
    for _ in range(max(repeats, 5)):
        begin = time.perf_counter()
        policy.start(contexts, settings)
        times.append(time.perf_counter() - begin)
    return float(np.median(times))


def keys_read_ratio(trajectory, max_context: int, block: int) -> float:
    """Keys the paged engine's decode attention reads over those the static engine's reads, in
    this rollout: each turn both hold the same rows (the live rows' bucket); the static one reads
    ``max_context`` keys per row, the paged one whole ``block``-token blocks up to the longest
    live row's context at that turn's response. An upper bound of the paged engine's speed-up
    where attention is all the cost."""
    turns = np.asarray(trajectory.token_turn)
    live = np.asarray(trajectory.turn_mask)
    buckets = row_buckets(live.shape[0], 8, 1)  # SamplerPolicy's defaults
    static = paged = 0
    for t in range(live.shape[1]):
        rows = np.flatnonzero(live[:, t])
        if not rows.size:
            break
        ends = [np.flatnonzero(turns[r] == t) for r in rows]
        longest = max((int(e[-1]) + 1 for e in ends if e.size), default=0)
        held = min(b for b in buckets if b >= rows.size)
        static += held * max_context
        paged += held * min(-(-longest // block) * block, max_context)
    return paged / max(static, 1)


def decode_step_ms(
    model: Qwen3ForCausalLM,
    paging: Paging | None,
    rows: int,
    fill: int,
    repeats: int = 5,
    cache_len: int = DECODE_LEN,
) -> float:
    """Milliseconds per decode step of ``rows`` rows holding ``fill`` random tokens each in
    ``cache_len``-token caches: median of ``repeats`` timed decodes of
    :data:`DECODE_STEPS` tokens (each from a copy of the prefilled state), after one that
    compiles."""
    sampler = Sampler(
        model, max_new_tokens=DECODE_STEPS, stop_token_ids=(), prefill_chunk=512, paging=paging
    )
    params = nnx.state(model)
    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, (rows, fill))
    state = sampler.append(
        params, sampler.init(rows, cache_len), tokens.astype(np.int32), np.ones(tokens.shape, bool)
    )
    times = []
    for r in range(repeats + 1):
        copy = jax.block_until_ready(jax.tree.map(jnp.copy, state))
        begin = time.perf_counter()
        _, out = sampler.decode(params, copy, jax.random.key(r), SamplingConfig(temperature=1.0))
        jax.block_until_ready(out.tokens)
        times.append(time.perf_counter() - begin)
    return float(np.median(times[1:])) / DECODE_STEPS * 1e3


def run(
    num_tasks: int = 64,
    group_size: int = 16,
    budget: int = 20,
    map_size: int = 4,
    max_response_tokens: int = 8,
    max_context: int = 1536,
    compare_tasks: int = 4,
    repeats: int = 1,
    seed: int = 0,
    decode_rows: int = 64,
    decode_len: int = DECODE_LEN,
    seats: int = 256,
    overlap_tasks: int = 8,
    step_ms: float = 20.0,
) -> list[BenchResult]:
    """The measurements of the module docstring."""
    if (
        min(
            num_tasks,
            group_size,
            budget,
            max_response_tokens,
            repeats,
            compare_tasks,
            decode_rows,
            seats,
            overlap_tasks,
        )
        < 1
        or map_size < 2
        or max(compare_tasks, overlap_tasks) > num_tasks
        or decode_len < 4 * DECODE_STEPS
        or not step_ms >= 0
    ):
        raise ValueError(
            "num_tasks, group_size, budget, max_response_tokens, repeats, seats, "
            "decode_rows, compare_tasks and overlap_tasks (both <= num_tasks) must "
            f"be >= 1, map_size >= 2, decode_len >= {4 * DECODE_STEPS} and step_ms "
            f">= 0; got {num_tasks}, {group_size}, {budget}, {max_response_tokens}, "
            f"{repeats}, {seats}, {decode_rows}, {compare_tasks}, {overlap_tasks}, "
            f"{map_size}, {decode_len}, {step_ms}"
        )
    key_maps, key_run = jax.random.split(jax.random.key(seed))
    env = FrozenLakeTextEnv(
        fl_maps.generate(key_maps, num_tasks, size=map_size), FrozenLakeTextConfig(t_max=budget)
    )
    config = RolloutConfig(
        group_size=group_size,
        budget=budget,
        max_response_tokens=max_response_tokens,
        max_context=max_context,
    )
    runner = MultiTurnRollout(env, load_tokenizer(), config)
    token_map = frozenlake_token_map(runner, [budget])
    model = tiny_policy_model(len(token_map), seed)
    policy = SamplerPolicy(model, token_map=token_map)
    tasks = np.arange(num_tasks)

    batched = _measure(lambda: [runner(policy, tasks, key_run)], repeats)
    compilations = {"policy": dict(policy.trace_counts), "env": dict(env.trace_counts)}
    paged_policy = SamplerPolicy(model, token_map=token_map, paging=Paging())
    paged = _measure(lambda: [runner(paged_policy, tasks, key_run)], repeats)
    seats = min(seats, num_tasks * group_size)
    seated_runner = MultiTurnRollout(
        env, runner.tokenizer, dataclasses.replace(config, max_rows_per_call=seats, refill=True)
    )
    seated_policy = SamplerPolicy(model, token_map=token_map, paging=Paging())
    seated = _measure(lambda: [seated_runner(seated_policy, tasks, key_run)], repeats)
    same_rollout = {
        name: bool(
            np.array_equal(
                np.asarray(m.result.trajectory.tokens), np.asarray(batched.result.trajectory.tokens)
            )
        )
        for name, m in (("paged", paged), ("continuous", seated))
    }

    # environment steps that take time, in 2 lanes against 1 (both on the paged engine)
    slow = {
        lanes: MultiTurnRollout(
            SlowSteps(env, step_ms), runner.tokenizer, dataclasses.replace(config, lanes=lanes)
        )
        for lanes in (1, 2)
    }
    overlap_policy = SamplerPolicy(model, token_map=token_map, paging=Paging())
    overlap_subset = tasks[:overlap_tasks]
    lanes = {
        n: _measure(lambda n=n: [slow[n](overlap_policy, overlap_subset, key_run)], repeats)
        for n in (1, 2)
    }

    def one_group(k: int) -> RolloutResult:
        return runner(policy, tasks[k : k + 1], jax.random.fold_in(key_run, k))

    per_group = _measure(
        lambda: [one_group(k) for k in range(num_tasks)], repeats, warmup=lambda: [one_group(0)]
    )
    subset = tasks[:compare_tasks]
    cached = _measure(lambda: [runner(policy, subset, key_run)], repeats)
    reencode_policy = SamplerPolicy(model, token_map=token_map, reuse_cache=False)
    reencoded = _measure(lambda: [runner(reencode_policy, subset, key_run)], repeats)

    # first-turn prefill of one group: G copies of one first prompt
    first, _ = runner._first_prompt(budget, render(np.asarray(env.maps[0]), 0))
    group = [first] * group_size
    prefill_shared = _start_seconds(policy, group, runner.settings, repeats)
    prefill_unshared = _start_seconds(
        SamplerPolicy(model, token_map=token_map, share_prefixes=False),
        group,
        runner.settings,
        repeats,
    )

    # decode step at a quarter-filled and a full 4,096-token cache (room left for the tokens)
    decode_model = tiny_policy_model(1000, seed)
    quarter, whole = decode_len // 4, decode_len - DECODE_STEPS
    decode = {
        (name, fill): decode_step_ms(
            decode_model, paging, decode_rows, fill, max(repeats, 5), decode_len
        )
        for name, paging in (("paged", Paging()), ("static", None))
        for fill in (quarter, whole)
    }

    stats = batched.result.stats
    shares = {
        "model": stats.policy_s / stats.total_s,
        "env": stats.env_s / stats.total_s,
        "host": stats.host_s / stats.total_s,
    }
    settings = {
        "backend": jax.default_backend(),
        "tasks": num_tasks,
        "group_size": group_size,
        "budget": budget,
        "map_size": map_size,
        "max_response_tokens": max_response_tokens,
        "max_context": max_context,
        "vocab_size": len(token_map),
        **TINY_DIMS,
        "repeats": repeats,
        "statistic": "median run",
    }
    full = {
        **settings,
        "rows": num_tasks * group_size,
        "turns": stats.turns,
        "turns_played": batched.turns,
        "sampled_tokens": batched.tokens,
        "live_rows_per_turn": list(stats.live_rows),
        "time_share": shares,
        "seconds": {
            "model": stats.policy_s,
            "env": stats.env_s,
            "host": stats.host_s,
            "total": stats.total_s,
            "baseline_total": per_group.seconds,
        },
        "success_rate": float(np.mean(np.asarray(batched.result.trajectory.success))),
        "compilations": compilations,
    }
    label = (
        f"rollout FrozenLake {map_size}x{map_size}, {num_tasks} tasks x G={group_size}, "
        f"B={budget}, tiny random Qwen3 (time: model {shares['model']:.0%}, env "
        f"{shares['env']:.0%}, host {shares['host']:.0%})"
    )
    small = {
        **settings,
        "rows": compare_tasks * group_size,
        "tasks": compare_tasks,
        "seconds": {"ours": cached.seconds, "baseline": reencoded.seconds},
    }
    prefill = {
        **settings,
        "rows": group_size,
        "tasks": 1,
        "prompt_tokens": len(first),
        "seconds": {"ours": prefill_shared, "baseline": prefill_unshared},
    }
    paging = Paging()
    paged_settings = {
        **settings,
        "rows": num_tasks * group_size,
        "paging": dataclasses.asdict(paging),
        "keys_read_vs_static": keys_read_ratio(
            batched.result.trajectory, max_context, paging.page_size * paging.block_pages
        ),
        "same_tokens_as_static": same_rollout["paged"],
        "seconds": {"ours": paged.seconds, "baseline": batched.seconds},
    }
    seated_settings = {
        **paged_settings,
        "seats": seats,
        "same_tokens_as_static": same_rollout["continuous"],
        "seconds": {"ours": seated.seconds, "baseline": batched.seconds},
    }
    decode_settings = {
        "backend": jax.default_backend(),
        "rows": decode_rows,
        "cache_tokens": decode_len,
        "filled": {"quarter": quarter, "full": whole},
        "decode_tokens": DECODE_STEPS,
        "vocab_size": 1000,
        **TINY_DIMS,
        "paging": dataclasses.asdict(Paging()),
        "ms_per_step": {
            f"{name} {'quarter' if fill == quarter else 'full'}": ms
            for (name, fill), ms in decode.items()
        },
        "statistic": "median of 5 decodes",
    }
    one_lane = lanes[1].result.stats
    overlap_settings = {
        **settings,
        "rows": overlap_tasks * group_size,
        "tasks": overlap_tasks,
        "step_ms_per_row": step_ms,
        "step_workers": 8,
        "paging": dataclasses.asdict(Paging()),
        "env_share_one_lane": one_lane.env_s / one_lane.total_s,
        "same_tokens_as_one_lane": bool(
            np.array_equal(
                np.asarray(lanes[2].result.trajectory.tokens),
                np.asarray(lanes[1].result.trajectory.tokens),
            )
        ),
        "seconds": {
            "ours": lanes[2].seconds,
            "baseline": lanes[1].seconds,
            "env_steps_ours": lanes[2].result.stats.env_step_s,
            "env_waited_ours": lanes[2].result.stats.env_s,
        },
    }
    return [
        BenchResult(
            label,
            "turns/s",
            batched.turns / batched.seconds,
            per_group.turns / per_group.seconds,
            PER_GROUP,
            full,
        ),
        BenchResult(
            label,
            "tokens/s",
            batched.tokens / batched.seconds,
            per_group.tokens / per_group.seconds,
            PER_GROUP,
            full,
        ),
        BenchResult(
            f"rollout FrozenLake {map_size}x{map_size}, {num_tasks} tasks x G={group_size}, "
            f"B={budget}, paged engine",
            "turns/s",
            paged.turns / paged.seconds,
            batched.turns / batched.seconds,
            STATIC,
            paged_settings,
        ),
        BenchResult(
            f"rollout FrozenLake {map_size}x{map_size}, {num_tasks} tasks x G={group_size}, "
            f"B={budget}, paged engine, continuous batching in {seats} seats",
            "turns/s",
            seated.turns / seated.seconds,
            batched.turns / batched.seconds,
            STATIC,
            seated_settings,
        ),
        BenchResult(
            f"decode step, paged engine, {decode_rows} rows of {decode_len} tokens a "
            "quarter filled",
            "ms",
            decode[("paged", quarter)],
            decode[("paged", whole)],
            FULL_CACHE,
            decode_settings,
        ),
        BenchResult(
            f"rollout FrozenLake {map_size}x{map_size}, {compare_tasks} tasks x "
            f"G={group_size}, B={budget}, KV cache continued",
            "turns/s",
            cached.turns / cached.seconds,
            reencoded.turns / reencoded.seconds,
            REENCODE,
            small,
        ),
        BenchResult(
            f"first-turn prefill of one group, G={group_size} rows, {len(first)}-token shared "
            "prompt, prefix shared",
            "prefills/s",
            1 / prefill_shared,
            1 / prefill_unshared,
            UNSHARED,
            prefill,
        ),
        BenchResult(
            f"rollout FrozenLake {map_size}x{map_size}, {overlap_tasks} tasks x "
            f"G={group_size}, B={budget}, environment steps of {step_ms:g} ms per row "
            "(8 workers) overlapping decoding in 2 lanes",
            "turns/s",
            lanes[2].turns / lanes[2].seconds,
            lanes[1].turns / lanes[1].seconds,
            ONE_LANE,
            overlap_settings,
        ),
    ]
