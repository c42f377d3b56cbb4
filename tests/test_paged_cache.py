"""Paged KV cache: page bookkeeping by hand, paged attention against the full-score-matrix
attention, and the model's cache forward through pages equal to one full forward per row."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_qwen3_cache import CONFIG, _chunk, model  # noqa: F401  (model: the shared fixture)

from agentrl_jax.models import PagedKVCache, paged_cache, positions_from_mask
from agentrl_jax.models.attention import _xla_attention, visibility


def _empty(batch=3, max_len=16, page_size=4, num_pages=None, block_pages=2):
    return PagedKVCache.empty(
        CONFIG,
        batch,
        max_len,
        page_size=page_size,
        num_pages=num_pages,
        block_pages=block_pages,
        dtype=jnp.float32,
    )


def _table(cache):
    return np.asarray(cache.page_table).tolist()


# ------------------------------------------------------------------------------ bookkeeping
def test_allocate_gives_rows_the_lowest_free_pages_in_row_order():
    cache = _empty(num_pages=6)  # 3 rows x 4 pages each, pool of 6
    cache, ok = paged_cache.allocate(cache, jnp.array([5, 0, 4]))  # 2, 0, 1 pages
    assert np.asarray(ok).tolist() == [True, True, True]
    assert _table(cache) == [[0, 1, 6, 6], [6, 6, 6, 6], [2, 6, 6, 6]]
    assert int(cache.pages_used) == 3
    cache = cache.replace(lengths=jnp.array([5, 0, 4]))
    # growing within a held page needs nothing; row 2 crosses into its 2nd page
    cache, ok = paged_cache.allocate(cache, jnp.array([8, 0, 5]))
    assert np.asarray(ok).tolist() == [True, True, True]
    assert _table(cache) == [[0, 1, 6, 6], [6, 6, 6, 6], [2, 3, 6, 6]]


def test_allocate_refuses_rows_past_the_pool_or_max_len_and_leaves_them_unassigned():
    cache = _empty(num_pages=5)
    cache, ok = paged_cache.allocate(cache, jnp.array([12, 9, 3]))  # 3 + 3 pages > 5 free
    # row 0 fits (3 pages); row 1 needs 3 of the 2 left: refused, and so is row 2 after it
    assert np.asarray(ok).tolist() == [True, False, False]
    assert _table(cache) == [[0, 1, 2, 5], [5, 5, 5, 5], [5, 5, 5, 5]]
    cache, ok = paged_cache.allocate(cache, jnp.array([12, 17, 0]))  # 17 > max_len 16
    assert np.asarray(ok).tolist() == [True, False, True]


def test_release_returns_pages_and_they_are_reused():
    cache = _empty(num_pages=6)
    cache, _ = paged_cache.allocate(cache, jnp.array([8, 4, 8]))
    cache = cache.replace(lengths=jnp.array([8, 4, 8]))
    assert _table(cache) == [[0, 1, 6, 6], [2, 6, 6, 6], [3, 4, 6, 6]]
    cache = paged_cache.release(cache, jnp.array([True, False, False]))
    assert _table(cache)[0] == [6, 6, 6, 6] and int(cache.lengths[0]) == 0
    assert np.asarray(cache.free).tolist() == [True, True, False, False, False, True]
    cache, ok = paged_cache.allocate(cache, jnp.array([12, 4, 8]))
    assert _table(cache)[0] == [0, 1, 5, 6]


def test_take_rows_moves_first_copies_copies_later_ones_and_frees_dropped_rows():
    cache = _empty(num_pages=8)
    rng = np.random.default_rng(0)
    cache, _ = paged_cache.allocate(cache, jnp.array([5, 3, 8]))
    cache = cache.replace(
        lengths=jnp.array([5, 3, 8]),
        k=jnp.asarray(rng.normal(size=cache.k.shape), jnp.float32),
        v=jnp.asarray(rng.normal(size=cache.v.shape), jnp.float32),
    )
    before = cache
    # row 0 twice, row 2 once, an empty row; row 1 dropped
    out = paged_cache.take_rows(cache, jnp.array([2, 0, 0, -1]))
    assert np.asarray(out.lengths).tolist() == [8, 5, 5, 0]
    table = _table(out)
    assert table[0] == _table(before)[2] and table[1] == _table(before)[0]  # moved, not copied
    assert table[3] == [8, 8, 8, 8]
    copy = table[2][:2]
    assert not set(copy) & set(table[0][:2] + table[1][:2])
    np.testing.assert_array_equal(
        np.asarray(out.k)[:, :, copy], np.asarray(before.k)[:, :, table[1][:2]]
    )
    np.testing.assert_array_equal(
        np.asarray(out.v)[:, :, copy], np.asarray(before.v)[:, :, table[1][:2]]
    )
    held = {p for row in table for p in row if p < 8}
    assert np.asarray(out.free).tolist() == [p not in held for p in range(8)]


# ------------------------------------------------------------------------------ attention
@pytest.mark.parametrize("length", [1, 5])
def test_paged_attention_equals_full_score_attention_on_ragged_rows(length):
    rng = np.random.default_rng(length)
    batch, size, per_row, layers, pool = 3, 4, 6, 2, 20
    kv_heads, heads, hd = 2, 8, 16
    k_pool = jnp.asarray(rng.normal(size=(kv_heads, layers, pool, size, hd)), jnp.float32)
    v_pool = jnp.asarray(rng.normal(size=(kv_heads, layers, pool, size, hd)), jnp.float32)
    table = np.full((batch, per_row), pool, np.int32)
    perm = rng.permutation(pool)
    fill = [5, 17, 9]  # keys cached per row (before the limits below)
    used = 0
    for b, n in enumerate(fill):
        pages = -(-(n + length) // size)
        table[b, :pages] = perm[used : used + pages]
        used += pages
    limits = np.array([[n + i + 1 for i in range(length)] for n in fill], np.int32)
    q = jnp.asarray(rng.normal(size=(batch, length, heads, hd)), jnp.float32)
    out = paged_cache.paged_attention(
        q, k_pool, v_pool, 1, jnp.asarray(table), jnp.asarray(limits), block_pages=2
    )

    # the same keys laid out contiguously per row
    def contiguous(pool_):  # [KV, B, R, S, hd] -> [B, R * S, KV, hd]
        rows = np.asarray(pool_)[:, 1][:, np.clip(table, 0, pool - 1)]
        return np.moveaxis(rows.reshape(kv_heads, batch, -1, hd), 0, 2)

    keys, values = contiguous(k_pool), contiguous(v_pool)
    want = _xla_attention(
        q,
        jnp.asarray(keys),
        jnp.asarray(values),
        visibility(jnp.asarray(limits), None, length, keys.shape[1]),
    )
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------ the model
@pytest.mark.parametrize("scan_layers", [True, False])
def test_model_through_pages_equals_full_forward_and_never_retraces(model, scan_layers):
    """Ragged prefill, decode steps, observations (one row idle), more decode; rows finish and
    release their pages, and a fresh row takes a released slot: every token's logits equal a
    full forward of its row; pages are interleaved across rows in a pool smaller than
    rows x pages_per_row."""
    graphdef, state = nnx.split(model)
    traces = []

    @jax.jit
    def step(state, tokens, mask, cache):
        traces.append(tokens.shape)
        mask = mask.astype(bool)
        cache, ok = paged_cache.allocate(cache, cache.lengths + mask.sum(1))
        positions = positions_from_mask(mask, cache.lengths)
        m = nnx.merge(graphdef, state)
        layers = None if scan_layers else m.split_layers()
        hidden, cache = m.hidden_states(tokens, positions, mask, cache, layers=layers)
        return m.logits(hidden), cache, ok

    rng = np.random.default_rng(0)
    history = [[] for _ in range(3)]
    outputs = [[] for _ in range(3)]
    cache = PagedKVCache.empty(
        CONFIG, 3, 24, page_size=4, num_pages=12, block_pages=2, dtype=jnp.float32
    )

    def feed(rows, width, left):
        nonlocal cache
        tokens, mask = _chunk(rows, width, left)
        logits, cache, ok = step(state, tokens, mask, cache)
        assert bool(np.all(ok))
        for b, row in enumerate(rows):
            history[b].extend(row)
            outputs[b].extend(np.asarray(logits)[b][mask[b]])

    feed([rng.integers(0, 97, n) for n in (5, 9, 1)], 9, left=False)
    for _ in range(4):
        feed([rng.integers(0, 97, 1) for _ in range(3)], 1, left=False)
    feed([rng.integers(0, 97, n) for n in (2, 0, 4)], 4, left=True)
    # row 1 finishes: its pages go back; a new episode starts in its slot
    cache = paged_cache.release(cache, jnp.array([False, True, False]))
    history[1], outputs[1] = [], []
    feed([rng.integers(0, 97, n) for n in (0, 7, 0)], 9, left=False)
    for _ in range(3):
        feed([rng.integers(0, 97, 1) for _ in range(3)], 1, left=False)

    assert np.asarray(cache.lengths).tolist() == [len(h) for h in history] == [14, 10, 12]
    assert int(cache.pages_used) == 4 + 3 + 3
    assert traces.count((3, 1)) == 1, "decode steps must not retrace"
    for b in range(3):
        tokens = jnp.asarray(history[b])[None]
        mask = jnp.ones(tokens.shape, bool)
        full, _ = model(tokens, positions_from_mask(mask), mask)
        np.testing.assert_allclose(np.stack(outputs[b]), np.asarray(full)[0], atol=1e-5, rtol=0)


WRITE_IN_PLACE = """
import jax, jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from agentrl_jax.models import paged_cache
device = topologies.get_topology_desc("v5p:2x2x2", "tpu").devices[:1]
one = NamedSharding(Mesh(device, ("x",)), PartitionSpec())
pool = (8, 36, 512, 128, 128)  # Qwen3-4B's kv heads, layers; 512 pages of 128: 4.5 GiB

