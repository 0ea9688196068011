"""What :class:`~gpuxfer.kv.agent.KVAgent`'s posts run on (:class:`Poster`, one per agent, handed to its transfers):
the post lock, the posted transfers' buffers kept until their events complete, the pooled host arrays of
requests and of device-ID posts' status words, the agent's stream's calls bound once, the stream slots' graphs
are captured on, and each route's ring of slots (the ``triton`` engine's device buffers, launchers and
graphs)."""
from __future__ import annotations

import collections
import functools
import itertools
import logging
import threading

from .. import config
from ..errors import BadInput, GpuxferError, NotRegistered, PeerLost, TransferTimeout
from ..platforms.base import Event, Stream
from .device_ids import _StatusWords
from .peers import _LEAKED, KVPeer
from .routes import _Route
from .triton_transfer import _Landed, _RequestPool, _Slot

log = logging.getLogger("gpuxfer.kv.agent")

#: a route's ring: at most this many slots (posts on other streams still running hold theirs)
RING_SLOTS = 4
#: a slot's smallest capacities (descriptor rows, request entries); larger requests grow it geometrically
MIN_SLOT_ROWS = 1024
MIN_SLOT_ENTRIES = 1024
#: posted transfers a post keeps without looking at their events; past it, a post first drops the completed
#: ones (so does a prepare that finds no free host array of its size), and the next post to look again is the
#: one past twice those still kept then (at least this many): posts queued faster than they complete look at
#: an event a doubling of the queue, not one a post
INFLIGHT_KEEP = 16


def _post_ended(platform, kept: tuple) -> bool:
    """Whether a kept post ``(event, buffers, stream)`` ran to its end: a folded post's landed host word (read
    before its event), else its event (:func:`_ended`)."""
    last = kept[1][-1] if kept[1] else None
    return (type(last) is _Landed and last.landed()) or _ended(platform, kept[0])


def _ended(platform, event) -> bool:
    """Whether the work before ``event`` is over: completed, or failed (its transfer's handle raises the error;
    nothing of it runs any more, and another transfer's post must not raise it)."""
    try:
        return platform.event_query(event)
    except GpuxferError:
        return True


