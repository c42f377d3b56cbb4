"""Logit filters against a plain NumPy (float64, full sort) reference of transformers' order:
valid-vocab mask, temperature, top-k, top-p."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax.sampling import filters
from agentrl_jax.sampling.filters import SamplingConfig


def reference_probs(
    logits: np.ndarray,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    valid_vocab_size: int | None = None,
) -> np.ndarray:
    """The sampling distribution ``[B, V]``, one row at a time, by a full stable sort."""
    out = np.zeros(logits.shape)
    for b, row in enumerate(logits.astype(np.float64)):
        row = row.copy()
        if valid_vocab_size is not None:
            row[valid_vocab_size:] = -np.inf
        row /= temperature
        order = np.argsort(-row, kind="stable")  # ties: lower id first
        keep = np.isfinite(row[order])
        if top_k:
            keep[top_k:] = False
        probs = np.where(keep, np.exp(row[order] - row[order][0]), 0.0)
        probs /= probs.sum()
        if top_p < 1:
            before = np.concatenate([[0.0], np.cumsum(probs)[:-1]])
            probs = np.where(before < top_p, probs, 0.0)
            probs /= probs.sum()
        out[b, order] = probs
    return out


def nucleus_size(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """How many tokens each row's nucleus holds (reference, no top-k)."""
    return (reference_probs(logits, temperature, top_p=top_p) > 0).sum(axis=1)


def random_logits(seed: int, batch: int, vocab: int, scale: float) -> np.ndarray:
    return (scale * np.random.default_rng(seed).standard_normal((batch, vocab))).astype(np.float32)


CONFIGS = [
    dict(temperature=1.0),
    dict(temperature=0.6, top_p=0.9),
    dict(temperature=1.0, top_p=0.5, valid_vocab_size=280),
    dict(temperature=1.3, top_k=20),
    dict(temperature=0.8, top_k=40, top_p=0.7),
    dict(temperature=1.0, top_k=500),  # top_k larger than the vocabulary
]


@pytest.mark.parametrize("kwargs", CONFIGS, ids=[str(c) for c in CONFIGS])
def test_filtered_distribution_matches_numpy_reference(kwargs):
    logits = random_logits(0, batch=6, vocab=300, scale=3.0)
    ours = np.exp(
        np.asarray(filters.filtered_log_probs(jnp.asarray(logits), SamplingConfig(**kwargs)))
    )
    expected = reference_probs(logits, **kwargs)
    np.testing.assert_array_equal(ours > 0, expected > 0)  # the same kept set
    np.testing.assert_allclose(ours, expected, atol=2e-6, rtol=0)
    assert 1 < (expected > 0).sum(1).min(), "degenerate case: only one token kept"


def test_top_p_prefilter_stages_are_exact_whichever_one_the_batch_needs():
    # Nucleus sizes 2, 2, 349 (nearly flat), 2, 30, 56.
    scales = np.array([8.0, 8.0, 0.15, 8.0, 3.0, 2.5], np.float32)[:, None]
    logits = random_logits(1, batch=6, vocab=400, scale=1.0) * scales
    config = SamplingConfig(temperature=1.0, top_p=0.9, first_prefilter_k=8, prefilter_k=32)
    sizes = nucleus_size(logits, 1.0, 0.9)
    for k in (8, 32):
        fits = np.asarray(filters.nucleus_fits_prefilter(jnp.asarray(logits), config, k=k))
        np.testing.assert_array_equal(fits, sizes <= k)
    np.testing.assert_array_equal(
        filters.nucleus_fits_prefilter(jnp.asarray(logits), config), sizes <= 32
    )
    assert sizes.tolist() == [2, 2, 349, 2, 30, 56]
    distribution = jax.jit(filters.filtered_log_probs, static_argnums=1)
    draw = jax.jit(filters.sample, static_argnums=2)  # one compilation for the three batches
    # Batches that the first stage, the second stage and only the whole-vocabulary search serve.
    for rows in ([0, 1, 3, 0, 1, 3], [0, 1, 3, 4, 0, 1], [0, 1, 2, 3, 4, 5]):
        ours = np.exp(np.asarray(distribution(jnp.asarray(logits[rows]), config)))
        np.testing.assert_allclose(
            ours, reference_probs(logits[rows], 1.0, top_p=0.9), atol=2e-6, rtol=0
        )
        tokens, log_probs = draw(jax.random.key(0), jnp.asarray(logits[rows]), config)
        np.testing.assert_allclose(
            np.exp(np.asarray(log_probs)), ours[np.arange(len(rows)), np.asarray(tokens)], rtol=1e-5
        )


