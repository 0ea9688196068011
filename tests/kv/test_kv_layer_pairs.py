"""Layers paired by name over both routes (ipc and NIXL): a side with a layer the other lacks (a draft or MTP
layer on the decode side only), or one both hold with other pieces, moves the layers that pair over a layer
range that leaves it out, in both directions, and refuses with LayoutMismatch naming it a range that asks for
it."""
from __future__ import annotations

import pytest
import torch

from gpuxfer import config
from gpuxfer.errors import LayoutMismatch
from gpuxfer.kv.agent import KVAgent

from _agent_arena import Arena, same_bytes

MTP = "model.layers.3.mtp"


@pytest.fixture(params=["ipc", "nixl"])
def route(request, monkeypatch):
    if request.param == "nixl":
        from gpuxfer.kv.nixl_route import nixl_reason
        from gpuxfer.platforms.host import HostPlatform
        why = nixl_reason(HostPlatform)
        if why is not None:
            if config.get("GPUXFER_TEST_REQUIRE_NIXL"):
                pytest.fail(f"GPUXFER_TEST_REQUIRE_NIXL=1 but the NIXL route cannot run: {why}")
            pytest.skip(why)
        monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    return request.param


def _layers(arena, names, seed):
    return {n: arena.tensor((2, 8, 4, 2, 4), torch.bfloat16, seed=seed + i) for i, n in enumerate(names)}


@pytest.fixture(params=["missing", "geometry"])
def extra(host, route, request):
    """prefill (device 0): layers 0-2 (``missing``), or also an MTP layer of half the heads of decode's
    (``geometry``); decode (device 1): layers 0-2 and an MTP layer (index 3); each the other's peer over ``route``;
    (prefill, decode, their layers, decode's peer of prefill, prefill's peer of decode)."""
    arenas = [Arena(host, 0), Arena(host, 1)]
    kw = {"remote": "nixl"} if route == "nixl" else {}
    pre = KVAgent("prefill", platform=host, device=0, engine="triton", timeout_s=30, **kw)
    dec = KVAgent("decode", platform=host, device=1, engine="triton", timeout_s=30, **kw)
    common = [f"model.layers.{i}.attn" for i in range(3)]
    src, dst = _layers(arenas[0], common, 1), _layers(arenas[1], common + [MTP], 20)
    if request.param == "geometry":
        src[MTP] = arenas[0].tensor((2, 8, 4, 1, 4), torch.bfloat16, seed=9)
    pre.register_group("g", 4, src)
    dec.register_group("g", 4, dst)
    p_dec = dec.add_peer(pre.metadata(), route=route)
    p_pre = pre.add_peer(dec.metadata(), route=route)
    yield pre, dec, src, dst, p_dec, p_pre
    dec.close()
    pre.close()
    for a in arenas:
        a.close()


def _moved(dst, src, d, s, before):
    """Each layer of ``dst`` (a copy of it taken before: ``before``) holds ``src``'s layer of its name at block
    ``d`` (from block ``s``), and is unchanged elsewhere (a layer ``src`` lacks: unchanged)."""
    for name, t in dst.items():
        want = before[name].clone()
        if name in src and name != MTP:
            want[:, d] = src[name][:, s]
        assert same_bytes(t, want), name


@pytest.mark.parametrize("layers", [(0, 3), (1, 3), (0, 1)])
def test_the_side_with_an_extra_layer_pulls_and_pushes_the_layers_both_hold(extra, layers):
    pre, dec, src, dst, p_dec, p_pre = extra
    sel = {n for n in src if layers[0] <= int(n.split(".")[2]) < layers[1]}
    assert MTP not in sel
    before = {k: v.clone() for k, v in dst.items()}
    dec.transfer(p_dec, "pull", local_blocks={"g": [5]}, remote_blocks={"g": [2]}, layers=layers).wait(30)
    _moved(dst, {n: src[n] for n in sel}, 5, 2, before)
    before = {k: v.clone() for k, v in src.items()}
    dec.transfer(p_dec, "push", local_blocks={"g": [1]}, remote_blocks={"g": [7]}, layers=layers).wait(30)
    _moved(src, {n: dst[n] for n in sel}, 7, 1, before)


def test_the_other_side_pulls_and_pushes_the_layers_both_hold(extra):
    pre, dec, src, dst, p_dec, p_pre = extra
    before = {k: v.clone() for k, v in src.items()}
    wide = (0, 3) if MTP in src else (0, 4)         # (a pull's source layer without a destination: moves nothing)
    pre.transfer(p_pre, "pull", local_blocks={"g": [3]}, remote_blocks={"g": [6]}, layers=wide).wait(30)
    _moved(src, dst, 3, 6, before)
    before = {k: v.clone() for k, v in dst.items()}
    pre.transfer(p_pre, "push", local_blocks={"g": [0]}, remote_blocks={"g": [4]}, layers=(0, 3)).wait(30)
    _moved(dst, src, 4, 0, before)


