"""The landing value of a request (the notification word its last push bumps, which the decode takes as "every
page of the request landed") is never written, nor covered by a later request's, when a push of the request
failed: the transfer thread's own ``_post`` over two real agents of this process (host emulation,
tests/integrations/test_sglang_pipeline.py's ``RealAgents``), with the decode rank's registration giving a
notification slot. A push of the host emulation fails alone (a cross-memory-attach copy that moved less than
asked: ``TransferFailed``), and later work on the stream runs: a failed push is injected as the platform's
copies of one post failing so.
"""
from __future__ import annotations

import numpy as np
import pytest

from _requires import require

require("sglang", "GPUXFER_REQUIRE_SGLANG", "sglang==0.5.23")

from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402

from gpuxfer.errors import DriverError  # noqa: E402
from gpuxfer.integrations.sglang.requests import TransferInfo  # noqa: E402
from gpuxfer.platforms.host_cma import wrap_scoped  # noqa: E402
from test_sglang_pipeline import DECODE, ROOM, RealAgents  # noqa: E402

SLOT = 3


@pytest.fixture
def real():
    mgr = RealAgents()
    mgr.pushes.add_decode("decode", mgr.dec.metadata(), {}, SLOT, DECODE)      # its last pushes bump word SLOT
    yield mgr
    mgr.close()


def _fail_posts(monkeypatch, mgr, which):
    """The platform's copies of the prefill's ``which``-th posts (counted from 1) fail on the stream as a
    cross-memory-attach copy that moved less than asked does (the transfer alone, later work running)."""
    plat = mgr.agent.platform
    copy, calls = plat.copy_batch_async, []

    def copy_batch_async(stream, dsts, srcs, sizes):
        calls.append(len(sizes))
        if len(calls) not in which:
            return copy(stream, dsts, srcs, sizes)

        def short():
            raise DriverError("process_vm_writev", "SHORT_COPY", 0, "an injected push", "moved 0 bytes")
        plat._stream(stream)._enqueue("injected failing copies", wrap_scoped(short))
    monkeypatch.setattr(plat, "copy_batch_async", copy_batch_async)


def _request(mgr, room, dst, chunks):
    """Request ``room`` naming decode pages ``dst``, sent as ``chunks`` (lists of prefill pages), each chunk one
    item of the transfer thread (one push each)."""
    mgr.update_status(room, KVPoll.Bootstrapping)
    mgr.transfer_infos[room] = {"decode": TransferInfo(
        room=room, endpoint=DECODE[0], dst_port=DECODE[1], session="decode", dst_kv_indices=np.array(dst, np.int32),
        dst_aux_index=3, required_dst_info_num=1, is_dummy=False)}
    mgr.update_status(room, KVPoll.WaitingForInput)
    start = 0
    for i, pages in enumerate(chunks):
        last = i == len(chunks) - 1
        mgr.add_transfer_request(room, np.array(pages), slice(start, start + len(pages)), last, aux_index=5)
        start += len(pages)
    while not mgr.pushes._queue.empty():
        mgr.run(mgr.pushes._queue.get_nowait())


def test_a_failed_middle_push_never_lets_the_last_push_write_the_landing_value(real, monkeypatch):
    """The request's first push fails, its last one would land: the word the last push bumps must not reach the
    value its row announced (the decode would end the request Success over pages never written, and drop the
    prefill's Failed status that follows as the conclusion of a request it already ended)."""
    _fail_posts(monkeypatch, real, which={1})
    announced = real.pushes._peers["decode"].next_notification(SLOT)
    _request(real, ROOM, [9, 10, 11, 12], [[1, 2], [3, 4]])
    assert real.request_status[ROOM] == KVPoll.Failed
    assert not real.decode_pages_equal([1, 2], [9, 10])            # the failed push wrote nothing
    assert real.dec.notification(SLOT) < announced


@pytest.mark.parametrize("which", [{1}, {2}], ids=["middle-push", "last-push"])
def test_a_later_requests_landing_value_never_covers_a_failed_requests(real, monkeypatch, which):
    """A request that failed announced value ``v`` on the word; the next request's last push must not make the
    word reach ``v`` (the decode, still waiting on ``v`` for the failed request until the Failed status reaches
    it, would end it Success): the failed request's slot is used no more, its rank's requests ending by their
    Success message."""
    _fail_posts(monkeypatch, real, which=which)
    announced = real.pushes._peers["decode"].next_notification(SLOT)
    _request(real, ROOM, [9, 10, 11, 12], [[1, 2], [3, 4]])
    assert real.request_status[ROOM] == KVPoll.Failed
    _request(real, ROOM + 1, [13, 14], [[5, 6]])
    assert real.request_status[ROOM + 1] == KVPoll.Success and real.decode_pages_equal([5, 6], [13, 14])
    assert real.dec.notification(SLOT) < announced
