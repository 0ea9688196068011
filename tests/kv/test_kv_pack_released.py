"""The KV pack engine when one side's waits are released mid-transfer (its failure) while more of its own posts, or
of its peer's, are queued behind: a released side's later signals must not overwrite the release value a peer's
verdict still has to read, so neither side reports success over bytes that did not land.

CPU tests on the host emulation: the shape's launches are wrapped to hold a stream at a chosen point (an event tells
the test it got there) and let it go when the test says.
"""
from __future__ import annotations

import threading
import time

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
    """The source posts a push of 3 chunks, then two pushes of one chunk each (parities 1 and 0, two shapes); the
    destination pulls the first and is slow to unpack chunks 1 and 2. The source's lane signals the last chunk (its
    waits not yet released), then the source times out and fails while its lane waits for FREE[0]: the release passes
    that wait, and the destination's signal that chunk 1 is unpacked lands in FREE[0] before the lane's closing
    verdict reads it (a go-ahead). The third push then packs its chunk into the source's slot 0 (its lane waits for
    that: the first push's lane reset PACKED[0]) and its lane copies it into the destination's slot 0, which still
    holds the first push's chunk 2 -- the destination unpacks those bytes into chunk 2's blocks. It must not report
    success: the first push's lane, released, closes with the release value in AVAIL[0]."""
    src, dst = sides
    s_ids, d_ids, xs, xd, before = _random_request(src, dst, 8)
    pushes = [src.agent.prepare(src.peer, "push", local_blocks={"g": ids}, remote_blocks={"g": d_ids[:len(ids)]})
              for ids in (list(range(40, 48)), list(range(56, 60)))]
    ss, ds, so, sc = xs._shape, xd._shape, pushes[0]._shape, pushes[1]._shape
    assert [len(x._chunks) for x in pushes] == [1, 1] and len({id(ss), id(so), id(sc)}) == 3
    closing = _hold(ss.closing[0], 1)               # the first push's closing verdict (parity 0)
    ss.closing[0] = closing
    u1 = _hold(ds.chunks[1][1], 1)                  # the destination's unpacks of chunks 1 and 2
    ds.chunks[1] = (ds.chunks[1][0], u1)
    u2 = _hold(ds.chunks[2][1], 1)
    ds.chunks[2] = (ds.chunks[2][0], u2)
    copied = _hold(sc.lane_released, 1)             # the third push's lane: its chunk is in slot 0, not signalled
    sc.lane_released = copied
    gates = (closing, u1, u2, copied)
    hd = xd.post()
    hs = xs.post()
    for x in pushes:
        x.post()
    try:
        assert dst.agent.flags.wait_host(AVAIL, 3, 60, flag="chunk 2 signalled") == 3
        assert u1.at.wait(60)
        with pytest.raises(TransferTimeout):
            hs.wait(0.5)                    # the source fails: its waits are released
        assert closing.at.wait(60)          # its lane passed FREE[0] >= 3 on the release value
        u1.go.set()                         # the destination signals FREE[0] := 2, then waits to unpack chunk 2
        assert u2.at.wait(60)
        assert src.agent.flags.read(FREE) == 2
        closing.go.set()
        assert copied.at.wait(60)
        u2.go.set()                         # the destination unpacks slot 0: the third push's chunk
        landed = _outcome(hd)
    finally:
        for g in gates:
            g.go.set()
        src.agent.release_waits()
        dst.agent.release_waits()
    overwritten = bool(torch.equal(dst.cache[d_ids[16:20]], src.cache[56:60]))
    assert overwritten, "the scenario did not come about: chunk 2's blocks do not hold the third push's bytes"
    assert not landed, "the destination reported success over bytes other than the source's blocks (chunk 2's " \
        "blocks hold the third push's)"


@pytest.mark.parametrize("sides", ["auto", "copy"], indirect=True)
def test_a_released_source_lane_never_signals_its_streams_go_ahead_values(sides, monkeypatch):
    """The source posts a push of one chunk and fails (its handle times out) before the destination posts: its lane
    passes PACKED[0] on the release value and copies its stale slot 0 into the destination's staging, then checks
    STATUS (released: its signal values become the release value). The destination then posts; its go signal (its
    fingerprint) overwrites the release value in the source's GO[0], so the source's stream -- still ahead of its
    wait on GO[0] -- finds a go-ahead and its verdict writes the chunk counts into the values its lane signals from,
    after the lane's check and before the stream's own check puts the release value back. The lane's signal must not
    carry that go-ahead count: the destination would unpack the stale slot and report success."""
    import gpuxfer.kernels.blocks as blocks
    from gpuxfer.kv.control import GO
    from gpuxfer.platforms.base import RELEASE_VALUE
    src, dst = sides
    s_ids, d_ids, _, _, before = _random_request(src, dst, 9)
    armed, calls = [], []
    lane_at, lane_go, stream_at, stream_go = (threading.Event() for _ in range(4))

    def checks(*a, _made=blocks.verdict_launcher, **kw):    # the released checks: the lane's first, then the stream's
        fn = _made(*a, **kw)
        if not kw.get("only_refused"):
            return fn

        def run(*b):
            if not armed:
                return fn(*b)
            calls.append(1)
            if len(calls) == 2:             # the stream's, after its verdict: held before it runs
                stream_at.set()
                assert stream_go.wait(60)
            out = fn(*b)
            if len(calls) == 1:             # the lane's, before its chunk signal: held after it ran
                lane_at.set()
                assert lane_go.wait(60)
            return out
        return run
    monkeypatch.setattr(blocks, "verdict_launcher", checks)
    xs = src.agent.prepare(src.peer, "push", local_blocks={"g": s_ids[:8]}, remote_blocks={"g": d_ids[:8]})
    monkeypatch.undo()
    xd = dst.agent.prepare(dst.peer, "pull", local_blocks={"g": d_ids[:8]}, remote_blocks={"g": s_ids[:8]})
    assert len(xs._chunks) == len(xd._chunks) == 1
    so = xs._shape
    assert so.expand is not None
    ahead = _hold(so.expand, 1)                     # the source's stream, before its wait on GO[0]
    so.expand = ahead
    armed.append(1)
    gates = (ahead.go, lane_go, stream_go)
    hs = xs.post()
    try:
        with pytest.raises(TransferTimeout):
            hs.wait(0.5)                    # the source fails: its waits are released
        assert lane_at.wait(60)             # its lane copied slot 0 and found itself released
        hd = xd.post()                      # the destination's FREE[0] := 0, GO[0] := fp into the source's words
        for _ in range(6000):
            if 0 < src.agent.flags.read(GO) < RELEASE_VALUE:
                break
            time.sleep(0.01)
        else:
            pytest.fail("the destination's go signal never reached the source's GO[0]")
        ahead.go.set()                      # the stream: wait GO[0] (the fingerprint), verdict: go ahead
        assert stream_at.wait(60)
        lane_go.set()                       # the lane signals its chunk
        landed = _outcome(hd)
    finally:
        for g in gates:
            g.set()
        src.agent.release_waits()
        dst.agent.release_waits()
    want = before.clone()
    want[d_ids[:8]] = src.cache[s_ids[:8]]
    assert not landed or bool(torch.equal(dst.cache, want)), \
        "the destination reported success over bytes other than the source's blocks (a stale staging slot)"
