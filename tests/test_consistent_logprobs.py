"""Consistent log-probs: the trainer scores tokens under the distribution they were drawn from
(``TrainConfig.scoring="sampling"``), or corrects the mismatch with truncated importance
sampling (the ``policy_clip_tis`` term), and logs the sampler-trainer gap.

References: the sampler's own recorded ``sampling_log_probs`` (drawn at temperature 0.7 and
top-p 0.9 from a tiny Qwen3 whose embedding has 4 rows past the valid vocabulary), the
filters' ``filtered_log_probs`` (the distribution ``sample`` draws from), and hand-computed
values for the TIS weights and the gradient of a truncated log-softmax.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from train_fakes import tiny_model

from agentrl_jax.algorithms import (
    AlgorithmConfig,
    LossInputs,
    LossTermConfig,
    compute_loss_with_metrics,
)
from agentrl_jax.errors import ConfigError
from agentrl_jax.sampling import SamplingConfig
from agentrl_jax.sampling.filters import filtered_log_probs, scoring_logits
from agentrl_jax.sampling.jitted import Sampler
from agentrl_jax.train import RLConfig, TrainBatch, TrainConfig, init_train_state, make_train_step
from agentrl_jax.train.logprobs import head_logprobs
from agentrl_jax.train.step import prepare_batch
from agentrl_jax.trajectory import Trajectory

VOCAB, VALID = 24, 20  # ids 20..23 are embedding rows no tokenizer id maps to
SAMPLING = SamplingConfig(temperature=0.7, top_p=0.9, valid_vocab_size=VALID)
ROWS, PROMPT, NEW = 8, 5, 6


def _scoring_config(**changes) -> TrainConfig:
    rl = RLConfig(
        scoring="sampling", sampling={"temperature": SAMPLING.temperature, "top_p": SAMPLING.top_p}
    )
    return TrainConfig(rl=dataclasses.replace(rl, **changes), valid_vocab_size=VALID)


@pytest.fixture(scope="module")
def sampled():
    """A tiny Qwen3 with a padded vocabulary and a batch its Sampler drew at temperature 0.7,
    top-p 0.9: prompt, then ``NEW`` sampled tokens per row, with the sampler's records."""
    model = tiny_model(seed=3, std=0.5, vocab_size=VOCAB)
    sampler = Sampler(model, max_new_tokens=NEW, stop_token_ids=())
    params = nnx.state(model)
    prompt = np.random.default_rng(0).integers(1, VALID, (ROWS, PROMPT)).astype(np.int32)
    state = sampler.append(
        params, sampler.init(ROWS, PROMPT + NEW), prompt, np.ones_like(prompt, bool)
    )
    keys = jax.random.split(jax.random.key(7), ROWS)
    _, out = sampler.decode(params, state, keys, SAMPLING)
    out = jax.device_get(out)
    assert np.all(out.lengths == NEW) and np.all(out.tokens < VALID)
    length = PROMPT + NEW
    sampled = np.zeros((ROWS, length), bool)
    sampled[:, PROMPT:] = True

    def at_responses(values):
        full = np.zeros((ROWS, length), np.float32)
        full[:, PROMPT:] = values
        return jnp.asarray(full)

    t = Trajectory.zeros(ROWS, length, 1)
    traj = t.replace(
        tokens=jnp.asarray(np.concatenate([prompt, out.tokens], axis=1)),
        token_mask=jnp.ones((ROWS, length), bool),
        loss_mask=jnp.asarray(sampled),
        token_turn=jnp.asarray(np.where(sampled, 0, -1).astype(np.int32)),
        logprobs=at_responses(out.log_probs),
        sampling_logprobs=at_responses(out.sampling_log_probs),
        turn_mask=jnp.ones((ROWS, 1), bool),
        group_id=jnp.arange(ROWS, dtype=jnp.int32) // 4,
        success=jnp.asarray(np.arange(ROWS) % 3 == 0),
        row_mask=jnp.ones(ROWS, bool),
    )
    return model, traj


# ------------------------------------------------------------------------- the distribution


