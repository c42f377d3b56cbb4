"""Qwen3 MoE (``qwen3_moe``) from and to Hugging Face checkpoints, against ``transformers``'
``Qwen3MoeForCausalLM`` at odd sizes (3 layers, the middle one dense via ``mlp_only_layers``,
6 experts, top-2): logits to 1e-5 in float32, every MoE layer's routing choices for every
token, the export's tensors bit for bit, the cache forward (prefill, then one token at a time)
equal to the whole-sequence forward, the paged engine's greedy decode equal to ``generate``; and
the real train step's gradients on an all-MoE model equal to its loss written out."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers
from compile_counter import count_backend_compiles
from flax import nnx
from hf_qwen3 import hf_greedy, hf_logits
from safetensors.numpy import load_file
from train_fakes import random_trajectory, tiny_model

from agentrl_jax.algorithms import AlgorithmConfig, LossTermConfig
from agentrl_jax.models import export_qwen3, load_qwen3, moe
from agentrl_jax.models.qwen3 import KVCache, positions_from_mask
from agentrl_jax.sampling import Paging, Sampler, SamplingConfig, pad_rows
from agentrl_jax.train import RLConfig, TrainBatch, TrainConfig, compute_gradients, init_train_state

TINY_MOE = dict(
    vocab_size=97,
    hidden_size=20,
    intermediate_size=28,
    moe_intermediate_size=12,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=6,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=[1],
    initializer_range=0.2,
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``(directory, transformers model)`` of a random tiny Qwen3 MoE (norms perturbed
    around 1, weights at std 0.2 so the routing is decided by margins, not rounding)."""
    path = tmp_path_factory.mktemp("moe") / "hf"
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**TINY_MOE)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    model.save_pretrained(path)
    return path, model


TOKENS = np.random.default_rng(0).integers(0, TINY_MOE["vocab_size"], (2, 11))


def test_logits_and_routing_equal_transformers(saved):
    path, reference = saved
    ours = load_qwen3(path)
    assert ours.config.moe_layers == (True, False, True)
    mask = jnp.ones(TOKENS.shape, bool)
    logits, _ = ours(jnp.asarray(TOKENS), positions_from_mask(mask), mask)
    want = hf_logits(reference, TOKENS)
    assert np.abs(want).max() > 1  # logits O(1): the tolerance means something
    np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-5, atol=1e-5)

    # each MoE layer's choices, from the router's input as transformers computed it
    seen = {}
    hooks = [
        layer.mlp.gate.register_forward_hook(
            lambda module, args, out, i=i: seen.update({i: (args[0], out[2])})
        )
        for i, layer in enumerate(reference.model.layers)
        if i != 1
    ]
    with torch.no_grad():
        reference(torch.from_numpy(TOKENS))
    for hook in hooks:
        hook.remove()
    # the forward's own record of them (what the sampler keeps for routing replay)
    _, _, routing = ours.hidden_states(
        jnp.asarray(TOKENS), positions_from_mask(mask), mask, routing=True
    )
    assert routing.experts.shape == (2, 11, 2, 2) and routing.logits.shape == (2, 11, 2, 6)
    for stack, layer in enumerate(sorted(seen)):
        want_experts = seen[layer][1].numpy().reshape(2, 11, 2)
        np.testing.assert_array_equal(np.asarray(routing.experts[:, :, stack]), want_experts)


def test_replayed_experts_are_the_ones_used_and_the_router_still_learns(saved):
    ours = load_qwen3(saved[0])
    graphdef, state = nnx.split(ours)
    tokens, mask = jnp.asarray(TOKENS), jnp.ones(TOKENS.shape, bool)
    positions = positions_from_mask(mask)

    @jax.jit
    def forward(state, replay):
        return nnx.merge(graphdef, state).hidden_states(
            tokens, positions, mask, replay=replay, routing=True
        )[::2]

    nothing = jnp.full((2, 11, 2, 2), -1, jnp.int32)  # no record: every token routes itself
    hidden, own = forward(state, nothing)
    # replaying the model's own routing is the same forward, bit for bit
    again, same = forward(state, own.experts)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(hidden))
    np.testing.assert_array_equal(np.asarray(same.experts), np.asarray(own.experts))
    # other experts for the first row's tokens (the second row records nothing: -1 routes itself)
    other = ((own.experts + 1) % 6).at[1].set(-1)
    moved, used = forward(state, other)
    np.testing.assert_array_equal(np.asarray(used.experts[0]), np.asarray(other[0]))
    np.testing.assert_array_equal(np.asarray(used.experts[1]), np.asarray(own.experts[1]))
    assert np.abs(np.asarray(moved[0] - hidden[0])).max() > 1e-3
    # the second row's tokens attend only to themselves and route themselves: unchanged
    np.testing.assert_allclose(np.asarray(moved[1]), np.asarray(hidden[1]), rtol=1e-6, atol=1e-6)
    differ = moe.differs(used.logits.reshape(-1, 6), other.reshape(-1, 2))
    assert np.asarray(differ).reshape(2, 11, 2)[0].all() and not np.asarray(differ)[22:].any()

    # under replay the router's gradient flows through the replayed experts' weights
    grads = jax.grad(lambda state: jnp.sum(forward(state, other)[0] ** 2))(state)
    assert np.abs(np.asarray(grads["layers"]["router"][...])).max() > 0

    # the cache forwards (scanned and unrolled) record and replay alike
    for layers in (None, ours.split_layers()):
        cache = KVCache.empty(ours.config, 2, 16, jnp.float32)
        cached, _, got = jax.jit(
            lambda cache, layers: ours.hidden_states(
                tokens, positions, mask, cache, layers=layers, replay=other, routing=True
            )
        )(cache, layers)
        np.testing.assert_array_equal(np.asarray(got.experts), np.asarray(used.experts))
        np.testing.assert_allclose(np.asarray(cached), np.asarray(moved), rtol=1e-5, atol=1e-5)


