"""The platform contract emulated on the CPU (a *test* platform: no GPU is used).

What it emulates, and how:

* **Devices** -- ``GPUXFER_HOST_DEVICES`` (default 2) emulated devices. They
  all share the host's memory; the device index only tags buffers and streams.
* **Buffers** -- POSIX shared memory (``shm_open`` + ``mmap``), so another
  process can open them by name, the way CUDA IPC opens a ``cudaMalloc`` buffer.
  ``ptr`` is the real address of the mapping in *this* process; a peer that
  opens the handle gets its own, different address (like real IPC).
  The owner registers the name with multiprocessing's resource tracker (so a
  crashed owner's segments are unlinked when the tracker exits) and unlinks it
  on ``close()``; openers never touch the tracker, so a peer exiting never
  unlinks the owner's memory. Once every peer has opened a buffer, its owner
  may drop the name (:meth:`HostPlatform.unpublish`): the mappings stay, and
  nothing is left in ``/dev/shm`` even if every process (tracker included) is
  killed.
* **Opening your own handle** is refused with :class:`BadInput`, as CUDA refuses
  ``cudaIpcOpenMemHandle`` in the exporting process: code that passes on the
  emulation must not depend on something the GPU forbids.
* **Streams** -- one FIFO worker thread (a daemon) per stream executes enqueued
  operations in order: copies (``memmove``), memsets, 64-bit flag writes, flag
  waits, launched Python callables and event records. A flag wait polls the
  word with back-off and blocks *only that stream's* later work; other streams
  run on. Waits are CUDA's cyclic GEQ: ``(int64)(*addr - value) >= 0``.
* **The default stream** -- ``current_stream(device)`` is one stream per device
  per platform object, shared by all threads (like CUDA's default stream).
  torch ops on CPU tensors run synchronously on the *calling* thread, not on a
  stream: to order torch work after stream work, enqueue it with
  :meth:`HostPlatform.launch`, or ``synchronize`` first (host code reading
  device results on a GPU must synchronize too).
* **Errors** -- an exception raised by an operation on a worker is stored; the
  stream is then failed (sticky, like a CUDA context error): later operations
  are skipped, and every event recorded after the failure raises the error from
  ``event_query`` / ``event_wait`` / ``synchronize``; enqueuing on a failed
  stream raises it at once. gpuxfer errors keep their type; anything else is
  wrapped in :class:`DriverError` (``api="host stream"``, the status is the
  exception's type name) with the original as ``__cause__``.
* **Graph capture** -- :meth:`HostPlatform.capture` records the operations
  enqueued on a stream (copies, flag writes and waits, launched callables)
  into a :class:`HostGraph` instead of running them, the way stream capture
  records a CUDA graph; :meth:`HostGraph.replay` enqueues the recorded
  operations again, with the values and addresses they were recorded with.
  Recording an event on a capturing stream is refused (host-visible events
  have no replayable meaning here).
* **Lifetime** -- ``close()`` on the platform aborts every worker, including
  one stuck in a flag wait, and fails the events still pending. A stream that is
  garbage-collected drains its queued work first (like ``cudaStreamDestroy``).
  Freeing a buffer while torch tensors over it are alive keeps the mapping
  until the last tensor dies (on a GPU that would be a use-after-free).
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import logging
import os
import queue
import secrets
import shutil
import threading
import time
import weakref
from typing import Callable, Sequence

import numpy as np

from .. import config
from ..common import SHM_UNAVAILABLE, map_shm, unlink_shm
from ..errors import BadInput, DriverError, GpuxferError, NotExportable
from .base import (DeviceBuffer, DeviceInfo, Event, ExportedRange, IpcHandle, LinkInfo, Memory, PeerMapping,
                   Platform, Stream, as_int64_array, check_flag_ptr)

log = logging.getLogger("gpuxfer.platforms.host")

_MASK64 = (1 << 64) - 1
_POLL_MAX_S = 5e-4          # longest sleep between two polls of a flag
_STOP_CHECK_S = 0.05        # how often an event wait on a worker checks for abort
_JOIN_TIMEOUT_S = 5.0       # how long close() waits for each worker to exit


def _to_signed64(value: int) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise BadInput(f"a flag value must be an integer, got {type(value).__name__}")
    value = int(value)
    if not -(1 << 63) <= value <= _MASK64:
        raise BadInput(f"flag value {value} does not fit in 64 bits")
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


def _geq_cyclic(current: int, value: int) -> bool:
    """CUDA's ``CU_STREAM_WAIT_VALUE_GEQ``: ``(int64_t)(*addr - value) >= 0``."""
    return _to_signed64((current - value) & _MASK64) >= 0