def test_scoring_logits_give_the_sampling_distribution():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(0, 2, (6, VOCAB)), jnp.float32)
    for config in (
        SAMPLING,
        SamplingConfig(temperature=1.3, top_k=5, valid_vocab_size=VALID),
        SamplingConfig(temperature=0.5),
    ):
        want = np.asarray(filtered_log_probs(logits, config))
        targets = jnp.asarray(np.argmax(want, axis=-1))  # in the support
        got = np.asarray(jax.nn.log_softmax(scoring_logits(logits, targets, config), axis=-1))
        np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], atol=1e-6)
        assert np.all(np.isneginf(got[~np.isfinite(want)]))
    with pytest.raises(ValueError, match="greedy"):
        scoring_logits(logits, targets, SamplingConfig(temperature=0.0))


def test_a_target_outside_the_nucleus_keeps_a_finite_log_prob_and_the_gradient_is_exact():
    logits = jnp.asarray([[4.0, 3.0, 0.0, -1.0, 2.0]])
    config = SamplingConfig(temperature=0.5, top_p=0.9)
    support = np.isfinite(np.asarray(filtered_log_probs(logits, config)))[0]
    target = 4  # logit 2: outside the 0.9 nucleus at temperature 0.5
    assert not support[target]

    def logp(x):
        return jax.nn.log_softmax(scoring_logits(x, jnp.asarray([target]), config), axis=-1)[
            0, target
        ]

    kept = support.copy()
    kept[target] = True
    scaled = np.asarray(logits[0]) / 0.5
    p = np.where(kept, np.exp(scaled - scaled[kept].max()), 0.0)
    p /= p.sum()
    assert np.isclose(float(logp(logits)), np.log(p[target]), atol=1e-6)
    # d log p_target / d logit_j = (1[j = target] - p_j) / T on the kept set, 0 elsewhere
    want = (np.eye(5)[target] - p) / 0.5 * kept
    np.testing.assert_allclose(np.asarray(jax.grad(logp)(logits))[0], want, atol=1e-6)


def test_entropy_is_the_sampling_distributions():
    rng = np.random.default_rng(2)
    hidden = jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.float32)
    head = jnp.asarray(rng.normal(0, 2, (4, VOCAB)), jnp.float32)
    targets = jnp.asarray(np.argmax(np.asarray(hidden @ head)[..., :VALID], axis=-1))
    _, entropy = head_logprobs(
        hidden, targets, lambda h: h @ head, chunk=2, with_entropy=True, sampling=SAMPLING
    )
    log_p = np.asarray(filtered_log_probs((hidden @ head).reshape(-1, VOCAB), SAMPLING))
    p = np.exp(log_p)
    want = -np.sum(np.where(p > 0, p * np.where(np.isfinite(log_p), log_p, 0), 0), axis=-1).reshape(
        2, 3
    )
    np.testing.assert_allclose(np.asarray(entropy), want, atol=1e-5)


# ------------------------------------------------------------------------- the train step


def test_scoring_under_the_sampling_distribution_matches_the_sampler(sampled):
    """The behaviour log-probs the loss uses are the sampler's sampling log-probs (1e-5), the
    first mini-batch's ratio is exactly 1, and the gap metrics say so."""
    model, traj = sampled
    mask = np.asarray(traj.loss_mask)
    model_lp, sampling_lp = (
        np.asarray(traj.logprobs)[mask],
        np.asarray(traj.sampling_logprobs)[mask],
    )
    assert np.max(np.abs(model_lp - sampling_lp)) > 0.1  # temperature and top-p matter here

    config = _scoring_config(batching={"epochs": 2, "mini_batches": 2})
    state = init_train_state(model, config)
    data, metrics = prepare_batch(nnx.graphdef(model), config, state, TrainBatch(traj))
    np.testing.assert_allclose(
        np.asarray(data["old_logprobs"])[mask], sampling_lp, atol=1e-5, rtol=0
    )
    assert float(metrics["sampler_gap_max"]) < 1e-5

    step = make_train_step(nnx.graphdef(model), config)
    _, metrics = step(state, TrainBatch(traj))
    ratio_deviation = np.asarray(metrics["updates/ratio_deviation"])
    assert ratio_deviation[0] == 0.0 and np.all(ratio_deviation[1:] > 0)
    assert float(metrics["sampler_gap_max"]) < 1e-5 and float(metrics["sampler_gap_mean"]) < 1e-6


