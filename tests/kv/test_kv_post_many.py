"""KVAgent.post_many: several prepared requests in one post -- one upload and one launch per route, every
byte of every request where it belongs, requests whose destinations overlap run in order, bad input refused
before anything is queued."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from gpuxfer.errors import BadInput, NotRegistered
from gpuxfer.kv import batch
from gpuxfer.kv.agent import KVAgent, KVLayerSpec

from _agent_arena import Arena, connect, same_bytes, token_oracle, vllm_layers


@pytest.fixture
def bpair(platform):
    """Two agents (prefill, decode) and their arenas on every platform present: the host emulation (devices 0
    and 1) and, with -m gpu, CUDA (both on device 0 where only one is present)."""
    d1 = 1 if platform.device_count() > 1 else 0
    a0, a1 = Arena(platform, 0, 1 << 20), Arena(platform, d1, 1 << 20)
    pre = KVAgent("prefill", platform=platform, device=0, engine="triton", timeout_s=60)
    dec = KVAgent("decode", platform=platform, device=d1, engine="triton", timeout_s=60)
    yield pre, dec, a0, a1
    dec.close()
    pre.close()
    a0.close()
    a1.close()


def _full(pre, dec, a0, a1, layers: int, blocks: int, bt: int, seed: int):
    """Group "full" of vLLM-shaped layers registered on both agents: ``(source layers, destination layers)``."""
    src = vllm_layers(a0, layers, blocks, bt, seed=seed)
    dst = vllm_layers(a1, layers, blocks, bt, seed=seed + 1)
    pre.register_group("full", bt, src)
    dec.register_group("full", bt, dst)
    return src, dst


def _count_uploads(agent, monkeypatch) -> list:
    """Every upload of a request array into a slot on the agent's stream, recorded: a copy of its own (its bytes)
    or a slot's folded graph ("folded": the upload is the graph's first node)."""
    seen = []
    calls = agent._poster.calls
    copy, launch = calls.copy, calls.launch_graph

    def counted(dst, src, n):
        seen.append(n)
        return copy(dst, src, n)

    def launched(graph):
        slots = [s for r in agent._routes.routes.values() for s in r.slots]
        folded = [s.folded for s in slots] + [s.checked.folded for s in slots if s.checked is not None]
        if any(graph is g for g in folded):
            seen.append("folded")
        return launch(graph)
    monkeypatch.setattr(calls, "copy", counted)
    monkeypatch.setattr(calls, "launch_graph", launched)
    return seen


def test_one_upload_for_a_route_every_byte(bpair, monkeypatch):
    pre, dec, a0, a1 = bpair
    src, dst = _full(pre, dec, a0, a1, 2, 12, 4, seed=1)
    peer, _ = connect(pre, dec)
    reqs = [([3, 0, 7], [1, 5, 2]), ([9], [11]), ([4, 10], [0, 8])]
    xs = [dec.prepare(peer, "pull", local_blocks={"full": d}, remote_blocks={"full": s}, name=f"r{i}")
          for i, (s, d) in enumerate(reqs)]
    before = {k: v.clone() for k, v in dst.items()}
    uploads = _count_uploads(dec, monkeypatch)
    hs = dec.post_many(xs)
    assert len(uploads) == 1                                    # one request array for the three
    assert [h.name for h in hs] == ["r0", "r1", "r2"]
    assert len({id(h.event) for h in hs}) == 1
    for h in hs:
        h.wait(60)
        assert h.done()
    written = [d for _, ds in reqs for d in ds]
    for name in src:
        for s_ids, d_ids in reqs:
            for s, d in zip(s_ids, d_ids):
                assert same_bytes(dst[name][:, d], src[name][:, s])
        rest = [b for b in range(12) if b not in written]
        assert same_bytes(dst[name][:, rest], before[name][:, rest])


@pytest.mark.parametrize("largest", [None, 1, 0])
def test_host_id_requests_merge_only_while_each_is_small(bpair, monkeypatch, largest):
    """Host-ID requests merge into one upload while each request array holds at most ``MERGE_ENTRIES`` entries
    (set here to the largest request's entries, or one fewer, or to what no request reaches); a batch holding
    a larger one is posted one request after another (an upload each), every byte where it belongs either way."""
    pre, dec, a0, a1 = bpair
    src, dst = _full(pre, dec, a0, a1, 2, 12, 4, seed=3)
    peer, _ = connect(pre, dec)
    reqs = [([3, 0, 7], [1, 5, 2]), ([9], [11]), ([4, 10], [0, 8])]
    xs = [dec.prepare(peer, "pull", local_blocks={"full": d}, remote_blocks={"full": s}) for s, d in reqs]
    most = max(x._entries for x in xs)
    monkeypatch.setattr(batch, "MERGE_ENTRIES", {None: most, 1: most - 1, 0: 0}[largest])
    uploads = _count_uploads(dec, monkeypatch)
    for h in dec.post_many(xs):
        h.wait(60)
    assert len(uploads) == (1 if largest is None else len(reqs)), uploads
    for name in src:
        for s_ids, d_ids in reqs:
            for s_, d in zip(s_ids, d_ids):
                assert same_bytes(dst[name][:, d], src[name][:, s_])


@pytest.mark.parametrize("op", ["pull", "push"])
@pytest.mark.parametrize("bs, bd", [(8, 2), (2, 8)])
def test_block_sizes_differ_partial_blocks(bpair, op, bs, bd):
    """Requests whose last larger block is partly used: each request's tokens land in its own blocks (the
    padding between requests moves nothing)."""
    pre, dec, a0, a1 = bpair
    nb_s, nb_d = 96 // bs, 96 // bd
    src = a0.tensor((2, nb_s, bs, 3, 2), torch.float16, seed=3)
    dst = a1.tensor((2, nb_d, bd, 3, 2), torch.float16, seed=4)
    pre.register_group("g", bs, {"l0": src})
    dec.register_group("g", bd, {"l0": dst})
    p_of_dec, p_of_pre = connect(pre, dec)
    rng = np.random.default_rng(1)
    s_perm, d_perm = rng.permutation(nb_s), rng.permutation(nb_d)
    expect = dst.cpu().clone()
    xs, si, di = [], 0, 0
    for k, tokens in enumerate((10, 3, 17)):            # none a multiple of the larger block
        s_ids = s_perm[si:si + -(-tokens // bs)]
        d_ids = d_perm[di:di + -(-tokens // bd)]
        si, di = si + len(s_ids), di + len(d_ids)
        want = token_oracle(src.cpu(), expect, s_ids, d_ids, bs, bd, kv_first=True)
        expect = torch.from_numpy(want).view(torch.float16) if want.dtype != np.float16 else torch.from_numpy(want)
        if op == "pull":
            xs.append(dec.prepare(p_of_dec, "pull", local_blocks={"g": d_ids}, remote_blocks={"g": s_ids}))
        else:
            xs.append(pre.prepare(p_of_pre, "push", local_blocks={"g": s_ids}, remote_blocks={"g": d_ids}))
    agent = dec if op == "pull" else pre
    for h in agent.post_many(xs):
        h.wait(60)
    assert np.array_equal(dst.cpu().numpy().view(np.uint8), expect.numpy().view(np.uint8))


def test_overlapping_destinations_run_in_order(bpair, monkeypatch):
    """Two requests writing the same block: not merged; posted one after another, the later one's bytes stay."""
    pre, dec, a0, a1 = bpair
    src, dst = _full(pre, dec, a0, a1, 1, 8, 2, seed=5)
    peer, _ = connect(pre, dec)
    a = dec.prepare(peer, "pull", local_blocks={"full": [1, 2]}, remote_blocks={"full": [3, 4]})
    b = dec.prepare(peer, "pull", local_blocks={"full": [2, 6]}, remote_blocks={"full": [5, 0]})
    uploads = _count_uploads(dec, monkeypatch)
    hs = dec.post_many([a, b])
    for h in hs:
        h.wait(60)
    assert len(uploads) == 2
    (name,) = src
    assert same_bytes(dst[name][:, 1], src[name][:, 3])
    assert same_bytes(dst[name][:, 2], src[name][:, 5])         # b's, posted after a's
    assert same_bytes(dst[name][:, 6], src[name][:, 0])