def _load64(ptr: int) -> int:
    return ctypes.c_int64.from_address(ptr).value


_fence_lock = threading.Lock()


def _store64(ptr: int, value: int) -> None:
    # The lock round trip is the fence: everything this thread did before
    # (earlier ops of the stream) is visible before the flag store.
    with _fence_lock:
        ctypes.c_int64.from_address(ptr).value = value


# --------------------------------------------------------------------------- shared memory


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
            resource_tracker.unregister(self.name, "shared_memory")

    def release(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            # torch tensors over the memory are still alive: the mapping lives on
            # until the last one dies (the mmap object closes itself then).
            log.debug("shared memory %s still viewed by tensors; unmapped when they die", self.name)
        self.unlink()


# --------------------------------------------------------------------------- streams and events


class _Stopped(Exception):
    """Raised inside a worker when the platform aborts it."""


class HostEvent(Event):
    """Completed when the stream's worker reaches it; carries the stream's error, if any."""

    def __init__(self, stream_name: str):
        self.stream_name = stream_name
        self._done = threading.Event()
        self._error: BaseException | None = None

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()

    def _check(self) -> bool:
        if not self._done.is_set():
            return False
        if self._error is not None:
            raise self._error
        return True

    def __repr__(self) -> str:
        state = "pending" if not self._done.is_set() else ("failed" if self._error else "done")
        return f"HostEvent({self.stream_name}, {state})"


class _Op:
    __slots__ = ("what", "fn", "event")

    def __init__(self, what: str, fn: Callable[[], object] | None, event: HostEvent | None = None):
        self.what, self.fn, self.event = what, fn, event


_DRAIN = _Op("drain and exit", None)


class _Worker:
    """The thread behind a :class:`HostStream` (kept apart so the stream can be garbage-collected)."""

    def __init__(self, name: str):
        self.name = name
        self.queue: queue.SimpleQueue[_Op] = queue.SimpleQueue()
        self.stop = threading.Event()
        self.closing = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"gpuxfer-{name}", daemon=True)
        self.thread.start()

    def put(self, op: _Op) -> None:
        if self.error is not None:
            raise self.error
        if self.closing or self.stop.is_set() or not self.thread.is_alive():
            raise BadInput(f"{self.name} is closed")
        self.queue.put(op)

    def drain(self) -> None:
        """Finish the queued work, then exit (refusing new work)."""
        if not self.closing:
            self.closing = True
            self.queue.put(_DRAIN)

    def _run(self) -> None:
        while True:
            op = self.queue.get()
            if op is _DRAIN:
                break
            if self.stop.is_set():
                self.queue.put(op)   # failed with the rest by _fail_pending
                break
            if op.event is not None:
                op.event._finish(self.error)
                continue
            if self.error is not None:
                continue
            try:
                op.fn()
            except _Stopped:
                break
            except BaseException as exc:  # noqa: BLE001 - stored, re-raised on the host
                self.error = _wrap(exc, f"running {op.what} on {self.name}")
                log.debug("%s failed: %s", self.name, self.error)
        self._fail_pending()

    def _fail_pending(self) -> None:
        err = self.error or DriverError("host stream", "STREAM_CLOSED", -1, f"waiting on {self.name}",
                                        "the stream was closed before this work ran")
        while True:
            try:
                op = self.queue.get_nowait()
            except queue.Empty:
                return
            if op.event is not None:
                op.event._finish(err)

    def abort(self) -> None:
        self.stop.set()
        self.queue.put(_DRAIN)

    def join(self, timeout: float) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()


def _wrap(exc: BaseException, doing: str) -> BaseException:
    if isinstance(exc, GpuxferError):
        return exc
    err = DriverError("host stream", type(exc).__name__, -1, doing, str(exc))
    err.__cause__ = exc
    return err


