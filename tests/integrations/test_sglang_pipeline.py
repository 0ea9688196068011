"""The SGLang backend's transfer thread posting a room's chunks without waiting for each: its ``Pushes``
(``_transfer``) and the manager's ``_on_abort`` driven in this process with stand-in pushes whose completion
and errors the test decides (no agent, no sockets, no decode): a room's posts are waited for only when it is
concluded, before its metadata row and its status; an error of any chunk fails the room then; an abort's ACK
goes only once every posted push was waited for; a push past the timeout withholds the ACK. The backend end
to end: tests/integrations/test_sglang_backend.py.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest

from _requires import require

require("sglang", "GPUXFER_REQUIRE_SGLANG", "sglang==0.5.23")

from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402
from sglang.srt.disaggregation.common.conn import ABORT_TAG  # noqa: E402

from gpuxfer.errors import BadInput, GpuxferError, PeerLost, TransferTimeout  # noqa: E402
from gpuxfer.kv.nixl_ffi import NixlError  # noqa: E402
from gpuxfer.integrations.sglang.inbox import Inbox  # noqa: E402
from gpuxfer.integrations.sglang.landing import READ_EVERY_S, Landings  # noqa: E402
from gpuxfer.integrations.sglang.conn import GpuxferKVManager  # noqa: E402
from gpuxfer.integrations.sglang.pushes import Pushes  # noqa: E402
from gpuxfer.integrations.sglang.requests import TransferInfo, _Chunk  # noqa: E402

ROOM = 7
DECODE = ("127.0.0.1", 5555)


class FakeHandle:
    """A posted push: ``wait`` blocks until the test ends it (bounded), then raises its error if it has one;
    ``early``: an error ``wait`` raises at once, the push still running. No event, as a NIXL push's handle:
    ``done()`` says whether it is over, and raises the error of one that failed (as often as it is asked)."""

    event = None

    def __init__(self, name, log):
        self.name, self.log = name, log
        self.landed = threading.Event()
        self.error = self.early = None
        self.waited = False

    def finish(self, error=None):
        self.error = error
        self.landed.set()

    def done(self):
        if self.landed.is_set() and self.error is not None:
            raise self.error
        return self.landed.is_set()

    def wait(self, timeout_s=None):
        self.log.append(("wait", self.name))
        if self.early is not None:
            raise self.early
        if not self.landed.wait(timeout_s):
            raise TransferTimeout(rank=0, step=0, flag=self.name, expected=1, seen=0, timeout_s=timeout_s,
                                  what=f"{self.name} did not complete")
        self.waited = True
        if self.error is not None:
            raise self.error


class FakePushes(Pushes):
    """The prefill's transfer thread with stand-in pushes, its records in the test's manager ``mgr``: ``_post``
    hands out :class:`FakeHandle` s (or raises ``mgr.post_errors[chunk start]``), the row is recorded, and
    ``mgr.before_drain`` runs once as a room's pushes are next waited for."""

    def __init__(self, mgr, timeout_s):
        super().__init__(mgr, None, mgr._agent_lock, None, timeout_s, threading.Event())
        self.mgr = mgr

    def _post(self, chunk, info):
        mgr, start = self.mgr, chunk.index_slice.start
        if start in mgr.post_errors:
            raise mgr.post_errors[start]
        if chunk.is_last:                       # the row goes before the last push is posted
            self._send_aux(chunk, info, None)
        mgr.log.append(("post", start))
        mgr.handles[start] = FakeHandle(f"chunk {start}", mgr.log)
        if mgr.landed_at_once:
            mgr.handles[start].finish()
        return mgr.handles[start]

    def _send_aux(self, chunk, info, landing):
        self.mgr.log.append(("aux", chunk.room))

    def _drain(self, room, *args, **kwargs):
        hook, self.mgr.before_drain = self.mgr.before_drain, None
        if hook is not None:
            hook()
        return super()._drain(room, *args, **kwargs)


class Manager(GpuxferKVManager):
    """The prefill manager's state without its agent, sockets or threads; its transfer thread a
    ``pushes_class`` (:class:`FakePushes`), messages to the decode recorded."""

    pushes_class = FakePushes

    def __init__(self, timeout_s=5.0):         # noqa: super().__init__ binds sockets and makes an agent
        self.timeout_s, self.kv_heads = timeout_s, (0, 0)
        self.request_status, self.transfer_infos, self.failure_records = {}, {}, {}
        self.failure_lock, self._agent_lock = threading.Lock(), threading.Lock()
        self._init_rooms()
        self._staging_outstanding = defaultdict(int)
        self._deferred_ack_targets, self._deferred_ack_poisoned_rooms = {}, set()
        self.deferred_bootstrap = None
        self.log, self.handles, self.post_errors = [], {}, {}
        self.landed_at_once = False             # new pushes complete as they are posted
        self.before_drain = None                # run once as a room's pushes are next waited for
        self.pushes = self.pushes_class(self, timeout_s)

    def send_kv_status_message(self, *, targets, bootstrap_room, status, failure_reason=None, infos=None):
        self.log.append(("status", bootstrap_room, status, failure_reason))

    def _send_abort_ack(self, room, target):
        self.log.append(("ack", room))

    def _prefill_unique_rank(self):
        return 0

    def run(self, chunk):
        """One item of the transfer thread's queue, as its worker handles it (errors fail the room); a chunk
        made by the test belongs to the room's request now, as one ``add_transfer_request`` queued."""
        if chunk.pages is not None and chunk.infos is None:
            chunk.infos = self.transfer_infos.get(chunk.room)
        self.pushes._handle(chunk)

    def statuses(self):
        return [e for e in self.log if e[0] == "status"]


def _room(mgr, pages=8):
    mgr.update_status(ROOM, KVPoll.Bootstrapping)
    mgr.transfer_infos[ROOM] = {"decode": TransferInfo(
        room=ROOM, endpoint=DECODE[0], dst_port=DECODE[1], session="decode",
        dst_kv_indices=np.arange(100, 100 + pages, dtype=np.int32), dst_aux_index=3, required_dst_info_num=1,
        is_dummy=False)}
    mgr.update_status(ROOM, KVPoll.WaitingForInput)


