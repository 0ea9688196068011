"""Views of token rows (``KVAgent.add_peer``'s ``token_slice`` / ``local_token_slice``): each token-major piece
cut into its block's tokens, bytes [a, b) of each token's row kept -- a range of heads of an SGLang-shaped MHA
page ``(page_size, heads, head_dim)`` on two sides holding different heads. The cut itself (bounds, refusals),
then transfers between two processes with every byte checked."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gpuxfer.errors import BadInput
from gpuxfer.kv.layers import _MAX_ROW_PIECES, KVLayer, KVPiece
from gpuxfer.kv.views import _cut_rows


def _layer(pieces, blocks=4, stride=None, token_major=True, extent=None):
    stride = stride or max(o + n for o, n in pieces)
    return KVLayer("l0", 0, 0, blocks, stride, tuple(KVPiece(o, n) for o, n in pieces),
                   extent or blocks * stride, token_major)


def test_rows_are_cut_piece_by_piece_then_token_by_token():
    lay = _layer([(0, 48), (64, 48)], stride=128)            # two pieces of 3 tokens of 16-byte rows
    (cut,) = _cut_rows("token_slice", "g", (4, 12), [lay], 3, "peer 'p'")
    assert [(p.offset, p.nbytes) for p in cut.pieces] == [(4, 8), (20, 8), (36, 8), (68, 8), (84, 8), (100, 8)]
    assert not cut.token_major and (cut.num_blocks, cut.block_stride, cut.extent) == (4, 128, 512)
    (whole,) = _cut_rows("token_slice", "g", [0, 16], [lay], 3, "peer 'p'")     # whole rows: still one per token
    assert [(p.offset, p.nbytes) for p in whole.pieces] == [(0, 16), (16, 16), (32, 16), (64, 16), (80, 16), (96, 16)]


@pytest.mark.parametrize("rng, layer, bt, match", [
    ((4, 17), _layer([(0, 48)]), 3, "16-byte token rows"),           # past the row
    ((0, 0), _layer([(0, 48)]), 3, "0 <= start < stop"),             # empty
    ((-1, 4), _layer([(0, 48)]), 3, "0 <= start < stop"),
    ((True, 4), _layer([(0, 48)]), 3, "0 <= start < stop"),
    ((0, 4, 8), _layer([(0, 48)]), 3, "0 <= start < stop"),
    ("ab", _layer([(0, 48)]), 3, "0 <= start < stop"),
    ((0, 4), _layer([(0, 50)]), 3, "not whole token rows"),          # 50 bytes are no 3 rows
    ((0, 4), _layer([(0, 48)], token_major=False), 3, "not token-major"),
    ((0, 1), _layer([(0, _MAX_ROW_PIECES + 1)]), _MAX_ROW_PIECES + 1, "over the"),   # too many pieces
])
def test_cuts_a_layer_does_not_have_are_refused(rng, layer, bt, match):
    with pytest.raises(BadInput, match=match):
        _cut_rows("token_slice", "g", rng, [layer], bt, "peer 'p'")


def test_the_bound_counts_the_whole_group():
    layers = [_layer([(0, 64)]) for _ in range(_MAX_ROW_PIECES // 64 + 1)]     # each layer alone is under it
    with pytest.raises(BadInput, match="over the"):
        _cut_rows("local_token_slice", "g", (0, 1), layers, 64, "this agent")
    assert len(_cut_rows("local_token_slice", "g", (0, 1), layers[:-1], 64, "this agent")) == len(layers) - 1


@pytest.mark.parametrize("arg", ["pieces", "local_pieces", "token_slice", "local_token_slice"])
@pytest.mark.parametrize("view", [np.array([0, 16]), 0])
def test_a_view_that_is_no_mapping_is_refused_before_anything(pair, arg, view):
    """A view argument is None or a mapping: an array (whose truth raises) or a falsy number (no view) is a
    BadInput naming it, and no peer is added."""
    pre, dec, _, _ = pair
    with pytest.raises(BadInput, match=f"^{arg} must map group"):
        dec.add_peer(pre.metadata(), **{arg: view})
    assert not dec.peers


# ----------------------------------------------------------------------------- two processes

HB, BT, BLOCKS, PAD = 16, 4, 6, 24       # a head's bytes per token, page tokens, pages, bytes after each page


def _pages(flat, at, heads, seed):
    """One SGLang-shaped MHA buffer: ``BLOCKS`` pages of ``(BT, heads, HB)`` bytes, ``PAD`` bytes after each (a
    block stride past the piece), random bytes everywhere; the view and its layer spec (one piece per page)."""
    from gpuxfer.kv.layers import KVLayerSpec
    stride = BT * heads * HB + PAD
    raw = flat[at:at + BLOCKS * stride]
    raw.copy_(torch.randint(0, 256, raw.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8))
    return raw, KVLayerSpec(raw, BLOCKS, stride, [(0, BT * heads * HB)])


def _page(raw, heads, b):
    """Page ``b`` of a buffer as ``(BT, heads, HB)``."""
    stride = BT * heads * HB + PAD
    return raw[b * stride:b * stride + BT * heads * HB].view(BT, heads, HB)


def _rows_side(rank, world, init, case, op, engine="copy_engine", platform_name="host"):
    """Rank 0 holds the source pages, rank 1 the destination; ``case``: (rank 0's heads, rank 1's, the heads
    [h0, h1) of rank 0 that land on heads [g0, g1) of rank 1). The side that initiates (``op``) cuts its own
    layers with ``local_token_slice`` and the other's with ``token_slice``; rank 1's every byte is then what
    it held but the landed heads of its named pages (its other heads, its other pages and the pad after
    each page untouched). ``platform_name`` "cuda": both ranks on GPU 0."""
    import datetime
    import torch.distributed as dist
    from gpuxfer.kv.agent import KVAgent
    from gpuxfer.platforms import get_platform
    (heads0, heads1, (h0, h1), (g0, g1)) = case
    heads = (heads0, heads1)[rank]
    plat = get_platform(platform_name)
    device = rank if platform_name == "host" else 0
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    keep = []
    try:
        buf = plat.alloc(1 << 16, device)
        keep.append(buf)
        flat = plat.as_tensor(buf, dtype=torch.uint8)
        layers = {f"entry.{e}": _pages(flat, 128 + e * 8192, heads, 10 * rank + e) for e in range(2)}
        agent = KVAgent(f"rows{rank}", platform=plat, device=device, engine=engine)
        keep.append(agent)
        agent.register_group("kv", BT, {k: spec for k, (_, spec) in layers.items()})
        blobs = [None, None]
        dist.all_gather_object(blobs, agent.metadata())
        before = {k: raw.cpu().clone() for k, (raw, _) in layers.items()}
        src, dst = [5, 0, 3], [1, 4, 2]
        initiator = 1 if op == "pull" else 0
        if rank == initiator:
            mine, theirs = ((g0, g1), (h0, h1)) if rank == 1 else ((h0, h1), (g0, g1))
            peer = agent.add_peer(blobs[1 - rank], token_slice={"kv": (theirs[0] * HB, theirs[1] * HB)},
                                  local_token_slice={"kv": (mine[0] * HB, mine[1] * HB)})
            ids = (dst, src) if op == "pull" else (src, dst)
            agent.transfer(peer, op, local_blocks={"kv": ids[0]}, remote_blocks={"kv": ids[1]}).wait(60)
            if rank == 1:           # a peer view alone pairs a token's row with a whole page: refused
                agent.remove_peer(peer)
                from gpuxfer.errors import LayoutMismatch
                peer = agent.add_peer(blobs[0], token_slice={"kv": (h0 * HB, h1 * HB)})
                try:
                    agent.prepare(peer, "pull", local_blocks={"kv": dst}, remote_blocks={"kv": src})
                    raise AssertionError("a token-row view paired with whole pages")
                except LayoutMismatch:
                    pass
        dist.barrier()
        got = [None, None]
        dist.all_gather_object(got, {k: raw.cpu().clone() for k, (raw, _) in layers.items()})
        if rank == 1:
            for k, raw in got[1].items():
                want = before[k].clone()
                for s_, d in zip(src, dst):
                    _page(want, heads1, d)[:, g0:g1] = _page(got[0][k], heads0, s_)[:, h0:h1]
                assert torch.equal(raw, want), k
                assert not torch.equal(raw, before[k]), k          # something landed
        dist.barrier()
        return "ok"
    finally:
        for r in keep[::-1]:
            r.close()
        dist.destroy_process_group()
        plat.close()


CASES = {
    "split": (4, 2, (2, 4), (0, 2)),       # a rank of TP 1 (4 heads) to the second rank of TP 2 (2 heads)
    "merge": (2, 4, (0, 2), (2, 4)),       # the second rank of TP 2 to its half of a rank of TP 1
    "middle": (4, 4, (1, 3), (2, 4)),      # heads at different offsets in rows of one size
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("op", ["pull", "push"])
def test_a_view_of_token_rows_moves_those_bytes_only(spawner, case, op):
    assert spawner.run_ranks(_rows_side, 2, CASES[case], op, timeout=180) == ["ok", "ok"]


def test_token_rows_over_the_descriptor_copy_kernel(spawner):
    """The same view run by the ``triton`` engine's kernels (interpreted on the host emulation)."""
    assert spawner.run_ranks(_rows_side, 2, CASES["split"], "pull", "triton", timeout=300) == ["ok", "ok"]


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["pull", "push"])
def test_token_rows_on_one_cuda_device(spawner, op):
    """Two processes on one CUDA device, the ``triton`` engine: every byte as on the host emulation."""
    from _skips import platform_reason
    why = platform_reason("cuda")
    if why:
        pytest.skip(why)
    assert spawner.run_ranks(_rows_side, 2, CASES["split"], op, "triton", "cuda", timeout=240) == ["ok", "ok"]


