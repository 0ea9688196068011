"""The descriptor-copy kernel (copy, pack and unpack are three modes of it).

A descriptor ``(src_offset, dst_offset, nbytes)`` moves ``nbytes`` bytes between
two flat uint8 pools. Either pool may be a peer GPU's memory mapped into this
process (pull: the kernel runs on the destination and reads the peer; push: it
runs on the source and writes the peer); to the kernel both are plain pointers.

Shape of the work
-----------------
* A **persistent grid**: ``G`` programs loop over *work items*, so the caller
  bounds the SMs used (``G`` <= SM count: one program per SM).
* A work item is a **group of ROWS descriptors** (and, when there are fewer groups
  than programs, a *slice*: every ``slices``-th column chunk of that group, so a
  few large descriptors still spread over the grid).
* Each step loads ``UNROLL`` chunks of ``W`` 16-byte units from each of the ROWS
  descriptors -- ``ROWS * W * 16 * UNROLL`` bytes, tens of KiB -- **before** storing
  any of them. A remote read over NVLink takes microseconds, so a program is
  latency bound and its throughput is the bytes it keeps in flight divided by
  that latency; this is what lets a few SMs reach the link's ceiling.
* The next item's descriptors are loaded **before** the current item is copied
  (one item of software prefetch), so their latency hides behind the data's.
* 16-byte vector accesses (``ld/st.global.v4.b32``) when the group's offsets and
  sizes and both pool bases are 16-byte aligned (checked per group at run time);
  plain 4-byte accesses when the launcher says everything is 4-byte aligned;
  a byte-wise path otherwise (any size, any alignment). All offsets are int64.

Modes (``MODE``, a compile-time constant):

* 0 -- copy: ``dst[d:d+n] = src[s:s+n]``.
* 1 -- pack: the destination is a staging buffer; row ``i``'s bytes go to
  ``staging_base + offs[i] - offs[row_begin]`` (``offs`` = exclusive cumsum of sizes).
* 2 -- unpack: the source is the staging buffer, laid out as pack wrote it.
"""
from __future__ import annotations

import triton.language as tl

from ._jit import dual_kernel


@dual_kernel(do_not_specialize=["row_begin", "n_rows", "staging_base", "n_items", "slices"])
def copy_kernel(src_ptr, dst_ptr, desc_ptr, offs_ptr,
                row_begin, n_rows, staging_base, n_items, slices,
                MODE: tl.constexpr, ALIGN: tl.constexpr, ROWS: tl.constexpr, W: tl.constexpr,
                UNROLL: tl.constexpr, LOAD_CACHE: tl.constexpr, STORE_CACHE: tl.constexpr):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    # int32 view of both pools for the aligned paths
    sp = src_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    dp = dst_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    cols = tl.arange(0, W * 4)              # int32 lanes of one row chunk (W 16-byte units)
    CH: tl.constexpr = W * 4 * UNROLL       # int32 lanes of one row per step
    BCH: tl.constexpr = W * 4               # bytes of one row per step on the byte path (one int32 lane each)
    lanes = tl.arange(0, ROWS)
    rb = tl.cast(row_begin, tl.int64)
    nr = tl.cast(n_rows, tl.int64)
    sbase = tl.cast(staging_base, tl.int64)
    off0 = tl.cast(0, tl.int64)
    if MODE != 0:
        off0 = tl.load(offs_ptr + rb)

    # the item being copied (loop-carried); starts empty
    s = tl.zeros([ROWS], tl.int64)
    d = tl.zeros([ROWS], tl.int64)
    n = tl.zeros([ROWS], tl.int64)
    sl = pid * 0
    for it in range(pid, n_items + G, G):
        # ---- prefetch item `it`'s descriptors (all-masked past the end)
        grp = it // slices
        sl_next = it - grp * slices
        r = tl.cast(grp, tl.int64) * ROWS + lanes
        rmask = (r < nr) & (it < n_items)
        rows = rb + r
        n_next = tl.load(desc_ptr + rows * 3 + 2, mask=rmask, other=0)
        if MODE == 0:
            s_next = tl.load(desc_ptr + rows * 3, mask=rmask, other=0)
            d_next = tl.load(desc_ptr + rows * 3 + 1, mask=rmask, other=0)
        elif MODE == 1:
            s_next = tl.load(desc_ptr + rows * 3, mask=rmask, other=0)
            d_next = sbase + tl.load(offs_ptr + rows, mask=rmask, other=0) - off0
        else:
            s_next = sbase + tl.load(offs_ptr + rows, mask=rmask, other=0) - off0
            d_next = tl.load(desc_ptr + rows * 3 + 1, mask=rmask, other=0)

        # ---- copy the previous item
        fast = (tl.max((s | d | n) & (ALIGN - 1), axis=0) == 0) & (ALIGN > 1)
        if fast:
            sw = s >> 2
            dw = d >> 2
            nw = n >> 2
            if ALIGN == 16:
                sw = tl.multiple_of(sw, 4)
                dw = tl.multiple_of(dw, 4)
                nw = tl.multiple_of(nw, 4)
            nch = tl.cdiv(tl.max(nw, axis=0), CH)
            for k in range(sl, nch, slices):
                c = tl.cast(k, tl.int64) * CH
                xs = ()
                for u in tl.static_range(UNROLL):
                    o = c + u * (W * 4) + cols
                    m = o[None, :] < nw[:, None]
                    xs = xs + (tl.load(sp + (sw[:, None] + o[None, :]), mask=m, cache_modifier=LOAD_CACHE),)
                for u in tl.static_range(UNROLL):
                    o = c + u * (W * 4) + cols
                    m = o[None, :] < nw[:, None]
                    tl.store(dp + (dw[:, None] + o[None, :]), xs[u], mask=m, cache_modifier=STORE_CACHE)
        else:
            nchb = tl.cdiv(tl.max(n, axis=0), BCH)
            for k in range(sl, nchb, slices):
                o = tl.cast(k, tl.int64) * BCH + cols
                m = o[None, :] < n[:, None]
                x = tl.load(src_ptr + (s[:, None] + o[None, :]), mask=m)
                tl.store(dst_ptr + (d[:, None] + o[None, :]), x, mask=m)
        s = s_next
        d = d_next
        n = n_next
        sl = sl_next
