"""SGLang's calls on the backend's sender and receiver in orders its scheduler does not usually make, and
inputs the backend cannot send: what each call may change is its own request's alone. Once cleared, a sender
or receiver holds its room id no more, and the router may give the id to a new request at once; its late
calls (send, init, abort, clear again, failure_exception) neither queue its pages for the new request's, nor
fail it, nor drop or take its state, nor tell its peers anything. A decode's ``send_metadata`` given what
cannot go on the wire (page indices that are no int32 pages or pass the frame limit, no metadata row, state
buffers) fails that room alone with a typed reason instead of raising into the scheduler. The managers are the
stand-ins of tests/integrations/test_sglang_pipeline.py (no agent, no sockets).
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from _requires import require

require("sglang", "GPUXFER_REQUIRE_SGLANG", "sglang==0.5.23")

from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402
from sglang.srt.disaggregation.common.conn import CommonKVSender, KVTransferError  # noqa: E402

from gpuxfer.integrations.sglang.conn import GpuxferKVReceiver, GpuxferKVSender  # noqa: E402
from test_sglang_bounds import _meta, _prefill  # noqa: E402
from test_sglang_pipeline import DECODE, ROOM, Decode  # noqa: E402


# ---------------------------------------------------------------------- the prefill's sender


def _sender(mgr, room=ROOM):
    """A new sender of ``room`` over ``mgr`` as SGLang's constructor leaves it (its network parts left out)."""
    from sglang.srt.observability.trace import TraceNullContext
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CommonKVSender, "__init__", lambda self, *a, **k: None)
        sender = GpuxferKVSender(mgr=mgr, bootstrap_addr="p:1", bootstrap_room=room)
    sender.conclude_state = sender._transfer_start_time = sender._early_send_wait_event = None
    sender.curr_idx = sender._transfer_num_kv_indices = sender._transfer_num_state_indices = 0
    sender.trace_ctx, sender.aux_index = TraceNullContext(), None
    mgr.kv_shard_size, mgr.enable_all_cp_ranks_for_transfer, mgr.is_dummy_cp_rank = 1, False, False
    mgr.update_status(room, KVPoll.Bootstrapping)
    return sender


@pytest.mark.parametrize("late", ["send", "init", "abort", "clear"])
def test_a_cleared_senders_late_calls_change_nothing_of_the_next_request_of_its_room_id(late):
    """Request A's sender cleared before it concluded; request B of the same room id holds the room (its
    decode named pages 11-12). A's late ``send`` queues none of A's pages for B's, its ``init`` and ``abort``
    neither fail B nor tell B's decode anything, its ``clear`` leaves B's state; A polls Failed."""
    mgr = _prefill()
    a = _sender(mgr)
    mgr.decode_ranks.on_transfer_info(_meta(ROOM, pages=(9, 10)))
    a.init(2, 5)
    a.clear()
    b = _sender(mgr)
    mgr.decode_ranks.on_transfer_info(_meta(ROOM, pages=(11, 12), token=b"2"))
    b.init(2, 5)
    {"send": lambda: a.send(np.array([1, 2], dtype=np.int32)), "init": lambda: a.init(3, 5),
     "abort": a.abort, "clear": a.clear}[late]()
    assert mgr.pushes._queue.empty() and not mgr.statuses() and not mgr.failure_records
    assert mgr.request_status[ROOM] == KVPoll.WaitingForInput and list(mgr.transfer_infos[ROOM]) == ["decode"]
    assert a.poll() == KVPoll.Failed and b.poll() == KVPoll.WaitingForInput and mgr.decode_ranks.requested[ROOM] == 1
    b.send(np.array([1, 2], dtype=np.int32))
    chunk = mgr.pushes._queue.get_nowait()
    assert chunk.infos is mgr.transfer_infos[ROOM] and chunk.is_last and list(chunk.pages) == [1, 2]


