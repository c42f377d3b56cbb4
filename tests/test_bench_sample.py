"""Smoke test of ``agentrl-jax bench sample`` at tiny sizes (fields and baselines; no timing)."""

import json

import numpy as np
import pytest

from agentrl_jax.bench import sample as bench_sample


def test_run_reports_every_measurement_with_its_baseline():
    results = bench_sample.run(
        configs=("tiny",),
        shapes=((2, 3),),
        prompt_len=4,
        floor_configs=("tiny",),
        floor_batches=(1,),
        floor_steps=2,
        turns=2,
        turn_tokens=2,
        repeats=1,
        bandwidth_bytes=1 << 20,
    )
    assert [(r.unit, r.baseline_name) for r in results] == [
        ("tokens/s", bench_sample.HF_BASELINE),
        ("ms", bench_sample.HF_BASELINE),
        ("ms", bench_sample.FLOOR_BASELINE),
        ("s", "same sampler re-encoding the history each turn"),
    ]
    for r in results:
        assert r.ours > 0 and r.baseline > 0 and r.ratio > 0
        assert r.settings["config"] == "tiny"
        assert set(json.loads(r.to_json())) == {
            "name",
            "unit",
            "ours",
            "baseline",
            "baseline_name",
            "settings",
            "ratio",
        }
    assert results[0].name == "sample tiny, batch 2 x 3 new tokens, top-p"
    fits = results[0].settings["nucleus_fit_fraction"]  # per prefilter stage, nested
    assert list(fits) == ["k=32", "k=256"] and 0 <= fits["k=32"] <= fits["k=256"] <= 1
    # the floor is the parameters' bytes over the measured bandwidth
    floor = results[2]
    assert floor.baseline == pytest.approx(
        1e3 * floor.settings["param_bytes"] / (floor.settings["copy_bandwidth_GBps"] * 1e9)
    )
    assert results[3].settings["turns"] == 2


def test_parameter_bytes_and_bandwidth():
    assert (
        bench_sample.parameter_bytes(
            {"a": np.zeros((3, 4), np.float32), "b": [np.zeros(5, np.int8)]}
        )
        == 53
    )
    assert bench_sample.copy_bandwidth(1 << 20, repeats=2) > 1e6  # bytes/s, any machine


def test_run_rejects_unknown_configs_and_bad_sizes():
    with pytest.raises(ValueError, match="unknown config"):
        bench_sample.run(configs=("huge",))
    with pytest.raises(ValueError, match="repeats"):
        bench_sample.run(configs=("tiny",), repeats=0)