@pytest.mark.parametrize("merge_from", [1, 8])
def test_routes_notifications_and_cut_batches(bpair, monkeypatch, merge_from):
    """Two routes (different groups), notifications of the merged ones in order, and a batch cut in two by the
    descriptor budget, each part merged or (fewer requests than ``MERGE_FROM``) posted one by one: every byte,
    and the peer's notification word counts every notifying request."""
    pre, dec, a0, a1 = bpair
    src, dst = _full(pre, dec, a0, a1, 2, 10, 2, seed=7)
    slab_s, slab_d = a0.tensor((6, 2, 40), seed=9), a1.tensor((6, 2, 40), seed=10)
    pre.register_group("slab", 2, {"s": slab_s})
    dec.register_group("slab", 2, {"s": slab_d})
    peer, _ = connect(pre, dec)
    monkeypatch.setattr(batch, "BATCH_ROWS", 16)      # each "full" request has 2 layers x 2 pieces x 2 = 8 rows
    monkeypatch.setattr(batch, "MERGE_FROM", merge_from)
    merged, post_route = [], batch._post_route
    monkeypatch.setattr(batch, "_post_route", lambda poster, xs, s: merged.append(len(xs)) or post_route(poster, xs, s))
    xs = [dec.prepare(peer, "pull", local_blocks={"full": [2 * i, 2 * i + 1]},
                      remote_blocks={"full": [9 - 2 * i, 8 - 2 * i]}, notify_slot=3) for i in range(4)]
    xs.insert(2, dec.prepare(peer, "pull", local_blocks={"slab": [5, 0]}, remote_blocks={"slab": [1, 2]}))
    hs = dec.post_many(xs)
    for h in hs:
        h.wait(60)
    assert [h.notify_value for h in hs] == [1, 2, None, 3, 4]
    # the "full" route's two parts merged or posted one by one (never cut where slots copy from the IDs); the
    # "slab" route's one request
    assert merged == ([4, 1] if dec._poster.blocks else [2, 2, 1] if merge_from == 1 else [1])
    assert pre.wait_notification(3, 4, timeout_s=30) >= 4
    for name in src:
        for i in range(4):
            assert same_bytes(dst[name][:, [2 * i, 2 * i + 1]], src[name][:, [9 - 2 * i, 8 - 2 * i]])
    assert same_bytes(slab_d[[5, 0]], slab_s[[1, 2]])