def test_a_cleared_senders_failure_exception_leaves_the_next_requests_reason():
    mgr = _prefill()
    a = _sender(mgr)
    a.clear()
    b = _sender(mgr)
    mgr.record_failure(ROOM, "the next request's own reason")
    with pytest.raises(KVTransferError):
        a.failure_exception()
    with pytest.raises(KVTransferError, match="the next request's own reason"):
        b.failure_exception()


# ---------------------------------------------------------------------- the decode's receiver


def _decode():
    """A decode manager stand-in as SGLang's receivers use it; what they send a prefill rank is in ``sent``."""
    mgr = Decode()
    mgr.local_ip, mgr.rank_port, mgr.session_id = DECODE[0], DECODE[1], "decode"
    mgr.defer_decode_allocation = mgr.enable_staging = mgr.enable_deferred_decode_kv_release = False
    mgr.addr_to_rooms_tracker, mgr.prefill_response_tracker, mgr.prefill_info_table = defaultdict(set), {}, {}
    mgr.sent, mgr.waiting_timeout = [], 300
    return mgr


def _receiver(mgr, room=ROOM):
    """A receiver of ``room`` past its handshake with one prefill rank (its messages recorded, not sent)."""
    r = GpuxferKVReceiver(mgr, "p:1", room)
    r.bootstrap_infos = [{"rank_ip": "127.0.0.1", "rank_port": 6000, "is_dummy": False}]
    r.required_dst_info_num = 1
    mgr.required_prefill_response_num_table[room] = 1
    r._send_bootstrap_message = lambda *, bootstrap_info, message, operation: mgr.sent.append(message) or True
    r._send_abort_notification = lambda force_arm=False: mgr.sent.append([b"ABORT", str(room).encode()])
    mgr.update_status(room, KVPoll.WaitingForInput)
    return r


@pytest.mark.parametrize("late", ["clear", "abort", "send_metadata", "init"])
def test_a_cleared_receivers_late_calls_change_nothing_of_the_next_request_of_its_room_id(late):
    """Request A landed and was cleared; request B of the same room id named its pages (11, 12; row 3). A's
    late calls send the prefill nothing (no ABORT of B's room, no A pages under B's token) and leave B's
    status, token and row alone: B still polls, A keeps its own conclusion."""
    mgr = _decode()
    a = _receiver(mgr)
    a.send_metadata(np.array([9, 10], dtype=np.int32), 2)
    mgr.update_status(ROOM, KVPoll.Success)
    assert a.poll() == KVPoll.Success
    a.clear()
    b = _receiver(mgr)
    b.send_metadata(np.array([11, 12], dtype=np.int32), 3)
    sent, token = len(mgr.sent), mgr.inbox.tokens[ROOM]
    {"clear": a.clear, "abort": a.abort, "init": lambda: a.init(0),
     "send_metadata": lambda: a.send_metadata(np.array([9, 10], dtype=np.int32), 2)}[late]()
    assert len(mgr.sent) == sent and not mgr.failure_records
    assert mgr.request_status[ROOM] == KVPoll.WaitingForInput and b.poll() == KVPoll.WaitingForInput
    assert mgr.inbox.tokens[ROOM] == token and mgr.inbox.aux_index[ROOM] == 3
    assert a.poll() == (KVPoll.Failed if late == "abort" else KVPoll.Success)


def test_a_cleared_receivers_failure_exception_leaves_the_next_requests_reason():
    mgr = _decode()
    a = _receiver(mgr)
    a.abort()
    a.clear()
    b = _receiver(mgr)
    mgr.record_failure(ROOM, "the next request's own reason")
    with pytest.raises(KVTransferError):
        a.failure_exception()
    with pytest.raises(KVTransferError, match="the next request's own reason"):
        b.failure_exception()


