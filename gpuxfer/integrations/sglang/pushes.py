"""The SGLang backend's prefill transfer thread (:class:`Pushes`), its part of the protocol :mod:`.conn`'s
timeline draws. No SGLang here: the KV manager wires it into SGLang's classes.

Every ``send()`` chunk the manager queues (:meth:`Pushes.put`) becomes one ``prepare`` + ``post`` of its pages onto
the decode pages the receiver named, and the thread does not wait for it: a request's chunks follow one another on
the copy streams while the scheduler computes the next. Chunks of a request queued behind one another while the
thread was busy (a request sent back to back) become one push (:func:`.requests.coalesce`). The last chunk's push
also bumps the decode agent's notification word that the decode's registration gave this prefill rank (stream order:
after every push of the request landed); before it is posted, the request's metadata rows are written into the
decode's rows in host memory (:mod:`.rows`, stamped with the decode's token and the value the push writes), where
the decode's registration named rows this rank opened and the room has one decode rank with a slot on the IPC route;
elsewhere the rows go on SGLang's control socket just before that push, with the value it will write. The request's
pushes are waited for (together bounded by ``timeout_s``) only when it is concluded: its last chunk, a failure, an
abort (:meth:`Pushes.drain_later`); then the manager concludes it (SGLang's status message to the decode). An
ABORT_ACK goes only once every push of the request was waited for and proven over; a push that failed for a lost
peer (``PeerLost``) marks its decode rank gone, sent nothing more. The decode ranks it pushes to (their peers, the
notification slots their registrations gave, the reasons a registration was refused) are this object's too: the
manager's control thread hands them over (:meth:`Pushes.add_decode`, :meth:`Pushes.refuse_decode`).

SGLang's state of a room (``request_status``, ``transfer_infos``, the failure records, ``_staging_outstanding``,
the deferred ABORT_ACKs, the status messages) is read and changed through :class:`Rooms` alone, which
:class:`.conn.GpuxferKVManager` implements.
"""
from __future__ import annotations

import logging
import numbers
import queue
import threading
import time
from collections import OrderedDict
from typing import Any, Container, Dict, List, Optional, Protocol, Tuple

from ... import config
from ...errors import BadInput, GpuxferError, PeerLost, TransferTimeout
from .landing import landing_frame
from .layout import GROUP, read_aux_rows
from .requests import TransferInfo, _Chunk, _drain_marker, _Posted, coalesce
from .rows import AuxRows, RowSegment

log = logging.getLogger("gpuxfer.sglang")

AUX_TAG = b"GXAUX3"             # a metadata row with its landing value and the decode's request token
AUX_TAG_V2 = b"GXAUX2"          # a row with its landing value, no token (to or from an earlier gpuxfer)
AUX_TAG_V1 = b"GXAUX"           # a row alone (from an earlier gpuxfer)
_IDLE_S = 0.2                   # how often an idle thread looks at its stop flag and its ended rooms
_CLIP = 400                     # characters of a decode's words (a refusal naming its values) kept or logged


def _row_of(chunk: _Chunk, info: TransferInfo) -> int:
    """The prefill's metadata row of ``chunk``'s request, an int >= 0 (a float cut to an int would send another
    request's row), where the decode named one: ``BadInput`` otherwise."""
    i = chunk.aux_index
    if type(i) is int and i >= 0 and info.dst_aux_index is not None:
        return i
    if info.dst_aux_index is None or i is None or isinstance(i, bool) or not isinstance(i, numbers.Integral) or i < 0:
        raise BadInput(f"room {chunk.room}: the last chunk has no metadata row (its index {i!r:.40})")
    return int(i)


def clip(text: str) -> str:
    """``text`` cut to ``_CLIP`` characters: a hostile registration's values never fill the log or memory."""
    return text if len(text) <= _CLIP else f"{text[:_CLIP]}... ({len(text)} characters)"


