"""The vLLM connector's parts that need no vLLM: params checks, block pairing, the compatibility check, the view
description, and a prefill and a decode worker in one process (the side channel: test_vllm_channel.py)."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from gpuxfer.errors import BadInput, LayoutMismatch
from gpuxfer.integrations.vllm.handshake import INFO_VERSION, check_compatible, decode_info, describe_view, encode_info
from gpuxfer.integrations.vllm.params import (BadTransferParams, build_params, pair_group, parse_remote_prefill,
                                              seal_key, seal_of, tokens_to_load)


def good(**kw):
    p = build_params(engine_id="p0", endpoints=[("127.0.0.1", 5601)], request_id="r1", block_ids=[[3, 4, 5]],
                     block_sizes=[16], lease_deadline=123.0, seal_key=seal_key(b"s" * 16))
    p.update(kw)
    return p


def test_params_round_trip():
    assert parse_remote_prefill(good(), [16]).key is None
    assert parse_remote_prefill(good(remote_key="0123abcd"), [16]).key == "0123abcd"
    rp = parse_remote_prefill(good(), [16])
    assert rp.endpoint_of(0) == ("127.0.0.1", 5601, "p0") and rp.block_ids[0].tolist() == [3, 4, 5]
    assert tokens_to_load(40, 0, [16], rp) == 39
    assert tokens_to_load(40, 16, [16], rp) == 23
    assert tokens_to_load(40, 8, [8], parse_remote_prefill(good(), [8])) == 0      # hit off the prefill's blocks
    assert tokens_to_load(1, 0, [16], rp) == 0                                      # nothing but the last token


@pytest.mark.parametrize("patch", [
    {"gpuxfer": None}, {"gpuxfer": 2}, {"remote_port": 0}, {"remote_port": "80"}, {"remote_port": True},
    {"remote_host": ""}, {"remote_host": "h" * 600}, {"remote_engine_id": 5}, {"remote_request_id": None},
    {"lease_deadline": float("nan")}, {"lease_deadline": "soon"}, {"lease_deadline": 10 ** 400}, {"tp_size": 2},
    {"remote_block_ids": [[1, 2], [3]]}, {"remote_block_ids": [[1.5]]}, {"remote_block_ids": [[-1]]},
    {"remote_block_ids": [[1 << 40]]}, {"remote_block_ids": [["1"]]}, {"remote_block_ids": [[True]]},
    {"remote_block_ids": "1,2,3"}, {"remote_block_ids": [[0] * ((1 << 22) + 1)]}, {"remote_block_ids": [[1 << 70]]},
    {"remote_block_ids": [[1, 2.0]]}, {"remote_block_ids": [[1, None]]},
    {"remote_block_sizes": [24]}, {"remote_block_sizes": [0]}, {"remote_block_sizes": []},
    {"remote_key": 7}, {"remote_key": ""}, {"remote_key": "k" * 65}, {"remote_key": "clé"}, {"remote_key": ["k"]},
])
def test_hostile_params_are_refused(patch):
    with pytest.raises(BadTransferParams):
        parse_remote_prefill(good(**patch), [16])


def tp2(**kw):
    p = build_params(engine_id="p0", endpoints=[("127.0.0.1", 5601), ("10.0.0.2", 5602)], request_id="r1",
                     block_ids=[[3, 4, 5]], block_sizes=[16], lease_deadline=123.0, seal_key=seal_key(b"s" * 16))
    p.update(kw)
    return p


def test_tp_params_name_each_rank():
    p = tp2()
    assert p["tp_size"] == 2 and p["remote_endpoints"] == [["127.0.0.1", 5601], ["10.0.0.2", 5602]]
    assert (p["remote_host"], p["remote_port"]) == ("127.0.0.1", 5601)
    rp = parse_remote_prefill(p, [16])
    assert rp.tp_size == 2 and rp.endpoint_of(1) == ("10.0.0.2", 5602, "p0")
    assert rp.endpoint_of(0) == ("127.0.0.1", 5601, "p0")
    assert "remote_endpoints" not in good() and parse_remote_prefill(good(), [16]).tp_size == 1
    for rank in (2, -1):                            # a rank the prefill instance does not have
        with pytest.raises(BadTransferParams, match="has no rank"):
            rp.endpoint_of(rank)
    # a decode of k times the prefill's size: rank i reads prefill rank i // k
    assert [rp.endpoint_of(i, 4)[1] for i in range(4)] == [5601, 5601, 5602, 5602]
    assert parse_remote_prefill(good(), [16]).endpoint_of(1, 2) == ("127.0.0.1", 5601, "p0")
    for rank, world in ((1, 1), (0, 3), (2, 3), (4, 4)):   # no such rank here, or a size the prefill's does not divide
        with pytest.raises(BadTransferParams, match="has no rank for decode rank"):
            rp.endpoint_of(rank, world)
    with pytest.raises(BadTransferParams, match="multiple of the prefill's"):
        parse_remote_prefill(good(), [16]).endpoint_of(1)


def test_a_release_names_each_rank_but_carries_no_block_ids():
    """A decode request that never loaded: the step's metadata tells every worker its rank's prefill endpoint
    and the request, without the block-ID arrays of the params (they would travel to every worker)."""
    import types
    from gpuxfer.integrations.vllm.scheduler import SchedulerSide
    side = SchedulerSide(engine_id="d0", block_sizes=[16], lease_s=30.0, endpoints=None)
    req = types.SimpleNamespace(request_id="r", kv_transfer_params=tp2(), status=None)
    assert side.request_finished(req, ([],)) == (False, None)
    (rp,) = side.build_payload()["releases"]
    assert rp.block_ids == () and rp.request_id == parse_remote_prefill(tp2(), [16]).request_id
    assert rp.endpoint_of(1) == ("10.0.0.2", 5602, "p0")


@pytest.mark.parametrize("patch", [
    {"tp_size": 0}, {"tp_size": -2}, {"tp_size": "2"}, {"tp_size": True}, {"tp_size": 2.0}, {"tp_size": 1 << 20},
    {"tp_size": 3}, {"tp_size": 1}, {"tp_size": None}, {"remote_endpoints": None},
    {"remote_endpoints": "127.0.0.1:5601,10.0.0.2:5602"}, {"remote_endpoints": [["127.0.0.1", 5601]]},
    {"remote_endpoints": [["127.0.0.1", 5601], ["10.0.0.2", 5602], ["h", 1]]},
    {"remote_endpoints": [["127.0.0.1", 5601], ["10.0.0.2"]]}, {"remote_endpoints": [["127.0.0.1", 5601], "h:1"]},
    {"remote_endpoints": [["127.0.0.1", 5601], ["10.0.0.2", "5602"]]},
    {"remote_endpoints": [["127.0.0.1", 5601], ["10.0.0.2", 0]]},
    {"remote_endpoints": [["127.0.0.1", 5601], ["10.0.0.2", True]]},
    {"remote_endpoints": [["127.0.0.1", 5601], ["", 5602]]}, {"remote_endpoints": [["127.0.0.1", 5601], [7, 5602]]},
    {"remote_endpoints": [["127.0.0.1", 5601], ["h" * 600, 5602]]},
    {"remote_endpoints": [["10.0.0.9", 5601], ["10.0.0.2", 5602]]},          # rank 0 is not remote_host/port
    {"remote_port": 5602},
])
def test_hostile_tp_params_are_refused(patch):
    with pytest.raises(BadTransferParams):
        parse_remote_prefill(tp2(**patch), [16])


def test_params_take_int_subclasses_but_not_bools():
    import enum

    class B(enum.IntEnum):
        X = 7
    assert parse_remote_prefill(good(remote_block_ids=[[3, B.X]]), [16]).block_ids[0].tolist() == [3, 7]
    with pytest.raises(BadTransferParams, match="integers only"):
        parse_remote_prefill(good(remote_block_ids=[[3, 4, False]]), [16])


def test_params_too_few_blocks():
    rp = parse_remote_prefill(good(), [16])
    with pytest.raises(BadTransferParams, match="need 4 blocks"):
        tokens_to_load(64, 0, [16], rp)


def test_pair_equal_and_ratios():
    loc, rem = np.array([7, 8, 9, 10]), np.array([1, 2, 3, 4])
    li, ri = pair_group(loc, rem, 16, 16, 0, 63, 16, 16)
    assert li.tolist() == [7, 8, 9, 10] and ri.tolist() == [1, 2, 3, 4]
    # decode 16-token blocks, prefill 64-token ones: the prefill side lists ceil(n / 4)
    li, ri = pair_group(np.array([7, 8, 9, 10, 11]), np.array([2, 6]), 16, 64, 0, 70, 16, 64)
    assert li.tolist() == [7, 8, 9, 10, 11] and ri.tolist() == [2, 6]
    # decode 64-token blocks, prefill 16-token ones
    li, ri = pair_group(np.array([3, 4]), np.array([1, 2, 3, 4, 5, 6]), 64, 16, 0, 70, 64, 16)
    assert li.tolist() == [3, 4] and ri.tolist() == [1, 2, 3, 4, 5]
    # manager blocks split into kernel blocks (32-token blocks of 16-token kernel blocks)
    li, ri = pair_group(np.array([5, 9]), np.array([2, 3]), 32, 32, 0, 40, 16, 32)
    assert li.tolist() == [10, 11, 18] and ri.tolist() == [2, 3]
    # a local prefix hit: start past it on both sides
    li, ri = pair_group(loc, rem, 16, 16, 32, 63, 16, 16)
    assert li.tolist() == [9, 10] and ri.tolist() == [3, 4]


def test_pair_one_block_size_matches_the_general_path():
    """The one-block-size shortcut (int64 IDs) gives what the general path (taken for int32 IDs) gives,
    errors included."""
    rng = np.random.default_rng(5)
    for _ in range(400):
        n = int(rng.integers(1, 9))
        loc = rng.integers(1, 50, n)
        rem = rng.integers(1, 50, n + int(rng.integers(-1, 2)))
        for arr in (loc, rem):
            if rng.random() < 0.3:
                arr[: int(rng.integers(0, arr.size + 1))] = 0
            if rng.random() < 0.2 and arr.size:
                arr[int(rng.integers(0, arr.size))] = 0
        start = int(rng.integers(0, 16 * n))
        end = int(rng.integers(start + 1, 16 * n + 2))
        outs = []
        for dt in (np.int64, np.int32):
            try:
                li, ri = pair_group(loc.astype(dt), rem.astype(dt), 16, 16, start, end, 16, 16)
                outs.append((li.tolist(), ri.tolist()))
            except BadTransferParams as exc:
                outs.append(str(exc))
        assert outs[0] == outs[1], (loc, rem, start, end)


def test_pair_sliding_window_nulls():
    li, ri = pair_group(np.array([0, 0, 8, 9]), np.array([0, 5, 6, 7]), 16, 16, 0, 63, 16, 16)
    assert li.tolist() == [8, 9] and ri.tolist() == [6, 7]
    with pytest.raises(BadTransferParams, match="no longer holds"):         # the prefill dropped a block we need
        pair_group(np.array([0, 7, 8, 9]), np.array([0, 0, 6, 7]), 16, 16, 0, 63, 16, 16)
    with pytest.raises(BadTransferParams, match="null block follows"):
        pair_group(np.array([7, 0, 8, 9]), np.array([1, 2, 3, 4]), 16, 16, 0, 63, 16, 16)
    with pytest.raises(BadTransferParams, match="not on a boundary"):      # window starts inside a prefill block
        pair_group(np.array([0, 7, 8, 9]), np.array([2, 3]), 16, 32, 0, 63, 16, 32)


def info(**kw):
    g = {"kind": "FullAttentionSpec", "block_size": 16, "kernel_tokens": 16, "token_major": True,
         "layers": ["l0", "l1"], "bytes_per_token": 512}
    g.update(kw)
    return {"version": 1, "engine_id": "e", "model": "m", "dtype": "auto/float16", "layout": "LBHNC", "groups": [g]}


def test_compatibility_check():
    check_compatible(info(), info(block_size=64, kernel_tokens=64))
    with pytest.raises(LayoutMismatch, match="same --block-size"):
        check_compatible(info(token_major=False), info(block_size=64, kernel_tokens=64, token_major=False))
    with pytest.raises(LayoutMismatch, match="do not divide"):
        check_compatible(info(), info(block_size=24, kernel_tokens=24))
    with pytest.raises(LayoutMismatch, match="layers"):
        check_compatible(info(), info(layers=["l0"]))
    bad = info()
    bad["model"] = "other"
    with pytest.raises(LayoutMismatch, match="model"):
        check_compatible(info(), bad)


def test_engine_description_of_another_version_or_shape_is_refused_by_name():
    assert decode_info(encode_info(dict(info(), version=INFO_VERSION)))["engine_id"] == "e"
    with pytest.raises(BadInput, match=f"of version 99, this instance's of version {INFO_VERSION}"):
        decode_info(encode_info(dict(info(), version=99)))
    with pytest.raises(BadInput, match="of version None"):
        decode_info(b'{"engine_id": "e"}')
    with pytest.raises(BadInput, match="JSON list, not an object"):
        decode_info(b"[1, 2]")
    with pytest.raises(BadInput, match="not JSON"):
        decode_info(b"\xff")


def tp_info(rank: int, size: int, heads: int, pieces: int | None = None, kind: str = "FullAttentionSpec", **kw):
    g = dict(kind=kind, content=[heads, 128], bytes_per_token=heads * 128 * 2,
             pieces=heads if pieces is None else pieces, kv_heads=heads)
    g.update(kw)
    d = info(**g)
    d.update(tp_rank=rank, tp_size=size)
    return d


def test_compatibility_of_tensor_parallel_sizes():
    """A decode of k times the prefill's TP size: rank i reads prefill rank i // k, its share of the heads (one
    piece per head on both sides), the one head it holds where ranks outnumber the KV heads, or an MLA latent
    whole; anything else is refused by name."""
    def views(local, remote):
        return check_compatible(local, remote).remote
    mla = dict(kind="MLAAttentionSpec")
    assert check_compatible(tp_info(1, 2, 4), tp_info(1, 2, 4)) == ({}, {}, frozenset())
    assert views(tp_info(1, 2, 2), tp_info(0, 1, 4)) == {0: (2, 4)}
    assert views(tp_info(2, 4, 1), tp_info(1, 2, 2)) == {0: (0, 1)}
    assert views(tp_info(3, 4, 1, **mla), tp_info(0, 1, 1, **mla)) == {}
    # more decode ranks than KV heads: rank r holds head r * H // TP, a replica shared with its neighbours
    assert views(tp_info(1, 2, 1), tp_info(0, 1, 1)) == {}                       # MQA: the one head
    assert [views(tp_info(r, 4, 1), tp_info(0, 1, 2))[0] for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert views(tp_info(3, 4, 1), tp_info(1, 2, 1)) == {}                       # 2 heads, TP 2 -> 4
    assert [views(tp_info(r, 8, 1), tp_info(0, 1, 4))[0][0] for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    # a prefill of m times the decode's size: decode rank i reads prefill ranks i * m .. i * m + m - 1, each into
    # its part of this rank's heads; an MLA latent from the first of them alone
    assert [check_compatible(tp_info(0, 1, 4), tp_info(r, 2, 2)).local for r in range(2)] == [{0: (0, 2)}, {0: (2, 4)}]
    assert [check_compatible(tp_info(1, 2, 2), tp_info(r, 4, 1)).local for r in (2, 3)] == [{0: (0, 1)}, {0: (1, 2)}]
    assert [check_compatible(tp_info(0, 1, 1, **mla), tp_info(r, 4, 1, **mla)).skip for r in range(4)] == \
        [frozenset(), {0}, {0}, {0}]
    assert views(tp_info(0, 1, 4), tp_info(1, 2, 2)) == {}
    for local, remote, says in [
            (tp_info(1, 2, 2), tp_info(1, 4, 1), "this worker 1 reads prefill ranks 2 to 3, the peer is rank 1"),
            (tp_info(0, 1, 4), tp_info(0, 2, 4), "1/2 of a decode rank's heads"),
            (tp_info(0, 1, 4, pieces=1), tp_info(0, 2, 2), "VLLM_KV_CACHE_LAYOUT=LBHNC"),
            (tp_info(0, 1, 4), tp_info(1, 2, 2, kv_heads=None), "not one per KV head"),
            (tp_info(0, 3, 2), tp_info(0, 2, 3), "tensor parallel size: this instance 3, the peer 2"),
            (tp_info(1, 2, 4), tp_info(0, 2, 4), "this worker 1 reads prefill rank 1, the peer is rank 0"),
            (tp_info(2, 4, 1), tp_info(0, 2, 2), "this worker 2 reads prefill rank 1, the peer is rank 0"),
            (tp_info(1, 2, 2), tp_info(0, 1, 2), "1/2 of a prefill rank's heads"),          # heads not split
            (tp_info(1, 2, 2), tp_info(0, 1, 4, pieces=1), "VLLM_KV_CACHE_LAYOUT=LBHNC"),   # token-outer blocks
            (tp_info(1, 2, 2, pieces=1), tp_info(0, 1, 4), "VLLM_KV_CACHE_LAYOUT=LBHNC"),
            (tp_info(1, 2, 2), tp_info(0, 1, 4, content="x"), "1/2 of a prefill rank's heads"),
            (tp_info(1, 2, 2), dict(tp_info(0, 1, 4), tp_size="2"), "tensor parallel size"),
            (tp_info(1, 2, 1, kind="MLAAttentionSpec"), tp_info(0, 1, 2, kind="MLAAttentionSpec"), "heads"),
            (tp_info(1, 2, 2), tp_info(0, 1, 4, kv_heads=None), "not one per KV head"),         # packed slots
            (tp_info(1, 2, 2), tp_info(0, 1, 4, kv_heads=2), "not one per KV head"),
            (tp_info(1, 2, 1), tp_info(0, 1, 3), "replicas of one head"),       # 3 heads do not spread on 2 ranks
            (tp_info(1, 4, 1), tp_info(0, 1, 2, pieces=1), "VLLM_KV_CACHE_LAYOUT=LBHNC")]:
        with pytest.raises(LayoutMismatch, match=says):
            check_compatible(local, remote)


def test_describe_view_layouts():
    buf = torch.zeros(2 * 10 * 4 * 16 * 64, dtype=torch.int8)
    # LBHNC: [L, B, H, N, C] -> head-major blocks
    v = buf.view(2, 10, 4, 16, 64)[1]
    spec, tok, major = describe_view(v, True)
    assert tok == 16 and major and spec.block_stride_bytes == 4 * 16 * 64
    assert spec.pieces == [(h * 16 * 64, 16 * 64) for h in range(4)]
    spec, _, major = describe_view(v, False)            # described alike: the two instances pair
    assert not major and spec.pieces == [(h * 16 * 64, 16 * 64) for h in range(4)]
    many = torch.zeros(10 * 17 * 16 * 64, dtype=torch.int8).view(10, 17, 16, 64)
    spec, _, major = describe_view(many, True)          # past 16 heads: one piece, not token-major
    assert not major and spec.pieces == [(0, 17 * 16 * 64)]
    # LBNHC: [L, B, N, H, C] viewed as [B, H, N, C]
    w = buf.view(2, 10, 16, 4, 64)[0].permute(0, 2, 1, 3)
    spec, tok, major = describe_view(w, True)
    assert tok == 16 and major and spec.pieces == [(0, 16 * 4 * 64)]
    with pytest.raises(LayoutMismatch):
        describe_view(buf.view(2, 10, 4, 16, 64)[0].permute(0, 1, 3, 2)[..., :1].expand(10, 4, 64, 16), True)


def test_importing_gpuxfer_imports_no_vllm():
    """gpuxfer and the connector's vLLM-free modules import no vLLM (vLLM loads the connector module itself)."""
    code = ("import sys, gpuxfer, gpuxfer.kv, gpuxfer.integrations, gpuxfer.integrations.vllm, "
            "gpuxfer.integrations.vllm.params, gpuxfer.integrations.vllm.handshake, "
            "gpuxfer.integrations.vllm.channel, gpuxfer.integrations.vllm.scheduler, gpuxfer.integrations.vllm.worker\n"
            "bad = [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]\n"
            "assert not bad, bad\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]


# ---------------------------------------------------------------------------------------------- the decode worker
# A prefill and a decode WorkerSide in this process over the host emulation's shared memory (LBHNC views, as vLLM
# lays them out), pulling with the triton engine: the reads take their block IDs on the device.

BLOCKS, BS, HEADS, CONTENT, LAYERS = 24, 16, 2, 32, 2


def _caches(host, fill: bool):
    size = LAYERS * BLOCKS * HEADS * BS * CONTENT
    buf = host.alloc(size, 0)
    raw = host.as_tensor(buf, torch.uint8, (size,), 0)
    if fill:
        raw.copy_(torch.randint(1, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)))
    else:
        raw.zero_()
    whole = raw.view(LAYERS, BLOCKS, HEADS, BS, CONTENT)
    return buf, {f"model.layers.{i}.self_attn.attn": whole[i] for i in range(LAYERS)}


