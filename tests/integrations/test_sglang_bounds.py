"""What a broken or hostile decode can make the SGLang backend's prefill keep, and how soon the prefill's
transfer thread lets go of a room that ended: the manager's ``DecodeRanks`` and the transfer thread
driven in this process with the stand-in pushes of tests/integrations/test_sglang_pipeline.py (no agent, no
sockets). A decode rank's destinations for rooms no request holds here are bounded in number, pages and age;
a destination of a rank whose registration was refused or never came, naming pages that are not its
registered pool's or more decode ranks than the TP sizes give, is stored nowhere (checked before anything
proportional to the list is allocated), and one naming an endpoint no registration of its rank came from is
not answered (no socket opened for it); a request whose decode named another page count fails before any push;
the decode ranks kept registered are bounded (a rank's registration again replaces its own, a rank found gone
makes room), and so is what is kept of refused ones; a room that failed without a marker is drained under a
steady stream of other rooms' chunks, not only once the thread is idle. The decode's handling of a broken or
hostile prefill's messages (the stand-in decode manager of test_sglang_pipeline.py): a metadata row is written
only at its room's own row, only before the room ended and only at its buffers' row sizes; a landing value only
past the values named on its word before; rows and statuses of rooms or requests not the rank's change nothing.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest

from _requires import require

require("sglang", "GPUXFER_REQUIRE_SGLANG", "sglang==0.5.23")

from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402
from sglang.srt.disaggregation.common.conn import CommonKVSender  # noqa: E402

from gpuxfer.integrations.sglang.conn import GpuxferKVManager, GpuxferKVSender  # noqa: E402
from gpuxfer.integrations.sglang.requests import TransferInfo, Unrequested, _Chunk  # noqa: E402
from gpuxfer.errors import BadInput  # noqa: E402
from test_sglang_pipeline import DECODE, ROOM, Decode, Manager, _abort_target, _chunk, _room  # noqa: E402


def _meta(room, session=b"decode", ranks=b"1", pages=(9, 10), port=DECODE[1], token=b"1"):
    """A decode rank's metadata message naming ``pages`` for ``room`` (its request ``token``)."""
    return TransferInfo.from_zmq([str(room).encode(), DECODE[0].encode(), str(port).encode(), session,
                                  np.array(pages, dtype=np.int32).tobytes(), b"3", ranks, b"0", token])


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _prefill(max_rooms=4, max_age_s=30.0):
    """A prefill manager whose decode rank ``decode`` registered (one destination per room), its unrequested
    rooms bounded by ``max_rooms`` and ``max_age_s`` on a clock the test moves."""
    mgr = Manager()
    mgr.is_mla_backend, mgr.req_to_decode_prefix_len = False, {}
    mgr.clock = Clock()
    mgr.decode_ranks.unrequested = Unrequested(max_rooms, max_age_s, clock=mgr.clock)
    _registered(mgr, "decode")
    return mgr


def _registered(mgr, session, port=DECODE[1], tp_ranks=1):
    """Decode rank ``session``'s registration from ``DECODE``'s ip and ``port``, taken (a 64-page pool)."""
    mgr.pushes._peers[session] = _peer()
    mgr.pushes._endpoints[session] = (DECODE[0], port)
    mgr.decode_ranks.dst_counts[session] = tp_ranks


def _peer(pages=64):
    """A registered decode rank's peer as the prefill's checks read it: its KV pool of ``pages`` pages."""
    return SimpleNamespace(groups={"kv": SimpleNamespace(num_blocks=pages)}, route="ipc")


def _failed_told(mgr, room):
    return [s for s in mgr.statuses() if s[1] == room and s[2] == KVPoll.Failed]


# ---------------------------------------------------------------------- rooms no request holds


def test_a_decode_naming_rooms_no_request_holds_keeps_only_its_newest():
    mgr = _prefill(max_rooms=4)
    for room in range(100):
        mgr.decode_ranks.on_transfer_info(_meta(room))
    assert sorted(mgr.transfer_infos) == [96, 97, 98, 99]
    assert sorted(mgr.request_status) == [96, 97, 98, 99] and sorted(mgr.req_to_decode_prefix_len) == [96, 97, 98, 99]
    assert mgr.decode_ranks.unrequested.rooms("decode") == [96, 97, 98, 99]


def test_a_decode_naming_rooms_no_request_holds_keeps_pages_of_twice_its_pool_at_most():
    """A 64-page pool: rooms of 40 pages each, 128 pages at most together (its live requests name its pool's
    pages at most; rooms it gave up may name them again until their timeout)."""
    mgr = _prefill(max_rooms=100)
    for room in range(10):
        mgr.decode_ranks.on_transfer_info(_meta(room, pages=np.arange(40) + room % 2))
    assert sorted(mgr.transfer_infos) == [7, 8, 9] and sorted(mgr.request_status) == [7, 8, 9]
    assert mgr.decode_ranks.unrequested.pages("decode") == 120
    mgr.decode_ranks.on_transfer_info(_meta(9, pages=(1, 2), token=b"2"))  # another request of room 9: it fails, kept
    assert mgr.request_status[9] == KVPoll.Failed and len(mgr.transfer_infos[9]["decode"].dst_kv_indices) == 40
    assert mgr.decode_ranks.unrequested.pages("decode") == 120                  # what is kept of it is counted


