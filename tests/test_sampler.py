"""The multi-turn sampler against transformers' generate, teacher-forced forwards, and itself
re-encoding each turn afresh; plus compilation counts and the context-overflow contract."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_counter import count_backend_compiles
from flax import nnx
from hf_qwen3 import hf_greedy, save_random_hf_qwen3

from agentrl_jax.models import KVCache, load_qwen3, positions_from_mask
from agentrl_jax.sampling import Sampler, SamplingConfig, StopReason, filtered_log_probs, pad_rows

GREEDY = SamplingConfig(temperature=0)
VOCAB = 250  # hf_qwen3.TINY


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    hf = save_random_hf_qwen3(path, seed=0)
    model = load_qwen3(path)
    return hf, model, nnx.state(model)


def random_rows(rng, lengths):
    return [rng.integers(0, VOCAB, n).tolist() for n in lengths]


def first_new_token(rows, start):
    """``(row, index, id)``: the first row with an id first occurring at index >= ``start``."""
    for r, tokens in enumerate(rows):
        for i in range(start, len(tokens)):
            if tokens[i] not in tokens[:i]:
                return r, i, tokens[i]
    raise AssertionError(f"no new token after {start} in any of {rows}")


@pytest.mark.parametrize(
    "overrides",
    [{}, dict(tie_word_embeddings=True, num_attention_heads=8, num_key_value_heads=2, head_dim=8)],
    ids=["untied_kv2", "tied_kv4"],
)
def test_greedy_equals_transformers_generate_on_a_ragged_left_padded_batch(tmp_path, overrides):
    hf = save_random_hf_qwen3(tmp_path, seed=3, **overrides)
    model = load_qwen3(tmp_path)
    params = nnx.state(model)
    rows = random_rows(np.random.default_rng(0), (7, 2, 11, 5))
    tokens, mask = pad_rows(rows, 11)
    new = 16

    def transformers_greedy(eos):
        return hf_greedy(hf, tokens, mask, new, eos)

    row, where, eos = first_new_token(transformers_greedy(None).tolist(), 3)  # stops mid-way
    expected = transformers_greedy(eos)
    sampler = Sampler(model, max_new_tokens=new, stop_token_ids=(eos,))
    state = sampler.append(params, sampler.init(4, 11 + new), tokens, mask)
    _, out = sampler.decode(params, state, jax.random.key(0), GREEDY)
    got = [np.asarray(out.tokens)[b, :n].tolist() for b, n in enumerate(out.lengths)]
    assert len(got[row]) == where + 1 and got[row][-1] == eos
    assert int(out.stop_reason[row]) == StopReason.STOP_TOKEN
    for b, generated in enumerate(got):
        assert generated == expected[b, : len(generated)].tolist(), b
        if generated[-1] == eos:  # transformers pads after the stop token
            assert (expected[b, len(generated) :] == 0).all()
        else:
            assert len(generated) == new and int(out.stop_reason[b]) == StopReason.BUDGET


@pytest.mark.parametrize("unrolled", [False, True])
def test_decode_step_form_equals_the_model_forward(tiny, unrolled):
    """The decode step's form of the one forward (small-batch products, optionally unrolled
    layers from per-layer weights) equals its plain form."""
    _, model, _ = tiny
    rows = random_rows(np.random.default_rng(8), (3, 7, 5))
    tokens, mask = (jnp.asarray(x) for x in pad_rows(rows, 7))
    _, cache = model.hidden_states(
        tokens, positions_from_mask(mask), mask, KVCache.empty(model.config, 3, 12, jnp.float32)
    )
    step_tokens, write = jnp.array([4, 90, 249]), jnp.array([True, False, True])
    layers = model.split_layers() if unrolled else None
    args = (step_tokens[:, None], cache.lengths[:, None], write[:, None], cache)
    ours, our_cache = model.hidden_states(*args, few_rows=True, layers=layers)
    theirs, their_cache = model.hidden_states(*args)
    np.testing.assert_allclose(ours[write], theirs[write], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(our_cache.lengths, their_cache.lengths)
    np.testing.assert_allclose(our_cache.k, their_cache.k, atol=1e-5, rtol=0)
    np.testing.assert_allclose(our_cache.v, their_cache.v, atol=1e-5, rtol=0)
    np.testing.assert_allclose(
        model.logits(ours[:, 0], few_rows=True), model.logits(ours[:, 0]), atol=1e-5, rtol=0
    )


def run_conversation(sampler, params, prompts, observations, budgets, keys, sampling, max_len):
    """Decode with cache continuation; returns each row's full history and per-turn outputs."""
    batch = len(prompts)
    state = sampler.append(params, sampler.init(batch, max_len), *pad_rows(prompts, 16))
    history = [list(p) for p in prompts]
    outputs = []
    for turn, key in enumerate(keys):
        if turn:
            state = sampler.append(params, state, *pad_rows(observations[turn - 1], (4, 8)))
            for b in range(batch):
                history[b] += observations[turn - 1][b]
        state, out = sampler.decode(params, state, key, sampling, budget=budgets[turn])
        outputs.append(jax.tree.map(np.asarray, out))
        for b in range(batch):
            history[b] += out.tokens[b, : out.lengths[b]].tolist()
        np.testing.assert_array_equal(state.lengths, [len(h) for h in history])
    return history, outputs


