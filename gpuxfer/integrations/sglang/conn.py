"""gpuxfer as an SGLang 0.5.23 disaggregation transfer backend: a KV manager, sender, receiver and bootstrap
server on SGLang's ``Common*`` classes. The only module of gpuxfer that imports SGLang besides the plugin
hook (:mod:`.plugin`), and SGLang imports it only once ``--disaggregation-transfer-backend gpuxfer`` chose it.

Each KV manager holds one :class:`~gpuxfer.kv.KVAgent` over SGLang's own KV pool (``KVArgs``: raw pointers,
registered with :meth:`~gpuxfer.kv.KVAgent.layer_at`, :mod:`.layout`). The prefill side pushes (SGLang's
shape): every ``send()`` chunk becomes one ``prepare`` + ``post`` of its pages onto the decode pages the
receiver named, on the transfer thread the prefill's manager owns (:class:`.pushes.Pushes`), which does not
wait for it (chunks of a request queued behind one another while the thread was busy, as a request sent back
to back, become one push). The last chunk's push also bumps the decode agent's notification word that the
decode's registration gave this prefill rank (stream order: after every push of the room landed), and its aux
metadata row goes on SGLang's control socket just before that push, with the value it will write. The
decode's ``poll()`` ends the room when the word holds that value; the prefill waits for the room's pushes,
then sends SGLang's Success status behind the row, which also ends the room where no notification could be
used (a rank past its ``NOTIFY_SLOTS`` registrations, a room of several prefill ranks, a peer on the NIXL
route, whose notification follows its last transfer alone); for a room the decode ended by its word, that
message is dropped on arrival (the room id may already be a new request's). Control messages are SGLang's
(ZMQ, the bootstrap server's ``/route``); what gpuxfer adds is the decode agent's metadata and a notification
slot in its registration, and the value in the row's message (the prefill's bootstrap thread is this
module's, its transfer thread :class:`.pushes.Pushes`)::

    decode (receiver)                           bootstrap server         prefill (manager threads)
    -----------------                           ----------------         -------------------------
                                                                         PUT /route (rank ip, ZMQ port)
    GET /route (try_ensure_parallel_info) ----> prefill rank's address
    KVReceiver.init: ["None", ip, port, session,
       geometry + agent metadata, slot k] ----------------------------> bootstrap thread: geometry checked,
                                                                          add_peer (maps decode's KV pool)
    send_metadata: [room, ip, port, session,
       decode pages, aux row, n, token t] ----------------------------> room -> WaitingForInput
                                                                         KVSender.init(pages, aux row)
                                                                         send(chunk) -> transfer thread (Pushes):
                                                                           prepare(push) + post
                                                                         ... one per chunk ...
                                                                         last chunk: v = next value of k
    decode thread: aux row written,   <----------------------------------- [AUX, room, row, "k:v", t, rows]
      room waits for word k >= v                                         post(notify_slot=k): agent stream:
                                                                           KV, then word k := v
    poll(): word k >= v -> Success                                       wait for every post of the room
    (word k written by prefill's stream)
    decode thread: dropped (ended) <-------------------------------------- [room, Success, rank, "", t]
                                                                         poll() == Success

Failures end in ``KVPoll.Failed`` on both sides, never a hang: a decode abort reaches the prefill as SGLang's
ABORT (chunks not yet posted are dropped; an ABORT_ACK follows once the posted ones were waited for); a
prefill abort or a failed push (a dead decode: ``PeerLost``) is sent to the decode as a Failed status; a dead
prefill is found by SGLang's heartbeat on the decode side, and every wait is bounded by SGLang's
disaggregation timeouts.

SGLang names a request by its room id alone, and a room id may name a new request once the last one ended. The
decode's metadata message names the request by a token of its own (``t``), which the prefill echoes in the
room's row and status messages: the decode drops those of an earlier request of the room id (late: it was
given up there first) instead of writing, landing or concluding the new one with them. On the prefill, a
request's pushes, its conclusion and its errors stay its own (``_Posted.infos``, :meth:`conclude_room`), and a
decode rank naming pages for a new request of a room id its earlier request still holds fails both.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter, OrderedDict
from typing import Any, Container, Dict, List, Optional

import numpy as np
import numpy.typing as npt
import zmq

from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import (
    ABORT_TAG,
    AbortNotification,
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
    KVTransferError,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.environ import envs
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.network import NetworkAddress

from ... import config
from ...errors import BadInput, BlockIdError, GpuxferError, ProtocolError
from ...kv import KVAgent
from .inbox import Inbox
from .landing import Landings, parse_slot, slot_frame
from .layout import (GROUP, check_supported, decode_registration, destinations, encode_registration, geometry,
                     geometry_differences, head_share, register_kv_args, total_kv_heads)
from .pushes import Pushes, clip
from .requests import MAX_SESSION_BYTES, TransferInfo, Unrequested, _Chunk

log = logging.getLogger("gpuxfer.sglang")

REGISTER_ROOM = b"None"         # SGLang's marker of a registration message (Mooncake's too)
# the pages a decode rank's rooms that no request here holds name together, in its KV pools: its live requests'
# pages are its pool's at most (no page is two requests'), and rooms it gave up may name them again meanwhile
UNREQUESTED_POOLS = 2
_RECV_POLL_MS = 200             # how often an idle control thread looks at its stop flag (a message wakes it)


def _tcp(endpoint: tuple) -> str:
    """SGLang's ``tcp://`` name of an ``(ip, port)`` endpoint (what its socket cache is keyed by)."""
    return NetworkAddress(endpoint[0], int(endpoint[1])).to_tcp()