def test_rooms_no_request_took_are_dropped_after_the_waiting_timeout():
    mgr = _prefill(max_age_s=30.0)
    mgr.decode_ranks.on_transfer_info(_meta(1))
    mgr.clock.now += 20
    mgr.decode_ranks.on_transfer_info(_meta(2))
    mgr.decode_ranks.expire()
    assert sorted(mgr.transfer_infos) == [1, 2]
    mgr.clock.now += 10
    mgr.decode_ranks.expire()
    assert sorted(mgr.transfer_infos) == [2] and sorted(mgr.request_status) == [2]
    mgr.clock.now += 20
    mgr.decode_ranks.expire()
    assert not mgr.transfer_infos and not mgr.request_status and not mgr.decode_ranks.unrequested.rooms("decode")


def test_a_claimed_room_of_no_request_leaves_no_failure_record_behind():
    """Two decode ranks claiming a room no request holds: the room's failure is kept (a request of it would
    fail) as long as the room's destinations are, then dropped with them."""
    mgr = _prefill(max_age_s=30.0)
    _registered(mgr, "other", port=DECODE[1] + 1)
    mgr.decode_ranks.on_transfer_info(_meta(5))
    mgr.decode_ranks.on_transfer_info(_meta(5, session=b"other", port=DECODE[1] + 1))
    assert 5 in mgr.failure_records and _failed_told(mgr, 5)
    mgr.clock.now += 30
    mgr.decode_ranks.expire()
    assert not mgr.failure_records and not mgr.transfer_infos and not mgr.request_status


def test_a_room_a_request_holds_is_kept_past_both_bounds_and_bounded_again_once_released():
    mgr = _prefill(max_rooms=2, max_age_s=30.0)
    mgr.decode_ranks.on_transfer_info(_meta(ROOM))
    mgr.hold_room(ROOM)                         # the prefill's request of it (its sender)
    for room in range(10):
        mgr.decode_ranks.on_transfer_info(_meta(room))
    mgr.clock.now += 100
    mgr.decode_ranks.expire()
    assert list(mgr.transfer_infos) == [ROOM] and ROOM in mgr.request_status
    mgr.release_room(ROOM)                      # the sender cleared: SGLang dropped the room's state
    mgr.transfer_infos.pop(ROOM)
    mgr.request_status.pop(ROOM)
    mgr.decode_ranks.on_transfer_info(_meta(ROOM))          # a late message naming it
    mgr.clock.now += 30
    mgr.decode_ranks.expire()
    assert not mgr.transfer_infos and not mgr.decode_ranks.requested


def test_the_sender_holds_its_room_from_before_sglangs_part_until_it_is_cleared(monkeypatch):
    mgr = _prefill(max_rooms=1)
    seen = []
    monkeypatch.setattr(CommonKVSender, "__init__", lambda self, *a, **k: seen.append(dict(mgr.decode_ranks.requested))
                        or setattr(self, "conclude_state", None))
    monkeypatch.setattr(CommonKVSender, "clear", lambda self: seen.append("clear"))
    sender = GpuxferKVSender(mgr=mgr, bootstrap_addr="p:1", bootstrap_room=ROOM)
    mgr.decode_ranks.on_transfer_info(_meta(ROOM))
    mgr.decode_ranks.on_transfer_info(_meta(ROOM + 1))      # past one unrequested room: the held one stays
    assert seen == [{ROOM: 1}] and ROOM in mgr.transfer_infos
    sender.clear()
    sender.clear()                              # a cleared sender's room id may be a new request's: untouched
    assert seen[1:] == ["clear"] and not mgr.decode_ranks.requested


# ---------------------------------------------------------------------- destinations refused outright


@pytest.mark.parametrize("session, ranks, says", [
    (b"decode", b"1000000", "names 1000000 decode ranks"),
    (b"decode", b"0", "names 0 decode ranks"),
])
def test_a_destination_that_cannot_be_taken_is_stored_nowhere_and_told_failed(session, ranks, says):
    mgr = _prefill()
    mgr.decode_ranks.on_transfer_info(_meta(3, session=session, ranks=ranks))
    assert not mgr.transfer_infos and not mgr.request_status and not mgr.failure_records
    assert says in _failed_told(mgr, 3)[0][3]


@pytest.mark.parametrize("session, port", [(b"forged-1", DECODE[1]), (b"decode", DECODE[1] + 1)],
                         ids=["never-registered", "another-endpoint"])
def test_a_destination_no_registration_came_from_is_stored_nowhere_and_not_answered(session, port):
    """A rank that never registered, or a message naming another endpoint than its rank registered from: a
    reply would go wherever the message says (a socket per endpoint, SGLang's, never closed), so none goes;
    counted, logged once per rank. The decode, if any, fails the room by its own timeout."""
    mgr = _prefill()
    for room in (3, 4):
        mgr.decode_ranks.on_transfer_info(_meta(room, session=session, port=port))
    assert not mgr.transfer_infos and not mgr.request_status and not mgr.failure_records
    assert not mgr.statuses() and mgr.decode_ranks.unanswered == 2
    assert list(mgr.decode_ranks.unanswered_ranks) == [session.decode()]


