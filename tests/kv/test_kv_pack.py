"""The KV API's pack engine (gpuxfer.kv.pack_transfer._PackTransfer): cached shapes, graph replays, flag parities.

CPU tests on the host emulation (Triton's interpreter, graphs recorded and replayed by the emulated
streams): two agents in one process, tiny staging slots so a request spans several chunks. GPU tests
(``-m gpu``) run the same two-sided protocol on one CUDA device.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gpuxfer.errors import BadInput, TransferMismatch, TransferTimeout
from gpuxfer.kv.agent import KVAgent

SLOT = 256          # bytes per staging slot: a 32-byte row per block, 8 blocks per chunk


class _Side:
    """One agent and a cache of ``blocks`` blocks of ``row`` bytes (one layer, one piece) on a host buffer."""

    def __init__(self, plat, name, device, blocks=64, row=32, timeout_s=60.0):
        self.buf = plat.alloc(blocks * row + 64, device)
        self.cache = plat.as_tensor(self.buf)[:blocks * row].view(blocks, row)
        self.agent = KVAgent(name, platform=plat, device=device, engine="pack", slot_bytes=SLOT, timeout_s=timeout_s)
        self.agent.register_group("g", 16, {"layers.0": self.cache})

    def close(self):
        self.agent.close()
        self.buf.close()


@pytest.fixture
def sides(plat, request, monkeypatch):
    """Two pack agents, peers of each other; ``flag_path`` (indirect parameter, default ``auto``: the probe
    finds remote writes work here) forces how signals reach the peer."""
    path = getattr(request, "param", "auto")
    monkeypatch.setenv("GPUXFER_FLAG_PATH", path)
    src, dst = _Side(plat, "prefill", 0), _Side(plat, "decode", 1)
    src.peer = src.agent.add_peer(dst.agent.metadata())
    dst.peer = dst.agent.add_peer(src.agent.metadata())
    assert src.peer.remote_flags == dst.peer.remote_flags == (path != "copy")
    yield src, dst
    dst.close()
    src.close()


def _prepare(src, dst, s_ids, d_ids, name="req"):
    xs = src.agent.prepare(src.peer, "push", local_blocks={"g": s_ids}, remote_blocks={"g": d_ids}, name=name)
    xd = dst.agent.prepare(dst.peer, "pull", local_blocks={"g": d_ids}, remote_blocks={"g": s_ids}, name=name)
    return xs, xd


def _move(src, dst, xs, xd, s_ids, d_ids, seed):
    """Fill the source, post both sides (destination first), check every destination block."""
    g = np.random.default_rng(seed)
    src.cache.copy_(torch.from_numpy(g.integers(0, 256, tuple(src.cache.shape), dtype=np.uint8)))
    before = dst.cache.clone()
    hd = xd.post()
    hs = xs.post()
    hs.wait(60)
    hd.wait(60)
    want = before
    want[d_ids] = src.cache[s_ids]
    assert torch.equal(dst.cache, want)


def test_large_requests_take_larger_chunks(sides, monkeypatch):
    """Chunks grow past their smallest size so a request takes about PACK_MAX_CHUNKS of them (up to the slot);
    both sides cut alike and the bytes land."""
    import gpuxfer.kv.request_arrays as S
    src, dst = sides
    monkeypatch.setattr(S, "PACK_CHUNK_BYTES", 64)
    monkeypatch.setattr(S, "PACK_MAX_CHUNKS", 8)
    s_ids, d_ids = list(range(0, 40)), list(range(24, 64))         # 1280 bytes: 8 chunks of 160, not 20 of 64
    xs, xd = _prepare(src, dst, s_ids, d_ids)
    assert [c[:3] for c in xs._chunks] == [c[:3] for c in xd._chunks] == [(5 * i, 5 * i + 5, 160) for i in range(8)]
    monkeypatch.setattr(S, "PACK_MAX_CHUNKS", 2)                   # 768 per chunk: the 256-byte slot caps it
    # (a shape not seen before: a shape's chunks are kept with it)
    wide = _prepare(src, dst, list(range(0, 48)), list(range(16, 64)))[0]
    assert [c[:3] for c in wide._chunks][:2] == [(0, 8, 256), (8, 16, 256)]
    monkeypatch.setattr(S, "PACK_MAX_CHUNKS", 8)
    _move(src, dst, xs, xd, s_ids, d_ids, seed=4)
    small = _prepare(src, dst, [1, 2], [3, 4])[0]                 # 64 bytes: one chunk of at least 64
    assert [c[:3] for c in small._chunks] == [(0, 2, 64)]


def _spy(monkeypatch, plat) -> dict:
    calls: dict = {}
    for name in ("copy_async", "write_flag", "wait_flag", "launch", "launch_graph", "record_event",
                 "stream_wait_event"):
        orig = getattr(plat, name)

        def wrapped(*a, _orig=orig, _name=name, **kw):
            calls[_name] = calls.get(_name, 0) + 1
            return _orig(*a, **kw)
        monkeypatch.setattr(plat, name, wrapped)
    return calls


@pytest.mark.parametrize("sides", ["auto", "copy"], indirect=True)
def test_repeated_posts_replay_one_graph_per_parity(sides, plat, monkeypatch):
    """The same request posted again and again: the first post enqueues the operations, the second captures
    the graphs of the two parities, every later one replays; every post moves the current bytes, with signals
    by remote writes or by 8-byte copies. A
    replaying post is the upload, one graph launch (two on the source: its copies run on a lane of their own)
    and an event, whatever the number of chunks."""
    src, dst = sides
    counts = []
    for s_ids, d_ids, chunks in ((list(range(40, 60)), list(range(3, 23)), 3),    # both slots reused
                                 (list(range(5)), list(range(30, 35)), 1)):
        xs, xd = _prepare(src, dst, s_ids, d_ids)
        assert len(xs._chunks) == len(xd._chunks) == chunks
        for i in range(3):
            _move(src, dst, xs, xd, s_ids, d_ids, seed=i)
        calls = _spy(monkeypatch, plat)
        _move(src, dst, xs, xd, s_ids, d_ids, seed=9)
        monkeypatch.undo()
        counts.append(calls)
        for side, x in ((src, xs), (dst, xd)):
            shape = x._shape
            assert shape.posts == 4 and all(g is not None for g in shape.graphs)
    # both sides: the upload, a graph launch, the event; the source's lane: a graph launch, an event waited on
    assert counts[0] == counts[1] == {"copy_async": 2, "launch_graph": 3, "record_event": 3,
                                      "stream_wait_event": 1}, counts
    assert src.peer.pack_sent == dst.peer.pack_recv == 8


def test_interleaved_shapes_and_fresh_requests(sides):
    """Requests of two sizes interleaved (each a fresh prepare over other blocks): a shape's cached graph
    serves a request after one of another shape, parities alternate across shapes; a request of no
    blocks moves nothing and leaves the sequence alone."""
    src, dst = sides
    rng = np.random.default_rng(7)
    sizes = [9, 3, 9, 0, 3, 9]
    for i, n in enumerate(sizes):
        s_ids = rng.choice(64, n, replace=False).tolist()
        d_ids = rng.choice(64, n, replace=False).tolist()
        xs, xd = _prepare(src, dst, s_ids, d_ids, name=f"req-{i}")
        _move(src, dst, xs, xd, s_ids, d_ids, seed=100 + i)
    shapes = src.agent._pack.shapes
    assert sorted(sh.posts for sh in shapes.values()) == [2, 3] and len(dst.agent._pack.shapes) == 2
    assert all(any(g is not None for g in sh.graphs) for sh in shapes.values())
    assert src.peer.pack_sent == dst.peer.pack_recv == len([n for n in sizes if n])


@pytest.mark.parametrize("sides", ["copy"], indirect=True)
def test_stuck_peer_times_out_and_releases_queued_replays(sides):
    """After graphs are captured, the destination posts twice more with no source: the first wait times out
    naming the request, the agent fails and releases its words; both replays then run through (the
    stream drains), and every later call raises the error (the released replay's done() too)."""
    src, dst = sides
    s_ids, d_ids = list(range(5)), list(range(20, 25))
    xs, xd = _prepare(src, dst, s_ids, d_ids)
    for i in range(3):
        _move(src, dst, xs, xd, s_ids, d_ids, seed=i)
    dst.agent.timeout_s = 0.3
    h1 = xd.post()
    h2 = xd.post()                                  # queued behind the stuck one, the other parity
    with pytest.raises(TransferTimeout, match="req"):
        h1.wait(0.3)
    assert dst.agent.failed is not None
    assert dst.agent.platform.synchronize(dst.agent.stream, 60)
    with pytest.raises(TransferTimeout):            # completed, released: not a success
        h2.done()
    with pytest.raises(TransferTimeout):
        xd.post()
    assert src.agent.failed is None


# (source IDs, destination IDs the source pushes to; what the destination pulls into, from which source IDs):
# posted in this order on each side
_MISMATCHES = {
    "same shape, other IDs": [((1, 2, 3), (10, 11, 12), (10, 11, 13), (1, 2, 3))],
    "3 blocks against 1": [((1, 2, 3), (10, 11, 12), (10,), (1,))],
    "3 chunks against 1": [(tuple(range(20)), tuple(range(30, 50)), (30, 31), (0, 1))],
    "1 chunk against 3": [((0, 1), (30, 31), tuple(range(30, 50)), tuple(range(20)))],
    "posted in swapped order": [((1, 2), (10, 11), (20, 21), (5, 6)), ((5, 6), (20, 21), (10, 11), (1, 2))],
}


@pytest.mark.parametrize("case", list(_MISMATCHES))
def test_sides_posting_different_requests_both_fail_and_write_nothing(sides, case):
    """The two sides post requests that differ (same shape other IDs, other block counts, other numbers of
    chunks, two requests in swapped order): the verdict on the device refuses each, every handle on both sides
    raises TransferMismatch (nothing hangs: the waiting side is released, whatever its number of chunks), no
    byte of the destination's cache changes, both agents fail (every later call raises it) and still close."""
    src, dst = sides
    g = np.random.default_rng(11)
    src.cache.copy_(torch.from_numpy(g.integers(0, 256, tuple(src.cache.shape), dtype=np.uint8)))
    dst.cache.copy_(torch.from_numpy(g.integers(0, 256, tuple(dst.cache.shape), dtype=np.uint8)))
    before = dst.cache.clone()
    xs = [src.agent.prepare(src.peer, "push", local_blocks={"g": list(a)}, remote_blocks={"g": list(b)})
          for a, b, _, _ in _MISMATCHES[case]]
    xd = [dst.agent.prepare(dst.peer, "pull", local_blocks={"g": list(c)}, remote_blocks={"g": list(d)})
          for _, _, c, d in _MISMATCHES[case]]
    assert all(a.fingerprint != b.fingerprint for a, b in zip(xs, xd))
    if case == "posted in swapped order":       # the same two requests on each side
        assert [x.fingerprint for x in xs] == [x.fingerprint for x in reversed(xd)]
    handles = [x.post() for x in xd] + [x.post() for x in xs]
    for h in handles:
        with pytest.raises(TransferMismatch, match="did not pair up"):
            h.wait(60)
    assert torch.equal(dst.cache, before)
    for side in (src, dst):
        assert isinstance(side.agent.failed, TransferMismatch)
        with pytest.raises(TransferMismatch):
            side.agent.prepare(side.peer, "push", local_blocks={"g": [1]}, remote_blocks={"g": [2]})
        assert side.agent.platform.synchronize(side.agent.stream, 60)
    assert "refused it" in str(dst.agent.failed) and "request" in str(src.agent.failed)


def test_matching_requests_share_a_fingerprint_and_others_do_not(plat):
    """Both sides compute one fingerprint for the same request whatever order they registered their groups
    in; other IDs, another pairing of the same IDs, other layers or another group give another."""
    a, b = _Side(plat, "prefill", 0), _Side(plat, "decode", 1)
    extra = []
    try:
        for side, order in ((a, ("h", "k")), (b, ("k", "h"))):
            for gname in order:
                buf = plat.alloc(64 * 48, side.agent.device)
                extra.append(buf)
                flat = plat.as_tensor(buf)
                side.agent.register_group(gname, 16, {f"{gname}.0": flat[:64 * 32].view(64, 32),
                                                      f"{gname}.1": flat[64 * 32:].view(64, 16)})
        pa, pb = a.agent.add_peer(b.agent.metadata()), b.agent.add_peer(a.agent.metadata())

        def fp(side, peer, op, mine, theirs, **kw):
            return side.agent.prepare(peer, op, local_blocks=mine, remote_blocks=theirs, **kw).fingerprint
        req_s = {"h": [1, 2, 3], "k": [4, 5]}
        req_d = {"h": [7, 8, 9], "k": [10, 11]}
        base = fp(a, pa, "push", req_s, req_d)
        assert base == fp(b, pb, "pull", req_d, req_s) and 1 <= base < 1 << 61
        assert base == fp(a, pa, "push", {"k": [5, 4], "h": [3, 1, 2]}, {"k": [11, 10], "h": [9, 7, 8]})
        others = [fp(a, pa, "push", {"h": [1, 2, 3], "k": [4, 6]}, req_d),
                  fp(a, pa, "push", {"h": [2, 1, 3], "k": [4, 5]}, req_d),
                  fp(a, pa, "push", req_s, req_d, layers=(0, 1)),
                  fp(a, pa, "push", {"h": [1, 2, 3]}, {"h": [7, 8, 9]}),
                  fp(a, pa, "pull", req_d, req_s)]
        assert len({base, *others}) == len(others) + 1
    finally:
        b.close()
        a.close()
        for buf in extra:
            buf.close()


def test_posts_on_several_streams_run_in_order(sides, plat):
    """Pack posts of one agent on different streams still run one after another (its staging serves every
    transfer), so each request lands whole."""
    src, dst = sides
    s1, s2 = plat.create_stream(0), plat.create_stream(0)
    try:
        reqs = [(list(range(0, 9)), list(range(20, 29))), (list(range(30, 35)), list(range(50, 55)))]
        pairs = [_prepare(src, dst, s, d, name=f"r{i}") for i, (s, d) in enumerate(reqs)]
        g = np.random.default_rng(3)
        src.cache.copy_(torch.from_numpy(g.integers(0, 256, tuple(src.cache.shape), dtype=np.uint8)))
        want = dst.cache.clone()
        for s, d in reqs:
            want[d] = src.cache[s]
        hs = [xd.post() for _, xd in pairs]
        hs += [xs.post(stream) for (xs, _), stream in zip(pairs, (s1, s2))]
        for h in hs:
            h.wait(60)
        assert torch.equal(dst.cache, want)
    finally:
        s1.close()
        s2.close()


def test_refused_remote_write_means_copies(plat, monkeypatch):
    """A platform refusing the probe's remote stream write (CUDA 13.1+) leaves the pair on 8-byte copies."""
    monkeypatch.setenv("GPUXFER_FLAG_PATH", "auto")
    src, dst = _Side(plat, "prefill", 0), _Side(plat, "decode", 1)
    try:
        def refuse(stream, ptr, value):
            raise RuntimeError("remote stream writes are not supported")
        monkeypatch.setattr(plat, "write_flag", refuse)
        assert src.agent.add_peer(dst.agent.metadata()).remote_flags is False
        monkeypatch.undo()
        assert dst.agent.add_peer(src.agent.metadata()).remote_flags is True
    finally:
        dst.close()
        src.close()


def test_pack_rows_launchers_place_and_bound_rows():
    """pack/unpack over rows of one size: row j at (j - start) * row_bytes, a longer row cut there; the
    rows' places must fit the staging buffer."""
    from gpuxfer.kernels.launch import pack_launcher, unpack_launcher
    g = np.random.default_rng(1)
    pool = torch.from_numpy(g.integers(0, 256, 4096, dtype=np.uint8))
    descs = torch.tensor([[0, 0, 48], [1000, 0, 48], [2000, 0, 96], [3000, 0, 48]], dtype=torch.int64)
    descs[:, 1] = torch.tensor([100, 300, 500, 700])
    staging = torch.zeros(256, dtype=torch.uint8)
    pack_launcher(pool, staging, descs, start=1, end=4, staging_offset=16, row_bytes=48)()
    want = torch.cat([pool[1000:1048], pool[2000:2048], pool[3000:3048]])
    assert torch.equal(staging[16:16 + 144], want) and not staging[:16].any() and not staging[160:].any()
    dst = torch.zeros(4096, dtype=torch.uint8)
    unpack_launcher(staging, dst, descs, start=1, end=4, staging_offset=16, row_bytes=48)()
    for s, d in ((1000, 300), (2000, 500), (3000, 700)):
        assert torch.equal(dst[d:d + 48], pool[s:s + 48])
    assert not dst[548:596].any()                   # the 96-byte row was cut at 48
    with pytest.raises(BadInput, match="pass the end of the staging"):
        pack_launcher(pool, staging, descs, start=0, end=4, staging_offset=100, row_bytes=48)
    with pytest.raises(BadInput, match="not both"):
        unpack_launcher(staging, dst, descs, torch.zeros(5, dtype=torch.int64), start=0, end=1, row_bytes=48)
    with pytest.raises(BadInput, match="row_bytes"):
        pack_launcher(pool, staging, descs, start=0, end=1, row_bytes=0)


def _kernel_kinds() -> set:
    """The kinds of compiled kernels launched so far through a launcher (:meth:`DualKernel.launcher
    <gpuxfer.kernels._jit.DualKernel.launcher>`): a first launch of a kind loads it, which must come before a post."""
    import sys

    from gpuxfer.kernels._jit import DualKernel
    return {(mod, name, key) for mod, m in list(sys.modules.items()) if mod.startswith("gpuxfer.kernels")
            for name, k in vars(m).items() if isinstance(k, DualKernel) for key in k._fast}


@pytest.mark.gpu
def test_cuda_pack_graph_replays_move_every_byte():
    """Both sides on one CUDA device (two agents of one process, torch-allocated caches, 64 KiB slots: a
    request spans chunks in both slots): requests of two shapes interleaved, each posted again and again
    (op by op, the two captures, graph replays) on the agent's, a created and torch's current stream,
    every byte checked each time, and no post launching a kernel of a kind its prepare did not load; then the
    destination posts with no source: a timeout naming the request, and the released stream drains."""
    from _skips import platform_reason
    why = platform_reason("cuda")
    if why:
        pytest.skip(why)
    from gpuxfer.platforms import get_platform
    plat = get_platform("cuda")
    try:
        g = torch.Generator(device="cuda:0").manual_seed(5)
        src = {f"layers.{i}": torch.randint(-1000, 1000, (2, 64, 16, 2, 64), generator=g, device="cuda:0",
                                            dtype=torch.int16).view(torch.bfloat16) for i in range(3)}
        dst = {k: torch.zeros_like(v) for k, v in src.items()}
        a = KVAgent("pre", platform=plat, device=0, engine="pack", slot_bytes=64 << 10, timeout_s=60)
        b = KVAgent("dec", platform=plat, device=0, engine="pack", slot_bytes=64 << 10, timeout_s=60)
        own = plat.create_stream(0)
        try:
            a.register_group("full", 16, src)
            b.register_group("full", 16, dst)
            pa, pb = a.add_peer(b.metadata()), b.add_peer(a.metadata())
            shapes = {"long": (list(range(40, 64)), list(range(0, 24))), "short": ([5, 9, 2], [60, 30, 31])}
            streams = (None, own, plat.current_stream(0))
            xs = {}
            for k in range(10):
                name = "long" if k % 3 else "short"
                s_ids, d_ids = shapes[name]
                # both sides prepare before either posts (in one process a shape's first prepare loads its
                # kernels, its next one captures its graphs); some posts repeat a prepared request
                if k < 6 or name not in xs:
                    xs[name] = (a.prepare(pa, "push", local_blocks={"full": s_ids}, remote_blocks={"full": d_ids},
                                          name=name),
                                b.prepare(pb, "pull", local_blocks={"full": d_ids}, remote_blocks={"full": s_ids},
                                          name=name))
                for t in src.values():
                    t.view(torch.int16)[:, s_ids] += 1
                torch.cuda.synchronize()                # the agents' streams do not follow torch's
                x_src, x_dst = xs[name]
                loaded = _kernel_kinds()
                hd = x_dst.post(streams[k % 3])
                hs = x_src.post()
                hs.wait(60)
                hd.wait(60)
                assert _kernel_kinds() == loaded, "a post launched a kernel of a kind its prepare did not load"
                for layer in src:
                    assert torch.equal(dst[layer].view(torch.int16)[:, d_ids],
                                       src[layer].view(torch.int16)[:, s_ids]), (layer, k)
            assert len(xs["long"][0]._chunks) >= 3
            for agent, x in ((a, xs["long"][0]), (b, xs["long"][1])):
                assert all(gr is not None for gr in x._shape.graphs)
            b.timeout_s = 1.0
            h1, h2 = xs["long"][1].post(), xs["long"][1].post()
            with pytest.raises(TransferTimeout, match="long"):
                h1.wait(1.0)
            assert plat.synchronize(b.stream, 30)
            with pytest.raises(TransferTimeout):    # completed, released: not a success
                h2.done()
        finally:
            own.close()
            b.close()
            a.close()
    finally:
        plat.close()


@pytest.mark.gpu
def test_cuda_pack_rows_launchers():
    """The rows-of-one-size pack and unpack compiled: places, the cut of a longer row, 16-byte and odd sizes."""
    from _skips import platform_reason
    why = platform_reason("cuda")
    if why:
        pytest.skip(why)
    from gpuxfer.kernels.launch import pack_launcher, unpack_launcher
    g = torch.Generator(device="cuda:0").manual_seed(1)
    pool = torch.randint(0, 256, (1 << 20,), generator=g, device="cuda:0", dtype=torch.uint8)
    for row in (528, 584, 37):
        n = 300
        starts = torch.randperm(((1 << 20) - 2 * row) // row, generator=g, device="cuda:0")[:n] * row
        sizes = torch.full((n,), row, dtype=torch.int64, device="cuda:0")
        sizes[7] = 2 * row                              # cut at row bytes
        descs = torch.stack([starts, torch.arange(n, device="cuda:0") * row, sizes], dim=1).contiguous()
        staging = torch.zeros(n * row + 64, dtype=torch.uint8, device="cuda:0")
        pack_launcher(pool, staging, descs, start=2, end=n, staging_offset=64, row_bytes=row)()
        want = torch.cat([pool[int(s):int(s) + row] for s in starts[2:].tolist()])
        assert torch.equal(staging[64:64 + (n - 2) * row], want), row
        out = torch.zeros(n * row, dtype=torch.uint8, device="cuda:0")
        unpack_launcher(staging, out, descs, start=2, end=n, staging_offset=64, row_bytes=row)()
        assert torch.equal(out[2 * row:], want) and not out[:2 * row].any(), row


@pytest.mark.gpu
def test_cuda_pack_sides_posting_different_requests_both_fail():
    """On one CUDA device (two agents of one process): requests of one shape posted, the verdicts loaded and the
    graphs captured on matching posts; then the two sides post different requests of that shape (graph
    replays), and other block counts (operations one by one): both handles raise TransferMismatch, the
    destination's bytes do not change, both streams drain."""
    from _skips import platform_reason
    why = platform_reason("cuda")
    if why:
        pytest.skip(why)
    from gpuxfer.platforms import get_platform
    plat = get_platform("cuda")
    try:
        for case in ("same shape", "other counts"):
            g = torch.Generator(device="cuda:0").manual_seed(3)
            src = {f"layers.{i}": torch.randint(0, 255, (64, 4096), generator=g, device="cuda:0",
                                                dtype=torch.uint8) for i in range(2)}
            dst = {k: torch.randint(0, 255, v.shape, generator=g, device="cuda:0", dtype=torch.uint8)
                   for k, v in src.items()}
            a = KVAgent("pre", platform=plat, device=0, engine="pack", slot_bytes=64 << 10, timeout_s=60)
            b = KVAgent("dec", platform=plat, device=0, engine="pack", slot_bytes=64 << 10, timeout_s=60)
            try:
                a.register_group("full", 16, src)
                b.register_group("full", 16, dst)
                pa, pb = a.add_peer(b.metadata()), b.add_peer(a.metadata())
                s_ids, d_ids = list(range(40, 60)), list(range(0, 20))
                xa = a.prepare(pa, "push", local_blocks={"full": s_ids}, remote_blocks={"full": d_ids})
                xb = b.prepare(pb, "pull", local_blocks={"full": d_ids}, remote_blocks={"full": s_ids})
                for _ in range(3):
                    hb, ha = xb.post(), xa.post()
                    ha.wait(60)
                    hb.wait(60)
                other = list(range(20, 40)) if case == "same shape" else list(range(20, 23))
                xb2 = b.prepare(pb, "pull", local_blocks={"full": other},
                                remote_blocks={"full": s_ids[:len(other)]})
                torch.cuda.synchronize()
                before = {k: v.clone() for k, v in dst.items()}
                hb, ha = xb2.post(), xa.post()
                for h in (ha, hb):
                    with pytest.raises(TransferMismatch):
                        h.wait(60)
                assert plat.synchronize(a.stream, 60) and plat.synchronize(b.stream, 60)
                torch.cuda.synchronize()
                assert all(torch.equal(dst[k], before[k]) for k in dst), case
            finally:
                b.close()
                a.close()
    finally:
        plat.close()


def _gated(fn, gate):
    """``fn``, run only once ``gate`` is set (a launch the test holds back)."""
    def run(*a):
        assert gate.wait(60)
        return fn(*a)
    return run


def _random_request(src, dst, seed: int):
    """The source's cache filled with random bytes and a request of 3 chunks of 8 blocks (slots 0, 1, 0) prepared on
    both sides: ``(source IDs, destination IDs, source transfer, destination transfer, the destination's cache)``."""
    g = np.random.default_rng(seed)
    src.cache.copy_(torch.from_numpy(g.integers(0, 256, tuple(src.cache.shape), dtype=np.uint8)))
    s_ids, d_ids = list(range(24)), list(range(30, 54))
    xs, xd = _prepare(src, dst, s_ids, d_ids)
    assert len(xs._chunks) == 3
    return s_ids, d_ids, xs, xd, dst.cache.clone()


def test_a_source_failing_mid_transfer_never_lets_the_destination_report_other_bytes(sides, monkeypatch):
    """The source's handle times out while the destination's stream has not yet unpacked chunk 0 (a busy
    destination): the source fails and releases its words, and its queued work runs on past the hand-offs that
    guard the destination's staging (its lane's wait for FREE passes: chunk 2 is copied into slot 0 before chunk 0
    was unpacked from it, then signalled as available). With the source's lane slow to reach its closing verdict,
    the destination then unpacks every chunk. Its handle must raise, not report success over chunk 2's bytes in
    chunk 0's blocks."""
    import threading

    import gpuxfer.kernels.blocks as blocks
    import gpuxfer.kernels.launch as launch
    from gpuxfer.kv.control import AVAIL, FREE
    src, dst = sides
    busy, slow_lane = threading.Event(), threading.Event()
    first = []

    def unpack(*a, _made=launch.unpack_launcher, **kw):       # the destination's first unpack waits: it is busy
        fn = _made(*a, **kw)
        if first:
            return fn
        first.append(fn)
        return _gated(fn, busy)

    def verdict(*a, _made=blocks.verdict_launcher, **kw):      # the source lane's closing verdict comes late
        fn = _made(*a, **kw)
        closing = a[0].data_ptr() in (src.agent.flags.word(FREE), src.agent.flags.word(FREE + 1))
        return _gated(fn, slow_lane) if closing else fn
    monkeypatch.setattr(launch, "unpack_launcher", unpack)
    monkeypatch.setattr(blocks, "verdict_launcher", verdict)
    s_ids, d_ids, xs, xd, before = _random_request(src, dst, 5)
    hd, hs = xd.post(), xs.post()
    try:
        with pytest.raises(TransferTimeout):
            hs.wait(0.5)                    # the source fails: its words are released
        # its lane then copies chunk 2 into slot 0 and signals it (then waits on its closing verdict)
        assert dst.agent.flags.wait_host(AVAIL, 3, 60, flag="chunk 2 signalled") >= 3
        busy.set()
        with pytest.raises(TransferMismatch, match="released.*may hold other bytes"):
            hd.wait(60)
    finally:
        busy.set()
        slow_lane.set()
    assert torch.equal(dst.cache[d_ids[:8]], src.cache[s_ids[16:]])       # what the error warns of


def test_a_destination_failing_mid_transfer_never_lets_the_source_report_success(sides, monkeypatch):
    """The destination's handle times out after it unpacked chunk 0, while the source is still packing chunk 1 (a
    busy source): the destination fails and releases its words, and its queued work runs on over chunks that never
    came (its waits for AVAIL pass: it unpacks its slots as they are and signals them free). The source then
    packs and copies the rest and its closing verdict sees every chunk freed. Its handle must raise, not report
    success for a push whose bytes did not land."""
    import threading

    import gpuxfer.kernels.launch as launch
    src, dst = sides
    busy = threading.Event()
    made = []

    def pack(*a, _made=launch.pack_launcher, **kw):            # the source's second pack waits: it is busy
        fn = _made(*a, **kw)
        made.append(fn)
        return _gated(fn, busy) if len(made) == 2 else fn
    monkeypatch.setattr(launch, "pack_launcher", pack)
    s_ids, d_ids, xs, xd, before = _random_request(src, dst, 6)
    hd, hs = xd.post(), xs.post()
    try:
        with pytest.raises(TransferTimeout):
            hd.wait(0.5)                    # the destination fails: its words are released
        assert dst.agent.platform.synchronize(dst.agent.stream, 60)     # it ran on over chunks that never came
    finally:
        busy.set()
    with pytest.raises(TransferMismatch, match="released.*may hold other bytes"):
        hs.wait(60)
    assert not torch.equal(dst.cache[d_ids], src.cache[s_ids])     # (chunks 1 and 2 did not land)


def test_a_prepare_loads_every_kernel_kind_its_posts_launch(sides, monkeypatch):
    """What a compiled platform launches at a shape's first prepare -- the verdict kernel in every kind (equal or
    not, descriptors or None, the fingerprint's alignment) the shape's posts launch, over zeros -- run here
    interpreted: it moves nothing, and the transfer then moves every byte."""
    import gpuxfer.kernels.blocks as blocks
    src, dst = sides
    from gpuxfer.kv.control import STATUS
    warm, real = set(), set()
    status = {side.agent.flags.word(STATUS) for side in sides}     # a real verdict's status words: its agent's

    def verdict(*a, _made=blocks.verdict_launcher, **kw):
        kind = (kw["equal"], a[5] is None, a[1].data_ptr() % 16 == 0, kw.get("only_refused", False))
        (real if a[2].data_ptr() in status else warm).add(kind)    # (the warm-up's land in a buffer of zeros)
        return _made(*a, **kw)
    monkeypatch.setattr(blocks, "verdict_launcher", verdict)
    monkeypatch.setattr(src.agent.platform, "kernels_interpreted", False)
    s_ids, d_ids, xs, xd, before = _random_request(src, dst, 7)
    monkeypatch.undo()
    assert len(real) == 4 and real <= warm
    assert xs.route.pack_warm == {(True, xs._shape.fp_ptr % 16 == 0)}
    assert xd.route.pack_warm == {(False, xd._shape.fp_ptr % 16 == 0)}
    assert torch.equal(dst.cache, before)                   # the warm-up moved nothing
    hd, hs = xd.post(), xs.post()
    hs.wait(60)
    hd.wait(60)
    assert torch.equal(dst.cache[d_ids], src.cache[s_ids])
