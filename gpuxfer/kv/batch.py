"""Many prepared requests in one post (:meth:`KVAgent.post_many <gpuxfer.kv.agent.KVAgent.post_many>`): a
decode step that admits several requests moves them with one upload and one graph launch per route.

The ``triton`` transfers of one route merge into one request array: per group, every request's source IDs
one after another, then every request's destination IDs, the header's counts summed. Where a group's two
sides have blocks of different sizes (a segment ``j`` reads block ``j // split``), each request's segments
are rounded up to a whole number of the larger blocks with IDs of ``-1`` on the side of the smaller blocks:
the expansion writes a zero-byte row for an ID outside the group (:mod:`gpuxfer.kernels.block_kernel`), so
the next request's segments start on a block of its own and the padding moves nothing::

    post_many([a, b, c])  (host, the post lock held)            stream
    -----------------------------------------------             ------
    every transfer's peer checked usable
    merged array of a + b + c (their checked IDs),
      no destination block twice among them        ->
    copy_async(slot.req, merged)                   ->           upload
    launch_graph(slot.graph)                       ->           expand + copies of a, b and c
    [a's, then c's notification]                   ->           the peers' words
    record_event                                   ->           one event: the handles of a, b and c

A route's batch of more than :data:`BATCH_ROWS` descriptors is cut into parts; a part of host-ID requests
fewer than :data:`MERGE_FROM` is then posted one request after another, a part of device-ID requests is merged
whatever its size. Where slots copy from the block IDs (``GPUXFER_KV_COPY=blocks``: no descriptor table), a
route's batch is never cut. Host-ID requests merge only while each is small (:data:`MERGE_ENTRIES`): a batch
holding a larger one is posted one request after another.

Two requests of a batch that write the same destination block are not merged (their order would not be
defined): that route's requests are posted one after another, as :meth:`KVTransfer.post` would. So are those
of a route dropped from the agent's cache and of the one built again in its place (one route to the caller).

Requests whose IDs are device tensors (:mod:`gpuxfer.kv.device_ids`) of a route whose blocks pair one to one
merge too (:func:`~gpuxfer.kv.device_ids.post_together`): one request array listing every request's tensors,
one upload, one checked graph; the host never sees their IDs, so a batch in which two requests name the same
destination block fails the device check as a whole (nothing moves, every handle raises). With descriptor
slots, a batch past :data:`BATCH_ROWS` is cut into parts, each checked as a whole: two requests naming one
destination in two parts both move, in the batch's order, as separate posts would. A route whose batch
mixes host and device IDs, or whose device-ID requests' block sizes differ, is posted one request after
another, in order. Transfers of other engines (``pack``, ``copy_engine``, the NIXL route) are posted one by
one after the triton engine's; NIXL orders no transfer after another, so one of the NIXL route that writes a
block an earlier one of the batch writes is posted once that one completed (its wait bounded).
"""
from __future__ import annotations

import itertools
from itertools import repeat
from operator import attrgetter, is_, itemgetter
from typing import Sequence

import numpy as np

from ..errors import BadInput
from ..platforms.base import Stream
from .transfer import KVTransfer, KVTransferHandle
from .device_ids import _DeviceIdTransfer, post_together
from .triton_transfer import _Pooled, _SlotTransfer, run_in_slot

#: a merged post's descriptors at most (24 MiB of slot), unless one request alone has more: a longer batch is
#: cut into several posts
BATCH_ROWS = 1 << 20

#: where a batch of host-ID requests is cut, a part of fewer requests than this is posted one request after
#: another: merging host IDs is host work proportional to the IDs (the merged array written, its destinations
#: marked), which a cut batch -- requests of many descriptors -- has plenty of, while a request's own post
#: uploads its staged array as it is (kv-dsv4 32k page 16, 64 requests on the host emulation with no-op stream
#: calls: ten merged parts 1.8 ms, 64 posts 0.34 ms). A part of device-ID requests is merged whatever its size:
#: the host lays out their tensors' addresses only (the same 64: ten merged parts 190 us, 64 posts 380 us)
MERGE_FROM = 8