def _chunk(start, n=2, last=False, wait_event=None):
    return _Chunk(ROOM, np.arange(start, start + n, dtype=np.int32), slice(start, start + n), last, 5, wait_event)


class FakeEvent:
    """SGLang's ``wait_event`` (a torch CUDA event on the forward stream): complete after ``pending`` queries
    (never where ``pending`` is None)."""

    def __init__(self, pending, log):
        self.pending, self.log = pending, log

    def query(self):
        self.log.append(("query",))
        if self.pending is None:
            return False
        self.pending -= 1
        return self.pending < 0


def _abort(mgr, generation=1):
    mgr._on_abort([ABORT_TAG, str(ROOM).encode(), b"127.0.0.1", b"5556", str(generation).encode()])


def test_chunks_are_posted_without_waiting_and_waited_before_the_row_and_success():
    mgr = Manager()
    _room(mgr)
    for start in (0, 2, 4):
        mgr.run(_chunk(start))
    assert mgr.log == [("post", 0), ("post", 2), ("post", 4)]         # nothing waited yet
    assert mgr._staging_outstanding[ROOM] == 3 and mgr.request_status[ROOM] == KVPoll.WaitingForInput
    for h in mgr.handles.values():
        h.finish()
    last = threading.Thread(target=mgr.run, args=(_chunk(6, last=True),))
    last.start()
    last.join(0.2)
    assert last.is_alive(), "the last chunk must wait for its own push"
    assert not mgr.statuses()                   # no Success before the last push landed
    mgr.handles[6].finish()
    last.join(5)
    assert not last.is_alive()
    assert all(h.waited for h in mgr.handles.values())
    tail = mgr.log[3:]
    assert [e[0] for e in tail] == ["aux", "post"] + ["wait"] * 4 + ["status"]   # the row goes as the last push
    assert tail[-1][2] == KVPoll.Success and mgr.request_status[ROOM] == KVPoll.Success
    assert ROOM not in mgr._staging_outstanding and not mgr.pushes._posted


def test_an_error_of_a_middle_chunk_fails_the_room_when_it_is_concluded():
    mgr = Manager()
    _room(mgr)
    for start in (0, 2, 4):
        mgr.run(_chunk(start))
    mgr.handles[0].finish()
    mgr.handles[2].finish(PeerLost(rank=0, peer=1, step=0, flag="push", after_s=0.0))
    mgr.handles[4].finish()
    assert not mgr.statuses()                   # found when the room is concluded, not before
    mgr.landed_at_once = True
    mgr.run(_chunk(6, last=True))
    assert all(h.waited for h in mgr.handles.values())      # every post waited for, the failed one's too
    (status,) = mgr.statuses()
    assert status[2] == KVPoll.Failed and "PeerLost" in status[3]
    # the row went with the last chunk, before the error was found; the Failed status follows it
    assert mgr.log.index(("aux", ROOM)) < mgr.log.index(status) and mgr.request_status[ROOM] == KVPoll.Failed
    assert "decode" in mgr.pushes._dead         # a lost peer is sent nothing more
    assert ROOM not in mgr._staging_outstanding and not mgr.pushes._posted


def test_a_chunk_that_cannot_be_posted_fails_the_room_after_the_posted_ones_are_waited_for():
    mgr = Manager()
    _room(mgr)
    mgr.run(_chunk(0))
    mgr.handles[0].finish()
    mgr.post_errors[2] = BadInput("no such pages")
    mgr.run(_chunk(2))
    assert mgr.handles[0].waited
    (status,) = mgr.statuses()
    assert status[2] == KVPoll.Failed and "no such pages" in status[3]
    mgr.run(_chunk(4))                          # after the failure nothing more is posted
    mgr.run(_chunk(6, last=True))
    assert [e for e in mgr.log if e[0] == "post"] == [("post", 0)]
    assert ("aux", ROOM) not in mgr.log and mgr.request_status[ROOM] == KVPoll.Failed


def test_an_abort_while_chunks_are_in_flight_acks_only_once_they_are_waited_for():
    mgr = Manager()
    _room(mgr)
    mgr.run(_chunk(0))
    mgr.run(_chunk(2))
    _abort(mgr)
    assert mgr.request_status[ROOM] == KVPoll.Failed
    assert ("ack", ROOM) not in mgr.log         # two pushes in flight: no ACK yet
    marker = mgr.pushes._queue.get_nowait()
    assert marker.pages is None and marker.room == ROOM
    drain = threading.Thread(target=mgr.run, args=(marker,))
    drain.start()
    mgr.handles[0].finish()
    drain.join(0.2)
    assert drain.is_alive() and ("ack", ROOM) not in mgr.log
    mgr.handles[2].finish()
    drain.join(5)
    assert not drain.is_alive()
    assert mgr.log.index(("ack", ROOM)) > max(mgr.log.index(("wait", "chunk 0")), mgr.log.index(("wait", "chunk 2")))
    assert mgr.log.count(("ack", ROOM)) == 1
    assert ROOM not in mgr._staging_outstanding and not mgr.pushes._posted
    mgr.run(_chunk(4))                          # a chunk after the abort: not posted
    mgr.run(_chunk(6, last=True))               # the last chunk: the decode told Failed, nothing posted
    assert [e[0] for e in mgr.log].count("post") == 2
    assert mgr.statuses()[-1][2] == KVPoll.Failed


def test_an_abort_with_nothing_posted_acks_at_once():
    mgr = Manager()
    _room(mgr)
    _abort(mgr)
    assert ("ack", ROOM) in mgr.log


def test_a_room_that_stops_without_a_marker_is_drained_when_idle():
    mgr = Manager()
    _room(mgr)
    mgr.run(_chunk(0))
    mgr.record_failure(ROOM, "failed elsewhere")
    mgr.update_status(ROOM, KVPoll.Failed)
    mgr.register_deferred_ack_target(ROOM, _abort_target())
    mgr.handles[0].finish()
    mgr.pushes._drain_ended_rooms()
    assert mgr.handles[0].waited and ("ack", ROOM) in mgr.log and not mgr.pushes._posted