def test_forged_endpoints_open_no_socket():
    """Many refused messages, each naming an endpoint of its own: SGLang's status sender (its socket cache,
    ``_connect``) is reached for none of them, and is for the registered rank's own endpoint."""
    mgr = _prefill()
    connected = []
    mgr._connect = lambda endpoint, is_ipv6=False: connected.append(endpoint) or SimpleNamespace(
        send_multipart=lambda parts: None)
    mgr._socket_send_locks = defaultdict(threading.Lock)
    mgr.send_kv_status_message = partial(GpuxferKVManager.send_kv_status_message, mgr)    # the real sender
    for i in range(300):
        mgr.decode_ranks.on_transfer_info(_meta(3, session=b"decode", port=10000 + i))
        mgr.decode_ranks.on_transfer_info(_meta(3, session=f"forged-{i}".encode(), port=10000 + i))
    assert connected == [] and mgr.decode_ranks.unanswered == 600
    mgr.decode_ranks.on_transfer_info(_meta(3, ranks=b"7"))        # refused, from the endpoint its rank registered from
    assert connected == [f"tcp://{DECODE[0]}:{DECODE[1]}"]


@pytest.mark.parametrize("session, ip", [(b"s" * 257, DECODE[0]), (b"decode", "1" * 257)], ids=["rank", "ip"])
def test_a_metadata_message_naming_a_rank_or_ip_past_256_bytes_is_dropped_unparsed(session, ip):
    """No SGLang rank is named so; the names of the ranks whose messages go unanswered are kept (logged once
    each), so a name of megabytes each would be kept by the thousand."""
    with pytest.raises(BadInput, match="at most 256 bytes"):
        TransferInfo.from_zmq([b"3", ip.encode(), b"5555", session, b"", b"", b"1", b"0", b"1"])
    TransferInfo.from_zmq([b"3", DECODE[0].encode(), b"5555", b"s" * 256, b"", b"", b"1", b"0", b"1"])


def test_refused_destinations_under_made_up_rank_names_leave_nothing_behind():
    mgr = _prefill()
    mgr.decode_ranks.on_transfer_info(_meta(3))
    for i in range(50):
        mgr.decode_ranks.on_transfer_info(_meta(3, session=f"forged-{i}".encode()))
    assert list(mgr.decode_ranks.unrequested._by_session) == ["decode"] and list(mgr.transfer_infos[3]) == ["decode"]
    assert mgr.request_status[3] == KVPoll.Failed
    mgr.clock.now += 30
    mgr.decode_ranks.expire()
    assert not mgr.transfer_infos and not mgr.request_status and not mgr.failure_records


def test_a_destination_arriving_after_its_request_failed_here_is_told_at_once():
    """The prefill's request of the room aborted before the decode named its pages (nobody to tell then): the
    decode's metadata message, when it comes, is answered Failed with the abort's reason, not left to the
    decode's waiting timeout."""
    mgr = _prefill()
    mgr.hold_room(ROOM)
    mgr.update_status(ROOM, KVPoll.Bootstrapping)
    mgr.conclude_failure(bootstrap_room=ROOM, failure_reason="Aborted by the prefill")
    told = len(_failed_told(mgr, ROOM))
    mgr.decode_ranks.on_transfer_info(_meta(ROOM))
    assert len(_failed_told(mgr, ROOM)) == told + 1 and _failed_told(mgr, ROOM)[-1][3] == "Aborted by the prefill"
    assert mgr.request_status[ROOM] == KVPoll.Failed


def test_a_refused_ranks_destination_fails_the_room_a_request_holds():
    mgr = _prefill()
    mgr.pushes._rejected["late"] = "page_size: prefill 4, decode 8"
    mgr.pushes._endpoints["late"] = DECODE
    mgr.hold_room(ROOM)
    mgr.update_status(ROOM, KVPoll.Bootstrapping)
    mgr.decode_ranks.on_transfer_info(_meta(ROOM, session=b"late"))
    assert mgr.request_status[ROOM] == KVPoll.Failed and "page_size" in mgr.failure_records[ROOM]
    assert not mgr.transfer_infos


