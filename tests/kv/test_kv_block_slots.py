"""The ``triton`` engine's slots with no descriptor table (``GPUXFER_KV_COPY=blocks``; docs/KV_API.md, "Slots
without descriptors"): each copy launch derives its rows from the block IDs on the device. Against the
descriptor slots (which the token oracle checks in test_kv_agent_transfers.py): no descriptor memory;
a batch past ``BATCH_ROWS`` still one upload; device IDs that fail the check move nothing; the expansion asked
for (``expanded_descriptors``) is the numpy plan's, whatever runs next on its slot; every byte the same as with
descriptor slots for the same requests."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gpuxfer.bench.kv.model.blocktable import burst_tables
from gpuxfer.bench.kv.model.layout import layout_for_burst, layout_groups
from gpuxfer.bench.kv.model.plan import request_plan
from gpuxfer.errors import BlockIdError
from gpuxfer.kv import batch
from gpuxfer.kv.agent import KVAgent

from _agent_arena import Arena, connect, same_bytes, vllm_layers


@pytest.fixture
def blocks(monkeypatch):
    monkeypatch.setenv("GPUXFER_KV_COPY", "blocks")


@pytest.fixture
def bpair(plat, blocks):
    a0, a1 = Arena(plat, 0, 1 << 18), Arena(plat, 1, 1 << 18)
    pre = KVAgent("prefill", platform=plat, device=0, engine="triton", timeout_s=60)
    dec = KVAgent("decode", platform=plat, device=1, engine="triton", timeout_s=60)
    assert pre._poster.blocks and dec._poster.blocks
    yield pre, dec, a0, a1
    dec.close()
    pre.close()
    a0.close()
    a1.close()


def _no_descriptors(agent) -> None:
    slots = [s for r in agent._routes.routes.values() for s in r.slots]
    assert slots and all(s.out is None and s.expand is None and s.rows == 0 for s in slots)
    assert agent.device_bytes()["descriptors"] == 0


def test_a_batch_past_the_row_budget_is_one_upload(bpair, monkeypatch):
    """Four requests of 8 rows each with a budget of 8 rows: descriptor slots cut them into four posts; slots
    without descriptors merge them into one."""
    pre, dec, a0, a1 = bpair
    src = vllm_layers(a0, 2, 12, 2, seed=5)
    dst = vllm_layers(a1, 2, 12, 2, seed=6)
    pre.register_group("full", 2, src)
    dec.register_group("full", 2, dst)
    peer, _ = connect(pre, dec)
    monkeypatch.setattr(batch, "BATCH_ROWS", 8)
    merged, post_route = [], batch._post_route
    monkeypatch.setattr(batch, "_post_route", lambda poster, xs, s: merged.append(len(xs)) or post_route(poster, xs, s))
    xs = [dec.prepare(peer, "pull", local_blocks={"full": [2 * i, 2 * i + 1]},
                      remote_blocks={"full": [11 - 2 * i, 10 - 2 * i]}) for i in range(4)]
    assert all(x.descriptors == 8 for x in xs)
    for h in dec.post_many(xs):
        h.wait(60)
    assert merged == [4]
    for name in src:
        for i in range(4):
            assert same_bytes(dst[name][:, [2 * i, 2 * i + 1]], src[name][:, [11 - 2 * i, 10 - 2 * i]])
    _no_descriptors(dec)


def test_device_ids_that_fail_the_check_move_nothing(bpair):
    pre, dec, a0, a1 = bpair
    src = vllm_layers(a0, 2, 12, 4, seed=7)
    dst = vllm_layers(a1, 2, 12, 4, seed=8)
    pre.register_group("full", 4, src)
    dec.register_group("full", 4, dst)
    peer, _ = connect(pre, dec)

    def on(ids):
        return torch.tensor(ids, dtype=torch.int32, device=dec._torch_device())

    before = {k: v.clone() for k, v in dst.items()}
    bad = [([1, 2], [3, 3]), ([1], [12])]          # a destination twice; one out of range
    for s, d in bad:
        h = dec.prepare(peer, "pull", local_blocks={"full": on(d)}, remote_blocks={"full": on(s)},
                        device_ids=True, name="bad").post()
        with pytest.raises(BlockIdError, match="'bad'.*nothing was moved"):
            h.wait(60)
    for k in dst:
        assert same_bytes(dst[k], before[k])
    dec.prepare(peer, "pull", local_blocks={"full": on([5, 0])}, remote_blocks={"full": on([9, 4])},
                device_ids=True).post().wait(60)
    for k in src:
        assert same_bytes(dst[k][:, [5, 0]], src[k][:, [9, 4]])
        rest = [b for b in range(12) if b not in (5, 0)]
        assert same_bytes(dst[k][:, rest], before[k][:, rest])
    _no_descriptors(dec)


def test_the_expansion_asked_for_is_the_plans(plat, blocks):
    """``expanded_descriptors`` of a blocks slot (a descriptor table made beside it, grown for a larger request)
    equals :func:`request_plan`'s descriptors; the table first made stays with the slot (work queued may still
    write it), and the slot's own launches hold none."""
    layout = layout_for_burst("kv-gqa", 80, 8, 1)
    bufs = [plat.alloc(layout.pool_bytes, d) for d in (0, 1)]
    agents = [KVAgent(f"side{d}", platform=plat, device=d, engine="triton") for d in (0, 1)]
    try:
        for ag, buf in zip(agents, bufs):
            for name, bt, layers in layout_groups(layout, plat.as_tensor(buf)):
                ag.register_group(name, bt, layers)
        peer = agents[1].add_peer(agents[0].metadata())
        key = lambda a: a[np.lexsort((a[:, 2], a[:, 1], a[:, 0]))]   # noqa: E731
        for isl in (16, 80):
            src_t = burst_tables(layout, isl, 1, seed=3, side="src")[0]
            dst_t = burst_tables(layout, isl, 1, seed=3, side="dst")[0]
            x = agents[1].prepare(peer, "pull", local_blocks=dst_t, remote_blocks=src_t)
            got = x.expanded_descriptors()
            want = request_plan(layout, layout, src_t, dst_t)
            assert got.shape == want.shape == (x.descriptors, 3)
            assert np.array_equal(key(got), key(want))
        (slot,) = [s for r in agents[1]._routes.routes.values() for s in r.slots]
        assert slot.rows == 0 and len(slot.spent) == 1 and slot.out.shape[0] >= x.descriptors
        # every table the slot holds is counted, the one it keeps for queued work included
        assert agents[1].device_bytes()["descriptors"] == 24 * (slot.out.shape[0] + slot.spent[0].shape[0])
        assert not any(launch is slot.expand for launch in slot.copies)
    finally:
        for ag in agents[::-1]:
            ag.close()
        for b in bufs:
            b.close()


