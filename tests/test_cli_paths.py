"""Every path a user gives the commands (issue #46): a config file, an environment's data
(``task.options.data``), the results folder (``--out``). Missing, empty, of the wrong kind,
unreadable or malformed: one line naming it, exit code 2, nothing written to ``--out``; and the
same command, once the path is corrected, runs in that same folder (nothing left behind refuses
it). The corrected reruns go as far as :class:`~agentrl_jax.reproduce.pipeline.Reproduction`
preparing the folder (the tasks made, ``config.yaml`` written), the phases stubbed; a corrected
data path and a corrected ``--out`` also run the first phase for real (``--until setup``).
As root, whom permissions do not stop, an unreadable or unwritable path is simulated."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentrl_jax.cli import app

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def _one_line_error(result) -> str:
    """The error in rich's box, without the box and line breaks (it may wrap inside a long
    path): compare with :func:`_squeezed` text. Exit code 2, no traceback."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "╭─ Error" in result.output, result.output
    box = result.output.split("╭─ Error", 1)[1].split("\n", 1)[1].split("╰", 1)[0]
    return _squeezed(box.replace("│", ""))


def _squeezed(text: str) -> str:
    return "".join(text.split())


def _refused(message: str) -> str:
    """What :func:`_one_line_error` gives for a command's one-line refusal ``message``."""
    return _squeezed(f"Invalid value: {message}")


def _stub_the_run(monkeypatch) -> None:
    """The phases stubbed: a rerun prepares its folder (tasks made, config.yaml written) and
    stops."""
    import agentrl_jax.reproduce.pipeline as pipeline

    monkeypatch.setattr(pipeline.Reproduction, "run", lambda self, until: self.out / "report.md")


@contextlib.contextmanager
def _unreadable(path: Path, monkeypatch):
    """``path`` unreadable while inside: ``chmod 000``, or, as root (whom permissions do not
    stop), what a ``chmod 000`` does to others: ``os.access`` says so, and its reads (``open``,
    a folder's listing) raise ``PermissionError``."""
    if not AS_ROOT:
        mode = path.stat().st_mode
        path.chmod(0)
        try:
            yield
        finally:
            path.chmod(mode)
        return
    denied = PermissionError(13, "Permission denied", str(path))
    real_access = os.access
    with monkeypatch.context() as m:
        m.setattr(os, "access", lambda p, mode, **kw: Path(p) != path and real_access(p, mode))
        for name in ("open", "iterdir"):
            real = getattr(Path, name)

            def refused(self, *args, _real=real, **kwargs):
                if self == path:
                    raise denied
                return _real(self, *args, **kwargs)

            m.setattr(Path, name, refused)
        yield


@contextlib.contextmanager
def _unwritable(path: Path, monkeypatch):
    """The folder ``path`` not writable while inside (``chmod 555``, or as root ``os.access``
    saying so, as on a read-only mount)."""
    if not AS_ROOT:
        mode = path.stat().st_mode
        path.chmod(0o555)
        try:
            yield
        finally:
            path.chmod(mode)
        return
    import agentrl_jax.cli.paths as paths

    real = os.access
    with monkeypatch.context() as m:
        m.setattr(paths.os, "access", lambda p, mode: Path(p) != path and real(p, mode))
        yield


# ---------------------------------------------------------------- config files

CONFIG_PROBLEMS = {
    # problem: (how the file is made bad, the message after "config {path}: ")
    "missing": (lambda p: None, "no such file"),
    "empty": (
        lambda p: p.write_text(""),
        "the file is empty (no sections); give no config file for the built-in default, or {} "
        "for a file of defaults",
    ),
    "a folder": (lambda p: p.mkdir(), "is a folder, not a file"),
    "unreadable": (lambda p: p.write_text("rl:\n  steps: 1\n"), None),  # click's message
    "not a mapping": (
        lambda p: p.write_text("- rl\n- eval\n"),
        "must be a mapping of sections (task, model, warm_start, engine, rl, eval, mesh), got a "
        "list ['rl', 'eval']",
    ),
    "not YAML": (
        lambda p: p.write_text("rl: [\n"),
        "not valid YAML (expected the node content, but found '<stream end>' at line 2, column 1)",
    ),
    "not UTF-8": (
        lambda p: p.write_bytes(b"rl:\n  steps: \xe9\n"),
        "not UTF-8 text (invalid continuation byte at byte 13)",
    ),
}


