"""The CUDA platform (gpuxfer/platforms/cuda.py).

CPU tests (default run): importing touches nothing, detection never raises, the
one error checker, the pure ``cuMemcpyBatchAsync`` plumbing (chunking, both C
ABIs, both ``cuda.bindings`` return shapes) driven end to end through fake
entry points that copy host memory, and the enum values / struct layout we
hard-code, checked against the installed ``cuda.bindings``.

GPU tests (``-m gpu``): the stream-memory-operation probe, device info, bf16
views, batch copies checked byte for byte on every batch path and stream kind,
Triton on the views, as_tensor / write_flag over an IPC mapping in a second
process (spawn), and NVLink as NVML reports it.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import sys
import types
import warnings

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
from gpuxfer.platforms.base import FLAG_OP_WAIT, FLAG_OP_WRITE, IpcHandle, flag_ops_array

T = 60.0

# --------------------------------------------------------------------------- import / detection


def test_import_touches_nothing():
    code = ("import sys\n"
            "import gpuxfer.platforms.cuda, gpuxfer.platforms\n"
            "bad = [m for m in ('cupy', 'cupy_backends', 'cuda.bindings', 'cuda.bindings.driver', 'pynvml', 'torch')"
            " if m in sys.modules]\n"
            "print(','.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"importing the cuda platform imported {out.stdout.strip()}"


def test_unavailable_reason_here_is_a_string_or_none():
    why = cm.CudaPlatform.unavailable_reason()
    assert why is None or (isinstance(why, str) and why)
    try:
        import torch
        if torch.version.cuda is None:
            assert "without CUDA" in why
    except ImportError:
        pass


def _fake_driver(**fns):
    driver = pytest.importorskip("cuda.bindings.driver", reason="cuda.bindings is not installed (gpuxfer[cuda12] "
                                 "or gpuxfer[cuda13]): these fakes use its real result codes")
    ns = types.SimpleNamespace(CUresult=driver.CUresult, cuGetErrorString=lambda e: (driver.CUresult(0), b"fake"))
    ns.__dict__.update(fns)
    return ns


@pytest.mark.parametrize("case", ["no-libcuda", "cuinit-fails", "no-devices", "cupy-missing", "bindings-missing"])
def test_unavailable_reason_branches(monkeypatch, case):
    torch = pytest.importorskip("torch")
    pytest.importorskip("cuda.bindings.driver")
    from cuda.bindings import driver
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cm, "_cupy", lambda: (None, types.SimpleNamespace(is_hip=False), Exception))
    ok = driver.CUresult.CUDA_SUCCESS

    def boom(*_):
        raise RuntimeError('"cuda" is an NVIDIA driver library and can only be found via system search')

    if case == "no-libcuda":
        monkeypatch.setattr(cm, "_driver", lambda: _fake_driver(cuInit=boom))
        assert "driver library cannot be loaded" in cm.CudaPlatform.unavailable_reason()
    elif case == "cuinit-fails":
        monkeypatch.setattr(cm, "_driver", lambda: _fake_driver(
            cuInit=lambda f: (driver.CUresult.CUDA_ERROR_NO_DEVICE,)))
        assert "cuInit failed with CUDA_ERROR_NO_DEVICE" in cm.CudaPlatform.unavailable_reason()
    elif case == "no-devices":
        monkeypatch.setattr(cm, "_driver", lambda: _fake_driver(cuInit=lambda f: (ok,),
                                                                cuDeviceGetCount=lambda: (ok, 0)))
        assert "no CUDA device is visible" in cm.CudaPlatform.unavailable_reason()
    elif case == "cupy-missing":
        def no_cupy():
            raise ImportError("No module named 'cupy'")
        monkeypatch.setattr(cm, "_cupy", no_cupy)
        assert "CuPy cannot be imported" in cm.CudaPlatform.unavailable_reason()
    else:
        def no_bindings():
            raise ImportError("No module named 'cuda.bindings'")
        monkeypatch.setattr(cm, "_driver", no_bindings)
        assert "cuda.bindings cannot be imported" in cm.CudaPlatform.unavailable_reason()


def test_unavailable_reason_never_raises(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.version, "cuda", "13.0")

    def weird():
        raise SystemError("something odd")
    monkeypatch.setattr(cm, "_cupy", lambda: (None, types.SimpleNamespace(is_hip=False), Exception))
    # a bare namespace, not _fake_driver: this must hold where cuda.bindings is not installed
    monkeypatch.setattr(cm, "_driver", lambda: types.SimpleNamespace(cuInit=lambda f: weird()))
    why = cm.CudaPlatform.unavailable_reason()
    assert isinstance(why, str) and "something odd" in why


# --------------------------------------------------------------------------- the error checker


def test_check_maps_a_failing_result_to_driver_error():
    driver = pytest.importorskip("cuda.bindings.driver")
    res = (driver.CUresult.CUDA_ERROR_NOT_SUPPORTED,)           # what e.g. cuStreamWriteValue64 returns
    with pytest.raises(DriverError) as info:
        cm.check(res, "writing flag 0x1000 := 3 on stream 7", "cuStreamWriteValue64")
    e = info.value
    assert (e.api, e.status_name, e.status) == ("cuStreamWriteValue64", "CUDA_ERROR_NOT_SUPPORTED", 801)
    assert e.doing == "writing flag 0x1000 := 3 on stream 7"
    assert "CUDA_ERROR_NOT_SUPPORTED (801)" in str(e) and "writing flag 0x1000" in str(e)
    # calls with outputs return (err, None...) on failure
    with pytest.raises(DriverError, match="CUDA_ERROR_INVALID_VALUE"):
        cm.check((driver.CUresult.CUDA_ERROR_INVALID_VALUE, None, None), "reading memory info")


def test_check_returns_outputs():
    driver = pytest.importorskip("cuda.bindings.driver")
    ok = driver.CUresult.CUDA_SUCCESS
    assert cm.check((ok,), "x") is None
    assert cm.check((ok, 5), "x") == 5
    assert cm.check((ok, 1, 2), "x") == (1, 2)
    assert cm.check(0, "x") is None                               # a ctypes entry point's int


def test_check_reads_plain_ints_as_curesult():
    pytest.importorskip("cuda.bindings.driver")
    with pytest.raises(DriverError) as info:
        cm.check(801, "issuing a batch", "cuMemcpyBatchAsync")
    assert info.value.status_name == "CUDA_ERROR_NOT_SUPPORTED"
    with pytest.raises(DriverError) as info:
        cm.check((123456,), "y")
    assert info.value.status_name == "CUresult(123456)" and info.value.status == 123456


def test_check_wraps_cupy_runtime_errors():
    pytest.importorskip("cupy_backends.cuda.api.runtime")
    from cupy_backends.cuda.api.runtime import CUDARuntimeError
    with pytest.raises(DriverError) as info:
        cm.check(CUDARuntimeError(1), "allocating 64 bytes on cuda:0", "cudaMalloc")
    e = info.value
    assert (e.api, e.status_name, e.status) == ("cudaMalloc", "cudaErrorInvalidValue", 1)
    assert "invalid argument" in str(e) and "allocating 64 bytes" in str(e)
    assert isinstance(e.__cause__, CUDARuntimeError)


def test_check_names_runtime_enums():
    runtime = pytest.importorskip("cuda.bindings.runtime")
    with pytest.raises(DriverError) as info:
        cm.check((runtime.cudaError_t.cudaErrorInvalidValue,), "z", "cudaFoo")
    assert info.value.status_name == "cudaErrorInvalidValue"


def test_rt_routes_cupy_errors_through_check(monkeypatch):
    pytest.importorskip("cupy_backends.cuda.api.runtime")
    from cupy_backends.cuda.api.runtime import CUDARuntimeError

    class Dev:
        def __init__(self, d):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=Dev))
    monkeypatch.setattr(cm, "_cupy", lambda: (fake_cupy, None, CUDARuntimeError))

    def ipcOpenMemHandle(h, f):
        raise CUDARuntimeError(400)   # cudaErrorInvalidResourceHandle

    with pytest.raises(DriverError) as info:
        cm.CudaPlatform()._rt(1, ipcOpenMemHandle, b"x", 1, doing="opening a handle")
    assert info.value.api == "cudaIpcOpenMemHandle"
    assert info.value.status_name == "cudaErrorInvalidResourceHandle"


# --------------------------------------------------------------------------- the per-step call path (fake driver)


class _Calls:
    """A fake stream-ordered driver call answering ``results`` in turn, and a fake ``_on``."""

    def __init__(self, *results):
        self.results, self.calls, self.pushed = list(results), 0, 0

    def cuFake(self, *args):
        self.calls += 1
        return (self.results.pop(0),)

    @contextlib.contextmanager
    def on(self, device):
        self.pushed += 1
        yield


def _plat_with(monkeypatch, calls, current_ctx=None):
    plat = cm.CudaPlatform()
    plat._ctxs[1] = (object(), 0x1111)
    monkeypatch.setattr(plat, "_on", calls.on)
    monkeypatch.setattr(cd, "_DRIVER", _fake_driver(cuCtxGetCurrent=lambda: (0, current_ctx)))
    return plat


def test_stream_op_on_a_created_stream_is_one_call(monkeypatch):
    calls = _Calls(0)
    plat = _plat_with(monkeypatch, calls, current_ctx=0x2222)      # another device's context is current
    plat._stream_op(cm.CudaStream(1, 0x7000, None), calls.cuFake, doing="x")
    assert (calls.calls, calls.pushed) == (1, 0)


def test_stream_op_pushes_the_context_only_when_the_driver_asks(monkeypatch):
    calls = _Calls(cd._ERR_INVALID_CONTEXT, 0)                     # no context on this thread, then fine
    plat = _plat_with(monkeypatch, calls)
    plat._stream_op(cm.CudaStream(1, 0x7000, None), calls.cuFake, doing="x")
    assert (calls.calls, calls.pushed) == (2, 1)
    calls = _Calls(1)                                              # any other error is raised, not retried
    plat = _plat_with(monkeypatch, calls)
    with pytest.raises(DriverError, match="cuFake failed with CUDA_ERROR_INVALID_VALUE.*while copying"):
        plat._stream_op(cm.CudaStream(1, 0x7000, None), calls.cuFake, doing=lambda: "copying")
    assert (calls.calls, calls.pushed) == (1, 0)


@pytest.mark.parametrize("handle", [0, 1, 2])
def test_stream_op_on_a_default_stream_makes_its_device_current(monkeypatch, handle):
    calls = _Calls(0)
    plat = _plat_with(monkeypatch, calls, current_ctx=0x2222)      # device 0's: handle 0 would mean its stream
    plat._stream_op(cm.CudaStream(1, handle, None), calls.cuFake, doing="x")
    assert (calls.calls, calls.pushed) == (1, 1)
    calls = _Calls(0)
    plat = _plat_with(monkeypatch, calls, current_ctx=0x1111)      # device 1's already: no push
    plat._stream_op(cm.CudaStream(1, handle, None), calls.cuFake, doing="x")
    assert (calls.calls, calls.pushed) == (1, 0)


def test_stream_calls_one_driver_call_each_and_the_checked_path_otherwise(monkeypatch):
    """The bound per-step calls: one call of the driver's entry point (here C callbacks standing in for
    them) with the stream's handle; an argument out of range, or a call the driver refuses, goes through the
    checked method (which pushes the context, or raises)."""
    c = ctypes
    seen, answers, keep = [], [], {}

    def entry(name, *argtypes):
        def fn(*args):
            seen.append((name, *[a or 0 for a in args]))
            return answers.pop(0) if answers else 0
        keep[name] = c.CFUNCTYPE(c.c_int, *argtypes)(fn)
        return c.cast(keep[name], c.c_void_p).value
    flag = (c.c_void_p, c.c_uint64, c.c_uint64, c.c_uint)
    current = [0x1111]                                  # the context current on this thread

    def get_current(p):
        seen.append(("current",))
        c.cast(p, c.POINTER(c.c_void_p))[0] = current[0]
        return 0
    keep["current"] = c.CFUNCTYPE(c.c_int, c.c_void_p)(get_current)
    points = {b"cuStreamWriteValue64": entry("write", *flag), b"cuStreamWaitValue64": entry("wait", *flag),
              b"cuGraphLaunch": entry("launch", c.c_void_p, c.c_void_p),
              b"cuStreamBatchMemOp": entry("memop", c.c_void_p, c.c_uint, c.c_void_p, c.c_uint),
              b"cuCtxGetCurrent": c.cast(keep["current"], c.c_void_p).value,
              b"cuMemcpyAsync": entry("copy", c.c_uint64, c.c_uint64, c.c_size_t, c.c_void_p)}

    def checked(name):      # cuda.bindings' own functions, under the checked methods
        def fn(*args):
            seen.append((name, *args))
            return (answers.pop(0) if answers else 0,)
        return fn
    plat = cm.CudaPlatform()
    plat._ctxs[1] = (object(), 0x1111)
    monkeypatch.setattr(cd, "_DRIVER", _fake_driver(
        cuCtxGetCurrent=lambda: (0, None), cuGetProcAddress=lambda name, ver, flags: (0, points[name], None),
        cuStreamWriteValue64=checked("checked write"), cuStreamWaitValue64=checked("checked wait"),
        cuGraphLaunch=checked("checked launch"), cuMemcpyAsync=checked("checked copy")))
    pushed = []
    monkeypatch.setattr(plat, "_on", lambda device: contextlib.nullcontext(pushed.append(device)))
    s = cm.CudaStream(1, 0x7000, None)
    calls = plat.stream_calls(s)
    g = cm.CudaGraph(1, None, 0x99)
    calls.write_flag(0x1000, 5)
    calls.wait_flag(0x1040, (1 << 64) - 1)
    calls.launch_graph(g)
    calls.copy(0x5000, 0x6000, 4096)
    assert seen == [("write", 0x7000, 0x1000, 5, 0), ("wait", 0x7000, 0x1040, (1 << 64) - 1, cd._WAIT_GEQ),
                    ("launch", 0x99, 0x7000), ("copy", 0x5000, 0x6000, 4096, 0x7000)] and not pushed
    seen.clear()
    calls.copy(0x5000, 0x6000, 0)                       # nothing to copy: no driver call
    with pytest.raises(BadInput, match="cannot copy -1 bytes"):
        calls.copy(0x5000, 0x6000, -1)
    assert not seen
    answers[:] = [1, 1]                                 # refused by the driver: the checked copy raises
    with pytest.raises(DriverError, match="CUDA_ERROR_INVALID_VALUE"):
        calls.copy(0x5000, 0x6000, 8)
    assert [x[0] for x in seen] == ["copy", "checked copy"]
    seen.clear()
    ops = flag_ops_array([(FLAG_OP_WRITE, 0x1000, 3), (FLAG_OP_WAIT, 0x1040, 2)])
    calls.flag_ops(ops)         # a new array: the checked method (which checks it), then straight to the driver
    calls.flag_ops(ops)
    assert seen == [("memop", 0x7000, 2, ops.ctypes.data, 0)] * 2 and not pushed
    seen.clear()
    with pytest.raises(BadInput, match="flag_ops_array"):
        calls.flag_ops(np.zeros((2, 3), dtype=np.uint64))
    with pytest.raises(BadInput, match="aligned"):
        calls.write_flag(0x1004, 5)
    with pytest.raises(BadInput, match="integer"):
        calls.wait_flag(0x1040, "3")
    with pytest.raises(BadInput, match="not a CUDA graph"):
        calls.launch_graph(object())
    assert not seen                                     # refused before any driver call
    answers[:] = [cd._ERR_INVALID_CONTEXT] * 2          # no context on this thread: the checked path
    calls.write_flag(0x1000, 6)                         # repeats it with the context pushed
    assert [x[0] for x in seen] == ["write", "checked write", "checked write"] and pushed == [1]
    answers[:] = [cd._ERR_INVALID_CONTEXT] * 2          # the same for flag_ops
    seen.clear()
    calls.flag_ops(ops)
    assert [x[0] for x in seen] == ["memop"] * 3 and pushed == [1, 1]
    answers[:] = [1, 1]                                 # refused by the driver: the checked path raises
    with pytest.raises(DriverError, match="CUDA_ERROR_INVALID_VALUE"):
        calls.wait_flag(0x1040, 4)
    plat._count = 1                                     # a default stream where one device is visible:
    seen.clear()                                        # its handle means that device's context
    plat.stream_calls(cm.CudaStream(1, 0, None)).wait_flag(0x1040, 4)
    assert seen == [("wait", 0, 0x1040, 4, cd._WAIT_GEQ)]
    plat._count = 2                                     # ... of a multi-device process: asked per call
    seen.clear()                                        # which context is current: the device's,
    default = plat.stream_calls(cm.CudaStream(1, 0, None))
    default.wait_flag(0x1040, 4)
    assert seen == [("current",), ("wait", 0, 0x1040, 4, cd._WAIT_GEQ)]
    current[0], n = 0x2222, len(pushed)                 # another device's: the checked call, which makes
    seen.clear()                                        # the device's context current first
    default.launch_graph(g)
    assert [x[0] for x in seen] == ["current", "checked launch"] and len(pushed) == n + 1
    plat._step_fns = False                              # no entry points: the checked calls
    seen.clear()
    plat.stream_calls(s).write_flag(0x1000, 7)
    assert [x[0] for x in seen] == ["checked write"]


def test_event_query_reads_not_ready_and_raises_errors(monkeypatch):
    answers = []
    monkeypatch.setattr(cd, "_DRIVER", _fake_driver(cuEventQuery=lambda h: (answers.pop(0),),
                                                    cuEventDestroy=lambda h: (0,)))
    plat = cm.CudaPlatform()
    ev = cm.CudaEvent(0, 0x9000)
    answers[:] = [cd.CUDA_ERROR_NOT_READY, 0, 400]
    assert plat.event_query(ev) is False
    assert plat.event_query(ev) is True
    with pytest.raises(DriverError, match="CUDA_ERROR_INVALID_HANDLE.*querying CudaEvent"):
        plat.event_query(ev)


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
    """The real _batch_on ctypes path, with a fake entry point of the exact C signature that memmoves."""
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
    p._batch_on(("ctypes", fn, abi), 0x1234, 0, chunks)
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
        cm.CudaPlatform()._batch_on(("ctypes", fn, 12080), 0x99, 1, chunks)
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
    cm.CudaPlatform()._batch_on(("bindings", None, None), 77, 0, ce.plan_batch_copies(dsts, srcs, sizes, 5))
    assert np.array_equal(dst, want) and calls and all(s == 77 and c <= 5 for c, s in calls)

    def failing(*a):
        return (driver.CUresult.CUDA_ERROR_INVALID_VALUE, None) if shape.startswith("12") else \
            (driver.CUresult.CUDA_ERROR_INVALID_VALUE,)
    fake.cuMemcpyBatchAsync = failing
    with pytest.raises(DriverError, match="CUDA_ERROR_INVALID_VALUE"):
        cm.CudaPlatform()._batch_on(("bindings", None, None), 77, 0, ce.plan_batch_copies(dsts, srcs, sizes))


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
    monkeypatch.setattr(p, "_check_device", lambda d: d)
    monkeypatch.setattr(p, "_rt", lambda dev, fn, *a, doing: fn(*a))
    monkeypatch.setattr(cmem, "_cupy", lambda: (None, fake_rt, None))
    buf = p.alloc((3 << 20) + 5, 0)
    assert seen == [4 << 20] and buf.nbytes == (3 << 20) + 5 and buf.allocated_bytes == 4 << 20
    small = p.alloc(300, 0)
    assert seen[-1] == 300 and small.nbytes == small.allocated_bytes == 300
    buf._closed = small._closed = True          # nothing real to free


def test_open_own_handle_is_refused_before_any_driver_call(monkeypatch):
    p = cm.CudaPlatform()
    monkeypatch.setattr(p, "_check_device", lambda d: d)
    h = IpcHandle("cuda", 0, 64, b"\0" * 64, os.getpid())
    with pytest.raises(BadInput, match="exported"):
        p.open_handle(h, 0)
    with pytest.raises(BadInput, match="64 bytes"):
        p.open_handle(IpcHandle("cuda", 0, 64, b"\0" * 10, os.getpid() + 1), 0)
    with pytest.raises(BadInput, match="not a CUDA IPC handle"):
        p.open_handle(IpcHandle("host", 0, 64, b"/x", os.getpid() + 1), 0)


# =========================================================================== GPU tests

gpu = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_reason():
    return cm.CudaPlatform.unavailable_reason()


@pytest.fixture
def plat(cuda_reason):
    if cuda_reason is not None:
        pytest.skip(f"CUDA unavailable: {cuda_reason}")
    p = cm.CudaPlatform()
    try:
        yield p
    finally:
        p.close()


def _need_gpus(p, n):
    if p.device_count() < n:
        pytest.skip(f"needs {n} GPUs, {p.device_count()} visible")


@gpu
def test_gpu_alloc_is_whole_large_pages(plat):
    from cuda.bindings import driver
    buf = plat.alloc(cm.LARGE_PAGE_BYTES * 3 + 100, 0)
    try:
        err, base, size = driver.cuMemGetAddressRange(buf.ptr)
        assert int(err) == 0 and int(base) == buf.ptr
        assert int(size) == buf.allocated_bytes == cm.LARGE_PAGE_BYTES * 4
        assert buf.nbytes == cm.LARGE_PAGE_BYTES * 3 + 100
    finally:
        buf.close()


@gpu
def test_gpu_probe_and_device_info(plat):
    for d in range(plat.device_count()):
        assert plat.probe_stream_mem_ops(d) is None, plat.probe_stream_mem_ops(d)
        assert plat.probe_stream_mem_ops(d) is None            # cached
        info = plat.device_info(d)
        print(info.as_dict())
        assert info.stream_mem_ops_64 and info.arch.startswith("sm_") and info.sm_count > 0
        assert info.total_bytes > info.free_bytes > 0 and info.copy_engines >= 1
        assert info.pci_bus_id and ":" in info.pci_bus_id
        assert any("CAN_USE_64_BIT_STREAM_MEM_OPS" in n for n in info.notes)
    v = plat.versions()
    print(v)
    assert v["cuda driver"][0].isdigit() and "unavailable" not in v["cupy"]


@gpu
def test_gpu_driver_calls_keep_the_callers_device(plat):
    import torch
    _need_gpus(plat, 2)
    torch.cuda.set_device(0)
    s1 = plat.create_stream(1)
    with plat.alloc(64, 1) as buf:
        plat.memset_async(s1, buf.ptr, 0, 64)
        plat.write_flag(s1, buf.ptr, 3)
        assert plat.synchronize(s1, T)
        assert plat.read_flag(buf.ptr, 1) == 3
        assert torch.cuda.current_device() == 0


@gpu
@pytest.mark.parametrize("stream_kind", ["created", "default"])
def test_gpu_stream_ops_land_on_the_streams_device(plat, stream_kind):
    """The per-step calls on device 1's streams while device 0 is current: a created stream takes the
    one-call path, the default stream (handle 0: "the current context's") must get device 1's context."""
    import torch
    _need_gpus(plat, 2)
    torch.cuda.set_device(0)
    s = plat.create_stream(1) if stream_kind == "created" else plat.current_stream(1)
    assert (s.handle in (0, 1, 2)) == (stream_kind == "default")
    src = torch.arange(4096, device="cuda:1", dtype=torch.int32).view(torch.uint8)
    dst = torch.zeros_like(src)
    with plat.alloc(256, 1) as flags:
        plat.memset_async(s, flags.ptr, 0, 256)
        plat.write_flag(s, flags.ptr, 5)
        plat.wait_flag(s, flags.ptr, 5)
        ev = plat.record_event(s)
        ev2 = plat.record_event(s, ev)
        assert ev2 is ev and ev.device == 1                       # re-recorded, not created
        plat.stream_wait_event(s, ev)
        plat.copy_async(s, dst.data_ptr(), src.data_ptr(), src.numel())
        done = plat.record_event(s)
        assert plat.event_wait(done, T) and plat.event_query(done)
        assert torch.equal(dst.cpu(), src.cpu())
        assert plat.read_flag(flags.ptr, 1) == 5
    assert torch.cuda.current_device() == 0
    if stream_kind == "created":
        s.close()


