"""Requests whose block IDs are device tensors (gpuxfer.kv.device_ids): checked on the device at each post, the
same requests accepted and refused as with host IDs, the same bytes moved; a refused request moves no byte
and its handle raises BlockIdError naming it; the host work does not read the IDs."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from gpuxfer.errors import BadInput, BlockIdError
from gpuxfer.kv.agent import KVAgent, KVLayerSpec

from _agent_arena import Arena, connect, same_bytes, token_oracle, vllm_layers


@pytest.fixture
def dpair(platform):
    """Two agents (prefill, decode) and their arenas on every platform present (the host emulation; CUDA with
    -m gpu, both on device 0 where only one is present)."""
    d1 = 1 if platform.device_count() > 1 else 0
    a0, a1 = Arena(platform, 0, 1 << 20), Arena(platform, d1, 1 << 20)
    pre = KVAgent("prefill", platform=platform, device=0, engine="triton", timeout_s=60)
    dec = KVAgent("decode", platform=platform, device=d1, engine="triton", timeout_s=60)
    yield pre, dec, a0, a1
    dec.close()
    pre.close()
    a0.close()
    a1.close()


def _on(agent, ids, dtype=torch.int64):
    return torch.tensor(list(ids), dtype=dtype, device=agent._torch_device())


def _full(pre, dec, a0, a1, layers=2, blocks=12, bt=4, seed=1):
    src = vllm_layers(a0, layers, blocks, bt, seed=seed)
    dst = vllm_layers(a1, layers, blocks, bt, seed=seed + 1)
    pre.register_group("full", bt, src)
    dec.register_group("full", bt, dst)
    return src, dst


def _snapshot(layers):
    return {k: v.clone() for k, v in layers.items()}


def _restore(layers, snap):
    for k, v in layers.items():
        v.copy_(snap[k])


def _unchanged(layers, snap) -> bool:
    return all(same_bytes(layers[k], snap[k]) for k in layers)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("op", ["pull", "push"])
def test_every_byte_where_it_belongs(dpair, dtype, op):
    pre, dec, a0, a1 = dpair
    src, dst = _full(pre, dec, a0, a1)
    p_dec, p_pre = connect(pre, dec)
    s_ids, d_ids = [3, 0, 7, 11], [1, 5, 2, 10]
    snap = _snapshot(dst)
    if op == "pull":
        x = dec.prepare(p_dec, "pull", local_blocks={"full": _on(dec, d_ids, dtype)},
                        remote_blocks={"full": _on(dec, s_ids, dtype)}, device_ids=True, name="r")
    else:
        x = pre.prepare(p_pre, "push", local_blocks={"full": _on(pre, s_ids, dtype)},
                        remote_blocks={"full": _on(pre, d_ids, dtype)}, device_ids=True, name="r")
    assert type(x).__name__ == "_DeviceIdTransfer"
    h = x.post()
    h.wait(60)
    assert h.done()
    for k in src:
        for s, d in zip(s_ids, d_ids):
            assert same_bytes(dst[k][:, d], src[k][:, s])
        rest = [b for b in range(12) if b not in d_ids]
        assert same_bytes(dst[k][:, rest], snap[k][:, rest])


BAD = [
    ("source block ID out of range", [3, 0, 12], [1, 5, 2]),
    ("source block ID out of range", [-1, 0, 4], [1, 5, 2]),
    ("destination block ID out of range", [3, 0, 1], [1, 5, -1]),
    ("destination block ID out of range", [3, 0, 1], [1, 5, 1 << 40]),
    ("destination block named twice", [3, 0, 1], [4, 4, 6]),
]


@pytest.mark.parametrize("what, s_ids, d_ids", BAD)
def test_bad_ids_move_nothing_and_name_the_request(dpair, what, s_ids, d_ids):
    pre, dec, a0, a1 = dpair
    src, dst = _full(pre, dec, a0, a1)
    peer, _ = connect(pre, dec)
    snap = _snapshot(dst)
    x = dec.prepare(peer, "pull", local_blocks={"full": _on(dec, d_ids)}, remote_blocks={"full": _on(dec, s_ids)},
                    device_ids=True, name="bad-one")
    h = x.post()
    with pytest.raises(BlockIdError, match=f"request 'bad-one'.*{what}.*nothing was moved"):
        h.wait(60)
    with pytest.raises(BlockIdError, match="bad-one"):
        h.done()
    assert _unchanged(dst, snap)
    # the slot's marks and header are whole again: a good request in the same slot moves its bytes
    good = dec.prepare(peer, "pull", local_blocks={"full": _on(dec, [4, 6, 1])},
                       remote_blocks={"full": _on(dec, [3, 0, 1])}, device_ids=True)
    good.post().wait(60)
    for k in src:
        for s, d in zip([3, 0, 1], [4, 6, 1]):
            assert same_bytes(dst[k][:, d], src[k][:, s])


@pytest.mark.parametrize("op", ["pull", "push"])
@pytest.mark.parametrize("bs, bd", [(8, 2), (2, 8)])
def test_block_sizes_differ(dpair, op, bs, bd):
    pre, dec, a0, a1 = dpair
    nb_s, nb_d = 96 // bs, 96 // bd
    src = a0.tensor((2, nb_s, bs, 3, 2), torch.float16, seed=3)
    dst = a1.tensor((2, nb_d, bd, 3, 2), torch.float16, seed=4)
    pre.register_group("g", bs, {"l0": src})
    dec.register_group("g", bd, {"l0": dst})
    p_dec, p_pre = connect(pre, dec)
    rng = np.random.default_rng(1)
    tokens = 19
    s_ids = rng.permutation(nb_s)[:-(-tokens // bs)].tolist()
    d_ids = rng.permutation(nb_d)[:-(-tokens // bd)].tolist()
    want = token_oracle(src.cpu(), dst.cpu(), s_ids, d_ids, bs, bd, kv_first=True)
    agent, peer = (dec, p_dec) if op == "pull" else (pre, p_pre)
    mine, theirs = (d_ids, s_ids) if op == "pull" else (s_ids, d_ids)
    agent.prepare(peer, op, local_blocks={"g": _on(agent, mine, torch.int32)},
                  remote_blocks={"g": _on(agent, theirs, torch.int32)}, device_ids=True).post().wait(60)
    assert np.array_equal(dst.cpu().numpy().view(np.uint8), want.view(np.uint8))


def test_refused_at_prepare(dpair):
    """What the shapes, dtypes and routes tell is refused at prepare, typed, naming what is wrong."""
    pre, dec, a0, a1 = dpair
    _full(pre, dec, a0, a1)
    peer, _ = connect(pre, dec)

    def prep(local, remote, **kw):
        return dec.prepare(peer, "pull", local_blocks={"full": local}, remote_blocks={"full": remote},
                           device_ids=True, name="r", **kw)
    with pytest.raises(BlockIdError, match="3 source and 2 destination blocks do not cover the same tokens"):
        prep(_on(dec, [1, 2]), _on(dec, [0, 1, 2]))
    with pytest.raises(BlockIdError, match="int32 or int64"):
        prep(_on(dec, [1, 2]).float(), _on(dec, [0, 1]).float())
    with pytest.raises(BlockIdError, match="int32 or int64"):
        prep(_on(dec, [1, 2, 3, 4]).view(2, 2), _on(dec, [0, 1, 2, 3]).view(2, 2))
    with pytest.raises(BlockIdError, match="int32 or int64"):
        prep(_on(dec, [1, 2, 3, 4])[::2], _on(dec, [0, 1]))
    with pytest.raises(BlockIdError, match="share one dtype"):
        prep(_on(dec, [1, 2], torch.int32), _on(dec, [0, 1]))
    with pytest.raises(BlockIdError, match="must be tensors on"):
        prep([1, 2], _on(dec, [0, 1]))
    with pytest.raises(BadInput, match="device_ids must be True, False or None"):
        dec.prepare(peer, "pull", local_blocks={"full": [1]}, remote_blocks={"full": [0]}, device_ids="yes")


def test_pack_and_copy_engine_peers_take_host_ids(plat):
    a0, a1 = Arena(plat, 0), Arena(plat, 1)
    pre = KVAgent("prefill", platform=plat, device=0, engine="pack", slot_bytes=512)
    dec = KVAgent("decode", platform=plat, device=1, engine="pack", slot_bytes=512)
    try:
        _full(pre, dec, a0, a1, layers=1, blocks=4, bt=2)
        peer, _ = connect(pre, dec)
        with pytest.raises(BadInput, match="need the triton engine"):
            dec.prepare(peer, "pull", local_blocks={"full": torch.tensor([1])},
                        remote_blocks={"full": torch.tensor([0])}, device_ids=True)
    finally:
        dec.close()
        pre.close()
        a0.close()
        a1.close()


def test_shared_destination_memory_across_groups(plat):
    """Two groups laid over one slab block for block: a block named in both is a destination twice (checked
    on the device as on the host); other blocks of each move."""
    a0, a1 = Arena(plat, 0), Arena(plat, 1)
    pre = KVAgent("prefill", platform=plat, device=0, engine="triton")
    dec = KVAgent("decode", platform=plat, device=1, engine="triton")
    try:
        for agent, arena, seed in ((pre, a0, 5), (dec, a1, 6)):
            slab = arena.tensor((8 * 96,), torch.uint8, seed=seed)
            agent.register_group("mla", 4, {"mla": KVLayerSpec(slab, 8, 96, [(0, 64)])})
            agent.register_group("swa", 4, {"swa": KVLayerSpec(slab, 8, 96, [(64, 32)])})
        peer, _ = connect(pre, dec)
        src_slab = a0.flat[:8 * 96].view(8, 96)
        dst_slab = a1.flat[:8 * 96].view(8, 96)
        snap = dst_slab.clone()
        with pytest.raises(BlockIdError, match="destination block 2 appears more than once"):
            dec.prepare(peer, "pull", local_blocks={"mla": [2], "swa": [2]}, remote_blocks={"mla": [1], "swa": [3]})
        x = dec.prepare(peer, "pull", local_blocks={"mla": _on(dec, [2]), "swa": _on(dec, [2])},
                        remote_blocks={"mla": _on(dec, [1]), "swa": _on(dec, [3])}, device_ids=True, name="twice")
        with pytest.raises(BlockIdError, match="'twice'.*named twice"):
            x.post().wait(60)
        assert torch.equal(dst_slab, snap)
        dec.prepare(peer, "pull", local_blocks={"mla": _on(dec, [2]), "swa": _on(dec, [5])},
                    remote_blocks={"mla": _on(dec, [1]), "swa": _on(dec, [3])}, device_ids=True).post().wait(60)
        assert torch.equal(dst_slab[2, :64], src_slab[1, :64]) and torch.equal(dst_slab[5, 64:], src_slab[3, 64:])
    finally:
        dec.close()
        pre.close()
        a0.close()
        a1.close()


def test_id_tensors_outlive_the_caller(dpair):
    """The caller drops its ID tensors right after the post: the transfer keeps them until it completed."""
    pre, dec, a0, a1 = dpair
    src, dst = _full(pre, dec, a0, a1)
    peer, _ = connect(pre, dec)
    hs = []
    for k in range(6):                  # more posts than a route's ring holds slots
        x = dec.prepare(peer, "pull", local_blocks={"full": _on(dec, [k])}, remote_blocks={"full": _on(dec, [11 - k])},
                        device_ids=True)
        hs.append(x.post())
        del x
    for h in hs:
        h.wait(60)
    for k in range(6):
        for n in src:
            assert same_bytes(dst[n][:, k], src[n][:, 11 - k])


ids_lists = st.lists(st.integers(-2, 13), min_size=0, max_size=6)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(s_ids=ids_lists, d_ids=ids_lists, narrow=st.booleans())
def test_same_verdict_and_bytes_as_host_ids(dpair, s_ids, d_ids, narrow):
    """Hypothesis: any request, host IDs as the oracle -- refused by one path iff by the other (at prepare
    for counts, at the post's completion for the rest on the device), and the same bytes when accepted."""
    pre, dec, a0, a1 = dpair
    if "full" not in dec.groups:
        _full(pre, dec, a0, a1)
        connect(pre, dec)
    peer = dec.peer("prefill")
    snap = a1.flat.clone()
    dtype = torch.int32 if narrow else torch.int64
    host_err = dev_err = None
    try:
        dec.prepare(peer, "pull", local_blocks={"full": d_ids}, remote_blocks={"full": s_ids}).post().wait(60)
    except BlockIdError as exc:
        host_err = exc
    host_bytes = a1.flat.clone()
    a1.flat.copy_(snap)
    try:
        dec.prepare(peer, "pull", local_blocks={"full": _on(dec, d_ids, dtype)},
                    remote_blocks={"full": _on(dec, s_ids, dtype)}, device_ids=True).post().wait(60)
    except BlockIdError as exc:
        dev_err = exc
    assert (host_err is None) == (dev_err is None), (host_err, dev_err)
    assert torch.equal(a1.flat, host_bytes if host_err is None else snap)
    a1.flat.copy_(snap)


def test_device_bytes_counts_the_slots(dpair):
    """What the routes' slots hold on the device is counted: descriptors, request buffers, the check's bitmap."""
    pre, dec, a0, a1 = dpair
    _full(pre, dec, a0, a1)
    peer, _ = connect(pre, dec)
    assert dec.device_bytes()["slots"] == 0
    dec.prepare(peer, "pull", local_blocks={"full": _on(dec, [1, 2])}, remote_blocks={"full": _on(dec, [3, 4])},
                device_ids=True).post().wait(60)
    got = dec.device_bytes()
    assert got["slots"] == 1 and got["routes"] >= 1
    slot = next(s for r in dec._routes.routes.values() for s in r.slots)
    assert got["descriptors"] == slot.rows * 24 and got["requests"] == slot.req.untyped_storage().nbytes()
    assert got["id_marks"] == slot.checked.marks.numel() * 4 > 0
    assert got["pack_staging"] == 0


def _count_calls(agent, monkeypatch, name: str = "copy") -> list:
    """The arguments of each call the agent's stream's bound ``name`` (copy, launch_graph) gets from now on."""
    seen = []
    call = getattr(agent._poster.calls, name)

    def counted(*args):
        seen.append(args[-1])
        return call(*args)
    monkeypatch.setattr(agent._poster.calls, name, counted)
    return seen


def test_post_many_one_upload_every_byte(dpair, monkeypatch):
    """Device-ID requests of one route posted together: one graph launch (the slot's folded graph: the request
    array up, the check, the copies, one status word back), every request's bytes where they belong."""
    pre, dec, a0, a1 = dpair
    src, dst = _full(pre, dec, a0, a1)
    peer, _ = connect(pre, dec)
    reqs = [([3, 0, 7], [1, 5, 2]), ([9], [11]), ([4, 10], [0, 8])]
    xs = [dec.prepare(peer, "pull", local_blocks={"full": _on(dec, d, torch.int32)},
                      remote_blocks={"full": _on(dec, s, torch.int32)}, name=f"r{i}", device_ids=True)
          for i, (s, d) in enumerate(reqs)]
    snap = _snapshot(dst)
    copies, graphs = _count_calls(dec, monkeypatch), _count_calls(dec, monkeypatch, "launch_graph")
    hs = dec.post_many(xs)
    assert copies == [] and len(graphs) == 1
    for h in hs:
        h.wait(60)
        assert h.done()
    pairs = [(s, d) for ss, ds in reqs for s, d in zip(ss, ds)]
    for k in src:
        for s, d in pairs:
            assert same_bytes(dst[k][:, d], src[k][:, s])
        rest = [b for b in range(12) if b not in {d for _, d in pairs}]
        assert same_bytes(dst[k][:, rest], snap[k][:, rest])


def test_post_many_merges_each_part_of_a_cut_batch(dpair, monkeypatch):
    """Device-ID requests of a batch cut by the descriptor budget into parts of two (fewer than ``MERGE_FROM``):
    each part one checked post (descriptor slots; slots without descriptors never cut: one post), every byte."""
    from gpuxfer.kv import batch
    pre, dec, a0, a1 = dpair
    src, dst = _full(pre, dec, a0, a1)
    peer, _ = connect(pre, dec)
    monkeypatch.setattr(batch, "BATCH_ROWS", 8)        # a request of one block: 2 layers x 2 pieces = 4 rows
    assert batch.MERGE_FROM > 2
    reqs = [([3], [1]), ([9], [11]), ([4], [0]), ([10], [8]), ([0], [6]), ([7], [2])]
    xs = [dec.prepare(peer, "pull", local_blocks={"full": _on(dec, d)}, remote_blocks={"full": _on(dec, s)},
                      name=f"r{i}", device_ids=True) for i, (s, d) in enumerate(reqs)]
    graphs = _count_calls(dec, monkeypatch, "launch_graph")
    hs = dec.post_many(xs)
    assert len(graphs) == (1 if dec._poster.blocks else 3)
    assert len({id(h.event) for h in hs}) == len(graphs)
    for h in hs:
        h.wait(60)
    for k in src:
        for s, d in reqs:
            assert same_bytes(dst[k][:, d], src[k][:, s])


def test_post_many_a_destination_in_two_requests_moves_nothing(dpair):
    pre, dec, a0, a1 = dpair
    src, dst = _full(pre, dec, a0, a1)
    peer, _ = connect(pre, dec)
    xs = [dec.prepare(peer, "pull", local_blocks={"full": _on(dec, mine)}, remote_blocks={"full": _on(dec, theirs)},
                      name=n, device_ids=True)
          for n, mine, theirs in (("a", [1, 2], [3, 4]), ("b", [2, 6], [5, 0]), ("c", [7], [11]))]
    snap = _snapshot(dst)
    ha, hb, hc = dec.post_many(xs)
    for h, name in ((ha, "a"), (hb, "b"), (hc, "c")):
        with pytest.raises(BlockIdError, match=f"request '{name}'.*3 requests posted with it.*named twice"):
            h.wait(60)
    assert _unchanged(dst, snap)
    ok = dec.post_many([dec.prepare(peer, "pull", local_blocks={"full": _on(dec, [1])},
                                    remote_blocks={"full": _on(dec, [3])}, device_ids=True),
                        dec.prepare(peer, "pull", local_blocks={"full": _on(dec, [2])},
                                    remote_blocks={"full": _on(dec, [4])}, device_ids=True)])
    for h in ok:
        h.wait(60)
    for k in src:
        assert same_bytes(dst[k][:, 1], src[k][:, 3]) and same_bytes(dst[k][:, 2], src[k][:, 4])


batches = st.lists(st.tuples(st.lists(st.integers(-1, 12), min_size=1, max_size=4),
                             st.lists(st.integers(-1, 12), min_size=1, max_size=4)), min_size=2, max_size=4)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reqs=batches)
