"""Block IDs checked on the device: the two kernels a request whose IDs live on the device runs before its
expansion (:mod:`gpuxfer.kernels.block_kernel`), so that a bad request moves no byte.

The request array is the expansion's (header, then the IDs) with *check fields* between the header and the
IDs, at ``head = P + 1 + 3G``::

    [head]                 status: 0 when uploaded; the check ORs its findings in (CHECK_* bits)
    [head + 1]             1: the caller's IDs are int64; 0: int32
    [head + 2 + g]         group g's destination IDs in all (where the header says they start)
    [head + 2 + G + g]     where group g's pieces start in this array
    [head + 2 + 2G + g]    how many pieces it has
    a piece (4 entries):   0 (source IDs) or 1 (destination IDs), the address of a caller's tensor of them,
                           how many IDs it holds, where they go in this array

(one request: two pieces per group; several requests posted together: two per request and group, each
group's sources one after another, then its destinations in the same order)
and a *group table* ``gtab`` of ``(source blocks, destination blocks, mark offset)`` per group. ``marks`` is a
bitmap over every group's destination blocks (bit ``mark offset + ID``; groups whose destination memory
overlaps share their offsets), all zero between requests.

:func:`check_ids_kernel` (grid ``(G, C)``): program ``(g, c)`` reads group g's pieces -- the caller's IDs --
and writes them into the request as int64, checks every source ID in ``[0, source blocks)``, every
destination ID in ``[0, destination blocks)``, and each in-range destination sets its bit with an atomic OR:
a bit found set is a destination named twice. :func:`settle_ids_kernel` (the same grid, a later launch): clears the bits
the request set; where the status is not 0, program ``(0, 0)`` zeroes the header's first rows and segment
counts (entries ``[0, P + 1 + G)``), so the expansion writes nothing and every copy's row range is empty.

What describes the caller's tensors is the host's: it wrote, from tensors it checked, each piece's address
and count, the width of their integers and where the pieces are; the kernel reads ``count`` IDs from each.
Bounds hold for any other content of the request and of the group table: an ID position outside
``[0, req_len)`` is not written, a piece outside the request is not read, a mark word outside the bitmap is
not touched, a group past the table is not checked.
"""
from __future__ import annotations

import triton.language as tl

from ._jit import dual_kernel

#: status bits
CHECK_SOURCE_RANGE = 1
CHECK_DEST_RANGE = 2
CHECK_DEST_TWICE = 4
#: check fields before a request's IDs
CHECK_FIELDS_FIXED = 2
#: check fields per group: its destination IDs in all, where its pieces start and how many
CHECK_FIELDS_PER_GROUP = 3
#: entries of a piece: side, address, count, position
PIECE_FIELDS = 4
GROUP_TABLE_FIELDS = 3