def conversation_inputs(seed, batch, turns):
    rng = np.random.default_rng(seed)
    prompts = random_rows(rng, rng.integers(1, 16, batch))
    observations = [random_rows(rng, rng.integers(0, 8, batch)) for _ in range(turns - 1)]
    budgets = rng.integers(1, 9, (turns, batch))
    return prompts, observations, budgets


def test_log_probs_equal_a_teacher_forced_forward_after_continuation_turns(tiny):
    _, model, params = tiny
    sampling = SamplingConfig(temperature=0.8, top_p=0.9, top_k=60)
    prompts, observations, budgets = conversation_inputs(1, batch=3, turns=4)
    sampler = Sampler(model, max_new_tokens=8, stop_token_ids=(7, 11))
    keys = jax.random.split(jax.random.key(5), 4)
    history, outputs = run_conversation(
        sampler, params, prompts, observations, budgets, keys, sampling, max_len=96
    )
    tokens, mask = pad_rows(history, 96)
    tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
    logits, _ = model(tokens, positions_from_mask(mask), mask)
    logits = np.asarray(logits)
    compared = 0
    for b in range(3):
        offset = 96 - len(history[b])  # left padding
        cursor = len(prompts[b])
        for turn, out in enumerate(outputs):
            if turn:
                cursor += len(observations[turn - 1][b])
            for i in range(out.lengths[b]):
                row_logits = logits[b, offset + cursor - 1]  # predicts the token at `cursor`
                token = history[b][cursor]
                assert token == out.tokens[b, i]
                model_lp = row_logits[token] - np.log(np.exp(row_logits.astype(np.float64)).sum())
                np.testing.assert_allclose(out.log_probs[b, i], model_lp, atol=1e-5, rtol=0)
                sampling_lp = filtered_log_probs(jnp.asarray(row_logits[None]), sampling)[0, token]
                np.testing.assert_allclose(out.sampling_log_probs[b, i], sampling_lp, atol=1e-5)
                cursor += 1
                compared += 1
        assert cursor == len(history[b])
    assert compared >= 30
    assert any(
        (out.sampling_log_probs[out.mask] - out.log_probs[out.mask] > 0.05).any() for out in outputs
    ), "sampling and model distributions should differ here"


def test_continuation_equals_reencoding_the_history_each_turn(tiny):
    _, model, params = tiny
    turns, batch = 5, 3
    prompts, observations, budgets = conversation_inputs(2, batch, turns)
    sampler = Sampler(model, max_new_tokens=8, stop_token_ids=(7,))
    keys = jax.random.split(jax.random.key(0), turns)
    history, outputs = run_conversation(
        sampler, params, prompts, observations, budgets, keys, GREEDY, max_len=96
    )
    assert any(o.lengths[b] > 0 for o in outputs for b in range(batch))
    fresh_history = [list(p) for p in prompts]
    for turn in range(turns):
        if turn:
            for b in range(batch):
                fresh_history[b] += observations[turn - 1][b]
        fresh = sampler.append(params, sampler.init(batch, 96), *pad_rows(fresh_history, 64))
        _, out = sampler.decode(params, fresh, keys[turn], GREEDY, budget=budgets[turn])
        np.testing.assert_array_equal(out.tokens, outputs[turn].tokens, err_msg=f"turn {turn}")
        np.testing.assert_array_equal(out.lengths, outputs[turn].lengths)
        for b in range(batch):
            fresh_history[b] += np.asarray(out.tokens)[b, : out.lengths[b]].tolist()
    assert fresh_history == history


