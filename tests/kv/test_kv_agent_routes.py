"""KVAgent's routes: the ring of slots (reuse, growth, a full ring), interleaved and forged requests,
CUDA slot graphs, notification order, refused short peers, the request pool, peers removed mid-build,
and warm-up.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from gpuxfer.errors import BadMetadata, TransferTimeout
from gpuxfer.kv.agent import KVAgent

from _agent_arena import Arena, connect, reblob, same_bytes, vllm_layers


# ----------------------------------------------------------------------------- the route's ring of slots


def _ring_pair(pre, dec, a0, a1, blocks=24):
    src = vllm_layers(a0, 2, blocks, 2, seed=1)
    dst = vllm_layers(a1, 2, blocks, 2, seed=70)
    pre.register_group("full", 2, src)
    dec.register_group("full", 2, dst)
    return src, dst, dec.add_peer(pre.metadata())


def _route_slots(agent):
    (route,) = [r for r in agent._routes.routes.values() if r.slots]
    return route.slots


def test_ring_reuses_its_slot_and_grows_it(pair, monkeypatch):
    """Posts on one stream reuse one slot; a request larger than the slot remakes it larger (geometrically) and
    still moves every byte; a post on another stream while the slot is busy there takes a second slot."""
    import gpuxfer.kv.posting as posting
    monkeypatch.setattr(posting, "MIN_SLOT_ROWS", 4)
    monkeypatch.setattr(posting, "MIN_SLOT_ENTRIES", 8)
    pre, dec, a0, a1 = pair
    src, dst, peer = _ring_pair(pre, dec, a0, a1)
    small = dec.prepare(peer, "pull", local_blocks={"full": [3]}, remote_blocks={"full": [0]})
    small.post().wait(60)
    small.post().wait(60)
    (slot,) = _route_slots(dec)
    blocks = dec._poster.blocks                             # (GPUXFER_KV_COPY=blocks: slots hold no descriptors)
    assert slot.rows == (0 if blocks else 4) and small.descriptors == 4          # 2 layers x K, V
    big_d, big_s = list(range(5, 15)), list(range(10, 20))
    big = dec.prepare(peer, "pull", local_blocks={"full": big_d}, remote_blocks={"full": big_s})
    big.post().wait(60)
    (grown,) = _route_slots(dec)
    assert grown is not slot and (blocks or grown.rows >= max(big.descriptors, 8)) and grown.entries >= 8
    for name in src:
        assert same_bytes(dst[name][:, big_d], src[name][:, big_s]) and same_bytes(dst[name][:, 3], src[name][:, 0])
    plat = dec.platform
    gate = plat.alloc(64, 1)
    held = plat.create_stream(1)
    try:
        plat.memset_async(held, gate.ptr, 0, 64)
        plat.wait_flag(held, gate.ptr, 1)                   # the first stream is held until the gate opens
        h1 = small.post(held)
        h2 = big.post()                                     # the agent's stream: the held slot is busy
        h2.wait(60)
        assert len(_route_slots(dec)) == 2 and not h1.done()
        plat.host_write_flag(gate.ptr, 1, 1)
        h1.wait(60)
        small.post().wait(60)                               # a free slot again: no third one
        assert len(_route_slots(dec)) == 2
    finally:
        plat.synchronize(held, 30)
        held.close()
        gate.close()


def test_full_ring_waits_for_a_slot_then_times_out(pair, monkeypatch):
    """With every slot busy on other streams, a post waits for the least recently used one: it proceeds once
    that completes, and raises TransferTimeout past the agent's timeout."""
    import gpuxfer.kv.posting as posting
    monkeypatch.setattr(posting, "RING_SLOTS", 1)
    pre, dec, a0, a1 = pair
    src, dst, peer = _ring_pair(pre, dec, a0, a1)
    x = dec.prepare(peer, "pull", local_blocks={"full": [3, 4]}, remote_blocks={"full": [0, 1]})
    plat = dec.platform
    gate = plat.alloc(64, 1)
    held = plat.create_stream(1)
    try:
        plat.memset_async(held, gate.ptr, 0, 64)
        plat.wait_flag(held, gate.ptr, 1)
        h1 = x.post(held)
        dec.timeout_s = 0.2
        with pytest.raises(TransferTimeout, match="slots of a route still run earlier posts"):
            x.post()
        dec.timeout_s = 60
        plat.host_write_flag(gate.ptr, 1, 1)
        x.post().wait(60)                   # waits for the held post, then runs in the same slot
        assert h1.done() and len(_route_slots(dec)) == 1
        for name in src:
            assert same_bytes(dst[name][:, [3, 4]], src[name][:, [0, 1]])
    finally:
        plat.synchronize(held, 30)
        held.close()
        gate.close()


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_interleaved_posts_of_many_requests_hypothesis(plat, data, monkeypatch):
    """Several prepared requests (disjoint destinations, sizes drawn, so slots are remade larger) posted again
    and again, interleaved over three streams: every destination block holds its source, nothing else moved."""
    import gpuxfer.kv.posting as posting
    monkeypatch.setattr(posting, "MIN_SLOT_ROWS", 4)
    monkeypatch.setattr(posting, "MIN_SLOT_ENTRIES", 8)
    a0, a1 = Arena(plat, 0), Arena(plat, 1)
    pre = KVAgent("p", platform=plat, device=0, engine="triton")
    dec = KVAgent("d", platform=plat, device=1, engine="triton")
    streams = [None, plat.create_stream(1), plat.create_stream(1)]
    try:
        blocks = 24
        src, dst, peer = _ring_pair(pre, dec, a0, a1, blocks)
        before = {k: v.clone() for k, v in dst.items()}
        free = list(np.random.default_rng(data.draw(st.integers(0, 1 << 20), label="seed")).permutation(blocks))
        xfers, moved = [], []
        for _ in range(data.draw(st.integers(2, 4), label="requests")):
            n = data.draw(st.integers(1, 6), label="blocks")
            d_ids, free = [int(b) for b in free[:n]], free[n:]
            s_ids = data.draw(st.lists(st.integers(0, blocks - 1), min_size=n, max_size=n), label="sources")
            xfers.append(dec.prepare(peer, "pull", local_blocks={"full": d_ids}, remote_blocks={"full": s_ids}))
            moved.append((d_ids, s_ids))
        order = data.draw(st.lists(st.tuples(st.integers(0, len(xfers) - 1), st.integers(0, 2)), min_size=len(xfers),
                                   max_size=8), label="posts")
        order += [(i, 0) for i in range(len(xfers))]        # every request at least once
        handles = [xfers[i].post(streams[k]) for i, k in order]
        for h in handles:
            h.wait(60)
        assert 1 <= len(_route_slots(dec)) <= posting.RING_SLOTS
        for name in src:
            want = before[name].clone()
            for d_ids, s_ids in moved:
                want[:, d_ids] = src[name][:, s_ids]
            assert same_bytes(dst[name], want), name
    finally:
        for s in streams[1:]:
            plat.synchronize(s, 30)
            s.close()
        dec.close()
        pre.close()
        a0.close()
        a1.close()


