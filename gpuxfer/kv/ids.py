"""A request's block IDs on the host: taken as contiguous int64 arrays, range-checked, ordered and
checked for duplicate destinations in O(IDs) with a per-thread scratch array."""
from __future__ import annotations

import threading

import numpy as np

from ..errors import BlockIdError
from .layers import _MAX_INT, _torch


def _as_ids(ids, request: str, group: str, side: str) -> np.ndarray:
    """Block IDs as a contiguous 1-D int64 array (``request``, ``group`` and ``side`` name them in errors)."""
    if type(ids) is np.ndarray and ids.dtype == np.int64 and ids.ndim == 1 and ids.flags.c_contiguous:
        return ids
    what = f"request {request!r}, group {group!r}, {side}"
    torch = _torch()
    if isinstance(ids, torch.Tensor):
        if ids.device.type != "cpu":
            raise BlockIdError(f"{what}: block IDs must be on the host (a list, a numpy array or a CPU tensor)")
        ids = ids.numpy()
    arr = np.asarray(ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise BlockIdError(f"{what}: block IDs must be a 1-D sequence of integers, got {arr.dtype} {arr.shape}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) >= _MAX_INT:
        raise BlockIdError(f"{what}: block ID {int(arr.max())} is out of range")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _check_range(ids: np.ndarray, limit: int, request: str, group: str, side: str) -> None:
    """Every ID in ``[0, limit)``: one reduction (a negative ID read unsigned is past any limit)."""
    if ids.size and int(ids.view(np.uint64).max()) >= limit:
        bad = int(np.flatnonzero((ids < 0) | (ids >= limit))[0])
        raise BlockIdError(f"request {request!r}, group {group!r}, {side}: block ID {int(ids[bad])} at position {bad} is out of range "
                           f"(the group holds blocks 0..{limit - 1})")


class _Scratch(threading.local):
    """Per thread: an int64 array over block IDs, all -1 between uses (each use puts back what it wrote),
    so checking or ordering a request's IDs costs O(IDs), not a fresh array over the group's blocks."""

    def __init__(self):
        self.slots = np.full(0, -1, dtype=np.int64)
        self.positions = np.arange(0, dtype=np.int64)

    def get(self, limit: int) -> np.ndarray:
        if self.slots.size < limit:
            self.slots = np.full(max(limit, 2 * self.slots.size), -1, dtype=np.int64)
        return self.slots[:limit]

    def arange(self, n: int) -> np.ndarray:
        """``np.arange(n)`` as a read-only view of one kept array."""
        if self.positions.size < n:
            self.positions = np.arange(max(n, 2 * self.positions.size), dtype=np.int64)
            self.positions.flags.writeable = False
        return self.positions[:n]


_SCRATCH = _Scratch()


def _sort_order(keys: np.ndarray, limit: int) -> np.ndarray:
    """An order sorting ``keys`` (IDs in ``[0, limit)``). Distinct keys among a good share of the range go
    by one scatter and one pass over the range; others by a comparison sort."""
    n = keys.size
    if limit <= 16 * n:
        slot = _SCRATCH.get(limit)
        slot[keys] = _SCRATCH.arange(n)
        order = slot[slot >= 0]
        slot[keys] = -1
        if order.size == n:
            return order
    return np.argsort(keys)


def _check_unique(ids: np.ndarray, limit: int, request: str, groups: list[str]) -> None:
    """No ID twice in ``ids`` (all in ``[0, limit)``): each ID's slot takes the position of one of its
    occurrences; an occurrence that reads back another position is a duplicate. O(len(ids))."""
    if ids.size < 2:
        return
    at = _SCRATCH.arange(ids.size)
    slot = _SCRATCH.get(limit)
    slot[ids] = at
    differ = slot[ids] != at
    slot[ids] = -1
    if differ.any():
        dup = np.flatnonzero(differ)
        raise BlockIdError(f"request {request!r}, group(s) {', '.join(groups)}: destination block "
                           f"{int(ids[dup[0]])} appears more than once (two copies "
                           "would land on the same bytes)")