class HostGraph:
    """Operations recorded from a capturing stream (:meth:`HostPlatform.capture`); :meth:`replay` runs them again."""

    def __init__(self, stream: "HostStream"):
        self.stream = stream
        self.ops: list[tuple[str, Callable[[], object]]] = []

    def replay(self, stream: "HostStream | None" = None) -> None:
        """Enqueue the recorded operations, in order, on ``stream`` (default: the stream they were captured on)."""
        s = self.stream if stream is None else stream
        if not isinstance(s, HostStream):
            raise BadInput(f"not a host stream: {s!r}")
        if s._capture is not None:
            raise BadInput(f"cannot replay a graph into {s!r} while it captures")
        for what, fn in self.ops:
            s._worker.put(_Op(what, fn))

    def __repr__(self) -> str:
        return f"HostGraph({len(self.ops)} ops, captured on {self.stream.name})"


class HostStream(Stream):
    """A FIFO of operations run by one worker thread."""

    def __init__(self, device: int, name: str, owned: bool = True):
        self.device = device
        self.handle = None
        self.name = name
        self.owned = owned         # False: a current (borrowed) stream, stopped by the platform's close()
        self._worker = _Worker(name)
        self._capture: HostGraph | None = None     # set while capturing: operations are recorded, not run
        self._finalizer = weakref.finalize(self, self._worker.drain)   # on GC: drain, then exit

    def close(self) -> None:
        """Let the queued work finish, then stop the worker (like ``cudaStreamDestroy``). Idempotent; a no-op
        for a current stream (the platform's ``close()`` stops those)."""
        if self.owned:
            self._finalizer()

    @property
    def closed(self) -> bool:
        return self.owned and (self._worker.closing or self._worker.stop.is_set())

    def _enqueue(self, what: str, fn: Callable[[], object]) -> None:
        if self._capture is not None:
            self._capture.ops.append((what, fn))
            return
        self._worker.put(_Op(what, fn))

    def __repr__(self) -> str:
        return f"HostStream({self.name})"


# --------------------------------------------------------------------------- the platform


def _host_device_count() -> int:
    return config.get("GPUXFER_HOST_DEVICES")


def _torch_dtype(dtype):
    import torch
    if dtype is None:
        return torch.uint8
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    raise BadInput(f"not a torch dtype: {dtype!r}")


