"""The ``triton`` engine's transfers: a route's slots (device buffers with their launches bound once
and captured as a graph, :class:`_Slot`), the transfer that runs a request in one
(:class:`_SlotTransfer`) and the pool of host request arrays (:class:`_RequestPool`). The ring of
slots per route is kept by :meth:`Poster.take_slot <gpuxfer.kv.posting.Poster.take_slot>`."""
from __future__ import annotations

import time

import numpy as np

from ..errors import TransferTimeout
from ..platforms.base import Platform, Stream
from .layers import _torch
from .transfer import KVTransfer, KVTransferHandle


#: a folded post's handle answers "not done yet" from its host word alone for this long after the post, then asks
#: the event too (a failed stream raises from there, a bit later than from the event alone)
LANDED_ONLY_S = 0.05
#: a slot folds its upload into its graph (:attr:`_Slot.folded`) up to this many request entries: the folded
#: upload copies the slot's whole capacity, so a large slot uploads what its requests need instead
FOLD_MAX_ENTRIES = 1 << 15


class _Slot:
    """A route's device buffers for one request at a time: the request array (header + block IDs) and the
    ``(rows, 3)`` descriptors, both zeroed when made; the launchers bound to them once (the expansion over a
    fixed grid, one copy per tiling whose row range each launch reads from the request's header on the
    device); the graph of those launches where the platform captures one. Whatever a request writes into
    ``req``, every access stays inside these buffers and the registered memory (the kernels' bounds), and
    every row of ``out`` holds zeros or a descriptor the expansion wrote: so any request whose rows and
    entries fit can run here, one after another.

    A slot of at most :data:`FOLD_MAX_ENTRIES` entries also has ``host``, host words of its own (pinned on a
    GPU): ``[0, entries)`` the next request, ``[entries]`` its post's sequence number, ``[entries + 1]`` the
    last sequence number that landed, ``[entries + 2]`` the device check's status. Its folded graph
    (:attr:`folded`) is the upload of ``host[:entries + 1]`` into ``req``, the launches, then the copy of the
    sequence number back into ``host[entries + 1]``: a post is one graph launch, and whether it completed is
    a host load (:class:`_Landed`). The host words are written only once the last folded post landed
    (:meth:`host_free`).

    A slot is free for a post on stream ``s`` once the last post on it completed, or when that post was on
    ``s`` itself (stream order puts the new upload after it).

    With ``blocks`` (``GPUXFER_KV_COPY=blocks``) a slot has no descriptor table and no expansion: each copy
    launch derives its rows from the request and the route's planes on the device
    (:func:`~gpuxfer.kernels.launch.copy_blocks_launcher`), so any request whose entries fit runs here whatever
    its rows; a descriptor table is made only where :meth:`expansion` is asked for one (for checking the
    expansion, not a transfer path)."""

    __slots__ = ("rows", "entries", "req", "out", "req_ptr", "expand", "copies", "graph", "event", "stream", "used",
                 "checked", "host", "host_t", "host_ptr", "folded", "seq", "status_owner", "blocks", "planes",
                 "n_groups", "spent")

    def __init__(self, route, rows: int, entries: int, device, pinned: bool = False, blocks: bool = False):
        from ..kernels.blocks import expand_launcher
        from ..kernels.launch import copy_blocks_launcher, copy_range_launcher
        torch = _torch()
        self.rows, self.entries, self.blocks = (0 if blocks else rows), entries, blocks
        # (the route's plane table, not the route: a route holds its slots, and a slot holding its route back would
        # keep a route dropped from the cache until a cyclic collection)
        self.planes, self.n_groups = route.planes, len(route.groups)
        fold = entries <= FOLD_MAX_ENTRIES
        # (one more entry when folded: the post's sequence number, uploaded with the request)
        self.req = torch.empty(entries + int(fold), dtype=torch.int64, device=device)[:entries]
        self.req_ptr = self.req.data_ptr()
        self.spent: list = []       # (blocks) descriptor tables :meth:`expansion` made before the current one
        if blocks:
            self.out = self.expand = None
            rows_cap = _blocks_max_rows(route, entries)
            self.copies = [f for f in (copy_blocks_launcher(route.src_anchor, route.dst_anchor, route.planes,
                                                            self.req, n_groups=len(route.groups), plane_lo=a,
                                                            plane_hi=b, max_rows=rows_cap, nbytes_hint=c,
                                                            splits=bool((route.table[a:b, 6:8] > 1).any()))
                                       for a, b, c in route.launch_classes) if f is not None]
        else:
            self.out = torch.empty((rows, 3), dtype=torch.int64, device=device)
            self.expand = expand_launcher(route.planes, self.req, self.out, n_groups=len(route.groups))
            self.copies = [f for f in (copy_range_launcher(route.src_anchor, route.dst_anchor, self.out, self.req,
                                                           lo_at=a, hi_at=b, nbytes_hint=c)
                                       for a, b, c in route.launch_classes) if f is not None]
        self.graph = None
        self.event = None
        self.stream = None
        self.used = 0
        self.checked = None         # its parts for device-ID requests (made by :mod:`~gpuxfer.kv.device_ids`)
        self.host = self.host_t = self.folded = self.status_owner = None
        self.host_ptr = 0
        self.seq = 0                # the last folded post's sequence number
        if fold:
            self.host_t = torch.zeros(entries + 3, dtype=torch.int64, pin_memory=pinned)
            self.host, self.host_ptr = self.host_t.numpy(), self.host_t.data_ptr()

    def expansion(self, plat: Platform, s: Stream, rows: int, device: int):
        """The expansion launch into a descriptor table of at least ``rows`` rows (``self.out`` once it ran): the
        slot's own; with ``blocks``, one made now (zeroed on ``s``, after platform device ``device``'s current
        stream; at least twice a smaller one before it, which stays with the slot: work queued may still write it)
        and kept beside the slot."""
        if self.blocks and (self.out is None or self.out.shape[0] < rows):
            from ..kernels.blocks import expand_launcher
            before = self.out
            if before is not None:
                self.spent.append(before)
            n = max(rows, 1, 0 if before is None else 2 * before.shape[0])
            self.out = _torch().empty((n, 3), dtype=_torch().int64, device=self.req.device)
            plat.stream_wait_event(s, plat.record_event(plat.current_stream(device)))
            plat.memset_async(s, self.out.data_ptr(), 0, self.out.shape[0] * 24)
            self.expand = expand_launcher(self.planes, self.req, self.out, n_groups=self.n_groups)
        return self.expand

    def kernels(self, stream=None) -> None:
        """The expansion (none with ``blocks``) and the copies, on ``stream`` (a driver handle) or torch's current
        stream."""
        if self.expand is not None and not self.blocks:
            self.expand(stream)
        for launch in self.copies:
            launch(stream)

    def enqueue(self, plat: Platform, s: Stream) -> None:
        """The kernels on ``s``, launched one by one: straight on its driver handle where the platform gives one."""
        native = plat.native_stream(s)
        if native is None:
            plat.launch(s, self.kernels)
        else:
            self.kernels(native)

    def record_folded(self, plat: Platform, s: Stream, launches, status_at: int | None = None) -> None:
        """What a folded graph holds, enqueued on ``s`` (a capturing stream): the upload of the host words,
        ``launches(plat, s)``, the status (``req[status_at]``, a checked graph's) and the sequence number copied
        back."""
        e = self.entries
        plat.copy_async(s, self.req_ptr, self.host_ptr, 8 * (e + 1))
        launches(plat, s)
        if status_at is not None:
            plat.copy_async(s, self.host_ptr + 8 * (e + 2), self.req_ptr + 8 * status_at, 8)
        plat.copy_async(s, self.host_ptr + 8 * (e + 1), self.req_ptr + 8 * e, 8)

    def host_free(self) -> bool:
        """Whether the host words may be written: no folded post of this slot is still to land."""
        return self.host[self.entries + 1] >= self.seq

    def post_folded(self, poster, graph, array: np.ndarray) -> "_Landed":
        """Write a request and the next sequence number of ``poster`` into the host words (the caller checked
        :meth:`host_free`) and launch ``graph`` (this slot's folded graph or its checked one) on the agent's
        stream; where the post's completion shows."""
        h, seq = self.host, poster.next_seq()
        h[:array.shape[0]] = array
        h[self.entries] = seq
        self.seq = seq                  # (before the launch: words a failed launch may have queued stay unwritten)
        poster.calls.launch_graph(graph)
        return _Landed(h, self.entries + 1, seq)


