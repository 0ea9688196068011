"""KVAgent refusing bad input (block IDs, layouts, registration), removing peers and closing with
transfers in flight, metadata bytes (round trip, hostile and fuzzed blobs), and the host's export range.
"""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from gpuxfer.errors import (BadInput, BadMetadata, BlockIdError, LayoutMismatch, NotExportable, NotRegistered,
                            TransferTimeout)
from gpuxfer.kv.agent import KVAgent
from gpuxfer.kv.layers import KVLayerSpec
from gpuxfer.kv.metadata import METADATA_VERSION, decode_metadata

from _agent_arena import connect, held_pull, meta_body, reblob, same_bytes, vllm_layers


# ----------------------------------------------------------------------------- bad input


def test_bad_block_ids(pair):
    pre, dec, a0, a1 = pair
    pre.register_group("full", 4, vllm_layers(a0, 1, 4, 4, seed=1))
    dec.register_group("full", 4, vllm_layers(a1, 1, 4, 4, seed=2))
    pre.register_group("w", 2, {"w0": a0.tensor((6, 2, 8), seed=3)})
    dec.register_group("w", 4, {"w0": a1.tensor((6, 4, 8), seed=3)})
    p, _ = connect(pre, dec)

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
    for odd in (torch.tensor([0], dtype=torch.uint8).view(torch.bool), torch.tensor([0]).to_sparse(),
                torch.zeros(1, dtype=torch.float8_e4m3fn), torch.zeros(8, dtype=torch.uint8).view(torch.uint1)):
        with pytest.raises(BlockIdError, match="integers"):     # (torch cannot give numpy these)
            prep({"full": [0]}, {"full": odd})
    prep({"full": torch.tensor([1], dtype=torch.uint16)}, {"full": torch.tensor([2], dtype=torch.int8)})
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
    p, _ = connect(pre, dec)
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
    p, _ = connect(pre, dec)
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


def test_layers_a_peer_could_not_read_are_refused_at_registration(pair):
    """A layer whose index the metadata cannot carry (negative, not an int, or a number in its name past 2^62) is
    BadInput naming the layer at register_group -- not metadata the peer then refuses -- and layers that are not a
    mapping or a sequence are BadInput too."""
    pre, dec, a0, a1 = pair
    for layer, match in [({"x": KVLayerSpec(a0.tensor((4, 4, 8)), 4, 32, [(0, 32)], index=-1)}, "'x'.*index"),
                         ({"x": KVLayerSpec(a0.tensor((4, 4, 8)), 4, 32, [(0, 32)], index="3")}, "'x'.*index"),
                         ({"model.layers.99999999999999999999.attn": a0.tensor((4, 4, 8))}, "99999999999999999999")]:
        with pytest.raises(BadInput, match=match):
            pre.register_group("g", 4, layer)
    with pytest.raises(BadInput, match="layers"):
        pre.register_group("g", 4, 5)
    assert pre.groups == {}
    pre.register_group("g", 4, {"x": KVLayerSpec(a0.tensor((4, 4, 8)), 4, 32, [(0, 32)], index=7)})
    dec.register_group("g", 4, {"x": a1.tensor((4, 4, 8))})
    dec.add_peer(pre.metadata())


@pytest.mark.parametrize("kw", [{"device": "x"}, {"device": 1.5}, {"rank": None}, {"rank": "x"}, {"rank": True}])
def test_agent_device_and_rank_that_are_not_ints_are_refused(plat, kw):
    with pytest.raises(BadInput, match=next(iter(kw))):
        KVAgent("bad", platform=plat, **kw)


def test_removed_peer_and_closed_agent(pair):
    pre, dec, a0, a1 = pair
    pre.register_group("g", 4, [a0.tensor((4, 4, 8))])
    dec.register_group("g", 4, [a1.tensor((4, 4, 8))])
    p, _ = connect(pre, dec)
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
    src, dst, p_of_dec, gate, s, h = held_pull(pre, dec, a0, a1)
    plat = dec.platform
    opener = threading.Timer(0.2, plat.host_write_flag, (gate.ptr, 1, 1))
    try:
        opener.start()
        dec.remove_peer("prefill")
        assert h.done() and p_of_dec.flags.closed and p_of_dec.flags.stage_mem.closed and dec.failed is None
        assert pre.notification(2) == 1
        for name in src:
            assert same_bytes(dst[name][:, 0], src[name][:, 3])
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
    src, dst, p_of_dec, gate, s, h = held_pull(pre, dec, a0, a1)
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
        assert 1 <= len(dec._poster.inflight) <= INFLIGHT_KEEP
        assert same_bytes(dst[next(iter(dst))][:, 1], src[next(iter(src))][:, 2])
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
    src, dst, p_of_dec, gate, s, h = held_pull(pre, dec, a0, a1)
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
            assert same_bytes(dst[name][:, 0], src[name][:, 3])
    finally:
        _stop_if_freed_under(s, h, p_of_dec)
        plat.host_write_flag(gate.ptr, 1, 1)
        plat.synchronize(s, 30)
        s.close()
        gate.close()
        del agent_mod._LEAKED[before:]
        link.close()


