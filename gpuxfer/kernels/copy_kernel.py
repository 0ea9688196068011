"""The descriptor-copy kernel (copy, pack, unpack and the copy of a KV request's blocks are modes of it).

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
* A **step** loads ``UNROLL`` chunks of ``W`` 16-byte units from each of the ROWS
  descriptors -- ``ROWS * W * 16 * UNROLL`` bytes, 16-74 KiB -- before storing any of
  them. A remote read over NVLink takes microseconds, so a program is latency
  bound: its throughput is the bytes it keeps in flight divided by that latency.
  That, not the number of programs, is what lets a few SMs reach the link's ceiling.
* The kernel keeps **two steps in flight**: it issues the loads of step ``i + 1``
  before the stores of step ``i`` (the loop body holds two steps, ping-pong, so no
  register holding an in-flight load is ever copied), and it prefetches the next
  item's descriptors one step ahead. A bounded grid of 16 programs pulled
  2,304-byte pages at ~89% of the copy-engine ceiling on 2x H200, against ~84% for
  the same tiles one step at a time.
* The state machine is a ``while`` loop on purpose: a one-step version written as
  a persistent ``for`` loop carrying the descriptors as ``iter_args`` was
  miscompiled by Triton 3.6 (its layout passes replaced the loop-carried row
  vectors by their initial values: nothing copied on the byte path, slices lost).
* 16-byte vector accesses (``ld/st.global.v4.b32``) when a group's offsets and
  sizes and both pool bases are 16-byte aligned (checked per group at run time);
  4-byte accesses when the launcher found everything 4-byte aligned (``ALIGN=4``);
  a byte-wise path for any other group (any size, any alignment; ``ALIGN=1``, pool
  bases not 4-byte aligned, takes it for every group). Offsets are int64.

Modes (``MODE``, a compile-time constant):

* 0 -- copy: ``dst[d:d+n] = src[s:s+n]``.
* 1 -- pack: the destination is a staging buffer; row ``i``'s bytes go to
  ``staging_base + offs[i] - offs[row_begin]`` (``offs`` = exclusive cumsum of sizes).
* 2 -- unpack: the source is the staging buffer, laid out as pack wrote it.
* 3 -- pack, rows of one size: row ``i``'s bytes go to ``staging_base + (i - row_begin) * row_bytes``
  (no offsets to read); a row holding more than ``row_bytes`` is cut at ``row_bytes``, so no row
  leaves its place.
* 4 -- unpack of what mode 3 packed.
* 5 -- copy of the blocks a KV request array names, with no descriptor table: ``desc_ptr`` is the request
  array and ``offs_ptr`` the plane table of :mod:`gpuxfer.kernels.block_kernel`; each work item derives its
  rows' ``(src, dst, nbytes)`` as the expansion kernel would have written them (``_block_rows``), so one
  launch replaces the expansion and the descriptor copy and no ``(N, 3)`` buffer exists. Always with
  ``DEVICE_RANGE``: ``lo_at``/``hi_at`` are the launch's planes ``[p_lo, p_hi)``, whose rows are
  ``[plane_row[p_lo], plane_row[p_hi])`` of the header. A row finds its plane, segment and IDs so::

      request array                                                plane table (P rows)
      +------------------+---------+-----------+-----------+-----------+   +--------------------------+
      | plane_row[0..P]  | nseg[G] | src_at[G] | dst_at[G] | block IDs |   | p: bases, strides, seg,  |
      +------------------+---------+-----------+-----------+-----------+   |   group g, splits, blocks|
                                                                           +--------------------------+
      row r:
        1. p   = the last plane of [p_lo, p_hi) with plane_row[p] <= r   (bisection: SEARCH probes)
        2. g   = planes[p].group;  j = r - plane_row[p];  live when 0 <= j < nseg[g]
        3. sid = request[src_at[g] + j // src_split];  did = request[dst_at[g] + j // dst_split]
        4. (src, dst, nbytes) = (src_base + sid * src_stride + (j % src_split) * seg_bytes,
                                 dst_base + did * dst_stride + (j % dst_split) * seg_bytes, seg_bytes)

  with the expansion's masking: a plane naming no group, a first row below ``-2**62``, ``j`` outside
  ``[0, nseg)``, an ID index outside the request or an ID outside ``[0, blocks)`` gives ``(0, 0, 0)``
  (nothing copied). The bisection takes ``SEARCH`` = ceil(log2(p_hi - p_lo)) steps, each probe inside
  ``[p_lo, p_hi)`` whatever the header holds; where a forged header has two planes claim a row, it takes
  the one the bisection finds. Without ``SPLIT`` (the launcher's planes split no block) steps 3 and 4
  divide by nothing, and a plane whose splits are not 1 gives ``(0, 0, 0)``.

Row ranges: the rows ``[row_begin, row_begin + n_rows)`` and their split into
``n_items`` work items of ``slices`` slices are launch arguments; with ``DEVICE_RANGE``
(a compile-time constant) the kernel reads the range instead from ``bounds[lo_at]`` and
``bounds[hi_at]`` on the device, clamps it into ``[0, n_rows)`` (then the number of rows
of the table) and derives the items and slices from it and the grid the way the
launchers do, so one launch with fixed arguments serves every range a request writes
there.

Destinations must not overlap (the order of the copies is unspecified).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._jit import dual_kernel
from .block_kernel import segment_descs


@triton.jit
def _item_descs(desc_ptr, offs_ptr, rb, nr, sbase, off0, rowb, blk, it, n_items, slices, lanes,
                MODE: tl.constexpr, ROWS: tl.constexpr, SEARCH: tl.constexpr, SPLIT: tl.constexpr):
    """Row descriptors (s, d, n in bytes; zeros past the end) and slice of work item ``it``."""
    grp = it // slices
    sl = it - grp * slices
    r = tl.cast(grp, tl.int64) * ROWS + lanes
    rmask = (r < nr) & ((lanes * 0 + it) < n_items)   # a tensor, not tensor & scalar (Triton 3.9's interpreter)
    rows = rb + r
    if MODE == 5:
        s, d, n = _block_rows(desc_ptr, offs_ptr, rows, rmask, blk, SEARCH, SPLIT)
    elif MODE == 0:
        n = tl.load(desc_ptr + rows * 3 + 2, mask=rmask, other=0)
        s = tl.load(desc_ptr + rows * 3, mask=rmask, other=0)
        d = tl.load(desc_ptr + rows * 3 + 1, mask=rmask, other=0)
    elif MODE == 1:
        n = tl.load(desc_ptr + rows * 3 + 2, mask=rmask, other=0)
        s = tl.load(desc_ptr + rows * 3, mask=rmask, other=0)
        d = sbase + tl.load(offs_ptr + rows, mask=rmask, other=0) - off0
    elif MODE == 2:
        n = tl.load(desc_ptr + rows * 3 + 2, mask=rmask, other=0)
        s = sbase + tl.load(offs_ptr + rows, mask=rmask, other=0) - off0
        d = tl.load(desc_ptr + rows * 3 + 1, mask=rmask, other=0)
    elif MODE == 3:
        n = tl.minimum(tl.load(desc_ptr + rows * 3 + 2, mask=rmask, other=0), rowb)
        s = tl.load(desc_ptr + rows * 3, mask=rmask, other=0)
        d = sbase + r * rowb
    else:
        n = tl.minimum(tl.load(desc_ptr + rows * 3 + 2, mask=rmask, other=0), rowb)
        s = sbase + r * rowb
        d = tl.load(desc_ptr + rows * 3 + 1, mask=rmask, other=0)
    return s, d, n, sl


@triton.jit
def _block_rows(req_ptr, planes_ptr, rows, live, blk, SEARCH: tl.constexpr, SPLIT: tl.constexpr):
    """Mode 5: the descriptors of output rows ``rows`` (``live`` lanes) of a request array, as the expansion
    kernel (:mod:`gpuxfer.kernels.block_kernel`) would have written them, with its masking rules.

    ``blk`` = (first plane, end plane, first group field, groups, request entries). The row's plane is the last
    plane ``p`` of ``[first, end)`` with ``plane_row[p] <= row`` (a bisection of ``SEARCH`` steps, every probe
    inside the range whatever the header holds; a header whose rows do not grow lands somewhere in it); then
    segment ``j = row - plane_row[p]`` is live when ``0 <= j < segments of p's group``."""
    p_lo, p_hi, np1, ng, rl = blk
    base = rows * 0 + p_lo
    cnt = p_hi - p_lo
    for _ in tl.static_range(SEARCH):
        half = cnt // 2
        probe = tl.load(req_ptr + base + half, mask=live, other=0)
        base = tl.where(probe <= rows, base + half, base)
        cnt = cnt - half
    pb = planes_ptr + base * 10
    row0 = tl.load(req_ptr + base, mask=live, other=0)
    src_base = tl.load(pb + 0, mask=live, other=0)
    src_stride = tl.load(pb + 1, mask=live, other=0)
    dst_base = tl.load(pb + 2, mask=live, other=0)
    dst_stride = tl.load(pb + 3, mask=live, other=0)
    seg = tl.load(pb + 4, mask=live, other=0)
    g = tl.load(pb + 5, mask=live, other=-1)
    rs = tl.maximum(tl.load(pb + 6, mask=live, other=1), 1)
    rd = tl.maximum(tl.load(pb + 7, mask=live, other=1), 1)
    src_nb = tl.load(pb + 8, mask=live, other=0)
    dst_nb = tl.load(pb + 9, mask=live, other=0)
    g_ok = live & (g >= 0) & (g < ng)
    gs = tl.where(g_ok, g, 0)
    nseg = tl.load(req_ptr + np1 + gs, mask=g_ok, other=0)
    soff = tl.load(req_ptr + np1 + ng + gs, mask=g_ok, other=0)
    doff = tl.load(req_ptr + np1 + 2 * ng + gs, mask=g_ok, other=0)
    # the expansion's rule: a first row below -2^62 leaves nothing (so row - row0 cannot overflow)
    near = g_ok & (row0 >= -(1 << 62))
    j = tl.where(near, rows - row0, -1)
    on = near & (j >= 0) & (j < nseg)
    return segment_descs(req_ptr, j, on, soff, doff, rl, src_base, src_stride, dst_base, dst_stride, seg, rs, rd,
                         src_nb, dst_nb, SPLIT)