def test_a_cleared_room_with_pushes_posted_is_drained_when_idle():
    """A room cleared (no status, no destinations) while a push of it was posted and no marker came: the push
    is waited for when the thread is idle, not held on to."""
    mgr = Manager()
    _room(mgr)
    mgr.run(_chunk(0))
    mgr.request_status.pop(ROOM)
    mgr.transfer_infos.pop(ROOM)
    mgr.handles[0].finish()
    mgr.pushes._drain_ended_rooms()
    assert mgr.handles[0].waited and not mgr.pushes._posted and ROOM not in mgr._staging_outstanding


def _abort_target():
    from sglang.srt.disaggregation.common.conn import AbortNotification
    return AbortNotification(room=ROOM, decode_ip="127.0.0.1", decode_port=5556, generation=1).deferred_ack_target()


def test_a_push_past_the_timeout_fails_the_room_and_withholds_the_ack():
    mgr = Manager(timeout_s=0.2)
    _room(mgr)
    mgr.run(_chunk(0))
    _abort(mgr)
    mgr.run(mgr.pushes._queue.get_nowait())     # the push never completes
    assert ("ack", ROOM) not in mgr.log         # it may still land: the decode must not reuse its pages on an ACK
    assert ROOM in mgr._deferred_ack_poisoned_rooms and not mgr.pushes._posted


@pytest.mark.parametrize("end", ["done", "nixl error", "wait raised early"])
def test_an_abort_acks_only_once_a_push_without_an_event_is_proven_over(end):
    """Pushes whose handle has no event (the NIXL route): one NIXL reported done lets the ACK go; one that ended in
    NIXL's error withholds it (NIXL cannot recall what it issued: part of it may still land), as does one whose
    wait raised while it still ran (a failed agent raises at once)."""
    mgr = Manager()
    _room(mgr)
    mgr.run(_chunk(0))
    _abort(mgr)
    if end == "done":
        mgr.handles[0].finish()
    elif end == "nixl error":
        mgr.handles[0].finish(NixlError("check_xfer_state", "waiting", "the transfer ended in ERR"))
    else:
        mgr.handles[0].early = GpuxferError("the agent failed")
    mgr.run(mgr.pushes._queue.get_nowait())
    over = end == "done"
    assert (("ack", ROOM) in mgr.log) == over, (end, mgr.log)
    assert (ROOM in mgr._deferred_ack_poisoned_rooms) != over and not mgr.pushes._posted


def test_a_prefill_abort_drains_the_room():
    mgr = Manager()
    _room(mgr)
    mgr.run(_chunk(0))
    mgr.conclude_failure(bootstrap_room=ROOM, failure_reason="Aborted by the prefill")
    mgr.pushes.drain_later(ROOM)                # what GpuxferKVSender.abort queues after telling the decode
    mgr.handles[0].finish()
    mgr.run(mgr.pushes._queue.get_nowait())
    assert mgr.handles[0].waited and not mgr.pushes._posted and ROOM not in mgr._staging_outstanding


def test_a_chunk_with_a_wait_event_is_posted_only_once_the_event_completed():
    mgr = Manager()
    _room(mgr)
    mgr.run(_chunk(0, wait_event=FakeEvent(3, mgr.log)))
    assert [e[0] for e in mgr.log] == ["query"] * 4 + ["post"]


def test_a_chunk_whose_room_is_aborted_during_its_wait_event_is_not_posted():
    mgr = Manager()
    _room(mgr)

    class AbortedMeanwhile:
        def query(self):
            _abort(mgr)                         # the decode gives the room up while the forward runs
            return True
    mgr.run(_chunk(0, wait_event=AbortedMeanwhile()))
    assert not [e for e in mgr.log if e[0] == "post"] and mgr.request_status[ROOM] == KVPoll.Failed


def test_a_wait_event_that_never_completes_fails_the_room_and_posts_nothing():
    mgr = Manager(timeout_s=0.2)
    _room(mgr)
    mgr.run(_chunk(0))
    mgr.handles[0].finish()
    mgr.run(_chunk(2, wait_event=FakeEvent(None, mgr.log)))
    assert [e for e in mgr.log if e[0] == "post"] == [("post", 0)]
    (status,) = mgr.statuses()
    assert status[2] == KVPoll.Failed and "TransferTimeout" in status[3] and "forward pass" in status[3]
    assert mgr.handles[0].waited and not mgr.pushes._posted



# ---------------------------------------------------------------------- the decode ends a room by its notification


class Decode(GpuxferKVManager):
    """The decode manager's handling of a metadata row message without its sockets or threads: one metadata
    buffer of 8-byte rows, notification words the test sets (``words``)."""

    def __init__(self, slots_handed=2):         # noqa: super().__init__ binds sockets and makes an agent
        import torch
        self.applied = []
        self.request_status, self.failure_records, self.failure_lock = {}, {}, threading.Lock()
        self.required_prefill_response_num_table = {}
        self.deferred_bootstrap = None
        self._staging_outstanding = defaultdict(int)
        self._deferred_ack_targets, self._deferred_ack_poisoned_rooms = {}, set()
        self.words = {}
        self.landings = Landings(lambda slot: self.words.get(slot, 0))
        self.inbox = Inbox(self, self.landings, KVPoll)
        for _ in range(slots_handed):
            self.landings.new_slot()
        self.aux = torch.zeros(4 * 8, dtype=torch.uint8)
        self.kv_args = SimpleNamespace(aux_data_ptrs=[self.aux.data_ptr()], aux_data_lens=[32], aux_item_lens=[8])

    def room(self, room, responses=1):
        self.update_status(room, KVPoll.Bootstrapping)
        self.update_status(room, KVPoll.WaitingForInput)
        self.required_prefill_response_num_table[room], self.inbox.aux_index[room] = responses, 2

    def aux_message(self, room, landing, row=b"ROW-0123", index=2):
        self.inbox.on_message([b"GXAUX2", str(room).encode(), str(index).encode(), landing, row])   # no token

    def parse_kv_status_message(self, msg):
        return msg[0], msg[1], 0, None

    def apply_prefill_status(self, *, bootstrap_room, status, prefill_rank, failure_reason):
        self.applied.append((bootstrap_room, status))


