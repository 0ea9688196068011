"""CUDA memory: raw ``cudaMalloc`` buffers in whole large pages, IPC handles exported and opened
(an allocation opened once per context, shared by later opens), ranges of torch's allocations exported,
and zero-copy torch views: :class:`CudaMemory`, a component of :class:`~gpuxfer.platforms.cuda.CudaPlatform`.
"""
from __future__ import annotations

import os
import threading
from typing import Sequence

import numpy as np

from ..common import exported_here, process_namespace
from ..errors import BadInput, DriverError, GpuxferError, NotExportable
from .base import DeviceBuffer, ExportedRange, IpcHandle, Memory, PeerMapping, Platform
from .cuda_driver import CU_MEMORYTYPE_DEVICE, CudaContexts, _cu, _cupy, _driver
from .views import view_shape

IPC_HANDLE_BYTES = 64
CU_MEMHOSTREGISTER_PORTABLE = 1
CU_MEMHOSTREGISTER_DEVICEMAP = 2


class _CudaArray:
    """A minimal ``__cuda_array_interface__`` (v3) exporter over raw device bytes."""

    __slots__ = ("__cuda_array_interface__", "_keep")

    def __init__(self, ptr: int, nbytes: int, keep: object):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 3}
        self._keep = keep   # the Memory object, for as long as the tensor lives


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


