"""Routing replay (R3) on a tiny Qwen3 MoE whose routers are nearly tied, so that the paged
engine's decode and the train step's teacher-forced forward, which add in different orders,
route some tokens to different experts: the engine records the experts of every sampled token,
the train step reports how many of them its router would change (``routing_differs``), and
with ``rl.routing_replay`` its forward routes them through the recorded experts, which makes
the sampler-trainer log-prob gap shrink."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from train_fakes import tiny_model

from agentrl_jax.algorithms import AlgorithmConfig, LossTermConfig
from agentrl_jax.errors import ConfigError
from agentrl_jax.sampling import Paging, Sampler, SamplingConfig, pad_rows
from agentrl_jax.train import RLConfig, TrainBatch, TrainConfig, compute_gradients, init_train_state
from agentrl_jax.train.scoring import sequence_logprobs
from agentrl_jax.trajectory import Trajectory

ROWS, PROMPT, NEW = 8, 6, 12
MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=8, norm_topk_prob=True)


def nearly_tied(model, spread: float):
    """``model`` with each MoE layer's router rows one shared vector plus ``spread`` times
    noise: the experts' logits differ by about ``spread`` relative to their size."""
    router = np.asarray(model.layers.router[...])
    rng = np.random.default_rng(7)
    shared = router[:, :1]
    model.layers.router[...] = jnp.asarray(
        shared + spread * np.abs(shared).mean() * rng.standard_normal(router.shape), jnp.float32
    )
    return model


@pytest.fixture(scope="module")
def sampled():
    """``(model, trajectory)``: ``ROWS`` ragged prompts, ``NEW`` tokens sampled each at
    temperature 1 through the paged engine, as a one-turn trajectory with the experts the
    engine recorded."""
    model = nearly_tied(tiny_model(3, **MOE), spread=1e-5)
    params = nnx.state(model)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    prompts = [rng.integers(1, vocab, int(n)).tolist() for n in rng.integers(2, PROMPT + 1, ROWS)]
    tokens, mask = pad_rows(prompts, PROMPT)
    sampler = Sampler(
        model, max_new_tokens=NEW, stop_token_ids=(), paging=Paging(page_size=4, block_pages=2)
    )
    state = sampler.append(params, sampler.init(ROWS, PROMPT + NEW), tokens, mask)
    _, out = sampler.decode(params, state, jax.random.key(1), SamplingConfig(temperature=1.0))
    out = jax.device_get(out)
    assert out.experts.shape == (ROWS, NEW, 2, 2) and out.experts.dtype == np.int16
    assert (out.lengths == NEW).all()

    # each row: its prompt, then its response right after it (right padding)
    width = PROMPT + NEW
    t = jax.device_get(Trajectory.zeros(ROWS, width, 1, routing=(2, 2)))
    fields = {name: np.array(getattr(t, name)) for name in t.__dataclass_fields__}
    for r, prompt in enumerate(prompts):
        n = len(prompt)
        span = slice(n, n + NEW)
        fields["tokens"][r, :n], fields["tokens"][r, span] = prompt, out.tokens[r]
        fields["token_mask"][r, : n + NEW] = True
        fields["loss_mask"][r, span] = True
        fields["token_turn"][r, span] = 0
        fields["logprobs"][r, span] = out.log_probs[r]
        fields["sampling_logprobs"][r, span] = out.sampling_log_probs[r]
        fields["experts"][r, span] = out.experts[r]
    fields["turn_mask"][:, 0] = fields["row_mask"][:] = True
    fields["group_id"][:] = np.arange(ROWS) // 4
    fields["success"][:] = np.arange(ROWS) % 2 == 0
    fields["budget"][:] = 1
    return model, Trajectory(**{k: jnp.asarray(v) for k, v in fields.items()})


def test_the_engine_records_the_experts_its_forward_used(sampled):
    """What the engine records is the routing of its own forward: the teacher-forced forward
    replaying it uses exactly those experts, and without replay chooses the same for most
    tokens (all but the near-ties)."""
    model, traj = sampled
    own = sequence_logprobs(model, traj.tokens, traj.token_mask, with_routing=True)[2]
    replayed = sequence_logprobs(
        model, traj.tokens, traj.token_mask, replay=traj.experts, with_routing=True
    )[2]
    sampled_tokens = np.asarray(traj.loss_mask)
    recorded = np.asarray(traj.experts)[sampled_tokens]
    np.testing.assert_array_equal(np.asarray(replayed.experts)[sampled_tokens], recorded)
    same = np.sort(np.asarray(own.experts)[sampled_tokens], -1) == np.sort(recorded, -1)
    share = 1 - same.all(-1).mean()
    assert 0 < share < 0.5, share  # some (token, layer) routings differ, most do not
    assert (np.asarray(traj.experts)[~sampled_tokens] == -1).all()


