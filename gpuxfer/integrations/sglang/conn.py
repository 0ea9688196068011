"""gpuxfer as an SGLang 0.5.23 disaggregation transfer backend: a KV manager, sender, receiver and bootstrap
server on SGLang's ``Common*`` classes. The only module of gpuxfer that imports SGLang besides the plugin
hook (:mod:`.plugin`), and SGLang imports it only once ``--disaggregation-transfer-backend gpuxfer`` chose it.

Each KV manager holds one :class:`~gpuxfer.kv.KVAgent` over SGLang's own KV pool (``KVArgs``: raw pointers,
registered with :meth:`~gpuxfer.kv.KVAgent.layer_at`, :mod:`.layout`). The prefill side pushes (SGLang's shape):
every ``send()`` chunk becomes one ``prepare`` + ``post`` of its pages onto the decode pages the receiver named,
on the transfer thread the prefill's manager owns (:class:`.pushes.Pushes`), which does not wait for it (chunks of
a request queued behind one another while the thread was busy, as a request sent back to back, become one push).
The last chunk's push also bumps the decode agent's notification word that the decode's registration gave this
prefill rank (stream order: after every push of the room landed); before it, the request's rows go into the
decode's rows in host memory (:mod:`.rows`), stamped with the decode's token and the value the word will hold, or
elsewhere (a decode of an earlier gpuxfer, a room without a slot, the NIXL route) on SGLang's control socket, with
the value. The decode's ``poll()`` ends the room when the word holds that value; the prefill waits for the room's
pushes, then sends SGLang's Success status, which also ends the room where no notification could be used; for a
room the decode ended by its word, that message is dropped on arrival (the room id may already be a new
request's). Control messages are SGLang's (ZMQ, the bootstrap server's ``/route``); what gpuxfer adds is the
decode agent's metadata, a notification slot and its rows' name in its registration (the prefill's bootstrap
thread is this module's, its transfer thread :class:`.pushes.Pushes`, what decode ranks register and name
:class:`.decode_ranks.DecodeRanks`'s; the decode's handling of the prefill's messages :class:`.inbox.Inbox`'s).
The timeline: docs/SGLANG.md.

Failures end in ``KVPoll.Failed`` on both sides, never a hang: a decode abort reaches the prefill as SGLang's ABORT
(chunks not yet posted are dropped; an ABORT_ACK follows once the posted ones were waited for); a prefill abort or a
failed push (a dead decode: ``PeerLost``) is sent to the decode as a Failed status; a dead prefill is found by
SGLang's heartbeat on the decode side, and every wait is bounded by SGLang's disaggregation timeouts.

SGLang names a request by its room id alone, and a room id may name a new request once the last one ended. The
decode's metadata message names the request by a token of its own (``t``), which the prefill echoes in the room's
row and status messages: the decode drops those of an earlier request of the room id (late: it was given up there
first) instead of writing, landing or concluding the new one with them (:mod:`.inbox`). On the prefill, a request's
pushes, its conclusion and its errors stay its own (``_Posted.infos``, :meth:`conclude_room`), and a decode rank
naming pages for a new request of a room id its earlier request still holds fails both.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
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
from sglang.srt.utils.network import NetworkAddress, get_zmq_socket_on_host

from ... import config
from ...errors import BadInput, GpuxferError, ProtocolError
from ...kv import KVAgent
from .control import bound_control_socket, within_frame
from .decode_ranks import DecodeRanks
from .inbox import Inbox
from .landing import Landings, slot_frame
from .layout import check_supported, encode_registration, geometry, register_kv_args, total_kv_heads
from .pushes import Pushes, clip
from .requests import TransferInfo, _Chunk, _int32_pages
from .rows import AuxRows, advertised

log = logging.getLogger("gpuxfer.sglang")

REGISTER_ROOM = b"None"         # SGLang's marker of a registration message (Mooncake's too)
_RECV_POLL_MS = 200             # how often an idle control thread looks at its stop flag (a message wakes it)
_clock = time.monotonic         # a sender's clock (how long a started request went without its last chunk)


def _tcp(endpoint: tuple) -> str:
    """SGLang's ``tcp://`` name of an ``(ip, port)`` endpoint (what its socket cache is keyed by)."""
    return NetworkAddress(endpoint[0], int(endpoint[1])).to_tcp()


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
        bound_control_socket(self, get_zmq_socket_on_host)      # a decode's (a prefill's was as it registered)
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
        # a decode rank's notification words have a host copy its polls read with a load (:mod:`.landing`)
        self.agent = KVAgent(f"sglang-{role}-{self.session_id}", platform=platform, device=device,
                             engine=config.get("GPUXFER_SGLANG_ENGINE"), timeout_s=self.timeout_s,
                             host_notify=role == "decode")
        self._agent_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: List[threading.Thread] = []
        try:
            register_kv_args(self.agent, args)
            self.aux_rows = AuxRows.create(args, self.agent.uid if role == "decode" else None)   # (:mod:`.rows`)
        except BaseException:
            self.agent.close()
            raise
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self._warm_up()
            self._init_rooms()
            # the transfer thread: its queue, the pushes in flight, the decode ranks' peers (:mod:`.pushes`)
            self.pushes = Pushes(self, self.agent, self._agent_lock, self.kv_args, self.timeout_s, self._stop,
                                 rows=self.aux_rows)
            self._spawn(self._prefill_control, "gpuxfer-sglang-control")
            self._spawn(self.pushes.run, "gpuxfer-sglang-transfer")
        else:
            rows = advertised(self.aux_rows)                    # (where a prefill of its host writes its rows)
            self._registration = encode_registration({**self.geometry, **rows}, self.agent.metadata())
            self.landings = Landings(self.agent.notification,
                                     self.agent.host_notification if self.agent.host_words is not None else None)
            # the prefill's messages about this rank's requests, each taken for its current request alone
            self.inbox = Inbox(self, self.landings, KVPoll, self.aux_rows)
            self._spawn(self._decode_control, "gpuxfer-sglang-control")
            self._threads.append(self._start_heartbeat_checker_thread())
        log.info("gpuxfer: SGLang %s rank %s registered %d KV entries (%d-token pages) with the %s engine",
                 role, self.session_id, len(args.kv_data_ptrs), int(args.page_size), self.agent.engine)

    def register_to_bootstrap(self) -> None:
        """SGLang's registration of a prefill rank, its control socket first bound (:mod:`.control`)."""
        bound_control_socket(self, get_zmq_socket_on_host)
        super().register_to_bootstrap()

    def _warm_up(self) -> None:
        """The push's kernels loaded at startup, not in the first request: SGLang's padding page 0 (never
        handed out) copied onto itself. A failure here only moves that cost to the first request."""
        try:
            log.info("gpuxfer: transfer kernels loaded in %.2f s", self.agent.warm_up(block=0))
        except GpuxferError as exc:
            log.warning("gpuxfer: loading the transfer kernels at startup failed (%s: %s); the first request "
                        "loads them", type(exc).__name__, exc)

    def _init_rooms(self) -> None:
        """A prefill rank's bookkeeping of rooms beside SGLang's: its decode ranks and the rooms they name
        (:class:`.decode_ranks.DecodeRanks`, whose lock a room's Failed mark takes against a chunk's count),
        and the endpoints its sockets may reach."""
        self.decode_ranks = DecodeRanks(self, KVPoll, self.timeout_s)
        self._room_lock = self.decode_ranks.lock
        # SGLang's ``tcp://`` name of each endpoint a kept decode rank registration names -> how many name it: the
        # only places a message goes and a socket is opened to (:meth:`_connect`)
        self._kept_endpoints: Counter = Counter()

    def _spawn(self, target, name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _recv_loop(self, handle, tick=None) -> None:
        """Hand each control message to ``handle`` until stopped; a message that fails is logged, never the end of the
        thread. ``tick``: run before each message and when idle (at least every ``_RECV_POLL_MS``)."""
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
        pages = b"" if is_dummy else within_frame(_int32_pages(kv_indices), "a decode's page indices")
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
        self._recv_loop(self._on_prefill_message, self.decode_ranks.expire)

    def _on_prefill_message(self, msg: List[bytes]) -> None:
        if msg and msg[0] == ABORT_TAG:
            self._on_abort(msg)
        elif msg and msg[0] == REGISTER_ROOM:
            self.decode_ranks.on_registration(msg)
        else:
            self.decode_ranks.on_transfer_info(TransferInfo.from_zmq(msg))

    def hold_room(self, room: int) -> None:
        """A request (its sender) holds ``room`` here: its destinations are kept while it does."""
        self.decode_ranks.hold(room)

    def release_room(self, room: int) -> None:
        self.decode_ranks.release(room)

    def check_page_counts(self, room: int, pages: int) -> None:
        """:meth:`.decode_ranks.DecodeRanks.check_page_counts` (SGLang's sender ``init``)."""
        self.decode_ranks.check_page_counts(room, pages)

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
            if target is not None and self.decode_ranks.keeps_ack_target(self._deferred_ack_targets.get(note.room),
                                                                         target):
                self.register_deferred_ack_target(note.room, target)
            self._maybe_ack_drained_abort(note.room)
        if status is not None:          # posted pushes waited for on the transfer thread, then the ACK
            self.pushes.drain_later(note.room)      # (a room unknown here: by the thread's sweep of ended rooms)

    def add_transfer_request(self, bootstrap_room: int, kv_indices: npt.NDArray[np.int32], index_slice: slice,
                             is_last_chunk: bool, aux_index: Optional[int] = None,
                             state_indices: Optional[List] = None, num_kv_tokens: Optional[int] = None,
                             wait_event: Any = None, **_: Any) -> None:
        """One ``send()`` chunk, queued for the transfer thread (the scheduler's thread does not wait); one sent
        before every decode rank named its pages (SGLang's ``send`` looks at no status) fails the request.
        ``wait_event``: an early send's, of cached prefix pages the previous forward may still write: waited for."""
        status = self.request_status.get(bootstrap_room)
        if state_indices or status == KVPoll.Bootstrapping:     # (the chunk would go to none or some decode ranks)
            self.conclude_failure(bootstrap_room=bootstrap_room, failure_reason="the gpuxfer backend does not move "
                                  "state buffers" if state_indices else "a chunk was sent before the decode's pages")
            return
        if status is None:
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

    def fail_drained(self, room: int, reason: str) -> None:
        """The room failed here (its abort, a timeout): nothing more of it posted, its posted pushes waited for
        (bounded by the waiting timeout), then its decode told. SGLang frees the request's KV pages once its sender
        polls Failed or its abort returns, the decode its own once told: a push still running would read the
        first (its word then ending the decode's request over them) or write the second."""
        with self._room_lock:       # (under the lock count_post takes: a push counted before is waited for)
            self.record_failure(room, reason)
            self.update_status(room, KVPoll.Failed)
            posted = self._staging_outstanding.get(room, 0) > 0
        done = self.pushes.drain_later(room)
        if posted and not self.pushes.wait_drain(done, self.timeout_s):
            log.warning("gpuxfer: room %s failed (%s) with pushes not over after %.0f s", room, reason, self.timeout_s)
        self.conclude_failure(bootstrap_room=room, failure_reason=reason)

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
        """SGLang's ``conclude_transfer`` of the request of ``room`` whose decode destinations are ``infos``, only while
        the room is still that request's (one cleared while its pushes were waited for is concluded by no one: a later
        request of the room id is not it), its decode ranks told with that request's tokens, but those in ``gone``.
        Success (``ok``) turns Failed where a failure was recorded (an abort, a claim)."""
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
        """:meth:`.pushes.Rooms.endpoint_changed`: the endpoints kept registrations name, counted by their ``tcp://``
        name (two spellings of one address are one); the socket SGLang cached for one no longer named is closed and
        dropped, so what a stream of forged registrations leaves open is bounded by the registrations kept."""
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
        """Stop the control threads (bounded joins), close the agent and the rows (:meth:`.rows.AuxRows.close`)."""
        self._stop.set()
        if hasattr(self, "_heartbeat_shutdown"):
            self._heartbeat_shutdown.set()
        for t in self._threads:
            t.join(timeout=5)
        with self._agent_lock:
            self.agent.close()
        if self.aux_rows is not None:
            self.aux_rows.close()


class GpuxferKVSender(CommonKVSender):
    def __init__(self, mgr: GpuxferKVManager, bootstrap_addr: str, bootstrap_room: int, *args, **kwargs):
        self.kv_mgr, self.bootstrap_room = mgr, bootstrap_room
        mgr.hold_room(bootstrap_room)           # before SGLang's part, which may mark it Failed
        self._holds_room = True
        self._started, self._last_handed = None, False      # when ``init`` started it; its last chunk handed over
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
            self._started = _clock()
            self.kv_mgr.check_page_counts(self.bootstrap_room, num_kv_indices)

    def send(self, *args: Any, **kwargs: Any) -> None:
        if self._holds_room:
            super().send(*args, **kwargs)
            self._last_handed = self._last_handed or self.curr_idx == self.num_kv_indices

    def poll(self) -> KVPoll:
        """SGLang's poll; Failed where the started request (``init``) handed no last chunk over within the waiting
        timeout (SGLang's prefill polls it forever: one whose decode named a prefix past its prompt sends none)."""
        status = super().poll()
        if (status == KVPoll.WaitingForInput and self._holds_room and not self._last_handed
                and self._started is not None and _clock() - self._started > self.kv_mgr.timeout_s):
            self.kv_mgr.fail_drained(self.bootstrap_room, f"the request handed over no last chunk within "
                                     f"{self.kv_mgr.timeout_s:.0f} s of its start")
            status = super().poll()
        return status

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
        """SGLang's abort, returning once the request's posted pushes were waited for (SGLang frees its pages
        then), and the decode told then (it would otherwise wait for its timeout)."""
        if not self._holds_room:
            self.conclude_state = KVPoll.Failed
            return
        super().abort()
        self.kv_mgr.fail_drained(self.bootstrap_room, "Aborted by the prefill")


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
        real = [i for i in self.bootstrap_infos or () if not i.get("is_dummy")]
        slot = real[0].get("gpuxfer_slot") if len(real) == 1 else None
        seen = None if slot is None else self.kv_mgr.landings.seen(slot)     # (before the metadata leaves)
        try:
            super().send_metadata(*args, **kwargs)
        except GpuxferError as exc:
            self.kv_mgr.record_failure(self.bootstrap_room, f"{type(exc).__name__}: {exc}")
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            self.ensure_abort_notified()
            return
        if len(real) == 1:      # the word a row in the rows lands on (:meth:`.inbox.Inbox.landed_by_row`)
            self.kv_mgr.inbox.prefill_slot(self.bootstrap_room, slot, seen)

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
            info["gpuxfer_slot"] = slot         # (SGLang caches the infos per prefill rank: its receivers read it)
            message = self.kv_mgr.build_receiver_registration_message(slot)
            if not self._send_bootstrap_message(bootstrap_info=info, message=message, operation="_register_kv_args"):
                return False
        return True

    def _poll(self) -> KVPoll:
        """SGLang's poll (under the receiver's lifecycle lock), and Success as soon as the room's notification
        word says its KV landed."""
        status = super()._poll()
        if (status in (KVPoll.WaitingForInput, KVPoll.Transferring)
                and (self.kv_mgr.landings.landed(self.bootstrap_room)
                     or self.kv_mgr.inbox.landed_by_row(self.bootstrap_room))):
            self.kv_mgr.inbox.end_by_word(self.bootstrap_room)
            status = self.kv_mgr.check_status(self.bootstrap_room)
            if status not in (KVPoll.Success, KVPoll.Failed):
                return super()._poll()
            self.conclude_state = status        # (SGLang's _poll of a concluded room: that, and the status)
        return status

    def _clear(self) -> None:
        if not self._owns_bootstrap_room:
            return
        super()._clear()
        self.kv_mgr.inbox.forget(self.bootstrap_room)
        self._owns_bootstrap_room = False


class GpuxferKVBootstrapServer(CommonKVBootstrapServer):
    pass
