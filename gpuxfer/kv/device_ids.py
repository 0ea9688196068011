"""Requests whose block IDs live on the device (an engine's block table is already there): the host never
reads them. :meth:`KVAgent.prepare <gpuxfer.kv.agent.KVAgent.prepare>` checks what the tensors' shapes say
(the counts cover the same tokens, the dtypes, the device) and keeps a header per request shape; its
request array is that header and the addresses of the ID tensors; the slot's checked graph reads the IDs
from those tensors and checks them before anything moves (:mod:`gpuxfer.kernels.id_check_kernel`)::

    prepare (host, O(groups))            post (host)                              stream
    -------------------------            -----------                              ------
    the IDs' shapes, dtypes, device;     take a free slot of the route
    the header of this request shape     folded (the agent's stream, the slot's host words free):
    (kept per route) + the tensors'        slot.host := header, seq
    addresses, in a pooled host array      launch_graph(checked.folded)      ->   header, status := 0 (upload)
                                                                                  check: the IDs read from the
                                                                                    tensors into the request;
                                                                                    ranges, a destination
                                                                                    twice (status |= bits)
                                                                                  settle: marks cleared; bad ->
                                                                                    the header's rows zeroed
                                                                                  [expand,] copies (nothing if bad)
                                                                                  slot.host[status] := status
                                                                                  slot.host[landed] := seq
                                         else: copy_async(slot.req, header)  ->   header, status := 0
                                           launch_graph(checked.graph)       ->   check, settle, [expand,] copies
                                           copy_async(word, slot.req[status])->   the post's status word (host)
                                         record_event                        ->   event

(``[expand,]``: with descriptor slots, ``GPUXFER_KV_COPY=descriptors``.) A request that fails the check moves no
byte and its handle raises :class:`~gpuxfer.errors.BlockIdError` naming it (``done()`` once complete, ``wait()``).
The IDs must be ready in the order of the post's stream (written on it, or before it); the transfer keeps the
tensors alive until its posts completed.
"""
from __future__ import annotations

import functools
import itertools
import logging
import operator
import threading
from typing import Mapping

import numpy as np

from ..errors import BadInput, BlockIdError, TransferTimeout
from ..kernels.id_check_kernel import (CHECK_DEST_RANGE, CHECK_DEST_TWICE, CHECK_FIELDS_FIXED, CHECK_FIELDS_PER_GROUP,
                                      CHECK_SOURCE_RANGE, PIECE_FIELDS)
from ..platforms.base import Stream
from .layers import _torch
from .transfer import KVTransferHandle
from .triton_transfer import _Pooled, _SlotTransfer, table_rows

log = logging.getLogger("gpuxfer.kv.agent")

_SHAPE, _TENSORS = operator.attrgetter("shape"), operator.attrgetter("_tensors")
_COUNTS, _ADDRESSES = operator.itemgetter(6), operator.itemgetter(7)     # (as bytes)
_UNIT = (1,)                # a contiguous 1-D tensor's strides

#: request shapes whose headers a route keeps (the least recently made goes first)
HEADERS_KEPT = 64
#: batch shapes (the request shapes of a post_many's requests, in order) whose headers a route keeps
BATCH_HEADERS_KEPT = 16


def wants_device_ids(local_blocks: Mapping, device_ids) -> bool:
    """Whether a request goes by device IDs: ``device_ids`` when given, else whether its first group's IDs are
    a tensor on a GPU."""
    if device_ids is not None:
        if not isinstance(device_ids, bool):
            raise BadInput(f"device_ids must be True, False or None, got {device_ids!r}")
        return device_ids
    for ids in local_blocks.values():
        return bool(getattr(ids, "is_cuda", False))
    return False


