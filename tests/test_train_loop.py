"""The training loop: a short GRPO run learns, skipped updates are logged and the run goes on,
process scores reach the train step, metrics go to JSONL (and TensorBoard), and a resumed
run's metrics file keeps each step once."""

from __future__ import annotations

import json
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from train_fakes import make_fake_rollout, random_trajectory, target_token, task_batches, tiny_model

from agentrl_jax.train import (
    MetricsLogger,
    RLConfig,
    TrainConfig,
    init_train_state,
    make_train_step,
    read_metrics,
    train,
)
from agentrl_jax.trajectory import StepScores, scored_turns

GROUP = 16
NUM_TASKS = 4


def target_scorer(trajectory, tasks=None) -> StepScores:
    """A user's step scorer for the fake task: 1 for a turn that sampled the target token."""
    vocab = 16
    hit = trajectory.action == target_token(trajectory.task_id, vocab)[:, None]
    mask = scored_turns(trajectory)
    return StepScores(jnp.where(mask & hit, 1.0, 0.0), mask, jnp.zeros_like(mask))


def _setup(config: TrainConfig):
    model = tiny_model()
    graphdef = nnx.split(model)[0]
    return (
        init_train_state(model, config),
        make_train_step(graphdef, config),
        make_fake_rollout(graphdef, group_size=GROUP),
    )


def test_a_short_grpo_run_increases_mean_reward(tmp_path):
    """Tiny random policy, fixed seeds: each turn it samples a token from its own logits and
    succeeds on the task's target token (chance ~1/16 per turn, 2 turns). GRPO at lr 1e-2
    must raise the success rate over its first steps: a learning signal, not a tuned number."""
    config = TrainConfig(rl=RLConfig(optimizer={"learning_rate": 1e-2}, steps=12))
    state, step, rollout = _setup(config)
    logger = MetricsLogger(tmp_path / "metrics.jsonl")
    final = train(
        state,
        step,
        rollout,
        task_batches(NUM_TASKS, NUM_TASKS),
        config,
        quality_scorer=target_scorer,
        logger=logger,
        progress=False,
    )
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 13)) and int(final.step) == 12
    assert int(final.data_position) == 12
    r_multi = np.array([r["R_multi"] for r in records])
    assert r_multi[-3:].mean() > r_multi[:3].mean() + 0.15, r_multi
    # R_single (mean step quality) rises with it here: sampling the target is the good step.
    r_single = np.array([r["R_single"] for r in records])
    assert r_single[-3:].mean() > r_single[:3].mean(), r_single
    for key in (
        "loss",
        "loss/policy_clip",
        "loss/kl",
        "grad_norm",
        "policy_clip/clip_fraction",
        "turns_mean",
        "time/update_s",
        "train_tokens_per_s",
        "update_skipped",
    ):
        assert key in records[0], key
    assert all(r["update_skipped"] == 0 for r in records)


def test_a_non_finite_update_is_skipped_logged_and_the_run_continues(tmp_path, capsys):
    config = TrainConfig(
        rl=RLConfig(optimizer={"learning_rate": 1e-2}, steps=3, process_reward_coef=0.5)
    )
    state, step, rollout = _setup(config)
    seen = []

    def poisoned_scorer(trajectory, tasks=None):  # the second batch's process scores hold a NaN
        scores = target_scorer(trajectory, tasks)
        if len(seen) == 1:
            scores = StepScores(scores.scores.at[0, 0].set(jnp.nan), scores.mask, scores.invalid)
        return scores

    def spy_step(state, batch):
        seen.append(batch.step_scores is not None)  # process scores reach the step
        return step(state, batch)

    class Writer:
        scalars = []

        def add_scalar(self, tag, value, step):
            self.scalars.append((tag, value, step))

    logger = MetricsLogger(tmp_path / "m.jsonl", writer=Writer())
    final = train(
        state,
        spy_step,
        rollout,
        task_batches(NUM_TASKS, 2),
        config,
        process_scorer=poisoned_scorer,
        quality_scorer=target_scorer,
        logger=logger,
        progress=True,
    )
    records = read_metrics(tmp_path / "m.jsonl")
    assert [r["update_skipped"] for r in records] == [0, 1, 0]
    assert records[1]["loss"] is None  # a non-finite value is logged as null
    assert int(final.step) == 3 and int(final.skipped_updates) == 1 and seen == [True, True, True]
    assert (
        "step 2: non-finite loss or gradient, 1 of 1 updates skipped (1 so far)"
        in capsys.readouterr().err
    )
    assert ("R_single", records[0]["R_single"], 1) in Writer.scalars


