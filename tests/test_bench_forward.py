"""Smoke test of ``agentrl-jax bench forward`` at tiny sizes, dense and MoE (no timing is
asserted)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from agentrl_jax.bench import forward, lora
from agentrl_jax.cli import app
from agentrl_jax.models import Qwen3Config


def test_run_measures_ours_and_transformers_on_the_same_computation():
    (result,) = forward.run(configs=["tiny"], batch=2, seq_len=8, repeats=1)
    assert result.unit == "tokens/s" and result.ours > 0 and result.baseline > 0
    assert result.baseline_name.startswith("transformers")
    assert result.ratio == pytest.approx(result.ours / result.baseline)
    assert result.settings["logits_max_abs_diff"] < 1e-4  # both sides computed the same logits


def test_cli_prints_one_json_object_per_config():
    out = CliRunner().invoke(
        app,
        [
            "bench",
            "forward",
            "--config",
            "tiny",
            "--batch",
            "1",
            "--seq-len",
            "4",
            "--repeats",
            "1",
            "--json",
        ],
    )
    assert out.exit_code == 0, out.output
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1
    assert lines[0]["settings"]["config"] == "tiny" and lines[0]["ratio"] > 0


def test_unknown_config_is_rejected():
    with pytest.raises(ValueError, match="unknown config"):
        forward.run(configs=["qwen3-9000b"])


def test_moe_shape_runs_against_transformers_moe_model():
    (result,) = forward.run(configs=["tiny-moe"], batch=2, seq_len=8, repeats=1)
    assert result.settings["model_type"] == "qwen3_moe" and result.ratio > 0
    assert result.baseline_name.endswith(" experts)")  # transformers' experts implementation
    assert result.settings["logits_max_abs_diff"] < 1e-4  # same routing, same logits


def test_moe_shapes_are_chosen_by_their_config():
    dense = [name for name, dims in forward.CONFIGS.items() if not forward.is_moe(dims)]
    assert dense == list(forward.DENSE_CONFIGS)
    a3b = Qwen3Config(**forward.CONFIGS["qwen3-30b-a3b-1layer"])  # Qwen3-30B-A3B, 1 layer
    assert (a3b.num_experts, a3b.num_experts_per_tok, a3b.moe_intermediate_size) == (128, 8, 768)
    assert a3b.moe_layers == (True,) and not a3b.tie_word_embeddings
    with pytest.raises(ValueError, match="unknown size 'tiny-moe'"):  # no LoRA on experts
        lora.run(sizes=["tiny-moe"])


def test_help_lists_every_shape():
    out = CliRunner().invoke(app, ["bench", "forward", "--help"], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert all(name in out.output for name in forward.CONFIGS)
