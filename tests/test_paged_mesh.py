"""The paged engine on 8 fake CPU devices: each batch shard pages its own rows, and the tokens
are one device's.

Sampler: a conversation with a release, a refill of two rows (``append_rows``) and copies
within shards, on two meshes (rows over ``data``, and over ``data`` x ``fsdp``), against the
one-device paged sampler. Rollout: a whole batch of 24 rows, and continuous batching in 16
seats with a pool that makes rows preempt and replay their turns, each against the one-device
static engine (the reference). Runs in a subprocess: the device count is fixed when JAX starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from fake_devices import fake_devices_env

SCRIPT = textwrap.dedent("""
    import dataclasses, json, sys, tempfile
    import jax, numpy as np
    from flax import nnx
    sys.path.insert(0, sys.argv[1])
    from hf_qwen3 import save_random_hf_qwen3
    from test_rollout_qwen3 import assert_same_trajectory, count_preemptions, make_tiny_policy
    from agentrl_jax.models import load_qwen3
    from agentrl_jax.models.tokenizer import load_tokenizer
    from agentrl_jax.sampling import SamplerPolicy
    from agentrl_jax.rollout import MultiTurnRollout, RolloutConfig
    from agentrl_jax.sampling import Paging, Sampler, SamplingConfig, pad_rows
    from agentrl_jax.sharding import MeshConfig, build_mesh, describe
    assert jax.device_count() == 8, jax.devices()
    report = {}

    # -- the sampler: 16 rows, 2 per shard
    path = tempfile.mkdtemp()
    save_random_hf_qwen3(path, seed=4)
    rng = np.random.default_rng(0)
    rows = lambda lengths: [rng.integers(0, 250, n).tolist() for n in lengths]  # noqa: E731
    prompts = pad_rows(rows(rng.integers(1, 12, 16)), 12)
    observations = pad_rows(rows(rng.integers(0, 6, 16)), 8)
    refills = pad_rows(rows((5, 9)), 12)
    budget = rng.integers(3, 10, 16)
    keys = [jax.random.split(jax.random.key(k), 16) for k in (3, 4)]  # one per row
    sampling = SamplingConfig(temperature=1.0, top_p=0.9)
    paging = Paging(page_size=4, block_pages=2)

    def conversation(mesh):
        model = load_qwen3(path, mesh=mesh)
        params = nnx.state(model)
        sampler = Sampler(model, max_new_tokens=10, stop_token_ids=(5,), mesh=mesh, paging=paging)
        state = sampler.append(params, sampler.init(16, 48), *prompts)
        state, first = sampler.decode(params, state, keys[0], sampling, budget=budget)
        state = sampler.append(params, state, *observations)
        state = sampler.release(state, np.array([0, 0, 1, 0, 0, 0, 1, 0] * 2, bool))
        state = sampler.append_rows(params, state, [2, 6], *refills)
        state = sampler.copy_rows(state, [-1, 7, 13], [0, 6, 12])
        state, second = sampler.decode(params, state, keys[1], sampling)
        errors = []
        if mesh is not None:
            for bad in (lambda: sampler.copy_rows(state, [1], [2]),
                        lambda: sampler.decode(params, state, jax.random.key(0), sampling)):
                try:
                    bad()
                    errors.append(None)
                except ValueError as e:
                    errors.append(str(e))
        return ([np.asarray(o.tokens) for o in (first, second)],
                [np.asarray(o.log_probs) for o in (first, second)],
                np.asarray(state.lengths).tolist(), describe(state.cache),
                dict(sampler.trace_counts), errors)

    one = conversation(None)
    for shape in ((8, 1, 1), (2, 4, 1)):
        tokens, log_probs, lengths, layout, traces, errors = conversation(
            build_mesh(MeshConfig(*shape)))
        report[f"sampler{shape}"] = {
            "same_tokens": all((a == b).all() for a, b in zip(one[0], tokens)),
            "log_prob_diff": max(float(np.abs(a - b).max()) for a, b in zip(one[1], log_probs)),
            "same_lengths": lengths == one[2], "sampled": int(sum((t != 0).sum() for t in one[0])),
            "layout": layout, "traces": traces, "errors": errors}
    try:
        Sampler(load_qwen3(path), max_new_tokens=4, paging=paging,
                mesh=build_mesh(MeshConfig(2, 2, 2)))
        report["tensor_error"] = None
    except NotImplementedError as e:
        report["tensor_error"] = str(e)

    # -- the rollout: the one-device static engine vs paged on the mesh
    tokenizer = load_tokenizer()
    env, _, token_map, model = make_tiny_policy(tokenizer)
    config = RolloutConfig(group_size=4, max_response_tokens=4, max_context=768)
    tasks, key = np.array([4, 9, 2, 7, 11, 5]), jax.random.key(6)
    reference = jax.device_get(MultiTurnRollout(env, tokenizer, config)(
        SamplerPolicy(model, token_map=token_map, min_rows=1), tasks, key))
    # the last: a pool of 60 pages per shard, room for ~1.25 of its 2 rows: preemption
    for name, shape, seats, pages in (("whole", (2, 4, 1), None, None),
                                      ("small pool", (8, 1, 1), 16, 8 * 60)):
        policy = SamplerPolicy(model, token_map=token_map, mesh=build_mesh(MeshConfig(*shape)),
                               paging=Paging(page_size=16, num_pages=pages, block_pages=4))
        preempted = count_preemptions(policy)
        played = dataclasses.replace(config, max_rows_per_call=seats, refill=seats is not None)
        got = jax.device_get(MultiTurnRollout(env, tokenizer, played)(policy, tasks, key))
        assert_same_trajectory(got.trajectory, reference.trajectory)
        assert got.responses == reference.responses
        report[f"rollout {name}"] = {
            "turns": sorted(set(reference.trajectory.turns_used.tolist())),
            "most_rows": max(s[1] for s in policy.shapes_used), "preempted": sum(preempted),
            "pool": describe(policy._state.cache)["k"]}
    print("REPORT" + json.dumps(report))