def test_a_requests_destination_named_again_differently_fails_it_and_is_not_replaced():
    """Decode rank ``decode``'s request (token 1) of room ``ROOM`` named pages 9-10 and a request holds the room
    (its pushes may already write them): the same message again changes nothing; one naming pages 11-12, or
    another metadata row, under the same token fails the room, the pages first named kept."""
    for other in (dict(pages=(11, 12)), dict(pages=(9, 10, 11)), dict(ranks=b"1", port=DECODE[1], token=b"1")):
        mgr = _prefill()
        mgr.hold_room(ROOM)
        mgr.update_status(ROOM, KVPoll.Bootstrapping)
        mgr.decode_ranks.on_transfer_info(_meta(ROOM, pages=(9, 10)))
        kept = mgr.transfer_infos[ROOM]["decode"]
        mgr.decode_ranks.on_transfer_info(_meta(ROOM, pages=(9, 10)))
        assert mgr.request_status[ROOM] == KVPoll.WaitingForInput and not mgr.statuses()
        assert mgr.transfer_infos[ROOM]["decode"] is kept
        info = _meta(ROOM, **{"pages": (9, 10), **other})
        if "pages" not in other:
            info.dst_aux_index = 4                  # another metadata row
        mgr.decode_ranks.on_transfer_info(info)
        assert mgr.request_status[ROOM] == KVPoll.Failed and "other pages or rows" in mgr.failure_records[ROOM]
        assert mgr.transfer_infos[ROOM]["decode"] is kept and list(kept.dst_kv_indices) == [9, 10]
        assert "other pages or rows" in _failed_told(mgr, ROOM)[0][3]


def test_forged_decode_ranks_never_grow_a_room_past_the_ranks_its_tp_size_gives():
    """A registered rank of twice this prefill's TP size: two destinations per room, a third refused."""
    mgr = _prefill()
    for i, s in enumerate(("d0", "d1", "d2")):
        _registered(mgr, s, port=DECODE[1] + i, tp_ranks=2)
    for i, s in enumerate((b"d0", b"d1", b"d2")):
        mgr.decode_ranks.on_transfer_info(_meta(4, session=s, ranks=b"2", port=DECODE[1] + i))
    assert sorted(mgr.transfer_infos[4]) == ["d0", "d1"] and mgr.request_status[4] == KVPoll.Failed


# ---------------------------------------------------------------------- the transfer thread lets go promptly


def _other_room(mgr, room):
    mgr.update_status(room, KVPoll.Bootstrapping)
    mgr.transfer_infos[room] = {"decode": TransferInfo(
        room=room, endpoint=DECODE[0], dst_port=DECODE[1], session="decode",
        dst_kv_indices=np.array([1, 2], dtype=np.int32), dst_aux_index=3, required_dst_info_num=1,
        is_dummy=False)}
    mgr.update_status(room, KVPoll.WaitingForInput)
    return _Chunk(room, np.array([5, 6], dtype=np.int32), slice(0, 2), True, 5, None, mgr.transfer_infos[room])


def test_a_room_that_failed_without_a_marker_is_drained_under_a_stream_of_other_rooms():
    """Room ``ROOM`` failed elsewhere (no abort marker queued) with a push posted, now over; the thread then
    handles other rooms' chunks back to back (its queue never empty): ``ROOM``'s push is waited for and its
    ACK sent while they flow, not once the thread is idle."""
    mgr = Manager()
    mgr.landed_at_once = True
    _room(mgr)
    mgr.run(_chunk(0))
    mgr.record_failure(ROOM, "failed elsewhere")
    mgr.update_status(ROOM, KVPoll.Failed)
    mgr.register_deferred_ack_target(ROOM, _abort_target())
    others = [_other_room(mgr, room) for room in range(100, 104)]
    acked_while_busy = []
    stop = mgr.pushes._stop
    conclude = mgr.conclude_room

    def conclude_and_look(room, *a):
        conclude(room, *a)
        if room == others[-1].room:             # the last queued item: the queue was never empty before
            acked_while_busy.append(("ack", ROOM) in mgr.log)
            stop.set()
    mgr.conclude_room = conclude_and_look
    for chunk in others:
        mgr.pushes.put(chunk)
    worker = threading.Thread(target=mgr.pushes.run)
    worker.start()
    worker.join(30)
    assert not worker.is_alive() and acked_while_busy == [True]
    assert ROOM not in mgr.pushes._posted and ROOM not in mgr._staging_outstanding


def test_a_room_whose_push_still_runs_is_left_to_a_later_item():
    mgr = Manager()
    _room(mgr)
    mgr.run(_chunk(0))
    mgr.update_status(ROOM, KVPoll.Failed)
    mgr.pushes._drain_ended_rooms(block=False)
    assert ROOM in mgr.pushes._posted and not mgr.handles[0].waited
    mgr.handles[0].finish()
    mgr.pushes._drain_ended_rooms(block=False)
    assert ROOM not in mgr.pushes._posted and mgr.handles[0].waited


# ---------------------------------------------------------------------- the decode against a broken or hostile prefill


def _decode_room(room=7, index=2):
    """A decode rank whose receiver named pages and metadata row ``index`` for ``room`` to one prefill rank."""
    mgr = Decode()
    mgr.local_ip, mgr.rank_port, mgr.session_id = DECODE[0], DECODE[1], "decode"
    mgr.room(room)
    meta = mgr.build_receiver_metadata_message(
        bootstrap_room=room, required_dst_info_num=1, kv_indices=np.array([9, 10], dtype=np.int32),
        aux_index=index, state_indices=None, decode_prefix_len=None, is_dummy=False)
    return mgr, meta[-1]


