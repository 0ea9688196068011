"""A request's block IDs on the host: taken as contiguous int64 arrays, range-checked, checked for
duplicate destinations and ordered, in O(IDs) and a fixed number of NumPy calls over all groups at
once (:class:`_RouteIds`, one per route), with per-thread scratch arrays; :class:`_IdsCache` keeps a bounded
number of them where nothing else bounds how many there are."""
from __future__ import annotations

import collections
import functools
import hashlib
import itertools
import threading

import numpy as np

try:        # np.count_nonzero's C function, without the two Python calls of its dispatch a use
    from numpy._core.multiarray import count_nonzero
except ImportError:         # (NumPy 1)
    from numpy.core.multiarray import count_nonzero

from ..errors import BlockIdError
from .layers import _MAX_INT, _torch

#: the C function behind ``ndarray.max`` (the largest of IDs read unsigned), without the Python call of the method's
#: wrapper (``numpy._core._methods._amax``)
_UMAX = np.maximum.reduce
_U64 = np.dtype(np.uint64)


#: int64's dtype: a native int64 array's dtype is this object (one that is not, metadata or byte order aside, takes
#: the conversion path)
_INT64 = np.dtype(np.int64)


@functools.cache
def _int_dtypes(torch) -> frozenset:
    """The torch dtypes of block IDs: plain integers (not bool, quantized or sub-byte ones, which numpy has not)."""
    return frozenset((torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32,
                      torch.uint64))


