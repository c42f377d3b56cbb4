"""The sampler on 8 fake CPU devices gives one device's tokens for the same key.

Runs in a subprocess: the device count is fixed when JAX starts. One subprocess runs both
tests' scripts, one after the other (``reports``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from fake_devices import fake_devices_env

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
    for name, shape in (("greedy", (8, 1, 1)), ("top_p", (2, 2, 2)), ("top_p_fallback", (4, 1, 2))):
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


# Each script given after the tests folder, run in order in one process (the fixture below):
# SCRIPT first, so that its compile counts are those of a process that traced nothing before.
SCRIPTS = textwrap.dedent("""
    import sys
    for i, script in enumerate(sys.argv[2:]):
        exec(compile(script, f"<script {i}>", "exec"), {"__name__": "__main__"})
""")


@pytest.fixture(scope="module")
def reports() -> dict[str, object]:
    """One 8-device subprocess running SCRIPT, then LAYOUT_SCRIPT: ``{"result":
    CompletedProcess, "sampler": SCRIPT's report, "layout": LAYOUT_SCRIPT's}`` (a report
    absent where its script did not finish)."""
    result = subprocess.run(
        [sys.executable, "-c", SCRIPTS, str(Path(__file__).parent), SCRIPT, LAYOUT_SCRIPT],
        env=fake_devices_env(8),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    lines = [text for text in result.stdout.splitlines() if text.startswith("REPORT")]
    found = dict(zip(("sampler", "layout"), (json.loads(t[len("REPORT") :]) for t in lines)))
    return {"result": result, **found}


def test_sharded_sampler_matches_one_device(reports):
    assert "sampler" in reports, reports["result"].stderr[-4000:]
    report = reports["sampler"]
    assert len(report) == 3
    for case, r in report.items():
        assert r["same_tokens"], case
        assert r["log_prob_diff"] < 1e-5, (case, r)
        assert r["tokens_generated"] > 20, (case, r)
        assert r["traces"] == {"init": 1, "append": 2, "decode": 1}, (case, r)  # 2 turns
    # Batch over (data, fsdp); KV heads over tensor; q_proj by the Qwen3 partition rules.
    assert report["greedy(8, 1, 1)"]["cache_k"] == "P(None, 'data')"
    assert report["top_p(2, 2, 2)"]["cache_k"] == "P(None, ('data', 'fsdp'), None, 'tensor')"
    assert report["top_p(2, 2, 2)"]["q_proj"] == "P(None, 'tensor', 'fsdp')"
    assert report["top_p(2, 2, 2)"]["tokens"] == "P(('data', 'fsdp'),)"
    assert report["top_p_fallback(4, 1, 2)"]["cache_k"] == "P(None, 'data', None, 'tensor')"


LAYOUT_SCRIPT = textwrap.dedent("""
    import json, re, sys, tempfile
    import jax, numpy as np
    from flax import nnx
    sys.path.insert(0, sys.argv[1])
    from hf_qwen3 import save_random_hf_qwen3
    from agentrl_jax.models import load_qwen3
    from agentrl_jax.sampling import SamplerPolicy
    from agentrl_jax.sampling import Sampler, SamplingConfig, generation_params, pad_rows
    from agentrl_jax.sharding import MeshConfig, build_mesh, describe

    path = tempfile.mkdtemp()
    save_random_hf_qwen3(path, seed=4)
    rng = np.random.default_rng(0)
    prompts = pad_rows([rng.integers(0, 250, n).tolist() for n in rng.integers(1, 12, 8)], 12)
    sampling = SamplingConfig(temperature=1.0, top_p=0.9)
    keys = jax.random.split(jax.random.key(3), 8)  # one per row

    def computations(text):
        comps, name = {}, None
        for line in text.splitlines():
            head = re.match(r"^(?:ENTRY )?%?([\\w.\\-]+) ", line)
            if head and line.rstrip().endswith("{"):
                name = head.group(1)
                comps[name] = []
            elif name is not None:
                comps[name].append(line)
        return comps

    def loop_all_gathers(text):
        # result shapes of the all-gathers in every while body and what those bodies call
        comps = computations(text)
        todo = [b for lines in comps.values() for l in lines
                for b in re.findall(r"body=%?([\\w.\\-]+)", l)]
        seen = set()
        while todo:
            c = todo.pop()
            if c in seen or c not in comps:
                continue
            seen.add(c)
            for l in comps[c]:
                todo += re.findall(r"(?:calls|body|condition|to_apply)=%?([\\w.\\-]+)", l)
                for group in re.findall(r"branch_computations=\\{([^}]*)\\}", l):
                    todo += [g.strip().lstrip("%") for g in group.split(",")]
        return [list(map(int, m.group(1).split(","))) for c in seen for l in comps[c]
                for m in [re.search(r"= \\w+\\[([\\d,]+)\\]\\S* all-gather(-start)?\\(", l)] if m]

    single = load_qwen3(path)
    sampler = Sampler(single, max_new_tokens=10, stop_token_ids=(5,))
    state = sampler.append(nnx.state(single), sampler.init(8, 32), *prompts)
    reference = np.asarray(sampler.decode(nnx.state(single), state, keys, sampling)[1].tokens)

    report = {}
    for shape in ((2, 4, 1), (2, 2, 2)):
        mesh = build_mesh(MeshConfig(*shape))
        model = load_qwen3(path, mesh=mesh)  # the training layout
        weights = {tuple(x.shape) for x in jax.tree.leaves(nnx.state(model))}
        weights |= {tuple(x.shape[1:]) for x in jax.tree.leaves(nnx.state(model)) if x.ndim == 3}
        policy = SamplerPolicy(model, mesh=mesh)
        # each layout, and the unrolled layer loop, once on (2, 4, 1); the replicated layout
        # with tensor parallelism on (2, 2, 2) (test_sharded_sampler_matches_one_device decodes
        # the training layout on it)
        cases = ((("training", False), ("replicated", False), ("replicated", True))
                 if shape == (2, 4, 1) else (("replicated", False),))
        for layout, unroll in cases:
            params = generation_params(nnx.state(model), mesh, layout)
            sampler = Sampler(model, max_new_tokens=10, stop_token_ids=(5,), mesh=mesh,
                              unroll_layers=unroll)
            state = sampler.append(params, sampler.init(8, 32), *prompts)
            text = sampler.lower_decode(params, state, keys, sampling).compile().as_text()
            gathered = loop_all_gathers(text)
            tokens = np.asarray(sampler.decode(params, state, keys, sampling)[1].tokens)
            report[f"{shape}/{layout}/unroll={unroll}"] = {
                "weight_gathers_in_loop": sum(tuple(g) in weights for g in gathered),
                "logits_gathers_in_loop": sum(g == [8, 250] for g in gathered),
                "same_tokens": bool((tokens == reference).all()),
                "q_proj": describe(params)["layers/q_proj"]}
        bf16 = SamplerPolicy(load_qwen3(path, dtype=jax.numpy.bfloat16, mesh=mesh), mesh=mesh)
        report[f"{shape}/policy"] = {
            "layout": policy.generation_layout,
            "q_proj": describe(policy.params)["layers/q_proj"],
            "q_proj_using": describe(policy.using(nnx.state(model)).params)["layers/q_proj"],
            "bf16_copy": sorted({str(x.dtype) for x in jax.tree.leaves(bf16.params)})}
        inferred = SamplerPolicy(model)  # no mesh given: the parameters' mesh and its batch shards
        report[f"{shape}/inferred"] = [inferred.mesh is mesh, inferred.row_multiple,
                                       inferred.generation_layout]
    print("REPORT" + json.dumps(report))
