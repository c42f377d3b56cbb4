"""LoRA (issue #47): adapters off or at B = 0 give the base model; gradients equal those of a
merged-weight loss written by hand; the train step trains the adapters only, with the base as
the KL reference and no second copy; the merged export loads in transformers; checkpoints hold
the adapters and resume bit for bit; PEFT's tensor layout."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file
from train_fakes import random_trajectory, tiny_model

from agentrl_jax.errors import ConfigError
from agentrl_jax.models import lora
from agentrl_jax.models.checkpoints import export_qwen3
from agentrl_jax.models.qwen3 import positions_from_mask
from agentrl_jax.train import RLConfig, TrainConfig, init_train_state, make_train_step
from agentrl_jax.train.batch import TrainBatch
from agentrl_jax.train.checkpoint import Checkpointer, CheckpointMismatchError
from agentrl_jax.train.state import policy_params, train_model
from agentrl_jax.train.step import compute_gradients

LORA = lora.LoraConfig(rank=4, alpha=8.0)


def _inputs(rows=2, length=7, vocab=64):
    tokens = (jnp.arange(rows * length).reshape(rows, length) * 7) % vocab
    mask = jnp.ones((rows, length), bool).at[0, -2:].set(False)
    return tokens, positions_from_mask(mask), mask


def _with_random_b(model, key):
    """``model``'s adapters with B drawn at random (B = 0 after init would hide A's gradient)."""
    graphdef, adapters, base = lora.split_adapters(model)
    pure = nnx.to_pure_dict(adapters)
    keys = iter(jax.random.split(key, 16))
    for name, value in pure["layers"]["lora"].items():
        if name.endswith("_b"):
            pure["layers"]["lora"][name] = 0.1 * jax.random.normal(next(keys), value.shape)
    nnx.replace_by_pure_dict(adapters, pure)
    return nnx.merge(graphdef, adapters, base)


def test_adapters_off_is_the_base_bitwise_and_b_zero_is_the_base():
    base = tiny_model(seed=1, vocab_size=64)
    adapted = lora.with_adapters(base, LORA, jax.random.key(0))
    tokens, positions, mask = _inputs()
    want, _ = base(tokens, positions, mask)
    off, _ = adapted(tokens, positions, mask, adapters=False)
    np.testing.assert_array_equal(np.asarray(off), np.asarray(want))
    zero_b, _ = adapted(tokens, positions, mask)  # B = 0 at initialisation
    # an exact zero is added to each projection; XLA may fuse that addition into a norm's
    # reduction and round differently, by at most a few units in the last place
    np.testing.assert_allclose(np.asarray(zero_b), np.asarray(want), rtol=0, atol=1e-6)
    assert not lora.has_adapters(base)  # the base model itself is untouched


def test_gradients_equal_those_of_a_hand_merged_weight_loss():
    base = tiny_model(seed=2, vocab_size=64)
    config = lora.LoraConfig(rank=3, alpha=5.0, targets=("q_proj", "v_proj", "down_proj"))
    model = _with_random_b(lora.with_adapters(base, config, jax.random.key(1)), jax.random.key(2))
    graphdef, adapters, frozen = lora.split_adapters(model)
    tokens, positions, mask = _inputs()
    plain_graphdef, plain = nnx.split(base)

    def loss_adapted(adapters):
        logits, _ = nnx.merge(graphdef, adapters, frozen)(tokens, positions, mask)
        return jnp.sum(jax.nn.log_softmax(logits)[..., 3] * mask)

    def loss_merged_by_hand(adapters):
        pure = nnx.to_pure_dict(plain)
        ad = nnx.to_pure_dict(adapters)["layers"]["lora"]
        layers = dict(pure["layers"])
        for name in config.targets:  # W + (alpha / r) B A, layer by layer
            layers[name] = jnp.stack(
                [
                    layers[name][i] + (5.0 / 3) * ad[f"{name}_b"][i] @ ad[f"{name}_a"][i]
                    for i in range(layers[name].shape[0])
                ]
            )
        state = nnx.State(jax.tree.map(nnx.Param, {**pure, "layers": layers}))
        logits, _ = nnx.merge(plain_graphdef, state)(tokens, positions, mask)
        return jnp.sum(jax.nn.log_softmax(logits)[..., 3] * mask)

    with jax.default_matmul_precision("highest"):
        got = jax.grad(loss_adapted)(adapters)
        want = jax.grad(loss_merged_by_hand)(adapters)
        np.testing.assert_allclose(loss_adapted(adapters), loss_merged_by_hand(adapters), rtol=1e-6)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert float(jnp.max(jnp.abs(w))) > 1e-4  # A's gradient is not zero (B is not)
        # float32 sums in another order: 5.1e-7 on the Intel CPU of 2026-12-06, 1.3e-6 on an
        # AVX-512 AMD EPYC (2026-12-06 later); a wrong scale or transpose is off by O(1)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=5e-6)


def test_merged_params_are_w_plus_scaled_ba():
    base = tiny_model(seed=3, vocab_size=64)
    model = _with_random_b(lora.with_adapters(base, LORA, jax.random.key(3)), jax.random.key(4))
    _, adapters, frozen = lora.split_adapters(model)
    merged = nnx.to_pure_dict(lora.merged_params(frozen, adapters, LORA.scale))
    ad = nnx.to_pure_dict(adapters)["layers"]["lora"]
    w = nnx.to_pure_dict(nnx.state(base))["layers"]
    for name in LORA.targets:
        want = np.asarray(w[name]) + 2.0 * np.einsum(
            "nor,nri->noi", np.asarray(ad[f"{name}_b"]), np.asarray(ad[f"{name}_a"])
        )
        np.testing.assert_allclose(np.asarray(merged["layers"][name]), want, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(merged["layers"]["q_norm"], w["q_norm"])
    tokens, positions, mask = _inputs()
    logits, _ = lora.merged_model(model)(tokens, positions, mask)
    adapted, _ = model(tokens, positions, mask)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(adapted), rtol=1e-5, atol=1e-5)


def _train_config(**rl):
    return TrainConfig(rl=RLConfig(**{"optimizer": {"learning_rate": 1e-2}, "lora": LORA, **rl}))


def test_the_step_trains_the_adapters_only_against_the_base_as_reference():
    config = _train_config()
    assert config.uses_reference  # the default GRPO preset has a KL term
    model = train_model(tiny_model(seed=4, vocab_size=16), config)
    state = init_train_state(model, config)
    assert state.reference is None  # no second copy: the reference is the base, adapters off
    adapter_shapes = jax.tree.map(jnp.shape, nnx.to_pure_dict(state.policy))
    assert set(adapter_shapes["layers"]["lora"]) == {
        f"{n}_{ab}" for n in lora.PROJECTIONS for ab in "ab"
    }
    mu_leaves = [x for x in jax.tree.leaves(state.policy_opt) if x.ndim]
    assert len(mu_leaves) == 2 * len(jax.tree.leaves(state.policy))  # Adam's moments, adapters'

    batch = TrainBatch(random_trajectory(0, rows=8, vocab=16))
    grads, _, metrics = compute_gradients(nnx.graphdef(model), config, state, batch)
    assert jax.tree.structure(grads) == jax.tree.structure(state.policy)
    # at step 0 (B = 0) the policy is the base: the KL term and its gradient are zero
    step = make_train_step(nnx.graphdef(model), config)
    base_before = jax.tree.map(np.asarray, state.base)
    new, metrics = step(state, batch)
    new, metrics = step(new, TrainBatch(random_trajectory(1, rows=8, vocab=16)))
    for before, after in zip(jax.tree.leaves(base_before), jax.tree.leaves(new.base)):
        np.testing.assert_array_equal(before, np.asarray(after))  # the base never moves
    moved = nnx.to_pure_dict(new.policy)["layers"]["lora"]["q_proj_b"]
    assert float(jnp.max(jnp.abs(moved))) > 0  # the adapters do
    assert float(metrics["loss/kl"]) > 0  # the policy has left the reference


def test_base_dtype_and_the_merged_policy_params():
    config = _train_config(lora=dataclasses.replace(LORA, base_dtype="bfloat16"))
    model = train_model(tiny_model(seed=5, vocab_size=16), config)
    state = init_train_state(model, config)
    assert {x.dtype for x in jax.tree.leaves(state.base)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(state.policy)} == {jnp.dtype(jnp.float32)}
    params = policy_params(state, config)  # a plain Qwen3's, merged, in the base's dtype
    plain = tiny_model(seed=5, vocab_size=16)
    assert jax.tree.structure(params) == jax.tree.structure(nnx.state(plain))


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"rl\.lora\.rank: must be an int in \[1, 131072\]"):
        RLConfig(lora={"rank": 0})
    with pytest.raises(ConfigError, match=r"rl\.lora\.targets: must be a non-empty list"):
        RLConfig(lora={"targets": ["qkv"]})
    with pytest.raises(ConfigError, match=r"rl\.lora\.ranks: unknown field"):
        RLConfig(lora={"ranks": 4})
    with pytest.raises(ConfigError, match=r"rl\.lora: must be null or a mapping"):
        RLConfig(lora=4)
    with pytest.raises(ConfigError, match=r"rl\.lora: a run with a critic"):
        TrainConfig(
            rl=RLConfig(lora={}),
            algorithm={
                "advantage": "gae",
                "loss_terms": [{"name": "policy_clip"}, {"name": "value_clip"}],
            },
        )
    rl = RLConfig(lora={"rank": 2, "targets": ["q_proj"]})
    assert rl.lora == lora.LoraConfig(rank=2, targets=("q_proj",))
    assert TrainConfig.from_dict(TrainConfig(rl=rl).to_dict()).rl == rl  # checkpoint JSON


def test_resume_is_bit_exact_and_checkpoints_hold_no_base(tmp_path):
    config = _train_config()
    model = train_model(tiny_model(seed=6, vocab_size=16), config)
    step = make_train_step(nnx.graphdef(model), config)
    batches = [TrainBatch(random_trajectory(i, rows=8, vocab=16)) for i in range(4)]
    straight = init_train_state(model, config)
    for batch in batches:
        straight, _ = step(straight, batch)

    state = init_train_state(model, config)
    with Checkpointer(tmp_path, every=1, keep=2) as checkpointer:
        for batch in batches[:2]:
            state, _ = step(state, batch)
        checkpointer.save(state, config)
        checkpointer.wait()
    saved = json.loads((tmp_path / "2" / "state" / "_METADATA").read_text())["tree_metadata"]
    arrays = {key.split("'")[1] for key in saved if "," in key.strip("(),")}  # not None leaves
    assert "base" not in arrays and "reference" not in arrays, arrays
    assert all("'lora'" in key for key in saved if key.startswith("('policy'")), saved
    template = init_train_state(model, config)
    with Checkpointer(tmp_path, every=1, keep=2) as checkpointer:
        restored = checkpointer.restore_latest(template, config).state
    for batch in batches[2:]:
        restored, _ = step(restored, batch)
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_resume_on_another_base_is_refused(tmp_path):
    config = _train_config()
    model = train_model(tiny_model(seed=6, vocab_size=16), config)
    state, _ = make_train_step(nnx.graphdef(model), config)(
        init_train_state(model, config), TrainBatch(random_trajectory(0, rows=8, vocab=16))
    )
    with Checkpointer(tmp_path, every=1, keep=2) as checkpointer:
        checkpointer.save(state, config)
        checkpointer.wait()
    other = train_model(tiny_model(seed=11, vocab_size=16), config)  # same shapes, other weights
    with Checkpointer(tmp_path, every=1, keep=2) as checkpointer:
        with pytest.raises(CheckpointMismatchError, match="trained on another base model"):
            checkpointer.restore_latest(init_train_state(other, config), config)
        same = checkpointer.restore_latest(init_train_state(model, config), config)
    assert int(same.state.step) == 1  # the base it was trained on resumes
    # a tampered fingerprint (not a list of numbers) is a mismatch, not a crash
    saved = tmp_path / "1" / "config" / "metadata"
    payload = json.loads(saved.read_text())
    for bad in ("abc", [None], ["1.0"] * len(payload["base_fingerprint"])):
        saved.write_text(json.dumps({**payload, "base_fingerprint": bad}))
        with Checkpointer(tmp_path, every=1, keep=2) as checkpointer:
            with pytest.raises(CheckpointMismatchError, match="another base model"):
                checkpointer.restore_latest(init_train_state(model, config), config)


def test_merged_export_loads_in_transformers_with_equal_logits(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = _with_random_b(
        lora.with_adapters(tiny_model(seed=7, vocab_size=64), LORA, jax.random.key(5)),
        jax.random.key(6),
    )
    export_qwen3(lora.merged_model(model), tmp_path / "merged")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    tokens, positions, mask = _inputs(rows=1, length=9)
    mask = jnp.ones_like(mask)
    ours, _ = model(tokens, positions_from_mask(mask), mask)
    with torch.no_grad():
        theirs = hf(torch.tensor(np.asarray(tokens))).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=0, atol=1e-4)


def test_peft_loads_the_adapters_with_logits_equal_to_ours(tmp_path):
    import peft  # noqa: PLC0415 (the test extra installs it)
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    base = tiny_model(seed=9, vocab_size=64)
    model = _with_random_b(lora.with_adapters(base, LORA, jax.random.key(9)), jax.random.key(10))
    export_qwen3(base, tmp_path / "base")
    lora.export_peft(model, tmp_path / "adapter")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    adapted = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    tokens = (jnp.arange(9)[None] * 7) % 64
    mask = jnp.ones_like(tokens, bool)
    ours, _ = model(tokens, positions_from_mask(mask), mask)
    with torch.no_grad():
        theirs = adapted(torch.tensor(np.asarray(tokens))).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=0, atol=1e-4)
    plain, _ = base(tokens, positions_from_mask(mask), mask)
    assert float(jnp.max(jnp.abs(plain - ours))) > 1e-3  # the adapters change the logits


def test_peft_export_layout(tmp_path):
    model = _with_random_b(
        lora.with_adapters(tiny_model(seed=8, vocab_size=64), LORA, jax.random.key(7)),
        jax.random.key(8),
    )
    lora.export_peft(model, tmp_path, base_model_name_or_path="Qwen/Qwen3-0.6B")
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    layers = model.config.num_hidden_layers
    assert len(tensors) == 2 * len(LORA.targets) * layers
    _, adapters, _ = lora.split_adapters(model)
    ad = nnx.to_pure_dict(adapters)["layers"]["lora"]
    prefix = "base_model.model.model.layers.1"
    np.testing.assert_array_equal(
        tensors[f"{prefix}.self_attn.q_proj.lora_A.weight"], ad["q_proj_a"][1]
    )
    np.testing.assert_array_equal(
        tensors[f"{prefix}.mlp.down_proj.lora_B.weight"], ad["down_proj_b"][1]
    )
