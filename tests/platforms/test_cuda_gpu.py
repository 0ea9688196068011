"""The CUDA platform on a GPU (``-m gpu``; skipped with the reason where CUDA is unusable): the
stream-memory-operation probe, device info, bf16 views, batch copies checked byte for byte on every batch
path and stream kind, Triton on the views, as_tensor / write_flag over an IPC mapping in a second process
(spawn), and NVLink as NVML reports it.
"""
from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

from gpuxfer.errors import BadInput, DriverError
from gpuxfer.platforms import cuda as cm
from gpuxfer.platforms import cuda_memory as cmem
from gpuxfer.platforms import cuda_entry as ce
from gpuxfer.platforms.base import IpcHandle


T = 60.0
gpu = pytest.mark.gpu


def _need_gpus(p, n):
    if p.device_count() < n:
        pytest.skip(f"needs {n} GPUs, {p.device_count()} visible")


@gpu
def test_gpu_alloc_is_whole_large_pages(cuda_plat):
    from cuda.bindings import driver
    buf = cuda_plat.alloc(cm.LARGE_PAGE_BYTES * 3 + 100, 0)
    try:
        err, base, size = driver.cuMemGetAddressRange(buf.ptr)
        assert int(err) == 0 and int(base) == buf.ptr
        assert int(size) == buf.allocated_bytes == cm.LARGE_PAGE_BYTES * 4
        assert buf.nbytes == cm.LARGE_PAGE_BYTES * 3 + 100
    finally:
        buf.close()


@gpu
def test_gpu_probe_and_device_info(cuda_plat):
    for d in range(cuda_plat.device_count()):
        assert cuda_plat.probe_stream_mem_ops(d) is None, cuda_plat.probe_stream_mem_ops(d)
        assert cuda_plat.probe_stream_mem_ops(d) is None            # cached
        info = cuda_plat.device_info(d)
        print(info.as_dict())
        assert info.stream_mem_ops_64 and info.arch.startswith("sm_") and info.sm_count > 0
        assert info.total_bytes > info.free_bytes > 0 and info.copy_engines >= 1
        assert info.pci_bus_id and ":" in info.pci_bus_id
        assert any("CAN_USE_64_BIT_STREAM_MEM_OPS" in n for n in info.notes)
    v = cuda_plat.versions()
    print(v)
    assert v["cuda driver"][0].isdigit() and "unavailable" not in v["cupy"]


@gpu
def test_gpu_driver_calls_keep_the_callers_device(cuda_plat):
    import torch
    _need_gpus(cuda_plat, 2)
    torch.cuda.set_device(0)
    s1 = cuda_plat.create_stream(1)
    with cuda_plat.alloc(64, 1) as buf:
        cuda_plat.memset_async(s1, buf.ptr, 0, 64)
        cuda_plat.write_flag(s1, buf.ptr, 3)
        assert cuda_plat.synchronize(s1, T)
        assert cuda_plat.read_flag(buf.ptr, 1) == 3
        assert torch.cuda.current_device() == 0


@gpu
@pytest.mark.parametrize("stream_kind", ["created", "default"])
def test_gpu_stream_ops_land_on_the_streams_device(cuda_plat, stream_kind):
    """The per-step calls on device 1's streams while device 0 is current: a created stream takes the
    one-call path, the default stream (handle 0: "the current context's") must get device 1's context."""
    import torch
    _need_gpus(cuda_plat, 2)
    torch.cuda.set_device(0)
    s = cuda_plat.create_stream(1) if stream_kind == "created" else cuda_plat.current_stream(1)
    assert (s.handle in (0, 1, 2)) == (stream_kind == "default")
    src = torch.arange(4096, device="cuda:1", dtype=torch.int32).view(torch.uint8)
    dst = torch.zeros_like(src)
    with cuda_plat.alloc(256, 1) as flags:
        cuda_plat.memset_async(s, flags.ptr, 0, 256)
        cuda_plat.write_flag(s, flags.ptr, 5)
        cuda_plat.wait_flag(s, flags.ptr, 5)
        ev = cuda_plat.record_event(s)
        ev2 = cuda_plat.record_event(s, ev)
        assert ev2 is ev and ev.device == 1                       # re-recorded, not created
        cuda_plat.stream_wait_event(s, ev)
        cuda_plat.copy_async(s, dst.data_ptr(), src.data_ptr(), src.numel())
        done = cuda_plat.record_event(s)
        assert cuda_plat.event_wait(done, T) and cuda_plat.event_query(done)
        assert torch.equal(dst.cpu(), src.cpu())
        assert cuda_plat.read_flag(flags.ptr, 1) == 5
    assert torch.cuda.current_device() == 0
    if stream_kind == "created":
        s.close()


