"""CUDA streams, events, copies and fills (:class:`CudaStreams`, a component of
:class:`~gpuxfer.platforms.cuda.CudaPlatform`): dedicated non-blocking streams and torch's current stream
wrapped as :class:`CudaStream`, raw driver events, ``cuMemcpyAsync``, ``cuMemcpyBatchAsync`` (through its
entry point, or on a proxy stream for the legacy default stream) and ``cuMemsetD8Async``.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Any, Callable

import numpy as np

from .. import config
from ..errors import BadInput
from .base import Event, Platform, Stream
from .cuda_driver import (_DEFAULT_STREAM_HANDLES, _EVENT_DISABLE_TIMING, _LEGACY_STREAM_HANDLES,
                          CU_EVENT_DISABLE_TIMING, CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE,
                          CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, CU_STREAM_NON_BLOCKING, CUDA_ERROR_NOT_READY, CudaContexts,
                          Release, _cu, _driver, check)
from . import cuda_driver
from .cuda_entry import (BATCH_MODE_ENV, CUDA_SUCCESS, SIZE_MAX, CUmemcpyAttributes, batch_call_args,
                         batch_status, plan_batch_copies, resolve_batch)


class CudaStream(Stream):
    """A CUDA stream: ``handle`` is the ``CUstream`` as an int (0 = legacy default stream).

    ``torch`` is the matching ``torch.cuda.Stream`` / ``ExternalStream`` (use it with
    ``torch.cuda.stream(...)``). Streams from :meth:`CudaPlatform.create_stream` are
    owned: ``close()`` destroys them (idempotent; the platform's ``close()`` does it too).
    """

    def __init__(self, device: int, handle: int, torch_stream, platform: "Platform | None" = None):
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

    Destroyed when the object is collected, or its handle given to ``pool`` (the platform's spare
    events) -- by ``__del__``, which costs nothing at creation where a ``weakref.finalize`` costs ~1 us
    per event (an event per post). A raw event rather than a ``torch.cuda.Event``:
    recording and waiting through the driver cost 0.6-0.7 us of host time where torch's
    wrappers cost 0.9-1.0 (2xH200, scripts/host_costs.py), and a pp step makes four such calls.
    """

    __slots__ = ("device", "handle", "_pool")

    def __init__(self, device: int, handle: int, pool: "_EventPool | None" = None):
        self.device = device
        self.handle = handle
        self._pool = pool

    def __del__(self):
        try:
            if self._pool is None:
                _destroy_event(self.handle)
            else:
                self._pool.give(self.device, self.handle)
        except Exception:  # noqa: BLE001 - interpreter exit: the module's names may be gone first
            pass

    def __repr__(self) -> str:
        return f"CudaEvent(cuda:{self.device}, 0x{self.handle:x})"


def _destroy_event(handle: int) -> None:
    try:
        cuda_driver._DRIVER.cuEventDestroy(handle)
    except Exception:  # noqa: BLE001 - interpreter exit: the driver may be gone first
        pass


class _EventPool:
    """A platform's spare driver events, per device: the handle of a collected :class:`CudaEvent` is kept
    for the next :meth:`record_event` that needs a new event (creating one costs a context push, a create
    and a pop, ~5 us of host time; recording a spare ~1 us). Reuse is invisible: no object refers to a
    spare, and a wait queued on an event before it is recorded again waits on the recording it saw
    (``cuStreamWaitEvent`` and ``cuEventQuery`` use the latest recording at call time). :meth:`close`
    destroys the spares; an event collected after it is destroyed, as is one past :attr:`CAP` spares."""

    CAP = 256

    def __init__(self):
        self.spare: dict[int, list[int]] = {}
        self.closed = False

    def take(self, device: int) -> int | None:
        spare = self.spare.get(device)
        try:
            return spare.pop() if spare else None
        except IndexError:          # emptied by another thread since the test
            return None

    def give(self, device: int, handle: int) -> None:
        """A collected event's handle (from its ``__del__``: any thread, list appends are atomic)."""
        if not self.closed:
            spare = self.spare.setdefault(device, [])
            if len(spare) < self.CAP:
                spare.append(handle)
                return
        _destroy_event(handle)

    def close(self) -> None:
        self.closed = True
        for spare in self.spare.values():
            while spare:
                _destroy_event(spare.pop())


def as_stream(stream) -> CudaStream:
    """``stream`` if it is an open :class:`CudaStream`, else :class:`~gpuxfer.errors.BadInput`."""
    if type(stream) is CudaStream and not stream._closed:    # the per-step case first
        return stream
    if not isinstance(stream, CudaStream):
        raise BadInput(f"not a CUDA stream: {stream!r}")
    if stream._closed:
        raise BadInput(f"{stream!r} is closed")
    return stream


def as_event(event) -> CudaEvent:
    if not isinstance(event, CudaEvent):
        raise BadInput(f"not a CUDA event: {event!r}")
    return event


class CudaStreams:
    """The streams, events, copies and fills of a :class:`~gpuxfer.platforms.cuda.CudaPlatform`: the streams it
    created (``owner`` is their platform: ``stream.close()`` comes back through it), torch's streams seen
    current, the spare events, the batch-copy path and its proxy streams."""

    def __init__(self, contexts: CudaContexts, owner: Platform, batch_max_per_call: int):
        self._ctx = contexts
        self._owner = owner
        self.batch_max_per_call = batch_max_per_call
        self._lock = threading.RLock()
        self._streams: dict[int, CudaStream] = {}          # id -> owned streams still alive
        self._events = _EventPool()                         # spare events for record_event
        self._current: dict[tuple, CudaStream] = {}        # (device, handle) -> torch's streams seen current
        self._raw_stream = None     # torch._C._cuda_getCurrentRawStream (False where torch lacks it)
        self._proxies: dict[int, tuple[int, Any, Any]] = {}   # device -> (stream, event in, event out)
        self._proxy_locks: dict[int, threading.Lock] = {}
        self._batch: tuple | None = None                   # resolved batch path (see _batch_impl)

    # ---- streams and events ----
    def create(self, device: int) -> CudaStream:
        """A dedicated non-blocking stream on ``device`` (not one of torch's pooled streams)."""
        import torch
        self._ctx.check_open()
        device = self._ctx.check_device(device)
        drv = _driver()
        with self._ctx.on(device):
            handle = int(_cu(drv.cuStreamCreate, CU_STREAM_NON_BLOCKING,
                             doing=f"creating a non-blocking stream on cuda:{device}"))
        try:
            ts = torch.cuda.ExternalStream(handle, device=torch.device("cuda", device))
        except Exception:
            with self._ctx.on(device):
                _cu(drv.cuStreamDestroy, handle, doing=f"destroying stream 0x{handle:x} of cuda:{device}")
            raise
        s = CudaStream(device, handle, ts, platform=self._owner)
        with self._lock:
            self._streams[id(s)] = s
        return s

    def destroy(self, s: CudaStream) -> None:
        with self._lock:
            self._streams.pop(id(s), None)
        with self._ctx.on(s.device):
            _cu(_driver().cuStreamDestroy, s.handle, doing=f"destroying {s!r}")

    def current(self, device: int) -> CudaStream:
        """torch's current stream of ``device``: one handle lookup, then a cached wrapper (the per-step path)."""
        if type(device) is not int or device not in self._ctx.ctxs:     # known devices skip the check
            device = self._ctx.check_device(device)
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
        s = as_stream(stream)
        if type(event) is not CudaEvent or event.device != s.device:    # re-record: none created per step
            handle = self._events.take(s.device)
            if handle is None:
                with self._ctx.on(s.device):
                    handle = int(_cu(_driver().cuEventCreate, _EVENT_DISABLE_TIMING,
                                     doing=f"creating an event on cuda:{s.device}"))
            event = CudaEvent(s.device, handle, self._events)
        self._ctx.stream_op(s, _driver().cuEventRecord, event.handle, s.handle,
                            doing=lambda: f"recording {event!r} on {s!r}")
        return event

    def stream_wait_event(self, stream: Stream, event: Event) -> None:
        s = as_stream(stream)
        e = event if type(event) is CudaEvent else as_event(event)
        self._ctx.stream_op(s, _driver().cuStreamWaitEvent, s.handle, e.handle, 0,
                            doing=lambda: f"making {s!r} wait for {e!r}")

    def event_query(self, event: Event) -> bool:
        e = as_event(event)
        res = _driver().cuEventQuery(e.handle)
        if int(res[0]) == CUDA_ERROR_NOT_READY:
            return False
        check(res, lambda: f"querying {e!r}", "cuEventQuery")
        return True

    def launch(self, stream: Stream, fn: Callable[[], object]) -> None:
        import torch
        s = as_stream(stream)
        if not callable(fn):
            raise BadInput(f"launch needs a callable, got {fn!r}")
        with torch.cuda.device(s.device), torch.cuda.stream(s.torch):
            fn()

    def native_stream(self, stream: Stream) -> int | None:
        """The ``CUstream`` of a created or wrapped stream; None for the default streams (their handles mean
        "the current context's", which only :meth:`launch` makes sure of)."""
        s = as_stream(stream)
        return None if s.handle in _DEFAULT_STREAM_HANDLES else s.handle

    # ---- copies ----
    def copy_async(self, stream: Stream, dst: int, src: int, nbytes: int) -> None:
        s = as_stream(stream)
        dst, src, nbytes = int(dst), int(src), int(nbytes)
        if nbytes < 0:
            raise BadInput(f"cannot copy {nbytes} bytes")
        if nbytes == 0:
            return
        self._ctx.stream_op(s, _driver().cuMemcpyAsync, dst, src, nbytes, s.handle,
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
                self._batch = resolve_batch(_driver, self._ctx.driver_version, config.get(BATCH_MODE_ENV))
            return self._batch

    def copy_batch_async(self, stream: Stream, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> None:
        """Many independent copies on ``stream`` with ``cuMemcpyBatchAsync`` (no order among them).

        srcAccessOrder=STREAM, flags=PREFER_OVERLAP_WITH_COMPUTE (copy engines), one
        attribute for every copy, at most ``batch_max_per_call`` copies per call. On
        the legacy default stream (which the API refuses) the batch runs on a proxy
        stream ordered after, and before, the legacy stream's work with events.
        Falls back to one ``cuMemcpyAsync`` per copy only where the API is missing.
        """
        s = as_stream(stream)
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
            with self._ctx.on(s.device):
                self._batch_on(impl, s.handle, s.device, chunks)
            return
        drv = _driver()
        proxy, ev_in, ev_out = self._proxy(s.device)
        with self._proxy_locks[s.device], self._ctx.on(s.device):
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
                with self._ctx.on(device):
                    doing = f"creating the batch-copy proxy stream of cuda:{device}"
                    st = int(_cu(drv.cuStreamCreate, CU_STREAM_NON_BLOCKING, doing=doing))
                    e1 = _cu(drv.cuEventCreate, CU_EVENT_DISABLE_TIMING, doing=doing)
                    e2 = _cu(drv.cuEventCreate, CU_EVENT_DISABLE_TIMING, doing=doing)
                self._proxies[device] = (st, e1, e2)
                self._proxy_locks[device] = threading.Lock()
            return self._proxies[device]

    def memset_async(self, stream: Stream, ptr: int, value: int, nbytes: int) -> None:
        s = as_stream(stream)
        ptr, nbytes = int(ptr), int(nbytes)
        if nbytes < 0 or isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
                or not 0 <= int(value) <= 255:
            raise BadInput(f"memset of {nbytes} bytes to {value!r}: need nbytes >= 0 and a byte value")
        if nbytes == 0:
            return
        with self._ctx.on(s.device):
            _cu(_driver().cuMemsetD8Async, ptr, int(value), nbytes, s.handle,
                doing=f"setting {nbytes} bytes at 0x{ptr:x} to {int(value)} on {s!r}")

    def close(self, release: Release) -> None:
        """Destroy the owned streams still open and the proxy streams and events; destroy the spare events
        (later collected events are destroyed, not kept)."""
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
            proxies, self._proxies = self._proxies, {}
        self._events.close()
        if not (streams or proxies):
            return
        drv = _driver()

        def on_device(dev: int) -> None:
            for s in streams:
                if s.device == dev:
                    s._closed = True
                    release.attempt(drv.cuStreamDestroy, s.handle, doing=f"destroying {s!r}")
            if dev in proxies:
                st, e1, e2 = proxies[dev]
                release.attempt(drv.cuStreamDestroy, st, doing=f"destroying the proxy stream of cuda:{dev}")
                release.attempt(drv.cuEventDestroy, e1, doing="destroying a proxy event")
                release.attempt(drv.cuEventDestroy, e2, doing="destroying a proxy event")

        release.on_each({s.device for s in streams} | set(proxies), on_device)
