"""The host emulation's streams: one FIFO worker thread per :class:`HostStream` runs its operations in
order (copies, fills, 64-bit flag writes and polled waits, launched callables, event records); a worker's
error is sticky and reaches the host through :class:`HostEvent` (but a :class:`TransferFailed` fails only the
work up to the next event); :class:`HostGraph` holds operations
recorded from a capturing stream. See :mod:`gpuxfer.platforms.host` for the semantics.
"""
from __future__ import annotations

import ctypes
import logging
import queue
import threading
import weakref
from typing import Callable

import numpy as np

from ..errors import BadInput, DriverError, GpuxferError
from .base import Event, Stream

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


class _Stopped(Exception):
    """Raised inside a worker when the platform aborts it."""


class TransferFailed(Exception):
    """Raised by an operation whose failure ends one transfer, not the stream (a cross-memory-attach copy to a
    process that exited): the worker skips the operations queued after it up to the next event record, that
    event raises ``error``, and the operations after the event run."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


class HostEvent(Event):
    """Completed when the stream's worker reaches it; carries the stream's error, if any."""

    def __init__(self, stream_name: str):
        self.stream_name = stream_name
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._transfer_only = False     # the error failed one transfer (TransferFailed), not the stream

    def _finish(self, error: BaseException | None, transfer_only: bool = False) -> None:
        self._error, self._transfer_only = error, transfer_only
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
        self.failed_transfer: BaseException | None = None     # until the next event record (TransferFailed)
        self._count_lock = threading.Lock()
        self._unfinished = 0        # operations put and not yet finished (the one running included)
        self.thread = threading.Thread(target=self._run, name=f"gpuxfer-{name}", daemon=True)
        self.thread.start()

    def put(self, op: _Op) -> None:
        if self.error is not None:
            raise self.error
        if self.closing or self.stop.is_set() or not self.thread.is_alive():
            raise BadInput(f"{self.name} is closed")
        with self._count_lock:
            self._unfinished += 1
        self.queue.put(op)

    @property
    def busy(self) -> bool:
        """Work put on this stream may still touch memory: some is queued or running."""
        return self._unfinished > 0 and self.thread.is_alive()

    def _finished_one(self) -> None:
        with self._count_lock:
            self._unfinished -= 1

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
            try:
                if not self._run_one(op):
                    break
            finally:
                self._finished_one()
        self._fail_pending()

    def _run_one(self, op: _Op) -> bool:
        """Run ``op``; False when the worker was stopped inside it."""
        if op.event is not None:
            op.event._finish(self.error or self.failed_transfer,
                             self.error is None and self.failed_transfer is not None)
            self.failed_transfer = None
            return True
        if self.error is not None or self.failed_transfer is not None:
            return True
        try:
            op.fn()
        except _Stopped:
            return False
        except TransferFailed as exc:
            self.failed_transfer = exc.error
            log.debug("%s: a transfer failed: %s", self.name, exc.error)
        except BaseException as exc:  # noqa: BLE001 - stored, re-raised on the host
            self.error = _wrap(exc, f"running {op.what} on {self.name}")
            log.debug("%s failed: %s", self.name, self.error)
        return True

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