@gpu
def test_gpu_record_event_reuses_collected_events(cuda_plat):
    """A new event of record_event takes the handle of a collected one; a recycled event still tracks its
    own recording (a copy queued after it), and after close nothing is reused."""
    import gc
    import torch
    s = cuda_plat.create_stream(0)
    first = cuda_plat.record_event(s)
    handle = first.handle
    del first
    gc.collect()
    src = torch.arange(1 << 20, device="cuda:0", dtype=torch.int32)
    dst = torch.zeros_like(src)
    cuda_plat.copy_async(s, dst.data_ptr(), src.data_ptr(), src.numel() * 4)
    again = cuda_plat.record_event(s)
    assert again.handle == handle                          # the spare, not a new event
    assert cuda_plat.event_wait(again, T) and torch.equal(dst, src)
    s.close()
    cuda_plat.close()
    assert cuda_plat._streams._events.closed and not any(cuda_plat._streams._events.spare.values())


@gpu
def test_gpu_as_tensor_bf16_round_trip(cuda_plat):
    import torch
    dev = cuda_plat.device_count() - 1
    with cuda_plat.alloc(1 << 16, dev) as buf:
        vals = (torch.randn(4096, device=f"cuda:{dev}") * 100).to(torch.bfloat16)
        t = cuda_plat.as_tensor(buf, torch.bfloat16, (64, 64), offset=2048)
        assert t.device == torch.device("cuda", dev) and t.data_ptr() == buf.ptr + 2048
        t.copy_(vals.view(64, 64))
        raw = cuda_plat.as_tensor(buf, torch.uint8, (8192,), offset=2048)
        assert torch.equal(raw.view(torch.bfloat16), vals)
        assert torch.equal(cuda_plat.as_tensor(buf, torch.bfloat16, (4096,), offset=2048).cpu(), vals.cpu())


@gpu
def test_gpu_view_by_storage_fallback(cuda_plat):
    """The fallback view (used where torch would resolve an IPC mapping's device from the pointer)."""
    import torch
    dev = cuda_plat.device_count() - 1
    with cuda_plat.alloc(4096, dev) as buf:
        cuda_plat.as_tensor(buf).zero_()
        v = cmem._view_by_storage(buf.ptr + 512, 1024, torch.device("cuda", dev))
        assert v.data_ptr() == buf.ptr + 512 and v.device == torch.device("cuda", dev) and v.numel() == 1024
        v.fill_(7)
        torch.cuda.synchronize(dev)
        raw = cuda_plat.as_tensor(buf).cpu()
        assert int((raw[512:1536] != 7).sum()) == 0
        assert int(raw[:512].count_nonzero()) == 0 and int(raw[1536:].count_nonzero()) == 0
        del v


