"""NumPy reference of every kernel: the pattern, copy, pack/unpack and verify.

Tests compare the Triton kernels against these, and the host emulation can use
them directly. Nothing here imports torch or Triton.

The pattern
-----------
Byte ``o`` of a pool filled with ``seed`` is byte ``o % 8`` (little-endian) of
``mix64(seed_key(seed) + o // 8)``, where ``mix64`` is the SplitMix64 finaliser
and ``seed_key`` mixes the seed the same way. Why it catches misrouted bytes:

* ``mix64`` is a bijection of 64-bit words (xor-shifts and odd multiplies are
  invertible), so for one seed the 8-byte word at every 8-aligned offset is
  different from the word at every other 8-aligned offset: the pattern never
  repeats within a pool (nor within any 2**67-byte range).
* A page copied from the wrong place *at a distance that is a multiple of 8*
  (every page misroute in a pool of 8-byte-multiple pages: neighbours, swaps,
  a stale block table) therefore differs in at least one byte of **every**
  8-byte word: it is caught deterministically, not by luck.
* A byte copied from any other offset (any distance, any alignment) compares
  two outputs of the hash at different inputs or different byte lanes, so it
  matches by accident with probability about 1/256; a misplaced run of ``k``
  bytes escapes with probability about ``256**-k`` (10**-1270 for a 528-byte page).
* An unwritten destination still holds the destination pool's own pattern,
  filled with another seed: ``seed_key`` of two seeds differ by a pseudo-random
  64-bit amount, so the two patterns line up only if that amount is smaller than
  the pool's word count (probability < 2**-30 for a 16 GiB pool) -- and even
  then only at one precise shift.
"""
from __future__ import annotations

import numpy as np

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MIX_M1 = 0xBF58476D1CE4E5B9
MIX_M2 = 0x94D049BB133111EB


def mix64_int(x: int) -> int:
    """SplitMix64's finaliser on a Python int (mod 2**64)."""
    x &= MASK64
    x ^= x >> 30
    x = (x * MIX_M1) & MASK64
    x ^= x >> 27
    x = (x * MIX_M2) & MASK64
    x ^= x >> 31
    return x


def seed_key(seed: int) -> int:
    """The 64-bit key of ``seed`` (any Python int); the kernels get it as a signed int64."""
    return mix64_int((int(seed) * GOLDEN + GOLDEN) & MASK64)


def seed_key_i64(seed: int) -> int:
    """:func:`seed_key` as a signed 64-bit value (how it is passed to a kernel)."""
    k = seed_key(seed)
    return k - (1 << 64) if k >= (1 << 63) else k


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on a uint64 array (wrapping arithmetic)."""
    x = np.asarray(x, dtype=np.uint64).copy()
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(MIX_M1)
        x ^= x >> np.uint64(27)
        x *= np.uint64(MIX_M2)
        x ^= x >> np.uint64(31)
    return x


def pattern(seed: int, start: int, nbytes: int) -> np.ndarray:
    """Pattern bytes at pool offsets ``start .. start + nbytes`` (uint8 array)."""
    if start < 0 or nbytes < 0:
        raise ValueError(f"bad range start={start} nbytes={nbytes}")
    if nbytes == 0:
        return np.zeros(0, dtype=np.uint8)
    w0 = start >> 3
    w1 = (start + nbytes + 7) >> 3
    words = np.arange(w0, w1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        words += np.uint64(seed_key(seed))
    h = mix64(words).astype("<u8", copy=False)
    b = h.view(np.uint8)
    lo = start & 7
    return b[lo:lo + nbytes].copy()


def pattern_at(seed: int, offsets: np.ndarray) -> np.ndarray:
    """Pattern bytes at arbitrary pool offsets (an int array of any shape)."""
    o = np.asarray(offsets, dtype=np.int64)
    if o.size and o.min() < 0:
        raise ValueError("negative pool offset")
    ou = o.astype(np.uint64)
    with np.errstate(over="ignore"):
        h = mix64((ou >> np.uint64(3)) + np.uint64(seed_key(seed)))
    return ((h >> ((ou & np.uint64(7)) << np.uint64(3))) & np.uint64(0xFF)).astype(np.uint8)


def fill(pool: np.ndarray, seed: int, start: int = 0, nbytes: int | None = None) -> None:
    """Write the pattern of ``seed`` over ``pool[start:start + nbytes]`` in place."""
    if nbytes is None:
        nbytes = pool.size - start
    pool[start:start + nbytes] = pattern(seed, start, nbytes)


def check_descs(descs) -> np.ndarray:
    d = np.ascontiguousarray(descs, dtype=np.int64)
    if d.ndim != 2 or d.shape[1] != 3:
        raise ValueError(f"descriptor table must have shape (N, 3), got {d.shape}")
    return d


def pack_offsets(descs) -> np.ndarray:
    """Exclusive cumulative sum of the sizes: N + 1 int64 values, the last is the total."""
    d = check_descs(descs)
    out = np.zeros(d.shape[0] + 1, dtype=np.int64)
    np.cumsum(d[:, 2], out=out[1:])
    return out


def copy(src: np.ndarray, dst: np.ndarray, descs) -> None:
    """``dst[d:d+n] = src[s:s+n]`` for every descriptor (in order)."""
    for s, d, n in check_descs(descs).tolist():
        dst[d:d + n] = src[s:s + n]


def pack(src: np.ndarray, descs, start: int = 0, end: int | None = None) -> np.ndarray:
    """The bytes of ``descs[start:end]``'s sources, back to back."""
    d = check_descs(descs)[start:end]
    if d.shape[0] == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.concatenate([src[s:s + n] for s, _, n in d.tolist()]).astype(np.uint8, copy=False)


