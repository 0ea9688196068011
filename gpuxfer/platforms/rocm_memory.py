"""ROCm memory: raw ``hipExtMallocWithFlags`` buffers (default, uncached flag words, signal words), IPC
handles exported and opened (an allocation opened once per device, shared by later opens), ranges of
torch's allocations exported, and zero-copy torch views. Mixed into
:class:`~gpuxfer.platforms.rocm.RocmPlatform`.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from ..common import exported_here, process_namespace
from ..errors import BadInput, DriverError, NotExportable
from .base import DeviceBuffer, ExportedRange, IpcHandle, Memory, PeerMapping
from .rocm_hip import (HIP_DEVICE_MALLOC_DEFAULT, HIP_DEVICE_MALLOC_UNCACHED, HIP_IPC_MEM_LAZY_ENABLE_PEER_ACCESS,
                       HIP_MALLOC_SIGNAL_MEMORY, handle_bytes, handle_from_bytes, hip_first)
from .rocm_sdma import SignalMemory
from .views import tensor_view_params


class _CudaArrayInterface:
    """The minimal ``__cuda_array_interface__`` (v3) torch needs to alias device memory."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None, "stream": None}


class _RocmMemory:
    """The memory hooks of :class:`~gpuxfer.platforms.rocm.RocmPlatform` (its state, checks and calls:
    ``_lock``, ``_own``, ``_ipc_open``, ``_peer_ranges``, ``_api``, ``hip``, ``hsa``, ``_check_open``,
    ``_check_device``, ``_on_device``)."""

    # ---- memory ----
    def _malloc(self, nbytes: int, device: int, flags: int, what: str) -> tuple[int, Any]:
        self._check_open()
        device = self._check_device(device)
        if not isinstance(nbytes, (int, np.integer)) or int(nbytes) <= 0:
            raise BadInput(f"cannot allocate {nbytes!r} bytes: the size must be a positive integer")
        with self._on_device(device):
            arr = hip_first(self._api("hipExtMallocWithFlags", int(nbytes), flags,
                                      doing=f"allocating {nbytes} B of {what} on device {device}"))
        ptr = int(arr)
        with self._lock:
            self._own[ptr] = (device, int(nbytes))
        return ptr, arr

    def alloc(self, nbytes: int, device: int) -> DeviceBuffer:
        ptr, arr = self._malloc(nbytes, device, HIP_DEVICE_MALLOC_DEFAULT, "device memory")
        return DeviceBuffer(self, device, ptr, int(nbytes), impl=arr)

    def alloc_flags(self, nbytes: int, device: int) -> DeviceBuffer:
        """Uncached device memory for flag words (exportable like :meth:`alloc`)."""
        ptr, arr = self._malloc(nbytes, device, HIP_DEVICE_MALLOC_UNCACHED, "uncached flag memory")
        return DeviceBuffer(self, device, ptr, int(nbytes), impl=arr)

    def alloc_signal(self, device: int) -> SignalMemory:
        """A ``hipMallocSignalMemory`` word (value 1) and its HSA signal handle, checked with ROCr."""
        ptr, arr = self._malloc(8, device, HIP_MALLOC_SIGNAL_MEMORY, "signal memory")
        sig = SignalMemory(self, device, ptr, ptr - 8, impl=arr)
        try:
            from .hsa import Signal
            seen = self.hsa().signal_value_pointer(Signal(sig.handle))
            if seen != ptr:
                raise DriverError("hsa_amd_signal_value_pointer", "LAYOUT_MISMATCH", -1,
                                  "checking that a hipMallocSignalMemory word is the value of signal (ptr - 8)",
                                  f"ROCr says the value of signal 0x{sig.handle:x} lives at 0x{seen:x}, not 0x{ptr:x}")
        except BaseException:
            sig.close()
            raise
        return sig

    def _free_raw(self, ptr: int, device: int, what: str) -> None:
        with self._lock:
            self._own.pop(ptr, None)
        self._api("hipFree", ptr, doing=f"freeing {what} at 0x{ptr:x} on device {device}")

    def _free(self, buf: DeviceBuffer) -> None:
        self._free_raw(buf.ptr, buf.device, f"{buf.nbytes} B")

    def export_handle(self, buf: DeviceBuffer) -> IpcHandle:
        if buf.platform is not self:
            raise BadInput(f"{buf!r} was not allocated by this ROCm platform")
        if buf.closed:
            raise BadInput(f"cannot export {buf!r}: it is freed")
        h = hip_first(self._api("hipIpcGetMemHandle", buf.ptr,
                                doing=f"exporting an IPC handle of {buf.nbytes} B on device {buf.device}"))
        return IpcHandle(self.name, buf.device, buf.nbytes, handle_bytes(h), os.getpid(), process_namespace())

    def allocation_range(self, ptr: int, device: int) -> tuple[int, int] | None:
        """``hipMemGetAddressRange``: the allocation (or IPC mapping) holding ``ptr``."""
        device = self._check_device(device)
        with self._on_device(device):
            outs = self._api("hipMemGetAddressRange", int(ptr),
                             doing=f"finding the allocation holding 0x{int(ptr):x} on device {device}")
        if len(outs) != 2:
            raise DriverError("hipMemGetAddressRange", "UNEXPECTED_RESULT", -1, "reading an allocation range",
                              f"hip-python returned {outs!r}")
        return int(outs[0]), int(outs[1])

    def export_range(self, ptr: int, nbytes: int, device: int, within: tuple[int, int] | None = None
                     ) -> ExportedRange:
        """The IPC handle of the ``hipMalloc`` allocation holding ``[ptr, ptr + nbytes)`` (a torch
        caching-allocator block lies in one) and the range's offset in it (``hipMemGetAddressRange``,
        then ``hipIpcGetMemHandle`` on its base)."""
        self._check_open()
        device = self._check_device(device)
        ptr, nbytes = int(ptr), int(nbytes)
        what = f"memory [0x{ptr:x}, +{nbytes}) on device {device}"
        try:
            base, size = self.allocation_range(ptr, device)
        except DriverError as exc:
            raise NotExportable(what, f"HIP does not know the pointer ({exc.status_name})") from exc
        if nbytes < 0 or ptr + nbytes > base + size:
            raise NotExportable(what, f"it runs past the end of its allocation [0x{base:x}, +{size})")
        try:
            h = hip_first(self._api("hipIpcGetMemHandle", base,
                                    doing=f"exporting an IPC handle of the allocation [0x{base:x}, +{size})"))
        except DriverError as exc:
            raise NotExportable(what, f"hipIpcGetMemHandle refused its allocation ({exc.status_name}): "
                                      "virtual-memory allocations cannot be exported this way") from exc
        return ExportedRange(IpcHandle(self.name, device, size, handle_bytes(h), os.getpid(), process_namespace()), ptr - base)

    def open_handle(self, handle: IpcHandle, device: int) -> PeerMapping:
        self._check_open()
        device = self._check_device(device)
        if handle.platform != self.name:
            raise BadInput(f"a {handle.platform!r} IPC handle cannot be opened on ROCm")
        if exported_here(handle.owner_pid, handle.owner_namespace):
            raise BadInput("cannot open an IPC handle in the process that exported it (HIP returns "
                           "hipErrorInvalidContext): use the DeviceBuffer itself")
        # an allocation's handle is opened once per device: a second open shares the first mapping
        # (counted), and the last close unmaps it
        key = (device, bytes(handle.payload))
        with self._lock:
            entry = self._ipc_open.get(key)
            if entry is not None:
                entry[1] += 1
                self._peer_ranges[entry[0]] = max(self._peer_ranges.get(entry[0], 0), entry[0] + handle.nbytes)
                return PeerMapping(self, device, entry[0], handle, impl=key)
        h = handle_from_bytes(self.hip, handle.payload)
        with self._on_device(device):
            p = hip_first(self._api("hipIpcOpenMemHandle", h, HIP_IPC_MEM_LAZY_ENABLE_PEER_ACCESS,
                                    doing=f"opening the IPC handle of device {handle.device} of pid "
                                          f"{handle.owner_pid} ({handle.nbytes} B) on device {device}"))
        ptr = int(p)
        with self._lock:
            self._peer_ranges[ptr] = ptr + handle.nbytes
            self._ipc_open[key] = [ptr, 1]
        return PeerMapping(self, device, ptr, handle, impl=key)

    def _close_mapping(self, mapping: PeerMapping) -> None:
        with self._lock:
            entry = self._ipc_open.get(mapping.impl)
            if entry is not None:
                entry[1] -= 1
                if entry[1] > 0:
                    return
                del self._ipc_open[mapping.impl]
            self._peer_ranges.pop(mapping.ptr, None)
        with self._on_device(mapping.device):
            self._api("hipIpcCloseMemHandle", mapping.ptr,
                      doing=f"closing the IPC mapping of device {mapping.handle.device} on device {mapping.device}")

    def is_peer_address(self, ptr: int, device: int | None = None) -> bool:
        """Whether ``ptr`` lies in an opened peer mapping (or in our memory on another device)."""
        with self._lock:
            if any(start <= ptr < end for start, end in self._peer_ranges.items()):
                return True
            if device is not None:
                for start, (dev, n) in self._own.items():
                    if dev != device and start <= ptr < start + n:
                        return True
        return False

    def as_tensor(self, mem: Memory, dtype=None, shape: Sequence[int] | None = None, offset: int = 0):
        import torch
        if mem.platform is not self:
            raise BadInput(f"{mem!r} does not belong to this ROCm platform")
        if mem.closed:
            raise BadInput(f"cannot view {mem!r}: it is closed")
        dt, shape, count = tensor_view_params(mem, dtype, shape, offset)
        dev = torch.device("cuda", mem.device)     # torch's ROCm build keeps the "cuda" device type
        if count == 0:
            return torch.empty(shape, dtype=dt, device=dev)
        ptr = mem.ptr + int(offset)
        with torch.cuda.device(mem.device):
            flat = torch.as_tensor(_CudaArrayInterface(ptr, count), device=dev)
        if flat.data_ptr() != ptr or flat.device != dev:
            raise DriverError("torch.as_tensor", "NOT_ZERO_COPY", -1,
                              f"viewing 0x{ptr:x} ({count} B) on device {mem.device} as a tensor",
                              f"torch made a tensor at 0x{flat.data_ptr():x} on {flat.device}")
        return flat.view(dt).reshape(shape)
