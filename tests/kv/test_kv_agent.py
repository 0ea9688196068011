"""The KV transfer API (gpuxfer.kv.agent): registration, metadata, transfers by block ID, every bad input.

CPU tests run on the host emulation (Triton's interpreter): tiny caches, few blocks. Two agents
in one process pair up without IPC; one test runs them in two processes. GPU tests (``-m gpu``)
run two processes on one CUDA device with torch-allocated caches.
"""
from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from gpuxfer.bench.kv.model.blocktable import burst_tables
from gpuxfer.bench.kv.model.layout import layout_for_burst, layout_groups
from gpuxfer.bench.kv.model.plan import request_plan
from gpuxfer.errors import (BadInput, BadMetadata, BlockIdError, LayoutMismatch, NotExportable, NotRegistered,
                            TransferTimeout)
from gpuxfer.kv.agent import KVAgent
from gpuxfer.kv.layers import KVLayerSpec, describe_layer
from gpuxfer.kv.metadata import METADATA_VERSION, decode_metadata


@pytest.fixture
def plat():
    from gpuxfer.platforms.host import HostPlatform
    p = HostPlatform()
    yield p
    p.close()


class Arena:
    """Host-emulation 'device memory': a shared-memory buffer carved into torch tensors."""

    def __init__(self, plat, device: int, nbytes: int = 1 << 16):
        self.buf = plat.alloc(nbytes, device)
        self.flat = plat.as_tensor(self.buf)
        self.at = 0

    def tensor(self, shape, dtype=torch.uint8, seed=None):
        item = torch.empty((), dtype=dtype).element_size()
        self.at = -(-self.at // 16) * 16
        n = int(np.prod(shape)) * item
        t = self.flat[self.at:self.at + n].view(dtype).view(shape)
        self.at += n
        if seed is not None:
            g = np.random.default_rng(seed)
            t.view(torch.uint8).reshape(-1).copy_(torch.from_numpy(g.integers(0, 256, n, dtype=np.uint8)))
        return t

    def close(self):
        self.buf.close()


@pytest.fixture
def pair(plat):
    """Two agents (prefill on device 0, decode on device 1) and their arenas."""
    a0, a1 = Arena(plat, 0), Arena(plat, 1)
    pre = KVAgent("prefill", platform=plat, device=0, timeout_s=60)
    dec = KVAgent("decode", platform=plat, device=1, timeout_s=60)
    yield pre, dec, a0, a1
    dec.close()
    pre.close()
    a0.close()
    a1.close()


def _vllm_layers(arena, layers, blocks, bt, seed):
    """vLLM flash-attention layout: (2, blocks, block_tokens, heads, dim) bf16 per layer."""
    return {f"model.layers.{i}.self_attn": arena.tensor((2, blocks, bt, 2, 4), torch.bfloat16, seed=seed + i)
            for i in range(layers)}


def _eq(a, b) -> bool:
    """Bytewise equality (random bytes viewed as floats hold NaNs)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _connect(pre, dec):
    return dec.add_peer(pre.metadata()), pre.add_peer(dec.metadata())


# ----------------------------------------------------------------------------- moving requests


@pytest.mark.parametrize("op", ["pull", "push"])
def test_move_request_every_byte(pair, op):
    pre, dec, a0, a1 = pair
    src = _vllm_layers(a0, 2, 6, 4, seed=1)
    dst = _vllm_layers(a1, 2, 6, 4, seed=50)
    slab_s = a0.tensor((5, 4, 584), seed=7)           # DSV4-style 584-byte slots, one piece per block
    slab_d = a1.tensor((5, 4, 584), seed=8)
    pre.register_group("full", 4, src)
    dec.register_group("full", 4, dst)
    pre.register_group("mla", 4, {"layers.0.mla": slab_s})
    dec.register_group("mla", 4, {"layers.0.mla": slab_d})
    p_of_dec, p_of_pre = _connect(pre, dec)
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
            assert _eq(dst[name][:, d], src[name][:, s])
        untouched = [b for b in range(6) if b not in d_ids["full"]]
        assert _eq(dst[name][:, untouched], before[name][:, untouched])
    for s, d in zip(s_ids["mla"], d_ids["mla"]):
        assert _eq(slab_d[d], slab_s[s])


def _token_oracle(src, dst, s_ids, d_ids, bs, bd, kv_first):
    """What the destination must hold after a transfer matching tokens (numpy, independent of the API)."""
    if src.dtype == torch.bfloat16:         # numpy has no bf16: the same bits as int16
        src, dst = src.view(torch.int16), dst.view(torch.int16)
    s = src.clone().numpy()
    out = dst.clone().numpy()
    tokens = min(len(s_ids) * bs, len(d_ids) * bd)
    for t in range(tokens):
        sb, so = s_ids[t // bs], t % bs
        db, do = d_ids[t // bd], t % bd
        if kv_first:
            out[:, db, do] = s[:, sb, so]
        else:
            out[db, do] = s[sb, so]
    return out


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
    p_of_dec, p_of_pre = _connect(pre, dec)
    tokens = 3 * max(bs, bd)
    rng = np.random.default_rng(0)
    s_ids = rng.permutation(nb_s)[:-(-tokens // bs)]
    d_ids = rng.permutation(nb_d)[:-(-tokens // bd)]
    expect = _token_oracle(src, dst, s_ids, d_ids, bs, bd, kv_first=True)
    if op == "pull":
        h = dec.transfer(p_of_dec, "pull", local_blocks={"g": d_ids}, remote_blocks={"g": s_ids})
    else:
        h = pre.transfer(p_of_pre, "push", local_blocks={"g": s_ids}, remote_blocks={"g": d_ids})
    h.wait(60)
    assert np.array_equal(dst.numpy().view(np.uint8), expect.view(np.uint8))


def test_layer_range_moves_only_those_layers(pair):
    pre, dec, a0, a1 = pair
    src = _vllm_layers(a0, 3, 4, 2, seed=10)
    dst = _vllm_layers(a1, 3, 4, 2, seed=20)
    before = {k: v.clone() for k, v in dst.items()}
    pre.register_group("full", 2, src)
    dec.register_group("full", 2, dst)
    p_of_dec, _ = _connect(pre, dec)
    x = dec.prepare(p_of_dec, "pull", local_blocks={"full": [0, 1]}, remote_blocks={"full": [2, 3]}, layers=(1, 2))
    x.post().wait(60)
    name = "model.layers.{}.self_attn"
    assert _eq(dst[name.format(1)][:, [0, 1]], src[name.format(1)][:, [2, 3]])
    for i in (0, 2):
        assert _eq(dst[name.format(i)], before[name.format(i)])
    with pytest.raises(BadInput, match="selects no layer"):
        dec.prepare(p_of_dec, "pull", local_blocks={"full": [0]}, remote_blocks={"full": [0]}, layers=(7, 9))


def test_transfer_reposts_and_notifies(pair):
    """A prepared transfer posts again; each post bumps the peer's notification word; a stream waits on it."""
    pre, dec, a0, a1 = pair
    pre.register_group("full", 4, _vllm_layers(a0, 1, 4, 4, seed=1))
    dec.register_group("full", 4, _vllm_layers(a1, 1, 4, 4, seed=2))
    _, p_of_pre = _connect(pre, dec)
    x = pre.prepare(p_of_pre, "push", local_blocks={"full": [0, 1]}, remote_blocks={"full": [2, 3]}, notify_slot=5)
    assert dec.notification(5) == 0
    h1 = x.post()
    h2 = x.post()
    assert (h1.notify_value, h2.notify_value) == (1, 2)
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
        src = _vllm_layers(a0, 1, 4, 4, seed=1)
        pre.register_group("full", 4, src)
        dst = _vllm_layers(a1, 1, 4, 4, seed=2)
        dec.register_group("full", 4, dst)
        _, p_of_pre = _connect(pre, dec)
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
            assert _eq(dst[name][:, [1, 3]], src[name][:, [0, 2]])
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
    launches -- an upload, one graph launch, the notification, one event -- once the route's slot exists;
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
    p_of_dec, p_of_pre = _connect(pre, dec)
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
            assert _eq(dst_full[k], want_full[k]), k
        assert _eq(dst_mla["layers.0.mla"], want_mla)
    (n_small, posted_small, small), (n_big, posted_big, big) = seen
    assert n_big >= 10 * n_small
    assert posted_small == posted_big and small == big, (small, big)
    assert posted_small == {"copy_async": 2, "launch_graph": 1, "write_flag": 1, "record_event": 1}, posted_small
    assert small["kernel:expand_kernel"] == 1


def test_timeout_names_the_request(pair):
    pre, dec, a0, a1 = pair
    pre.register_group("full", 4, _vllm_layers(a0, 1, 4, 4, seed=1))
    dec.register_group("full", 4, _vllm_layers(a1, 1, 4, 4, seed=2))
    p_of_dec, _ = _connect(pre, dec)
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
    agents = [KVAgent(f"side{d}", platform=plat, device=d) for d in (0, 1)]
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
    agents = [KVAgent(f"h{d}", platform=plat, device=d) for d in (0, 1)]
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
    pre = KVAgent("p", platform=plat, device=0)
    dec = KVAgent("d", platform=plat, device=1)
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
        expect = [_token_oracle(src, dst, s, d, bs, bd, kv) for _, src, dst, s, d, bs, bd, kv in groups]
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


# ----------------------------------------------------------------------------- bad input


def test_bad_block_ids(pair):
    pre, dec, a0, a1 = pair
    pre.register_group("full", 4, _vllm_layers(a0, 1, 4, 4, seed=1))
    dec.register_group("full", 4, _vllm_layers(a1, 1, 4, 4, seed=2))
    pre.register_group("w", 2, {"w0": a0.tensor((6, 2, 8), seed=3)})
    dec.register_group("w", 4, {"w0": a1.tensor((6, 4, 8), seed=3)})
    p, _ = _connect(pre, dec)

    def prep(local, remote, **kw):
        return dec.prepare(p, "pull", local_blocks=local, remote_blocks=remote, name="r1", **kw)

    with pytest.raises(BlockIdError, match="block ID 4 at position 1 is out of range"):
        prep({"full": [0, 1]}, {"full": [0, 4]})
    with pytest.raises(BlockIdError, match="block ID -1"):
        prep({"full": [-1]}, {"full": [0]})
    with pytest.raises(BlockIdError, match="destination block 2 appears more than once"):
        prep({"full": [2, 2]}, {"full": [0, 1]})
    with pytest.raises(BlockIdError, match="do not cover the same tokens"):
        prep({"full": [0, 1]}, {"full": [0]})
    with pytest.raises(BlockIdError, match="do not cover the same tokens"):
        prep({"w": [0, 1]}, {"w": [0]})                 # 2 decode blocks of 4 tokens need 4 of 2
    prep({"w": [0, 1]}, {"w": [0, 1, 2, 3]})
    with pytest.raises(BlockIdError, match="same"):
        prep({"full": [0]}, {"w": [0]})
    with pytest.raises(NotRegistered, match="'nope'"):
        prep({"nope": [0]}, {"nope": [0]})
    with pytest.raises(BlockIdError, match="1-D"):
        prep({"full": [[0]]}, {"full": [[0]]})
    with pytest.raises(BlockIdError, match="integers"):
        prep({"full": [0.5]}, {"full": [0]})
    with pytest.raises(BlockIdError, match="out of range"):
        prep({"full": np.array([2**63 - 1], dtype=np.uint64)}, {"full": [0]})
    with pytest.raises(BadInput, match="op must be"):
        dec.prepare(p, "send", local_blocks={}, remote_blocks={})
    with pytest.raises(BadInput, match="notify_slot"):
        prep({"full": [0]}, {"full": [0]}, notify_slot=64)
    with pytest.raises(BadInput, match="layers must be"):
        prep({"full": [0]}, {"full": [0]}, layers=(3, 1))


def test_duplicate_destinations_across_groups_sharing_memory(pair):
    """Two groups laid over one slab array (vLLM's packed layout): a block ID may serve one group only."""
    pre, dec, a0, a1 = pair
    for ag, ar, seed in ((pre, a0, 1), (dec, a1, 2)):
        slab = ar.tensor((8, 96), seed=seed)
        ag.register_group("mla", 4, {"mla": KVLayerSpec(slab, 8, 96, [(0, 64)])})
        ag.register_group("swa", 4, {"swa": KVLayerSpec(slab, 8, 96, [(0, 32)])})
    p, _ = _connect(pre, dec)
    dec.prepare(p, "pull", local_blocks={"mla": [0, 1], "swa": [2]}, remote_blocks={"mla": [0, 1], "swa": [3]})
    with pytest.raises(BlockIdError, match="block 1 appears more than once"):
        dec.prepare(p, "pull", local_blocks={"mla": [0, 1], "swa": [1]}, remote_blocks={"mla": [0, 1], "swa": [3]})


def test_mismatched_layouts(pair):
    pre, dec, a0, a1 = pair
    pre.register_group("a", 4, {"l0": a0.tensor((4, 4, 8))})
    dec.register_group("a", 4, {"l0": a1.tensor((4, 4, 16))})
    pre.register_group("b", 4, {"l0": a0.tensor((4, 4, 8))})
    dec.register_group("b", 4, {"other": a1.tensor((4, 4, 8))})
    pre.register_group("c", 4, {"l0": a0.tensor((4, 4, 8))})
    dec.register_group("c", 3, {"l0": a1.tensor((4, 3, 8))})
    pre.register_group("d", 4, {"l0": a0.tensor((4, 4, 8))})
    dec.register_group("d", 2, {"l0": a1.tensor((8, 2, 8))}, token_major=False)
    pre.register_group("e", 4, {"l0": a0.tensor((4, 4, 8)), "l1": a0.tensor((4, 4, 8))})
    dec.register_group("e", 4, {"l0": a1.tensor((4, 4, 8))})
    pre.register_group("ok", 4, {"l0": a0.tensor((4, 4, 8))})
    dec.register_group("ok", 4, {"l0": a1.tensor((4, 4, 8))})
    pre.register_group("only-here", 4, {"l0": a0.tensor((4, 4, 8))})
    p, _ = _connect(pre, dec)
    for g, match in (("a", "bytes per block"), ("b", "no layer"), ("c", "one must divide"), ("d", "token-major"),
                     ("e", "1 layers here, 2 on")):
        with pytest.raises(LayoutMismatch, match=match):
            dec.prepare(p, "pull", local_blocks={g: [0]}, remote_blocks={g: [0]})
    dec.prepare(p, "pull", local_blocks={"ok": [0]}, remote_blocks={"ok": [1]}).post().wait(60)
    with pytest.raises(NotRegistered, match="only-here"):
        dec.prepare(p, "pull", local_blocks={"only-here": [0]}, remote_blocks={"only-here": [0]})


def test_registration_errors(pair, plat):
    pre, dec, a0, a1 = pair
    plain = torch.zeros((4, 4, 8), dtype=torch.uint8)      # plain memory: a cma handle (tests/kv/test_kv_cma.py)
    pre.register_group("plain", 4, {"l": plain})
    with pytest.raises(BadInput, match="torch.Tensor"):
        pre.register_group("g", 4, {"l": np.zeros((4, 4, 8))})
    with pytest.raises(BadInput, match="block_tokens"):
        pre.register_group("g", 0, {"l": a0.tensor((4, 4, 8))})
    with pytest.raises(BadInput, match="no layers"):
        pre.register_group("g", 4, {})
    pre.register_group("g", 4, [a0.tensor((4, 4, 8))])
    assert pre.groups == {"plain": (4, 4, 1), "g": (4, 4, 1)}
    with pytest.raises(BadInput, match="already registered"):
        pre.register_group("g", 4, [a0.tensor((4, 4, 8))])
    with pytest.raises(BadInput, match="engine"):
        KVAgent("x", platform=plat, engine="carrier-pigeon")
    with pytest.raises(NotRegistered, match="no peer 'ghost'"):
        pre.peer("ghost")


def test_removed_peer_and_closed_agent(pair):
    pre, dec, a0, a1 = pair
    pre.register_group("g", 4, [a0.tensor((4, 4, 8))])
    dec.register_group("g", 4, [a1.tensor((4, 4, 8))])
    p, _ = _connect(pre, dec)
    x = dec.prepare(p, "pull", local_blocks={"g": [0]}, remote_blocks={"g": [1]})
    with pytest.raises(BadInput, match="already added"):
        dec.add_peer(pre.metadata())
    dec.remove_peer("prefill")
    with pytest.raises(NotRegistered, match="removed"):
        x.post()
    with pytest.raises(NotRegistered):
        dec.remove_peer("prefill")
    with pytest.raises(BadInput, match="own peer"):
        dec.add_peer(dec.metadata())
    dec.close()
    dec.close()
    with pytest.raises(BadInput, match="closed"):
        dec.metadata()


def _held_pull(pre, dec, a0, a1):
    """A pull with a notification posted on a stream of its own held by a gate: (src, dst, peer, gate, stream,
    handle). The notification goes through the peer link's stage word (an in-process peer maps nothing)."""
    src, dst = _vllm_layers(a0, 1, 4, 4, seed=1), _vllm_layers(a1, 1, 4, 4, seed=2)
    pre.register_group("full", 4, src)
    dec.register_group("full", 4, dst)
    p_of_dec, _ = _connect(pre, dec)
    plat = dec.platform
    gate = plat.alloc(64, 1)
    s = plat.create_stream(1)
    plat.memset_async(s, gate.ptr, 0, 64)
    plat.wait_flag(s, gate.ptr, 1)
    h = dec.transfer(p_of_dec, "pull", local_blocks={"full": [0]}, remote_blocks={"full": [3]}, stream=s,
                     notify_slot=2)
    return src, dst, p_of_dec, gate, s, h


def _stop_if_freed_under(s, h, peer) -> None:
    """Drop the held work (not run it) when the peer link's stage words were freed under it: running it would
    write into freed memory."""
    if not h.done() and peer.flags.stage_mem.closed:
        s._worker.abort()


def test_remove_peer_waits_for_its_transfers(pair):
    """remove_peer while a post to that peer is held: it waits for the post (the gate opens meanwhile), then
    closes the peer's flag link; the bytes and the notification landed and the agent is fine."""
    import threading
    pre, dec, a0, a1 = pair
    src, dst, p_of_dec, gate, s, h = _held_pull(pre, dec, a0, a1)
    plat = dec.platform
    opener = threading.Timer(0.2, plat.host_write_flag, (gate.ptr, 1, 1))
    try:
        opener.start()
        dec.remove_peer("prefill")
        assert h.done() and p_of_dec.flags.closed and p_of_dec.flags.stage_mem.closed and dec.failed is None
        assert pre.notification(2) == 1
        for name in src:
            assert _eq(dst[name][:, 0], src[name][:, 3])
    finally:
        opener.cancel()
        _stop_if_freed_under(s, h, p_of_dec)
        plat.host_write_flag(gate.ptr, 1, 1)
        plat.synchronize(s, 30)
        s.close()
        gate.close()


def test_posted_transfers_kept_until_complete_then_dropped(pair):
    """A post keeps its transfer (host array, slot) until its event completed, though the caller dropped the
    transfer and the handle; a prepare drops the completed ones (not a running one); posts without
    prepares keep at most INFLIGHT_KEEP of them."""
    import gc
    import weakref
    from gpuxfer.kv.posting import INFLIGHT_KEEP
    pre, dec, a0, a1 = pair
    src, dst, p_of_dec, gate, s, h = _held_pull(pre, dec, a0, a1)
    plat = dec.platform
    try:
        held = weakref.ref(h.transfer)
        del h
        gc.collect()
        y = dec.prepare(p_of_dec, "pull", local_blocks={"full": [1]}, remote_blocks={"full": [2]})
        gc.collect()
        assert held() is not None                       # still queued behind the gate
        plat.host_write_flag(gate.ptr, 1, 1)
        assert plat.synchronize(s, 30)
        dec.prepare(p_of_dec, "pull", local_blocks={"full": [1]}, remote_blocks={"full": [2]})
        gc.collect()
        assert held() is None
        for _ in range(2 * INFLIGHT_KEEP + 3):
            y.post().wait(60)
        assert 1 <= len(dec._inflight) <= INFLIGHT_KEEP
        assert _eq(dst[next(iter(dst))][:, 1], src[next(iter(src))][:, 2])
    finally:
        plat.host_write_flag(gate.ptr, 1, 1)
        plat.synchronize(s, 30)
        s.close()
        gate.close()


def test_remove_peer_keeps_what_a_stuck_transfer_may_touch(pair):
    """remove_peer while a post to that peer is held past the agent's timeout: the agent fails (its error
    names the peer) and keeps the peer's flag link (its stage words) instead of closing it; once the gate
    opens, the post runs through the kept memory."""
    from gpuxfer.kv import agent as agent_mod
    pre, dec, a0, a1 = pair
    src, dst, p_of_dec, gate, s, h = _held_pull(pre, dec, a0, a1)
    plat = dec.platform
    link = p_of_dec.flags
    before = len(agent_mod._LEAKED)
    try:
        dec.timeout_s = 0.1
        dec.remove_peer("prefill")
        assert any(m is link for m in agent_mod._LEAKED[before:]) and not link.stage_mem.closed and not h.done()
        assert isinstance(dec.failed, TransferTimeout) and "transfers with peer 'prefill'" in str(dec.failed)
        plat.host_write_flag(gate.ptr, 1, 1)
        assert plat.event_wait(h.event, 60)
        assert pre.notification(2) == 1
        for name in src:
            assert _eq(dst[name][:, 0], src[name][:, 3])
    finally:
        _stop_if_freed_under(s, h, p_of_dec)
        plat.host_write_flag(gate.ptr, 1, 1)
        plat.synchronize(s, 30)
        s.close()
        gate.close()
        del agent_mod._LEAKED[before:]
        link.close()


# ----------------------------------------------------------------------------- metadata bytes


def _meta_body(blob: bytes) -> dict:
    return json.loads(blob[12:])


def _reblob(body: dict, version: int = METADATA_VERSION) -> bytes:
    raw = json.dumps(body).encode()
    return struct.pack("<4sHHI", b"GXKV", version, 0, len(raw)) + raw


def test_metadata_roundtrip_and_hostile_bytes(pair):
    pre, dec, a0, a1 = pair
    pre.register_group("full", 4, _vllm_layers(a0, 2, 4, 4, seed=1))
    blob = pre.metadata()
    meta = decode_metadata(blob)
    assert meta.agent == "prefill" and [g.name for g in meta.groups] == ["full"]
    assert len(meta.groups[0].layers) == 2 and len(meta.allocations) == 1
    body = _meta_body(blob)
    cases = [
        (b"", "shorter than"), (blob[:11], "shorter than"), (b"XXXX" + blob[4:], "magic"),
        (_reblob(body, version=99), "version 99"), (blob[:-1], "body bytes"), (blob + b" ", "body bytes"),
        (_reblob(body, version=METADATA_VERSION - 1), f"version {METADATA_VERSION - 1};"),
        (blob[:12] + b"\xff" * (len(blob) - 12), "not valid JSON"), ("text", "must be bytes"),
        (_reblob([1, 2]), "JSON object"),
    ]
    for bad, match in cases:
        with pytest.raises(BadMetadata, match=match):
            decode_metadata(bad)

    def mutate(path, value):
        b = json.loads(json.dumps(body))
        node = b
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        return _reblob(b)

    g0l0 = ["groups", 0, "layers", 0]
    for path, value, match in [
        (["pid"], -1, "'pid'"), (["agent"], "", "'agent'"), (["allocations"], "x", "'allocations'"),
        (["control", "payload"], "zz", "hex"), (["control", "nbytes"], 8, "control"),
        (g0l0 + ["alloc"], 5, "'alloc'"), (g0l0 + ["offset"], 2**61, "lie outside"),
        (g0l0 + ["num_blocks"], 10**6, "past the"), (g0l0 + ["block_stride"], 0, "'block_stride'"),
        (g0l0 + ["pieces"], [[0, -1]], "piece"), (g0l0 + ["pieces"], [[0]], "piece"),
        (g0l0 + ["pieces"], [], "pieces"), (g0l0 + ["token_major"], 1, "token_major"),
        (g0l0 + ["name"], "model.layers.1.self_attn", "duplicate layer"),
        (["groups", 0, "block_tokens"], 0, "block_tokens"),
        (["groups"], [body["groups"][0], body["groups"][0]], "duplicate group"),
        (g0l0 + ["pieces"], [[0, 2**70]], "piece"), (g0l0 + ["index"], True, "'index'"),
    ]:
        with pytest.raises(BadMetadata, match=match):
            decode_metadata(mutate(path, value))
    with pytest.raises(BadMetadata, match="platform"):
        dec.add_peer(mutate(["platform"], "cuda"))
    with pytest.raises(BadMetadata, match="not a live agent"):
        dec.add_peer(mutate(["uid"], "0" * 32))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_metadata_fuzz_raises_only_typed_errors(raw):
    for blob in (raw, b"GXKV" + struct.pack("<HHI", METADATA_VERSION, 0, max(len(raw) - 8, 0)) + raw[8:]):
        try:
            decode_metadata(blob)
        except BadMetadata:
            pass


# ----------------------------------------------------------------------------- platform hooks


def test_host_export_range(plat):
    buf = plat.alloc(4096, 0)
    try:
        t = plat.as_tensor(buf)[1000:1100]
        ex = plat.export_range(t.data_ptr(), 100, 0)
        assert ex.offset == 1000 and ex.handle.nbytes == 4096
        assert plat.allocation_range(t.data_ptr(), 0) == (buf.ptr, 4096)
        with pytest.raises(NotExportable, match="runs past the end"):
            plat.export_range(buf.ptr + 4000, 200, 0)
        with pytest.raises(BadInput, match="device 0, not 1"):
            plat.export_range(buf.ptr, 8, 1)
        plain = torch.zeros(8)
        assert plat.export_range(plain.data_ptr(), 8, 0).handle.payload.startswith(b"GXCMA")   # plain memory
        assert plat.allocation_range(torch.zeros(8).data_ptr(), 0) is None
        from gpuxfer.platforms.base import Platform        # the contract's defaults: nothing but alloc's buffers
        with pytest.raises(NotExportable, match="can only export buffers it allocated"):
            Platform.export_range(plat, buf.ptr, 8, 0)
        assert Platform.allocation_range(plat, buf.ptr, 0) is None
    finally:
        buf.close()


# ----------------------------------------------------------------------------- two processes


def _side(rank, world, init, platform_name, op, carve, engine="triton"):
    """One side of a two-process hand-off: vLLM-shaped caches allocated by torch (CUDA) or carved from a
    shared-memory buffer (host), metadata bytes swapped through a gloo group, every byte checked."""
    import datetime
    import torch.distributed as dist
    from gpuxfer.platforms import get_platform
    plat = get_platform(platform_name)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    keep = []
    try:
        layers, blocks, bt = 3, 6, 4
        shape = (2, blocks, bt, 2, 8)
        n = int(np.prod(shape))
        if platform_name == "host":
            buf = plat.alloc(layers * n * 2 + 4096, rank)
            keep.append(buf)
            flat = plat.as_tensor(buf, dtype=torch.bfloat16)
            caches = {f"model.layers.{i}.attn": flat[1000 + i * n:1000 + (i + 1) * n].view(shape)
                      for i in range(layers)}
            device = rank
        else:
            device = 0
            big = torch.empty(layers * n + 3000, dtype=torch.bfloat16, device="cuda:0")   # one allocation
            caches = {f"model.layers.{i}.attn": (big[1000 + i * n:1000 + (i + 1) * n].view(shape) if carve
                                                  else torch.empty(shape, dtype=torch.bfloat16, device="cuda:0"))
                      for i in range(layers)}
        g = torch.Generator().manual_seed(rank)
        for t in caches.values():
            t.copy_(torch.randn(shape, generator=g).to(torch.bfloat16))
        agent = KVAgent(f"rank{rank}", platform=plat, device=device, engine=engine)
        keep.append(agent)
        agent.register_kv_caches(caches, bt, group="full")
        blobs = [None, None]
        dist.all_gather_object(blobs, agent.metadata())
        peer = agent.add_peer(blobs[1 - rank])
        if platform_name == "cuda":     # a second open of an allocation's handle shares the first mapping
            again = plat.open_handle(peer.meta.allocations[0], device)
            assert again.ptr == peer._mappings[0].ptr
            again.close()
        src_ids, dst_ids = [5, 0, 3], [1, 4, 2]
        initiator = 1 if op == "pull" else 0
        if engine == "pack":            # two-sided: the source pushes, the destination pulls, both post
            mine, theirs = (src_ids, dst_ids) if rank == 0 else (dst_ids, src_ids)
            agent.transfer(peer, "push" if rank == 0 else "pull", local_blocks={"full": mine},
                           remote_blocks={"full": theirs}).wait(60)
        elif rank == initiator:
            mine, theirs = (dst_ids, src_ids) if op == "pull" else (src_ids, dst_ids)
            h = agent.transfer(peer, op, local_blocks={"full": mine}, remote_blocks={"full": theirs}, notify_slot=0)
            h.wait(60)
        else:
            agent.wait_notification(0, 1, timeout_s=60)
        dist.barrier()
        sums = {k: [t[:, b].float().cpu().numpy() for b in range(blocks)] for k, t in caches.items()}
        allsums = [None, None]
        dist.all_gather_object(allsums, sums)
        for k in caches:
            for s, d in zip(src_ids, dst_ids):
                assert np.array_equal(allsums[0][k][s], allsums[1][k][d]), (k, s, d)
        dist.barrier()
        return "ok"
    finally:
        for r in keep[::-1]:
            r.close()
        dist.destroy_process_group()
        plat.close()


# pull over triton and push over pack by default (both engines, both directions); push over triton with the
# long tests
@pytest.mark.parametrize("op, engine", [("pull", "triton"), pytest.param("push", "triton", marks=pytest.mark.slow),
                                        ("push", "pack")])
def test_two_processes_host(spawner, op, engine):
    assert spawner.run_ranks(_side, 2, "host", op, True, engine, timeout=180) == ["ok", "ok"]


@pytest.mark.gpu
@pytest.mark.parametrize("op, carve, engine", [("pull", True, "triton"), ("push", False, "triton"),
                                               ("push", True, "pack"), ("pull", True, "copy_engine")])
def test_two_processes_one_cuda_device(spawner, op, carve, engine):
    from conftest import platform_reason
    why = platform_reason("cuda")
    if why:
        pytest.skip(why)
    assert spawner.run_ranks(_side, 2, "cuda", op, carve, engine, timeout=240) == ["ok", "ok"]


def _expandable_child():
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    from gpuxfer.platforms import get_platform
    plat = get_platform("cuda")
    t = torch.empty((2, 4, 4, 8), dtype=torch.bfloat16, device="cuda:0")
    agent = KVAgent("x", platform=plat, device=0)
    try:
        agent.register_kv_caches({"l0": t}, 4)
    except NotExportable as exc:
        return str(exc)
    finally:
        agent.close()
        plat.close()
    return "registered"


@pytest.mark.gpu
def test_cuda_export_range_and_expandable_segments(spawner):
    from conftest import platform_reason
    why = platform_reason("cuda")
    if why:
        pytest.skip(why)
    from gpuxfer.platforms import get_platform
    plat = get_platform("cuda")
    try:
        big = torch.empty(10 << 20, dtype=torch.uint8, device="cuda:0")
        part = big[3 << 20:]
        ex = plat.export_range(part.data_ptr(), 1 << 20, 0)
        base, size = plat.allocation_range(part.data_ptr(), 0)
        assert part.data_ptr() - base == ex.offset and ex.handle.nbytes == size >= 10 << 20
        with pytest.raises(NotExportable):
            plat.export_range(torch.zeros(4).data_ptr(), 16, 0)
    finally:
        plat.close()
    msg = spawner.start(_expandable_child, name="expandable").result(120)
    assert "not legacy-IPC capable" in msg or "expandable" in msg, msg


# ----------------------------------------------------------------------------- the pack engine (two-sided)


@pytest.fixture
def pack_pair(plat):
    a0, a1 = Arena(plat, 0), Arena(plat, 1)
    pre = KVAgent("prefill", platform=plat, device=0, engine="pack", slot_bytes=512)
    dec = KVAgent("decode", platform=plat, device=1, engine="pack", slot_bytes=512)
    yield pre, dec, a0, a1
    dec.close()
    pre.close()
    a0.close()
    a1.close()


def test_pack_both_sides_post_every_byte(pack_pair):
    """Both sides post the same request; small slots force many chunks and slot reuse; two requests in a row
    (chunk numbers carry on); different block sizes on the two sides; registration in different orders."""
    pre, dec, a0, a1 = pack_pair
    src = _vllm_layers(a0, 2, 6, 4, seed=1)
    dst = _vllm_layers(a1, 2, 12, 2, seed=2)
    slab_s, slab_d = a0.tensor((5, 4, 100), seed=3), a1.tensor((5, 4, 100), seed=4)
    pre.register_group("full", 4, src)
    pre.register_group("mla", 4, {"m": slab_s})
    dec.register_group("mla", 4, {"m": slab_d})            # the other order: chunks follow names, not order
    dec.register_group("full", 2, dict(reversed(list(dst.items()))))
    p_of_dec, p_of_pre = _connect(pre, dec)
    for s_full, d_full, s_mla, d_mla in (([4, 0, 2], [1, 5, 3, 11, 0, 7], [1, 3], [4, 0]),
                                         ([5], [2, 9], [0], [1])):
        expect = {k: _token_oracle(src[k], dst[k], s_full, d_full, 4, 2, kv_first=True) for k in src}
        want_slab = slab_d.clone()
        want_slab[d_mla] = slab_s[s_mla]
        xd = dec.prepare(p_of_dec, "pull", local_blocks={"full": d_full, "mla": d_mla},
                         remote_blocks={"full": s_full, "mla": s_mla}, name="req")
        xs = pre.prepare(p_of_pre, "push", local_blocks={"full": s_full, "mla": s_mla},
                         remote_blocks={"full": d_full, "mla": d_mla}, name="req")
        assert len(xs._chunks) == len(xd._chunks) >= 2
        hd = xd.post()
        hs = xs.post()
        hd.wait(60)
        hs.wait(60)
        for k in src:
            assert np.array_equal(dst[k].view(torch.int16).numpy(), expect[k]), k
        assert _eq(slab_d, want_slab)


def test_pack_without_the_source_times_out_naming_the_request(pack_pair):
    pre, dec, a0, a1 = pack_pair
    pre.register_group("g", 4, [a0.tensor((4, 4, 8))])
    dec.register_group("g", 4, [a1.tensor((4, 4, 8))])
    p_of_dec, _ = _connect(pre, dec)
    h = dec.prepare(p_of_dec, "pull", local_blocks={"g": [0]}, remote_blocks={"g": [1]}, name="lonely").post()
    with pytest.raises(TransferTimeout, match="lonely"):
        h.wait(0.2)
    # the agent failed: it released its stream's waits (the stream drains, nothing landed) and raises the
    # error from every later call; close still works (the fixture)
    assert dec.failed is not None
    assert dec.platform.synchronize(dec.stream, 60)
    with pytest.raises(TransferTimeout, match="lonely"):
        h.wait(60)
    with pytest.raises(TransferTimeout, match="lonely"):
        dec.prepare(p_of_dec, "pull", local_blocks={"g": [0]}, remote_blocks={"g": [1]})
    with pytest.raises(TransferTimeout, match="lonely"):
        dec.wait_notification(0, 1, timeout_s=1)
    assert pre.failed is None


def test_pack_post_failing_part_way_fails_the_agent(pack_pair, monkeypatch):
    """An operation of a pack post that raises after others were queued (the peer may have seen them) fails the
    agent: its waits are released, the error comes from every later call, the pair's transfer count stays."""
    pre, dec, a0, a1 = pack_pair
    pre.register_group("g", 4, [a0.tensor((4, 4, 8))])
    dec.register_group("g", 4, [a1.tensor((4, 4, 8))])
    p_of_dec, _ = _connect(pre, dec)
    x = dec.prepare(p_of_dec, "pull", local_blocks={"g": [0, 1]}, remote_blocks={"g": [1, 2]}, name="torn")
    plat = dec.platform
    calls = []

    def flaky(orig):            # the post's second flag operation (a write, or the go signal's copy) refused
        def op(s, *a):
            calls.append(a[0])
            if len(calls) == 2:
                raise BadInput("injected: the stream refused a flag operation")
            orig(s, *a)
        return op
    monkeypatch.setattr(plat, "write_flag", flaky(plat.write_flag))
    monkeypatch.setattr(plat, "copy_async", flaky(plat.copy_async))
    with pytest.raises(BadInput, match="injected"):
        x.post()
    monkeypatch.undo()
    assert len(calls) == 2 and p_of_dec.pack_recv == 0
    assert isinstance(dec.failed, BadInput)
    assert plat.synchronize(dec.stream, 60)             # nothing of the torn post waits any more
    with pytest.raises(BadInput, match="injected"):
        x.post()
    with pytest.raises(BadInput, match="not an open stream"):
        pre.prepare(pre.peer("decode"), "push", local_blocks={"g": [1, 2]}, remote_blocks={"g": [0, 1]}).post(
            stream=object())
    assert pre.failed is None


def test_stuck_peer_releases_stream_waits_on_notifications(pair):
    """A notification that never comes: wait_notification times out, fails the agent, and the stream made to
    wait on that slot is released (it drains); every later call raises the error."""
    pre, dec, a0, a1 = pair
    pre.register_group("g", 4, [a0.tensor((4, 4, 8))])
    dec.register_group("g", 4, [a1.tensor((4, 4, 8))])
    p_of_dec, _ = _connect(pre, dec)
    plat = dec.platform
    s = plat.create_stream(1)
    try:
        dec.stream_wait_notification(s, 7, 1)            # nobody will notify slot 7
        with pytest.raises(TransferTimeout, match="notification slot 7"):
            dec.wait_notification(7, 1, timeout_s=0.1)
        assert plat.synchronize(s, 60)                  # released by the failure
        with pytest.raises(TransferTimeout, match="notification slot 7"):
            dec.prepare(p_of_dec, "pull", local_blocks={"g": [0]}, remote_blocks={"g": [1]})
        with pytest.raises(TransferTimeout, match="notification slot 7"):
            dec.notification(7)
        x = pre.prepare(pre.peer("decode"), "push", local_blocks={"g": [0]}, remote_blocks={"g": [1]})
        x.post().wait(60)                               # the other agent is unaffected
    finally:
        s.close()


def test_close_releases_a_post_on_the_callers_stream_stuck_on_a_dead_peer(pack_pair):
    """A pack destination posted on the caller's stream, its source never posts: close waits (bounded) for the
    post, releases the waits, drains that stream too, then frees the flag words and the staging."""
    pre, dec, a0, a1 = pack_pair
    pre.register_group("g", 4, [a0.tensor((4, 4, 8))])
    dec.register_group("g", 4, [a1.tensor((4, 4, 8))])
    p_of_dec, _ = _connect(pre, dec)
    plat = dec.platform
    s = plat.create_stream(1)
    try:
        dec.timeout_s = 2.0
        h = dec.prepare(p_of_dec, "pull", local_blocks={"g": [0]}, remote_blocks={"g": [1]}).post(s)
        waiter = plat.create_stream(1)
        dec.stream_wait_notification(waiter, 9, 1)          # nobody notifies slot 9 either
        words, staging = dec.flags, dec.staging
        dec.close()
        assert h.done() and plat.event_wait(plat.record_event(waiter), 60)
        assert not words.closed and dec.flags is None       # prefill's link to decode holds them
        pre.remove_peer("decode")
        assert words.closed and staging.closed
        assert all(m.closed for m in p_of_dec._mappings) and p_of_dec.flags.stage_mem.closed
    finally:
        s.close()
        waiter.close()


def test_close_keeps_memory_a_wait_it_cannot_release_may_touch(pair):
    """A post held on the caller's stream by a wait the agent cannot release: close gives up after its
    timeout and keeps the flag words and the peer's mappings and flag link (the post later reads and
    writes them) instead of freeing them under it."""
    from gpuxfer.kv import agent as agent_mod
    pre, dec, a0, a1 = pair
    src, dst = _vllm_layers(a0, 1, 4, 4, seed=1), _vllm_layers(a1, 1, 4, 4, seed=2)
    pre.register_group("full", 4, src)
    dec.register_group("full", 4, dst)
    p_of_dec, _ = _connect(pre, dec)
    plat = dec.platform
    gate = plat.alloc(64, 1)
    s = plat.create_stream(1)
    kept = []
    try:
        plat.memset_async(s, gate.ptr, 0, 64)
        plat.wait_flag(s, gate.ptr, 1)
        h = dec.transfer(p_of_dec, "pull", local_blocks={"full": [0]}, remote_blocks={"full": [3]}, stream=s,
                         notify_slot=2)
        dec.timeout_s = 0.1
        expect = [dec.flags, p_of_dec.flags, *p_of_dec._mappings]     # (an in-process peer maps nothing)
        dec.close()
        kept = [m for m in agent_mod._LEAKED if any(m is e for e in expect)]
        assert len(kept) == len(expect) and not any(m.closed for m in kept) and not h.done()
        plat.host_write_flag(gate.ptr, 1, 1)
        assert plat.event_wait(h.event, 60)             # ran through the memory close kept
        assert pre.notification(2) == 1
        for name in src:
            assert _eq(dst[name][:, 0], src[name][:, 3])
    finally:
        plat.host_write_flag(gate.ptr, 1, 1)
        plat.synchronize(s, 30)
        s.close()
        gate.close()
        for m in kept:
            agent_mod._LEAKED.remove(m)
            m.close()


def test_pack_goes_to_one_peer(plat, pack_pair):
    pre, dec, a0, a1 = pack_pair
    other = KVAgent("other", platform=plat, device=1, engine="pack", slot_bytes=512)
    try:
        for ag, ar in ((pre, a0), (dec, a1), (other, a1)):
            ag.register_group("g", 4, [ar.tensor((4, 4, 8))])
        p1, p2 = pre.add_peer(dec.metadata()), pre.add_peer(other.metadata())
        x = pre.prepare(p1, "push", local_blocks={"g": [0]}, remote_blocks={"g": [1]})
        dec.prepare(dec.add_peer(pre.metadata()), "pull", local_blocks={"g": [1]}, remote_blocks={"g": [0]}).post()
        x.post().wait(60)
        with pytest.raises(BadInput, match="another peer"):
            pre.prepare(p2, "push", local_blocks={"g": [0]}, remote_blocks={"g": [1]}).post()
    finally:
        other.close()


def test_flag_probe_bounded_and_keeps_a_stream_with_a_pending_write(pack_pair, monkeypatch):
    """The remote-write probe waits at most the agent's timeout (at most the set-up bound); a write that did not
    complete in time leaves its stream open (kept, not destroyed under it) and signals go by copies."""
    from gpuxfer import flaglink
    pre, dec, a0, a1 = pack_pair
    monkeypatch.setenv("GPUXFER_FLAG_PATH", "auto")
    pre.timeout_s = 0.25
    peer = pre.add_peer(dec.metadata())
    plat = pre.platform
    seen = []

    def stuck(s, timeout_s=60.0):
        seen.append((s, timeout_s))
        return False
    monkeypatch.setattr(plat, "synchronize", stuck)
    try:
        assert peer.flags.probe_one_sided(pre.timeout_s) is False and peer.remote_flags is False
        (s, t), = seen
        assert t == 0.25 and not s.closed and s in flaglink._KEPT
    finally:
        monkeypatch.undo()
        flaglink._KEPT.remove(s)
        plat.synchronize(s, 30)
        s.close()
    assert peer.flags.probe_one_sided(pre.timeout_s) is True      # the host emulation's stream writes land


def test_pack_needs_staging_on_both_sides(plat, pack_pair):
    pre, dec, a0, a1 = pack_pair
    tri = KVAgent("tri", platform=plat, device=1)
    try:
        tri.register_group("g", 4, [a1.tensor((4, 4, 8))])
        pre.register_group("g", 4, [a0.tensor((4, 4, 8))])
        p = pre.add_peer(tri.metadata())
        with pytest.raises(BadInput, match="no staging buffer"):
            pre.prepare(p, "push", local_blocks={"g": [0]}, remote_blocks={"g": [1]})
        with pytest.raises(BadInput, match="do not fit"):
            big = KVAgent("big", platform=plat, device=0, engine="pack", slot_bytes=256)
            big2 = KVAgent("big2", platform=plat, device=1, engine="pack", slot_bytes=256)
            try:
                big.register_group("g", 4, [a0.tensor((4, 4, 128))])
                big2.register_group("g", 4, [a1.tensor((4, 4, 128))])
                big.prepare(big.add_peer(big2.metadata()), "push", local_blocks={"g": [0]}, remote_blocks={"g": [1]})
            finally:
                big2.close()
                big.close()
    finally:
        tri.close()


def test_pack_peers_with_other_staging_slots_are_refused(plat, pack_pair):
    """Each side addresses the pair's staging slots by its own slot size: a peer whose slots differ would take
    chunks past its slots (past its staging) and unpack the wrong bytes; add_peer refuses it, naming both."""
    pre, dec, a0, a1 = pack_pair
    other = KVAgent("other", platform=plat, device=1, engine="pack", slot_bytes=256)
    try:
        with pytest.raises(LayoutMismatch, match="256-byte staging slots.*512"):
            pre.add_peer(other.metadata())
        with pytest.raises(LayoutMismatch, match="512-byte staging slots.*256"):
            other.add_peer(pre.metadata())
        for agent, name in ((pre, "other"), (other, "prefill")):     # nothing of the refused peer kept
            with pytest.raises(NotRegistered):
                agent.peer(name)
        pre.add_peer(dec.metadata())                # equal slots: fine
    finally:
        other.close()


# ----------------------------------------------------------------------------- the copy_engine engine


@pytest.mark.parametrize("op", ["pull", "push"])
def test_copy_engine_moves_tokens_and_matches_the_kernel(plat, op):
    """copy_engine expands on the host (its driver API takes host arrays): the same descriptors as the
    device expansion, the same bytes, different block sizes included."""
    a0, a1 = Arena(plat, 0), Arena(plat, 1)
    agents = {}
    try:
        for eng in ("copy_engine", "triton"):
            agents[eng] = (KVAgent(f"p-{eng}", platform=plat, device=0, engine=eng),
                           KVAgent(f"d-{eng}", platform=plat, device=1, engine=eng))
        src = a0.tensor((2, 8, 8, 3, 2), torch.float16, seed=5)
        dst = a1.tensor((2, 32, 2, 3, 2), torch.float16, seed=6)
        s_ids, d_ids = [3, 6], [9, 1, 30, 4, 7, 0, 12, 2]
        expect = _token_oracle(src, dst, s_ids, d_ids, 8, 2, kv_first=True)
        got = {}
        for eng, (pre, dec) in agents.items():
            pre.register_group("g", 8, {"l": src})
            dec.register_group("g", 2, {"l": dst})
            if op == "pull":
                x = dec.prepare(dec.add_peer(pre.metadata()), "pull", local_blocks={"g": d_ids},
                                remote_blocks={"g": s_ids})
            else:
                x = pre.prepare(pre.add_peer(dec.metadata()), "push", local_blocks={"g": s_ids},
                                remote_blocks={"g": d_ids})
            got[eng] = x.expanded_descriptors()
            if eng == "copy_engine":
                x.post().wait(60)
                assert np.array_equal(dst.numpy().view(np.uint8), expect.view(np.uint8))
        key = lambda a: a[np.lexsort((a[:, 2], a[:, 1], a[:, 0]))]   # noqa: E731
        assert np.array_equal(key(got["copy_engine"]), key(got["triton"]))
    finally:
        for pre, dec in agents.values():
            dec.close()
            pre.close()
        a0.close()
        a1.close()


# ----------------------------------------------------------------------------- the benchmark through the API


@pytest.mark.slow
def test_bench_pack_rows_through_the_agent_at_batch_2(tmp_path, capsys):
    """``gpuxfer bench kv --engine pack``: both sides post every request of a batch by block ID through
    KVAgent's pack engine, every byte verified, with post and setup host costs per request (the default
    run's rows go through KVAgent too: test_kv_bench's end-to-end test)."""
    from gpuxfer.cli import main
    out = tmp_path / "out"
    rc = main(["bench", "kv", "--platform", "host", "--workload", "kv-mla", "--isl", "16", "--page", "16",
               "--batch", "2", "--warmup", "0", "--trials", "1", "--timeout", "60", "--engine", "pack,bulk",
               "--direction", "pull", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    rows = {r["engine"]: r for r in json.loads((out / "kv_bench.json").read_text())["rows"]}
    assert set(rows) == {"pack", "bulk"}
    r = rows["pack"]
    assert r["valid"] and r["wrong_bytes"] == 0 and r["post"] == "host" and r["api"] == "KVAgent"
    assert r["post_p50_us"] > 0 and r["setup_us"] > 0 and r["register_ms"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["pull", "push"])
def test_cuda_reposts_through_the_bound_launchers(op):
    """On CUDA a transfer's posts launch the compiled kernels directly (arguments bound once, the compiled
    kernel found by the arguments' kind); every post moves the current bytes: the source changes between
    posts, the destination follows, on three kinds of stream; a fresh request over other blocks too."""
    from conftest import platform_reason
    why = platform_reason("cuda")
    if why:
        pytest.skip(why)
    from gpuxfer.platforms import get_platform
    plat = get_platform("cuda")
    try:
        g = torch.Generator(device="cuda:0").manual_seed(3)
        src = {f"layers.{i}": torch.randint(-1000, 1000, (2, 32, 16, 2, 64), generator=g, device="cuda:0",
                                            dtype=torch.int16).view(torch.bfloat16) for i in range(3)}
        dst = {k: torch.zeros_like(v) for k, v in src.items()}
        a = KVAgent("pre", platform=plat, device=0)
        b = KVAgent("dec", platform=plat, device=0)
        try:
            a.register_group("full", 16, src)
            b.register_group("full", 16, dst)
            if op == "pull":
                agent, peer = b, b.add_peer(a.metadata())
            else:
                agent, peer = a, a.add_peer(b.metadata())
            own = plat.create_stream(0)
            # the agent's stream and a created one launch on their driver handles; torch's current (default)
            # stream goes through Platform.launch
            streams = (None, own, plat.current_stream(0))
            for s_ids, d_ids in (([3, 9, 0, 31], [1, 2, 30, 7]), ([5, 6], [8, 4])):
                mine, theirs = (d_ids, s_ids) if op == "pull" else (s_ids, d_ids)
                x = agent.prepare(peer, op, local_blocks={"full": mine}, remote_blocks={"full": theirs})
                for k in range(4):
                    for t in src.values():
                        t.view(torch.int16)[:, s_ids] += 1
                    torch.cuda.synchronize()            # the agent's stream does not follow torch's
                    x.post(streams[k % 3]).wait(60)
                    for name in src:
                        assert torch.equal(dst[name].view(torch.int16)[:, d_ids],
                                           src[name].view(torch.int16)[:, s_ids]), (name, k)
            own.close()
        finally:
            b.close()
            a.close()
    finally:
        plat.close()


# ----------------------------------------------------------------------------- the route's ring of slots


def _ring_pair(pre, dec, a0, a1, blocks=24):
    src = _vllm_layers(a0, 2, blocks, 2, seed=1)
    dst = _vllm_layers(a1, 2, blocks, 2, seed=70)
    pre.register_group("full", 2, src)
    dec.register_group("full", 2, dst)
    return src, dst, dec.add_peer(pre.metadata())


def _route_slots(agent):
    (route,) = [r for r in agent._routes.values() if r.slots]
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
    assert slot.rows == 4 and small.descriptors == 4          # 2 layers x K, V
    big_d, big_s = list(range(5, 15)), list(range(10, 20))
    big = dec.prepare(peer, "pull", local_blocks={"full": big_d}, remote_blocks={"full": big_s})
    big.post().wait(60)
    (grown,) = _route_slots(dec)
    assert grown is not slot and grown.rows >= max(big.descriptors, 8) and grown.entries >= 8
    for name in src:
        assert _eq(dst[name][:, big_d], src[name][:, big_s]) and _eq(dst[name][:, 3], src[name][:, 0])
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
            assert _eq(dst[name][:, [3, 4]], src[name][:, [0, 1]])
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
    pre = KVAgent("p", platform=plat, device=0)
    dec = KVAgent("d", platform=plat, device=1)
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
            assert _eq(dst[name], want), name
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
    (route,) = [r for r in dec._routes.values() if r.slots]
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
        assert _eq(dst[name][:, [1, 2, 3]], src[name][:, [4, 5, 6]])


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["pull", "push"])
def test_cuda_slot_graphs_grow_interleave_and_stay_in_bounds(op, monkeypatch):
    """On CUDA: posts replay the slot's graph (captured once), a larger request remakes the slot, requests
    interleaved over three streams all land, and a forged request array writes nothing outside the
    destination's layers (the bytes around them and the whole source side keep their values); honest
    posts afterwards move every byte again."""
    from conftest import platform_reason
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
    a = KVAgent("pre", platform=plat, device=0)
    b = KVAgent("dec", platform=plat, device=0)
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
        (route,) = [r for r in agent._routes.values() if r.slots]
        (first,) = route.slots
        assert agent.graphs and first.graph is not None
        xs[1].post().wait(60)
        assert route.slots[0] is not first and route.slots[0].rows >= xs[1].descriptors
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
        a, b = KVAgent("pre", platform=plat, device=0), KVAgent("dec", platform=plat, device=0)
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
    from conftest import platform_reason
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
    forged = _reblob(body)
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
    from gpuxfer.kv.slots import _RequestPool
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
    _connect(pre, dec)
    x = dec.prepare(np.str_("prefill"), "pull", local_blocks={"g": [0]}, remote_blocks={"g": [1]})
    assert x.peer is dec.peer("prefill")


def test_a_peer_removed_while_its_route_is_built_leaves_no_route(pair, monkeypatch):
    """remove_peer running while another call builds a route to that peer: the route is not cached, and the
    peer added again under the same name gets routes of its own (never the removed peer's mappings)."""
    pre, dec, a0, a1 = pair
    pre.register_group("g", 4, [a0.tensor((4, 4, 8))])
    dec.register_group("g", 4, [a1.tensor((4, 4, 8))])
    _connect(pre, dec)
    old = dec.peer("prefill")
    dec._routes.clear()
    build = type(dec)._build_route
    built = []

    def build_then_remove(self, peer, *a, **kw):
        route = build(self, peer, *a, **kw)
        if peer is old and old.name in self._peers:
            built.append(route)
            self.remove_peer(old.name)           # (as another thread would, mid-build)
        return route

    monkeypatch.setattr(type(dec), "_build_route", build_then_remove)
    dec.prepare(old, "pull", local_blocks={"g": [0]}, remote_blocks={"g": [1]})
    assert built and not any(r is built[0] for r in dec._routes.values())
    monkeypatch.undo()
    new = dec.add_peer(pre.metadata())
    x = dec.prepare("prefill", "pull", local_blocks={"g": [0]}, remote_blocks={"g": [1]})
    assert x.peer is new and x.route is not built[0]


@pytest.mark.parametrize("engine", ["triton", "copy_engine", "pack"])
def test_warm_up_changes_no_byte_and_leaves_no_peer(plat, engine):
    """warm_up's pull of block 0 onto itself through a mirror agent: every cache byte as before, the mirror gone,
    a real request with a peer afterwards still moves the right bytes; pack agents do nothing."""
    a0, a1 = Arena(plat, 0), Arena(plat, 1)
    pre = KVAgent("prefill", platform=plat, device=0, timeout_s=60, engine=engine)
    dec = KVAgent("decode", platform=plat, device=1, timeout_s=60, engine=engine)
    try:
        src, dst = _vllm_layers(a0, 2, 6, 4, seed=1), _vllm_layers(a1, 2, 6, 4, seed=50)
        pre.register_group("full", 4, src)
        dec.register_group("full", 4, dst)
        before = {k: v.clone() for k, v in dst.items()}
        took = dec.warm_up()
        assert took == 0.0 if engine == "pack" else took > 0.0
        assert dec._peers == {} and dec._routes == {}
        for name in dst:
            assert _eq(dst[name], before[name])
        if engine == "pack":
            return
        peer = dec.add_peer(pre.metadata())
        dec.prepare(peer, "pull", local_blocks={"full": [2, 5]}, remote_blocks={"full": [4, 1]}).post().wait(60)
        for name in src:
            assert _eq(dst[name][:, [2, 5]], src[name][:, [4, 1]])
            assert _eq(dst[name][:, [0, 1, 3, 4]], before[name][:, [0, 1, 3, 4]])
    finally:
        dec.close()
        pre.close()
        a0.close()
        a1.close()