def test_a_rows_draw_with_its_own_key_does_not_depend_on_the_other_rows():
    # Rows 0, 1, 3 fit the first prefilter, row 4 the second, row 2 (nearly flat) only the
    # whole-vocabulary search, whose candidates come in another order. Each row keeps its draws
    # in every batch: a finished row's or a neighbour's flat distribution once switched the
    # whole batch to the other order, and so changed every row's token for the same key (the
    # paged engine zeroes finished rows, the static one keeps them: different tokens).
    scales = np.array([8.0, 8.0, 0.15, 8.0, 3.0, 2.5], np.float32)[:, None]
    logits = random_logits(1, batch=6, vocab=400, scale=1.0) * scales
    config = SamplingConfig(temperature=1.0, top_p=0.9, first_prefilter_k=8, prefilter_k=32)
    draw = jax.jit(filters.sample, static_argnums=2)
    for seed in range(20):
        keys = jax.random.split(jax.random.key(seed), 6)
        alone = [
            np.asarray(draw(keys[r : r + 1], jnp.asarray(logits[r : r + 1]), config)[0])[0]
            for r in range(6)
        ]
        for rows in ([0, 1, 3, 4], [0, 1, 2, 3, 4, 5], [2, 0, 4]):
            tokens, _ = draw(keys[np.array(rows)], jnp.asarray(logits[rows]), config)
            assert np.asarray(tokens).tolist() == [alone[r] for r in rows], (seed, rows)


def test_prefilter_stages_are_ascending_and_capped_by_the_vocabulary():
    config = SamplingConfig(top_p=0.9, first_prefilter_k=32, prefilter_k=256)
    assert config.prefilter_stages(151_936) == (32, 256)
    assert config.prefilter_stages(100) == (32, 100)
    assert config.prefilter_stages(20) == (20,)
    assert SamplingConfig(top_p=0.9, first_prefilter_k=300).prefilter_stages(1000) == (256,)
    assert SamplingConfig(top_p=0.9, prefilter_k=4).prefilter_stages(1000) == (4,)


