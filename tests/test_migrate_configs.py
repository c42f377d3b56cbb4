"""notebooks/migrate_configs.py, the one way to upgrade a config stored in an earlier layout
(the package reads only the current one): every old field moves to where it lives now, what
cannot move without changing the run is refused naming the field, a migrated file loads into
the config it ran, and every config stored in the repository is in the current layout."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from agentrl_jax.algorithms import AlgorithmConfig
from agentrl_jax.config_io import dump_config
from agentrl_jax.errors import ConfigError
from agentrl_jax.reproduce.config import config_from_dict, load_config
from agentrl_jax.sampling.config import EngineConfig

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "notebooks" / "migrate_configs.py"
STORED = sorted((ROOT / "notebooks").glob("**/config.yaml"))
SHIPPED = sorted((ROOT / "configs").glob("*.yaml"))


def _script():
    spec = importlib.util.spec_from_file_location("migrate_configs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


migrate_configs = _script()
migrate = migrate_configs.migrate
MigrationError = migrate_configs.MigrationError


def _loss_term(algorithm: AlgorithmConfig, name: str):
    return next((t for t in algorithm.loss_terms if t.name == name), None)


# an rl section as the oldest stored results folders wrote it
OLD = {
    "rl": {
        "runs": ["grpo", "gigpo"],
        "kl_coef": 0.01,
        "aggregation": "token-mean",
        "clip_low": 0.2,
        "clip_high": 0.3,
        "gigpo_omega": 0.5,
        "gigpo_gamma": 0.9,
        "gae_gamma": 0.99,  # no run reads it: dropped (it never had an effect)
        "kv_page_size": 32,
        "kv_pages": 64,
        "prefill_chunk": 128,
        "kv_cache_dtype": "bfloat16",
        "generation_layout": "training",
    },
    "eval": {
        "gamma": 0.95,
        "kv_page_size": 32,
        "prefill_chunk": 128,
        "kv_cache_dtype": "bfloat16",
    },
}


def test_migration_moves_every_old_field_and_refuses_what_it_cannot_move():
    config = config_from_dict(migrate(OLD))
    assert config.engine == EngineConfig(
        kv_cache_dtype="bfloat16",
        prefill_chunk=128,
        kv_page_size=32,
        kv_pages=64,
        generation_layout="training",
    )
    assert config.rl.preset_params == {
        "aggregation": "token-mean",
        "clip_high": 0.3,
        "clip_low": 0.2,
        "gigpo_gamma": 0.9,
        "gigpo_omega": 0.5,
        "kl_coef": 0.01,
    }
    gigpo = config.rl.resolved_runs()[1].algorithm
    assert dict(gigpo.advantage_params).items() >= {"omega": 0.5, "gamma": 0.9}.items()
    for run in config.rl.resolved_runs()[:1]:  # grpo: the KL, clip and aggregation rl gave it
        assert _loss_term(run.algorithm, "kl").coef == 0.01
        clip = dict(_loss_term(run.algorithm, "policy_clip").params)
        assert (clip["clip_low"], clip["clip_high"]) == (0.2, 0.3)
        assert run.algorithm.aggregation == "token-mean"
    # the package reads only the current layout: an old field (in a file or an override) is
    # an unknown one, and the new place of an old override is where the script puts it
    with pytest.raises(ConfigError, match=r"rl: unknown field 'kl_coef'"):
        load_config(ROOT / "configs" / "frozenlake_ci.yaml", ["rl.kl_coef=0.02"])
    with pytest.raises(ConfigError, match=r"rl: unknown field 'kl_coef'"):
        config_from_dict(OLD)
    assert (
        load_config(
            ROOT / "configs" / "frozenlake_ci.yaml", ["rl.preset_params.kl_coef=0.02"]
        ).rl.preset_params["kl_coef"]
        == 0.02
    )
    with pytest.raises(MigrationError, match=r"eval\.kv_page_size: 16, but rl\.kv_page_size is 32"):
        migrate({"rl": {"kv_page_size": 32}, "eval": {"kv_page_size": 16}})
    with pytest.raises(MigrationError, match=r"eval\.gamma: 0\.9; the step quality's discount"):
        migrate({"eval": {"gamma": 0.9}})


@pytest.mark.parametrize(
    "old, message",
    [
        (
            {"rl": {"kv_page_size": None}, "eval": {"kv_page_size": 16}},
            "eval.kv_page_size: 16, but rl.kv_page_size is None: the sampling engine is one "
            "section now (engine.kv_page_size), shared by the rollouts and the evaluation",
        ),
        (
            {"eval": {"gamma": int("9" * 400)}},
            "eval.gamma: " + "9" * 197 + "...; the step quality's discount is the "
            "environment's own now (0.95, §7), not a setting",
        ),
    ],
    ids=["an evaluation that paged differently", "a step-quality discount"],
)
def test_what_cannot_move_is_named(old, message):
    with pytest.raises(MigrationError) as info:
        migrate(old)
    assert str(info.value) == message


def test_the_script_rewrites_a_file_once_and_leaves_a_current_one_as_it_is(tmp_path, capsys):
    old, current = tmp_path / "old.yaml", tmp_path / "current.yaml"
    old.write_text(yaml.safe_dump(OLD, sort_keys=False))
    current.write_text((ROOT / "configs" / "frozenlake_ci.yaml").read_text())
    before = current.read_bytes()
    assert migrate_configs.main(["--check", str(old), str(current)]) == 1
    assert yaml.safe_load(old.read_text()) == OLD  # --check writes nothing
    assert migrate_configs.main([str(old), str(current)]) == 0
    assert f"migrated {old}" in capsys.readouterr().out
    assert current.read_bytes() == before
    loaded, expected = load_config(old), config_from_dict(migrate(OLD))
    assert (loaded.engine, loaded.rl.preset_params) == (expected.engine, expected.rl.preset_params)
    assert migrate_configs.main(["--check", str(old)]) == 0  # once is enough
    bad = tmp_path / "bad.yaml"
    bad.write_text("eval:\n  gamma: 0.5\n")
    assert migrate_configs.main([str(bad)]) == 2
    assert "eval.gamma: 0.5" in capsys.readouterr().err


def test_the_stored_results_folders_are_found():
    assert len(STORED) >= 6, STORED


@pytest.mark.parametrize("path", [*STORED, *SHIPPED], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_stored_config_is_in_the_current_layout_and_loads(path):
    """Every config the repository stores was migrated (the script would change nothing), loads,
    and written again reads back the same."""
    assert migrate(yaml.safe_load(path.read_text())) == yaml.safe_load(path.read_text())
    config = load_config(path)
    assert config_from_dict(yaml.safe_load(dump_config(config))) == config


FLAT = """\
# a config of the flat rl layout
rl:
  runs: [grpo]
  steps: 2
  learning_rate: 1.0e-4   # ours
  # memory: none changes the numbers
  remat: full
  num_micro_batches: 2
  max_staleness: 1
  checkpoint_every: 1
  checkpoint_keep: 3
  tensorboard: false
  temperature: 0.9