def test_forged_request_stays_inside_the_buffers(pair):
    """A prepared request's array rewritten with hostile values (first rows and counts past the slot, negative
    and huge offsets, IDs out of range) still completes, writes nowhere but the registered destination layers
    (the bytes around them keep their values, the source side is untouched), and the next honest post moves
    every byte."""
    pre, dec, a0, a1 = pair
    rng = np.random.default_rng(9)
    for arena in (a0, a1):          # known bytes everywhere, around the layers too
        arena.flat.copy_(torch.from_numpy(rng.integers(0, 256, arena.flat.numel(), dtype=np.uint8)))
    src, dst, peer = _ring_pair(pre, dec, a0, a1)
    x = dec.prepare(peer, "pull", local_blocks={"full": [1, 2, 3]}, remote_blocks={"full": [4, 5, 6]})
    x.post().wait(60)
    spans = [(t.data_ptr() - a1.flat.data_ptr(), t.numel() * t.element_size()) for t in dst.values()]
    src_bytes, dst_bytes = a0.flat.clone(), a1.flat.clone()
    honest = x._array.copy()
    (route,) = [r for r in dec._routes.routes.values() if r.slots]
    P, G = len(route.plane_group), len(route.groups)
    head = P + 1 + 3 * G
    big, neg = (1 << 63) - 1, -(1 << 63)
    forged = [
        np.r_[[0] * P, big, [big] * G, honest[P + 1 + G:]],                              # counts past the slot
        np.r_[[neg, big // 2] * (P // 2) + [5] * (P % 2), honest[P:P + 1], [1 << 40] * G, [-7] * G, [big] * G,
              honest[head:]],                                                            # first rows, offsets
        np.r_[honest[:head], rng.integers(-(1 << 62), 1 << 62, honest.size - head)],     # IDs anywhere
    ]
    for f in forged:
        x._array[:] = np.asarray(f, dtype=np.int64)[:x._array.size]
        x.post().wait(60)
        assert torch.equal(a0.flat, src_bytes)
        now = a1.flat.clone()
        outside = torch.ones(now.numel(), dtype=torch.bool)
        for off, n in spans:
            outside[off:off + n] = False
        assert torch.equal(now[outside], dst_bytes[outside])
    for name in dst:                # scribbled blocks are overwritten by an honest post
        dst[name].view(torch.uint8).fill_(0)
    x._array[:] = honest
    x.post().wait(60)
    for name in src:
        assert same_bytes(dst[name][:, [1, 2, 3]], src[name][:, [4, 5, 6]])


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["pull", "push"])
def test_cuda_slot_graphs_grow_interleave_and_stay_in_bounds(op, monkeypatch):
    """On CUDA: posts replay the slot's graph (captured once), a larger request remakes the slot, requests
    interleaved over three streams all land, and a forged request array writes nothing outside the
    destination's layers (the bytes around them and the whole source side keep their values); honest
    posts afterwards move every byte again."""
    from _skips import platform_reason
    why = platform_reason("cuda")
    if why:
        pytest.skip(why)
    import gpuxfer.kv.posting as posting
    from gpuxfer.platforms import get_platform
    monkeypatch.setattr(posting, "MIN_SLOT_ROWS", 8)
    monkeypatch.setattr(posting, "MIN_SLOT_ENTRIES", 16)
    plat = get_platform("cuda")
    layers, blocks, guard = 3, 64, 1 << 16
    shape = (2, blocks, 16, 2, 64)
    n = int(np.prod(shape)) * 2
    g = torch.Generator(device="cuda:0").manual_seed(5)
    arenas = [torch.randint(0, 256, (layers * n + 2 * guard,), generator=g, device="cuda:0", dtype=torch.uint8)
              for _ in range(2)]
    caches = [{f"layers.{i}": ar[guard + i * n:guard + (i + 1) * n].view(torch.bfloat16).view(shape)
               for i in range(layers)} for ar in arenas]
    src, dst = caches
    a = KVAgent("pre", platform=plat, device=0, engine="triton")
    b = KVAgent("dec", platform=plat, device=0, engine="triton")
    own = plat.create_stream(0)
    try:
        a.register_group("full", 16, src)
        b.register_group("full", 16, dst)
        agent = b if op == "pull" else a
        peer = agent.add_peer((a if op == "pull" else b).metadata())
        reqs = [([0, 1], [33, 7]), (list(range(10, 50)), list(range(60, 20, -1)))]
        xs = []
        for d_ids, s_ids in reqs:
            mine, theirs = (d_ids, s_ids) if op == "pull" else (s_ids, d_ids)
            xs.append(agent.prepare(peer, op, local_blocks={"full": mine}, remote_blocks={"full": theirs}))

        def check_moved():
            for name in src:
                for d_ids, s_ids in reqs:
                    assert torch.equal(dst[name].view(torch.int16)[:, d_ids], src[name].view(torch.int16)[:, s_ids])

        xs[0].post().wait(60)
        (route,) = [r for r in agent._routes.routes.values() if r.slots]
        (first,) = route.slots
        assert agent.graphs and first.graph is not None
        xs[1].post().wait(60)
        # (a slot grows by what the larger request needs: descriptor rows, or its entries without a table)
        grown = route.slots[0]
        assert grown is not first and (grown.entries >= xs[1]._array.size if grown.blocks
                                       else grown.rows >= xs[1].descriptors)
        streams = (None, own, plat.current_stream(0))
        handles = [xs[k % 2].post(streams[k % 3]) for k in range(7)]
        for h in handles:
            h.wait(60)
        check_moved()
        assert agent.graphs and 1 <= len(route.slots) <= posting.RING_SLOTS
        torch.cuda.synchronize()
        before = [ar.clone() for ar in arenas]
        x = xs[1]
        honest = x._array.copy()
        P, G = len(route.plane_group), len(route.groups)
        head = P + 1 + 3 * G
        big = (1 << 63) - 1
        rng = np.random.default_rng(1)
        for forged in (np.r_[[0] * P, big, [big] * G, honest[P + 1 + G:]],
                       np.r_[[-(1 << 63)] * (P + 1), [1 << 40] * G, [-7] * G, [big] * G, honest[head:]],
                       np.r_[honest[:head], rng.integers(-(1 << 62), 1 << 62, honest.size - head)]):
            x._array[:] = np.asarray(forged, dtype=np.int64)[:x._array.size]
            x.post().wait(60)
            torch.cuda.synchronize()
            assert torch.equal(arenas[0], before[0])            # the source side: read only
            assert torch.equal(arenas[1][:guard], before[1][:guard])
            assert torch.equal(arenas[1][-guard:], before[1][-guard:])
        x._array[:] = honest
        for xx in xs:
            xx.post(own).wait(60)
        check_moved()
    finally:
        plat.synchronize(own, 30)
        own.close()
        b.close()
        a.close()


