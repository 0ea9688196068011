"""A peer on the NIXL route (:class:`NixlPeer`, :mod:`gpuxfer.kv.nixl_route`): its groups as its metadata states
them, both sides' prepped descriptor lists (:class:`_Lists`), a request's IDs turned into the lists' indices,
and the route's transfers (:class:`_NixlTransfer`: one prepped NIXL transfer per post) and handles
(:class:`_NixlHandle`). Importing this module never imports NIXL."""
from __future__ import annotations

import logging
import time
from typing import Mapping

import numpy as np

from .. import config
from ..errors import BadInput, BadMetadata, GpuxferError, LayoutMismatch, NotRegistered, TransferTimeout
from ..platforms.base import Stream
from .control import NOTIFY_SLOTS
from .ids import IDS_PER_PEER, _IdsCache, _RouteIds
from .layers import KVLayer
from .nixl_ffi import NixlError, RemoteHeld
from .nixl_route import NOTIF_PREFIX, NixlSide
from .posting import INFLIGHT_KEEP
from .peers import KVPeer, _Group
from .routes import _check_sources, _overlap_classes, _pair_pieces, request_groups
from .transfer import KVTransfer

log = logging.getLogger("gpuxfer.kv.agent")

#: descriptors a prepped list holds at most (NIXL indexes them with int32)
MAX_DESCRIPTORS = 1 << 31
#: a peer's lists may hold this many times the descriptors of this agent's own blocks x pieces (a peer with up to
#: this many times its blocks, or a block size down to this fraction of its own); past that,
#: ``GPUXFER_KV_NIXL_MAX_DESCRIPTORS`` bounds them, whatever the peer's metadata states
PEER_SCALE = 4


class _Lists:
    """Both sides' prepped descriptor lists over a set of groups: per group its planes (layer pieces) with
    where each plane's descriptors start in the local and the remote list."""

    def __init__(self, groups: tuple[str, ...]):
        self.groups = groups
        self.local_h = self.remote_h = None
        self.planes: dict[str, list[tuple]] = {}      # group -> (layer index, local start, remote start, segment bytes)
        self.ratios: dict[str, tuple[int, int]] = {}                  # group -> (local, remote) segments per block
        self.errors: dict[str, Exception] = {}                         # group -> why it cannot pair
        self.full: dict[str, bool] = {}                                 # group -> both sides have the same layers
        self.unpaired: dict[str, list] = {}             # group -> the peer's layers no layer here pairs with
        self.renumbered: dict[str, list] = {}         # group -> the peer's layers whose namesake here has another index
        # group -> (layer index, why) per layer of this agent's that does not pair with the peer's of its name (none,
        # or other pieces): a request over a range holding it raises LayoutMismatch(why), others move those that pair
        self.unpairable: dict[str, list[tuple[int, str]]] = {}
        # group -> per plane (local address of block 0, local block stride, remote address, remote stride) where the
        # plane's one segment per block is the whole block on both sides (consecutive blocks adjoin), else None
        self.spans: dict[str, list[tuple[int, int, int, int] | None]] = {}


