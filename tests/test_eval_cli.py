"""``agentrl-jax eval`` end to end on tiny random checkpoints written here: a Hugging Face
directory as the base policy and a training checkpoint (Orbax, via the trainer's
Checkpointer) as the RL policy; every figure a valid PNG (and PDF), the report renders.
Also: naming policies by directory, and the errors for bad paths."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import jax
import numpy as np
import pytest
from eval_helpers import frozenlake_corpus, save_tiny_policy
from flax import nnx
from markdown_it import MarkdownIt
from typer.testing import CliRunner

from agentrl_jax.cli import app
from agentrl_jax.evaluation.policies import PolicyLoadError, checkpoint_step_dir, load_policy
from agentrl_jax.models import load_qwen3
from agentrl_jax.models.small_tokenizer import build_small_tokenizer
from agentrl_jax.train import Checkpointer, MetricsLogger, RLConfig, TrainConfig, init_train_state

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TINY = [
    "--maps",
    "3",
    "--map-size",
    "4",
    "--map-p",
    "0.9",
    "--random-start-goal",
    "--t-max",
    "4",
    "--max-response-tokens",
    "4",
    "--max-context",
    "512",
    "--seed",
    "0",
]


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    """``(base HF dir, RL checkpoint run dir, the RL weights' HF dir)``."""
    root = tmp_path_factory.mktemp("eval_cli")
    tokenizer = build_small_tokenizer(frozenlake_corpus(range(1, 5)), vocab_size=600)
    base_dir = save_tiny_policy(root / "base", tokenizer, seed=0)
    rl_weights = save_tiny_policy(root / "rl_weights", tokenizer, seed=1)
    config = TrainConfig(rl=RLConfig(steps=3))
    state = init_train_state(load_qwen3(rl_weights), config).replace(step=jax.numpy.asarray(3))
    checkpointer = Checkpointer(root / "run", every=1, keep=2)
    checkpointer.save(state, config, {"model_dir": str(base_dir)})
    checkpointer.wait()
    checkpointer.close()
    return base_dir, root / "run", rl_weights


def _params_equal(a, b) -> bool:
    leaves = zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b)), strict=True)
    return all(np.array_equal(x, y) for x, y in leaves)


def test_policies_by_directory(policies, tmp_path):
    base_dir, run_dir, rl_weights = policies
    base = load_policy(base_dir)
    assert base.kind == "huggingface" and base.step is None
    rl = load_policy(run_dir)
    assert rl.kind == "checkpoint" and rl.step == 3 and rl.model_dir == base_dir
    assert checkpoint_step_dir(run_dir) == run_dir / "3"
    assert _params_equal(rl.model, load_qwen3(rl_weights))  # the policy params, restored
    assert not _params_equal(rl.model, base.model)
    step = load_policy(run_dir / "3", model_dir=rl_weights)  # a step directory, model dir given
    assert step.model_dir == rl_weights and _params_equal(step.model, rl.model)
    assert rl.tokenizer.get_vocab() == base.tokenizer.get_vocab()

    with pytest.raises(PolicyLoadError, match="no such file"):
        load_policy(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PolicyLoadError, match=r"empty: neither a Hugging Face model directory"):
        load_policy(tmp_path / "empty")
    with pytest.raises(PolicyLoadError, match="has no config.json"):
        load_policy(run_dir, model_dir=tmp_path / "empty")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(PolicyLoadError, match="broken: cannot load"):
        load_policy(broken)


def _check_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    width, height = struct.unpack(">II", data[16:24])  # IHDR
    assert width > 100 and height > 100, path
    import matplotlib.image

    assert matplotlib.image.imread(path).shape[:2] == (height, width)
    assert path.with_suffix(".pdf").read_bytes()[:5] == b"%PDF-"


