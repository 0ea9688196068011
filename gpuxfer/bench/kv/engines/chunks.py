"""Cutting descriptor tables: long descriptors split, a table cut into chunks that ramp up and down
(the ``pack`` and ``nixl+pack`` pipelines, MoRI-IO's work-request cap), a byte range as bulk descriptors.

Pure numpy; every function returns int64 ``(N, 3)`` ``(src_offset, dst_offset, nbytes)`` tables or row ranges.
"""
from __future__ import annotations

import numpy as np

from ....errors import BadInput
from .base import as_descriptors


def split_large(desc: np.ndarray, max_bytes: int) -> np.ndarray:
    """Split every descriptor longer than ``max_bytes`` into pieces of at most ``max_bytes`` (order kept)."""
    d = as_descriptors(desc)
    n = d[:, 2]
    if d.shape[0] == 0 or int(n.max()) <= max_bytes:
        return d
    pieces = np.maximum(1, -(-n // max_bytes))
    idx = np.repeat(np.arange(d.shape[0]), pieces)
    first = np.cumsum(pieces) - pieces
    k = np.arange(idx.size) - np.repeat(first, pieces)           # piece number within its descriptor
    off = k * max_bytes
    out = np.empty((idx.size, 3), dtype=np.int64)
    out[:, 0] = d[idx, 0] + off
    out[:, 1] = d[idx, 1] + off
    out[:, 2] = np.minimum(max_bytes, n[idx] - off)
    return out


def chunk_plan(desc: np.ndarray, chunk_bytes: int, first_chunk_bytes: int) -> list[tuple[int, int, int]]:
    """Cut ``desc`` (no descriptor longer than ``chunk_bytes``) into chunks at descriptor boundaries.

    Chunk sizes ramp up from ``first_chunk_bytes``, doubling, to ``chunk_bytes``, and
    ramp down again at the end (each at most half of what is left, never below
    ``first_chunk_bytes``): the first pack and the last unpack -- the pipeline's
    fill and drain, which nothing overlaps -- stay small. Returns ``(start, stop,
    nbytes)`` descriptor ranges.
    """
    n = desc[:, 2]
    cum = np.concatenate([[0], np.cumsum(n, dtype=np.int64)])
    total = int(cum[-1])
    out = []
    start, head = 0, int(first_chunk_bytes)
    nd = desc.shape[0]
    while start < nd:
        left = total - int(cum[start])
        target = min(head, chunk_bytes, max(int(first_chunk_bytes), left // 2))
        limit = int(cum[start]) + target
        stop = int(np.searchsorted(cum, limit, side="right")) - 1
        stop = min(max(stop, start + 1), nd)
        out.append((start, stop, int(cum[stop] - cum[start])))
        start = stop
        head = min(head * 2, chunk_bytes)
    assert sum(c[2] for c in out) == total
    return out


def bulk_descriptors(nbytes: int, chunk_bytes: int, *,
                     src_offset: int = 0, dst_offset: int = 0) -> np.ndarray:
    """``[0, nbytes)`` cut into descriptors of at most ``chunk_bytes`` (the last may be shorter)."""
    nbytes, chunk_bytes = int(nbytes), int(chunk_bytes)
    if nbytes < 0 or chunk_bytes <= 0:
        raise BadInput(f"bulk_descriptors needs nbytes >= 0 and chunk_bytes > 0, got {nbytes}, {chunk_bytes}")
    starts = np.arange(0, nbytes, chunk_bytes, dtype=np.int64)
    sizes = np.minimum(chunk_bytes, nbytes - starts)
    return np.stack([starts + src_offset, starts + dst_offset, sizes], axis=1).astype(np.int64).reshape(-1, 3)