def test_bad_batches_refused_before_anything_moves(pair, plat):
    pre, dec, a0, a1 = pair
    src, dst = _full(pre, dec, a0, a1, 1, 4, 2, seed=11)
    peer, _ = connect(pre, dec)
    x = dec.prepare(peer, "pull", local_blocks={"full": [0]}, remote_blocks={"full": [1]})
    with pytest.raises(BadInput, match="sequence"):
        dec.post_many(x)
    with pytest.raises(BadInput, match="item 1"):
        dec.post_many([x, "r2"])
    with pytest.raises(BadInput, match="twice"):
        dec.post_many([x, x])
    other = KVAgent("other", platform=plat, device=1, engine="triton")
    try:
        other.register_group("full", 2, vllm_layers(a1, 1, 4, 2, seed=13))
        z = other.prepare(other.add_peer(pre.metadata()), "pull", local_blocks={"full": [0]},
                          remote_blocks={"full": [1]})
        with pytest.raises(BadInput, match="item 1 .* not a transfer prepared by agent 'decode'"):
            dec.post_many([x, z])
    finally:
        other.close()
    before = {k: v.clone() for k, v in dst.items()}
    y = dec.prepare(peer, "pull", local_blocks={"full": [2]}, remote_blocks={"full": [3]})
    dec.remove_peer(peer)
    with pytest.raises(NotRegistered):
        dec.post_many([x, y])
    for k in dst:
        assert same_bytes(dst[k], before[k])
    assert dec.post_many([]) == []