@pytest.fixture
def workers(host):
    from gpuxfer.integrations.vllm.worker import Settings, WorkerSide
    made, bufs = [], []

    def make(device_ids: bool | str = True):
        out = []
        for name, fill in (("p", True), ("d", False)):
            buf, caches = _caches(host, fill)
            bufs.append(buf)
            w = WorkerSide(engine_id=name, model="m", dtype="auto/float16", layout="LBHNC",
                           groups=[("FullAttentionSpec", BS, list(caches))], platform=host,
                           settings=Settings(lease_s=60, host="127.0.0.1", port=0, handshake_timeout_s=30,
                                             token_major=True, engine="triton", device_ids=device_ids))
            if name == "p":
                w.keyed_by(b"s" * 16)       # (as the prefill's first step does: its handshake then has its seal key)
            w.register(caches)
            w.caches = caches
            made.append(w)
            out.append(w)
        return out
    yield make
    for w in reversed(made):
        w.close()
    for b in bufs:
        b.close()


def _load(P, req: str, local: list[int], remote: list[int]):
    import time
    from gpuxfer.integrations.vllm.params import RemotePrefill
    from gpuxfer.integrations.vllm.loads import Load
    from gpuxfer.integrations.vllm.holds import make_key
    rp = RemotePrefill("p", "127.0.0.1", P.server.port, f"p-{req}", (np.array(remote, dtype=np.int64),), (BS,),
                       time.monotonic() + 60, key=make_key(P.prefill.secret, f"p-{req}"))
    rp = dataclasses.replace(rp, seal=seal_of(rp, seal_key(P.prefill.secret)))
    return Load(req, rp, (np.array(local, dtype=np.int64),), 0, BS * len(local) - 1)


