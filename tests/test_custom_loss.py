"""A user's own loss term, registered from outside the package (in this file) under a name of
its own, needing the policy's entropy and the reference's log-probs: the trainer computes both
because the term declares them (there is no "entropy" or "kl" term in the config), trains with
it through the public API (the train step in the training loop) and through the CLI
(``agentrl-jax reproduce frozenlake --plugin`` on this very file); and the plugin loader.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from train_fakes import make_fake_rollout, random_trajectory, task_batches, tiny_model
from typer.testing import CliRunner

from agentrl_jax.algorithms import (
    LOSS_TERMS,
    AlgorithmConfig,
    LossTermConfig,
    Param,
    register_loss_term,
)
from agentrl_jax.cli import app
from agentrl_jax.errors import ConfigError
from agentrl_jax.plugins import PLUGINS_ENV, PluginError, load_plugin, load_plugins
from agentrl_jax.reproduce.config import load_config
from agentrl_jax.train import (
    MetricsLogger,
    RLConfig,
    TrainBatch,
    TrainConfig,
    init_train_state,
    make_train_step,
    read_metrics,
    train,
    train_config,
)
from agentrl_jax.train.inputs import step_inputs

ROOT = Path(__file__).resolve().parent.parent
CI_CONFIG = ROOT / "configs" / "frozenlake_ci.yaml"
TERM = "test_custom_entropy_k2"  # a name the trainer has never heard of


@register_loss_term(
    TERM,
    required=("logprobs", "entropy", "ref_logprobs"),
    params={"tau": Param(0.1, lambda v: isinstance(v, float) and v >= 0, "a float >= 0")},
)
def entropy_k2(inputs, *, tau):
    """Per token ``(log pi - log pi_ref)^2 / 2 - tau * H(pi)``: a k2 pull to the reference plus
    an entropy bonus, and the entropy as a metric of its own."""
    d = inputs.logprobs - inputs.ref_logprobs
    return 0.5 * d**2 - tau * inputs.entropy, {"entropy": inputs.entropy}


@register_loss_term("test_custom_reads_values", required=("logprobs", "values"))
def reads_values(inputs):
    """A policy term that reads the critic's differentiated values: the step cannot give it that."""
    return inputs.logprobs * inputs.values


ALGORITHM = AlgorithmConfig(loss_terms=(LossTermConfig("policy_clip"), LossTermConfig(TERM, 0.5)))


def test_the_step_computes_what_the_term_declares_whatever_its_name():
    config = TrainConfig(algorithm=ALGORITHM)
    needs = step_inputs(config.algorithm)
    assert needs.live("policy") == {"logprobs", "entropy"} and needs.reference
    assert config.kl_coef == 0.0 and config.uses_reference  # no "kl" term, yet a reference
    plain_config = TrainConfig(
        algorithm=AlgorithmConfig(loss_terms=(LossTermConfig("policy_clip"),))
    )
    plain = step_inputs(plain_config.algorithm)
    assert plain.live("policy") == {"logprobs"} and not plain.reference  # nothing extra computed
    model = tiny_model(num_hidden_layers=1)
    assert init_train_state(model, plain_config).reference is None
    assert init_train_state(model, config).reference is not None


def test_a_term_needing_an_input_the_step_cannot_compute_is_refused_naming_it():
    algorithm = AlgorithmConfig(
        loss_terms=(LossTermConfig("policy_clip"), LossTermConfig("test_custom_reads_values"))
    )
    with pytest.raises(
        ConfigError,
        match=r"TrainConfig\.algorithm\.loss_terms\[1\]: loss term "
        r"'test_custom_reads_values' \(policy\) needs LossInputs\.values, but "
        r"the train step computes it only for critic terms",
    ):
        TrainConfig(algorithm=algorithm)