@gpu
def test_gpu_record_event_reuses_collected_events(plat):
    """A new event of record_event takes the handle of a collected one; a recycled event still tracks its
    own recording (a copy queued after it), and after close nothing is reused."""
    import gc
    import torch
    s = plat.create_stream(0)
    first = plat.record_event(s)
    handle = first.handle
    del first
    gc.collect()
    src = torch.arange(1 << 20, device="cuda:0", dtype=torch.int32)
    dst = torch.zeros_like(src)
    plat.copy_async(s, dst.data_ptr(), src.data_ptr(), src.numel() * 4)
    again = plat.record_event(s)
    assert again.handle == handle                          # the spare, not a new event
    assert plat.event_wait(again, T) and torch.equal(dst, src)
    s.close()
    plat.close()
    assert plat._events.closed and not any(plat._events.spare.values())


def test_event_pool_keeps_spares_up_to_its_cap_and_destroys_after_close(monkeypatch):
    from gpuxfer.platforms import cuda_streams as cs
    destroyed: list[int] = []
    monkeypatch.setattr(cs, "_destroy_event", destroyed.append)
    pool = cs._EventPool()
    assert pool.take(0) is None
    for h in range(pool.CAP + 2):
        pool.give(0, 1000 + h)
    assert destroyed == [1000 + pool.CAP, 1001 + pool.CAP]          # past the cap: destroyed
    assert pool.take(0) == 999 + pool.CAP and pool.take(1) is None  # last in, first out; per device
    pool.close()
    assert len(destroyed) == pool.CAP + 1 and pool.take(0) is None
    pool.give(0, 7)                                                  # collected after close: destroyed
    assert destroyed[-1] == 7


