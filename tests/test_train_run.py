"""The training entry point (agentrl_jax.train.run): trimming trajectories to buckets, task
batches, a run's update and rollouts from one config, and a short run whose programs compile
once per shape."""

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
from agentrl_jax.evaluation.evaluate_policies import make_tasks
from agentrl_jax.models.small_tokenizer import build_small_tokenizer
from agentrl_jax.reproduce.config import default_config, load_config
from agentrl_jax.reproduce.policy_init import random_qwen3
from agentrl_jax.reproduce.studies.frozenlake import frozenlake_corpus
from agentrl_jax.sampling import Paging, SamplerPolicy
from agentrl_jax.sampling.config import EngineConfig
from agentrl_jax.train import RLConfig, read_metrics, train_config
from agentrl_jax.train import run as training
from agentrl_jax.trajectory import TOKEN_FIELDS, Trajectory, bucket_width, row_lengths


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
    for field in TOKEN_FIELDS:
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


def test_runs_share_their_updates_and_differ_in_budget_and_algorithm():
    config = default_config(overrides=["rl.runs=[grpo, budgetmix, gigpo-budgetmix, ppo]"])
    specs = {s.name: s for s in config.rl.resolved_runs()}
    updates = {name: train_config(config, s) for name, s in specs.items()}
    assert all(u.rl is config.rl for u in updates.values())  # one section, never copied
    assert not specs["grpo"].budget_mix and specs["budgetmix"].budget_mix
    assert updates["grpo"].algorithm == updates["budgetmix"].algorithm
    assert updates["gigpo-budgetmix"].budget_anchors
    assert not updates["budgetmix"].budget_anchors  # GRPO has no anchors
    assert updates["ppo"].uses_critic and not updates["grpo"].uses_critic
    assert updates["grpo"].loss_positions == 12 * 8  # the task's T_max x response tokens
    assert training.rollout_config(config, specs["budgetmix"]).budget is None  # drawn per group
    assert training.rollout_config(config, specs["grpo"]).budget == 12


def test_the_rollout_memory_settings_reach_the_rollout_and_the_policy():
    config = default_config(
        overrides=[
            "rl.group_size=4",
            "rl.max_rows_per_call=8",
            "engine.kv_cache_dtype=bfloat16",
            "engine.prefill_chunk=64",
            "engine.generation_layout=training",
        ]
    )
    spec = config.rl.resolved_runs()[0]
    assert training.rollout_config(config, spec).max_rows_per_call == 8
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
    policy = SamplerPolicy.from_engine(model, config.engine)
    assert (policy.cache_dtype, policy.prefill_chunk, policy.generation_layout) == (
        np.dtype("bfloat16"),
        64,
        "training",
    )
    default = SamplerPolicy.from_engine(model, EngineConfig())
    assert (default.cache_dtype, default.prefill_chunk, default.row_multiple) == (None, None, 1)
    assert default.paging == Paging(page_size=16)  # the paged engine is the default
    assert SamplerPolicy.from_engine(model, EngineConfig(kv_page_size=None)).paging is None
    paged = EngineConfig(kv_page_size=16, kv_pages=40)
    assert SamplerPolicy.from_engine(model, paged).paging == Paging(page_size=16, num_pages=40)
    with pytest.raises(ConfigError, match="engine.kv_pages: a pool of 40 pages needs the paged"):
        EngineConfig(kv_pages=40, kv_page_size=None)
    refill = default_config(
        overrides=["rl.group_size=4", "rl.max_rows_per_call=8", "rl.refill=true"]
    )
    assert training.rollout_config(refill, spec).refill
    with pytest.raises(ConfigError, match="rl.refill: continuous batching needs"):
        RLConfig(refill=True)


def test_live_metric_sinks_that_cannot_work_are_refused_before_any_work(monkeypatch):
    import agentrl_jax.train.sinks as sinks

    monkeypatch.setattr(sinks, "tensorboard_available", lambda: False)
    monkeypatch.setattr(training, "tensorboard_available", lambda: False)
    with pytest.raises(ConfigError, match="rl.logging.tensorboard: true needs tensorboardX"):
        RLConfig(logging={"tensorboard": True})
    config = default_config()  # auto: nothing to write with, no error, no writer
    spec = config.rl.resolved_runs()[0]
    assert training._logger(config, spec, Path("/nowhere"), 0, None).writer is None
    monkeypatch.setitem(sys.modules, "wandb", None)  # not importable
    with pytest.raises(
        ConfigError, match="rl.logging.wandb_project: logging to W&B project 'x' needs"
    ):
        RLConfig(logging={"wandb_project": "x"})
    with pytest.raises(ConfigError, match="rl.logging.tensorboard: must be one of"):
        RLConfig(logging={"tensorboard": "yes"})


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
            "rl.checkpoint.every=3",
            "rl.logging.tensorboard=true",
            "rl.logging.wandb_project=agentrl-test",
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
    make_policy, make_step = SamplerPolicy.from_engine, training.make_train_step

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

    monkeypatch.setattr(SamplerPolicy, "from_engine", recording_policy)
    monkeypatch.setattr(training, "make_train_step", recording_step)
    spec = config.rl.resolved_runs()[0]
    with count_backend_compiles_by_name() as compiles:
        training.train_policy(
            model,
            tokenizer,
            tasks.train,
            spec,
            config,
            out=tmp_path,
            quality_scorer=config.study.step_scorer(tasks.train),
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