def _cuda_order_and_close():
    """On CUDA: a notification posted on a second stream waits for the slot's earlier post (held by a gate);
    closing a pack destination whose source never posts, its post on the caller's stream, releases that
    stream's waits and returns. Every kernel is loaded (and every slot made) before a stream is held: a
    kernel's first launch waits for the device's queues. A timer opens the gate whatever happens."""
    import threading
    from gpuxfer.platforms import get_platform
    plat = get_platform("cuda")
    try:
        g = torch.Generator(device="cuda:0").manual_seed(5)
        src = {"layers.0": torch.randint(-1000, 1000, (2, 8, 16, 2, 64), generator=g, device="cuda:0",
                                         dtype=torch.int16)}
        dst = {k: torch.zeros_like(v) for k, v in src.items()}
        gate = plat.alloc(64, 0)
        opener = threading.Timer(30, plat.host_write_flag, (gate.ptr, 1, 0))
        s1, s2, s3 = (plat.create_stream(0) for _ in range(3))
        a, b = KVAgent("pre", platform=plat, device=0, engine="triton"), KVAgent("dec", platform=plat, device=0, engine="triton")
        c = KVAgent("pre-pack", platform=plat, device=0, engine="pack", timeout_s=0.5)
        d = KVAgent("dec-pack", platform=plat, device=0, engine="pack", timeout_s=0.5)
        try:
            a.register_group("full", 16, src)
            b.register_group("full", 16, dst)
            torch.cuda.synchronize()
            peer = a.add_peer(b.metadata())
            x1 = a.prepare(peer, "push", local_blocks={"full": [0]}, remote_blocks={"full": [1]}, notify_slot=4)
            x2 = a.prepare(peer, "push", local_blocks={"full": [2]}, remote_blocks={"full": [3]}, notify_slot=4)
            warm = [x1.post(s1), x2.post(s2)]               # loads the kernels, makes a slot per stream
            for h in warm:
                h.wait(60)
            assert b.notification(4) == 2
            plat.memset_async(s1, gate.ptr, 0, 64)
            assert plat.synchronize(s1, 60)
            plat.wait_flag(s1, gate.ptr, 1)
            opener.start()
            h1, h2 = x1.post(s1), x2.post(s2)
            assert (h1.notify_value, h2.notify_value) == (3, 4)
            assert not plat.event_wait(h2.event, 0.2) and b.notification(4) == 2
            plat.host_write_flag(gate.ptr, 1, 0)
            h2.wait(60)
            assert h1.done() and b.notification(4) == 4
            assert torch.equal(dst["layers.0"][:, [1, 3]], src["layers.0"][:, [0, 2]])
            c.register_group("full", 16, {k: v.clone() for k, v in src.items()})
            d.register_group("full", 16, {k: torch.zeros_like(v) for k, v in src.items()})
            torch.cuda.synchronize()
            pd, pc = d.add_peer(c.metadata()), c.add_peer(d.metadata())
            xd = d.prepare(pd, "pull", local_blocks={"full": [0]}, remote_blocks={"full": [1]})
            xs = c.prepare(pc, "push", local_blocks={"full": [1]}, remote_blocks={"full": [0]})
            done = [xd.post(s3), xs.post()]                 # a whole transfer first: every kernel loaded
            for h in done:
                h.wait(60)
            h = xd.post(s3)                                 # its source never posts this one
            d.close()
            assert h.done() and d.flags is None
        finally:
            opener.cancel()
            plat.host_write_flag(gate.ptr, 1, 0)
            for ag in (d, c, b, a):
                ag.close()
            for s in (s1, s2, s3):
                plat.synchronize(s, 30)
                s.close()
            gate.close()
    finally:
        plat.close()
    return "ok"


