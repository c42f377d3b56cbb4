"""ActionNLL and cumulative LLR (§7.4) against independent teacher-forced log-probs: each
conversation scored alone, unpadded, by transformers' reference Qwen3 (the checkpoints are
saved by transformers; our model loads them), and against the sampler's recorded log-probs;
two tiny random Qwen3 checkpoints play base and "RL"."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from eval_helpers import frozenlake_corpus, save_tiny_policy
from fake_devices import fake_devices_env
from flax import nnx
from hf_qwen3 import hf_logits, load_hf_qwen3

from agentrl_jax.evaluation import likelihood
from agentrl_jax.evaluation.analyses import likelihood as likelihood_analysis
from agentrl_jax.evaluation.passt import EVAL_SAMPLING, eval_rollout_config
from agentrl_jax.evaluation.policies import load_policy, sampler_policies
from agentrl_jax.models.small_tokenizer import build_small_tokenizer
from agentrl_jax.rollout import MultiTurnRollout
from agentrl_jax.sampling import TokenMap
from agentrl_jax.train import RLConfig, TrainConfig
from agentrl_jax.train.scoring import sequence_logprobs
from envs.frozenlake import maps as fl_maps
from envs.frozenlake.text_env import FrozenLakeTextConfig, FrozenLakeTextEnv


def reference_turn_logprobs(logits_fn, traj) -> np.ndarray:
    """Each row's conversation, unpadded and alone: ``[N, T]`` summed response log-probs."""
    out = np.zeros(traj.turn_mask.shape)
    for row in range(traj.tokens.shape[0]):
        length = int(traj.token_mask[row].sum())
        ids = np.asarray(traj.tokens[row, :length])
        logp = jax.nn.log_softmax(jnp.asarray(logits_fn(ids), jnp.float32), axis=-1)
        picked = np.asarray(logp[:-1][np.arange(length - 1), ids[1:]], np.float64)
        for pos in np.flatnonzero(traj.loss_mask[row, :length]):  # pos >= 1: a prompt comes first
            out[row, traj.token_turn[row, pos]] += picked[pos - 1]
    return out


@pytest.fixture(scope="module")
def policy_dirs(tmp_path_factory):
    """The base and RL policies' Hugging Face directories."""
    tokenizer = build_small_tokenizer(frozenlake_corpus(), vocab_size=400)
    root = tmp_path_factory.mktemp("policies")
    return [
        save_tiny_policy(root / name, tokenizer, seed=seed)
        for name, seed in (("base", 0), ("rl", 1))
    ]


@pytest.fixture(scope="module")
def setup(policy_dirs):
    """Base and RL policies, trajectories of each played with the whole history, and the
    reference per-turn log-probs ``{(trajectory set, model): [N, T]}``."""
    dirs = policy_dirs
    base, rl = (load_policy(d) for d in dirs)
    env = FrozenLakeTextEnv(
        fl_maps.generate(jax.random.key(0), 3, size=3, p=0.9), FrozenLakeTextConfig(t_max=4)
    )
    config = eval_rollout_config(group_size=2, budget=4, max_response_tokens=6, max_context=512)
    runner = MultiTurnRollout(env, base.tokenizer, config)
    policies = sampler_policies(base, rl, min_rows=1)
    trajectories = {
        name: jax.device_get(runner(p, np.arange(3), jax.random.key(k)).trajectory)
        for k, (name, p) in enumerate(zip(("base", "RL"), policies))
    }
    references = {}
    for model_name, directory in (("base", dirs[0]), ("RL", dirs[1])):
        torch_model = load_hf_qwen3(directory)
        for name, traj in trajectories.items():
            references[name, model_name] = reference_turn_logprobs(
                lambda ids: hf_logits(torch_model, ids[None])[0], traj
            )
    return base, rl, trajectories, references


def test_turn_logprobs_equal_teacher_forced_forward(setup):
    base, rl, trajectories, references = setup
    for name, traj in trajectories.items():
        assert traj.turn_mask.sum() > 6 and traj.loss_mask.sum() > 20  # not vacuous
        for model_name, policy in (("base", base), ("RL", rl)):
            got = likelihood.turn_logprobs(policy.model, traj, rows_per_batch=4)
            np.testing.assert_allclose(got, references[name, model_name], atol=1e-5, rtol=0)
            assert np.all(got[~traj.turn_mask] == 0)


def test_turn_logprobs_match_the_sampler(setup):
    """The sampler recorded each token's log-prob under its own unmodified distribution."""
    _, rl, trajectories, _ = setup
    traj = trajectories["RL"]
    recorded = np.zeros(traj.turn_mask.shape)
    rows, cols = np.nonzero(traj.loss_mask)
    np.add.at(recorded, (rows, traj.token_turn[rows, cols]), traj.logprobs[rows, cols])
    np.testing.assert_allclose(
        likelihood.turn_logprobs(rl.model, traj, rows_per_batch=4), recorded, atol=1e-4, rtol=0
    )