class NixlPeer(KVPeer):
    """A peer reached through NIXL: its groups as its metadata states them (addresses in its process), its NIXL
    agent added to ours, both sides' descriptor lists prepped once per set of shared groups."""

    route = "nixl"
    engine = "nixl"                     # its transfers are NIXL's (READ / WRITE), whatever the agent's engine

    def __init__(self, agent, meta, side: NixlSide, registry, poster, local_view: dict | None = None):
        """``agent``: the :class:`~gpuxfer.kv.agent.KVAgent` adding it, with its :class:`~gpuxfer.kv.peers.Registry`
        and :class:`~gpuxfer.kv.posting.Poster`; ``meta``: the peer's decoded metadata; ``local_view``: ``{group:
        this agent's group seen through some of its pieces}`` (``add_peer(local_pieces=...)``), the groups whose
        local side this peer's descriptors cover only those pieces of."""
        side.check_peer(meta)
        self.agent, self.meta, self.name, self.side = agent, meta, meta.agent, side
        self.local_view = local_view or {}
        self.registry, self.poster, self._closed = registry, poster, False
        self._mappings, self._owned = [], []     # (KVPeer's: none on this route)
        self.flags = self.staging_ptr = self._local = None
        self._seq, self._notified = [0] * NOTIFY_SLOTS, [None] * NOTIFY_SLOTS
        self.pack_sent = self.pack_recv = 0
        self._lists: _Lists | None = None
        self._ids = _IdsCache(IDS_PER_PEER)      # (op, groups) -> _RouteIds
        self._inflight: list["_NixlHandle"] = []
        nx, self.remote = meta.nixl, None
        self.groups: dict[str, _Group] = {}
        for g in meta.groups:
            layers = [KVLayer(lay.name, lay.index, nx["bases"][a] + off, lay.num_blocks, lay.block_stride,
                              lay.pieces, lay.extent, lay.token_major) for lay, a, off in g.layers]
            self.groups[g.name] = _Group(g.name, g.block_tokens, layers, [(a, off) for _, a, off in g.layers])
        try:            # what NIXL was given is taken back if a later step fails
            try:
                with side.lock:
                    self.remote = side.nixl.add_remote(nx["md"], nx["agent"])
            except RemoteHeld as exc:
                raise BadMetadata(f"peer {meta.agent!r}: its NIXL agent {exc.name!r} is one agent {agent.name!r} "
                                  "reaches already (as another peer)") from None
            if self.remote != nx["agent"]:
                raise BadMetadata(f"peer {meta.agent!r}: its NIXL metadata names agent {self.remote!r}, its "
                                  f"metadata {nx['agent']!r}")
            with side.lock:
                side.senders.add(self.remote)   # its notifications count from here until _release
            try:
                with side.lock:
                    side.nixl.connect(self.remote)
            except Exception as exc:  # noqa: BLE001 - optional: the first transfer connects otherwise
                log.info("agent %s: NIXL make_connection to %s failed (%s); connecting on first use", agent.name,
                         self.name, exc)
            self.lists()
        except BaseException:
            self.close()
            raise

    # -- descriptor lists

    def _mine(self, group: str) -> _Group:
        """This agent's ``group`` as transfers with this peer see it."""
        return self.local_view.get(group) or self.registry.groups[group]

    def lists(self, want: tuple[str, ...] = ()) -> _Lists:
        """The prepped lists over every group both sides hold (rebuilt when a request names a group registered
        after they were made)."""
        have = self._lists
        if have is not None and all(g in have.groups for g in want):
            return have
        groups = tuple(g for g in self.registry.groups if g in self.groups)
        self.side.register()            # allocations of groups registered since
        built = self._build(groups)
        with self.poster.lock:          # a post checks its lists and hands them to NIXL under it; _release takes them
            gone = self._closed
            have, self._lists = (None, self._lists) if gone else (self._lists, built)
        if gone:                        # (released: these are no peer's to release)
            self._drop_lists(built)
            raise NotRegistered(f"peer {self.name!r} was removed from agent {self.agent.name!r}")
        if have is not None:            # transfers made from the old lists complete first (bounded)
            deadline = time.monotonic() + self.agent.timeout_s
            for h in self._inflight:
                try:
                    h._settle(max(0.0, deadline - time.monotonic()))
                except (NixlError, NotRegistered):
                    pass                # over: its failure is its own handle's to raise
            with self.poster.lock:      # (a post appends to the list under it)
                self._reap()
            self._drop_lists(have)
        return built

    def _build(self, groups: tuple[str, ...]) -> _Lists:
        """Both sides' lists over ``groups``: their planes paired and counted first, refused past
        :meth:`_limit` before any row is built."""
        out = _Lists(groups)
        # per group that pairs: its (local, remote) segments per block and its planes (layer, peer's layer, pair)
        todo: list[tuple[str, tuple[int, int], list[tuple]]] = []
        n_local = n_remote = 0
        for gname in groups:
            mine, theirs = self._mine(gname), self.groups[gname]
            bm, bt = mine.block_tokens, theirs.block_tokens
            if max(bm, bt) % min(bm, bt):
                out.errors[gname] = LayoutMismatch(f"group {gname!r}: block sizes {bm} (here) and {bt} (peer "
                                                   f"{self.name!r}) tokens; one must divide the other")
                continue
            seg = min(bm, bt)
            rm, rt = bm // seg, bt // seg
            whole_blocks = rm == rt == 1            # one segment per block on both sides
            by_name = {lay.name: lay for lay in theirs.layers}
            planes, unpairable = [], []
            for lay in mine.layers:         # (a layer that does not pair fails only the requests over it)
                other = by_name.get(lay.name)
                if other is None:
                    unpairable.append((lay.index, f"group {gname!r}: peer {self.name!r} has no layer {lay.name!r}"))
                    continue
                try:
                    pairs = _pair_pieces(gname, lay, other, bm, bt, True)
                except LayoutMismatch as exc:       # (its message: the error would keep this frame's rows)
                    unpairable.append((lay.index, str(exc)))
                    continue
                planes += [(lay, other, p) for p in (_coalesce(pairs) if whole_blocks else pairs)]
            out.unpairable[gname] = unpairable
            todo.append((gname, (rm, rt), planes))
            n_local += len(planes) * mine.num_blocks * rm
            n_remote += len(planes) * theirs.num_blocks * rt
        _check_count(self.name, n_local, n_remote, self._limit(groups))
        local_rows: list[tuple[np.ndarray, int]] = []
        remote_rows: list[tuple[np.ndarray, int]] = []
        n_local = n_remote = 0
        for gname, (rm, rt), planes in todo:
            mine, theirs = self._mine(gname), self.groups[gname]
            out.planes[gname], out.spans[gname] = [], []
            for lay, other, (my_off, their_off, seg_bytes) in planes:
                out.planes[gname].append((lay.index, n_local, n_remote, seg_bytes))
                adjoin = rm == rt == 1 and seg_bytes == lay.block_stride == other.block_stride
                out.spans[gname].append((lay.ptr + my_off, lay.block_stride, other.ptr + their_off,
                                         other.block_stride) if adjoin else None)
                local_rows.append((_segments(lay.ptr + my_off, mine.num_blocks, lay.block_stride, rm, seg_bytes),
                                   seg_bytes))
                remote_rows.append((_segments(other.ptr + their_off, theirs.num_blocks, other.block_stride, rt,
                                              seg_bytes), seg_bytes))
                n_local += mine.num_blocks * rm
                n_remote += theirs.num_blocks * rt
            out.ratios[gname] = (rm, rt)
            out.full[gname] = len(mine.layers) == len(theirs.layers)
            index = {lay.name: lay.index for lay in mine.layers}
            out.unpaired[gname] = [lay for lay in theirs.layers if lay.name not in index]
            out.renumbered[gname] = [lay for lay in theirs.layers if index.get(lay.name, lay.index) != lay.index]
        if any(out.planes.values()):
            local = _dlist(local_rows, self.side.device)
            remote = _dlist(remote_rows, self.meta.nixl["device"])
            with self.side.lock:
                out.local_h = self.side.nixl.prep(None, local)
                try:
                    out.remote_h = self.side.nixl.prep(self.remote, remote)
                except BaseException:
                    self.side.nixl.release_quietly((), [out.local_h])
                    raise
        return out

    def _limit(self, groups: tuple[str, ...]) -> int:
        """The most descriptors either list over ``groups`` may hold: :data:`PEER_SCALE` times this agent's own
        blocks x pieces of them, or ``GPUXFER_KV_NIXL_MAX_DESCRIPTORS`` if more; below NIXL's int32 indices."""
        own = sum(lay.num_blocks * len(lay.pieces) for g in groups for lay in self._mine(g).layers)
        return min(max(PEER_SCALE * own, config.get("GPUXFER_KV_NIXL_MAX_DESCRIPTORS")), MAX_DESCRIPTORS - 1)

    def _drop_lists(self, lists: _Lists) -> None:
        handles = [h for h in (lists.local_h, lists.remote_h) if h is not None]
        with self.side.lock:
            errors = self.side.nixl.release_quietly((), handles)
        if errors:
            log.warning("peer %s: releasing prepped NIXL lists: %s", self.name, "; ".join(errors))

    def _route_ids(self, op: str, groups: tuple[str, ...]) -> _RouteIds:
        def build() -> _RouteIds:
            push = op == "push"
            limits, splits, spans = [], [], []
            for g in groups:
                mine, theirs = self._mine(g), self.groups[g]
                src, dst = (mine, theirs) if push else (theirs, mine)
                seg = min(src.block_tokens, dst.block_tokens)
                limits.append((src.num_blocks, dst.num_blocks))
                splits.append((src.block_tokens // seg, dst.block_tokens // seg))
                spans.append([lay.span for lay in dst.layers])
            return _RouteIds(groups, limits, splits, _overlap_classes(spans), True)
        return self._ids.get((op, groups), build)

    # -- requests

    def prepare(self, op: str, layers: tuple[int, int] | None, name: str, local_blocks: Mapping,
                remote_blocks: Mapping, notify_slot: int | None) -> "_NixlTransfer":
        """A request's IDs checked (as on the IPC route) and turned into both lists' indices."""
        groups = request_groups(self.registry, self, name, local_blocks, remote_blocks)
        lists = self.lists(groups)
        for g in groups:
            if g in lists.errors:       # (a new error each time: one raised again would keep every frame it passed)
                raise LayoutMismatch(str(lists.errors[g]))
            if layers is None and not lists.full[g]:
                raise LayoutMismatch(f"group {g!r}: {len(self._mine(g).layers)} layers here, "
                                     f"{len(self.groups[g].layers)} on peer {self.name!r}")
        push = op == "push"
        if push:        # every destination layer in the range is written: none lacks its source in the range
            for g in groups:
                if lists.unpaired[g] or (layers is not None and lists.renumbered[g]):
                    names = {lay.name for lay in self._mine(g).layers if layers is None or
                             layers[0] <= lay.index < layers[1]}
                    _check_sources(g, self.name, layers, lists.unpaired[g] + lists.renumbered[g], names)
        for g in groups:    # each layer of this agent's in the range pairs with the peer's of its name
            for index, why in lists.unpairable[g]:
                if layers is None or layers[0] <= index < layers[1]:
                    raise LayoutMismatch(why)
        n_seg, lens_s, lens_d, (S, D, *_rest) = self._route_ids(op, groups).check(name, push, local_blocks,
                                                                                   remote_blocks)
        loc, rem, nbytes, parts, writes = [], [], 0, [], {}
        a = b = 0
        for g, n, ls, ld in zip(groups, n_seg, lens_s, lens_d):
            src, dst = S[a:a + ls], D[b:b + ld]
            a, b = a + ls, b + ld
            writes[g] = dst.copy()          # (the checker reuses its arrays)
            mine, theirs = (src, dst) if push else (dst, src)
            rm, rt = lists.ratios[g]
            my_seg, their_seg = _segment_index(mine, rm, n), _segment_index(theirs, rt, n)
            sel = [i for i, p in enumerate(lists.planes[g]) if layers is None or layers[0] <= p[0] < layers[1]]
            if not sel or not n:
                continue
            planes = [lists.planes[g][i] for i in sel]
            starts = np.array([(p[1], p[2]) for p in planes], dtype=np.int64)
            loc.append((starts[:, :1] + my_seg).ravel())
            rem.append((starts[:, 1:] + their_seg).ravel())
            nbytes += n * sum(p[3] for p in planes)
            parts.append((my_seg, their_seg, [lists.spans[g][i] for i in sel]))
        if not loc and layers is not None and not any(
                layers[0] <= p[0] < layers[1] for g in groups for p in lists.planes[g]):
            raise BadInput(f"layer range {layers} selects no layer of the groups shared with peer {self.name!r}")
        local_idx = np.concatenate(loc).astype(np.int32) if loc else np.empty(0, np.int32)
        remote_idx = np.concatenate(rem).astype(np.int32) if rem else np.empty(0, np.int32)
        rows = _runs(parts, local_idx.size, self.side.device, self.meta.nixl["device"])
        return _NixlTransfer(self.poster, self, lists, op, name, local_idx, remote_idx, notify_slot, nbytes, rows,
                             (self.meta.uid if push else None, layers, writes))

    # -- lifetime

    def _reap(self, keep: int | None = None) -> None:
        """Forget completed transfers (NIXL's handles released when seen done); past ``keep`` of them, NIXL is asked
        about the oldest first, as far as they completed: handles nobody waits on stay bounded."""
        for h in self._inflight if keep is not None and len(self._inflight) >= keep else ():
            try:
                if not h._poll():
                    break
            except GpuxferError:        # over: its wait raises it
                pass
        self._inflight = [h for h in self._inflight if not h._finished]

    def _release(self) -> None:
        side, errors = self.side, []
        with side.lock:                 # its notifications count no more (a peer's name is held by one at most)
            side.senders.discard(self.remote)
        deadline = time.monotonic() + self.agent.timeout_s
        for h in list(self._inflight):
            try:
                h._settle(max(0.0, deadline - time.monotonic()))
            except Exception as exc:  # noqa: BLE001 - closing: what failed is logged, the rest released
                log.warning("peer %s: %s", self.name, exc)
        with side.lock:
            for h in self._inflight:    # unfinished: its handle never asks NIXL about it again
                if h._finished:
                    continue
                why = side.nixl.release_quietly([h._xfer]) if h._xfer is not None else []
                errors += why
                h._cut = (f"peer {self.name!r} was removed before it completed (NIXL "
                          + ("refused to release its transfer)" if why else "released its transfer)"))
        self._inflight = []
        with self.poster.lock:          # (a rebuild swaps them under it: each list is released once)
            lists, self._lists = self._lists, None
        if lists is not None and not side.nixl.closed:     # (a closed NIXL agent released them)
            self._drop_lists(lists)
        if self.remote is not None and not side.nixl.closed:
            with side.lock:
                try:
                    side.nixl.remove_remote(self.remote)
                except GpuxferError as exc:  # the side's close retries
                    errors.append(str(exc))
        if errors:
            log.warning("peer %s: releasing NIXL state: %s", self.name, "; ".join(errors))

    def __repr__(self) -> str:
        return f"NixlPeer({self.name!r}, NIXL agent {self.remote!r}, {len(self.meta.groups)} groups)"


def _check_count(peer: str, local: int, remote: int, limit: int) -> None:
    """Refuse lists of ``local`` and ``remote`` descriptors past ``limit`` (:meth:`NixlPeer._limit`), before they
    are built: the peer's count is its metadata's claim (:class:`BadMetadata`), this side's :class:`BadInput`."""
    why = (f"this agent's lists hold at most {limit:,} ({PEER_SCALE} times its own caches' blocks x pieces, or "
           "GPUXFER_KV_NIXL_MAX_DESCRIPTORS if more; below NIXL's int32 indices)")
    if remote > limit:
        raise BadMetadata(f"peer {peer!r}: its caches as its metadata states them make {remote:,} NIXL descriptors; "
                          + why)
    if local > limit:
        raise BadInput(f"peer {peer!r}: pairing this agent's caches with the peer's block size makes {local:,} NIXL "
                       f"descriptors here; {why}")


def _coalesce(pairs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Whole-block pieces ``(my offset, their offset, bytes)`` with each one that starts, on both sides, where the one
    before it ends folded into it: one NIXL descriptor per block for a layer whose heads lie in a row on both sides
    (NIXL's cost is per descriptor)."""
    out: list[tuple[int, int, int]] = []
    for m, t, n in pairs:
        if out and out[-1][0] + out[-1][2] == m and out[-1][1] + out[-1][2] == t:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((m, t, n))
    return out


def _segments(base: int, blocks: int, stride: int, ratio: int, seg_bytes: int) -> np.ndarray:
    """Addresses of a plane's segments: block-major, ``ratio`` segments per block."""
    return (base + np.arange(blocks, dtype=np.uint64)[:, None] * np.uint64(stride)
            + np.arange(ratio, dtype=np.uint64)[None, :] * np.uint64(seg_bytes)).ravel()


def _dlist(rows: list[tuple[np.ndarray, int]], device: int) -> np.ndarray:
    """NIXL's ``(N, 3)`` uint64 rows ``(address, length, device)`` of planes' segment addresses."""
    out = np.empty((sum(a.size for a, _ in rows), 3), dtype=np.uint64)
    at = 0
    for addrs, seg in rows:
        out[at:at + addrs.size, 0], out[at:at + addrs.size, 1] = addrs, seg
        at += addrs.size
    out[:, 2] = device
    return out


def _runs(parts: list, descriptors: int, local_dev: int, remote_dev: int) -> tuple[np.ndarray, np.ndarray] | None:
    """A request's blocks as runs: where every plane of it is whole blocks on both sides (:attr:`_Lists.spans`),
    its block pairs taken in the order of the local IDs (a request's pairs are a set: no destination twice), each
    run of pairs consecutive on both sides is one descriptor per plane -- NIXL rows ``(address, bytes, device)`` of
    both sides --, if that at least halves the prepped lists' ``descriptors``; else None. ``parts``: per group
    ``(local block IDs, remote block IDs, spans of its planes)``."""
    if not parts or any(sp is None for _, _, spans in parts for sp in spans):
        return None
    cuts, total = [], 0
    for mine, theirs, spans in parts:
        if mine.size > 1 and not (mine[1:] > mine[:-1]).all():
            order = np.argsort(mine, kind="stable")
            mine, theirs = mine[order], theirs[order]
        first = np.flatnonzero(np.concatenate(([True], (np.diff(mine) != 1) | (np.diff(theirs) != 1))))
        cuts.append((mine[first], theirs[first], np.diff(np.append(first, mine.size)), spans))
        total += first.size * len(spans)
    if 2 * total > descriptors:
        return None
    loc, rem = np.empty((total, 3), np.uint64), np.empty((total, 3), np.uint64)
    at = 0
    for m0, t0, count, spans in cuts:
        sp = np.array(spans, dtype=np.uint64)                 # (planes, 4): local base, stride, remote base, stride
        k = sp.shape[0] * m0.size
        for rows, base, stride, start in ((loc, sp[:, 0:1], sp[:, 1:2], m0), (rem, sp[:, 2:3], sp[:, 3:4], t0)):
            rows[at:at + k, 0] = (base + start.astype(np.uint64)[None, :] * stride).ravel()
            rows[at:at + k, 1] = (count.astype(np.uint64)[None, :] * stride).ravel()
        at += k
    loc[:, 2], rem[:, 2] = local_dev, remote_dev
    return loc, rem


def _segment_index(blocks: np.ndarray, ratio: int, n: int) -> np.ndarray:
    """Per segment of a request (``n`` of them): its index in a plane's list of this side (``ratio`` segments
    per block of ``blocks``)."""
    if ratio == 1:
        return blocks[:n]
    seg = np.arange(n, dtype=np.int64)
    return blocks[seg // ratio] * ratio + seg % ratio


# ----------------------------------------------------------------------------- transfers and handles


class _NixlTransfer(KVTransfer):
    """A prepared request on the NIXL route: both lists' indices, or (:func:`_runs`) its runs of consecutive blocks
    as descriptors of their own; each post is one NIXL transfer, prepped or made from the runs."""

    def __init__(self, poster, peer: NixlPeer, lists: _Lists, op: str, name: str, local_idx: np.ndarray,
                 remote_idx: np.ndarray, notify_slot: int | None, nbytes: int,
                 rows: tuple[np.ndarray, np.ndarray] | None = None, writes: tuple = (None, None, {})):  # noqa: D107
        self.poster, self.agent = poster, poster.agent
        self.peer, self.lists, self.op, self.name, self.route = peer, lists, op, name, None
        self.local_idx, self.remote_idx = local_idx, remote_idx
        self.rows = rows                # runs of blocks as descriptors of their own (:func:`_runs`), or None
        self.notify_slot = notify_slot
        self.descriptors = int(local_idx.size if rows is None else len(rows[0]))
        self.nbytes, self.n_seg = int(nbytes), None
        self.writes = writes    # (side: the peer's uid or None, layers, {group: destination IDs}): batch._overwrites

    def describe(self) -> str:
        return (f"NIXL {'READ' if self.op == 'pull' else 'WRITE'} of request {self.name!r} with peer "
                f"{self.peer.name!r} ({self.descriptors:,} descriptors, {self.nbytes:,} bytes)")

    def post(self, stream: Stream | None = None) -> "_NixlHandle":
        """Start the transfer once the work already on ``stream`` (default: the agent's) completed -- NIXL's
        transfers are not stream-ordered, so the host waits for it, at most the agent's timeout."""
        agent, poster, peer = self.agent, self.poster, self.peer
        poster.check_usable(peer)
        s = poster.stream(stream)
        plat = agent.platform
        ev = plat.record_event(s)
        if not plat.event_query(ev) and not plat.event_wait(ev, agent.timeout_s):
            raise TransferTimeout(rank=agent.rank, step=0, flag=f"request {self.name!r}", expected=1, seen=0,
                                  timeout_s=agent.timeout_s, what="the work on the posting stream did not complete")
        with poster.lock:                   # remove_peer and close exclude it: the peer's lists stay while it posts
            poster.check_usable(peer)
            if peer._lists is not self.lists:
                raise BadInput(f"request {self.name!r} was prepared before peer {peer.name!r}'s descriptor lists "
                               "were rebuilt (a group registered since): prepare it again")
            return self._post_locked()

    def _post_locked(self) -> "_NixlHandle":
        peer = self.peer
        side, slot = peer.side, self.notify_slot
        op = "READ" if self.op == "pull" else "WRITE"
        with side.lock:                     # the notification's value is taken and spent under the lock
            value = None if slot is None else peer._seq[slot] + 1
            notif = b"" if slot is None else NOTIF_PREFIX + f"{slot}:{value}".encode()
            xfer = state = None
            if not self.descriptors:        # nothing to move: only the notification
                if notif:
                    side.nixl.notify(peer.remote, notif)
            else:
                if self.rows is not None:
                    xfer = side.nixl.oneshot(op, self.rows[0], self.rows[1], peer.remote, notif)
                else:
                    xfer = side.nixl.make_prepped(op, self.lists.local_h, self.local_idx, self.lists.remote_h,
                                                  self.remote_idx, notif)
                try:
                    state = side.nixl.post(xfer, self.describe())
                except BaseException:
                    side.nixl.release_quietly([xfer])
                    raise
            if slot is not None:
                peer._seq[slot] = value
        if xfer is None:
            return _NixlHandle(self, None, "DONE", value)
        h = _NixlHandle(self, xfer, state, value)
        peer._reap(INFLIGHT_KEEP)
        peer._inflight.append(h)
        return h

    def expanded_descriptors(self) -> np.ndarray:
        raise BadInput("the NIXL route expands no descriptor table: its requests are index arrays into NIXL's "
                       "prepped lists")


class _NixlHandle:
    """A posted NIXL transfer: ``done()``, ``wait(timeout_s)``, ``stream_wait(stream)`` (the host waits, then
    the stream's later work runs after it); ``event`` is None (NIXL's transfers have no stream event)."""

    event = None

    def __init__(self, transfer: _NixlTransfer, xfer, state: str, notify_value: int | None):
        self.transfer, self.name, self.notify_value = transfer, transfer.name, notify_value
        self._xfer = xfer
        self._finished = xfer is None
        self._cut: str | None = None        # why its transfer was released before it completed
        self._failed = False                # NIXL reported ERR: it fails once NIXL released it
        self._state = state
        if xfer is not None:
            self._check(state)

    def _check(self, state: str) -> bool:
        """Whether ``state`` is DONE (the NIXL handle then released); ERR: :meth:`_fail`."""
        if state == "DONE":
            self._finish()
            return True
        if state == "ERR":
            return self._fail()
        return False

    def _fail(self) -> bool:
        """A transfer NIXL reported ERR: released through NIXL, then :class:`~gpuxfer.kv.nixl_ffi.NixlError` naming
        the request (from every later poll too); False while NIXL refuses to release it (the transfer may still
        run: the handle stays pending, and bounded waits time out)."""
        side = self.transfer.peer.side
        with side.lock:
            self._failed = True
            if self._cut is not None:
                raise NotRegistered(f"request {self.name!r}: {self._cut}")
            errors = [] if self._finished else side.nixl.release_quietly([self._xfer])
            if not errors:
                self._finished, self._xfer = True, None
        if errors:
            log.debug("request %s: NIXL does not release its failed transfer yet: %s", self.name, "; ".join(errors))
            return False
        raise NixlError("check_xfer_state", self.transfer.describe(), "the transfer ended in ERR (the peer died "
                        "or refused it); NIXL released it, but cannot tell when the operations it had started stop: "
                        "they may still read or write its blocks")

    def _finish(self) -> None:
        side = self.transfer.peer.side
        with side.lock:                 # once: another thread polling the handle sees it finished
            if self._finished or self._cut is not None:
                return
            errors = side.nixl.release_quietly([self._xfer])
            self._finished = True
            self._xfer = None if not errors else self._xfer
        if errors:
            log.warning("request %s: releasing its NIXL transfer: %s", self.name, "; ".join(errors))

    def _poll(self) -> bool:
        side = self.transfer.peer.side
        with side.lock:                 # (a release by another thread is seen here, before NIXL is asked)
            if self._finished and not self._failed:
                return True
            if self._cut is not None:
                raise NotRegistered(f"request {self.name!r}: {self._cut}")
            if not self._failed:
                if side.nixl.closed:
                    raise BadInput(f"agent {self.transfer.agent.name!r} is closed")
                self._state = side.nixl.state(self._xfer)
        return self._check(self._state)

    def done(self) -> bool:
        return self._poll()

    def _settle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        delay = 1e-5
        while not self._poll():
            if time.monotonic() > deadline:
                raise TransferTimeout(rank=self.transfer.agent.rank, step=0, flag=f"request {self.name!r}",
                                      expected=1, seen=0, timeout_s=timeout_s,
                                      what=f"{self.transfer.describe()} did not complete (NIXL: {self._state})")
            time.sleep(delay)
            delay = min(2 * delay, 1e-3)

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until the transfer completed; :class:`TransferTimeout` naming the request past ``timeout_s``
        (default: the agent's; a finite number of seconds > 0, at most :data:`~gpuxfer.sync.MAX_TIMEOUT_S`, else
        :class:`~gpuxfer.errors.BadInput`), :class:`~gpuxfer.kv.nixl_ffi.NixlError` when NIXL reports it failed."""
        from ..sync import check_timeout
        agent = self.transfer.agent
        agent.check()
        self._settle(agent.timeout_s if timeout_s is None else
                     check_timeout(timeout_s, f"KV transfer {self.name!r}: timeout_s"))

    def stream_wait(self, stream: Stream) -> None:
        """Make ``stream``'s later work run after this transfer (the host waits for it, bounded)."""
        self.wait()

    def __repr__(self) -> str:
        return f"_NixlHandle({self.name!r}, {self._state})"