def test_a_row_message_writes_the_row_and_arms_its_landing():
    mgr = Decode()
    mgr.room(7)
    mgr.aux_message(7, b"1:3")
    assert bytes(mgr.aux[16:24]) == b"ROW-0123" and mgr.landings.waiting(7)
    mgr.words[1] = 3
    assert mgr.landings.landed(7) and not mgr.landings.waiting(7)


def test_a_room_of_several_prefill_ranks_or_a_foreign_slot_is_not_armed():
    mgr = Decode(slots_handed=2)
    mgr.room(9, responses=2)                     # two prefill ranks: SGLang's Success messages count them
    mgr.aux_message(9, b"1:1")
    mgr.room(8)
    mgr.aux_message(8, b"5:1")                   # a slot this rank never handed out
    assert not mgr.landings.waiting(9) and not mgr.landings.waiting(8)
    assert bytes(mgr.aux[16:24]) == b"ROW-0123"


def test_the_prefill_conclusion_of_a_room_ended_by_its_word_is_dropped_once():
    mgr = Decode()
    mgr.room(7)
    mgr.inbox.end_by_word(7)
    assert mgr.request_status[7] == KVPoll.Success
    mgr.request_status.pop(7)                   # cleared, and the room id used again by a new request
    mgr.room(7)
    mgr.inbox.on_message([7, KVPoll.Success])             # the old request's Success, late: not the new one's
    assert mgr.applied == [] and mgr.request_status[7] == KVPoll.WaitingForInput
    mgr.inbox.on_message([7, KVPoll.Success])             # the new request's own
    assert mgr.applied == [(7, KVPoll.Success)]


def test_a_status_that_got_there_first_is_applied_and_nothing_is_dropped_later():
    mgr = Decode()
    mgr.room(7)
    mgr.inbox.on_message([7, KVPoll.Success])
    mgr.request_status[7] = KVPoll.Success      # what apply_prefill_status did
    mgr.inbox.end_by_word(7)                          # the word seen after it: nothing more to drop
    assert not mgr.inbox.ended_by_word and mgr.applied == [(7, KVPoll.Success)]


def test_a_row_of_an_earlier_gpuxfer_is_written_with_no_landing():
    mgr = Decode()
    mgr.room(7)
    mgr.inbox.on_message([b"GXAUX", b"7", b"2", b"ROW-0123"])
    assert bytes(mgr.aux[16:24]) == b"ROW-0123" and not mgr.landings.waiting(7)


@pytest.mark.parametrize("landing", [b"1", b"1:", b":3", b"1:0", b"64:1", b"-1:2", b"1:x", b"1:" + b"9" * 20,
                                     b"1:4611686018427387904"])
def test_a_hostile_landing_fails_the_room_and_writes_no_row(landing):
    mgr = Decode()
    mgr.room(7)
    mgr.aux_message(7, landing)
    assert mgr.request_status[7] == KVPoll.Failed and "metadata row" in mgr.failure_records[7]
    assert not mgr.aux.any() and not mgr.landings.waiting(7)


# ---------------------------------------------------------------------- the prefill announces the value it writes


class FakePeer:
    route, groups = "ipc", {"kv": SimpleNamespace(num_blocks=1 << 20)}     # a registered pool of 1M pages

    def __init__(self):
        self.seq = 0

    def next_notification(self, slot):
        return self.seq + 1


class FakeXfer:
    def __init__(self, agent, peer, slot, log):
        self.agent, self.peer, self.slot, self.log = agent, peer, slot, log

    def post(self):
        if self.agent.fail_posts:
            raise PeerLost(rank=0, peer=1, step=0, flag="push", after_s=0.0)
        value = None
        if self.slot is not None:
            self.peer.seq += 1 + self.agent.skew
            value = self.peer.seq
        self.log.append(("post", self.slot, value))
        h = FakeHandle("push", self.log)
        h.notify_value = value
        h.finish()
        return h


class FakePushAgent:
    def __init__(self, log):
        self.log, self.fail_posts, self.skew = log, False, 0

    def prepare(self, peer, op, *, local_blocks, remote_blocks, name, notify_slot=None):
        self.log.append(("prepare", notify_slot))
        return FakeXfer(self, peer, notify_slot, self.log)


class RealPostPushes(FakePushes):
    """The transfer thread's own ``_post``; the row recorded with the landing it names."""

    _post = Pushes._post

    def _send_aux(self, chunk, info, landing):
        self.mgr.log.append(("aux", landing))


class RealPost(Manager):
    """The transfer thread's own ``_post`` over a stand-in agent whose peer counts notifications."""

    pushes_class = RealPostPushes

    def __init__(self):
        super().__init__()
        self.pushes.agent, self.peer = FakePushAgent(self.log), FakePeer()
        self.pushes._peers, self.pushes._notify_slots = {"decode": self.peer}, {"decode": 3}
        self.pushes._endpoints = {"decode": DECODE}


def test_the_row_names_the_value_the_last_push_writes_and_goes_before_it():
    mgr = RealPost()
    _room(mgr, pages=4)
    mgr.run(_chunk(0))
    mgr.run(_chunk(2, last=True))
    assert [e for e in mgr.log if e[0] in ("prepare", "aux", "post")] == [
        ("prepare", None), ("post", None, None), ("aux", (3, 1)), ("prepare", 3), ("post", 3, 1)]
    assert mgr.statuses()[-1][2] == KVPoll.Success