def _drive(P, D, want: set, timeout: float = 120.0) -> tuple[set, set]:
    import time
    got, failed = set(), set()
    deadline = time.monotonic() + timeout
    while want - got:
        assert time.monotonic() < deadline, f"loads {sorted(want - got)} not reported"
        P.poll()
        _, r, f = D.poll()
        got |= r
        failed |= f
    return got, failed


def _moved(P, D, local: list[int], remote: list[int]) -> bool:
    return all(torch.equal(D.caches[n][b], P.caches[n][a]) for n in D.caches for a, b in zip(remote, local))


def _zero(D, blocks) -> bool:
    return all(not D.caches[n][b].any() for n in D.caches for b in blocks)


def test_decode_reads_with_device_ids(workers):
    """Equal kernel blocks on a triton peer: a step's loads go as one read with device IDs; every byte lands."""
    P, D = workers()
    assert D.decode.staging is not None
    D.start_loads([_load(P, "a", [3, 4, 5], [7, 8, 9])])
    assert _drive(P, D, {"a"}) == ({"a"}, set())
    assert D.decode.remotes[("127.0.0.1", P.server.port, "p")].device_ids
    D.start_loads([_load(P, "b", [10, 11], [1, 2]), _load(P, "c", [12, 13, 14], [20, 21, 22])])
    assert D.decode.inflight[0].handle is D.decode.inflight[1].handle          # one read for the step
    assert _drive(P, D, {"b", "c"}) == ({"b", "c"}, set())
    assert _moved(P, D, [3, 4, 5], [7, 8, 9]) and _moved(P, D, [10, 11, 12, 13, 14], [1, 2, 20, 21, 22])
    stats = D.take_stats()
    assert stats["device_id_loads"] == 3 and stats["host_id_loads"] == 0 and stats["failed"] == 0


