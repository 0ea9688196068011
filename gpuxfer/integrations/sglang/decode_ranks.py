"""The SGLang backend's prefill record of its decode ranks (:class:`DecodeRanks`): their registrations, checked
and handed to the transfer thread's peers (:class:`.pushes.Pushes`), and the destinations their metadata
messages name for each room, checked, kept within bounds or refused, and answered. What a broken or hostile
decode can make a prefill keep is bounded here: rooms no request holds (:class:`.requests.Unrequested`), the
ranks whose messages go unanswered. No SGLang here: SGLang's state of each room is the prefill's KV manager's
(:mod:`.conn`), read and changed through it (:class:`PrefillRooms`), SGLang's ``KVPoll`` values handed in.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from typing import Any, Dict, List, Optional, Protocol

import numpy as np

from ... import config
from ...errors import BadInput, GpuxferError
from .landing import parse_slot
from .layout import GROUP, decode_registration, destinations, geometry_differences, head_share
from .pushes import Pushes, clip
from .requests import MAX_SESSION_BYTES, TransferInfo, Unrequested, ascii_frame

log = logging.getLogger("gpuxfer.sglang")

# the pages a decode rank's rooms that no request here holds name together, in its KV pools: its live requests'
# pages are its pool's at most (no page is two requests'), and rooms it gave up may name them again meanwhile
UNREQUESTED_POOLS = 2


def _same_destination(a: TransferInfo, b: TransferInfo) -> bool:
    """Whether two metadata messages of one decode rank's request name the same destination."""
    return ((a.endpoint, a.dst_port, a.dst_aux_index, a.required_dst_info_num, a.is_dummy, a.decode_prefix_len)
            == (b.endpoint, b.dst_port, b.dst_aux_index, b.required_dst_info_num, b.is_dummy, b.decode_prefix_len)
            and np.array_equal(a.dst_kv_indices, b.dst_kv_indices))


class PrefillRooms(Protocol):
    """What :class:`DecodeRanks` asks of the prefill's KV manager: SGLang's state of a room
    (``CommonKVManager``'s), this rank's geometry and KV heads (:mod:`.layout`), and its transfer thread."""

    transfer_infos: Dict[int, Dict[str, TransferInfo]]
    request_status: Dict[int, Any]
    req_to_decode_prefix_len: Dict[int, int]
    failure_records: Dict[int, str]
    failure_lock: Any
    geometry: Dict[str, Any]
    kv_heads: tuple
    pushes: Pushes

    def room_failed(self, room: int, unknown: bool = False) -> bool: ...

    def record_failure(self, bootstrap_room: int, failure_reason: str) -> None: ...

    def update_status(self, bootstrap_room: int, status: Any) -> None: ...

    def resolve_kv_replica_factor(self, transfer_infos: Dict) -> None: ...

    def conclude_failure(self, *, bootstrap_room: int, failure_reason: str) -> Any: ...

    def send_kv_status_message(self, *, targets: List[tuple], bootstrap_room: int, status: Any,
                               failure_reason: Optional[str] = None,
                               infos: Optional[List[TransferInfo]] = None) -> None: ...


