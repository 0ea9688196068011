"""Routes: everything transfers between an agent and a peer in one direction over one layer range need,
built once per (peer, direction, layer range, groups) and cached (:class:`_Route`): the plane table (one row
per layer piece, largest segments first, in an order both sides derive alike), the segment classes and
copy launches, the destination overlap classes, and the ring of slots posts run in -- and an agent's cache of
them (:class:`RouteCache`)."""
from __future__ import annotations

import bisect
import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import BadInput, BlockIdError, GpuxferError, LayoutMismatch, NotRegistered
from .ids import _RouteIds, route_salts
from .layers import KVLayer, _torch

#: routes an agent keeps cached per peer (each holds its plane table and ring of slots on the device); past it,
#: caching one more drops the least recently used ones whose slots' last posts completed
ROUTES_PER_PEER = 256


@dataclass
class _Route:
    """Everything a transfer between the agent and a peer in one direction needs, built once."""

    op: str
    groups: list[str]                            # route-local group order
    ids: _RouteIds                               # how its requests' block IDs are checked and ordered
    planes: Any                                  # (P, PLANE_FIELDS) int64 on the device
    table: np.ndarray                            # the same on the host
    plane_group: np.ndarray                      # (P,) group of each plane
    classes: list[tuple[int, int, int]]          # (first plane, end plane, segment bytes), planes sorted by size
    src_anchor: Any                              # 1-element tensors at src_base / dst_base (kernels' anchors;
    dst_anchor: Any                              # None for a peer's memory not addressable here)
    src_base: int = 0                            # the addresses the table's offsets are from
    dst_base: int = 0
    launch_classes: list[tuple[int, int, int]] = field(default_factory=list)   # per copy launch: (first plane,
                                                 # end plane, segment bytes): neighbouring sizes tiled alike
    group_bytes: list[int] = field(default_factory=list)  # per group: bytes one segment of each plane moves
    slots: list = field(default_factory=list)    # the ring of device buffers posts run in (triton_transfer._Slot)
    device_ids: Any = None                       # what device-ID requests need (:class:`~gpuxfer.kv.device_ids._DeviceRoute`)
    pack_warm: set[tuple] = field(default_factory=set)   # (source?, fingerprint aligned?) whose kernels are loaded
    salts: tuple = (0, None)                     # a request fingerprint's salts (:func:`route_salts`)
    used: int = 0                                # when a request last found it in the cache (RouteCache.lookup)
    plane_rows: Any = None                       # np.arange(P + 1), read-only: plane p's first row in a one-group
                                                 # request of n segments is p * n (RequestStaging.stage)