def _same_destination(a: TransferInfo, b: TransferInfo) -> bool:
    """Whether two metadata messages of one decode rank's request name the same destination."""
    return ((a.endpoint, a.dst_port, a.dst_aux_index, a.required_dst_info_num, a.is_dummy, a.decode_prefix_len)
            == (b.endpoint, b.dst_port, b.dst_aux_index, b.required_dst_info_num, b.is_dummy, b.decode_prefix_len)
            and np.array_equal(a.dst_kv_indices, b.dst_kv_indices))


def _int32_pages(kv_indices) -> bytes:
    """A decode's page indices as its metadata message carries them (int32s); ``BlockIdError`` for any that is
    no integer or does not fit (a cast would name another page)."""
    try:
        arr = np.asarray(kv_indices)
    except (TypeError, ValueError, RuntimeError) as exc:     # e.g. a device tensor, a ragged list
        raise BlockIdError(f"decode page indices must be a 1-D array of integers: {exc}") from None
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise BlockIdError(f"decode page indices must be a 1-D array of integers, got {arr.dtype} {arr.shape}")
    if arr.size and not (0 <= int(arr.min()) and int(arr.max()) <= np.iinfo(np.int32).max):
        raise BlockIdError(f"decode page indices {int(arr.min())}..{int(arr.max())} do not fit an int32 page index")
    return np.ascontiguousarray(arr, dtype=np.int32).tobytes()


