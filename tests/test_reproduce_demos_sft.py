"""The warm start of the reproduction: the grid parser the demonstrator reads prompts with
(envs.frozenlake.text.parse_grid), the scripted Q*-greedy demonstrator with injected mistakes
(agentrl_jax.reproduce.demos) and behaviour cloning on its demonstrations
(agentrl_jax.reproduce.sft).

References: the demonstrator's moves against a float64 backward induction over gymnasium's
``FrozenLakeEnv(...).P`` (tests/eval_helpers.py), on states read from the prompts of a real
rollout with a parser of the test's own; the supervised loss against the summed token NLL of
a transformers (torch) Qwen3 holding the same weights; the batcher against row identities."""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl_jax.models import export_qwen3
from agentrl_jax.models.small_tokenizer import build_small_tokenizer
from agentrl_jax.reproduce import demos as demo_lib
from agentrl_jax.reproduce import sft
from agentrl_jax.reproduce.policy_init import random_qwen3
from agentrl_jax.reproduce.studies.frozenlake import QStarDemonstrator, frozenlake_corpus
from envs.frozenlake import grid
from envs.frozenlake import maps as fl_maps
from envs.frozenlake.text import parse_action, parse_grid, render
from envs.frozenlake.text_env import FrozenLakeTextConfig, FrozenLakeTextEnv

sys.path.insert(0, str(Path(__file__).parent))
from compile_counter import count_backend_compiles  # noqa: E402
from eval_helpers import gym_q_star, turns_in  # noqa: E402
from eval_helpers import parse_grid as reference_parse_grid  # noqa: E402
from hf_qwen3 import hf_logits, load_hf_qwen3  # noqa: E402

T_MAX = 6
MAPS = 8
SUCCESS_RATE = 0.8
DEMOS_PER_TASK = 4
MAX_CONTEXT = 384
# Two actions whose float64 success probabilities are closer than this are a tie: the
# demonstrator's float32 Q* may order them either way, so only optimality is checked there.
TIE = 1e-5
WARM_EPOCHS, WARM_BATCH = 4, 12  # 3 batches per epoch, the last 8 rows and 4 padding
BATCH_ROWS = MAPS * DEMOS_PER_TASK  # every demonstration


# ---------------------------------------------------------------- parse_grid


@st.composite
def live_grids(draw):
    """``(tiles, pos)``: any square map of tile codes, the player on a frozen or start cell."""
    n = draw(st.integers(1, 8))
    codes = draw(st.lists(st.integers(0, grid.GOAL), min_size=n * n, max_size=n * n))
    tiles = np.array(codes, np.int8).reshape(n, n)
    live = np.flatnonzero(np.isin(tiles.reshape(-1), [grid.FROZEN, grid.START]))
    if live.size == 0:
        tiles[0, 0] = grid.FROZEN
        live = np.array([0])
    return tiles, int(draw(st.sampled_from(live.tolist())))


@settings(max_examples=300, deadline=None)
@given(live_grids())
def test_parse_grid_inverts_render(case):
    tiles, pos = case
    parsed, parsed_pos = parse_grid(render(tiles, pos))
    # The start cell renders as plain ice (same dynamics), so it parses as ice.
    assert parsed.dtype == np.int8
    np.testing.assert_array_equal(parsed, np.where(tiles == grid.START, grid.FROZEN, tiles))
    assert parsed_pos == pos


@pytest.mark.parametrize(
    "text",
    [
        "",
        "P _\n_",  # not square
        "P _ _\n_ _ _",  # not square
        "P _\n_ Q",  # unknown symbol
        "_ _\n_ G",  # no player
        "P _\nP G",  # two players
        "X _\n_ G",  # player in a hole: not a live state
        "_ _\n_ W",  # player on the goal
        "P  _\n_ G",  # two spaces
        "P,_\n_,G",  # not space-separated
        "P _ \n_ G",  # trailing space
    ],
)
def test_malformed_grids_are_refused(text):
    with pytest.raises(ValueError, match="parse_grid"):
        parse_grid(text)