def test_model_scoring_with_tis_weights_the_loss_by_the_capped_ratio(sampled):
    """``scoring="model"`` scores the temperature-1, whole-vocabulary model: it equals the
    sampler's ``logprobs`` (gap < 1e-5, measured in the batch's only update), not the sampling
    distribution; ``policy_clip_tis`` weighs each token by ``min(pi_old / mu, cap)``."""
    model, traj = sampled
    mask = np.asarray(traj.loss_mask)
    cap = 1.0  # sampled at temperature 0.7, most tokens are likelier under mu than under the model
    algorithm = AlgorithmConfig(
        loss_terms=(LossTermConfig("policy_clip_tis", params={"cap": cap}),)
    )
    config = TrainConfig(algorithm=algorithm)
    state = init_train_state(model, config)
    _, metrics = make_train_step(nnx.graphdef(model), config)(state, TrainBatch(traj))
    assert float(metrics["sampler_gap_max"]) < 1e-5
    ratio = np.exp(np.asarray(traj.logprobs) - np.asarray(traj.sampling_logprobs))[mask]
    assert (
        ratio.max() > cap and np.abs(np.log(ratio)).max() > 0.1
    )  # the distributions differ; some weights capped
    np.testing.assert_allclose(
        float(metrics["policy_clip_tis/tis_weight"]), np.minimum(ratio, cap).mean(), rtol=1e-4
    )
    np.testing.assert_allclose(
        float(metrics["policy_clip_tis/tis_capped"]), np.mean(ratio >= cap), atol=1e-6
    )


def test_tis_term_by_hand():
    old = jnp.asarray([[-1.0, -2.0, -0.5, -0.3]])
    inputs = LossInputs(
        loss_mask=jnp.asarray([[1.0, 1.0, 1.0, 0.0]]),
        logprobs=old,
        old_logprobs=old,
        advantages=jnp.asarray([[1.0, -1.0, 2.0, 5.0]]),
        sampler_logprobs=jnp.asarray([[-1.5, -1.0, -0.5, -9.0]]),
    )
    algorithm = AlgorithmConfig(
        loss_terms=(LossTermConfig("policy_clip_tis", params={"cap": 1.6}),)
    )
    result = compute_loss_with_metrics(algorithm, inputs, "policy")
    weights = [1.6, np.exp(-1.0), 1.0]  # min(exp(0.5), 1.6), min(exp(-1), 1.6), min(1, 1.6)
    losses = [-1.0 * weights[0], 1.0 * weights[1], -2.0 * weights[2]]  # -A r w, ratio 1
    assert np.isclose(float(result.total.total), sum(losses), atol=1e-6)
    assert np.isclose(float(result.total.denom), 3.0)
    assert np.isclose(
        float(result.metrics["policy_clip_tis/tis_weight"].total) / 3.0, np.mean(weights), atol=1e-6
    )


def test_config_fields_are_validated_and_round_trip():
    config = _scoring_config()
    assert TrainConfig.from_dict(config.to_dict()) == config
    assert config.scoring_sampling == SAMPLING and TrainConfig().scoring_sampling is None
    with pytest.raises(ConfigError, match="scoring"):
        TrainConfig(rl=RLConfig(scoring="tempered"))
    with pytest.raises(ConfigError, match=r"rl\.sampling\.temperature"):
        TrainConfig(rl=RLConfig(sampling={"temperature": 0.0}))
    with pytest.raises(ConfigError, match=r"rl\.sampling\.top_p"):
        TrainConfig(rl=RLConfig(sampling={"top_p": 1.5}))
    with pytest.raises(ValueError, match="cap"):
        LossTermConfig("policy_clip_tis", params={"cap": 0.0})


def test_old_records_load_with_sampling_logprobs_from_logprobs():
    t = Trajectory.zeros(2, 3, 1).replace(logprobs=jnp.full((2, 3), -0.5))
    arrays = {
        f.name: np.asarray(getattr(t, f.name))
        for f in dataclasses.fields(t)
        if f.name != "sampling_logprobs"
    }
    loaded = Trajectory.from_arrays(arrays)
    np.testing.assert_array_equal(loaded.sampling_logprobs, arrays["logprobs"])
    with pytest.raises(ValueError, match="unknown fields \\['bogus'\\]"):
        Trajectory.from_arrays({**arrays, "bogus": np.zeros(2)})
