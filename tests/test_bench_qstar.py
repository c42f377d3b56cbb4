"""Smoke test of ``agentrl-jax bench qstar`` at tiny sizes (fields and baselines; no timing)."""

import json

import numpy as np
import pytest

from agentrl_jax.bench import qstar as bench_qstar
from envs.frozenlake import qstar


def test_run_reports_both_baselines():
    results = bench_qstar.run(num_maps=6, horizon=5, repeats=1, per_map_limit=3)
    assert [r.baseline_name for r in results] == ["NumPy per-map loop", "NumPy batched"]
    for r in results:
        assert r.unit == "ms" and r.ours > 0 and r.baseline > 0 and r.ratio > 0
        assert "6 random 8x8 slippery maps, H=5" in r.name
        assert r.settings["maps"] == 6 and r.settings["horizon"] == 5
        assert r.settings["max_abs_diff"] <= bench_qstar.AGREEMENT_ATOL
        line = json.loads(r.to_json())
        assert set(line) == {
            "name",
            "unit",
            "ours",
            "baseline",
            "baseline_name",
            "settings",
            "ratio",
        }
    assert results[0].settings["per_map_timed_maps"] == 3 and results[0].settings["per_map_scaled"]


def test_numpy_baselines_agree_with_q_star():
    tiles = bench_qstar.random_maps(5, seed=7)
    assert tiles.shape == (5, 8, 8) and tiles.dtype == np.int8
    ours = np.asarray(qstar.q_star(tiles, 12, success_rate=0.6))
    for baseline in (bench_qstar.numpy_q_star_per_map, bench_qstar.numpy_q_star_batched):
        np.testing.assert_allclose(baseline(tiles, 12, success_rate=0.6), ours, atol=1e-6, rtol=0)


def test_run_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_maps"):
        bench_qstar.run(num_maps=0, horizon=5, repeats=1)