@pytest.mark.parametrize("layers", [(0, 4), (3, 4), (2, 10)])
def test_a_range_asking_for_the_layer_one_side_lacks_is_refused_naming_it(extra, layers):
    pre, dec, src, dst, p_dec, p_pre = extra
    before = ({k: v.clone() for k, v in src.items()}, {k: v.clone() for k, v in dst.items()})
    kw = dict(local_blocks={"g": [0]}, remote_blocks={"g": [1]}, layers=layers)
    for agent, peer, op in ((dec, p_dec, "pull"), (dec, p_dec, "push"), (pre, p_pre, "push")):
        with pytest.raises(LayoutMismatch, match=MTP.replace(".", r"\.")):
            agent.prepare(peer, op, **kw)
    if MTP in src:
        with pytest.raises(LayoutMismatch, match=MTP.replace(".", r"\.")):
            pre.prepare(p_pre, "pull", **kw)
    for agent, peer in ((dec, p_dec), (pre, p_pre)):
        for op in ("pull", "push"):         # no range: the layers differ in number, or the MTP layers' pieces
            with pytest.raises(LayoutMismatch, match="layers here" if MTP not in src else "MTP|mtp"):
                agent.prepare(peer, op, local_blocks={"g": [0]}, remote_blocks={"g": [1]})
    for old, new in zip(before, (src, dst)):
        assert all(same_bytes(old[k], new[k]) for k in old)


def test_a_refusal_raised_again_keeps_no_frames_of_the_last(extra):
    """The same refused request, prepared many times: each LayoutMismatch's traceback holds the frames of its own
    call only (an error object raised again would pile up every earlier call's frames and their arrays)."""
    pre, dec, src, dst, p_dec, p_pre = extra
    depth = []
    for _ in range(3):
        with pytest.raises(LayoutMismatch) as err:
            dec.prepare(p_dec, "pull", local_blocks={"g": [0]}, remote_blocks={"g": [1]}, layers=(0, 4))
        tb, n = err.value.__traceback__, 0
        while tb is not None:
            tb, n = tb.tb_next, n + 1
        depth.append(n)
    assert depth[0] == depth[1] == depth[2], depth


def test_a_push_over_a_range_holding_a_peer_layer_whose_source_lies_outside_it_is_refused(host, route):
    """Layer "x" is layer 1 on the peer but layer 5 here (a misnumbered or forged index); "y" is layer 0 on both.
    A push over (0, 2) would leave the peer's layer 1 unwritten: LayoutMismatch naming it on both routes, nothing
    moved; a pull over (0, 2) moves "y" alone (its destination layers are this side's in the range), and a push
    over (0, 6) moves both."""
    from gpuxfer.kv.layers import KVLayerSpec
    arenas = [Arena(host, 0), Arena(host, 1)]
    kw = {"remote": "nixl"} if route == "nixl" else {}
    agents = [KVAgent(f"idx{r}", platform=host, device=r, engine="triton", timeout_s=30, **kw) for r in (0, 1)]
    try:
        tensors = [{n: a.tensor((8, 64), seed=10 * r + k) for k, n in enumerate("xy")} for r, a in enumerate(arenas)]
        for r, (ag, ts) in enumerate(zip(agents, tensors)):
            ag.register_group("g", 4, {n: KVLayerSpec(t, 8, 64, [(0, 64)], index=i) for (n, t), i in
                                       zip(ts.items(), ((1, 0) if r == 0 else (5, 0)))})
        here, there = agents[1], agents[0]
        peer = here.add_peer(there.metadata(), route=route)
        before = [{n: t.clone() for n, t in ts.items()} for ts in tensors]
        with pytest.raises(LayoutMismatch, match="'x'"):
            here.prepare(peer, "push", local_blocks={"g": [1]}, remote_blocks={"g": [2]}, layers=(0, 2))
        assert all(torch.equal(tensors[0][n], before[0][n]) for n in "xy")
        here.transfer(peer, "pull", local_blocks={"g": [3]}, remote_blocks={"g": [4]}, layers=(0, 2)).wait(30)
        want = before[1]["y"].clone()
        want[3] = before[0]["y"][4]
        assert torch.equal(tensors[1]["y"], want) and torch.equal(tensors[1]["x"], before[1]["x"])
        here.transfer(peer, "push", local_blocks={"g": [6]}, remote_blocks={"g": [7]}, layers=(0, 6)).wait(30)
        for n in "xy":
            want = before[0][n].clone()
            want[7] = tensors[1][n][6]
            assert torch.equal(tensors[0][n], want), n
    finally:
        for ag in agents[::-1]:
            ag.close()
        for a in arenas:
            a.close()