def test_a_last_push_that_fails_after_its_row_went_retires_the_slot():
    mgr = RealPost()
    _room(mgr, pages=2)
    mgr.pushes.agent.fail_posts = True          # (a prepare that raises is the same path)
    mgr.run(_chunk(0, last=True))
    assert ("aux", (3, 1)) in mgr.log and mgr.statuses()[-1][2] == KVPoll.Failed
    assert mgr.pushes._notify_slots["decode"] is None   # value 1 may be written by a later push: never announced
    mgr.pushes.agent.fail_posts = False
    mgr.pushes._dead.clear()
    mgr.request_status.clear()
    _room(mgr, pages=4)
    mgr.run(_chunk(0))
    mgr.run(_chunk(2, last=True))
    tail = [e for e in mgr.log if e[0] in ("prepare", "aux", "post")][-3:]
    assert tail == [("aux", None), ("prepare", None), ("post", None, None)]     # the room ends by its Success


def test_a_peer_reached_through_nixl_announces_no_value():
    mgr = RealPost()
    mgr.peer.route = "nixl"                     # its notification follows its last transfer alone
    _room(mgr, pages=2)
    mgr.run(_chunk(0, last=True))
    assert ("aux", None) in mgr.log and ("post", None, None) in mgr.log


def test_a_push_that_wrote_another_value_than_announced_retires_the_slot():
    mgr = RealPost()
    _room(mgr, pages=2)
    mgr.pushes.agent.skew = 1
    mgr.run(_chunk(0, last=True))
    assert ("aux", (3, 1)) in mgr.log and ("post", 3, 2) in mgr.log
    assert mgr.pushes._notify_slots["decode"] is None


# ---------------------------------------------------------------------- the prefill's pushes over real agents


class RealAgentsPushes(FakePushes):
    _post = Pushes._post


class RealAgents(Manager):
    """The transfer thread's own ``_post`` over two real agents of this process (host emulation): the prefill's
    pool (``ENTRIES`` entries of ``PAGES`` pages, random bytes) pushed onto a decode agent's (zeros), as
    ``KVArgs`` hands them over."""

    pushes_class = RealAgentsPushes
    ENTRIES, PAGES, ITEM = 2, 16, 64

    def __init__(self):
        super().__init__()
        import sys
        import pathlib
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "kv"))
        from _agent_arena import Arena
        from gpuxfer.integrations.sglang.layout import geometry, register_kv_args
        from gpuxfer.kv import KVAgent
        from gpuxfer.platforms import get_platform
        plat = get_platform("host")
        self.arena = Arena(plat, 0, 2 * self.ENTRIES * self.PAGES * self.ITEM + 4096)
        self.src = [self.arena.tensor((self.PAGES, self.ITEM), seed=e + 1) for e in range(self.ENTRIES)]
        self.dst = [self.arena.tensor((self.PAGES, self.ITEM)) for _ in range(self.ENTRIES)]
        for t in self.dst:
            t.zero_()
        self.agent = KVAgent("sglang-prefill-test", platform=plat, engine="copy_engine", timeout_s=5)
        self.dec = KVAgent("sglang-decode-test", platform=plat, engine="copy_engine", timeout_s=5, host_notify=True)
        self.args = {}
        for agent, pool in ((self.agent, self.src), (self.dec, self.dst)):
            self.args[agent] = SimpleNamespace(
                kv_data_ptrs=[t.data_ptr() for t in pool], kv_data_lens=[t.numel() for t in pool],
                kv_item_lens=[self.ITEM] * self.ENTRIES, page_size=4, state_types=[], host_kv_data_ptrs=None,
                aux_item_lens=[64], kv_cache_dtype_str="bfloat16", kv_layout=None, num_draft_entries=0)
            register_kv_args(agent, self.args[agent])
        self.geometry = geometry(self.args[self.agent], 1)
        self.pushes.agent = self.agent
        self.pushes.add_decode("decode", self.dec.metadata(), {}, None, DECODE)

    def close(self):
        self.agent.close()
        self.dec.close()
        self.arena.close()

    def decode_pages_equal(self, src_pages, dst_pages):
        return all(torch_equal(s[list(src_pages)], d[list(dst_pages)]) for s, d in zip(self.src, self.dst))


def torch_equal(a, b):
    import torch
    return torch.equal(a, b)


@pytest.fixture
def real():
    mgr = RealAgents()
    yield mgr
    mgr.close()


def test_real_agents_land_a_room_byte_for_byte(real):
    _room(real, pages=4)                        # decode pages 100.. are past its 16: name its own
    real.transfer_infos[ROOM]["decode"].dst_kv_indices = np.array([9, 10, 11, 12], dtype=np.int32)
    real.add_transfer_request(ROOM, np.array([1, 2]), slice(0, 2), False)
    real.add_transfer_request(ROOM, np.array([3, 4]), slice(2, 4), True, aux_index=5)
    while not real.pushes._queue.empty():
        real.run(real.pushes._queue.get_nowait())
    assert real.statuses()[-1][2] == KVPoll.Success
    assert real.decode_pages_equal([1, 2, 3, 4], [9, 10, 11, 12])


def test_chunks_queued_while_the_thread_was_busy_land_as_one_push(real):
    """A request sent back to back (four chunks queued before the transfer thread takes the first): one
    ``prepare`` + ``post`` of all its pages, every page on its own decode page."""
    _room(real, pages=8)
    real.transfer_infos[ROOM]["decode"].dst_kv_indices = np.array([9, 3, 10, 11, 12, 0, 13, 14], dtype=np.int32)
    for start, last in ((0, False), (2, False), (4, False), (6, True)):
        real.add_transfer_request(ROOM, np.array([start + 1, start + 2]), slice(start, start + 2), last, aux_index=5)
    prepared, prepare = [], real.agent.prepare
    real.agent.prepare = lambda *a, **k: prepared.append(k["local_blocks"]) or prepare(*a, **k)
    worker = threading.Thread(target=real.pushes.run)
    worker.start()
    deadline = time.monotonic() + 30
    while not real.statuses() and time.monotonic() < deadline:
        time.sleep(0.01)
    real.pushes._stop.set()
    worker.join(10)
    assert not worker.is_alive()
    assert real.statuses()[-1][2] == KVPoll.Success
    assert [list(blocks.values())[0].tolist() for blocks in prepared] == [list(range(1, 9))]
    assert real.decode_pages_equal(range(1, 9), [9, 3, 10, 11, 12, 0, 13, 14])