@pytest.mark.parametrize("command", [["reproduce", "frozenlake"], ["train"]])
@pytest.mark.parametrize("problem", list(CONFIG_PROBLEMS))
def test_a_bad_config_file_is_one_line_and_the_corrected_rerun_works(
    tmp_path, monkeypatch, problem, command
):
    config, out = tmp_path / "my.yaml", tmp_path / "results"
    make, expected = CONFIG_PROBLEMS[problem]
    make(config)
    args = [*command, "--config", str(config), "--out", str(out)]
    with _unreadable(config, monkeypatch) if problem == "unreadable" else contextlib.nullcontext():
        result = CliRunner().invoke(app, args)
    if problem == "unreadable":  # click's own check of the option comes first
        expected_line = _squeezed(f"Invalid value for '--config': path '{config}' is not readable.")
    else:
        expected_line = _refused(f"config {config}: {expected}")
    assert _one_line_error(result) == expected_line
    assert not out.exists()
    if config.is_dir():
        config.rmdir()
    config.write_text("rl:\n  steps: 1\n")  # corrected in place: the same command again
    _stub_the_run(monkeypatch)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "steps: 1" in (out / "config.yaml").read_text()


def test_an_unreadable_config_file_is_a_config_error(tmp_path, monkeypatch):
    """Read without the command line's check (the API, a results folder's config.yaml)."""
    from agentrl_jax.errors import ConfigError
    from agentrl_jax.reproduce.config import load_config

    config = tmp_path / "my.yaml"
    config.write_text("rl:\n  steps: 1\n")
    with _unreadable(config, monkeypatch), pytest.raises(ConfigError) as error:
        load_config(config)
    assert str(error.value) == f"config {config}: cannot be read (Permission denied)"


def test_a_bad_config_file_for_eval_is_one_line_before_any_work(tmp_path):
    config, out = tmp_path / "my.yaml", tmp_path / "results"
    config.mkdir()
    result = CliRunner().invoke(
        app, ["eval", "--config", str(config), "--policy", "base=/nowhere", "--out", str(out)]
    )
    assert _one_line_error(result) == _refused(f"config {config}: is a folder, not a file")
    assert not out.exists()


# ---------------------------------------------------------------- data files


def _spider(root: Path) -> None:
    """A tiny Spider folder: one database, two questions in each split."""
    (root / "database" / "shop").mkdir(parents=True)
    with sqlite3.connect(root / "database" / "shop" / "shop.sqlite") as db:
        db.executescript(
            "CREATE TABLE item (id INTEGER PRIMARY KEY, name TEXT, price REAL);"
            "INSERT INTO item VALUES (1, 'pen', 1.5), (2, 'ink', 4.0), (3, 'pad', 2.25);"
        )
    entries = [
        {
            "db_id": "shop",
            "question": "How many items are there?",
            "query": "SELECT count(*) FROM item",
        },
        {
            "db_id": "shop",
            "question": "Name the dearest item.",
            "query": "SELECT name FROM item ORDER BY price DESC LIMIT 1",
        },
        {"db_id": "shop", "question": "List the item names.", "query": "SELECT name FROM item"},
    ]
    (root / "train_spider.json").write_text(json.dumps(entries[:2]))
    (root / "dev.json").write_text(json.dumps(entries[1:]))