class _DeviceRoute:
    """What a route keeps for device-ID requests: the group table the check reads (``(G, 3)``: source blocks,
    destination blocks, mark offset), the marks bitmap's size in words, and the headers of request shapes."""

    def __init__(self, route, device):
        torch = _torch()
        ids = route.ids
        table = [(a, b, int(off)) for (a, b), off in zip(ids.limits, ids.class_offsets)]
        self.gtab = torch.tensor(table, dtype=torch.int64, device=device).reshape(len(table), 3)
        self.device = device
        self.index = -1 if device.type == "cpu" else (device.index or 0)     # what Tensor.get_device() says
        self.n_words = max(1, -(-int(ids.class_span) // 32))
        self.headers: dict = {}
        self.batches: dict = {}             # the same for requests posted together (post_together)
        self.lock = threading.Lock()
        self.tensor, self.int32, self.int64 = torch.Tensor, torch.int32, torch.int64     # (prepare's, looked up once)
        self.data_ptr = torch.Tensor.data_ptr


class _Header:
    """The request array of a request shape, or of several requests posted together, but for the ID tensors'
    addresses (a host array, never written once made), where those go, and the request's size and layout."""

    __slots__ = ("array", "addresses", "entries", "n_seg", "n_rows", "nbytes_moved")

    def __init__(self, array: np.ndarray, addresses: np.ndarray, entries: int, n_seg: np.ndarray, n_rows: int,
                 moved: int):
        self.array, self.addresses = array, addresses       # per request: its 2G tensors' entries (sources first)
        self.entries, self.n_seg, self.n_rows, self.nbytes_moved = entries, n_seg, n_rows, moved


def _layout(route, LS: np.ndarray, LD: np.ndarray, NS: np.ndarray, wide: bool) -> _Header:
    """The request array of ``K`` requests (``LS`` / ``LD`` / ``NS``: ``(K, G)`` source IDs, destination IDs and
    segments per request and group) as :mod:`gpuxfer.kernels.id_check_kernel` lays it out: per group, every
    request's source IDs one after another, then their destination IDs; a piece per request, group and side."""
    return _layout_counts(route, np.stack([LS, LD, NS], axis=1), wide)


def _layout_counts(route, counts: np.ndarray, wide: bool) -> _Header:
    """:func:`_layout` of ``counts`` (``(K, 3, G)``: per request, its source IDs, destination IDs and segments
    per group)."""
    K, _, G = counts.shape
    P = int(route.plane_group.size)
    frame, addresses = _frame(K, G, P)
    head, first = P + 1 + 3 * G, frame.shape[0]
    a = frame.copy()
    sums = counts.sum(axis=0)                           # (3, G): IDs of each side and segments, per group
    runs = np.empty(2 * G + 1, dtype=np.int64)          # where each group's sources, then destinations, start
    runs[0] = first
    runs[1:] = sums[:2].ravel()
    np.cumsum(runs, out=runs)
    ns = sums[2]
    a[P + 1:P + 1 + G] = ns
    a[P + 1 + G:head] = runs[:2 * G]
    np.cumsum(ns[route.plane_group], out=a[1:P + 1])
    a[head + 1] = 1 if wide else 0
    a[head + 2:head + 2 + G] = runs[G + 1:] - runs[G:2 * G]
    pieces = a[head + CHECK_FIELDS_FIXED + CHECK_FIELDS_PER_GROUP * G:].reshape(G, 2, K, PIECE_FIELDS)
    ids = counts[:, :2].transpose(2, 1, 0)              # (G, 2, K): per group and side, each request's IDs
    pieces[..., 2] = ids
    # each piece's first entry: its run's start plus the IDs of the requests before it in the run
    np.cumsum(ids, axis=2, out=pieces[..., 3])
    pieces[..., 3] += runs[:2 * G].reshape(2, G).T[:, :, None] - ids
    moved = int(sum(int(n) * b for n, b in zip(ns.tolist(), route.group_bytes)))
    return _Header(a, addresses, int(runs[-1]), ns, int(a[P]), moved)


@functools.lru_cache(maxsize=64)
def _frame(K: int, G: int, P: int) -> tuple[np.ndarray, np.ndarray]:
    """What :func:`_layout`'s array of ``K`` requests, ``G`` groups and ``P`` planes holds whatever their IDs (the
    pieces' places and sides), read-only, and where the requests' tensors' addresses go in it (``(K, 2G)``:
    sources, then destinations)."""
    head = P + 1 + 3 * G
    p0 = head + CHECK_FIELDS_FIXED + CHECK_FIELDS_PER_GROUP * G
    per = 2 * K * PIECE_FIELDS                          # entries of one group's pieces
    a = np.zeros(p0 + G * per, dtype=np.int64)
    a[head + 2 + G:head + 2 + 2 * G] = p0 + per * np.arange(G)
    a[head + 2 + 2 * G:head + 2 + 3 * G] = 2 * K
    a[p0:].reshape(G, 2 * K, PIECE_FIELDS)[:, K:, 0] = 1
    k, g = np.arange(K)[:, None], np.arange(G)[None, :]
    at = p0 + per * g + PIECE_FIELDS * k + 1
    addresses = np.concatenate([at, at + PIECE_FIELDS * K], axis=1)
    a.flags.writeable = addresses.flags.writeable = False
    return a, addresses


def _header(route, dev: _DeviceRoute, lens_s: tuple, lens_d: tuple, n_seg: tuple, wide: bool) -> _Header:
    """One request shape's :class:`_Header`, made once per route and kept."""
    key = (lens_s, lens_d, wide)
    h = dev.headers.get(key)
    if h is not None:
        return h
    h = _layout(route, np.array([lens_s], dtype=np.int64), np.array([lens_d], dtype=np.int64),
                np.array([n_seg], dtype=np.int64), wide)
    with dev.lock:
        if len(dev.headers) >= HEADERS_KEPT:
            dev.headers.pop(next(iter(dev.headers)))
        dev.headers[key] = h
    return h


def _batch_header(route, counts: bytes, K: int, G: int, wide: bool) -> _Header:
    """The :class:`_Header` of ``K`` requests posted together whose shapes ``counts`` holds (per request, its
    source IDs, destination IDs and segments per group, int64 bytes), made once per route and kept."""
    dev = route.device_ids
    key = (counts, wide)
    h = dev.batches.get(key)
    if h is not None:
        return h
    h = _layout_counts(route, np.frombuffer(counts, dtype=np.int64).reshape(K, 3, G), wide)
    h.array.flags.writeable = False
    with dev.lock:
        if len(dev.batches) >= BATCH_HEADERS_KEPT:
            dev.batches.pop(next(iter(dev.batches)))
        dev.batches[key] = h
    return h


def prepare_device(poster, peer, route, op: str, name: str, local_blocks: Mapping, remote_blocks: Mapping,
                   notify_slot: int | None) -> "_DeviceIdTransfer":
    """:meth:`KVAgent.prepare` of a request whose IDs are device tensors (see the module): O(groups) host work.
    ``poster``: the agent's :class:`~gpuxfer.kv.posting.Poster`."""
    if peer.engine != "triton":
        raise BadInput(f"request {name!r}: block IDs on the device need the triton engine; peer {peer.name!r} "
                       f"runs {peer.engine!r} (pass the IDs on the host)")
    if notify_slot is not None:
        # the notification is queued whatever the device check finds: the peer would go ahead on blocks a
        # refused request did not write
        raise BadInput(f"request {name!r}: a notification needs block IDs on the host (the peer must not be "
                       "signalled for a request the device check may refuse); notify with a later request "
                       "or KVPeer.notify once the handle's wait passed")
    dev = route.device_ids
    if dev is None:
        dev = route.device_ids = _DeviceRoute(route, poster.torch_device())
    T, where, i32, i64 = dev.tensor, dev.index, dev.int32, dev.int64
    push = op == "push"
    rows = []                       # per group: (sources, destinations, segments, their counts)
    dtype = None
    for g, (rs, rd) in zip(route.groups, route.ids.splits):
        mine, theirs = local_blocks[g], remote_blocks[g]
        if dtype is None:
            dtype = getattr(mine, "dtype", None)
        for t in (mine, theirs):
            # (a stride of (1,) is a contiguous 1-D tensor: one call where two ask; others ask both)
            if type(t) is not T or t.is_nested or t.get_device() != where or t.dtype is not dtype \
                    or (t.stride() != _UNIT and (t.dim() != 1 or not t.is_contiguous())) \
                    or (dtype is not i32 and dtype is not i64) or t.is_neg():
                _refuse(name, g, "local blocks" if t is mine else "remote blocks", t, dev.device, dtype)
        s, d = (mine, theirs) if push else (theirs, mine)
        a, b = s.shape[0], d.shape[0]
        n = a if rs == 1 else b
        if -(-n // rs) != a or -(-n // rd) != b:
            raise BlockIdError(f"request {name!r}, group {g!r}: {a} source and {b} destination blocks do not "
                               f"cover the same tokens (block-size ratio {rs}:{rd})")
        rows.append((s, d, n, a, b))
    srcs, dsts, n_seg, lens_s, lens_d = map(list, zip(*rows))
    wide = dtype is i64
    lens_s_t, lens_d_t = tuple(lens_s), tuple(lens_d)
    head = dev.headers.get((lens_s_t, lens_d_t, wide))        # (kept: :func:`_header`'s key)
    if head is None:
        head = _header(route, dev, lens_s_t, lens_d_t, tuple(n_seg), wide)
    tensors = srcs + dsts
    pooled, h = poster.requests.take(head.array.shape[0], poster.reap_locked)
    h[:] = head.array
    addresses = list(map(T.data_ptr, tensors))
    width = 8 if wide else 4
    for t, a in zip(tensors, addresses):
        if (a == 0 or a % width) and t.shape[0]:
            raise BlockIdError(f"request {name!r}: a tensor of block IDs has no memory of its own on the device "
                               f"(address {a:#x}): a meta tensor, or not aligned to its {width}-byte integers")
    h[head.addresses[0]] = addresses
    counts = lens_s + lens_d + n_seg
    return _DeviceIdTransfer(poster, peer, route, op, name, head, pooled, h, tensors, notify_slot,
                             (lens_s, lens_d, n_seg, addresses, wide, counts,
                              np.array(counts, dtype=np.int64).tobytes(), h[head.addresses[0]].tobytes()))


def _refuse(name: str, group: str, side: str, ids, device, dtype) -> None:
    """The :class:`BlockIdError` of a device-ID request's tensor that is not what :func:`prepare_device` takes."""
    torch = _torch()
    what = f"request {name!r}, group {group!r}, {side}"
    if isinstance(ids, torch.Tensor) and type(ids) is not torch.Tensor:
        raise BlockIdError(f"{what}: block IDs on the device must be a plain torch.Tensor, got {type(ids).__name__}")
    if isinstance(ids, torch.Tensor) and (ids.is_nested or ids.is_neg()):
        # (the check reads the tensor's memory: a negated view's memory holds other IDs than its values)
        raise BlockIdError(f"{what}: block IDs on the device must be a plain tensor, got a "
                           f"{'nested' if ids.is_nested else 'negated (neg-bit) view'}")
    if not isinstance(ids, torch.Tensor) or ids.device != device:
        raise BlockIdError(f"{what}: block IDs on the device must be tensors on {device}, got "
                           f"{ids.device if isinstance(ids, torch.Tensor) else type(ids).__name__}")
    if ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 1 or not ids.is_contiguous():
        raise BlockIdError(f"{what}: block IDs on the device must be a contiguous 1-D int32 or int64 tensor, got "
                           f"{ids.dtype} {tuple(ids.shape)}")
    raise BlockIdError(f"{what}: {ids.dtype} beside {dtype}: a request's device IDs share one dtype")


class _StatusWords:
    """Host words a device-ID post's status lands in (pinned where the device is a GPU), one per post, taken
    from chunks of :attr:`CHUNK` and given back when the post's :class:`_Status` goes."""

    CHUNK = 1024

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self.chunks: list = []
        self.free: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def take(self, batch: int = 1) -> "_Status":
        try:
            c, i = self.free.pop()
        except IndexError:
            with self.lock:
                torch = _torch()
                t = torch.zeros(self.CHUNK, dtype=torch.int64, pin_memory=self.pinned)
                self.chunks.append((t, t.numpy()))
                c = len(self.chunks) - 1
                self.free.extend((c, k) for k in range(1, self.CHUNK))
                i = 0
        t, a = self.chunks[c]
        return _Status(self, c, i, a, t.data_ptr() + 8 * i, batch)


class _Status:
    """One post's status word (its bits: :mod:`gpuxfer.kernels.id_check_kernel`); read once the post completed."""

    __slots__ = ("words", "chunk", "index", "array", "ptr", "batch")

    def __init__(self, words: _StatusWords, chunk: int, index: int, array, ptr: int, batch: int):
        self.words, self.chunk, self.index, self.array, self.ptr = words, chunk, index, array, ptr
        self.batch = batch          # requests posted together with this word (post_many)

    def raise_if_bad(self, name: str) -> None:
        bits = int(self.array[self.index])
        if bits:
            _raise_if_bad(bits, name, self.batch)

    def __del__(self):
        self.words.free.append((self.chunk, self.index))


def _raise_if_bad(bits: int, name: str, batch: int) -> None:
    """The :class:`BlockIdError` of a device check's status ``bits`` (nothing when 0)."""
    if bits:
        what = [w for b, w in ((CHECK_SOURCE_RANGE, "a source block ID out of range"),
                               (CHECK_DEST_RANGE, "a destination block ID out of range"),
                               (CHECK_DEST_TWICE, "a destination block named twice")) if bits & b]
        whose = "its block IDs" if batch == 1 else f"the block IDs of the {batch} requests posted with it (post_many)"
        raise BlockIdError(f"request {name!r}: {whose}, checked on the device, hold "
                           f"{' and '.join(what) or f'status {bits:#x}'}; nothing was moved")


class _SlotStatus:
    """A folded checked post's status: the slot's status host word while the slot's next folded checked post has
    not taken it over, then the value it held, kept here (:meth:`hand_over`, called once this post landed)."""

    __slots__ = ("slot", "batch", "live", "bits")

    def __init__(self, slot, batch: int):
        self.slot, self.batch, self.live, self.bits = slot, batch, True, 0

    def hand_over(self) -> None:
        self.bits = int(self.slot.host[self.slot.entries + 2])
        self.live = False

    def raise_if_bad(self, name: str) -> None:
        bits = int(self.slot.host[self.slot.entries + 2])
        if not self.live:           # (read first: a hand-over keeps the value before the word is written again)
            bits = self.bits
        if bits:
            _raise_if_bad(bits, name, self.batch)


class _DeviceIdTransfer(_SlotTransfer):
    """The ``triton`` engine's transfer of a request whose IDs are device tensors (see the module)."""

    def __init__(self, poster, peer, route, op: str, name: str, head: _Header,
                 pooled, array: np.ndarray, tensors: list, notify_slot: int | None, shape: tuple):
        self._tensors = tensors          # the caller's IDs: read by the posts' check, kept alive with the transfer
        self.shape = shape               # (source and destination IDs and segments per group, addresses, int64?,
                                         # the first three in one list, then it and the addresses as int64 bytes)
        self._pooled = pooled
        self._array = array
        self._ptr = pooled[2]           # (the array's address: :class:`~gpuxfer.kv.triton_transfer._RequestPool`)
        self._entries = head.entries
        super(_SlotTransfer, self).__init__(poster, peer, route, op, name, head.n_seg, pooled[0], notify_slot,
                                            head.n_rows, head.nbytes_moved)

    def _check_tensors(self) -> None:
        """The ID tensors still where :meth:`KVAgent.prepare` found them: a tensor given other memory since
        (``set_``, or ``resize_`` past its storage) would have the check read memory that may be free; one
        address read per tensor. (A tensor made smaller in place keeps its memory: the check reads the IDs
        prepare counted, all inside it.)"""
        for t, a in zip(self._tensors, self.shape[3]):
            if t.data_ptr() != a:
                raise BlockIdError(f"request {self.name!r}: a tensor of its block IDs moved to other memory since "
                                   "prepare (set_ or resize_): prepare the request again")

    def _run(self, s: Stream, expand_only: bool = False):
        self._check_tensors()
        poster = self.poster
        slot = poster.take_slot(self.route, s, self.descriptors, self._entries)
        try:
            if expand_only:
                slot.expansion(poster.agent.platform, s, self.descriptors, poster.agent.device)
            return (slot,) + _run_checked(poster, self.route, slot, s, self._array, self._ptr, 1, expand_only)
        except BaseException:
            poster.retire(self.route, slot)
            poster.hold_until_drained(s, (self, slot))
            raise

    def _post_locked(self, s: Stream):
        """:meth:`_run` and :meth:`_finish` written out (a post's Python calls are its host time); the tensors'
        addresses read in one pass, :meth:`_check_tensors` naming the one that moved."""
        poster, route = self.poster, self.route
        if list(map(route.device_ids.data_ptr, self._tensors)) != self.shape[3]:
            self._check_tensors()
        slot = poster.take_slot(route, s, self.descriptors, self._entries)
        status = None
        try:
            status, landed = _run_checked(poster, route, slot, s, self._array, self._ptr, 1)
            if self.notify_slot is None:        # (always: prepare_device refuses a notification)
                value, event = None, poster.agent.platform.record_event(s)
            else:
                value, event = self.peer._notify(s, self.notify_slot)
        except BaseException:
            poster.retire(route, slot)
            poster.hold_until_drained(s, (self, slot, status))
            raise
        slot.event, slot.stream = event, s
        poster.track(event, (self, slot, status) if landed is None else (self, slot, status, landed), s)
        return KVTransferHandle(self, event, s, value, status, landed)

    def expanded_descriptors(self) -> np.ndarray:
        """As :meth:`_SlotTransfer.expanded_descriptors`, after the device check (:class:`BlockIdError` where the
        IDs fail it)."""
        agent, poster = self.agent, self.poster
        plat = agent.platform
        with poster.lock:
            poster.check_usable(self.peer)
            s = agent.stream
            slot, status, _ = self._run(s, expand_only=True)
            rows = table_rows(poster, slot, s, self.descriptors)
            event = plat.record_event(s)
            slot.event, slot.stream = event, s
            poster.track(event, (self, slot, status, rows), s)
        if not plat.event_wait(event, agent.timeout_s):
            raise TransferTimeout(rank=agent.rank, step=0, flag=f"request {self.name!r}", expected=1, seen=0,
                                  timeout_s=agent.timeout_s, what="expanding the descriptors")
        status.raise_if_bad(self.name)
        return rows.numpy().copy()


def post_together(poster, xs: list[_DeviceIdTransfer], s: Stream) -> list:
    """Device-ID requests of one route whose blocks pair one to one and whose IDs have one width, in one post (the
    caller holds the post lock and checked their peers): one request array of every request's pieces
    (:func:`_layout`), one upload, one checked graph, one status word and one event for all. A batch whose IDs
    fail the check -- a destination named by two of its requests included -- moves nothing: every handle
    raises :class:`BlockIdError`."""
    if len(xs) == 1:
        return [xs[0]._post_locked(s)]
    agent = poster.agent
    route, plat = xs[0].route, agent.platform
    chain = itertools.chain.from_iterable
    shapes = list(map(_SHAPE, xs))
    K, G = len(xs), len(route.groups)
    # every request's tensors' addresses now, in one array, against those prepare found
    addresses = np.fromiter(map(route.device_ids.data_ptr, chain(map(_TENSORS, xs))), dtype=np.int64,
                            count=2 * G * K)
    if addresses.tobytes() != b"".join(map(_ADDRESSES, shapes)):
        for x in xs:
            x._check_tensors()      # (raises naming the request whose tensor moved)
    counts = b"".join(map(_COUNTS, shapes))
    head = route.device_ids.batches.get((counts, shapes[0][4]))         # (kept: :func:`_batch_header`'s key)
    if head is None:
        head = _batch_header(route, counts, K, G, shapes[0][4])
    token, h = poster.requests.take(head.array.shape[0], poster.reap)
    keep = _Pooled(poster.requests, token)
    h[:] = head.array
    h[head.addresses] = addresses.reshape(head.addresses.shape)
    slot = poster.take_slot(route, s, head.n_rows, head.entries)
    status = None
    try:
        status, landed = _run_checked(poster, route, slot, s, h, token[2], len(xs))
        event = plat.record_event(s)          # (device-ID requests carry no notification: prepare_device)
    except BaseException:
        poster.retire(route, slot)
        poster.hold_until_drained(s, (tuple(xs), keep, status, slot))
        raise
    slot.event, slot.stream = event, s
    poster.track(event, (tuple(xs), slot, keep, status) + ((landed,) if landed is not None else ()), s)
    return KVTransferHandle._together(xs, event, s, None, status, landed)


def _run_checked(poster, route, slot, s: Stream, array: np.ndarray, ptr: int, batch: int, expand_only: bool = False):
    """A checked request array (``array``: the requests' header, ``batch`` requests; ``ptr``: its address) run in
    ``slot`` on ``s``:
    on the agent's stream, where the slot's host words are free, its folded checked graph alone (the status
    lands in the slot's host words); else the upload, the checked graph and the status copied into a pooled
    word. ``(status, landed)``: what the handles read (landed: None unless folded)."""
    plat = poster.agent.platform
    checked = slot.checked
    if checked is None:
        checked = _checked(poster, route, slot, s)
    own = s is poster.agent.stream    # the agent's stream: its calls bound once (Platform.stream_calls)
    if own and checked.folded is not None and not expand_only and slot.host_free():
        status = _SlotStatus(slot, batch)
        before, slot.status_owner = slot.status_owner, status
        if before is not None:
            before.hand_over()
        return status, slot.post_folded(poster, checked.folded, array)
    copy = poster.calls.copy if own else (lambda d, src, n: plat.copy_async(s, d, src, n))
    copy(slot.req_ptr, ptr, array.nbytes)
    if expand_only:
        plat.launch(s, checked.check_and_expand)
    else:
        _launch_checked(poster, checked, s, own)
    status = poster.status_words.take(batch)
    copy(status.ptr, slot.req_ptr + 8 * checked.status_at, 8)
    return status, None


def _launch_checked(poster, checked: "_Checked", s: Stream, own: bool) -> None:
    """A slot's checked graph on ``s`` (its launches one by one where the platform captured none)."""
    if checked.graph is None:
        checked.enqueue(poster.agent.platform, s)
    elif own:
        poster.calls.launch_graph(checked.graph)
    else:
        poster.agent.platform.launch_graph(s, checked.graph)


class _Checked:
    """A slot's parts for device-ID requests, made on the slot's first such post: the marks bitmap (zeroed), the
    check and settle launches and the checked graph (check, settle, expand, copies)."""

    __slots__ = ("marks", "check", "settle", "graph", "status_at", "slot", "folded")

    def __init__(self, route, slot, device):
        from ..kernels.blocks import check_ids_launchers, request_header_len
        torch = _torch()
        dev = route.device_ids
        self.slot = slot
        self.marks = torch.zeros(dev.n_words, dtype=torch.int32, device=device)
        self.status_at = request_header_len(int(route.plane_group.size), len(route.groups))
        launches = check_ids_launchers(slot.req, dev.gtab, self.marks, n_planes=int(route.plane_group.size),
                                       n_groups=len(route.groups))
        self.check, self.settle = launches if launches is not None else (None, None)
        self.graph = self.folded = None      # folded: the upload, these launches, the status and landed words

    def kernels(self, stream=None) -> None:
        if self.check is not None:
            self.check(stream)
            self.settle(stream)
        self.slot.kernels(stream)

    def check_and_expand(self, stream=None) -> None:
        if self.check is not None:
            self.check(stream)
            self.settle(stream)
        if self.slot.expand is not None:
            self.slot.expand(stream)

    def enqueue(self, plat, s: Stream) -> None:
        native = plat.native_stream(s)
        if native is None:
            plat.launch(s, self.kernels)
        else:
            self.kernels(native)


def _checked(poster, route, slot, s: Stream) -> _Checked:
    """A slot's :class:`_Checked`, made on its first device-ID post: the check's kernels loaded first by a launch
    on ``s`` over a zeroed request, ID buffer and bitmap of their own (the slot's request may hold a request of
    before), then the checked graph captured (as :meth:`Poster._new_slot <gpuxfer.kv.posting.Poster._new_slot>`
    captures a slot's)."""
    if slot.checked is not None:
        return slot.checked
    from ..kernels.blocks import check_ids_launchers
    agent = poster.agent
    plat = agent.platform
    device = poster.torch_device()
    checked = _Checked(route, slot, device)
    if checked.check is None:
        slot.checked = checked
        return checked
    torch = _torch()
    if not plat.kernels_interpreted:
        G = len(route.groups)
        # scratch made like the slot's request and bitmap, so the kernels the capture below launches are the
        # variants loaded here (a capture cannot load a module)
        scratch = (torch.zeros_like(slot.req), torch.zeros_like(checked.marks))
        plat.stream_wait_event(s, plat.record_event(plat.current_stream(agent.device)))
        check, settle = check_ids_launchers(scratch[0], route.device_ids.gtab, scratch[1],
                                            n_planes=int(route.plane_group.size), n_groups=G)
        native = plat.native_stream(s)
        if native is None:
            plat.launch(s, lambda: (check(), settle()))
        else:
            check(native)
            settle(native)
        event = plat.record_event(s)
        poster.track(event, scratch, s)
    if poster.graphs:
        try:
            checked.graph = plat.capture_graph(poster.capture_stream(), lambda c: checked.enqueue(plat, c))
        except Exception as exc:  # noqa: BLE001 - the same launches run one by one instead
            log.warning(
                "agent %s: capturing a slot's checked launches as a graph failed (%s: %s); posts launch them one "
                "by one", agent.name, type(exc).__name__, exc)
        if checked.graph is not None and slot.host is not None:
            poster._fold(slot, lambda c: slot.record_folded(plat, c, checked.enqueue, checked.status_at), "folded",
                         owner=checked)
    slot.checked = checked
    return checked
