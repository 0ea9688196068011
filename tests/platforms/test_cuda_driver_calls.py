"""The CUDA platform (gpuxfer/platforms/cuda.py) on the CPU, through fake drivers: importing touches
nothing, detection never raises, the one error checker, the per-step call path (stream-ordered calls, the
context pushed only when needed) and the event pool.
"""
from __future__ import annotations

import contextlib
import ctypes
import subprocess
import sys
import types

import numpy as np
import pytest

from gpuxfer.errors import BadInput, DriverError
from gpuxfer.platforms import cuda as cm
from gpuxfer.platforms import cuda_driver as cd
from gpuxfer.platforms.base import FLAG_OP_WAIT, FLAG_OP_WRITE, flag_ops_array


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
    monkeypatch.setattr(cd, "_cupy", lambda: (fake_cupy, None, CUDARuntimeError))

    def ipcOpenMemHandle(h, f):
        raise CUDARuntimeError(400)   # cudaErrorInvalidResourceHandle

    with pytest.raises(DriverError) as info:
        cm.CudaPlatform()._contexts.rt(1, ipcOpenMemHandle, b"x", 1, doing="opening a handle")
    assert info.value.api == "cudaIpcOpenMemHandle"
    assert info.value.status_name == "cudaErrorInvalidResourceHandle"


# --------------------------------------------------------------------------- the per-step call path (fake driver)


class _Calls:
    """A fake stream-ordered driver call answering ``results`` in turn, and a fake ``CudaContexts.on``."""

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
    plat._contexts.ctxs[1] = (object(), 0x1111)
    monkeypatch.setattr(plat._contexts, "on", calls.on)
    monkeypatch.setattr(cd, "_DRIVER", _fake_driver(cuCtxGetCurrent=lambda: (0, current_ctx)))
    return plat


def test_stream_op_on_a_created_stream_is_one_call(monkeypatch):
    calls = _Calls(0)
    plat = _plat_with(monkeypatch, calls, current_ctx=0x2222)      # another device's context is current
    plat._contexts.stream_op(cm.CudaStream(1, 0x7000, None), calls.cuFake, doing="x")
    assert (calls.calls, calls.pushed) == (1, 0)


def test_stream_op_pushes_the_context_only_when_the_driver_asks(monkeypatch):
    calls = _Calls(cd._ERR_INVALID_CONTEXT, 0)                     # no context on this thread, then fine
    plat = _plat_with(monkeypatch, calls)
    plat._contexts.stream_op(cm.CudaStream(1, 0x7000, None), calls.cuFake, doing="x")
    assert (calls.calls, calls.pushed) == (2, 1)
    calls = _Calls(1)                                              # any other error is raised, not retried
    plat = _plat_with(monkeypatch, calls)
    with pytest.raises(DriverError, match="cuFake failed with CUDA_ERROR_INVALID_VALUE.*while copying"):
        plat._contexts.stream_op(cm.CudaStream(1, 0x7000, None), calls.cuFake, doing=lambda: "copying")
    assert (calls.calls, calls.pushed) == (1, 0)


@pytest.mark.parametrize("handle", [0, 1, 2])
def test_stream_op_on_a_default_stream_makes_its_device_current(monkeypatch, handle):
    calls = _Calls(0)
    plat = _plat_with(monkeypatch, calls, current_ctx=0x2222)      # device 0's: handle 0 would mean its stream
    plat._contexts.stream_op(cm.CudaStream(1, handle, None), calls.cuFake, doing="x")
    assert (calls.calls, calls.pushed) == (1, 1)
    calls = _Calls(0)
    plat = _plat_with(monkeypatch, calls, current_ctx=0x1111)      # device 1's already: no push
    plat._contexts.stream_op(cm.CudaStream(1, handle, None), calls.cuFake, doing="x")
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
    plat._contexts.ctxs[1] = (object(), 0x1111)
    monkeypatch.setattr(cd, "_DRIVER", _fake_driver(
        cuCtxGetCurrent=lambda: (0, None), cuGetProcAddress=lambda name, ver, flags: (0, points[name], None),
        cuStreamWriteValue64=checked("checked write"), cuStreamWaitValue64=checked("checked wait"),
        cuGraphLaunch=checked("checked launch"), cuMemcpyAsync=checked("checked copy")))
    pushed = []
    monkeypatch.setattr(plat._contexts, "on", lambda device: contextlib.nullcontext(pushed.append(device)))
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
    plat._contexts.count = 1                            # a default stream where one device is visible:
    seen.clear()                                        # its handle means that device's context
    plat.stream_calls(cm.CudaStream(1, 0, None)).wait_flag(0x1040, 4)
    assert seen == [("wait", 0, 0x1040, 4, cd._WAIT_GEQ)]
    plat._contexts.count = 2                            # ... of a multi-device process: asked per call
    seen.clear()                                        # which context is current: the device's,
    default = plat.stream_calls(cm.CudaStream(1, 0, None))
    default.wait_flag(0x1040, 4)
    assert seen == [("current",), ("wait", 0, 0x1040, 4, cd._WAIT_GEQ)]
    current[0], n = 0x2222, len(pushed)                 # another device's: the checked call, which makes
    seen.clear()                                        # the device's context current first
    default.launch_graph(g)
    assert [x[0] for x in seen] == ["current", "checked launch"] and len(pushed) == n + 1
    plat._flags._step_fns = False                       # no entry points: the checked calls
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


# --------------------------------------------------------------------------- the event pool


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
