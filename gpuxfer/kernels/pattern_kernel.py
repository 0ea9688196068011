"""Pattern fill and verify kernels.

The pattern (see :mod:`gpuxfer.kernels.reference`, which computes the same bytes
with NumPy): byte ``o`` of a pool filled with ``seed`` is byte ``o % 8`` of
``mix64(key + o // 8)``, ``key = seed_key(seed)`` and ``mix64`` the SplitMix64
finaliser. Both kernels compute it per byte from the byte's pool offset, so any
alignment works.

* ``fill_kernel`` writes the pattern over ``pool[start:start + nbytes]``.
* ``verify_kernel`` reads every byte of every descriptor's *destination* and
  compares it with the pattern at the descriptor's *source* offset; it adds the
  number of wrong bytes to ``result[0]`` and lowers ``result[1]`` to the index of
  the first descriptor holding one (atomics, once per program).
"""
from __future__ import annotations

import triton.language as tl

from ._jit import dual_kernel


@dual_kernel(do_not_specialize=["start", "nbytes", "key"])
def fill_kernel(pool_ptr, start, nbytes, key, BLOCK: tl.constexpr):
    pid = tl.cast(tl.program_id(0), tl.int64)
    first = tl.cast(start, tl.int64)
    end = first + tl.cast(nbytes, tl.int64)
    k = tl.cast(tl.cast(key, tl.int64), tl.uint64, bitcast=True)
    o = first + pid * BLOCK + tl.arange(0, BLOCK)
    m = o < end
    ou = tl.cast(o, tl.uint64)
    x = (ou >> 3) + k
    x = x ^ (x >> 30)
    x = x * 0xBF58476D1CE4E5B9
    x = x ^ (x >> 27)
    x = x * 0x94D049BB133111EB
    x = x ^ (x >> 31)
    b = (x >> ((ou & 7) << 3)) & 0xFF
    tl.store(pool_ptr + o, tl.cast(b, tl.uint8), mask=m)


@dual_kernel(do_not_specialize=["n_rows", "key", "n_items", "slices"])
def verify_kernel(pool_ptr, desc_ptr, n_rows, key, result_ptr, n_items, slices,
                  ROWS: tl.constexpr, WB: tl.constexpr):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    k = tl.cast(tl.cast(key, tl.int64), tl.uint64, bitcast=True)
    nr = tl.cast(n_rows, tl.int64)
    cols = tl.arange(0, WB)
    lanes = tl.arange(0, ROWS)
    wrong = tl.zeros([ROWS], tl.int64)
    first = nr
    for it in range(pid, n_items, G):
        grp = it // slices
        sl = it - grp * slices
        r = tl.cast(grp, tl.int64) * ROWS + lanes
        rmask = r < nr
        s = tl.load(desc_ptr + r * 3, mask=rmask, other=0)
        d = tl.load(desc_ptr + r * 3 + 1, mask=rmask, other=0)
        n = tl.load(desc_ptr + r * 3 + 2, mask=rmask, other=0)
        nch = tl.cdiv(tl.max(n, axis=0), WB)
        bad_rows = tl.zeros([ROWS], tl.int64)
        for c in range(sl, nch, slices):
            o = tl.cast(c, tl.int64) * WB + cols
            m = o[None, :] < n[:, None]
            got = tl.load(pool_ptr + (d[:, None] + o[None, :]), mask=m, other=0)
            so = tl.cast(s[:, None] + o[None, :], tl.uint64)
            x = (so >> 3) + k
            x = x ^ (x >> 30)
            x = x * 0xBF58476D1CE4E5B9
            x = x ^ (x >> 27)
            x = x * 0x94D049BB133111EB
            x = x ^ (x >> 31)
            want = tl.cast((x >> ((so & 7) << 3)) & 0xFF, tl.uint8)
            bad = (got != want) & m
            bad_rows += tl.cast(tl.sum(tl.cast(bad, tl.int32), axis=1), tl.int64)
        wrong += bad_rows
        first = tl.minimum(first, tl.min(tl.where(bad_rows > 0, r, nr), axis=0))
    tl.atomic_add(result_ptr, tl.sum(wrong, axis=0))
    tl.atomic_min(result_ptr + 1, first)