class DecodeRanks:
    """A prefill rank's decode ranks and the rooms they name. ``lock``: the one a room's Failed mark takes against
    a chunk's count and a request's taking of its room (the manager's too); ``requested``: the rooms requests
    (senders) hold here, how many each; ``unrequested``: the rooms decode ranks named that none holds
    (bounded); ``dst_counts``: how many decode ranks each registered rank's rooms name (None: it says no TP
    size); ``unanswered``: how many refused metadata messages named an endpoint no kept registration of their
    rank came from (not answered: a reply would open a socket to wherever the message says), logged once per
    rank of ``unanswered_ranks``."""

    def __init__(self, rooms: PrefillRooms, kv_poll: Any, max_age_s: float):
        self.rooms, self.kv_poll = rooms, kv_poll
        self.lock = threading.Lock()
        self.requested: Counter = Counter()
        self.unrequested = Unrequested(config.get("GPUXFER_SGLANG_UNREQUESTED_ROOMS"), max_age_s)
        self.dst_counts: Dict[str, Optional[int]] = {}
        self.unanswered = 0
        self.unanswered_ranks: "OrderedDict[str, None]" = OrderedDict()

    def on_registration(self, msg: List[bytes]) -> None:
        """A decode rank's KV pool: its geometry checked against ours, then its agent added (its memory
        mapped; milliseconds), within the decode ranks a prefill rank keeps (:meth:`.pushes.Pushes.add_decode`).
        A rank that does not pair is remembered with the reason its rooms fail for; one whose name no SGLang rank
        has (SGLang's ``ip:port``) is dropped, nothing of it kept. A rank kept, taken or refused, keeps the
        endpoint its registration names (ip, port): the one its rooms' status messages go to."""
        if len(msg) < 4 or len(msg[3]) > MAX_SESSION_BYTES:
            log.error("gpuxfer: a decode registration of %d frames naming a %d-byte rank dropped", len(msg),
                      len(msg[3]) if len(msg) > 3 else 0)
            return
        session = ascii_frame(msg[3], "decode rank")
        endpoint = None
        try:
            endpoint = (msg[1].decode("ascii"), int(msg[2].decode("ascii")))
            if len(msg[1]) > MAX_SESSION_BYTES or not 0 < endpoint[1] < 65536:
                endpoint = None
                raise BadInput(f"the registration names no endpoint (ip {msg[1][:64]!r}, port {msg[2][:16]!r})")
            geom, meta = decode_registration(msg[4] if len(msg) > 4 else b"")
            slot = parse_slot(msg[5] if len(msg) > 5 else b"")
            diffs = geometry_differences(self.rooms.geometry, geom)
            if diffs:
                raise BadInput("the decode's KV pool does not pair page for page with this prefill's: "
                               + "; ".join(diffs))
            views = head_share(self.rooms.geometry, geom, *self.rooms.kv_heads)
            dsts = destinations(self.rooms.geometry, geom)
            peer = self.rooms.pushes.add_decode(session, meta, views, slot, endpoint, registration=geom)
            self.dst_counts[session] = dsts
            for dropped in [s for s in self.dst_counts if self.rooms.pushes.refusal(s) is not None]:
                del self.dst_counts[dropped]       # a rank found gone whose place this one took
            log.info("gpuxfer: decode rank %s added (%s route, %s engine%s)", session, peer.route, peer.engine,
                     f"; bytes {views['local_token_slice'][GROUP]} of each token's row here to bytes "
                     f"{views['token_slice'][GROUP]} of the decode's" if views else "")
        except Exception as exc:        # noqa: BLE001 - whatever the registration raised, the rank is refused
            why = clip(f"{type(exc).__name__}: {exc}")
            if isinstance(exc, GpuxferError):
                log.error("gpuxfer: refusing decode rank %s: %s", session, why)
            else:
                log.exception("gpuxfer: refusing decode rank %s: %s", session, why)
            self.dst_counts.pop(session, None)
            # an earlier registration of the rank no longer describes it
            self.rooms.pushes.refuse_decode(session, why, endpoint, registered=True)

    def _refusal(self, info: TransferInfo) -> Optional[str]:
        """Why decode rank ``info.session``'s destination cannot be taken (None: it can): the rank's
        registration was refused or never came (the rank registers on the socket its metadata follows), the
        message names another endpoint than the registration came from, its pages are not pages of the pool it
        registered (:meth:`_pages_refusal`), its decode prefix length is negative, or the message names another
        number of decode ranks for the room than SGLang's rank mapping gives for the two ranks' TP sizes (at most
        the decode ranks registered, where the rank states no TP size)."""
        why = self.rooms.pushes.refusal(info.session)
        if why is None and self.rooms.pushes.endpoint(info.session) != (info.endpoint, info.dst_port):
            why = f"it names endpoint {info.endpoint}:{info.dst_port}, not the one it registered from"
        why = why or self._pages_refusal(info)
        if why is None and (info.decode_prefix_len or 0) < 0:
            # SGLang's prefill would start the request's sends there, and count its pages from the prompt less
            # it: no chunk would ever be the last, and the request would hold its KV with no timeout
            why = f"it names a decode prefix length of {info.decode_prefix_len} tokens"
        if why is not None:
            return why
        named, need = info.required_dst_info_num, self.dst_counts.get(info.session)
        if need is None:
            have = self.rooms.pushes.decode_ranks()
            if not 1 <= named <= have:
                return f"it names {named} decode ranks for the room, {have} are registered here"
        elif named != need:
            return f"it names {named} decode ranks for the room, its attention TP size against this rank's makes {need}"
        return None

    def _pages_refusal(self, info: TransferInfo) -> Optional[str]:
        """Why the decode pages ``info`` names are no pages of the pool its rank registered (None: they are):
        more pages than the pool holds, a page outside it, or one named twice (each chunk's push sees its own
        pages only). The list is a view of the message; what is allocated to check it is bounded by the pool."""
        pages = info.dst_kv_indices
        if info.is_dummy or not pages.size:
            return None
        pool = self.rooms.pushes.pool_pages(info.session)
        if pages.size > pool:
            return f"it names {pages.size} pages, its KV pool holds {pool}"
        low, high = int(pages.min()), int(pages.max())
        if low < 0 or high >= pool:
            return f"it names page {low if low < 0 else high}, outside its {pool}-page KV pool"
        if np.unique(pages).size != pages.size:
            return "it names one of its pages more than once"
        return None

    def check_page_counts(self, room: int, pages: int) -> None:
        """The request of ``room`` sends ``pages`` pages (SGLang's sender ``init``, once every decode rank named
        its own): a decode rank that named another number fails the room before any push (its last pages would
        never be written, or the first ones written for nothing)."""
        infos = self.rooms.transfer_infos.get(room) or {}
        bad = next((i for i in infos.values() if not i.is_dummy and len(i.dst_kv_indices) != pages), None)
        if bad is not None:
            reason = (f"decode rank {bad.session} named {len(bad.dst_kv_indices)} pages for room {room}, whose "
                      f"request sends {pages}")
            log.warning("gpuxfer: %s", reason)
            self.rooms.conclude_failure(bootstrap_room=room, failure_reason=reason)

    def on_transfer_info(self, info: TransferInfo) -> None:
        """A decode rank's destination for a room (its metadata message). A destination that cannot be taken
        (:meth:`_refusal`), or one more than the room has, is stored nowhere: that rank is told Failed, and the
        room fails where a request holds it (or another rank's destination). A room no request holds here yet
        is kept within :class:`.requests.Unrequested`'s bounds."""
        refusal, known, again, dropped, budget = self._refusal(info), None, False, [], 0
        with self.lock:
            infos = self.rooms.transfer_infos.get(info.room) or {}
            if refusal is not None:
                reason = f"decode rank {info.session} cannot be written room {info.room}: {refusal}"
                fail = bool(infos) or bool(self.requested.get(info.room))
            else:
                need = next(iter(infos.values()), info).required_dst_info_num
                known = infos.get(info.session)
                again = known is not None and known.token == info.token
                # more decode ranks than the room has (a room id two requests drew, or a forged claim), a
                # decode rank's new request of a room id its earlier request still holds here (that one was
                # given up there), or its request's destination named again, differently (pushes may already
                # have gone to the first): none may be written another's KV, so the room fails for all of them
                fail = ((known is None and (len(infos) >= need or info.required_dst_info_num != need))
                        or (known is not None and not again) or (again and not _same_destination(known, info)))
                reason = (f"decode rank {info.session} claims room {info.room}, which {len(infos)} decode rank(s) "
                          f"{sorted(infos)} of {need} already claimed"
                          + ("" if known is None else " for another of its requests" if not again else
                             ", naming other pages or rows for the same request")) if fail else None
                # the prefill sends every decode rank of the room the request's tokens from one prefix length on
                # (SGLang's first named): a rank naming another would be written other tokens than it asked for
                prefix = next((i.decode_prefix_len or 0 for i in infos.values()), None)
                if not fail and known is None and prefix is not None and (info.decode_prefix_len or 0) != prefix:
                    fail = True
                    reason = (f"decode rank {info.session} names a decode prefix length of "
                              f"{info.decode_prefix_len or 0} tokens for room {info.room}, its other decode ranks "
                              f"{sorted(infos)} {prefix}")
            if fail and self.rooms.request_status.get(info.room) != self.kv_poll.Success:
                self.rooms.record_failure(info.room, reason)
                self.rooms.update_status(info.room, self.kv_poll.Failed)
            if refusal is None and not fail and not again:     # the same message again changes nothing
                # staged once for every push of the room: an int64 array of its own (the agent takes such IDs
                # as they are, where it converts any other type at each push), no longer a view of the message
                info.dst_kv_indices = np.array(info.dst_kv_indices, dtype=np.int64)
                infos = self.rooms.transfer_infos.setdefault(info.room, infos)
                infos[info.session] = info
                if len(infos) == info.required_dst_info_num:
                    self.rooms.resolve_kv_replica_factor(infos)
                    self.rooms.req_to_decode_prefix_len[info.room] = next(
                        (i.decode_prefix_len for i in infos.values() if i.decode_prefix_len is not None), 0)
                    self.rooms.update_status(info.room, self.kv_poll.WaitingForInput)
                if self.requested.get(info.room) and self.rooms.room_failed(info.room):
                    # the request here failed (its abort) before this rank named its pages: told now, not at its
                    # waiting timeout
                    with self.rooms.failure_lock:
                        reason = self.rooms.failure_records.get(info.room) or "the prefill's request of the room failed"
            # a room no request holds is bounded by the registered ranks whose destinations it holds (a
            # refused one's is none, and its session name may be any), in rooms and in the pages they name
            if refusal is None and not self.requested.get(info.room):
                kept = (self.rooms.transfer_infos.get(info.room) or {}).get(info.session)
                pages = 0 if kept is None else len(kept.dst_kv_indices)
                budget = UNREQUESTED_POOLS * self.rooms.pushes.pool_pages(info.session)
                dropped = self._drop_unrequested(self.unrequested.note(info.session, info.room, pages, budget))
        if dropped:
            log.warning("gpuxfer: decode rank %s named pages for more than %d rooms, or %d pages, that no request "
                        "here holds: dropped its oldest, room(s) %s", info.session, self.unrequested.max_rooms,
                        budget, dropped[:8])
        if refusal is not None:
            log.warning("gpuxfer: %s", reason)
        if reason is not None and not info.is_dummy:
            if self.rooms.pushes.endpoint(info.session) == (info.endpoint, info.dst_port):
                self.rooms.send_kv_status_message(targets=[(info.endpoint, info.dst_port)], bootstrap_room=info.room,
                                            status=self.kv_poll.Failed, failure_reason=reason, infos=[info])
            else:
                self._unanswered(info)

    def keeps_ack_target(self, kept: Optional[Dict], target: Any) -> bool:
        """Whether an ABORT's return address ``target`` (SGLang's ``AckTarget``) joins a room's deferred ACK
        targets ``kept`` (SGLang's, by ip and port, kept until the room's pushes were waited for): one already
        kept (a later generation) always; a new one only as the room's ``max_decode_ranks``-th at most, its ip at
        most ``MAX_SESSION_BYTES`` (each ABORT naming an address of its own would otherwise keep one more)."""
        if len(target.ip) > MAX_SESSION_BYTES:
            return False
        kept = kept or {}
        return (target.ip, target.port) in kept or len(kept) < self.rooms.pushes.max_decode_ranks

    def _unanswered(self, info: TransferInfo) -> None:
        """A refused metadata message whose rank never registered, or that names another endpoint than the
        rank registered from: not answered (its decode, if any, fails the room by its own timeout), counted,
        logged once per rank (of the latest ranks: what is kept of them is bounded)."""
        self.unanswered += 1
        if info.session in self.unanswered_ranks:
            return
        self.unanswered_ranks[info.session] = None
        while len(self.unanswered_ranks) > self.rooms.pushes.max_decode_ranks:
            self.unanswered_ranks.popitem(last=False)
        log.warning("gpuxfer: refused metadata messages of decode rank %s naming endpoint %s:%s are not answered: "
                    "no registration of the rank came from there (%d unanswered so far)", clip(info.session),
                    clip(info.endpoint), info.dst_port, self.unanswered)

    def _drop_unrequested(self, rooms: List[int]) -> List[int]:
        """Everything kept of ``rooms``, which no request holds here (under the room lock): their decode
        destinations and the status and failure those made. Returns the rooms dropped."""
        out = [room for room in rooms if not self.requested.get(room)]
        for room in out:
            self.rooms.transfer_infos.pop(room, None)
            self.rooms.request_status.pop(room, None)
            self.rooms.req_to_decode_prefix_len.pop(room, None)
            with self.rooms.failure_lock:
                self.rooms.failure_records.pop(room, None)
        return out

    def expire(self) -> None:
        """The rooms decode ranks named longer than the waiting timeout ago that no request took since: by
        then their decode gave them up."""
        with self.lock:
            dropped = self._drop_unrequested(self.unrequested.expired())
        if dropped:
            log.warning("gpuxfer: dropped the pages decode ranks named for %d room(s) that no request here took "
                        "within %.0f s: %s", len(dropped), self.unrequested.max_age_s, dropped[:8])

    def hold(self, room: int) -> None:
        """A request (its sender) holds ``room`` here: its destinations are kept while it does."""
        with self.lock:
            self.requested[room] += 1
            self.unrequested.forget(room)

    def release(self, room: int) -> None:
        """A request let go of ``room`` (its sender cleared, after SGLang's ``clear`` dropped the room's
        destinations). A destination of the room stored in between (a message handled meanwhile: the rank's again,
        or its next request's) is from now on one of a room no request holds, kept within those bounds."""
        dropped: List[int] = []
        with self.lock:
            self.requested[room] -= 1
            if self.requested[room] > 0:
                return
            del self.requested[room]
            for session, info in list((self.rooms.transfer_infos.get(room) or {}).items()):
                budget = UNREQUESTED_POOLS * self.rooms.pushes.pool_pages(session)
                dropped += self._drop_unrequested(self.unrequested.note(session, room, len(info.dst_kv_indices),
                                                                        budget))
        if dropped:
            log.warning("gpuxfer: dropped the pages decode ranks named for %d room(s) that no request here holds, "
                        "past their bounds: %s", len(dropped), dropped[:8])