def test_post_many_against_host_ids(dpair, reqs):
    """Hypothesis: device-ID requests posted together move what the same requests with host IDs move when each
    passes the host checks and no two name one destination; otherwise the whole batch moves nothing and every
    handle raises."""
    pre, dec, a0, a1 = dpair
    if "full" not in dec.groups:
        _full(pre, dec, a0, a1)
        connect(pre, dec)
    peer = dec.peer("prefill")
    reqs = [(s[:len(d)], d[:len(s)]) for s, d in reqs]
    snap = a1.flat.clone()
    ok = True
    try:
        xs = [dec.prepare(peer, "pull", local_blocks={"full": d}, remote_blocks={"full": s}) for s, d in reqs]
    except BlockIdError:
        ok = False
    dsts = [b for _, d in reqs for b in d]
    ok = ok and len(set(dsts)) == len(dsts)
    if ok:
        for h in dec.post_many(xs):
            h.wait(60)
    want = a1.flat.clone()
    a1.flat.copy_(snap)
    hs = dec.post_many([dec.prepare(peer, "pull", local_blocks={"full": _on(dec, d)},
                                    remote_blocks={"full": _on(dec, s)}, device_ids=True) for s, d in reqs])
    refused = 0
    for h in hs:
        try:
            h.wait(60)
        except BlockIdError:
            refused += 1
    assert refused == (0 if ok else len(hs))
    assert torch.equal(a1.flat, want if ok else snap)
    a1.flat.copy_(snap)