class GpuxferKVManager(CommonKVManager):
    """SGLang's per-rank KV manager with a :class:`KVAgent` over the rank's KV pool. A prefill rank's runs its
    control thread here and owns its transfer thread, ``pushes`` (:class:`.pushes.Pushes`), which it answers
    about SGLang's state of a room (:class:`.pushes.Rooms`)."""

    supports_deferred_decode_kv_release = True
    kv_status_msg_carries_reason = True         # a Failed status tells the decode why (an abort, a dead peer)

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args: ServerArgs,
                 is_mla_backend: Optional[bool] = False):
        check_supported(args)           # before the base class binds sockets and registers the rank
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        if self.defer_decode_allocation:
            raise BadInput("the gpuxfer SGLang backend supports --disaggregation-decode-allocation-policy early "
                           "only (prefill_complete is not implemented)")
        if self.kv_shard_size > 1 or self.attn_cp_size > 1 or self.pp_size > 1:
            raise BadInput("the gpuxfer SGLang backend does not support KV sharding, context or pipeline "
                           "parallelism yet")
        from ...platforms import current
        platform = current()
        self.timeout_s = float(envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get())
        self.session_id = f"{self.local_ip}:{self.rank_port}"
        mla = is_mla_backend or getattr(self, "is_hybrid_mla_backend", False)   # every rank holds all the KV
        self.geometry = geometry(args, None if mla else self.attn_tp_size, self.attn_tp_size)
        # the model's KV heads and this rank's, where its pool holds a slice of them (head slicing reads them)
        self.kv_heads = (0, 0) if mla else (total_kv_heads(args, self.attn_tp_size),
                                            int(getattr(args, "kv_head_num", 0) or 0))
        device = 0 if platform.host_memory else int(getattr(args, "gpu_id", 0) or 0)
        role = "prefill" if disaggregation_mode == DisaggregationMode.PREFILL else "decode"
        self.agent = KVAgent(f"sglang-{role}-{self.session_id}", platform=platform, device=device,
                             engine=config.get("GPUXFER_SGLANG_ENGINE"), timeout_s=self.timeout_s)
        self._agent_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: List[threading.Thread] = []
        try:
            register_kv_args(self.agent, args)
        except BaseException:
            self.agent.close()
            raise
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self._warm_up()
            self._init_rooms()
            # the transfer thread: its queue, the pushes in flight, the decode ranks' peers (:mod:`.pushes`)
            self.pushes = Pushes(self, self.agent, self._agent_lock, self.kv_args, self.timeout_s, self._stop)
            self._spawn(self._prefill_control, "gpuxfer-sglang-control")
            self._spawn(self.pushes.run, "gpuxfer-sglang-transfer")
        else:
            self._registration = encode_registration(self.geometry, self.agent.metadata())
            self.landings = Landings(self.agent.notification)
            # the prefill's messages about this rank's requests, each taken for its current request alone
            self.inbox = Inbox(self, self.landings, KVPoll)
            self._spawn(self._decode_control, "gpuxfer-sglang-control")
            self._threads.append(self._start_heartbeat_checker_thread())
        log.info("gpuxfer: SGLang %s rank %s registered %d KV entries (%d-token pages) with the %s engine",
                 role, self.session_id, len(args.kv_data_ptrs), int(args.page_size), self.agent.engine)

    def _warm_up(self) -> None:
        """The push's kernels loaded at startup, not in the first request: SGLang's padding page 0 (never
        handed out) copied onto itself. A failure here only moves that cost to the first request."""
        try:
            log.info("gpuxfer: transfer kernels loaded in %.2f s", self.agent.warm_up(block=0))
        except GpuxferError as exc:
            log.warning("gpuxfer: loading the transfer kernels at startup failed (%s: %s); the first request "
                        "loads them", type(exc).__name__, exc)

    def _init_rooms(self) -> None:
        """A prefill rank's bookkeeping of rooms beside SGLang's: the lock a room's Failed mark takes against a
        chunk's count and a request's taking of its room, the rooms requests hold here (``_requested``: how
        many senders), the rooms decode ranks named that none holds (``_unrequested``, bounded) and how many
        decode ranks each registered rank's rooms name (``_dst_counts``; None: it says no TP size)."""
        self._room_lock = threading.Lock()
        self._requested: Counter = Counter()
        self._unrequested = Unrequested(config.get("GPUXFER_SGLANG_UNREQUESTED_ROOMS"), self.timeout_s)
        self._dst_counts: Dict[str, Optional[int]] = {}
        # metadata messages refused that named an endpoint no kept registration of their rank came from: not
        # answered (a reply would open a socket to wherever the message says), counted, logged once per rank
        self.unanswered = 0
        self._unanswered_ranks: "OrderedDict[str, None]" = OrderedDict()
        # SGLang's ``tcp://`` name of each endpoint a kept decode rank registration names -> how many name it: the
        # only places a message goes and a socket is opened to (:meth:`_connect`)
        self._kept_endpoints: Counter = Counter()

    def _spawn(self, target, name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _recv_loop(self, handle, tick=None) -> None:
        """Hand each control message to ``handle`` until stopped; a message that fails is logged, never
        the end of the thread. ``tick``: run before each message and when idle (at least every
        ``_RECV_POLL_MS``)."""
        poller = zmq.Poller()
        poller.register(self.server_socket, zmq.POLLIN)
        while not self._stop.is_set():
            ready = poller.poll(_RECV_POLL_MS)
            try:
                if tick is not None:
                    tick()
                if ready:
                    msg = self.server_socket.recv_multipart()
                    try:
                        handle(msg)
                    except Exception:
                        log.exception("gpuxfer: SGLang control message %r failed", [m[:32] for m in msg[:4]])
            except Exception:
                log.exception("gpuxfer: SGLang control thread step failed")

    # ------------------------------------------------------------------ decode role

    def build_receiver_registration_message(self, notify_slot: Optional[int] = None) -> List[bytes]:
        """The registration a receiver sends a prefill rank: SGLang's fields, this rank's geometry and agent
        metadata, and ``notify_slot``, the notification word of this agent that rank's pushes bump
        (:meth:`Landings.new_slot <.landing.Landings.new_slot>`; none: its rooms end by its Success message)."""
        return [REGISTER_ROOM, self.local_ip.encode("ascii"), str(self.rank_port).encode("ascii"),
                self.session_id.encode("ascii"), self._registration, slot_frame(notify_slot)]

    def build_receiver_metadata_message(self, *, bootstrap_room: int, required_dst_info_num: int,
                                        kv_indices: npt.NDArray[np.int32], aux_index: Optional[int],
                                        state_indices: Optional[List], decode_prefix_len: Optional[int],
                                        is_dummy: bool, device_kv_indices=None) -> List[bytes]:
        if state_indices:
            raise BadInput("the gpuxfer SGLang backend does not move state buffers (state_indices given)")
        pages = b"" if is_dummy else _int32_pages(kv_indices)
        if not is_dummy and (isinstance(aux_index, bool) or not isinstance(aux_index, (int, np.integer))
                             or aux_index < 0):
            raise BadInput(f"a decode's metadata row index must be an int >= 0, got {aux_index!r:.40}")
        token = self.inbox.name_request(bootstrap_room, None if is_dummy else int(aux_index))
        return [str(bootstrap_room).encode("ascii"), self.local_ip.encode("ascii"),
                str(self.rank_port).encode("ascii"), self.session_id.encode("ascii"), pages,
                b"" if is_dummy else str(int(aux_index)).encode("ascii"),
                str(required_dst_info_num).encode("ascii"), str(decode_prefix_len or 0).encode("ascii"), token]

    def _decode_control(self) -> None:
        self._recv_loop(self.inbox.on_message)

    # ------------------------------------------------------------------ prefill role

    def _prefill_control(self) -> None:
        self._recv_loop(self._on_prefill_message, self._expire_unrequested)

    def _on_prefill_message(self, msg: List[bytes]) -> None:
        if msg and msg[0] == ABORT_TAG:
            self._on_abort(msg)
        elif msg and msg[0] == REGISTER_ROOM:
            self._on_registration(msg)
        else:
            self._on_transfer_info(TransferInfo.from_zmq(msg))

    def _on_registration(self, msg: List[bytes]) -> None:
        """A decode rank's KV pool: its geometry checked against ours, then its agent added (its memory
        mapped; milliseconds), within the decode ranks a prefill rank keeps (:meth:`.pushes.Pushes.add_decode`).
        A rank that does not pair is remembered with the reason its rooms fail for; one whose name no SGLang rank
        has (SGLang's ``ip:port``) is dropped, nothing of it kept. A rank kept, taken or refused, keeps the
        endpoint its registration names (ip, port): the one its rooms' status messages go to."""
        if len(msg) < 4 or len(msg[3]) > MAX_SESSION_BYTES:
            log.error("gpuxfer: a decode registration of %d frames naming a %d-byte rank dropped", len(msg),
                      len(msg[3]) if len(msg) > 3 else 0)
            return
        session = msg[3].decode("ascii")
        endpoint = None
        try:
            endpoint = (msg[1].decode("ascii"), int(msg[2].decode("ascii")))
            if len(msg[1]) > MAX_SESSION_BYTES or not 0 < endpoint[1] < 65536:
                endpoint = None
                raise BadInput(f"the registration names no endpoint (ip {msg[1][:64]!r}, port {msg[2][:16]!r})")
            geom, meta = decode_registration(msg[4] if len(msg) > 4 else b"")
            slot = parse_slot(msg[5] if len(msg) > 5 else b"")
            diffs = geometry_differences(self.geometry, geom)
            if diffs:
                raise BadInput("the decode's KV pool does not pair page for page with this prefill's: "
                               + "; ".join(diffs))
            views = head_share(self.geometry, geom, *self.kv_heads)
            dsts = destinations(self.geometry, geom)
            peer = self.pushes.add_decode(session, meta, views, slot, endpoint)
            self._dst_counts[session] = dsts
            for dropped in [s for s in self._dst_counts if self.pushes.refusal(s) is not None]:
                del self._dst_counts[dropped]       # a rank found gone whose place this one took
            log.info("gpuxfer: decode rank %s added (%s route, %s engine%s)", session, peer.route, peer.engine,
                     f"; bytes {views['local_token_slice'][GROUP]} of each token's row here to bytes "
                     f"{views['token_slice'][GROUP]} of the decode's" if views else "")
        except Exception as exc:        # noqa: BLE001 - whatever the registration raised, the rank is refused
            why = clip(f"{type(exc).__name__}: {exc}")
            if isinstance(exc, GpuxferError):
                log.error("gpuxfer: refusing decode rank %s: %s", session, why)
            else:
                log.exception("gpuxfer: refusing decode rank %s: %s", session, why)
            self._dst_counts.pop(session, None)
            # an earlier registration of the rank no longer describes it
            self.pushes.refuse_decode(session, why, endpoint, registered=True)

    def _refusal(self, info: TransferInfo) -> Optional[str]:
        """Why decode rank ``info.session``'s destination cannot be taken (None: it can): the rank's
        registration was refused or never came (the rank registers on the socket its metadata follows), the
        message names another endpoint than the registration came from, its pages are not pages of the pool it
        registered (:meth:`_pages_refusal`), or the message names another number of decode ranks for the room
        than SGLang's rank mapping gives for the two ranks' TP sizes (at most the decode ranks registered, where
        the rank states no TP size)."""
        why = self.pushes.refusal(info.session)
        if why is None and self.pushes.endpoint(info.session) != (info.endpoint, info.dst_port):
            why = f"it names endpoint {info.endpoint}:{info.dst_port}, not the one it registered from"
        why = why or self._pages_refusal(info)
        if why is not None:
            return why
        named, need = info.required_dst_info_num, self._dst_counts.get(info.session)
        if need is None:
            have = self.pushes.decode_ranks()
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
        pool = self.pushes.pool_pages(info.session)
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
        infos = self.transfer_infos.get(room) or {}
        bad = next((i for i in infos.values() if not i.is_dummy and len(i.dst_kv_indices) != pages), None)
        if bad is not None:
            reason = (f"decode rank {bad.session} named {len(bad.dst_kv_indices)} pages for room {room}, whose "
                      f"request sends {pages}")
            log.warning("gpuxfer: %s", reason)
            self.conclude_failure(bootstrap_room=room, failure_reason=reason)

    def _on_transfer_info(self, info: TransferInfo) -> None:
        """A decode rank's destination for a room (its metadata message). A destination that cannot be taken
        (:meth:`_refusal`), or one more than the room has, is stored nowhere: that rank is told Failed, and the
        room fails where a request holds it (or another rank's destination). A room no request holds here yet
        is kept within :class:`.requests.Unrequested`'s bounds."""
        refusal, known, again, dropped, budget = self._refusal(info), None, False, [], 0
        with self._room_lock:
            infos = self.transfer_infos.get(info.room) or {}
            if refusal is not None:
                reason = f"decode rank {info.session} cannot be written room {info.room}: {refusal}"
                fail = bool(infos) or bool(self._requested.get(info.room))
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
            if fail and self.request_status.get(info.room) != KVPoll.Success:
                self.record_failure(info.room, reason)
                self.update_status(info.room, KVPoll.Failed)
            if refusal is None and not fail and not again:     # the same message again changes nothing
                infos = self.transfer_infos.setdefault(info.room, infos)
                infos[info.session] = info
                if len(infos) == info.required_dst_info_num:
                    self.resolve_kv_replica_factor(infos)
                    self.req_to_decode_prefix_len[info.room] = next(
                        (i.decode_prefix_len for i in infos.values() if i.decode_prefix_len is not None), 0)
                    self.update_status(info.room, KVPoll.WaitingForInput)
                if self._requested.get(info.room) and self.request_status.get(info.room) == KVPoll.Failed:
                    # the request here failed (its abort) before this rank named its pages: told now, not at its
                    # waiting timeout
                    with self.failure_lock:
                        reason = self.failure_records.get(info.room) or "the prefill's request of the room failed"
            # a room no request holds is bounded by the registered ranks whose destinations it holds (a
            # refused one's is none, and its session name may be any), in rooms and in the pages they name
            if refusal is None and not self._requested.get(info.room):
                kept = (self.transfer_infos.get(info.room) or {}).get(info.session)
                pages = 0 if kept is None else len(kept.dst_kv_indices)
                budget = UNREQUESTED_POOLS * self.pushes.pool_pages(info.session)
                dropped = self._drop_unrequested(self._unrequested.note(info.session, info.room, pages, budget))
        if dropped:
            log.warning("gpuxfer: decode rank %s named pages for more than %d rooms, or %d pages, that no request "
                        "here holds: dropped its oldest, room(s) %s", info.session, self._unrequested.max_rooms,
                        budget, dropped[:8])
        if refusal is not None:
            log.warning("gpuxfer: %s", reason)
        if reason is not None and not info.is_dummy:
            if self.pushes.endpoint(info.session) == (info.endpoint, info.dst_port):
                self.send_kv_status_message(targets=[(info.endpoint, info.dst_port)], bootstrap_room=info.room,
                                            status=KVPoll.Failed, failure_reason=reason, infos=[info])
            else:
                self._unanswered(info)

    def _unanswered(self, info: TransferInfo) -> None:
        """A refused metadata message whose rank never registered, or that names another endpoint than the
        rank registered from: not answered (its decode, if any, fails the room by its own timeout), counted,
        logged once per rank (of the latest ranks: what is kept of them is bounded)."""
        self.unanswered += 1
        if info.session in self._unanswered_ranks:
            return
        self._unanswered_ranks[info.session] = None
        while len(self._unanswered_ranks) > self.pushes.max_decode_ranks:
            self._unanswered_ranks.popitem(last=False)
        log.warning("gpuxfer: refused metadata messages of decode rank %s naming endpoint %s:%s are not answered: "
                    "no registration of the rank came from there (%d unanswered so far)", clip(info.session),
                    clip(info.endpoint), info.dst_port, self.unanswered)

    def _drop_unrequested(self, rooms: List[int]) -> List[int]:
        """Everything kept of ``rooms``, which no request holds here (under the room lock): their decode
        destinations and the status and failure those made. Returns the rooms dropped."""
        out = [room for room in rooms if not self._requested.get(room)]
        for room in out:
            self.transfer_infos.pop(room, None)
            self.request_status.pop(room, None)
            self.req_to_decode_prefix_len.pop(room, None)
            with self.failure_lock:
                self.failure_records.pop(room, None)
        return out

    def _expire_unrequested(self) -> None:
        """The rooms decode ranks named longer than the waiting timeout ago that no request took since: by
        then their decode gave them up."""
        with self._room_lock:
            dropped = self._drop_unrequested(self._unrequested.expired())
        if dropped:
            log.warning("gpuxfer: dropped the pages decode ranks named for %d room(s) that no request here took "
                        "within %.0f s: %s", len(dropped), self._unrequested.max_age_s, dropped[:8])

    def hold_room(self, room: int) -> None:
        """A request (its sender) holds ``room`` here: its destinations are kept while it does."""
        with self._room_lock:
            self._requested[room] += 1
            self._unrequested.forget(room)

    def release_room(self, room: int) -> None:
        with self._room_lock:
            self._requested[room] -= 1
            if self._requested[room] <= 0:
                del self._requested[room]

    def send_kv_status_message(self, *, targets: List[tuple], bootstrap_room: int, status: KVPoll,
                               failure_reason: Optional[str] = None, infos: Optional[List[TransferInfo]] = None) -> None:
        """SGLang's status message to each decode endpoint, with the token that rank named the room's request by
        (``infos``: the destinations to take it from; the room's own by default), so the decode applies it to
        that request alone, never to a later request of the same room id."""
        if not targets:
            return
        if infos is None:
            infos = list((getattr(self, "transfer_infos", {}).get(bootstrap_room) or {}).values())
        tokens = {(i.endpoint, i.dst_port): i.token for i in infos}
        parts = self._encode_kv_status_message(bootstrap_room=bootstrap_room, status=status,
                                               failure_reason=failure_reason)
        for endpoint, dst_port in targets:
            token = tokens.get((endpoint, dst_port))
            na = NetworkAddress(endpoint, dst_port)
            try:
                self._send_multipart_locked(na.to_tcp(), parts + ([token] if token else []), is_ipv6=na.is_ipv6)
            except Exception as exc:    # noqa: BLE001 - best effort, as SGLang's: the decode has its timeout
                log.warning("gpuxfer: status %s of room %s to %s failed: %s", status, bootstrap_room,
                            na.to_host_port_str(), exc)

    def _on_abort(self, msg: List[bytes]) -> None:
        """The decode gave a room up: no chunk of it is posted from now on; the ACK (where the decode asked
        for one) goes once none is in flight."""
        note = AbortNotification.from_zmq(msg)
        if note is None:
            return
        with self._room_lock:
            status = self.request_status.get(note.room)
            if status is not None and status != KVPoll.Success:
                self.record_failure(note.room, "Aborted by the decode instance")
                self.update_status(note.room, KVPoll.Failed)
            target = note.deferred_ack_target()
            if target is not None:
                self.register_deferred_ack_target(note.room, target)
            self._maybe_ack_drained_abort(note.room)
        # pushes already posted are waited for on the transfer thread, which then sends the ACK
        self.pushes.drain_later(note.room)

    def add_transfer_request(self, bootstrap_room: int, kv_indices: npt.NDArray[np.int32], index_slice: slice,
                             is_last_chunk: bool, aux_index: Optional[int] = None,
                             state_indices: Optional[List] = None, num_kv_tokens: Optional[int] = None,
                             wait_event: Any = None, **_: Any) -> None:
        """One ``send()`` chunk, queued for the transfer thread (the scheduler's thread does not wait).
        ``wait_event``: what SGLang hands with an early send of cached prefix pages under its overlap
        scheduler (recorded on the forward stream, whose previous step may still write them): the thread
        waits for it before it posts the chunk."""
        if state_indices:
            self.record_failure(bootstrap_room, "the gpuxfer backend does not move state buffers")
            self.update_status(bootstrap_room, KVPoll.Failed)
            return
        if bootstrap_room not in self.request_status:
            return
        # a copy as given: the agent checks the IDs' type and range (a cast could turn them into other pages)
        self.pushes.put(_Chunk(bootstrap_room, np.array(kv_indices), index_slice, bool(is_last_chunk), aux_index,
                               wait_event, self.transfer_infos.get(bootstrap_room)))

    # ------------------------------------------------------------------ prefill: what its transfer thread asks

    def room_infos(self, room: int) -> Optional[Dict[str, TransferInfo]]:
        """:meth:`.pushes.Rooms.room_infos`: SGLang's ``transfer_infos`` of the room."""
        return self.transfer_infos.get(room)

    def room_failed(self, room: int, unknown: bool = False) -> bool:
        """:meth:`.pushes.Rooms.room_failed`."""
        status = self.request_status.get(room)
        return unknown if status is None else status == KVPoll.Failed

    def count_post(self, room: int) -> bool:
        """:meth:`.pushes.Rooms.count_post`: under the room lock an abort marks the room Failed by."""
        with self._room_lock:
            if self.request_status.get(room) == KVPoll.Failed:
                return False
            self._staging_outstanding[room] += 1
            return True

    def uncount_posts(self, room: int, chunks: int, withhold_ack: bool) -> None:
        """:meth:`.pushes.Rooms.uncount_posts`: SGLang's ``_staging_outstanding`` and deferred ACKs."""
        with self._room_lock:
            left = self._staging_outstanding.get(room, 0) - chunks
            if left > 0:
                self._staging_outstanding[room] = left
            else:
                self._staging_outstanding.pop(room, None)
            if withhold_ack:
                self.poison_deferred_ack_room(room)
            self._maybe_ack_drained_abort(room)

    def conclude_room(self, room: int, infos: Optional[Dict[str, TransferInfo]], ok: bool, reason: Optional[str],
                      gone: Container[str]) -> None:
        """SGLang's ``conclude_transfer`` of the request of ``room`` whose decode destinations are ``infos``,
        only while the room is still that request's (one cleared while its pushes were waited for is concluded
        by no one: a later request of the room id is not it), its decode ranks told with that request's
        tokens, but those in ``gone``. Success (``ok``) turns Failed where a failure was recorded (an abort, a
        claim)."""
        with self._room_lock:
            if infos is None or self.transfer_infos.get(room) is not infos:
                return
            with self.failure_lock:
                recorded = self.failure_records.get(room)
                status = KVPoll.Success if ok else KVPoll.Failed
                if status == KVPoll.Success and (recorded is not None
                                                 or self.request_status.get(room) == KVPoll.Failed):
                    status = KVPoll.Failed
                if status == KVPoll.Failed:
                    reason = self.failure_records.setdefault(room, recorded or reason or "KV transfer failed")
                else:
                    reason = None
            self.update_status(room, status)
        targets = [(i.endpoint, i.dst_port) for i in infos.values() if not i.is_dummy and i.session not in gone]
        self.send_kv_status_message(targets=targets, bootstrap_room=room, status=status, failure_reason=reason,
                                    infos=list(infos.values()))

    def send_to_decode(self, info: TransferInfo, parts: List[bytes]) -> None:
        """:meth:`.pushes.Rooms.send_to_decode`: on SGLang's socket to the decode rank's endpoint."""
        na = NetworkAddress(info.endpoint, info.dst_port)
        self._send_multipart_locked(na.to_tcp(), parts, is_ipv6=na.is_ipv6)

    # ------------------------------------------------------------------ prefill: its sockets to decode ranks

    def endpoint_changed(self, old: Optional[tuple], new: Optional[tuple]) -> None:
        """:meth:`.pushes.Rooms.endpoint_changed`: the endpoints kept registrations name, counted by their
        ``tcp://`` name (two spellings of one address are one); the socket SGLang cached for one no longer
        named is closed and dropped, so what a stream of forged registrations leaves open is bounded by the
        registrations kept."""
        if new is not None:
            self._kept_endpoints[_tcp(new)] += 1
        if old is not None:
            tcp = _tcp(old)
            self._kept_endpoints[tcp] -= 1
            if self._kept_endpoints[tcp] <= 0:
                del self._kept_endpoints[tcp]
                self._close_socket(tcp)

    def _kept(self, endpoint: str) -> bool:
        kept = getattr(self, "_kept_endpoints", None)     # a decode manager: SGLang's own endpoints, all kept
        return kept is None or endpoint in kept

    def _connect(self, endpoint: str, is_ipv6: bool = False):
        """SGLang's cached socket to ``endpoint``; on a prefill only where a kept decode rank registration names
        it (``BadInput`` otherwise, nothing opened): a forged ABORT's return address, or a destination of a
        registration since replaced, opens no socket. One whose registration went while it was opened is
        closed again (the registration's side closed what was cached before it)."""
        if not self._kept(endpoint):
            raise BadInput(f"no decode rank registration kept here names endpoint {clip(endpoint)}")
        sock = super()._connect(endpoint, is_ipv6=is_ipv6)
        if not self._kept(endpoint):
            self._close_socket(endpoint)
            raise BadInput(f"the decode rank registration naming endpoint {clip(endpoint)} was dropped")
        return sock

    def _send_multipart_locked(self, endpoint: str, parts: List[bytes], is_ipv6: bool = False) -> None:
        """SGLang's send on its cached socket, serialized per endpoint; ``BadInput`` where the socket was closed
        meanwhile (its endpoint dropped) instead of a send on a closed socket. On a prefill it never waits:
        where ZMQ's queue to a decode is full (it reads none of its messages: hung, or registered and never
        reading), ``ProtocolError`` at once, instead of holding the transfer thread (every other decode's
        requests behind it) or the scheduler for SGLang's 30-second send timeout."""
        sock = self._connect(endpoint, is_ipv6=is_ipv6)
        lock = self._socket_send_locks.get(endpoint)
        if lock is None:
            raise BadInput(f"the socket to {clip(endpoint)} was closed: no kept registration names it")
        with lock:
            if sock.closed:
                raise BadInput(f"the socket to {clip(endpoint)} was closed: no kept registration names it")
            try:
                sock.send_multipart(parts, flags=0 if getattr(self, "_kept_endpoints", None) is None else zmq.NOBLOCK)
            except zmq.Again:
                raise ProtocolError(f"decode endpoint {clip(endpoint)} reads none of the messages queued to it "
                                    f"({sock.get(zmq.SNDHWM)} unread): nothing more is queued there") from None

    def _close_socket(self, endpoint: str) -> None:
        """Close and drop the socket SGLang cached for ``endpoint`` and its disconnect monitor (after a send
        in progress on it: under its send lock)."""
        if not hasattr(self, "_socket_lock"):
            return                      # no SGLang socket state: nothing was opened
        with self._socket_lock:
            sock = self._socket_cache.pop(endpoint, None)
            monitor = self._monitor_cache.pop(endpoint, None)
            send_lock = self._socket_send_locks.pop(endpoint, None)
        if sock is not None:
            with send_lock or contextlib.nullcontext():
                sock.close(linger=0)
        if monitor is not None:
            monitor.close(linger=0)

    # ------------------------------------------------------------------ both

    def teardown(self) -> None:
        """Stop the control threads (bounded joins) and close the agent."""
        self._stop.set()
        if hasattr(self, "_heartbeat_shutdown"):
            self._heartbeat_shutdown.set()
        for t in self._threads:
            t.join(timeout=5)
        with self._agent_lock:
            self.agent.close()


class GpuxferKVSender(CommonKVSender):
    def __init__(self, mgr: GpuxferKVManager, bootstrap_addr: str, bootstrap_room: int, *args, **kwargs):
        self.kv_mgr, self.bootstrap_room = mgr, bootstrap_room
        mgr.hold_room(bootstrap_room)           # before SGLang's part, which may mark it Failed
        self._holds_room = True
        try:
            super().__init__(mgr, bootstrap_addr, bootstrap_room, *args, **kwargs)
        except BaseException:
            self._release_room()
            raise

    # Once cleared, a sender holds its room id no more, and the id may name a new request: SGLang's calls on
    # it (send, init, abort, clear again) would queue its pages for that request's decode pages, fail it or
    # drop its state, so they change nothing; it polls Failed where it was cleared before it concluded.

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None) -> None:
        super().init(num_kv_indices, aux_index)
        if self._holds_room:
            self.kv_mgr.check_page_counts(self.bootstrap_room, num_kv_indices)

    def send(self, *args: Any, **kwargs: Any) -> None:
        if self._holds_room:
            super().send(*args, **kwargs)

    def _release_room(self) -> None:
        if self._holds_room:
            self._holds_room = False
            self.kv_mgr.release_room(self.bootstrap_room)

    def clear(self) -> None:
        if not self._holds_room:
            return
        super().clear()
        if self.conclude_state is None:
            self.conclude_state = KVPoll.Failed
        self._release_room()

    def failure_exception(self):
        if not self._holds_room:        # the room id's failure record may be a new request's: left to it
            self.conclude_state = KVPoll.Failed
            raise KVTransferError(self.bootstrap_room, "the request was cleared before it concluded")
        super().failure_exception()

    def abort(self) -> None:
        """SGLang's abort, and the decode told at once (it would otherwise wait for its timeout)."""
        if not self._holds_room:
            self.conclude_state = KVPoll.Failed
            return
        super().abort()
        self.kv_mgr.conclude_failure(bootstrap_room=self.bootstrap_room, failure_reason="Aborted by the prefill")
        self.kv_mgr.pushes.drain_later(self.bootstrap_room)     # its posted pushes waited for


