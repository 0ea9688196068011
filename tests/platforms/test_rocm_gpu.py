"""ROCm on real AMD GPUs (MI300 / MI355X): marked ``gpu``, skipped elsewhere with the reason.

NEVER RUN YET (no AMD GPU was reachable when written). docs/ROCM.md's
validation steps use these: ``pytest -m gpu tests/platforms/test_rocm_gpu.py -k platform|hsa|sdma -v``.
"""
from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest

pytestmark = pytest.mark.gpu


def _need_two(rocm_plat):
    if rocm_plat.device_count() < 2:
        pytest.skip("needs two AMD GPUs")


# --------------------------------------------------------------------------- platform


def test_platform_device_info_and_links(rocm_plat):
    info = rocm_plat.device_info(0)
    print(info.as_dict())
    print(rocm_plat.versions())
    assert info.arch.startswith("gfx") and info.sm_count > 0 and info.pci_bus_id
    assert info.stream_mem_ops_64, "a 64-bit stream write + wait + synchronize did not work"
    if rocm_plat.device_count() >= 2:
        link = rocm_plat.link(0, 1)
        print(link.as_dict())
        assert link.peer_access and link.kind in ("xgmi", "pcie")


def test_platform_memory_tensor_flags_and_copies(rocm_plat):
    import torch
    rocm_plat.set_device(0)
    buf = rocm_plat.alloc(1 << 20, 0)
    flags = rocm_plat.alloc_flags(64, 0)
    s1, s2 = rocm_plat.create_stream(0), rocm_plat.create_stream(0)
    try:
        t = rocm_plat.as_tensor(buf, torch.bfloat16)
        assert t.device == torch.device("cuda", 0) and t.data_ptr() == buf.ptr and t.numel() == (1 << 19)
        t.copy_(torch.arange(t.numel(), device="cuda:0").to(torch.bfloat16))
        torch.cuda.synchronize(0)
        rocm_plat.memset_async(s1, flags.ptr, 0, 64)
        rocm_plat.write_flag(s1, flags.ptr, 5)
        assert rocm_plat.synchronize(s1, 10.0) and rocm_plat.read_flag(flags.ptr, 0) == 5
        rocm_plat.host_write_flag(flags.ptr + 8, 9, 0)
        assert rocm_plat.read_flag(flags.ptr + 8, 0) == 9
        # a wait blocks later work on its own stream only
        rocm_plat.wait_flag(s2, flags.ptr + 16, 3)
        rocm_plat.write_flag(s2, flags.ptr + 24, 1)
        rocm_plat.write_flag(s1, flags.ptr + 32, 1)
        assert rocm_plat.synchronize(s1, 10.0)
        time.sleep(0.2)
        assert rocm_plat.read_flag(flags.ptr + 24, 0) == 0
        rocm_plat.write_flag(s1, flags.ptr + 16, 3)
        assert rocm_plat.synchronize(s2, 10.0) and rocm_plat.read_flag(flags.ptr + 24, 0) == 1
        # copies, default and forced SDMA
        half = 1 << 19
        rocm_plat.copy_async(s1, buf.ptr + half, buf.ptr, half // 2)
        rocm_plat.copy_async(s1, buf.ptr + half + half // 2, buf.ptr + half // 2, half // 2, force_nocu=True)
        assert rocm_plat.synchronize(s1, 10.0)
        u8 = rocm_plat.as_tensor(buf)
        assert torch.equal(u8[half:], u8[:half])
    finally:
        for s in (s1, s2):
            rocm_plat._destroy_stream(s)
        flags.close()
        buf.close()


def _child_ipc(handle, device: int, n: int) -> int:
    import torch
    from gpuxfer.platforms.rocm import RocmPlatform
    p = RocmPlatform()
    try:
        p.set_device(device)
        m = p.open_handle(handle, device)
        local = p.alloc(n, device)
        s = p.create_stream(device)
        p.copy_async(s, local.ptr, m.ptr, n)                   # a peer copy: SDMA, no CU
        assert p.synchronize(s, 30.0)
        view = p.as_tensor(m)
        assert view.device == torch.device("cuda", device)
        expect = (torch.arange(n, device=f"cuda:{device}") % 251).to(torch.uint8)
        ok = torch.equal(view, expect) and torch.equal(p.as_tensor(local), expect)
        local.close()
        m.close()
        return int(ok)
    finally:
        p.close()


def test_platform_ipc_to_a_second_process(rocm_plat, spawner):
    import torch
    _need_two(rocm_plat)
    n = 8 << 20
    buf = rocm_plat.alloc(n, 0)
    try:
        rocm_plat.as_tensor(buf).copy_((torch.arange(n, device="cuda:0") % 251).to(torch.uint8))
        torch.cuda.synchronize(0)
        child = spawner.start(_child_ipc, buf.export(), 1, n, name="peer on device 1")
        assert child.result(timeout=180) == 1
        child.join(30)
    finally:
        buf.close()


# --------------------------------------------------------------------------- HSA


def test_hsa_agents_engine_plan_and_a_dependent_local_sdma_copy(rocm_plat):
    from gpuxfer.errors import TransferTimeout
    from gpuxfer.platforms.hsa import choose_engine, engine_bits, mask_str, plan_engines
    hsa = rocm_plat.hsa()
    me = rocm_plat.agent(0)
    print(me)
    assert me.is_gpu and me.pci_bus_id == rocm_plat.pci_bus_id(0)
    for d in range(1, rocm_plat.device_count()):
        peer = rocm_plat.agent(d)
        print(f"0 -> {d}: preferred {mask_str(hsa.preferred_copy_engine(peer.handle, me.handle))}, available "
              f"{mask_str(hsa.copy_engine_status(peer.handle, me.handle))}, plan "
              f"{plan_engines(hsa, me, peer, 1).why}")
    import torch
    buf = rocm_plat.alloc(2 << 20, 0)
    dep, done = hsa.signal_create(1), hsa.signal_create(1)
    try:
        rocm_plat.as_tensor(buf)[: 1 << 20].fill_(7)
        rocm_plat.as_tensor(buf)[1 << 20:].fill_(0)
        torch.cuda.synchronize(0)
        eng, _ = choose_engine(hsa.copy_engine_status(me.handle, me.handle),
                               hsa.preferred_copy_engine(me.handle, me.handle), xgmi_peer=False)
        hsa.copy_on_engine(buf.ptr + (1 << 20), me.handle, buf.ptr, me.handle, 1 << 20, [dep], done, eng)
        time.sleep(0.2)
        assert hsa.signal_load(done) == 1, "the copy ran although its dependency was still 1"
        hsa.signal_store(dep, 0)
        assert hsa.signal_wait_at_most(done, 0, 10.0) == 0
        u8 = rocm_plat.as_tensor(buf)
        assert torch.equal(u8[1 << 20:], u8[: 1 << 20]), f"SDMA copy on engine {engine_bits(eng)} corrupted"
        stuck = hsa.signal_create(1)
        with pytest.raises(TransferTimeout):
            hsa.signal_wait_at_most(stuck, 0, 0.3)
        hsa.signal_destroy(stuck)
    finally:
        hsa.signal_destroy(done)
        hsa.signal_destroy(dep)
        buf.close()


def test_hsa_signal_memory_layout(rocm_plat):
    from gpuxfer.platforms.hsa import Signal
    sig = rocm_plat.alloc_signal(0)          # raises if ROCr disagrees with handle = value pointer - 8
    try:
        assert rocm_plat.hsa().signal_load(Signal(sig.handle)) == 1     # HIP creates signal memory armed (1)
    finally:
        sig.close()


# --------------------------------------------------------------------------- the sdma hand-off


def _child_pipeline(rank: int, rdv: str, path: str, steps: int, max_elems: int) -> dict:
    import torch
    import torch.distributed as dist
    os.environ["GPUXFER_SDMA_PATH"] = path
    torch.cuda.set_device(rank)
    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    from gpuxfer.pp.selection import connect
    import gpuxfer.pp.sdma  # noqa: F401 - registers the backend where selection does not list it
    out = {}
    dev = torch.device("cuda", rank)
    peer = dict(send_to=1) if rank == 0 else dict(recv_from=0)
    specs = {"h": ((max_elems,), torch.float32), "r": ((4, 1024), torch.bfloat16)}

    def make(k):
        g = torch.Generator(device=dev).manual_seed(k)
        n = int(torch.randint(4096, max_elems + 1, (1,), generator=g, device=dev))
        return {"h": torch.rand(n, generator=g, device=dev), "r": torch.rand(4, 1024, generator=g, device=dev
                                                                           ).to(torch.bfloat16)}
    try:
        with connect(backend="sdma", platform="rocm", device=rank, specs=specs, timeout_s=60, **peer) as conn:
            out["backend"] = conn.backend
            bad = 0
            for k in range(1, steps + 1):
                if rank == 0:
                    conn.sender().send(make(k))
                else:
                    if k % 7 == 0:
                        time.sleep(0.01)          # a lagging receiver: back-pressure on the sender
                    got, exp = conn.receiver().recv().tensors, make(k)
                    bad += sum(not torch.equal(got[n], exp[n]) for n in exp)
            conn.synchronize(60)
            out["bad"] = bad
        with connect(backend="auto", platform="rocm", device=rank, specs=specs, timeout_s=60, **peer) as conn:
            out["auto"] = conn.backend
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return out


@pytest.mark.parametrize("path", ["hsa", "hip"])
def test_sdma_two_processes_every_byte(rocm_plat, spawner, tmp_path, path):
    _need_two(rocm_plat)
    rdv = str(tmp_path / "rdv")
    kids = [spawner.start(_child_pipeline, r, rdv, path, 200, 16 << 20, name=f"rank {r}") for r in (0, 1)]
    outs = [k.result(timeout=550) for k in kids]
    for k in kids:
        k.join(60)
    assert [o["backend"] for o in outs] == ["sdma", "sdma"]
    assert outs[1]["bad"] == 0
    assert [o["auto"] for o in outs] == ["nccl", "nccl"]     # auto keeps NCCL on ROCm until validated
