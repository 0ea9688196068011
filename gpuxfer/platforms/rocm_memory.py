"""ROCm memory: raw ``hipExtMallocWithFlags`` buffers (default, uncached flag words, signal words), IPC
handles exported and opened (an allocation opened once per device, shared by later opens), ranges of
torch's allocations exported, and zero-copy torch views: :class:`RocmMemory`, a component of
:class:`~gpuxfer.platforms.rocm.RocmPlatform`, and the signal words it allocates (:class:`SignalMemory`).
"""
from __future__ import annotations

import os
import threading
from typing import Any, Callable, Sequence

import numpy as np

from ..common import exported_here, process_namespace
from ..errors import BadInput, DriverError, NotExportable
from .base import Closable, DeviceBuffer, ExportedRange, IpcHandle, Memory, PeerMapping, Platform
from .rocm_hip import (HIP_DEVICE_MALLOC_DEFAULT, HIP_DEVICE_MALLOC_UNCACHED, HIP_IPC_MEM_LAZY_ENABLE_PEER_ACCESS,
                       HIP_MALLOC_SIGNAL_MEMORY, HipApi, HipDevices, handle_bytes, handle_from_bytes, hip_first)
from .views import tensor_view_params


class _CudaArrayInterface:
    """The minimal ``__cuda_array_interface__`` (v3) torch needs to alias device memory."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None, "stream": None}


class SignalMemory(Closable):
    """An 8-byte ``hipMallocSignalMemory`` word: a ROCr signal HIP stream operations may write.

    ``ptr`` is the value word (HIP's pointer), ``handle`` the ``hsa_signal_t``
    (``ptr - 8``: ``amd_signal_t`` starts ``{int64 kind; int64 value; ...}``),
    checked at allocation with ``hsa_amd_signal_value_pointer``. HIP creates
    it with the value 1. ``memory`` is the :class:`RocmMemory` that frees it.
    """

    def __init__(self, memory: "RocmMemory", device: int, ptr: int, handle: int, impl=None):
        self.memory, self.device, self.ptr, self.handle, self.impl = memory, device, ptr, handle, impl

    @property
    def signal(self):
        """The :class:`~gpuxfer.platforms.hsa.Signal` of this word (a copy's dependency or completion)."""
        from .hsa import Signal
        return Signal(self.handle)

    def _release(self) -> None:
        self.memory.free_raw(self.ptr, self.device, "a signal word")

    def __repr__(self) -> str:
        return f"SignalMemory(device {self.device}, value at 0x{self.ptr:x}, signal 0x{self.handle:x})"


class RocmMemory:
    """The memory of a :class:`~gpuxfer.platforms.rocm.RocmPlatform` (``owner``: the platform its buffers and
    mappings belong to, whose ``_free`` / ``_close_mapping`` come back here): allocations (default, uncached
    flag words, signal words checked with ROCr through ``hsa``), IPC export and open (an allocation's handle
    opened once per device, counted), which addresses are a peer's, tensor views."""

    name = "rocm"

    def __init__(self, devices: HipDevices, api: HipApi, owner: Platform, hsa: Callable[[], Any]):
        self._devices = devices
        self._api = api
        self._owner = owner
        self._hsa = hsa
        self._lock = threading.RLock()
        self._peer_ranges: dict[int, int] = {}          # start -> end of opened peer mappings
        self._ipc_open: dict[tuple[int, bytes], list] = {}  # (device, handle) -> [mapped pointer, open count]
        self._own: dict[int, tuple[int, int]] = {}      # ptr -> (device, nbytes) of our allocations

    def _malloc(self, nbytes: int, device: int, flags: int, what: str) -> tuple[int, Any]:
        self._devices.check_open()
        device = self._devices.check(device)
        if not isinstance(nbytes, (int, np.integer)) or int(nbytes) <= 0:
            raise BadInput(f"cannot allocate {nbytes!r} bytes: the size must be a positive integer")
        with self._devices.on(device):
            arr = hip_first(self._api("hipExtMallocWithFlags", int(nbytes), flags,
                                      doing=f"allocating {nbytes} B of {what} on device {device}"))
        ptr = int(arr)
        with self._lock:
            self._own[ptr] = (device, int(nbytes))
        return ptr, arr

    def alloc(self, nbytes: int, device: int) -> DeviceBuffer:
        ptr, arr = self._malloc(nbytes, device, HIP_DEVICE_MALLOC_DEFAULT, "device memory")
        return DeviceBuffer(self._owner, device, ptr, int(nbytes), impl=arr)

    def alloc_flags(self, nbytes: int, device: int) -> DeviceBuffer:
        """Uncached device memory for flag words (exportable like :meth:`alloc`)."""
        ptr, arr = self._malloc(nbytes, device, HIP_DEVICE_MALLOC_UNCACHED, "uncached flag memory")
        return DeviceBuffer(self._owner, device, ptr, int(nbytes), impl=arr)

    def alloc_signal(self, device: int) -> SignalMemory:
        """A ``hipMallocSignalMemory`` word (value 1) and its HSA signal handle, checked with ROCr."""
        ptr, arr = self._malloc(8, device, HIP_MALLOC_SIGNAL_MEMORY, "signal memory")
        sig = SignalMemory(self, device, ptr, ptr - 8, impl=arr)
        try:
            from .hsa import Signal
            seen = self._hsa().signal_value_pointer(Signal(sig.handle))
            if seen != ptr:
                raise DriverError("hsa_amd_signal_value_pointer", "LAYOUT_MISMATCH", -1,
                                  "checking that a hipMallocSignalMemory word is the value of signal (ptr - 8)",
                                  f"ROCr says the value of signal 0x{sig.handle:x} lives at 0x{seen:x}, not 0x{ptr:x}")
        except BaseException:
            sig.close()
            raise
        return sig

    def free_raw(self, ptr: int, device: int, what: str) -> None:
        with self._lock:
            self._own.pop(ptr, None)
        self._api("hipFree", ptr, doing=f"freeing {what} at 0x{ptr:x} on device {device}")

    def free(self, buf: DeviceBuffer) -> None:
        self.free_raw(buf.ptr, buf.device, f"{buf.nbytes} B")

    def export_handle(self, buf: DeviceBuffer) -> IpcHandle:
        if buf.platform is not self._owner:
            raise BadInput(f"{buf!r} was not allocated by this ROCm platform")
        if buf.closed:
            raise BadInput(f"cannot export {buf!r}: it is freed")
        h = hip_first(self._api("hipIpcGetMemHandle", buf.ptr,
                                doing=f"exporting an IPC handle of {buf.nbytes} B on device {buf.device}"))
        return IpcHandle(self.name, buf.device, buf.nbytes, handle_bytes(h), os.getpid(), process_namespace())

    def allocation_range(self, ptr: int, device: int) -> tuple[int, int] | None:
        """``hipMemGetAddressRange``: the allocation (or IPC mapping) holding ``ptr``."""
        device = self._devices.check(device)
        with self._devices.on(device):
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
        self._devices.check_open()
        device = self._devices.check(device)
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
        self._devices.check_open()
        device = self._devices.check(device)
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
                return PeerMapping(self._owner, device, entry[0], handle, impl=key)
        h = handle_from_bytes(self._api.hip, handle.payload)
        with self._devices.on(device):
            p = hip_first(self._api("hipIpcOpenMemHandle", h, HIP_IPC_MEM_LAZY_ENABLE_PEER_ACCESS,
                                    doing=f"opening the IPC handle of device {handle.device} of pid "
                                          f"{handle.owner_pid} ({handle.nbytes} B) on device {device}"))
        ptr = int(p)
        with self._lock:
            self._peer_ranges[ptr] = ptr + handle.nbytes
            self._ipc_open[key] = [ptr, 1]
        return PeerMapping(self._owner, device, ptr, handle, impl=key)

    def close_mapping(self, mapping: PeerMapping) -> None:
        with self._lock:
            entry = self._ipc_open.get(mapping.impl)
            if entry is not None:
                entry[1] -= 1
                if entry[1] > 0:
                    return
                del self._ipc_open[mapping.impl]
            self._peer_ranges.pop(mapping.ptr, None)
        with self._devices.on(mapping.device):
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
        if mem.platform is not self._owner:
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
