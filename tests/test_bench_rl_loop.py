"""``agentrl-jax bench rl-loop`` at a tiny size: one row per setting and unit against the
synchronous loop, each setting in its own process on two devices (rollouts on one, updates on
the other), and the order of events that shows the overlap. No timing is asserted."""

import json

from agentrl_jax.bench import rl_loop

SMALL = [
    "rl.tasks_per_step=2",
    "rl.group_size=2",
    "task.t_max=4",
    "task.train_tasks=8",
    "task.eval_tasks=2",
    # a smaller, cheaper policy and update (neither is checked: the loop's order is): one layer,
    # XLA's attention in the update, no TensorBoard writer
    "model.num_hidden_layers=1",
    "rl.memory.attention=xla",
    "rl.logging.tensorboard=false",
]


def test_each_staleness_is_measured_against_the_synchronous_loop_on_split_devices():
    results = rl_loop.run([1], steps=3, warmup=1, step_ms=1.0, overrides=SMALL)
    assert [(r.unit, r.baseline_name) for r in results] == [
        ("turns/s", rl_loop.SYNC),
        ("updates/s", rl_loop.SYNC),
    ]
    for r in results:
        assert r.ours > 0 and r.baseline > 0 and r.ratio == r.ours / r.baseline
        assert json.loads(r.to_json())["settings"]["devices"] == ["cpu:0", "cpu:1"]
        assert r.settings["rows_per_update"] == 4 and r.settings["events_sync"] == ""
    # batch 0 first; then each update dispatched, the next batch sampled, the update waited for
    events = "rollout 0 | update 0 | rollout 1 | done 0 | update 1 | rollout 2 | done 1"
    events += " | update 2 | done 2"  # the last update: nothing left to sample
    assert results[0].settings["events"] == events