def test_turns_sampled_from_a_history_window_need_a_config_that_trains_them_step_wise():
    """A windowed turn (context_start past the system header) is trained under its own
    context, so a response is both a loss token and later turns' context: a sequence mode of
    aggregation (which would count turns, not trajectories) is refused."""
    config = TrainConfig(rl=RLConfig(steps=1), algorithm={"aggregation": "seq-mean-token-mean"})
    traj = random_trajectory(0)
    windowed = traj.replace(context_start=traj.context_start.at[2, 1].set(5))
    state = init_train_state(tiny_model(), config)
    with pytest.raises(
        ValueError,
        match=r"Trajectory.context_start: 1 turns were sampled from a windowed "
        r"history \(first: row 2, turn 1\); the step trains each of them under its own "
        r"context, which it cannot with aggregation 'seq-mean-token-mean' \(use token-mean\)",
    ):
        train(
            state, None, lambda params, key, tasks: windowed, lambda i: None, config, progress=False
        )
    full = traj.replace(prefix_len=jnp.full(8, 3), context_start=jnp.where(traj.turn_mask, 3, 0))
    seen = []
    train(
        state,
        lambda s, b: (seen.append(b) or s.replace(step=s.step + 1), {"update_skipped": 0.0}),
        lambda params, key, tasks: full,
        lambda i: None,
        config,
        progress=False,
    )
    assert len(seen) == 1


def test_process_rewards_need_a_scorer():
    config = TrainConfig(rl=RLConfig(process_reward_coef=0.5))
    with pytest.raises(ValueError, match="process_reward_coef > 0 needs a process_scorer"):
        train(None, None, None, None, config)


def test_resumed_metrics_keep_each_step_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 0.1 * s}) for s in range(1, 6)]
    path.write_text("\n".join(lines) + '\n{"step": 6, "lo')  # the last line was cut by a kill
    logger = MetricsLogger(path, resume_step=3)
    logger.log(4, {"loss": 9.0})
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [
        (1, 0.1),
        (2, 0.2),
        (3, 0.30000000000000004),
        (4, 9.0),
    ]


def test_tensorboard_writer_is_used_when_installed(tmp_path, monkeypatch):
    made = []

    class SummaryWriter:
        def __init__(self, logdir):
            made.append(logdir)
            self.scalars = []

        def add_scalar(self, tag, value, step):
            self.scalars.append((tag, value, step))

    monkeypatch.setitem(
        sys.modules, "tensorboardX", types.SimpleNamespace(SummaryWriter=SummaryWriter)
    )
    logger = MetricsLogger(None, tensorboard_dir=tmp_path / "tb")
    logger.log(7, {"R_multi": 0.5})
    assert made == [str(tmp_path / "tb")] and logger.writer.scalars == [("R_multi", 0.5, 7)]