@pytest.mark.parametrize(
    "vocab, k", [(300, 7), (1187 * 128, 1), (1187 * 128, 32), (1187 * 128, 256), (64 * 64, 16)]
)
def test_top_k_equals_a_stable_sort_with_ties(vocab, k):
    logits = np.round(random_logits(8, batch=5, vocab=vocab, scale=2.0), 1)  # many ties
    logits[1] = 0.5  # all tied: ids 0..k-1
    logits[2] = -np.inf
    logits[2, [vocab - 1, 3, vocab // 2]] = 7.0  # tied maxima in far-apart blocks
    values, ids = filters.top_k(jnp.asarray(logits), k)
    order = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(np.asarray(ids), order)
    np.testing.assert_array_equal(np.asarray(values), np.take_along_axis(logits, order, axis=1))
    assert np.asarray(ids).dtype == np.int32


@pytest.mark.parametrize("scale, top_p", [(0.05, 0.9), (1.0, 0.5), (4.0, 0.99), (2.0, 1e-3)])
def test_threshold_nucleus_equals_the_sorted_definition(scale, top_p):
    logits = random_logits(6, batch=5, vocab=3000, scale=scale)
    logits[1, ::2] *= -1e4  # huge negative logits: the bisection spans negative floats too
    keep = np.asarray(filters.nucleus_by_threshold(jnp.asarray(logits), top_p))
    np.testing.assert_array_equal(keep, reference_probs(logits, 1.0, top_p=top_p) > 0)


def test_threshold_nucleus_keeps_every_token_tied_at_the_boundary():
    logits = np.full((1, 40), -5.0, np.float32)
    logits[0, [3, 9, 20, 31]] = 2.0  # four equal tokens, ~24% of the mass each
    keep = np.asarray(filters.nucleus_by_threshold(jnp.asarray(logits), 0.5))[0]
    assert np.flatnonzero(keep).tolist() == [3, 9, 20, 31]  # sorted by id: only 3, 9, 20
    assert np.flatnonzero(reference_probs(logits, 1.0, top_p=0.5)[0]).tolist() == [3, 9, 20]


@pytest.mark.parametrize("vocab", [300, 1024, 1187 * 128])
def test_two_level_argmax_equals_jnp_argmax_with_ties(vocab):
    logits = np.round(random_logits(7, batch=6, vocab=vocab, scale=2.0), 1)  # many ties
    logits[1] = -np.inf
    logits[2, [5, vocab - 1]] = 50.0  # a tie for the maximum across blocks: first wins
    ours = np.asarray(filters.argmax(jnp.asarray(logits)))
    np.testing.assert_array_equal(ours, np.argmax(logits, axis=1))
    assert ours[2] == 5


def test_greedy_is_argmax_over_the_valid_vocabulary():
    logits = random_logits(2, batch=5, vocab=50, scale=1.0)
    logits[:, 45:] += 100.0  # padding rows of the embedding: largest logits, never produced
    config = SamplingConfig(temperature=0, valid_vocab_size=45)
    tokens, log_probs = filters.sample(jax.random.key(0), jnp.asarray(logits), config)
    np.testing.assert_array_equal(tokens, logits[:, :45].argmax(1))
    np.testing.assert_array_equal(log_probs, 0.0)
    dist = np.asarray(filters.filtered_log_probs(jnp.asarray(logits), config))
    np.testing.assert_array_equal(np.argmax(dist, 1), tokens)
    assert (np.isfinite(dist).sum(1) == 1).all()


@pytest.mark.parametrize(
    "kwargs",
    [dict(temperature=1.0), dict(temperature=0.7, top_p=0.8), dict(temperature=1.0, top_k=5)],
)
def test_sample_frequencies_follow_the_filtered_distribution(kwargs):
    vocab, draws = 600, 40_000  # vocab > 256: the two-level inverse CDF spans several blocks
    rng = np.random.default_rng(3)
    base = np.full(vocab, -30.0, np.float32)
    base[rng.choice(vocab, 12, replace=False)] = rng.normal(size=12) * 1.5
    base[590:] = 5.0  # beyond valid_vocab_size: must never be drawn
    config = SamplingConfig(valid_vocab_size=590, **kwargs)
    logits = jnp.broadcast_to(jnp.asarray(base), (draws, vocab))
    tokens, log_probs = filters.sample(jax.random.key(7), logits, config)
    tokens = np.asarray(tokens)
    expected = reference_probs(base[None], valid_vocab_size=590, **kwargs)[0]
    frequencies = np.bincount(tokens, minlength=vocab) / draws
    assert set(np.flatnonzero(frequencies)) <= set(np.flatnonzero(expected))
    # 4 binomial standard deviations per token, plus a tiny allowance for float32 rounding.
    np.testing.assert_array_less(
        np.abs(frequencies - expected), 4 * np.sqrt(expected * (1 - expected) / draws) + 1e-4
    )
    # Returned log-probabilities are those of the sampling distribution at the drawn token.
    np.testing.assert_allclose(np.exp(np.asarray(log_probs)), expected[tokens], rtol=1e-5)


def test_sample_is_a_function_of_the_key():
    logits = jnp.asarray(random_logits(4, batch=16, vocab=300, scale=1.0))
    config = SamplingConfig(temperature=1.0, top_p=0.95)
    draw = jax.jit(filters.sample, static_argnums=2)
    first, _ = draw(jax.random.key(1), logits, config)
    again, _ = draw(jax.random.key(1), logits, config)
    other, _ = draw(jax.random.key(2), logits, config)
    np.testing.assert_array_equal(first, again)
    assert (np.asarray(first) != np.asarray(other)).any()


def test_model_log_probs_are_the_untruncated_log_softmax():
    logits = random_logits(5, batch=3, vocab=40, scale=2.0)
    tokens = np.array([0, 17, 39])
    ours = np.asarray(filters.model_log_probs(jnp.asarray(logits), jnp.asarray(tokens)))
    lse = np.log(np.exp(logits.astype(np.float64)).sum(1))
    np.testing.assert_allclose(ours, logits[np.arange(3), tokens] - lse, atol=1e-5)


def test_sample_categorical_never_draws_zero_weight_entries():
    weights = np.full((2000, 700), -np.inf, np.float32)
    weights[:, [3, 256, 511, 699]] = 0.0  # block edges of the two-level scan
    drawn = np.asarray(filters.sample_categorical(jax.random.key(0), jnp.asarray(weights)))
    assert set(drawn.tolist()) == {3, 256, 511, 699}


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -1.0),
        ("top_k", -2),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("prefilter_k", 0),
        ("first_prefilter_k", 0),
        ("valid_vocab_size", 0),
    ],
)
def test_config_rejects_bad_fields_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingConfig(**{field: value})
