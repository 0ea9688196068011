"""A hostile review of the prefill's transfer thread (:class:`gpuxfer.integrations.sglang.pushes.Pushes`): orders of
SGLang's sender calls that leave a chunk of a request unposted. Over tests/integrations/test_sglang_pipeline.py's two
real agents (host emulation).
"""
from __future__ import annotations

import numpy as np
import pytest

from _requires import require

require("sglang", "GPUXFER_REQUIRE_SGLANG", "sglang==0.5.23")

from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402

from gpuxfer.integrations.sglang.requests import TransferInfo, _Chunk  # noqa: E402
from test_sglang_pipeline import DECODE, ROOM, real  # noqa: E402,F401 (real: the fixture)


def _handle_queued(mgr):
    """The transfer thread's handling of every item queued (as its worker takes them, chunks as queued)."""
    while not mgr.pushes._queue.empty():
        mgr.pushes._handle(mgr.pushes._queue.get_nowait())


@pytest.mark.parametrize("handled", ["before-the-pages-came", "after-the-pages-came"])
def test_a_chunk_sent_before_the_decode_named_its_pages_never_lets_the_room_end_success(real, handled):
    """SGLang's ``KVSender.send`` does not look at the room's status: a first chunk sent while the room is still
    Bootstrapping (the decode's metadata message not yet here) is queued with no destination, and the transfer thread
    drops it (it would go nowhere). The decode's pages then come and the last chunk is sent: that request must not
    end Success with its first pages never written (the decode would decode from its own stale bytes there)."""
    real.update_status(ROOM, KVPoll.Bootstrapping)
    real.add_transfer_request(ROOM, np.array([1, 2]), slice(0, 2), False)      # (SGLang's send: no status check)
    if handled == "before-the-pages-came":
        _handle_queued(real)
    real.transfer_infos[ROOM] = {"decode": TransferInfo(
        room=ROOM, endpoint=DECODE[0], dst_port=DECODE[1], session="decode",
        dst_kv_indices=np.array([9, 10, 11, 12], np.int32), dst_aux_index=3, required_dst_info_num=1,
        is_dummy=False)}
    real.update_status(ROOM, KVPoll.WaitingForInput)
    real.add_transfer_request(ROOM, np.array([3, 4]), slice(2, 4), True, aux_index=5)
    _handle_queued(real)
    ended = real.statuses()[-1][2]
    assert ended != KVPoll.Success or real.decode_pages_equal([1, 2, 3, 4], [9, 10, 11, 12]), real.statuses()
    assert ended == KVPoll.Failed and real.request_status[ROOM] == KVPoll.Failed
    assert "before" in real.failure_records[ROOM], real.failure_records[ROOM]


def test_a_request_sent_whole_before_the_decode_named_its_pages_fails_instead_of_hanging(real):
    """The same with the request's only (last) chunk sent while the room is Bootstrapping: it is dropped, and the
    sender, its last chunk handed over, is left to its pushes (no timeout of its own, nor SGLang's): the request must
    end (Failed), not wait forever holding its KV on the prefill once the decode's pages come."""
    real.update_status(ROOM, KVPoll.Bootstrapping)
    real.add_transfer_request(ROOM, np.array([1, 2]), slice(0, 2), True, aux_index=5)
    _handle_queued(real)
    real.transfer_infos[ROOM] = {"decode": TransferInfo(
        room=ROOM, endpoint=DECODE[0], dst_port=DECODE[1], session="decode",
        dst_kv_indices=np.array([9, 10], np.int32), dst_aux_index=3, required_dst_info_num=1, is_dummy=False)}
    real.update_status(ROOM, KVPoll.WaitingForInput)
    _handle_queued(real)
    assert real.request_status[ROOM] == KVPoll.Failed, real.request_status
    assert "before the decode" in real.failure_records[ROOM], real.failure_records
    assert not any(t.any() for t in real.dst)


def test_a_request_whose_middle_chunk_was_never_posted_never_ends_success(real):
    """Whatever left a chunk of a request unposted (here: one queued with no destination, which the transfer thread
    drops), a later chunk that does not start where the posted ones end fails the request: its last push would
    bump the decode's word, and its Success would go, over pages never written."""
    real.update_status(ROOM, KVPoll.Bootstrapping)
    real.transfer_infos[ROOM] = {"decode": TransferInfo(
        room=ROOM, endpoint=DECODE[0], dst_port=DECODE[1], session="decode",
        dst_kv_indices=np.array([9, 10, 11, 12], np.int32), dst_aux_index=3, required_dst_info_num=1,
        is_dummy=False)}
    real.update_status(ROOM, KVPoll.WaitingForInput)
    real.add_transfer_request(ROOM, np.array([1]), slice(0, 1), False)
    real.pushes.put(_Chunk(ROOM, np.array([2, 3]), slice(1, 3), False, None))     # (no destination: dropped)
    real.add_transfer_request(ROOM, np.array([4]), slice(3, 4), True, aux_index=5)
    _handle_queued(real)
    assert real.request_status[ROOM] == KVPoll.Failed and real.statuses()[-1][2] == KVPoll.Failed
    assert "never sent" in real.failure_records[ROOM], real.failure_records


def test_chunks_sent_in_order_still_land_every_page(real):
    """(The check above fails a request with a hole only: chunks in order land, every page.)"""
    real.update_status(ROOM, KVPoll.Bootstrapping)
    real.transfer_infos[ROOM] = {"decode": TransferInfo(
        room=ROOM, endpoint=DECODE[0], dst_port=DECODE[1], session="decode",
        dst_kv_indices=np.array([9, 10, 11, 12, 13], np.int32), dst_aux_index=3, required_dst_info_num=1,
        is_dummy=False)}
    real.update_status(ROOM, KVPoll.WaitingForInput)
    for pages, where, last in (([1], slice(0, 1), False), ([2, 3], slice(1, 3), False), ([4, 5], slice(3, 5), True)):
        real.add_transfer_request(ROOM, np.array(pages), where, last, aux_index=5)
        _handle_queued(real)            # (one push each, none joined)
    assert real.statuses()[-1][2] == KVPoll.Success
    assert real.decode_pages_equal([1, 2, 3, 4, 5], [9, 10, 11, 12, 13])