def test_post_many_host_and_device_ids_of_a_route_keep_their_order(dpair):
    """A route's batch mixing host and device IDs runs in list order: the later request's bytes stay where both
    write one block."""
    pre, dec, a0, a1 = dpair
    src, dst = _full(pre, dec, a0, a1)
    peer, _ = connect(pre, dec)
    for first_device in (True, False):
        dev = dec.prepare(peer, "pull", local_blocks={"full": _on(dec, [5])}, remote_blocks={"full": _on(dec, [3])},
                          device_ids=True)
        host = dec.prepare(peer, "pull", local_blocks={"full": [5]}, remote_blocks={"full": [7]})
        for h in dec.post_many([dev, host] if first_device else [host, dev]):
            h.wait(60)
        for k in src:
            assert same_bytes(dst[k][:, 5], src[k][:, 7 if first_device else 3])


def test_refused_notifications_moved_tensors_and_meta_tensors(dpair):
    """A notification with device IDs is refused at prepare (it would be queued whatever the check finds); a
    tensor given other memory after prepare is refused at the post; a tensor with no memory at prepare."""
    pre, dec, a0, a1 = dpair
    src, dst = _full(pre, dec, a0, a1)
    peer, _ = connect(pre, dec)
    with pytest.raises(BadInput, match="notification needs block IDs on the host"):
        dec.prepare(peer, "pull", local_blocks={"full": _on(dec, [1])}, remote_blocks={"full": _on(dec, [2])},
                    device_ids=True, notify_slot=0)
    mine = _on(dec, [1, 2])
    x = dec.prepare(peer, "pull", local_blocks={"full": mine}, remote_blocks={"full": _on(dec, [3, 4])},
                    device_ids=True, name="moved")
    mine.set_(_on(dec, [1, 2]))
    snap = _snapshot(dst)
    with pytest.raises(BlockIdError, match="'moved'.*moved to other memory since prepare"):
        x.post()
    with pytest.raises(BlockIdError, match="moved to other memory"):
        dec.post_many([x])
    ok = [dec.prepare(peer, "pull", local_blocks={"full": _on(dec, [5 + i])}, remote_blocks={"full": _on(dec, [3])},
                      device_ids=True, name=f"ok{i}") for i in range(2)]
    with pytest.raises(BlockIdError, match="'moved'.*moved to other memory since prepare") as err:
        dec.post_many([ok[0], x, ok[1]])         # (merged: the batch's tensors checked at once)
    assert err.value.handles == [None, None, None]
    assert _unchanged(dst, snap)
    if dec._torch_device().type == "cpu":
        meta = torch.empty(2, dtype=torch.int64, device="meta")
        with pytest.raises(BlockIdError):
            dec.prepare(peer, "pull", local_blocks={"full": meta}, remote_blocks={"full": _on(dec, [3, 4])},
                        device_ids=True)
    param = torch.nn.Parameter(_on(dec, [1]), requires_grad=False)
    with pytest.raises(BlockIdError, match="plain torch.Tensor"):
        dec.prepare(peer, "pull", local_blocks={"full": param}, remote_blocks={"full": _on(dec, [3])},
                    device_ids=True)