class GpuxferKVReceiver(CommonKVReceiver):
    # Once cleared, a receiver no longer owns its room id (SGLang's ``_owns_bootstrap_room``, which its own
    # ``clear`` and ``abort`` honor), and the id may name a new request: ``init``, ``send_metadata`` and
    # ``failure_exception`` change nothing of it either (no pages named, no ABORT sent, no failure taken).

    def init(self, prefill_dp_rank: int) -> None:
        if self._owns_bootstrap_room:
            super().init(prefill_dp_rank)

    def send_metadata(self, *args: Any, **kwargs: Any) -> None:
        """SGLang's ``send_metadata``; what the backend cannot send (page indices that are no int32 pages, no
        metadata row, state buffers) fails the room alone with its typed reason, never raising into the
        scheduler, and the prefill ranks are told (SGLang's ABORT)."""
        if not self._owns_bootstrap_room:
            return
        try:
            super().send_metadata(*args, **kwargs)
        except GpuxferError as exc:
            self.kv_mgr.record_failure(self.bootstrap_room, f"{type(exc).__name__}: {exc}")
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            self.ensure_abort_notified()

    def failure_exception(self):
        if not self._owns_bootstrap_room:   # the room id's failure record may be a new request's: left to it
            raise KVTransferError(self.bootstrap_room, "the request was cleared before it concluded")
        super().failure_exception()

    def _register_kv_args(self) -> bool:
        """SGLang's registration with each prefill rank of the room, each rank that sends KV alone given a
        notification slot of its own (not a dummy rank, nor one of several ranks answering for a request)."""
        if self.bootstrap_infos is None:
            return False
        single = getattr(self, "required_prefill_response_num", 1) == 1
        for info in self.bootstrap_infos:
            slot = self.kv_mgr.landings.new_slot() if single and not info.get("is_dummy") else None
            message = self.kv_mgr.build_receiver_registration_message(slot)
            if not self._send_bootstrap_message(bootstrap_info=info, message=message, operation="_register_kv_args"):
                return False
        return True

    def _poll(self) -> KVPoll:
        """SGLang's poll (under the receiver's lifecycle lock), and Success as soon as the room's notification
        word says its KV landed."""
        status = super()._poll()
        if (status in (KVPoll.WaitingForInput, KVPoll.Transferring)
                and self.kv_mgr.landings.landed(self.bootstrap_room)):
            self.kv_mgr.inbox.end_by_word(self.bootstrap_room)
            status = super()._poll()
        return status

    def _clear(self) -> None:
        if not self._owns_bootstrap_room:
            return
        super()._clear()
        self.kv_mgr.inbox.forget(self.bootstrap_room)
        self._owns_bootstrap_room = False


class GpuxferKVBootstrapServer(CommonKVBootstrapServer):
    pass
