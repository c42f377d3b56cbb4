"""The memory-bounded train step computes today's step: chunked log-probs at the loss positions
equal the full ``[N, L, V]`` log-softmax, and every remat policy, loss-position bound, logits
chunk and attention implementation gives the default step's loss, gradients and metrics to
1e-6 (float32), on one device and with activation sharding constraints on 8 fake devices.
No ``[N, L, V]`` buffer is left in the compiled step.

The 8-device check needs a fresh process (JAX fixes the device count at start-up): this file
runs itself as a script with ``--xla_force_host_platform_device_count=8``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fake_devices import fake_devices_env
from flax import nnx

sys.path.insert(0, str(Path(__file__).parent))  # train_fakes, also when run as a script

from train_fakes import random_trajectory, tiny_model  # noqa: E402

from agentrl_jax.algorithms import AlgorithmConfig, LossTermConfig  # noqa: E402
from agentrl_jax.train import RLConfig, TrainBatch, TrainConfig, compute_gradients, init_train_state  # noqa: E402
from agentrl_jax.train.logprobs import (  # noqa: E402
    check_loss_positions,
    gather_positions,
    kept_mask,
    position_logprobs,
)

ATOL = 1e-6
# every policy term (clip-higher, KL, entropy) and a per-sequence aggregation
GRPO = TrainConfig(
    rl=RLConfig(optimizer={"learning_rate": 1e-3}),
    algorithm=AlgorithmConfig(
        aggregation="seq-mean-token-mean",
        loss_terms=(
            LossTermConfig("policy_clip", params={"clip_high": 0.28}),
            LossTermConfig("kl", 0.001),
            LossTermConfig("entropy", 0.01),
        ),
    ),
)
PPO = TrainConfig(
    algorithm=AlgorithmConfig(
        advantage="gae",
        loss_terms=(
            LossTermConfig("policy_clip"),
            LossTermConfig("kl", 0.001),
            LossTermConfig("value_clip"),
        ),
    )
)
ROWS, TOKENS, TURNS = 8, 24, 3
VOCAB = (
    97  # a size no other dimension has, so [rows, L, V] buffers can be told apart in the program
)


def _with(config: TrainConfig, **changes) -> TrainConfig:
    """``config`` with ``changes``: TrainConfig's own fields, the rest the rl section's
    (``rl.memory``'s, ``num_micro_batches`` ``rl.batching``'s)."""
    own = {k: v for k, v in changes.items() if k in TrainConfig.__dataclass_fields__}
    memory = {k: v for k, v in changes.items() if k in ("remat", "attention", "logits_chunk")}
    batching = {k: v for k, v in changes.items() if k == "num_micro_batches"}
    rl = dataclasses.replace(
        config.rl,
        memory=dataclasses.replace(config.rl.memory, **memory),
        batching=dataclasses.replace(config.rl.batching, **batching),
    )
    return dataclasses.replace(config, rl=rl, **own)


@functools.lru_cache(maxsize=None)
def _model():
    return tiny_model(vocab_size=VOCAB)


@functools.lru_cache(maxsize=None)
def _state(config: TrainConfig):
    """The reference differs from the policy (so KL has a gradient), the value head is non-zero."""
    model = _model()
    state = init_train_state(model, config)
    rng = np.random.default_rng(7)
    if state.reference is not None:
        state = state.replace(
            reference=jax.tree.map(
                lambda x: jnp.asarray(np.asarray(x) + 0.05 * rng.standard_normal(x.shape), x.dtype),
                state.reference,
            )
        )
    if state.critic is not None:
        head = {
            "kernel": jnp.linspace(-0.25, 0.25, model.config.hidden_size),
            "bias": jnp.asarray(0.3),
        }
        state = state.replace(critic=state.critic.replace(head=head))
    return state


def _batch(seed: int = 3) -> TrainBatch:
    return TrainBatch(random_trajectory(seed, rows=ROWS, tokens=TOKENS, turns=TURNS, padded_rows=1))


def _max_loss_tokens(batch: TrainBatch) -> int:
    t = batch.trajectory
    return int((np.asarray(t.loss_mask) & np.asarray(t.row_mask)[:, None])[:, 1:].sum(1).max())


def _compiled(config: TrainConfig, batch: TrainBatch):
    graphdef = nnx.graphdef(_model())
    return (
        jax.jit(functools.partial(compute_gradients, graphdef, config))
        .lower(_state(config), batch)
        .compile()
    )


def _gradients(config: TrainConfig, batch: TrainBatch):
    return jax.device_get(_compiled(config, batch)(_state(config), batch))


def _assert_close(got, want, what: str) -> None:
    for i, (x, y) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
        np.testing.assert_allclose(
            np.asarray(x), np.asarray(y), atol=ATOL, rtol=ATOL, err_msg=f"{what} leaf {i}"
        )


def _comparable(metrics):
    return {k: v for k, v in metrics.items() if k != "loss_tokens_dropped"}


# ------------------------------------------------------------------------- the pieces


def test_gather_positions_orders_drops_and_scatters_back():
    mask = jnp.array([[1, 0, 1, 1, 0, 1], [0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 0, 0]], bool)
    positions, valid = gather_positions(mask, 3)
    # position 0 is never a loss position; row 0's fourth (position 5) is past the bound
    np.testing.assert_array_equal(positions, [[2, 3, 5], [3, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(valid, [[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(
        kept_mask(mask, 2), [[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 0, 0], [0] * 6]
    )


@pytest.mark.parametrize("width,chunk", [(None, 512), (9, 4), (9, 1), (12, 5)])
def test_position_logprobs_equal_the_full_log_softmax(width, chunk):
    """Values and gradients (w.r.t. hidden states and the head) against ``[N, L, V]``
    log_softmax."""
    rng = np.random.default_rng(0)
    n, length, dim, vocab = 3, 16, 8, 11
    hidden = jnp.asarray(rng.standard_normal((n, length, dim)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((vocab, dim)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, vocab, (n, length)), jnp.int32)
    mask = jnp.asarray(rng.random((n, length)) < 0.5).at[:, 0].set(False).at[2].set(False)
    assert int(mask.sum(1).max()) <= (width or length)

    def full(hidden, head):
        log_p = jax.nn.log_softmax(jnp.einsum("nld,vd->nlv", hidden[:, :-1], head), axis=-1)
        lp = jnp.take_along_axis(log_p, tokens[:, 1:, None], axis=-1)[..., 0]
        ent = -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)
        pad = lambda x: jnp.where(mask, jnp.pad(x, ((0, 0), (1, 0))), 0.0)  # noqa: E731
        return pad(lp), pad(ent)

    def chunked(hidden, head):
        return position_logprobs(
            hidden,
            tokens,
            mask,
            lambda h: jnp.einsum("ncd,vd->ncv", h, head),
            width=width,
            chunk=chunk,
            with_entropy=True,
        )

    for got, want in zip(jax.jit(chunked)(hidden, head), jax.jit(full)(hidden, head), strict=True):
        np.testing.assert_allclose(got, want, atol=ATOL)

    def objective(fn):
        return lambda h, w: jnp.sum(fn(h, w)[0] * 0.7 + fn(h, w)[1] * 0.3)

    got = jax.jit(jax.grad(objective(chunked), argnums=(0, 1)))(hidden, head)
    want = jax.jit(jax.grad(objective(full), argnums=(0, 1)))(hidden, head)
    _assert_close(got, want, "gradient")


def test_too_many_loss_tokens_are_rejected_before_the_step_and_counted_in_it():
    batch = _batch()
    most = _max_loss_tokens(batch)
    check_loss_positions(batch.trajectory, most)
    with pytest.raises(ValueError, match="TrainConfig.loss_positions"):
        check_loss_positions(batch.trajectory, most - 1)
    _, _, metrics = _gradients(_with(GRPO, loss_positions=most - 1), batch)
    assert float(metrics["loss_tokens_dropped"]) >= 1


# ------------------------------------------------------------------------- the whole step


# Full remat and bounded loss positions with logits chunks are checked inside "all" (each costs
# a whole train-step compilation on its own); the 8-device test runs them with chunks of 3.
MEMORY_OPTIONS = {
    "remat-dots": dict(remat="dots"),
    "remat-offload": dict(remat="offload"),  # on CPU the host copies are elided: see the jaxpr test
    "blocked-attention": dict(attention="blocked"),
    "all": dict(
        remat="full", loss_positions="max", logits_chunk=2, num_micro_batches=2, attention="blocked"
    ),
}


_DEFAULT_STEPS: dict = {}  # the default step's outputs per algorithm, computed once


# Every option with GRPO; PPO (critic and value loss too) with all of them at once.
@pytest.mark.parametrize(
    "name,config,option",
    [("grpo", GRPO, option) for option in MEMORY_OPTIONS] + [("ppo", PPO, "all")],
)
def test_memory_options_give_the_default_step(name, config, option):
    batch = _batch()
    changes = dict(MEMORY_OPTIONS[option])
    if changes.get("loss_positions") == "max":
        changes["loss_positions"] = _max_loss_tokens(batch)
    if name not in _DEFAULT_STEPS:
        _DEFAULT_STEPS[name] = _gradients(config, batch)
    want = _DEFAULT_STEPS[name]
    compiled = _compiled(_with(config, **changes), batch)
    got = jax.device_get(compiled(_state(_with(config, **changes)), batch))
    assert float(got[2]["loss_tokens_dropped"]) == 0
    _assert_close(
        (got[0], got[1], _comparable(got[2])),
        (want[0], want[1], _comparable(want[2])),
        f"{name} {option}",
    )
    if "logits_chunk" in changes:
        _assert_no_vocabulary_sized_activation(
            compiled.as_text(), changes["logits_chunk"], ROWS // changes.get("num_micro_batches", 1)
        )


def test_offload_moves_the_saved_matmul_outputs_to_host_memory():
    """``remat: offload`` saves the layers' matmul outputs in host memory (``pinned_host``):
    the traced gradient puts them there and reads them back (XLA:CPU then elides the copies,
    so the step above checks the numbers; TPU and GPU keep them)."""
    config = _with(GRPO, remat="offload")
    jaxpr = str(
        jax.make_jaxpr(functools.partial(compute_gradients, nnx.graphdef(_model()), config))(
            _state(config), _batch()
        )
    )
    assert "MemorySpace.Host" in jaxpr and "MemorySpace.Device" in jaxpr
    plain = str(
        jax.make_jaxpr(functools.partial(compute_gradients, nnx.graphdef(_model()), GRPO))(
            _state(GRPO), _batch()
        )
    )
    assert "MemorySpace.Host" not in plain


def _assert_no_vocabulary_sized_activation(text: str, chunk: int, micro_rows: int) -> None:
    """With loss positions bounded, no ``[rows, L, V]`` (or ``[rows, L-1, V]``) buffer exists in
    the compiled step, for the batch's rows or a micro-batch's; the head runs on chunks."""
    for rows in {ROWS, micro_rows}:
        assert (
            f"[{rows},{TOKENS},{VOCAB}]" not in text
            and f"[{rows},{TOKENS - 1},{VOCAB}]" not in text
        )
    assert re.search(rf"\[{micro_rows},{chunk},{VOCAB}\]", text)  # the head on chunks of positions


# ------------------------------------------------------------------------ 8 devices (child process)

MESHES = {"dp-fsdp-tp": (2, 2, 2), "fsdp": (1, 8, 1)}
ON_MESH = {"grpo": "dp-fsdp-tp", "ppo": "fsdp"}  # each algorithm on one mesh: one compilation each
# and with its own memory options, so 8 devices see two remat policies and both CPU attentions
ON_MESH_REMAT = {"grpo": "full", "ppo": "offload"}
ON_MESH_ATTENTION = {"grpo": "blocked", "ppo": "xla"}


def _sharded_results(out: Path) -> None:
    """Child process (8 devices): gradients with activation constraints, GRPO on the
    (data, fsdp, tensor) mesh (full remat, blocked attention), PPO (critic too) on the
    all-fsdp one (offload remat, xla attention)."""
    from agentrl_jax.sharding import MeshConfig, build_mesh
    from agentrl_jax.train import batch_shardings, shard_state, state_shardings

    assert jax.device_count() == 8, jax.devices()
    batch, arrays = _batch(), {}
    for name, config in (("grpo", GRPO), ("ppo", PPO)):
        mesh_name = ON_MESH[name]
        mesh = build_mesh(MeshConfig(*MESHES[mesh_name]))
        config = _with(
            config,
            remat=ON_MESH_REMAT[name],
            loss_positions=_max_loss_tokens(batch),
            logits_chunk=3,
            attention=ON_MESH_ATTENTION[name],
            num_micro_batches=1 if name == "ppo" else 2,
        )
        state = _state(config)
        fn = jax.jit(
            functools.partial(compute_gradients, nnx.graphdef(_model()), config, mesh=mesh),
            in_shardings=(state_shardings(state, mesh), batch_shardings(batch, mesh)),
        )
        grads = jax.device_get(
            fn(shard_state(state, mesh), jax.device_put(batch, batch_shardings(batch, mesh)))
        )
        for i, leaf in enumerate(jax.tree.leaves((grads[0], grads[1], _comparable(grads[2])))):
            arrays[f"{name}/{i}"] = np.asarray(leaf)
    np.savez(out, **arrays)


def test_eight_devices_with_activation_constraints_give_the_single_device_step(tmp_path):
    out = tmp_path / "results.npz"
    env = fake_devices_env(8)
    child = subprocess.run(
        [sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=900
    )
    assert child.returncode == 0, child.stderr[-3000:]
    results = np.load(out)
    batch = _batch()
    for name, config in (("grpo", GRPO), ("ppo", PPO)):
        want = _DEFAULT_STEPS.get(name) or _gradients(config, batch)
        leaves = jax.tree.leaves((want[0], want[1], _comparable(want[2])))
        for i, leaf in enumerate(leaves):
            np.testing.assert_allclose(
                results[f"{name}/{i}"],
                np.asarray(leaf),
                atol=ATOL,
                rtol=ATOL,
                err_msg=f"{ON_MESH[name]} {name} leaf {i}",
            )


if __name__ == "__main__":
    _sharded_results(Path(sys.argv[1]))
    print(json.dumps({"ok": True}))