def _blocks_max_rows(route, entries: int) -> int:
    """The rows a blocks slot's copy launches visit at most, whatever its request's header says: no honest
    request of ``entries`` entries has more (each plane's segments are at most its group's IDs times the
    larger split), so a forged header's counts end there rather than run the kernel for ~2^63 empty rows."""
    table = route.table
    split = int(table[:, 6:8].max()) if table.shape[0] else 1
    return min(table.shape[0] * max(entries, 1) * max(split, 1), 1 << 62)


class _Landed:
    """Where a folded post's completion shows: ``words[at] >= seq`` once its graph ran to the end (the slot's
    later folded posts land later numbers); ``until``: till when a word not landed yet is taken as "not done"
    without asking the event (:data:`LANDED_ONLY_S`)."""

    __slots__ = ("words", "at", "seq", "until")

    def __init__(self, words: np.ndarray, at: int, seq: int):
        self.words, self.at, self.seq = words, at, seq
        self.until = time.monotonic() + LANDED_ONLY_S

    def landed(self) -> bool:
        return self.words[self.at] >= self.seq


def run_in_slot(poster, route, s: Stream, array: np.ndarray, ptr: int, rows: int, entries: int,
                expand_only: bool = False) -> tuple[_Slot, _Landed | None]:
    """Upload a request array (``array``: ``rows`` descriptors, ``entries`` entries in the slot; ``ptr``: its
    address, the third item of its :class:`_RequestPool` token) into a free slot of ``route`` and enqueue its
    kernels on ``s`` (the caller holds the post lock of ``poster``, a :class:`~gpuxfer.kv.posting.Poster`): on
    the agent's stream, where the slot's host words are free, the
    slot's folded graph alone (returned: where its completion shows); else the upload, then the slot's graph
    or its launches one by one (None)."""
    slot = poster.take_slot(route, s, rows, entries)
    try:
        return slot, _enqueue(poster, slot, s, array, ptr, rows, expand_only)
    except BaseException:
        poster.retire(route, slot)
        poster.hold_until_drained(s, (slot,))
        raise


