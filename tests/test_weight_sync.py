"""The weight sync (``agentrl_jax.sampling.weights``): a copy of the training parameters in the
sampler's layout that outlives the train step's donation, made device to device. Several
processes: tests/test_multihost.py (2 processes x 4 devices under transfer guards)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
from compile_counter import count_backend_compiles
from fake_devices import fake_devices_env
from flax import nnx
from train_fakes import tiny_model

from agentrl_jax.sampling.weights import sync_weights


def test_the_copy_survives_the_donation_of_its_source_and_casts():
    params = nnx.state(tiny_model())
    want = jax.tree.map(np.asarray, params)
    copy = sync_weights(params, dtype=jnp.bfloat16)
    same = sync_weights(params)
    jax.jit(lambda p: jax.tree.map(lambda x: x * 2, p), donate_argnums=0)(params)  # donated
    for got, value in zip(jax.tree.leaves(copy), jax.tree.leaves(want)):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got), value.astype(jnp.bfloat16))
    for got, value in zip(jax.tree.leaves(same), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(got), value)


def test_each_update_syncs_with_the_program_compiled_for_the_first():
    """Once per update: the same layout and dtype reuse one cached, compiled copy (the first
    sync compiles it; the next updates' syncs compile nothing)."""
    params = nnx.state(tiny_model())
    bump = jax.jit(lambda p: jax.tree.map(lambda x: x + 1, p))  # the next update's parameters
    sync_weights(params, dtype=jnp.bfloat16)
    params = bump(params)
    with count_backend_compiles() as compiles:
        for _ in range(3):
            copy = sync_weights(params, dtype=jnp.bfloat16)
            params = bump(params)
    assert compiles == []
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(copy))


SPLIT = textwrap.dedent(
    """
    import contextlib
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from train_fakes import tiny_model
    from agentrl_jax.sampling.weights import sampler_shardings, sync_weights
    from agentrl_jax.sharding import MeshConfig, build_mesh, rollout_devices, training_mesh
    from agentrl_jax.train.state import place_state, init_train_state
    from agentrl_jax.train import TrainConfig

    config = MeshConfig(data=1, fsdp=2, rollout=2)
    train_mesh = training_mesh(config)
    assert set(train_mesh.devices.flat) == set(jax.devices()[:2]), train_mesh
    assert rollout_devices(config) == jax.devices()[2:]
    state = place_state(init_train_state(tiny_model(), TrainConfig()), train_mesh)
    whole = jax.tree.map(np.asarray, state.policy)
    rollout_mesh = build_mesh(MeshConfig(data=-1), rollout_devices(config))
    guards = contextlib.ExitStack()
    guards.enter_context(jax.transfer_guard_device_to_host("disallow_explicit"))
    guards.enter_context(jax.transfer_guard_host_to_device("disallow_explicit"))
    with guards:
        other = jax.block_until_ready(sync_weights(state.policy, rollout_mesh, layout="replicated"))
        one = jax.block_until_ready(sync_weights(state.policy, None, device=jax.devices()[3]))
        here = jax.block_until_ready(sync_weights(state.policy, train_mesh, layout="replicated"))
    for got, mesh in ((other, rollout_mesh), (here, train_mesh)):
        for x, s, v in zip(jax.tree.leaves(got),
                           jax.tree.leaves(sampler_shardings(whole, mesh, "replicated")),
                           jax.tree.leaves(whole)):
            assert x.sharding == s, (x.sharding, s)
            np.testing.assert_array_equal(np.asarray(x), v)
    for x, v in zip(jax.tree.leaves(one), jax.tree.leaves(whole)):
        assert x.sharding.device_set == {jax.devices()[3]}
        np.testing.assert_array_equal(np.asarray(x), v)
    print("split ok")
    """
)


def test_rollout_devices_of_their_own_get_the_weights_device_to_device(tmp_path):
    """``mesh.rollout: 2`` of 4 devices: the train state on the first two (fsdp), the sampler's
    copy on the other two (and on one device, and resharded on the training devices), under
    transfer guards that refuse any copy through the host."""
    done = subprocess.run(
        [sys.executable, "-c", SPLIT],
        env={**fake_devices_env(4), "PYTHONPATH": str(__import__("pathlib").Path(__file__).parent)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and "split ok" in done.stdout, done.stderr[-3000:]