def test_a_row_naming_another_metadata_row_than_the_rooms_fails_it_and_writes_nothing():
    mgr, token = _decode_room(index=2)
    mgr.inbox.on_message([b"GXAUX3", b"7", b"1", b"1:1", token, b"ROW-0123"])    # row 1: another request's
    assert mgr.request_status[7] == KVPoll.Failed and "metadata row 1" in mgr.failure_records[7]
    assert not mgr.aux.any() and not mgr.landings.waiting(7)


def test_a_row_for_a_room_this_rank_named_no_pages_for_writes_nothing():
    mgr = Decode()
    mgr.update_status(5, KVPoll.Bootstrapping)      # a room of this rank with no metadata sent (a dummy's)
    mgr.inbox.on_message([b"GXAUX2", b"5", b"0", b"", b"ROW-0123"])
    assert mgr.request_status[5] == KVPoll.Failed and not mgr.aux.any()


@pytest.mark.parametrize("status", [KVPoll.Success, KVPoll.Failed])
def test_a_row_after_the_room_ended_is_dropped_unwritten(status):
    mgr, token = _decode_room()
    mgr.update_status(7, status)
    mgr.inbox.on_message([b"GXAUX3", b"7", b"2", b"1:1", token, b"ROW-0123"])
    assert mgr.request_status[7] == status and not mgr.aux.any() and not mgr.landings.waiting(7)


@pytest.mark.parametrize("rows", [[b"SHORT"], [b"ROW-0123-TOO-LONG"], [], [b"ROW-0123", b"ROW-0123"]])
def test_rows_of_the_wrong_size_or_number_fail_the_room_and_write_nothing(rows):
    mgr, token = _decode_room()
    mgr.inbox.on_message([b"GXAUX3", b"7", b"2", b"1:1", token, *rows])
    assert mgr.request_status[7] == KVPoll.Failed and not mgr.aux.any() and not mgr.landings.waiting(7)


@pytest.mark.parametrize("msg", [
    [b"GXAUX3", b"8", b"2", b"1:1", b"1", b"ROW-0123"],      # a room this rank does not hold
    [b"GXAUX3", b"7", b"2", b"1:1", b"999", b"ROW-0123"],    # another request's token
    [b"GXAUX3", b"7"], [b"GXAUX3", b"\xff", b"2", b""],
    [b"GXAUX3", b"7", b"x", b"", b"999", b"ROW-0123"],      # another request's, its row index no number
])
def test_rows_of_rooms_or_requests_not_this_ranks_or_unparsable_change_nothing(msg):
    mgr, _ = _decode_room()
    try:
        mgr.inbox.on_message(msg)
    except Exception as exc:                # what the control loop logs: never an SGLang status
        assert isinstance(exc, BadInput), exc
    assert mgr.request_status == {7: KVPoll.WaitingForInput} and not mgr.aux.any()
    assert not mgr.landings.waiting(7) and not mgr.failure_records


def test_status_for_a_room_this_rank_does_not_hold_is_dropped():
    mgr, token = _decode_room()
    mgr.inbox.on_message([8, KVPoll.Success, b"", b"", b"1"])
    mgr.inbox.on_message([7, KVPoll.Success, b"", b"", b"999"])                    # another request's token
    assert mgr.applied == [] and mgr.request_status == {7: KVPoll.WaitingForInput}


def test_a_landing_value_named_before_on_its_word_fails_the_room_and_writes_nothing():
    """Request A of slot 1 lands at value 3. A row of a later request naming value 3 again (or lower) would
    end it at once by a word that says nothing of its pages: refused; a value past it is armed."""
    mgr, token = _decode_room()
    mgr.inbox.on_message([b"GXAUX3", b"7", b"2", b"1:3", token, b"ROW-0123"])
    mgr.words[1] = 3
    assert mgr.landings.landed(7)
    mgr.aux.zero_()
    for room, value in ((8, b"3"), (9, b"2"), (10, b"4")):
        mgr.room(room)
        mgr.inbox.tokens[room] = token = str(room).encode()
        mgr.inbox.on_message([b"GXAUX3", str(room).encode(), b"2", b"1:" + value, token, b"ROW-0123"])
        if room != 10:
            assert mgr.request_status[room] == KVPoll.Failed and "not past it" in mgr.failure_records[room]
            assert not mgr.aux.any() and not mgr.landings.waiting(room)
    assert mgr.landings.waiting(10) and bytes(mgr.aux[16:24]) == b"ROW-0123"


# ---------------------------------------------------------------------- decode ranks' registrations


class RegAgent:
    """The prefill's agent as registrations use it: ``add_peer`` hands out stand-in peers (a 64-page pool)."""

    def __init__(self):
        self.added, self.removed = [], []

    def add_peer(self, meta, **views):
        self.added.append(meta)
        return SimpleNamespace(groups={"kv": SimpleNamespace(num_blocks=64)}, route="ipc", engine="copy_engine",
                               meta=meta)

    def remove_peer(self, peer):
        self.removed.append(peer.meta)


