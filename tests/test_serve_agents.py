"""Training an agent program through ``train_policy`` (issue #59): an :class:`AgentEnv` (the
FrozenLake ``openai`` agent of examples/) makes the entry point serve the policy in-process,
play every update's episodes through it, and train on the server's records. The trainer's own
log-probs of the recorded tokens equal the ones the server recorded (the sampler-trainer gap
is float rounding): nothing was re-tokenised."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

import envs
from agentrl_jax.models.tokenizer import load_tokenizer
from agentrl_jax.plugins import load_plugins
from agentrl_jax.reproduce.config import default_config
from agentrl_jax.reproduce.policy_init import random_qwen3
from agentrl_jax.serve.agents import AgentEnv
from agentrl_jax.train import read_metrics
from agentrl_jax.train import run as training


def test_train_policy_trains_an_agent_program_on_what_its_server_recorded(tmp_path):
    (example,) = load_plugins(["examples/frozenlake_openai_agent.py"])
    maps = example.default_maps(4)
    agent = example.make_agent(maps, budget=2, max_tokens=64)
    tasks = envs.EnvTasks(AgentEnv("frozenlake_openai_small", agent, 4, 2), tuple("abcd"))
    tokenizer = load_tokenizer()
    model = random_qwen3(
        len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=1024,
        seed=0,
        eos_token_ids=tokenizer.convert_tokens_to_ids(["<|im_end|>"]),
    )
    config = default_config(
        overrides=[
            "rl.steps=2",
            "rl.tasks_per_step=2",
            "rl.group_size=2",
            "rl.runs=[grpo]",
            "task.max_context=1024",
            "task.max_response_tokens=6",
        ]
    )
    before = jax.tree.map(np.asarray, nnx.state(model))
    seen = []
    params = training.train_policy(
        model, tokenizer, tasks, "grpo", config, out=tmp_path, on_step=lambda s, m: seen.append(m)
    )
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for m in seen:
        assert m["update_skipped"] == 0
        assert m["turns_mean"] > 0  # the agent played through the server
        assert m["sampler_gap_max"] < 1e-4, m  # the recorded log-probs are the trainer's
    changed = jax.tree.map(lambda a, b: not np.array_equal(np.asarray(a), b), params, before)
    assert any(jax.tree.leaves(changed))