def test_every_upload_reads_the_request_array_it_posts(dpair, monkeypatch):
    """A post uploads from the address its pool token kept (read once, when the pooled array was made): for host
    and device IDs, alone and merged by post_many, and for arrays given back to the pool and taken again, that
    address is the posted array's own, and the bytes land."""
    from gpuxfer.kv import device_ids as kd, triton_transfer as kt
    pre, dec, a0, a1 = dpair
    src, dst = _full(pre, dec, a0, a1)
    p_dec, _ = connect(pre, dec)
    seen = []

    def checking(real, at):         # (``at``: where the array and its address come in the arguments)
        def run(*args):
            array, ptr = args[at:at + 2]
            seen.append(ptr)
            assert ptr == array.ctypes.data
            return real(*args)
        return run

    monkeypatch.setattr(kt, "_enqueue", checking(kt._enqueue, 3))
    monkeypatch.setattr(kd, "_run_checked", checking(kd._run_checked, 4))
    pairs = [([3, 0], [1, 5]), ([7], [2]), ([11, 4], [10, 6])]
    for _ in range(3):              # (the pool's arrays given back and taken again)
        for device in (False, True):
            ids = (lambda v: _on(dec, v)) if device else (lambda v: v)
            xs = [dec.prepare(p_dec, "pull", local_blocks={"full": ids(d)}, remote_blocks={"full": ids(s)},
                              device_ids=device) for s, d in pairs]
            xs[0].post().wait(60)
            for h in dec.post_many(xs[1:]):       # (merged: one array of both)
                h.wait(60)
            for h in dec.post_many(xs):
                h.wait(60)
            del xs
    assert len(seen) == 3 * 2 * 3
    for s_ids, d_ids in pairs:
        for k in src:
            for s, d in zip(s_ids, d_ids):
                assert same_bytes(dst[k][:, d], src[k][:, s])
