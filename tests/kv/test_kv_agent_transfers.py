"""KVAgent moving requests by block ID: every byte, block sizes that differ, layer ranges, reposts and
notifications, host costs per post, the expansion against the numpy plans, and layer descriptions.

CPU tests run on the host emulation (Triton's interpreter): tiny caches, few blocks; two agents in one
process pair up without IPC (the ``pair`` fixture, conftest.py).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from gpuxfer.errors import BadInput, TransferTimeout
from gpuxfer.kv.agent import KVAgent
from gpuxfer.bench.kv.model.blocktable import burst_tables
from gpuxfer.kv.layers import KVLayerSpec, describe_layer
from gpuxfer.bench.kv.model.layout import layout_for_burst, layout_groups
from gpuxfer.bench.kv.model.plan import request_plan

from _agent_arena import Arena, connect, same_bytes, token_oracle, vllm_layers


# ----------------------------------------------------------------------------- moving requests


@pytest.mark.parametrize("op", ["pull", "push"])
def test_move_request_every_byte(pair, op):
    pre, dec, a0, a1 = pair
    src = vllm_layers(a0, 2, 6, 4, seed=1)
    dst = vllm_layers(a1, 2, 6, 4, seed=50)
    slab_s = a0.tensor((5, 4, 584), seed=7)           # DSV4-style 584-byte slots, one piece per block
    slab_d = a1.tensor((5, 4, 584), seed=8)
    pre.register_group("full", 4, src)
    dec.register_group("full", 4, dst)
    pre.register_group("mla", 4, {"layers.0.mla": slab_s})
    dec.register_group("mla", 4, {"layers.0.mla": slab_d})
    p_of_dec, p_of_pre = connect(pre, dec)
    s_ids, d_ids = {"full": [4, 0, 2], "mla": [1, 3]}, {"full": [1, 5, 3], "mla": [4, 0]}
    if op == "pull":
        x = dec.prepare(p_of_dec, "pull", local_blocks=d_ids, remote_blocks=s_ids, name="req-7")
    else:
        x = pre.prepare(p_of_pre, "push", local_blocks=s_ids, remote_blocks=d_ids, name="req-7")
    before = {k: v.clone() for k, v in dst.items()}
    h = x.post()
    h.wait(60)
    assert h.done() and h.name == "req-7"
    assert x.descriptors == 2 * 2 * 3 + 2
    for name in src:
        for s, d in zip(s_ids["full"], d_ids["full"]):
            assert same_bytes(dst[name][:, d], src[name][:, s])
        untouched = [b for b in range(6) if b not in d_ids["full"]]
        assert same_bytes(dst[name][:, untouched], before[name][:, untouched])
    for s, d in zip(s_ids["mla"], d_ids["mla"]):
        assert same_bytes(slab_d[d], slab_s[s])


@pytest.mark.parametrize("op", ["pull", "push"])
@pytest.mark.parametrize("bs, bd", [(8, 2), (2, 8)])
def test_block_sizes_differ_tokens_match(pair, op, bs, bd):
    """Prefill blocks of 8 tokens, decode blocks of 2 (and the reverse): tokens land in order."""
    pre, dec, a0, a1 = pair
    nb_s, nb_d = 64 // bs, 64 // bd
    src = a0.tensor((2, nb_s, bs, 3, 2), torch.float16, seed=3)
    dst = a1.tensor((2, nb_d, bd, 3, 2), torch.float16, seed=4)
    pre.register_group("g", bs, {"l0": src})
    dec.register_group("g", bd, {"l0": dst})
    p_of_dec, p_of_pre = connect(pre, dec)
    tokens = 3 * max(bs, bd)
    rng = np.random.default_rng(0)
    s_ids = rng.permutation(nb_s)[:-(-tokens // bs)]
    d_ids = rng.permutation(nb_d)[:-(-tokens // bd)]
    expect = token_oracle(src, dst, s_ids, d_ids, bs, bd, kv_first=True)
    if op == "pull":
        h = dec.transfer(p_of_dec, "pull", local_blocks={"g": d_ids}, remote_blocks={"g": s_ids})
    else:
        h = pre.transfer(p_of_pre, "push", local_blocks={"g": s_ids}, remote_blocks={"g": d_ids})
    h.wait(60)
    assert np.array_equal(dst.numpy().view(np.uint8), expect.view(np.uint8))


def test_layer_range_moves_only_those_layers(pair):
    pre, dec, a0, a1 = pair
    src = vllm_layers(a0, 3, 4, 2, seed=10)
    dst = vllm_layers(a1, 3, 4, 2, seed=20)
    before = {k: v.clone() for k, v in dst.items()}
    pre.register_group("full", 2, src)
    dec.register_group("full", 2, dst)
    p_of_dec, _ = connect(pre, dec)
    x = dec.prepare(p_of_dec, "pull", local_blocks={"full": [0, 1]}, remote_blocks={"full": [2, 3]}, layers=(1, 2))
    x.post().wait(60)
    name = "model.layers.{}.self_attn"
    assert same_bytes(dst[name.format(1)][:, [0, 1]], src[name.format(1)][:, [2, 3]])
    for i in (0, 2):
        assert same_bytes(dst[name.format(i)], before[name.format(i)])
    with pytest.raises(BadInput, match="selects no layer"):
        dec.prepare(p_of_dec, "pull", local_blocks={"full": [0]}, remote_blocks={"full": [0]}, layers=(7, 9))


def test_transfer_reposts_and_notifies(pair):
    """A prepared transfer posts again; each post bumps the peer's notification word; a stream waits on it."""
    pre, dec, a0, a1 = pair
    pre.register_group("full", 4, vllm_layers(a0, 1, 4, 4, seed=1))
    dec.register_group("full", 4, vllm_layers(a1, 1, 4, 4, seed=2))
    _, p_of_pre = connect(pre, dec)
    x = pre.prepare(p_of_pre, "push", local_blocks={"full": [0, 1]}, remote_blocks={"full": [2, 3]}, notify_slot=5)
    assert dec.notification(5) == 0
    assert p_of_pre.next_notification(5) == 1 and p_of_pre.next_notification(6) == 1
    h1 = x.post()
    h2 = x.post()
    assert (h1.notify_value, h2.notify_value) == (1, 2)
    assert p_of_pre.next_notification(5) == 3 and p_of_pre.next_notification(6) == 1
    for bad in (-1, 64, True, "5"):
        with pytest.raises(BadInput, match="notification slot"):
            p_of_pre.next_notification(bad)
    h2.wait(60)
    assert dec.wait_notification(5, 2, timeout_s=30) >= 2
    s = dec.platform.create_stream(1)
    dec.stream_wait_notification(s, 5, 2)
    assert dec.platform.synchronize(s, 30)
    with pytest.raises(TransferTimeout, match="notification slot 6"):
        dec.wait_notification(6, 1, timeout_s=0.05)