#: a route's host-ID requests merge only where each holds at most this many request-array entries (its IDs of
#: both sides and header); a batch with a larger one is posted one request after another. Merging pays a few
#: nanoseconds a block ID (written into the merged array, its destination marked) to save a post's fixed host work
#: (its graph launch, ~5 us on the host emulation, 15-25 us on a GPU machine): requests of a few thousand IDs
#: and more cost more merged (kv-dsv4 32k page 16, ~8.8k IDs each, 64 requests with blocks slots on the host
#: emulation with no-op stream calls: merged 2.1 ms, posted one by one 0.34-0.44 ms)
MERGE_ENTRIES = 4096

_TRITON = frozenset((_SlotTransfer, _DeviceIdTransfer))
_ROUTE, _AGENT_PEER, _SHAPE = attrgetter("route"), attrgetter("agent", "peer"), attrgetter("shape")
_WIDE = itemgetter(4)
_ENTRIES, _NOTIFY = attrgetter("_entries"), attrgetter("notify_slot")
_SUM = np.add.reduce


def post_many(poster, transfers: Sequence[KVTransfer], stream: Stream | None) -> list[KVTransferHandle]:
    """:meth:`KVAgent.post_many` of the agent whose :class:`~gpuxfer.kv.posting.Poster` ``poster`` is: the
    handles, in the order of ``transfers``."""
    agent = poster.agent
    if type(transfers) is not list and (isinstance(transfers, (str, bytes)) or not isinstance(transfers, Sequence)):
        raise BadInput(f"post_many takes a sequence of prepared transfers, got {type(transfers).__name__}")
    if len(transfers) == 1:         # (what a decode step admitting one request posts): its own post, which checks
        x = transfers[0]            # its peer; a transfer of this agent's (anything else: _sort's error)
        if isinstance(x, KVTransfer) and x.agent is agent:
            try:
                return [x.post(stream)]     # (its post checks the stream)
            except Exception as exc:
                exc.handles = [None]
                raise
    routes, others, peers, kinds = _sort(agent, transfers)
    s = agent.stream if stream is None else poster.stream(stream)      # (None: the agent checked open below)
    # (one route's triton requests hash by identity; other items may not hash at all)
    if len(set(transfers) if kinds is not None else set(map(id, transfers))) != len(transfers):
        raise BadInput("post_many: a transfer appears twice (post it again in a later call)")
    for i in others:                # the other engines' peers before anything is queued (triton's: under the lock)
        poster.check_usable(transfers[i].peer)
    handles: list[KVTransferHandle | None] = [None] * len(transfers)
    try:
        if routes:
            with poster.lock:
                for peer in peers:  # before anything is queued, with remove_peer and close kept out
                    poster.check_usable(peer)
                for idx in routes.values():
                    _post_route_requests(poster, transfers, idx, s, handles, kinds)
        posted = []                 # the NIXL route's transfers posted: (what each writes, its handle)
        for i in others:
            writes = getattr(transfers[i], "writes", None)
            if writes is not None:      # (NIXL orders no transfer after another)
                for earlier, h in posted:
                    if _overwrites(writes, earlier):
                        h.wait()
            handles[i] = transfers[i].post(s)
            if writes is not None:
                posted.append((writes, handles[i]))
    except Exception as exc:
        # some transfers may be queued already: the caller learns which (and must not reuse their blocks
        # before they complete)
        exc.handles = list(handles)
        raise
    return handles


def _overwrites(writes: tuple, earlier: tuple) -> bool:
    """Whether a NIXL-route transfer may write a block an ``earlier`` one writes (their ``writes``: the side -- the
    peer's uid, or None for this agent --, the layer range, ``{group: destination block IDs}``): the same side's
    block of a group, in layer ranges that meet. It is posted once that one completed, so the later one's bytes
    are what stays, as on the IPC route."""
    (mine, ml, mw), (theirs, ol, ow) = writes, earlier
    if mine != theirs or (ml is not None and ol is not None and (ml[1] <= ol[0] or ol[1] <= ml[0])):
        return False
    return any(g in ow and np.intersect1d(ids, ow[g]).size for g, ids in mw.items())


