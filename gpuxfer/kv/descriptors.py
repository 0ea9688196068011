"""Descriptor tables, what the runtime and the benchmark both move: an int64 array of shape (N, 3), columns
``(src_offset, dst_offset, nbytes)``, byte offsets into the source and destination pools; the two directions a
transfer runs in; the one bounds check of every table.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ..errors import BadInput

__all__ = ["DIRECTIONS", "PLAN_DTYPE", "as_descriptors", "check_bounds"]

PLAN_DTYPE = np.int64
#: how a transfer moves: ``pull`` (the decode side reads the prefill side's pool) or ``push`` (the prefill
#: side writes the decode side's)
DIRECTIONS = ("pull", "push")


def as_descriptors(table, name: str = "descriptors") -> np.ndarray:
    """``table`` as a contiguous int64 (N, 3) array; :class:`BadInput` for any other shape or a non-integer
    dtype."""
    arr = np.asarray(table)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise BadInput(f"{name} must have shape (N, 3), got {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise BadInput(f"{name} must be integers, got {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _as_plan(plan) -> np.ndarray:
    if not isinstance(plan, np.ndarray):
        raise BadInput(f"a descriptor plan must be a numpy array, got {type(plan).__name__}")
    if plan.dtype != PLAN_DTYPE or plan.ndim != 2 or plan.shape[1] != 3:
        raise BadInput(f"a descriptor plan must be int64 of shape (N, 3), got {plan.dtype} {plan.shape}")
    return plan


def _first(mask: np.ndarray) -> int | None:
    idx = np.flatnonzero(mask)
    return int(idx[0]) if idx.size else None


def check_bounds(plan: np.ndarray, src_nbytes: int | None, dst_nbytes: int | None, *,
                 describe: Callable[[int], str] | None = None) -> None:
    """Every row moves at least one byte and lies inside both pools; :class:`BadInput` names the first
    row that does not. The one bounds check of plans and of every KV engine's descriptors.

    A pool size of ``None`` (not known here) checks only that the row's offsets are non-negative.
    Overflow-safe: a range is compared as ``offset <= pool - nbytes`` once ``0 < nbytes`` is known,
    never as ``offset + nbytes``, which wraps in int64 for an offset or size near ``2**63``.
    """
    plan = _as_plan(plan)
    if plan.shape[0] == 0:
        return
    name = describe or (lambda i: f"descriptor {i}")
    size = plan[:, 2]
    i = _first(size <= 0)
    if i is not None:
        raise BadInput(f"{name(i)} moves {int(size[i])} bytes; every descriptor must move at least one")
    for side, col, pool in (("source", plan[:, 0], src_nbytes), ("destination", plan[:, 1], dst_nbytes)):
        if pool is None:
            i = _first(col < 0)
        else:
            pool = int(pool)
            if not 0 <= pool < 1 << 63:
                raise BadInput(f"the {side} pool size must be in [0, 2**63), got {pool}")
            i = _first((col < 0) | (col > np.int64(pool) - size))     # pool - size: no overflow for size > 0
        if i is not None:
            where = f"the {side} pool" + ("" if pool is None else f" of {pool} bytes")
            raise BadInput(f"{name(i)}: {side} range [{int(col[i])}, {int(col[i]) + int(size[i])}) lies outside "
                           f"{where}")
