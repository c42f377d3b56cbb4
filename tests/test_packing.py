"""Sequence packing (issue #47): several trajectories per row, each attending within itself at
its own positions, gives the unpacked step's losses and gradients, for every attention
implementation this machine runs (cuDNN's mask is the same visibility function as "xla"'s)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from train_fakes import random_trajectory, tiny_model

from agentrl_jax.algorithms import aggregation
from agentrl_jax.errors import ConfigError
from agentrl_jax.models.attention import _splash_attention, attention, segment_starts
from agentrl_jax.models.qwen3 import packed_positions
from agentrl_jax.train import RLConfig, TrainConfig, init_train_state, make_train_step
from agentrl_jax.train.batch import TrainBatch
from agentrl_jax.train.packing import pack, plan_packing, row_sequences, unpack
from agentrl_jax.train.step import compute_gradients


def test_plan_packs_whole_rows_first_fit_longest_first():
    mask = np.zeros((5, 8), bool)
    for row, n in enumerate([5, 3, 0, 2, 6]):
        mask[row, :n] = True
    plan = plan_packing(row_sequences(mask, np.ones(5)), 5, 8, multiple=2)
    # longest first: 6 (row 4) | 5 (row 0) + 3 (row 1) | 2 (row 3) joins row 4's: 6 + 2 = 8
    np.testing.assert_array_equal(plan.rows[0], [4] * 6 + [3] * 2)
    np.testing.assert_array_equal(plan.rows[1], [0] * 5 + [1] * 3)
    np.testing.assert_array_equal(plan.segment_ids[0], [1] * 6 + [2] * 2)
    np.testing.assert_array_equal(plan.cols[1], [0, 1, 2, 3, 4, 0, 1, 2])
    assert plan.shape == (2, 8) and plan.valid.all()
    x = jnp.asarray(np.arange(40).reshape(5, 8))
    back = unpack(pack(x, plan), plan, 5, 8)
    np.testing.assert_array_equal(np.where(mask, back, 0), np.where(mask, x, 0))
    # rounded up to the micro-batch multiple (empty rows), never below it
    assert plan_packing(row_sequences(mask, np.ones(5)), 5, 8, multiple=4).shape == (4, 8)


def test_segment_starts_and_positions():
    ids = jnp.array([[1, 1, 1, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(segment_starts(ids), [[0, 0, 0, 3, 3, 5, 5], [0] * 7])
    mask = ids > 0
    np.testing.assert_array_equal(packed_positions(mask, ids)[0], [0, 1, 2, 0, 1, 0, 0])


@pytest.mark.parametrize("implementation", ["xla", "blocked", "splash"])
def test_attention_within_segments_equals_each_sequence_alone(implementation):
    key = jax.random.split(jax.random.key(0), 3)
    lengths = (50, 30, 48)  # three sequences in one row of 128
    q = jax.random.normal(key[0], (1, 128, 4, 8))
    k = jax.random.normal(key[1], (1, 128, 2, 8))
    v = jax.random.normal(key[2], (1, 128, 2, 8))
    ids = jnp.asarray(np.repeat(np.arange(1, 4), lengths)[None]).astype(jnp.int32)
    valid = jnp.ones((1, 128), bool)
    if implementation == "splash":  # the Pallas interpreter (the kernel is TPU-only)
        packed = _splash_attention(
            q, k, v, None, valid, 128, 128, interpret=True, key_start=segment_starts(ids)
        )
    else:
        packed = attention(
            q,
            k,
            v,
            None,
            valid,
            key_start=segment_starts(ids),
            implementation=implementation,
            block_q=32,
            block_k=32,
        )
    at = 0
    for n in lengths:
        alone = attention(q[:, at : at + n], k[:, at : at + n], v[:, at : at + n], None)
        np.testing.assert_allclose(packed[:, at : at + n], alone, rtol=1e-5, atol=1e-5)
        at += n


PPO = {  # GAE on a critic whose values the packed rows compute, then unpack per trajectory
    "advantage": "gae",
    "aggregation": "seq-mean-token-mean",
    "loss_terms": [{"name": "policy_clip"}, {"name": "value_clip"}],
}


@pytest.mark.parametrize(
    "attention_impl, aggregation_mode",
    [
        ("xla", "token-mean"),
        ("xla", "seq-mean-token-mean"),
        ("blocked", "token-mean"),
        ("blocked", "seq-mean-token-mean"),
        ("xla", "ppo"),
    ],
)
def test_packed_step_gradients_equal_the_unpacked_ones(attention_impl, aggregation_mode):
    algorithm = (
        PPO
        if aggregation_mode == "ppo"
        else {
            "aggregation": aggregation_mode,
            "loss_terms": [{"name": "policy_clip"}, {"name": "kl", "coef": 0.1}],
        }
    )
    plain = TrainConfig(
        rl=RLConfig(memory={"attention": attention_impl}, batching={"num_micro_batches": 2}),
        algorithm=algorithm,
    )
    packed = dataclasses.replace(
        plain,
        rl=dataclasses.replace(plain.rl, memory=dataclasses.replace(plain.rl.memory, packing=True)),
    )
    model = tiny_model(seed=3, vocab_size=16)
    # perturb the policy away from the reference, so the KL term has a gradient
    state = init_train_state(model, plain)
    state = state.replace(policy=jax.tree.map(lambda x: x * 1.01, state.policy))
    batch = TrainBatch(random_trajectory(5, rows=16, tokens=24, padded_rows=2))
    step = make_train_step(nnx.graphdef(model), packed)
    packed_batch = step.packed(batch)
    assert packed_batch.packing.shape[0] < 16  # fewer rows than trajectories
    graphdef = nnx.graphdef(model)
    if aggregation_mode == "ppo":  # a critic that is not the policy: values and returns vary
        state = state.replace(
            critic=state.critic.replace(
                head={"kernel": jnp.linspace(-1.0, 1.0, 16), "bias": jnp.asarray(0.3)}
            )
        )
    with jax.default_matmul_precision("highest"):
        g_plain, c_plain, m_plain = jax.jit(compute_gradients, static_argnums=(0, 1))(
            graphdef, plain, state, batch
        )
        g_packed, c_packed, m_packed = jax.jit(compute_gradients, static_argnums=(0, 1))(
            graphdef, packed, state, packed_batch
        )
    names = ["loss", "loss/policy_clip", "advantage_mean", "loss_tokens"]
    names += ["value_loss", "value_mean"] if aggregation_mode == "ppo" else ["loss/kl"]
    for name in names:
        np.testing.assert_allclose(m_packed[name], m_plain[name], rtol=1e-6, atol=1e-7)
    grads = [(g_packed, g_plain)] + ([(c_packed, c_plain)] if c_plain is not None else [])
    for got, want in grads:
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
    assert float(jnp.max(jnp.abs(jax.tree.leaves(g_plain)[0]))) > 1e-4


def test_the_packed_train_step_updates_as_the_unpacked_one():
    plain = TrainConfig(rl=RLConfig(optimizer={"learning_rate": 1e-2}))
    packed = dataclasses.replace(
        plain,
        rl=dataclasses.replace(plain.rl, memory=dataclasses.replace(plain.rl.memory, packing=True)),
    )
    model = tiny_model(seed=4, vocab_size=16)
    batch = TrainBatch(random_trajectory(6, rows=8))
    results = []
    for config in (plain, packed):
        step = make_train_step(nnx.graphdef(model), config)
        new, metrics = step(init_train_state(model, config), batch)
        results.append((new.policy, metrics))
    np.testing.assert_allclose(results[1][1]["loss"], results[0][1]["loss"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(results[1][0]), jax.tree.leaves(results[0][0]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)


def test_segment_aggregation_counts_each_sequence():
    per_token = jnp.array([[1.0, 2.0, 3.0, 4.0, 0.0]])
    mask = jnp.array([[1, 1, 0, 1, 0]], bool)
    ids = jnp.array([[1, 1, 1, 2, 0]])
    part = aggregation.aggregate(per_token, mask, "seq-mean-token-mean", segment_ids=ids)
    assert (float(part.total), float(part.denom)) == (1.5 + 4.0, 2.0)  # (1+2)/2 and 4/1


def test_bad_packing_and_window_settings_name_the_field():
    for value in (0, -1, "2", 2.5, True):
        with pytest.raises(
            ConfigError, match=r"rl\.history_window: must be null or an int in \[1, 4096\]"
        ):
            RLConfig(history_window=value)
    with pytest.raises(ConfigError, match=r"rl\.memory\.packing: must be true or false"):
        RLConfig(memory={"packing": "yes"})
    with pytest.raises(ConfigError, match=r"rl\.history_window: run 'ppo' trains each windowed"):
        RLConfig(runs=("ppo",), history_window=2, preset_params={"aggregation": "token-mean"})


def test_packing_refuses_terms_that_read_whole_rows():
    with pytest.raises(ConfigError, match=r"rl\.memory\.packing: loss term 'gspo_clip'"):
        TrainConfig(
            rl=RLConfig(memory={"packing": True}),
            algorithm={"loss_terms": [{"name": "gspo_clip"}], "aggregation": "token-mean"},
        )
