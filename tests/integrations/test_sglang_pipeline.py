"""The SGLang backend's transfer thread posting a room's chunks without waiting for each: the manager's
``_transfer`` / ``_on_abort`` driven in this process with stand-in pushes whose completion and errors the test
decides (no agent, no sockets, no decode): a room's posts are waited for only when it is concluded, before its
metadata row and its status; an error of any chunk fails the room then; an abort's ACK goes only once every
posted push was waited for; a push past the timeout withholds the ACK. The backend end to end:
tests/integrations/test_sglang_backend.py.
"""
from __future__ import annotations

import queue
import threading
from collections import defaultdict

import numpy as np

from _requires import require

require("sglang", "GPUXFER_REQUIRE_SGLANG", "sglang==0.5.23")

from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402
from sglang.srt.disaggregation.common.conn import ABORT_TAG  # noqa: E402

from gpuxfer.errors import BadInput, PeerLost, TransferTimeout  # noqa: E402
from gpuxfer.integrations.sglang.conn import (GpuxferKVManager, TransferInfo, _Chunk,  # noqa: E402
                                              _drain_marker)

ROOM = 7
DECODE = ("127.0.0.1", 5555)


class FakeHandle:
    """A posted push: ``wait`` blocks until the test ends it (bounded), then raises its error if it has one."""

    def __init__(self, name, log):
        self.name, self.log = name, log
        self.landed = threading.Event()
        self.error = None
        self.waited = False

    def finish(self, error=None):
        self.error = error
        self.landed.set()

    def wait(self, timeout_s=None):
        self.log.append(("wait", self.name))
        if not self.landed.wait(timeout_s):
            raise TransferTimeout(rank=0, step=0, flag=self.name, expected=1, seen=0, timeout_s=timeout_s,
                                  what=f"{self.name} did not complete")
        self.waited = True
        if self.error is not None:
            raise self.error


class Manager(GpuxferKVManager):
    """The prefill manager's transfer state without its agent, sockets or threads: ``_post`` hands out
    :class:`FakeHandle` s (or raises ``post_errors[chunk start]``), messages to the decode are recorded."""

    def __init__(self, timeout_s=5.0):         # noqa: super().__init__ binds sockets and makes an agent
        self.timeout_s = timeout_s
        self.request_status, self.transfer_infos, self.failure_records = {}, {}, {}
        self.failure_lock, self._room_lock, self._agent_lock = threading.Lock(), threading.Lock(), threading.Lock()
        self._staging_outstanding = defaultdict(int)
        self._deferred_ack_targets, self._deferred_ack_poisoned_rooms = {}, set()
        self.deferred_bootstrap = None
        self._queue, self._posted, self._dead, self._peers, self._rejected = queue.Queue(), {}, {}, {}, {}
        self.log, self.handles, self.post_errors = [], {}, {}
        self.landed_at_once = False             # new pushes complete as they are posted

    def _post(self, chunk, info):
        start = chunk.index_slice.start
        if start in self.post_errors:
            raise self.post_errors[start]
        self.log.append(("post", start))
        self.handles[start] = FakeHandle(f"chunk {start}", self.log)
        if self.landed_at_once:
            self.handles[start].finish()
        return self.handles[start]

    def _send_aux(self, chunk, info):
        self.log.append(("aux", chunk.room))

    def send_kv_status_message(self, *, targets, bootstrap_room, status, failure_reason=None):
        self.log.append(("status", bootstrap_room, status, failure_reason))

    def _send_abort_ack(self, room, target):
        self.log.append(("ack", room))

    def _prefill_unique_rank(self):
        return 0

    def run(self, chunk):
        """One item of the transfer thread's queue, as its worker handles it (errors fail the room)."""
        try:
            self._transfer(chunk)
        except Exception as exc:
            self._drain(chunk.room)
            self.conclude_failure(bootstrap_room=chunk.room, failure_reason=f"{type(exc).__name__}: {exc}",
                                  targets=self._live_targets(chunk.room))

    def statuses(self):
        return [e for e in self.log if e[0] == "status"]


def _room(mgr, pages=8):
    mgr.update_status(ROOM, KVPoll.Bootstrapping)
    mgr.transfer_infos[ROOM] = {"decode": TransferInfo(
        room=ROOM, endpoint=DECODE[0], dst_port=DECODE[1], session="decode",
        dst_kv_indices=np.arange(100, 100 + pages, dtype=np.int32), dst_aux_index=3, required_dst_info_num=1,
        is_dummy=False)}
    mgr.update_status(ROOM, KVPoll.WaitingForInput)


def _chunk(start, n=2, last=False):
    return _Chunk(ROOM, np.arange(start, start + n, dtype=np.int32), slice(start, start + n), last, 5)


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
    tail = mgr.log[4:]
    assert [e[0] for e in tail] == ["wait"] * 4 + ["aux", "status"]
    assert tail[-1][2] == KVPoll.Success and mgr.request_status[ROOM] == KVPoll.Success
    assert ROOM not in mgr._staging_outstanding and not mgr._posted


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
    assert ("aux", ROOM) not in mgr.log and mgr.request_status[ROOM] == KVPoll.Failed
    assert "decode" in mgr._dead                # a lost peer is sent nothing more
    assert ROOM not in mgr._staging_outstanding and not mgr._posted


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
    marker = mgr._queue.get_nowait()
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
    assert ROOM not in mgr._staging_outstanding and not mgr._posted
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
    mgr._drain_ended_rooms()
    assert mgr.handles[0].waited and ("ack", ROOM) in mgr.log and not mgr._posted


def _abort_target():
    from sglang.srt.disaggregation.common.conn import AbortNotification
    return AbortNotification(room=ROOM, decode_ip="127.0.0.1", decode_port=5556, generation=1).deferred_ack_target()


def test_a_push_past_the_timeout_fails_the_room_and_withholds_the_ack():
    mgr = Manager(timeout_s=0.2)
    _room(mgr)
    mgr.run(_chunk(0))
    _abort(mgr)
    mgr.run(mgr._queue.get_nowait())            # the push never completes
    assert ("ack", ROOM) not in mgr.log         # it may still land: the decode must not reuse its pages on an ACK
    assert ROOM in mgr._deferred_ack_poisoned_rooms and not mgr._posted


def test_a_prefill_abort_drains_the_room():
    mgr = Manager()
    _room(mgr)
    mgr.run(_chunk(0))
    mgr.conclude_failure(bootstrap_room=ROOM, failure_reason="Aborted by the prefill")
    mgr._queue.put(_drain_marker(ROOM))         # what GpuxferKVSender.abort queues after telling the decode
    mgr.handles[0].finish()
    mgr.run(mgr._queue.get_nowait())
    assert mgr.handles[0].waited and not mgr._posted and ROOM not in mgr._staging_outstanding