def test_a_few_rows_run_as_one_small_batch_not_padded_to_rows_per_batch(setup, monkeypatch):
    """6 rows with ``rows_per_batch=64``: one forward of 8 rows (the power of two that holds
    them), not 64 (a 10x waste on a small evaluation); the same log-probs."""
    base, _, trajectories, references = setup
    batches = []
    real = likelihood.scoring_program

    def recording(*args, **kwargs):
        program = real(*args, **kwargs)

        def run(params, tokens, *rest):
            batches.append(tokens.shape[0])
            return program(params, tokens, *rest)

        return run

    monkeypatch.setattr(likelihood, "scoring_program", recording)
    traj = trajectories["base"]
    got = likelihood.turn_logprobs(base.model, traj, rows_per_batch=64)
    assert len(traj.turn_mask) == 6 and batches == [8]
    np.testing.assert_allclose(got, references["base", "base"], atol=1e-5, rtol=0)


def test_action_nll_and_llr_are_the_teacher_forced_differences(setup):
    base, rl, trajectories, references = setup
    data = likelihood.likelihood_data(base.model, rl.model, trajectories, rows_per_batch=4)
    nll = data.action_nll()
    assert set(nll) == {"base responses", "RL responses"}
    sets = data.llr_sets()
    for name, traj in trajectories.items():
        ref_base, ref_rl = references[name, "base"], references[name, "RL"]
        mask = np.asarray(traj.turn_mask)
        np.testing.assert_allclose(nll[f"{name} responses"], -ref_base[mask], atol=1e-5, rtol=0)
        logp_rl, logp_base, turn_mask, success = sets[f"{name} trajectories"]
        cum = likelihood_analysis.cumulative_llr(logp_rl, logp_base, turn_mask)
        np.testing.assert_allclose(
            cum, np.cumsum(np.where(mask, ref_rl - ref_base, 0), axis=1), atol=1e-5, rtol=0
        )
        np.testing.assert_array_equal(success, traj.success)
        valid = data.action_nll(valid_only=True)[f"{name} responses"]
        np.testing.assert_allclose(
            valid, -ref_base[mask & np.asarray(traj.action_valid)], atol=1e-5
        )
    assert np.all(np.concatenate(list(nll.values())) > 0)


def test_token_map_scores_the_mapped_ids(setup):
    base, _, trajectories, _ = setup
    traj = trajectories["base"]
    used = np.unique(np.asarray(traj.tokens)[np.asarray(traj.token_mask)])
    token_map = TokenMap(used + 1000)  # tokenizer ids 1000+ -> model ids 0..K-1
    shifted = dataclasses.replace(traj, tokens=np.where(traj.token_mask, traj.tokens + 1000, 0))
    mapped = dataclasses.replace(
        traj, tokens=np.where(traj.token_mask, np.searchsorted(used, traj.tokens), 0)
    )
    np.testing.assert_allclose(
        likelihood.turn_logprobs(base.model, shifted, token_map=token_map),
        likelihood.turn_logprobs(base.model, mapped),
        atol=1e-6,
    )


def test_windowed_records_are_refused(setup):
    base, _, trajectories, _ = setup
    traj = trajectories["base"]
    starts = np.where(traj.turn_mask, traj.prefix_len[:, None] + 5, 0)
    windowed = dataclasses.replace(traj, context_start=starts)
    with pytest.raises(ValueError, match="history window"):
        likelihood.turn_logprobs(base.model, windowed)


def test_blocked_attention_scores_the_same(setup):
    """The memory-bounded forward (flash-style attention, no [L, L] scores) gives the same
    teacher-forced log-probs as the reference."""
    base, _, trajectories, references = setup
    for name, traj in trajectories.items():
        got = likelihood.turn_logprobs(base.model, traj, rows_per_batch=4, attention="blocked")
        np.testing.assert_allclose(got, references[name, "base"], atol=1e-5, rtol=0)


def test_the_head_runs_only_at_the_sampled_positions(setup):
    """The scoring program never builds ``[rows, L, V]`` logits: only chunks of the bounded
    sampled positions (the trainer's :mod:`agentrl_jax.train.logprobs`)."""
    base = setup[0]
    graphdef, params = nnx.split(base.model)
    rows, width, bound, vocab = 4, 256, 64, base.model.config.vocab_size
    tokens, mask = jnp.zeros((rows, width), jnp.int32), jnp.ones((rows, width), bool)
    program = likelihood.scoring_program(graphdef, likelihood.scoring_config("blocked", bound))
    text = program.lower(params, tokens, mask, mask).compile().as_text()
    assert f"[{rows},{bound},{vocab}]" in text
    assert all(f"[{rows},{n},{vocab}]" not in text for n in (width - 1, width)), (
        "full-length logits"
    )
    assert (
        likelihood.scoring_program(graphdef, likelihood.scoring_config("blocked", bound)) is program
    )