def test_a_route_s_batch_with_a_transfer_twice_or_an_unhashable_item_is_refused(pair):
    """A batch of one route's requests naming one of them twice, or holding an item that does not hash (a list,
    a dict): BadInput before anything is queued, not a TypeError."""
    pre, dec, a0, a1 = pair
    src, dst = _full(pre, dec, a0, a1, 1, 8, 2, seed=12)
    peer, _ = connect(pre, dec)
    xs = [dec.prepare(peer, "pull", local_blocks={"full": [i]}, remote_blocks={"full": [7 - i]}) for i in range(4)]
    before = {k: v.clone() for k, v in dst.items()}
    with pytest.raises(BadInput, match="twice"):
        dec.post_many([*xs, xs[2]])
    with pytest.raises(BadInput, match="item 4"):
        dec.post_many([*xs, [1]])
    with pytest.raises(BadInput, match="item 0"):
        dec.post_many([{}, *xs])
    for k in dst:
        assert same_bytes(dst[k], before[k])
    for h in dec.post_many(xs):
        h.wait(60)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_batches_against_posts_one_by_one(plat, data):
    """Hypothesis: a batch of requests (random counts, ratios, groups, notifications) moved by post_many leaves
    the destination exactly as posting them one by one does, in a second pair of agents."""
    bs = data.draw(st.sampled_from([1, 2, 4]), label="source block")
    bd = data.draw(st.sampled_from([1, 2, 4] if bs == 1 else [1, bs]), label="destination block")
    if bs > 1 and bd > 1:
        bd = bs
    nb_s, nb_d = 48 // bs, 48 // bd
    sides = []
    for run in range(2):
        a0, a1 = Arena(plat, 0, 1 << 15), Arena(plat, 1, 1 << 15)
        pre = KVAgent(f"p{run}", platform=plat, device=0, engine="triton")
        dec = KVAgent(f"d{run}", platform=plat, device=1, engine="triton")
        src = a0.tensor((2, nb_s, bs, 3), seed=1)
        dst = a1.tensor((2, nb_d, bd, 3), seed=2)
        pre.register_group("g", bs, {"l": src})
        dec.register_group("g", bd, {"l": dst})
        sides.append((a0, a1, pre, dec, dst, connect(pre, dec)[0]))
    try:
        n_req = data.draw(st.integers(1, 5), label="requests")
        s_perm = data.draw(st.permutations(range(nb_s)), label="source blocks")
        d_perm = data.draw(st.permutations(range(nb_d)), label="destination blocks")
        overlap = data.draw(st.booleans(), label="destinations may repeat")
        reqs, si, di = [], 0, 0
        for _ in range(n_req):
            tokens = data.draw(st.integers(1, 6), label="tokens")
            ns, nd = -(-tokens // bs), -(-tokens // bd)
            if si + ns > nb_s or di + nd > nb_d:
                break
            reqs.append((list(s_perm[si:si + ns]), list(d_perm[di:di + nd]),
                         data.draw(st.sampled_from([None, 0, 5]), label="notify")))
            si += ns
            di = di + nd if not overlap else max(0, di + nd - 1)
        for k, (a0, a1, pre, dec, dst, peer) in enumerate(sides):
            xs = [dec.prepare(peer, "pull", local_blocks={"g": d}, remote_blocks={"g": s}, notify_slot=n)
                  for s, d, n in reqs]
            hs = dec.post_many(xs) if k == 0 else [x.post() for x in xs]
            for h in hs:
                h.wait(60)
        assert same_bytes(sides[0][4], sides[1][4])
    finally:
        for a0, a1, pre, dec, _, _ in sides:
            dec.close()
            pre.close()
            a0.close()
            a1.close()


def test_other_engines_post_one_by_one(plat):
    """copy_engine transfers (no slot to merge into) in a post_many: each posted as post() would, every byte."""
    a0, a1 = Arena(plat, 0), Arena(plat, 1)
    pre = KVAgent("p", platform=plat, device=0, engine="copy_engine")
    dec = KVAgent("d", platform=plat, device=1, engine="copy_engine")
    try:
        src, dst = _full(pre, dec, a0, a1, 2, 6, 2, seed=21)
        peer, _ = connect(pre, dec)
        reqs = [([0, 1], [5, 4]), ([2], [3])]
        xs = [dec.prepare(peer, "pull", local_blocks={"full": d}, remote_blocks={"full": s}) for s, d in reqs]
        hs = dec.post_many(xs)
        assert len({id(h.event) for h in hs}) == 2
        for h in hs:
            h.wait(60)
        for name in src:
            for s_ids, d_ids in reqs:
                assert same_bytes(dst[name][:, d_ids], src[name][:, s_ids])
    finally:
        dec.close()
        pre.close()
        a0.close()
        a1.close()


def test_an_error_after_some_posts_carries_their_handles(pair, plat, monkeypatch):
    """A batch over two routes whose second post fails: the first is queued and lands, and the error says so
    (its ``handles``); nothing of the second moved."""
    from gpuxfer.errors import TransferTimeout
    pre, dec, a0, a1 = pair
    src, dst = _full(pre, dec, a0, a1, 1, 6, 2, seed=31)
    other = KVAgent("prefill-2", platform=plat, device=0, engine="triton")
    try:
        other.register_group("full", 2, vllm_layers(a0, 1, 6, 2, seed=33))
        p1, _ = connect(pre, dec)
        p2 = dec.add_peer(other.metadata())
        before = {k: v.clone() for k, v in dst.items()}
        x1 = dec.prepare(p1, "pull", local_blocks={"full": [0, 1]}, remote_blocks={"full": [4, 5]})
        x2 = dec.prepare(p2, "pull", local_blocks={"full": [2]}, remote_blocks={"full": [3]})
        take, calls = dec._poster.take_slot, []

        def failing(*a, **k):
            calls.append(1)
            if len(calls) == 2:
                raise TransferTimeout(rank=0, step=0, flag="a free slot", expected=1, seen=0, timeout_s=1.0,
                                      what="test")
            return take(*a, **k)
        monkeypatch.setattr(dec._poster, "take_slot", failing)
        with pytest.raises(TransferTimeout) as info:
            dec.post_many([x1, x2])
        h1, h2 = info.value.handles
        assert h2 is None and h1 is not None
        h1.wait(60)
        (name,) = src
        assert same_bytes(dst[name][:, [0, 1]], src[name][:, [4, 5]])
        assert same_bytes(dst[name][:, 2], before[name][:, 2])
    finally:
        other.close()


def test_a_merged_post_failing_late_keeps_its_array_until_the_stream_drained(pair, monkeypatch):
    """The event of a merged post cannot be recorded: the upload may still read the merged array, so it stays
    out of the pool until the stream drained (and the error reaches the caller)."""
    from gpuxfer.errors import GpuxferError
    pre, dec, a0, a1 = pair
    src, dst = _full(pre, dec, a0, a1, 1, 6, 2, seed=41)
    peer, _ = connect(pre, dec)
    xs = [dec.prepare(peer, "pull", local_blocks={"full": [i]}, remote_blocks={"full": [5 - i]}) for i in range(3)]
    drained = []
    sync = dec.platform.synchronize

    def recording_sync(s, timeout_s=60.0):
        drained.append(s)
        return sync(s, timeout_s)
    record = dec.platform.record_event
    state = {"fail": True}

    def failing_record(s):
        if state["fail"]:
            state["fail"] = False
            raise GpuxferError("test: no event")
        return record(s)
    monkeypatch.setattr(dec.platform, "synchronize", recording_sync)
    monkeypatch.setattr(dec.platform, "record_event", failing_record)
    with pytest.raises(GpuxferError, match="no event") as info:
        dec.post_many(xs)
    assert drained == [dec.stream]
    assert info.value.handles == [None, None, None]


def test_one_transfer_posts_as_post_does(pair):
    """``post_many`` of one transfer is its ``post``: the bytes land, and an error (here the peer removed) carries
    ``handles == [None]`` as a batch's error does."""
    from gpuxfer.errors import GpuxferError
    pre, dec, a0, a1 = pair
    src, dst = _full(pre, dec, a0, a1, 1, 6, 2, seed=43)
    peer, _ = connect(pre, dec)
    x = dec.prepare(peer, "pull", local_blocks={"full": [1]}, remote_blocks={"full": [4]})
    [h] = dec.post_many([x])
    h.wait(60)
    for name in src:
        assert same_bytes(dst[name][:, 1], src[name][:, 4])
    y = dec.prepare(peer, "pull", local_blocks={"full": [2]}, remote_blocks={"full": [3]})
    dec.remove_peer(peer)
    with pytest.raises(GpuxferError) as info:
        dec.post_many([y])
    assert info.value.handles == [None]


def test_remove_peer_waits_for_a_merged_post_with_it(platform):
    """A merged post (one request for several transfers) still queued when its peer is removed: ``remove_peer``
    waits for it (here the stream is held past the agent's timeout: the agent fails, the peer's memory is kept),
    never unmaps memory the post still reads."""
    a0, a1 = Arena(platform, 0, 1 << 20), Arena(platform, 0, 1 << 20)
    pre = KVAgent("prefill", platform=platform, device=0, engine="triton", timeout_s=60)
    dec = KVAgent("decode", platform=platform, device=0, engine="triton", timeout_s=0.5)
    try:
        _full(pre, dec, a0, a1, 1, 8, 2, seed=11)
        peer, _ = connect(pre, dec)
        gate = platform.alloc(64, 0)
        platform.host_write_flag(gate.ptr, 0, 0)
        platform.wait_flag(dec.stream, gate.ptr, 1)
        xs = [dec.prepare(peer, "pull", local_blocks={"full": [d]}, remote_blocks={"full": [s]}, name=f"r{d}")
              for s, d in ((3, 1), (4, 2))]
        hs = dec.post_many(xs)
        assert len({id(h.event) for h in hs}) == 1          # merged
        dec.remove_peer(peer)
        assert dec.failed is not None and "removing the peer" in str(dec.failed)
        platform.host_write_flag(gate.ptr, 1, 0)
        platform.synchronize(dec.stream, 30)
        gate.close()
    finally:
        dec.close()
        pre.close()
        a0.close()
        a1.close()


def test_a_request_refused_after_others_of_its_route_were_queued_carries_their_handles(pair):
    """A route's batch posted one request after another (host and device IDs mixed) whose later request is
    refused at its post (a tensor of its IDs moved since prepare): the requests queued before it are in the
    error's ``handles`` and land; the refused one moved nothing."""
    from gpuxfer.errors import BlockIdError
    pre, dec, a0, a1 = pair
    src, dst = _full(pre, dec, a0, a1, 1, 6, 2, seed=51)
    peer, _ = connect(pre, dec)
    (name,) = src
    before = dst[name].clone()
    host = dec.prepare(peer, "pull", local_blocks={"full": [0, 1]}, remote_blocks={"full": [4, 5]})
    ids = torch.tensor([3], dtype=torch.int64, device=dec._torch_device())
    moved = dec.prepare(peer, "pull", local_blocks={"full": ids},
                        remote_blocks={"full": torch.tensor([2], dtype=torch.int64, device=dec._torch_device())},
                        device_ids=True, name="moved")
    ids.set_(torch.tensor([3], dtype=torch.int64, device=dec._torch_device()))
    with pytest.raises(BlockIdError, match="'moved'.*moved to other memory") as info:
        dec.post_many([host, moved])
    h_host, h_moved = info.value.handles
    assert h_moved is None and h_host is not None
    h_host.wait(60)
    assert same_bytes(dst[name][:, [0, 1]], src[name][:, [4, 5]])
    assert same_bytes(dst[name][:, 2:], before[:, 2:])


def test_overlapping_requests_failing_part_way_carry_the_queued_handles(pair, monkeypatch):
    """Requests of one route writing the same block run one after another; the second's post failing (no free
    slot) leaves the first's handle in the error's ``handles``."""
    from gpuxfer.errors import TransferTimeout
    pre, dec, a0, a1 = pair
    src, dst = _full(pre, dec, a0, a1, 1, 6, 2, seed=53)
    peer, _ = connect(pre, dec)
    xs = [dec.prepare(peer, "pull", local_blocks={"full": [0, 1]}, remote_blocks={"full": [4, 5]}),
          dec.prepare(peer, "pull", local_blocks={"full": [1]}, remote_blocks={"full": [3]})]
    take, calls = dec._poster.take_slot, []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise TransferTimeout(rank=0, step=0, flag="a free slot", expected=1, seen=0, timeout_s=1.0, what="test")
        return take(*a, **k)
    monkeypatch.setattr(dec._poster, "take_slot", failing)
    with pytest.raises(TransferTimeout) as info:
        dec.post_many(xs)
    h1, h2 = info.value.handles
    assert h2 is None and h1 is not None
    h1.wait(60)
    (name,) = src
    assert same_bytes(dst[name][:, [0, 1]], src[name][:, [4, 5]])


def test_handles_of_a_merged_post_hold_what_a_post_s_handle_holds():
    """``KVTransferHandle._together`` (a merged post's handles, made without a call each) sets every field that
    ``KVTransferHandle.__init__`` sets, to the same values."""
    from types import SimpleNamespace
    from gpuxfer.kv.transfer import KVTransferHandle
    xs = [SimpleNamespace(name=f"r{i}") for i in range(3)]
    event, stream, status, landed = object(), object(), object(), object()
    for values in (None, [7, None, 9]):
        made = KVTransferHandle._together(xs, event, stream, values, status, landed)
        for x, v, h in zip(xs, values or [None] * 3, made):
            one = KVTransferHandle(x, event, stream, v, status, landed)
            assert type(h) is KVTransferHandle
            for field in KVTransferHandle.__slots__:
                assert getattr(h, field) is getattr(one, field), field


def _four_group_pair(plat, run: str, nb: int):
    """Prefill/decode agents over four groups of ``nb`` destination blocks: "same" (4-token blocks on both
    sides), "down" (8-token source blocks, 2-token destination blocks: a merge pads the destination side), and
    "mla"/"swa" laid over one slab on each side (a block ID names memory of both). ``(arenas, agents, decode's
    peer)``."""
    a0, a1 = Arena(plat, 0, 1 << 18), Arena(plat, 1, 1 << 18)
    pre = KVAgent(f"prefill-{run}", platform=plat, device=0, engine="triton", timeout_s=60)
    dec = KVAgent(f"decode-{run}", platform=plat, device=1, engine="triton", timeout_s=60)
    pre.register_group("same", 4, {"same": a0.tensor((2, nb, 4, 2), seed=1)})
    dec.register_group("same", 4, {"same": a1.tensor((2, nb, 4, 2), seed=2)})
    pre.register_group("down", 8, {"down": a0.tensor((2, nb // 2, 8, 2), seed=3)})
    dec.register_group("down", 2, {"down": a1.tensor((2, nb, 2, 2), seed=4)})
    for k, (agent, arena) in enumerate(((pre, a0), (dec, a1))):
        slab = arena.tensor((nb * 96,), seed=5 + k)
        agent.register_group("mla", 4, {"mla": KVLayerSpec(slab, nb, 96, [(0, 64)])})
        agent.register_group("swa", 4, {"swa": KVLayerSpec(slab, nb, 96, [(64, 32)])})
    return (a0, a1), (pre, dec), connect(pre, dec)[0]


@pytest.mark.parametrize("mode", ["descriptors", "blocks"])
@pytest.mark.parametrize("repeat", [None, "same", "down", "mla-swa"])
def test_a_destination_two_requests_of_a_large_batch_name_is_found(plat, monkeypatch, mode, repeat):
    """24 requests over four groups (one padded in a merge, two over one slab), each request's destinations
    distinct: merged into one upload; with one block named by requests 2 and 21 (in one group, in the padded
    group, or as "mla" by one and "swa" by the other, the same memory), posted one by one -- in both slot kinds,
    every destination byte as the batch cut between the two leaves it."""
    monkeypatch.setenv("GPUXFER_KV_COPY", mode)
    nb, n = 64, 24
    rng = np.random.default_rng(17)
    same, down, slab = rng.permutation(nb), rng.permutation(nb), rng.permutation(nb)
    reqs = []
    for r in range(n):
        dst = {"same": same[2 * r:2 * r + 2].copy(), "down": down[2 * r:2 * r + 2].copy(),
               "mla": slab[2 * r:2 * r + 1].copy(), "swa": slab[2 * r + 1:2 * r + 2].copy()}
        src = {"same": rng.integers(0, nb, 2), "down": rng.integers(0, nb // 2, 1),
               "mla": rng.integers(0, nb, 1), "swa": rng.integers(0, nb, 1)}
        reqs.append((src, dst))
    if repeat == "same":
        reqs[21][1]["same"][0] = reqs[2][1]["same"][1]
    elif repeat == "down":
        reqs[21][1]["down"][1] = reqs[2][1]["down"][0]
    elif repeat == "mla-swa":
        reqs[21][1]["swa"][0] = reqs[2][1]["mla"][0]
    after = []
    for run in ("batch", "posts"):
        arenas, agents, peer = _four_group_pair(plat, f"{mode}-{run}", nb)
        dec = agents[1]
        try:
            assert dec._poster.blocks == (mode == "blocks")
            xs = [dec.prepare(peer, "pull", local_blocks=d, remote_blocks=s, name=f"r{i}")
                  for i, (s, d) in enumerate(reqs)]
            if run == "batch":
                uploads = _count_uploads(dec, monkeypatch)
                hs = dec.post_many(xs)
                assert len(uploads) == (1 if repeat is None else n)
            else:               # in order, the two requests naming one block in two batches
                hs = dec.post_many(xs[:21]) + dec.post_many(xs[21:])
            for h in hs:
                h.wait(60)
            after.append(arenas[1].flat.clone())
        finally:
            for ag in agents[::-1]:
                ag.close()
            for a in arenas:
                a.close()
    assert same_bytes(after[0], after[1])


@pytest.mark.parametrize("mode", ["descriptors", "blocks"])
def test_device_ids_naming_one_destination_in_a_batch(plat, monkeypatch, mode):
    """Four device-ID requests of 8 rows, the first and the last naming destination block 1, with a budget of 16
    rows: slots without descriptors merge the batch and its check fails as a whole (nothing moves, every handle
    raises BlockIdError); descriptor slots cut it into two parts, each checked as a whole, and every request
    moves, in the batch's order (block 1 ends with the last one's bytes)."""
    from gpuxfer.errors import BlockIdError
    monkeypatch.setenv("GPUXFER_KV_COPY", mode)
    monkeypatch.setattr(batch, "BATCH_ROWS", 16)
    a0, a1 = Arena(plat, 0, 1 << 18), Arena(plat, 1, 1 << 18)
    pre = KVAgent("prefill", platform=plat, device=0, engine="triton", timeout_s=60)
    dec = KVAgent("decode", platform=plat, device=1, engine="triton", timeout_s=60)
    try:
        src, dst = vllm_layers(a0, 2, 12, 2, seed=5), vllm_layers(a1, 2, 12, 2, seed=6)
        pre.register_group("full", 2, src)
        dec.register_group("full", 2, dst)
        peer, _ = connect(pre, dec)
        before = {k: v.clone() for k, v in dst.items()}

        def on(ids):
            return torch.tensor(ids, dtype=torch.int64, device=dec._torch_device())

        d, s = [[0, 1], [2, 3], [4, 5], [6, 1]], [[11, 10], [9, 8], [7, 6], [5, 4]]
        xs = [dec.prepare(peer, "pull", local_blocks={"full": on(d[i])}, remote_blocks={"full": on(s[i])},
                          device_ids=True, name=f"r{i}") for i in range(4)]
        assert all(x.descriptors == 8 for x in xs)
        hs = dec.post_many(xs)
        if mode == "blocks":
            for h in hs:
                with pytest.raises(BlockIdError):
                    h.wait(60)
            for k in dst:
                assert same_bytes(dst[k], before[k])
        else:
            for h in hs:
                h.wait(60)
            for k in dst:
                for i in range(4):
                    for j in range(2):
                        if (i, j) != (0, 1):
                            assert same_bytes(dst[k][:, d[i][j]], src[k][:, s[i][j]]), (k, i, j)
    finally:
        dec.close()
        pre.close()
        a0.close()
        a1.close()