@pytest.mark.parametrize("engine", ["triton", "copy_engine"])
def test_notifications_from_two_streams_land_in_order(plat, engine):
    """Posts notifying one slot from two streams: the second's notification (2) waits for the first post, held
    on its stream, so the peer's word goes 0 -> 1 -> 2, never to 2 before the first post's data landed nor
    back down."""
    a0, a1 = Arena(plat, 0), Arena(plat, 1)
    pre = KVAgent("prefill", platform=plat, device=0, engine=engine)
    dec = KVAgent("decode", platform=plat, device=1, engine=engine)
    gate = plat.alloc(64, 0)
    s1, s2 = plat.create_stream(0), plat.create_stream(0)
    try:
        src = vllm_layers(a0, 1, 4, 4, seed=1)
        pre.register_group("full", 4, src)
        dst = vllm_layers(a1, 1, 4, 4, seed=2)
        dec.register_group("full", 4, dst)
        _, p_of_pre = connect(pre, dec)
        x1 = pre.prepare(p_of_pre, "push", local_blocks={"full": [0]}, remote_blocks={"full": [1]}, notify_slot=4)
        x2 = pre.prepare(p_of_pre, "push", local_blocks={"full": [2]}, remote_blocks={"full": [3]}, notify_slot=4)
        plat.memset_async(s1, gate.ptr, 0, 64)
        plat.wait_flag(s1, gate.ptr, 1)                 # the first post is held until the gate opens
        h1, h2 = x1.post(s1), x2.post(s2)
        assert (h1.notify_value, h2.notify_value) == (1, 2)
        assert not plat.event_wait(h2.event, 0.2)       # its notification waits for the first post
        assert dec.notification(4) == 0
        plat.host_write_flag(gate.ptr, 1, 0)
        h2.wait(60)
        assert h1.done() and dec.notification(4) == 2
        for name in src:
            assert same_bytes(dst[name][:, [1, 3]], src[name][:, [0, 2]])
        x1.post(s1).wait(60)                            # a third, on the first stream
        assert dec.notification(4) == 3
    finally:
        plat.host_write_flag(gate.ptr, 1, 0)
        for s in (s1, s2):
            plat.synchronize(s, 30)
            s.close()
        gate.close()
        dec.close()
        pre.close()
        a0.close()
        a1.close()