@pytest.mark.parametrize("kv_indices, aux_index, state, says", [
    (np.array([1.5, 2.0]), 2, None, "BlockIdError: decode page indices must be a 1-D array of integers"),
    (np.array([1, 1 << 40]), 2, None, "BlockIdError: decode page indices 1..1099511627776 do not fit"),
    (np.array([[1, 2]]), 2, None, "BlockIdError"),
    ([1, [2, 3]], 2, None, "BlockIdError"),
    (np.array([1, 2], dtype=np.int32), None, None, "BadInput: a decode's metadata row index"),
    (np.array([1, 2], dtype=np.int32), -1, None, "BadInput: a decode's metadata row index"),
    (np.array([1, 2], dtype=np.int32), "2", None, "BadInput: a decode's metadata row index"),
    (np.array([1, 2], dtype=np.int32), 2, [np.array([1])], "BadInput: the gpuxfer SGLang backend does not move"),
], ids=["floats", "past-int32", "2-d", "ragged", "no-row", "negative-row", "row-as-text", "state"])
def test_metadata_the_backend_cannot_send_fails_its_room_alone(kv_indices, aux_index, state, says):
    """Never an exception into the scheduler: the room Failed with the typed reason, its prefill rank told by
    an ABORT (no pages named to it), the room beside it untouched."""
    mgr = _decode()
    a, other = _receiver(mgr), _receiver(mgr, ROOM + 1)
    a.send_metadata(kv_indices, aux_index, state)
    assert a.poll() == KVPoll.Failed and mgr.failure_records[ROOM].startswith(says)
    assert mgr.sent == [[b"ABORT", str(ROOM).encode()]] and ROOM not in mgr.inbox.aux_index
    assert other.poll() == KVPoll.WaitingForInput and ROOM + 1 not in mgr.failure_records


def test_rooms_ended_by_their_word_leave_nothing_behind_once_cleared(monkeypatch):
    """100 requests ended by their notification word, then cleared: nothing is kept for their prefill's late
    conclusions (each names its request's token, by which it is dropped); a late one changes nothing. Where a
    prefill names no token (an earlier gpuxfer), what is kept for them is bounded, the oldest dropped."""
    from gpuxfer.integrations.sglang import inbox
    mgr = _decode()
    for room in range(100):
        r = _receiver(mgr, room)
        r.send_metadata(np.array([9, 10], dtype=np.int32), 2)
        mgr.inbox.end_by_word(room)
        assert r.poll() == KVPoll.Success
        r.clear()
    assert not mgr.inbox.ended_by_word
    mgr.inbox.on_message([5, KVPoll.Success, b"", b"", b"6"])            # room 5's late Success (token 6)
    assert mgr.applied == []
    monkeypatch.setattr(inbox, "ENDED_KEPT", 4)
    for room in range(200, 210):
        mgr.room(room)                          # no token: its prefill is an earlier gpuxfer's
        mgr.inbox.end_by_word(room)
    assert list(mgr.inbox.ended_by_word) == [206, 207, 208, 209]



def test_page_indices_past_the_frame_limit_fail_their_room_alone(monkeypatch):
    """A page list whose frame passes ``GPUXFER_SGLANG_MAX_FRAME_MB`` (1 MiB here), which the prefill rank's
    control socket would drop with its connection (the messages of other rooms queued on it lost, each room
    waiting out its timeout), fails its room alone, typed, naming the setting; a list of exactly the limit goes."""
    monkeypatch.setenv("GPUXFER_SGLANG_MAX_FRAME_MB", "1")
    mgr = _decode()
    a, other = _receiver(mgr), _receiver(mgr, ROOM + 1)
    a.send_metadata(np.arange((1 << 18) + 1, dtype=np.int32), 2)
    assert a.poll() == KVPoll.Failed
    assert mgr.failure_records[ROOM].startswith("BadInput: a decode's page indices take 1048580 bytes, past the 1 "
                                                "MiB of a control message frame (GPUXFER_SGLANG_MAX_FRAME_MB)")
    assert mgr.sent == [[b"ABORT", str(ROOM).encode()]]
    other.send_metadata(np.arange(1 << 18, dtype=np.int32), 2)
    assert other.poll() == KVPoll.WaitingForInput and ROOM + 1 not in mgr.failure_records
    assert len(mgr.sent) == 2 and len(mgr.sent[1][4]) == 1 << 20