class CudaMemory:
    """The buffers and mappings of a :class:`~gpuxfer.platforms.cuda.CudaPlatform` (``owner``: the platform
    they belong to, whose ``_free`` / ``_close_mapping`` come back here): allocation, IPC export and open (an
    allocation's handle opened once per device, counted), host memory mapped for the device, tensor views."""

    name = "cuda"

    def __init__(self, contexts: CudaContexts, owner: Platform):
        self._ctx = contexts
        self._owner = owner
        self._lock = threading.Lock()
        self._ipc_open: dict[tuple[int, bytes], list] = {}  # (device, handle) -> [mapped pointer, open count]
        self._cai_views_peers: bool | None = None          # does __cuda_array_interface__ view IPC mappings?

    def alloc(self, nbytes: int, device: int) -> DeviceBuffer:
        self._ctx.check_open()
        device = self._ctx.check_device(device)
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or int(nbytes) <= 0:
            raise BadInput(f"cannot allocate {nbytes!r} bytes: the size must be a positive integer")
        size = alloc_bytes(int(nbytes))
        _, rt, _ = _cupy()
        ptr = self._ctx.rt(device, rt.malloc, size, doing=f"allocating {size} bytes on cuda:{device}")
        return DeviceBuffer(self._owner, device, int(ptr), int(nbytes), impl="cudaMalloc", allocated_bytes=size)

    def free(self, buf: DeviceBuffer) -> None:
        _, rt, _ = _cupy()
        self._ctx.rt(buf.device, rt.free, buf.ptr, doing=f"freeing {buf!r}")

    def export_handle(self, buf: DeviceBuffer) -> IpcHandle:
        if not isinstance(buf, DeviceBuffer) or getattr(buf.platform, "name", None) != self.name:
            raise BadInput(f"{buf!r} is not a CUDA buffer")
        if buf.closed:
            raise BadInput(f"cannot export {buf!r}: it is freed")
        _, rt, _ = _cupy()
        payload = self._ctx.rt(buf.device, rt.ipcGetMemHandle, buf.ptr, doing=f"exporting an IPC handle of {buf!r}")
        payload = bytes(payload)
        if len(payload) != IPC_HANDLE_BYTES:
            raise DriverError("cudaIpcGetMemHandle", "UNEXPECTED_HANDLE_SIZE", -1,
                              f"exporting an IPC handle of {buf!r}",
                              f"got {len(payload)} bytes, expected {IPC_HANDLE_BYTES}")
        return IpcHandle(self.name, buf.device, buf.nbytes, payload, os.getpid(), process_namespace())

    def allocation_range(self, ptr: int, device: int) -> tuple[int, int] | None:
        """``cuMemGetAddressRange``: the allocation (or IPC mapping) holding ``ptr``."""
        device = self._ctx.check_device(device)
        with self._ctx.on(device):
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

    def export_range(self, ptr: int, nbytes: int, device: int, within: tuple[int, int] | None = None
                     ) -> ExportedRange:
        """The IPC handle of the ``cudaMalloc`` allocation holding ``[ptr, ptr + nbytes)`` (a torch
        caching-allocator block lies in one) and the range's offset in it.

        ``cuPointerGetAttribute`` checks the memory first: device memory of ``device``, not managed,
        and legacy-IPC capable (``CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE``; memory from
        ``cuMemCreate``, such as torch's expandable segments, is not); ``cuMemGetAddressRange``
        gives the allocation; ``cudaIpcGetMemHandle`` exports its base.
        """
        self._ctx.check_open()
        device = self._ctx.check_device(device)
        ptr, nbytes = int(ptr), int(nbytes)
        what = f"memory [0x{ptr:x}, +{nbytes}) on cuda:{device}"
        with self._ctx.on(device):
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
        payload = bytes(self._ctx.rt(device, rt.ipcGetMemHandle, base,
                                     doing=f"exporting an IPC handle of the allocation [0x{base:x}, +{size}) "
                                       f"on cuda:{device}"))
        if len(payload) != IPC_HANDLE_BYTES:
            raise DriverError("cudaIpcGetMemHandle", "UNEXPECTED_HANDLE_SIZE", -1, f"exporting {what}",
                              f"got {len(payload)} bytes, expected {IPC_HANDLE_BYTES}")
        return ExportedRange(IpcHandle(self.name, device, size, payload, os.getpid(), process_namespace()), ptr - base)

    def open_handle(self, handle: IpcHandle, device: int) -> PeerMapping:
        self._ctx.check_open()
        device = self._ctx.check_device(device)
        if not isinstance(handle, IpcHandle) or handle.platform != self.name:
            raise BadInput(f"not a CUDA IPC handle: {handle!r}")
        if len(handle.payload) != IPC_HANDLE_BYTES:
            raise BadInput(f"a CUDA IPC handle holds {IPC_HANDLE_BYTES} bytes, this one {len(handle.payload)}")
        if exported_here(handle.owner_pid, handle.owner_namespace):
            raise BadInput("cannot open an IPC handle in the process that exported it (CUDA refuses "
                           "cudaIpcOpenMemHandle there): use the DeviceBuffer itself")
        # A context opens an allocation's handle once: a second open of the same handle shares the
        # first mapping (counted), and the last close unmaps it.
        key = (device, bytes(handle.payload))
        with self._lock:
            entry = self._ipc_open.get(key)
            if entry is not None:
                entry[1] += 1
                return PeerMapping(self._owner, device, entry[0], handle, impl=key)
            _, rt, _ = _cupy()
            ptr = self._ctx.rt(device, rt.ipcOpenMemHandle, bytes(handle.payload), rt.cudaIpcMemLazyEnablePeerAccess,
                               doing=(f"opening on cuda:{device} the IPC handle of device {handle.device} of pid "
                                  f"{handle.owner_pid} ({handle.nbytes} bytes)"))
            self._ipc_open[key] = [int(ptr), 1]
        return PeerMapping(self._owner, device, int(ptr), handle, impl=key)

    def close_mapping(self, mapping: PeerMapping) -> None:
        with self._lock:
            entry = self._ipc_open.get(mapping.impl)
            if entry is not None:
                entry[1] -= 1
                if entry[1] > 0:
                    return
                del self._ipc_open[mapping.impl]
        _, rt, _ = _cupy()
        self._ctx.rt(mapping.device, rt.ipcCloseMemHandle, mapping.ptr, doing=f"closing {mapping!r}")

    def map_host_words(self, ptr: int, nbytes: int, device: int) -> int:
        """``cuMemHostRegister`` (portable, device-mapped) of a shared-memory mapping, and its device address
        (``cuMemHostGetDevicePointer``): stream writes, waits and copies reach it over PCIe."""
        self._ctx.check_open()
        device = self._ctx.check_device(device)
        ptr, nbytes = int(ptr), int(nbytes)
        drv = _driver()
        with self._ctx.on(device):
            _cu(drv.cuMemHostRegister, ptr, nbytes, CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP,
                doing=f"registering {nbytes} bytes of host memory at 0x{ptr:x} for cuda:{device}")
            try:
                return int(_cu(drv.cuMemHostGetDevicePointer, ptr, 0,
                               doing=f"the device address of host memory at 0x{ptr:x} on cuda:{device}"))
            except BaseException:
                _cu(drv.cuMemHostUnregister, ptr, doing=f"unregistering host memory at 0x{ptr:x}")
                raise

    def unmap_host_words(self, ptr: int, device: int) -> None:
        device = self._ctx.check_device(device)
        with self._ctx.on(device):
            _cu(_driver().cuMemHostUnregister, int(ptr), doing=f"unregistering host memory at 0x{int(ptr):x}")

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
        shape, count = view_shape(shape, item)
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
