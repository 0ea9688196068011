"""The CUDA platform's pure ``cuMemcpyBatchAsync`` plumbing on the CPU (chunking, both C ABIs, both
``cuda.bindings`` return shapes) driven end to end through fake entry points that copy host memory; the
enum values / struct layout we hard-code, checked against the installed ``cuda.bindings``; allocation
rounding and refused IPC handles.
"""
from __future__ import annotations

import ctypes
import os
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuxfer.errors import BadInput, DriverError
from gpuxfer.platforms import cuda as cm
from gpuxfer.platforms import cuda_driver as cd
from gpuxfer.platforms import cuda_flags as cf
from gpuxfer.platforms import cuda_memory as cmem
from gpuxfer.platforms import cuda_entry as ce
from gpuxfer.platforms.base import IpcHandle


# --------------------------------------------------------------------------- batch plumbing (pure)


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), max_size=60), per_call=st.integers(1, 17))
def test_plan_batch_copies_chunks(sizes, per_call):
    n = len(sizes)
    dsts = np.arange(1, n + 1, dtype=np.int64) * 4096
    srcs = np.arange(1, n + 1, dtype=np.int64) * 8192 + 3
    chunks = ce.plan_batch_copies(dsts, srcs, np.array(sizes, dtype=np.int64), per_call)
    keep = np.array(sizes, dtype=np.int64) > 0
    assert all(0 < len(c[0]) <= per_call for c in chunks)
    assert sum(len(c[0]) for c in chunks) == int(keep.sum())
    assert len(chunks) == -(-int(keep.sum()) // per_call)
    for c in chunks:
        assert len(c[0]) == len(c[1]) == len(c[2])
        for a in c:
            assert a.dtype == np.uint64 and a.flags.c_contiguous
    if chunks:
        got = [np.concatenate([c[i] for c in chunks]).astype(np.int64) for i in range(3)]
        for g, want in zip(got, (dsts[keep], srcs[keep], np.array(sizes, dtype=np.int64)[keep])):
            assert np.array_equal(g, want)


def test_plan_batch_copies_rejects_bad_input():
    a = np.array([4096, 8192], dtype=np.int64)
    with pytest.raises(BadInput, match="differ in length"):
        ce.plan_batch_copies(a, a[:1], a)
    with pytest.raises(BadInput, match="negative"):
        ce.plan_batch_copies(a, a, np.array([1, -1]))
    with pytest.raises(BadInput, match="null"):
        ce.plan_batch_copies(np.array([0, 8]), a, np.array([1, 1]))
    with pytest.raises(BadInput, match="max_per_call"):
        ce.plan_batch_copies(a, a, a, 0)
    with pytest.raises(BadInput, match="one-dimensional"):
        ce.plan_batch_copies(a.reshape(2, 1), a, a)
    assert ce.plan_batch_copies([], [], []) == []
    # a null pointer in a zero-byte copy is dropped with it
    assert len(ce.plan_batch_copies(np.array([0, 8]), a, np.array([0, 1]))) == 1


def test_batch_call_args_both_abis():
    d, s, n = ce.plan_batch_copies(np.array([16, 32, 48]), np.array([64, 80, 96]), np.array([1, 2, 3]))[0]
    a12 = ce.batch_call_args(12080, d, s, n, 1000, 2000, 3000, 0xABC)
    a13 = ce.batch_call_args(13000, d, s, n, 1000, 2000, 3000, 0xABC)
    assert len(a12) == 9 and len(a13) == 8
    assert a12[:7] == a13[:7] == (d.ctypes.data, s.ctypes.data, n.ctypes.data, 3, 1000, 2000, 1)
    assert a12[7:] == (3000, 0xABC) and a13[7:] == (0xABC,)
    with pytest.raises(BadInput, match="ABI"):
        ce.batch_call_args(12000, d, s, n, 1, 2, 3, 4)
    with pytest.raises(BadInput, match="uint64"):
        ce.batch_call_args(13000, d.astype(np.int64), s, n, 1, 2, 3, 4)


def test_batch_status_shapes():
    driver = pytest.importorskip("cuda.bindings.driver")
    ok, bad = driver.CUresult.CUDA_SUCCESS, driver.CUresult.CUDA_ERROR_INVALID_VALUE
    assert ce.batch_status(0) == (0, None)                       # ctypes entry point
    assert ce.batch_status((ok,)) == (ok, None)                  # cuda.bindings 13.x
    assert ce.batch_status((ok, 0)) == (ok, 0)                   # cuda.bindings 12.8 / 12.9
    assert ce.batch_status((bad, None)) == (bad, None)           # 12.x on error
    assert ce.batch_status((bad, ce.SIZE_MAX)) == (bad, None)
    assert ce.batch_status((bad, 7)) == (bad, 7)
    with pytest.raises(TypeError):
        ce.batch_status((ok, 1, 2))


def _host_batch(slot: int, k: int, seed: int):
    """k slot-sized copies between two host buffers, src slot i -> dst slot perm[i], ragged sizes (some 0).

    Returns (src, dst, dsts, srcs, sizes, expected dst).
    """
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, slot * k, dtype=np.uint8)
    dst = np.zeros(slot * k, dtype=np.uint8)
    perm = rng.permutation(k)
    sizes = rng.integers(0, slot + 1, k).astype(np.int64)
    sizes[::5] = 0
    want = np.zeros_like(dst)
    for i in range(k):
        want[perm[i] * slot:perm[i] * slot + sizes[i]] = src[i * slot:i * slot + sizes[i]]
    srcs = src.ctypes.data + np.arange(k, dtype=np.int64) * slot
    dsts = dst.ctypes.data + perm.astype(np.int64) * slot
    return src, dst, dsts, srcs, sizes, want