def test_ten_turn_rollout_compiles_a_fixed_small_number_of_times(tiny):
    _, model, params = tiny
    rng = np.random.default_rng(3)
    sampler = Sampler(model, max_new_tokens=6, stop_token_ids=(7,))
    sampling = SamplingConfig(temperature=1.0, top_p=0.9)
    keys = list(jax.random.split(jax.random.key(0), 20))
    widths = set()
    with count_backend_compiles() as compiles:
        per_rollout = []
        for rollout in range(2):  # a second rollout, new prompt lengths: nothing new to compile
            before = len(compiles)
            state = sampler.init(4, 160)
            tokens, mask = pad_rows(random_rows(rng, rng.integers(1, 33, 4)), (16, 32))
            widths.add(("prompt", tokens.shape[1]))
            state = sampler.append(params, state, tokens, mask)
            for turn in range(10):
                budget = rng.integers(0, 7, 4)
                state, out = sampler.decode(
                    params, state, keys[10 * rollout + turn], sampling, budget=budget
                )
                assert (np.asarray(out.lengths) <= budget).all()
                tokens, mask = pad_rows(random_rows(rng, rng.integers(0, 9, 4)), (4, 8))
                widths.add(("observation", tokens.shape[1]))
                state = sampler.append(params, state, tokens, mask)
            jax.block_until_ready(state)
            per_rollout.append(len(compiles) - before)
    assert not np.asarray(state.overflowed).any()
    distinct_widths = len({w for _, w in widths})
    assert 2 <= distinct_widths <= 4
    assert sampler.trace_counts == {"init": 1, "decode": 1, "append": distinct_widths}
    # Exactly one compiled program per traced function and shape, none for the 2nd rollout.
    assert per_rollout == [1 + 1 + distinct_widths, 0], (per_rollout, widths)


def test_rows_that_do_not_fit_are_flagged_and_never_truncated(tiny):
    _, model, params = tiny
    sampler = Sampler(model, max_new_tokens=8, stop_token_ids=())
    state = sampler.append(params, sampler.init(3, 12), *pad_rows([[1] * 4, [2] * 9, [3] * 3], 9))
    state, out = sampler.decode(params, state, jax.random.key(0), GREEDY, budget=[2, 8, 2])
    # Row 1 had 3 free slots: it samples 3 tokens, then stops for lack of room.
    np.testing.assert_array_equal(out.lengths, [2, 3, 2])
    assert out.stop_reason.tolist() == [
        StopReason.BUDGET,
        StopReason.CONTEXT_FULL,
        StopReason.BUDGET,
    ]
    np.testing.assert_array_equal(state.lengths, [6, 12, 5])
    np.testing.assert_array_equal(state.overflowed, [False, True, False])
    # Row 0 has room for 6 more tokens, row 2 only for 7: a 7-token observation fits row 2 only.
    cache_k = np.asarray(state.cache.k).copy()
    state = sampler.append(params, state, *pad_rows([[5] * 7, [5] * 7, [5] * 7], 8))
    np.testing.assert_array_equal(state.lengths, [6, 12, 12])
    np.testing.assert_array_equal(state.overflowed, [True, True, False])
    np.testing.assert_array_equal(np.asarray(state.cache.k)[:, :2], cache_k[:, :2])  # untouched
    state, out = sampler.decode(params, state, jax.random.key(1), GREEDY)
    assert out.stop_reason.tolist() == [
        StopReason.NOT_RUN,
        StopReason.NOT_RUN,
        StopReason.CONTEXT_FULL,
    ]
    np.testing.assert_array_equal(out.lengths, 0)
    np.testing.assert_array_equal(state.overflowed, True)