_POST_CALLS = ("copy_async", "copy_batch_async", "launch", "launch_graph", "write_flag", "wait_flag", "record_event",
               "stream_wait_event", "memset_async", "synchronize")


def _spy(monkeypatch, plat) -> dict:
    """Count the platform calls and kernel launches made from now on (a test of structure, not speed)."""
    from gpuxfer.kernels._jit import DualKernel
    counts: dict = {}

    def wrap(name, fn):
        def spy(*a, **k):
            counts[name] = counts.get(name, 0) + 1
            return fn(*a, **k)
        return spy
    for name in _POST_CALLS:
        monkeypatch.setattr(plat, name, wrap(name, getattr(plat, name)))
    launch = DualKernel.launch

    def kernel(self, *a, **k):
        counts[f"kernel:{self.__name__}"] = counts.get(f"kernel:{self.__name__}", 0) + 1
        return launch(self, *a, **k)
    monkeypatch.setattr(DualKernel, "launch", kernel)
    return counts


@pytest.mark.parametrize("op", ["pull", "push"])
def test_post_calls_do_not_grow_with_the_descriptors(pair, monkeypatch, op):
    """A request of 2 blocks and one of 40 (20x the descriptors) post the same platform calls and kernel
    launches -- one graph launch (the upload folded in: the request is written into the slot's host words), the
    notification, one event -- once the route's slot exists;
    both move the same bytes as the reference (block by block)."""
    pre, dec, a0, a1 = pair
    caches = []
    for ag, ar, seed in ((pre, a0, 1), (dec, a1, 60)):
        full = {f"layers.{i}": ar.tensor((2, 48, 2, 4), torch.bfloat16, seed=seed + i) for i in range(3)}
        mla = {"layers.0.mla": ar.tensor((48, 2, 40), seed=seed + 9)}
        ag.register_group("full", 2, full)
        ag.register_group("mla", 2, mla)
        caches.append((full, mla))
    (src_full, src_mla), (dst_full, dst_mla) = caches
    p_of_dec, p_of_pre = connect(pre, dec)
    agent, peer = (dec, p_of_dec) if op == "pull" else (pre, p_of_pre)
    rng = np.random.default_rng(5)
    one = {"full": [0], "mla": [0]}
    agent.transfer(peer, op, local_blocks=one, remote_blocks=one).wait(60)     # makes the route's slot
    seen = []
    for n in (2, 40):
        s_ids = {g: rng.permutation(48)[:n].tolist() for g in ("full", "mla")}
        d_ids = {g: rng.permutation(48)[:n].tolist() for g in ("full", "mla")}
        want_full = {k: v.clone() for k, v in dst_full.items()}
        want_mla = dst_mla["layers.0.mla"].clone()
        for k in want_full:
            want_full[k][:, d_ids["full"]] = src_full[k][:, s_ids["full"]]
        want_mla[d_ids["mla"]] = src_mla["layers.0.mla"][s_ids["mla"]]
        mine, theirs = (d_ids, s_ids) if op == "pull" else (s_ids, d_ids)
        x = agent.prepare(peer, op, local_blocks=mine, remote_blocks=theirs, notify_slot=3)
        counts = _spy(monkeypatch, agent.platform)
        h = x.post()
        posted = {k: v for k, v in counts.items() if not k.startswith("kernel:")}     # the calls post made
        h.wait(60)                      # the host emulation runs the stream's work on a worker thread
        seen.append((x.descriptors, posted, dict(counts)))
        monkeypatch.undo()
        for k in want_full:
            assert same_bytes(dst_full[k], want_full[k]), k
        assert same_bytes(dst_mla["layers.0.mla"], want_mla)
    (n_small, posted_small, small), (n_big, posted_big, big) = seen
    assert n_big >= 10 * n_small
    assert posted_small == posted_big and small == big, (small, big)
    assert posted_small == {"copy_async": 1, "launch_graph": 1, "write_flag": 1, "record_event": 1}, posted_small
    assert small.get("kernel:expand_kernel", 0) == (0 if dec._poster.blocks else 1)    # (blocks: no expansion)