class Rooms(Protocol):
    """What the transfer thread asks of the prefill's KV manager about a room (SGLang's state of it). The
    thread never blocks the manager: none of these waits for a push."""

    def room_infos(self, room: int) -> Optional[Dict[str, TransferInfo]]:
        """The room's decode destinations as its current request named them (SGLang's ``transfer_infos``;
        None: cleared, or a dummy rank's room)."""

    def room_failed(self, room: int, unknown: bool = False) -> bool:
        """Whether the room is marked Failed; ``unknown``: the answer for a room with no status (cleared)."""

    def count_post(self, room: int) -> bool:
        """One more chunk of the room in flight (SGLang's ``_staging_outstanding``, which holds back the room's
        ABORT_ACK), unless the room is marked Failed: then False, and nothing of it may be posted. Atomic
        against an abort marking the room."""

    def uncount_posts(self, room: int, chunks: int, withhold_ack: bool) -> None:
        """``chunks`` of the room's counted chunks waited for: off its count, and the room's ABORT_ACK sent once
        none is left; ``withhold_ack``: one may still land, so the room gets no ACK (SGLang's poisoned room)."""

    def conclude_room(self, room: int, infos: Optional[Dict[str, TransferInfo]], ok: bool, reason: Optional[str],
                      gone: Container[str]) -> None:
        """SGLang's conclusion of the request whose decode destinations are ``infos`` (none: while the room is
        no longer that request's): Success where ``ok`` and no failure was recorded, else Failed with the
        recorded reason or ``reason``; its decode ranks told, but the ones in ``gone``."""

    def send_to_decode(self, info: TransferInfo, parts: List[bytes]) -> None:
        """One message on SGLang's control socket to ``info``'s decode rank (raises where it cannot go)."""

    def endpoint_changed(self, old: Optional[Tuple[str, int]], new: Optional[Tuple[str, int]]) -> None:
        """A kept decode rank's registration names endpoint ``new`` (None: none) where it named ``old``: what
        was opened to an endpoint no kept registration names any more is closed, and nothing is sent there."""


