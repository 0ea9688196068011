"""An agent's cache of routes: layer ranges that select the same layers (ending in a gap between layer indices,
or past the model) share one route, a peer keeps a bounded number of routes (the least recently used idle ones
go first), and a route whose post is still queued stays until it completed."""
from __future__ import annotations

import pytest
import torch

from gpuxfer.kv import routes as kv_routes

from _agent_arena import connect, same_bytes


def _gapped(pre, dec, a0, a1, indices):
    """Group "full" of layers with model indices ``indices`` on both sides (8 blocks of 4 tokens); (decode's
    layers, prefill's, decode's peer)."""
    def layers(arena, seed):
        return {f"model.layers.{i}.self_attn": arena.tensor((2, 8, 4, 2, 4), torch.bfloat16, seed=seed + i)
                for i in indices}
    src, dst = layers(a0, 1), layers(a1, 50)
    pre.register_group("full", 4, src)
    dec.register_group("full", 4, dst)
    p, _ = connect(pre, dec)
    return dst, src, p


def _pull(dec, p, dst, src, layers, d, s, stream=None):
    """Pull block ``s`` into block ``d`` over ``layers``; the handle, and a check of every layer's bytes."""
    before = {k: v.clone() for k, v in dst.items()}
    h = dec.prepare(p, "pull", local_blocks={"full": [d]}, remote_blocks={"full": [s]}, layers=layers).post(stream)

    def check():
        for name, t in dst.items():
            want = before[name].clone()
            if layers[0] <= int(name.split(".")[2]) < layers[1]:
                want[:, d] = src[name][:, s]
            assert same_bytes(t, want), (layers, name)
    return h, check


def _routes(agent) -> set[int]:
    return {id(r) for r in agent._routes.routes.values()}


def test_ranges_selecting_the_same_layers_share_one_route(pair):
    """Layers 0, 5 and 9: every range selecting layer 0 alone ((0, 1) ... (0, 5)), 5 alone, both, or 9 alone maps
    to one route per set of layers (four routes built, not one per range), each moving the bytes of its layers."""
    pre, dec, a0, a1 = pair
    dst, src, p = _gapped(pre, dec, a0, a1, (0, 5, 9))
    base = dec.device_bytes()["routes"]
    sets = [[(0, 1), (0, 2), (0, 5), (0, 3)], [(5, 6), (1, 6), (4, 9), (2, 7)], [(0, 6), (0, 9)],
            [(9, 10), (6, 10), (9, 10**9), (7, 2**40)]]
    for k, ranges in enumerate(sets):
        for d, layers in enumerate(ranges):
            h, check = _pull(dec, p, dst, src, layers, d, 7 - d)
            h.wait(60)
            check()
            assert dec.device_bytes()["routes"] == base + k + 1, (layers, dec.device_bytes())


def test_a_peer_keeps_a_bounded_number_of_routes(pair, monkeypatch):
    """With at most 3 routes per peer, requests over six distinct ranges (one route each) keep 3 routes cached,
    dropping the least recently used; each request, and each again after its route was dropped, moves its
    layer's bytes."""
    monkeypatch.setattr(kv_routes, "ROUTES_PER_PEER", 3, raising=False)
    pre, dec, a0, a1 = pair
    dst, src, p = _gapped(pre, dec, a0, a1, range(6))
    for rnd in range(2):
        for i in range(6):
            h, check = _pull(dec, p, dst, src, (i, i + 1), i, (i + rnd + 1) % 8)
            h.wait(60)
            check()
            assert dec.device_bytes()["routes"] <= 3, dec.device_bytes()
    last = dec.prepare(p, "pull", local_blocks={"full": [0]}, remote_blocks={"full": [1]}, layers=(5, 6)).route
    assert id(last) in _routes(dec)         # the most recently used stays


def test_a_route_whose_post_is_queued_stays_cached_until_it_completed(pair, monkeypatch):
    """At most one route per peer: a post held on a stream keeps its route (and slot) cached while other ranges'
    routes come and go; once it completed, its bytes are right and the next route built drops it."""
    monkeypatch.setattr(kv_routes, "ROUTES_PER_PEER", 1, raising=False)
    pre, dec, a0, a1 = pair
    dst, src, p = _gapped(pre, dec, a0, a1, range(4))
    plat = dec.platform
    gate = plat.alloc(64, 1)
    held = plat.create_stream(1)
    try:
        plat.memset_async(held, gate.ptr, 0, 64)
        plat.wait_flag(held, gate.ptr, 1)                   # the stream is held until the gate opens
        h0, _ = _pull(dec, p, dst, src, (0, 1), 2, 6, stream=held)
        name = "model.layers.0.self_attn"
        want = dst[name].clone()
        want[:, 2] = src[name][:, 6]
        busy = h0.transfer.route
        for i in (1, 2):
            h, check = _pull(dec, p, dst, src, (i, i + 1), 3, i)
            h.wait(60)
            check()
            assert id(busy) in _routes(dec) and len(_routes(dec)) == 2
        assert not h0.done()
        plat.host_write_flag(gate.ptr, 1, 1)
        h0.wait(60)
        assert same_bytes(dst[name], want)
        h, check = _pull(dec, p, dst, src, (3, 4), 4, 0)
        h.wait(60)
        check()
        assert _routes(dec) == {id(h.transfer.route)}
    finally:
        plat.synchronize(held, 30)
        held.close()
        gate.close()