def unpack(staging: np.ndarray, dst: np.ndarray, descs, start: int = 0, end: int | None = None) -> None:
    """Scatter ``staging`` (as :func:`pack` laid it out) to ``descs[start:end]``'s destinations."""
    pos = 0
    for _, d, n in check_descs(descs)[start:end].tolist():
        dst[d:d + n] = staging[pos:pos + n]
        pos += n


def verify_guard(dst: np.ndarray, descs, seed: int) -> tuple[int, int, int]:
    """Check every byte of ``dst`` that no descriptor's destination covers against the pattern of
    ``seed`` at its own offset (``dst`` was filled with ``seed`` before the transfer).

    Returns ``(wrong_bytes, first_bad, checked)``: the number of such bytes that differ, the
    pool offset of the first (-1 if none) and the number of bytes checked. Descriptors must lie
    inside ``dst``.
    """
    d = check_descs(descs)
    size = int(dst.size)
    edges = np.zeros(size + 1, dtype=np.int64)           # +1 where a destination starts, -1 where it ends
    np.add.at(edges, d[:, 1], 1)
    np.add.at(edges, d[:, 1] + d[:, 2], -1)
    outside = np.cumsum(edges[:-1]) == 0
    bad = outside & (dst != pattern(seed, 0, size))
    wrong = int(bad.sum())
    return wrong, int(np.argmax(bad)) if wrong else -1, int(outside.sum())


def verify(dst: np.ndarray, descs, seed: int) -> tuple[int, int]:
    """Check ``dst[d:d+n]`` against the pattern of ``seed`` at ``s .. s+n`` for every descriptor.

    Returns ``(wrong_bytes, first_bad)``: the number of wrong bytes and the index of
    the first descriptor holding one (-1 if none).
    """
    d = check_descs(descs)
    n = d[:, 2]
    total = int(n.sum())
    if total == 0:
        return 0, -1
    desc_id = np.repeat(np.arange(d.shape[0], dtype=np.int64), n)
    starts = np.repeat(pack_offsets(d)[:-1], n)
    within = np.arange(total, dtype=np.int64) - starts
    got = dst[np.repeat(d[:, 1], n) + within]
    want = pattern_at(seed, np.repeat(d[:, 0], n) + within)
    bad = got != want
    wrong = int(bad.sum())
    first = int(desc_id[np.argmax(bad)]) if wrong else -1
    return wrong, first