class Pushes:
    """The prefill's transfer thread (:meth:`run`) and what it alone owns: the chunks queued for it, the pushes
    posted and not yet waited for (``_posted``), the decode ranks found gone (``_dead``), and the decode ranks'
    peers. ``agent_lock`` guards the agent's calls and the peers and slots against the manager's threads;
    ``stop`` ends :meth:`run`."""

    def __init__(self, rooms: Rooms, agent: Any, agent_lock: threading.Lock, kv_args: Any, timeout_s: float,
                 stop: threading.Event, max_decode_ranks: Optional[int] = None, rows: Optional[AuxRows] = None):
        self.rooms, self.agent, self.kv_args, self.timeout_s = rooms, agent, kv_args, timeout_s
        self.rows = rows                                    # the shape of this rank's metadata rows
        self._agent_lock, self._stop = agent_lock, stop
        self._queue: "queue.Queue[_Chunk]" = queue.Queue()
        self._drains_queued: set = set()                    # rooms whose drain marker is queued, not yet taken
        self._drained: Dict[int, threading.Event] = {}      # room -> set once its queued drain ran
        self._drains_lock = threading.Lock()
        self._posted: Dict[int, _Posted] = {}               # rooms with pushes in flight
        self._dead: Dict[str, str] = {}                     # decode ranks a push found gone: told nothing more
        self._peers: Dict[str, Any] = {}                    # decode rank -> its KVPeer
        self._notify_slots: Dict[str, Optional[int]] = {}   # decode rank -> the slot its registration gave
        self._aux_rows: Dict[str, RowSegment] = {}          # decode rank -> its metadata rows, opened here
        # decode rank -> why its registration was refused (the latest ``max_decode_ranks``)
        self._rejected: "OrderedDict[str, str]" = OrderedDict()
        # decode rank kept (in ``_peers`` or ``_rejected``) -> the (ip, port) its registration came from: the one
        # endpoint a status message about the rank goes to
        self._endpoints: Dict[str, Tuple[str, int]] = {}
        # the decode ranks whose peers are kept at once (GPUXFER_SGLANG_DECODE_RANKS), and how many new ranks'
        # registrations found them all taken
        self.max_decode_ranks = int(config.get("GPUXFER_SGLANG_DECODE_RANKS") if max_decode_ranks is None
                                    else max_decode_ranks)
        self.refused_over_cap = 0

    # ------------------------------------------------------------------ the manager's calls

    def put(self, chunk: _Chunk) -> None:
        """Queue one ``send()`` chunk (the caller does not wait)."""
        self._queue.put(chunk)

    def drain_later(self, room: int) -> threading.Event:
        """Queue the room's drain (an abort): its posted pushes waited for, then its ACK. One marker per room
        at a time: a drain already queued waits for every push posted before it runs (aborts mark the room
        Failed first, so none is posted after), so ABORTs of one room again never grow the queue. Returns an
        event set once that drain ran."""
        with self._drains_lock:
            done = self._drained.setdefault(room, threading.Event())
            if room in self._drains_queued:
                return done
            self._drains_queued.add(room)
        self._queue.put(_drain_marker(room))
        return done

    def wait_drain(self, done: threading.Event, timeout_s: float) -> bool:
        """Wait for the drain :meth:`drain_later` queued (its event ``done``): at most ``timeout_s``, and not past
        this thread's stop (a stopped thread runs no drain). Whether it ran."""
        deadline = time.monotonic() + timeout_s
        while not done.wait(min(_IDLE_S, max(deadline - time.monotonic(), 0.0))):
            if self._stop.is_set() or time.monotonic() >= deadline:
                return done.is_set()
        return True

    def add_decode(self, session: str, meta: bytes, views: Dict[str, Any], slot: Optional[int],
                   endpoint: Optional[Tuple[str, int]] = None, registration: Optional[dict] = None) -> Any:
        """Decode rank ``session``'s agent added (``views``: :func:`.layout.head_share`'s), replacing an earlier
        registration's (the rank's new process, or the same one registering again: no longer a rank found gone);
        its last push of a request bumps notification ``slot`` (None: its rooms end by their Success message);
        ``endpoint``: the (ip, port) its registration came from (None: none to answer it at); ``registration``:
        its geometry, naming its metadata rows in host memory where it keeps them (opened here on the IPC route:
        ``BadMetadata`` where they are not that rank's agent's).
        Returns the peer. A rank new here while ``max_decode_ranks`` are kept takes the place of one found gone;
        where none is, ``BadInput`` (counted in ``refused_over_cap``), nothing of the rank added."""
        if session not in self._peers and len(self._peers) >= self.max_decode_ranks:
            gone = next((s for s in self._peers if s in self._dead), None)
            if gone is None:
                self.refused_over_cap += 1
                raise BadInput(f"{len(self._peers)} decode ranks are registered here, as many as "
                               f"GPUXFER_SGLANG_DECODE_RANKS allows ({self.refused_over_cap} new rank(s) refused "
                               "so far)")
            log.warning("gpuxfer: decode rank %s, found gone, dropped for decode rank %s (%d decode ranks are "
                        "registered here, GPUXFER_SGLANG_DECODE_RANKS)", gone, session, len(self._peers))
            self.refuse_decode(gone, f"it was found gone ({self._dead[gone]}), and its peer dropped for a new rank")
        with self._agent_lock:
            old = self._peers.pop(session, None)
            if old is not None:
                self.agent.remove_peer(old)
            self._peers[session] = peer = self.agent.add_peer(meta, **views)
            self._notify_slots[session] = slot
            self._set_rows(session, None)
            if self.rows is not None and registration and peer.route == "ipc":
                self._set_rows(session, self.rows.open_peer(registration, peer.meta.uid))
        self._rejected.pop(session, None)
        self._set_endpoint(session, endpoint)
        self._dead.pop(session, None)
        return peer

    def refuse_decode(self, session: str, why: str, endpoint: Optional[Tuple[str, int]] = None,
                      registered: bool = False) -> None:
        """Decode rank ``session`` does not pair: its rooms fail with ``why`` (clipped; the latest
        ``max_decode_ranks`` refusals are kept, an older one's rooms fail as of a rank that never registered), an
        earlier registration's peer removed (it no longer describes the rank). ``registered``: a registration of
        the rank was refused, which came from ``endpoint`` (None: none to answer it at); otherwise the rank's
        endpoint stays the one it registered from."""
        self._rejected[session] = clip(why)
        self._rejected.move_to_end(session)
        if registered:
            self._set_endpoint(session, endpoint)
        while len(self._rejected) > self.max_decode_ranks:
            self._set_endpoint(self._rejected.popitem(last=False)[0], None)
        with self._agent_lock:
            old = self._peers.pop(session, None)
            self._notify_slots.pop(session, None)
            self._set_rows(session, None)
            if old is not None:
                self.agent.remove_peer(old)
        self._dead.pop(session, None)

    def _set_rows(self, session: str, segment: Optional[RowSegment]) -> None:
        """Decode rank ``session``'s metadata rows opened here: ``segment`` (None: none, its requests' rows go on
        the control socket), an earlier one closed (under the agent lock, as every write into them)."""
        old = self._aux_rows.pop(session, None)
        if old is not None and old is not segment:
            old.close()
        if segment is not None:
            self._aux_rows[session] = segment

    def _set_endpoint(self, session: str, endpoint: Optional[Tuple[str, int]]) -> None:
        """Every change of the endpoints kept goes through here: the manager closes what it opened to one no
        kept registration names any more (:meth:`Rooms.endpoint_changed`)."""
        old = self._endpoints.pop(session, None)
        if endpoint is not None:
            self._endpoints[session] = endpoint
        if old != endpoint:
            self.rooms.endpoint_changed(old, endpoint)

    def endpoint(self, session: str) -> Optional[Tuple[str, int]]:
        """The (ip, port) decode rank ``session`` registered from (None: no registration of it is kept, or it
        named none)."""
        return self._endpoints.get(session)

    def pool_pages(self, session: str) -> int:
        """How many pages of the KV pool decode rank ``session`` registered (0: none, or no such rank)."""
        group = getattr(self._peers.get(session), "groups", {}).get(GROUP)
        return 0 if group is None else int(group.num_blocks)

    def refusal(self, session: str) -> Optional[str]:
        """Why decode rank ``session`` cannot be written (None: its registration was taken)."""
        if session in self._peers:
            return None
        return self._rejected.get(session, "its registration never arrived")

    def decode_ranks(self) -> int:
        """How many decode ranks' registrations were taken."""
        return len(self._peers)

    def run(self) -> None:
        """The transfer thread: the queue's items in order until ``stop``. The rooms that ended without a
        marker are drained after each item once their pushes are over (a steady stream of other rooms'
        chunks never holds them), and when idle whatever their pushes' state."""
        held: Optional[_Chunk] = None   # taken off the queue behind chunks it could not join: handled next
        while not self._stop.is_set():
            if held is None:
                try:
                    held = self._queue.get(timeout=_IDLE_S)
                except queue.Empty:
                    self._drain_ended_rooms()
                    continue
            chunk, held = coalesce(held, self._queue)
            self._handle(chunk)
            self._drain_ended_rooms(block=False)
        # Stopped (teardown): the pushes still posted are not waited for here; the agent's close drains every
        # post it queued before it frees anything.

    # ------------------------------------------------------------------ the thread's own

    def _handle(self, chunk: _Chunk) -> None:
        """One item of the queue; an error fails the chunk's request, never the thread."""
        try:
            self._transfer(chunk)
        except Exception as exc:                # noqa: BLE001 - a room's failure, never the thread's end
            log.error("gpuxfer: room %s failed: %s: %s", chunk.room, type(exc).__name__, exc)
            self._drain(chunk.room)             # normally drained already; never concluded with a push in flight
            self.rooms.conclude_room(chunk.room, chunk.infos, False, f"{type(exc).__name__}: {exc}", self._dead)

    def _transfer(self, chunk: _Chunk) -> None:
        """Post one chunk's pushes and return without waiting for them. The room's posts are waited for only
        when it is concluded (its last chunk, a failure, an abort), before its Success status goes to the
        decode; the decode ends it earlier only by the notification word its last push writes after every
        byte."""
        room = chunk.room
        if chunk.pages is None:         # an abort: wait for what was posted, then the ACK
            with self._drains_lock:     # (an abort from now on queues a drain again)
                self._drains_queued.discard(room)
                done = self._drained.pop(room, None)
            try:
                self._drain(room)
            finally:
                if done is not None:
                    done.set()
            return
        infos = self.rooms.room_infos(room)
        if infos is None:               # cleared by its sender, or a dummy rank with nothing to send
            self._drain(room)
            return
        if infos is not chunk.infos:    # queued by an earlier request of this room id, cleared since
            return
        earlier = self._posted.get(room)
        if earlier is not None and earlier.infos is not infos:
            self._drain(room, earlier=True)     # an earlier request's pushes: waited for, never this one's
        if chunk.wait_event is not None and not self.rooms.room_failed(room):
            self._wait_source(chunk)    # before the count below: an abort during the wait posts nothing
        if not self.rooms.count_post(room):     # counted before the post: an abort from now on waits for it
            # aborted here or by the decode: nothing more posted; tell the decode once, on the last chunk,
            # after the pushes already posted were waited for
            self._drain(room)
            if chunk.is_last:
                self.rooms.conclude_room(room, infos, False, "Aborted", self._dead)
            return
        posted = self._posted.setdefault(room, _Posted(infos))
        posted.chunks += 1
        start = chunk.index_slice.start
        if start != posted.sent:
            # a chunk of the request was never posted (SGLang's send() before the decode named its pages: queued with
            # no destination, dropped): the pages there would never be written, and the last push's word and Success
            # would say they were
            raise BadInput(f"room {room}: a chunk sends pages {start}..{chunk.index_slice.stop} of the decode's "
                           f"list; its pages from {posted.sent} on were never sent (a chunk sent before the decode "
                           "named them)")
        posted.sent = chunk.index_slice.stop
        for info in infos.values():
            if not info.is_dummy:
                try:
                    h = self._post(chunk, info)
                except PeerLost as exc:
                    self._dead[info.session] = f"{type(exc).__name__}: {exc}"
                    raise                       # _handle drains the room, then concludes it Failed
                if h is not None:
                    posted.handles.append((info, h))
        if not chunk.is_last:
            return
        errors = self._drain(room)
        if errors:
            raise errors[0]             # the first error of any of the room's chunks fails the room
        self.rooms.conclude_room(room, infos, True, "Aborted", self._dead)     # Failed where aborted meanwhile

    def _wait_source(self, chunk: _Chunk) -> None:
        """Wait (bounded by ``timeout_s``) for the event SGLang handed with the chunk: its pages are written
        by the forward pass it was recorded behind. Polled, not synchronized on, so a forward that never
        ends fails the room instead of holding this thread."""
        deadline = time.monotonic() + self.timeout_s
        pause = 20e-6
        while not chunk.wait_event.query():
            if time.monotonic() > deadline:
                raise TransferTimeout(rank=0, step=0, flag=f"room {chunk.room}'s source KV", expected=1, seen=0,
                                      timeout_s=self.timeout_s,
                                      what="the forward pass writing the chunk's pages did not finish")
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
        chunk.wait_event = None

    def _drain(self, room: int, earlier: bool = False) -> List[GpuxferError]:
        """Wait for every push of ``room`` still posted (together bounded by ``timeout_s``), then take the
        room's chunks off its count, which sends an ABORT_ACK that waited on them (:meth:`Rooms.uncount_posts`).
        Returns the posts' errors, first posted first. A push that did not complete in time may still land: an
        ACK would let the decode reuse pages it can write, so the room's ACK is withheld (SGLang's poisoned
        room: the decode releases them on its own timeout). ``earlier``: the pushes are an earlier request's of
        the room id, whose count and ACK state SGLang dropped when the new request began: they are waited for,
        their errors logged, and the new request's state is left alone."""
        posted = self._posted.pop(room, None)
        if posted is None:
            return []
        errors: List[GpuxferError] = []
        timed_out = False
        deadline = time.monotonic() + self.timeout_s
        for info, h in posted.handles:
            try:
                h.wait(max(deadline - time.monotonic(), 1e-3))
            except Exception as exc:            # noqa: BLE001 - every push is accounted for, whatever it raised
                if isinstance(exc, PeerLost):
                    self._dead[info.session] = f"{type(exc).__name__}: {exc}"
                slot = getattr(getattr(h, "transfer", None), "notify_slot", None)
                if getattr(h, "notify_value", None) is not None and slot is not None:
                    # the value its room's row announced may never be written, and a later room's would cover it
                    # (the decode would end this room by it): that rank's rooms end by their Success message
                    log.warning("gpuxfer: room %s: its last push to %s failed; notification %s is used no more",
                                room, info.session, slot)
                    self._retire_slot(info.session, slot)
                # a wait can raise before the push ended (a failed agent raises at once): only a push seen
                # complete lets the room's ACK go
                timed_out = timed_out or isinstance(exc, TransferTimeout) or not self._push_ended(h)
                errors.append(exc if isinstance(exc, GpuxferError) else GpuxferError(f"{type(exc).__name__}: {exc}"))
        if earlier:
            for exc in errors:
                log.warning("gpuxfer: room %s: a push of an earlier request of the room id failed: %s: %s", room,
                            type(exc).__name__, exc)
            return []
        self.rooms.uncount_posts(room, posted.chunks, timed_out)
        return errors

    def _push_ended(self, h) -> bool:
        """Whether the work a push queued is over: its event completed, or failed on the device (an IPC peer);
        NIXL reported it done (a NIXL peer, whose handle has no event). A NIXL push that ended in error is not
        proven over: NIXL cannot recall what it issued, and part of it may still land."""
        if h.event is None:
            try:
                return bool(h.done())
            except Exception:       # noqa: BLE001 - an error, NIXL's among them: not proven over
                return False
        try:
            return bool(self.agent.platform.event_query(h.event))
        except GpuxferError:
            return True
        except Exception:           # noqa: BLE001 - unknown: not proven over
            return False

    def _drain_ended_rooms(self, block: bool = True) -> None:
        """Drain the rooms with pushes posted that ended without a marker reaching this thread (failed or
        cleared while their chunks stopped coming), so none holds its ACK or its count; not ``block``: only
        those whose pushes are all over (waiting for them returns at once). An error is logged, never the
        thread's end."""
        try:
            for room, posted in list(self._posted.items()):
                current = self.rooms.room_infos(room)
                earlier = current is not None and current is not posted.infos     # a new request of the room id's
                if ((earlier or self.rooms.room_failed(room, unknown=True))
                        and (block or all(self._settled(h) for _, h in posted.handles))):
                    self._drain(room, earlier=earlier)
        except Exception as exc:        # noqa: BLE001 - never the thread's end
            log.error("gpuxfer: draining ended rooms failed: %s: %s", type(exc).__name__, exc)

    def _settled(self, h) -> bool:
        """Whether waiting for push ``h`` returns at once: it completed, or ended in an error (which its wait
        raises; :meth:`_push_ended` still decides whether it is proven over)."""
        try:
            return bool(h.done() if h.event is None else self.agent.platform.event_query(h.event))
        except Exception:           # noqa: BLE001 - an error its wait raises at once
            return True

    def _post(self, chunk: _Chunk, info: TransferInfo):
        """Post one chunk's push to one decode rank (None: no pages of it for that rank). A last chunk's push carries
        the rank's notification and, where the rank registered its metadata rows, the room's rows (stamped with the
        value that push's notification will write: only this thread notifies); elsewhere the room's row goes first
        on the control socket with that value, so it travels while the push runs. A push that then fails takes the
        slot out of use: the value announced is never written. Only an IPC peer's notification follows every earlier
        push of the stream; a NIXL peer's would follow the last transfer alone, so its rooms end by their Success
        message."""
        if info.session in self._dead:
            raise GpuxferError(f"decode rank {info.session} is gone ({self._dead[info.session]})")
        peer = self._peers.get(info.session)
        if peer is None:
            why = self._rejected.get(info.session, "its registration never arrived")
            raise BadInput(f"decode rank {info.session} cannot be written: {why}")
        dst = info.dst_kv_indices[chunk.index_slice]
        # every page the decode named is written: the last chunk ends where its list ends
        if len(dst) != len(chunk.pages) or (chunk.is_last and chunk.index_slice.stop != len(info.dst_kv_indices)):
            raise BadInput(f"room {chunk.room}: the decode named {len(info.dst_kv_indices)} pages; this "
                           f"{'last ' if chunk.is_last else ''}chunk sends pages "
                           f"{chunk.index_slice.start}..{chunk.index_slice.stop}")
        if not len(dst):
            if chunk.is_last:
                self._send_aux(chunk, info, None)
            return None
        name = f"room {chunk.room} pages {chunk.index_slice.start}+{len(dst)}"
        if not chunk.is_last:
            with self._agent_lock:
                return self.agent.prepare(peer, "push", local_blocks={GROUP: chunk.pages},
                                          remote_blocks={GROUP: dst}, name=name).post()
        token = info.stamp_token
        one_rank = sum(not i.is_dummy for i in chunk.infos.values()) == 1      # (one decode rank: one stamp)
        with self._agent_lock:          # the peer, its slot and its rows as the control thread last set them
            peer = self._peers.get(info.session, peer)
            slot = self._notify_slots.get(info.session) if peer.route == "ipc" else None
            value = None if slot is None else peer.next_notification(slot)
            rows_there = self._aux_rows.get(info.session)
            in_rows = slot is not None and rows_there is not None and token is not None and one_rank
            if in_rows:
                # the rows into the decode's host memory, stamped with the value the push below writes
                row = _row_of(chunk, info)
                if not 0 <= info.dst_aux_index < rows_there.rows:
                    raise BadInput(f"room {chunk.room}: the decode names metadata row {info.dst_aux_index}; it "
                                   f"registered {rows_there.rows}")
                self.rows.write(rows_there, int(info.dst_aux_index), row, token, slot, value)
        if not in_rows:
            self._send_aux(chunk, info, None if slot is None else (slot, value))
        try:
            with self._agent_lock:
                if slot is not None:
                    self._after_earlier_pushes(chunk.room, info.session)
                h = self.agent.prepare(peer, "push", local_blocks={GROUP: chunk.pages}, remote_blocks={GROUP: dst},
                                       name=name, notify_slot=slot).post()
        except BaseException:
            if slot is not None:
                self._retire_slot(info.session, slot)
            raise
        if slot is not None and h.notify_value != value:        # only this thread notifies: never expected
            log.error("gpuxfer: room %s: its push to %s wrote notification %s, not the %s announced; that rank's "
                      "rooms end by their Success message from now on", chunk.room, info.session,
                      h.notify_value, value)
            self._retire_slot(info.session, slot)
        return h

    def _after_earlier_pushes(self, room: int, session: str) -> None:
        """The agent's stream (where the room's last push goes next) waits for the room's pushes already posted to
        decode rank ``session`` (under the agent lock): the value that push's notification writes says every
        page of the room landed, so where one of them failed (a push of the host emulation fails alone, later
        work running) the last push fails with it, its notification unwritten."""
        posted = self._posted.get(room)
        for info, h in (posted.handles if posted is not None else ()):
            if info.session == session and getattr(h, "event", None) is not None:
                h.stream_wait(self.agent.stream)

    def _retire_slot(self, session: str, slot: int) -> None:
        """No more notifications to ``slot`` of decode rank ``session`` (a value announced may never be written,
        or was written by another post): its rooms end by their Success message (a new registration of the rank
        brings a fresh slot)."""
        with self._agent_lock:
            if self._notify_slots.get(session) == slot:
                self._notify_slots[session] = None

    def _send_aux(self, chunk: _Chunk, info: TransferInfo, landing: Optional[tuple]) -> None:
        """The room's metadata row on the control socket, ahead of its Success status on the same socket (the
        decode's thread writes it on arrival), with ``landing``: ``(slot, value)``, the notification word the
        room's last push to that rank bumps and the value it writes once every push of the room landed (None:
        the room ends by its Success message)."""
        rows = read_aux_rows(self.kv_args, _row_of(chunk, info))
        head = [str(chunk.room).encode("ascii"), str(info.dst_aux_index).encode("ascii"), landing_frame(landing)]
        # the decode's token for the request: it writes the row for that request alone (none: a decode that
        # named none reads the row without it)
        parts = [AUX_TAG, *head, info.token, *rows] if info.token else [AUX_TAG_V2, *head, *rows]
        self.rooms.send_to_decode(info, parts)
