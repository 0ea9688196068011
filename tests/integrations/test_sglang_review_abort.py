"""A prefill request failed on the prefill side (its abort, or no last chunk within the waiting timeout) while
pushes of it are still running. SGLang frees the request's KV pages on the prefill as soon as its ``abort()``
returns or its sender polls Failed, and the decode frees its pages once told Failed: a push still running would
read the first (a new request's forward writing them; its notification word, written after the copies, then ends
the decode's request Success over those bytes) or write the second. So the sender's abort, and the poll that
fails it, return only once the request's posted pushes were waited for, and the decode is told after. The
managers are the stand-ins of tests/integrations/test_sglang_pipeline.py (no agent, no sockets), the transfer
thread a real one over stand-in pushes.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from _requires import require

require("sglang", "GPUXFER_REQUIRE_SGLANG", "sglang==0.5.23")

from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402

from test_sglang_bounds import _prefill  # noqa: E402
from test_sglang_hostile import _Clock, _meta, _sender  # noqa: E402
from test_sglang_pipeline import ROOM  # noqa: E402


@pytest.mark.parametrize("how", ["abort", "no last chunk"])
def test_a_prefill_failure_returns_and_tells_the_decode_only_once_its_posted_pushes_were_waited_for(monkeypatch,
                                                                                                     how):
    mgr, clock = _prefill(), _Clock()
    mgr.timeout_s = 30.0
    sender = _sender(monkeypatch, mgr, clock)
    mgr.decode_ranks.on_transfer_info(_meta(ROOM, 0, pages=(9, 10)))
    sender.init(2, 5)
    sender.send(np.array([1], dtype=np.int32))              # the first of two chunks
    mgr.run(mgr.pushes._queue.get_nowait())                 # posted, still running
    push = mgr.handles[0]
    told_before = []

    def before_drain():                                     # the transfer thread waits for the push next
        told_before.append(list(mgr.statuses()))
        push.finish()
    mgr.before_drain = before_drain
    worker = threading.Thread(target=mgr.pushes.run, daemon=True)
    worker.start()
    try:
        if how == "abort":
            sender.abort()
        else:
            clock.now += 31
            assert sender.poll() == KVPoll.Failed
        assert push.waited                                  # returned once the push was waited for
        assert told_before == [[]]                          # and the decode told after it
        assert mgr.statuses()[-1][2] == KVPoll.Failed and sender.poll() == KVPoll.Failed
    finally:
        mgr.pushes._stop.set()
        worker.join(10)
    assert not worker.is_alive()


def test_a_prefill_abort_with_no_push_posted_returns_at_once_and_tells_the_decode(monkeypatch):
    """Nothing posted (no transfer thread runs here): the abort waits for nothing."""
    mgr, clock = _prefill(), _Clock()
    sender = _sender(monkeypatch, mgr, clock)
    mgr.decode_ranks.on_transfer_info(_meta(ROOM, 0, pages=(9, 10)))
    sender.init(2, 5)
    sender.abort()
    assert mgr.statuses()[-1][2] == KVPoll.Failed and sender.poll() == KVPoll.Failed


def test_a_prefill_abort_waits_for_no_drain_once_the_transfer_thread_stopped(monkeypatch):
    """A push of the request still running and the transfer thread stopped as the abort waits for it (the
    manager's teardown): the abort returns, its decode told, instead of waiting the waiting timeout (an hour here)
    for a drain no thread runs."""
    mgr, clock = _prefill(), _Clock()
    mgr.timeout_s = 3600.0
    sender = _sender(monkeypatch, mgr, clock)
    mgr.decode_ranks.on_transfer_info(_meta(ROOM, 0, pages=(9, 10)))
    sender.init(2, 5)
    sender.send(np.array([1], dtype=np.int32))
    mgr.run(mgr.pushes._queue.get_nowait())                 # posted, never over

    class StopOnWait(threading.Event):                      # the teardown comes as the abort waits
        def wait(self, timeout=None):
            mgr.pushes._stop.set()
            return super().wait(timeout)
    mgr.pushes._drained[ROOM] = StopOnWait()                # (the event the abort's drain sets)
    aborting = threading.Thread(target=sender.abort, daemon=True)
    aborting.start()
    aborting.join(60)
    assert not aborting.is_alive() and not mgr.handles[0].waited
    assert mgr.statuses()[-1][2] == KVPoll.Failed and sender.poll() == KVPoll.Failed
