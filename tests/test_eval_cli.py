"""``agentrl-jax eval``, the one front door to the analyses for any registered environment, end
to end on tiny random checkpoints written here: a results folder is evaluated at its own
task settings (its T_max and map size, not the paper's), named policies (a Hugging Face
directory as the base, a training checkpoint, Orbax via the trainer's Checkpointer, as the RL
policy) under a config; every figure a valid PNG (and PDF), the report renders. Also: naming
policies by directory, and the errors for bad paths and requests."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import jax
import numpy as np
import pytest
from eval_helpers import frozenlake_corpus, plugin_analysis, save_tiny_policy
from flax import nnx
from markdown_it import MarkdownIt
from typer.testing import CliRunner

from agentrl_jax.cli import app
from agentrl_jax.config_io import dump_config
from agentrl_jax.evaluation.policies import PolicyLoadError, checkpoint_step_dir, load_policy
from agentrl_jax.models import load_qwen3
from agentrl_jax.models.small_tokenizer import build_small_tokenizer
from agentrl_jax.reproduce.config import load_config
from agentrl_jax.train import Checkpointer, MetricsLogger, RLConfig, TrainConfig, init_train_state

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CI_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "frozenlake_ci.yaml"
# the CI config at 3 test maps, 4-token responses
TINY = ["--set", "task.eval_tasks=3", "--set", "task.max_response_tokens=4"]


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


def _finished_run(folder: Path, policies) -> Path:
    """A results folder as ``agentrl-jax reproduce`` leaves it after training: the CI config
    (4x4 maps, T_max 4) with one run, the base and the run's models, the run's metrics."""
    base_dir, _, rl_weights = policies
    config = load_config(CI_CONFIG, ["rl.runs=[grpo]", "task.eval_tasks=3"])
    folder.mkdir()
    (folder / "config.yaml").write_text(dump_config(config))
    for name, source in (("base", base_dir), ("grpo", rl_weights)):
        (folder / "models").mkdir(exist_ok=True)
        (folder / "models" / name).symlink_to(source, target_is_directory=True)
    logger = MetricsLogger(folder / "runs" / "grpo" / "metrics.jsonl")
    for step in range(1, 6):
        logger.log(step, {"R_multi": 0.1 * step, "R_single": 0.5 - 0.02 * step, "loss": 1.0})
    return folder


def test_a_results_folder_is_evaluated_at_its_own_task_settings(policies, tmp_path):
    folder = _finished_run(tmp_path / "run", policies)
    printed = _run("eval", str(folder), "--analysis", "table", "--analysis", "dynamics")
    assert "4x4 FrozenLake" in printed and "T_max 4" in printed  # the run's, not 8x8 / 70
    assert "lengths 8/256 tokens" in printed  # its eval section: the CI config's context
    out = folder / "eval"
    table = json.loads((out / "raw" / "table.json").read_text())
    assert table["t_max"] == 4 and table["policies"] == ["base", "GRPO"]
    assert table["settings"]["max_context"] == 256 and table["budgets"] == [1, 2, 3, 4]
    assert len(table["task_ids"]) == 3
    dynamics = json.loads((out / "raw" / "dynamics.json").read_text())
    assert set(dynamics["runs"]) == {"GRPO"}  # read from the folder's metrics
    report = (out / "report.md").read_text()
    assert "Table 1" in report and "Training dynamics" in report
    # an override changes what it says it changes, nothing else
    again = _run(
        "eval",
        str(folder),
        "--analysis",
        "table",
        "--set",
        "eval.samples=4",
        "--out",
        str(tmp_path / "more"),
    )
    assert "4 samples per task" in again
    more = json.loads((tmp_path / "more" / "raw" / "table.json").read_text())
    assert more["settings"]["samples"] == 4 and more["t_max"] == 4


@pytest.mark.slow
def test_named_policies_under_a_config_end_to_end(policies, tmp_path):
    """A Hugging Face base and a training checkpoint as the RL policy, every analysis."""
    base_dir, run_dir, _ = policies
    out = tmp_path / "results"
    pool = [
        "--set",
        "eval.states=8",
        "--set",
        "eval.group_size=2",
        "--set",
        "eval.source_samples=2",
    ]
    _run(
        "eval",
        "--config",
        str(CI_CONFIG),
        *TINY,
        *pool,
        "--policy",
        f"base={base_dir}",
        "--policy",
        f"RL={run_dir}",
        "--out",
        str(out),
    )
    passk = json.loads((out / "raw" / "passk.json").read_text())
    assert passk["policies"] == ["base", "RL"]
    steps = json.loads((out / "raw" / "steps.json").read_text())
    assert steps["settings"]["states"] == 8
    report = (out / "report.md").read_text()
    tokens = MarkdownIt().parse(report)
    images = [
        child.attrs["src"]
        for t in tokens
        if t.type == "inline"
        for child in t.children
        if child.type == "image"
    ]
    assert len(images) >= 8
    for image in images:
        _check_png(out / image)
    assert "Table 1" in report and "training dynamics" not in report.lower()  # no metrics


def _fails(*args: str) -> str:
    """The error output of a command that must fail, on one line (no box wrapping)."""
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "1000"})
    assert result.exit_code != 0, result.output
    return " ".join(result.output.split())


def test_cli_errors_name_the_problem(policies, tmp_path):
    base_dir, run_dir, _ = policies
    named = ["--config", str(CI_CONFIG), *TINY, "--out", str(tmp_path / "out")]
    missing = tmp_path / "nope"
    assert f"{missing}: no such file" in _fails(
        "eval", *named, "--policy", f"base={missing}", "--policy", f"RL={run_dir}"
    )
    assert "compares the base with other policies" in _fails(
        "eval", *named, "--policy", f"base={base_dir}", "--analysis", "steps"
    )
    assert "unknown or unsupported analysis 'nope'" in _fails(
        "eval", *named, "--policy", f"base={base_dir}", "--analysis", "nope"
    )
    assert "expected LABEL=DIR" in _fails("eval", *named, "--policy", str(base_dir))
    assert "name the policies" in _fails("eval", "--config", str(CI_CONFIG))
    assert "no config.yaml" in _fails("eval", str(tmp_path))
    folder = _finished_run(tmp_path / "run", policies)
    assert "brings its config" in _fails("eval", str(folder), "--env", "sql")


def test_one_policy_gets_the_analyses_one_policy_can_have():
    """Without a second policy the default drops the pairwise analyses (base against RL) instead
    of refusing; without training logs, the dynamics."""
    from agentrl_jax.evaluation.analyses.registry import pairwise
    from agentrl_jax.evaluation.evaluate_policies import default_analyses

    config = load_config(CI_CONFIG)
    two = default_analyses(config, with_logs=True, policies=2)
    assert "likelihood" in two and "dynamics" in two
    one = default_analyses(config, with_logs=False, policies=1)
    assert one == tuple(n for n in two if n not in pairwise() and n != "dynamics") and one


def test_a_plugin_analysis_is_run_and_reported_by_eval(policies, tmp_path):
    """An analysis a user's plugin file registers (tests/eval_helpers.py: PLUGIN_ANALYSIS) is
    listed by --help, run by ``eval --plugin FILE --analysis NAME``, and reported: its raw
    record, its section in report.md, its claim in findings.json; no package edit."""
    base_dir, _run_dir, rl_weights = policies
    out = tmp_path / "out"
    with plugin_analysis(tmp_path) as plugin:
        listed = CliRunner().invoke(
            app, ["eval", "--plugin", str(plugin), "--help"], env={"COLUMNS": "1000"}
        )
        assert "solved_once" in listed.output
        args = ["eval", "--plugin", str(plugin), "--policy", f"base={base_dir}"]
        args += ["--policy", f"RL={rl_weights}", "--analysis", "solved_once"]
        args += ["--config", str(CI_CONFIG), *TINY, "--out", str(out)]
        result = CliRunner().invoke(app, args, env={"COLUMNS": "1000"})
        assert result.exit_code == 0, result.output
    raw = json.loads((out / "raw" / "solved_once.json").read_text())
    assert raw["analysis"] == "solved_once" and raw["policies"] == ["base", "RL"]
    assert set(raw["shares"]) == {"base", "RL"} and raw["task_ids"] == [0, 1, 2]
    report = (out / "report.md").read_text()
    assert "## Solved once" in report and "Tasks solved in one try: base " in report
    claims = [
        f for f in json.loads((out / "findings.json").read_text()) if "plugin" in f["headline"]
    ]
    assert [f["subject"] for f in claims] == ["base", "RL"]
    assert report.count("](#solved-once)") == 2  # each verdict links to the plugin's section


def test_an_interrupted_eval_says_what_it_kept_and_the_command_again(policies, tmp_path):
    """Ctrl-C during the second analysis: one line naming it, the finished analysis kept, no
    report, the same command to evaluate again; exit status 130, no traceback."""
    from agentrl_jax.evaluation import evaluate_policies

    base_dir, _run_dir, rl_weights = policies
    real = evaluate_policies.run_analysis
    ran = []

    def interrupted_second(name, *args, **kwargs):
        if ran:
            raise KeyboardInterrupt
        ran.append(name)
        return real(name, *args, **kwargs)

    out = tmp_path / "out"
    # (in the order the message writes them: policies, analyses, config, settings, folder)
    args = ["eval", "--policy", f"base={base_dir}", "--policy", f"RL={rl_weights}"]
    args += ["--analysis", "passk", "--analysis", "likelihood", "--config", str(CI_CONFIG)]
    args += [*TINY, "--out", str(out)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(evaluate_policies, "run_analysis", interrupted_second)
        result = CliRunner().invoke(app, args, env={"COLUMNS": "1000"})
    assert result.exit_code == 130, result.output
    assert "Traceback" not in result.output
    said = [line for line in result.output.splitlines() if line.startswith("eval: interrupted")]
    assert said == [
        f"eval: interrupted during analysis likelihood; saved in {out}: the files of the "
        "finished analyses (passk), no report; eval does not resume, so rerun to evaluate "
        f"again: agentrl-jax {' '.join(args)}"
    ]
    assert (out / "pass_at_k.json").is_file() and not (out / "report.md").exists()
