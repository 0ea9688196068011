"""The platform contract on NVIDIA GPUs.

Which library does what, and why:

* **CuPy's runtime** (``cupy.cuda.runtime``) allocates and frees buffers with a
  plain ``cudaMalloc`` / ``cudaFree`` (never a caching-allocator block, so an
  IPC handle names exactly the buffer) and exports / opens / closes IPC handles
  (``cudaIpcGetMemHandle`` returns the 64 raw bytes, whatever the version of
  ``cuda.bindings``: its ``cudaIpcMemHandle_t.reserved`` vanished in 13.4).
* **cuda.bindings' driver API** does everything enqueued on a stream:
  ``cuStreamWriteValue64`` / ``cuStreamWaitValue64`` (flags), ``cuMemcpyAsync``,
  ``cuMemsetD8Async``, host reads / writes of flags on a helper stream, and
  device attributes. ``cuMemcpyBatchAsync`` is called through its driver entry
  point (``cuGetProcAddress`` + ctypes) with the descriptor arrays passed as
  numpy buffers: no Python object per copy. Its C signature differs between
  CUDA 12.8 (``..., size_t *failIdx, CUstream``) and 13.0 (``..., CUstream``);
  the entry point is requested for one ABI version and called with exactly that
  signature (:data:`~gpuxfer.platforms.cuda_entry.BATCH_ABIS`; the entry points are
  resolved in :mod:`gpuxfer.platforms.cuda_entry`).
* **torch** owns what kernels see: streams are wrapped as ``torch.cuda``
  streams, events are ``torch.cuda.Event``, and buffers are viewed as tensors
  through ``__cuda_array_interface__`` with the device given explicitly. The
  view is checked (same pointer, same device); where torch instead resolves an
  IPC mapping's device from the pointer (and would copy), the view goes through
  a non-owning storage on the mapping's device (``_view_by_storage``).
* **nvidia-ml-py** (NVML) tells NVLink from PCIe per device pair, matching
  devices by PCI bus id (NVML indexes ignore ``CUDA_VISIBLE_DEVICES``).

Every driver / runtime status goes through :func:`check`, which raises
:class:`~gpuxfer.errors.DriverError` with the API, the status name
(``CUDA_ERROR_NOT_SUPPORTED``...), the status text and what gpuxfer was doing.
Driver calls run with the primary context of the device concerned pushed (and
popped after) when it is not already current, so they never change the
caller's current device.

Semantics worth knowing:

* ``create_stream`` makes a dedicated non-blocking stream (``cuStreamCreate``
  with ``CU_STREAM_NON_BLOCKING``) wrapped as ``torch.cuda.ExternalStream``,
  not a stream from torch's pool: the pool hands out its 32 streams round
  robin, and a flag wait on a recycled pool stream would stall unrelated torch
  (or NCCL) work. Created streams are destroyed by ``stream.close()`` or at
  platform ``close()``; a stream whose device work is pending is released by
  the driver once that work ends.
* ``current_stream`` is torch's current stream, often the *legacy default
  stream* (handle 0). ``cuMemcpyBatchAsync`` refuses that stream, so a batch on
  it runs on a per-device proxy stream ordered with events (legacy -> proxy ->
  legacy): stream order is kept.
* ``read_flag`` / ``host_write_flag`` copy 8 bytes through pinned host memory on
  a per-device non-blocking helper stream (never the legacy stream) and poll
  that stream alone, so a stream stuck in a flag wait does not hold them up. They
  raise :class:`~gpuxfer.errors.TransferTimeout` after
  ``CudaPlatform.host_op_timeout_s`` rather than hang (a stuck stream that shares
  a hardware queue with the helper stream could hold it).
* Opening an IPC handle in the process that exported it is refused with
  :class:`~gpuxfer.errors.BadInput` (CUDA refuses it too): use the buffer itself.
  Opening the same handle again on a device shares the first mapping (CUDA maps an
  allocation once per context); it is unmapped when the last of its mappings closes.
* Flag values: any 64-bit integer (``-2**63 .. 2**64-1``), written as its
  unsigned 64-bit pattern; ``read_flag`` returns the signed value. Waits are the
  driver's cyclic GEQ: ``(int64)(*ptr - value) >= 0``.
* Remote flag writes (``write_flag`` on an IPC-mapped peer address) work on
  CUDA 13.0 drivers and are refused from CUDA 13.1 on (NVIDIA/nccl#2052): the
  protocols stage flags locally and copy 8 bytes instead. ``write_flag`` /
  ``wait_flag`` accept any device pointer mapped in the stream's context.
* Deadlock hygiene: ``cudaFree`` / ``cudaIpcCloseMemHandle`` (``close()``) may
  wait for pending device work; drain streams stuck in flag waits first.
"""
from __future__ import annotations

import ctypes
import os
import threading
import time
import weakref
from typing import Any, Callable, Sequence

import numpy as np

from .. import config
from ..common import package_version
from ..errors import BadInput, DriverError, GpuxferError, NotExportable, TransferTimeout
from .cuda_entry import (BATCH_MAX_PER_CALL, BATCH_MODE_ENV, CUDA_SUCCESS, SIZE_MAX, CUmemcpyAttributes,
                         batch_call_args, batch_status, cuda_version_str, plan_batch_copies, resolve_batch,
                         resolve_memop, resolve_step_fns)
from .base import (DeviceBuffer, DeviceInfo, Event, ExportedRange, IpcHandle, LinkInfo, Memory, PeerMapping,
                   Platform, Stream, StreamCalls, check_flag_ptr, FLAG_OP_WORDS, RELEASE_VALUE)

# --------------------------------------------------------------------------- constants

IPC_HANDLE_BYTES = 64
_MASK64 = (1 << 64) - 1

# driver enum values (checked against cuda-bindings 12.9 and 13.x; see tests)
CU_STREAM_NON_BLOCKING = 1
CU_EVENT_DISABLE_TIMING = 2
CU_MEMHOSTALLOC_PORTABLE = 1
CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1
_WAIT_GEQ = 0                 # CU_STREAM_WAIT_VALUE_GEQ
_ERR_INVALID_CONTEXT = 201     # CUDA_ERROR_INVALID_CONTEXT
_EVENT_DISABLE_TIMING = 2      # CU_EVENT_DISABLE_TIMING
CUDA_ERROR_NOT_READY = 600
CU_MEMORYTYPE_DEVICE = 2
_LEGACY_STREAM_HANDLES = (0, 1)    # NULL and cudaStreamLegacy; 2 (per-thread default) is not legacy
_DEFAULT_STREAM_HANDLES = (0, 1, 2)  # streams that mean "the current context's"

# --------------------------------------------------------------------------- lazy imports


_DRIVER = None


def _driver():
    global _DRIVER
    if _DRIVER is None:
        from cuda.bindings import driver
        _DRIVER = driver
    return _DRIVER


def _cupy():
    import cupy
    from cupy_backends.cuda.api.runtime import CUDARuntimeError
    return cupy, cupy.cuda.runtime, CUDARuntimeError


# --------------------------------------------------------------------------- the one error checker


def _status_info(status: Any) -> tuple[int, str, str]:
    """``(code, name, text)`` of a driver / runtime status or a CuPy ``CUDARuntimeError``."""
    # CuPy: CUDARuntimeError(status) whose str() is "cudaErrorName: text"
    if isinstance(status, BaseException):
        code = int(getattr(status, "status", -1))
        name, sep, text = str(status).partition(": ")
        if not sep or not name.startswith("cuda"):
            name, text = f"cudaError({code})", str(status)
        return code, name, text
    code = int(status)
    enum_name = type(status).__name__
    try:
        if enum_name == "cudaError_t":           # cuda.bindings runtime status
            from cuda.bindings import runtime
            name = runtime.cudaError_t(code).name
            text = runtime.cudaGetErrorString(runtime.cudaError_t(code))[1]
        else:                                    # CUresult, or a plain int from a ctypes call
            drv = _driver()
            try:
                name = drv.CUresult(code).name
            except ValueError:
                return code, f"CUresult({code})", ""
            try:
                err, text = drv.cuGetErrorString(drv.CUresult(code))
                if int(err) != CUDA_SUCCESS:
                    text = b""
            except Exception:                    # driver library missing (CPU machines): no text
                text = b""
    except Exception:
        return code, getattr(status, "name", f"status({code})"), ""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return code, name, text or ""