def _run(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, f"{args[:2]}: {result.output}\n{result.exception!r}"
    return result.output


@pytest.mark.slow
def test_eval_commands_end_to_end(policies, tmp_path):
    base_dir, run_dir, _ = policies
    out = tmp_path / "results"
    common = ["--base", str(base_dir), "--rl", str(run_dir), "--out", str(out), *TINY]
    _run("eval", "passk", *common, "--samples", "4")
    _run("eval", "passt", *common, "--samples", "2", "--k", "2")
    pool = ["--states", "8", "--group-size", "2", "--source-samples", "2"]
    _run("eval", "steps", *common, *pool, "--bins", "4")
    _run("eval", "errors", *common, *pool)
    _run("eval", "likelihood", *common, "--samples", "2")
    logger = MetricsLogger(tmp_path / "metrics.jsonl")
    for step in range(1, 6):
        logger.log(step, {"R_multi": 0.1 * step, "R_single": 0.5 - 0.02 * step, "loss": 1.0})
    output = _run(
        "eval", "report", "--out", str(out), "--training-log", str(tmp_path / "metrics.jsonl")
    )
    assert "Wrote" in output

    counts = json.loads((out / "pass_at_k_counts.json").read_text())
    assert set(counts) == {"base", "RL"} and counts["RL"]["n"] == [4, 4, 4]
    table = json.loads((out / "pass_at_t_table.json").read_text())
    assert table["budgets"] == [1, 2, 3, 4] and set(table["table"]) == {"base", "RL"}
    settings = json.loads((out / "settings" / "steps.json").read_text())
    assert settings["policies"]["RL"]["kind"] == "checkpoint" and settings["states"] == 8
    steps = json.loads((out / "step_quality_details.json").read_text())
    assert steps["states"] == 8 and set(steps["invalid_share"]) == {"base", "RL"}
    continuation = json.loads((out / "continuation.json").read_text())
    assert set(continuation) == {"base", "RL"} and continuation["base"]["n"] > 0

    report = (out / "report.md").read_text()
    tokens = MarkdownIt().parse(report)
    images = [
        child.attrs["src"]
        for t in tokens
        if t.type == "inline"
        for child in t.children
        if child.type == "image"
    ]
    expected = {
        "pass_at_k",
        "pass_at_t",
        "pass_at_t_table",
        "step_quality",
        "quality_vs_depth",
        "error_step_quality",
        "continuation",
        "likelihood_action_nll",
        "likelihood_cumulative_llr",
        "training_dynamics",
    }
    assert {Path(i).stem for i in images} == expected
    for image in images:
        _check_png(out / image)
    headings = [t.content for t in tokens if t.type == "inline" and t.map and t.level == 1]
    assert "Training dynamics" in report and "Table 1" in report and len(headings) >= 10


def _fails(*args: str) -> str:
    """The error output of a command that must fail, on one line (no box wrapping)."""
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "1000"})
    assert result.exit_code != 0, result.output
    return " ".join(result.output.split())


def test_cli_errors_name_the_problem(policies, tmp_path):
    base_dir, run_dir, _ = policies
    out = ["--out", str(tmp_path), *TINY]
    missing = tmp_path / "nope"
    assert f"{missing}: no such file" in _fails(
        "eval", "steps", "--base", str(missing), "--rl", str(run_dir), *out
    )
    assert "pass --rl" in _fails("eval", "steps", "--base", str(base_dir), *out)
    assert "T_max=4" in _fails("eval", "passt", "--base", str(base_dir), *out, "--budgets", "2,9")
    assert "--invalid must be one of" in _fails(
        "eval", "errors", "--base", str(base_dir), "--rl", str(run_dir), *out, "--invalid", "nan"
    )
    assert "holds no analysis" in _fails("eval", "report", "--out", str(tmp_path))


def test_the_cli_page_size_default_is_the_reproductions():
    from agentrl_jax.cli import eval as eval_cli
    from agentrl_jax.sampling.config import KV_PAGE_SIZE

    option = {name: default for name, _, default in eval_cli._COMMON}["kv_page_size"]
    assert option.default == KV_PAGE_SIZE