def _decode_names(mgr, pages):
    """Room ``ROOM``'s decode pages as the decode's metadata message carries them."""
    mgr.transfer_infos[ROOM]["decode"] = TransferInfo.from_zmq(
        [str(ROOM).encode(), DECODE[0].encode(), str(DECODE[1]).encode(), b"decode",
         np.array(pages, dtype=np.int32).tobytes(), b"3", b"1"])


def _run_all(mgr):
    while not mgr.pushes._queue.empty():
        mgr.run(mgr.pushes._queue.get_nowait())


@pytest.mark.parametrize("pages", [np.array([2**32 + 1, 2**32 + 2], dtype=np.int64), np.array([1.9, 2.7]),
                                   np.array([2**64 - 15, 2**64 - 14], dtype=np.uint64)],
                         ids=["past-int32", "float", "uint64"])
def test_send_page_indices_that_are_no_pool_pages_fail_the_room_and_write_nothing(real, pages):
    """Prefill page indices past the pool (past an int32 too) or not integers: never taken for other pages."""
    _room(real, pages=2)
    real.transfer_infos[ROOM]["decode"].dst_kv_indices = np.array([9, 10], dtype=np.int32)
    real.add_transfer_request(ROOM, pages, slice(0, 2), True, aux_index=5)
    _run_all(real)
    assert real.request_status[ROOM] == KVPoll.Failed and real.statuses()[-1][2] == KVPoll.Failed
    assert not any(t.any() for t in real.dst)


def test_a_decode_naming_more_pages_than_the_room_sends_fails_it(real):
    """The decode named 4 pages, the prefill's last chunk ends at 2: its last 2 pages would never be written."""
    _room(real, pages=4)
    real.transfer_infos[ROOM]["decode"].dst_kv_indices = np.array([9, 10, 11, 12], dtype=np.int32)
    real.add_transfer_request(ROOM, np.array([1, 2]), slice(0, 2), True, aux_index=5)
    _run_all(real)
    assert real.request_status[ROOM] == KVPoll.Failed and real.statuses()[-1][2] == KVPoll.Failed


@pytest.mark.parametrize("pages", [np.array([2**32 + 1, 2**32 + 2], dtype=np.int64), np.array([1.9, 2.7])],
                         ids=["past-int32", "float"])
def test_decode_page_indices_that_do_not_fit_the_message_are_refused(pages):
    """The decode's pages travel as int32s: one past an int32 is never sent as another page."""
    from gpuxfer.errors import BlockIdError
    mgr = Decode()
    mgr.local_ip, mgr.rank_port, mgr.session_id = "127.0.0.1", 5555, "127.0.0.1:5555"
    with pytest.raises(BlockIdError):
        mgr.build_receiver_metadata_message(bootstrap_room=7, required_dst_info_num=1, kv_indices=pages,
                                            aux_index=1, state_indices=None, decode_prefix_len=None,
                                            is_dummy=False)


def _registration(mgr, **change):
    """The decode's registration message, its geometry changed by ``change``."""
    from gpuxfer.integrations.sglang.layout import encode_registration, geometry
    geom = {**geometry(mgr.args[mgr.dec], 1), **change}
    return [b"None", DECODE[0].encode(), str(DECODE[1]).encode(), b"decode",
            encode_registration(geom, mgr.dec.metadata()), b""]


def test_a_refused_registration_fails_the_ranks_rooms_even_after_an_accepted_one(real):
    """The decode rank registers again with a geometry that does not pair (another page size): its rooms fail
    with that reason, not pushed through the peer its earlier registration added."""
    real.agent.remove_peer(real.pushes._peers.pop("decode"))
    real.decode_ranks.on_registration(_registration(real))
    assert "decode" in real.pushes._peers
    real.decode_ranks.on_registration(_registration(real, page_size=8))
    assert "page_size" in real.pushes._rejected["decode"]
    _room(real, pages=2)
    _decode_names(real, [9, 10])
    real.add_transfer_request(ROOM, np.array([1, 2]), slice(0, 2), True, aux_index=5)
    _run_all(real)
    assert real.request_status[ROOM] == KVPoll.Failed and "page_size" in real.statuses()[-1][3]
    assert not any(t.any() for t in real.dst)


def test_a_registration_failing_with_an_untyped_error_refuses_the_rank(real, monkeypatch):
    """Whatever a registration raises (here a ``KeyError`` from the geometry check), the rank is refused and its
    earlier peer dropped, not kept for its rooms."""
    monkeypatch.setattr("gpuxfer.integrations.sglang.decode_ranks.head_share", lambda *a: {}["kv_item_lens"])
    real.decode_ranks.on_registration(_registration(real))
    assert "decode" not in real.pushes._peers and "KeyError" in real.pushes._rejected["decode"]


def test_two_decode_ranks_claiming_one_room_fail_it_for_both():
    """A room of one decode rank (``required_dst_info_num`` 1) claimed by a second one (a room id two requests
    drew, or a forged message): neither is written the other's KV and reported Success."""
    mgr = Manager()
    mgr.landed_at_once, mgr.is_mla_backend, mgr.req_to_decode_prefix_len = True, False, {}
    mgr.update_status(ROOM, KVPoll.Bootstrapping)
    mgr.pushes._peers = {s: SimpleNamespace(groups={"kv": SimpleNamespace(num_blocks=16)}) for s in ("decode", "other")}
    mgr.pushes._endpoints = {"decode": DECODE, "other": (DECODE[0], DECODE[1] + 1)}
    for session, port in (("decode", DECODE[1]), ("other", DECODE[1] + 1)):
        mgr.decode_ranks.on_transfer_info(TransferInfo.from_zmq(
            [str(ROOM).encode(), DECODE[0].encode(), str(port).encode(), session.encode(),
             np.array([9, 10], dtype=np.int32).tobytes(), b"3", b"1"]))
    mgr.run(_chunk(0, last=True))
    assert mgr.request_status[ROOM] == KVPoll.Failed
    assert KVPoll.Success not in [s[2] for s in mgr.statuses()]