def test_parse_grid_ignores_surrounding_newlines():
    tiles, pos = parse_grid("\nP _\n_ G\n")
    np.testing.assert_array_equal(tiles, [[grid.FROZEN, grid.FROZEN], [grid.FROZEN, grid.GOAL]])
    assert pos == 0


# ---------------------------------------------------------------- the demonstrator


@pytest.fixture(scope="module")
def env():
    maps = fl_maps.generate(
        jax.random.key(0), MAPS, size=4, p=0.8, random_start_goal=True, split="train"
    )
    return FrozenLakeTextEnv(
        np.asarray(maps),
        FrozenLakeTextConfig(t_max=T_MAX, is_slippery=True, success_rate=SUCCESS_RATE),
    )


def test_parse_grid_reads_the_tasks_maps_at_every_live_cell(env):
    for tiles in env.maps:
        for pos in np.flatnonzero(np.isin(tiles.reshape(-1), [grid.FROZEN, grid.START])):
            parsed, parsed_pos = parse_grid(render(tiles, pos))
            assert parsed_pos == pos
            np.testing.assert_array_equal(parsed, np.where(tiles == grid.START, grid.FROZEN, tiles))


@pytest.fixture(scope="module")
def tokenizer(env):
    return build_small_tokenizer(
        frozenlake_corpus(env.instructions(), env.maps, T_MAX), vocab_size=512, split_words=False
    )


@pytest.fixture(scope="module")
def references(env):
    """``{map bytes as the prompt shows it (start = ice): Q[h, s, a]}``, float64, gamma 1:
    the probability of reaching the goal within ``h`` moves."""
    out = {}
    for tiles in env.maps:
        shown = np.where(tiles == grid.START, grid.FROZEN, tiles).astype(np.int8)
        out[shown.tobytes()] = gym_q_star(tiles, T_MAX, gamma=1.0, success_rate=SUCCESS_RATE)
    return out


def demonstrator(env, mistake_rate: float, seed: int = 0) -> QStarDemonstrator:
    return QStarDemonstrator(
        env.maps,
        T_MAX,
        is_slippery=True,
        success_rate=SUCCESS_RATE,
        mistake_rate=mistake_rate,
        seed=seed,
    )


