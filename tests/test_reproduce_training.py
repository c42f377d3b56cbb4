"""The reproduction's RL plumbing: trimming trajectories to buckets, task batches, run specs,
and a short run whose programs compile once per shape."""

from __future__ import annotations

import importlib.machinery
import sys
import types
from pathlib import Path

import jax
import numpy as np
import pytest
from compile_counter import count_backend_compiles, count_backend_compiles_by_name

from agentrl_jax.errors import ConfigError
from agentrl_jax.models.small_tokenizer import build_small_tokenizer
from agentrl_jax.reproduce import training
from agentrl_jax.reproduce.config import RLSettings, load_config
from agentrl_jax.reproduce.pipeline import make_tasks
from agentrl_jax.reproduce.policy_init import random_qwen3
from agentrl_jax.reproduce.studies.frozenlake import frozenlake_corpus
from agentrl_jax.sampling import Paging
from agentrl_jax.train import read_metrics
from agentrl_jax.trajectory import Trajectory, bucket_width, row_lengths


def _trajectory(lengths, width=384, turns=3):
    traj = Trajectory.zeros(len(lengths), width, turns)
    mask = np.arange(width)[None, :] < np.asarray(lengths)[:, None]
    tokens = np.where(mask, np.arange(1, width + 1)[None, :], 0).astype(np.int32)
    return traj.replace(
        tokens=tokens,
        token_mask=mask,
        loss_mask=mask & (np.arange(width) % 2 == 1),
        token_turn=np.where(mask, 0, -1).astype(np.int32),
        logprobs=np.where(mask, -0.5, 0.0).astype(np.float32),
    )


def test_row_lengths_reach_each_rows_last_real_token():
    mask = np.zeros((4, 10), bool)
    mask[0, :3] = True
    mask[1, [0, 6]] = True  # a gap: the width must still reach slot 6
    mask[2, :] = True
    assert row_lengths(mask).tolist() == [3, 7, 10, 0]
    assert [bucket_width(n, 300, 64) for n in (0, 64, 65, 257)] == [64, 64, 128, 300]


