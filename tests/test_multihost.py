"""Multi-process runs on a local cluster (issue: multi-host for real): 2 processes x 4 fake CPU
devices through jax's distributed runtime against 1 process x 8 devices.

The worker (tests/multihost_worker.py) runs GRPO train steps on a global 2 x 2 x 2 mesh, each
process supplying its half of every batch's rows, and writes and restores an Orbax checkpoint
from every process. The parameters must equal the single-process run's, and those of a packed
update with ``mesh.ordered_sums`` (each process packing the whole host batch) bit for bit; a
process that dies
must end the others with an error, not leave them waiting. (A process SIGKILLed mid-training
and the run resumed: tests/test_multihost_reproduce.py, on the whole reproduction.)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from multihost import launch

from agentrl_jax.distributed import ClusterConfig
from agentrl_jax.errors import ConfigError

WORKER = Path(__file__).parent / "multihost_worker.py"


def _params(out: Path, name: str = "params.npz") -> list[np.ndarray]:
    with np.load(out / name) as data:
        return [data[k] for k in sorted(data.files, key=lambda k: int(k.split("_")[1]))]


@pytest.fixture(scope="module")
def synced_and_trained(tmp_path_factory):
    """(folder, processes): 2 processes x 4 devices that sync the initial weights
    (test_weights_sync_to_each_process_devices_without_the_host), then train into
    ``folder`` (test_two_processes_train_to_the_parameters_of_one): one start for both."""
    folder = tmp_path_factory.mktemp("multihost")
    return folder, launch(
        WORKER, [str(folder / "two"), "sync+train", "--packed"], processes=2, devices=4
    )


@pytest.mark.slow
def test_two_processes_train_to_the_parameters_of_one(tmp_path, synced_and_trained):
    single = launch(WORKER, [str(tmp_path / "one"), "train", "--packed"], processes=1, devices=8)
    assert single[0].code == 0, single[0].output[-3000:]
    folder, pair = synced_and_trained
    for i, p in enumerate(pair):
        assert p.code == 0, f"process {i}:\n{p.output[-3000:]}"
        assert f"process {i} done" in p.output
    one, two = _params(tmp_path / "one"), _params(folder / "two")
    assert len(one) == len(two) > 0
    for a, b in zip(one, two):
        np.testing.assert_allclose(b, a, atol=1e-6, rtol=1e-6)
    # a packed update planned by each process on the whole host batch, its sums added in a
    # fixed order (mesh.ordered_sums): the single process's bits
    one, two = _params(tmp_path / "one", "packed.npz"), _params(folder / "two", "packed.npz")
    assert len(one) == len(two) > 0
    for a, b in zip(one, two):
        np.testing.assert_array_equal(b, a)
    # both processes logged the same losses as the single one (the global batch's)
    losses = [line for line in single[0].output.splitlines() if " loss " in line]
    assert [line.split(" loss ")[1] for line in losses] == [
        line.split(" loss ")[1] for line in pair[1].output.splitlines() if " loss " in line
    ]


def test_weights_sync_to_each_process_devices_without_the_host(synced_and_trained):
    """The weight sync of asynchronous training on 2 processes x 4 devices: the global policy
    to each process's sampler layouts (decode-replicated in bfloat16, the training layout, one
    device) and the key, all under ``jax.transfer_guard_device_to_host`` and ``_host_to_device``
    at ``"disallow_explicit"`` (no copy through the host in either direction, explicit or
    implicit; the worker checks the guards refuse the gather the loop used before); the values
    equal the gathered parameters. Then a split rollout's gather over one device per process
    (each one's last, as on ``mesh.rollout``'s devices) gives every process's blob in order."""
    _, pair = synced_and_trained
    for i, p in enumerate(pair):
        assert p.code == 0, f"process {i}:\n{p.output[-3000:]}"
        assert f"process {i} synced on device" in p.output


@pytest.mark.slow
def test_a_dead_process_ends_the_others_with_an_error(tmp_path):
    """Process 1 exits abruptly after the first update; process 0 must fail within the
    heartbeat timeout (10 s here) plus start-up, never hang."""
    pair = launch(WORKER, [str(tmp_path / "out"), "die"], processes=2, devices=4, timeout=240)
    assert pair[1].code == 3
    assert pair[0].code not in (0, None), pair[0].output[-3000:]
    # the error names the failure: the peer's closed connection, or jax's heartbeat verdict
    assert "Connection closed by peer" in pair[0].output or "heartbeat" in pair[0].output
    assert pair[0].seconds - pair[1].seconds < 120


@pytest.mark.slow
def test_cluster_auto_finds_the_processes_from_slurm_variables(tmp_path):
    """``--cluster-auto`` under the variables ``srun`` sets (``SLURM_JOB_ID``, ``_NTASKS``,
    ``_PROCID``, ...): jax's own detection joins the two processes, which train as with the
    explicit flags."""
    pair = launch(
        WORKER,
        [str(tmp_path / "out"), "train", "--updates", "1"],
        processes=2,
        devices=4,
        slurm=True,
    )
    for i, p in enumerate(pair):
        assert p.code == 0, f"process {i}:\n{p.output[-3000:]}"
        assert (
            f"process {i} of 2 starts at update 0" in p.output and f"process {i} done" in p.output
        )


def test_cluster_config_is_validated():
    assert not ClusterConfig().enabled and ClusterConfig(auto=True).enabled
    with pytest.raises(ConfigError, match="without num_processes, process_id"):
        ClusterConfig(coordinator="localhost:1234")
    with pytest.raises(ConfigError, match="HOST:PORT"):
        ClusterConfig(coordinator="localhost", num_processes=2, process_id=0)
    with pytest.raises(ConfigError, match=r"process_id: must be an int in \[0, 2\)"):
        ClusterConfig(coordinator="localhost:1234", num_processes=2, process_id=2)
    with pytest.raises(ConfigError, match="either auto"):
        ClusterConfig(coordinator="localhost:1234", num_processes=2, process_id=0, auto=True)


def test_one_process_never_splits_rollouts():
    """Splitting happens only for a rollout whose config asks for it
    (``RolloutConfig.split_processes``, an argument, never module state) and with several
    processes: one process plays every row itself (and nothing is gathered)."""
    from agentrl_jax import distributed

    assert distributed.row_shares(8) is None
    assert not hasattr(distributed, "split_rollouts")  # no flag that steers rollouts
    assert distributed.local_mesh(None) is None