@pytest.mark.gpu
def test_cuda_notifications_in_order_and_close_releases_a_stuck_pack_post(spawner):
    """:func:`_cuda_order_and_close` in a process of its own (killed if it does not finish in time)."""
    from _skips import platform_reason
    why = platform_reason("cuda")
    if why:
        pytest.skip(why)
    assert spawner.start(_cuda_order_and_close, name="order-and-close", hard_exit=True).result(100) == "ok"


def test_a_peer_whose_flag_words_or_staging_are_smaller_than_claimed_is_refused(plat, pack_pair, monkeypatch):
    """Metadata claims sizes; where the platform can tell what a mapping really holds (CUDA: the address
    range of the IPC mapping), flag words or staging smaller than claimed are refused (the flag writes and
    chunk copies would land past them), as allocations are. The peer's pid and uid are forged to another
    process's agent's so the handles are opened as a remote peer's."""
    import json
    pre, dec, a0, a1 = pack_pair
    body = json.loads(dec.metadata()[12:])
    body["pid"] += 1
    body["uid"] = "f" * 32
    forged = reblob(body)
    for name, claimed in (("flag words", body["control"]["nbytes"]), ("staging", body["staging"]["nbytes"])):
        real = plat.allocation_range

        def short(ptr, device, claimed=claimed):
            got = real(ptr, device)
            return (ptr, claimed - 64) if got is None or got[1] == claimed else got
        monkeypatch.setattr(plat, "allocation_range", short)
        with pytest.raises(BadMetadata, match=f"claims {name} of {claimed} bytes"):
            pre.add_peer(forged)
        monkeypatch.undo()
    pre.add_peer(forged)                    # the sizes as claimed: added


