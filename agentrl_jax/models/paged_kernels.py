"""jax's Pallas paged-attention kernels for the decode step, over this project's page pool.

A decode step attends one new query per row to the row's cached keys. On accelerators jax
ships kernels that read each row's pages straight from device memory, one block of pages at a
time, with an online softmax:

* ``"pallas_tpu"``: :func:`jax.experimental.pallas.ops.tpu.paged_attention.paged_attention`.
  It casts the pages it loads to bfloat16, so it is selected only for a bfloat16 pool (the
  paper-scale configs' ``kv_cache_dtype``); on a float32 pool it would round the keys;
* ``"pallas_gpu"``: :func:`jax.experimental.pallas.ops.gpu.paged_attention.paged_attention`
  (Triton).

Both read keys and values as ``[kv_heads, pages, page_size, head_dim]``. The pool of
:class:`~agentrl_jax.models.paged_cache.PagedKVCache` is ``[KV, layers, P, S, hd]``, which
reshapes for free to ``[KV, layers * P, S, hd]``: layer ``l``'s page ``p`` is page
``l * P + p`` there, so a kernel reads the pool in place, with no copy of a layer's pages.
Neither scales the scores, so the query is multiplied by ``hd ** -0.5`` first.

:func:`select_kernel` says what a platform gets (``"xla"``, the gather-based
:func:`~agentrl_jax.models.paged_cache.paged_attention`, wherever a kernel's constraints do
not hold); :func:`decode_attention` runs one. Appends (several queries per row: prompts and
observations) always use the XLA version. ``interpret=True`` runs a kernel by Pallas'
interpreter, on any backend: that is how the tests check both kernels against the XLA version
on a CPU (`tests/test_paged_kernels.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

KERNELS = ("xla", "pallas_tpu", "pallas_gpu")
_SPLITS = (16, 8, 4, 2, 1)
# The Triton kernel keeps a block's keys and values in shared memory: XLA:GPU (jax 0.10.2,
# compiled for H100 and A100) takes 64 KiB tiles of keys (256 bfloat16 tokens of head_dim 128)
# and refuses 128 KiB ones (276 KiB of shared memory asked for the block; an H100 block may opt
# in to 227 KiB, an A100's to 163 KiB). tests/gpu/test_gpu_compile.py compiles both.
GPU_TILE_BYTES = 64 * 1024


def unmet(kernel: str, *, page_size: int, head_dim: int, dtype) -> str | None:
    """Why ``kernel`` cannot serve a pool of ``page_size``-token pages, ``head_dim`` and
    ``dtype`` (None: it can). TPU: a bfloat16 pool (the kernel computes in bfloat16),
    ``head_dim`` a multiple of 128 and ``page_size`` of 16 (its memory tiles). GPU: ``head_dim``
    and ``page_size`` multiples of 16 (Triton's matrix tiles)."""
    if kernel == "pallas_tpu":
        if jnp.dtype(dtype) != jnp.bfloat16:
            return (
                f"it computes on bfloat16 pages, and this pool is {jnp.dtype(dtype)} (its "
                "keys would be rounded)"
            )
        if head_dim % 128 or page_size % 16:
            return (
                f"it needs head_dim a multiple of 128 and pages a multiple of 16 tokens, "
                f"got {head_dim} and {page_size}"
            )
    if kernel == "pallas_gpu" and (head_dim % 16 or page_size % 16):
        return f"it needs head_dim and pages multiples of 16, got {head_dim} and {page_size}"
    if kernel == "pallas_gpu" and page_size * head_dim * jnp.dtype(dtype).itemsize > GPU_TILE_BYTES:
        return (
            f"a page of {page_size} tokens x head_dim {head_dim} in {jnp.dtype(dtype)} is over the "
            f"{GPU_TILE_BYTES // 1024} KiB its shared memory holds for one block of keys"
        )
    return None


def gpu_block_pages(block_pages: int, per_row: int, page_bytes: int) -> int:
    """Pages per block of the Triton kernel's loop: a power of two (Triton's arrays are; 3
    pages a block fails to lower), a divisor of the pages each of its ``k_splits`` reads
    (``per_row`` over the splits), at most ``block_pages`` and at most :data:`GPU_TILE_BYTES`
    of keys (``page_bytes`` a page)."""
    splits = next(s for s in _SPLITS if per_row % s == 0)
    most = max(1, min(block_pages, GPU_TILE_BYTES // page_bytes))
    pages = 1
    while (per_row // splits) % (2 * pages) == 0 and 2 * pages <= most:
        pages *= 2
    return pages


def select_kernel(platform: str, *, page_size: int, head_dim: int, dtype) -> str:
    """The decode attention for ``platform`` (``jax.Device.platform``: "tpu", "gpu" or
    "cuda", "cpu", ...): the platform's Pallas kernel where :func:`unmet` finds nothing
    against it, else "xla"."""
    kernel = {
        "tpu": "pallas_tpu",
        "gpu": "pallas_gpu",
        "cuda": "pallas_gpu",
        "rocm": "pallas_gpu",
    }.get(platform, "xla")
    fits = unmet(kernel, page_size=page_size, head_dim=head_dim, dtype=dtype) is None
    return kernel if fits else "xla"


def _divisor(n: int, at_most: int) -> int:
    """The largest divisor of ``n`` that is at most ``at_most``."""
    return max(d for d in range(1, max(1, min(n, at_most)) + 1) if n % d == 0)


def decode_attention(
    kernel: str,
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: int | jax.Array,
    page_table: jax.Array,
    lengths: jax.Array,
    block_pages: int,
    interpret: bool = False,
) -> jax.Array:
    """One query per row against its first ``lengths[b]`` cached slots, by a Pallas kernel.

    ``q [B, H, hd]``; ``k_pool, v_pool [KV, layers, P, S, hd]`` at ``layer``; ``page_table
    [B, R]`` (entries ``>= P``, unassigned, are never read below ``lengths``); ``lengths [B]``
    int (a row with 0 gets a meaningless, finite-or-not output: callers discard it).
    ``block_pages``: pages per block of the kernel's loop (reduced to a divisor of ``R``).
    Returns ``[B, H, hd]`` in ``q.dtype``.
    """
    kv_heads, layers, pages, size, head_dim = k_pool.shape
    per_row = page_table.shape[1]
    flat = (kv_heads, layers * pages, size, head_dim)
    table = jnp.minimum(page_table, pages - 1).astype(jnp.int32) + layer * pages
    lengths = jnp.maximum(lengths, 1).astype(jnp.int32)
    scaled = (q.astype(jnp.float32) * head_dim**-0.5).astype(q.dtype)
    if kernel == "pallas_tpu":
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention  # noqa: PLC0415

        call = lambda: paged_attention(  # noqa: E731
            scaled,
            k_pool.reshape(flat),
            v_pool.reshape(flat),
            lengths,
            table,
            pages_per_compute_block=_divisor(per_row, block_pages),
        )
        if not interpret:
            return call()
        from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415

        with pltpu.force_tpu_interpret_mode():
            return call()
    if kernel == "pallas_gpu":
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention  # noqa: PLC0415

        splits = next(s for s in _SPLITS if per_row % s == 0)
        page_bytes = size * head_dim * k_pool.dtype.itemsize
        return paged_attention(
            scaled,
            k_pool.reshape(flat),
            v_pool.reshape(flat),
            table,
            lengths,
            pages_per_compute_block=gpu_block_pages(block_pages, per_row, page_bytes),
            k_splits=splits,
            interpret=interpret,
        )
    raise ValueError(f"decode_attention: kernel must be one of {KERNELS[1:]}, got {kernel!r}")


__all__ = ["KERNELS", "decode_attention", "select_kernel"]