def test_collected_event_goes_to_its_pool_or_is_destroyed(monkeypatch):
    import gc
    from gpuxfer.platforms import cuda_streams as cs
    destroyed: list[int] = []
    monkeypatch.setattr(cs, "_destroy_event", destroyed.append)
    pool = cs._EventPool()
    ev = cs.CudaEvent(1, 0x51, pool)
    lone = cs.CudaEvent(0, 0x52)
    del ev, lone
    gc.collect()
    assert pool.take(1) == 0x51 and pool.take(1) is None and destroyed == [0x52]


@gpu
def test_gpu_as_tensor_bf16_round_trip(plat):
    import torch
    dev = plat.device_count() - 1
    with plat.alloc(1 << 16, dev) as buf:
        vals = (torch.randn(4096, device=f"cuda:{dev}") * 100).to(torch.bfloat16)
        t = plat.as_tensor(buf, torch.bfloat16, (64, 64), offset=2048)
        assert t.device == torch.device("cuda", dev) and t.data_ptr() == buf.ptr + 2048
        t.copy_(vals.view(64, 64))
        raw = plat.as_tensor(buf, torch.uint8, (8192,), offset=2048)
        assert torch.equal(raw.view(torch.bfloat16), vals)
        assert torch.equal(plat.as_tensor(buf, torch.bfloat16, (4096,), offset=2048).cpu(), vals.cpu())


