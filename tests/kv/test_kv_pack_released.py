"""The KV pack engine when one side's waits are released mid-transfer (its failure) while more of its own posts, or
of its peer's, are queued behind: a released side's later signals must not overwrite the release value a peer's
verdict still has to read, so neither side reports success over bytes that did not land.

CPU tests on the host emulation: the shape's launches are wrapped to hold a stream at a chosen point (an event tells
the test it got there) and let it go when the test says.
"""
from __future__ import annotations

import threading

import pytest
import torch

from gpuxfer.errors import TransferMismatch, TransferTimeout
from gpuxfer.kv.control import AVAIL, FREE

from test_kv_pack import _random_request, sides  # noqa: F401 - the fixture


def _hold(fn, call: int):
    """``fn`` whose ``call``-th run (1-based) sets ``.at`` and waits for ``.go``: a launch the test holds back."""
    calls = []
    at, go = threading.Event(), threading.Event()

    def run(*a):
        calls.append(1)
        if len(calls) == call:
            at.set()
            assert go.wait(60)
        return fn(*a)
    run.at, run.go = at, go
    return run


def _outcome(handle) -> bool:
    """Whether ``handle`` reports its transfer landed."""
    try:
        handle.wait(60)
        return True
    except (TransferMismatch, TransferTimeout):
        return False


@pytest.mark.parametrize("sides", ["auto", "copy"], indirect=True)
@pytest.mark.parametrize("held_at", [0, 1])
def test_a_destination_failing_with_pulls_queued_never_lets_the_source_report_success(sides, held_at):
    """The destination posts the same pull three times; its first times out while the source is busy packing
    chunk 1 (the destination fails, its waits are released: its first pull unpacks slots that never got their
    chunks, and its second runs through). The source's lane then passes its last wait on FREE[0] on the release
    value and is slow to reach its closing verdict, while the destination's third pull (parity 0 again) starts:
    its signals into FREE[0] (the reset, then chunk ``held_at``'s) must not read as a destination that unpacked
    every chunk, or the source reports success for a push whose bytes did not land."""
    src, dst = sides
    s_ids, d_ids, xs, xd, before = _random_request(src, dst, 7)
    ss, ds = xs._shape, xd._shape
    busy = _hold(ss.chunks[1][1], 1)                 # the source's pack of chunk 1
    ss.chunks[1] = (ss.chunks[1][0], busy)
    closing = _hold(ss.closing[0], 1)               # the source lane's closing verdict (parity 0)
    ss.closing[0] = closing
    third = _hold(ds.expand, 3)                     # the destination's third pull, before its first signal
    ds.expand = third
    unpack = _hold(ds.chunks[held_at][1], 3)        # ... and at its unpack of chunk ``held_at``
    ds.chunks[held_at] = (ds.chunks[held_at][0], unpack)
    gates = (busy, closing, third, unpack)
    hd = xd.post()
    xd.post()
    xd.post()
    hs = xs.post()
    try:
        with pytest.raises(TransferTimeout):
            hd.wait(0.5)                    # the destination fails: its waits are released
        assert third.at.wait(60)            # its first two pulls ran through
        busy.go.set()
        assert closing.at.wait(60)          # the source's lane passed FREE[0] >= 3 on the release value
        third.go.set()
        assert unpack.at.wait(60)           # the third pull signalled FREE[0] (a reset, then chunk 0 if held at 1)
        seen = src.agent.flags.read(FREE)
        closing.go.set()
        landed = _outcome(hs)
    finally:
        for g in gates:
            g.go.set()
        dst.agent.release_waits()           # (its third pull waits on chunks that never come)
    want = before.clone()
    want[d_ids] = src.cache[s_ids]
    assert not landed or bool(torch.equal(dst.cache, want)), \
        f"the source reported success for a push whose bytes did not land (FREE[0] read {seen})"


@pytest.mark.parametrize("sides", ["auto", "copy"], indirect=True)
def test_a_source_failing_with_pushes_queued_never_lets_the_destination_report_other_bytes(sides):
    """The source posts a push of 3 chunks, then two of one chunk (parities 1 and 0); the destination is slow to
    unpack chunks 1 and 2. The source's lane signals its last chunk (its waits not yet released), then the source
    times out and fails while its lane waits for FREE[0]: the release passes that wait, and the destination's signal
    that chunk 1 is unpacked lands in FREE[0] before the lane's closing verdict reads it. The source's third push
    (refused: its go word was released) then packs its chunk and copies it into slot 0, which still holds the first
    push's chunk 2. The destination must not report success with those bytes in the first push's chunk 2 blocks."""
    src, dst = sides
    s_ids, d_ids, xs, xd, before = _random_request(src, dst, 8)
    one = src.agent.prepare(src.peer, "push", local_blocks={"g": list(range(40, 48))}, remote_blocks={"g": d_ids[:8]})
    assert len(one._chunks) == 1
    ss, ds, so = xs._shape, xd._shape, one._shape
    closing = _hold(ss.closing[0], 1)               # the first push's closing verdict (parity 0)
    ss.closing[0] = closing
    u1 = _hold(ds.chunks[1][1], 1)                  # the destination's unpacks of chunks 1 and 2
    ds.chunks[1] = (ds.chunks[1][0], u1)
    u2 = _hold(ds.chunks[2][1], 1)
    ds.chunks[2] = (ds.chunks[2][0], u2)
    copied = _hold(so.released, 2)                  # the third push's lane: its chunk is in slot 0, not signalled
    so.released = copied
    gates = (closing, u1, u2, copied)
    hd = xd.post()
    hs = xs.post()
    one.post()
    one.post()
    try:
        assert dst.agent.flags.wait_host(AVAIL, 3, 60, flag="chunk 2 signalled") == 3
        assert u1.at.wait(60)
        with pytest.raises(TransferTimeout):
            hs.wait(0.5)                    # the source fails: its waits are released
        assert closing.at.wait(60)          # its lane passed FREE[0] >= 3 on the release value
        u1.go.set()                         # the destination signals FREE[0] := 2, then waits to unpack chunk 2
        assert u2.at.wait(60)
        closing.go.set()
        assert copied.at.wait(60)
        u2.go.set()
        landed = _outcome(hd)
    finally:
        for g in gates:
            g.go.set()
        src.agent.release_waits()
        dst.agent.release_waits()
    want = before.clone()
    want[d_ids] = src.cache[s_ids]
    assert not landed or bool(torch.equal(dst.cache, want)), \
        "the destination reported success over bytes other than the source's blocks: its chunk 2 blocks hold the " \
        f"third push's: {torch.equal(dst.cache[d_ids[16:]], src.cache[40:48])}"