def _enqueue(poster, slot: _Slot, s: Stream, array: np.ndarray, ptr: int, rows: int, expand_only: bool
             ) -> _Landed | None:
    agent = poster.agent
    own = s is agent.stream         # the agent's stream: its calls bound once (Platform.stream_calls)
    if own and slot.folded is not None and not expand_only and slot.host_free():
        return slot.post_folded(poster, slot.folded, array)
    plat = agent.platform
    if own:
        poster.calls.copy(slot.req_ptr, ptr, array.nbytes)
    else:
        plat.copy_async(s, slot.req_ptr, ptr, array.nbytes)
    if expand_only:
        expand = slot.expansion(plat, s, rows, agent.device)
        if expand is not None:
            plat.launch(s, expand)
    elif slot.graph is not None:
        if own:
            poster.calls.launch_graph(slot.graph)
        else:
            plat.launch_graph(s, slot.graph)
    else:
        slot.enqueue(plat, s)
    return None


class _SlotTransfer(KVTransfer):
    """The ``triton`` engine: a prepared request is only its host array; each post runs it in a slot of the
    route's ring (:class:`_Slot`) -- on the agent's stream the slot's folded graph (its host words written,
    one graph launch), else one upload of the array and one graph launch (or the slot's launches where the
    platform captures no graph); then the notification and one event::

        prepare (host)                 post (host)                          stream
        --------------                 -----------                          ------
        check the IDs, write the       take a free slot of the route  ->
        header and IDs into a          folded: slot.host := array, seq
        pooled host array                launch_graph(slot.folded)    ->    upload (host words -> slot.req)
                                                                             expand (IDs -> descriptors)
                                                                             copy per tiling (rows from the header)
                                                                             slot.host[landed] := seq
                                       else: copy_async(slot.req,     ->    upload (header + IDs)
                                               array)
                                         launch_graph(slot.graph)     ->    expand, copies
                                       [notify: 2 stream operations]  ->    peer's word k := n
                                       record_event                   ->    event

    A folded post's handle asks the host word whether it completed (no driver call) and the event only while
    it has not.

    The array goes back to the agent's pool when the transfer is collected, which is after its last post
    completed (the agent keeps a posted transfer until its event completes)."""

    def __init__(self, poster, peer, route, op: str, name: str, n_seg: list[int],
                 host, array: np.ndarray, notify_slot: int | None, descriptors: int, nbytes: int):
        self._pooled = host
        self._array = array
        self._ptr = host[2]             # (the array's address: a view of the pooled array from its start)
        self._entries = int(array.shape[0])
        super().__init__(poster, peer, route, op, name, n_seg, host[0], notify_slot, descriptors, nbytes)

    def _run(self, s: Stream, expand_only: bool = False) -> tuple[_Slot, _Landed | None]:
        """Upload this request into a free slot and enqueue its kernels on ``s`` (the caller holds the post lock)."""
        return run_in_slot(self.poster, self.route, s, self._array, self._ptr, self.descriptors, self._entries,
                           expand_only)

    def post(self, stream: Stream | None = None) -> KVTransferHandle:
        """Enqueue the transfer on ``stream`` (default: the agent's own) and return its handle.

        Host work: on the agent's stream, the request array written into a free slot's host words and one
        graph launch (the upload, the expansion and one copy per kernel tiling, captured once per slot); else
        one copy (the request array) and one graph launch (launches one by one where the platform captures no
        graph); then a notification (two stream operations, :meth:`KVPeer.notify`) if asked for and one event.
        None of it depends on the number of descriptors.
        """
        poster = self.poster
        s = poster.agent.stream if stream is None else poster.stream(stream)     # (None: checked open below)
        with poster.lock:                  # remove_peer and close exclude it: checked under it
            poster.check_usable(self.peer)
            return self._post_locked(s)

    def _post_locked(self, s: Stream) -> KVTransferHandle:
        """:meth:`post` on ``s`` once the caller holds the post lock and checked the peer: :func:`run_in_slot`
        and :meth:`_finish` written out (a post's Python calls are its host time)."""
        poster, route = self.poster, self.route
        slot = poster.take_slot(route, s, self.descriptors, self._entries)
        try:
            landed = _enqueue(poster, slot, s, self._array, self._ptr, self.descriptors, False)
            if self.notify_slot is None:
                value, event = None, poster.agent.platform.record_event(s)
            else:
                value, event = self.peer._notify(s, self.notify_slot)
                landed = None       # (the event then covers the notification)
        except BaseException:
            poster.retire(route, slot)
            poster.hold_until_drained(s, (self, slot))
            raise
        slot.event, slot.stream = event, s
        poster.track(event, (self, slot) if landed is None else (self, slot, landed), s)
        return KVTransferHandle(self, event, s, value, landed=landed)

    def expanded_descriptors(self) -> np.ndarray:
        """Run only the upload and the expansion (in a slot, on the agent's stream), wait, and return the
        ``(N, 3)`` descriptors (offsets from the source and destination anchors) -- for checking the expansion;
        not a transfer path."""
        agent, poster = self.agent, self.poster
        plat = agent.platform
        with poster.lock:
            poster.check_usable(self.peer)
            s = agent.stream
            slot, _ = self._run(s, expand_only=True)
            rows = table_rows(poster, slot, s, self.descriptors)
            event = plat.record_event(s)
            slot.event, slot.stream = event, s
            poster.track(event, (self, slot, rows), s)
        if not plat.event_wait(event, agent.timeout_s):
            raise TransferTimeout(rank=agent.rank, step=0, flag=f"request {self.name!r}", expected=1, seen=0,
                                  timeout_s=agent.timeout_s, what="expanding the descriptors")
        return rows.numpy().copy()