@gpu
def test_gpu_view_by_storage_fallback(plat):
    """The fallback view (used where torch would resolve an IPC mapping's device from the pointer)."""
    import torch
    dev = plat.device_count() - 1
    with plat.alloc(4096, dev) as buf:
        plat.as_tensor(buf).zero_()
        v = cmem._view_by_storage(buf.ptr + 512, 1024, torch.device("cuda", dev))
        assert v.data_ptr() == buf.ptr + 512 and v.device == torch.device("cuda", dev) and v.numel() == 1024
        v.fill_(7)
        torch.cuda.synchronize(dev)
        raw = plat.as_tensor(buf).cpu()
        assert int((raw[512:1536] != 7).sum()) == 0
        assert int(raw[:512].count_nonzero()) == 0 and int(raw[1536:].count_nonzero()) == 0
        del v


@gpu
def test_gpu_triton_accepts_views(plat):
    import torch
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def _double(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        tl.store(y_ptr + i, tl.load(x_ptr + i, mask=m) * 2, mask=m)

    with plat.alloc(1 << 14, 0) as buf:
        x = plat.as_tensor(buf, torch.bfloat16, (2048,))
        y = plat.as_tensor(buf, torch.bfloat16, (2048,), offset=4096)
        x.copy_(torch.arange(2048, device="cuda:0").to(torch.bfloat16))
        s = plat.create_stream(0)
        plat.launch(s, lambda: _double[(16,)](x, y, 2048, BLOCK=128))
        assert plat.synchronize(s, T)
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
            assert "cuMemcpyBatchAsync" in note and ("12080" in note) == (mode == "ctypes12080" or
                                                                        p._driver_ver() < 13000)
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
def test_gpu_batch_on_legacy_stream_keeps_stream_order(plat):
    """A batch on torch's legacy default stream runs after earlier work there and before later work."""
    import torch
    with plat.alloc(1 << 20, 0) as a, plat.alloc(1 << 20, 0) as b:
        s = plat.current_stream(0)
        assert s.is_legacy_default, s                    # torch's default: the legacy NULL stream
        ta, tb = plat.as_tensor(a), plat.as_tensor(b)
        tb.zero_()
        torch.cuda._sleep(50_000_000)                    # long GPU work before, on the same stream
        ta.fill_(9)
        offs = np.arange(0, 1 << 20, 4096, dtype=np.int64)
        plat.copy_batch_async(s, b.ptr + offs, a.ptr + offs, np.full(len(offs), 4096, dtype=np.int64))
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
            out["cai_views_peers"] = p._cai_views_peers
            want = torch.arange(n, device=f"cuda:{dev}").to(torch.bfloat16)
            out["read_ok"] = bool(torch.equal(t, want))
            p._cai_views_peers = False                  # force the non-owning-storage view too
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
def test_gpu_ipc_peer_view_and_remote_flag_write(plat, spawner):
    import torch
    _need_gpus(plat, 2)
    n = 4096
    with plat.alloc(2 * n + 64, 0) as buf:
        t = plat.as_tensor(buf, torch.bfloat16, (n,))
        t.copy_(torch.arange(n, device="cuda:0").to(torch.bfloat16))
        flag = buf.ptr + buf.nbytes - 8
        s = plat.create_stream(0)
        plat.memset_async(s, flag, 0, 8)
        assert plat.synchronize(s, T)
        torch.cuda.synchronize(0)
        child = spawner.start(_child_ipc_peer, buf.export(), 1, n, name="peer on cuda:1")
        res = child.result(240)
        child.join(60)
        print("IPC peer:", res)
        assert res["view_ok"] and res["read_ok"] and res["fallback_ok"]
        assert torch.equal(t, (torch.arange(n, device="cuda:0") * 2).to(torch.bfloat16))
        seen = plat.read_flag(flag, 0)
        if res["remote_write"] == "ok":
            assert seen == 4242, f"the peer's cuStreamWriteValue64 reported success but the flag reads {seen}"
        else:
            warnings.warn(f"remote cuStreamWriteValue64 to an IPC mapping: {res['remote_write']} "
                          "(expected from CUDA 13.1 on)")
            assert seen == 0


@gpu
def test_gpu_nvlink_matches_nvml(plat):
    _need_gpus(plat, 2)
    pynvml = pytest.importorskip("pynvml")
    link = plat.link(0, 1)
    print(link.as_dict())
    pynvml.nvmlInit()
    try:
        h = [pynvml.nvmlDeviceGetHandleByPciBusId(plat.pci_bus_id(i)) for i in (0, 1)]
        status = pynvml.nvmlDeviceGetP2PStatus(h[0], h[1], 2)   # NVML_P2P_CAPS_INDEX_NVLINK
    finally:
        pynvml.nvmlShutdown()
    assert link.kind == ("nvlink" if status == 0 else "pcie"), link
    assert link.is_fast == (status == 0)
    assert plat.link(0, 0).kind == "same-device"


@gpu
def test_gpu_read_flag_is_not_blocked_by_a_stuck_stream(plat):
    dev = 0
    with plat.alloc(16, dev) as flags:
        s = plat.create_stream(dev)
        plat.memset_async(s, flags.ptr, 0, 16)
        assert plat.synchronize(s, T)
        plat.wait_flag(s, flags.ptr, 1)
        try:
            ev = plat.record_event(s)
            assert not plat.event_wait(ev, 0.1)
            assert plat.read_flag(flags.ptr, dev) == 0            # helper stream runs past the stuck one
            plat.host_write_flag(flags.ptr + 8, -5, dev)
            assert plat.read_flag(flags.ptr + 8, dev) == -5
        finally:
            plat.host_write_flag(flags.ptr, 1, dev)
        assert plat.synchronize(s, T)


@gpu
def test_gpu_driver_errors_are_typed(plat):
    s = plat.create_stream(0)
    bogus = IpcHandle("cuda", 0, 4096, bytes(range(1, 65)), os.getpid() + 1)   # no such allocation
    with pytest.raises(DriverError) as info:
        plat.open_handle(bogus, 0)
    assert info.value.api == "cudaIpcOpenMemHandle" and info.value.status_name.startswith("cudaError")
    assert "opening on cuda:0" in info.value.doing
    with pytest.raises(BadInput):
        plat.write_flag(s, 0x1004, 1)
    with pytest.raises(BadInput):
        plat.alloc(0, 0)
    with pytest.raises(BadInput):
        plat.device_info(plat.device_count())