def decode_writes(k, page, offset, values):  # one token per row into every layer
    return jax.lax.fori_loop(0, pool[1], lambda layer, k: paged_cache.write(
        k, layer, page, offset, values * layer), k)

spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=one)
compiled = jax.jit(decode_writes, donate_argnums=0).lower(
    spec(pool, jnp.bfloat16), spec((64, 1), jnp.int32), spec((64, 1), jnp.int32),
    spec((64, 1, 8, 128), jnp.bfloat16)).compile()
print(compiled.memory_analysis().temp_size_in_bytes,
      compiled.memory_analysis().argument_size_in_bytes)
"""


def test_the_pool_write_stays_in_place_when_compiled_for_a_tpu():
    """The per-token scatter into the heads-first pool, compiled for a v5p chip: its
    temporaries are a few MiB, not a second pool (``pool.at[:, layer, page, offset]`` made
    the TPU compiler copy all of it; XLA:CPU does not, so the check needs the TPU compiler)."""
    pytest.importorskip("libtpu")
    import os
    import subprocess
    import sys

    # compile-only TPU devices: the child may load libtpu while this process holds it too
    child_env = {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}

    child = subprocess.run(
        [sys.executable, "-c", WRITE_IN_PLACE],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    temp, pool = map(int, child.stdout.split()[-2:])
    assert pool > 4 * 2**30 and temp < 2**26