def test_export_round_trips_bit_for_bit(saved, tmp_path):
    path, reference = saved
    out = export_qwen3(load_qwen3(path), tmp_path / "out", max_shard_bytes=20_000)
    assert len(list(out.glob("model-*.safetensors"))) > 1  # sharded, with an index
    original = load_file(path / "model.safetensors")
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    exported = {}
    for name in sorted(set(index.values())):
        exported.update(load_file(out / name))
    assert sorted(exported) == sorted(original)  # per-expert names, the dense layer's MLP
    for name, tensor in original.items():
        np.testing.assert_array_equal(exported[name], tensor, err_msg=name)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["mlp_only_layers"] == [1]
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    np.testing.assert_array_equal(hf_logits(again, TOKENS), hf_logits(reference, TOKENS))


def test_the_cache_forward_equals_the_whole_sequence(saved):
    ours = load_qwen3(saved[0])
    tokens = jnp.asarray(TOKENS)
    mask = jnp.ones(TOKENS.shape, bool)
    forward = jax.jit(lambda tokens, mask, cache: ours(tokens, positions_from_mask(mask), mask))
    whole, _ = forward(tokens, mask, None)
    step = jax.jit(
        lambda tokens, mask, cache: ours(
            tokens, positions_from_mask(mask, cache.lengths), mask, cache
        )
    )
    cache = KVCache.empty(ours.config, 2, 16, jnp.float32)
    prefix = 6
    steps = [step(tokens[:, :prefix], mask[:, :prefix], cache)]
    cache = steps[0][1]
    for t in range(prefix, TOKENS.shape[1]):
        logits, cache = step(tokens[:, t : t + 1], mask[:, t : t + 1], cache)
        steps.append((logits, cache))
    got = jnp.concatenate([logits for logits, _ in steps], axis=1)
    np.testing.assert_allclose(np.asarray(got), np.asarray(whole), rtol=1e-5, atol=1e-5)
    # the layers unrolled from split weights (the CPU sampler's decode) compute the same
    cache = KVCache.empty(ours.config, 2, 16, jnp.float32)
    hidden, _ = jax.jit(
        lambda cache: ours.hidden_states(
            tokens, positions_from_mask(mask), mask, cache, layers=ours.split_layers()
        )
    )(cache)
    np.testing.assert_allclose(
        np.asarray(ours.logits(hidden)), np.asarray(whole), rtol=1e-5, atol=1e-5
    )


