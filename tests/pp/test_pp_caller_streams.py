"""A copy_engine end remembers every caller stream its steps came on, and its teardown waits for each of them
(work queued on an earlier stream may still read the buffers and host words close() frees). In one process on
one process, no peer (the host platform; CUDA under ``-m gpu``): the steps' stream bookkeeping and close()
itself. Event-driven: a gate holds the first stream's work, opened only once close() waits on that stream."""
from __future__ import annotations

import threading

import pytest
import torch

from gpuxfer.platforms.host import HostPlatform
from gpuxfer.pp.copy_engine import CALLER_STREAMS, CopyEngineTransport
from gpuxfer.pp.spec import SpecTable


def _end(plat):
    t = CopyEngineTransport(role="send", rank=0, peer=1, device=0, platform=plat, timeout_s=20.0,
                            specs=SpecTable({"h": ((64,), torch.float32)}), metadata=False, group=None,
                            tag_base=0, torch_device=torch.device("cpu"), recv_slots=2)
    t._state = "open"      # no peer: close() finds no barrier partner and frees what is its own
    return t


@pytest.fixture
def end():
    plat = HostPlatform()
    t = _end(plat)
    yield plat, t
    t._free()
    plat.close()


def test_close_waits_for_a_step_still_running_on_an_earlier_caller_stream(platform):
    """Stream a holds a step's work behind a flag wait (the gate), released only once close() waits on a;
    stream b came last. Every unmap and free must come after a's work."""
    plat, t = platform, _end(platform)
    a, b = plat.create_stream(0), plat.create_stream(0)
    words = plat.alloc(128, 0)
    gate, done = words.ptr, words.ptr + 64
    waited_on = []
    synchronize = plat.synchronize

    def watched(stream, timeout_s=60.0):    # the gate opens once close() waits on stream a, not before
        waited_on.append(stream)
        if stream is a:
            plat.host_write_flag(gate, 1, 0)
        return synchronize(stream, timeout_s)
    at_teardown = []
    close_mappings = t._close_mappings
    t._close_mappings = lambda: (at_teardown.append(plat.read_flag(done, 0)), close_mappings())
    try:
        plat.host_write_flag(gate, 0, 0)
        plat.host_write_flag(done, 0, 0)
        t._check_eager(a, "send()")                     # steps on a: still running behind the gate
        plat.wait_flag(a, gate, 1)
        plat.write_flag(a, done, 1)
        t._check_eager(b, "send()")                     # then steps on b (the last stream)
        plat.write_flag(b, words.ptr + 8, 1)
        plat.synchronize = watched
        t.close()
        assert a in waited_on and b in waited_on
        assert at_teardown == [1]                       # a's work had finished before any unmap or free
        t.close()                                       # idempotent
        assert at_teardown == [1]
    finally:
        plat.synchronize = synchronize
        plat.host_write_flag(gate, 1, 0)
        for s in (a, b):
            synchronize(s, 30.0)
            s.close()
        t._free()
        words.close()


def test_idle_caller_streams_are_forgotten_past_the_bound(end):
    """A caller making streams as it goes: past CALLER_STREAMS, each remembered stream gets an event; one whose
    event completed is dropped at the next new stream, a busy one kept, and one noted again keeps its place."""
    plat, t = end
    gate = threading.Event()
    busy = plat.create_stream(0)
    streams = [plat.create_stream(0) for _ in range(CALLER_STREAMS + 1)]
    try:
        plat.launch(busy, lambda: gate.wait(30.0))
        t._check_eager(busy, "send()")
        for s in streams[:CALLER_STREAMS - 1]:
            t._check_eager(s, "send()")
        t._check_eager(busy, "send()")                  # seen again: not added twice
        assert len(t._caller_streams) == CALLER_STREAMS
        t._check_eager(streams[-2], "send()")           # the bound: every stream gets an event, none goes yet
        assert len(t._caller_streams) == CALLER_STREAMS + 1
        events = [ev for s, ev in t._caller_streams.items() if s is not busy and ev is not None]
        assert len(events) == CALLER_STREAMS - 1 and all(plat.event_wait(ev, 30.0) for ev in events)
        t._check_eager(streams[0], "send()")            # noted again: its event dropped, it stays
        t._check_eager(streams[-1], "send()")           # the idle ones go; the busy one and streams[0] stay
        assert set(t._caller_streams) == {busy, streams[0], streams[-2], streams[-1]}
        assert not t._drain(0.05)                       # busy still holds work: not drained
        gate.set()
        assert t._drain(30.0)
    finally:
        gate.set()
        for s in [busy, *streams]:
            plat.synchronize(s, 30.0)
            s.close()
