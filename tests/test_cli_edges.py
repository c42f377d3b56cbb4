"""What a newcomer meets at the command line: an unusable ``--out`` is one line before any work,
the header names the overrides, no torch advice, and ``solve`` shows an episode that succeeds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentrl_jax.cli import app

ROOT = Path(__file__).resolve().parents[1]


def _one_line_error(result) -> str:
    """The error's text without rich's box and line breaks (it may wrap inside a long path):
    compare with :func:`_squeezed` text."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    return _squeezed(result.output.replace("│", ""))


def _squeezed(text: str) -> str:
    return "".join(text.split())


@pytest.mark.parametrize(
    "command", [["reproduce", "frozenlake"], ["eval", "--policy", "base=/nowhere"]]
)
def test_an_out_folder_that_is_a_file_is_refused_before_any_work(tmp_path, command):
    taken = tmp_path / "results"
    taken.write_text("")
    result = CliRunner().invoke(app, command + ["--out", str(taken)])
    assert _squeezed(f"--out {taken}: is a file, not a folder") in _one_line_error(result)


def test_solve_refuses_its_out_file_before_computing_anything(tmp_path):
    result = CliRunner().invoke(app, ["solve", "frozenlake", "--maps", "2", "--out", str(tmp_path)])
    message = _one_line_error(result)
    assert _squeezed(f"--out {tmp_path}: is a folder, not a file") in message
    assert "FrozenLake" not in message  # nothing was solved first
    below_a_file = tmp_path / "file"
    below_a_file.write_text("")
    result = CliRunner().invoke(app, ["solve", "frozenlake", "--out", str(below_a_file / "x.json")])
    assert _squeezed("is a file, so no folder can be made there") in _one_line_error(result)


def test_an_unwritable_out_is_refused(tmp_path, monkeypatch):
    import agentrl_jax.cli.paths as paths

    monkeypatch.setattr(paths.os, "access", lambda path, mode: False)  # as on a read-only mount
    result = CliRunner().invoke(app, ["reproduce", "frozenlake", "--out", str(tmp_path / "new")])
    assert _squeezed(f"{tmp_path} is not writable") in _one_line_error(result)


def test_the_header_names_the_overrides(tmp_path, monkeypatch):
    import agentrl_jax.reproduce.pipeline as pipeline

    monkeypatch.setattr(pipeline, "reproduce", lambda settings, out, **kwargs: out / "report.md")
    result = CliRunner().invoke(
        app,
        [
            "reproduce",
            "frozenlake",
            "--out",
            str(tmp_path),
            "--set",
            "rl.steps=3",
            "--set",
            "eval.samples=16",
        ],
    )
    assert result.exit_code == 0, result.output
    assert (
        f"Reproducing FrozenLake into {tmp_path} (config: built-in default with --set "
        "rl.steps=3, eval.samples=16)"
    ) in result.output


@pytest.mark.parametrize("command", [["reproduce", "frozenlake"], ["train"]])
def test_without_out_the_run_goes_to_results_and_its_env(tmp_path, monkeypatch, command):
    """README's first command: no ``--out``, the folder is results/<env> in the working folder."""
    import agentrl_jax.reproduce.pipeline as pipeline

    folders = []
    monkeypatch.setattr(
        pipeline,
        "reproduce",
        lambda settings, out, **kwargs: folders.append(out) or out / "report.md",
    )
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 0, result.output
    assert folders == [Path("results") / "frozenlake"]
    assert "into results/frozenlake (config: built-in default)" in result.output


@pytest.mark.parametrize("problem", ["missing", "empty", "not a Qwen3"])
def test_a_bad_model_folder_is_one_line_and_the_corrected_rerun_works(
    tmp_path, monkeypatch, problem
):
    """``model.model_dir`` missing, without config.json, or of another architecture: one line
    naming the field and the folder, exit 2, nothing written; the corrected command then runs
    in the same results folder (the folder is prepared; the run itself is stubbed)."""
    import agentrl_jax.reproduce.pipeline as pipeline

    model = tmp_path / "Qwen3-4B"
    if problem != "missing":
        model.mkdir()
    if problem == "not a Qwen3":
        (model / "config.json").write_text('{"model_type": "llama"}')
    out = tmp_path / "results"
    common = ["reproduce", "frozenlake", "--out", str(out), "--set", "warm_start.enabled=false"]
    result = CliRunner().invoke(app, [*common, "--set", f"model.model_dir={model}"])
    expected = {
        "missing": f"model.model_dir: model directory '{model}' does not exist",
        "empty": f"model.model_dir: {model}/config.json not found: a Hugging Face model "
        "directory needs config.json",
        "not a Qwen3": f"model.model_dir: {model}/config.json: unsupported architecture "
        "(model_type='llama', architectures=[]); only model_type='qwen3' Qwen3ForCausalLM "
        "(dense Qwen3) and 'qwen3_moe' Qwen3MoeForCausalLM (Qwen3 MoE) are implemented",
    }[problem]
    assert _squeezed(expected) in _one_line_error(result)
    assert not out.exists()
    monkeypatch.setattr(pipeline.Reproduction, "run", lambda self, until: self.out / "report.md")
    result = CliRunner().invoke(app, common)  # corrected: the built-in small policy
    assert result.exit_code == 0, result.output
    assert (out / "config.yaml").is_file()