def _as_ids(ids, request: str, group: str, side: str) -> np.ndarray:
    """Block IDs as a contiguous 1-D int64 array of their own (``request``, ``group`` and ``side`` name them in
    errors): never the caller's memory, which another thread may change between the checks and the copy into a
    request (an ID checked in range, then written out of it)."""
    if type(ids) is np.ndarray and ids.dtype is _INT64 and ids.ndim == 1 and ids.flags.c_contiguous:
        return ids.copy()
    what = f"request {request!r}, group {group!r}, {side}"
    torch = _torch()
    if isinstance(ids, torch.Tensor):
        if ids.device.type != "cpu":
            raise BlockIdError(f"{what}: block IDs must be on the host (a list, a numpy array or a CPU tensor)")
        if ids.dtype not in _int_dtypes(torch) or ids.layout is not torch.strided or ids.is_nested:
            raise BlockIdError(f"{what}: block IDs must be a 1-D sequence of integers, got {ids.dtype} "
                               f"{'nested' if ids.is_nested else tuple(ids.shape)} ({ids.layout})")
        ids = ids.detach().resolve_neg().numpy()        # (a negated view's values, not its memory's)
    try:
        arr = np.asarray(ids)
    except (ValueError, TypeError, OverflowError) as exc:      # ragged or otherwise not an array of numbers
        raise BlockIdError(f"{what}: block IDs must be a 1-D sequence of integers ({exc})") from None
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise BlockIdError(f"{what}: block IDs must be a 1-D sequence of integers, got {arr.dtype} {arr.shape}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) >= _MAX_INT:
        raise BlockIdError(f"{what}: block ID {int(arr.max())} is out of range")
    out = np.ascontiguousarray(arr, dtype=np.int64)
    # (a list's array is new; a tensor's, a buffer's or the caller's array is theirs)
    return out.copy() if out is ids or not out.flags.owndata else out


def _uncovered(request: str, group: str, a: int, b: int, rs: int, rd: int) -> BlockIdError:
    """The error of ``a`` source and ``b`` destination blocks that do not cover the same tokens."""
    return BlockIdError(f"request {request!r}, group {group!r}: {a} source and {b} destination blocks do not "
                        f"cover the same tokens (block-size ratio {rs}:{rd})")


def _beyond(ids: np.ndarray, rising: bool, limit: int) -> bool:
    """Whether an ID of ``ids`` (not empty) leaves ``[0, limit)``: the ends of rising IDs, else their largest read
    unsigned (a negative ID is past any limit)."""
    if rising:
        return int(ids[0]) < 0 or int(ids[-1]) >= limit
    return int(_UMAX(ids.view(_U64))) >= limit


def _check_range(ids: np.ndarray, limit: int, request: str, group: str, side: str) -> None:
    """Every ID in ``[0, limit)``: one reduction (a negative ID read unsigned is past any limit)."""
    if ids.size and int(_UMAX(ids.view(_U64))) >= limit:
        bad = int(np.flatnonzero((ids < 0) | (ids >= limit))[0])
        raise BlockIdError(f"request {request!r}, group {group!r}, {side}: block ID {int(ids[bad])} at position {bad} is out of range "
                           f"(the group holds blocks 0..{limit - 1})")


class _Scratch(threading.local):
    """Per thread: an int64 array over block IDs, all -1 between uses, and a bool one, all False between uses
    (each use puts back what it wrote), so checking or ordering a request's IDs costs O(IDs), not a fresh
    array over the group's blocks; and work arrays whose contents do not outlive a call."""

    def __init__(self):
        self.slots = np.full(0, -1, dtype=np.int64)
        self.marks = np.zeros(0, dtype=bool)
        self.positions = np.arange(0, dtype=np.int64)
        self.work: list[np.ndarray] = [np.empty(0, dtype=np.int64) for _ in range(4)]

    def get(self, limit: int) -> np.ndarray:
        if self.slots.size < limit:
            self.slots = np.full(max(limit, 2 * self.slots.size), -1, dtype=np.int64)
        return self.slots[:limit]

    def mask(self, limit: int) -> np.ndarray:
        if self.marks.size < limit:
            self.marks = np.zeros(max(limit, 2 * self.marks.size), dtype=bool)
        return self.marks[:limit]

    def arange(self, n: int) -> np.ndarray:
        """``np.arange(n)`` as a read-only view of one kept array."""
        if self.positions.size < n:
            self.positions = np.arange(max(n, 2 * self.positions.size), dtype=np.int64)
            self.positions.flags.writeable = False
        return self.positions[:n]

    def buf(self, k: int, n: int) -> np.ndarray:
        """Work array ``k`` (0..3) with room for ``n`` int64 entries."""
        if self.work[k].size < n:
            self.work[k] = np.empty(max(n, 2 * self.work[k].size), dtype=np.int64)
        return self.work[k][:n]


_SCRATCH = _Scratch()
#: a key range at most this many times the keys goes by marks over the range, a larger one by a comparison
#: sort (ordering) or class by class over the slots of the keys only (duplicates)
_DENSE = 16


def _sort_order(keys: np.ndarray, limit: int) -> np.ndarray:
    """An order sorting ``keys`` (IDs in ``[0, limit)``). Distinct keys among a good share of the range go
    by one scatter and one pass over the range; others by a comparison sort."""
    n = keys.size
    if limit <= _DENSE * n:
        slot = _SCRATCH.get(limit)
        slot[keys] = _SCRATCH.arange(n)
        order = slot[slot >= 0]
        slot[keys] = -1
        if order.size == n:
            return order
    return keys.argsort(kind="stable")


def _check_unique(ids: np.ndarray, limit: int, request: str, groups: list[str]) -> None:
    """No ID twice in ``ids`` (all in ``[0, limit)``): each ID's slot takes the position of one of its
    occurrences; an occurrence that reads back another position is a duplicate. O(len(ids))."""
    if ids.size < 2:
        return
    at = _SCRATCH.arange(ids.size)
    slot = _SCRATCH.get(limit)
    slot[ids] = at
    differ = slot[ids] != at
    slot[ids] = -1
    if count_nonzero(differ):
        dup = np.flatnonzero(differ)
        raise BlockIdError(f"request {request!r}, group(s) {', '.join(groups)}: destination block "
                           f"{int(ids[dup[0]])} appears more than once (two copies "
                           "would land on the same bytes)")


def _past(ids: np.ndarray, lens: list[int], limits: np.ndarray) -> bool:
    """Whether some group's IDs (``ids``: the groups' IDs one after another, ``lens`` of each) leave ``[0,
    limit)``: one reduction per group in one call, over the IDs read unsigned (a negative ID is past any
    limit)."""
    if not ids.size:
        return False
    starts = list(itertools.accumulate(lens[:-1], initial=0))
    if 0 in lens:
        keep = [i for i, n in enumerate(lens) if n]
        starts, limits = [starts[i] for i in keep], limits[keep]
    return bool(count_nonzero(np.maximum.reduceat(ids.view(np.uint64), starts) >= limits))


#: ID checkers a NIXL peer keeps (one per direction and set of groups a request names); past it, the least
#: recently used goes (built again from the groups when a request names them again)
IDS_PER_PEER = 64


class _IdsCache:
    """At most ``cap`` values by key, the least recently used dropped past it; safe to use from any thread (two
    threads missing one key at once may both build it: either value is right)."""

    def __init__(self, cap: int):
        self.cap = cap
        self._values: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._values)

    def get(self, key, build):
        """The value cached under ``key``, else ``build()``'s, cached."""
        with self._lock:
            value = self._values.get(key)
            if value is not None:
                self._values.move_to_end(key)
                return value
        value = build()
        with self._lock:
            self._values[key] = value
            self._values.move_to_end(key)
            while len(self._values) > self.cap:
                self._values.popitem(last=False)
        return value


