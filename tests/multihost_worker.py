"""One process of a local cluster (tests/multihost.py): GRPO train steps on a global
2 x 2 x 2 mesh, fed by each process's share of the rows, with an Orbax checkpoint after every
update written (and, on start, restored) by every process.

    python multihost_worker.py OUT MODE [--updates N] [--packed]
        [--coordinator H:P --num-processes N --process-id I]

MODE ``train``: updates ``N`` batches from the newest checkpoint in ``OUT`` (or the start),
checks the last checkpoint restores to the live state, and the main process saves the
parameters to ``OUT/params.npz``. MODE ``die``: process 1 exits abruptly after the first
update; the others must fail (not hang) on their next collective. MODE ``sync``: the weight
sync of the initial state (``weight_sync``); ``sync+train``: that, then ``train`` in the same
process (one start of the cluster for both tests). ``--packed``: after ``train``, a packed
update of the initial state with ``mesh.ordered_sums`` (:func:`packed_update`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("mode", choices=("train", "die", "sync", "sync+train"))
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--packed", action="store_true")
    parser.add_argument("--coordinator")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    parser.add_argument("--cluster-auto", action="store_true")
    args = parser.parse_args()

    from agentrl_jax.distributed import ClusterConfig, initialize

    initialize(
        ClusterConfig(
            args.coordinator,
            args.num_processes,
            args.process_id,
            auto=args.cluster_auto,
            heartbeat_timeout_s=10,
        )
    )

    import jax
    import numpy as np
    from flax import nnx
    from test_train_step import GRPO, _perturbed
    from train_fakes import random_trajectory, tiny_model

    from agentrl_jax import distributed
    from agentrl_jax.sharding import BATCH_AXES, MeshConfig, build_mesh
    from agentrl_jax.train import TrainBatch, init_train_state, make_train_step, shard_state
    from agentrl_jax.train.checkpoint import Checkpointer

    assert jax.device_count() == 8, jax.devices()
    mesh = build_mesh(MeshConfig(2, 2, 2))
    model = tiny_model()
    graphdef = nnx.split(model)[0]
    state = init_train_state(model, GRPO)
    state = state.replace(reference=_perturbed(state.reference, 7))
    state = shard_state(jax.tree.map(np.asarray, state), mesh)  # host values, same everywhere
    out = Path(args.out)
    if args.mode.startswith("sync"):
        weight_sync(state, mesh, out)  # reads the state, changes nothing
        if args.mode == "sync":
            return
    step = make_train_step(graphdef, GRPO, mesh=mesh, state_template=state)
    initial = state
    with Checkpointer(out / "checkpoints", every=1, keep=2, async_save=False) as saver:
        restored = saver.restore_latest(state, GRPO)  # every process restores its shards
        first = 0 if restored is None else restored.step
        state = state if restored is None else restored.state
        print(
            f"process {jax.process_index()} of {jax.process_count()} starts at update {first}",
            flush=True,
        )
        for update in range(first, args.updates):
            whole = TrainBatch(random_trajectory(6 + update, rows=16, padded_rows=2))
            batch = distributed.global_batch(whole, mesh, (BATCH_AXES,))
            state, metrics = step(state, batch)
            print(
                f"process {jax.process_index()} update {update} loss "
                f"{float(distributed.host_value(metrics['loss'])):.6f}",
                flush=True,
            )
            saver.save(state, GRPO)  # every process writes its shards (step = update + 1)
            saver.wait()
            if args.mode == "die" and update == 0 and jax.process_index() == 1:
                os._exit(3)  # no goodbye to the coordinator: as a lost host looks
            if args.mode == "die":
                time.sleep(1)
        latest = saver.restore_latest(state, GRPO)
    same = jax.tree.map(
        lambda a, b: bool(np.array_equal(a, b)),
        distributed.host_value(latest.state),
        distributed.host_value(state),
    )
    assert all(jax.tree.leaves(same)), "the restored state differs from the saved one"
    if args.packed:
        packed_update(graphdef, mesh, initial, args.updates, out)
    params = distributed.host_value(state.policy)
    if distributed.is_main():
        np.savez(out / "params.npz", *jax.tree.leaves(params))
    print(f"process {jax.process_index()} done", flush=True)


def packed_update(graphdef, mesh, state, seed: int, out: Path) -> None:
    """A packed update of ``state`` (each process plans the whole host batch and places its
    share of the packed rows) with its sums in a fixed order (``mesh.ordered_sums``), its
    policy saved to ``OUT/packed.npz``: one process's bits."""
    import jax
    import numpy as np
    from test_train_step import GRPO
    from train_fakes import random_trajectory

    from agentrl_jax import distributed
    from agentrl_jax.train import TrainBatch, make_train_step

    packed = dataclasses.replace(
        GRPO,
        ordered_sums=True,
        rl=dataclasses.replace(GRPO.rl, memory=dataclasses.replace(GRPO.rl.memory, packing=True)),
    )
    step = make_train_step(graphdef, packed, mesh=mesh, state_template=state)
    whole = TrainBatch(random_trajectory(6 + seed, rows=16, padded_rows=2))
    assert step.packed(whole).packing is not None
    after, metrics = step(state, whole)  # the host batch: the step packs and places it
    print(
        f"process {jax.process_index()} packed update loss "
        f"{float(distributed.host_value(metrics['loss'])):.9f} grad_norm "
        f"{float(distributed.host_value(metrics['grad_norm'])):.9f}",
        flush=True,
    )
    if distributed.is_main():
        np.savez(out / "packed.npz", *jax.tree.leaves(distributed.host_value(after.policy)))