@pytest.fixture(scope="module")
def played(env, tokenizer):
    """Greedy demonstrations of every map through the real rollout, and every
    ``(context, reply)`` the demonstrator was asked for."""
    greedy = demonstrator(env, 0.0)
    asked: list[tuple[str, str]] = []

    def script(contexts, live):
        replies = greedy(contexts, live)
        asked.extend((c, r) for c, r, on in zip(contexts, replies, live) if on)
        return replies

    calls = []
    trajectory = demo_lib.collect_demos(
        env,
        tokenizer,
        script,
        np.arange(MAPS),
        jax.random.key(1),
        demos_per_task=DEMOS_PER_TASK,
        max_response_tokens=8,
        max_context=MAX_CONTEXT,
        tasks_per_call=MAPS // 2,
        on_call=lambda: calls.append(1),
    )
    assert len(calls) == demo_lib.demo_calls(MAPS, MAPS // 2) == 2
    return trajectory, asked, greedy


def read_state(context: str, references) -> tuple[np.ndarray, int, int]:
    """``(Q[remaining, pos] float64 [4], pos, remaining)`` of the last turn of a context,
    read with the test's own parser."""
    _, _, remaining, text = turns_in(context)[-1]
    tiles, pos = reference_parse_grid(text)
    return references[tiles.tobytes()][remaining, pos], pos, remaining


def clear_best(q: np.ndarray) -> int | None:
    """The best action when it beats the runner-up by more than :data:`TIE`, else None."""
    order = np.argsort(q)[::-1]
    return int(order[0]) if q[order[0]] - q[order[1]] > TIE else None


def test_greedy_demonstrations_follow_finite_horizon_q_star(played, references, tokenizer):
    trajectory, asked, greedy = played
    assert len(asked) == greedy.moves > MAPS * DEMOS_PER_TASK and greedy.mistakes == 0
    remaining_seen, clear = set(), 0
    for context, reply in asked:
        q, _, remaining = read_state(context, references)
        action = parse_action(reply)
        assert reply == f"<answer>{grid.ACTION_NAMES[action]}</answer>"
        assert q[action] >= q.max() - TIE, (context[-80:], reply, q)
        best = clear_best(q)
        if best is not None:
            clear += 1
            assert action == best, (context[-80:], reply, q)
        remaining_seen.add(remaining)
    assert clear >= len(asked) // 3  # many states have a strictly best move: the check has teeth
    assert len(remaining_seen) >= 3  # BudgetMix budgets: several remaining horizons were shown

    # The recorded tokens are the conversation: each row's trained tokens decode to one answer
    # per turn it played, each closed by the stop token (nothing of the prompts is trained on).
    tokens, loss_mask = np.asarray(trajectory.tokens), np.asarray(trajectory.loss_mask)
    for row in range(tokens.shape[0]):
        learned = tokenizer.decode(tokens[row][loss_mask[row]].tolist(), skip_special_tokens=False)
        turns = int(np.asarray(trajectory.turns_used)[row])
        assert learned.count("<|im_end|>") == turns
        for part in learned.split("<|im_end|>")[:-1]:
            assert parse_action(part) != -1 and part.strip().startswith("<answer>")


def test_the_demonstrator_is_budget_aware_at_every_state(env, references):
    """Through ``action`` directly: every live cell of every map at every remaining budget."""
    greedy = demonstrator(env, 0.0)
    differs = 0
    for tiles in env.maps:
        shown = np.where(tiles == grid.START, grid.FROZEN, tiles)
        q = references[shown.astype(np.int8).tobytes()]
        for pos in np.flatnonzero(shown.reshape(-1) == grid.FROZEN):
            for remaining in range(1, T_MAX + 1):
                action = greedy.action(shown, int(pos), remaining)
                assert q[remaining, pos, action] >= q[remaining, pos].max() - TIE
                best = clear_best(q[remaining, pos])
                if best is not None:
                    assert action == best
                    full = clear_best(q[T_MAX, pos])
                    differs += full is not None and full != best
    # The remaining budget matters: at some states the best move with few turns left is not
    # the best with all of them (so a budget-blind demonstrator would fail this test).
    assert differs > 0
    with pytest.raises(ValueError, match="not given"):
        greedy.action(np.full((4, 4), grid.FROZEN, np.int8), 0, 1)


def test_an_always_mistaken_demonstrator_never_plays_the_greedy_move(env, played, references):
    _, asked, _ = played
    wrong = demonstrator(env, 1.0, seed=5)
    offsets = np.zeros(4, int)
    for _ in range(10):
        for context, _ in asked:
            q, _, _ = read_state(context, references)
            action = parse_action(wrong.reply(context))
            best = clear_best(q)
            if best is not None:
                assert action != best
                offsets[(action - best) % 4] += 1
    assert wrong.mistakes == wrong.moves == 10 * len(asked)
    # A mistake is a uniformly random *other* move: offsets 1, 2, 3 each about a third.
    n = offsets.sum()
    assert offsets[0] == 0 and n > 300
    assert np.all(np.abs(offsets[1:] / n - 1 / 3) < 4 * math.sqrt((1 / 3) * (2 / 3) / n)), offsets


@pytest.mark.parametrize("rate", [0.1, 0.25, 0.5])
def test_the_mistake_share_matches_the_rate(env, played, references, rate):
    _, asked, _ = played
    noisy = demonstrator(env, rate, seed=11)
    repeats, mistakes, clear = 20, 0, 0
    for _ in range(repeats):
        for context, _ in asked:
            q, _, _ = read_state(context, references)
            best = clear_best(q)
            action = parse_action(noisy.reply(context))
            if best is not None:
                clear += 1
                mistakes += action != best
    bound = 4 * math.sqrt(rate * (1 - rate) / clear)  # 4 sigma of a binomial share
    assert abs(mistakes / clear - rate) < bound, (mistakes, clear)
    moves = repeats * len(asked)
    assert noisy.moves == moves
    assert abs(noisy.mistakes / moves - rate) < 4 * math.sqrt(rate * (1 - rate) / moves)


def test_demonstrator_refuses_bad_input(env):
    with pytest.raises(ValueError, match="mistake_rate"):
        demonstrator(env, 1.5)
    with pytest.raises(ValueError, match="no turn message"):
        demonstrator(env, 0.0).reply("<|im_start|>system\nhello<|im_end|>")


# ---------------------------------------------------------------- behaviour cloning


def small_model(vocab: int, *, seed: int):
    """A 2-layer random Qwen3 made as the pipeline's setup phase makes one."""
    return random_qwen3(
        vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=1024,
        seed=seed,
    )


def batch_of_rows(trajectory, rows) -> sft.SFTBatch:
    """``rows`` of ``trajectory`` as a batch of :data:`BATCH_ROWS` rows (the rest all-zero
    padding rows), so every NLL below shares one compilation."""
    width = sft.batch_width(trajectory)

    def take(x):
        x = np.asarray(x)[rows, :width]
        return np.concatenate([x, np.zeros((BATCH_ROWS - len(x), width), x.dtype)])

    return sft.SFTBatch(
        take(trajectory.tokens), take(trajectory.token_mask), take(trajectory.loss_mask)
    )


# nll_sum jitted once for every comparison below (its graphdef is static).
nll_sum = jax.jit(sft.nll_sum, static_argnums=0)


@pytest.fixture(scope="module")
def warm_started(played, tokenizer):
    """A random policy, warm-started on the greedy demonstrations: ``(model, params,
    history, on_step calls, backend compilations during the steps after the first)``;
    ``model`` keeps its initial parameters."""
    trajectory, _, _ = played
    model = small_model(len(tokenizer), seed=0)
    calls, later_compiles = [], []
    make_sft_step = sft.make_sft_step

    def counting_step(*args, **kwargs):
        step = make_sft_step(*args, **kwargs)

        def counted(*args):
            if not calls:  # the first step compiles
                return step(*args)
            with count_backend_compiles() as compiles:
                out = step(*args)
            later_compiles.extend(compiles)
            return out

        return counted

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sft, "make_sft_step", counting_step)
        params, history = sft.warm_start(
            model,
            trajectory,
            batch_size=WARM_BATCH,
            epochs=WARM_EPOCHS,
            learning_rate=1e-2,
            weight_decay=0.01,
            seed=0,
            on_step=lambda i, r: calls.append((i, r["nll"])),
        )
    return model, params, history, calls, later_compiles


