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

Layout: this module holds :class:`CudaPlatform` (detection, devices, links,
versions, the context switches every hook uses, ``close``); its hooks come from
one mixin per concept: :mod:`~gpuxfer.platforms.cuda_memory` (buffers, IPC,
tensor views), :mod:`~gpuxfer.platforms.cuda_streams` (streams, events, copies,
fills), :mod:`~gpuxfer.platforms.cuda_flags` (flags, ``stream_calls``, the
probe) and :mod:`~gpuxfer.platforms.cuda_graphs` (capture, launch), over
:mod:`~gpuxfer.platforms.cuda_driver` (the lazy loaders and :func:`check`).
"""
from __future__ import annotations

import ctypes
import threading
from typing import Any, Callable

import numpy as np

from .. import config
from ..common import package_version
from ..errors import BadInput
from .base import DeviceInfo, LinkInfo, Platform
from .cuda_driver import (_DEFAULT_STREAM_HANDLES, _ERR_INVALID_CONTEXT, _OnDevice, _OnDeviceCtx, _cu, _cupy,
                          _driver, _runtime_api_name, _status_info, check)
from .cuda_entry import BATCH_MAX_PER_CALL, CUDA_SUCCESS, cuda_version_str
from .cuda_flags import _CudaFlags, _Helper
from .cuda_graphs import CudaGraph, _CudaGraphs
from .cuda_memory import LARGE_PAGE_BYTES, _CudaMemory, alloc_bytes
from .cuda_streams import CudaEvent, CudaStream, _CudaStreams, _EventPool

__all__ = ["CudaPlatform", "CudaStream", "CudaEvent", "CudaGraph", "check", "alloc_bytes", "LARGE_PAGE_BYTES"]


# --------------------------------------------------------------------------- the platform


class CudaPlatform(_CudaMemory, _CudaStreams, _CudaFlags, _CudaGraphs, Platform):
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
                vis = config.get("CUDA_VISIBLE_DEVICES")
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
        self._events = _EventPool()                         # spare events for record_event
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
        self._events.close()
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
