"""What :class:`~gpuxfer.kv.agent.KVAgent`'s posts run on, made once and reused: a route's ring of slots (the
``triton`` engine's device buffers, launchers and graphs), the ``pack`` engine's shapes and lane stream, and
the posted transfers' buffers kept until their events complete."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..errors import GpuxferError, TransferTimeout
from ..platforms.base import Event, Stream
from .pack_transfer import _PackShape
from .routes import _Route
from .triton_transfer import _Slot

if TYPE_CHECKING:
    from .pack_transfer import _PackTransfer

log = logging.getLogger("gpuxfer.kv.agent")

#: a route's ring: at most this many slots (posts on other streams still running hold theirs)
RING_SLOTS = 4
#: a slot's smallest capacities (descriptor rows, request entries); larger requests grow it geometrically
MIN_SLOT_ROWS = 1024
MIN_SLOT_ENTRIES = 1024
#: shapes of pack transfers an agent keeps (buffers, kernels, graphs), the least recently posted going first
PACK_SHAPES = 8
#: posted transfers a post keeps without looking at their events; past it, a post first drops the completed
#: ones (so does a prepare that finds no free host array of its size)
INFLIGHT_KEEP = 16


def _ended(platform, event) -> bool:
    """Whether the work before ``event`` is over: completed, or failed (its transfer's handle raises the error;
    nothing of it runs any more, and another transfer's post must not raise it)."""
    try:
        return platform.event_query(event)
    except GpuxferError:
        return True


class _PostResources:
    """The slots, pack shapes, lane and in-flight buffers of :class:`~gpuxfer.kv.agent.KVAgent`'s posts."""

    def _take_slot(self, route: _Route, s: Stream, rows: int, entries: int) -> _Slot:
        """A slot of ``route``'s ring free for a post on ``s`` that holds ``rows`` descriptors and ``entries``
        request entries: one last used on ``s`` or whose last post completed (made, or remade larger --
        geometrically --, when it is too small); a new one while the ring has room; else the least recently
        used, once its last post completed (waiting at most the agent's timeout)."""
        plat, slots = self.platform, route.slots
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
                if not plat.event_wait(slots[i].event, self.timeout_s):
                    raise TransferTimeout(rank=self.rank, step=0, flag="a free slot", expected=1, seen=0,
                                          timeout_s=self.timeout_s,
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
        plat = self.platform
        slot = _Slot(route, rows, entries, self._torch_device())
        plat.stream_wait_event(s, plat.record_event(plat.current_stream(self.device)))
        plat.memset_async(s, slot.req_ptr, 0, entries * 8)
        plat.memset_async(s, slot.out.data_ptr(), 0, rows * 24)
        if not plat.kernels_interpreted:
            # one run of the fixed launches over the zeroed request (it moves nothing) loads the compiled
            # kernels, so the capture below records launches only
            slot.enqueue(plat, s)
        slot.event, slot.stream = plat.record_event(s), s
        if self.graphs:
            try:
                if self._capture_stream is None:
                    self._capture_stream = plat.create_stream(self.device)
                slot.graph = plat.capture_graph(self._capture_stream, lambda c: slot.enqueue(plat, c))
            except Exception as exc:  # noqa: BLE001 - the same launches run one by one instead
                log.warning("agent %s: capturing a slot's launches as a graph failed (%s: %s); posts launch them "
                            "one by one", self.name, type(exc).__name__, exc)
                self.graphs = False
            if slot.graph is None:
                self.graphs = False
        return slot

    def device_bytes(self) -> dict[str, int]:
        """Device memory this agent holds beyond the registered caches and its flag words, in bytes: the routes'
        slots -- descriptor buffers (``(rows, 3)`` int64: 24 bytes per descriptor of the largest request a slot
        ran), request buffers and the device ID check's bitmaps -- and the pack engine's staging slots; with the
        number of routes and slots."""
        routes = {id(r): r for r in list(self._routes.values())}.values()
        slots = [s for r in routes for s in list(r.slots)]
        return {"routes": len(routes), "slots": len(slots),
                "descriptors": sum(s.rows * 24 for s in slots),
                "requests": sum(s.entries * 8 for s in slots),
                "id_marks": sum(s._checked.marks.numel() * 4 for s in slots if s._checked is not None),
                "pack_staging": self.staging.nbytes if self.staging is not None else 0}

    def _pack_shape(self, x: "_PackTransfer") -> "_PackShape":
        """The cached :class:`_PackShape` of ``x``'s shape (built on first use; the least recently used of
        more than :data:`PACK_SHAPES` goes: posts in flight keep theirs alive through :meth:`_track`)."""
        shapes = self._pack_shapes
        shape = shapes.get(x._shape_key)
        if shape is None:
            shape = shapes[x._shape_key] = _PackShape(self, x)
            while len(shapes) > PACK_SHAPES:
                shapes.popitem(last=False)
        else:
            shapes.move_to_end(x._shape_key)
        return shape

    def _pack_lane(self) -> Stream:
        if self._lane is None:
            self._lane = self.platform.create_stream(self.device)
        return self._lane

    def _track(self, event: Event, buffers: tuple) -> None:
        """Keep a posted transfer's buffers until its event completes (dropping the transfer and its
        handle early must not free memory the stream still reads). The caller holds the post lock. The
        completed entries go when a prepare finds no free host array (:meth:`_reap_locked`), or here once more than
        :data:`INFLIGHT_KEEP` are kept: a post does not query events otherwise."""
        q = self._inflight
        if len(q) >= INFLIGHT_KEEP:
            self._reap()
        q.append((event, buffers))

    def _reap_locked(self) -> None:
        """:meth:`_reap` under the post lock (completed posts give their host arrays back to the pool)."""
        with self._post_lock:
            self._reap()

    def _reap(self) -> None:
        """Drop the posted transfers whose events completed, oldest first (the caller holds the post lock)."""
        q = self._inflight
        plat = self.platform
        while q and _ended(plat, q[0][0]):
            q.popleft()