def expand_blocks(planes, request, n_groups: int, n_rows: int, out: np.ndarray | None = None) -> np.ndarray:
    """NumPy reference of :func:`gpuxfer.kernels.blocks.expand_blocks` (same masking rules):
    the ``(n_rows, 3)`` descriptors of ``request`` over ``planes`` (rows no plane covers keep
    ``out``'s values, zeros by default)."""
    planes = np.asarray(planes, dtype=np.int64).reshape(-1, 10)
    req = np.asarray(request, dtype=np.int64).reshape(-1)
    out = np.zeros((n_rows, 3), dtype=np.int64) if out is None else out
    n_planes, rl = planes.shape[0], req.shape[0]
    np1 = n_planes + 1
    if np1 + 3 * n_groups > rl:
        return out
    for p in range(n_planes):
        sb, ss, db, ds, seg, g, rs, rd, snb, dnb = (int(v) for v in planes[p])
        if not 0 <= g < n_groups:
            continue
        rs, rd = max(rs, 1), max(rd, 1)
        row0, nseg = int(req[p]), int(req[np1 + g])
        soff, doff = int(req[np1 + n_groups + g]), int(req[np1 + 2 * n_groups + g])
        for j in range(max(nseg, 0)):
            row = row0 + j
            if not 0 <= row < n_rows:
                continue
            si_at, di_at = soff + j // rs, doff + j // rd
            si = int(req[si_at]) if 0 <= si_at < rl else -1
            di = int(req[di_at]) if 0 <= di_at < rl else -1
            if 0 <= si < snb and 0 <= di < dnb:
                out[row] = (sb + si * ss + (j % rs) * seg, db + di * ds + (j % rd) * seg, seg)
            else:
                out[row] = (0, 0, 0)
    return out


def block_rows(planes, request, n_groups: int, plane_lo: int, plane_hi: int, max_rows: int,
               splits: bool = True) -> tuple[int, np.ndarray]:
    """NumPy reference of the copy kernel's mode 5 (:func:`gpuxfer.kernels.launch.copy_blocks_launcher`):
    ``(first, descs)``, the rows ``[first, first + len(descs))`` it copies and their ``(src, dst, nbytes)``.

    The rows are ``[request[plane_lo], request[plane_hi])`` clamped into ``[0, max_rows)``; a row's plane is the
    last ``p`` of ``[plane_lo, plane_hi)`` with ``request[p] <= row`` by the kernel's bisection (the first of the
    range when none); then the expansion's rules (:func:`expand_blocks`) for segment ``row - request[p]`` of
    plane ``p``, ``(0, 0, 0)`` where they give nothing (and, without ``splits``, for a plane that splits a block)."""
    planes = np.asarray(planes, dtype=np.int64).reshape(-1, 10)
    req = [int(v) for v in np.asarray(request, dtype=np.int64).reshape(-1)]
    rl, np1 = len(req), planes.shape[0] + 1
    lo = min(max(req[plane_lo], 0), max_rows)
    hi = min(max(req[plane_hi], lo), max_rows)
    out = np.zeros((hi - lo, 3), dtype=np.int64)
    for row in range(lo, hi):
        base, cnt = plane_lo, plane_hi - plane_lo
        while cnt > 1:
            half = cnt // 2
            if req[base + half] <= row:
                base += half
            cnt -= half
        sb, ss, db, ds, seg, g, rs, rd, snb, dnb = (int(v) for v in planes[base])
        row0 = req[base]
        if not 0 <= g < n_groups or row0 < -(1 << 62) or (not splits and max(rs, rd) > 1):
            continue
        rs, rd = max(rs, 1), max(rd, 1)
        j = row - row0
        if not 0 <= j < req[np1 + g]:
            continue
        si_at, di_at = req[np1 + n_groups + g] + j // rs, req[np1 + 2 * n_groups + g] + j // rd
        si = req[si_at] if 0 <= si_at < rl else -1
        di = req[di_at] if 0 <= di_at < rl else -1
        if 0 <= si < snb and 0 <= di < dnb:
            out[row - lo] = (sb + si * ss + (j % rs) * seg, db + di * ds + (j % rd) * seg, seg)
    return lo, out