def _sort(agent, transfers: Sequence[KVTransfer]) -> tuple[dict, list[int], list, set | None]:
    """``transfers`` checked to be the agent's and sorted: the ``triton`` engine's requests (host or device IDs)
    by route (its peer and salt), the others' positions, the distinct peers of the first, and the types of the
    transfers where all are the ``triton`` engine's requests of one route (else None)."""
    kinds = set(map(type, transfers))
    if kinds and kinds <= _TRITON:      # (the agent's requests of one route: sorted without a Python loop)
        route = transfers[0].route
        if all(map(is_, map(_ROUTE, transfers), repeat(route))):
            owners = set(map(_AGENT_PEER, transfers))      # (agents and peers compare by identity)
            if len(owners) == 1:
                owner, peer = owners.pop()
                if owner is agent:
                    return {id(route): range(len(transfers))}, [], [peer], kinds
    routes: dict[tuple, list[int]] = {}
    others: list[int] = []
    peers: dict[int, object] = {}
    for i, x in enumerate(transfers):
        t = type(x)
        if (t is _SlotTransfer or t is _DeviceIdTransfer) and x.agent is agent:
            # by what the route moves (its salt: both agents, the layer pieces, the groups' blocks), not by the
            # route object: a route dropped from the cache and the one built again in its place are one route to
            # the caller, whose requests keep their order (:func:`_post_route_requests`)
            routes.setdefault((id(x.peer), x.route.salts[0]), []).append(i)
            peers[id(x.peer)] = x.peer
        elif isinstance(x, KVTransfer) and x.agent is agent:
            others.append(i)
        else:
            raise BadInput(f"post_many: item {i} ({x!r}) is not a transfer prepared by agent {agent.name!r}")
    return routes, others, list(peers.values()), None


def _post_route_requests(poster, transfers: Sequence[KVTransfer], idx: Sequence[int], s: Stream,
                         handles: list, kinds: set | None = None) -> None:
    """One route's requests (their positions ``idx``) posted under the post lock, each handle into ``handles``
    as it is queued (an error part way leaves the queued ones' handles there). ``kinds``: the requests' types
    where ``idx`` is every transfer (:func:`_sort`)."""
    everything = type(idx) is range and len(idx) == len(transfers)
    every = list(transfers) if everything else [transfers[i] for i in idx]
    one = True
    if kinds is None or not everything:
        kinds = set(map(type, every))
        one = all(map(is_, map(_ROUTE, every), repeat(every[0].route)))
    # host and device IDs mixed (the host cannot tell whether their destinations overlap), device IDs of
    # different widths or of a route whose block sizes differ, or requests of a route dropped from the cache
    # and of the one built again in its place: one request after another (post None)
    if not one:
        post = None
    elif kinds == {_SlotTransfer}:
        post = _post_route if max(map(_ENTRIES, every)) <= MERGE_ENTRIES else None
    elif kinds == {_DeviceIdTransfer} and len(set(map(_WIDE, map(_SHAPE, every)))) == 1 \
            and every[0].route.ids.paired:
        post = post_together
    else:
        post = None
    parts = [idx] if poster.blocks else _parts(transfers, idx)      # (blocks slots hold no descriptor table)
    for part in parts:
        xs = every if part is idx else [transfers[i] for i in part]
        merged = post(poster, xs, s) if post is not None and (len(parts) == 1 or len(part) >= MERGE_FROM
                                                              or post is post_together) else None
        if merged is None:          # one request after another, in order
            for i, x in zip(part, xs):
                handles[i] = x._post_locked(s)
        elif part is idx and everything:
            handles[:] = merged
        else:
            for i, h in zip(part, merged):
                handles[i] = h


def _parts(transfers, idx: list[int]) -> list[list[int]]:
    """``idx`` cut into runs of at most :data:`BATCH_ROWS` descriptors (a run of one where a request alone has more)."""
    parts, cur, rows = [], [], 0
    for i in idx:
        n = transfers[i].descriptors
        if cur and rows + n > BATCH_ROWS:
            parts.append(cur)
            cur, rows = [], 0
        cur.append(i)
        rows += n
    if cur:
        parts.append(cur)
    return parts


