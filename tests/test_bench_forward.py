"""Smoke test of ``agentrl-jax bench forward`` at tiny sizes (no timing is asserted)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from agentrl_jax.bench import forward
from agentrl_jax.cli import app


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