def check(result: Any, doing: "str | Callable[[], str]", api: str = "") -> Any:
    """Return the outputs of a CUDA call, or raise :class:`DriverError`.

    ``result`` is what a ``cuda.bindings`` call returns (``(status, *outputs)``;
    the status is a ``CUresult`` / ``cudaError_t``), a bare status (a ctypes
    call's int is read as a ``CUresult``), or a CuPy ``CUDARuntimeError``.
    Returns ``None`` for no output, the output for one, a tuple for several.
    ``doing`` says what gpuxfer was doing ("opening the IPC handle of ..."); hot
    paths pass a callable so the text is only formatted when the call failed.
    """
    if isinstance(result, BaseException):
        code, name, text = _status_info(result)
        raise DriverError(api or "CUDA runtime", name, code, _text(doing), text) from result
    if isinstance(result, tuple):
        if not result:
            raise TypeError("check() got an empty result tuple")
        status, outputs = result[0], result[1:]
    else:
        status, outputs = result, ()
    if int(status) != CUDA_SUCCESS:
        code, name, text = _status_info(status)
        raise DriverError(api or "CUDA driver", name, code, _text(doing), text)
    if not outputs:
        return None
    return outputs[0] if len(outputs) == 1 else outputs


def _text(doing: "str | Callable[[], str]") -> str:
    return doing() if callable(doing) else doing


def _cu(fn: Callable, *args, doing: "str | Callable[[], str]") -> Any:
    """Call a ``cuda.bindings`` function and :func:`check` its result."""
    return check(fn(*args), doing, getattr(fn, "__name__", "CUDA driver"))


def _runtime_api_name(fn: Callable) -> str:
    n = getattr(fn, "__name__", "runtime")
    return "cuda" + n[:1].upper() + n[1:]


# --------------------------------------------------------------------------- stream / event wrappers


class CudaStream(Stream):
    """A CUDA stream: ``handle`` is the ``CUstream`` as an int (0 = legacy default stream).

    ``torch`` is the matching ``torch.cuda.Stream`` / ``ExternalStream`` (use it with
    ``torch.cuda.stream(...)``). Streams from :meth:`CudaPlatform.create_stream` are
    owned: ``close()`` destroys them (idempotent; the platform's ``close()`` does it too).
    """

    def __init__(self, device: int, handle: int, torch_stream, platform: "CudaPlatform | None" = None):
        self.device = device
        self.handle = handle
        self.torch = torch_stream
        self._platform = platform      # set only for owned streams
        self._closed = False

    @property
    def owned(self) -> bool:
        return self._platform is not None

    @property
    def is_legacy_default(self) -> bool:
        return self.handle in _LEGACY_STREAM_HANDLES

    def __repr__(self) -> str:
        kind = "owned" if self.owned else ("legacy default" if self.is_legacy_default else "torch")
        return f"CudaStream(cuda:{self.device}, 0x{self.handle:x}, {kind})"


class CudaEvent(Event):
    """A driver event (``CU_EVENT_DISABLE_TIMING``) of ``device``: ``handle`` is the ``CUevent`` as an int.

    Destroyed when the object is collected. A raw event rather than a ``torch.cuda.Event``:
    recording and waiting through the driver cost 0.6-0.7 us of host time where torch's
    wrappers cost 0.9-1.0 (2xH200, scripts/host_costs.py), and a pp step makes four such calls.
    """

    def __init__(self, device: int, handle: int):
        self.device = device
        self.handle = handle
        weakref.finalize(self, _destroy_event, handle)

    def __repr__(self) -> str:
        return f"CudaEvent(cuda:{self.device}, 0x{self.handle:x})"


class CudaGraph:
    """An instantiated CUDA graph (``CUgraphExec``) and its graph; destroyed when collected (a launch still
    in flight finishes first: the driver frees it afterwards)."""

    def __init__(self, device: int, graph, exe):
        self.device = device
        self.exe = exe
        self.handle = int(exe)      # the CUgraphExec as an int (for entry points called through ctypes)
        weakref.finalize(self, _destroy_graph, exe, graph)

    def __repr__(self) -> str:
        return f"CudaGraph(cuda:{self.device}, 0x{int(self.exe):x})"


def _destroy_graph(exe, graph) -> None:
    try:
        _DRIVER.cuGraphExecDestroy(exe)
        _DRIVER.cuGraphDestroy(graph)
    except Exception:  # noqa: BLE001 - interpreter exit: the driver may be gone first
        pass


def _destroy_event(handle: int) -> None:
    try:
        _DRIVER.cuEventDestroy(handle)
    except Exception:  # noqa: BLE001 - interpreter exit: the driver may be gone first
        pass


class _CudaArray:
    """A minimal ``__cuda_array_interface__`` (v3) exporter over raw device bytes."""

    __slots__ = ("__cuda_array_interface__", "_keep")

    def __init__(self, ptr: int, nbytes: int, keep: object):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 3}
        self._keep = keep   # the Memory object, for as long as the tensor lives


class _Helper:
    """Per-device state for host reads / writes of flags: a stream and 8 pinned bytes."""

    def __init__(self, stream: int, host_ptr: int):
        self.stream = stream
        self.host_ptr = host_ptr
        self.lock = threading.Lock()


class _OnDevice:
    """``with plat._on(dev):`` -- the device's primary context is current inside (pushed only if needed)."""

    __slots__ = ("_plat", "_dev", "_pushed")

    def __init__(self, plat: "CudaPlatform", dev: int):
        self._plat, self._dev, self._pushed = plat, dev, False

    def __enter__(self):
        self._pushed = self._plat._make_current(self._dev)
        return self

    def __exit__(self, *exc) -> None:
        if self._pushed:
            self._pushed = False
            _cu(_driver().cuCtxPopCurrent, doing=f"restoring the caller's context after work on cuda:{self._dev}")


class _RelaxedCapture:
    """``with _RelaxedCapture():`` -- this thread's stream-capture mode is relaxed inside.

    A graph capture in torch's default (global) mode forbids "unsafe" calls -- a stream query or
    synchronise, a synchronous copy -- on every thread while it lasts, and such a call invalidates
    it. The host's flag reads and writes (a copy on a helper stream, then a bounded poll) run
    here, so a watchdog release or a failure found during someone's capture leaves that capture
    intact.
    """

    __slots__ = ("_old",)

    def __enter__(self):
        d = _driver()
        self._old = _cu(d.cuThreadExchangeStreamCaptureMode, d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED,
                        doing="relaxing this thread's stream-capture mode for a host flag access")
        return self

    def __exit__(self, *exc) -> None:
        _cu(_driver().cuThreadExchangeStreamCaptureMode, self._old,
            doing="restoring this thread's stream-capture mode")


#: The GPU's large page. A kernel touching pages scattered over a ``cudaMalloc`` whose size is
#: not a multiple of it runs much slower (likely: the driver maps such a buffer with small pages,
#: and address translation costs): on H200 a batch-1 kv-dsv4 pull over a 14.65 GB pool took
#: 2.1 ms with the pool's exact size and 0.85 ms with the size rounded up to 2 MiB
#: (scripts/page_probe.py).
LARGE_PAGE_BYTES = 2 << 20