def test_inactive_and_zero_budget_rows_write_nothing(tiny):
    _, model, params = tiny
    sampler = Sampler(model, max_new_tokens=5, stop_token_ids=())
    state = sampler.append(params, sampler.init(3, 20), *pad_rows([[1, 2], [3, 4], [5, 6]], 2))
    cache_k = np.asarray(state.cache.k).copy()
    state, out = sampler.decode(
        params,
        state,
        jax.random.key(0),
        SamplingConfig(),
        budget=[5, 0, 5],
        active=[True, True, False],
    )
    assert out.stop_reason.tolist() == [StopReason.BUDGET, StopReason.NOT_RUN, StopReason.NOT_RUN]
    np.testing.assert_array_equal(out.lengths, [5, 0, 0])
    np.testing.assert_array_equal(out.tokens[1:], 0)  # pad_token_id
    np.testing.assert_array_equal(out.log_probs[1:], 0.0)
    np.testing.assert_array_equal(state.lengths, [7, 2, 2])
    np.testing.assert_array_equal(np.asarray(state.cache.k)[:, 1:], cache_k[:, 1:])


def test_same_key_same_tokens_and_stop_tokens_end_rows(tiny):
    _, model, params = tiny
    sampler = Sampler(model, max_new_tokens=12, stop_token_ids=())
    prompt = pad_rows(random_rows(np.random.default_rng(4), (3, 6, 4, 5)), 6)
    sampling = SamplingConfig(temperature=1.0, top_p=0.95)

    def run(key, sampler=sampler):
        state = sampler.append(params, sampler.init(4, 32), *prompt)
        return sampler.decode(params, state, key, sampling)

    (_, a), (_, b), (_, c) = run(jax.random.key(9)), run(jax.random.key(9)), run(jax.random.key(10))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert (np.asarray(a.tokens) != np.asarray(c.tokens)).any()
    # Caller-given stop ids: the same draws, cut just after each row's first stop token.
    row, where, stop = first_new_token(np.asarray(a.tokens).tolist(), 2)
    stopping = Sampler(model, max_new_tokens=12, stop_token_ids=(stop, VOCAB - 1))
    state, d = run(jax.random.key(9), stopping)
    kept = np.asarray(a.tokens)[row, : where + 1].tolist()
    assert np.asarray(d.tokens)[row, : d.lengths[row]].tolist() == kept
    assert int(d.stop_reason[row]) == StopReason.STOP_TOKEN
    prompt_length = int(prompt[1][row].sum())
    assert int(state.lengths[row]) == prompt_length + where + 1  # the stop token is cached too


def test_bad_shapes_are_rejected_with_their_names(tiny):
    _, model, params = tiny
    sampler = Sampler(model, max_new_tokens=4)
    state = sampler.init(2, 8)
    with pytest.raises(ValueError, match=r"append: tokens \(3, 4\)"):
        sampler.append(params, state, np.zeros((3, 4), int), np.ones((3, 4), bool))
    with pytest.raises(ValueError, match="budget"):
        sampler.decode(params, state, jax.random.key(0), GREEDY, budget=[1, 2, 3])
    with pytest.raises(ValueError, match="stop token id 999"):
        Sampler(model, max_new_tokens=4, stop_token_ids=(999,))


