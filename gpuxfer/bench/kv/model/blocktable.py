"""Block tables: which pool pages each request of a burst occupies, on each side.

A table is drawn per page space from one seeded permutation of that space's pool
pages; request ``r`` of a burst takes the slice ``[r * n, (r + 1) * n)`` (``n`` the
pages one request takes from that space), so the requests of a burst never share
a page, as a real allocator's live requests never alias blocks. Inside a request's
slice, the transfer regions sharing the space take consecutive sub-slices in plan
order.

Seeds derive from (seed, workload, geometry, side) through a stable hash
(BLAKE2b, never Python's salted ``hash()``), so both processes of a benchmark derive
both sides' tables from the configuration alone, and the source ("src") and
destination ("dst") tables are independent.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np

from ....errors import BadInput
from .layout import PoolLayout
from .workloads import _pos_int

__all__ = ["SIDES", "ORDERS", "derive_seed", "space_permutation", "burst_tables"]

SIDES = ("src", "dst")
#: "random": a seeded permutation (fragmented allocator); "sequential": pages in pool
#: order (a fresh allocator, the best case for coalescing).
ORDERS = ("random", "sequential")


def derive_seed(seed: int, *parts) -> int:
    """A 64-bit seed from ``seed`` and ``parts`` (ints and strings), stable across runs and processes."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise BadInput(f"seed must be an integer, got {seed!r}")
    for p in parts:
        if isinstance(p, bool) or not isinstance(p, (int, str)):
            raise BadInput(f"seed parts must be ints or strings, got {p!r}")
    blob = json.dumps([seed, *parts], separators=(",", ":")).encode()
    return int.from_bytes(hashlib.blake2b(blob, digest_size=8, person=b"gpuxfer-kv-bt").digest(), "little")


def _check_side(side: str) -> str:
    if side not in SIDES:
        raise BadInput(f"block-table side must be one of {', '.join(SIDES)}, got {side!r}")
    return side


def space_permutation(layout: PoolLayout, space: str, *, seed: int, side: str, order: str = "random") -> np.ndarray:
    """The page order of ``space`` on ``side``: an int64 permutation of its pool pages."""
    _check_side(side)
    if order not in ORDERS:
        raise BadInput(f"block-table order must be one of {', '.join(ORDERS)}, got {order!r}")
    pages = layout.pages_in(space)
    if order == "sequential":
        return np.arange(pages, dtype=np.int64)
    s = derive_seed(seed, "block-table", layout.workload.name, layout.page_tokens, space, pages, side)
    return np.random.default_rng(s).permutation(pages).astype(np.int64, copy=False)


def burst_tables(layout: PoolLayout, isl_tokens: int, batch: int, *, seed: int, side: str,
                 order: str = "random") -> list[dict[str, np.ndarray]]:
    """Per request of a burst: transfer region name -> its pool page indices (int64), in plan order.

    Raises :class:`BadInput` when a page space of ``layout`` is too small for the burst.
    """
    _check_side(side)
    _pos_int(batch, "batch (requests per burst)")
    trs = layout.workload.transfer_regions(layout.page_tokens)
    tables: list[dict[str, np.ndarray]] = [{} for _ in range(batch)]
    spaces: dict[str, list] = {}
    for t in trs:
        spaces.setdefault(t.page_space, []).append(t)
    for space, members in spaces.items():
        counts = [t.pages_per_request(isl_tokens) for t in members]
        per_request = sum(counts)
        have = layout.pages_in(space)
        if per_request * batch > have:
            raise BadInput(
                f"pool too small for the burst: page space {space!r} of {layout.workload.name!r} holds {have} "
                f"pages, {batch} request(s) of {isl_tokens} tokens at {layout.page_tokens}-token pages need "
                f"{per_request} each ({per_request * batch} in all)")
        perm = space_permutation(layout, space, seed=seed, side=side, order=order)
        for r in range(batch):
            start = r * per_request
            for t, n in zip(members, counts):
                tables[r][t.name] = perm[start:start + n]
                start += n
    return tables