def test_a_cleared_requests_queued_chunk_is_not_posted_for_a_new_request_of_its_room():
    """Request A's last chunk still queued when A is aborted and cleared, and a new request B of the same room
    id is waiting for its KV: A's chunk must not be pushed into B's pages nor conclude B's room."""
    mgr = Manager()
    mgr.landed_at_once = True
    _room(mgr, pages=2)
    mgr.add_transfer_request(ROOM, np.array([1, 2]), slice(0, 2), True, aux_index=5)     # A's, not run yet
    _abort(mgr)                                 # the decode gives A up; A's sender fails and is cleared
    mgr.failure_records.pop(ROOM)               # (SGLang's failure_exception, then clear)
    mgr.request_status.pop(ROOM)
    mgr.transfer_infos.pop(ROOM)
    _room(mgr, pages=2)                         # B: the same room id, its decode pages named
    _run_all(mgr)
    assert not [e for e in mgr.log if e[0] == "post"], mgr.log
    assert mgr.request_status[ROOM] == KVPoll.WaitingForInput and not mgr.statuses()


# ---------------------------------------------------------------------- a room id used by one request after another


def test_an_earlier_requests_push_never_fails_a_new_request_of_its_room():
    """Request A's push is still posted when A fails with no drain queued (as a second decode rank's claim of
    its room fails it) and is cleared; a new request B of the same room id then sends its KV. A's push (which
    fails) is waited for, but its error is A's: B succeeds."""
    mgr = Manager()
    _room(mgr)
    mgr.run(_chunk(0))                          # A's push, in flight
    mgr.record_failure(ROOM, "claimed by another decode rank")
    mgr.update_status(ROOM, KVPoll.Failed)
    mgr.failure_records.pop(ROOM)               # A's sender: failure_exception, then clear
    mgr.request_status.pop(ROOM)
    mgr.transfer_infos.pop(ROOM)
    a = mgr.handles[0]
    a.finish(BadInput("A's push failed"))
    _room(mgr, pages=4)                         # B
    mgr.landed_at_once = True
    mgr.run(_chunk(0))
    mgr.run(_chunk(2, last=True))
    assert a.waited and mgr.handles[0] is not a
    assert mgr.statuses()[-1][2] == KVPoll.Success, mgr.statuses()
    assert mgr.request_status[ROOM] == KVPoll.Success
    assert not mgr.pushes._posted and ROOM not in mgr._staging_outstanding


class WirePushes(RealPostPushes):
    _send_aux = Pushes._send_aux


class WirePrefill(RealPost):
    """The prefill's own row and status messages over :class:`RealPost`'s pushes (slot 3 of the decode),
    kept in ``wire`` as they would go to the decode."""

    pushes_class = WirePushes
    send_kv_status_message = GpuxferKVManager.send_kv_status_message

    def __init__(self):
        super().__init__()
        import torch
        self.is_mla_backend, self.req_to_decode_prefix_len, self.kv_status_msg_tag = False, {}, None
        self.aux = torch.zeros(8 * 8, dtype=torch.uint8)
        self.pushes.kv_args = SimpleNamespace(aux_data_ptrs=[self.aux.data_ptr()], aux_data_lens=[64],
                                              aux_item_lens=[8])
        self.wire = []

    def row(self, data):
        """The row the room's last chunk (metadata index 5) sends."""
        self.aux[40:48] = torch_tensor(data)

    def request(self, meta):
        """A request of room ``ROOM`` whose decode named its pages by ``meta`` (its metadata message)."""
        self.request_status.pop(ROOM, None)     # an earlier request's sender cleared (failure_exception, clear)
        self.transfer_infos.pop(ROOM, None)
        self.failure_records.pop(ROOM, None)
        self.update_status(ROOM, KVPoll.Bootstrapping)
        self.decode_ranks.on_transfer_info(TransferInfo.from_zmq(meta))

    def _send_multipart_locked(self, addr, parts, is_ipv6=False):
        self.wire.append(list(parts))

    def take(self):
        out, self.wire = self.wire, []
        return out


def torch_tensor(data):
    import torch
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class WireDecode(Decode):
    """The decode's own handling of the prefill's messages (SGLang's status parsing and applying) and its
    receivers' ``send_metadata`` message, ``poll`` and ``clear`` for room ``ROOM``; notification slot 3 is
    the prefill's (``words[3]``)."""

    parse_kv_status_message = GpuxferKVManager.parse_kv_status_message
    apply_prefill_status = GpuxferKVManager.apply_prefill_status

    def __init__(self):
        super().__init__(slots_handed=4)
        self.local_ip, self.rank_port, self.session_id = DECODE[0], DECODE[1], "decode"
        self.prefill_response_tracker, self.addr_to_rooms_tracker = {}, defaultdict(set)
        self.enable_staging = self.defer_decode_allocation = self.enable_deferred_decode_kv_release = False
        self.kv_status_msg_tag, self.rx = None, None

    def request(self):
        """A new receiver of room ``ROOM``: its metadata message (pages 9 and 10, metadata row 2)."""
        from gpuxfer.integrations.sglang.conn import GpuxferKVReceiver
        self.room(ROOM)
        self.prefill_response_tracker[ROOM] = set()
        self.rx = rx = object.__new__(GpuxferKVReceiver)
        rx.kv_mgr, rx.bootstrap_room, rx.bootstrap_addr, rx.conclude_state, rx.init_time = self, ROOM, "p", None, None
        return self.build_receiver_metadata_message(
            bootstrap_room=ROOM, required_dst_info_num=1, kv_indices=np.array([9, 10], dtype=np.int32),
            aux_index=2, state_indices=None, decode_prefix_len=None, is_dummy=False)

    def poll(self):
        time.sleep(2 * READ_EVERY_S)            # a word read by the last poll is read again
        return self.rx.poll()

    def clear(self):
        self.rx.clear()

    def deliver(self, msgs):
        for m in msgs:
            self.inbox.on_message(m)

    def row(self):
        return bytes(self.aux[16:24])