@pytest.mark.parametrize("abi", ce.BATCH_ABIS)
def test_ctypes_batch_path_end_to_end_on_host_memory(abi):
    """The real CudaStreams._batch_on ctypes path, with a fake entry point of the exact C signature that memmoves."""
    pytest.importorskip("cuda.bindings.driver", reason="cuda.bindings is not installed: the path builds its "
                        "attributes with it")
    calls = []
    seen = {}
    args = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_size_t] + ([ctypes.c_void_p] if abi == 12080 else []) + [ctypes.c_void_p]
    proto = ctypes.CFUNCTYPE(ctypes.c_int, *args)

    def fake(dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, *rest):
        stream = rest[-1]
        a = ce.CUmemcpyAttributes.from_address(attrs)
        seen["attr"] = (a.srcAccessOrder, a.flags, a.srcLocHint.type, a.dstLocHint.type)
        seen["idx"] = ctypes.c_size_t.from_address(attr_idxs).value
        seen["num_attrs"], seen["stream"] = num_attrs, stream
        d = np.ctypeslib.as_array((ctypes.c_uint64 * count).from_address(dsts))
        s = np.ctypeslib.as_array((ctypes.c_uint64 * count).from_address(srcs))
        n = np.ctypeslib.as_array((ctypes.c_uint64 * count).from_address(sizes))
        for dd, ss, nn in zip(d.tolist(), s.tolist(), n.tolist()):
            ctypes.memmove(dd, ss, nn)
        calls.append(count)
        return 0

    fn = proto(fake)
    src, dst, dsts, srcs, sizes, want = _host_batch(500, 40, seed=abi)
    chunks = ce.plan_batch_copies(dsts, srcs, sizes, 7)
    p = cm.CudaPlatform()
    p._streams._batch_on(("ctypes", fn, abi), 0x1234, 0, chunks)
    assert np.array_equal(dst, want)
    assert calls == [len(c[0]) for c in chunks] and max(calls) <= 7
    assert seen["attr"] == (cd.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, cd.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE,
                            0, 0)
    assert seen["idx"] == 0 and seen["num_attrs"] == 1 and seen["stream"] == 0x1234


