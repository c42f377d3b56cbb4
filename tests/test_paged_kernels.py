"""jax's Pallas paged-attention kernels (TPU, GPU) over this project's page pool, run by the
Pallas interpreter on this CPU: equal to the XLA paged attention they replace in decode."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from agentrl_jax.models import Qwen3Config, Qwen3ForCausalLM, paged_cache, paged_kernels
from agentrl_jax.sampling import Paging, Sampler, SamplingConfig
from agentrl_jax.validation import ConfigError


def _pool(rng, kv_heads, layers, pages, size, hd, dtype):
    return jnp.asarray(rng.normal(size=(kv_heads, layers, pages, size, hd)), dtype)


@pytest.mark.parametrize(
    "kernel,hd,dtype,atol",
    [
        ("pallas_gpu", 16, jnp.float32, 2e-6),
        ("pallas_tpu", 128, jnp.bfloat16, 2e-5),  # the TPU kernel computes on bfloat16 pages
    ],
)
def test_kernel_equals_the_xla_paged_attention_on_ragged_rows_in_place(kernel, hd, dtype, atol):
    rng = np.random.default_rng(0)
    batch, heads, kv_heads, layers, pages, size, per_row = 4, 4, 2, 3, 24, 16, 4
    k_pool, v_pool = (_pool(rng, kv_heads, layers, pages, size, hd, dtype) for _ in range(2))
    lengths = np.array([1, 17, 64, 30], np.int32)
    table = np.full((batch, per_row), pages, np.int32)  # unassigned past each row's pages
    order = rng.permutation(pages)
    used = 0
    for b, n in enumerate(lengths):
        table[b, : -(-n // size)] = order[used : used - (-n // size)]
        used -= -n // size
    q = jnp.asarray(rng.normal(size=(batch, heads, hd)), jnp.float32)
    want = paged_cache.paged_attention(
        q[:, None],
        k_pool,
        v_pool,
        2,
        jnp.asarray(table),
        jnp.asarray(lengths)[:, None],
        block_pages=2,
    )[:, 0]
    got = paged_kernels.decode_attention(
        kernel,
        q,
        k_pool,
        v_pool,
        2,
        jnp.asarray(table),
        jnp.asarray(lengths),
        block_pages=2,
        interpret=True,
    )
    assert got.shape == (batch, heads, hd)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=atol, rtol=0)


def test_each_platform_gets_its_kernel_only_where_its_constraints_hold():
    select = paged_kernels.select_kernel
    assert select("tpu", page_size=128, head_dim=128, dtype=jnp.bfloat16) == "pallas_tpu"
    assert select("tpu", page_size=128, head_dim=128, dtype=jnp.float32) == "xla"  # would round
    assert select("tpu", page_size=128, head_dim=64, dtype=jnp.bfloat16) == "xla"
    assert select("gpu", page_size=16, head_dim=128, dtype=jnp.float32) == "pallas_gpu"
    assert select("cuda", page_size=8, head_dim=128, dtype=jnp.float32) == "xla"
    assert select("cpu", page_size=128, head_dim=128, dtype=jnp.bfloat16) == "xla"
    with pytest.raises(ConfigError, match="paging.kernel"):
        Paging(kernel="triton")


@pytest.mark.parametrize(
    "kernel, page_size, dtype, why",
    [
        ("pallas_tpu", 16, jnp.float32, "computes on bfloat16 pages, and this pool is float32"),
        ("pallas_tpu", 16, jnp.bfloat16, "head_dim a multiple of 128"),  # head_dim 16
        ("pallas_gpu", 8, jnp.float32, "multiples of 16, got 16 and 8"),
    ],
)
def test_a_kernel_chosen_by_name_that_cannot_serve_the_cache_is_refused(
    kernel, page_size, dtype, why
):
    """``auto`` falls back to the XLA version; a kernel named explicitly for a cache it cannot
    serve (rounding a float32 pool, shapes off its tiles) is a one-line error at ``init``."""
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    sampler = Sampler(
        Qwen3ForCausalLM(config, rngs=nnx.Rngs(0)),
        max_new_tokens=1,
        paging=Paging(page_size=page_size, kernel=kernel, interpret=True),
    )
    with pytest.raises(
        ValueError, match=f"paging.kernel='{kernel}' cannot serve this cache: .*{why}"
    ):
        sampler.init(1, 32, dtype)


def test_decode_through_the_gpu_kernel_gives_the_xla_engines_tokens():
    """A Sampler on ``Paging(kernel="pallas_gpu", interpret=True)``: the same greedy tokens
    and log-probs as the XLA paged engine (appends stay XLA; every decode step runs the kernel
    at each layer, reading the stacked pool in place)."""
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    model = Qwen3ForCausalLM(config, rngs=nnx.Rngs(0))
    params = nnx.state(model)
    tokens = np.random.default_rng(1).integers(0, 64, (3, 20)).astype(np.int32)
    mask = np.arange(20)[None, :] < np.array([[20], [5], [13]])
    out = {}
    for kernel in ("xla", "pallas_gpu"):
        sampler = Sampler(
            model,
            max_new_tokens=4,
            stop_token_ids=(),
            paging=Paging(page_size=16, block_pages=2, kernel=kernel, interpret=True),
        )
        state = sampler.init(3, 64)
        assert state.cache.kernel == kernel
        state = sampler.append(params, state, tokens, mask)
        _, sample = sampler.decode(
            params, state, jax.random.key(0), SamplingConfig(temperature=0.0)
        )
        out[kernel] = jax.device_get(sample)
    np.testing.assert_array_equal(out["pallas_gpu"].tokens, out["xla"].tokens)
    np.testing.assert_allclose(out["pallas_gpu"].log_probs, out["xla"].log_probs, atol=1e-5, rtol=0)
    # on this CPU "auto" is the XLA version
    assert Sampler(model, max_new_tokens=1, paging=Paging()).init(1, 32).cache.kernel == "xla"


SAMPLER_ON_V5P = """
import sys
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.experimental import topologies
from jax.sharding import Mesh
from agentrl_jax.plan.programs import _abstract
from agentrl_jax.sharding import generation_rules, tree_shardings
from agentrl_jax.models import Qwen3Config, Qwen3ForCausalLM
from agentrl_jax.sampling import Paging, Sampler, SamplingConfig
from agentrl_jax.sampling.sampler import init_state
devices = topologies.get_topology_desc("v5p:2x2x2", "tpu").devices
mesh = Mesh(np.array(devices).reshape(1, 8, 1, 1), ("data", "fsdp", "expert", "tensor"))
config = Qwen3Config(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=128)
model = nnx.eval_shape(lambda: Qwen3ForCausalLM(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
sampler = Sampler(model, max_new_tokens=4, mesh=mesh,
                  paging=Paging(page_size=128, kernel=sys.argv[1]))
pool = sampler.pool(64, 2048, dtype=jnp.bfloat16)
state = jax.eval_shape(lambda: init_state(config, 64, 2048, jnp.bfloat16, model.dtype, pool))
state = _abstract(state, sampler.state_shardings(state))
params = nnx.state(model)
params = _abstract(params, tree_shardings(params, mesh, generation_rules()))
rows = lambda shape, dtype: jax.ShapeDtypeStruct(
    shape, dtype, sharding=sampler.rows_sharding(len(shape)))
compiled = sampler._decode.lower(params, state, rows((64, 2), jnp.uint32), rows((64,), jnp.int32),
                                 rows((64,), jnp.bool_), sampling=SamplingConfig()).compile()
print(pool.kernel, compiled.as_text().count("tpu_custom_call"))
"""


@pytest.mark.parametrize("kernel, chosen", [("auto", "pallas_tpu"), ("xla", "xla")])
def test_a_sampler_compiled_for_v5p_decodes_through_the_tpu_kernel(kernel, chosen):
    """Compiled for v5p:2x2x2 (compile-only devices), a bfloat16 pool of head_dim 128 gets the
    TPU kernel by default: the decode program calls Mosaic custom calls; ``kernel="xla"`` none."""
    pytest.importorskip("libtpu")
    import os
    import subprocess
    import sys

    # compile-only TPU devices: the child may load libtpu while this process holds it too
    child_env = {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}

    child = subprocess.run(
        [sys.executable, "-c", SAMPLER_ON_V5P, kernel],
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    name, calls = child.stdout.split()[-2:]
    assert name == chosen and (int(calls) > 0) == (chosen == "pallas_tpu")