""")


def test_paged_engine_on_a_mesh_gives_one_devices_tokens():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(Path(__file__).parent)],
        env=fake_devices_env(8),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(text for text in result.stdout.splitlines() if text.startswith("REPORT"))
    report = json.loads(line[len("REPORT") :])
    for shape in ("(8, 1, 1)", "(2, 4, 1)"):
        r = report[f"sampler{shape}"]
        assert r["same_tokens"] and r["same_lengths"], (shape, r)
        assert r["log_prob_diff"] < 1e-5 and r["sampled"] > 60, (shape, r)
        # rows, and the pool's pages ([KV, layers, P, S, hd]), split over the batch axes: each shard
        # a whole engine
        axes = {"(8, 1, 1)": "'data'", "(2, 4, 1)": "('data', 'fsdp')"}[shape]
        assert (
            r["layout"]["k"] == f"P(None, None, {axes})"
            and r["layout"]["page_table"] == f"P({axes},)"
        )
        # decode traced twice: once more for the one-key call, refused while tracing
        assert r["traces"] == {
            "init": 1,
            "append": 2,
            "decode": 2,
            "release": 1,
            "append_rows": 1,
            "copy_rows": 1,
        }, (shape, r)
        cross, one_key = r["errors"]
        assert "different batch shards" in cross and "[B] keys" in one_key, r["errors"]
    assert "tensor=2" in report["tensor_error"]
    # the rollouts matched the reference inside the child (assert_same_trajectory)
    assert len(report["rollout whole"]["turns"]) > 1
    assert report["rollout small pool"]["most_rows"] <= 16
    assert report["rollout small pool"]["pool"] == "P(None, None, 'data')"
    assert report["rollout whole"]["preempted"] == 0 < report["rollout small pool"]["preempted"]
