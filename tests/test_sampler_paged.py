"""The sampler over a paged KV cache: the same tokens as the static-cache sampler (the
reference) and as transformers' generate, log-probs equal to teacher forcing, a pool that runs
out stops rows cleanly, released rows refill, and nothing recompiles per turn or per refill."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from compile_counter import count_backend_compiles
from hf_qwen3 import hf_greedy
from test_sampler import conversation_inputs, random_rows, run_conversation, tiny  # noqa: F401

from agentrl_jax.sampling import Paging, Sampler, SamplingConfig, StopReason, pad_rows

GREEDY = SamplingConfig(temperature=0)
PAGING = Paging(page_size=4, block_pages=2)


def test_greedy_equals_transformers_generate_and_the_static_sampler(tiny):
    hf, model, params = tiny
    rows = random_rows(np.random.default_rng(0), (7, 2, 11, 5))
    tokens, mask = pad_rows(rows, 11)
    new = 16
    expected = hf_greedy(hf, tokens, mask, new)
    outs = {}
    for name, paging in (("static", None), ("paged", PAGING)):
        sampler = Sampler(model, max_new_tokens=new, stop_token_ids=(), paging=paging)
        state = sampler.append(params, sampler.init(4, 11 + new), tokens, mask)
        _, outs[name] = sampler.decode(params, state, jax.random.key(0), GREEDY)
    np.testing.assert_array_equal(outs["paged"].tokens, expected)
    np.testing.assert_array_equal(outs["paged"].tokens, outs["static"].tokens)
    np.testing.assert_allclose(outs["paged"].log_probs, outs["static"].log_probs, atol=1e-5)


def test_multi_turn_sampling_equals_the_static_sampler_token_for_token(tiny):
    """Four turns at temperature 0.8 / top-p / top-k with the same per-turn keys: the paged
    engine draws the same tokens, with the same log-probs (to 1e-5), as the reference."""
    _, model, params = tiny
    sampling = SamplingConfig(temperature=0.8, top_p=0.9, top_k=60)
    prompts, observations, budgets = conversation_inputs(1, batch=3, turns=4)
    keys = jax.random.split(jax.random.key(5), 4)
    results = {}
    for name, paging in (("static", None), ("paged", PAGING)):
        sampler = Sampler(model, max_new_tokens=8, stop_token_ids=(7, 11), paging=paging)
        results[name] = run_conversation(
            sampler, params, prompts, observations, budgets, keys, sampling, max_len=96
        )
    (static_history, static_out), (paged_history, paged_out) = results["static"], results["paged"]
    assert paged_history == static_history
    assert sum(int(o.lengths.sum()) for o in paged_out) >= 30
    for ours, theirs in zip(paged_out, static_out):
        np.testing.assert_array_equal(ours.tokens, theirs.tokens)
        np.testing.assert_allclose(ours.log_probs, theirs.log_probs, atol=1e-5, rtol=0)
        np.testing.assert_allclose(ours.sampling_log_probs, theirs.sampling_log_probs, atol=1e-5)


def test_a_pool_that_runs_out_stops_rows_for_want_of_a_page_and_spares_the_others(tiny):
    _, model, params = tiny
    # 3 rows of up to 24 tokens but 9 pages of 4 tokens (36 tokens) between them
    sampler = Sampler(
        model,
        max_new_tokens=16,
        stop_token_ids=(),
        paging=Paging(page_size=4, num_pages=9, block_pages=2),
    )
    reference = Sampler(model, max_new_tokens=16, stop_token_ids=())
    rows = [[1] * 8, [2] * 8, [3] * 4]  # 2 + 2 + 1 pages
    state = sampler.append(params, sampler.init(3, 24), *pad_rows(rows, 8))
    assert int(state.cache.pages_used) == 5
    state, out = sampler.decode(params, state, jax.random.key(0), GREEDY, budget=[16, 2, 16])
    ref_state = reference.append(params, reference.init(3, 24), *pad_rows(rows, 8))
    _, ref = reference.decode(params, ref_state, jax.random.key(0), GREEDY, budget=[16, 2, 16])
    # 4 pages free; rows take them in row order as they cross page boundaries: the first
    # token of each row takes one (1 left), row 0 takes the last at 12 tokens, so row 2 stops
    # at 8 (4 sampled) and row 0 at 16 (8 sampled); row 1 spends its budget of 2
    lengths = np.asarray(out.lengths)
    assert lengths.tolist() == [8, 2, 4]
    assert out.stop_reason.tolist() == [StopReason.NO_PAGE, StopReason.BUDGET, StopReason.NO_PAGE]
    assert int(state.cache.pages_used) == 9
    assert np.asarray(state.overflowed).tolist() == [True, False, True]
    for b in range(3):  # what was sampled is what the unbounded reference samples
        np.testing.assert_array_equal(out.tokens[b, : lengths[b]], ref.tokens[b, : lengths[b]])
    # releasing row 0 lets row 1 grow again
    state = sampler.release(state, [True, False, False])
    assert int(state.cache.pages_used) == 9 - 4
    state, out = sampler.decode(params, state, jax.random.key(1), GREEDY, budget=[16, 6, 16])
    assert int(out.lengths[1]) == 6 and int(out.stop_reason[0]) == StopReason.NOT_RUN
    assert int(state.lengths[1]) == 16


def test_released_rows_refill_and_nothing_recompiles_per_turn_or_refill(tiny):
    """A rollout in which finished rows are released and new prompts take their slots (the
    continuous-batching pattern): each refilled row samples what a fresh sampler samples for
    its prompt alone, and a second such rollout compiles nothing."""
    _, model, params = tiny
    sampler = Sampler(model, max_new_tokens=6, stop_token_ids=(), paging=PAGING)
    fresh = Sampler(model, max_new_tokens=6, stop_token_ids=(), paging=PAGING)
    rng = np.random.default_rng(3)
    keys = list(jax.random.split(jax.random.key(0), 20))
    with count_backend_compiles() as compiles:
        per_rollout = []
        for rollout in range(2):
            before = len(compiles)
            state = sampler.init(4, 64)
            state = sampler.append(params, state, *pad_rows(random_rows(rng, [5, 9, 3, 7]), (16,)))
            for turn in range(6):
                state, out = sampler.decode(params, state, keys[10 * rollout + turn], GREEDY)
                done = np.zeros(4, bool)
                done[turn % 4] = True  # one row's episode ends each turn
                state = sampler.release(state, done)
                prompt = random_rows(rng, [int(rng.integers(2, 12))])[0]
                chunk = [prompt if d else [] for d in done]
                state = sampler.append(params, state, *pad_rows(chunk, (16,)))
                if rollout == 0 and turn == 2:  # the refilled row equals a fresh one
                    key = keys[10 * rollout + turn + 1]
                    _, refilled = sampler.decode(params, jax.tree.map(np.copy, state), key, GREEDY)
                    alone = fresh.append(params, fresh.init(4, 64), *pad_rows(chunk, (16,)))
                    _, alone = fresh.decode(params, alone, key, GREEDY, active=done)
                    np.testing.assert_array_equal(refilled.tokens[done], alone.tokens[done])
            jax.block_until_ready(state)
            per_rollout.append(len(compiles) - before)
    assert per_rollout[1] == 0, per_rollout
    assert sampler.trace_counts == {"init": 1, "decode": 1, "append": 1, "release": 1}


def test_copies_the_pool_cannot_hold_are_flagged_overflowed_not_silently_empty(tiny):
    from agentrl_jax.sampling.scheduler import take_rows

    _, model, params = tiny
    sampler = Sampler(
        model,
        max_new_tokens=4,
        stop_token_ids=(),
        paging=Paging(page_size=4, num_pages=6, block_pages=2),
    )
    state = sampler.append(params, sampler.init(2, 16), *pad_rows([[1] * 6, [2] * 3], 6))
    out = take_rows(state, jax.numpy.array([0, 0, 0, 1, -1]))  # 2 pages per copy of row 0
    # pages: row 0 holds 2, row 1 holds 1, 3 free: the 1st copy fits, the 2nd does not
    assert np.asarray(out.lengths).tolist() == [6, 6, 0, 3, 0]
    assert np.asarray(out.overflowed).tolist() == [False, False, True, False, False]


def test_append_rows_and_copy_rows_work_on_part_of_the_batch(tiny):
    """Seating new rows mid-rollout: ``append_rows`` prefills rows 1 and 3 only (a padding
    entry writes nothing), ``copy_rows`` copies row 1 into the empty row 2; then every row
    decodes what a batch prefilled in one ``append`` decodes, and rows 0 and 4 never changed."""
    _, model, params = tiny
    sampler = Sampler(model, max_new_tokens=6, stop_token_ids=(), paging=PAGING)
    rng = np.random.default_rng(9)
    first = random_rows(rng, [5, 0, 0, 0, 7])
    new = random_rows(rng, [9, 4])
    state = sampler.append(params, sampler.init(5, 48), *pad_rows(first, (16,)))
    before = np.asarray(state.cache.page_table)[[0, 4]].copy()
    tokens, mask = pad_rows(new + [[]], (16,))
    state = sampler.append_rows(params, state, [1, 3, -1], tokens, mask)
    state = sampler.copy_rows(state, [2, -1], [1, 0])
    assert np.asarray(state.lengths).tolist() == [5, 9, 9, 4, 7]
    np.testing.assert_array_equal(np.asarray(state.cache.page_table)[[0, 4]], before)
    key = jax.random.key(3)
    _, ours = sampler.decode(params, state, key, GREEDY)
    reference = Sampler(model, max_new_tokens=6, stop_token_ids=())
    full = [first[0], new[0], new[0], new[1], first[4]]
    ref_state = reference.append(params, reference.init(5, 48), *pad_rows(full, (16,)))
    _, theirs = reference.decode(params, ref_state, key, GREEDY)
    np.testing.assert_array_equal(ours.tokens, theirs.tokens)
    np.testing.assert_allclose(ours.log_probs, theirs.log_probs, atol=1e-5)


@pytest.mark.parametrize("paging", [None, PAGING], ids=["static", "paged"])
def test_restart_after_compaction_regrows_the_cache_and_keeps_the_other_rows(tiny, paging):
    """``SamplerPolicy.restart`` when the cache was compacted below the rows it must seat: the
    cache grows back (kept rows keep their caches), the restarted rows sample what a fresh
    policy samples for their contexts, and the row that played on samples what it would have."""
    from agentrl_jax.sampling import PolicySettings, SamplerPolicy

    _, model, _ = tiny
    settings = PolicySettings(
        max_context=64, max_response_tokens=5, stop_token_ids=(), sampling=GREEDY
    )
    rng = np.random.default_rng(4)
    contexts = random_rows(rng, [6, 3, 8, 5])
    new = random_rows(rng, [0, 7, 4, 0])
    keys = jax.random.split(jax.random.key(1), 4)
    budget = np.full(4, 5)
    policy = SamplerPolicy(model, min_rows=1, paging=paging, share_prefixes=False)
    policy.start(contexts, settings)
    first = policy.respond(np.array([True, False, False, False]), budget, keys)
    assert ("take_rows", 1, 4) in policy.shapes_used  # compacted to the one live row
    policy.extend([[5, 6], [], [], []])
    policy.restart(new, np.array([False, True, True, False]))
    live = np.array([True, True, True, False])
    out = policy.respond(live, budget, keys)
    assert ("take_rows", 4, 1) in policy.shapes_used  # grown back
    fresh = SamplerPolicy(model, min_rows=1, paging=paging)
    fresh.start([contexts[0] + first.tokens[0, :5].tolist() + [5, 6]] + new[1:], settings)
    expected = fresh.respond(live, budget, keys)
    np.testing.assert_array_equal(out.tokens[live], expected.tokens[live])
    np.testing.assert_array_equal(out.lengths, expected.lengths)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"page_size": 0}, "paging.page_size: must be an int >= 1, got 0"),
        ({"num_pages": -3}, "paging.num_pages: must be null or an int >= 1, got -3"),
        ({"block_pages": 2.5}, "paging.block_pages: must be an int >= 1, got 2.5"),
        ({"page_size": True}, "paging.page_size"),
    ],
)
def test_bad_paging_settings_are_rejected_with_their_names(fields, match):
    from agentrl_jax.errors import ConfigError

    with pytest.raises(ConfigError, match=match.replace(".", r"\.")):
        Paging(**fields)