def test_device_ids_off_reads_with_host_ids(workers):
    P, D = workers(device_ids=False)
    assert D.decode.staging is None
    D.start_loads([_load(P, "a", [3, 4], [7, 8])])
    assert _drive(P, D, {"a"}) == ({"a"}, set())
    assert _moved(P, D, [3, 4], [7, 8])
    stats = D.take_stats()
    assert stats["device_id_loads"] == 0 and stats["host_id_loads"] == 1


def test_device_ids_auto_reads_a_lone_load_with_host_ids_and_a_step_of_several_on_the_device(workers):
    """``device_ids`` "auto": a step's single read of an engine goes with host IDs, a step's several reads of it
    with device IDs in one read; every byte lands."""
    P, D = workers(device_ids="auto")
    assert D.decode.staging is not None
    D.start_loads([_load(P, "a", [3, 4, 5], [7, 8, 9])])
    assert _drive(P, D, {"a"}) == ({"a"}, set())
    assert D.take_stats()["host_id_loads"] == 1
    D.start_loads([_load(P, "b", [10, 11], [1, 2]), _load(P, "c", [12, 13, 14], [20, 21, 22])])
    assert D.decode.inflight[0].handle is D.decode.inflight[1].handle          # one read for the step
    assert _drive(P, D, {"b", "c"}) == ({"b", "c"}, set())
    D.start_loads([_load(P, "d", [15], [23])])
    assert _drive(P, D, {"d"}) == ({"d"}, set())
    assert _moved(P, D, [3, 4, 5, 10, 11, 12, 13, 14, 15], [7, 8, 9, 1, 2, 20, 21, 22, 23])
    stats = D.take_stats()
    assert stats["device_id_loads"] == 2 and stats["host_id_loads"] == 1 and stats["failed"] == 0


