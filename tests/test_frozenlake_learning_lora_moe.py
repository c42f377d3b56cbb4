"""Short GRPO runs learn FrozenLake 4x4 as tests/test_frozenlake_learning.py's do, with the
policy trained through LoRA adapters (issue #47) or as a mixture of experts with routing replay
(issue #58): the same setting, checks and margins (tests/frozenlake_learning.py), each against
its own no-update control (its policy differs from the dense runs'). A file of their own so that
the suite's two workers share the learning runs (pytest-xdist hands out whole files).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from frozenlake_learning import (
    Run,
    assert_held_out_success_rises,
    assert_learns_beyond_the_control,
    learning_run,
)
from test_frozenlake_learning import GRPO

from agentrl_jax.models.lora import LoraConfig

# ~1 min on the shared 2-core CPU, at -O1 as the other learning runs (tests/conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.optimized]

# GRPO training LoRA adapters (rank 8, alpha 32, every attention and MLP projection) on the
# frozen base: the optimizer holds the adapters only and the KL reference is the base with the
# adapters off. Its policy's weights are N(0, 0.4), not the others' N(0, 0.1): at 0.1 the
# tiny model's answers are set by its embeddings and norms, which LoRA leaves frozen (measured:
# training only the seven projections, at full rank and without LoRA, does not learn there
# within the 10 steps either), while at 0.4 the layers shape them.
LORA_STD = 0.4
LORA_GRPO = dataclasses.replace(
    GRPO,
    rl=dataclasses.replace(
        GRPO.rl,
        lora=LoraConfig(rank=8, alpha=32.0),
        optimizer=dataclasses.replace(GRPO.rl.optimizer, learning_rate=5e-2),
    ),
)


@pytest.fixture(scope="module")
def lora_grpo() -> Run:
    return learning_run(LORA_GRPO, std=LORA_STD)


def test_lora_grpo_learns_beyond_the_control_with_the_base_frozen(lora_grpo):
    assert all(np.isfinite(m["loss"]) and m["update_skipped"] == 0 for m in lora_grpo.trained)
    assert_learns_beyond_the_control(lora_grpo)
    assert_held_out_success_rises(lora_grpo)


# GRPO on a tiny Qwen3 MoE (4 experts of width 16, 2 per token, in both layers) with routing
# replay: the rollouts record each sampled token's experts and the updates route those tokens
# through them (issue #58).
MOE = (("num_experts", 4), ("num_experts_per_tok", 2), ("moe_intermediate_size", 16))
MOE_GRPO = dataclasses.replace(GRPO, rl=dataclasses.replace(GRPO.rl, routing_replay=True))


@pytest.fixture(scope="module")
def moe_grpo() -> Run:
    return learning_run(MOE_GRPO, model=MOE)


def test_moe_grpo_with_routing_replay_learns_beyond_the_control(moe_grpo):
    trained = moe_grpo.trained
    assert all(np.isfinite(m["loss"]) and m["update_skipped"] == 0 for m in trained)
    # the sampled tokens' experts reached the train step: the router's own choice is reported
    assert all(0 <= m["routing_differs"] < 0.5 for m in trained)
    assert_learns_beyond_the_control(moe_grpo)
    assert_held_out_success_rises(moe_grpo)