""")


def test_generation_layout_decodes_without_gathering_weights(reports):
    """The weights replicated over ``fsdp`` (``generation_params(..., "replicated")``): the
    compiled decode loop all-gathers no weight (the training layout gathers them every step)
    and no ``[B, V]`` logits (per-row keys sample each device's own rows), and the tokens equal
    one device's for the same per-row keys. ``SamplerPolicy``'s "auto" picks it when fsdp > 1."""
    assert reports["result"].returncode == 0, reports["result"].stderr[-4000:]
    report = reports["layout"]
    for case, r in report.items():
        if case.endswith(("/policy", "/inferred")):
            continue
        assert r["same_tokens"], case
        assert r["logits_gathers_in_loop"] == 0, (case, r)
        if "/replicated/" in case:
            assert r["weight_gathers_in_loop"] == 0, (case, r)
    # the detector sees the training layout's per-step weight gathers
    assert report["(2, 4, 1)/training/unroll=False"]["weight_gathers_in_loop"] > 0
    assert report["(2, 4, 1)/training/unroll=False"]["q_proj"] == "P(None, None, 'fsdp')"
    assert report["(2, 4, 1)/replicated/unroll=False"]["q_proj"] == "P(None, None, None)"
    assert report["(2, 2, 2)/replicated/unroll=False"]["q_proj"] == "P(None, 'tensor', None)"
    # the replicated copy is in the compute dtype (the model casts to it anyway)
    assert report["(2, 4, 1)/policy"] == {
        "layout": "replicated",
        "q_proj": "P(None, None, None)",
        "q_proj_using": "P(None, None, None)",
        "bf16_copy": ["bfloat16"],
    }
    assert report["(2, 2, 2)/policy"]["layout"] == "replicated"
    assert report["(2, 4, 1)/inferred"] == [True, 8, "replicated"]
    assert report["(2, 2, 2)/inferred"] == [True, 4, "replicated"]
