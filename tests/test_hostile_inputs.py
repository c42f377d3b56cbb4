"""Nothing a user types or stores deletes their files or crashes a run (issue #55), by
construction:

* **one guarded way to delete** (:mod:`agentrl_jax.folders`): ``--fresh`` on a folder this
  project did not make (a user's own files, ``.``, a repository) is refused in one line, exit
  code 2, the folder byte for byte as it was; a symlinked ``--out`` is resolved, a dangling
  one refused; the folder's own links are never followed when it is deleted;
* **every config number declares its range** beside its field
  (:func:`agentrl_jax.validation.setting`): a walk over every section (and every registered
  environment's options) fails on a numeric field without both bounds, and every such field
  refuses the values an attacker writes (past either bound, integers of any length in any
  base, NaN, infinities) in one line naming the field, the value cut to 120 characters and
  the range, at load (file or override); nothing reaches ``config.yaml``.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path

import pytest
from test_cli_paths import _one_line_error, _refused, _squeezed, _stub_the_run
from typer.testing import CliRunner

import envs
from agentrl_jax.algorithms import AlgorithmConfig, LossTermConfig
from agentrl_jax.cli import app
from agentrl_jax.errors import ConfigError
from agentrl_jax.folders import MARKER, SCRATCH, FolderGuardError, claim, remove_folder
from agentrl_jax.models.lora import LoraConfig
from agentrl_jax.reproduce.config import SECTIONS as _SECTIONS
from agentrl_jax.reproduce.config import config_from_dict, default_config, load_config
from agentrl_jax.reproduce.folder import RESULTS
from agentrl_jax.sampling.config import SamplingSettings
from agentrl_jax.train.config import SUBSECTIONS as RL_SUBSECTIONS
from agentrl_jax.train.config import Config, TaskConfig
from agentrl_jax.validation import MAX_TOKENS, declared_range, numeric_fields, real, setting

# ---------------------------------------------------------------- one guarded way to delete


def _tree(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` and its bytes (links as their target), to compare before and
    after."""
    out = {}
    for root, dirs, files in os.walk(path):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            full = Path(root, name)
            key = str(full.relative_to(path))
            out[key] = os.readlink(full).encode() if full.is_symlink() else full.read_bytes()
    return out


def _fresh(out: Path, *extra: str):
    args = ["reproduce", "frozenlake", "--out", str(out), "--fresh", "--no-progress", *extra]
    return CliRunner().invoke(app, args)


def test_fresh_refuses_a_users_folder_and_keeps_every_byte(tmp_path, monkeypatch):
    _stub_the_run(monkeypatch)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "a.txt").write_bytes(b"my thesis\x00\xff")
    before = _tree(mine)
    assert _one_line_error(_fresh(mine)) == _refused(
        f"--fresh: {mine} is not a results folder made by agentrl-jax (it holds a.txt); "
        "nothing was deleted; choose another --out"
    )
    assert _tree(mine) == before  # a.txt byte for byte, no config.yaml, no marker
    # the corrected rerun (a folder of its own) works, and --fresh then deletes what it made
    out = tmp_path / "results"
    for _ in range(2):
        result = _fresh(out)
        assert result.exit_code == 0, result.output
        assert (out / "config.yaml").is_file() and (out / MARKER).is_file()


@pytest.mark.parametrize("where", [".", "~", "the repository"])
def test_fresh_refuses_a_mistyped_out(tmp_path, monkeypatch, where):
    _stub_the_run(monkeypatch)
    home = tmp_path / "home"
    (home / "notes").mkdir(parents=True)
    (home / "notes" / "n.md").write_text("keep")
    monkeypatch.setenv("HOME", str(home))
    repo = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(home)
    target = {".": home, "~": home, "the repository": repo}[where]
    out = {".": Path("."), "~": Path("~").expanduser(), "the repository": repo}[where]
    before = _tree(home) if target == home else sorted(os.listdir(repo))
    error = _one_line_error(_fresh(out))
    assert error.startswith(_squeezed("Invalid value: --fresh:")), error
    assert _squeezed("nothing was deleted") in error
    assert (_tree(home) if target == home else sorted(os.listdir(repo))) == before