def table_rows(poster, slot: _Slot, s: Stream, n: int):
    """The first ``n`` rows of ``slot``'s descriptor table, copied on ``s`` (after the expansion queued there) into
    a host tensor of their own: the slot's next post or expansion, from any thread, rewrites the table."""
    torch = _torch()
    rows = torch.empty((n, 3), dtype=torch.int64, pin_memory=poster.requests.pinned)
    if n:
        poster.agent.platform.copy_async(s, rows.data_ptr(), slot.out.data_ptr(), n * 24)
    return rows


class _RequestPool:
    """Host int64 arrays for request arrays, pinned where the device is a GPU (the upload is then a DMA),
    kept for reuse by capacity (powers of two): taking one costs a list pop, not an allocation. A token is
    ``(tensor, its numpy array, its address)``: the address read once, when the array is made (a post's upload
    reads it from there: ``ndarray.ctypes`` costs microseconds a call), and it holds for as long as the token
    lives: the pool's tensors are its own, never resized nor given other memory."""

    KEEP = 16                   # arrays kept per capacity, at least
    KEEP_ENTRIES = 1 << 18      # ... or while those kept hold fewer entries (2 MiB): a batch of small requests
                                # (post_many) gives its arrays back to be taken again, not freed and made again

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self.free: dict[int, list] = {}

    def take(self, n: int, reap=None):
        """``(token, array)``: an array of ``n`` entries (at the token's address), and what to give back once it is
        no longer read.
        ``reap``: called when none of that capacity is free (it may give some back) before one is made."""
        cap = (n - 1).bit_length()
        cap = 1 << (cap if cap > 10 else 10)        # (at least 1024 entries)
        kept = self.free.get(cap)
        if not kept and reap is not None:
            reap()
            kept = self.free.get(cap)
        token = None
        if kept:
            try:
                token = kept.pop()
            except IndexError:      # another thread took the last one
                pass
        if token is None:
            torch = _torch()
            owner = torch.empty(cap, dtype=torch.int64, pin_memory=self.pinned)
            token = (owner, owner.numpy(), owner.data_ptr())
        return token, token[1][:n]

    def give(self, token) -> None:
        cap = token[1].shape[0]
        kept = self.free.setdefault(cap, [])
        if len(kept) < self.KEEP or len(kept) * cap < self.KEEP_ENTRIES:
            kept.append(token)


class _Pooled:
    """A request array of a post alone (several requests merged into one), given back to the pool once the agent
    lets go of it (after the post's event)."""

    __slots__ = ("pool", "token")

    def __init__(self, pool: _RequestPool, token):
        self.pool, self.token = pool, token

    def __del__(self):
        self.pool.give(self.token)