def test_without_tensorboard_only_jsonl_is_written(tmp_path, monkeypatch):
    for name in ("tensorboardX", "torch.utils.tensorboard"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails
    with pytest.warns(UserWarning, match="neither tensorboardX nor tensorboard is installed"):
        logger = MetricsLogger(tmp_path / "m.jsonl", tensorboard_dir=tmp_path / "tb")
    logger.log(1, {"R_multi": 0.25})
    assert read_metrics(tmp_path / "m.jsonl") == [{"step": 1, "R_multi": 0.25}]


def test_rollout_metrics_estimate_the_entropy_from_the_sampled_tokens_log_probs():
    """``entropy_estimate`` = mean ``-log pi`` over sampled tokens of real rows (padding rows
    and prompt tokens left out), by hand on 2 real rows of 3."""
    from agentrl_jax.train.loop import rollout_metrics

    traj = random_trajectory(0, rows=3, tokens=4, turns=1, group_size=1)
    loss_mask = np.array([[0, 1, 1, 0], [0, 0, 1, 0], [1, 1, 1, 1]], bool)
    logprobs = np.array(
        [[-9.0, -1.0, -2.0, -9.0], [-9.0, -9.0, -0.5, -9.0], [-7.0] * 4], np.float32
    )
    traj = traj.replace(
        loss_mask=jnp.asarray(loss_mask),
        logprobs=jnp.asarray(logprobs),
        row_mask=jnp.asarray([True, True, False]),
    )
    assert rollout_metrics(traj, None)["entropy_estimate"] == pytest.approx((1.0 + 2.0 + 0.5) / 3)


def test_the_loop_logs_rollout_throughput_and_the_entropy_estimate(tmp_path):
    config = TrainConfig(rl=RLConfig(optimizer={"learning_rate": 1e-2}, steps=2))
    state, step, rollout = _setup(config)
    logger = MetricsLogger(tmp_path / "m.jsonl")
    train(state, step, rollout, task_batches(NUM_TASKS, 2), config, logger=logger, progress=False)
    for record in read_metrics(tmp_path / "m.jsonl"):
        assert record["rollout_tokens_per_s"] > 0 and record["rollout_turns_per_s"] > 0
        assert record["entropy_estimate"] > 0


@pytest.mark.parametrize("algorithm", ["grpo", "dapo"])
def test_the_batch_crosses_to_the_devices_once_per_update(algorithm):
    """The rollout hands the loop host (NumPy) arrays; its checks, dynamic sampling and
    metrics work on them there, and the train step places each update's batch on the devices
    once, explicitly (``JittedTrainStep.place``): under
    ``jax.transfer_guard_host_to_device("disallow")``, which refuses every implicit transfer,
    three updates run, each placing one batch of host arrays (DAPO's filter reads an explicit
    copy on the host's CPU device)."""
    import jax

    from agentrl_jax.algorithms import AlgorithmConfig
    from agentrl_jax.train.presets import dapo_algorithm

    dapo = algorithm == "dapo"
    config = TrainConfig(
        rl=RLConfig(optimizer={"learning_rate": 1e-2}, steps=3),
        algorithm=AlgorithmConfig.from_dict(dapo_algorithm({})) if dapo else AlgorithmConfig(),
    )
    state, step, device_rollout = _setup(config)

    def rollout(params, key, tasks):
        with jax.transfer_guard("allow"):  # a real rollout moves prompts to its sampler
            return jax.device_get(device_rollout(params, key, tasks))

    placed, place = [], step.place

    def counted(batch, state):
        placed.append(all(isinstance(x, np.ndarray) for x in jax.tree.leaves(batch)))
        return place(batch, state)

    def tasks(position: int) -> np.ndarray:  # a task batch on the host, as task_batch_fn's
        return (2 * position + np.arange(2, dtype=np.int32)) % NUM_TASKS

    step.place = counted
    with jax.transfer_guard_host_to_device("disallow"):
        final = train(state, step, rollout, tasks, config, progress=False)
    assert int(final.step) == 3 and placed == [True] * 3
    with pytest.raises(Exception, match="[Dd]isallowed host-to-device transfer"):
        with jax.transfer_guard_host_to_device("disallow"):  # the guard does catch one
            jnp.asarray(np.ones(3)) + 1


# ----------------------------------------------------------------------- asynchronous training


def _fingerprint(params) -> float:
    """A number that changes with every update of the parameters."""
    import jax

    return float(sum(np.asarray(x, np.float64).sum() for x in jax.tree.leaves(params)))


def _fingerprinted_run(config: TrainConfig, events: list | None = None):
    """``config``'s run on the fake task: the fingerprint of the parameters each rollout
    sampled with, those after each update (the initial first), the metrics, the train step."""
    state, step, fake = _setup(config)
    sampled_with, after_update, records = [], [_fingerprint(state.policy)], []

    def rollout(params, key, tasks):
        sampled_with.append(_fingerprint(params))
        return fake(params, key, tasks)

    def on_step(state, metrics):
        after_update.append(_fingerprint(state.policy))
        records.append(metrics)

    tasks = task_batches(NUM_TASKS, 2)
    train(state, step, rollout, tasks, config, progress=False, on_step=on_step, events=events)
    return sampled_with, after_update, records, step


@pytest.mark.parametrize("staleness", [1, 2])
def test_bounded_staleness_samples_batch_j_with_the_parameters_of_update_j_minus_k(staleness):
    """``max_staleness`` k: batch j is sampled by the parameters after max(0, j - k) updates,
    which the metrics report (``policy_version``, ``staleness_*``), and the order of events
    shows each rollout sampled after its update was dispatched and before that update's results
    were waited for (the overlap, without timing)."""
    steps = 5
    config = TrainConfig(
        rl=RLConfig(
            optimizer={"learning_rate": 1e-2},
            asynchronous={"max_staleness": staleness},
            steps=steps,
        )
    )
    events = []
    sampled_with, after_update, records, step = _fingerprinted_run(config, events)
    assert step.compiled_count() == 1  # one batch shape: the update compiled once
    versions = [max(0, j - staleness) for j in range(steps)]
    assert sampled_with == [after_update[v] for v in versions]
    assert len(set(after_update)) == steps + 1  # every update changed the parameters
    assert [r["policy_version"] for r in records] == versions
    assert [r["staleness_max"] for r in records] == [min(j, staleness) for j in range(steps)]
    assert [r["staleness_mean"] for r in records] == [min(j, staleness) for j in range(steps)]
    first = [("rollout", j) for j in range(staleness)]
    overlapped = []
    for i in range(steps):
        overlapped.append(("update", i))
        if i + staleness < steps:
            overlapped.append(("rollout", i + staleness))
        overlapped.append(("update_done", i))
    assert events == first + overlapped
    for r in records:  # the off-policy correction's weights, the gap, the loop's times
        assert 0 < r["off_policy/weight"] <= 2.0 and 0 <= r["off_policy/capped"] <= 1
        assert r["off_policy/weight_max"] <= 2.0
        assert "sampler_gap_mean" in r and r["time/idle_s"] >= 0
    assert records[0]["off_policy/weight"] == pytest.approx(1.0, abs=1e-4)  # on-policy


def test_max_staleness_0_is_the_synchronous_loop():
    """The default (0) runs the synchronous loop: every batch sampled by the parameters it
    updates, no asynchronous metrics, no off-policy weights."""
    config = TrainConfig(rl=RLConfig(optimizer={"learning_rate": 1e-2}, steps=3))
    sampled_with, after_update, records, _ = _fingerprinted_run(config)
    assert sampled_with == after_update[:3]
    assert not any(k.startswith("off_policy/") or "staleness" in k for k in records[0])


def test_off_policy_weights_are_the_truncated_ratio_to_the_sampler():
    """The correction by hand: a batch whose recorded log-probs are those of other parameters
    gets per-token weights min(exp(own - recorded), cap), their token mean logged; the loss is
    the weighted one (the unweighted loss of the same batch differs)."""
    import jax

    from agentrl_jax.train.step import policy_gradients, prepare_batch
    from agentrl_jax.trajectory import Trajectory  # noqa: F401

    cap = 1.5
    config = TrainConfig(rl=RLConfig(asynchronous={"max_staleness": 1, "off_policy_cap": cap}))
    model = tiny_model()
    graphdef = nnx.split(model)[0]
    state = init_train_state(model, config)
    fake = make_fake_rollout(graphdef, group_size=GROUP)
    stale = jax.tree.map(lambda x: x * 1.3, state.policy)  # other parameters sampled it
    trajectory = fake(stale, jax.random.PRNGKey(3), jnp.arange(2))
    from agentrl_jax.train.batch import TrainBatch

    data, _ = jax.jit(lambda s, b: prepare_batch(graphdef, config, s, b))(
        state, TrainBatch(trajectory)
    )

    def gradients(config):  # jitted: op by op the tiny model's forward and backward take 10 s
        return jax.jit(lambda p, d: policy_gradients(graphdef, config, p, d, first_update=True)[1])(
            state.policy, data
        )

    metrics, plain = (
        gradients(config),
        gradients(TrainConfig(rl=RLConfig(asynchronous={"max_staleness": 0}))),
    )
    # own log-probs at the current parameters, teacher-forced
    from agentrl_jax.train.step import _model_scores

    own = _model_scores(graphdef, config, state.policy, data, None)[0]
    mask = np.asarray(data["loss_mask"], bool)
    ratio = np.exp(np.asarray(own, np.float64) - np.asarray(trajectory.logprobs, np.float64))
    weights = np.minimum(ratio, cap)[mask]
    assert float(metrics["off_policy/weight"]) == pytest.approx(weights.mean(), rel=1e-4)
    assert float(metrics["off_policy/capped"]) == pytest.approx((weights >= cap).mean(), abs=1e-6)
    assert float(metrics["off_policy/weight_max"]) == pytest.approx(weights.max(), rel=1e-4)
    assert weights.min() < 0.9 and weights.max() == pytest.approx(cap)  # it does weigh
    assert float(metrics["loss"]) != pytest.approx(float(plain["loss"]), rel=1e-3)