def _post_route(poster, xs: list[_SlotTransfer], s: Stream) -> list[KVTransferHandle] | None:
    """One route's requests on ``s``, merged (one upload, one launch, one event); None, queueing nothing, where
    two of them write the same destination block (the caller posts them one by one)."""
    if len(xs) == 1:
        return [xs[0]._post_locked(s)]
    merged = _merge(poster, xs[0].route, xs)
    if merged is None:
        return None
    keep, array, rows = merged
    route, slot = xs[0].route, None
    try:
        slot, landed = run_in_slot(poster, route, s, array, keep.token[2], rows, int(array.shape[0]))
        values = None               # (no request notifies: no Python step per request)
        if not all(map(is_, map(_NOTIFY, xs), repeat(None))):
            values = [x.peer._notify(s, x.notify_slot)[0] if x.notify_slot is not None else None for x in xs]
            landed = None           # (the handles' events then cover the notifications)
        event = poster.agent.platform.record_event(s)
    except BaseException:
        poster.retire(route, slot)
        poster.hold_until_drained(s, (tuple(xs), keep, slot))
        raise
    slot.event, slot.stream = event, s
    poster.track(event, (tuple(xs), slot, keep) if landed is None else (tuple(xs), slot, keep, landed), s)
    return KVTransferHandle._together(xs, event, s, values, landed=landed)


def _merge(poster, route, xs: list[_SlotTransfer]):
    """``(keeper, merged array, descriptors)`` of ``xs`` (one route's staged requests), or None where two of them
    write the same destination block."""
    P, G = int(route.plane_group.size), len(route.groups)
    head = P + 1 + 3 * G
    # (requests, 3G): counts, starts (np.array of the rows: np.stack makes a Python call per request)
    hdr = np.array([x._array[P + 1:head] for x in xs])
    ends = np.concatenate([hdr[:, G + 1:], [[x._entries] for x in xs]], axis=1)
    if route.ids.paired:
        n_seg, parts, lens = _paired_parts(xs, hdr, ends, G)
    else:
        n_seg, parts, lens = _padded_parts(xs, hdr, ends, G, route.ids.splits)
    starts = list(itertools.accumulate(lens, initial=head))
    total = starts[-1]
    token, h = poster.requests.take(total, poster.reap)
    keep = _Pooled(poster.requests, token)
    np.concatenate(parts, out=h[head:total])
    dsts = [h[starts[G + g]:starts[G + g + 1]] for g in range(G)]      # (views: every request's, per group)
    if not route.ids.paired:            # without the padding's -1s
        dsts = [d[d >= 0] for d in dsts]
    if not route.ids.distinct(dsts):    # (each request's own were distinct at prepare: the batch's repeats)
        return None
    h[0] = 0
    h[P + 1:P + 1 + G] = n_seg
    h[P + 1 + G:head] = starts[:-1]
    h[P + 1:P + 1 + G][route.plane_group].cumsum(out=h[1:P + 1])
    return keep, h, int(h[P])


def _paired_parts(xs, hdr: np.ndarray, ends: np.ndarray, G: int):
    """Segments per group, the requests' ID runs in the merged order (per side and group, request by request)
    and the merged runs' lengths, for a route whose blocks pair one to one (no padding)."""
    st, ln = hdr[:, G:].tolist(), (ends - hdr[:, G:]).tolist()
    K = len(xs)
    arrays = [x._array for x in xs]
    parts = [arrays[k][st[k][j]:st[k][j] + ln[k][j]] for j in range(2 * G) for k in range(K)]
    # (np.add.reduce: ndarray.sum's Python wrapper costs a call)
    return _SUM(hdr[:, :G], axis=0), parts, _SUM(ends - hdr[:, G:], axis=0).tolist()


def _padded_parts(xs, hdr: np.ndarray, ends: np.ndarray, G: int, splits):
    """:func:`_paired_parts` where a group's blocks differ in size: each request's segments rounded up to whole
    larger blocks by ``-1`` IDs on the side of the smaller ones."""
    srcs: list[list[np.ndarray]] = [[] for _ in range(G)]
    dsts: list[list[np.ndarray]] = [[] for _ in range(G)]
    n_seg = [0] * G
    for x, row, end in zip(xs, hdr.tolist(), ends.tolist()):
        a = x._array
        for g in range(G):
            n = row[g]
            srcs[g].append(a[row[G + g]:end[g]])
            dsts[g].append(a[row[2 * G + g]:end[G + g]])
            rs, rd = splits[g]
            pad = -n % max(rs, rd)
            if pad:
                (srcs if rs == 1 else dsts)[g].append(np.full(pad, -1, dtype=np.int64))
            n_seg[g] += n + pad
    runs = srcs + dsts
    return n_seg, [p for ps in runs for p in ps], [sum(int(p.size) for p in ps) for ps in runs]