def _registrar(max_ranks):
    from gpuxfer.integrations.sglang.layout import geometry
    mgr = _prefill()
    mgr.pushes._peers.clear()
    mgr.decode_ranks.dst_counts.clear()
    mgr.pushes.agent, mgr.pushes.max_decode_ranks = RegAgent(), max_ranks
    mgr.args = SimpleNamespace(page_size=4, kv_item_lens=[64], aux_item_lens=[8], kv_cache_dtype_str="bfloat16",
                               kv_layout=None, num_draft_entries=0)
    mgr.geometry = geometry(mgr.args, 1)
    return mgr


def _register(mgr, session, meta=None, port=DECODE[1], **change):
    """Decode rank ``session``'s registration with ``mgr`` from ``port``: its geometry ``mgr``'s but for
    ``change``."""
    from gpuxfer.integrations.sglang.layout import encode_registration, geometry
    geom = {**geometry(mgr.args, 1), **change}
    meta = meta or f"agent of {session}".encode()
    mgr.decode_ranks.on_registration([b"None", DECODE[0].encode(), str(port).encode(), session.encode(),
                          encode_registration(geom, meta), b""])


def test_decode_ranks_past_the_cap_are_refused_counted_and_keep_nothing():
    mgr = _registrar(3)
    for i in range(10):
        _register(mgr, f"d{i}")
    assert sorted(mgr.pushes._peers) == ["d0", "d1", "d2"] and len(mgr.pushes.agent.added) == 3
    assert sorted(mgr.decode_ranks.dst_counts) == ["d0", "d1", "d2"] and mgr.pushes.refused_over_cap == 7
    assert "GPUXFER_SGLANG_DECODE_RANKS" in mgr.pushes.refusal("d9")
    mgr.decode_ranks.on_transfer_info(_meta(3, session=b"d9", pages=(1, 2)))
    assert not mgr.transfer_infos and "GPUXFER_SGLANG_DECODE_RANKS" in _failed_told(mgr, 3)[0][3]


def test_a_decode_ranks_registration_again_replaces_its_earlier_one():
    mgr = _registrar(2)
    _register(mgr, "d0", b"first")
    _register(mgr, "d1")
    _register(mgr, "d0", b"second")             # at the cap: the rank's own earlier registration makes room
    assert sorted(mgr.pushes._peers) == ["d0", "d1"] and mgr.pushes._peers["d0"].meta == b"second"
    assert mgr.pushes.agent.removed == [b"first"] and mgr.pushes.refused_over_cap == 0


def test_a_decode_rank_found_gone_makes_room_and_is_writable_again_once_it_registers():
    mgr = _registrar(2)
    _register(mgr, "d0")
    _register(mgr, "d1")
    mgr.pushes._dead["d0"] = "PeerLost: its process exited"
    _register(mgr, "d2")                        # at the cap: the rank found gone goes
    assert sorted(mgr.pushes._peers) == ["d1", "d2"] and mgr.pushes.agent.removed == [b"agent of d0"]
    assert sorted(mgr.decode_ranks.dst_counts) == ["d1", "d2"]
    assert "d0" not in mgr.pushes._dead and "gone" in mgr.pushes.refusal("d0")
    mgr.pushes._dead["d1"] = "PeerLost: its process exited"
    _register(mgr, "d1", b"restarted")          # the rank's new registration is no longer the one found gone
    assert "d1" not in mgr.pushes._dead and mgr.pushes.refusal("d1") is None


def test_refused_registrations_under_many_names_keep_a_bounded_record():
    mgr = _registrar(4)
    for i in range(50):
        _register(mgr, f"bad{i}", page_size=8)
    _register(mgr, "huge", kv_cache_dtype="x" * (4 << 20))         # a 4 MiB difference to name
    assert len(mgr.pushes._rejected) == 4 and not mgr.pushes._peers and not mgr.decode_ranks.dst_counts
    assert "kv_cache_dtype" in mgr.pushes.refusal("huge") and len(mgr.pushes.refusal("huge")) < 1000
    _register(mgr, "s" * 100_000)                                   # no SGLang rank is named so
    assert len(mgr.pushes._rejected) == 4 and not mgr.pushes._peers


# ---------------------------------------------------------------------- a decode rank's page lists


@pytest.fixture
def unique_sizes(monkeypatch):
    """The sizes of the arrays ``np.unique`` is asked about (the sort a page list's duplicate check costs)."""
    sizes, unique = [], np.unique
    monkeypatch.setattr(np, "unique", lambda a, *args, **kw: sizes.append(np.size(a)) or unique(a, *args, **kw))
    return sizes


@pytest.mark.parametrize("pages, says", [
    (np.arange(1 << 20) % 64, "names 1048576 pages, its KV pool holds 64"),
    ((3, 64), "page 64"), ((-1, 3), "page -1"), ((5, 6, 5), "more than once"),
], ids=["past-the-pool", "past-the-last-page", "negative", "twice"])
def test_a_page_list_the_decode_pool_cannot_hold_is_refused_on_arrival(unique_sizes, pages, says):
    """Decode rank ``decode`` registered a 64-page pool: a list longer than it, a page outside it or named twice
    fails the room, stored nowhere, sorted nowhere past the pool's size."""
    mgr = _prefill()
    mgr.hold_room(ROOM)
    mgr.update_status(ROOM, KVPoll.Bootstrapping)
    mgr.decode_ranks.on_transfer_info(_meta(ROOM, pages=pages))
    assert not mgr.transfer_infos and mgr.request_status[ROOM] == KVPoll.Failed
    assert says in mgr.failure_records[ROOM] and says in _failed_told(mgr, ROOM)[0][3]
    assert all(n <= 64 for n in unique_sizes)