@functools.cache
def _step(replay: bool, micro_batches: int = 1):
    algorithm = AlgorithmConfig(
        aggregation="seq-mean-token-mean", loss_terms=(LossTermConfig("policy_clip"),)
    )
    rl = RLConfig(
        routing_replay=replay,
        batching={"num_micro_batches": micro_batches},
        memory={"logits_chunk": 8},
    )
    return TrainConfig(rl=rl, algorithm=algorithm)


def test_replay_routes_as_the_sampler_did_and_shrinks_the_log_prob_gap(sampled):
    model, traj = sampled
    graphdef = nnx.split(model)[0]
    grads, metrics = {}, {}
    for replay in (False, True):
        config = _step(replay)
        state = init_train_state(model, config)
        grads[replay], _, metrics[replay] = jax.jit(
            functools.partial(compute_gradients, graphdef, config)
        )(state, TrainBatch(traj))
    off, on = (jax.device_get(metrics[r]) for r in (False, True))
    # the router's own choice differs from the sampler's for the same share either way
    assert off["routing_differs"] > 0
    np.testing.assert_allclose(on["routing_differs"], off["routing_differs"], rtol=1e-6)
    # replay shrinks the gap between the sampler's and the trainer's log-probs
    assert on["sampler_gap_mean"] < 0.5 * off["sampler_gap_mean"], (on, off)
    assert on["sampler_gap_max"] < off["sampler_gap_max"]
    print(
        f"routing differs for {off['routing_differs']:.1%} of (sampled token, MoE layer) pairs; "
        f"sampler-trainer gap mean/max {off['sampler_gap_mean']:.2e}/{off['sampler_gap_max']:.2e}"
        f" without replay, {on['sampler_gap_mean']:.2e}/{on['sampler_gap_max']:.2e} with"
    )

    # micro-batching leaves the replayed gradients as they are
    split = _step(True, micro_batches=2)
    state = init_train_state(model, split)
    parts = jax.jit(functools.partial(compute_gradients, graphdef, split))(state, TrainBatch(traj))
    for a, b in zip(jax.tree.leaves(grads[True]), jax.tree.leaves(parts[0])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize(
    "change, said",
    [
        (dict(rl=RLConfig(routing_replay=True)), "rl.routing_replay: the model has no MoE layers"),
        (
            dict(
                algorithm=AlgorithmConfig(
                    loss_terms=(LossTermConfig("policy_clip"), LossTermConfig("router_z", 0.001))
                )
            ),
            "algorithm.loss_terms[1]: loss term 'router_z' (policy) needs LossInputs.router_logits",
        ),
    ],
)
def test_a_dense_model_asked_for_routing_is_a_config_error(change, said):
    with pytest.raises(ConfigError, match=re.escape(said)):
        init_train_state(tiny_model(0), TrainConfig(**change))


def test_the_router_terms_train_the_router_through_the_step(sampled):
    """``router_z`` and ``router_balance`` in the real train step (2 micro-batches, replay on):
    their gradients are ``jax.grad`` of the same terms written on the forward's own routing."""
    from agentrl_jax.algorithms import router

    model, traj = sampled
    graphdef = nnx.split(model)[0]
    algorithm = AlgorithmConfig(
        aggregation="token-mean",
        loss_terms=(LossTermConfig("router_z", 0.01), LossTermConfig("router_balance", 0.1)),
    )
    config = TrainConfig(
        rl=RLConfig(
            routing_replay=True, batching={"num_micro_batches": 2}, memory={"logits_chunk": 8}
        ),
        algorithm=algorithm,
    )
    state = init_train_state(model, config)
    grads, _, metrics = jax.jit(functools.partial(compute_gradients, graphdef, config))(
        state, TrainBatch(traj)
    )

    def loss(params):
        routing = sequence_logprobs(
            nnx.merge(graphdef, params),
            traj.tokens,
            traj.token_mask,
            replay=traj.experts,
            with_routing=True,
        )[2]
        mask = traj.loss_mask
        balance, _ = router.balance_loss(routing.logits, routing.experts, mask)
        per_token = 0.01 * router.z_loss(routing.logits) + 0.1 * balance
        return jnp.sum(jnp.where(mask, per_token, 0.0)) / jnp.sum(mask)

    want = jax.grad(loss)(state.policy)
    np.testing.assert_allclose(
        np.asarray(grads["layers"]["router"][...]),
        np.asarray(want["layers"]["router"][...]),
        rtol=1e-4,
        atol=1e-9,
    )
    assert np.abs(np.asarray(want["layers"]["router"][...])).max() > 0
    assert 0 < metrics["router_balance/max_load"] <= 0.5
