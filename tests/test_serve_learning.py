"""An agent program learns through the policy server (issue #59): FrozenLake written as an
ordinary ``openai`` tool-calling loop (examples/frozenlake_openai_agent.py) is played by a
tiny Qwen3 behind the server, and GRPO on the server's token records raises its success beyond
the no-update control, as the built-in rollout's learning test does
(tests/test_frozenlake_learning.py: the same one-step 4x4 maps, group size, budget, steps and
checks; the policy answers one token per turn, read as a move)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from frozenlake_learning import (
    GROUP,
    HELD_OUT_MAPS,
    STEPS,
    TASKS_PER_STEP,
    TRAIN_MAPS,
    WINDOW,
    one_step_maps,
)
from train_fakes import tiny_model

from agentrl_jax.models.tokenizer import load_tokenizer
from agentrl_jax.plugins import load_plugins
from agentrl_jax.prompts import ChatTokens
from agentrl_jax.sampling import TokenMap
from agentrl_jax.serve import ChatRenderer, PolicyServer, ServingEngine, serve_in_thread
from agentrl_jax.serve.agents import AgentEnv, AgentRunner
from agentrl_jax.train import RLConfig, TrainConfig, init_train_state, make_train_step, train
from agentrl_jax.train.state import policy_params
from envs.frozenlake import grid

pytestmark = [pytest.mark.slow, pytest.mark.optimized]

BUDGET = 5
GRPO = TrainConfig(
    rl=RLConfig(
        optimizer={"learning_rate": 6e-2}, memory={"attention": "blocked"}, steps=STEPS, seed=0
    )
)


def example():
    (module,) = load_plugins(["examples/frozenlake_openai_agent.py"])
    return module


def token_map(tok, maps) -> TokenMap:
    """Every id the agent's conversations can hold: each map's first prompt (system, tools,
    map) and every later user message (each cell, each count of moves left)."""
    agent, render = example(), ChatRenderer(tok)
    texts = []
    for tiles in maps:
        start = int(np.flatnonzero(tiles.reshape(-1) == grid.START)[0])
        first = [
            {"role": "system", "content": agent.SYSTEM},
            {"role": "user", "content": agent.observation(tiles, start, BUDGET)},
        ]
        texts.append(render.decode(render.prompt(first, agent.TOOLS)))
        for pos in range(tiles.size):
            for left in range(BUDGET):
                shown = [{"role": "user", "content": agent.observation(tiles, pos, left)}]
                texts.append(render.decode(render.continuation(shown, closed_by=None)))
    return TokenMap.from_texts(tok, texts, extra_ids=ChatTokens(tok).stop_token_ids)


@dataclasses.dataclass(frozen=True)
class Played:
    trained: list
    control: list
    held_out: dict


@functools.lru_cache(maxsize=1)
def played() -> Played:
    maps = one_step_maps(jax.random.key(0), TRAIN_MAPS + HELD_OUT_MAPS)
    tok = load_tokenizer()
    tmap = token_map(tok, maps)
    model = tiny_model(seed=0, std=0.1, vocab_size=len(tmap))
    agent = example().make_agent(maps, budget=BUDGET, max_tokens=1)
    env = AgentEnv("frozenlake_openai_test", agent, len(maps), BUDGET)
    engine = ServingEngine(
        model,
        stop_token_ids=ChatTokens(tok).stop_token_ids,
        token_map=tmap,
        slots=GROUP * TASKS_PER_STEP,
        max_context=512,
        chunk=1,
    )
    server = PolicyServer(engine, tok, max_tokens=1)
    train_ids, held_ids = np.arange(TRAIN_MAPS), np.arange(TRAIN_MAPS, len(maps))

    def batches(position):
        return train_ids[(position * TASKS_PER_STEP + np.arange(TASKS_PER_STEP)) % TRAIN_MAPS]

    with serve_in_thread(server) as url:
        runner = AgentRunner(env, server, url, group_size=GROUP, record_length=512)

        def run(step_fn):
            metrics = []
            final = train(
                init_train_state(model, GRPO),
                step_fn,
                runner,
                batches,
                GRPO,
                progress=False,
                on_step=lambda state, m: metrics.append(m),
            )
            return final, metrics

        def rates(params):
            success = []
            for k, batch in enumerate(held_ids.reshape(-1, TASKS_PER_STEP)):
                traj = runner(params, jax.random.key(100 + k), batch)
                success.append(np.asarray(traj.success).mean())
            return float(np.mean(success))

        def unchanged(state, batch):
            return state.replace(step=state.step + 1), {"update_skipped": jnp.zeros(())}

        final, trained = run(make_train_step(nnx_graphdef(model), GRPO))
        initial_state, control = run(unchanged)
        held = {
            "initial": rates(policy_params(initial_state, GRPO)),
            "final": rates(policy_params(final, GRPO)),
        }
        assert not runner.errors, runner.errors[:3]
    return Played(trained, control, held)


def nnx_graphdef(model):
    from flax import nnx

    return nnx.graphdef(model)


def test_the_agent_program_learns_beyond_the_control_through_the_server():
    run = played()
    trained = np.array([m["R_multi"] for m in run.trained])
    control = np.array([m["R_multi"] for m in run.control])
    report = f"trained R_multi {np.round(trained, 2)}, control {np.round(control, 2)}, held-out {run.held_out}"  # noqa: E501
    print(report)
    assert trained[0] == control[0], report  # the same keys and tasks play the same episodes
    gain = trained[-WINDOW:].mean() - trained[:WINDOW].mean()
    control_gain = control[-WINDOW:].mean() - control[:WINDOW].mean()
    assert gain > control_gain + 0.2, report
    assert trained[-WINDOW:].mean() > control[-WINDOW:].mean() + 0.2, report
    assert run.held_out["final"] > run.held_out["initial"] + 0.15, report