def test_a_bad_block_id_on_the_device_fails_only_its_load(workers, caplog):
    """A remote ID past the prefill's blocks: alone, the device check refuses the read; posted with good loads,
    the step's read is refused as a whole, posted again load by load with host IDs, and only the load at fault
    fails. Its blocks get no byte; vLLM is told its block IDs."""
    P, D = workers()
    D.start_loads([_load(P, "bad", [3, 4], [5, BLOCKS + 1])])
    with caplog.at_level("WARNING", logger="gpuxfer.vllm"):
        assert _drive(P, D, {"bad"}) == ({"bad"}, {"bad"})
    assert "checked on the device" in caplog.text
    assert _zero(D, [3, 4]) and D.take_load_errors() == {3, 4}
    D.start_loads([_load(P, "g1", [6, 7], [1, 2]), _load(P, "bad2", [8, 9], [BLOCKS, 3]),
                   _load(P, "g2", [10], [4])])
    assert _drive(P, D, {"g1", "bad2", "g2"}) == ({"g1", "bad2", "g2"}, {"bad2"})
    assert _moved(P, D, [6, 7, 10], [1, 2, 4]) and _zero(D, [3, 4, 8, 9])
    assert D.take_load_errors() == {8, 9}
    stats = D.take_stats()
    assert stats["failed"] == 2 and stats["transfers"] == 2 and stats["host_id_loads"] == 2


