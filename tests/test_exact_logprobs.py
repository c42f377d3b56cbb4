"""Exact log-probs (``rl.exact_logprobs``, :mod:`agentrl_jax.sampling.exact`): the sampler's
recorded float32 log-probs of every sampled token and the trainer's are the same bits.

References: bitwise comparisons between the two sides (``np.array_equal`` on the raw bits of
the float32 values), over ragged multi-turn FrozenLake rollouts of a tiny random Qwen3 on the
paged KV cache (rows ending at different turns, so decode runs compacted batches of 6, 4 and 2
rows), scored by the train step unpacked and packed, at two micro-batch sizes; a model
computing in bfloat16 on the engine; and the fast path, whose gap (~1e-6) shows the comparison
can fail.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from train_fakes import TINY

from agentrl_jax.algorithms.budgetmix import budget_set
from agentrl_jax.bench.rollout import frozenlake_token_map, tiny_policy_model
from agentrl_jax.errors import ConfigError
from agentrl_jax.models import Qwen3Config, Qwen3ForCausalLM
from agentrl_jax.models.tokenizer import load_tokenizer
from agentrl_jax.rollout import MultiTurnRollout, RolloutConfig
from agentrl_jax.sampling import Paging, Sampler, SamplerPolicy, SamplingConfig
from agentrl_jax.train import RLConfig, TrainBatch, TrainConfig, init_train_state, make_train_step
from agentrl_jax.train.scoring import exact_logprobs, sequence_logprobs
from envs.frozenlake import maps as fl_maps
from envs.frozenlake.text_env import FrozenLakeTextConfig, FrozenLakeTextEnv

CONTEXT = 448
SAMPLING = {"temperature": 0.7, "top_p": 0.9}
TASKS, KEY = np.array([4, 1, 2]), 8  # budgets 3, 5, 4: rows end at turns 3 to 5
PAGED = Paging(page_size=16, block_pages=4)


def bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.int32)


@pytest.fixture(scope="module")
def setup():
    """``(model, rollouts)``: a tiny random Qwen3 over FrozenLake's token map, and its rollouts
    with the paged cache: ``exact`` (6 rows, ragged) and ``fast`` (2 of those rows, without
    exact log-probs)."""
    tokenizer = load_tokenizer()
    maps = fl_maps.generate(jax.random.key(1), 8, size=4, p=0.8)
    env = FrozenLakeTextEnv(maps, FrozenLakeTextConfig(t_max=5))
    config = RolloutConfig(
        group_size=2,
        max_response_tokens=4,
        max_context=CONTEXT,
        sampling=RLConfig(sampling=SAMPLING).sampling.config(None),
    )
    runner = MultiTurnRollout(env, tokenizer, config)
    token_map = frozenlake_token_map(runner, budget_set(5))
    model = tiny_policy_model(
        len(token_map),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=1,
    )

    exact = SamplerPolicy(model, token_map=token_map, min_rows=1, paging=PAGED, exact_logprobs=True)
    fast = SamplerPolicy(model, token_map=token_map, min_rows=1, paging=PAGED)
    rollouts = {}
    for name, policy, tasks in (("exact", exact, TASKS), ("fast", fast, TASKS[:1])):
        result = runner(policy, tasks, jax.random.key(KEY))
        rollouts[name] = (result, _model_ids(result.trajectory, token_map))
    return model, rollouts


def _model_ids(trajectory, token_map):
    real = trajectory.token_mask
    ids = token_map.to_model(np.where(real, trajectory.tokens, token_map.tokenizer_ids[0]))
    return trajectory.replace(tokens=np.where(real, ids, 0).astype(np.int32))


def test_the_rollouts_are_ragged(setup):
    _, rollouts = setup
    result, traj = rollouts["exact"]
    assert result.stats.live_rows == (6, 6, 6, 4, 2)  # compacted to 4, then 2 rows
    assert len(set(traj.token_mask.sum(axis=1))) > 2 and len(set(traj.loss_mask.sum(axis=1))) > 1


def test_the_trainers_log_probs_are_the_samplers_bit_for_bit(setup):
    """Both distributions: the model's (``logprobs``) and the sampling one (temperature 0.7,
    top-p 0.9, ``sampling_logprobs``), through :func:`exact_logprobs` at the canonical
    length."""
    model, rollouts = setup
    traj = rollouts["exact"][1]
    mask = traj.loss_mask.astype(bool)
    score = jax.jit(
        lambda params, sampling: exact_logprobs(
            nnx.merge(nnx.graphdef(model), params),
            traj.tokens,
            traj.token_mask,
            traj.loss_mask,
            length=CONTEXT,
            sampling=sampling,
        ),
        static_argnums=1,
    )
    sampling = TrainConfig(rl=RLConfig(scoring="sampling", sampling=SAMPLING)).scoring_sampling
    for recorded, distribution in ((traj.logprobs, None), (traj.sampling_logprobs, sampling)):
        got = np.asarray(score(nnx.state(model), distribution))
        np.testing.assert_array_equal(bits(got[mask]), bits(recorded[mask]))
    assert np.abs(traj.logprobs - traj.sampling_logprobs)[mask].max() > 0.1  # they differ


def _step_metrics(model, traj, *, exact, packing, micro):
    config = TrainConfig(
        rl=RLConfig(
            exact_logprobs=exact,
            scoring="sampling",
            sampling=SAMPLING,
            tasks_per_step=3,
            group_size=2,
            batching={"epochs": 2, "mini_batches": 2, "num_micro_batches": micro},
            memory={"packing": packing},
            asynchronous={"max_staleness": 1},  # weights each token by min(pi_old / mu, cap)
        ),
        context_length=CONTEXT,
    )
    step = make_train_step(nnx.graphdef(model), config)
    _, metrics = step(init_train_state(model, config), TrainBatch(traj))
    return jax.tree.map(np.asarray, metrics)


@pytest.mark.parametrize("packing, micro", [(False, 1), (True, 3)])
def test_the_first_updates_ratios_are_exactly_one(setup, packing, micro):
    """The train step (2 epochs x 2 mini-batches, asynchronous: each token weighted by
    ``pi_old / mu``): the old log-probs equal the sampler's (gap exactly 0), every update's
    off-policy weight is exactly 1 (its largest too), the first update's ratio is exactly 1,
    and the later updates move."""
    model, rollouts = setup
    metrics = _step_metrics(model, rollouts["exact"][1], exact=True, packing=packing, micro=micro)
    assert metrics["sampler_gap_max"] == 0.0 and metrics["sampler_gap_mean"] == 0.0
    np.testing.assert_array_equal(metrics["updates/off_policy/weight"], 1.0)
    assert metrics["off_policy/weight_max"] == 1.0
    assert metrics["updates/ratio_deviation"][0] == 0.0
    assert np.all(metrics["updates/ratio_deviation"][1:] > 0)


def test_without_exact_log_probs_the_gap_remains(setup):
    """The fast path: the train step's forward (:func:`sequence_logprobs`) agrees with the
    fast sampler to ~1e-6, not to the bit; nor with the exact sampler."""
    model, rollouts = setup
    forward = TrainConfig(rl=RLConfig(scoring="sampling", sampling=SAMPLING)).forward
    score = jax.jit(
        lambda params, tokens, token_mask, loss_mask: sequence_logprobs(
            nnx.merge(nnx.graphdef(model), params),
            tokens,
            token_mask,
            loss_mask=loss_mask,
            forward=forward,
        )[0]
    )
    for name in ("fast", "exact"):
        traj = rollouts[name][1]
        mask = traj.loss_mask.astype(bool)
        got = np.asarray(score(nnx.state(model), traj.tokens, traj.token_mask, traj.loss_mask))
        gap = np.abs(got - traj.sampling_logprobs)[mask]
        assert 0.0 < gap.max() < 1e-4, name


def test_the_option_is_validated_and_named():
    assert RLConfig().exact_logprobs is False
    config = TrainConfig(rl=RLConfig(exact_logprobs=True), context_length=CONTEXT)
    assert TrainConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ConfigError, match=r"rl\.exact_logprobs: must be true or false"):
        RLConfig(exact_logprobs="yes")
    with pytest.raises(ConfigError, match=r"rl\.exact_logprobs: .*history_window"):
        RLConfig(exact_logprobs=True, history_window=2)
    with pytest.raises(ConfigError, match=r"TrainConfig\.context_length"):
        TrainConfig(context_length=0)
    with pytest.raises(ValueError, match="exact_logprobs must be a bool"):
        SamplerPolicy(tiny_policy_model(8), exact_logprobs=1)


def test_bfloat16_compute_holds_too():
    """A tiny Qwen3 computing in bfloat16 (float32 weights and logits), sampled by the engine on
    the paged cache from ragged prompts: the trainer's canonical log-probs are the sampler's,
    bit for bit, under both distributions."""
    config = Qwen3Config(**{**TINY, "vocab_size": 24})
    model = Qwen3ForCausalLM(config, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(3))
    params, rows, new, length = nnx.state(model), 3, 5, 24
    sampler = Sampler(model, max_new_tokens=new, stop_token_ids=(), paging=Paging(page_size=8))
    lengths = np.array([3, 8, 5])
    tokens = np.zeros((rows, length), np.int32)
    prompt_mask = np.arange(8)[None, :] < lengths[:, None]
    tokens[:, :8] = np.where(prompt_mask, np.random.default_rng(0).integers(1, 24, (rows, 8)), 0)
    state = sampler.append(params, sampler.init(rows, length), tokens[:, :8], prompt_mask)
    sampling = SamplingConfig(temperature=0.7, top_p=0.9)
    keys = jax.random.split(jax.random.key(1), rows)
    _, out = jax.device_get(sampler.decode(params, state, keys, sampling, history=tokens))
    loss_mask = np.zeros((rows, length), bool)
    for b, n in enumerate(lengths):
        tokens[b, n : n + new], loss_mask[b, n : n + new] = out.tokens[b], True
    token_mask = np.arange(length)[None, :] < (lengths + new)[:, None]
    score = jax.jit(
        lambda p, s: exact_logprobs(
            nnx.merge(nnx.graphdef(model), p), tokens, token_mask, loss_mask, sampling=s
        ),
        static_argnums=1,
    )
    for recorded, distribution in ((out.log_probs, None), (out.sampling_log_probs, sampling)):
        got = np.asarray(score(params, distribution))[loss_mask].reshape(rows, new)
        np.testing.assert_array_equal(bits(got), bits(recorded))
