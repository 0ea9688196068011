"""KVAgent across two processes: on the host emulation, and (``-m gpu``) two processes on one CUDA device
with torch-allocated caches; CUDA's export range with expandable segments.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from gpuxfer.errors import NotExportable
from gpuxfer.kv.agent import KVAgent


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
        agent = KVAgent(f"rank{rank}", platform=plat, device=device, engine=engine, host_notify=True)
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
        else:       # the notification's host copy first (a load; gpuxfer.kv.host_notify), then the word
            import time
            deadline = time.monotonic() + 60
            while agent.host_notification(0) < 1:
                assert time.monotonic() < deadline, "the host copy of the notification never came"
                time.sleep(1e-4)
            assert agent.wait_notification(0, 1, timeout_s=60) == 1 and agent.host_notification(0) == 1
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
    from _skips import platform_reason
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
    from _skips import platform_reason
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


def _pieces_side(rank, world, init, platform_name, whose):
    """A view of pieces [2, 4), one piece per head, every byte checked (rank 1 pulls from rank 0):
    ``whose`` "peer": rank 0 holds 4 heads per block, rank 1 2, and rank 1 adds rank 0 seen through pieces
    [2, 4) (``pieces``): its blocks then hold rank 0's heads 2 and 3. "local": rank 0 holds 2 heads, rank 1 4,
    and rank 1 sees its own layers through pieces [2, 4) (``local_pieces``): its heads 2 and 3 then hold rank
    0's two. Nothing else of rank 1's memory changes; ranges a layer does not have are ``BadInput``."""
    import datetime
    import torch.distributed as dist
    from gpuxfer.errors import BadInput
    from gpuxfer.kv.layers import KVLayerSpec
    from gpuxfer.platforms import get_platform
    plat = get_platform(platform_name)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    keep = []
    try:
        heads, blocks, hbytes = ((4, 2) if whose == "peer" else (2, 4))[rank], 6, 64    # a head's piece: 64 B
        buf = plat.alloc(2 * blocks * heads * hbytes + 4096, rank)
        keep.append(buf)
        flat = plat.as_tensor(buf, dtype=torch.uint8)
        layers = {}
        for i in range(2):
            view = flat[i * blocks * heads * hbytes:(i + 1) * blocks * heads * hbytes].view(blocks, heads, hbytes)
            view.copy_(torch.randint(0, 256, view.shape, generator=torch.Generator().manual_seed(10 * rank + i),
                                     dtype=torch.uint8))
            layers[f"l{i}"] = (view, KVLayerSpec(view, blocks, heads * hbytes,
                                                 [(h * hbytes, hbytes) for h in range(heads)]))
        agent = KVAgent(f"{whose}{rank}", platform=plat, device=rank, engine="triton")
        keep.append(agent)
        agent.register_group("g", 4, {k: spec for k, (_, spec) in layers.items()})
        blobs = [None, None]
        dist.all_gather_object(blobs, agent.metadata())
        src, dst = [5, 0, 3], [1, 4, 2]
        if rank == 1:
            before = {k: v.clone() for k, (v, _) in layers.items()}
            key = "pieces" if whose == "peer" else "local_pieces"
            for bad in ({"g": (2, 5)}, {"g": (1, 1)}, {"h": (0, 2)}, {"g": (True, 2)}, [(0, 2)]):
                try:
                    agent.add_peer(blobs[0], **{key: bad})
                    raise AssertionError(f"{key} {bad} accepted")
                except BadInput:
                    pass
            peer = agent.add_peer(blobs[0], **{key: {"g": (2, 4)}})
            agent.transfer(peer, "pull", local_blocks={"g": dst}, remote_blocks={"g": src}).wait(60)
        dist.barrier()
        got = [None, None]
        dist.all_gather_object(got, {k: v.clone() for k, (v, _) in layers.items()})
        if rank == 1:
            for k, (v, _) in layers.items():
                want = before[k].clone()
                for s_, d in zip(src, dst):
                    if whose == "peer":
                        want[d] = got[0][k][s_, 2:4]
                    else:
                        want[d, 2:4] = got[0][k][s_]
                assert torch.equal(v, want), k
        dist.barrier()
        return "ok"
    finally:
        for r in keep[::-1]:
            r.close()
        dist.destroy_process_group()
        plat.close()


@pytest.mark.parametrize("whose", ["peer", "local"])
def test_a_view_of_some_pieces_of_each_block(spawner, whose):
    assert spawner.run_ranks(_pieces_side, 2, "host", whose, timeout=180) == ["ok", "ok"]
