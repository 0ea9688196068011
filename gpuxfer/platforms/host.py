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
* **Plain process memory** -- memory that is no shared-memory buffer (a plain torch CPU tensor, the KV caches
  an engine allocated itself) is exported as a *cma* handle (the process's identity, the address, the size;
  ``export_range``) and reached from another process by cross-memory attach: its mapping is not addressable
  (``mapping.addressable`` is False; ``as_tensor``, fills and flags refuse it, a stray access faults on a
  no-access reservation), and ``copy_async`` / ``copy_batch_async`` turn copies into or out of it into
  ``process_vm_readv`` / ``process_vm_writev``, checked against its range before any system call. Their
  errors (the process exited: ``PeerLost``; ptrace access denied: ``BackendUnavailable``) fail that transfer
  only. :mod:`~gpuxfer.platforms.host_cma` has the design and its timeline.
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
  stream is then failed (sticky, like a CUDA context error; a failed cross-memory-attach copy is not: it
  fails the operations up to the next event, which raises it): later operations
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
  until the last tensor dies (on a GPU that would be a use-after-free), and
  freeing one (or closing a mapping) while any stream has work queued or
  running keeps it mapped until the streams are idle or the platform closed
  them: a wait that will never be satisfied never reads unmapped memory.

Layout: this module holds :class:`HostPlatform` (devices, the stream, event,
copy, flag and capture hooks, ``close``); the shared-memory buffers and their
IPC are :mod:`~gpuxfer.platforms.host_memory` (mixed in), cross-memory attach
:mod:`~gpuxfer.platforms.host_cma`, the worker threads
behind streams, events and graphs :mod:`~gpuxfer.platforms.host_streams`.
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import os
import shutil
import threading
import time
import weakref
from typing import Callable

import numpy as np

from .. import config
from ..common import SHM_UNAVAILABLE
from ..errors import BadInput
from .base import (DeviceInfo, Event, LinkInfo, Memory, Platform, Stream, as_int64_array, check_flag_ptr,
                   wait_seconds)
from .host_cma import CmaSpace, wrap_scoped
from .host_memory import _HostMemory
from .host_streams import (_JOIN_TIMEOUT_S, _POLL_MAX_S, _STOP_CHECK_S, HostEvent, HostGraph, HostStream, _Op,
                           TransferFailed, _Stopped, _Worker, _geq_cyclic, _load64, _store64, _to_signed64)

__all__ = ["HostPlatform", "HostStream", "HostEvent", "HostGraph"]

log = logging.getLogger("gpuxfer.platforms.host")


# --------------------------------------------------------------------------- the platform


