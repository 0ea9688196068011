"""The pack engine's verdict kernel: whether the two sides of a two-sided transfer posted the same request,
decided on the device before any byte of the destination's blocks is written.

Each side's request carries a fingerprint (a 64-bit hash over its groups, block IDs and layers, computed
alike on both sides; always in ``[1, REFUSED)``). One launch reads a flag word the peer wrote (``word``)
and this side's fingerprint (``fp``), and decides:

* ``EQUAL`` (the source, on the destination's go signal carrying its fingerprint): refused when the
  word differs from the fingerprint;
* else (the destination on the source's first chunk signal; the source on the destination's last free
  signal): refused when the word is ``REFUSED`` or more (the peer refused, or a failure released it).

Then it writes the values of this side's signals of the transfer into ``sig[0:n_sig]``: ``1, 2, ...,
n_sig - 1`` and a final ``0`` (the per-chunk signals and the closing reset) when the transfer goes
ahead, all ``REFUSED`` when it is refused (so every wait of the peer passes, whatever its number of
chunks); a refusal also zeroes the byte counts of ``out``'s first ``n_rows`` descriptor rows (the
unpacks that follow move nothing) and, where ``status[0]`` is still 0, records ``(fp, word)`` in
``status[0:2]`` (sticky: the first refusal stays).

``ONLY_REFUSED`` (the check before a side's last signal of a transfer: its ``word`` is the side's own status
word, which a release of its waits sets to the release value, and ``REFUSED`` is that value): the signals are
written only when refused, each ``REFUSED``; a transfer that goes ahead keeps the values its first verdict wrote.
"""
from __future__ import annotations

import triton.language as tl

from ._jit import dual_kernel


@dual_kernel(do_not_specialize=["n_sig", "n_rows"])
def verdict_kernel(word_ptr, fp_ptr, sig_ptr, n_sig, status_ptr, out_ptr, n_rows,
                   EQUAL: tl.constexpr, REFUSED: tl.constexpr, BLOCK: tl.constexpr,
                   ONLY_REFUSED: tl.constexpr):
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    at = tl.cast(lanes * 0, tl.int64)
    seen = tl.load(word_ptr + at, volatile=True)
    mine = tl.load(fp_ptr + at)
    if EQUAL:
        bad = seen != mine
    else:
        bad = seen >= REFUSED
    r = tl.cast(pid, tl.int64) * BLOCK + lanes
    tl.store(out_ptr + r * 3 + 2, at, mask=bad & (r < n_rows))
    if pid == 0:
        ns = tl.cast(n_sig, tl.int64)
        for start in range(0, n_sig, BLOCK):
            i = tl.cast(start, tl.int64) + lanes
            value = tl.where(i == ns - 1, at, i + 1)
            if ONLY_REFUSED:
                tl.store(sig_ptr + i, at + REFUSED, mask=bad & (i < ns))
            else:
                tl.store(sig_ptr + i, tl.where(bad, at + REFUSED, value), mask=i < ns)
        cur = tl.load(status_ptr + at, volatile=True)
        put = bad & (lanes == 0) & (cur == 0)
        tl.store(status_ptr + at, mine, mask=put)
        tl.store(status_ptr + at + 1, seen, mask=put)