_MESH_CHILD = """
import sys
import numpy as np
from agentrl_jax.evaluation import likelihood
from agentrl_jax.models.checkpoints import load_qwen3
from agentrl_jax.sharding import MeshConfig, build_mesh
from agentrl_jax.trajectory import Trajectory
data = np.load(sys.argv[2])
traj = Trajectory.from_arrays({k: data[k] for k in data.files if k != "expected"})
mesh = build_mesh(MeshConfig(data=1, fsdp=8))
model = load_qwen3(sys.argv[1], mesh=mesh)
got = likelihood.turn_logprobs(model, traj, rows_per_batch=3, attention="blocked")  # 3 rows -> 8
np.testing.assert_allclose(got, data["expected"], atol=1e-5, rtol=0)
print("OK", got.shape)
"""


def test_scoring_on_an_fsdp_mesh_gives_the_single_device_numbers(setup, policy_dirs, tmp_path):
    """On 8 fake devices, parameters sharded by FSDP: rows split over the batch axes
    (rows_per_batch rounded up to them), the same log-probs as on one device."""
    base, _, trajectories, _ = setup
    traj = trajectories["base"]
    expected = likelihood.turn_logprobs(base.model, traj, rows_per_batch=4)
    fields = {f.name: np.asarray(getattr(traj, f.name)) for f in dataclasses.fields(traj)}
    np.savez(tmp_path / "traj.npz", expected=expected, **fields)
    child = subprocess.run(
        [sys.executable, "-c", _MESH_CHILD, str(policy_dirs[0]), str(tmp_path / "traj.npz")],
        env=fake_devices_env(8),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0 and "OK" in child.stdout, child.stderr[-3000:]


def test_the_rollout_records_the_sampling_distributions_log_probs(setup):
    """``Trajectory.sampling_logprobs`` of a multi-turn rollout (temperature 0.6, top-p 0.9,
    cache continuation) equal the trainer's teacher-forced scores under
    ``TrainConfig(scoring="sampling")``; ``logprobs`` stay the model distribution's."""
    _, rl, trajectories, _ = setup
    traj = trajectories["RL"]
    config = TrainConfig(
        rl=RLConfig(
            scoring="sampling",
            sampling={"temperature": EVAL_SAMPLING.temperature, "top_p": EVAL_SAMPLING.top_p},
        )
    )
    scored, _ = sequence_logprobs(
        rl.model,
        jnp.asarray(traj.tokens),
        jnp.asarray(traj.token_mask),
        loss_mask=jnp.asarray(traj.loss_mask),
        forward=config.forward,
    )
    mask = np.asarray(traj.loss_mask)
    np.testing.assert_allclose(
        np.asarray(scored)[mask], np.asarray(traj.sampling_logprobs)[mask], atol=1e-5
    )
    assert np.abs(np.asarray(traj.sampling_logprobs) - np.asarray(traj.logprobs))[mask].max() > 1e-2


def test_token_scores_are_transformers_log_probs_and_entropies(setup, policy_dirs):
    """The erosion analysis' per-token scores: each sampled token's log-prob and the entropy
    of the distribution that predicts it, against transformers' logits (row by row)."""
    base, _, trajectories, _ = setup
    traj = trajectories["RL"]
    logp, entropy = likelihood.token_scores(base.model, traj, rows_per_batch=4)
    torch_model = load_hf_qwen3(policy_dirs[0])
    scored = np.asarray(traj.loss_mask, bool) & np.asarray(traj.token_mask, bool)
    assert np.all(logp[~scored] == 0) and np.all(entropy[~scored] == 0)
    for row in range(traj.tokens.shape[0]):
        length = int(traj.token_mask[row].sum())
        ids = np.asarray(traj.tokens[row, :length])
        ref = jax.nn.log_softmax(jnp.asarray(hf_logits(torch_model, ids[None])[0], jnp.float32))
        ref = np.asarray(ref, np.float64)
        for pos in np.flatnonzero(scored[row, :length]):
            np.testing.assert_allclose(logp[row, pos], ref[pos - 1, ids[pos]], atol=1e-5)
            want = -np.sum(np.exp(ref[pos - 1]) * ref[pos - 1])
            np.testing.assert_allclose(entropy[row, pos], want, atol=1e-4)