@gpu
def test_gpu_triton_accepts_views(cuda_plat):
    import torch
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def _double(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        tl.store(y_ptr + i, tl.load(x_ptr + i, mask=m) * 2, mask=m)

    with cuda_plat.alloc(1 << 14, 0) as buf:
        x = cuda_plat.as_tensor(buf, torch.bfloat16, (2048,))
        y = cuda_plat.as_tensor(buf, torch.bfloat16, (2048,), offset=4096)
        x.copy_(torch.arange(2048, device="cuda:0").to(torch.bfloat16))
        s = cuda_plat.create_stream(0)
        cuda_plat.launch(s, lambda: _double[(16,)](x, y, 2048, BLOCK=128))
        assert cuda_plat.synchronize(s, T)
        assert torch.equal(y, x * 2)


@gpu
@pytest.mark.parametrize("mode", ["auto", "ctypes12080", "bindings", "loop"])
@pytest.mark.parametrize("stream_kind", ["created", "current"])
def test_gpu_copy_batch_random_descriptors(cuda_reason, monkeypatch, mode, stream_kind):
    import torch
    if cuda_reason is not None:
        pytest.skip(f"CUDA unavailable: {cuda_reason}")
    monkeypatch.setenv(ce.BATCH_MODE_ENV, mode)
    with cm.CudaPlatform() as p:
        note = p.batch_copy_note()
        print(mode, stream_kind, note)
        if mode in ("auto", "ctypes12080"):
            assert "cuMemcpyBatchAsync" in note and ("12080" in note) == (
                mode == "ctypes12080" or p._contexts.driver_version() < 13000)
        src_dev, dst_dev = 0, p.device_count() - 1
        page, npages = 576, 20000                               # > 2 chunks of 8192
        rng = np.random.default_rng(7)
        src, dst = p.alloc(page * npages, src_dev), p.alloc(page * npages, dst_dev)
        try:
            data = torch.randint(0, 256, (page * npages,), dtype=torch.uint8, device=f"cuda:{src_dev}")
            p.as_tensor(src).copy_(data)
            p.as_tensor(dst).zero_()
            torch.cuda.synchronize(src_dev)
            torch.cuda.synchronize(dst_dev)
            k = 17000
            from_pages = rng.choice(npages, size=k, replace=False)
            to_pages = rng.choice(npages, size=k, replace=False)
            sizes = rng.integers(0, page + 1, size=k).astype(np.int64)      # ragged, some zero
            s = p.create_stream(dst_dev) if stream_kind == "created" else p.current_stream(dst_dev)
            p.copy_batch_async(s, dst.ptr + to_pages * page, src.ptr + from_pages * page, sizes)
            assert p.synchronize(s, T)
            want = torch.zeros(page * npages, dtype=torch.uint8)
            d_cpu = data.cpu()
            for fp, tp, n in zip(from_pages.tolist(), to_pages.tolist(), sizes.tolist()):
                want[tp * page:tp * page + n] = d_cpu[fp * page:fp * page + n]
            got = p.as_tensor(dst).cpu()
            bad = (got != want).nonzero()
            assert bad.numel() == 0, f"{bad.numel()} wrong bytes, first at {int(bad[0])}"
        finally:
            torch.cuda.synchronize()
            src.close()
            dst.close()


@gpu
def test_gpu_batch_on_legacy_stream_keeps_stream_order(cuda_plat):
    """A batch on torch's legacy default stream runs after earlier work there and before later work."""
    import torch
    with cuda_plat.alloc(1 << 20, 0) as a, cuda_plat.alloc(1 << 20, 0) as b:
        s = cuda_plat.current_stream(0)
        assert s.is_legacy_default, s                    # torch's default: the legacy NULL stream
        ta, tb = cuda_plat.as_tensor(a), cuda_plat.as_tensor(b)
        tb.zero_()
        torch.cuda._sleep(50_000_000)                    # long GPU work before, on the same stream
        ta.fill_(9)
        offs = np.arange(0, 1 << 20, 4096, dtype=np.int64)
        cuda_plat.copy_batch_async(s, b.ptr + offs, a.ptr + offs, np.full(len(offs), 4096, dtype=np.int64))
        tb.add_(1)                                       # after the batch, on the same stream
        torch.cuda.synchronize(0)
        assert int((tb != 10).sum()) == 0


def _child_ipc_peer(handle, dev: int, n: int) -> dict:
    """Open rank 0's buffer on ``dev``; view it (bf16), run Triton on it, try a remote flag write."""
    import torch
    out = {}
    with cm.CudaPlatform() as p:
        torch.cuda.set_device(dev)
        m = p.open_handle(handle, dev)
        try:
            t = p.as_tensor(m, torch.bfloat16, (n,))
            out["view_ok"] = t.data_ptr() == m.ptr and t.device == torch.device("cuda", dev)
            out["cai_views_peers"] = p._memory._cai_views_peers
            want = torch.arange(n, device=f"cuda:{dev}").to(torch.bfloat16)
            out["read_ok"] = bool(torch.equal(t, want))
            p._memory._cai_views_peers = False                  # force the non-owning-storage view too
            t2 = p.as_tensor(m, torch.bfloat16, (n,))
            out["fallback_ok"] = t2.data_ptr() == m.ptr and bool(torch.equal(t2, want))
            del t2
            t.mul_(2)                                   # SM write over NVLink / PCIe into rank 0's memory
            torch.cuda.synchronize(dev)
            s = p.create_stream(dev)
            flag_ptr = m.ptr + m.nbytes - 8
            try:
                p.write_flag(s, flag_ptr, 4242)
                out["remote_write"] = "ok" if p.synchronize(s, T) else "timeout"
            except DriverError as exc:
                out["remote_write"] = f"refused: {exc.status_name}"
            s.close()
        finally:
            m.close()
    return out


@gpu
@pytest.mark.timeout(300)
def test_gpu_ipc_peer_view_and_remote_flag_write(cuda_plat, spawner):
    import torch
    _need_gpus(cuda_plat, 2)
    n = 4096
    with cuda_plat.alloc(2 * n + 64, 0) as buf:
        t = cuda_plat.as_tensor(buf, torch.bfloat16, (n,))
        t.copy_(torch.arange(n, device="cuda:0").to(torch.bfloat16))
        flag = buf.ptr + buf.nbytes - 8
        s = cuda_plat.create_stream(0)
        cuda_plat.memset_async(s, flag, 0, 8)
        assert cuda_plat.synchronize(s, T)
        torch.cuda.synchronize(0)
        child = spawner.start(_child_ipc_peer, buf.export(), 1, n, name="peer on cuda:1")
        res = child.result(240)
        child.join(60)
        print("IPC peer:", res)
        assert res["view_ok"] and res["read_ok"] and res["fallback_ok"]
        assert torch.equal(t, (torch.arange(n, device="cuda:0") * 2).to(torch.bfloat16))
        seen = cuda_plat.read_flag(flag, 0)
        if res["remote_write"] == "ok":
            assert seen == 4242, f"the peer's cuStreamWriteValue64 reported success but the flag reads {seen}"
        else:
            warnings.warn(f"remote cuStreamWriteValue64 to an IPC mapping: {res['remote_write']} "
                          "(expected from CUDA 13.1 on)")
            assert seen == 0


@gpu
def test_gpu_nvlink_matches_nvml(cuda_plat):
    _need_gpus(cuda_plat, 2)
    pynvml = pytest.importorskip("pynvml")
    link = cuda_plat.link(0, 1)
    print(link.as_dict())
    pynvml.nvmlInit()
    try:
        h = [pynvml.nvmlDeviceGetHandleByPciBusId(cuda_plat.pci_bus_id(i)) for i in (0, 1)]
        status = pynvml.nvmlDeviceGetP2PStatus(h[0], h[1], 2)   # NVML_P2P_CAPS_INDEX_NVLINK
    finally:
        pynvml.nvmlShutdown()
    assert link.kind == ("nvlink" if status == 0 else "pcie"), link
    assert link.is_fast == (status == 0)
    assert cuda_plat.link(0, 0).kind == "same-device"


@gpu
def test_gpu_read_flag_is_not_blocked_by_a_stuck_stream(cuda_plat):
    dev = 0
    with cuda_plat.alloc(16, dev) as flags:
        s = cuda_plat.create_stream(dev)
        cuda_plat.memset_async(s, flags.ptr, 0, 16)
        assert cuda_plat.synchronize(s, T)
        cuda_plat.wait_flag(s, flags.ptr, 1)
        try:
            ev = cuda_plat.record_event(s)
            assert not cuda_plat.event_wait(ev, 0.1)
            assert cuda_plat.read_flag(flags.ptr, dev) == 0            # helper stream runs past the stuck one
            cuda_plat.host_write_flag(flags.ptr + 8, -5, dev)
            assert cuda_plat.read_flag(flags.ptr + 8, dev) == -5
        finally:
            cuda_plat.host_write_flag(flags.ptr, 1, dev)
        assert cuda_plat.synchronize(s, T)


@gpu
def test_gpu_driver_errors_are_typed(cuda_plat):
    s = cuda_plat.create_stream(0)
    bogus = IpcHandle("cuda", 0, 4096, bytes(range(1, 65)), os.getpid() + 1)   # no such allocation
    with pytest.raises(DriverError) as info:
        cuda_plat.open_handle(bogus, 0)
    assert info.value.api == "cudaIpcOpenMemHandle" and info.value.status_name.startswith("cudaError")
    assert "opening on cuda:0" in info.value.doing
    with pytest.raises(BadInput):
        cuda_plat.write_flag(s, 0x1004, 1)
    with pytest.raises(BadInput):
        cuda_plat.alloc(0, 0)
    with pytest.raises(BadInput):
        cuda_plat.device_info(cuda_plat.device_count())