def test_ctypes_batch_path_reports_the_failing_copy():
    pytest.importorskip("cuda.bindings.driver")
    args = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p]

    def fake(*a):
        ctypes.c_size_t.from_address(a[7]).value = 2
        return 1   # CUDA_ERROR_INVALID_VALUE

    fn = ctypes.CFUNCTYPE(ctypes.c_int, *args)(fake)
    chunks = ce.plan_batch_copies(np.arange(1, 11) * 64, np.arange(1, 11) * 64 + 8192, np.ones(10, np.int64), 4)
    with pytest.raises(DriverError) as info:
        cm.CudaPlatform()._streams._batch_on(("ctypes", fn, 12080), 0x99, 1, chunks)
    e = info.value
    assert e.api == "cuMemcpyBatchAsync" and e.status_name == "CUDA_ERROR_INVALID_VALUE"
    assert "copies 0..3" in e.doing and "failing at copy 2" in e.doing and "cuda:1" in e.doing


@pytest.mark.parametrize("shape", ["12.x (err, failIdx)", "13.x (err,)"])
def test_bindings_batch_path_both_return_shapes(monkeypatch, shape):
    driver = pytest.importorskip("cuda.bindings.driver")
    calls = []

    def fake_batch(dsts, srcs, sizes, count, attrs, idxs, num_attrs, stream):
        assert all(isinstance(x, driver.CUdeviceptr) for x in dsts + srcs)
        assert count == len(dsts) == len(srcs) == len(sizes) and idxs == [0] and num_attrs == 1
        a = attrs[0]
        assert int(a.srcAccessOrder) == 1 and int(a.flags) == 1
        for dd, ss, nn in zip(dsts, srcs, sizes):
            ctypes.memmove(int(dd), int(ss), nn)
        calls.append((count, stream))
        ok = driver.CUresult.CUDA_SUCCESS
        return (ok, 0) if shape.startswith("12") else (ok,)

    fake = types.SimpleNamespace(CUresult=driver.CUresult, CUdeviceptr=driver.CUdeviceptr,
                                 CUmemcpyAttributes=driver.CUmemcpyAttributes,
                                 CUmemcpySrcAccessOrder=driver.CUmemcpySrcAccessOrder,
                                 CUmemcpyFlags=driver.CUmemcpyFlags, cuMemcpyBatchAsync=fake_batch)
    monkeypatch.setattr(cd, "_DRIVER", fake)
    src, dst, dsts, srcs, sizes, want = _host_batch(400, 12, seed=3)
    cm.CudaPlatform()._streams._batch_on(("bindings", None, None), 77, 0, ce.plan_batch_copies(dsts, srcs, sizes, 5))
    assert np.array_equal(dst, want) and calls and all(s == 77 and c <= 5 for c, s in calls)

    def failing(*a):
        return (driver.CUresult.CUDA_ERROR_INVALID_VALUE, None) if shape.startswith("12") else \
            (driver.CUresult.CUDA_ERROR_INVALID_VALUE,)
    fake.cuMemcpyBatchAsync = failing
    with pytest.raises(DriverError, match="CUDA_ERROR_INVALID_VALUE"):
        cm.CudaPlatform()._streams._batch_on(("bindings", None, None), 77, 0, ce.plan_batch_copies(dsts, srcs, sizes))


# --------------------------------------------------------------------------- hard-coded values vs cuda.bindings


def test_constants_match_cuda_bindings():
    d = pytest.importorskip("cuda.bindings.driver")
    assert cd.CU_STREAM_NON_BLOCKING == int(d.CUstream_flags.CU_STREAM_NON_BLOCKING)
    assert cd.CU_EVENT_DISABLE_TIMING == int(d.CUevent_flags.CU_EVENT_DISABLE_TIMING)
    assert cd.CU_MEMHOSTALLOC_PORTABLE == d.CU_MEMHOSTALLOC_PORTABLE
    assert cd.CUDA_ERROR_NOT_READY == int(d.CUresult.CUDA_ERROR_NOT_READY)
    assert cd.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM == int(d.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM)
    assert cd.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE == int(
        d.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE)
    assert int(d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ) == cd._WAIT_GEQ == 0
    A = d.CUdevice_attribute
    assert int(A.CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS) == 122
    assert int(A.CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR) == 123
    assert int(A.CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES) == 98
    for name in ("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR", "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR",
                 "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT", "CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT"):
        assert hasattr(A, name)
    for fn in ("cuStreamWriteValue64", "cuStreamWaitValue64", "cuMemcpyAsync", "cuMemsetD8Async",
               "cuMemcpyDtoHAsync", "cuMemcpyHtoDAsync", "cuStreamQuery", "cuStreamCreate", "cuStreamDestroy",
               "cuEventCreate", "cuEventRecord", "cuEventDestroy", "cuStreamWaitEvent", "cuMemHostAlloc",
               "cuMemFreeHost", "cuCtxGetCurrent", "cuCtxPushCurrent", "cuCtxPopCurrent",
               "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease", "cuGetProcAddress", "cuDriverGetVersion",
               "cuDeviceGetName", "cuDeviceGetPCIBusId", "cuDeviceTotalMem", "cuMemGetInfo",
               "cuDeviceCanAccessPeer", "cuDeviceGetAttribute", "cuDeviceGetCount", "cuInit"):
        assert hasattr(d, fn), fn