def alloc_bytes(nbytes: int) -> int:
    """The size :meth:`CudaPlatform.alloc` allocates for ``nbytes``: from one large page up,
    rounded up to whole large pages; smaller requests as asked."""
    if nbytes < LARGE_PAGE_BYTES:
        return nbytes
    return -(-nbytes // LARGE_PAGE_BYTES) * LARGE_PAGE_BYTES


def _view_by_storage(ptr: int, nbytes: int, device):
    """A uint8 CUDA tensor over ``[ptr, ptr + nbytes)`` through a non-owning storage on ``device``."""
    import torch
    make = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if make is None:
        raise GpuxferError(f"this torch ({torch.__version__}) cannot view 0x{ptr:x} on {device} in place")
    storage = make(int(ptr), device, int(nbytes))
    t = torch.empty(0, dtype=torch.uint8, device=device)
    t.set_(storage, 0, (int(nbytes),), (1,))
    return t


def _torch_dtype(dtype):
    import torch
    if dtype is None:
        return torch.uint8
    if isinstance(dtype, torch.dtype):
        return dtype
    raise BadInput(f"not a torch dtype: {dtype!r}")


def _u64(value: int, what: str = "flag value") -> int:
    if type(value) is int and 0 <= value <= _MASK64:     # the per-step case
        return value
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise BadInput(f"a {what} must be an integer, got {type(value).__name__}")
    value = int(value)
    if not -(1 << 63) <= value <= _MASK64:
        raise BadInput(f"{what} {value} does not fit in 64 bits")
    return value & _MASK64


# --------------------------------------------------------------------------- the platform


class CudaPlatform(Platform):
    """The contract on CUDA: CuPy runtime for memory and IPC, cuda.bindings for stream work, NVML for links."""

    name = "cuda"
    is_emulation = False
    memory_runtime = "cuda"
    copy_engine_peer_copies = True

    host_op_timeout_s: float = 30.0     # read_flag / host_write_flag give up (TransferTimeout) after this
    batch_max_per_call: int = BATCH_MAX_PER_CALL

    # ---- detection ----
    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why CUDA cannot be used here, or None. Never raises; creates no context (cuInit + count only)."""
        try:
            try:
                import torch
            except Exception as exc:
                return f"torch cannot be imported ({type(exc).__name__}: {exc})"
            if getattr(torch.version, "cuda", None) is None:
                return f"torch {torch.__version__} was built without CUDA"
            try:
                _, rt, _ = _cupy()
            except Exception as exc:
                return (f"CuPy cannot be imported ({type(exc).__name__}: {exc}); "
                        "install gpuxfer[cuda12] or gpuxfer[cuda13]")
            if getattr(rt, "is_hip", False):
                return "the installed CuPy is a ROCm build"
            try:
                drv = _driver()
            except Exception as exc:
                return (f"cuda.bindings cannot be imported ({type(exc).__name__}: {exc}); "
                        "install gpuxfer[cuda12] or gpuxfer[cuda13]")
            try:
                res = drv.cuInit(0)
            except Exception as exc:   # e.g. cuda.pathfinder DynamicLibNotFoundError: no libcuda.so
                return f"the CUDA driver library cannot be loaded ({type(exc).__name__}: {exc})"
            if int(res[0]) != CUDA_SUCCESS:
                _, name, text = _status_info(res[0])
                return f"cuInit failed with {name}" + (f" ({text})" if text else "")
            err, count = drv.cuDeviceGetCount()
            if int(err) != CUDA_SUCCESS:
                _, name, _ = _status_info(err)
                return f"cuDeviceGetCount failed with {name}"
            if int(count) == 0:
                vis = os.environ.get("CUDA_VISIBLE_DEVICES")
                return "no CUDA device is visible" + (f" (CUDA_VISIBLE_DEVICES={vis!r})" if vis is not None else "")
            if not torch.cuda.is_available():
                return f"torch {torch.__version__} sees no usable CUDA device"
            return None
        except Exception as exc:   # never raise from detection
            return f"CUDA detection failed ({type(exc).__name__}: {exc})"

    def __init__(self):
        self._lock = threading.RLock()
        self._closed_platform = False
        self._count: int | None = None
        self._ctxs: dict[int, tuple[Any, int]] = {}       # device -> (CUcontext, as int)
        self._helpers: dict[int, _Helper] = {}
        self._proxies: dict[int, tuple[int, Any, Any]] = {}   # device -> (stream, event in, event out)
        self._proxy_locks: dict[int, threading.Lock] = {}
        self._streams: dict[int, CudaStream] = {}          # id -> owned streams still alive
        self._current: dict[tuple, CudaStream] = {}        # (device, handle) -> torch's streams seen current
        self._raw_stream = None     # torch._C._cuda_getCurrentRawStream (False where torch lacks it)
        self._memop = None          # cuStreamBatchMemOp through ctypes (False where missing)
        self._step_fns = None       # stream_calls' entry points through ctypes (False where missing)
        self._memop_arrays: dict[int, tuple] = {}     # id -> (flag_ops array, its address, rows)
        self._probes: dict[int, str | None] = {}
        self._links: dict[tuple[int, int], LinkInfo] = {}
        self._batch: tuple | None = None                   # resolved batch path (see _batch_impl)
        self._driver_version: int | None = None
        self._cai_views_peers: bool | None = None          # does __cuda_array_interface__ view IPC mappings?
        self._ipc_open: dict[tuple[int, bytes], list] = {}  # (device, handle) -> [mapped pointer, open count]

    # ---- small helpers ----
    def _check_open(self) -> None:
        if self._closed_platform:
            raise BadInput("the cuda platform is closed")

    def _check_device(self, device: int) -> int:
        if isinstance(device, bool) or not isinstance(device, (int, np.integer)):
            raise BadInput(f"device must be an integer, got {device!r}")
        n = self.device_count()
        if not 0 <= int(device) < n:
            raise BadInput(f"device {device!r} does not exist: {n} CUDA device(s) are visible")
        return int(device)

    def _retain(self, device: int) -> tuple[Any, int]:
        with self._lock:
            if device not in self._ctxs:
                ctx = _cu(_driver().cuDevicePrimaryCtxRetain, device,
                          doing=f"retaining the primary context of cuda:{device}")
                self._ctxs[device] = (ctx, int(ctx))
            return self._ctxs[device]

    def _make_current(self, device: int) -> bool:
        """Make ``device``'s primary context current; True if it was pushed (pop it after)."""
        ctx, _ = self._retain(device)
        if self._is_current(device):
            return False
        _cu(_driver().cuCtxPushCurrent, ctx, doing=f"making the primary context of cuda:{device} current")
        return True

    def _on(self, device: int) -> _OnDevice:
        return _OnDevice(self, device)

    def _stream_op(self, s: CudaStream, fn: Callable, *args, doing: "str | Callable[[], str]") -> None:
        """``fn(*args)`` (a driver call queued on ``s``) in ``s``'s context, errors through :func:`check`.

        The per-step hot path. A created stream names its context, and stream-ordered
        calls on it run there whatever context is current (measured on 2x H200:
        copies, flag writes and waits on device 1's stream with device 0's context
        current), so it is one driver call. The default streams (handles 0-2) mean
        "the current context's", so for them the device's context is made current
        first -- without that check, work meant for device 1's default stream would
        land on device 0's (measured: an event record there fails, INVALID_HANDLE).
        A process that sees one device skips the check (a driver call per op): any
        context current on its thread is that device's (torch's primary context; a
        context of the caller's own, made with the driver API, would take the work),
        and with none current the call fails with INVALID_CONTEXT and is repeated
        with the device's context pushed.
        """
        if s.handle in _DEFAULT_STREAM_HANDLES and self._count != 1 and not self._is_current(s.device):
            with self._on(s.device):
                _cu(fn, *args, doing=doing)
            return
        res = fn(*args)
        status = int(res[0])
        if status == CUDA_SUCCESS:
            return
        if status != _ERR_INVALID_CONTEXT:
            check(res, doing, fn.__name__)
            return
        with self._on(s.device):           # no context current on this thread: repeat it with one pushed
            _cu(fn, *args, doing=doing)

    def _is_current(self, device: int) -> bool:
        """Is ``device``'s primary context (already retained) current on this thread?"""
        entry = self._ctxs.get(device)
        if entry is None:
            return False
        _, cur = _driver().cuCtxGetCurrent()
        return cur is not None and int(cur) == entry[1]

    def _rt(self, device: int, fn: Callable, *args, doing: str) -> Any:
        """Call a CuPy runtime function with ``device`` current; CuPy errors become DriverError via check()."""
        cupy, _, CUDARuntimeError = _cupy()
        try:
            with cupy.cuda.Device(device):
                return fn(*args)
        except CUDARuntimeError as exc:
            check(exc, doing, _runtime_api_name(fn))

    @staticmethod
    def _stream(stream) -> CudaStream:
        if type(stream) is CudaStream and not stream._closed:    # the per-step case first
            return stream
        if not isinstance(stream, CudaStream):
            raise BadInput(f"not a CUDA stream: {stream!r}")
        if stream._closed:
            raise BadInput(f"{stream!r} is closed")
        return stream

    @staticmethod
    def _event(event) -> CudaEvent:
        if not isinstance(event, CudaEvent):
            raise BadInput(f"not a CUDA event: {event!r}")
        return event

    def _driver_ver(self) -> int:
        if self._driver_version is None:
            self._driver_version = int(_cu(_driver().cuDriverGetVersion, doing="reading the driver version"))
        return self._driver_version

    def _attr(self, device: int, name: str) -> int:
        drv = _driver()
        attr = getattr(drv.CUdevice_attribute, name)
        return int(_cu(drv.cuDeviceGetAttribute, attr, device, doing=f"reading {name} of cuda:{device}"))

    # ---- devices ----
    def device_count(self) -> int:
        if self._count is None:
            drv = _driver()
            _cu(drv.cuInit, 0, doing="initialising the CUDA driver")
            self._count = int(_cu(drv.cuDeviceGetCount, doing="counting CUDA devices"))
        return self._count

    def set_device(self, device: int) -> None:
        import torch
        torch.cuda.set_device(self._check_device(device))

    def pci_bus_id(self, device: int) -> str:
        device = self._check_device(device)
        raw = _cu(_driver().cuDeviceGetPCIBusId, 64, device, doing=f"reading the PCI bus id of cuda:{device}")
        return raw.split(b"\0", 1)[0].decode().strip()

    def device_info(self, device: int) -> DeviceInfo:
        device = self._check_device(device)
        drv = _driver()
        raw = _cu(drv.cuDeviceGetName, 256, device, doing=f"reading the name of cuda:{device}")
        name = raw.split(b"\0", 1)[0].decode(errors="replace").strip()
        major = self._attr(device, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR")
        minor = self._attr(device, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR")
        total = int(_cu(drv.cuDeviceTotalMem, device, doing=f"reading the memory size of cuda:{device}"))
        with self._on(device):
            free, _ = _cu(drv.cuMemGetInfo, doing=f"reading the free memory of cuda:{device}")
        attr64 = self._attr(device, "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS")
        nor = self._attr(device, "CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR")
        flush = self._attr(device, "CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES")
        probe = self.probe_stream_mem_ops(device)
        notes = [f"driver CUDA {cuda_version_str(self._driver_ver())}",
                 f"attribute CAN_USE_64_BIT_STREAM_MEM_OPS={attr64}",
                 ("stream memory operations probe (write + wait + host release): ok" if probe is None
                  else f"stream memory operations probe failed: {probe}")]
        if probe is None and not attr64:
            notes.append("the attribute says no 64-bit stream memory operations, the real probe says yes: "
                         "trusting the probe")
        notes.append(self.batch_copy_note())
        return DeviceInfo(
            index=device, name=name, arch=f"sm_{major}{minor}", total_bytes=total, free_bytes=int(free),
            pci_bus_id=self.pci_bus_id(device),
            sm_count=self._attr(device, "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT"),
            copy_engines=self._attr(device, "CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT"),
            stream_mem_ops_64=probe is None, stream_wait_nor=bool(nor), can_flush_remote_writes=bool(flush),
            notes=tuple(notes))

    def link(self, src: int, dst: int) -> LinkInfo:
        src, dst = self._check_device(src), self._check_device(dst)
        if src == dst:
            return LinkInfo(src, dst, "same-device", True)
        key = (src, dst)
        if key not in self._links:
            peer = bool(_cu(_driver().cuDeviceCanAccessPeer, src, dst,
                            doing=f"asking whether cuda:{src} can access cuda:{dst}"))
            kind, detail = self._nvlink(src, dst)
            self._links[key] = LinkInfo(src, dst, kind, peer, detail)
        return self._links[key]

    def _nvlink(self, src: int, dst: int) -> tuple[str, str]:
        """("nvlink" | "pcie" | "unknown", detail) from NVML's P2P status, devices matched by PCI bus id."""
        try:
            import pynvml
        except Exception as exc:
            return "unknown", f"NVML (nvidia-ml-py) is not importable: {type(exc).__name__}: {exc}"
        bus = (self.pci_bus_id(src), self.pci_bus_id(dst))
        try:
            pynvml.nvmlInit()
        except Exception as exc:
            return "unknown", f"NVML cannot be initialised: {exc}"
        try:
            h1 = pynvml.nvmlDeviceGetHandleByPciBusId(bus[0])
            h2 = pynvml.nvmlDeviceGetHandleByPciBusId(bus[1])
            index = getattr(pynvml, "NVML_P2P_CAPS_INDEX_NVLINK", 2)
            if isinstance(index, tuple):   # some pynvml constants are 1-tuples (a stray comma)
                index = index[0]
            status = int(pynvml.nvmlDeviceGetP2PStatus(h1, h2, index))
        except Exception as exc:
            return "unknown", f"NVML P2P query failed for {bus[0]} -> {bus[1]}: {exc}"
        finally:
            try:
                pynvml.nvmlShutdown()
            except Exception:
                pass
        ok = getattr(pynvml, "NVML_P2P_STATUS_OK", 0)
        if status == ok:
            return "nvlink", f"NVML P2P NVLink status OK ({bus[0]} -> {bus[1]})"
        names = {v: k for k, v in vars(pynvml).items() if k.startswith("NVML_P2P_STATUS_") and isinstance(v, int)}
        return "pcie", (f"NVML P2P NVLink status {names.get(status, status)} ({bus[0]} -> {bus[1]}): "
                        "no NVLink, traffic goes over PCIe")

    @classmethod
    def load_runtime_library(cls, major: int) -> str | None:
        """``libcudart.so.<major>``: from the loader's path, else from NVIDIA's runtime wheel of that major version
        (``nvidia-cuda-runtime-cu<major>``), e.g. for an extension built against CUDA 12 on a CUDA 13 image."""
        name = f"libcudart.so.{int(major)}"
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            return None
        except OSError as exc:
            why = str(exc)
        try:
            from importlib import metadata
            for dist in (f"nvidia-cuda-runtime-cu{int(major)}", "nvidia-cuda-runtime"):
                try:
                    files = metadata.files(dist) or []
                except metadata.PackageNotFoundError:
                    continue
                for f in files:
                    if f.name == name:
                        ctypes.CDLL(str(f.locate()), mode=ctypes.RTLD_GLOBAL)
                        return None
        except Exception as exc:  # noqa: BLE001 - a reason, not a crash
            why = f"{type(exc).__name__}: {exc}"
        return f"{name} was not found ({why}): install nvidia-cuda-runtime-cu{int(major)}"

    def versions(self) -> dict[str, str]:
        out: dict[str, str] = {}

        def put(key: str, fn: Callable[[], object]) -> None:
            try:
                out[key] = str(fn())
            except Exception as exc:
                out[key] = f"unavailable ({type(exc).__name__}: {exc})"

        put("cuda driver", lambda: cuda_version_str(self._driver_ver()))

        def nvml_driver():
            import pynvml
            pynvml.nvmlInit()
            try:
                v = pynvml.nvmlSystemGetDriverVersion()
                return v.decode() if isinstance(v, bytes) else v
            finally:
                pynvml.nvmlShutdown()

        put("nvidia driver", nvml_driver)
        put("cuda runtime (cupy)", lambda: cuda_version_str(_cupy()[1].runtimeGetVersion()))
        put("cupy", lambda: _cupy()[0].__version__)
        put("cuda-bindings", lambda: __import__("cuda.bindings", fromlist=["__version__"]).__version__)
        put("nvidia-ml-py", lambda: package_version("nvidia-ml-py") or "not installed")
        put("torch", lambda: __import__("torch").__version__)
        put("torch cuda", lambda: __import__("torch").version.cuda)
        return out

    # ---- memory ----
    def alloc(self, nbytes: int, device: int) -> DeviceBuffer:
        self._check_open()
        device = self._check_device(device)
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or int(nbytes) <= 0:
            raise BadInput(f"cannot allocate {nbytes!r} bytes: the size must be a positive integer")
        size = alloc_bytes(int(nbytes))
        _, rt, _ = _cupy()
        ptr = self._rt(device, rt.malloc, size, doing=f"allocating {size} bytes on cuda:{device}")
        return DeviceBuffer(self, device, int(ptr), int(nbytes), impl="cudaMalloc", allocated_bytes=size)

    def _free(self, buf: DeviceBuffer) -> None:
        _, rt, _ = _cupy()
        self._rt(buf.device, rt.free, buf.ptr, doing=f"freeing {buf!r}")

    def export_handle(self, buf: DeviceBuffer) -> IpcHandle:
        if not isinstance(buf, DeviceBuffer) or getattr(buf.platform, "name", None) != self.name:
            raise BadInput(f"{buf!r} is not a CUDA buffer")
        if buf.closed:
            raise BadInput(f"cannot export {buf!r}: it is freed")
        _, rt, _ = _cupy()
        payload = self._rt(buf.device, rt.ipcGetMemHandle, buf.ptr, doing=f"exporting an IPC handle of {buf!r}")
        payload = bytes(payload)
        if len(payload) != IPC_HANDLE_BYTES:
            raise DriverError("cudaIpcGetMemHandle", "UNEXPECTED_HANDLE_SIZE", -1,
                              f"exporting an IPC handle of {buf!r}",
                              f"got {len(payload)} bytes, expected {IPC_HANDLE_BYTES}")
        return IpcHandle(self.name, buf.device, buf.nbytes, payload, os.getpid())

    def allocation_range(self, ptr: int, device: int) -> tuple[int, int] | None:
        """``cuMemGetAddressRange``: the allocation (or IPC mapping) holding ``ptr``."""
        device = self._check_device(device)
        with self._on(device):
            base, size = _cu(_driver().cuMemGetAddressRange, int(ptr),
                             doing=f"finding the allocation holding 0x{int(ptr):x} on cuda:{device}")
        return int(base), int(size)

    def _pointer_attr(self, name: str, ptr: int, device: int):
        """``cuPointerGetAttribute(name, ptr)``, or None where this driver binding lacks the attribute."""
        drv = _driver()
        attr = getattr(drv.CUpointer_attribute, name, None)
        if attr is None:
            return None
        return _cu(drv.cuPointerGetAttribute, attr, int(ptr),
                   doing=f"reading {name} of 0x{int(ptr):x} on cuda:{device}")

    def export_range(self, ptr: int, nbytes: int, device: int) -> ExportedRange:
        """The IPC handle of the ``cudaMalloc`` allocation holding ``[ptr, ptr + nbytes)`` (a torch
        caching-allocator block lies in one) and the range's offset in it.

        ``cuPointerGetAttribute`` checks the memory first: device memory of ``device``, not managed,
        and legacy-IPC capable (``CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE``; memory from
        ``cuMemCreate``, such as torch's expandable segments, is not); ``cuMemGetAddressRange``
        gives the allocation; ``cudaIpcGetMemHandle`` exports its base.
        """
        self._check_open()
        device = self._check_device(device)
        ptr, nbytes = int(ptr), int(nbytes)
        what = f"memory [0x{ptr:x}, +{nbytes}) on cuda:{device}"
        with self._on(device):
            try:
                mtype = self._pointer_attr("CU_POINTER_ATTRIBUTE_MEMORY_TYPE", ptr, device)
            except DriverError as exc:
                raise NotExportable(what, f"the driver does not know the pointer ({exc.status_name})") from exc
            if mtype is not None and int(mtype) != CU_MEMORYTYPE_DEVICE:
                raise NotExportable(what, f"it is not device memory (memory type {int(mtype)})")
            ordinal = self._pointer_attr("CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL", ptr, device)
            if ordinal is not None and int(ordinal) != device:
                raise BadInput(f"{what} is memory of cuda:{int(ordinal)}, not of cuda:{device}")
            managed = self._pointer_attr("CU_POINTER_ATTRIBUTE_IS_MANAGED", ptr, device)
            if managed:
                raise NotExportable(what, "it is managed (unified) memory")
            capable = self._pointer_attr("CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE", ptr, device)
            if capable is not None and not int(capable):
                raise NotExportable(what, "it is not legacy-IPC capable: a virtual-memory allocation "
                                          "(cuMemCreate), e.g. torch's expandable segments "
                                          "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True); allocate the KV "
                                          "caches without expandable segments")
        base, size = self.allocation_range(ptr, device)
        if nbytes < 0 or ptr + nbytes > base + size:
            raise NotExportable(what, f"it runs past the end of its allocation [0x{base:x}, +{size})")
        _, rt, _ = _cupy()
        payload = bytes(self._rt(device, rt.ipcGetMemHandle, base,
                                 doing=f"exporting an IPC handle of the allocation [0x{base:x}, +{size}) "
                                       f"on cuda:{device}"))
        if len(payload) != IPC_HANDLE_BYTES:
            raise DriverError("cudaIpcGetMemHandle", "UNEXPECTED_HANDLE_SIZE", -1, f"exporting {what}",
                              f"got {len(payload)} bytes, expected {IPC_HANDLE_BYTES}")
        return ExportedRange(IpcHandle(self.name, device, size, payload, os.getpid()), ptr - base)

    def open_handle(self, handle: IpcHandle, device: int) -> PeerMapping:
        self._check_open()
        device = self._check_device(device)
        if not isinstance(handle, IpcHandle) or handle.platform != self.name:
            raise BadInput(f"not a CUDA IPC handle: {handle!r}")
        if len(handle.payload) != IPC_HANDLE_BYTES:
            raise BadInput(f"a CUDA IPC handle holds {IPC_HANDLE_BYTES} bytes, this one {len(handle.payload)}")
        if handle.owner_pid == os.getpid():
            raise BadInput("cannot open an IPC handle in the process that exported it (CUDA refuses "
                           "cudaIpcOpenMemHandle there): use the DeviceBuffer itself")
        # A context opens an allocation's handle once: a second open of the same handle shares the
        # first mapping (counted), and the last close unmaps it.
        key = (device, bytes(handle.payload))
        with self._lock:
            entry = self._ipc_open.get(key)
            if entry is not None:
                entry[1] += 1
                return PeerMapping(self, device, entry[0], handle, impl=key)
            _, rt, _ = _cupy()
            ptr = self._rt(device, rt.ipcOpenMemHandle, bytes(handle.payload), rt.cudaIpcMemLazyEnablePeerAccess,
                           doing=(f"opening on cuda:{device} the IPC handle of device {handle.device} of pid "
                                  f"{handle.owner_pid} ({handle.nbytes} bytes)"))
            self._ipc_open[key] = [int(ptr), 1]
        return PeerMapping(self, device, int(ptr), handle, impl=key)

    def _close_mapping(self, mapping: PeerMapping) -> None:
        with self._lock:
            entry = self._ipc_open.get(mapping.impl)
            if entry is not None:
                entry[1] -= 1
                if entry[1] > 0:
                    return
                del self._ipc_open[mapping.impl]
        _, rt, _ = _cupy()
        self._rt(mapping.device, rt.ipcCloseMemHandle, mapping.ptr, doing=f"closing {mapping!r}")

    def as_tensor(self, mem: Memory, dtype=None, shape: Sequence[int] | None = None, offset: int = 0):
        import torch
        if not isinstance(mem, Memory) or getattr(mem.platform, "name", None) != self.name:
            raise BadInput(f"{mem!r} is not CUDA memory")
        if mem.closed:
            raise BadInput(f"cannot view {mem!r}: it is closed")
        dt = _torch_dtype(dtype)
        item = torch.empty((), dtype=dt).element_size()
        if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or not 0 <= offset <= mem.nbytes:
            raise BadInput(f"offset {offset!r} lies outside {mem!r}")
        offset = int(offset)
        if offset % item:
            raise BadInput(f"offset {offset} is not a multiple of the {dt} item size ({item} bytes)")
        if shape is None:
            shape = ((mem.nbytes - offset) // item,)
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise BadInput(f"negative size in shape {shape}")
        count = int(np.prod(shape, dtype=np.int64)) * item
        mem.check_range(offset, count, f"a {dt} tensor of shape {shape} at byte offset {offset}")
        dev = torch.device("cuda", mem.device)
        if count == 0:
            return torch.empty(shape, dtype=dt, device=dev)
        want = mem.ptr + offset
        flat = None
        if not (isinstance(mem, PeerMapping) and self._cai_views_peers is False):
            try:
                flat = torch.as_tensor(_CudaArray(want, count, mem), device=dev)
            except Exception:
                flat = None
            ok = flat is not None and flat.data_ptr() == want and flat.device == dev
            if isinstance(mem, PeerMapping):
                self._cai_views_peers = ok
            if not ok:
                flat = None
        if flat is None:
            # This torch resolved the device from the pointer (an IPC mapping can report the
            # exporter's device) and made a copy: view it through a non-owning storage instead.
            flat = _view_by_storage(want, count, dev)
        if flat.data_ptr() != want or flat.device != dev:
            raise GpuxferError(f"torch did not view {mem!r} in place (got {flat.device}, "
                               f"0x{flat.data_ptr():x}; wanted {dev}, 0x{want:x})")
        return flat.view(dt).reshape(shape)

    # ---- streams and events ----
    def create_stream(self, device: int) -> CudaStream:
        """A dedicated non-blocking stream on ``device`` (not one of torch's pooled streams)."""
        import torch
        self._check_open()
        device = self._check_device(device)
        drv = _driver()
        with self._on(device):
            handle = int(_cu(drv.cuStreamCreate, CU_STREAM_NON_BLOCKING,
                             doing=f"creating a non-blocking stream on cuda:{device}"))
        try:
            ts = torch.cuda.ExternalStream(handle, device=torch.device("cuda", device))
        except Exception:
            with self._on(device):
                _cu(drv.cuStreamDestroy, handle, doing=f"destroying stream 0x{handle:x} of cuda:{device}")
            raise
        s = CudaStream(device, handle, ts, platform=self)
        with self._lock:
            self._streams[id(s)] = s
        return s

    def _destroy_stream(self, s: CudaStream) -> None:
        with self._lock:
            self._streams.pop(id(s), None)
        with self._on(s.device):
            _cu(_driver().cuStreamDestroy, s.handle, doing=f"destroying {s!r}")

    def current_stream(self, device: int) -> CudaStream:
        """torch's current stream of ``device``: one handle lookup, then a cached wrapper (the per-step path)."""
        if type(device) is not int or device not in self._ctxs:     # known devices skip the check
            device = self._check_device(device)
        raw = self._raw_stream
        if raw is None:
            import torch
            raw = self._raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", False)
        s = self._current.get((device, raw(device))) if raw else None
        if s is None:
            import torch
            ts = torch.cuda.current_stream(device)
            s = CudaStream(device, int(ts.cuda_stream), ts)
            if len(self._current) > 64:      # streams come and go (torch.cuda.Stream()): stay bounded
                self._current.clear()
            self._current[(device, s.handle)] = s
        return s

    def record_event(self, stream: Stream, event: Event | None = None) -> CudaEvent:
        s = self._stream(stream)
        if type(event) is not CudaEvent or event.device != s.device:    # re-record: none created per step
            with self._on(s.device):
                event = CudaEvent(s.device, int(_cu(_driver().cuEventCreate, _EVENT_DISABLE_TIMING,
                                                    doing=f"creating an event on cuda:{s.device}")))
        self._stream_op(s, _driver().cuEventRecord, event.handle, s.handle,
                        doing=lambda: f"recording {event!r} on {s!r}")
        return event

    def stream_wait_event(self, stream: Stream, event: Event) -> None:
        s = self._stream(stream)
        e = event if type(event) is CudaEvent else self._event(event)
        self._stream_op(s, _driver().cuStreamWaitEvent, s.handle, e.handle, 0,
                        doing=lambda: f"making {s!r} wait for {e!r}")

    def event_query(self, event: Event) -> bool:
        e = self._event(event)
        res = _driver().cuEventQuery(e.handle)
        if int(res[0]) == CUDA_ERROR_NOT_READY:
            return False
        check(res, lambda: f"querying {e!r}", "cuEventQuery")
        return True

    def launch(self, stream: Stream, fn: Callable[[], object]) -> None:
        import torch
        s = self._stream(stream)
        if not callable(fn):
            raise BadInput(f"launch needs a callable, got {fn!r}")
        with torch.cuda.device(s.device), torch.cuda.stream(s.torch):
            fn()

    def native_stream(self, stream: Stream) -> int | None:
        """The ``CUstream`` of a created or wrapped stream; None for the default streams (their handles mean
        "the current context's", which only :meth:`launch` makes sure of)."""
        s = self._stream(stream)
        return None if s.handle in _DEFAULT_STREAM_HANDLES else s.handle

    # ---- copies ----
    def copy_async(self, stream: Stream, dst: int, src: int, nbytes: int) -> None:
        s = self._stream(stream)
        dst, src, nbytes = int(dst), int(src), int(nbytes)
        if nbytes < 0:
            raise BadInput(f"cannot copy {nbytes} bytes")
        if nbytes == 0:
            return
        self._stream_op(s, _driver().cuMemcpyAsync, dst, src, nbytes, s.handle,
                        doing=lambda: f"copying {nbytes} bytes 0x{src:x} -> 0x{dst:x} on {s!r}")

    def batch_copy_note(self) -> str:
        """How ``copy_batch_async`` runs here (for device_info notes and doctor)."""
        impl = self._batch_impl()
        if impl[0] == "ctypes":
            return (f"copy_batch_async: cuMemcpyBatchAsync through its driver entry point (ABI {impl[2]}), "
                    f"up to {self.batch_max_per_call} copies per call")
        if impl[0] == "bindings":
            return "copy_batch_async: cuMemcpyBatchAsync through cuda.bindings' wrapper"
        return f"copy_batch_async: one cuMemcpyAsync per copy ({impl[1]})"

    def _batch_impl(self) -> tuple:
        """Resolve once: ("ctypes", fn, abi) | ("bindings", None, None) | ("loop", why, None)."""
        if self._batch is not None:
            return self._batch
        with self._lock:
            if self._batch is None:
                self._batch = resolve_batch(_driver, self._driver_ver, config.get(BATCH_MODE_ENV))
            return self._batch

    def copy_batch_async(self, stream: Stream, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> None:
        """Many independent copies on ``stream`` with ``cuMemcpyBatchAsync`` (no order among them).

        srcAccessOrder=STREAM, flags=PREFER_OVERLAP_WITH_COMPUTE (copy engines), one
        attribute for every copy, at most ``batch_max_per_call`` copies per call. On
        the legacy default stream (which the API refuses) the batch runs on a proxy
        stream ordered after, and before, the legacy stream's work with events.
        Falls back to one ``cuMemcpyAsync`` per copy only where the API is missing.
        """
        s = self._stream(stream)
        chunks = plan_batch_copies(dsts, srcs, sizes, self.batch_max_per_call)
        if not chunks:
            return
        impl = self._batch_impl()
        if impl[0] == "loop":
            for d, sr, n in chunks:
                for dd, ss, nn in zip(d.tolist(), sr.tolist(), n.tolist()):
                    self.copy_async(s, dd, ss, nn)
            return
        if not s.is_legacy_default:
            with self._on(s.device):
                self._batch_on(impl, s.handle, s.device, chunks)
            return
        drv = _driver()
        proxy, ev_in, ev_out = self._proxy(s.device)
        with self._proxy_locks[s.device], self._on(s.device):
            what = f"ordering a copy batch of {s!r} through the proxy stream 0x{proxy:x}"
            _cu(drv.cuEventRecord, ev_in, s.handle, doing=what)
            _cu(drv.cuStreamWaitEvent, proxy, ev_in, 0, doing=what)
            self._batch_on(impl, proxy, s.device, chunks)
            _cu(drv.cuEventRecord, ev_out, proxy, doing=what)
            _cu(drv.cuStreamWaitEvent, s.handle, ev_out, 0, doing=what)

    def _batch_on(self, impl: tuple, handle: int, device: int, chunks) -> None:
        """Issue the chunks on stream ``handle`` (its context is current)."""
        drv = _driver()
        kind = impl[0]
        done = 0
        if kind == "ctypes":
            fn, abi = impl[1], impl[2]
            attrs = CUmemcpyAttributes(srcAccessOrder=CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                                       flags=CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE)
            attr_idx = ctypes.c_size_t(0)
            fail = ctypes.c_size_t(SIZE_MAX)
            for d, sr, n in chunks:
                fail.value = SIZE_MAX
                rc = fn(*batch_call_args(abi, d, sr, n, ctypes.addressof(attrs), ctypes.addressof(attr_idx),
                                         ctypes.addressof(fail), handle))
                status, _ = batch_status(rc)
                if int(status) != CUDA_SUCCESS:
                    f = None if abi != 12080 or fail.value == SIZE_MAX else int(fail.value)
                    self._batch_failed(status, f, done, len(d), handle, device)
                done += len(d)
            return
        attr = drv.CUmemcpyAttributes()
        attr.srcAccessOrder = drv.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        attr.flags = drv.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
        P = drv.CUdeviceptr
        for d, sr, n in chunks:
            res = drv.cuMemcpyBatchAsync([P(x) for x in d.tolist()], [P(x) for x in sr.tolist()], n.tolist(),
                                         len(d), [attr], [0], 1, handle)
            status, f = batch_status(res)
            if int(status) != CUDA_SUCCESS:
                self._batch_failed(status, f, done, len(d), handle, device)
            done += len(d)

    @staticmethod
    def _batch_failed(status, fail_idx, done: int, count: int, handle: int, device: int) -> None:
        where = "" if fail_idx is None else f", failing at copy {done + fail_idx}"
        check((status,), f"issuing copies {done}..{done + count - 1} of a batch on stream 0x{handle:x} "
                         f"of cuda:{device}{where}", "cuMemcpyBatchAsync")

    def _proxy(self, device: int) -> tuple[int, Any, Any]:
        with self._lock:
            if device not in self._proxies:
                drv = _driver()
                with self._on(device):
                    doing = f"creating the batch-copy proxy stream of cuda:{device}"
                    st = int(_cu(drv.cuStreamCreate, CU_STREAM_NON_BLOCKING, doing=doing))
                    e1 = _cu(drv.cuEventCreate, CU_EVENT_DISABLE_TIMING, doing=doing)
                    e2 = _cu(drv.cuEventCreate, CU_EVENT_DISABLE_TIMING, doing=doing)
                self._proxies[device] = (st, e1, e2)
                self._proxy_locks[device] = threading.Lock()
            return self._proxies[device]

    def memset_async(self, stream: Stream, ptr: int, value: int, nbytes: int) -> None:
        s = self._stream(stream)
        ptr, nbytes = int(ptr), int(nbytes)
        if nbytes < 0 or isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
                or not 0 <= int(value) <= 255:
            raise BadInput(f"memset of {nbytes} bytes to {value!r}: need nbytes >= 0 and a byte value")
        if nbytes == 0:
            return
        with self._on(s.device):
            _cu(_driver().cuMemsetD8Async, ptr, int(value), nbytes, s.handle,
                doing=f"setting {nbytes} bytes at 0x{ptr:x} to {int(value)} on {s!r}")

    # ---- flags ----
    def write_flag(self, stream: Stream, ptr: int, value: int) -> None:
        """``cuStreamWriteValue64`` (default flags: a fence before the write). ``ptr`` may be a peer mapping."""
        s = self._stream(stream)
        ptr = int(ptr)
        check_flag_ptr(ptr)
        v = _u64(value)
        self._stream_op(s, _driver().cuStreamWriteValue64, s.handle, ptr, v, 0,
                        doing=lambda: f"writing flag 0x{ptr:x} := {int(value)} on {s!r}")

    def wait_flag(self, stream: Stream, ptr: int, value: int) -> None:
        """``cuStreamWaitValue64`` with ``CU_STREAM_WAIT_VALUE_GEQ`` (cyclic: ``(int64)(*ptr - value) >= 0``)."""
        s = self._stream(stream)
        ptr = int(ptr)
        check_flag_ptr(ptr)
        v = _u64(value)
        drv = _driver()
        self._stream_op(s, drv.cuStreamWaitValue64, s.handle, ptr, v, _WAIT_GEQ,
                        doing=lambda: f"enqueuing a wait for flag 0x{ptr:x} >= {int(value)} on {s!r}")

    def flag_ops(self, stream: Stream, ops: np.ndarray) -> None:
        """``cuStreamBatchMemOp``: every row of ``ops`` (a ``flag_ops_array``, its rows laid out as
        ``CUstreamBatchMemOpParams``) in one driver call, resolved with ``cuGetProcAddress`` and called
        through ctypes with the array's address (no per-call conversion). Where the entry point is
        missing: one call per row (the base class)."""
        s = self._stream(stream)
        fn = self._memop
        if fn is None:
            fn = self._memop = resolve_memop(_driver)
        if fn is False:
            return super().flag_ops(stream, ops)
        entry = self._memop_arrays.get(id(ops))
        if entry is None or entry[0] is not ops:
            if (type(ops) is not np.ndarray or ops.dtype != np.uint64 or ops.ndim != 2
                    or ops.shape[1] != FLAG_OP_WORDS or not ops.flags.c_contiguous or not 0 < len(ops) <= 256):
                raise BadInput(f"flag_ops needs a flag_ops_array (1-256 rows of {FLAG_OP_WORDS} uint64 words)")
            if len(self._memop_arrays) > 64:
                self._memop_arrays.clear()
            entry = self._memop_arrays[id(ops)] = (ops, ops.ctypes.data, len(ops))
        _, addr, n = entry
        if s.handle in _DEFAULT_STREAM_HANDLES and self._count != 1 and not self._is_current(s.device):
            with self._on(s.device):
                rc = fn(s.handle, n, addr, 0)
        else:
            rc = fn(s.handle, n, addr, 0)
            if rc == _ERR_INVALID_CONTEXT:
                with self._on(s.device):
                    rc = fn(s.handle, n, addr, 0)
        if rc:
            check(rc, lambda: f"queueing {n} flag operations on {s!r}", "cuStreamBatchMemOp")

    def _helper(self, device: int) -> _Helper:
        h = self._helpers.get(device)
        if h is not None:
            return h
        with self._lock:
            if device not in self._helpers:
                drv = _driver()
                with self._on(device):
                    st = int(_cu(drv.cuStreamCreate, CU_STREAM_NON_BLOCKING,
                                 doing=f"creating the flag helper stream of cuda:{device}"))
                    try:
                        host = int(_cu(drv.cuMemHostAlloc, 64, CU_MEMHOSTALLOC_PORTABLE,
                                       doing=f"allocating pinned memory for host flag access on cuda:{device}"))
                    except Exception:
                        _cu(drv.cuStreamDestroy, st, doing="destroying the flag helper stream")
                        raise
                self._helpers[device] = _Helper(st, host)
            return self._helpers[device]

    def _finish_helper(self, h: _Helper, device: int, ptr: int, what: str, expected: int) -> None:
        """Poll the helper stream alone until its copy is done; TransferTimeout past host_op_timeout_s."""
        drv = _driver()
        deadline = time.monotonic() + self.host_op_timeout_s
        spins, delay = 0, 2e-6
        while True:
            (err,) = drv.cuStreamQuery(h.stream)
            if int(err) == CUDA_SUCCESS:
                return
            if int(err) != CUDA_ERROR_NOT_READY:
                check((err,), f"{what} of flag 0x{ptr:x} on cuda:{device}", "cuStreamQuery")
            if time.monotonic() > deadline:
                raise TransferTimeout(rank=-1, step=-1, flag=f"0x{ptr:x}", expected=expected, seen=None,
                                      timeout_s=self.host_op_timeout_s,
                                      what=f"{what} on cuda:{device}'s helper stream did not finish: the "
                                           "device's copy queue is blocked")
            spins += 1
            if spins > 200:
                time.sleep(delay)
                delay = min(delay * 2, 1e-3)

    def read_flag(self, ptr: int, device: int) -> int:
        """An 8-byte device-to-host copy on the device's helper stream, polled with a timeout."""
        ptr = int(ptr)
        check_flag_ptr(ptr)
        device = self._check_device(device)
        h = self._helper(device)
        with h.lock, self._on(device), _RelaxedCapture():
            _cu(_driver().cuMemcpyDtoHAsync, h.host_ptr, ptr, 8, h.stream,
                doing=f"reading flag 0x{ptr:x} from the host (cuda:{device})")
            self._finish_helper(h, device, ptr, "a host read", -1)
            return ctypes.c_int64.from_address(h.host_ptr).value

    def host_write_flag(self, ptr: int, value: int, device: int) -> None:
        """An 8-byte host-to-device copy on the device's helper stream, waited for with a timeout."""
        ptr = int(ptr)
        check_flag_ptr(ptr)
        v = _u64(value)
        device = self._check_device(device)
        h = self._helper(device)
        with h.lock, self._on(device), _RelaxedCapture():
            ctypes.c_uint64.from_address(h.host_ptr + 8).value = v
            _cu(_driver().cuMemcpyHtoDAsync, ptr, h.host_ptr + 8, 8, h.stream,
                doing=f"writing flag 0x{ptr:x} := {int(value)} from the host (cuda:{device})")
            self._finish_helper(h, device, ptr, "a host write", int(value))

    # ---- graph capture ----
    def is_capturing(self, stream: Stream) -> bool:
        """``cuStreamIsCapturing``: True while ``stream`` records a graph (an invalidated capture included)."""
        s = self._stream(stream)
        with self._on(s.device):
            status = _cu(_driver().cuStreamIsCapturing, s.handle, doing=lambda: f"asking whether {s!r} captures")
        return int(status) != 0      # CU_STREAM_CAPTURE_STATUS_NONE

    def capture_graph(self, stream: Stream, record: Callable[[Stream], object]) -> CudaGraph:
        """Stream capture (thread-local mode) of what ``record(stream)`` enqueues, instantiated."""
        s = self._stream(stream)
        if not s.owned:
            raise BadInput(f"capture_graph needs a stream of create_stream, got {s!r}")
        drv = _driver()
        with self._on(s.device):
            _cu(drv.cuStreamBeginCapture, s.handle, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                doing=lambda: f"starting a capture on {s!r}")
            try:
                record(s)
            except BaseException:
                res = drv.cuStreamEndCapture(s.handle)
                if int(res[0]) == CUDA_SUCCESS and len(res) > 1 and res[1] is not None:
                    drv.cuGraphDestroy(res[1])
                raise
            graph = _cu(drv.cuStreamEndCapture, s.handle, doing=lambda: f"ending the capture on {s!r}")
            try:
                exe = _cu(drv.cuGraphInstantiate, graph, 0, doing=lambda: f"instantiating a graph captured on {s!r}")
            except BaseException:
                drv.cuGraphDestroy(graph)
                raise
        return CudaGraph(s.device, graph, exe)

    def launch_graph(self, stream: Stream, graph) -> None:
        s = self._stream(stream)
        if type(graph) is not CudaGraph:
            raise BadInput(f"not a CUDA graph: {graph!r}")
        self._stream_op(s, _driver().cuGraphLaunch, graph.exe, s.handle,
                        doing=lambda: f"launching {graph!r} on {s!r}")

    # ---- a per-step path ----
    def stream_calls(self, stream: Stream) -> StreamCalls:
        """The flag and graph calls bound to ``stream``: one driver call each, through its entry point
        (``cuGetProcAddress``, the CUDA 12 ABI, called through ctypes with plain integers: no per-call
        argument objects), where the arguments are in-range integers (and a graph of this platform), with
        the stream's checks done here, once. Any other argument, and any call the driver refuses (no
        context current on this thread included), goes through the checked method, which repeats it in
        the stream's context or raises what is wrong. A default stream's handle means "the current
        context's" stream: in a process that sees several devices each call first asks the driver which
        context is current (one more entry-point call) and takes the checked method unless it is the
        device's. A driver without the entry points keeps the checked methods."""
        s = self._stream(stream)
        fns = self._step_fns
        if fns is None:
            fns = self._step_fns = resolve_step_fns(_driver)
        if not fns:
            return super().stream_calls(s)
        write, wait, launch, current = fns
        h = s.handle
        write_flag, wait_flag, launch_graph = self.write_flag, self.wait_flag, self.launch_graph
        other = None            # None, or a callable: True where another context may be current
        if h in _DEFAULT_STREAM_HANDLES and self.device_count() != 1:
            ctx, c = self._retain(s.device)[1], ctypes

            def other() -> bool:
                cur = c.c_void_p()
                return bool(current(c.byref(cur))) or cur.value != ctx

        def write_fast(ptr: int, value: int) -> None:
            if (type(ptr) is not int or ptr & 7 or type(value) is not int or not 0 <= value <= _MASK64 or s._closed
                    or (other is not None and other()) or write(h, ptr, value, 0)):
                write_flag(s, ptr, value)

        def wait_fast(ptr: int, value: int) -> None:
            if (type(ptr) is not int or ptr & 7 or type(value) is not int or not 0 <= value <= _MASK64 or s._closed
                    or (other is not None and other()) or wait(h, ptr, value, _WAIT_GEQ)):
                wait_flag(s, ptr, value)

        def launch_fast(graph) -> None:
            if (type(graph) is not CudaGraph or s._closed or (other is not None and other())
                    or launch(graph.handle, h)):
                launch_graph(s, graph)

        return StreamCalls(s, write_fast, wait_fast, launch_fast)

    def probe_stream_mem_ops(self, device: int, timeout_s: float = 10.0) -> str | None:
        """None if 64-bit stream write / wait really work on ``device``, else why not. Cached per device.

        On a fresh buffer and a fresh stream: write 7 + wait >= 7 must complete and
        read back 7; then a wait >= 1 on a zero word must hold the stream until the
        host writes 1. If a wait never completes, the buffer and stream are leaked on
        purpose (freeing them could block behind the stuck wait).
        """
        device = self._check_device(device)
        if device in self._probes:
            return self._probes[device]
        why = self._run_probe(device, timeout_s)
        with self._lock:
            self._probes.setdefault(device, why)
        return self._probes[device]

    def _run_probe(self, device: int, timeout_s: float) -> str | None:
        try:
            buf = self.alloc(64, device)
        except GpuxferError as exc:
            return f"could not allocate the probe buffer: {exc}"
        stream = None
        stuck = False
        try:
            stream = self.create_stream(device)
            self.memset_async(stream, buf.ptr, 0, 64)
            self.write_flag(stream, buf.ptr, 7)
            self.wait_flag(stream, buf.ptr, 7)
            if not self.event_wait(self.record_event(stream), timeout_s):
                stuck = True
                return f"a stream write of 7 then a wait for >= 7 did not complete within {timeout_s:g} s"
            seen = self.read_flag(buf.ptr, device)
            if seen != 7:
                return f"cuStreamWriteValue64 wrote nothing visible: read back {seen}, expected 7"
            self.wait_flag(stream, buf.ptr + 8, 1)
            held = self.record_event(stream)
            time.sleep(0.005)
            if self.event_query(held):
                return "cuStreamWaitValue64 did not hold the stream (a wait for >= 1 on a zero word completed)"
            self.host_write_flag(buf.ptr + 8, 1, device)
            if not self.event_wait(held, timeout_s):
                stuck = True
                return f"a stream wait was not released within {timeout_s:g} s of the host writing the flag"
            return None
        except GpuxferError as exc:
            return f"{exc}"
        finally:
            if stuck:
                try:   # try to let it go; leak the buffer and stream either way
                    self.host_write_flag(buf.ptr, RELEASE_VALUE, device)
                    self.host_write_flag(buf.ptr + 8, RELEASE_VALUE, device)
                except Exception:
                    pass
                buf._closed = True          # leaked on purpose: freeing could block behind the wait
            else:
                if stream is not None:
                    stream.close()
                buf.close()

    # ---- lifetime ----
    @property
    def closed(self) -> bool:
        return self._closed_platform

    def close(self) -> None:
        """Destroy owned and helper streams, free pinned memory, release primary contexts. Idempotent.

        Streams created here become unusable; buffers and mappings stay valid (close them
        before exiting).
        """
        with self._lock:
            if self._closed_platform:
                return
            self._closed_platform = True
            streams = list(self._streams.values())
            self._streams.clear()
            helpers, self._helpers = self._helpers, {}
            proxies, self._proxies = self._proxies, {}
            ctxs, self._ctxs = self._ctxs, {}
        if not (streams or helpers or proxies or ctxs):
            return
        drv = _driver()
        errors: list[BaseException] = []

        def attempt(fn: Callable, *args, doing: str) -> None:
            try:
                _cu(fn, *args, doing=doing)
            except Exception as exc:  # keep releasing the rest, report the first failure
                errors.append(exc)

        for dev in sorted({s.device for s in streams} | set(helpers) | set(proxies)):
            if dev not in ctxs:
                continue
            try:
                with _OnDeviceCtx(ctxs[dev][0]):
                    for s in streams:
                        if s.device == dev:
                            s._closed = True
                            attempt(drv.cuStreamDestroy, s.handle, doing=f"destroying {s!r}")
                    if dev in helpers:
                        attempt(drv.cuStreamDestroy, helpers[dev].stream,
                                doing=f"destroying the flag helper stream of cuda:{dev}")
                        attempt(drv.cuMemFreeHost, helpers[dev].host_ptr,
                                doing=f"freeing the pinned flag memory of cuda:{dev}")
                    if dev in proxies:
                        st, e1, e2 = proxies[dev]
                        attempt(drv.cuStreamDestroy, st, doing=f"destroying the proxy stream of cuda:{dev}")
                        attempt(drv.cuEventDestroy, e1, doing="destroying a proxy event")
                        attempt(drv.cuEventDestroy, e2, doing="destroying a proxy event")
            except Exception as exc:
                errors.append(exc)
        for dev in sorted(ctxs):
            attempt(drv.cuDevicePrimaryCtxRelease, dev, doing=f"releasing the primary context of cuda:{dev}")
        if errors:
            raise errors[0]

    def __repr__(self) -> str:
        return f"CudaPlatform({'closed' if self._closed_platform else 'open'})"


class _OnDeviceCtx:
    """Push a given context for the block (used by close(), after the context table is cleared)."""

    def __init__(self, ctx):
        self._ctx = ctx

    def __enter__(self):
        _cu(_driver().cuCtxPushCurrent, self._ctx, doing="making a context current to release its resources")
        return self

    def __exit__(self, *exc) -> None:
        _cu(_driver().cuCtxPopCurrent, doing="restoring the caller's context")