def _mode_pair(plat, monkeypatch, mode: str, seed: int):
    """A prefill/decode pair whose slots copy by ``mode``, over three groups (blocks of 4 tokens on both sides;
    8 -> 2; 2 -> 8) of two layers each, the same bytes for the same ``seed``: ``(agents, arenas, decode's
    peer, prefill's peer, destination layers of both sides)``."""
    monkeypatch.setenv("GPUXFER_KV_COPY", mode)
    a0, a1 = Arena(plat, 0, 1 << 18), Arena(plat, 1, 1 << 18)
    pre = KVAgent(f"prefill-{mode}", platform=plat, device=0, engine="triton", timeout_s=60)
    dec = KVAgent(f"decode-{mode}", platform=plat, device=1, engine="triton", timeout_s=60)
    assert pre._poster.blocks == dec._poster.blocks == (mode == "blocks")
    layers = {}
    for k, (g, bs, bd) in enumerate((("same", 4, 4), ("down", 8, 2), ("up", 2, 8))):
        mine = {f"model.layers.{i}.{g}": a0.tensor((2, 48 // bs, bs, 2, 2), torch.float16, seed=seed + 10 * k + i)
                for i in range(2)}
        theirs = {f"model.layers.{i}.{g}": a1.tensor((2, 48 // bd, bd, 2, 2), torch.float16,
                                                     seed=seed + 10 * k + i + 5) for i in range(2)}
        pre.register_group(g, bs, mine)
        dec.register_group(g, bd, theirs)
        layers.update(mine)
        layers.update({"dec:" + n: t for n, t in theirs.items()})
    p_of_dec, p_of_pre = connect(pre, dec)
    return (pre, dec), (a0, a1), p_of_dec, p_of_pre, layers


def _requests(rng, n: int) -> list[dict]:
    """``n`` random requests: per group, source and destination IDs covering the same tokens (a request's
    destinations distinct; two requests may share one), and at times a layer range."""
    out = []
    for _ in range(n):
        req = {"layers": [None, (0, 1), (1, 2)][rng.integers(3)], "src": {}, "dst": {}}
        for g, bs, bd in (("same", 4, 4), ("down", 8, 2), ("up", 2, 8)):
            tokens = int(rng.integers(0, 20))          # (a group with no IDs: planes of no rows)
            req["src"][g] = rng.permutation(48 // bs)[:-(-tokens // bs)]
            req["dst"][g] = rng.permutation(48 // bd)[:-(-tokens // bd)]
        out.append(req)
    return out


@pytest.mark.parametrize("op", ["pull", "push"])
@pytest.mark.parametrize("seed", [1, 2])
def test_blocks_and_descriptor_slots_move_the_same_bytes(plat, monkeypatch, op, seed):
    """The same requests -- groups of equal and of differing block sizes, layer ranges, batches merged with
    padding and batches whose destinations overlap (posted in order) -- leave every byte of both sides the same
    with slots copying from the block IDs as with descriptor slots."""
    reqs = _requests(np.random.default_rng(seed), 5)
    after = {}
    for mode in ("descriptors", "blocks"):
        agents, arenas, p_of_dec, p_of_pre, layers = _mode_pair(plat, monkeypatch, mode, seed)
        pre, dec = agents
        before = {n: t.clone() for n, t in layers.items()}
        try:
            xs = []
            for r in reqs:
                if op == "pull":
                    xs.append(dec.prepare(p_of_dec, "pull", local_blocks=r["dst"], remote_blocks=r["src"],
                                          layers=r["layers"]))
                else:
                    xs.append(pre.prepare(p_of_pre, "push", local_blocks=r["src"], remote_blocks=r["dst"],
                                          layers=r["layers"]))
            initiator = dec if op == "pull" else pre
            for h in initiator.post_many(xs[:3]):           # a merged batch (padding between requests)
                h.wait(60)
            for h in initiator.post_many([xs[3], xs[4], xs[0]]):
                h.wait(60)
            for x in xs[1:3]:
                x.post().wait(60)
            after[mode] = {n: t.clone() for n, t in layers.items()}
            assert not all(same_bytes(before[n], after[mode][n]) for n in layers)
        finally:
            for ag in agents[::-1]:
                ag.close()
            for a in arenas:
                a.close()
    assert after["blocks"].keys() == after["descriptors"].keys()
    for n in after["blocks"]:
        assert same_bytes(after["blocks"][n], after["descriptors"][n]), n


def test_device_ids_blocks_and_descriptor_slots_move_the_same_bytes(plat, monkeypatch):
    """Device-ID requests -- alone, merged (one checked post), a merged batch one of whose requests fails the
    check (nothing of it moves), a route whose block sizes differ -- leave the same bytes in both modes."""
    rng = np.random.default_rng(7)
    reqs = _requests(rng, 4)
    after = {}
    for mode in ("descriptors", "blocks"):
        agents, arenas, peer, _, layers = _mode_pair(plat, monkeypatch, mode, 11)
        pre, dec = agents

        def on(ids):
            return torch.tensor(np.asarray(ids), dtype=torch.int32, device=dec._torch_device())

        def prep(r, groups, bad=False):
            d, s = {g: r["dst"][g] for g in groups}, {g: r["src"][g] for g in groups}
            if bad:                 # a destination named twice
                g = groups[0]
                d[g], s[g] = [*d[g], d[g][0]], [*s[g], s[g][0]]
            return dec.prepare(peer, "pull", local_blocks={g: on(v) for g, v in d.items()},
                               remote_blocks={g: on(v) for g, v in s.items()}, layers=r["layers"], device_ids=True)
        try:
            hs = dec.post_many([prep(r, ["same"]) for r in reqs[:3]])
            hs += dec.post_many([prep(reqs[3], ["same"]), prep(reqs[0], ["same"], bad=True)])
            hs += dec.post_many([prep(r, ["same", "down", "up"]) for r in reqs[1:]])
            ok = []
            for h in hs:
                try:
                    h.wait(60)
                    ok.append(True)
                except BlockIdError:
                    ok.append(False)
            assert ok == [True] * 3 + [False] * 2 + [True] * 3
            after[mode] = {n: t.clone() for n, t in layers.items()}
        finally:
            for ag in agents[::-1]:
                ag.close()
            for a in arenas:
                a.close()
    for n in after["blocks"]:
        assert same_bytes(after["blocks"][n], after["descriptors"][n]), n


def test_launches_of_several_tilings_and_many_planes(plat, monkeypatch):
    """A route of 16 KiB and 64-byte segments (two copy launches, the second's planes not starting at 0) over
    fourteen planes: the same bytes in both modes, push and pull, merged and alone."""
    from gpuxfer.kv.agent import KVLayerSpec
    after = {}
    for mode in ("descriptors", "blocks"):
        monkeypatch.setenv("GPUXFER_KV_COPY", mode)
        arenas = [Arena(plat, d, 1 << 19) for d in (0, 1)]
        agents = [KVAgent(f"tile{d}-{mode}", platform=plat, device=d, engine="triton", timeout_s=60) for d in (0, 1)]
        try:
            raws = []
            for d, (ag, ar) in enumerate(zip(agents, arenas)):
                big = {f"model.layers.{i}.big": KVLayerSpec(r, 4, 1 << 14, [(0, 1 << 14)])
                       for i, r in enumerate(ar.tensor((4 << 14,), seed=20 + 3 * d + k) for k in range(2))}
                small = {f"model.layers.{i}.small": KVLayerSpec(r, 8, 128, [(0, 64), (64, 64)])
                         for i, r in enumerate(ar.tensor((8 * 128,), seed=40 + 7 * d + k) for k in range(6))}
                ag.register_group("big", 1, big)
                ag.register_group("small", 1, small)
                raws += [s.tensor for s in (*big.values(), *small.values())]
            p_of_dec, p_of_pre = connect(*agents)
            pre, dec = agents
            assert dec._poster.blocks == (mode == "blocks")
            before = [r.clone() for r in raws]
            route = dec._routes.route(p_of_dec, "pull", None, ("big", "small"))
            assert len(route.launch_classes) == 2 and route.launch_classes[1][0] > 0
            xs = [dec.prepare(p_of_dec, "pull", local_blocks={"big": [3, 0], "small": [7, 2, 5]},
                              remote_blocks={"big": [1, 2], "small": [0, 6, 3]}),
                  dec.prepare(p_of_dec, "pull", local_blocks={"big": [1], "small": [1, 4]},
                              remote_blocks={"big": [3], "small": [2, 7]})]
            for h in dec.post_many(xs):
                h.wait(60)
            pre.transfer(p_of_pre, "push", local_blocks={"big": [0], "small": [4, 5]},
                         remote_blocks={"big": [2], "small": [0, 3]}).wait(60)
            after[mode] = [r.clone() for r in raws]
            # (both write the decode side's layers: each of them, none of the prefill side's)
            assert [not same_bytes(a, b) for a, b in zip(before, after[mode])] == [False] * 8 + [True] * 8
        finally:
            for ag in agents[::-1]:
                ag.close()
            for a in arenas:
                a.close()
    assert all(same_bytes(a, b) for a, b in zip(after["descriptors"], after["blocks"]))


@pytest.mark.parametrize("device_ids", [False, True])
@pytest.mark.parametrize("mode", ["descriptors", "blocks"])
def test_expanded_descriptors_are_the_requests_whatever_runs_next_on_its_slot(plat, monkeypatch, mode, device_ids):
    """``expanded_descriptors`` of one request while another thread's larger one is expanded in the same slot
    between the first's post and its read: each call returns its own request's rows."""
    monkeypatch.setenv("GPUXFER_KV_COPY", mode)
    a0, a1 = Arena(plat, 0, 1 << 18), Arena(plat, 1, 1 << 18)
    pre = KVAgent("prefill", platform=plat, device=0, engine="triton", timeout_s=60)
    dec = KVAgent("decode", platform=plat, device=1, engine="triton", timeout_s=60)
    try:
        pre.register_group("full", 2, vllm_layers(a0, 1, 12, 2, seed=1))
        dec.register_group("full", 2, vllm_layers(a1, 1, 12, 2, seed=2))
        peer, _ = connect(pre, dec)

        def ids(v):
            return torch.tensor(v, device=dec._torch_device()) if device_ids else v
        small = dec.prepare(peer, "pull", local_blocks={"full": ids([0])}, remote_blocks={"full": ids([1])},
                            device_ids=device_ids)
        big = dec.prepare(peer, "pull", local_blocks={"full": ids(list(range(2, 12)))},
                          remote_blocks={"full": ids(list(range(10)))}, device_ids=device_ids)
        alone = small.expanded_descriptors()
        wait, calls = dec.platform.event_wait, []

        def racing(event, timeout_s):
            calls.append(1)
            if len(calls) == 1:             # another thread's call takes the lock before this one's read
                assert big.expanded_descriptors().shape == (big.descriptors, 3)
            return wait(event, timeout_s)
        monkeypatch.setattr(dec.platform, "event_wait", racing)
        assert np.array_equal(small.expanded_descriptors(), alone)
    finally:
        dec.close()
        pre.close()
        a0.close()
        a1.close()
