"""An MoE router's auxiliary loss terms (``router_balance``, ``router_z``;
``agentrl_jax/algorithms/router.py``): hand-computed values on tiny arrays, agreement with
transformers' ``load_balancing_loss_func`` for one sequence (layer by layer), exactness under
micro-batches and packing, gradients through the router probabilities only, and the
registry/config path (the step's live inputs; a dense model refused by name)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from agentrl_jax.algorithms import aggregation as agg
from agentrl_jax.algorithms import router
from agentrl_jax.algorithms.algorithm_config import AlgorithmConfig, LossTermConfig
from agentrl_jax.algorithms.compute import compute_loss_with_metrics
from agentrl_jax.algorithms.registry import LossInputs
from agentrl_jax.models import moe
from agentrl_jax.train import TrainConfig
from agentrl_jax.train.inputs import check_inputs, check_model_inputs, step_inputs

# ---------------------------------------------------------------- a hand-computed batch
# 2 sequences x 3 tokens, 2 MoE layers, 4 experts, top-2.
P_UP = np.log([0.1, 0.2, 0.3, 0.4])  # logits whose softmax is (.1, .2, .3, .4), logsumexp 0
P_DOWN = P_UP[::-1]


def hand_batch():
    logits = np.zeros((2, 3, 2, 4), np.float32)
    logits[0, :, 0] = P_UP  # seq 0, layer 0: p = (.1, .2, .3, .4); layer 1: uniform (lse log 4)
    logits[1, :, 0] = P_DOWN  # seq 1, layer 0: p = (.4, .3, .2, .1)
    logits[1, :, 1] = P_UP + 1.0  # seq 1, layer 1: p = (.1, .2, .3, .4), lse 1
    experts = np.array(
        [
            [[[0, 1], [2, 3]], [[0, 2], [2, 3]], [[1, 0], [3, 1]]],  # token 2 is off the mask
            [[[3, 2], [0, 1]], [[3, 2], [1, 2]], [[3, 2], [2, 3]]],
        ],
        np.int32,
    )
    mask = np.array([[1, 1, 0], [1, 1, 1]], bool)
    return jnp.asarray(logits), jnp.asarray(experts), jnp.asarray(mask)


# loads over each sequence's loss tokens (sum k = 2 over experts)
HAND_LOADS = np.array(
    [
        [[1.0, 0.5, 0.5, 0.0], [0.0, 0.0, 1.0, 1.0]],
        [[0.0, 0.0, 1.0, 1.0], [1 / 3, 2 / 3, 2 / 3, 1 / 3]],
    ]
)
# per token: mean over layers of 4 * sum_e f p
#   seq 0: layer 0: 4 (1 x .1 + .5 x .2 + .5 x .3) = 1.4; layer 1: 4 (.25 + .25) = 2 -> 1.7
#   seq 1: layer 0: 4 (.2 + .1) = 1.2; layer 1: 4 (.1/3 + .4/3 + .4/3 + .4/3) = 2 -> 1.6
HAND_BALANCE = np.array([[1.7] * 3, [1.6] * 3])
HAND_MAX_LOAD = np.array([[0.5] * 3, [5 / 12] * 3])  # mean_m max_e f / k
HAND_Z = np.array([[np.log(4.0) ** 2 / 2] * 3, [0.5] * 3])  # mean_m lse^2


def test_hand_computed_values():
    logits, experts, mask = hand_batch()
    loads = router.sequence_loads(experts, mask, 4)
    np.testing.assert_allclose(loads, np.broadcast_to(HAND_LOADS[:, None], (2, 3, 2, 4)), 1e-6)
    np.testing.assert_allclose(np.sum(loads, axis=-1), 2.0, rtol=1e-6)  # sums to k
    loss, max_load = router.balance_loss(logits, experts, mask)
    np.testing.assert_allclose(loss, HAND_BALANCE, rtol=1e-5)
    np.testing.assert_allclose(max_load, HAND_MAX_LOAD, rtol=1e-6)
    np.testing.assert_allclose(router.z_loss(logits), HAND_Z, rtol=1e-5, atol=1e-6)
    # bfloat16 logits are read in float32 (the router's own softmax)
    low, _ = router.balance_loss(logits.astype(jnp.bfloat16), experts, mask)
    assert low.dtype == jnp.float32
    np.testing.assert_allclose(low, HAND_BALANCE, rtol=1e-2)

    # through the registry: token-mean is (2 x 1.7 + 3 x 1.6) / 5, the sequence mean 1.65
    config = AlgorithmConfig(
        loss_terms=(LossTermConfig("router_balance", 0.01), LossTermConfig("router_z", 0.001))
    )
    inputs = LossInputs(loss_mask=mask, router_logits=logits, router_experts=experts)
    result = compute_loss_with_metrics(config, inputs)
    assert float(agg.mean(result.parts["router_balance"])) == pytest.approx(8.2 / 5, rel=1e-5)
    z = float(agg.mean(result.parts["router_z"]))
    assert z == pytest.approx((2 * np.log(4.0) ** 2 / 2 + 3 * 0.5) / 5, rel=1e-5)
    assert float(agg.mean(result.total)) == pytest.approx(0.01 * 8.2 / 5 + 0.001 * z, rel=1e-5)
    max_load = float(agg.mean(result.metrics["router_balance/max_load"]))
    assert max_load == pytest.approx((2 * 0.5 + 3 * 5 / 12) / 5, rel=1e-6)
    seq = dataclasses.replace(config, aggregation="seq-mean-token-mean")
    seq_result = compute_loss_with_metrics(seq, inputs)
    assert float(agg.mean(seq_result.parts["router_balance"])) == pytest.approx(1.65, rel=1e-5)


def test_balanced_router_scores_k():
    n, length, layers, e, k = 1, 8, 2, 4, 2
    logits = jnp.zeros((n, length, layers, e))
    experts = jnp.asarray(np.tile([[0, 1], [2, 3]], (4, 1))[None, :, None].repeat(layers, 2))
    loss, max_load = router.balance_loss(logits, experts, jnp.ones((n, length), bool))
    np.testing.assert_allclose(loss, float(k), rtol=1e-6)
    np.testing.assert_allclose(max_load, 1 / e, rtol=1e-6)


# ---------------------------------------------------------------- transformers


def _ours_one_sequence(logits, experts, mask) -> float:
    loss, _ = router.balance_loss(logits[None], experts[None], mask[None])
    return float(agg.mean(agg.aggregate(loss, mask[None])))


@pytest.mark.parametrize("layers", [1, 3])
def test_one_sequence_equals_transformers_layer_by_layer(layers):
    length, e, k = 11, 6, 2
    rng = np.random.default_rng(layers)
    logits = jnp.asarray(rng.normal(size=(length, layers, e)).astype(np.float32))
    _, _, experts = moe.top_experts(logits.reshape(-1, e), k)  # the router's own top-k
    experts = experts.reshape(length, layers, k)
    mask = np.ones(length, bool)
    mask[[0, 1, 7]] = False  # prompt-like and tool-output tokens are off the loss mask
    mask = jnp.asarray(mask)

    def hf(layer_logits: tuple) -> float:
        return float(
            load_balancing_loss_func(
                tuple(torch.from_numpy(np.array(x)) for x in layer_logits),
                num_experts=e,
                top_k=k,
                attention_mask=torch.from_numpy(np.array(mask))[None].long(),
            )
        )

    per_layer = [hf((logits[:, m],)) for m in range(layers)]
    assert _ours_one_sequence(logits, experts, mask) == pytest.approx(np.mean(per_layer), 1e-5)
    if layers == 1:  # one MoE layer: transformers' value itself
        assert _ours_one_sequence(logits, experts, mask) == pytest.approx(hf((logits[:, 0],)), 1e-5)
    else:  # transformers pools the layers: E sum_e (mean_m f)(mean_m P), which differs
        pooled = hf(tuple(logits[:, m] for m in range(layers)))
        loads = router.sequence_loads(experts[None], mask[None], e)[0, 0]  # [M, E]
        probs = jax.nn.softmax(logits, axis=-1)
        mean_probs = jnp.sum(probs * mask[:, None, None], axis=0) / jnp.sum(mask)  # [M, E]
        mine = e * jnp.sum(jnp.mean(loads, 0) * jnp.mean(mean_probs, 0))
        assert pooled == pytest.approx(float(mine), 1e-5)
        assert pooled != pytest.approx(_ours_one_sequence(logits, experts, mask), 1e-3)


# ---------------------------------------------------------------- exactness


def random_batch(seed=0, n=4, length=9, layers=2, e=5, k=2):
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.normal(size=(n, length, layers, e)).astype(np.float32))
    _, _, experts = moe.top_experts(logits.reshape(-1, e), k)
    mask = rng.random((n, length)) < 0.7
    mask[-1] = False  # a padded row
    return logits, experts.reshape(n, length, layers, k), jnp.asarray(mask)


ROUTER_TERMS = (LossTermConfig("router_balance", 0.01), LossTermConfig("router_z", 0.001))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batches_add_up_to_the_batch(mode):
    logits, experts, mask = random_batch()
    config = AlgorithmConfig(loss_terms=ROUTER_TERMS, aggregation=mode)

    def run(rows):
        inputs = LossInputs(
            loss_mask=mask[rows], router_logits=logits[rows], router_experts=experts[rows]
        )
        return compute_loss_with_metrics(config, inputs)

    whole = run(slice(None))
    halves = [run(slice(0, 2)), run(slice(2, 4))]
    for get in (
        lambda r: r.total,
        lambda r: r.parts["router_balance"],
        lambda r: r.parts["router_z"],
        lambda r: r.metrics["router_balance/max_load"],
    ):
        summed = agg.combine([get(h) for h in halves])
        np.testing.assert_allclose(summed.total, get(whole).total, rtol=1e-5)
        np.testing.assert_allclose(summed.denom, get(whole).denom)


def test_packed_rows_equal_unpacked():
    """Three sequences (3, 2 and 4 tokens) as rows of their own, then packed into two rows of
    6 (``segment_ids`` 1, 2, ..., 0 on empty slots, as the train step packs)."""
    logits, experts, _ = random_batch(seed=3, n=3, length=4)
    lengths = (3, 2, 4)
    mask = jnp.asarray(np.arange(4)[None] < np.array(lengths)[:, None])
    mask = mask.at[0, 0].set(False)  # a token of the first sequence off the loss mask
    slots = [(0, 0), (0, 3), (1, 0)]  # (row, start) of each sequence in the packed rows
    packed = {
        "logits": np.zeros((2, 6) + logits.shape[2:], np.float32),
        "experts": np.zeros((2, 6) + experts.shape[2:], np.int32),
        "mask": np.zeros((2, 6), bool),
        "segment_ids": np.zeros((2, 6), np.int32),
    }
    for i, ((row, start), size) in enumerate(zip(slots, lengths)):
        where = (row, slice(start, start + size))
        packed["logits"][where] = logits[i, :size]
        packed["experts"][where] = experts[i, :size]
        packed["mask"][where] = mask[i, :size]
        packed["segment_ids"][where] = i + 1
    packed = {name: jnp.asarray(v) for name, v in packed.items()}

    loss, max_load = router.balance_loss(logits, experts, mask)
    packed_loss, packed_max = router.balance_loss(
        packed["logits"], packed["experts"], packed["mask"], packed["segment_ids"]
    )
    for i, ((row, start), size) in enumerate(zip(slots, lengths)):
        np.testing.assert_allclose(packed_loss[row, start : start + size], loss[i, :size], 1e-6)
        np.testing.assert_allclose(packed_max[row, start : start + size], max_load[i, :size], 1e-6)
    # without the segments the first row's two sequences would share their loads
    mixed, _ = router.balance_loss(packed["logits"], packed["experts"], packed["mask"])
    assert not np.allclose(mixed[0, :3], loss[0, :3])

    for mode in ("token-mean", "seq-mean-token-mean"):
        config = AlgorithmConfig(loss_terms=ROUTER_TERMS, aggregation=mode)
        plain = compute_loss_with_metrics(
            config, LossInputs(loss_mask=mask, router_logits=logits, router_experts=experts)
        )
        packed_result = compute_loss_with_metrics(
            config,
            LossInputs(
                loss_mask=packed["mask"],
                router_logits=packed["logits"],
                router_experts=packed["experts"],
                segment_ids=packed["segment_ids"],
            ),
        )
        for a, b in ((plain.total, packed_result.total), (plain.metrics, packed_result.metrics)):
            jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5), a, b)


# ---------------------------------------------------------------- gradients


def test_gradients_reach_the_router_logits_through_the_probabilities_only():
    logits, experts, mask = hand_batch()
    config = AlgorithmConfig(loss_terms=(LossTermConfig("router_balance"),))

    def mean_loss(x):
        inputs = LossInputs(loss_mask=mask, router_logits=x, router_experts=experts)
        return agg.mean(compute_loss_with_metrics(config, inputs).total)

    def written_out(x):  # the loads as constants: E mean_m sum_e f p, token-mean
        p = jax.nn.softmax(x, axis=-1)
        per_token = 4 * jnp.mean(jnp.sum(HAND_LOADS[:, None] * p, -1), -1)
        return jnp.sum(per_token * mask) / jnp.sum(mask)

    grad = jax.grad(mean_loss)(logits)
    np.testing.assert_allclose(grad, jax.grad(written_out)(logits), rtol=1e-5, atol=1e-7)
    assert np.all(np.asarray(grad)[0, 2] == 0)  # off the loss mask: no gradient
    assert np.all(np.abs(np.asarray(grad)[mask]).sum(axis=(-2, -1)) > 0)
    # the z-loss: d/dx lse^2 / M = 2 lse softmax(x) / M per token (token-mean over 5 tokens)
    z_config = AlgorithmConfig(loss_terms=(LossTermConfig("router_z"),))
    z_grad = jax.grad(
        lambda x: agg.mean(
            compute_loss_with_metrics(
                z_config, LossInputs(loss_mask=mask, router_logits=x, router_experts=experts)
            ).total
        )
    )(logits)
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    expected = 2 * lse * jax.nn.softmax(logits, axis=-1) / 2 * mask[..., None, None] / 5
    np.testing.assert_allclose(z_grad, expected, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- registry and config


def test_config_path_declares_the_router_inputs():
    config = AlgorithmConfig.from_dict(
        {
            "loss_terms": [
                {"name": "policy_clip"},
                {"name": "router_balance", "coef": 0.001},
                {"name": "router_z", "coef": 0.001},
            ]
        }
    )
    needs = step_inputs(config)
    assert {"router_logits", "router_experts"} <= needs.live("policy")
    assert not needs.batch & {"router_logits", "router_experts"}
    assert config.required_loss_inputs("policy") >= {"router_logits", "router_experts"}
    check_inputs(config)
    TrainConfig(algorithm=config)  # the config's own checks pass
    check_model_inputs(config, moe_layers=2)  # an MoE model: fine
    with pytest.raises(
        ValueError,
        match=r"loss_terms\[1\]: loss term 'router_balance' \(policy\) "
        r"needs LossInputs\.router_logits, but the model has no MoE layers",
    ):
        check_model_inputs(config, moe_layers=0)
    z_only = AlgorithmConfig(loss_terms=(LossTermConfig("policy_clip"), LossTermConfig("router_z")))
    with pytest.raises(ValueError, match=r"loss_terms\[1\]: loss term 'router_z'.*router_logits"):
        check_model_inputs(z_only, moe_layers=0)
    check_model_inputs(AlgorithmConfig(), moe_layers=0)  # no router term: a dense model is fine
    # the terms take no parameters (their weight is the coefficient)
    with pytest.raises(ValueError, match=r"unknown parameter 'alpha'; known: none"):
        LossTermConfig("router_balance", 0.001, {"alpha": 1.0})
    # a forward that hands no router logits: an error naming the field, not a crash
    mask = jnp.ones((1, 2), bool)
    with pytest.raises(ValueError, match=r"'router_z' needs LossInputs\.router_logits, which is"):
        compute_loss_with_metrics(
            z_only,
            LossInputs(
                loss_mask=mask,
                logprobs=jnp.zeros((1, 2)),
                old_logprobs=jnp.zeros((1, 2)),
                advantages=jnp.zeros((1, 2)),
            ),
        )