def test_the_staged_ids_are_not_reused_while_a_copy_can_read_them(workers, host):
    """The agent's stream held up: a second step's IDs must not go where the first step's copy, still queued,
    reads them (each step lands its own bytes once the stream runs)."""
    import threading
    P, D = workers()
    D.start_loads([_load(P, "w", [1], [1])])            # the handshake, out of the way
    _drive(P, D, {"w"})
    gate = threading.Event()
    host.launch(D.agent.stream, lambda: gate.wait(60))
    try:
        D.start_loads([_load(P, "s1", [3, 4, 5], [7, 8, 9])])
        D.start_loads([_load(P, "s2", [10, 11, 12], [13, 14, 15])])
        assert D.decode.inflight[0].handle is not D.decode.inflight[-1].handle
    finally:
        gate.set()
    assert _drive(P, D, {"s1", "s2"}) == ({"s1", "s2"}, set())
    assert _moved(P, D, [3, 4, 5], [7, 8, 9]) and _moved(P, D, [10, 11, 12], [13, 14, 15])
    assert len(D.decode.staging.entries) == 2


def test_the_id_staging_is_made_at_startup(workers, monkeypatch):
    """Registration makes the staging entries a step's IDs need (twice the blocks the caches hold, a bounded
    size), so a step allocates no pinned memory."""
    from gpuxfer.integrations.vllm import staging
    P, D = workers()
    made = list(D.decode.staging.entries)
    assert len(made) == staging.RESERVE_ENTRIES and all(e.size >= 2 * BLOCKS for e in made)
    D.start_loads([_load(P, "a", [1, 2], [3, 4]), _load(P, "b", [5, 6], [7, 8])])
    assert _drive(P, D, {"a", "b"}) == ({"a", "b"}, set())
    assert D.decode.staging.entries == made
    monkeypatch.setattr(staging, "RESERVE_MAX_IDS", 5000)
    D.decode.staging.reserve(10 ** 9)
    assert [e.size for e in D.decode.staging.entries[len(made):]] == [8192] * staging.RESERVE_ENTRIES