def weight_sync(state, mesh, out: Path) -> None:
    """The policy (global, on the 2 x 2 x 2 mesh) to this process's sampler layouts under
    transfer guards that refuse any copy to or from the host, implicit or explicit; then, the
    guards lifted, the values checked against the gathered ones."""
    import contextlib

    import jax
    import jax.numpy as jnp
    import numpy as np

    from agentrl_jax import distributed
    from agentrl_jax.sampling.weights import sampler_shardings, sync_weights

    local = distributed.local_mesh(mesh)
    assert local is not None and set(local.devices.flat) == set(jax.local_devices())
    results = {}
    no_host = contextlib.ExitStack()  # explicit transfers refused too (np.asarray, device_get)
    no_host.enter_context(jax.transfer_guard_device_to_host("disallow_explicit"))
    no_host.enter_context(jax.transfer_guard_host_to_device("disallow_explicit"))
    with no_host:
        for layout, dtype in (("replicated", jnp.bfloat16), ("training", None)):
            results[layout] = jax.block_until_ready(
                sync_weights(state.policy, local, layout=layout, dtype=dtype)
            )
        one = jax.block_until_ready(sync_weights(state.policy, None, device=jax.local_devices()[1]))
        key = jax.block_until_ready(distributed.host_key(state.rng))
        try:  # the guards do refuse the host's path (the sampler placing host parameters,
            # as it did with the gathered NumPy arrays before the sync moved on device; on a
            # CPU reading a device array into NumPy is no transfer, so this side is checked)
            jax.device_put(np.ones((4, 4), np.float32), jax.local_devices()[0])
        except Exception as error:  # noqa: BLE001 - jax raises a plain exception type
            assert "Disallowed host-to-device transfer" in str(error), error
        else:
            raise AssertionError("the transfer guard let a copy from the host pass")
    whole = distributed.host_value(state.policy)
    for layout, dtype in (("replicated", jnp.bfloat16), ("training", None)):
        got, want = results[layout], sampler_shardings(whole, local, layout)
        for x, sharding, value in zip(
            jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(whole)
        ):
            assert x.is_fully_addressable and x.sharding == sharding, (x.sharding, sharding)
            expected = value.astype(dtype) if dtype is not None else value
            np.testing.assert_array_equal(np.asarray(x), np.asarray(expected))
    for x, value in zip(jax.tree.leaves(one), jax.tree.leaves(whole)):
        assert x.sharding.device_set == {jax.local_devices()[1]}
        np.testing.assert_array_equal(np.asarray(x), value)
    np.testing.assert_array_equal(
        np.asarray(jax.random.key_data(key)), distributed.host_value(state.rng)
    )
    # a split rollout's gather over one device per process (the last of each: where
    # mesh.rollout's rollout devices are), every process's blob in process order
    last = jax.local_devices()[-1]
    peers = distributed.peer_devices(last)
    assert [d.process_index for d in peers] == list(range(jax.process_count()))
    assert peers[jax.process_index()] == last and len(set(peers)) == jax.process_count()
    got = distributed.allgather_blobs({"i": np.array([jax.process_index()])}, "t", device=last)
    assert [(int(a["i"][0]), t) for a, t in got] == [(i, "t") for i in range(jax.process_count())]
    print(f"process {jax.process_index()} synced on device", flush=True)


if __name__ == "__main__":
    main()
