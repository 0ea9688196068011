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
versions, ``close``), which builds and owns one component per concept and
hands each hook to it: :class:`~gpuxfer.platforms.cuda_driver.CudaContexts`
(devices, primary contexts, the context switches every component uses, the
driver version), :class:`~gpuxfer.platforms.cuda_memory.CudaMemory` (buffers,
IPC, tensor views), :class:`~gpuxfer.platforms.cuda_streams.CudaStreams`
(streams, events, copies, fills), :class:`~gpuxfer.platforms.cuda_flags.CudaFlags`
(flags, ``stream_calls``, the probe) and
:class:`~gpuxfer.platforms.cuda_graphs.CudaGraphs` (capture, launch). The
components import :mod:`~gpuxfer.platforms.cuda_driver` (the lazy loaders and
:func:`check`), never this module.
"""
from __future__ import annotations

import ctypes
from typing import Callable, Sequence

import numpy as np

from .. import config
from ..common import package_version
from .base import (DeviceBuffer, DeviceInfo, Event, ExportedRange, IpcHandle, LinkInfo, Memory, PeerMapping, Platform,
                   Stream, StreamCalls)
from .cuda_driver import CudaContexts, _cu, _cupy, _driver, _status_info, check
from .cuda_entry import BATCH_MAX_PER_CALL, CUDA_SUCCESS, cuda_version_str
from .cuda_flags import CudaFlags
from .cuda_graphs import CudaGraph, CudaGraphs
from .cuda_memory import LARGE_PAGE_BYTES, CudaMemory, alloc_bytes
from .cuda_streams import CudaEvent, CudaStream, CudaStreams, as_stream

__all__ = ["CudaPlatform", "CudaStream", "CudaEvent", "CudaGraph", "check", "alloc_bytes", "LARGE_PAGE_BYTES"]


# --------------------------------------------------------------------------- the platform


class CudaPlatform(Platform):
    """The contract on CUDA: CuPy runtime for memory and IPC, cuda.bindings for stream work, NVML for links.
    Built of components it owns and closes (see the module docstring's layout)."""

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
        self._contexts = CudaContexts()
        self._memory = CudaMemory(self._contexts, self)
        self._streams = CudaStreams(self._contexts, self, self.batch_max_per_call)
        self._flags = CudaFlags(self._contexts, self.host_op_timeout_s)
        self._graphs = CudaGraphs(self._contexts)
        self._links: dict[tuple[int, int], LinkInfo] = {}

    # ---- devices ----
    def device_count(self) -> int:
        return self._contexts.device_count()

    def set_device(self, device: int) -> None:
        import torch
        torch.cuda.set_device(self._contexts.check_device(device))

    def pci_bus_id(self, device: int) -> str:
        device = self._contexts.check_device(device)
        raw = _cu(_driver().cuDeviceGetPCIBusId, 64, device, doing=f"reading the PCI bus id of cuda:{device}")
        return raw.split(b"\0", 1)[0].decode().strip()

    def device_info(self, device: int) -> DeviceInfo:
        device = self._contexts.check_device(device)
        drv = _driver()
        raw = _cu(drv.cuDeviceGetName, 256, device, doing=f"reading the name of cuda:{device}")
        name = raw.split(b"\0", 1)[0].decode(errors="replace").strip()
        major = self._contexts.attr(device, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR")
        minor = self._contexts.attr(device, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR")
        total = int(_cu(drv.cuDeviceTotalMem, device, doing=f"reading the memory size of cuda:{device}"))
        with self._contexts.on(device):
            free, _ = _cu(drv.cuMemGetInfo, doing=f"reading the free memory of cuda:{device}")
        attr64 = self._contexts.attr(device, "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS")
        nor = self._contexts.attr(device, "CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR")
        flush = self._contexts.attr(device, "CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES")
        probe = self.probe_stream_mem_ops(device)
        notes = [f"driver CUDA {cuda_version_str(self._contexts.driver_version())}",
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
            sm_count=self._contexts.attr(device, "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT"),
            copy_engines=self._contexts.attr(device, "CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT"),
            stream_mem_ops_64=probe is None, stream_wait_nor=bool(nor), can_flush_remote_writes=bool(flush),
            notes=tuple(notes))

    def link(self, src: int, dst: int) -> LinkInfo:
        src, dst = self._contexts.check_device(src), self._contexts.check_device(dst)
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

        put("cuda driver", lambda: cuda_version_str(self._contexts.driver_version()))

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

    # ---- memory (CudaMemory) ----
    def alloc(self, nbytes: int, device: int) -> DeviceBuffer:
        return self._memory.alloc(nbytes, device)

    def _free(self, buf: DeviceBuffer) -> None:
        self._memory.free(buf)

    def export_handle(self, buf: DeviceBuffer) -> IpcHandle:
        return self._memory.export_handle(buf)

    def allocation_range(self, ptr: int, device: int) -> tuple[int, int] | None:
        return self._memory.allocation_range(ptr, device)

    def export_range(self, ptr: int, nbytes: int, device: int, within: tuple[int, int] | None = None
                     ) -> ExportedRange:
        return self._memory.export_range(ptr, nbytes, device, within)

    def open_handle(self, handle: IpcHandle, device: int) -> PeerMapping:
        return self._memory.open_handle(handle, device)

    def _close_mapping(self, mapping: PeerMapping) -> None:
        self._memory.close_mapping(mapping)

    def map_host_words(self, ptr: int, nbytes: int, device: int) -> int:
        return self._memory.map_host_words(ptr, nbytes, device)

    def unmap_host_words(self, ptr: int, device: int) -> None:
        self._memory.unmap_host_words(ptr, device)

    def as_tensor(self, mem: Memory, dtype=None, shape: Sequence[int] | None = None, offset: int = 0):
        return self._memory.as_tensor(mem, dtype, shape, offset)

    # ---- streams, events, copies (CudaStreams) ----
    def create_stream(self, device: int) -> CudaStream:
        return self._streams.create(device)

    def _destroy_stream(self, s: CudaStream) -> None:
        self._streams.destroy(s)

    def current_stream(self, device: int) -> CudaStream:
        return self._streams.current(device)

    def record_event(self, stream: Stream, event: Event | None = None) -> CudaEvent:
        return self._streams.record_event(stream, event)

    def stream_wait_event(self, stream: Stream, event: Event) -> None:
        self._streams.stream_wait_event(stream, event)

    def event_query(self, event: Event) -> bool:
        return self._streams.event_query(event)

    def launch(self, stream: Stream, fn: Callable[[], object]) -> None:
        self._streams.launch(stream, fn)

    def native_stream(self, stream: Stream) -> int | None:
        return self._streams.native_stream(stream)

    def copy_async(self, stream: Stream, dst: int, src: int, nbytes: int) -> None:
        self._streams.copy_async(stream, dst, src, nbytes)

    def copy_batch_async(self, stream: Stream, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> None:
        self._streams.copy_batch_async(stream, dsts, srcs, sizes)

    def batch_copy_note(self) -> str:
        """How ``copy_batch_async`` runs here (for device_info notes and doctor)."""
        return self._streams.batch_copy_note()

    def memset_async(self, stream: Stream, ptr: int, value: int, nbytes: int) -> None:
        self._streams.memset_async(stream, ptr, value, nbytes)

    # ---- flags (CudaFlags) ----
    def write_flag(self, stream: Stream, ptr: int, value: int) -> None:
        self._flags.write_flag(stream, ptr, value)

    def wait_flag(self, stream: Stream, ptr: int, value: int) -> None:
        self._flags.wait_flag(stream, ptr, value)

    def flag_ops(self, stream: Stream, ops: np.ndarray) -> None:
        if not self._flags.flag_ops(stream, ops):       # no cuStreamBatchMemOp: one call per row
            super().flag_ops(stream, ops)

    def read_flag(self, ptr: int, device: int) -> int:
        return self._flags.read_flag(ptr, device)

    def host_write_flag(self, ptr: int, value: int, device: int) -> None:
        self._flags.host_write_flag(ptr, value, device)

    def stream_calls(self, stream: Stream) -> StreamCalls:
        s = as_stream(stream)
        return self._flags.stream_calls(s, self) or super().stream_calls(s)

    def probe_stream_mem_ops(self, device: int, timeout_s: float = 10.0) -> str | None:
        """None if 64-bit stream write / wait really work on ``device``, else why not (cached per device;
        :func:`~gpuxfer.platforms.cuda_flags.run_probe`)."""
        return self._flags.probe(self, self._contexts.check_device(device), timeout_s)

    # ---- graphs (CudaGraphs) ----
    def is_capturing(self, stream: Stream) -> bool:
        return self._graphs.is_capturing(stream)

    def capture_graph(self, stream: Stream, record: Callable[[Stream], object]) -> CudaGraph:
        return self._graphs.capture(stream, record)

    def launch_graph(self, stream: Stream, graph) -> None:
        self._graphs.launch(stream, graph)

    # ---- lifetime ----
    @property
    def closed(self) -> bool:
        return self._contexts.closed

    def close(self) -> None:
        """Destroy owned and helper streams, free pinned memory, release primary contexts. Idempotent.

        Streams created here become unusable; buffers and mappings stay valid (close them
        before exiting).
        """
        release = self._contexts.detach()
        if release is None:
            return
        self._streams.close(release)
        self._flags.close(release)
        release.finish()

    def __repr__(self) -> str:
        return f"CudaPlatform({'closed' if self.closed else 'open'})"