@pytest.mark.parametrize(
    "used, width", [(1, 64), (64, 64), (65, 128), (129, 256), (300, 384), (384, 384)]
)
def test_trim_tokens_to_power_of_two_buckets_keeps_every_real_token(used, width):
    traj = _trajectory([used, max(used // 2, 1)])
    trimmed = training.trim_tokens(traj)
    assert trimmed.tokens.shape == (2, width)
    for field in training.TOKEN_FIELDS:
        full, cut = np.asarray(getattr(traj, field)), np.asarray(getattr(trimmed, field))
        np.testing.assert_array_equal(cut, full[:, :width])
        assert not np.any(np.asarray(traj.token_mask)[:, width:])  # nothing real was cut
    np.testing.assert_array_equal(trimmed.turn_mask, traj.turn_mask)  # per-turn fields untouched


def test_task_batches_are_a_pure_function_of_seed_and_position():
    batch = training.task_batch_fn(20, 8, seed=3)
    first = batch(5)
    assert len(set(first.tolist())) == 8 and first.min() >= 0 and first.max() < 20
    np.testing.assert_array_equal(first, training.task_batch_fn(20, 8, seed=3)(5))
    assert not np.array_equal(batch(5), batch(6))
    with pytest.raises(ValueError, match="exceeds"):
        training.task_batch_fn(4, 8, seed=0)


def test_run_specs_same_updates_different_budget_and_algorithm():
    rl = RLSettings(runs=("grpo", "budgetmix", "gigpo-budgetmix", "ppo"), steps=7)
    specs = {s.name: s for s in training.run_specs(rl)}
    assert [s.train_config.total_steps for s in specs.values()] == [7] * 4
    assert not specs["grpo"].budget_mix and specs["budgetmix"].budget_mix
    assert specs["grpo"].train_config.algorithm == specs["budgetmix"].train_config.algorithm
    assert specs["gigpo-budgetmix"].train_config.budget_anchors
    assert not specs["budgetmix"].train_config.budget_anchors  # GRPO has no anchors
    assert specs["ppo"].train_config.uses_critic and not specs["grpo"].train_config.uses_critic
    config = training.rollout_config(
        specs["budgetmix"],
        rl,
        t_max=12,
        max_response_tokens=8,
        max_context=384,
        valid_vocab_size=None,
    )
    assert config.budget is None  # BudgetMix draws per group
    assert (
        training.rollout_config(
            specs["grpo"],
            rl,
            t_max=12,
            max_response_tokens=8,
            max_context=384,
            valid_vocab_size=None,
        ).budget
        == 12
    )


def test_the_rollout_memory_settings_reach_the_rollout_and_the_policy():
    rl = RLSettings(
        group_size=4,
        max_rows_per_call=8,
        kv_cache_dtype="bfloat16",
        prefill_chunk=64,
        generation_layout="training",
    )
    spec = training.run_specs(rl)[0]
    assert (
        training.rollout_config(
            spec, rl, t_max=4, max_response_tokens=8, max_context=256, valid_vocab_size=None
        ).max_rows_per_call
        == 8
    )
    model = random_qwen3(
        300,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=256,
    )
    policy = training.sampler_policy(model, rl)
    assert (policy.cache_dtype, policy.prefill_chunk, policy.generation_layout) == (
        np.dtype("bfloat16"),
        64,
        "training",
    )
    default = training.sampler_policy(model, RLSettings())
    assert (default.cache_dtype, default.prefill_chunk, default.row_multiple) == (None, None, 1)
    assert default.paging == Paging(page_size=16)  # the paged engine is the default
    assert training.sampler_policy(model, RLSettings(kv_page_size=None)).paging is None
    paged = RLSettings(group_size=4, max_rows_per_call=8, kv_page_size=16, kv_pages=40, refill=True)
    assert training.sampler_policy(model, paged).paging == Paging(page_size=16, num_pages=40)
    with pytest.raises(ConfigError, match="rl.kv_pages: a pool of 40 pages needs the paged KV"):
        RLSettings(kv_pages=40, kv_page_size=None)
    assert training.rollout_config(
        spec, paged, t_max=4, max_response_tokens=8, max_context=256, valid_vocab_size=None
    ).refill
    with pytest.raises(ConfigError, match="rl.refill: continuous batching needs"):
        RLSettings(refill=True)


def test_live_metric_sinks_that_cannot_work_are_refused_before_any_work(monkeypatch):
    import agentrl_jax.train.loop as loop

    monkeypatch.setattr(loop, "tensorboard_available", lambda: False)
    monkeypatch.setattr(training, "tensorboard_available", lambda: False)
    with pytest.raises(ConfigError, match="rl.tensorboard: true needs tensorboardX"):
        RLSettings(tensorboard=True)
    assert not training._tensorboard(RLSettings())  # auto: nothing to write with, no error
    monkeypatch.setitem(sys.modules, "wandb", None)  # not importable
    with pytest.raises(ConfigError, match="rl.wandb_project: logging to W&B project 'x' needs"):
        RLSettings(wandb_project="x")
    with pytest.raises(ConfigError, match="rl.tensorboard: must be one of"):
        RLSettings(tensorboard="yes")


# ---------------------------------------------------------------------------- placement
CI_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "frozenlake_ci.yaml"


LIVE_METRICS = (
    "R_multi",
    "R_single",
    "loss",
    "loss/policy_clip",
    "loss/kl",
    "approx_kl",
    "ratio_mean",
    "policy_clip/clip_fraction",
    "entropy_estimate",
    "grad_norm",
    "update_skipped",
    "skipped_updates",
    "rollout_tokens_per_s",
    "rollout_turns_per_s",
    "time/rollout_s",
    "time/score_s",
    "time/update_s",
)


def test_six_updates_compile_once_per_shape_and_log_every_metric_live(tmp_path, monkeypatch):
    """A 6-update BudgetMix GRPO run at CI size (16 rows, no warm start): the train step and every
    sampler program (init, append per width, decode, take_rows) compile exactly once per
    distinct input shape, i.e. no update compiles a program again because its inputs were
    placed differently (uncommitted counters and keys in the first update, committed ones
    returned by the train step after it). Its metrics reach TensorBoard (read back with
    TensorBoard's own ``EventAccumulator``) and a W&B run (a stand-in ``wandb`` module) at
    every step, each equal to the ``metrics.jsonl`` record."""
    logged = []

    class FakeRun:
        def log(self, values, step):
            logged.append((step, values))

        def finish(self):
            logged.append("finished")

    fake_wandb = types.ModuleType("wandb")
    fake_wandb.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake_wandb.init = lambda **kwargs: (logged.append(kwargs), FakeRun())[1]
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb)
    config = load_config(
        CI_CONFIG,
        [
            "warm_start.enabled=false",
            "rl.steps=6",
            "rl.runs=[budgetmix]",
            "rl.tasks_per_step=4",
            "rl.checkpoint_every=3",
            "rl.tensorboard=true",
            "rl.wandb_project=agentrl-test",
        ],
    )
    t, m = config.task, config.model
    tasks = make_tasks(config)
    tokenizer = build_small_tokenizer(
        frozenlake_corpus(tasks.train.env.instructions(), tasks.train.env.maps, t.t_max),
        vocab_size=m.tokenizer_vocab,
        split_words=False,
    )
    model = random_qwen3(
        len(tokenizer),
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_hidden_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads,
        head_dim=m.head_dim,
        max_position_embeddings=2048,
        eos_token_ids=tokenizer.convert_tokens_to_ids(["<|im_end|>"]),
    )
    policies, step_shapes, step_compiles = [], set(), []
    make_policy, make_step = training.sampler_policy, training.make_train_step

    def recording_policy(*args, **kwargs):
        policies.append(make_policy(*args, **kwargs))
        return policies[-1]

    def recording_step(*args, **kwargs):
        step = make_step(*args, **kwargs)

        def call(state, batch):
            step_shapes.add(jax.tree.map(np.shape, batch))
            with count_backend_compiles() as events:
                out = jax.block_until_ready(step(state, batch))
            step_compiles.append(len(events))
            return out

        return call

    monkeypatch.setattr(training, "sampler_policy", recording_policy)
    monkeypatch.setattr(training, "make_train_step", recording_step)
    spec = training.run_specs(config.rl)[0]
    with count_backend_compiles_by_name() as compiles:
        training.run_training(
            spec,
            model,
            tasks.train.env,
            tokenizer,
            config.rl,
            run_dir=tmp_path,
            t_max=t.t_max,
            max_response_tokens=t.max_response_tokens,
            max_context=t.max_context,
            metadata={},
            quality_scorer=t.study.step_scorer(tasks.train),
        )
    assert len(step_compiles) == 6
    assert sum(step_compiles) == len(step_shapes), (step_compiles, step_shapes)
    traces = policies[0].trace_counts
    programs = {
        "init": "jit(_init_impl)",
        "append": "jit(_append_impl)",
        "decode": "jit(_decode_impl)",
        "take_rows": "jit(_take_impl)",
    }
    assert min(traces[kind] for kind in ("init", "append", "decode", "take_rows")) >= 1
    for kind, name in programs.items():
        assert compiles[name] == traces[kind], (kind, dict(compiles), dict(traces))

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = read_metrics(tmp_path / "metrics.jsonl")
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    for name in LIVE_METRICS:
        scalars = events.Scalars(name)
        assert [e.step for e in scalars] == list(range(1, 7)), name
        np.testing.assert_allclose(
            [e.value for e in scalars], [r[name] for r in records], rtol=1e-6, err_msg=name
        )
    assert logged[0]["project"] == "agentrl-test" and logged[0]["name"] == spec.name
    assert [step for step, _ in logged[1:-1]] == list(range(1, 7)) and logged[-1] == "finished"
    for (_, values), record in zip(logged[1:-1], records):
        assert {name: values[name] for name in LIVE_METRICS} == pytest.approx(
            {name: record[name] for name in LIVE_METRICS}
        )
