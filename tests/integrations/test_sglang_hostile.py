"""What a broken or hostile peer's control message may make the SGLang backend do, beyond
tests/integrations/test_sglang_bounds.py: the prefill's ``DecodeRanks`` and the decode's ``Inbox`` driven in this
process with the stand-in managers of tests/integrations/test_sglang_pipeline.py (no agent, no sockets). A
destination whose decode prefix length no SGLang scheduler could send through, or that names another prefix
length than the room's other decode ranks, is refused on arrival, its room failed and its rank told; a message
whose frames do not parse is refused with a typed error naming the frame; a metadata row message of a room's
current request whose row index does not parse fails the room (its row cannot be written, so a Success after it
must not end the room over the row an earlier request left there); a flood of ABORT messages (rooms made up, or
one room again and again) queues at most one drain per room the prefill knows, so a peer never grows the
transfer thread's queue while that thread waits for a slow push, nor the return addresses a room keeps for its
ACK past the decode ranks kept; a destination stored while its request was being cleared is bounded as a room
no request holds; a started request that hands no last chunk over (its decode named a prefix past its prompt)
fails after the waiting timeout instead of holding its KV forever.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from _requires import require

require("sglang", "GPUXFER_REQUIRE_SGLANG", "sglang==0.5.23")

from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402
from sglang.srt.disaggregation.common.conn import ABORT_TAG  # noqa: E402

from gpuxfer.errors import BadInput  # noqa: E402
from gpuxfer.integrations.sglang.requests import TransferInfo  # noqa: E402
from test_sglang_bounds import _decode_room, _failed_told, _prefill  # noqa: E402
from test_sglang_pipeline import DECODE, ROOM, Manager, _abort, _chunk, _room  # noqa: E402


def _meta(room, prefix_len, pages=(9, 10), token=b"1"):
    """Decode rank ``decode``'s metadata message for ``room`` naming ``pages`` past a ``prefix_len``-token prefix
    its own cache holds (SGLang's ``decode_prefix_len``)."""
    return TransferInfo.from_zmq([str(room).encode(), DECODE[0].encode(), str(DECODE[1]).encode(), b"decode",
                                  np.array(pages, dtype=np.int32).tobytes(), b"3", b"1",
                                  str(prefix_len).encode(), token])


@pytest.mark.parametrize("prefix_len", [-16, -1, -(10 ** 30)])
def test_a_negative_decode_prefix_len_is_refused_and_told_failed(prefix_len):
    """SGLang's prefill starts sending a request at the decode's prefix length (``start_send_idx``) and counts its
    pages from the prompt's length less it: a negative one makes the first chunk's slice of the request's tokens
    empty and the page count one the chunks never reach, so no chunk is ever the last and the request holds its
    prefill KV with no timeout (a decode that never aborts it keeps it forever). Refused on arrival instead:
    stored nowhere, the room the request holds failed, the rank told."""
    mgr = _prefill()
    mgr.hold_room(ROOM)
    mgr.update_status(ROOM, KVPoll.Bootstrapping)
    mgr.decode_ranks.on_transfer_info(_meta(ROOM, prefix_len))
    assert ROOM not in mgr.transfer_infos and ROOM not in mgr.req_to_decode_prefix_len
    assert mgr.request_status[ROOM] == KVPoll.Failed and "prefix length" in mgr.failure_records[ROOM]
    assert "prefix length" in _failed_told(mgr, ROOM)[0][3]


def test_a_decode_prefix_len_of_zero_or_more_is_taken():
    mgr = _prefill()
    mgr.hold_room(ROOM)
    mgr.update_status(ROOM, KVPoll.Bootstrapping)
    mgr.decode_ranks.on_transfer_info(_meta(ROOM, 64))
    assert mgr.request_status[ROOM] == KVPoll.WaitingForInput and mgr.req_to_decode_prefix_len[ROOM] == 64
    assert not mgr.statuses()


# ---------------------------------------------------------------------- frames that do not parse


def _frames(**bad):
    """A decode rank's metadata message, its frames as SGLang's receiver sends them but those in ``bad``."""
    frames = {"room": b"7", "ip": DECODE[0].encode(), "port": str(DECODE[1]).encode(), "session": b"decode",
              "pages": np.array([9, 10], dtype=np.int32).tobytes(), "aux": b"3", "ranks": b"1", "prefix": b"0",
              "token": b"1"}
    frames.update(bad)
    return list(frames.values())


@pytest.mark.parametrize("frame, value", [
    ("room", b"\xff7"), ("room", b"seven"), ("ip", b"\xff"), ("port", b"55x5"), ("session", b"dec\xffode"),
    ("aux", b"three"), ("ranks", b""), ("ranks", b"\xff"), ("prefix", b"0x10"),
])
def test_a_metadata_message_whose_frames_do_not_parse_is_refused_naming_the_frame(frame, value):
    with pytest.raises(BadInput, match=frame):
        TransferInfo.from_zmq(_frames(**{frame: value}))


def test_a_registration_naming_its_rank_in_other_than_ascii_is_dropped_with_a_typed_error():
    """Nothing of it kept, nothing raised to the control thread but what names the frame."""
    mgr = _prefill()
    before = dict(mgr.pushes._endpoints)
    with pytest.raises(BadInput, match="rank"):
        mgr.decode_ranks.on_registration([b"None", DECODE[0].encode(), b"6000", b"\xffdecode", b"", b""])
    assert mgr.pushes._endpoints == before and not mgr.pushes._rejected


# ---------------------------------------------------------------------- the decode's row messages


@pytest.mark.parametrize("index", [b"x", b"\xff", b""])
def test_a_row_of_the_rooms_request_whose_index_does_not_parse_fails_the_room(index):
    """The row message of the room's own request (its token) came and cannot be written: the room fails, so the
    prefill's Success that follows it never ends the room over the row an earlier request left at its index."""
    mgr, token = _decode_room()
    mgr.aux[16:24] = torch.tensor(list(b"EARLIER!"), dtype=torch.uint8)
    mgr.inbox.on_message([b"GXAUX3", b"7", index, b"1:1", token, b"ROW-0123"])
    assert mgr.request_status[7] == KVPoll.Failed and "metadata row" in mgr.failure_records[7]
    assert bytes(mgr.aux[16:24]) == b"EARLIER!" and not mgr.landings.waiting(7)
    mgr.update_status(7, KVPoll.Success)        # what SGLang's status handling does with the Success after it
    assert mgr.request_status[7] == KVPoll.Failed


@pytest.mark.parametrize("index", [b"x", b"\xff"])
def test_a_row_of_another_request_whose_index_does_not_parse_changes_nothing(index):
    mgr, _ = _decode_room()
    mgr.inbox.on_message([b"GXAUX3", b"7", index, b"1:1", b"999", b"ROW-0123"])
    assert mgr.request_status[7] == KVPoll.WaitingForInput and not mgr.failure_records and not mgr.aux.any()


# ---------------------------------------------------------------------- ABORT floods


def test_aborts_of_made_up_rooms_or_of_one_room_again_queue_at_most_one_drain_per_known_room():
    """Nothing takes the queue's items here (a transfer thread waiting for a slow push): ABORTs of rooms no
    request or destination of this prefill names queue nothing (a room cleared with pushes still posted is
    drained by the thread's sweep of ended rooms), and ABORTs of one room again one drain until it ran."""
    mgr = Manager()
    _room(mgr)
    mgr.run(_chunk(0))                          # a push of the room in flight
    for room in range(1000, 3000):
        mgr._on_abort([ABORT_TAG, str(room).encode(), DECODE[0].encode(), b"5556", b"1"])
    for generation in range(1, 2001):
        _abort(mgr, generation)
    assert mgr.pushes._queue.qsize() == 1 and mgr.request_status[ROOM] == KVPoll.Failed
    marker = mgr.pushes._queue.get_nowait()
    assert marker.room == ROOM and marker.pages is None
    mgr.handles[0].finish()
    mgr.run(marker)                             # drained: the ACK went once the push was waited for
    assert ("ack", ROOM) in mgr.log and not mgr.pushes._posted
    _abort(mgr, 2001)                           # after its drain ran, an ABORT queues one again
    assert mgr.pushes._queue.qsize() == 1


def test_an_abort_of_a_cleared_room_with_a_push_posted_acks_once_the_sweep_drains_it():
    """The room's request was cleared (no status here) while its push was posted: the ABORT queues no drain, and
    its ACK goes once the push is over, from the transfer thread's sweep of ended rooms."""
    mgr = Manager()
    _room(mgr)
    mgr.run(_chunk(0))
    mgr.request_status.pop(ROOM)                # SGLang's clear of the sender
    mgr.transfer_infos.pop(ROOM)
    _abort(mgr)
    assert mgr.pushes._queue.empty() and ("ack", ROOM) not in mgr.log
    mgr.handles[0].finish()
    mgr.pushes._drain_ended_rooms(block=False)
    assert ("ack", ROOM) in mgr.log and not mgr.pushes._posted


# ---------------------------------------------------------------------- one prefix length per room


def test_decode_ranks_of_one_room_naming_other_prefix_lengths_fail_it():
    """Two decode ranks of a room (a decode of twice this prefill's TP size) naming as many pages past other
    prefix lengths: the prefill sends the request's tokens from one prefix length on (the first named) to both,
    so the second would be written other tokens than it asked for, and told Success. The room fails instead."""
    from test_sglang_bounds import _registered
    mgr = _prefill()
    for i, s in enumerate(("d0", "d1")):
        _registered(mgr, s, port=DECODE[1] + i, tp_ranks=2)
    mgr.hold_room(ROOM)
    mgr.update_status(ROOM, KVPoll.Bootstrapping)
    for i, (s, prefix) in enumerate(((b"d0", 16), (b"d1", 17))):
        mgr.decode_ranks.on_transfer_info(TransferInfo.from_zmq(
            [str(ROOM).encode(), DECODE[0].encode(), str(DECODE[1] + i).encode(), s,
             np.array([9, 10], dtype=np.int32).tobytes(), b"3", b"2", str(prefix).encode(), b"1"]))
    assert mgr.request_status[ROOM] == KVPoll.Failed and "prefix length of 17" in mgr.failure_records[ROOM]
    assert list(mgr.transfer_infos[ROOM]) == ["d0"] and "prefix length of 17" in _failed_told(mgr, ROOM)[0][3]


def test_decode_ranks_of_one_room_naming_one_prefix_length_take_it():
    from test_sglang_bounds import _registered
    mgr = _prefill()
    for i, s in enumerate(("d0", "d1")):
        _registered(mgr, s, port=DECODE[1] + i, tp_ranks=2)
    mgr.hold_room(ROOM)
    mgr.update_status(ROOM, KVPoll.Bootstrapping)
    for i, s in enumerate((b"d0", b"d1")):
        mgr.decode_ranks.on_transfer_info(TransferInfo.from_zmq(
            [str(ROOM).encode(), DECODE[0].encode(), str(DECODE[1] + i).encode(), s,
             np.array([9, 10], dtype=np.int32).tobytes(), b"3", b"2", b"16", b"1"]))
    assert mgr.request_status[ROOM] == KVPoll.WaitingForInput and mgr.req_to_decode_prefix_len[ROOM] == 16
    assert not mgr.statuses()


# ---------------------------------------------------------------------- a room's destination named as its request ends


def test_a_destination_named_while_its_request_is_cleared_is_kept_no_longer_than_an_unrequested_rooms():
    """SGLang's ``clear`` drops the room's destinations, then the sender lets go of the room: a metadata message
    of the room id handled in between (a decode rank naming it again, or its next request's) is stored as the
    room a request holds. Once let go it is a room no request holds: kept for the waiting timeout at most, not
    forever."""
    mgr = _prefill(max_age_s=30.0)
    mgr.hold_room(ROOM)
    mgr.update_status(ROOM, KVPoll.Bootstrapping)
    mgr.decode_ranks.on_transfer_info(_meta(ROOM, 0))
    mgr.transfer_infos.pop(ROOM)                # SGLang's clear of the sender: its state of the room dropped
    mgr.request_status.pop(ROOM)
    mgr.decode_ranks.on_transfer_info(_meta(ROOM, 0, token=b"2"))      # handled before the sender let go
    mgr.release_room(ROOM)
    assert mgr.decode_ranks.unrequested.rooms("decode") == [ROOM]
    mgr.clock.now += 30
    mgr.decode_ranks.expire()
    assert not mgr.transfer_infos and not mgr.request_status and not mgr.req_to_decode_prefix_len


# ---------------------------------------------------------------------- a request that never sends its last chunk


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _sender(monkeypatch, mgr, clock):
    """A prefill sender of room ``ROOM`` (SGLang's ``CommonKVSender`` state as its constructor leaves it) on the
    backend's clock ``clock``."""
    from sglang.srt.disaggregation.common.conn import CommonKVSender
    from sglang.srt.observability.req_time_stats import TraceNullContext
    from gpuxfer.integrations.sglang import conn
    from gpuxfer.integrations.sglang.conn import GpuxferKVSender

    def init(self, mgr, *a, **k):
        self.kv_mgr, self.conclude_state, self.curr_idx, self.aux_index = mgr, None, 0, None
        self.trace_ctx, self._transfer_start_time, self._prefill_complete_time = TraceNullContext(), None, None
        self._early_send_wait_event, self.init_time = None, None
        self._transfer_num_kv_indices = self._transfer_num_state_indices = 0
    monkeypatch.setattr(CommonKVSender, "__init__", init)
    monkeypatch.setattr(conn, "_clock", clock, raising=False)
    mgr.defer_decode_allocation, mgr.reports_transfer_latency, mgr.kv_shard_size = False, False, 1
    mgr.enable_all_cp_ranks_for_transfer, mgr.is_dummy_cp_rank = False, False
    mgr.update_status(ROOM, KVPoll.Bootstrapping)
    return GpuxferKVSender(mgr, "p:1", ROOM)


@pytest.mark.parametrize("pages", [0, 2])
def test_a_request_that_never_sends_its_last_chunk_fails_after_the_waiting_timeout(monkeypatch, pages):
    """SGLang's prefill sends nothing of a request whose decode named a prefix longer than its prompt (a page
    count of 0 from a prefix up to a page past it: ``send_kv_chunk`` returns while its end is before its start),
    and polls it with no timeout of its own: a request started (``init``) whose last chunk was not handed over
    within the waiting timeout (by then its decode gave it up) fails, its decode told."""
    mgr, clock = _prefill(), _Clock()
    mgr.timeout_s = 30.0
    sender = _sender(monkeypatch, mgr, clock)
    mgr.decode_ranks.on_transfer_info(_meta(ROOM, 80, pages=list(range(9, 9 + pages))))
    sender.init(pages, 5)
    if pages:
        sender.send(np.array([1], dtype=np.int32))              # a first chunk, never the last
    clock.now += 29
    assert sender.poll() == KVPoll.WaitingForInput
    clock.now += 2
    assert sender.poll() == KVPoll.Failed and "last chunk" in mgr.failure_records[ROOM]
    assert "last chunk" in _failed_told(mgr, ROOM)[0][3]


def test_a_request_whose_last_chunk_was_handed_over_is_left_to_its_pushes(monkeypatch):
    """Its last chunk handed over (a prefix as long as the prompt: no page, the row alone), the request is the
    transfer thread's to conclude, however long its pushes take (they are bounded there)."""
    mgr, clock = _prefill(), _Clock()
    mgr.timeout_s = 30.0
    sender = _sender(monkeypatch, mgr, clock)
    mgr.decode_ranks.on_transfer_info(_meta(ROOM, 64, pages=[]))
    sender.init(0, 5)
    sender.send(np.array([], dtype=np.int32))
    clock.now += 100
    assert sender.poll() == KVPoll.WaitingForInput and not mgr.failure_records


def test_abort_return_addresses_kept_for_a_room_are_bounded():
    """A room with a push in flight keeps each ABORT's return address (SGLang's deferred ACK targets, one per
    ip and port) until its pushes are waited for: ABORTs each naming an address of their own (forged, or a
    megabyte of ip) keep at most as many as the decode ranks a prefill rank keeps, each ip at most 256 bytes."""
    mgr = Manager()
    mgr.pushes.max_decode_ranks = 4
    _room(mgr)
    mgr.run(_chunk(0))                          # a push of the room in flight: the ACK waits for it
    mgr._on_abort([ABORT_TAG, str(ROOM).encode(), b"1" * (1 << 20), b"5556", b"1"])
    for port in range(6000, 8000):
        mgr._on_abort([ABORT_TAG, str(ROOM).encode(), DECODE[0].encode(), str(port).encode(), b"1"])
    targets = mgr._deferred_ack_targets[ROOM]
    assert len(targets) == 4 and all(len(ip) <= 256 for ip, _ in targets)