def test_nll_sum_equals_transformers_summed_token_nll(played, warm_started, tmp_path):
    """On the warm-started weights (logits far from uniform), exported as the pipeline saves a
    policy and read by transformers."""
    trajectory, _, _ = played
    model, params, *_ = warm_started
    graphdef = nnx.graphdef(model)
    export_qwen3(nnx.merge(graphdef, params), tmp_path / "policy")
    reference = load_hf_qwen3(tmp_path / "policy", dtype=torch.float32)

    rows = [0, 5, 13, 30]
    batch = batch_of_rows(trajectory, rows)  # and 28 all-zero padding rows
    total, count = nll_sum(graphdef, params, batch)

    expected, tokens_counted = 0.0, 0
    for i in range(len(rows)):
        length = int(batch.token_mask[i].sum())
        assert batch.token_mask[i, :length].all()  # a rollout row is one contiguous prefix
        ids = batch.tokens[i, :length]
        logits = torch.tensor(hf_logits(reference, ids[None]), dtype=torch.float64)[0]
        logp = (
            torch.log_softmax(logits[:-1], dim=-1)
            .gather(1, torch.tensor(ids[1:, None], dtype=torch.long))[:, 0]
            .numpy()
        )
        trained = batch.loss_mask[i, 1:length]
        assert not batch.loss_mask[i, 0] and not batch.loss_mask[i, length:].any()
        expected -= float(np.sum(logp[trained]))
        tokens_counted += int(trained.sum())
    assert int(count) == tokens_counted == int(batch.loss_mask.sum()) > 0
    assert (
        float(total) / tokens_counted < math.log(reference.config.vocab_size) - 1.0
    )  # not uniform
    # The sum over the real rows alone: the padding rows add nothing.
    assert float(total) == pytest.approx(expected, rel=2e-5)


