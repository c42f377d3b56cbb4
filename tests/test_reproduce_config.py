"""The configuration tree (agentrl_jax.reproduce.config over agentrl_jax.train.config) and what
it feeds the trainer (agentrl_jax.train.config.train_config): every shipped YAML validates and
only overrides, bad values and
unknown keys are refused naming ``section.field``, overrides parse, and the paper-scale configs
hold docs/paper.md §3/§4/§7's numbers all the way into the TrainConfigs and rollout settings."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from fake_devices import fake_devices_env

from agentrl_jax.algorithms import AlgorithmConfig
from agentrl_jax.config_io import apply_overrides, dump_config
from agentrl_jax.errors import ConfigError
from agentrl_jax.reproduce.config import (
    ReproduceConfig,
    config_from_dict,
    default_config,
    env_defaults,
    load_config,
)
from agentrl_jax.sharding import MeshConfig
from agentrl_jax.train.config import RLConfig, TrainConfig, train_config
from agentrl_jax.train.presets import RUN_PRESETS
from agentrl_jax.train.run import rollout_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
ALL_CONFIGS = sorted(CONFIGS.glob("*.yaml"))
# the paper's setting for eight devices (a GPU node, a TPU slice) and for one 80 GB GPU; the
# Qwen3-30B-A3B configs (an expert mesh axis, LoRA on 8 GPUs): tests/test_expert_parallel.py
MOE_CONFIGS = sorted(CONFIGS.glob("frozenlake_qwen3_30b_a3b_*.yaml"))
PAPER_CONFIGS = sorted(set(CONFIGS.glob("frozenlake_qwen3_*_[gt]pu.yaml")) - set(MOE_CONFIGS))
ONE_GPU_CONFIGS = sorted(CONFIGS.glob("frozenlake_qwen3_*_1gpu.yaml"))


def test_the_shipped_configs_are_the_expected_set():
    # A new YAML is picked up by every test below; this guards against a glob that finds nothing.
    assert {p.name for p in ALL_CONFIGS} >= {
        "frozenlake_cpu_large.yaml",
        "frozenlake_ci.yaml",
        "frozenlake_qwen3_4b_gpu.yaml",
        "frozenlake_qwen3_4b_tpu.yaml",
        "frozenlake_qwen3_8b_gpu.yaml",
        "frozenlake_qwen3_8b_tpu.yaml",
    }
    assert len(PAPER_CONFIGS) == 4
    assert [p.name for p in ONE_GPU_CONFIGS] == [
        "frozenlake_qwen3_0.6b_1gpu.yaml",
        "frozenlake_qwen3_1.7b_1gpu.yaml",
        "frozenlake_qwen3_8b_lora_1gpu.yaml",
    ]


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=lambda p: p.name)
def test_every_config_loads_and_round_trips(path):
    config = load_config(path)
    assert isinstance(config, ReproduceConfig)
    assert config_from_dict(config.to_dict()) == config
    # ... and through the YAML a results folder stores (config.yaml).
    assert config_from_dict(yaml.safe_load(dump_config(config))) == config
    # Every key the file sets is read as written (none silently dropped or renamed), and
    # overrides the default below it (a file restates nothing).
    written = yaml.safe_load(path.read_text())
    plain = config.to_dict()
    default = default_config(config.task.env).to_dict()
    for section, fields in written.items():
        for field, value in fields.items():
            if isinstance(value, dict):  # a mapping field: key by key
                below = default[section][field] or {}  # e.g. rl.lora: null below
                for key, item in value.items():
                    assert plain[section][field][key] == item, f"{path.name}: {section}.{field}"
                    if field != "options" or key in below:
                        assert below.get(key) != item, (path.name, field, key)
                continue
            assert plain[section][field] == value, f"{path.name}: {section}.{field}"
            if (section, field) != ("task", "env"):
                assert default[section][field] != value, f"{path.name} restates {section}.{field}"


def test_the_built_in_default_is_the_environments_study_over_the_classes():
    assert load_config(None) == default_config("frozenlake")
    assert load_config(None, ["task.env=sql"]) == default_config("sql")
    # one place per environment: its study's config_defaults, here over the library's classes
    assert default_config("frozenlake").rl.optimizer.learning_rate == 1e-3
    assert RLConfig().optimizer.learning_rate == 1e-6  # the paper's (§4)
    assert default_config("sql").task.t_max == 10 and default_config("bfcl").task.t_max == 24
    assert env_defaults("code")["task"]["env"] == "code"


def test_round_trip_of_non_default_values():
    config = load_config(
        CONFIGS / "frozenlake_ci.yaml",
        [
            "rl.runs=[ppo, gigpo-budgetmix]",
            "eval.budgets=[3, 1, 3]",
            "rl.optimizer.max_grad_norm=null",
            "model.dtype=bfloat16",
            "mesh.data=-1",
            "mesh.fsdp=2",
            "task.options.slippery=false",
            "engine.kv_cache_dtype=bfloat16",
            "rl.max_rows_per_call=8",
            "engine.prefill_chunk=512",
            "engine.generation_layout=training",
        ],
    )
    assert (config.engine.kv_cache_dtype, config.rl.max_rows_per_call) == ("bfloat16", 8)
    assert config.rl.runs == ("ppo", "gigpo-budgetmix")
    assert config.eval.budgets == (1, 3)  # sorted, deduplicated
    assert config_from_dict(config.to_dict()) == config
    assert config_from_dict(yaml.safe_load(dump_config(config))) == config


# ---------------------------------------------------------------- refusals naming the field


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"task.t_max": 3}, "task.t_max"),
        ({"task.options.frozen_p": 0.0}, "task.options.frozen_p"),
        ({"task.options.slippery": "yes"}, "task.options.slippery"),
        ({"task.train_tasks": 2.5}, "task.train_tasks"),
        (
            {"task.env": "chess"},
            "task.env: unknown environment 'chess'; registered: frozenlake, sql",
        ),
        (
            {"task.options": {"map_sise": 4}},
            "task.options: environment 'frozenlake' takes no option 'map_sise'",
        ),
        ({"task.options": [4]}, "task.options: must be a mapping"),
        (
            {"task.env": "sql", "task.options": {"limit": 3}},
            "task.options: 'limit': set from the task section",
        ),
        (
            {"task.env": "sql", "task.options": {"map_size": 4}},
            "task.options: environment 'sql' takes no option 'map_size'; it takes: data",
        ),
        ({"model.head_dim": 15}, "model.head_dim"),
        ({"model.dtype": "float16"}, "model.dtype"),
        ({"model.num_key_value_heads": 3}, "model.num_key_value_heads"),  # does not divide 4 heads
        ({"model.model_dir": ""}, "model.model_dir"),
        ({"warm_start.mistake_rate": 1.5}, "warm_start.mistake_rate"),
        ({"warm_start.learning_rate": 0.0}, "warm_start.learning_rate"),
        ({"warm_start.enabled": 1}, "warm_start.enabled"),
        ({"rl.group_size": 1}, "rl.group_size"),
        ({"rl.runs": ["grpo", "dpo"]}, "rl.runs"),
        ({"rl.runs": ["grpo", "grpo"]}, "rl.runs"),
        ({"rl.runs": "grpo"}, "rl.runs"),
        ({"rl.preset_params.clip_low": 0.0}, "rl.preset_params.clip_low"),
        ({"rl.preset_params.clip_low": 1.0}, "rl.preset_params.clip_low"),
        ({"rl.preset_params.clip_high": -0.1}, "rl.preset_params.clip_high"),
        ({"rl.preset_params.gigpo_omega": 1.0}, "rl.preset_params.gigpo_omega: no run's preset"),
        ({"rl.preset_params": [1]}, "rl.preset_params: must be a mapping"),
        ({"rl.batching.epochs": 0}, "rl.batching.epochs"),
        (
            {"rl.batching.mini_batches": 3},
            "rl.batching.mini_batches: must divide tasks_per_step x group_size (64)",
        ),
        (
            {"rl.algorithm": {"advantage": "nope"}},
            "rl.runs[0].algorithm: AlgorithmConfig.advantage: unknown",
        ),
        ({"rl.algorithm": {"loss": []}}, "rl.algorithm: unknown field 'loss'"),
        ({"rl.algorithm": [1]}, "rl.algorithm: must be a mapping of AlgorithmConfig fields"),
        ({"rl.runs": [{"preset": "grpo"}]}, "rl.runs[0]: needs a name"),
        ({"rl.runs": [{"name": "../x"}]}, "rl.runs[0].name: must be a folder name"),
        ({"rl.runs": [{"name": "base"}]}, "rl.runs[0].name: must be a folder name"),
        (
            {"rl.runs": [{"name": "x", "preset": "nope"}]},
            "rl.runs[0].preset: must be one of grpo, budgetmix",
        ),
        (
            {"rl.runs": [{"name": "x", "budget_mix": 1}]},
            "rl.runs[0].budget_mix: must be true, false or adaptive",
        ),
        ({"rl.runs": [{"name": "x", "stuff": 1}]}, "rl.runs[0]: unknown field 'stuff'"),
        (
            {"rl.runs": ["grpo", {"name": "x", "label": "GRPO"}]},
            "rl.runs: two runs have the label 'GRPO'",
        ),
        (
            {"rl.runs": [{"name": "x", "algorithm": {"loss_terms": ["value_clip"]}}]},
            "rl.runs[0].algorithm: AlgorithmConfig.loss_terms: needs at least one policy term",
        ),
        (
            {
                "rl.runs": [
                    {
                        "name": "x",
                        "algorithm": {"loss_terms": ["policy_clip", {"name": "kl", "coef": [1]}]},
                    }
                ]
            },
            "rl.runs[0].algorithm: AlgorithmConfig.loss_terms[1]",
        ),
        # A critic term with an estimator that produces no returns: refused by the trainer's check.
        (
            {
                "rl.runs": [
                    {"name": "x", "algorithm": {"loss_terms": ["policy_clip", "value_clip"]}}
                ]
            },
            "rl.runs[0].algorithm.loss_terms[1]: "
            "loss term 'value_clip' (critic) needs LossInputs.returns",
        ),
        ({"rl.sampling.temperature": float("nan")}, "rl.sampling.temperature"),
        (
            {"rl.batching.num_micro_batches": 3},
            "rl.batching.num_micro_batches",
        ),  # does not divide 8 x 8 rows
        ({"engine.kv_cache_dtype": "float16"}, "engine.kv_cache_dtype"),
        (
            {"rl.max_rows_per_call": 12},
            "rl.max_rows_per_call: must be a multiple of group_size (8)",
        ),
        ({"rl.max_rows_per_call": 0}, "rl.max_rows_per_call"),
        ({"engine.prefill_chunk": 0}, "engine.prefill_chunk"),
        ({"engine.generation_layout": "sharded"}, "engine.generation_layout"),
        ({"engine.kv_pages": 4, "engine.kv_page_size": None}, "engine.kv_pages"),
        ({"rl.process_reward_coef": 0.1}, "rl.process_reward_coef"),
        ({"rl.process_rewards": "judge"}, "rl.judge_model_dir"),
        ({"eval.samples": 0}, "eval.samples"),
        ({"eval.k": 9}, "eval.k"),  # more than eval.samples (8)
        ({"eval.sampling.top_p": 0.0}, "eval.sampling.top_p"),
        ({"eval.budgets": [13]}, "eval.budgets"),  # beyond task.t_max (12)
        # MeshConfig (agentrl_jax.sharding) names its section and field, as the others do.
        ({"mesh.data": 0}, "mesh.data: must be -1 (all remaining devices) or an int in [1, 65536]"),
        ({"mesh.data": -1, "mesh.fsdp": -1}, "mesh: at most one axis may be -1"),
    ],
    ids=lambda v: ",".join(v) if isinstance(v, dict) else None,
)
def test_a_bad_value_names_its_section_and_field(changes, expected):
    data = default_config().to_dict()
    for key, value in changes.items():
        *path, field = key.split(".")
        target = data
        for part in path:
            target = target[part]
        target[field] = value
    with pytest.raises(ValueError) as error:
        config_from_dict(data)
    assert str(error.value).startswith(expected), str(error.value)


def test_a_bad_value_in_a_yaml_file_names_the_field(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rl:\n  steps: 0\n")
    with pytest.raises(ValueError) as error:
        load_config(path)
    assert str(error.value) == f"config {path}: rl.steps: must be an int in [1, 10000000], got 0"


@pytest.mark.parametrize(
    "data, message",
    [
        ({"rl": {"stepz": 3}}, r"^rl: unknown field 'stepz'"),
        ({"bogus": {}}, r"unknown section 'bogus'"),
        ({"rl": 5}, r"^rl: must be a mapping of fields"),
        ({"task": {"t_max": 8}, "evaluation": {"k": 2}}, r"unknown section 'evaluation'"),
        ({"mesh": {"pipeline": 2}}, r"^mesh: unknown field 'pipeline'"),
        ([1, 2], r"must be a mapping of sections"),
    ],
)
def test_unknown_or_malformed_keys_are_errors(data, message):
    with pytest.raises(ValueError, match=message):
        config_from_dict(data)


def test_bad_files_are_errors_naming_the_file(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_config(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("rl: [unclosed\n")
    with pytest.raises(ValueError, match=r"broken\.yaml: not valid YAML"):
        load_config(broken)
    listed = tmp_path / "list.yaml"
    listed.write_text("- rl\n")
    with pytest.raises(ValueError, match=r"list\.yaml: must be a mapping of sections"):
        load_config(listed)
    typo = tmp_path / "typo.yaml"
    typo.write_text("warm_start:\n  epoch: 2\n")
    with pytest.raises(ValueError, match=r"typo\.yaml: warm_start: unknown field 'epoch'"):
        load_config(typo)
    # An empty file is refused (a truncated or wrong file), {} is the default; every such case
    # and its exact message: tests/test_loader_errors.py.
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing set\n")
    with pytest.raises(ValueError, match=r"empty\.yaml: the file is empty"):
        load_config(empty)
    empty.write_text("{}  # every field its default\n")
    assert load_config(empty) == default_config()


# ---------------------------------------------------------------- overrides


def test_overrides_parse_values_as_yaml_and_apply_on_the_file():
    config = load_config(
        CONFIGS / "frozenlake_ci.yaml",
        [
            "rl.steps=5",
            "rl.runs=[gigpo]",
            "warm_start.enabled=false",
            "rl.optimizer.learning_rate=2.5e-4",
            "model.model_dir=/models/qwen3",
            "eval.budgets=[1, 2]",
            "task.t_max = 6",
        ],
    )
    file_only = load_config(CONFIGS / "frozenlake_ci.yaml")
    assert config.rl.steps == 5 and config.rl.runs == ("gigpo",)
    assert config.warm_start.enabled is False
    assert config.rl.optimizer.learning_rate == 2.5e-4
    assert config.model.model_dir == "/models/qwen3"
    assert config.eval.budgets == (1, 2) and config.task.t_max == 6
    # Everything not overridden is the file's value (which differs from the default).
    assert config.rl.group_size == file_only.rl.group_size == 4
    assert config.model.hidden_size == file_only.model.hidden_size == 32
    # The last override of a field wins; the input mapping is not modified.
    data = {"rl": {"steps": 1}}
    assert apply_overrides(data, ["rl.steps=2", "rl.steps=3"])["rl"]["steps"] == 3
    assert data == {"rl": {"steps": 1}}
    # A value with '=' in it keeps everything after the first '='.
    assert apply_overrides({}, ["model.model_dir=/a=b"])["model"]["model_dir"] == "/a=b"


@pytest.mark.parametrize(
    "override, message",
    [
        ("rl.steps", r"override 'rl\.steps': expected section\.field=value"),
        ("steps=3", r"override 'steps=3': expected section\.field=value"),
        ("rl.=3", r"override 'rl\.=3': expected section\.field=value"),
        ("=3", r"expected section\.field=value"),
        ("rl.stepz=3", r"with override 'rl\.stepz=3': rl: unknown field 'stepz'"),
        ("rll.steps=3", r"with override 'rll\.steps=3': unknown section 'rll'"),
        (
            "rl.steps=three",
            r"with override 'rl\.steps=three': rl\.steps: must be an int in \[1, 10000000\], "
            r"got 'three'$",
        ),
        (
            "rl.steps=",
            r"with override 'rl\.steps=': rl\.steps: must be an int in \[1, 10000000\], got None$",
        ),
        (
            "rl.runs=[grpo, nope]",
            r"with override 'rl\.runs=\[grpo, nope\]': rl\.runs\[1\]: unknown run preset 'nope'",
        ),
        ("rl.algorithm=3", r"with override 'rl\.algorithm=3': rl\.algorithm: must be a mapping"),
        ("rl.steps.x=3", r"override 'rl\.steps\.x=3': rl\.steps: must be a mapping, got an int"),
        ("rl.algorithm..x=3", r"override 'rl\.algorithm\.\.x=3': expected section\.field=value"),
        (
            "model.tokenizer_isolate=yes please",
            r"model\.tokenizer_isolate: must be true or false, got 'yes please'",
        ),
        ("model.tokenizer_isolate=1", r"model\.tokenizer_isolate: must be true or false, got 1"),
    ],
)
def test_a_malformed_override_is_a_clear_error(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(CONFIGS / "frozenlake_ci.yaml", [override])


@pytest.mark.parametrize(
    "override, refused, closest",
    [
        ("rl.stepz=3", "rl: unknown field 'stepz'; known: ", "steps"),
        ("warm_start.epoch=2", "warm_start: unknown field 'epoch'; known: ", "epochs"),
        ("rll.steps=3", "unknown section 'rll'; known: ", "rl"),
        ("rl.lora={rnk: 2}", "rl.lora.rnk: unknown field; known: ", "rank"),
        (
            "task.env=frozenlak",
            "task.env: unknown environment 'frozenlak'; registered: ",
            "frozenlake",
        ),
        ("task.options={map_sise: 4}", "takes no option 'map_sise'; it takes: ", "map_size"),
        ("rl.runs=[grpo, GiGPO]", "rl.runs[1]: unknown run preset 'GiGPO'; presets: ", "gigpo"),
        (
            "rl.runs=[{name: x, preset: dapo-budgetmx}]",
            "rl.runs[0].preset: must be one of ",
            "dapo-budgetmix",
        ),
        ("rl.runs=[{name: x, lable: X}]", "rl.runs[0]: unknown field 'lable'; known: ", "label"),
        ("rl.algorithm={advantag: grpo}", "rl.algorithm: unknown field 'advantag'", "advantage"),
        (
            "rl.runs=[{name: x, preset: grpo, params: {clip_hi: 0.3}}]",
            "unknown hyper-parameter 'clip_hi'; the preset declares: ",
            "clip_high",
        ),
        ("rl.preset_params={kl_cof: 0.1}", "kl_cof: no run's preset declares it", "kl_coef"),
        (
            "rl.runs=[{name: x, algorithm: {advantage: gipo}}]",
            "unknown advantage estimator 'gipo'; known: ",
            "gigpo",
        ),
        (
            "rl.runs=[{name: x, algorithm: {loss_terms: [policy_clp]}}]",
            "unknown loss term 'policy_clp'; known: ",
            "policy_clip",
        ),
    ],
)
def test_a_misspelt_name_is_refused_with_the_closest_valid_one(override, refused, closest):
    """A config field or section, environment (or its option), run preset (or its field and
    hyper-parameters), estimator or loss term that is not one: the message lists the valid
    names and ends with the closest (difflib, ignoring case)."""
    with pytest.raises(ValueError) as error:
        load_config(CONFIGS / "frozenlake_ci.yaml", [override])
    message = str(error.value)
    assert refused in message and message.endswith(f"; did you mean {closest!r}?"), message


def test_a_name_close_to_none_gets_no_suggestion():
    for override in ("rl.runs=[grpo, nope]", "task.env=xyzzy", "rl.xyzzy=1"):
        with pytest.raises(ValueError) as error:
            load_config(CONFIGS / "frozenlake_ci.yaml", [override])
        assert "did you mean" not in str(error.value), str(error.value)


def test_tokenizer_isolate_is_refused_where_no_tokenizer_is_built_or_nothing_is_declared():
    with pytest.raises(ValueError, match=r"model\.tokenizer_isolate: only for the tokenizer built"):
        load_config(
            CONFIGS / "frozenlake_ci.yaml",
            ["model.tokenizer_isolate=true", "model.model_dir=/models/qwen3"],
        )
    with pytest.raises(ValueError, match=r"the sql environment's study declares no pieces"):
        config_from_dict({"task": {"env": "sql"}, "model": {"tokenizer_isolate": True}})
    assert load_config(
        CONFIGS / "frozenlake_ci.yaml", ["model.tokenizer_isolate=true"]
    ).model.tokenizer_isolate


# ---------------------------------------------------------------- the paper's numbers


def _paper_checks(
    config: ReproduceConfig, pass_k_samples: int = 128, learning_rate: float = 1e-6
) -> None:
    """docs/paper.md §2-§4 and §7 numbers every paper-scale config must hold (one GPU holds
    32 samples of a task at the full context, not the paper's 128: ``pass_k_samples``; LoRA
    adapters train at 1e-5, not full fine-tuning's 1e-6: ``learning_rate``)."""
    assert config.task.t_max == 70  # §2
    rl = config.rl
    assert rl.group_size == 16  # §4 G
    assert (
        rl.optimizer.learning_rate == learning_rate and rl.optimizer.weight_decay == 0.01
    )  # §4 AdamW
    assert rl.preset_params["kl_coef"] == 0.001  # §4 KL
    assert rl.sampling.temperature == 1.0 and rl.sampling.top_p == 1.0  # §4 rollouts
    assert rl.optimizer.critic_learning_rate == 1e-5  # §4 PPO critic
    assert rl.preset_params["clip_low"] == rl.preset_params["clip_high"] == 0.2  # §4 clips
    assert (
        rl.batching.epochs == 1 and rl.batching.mini_batches == 1 and rl.algorithm == {}
    )  # one update per batch (verl's)
    ev = config.eval
    assert ev.sampling.temperature == 0.6 and ev.sampling.top_p == 0.9  # §3 decoding
    assert ev.k == 8 and ev.samples >= ev.k  # §3 Pass@8
    assert ev.pass_k_samples == pass_k_samples  # §3 k = 1..128
    assert ev.states == 512 and ev.group_size == 16  # §7.1
    # Paper scale starts from a pretrained Qwen3 (no warm start), in bfloat16.
    assert config.model.model_dir is not None and config.warm_start.enabled is False
    assert config.model.dtype == "bfloat16"
    # Response and context lengths are consistent between training and evaluation.
    assert ev.max_response_tokens == config.task.max_response_tokens
    assert ev.max_context == config.task.max_context


@pytest.mark.parametrize("path", PAPER_CONFIGS + ONE_GPU_CONFIGS, ids=lambda p: p.name)
def test_paper_configs_hold_the_papers_numbers(path):
    config = load_config(path)
    one_gpu = path in ONE_GPU_CONFIGS
    lora = config.rl.lora is not None
    assert lora == ("lora" in path.name)
    if lora:  # Qwen3-8B: 16 rows of its cache on one GPU; rank 16 on every projection
        assert config.rl.lora.rank == 16 and len(config.rl.lora.targets) == 7
        _paper_checks(config, pass_k_samples=16, learning_rate=1e-5)
    else:
        _paper_checks(config, pass_k_samples=32 if one_gpu else 128)
    if one_gpu:  # one device, its model named in the folder (plan reads the size from it)
        assert config.mesh.resolve(1) == (1, 1, 1)
        assert path.name.split("_")[2] in config.model.model_dir.lower()


def _loss_term(algorithm: AlgorithmConfig, name: str):
    terms = [t for t in algorithm.loss_terms if t.name == name]
    assert len(terms) <= 1
    return terms[0] if terms else None


PAPER_RUNS = ("grpo", "budgetmix", "gigpo", "gigpo-budgetmix", "ppo", "ppo-budgetmix")


@pytest.mark.parametrize("path", [None, CONFIGS / "frozenlake_ci.yaml"], ids=["default", "ci"])
def test_a_default_hyper_parameter_applies_only_where_a_run_declares_it(path):
    """The CPU default sets kl_coef and aggregation for the presets that declare them; runs
    whose presets declare neither (DAPO) load without them, while a value the user states for
    no run's preset is still refused."""
    assert dict(load_config(path, ["rl.runs=[dapo]"]).rl.preset_params) == {}
    mixed = load_config(path, ["rl.runs=[dapo, grpo]"]).rl.preset_params
    assert mixed["kl_coef"] == 0.05 and mixed["aggregation"] == "seq-mean-token-mean"
    with pytest.raises(ConfigError, match="rl.preset_params.kl_coef: no run's preset declares"):
        load_config(path, ["rl.runs=[dapo]", "rl.preset_params.kl_coef=0.1"])


# every paper run (PPO's critic included, so not the LoRA config's adapters-only policy)
FULL_CONFIGS = PAPER_CONFIGS + [p for p in ONE_GPU_CONFIGS if "lora" not in p.name]


@pytest.mark.parametrize("path", FULL_CONFIGS, ids=lambda p: p.name)
def test_paper_configs_reach_the_trainer_with_the_papers_numbers(path):
    config = load_config(path, [f"rl.runs=[{','.join(PAPER_RUNS)}]"])
    specs = config.rl.resolved_runs()
    assert [s.name for s in specs] == list(PAPER_RUNS)
    # (GiGPO's and PPO's own hyper-parameters come in with their runs, at the paper's values)
    assert config.rl.preset_params["gigpo_omega"] == 1.0
    assert config.rl.preset_params["gigpo_gamma"] == 0.95
    assert config.rl.preset_params["value_clip"] == 0.5
    by_name = {s.name: train_config(config, s) for s in specs}
    for spec in specs:
        tc = by_name[spec.name]
        assert tc.rl is config.rl  # the section itself, not a copy
        assert spec.label == RUN_PRESETS[spec.name][0]
        assert tc.rl.optimizer.learning_rate == 1e-6 and tc.rl.optimizer.weight_decay == 0.01
        assert tc.kl_coef == 0.001 and tc.uses_reference
        clip = dict(_loss_term(tc.algorithm, "policy_clip").params)
        assert clip["clip_low"] == clip["clip_high"] == 0.2
        assert _loss_term(tc.algorithm, "policy_clip").coef == 1.0
        assert (tc.rl.batching.epochs, tc.rl.batching.mini_batches) == (1, 1)
        assert tc.max_response_length == 70 * config.task.max_response_tokens
        assert spec.budget_mix == spec.name.endswith("budgetmix")
        assert tc.budget_anchors == (spec.name == "gigpo-budgetmix")  # §5: anchor (s_t, B - t)
        # The rollouts: G = 16 at temperature 1.0; full-budget runs at T_max, BudgetMix draws.
        rollout = rollout_config(config, spec)
        assert rollout.group_size == 16
        assert rollout.sampling.temperature == 1.0 and rollout.sampling.top_p == 1.0
        assert rollout.budget == (None if spec.budget_mix else 70)

    for name in ("grpo", "budgetmix"):
        algorithm = by_name[name].algorithm
        assert algorithm.advantage == "grpo"
        assert _loss_term(algorithm, "value_clip") is None
        assert not by_name[name].uses_critic
    for name in ("gigpo", "gigpo-budgetmix"):
        algorithm = by_name[name].algorithm
        assert algorithm.advantage == "gigpo"
        params = dict(algorithm.advantage_params)
        assert params["omega"] == 1.0 and params["gamma"] == 0.95
    for name in ("ppo", "ppo-budgetmix"):
        tc = by_name[name]
        assert tc.algorithm.advantage == "gae" and tc.uses_critic
        assert tc.rl.optimizer.critic_learning_rate == 1e-5
        assert dict(_loss_term(tc.algorithm, "value_clip").params)["clip"] == 0.5

    # Evaluation decoding: temperature 0.6, top-p 0.9 (§3).
    sampling = config.eval.rollout_config().sampling
    assert sampling.temperature == 0.6 and sampling.top_p == 0.9


def test_a_zero_kl_coefficient_drops_the_kl_term():
    config = load_config(CONFIGS / "frozenlake_ci.yaml", ["rl.preset_params.kl_coef=0"])
    (spec, *_) = config.rl.resolved_runs()
    assert _loss_term(spec.algorithm, "kl") is None
    assert not train_config(config, spec).uses_reference


# ---------------------------------------------------------------- meshes


def test_mesh_settings_resolve_for_their_machines():
    # One 8-GPU node: FSDP over all 8; a TPU slice: FSDP in groups of 8, data across groups.
    for path in PAPER_CONFIGS:
        mesh = load_config(path).mesh
        assert mesh.resolve(8) == (1, 8, 1), path.name
        if path.name.endswith("_tpu.yaml"):
            assert mesh.resolve(64) == (8, 8, 1)
            with pytest.raises(ValueError, match="not divisible"):
                mesh.resolve(12)
        else:
            with pytest.raises(ValueError, match="needs 8 devices"):
                mesh.resolve(16)
    # The CPU configs run on one device (more is refused, not silently ignored).
    for mesh in (default_config().mesh, load_config(CONFIGS / "frozenlake_ci.yaml").mesh):
        assert mesh.resolve(1) == (1, 1, 1)
        with pytest.raises(ValueError, match="needs 1 devices"):
            mesh.resolve(8)


_MESH_SCRIPT = """
import json, sys
import jax
from agentrl_jax.reproduce.config import load_config
from agentrl_jax.sharding import build_mesh
assert jax.device_count() == 8, jax.devices()
print(json.dumps({p: dict(build_mesh(load_config(p).mesh).shape) for p in sys.argv[1:]}))
"""


def test_paper_meshes_build_on_eight_fake_cpu_devices():
    env = fake_devices_env(8)
    done = subprocess.run(
        [sys.executable, "-c", _MESH_SCRIPT, *map(str, PAPER_CONFIGS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    shapes = json.loads(done.stdout.strip().splitlines()[-1])
    for path in PAPER_CONFIGS:
        assert shapes[str(path)] == {"data": 1, "fsdp": 8, "expert": 1, "tensor": 1}, path.name


def test_mesh_section_is_a_mesh_config():
    assert isinstance(ReproduceConfig().mesh, MeshConfig)
    assert ReproduceConfig().mesh == MeshConfig(data=1, fsdp=1, tensor=1)


# ---------------------------------------------------------------- composing runs by name


def _terms(algorithm: AlgorithmConfig) -> dict:
    return {t.name: (t.coef, dict(t.params)) for t in algorithm.loss_terms}


def test_every_preset_builds_and_reaches_the_trainer():
    TABLE = RUN_PRESETS
    config = default_config(overrides=[f"rl.runs=[{', '.join(TABLE)}]", "task.t_max=12"])
    specs = config.rl.resolved_runs()
    assert [s.name for s in specs] == list(TABLE)
    for spec in specs:
        assert (
            spec.label == TABLE[spec.name].label and spec.budget_mix == TABLE[spec.name].budget_mix
        )
    by_name = {s.name: train_config(config, s).algorithm for s in specs}
    assert _terms(by_name["dapo"]) == {
        "policy_clip": (1.0, {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": None})
    }
    assert by_name["dapo"].dynamic_sampling and by_name["dapo"].max_rollout_batches == 4
    assert by_name["dapo"].overlong_buffer == 0 and not by_name["grpo"].dynamic_sampling
    # Dr. GRPO's constant is the most sampled tokens a row can hold, which the trainer knows.
    dr = by_name["dr-grpo"]
    assert (dr.advantage, dr.aggregation, dr.aggregation_constant) == (
        "dr_grpo",
        "seq-mean-token-sum",
        96.0,  # T_max 12 x 8 tokens
    )
    with pytest.raises(
        ValueError, match="TrainConfig.max_response_length: must be set .* aggregation_constant"
    ):
        TrainConfig(algorithm=specs[list(TABLE).index("dr-grpo")].algorithm)
    assert by_name["rloo"].advantage == "rloo" and "gspo_clip" in _terms(by_name["gspo"])


def test_a_gigpo_run_with_dapos_clip_is_composed_by_name_from_the_command_line():
    override = (
        "rl.runs=[gigpo, {name: gigpo-dapo, preset: gigpo, label: 'GiGPO, DAPO clip', "
        "budget_mix: true, algorithm: {loss_terms: [{name: policy_clip, "
        "params: {clip_low: 0.2, clip_high: 0.28}}, {name: kl, coef: 0.001}]}}]"
    )
    config = load_config(
        CONFIGS / "frozenlake_ci.yaml",
        [override, "rl.batching.epochs=2", "rl.batching.mini_batches=2"],
    )
    assert config.rl.run_names == ("gigpo", "gigpo-dapo")
    plain, dapo = config.rl.resolved_runs()
    assert (dapo.label, dapo.budget_mix) == ("GiGPO, DAPO clip", True)
    algorithm = dapo.algorithm
    assert (
        algorithm.advantage == "gigpo" and dict(algorithm.advantage_params)["gamma"] == 0.95
    )  # the preset's
    assert _terms(algorithm)["policy_clip"][1]["clip_high"] == 0.28
    assert _terms(plain.algorithm)["policy_clip"][1]["clip_high"] == 0.2
    # GiGPO reads anchor states: under BudgetMix it anchors on (s_t, B - t), found from what it
    # declares.
    assert train_config(config, dapo).budget_anchors
    assert not train_config(config, plain).budget_anchors
    assert (config.rl.batching.epochs, config.rl.batching.mini_batches) == (2, 2)
    # It round-trips through the results folder's config.yaml.
    assert config_from_dict(yaml.safe_load(dump_config(config))) == config
    assert (
        load_config(
            CONFIGS / "frozenlake_ci.yaml",
            [override, "rl.batching.epochs=2", "rl.batching.mini_batches=2"],
        )
        == config
    )


def test_rl_algorithm_and_the_shared_hyper_parameters_reach_every_run():
    config = load_config(
        CONFIGS / "frozenlake_ci.yaml",
        [
            "rl.runs=[grpo, ppo, dapo]",
            "rl.preset_params.clip_high=0.28",
            "rl.algorithm.aggregation=seq-mean-token-mean",
        ],
    )
    assert config.rl.algorithm == {"aggregation": "seq-mean-token-mean"}
    grpo, ppo, dapo = (s.algorithm for s in config.rl.resolved_runs())
    assert all(a.aggregation == "seq-mean-token-mean" for a in (grpo, ppo, dapo))
    assert (
        _terms(grpo)["policy_clip"][1]["clip_high"]
        == _terms(ppo)["policy_clip"][1]["clip_high"]
        == 0.28
    )
    assert _terms(ppo)["value_clip"][1]["clip"] == 0.5  # the rest of the preset stays
    # Overriding the advantage restarts its parameters from the new estimator's defaults.
    config = load_config(
        CONFIGS / "frozenlake_ci.yaml",
        [
            "rl.runs=[gigpo]",
            "rl.algorithm.advantage=grpo",
            "rl.algorithm.loss_terms=[policy_clip, entropy]",
        ],
    )
    (spec,) = config.rl.resolved_runs()
    assert spec.algorithm.advantage == "grpo" and list(_terms(spec.algorithm)) == [
        "policy_clip",
        "entropy",
    ]
    assert not train_config(config, spec).uses_reference  # no term reads reference log-probs


def test_a_preset_registered_from_outside_declares_and_checks_its_hyper_parameters():
    from agentrl_jax.algorithms import Param
    from agentrl_jax.train.presets import POLICY, grpo_algorithm, register_run_preset

    name = "test-grpo-tempered"
    params = {
        **POLICY,
        "aggregation": Param("token-mean", lambda v: v == "token-mean", "token-mean"),
    }
    try:
        register_run_preset(name, label="GRPO, token mean", algorithm=grpo_algorithm, params=params)
        with pytest.raises(ValueError, match="already registered"):
            register_run_preset(name, label="again", algorithm=grpo_algorithm)
        # the CPU default's shared aggregation is refused by this preset's own check
        with pytest.raises(ValueError, match=r"rl\.preset_params\.aggregation: must be token-mean"):
            load_config(CONFIGS / "frozenlake_ci.yaml", [f"rl.runs=[{name}]"])
        token_mean = "rl.preset_params.aggregation=token-mean"
        config = load_config(CONFIGS / "frozenlake_ci.yaml", [f"rl.runs=[{name}]", token_mean])
        (spec,) = config.rl.resolved_runs()
        assert spec.label == "GRPO, token mean" and spec.algorithm.aggregation == "token-mean"
        # a run's own params are checked against what its preset declares
        with pytest.raises(ValueError, match=r"rl\.runs\[0\]\.params: unknown hyper-parameter"):
            load_config(
                CONFIGS / "frozenlake_ci.yaml",
                [f"rl.runs=[{{name: x, preset: {name}, params: {{gigpo_omega: 2}}}}]", token_mean],
            )
        (own,) = load_config(
            CONFIGS / "frozenlake_ci.yaml",
            [f"rl.runs=[{{name: x, preset: {name}, params: {{kl_coef: 0.5}}}}]", token_mean],
        ).rl.resolved_runs()
        assert _terms(own.algorithm)["kl"][0] == 0.5
    finally:
        RUN_PRESETS.pop(name, None)
    with pytest.raises(ValueError, match="run preset name"):
        register_run_preset("init", label="x", algorithm=grpo_algorithm)


def test_the_shared_aggregation_reaches_the_presets_that_declare_it_and_no_other():
    def aggregations(rl: RLConfig) -> dict[str, str]:
        return {s.name: s.algorithm.aggregation for s in rl.resolved_runs()}

    presets = ("grpo", "budgetmix", "budgetmix-adaptive", "gigpo", "ppo", "rloo", "dapo", "dr-grpo")
    default = aggregations(default_config(overrides=[f"rl.runs=[{', '.join(presets)}]"]).rl)
    assert default == {
        **{p: "seq-mean-token-mean" for p in presets[:6]},  # the CPU default's
        "dapo": "token-mean",
        "dr-grpo": "seq-mean-token-sum",
    }
    assert (
        aggregations(RLConfig(runs=presets))
        == {  # the presets' own default (the paper's)
            **default,
            **{p: "token-mean" for p in presets[:6]},
        }
    )
    with pytest.raises(ValueError, match=r"^rl\.preset_params\.aggregation: "):
        RLConfig(preset_params={"aggregation": "mean"})


def test_nested_overrides_do_not_touch_their_input():
    data = {"rl": {"algorithm": {"advantage": "grpo"}}}
    out = apply_overrides(
        data, ["rl.algorithm.aggregation=token-mean", "rl.algorithm.advantage_params.eps=0.1"]
    )
    assert out["rl"]["algorithm"] == {
        "advantage": "grpo",
        "aggregation": "token-mean",
        "advantage_params": {"eps": 0.1},
    }
    assert data == {"rl": {"algorithm": {"advantage": "grpo"}}}


def test_the_adaptive_budgetmix_preset_draws_only_budgets_each_task_can_meet():
    """``budgetmix-adaptive``: BudgetMix whose draws skip budgets below a task's shortest path
    (the rollout asks the environment's ``structural_bounds``); T_max where none is left."""
    import jax

    from agentrl_jax.algorithms.budgetmix import budget_set
    from agentrl_jax.models.tokenizer import load_tokenizer
    from agentrl_jax.rollout import MultiTurnRollout
    from envs.frozenlake import maps as fl_maps
    from envs.frozenlake.text_env import FrozenLakeTextConfig, FrozenLakeTextEnv

    whole = default_config(
        overrides=[
            "rl.runs=[budgetmix, budgetmix-adaptive]",
            "task.t_max=20",
            "task.max_context=512",
        ]
    )
    specs = {s.name: s for s in whole.rl.resolved_runs()}
    assert specs["budgetmix-adaptive"].budget_mix == "adaptive"
    config = rollout_config(whole, specs["budgetmix-adaptive"])
    assert config.budget is None and config.adaptive_budgets
    assert not rollout_config(whole, specs["budgetmix"]).adaptive_budgets
    env = FrozenLakeTextEnv(
        fl_maps.generate(jax.random.key(2), 40, size=6, p=0.8), FrozenLakeTextConfig(t_max=20)
    )
    bounds = env.structural_bounds(np.arange(40))
    assert bounds.min() >= 2 and bounds.max() <= 20  # 6x6 solvable maps: between 2 and 20 moves
    runner = MultiTurnRollout(env, load_tokenizer(), config)
    drawn = [runner._group_budgets(jax.random.key(k), np.arange(40), None) for k in range(5)]
    for budgets in drawn:
        assert set(budgets) <= set(budget_set(20))
        assert (budgets >= bounds).all()  # never a budget the task cannot meet
    plain = MultiTurnRollout(
        env, load_tokenizer(), dataclasses.replace(config, adaptive_budgets=False)
    )
    assert any(
        (plain._group_budgets(jax.random.key(k), np.arange(40), None) < bounds).any()
        for k in range(5)
    )  # plain BudgetMix does draw them
    with pytest.raises(ConfigError, match="budget_mix: must be true, false or adaptive"):
        RLConfig(runs=({"name": "x", "preset": "grpo", "budget_mix": "sometimes"},))


def test_one_engine_serves_the_rollouts_and_the_evaluation():
    config = default_config(overrides=["engine.kv_page_size=null", "engine.prefill_chunk=64"])
    assert (config.engine.paging, config.engine.prefill_chunk) == (None, 64)
    for section in ("rl", "eval"):
        fields = {f.name for f in dataclasses.fields(getattr(config, section))}
        assert not fields & {"kv_page_size", "prefill_chunk", "kv_cache_dtype", "kv_pages"}
    with pytest.raises(ConfigError, match=r"engine\.kv_page_size: the paged KV cache"):
        default_config(overrides=["mesh.tensor=2"])