class HostPlatform(Platform):
    """The contract on the CPU: shared-memory buffers, one worker thread per stream."""

    name = "host"
    is_emulation = True
    host_memory = True
    memory_runtime = "host"
    collective_backend = "gloo"
    kernels_interpreted = True
    copy_engine_peer_copies = True

    _ids = itertools.count()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if SHM_UNAVAILABLE:
            return SHM_UNAVAILABLE
        return None

    def __init__(self, devices: int | None = None):
        self._ndev = _host_device_count() if devices is None else int(devices)
        if self._ndev < 1:
            raise BadInput(f"the host platform needs at least one device, got {self._ndev}")
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._default: dict[int, HostStream] = {}
        self._nstreams = itertools.count()
        self._is_closed = False
        self._memory: dict[int, Memory] = {}     # ptr -> live buffers and mappings (export_range)

    # ---- devices ----
    def _check_device(self, device: int) -> int:
        if not isinstance(device, (int, np.integer)) or not 0 <= int(device) < self._ndev:
            raise BadInput(f"device {device!r} does not exist: the host emulation has {self._ndev} "
                           f"device(s) (set GPUXFER_HOST_DEVICES for more)")
        return int(device)

    def _check_open(self) -> None:
        if self._is_closed:
            raise BadInput("the host platform is closed")

    def device_count(self) -> int:
        return self._ndev

    def device_info(self, device: int) -> DeviceInfo:
        device = self._check_device(device)
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = 0
        free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else None
        return DeviceInfo(
            index=device, name=f"host-emulated-{device}", arch="host", total_bytes=total, free_bytes=free,
            pci_bus_id=None, sm_count=os.cpu_count() or 1, copy_engines=2, stream_mem_ops_64=True,
            stream_wait_nor=False, can_flush_remote_writes=False,
            notes=("EMULATION on the CPU: shared memory + one worker thread per stream; no GPU is used",
                   "free_bytes is the free space of /dev/shm"))

    def link(self, src: int, dst: int) -> LinkInfo:
        src, dst = self._check_device(src), self._check_device(dst)
        if src == dst:
            return LinkInfo(src, dst, "same-device", True)
        return LinkInfo(src, dst, "shared-memory", True, "emulated: both ends are host memory")

    def versions(self) -> dict[str, str]:
        return {"driver": "none (host emulation)", "emulated devices": str(self._ndev)}

    # ---- memory ----
    def alloc(self, nbytes: int, device: int) -> DeviceBuffer:
        self._check_open()
        device = self._check_device(device)
        if not isinstance(nbytes, (int, np.integer)) or int(nbytes) <= 0:
            raise BadInput(f"cannot allocate {nbytes!r} bytes: the size must be a positive integer")
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
        buf.impl.release()

    def _holder(self, ptr: int) -> Memory | None:
        ptr = int(ptr)
        with self._lock:
            for mem in self._memory.values():
                if mem.ptr <= ptr < mem.ptr + mem.nbytes:
                    return mem
        return None

    def allocation_range(self, ptr: int, device: int) -> tuple[int, int] | None:
        mem = self._holder(ptr)
        return None if mem is None else (mem.ptr, mem.nbytes)

    def export_range(self, ptr: int, nbytes: int, device: int) -> ExportedRange:
        """The shared-memory buffer (from :meth:`alloc`) holding ``[ptr, ptr + nbytes)``; any other host
        memory (a plain torch CPU tensor) cannot be opened by another process."""
        device = self._check_device(device)
        ptr, nbytes = int(ptr), int(nbytes)
        mem = self._holder(ptr)
        what = f"host memory [0x{ptr:x}, +{nbytes})"
        if not isinstance(mem, DeviceBuffer):
            why = ("it lies in another process's buffer opened here" if mem is not None else
                   "it is not inside a shared-memory buffer of this host platform (allocate the memory with "
                   "Platform.alloc and view it with Platform.as_tensor)")
            raise NotExportable(what, why)
        if nbytes < 0 or ptr + nbytes > mem.ptr + mem.nbytes:
            raise NotExportable(what, f"it runs past the end of {mem!r}")
        if mem.device != device:
            raise BadInput(f"{what} belongs to emulated device {mem.device}, not {device}")
        return ExportedRange(self.export_handle(mem), ptr - mem.ptr)

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
        return IpcHandle(self.name, buf.device, buf.nbytes, buf.impl.name.encode(), os.getpid())

    def open_handle(self, handle: IpcHandle, device: int) -> PeerMapping:
        self._check_open()
        device = self._check_device(device)
        if handle.platform != self.name:
            raise BadInput(f"a {handle.platform!r} IPC handle cannot be opened on the host platform")
        if handle.owner_pid == os.getpid():
            raise BadInput("cannot open an IPC handle in the process that exported it (CUDA forbids it "
                           "too): use the DeviceBuffer itself")
        name = handle.payload.decode()
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

    def _close_mapping(self, mapping: PeerMapping) -> None:
        with self._lock:
            self._memory.pop(mapping.ptr, None)
        mapping.impl.release()

    def as_tensor(self, mem: Memory, dtype=None, shape: Sequence[int] | None = None, offset: int = 0):
        import torch
        if mem.platform is not self or not isinstance(getattr(mem, "impl", None), _Shm):
            raise BadInput(f"{mem!r} does not belong to this host platform")
        if mem.closed:
            raise BadInput(f"cannot view {mem!r}: it is closed")
        dt = _torch_dtype(dtype)
        item = torch.empty((), dtype=dt).element_size()
        if not isinstance(offset, (int, np.integer)) or offset < 0 or offset > mem.nbytes:
            raise BadInput(f"offset {offset!r} lies outside {mem!r}")
        if offset % item:
            raise BadInput(f"offset {offset} is not a multiple of the {dt} item size ({item} bytes)")
        if shape is None:
            shape = ((mem.nbytes - offset) // item,)
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise BadInput(f"negative size in shape {shape}")
        count = int(np.prod(shape, dtype=np.int64)) * item
        mem.check_range(offset, count, f"a {dt} tensor of shape {shape} at byte offset {offset}")
        if count == 0:
            return torch.empty(shape, dtype=dt)
        # frombuffer keeps a reference to the memoryview, whose buffer export keeps
        # the mapping alive (mmap.close() refuses) as long as a tensor uses it.
        flat = torch.frombuffer(memoryview(mem.impl.mm), dtype=torch.uint8, count=count, offset=int(offset))
        return flat.view(dt).reshape(shape)

    # ---- streams and events ----
    def create_stream(self, device: int, owned: bool = True) -> HostStream:
        self._check_open()
        device = self._check_device(device)
        stream = HostStream(device, f"host stream {next(self._nstreams)} (device {device})", owned)
        with self._lock:
            self._workers = [w for w in self._workers if w.thread.is_alive()]
            self._workers.append(stream._worker)
        return stream

    def current_stream(self, device: int) -> HostStream:
        device = self._check_device(device)
        with self._lock:
            stream = self._default.get(device)
        if stream is None:
            new = self.create_stream(device, owned=False)
            with self._lock:
                stream = self._default.setdefault(device, new)
            if stream is not new:
                new._finalizer()
        return stream

    @staticmethod
    def _stream(stream) -> HostStream:
        if not isinstance(stream, HostStream):
            raise BadInput(f"not a host stream: {stream!r}")
        if stream.closed:
            raise BadInput(f"{stream!r} is closed")
        return stream

    def record_event(self, stream: Stream, event: Event | None = None) -> HostEvent:
        """Always a new event (``event`` is not reused: a host event completes once)."""
        s = self._stream(stream)
        if s._capture is not None:
            raise BadInput(f"cannot record an event on {s.name} while it captures a graph (host emulation)")
        ev = HostEvent(s.name)
        s._worker.put(_Op("event record", None, ev))
        return ev

    def stream_wait_event(self, stream: Stream, event: Event) -> None:
        s = self._stream(stream)
        if not isinstance(event, HostEvent):
            raise BadInput(f"not a host event: {event!r}")
        stop = s._worker.stop

        def wait() -> None:
            while not event._done.wait(_STOP_CHECK_S):
                if stop.is_set():
                    raise _Stopped
            event._check()   # an error on the other stream fails this one too

        s._enqueue(f"wait for an event of {event.stream_name}", wait)

    def event_query(self, event: Event) -> bool:
        if not isinstance(event, HostEvent):
            raise BadInput(f"not a host event: {event!r}")
        return event._check()

    def event_wait(self, event: Event, timeout_s: float) -> bool:
        if not isinstance(event, HostEvent):
            raise BadInput(f"not a host event: {event!r}")
        event._done.wait(max(0.0, timeout_s))
        return event._check()

    def launch(self, stream: Stream, fn: Callable[[], object]) -> None:
        if not callable(fn):
            raise BadInput(f"launch needs a callable, got {fn!r}")
        self._stream(stream)._enqueue(f"launched {getattr(fn, '__name__', 'callable')}", fn)

    # ---- copies ----
    def copy_async(self, stream: Stream, dst: int, src: int, nbytes: int) -> None:
        s = self._stream(stream)
        dst, src, nbytes = int(dst), int(src), int(nbytes)
        if nbytes < 0:
            raise BadInput(f"cannot copy {nbytes} bytes")
        if nbytes:
            s._enqueue(f"copy of {nbytes} B 0x{src:x} -> 0x{dst:x}", lambda: ctypes.memmove(dst, src, nbytes))

    def copy_batch_async(self, stream: Stream, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> None:
        s = self._stream(stream)
        d, sr, n = (as_int64_array(a, nm).copy() for a, nm in ((dsts, "dsts"), (srcs, "srcs"), (sizes, "sizes")))
        if not len(d) == len(sr) == len(n):
            raise BadInput(f"dsts, srcs and sizes differ in length: {len(d)}, {len(sr)}, {len(n)}")
        if len(n) and n.min() < 0:
            raise BadInput("a copy size is negative")

        def run() -> None:
            for dd, ss, nn in zip(d.tolist(), sr.tolist(), n.tolist()):
                if nn:
                    ctypes.memmove(dd, ss, nn)

        if len(n):
            s._enqueue(f"batch of {len(n)} copies", run)

    def memset_async(self, stream: Stream, ptr: int, value: int, nbytes: int) -> None:
        s = self._stream(stream)
        ptr, nbytes = int(ptr), int(nbytes)
        if nbytes < 0 or not 0 <= int(value) <= 255:
            raise BadInput(f"memset of {nbytes} bytes to {value!r}: need nbytes >= 0 and a byte value")
        if nbytes:
            s._enqueue(f"memset of {nbytes} B at 0x{ptr:x}", lambda: ctypes.memset(ptr, int(value), nbytes))

    # ---- flags ----
    def write_flag(self, stream: Stream, ptr: int, value: int) -> None:
        s = self._stream(stream)
        check_flag_ptr(int(ptr))
        v = _to_signed64(value)
        s._enqueue(f"flag write {v} to 0x{int(ptr):x}", lambda: _store64(int(ptr), v))

    def wait_flag(self, stream: Stream, ptr: int, value: int) -> None:
        s = self._stream(stream)
        ptr = int(ptr)
        check_flag_ptr(ptr)
        v = _to_signed64(value)
        stop = s._worker.stop

        def wait() -> None:
            delay = 1e-6
            while not _geq_cyclic(_load64(ptr), v):
                if stop.is_set():
                    raise _Stopped
                time.sleep(delay)
                delay = min(delay * 2, _POLL_MAX_S)

        s._enqueue(f"flag wait 0x{ptr:x} >= {v}", wait)

    def read_flag(self, ptr: int, device: int) -> int:
        check_flag_ptr(int(ptr))
        return _load64(int(ptr))

    def host_write_flag(self, ptr: int, value: int, device: int) -> None:
        check_flag_ptr(int(ptr))
        _store64(int(ptr), _to_signed64(value))

    # ---- graph capture (emulated) ----
    def begin_capture(self, stream: Stream) -> HostGraph:
        """Record, from now on, what is enqueued on ``stream`` instead of running it."""
        s = self._stream(stream)
        if s._capture is not None:
            raise BadInput(f"{s.name} is already capturing")
        s._capture = HostGraph(s)
        return s._capture

    def end_capture(self, stream: Stream) -> HostGraph:
        """Stop recording on ``stream``; the graph of what was recorded."""
        s = self._stream(stream)
        graph, s._capture = s._capture, None
        if graph is None:
            raise BadInput(f"{s.name} is not capturing")
        return graph

    @contextlib.contextmanager
    def capture(self, stream: Stream | None = None, device: int = 0):
        """``with plat.capture() as graph:`` records ``stream``, or, like ``torch.cuda.graph``, a fresh
        stream made ``device``'s current stream for the block (the graph then replays on the current stream
        of before); the graph holds the operations once the block ends."""
        if stream is not None:
            s = self._stream(stream)
            graph = self.begin_capture(s)
            try:
                yield graph
            finally:
                self.end_capture(s)
            return
        before = self.current_stream(device)
        cap = self.create_stream(device)
        graph = self.begin_capture(cap)
        graph.stream = before
        with self._lock:
            self._default[device] = cap
        try:
            yield graph
        finally:
            with self._lock:
                self._default[device] = before
            self.end_capture(cap)
            cap.close()

    def is_capturing(self, stream: Stream) -> bool:
        return self._stream(stream)._capture is not None

    def capture_graph(self, stream: Stream, record: Callable[[Stream], object]) -> HostGraph:
        s = self._stream(stream)
        self.begin_capture(s)
        try:
            record(s)
        finally:
            graph = self.end_capture(s)
        return graph

    def launch_graph(self, stream: Stream, graph) -> None:
        if not isinstance(graph, HostGraph):
            raise BadInput(f"not a host graph: {graph!r}")
        graph.replay(self._stream(stream))

    # ---- lifetime ----
    @property
    def closed(self) -> bool:
        return self._is_closed

    def close(self) -> None:
        """Abort every stream's worker (a pending flag wait included) and fail pending events. Idempotent."""
        with self._lock:
            if self._is_closed:
                return
            self._is_closed = True
            workers, self._workers = self._workers, []
            self._default.clear()
        for w in workers:
            w.abort()
        for w in workers:
            if not w.join(_JOIN_TIMEOUT_S):
                log.warning("%s did not stop within %g s (a launched callable is still running)",
                            w.name, _JOIN_TIMEOUT_S)

    def __repr__(self) -> str:
        return f"HostPlatform({self._ndev} emulated devices{', closed' if self._is_closed else ''})"

