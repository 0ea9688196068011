"""The NIXL route of KVAgent (gpuxfer.kv.nixl_route) against real NIXL on the host emulation.

Two spawned processes with host-emulation caches registered with the agent (DRAM), their metadata bytes
swapped, ``add_peer(..., route="nixl")`` (one machine: the route is asked for), UCX over loopback
(``UCX_NET_DEVICES=lo``). They run the KV API's engine-independent cases over the route -- pull, push, layer
ranges, block-size ratios, notifications, re-posts, bad IDs -- each side checking every byte of its caches
against the same seeded caches rebuilt locally. Then: a killed peer (no hang), timeouts, a missing NIXL
(a typed error naming the extra), hostile NIXL metadata. Without NIXL the tests that need it skip with the
reason, unless ``GPUXFER_TEST_REQUIRE_NIXL=1`` (CI's NIXL step), where they fail. GPU (``gpu``): the same
scenario with CUDA caches (VRAM) in two processes on one device.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from gpuxfer import config
from gpuxfer.errors import (BackendUnavailable, BadInput, BadMetadata, BlockIdError, LayoutMismatch, NotRegistered,
                            TransferTimeout)
from gpuxfer.kv.agent import KVAgent
from gpuxfer.kv.layers import KVLayerSpec
from gpuxfer.kv.metadata import _HEADER, METADATA_MAGIC, METADATA_VERSION, decode_metadata

LOOPBACK = {"UCX_NET_DEVICES": "lo"}


def _nixl_reason() -> str | None:
    from gpuxfer.kv.nixl_route import nixl_reason
    from gpuxfer.platforms.host import HostPlatform
    return nixl_reason(HostPlatform)


@pytest.fixture
def need_nixl(monkeypatch):
    why = _nixl_reason()
    if why is not None:
        if config.get("GPUXFER_TEST_REQUIRE_NIXL"):
            pytest.fail(f"GPUXFER_TEST_REQUIRE_NIXL=1 but the NIXL route cannot run: {why}")
        pytest.skip(why)
    for k, v in LOOPBACK.items():
        monkeypatch.setenv(k, v)


# ----------------------------------------------------------------------------- the caches both sides know


LAYERS, BLOCKS, BT = 3, 12, 4              # group "full": vLLM layout, equal block sizes
MLA_BT = {0: 8, 1: 4}                      # group "mla": 8-token blocks on rank 0, 4-token ones on rank 1
MLA_BLOCKS = {0: 6, 1: 12}
SLOT = 48                                  # bytes per token of the "mla" slab


def _caches(rank: int, flat: torch.Tensor | None = None, device="cpu") -> dict[str, dict[str, torch.Tensor]]:
    """Rank ``rank``'s caches, seeded: carved from ``flat`` (its registered memory) or, as the other side's
    reference, plain CPU tensors."""
    g = np.random.default_rng(100 + rank)
    shapes = {"full": {f"model.layers.{i}.attn": (2, BLOCKS, BT, 2, 4) for i in range(LAYERS)},
              "mla": {"model.layers.0.mla": (MLA_BLOCKS[rank], MLA_BT[rank], SLOT)}}
    out, at = {}, 256
    for grp, layers in shapes.items():
        out[grp] = {}
        for name, shape in layers.items():
            n = int(np.prod(shape))
            data = torch.from_numpy(g.integers(0, 256, n, dtype=np.uint8))
            if flat is None:
                t = data.view(shape).clone()
            else:
                t = flat[at:at + n].view(shape)
                t.copy_(data.view(shape).to(device))
            out[grp][name] = t
            at += -(-n // 256) * 256
    return out


def _copy_full(dst, src, s_ids, d_ids, layers=None):
    for i, name in enumerate(dst):
        if layers is None or layers[0] <= i < layers[1]:
            for s, d in zip(s_ids, d_ids):
                dst[name][:, d] = src[name][:, s]


def _copy_mla(dst, src, s_ids, d_ids, bs, bd):
    """Token-matched copy of a (blocks, bt, SLOT) slab between block sizes ``bs`` and ``bd``."""
    (name, d), (_, s) = next(iter(dst.items())), next(iter(src.items()))
    n = len(d_ids) * bd if bd <= bs else len(s_ids) * bs
    seg = min(bs, bd)
    for i in range(n // seg):
        t = i * seg
        d[d_ids[t // bd], t % bd:t % bd + seg] = s[s_ids[t // bs], t % bs:t % bs + seg]


def _check(mine: dict, expected: dict, what: str) -> None:
    for grp in expected:
        for name, want in expected[grp].items():
            got = mine[grp][name].cpu()
            if not torch.equal(got, want):
                bad = int((got != want).nonzero()[0][0]) if got.dim() else 0
                raise AssertionError(f"{what}: {grp}/{name} differs (first at block {bad})")


def _setup(rank, platform_name, timeout_s=60.0):
    plat_mod = __import__("gpuxfer.platforms", fromlist=["get_platform"])
    plat = plat_mod.get_platform(platform_name)
    if platform_name == "host":
        buf = plat.alloc(1 << 16, rank)
        flat = plat.as_tensor(buf)
        device = rank
        caches = _caches(rank, flat)
    else:
        buf = None
        device = 0
        flat = torch.empty(1 << 16, dtype=torch.uint8, device="cuda:0")
        caches = _caches(rank, flat, "cuda:0")
    agent = KVAgent(f"rank{rank}", platform=plat, device=device, timeout_s=timeout_s, remote="nixl")
    agent.register_group("full", BT, caches["full"])
    agent.register_group("mla", MLA_BT[rank], caches["mla"])
    return plat, buf, agent, caches


# ----------------------------------------------------------------------------- two processes, every case


def _scenario(rank, world, init, platform_name):
    """Rank 0 is prefill (8-token "mla" blocks), rank 1 decode (4-token ones); every step checked byte for byte
    on the side whose caches changed (the rest of its caches too), the other side checks its own stayed."""
    import datetime
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    plat, buf, agent, caches = _setup(rank, platform_name)
    try:
        blobs = [None, None]
        dist.all_gather_object(blobs, agent.metadata())
        peer = agent.add_peer(blobs[1 - rank], route="nixl")
        assert peer.route == "nixl" and type(peer).__name__ == "NixlPeer"
        dist.barrier()                  # a notification counts once its receiver added the sender as a peer
        mine = {g: {k: v.cpu().clone() for k, v in c.items()} for g, c in caches.items()}
        theirs = _caches(1 - rank)
        expect = mine

        # 1. decode pulls "full" and the 8 -> 4-token "mla" blocks, notifying prefill's slot 1
        src_full, dst_full = [5, 0, 3, 11], [1, 4, 2, 10]
        src_mla, dst_mla = [4, 1], [7, 0, 9]                  # 3 decode blocks = 12 tokens of 2 prefill blocks
        if rank == 1:
            x = agent.prepare(peer, "pull", local_blocks={"full": dst_full, "mla": dst_mla},
                              remote_blocks={"full": src_full, "mla": src_mla}, notify_slot=1, name="pull-1")
            assert x.descriptors == LAYERS * 2 * 4 + 3
            h = x.post()
            h.wait(60)
            assert h.done() and h.name == "pull-1" and h.notify_value == 1
            _copy_full(expect["full"], theirs["full"], src_full, dst_full)
            _copy_mla(expect["mla"], theirs["mla"], src_mla, dst_mla, 8, 4)
        else:
            assert agent.wait_notification(1, 1, timeout_s=60) >= 1
        _check(caches, expect, f"rank {rank} after the pull")
        dist.barrier()

        # 2. prefill pushes layer 1 only, twice (a re-post), notifying decode's slot 2
        if rank == 0:
            x = agent.prepare(peer, "push", local_blocks={"full": [7, 8]}, remote_blocks={"full": [6, 0]},
                              layers=(1, 2), notify_slot=2)
            assert x.descriptors == 2 * 2
            assert [x.post().wait(60), x.post().wait(60)] == [None, None]
        else:
            assert agent.wait_notification(2, 2, timeout_s=60) >= 2
            _copy_full(expect["full"], theirs["full"], [7, 8], [6, 0], layers=(1, 2))
        _check(caches, expect, f"rank {rank} after the layer-range push")
        dist.barrier()

        # 3. decode pushes 4 -> 8-token "mla" blocks back (its 4 blocks fill 2 prefill blocks)
        if rank == 1:
            agent.transfer(peer, "push", local_blocks={"mla": [3, 5, 6, 8]}, remote_blocks={"mla": [0, 5]},
                           notify_slot=3).wait(60)
        else:
            agent.wait_notification(3, 1, timeout_s=60)
            _copy_mla(expect["mla"], theirs["mla"], [3, 5, 6, 8], [0, 5], 4, 8)
        _check(caches, expect, f"rank {rank} after the ratio push")
        dist.barrier()

        # 4. bad requests on the route: typed errors, nothing moves
        with pytest.raises(BlockIdError, match="out of range"):
            agent.prepare(peer, "pull", local_blocks={"full": [BLOCKS]}, remote_blocks={"full": [0]})
        with pytest.raises(BlockIdError, match="out of range"):
            agent.prepare(peer, "push", local_blocks={"full": [0]}, remote_blocks={"full": [-1]})
        with pytest.raises(BlockIdError, match="more than once"):
            agent.prepare(peer, "pull", local_blocks={"full": [1, 1]}, remote_blocks={"full": [0, 2]})
        with pytest.raises(BlockIdError, match="same tokens"):
            agent.prepare(peer, "pull", local_blocks={"mla": [0, 1, 2]}, remote_blocks={"mla": [0]})
        with pytest.raises(BlockIdError, match="integers"):
            agent.prepare(peer, "pull", local_blocks={"full": [0.5]}, remote_blocks={"full": [0]})
        with pytest.raises(NotRegistered, match="nope"):
            agent.prepare(peer, "pull", local_blocks={"nope": [0]}, remote_blocks={"nope": [0]})
        with pytest.raises(BadInput, match="selects no layer"):
            agent.prepare(peer, "pull", local_blocks={"full": [0]}, remote_blocks={"full": [0]}, layers=(50, 60))
        with pytest.raises(BadInput, match="notify_slot"):
            agent.prepare(peer, "pull", local_blocks={"full": [0]}, remote_blocks={"full": [0]}, notify_slot=64)
        _check(caches, expect, f"rank {rank} after the bad requests")
        dist.barrier()

        # 5. an empty request still notifies
        if rank == 0:
            agent.transfer(peer, "push", local_blocks={"full": []}, remote_blocks={"full": []}, notify_slot=4).wait(30)
        else:
            agent.wait_notification(4, 1, timeout_s=60)
        dist.barrier()
        agent.remove_peer(peer)
        with pytest.raises(NotRegistered):
            agent.prepare(peer, "pull", local_blocks={"full": [0]}, remote_blocks={"full": [0]})
        dist.barrier()
        return "ok"
    finally:
        agent.close()
        if buf is not None:
            buf.close()
        dist.destroy_process_group()
        plat.close()


def test_two_processes_over_nixl(need_nixl, spawner):
    assert spawner.run_ranks(_scenario, 2, "host", timeout=240) == ["ok", "ok"]


@pytest.mark.gpu
def test_two_processes_over_nixl_cuda(need_nixl, spawner):
    """The same scenario with CUDA caches (VRAM registered with NIXL), two processes on device 0."""
    from _skips import platform_reason
    why = platform_reason("cuda")
    if why:
        pytest.skip(why)
    assert spawner.run_ranks(_scenario, 2, "cuda", timeout=300) == ["ok", "ok"]


# ----------------------------------------------------------------------------- a killed peer


def _doomed(to_peer, from_peer):
    """Register, swap metadata, add the peer, then die without closing anything."""
    import os
    plat, buf, agent, _ = _setup(0, "host")
    to_peer.put(agent.metadata())
    agent.add_peer(from_peer.get(timeout=60), route="nixl")
    to_peer.put("ready")
    from_peer.get(timeout=60)        # the survivor's first pull went through
    os._exit(0)


def _survivor(to_peer, from_peer, from_parent):
    plat, buf, agent, caches = _setup(1, "host", timeout_s=20.0)
    try:
        blob = from_peer.get(timeout=60)
        to_peer.put(agent.metadata())
        peer = agent.add_peer(blob, route="nixl")
        assert from_peer.get(timeout=60) == "ready"
        agent.transfer(peer, "pull", local_blocks={"full": [0]}, remote_blocks={"full": [1]}).wait(30)
        to_peer.put("die")
        assert from_parent.get(timeout=60) == "dead"
        from gpuxfer.errors import GpuxferError
        outcome = []
        for _ in range(2):               # a dead peer: NIXL's error or a timeout, never a hang
            try:
                agent.transfer(peer, "pull", local_blocks={"full": [2]}, remote_blocks={"full": [3]}).wait(10)
                outcome.append("moved")
            except GpuxferError as exc:
                outcome.append(type(exc).__name__)
        assert all(o in ("NixlError", "TransferTimeout") for o in outcome), outcome
        with pytest.raises(TransferTimeout):
            agent.wait_notification(5, 1, timeout_s=0.5)
        return outcome
    finally:
        agent.close()                    # bounded: the agent's timeout per wait
        buf.close()
        plat.close()


def test_a_killed_peer_never_hangs_the_survivor(need_nixl, spawner):
    a, b, parent = spawner.queue(), spawner.queue(), spawner.queue()
    doomed = spawner.start(_doomed, b, a, name="doomed")
    survivor = spawner.start(_survivor, a, b, parent, name="survivor", hard_exit=True)
    doomed.join(120)                     # exits 0 through os._exit once told to die
    parent.put("dead")
    outcome = survivor.result(180)
    survivor.join(30)
    assert len(outcome) == 2, outcome
    print("OUTCOME", outcome)


# ----------------------------------------------------------------------------- one process


@pytest.fixture
def nixl_pair(need_nixl, host):
    """Two NIXL-route agents in this process, their caches registered, peers added over the route."""
    bufs = [host.alloc(1 << 16, r) for r in (0, 1)]
    caches = [_caches(r, host.as_tensor(b)) for r, b in enumerate(bufs)]
    agents = [KVAgent(f"side{r}", platform=host, device=r, timeout_s=20, remote="nixl") for r in (0, 1)]
    for r, a in enumerate(agents):
        a.register_group("full", BT, caches[r]["full"])
    peers = [agents[0].add_peer(agents[1].metadata(), route="nixl"),
             agents[1].add_peer(agents[0].metadata(), route="nixl")]
    yield agents, peers, caches
    for a in agents:
        a.close()
    for b in bufs:
        b.close()


def test_a_stuck_transfer_times_out_naming_the_request_and_the_agent_stays_usable(nixl_pair, monkeypatch):
    from gpuxfer.kv import nixl_ffi
    (a, b), (p, _), caches = nixl_pair
    real = nixl_ffi.NixlAgent.state
    monkeypatch.setattr(nixl_ffi.NixlAgent, "state", lambda self, h: "PROC")
    h = a.transfer(p, "pull", local_blocks={"full": [0]}, remote_blocks={"full": [1]}, name="stuck-req")
    with pytest.raises(TransferTimeout, match="stuck-req"):
        h.wait(0.3)
    assert not h.done()
    monkeypatch.setattr(nixl_ffi.NixlAgent, "state", real)
    h.wait(20)
    assert h.done()
    assert torch.equal(caches[0]["full"]["model.layers.0.attn"][:, 0], caches[1]["full"]["model.layers.0.attn"][:, 1])


def test_a_peer_removed_while_a_post_waits_on_its_stream_is_never_posted_to(nixl_pair, monkeypatch):
    """remove_peer completes while a post waits for the work on its stream (after the post's first check):
    the post then raises NotRegistered instead of handing NIXL the removed peer's released lists; the agent
    stays usable; posts racing remove_peer from threads end in moved blocks or NotRegistered only."""
    import threading
    from gpuxfer.errors import GpuxferError, NotRegistered
    (a, b), (p, _), caches = nixl_pair
    x = a.prepare(p, "pull", local_blocks={"full": [3]}, remote_blocks={"full": [5]}, name="late")
    real = a.platform.event_query
    removed = threading.Event()

    def query_after_removal(ev):
        t = threading.Thread(target=lambda: (a.remove_peer(p), removed.set()))
        t.start()
        t.join(30)
        return real(ev)

    monkeypatch.setattr(a.platform, "event_query", query_after_removal)
    with pytest.raises(NotRegistered, match="removed"):
        x.post()
    assert removed.is_set()
    monkeypatch.setattr(a.platform, "event_query", real)
    p2 = a.add_peer(b.metadata(), route="nixl")
    xs = [a.prepare(p2, "pull", local_blocks={"full": [i]}, remote_blocks={"full": [i]}, name=f"r{i}")
          for i in range(4)]
    outcomes, go = [], threading.Event()

    def poster(x):
        go.wait(10)
        for _ in range(20):
            try:
                x.post().wait(20)
                outcomes.append("moved")
            except GpuxferError as exc:
                outcomes.append(type(exc).__name__)
            except BaseException as exc:  # noqa: BLE001 - what the test is looking for
                outcomes.append(f"untyped {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=poster, args=(x,)) for x in xs]
    for t in threads:
        t.start()
    go.set()
    a.remove_peer(p2)
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert len(outcomes) == 80 and set(outcomes) <= {"moved", "NotRegistered"}, outcomes
    name = "model.layers.0.attn"
    if "moved" in outcomes:
        assert torch.equal(caches[0]["full"][name][:, 0], caches[1]["full"][name][:, 0])


def test_a_group_registered_after_add_peer_rebuilds_the_lists(need_nixl, host):
    """A group the peer's metadata named, registered here after add_peer (in an allocation of its own): the
    lists are rebuilt when a request names it; a request prepared on the old lists is refused, new ones move."""
    bufs = [host.alloc(1 << 16, 1), host.alloc(1 << 14, 0), host.alloc(1 << 16, 0)]
    a = KVAgent("late-a", platform=host, device=0, timeout_s=20, remote="nixl")
    b2 = KVAgent("late-b", platform=host, device=1, timeout_s=20, remote="nixl")
    try:
        caches = [_caches(0, host.as_tensor(bufs[2]))]
        a.register_group("full", BT, caches[0]["full"])
        c = _caches(1, host.as_tensor(bufs[0]))
        b2.register_group("full", BT, c["full"])
        b2.register_group("mla", MLA_BT[1], c["mla"])
        p2 = a.add_peer(b2.metadata(), route="nixl")
        with pytest.raises(NotRegistered, match="mla"):
            a.prepare(p2, "pull", local_blocks={"mla": [0]}, remote_blocks={"mla": [0]})
        old = a.prepare(p2, "pull", local_blocks={"full": [2]}, remote_blocks={"full": [3]})
        a_mla = _caches(0, host.as_tensor(bufs[1]))["mla"]["model.layers.0.mla"]
        a.register_group("mla", MLA_BT[0], {"model.layers.0.mla": a_mla})
        want = a_mla.clone()
        a.transfer(p2, "pull", local_blocks={"mla": [2]}, remote_blocks={"mla": [5, 9]}).wait(20)
        b_mla = c["mla"]["model.layers.0.mla"]
        want[2, :4], want[2, 4:] = b_mla[5], b_mla[9]
        assert torch.equal(a_mla, want)
        with pytest.raises(BadInput, match="prepare it again"):
            old.post()
        a.transfer(p2, "pull", local_blocks={"full": [2]}, remote_blocks={"full": [3]}).wait(20)
        for name, t in caches[0]["full"].items():
            assert torch.equal(t[:, 2], c["full"][name][:, 3])
        a.remove_peer(p2)
    finally:
        b2.close()
        a.close()
        for x in bufs:
            x.close()


@pytest.mark.parametrize("whose", ["peer", "local"])
def test_a_view_of_some_pieces_over_nixl(need_nixl, host, whose):
    """Pieces [2, 4) of each block, one piece per head, over the NIXL route: ``pieces`` (agent b reads heads 2
    and 3 of a's four into its two) or ``local_pieces`` (b's heads 2 and 3 of four take a's two), in both
    directions; every byte of b checked, nothing else of b's memory changed."""
    heads = (4, 2) if whose == "peer" else (2, 4)
    blocks, hb = 6, 64
    bufs = [host.alloc(2 * blocks * heads[r] * hb + 4096, r) for r in (0, 1)]
    agents = []
    try:
        views = []
        for r in (0, 1):
            flat = host.as_tensor(bufs[r])
            layers = {}
            for i in range(2):
                v = flat[i * blocks * heads[r] * hb:(i + 1) * blocks * heads[r] * hb].view(blocks, heads[r], hb)
                v.copy_(torch.randint(0, 256, v.shape, generator=torch.Generator().manual_seed(10 * r + i),
                                      dtype=torch.uint8))
                layers[f"l{i}"] = KVLayerSpec(v, blocks, heads[r] * hb, [(h * hb, hb) for h in range(heads[r])])
                views.append(v)
            ag = KVAgent(f"view{r}", platform=host, device=r, timeout_s=20, remote="nixl", engine="triton")
            agents.append(ag)
            ag.register_group("g", 4, layers)
        a, b = agents
        key = "pieces" if whose == "peer" else "local_pieces"
        pa = a.add_peer(b.metadata(), route="nixl", **{"local_pieces" if whose == "peer" else "pieces": {"g": (2, 4)}})
        pb = b.add_peer(a.metadata(), route="nixl", **{key: {"g": (2, 4)}})
        for op, who, peer, first in (("pull", b, pb, [5, 0]), ("push", a, pa, [1, 3])):
            before = [v.clone() for v in views[2:]]
            src, dst = first, [4, 2]
            if op == "pull":
                b.transfer(peer, "pull", local_blocks={"g": dst}, remote_blocks={"g": src}).wait(20)
            else:
                a.transfer(peer, "push", local_blocks={"g": src}, remote_blocks={"g": dst}).wait(20)
            for i in range(2):
                want = before[i].clone()
                for s_, d in zip(src, dst):
                    if whose == "peer":
                        want[d] = views[i][s_, 2:4]
                    else:
                        want[d, 2:4] = views[i][s_]
                assert torch.equal(views[2 + i], want), (op, i)
    finally:
        for ag in agents[::-1]:
            ag.close()
        for x in bufs:
            x.close()


@pytest.mark.parametrize("op", ["pull", "push"])
def test_a_view_of_token_rows_over_nixl(need_nixl, host, op):
    """Heads [2, 4) of token-major pages of four heads ``(page tokens, heads, head bytes)``, an SGLang MHA pool at
    attention TP 1, land on all of the two heads of pages of a pool at TP 2 (its second rank), over the NIXL
    route (``token_slice`` and ``local_token_slice``: one descriptor per token row, block and layer): every byte
    of the destination checked, the other heads and pages and the pad after each page untouched."""
    bt, hb, blocks, pad = 4, 16, 6, 24
    heads = (4, 2)
    bufs = [host.alloc(1 << 16, r) for r in (0, 1)]
    agents, views = [], []
    try:
        for r in (0, 1):
            flat = host.as_tensor(bufs[r])
            stride = bt * heads[r] * hb + pad
            layers = {}
            for i in range(2):
                raw = flat[i * 8192:i * 8192 + blocks * stride]
                raw.copy_(torch.randint(0, 256, raw.shape, generator=torch.Generator().manual_seed(10 * r + i),
                                        dtype=torch.uint8))
                layers[f"l{i}"] = KVLayerSpec(raw, blocks, stride, [(0, bt * heads[r] * hb)])
                views.append(raw)
            ag = KVAgent(f"rows{r}", platform=host, device=r, timeout_s=20, remote="nixl", engine="triton")
            agents.append(ag)
            ag.register_group("g", bt, layers)
        a, b = agents
        src, dst = [5, 0, 3], [1, 4, 2]
        before = [v.clone() for v in views[2:]]
        if op == "pull":
            peer = b.add_peer(a.metadata(), route="nixl", token_slice={"g": (2 * hb, 4 * hb)},
                              local_token_slice={"g": (0, 2 * hb)})
            b.transfer(peer, "pull", local_blocks={"g": dst}, remote_blocks={"g": src}).wait(20)
        else:
            peer = a.add_peer(b.metadata(), route="nixl", local_token_slice={"g": (2 * hb, 4 * hb)},
                              token_slice={"g": (0, 2 * hb)})
            a.transfer(peer, "push", local_blocks={"g": src}, remote_blocks={"g": dst}).wait(20)

        def page(raw, n, k):
            stride = bt * n * hb + pad
            return raw[k * stride:k * stride + bt * n * hb].view(bt, n, hb)

        for i in range(2):
            want = before[i].clone()
            for s_, d in zip(src, dst):
                page(want, 2, d)[:] = page(views[i], 4, s_)[:, 2:4]
            assert torch.equal(views[2 + i], want), i
            assert not torch.equal(views[2 + i], before[i])
    finally:
        for ag in agents[::-1]:
            ag.close()
        for x in bufs:
            x.close()


def test_layouts_that_differ_are_refused_by_group(need_nixl, host):
    bufs = [host.alloc(1 << 16, r) for r in (0, 1)]
    try:
        t0 = host.as_tensor(bufs[0])[:6 * 3 * 8].view(6, 3, 8)
        t1 = host.as_tensor(bufs[1])[:6 * 2 * 8].view(6, 2, 8)
        a = KVAgent("a", platform=host, device=0, remote="nixl", timeout_s=10)
        b = KVAgent("b", platform=host, device=1, remote="nixl", timeout_s=10)
        try:
            a.register_group("g", 3, {"x": t0})
            b.register_group("g", 2, {"x": t1})
            p = a.add_peer(b.metadata(), route="nixl")
            with pytest.raises(LayoutMismatch, match="one must divide the other"):
                a.prepare(p, "pull", local_blocks={"g": [0]}, remote_blocks={"g": [0]})
        finally:
            b.close()
            a.close()
    finally:
        for x in bufs:
            x.close()


def test_route_choice_and_errors_without_asking(host, monkeypatch):
    """An agent without NIXL refuses route='nixl' and a peer on another host, naming what to do."""
    a = KVAgent("plain-a", platform=host, device=0, timeout_s=10)
    b = KVAgent("plain-b", platform=host, device=1, timeout_s=10)
    try:
        blob = b.metadata()
        with pytest.raises(BackendUnavailable, match="remote='nixl'"):
            a.add_peer(blob, route="nixl")
        with pytest.raises(BadInput, match="route must be"):
            a.add_peer(blob, route="ucx")
        body = json.loads(blob[_HEADER.size:])
        body["host"] = "elsewhere"
        raw = json.dumps(body).encode()
        far = _HEADER.pack(METADATA_MAGIC, METADATA_VERSION, 0, len(raw)) + raw
        with pytest.raises(BackendUnavailable, match="elsewhere"):
            a.add_peer(far)
        with pytest.raises(BackendUnavailable, match="route='nixl'"):
            a.add_peer(far, route="ipc")
        assert a.add_peer(blob).route == "ipc"
    finally:
        b.close()
        a.close()


def test_missing_nixl_is_a_typed_error_naming_the_extra(host, monkeypatch):
    from gpuxfer.kv import nixl_ffi
    monkeypatch.setattr(nixl_ffi, "find_nixl", lambda refresh=False: (None, "NIXL is not installed (tried nixl): "
                                                                          "pip install nixl-cu13"))
    with pytest.raises(BackendUnavailable, match=r"gpuxfer\[nixl\]"):
        KVAgent("wants-nixl", platform=host, device=0, remote="nixl")
    monkeypatch.setenv("GPUXFER_KV_REMOTE", "nixl")
    with pytest.raises(BackendUnavailable, match="NIXL is not installed"):
        KVAgent("wants-nixl-env", platform=host, device=0)
    from gpuxfer.kv.nixl_route import route_report
    assert "gpuxfer[nixl]" in route_report(host)["nixl"]
    with pytest.raises(BadInput, match="remote"):
        KVAgent("bad-remote", platform=host, device=0, remote="ucx")


def _with_nixl_section(blob: bytes, section) -> bytes:
    body = json.loads(blob[_HEADER.size:])
    body["nixl"] = section
    raw = json.dumps(body).encode()
    return _HEADER.pack(METADATA_MAGIC, METADATA_VERSION, 0, len(raw)) + raw


def test_hostile_nixl_metadata_is_refused(host):
    """Forged NIXL sections: BadMetadata naming the field, before anything reaches NIXL."""
    buf = host.alloc(1 << 14, 0)
    a = KVAgent("meta-a", platform=host, device=0, timeout_s=10)
    try:
        a.register_group("g", 4, {"x": host.as_tensor(buf)[:4 * 4 * 8].view(4, 4, 8)})
        blob = a.metadata()
        nbytes = decode_metadata(blob).allocations[0].nbytes
        good = {"agent": "n", "md": "00ff", "mem": "DRAM", "device": 0, "bases": [4096]}
        assert decode_metadata(_with_nixl_section(blob, good)).nixl["md"] == b"\x00\xff"
        for field, value, match in [
            ("agent", "", "'agent'"), ("agent", 5, "'agent'"), ("md", "zz", "not hex"), ("md", "", "'md'"),
            ("mem", "HBM", "'mem'"), ("device", -1, "'device'"), ("device", True, "'device'"),
            ("bases", [], "one address per allocation"), ("bases", [0], "base 0"),
            ("bases", [(1 << 64) - nbytes + 1], "base 0"), ("bases", ["4096"], "base 0"),
        ]:
            with pytest.raises(BadMetadata, match=match):
                decode_metadata(_with_nixl_section(blob, dict(good, **{field: value})))
        with pytest.raises(BadMetadata, match="object"):
            decode_metadata(_with_nixl_section(blob, [1, 2]))
        with pytest.raises(BadMetadata, match="'md'"):
            decode_metadata(_with_nixl_section(blob, dict(good, md="00" * ((4 << 20) + 1))))
    finally:
        a.close()
        buf.close()


def test_notifications_advance_only_over_values_that_all_arrived(need_nixl, host):
    """The receiver's word reaches n only once notifications 1..n all arrived, whatever order they came in;
    malformed messages are ignored."""
    a = KVAgent("notif", platform=host, device=0, timeout_s=10, remote="nixl")
    try:
        side = a.nixl
        side.senders.add("peer")                        # as a peer's NIXL agent is, while it is one
        side._deliver({"peer": [b"gxkv:3:2", b"junk", b"gxkv:99:1", b"gxkv:3:x"]})
        assert a.notification(3) == 0
        side._deliver({"peer": [b"gxkv:3:1", b"gxkv:3:4"]})
        assert a.notification(3) == 2
        side._deliver({"peer": [b"gxkv:3:3"]})
        assert a.notification(3) == 4
        side._deliver({"peer": [b"gxkv:3:2"]})          # a repeat never lowers it
        assert a.notification(3) == 4
    finally:
        a.close()


def _held(side) -> int:
    """Notification values the side holds, past their slots' words, over every slot."""
    return sum(bin(bits).count("1") for bits in side._ahead)


def test_notifications_held_out_of_order_stay_within_a_window(need_nixl, host):
    """Values at most NOTIFY_WINDOW past a slot's word are held until the ones before them arrive; any further
    ahead is refused and counted: a slot never holds more than the window, whatever arrives."""
    from gpuxfer.kv.nixl_route import NOTIFY_WINDOW as W
    a = KVAgent("notif-w", platform=host, device=0, timeout_s=10, remote="nixl")
    try:
        side = a.nixl
        side.senders.add("peer")
        side._deliver({"peer": [b"gxkv:2:%d" % v for v in range(2, 3 * W)]})
        assert a.notification(2) == 0 and _held(side) == W - 1 and side.refused == 2 * W - 1
        side._deliver({"peer": [b"gxkv:2:1", b"gxkv:2:%d" % (2 * W), b"gxkv:2:%d" % (2 * W + 1)]})
        assert a.notification(2) == W and _held(side) == 1 and side.refused == 2 * W
        side._deliver({"peer": [b"gxkv:2:%d" % v for v in range(W + 1, 2 * W)]})
        assert a.notification(2) == 2 * W and _held(side) == 0
    finally:
        a.close()


def test_a_flood_of_forged_notifications_holds_nothing_and_real_ones_complete(nixl_pair, caplog):
    """Notifications sent over NIXL far past a slot's word (a forged or broken sender), tens of thousands: none
    held, each counted, the first logged; the transfers' own notifications to that slot then complete."""
    import time
    from gpuxfer.kv.nixl_route import NOTIFY_WINDOW as W
    (a, b), (p, _), caches = nixl_pair
    n = 20_000
    with a.nixl.lock:
        for v in range(n):
            a.nixl.nixl.notify(p.remote, b"gxkv:5:%d" % (W + 1 + 7 * v))
    deadline = time.monotonic() + 60
    while b.nixl.refused < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert b.nixl.refused == n and _held(b.nixl) == 0
    for blk in range(3):
        a.transfer(p, "push", local_blocks={"full": [blk]}, remote_blocks={"full": [blk + 4]}, notify_slot=5).wait(20)
    assert b.wait_notification(5, 3, timeout_s=20) == 3 and _held(b.nixl) == 0
    name = "model.layers.0.attn"
    assert torch.equal(caches[1]["full"][name][:, 4:7], caches[0]["full"][name][:, 0:3])
    assert len([r for r in caplog.records if "refused NIXL notification" in r.getMessage()]) == 1


def _until(cond, what: str) -> None:
    """Wait (bounded) for ``cond()`` -- an outcome, refused or delivered, of notifications sent: the receiving
    side's poller drains NIXL's notifications meanwhile."""
    import time
    deadline = time.monotonic() + 60
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_notifications_of_an_agent_that_is_no_peer_never_move_a_word(nixl_pair, host, caplog):
    """A third NIXL agent that loaded this agent's metadata (added it as its peer) but is not this agent's peer:
    its notifications -- riding on a push, on an empty request, or sent alone in our senders' format -- are
    refused and counted, the first logged, and move no word, though its values are the next ones; the real
    peer's pushes then notify as always."""
    (a, b), (p, _), caches = nixl_pair
    buf = host.alloc(1 << 16, 0)
    c = KVAgent("stranger", platform=host, device=0, timeout_s=20, remote="nixl")
    try:
        c.register_group("full", BT, _caches(0, host.as_tensor(buf))["full"])
        to_b = c.add_peer(b.metadata(), route="nixl")
        c.transfer(to_b, "push", local_blocks={"full": [0]}, remote_blocks={"full": [9]}, notify_slot=5).wait(20)
        c.transfer(to_b, "push", local_blocks={"full": []}, remote_blocks={"full": []}, notify_slot=5).wait(20)
        with c.nixl.lock:
            for v in (3, 4):
                c.nixl.nixl.notify(to_b.remote, b"gxkv:5:%d" % v)
        _until(lambda: b.nixl.refused_senders == 4 or b.notification(5), "the notifications never arrived")
        assert b.notification(5) == 0 and _held(b.nixl) == 0 and b.nixl.refused == 0
        for blk in range(2):
            a.transfer(p, "push", local_blocks={"full": [blk]}, remote_blocks={"full": [blk + 4]},
                       notify_slot=5).wait(20)
        assert b.wait_notification(5, 2, timeout_s=20) == 2 and b.notification(5) == 2
        name = "model.layers.0.attn"
        assert torch.equal(caches[1]["full"][name][:, 4:6], caches[0]["full"][name][:, 0:2])
        assert b.nixl.refused_senders == 4
        logged = [r.getMessage() for r in caplog.records if "not a peer of this agent" in r.getMessage()]
        assert len(logged) == 1 and c.nixl.name in logged[0]
    finally:
        c.close()
        buf.close()


def test_a_removed_peers_notifications_are_refused(nixl_pair):
    """Once the receiver removed a peer, that peer's notifications (sent alone, in our senders' format) are
    refused and counted and move no word; the peer's pushes with notifications before moved it."""
    (a, b), (p, back), caches = nixl_pair
    a.transfer(p, "push", local_blocks={"full": [1]}, remote_blocks={"full": [2]}, notify_slot=6).wait(20)
    assert b.wait_notification(6, 1, timeout_s=20) == 1
    b.remove_peer(back)
    with a.nixl.lock:
        for v in (2, 3):
            a.nixl.nixl.notify(p.remote, b"gxkv:6:%d" % v)
    _until(lambda: b.nixl.refused_senders == 2 or b.notification(6) > 1, "the notifications never arrived")
    assert b.notification(6) == 1 and _held(b.nixl) == 0 and not b.nixl.senders


def test_a_peer_on_another_host_takes_the_nixl_route_by_itself(need_nixl, host):
    """``add_peer(blob)`` with no route named: a peer whose metadata names another host goes over NIXL."""
    bufs = [host.alloc(1 << 16, r) for r in (0, 1)]
    agents = [KVAgent(f"far{r}", platform=host, device=r, timeout_s=20, remote="nixl") for r in (0, 1)]
    try:
        caches = [_caches(r, host.as_tensor(b)) for r, b in enumerate(bufs)]
        for r, a in enumerate(agents):
            a.register_group("full", BT, caches[r]["full"])
        body = json.loads(agents[1].metadata()[_HEADER.size:])
        body["host"] = "another-host"
        raw = json.dumps(body).encode()
        peer = agents[0].add_peer(_HEADER.pack(METADATA_MAGIC, METADATA_VERSION, 0, len(raw)) + raw)
        assert peer.route == "nixl"
        agents[0].transfer(peer, "push", local_blocks={"full": [3, 4]}, remote_blocks={"full": [9, 1]}).wait(20)
        for name, t in caches[0]["full"].items():
            assert torch.equal(caches[1]["full"][name][:, [9, 1]], t[:, [3, 4]])
    finally:
        for a in agents:
            a.close()
        for b in bufs:
            b.close()


@pytest.mark.parametrize("pieces,per_block,src,dst,descriptors", [
    ([(0, 64), (64, 64)], 1, [5, 6, 9], [1, 2, 3], 2 * 3),                  # whole blocks, runs too short to merge
    ([(0, 64), (72, 56)], 2, [5, 6, 9], [1, 2, 3], 2 * 3 * 2),              # pieces apart: one descriptor each
    ([(0, 64), (64, 64)], 1, [4, 5, 6, 7, 8, 9], [0, 1, 2, 3, 10, 11], 2 * 2),  # two runs of whole blocks
    ([(0, 64), (72, 56)], 2, [4, 5, 6, 7, 8, 9], [0, 1, 2, 3, 10, 11], 2 * 6 * 2),  # runs of pieces apart: no
    ([(0, 64), (64, 64)], 1, [9, 8, 7, 6], [3, 2, 1, 0], 2 * 1),            # both sides descending: one run
    ([(0, 64), (64, 64)], 1, [6, 7, 8, 9], [3, 2, 1, 0], 2 * 4),            # opposite orders: no run
])
def test_nixl_descriptors_cover_pieces_in_a_row_and_runs_of_blocks(need_nixl, pieces, per_block, src, dst,
                                                                    descriptors):
    """Equal block sizes: a block's pieces that lie in a row on both sides (a layer's heads, head-major) are one
    NIXL descriptor, pieces apart stay one each; where the pieces make whole blocks, a request's runs of blocks
    consecutive on both sides are one descriptor per layer when that at least halves the count. The bytes land
    in every case, and the gap between pieces stays."""
    from gpuxfer.kv.layers import KVLayerSpec
    from gpuxfer.platforms import get_platform
    plat = get_platform("host")
    rng = np.random.default_rng(7)
    bufs, agents, flats = [], [], []
    try:
        for r in range(2):
            bufs.append(plat.alloc(1 << 13, r))
            flat = plat.as_tensor(bufs[-1])
            flat.copy_(torch.from_numpy(rng.integers(0, 256, flat.numel(), dtype=np.uint8)))
            flats.append(flat)
            agents.append(KVAgent(f"coalesce{r}", platform=plat, device=r, remote="nixl"))
            agents[-1].register_group("heads", 4, {f"model.layers.{i}.attn": KVLayerSpec(
                flat[i * 2048:(i + 1) * 2048], 16, 128, pieces) for i in range(2)})
        before = [f.clone() for f in flats]
        peer = agents[1].add_peer(agents[0].metadata(), route="nixl")
        x = agents[1].prepare(peer, "pull", local_blocks={"heads": dst}, remote_blocks={"heads": src})
        assert x.descriptors == descriptors
        x.post().wait(60)
        want = before[1].clone()
        for i in range(2):
            for s, d in zip(src, dst):
                for off, n in pieces:
                    a, b = i * 2048 + d * 128 + off, i * 2048 + s * 128 + off
                    want[a:a + n] = before[0][b:b + n]
        assert torch.equal(flats[1], want) and torch.equal(flats[0], before[0])
    finally:
        for a in agents:
            a.close()
        for b in bufs:
            b.close()


@pytest.mark.parametrize("bad", ["soon", -1, 0, float("nan"), float("inf")])
def test_a_handle_wait_refuses_timeouts_that_are_not_bounded(nixl_pair, monkeypatch, bad):
    """``handle.wait(timeout_s)`` on the NIXL route holds its bound to the IPC route's rule: a finite number of
    seconds in (0, one week], else BadInput at once -- never a wait without end (NaN, infinity) nor an untyped
    error."""
    import threading
    from gpuxfer.kv import nixl_ffi
    (a, _), (p, _), _ = nixl_pair
    monkeypatch.setattr(nixl_ffi.NixlAgent, "state", lambda self, h: "PROC")
    h = a.transfer(p, "pull", local_blocks={"full": [0]}, remote_blocks={"full": [1]}, name="bounded")
    got = []

    def wait():
        try:
            h.wait(bad)
            got.append("returned")
        except BaseException as exc:  # noqa: BLE001 - what the test looks at
            got.append(exc)

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    t.join(5)
    assert got, f"handle.wait({bad!r}) still waits after 5 s"
    assert isinstance(got[0], BadInput) and "timeout" in str(got[0]), got
    monkeypatch.undo()
    h.wait(20)


def test_lists_rebuilt_while_a_post_is_under_way_are_not_released_under_it(need_nixl, host, monkeypatch):
    """A request naming a group registered since add_peer rebuilds the peer's lists while another thread posts a
    request prepared on the old ones (past the post's check of its lists): NIXL is never handed a list already
    released -- the post either runs on the old lists (kept until it completes) or is refused (prepare again)."""
    import threading
    from gpuxfer.kv import nixl_ffi, nixl_peer
    bufs = [host.alloc(1 << 16, 1), host.alloc(1 << 14, 0), host.alloc(1 << 16, 0)]
    a = KVAgent("race-a", platform=host, device=0, timeout_s=20, remote="nixl")
    b = KVAgent("race-b", platform=host, device=1, timeout_s=20, remote="nixl")
    try:
        mine = _caches(0, host.as_tensor(bufs[2]))
        a.register_group("full", BT, mine["full"])
        theirs = _caches(1, host.as_tensor(bufs[0]))
        b.register_group("full", BT, theirs["full"])
        b.register_group("mla", MLA_BT[1], theirs["mla"])
        p = a.add_peer(b.metadata(), route="nixl")
        x = a.prepare(p, "pull", local_blocks={"full": [2]}, remote_blocks={"full": [3]}, name="on-old-lists")
        a.register_group("mla", MLA_BT[0], _caches(0, host.as_tensor(bufs[1]))["mla"])
        real_post, real_make = nixl_peer._NixlTransfer._post_locked, nixl_ffi.NixlAgent.make_prepped
        handed = []

        def post_locked(self):          # another thread's request rebuilds the lists in this post's window
            t = threading.Thread(target=lambda: a.prepare(p, "pull", local_blocks={"mla": [2]},
                                                          remote_blocks={"mla": [5, 9]}))
            t.start()
            t.join(20)
            return real_post(self)

        def make_prepped(self, op, local_h, local_idx, remote_h, remote_idx, notif=b""):
            handed.append((local_h in self._dlists, remote_h in self._dlists))
            return real_make(self, op, local_h, local_idx, remote_h, remote_idx, notif)

        monkeypatch.setattr(nixl_peer._NixlTransfer, "_post_locked", post_locked)
        monkeypatch.setattr(nixl_ffi.NixlAgent, "make_prepped", make_prepped)
        try:
            x.post().wait(20)
            for name, t in mine["full"].items():
                assert torch.equal(t[:, 2], theirs["full"][name][:, 3])
        except BadInput as exc:
            assert "prepare it again" in str(exc)
        assert all(h == (True, True) for h in handed), f"NIXL was handed released lists: {handed}"
        monkeypatch.undo()
        a.remove_peer(p)
    finally:
        b.close()
        a.close()
        for buf in bufs:
            buf.close()


def test_a_handle_whose_transfer_remove_peer_released_never_polls_it(nixl_pair, monkeypatch):
    """remove_peer past its bound releases a transfer still running: the handle then raises a typed error naming
    the request (from done() and wait()) -- it never asks NIXL about the released transfer, nor reports it done."""
    from gpuxfer.kv import nixl_ffi
    (a, _), (p, _), _ = nixl_pair
    real, real_post = nixl_ffi.NixlAgent.state, nixl_ffi.NixlAgent.post
    monkeypatch.setattr(nixl_ffi.NixlAgent, "state", lambda self, h: "PROC")
    monkeypatch.setattr(nixl_ffi.NixlAgent, "post", lambda self, h, what: real_post(self, h, what) and "PROC")
    monkeypatch.setattr(a, "timeout_s", 0.3)
    h = a.transfer(p, "pull", local_blocks={"full": [0]}, remote_blocks={"full": [1]}, name="cut-short")
    a.remove_peer(p)
    asked = []

    def state(self, x):
        asked.append(x in self._xfers)          # a handle NIXL still holds, not one released
        return real(self, x)

    monkeypatch.setattr(nixl_ffi.NixlAgent, "state", state)
    with pytest.raises(NotRegistered, match="cut-short"):
        h.done()
    with pytest.raises(NotRegistered, match="cut-short"):
        h.wait(5)
    assert asked == []


def test_a_handle_polled_while_another_caller_releases_it_is_done(nixl_pair, monkeypatch):
    """Two callers of one handle (a wait and close's settle, or two threads): one that polls right after the other
    released the completed transfer sees it done, never asks NIXL about the released transfer."""
    from gpuxfer.kv import nixl_ffi
    (a, _), (p, _), _ = nixl_pair
    side = a.nixl
    h = a.transfer(p, "pull", local_blocks={"full": [0]}, remote_blocks={"full": [1]}, name="polled-twice")
    asked, armed, real_state, real_release = [], [], nixl_ffi.NixlAgent.state, nixl_ffi.NixlAgent.release_quietly

    class Lock:                         # the side's lock, running `after` once it is let go
        def __init__(self, inner):
            self.inner, self.after = inner, None

        def __enter__(self):
            self.inner.acquire()

        def __exit__(self, *exc):
            self.inner.release()
            after, self.after = self.after, None
            if after is not None:
                after()

    def state(self, x):
        asked.append(x in self._xfers)
        return real_state(self, x)

    def release_quietly(self, handles=(), dlists=()):
        if not armed and any(x is h._xfer for x in handles):
            armed.append(True)
            side.lock.after = lambda: asked.append(("done", h.done()))     # the other caller, in the window
        return real_release(self, handles, dlists)

    monkeypatch.setattr(side, "lock", Lock(side.lock))
    monkeypatch.setattr(nixl_ffi.NixlAgent, "state", state)
    monkeypatch.setattr(nixl_ffi.NixlAgent, "release_quietly", release_quietly)
    h.wait(20)
    assert armed and asked[-1] == ("done", True) and all(x is True for x in asked[:-1]), asked


def test_the_id_checkers_cache_stays_bounded():
    """Ever-new keys keep at most ``cap`` values, the least recently used going first."""
    from gpuxfer.kv.ids import _IdsCache
    cache, built = _IdsCache(3), []
    for k in range(100):
        assert cache.get(("pull", (f"g{k}",)), lambda: built.append(k) or k) == k
        assert cache.get(("pull", ("g0",)), lambda: -1) in (0, -1)        # g0 kept in use
        assert len(cache) <= 3
    assert cache.get(("pull", ("g0",)), lambda: -2) == 0 and cache.get(("pull", ("g5",)), lambda: -3) == -3


def test_a_peers_id_checkers_stay_bounded_and_move_right_bytes(nixl_pair):
    """Requests naming more (direction, groups) sets than the peer keeps: the cache stays at its cap, each
    request built again as needed moves the bytes asked."""
    from gpuxfer.kv.ids import IDS_PER_PEER
    (a, b), (p, q), caches = nixl_pair
    assert p._ids.cap == IDS_PER_PEER
    p._ids.cap = 1
    for k in range(4):
        src, dst = k % BLOCKS, (k + 5) % BLOCKS
        if k % 2:
            a.transfer(p, "push", local_blocks={"full": [src]}, remote_blocks={"full": [dst]}).wait(20)
            mine, theirs = caches[0]["full"], caches[1]["full"]
        else:
            a.transfer(p, "pull", local_blocks={"full": [dst]}, remote_blocks={"full": [src]}).wait(20)
            mine, theirs = caches[1]["full"], caches[0]["full"]
        assert len(p._ids) == 1
        for name, t in mine.items():
            assert torch.equal(t[:, src], theirs[name][:, dst])
