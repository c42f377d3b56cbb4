"""The sampler on 8 fake CPU devices gives one device's tokens for the same key.

Runs in a subprocess: the device count is fixed when JAX starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import json, sys, tempfile
    import jax, numpy as np
    from flax import nnx
    sys.path.insert(0, sys.argv[1])
    from hf_qwen3 import save_random_hf_qwen3
    from agentrl_jax.models import load_qwen3
    from agentrl_jax.sampling import Sampler, SamplingConfig, pad_rows
    from agentrl_jax.sharding import MeshConfig, build_mesh, describe
    assert jax.device_count() == 8, jax.devices()

    path = tempfile.mkdtemp()
    save_random_hf_qwen3(path, seed=4)
    rng = np.random.default_rng(0)
    prompts = pad_rows([rng.integers(0, 250, n).tolist() for n in rng.integers(1, 12, 8)], 12)
    observations = pad_rows([rng.integers(0, 250, n).tolist() for n in rng.integers(0, 6, 8)], 8)
    budget = rng.integers(3, 10, 8)
    configs = {"greedy": SamplingConfig(temperature=0),
               "top_p": SamplingConfig(temperature=1.0, top_p=0.9),
               # the random model is flat: a 4-token prefilter never holds the nucleus, so
               # every step takes the whole-vocabulary fallback
               "top_p_fallback": SamplingConfig(temperature=1.0, top_p=0.9, prefilter_k=4)}

    def conversation(mesh, sampling):
        model = load_qwen3(path, mesh=mesh)
        params = nnx.state(model)
        sampler = Sampler(model, max_new_tokens=10, stop_token_ids=(5,), mesh=mesh)
        state = sampler.append(params, sampler.init(8, 48), *prompts)
        state, first = sampler.decode(params, state, jax.random.key(3), sampling, budget=budget)
        state = sampler.append(params, state, *observations)
        state, second = sampler.decode(params, state, jax.random.key(4), sampling)
        layout = {"cache_k": describe(state.cache)["k"], "tokens": describe(second)["tokens"],
                  "q_proj": describe(params)["layers/q_proj"]}
        return [np.asarray(o.tokens) for o in (first, second)], \\
               [np.asarray(o.log_probs) for o in (first, second)], layout, sampler.trace_counts

    single = {name: conversation(None, sampling) for name, sampling in configs.items()}
    report = {}
    for name, shape in (("greedy", (8, 1, 1)), ("greedy", (2, 2, 2)), ("top_p", (2, 2, 2)),
                        ("top_p_fallback", (4, 1, 2))):
        tokens_1, log_probs_1, _, _ = single[name]
        mesh = build_mesh(MeshConfig(*shape))
        tokens_n, log_probs_n, layout, traces = conversation(mesh, configs[name])
        report[f"{name}{shape}"] = {
            "same_tokens": all((a == b).all() for a, b in zip(tokens_1, tokens_n)),
            "log_prob_diff": max(float(np.abs(a - b).max())
                                 for a, b in zip(log_probs_1, log_probs_n)),
            "tokens_generated": int(sum((t != 0).sum() for t in tokens_1)),
            "traces": dict(traces), **layout}
    print("REPORT" + json.dumps(report))
""")


def test_sharded_sampler_matches_one_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    tests_dir = str(Path(__file__).parent)
    result = subprocess.run([sys.executable, "-c", SCRIPT, tests_dir], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(l for l in result.stdout.splitlines() if l.startswith("REPORT"))
    report = json.loads(line[len("REPORT"):])
    assert len(report) == 4
    for case, r in report.items():
        assert r["same_tokens"], case
        assert r["log_prob_diff"] < 1e-5, (case, r)
        assert r["tokens_generated"] > 20, (case, r)
        assert r["traces"] == {"init": 1, "append": 2, "decode": 1}, (case, r)  # 2 turns
    # Batch over (data, fsdp); KV heads over tensor; q_proj by the Qwen3 partition rules.
    assert report["greedy(8, 1, 1)"]["cache_k"] == "P(None, 'data')"
    assert report["greedy(2, 2, 2)"]["cache_k"] == "P(None, ('data', 'fsdp'), None, 'tensor')"
    assert report["greedy(2, 2, 2)"]["q_proj"] == "P(None, 'tensor', 'fsdp')"
    assert report["top_p(2, 2, 2)"]["tokens"] == "P(('data', 'fsdp'),)"
    assert report["top_p_fallback(4, 1, 2)"]["cache_k"] == "P(None, 'data', None, 'tensor')"
