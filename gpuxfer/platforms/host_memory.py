"""The host emulation's memory: POSIX shared-memory buffers (``shm_open`` + ``mmap``) that another
process opens by name the way CUDA IPC opens a ``cudaMalloc`` buffer, exported ranges (any other memory of
the process as a cma handle, :mod:`~gpuxfer.platforms.host_cma`), and zero-copy torch views. Mixed into :class:`~gpuxfer.platforms.host.HostPlatform`. See :mod:`gpuxfer.platforms.host` for the
semantics.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import re
import secrets
from typing import Sequence

import numpy as np

from ..common import exported_here, map_shm, process_namespace, unlink_shm
from ..errors import BadInput, DriverError, NotExportable
from . import host_cma as cma
from .base import DeviceBuffer, ExportedRange, IpcHandle, Memory, PeerMapping
from .views import tensor_view_params

log = logging.getLogger("gpuxfer.platforms.host")

#: the names :meth:`_HostMemory.alloc` gives its segments (creator's pid in hex, a counter, a random tag): an IPC
#: handle's payload is one of them, or it is refused
_SEGMENT_NAME = re.compile(r"/gx[0-9a-f]{1,16}_[0-9]{1,20}_[0-9a-f]{8}")


class _Shm:
    """One mapped POSIX shared-memory segment."""

    def __init__(self, name: str, nbytes: int, create: bool):
        self.name, self.nbytes, self.owner = name, nbytes, create
        self.mm = map_shm(name, nbytes, create=create)
        anchor = ctypes.c_char.from_buffer(self.mm)   # a buffer export, released right below
        self.ptr = ctypes.addressof(anchor)
        del anchor
        self.linked = create
        if create:
            from multiprocessing import resource_tracker
            resource_tracker.register(name, "shared_memory")

    def unlink(self) -> None:
        """Drop the name (the owner's; idempotent): the mappings stay valid, no new opener finds it."""
        if self.linked:
            from multiprocessing import resource_tracker
            self.linked = False
            unlink_shm(self.name)
            try:
                resource_tracker.unregister(self.name, "shared_memory")
            except Exception as exc:  # noqa: BLE001 - the name is gone already: only the tracker's books are left
                log.debug("shared memory %s unlinked; the resource tracker did not take the news: %s", self.name, exc)

    def release(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            # torch tensors over the memory are still alive: the mapping lives on
            # until the last one dies (the mmap object closes itself then).
            log.debug("shared memory %s still viewed by tensors; unmapped when they die", self.name)
        self.unlink()


def _address(v, what: str) -> int:
    """An address or a size as an int: an integer of 64 bits (not a bool or a float), else BadInput."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not -(1 << 63) <= int(v) < 1 << 63:
        raise BadInput(f"{what} must be a 64-bit integer, got {v!r}")
    return int(v)


def _segment_name(handle: IpcHandle) -> str:
    """The segment name an IPC handle's payload holds, checked (the bytes come from another process)."""
    payload, n = handle.payload, handle.nbytes
    if isinstance(payload, (bytes, bytearray)):
        name = bytes(payload).decode("ascii", "replace")
        if _SEGMENT_NAME.fullmatch(name) and isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return name
    raise BadInput(f"not a host IPC handle of a positive size ({n!r} bytes) whose payload names a shared-memory "
                   f"buffer this platform allocates: {payload!r:.80}")


class _HostMemory:
    """The memory hooks of :class:`~gpuxfer.platforms.host.HostPlatform` (its state and checks: ``_lock``,
    ``_memory``, ``_ids``, ``_check_open``, ``_check_device``)."""

    def alloc(self, nbytes: int, device: int) -> DeviceBuffer:
        self._check_open()
        device = self._check_device(device)
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or not 0 < int(nbytes) < 1 << 63:
            raise BadInput(f"cannot allocate {nbytes!r} bytes: the size must be a positive 64-bit integer")
        name = f"/gx{os.getpid():x}_{next(self._ids)}_{secrets.token_hex(4)}"
        try:
            shm = _Shm(name, int(nbytes), create=True)
        except OSError as exc:
            raise DriverError("shm_open", errno.errorcode.get(exc.errno or 0, "OSError"), exc.errno or -1,
                              f"allocating {nbytes} bytes of shared memory on host device {device}",
                              str(exc)) from exc
        buf = DeviceBuffer(self, device, shm.ptr, int(nbytes), impl=shm)
        with self._lock:
            self._memory[buf.ptr] = buf
        return buf

    def _free(self, buf: DeviceBuffer) -> None:
        with self._lock:
            self._memory.pop(buf.ptr, None)
        self._unmap_when_idle(buf.impl)

    def _unmap_when_idle(self, impl) -> None:
        """Unmap ``impl`` now if no stream of this platform has work queued or running, which could touch it (a
        flag wait on it never satisfied, a copy from it); else at the first free that finds them idle, or once
        ``close`` has stopped them. The memory is gone from the platform's books at once either way."""
        with self._lock:
            self._unmapped_later.append(impl)
            if any(w.busy for w in self._workers):
                log.debug("a buffer freed while streams still run: unmapped once they are idle")
                return
            ready, self._unmapped_later = self._unmapped_later, []
        for x in ready:
            x.release()

    def _holder(self, ptr: int) -> Memory | None:
        ptr = int(ptr)
        with self._lock:
            for mem in self._memory.values():
                if mem.ptr <= ptr < mem.ptr + mem.nbytes:
                    return mem
        return None

    def allocation_range(self, ptr: int, device: int) -> tuple[int, int] | None:
        mem = self._holder(_address(ptr, "an address"))
        return None if mem is None else (mem.ptr, mem.nbytes)

    def export_range(self, ptr: int, nbytes: int, device: int, within: tuple[int, int] | None = None
                     ) -> ExportedRange:
        """The shared-memory buffer (from :meth:`alloc`) holding ``[ptr, ptr + nbytes)``; any other memory of
        this process (a plain torch CPU tensor) is named by a cma handle, which another process reaches by
        cross-memory attach (:mod:`~gpuxfer.platforms.host_cma`): the handle covers ``within`` (``(base,
        nbytes)``, a tensor's storage) where that holds the range, else the range itself."""
        device = self._check_device(device)
        ptr, nbytes = _address(ptr, "an exported range's address"), _address(nbytes, "an exported range's size")
        mem = self._holder(ptr)
        what = f"host memory [0x{ptr:x}, +{nbytes})"
        if mem is None:
            return self._export_cma(ptr, nbytes, device, within)
        if not isinstance(mem, DeviceBuffer):
            raise NotExportable(what, "it lies in another process's buffer opened here")
        if nbytes < 0 or ptr + nbytes > mem.ptr + mem.nbytes:
            raise NotExportable(what, f"it runs past the end of {mem!r}")
        if mem.device != device:
            raise BadInput(f"{what} belongs to emulated device {mem.device}, not {device}")
        return ExportedRange(self.export_handle(mem), ptr - mem.ptr)

    def _export_cma(self, ptr: int, nbytes: int, device: int, within) -> ExportedRange:
        what = f"host memory [0x{ptr:x}, +{nbytes})"
        if nbytes <= 0 or ptr <= 0:
            raise NotExportable(what, "an empty range or a null address names no memory")
        base, size = ptr, nbytes
        if within is not None:
            try:
                wb, wn = (_address(v, "within") for v in within)
            except (TypeError, ValueError):
                raise BadInput(f"within must be (base, size), got {within!r}") from None
            if 0 < wb <= ptr and nbytes <= wn - (ptr - wb):
                base, size = wb, wn
        if self._cma:
            self._cma.refuse(base, size, f"exporting {what}")
        payload = cma.encode_handle(os.getpid(), base, size)
        return ExportedRange(IpcHandle(self.name, device, size, payload, os.getpid(), process_namespace()), ptr - base)

    def unpublish(self, buf: DeviceBuffer) -> None:
        """Drop the shared-memory name of ``buf`` once its peers have opened it (later opens fail;
        existing mappings and ``buf`` stay valid). A GPU's IPC handle has no name to drop."""
        if buf.platform is not self or not isinstance(buf.impl, _Shm):
            raise BadInput(f"{buf!r} was not allocated by this host platform")
        buf.impl.unlink()

    def export_handle(self, buf: DeviceBuffer) -> IpcHandle:
        if buf.platform is not self or not isinstance(buf.impl, _Shm):
            raise BadInput(f"{buf!r} was not allocated by this host platform")
        if buf.closed:
            raise BadInput(f"cannot export {buf!r}: it is freed")
        return IpcHandle(self.name, buf.device, buf.nbytes, buf.impl.name.encode(), os.getpid(), process_namespace())

    def open_handle(self, handle: IpcHandle, device: int) -> PeerMapping:
        self._check_open()
        device = self._check_device(device)
        if handle.platform != self.name:
            raise BadInput(f"a {handle.platform!r} IPC handle cannot be opened on the host platform")
        if exported_here(handle.owner_pid, handle.owner_namespace):
            raise BadInput("cannot open an IPC handle in the process that exported it (CUDA forbids it "
                           "too): use the DeviceBuffer itself")
        if cma.is_cma_payload(handle.payload):
            return self._open_cma(handle, device)
        name = _segment_name(handle)
        try:
            shm = _Shm(name, handle.nbytes, create=False)
        except OSError as exc:
            raise DriverError("shm_open", errno.errorcode.get(exc.errno or 0, "OSError"), exc.errno or -1,
                              f"opening the IPC handle of device {handle.device} of pid {handle.owner_pid} "
                              f"({handle.nbytes} bytes)", str(exc)) from exc
        mapping = PeerMapping(self, device, shm.ptr, handle, impl=shm)
        with self._lock:
            self._memory[mapping.ptr] = mapping
        return mapping

    def _open_cma(self, handle: IpcHandle, device: int) -> PeerMapping:
        """A cma handle (another process's plain memory): a mapping that is not addressable here, reached by
        the copy hooks only."""
        with self._lock:
            impl = cma.open_cma(handle.payload, handle.owner_pid, handle.nbytes, self._cma_targets)
        mapping = PeerMapping(self, device, impl.local, handle, impl=impl)
        mapping.addressable = False
        with self._lock:
            self._memory[mapping.ptr] = mapping
        self._cma.add(mapping)
        return mapping

    def _close_mapping(self, mapping: PeerMapping) -> None:
        with self._lock:
            self._memory.pop(mapping.ptr, None)
        if isinstance(mapping.impl, cma.CmaMapping):
            self._cma.remove(mapping)       # queued copies hold the process they reach, never the reservation
        self._unmap_when_idle(mapping.impl)

    def as_tensor(self, mem: Memory, dtype=None, shape: Sequence[int] | None = None, offset: int = 0):
        import torch
        if isinstance(getattr(mem, "impl", None), cma.CmaMapping):
            raise BadInput(f"{mem!r} is another process's memory reached by cross-memory attach: not addressable "
                           "here (copy_async / copy_batch_async reach it)")
        if mem.platform is not self or not isinstance(getattr(mem, "impl", None), _Shm):
            raise BadInput(f"{mem!r} does not belong to this host platform")
        if mem.closed:
            raise BadInput(f"cannot view {mem!r}: it is closed")
        dt, shape, count = tensor_view_params(mem, dtype, shape, offset)
        if count == 0:
            return torch.empty(shape, dtype=dt)
        # frombuffer keeps a reference to the memoryview, whose buffer export keeps
        # the mapping alive (mmap.close() refuses) as long as a tensor uses it.
        flat = torch.frombuffer(memoryview(mem.impl.mm), dtype=torch.uint8, count=count, offset=int(offset))
        return flat.view(dt).reshape(shape)