def _deepcoder(path: Path, count: int = 4) -> None:
    """``count`` stdin/stdout tasks, ``add-0`` ... (the first four: two in each split)."""
    rows = [
        {
            "task_id": f"add-{i}",
            "problem": f"Print the sum of two integers plus {i}.",
            "tests": [{"input": "1 2\n", "output": f"{3 + i}\n"}],
        }
        for i in range(count)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _bfcl(root: Path) -> None:
    """A folder laid out like bfcl-eval's data: the first tasks of multi_turn_base."""
    from envs.bfcl.data import package_data_dir

    package = package_data_dir()
    (root / "possible_answer").mkdir(parents=True)
    for folder in (Path(), Path("possible_answer")):
        (source,) = (package / folder).glob("BFCL_v*_multi_turn_base.json")
        lines = source.read_text().splitlines()[:13]  # two fall in the train split
        (root / folder / source.name).write_text("\n".join(lines) + "\n")
    shutil.copytree(package / "multi_turn_func_doc", root / "multi_turn_func_doc")


def _policy(folder: Path) -> Path:
    """A model folder as far as the checks before the run read it: a tiny Qwen3's
    config.json."""
    from agentrl_jax.models import Qwen3Config

    config = Qwen3Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict()))
    return folder


def _sandbox_or_skip() -> None:
    """The code environment's tasks run in its sandbox: skip where this machine has none."""
    from envs.code.isolation import SandboxUnavailable, resolve_isolation

    try:
        resolve_isolation("strict")
    except SandboxUnavailable as error:
        pytest.skip(f"the code sandbox is unavailable here: {error}")


# env: (config, kind of path, what the message says it expects, how a good one is made)
DATA = {
    "sql": ("sql_ci.yaml", "folder", "a Spider folder", _spider),
    "code": ("code_ci.yaml", "file", "a DeepCoder-style JSONL file", _deepcoder),
    "bfcl": ("bfcl_ci.yaml", "folder", "a folder laid out like bfcl-eval's data", _bfcl),
}


def _without_train_tasks(env: str, path: Path) -> str:
    """Makes data at ``path`` with no training task; returns the message after
    "task.options.data: "."""
    if env == "sql":
        _spider(path)
        (path / "train_spider.json").write_text("[]")
        return f"load_spider: {path}/train_spider.json holds no tasks"
    if env == "code":
        _deepcoder(path, 2)
        path.write_text(path.read_text().splitlines()[1] + "\n")  # add-1, a test task
    else:
        _bfcl(path)
        for file in path.glob("**/BFCL_v*_multi_turn_base.json"):  # the first, a test task
            file.write_text(file.read_text().splitlines()[0] + "\n")
    return (
        f"{path}: none of its 1 task(s) falls in the 'train' split (a fixed hash of each task "
        "id splits them in two halves); it needs more tasks"
    )


def _malformed(env: str, path: Path) -> str:
    """Makes good data at ``path`` malformed; returns the message after "task.options.data: "."""
    if env == "sql":
        _spider(path)
        (path / "train_spider.json").write_text("[{")
        return (
            f"load_spider: {path}/train_spider.json is not valid JSON: Expecting property name "
            "enclosed in double quotes: line 1 column 3 (char 2)"
        )
    if env == "code":
        _deepcoder(path)
        with path.open("a") as file:
            file.write("{not json\n")
        return (
            f"{path}:5: not valid JSON (Expecting property name enclosed in double quotes: "
            "line 1 column 2 (char 1))"
        )
    _bfcl(path)
    (question,) = path.glob("BFCL_v*_multi_turn_base.json")
    lines = question.read_text().splitlines()
    question.write_text("\n".join(lines[:2] + ["{not json"] + lines[3:]) + "\n")
    return f"{question}:3: not valid JSON (Expecting property name enclosed in double quotes)"


