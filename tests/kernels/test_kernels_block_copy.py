"""The copy kernel's mode 5 (:func:`~gpuxfer.kernels.launch.copy_blocks_launcher`): a request array and a plane
table copied with no descriptor table, against the expansion + descriptor copy of the same request and the
NumPy reference (:func:`~gpuxfer.kernels.reference.block_rows`).

Every buffer the kernels get is a view into a larger one: guard bytes around the pools, valid-looking block IDs
and headers around the request, valid planes around the launch's planes. A read outside a view would copy bytes
the reference does not (a wrong block, a guard byte); a write outside one changes a guard byte. On the CPU
(Triton's interpreter) and, marked ``gpu``, compiled.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gpuxfer.errors import BadInput
from gpuxfer.kernels import reference as ref
from gpuxfer.kernels.blocks import expand_launcher
from gpuxfer.kernels.launch import blocks_config, choose_config, copy_blocks_launcher, copy_range_launcher

SRC_SEED, DST_SEED = 31, 47
GUARD = 64                     # guard bytes (and guard request entries) on each side
SPLITS = [(1, 1), (2, 1), (4, 1), (1, 2), (1, 4)]      # (segments per source block, per destination block)


def _host(t: torch.Tensor) -> np.ndarray:
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)
    return t.cpu().numpy().copy()


class Layout:
    """Random planes over two pools: ``G`` groups (their own block counts and splits), ``P`` planes in random
    group order, each plane's blocks in a region of its own (segments of ``seg`` bytes; 16-byte multiples and
    16-byte aligned bases when ``aligned``)."""

    def __init__(self, rng, G: int, P: int, aligned: bool, max_seg: int = 80, splits=None):
        self.G, self.P = G, P
        self.splits = splits or [SPLITS[i] for i in rng.integers(0, len(SPLITS), G)]
        self.src_nb = rng.integers(2, 7, G)
        self.dst_nb = rng.integers(2, 7, G)
        self.group = rng.integers(0, G, P)
        unit = 16 if aligned else 1
        rows, src_end, dst_end = [], 0, 0
        for g in self.group:
            rs, rd = self.splits[g]
            seg = int(rng.integers(1, max_seg // unit + 1)) * unit
            ss = rs * seg + int(rng.integers(0, 3)) * unit
            ds = rd * seg + int(rng.integers(0, 3)) * unit
            src_end += int(rng.integers(0, 3)) * unit
            dst_end += int(rng.integers(0, 3)) * unit
            rows.append([src_end, ss, dst_end, ds, seg, g, rs, rd, self.src_nb[g], self.dst_nb[g]])
            src_end += ss * int(self.src_nb[g])
            dst_end += ds * int(self.dst_nb[g])
        self.planes = np.array(rows, dtype=np.int64).reshape(P, 10)
        self.src_bytes, self.dst_bytes = src_end, dst_end

    def request(self, rng, extra: int = 0) -> np.ndarray:
        """A well-formed request (as the agent writes one): per group some segments, source IDs anywhere,
        distinct destination IDs; then ``extra`` entries of valid IDs (a slot larger than the request)."""
        G, P = self.G, self.P
        head = P + 1 + 3 * G
        nseg, ids, starts_s, starts_d, at = [], [], [], [], head
        for g in range(G):
            rs, rd = self.splits[g]
            n = int(rng.integers(0, int(self.dst_nb[g]) * rd + 1))
            s_ids = rng.integers(0, self.src_nb[g], -(-n // rs))
            d_ids = rng.permutation(int(self.dst_nb[g]))[:-(-n // rd)]
            nseg.append(n)
            starts_s.append(at)
            starts_d.append(at + s_ids.size)
            at += s_ids.size + d_ids.size
            ids += [s_ids, d_ids]
        rows = np.concatenate([[0], np.cumsum(np.array(nseg, dtype=np.int64)[self.group])])
        tail = rng.integers(0, 2, extra)
        return np.concatenate([rows, nseg, starts_s, starts_d, *ids, tail]).astype(np.int64)


def _classes(rng, P: int) -> list[tuple[int, int]]:
    """The planes cut into up to three launches (a route's launch classes)."""
    cuts = sorted(set(rng.integers(1, P, int(rng.integers(0, 3))).tolist())) if P > 1 else []
    b = [0, *cuts, P]
    return list(zip(b[:-1], b[1:]))


class Run:
    """Both paths over one layout on ``dev``: pools, plane table and request inside guarded buffers."""

    def __init__(self, dev, lay: Layout, req: np.ndarray, pool_at: int = GUARD):
        self.dev, self.lay, self.req = dev, lay, req
        self.pool_at = pool_at
        self.src_all = ref.pattern(SRC_SEED, 0, pool_at + lay.src_bytes + GUARD)
        self.dst_all = ref.pattern(DST_SEED, 0, pool_at + lay.dst_bytes + GUARD)
        # around the request: entries that are valid IDs and row numbers (a read of them would copy something)
        self.req_all = np.concatenate([np.ones(GUARD, np.int64), req, np.ones(GUARD, np.int64)])
        # around the planes: a copy of the table (a plane read outside the launch's would copy its segments)
        self.planes_all = np.concatenate([lay.planes, lay.planes, lay.planes])

    def _views(self):
        d, at, P = self.dev, self.pool_at, self.lay.P
        src_all = torch.from_numpy(self.src_all.copy()).to(d)
        dst_all = torch.from_numpy(self.dst_all.copy()).to(d)
        req_all = torch.from_numpy(self.req_all.copy()).to(d)
        planes_all = torch.from_numpy(self.planes_all.copy()).to(d)
        return (dst_all, src_all[at:at + self.lay.src_bytes], dst_all[at:at + self.lay.dst_bytes],
                req_all[GUARD:GUARD + self.req.size], planes_all[P:2 * P])

    def fused(self, classes, cap: int, **kw) -> np.ndarray:
        dst_all, src, dst, req, planes = self._views()
        for lo, hi in classes:
            launch = copy_blocks_launcher(src, dst, planes, req, n_groups=self.lay.G, plane_lo=lo, plane_hi=hi,
                                          max_rows=cap, **kw)
            if launch is not None:
                launch()
        return _host(dst_all)

    def expand_copy(self, classes, cap: int, **kw) -> np.ndarray:
        """The slot's path: the expansion over every plane into a zeroed table, one range copy per class."""
        dst_all, src, dst, req, planes = self._views()
        out = torch.zeros((cap, 3), dtype=torch.int64, device=self.dev)
        expand_launcher(planes, req, out, n_groups=self.lay.G, programs_per_plane=2, block=4)()
        for lo, hi in classes:
            launch = copy_range_launcher(src, dst, out, req, lo_at=lo, hi_at=hi, **kw)
            if launch is not None:
                launch()
        return _host(dst_all)

    def reference(self, classes, cap: int, splits: bool = True) -> np.ndarray | None:
        """What mode 5 copies, by the NumPy reference; None where two copied rows share a destination byte (the
        kernel's order between them is unspecified)."""
        want = self.dst_all.copy()
        at = self.pool_at
        descs = np.concatenate([ref.block_rows(self.lay.planes, self.req, self.lay.G, lo, hi, cap, splits)[1]
                                for lo, hi in classes] or [np.zeros((0, 3), np.int64)])
        descs = descs[descs[:, 2] > 0]
        order = np.argsort(descs[:, 1], kind="stable")
        ends = descs[order, 1] + descs[order, 2]
        if descs.shape[0] > 1 and (descs[order[1:], 1] < np.maximum.accumulate(ends)[:-1]).any():
            return None
        assert ((descs[:, 0] >= 0) & (descs[:, 0] + descs[:, 2] <= self.lay.src_bytes)).all()
        assert ((descs[:, 1] >= 0) & (descs[:, 1] + descs[:, 2] <= self.lay.dst_bytes)).all()
        ref.copy(self.src_all[at:], want[at:], descs)
        return want

    def unambiguous(self, classes, cap: int) -> bool:
        """Whether the expansion + copy has one answer mode 5 must match: every row a launch copies is written
        by at most one plane of the expansion, and that plane is the one mode 5's bisection finds."""
        lay, req = self.lay, [int(v) for v in self.req]
        np1, G = lay.P + 1, lay.G
        for lo, hi in classes:
            first = min(max(req[lo], 0), cap)
            end = min(max(req[hi], first), cap)
            for row in range(first, end):
                writers = [p for p in range(lay.P) if 0 <= lay.planes[p, 5] < G and req[p] >= -(1 << 62)
                           and 0 <= row - req[p] < req[np1 + lay.planes[p, 5]]]
                if len(writers) > 1:
                    return False
                if writers:
                    base, cnt = lo, hi - lo
                    while cnt > 1:
                        half = cnt // 2
                        base, cnt = (base + half if req[base + half] <= row else base), cnt - half
                    if writers[0] != base:
                        return False
        return True


def _check_guards(run: Run, got: np.ndarray) -> None:
    at = run.pool_at
    assert np.array_equal(got[:at], run.dst_all[:at]), "a byte before the destination pool changed"
    end = at + run.lay.dst_bytes
    assert np.array_equal(got[end:], run.dst_all[end:]), "a byte past the destination pool changed"


@pytest.mark.parametrize("seed, G, P, aligned, pool_at", [
    (1, 1, 2, True, GUARD), (2, 2, 4, True, GUARD), (3, 3, 5, False, GUARD), (4, 2, 3, True, GUARD + 4),
    (5, 2, 4, False, GUARD + 3), (6, 3, 6, True, GUARD)])
def test_block_copy_matches_expand_and_copy(dev, seed, G, P, aligned, pool_at):
    """Well-formed requests over random layouts (splits 1/2/4 on either side; 16-byte, 4-byte and byte paths by
    the segments and the pools' alignment; the output capped below and above the request's rows): the bytes
    mode 5 writes are those of the expansion + copy and of the reference, nothing outside the pool changes."""
    rng = np.random.default_rng(seed)
    lay = Layout(rng, G, P, aligned)
    for _ in range(2):
        req = lay.request(rng, extra=int(rng.integers(0, 5)))
        total = int(req[P])
        cap = max(1, total + int(rng.integers(-3, 4)))
        classes = _classes(rng, P)
        run = Run(dev, lay, req, pool_at)
        got = run.fused(classes, cap)
        _check_guards(run, got)
        want = run.reference(classes, cap)
        assert want is not None
        assert np.array_equal(got, want)
        assert np.array_equal(got, run.expand_copy(classes, cap))
        assert total == 0 or not np.array_equal(got, run.dst_all), "nothing was copied"


def test_block_copy_large_segments_over_slices(dev):
    """Few rows of segments larger than a step on a grid of more programs than work items (one item of 16 rows): the items are sliced
    (each program copies every ``slices``-th chunk of a row), the 16-byte path pipelined over chunks."""
    rng = np.random.default_rng(12)
    lay = Layout(rng, 1, 2, True, max_seg=3200)
    req = lay.request(rng)
    run = Run(dev, lay, req)
    cap = int(req[lay.P])
    assert 0 < cap <= 16 and lay.planes[:, 4].min() > 1024
    got = run.fused([(0, 2)], cap, num_programs=5, nbytes_hint=3200)
    _check_guards(run, got)
    assert np.array_equal(got, run.reference([(0, 2)], cap))


def test_block_copy_without_splits(dev):
    """Planes that split no block (the same block size on both sides) compile mode 5 without the divisions by
    the splits, found by the launcher in the plane table: the bytes of the expansion + copy. A launch told its
    planes split nothing copies nothing for a plane that does, and the rest of the request still moves."""
    rng = np.random.default_rng(21)
    lay = Layout(rng, 2, 4, True, splits=[(1, 1), (1, 1)])
    req = lay.request(rng)
    cap = int(req[lay.P])
    run = Run(dev, lay, req)
    got = run.fused([(0, 2), (2, 4)], cap)
    _check_guards(run, got)
    assert np.array_equal(got, run.expand_copy([(0, 2), (2, 4)], cap))
    assert np.array_equal(got, run.reference([(0, 2), (2, 4)], cap)) and not np.array_equal(got, run.dst_all)
    lay = Layout(rng, 2, 4, True, splits=[(1, 1), (2, 1)])
    lay.group[:] = [0, 1, 0, 1]
    lay.planes[:, 5] = lay.group
    lay.planes[:, 6] = [1, 2, 1, 2]
    lay.planes[:, 8:10] = [[lay.src_nb[g], lay.dst_nb[g]] for g in lay.group]
    while True:
        req = lay.request(rng)
        if req[lay.P + 1] > 0 and req[lay.P + 2] > 0:
            break
    cap = int(req[lay.P])
    run = Run(dev, lay, req)
    got = run.fused([(0, 4)], cap, splits=False)
    _check_guards(run, got)
    assert np.array_equal(got, run.reference([(0, 4)], cap, splits=False))
    assert not np.array_equal(got, run.dst_all), "the planes that split nothing moved nothing"
    assert not np.array_equal(got, run.reference([(0, 4)], cap)), "a plane that splits blocks was copied"


@pytest.mark.gpu
def test_a_launcher_made_while_a_graph_captures():
    """A launcher made while torch's current stream captures a CUDA graph, ``splits`` not given: it reads
    nothing back from the planes (a device-to-host copy there fails the capture) and divides by the splits;
    the captured launch, replayed, copies the reference's bytes."""
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    dev = torch.device("cuda", torch.cuda.current_device())
    rng = np.random.default_rng(8)
    lay = Layout(rng, 2, 4, True, splits=[(1, 1), (2, 1)])
    req = lay.request(rng)
    cap = int(req[lay.P])
    run = Run(dev, lay, req)
    dst_all, src, dst, req_t, planes = run._views()
    kw = dict(n_groups=lay.G, plane_lo=0, plane_hi=lay.P, max_rows=cap)
    copy_blocks_launcher(src, dst, planes, req_t, splits=True, **kw)()      # (the kernel compiled and loaded)
    dst_all.copy_(torch.from_numpy(run.dst_all).to(dev))
    torch.cuda.synchronize(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        copy_blocks_launcher(src, dst, planes, req_t, **kw)()
    assert np.array_equal(_host(dst_all), run.dst_all), "the capture ran the copy"
    graph.replay()
    got = _host(dst_all)
    _check_guards(run, got)
    assert np.array_equal(got, run.reference([(0, lay.P)], cap)) and not np.array_equal(got, run.dst_all)


BIG = np.array([-(1 << 63), -(1 << 62) - 1, -(1 << 62), -7, -1, 0, 1, 2, 3, 5, 9, 40, 1 << 31, 1 << 40,
                (1 << 62), (1 << 63) - 1], dtype=np.int64)


def _forge(rng, lay: Layout, req: np.ndarray, rows: bool) -> np.ndarray:
    """A well-formed request with a few of its fields forged -- first rows and counts (``rows``), ID starts,
    IDs -- to values near the buffer's edges or anywhere in int64."""
    req = req.copy()
    P, G = lay.P, lay.G
    head = P + 1 + 3 * G
    fields = [(lo, hi) for lo, hi in ((0, P + 1), (P + 1, P + 1 + G)) if rows]
    fields += [(lo, hi) for lo, hi in ((P + 1 + G, head), (head, req.size)) if hi > lo]
    for k in rng.choice(len(fields), int(rng.integers(1, 3)), replace=False):
        lo, hi = fields[k]
        at = rng.integers(lo, hi, int(rng.integers(1, 3)))
        near = rng.integers(-3, req.size + 4, at.size)
        req[at] = np.where(rng.random(at.size) < 0.3, rng.choice(BIG, at.size), near)
    return req


@pytest.mark.parametrize("seed", range(4))
def test_block_copy_hostile_requests_stay_in_bounds(dev, seed):
    """Forged first rows, counts, ID starts (past the buffer, negative, huge) and IDs (out of range,
    negative, huge), and planes naming no group: nothing outside the pools changes, no entry outside the
    request or plane outside the launch's is read (they hold valid IDs and planes: reading one would copy
    bytes the reference does not), and the bytes are the reference's and, where the expansion gives one
    answer (no row claimed by two planes), the expansion + copy's. At mode 5's own small-row tiling and at the
    descriptor copy's."""
    rng = np.random.default_rng(100 + seed)
    lay = Layout(rng, int(rng.integers(1, 4)), int(rng.integers(2, 6)), bool(seed % 2))
    lay.planes[rng.integers(0, lay.P), 5] = rng.choice([-1, lay.G, 1 << 40])
    compared = copied = 0
    for i in range(8):
        req = _forge(rng, lay, lay.request(rng, extra=2), rows=i % 2 == 1)
        cap = int(rng.integers(1, 32))
        classes = _classes(rng, lay.P)
        run = Run(dev, lay, req)
        got = run.fused(classes, cap, config=None if seed % 2 else choose_config(2304))
        _check_guards(run, got)
        want = run.reference(classes, cap)
        if want is not None:
            assert np.array_equal(got, want)
        if run.unambiguous(classes, cap):
            compared += 1
            copied += not np.array_equal(got, run.dst_all)
            assert np.array_equal(got, run.expand_copy(classes, cap))
    assert copied, "no request of this seed that moved bytes was compared with the expansion"


def _two_planes():
    """One group of 4-block pools (32-byte blocks, one segment each), two planes: the first and second half of
    each pool."""
    from types import SimpleNamespace
    planes = np.array([[0, 32, 0, 32, 32, 0, 1, 1, 4, 4], [128, 32, 128, 32, 32, 0, 1, 1, 4, 4]], dtype=np.int64)
    return SimpleNamespace(G=1, P=2, planes=planes, src_bytes=256, dst_bytes=256)


B62 = 1 << 62
EDGES = [   # (why, header [row0, row1, row2, count, src IDs at, dst IDs at], src IDs, dst IDs, rows copied)
    ("IDs at and past the block counts", [0, 4, 8, 4, 6, 10], [0, 4, -1, 3], [1, 2, 3, 4], [0, 4]),
    ("ID starts before and past the buffer", [0, 4, 8, 4, -1, 12], [0, 1, 2, 3], [3, 2, 1, 0], [1, 5]),
    # (then two valid IDs: the segment past the count would find its IDs)
    ("a count shorter than its plane's rows", [0, 5, 8, 3, 6, 9], [0, 1, 2], [2, 1, 0, 3, 3], [0, 1, 2, 5, 6, 7]),
    ("a first row at -2**62", [-B62, 8, 8, (1 << 63) - 1, 6 - B62, 10 - B62], [0, 1, 2, 3], [3, 2, 1, 0],
     [0, 1, 2, 3]),
    ("a first row below -2**62", [-B62 - 1, 8, 8, (1 << 63) - 1, 5 - B62, 9 - B62], [0, 1, 2, 3], [3, 2, 1, 0],
     []),
]


@pytest.mark.parametrize("why, header, s_ids, d_ids, rows", EDGES, ids=[e[0] for e in EDGES])
def test_block_copy_edges_of_the_masking_rules(dev, why, header, s_ids, d_ids, rows):
    """Requests at the edges of the rules -- each row copied or not as the expansion decides (the guard entries
    around the request are valid IDs, so an index one past either end would copy a block)."""
    lay = _two_planes()
    req = np.array(header + s_ids + d_ids, dtype=np.int64)
    run = Run(dev, lay, req)
    first, descs = ref.block_rows(lay.planes, req, 1, 0, 2, 16)
    assert (first + np.flatnonzero(descs[:, 2])).tolist() == rows
    assert run.unambiguous([(0, 2)], 16)
    got = run.fused([(0, 2)], 16)
    _check_guards(run, got)
    assert np.array_equal(got, run.reference([(0, 2)], 16))
    assert np.array_equal(got, run.expand_copy([(0, 2)], 16))


def test_one_block_copy_launcher_serves_request_after_request(dev):
    """The launcher is bound once to the request buffer: each request written there is copied whole (its rows
    read on the device), a shorter one after a longer one copying only its own rows."""
    rng = np.random.default_rng(5)
    lay = Layout(rng, 2, 3, True)
    first = lay.request(rng)
    run = Run(dev, lay, first)
    buf = torch.zeros(first.size + 40, dtype=torch.int64, device=dev)
    src = torch.from_numpy(run.src_all[GUARD:GUARD + lay.src_bytes].copy()).to(dev)
    dst = torch.from_numpy(run.dst_all[GUARD:GUARD + lay.dst_bytes].copy()).to(dev)
    launch = copy_blocks_launcher(src, dst, torch.from_numpy(lay.planes).to(dev), buf, n_groups=2, plane_lo=0,
                                  plane_hi=3, max_rows=64)
    want = run.dst_all[GUARD:GUARD + lay.dst_bytes].copy()
    for req in (first, lay.request(rng), lay.request(rng)):
        buf.zero_()
        buf[:req.size] = torch.from_numpy(req).to(dev)
        launch()
        ref.copy(run.src_all[GUARD:], want, ref.block_rows(lay.planes, req, 2, 0, 3, 64)[1])
        assert np.array_equal(_host(dst), want)


def test_copy_blocks_launcher_rejects_bad_arguments():
    pool = torch.zeros(64, dtype=torch.uint8)
    planes = torch.zeros((3, 10), dtype=torch.int64)
    req = torch.zeros(3 + 1 + 3 * 2, dtype=torch.int64)
    ok = dict(n_groups=2, plane_lo=0, plane_hi=3, max_rows=8)
    assert copy_blocks_launcher(pool, pool, planes, req, **ok) is not None
    for kw, match in [(dict(n_groups=3), "request holds 10 entries"), (dict(n_groups=-1), "n_groups"),
                      (dict(plane_lo=4), "plane_lo"), (dict(plane_lo=2, plane_hi=1), "plane_hi"),
                      (dict(plane_hi=4), "plane_hi"), (dict(max_rows=(1 << 62) + 1), "max_rows"),
                      (dict(max_rows=True), "max_rows"), (dict(num_programs=0), "num_programs"),
                      (dict(splits=0), "splits"), (dict(splits="no"), "splits")]:
        with pytest.raises(BadInput, match=match):
            copy_blocks_launcher(pool, pool, planes, req, **{**ok, **kw})
    for args, match in [((pool, pool, planes[:, :9].contiguous(), req), "fields per row"),
                        ((pool, pool, planes.to(torch.int32), req), "planes must be"),
                        ((pool, pool, planes, req.view(2, 5)), "request must be"),
                        ((pool, pool, planes, req[::2]), "request must be"),
                        ((pool.view(8, 8), pool, planes, req), "src_pool")]:
        with pytest.raises(BadInput, match=match):
            copy_blocks_launcher(*args, **ok)
    assert copy_blocks_launcher(pool, pool, planes, req, **{**ok, "plane_lo": 2, "plane_hi": 2}) is None
    assert copy_blocks_launcher(pool, pool, planes, req, **{**ok, "max_rows": 0}) is None


def test_block_copy_needs_its_range_read_on_the_device():
    """Mode 5's rows are the header's: a launch with host-given rows (no bounds) is refused."""
    from gpuxfer.kernels import launch
    pool = torch.zeros(64, dtype=torch.uint8)
    req = torch.zeros(10, dtype=torch.int64)
    with pytest.raises(BadInput, match="bounds needed"):
        launch._copy_launch(launch.MODE_BLOCKS, pool, pool, req, torch.zeros((3, 10), dtype=torch.int64), 0, 4, 0,
                            None, None, 16, None, False)


def test_block_copy_tiling_of_its_own_for_small_rows():
    """Mode 5 takes its own tiling for rows of at most 4 KB between pools that are not both local on the default
    grid, the descriptor copy's otherwise; a hint that is not an integer is left to the launch's check."""
    small = blocks_config(2304)
    assert small is not None and small == blocks_config(None) == blocks_config(4096) != choose_config(2304)
    assert blocks_config(4097) is None and blocks_config(528, local=True) is None
    assert blocks_config(528, num_programs=4) is None and blocks_config("528") is None
    assert blocks_config(True) is None