def test_a_second_load_of_one_prefill_request_fails_and_releases_nothing(workers):
    """Two loads of one prefill request in a step (vLLM's n > 1 children share the parent's params): the first
    reads; the second fails at once, and the prefill hears one done and no release (a release would free the
    blocks under the first read)."""
    import dataclasses
    P, D = workers(device_ids=False)
    first = _load(P, "a", [3, 4], [7, 8])
    second = dataclasses.replace(_load(P, "b", [5, 6], [7, 8]), remote=first.remote)
    D.start_loads([first, second])
    assert _drive(P, D, {"a", "b"}) == ({"a", "b"}, {"b"})
    assert _moved(P, D, [3, 4], [7, 8]) and _zero(D, [5, 6]) and D.take_load_errors() == {5, 6}
    import time
    time.sleep(0.3)
    P.server.pump()
    events = []
    while not P.server.events.empty():
        events.append(P.server.events.get_nowait())
    assert events == [("done", "p-a", 1, first.remote.key, D.decode.claims and events[0][4])], events
    assert events[0][4] and len(events[0][4]) == 16        # the load's claim token
    # the claim goes once the prefill's lease on it ran out (a load after that fails on the lease anyway)
    from gpuxfer.integrations.vllm import lease
    assert len(D.decode.claims) == 1
    D.decode._prune_claims()
    assert len(D.decode.claims) == 1
    D.decode.claims = {c: (r, lease.now() - 1) for c, (r, _) in D.decode.claims.items()}
    D.decode._prune_claims()
    assert D.decode.claims == {}
