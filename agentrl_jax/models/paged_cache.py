"""A paged KV cache: a shared pool of fixed-size pages, a page table per row, attention that
reads only the pages rows use.

Layout
------
``PagedKVCache`` holds

* ``k``, ``v``    ``[kv_heads, num_layers, num_pages, page_size, head_dim]``: the pool, heads
  first: jax's Pallas paged-attention kernels (TPU and GPU) read one head's pages as
  ``[pages, page_size, head_dim]``, and with the layers flattened into the page axis (a free
  reshape) they read the whole pool in place (:mod:`agentrl_jax.models.paged_kernels`);
* ``page_table``  ``[B, pages_per_row]`` int32: row ``b``'s logical page ``p`` (slots
  ``p * page_size ..``) lives in physical page ``page_table[b, p]``; ``num_pages`` (one past
  the last page) marks an unassigned entry. A row's assigned pages are always its first
  ``ceil(lengths[b] / page_size)`` entries;
* ``lengths``     ``[B]`` int32: tokens cached per row (as :class:`~agentrl_jax.models.qwen3.
  KVCache`);
* ``free``        ``[num_pages]`` bool: pages no row holds.

A row can hold at most ``max_len = pages_per_row * page_size`` tokens, but the pool may be
smaller than ``B * pages_per_row`` pages: memory follows the tokens actually cached, not the
worst case of every row. Everything is static-shape: growing contexts, finishing rows and
refills change values, never shapes, so nothing recompiles.

Pure functions
--------------
* :func:`allocate` gives rows the pages they need to grow to a new length (a row that cannot
  get them gets none and is reported, so the caller leaves it unwritten);
* :func:`release` returns rows' pages to the pool (a finished row; its slot is then empty);
* :func:`take_rows` reorders, drops and duplicates rows: a row's first copy keeps its pages (no
  data moves), later copies get fresh pages and a copy of the data, dropped rows' pages are freed;
  :func:`copy_rows` copies a few rows into empty ones (a task group's shared prompt);
* :func:`write` stores one layer's new keys/values at the rows' next slots;
* :func:`paged_attention` is grouped-query attention of queries against each row's pages: a
  ``lax.while_loop`` over blocks of ``block_pages`` pages that stops after the last block any
  row uses, with an online (flash) softmax. Its cost follows the longest row's fill, not
  ``max_len``: a decode step at a quarter-filled cache reads a quarter of the keys.

The model's cache forward (:meth:`agentrl_jax.models.qwen3.Qwen3ForCausalLM.hidden_states`)
accepts this cache wherever it accepts a ``KVCache``; the sampler allocates before each write.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from agentrl_jax.models.config import Qwen3Config

_MASKED_SCORE = -1e30


@struct.dataclass
class PagedKVCache:
    """Pages of keys/values plus each row's page table and fill level (module docstring)."""

    k: jax.Array  # [kv_heads, num_layers, num_pages, page_size, head_dim]
    v: jax.Array  # [kv_heads, num_layers, num_pages, page_size, head_dim]
    page_table: jax.Array  # [B, pages_per_row] int32, num_pages = unassigned
    lengths: jax.Array  # [B] int32
    free: jax.Array  # [num_pages] bool
    block_pages: int = struct.field(pytree_node=False, default=8)
    # the decode step's attention: "xla" (paged_attention), "pallas_tpu" or "pallas_gpu"
    # (paged_kernels); interpret: a Pallas kernel run by its interpreter (tests on a CPU)
    kernel: str = struct.field(pytree_node=False, default="xla")
    interpret: bool = struct.field(pytree_node=False, default=False)

    @classmethod
    def empty(
        cls,
        config: Qwen3Config,
        batch_size: int,
        max_len: int,
        *,
        page_size: int = 32,
        num_pages: int | None = None,
        block_pages: int = 8,
        kernel: str = "xla",
        interpret: bool = False,
        dtype: jnp.dtype = jnp.bfloat16,
    ) -> "PagedKVCache":
        """``batch_size`` empty rows of up to ``max_len`` tokens (rounded up to whole pages)
        over a pool of ``num_pages`` pages (default: enough for every row to be full)."""
        if page_size < 1 or block_pages < 1:
            raise ValueError(
                f"page_size and block_pages must be >= 1, got {page_size}, {block_pages}"
            )
        pages_per_row = -(-max_len // page_size)
        num_pages = batch_size * pages_per_row if num_pages is None else num_pages
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        shape = (
            config.num_key_value_heads,
            config.num_hidden_layers,
            num_pages,
            page_size,
            config.head_dim,
        )
        return cls(
            k=jnp.zeros(shape, dtype),
            v=jnp.zeros(shape, dtype),
            page_table=jnp.full((batch_size, pages_per_row), num_pages, jnp.int32),
            lengths=jnp.zeros((batch_size,), jnp.int32),
            free=jnp.ones((num_pages,), bool),
            block_pages=min(block_pages, pages_per_row),
            kernel=kernel,
            interpret=interpret,
        )

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def pages_per_row(self) -> int:
        return self.page_table.shape[1]

    @property
    def max_len(self) -> int:
        return self.pages_per_row * self.page_size

    @property
    def pages_used(self) -> jax.Array:
        """Scalar int32: pages held by rows."""
        return self.num_pages - jnp.sum(self.free, dtype=jnp.int32)


def _held(cache: PagedKVCache) -> jax.Array:
    """``[B]`` int32: pages each row holds (its first entries of the page table)."""
    return jnp.sum(cache.page_table < cache.num_pages, axis=1, dtype=jnp.int32)


def allocate(cache: PagedKVCache, new_lengths: jax.Array) -> tuple[PagedKVCache, jax.Array]:
    """Give each row the pages it needs to hold ``new_lengths [B]`` tokens.

    Returns ``(cache, ok [B] bool)``. Rows take free pages in row order, lowest page first; a
    row whose pages do not fit in what is left (or whose ``new_lengths`` exceeds ``max_len``)
    gets none and ``ok`` False, and so does every later row that needs a page (the pool is
    then as good as full); a row that needs no new page is always ok. ``lengths`` is not changed
    (the write that follows sets it).
    """
    size, num_pages, per_row = cache.page_size, cache.num_pages, cache.pages_per_row
    held = _held(cache)
    wanted = -(-jnp.minimum(new_lengths, cache.max_len) // size)
    in_range = new_lengths <= cache.max_len
    need = jnp.where(in_range, jnp.maximum(wanted - held, 0), 0)
    fits = jnp.cumsum(need) <= jnp.sum(cache.free, dtype=jnp.int32)
    ok = ((jnp.cumsum(~fits) == 0) | (need == 0)) & in_range  # none after the first misfit
    need = jnp.where(ok, need, 0)
    start = jnp.cumsum(need) - need
    free_ids = jnp.nonzero(cache.free, size=num_pages, fill_value=num_pages)[0].astype(jnp.int32)
    logical = jnp.arange(per_row, dtype=jnp.int32)[None, :]
    fresh = (logical >= held[:, None]) & (logical < (held + need)[:, None])  # [B, R]
    rank = jnp.clip(start[:, None] + logical - held[:, None], 0, num_pages - 1)
    table = jnp.where(fresh, free_ids[rank], cache.page_table)
    taken = (
        jnp.zeros((num_pages,), bool).at[jnp.where(fresh, table, num_pages)].set(True, mode="drop")
    )
    return cache.replace(page_table=table, free=cache.free & ~taken), ok


def release(cache: PagedKVCache, rows: jax.Array) -> PagedKVCache:
    """Empty the rows where ``rows [B]`` is True: their pages go back to the pool."""
    rows = rows.astype(bool)
    pages = jnp.where(rows[:, None], cache.page_table, cache.num_pages)
    return cache.replace(
        free=cache.free.at[pages.reshape(-1)].set(True, mode="drop"),
        page_table=jnp.where(rows[:, None], cache.num_pages, cache.page_table),
        lengths=jnp.where(rows, 0, cache.lengths),
    )


def take_rows(cache: PagedKVCache, index: jax.Array) -> PagedKVCache:
    """The rows ``index int[B']`` in that order; ``index < 0`` gives an empty row.

    The first row taken from each source keeps that source's pages; a later row taken from
    the same source gets fresh pages holding a copy (one row at a time, so the copy's
    temporary is one row's pages); sources not taken release their pages. A copy that does not
    fit in the pool leaves its row empty (check ``lengths``).
    """
    index = index.astype(jnp.int32)
    count = index.shape[0]
    valid = index >= 0
    source = jnp.where(valid, index, 0)
    earlier = jnp.tril(source[:, None] == source[None, :], k=-1) & valid[None, :]
    first = valid & ~jnp.any(earlier, axis=1)  # [B'] this row keeps its source's pages
    kept = (
        jnp.zeros(cache.lengths.shape, bool).at[jnp.where(first, source, -1)].set(True, mode="drop")
    )
    cache = release(cache, ~kept)
    src_table = cache.page_table[source]
    table = jnp.where(first[:, None], src_table, cache.num_pages)
    lengths = jnp.where(valid, cache.lengths[source], 0)
    copies = valid & ~first
    out = cache.replace(page_table=table, lengths=jnp.where(first, lengths, 0))
    out, ok = allocate(out, jnp.where(copies, lengths, 0))
    copied = copies & ok

    def copy_row(i, kv):
        k, v = kv
        held = out.page_table[i] < out.num_pages
        dst = jnp.where(held & copied[i], out.page_table[i], out.num_pages)
        src = jnp.clip(src_table[i], 0, out.num_pages - 1)
        return (
            k.at[:, :, dst].set(k[:, :, src], mode="drop"),
            v.at[:, :, dst].set(v[:, :, src], mode="drop"),
        )

    k, v = jax.lax.fori_loop(0, count, copy_row, (out.k, out.v))
    out = out.replace(k=k, v=v, lengths=jnp.where(first | copied, lengths, 0))
    return release(out, copies & ~ok)


def copy_rows(
    cache: PagedKVCache, dst: jax.Array, src: jax.Array
) -> tuple[PagedKVCache, jax.Array]:
    """Row ``dst[i]`` becomes a copy of row ``src[i]``: fresh pages holding a copy of the
    data, one pair at a time (``dst`` distinct, empty rows, not among ``src``; ``dst < 0``:
    no pair). Returns ``(cache, copied [k] bool)``: a copy the pool has no room for leaves its
    row empty."""
    batch = cache.lengths.shape[0]
    valid = dst >= 0
    target = jnp.where(valid, dst, batch)
    source = jnp.where(valid, src, 0)
    lengths = jnp.where(valid, cache.lengths[source], 0)
    cache, ok = allocate(cache, cache.lengths.at[target].set(lengths, mode="drop"))
    copied = valid & ok[jnp.where(valid, dst, 0)]
    src_table = cache.page_table[source]

    def copy_pair(i, kv):
        k, v = kv
        row = jnp.where(copied[i], target[i], 0)
        held = (cache.page_table[row] < cache.num_pages) & copied[i]
        to = jnp.where(held, cache.page_table[row], cache.num_pages)
        start = jnp.clip(src_table[i], 0, cache.num_pages - 1)
        return (
            k.at[:, :, to].set(k[:, :, start], mode="drop"),
            v.at[:, :, to].set(v[:, :, start], mode="drop"),
        )

    k, v = jax.lax.fori_loop(0, dst.shape[0], copy_pair, (cache.k, cache.v))
    landed = jnp.where(copied, target, batch)
    return cache.replace(
        k=k, v=v, lengths=cache.lengths.at[landed].set(lengths, mode="drop")
    ), copied


def physical_slots(cache: PagedKVCache, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(page, offset)`` of logical ``slots [B, L]`` (``>= max_len``: out of range, dropped)."""
    size = cache.page_size
    inside = slots < cache.max_len
    logical = jnp.clip(slots // size, 0, cache.pages_per_row - 1)
    page = jnp.take_along_axis(cache.page_table, logical, axis=1)
    return jnp.where(inside, page, cache.num_pages), slots % size


def write(
    pool: jax.Array, layer: int | jax.Array, page: jax.Array, offset: jax.Array, values: jax.Array
) -> jax.Array:
    """``pool [KV, layers, P, S, hd]`` with ``values [B, L, KV, hd]`` stored at layer ``layer``,
    ``(page, offset) [B, L]`` (a page of ``P`` is dropped).

    Every index is explicit, heads included: XLA keeps a scatter of this form in place, while
    ``pool.at[:, layer, page, offset]`` (a slice before the indexed axes) made the TPU compiler
    copy the whole pool (``plan`` on v5p; a test checks the compiled temporaries)."""
    heads = jnp.arange(pool.shape[0])
    return pool.at[heads, layer, page[..., None], offset[..., None]].set(
        values.astype(pool.dtype), mode="drop"
    )


def paged_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: int | jax.Array,
    page_table: jax.Array,
    key_limit: jax.Array,
    block_pages: int,
) -> jax.Array:
    """Grouped-query attention of ``q [B, L, H, hd]`` against each row's pages.

    ``k_pool, v_pool [KV, layers, P, S, hd]`` at ``layer``; ``page_table [B, R]``; query
    ``(b, i)`` sees the row's logical slots ``< key_limit[b, i]``. Blocks of ``block_pages``
    pages are read until the last one any row's limit reaches (a ``lax.while_loop``: the trip
    count is a value, not a shape). Scores and the online softmax are float32; returns
    ``[B, L, H, hd]`` in ``q.dtype``. A query with no visible slot gets zeros.
    """
    batch, length, heads, head_dim = q.shape
    kv_heads, size = k_pool.shape[0], k_pool.shape[3]
    num_pages, per_row = k_pool.shape[2], page_table.shape[1]
    groups = heads // kv_heads
    block = block_pages * size
    blocks = -(-per_row // block_pages)
    table = jnp.pad(
        page_table, ((0, 0), (0, blocks * block_pages - per_row)), constant_values=num_pages
    )
    grouped = (
        q.reshape(batch, length, kv_heads, groups, head_dim).astype(jnp.float32) * head_dim**-0.5
    )
    used = -(-jnp.max(key_limit) // block)  # blocks any query reaches

    def body(carry):
        i, best, total, acc = carry
        pages = jnp.clip(
            jax.lax.dynamic_slice_in_dim(table, i * block_pages, block_pages, 1), 0, num_pages - 1
        )  # [B, block_pages]
        keys = k_pool[:, layer, pages].reshape(kv_heads, batch, block, head_dim)
        values = v_pool[:, layer, pages].reshape(kv_heads, batch, block, head_dim)
        scores = jnp.einsum("blkgd,kbsd->bkgls", grouped, keys.astype(jnp.float32))
        slot = i * block + jnp.arange(block)
        visible = (slot[None, None, :] < key_limit[:, :, None])[:, None, None]  # [B,1,1,L,s]
        scores = jnp.where(visible, scores, _MASKED_SCORE)
        new_best = jnp.maximum(best, jnp.max(scores, axis=-1))
        probs = jnp.where(visible, jnp.exp(scores - new_best[..., None]), 0.0)
        scale = jnp.exp(best - new_best)
        total = total * scale + jnp.sum(probs, axis=-1)
        acc = acc * scale[..., None] + jnp.einsum(
            "bkgls,kbsd->bkgld", probs, values.astype(jnp.float32)
        )
        return i + 1, new_best, total, acc

    stats = (batch, kv_heads, groups, length)
    init = (
        jnp.int32(0),
        jnp.full(stats, _MASKED_SCORE, jnp.float32),
        jnp.zeros(stats, jnp.float32),
        jnp.zeros(stats + (head_dim,), jnp.float32),
    )
    _, _, total, acc = jax.lax.while_loop(lambda c: c[0] < used, body, init)
    out = acc / jnp.where(total > 0, total, 1.0)[..., None]
    out = jnp.moveaxis(out, 3, 1).reshape(batch, length, heads, head_dim)  # [B, L, KV, G, hd]
    return out.astype(q.dtype)


__all__ = [
    "PagedKVCache",
    "allocate",
    "copy_rows",
    "paged_attention",
    "physical_slots",
    "release",
    "take_rows",
    "write",
]