def _hand_term(params, reference, graphdef, traj, tau=0.1):
    """The term's token mean on a batch, from full logits (log-softmax, entropy) written out."""
    tokens, mask = traj.tokens, traj.token_mask
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)

    def log_softmax(p):
        logits, _ = nnx.merge(graphdef, p)(tokens, positions, mask)
        return jax.nn.log_softmax(logits[:, :-1], axis=-1)

    lsm, ref_lsm = log_softmax(params), log_softmax(reference)
    picked = jnp.take_along_axis(lsm, tokens[:, 1:, None], axis=-1)[..., 0]
    ref = jnp.take_along_axis(ref_lsm, tokens[:, 1:, None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(lsm) * lsm, axis=-1)
    per_token = 0.5 * (picked - ref) ** 2 - tau * entropy
    m = (traj.loss_mask & traj.row_mask[:, None])[:, 1:].astype(jnp.float32)
    return jnp.sum(per_token * m) / jnp.sum(m), jnp.sum(entropy * m) / jnp.sum(m)


def test_training_with_the_term_through_the_public_api(tmp_path):
    model = tiny_model(num_hidden_layers=1)
    graphdef = nnx.graphdef(model)
    config = TrainConfig(
        rl=RLConfig(optimizer={"learning_rate": 1e-2}, steps=3), algorithm=ALGORITHM
    )
    state = init_train_state(model, config)
    rng = np.random.default_rng(0)  # a reference away from the policy, so the k2 part is not 0
    state = state.replace(
        reference=jax.tree.map(
            lambda x: jnp.asarray(np.asarray(x) + 0.05 * rng.standard_normal(x.shape), x.dtype),
            state.reference,
        )
    )
    step, seen = make_train_step(graphdef, config), []

    def spy(state, batch):
        seen.append((state.policy, batch.trajectory))
        return step(state, batch)

    final = train(
        state,
        spy,
        make_fake_rollout(graphdef, group_size=8),
        task_batches(4, 2),
        config,
        logger=MetricsLogger(tmp_path / "m.jsonl"),
        progress=False,
    )
    records = read_metrics(tmp_path / "m.jsonl")
    assert int(final.step) == 3 and [r["update_skipped"] for r in records] == [0, 0, 0]
    assert all(math.isfinite(r[f"loss/{TERM}"]) and r[f"{TERM}/entropy"] > 0 for r in records)
    # The step's value of the term is the term computed by hand, with entropy and reference
    # log-probs.
    params, traj = seen[0]
    want, entropy = jax.jit(_hand_term, static_argnums=2)(params, state.reference, graphdef, traj)
    np.testing.assert_allclose(records[0][f"loss/{TERM}"], float(want), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(records[0][f"{TERM}/entropy"], float(entropy), rtol=1e-5)
    assert abs(float(want) + 0.1 * float(entropy)) > 1e-6  # the reference part is not 0


# ------------------------------------------------------------------------- the CLI


def test_the_cli_trains_with_a_term_from_a_plugin_file(tmp_path):
    out = tmp_path / "out"
    run = (
        f"rl.runs=[{{name: custom, label: Custom, preset: grpo, algorithm: {{loss_terms: "
        f"[policy_clip, {{name: {TERM}, coef: 0.5, params: {{tau: 0.2}}}}]}}}}]"
    )
    result = CliRunner().invoke(
        app,
        [
            "reproduce",
            "frozenlake",
            "--config",
            str(CI_CONFIG),
            "--out",
            str(out),
            "--plugin",
            __file__,
            "--set",
            "warm_start.enabled=false",
            "--set",
            "rl.steps=1",
            "--set",
            run,
            "--until",
            "train:custom",
            "--no-progress",
        ],
        env={"COLUMNS": "1000"},
    )
    assert result.exit_code == 0, result.output
    (record,) = [
        json.loads(line)
        for line in (out / "runs" / "custom" / "metrics.jsonl").read_text().splitlines()
    ]
    assert math.isfinite(record[f"loss/{TERM}"]) and record[f"{TERM}/entropy"] > 0
    assert record["update_skipped"] == 0
    # The run records the plugin it was made with: the file and its sha256, in the results
    # folder and in the checkpoint's metadata.
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    (recorded,) = [
        r
        for r in json.loads((out / "plugins.json").read_text())["plugins"]
        if r["file"] == str(Path(__file__).resolve())
    ]
    assert recorded["sha256"] == digest and recorded["spec"] == __file__
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager((out / "runs" / "custom" / "checkpoints").resolve()) as manager:
        saved = manager.restore(1, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config
    assert any(r["sha256"] == digest for r in saved["plugins"])
    # A config the folder's plugins would make loadable: the error names them.
    result = CliRunner().invoke(
        app,
        [
            "reproduce",
            "frozenlake",
            "--config",
            str(CI_CONFIG),
            "--out",
            str(out),
            "--set",
            "rl.runs=[{name: x, algorithm: {loss_terms: [policy_clip, not_registered_anywhere]}}]",
            "--no-progress",
        ],
        env={"COLUMNS": "1000"},
    )
    assert result.exit_code == 2 and "was made with the plugins" in " ".join(result.output.split())
    # Without the plugin the config cannot name the term: a usage error naming it.
    result = CliRunner().invoke(
        app,
        [
            "reproduce",
            "frozenlake",
            "--config",
            str(CI_CONFIG),
            "--out",
            str(tmp_path / "other"),
            "--set",
            "rl.runs=[{name: x, algorithm: {loss_terms: [policy_clip, not_registered_anywhere]}}]",
            "--no-progress",
        ],
        env={"COLUMNS": "1000"},
    )
    assert result.exit_code == 2 and "unknown loss term 'not_registered_anywhere'" in " ".join(
        result.output.split()
    )


# ------------------------------------------------------------------------- the plugin loader


def test_plugins_load_by_path_once_and_name_their_errors(tmp_path, monkeypatch):
    name = f"test_plugin_term_{tmp_path.name}"
    plugin = tmp_path / "my_loss.py"
    plugin.write_text(
        "from agentrl_jax.algorithms import register_loss_term\n"
        f"@register_loss_term({name!r}, required=('logprobs',))\n"
        "def term(inputs):\n    return -inputs.logprobs\n"
    )
    module = load_plugin(str(plugin))
    assert name in LOSS_TERMS and LOSS_TERMS[name].fn is module.term
    assert load_plugin(str(plugin)) is module  # already imported: not registered twice
    assert load_plugin(__file__) is sys.modules[__name__]  # this test module, imported by pytest
    monkeypatch.setenv(PLUGINS_ENV, f"{plugin}{__import__('os').pathsep}json")
    assert load_plugins(["math"]) == [module, json, math]

    with pytest.raises(PluginError, match=r"plugin .*missing\.py: no such file"):
        load_plugin(str(tmp_path / "missing.py"))
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(PluginError, match=r"broken\.py: importing it failed: RuntimeError: boom"):
        load_plugin(str(broken))
    with pytest.raises(
        PluginError, match=r"plugin 'no_such_module_here': no module named 'no_such_module_here'"
    ):
        load_plugin("no_such_module_here")


def test_the_readme_guide_defines_a_term_its_command_line_trains_with(tmp_path):
    """docs/extending.md "Write your own loss": its file registers the term, its ``--set``
    composes a run with it, and the train step traces with that run's config."""
    readme = (ROOT / "docs" / "extending.md").read_text()
    section = readme.split("## Write your own loss", 1)[1].split("\n## ", 1)[0]
    source = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    command = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    assert "--plugin my_loss.py" in command
    (tmp_path / "my_loss.py").write_text(source)
    load_plugin(str(tmp_path / "my_loss.py"))
    override = re.search(r"--set '(.*?)'", command, re.S).group(1)
    config = load_config(CI_CONFIG, [override])
    (spec,) = config.rl.resolved_runs()
    update = train_config(config, spec)
    assert spec.name == "gated" and spec.label == "GRPO, gated KL"
    assert [t.name for t in update.algorithm.loss_terms] == [
        "policy_clip",
        "entropy_gated_kl",
    ]
    assert update.uses_reference and "entropy" in step_inputs(update.algorithm).live("policy")
    model = tiny_model(num_hidden_layers=1)
    step = make_train_step(nnx.graphdef(model), update)
    state = jax.eval_shape(lambda: init_train_state(model, update))
    _, metrics = jax.eval_shape(step._step, state, TrainBatch(random_trajectory(0)))
    assert {"loss/entropy_gated_kl", "entropy_gated_kl/weight"} <= set(metrics)