eval:
  samples: 8
  temperature: 0.7        # the evaluation's
  top_p: 0.95
"""


def test_flat_rl_fields_move_into_their_subsections_keeping_the_comments(tmp_path):
    text = migrate_configs.migrate_text(FLAT)
    assert "# a config of the flat rl layout" in text
    assert "  optimizer:\n    learning_rate: 1.0e-4   # ours\n" in text
    assert "  memory:\n    # memory: none changes the numbers\n    remat: full\n" in text
    assert "  checkpoint:\n    every: 1\n    keep: 3\n" in text
    assert "  sampling:\n    temperature: 0.7        # the evaluation's\n    top_p: 0.95\n" in text
    data = yaml.safe_load(text)
    assert data == migrate(yaml.safe_load(FLAT))
    assert data["eval"]["sampling"] == {  # top_k 0: the evaluation never truncated to the top k
        "temperature": 0.7,
        "top_k": 0,
        "top_p": 0.95,
    }
    path = tmp_path / "flat.yaml"
    path.write_text(FLAT)
    assert migrate_configs.main([str(path)]) == 0
    config = load_config(path)
    rl = config.rl
    assert (rl.optimizer.learning_rate, rl.memory.remat, rl.batching.num_micro_batches) == (
        1e-4,
        "full",
        2,
    )
    assert (rl.asynchronous.max_staleness, rl.checkpoint.every, rl.checkpoint.keep) == (1, 1, 3)
    assert (rl.logging.tensorboard, rl.sampling.temperature) == (False, 0.9)
    assert (config.eval.sampling.temperature, config.eval.sampling.top_p) == (0.7, 0.95)
    assert migrate_configs.main(["--check", str(path)]) == 0
    # a flow-style section moves too (written by yaml.safe_dump: its comments are not kept)
    flow = migrate_configs.migrate_text("rl: {steps: 2, epochs: 2, mini_batches: 2}\n")
    assert yaml.safe_load(flow) == {
        "rl": {"steps": 2, "batching": {"epochs": 2, "mini_batches": 2}}
    }
    with pytest.raises(MigrationError, match=r"rl\.epochs: 2, but rl\.batching\.epochs is 3"):
        migrate({"rl": {"epochs": 2, "batching": {"epochs": 3}}})
    with pytest.raises(MigrationError, match=r"rl\.batching: 4, but rl\.epochs belongs in it"):
        migrate({"rl": {"epochs": 2, "batching": 4}})