def test_a_symlinked_out_is_resolved_and_a_dangling_one_refused(tmp_path, monkeypatch):
    _stub_the_run(monkeypatch)
    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    link.symlink_to(real)
    result = _fresh(link)
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and (real / "config.yaml").is_file()
    assert _squeezed(str(real)) in _squeezed(result.output)  # the folder it wrote into
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    assert _one_line_error(_fresh(dangling)) == _refused(
        f"--out {dangling}: is a symbolic link to {tmp_path / 'nowhere'}, which does not "
        "exist; name a folder"
    )
    assert not (tmp_path / "nowhere").exists()


def test_an_older_results_folder_is_recognised_by_its_layout(tmp_path, monkeypatch):
    """A results folder of a version before markers (config.yaml and phases.json) is one."""
    _stub_the_run(monkeypatch)
    out = tmp_path / "old"
    out.mkdir()
    (out / "config.yaml").write_text("{}\n")
    (out / "phases.json").write_text("{}")
    (out / "report.md").write_text("old")
    result = _fresh(out)
    assert result.exit_code == 0, result.output
    assert not (out / "report.md").exists()


def test_remove_folder_touches_only_its_own_kind(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep")
    ours = claim(tmp_path / "scratch", SCRATCH)
    (ours / "sub").mkdir()
    (ours / "sub" / "link").symlink_to(outside)  # a link inside is removed, not followed
    (ours / "file-link").symlink_to(outside / "precious")
    # refused, untouched: a link to our folder, a file, a folder of another kind, an unmarked one
    link = tmp_path / "link"
    link.symlink_to(ours)
    with pytest.raises(FolderGuardError, match=r"is a symbolic link \(to .*\), not a scratch"):
        remove_folder(link, SCRATCH)
    (tmp_path / "f").write_text("x")
    with pytest.raises(FolderGuardError, match="is a file, not a scratch folder"):
        remove_folder(tmp_path / "f", SCRATCH)
    with pytest.raises(FolderGuardError, match=r"not a results folder .*nothing was deleted"):
        remove_folder(ours, RESULTS)
    with pytest.raises(FolderGuardError, match=r"\(it holds precious\); nothing was deleted"):
        remove_folder(outside, SCRATCH)
    with pytest.raises(FolderGuardError, match="marked as a scratch folder"):
        claim(ours, RESULTS)
    # a forged marker that is a link, or too big, is no marker
    forged = tmp_path / "forged"
    forged.mkdir()
    (forged / MARKER).symlink_to(ours / MARKER)
    with pytest.raises(FolderGuardError):
        remove_folder(forged, SCRATCH)
    assert remove_folder(ours, SCRATCH) is True
    assert not ours.exists() and link.is_symlink()
    assert (outside / "precious").read_text() == "keep"
    assert remove_folder(ours, SCRATCH) is False  # nothing left to delete


# ---------------------------------------------------------------- declared ranges

# every config class a user writes: the YAML sections, their subsections (rl.optimizer, ...,
# eval.sampling), rl.lora, each environment's options
_CLASSES = {
    **_SECTIONS,
    **{f"rl.{name}": cls for name, cls in RL_SUBSECTIONS.items()},
    "eval.sampling": SamplingSettings,
    "rl.lora": LoraConfig,
    "rl.algorithm": AlgorithmConfig,
    "rl.algorithm.loss_terms[0]": LossTermConfig,
    **{
        f"task.options ({name})": envs.entry(name).option_type
        for name in envs.names()
        if envs.entry(name).option_type is not None
    },
}


def _numeric_fields():
    return [(section, cls, f) for section, cls in _CLASSES.items() for f in numeric_fields(cls)]


def test_every_numeric_field_declares_its_range():
    """A numeric field added later without both bounds fails here."""
    fields = _numeric_fields()
    assert len(fields) > 60  # the walk sees the sections (a guard against walking nothing)
    missing = [f"{section}.{f.name}" for section, _, f in fields if declared_range(f) is None]
    assert missing == [], f"numeric fields without a declared [lo, hi]: {missing}"
    for section, _cls, f in fields:  # each default lies in its own range
        lo, hi = declared_range(f)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        values = default if isinstance(default, tuple) else (default,)
        assert all(v is None or lo <= v <= hi for v in values), (section, f.name, default)


def test_an_environment_option_without_a_range_cannot_be_registered():
    @dataclasses.dataclass(frozen=True)
    class Options:
        size: int = 4  # no range: refused
        rate: float = setting(0.5, real(0.0, 1.0))

    with pytest.raises(envs.EnvOptionError, match=r"numeric options must declare .*; size do"):
        envs.register(
            "ranged",
            lambda **_: None,
            label="R",
            max_response_tokens=1,
            max_context=16,
            option_type=Options,
        )
    assert "ranged" not in envs.names()


def _hostile(lo: float, hi: float, integral: bool) -> list[tuple[str, str]]:
    """``(YAML text, what the error shows)`` for each value an attacker writes into a field
    declaring ``[lo, hi]``."""
    past = [
        (str(int(hi) + 1 if integral else hi * 2 + 1), None),
        (str(int(lo) - 1 if integral else lo - 1), None),
    ]
    return past + [
        ("9" * 5000, "an integer of 5,000 digits"),  # Python reads at most 4,300
        ("-" + "9" * 5000, "an integer of 5,000 digits"),
        ("0x" + "f" * 5000, "an integer of about 6,021 digits"),  # any base
        ("0b" + "1" * 20000, "an integer of about 6,021 digits"),
        (".nan", "nan"),
        (".inf", "inf"),
        ("-.inf", "-inf"),
        ("1.0e+999", "inf"),
    ]


def _written(section: str, field: str, value: str) -> tuple[str, str]:
    """``(YAML text, the field's name in the error)`` setting ``field`` of ``section`` to the
    YAML ``value``."""
    if section == "rl.algorithm":
        return (
            f"rl:\n  algorithm:\n    {field}: {value}\n",
            f"rl.runs[0].algorithm: AlgorithmConfig.{field}",
        )
    if section == "rl.algorithm.loss_terms[0]":
        return (
            f"rl:\n  algorithm:\n    loss_terms: [{{name: policy_clip, {field}: {value}}}]\n",
            f"rl.runs[0].algorithm: AlgorithmConfig.loss_terms[0]: "
            f"LossTermConfig(name='policy_clip').{field}",
        )
    path = ["task", "options"] if section.startswith("task.options") else section.split(".")
    text = "".join("  " * depth + f"{part}:\n" for depth, part in enumerate(path))
    return text + "  " * len(path) + f"{field}: {value}\n", ".".join([*path, field])


@pytest.mark.parametrize(
    "section, cls, field",
    _numeric_fields(),
    ids=lambda v: getattr(v, "name", v if isinstance(v, str) else ""),
)
def test_every_numeric_field_refuses_hostile_values_naming_field_value_and_range(
    tmp_path, section, cls, field
):
    lo, hi = declared_range(field)
    hint = str(typing.get_type_hints(cls)[field.name])
    integral = "int" in hint and "float" not in hint
    for text, shown in _hostile(lo, hi, integral):
        yaml, name = _written(section, field.name, f"[{text}]" if "tuple" in hint else text)
        config = tmp_path / "hostile.yaml"
        config.write_text(yaml)
        with pytest.raises(ConfigError) as error:
            load_config(config)
        message = str(error.value)
        assert "\n" not in message and len(message) < 600, message
        assert message.startswith(f"config {config}: {name}: must be "), message
        got = message.split(", got ", 1)[-1] if ", got " in message else message
        assert len(got) <= 120, message
        if shown is not None:
            assert shown in message, message
        assert field.metadata["check"].expect in message, message  # the declared range


def test_a_hostile_override_is_one_line_exit_2_and_writes_nothing(tmp_path, monkeypatch):
    _stub_the_run(monkeypatch)
    out = tmp_path / "results"
    for item, expected in [
        (
            "rl.lora.rank=1000000000000",
            "rl.lora.rank: must be an int in [1, 131072], got 1000000000000",
        ),
        (
            "task.t_max=99999999999999999999999",
            "task.t_max: must be an int in [4, 4096] (the 25% budget level must be >= 1 turn), "
            "got 99999999999999999999999",
        ),
        (
            "task.options.map_size=100000",
            "task.options.map_size: must be an int in [2, 32], got 100000",
        ),
        (
            "rl.steps=0x" + "f" * 5000,
            "rl.steps: must be an int in [1, 10000000], got an integer of about 6,021 digits",
        ),
    ]:
        args = ["reproduce", "frozenlake", "--out", str(out), "--set", item, "--no-progress"]
        error = _one_line_error(CliRunner().invoke(app, args))
        assert error.endswith(_squeezed(expected)), error
        assert not out.exists()
        # --print-config: nothing of it printed either (it is refused before writing)
        result = CliRunner().invoke(app, [*args, "--print-config"])
        assert result.exit_code == 2 and "task:" not in result.output
    # the corrected rerun (the field within its range) prepares the folder
    args = ["reproduce", "frozenlake", "--out", str(out), "--set", "rl.lora.rank=4"]
    result = CliRunner().invoke(app, [*args, "--no-progress"])
    assert result.exit_code == 0, result.output
    assert load_config(out / "config.yaml").rl.lora.rank == 4


def test_ranges_that_follow_from_other_fields():
    base = default_config().to_dict()

    def refused(changes: dict) -> str:
        data = {k: dict(v) for k, v in base.items()}
        for key, value in changes.items():
            section, field = key.split(".", 1)
            data[section][field] = value
        with pytest.raises(ConfigError) as error:
            config_from_dict(data)
        return str(error.value)

    # a LoRA rank past min(in, out) of a targeted projection of the configured model
    assert refused({"rl.lora": {"rank": 33, "targets": ["k_proj", "q_proj"]}}) == (
        "rl.lora.rank: must be <= 32, min(in, out) of the targeted projections "
        "(k_proj is [32, 64]), got 33"
    )
    assert config_from_dict({**base, "rl": {**base["rl"], "lora": {"rank": 32}}})
    # a turn budget or a response the context cannot hold
    assert refused({"task.t_max": 400}) == (
        "task.t_max: must be <= task.max_context (384): every turn takes at least one token "
        "of the context, got 400"
    )
    # a step's token buffers beyond int32 indexing
    message = refused(
        {"rl.tasks_per_step": 2**20, "rl.group_size": 4096, "task.max_context": 2**10}
    )
    assert message.startswith("rl.tasks_per_step: a step's rows") and f"{MAX_TOKENS:,}" in message


def test_a_loaded_models_lora_rank_is_checked_before_allocating():
    """A rank past what the model's projections can hold is refused before any adapter is
    allocated (a 1e12 rank once asked for 128 TB)."""
    import jax
    from flax import nnx

    from agentrl_jax.models import Qwen3Config, Qwen3ForCausalLM
    from agentrl_jax.models.lora import with_adapters

    config = Qwen3Config(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    model = Qwen3ForCausalLM(config, rngs=nnx.Rngs(0))
    with pytest.raises(
        ConfigError, match=r"rl\.lora\.rank: must be <= 8, .*\(k_proj is \[8, 16\]\), got 9"
    ):
        with_adapters(model, LoraConfig(rank=9), jax.random.key(0))
    assert with_adapters(model, LoraConfig(rank=8), jax.random.key(0)) is not None


def test_config_yaml_is_never_written_with_an_unprintable_value(tmp_path):
    """A value no config may hold, in a place no declared check looks (an environment's
    options, a preset parameter), is refused when the config is built, so config.yaml is never
    written with it."""
    for item in ("rl.preset_params.kl_coef=" + "9" * 5000, "rl.preset_params.kl_coef=.nan"):
        with pytest.raises(ConfigError, match=r"rl\.preset_params\.kl_coef: must be"):
            load_config(None, [item])
    # an environment whose options have no declared type (SQL's): the tree is walked
    for value in (float("nan"), 10**5000):
        with pytest.raises(ConfigError) as error:
            Config(task=TaskConfig(env="sql", options={"data": value}))
        assert str(error.value) == (
            "task.options.data: a NaN or an integer too long to print (4,000+ digits) is no "
            "setting's value"
        )


def test_rollouts_whose_kv_cache_cannot_fit_a_device_are_refused_before_allocating(
    tmp_path, monkeypatch
):
    """The stated memory rule for the counts (``check_rollout_memory``): 2 layers x 2 K/V x
    2 heads x 16 dims x 4 bytes = 512 bytes of KV cache per token; 64 rows x 384 tokens are
    12 MiB, refused on a device of 8 MiB, accepted on one of 16 MiB; max_rows_per_call 32
    halves it."""
    import agentrl_jax.train.run as run
    from agentrl_jax.reproduce.policy_init import random_qwen3

    config = load_config(
        None, ["rl.tasks_per_step=4", "rl.group_size=16", "engine.kv_page_size=null"]
    )
    model = random_qwen3(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        eos_token_ids=(1,),
        seed=0,
    )
    assert run.kv_cache_bytes(config.engine, model.config, 64, 384, model.dtype) == 64 * 384 * 512
    monkeypatch.setattr(run, "device_memory_bytes", lambda device: 8 * 2**20)
    monkeypatch.setattr(run.jax, "local_devices", lambda: [object()])
    with pytest.raises(ConfigError) as error:
        run.train_policy(model, None, "frozenlake", "grpo", config, out=tmp_path / "run")
    assert str(error.value) == (
        "rl.tasks_per_step: a rollout's KV cache, 64 rows (tasks_per_step x group_size) x "
        "task.max_context 384 tokens, is 12.0 MiB on each of 1 device(s), more than one "
        "device's 8.0 MiB; lower rl.max_rows_per_call, the rows or task.max_context (or bound "
        "the paged pool, engine.kv_pages)"
    )
    assert not (tmp_path / "run").exists()  # nothing was written
    monkeypatch.setattr(run, "device_memory_bytes", lambda device: 16 * 2**20)
    run.check_rollout_memory(model, config)
    monkeypatch.setattr(run, "device_memory_bytes", lambda device: 8 * 2**20)
    halved = load_config(
        None,
        [
            "rl.tasks_per_step=4",
            "rl.group_size=16",
            "rl.max_rows_per_call=32",
            "engine.kv_page_size=null",
        ],
    )
    run.check_rollout_memory(model, halved)  # 32 x 384 x 512 bytes = 6 MiB


@pytest.mark.parametrize("where", ["config.json", "a safetensors header"])
def test_an_integer_too_long_to_read_in_a_model_folder_is_the_loaders_error(tmp_path, where):
    """Python refuses to read an integer of more than 4,300 digits with a bare ValueError; the
    loaders refuse one of more than 100, naming the file."""
    from agentrl_jax.models import CheckpointError, load_qwen3
    from agentrl_jax.models.strict_json import load_json_object

    huge = "9" * 5000
    if where == "a safetensors header":
        with pytest.raises(CheckpointError) as error:
            load_json_object(
                '{"w": {"dtype": "F32", "shape": [' + huge + '], "data_offsets": [0, 4]}}',
                source="model.safetensors",
                what="the header",
                error=CheckpointError,
            )
        assert str(error.value) == (
            "model.safetensors: the header holds an integer of 5,000 digits (at most 100)"
        )
        return
    (tmp_path / "config.json").write_text('{"hidden_size": ' + huge + "}")
    with pytest.raises(ValueError) as error:
        load_qwen3(tmp_path)
    assert "holds an integer of 5,000 digits (at most 100)" in str(error.value)
    assert str(tmp_path / "config.json") in str(error.value)


@pytest.mark.parametrize(
    "value, shown",
    [
        ("0x" + "f" * 400, "4446241647709404462001681406551736431581923451213783931941822309375"),
        ("9" * 5000, "an integer of 5,000 digits"),
        (".nan", "nan"),
    ],
)
def test_a_hostile_estimator_parameter_is_named_never_a_traceback(value, shown):
    """A registered estimator's hyper-parameter (``rl.algorithm.advantage_params``): an integer
    too large for a float once ended in an OverflowError; now the parameter's one-line error,
    the value cut to 120 characters."""
    with pytest.raises(ConfigError) as error:
        load_config(None, [f"rl.algorithm.advantage_params={{eps: {value}}}"])
    message = str(error.value)
    assert "rl.runs[0].algorithm: AlgorithmConfig.advantage_params['eps']: must be a finite " in (
        message
    )
    got = message.split(", got ", 1)[1]
    assert got.startswith(shown) and len(got) <= 120, message