def synthetic_record(rows: int = 23, length: int = 200, seed: int = 0):
    """A record with an id in every row's first token, prefix token masks of various lengths,
    loss tokens inside them, two padding rows (``row_mask`` False) and one real row without a
    loss token; only the attributes the batcher reads."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(20, 131, rows)
    lengths[rows // 2] = 130  # the longest row: 130 tokens
    tokens = rng.integers(1, 500, (rows, length)).astype(np.int32)
    tokens[:, 0] = 1000 + np.arange(rows)
    token_mask = np.arange(length)[None, :] < lengths[:, None]
    loss_mask = token_mask & (rng.random((rows, length)) < 0.3)
    loss_mask[:, 0] = False
    loss_mask[:, 1] = True  # every row has a loss token ...
    row_mask = np.ones(rows, bool)
    row_mask[[4, 17]] = False  # ... but two rows are padding
    loss_mask[9] = False  # ... and one has nothing to learn
    eligible = sorted(set(range(rows)) - {4, 9, 17})
    return (
        types.SimpleNamespace(
            tokens=tokens, token_mask=token_mask, loss_mask=loss_mask, row_mask=row_mask
        ),
        eligible,
        int(lengths.max()),
    )


def test_sft_batches_cover_every_row_once_per_epoch_with_fixed_shapes():
    record, eligible, longest = synthetic_record()
    batch_size, epochs = 6, 3
    width = sft.batch_width(record)
    assert width == 192 and longest == 130  # the longest row, rounded up to a multiple of 64

    batches = list(sft.sft_batches(record, batch_size, epochs, seed=7))
    assert len(batches) == sft.num_sft_steps(len(eligible), batch_size, epochs) == 12
    orders = []
    for epoch in range(epochs):
        seen = []
        for got_epoch, batch in batches[4 * epoch : 4 * (epoch + 1)]:
            assert got_epoch == epoch
            for array in (batch.tokens, batch.token_mask, batch.loss_mask):
                assert array.shape == (batch_size, width)
            for i in range(batch_size):
                if not batch.token_mask[i].any():  # padding: all three all zero
                    assert not batch.tokens[i].any() and not batch.loss_mask[i].any()
                    continue
                row = int(batch.tokens[i, 0]) - 1000
                seen.append(row)
                np.testing.assert_array_equal(batch.tokens[i], record.tokens[row, :width])
                np.testing.assert_array_equal(batch.token_mask[i], record.token_mask[row, :width])
                np.testing.assert_array_equal(batch.loss_mask[i], record.loss_mask[row, :width])
        assert sorted(seen) == eligible  # every trainable row exactly once
        orders.append(seen)
    assert orders[0] != orders[1]  # reshuffled each epoch
    # The same seed gives the same batches; another seed another order.
    again = [
        b.tokens[:, 0].tolist() for _, b in sft.sft_batches(record, batch_size, epochs, seed=7)
    ]
    assert again == [b.tokens[:, 0].tolist() for _, b in batches]
    other = [
        b.tokens[:, 0].tolist() for _, b in sft.sft_batches(record, batch_size, epochs, seed=8)
    ]
    assert other != again


def test_grouped_sft_batches_sort_by_length_and_cut_each_batch_to_its_own_width():
    """group_by_length: every row once per epoch; inside a window (here the whole epoch: 20
    rows < 16 batches of 4) the batches are consecutive runs of the rows sorted by length, so
    no two batches' length ranges interleave; each batch is as wide as its longest row rounded
    up to 64 x 2^k (at most the record's width), and the row contents are the record's."""
    record, eligible, _ = synthetic_record()
    lengths = np.asarray(record.token_mask).sum(axis=1)
    batch_size, epochs = 4, 2
    batches = list(sft.sft_batches(record, batch_size, epochs, seed=3, group_by_length=True))
    assert len(batches) == sft.num_sft_steps(len(eligible), batch_size, epochs, True) == 10
    widths, first_epoch = set(), []
    for epoch in range(epochs):
        seen, ranges = [], []
        for got_epoch, batch in batches[5 * epoch : 5 * (epoch + 1)]:
            assert got_epoch == epoch
            real = [i for i in range(batch_size) if batch.token_mask[i].any()]
            rows = [int(batch.tokens[i, 0]) - 1000 for i in real]
            longest = int(lengths[rows].max())
            width = min(next(w for w in (64, 128, 256) if w >= longest), 192)
            assert batch.tokens.shape == (batch_size, width)
            widths.add(batch.tokens.shape[1])
            for i, row in zip(real, rows):
                cols = batch.tokens.shape[1]
                np.testing.assert_array_equal(batch.tokens[i], record.tokens[row, :cols])
                np.testing.assert_array_equal(batch.loss_mask[i], record.loss_mask[row, :cols])
            seen += rows
            ranges.append((int(lengths[rows].min()), longest))
        assert sorted(seen) == eligible
        ranges.sort()
        assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))  # sorted runs, no interleaving
        first_epoch.append(seen)
    assert widths == {64, 128, 192}  # 192: the record's own width caps 256
    assert first_epoch[0] != first_epoch[1]


@pytest.mark.parametrize("rows, batch_size", [(1, 4), (64, 4), (65, 4), (200, 4), (513, 32)])
def test_num_sft_steps_counts_the_grouped_batches(rows, batch_size):
    """One partial batch per window of LENGTH_WINDOW batches, at most."""
    record = types.SimpleNamespace(
        tokens=np.arange(rows)[:, None] + np.zeros((1, 8), np.int32),
        token_mask=np.arange(8)[None, :] < (np.arange(rows) % 7 + 2)[:, None],
        row_mask=np.ones(rows, bool),
    )
    record.loss_mask = record.token_mask.copy()
    got = sum(1 for _ in sft.sft_batches(record, batch_size, 2, seed=0, group_by_length=True))
    assert got == sft.num_sft_steps(rows, batch_size, 2, group_by_length=True)


def test_batch_width_never_exceeds_the_record():
    record, _, _ = synthetic_record(length=150)
    assert sft.batch_width(record) == 150  # 130 rounded up to 192 is cut to the record


def test_warm_start_lowers_the_nll_of_the_demonstrations(played, warm_started, tokenizer):
    trajectory, _, _ = played
    model, params, history, calls, later_compiles = warm_started
    graphdef, initial = nnx.split(model)
    everything = batch_of_rows(trajectory, np.arange(BATCH_ROWS))

    def mean_nll(weights) -> float:
        total, count = nll_sum(graphdef, weights, everything)
        return float(total / count)

    before, after = mean_nll(initial), mean_nll(params)
    assert before == pytest.approx(math.log(len(tokenizer)), abs=0.3)  # random init: ~uniform
    assert after < before - 1.0, (before, after)

    rows = MAPS * DEMOS_PER_TASK
    steps = sft.num_sft_steps(rows, WARM_BATCH, WARM_EPOCHS)
    assert len(history) == steps == 12
    assert [h["step"] for h in history] == list(range(1, steps + 1)) == [i for i, _ in calls]
    assert [h["epoch"] for h in history] == [e for e in range(WARM_EPOCHS) for _ in range(3)]
    assert [h["nll"] for h in history] == [nll for _, nll in calls]
    assert history[-1]["nll"] < history[0]["nll"] - 1.0
    # The first step's NLL is the initial policy's on its batch (the loss is what is logged).
    _, first = next(sft.sft_batches(trajectory, WARM_BATCH, WARM_EPOCHS, seed=0))
    padded = sft.SFTBatch(
        *(
            np.concatenate([x, np.zeros((BATCH_ROWS - WARM_BATCH, x.shape[1]), x.dtype)])
            for x in (first.tokens, first.token_mask, first.loss_mask)
        )
    )
    total, count = nll_sum(graphdef, initial, padded)
    assert history[0]["nll"] == pytest.approx(float(total / count), rel=1e-5)
    # Fixed shapes (the last batch of an epoch is padded): the step compiled once, at step 1.
    assert later_compiles == []


def test_warm_start_refuses_demonstrations_without_a_response(played, warm_started):
    trajectory, _, _ = played
    empty = trajectory.replace(loss_mask=np.zeros_like(np.asarray(trajectory.loss_mask)))
    with pytest.raises(ValueError, match="no demonstration has a response token"):
        sft.warm_start(warm_started[0], empty, batch_size=4, epochs=1, learning_rate=1e-3)