def _pair_pieces(group: str, mine: KVLayer, theirs: KVLayer, bt_src: int, bt_dst: int, src_is_mine: bool
                 ) -> list[tuple[int, int, int]]:
    """Per piece: (source piece offset, destination piece offset, segment bytes)."""
    src, dst = (mine, theirs) if src_is_mine else (theirs, mine)
    if len(src.pieces) != len(dst.pieces):
        raise LayoutMismatch(f"group {group!r}, layer {mine.name!r}: {len(src.pieces)} pieces per block on the "
                             f"source, {len(dst.pieces)} on the destination")
    seg_tokens = min(bt_src, bt_dst)
    out = []
    for k, (ps, pd) in enumerate(zip(src.pieces, dst.pieces)):
        if bt_src == bt_dst:
            if ps.nbytes != pd.nbytes:
                raise LayoutMismatch(f"group {group!r}, layer {mine.name!r}, piece {k}: {ps.nbytes} bytes per "
                                     f"block on the source, {pd.nbytes} on the destination")
            out.append((ps.offset, pd.offset, ps.nbytes))
            continue
        if not (src.token_major and dst.token_major):
            raise LayoutMismatch(f"group {group!r}, layer {mine.name!r}: block sizes differ ({bt_src} and {bt_dst} "
                                 "tokens) but a side's pieces are not token-major")
        if ps.nbytes * bt_dst != pd.nbytes * bt_src:
            raise LayoutMismatch(f"group {group!r}, layer {mine.name!r}, piece {k}: {ps.nbytes} bytes per "
                                 f"{bt_src}-token block and {pd.nbytes} per {bt_dst}-token block are not the same "
                                 "bytes per token")
        small = ps.nbytes if bt_src == seg_tokens else pd.nbytes
        big, ratio = (ps.nbytes, bt_src // seg_tokens) if bt_src > seg_tokens else (pd.nbytes, bt_dst // seg_tokens)
        if big % ratio or big // ratio != small:
            raise LayoutMismatch(f"group {group!r}, layer {mine.name!r}, piece {k}: {big} bytes do not split "
                                 f"into {ratio} equal segments")
        out.append((ps.offset, pd.offset, small))
    return out


def _check_sources(group: str, peer: str, layers: tuple[int, int] | None, dst_layers, src_names: set) -> None:
    """A push over ``layers`` (a range) writes every layer of the peer's group in it: :class:`LayoutMismatch` naming
    the first such layer of ``dst_layers`` whose name is not in ``src_names`` (a pull's destination layers are this
    agent's, each paired with the peer's or refused, so a pull needs no such check)."""
    for lay in dst_layers:
        if lay.name not in src_names and (layers is None or layers[0] <= lay.index < layers[1]):
            raise LayoutMismatch(f"group {group!r}: layer {lay.name!r} (layer {lay.index}) of peer {peer!r} is in "
                                 f"layer range {layers}, but this agent has no layer of that name to push into it")


def _overlap_classes(spans: list[list[tuple[int, int]]]) -> list[list[int]]:
    """Groups (by index) whose memory spans intersect, merged transitively (union-find)."""
    parent = list(range(len(spans)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, j in itertools.combinations(range(len(spans)), 2):
        if any(a < d and c < b for a, b in spans[i] for c, d in spans[j]):
            parent[find(i)] = find(j)
    classes: dict[int, list[int]] = {}
    for i in range(len(spans)):
        classes.setdefault(find(i), []).append(i)
    return list(classes.values())


def _busy(platform, route: _Route) -> bool:
    """Whether a slot of ``route`` has a post that has not completed (one that ended in an error is over)."""
    for slot in list(route.slots):
        try:
            if slot.event is not None and not platform.event_query(slot.event):
                return True
        except GpuxferError:
            pass
    return False


def request_groups(registry, peer, name: str, local_blocks, remote_blocks) -> tuple[str, ...]:
    """The groups a request names (``local_blocks`` and ``remote_blocks``: the same ones, each registered on both
    the agent whose :class:`~gpuxfer.kv.peers.Registry` ``registry`` is and ``peer``), in the agent's order."""
    try:
        differ = set(local_blocks) != set(remote_blocks)
    except TypeError:               # (a mapping whose keys do not hash)
        raise BlockIdError(f"request {name!r}: local_blocks and remote_blocks must map group names to block IDs, "
                           f"got keys {list(local_blocks)!r:.200} and {list(remote_blocks)!r:.200}") from None
    if differ:
        raise BlockIdError(f"request {name!r}: local_blocks names groups {sorted(map(str, local_blocks))}, "
                           f"remote_blocks {sorted(map(str, remote_blocks))}; they must be the same")
    if not local_blocks:
        raise BlockIdError(f"request {name!r} names no group")
    groups = registry.groups
    for g in local_blocks:
        if g not in groups or g not in peer.groups:
            shared = [x for x in groups if x in peer.groups]
            raise NotRegistered(f"request {name!r}: group {g!r} is not registered on both agent "
                                f"{registry.name!r} and peer {peer.name!r} (shared: {', '.join(shared) or 'none'})")
    return tuple(g for g in groups if g in local_blocks)


class RouteCache:
    """An agent's routes (:attr:`routes`: ``{(peer, direction, layer range or None, frozenset of groups): route}``:
    a request naming its groups in any order finds their route) and how a route is built. ``agent``:
    its platform, device, timeout and uid are read from it; ``registry``: its
    :class:`~gpuxfer.kv.peers.Registry` (its groups, and its peers: a route is kept while its peer is one).

    Layer ranges are cached by the layers they select (:meth:`clamp`), and a peer keeps at most
    :data:`ROUTES_PER_PEER` routes: caching one more drops the least recently used ones whose slots are idle
    (their last posts completed). A dropped route's memory goes once nothing holds it: a posted transfer's
    buffers, its route and slot among them, are held by the :class:`~gpuxfer.kv.posting.Poster` until its event
    completes, and a prepared transfer holds its route."""

    def __init__(self, agent, registry):
        self.agent, self.registry = agent, registry
        self.routes: dict[tuple, _Route] = {}
        self.bounds: dict = {}     # per peer: (the registry's groups dict, sorted layer indices of both sides)
        # routes dropped from the cache (:meth:`_bound`, :meth:`forget`, :meth:`drop_all`) that something still
        # holds (a prepared transfer, or a posted one until it completed): their memory is still allocated
        # (:meth:`slot_bytes` counts it)
        self.dropped: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._uses = itertools.count(1)

    def clamp(self, peer, layers: tuple[int, int] | None) -> tuple[int, int] | None:
        """``layers`` (a checked ``(first, stop)`` range) as the one range of the layers it selects: from the
        first to one past the last layer index in it of the agent's groups and ``peer``'s. A route selects layers
        by their indices alone, so ranges holding the same indices are one cache key: a range wider than the
        model (``(0, 10**9)``, ``(0, 10**9 + 1)``...) or ending anywhere in a gap between two layer indices shares
        the route of the layers it holds and builds no route of its own. A range holding no such index is left as
        it is (a route over it selects no layer: BadInput)."""
        if layers is None:
            return None
        mine = self.registry.groups
        hit = self.bounds.get(peer)
        if hit is None or hit[0] is not mine:
            hit = (mine, sorted({lay.index for gs in (mine, peer.groups) for g in gs.values() for lay in g.layers}))
            with self.registry.lock:    # (kept while the peer is the agent's: :meth:`forget` drops them)
                if self.registry.peers.get(peer.name) is peer:
                    self.bounds[peer] = hit
        idx = hit[1]
        i, j = bisect.bisect_left(idx, layers[0]), bisect.bisect_left(idx, layers[1])
        return (idx[i], idx[j - 1] + 1) if i < j else layers

    def lookup(self, key: tuple) -> _Route | None:
        """The route cached under ``key``, marked used now; None if none."""
        r = self.routes.get(key)
        if r is not None:
            r.used = next(self._uses)
        return r

    def route(self, peer, op: str, layers: tuple[int, int] | None, groups: tuple[str, ...]) -> _Route:
        key = (peer, op, layers, frozenset(groups))
        r = self.lookup(key)
        if r is None:
            r = self.keep(key, self.build(peer, op, layers, groups))
        return r

    def keep(self, key: tuple, route: _Route) -> _Route:
        """Cache ``route`` under ``key`` (its peer first) while that peer is still the agent's (a peer removed
        while the route was built leaves nothing cached: the route counts as dropped while something holds it);
        then at most :data:`ROUTES_PER_PEER` routes of the peer stay (:meth:`_bound`). Returns the route to use:
        the one another thread cached under ``key`` while this one was built, else ``route``."""
        route.used = next(self._uses)
        with self.registry.lock:
            if self.registry.peers.get(key[0].name) is not key[0]:
                self.dropped[id(route)] = route
                return route
            have = self.routes.get(key)
            if have is not None:
                have.used = route.used
                return have
            self.routes[key] = route
            self._bound(key[0], route)
        return route

    def _bound(self, peer, keep: _Route) -> None:
        """Drop the least recently used routes of ``peer`` but ``keep`` while it has more than
        :data:`ROUTES_PER_PEER`, skipping those with a slot whose last post has not completed (the caller holds
        the registry's lock)."""
        mine = [(r.used, k, r) for k, r in self.routes.items() if k[0] is peer]     # (one key a route)
        over = len(mine) - ROUTES_PER_PEER
        if over <= 0:
            return
        plat = self.agent.platform
        for _, k, r in sorted(mine, key=lambda m: m[0]):
            if over <= 0:
                break
            if r is keep or _busy(plat, r):
                continue
            del self.routes[k]
            self.dropped[id(r)] = r
            over -= 1

    def forget(self, peer) -> None:
        """Drop the routes of ``peer`` (the caller holds the registry's lock)."""
        for k in [k for k in self.routes if k[0] is peer]:
            r = self.routes.pop(k)
            self.dropped[id(r)] = r
        self.bounds.pop(peer, None)

    def drop_all(self) -> None:
        """Drop every route: the cache starts again from a new dict (a reader holding the old one goes on over
        it); each dropped route counts in :meth:`slot_bytes` while something holds it. The caller holds the
        registry's lock (:meth:`slot_bytes` reads the dropped routes under it)."""
        old, self.routes = self.routes, {}
        for r in list(old.values()):
            self.dropped[id(r)] = r

    def slot_bytes(self) -> dict[str, int]:
        """The slots of the routes cached and of those dropped from the cache that something still holds: how
        many routes of each and slots, and the bytes of their descriptor and request buffers and of the device ID
        check's bitmaps."""
        with self.registry.lock:
            cached = {id(r): r for r in self.routes.values()}
            held = {i: r for i, r in list(self.dropped.items()) if i not in cached}
        routes = [*cached.values(), *held.values()]
        slots = [s for r in routes for s in list(r.slots)]
        return {"routes": len(cached), "held_routes": len(held), "slots": len(slots),
                "descriptors": sum(t.shape[0] * 24 for s in slots for t in (s.out, *s.spent) if t is not None),
                "requests": sum((s.entries + (s.host is not None)) * 8 for s in slots),   # (+ a folded slot's seq)
                "id_marks": sum(s.checked.marks.numel() * 4 for s in slots if s.checked is not None)}

    def build(self, peer, op: str, layers: tuple[int, int] | None, names: tuple[str, ...]) -> _Route:
        """The route of ``peer`` (a :class:`~gpuxfer.kv.peers.KVPeer`) in direction ``op`` over ``layers`` of
        groups ``names``; :class:`LayoutMismatch` where the two sides' layouts do not pair up."""
        torch = _torch()
        agent = self.agent
        from ..kernels.blocks import PLANE_FIELDS
        src_is_mine = op == "push"
        rows, plane_group, splits, limits, dst_spans, keys = [], [], [], [], [], []
        src_ptrs, dst_ptrs = [], []        # (absolute piece address of block 0, anchor maker)
        view, registered = peer.local_view or {}, self.registry.groups
        for gi, gname in enumerate(names):
            mine, theirs = view.get(gname) or registered.get(gname), peer.groups[gname]
            if mine is None:            # (the agent was closed since the request named it)
                raise NotRegistered(f"group {gname!r} is no longer registered on agent {self.registry.name!r}")
            bts, btd = (mine.block_tokens, theirs.block_tokens) if src_is_mine else \
                (theirs.block_tokens, mine.block_tokens)
            if max(bts, btd) % min(bts, btd):
                raise LayoutMismatch(f"group {gname!r}: block sizes {bts} (source) and {btd} (destination) tokens; "
                                     "one must divide the other")
            seg = min(bts, btd)
            splits.append((bts // seg, btd // seg))
            src_g, dst_g = (mine, theirs) if src_is_mine else (theirs, mine)
            limits.append((src_g.num_blocks, dst_g.num_blocks))
            theirs_by_name = {lay.name: (lay, ref) for lay, ref in zip(theirs.layers, theirs.flats)}
            selected = [(lay, fl) for lay, fl in zip(mine.layers, mine.flats)
                        if layers is None or layers[0] <= lay.index < layers[1]]
            if layers is None and len(theirs.layers) != len(mine.layers):
                raise LayoutMismatch(f"group {gname!r}: {len(mine.layers)} layers here, {len(theirs.layers)} on "
                                     f"peer {peer.name!r}")
            if src_is_mine:             # every destination layer in the range is written: none lacks its source
                _check_sources(gname, peer.name, layers, theirs.layers, {lay.name for lay, _ in selected})
            spans = []
            for lay, fl in selected:
                other = theirs_by_name.get(lay.name)
                if other is None:
                    raise LayoutMismatch(f"group {gname!r}: peer {peer.name!r} has no layer {lay.name!r}")
                olay, oref = other
                mine_anchor = (lambda f=fl: f)
                their_anchor = (lambda o=oref, p=olay.ptr: peer.anchor(o, p))
                s_lay, d_lay = (lay, olay) if src_is_mine else (olay, lay)
                s_anc, d_anc = (mine_anchor, their_anchor) if src_is_mine else (their_anchor, mine_anchor)
                src_ptrs.append((s_lay.ptr, s_anc))
                dst_ptrs.append((d_lay.ptr, d_anc))
                spans.append(d_lay.span)
                for k, (ps_off, pd_off, seg_bytes) in enumerate(_pair_pieces(gname, lay, olay, bts, btd,
                                                                              src_is_mine)):
                    keys.append((-seg_bytes, gname, lay.name, k))
                    rows.append([s_lay.ptr + ps_off, s_lay.block_stride, d_lay.ptr + pd_off, d_lay.block_stride,
                                 seg_bytes, gi, bts // seg, btd // seg, src_g.num_blocks, dst_g.num_blocks])
                    plane_group.append(gi)
            dst_spans.append(spans)
        if not rows:
            raise BadInput(f"layer range {layers} selects no layer of the groups shared with peer {peer.name!r}")
        src_base, src_anchor = min(src_ptrs, key=lambda x: x[0])
        dst_base, dst_anchor = min(dst_ptrs, key=lambda x: x[0])
        table = np.array(rows, dtype=np.int64)
        table[:, 0] -= src_base
        table[:, 2] -= dst_base
        # largest segments first, each size together; then by group, layer and piece names: an order
        # both sides derive alike (whatever order they registered in)
        order = np.array(sorted(range(len(keys)), key=keys.__getitem__), dtype=np.int64)
        table, pg = table[order], np.asarray(plane_group, dtype=np.int64)[order]
        cuts = np.flatnonzero(np.diff(table[:, 4])) + 1
        bounds = [0, *cuts.tolist(), len(table)]
        classes = [(a, b, int(table[a, 4])) for a, b in zip(bounds[:-1], bounds[1:])]
        from ..kernels import launch as kl
        merged: list[list] = []         # one copy launch per tiling: neighbouring sizes tiled alike share one
        for a, b, c in classes:
            key = (kl.choose_config(c), kl.choose_config(c, few_programs=True))
            if merged and merged[-1][3] == key:
                merged[-1][1] = b
            else:
                merged.append([a, b, c, key])
        dev = agent.platform.torch_device(agent.device)
        planes = torch.from_numpy(np.ascontiguousarray(table)).to(dev)
        if dev.type != "cpu":
            agent.platform.synchronize(agent.platform.current_stream(agent.device), agent.timeout_s)
        assert table.shape[1] == PLANE_FIELDS
        # copies run in the order of the peer's blocks: programs running together touch neighbouring peer
        # memory (the fastest order measured for the descriptor-copy kernel); the order of the copies is
        # free, no two destinations overlap. The pack engine's two sides must agree on it and touch only
        # their own memory: both take the destination's (whose order also finds repeated destinations).
        ids = _RouteIds(names, limits, splits, _overlap_classes(dst_spans),
                        sort_by_dst=op == "push" or peer.engine == "pack")
        plane_rows = np.arange(pg.size + 1, dtype=np.int64)
        plane_rows.flags.writeable = False
        return _Route(op=op, groups=names, ids=ids, planes=planes, table=table, plane_group=pg, classes=classes,
                      plane_rows=plane_rows,
                      src_anchor=src_anchor(), dst_anchor=dst_anchor(), src_base=int(src_base), dst_base=int(dst_base),
                      launch_classes=[(a, b, c) for a, b, c, _ in merged],
                      group_bytes=[int(table[pg == gi, 4].sum()) for gi in range(len(names))],
                      salts=route_salts(names, sorted(keys), splits, limits,
                                        (agent.uid, peer.meta.uid) if src_is_mine else (peer.meta.uid, agent.uid)))