def test_requests_naming_groups_in_every_order_add_one_key(pair):
    """Three groups named in each of their six orders: one route under one key (not a key per order: the cache's
    keys stay bounded by its routes), each request moving its bytes."""
    import itertools
    pre, dec, a0, a1 = pair
    names = ("ga", "gb", "gc")
    src, dst = {}, {}
    for k, g in enumerate(names):
        src[g] = {f"model.layers.{k}.{g}": a0.tensor((2, 8, 4, 2, 4), torch.bfloat16, seed=k + 1)}
        dst[g] = {f"model.layers.{k}.{g}": a1.tensor((2, 8, 4, 2, 4), torch.bfloat16, seed=k + 40)}
        pre.register_group(g, 4, src[g])
        dec.register_group(g, 4, dst[g])
    p, _ = connect(pre, dec)
    keys = len(dec._routes.routes)
    for d, order in enumerate(itertools.permutations(names)):
        dec.transfer(p, "pull", local_blocks={g: [d] for g in order}, remote_blocks={g: [7 - d] for g in order},
                     layers=(0, 2)).wait(60)
        for g in names:
            (name, t), = dst[g].items()
            if int(name.split(".")[2]) < 2:
                assert same_bytes(t[:, d], src[g][name][:, 7 - d]), (order, g)
    assert len(dec._routes.routes) == keys + 1, list(dec._routes.routes)


def test_device_bytes_counts_a_dropped_route_a_prepared_transfer_holds(pair, monkeypatch):
    """At most one route per peer: a prepared transfer's route dropped from the cache by another range's is still
    allocated, and device_bytes counts it (held_routes) until the transfer goes; a removed peer's route alike."""
    import gc
    monkeypatch.setattr(kv_routes, "ROUTES_PER_PEER", 1, raising=False)
    pre, dec, a0, a1 = pair
    dst, src, p = _gapped(pre, dec, a0, a1, range(2))
    kept = dec.prepare(p, "pull", local_blocks={"full": [1]}, remote_blocks={"full": [2]}, layers=(0, 1))
    kept.post().wait(60)
    one = dec.device_bytes()
    assert one["routes"] == 1 and one["held_routes"] == 0 and one["requests"] > 0, one
    h, check = _pull(dec, p, dst, src, (1, 2), 3, 4)
    h.wait(60)
    check()
    both = dec.device_bytes()
    assert both["routes"] == 1 and both["held_routes"] == 1 and both["requests"] == 2 * one["requests"], both
    assert id(kept.route) not in _routes(dec)
    del kept, h, check
    dec._poster.reap_locked()
    gc.collect()
    after = dec.device_bytes()
    assert after["held_routes"] == 0 and after["requests"] == one["requests"], after
    held = dec.prepare(p, "pull", local_blocks={"full": [1]}, remote_blocks={"full": [2]}, layers=(1, 2))
    dec.remove_peer(p)
    gone = dec.device_bytes()
    assert gone["routes"] == 0 and gone["held_routes"] == 1 and gone["requests"] == one["requests"], gone
    del held
    dec._poster.reap_locked()           # the poster keeps a completed post's buffers until it reaps them
    gc.collect()
    assert dec.device_bytes()["held_routes"] == 0 and dec.device_bytes()["requests"] == 0


def test_device_bytes_counts_routes_a_new_group_dropped_while_a_transfer_holds_them(pair):
    """register_group drops every cached route; one a prepared transfer holds still counts in device_bytes."""
    import gc
    pre, dec, a0, a1 = pair
    dst, src, p = _gapped(pre, dec, a0, a1, range(2))
    kept = dec.prepare(p, "pull", local_blocks={"full": [1]}, remote_blocks={"full": [2]}, layers=(0, 2))
    kept.post().wait(60)
    one = dec.device_bytes()
    dec.register_group("more", 4, {"model.layers.0.more": a1.tensor((2, 8, 4, 2, 4), torch.bfloat16, seed=3)})
    got = dec.device_bytes()
    assert got["routes"] == 0 and got["held_routes"] == 1 and got["requests"] == one["requests"] > 0, got
    del kept
    dec._poster.reap_locked()
    gc.collect()
    assert dec.device_bytes()["held_routes"] == 0 and dec.device_bytes()["requests"] == 0
