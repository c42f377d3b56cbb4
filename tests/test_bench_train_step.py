"""Smoke test of ``agentrl-jax bench train-step`` at tiny sizes, dense and MoE (fields,
agreement; no timing)."""

import json

import pytest
from typer.testing import CliRunner

from agentrl_jax.bench import train_step as bench_train_step
from agentrl_jax.cli import app


def test_run_reports_tokens_per_second_against_pytorch():
    result, frozenlake = bench_train_step.run(sizes=("tiny",), rows=4, tokens=32, repeats=1)
    assert (
        result.unit == "tokens/s" and result.ours > 0 and result.baseline > 0 and result.ratio > 0
    )
    assert result.baseline_name == "PyTorch transformers fwd+ref fwd+bwd+AdamW"
    assert result.name == "GRPO update, tiny, synthetic mask, 4x32 tokens"
    # the FrozenLake-like row: the head runs at the sampled positions only, same first-step loss
    assert frozenlake.name == "GRPO update, tiny, frozenlake mask, 4x32 tokens"
    assert (
        frozenlake.settings["loss_positions"] == 8 and frozenlake.settings["loss_tokens"] == 4 * 8
    )
    assert result.settings["size"] == "tiny" and result.settings["rows"] == 4
    # run() itself raises unless both first-step losses and gradient norms agree (same weights,
    # same batch).
    assert result.settings["first_step_loss"] != 0
    assert result.settings["first_step_grad_norm"] == pytest.approx(
        result.settings["torch_first_step_grad_norm"], rel=1e-3
    )
    line = json.loads(result.to_json())
    assert set(line) == {"name", "unit", "ours", "baseline", "baseline_name", "settings", "ratio"}


def test_the_ragged_frozenlake_batch_is_timed_padded_and_packed():
    padded, packed = bench_train_step.run(
        sizes=("tiny",), rows=4, tokens=256, repeats=1, masks=("frozenlake-ragged",)
    )
    assert padded.name == "GRPO update, tiny, frozenlake-ragged mask, padded, 4x256 tokens"
    assert packed.settings["layout"] == "packed" and packed.settings["vs_padded"] > 0
    # rows of 1 and 2 turns (105 and 210 tokens): the two short ones share a packed row
    assert (padded.settings["rows_computed"], packed.settings["rows_computed"]) == (4, 3)
    # run() raised unless each first-step loss agrees with PyTorch's on the padded batch
    assert packed.settings["first_step_loss"] == pytest.approx(
        padded.settings["first_step_loss"], rel=1e-5
    )


def test_synthetic_batch_has_rollout_layout():
    batch = bench_train_step.synthetic_batch(rows=4, tokens=32, vocab=50)
    assert batch.tokens.shape == (4, 32) and bool(batch.token_mask.all())
    assert not bool(batch.loss_mask[:, :8].any()) and bool(
        batch.loss_mask.any()
    )  # a prompt, then responses
    assert int(batch.token_turn.max()) >= 1 and bool(
        (batch.token_turn[~batch.loss_mask] == -1).all()
    )


def test_frozenlake_batch_samples_8_of_every_105_tokens():
    batch, bound = bench_train_step.frozenlake_batch(rows=4, tokens=420, vocab=50)
    per_row = batch.loss_mask.sum(1)
    assert bound == 32 and bool((per_row == 32).all())  # 4 turns x 8 response tokens
    assert bool(batch.loss_mask[:, 97:105].all()) and not bool(batch.loss_mask[:, :97].any())
    assert int(batch.token_turn.max()) == 3 and batch.turn_mask.shape == (4, 4)


def test_run_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown size 'huge'"):
        bench_train_step.run(sizes=("huge",))
    with pytest.raises(ValueError, match="rows must be a multiple of the group size 4"):
        bench_train_step.run(sizes=("tiny",), rows=6)


def test_moe_size_is_timed_against_transformers_moe_model():
    (result,) = bench_train_step.run(
        sizes=("tiny-moe",), rows=4, tokens=32, repeats=1, masks=("synthetic",)
    )
    assert result.name == "GRPO update, tiny-moe, synthetic mask, 4x32 tokens" and result.ratio > 0
    assert result.settings["num_experts"] == 8
    assert result.settings["torch_implementation"].endswith(" experts")  # Qwen3MoeForCausalLM
    # the gradient norm is the model's: the same experts, routing and no router loss either side
    assert result.settings["first_step_grad_norm"] == pytest.approx(
        result.settings["torch_first_step_grad_norm"], rel=1e-3
    )


def test_disagreeing_gradient_norms_stop_the_run():
    bench_train_step._check_agreement("tiny, padded", (0.5, 2.0), (0.5, 2.0 * (1 + 1e-5)))
    with pytest.raises(RuntimeError, match="tiny, padded: first-step gradient norms disagree"):
        bench_train_step._check_agreement("tiny, padded", (0.5, 2.0), (0.5, 2.2))


def test_help_lists_every_size():
    out = CliRunner().invoke(app, ["bench", "train-step", "--help"], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert all(name in out.output for name in bench_train_step.SIZES)