def _int64(v, what: str) -> int:
    """An address, size or byte value of a copy or fill as an int: an integer of 64 bits, else BadInput."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not -(1 << 63) <= int(v) < 1 << 63:
        raise BadInput(f"{what} must be a 64-bit integer, got {v!r}")
    return int(v)


def _host_device_count() -> int:
    return config.get("GPUXFER_HOST_DEVICES")


class HostPlatform(_HostMemory, Platform):
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
        self._unmapped_later: list = []          # freed while streams ran: unmapped once they are idle
        self._cma = CmaSpace()                    # mappings of other processes' plain memory (copies only)
        self._cma_targets = weakref.WeakValueDictionary()   # (pid, start time) -> the process cma mappings reach

    # ---- devices ----
    def _check_device(self, device: int) -> int:
        if not isinstance(device, (int, np.integer)) or not 0 <= int(device) < self._ndev:
            raise BadInput(f"device {device!r} does not exist: the host emulation has {self._ndev} "
                           f"device(s) (set GPUXFER_HOST_DEVICES for more)")
        return int(device)

    def _check_open(self) -> None:
        if self._is_closed:
            raise BadInput("the host platform is closed")

    def set_device(self, device: int) -> None:
        self._check_device(device)

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
            if event._transfer_only and event._error is not None:
                raise TransferFailed(event._error)      # fails what depends on that transfer, up to the next event
            event._check()   # an error on the other stream fails this one too

        s._enqueue(f"wait for an event of {event.stream_name}", wait)

    def event_query(self, event: Event) -> bool:
        if not isinstance(event, HostEvent):
            raise BadInput(f"not a host event: {event!r}")
        return event._check()

    def event_wait(self, event: Event, timeout_s: float) -> bool:
        if not isinstance(event, HostEvent):
            raise BadInput(f"not a host event: {event!r}")
        event._done.wait(wait_seconds(timeout_s))
        return event._check()

    def launch(self, stream: Stream, fn: Callable[[], object]) -> None:
        if not callable(fn):
            raise BadInput(f"launch needs a callable, got {fn!r}")
        self._stream(stream)._enqueue(f"launched {getattr(fn, '__name__', 'callable')}", fn)

    # ---- copies ----
    def copy_async(self, stream: Stream, dst: int, src: int, nbytes: int) -> None:
        s = self._stream(stream)
        dst, src, nbytes = (_int64(v, what) for v, what in ((dst, "copy destination"), (src, "copy source"),
                                                             (nbytes, "copy size")))
        if nbytes < 0:
            raise BadInput(f"cannot copy {nbytes} bytes")
        if nbytes and (dst <= 0 or src <= 0):
            raise BadInput(f"a copy of {nbytes} B from 0x{src:x} to 0x{dst:x}: a null or negative address")
        if nbytes and self._cma:
            self._enqueue_copies(s, *(np.array([v], dtype=np.int64) for v in (dst, src, nbytes)))
        elif nbytes:
            s._enqueue(f"copy of {nbytes} B 0x{src:x} -> 0x{dst:x}", lambda: ctypes.memmove(dst, src, nbytes))

    def copy_batch_async(self, stream: Stream, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> None:
        s = self._stream(stream)
        d, sr, n = (as_int64_array(a, nm).copy() for a, nm in ((dsts, "dsts"), (srcs, "srcs"), (sizes, "sizes")))
        if not len(d) == len(sr) == len(n):
            raise BadInput(f"dsts, srcs and sizes differ in length: {len(d)}, {len(sr)}, {len(n)}")
        if len(n) and n.min() < 0:
            raise BadInput("a copy size is negative")
        live = n > 0
        if live.any() and (d[live].min() <= 0 or sr[live].min() <= 0):
            raise BadInput("a copy address is null or negative")
        if len(n) and self._cma:
            self._enqueue_copies(s, d, sr, n)
            return

        def run() -> None:
            for dd, ss, nn in zip(d.tolist(), sr.tolist(), n.tolist()):
                if nn:
                    ctypes.memmove(dd, ss, nn)

        if len(n):
            s._enqueue(f"batch of {len(n)} copies", run)

    def _enqueue_copies(self, s: HostStream, d: np.ndarray, sr: np.ndarray, n: np.ndarray) -> None:
        """Copies while cma mappings are open: each checked against them now; those with an end in one run as
        cross-memory-attach calls, their errors failing the transfer (:mod:`~gpuxfer.platforms.host_cma`)."""
        run = self._cma.plan(d, sr, n)
        if run is not None:
            s._enqueue(f"batch of {len(n)} copies (cross-memory attach)", wrap_scoped(run))
            return

        def plain() -> None:
            for dd, ss, nn in zip(d.tolist(), sr.tolist(), n.tolist()):
                if nn:
                    ctypes.memmove(dd, ss, nn)

        s._enqueue(f"batch of {len(n)} copies", plain)

    def memset_async(self, stream: Stream, ptr: int, value: int, nbytes: int) -> None:
        s = self._stream(stream)
        ptr, value, nbytes = _int64(ptr, "memset address"), _int64(value, "memset value"), _int64(nbytes, "memset size")
        if nbytes < 0 or not 0 <= value <= 255:
            raise BadInput(f"memset of {nbytes} bytes to {value!r}: need nbytes >= 0 and a byte value")
        if nbytes and ptr <= 0:
            raise BadInput(f"memset of {nbytes} bytes at 0x{ptr:x}: a null or negative address")
        if self._cma:
            self._cma.refuse(ptr, nbytes, "a memset")
        if nbytes:
            s._enqueue(f"memset of {nbytes} B at 0x{ptr:x}", lambda: ctypes.memset(ptr, int(value), nbytes))

    # ---- flags ----
    def _check_flag(self, ptr: int) -> int:
        ptr = check_flag_ptr(ptr)
        if self._cma:
            self._cma.refuse(ptr, 8, "a flag")
        return ptr

    def write_flag(self, stream: Stream, ptr: int, value: int) -> None:
        s = self._stream(stream)
        ptr = self._check_flag(ptr)
        v = _to_signed64(value)
        s._enqueue(f"flag write {v} to 0x{ptr:x}", lambda: _store64(ptr, v))

    def wait_flag(self, stream: Stream, ptr: int, value: int) -> None:
        s = self._stream(stream)
        ptr = self._check_flag(ptr)
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
        return _load64(self._check_flag(ptr))

    def map_host_words(self, ptr: int, nbytes: int, device: int) -> int:
        """Host memory is what the emulated streams run on: its own address."""
        self._check_open()
        self._check_device(device)
        return int(ptr)

    def host_write_flag(self, ptr: int, value: int, device: int) -> None:
        _store64(self._check_flag(ptr), _to_signed64(value))

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
        if not callable(record):
            raise BadInput(f"capture_graph needs a callable that records, got {record!r}")
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
        stuck = False
        for w in workers:
            if not w.join(_JOIN_TIMEOUT_S):
                stuck = True
                log.warning("%s did not stop within %g s (a launched callable is still running)",
                            w.name, _JOIN_TIMEOUT_S)
        with self._lock:
            later, self._unmapped_later = ([], self._unmapped_later) if stuck else (self._unmapped_later, [])
        for impl in later:          # (kept mapped, for the process's life, while a stuck callable may touch it)
            impl.release()

    def __repr__(self) -> str:
        return f"HostPlatform({self._ndev} emulated devices{', closed' if self._is_closed else ''})"