def test_the_paged_engine_decodes_it_as_transformers_generates(saved):
    """Greedy decode of a ragged left-padded batch through the paged engine: transformers'
    ``generate`` token for token, the log-probs of teacher forcing, and a second batch of other
    prompts compiles nothing."""
    path, reference = saved
    model = load_qwen3(path)
    params = nnx.state(model)
    rng = np.random.default_rng(1)
    new, width = 8, 11

    def batch():
        rows = [rng.integers(0, TINY_MOE["vocab_size"], n).tolist() for n in (7, 2, 11, 5)]
        return pad_rows(rows, width)

    sampler = Sampler(
        model, max_new_tokens=new, stop_token_ids=(), paging=Paging(page_size=4, block_pages=2)
    )

    def decode(tokens, mask):
        state = sampler.append(params, sampler.init(4, width + new), tokens, mask)
        return sampler.decode(params, state, jax.random.key(0), SamplingConfig(temperature=0))[1]

    tokens, mask = batch()
    out = decode(tokens, mask)
    np.testing.assert_array_equal(out.tokens, hf_greedy(reference, tokens, mask, new))
    # teacher forcing: the whole sequence at once, the log-prob of each generated token
    full = jnp.concatenate([jnp.asarray(tokens), jnp.asarray(out.tokens)], axis=1)
    full_mask = jnp.concatenate([jnp.asarray(mask, bool), jnp.ones(out.tokens.shape, bool)], 1)
    logits, _ = model(full, positions_from_mask(full_mask), full_mask)
    scores = jax.nn.log_softmax(logits[:, width - 1 : -1], axis=-1)
    forced = jnp.take_along_axis(scores, jnp.asarray(out.tokens)[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(np.asarray(out.log_probs), np.asarray(forced), atol=1e-5)
    with count_backend_compiles() as compiles:
        decode(*batch())
    assert compiles == []


def test_the_train_step_on_a_moe_model_is_its_loss_gradient():
    """The real train step's gradients (remat "full", the head in chunks of 8 positions, and
    in 2 micro-batches) equal ``jax.grad`` of the clipped policy loss written out on the MoE
    forward; every expert that a token reached gets a gradient."""
    model = tiny_model(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, norm_topk_prob=True
    )
    assert model.config.moe_layers == (True, True)
    graphdef = nnx.split(model)[0]
    algorithm = AlgorithmConfig(
        aggregation="seq-mean-token-mean", loss_terms=(LossTermConfig("policy_clip"),)
    )
    config = TrainConfig(
        rl=RLConfig(memory={"remat": "full", "logits_chunk": 8}), algorithm=algorithm
    )
    split = TrainConfig(
        rl=RLConfig(memory={"remat": "full", "logits_chunk": 8}, batching={"num_micro_batches": 2}),
        algorithm=algorithm,
    )
    state = init_train_state(model, config)
    traj = random_trajectory(3, rows=8, padded_rows=1)
    grads, _, _ = jax.jit(functools.partial(compute_gradients, graphdef, config))(
        state, TrainBatch(traj)
    )
    micro, _, _ = jax.jit(functools.partial(compute_gradients, graphdef, split))(
        state, TrainBatch(traj)
    )

    success, rows, groups = (np.asarray(x) for x in (traj.success, traj.row_mask, traj.group_id))
    advantages = np.zeros(len(success), np.float32)
    for g in np.unique(groups[rows]):
        members = rows & (groups == g)
        r = success[members].astype(np.float64)
        advantages[members] = (r - r.mean()) / (r.std(ddof=1) + 1e-6) if members.sum() > 1 else 0

    def loss(params):  # one update per batch: the ratio is 1, the loss -A per token
        tokens, mask = traj.tokens, traj.token_mask
        logits, _ = nnx.merge(graphdef, params)(tokens, positions_from_mask(mask), mask)
        log_probs = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        lp = jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1)[..., 0]
        per_token = -jnp.asarray(advantages)[:, None] * jnp.exp(lp - jax.lax.stop_gradient(lp))
        weights = (traj.loss_mask & traj.row_mask[:, None])[:, 1:].astype(jnp.float32)
        counts = weights.sum(1)
        means = (per_token * weights).sum(1) / jnp.maximum(counts, 1)
        return jnp.sum(jnp.where(counts > 0, means, 0)) / jnp.sum(counts > 0)

    want = jax.jit(jax.grad(loss))(state.policy)
    for got in (grads, micro):
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6, rtol=1e-5)
    assert float(optax.tree.norm(want)) > 1e-3
    experts = np.asarray(want["layers"]["experts_up"])  # [layers, experts, I, H]
    assert (np.abs(experts).reshape(2, 4, -1).max(-1) > 0).sum() >= 6  # most experts trained


@pytest.mark.parametrize(
    "change, said",
    [
        ({"num_experts_per_tok": 7}, "num_experts_per_tok: must be in [1, num_experts=6], got 7"),
        ({"num_experts_per_tok": 0}, "num_experts_per_tok: must be in [1, num_experts=6]"),
        ({"num_local_experts": {"n": 6}}, "num_experts: must be"),
        ({"num_local_experts": None}, "num_local_experts: required field is missing"),
        ({"moe_intermediate_size": 0}, "moe_intermediate_size: must be >= 1 with experts"),
        ({"moe_intermediate_size": 2**40}, "moe_intermediate_size: must be"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step: must be"),
        ({"mlp_only_layers": "1"}, "mlp_only_layers: must be a list of layer indices"),
        ({"mlp_only_layers": [1.5]}, "mlp_only_layers: must be a list of layer indices"),
        ({"mlp_only_layers": [-1]}, "mlp_only_layers: must be a list of layer indices"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob: must be true or false"),
        ({"model_type": ["qwen3_moe"]}, "unsupported architecture"),
    ],
)
def test_a_hostile_moe_config_is_a_config_error_naming_the_field(saved, change, said):
    from agentrl_jax.models import ConfigError, Qwen3Config

    config = json.loads((saved[0] / "config.json").read_text())
    with pytest.raises(ConfigError) as raised:
        Qwen3Config.from_hf_dict({**config, **change})
    assert said in str(raised.value)


@pytest.mark.parametrize(
    "experts, said",
    [
        (
            7,
            "missing 6 tensor(s) that config.json requires, e.g. "
            "['model.layers.0.mlp.experts.6.down_proj.weight'",
        ),
        (
            5,
            "unexpected tensor(s) not part of a Qwen3 with this config.json: "
            "'model.layers.0.mlp.experts.5",
        ),
    ],
)
def test_expert_tensors_the_config_does_not_describe_are_refused(saved, tmp_path, experts, said):
    import shutil

    from agentrl_jax.models import CheckpointError

    folder = tmp_path / "edited"
    shutil.copytree(saved[0], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_local_experts": experts}))
    with pytest.raises(CheckpointError) as raised:
        load_qwen3(folder)
    assert said in str(raised.value)