# ----------------------------------------------------------------------------- metadata bytes


def test_metadata_roundtrip_and_hostile_bytes(pair):
    pre, dec, a0, a1 = pair
    pre.register_group("full", 4, vllm_layers(a0, 2, 4, 4, seed=1))
    blob = pre.metadata()
    meta = decode_metadata(blob)
    assert meta.agent == "prefill" and [g.name for g in meta.groups] == ["full"]
    assert len(meta.groups[0].layers) == 2 and len(meta.allocations) == 1
    body = meta_body(blob)
    cases = [
        (b"", "shorter than"), (blob[:11], "shorter than"), (b"XXXX" + blob[4:], "magic"),
        (reblob(body, version=99), "version 99"), (blob[:-1], "body bytes"), (blob + b" ", "body bytes"),
        (reblob(body, version=METADATA_VERSION - 1), f"version {METADATA_VERSION - 1};"),
        (blob[:12] + b"\xff" * (len(blob) - 12), "not valid JSON"), ("text", "must be bytes"),
        (reblob([1, 2]), "JSON object"),
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
        return reblob(b)

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


def test_remove_peer_of_a_stale_or_foreign_peer_leaves_the_live_one(pair, plat):
    """remove_peer(peer) removes that peer only: a peer object removed before (its name since added again) or
    another agent's peer of the same name raises NotRegistered and the live peer of that name keeps working."""
    pre, dec, a0, a1 = pair
    src, dst = a0.tensor((4, 4, 8), seed=1), a1.tensor((4, 4, 8), seed=2)
    pre.register_group("g", 4, [src])
    dec.register_group("g", 4, [dst])
    stale = dec.add_peer(pre.metadata())
    dec.remove_peer(stale)
    live = dec.add_peer(pre.metadata())
    with pytest.raises(NotRegistered, match="removed before"):
        dec.remove_peer(stale)
    other = KVAgent("other", platform=plat, device=1, engine="triton", timeout_s=60)
    try:
        other.register_group("g", 4, [a1.tensor((4, 4, 8))])
        foreign = other.add_peer(pre.metadata())
        with pytest.raises(NotRegistered, match="another agent"):
            dec.remove_peer(foreign)
        assert not foreign.closed
    finally:
        other.close()
    assert dec.peers["prefill"] is live and not live.closed
    dec.transfer(live, "pull", local_blocks={"g": [0]}, remote_blocks={"g": [1]}).wait(30)
    assert same_bytes(dst[0], src[1])
    dec.remove_peer(live)


def test_posts_queued_faster_than_they_complete_look_at_few_events(pair, monkeypatch):
    """Posts behind a stream that does not move: a post looks at the oldest posted transfer's event only once the
    posted ones doubled since the last look (not at every post past INFLIGHT_KEEP), keeps every transfer until
    its event completed, and a reap once they completed drops them all and looks again from INFLIGHT_KEEP on."""
    from gpuxfer.kv.posting import INFLIGHT_KEEP
    pre, dec, a0, a1 = pair
    src, dst, p_of_dec, gate, s, h = held_pull(pre, dec, a0, a1)
    plat = dec.platform
    asked = []
    real = plat.event_query
    monkeypatch.setattr(plat, "event_query", lambda e: asked.append(e) or real(e))
    n = 8 * INFLIGHT_KEEP
    try:
        x = dec.prepare(p_of_dec, "pull", local_blocks={"full": [1]}, remote_blocks={"full": [2]})
        handles = [x.post(s) for _ in range(n)]
        assert len(asked) <= 8          # (a look at 16, 32, 64 and 128 kept, and the first slot's: not one a post)
        assert len(dec._poster.inflight) == n + 1 and not any(hh.done() for hh in handles)
    finally:
        plat.host_write_flag(gate.ptr, 1, 1)
        assert plat.synchronize(s, 30)
    assert h.done() and all(hh.done() for hh in handles)
    dec._poster.reap_locked()
    assert not dec._poster.inflight and dec._poster.reap_at == INFLIGHT_KEEP
    assert same_bytes(dst[next(iter(dst))][:, 1], src[next(iter(src))][:, 2])