@triton.jit
def _step(src_ptr, dst_ptr, sp, dp, desc_ptr, offs_ptr, rb, nr, sbase, off0, rowb, blk, n_items, slices, G, lanes,
          cols, it, k, s, d, n, sl, ps, pd, pn, psl, qd, qn, qc, qxs,
          MODE: tl.constexpr, ALIGN: tl.constexpr, ROWS: tl.constexpr, W: tl.constexpr, UNROLL: tl.constexpr,
          LOAD_CACHE: tl.constexpr, STORE_CACHE: tl.constexpr, SEARCH: tl.constexpr, SPLIT: tl.constexpr):
    """One pipelined step: load chunk ``k`` of item ``it``, then store the pending chunk
    ``(qd, qn, qc, qxs)``, then advance. Returns the new state and the new pending chunk.

    Offsets in ``qd``/``qn``/``qc`` are in ALIGN-byte units (so the stores know their alignment
    even across the loop's back edge)."""
    VEC: tl.constexpr = 4 if ALIGN == 16 else 1      # int32 lanes per unit (ALIGN 16 or 4; 1: never fast)
    LOG: tl.constexpr = 4 if ALIGN == 16 else 2
    STEP_U: tl.constexpr = (W * 4 // VEC) * UNROLL   # units per row per step
    valid = it < n_items
    # one reduction: the largest size, or "huge" if a row is not ALIGN-aligned
    mis = (s | d | n) & (ALIGN - 1)
    big = tl.max(tl.where(mis != 0, 1 << 62, n), axis=0)
    fast = (big < (1 << 62)) & valid & (ALIGN > 1)
    su = s >> LOG
    du = d >> LOG
    nu = n >> LOG
    nch = tl.cdiv(big >> LOG, STEP_U)
    cu = tl.cast(k, tl.int64) * STEP_U
    # ---- issue this step's loads
    xs = ()
    lim = tl.where(fast, nu * VEC, 0)      # no loads unless fast (a tensor bound: Triton 3.9's interpreter
    for u in tl.static_range(UNROLL):      # refuses tensor & scalar masks)
        o = (cu + u * (W * 4 // VEC)) * VEC + cols
        m = o[None, :] < lim[:, None]
        xs = xs + (tl.load(sp + ((su * VEC)[:, None] + o[None, :]), mask=m, cache_modifier=LOAD_CACHE),)
    # ---- a group that is not aligned: byte-wise, whole item, not pipelined
    if (fast == 0) & valid:
        nchb = tl.cdiv(tl.max(n, axis=0), W * 4)
        for kb in range(sl, nchb, slices):
            ob = tl.cast(kb, tl.int64) * (W * 4) + cols
            mb = ob[None, :] < n[:, None]
            xb = tl.load(src_ptr + (s[:, None] + ob[None, :]), mask=mb)
            tl.store(dst_ptr + (d[:, None] + ob[None, :]), xb, mask=mb)
    # ---- store the pending chunk (loaded one step ago)
    for u in tl.static_range(UNROLL):
        o = (qc + u * (W * 4 // VEC)) * VEC + cols
        m = o[None, :] < (qn * VEC)[:, None]
        tl.store(dp + ((qd * VEC)[:, None] + o[None, :]), qxs[u], mask=m, cache_modifier=STORE_CACHE)
    # ---- advance
    k2 = k + slices
    adv = (k2 >= nch) | (fast == 0)
    it2 = tl.where(adv, it + G, it)
    k3 = tl.where(adv, psl, k2)
    s2 = tl.where(adv, ps, s)
    d2 = tl.where(adv, pd, d)
    n2 = tl.where(adv, pn, n)
    sl2 = tl.where(adv, psl, sl)
    # prefetch the descriptors of the item after the (new) current one
    ps2, pd2, pn2, psl2 = _item_descs(desc_ptr, offs_ptr, rb, nr, sbase, off0, rowb, blk, it2 + G, n_items, slices,
                                      lanes, MODE, ROWS, SEARCH, SPLIT)
    qn2 = tl.where(fast, nu, 0)
    return it2, k3, s2, d2, n2, sl2, ps2, pd2, pn2, psl2, du, qn2, cu, xs


@dual_kernel(do_not_specialize=["row_begin", "n_rows", "staging_base", "n_items", "slices", "lo_at", "hi_at",
                                 "row_bytes", "n_planes", "n_groups", "req_len"])
def copy_kernel(src_ptr, dst_ptr, desc_ptr, offs_ptr,
                row_begin, n_rows, staging_base, n_items, slices, bounds_ptr, lo_at, hi_at, row_bytes,
                n_planes, n_groups, req_len,
                MODE: tl.constexpr, ALIGN: tl.constexpr, ROWS: tl.constexpr, W: tl.constexpr,
                UNROLL: tl.constexpr, LOAD_CACHE: tl.constexpr, STORE_CACHE: tl.constexpr,
                DEVICE_RANGE: tl.constexpr, SEARCH: tl.constexpr, SPLIT: tl.constexpr):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    sp = src_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    dp = dst_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    cols = tl.arange(0, W * 4)
    lanes = tl.arange(0, ROWS)
    if DEVICE_RANGE:
        cap = tl.cast(n_rows, tl.int64)
        lo = tl.minimum(tl.maximum(tl.load(bounds_ptr + lo_at), 0), cap)
        hi = tl.minimum(tl.maximum(tl.load(bounds_ptr + hi_at), lo), cap)
        rb = lo
        nr = hi - lo
        groups = (nr + ROWS - 1) // ROWS
        slices = tl.where(groups >= G, 1, tl.minimum((G + groups - 1) // tl.maximum(groups, 1), 1 << 16))
        n_items = groups * slices
    else:
        rb = tl.cast(row_begin, tl.int64)
        nr = tl.cast(n_rows, tl.int64)
    sbase = tl.cast(staging_base, tl.int64)
    off0 = tl.cast(0, tl.int64)
    rowb = tl.cast(row_bytes, tl.int64)
    # mode 5's request geometry: (first plane, end plane, first group field, groups, request entries)
    blk = (tl.cast(lo_at, tl.int64), tl.cast(hi_at, tl.int64), tl.cast(n_planes, tl.int64) + 1,
           tl.cast(n_groups, tl.int64), tl.cast(req_len, tl.int64))
    if MODE == 1:
        off0 = tl.load(offs_ptr + rb)
    if MODE == 2:
        off0 = tl.load(offs_ptr + rb)
    it = pid
    s, d, n, sl = _item_descs(desc_ptr, offs_ptr, rb, nr, sbase, off0, rowb, blk, it, n_items, slices, lanes,
                              MODE, ROWS, SEARCH, SPLIT)
    ps, pd, pn, psl = _item_descs(desc_ptr, offs_ptr, rb, nr, sbase, off0, rowb, blk, it + G, n_items, slices,
                                  lanes, MODE, ROWS, SEARCH, SPLIT)
    k = sl
    qd = tl.zeros([ROWS], tl.int64)
    qn = tl.zeros([ROWS], tl.int64)
    qc = tl.cast(0, tl.int64)
    qxs = ()
    for u in tl.static_range(UNROLL):
        qxs = qxs + (tl.zeros([ROWS, W * 4], tl.int32),)
    while it < n_items:
        # two steps per iteration (ping-pong), so a chunk's registers are never copied
        # while its loads are in flight
        it, k, s, d, n, sl, ps, pd, pn, psl, ad, an, ac, axs = _step(
            src_ptr, dst_ptr, sp, dp, desc_ptr, offs_ptr, rb, nr, sbase, off0, rowb, blk, n_items, slices, G, lanes,
            cols,
            it, k, s, d, n, sl, ps, pd, pn, psl, qd, qn, qc, qxs,
            MODE, ALIGN, ROWS, W, UNROLL, LOAD_CACHE, STORE_CACHE, SEARCH, SPLIT)
        it, k, s, d, n, sl, ps, pd, pn, psl, qd, qn, qc, qxs = _step(
            src_ptr, dst_ptr, sp, dp, desc_ptr, offs_ptr, rb, nr, sbase, off0, rowb, blk, n_items, slices, G, lanes,
            cols,
            it, k, s, d, n, sl, ps, pd, pn, psl, ad, an, ac, axs,
            MODE, ALIGN, ROWS, W, UNROLL, LOAD_CACHE, STORE_CACHE, SEARCH, SPLIT)
    VEC: tl.constexpr = 4 if ALIGN == 16 else 1
    for u in tl.static_range(UNROLL):
        o = (qc + u * (W * 4 // VEC)) * VEC + cols
        m = o[None, :] < (qn * VEC)[:, None]
        tl.store(dp + ((qd * VEC)[:, None] + o[None, :]), qxs[u], mask=m, cache_modifier=STORE_CACHE)