@pytest.mark.parametrize(
    "problem",
    [
        "missing",
        "empty",
        "the other kind",
        "unreadable",
        "incomplete",
        "no train task",
        "malformed",
    ],
)
@pytest.mark.parametrize("env", list(DATA))
def test_bad_data_is_one_line_naming_the_field_and_the_corrected_rerun_works(
    tmp_path, monkeypatch, env, problem
):
    """``task.options.data`` of each built-in environment: one line naming the field and the
    path, exit 2, no results folder; then the data is corrected in place and the same command
    prepares the same folder."""
    config, kind, expects, make_good = DATA[env]
    if env == "code" and problem in ("incomplete", "no train task", "malformed"):
        _sandbox_or_skip()  # its tasks load once the sandbox is there
    data, out = tmp_path / ("data.jsonl" if kind == "file" else "data"), tmp_path / "results"
    if problem == "empty":
        data.mkdir() if kind == "folder" else data.write_text("")
        expected = f"{data} is an empty {kind}; expected {expects}"
    elif problem == "the other kind":
        data.write_text("x\n") if kind == "folder" else data.mkdir()
        other = "a file, not a folder" if kind == "folder" else "a folder, not a file"
        expected = f"{data} is {other}; expected {expects}"
    elif problem == "unreadable":
        make_good(data)
        expected = f"{data} cannot be read (Permission denied)"
    elif problem == "incomplete":  # what a data path needs inside it is missing
        if env == "sql":
            _spider(data)
            (data / "train_spider.json").unlink()
            expected = (
                f"load_spider: split 'train' needs {data}/train_spider.json, which is missing"
            )
        elif env == "code":
            data.write_text('{"problem": "Print 1."}\n')
            expected = f"{data}:1: no 'tests' (or 'input_output') field"
        else:
            _bfcl(data)
            shutil.rmtree(data / "possible_answer")
            expected = f"no BFCL_v<N>_multi_turn_base.json in {data}/possible_answer"
    elif problem == "no train task":
        expected = _without_train_tasks(env, data)
    elif problem == "malformed":
        expected = _malformed(env, data)
    else:
        expected = f"{data} does not exist; expected {expects}"
    args = ["reproduce", env, "--config", str(CONFIGS / config), "--out", str(out)]
    args += ["--set", f"task.options.data={data}"]
    if env == "code":  # DeepCoder's rows have no reference program to warm-start on
        args += ["--set", "warm_start.enabled=false", "--until", "train:grpo"]
        args += ["--set", f"model.model_dir={_policy(tmp_path / 'policy')}"]
    else:
        args += ["--until", "setup"]
    with _unreadable(data, monkeypatch) if problem == "unreadable" else contextlib.nullcontext():
        result = CliRunner().invoke(app, args)
    assert _one_line_error(result) == _refused(f"task.options.data: {expected}")
    assert not out.exists()
    if env == "code":
        _sandbox_or_skip()  # the corrected rerun makes the tasks
    if data.is_dir():
        shutil.rmtree(data)
    elif data.exists():
        data.unlink()
    make_good(data)  # corrected in place: the same command again
    _stub_the_run(monkeypatch)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert f"data: {data}" in (out / "config.yaml").read_text()


def test_data_that_is_not_a_path_is_one_line(tmp_path):
    out = tmp_path / "results"
    result = CliRunner().invoke(
        app,
        ["reproduce", "sql", "--set", "task.options.data=3", "--out", str(out), "--until", "setup"],
    )
    expected = "task.options.data: expected the path of a Spider folder, got 3"
    assert _one_line_error(result) == _refused(expected)
    assert not out.exists()


def test_bad_data_for_eval_is_one_line_before_the_policies_load(tmp_path):
    out = tmp_path / "results"
    result = CliRunner().invoke(
        app,
        ["eval", "--env", "sql", "--set", f"task.options.data={tmp_path / 'spider'}"]
        + ["--policy", "base=/nowhere", "--out", str(out)],
    )
    expected = f"task.options.data: {tmp_path / 'spider'} does not exist; expected a Spider folder"
    assert _one_line_error(result) == _refused(expected)
    assert not out.exists()