class _RouteIds:
    """How a route checks and orders its requests' block IDs (built with the route, once).

    Every group at once: both sides' IDs in one array (the groups one after another), one reduction call
    for the range checks, and one scatter of marks over keys ``offset of the group + block ID`` -- every
    group a key range of its own -- that both orders the pairs and finds duplicate destinations (groups
    whose destination memory overlaps share a range, so a block ID serves one of them only). The copies
    run in the order of the key side's blocks (``sort_by_dst``: the destination's, else the source's),
    group by group: ordered by destination keys, every destination turning up once is the duplicate
    check; ordered by source keys, the destinations' keys get a range of marks of their own in the same
    scatter. A failed check is then found group by group, so its error names the group, the side and the
    ID. Few IDs in a large range go by a comparison sort and by the per-group duplicate check (time O(IDs);
    the check's per-thread array over the group's blocks is made once and kept)."""

    def __init__(self, groups: tuple[str, ...], limits: list[tuple[int, int]], splits: list[tuple[int, int]],
                 dst_classes: list[list[int]], sort_by_dst: bool):
        self.groups, self.limits, self.splits, self.dst_classes = groups, limits, splits, dst_classes
        self.sort_by_dst = sort_by_dst
        self.side_limits = np.array([a for a, _ in limits] + [b for _, b in limits], dtype=np.uint64)
        self.paired = all(s == (1, 1) for s in splits)       # one block each side per segment: ordered as one
        self.single = self.paired and len(groups) == 1
        offsets, self.span = [], 0
        for a, b in limits:
            offsets.append(self.span)
            self.span += max(a, b)
        self.offsets = np.array(offsets, dtype=np.int64)
        self.shared = all(len(c) == 1 for c in dst_classes)  # duplicates keyed like the order
        if self.shared:
            self.class_offsets, self.class_span = self.offsets, self.span
        else:
            cls_off, self.class_span = [0] * len(groups), 0
            for cls in dst_classes:
                for gi in cls:
                    cls_off[gi] = self.class_span
                self.class_span += max(limits[gi][1] for gi in cls)
            self.class_offsets = np.array(cls_off, dtype=np.int64)
        # per class: its groups, the blocks of its largest destination, its groups' names (the duplicate check)
        self.dst_class_checks = [(cls, max(limits[gi][1] for gi in cls), [groups[gi] for gi in cls])
                                 for cls in dst_classes]
        # each group's destination keys: its window of the marks over the classes' range
        self.class_windows = [(int(o), int(o) + b) for o, (_, b) in zip(self.class_offsets, limits)]
        # where each group's keys start (:meth:`_order` marks them through a view of the marks from there):
        # ordered by source keys, the source side's keys, then the destination side's past them
        self.key_offsets = [int(o) for o in self.offsets]
        self.dst_key_offsets = [self.span + int(o) for o in self.class_offsets]

    def check(self, request: str, push: bool, local_blocks, remote_blocks) -> tuple:
        """A request's IDs taken per group (``local_blocks`` / ``remote_blocks``: ``{group: IDs}`` naming the
        route's groups), their counts, ranges and destinations checked (:class:`BlockIdError` naming the
        request, group and side), and their order found. Returns ``(segments per group, source counts,
        destination counts, the order)``: the order lives in this thread's work arrays, for :meth:`write`
        before the thread's next check."""
        if self.single:
            g = self.groups[0]
            mine = _as_ids(local_blocks[g], request, g, "local blocks")
            theirs = _as_ids(remote_blocks[g], request, g, "remote blocks")
            if (self.span if self.sort_by_dst else self.span + self.class_span) > _DENSE * mine.size:
                return self._check_one(request, push, mine, theirs)
            local_blocks, remote_blocks = {g: mine}, {g: theirs}
        return self._check_all(request, push, local_blocks, remote_blocks)

    def _check_one(self, request: str, push: bool, mine: np.ndarray, theirs: np.ndarray) -> tuple:
        """:meth:`check` of a route of one group whose blocks pair one to one, for IDs few in their range
        (what an engine's request is): the general path's checks and order in a few NumPy calls. Blocks listed
        in rising order (an allocator's fresh blocks come so), a comparison per side, need no reduction for the
        range (their ends bound it), no sort on the key side, and rising destinations are distinct (no duplicate
        check); other IDs take a reduction, a stable sort and the duplicate check over the destinations' slots."""
        g = self.groups[0]
        s, d = (mine, theirs) if push else (theirs, mine)
        n = s.size
        if d.size != n:
            raise _uncovered(request, g, n, d.size, 1, 1)
        ls, ld = self.limits[0]
        s_up = d_up = True
        if n > 1:
            s_up = not count_nonzero(s[1:] <= s[:-1])
            d_up = not count_nonzero(d[1:] <= d[:-1])
        if n and (_beyond(s, s_up, ls) or _beyond(d, d_up, ld)):
            _check_range(s, ls, request, g, "source (local)" if push else "source (remote)")
            _check_range(d, ld, request, g, "destination (remote)" if push else "destination (local)")
        order = None
        if not (d_up if self.sort_by_dst else s_up):
            order = ("sort", (d if self.sort_by_dst else s).argsort(kind="stable"))
        if not d_up:
            _check_unique(d, ld, request, [g])
        return [n], [n], [n], (s, d, order, [n], [n])

    def _check_all(self, request: str, push: bool, local_blocks, remote_blocks) -> tuple:
        """:meth:`check` over every group at once."""
        rows = []                   # per group: (sources, destinations, segments, their counts)
        ns = nd = 0
        for g, (rs, rd) in zip(self.groups, self.splits):
            mine = _as_ids(local_blocks[g], request, g, "local blocks")
            theirs = _as_ids(remote_blocks[g], request, g, "remote blocks")
            s, d = (mine, theirs) if push else (theirs, mine)
            a, b = s.size, d.size
            n = a if rs == 1 else b
            if -(-n // rs) != a or -(-n // rd) != b:
                raise _uncovered(request, g, a, b, rs, rd)
            rows.append((s, d, n, a, b))
            ns += a
            nd += b
        srcs, dsts, n_seg, lens_s, lens_d = map(list, zip(*rows))
        both = np.concatenate(srcs + dsts, out=_SCRATCH.buf(0, ns + nd))
        S, D = both[:ns], both[ns:]
        if _past(both, lens_s + lens_d, self.side_limits):
            for g, (ls, ld), s, d in zip(self.groups, self.limits, srcs, dsts):
                _check_range(s, ls, request, g, "source (local)" if push else "source (remote)")
                _check_range(d, ld, request, g, "destination (remote)" if push else "destination (local)")
        order, distinct = self._order(both, ns, lens_s, lens_d) if self.paired and ns > 1 else (None, False)
        if not distinct:
            self._check_destinations(request, dsts, nd)
        return n_seg, lens_s, lens_d, (S, D, order, lens_s, lens_d)

    def _order(self, both: np.ndarray, n: int, lens_s: list[int], lens_d: list[int]) -> tuple[tuple, bool]:
        """The order of a paired route's ``n`` pairs (``both``: the sources, then the destinations) by their
        keys (``offset of the group + key side's ID``), and whether the destinations were found distinct
        on the way. The order: ``("marks", sorted keys, partners at the keys)`` where the keys are distinct
        among a good share of their range (one scatter per group and side and one pass over the range: each
        group's IDs index a view of the marks and partners starting at its keys' offset, so no key array is made),
        else ``("sort", order)``. (``lens_s`` and ``lens_d`` are equal: the route pairs blocks one to one.)"""
        S, D = both[:n], both[n:]
        by_dst = self.sort_by_dst
        X, O = (D, S) if by_dst else (S, D)
        if (self.span if by_dst else self.span + self.class_span) > _DENSE * n:
            return ("sort", np.add(X, self.offsets.repeat(lens_s), out=_SCRATCH.buf(2, n)).argsort(
                kind="stable")), False
        span = self.span
        # (by source keys, the destinations' keys go past the sources': their marks count the distinct ones)
        marks = _SCRATCH.mask(span if by_dst else span + self.class_span)
        partner = _SCRATCH.buf(3, span)
        a = 0
        for o, od, k in zip(self.key_offsets, self.dst_key_offsets, lens_s):
            if k:       # (every ID checked in its group's range: inside the group's keys)
                x, b = X[a:a + k], a + k
                marks[o:][x] = True
                partner[o:][x] = O[a:b]
                if not by_dst:
                    marks[od:][D[a:b]] = True
                a = b
        at = marks[:span].nonzero()[0]
        distinct = (self.shared and at.size == n) if by_dst else int(count_nonzero(marks[span:])) == n
        marks[:] = False
        if at.size == n:        # (ordered by source keys, a source read twice goes by the sort)
            return ("marks", at, partner), distinct
        return ("sort", np.add(X, self.offsets.repeat(lens_s), out=_SCRATCH.buf(2, n)).argsort(
            kind="stable")), distinct

    def _check_destinations(self, request: str, dsts: list[np.ndarray], nd: int) -> None:
        """No destination block twice among groups sharing destination memory (``dsts``: per group, ``nd`` IDs
        in all): :meth:`distinct`'s pass of marks, or class by class where the IDs are few in a large range or a
        repeat is to be found and named."""
        if nd < 2 or (self.class_span <= _DENSE * nd and self._marked_once(dsts, nd)):
            return
        for cls, limit, names in self.dst_class_checks:
            _check_unique(dsts[cls[0]] if len(cls) == 1 else np.concatenate([dsts[gi] for gi in cls]), limit,
                          request, names)

    def _marked_once(self, dsts: list[np.ndarray], nd: int) -> bool:
        """Whether the ``nd`` IDs of ``dsts`` (per group, in range) mark ``nd`` distinct keys ``offset of the class
        + ID``: one scatter per group into a view of this thread's marks (no key array made), one count, one
        clear of the class range."""
        marks = _SCRATCH.mask(self.class_span)
        for d, (lo, hi) in zip(dsts, self.class_windows):
            marks[lo:hi][d] = True
        seen = count_nonzero(marks)
        marks[:] = False
        return seen == nd

    def distinct(self, dsts: list[np.ndarray]) -> bool:
        """Whether no destination block appears twice among ``dsts`` (per group of the route, each a 1-D int64
        array of IDs already checked in range, e.g. views of a merged request array): O(IDs), one scatter of
        marks per group over the classes' key range where the IDs are a good share of it, else class by class
        over the per-thread slots of the IDs only."""
        nd = sum(map(len, dsts))        # (1-D arrays)
        if nd < 2:
            return True
        if self.class_span <= _DENSE * nd:
            return self._marked_once(dsts, nd)
        try:
            self._check_destinations("", dsts, nd)
        except BlockIdError:
            return False
        return True

    def write(self, checked: tuple, out_s: np.ndarray, out_d: np.ndarray) -> None:
        """The checked IDs (:meth:`check`'s last item) ordered into ``out_s`` and ``out_d``, group by group:
        each group's pairs sorted by the key side's block (groups whose two sides' blocks differ in size keep
        theirs)."""
        S, D, order, lens_s, lens_d = checked
        if order is not None:
            out_x, out_o = (out_d, out_s) if self.sort_by_dst else (out_s, out_d)
            if order[0] == "marks":          # (n distinct keys, sorted: each group's lens_s[g] of them in turn)
                _, at, partner = order
                a = 0
                for o, k in zip(self.key_offsets, lens_s):
                    if k:
                        np.subtract(at[a:a + k], o, out=out_x[a:a + k])
                        a += k
                partner.take(at, out=out_o)
            else:           # (the methods: np.take's Python wrappers cost three calls each)
                X, O = (D, S) if self.sort_by_dst else (S, D)
                X.take(order[1], out=out_x)
                O.take(order[1], out=out_o)
            return
        if self.paired:
            out_s[:] = S
            out_d[:] = D
            return
        a = b = 0
        for (rs, rd), (ls, ld), k, m in zip(self.splits, self.limits, lens_s, lens_d):
            s, d = S[a:a + k], D[b:b + m]
            if rs == rd == 1 and k > 1:
                order = _sort_order(d, ld) if self.sort_by_dst else _sort_order(s, ls)
                s.take(order, out=out_s[a:a + k])
                d.take(order, out=out_d[b:b + m])
            else:
                out_s[a:a + k] = s
                out_d[b:b + m] = d
            a, b = a + k, b + m


_MASK64 = (1 << 64) - 1
_K_ID, _K_POS = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xD6E8FEB86659FD93)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _salt(*parts) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def route_salts(groups, keys, splits, limits, agents: tuple[str, str]) -> tuple[int, np.ndarray]:
    """What a route mixes into its requests' fingerprints (:func:`request_fingerprint`), the same on both sides
    of a pair whatever order each registered in: a salt of the route (the source and destination agents' ids
    ``agents``, its layer pieces' sorted keys -- segment bytes, group, layer and piece names --, each group's
    block-size ratio and block counts, by group name) and one per group and side (the route's group order:
    every group's source side, then every group's destination side)."""
    by_name = sorted(zip(groups, splits, limits))
    route = _salt("route", agents, list(keys), by_name)
    salts = np.array([_salt(route, g, side) for side in ("src", "dst") for g in groups], dtype=np.uint64)
    return route, salts


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, in place over a uint64 array (wrapping)."""
    x ^= x >> _S30
    x *= _MIX1
    x ^= x >> _S27
    x *= _MIX2
    x ^= x >> _S31
    return x


def _mix_int(x: int) -> int:
    """SplitMix64's finaliser over a Python int (64-bit)."""
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