def test_request_pool_reaps_only_when_none_is_free():
    """A prepare takes a free host array without looking at posted transfers; with none free, the reap runs
    first and what it gives back is taken instead of a new array."""
    from gpuxfer.kv.triton_transfer import _RequestPool
    pool = _RequestPool(pinned=False)
    calls = []
    first, arr = pool.take(100, lambda: calls.append("reap"))
    assert calls == ["reap"] and arr.shape == (100,)       # nothing free: reaped, then made
    pool.give(first)
    again, _ = pool.take(200, lambda: calls.append("reap"))
    assert again is first and calls == ["reap"]             # a free one (same capacity): no reap
    held = again
    got, _ = pool.take(300, lambda: pool.give(held))          # the reap gives one back: it is taken
    assert got is held


def test_a_peer_named_by_a_str_subclass_is_found(pair):
    """``peer`` as its name: any ``str`` (a subclass too, e.g. numpy's ``str_`` from a config) names it."""
    pre, dec, a0, a1 = pair
    pre.register_group("g", 4, [a0.tensor((4, 4, 8))])
    dec.register_group("g", 4, [a1.tensor((4, 4, 8))])
    connect(pre, dec)
    x = dec.prepare(np.str_("prefill"), "pull", local_blocks={"g": [0]}, remote_blocks={"g": [1]})
    assert x.peer is dec.peer("prefill")