# ---------------------------------------------------------------------------- memory options
def test_chunked_prefill_equals_one_wide_append(tiny):
    """An append wider than ``prefill_chunk`` (here 45 columns in chunks of 8, the last one
    padded) after cached tokens equals one wide append: cache, lengths, hidden state and
    overflow flags (a row whose chunk does not fit gets none of it), and the decoded tokens."""
    _, model, params = tiny
    rng = np.random.default_rng(11)
    prompts = pad_rows(random_rows(rng, (5, 1, 9, 3)), 16)
    # real tokens anywhere in the row (the append is compact), row 3 too long for its room
    mask = rng.random((4, 45)) < 0.6
    mask[3] = True
    chunk = (rng.integers(0, VOCAB, (4, 45)).astype(np.int32), mask)
    results = []
    for prefill_chunk in (None, 8):
        sampler = Sampler(model, max_new_tokens=6, stop_token_ids=(), prefill_chunk=prefill_chunk)
        state = sampler.append(params, sampler.init(4, 46), *prompts)
        state = sampler.append(params, state, *chunk)
        snapshot = jax.tree.map(lambda x: np.asarray(x).copy(), state)
        _, out = sampler.decode(params, state, jax.random.key(5), SamplingConfig(temperature=1.0))
        results.append((snapshot, jax.tree.map(np.asarray, out)))
    (wide, wide_out), (chunked, chunked_out) = results
    np.testing.assert_array_equal(chunked.lengths, wide.lengths)
    np.testing.assert_array_equal(chunked.overflowed, wide.overflowed)
    expected = prompts[1].sum(1) + mask.sum(1) > 46
    assert expected.tolist() == [False, False, False, True]
    np.testing.assert_array_equal(wide.overflowed, expected)
    # float32 rounding only: the projections run on [4, 8]- instead of [4, 45]-token blocks
    for got, want in (
        (chunked.cache.k, wide.cache.k),
        (chunked.cache.v, wide.cache.v),
        (chunked.hidden, wide.hidden),
    ):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(chunked_out.tokens, wide_out.tokens)
    np.testing.assert_allclose(chunked_out.log_probs, wide_out.log_probs, atol=1e-5, rtol=0)


def test_a_bfloat16_cache_for_a_float32_model(tiny):
    """The cache's dtype is the caller's; the pending hidden state stays in the compute dtype,
    and the log-probs stay close to those of a float32 cache."""
    _, model, params = tiny
    prompts = pad_rows(random_rows(np.random.default_rng(2), (4, 7, 2)), 8)
    sampler = Sampler(model, max_new_tokens=5, stop_token_ids=())
    outs = []
    for dtype in (None, jnp.bfloat16):
        state = sampler.append(params, sampler.init(3, 16, dtype), *prompts)
        assert state.cache.k.dtype == (dtype or jnp.float32) and state.hidden.dtype == jnp.float32
        state, out = sampler.decode(params, state, jax.random.key(1), GREEDY)
        outs.append(out)
        assert state.cache.v.dtype == (dtype or jnp.float32)
    np.testing.assert_array_equal(outs[0].lengths, 5)
    # greedy tokens agree until the first disagreement; there the log-probs are bf16-close
    np.testing.assert_allclose(outs[1].log_probs[:, 0], outs[0].log_probs[:, 0], atol=5e-2)
    assert sampler.trace_counts["init"] == 2  # one program per cache dtype


def test_per_row_keys_make_a_rows_tokens_independent_of_its_batch(tiny):
    """With one key per row a row's tokens depend only on its key and context: the same rows
    in another order, or alone, sample the same tokens (top-p and plain sampling)."""
    _, model, params = tiny
    rows = random_rows(np.random.default_rng(6), (3, 8, 5, 2))
    keys = jax.random.split(jax.random.key(4), 4)
    for sampling in (SamplingConfig(temperature=1.0), SamplingConfig(temperature=1.0, top_p=0.9)):
        sampler = Sampler(model, max_new_tokens=8, stop_token_ids=())

        def run(order):
            state = sampler.append(
                params, sampler.init(len(order), 24), *pad_rows([rows[i] for i in order], 8)
            )
            _, out = sampler.decode(params, state, keys[np.asarray(order)], sampling)
            return np.asarray(out.tokens)

        whole = run([0, 1, 2, 3])
        np.testing.assert_array_equal(run([2, 0, 3, 1]), whole[[2, 0, 3, 1]])
        np.testing.assert_array_equal(run([1, 3]), whole[[1, 3]])
        # the same keys as raw uint32 data give the same draws
        state = sampler.append(params, sampler.init(4, 24), *pad_rows(rows, 8))
        _, raw = sampler.decode(params, state, np.asarray(jax.random.key_data(keys)), sampling)
        np.testing.assert_array_equal(np.asarray(raw.tokens), whole)
        assert len(set(map(tuple, whole.tolist()))) == 4