@dual_kernel(do_not_specialize=["n_groups", "head", "req_len", "n_words"])
def check_ids_kernel(req_ptr, gtab_ptr, marks_ptr, n_groups, head, req_len, n_words, BLOCK: tl.constexpr):
    g = tl.cast(tl.program_id(0), tl.int64)
    c0 = tl.program_id(1)
    n_c = tl.num_programs(1)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    zero = lanes * 0
    rl = zero + req_len
    ng = zero + n_groups
    h = zero + head
    fields_ok = (h + 2 + 3 * ng <= rl) & (h >= 1 + 3 * ng) & (g < ng)
    gv = zero + g
    src_nb = tl.load(gtab_ptr + gv * 3, mask=fields_ok, other=0)
    dst_nb = tl.load(gtab_ptr + gv * 3 + 1, mask=fields_ok, other=0)
    moff = tl.load(gtab_ptr + gv * 3 + 2, mask=fields_ok, other=0)
    wide = tl.load(req_ptr + h + 1, mask=fields_ok, other=1) != 0
    first = tl.load(req_ptr + h + 2 + ng + gv, mask=fields_ok, other=0)
    count = tl.load(req_ptr + h + 2 + 2 * ng + gv, mask=fields_ok, other=0)
    # the pieces inside the request only
    count = tl.where(fields_ok & (first >= 0) & (first <= rl), tl.minimum(tl.maximum(count, 0), (rl - first) // 4), 0)
    n_pieces = tl.max(count, axis=0)
    at = tl.max(first, axis=0)
    # the IDs are written after every group's pieces only: a forged position never overwrites a field or a
    # piece (whose address another program reads)
    ids_from = h + 2 + 3 * ng
    for k in range(0, n_groups):
        fk = tl.load(req_ptr + h + 2 + ng + k, mask=fields_ok, other=0)
        ck = tl.load(req_ptr + h + 2 + 2 * ng + k, mask=fields_ok, other=0)
        ck = tl.where(fields_ok & (fk >= 0) & (fk <= rl), tl.minimum(tl.maximum(ck, 0), (rl - fk) // 4), 0)
        ids_from = tl.maximum(ids_from, tl.where(ck > 0, fk + 4 * ck, 0))
    bad_s = zero
    bad_d = zero
    dup = zero
    for q in range(0, n_pieces):
        e = zero + at + q * 4
        side = tl.load(req_ptr + e, mask=fields_ok, other=0)
        # where the caller's IDs are, and how many (the host wrote them from a tensor it checked)
        addr = tl.max(tl.load(req_ptr + e + 1, mask=fields_ok, other=0), axis=0)
        cnt = tl.load(req_ptr + e + 2, mask=fields_ok, other=0)
        pos = tl.load(req_ptr + e + 3, mask=fields_ok, other=0)
        is_dst = side != 0
        limit = tl.where(is_dst, dst_nb, src_nb)
        p64 = addr.to(tl.pointer_type(tl.int64))
        p32 = addr.to(tl.pointer_type(tl.int32))
        for start in range(c0 * BLOCK, tl.max(cnt, axis=0), n_c * BLOCK):
            j = start + lanes
            live = j < cnt
            v64 = tl.load(p64 + j, mask=live & wide, other=0)
            v32 = tl.load(p32 + j, mask=live & (wide == 0), other=0).to(tl.int64)
            v = tl.where(wide, v64, v32)
            rp = pos + j
            tl.store(req_ptr + rp, v, mask=live & (rp >= ids_from) & (rp < rl))
            out = live & ((v < 0) | (v >= limit))
            bad_s = tl.maximum(bad_s, tl.where(out & (is_dst == 0), 1, 0))
            bad_d = tl.maximum(bad_d, tl.where(out & is_dst, 1, 0))
            key = moff + v
            word = key >> 5
            d_ok = live & is_dst & (out == 0) & (key >= 0) & (word < n_words)
            bit = (tl.cast(1, tl.int32) << (key & 31).to(tl.int32))
            old = tl.atomic_or(marks_ptr + word, bit, mask=d_ok)
            dup = tl.maximum(dup, tl.where(d_ok & ((old & bit) != 0), 1, 0))
    bits = tl.max(bad_s, axis=0) * 1 + tl.max(bad_d, axis=0) * 2 + tl.max(dup, axis=0) * 4
    if bits != 0:
        tl.atomic_or(req_ptr + head, bits.to(tl.int64))


@dual_kernel(do_not_specialize=["n_groups", "head", "req_len", "n_words", "n_zero"])
def settle_ids_kernel(req_ptr, gtab_ptr, marks_ptr, n_groups, head, req_len, n_words, n_zero,
                      BLOCK: tl.constexpr):
    g = tl.cast(tl.program_id(0), tl.int64)
    c0 = tl.program_id(1)
    n_c = tl.num_programs(1)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    zero = lanes * 0
    rl = zero + req_len
    ng = zero + n_groups
    h = zero + head
    fields_ok = (h + 2 + 3 * ng <= rl) & (h >= 1 + 3 * ng) & (g < ng)
    gv = zero + g
    dst_nb = tl.load(gtab_ptr + gv * 3 + 1, mask=fields_ok, other=0)
    moff = tl.load(gtab_ptr + gv * 3 + 2, mask=fields_ok, other=0)
    doff = tl.load(req_ptr + h - ng + gv, mask=fields_ok, other=0)
    ld = tl.load(req_ptr + h + 2 + gv, mask=fields_ok, other=0)
    ld = tl.where(fields_ok, tl.minimum(tl.maximum(ld, 0), rl), 0)
    n = tl.max(ld, axis=0)
    for start in range(c0 * BLOCK, n, n_c * BLOCK):
        j = start + lanes
        dp = doff + j
        d_live = (j < ld) & (dp >= 0) & (dp < rl)
        dv = tl.load(req_ptr + dp, mask=d_live, other=-1)
        key = moff + dv
        word = key >> 5
        ok = d_live & (dv >= 0) & (dv < dst_nb) & (key >= 0) & (word < n_words)
        tl.store(marks_ptr + word, tl.cast(zero, tl.int32), mask=ok)
    if (g == 0) & (c0 == 0):
        status = tl.load(req_ptr + h, mask=h < rl, other=0)
        bad = status != 0
        nz = tl.minimum(zero + n_zero, tl.minimum(h, rl))
        for z in range(0, n_zero, BLOCK):
            i = z + lanes
            tl.store(req_ptr + i, zero, mask=bad & (i < nz))