def _refusals_side(rank, world, init):
    """What a token-row view refuses at ``add_peer``: a group the peer lacks, rows a layer does not have, the
    pack engine (its two sides move whole blocks); a peer in this process is refused as for pieces."""
    import datetime
    import torch.distributed as dist
    from gpuxfer.kv.agent import KVAgent
    from gpuxfer.platforms import get_platform
    plat = get_platform("host")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    keep = []
    try:
        buf = plat.alloc(1 << 16, rank)
        keep.append(buf)
        flat = plat.as_tensor(buf, dtype=torch.uint8)
        raw, spec = _pages(flat, 128, 2, rank)
        agent = KVAgent(f"refuse{rank}", platform=plat, device=rank, engine="copy_engine")
        keep.append(agent)
        agent.register_group("kv", BT, {"entry.0": spec})
        blobs = [None, None]
        dist.all_gather_object(blobs, agent.metadata())
        if rank == 1:
            bad = [dict(token_slice={"other": (0, HB)}), dict(local_token_slice={"other": (0, HB)}),
                   dict(token_slice={"kv": (0, 2 * HB + 1)}), dict(local_token_slice={"kv": (HB, HB)}),
                   dict(token_slice=[(0, HB)])]
            for kw in bad:
                with pytest.raises(BadInput):
                    agent.add_peer(blobs[0], **kw)
            pack = KVAgent("refuse-pack", platform=plat, device=rank, engine="pack")
            try:
                with pytest.raises(BadInput, match="another process"):
                    pack.add_peer(blobs[1], token_slice={"kv": (0, HB)})
                with pytest.raises(BadInput, match="token rows needs the triton or copy_engine"):
                    pack.add_peer(blobs[0], token_slice={"kv": (0, HB)})
                # the pack engine's source and destination each build a route: a view of the peer's pieces on
                # one side pairs with neither the other side's whole blocks nor any view it may take
                with pytest.raises(BadInput, match="pieces needs the triton or copy_engine"):
                    pack.add_peer(blobs[0], pieces={"kv": (0, 1)})
                assert not pack.peers
            finally:
                pack.close()
            assert not agent.peers
        dist.barrier()
        return "ok"
    finally:
        for r in keep[::-1]:
            r.close()
        dist.destroy_process_group()
        plat.close()


def test_token_row_views_refused(spawner):
    assert spawner.run_ranks(_refusals_side, 2, timeout=180) == ["ok", "ok"]