def test_timeout_names_the_request(pair):
    pre, dec, a0, a1 = pair
    pre.register_group("full", 4, vllm_layers(a0, 1, 4, 4, seed=1))
    dec.register_group("full", 4, vllm_layers(a1, 1, 4, 4, seed=2))
    p_of_dec, _ = connect(pre, dec)
    plat = dec.platform
    gate = plat.alloc(64, 1)
    s = plat.create_stream(1)
    try:
        plat.memset_async(s, gate.ptr, 0, 64)
        plat.wait_flag(s, gate.ptr, 1)                    # the stream is held until the gate opens
        h = dec.transfer(p_of_dec, "pull", local_blocks={"full": [0]}, remote_blocks={"full": [1]}, stream=s,
                         name="stuck-request")
        with pytest.raises(TransferTimeout, match="stuck-request"):
            h.wait(0.1)
        assert not h.done()
        plat.host_write_flag(gate.ptr, 1, 1)
        h.wait(60)
    finally:
        plat.synchronize(s, 30)
        s.close()
        gate.close()


# ----------------------------------------------------------------------------- the expansion against the plans


@pytest.mark.parametrize("workload, isl, page", [("kv-dsv4", 160, 16), ("kv-dsv4-vllm", 600, 256),
                                                 ("kv-gqa", 40, 8)])