def test_a_late_row_and_status_of_a_given_up_request_never_end_a_new_request_of_its_room():
    """Request A of room ``ROOM`` is given up on the decode (its waiting timeout, an abort) and cleared just as
    the prefill sends its last chunk: A's row (naming the value A's push writes) and A's Success arrive once
    a new request B of the same room id named its pages. Neither may end B (its KV not sent: wrong bytes
    reported good) nor write B's row; B then ends by its own."""
    pre, dec = WirePrefill(), WireDecode()
    pre.row(b"ROW-AAAA")
    pre.request(dec.request())                  # A
    pre.run(_chunk(0, last=True))               # A's row, push, Success: on their way
    late = pre.take()
    assert [m[0] for m in late][0].startswith(b"GXAUX") and len(late) == 2
    dec.clear()                                 # A given up and cleared on the decode
    b_meta = dec.request()                      # B: the same room id
    dec.deliver(late)
    dec.words[3] = 1                            # A's push wrote the value A's row named
    assert dec.poll() == KVPoll.WaitingForInput and dec.row() == bytes(8)
    pre.row(b"ROW-BBBB")
    pre.request(b_meta)                         # B's KV sent
    pre.run(_chunk(0, last=True))
    dec.deliver(pre.take()[:1])                 # B's row: B ends by its word
    assert dec.poll() == KVPoll.WaitingForInput
    dec.words[3] = 2
    assert dec.poll() == KVPoll.Success and dec.row() == b"ROW-BBBB"


def test_a_late_failure_of_an_earlier_request_never_fails_a_new_request_of_its_room():
    pre, dec = WirePrefill(), WireDecode()
    pre.request(dec.request())                  # A
    pre.conclude_failure(bootstrap_room=ROOM, failure_reason="Aborted by the prefill")
    late = pre.take()
    dec.clear()
    b_meta = dec.request()                      # B
    dec.deliver(late)
    assert dec.poll() == KVPoll.WaitingForInput
    pre.row(b"ROW-BBBB")
    pre.request(b_meta)
    pre.run(_chunk(0, last=True))
    dec.deliver(pre.take())                     # B's row and Success
    assert dec.poll() == KVPoll.Success and dec.row() == b"ROW-BBBB"


def test_a_new_request_naming_its_pages_while_the_earlier_one_is_concluded_is_failed_not_hung():
    """A ends on the decode by its word and is cleared; B, of the same room id, names its pages to the prefill
    while the prefill still waits for A's push. A's conclusion must not end B (B's KV was never sent), and B
    must not wait for its timeout: it is told Failed (the prefill cannot hold two requests of one room id)."""
    pre, dec = WirePrefill(), WireDecode()
    pre.request(dec.request())                  # A

    def a_lands_then_b_names_its_pages():
        dec.deliver(pre.take())                 # A's row
        dec.words[3] = 1
        assert dec.poll() == KVPoll.Success     # A ended by its word
        dec.clear()
        pre.decode_ranks.on_transfer_info(TransferInfo.from_zmq(dec.request()))     # B's pages, A still there
    pre.before_drain = a_lands_then_b_names_its_pages
    pre.run(_chunk(0, last=True))
    dec.deliver(pre.take())
    assert dec.poll() == KVPoll.Failed and "another of its requests" in dec.failure_records[ROOM]


def test_a_new_request_of_a_decode_rank_never_takes_the_pushes_of_its_earlier_one(real):
    """A's first chunk is posted into A's decode pages; the decode rank then names pages for a new request of
    the same room id (it gave A up and told this prefill nothing: its heartbeat declared it dead). A's last
    chunk must not be pushed into the new request's pages, nor either reported Success."""
    def meta(pages, token):
        return [str(ROOM).encode(), DECODE[0].encode(), str(DECODE[1]).encode(), b"decode",
                np.array(pages, dtype=np.int32).tobytes(), b"3", b"1", b"0", token]
    real.is_mla_backend, real.req_to_decode_prefix_len = False, {}
    real.update_status(ROOM, KVPoll.Bootstrapping)
    real.decode_ranks.on_transfer_info(TransferInfo.from_zmq(meta([5, 6, 7, 8], b"1")))         # A
    real.add_transfer_request(ROOM, np.array([1, 2]), slice(0, 2), False)
    _run_all(real)
    real.decode_ranks.on_transfer_info(TransferInfo.from_zmq(meta([12, 13, 14, 15], b"2")))     # B's pages
    real.add_transfer_request(ROOM, np.array([3, 4]), slice(2, 4), True, aux_index=5)
    _run_all(real)
    assert real.decode_pages_equal([1, 2], [5, 6]) and not any(t[7:].any() for t in real.dst)
    assert real.request_status[ROOM] == KVPoll.Failed
    assert KVPoll.Success not in [s[2] for s in real.statuses()]


def test_a_request_cleared_while_its_pushes_are_waited_for_never_concludes_a_new_request_of_its_room():
    """A's last push is slow; while the transfer thread waits for it the decode aborts A, A's sender is
    cleared and a new request B of the same room id names its pages. A's conclusion, once its push is over,
    must not mark B Success (B's KV not sent) nor tell B's decode anything."""
    mgr = Manager()
    _room(mgr, pages=2)

    def a_aborted_cleared_and_b_begins():
        _abort(mgr)
        mgr.failure_records.pop(ROOM)           # A's sender: failure_exception, then clear
        mgr.request_status.pop(ROOM)
        mgr.transfer_infos.pop(ROOM)
        _room(mgr, pages=2)                     # B
        mgr.handles[0].finish()                 # A's push over
    mgr.before_drain = a_aborted_cleared_and_b_begins
    mgr.run(_chunk(0, last=True))
    assert mgr.request_status[ROOM] == KVPoll.WaitingForInput and not mgr.statuses(), mgr.log