def test_memcpy_attributes_layout_matches_cuda_bindings():
    d = pytest.importorskip("cuda.bindings.driver")
    ours = ce.CUmemcpyAttributes(srcAccessOrder=cd.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                                 flags=cd.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE)
    theirs = d.CUmemcpyAttributes()
    theirs.srcAccessOrder = d.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    theirs.flags = d.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
    assert ctypes.sizeof(ours) == 24
    assert bytes(ours) == ctypes.string_at(theirs.getPtr(), 24)


def test_stream_kinds_and_value_checks():
    assert cm.CudaStream(0, 0, None).is_legacy_default and cm.CudaStream(0, 1, None).is_legacy_default
    assert not cm.CudaStream(0, 2, None).is_legacy_default and not cm.CudaStream(0, 0x7F00, None).owned
    assert cf._u64(-1) == (1 << 64) - 1 and cf._u64(5) == 5 and cf._u64((1 << 64) - 1) == (1 << 64) - 1
    for bad in (1 << 64, -(1 << 63) - 1, 1.5, True):
        with pytest.raises(BadInput):
            cf._u64(bad)


def test_alloc_bytes_rounds_to_whole_large_pages_from_one_page_up():
    page = cm.LARGE_PAGE_BYTES
    assert page == 2 << 20
    for n in (1, 256, 4096, page - 1):
        assert cm.alloc_bytes(n) == n
    assert cm.alloc_bytes(page) == page and cm.alloc_bytes(page + 1) == 2 * page
    assert cm.alloc_bytes(14_650_649_856) == 6986 * page        # the kv bench pool that ran slow unrounded


def test_alloc_hands_the_rounded_size_to_cuda_malloc(monkeypatch):
    seen = []
    fake_rt = types.SimpleNamespace(malloc=lambda n: seen.append(n) or 0x7000_0000)
    p = cm.CudaPlatform()
    monkeypatch.setattr(p._contexts, "check_device", lambda d: d)
    monkeypatch.setattr(p._contexts, "rt", lambda dev, fn, *a, doing: fn(*a))
    monkeypatch.setattr(cmem, "_cupy", lambda: (None, fake_rt, None))
    buf = p.alloc((3 << 20) + 5, 0)
    assert seen == [4 << 20] and buf.nbytes == (3 << 20) + 5 and buf.allocated_bytes == 4 << 20
    small = p.alloc(300, 0)
    assert seen[-1] == 300 and small.nbytes == small.allocated_bytes == 300
    buf._closed = small._closed = True          # nothing real to free


def test_open_own_handle_is_refused_before_any_driver_call(monkeypatch):
    p = cm.CudaPlatform()
    monkeypatch.setattr(p._contexts, "check_device", lambda d: d)
    h = IpcHandle("cuda", 0, 64, b"\0" * 64, os.getpid())
    with pytest.raises(BadInput, match="exported"):
        p.open_handle(h, 0)
    with pytest.raises(BadInput, match="64 bytes"):
        p.open_handle(IpcHandle("cuda", 0, 64, b"\0" * 10, os.getpid() + 1), 0)
    with pytest.raises(BadInput, match="not a CUDA IPC handle"):
        p.open_handle(IpcHandle("host", 0, 64, b"/x", os.getpid() + 1), 0)
