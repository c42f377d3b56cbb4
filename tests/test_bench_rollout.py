"""Smoke test of ``agentrl-jax bench rollout`` at tiny sizes (fields and baseline; no timing)."""

import json

import pytest

from agentrl_jax.bench import rollout as bench_rollout


def test_run_reports_ours_and_both_baselines():
    results = bench_rollout.run(
        num_tasks=2,
        group_size=2,
        budget=3,
        max_response_tokens=4,
        max_context=512,
        compare_tasks=1,
        repeats=1,
        decode_rows=2,
        decode_len=128,
        seats=2,
        overlap_tasks=1,
        step_ms=1.0,
    )
    assert [(r.unit, r.baseline_name) for r in results] == [
        ("turns/s", bench_rollout.PER_GROUP),
        ("tokens/s", bench_rollout.PER_GROUP),
        ("turns/s", bench_rollout.STATIC),
        ("turns/s", bench_rollout.STATIC),
        ("ms", bench_rollout.FULL_CACHE),
        ("turns/s", bench_rollout.REENCODE),
        ("prefills/s", bench_rollout.UNSHARED),
        ("turns/s", bench_rollout.ONE_LANE),
    ]
    for r in results:
        assert r.ours > 0 and r.baseline > 0 and r.ratio > 0
        assert set(json.loads(r.to_json())) == {
            "name",
            "unit",
            "ours",
            "baseline",
            "baseline_name",
            "settings",
            "ratio",
        }
    settings = results[0].settings
    assert settings["rows"] == 4 and settings["turns"] <= 3
    assert sum(settings["time_share"].values()) == pytest.approx(1.0)
    assert settings["compilations"]["policy"]["decode"] == 1  # one batch size, one compilation
    assert settings["compilations"]["env"] == {"reset": 1, "step": 1}
    assert "model" in results[0].name and "env" in results[0].name
    assert results[2].settings["rows"] == 4 and results[2].settings["same_tokens_as_static"]
    assert results[3].settings["seats"] == 2 and results[3].settings["same_tokens_as_static"]
    assert set(results[4].settings["ms_per_step"]) == {
        "paged quarter",
        "paged full",
        "static quarter",
        "static full",
    }
    assert results[4].settings["filled"] == {"quarter": 32, "full": 120}
    assert results[5].settings["rows"] == 2
    assert results[6].settings["rows"] == 2 and results[6].settings["prompt_tokens"] > 50
    overlap = results[7].settings
    assert overlap["rows"] == 2 and overlap["same_tokens_as_one_lane"]
    assert overlap["seconds"]["env_steps_ours"] > 0 and overlap["step_ms_per_row"] == 1.0


def test_slow_steps_wait_per_row_over_the_workers_and_change_nothing_else(monkeypatch):
    import numpy as np

    waits = []
    monkeypatch.setattr(bench_rollout.time, "sleep", waits.append)

    class Env:
        t_max = 5

        def step(self, state, responses, live):
            return state + 1, "result"

    slow = bench_rollout.SlowSteps(Env(), row_ms=20.0, workers=8)
    assert slow.t_max == 5
    assert slow.step(1, [""] * 20, np.arange(20) < 17) == (2, "result")
    assert slow.step(1, [""] * 20, np.zeros(20, bool)) == (2, "result")
    assert waits == [pytest.approx(0.06), 0.0]  # 17 rows over 8 workers: 3 rounds of 20 ms


def test_run_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_tasks"):
        bench_rollout.run(num_tasks=0)
    with pytest.raises(ValueError, match="compare_tasks"):
        bench_rollout.run(num_tasks=2, compare_tasks=3)
    with pytest.raises(ValueError, match="decode_len"):
        bench_rollout.run(num_tasks=2, decode_len=16)
    with pytest.raises(ValueError, match="overlap_tasks"):
        bench_rollout.run(num_tasks=2, overlap_tasks=3)
    with pytest.raises(ValueError, match="step_ms"):
        bench_rollout.run(num_tasks=2, step_ms=float("nan"))


def test_keys_read_ratio_counts_whole_blocks_up_to_the_longest_live_row():
    from types import SimpleNamespace

    import numpy as np

    turns = np.full((2, 64), -1)
    turns[0, 8:10], turns[1, 9:12], turns[0, 28:31] = 0, 0, 1  # turn 0 ends at 10 and 12
    live = np.array([[True, True], [True, False]])
    trajectory = SimpleNamespace(token_turn=turns, turn_mask=live)
    # both turns hold the 2 rows: static 2 x 64 keys each; paged 16 (12 -> one block) then 32
    assert bench_rollout.keys_read_ratio(trajectory, 64, 16) == (2 * 16 + 2 * 32) / (2 * 2 * 64)