def test_expansion_matches_the_numpy_plan(plat, workload, isl, page):
    """Bench layouts registered as groups, seeded block tables as block IDs: the descriptors the
    device expands are exactly :func:`request_plan`'s."""
    layout = layout_for_burst(workload, isl, page, 1)
    bufs = [plat.alloc(layout.pool_bytes, d) for d in (0, 1)]
    agents = [KVAgent(f"side{d}", platform=plat, device=d, engine="triton") for d in (0, 1)]
    try:
        for ag, buf in zip(agents, bufs):
            for name, bt, layers in layout_groups(layout, plat.as_tensor(buf)):
                ag.register_group(name, bt, layers)
        src_t = burst_tables(layout, isl, 1, seed=3, side="src")[0]
        dst_t = burst_tables(layout, isl, 1, seed=3, side="dst")[0]
        peer = agents[1].add_peer(agents[0].metadata())
        x = agents[1].prepare(peer, "pull", local_blocks=dst_t, remote_blocks=src_t)
        got = x.expanded_descriptors()
        want = request_plan(layout, layout, src_t, dst_t)
        key = lambda a: a[np.lexsort((a[:, 2], a[:, 1], a[:, 0]))]   # noqa: E731
        assert got.shape == want.shape == (x.descriptors, 3)
        assert np.array_equal(key(got), key(want))
        assert x.nbytes == int(want[:, 2].sum())
    finally:
        for ag in agents[::-1]:
            ag.close()
        for b in bufs:
            b.close()


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_expansion_matches_the_plan_hypothesis(plat, data):
    """Hypothesis over the bench's workloads, input lengths, page sizes, seeds and block-table orders: the
    device expansion of a pull or push equals :func:`request_plan` (the numpy oracle)."""
    from gpuxfer.bench.kv.model.workloads import get_workload
    name = data.draw(st.sampled_from(["kv-mla", "kv-gqa", "kv-dsv4", "kv-dsv4-vllm"]), label="workload")
    w = get_workload(name)
    page = data.draw(st.sampled_from(w.allowed_pages or [p for p in (4, 8, 16, 32) if w.supports_page(p)]),
                     label="page")
    isl = data.draw(st.integers(1, 300 if name != "kv-dsv4-vllm" else 1500), label="isl")
    seed = data.draw(st.integers(0, 1 << 20), label="seed")
    order = data.draw(st.sampled_from(["random", "sequential"]), label="order")
    op = data.draw(st.sampled_from(["pull", "push"]), label="op")
    layout = layout_for_burst(w, isl, page, 1)
    bufs = [plat.alloc(layout.pool_bytes, d) for d in (0, 1)]
    agents = [KVAgent(f"h{d}", platform=plat, device=d, engine="triton") for d in (0, 1)]
    try:
        for ag, buf in zip(agents, bufs):
            for gname, bt, layers in layout_groups(layout, plat.as_tensor(buf)):
                ag.register_group(gname, bt, layers)
        src_t = burst_tables(layout, isl, 1, seed=seed, side="src", order=order)[0]
        dst_t = burst_tables(layout, isl, 1, seed=seed, side="dst", order=order)[0]
        me = agents[1] if op == "pull" else agents[0]
        peer = me.add_peer(agents[0 if op == "pull" else 1].metadata())
        mine, theirs = (dst_t, src_t) if op == "pull" else (src_t, dst_t)
        got = me.prepare(peer, op, local_blocks=mine, remote_blocks=theirs).expanded_descriptors()
        want = request_plan(layout, layout, src_t, dst_t)
        key = lambda a: a[np.lexsort((a[:, 2], a[:, 1], a[:, 0]))]   # noqa: E731
        assert np.array_equal(key(got), key(want))
    finally:
        for ag in agents[::-1]:
            ag.close()
        for b in bufs:
            b.close()


