"""Host-side packing of ragged token rows into the few static chunk widths the sampler sees."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def bucket_width(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket ``>= length`` (buckets need not be sorted)."""
    fitting = [b for b in buckets if b >= length]
    if not fitting:
        raise ValueError(f"a row of {length} tokens exceeds the largest bucket {max(buckets)}")
    return min(fitting)


def pad_rows(
    rows: Sequence[Sequence[int]], buckets: int | Sequence[int], *, pad_id: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad ragged rows to one width: ``(tokens int32 [B, W], mask bool [B, W])``.

    ``W`` is the smallest of ``buckets`` holding the longest row, so a rollout whose chunks
    vary in length compiles once per bucket, not once per length. Empty rows are all padding.
    """
    buckets = (buckets,) if isinstance(buckets, int) else tuple(buckets)
    width = bucket_width(max((len(r) for r in rows), default=0), buckets)
    tokens = np.full((len(rows), width), pad_id, np.int32)
    mask = np.zeros((len(rows), width), bool)
    for b, row in enumerate(rows):
        if len(row):
            tokens[b, width - len(row) :] = np.asarray(row, np.int32)
            mask[b, width - len(row) :] = True
    return tokens, mask