class Poster:
    """The post side of an agent (``agent``: its platform, device, stream, timeout, rank and name are read from
    it; ``registry``: its :class:`~gpuxfer.kv.peers.Registry`). Everything that queues work touching a peer's or
    the agent's memory holds :attr:`lock` and calls :meth:`check_usable` under it."""

    def __init__(self, agent, registry):
        self.agent, self.registry = agent, registry
        self.lock = threading.Lock()
        self.inflight: collections.deque = collections.deque()     # (event, buffers, stream) of posts
        pinned = not agent.platform.host_memory
        self.requests = _RequestPool(pinned=pinned)                 # host arrays of requests
        self.status_words = _StatusWords(pinned=pinned)            # device-ID posts' status words
        self.calls = None                       # the agent's stream's flag, graph and copy calls (bind)
        self.graphs = True                      # capture slots' launches as graphs
        self.blocks = config.get("GPUXFER_KV_COPY") == "blocks"     # slots copy from the IDs: no descriptor table
        self.capture: Stream | None = None      # where graphs are captured (capture_stream)
        self._slot_uses = itertools.count(1)
        self.reap_at = INFLIGHT_KEEP             # posted transfers kept before a post looks at their events
        self._look_all_at = INFLIGHT_KEEP        # ... before a reap looks past an oldest still running (reap)
        self.next_seq = functools.partial(next, itertools.count(1))     # folded posts' sequence numbers

    def bind(self, stream: Stream) -> None:
        """Bind the agent's stream's calls once (:meth:`Platform.stream_calls`)."""
        plat = self.agent.platform
        self.calls = plat.stream_calls(stream)
        if self.calls.copy is None:
            self.calls.copy = functools.partial(plat.copy_async, stream)

    def check_open(self) -> None:
        """The agent is open (else :class:`BadInput`) and has not failed (else the error that failed it)."""
        agent = self.agent
        if agent.closed:
            raise BadInput(f"agent {agent.name!r} is closed")
        agent.check()

    def check_usable(self, peer) -> None:
        """The agent is open and usable and ``peer`` is still its own (and, in this process, open): else a typed
        error. Queuing work on the peer's memory calls it under the post lock."""
        agent = self.agent
        if (type(peer) is KVPeer and peer.agent is agent and not peer._closed and not agent.closed
                and agent.failed is None and self.registry.peers.get(peer.name) is peer
                and (peer._local is None or not peer._local.closed)):
            return          # the per-post case
        self.check_open()
        if not isinstance(peer, KVPeer) or peer.agent is not agent:
            raise NotRegistered(f"{peer!r} is not a peer of agent {agent.name!r}")
        if peer.closed or self.registry.peers.get(peer.name) is not peer:
            raise NotRegistered(f"peer {peer.name!r} was removed from agent {agent.name!r}")
        if peer._local is None or not peer._local.closed:
            return          # usable: a peer of another kind (NIXL's) or of another process
        raise PeerLost(rank=agent.rank, peer=peer._local.rank, step=0, flag=f"peer {peer.name!r}", after_s=0.0,
                       why=f"agent {peer.name!r} of this process was closed (remove_peer it)")

    def stream(self, stream) -> Stream:
        """The stream a post runs on: the agent's own where ``stream`` is None, else ``stream``, which must be an
        open stream of the platform on the agent's device (else :class:`BadInput`: the slots, graphs and words a
        post uses belong to that device)."""
        agent = self.agent
        if stream is None:
            return agent.stream
        if not isinstance(stream, Stream) or stream.closed or stream.device != agent.device:
            where = "" if not isinstance(stream, Stream) or stream.closed else f" (it is device {stream.device}'s)"
            raise BadInput(f"agent {agent.name!r} cannot post on {stream!r}: not an open stream of the platform on "
                           f"its device {agent.device}{where}")
        return stream

    def torch_device(self):
        return self.agent.platform.torch_device(self.agent.device)

    def capture_stream(self) -> Stream:
        """The stream graphs are captured on (made on first use)."""
        if self.capture is None:
            self.capture = self.agent.platform.create_stream(self.agent.device)
        return self.capture

    # ------------------------------------------------------------------ posted transfers

    def track(self, event: Event, buffers: tuple, stream: Stream) -> None:
        """Keep a posted transfer's buffers until its event completes (dropping the transfer and its
        handle early must not free memory the stream still reads). The caller holds the post lock. The
        completed entries go when a prepare finds no free host array (:meth:`reap_locked`), or here once
        :attr:`reap_at` are kept (:data:`INFLIGHT_KEEP`, or twice what the last reap kept): a post does not query
        events otherwise. ``buffers`` of a folded post
        without a notification end with its :class:`~gpuxfer.kv.triton_transfer._Landed`: nothing of the post
        reads them once its graph ran to the end, so :meth:`reap` reads that host word before the event.
        ``stream``: where ``event`` was recorded."""
        q = self.inflight
        if len(q) >= self.reap_at:
            self.reap()
        q.append((event, buffers, stream))

    def reap_locked(self) -> None:
        """:meth:`reap` under the post lock (completed posts give their host arrays back to the pool)."""
        with self.lock:
            self.reap()

    def reap(self) -> None:
        """Drop the posted transfers whose events completed, oldest first (the caller holds the post lock); the
        next post's reap once twice as many as are left are kept (:data:`INFLIGHT_KEEP` at least). Where the
        oldest still runs, the others are looked at too once twice as many are kept as after the last such look
        (:data:`INFLIGHT_KEEP` at least, again once none is kept): a post held on one stream keeps none of other
        streams that completed (their pooled host arrays go back to the pool). A stream's posts complete in order,
        so only the oldest kept of each stream is asked."""
        q = self.inflight
        plat = self.agent.platform
        while q and _post_ended(plat, q[0]):
            q.popleft()
        if len(q) > 1 and len(q) >= self._look_all_at:
            running_on = {q[0][2]}      # the streams whose oldest kept post still runs
            kept = [q[0]]
            for x in itertools.islice(q, 1, None):
                if x[2] in running_on:
                    kept.append(x)
                elif not _post_ended(plat, x):
                    kept.append(x)
                    running_on.add(x[2])
            if len(kept) < len(q):
                q.clear()
                q.extend(kept)
            self._look_all_at = max(INFLIGHT_KEEP, 2 * len(q))
        elif not q:
            self._look_all_at = INFLIGHT_KEEP
        self.reap_at = max(INFLIGHT_KEEP, 2 * len(q))

    def retire(self, route: _Route, slot: _Slot | None) -> None:
        """A post failed after taking ``slot`` (it may have queued an upload or launches there): the slot leaves
        the route's ring, so no later post -- on another stream, once the slot's earlier event completed --
        writes buffers that queued work still uses; a later post makes another. The caller keeps the slot's
        buffers (:meth:`hold_until_drained`)."""
        if slot is not None:
            route.slots[:] = [x for x in route.slots if x is not slot]

    def hold_until_drained(self, s: Stream, buffers: tuple) -> None:
        """A post failed part way: its upload may be queued and still read its host array. Keep ``buffers``
        until ``s`` drained (at most the agent's timeout), else for the life of the process."""
        agent = self.agent
        try:
            if agent.platform.synchronize(s, agent.timeout_s):
                return
        except Exception:       # noqa: BLE001 - a failed stream: nothing proves the upload is over
            pass
        _LEAKED.append(buffers)

    # ------------------------------------------------------------------ slots

    def take_slot(self, route: _Route, s: Stream, rows: int, entries: int) -> _Slot:
        """A slot of ``route``'s ring free for a post on ``s`` that holds ``rows`` descriptors and ``entries``
        request entries: one last used on ``s`` or whose last post completed (made, or remade larger --
        geometrically --, when it is too small); a new one while the ring has room; else the least recently
        used, once its last post completed (waiting at most the agent's timeout)."""
        agent = self.agent
        plat, slots = agent.platform, route.slots
        if self.blocks:
            rows = 0                # (its copies hold no descriptor table)
        i = -1
        for k, slot in enumerate(slots):
            if slot.stream is s or _ended(plat, slot.event):     # every slot has its last event
                if slot.rows >= rows and slot.entries >= entries:
                    slot.used = next(self._slot_uses)
                    return slot
                i = k
                break
        if i < 0:
            if len(slots) < RING_SLOTS:
                i = len(slots)
            else:
                i = min(range(len(slots)), key=lambda k: slots[k].used)
                if not plat.event_wait(slots[i].event, agent.timeout_s):
                    raise TransferTimeout(rank=agent.rank, step=0, flag="a free slot", expected=1, seen=0,
                                          timeout_s=agent.timeout_s,
                                          what=f"all {len(slots)} slots of a route still run earlier posts")
        if i == len(slots):
            slot = self._new_slot(route, s, max(rows, MIN_SLOT_ROWS), max(entries, MIN_SLOT_ENTRIES))
            slots.append(slot)
            return self._use(slot)
        slot = slots[i]
        if slot.rows < rows or slot.entries < entries:
            slot = slots[i] = self._new_slot(route, s, slot.rows if rows <= slot.rows else max(rows, 2 * slot.rows),
                                             slot.entries if entries <= slot.entries else
                                             max(entries, 2 * slot.entries))
        return self._use(slot)

    def _use(self, slot: _Slot) -> _Slot:
        slot.used = next(self._slot_uses)
        return slot

    def _new_slot(self, route: _Route, s: Stream, rows: int, entries: int) -> _Slot:
        """A slot's buffers, zeroed on ``s`` (after torch's current stream, where the caching allocator may
        have used the memory last), its launchers, and its graph (captured on a stream of the agent's)."""
        agent = self.agent
        plat = agent.platform
        slot = _Slot(route, rows, entries, self.torch_device(), pinned=self.requests.pinned, blocks=self.blocks)
        plat.stream_wait_event(s, plat.record_event(plat.current_stream(agent.device)))
        plat.memset_async(s, slot.req_ptr, 0, entries * 8)
        if slot.out is not None:
            plat.memset_async(s, slot.out.data_ptr(), 0, rows * 24)
        if not plat.kernels_interpreted:
            # one run of the fixed launches over the zeroed request (it moves nothing) loads the compiled
            # kernels, so the capture below records launches only
            slot.enqueue(plat, s)
        slot.event, slot.stream = plat.record_event(s), s
        if self.graphs:
            try:
                slot.graph = plat.capture_graph(self.capture_stream(), lambda c: slot.enqueue(plat, c))
            except Exception as exc:  # noqa: BLE001 - the same launches run one by one instead
                log.warning("agent %s: capturing a slot's launches as a graph failed (%s: %s); posts launch them "
                            "one by one", agent.name, type(exc).__name__, exc)
                self.graphs = False
            if slot.graph is None:
                self.graphs = False
            elif slot.host is not None:
                self._fold(slot, lambda c: slot.record_folded(plat, c, slot.enqueue), "folded")
        return slot

    def _fold(self, slot: _Slot, record, attr: str, owner=None) -> None:
        """Capture ``record`` (a slot's folded graph, :meth:`_Slot.record_folded`) into ``owner.attr`` (default:
        the slot); posts keep the unfolded graph where the capture fails."""
        try:
            setattr(owner or slot, attr, self.agent.platform.capture_graph(self.capture_stream(), record))
        except Exception as exc:  # noqa: BLE001 - the upload stays a call of its own
            log.warning("agent %s: capturing a slot's folded graph failed (%s: %s); its posts upload with a call "
                        "of their own", self.agent.name, type(exc).__name__, exc)
