"""The block-descriptor expansion kernel: block IDs + a registered layout -> copy descriptors.

A KV transfer names blocks, not bytes. Its layout is a table of *planes*, one per
(layer, piece of a block) -- the K or V half of a layer, one layer's slab, a packed
group's slab -- each with ``PLANE_FIELDS`` int64 fields::

    0 src_base    byte offset of the piece in source block 0 (from the source anchor)
    1 src_stride  bytes between two source blocks
    2 dst_base    ... in destination block 0 (from the destination anchor)
    3 dst_stride
    4 seg_bytes   bytes of one segment: the piece's share of the smaller block
    5 group       which group's block IDs the plane uses (index into the request's group fields)
    6 src_split   segments per source block (1, or the block-size ratio when the source blocks are larger)
    7 dst_split   segments per destination block
    8 src_blocks  source block IDs must be below this
    9 dst_blocks  destination block IDs must be below this

A *request* is one flat int64 array (uploaded per transfer)::

    [0, P]             plane_row[p]: the first output row of plane p (plane_row[P] = rows in all)
    [P+1, P+1+G)       segments of group g
    [P+1+G, P+1+2G)    where group g's source block IDs start in this array
    [P+1+2G, P+1+3G)   where its destination block IDs start
    then the block IDs

Segment ``j`` of plane ``p`` (group ``g``) becomes output row ``plane_row[p] + j``::

    src = src_base + src_ids[j // src_split] * src_stride + (j % src_split) * seg_bytes
    dst = dst_base + dst_ids[j // dst_split] * dst_stride + (j % dst_split) * seg_bytes

so tokens, not blocks, are matched when the two sides' block sizes differ (one
divides the other). The grid is ``(P, C)``, fixed by the caller whatever the request
holds: program ``(p, c)`` writes chunks ``c, c + C, c + 2C, ...`` of ``BLOCK`` segments of
plane ``p``, as many as the request's header says (so one grid serves every request an
output of ``n_rows`` rows can hold).

Bounds hold for any content of the request: only segments whose row lies in
``[0, n_rows)`` are visited (a forged count or first row bounds the loop by the output,
not by the header; a first row below ``-2**62`` leaves nothing), an ID index outside the request is not read, and a block ID outside
``[0, blocks)`` (or a group index outside ``[0, G)``) yields the row ``(0, 0, 0)``:
nothing is copied for it.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._jit import dual_kernel

PLANE_FIELDS = 10


@triton.jit
def segment_descs(req_ptr, j, on, soff, doff, rl, src_base, src_stride, dst_base, dst_stride, seg, rs, rd,
                  src_nb, dst_nb, SPLIT: tl.constexpr):
    """``(src, dst, nbytes)`` of segment ``j`` of a plane (the fields above; ``soff`` / ``doff``: where its
    group's IDs start in the request of ``rl`` entries) on the lanes ``on``; ``(0, 0, 0)`` elsewhere, where an
    ID index falls outside the request or an ID outside ``[0, blocks)``. Without ``SPLIT`` nothing is divided
    and a plane whose splits are not 1 gives ``(0, 0, 0)`` (shared by the expansion and the copy kernel's
    mode 5, so both name the same bytes)."""
    j = tl.where(on, j, 0)
    if SPLIT:
        sq = j // rs
        dq = j // rd
        s_part = (j - sq * rs) * seg
        d_part = (j - dq * rd) * seg
    else:
        on = on & (rs == 1) & (rd == 1)
        sq = j
        dq = j
        s_part = 0
        d_part = 0
    si_at = soff + sq
    di_at = doff + dq
    rd_ok = on & (si_at >= 0) & (si_at < rl) & (di_at >= 0) & (di_at < rl)
    si = tl.load(req_ptr + si_at, mask=rd_ok, other=-1)
    di = tl.load(req_ptr + di_at, mask=rd_ok, other=-1)
    ok = rd_ok & (si >= 0) & (si < src_nb) & (di >= 0) & (di < dst_nb)
    s = tl.where(ok, src_base + si * src_stride + s_part, 0)
    d = tl.where(ok, dst_base + di * dst_stride + d_part, 0)
    n = tl.where(ok, seg, 0)
    return s, d, n


@dual_kernel(do_not_specialize=["n_planes", "n_groups", "req_len", "n_rows"])
def expand_kernel(planes_ptr, req_ptr, out_ptr, n_planes, n_groups, req_len, n_rows, BLOCK: tl.constexpr):
    p = tl.cast(tl.program_id(0), tl.int64)
    c0 = tl.cast(tl.program_id(1), tl.int64)
    n_c = tl.cast(tl.num_programs(1), tl.int64)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    zero = lanes * 0
    pb = planes_ptr + p * 10
    src_base = zero + tl.load(pb + 0)
    src_stride = zero + tl.load(pb + 1)
    dst_base = zero + tl.load(pb + 2)
    dst_stride = zero + tl.load(pb + 3)
    seg = zero + tl.load(pb + 4)
    g = zero + tl.load(pb + 5)
    rs = tl.maximum(zero + tl.load(pb + 6), 1)
    rd = tl.maximum(zero + tl.load(pb + 7), 1)
    src_nb = zero + tl.load(pb + 8)
    dst_nb = zero + tl.load(pb + 9)
    ng = zero + n_groups
    rl = zero + req_len
    nr = zero + n_rows
    g_ok = (g >= 0) & (g < ng)
    gs = tl.where(g_ok, g, 0)
    np1 = zero + n_planes + 1
    head = (np1 + 3 * ng) <= rl
    row0 = tl.load(req_ptr + (zero + p), mask=head, other=0)
    nseg = tl.load(req_ptr + np1 + gs, mask=head & g_ok, other=0)
    soff = tl.load(req_ptr + np1 + ng + gs, mask=head & g_ok, other=0)
    doff = tl.load(req_ptr + np1 + 2 * ng + gs, mask=head & g_ok, other=0)
    # the segments whose rows lie in [0, n_rows): j in [j_lo, j_hi), computed without overflow
    # (a first row below -2^62 or past the output leaves nothing)
    far = (row0 < -(1 << 62)) | (row0 > nr)
    r0 = tl.where(far, 0, row0)
    j_lo = tl.where(r0 < 0, 0 - r0, 0)
    j_hi = tl.where(far | (head == 0) | (g_ok == 0), 0, tl.minimum(nseg, nr - r0))
    n_j = tl.maximum(j_hi - j_lo, 0)
    # chunks of this plane (every lane holds the same count; the loop bound is one of them)
    n_chunks = tl.max((n_j + BLOCK - 1) // BLOCK, axis=0)
    for c in range(c0, n_chunks, n_c):
        j = j_lo + c * BLOCK + lanes
        live = j < j_hi
        so, do, nb = segment_descs(req_ptr, j, live, soff, doff, rl, src_base, src_stride, dst_base, dst_stride,
                                   seg, rs, rd, src_nb, dst_nb, True)
        row = r0 + j
        tl.store(out_ptr + row * 3, so, mask=live)
        tl.store(out_ptr + row * 3 + 1, do, mask=live)
        tl.store(out_ptr + row * 3 + 2, nb, mask=live)