def test_the_corrected_data_runs_its_first_phase(tmp_path):
    """Unstubbed: after a Spider folder that was a file, the same command runs ``setup`` in
    the same results folder."""
    data, out = tmp_path / "spider", tmp_path / "results"
    data.write_text("")
    args = ["reproduce", "sql", "--config", str(CONFIGS / "sql_ci.yaml"), "--out", str(out)]
    args += ["--set", f"task.options.data={data}", "--until", "setup", "--no-progress"]
    assert _one_line_error(CliRunner().invoke(app, args)) == _refused(
        f"task.options.data: {data} is a file, not a folder; expected a Spider folder"
    )
    data.unlink()
    _spider(data)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "Stopped after setup" in result.output
    assert (out / "models" / "init" / "config.json").is_file()


# ---------------------------------------------------------------- the results folder


@pytest.mark.parametrize("command", [["reproduce", "frozenlake"], ["train"]])
@pytest.mark.parametrize("problem", ["a file", "under a file", "not writable"])
def test_a_bad_out_is_one_line_and_the_corrected_rerun_works(
    tmp_path, monkeypatch, problem, command
):
    parent = tmp_path / "runs"
    parent.mkdir()
    if problem == "a file":
        out = parent / "results"
        out.write_text("")
        expected = f"--out {out}: is a file, not a folder"
    elif problem == "under a file":
        (parent / "taken").write_text("")
        out = parent / "taken" / "results"
        expected = f"--out {out}: {parent / 'taken'} is a file, so no folder can be made there"
    else:
        out = parent / "results"
        expected = f"--out {out}: {parent} is not writable (read-only file system or permissions)"
    args = [*command, "--out", str(out), "--set", "rl.steps=1"]
    with (
        _unwritable(parent, monkeypatch) if problem == "not writable" else contextlib.nullcontext()
    ):
        result = CliRunner().invoke(app, args)
    assert _one_line_error(result) == _refused(expected)
    assert not out.is_dir()
    if problem == "a file":
        out.unlink()
    elif problem == "under a file":
        (parent / "taken").unlink()
    _stub_the_run(monkeypatch)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert (out / "config.yaml").is_file()


def test_a_corrected_out_runs_its_first_phase(tmp_path):
    """Unstubbed: once the file in the way is gone, the same command runs ``setup``."""
    out = tmp_path / "results"
    out.write_text("")
    args = ["reproduce", "frozenlake", "--config", str(CONFIGS / "frozenlake_ci.yaml")]
    args += ["--out", str(out), "--until", "setup", "--no-progress"]
    assert _one_line_error(CliRunner().invoke(app, args)) == _refused(
        f"--out {out}: is a file, not a folder"
    )
    out.unlink()
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert (out / "models" / "init" / "config.json").is_file()


@pytest.mark.parametrize("problem", ["missing", "a file", "no config.yaml"])
def test_a_bad_results_folder_to_evaluate_is_one_line(tmp_path, problem):
    folder = tmp_path / "results"
    if problem == "a file":
        folder.write_text("")
    elif problem == "no config.yaml":
        folder.mkdir()
    result = CliRunner().invoke(app, ["eval", str(folder)])
    expected = {
        "missing": f"{folder}: does not exist, so not a results folder of agentrl-jax reproduce "
        "or train",
        "a file": f"{folder}: is a file, not a results folder of agentrl-jax reproduce or train",
        "no config.yaml": f"{folder}: no config.yaml, so not a results folder of agentrl-jax "
        "reproduce or train; name the policies (--policy LABEL=DIR) and the config (--config, "
        "--env)",
    }[problem]
    assert _one_line_error(result) == _refused(expected)
    assert not (tmp_path / "results" / "eval").exists()