def test_a_page_list_the_pool_holds_is_taken():
    mgr = _prefill()
    mgr.decode_ranks.on_transfer_info(_meta(ROOM, pages=np.arange(64)[::-1]))
    assert len(mgr.transfer_infos[ROOM]["decode"].dst_kv_indices) == 64
    assert mgr.request_status[ROOM] == KVPoll.WaitingForInput and not mgr.statuses()


@pytest.mark.parametrize("named", [3, 1], ids=["more", "fewer"])
def test_a_decode_naming_another_page_count_than_the_request_sends_fails_it_before_any_push(named, monkeypatch):
    """The request sends 2 pages, the decode named ``named``: failed when the request starts (``init``), so
    none of its chunks reaches a push (real agents: nothing written)."""
    from test_sglang_pipeline import RealAgents
    real = RealAgents()
    try:
        monkeypatch.setattr(CommonKVSender, "__init__", lambda self, *a, **k: None)
        sender = GpuxferKVSender(mgr=real, bootstrap_addr="p:1", bootstrap_room=ROOM)
        _room(real, pages=named)
        real.transfer_infos[ROOM]["decode"].dst_kv_indices = np.arange(9, 9 + named, dtype=np.int32)
        sender.init(2, 5)
        assert real.request_status[ROOM] == KVPoll.Failed and f"named {named} pages" in real.failure_records[ROOM]
        real.add_transfer_request(ROOM, np.array([1]), slice(0, 1), False)
        real.add_transfer_request(ROOM, np.array([2]), slice(1, 2), True, aux_index=5)
        while not real.pushes._queue.empty():
            real.run(real.pushes._queue.get_nowait())
        assert not any(t.any() for t in real.dst) and KVPoll.Success not in [s[2] for s in real.statuses()]
    finally:
        real.close()


# ---------------------------------------------------------------------- the sockets a prefill keeps open


@pytest.fixture
def sockets():
    """A registrar (:func:`_registrar`, 4 decode ranks kept, 4 refusals) with SGLang's own socket cache and
    status sender on a real ZMQ context: each answer opens (and caches) a socket to its endpoint, as in a
    server. Yields the manager and a count of this process's open file descriptors."""
    import os
    import zmq
    from sglang.srt.disaggregation.common.conn import CommonKVManager
    mgr = _registrar(4)
    mgr._zmq_ctx, mgr._socket_lock, mgr.defer_decode_allocation = zmq.Context(), threading.Lock(), False
    mgr._socket_cache, mgr._monitor_cache, mgr._socket_send_locks = {}, {}, {}
    mgr.send_kv_status_message = partial(GpuxferKVManager.send_kv_status_message, mgr)
    mgr._send_abort_ack = partial(CommonKVManager._send_abort_ack, mgr)
    try:
        yield mgr, lambda: len(os.listdir("/proc/self/fd"))
    finally:
        mgr._zmq_ctx.destroy(linger=0)


def _cached(mgr):
    return len(mgr._socket_cache), len(mgr._monitor_cache), len(mgr._socket_send_locks)


def _settled_fds(fds, at_most):
    """This process's open descriptors once ZMQ's reaper closed what was closed (bounded wait)."""
    import time
    deadline = time.monotonic() + 20
    while fds() > at_most and time.monotonic() < deadline:
        time.sleep(0.05)
    return fds()


def test_forged_registrations_each_answered_leave_no_more_sockets_than_registrations_kept(sockets):
    """200 refused registrations, each from an endpoint of its own and each followed by a metadata message of
    its rank (answered Failed there, which opens SGLang's socket to it): only the 4 refusals kept have a
    socket; an evicted one's socket and monitor are closed, its file descriptors freed."""
    mgr, fds = sockets
    for i in range(4):
        _register(mgr, f"warm{i}", port=21000 + i, page_size=8)
        mgr.decode_ranks.on_transfer_info(_meta(3, session=f"warm{i}".encode(), port=21000 + i))
    base = fds()
    for i in range(200):
        _register(mgr, f"bad{i}", port=20000 + i, page_size=8)
        mgr.decode_ranks.on_transfer_info(_meta(3, session=f"bad{i}".encode(), port=20000 + i))
        assert _cached(mgr)[0] <= 4
    assert _cached(mgr) == (4, 4, 4) and len(_failed_told(mgr, 3)) == 0        # answered by sockets only
    assert sorted(mgr._kept_endpoints) == [f"tcp://{DECODE[0]}:{20196 + i}" for i in range(4)]
    assert _settled_fds(fds, base + 16) <= base + 16