_PLACES = np.zeros(0, dtype=np.uint64)      # i * _K_POS, grown as needed (read only)


def _places(n: int) -> np.ndarray:
    global _PLACES
    if _PLACES.size < n:
        grown = np.arange(max(n, 2 * _PLACES.size, 1024), dtype=np.uint64) * _K_POS
        grown.flags.writeable = False
        _PLACES = grown
    return _PLACES[:n]


def request_fingerprint(ids: np.ndarray, lens: list[int], salts: tuple[int, np.ndarray]) -> int:
    """A request's fingerprint: 64-bit hash over its written block IDs (``ids``: every group's source IDs, then
    every group's destination IDs, ``lens`` of each, in the route's group order and the order :meth:`_RouteIds.write`
    gives them) and its route (``salts``, :func:`route_salts`). Each ID is mixed with its group and side's salt
    and its place among them; the sum over the IDs does not depend on the order of the groups, so both sides
    of a pair compute the same value for the same request. In ``[1, 2**61)``. O(IDs), a fixed number of NumPy
    calls."""
    route, per = salts
    total = 0
    n = ids.size
    if n:
        # place j of a run starting at entry a: (a + j) * K - a * K, the run's part folded into its salt
        starts = np.cumsum(lens, dtype=np.uint64) - np.asarray(lens, dtype=np.uint64)
        x = np.multiply(ids.view(np.uint64), _K_ID)
        x += _places(n)
        x += np.repeat(per - starts * _K_POS, lens)
        total = int(np.add.reduce(_mix(x), dtype=np.uint64))
    return (_mix_int((total + route) & _MASK64) >> 3) | 1