def test_expansion_kernel_matches_reference_on_hostile_input():
    """Random planes and requests, IDs and offsets out of range included: the kernel writes exactly what
    the reference does, and nothing outside ``out``."""
    from gpuxfer.kernels import expand_blocks
    from gpuxfer.kernels import reference as ref

    @settings(max_examples=25, deadline=None)
    @given(st.data())
    def check(data):
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
        P, G = data.draw(st.integers(1, 4)), data.draw(st.integers(0, 3))
        planes = rng.integers(-3, 50, (P, 10)).astype(np.int64)
        planes[:, 5] = rng.integers(-1, G + 1, P)
        n_ids = data.draw(st.integers(0, 12))
        head = P + 1 + 3 * G
        req = rng.integers(-2, head + n_ids + 3, head + n_ids).astype(np.int64)
        n_rows = data.draw(st.integers(1, 40))
        out = torch.full((n_rows + 2, 3), -7, dtype=torch.int64)
        expand_blocks(torch.from_numpy(planes), torch.from_numpy(req), out[1:-1], n_groups=G, max_segments=64)
        want = ref.expand_blocks(planes, req, G, n_rows, np.full((n_rows, 3), -7, dtype=np.int64))
        assert np.array_equal(out[1:-1].numpy(), want)
        assert (out[0] == -7).all() and (out[-1] == -7).all()

    check()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_groups_ratios_and_ids(plat, data):
    """Hypothesis over groups (layouts, pieces, block sizes one dividing the other) and block IDs: the
    destination holds what a token-by-token numpy copy says."""
    a0, a1 = Arena(plat, 0, 1 << 15), Arena(plat, 1, 1 << 15)
    pre = KVAgent("p", platform=plat, device=0, engine="triton")
    dec = KVAgent("d", platform=plat, device=1, engine="triton")
    try:
        groups = []
        for gi in range(data.draw(st.integers(1, 2), label="groups")):
            base = data.draw(st.sampled_from([1, 2, 4]), label="base block tokens")
            bs = base * data.draw(st.sampled_from([1, 2, 4]), label="source ratio")
            bd = base if bs != base else base * data.draw(st.sampled_from([1, 2]), label="destination ratio")
            kv_first = data.draw(st.booleans(), label="kv first")
            tb = data.draw(st.sampled_from([1, 3, 16]), label="bytes per token")
            tokens = data.draw(st.integers(1, 3), label="segments") * max(bs, bd)
            nb_s, nb_d = tokens // bs + 2, tokens // bd + 2
            shape = lambda nb, bt: (2, nb, bt, tb) if kv_first else (nb, bt, tb)  # noqa: E731
            src = a0.tensor(shape(nb_s, bs), seed=gi + 1)
            dst = a1.tensor(shape(nb_d, bd), seed=gi + 9)
            pre.register_group(f"g{gi}", bs, {"l": src})
            dec.register_group(f"g{gi}", bd, {"l": dst})
            s_ids = np.random.default_rng(gi).permutation(nb_s)[:tokens // bs]
            d_ids = np.random.default_rng(gi + 5).permutation(nb_d)[:tokens // bd]
            groups.append((f"g{gi}", src, dst, s_ids, d_ids, bs, bd, kv_first))
        expect = [token_oracle(src, dst, s, d, bs, bd, kv) for _, src, dst, s, d, bs, bd, kv in groups]
        op = data.draw(st.sampled_from(["pull", "push"]), label="op")
        src_ids = {g[0]: g[3] for g in groups}
        dst_ids = {g[0]: g[4] for g in groups}
        if op == "pull":
            peer = dec.add_peer(pre.metadata())
            dec.transfer(peer, "pull", local_blocks=dst_ids, remote_blocks=src_ids).wait(60)
        else:
            peer = pre.add_peer(dec.metadata())
            pre.transfer(peer, "push", local_blocks=src_ids, remote_blocks=dst_ids).wait(60)
        for (name, _, dst, *_), want in zip(groups, expect):
            assert np.array_equal(dst.numpy().view(np.uint8), want.view(np.uint8)), name
    finally:
        dec.close()
        pre.close()
        a0.close()
        a1.close()


# ----------------------------------------------------------------------------- layer descriptions


def test_describe_layer_shapes():
    kv = torch.zeros((2, 5, 4, 2, 8), dtype=torch.bfloat16)
    lay = describe_layer(kv, name="model.layers.3.attn")
    assert (lay.num_blocks, lay.block_stride, lay.index) == (5, 4 * 2 * 8 * 2, 3)
    assert [(p.offset, p.nbytes) for p in lay.pieces] == [(0, 128), (5 * 128, 128)]
    fi = torch.zeros((5, 2, 4, 2, 8), dtype=torch.float16)            # FlashInfer: K and V per block
    assert [(p.offset, p.nbytes) for p in describe_layer(fi).pieces] == [(0, 128), (128, 128)]
    dsv4 = torch.zeros((7, 37440), dtype=torch.uint8)[:, :64 * 584].view(7, 64, 584)   # padded pages
    lay = describe_layer(dsv4)
    assert (lay.num_blocks, lay.block_stride, lay.pieces[0].nbytes) == (7, 37440, 64 * 584)
    two = torch.zeros((2, 2, 4, 8))
    assert describe_layer(two, num_blocks=2).pieces[1].offset == two.stride(0) * 4
    with pytest.raises(BadInput, match="dense"):
        describe_layer(torch.zeros((4, 6, 8)).transpose(1, 2))
    with pytest.raises(BadInput, match="holds 4 blocks"):
        describe_layer(torch.zeros((4, 6, 8)), num_blocks=5)
    with pytest.raises(BadInput, match="block dimension"):
        describe_layer(torch.zeros(8))
    slab = torch.zeros(10 * 100, dtype=torch.uint8)
    spec = KVLayerSpec(slab[30:], num_blocks=10, block_stride_bytes=100, pieces=[(0, 20)])
    assert describe_layer(spec).extent == 970
    with pytest.raises(BadInput, match="past the"):
        describe_layer(KVLayerSpec(slab[30:], 10, 100, [(0, 71)]))
    with pytest.raises(BadInput, match="exceed the block stride"):
        describe_layer(KVLayerSpec(slab, 2, 10, [(0, 20)]))