def test_a_rank_registering_again_from_endpoint_after_endpoint_keeps_one_socket(sockets):
    mgr, _ = sockets
    for i in range(100):
        _register(mgr, "d0", port=20000 + i)
        mgr.decode_ranks.on_transfer_info(_meta(3, session=b"d0", port=20000 + i, ranks=b"9"))     # refused: answered
    assert _cached(mgr) == (1, 1, 1) and list(mgr._socket_cache) == [f"tcp://{DECODE[0]}:20099"]
    assert list(mgr.pushes._peers) == ["d0"] and list(mgr._kept_endpoints) == [f"tcp://{DECODE[0]}:20099"]


def test_a_status_for_an_endpoint_no_registration_names_any_more_opens_no_socket(sockets):
    """Decode rank d0's destination for a room a request holds, then its registration from another endpoint:
    the room's Failed status goes nowhere (the old endpoint is no registration's), no socket opened for it."""
    mgr, _ = sockets
    _register(mgr, "d0")
    mgr.hold_room(ROOM)
    mgr.update_status(ROOM, KVPoll.Bootstrapping)
    mgr.decode_ranks.on_transfer_info(_meta(ROOM, session=b"d0"))
    assert mgr.request_status[ROOM] == KVPoll.WaitingForInput
    _register(mgr, "d0", port=DECODE[1] + 1)
    mgr.conclude_failure(bootstrap_room=ROOM, failure_reason="aborted")
    assert _cached(mgr) == (0, 0, 0) and mgr.request_status[ROOM] == KVPoll.Failed


def test_a_decode_that_registers_and_never_reads_never_holds_the_prefill(sockets):
    """Decode rank d0 registered from an endpoint that takes connections and reads nothing (a listening TCP
    socket never accepted): once ZMQ's queue to it is full, a message to it fails at once with a typed error,
    instead of holding the sending thread (the transfer thread, every other decode's requests behind it, or
    the scheduler's abort) for SGLang's 30-second send timeout each."""
    import socket
    from gpuxfer.errors import ProtocolError
    mgr, _ = sockets
    with socket.socket() as listening:
        listening.bind((DECODE[0], 0))
        listening.listen(1)
        port = listening.getsockname()[1]
        _register(mgr, "d0", port=port)
        info, outcome = _meta(ROOM, session=b"d0", port=port), []

        def send():
            try:
                for _ in range(5000):
                    mgr.send_to_decode(info, [b"GXAUX3", b"x" * 64])
                outcome.append("sent")
            except Exception as exc:        # noqa: BLE001 - what the transfer thread's room failure gets
                outcome.append(exc)
        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        sender.join(20)
        assert outcome and isinstance(outcome[0], ProtocolError) and "reads none" in str(outcome[0])
        with pytest.raises(ProtocolError):
            mgr.send_to_decode(info, [b"GXAUX3"])


def test_forged_abort_return_addresses_open_no_socket(sockets):
    """ABORTs naming return addresses of their own (each armed for an ACK): no ACK goes to any of them, and
    no socket is opened; an ABORT from a registered rank's endpoint is ACKed there."""
    from sglang.srt.disaggregation.common.conn import ABORT_TAG
    mgr, _ = sockets
    _register(mgr, "d0")
    for i in range(100):
        mgr._on_abort([ABORT_TAG, str(1000 + i).encode(), DECODE[0].encode(), str(30000 + i).encode(), b"1"])
    assert _cached(mgr) == (0, 0, 0) and not mgr._deferred_ack_targets
    mgr._on_abort([ABORT_TAG, b"5", DECODE[0].encode(), str(DECODE[1]).encode(), b"1"])
    assert list(mgr._socket_cache) == [f"tcp://{DECODE[0]}:{DECODE[1]}"]


def test_a_kept_destinations_pages_are_staged_once_as_int64_of_their_own():
    """A destination kept for a room holds its pages as an int64 array of its own (the agent takes such IDs as they
    are at every push, no conversion), not a view of the message's frame; a refused one is not copied at all."""
    mgr = _prefill()
    frame = np.array([9, 10, 11], dtype=np.int32).tobytes()
    msg = [str(ROOM).encode(), DECODE[0].encode(), str(DECODE[1]).encode(), b"decode", frame, b"3", b"1", b"0", b"1"]
    info = TransferInfo.from_zmq(msg)
    assert info.dst_kv_indices.dtype == np.int32 and not info.dst_kv_indices.flags.owndata
    mgr.decode_ranks.on_transfer_info(info)
    kept = mgr.transfer_infos[ROOM]["decode"]
    pages = kept.dst_kv_indices
    assert pages.dtype == np.int64 and pages.flags.owndata and pages.flags.c_contiguous
    assert list(pages) == [9, 10, 11] and kept.stamp_token == 1
    outside = _meta(ROOM + 1, pages=(9, 64))            # past the 64-page pool: refused, kept nowhere
    mgr.decode_ranks.on_transfer_info(outside)
    assert ROOM + 1 not in mgr.transfer_infos and outside.dst_kv_indices.dtype == np.int32