def test_no_pytorch_advice_from_transformers_when_torch_is_missing():
    """torch hidden from the child: transformers alone prints its advice, the CLI's import not."""
    hide = "import sys; sys.modules['torch'] = None; "
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    plain = subprocess.run(
        [sys.executable, "-c", hide + "import transformers"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    ours = subprocess.run(
        [sys.executable, "-c", hide + "import agentrl_jax.cli, transformers"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "PyTorch was not found" in plain.stderr  # the advice exists: the check below means it
    assert ours.returncode == 0 and "PyTorch was not found" not in ours.stderr + ours.stdout


def test_solve_shows_an_episode_that_reaches_the_goal():
    result = CliRunner().invoke(
        app,
        ["solve", "frozenlake", "--maps", "4", "--size", "5", "--t-max", "20", "--episodes", "8"],
    )
    assert result.exit_code == 0, result.output
    assert "the first to reach the goal" in result.output
    assert "\nreached the goal after" in result.output


def test_seeds_run_the_study_once_per_seed_and_tabulate_each_finding(tmp_path, monkeypatch):
    """``--seeds 0 --seeds 7``: one run per seed into ``seed_<s>/`` with every seed of the
    config set to it, then ``seeds.md`` / ``seeds.json``: each finding's verdict per seed."""
    import json

    import agentrl_jax.reproduce.pipeline as pipeline
    from agentrl_jax.evaluation import findings

    seen = []

    def fake_reproduce(settings, out, **kwargs):  # writes the findings a run would
        seed = settings.rl.seed
        seen.append(
            (
                out.name,
                settings.task.seed,
                settings.model.seed,
                settings.warm_start.seed,
                settings.eval.seed,
                seed,
                settings.rl.steps,
            )
        )
        out.mkdir(parents=True)
        verdict = findings.SHOWS if seed == 0 else findings.REFUTED
        rows = [
            {
                "headline": findings.PASS_AT_K,
                "subject": "GRPO",
                "paper": "",
                "numbers": {},
                "observed": f"lead {seed}",
                "verdict": verdict,
            }
        ]
        (out / findings.FINDINGS_JSON).write_text(json.dumps(rows))
        (out / "report.md").write_text("")
        return out / "report.md"

    monkeypatch.setattr(pipeline, "reproduce", fake_reproduce)
    result = CliRunner().invoke(
        app,
        [
            "reproduce",
            "frozenlake",
            "--out",
            str(tmp_path),
            "--set",
            "rl.steps=3",
            "--seeds",
            "0",
            "--seeds",
            "7",
        ],
    )
    assert result.exit_code == 0, result.output
    assert seen == [("seed_0", 0, 0, 0, 0, 0, 3), ("seed_7", 7, 7, 7, 7, 7, 3)]
    summary = json.loads((tmp_path / "seeds.json").read_text())
    (row,) = summary["findings"]
    assert row["verdicts"] == {"0": "shows", "7": "refuted"} and row["shows"] == [0]
    table = (tmp_path / "seeds.md").read_text()
    assert f"| {findings.PASS_AT_K} | GRPO | **shows** | **refuted** | 1 of 2 |" in table
    assert "seed 0: lead 0; seed 7: lead 7" in table
    result = CliRunner().invoke(
        app,
        ["reproduce", "frozenlake", "--out", str(tmp_path / "x"), "--seeds", "3", "--seeds", "3"],
    )
    assert _squeezed("--seeds: each seed once") in _one_line_error(result)


def test_a_compile_cache_that_is_a_file_is_refused_before_any_work(tmp_path):
    taken = tmp_path / "cache"
    taken.write_text("")
    result = CliRunner().invoke(
        app,
        ["reproduce", "frozenlake", "--out", str(tmp_path / "out"), "--compile-cache", str(taken)],
    )
    assert _squeezed(f"--compile-cache {taken}: is a file, not a folder") in _one_line_error(result)
    assert not (tmp_path / "out").exists()


_CACHE_PROBE = """
import sys
import jax, jax.numpy as jnp
from agentrl_jax.cli.compile_cache import use_compile_cache
hits = []
jax.monitoring.register_event_listener(
    lambda event, **kw: hits.append(event)
    if event == "/jax/compilation_cache/cache_hits" else None)
folder = use_compile_cache(None if sys.argv[1] == "default" else sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # tiny programs too
def make():  # a new jitted function each time, as each phase's new sampler makes its own
    return jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
x = jnp.ones((64, 64))
first, second = make()(x), make()(x)
print(folder, len(hits), float(first) == float(second))
"""


@pytest.mark.parametrize("setting", ["default", "mine", "off"])
def test_the_compile_cache_loads_what_another_jitted_function_compiled(tmp_path, setting):
    """The commands' persistent cache (``--compile-cache``): a second jitted function with
    the same program loads the first one's executable instead of compiling it (what the
    default study gains from it: each phase's sampler recompiles the same shapes). Default:
    ``$XDG_CACHE_HOME/agentrl-jax/xla``; ``off``: nothing is cached."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    arg = str(tmp_path / "mine") if setting == "mine" else setting
    out = subprocess.run(
        [sys.executable, "-c", _CACHE_PROBE, arg],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    folder, hits, same = out.stdout.split()
    expected = {
        "default": tmp_path / "xdg" / "agentrl-jax" / "xla",
        "mine": tmp_path / "mine",
        "off": None,
    }[setting]
    assert folder == str(expected) and same == "True"
    assert int(hits) == (0 if expected is None else 1)
    if expected is not None:
        assert any(expected.iterdir())  # the executable was written there


@pytest.mark.parametrize(
    "mesh",
    [["mesh.rollout=1"], ["mesh.data=2"]],
    ids=["all-devices-for-rollouts", "more-devices-than-there-are"],
)
def test_a_mesh_the_devices_cannot_lay_out_is_one_line_before_any_work(tmp_path, mesh):
    """One device: giving it to rollouts leaves none to train on, and a 2-device mesh has one
    too few: one line naming the ``mesh`` section, exit 2, no results folder."""
    out = tmp_path / "results"
    sets = [x for item in mesh for x in ("--set", item)]
    result = CliRunner().invoke(app, ["reproduce", "frozenlake", "--out", str(out), *sets])
    line = _one_line_error(result)
    assert _squeezed("Invalid value: mesh: ") in line and "--setmesh.data=-1" in line, line
    assert not out.exists()


# ---------------------------------------------------- help lists what is registered, typos


def _wide(*args: str) -> tuple[int, str]:
    """Exit code and output of a command, rendered 1000 columns wide, whitespace normalised
    (no line wrapped inside a list of names, no box edge inside one)."""
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "1000"})
    assert "Traceback" not in result.output
    return result.exit_code, " ".join(result.output.split())


def _listed(*args: str) -> str:
    code, text = _wide(*args, "--help")
    assert code == 0, text
    return text


def _names():
    """The registered environments, run presets and analyses, each as the help lists them."""
    from agentrl_jax.cli.registries import analyses, environments, presets

    return tuple(", ".join(names()) for names in (environments, presets, analyses))


@pytest.fixture
def registries_restored():
    """Whatever a test's plugins register (environments, presets, analyses, the plugin records)
    is gone after it, so later tests see the built-in registries."""
    import envs.registry
    from agentrl_jax import plugins
    from agentrl_jax.evaluation.analyses import registry
    from agentrl_jax.train.presets import RUN_PRESETS

    tables = (envs.registry._REGISTRY, RUN_PRESETS, plugins._LOADED, registry._REGISTRY)
    before = [dict(table) for table in tables]
    yield
    for table, saved in zip(tables, before):
        table.clear()
        table.update(saved)


def test_help_lists_every_registered_environment_preset_and_analysis():
    environments, presets, analyses = _names()
    assert "frozenlake, sql" in environments and "grpo, budgetmix" in presets
    assert "table, " in analyses and ", dynamics" in analyses
    assert f"study of an environment ({environments})" in _listed()  # the command list
    reproduce = _listed("reproduce")
    assert f"one of those registered: {environments}" in reproduce  # ENV
    assert f"a registered run preset ({presets})" in reproduce
    assert f"those of {analyses} that" in reproduce
    evaluate = _listed("eval")
    assert f"One of {analyses} (repeatable" in evaluate  # --analysis
    assert f"one of {environments}." in evaluate  # --env
    train = _listed("train")
    assert f"one of {environments} (default" in train and f"preset ({presets})" in train
    assert "{environments}" not in reproduce + evaluate + train  # every placeholder filled


def test_help_lists_what_a_plugin_registers(tmp_path, monkeypatch, registries_restored):
    """A plugin's environment and run preset are listed like the built-in ones: from
    AGENTRL_JAX_PLUGINS by every help, from --plugin by the help of the command it is given to
    (click shows --help before it takes any option's value: the command reads them itself)."""
    from agentrl_jax.plugins import PLUGINS_ENV

    def plugin(name: str) -> Path:
        path = tmp_path / f"{name}.py"
        path.write_text(
            "import envs\n"
            "from agentrl_jax.train.presets import grpo_algorithm, register_run_preset\n"
            f"envs.register({name!r}, lambda: None, label='Maze', max_response_tokens=8, "
            "max_context=64)\n"
            f"register_run_preset('{name}-grpo', label='Maze GRPO', "
            "algorithm=lambda p: {'advantage': 'grpo'})\n"
        )
        return path

    monkeypatch.setenv(PLUGINS_ENV, str(plugin("maze_from_env")))
    for command in ((), ("reproduce",), ("eval",), ("train",)):
        # (after the environments registered before it: other test files may have added some)
        assert ", maze_from_env" in _listed(*command), command
    assert ", maze_from_env-grpo" in _listed("reproduce")
    environments, presets, _ = _names()
    assert environments.endswith("maze_from_env") and presets.endswith("maze_from_env-grpo")

    given = plugin("maze_given")
    for command in ("reproduce", "eval", "train"):
        assert "maze_from_env, maze_given" in _listed(command, "--plugin", str(given)), command
    assert "maze_from_env-grpo, maze_given-grpo" in _listed("reproduce", f"--plugin={given}")

    code, text = _wide("reproduce", "--plugin", str(tmp_path / "missing.py"), "--help")
    assert code == 2 and "Invalid value for '--plugin': plugin" in text and "no such file" in text


def test_help_names_a_plugin_that_cannot_be_imported(tmp_path, monkeypatch, registries_restored):
    from agentrl_jax.plugins import PLUGINS_ENV

    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    monkeypatch.setenv(PLUGINS_ENV, str(broken))
    code, text = _wide("--help")
    assert code == 2
    assert f"Invalid value for {PLUGINS_ENV}: plugin {broken}: importing it failed" in text


@pytest.mark.parametrize(
    "args, suggestion",
    [
        (["reproduce", "frozenlak"], "unknown environment 'frozenlak'; registered: "),
        (["reproduce", "frozenlake", "--set", "rl.stepz=3"], "rl: unknown field 'stepz'; known: "),
        (["train", "--env", "FrozenLake"], "unknown environment 'FrozenLake'; registered: "),
        (
            ["reproduce", "frozenlake", "--set", "rl.runs=[grpo, budgetmx]"],
            "rl.runs[1]: unknown run preset 'budgetmx'; presets: ",
        ),
        (
            [
                "eval",
                "--config",
                str(ROOT / "configs" / "frozenlake_ci.yaml"),
                "--policy",
                "base=/nowhere",
                "--policy",
                "RL=/nowhere",
                "--analysis",
                "pask",
            ],
            "unknown or unsupported analysis 'pask': the frozenlake study supports ",
        ),
    ],
    ids=["environment", "field", "environment-case", "preset", "analysis"],
)
def test_a_misspelt_name_gets_the_closest_registered_one(tmp_path, args, suggestion):
    """The message lists the valid names, then suggests the closest: one line, exit 2, before
    any work (no results folder, no policy loaded)."""
    out = tmp_path / "out"
    code, text = _wide(*args, "--out", str(out), *(["--print-config"] if args[0] != "eval" else []))
    closest = {
        "frozenlak": "frozenlake",
        "rl.stepz=3": "steps",
        "FrozenLake": "frozenlake",
        "rl.runs=[grpo, budgetmx]": "budgetmix",
        "pask": "passk",
    }[args[-1]]
    assert code == 2 and suggestion in text, text
    assert f"; did you mean '{closest}'?" in text.split(suggestion, 1)[1], text
    assert not out.exists() or not any(out.iterdir())