def test_a_peer_removed_while_its_route_is_built_leaves_no_route(pair, monkeypatch):
    """remove_peer running while another call builds a route to that peer: the route is not cached, and the
    peer added again under the same name gets routes of its own (never the removed peer's mappings)."""
    pre, dec, a0, a1 = pair
    pre.register_group("g", 4, [a0.tensor((4, 4, 8))])
    dec.register_group("g", 4, [a1.tensor((4, 4, 8))])
    connect(pre, dec)
    old = dec.peer("prefill")
    dec._routes.routes.clear()
    build = dec._routes.build
    built = []

    def build_then_remove(peer, *a, **kw):
        route = build(peer, *a, **kw)
        if peer is old and old.name in dec.peers:
            built.append(route)
            dec.remove_peer(old.name)           # (as another thread would, mid-build)
        return route

    monkeypatch.setattr(dec._routes, "build", build_then_remove)
    dec.prepare(old, "pull", local_blocks={"g": [0]}, remote_blocks={"g": [1]})
    assert built and not any(r is built[0] for r in dec._routes.routes.values())
    monkeypatch.undo()
    new = dec.add_peer(pre.metadata())
    x = dec.prepare("prefill", "pull", local_blocks={"g": [0]}, remote_blocks={"g": [1]})
    assert x.peer is new and x.route is not built[0]


@pytest.mark.parametrize("engine, device_ids", [("triton", False), ("triton", True), ("copy_engine", False),
                                               ("pack", False)])
def test_warm_up_changes_no_byte_and_leaves_no_peer(plat, engine, device_ids):
    """warm_up's pull of block 0 onto itself through a mirror agent (with host IDs, and with device IDs too):
    every cache byte as before, the mirror gone, a real request with a peer afterwards still moves the right
    bytes; pack agents do nothing."""
    a0, a1 = Arena(plat, 0), Arena(plat, 1)
    pre = KVAgent("prefill", platform=plat, device=0, timeout_s=60, engine=engine)
    dec = KVAgent("decode", platform=plat, device=1, timeout_s=60, engine=engine)
    try:
        src, dst = vllm_layers(a0, 2, 6, 4, seed=1), vllm_layers(a1, 2, 6, 4, seed=50)
        pre.register_group("full", 4, src)
        dec.register_group("full", 4, dst)
        before = {k: v.clone() for k, v in dst.items()}
        took = dec.warm_up(device_ids=device_ids)
        assert took == 0.0 if engine == "pack" else took > 0.0
        assert dec.peers == {} and dec._routes.routes == {}
        for name in dst:
            assert same_bytes(dst[name], before[name])
        if engine == "pack":
            return
        peer = dec.add_peer(pre.metadata())
        dec.prepare(peer, "pull", local_blocks={"full": [2, 5]}, remote_blocks={"full": [4, 1]}).post().wait(60)
        for name in src:
            assert same_bytes(dst[name][:, [2, 5]], src[name][:, [4, 1]])
            assert same_bytes(dst[name][:, [0, 1, 3, 4]], before[name][:, [0, 1, 3, 4]])
    finally:
        dec.close()
        pre.close()
        a0.close()
        a1.close()
