"""Block IDs checked on the device: the two kernels a request whose IDs live on the device runs before its
expansion (:mod:`gpuxfer.kernels.block_kernel`), so that a bad request moves no byte.

The request array is the expansion's (header, then the IDs) with *check fields* between the header and the
IDs, at ``head = P + 1 + 3G``::

    [head]                 status: 0 when uploaded; the check ORs its findings in (CHECK_* bits)
    [head + 1]             1: the caller's IDs are int64; 0: int32
    [head + 2 + g]         group g's source IDs: how many
    [head + 2 + G + g]     ... destination IDs: how many
    [head + 2 + 2G + g]    the address of the caller's tensor of group g's source IDs
    [head + 2 + 3G + g]    ... of its destination IDs

and a *group table* ``gtab`` of ``(source blocks, destination blocks, mark offset)`` per group. ``marks`` is a
bitmap over every group's destination blocks (bit ``mark offset + ID``; groups whose destination memory
overlaps share their offsets), all zero between requests.

:func:`check_ids_kernel` (grid ``(G, C)``): reads the caller's IDs and writes them into the request as int64
(where the header says group g's IDs start), checks every source ID in ``[0, source blocks)``, every
destination ID in ``[0, destination blocks)``, and each in-range destination sets its bit with an atomic OR:
a bit found set is a destination named twice. :func:`settle_ids_kernel` (the same grid, a later launch): clears the bits
the request set; where the status is not 0, program ``(0, 0)`` zeroes the header's first rows and segment
counts (entries ``[0, P + 1 + G)``), so the expansion writes nothing and every copy's row range is empty.

The addresses and counts are the host's: it wrote them from tensors it checked (on the device, of that
many IDs each), and the kernel reads ``count`` IDs from each. Bounds hold for any other content of the
request and of the group table: an ID position outside ``[0, req_len)`` is not written, a mark word outside
the bitmap is not touched, a group past the table is not checked.
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
#: check fields per group: source and destination counts and addresses
CHECK_FIELDS_PER_GROUP = 4
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
    fields_ok = (h + 2 + 4 * ng <= rl) & (h >= 1 + 3 * ng) & (g < ng)
    gv = zero + g
    src_nb = tl.load(gtab_ptr + gv * 3, mask=fields_ok, other=0)
    dst_nb = tl.load(gtab_ptr + gv * 3 + 1, mask=fields_ok, other=0)
    moff = tl.load(gtab_ptr + gv * 3 + 2, mask=fields_ok, other=0)
    wide = tl.load(req_ptr + h + 1, mask=fields_ok, other=1) != 0
    soff = tl.load(req_ptr + h - 2 * ng + gv, mask=fields_ok, other=0)
    doff = tl.load(req_ptr + h - ng + gv, mask=fields_ok, other=0)
    ls = tl.load(req_ptr + h + 2 + gv, mask=fields_ok, other=0)
    ld = tl.load(req_ptr + h + 2 + ng + gv, mask=fields_ok, other=0)
    ls = tl.where(fields_ok, tl.maximum(ls, 0), 0)
    ld = tl.where(fields_ok, tl.maximum(ld, 0), 0)
    # where the caller's IDs are (the host wrote the addresses of the tensors it checked, ls / ld IDs each)
    s_at = tl.max(tl.load(req_ptr + h + 2 + 2 * ng + gv, mask=fields_ok, other=0), axis=0)
    d_at = tl.max(tl.load(req_ptr + h + 2 + 3 * ng + gv, mask=fields_ok, other=0), axis=0)
    s64p = s_at.to(tl.pointer_type(tl.int64))
    s32p = s_at.to(tl.pointer_type(tl.int32))
    d64p = d_at.to(tl.pointer_type(tl.int64))
    d32p = d_at.to(tl.pointer_type(tl.int32))
    n = tl.max(tl.maximum(ls, ld), axis=0)
    bad_s = zero
    bad_d = zero
    dup = zero
    for start in range(c0 * BLOCK, n, n_c * BLOCK):
        j = start + lanes
        # sources: read from the caller's tensor, written into the request as int64
        s_in = j < ls
        s64 = tl.load(s64p + j, mask=s_in & wide, other=0)
        s32 = tl.load(s32p + j, mask=s_in & (wide == 0), other=0).to(tl.int64)
        sv = tl.where(wide, s64, s32)
        sp = soff + j
        tl.store(req_ptr + sp, sv, mask=s_in & (sp >= 0) & (sp < rl))
        bad_s = tl.maximum(bad_s, tl.where(s_in & ((sv < 0) | (sv >= src_nb)), 1, 0))
        # destinations
        d_in = j < ld
        d64 = tl.load(d64p + j, mask=d_in & wide, other=0)
        d32 = tl.load(d32p + j, mask=d_in & (wide == 0), other=0).to(tl.int64)
        dv = tl.where(wide, d64, d32)
        dp = doff + j
        tl.store(req_ptr + dp, dv, mask=d_in & (dp >= 0) & (dp < rl))
        d_bad = d_in & ((dv < 0) | (dv >= dst_nb))
        key = moff + dv
        word = key >> 5
        d_ok = d_in & (d_bad == 0) & (key >= 0) & (word < n_words)
        bit = (tl.cast(1, tl.int32) << (key & 31).to(tl.int32))
        old = tl.atomic_or(marks_ptr + word, bit, mask=d_ok)
        twice = d_ok & ((old & bit) != 0)
        bad_d = tl.maximum(bad_d, tl.where(d_bad, 1, 0))
        dup = tl.maximum(dup, tl.where(twice, 1, 0))
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
    fields_ok = (h + 2 + 4 * ng <= rl) & (h >= 1 + 3 * ng) & (g < ng)
    gv = zero + g
    dst_nb = tl.load(gtab_ptr + gv * 3 + 1, mask=fields_ok, other=0)
    moff = tl.load(gtab_ptr + gv * 3 + 2, mask=fields_ok, other=0)
    doff = tl.load(req_ptr + h - ng + gv, mask=fields_ok, other=0)
    ld = tl.load(req_ptr + h + 2 + ng + gv, mask=fields_ok, other=0)
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
