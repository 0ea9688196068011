"""CUDA flags: 64-bit words written and waited on streams (``cuStreamWriteValue64`` /
``cuStreamWaitValue64``, ``cuStreamBatchMemOp``), read and written from the host on a per-device helper
stream with a bounded poll, the per-step :meth:`stream_calls` through the driver's entry points, and the
probe that stream memory operations really work: :class:`CudaFlags`, a component of
:class:`~gpuxfer.platforms.cuda.CudaPlatform`, and :func:`run_probe`.
"""
from __future__ import annotations

import ctypes
import threading
import time

import numpy as np

from ..errors import BadInput, GpuxferError, TransferTimeout
from .base import FLAG_OP_WORDS, RELEASE_VALUE, Platform, Stream, StreamCalls, check_flag_ptr
from .cuda_driver import (_DEFAULT_STREAM_HANDLES, _ERR_INVALID_CONTEXT, _WAIT_GEQ, CU_MEMHOSTALLOC_PORTABLE,
                          CU_STREAM_NON_BLOCKING, CUDA_ERROR_NOT_READY, CudaContexts, Release, _cu, _driver,
                          check)
from .cuda_entry import CUDA_SUCCESS, resolve_memop, resolve_step_fns
from .cuda_graphs import CudaGraph
from .cuda_streams import as_stream

_MASK64 = (1 << 64) - 1


class _Helper:
    """Per-device state for host reads / writes of flags: a stream and 8 pinned bytes."""

    def __init__(self, stream: int, host_ptr: int):
        self.stream = stream
        self.host_ptr = host_ptr
        self.lock = threading.Lock()


class _RelaxedCapture:
    """``with _RelaxedCapture():`` -- this thread's stream-capture mode is relaxed inside.

    A graph capture in torch's default (global) mode forbids "unsafe" calls -- a stream query or
    synchronise, a synchronous copy -- on every thread while it lasts, and such a call invalidates
    it. The host's flag reads and writes (a copy on a helper stream, then a bounded poll) run
    here, so a watchdog release or a failure found during someone's capture leaves that capture
    intact.
    """

    __slots__ = ("_old",)

    def __enter__(self):
        d = _driver()
        self._old = _cu(d.cuThreadExchangeStreamCaptureMode, d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED,
                        doing="relaxing this thread's stream-capture mode for a host flag access")
        return self

    def __exit__(self, *exc) -> None:
        _cu(_driver().cuThreadExchangeStreamCaptureMode, self._old,
            doing="restoring this thread's stream-capture mode")


def _u64(value: int, what: str = "flag value") -> int:
    if type(value) is int and 0 <= value <= _MASK64:     # the per-step case
        return value
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise BadInput(f"a {what} must be an integer, got {type(value).__name__}")
    value = int(value)
    if not -(1 << 63) <= value <= _MASK64:
        raise BadInput(f"{what} {value} does not fit in 64 bits")
    return value & _MASK64


class CudaFlags:
    """The flags of a :class:`~gpuxfer.platforms.cuda.CudaPlatform`: stream writes and waits (one call, or a row
    of them through ``cuStreamBatchMemOp``), host reads and writes on a per-device helper stream given up after
    ``host_op_timeout_s``, the per-step :meth:`stream_calls`, and the probe's results per device."""

    def __init__(self, contexts: CudaContexts, host_op_timeout_s: float):
        self._ctx = contexts
        self.host_op_timeout_s = host_op_timeout_s
        self._lock = threading.RLock()
        self._helpers: dict[int, _Helper] = {}
        self._memop = None          # cuStreamBatchMemOp through ctypes (False where missing)
        self._step_fns = None       # stream_calls' entry points through ctypes (False where missing)
        self._memop_arrays: dict[int, tuple] = {}     # id -> (flag_ops array, its address, rows)
        self._probes: dict[int, str | None] = {}

    def write_flag(self, stream: Stream, ptr: int, value: int) -> None:
        """``cuStreamWriteValue64`` (default flags: a fence before the write). ``ptr`` may be a peer mapping."""
        s = as_stream(stream)
        ptr = int(ptr)
        check_flag_ptr(ptr)
        v = _u64(value)
        self._ctx.stream_op(s, _driver().cuStreamWriteValue64, s.handle, ptr, v, 0,
                            doing=lambda: f"writing flag 0x{ptr:x} := {int(value)} on {s!r}")

    def wait_flag(self, stream: Stream, ptr: int, value: int) -> None:
        """``cuStreamWaitValue64`` with ``CU_STREAM_WAIT_VALUE_GEQ`` (cyclic: ``(int64)(*ptr - value) >= 0``)."""
        s = as_stream(stream)
        ptr = int(ptr)
        check_flag_ptr(ptr)
        v = _u64(value)
        drv = _driver()
        self._ctx.stream_op(s, drv.cuStreamWaitValue64, s.handle, ptr, v, _WAIT_GEQ,
                            doing=lambda: f"enqueuing a wait for flag 0x{ptr:x} >= {int(value)} on {s!r}")

    def flag_ops(self, stream: Stream, ops: np.ndarray) -> bool:
        """``cuStreamBatchMemOp``: every row of ``ops`` (a ``flag_ops_array``, its rows laid out as
        ``CUstreamBatchMemOpParams``) in one driver call, resolved with ``cuGetProcAddress`` and called
        through ctypes with the array's address (no per-call conversion). False, with nothing queued, where
        the entry point is missing (the caller then queues one call per row)."""
        s = as_stream(stream)
        fn = self._memop
        if fn is None:
            fn = self._memop = resolve_memop(_driver)
        if fn is False:
            return False
        entry = self._memop_arrays.get(id(ops))
        if entry is None or entry[0] is not ops:
            if (type(ops) is not np.ndarray or ops.dtype != np.uint64 or ops.ndim != 2
                    or ops.shape[1] != FLAG_OP_WORDS or not ops.flags.c_contiguous or not 0 < len(ops) <= 256):
                raise BadInput(f"flag_ops needs a flag_ops_array (1-256 rows of {FLAG_OP_WORDS} uint64 words)")
            if len(self._memop_arrays) > 64:
                self._memop_arrays.clear()
            entry = self._memop_arrays[id(ops)] = (ops, ops.ctypes.data, len(ops))
        _, addr, n = entry
        if s.handle in _DEFAULT_STREAM_HANDLES and self._ctx.count != 1 and not self._ctx.is_current(s.device):
            with self._ctx.on(s.device):
                rc = fn(s.handle, n, addr, 0)
        else:
            rc = fn(s.handle, n, addr, 0)
            if rc == _ERR_INVALID_CONTEXT:
                with self._ctx.on(s.device):
                    rc = fn(s.handle, n, addr, 0)
        if rc:
            check(rc, lambda: f"queueing {n} flag operations on {s!r}", "cuStreamBatchMemOp")
        return True

    def _helper(self, device: int) -> _Helper:
        h = self._helpers.get(device)
        if h is not None:
            return h
        with self._lock:
            if device not in self._helpers:
                drv = _driver()
                with self._ctx.on(device):
                    st = int(_cu(drv.cuStreamCreate, CU_STREAM_NON_BLOCKING,
                                 doing=f"creating the flag helper stream of cuda:{device}"))
                    try:
                        host = int(_cu(drv.cuMemHostAlloc, 64, CU_MEMHOSTALLOC_PORTABLE,
                                       doing=f"allocating pinned memory for host flag access on cuda:{device}"))
                    except Exception:
                        _cu(drv.cuStreamDestroy, st, doing="destroying the flag helper stream")
                        raise
                self._helpers[device] = _Helper(st, host)
            return self._helpers[device]

    def _finish_helper(self, h: _Helper, device: int, ptr: int, what: str, expected: int) -> None:
        """Poll the helper stream alone until its copy is done; TransferTimeout past host_op_timeout_s."""
        drv = _driver()
        deadline = time.monotonic() + self.host_op_timeout_s
        spins, delay = 0, 2e-6
        while True:
            (err,) = drv.cuStreamQuery(h.stream)
            if int(err) == CUDA_SUCCESS:
                return
            if int(err) != CUDA_ERROR_NOT_READY:
                check((err,), f"{what} of flag 0x{ptr:x} on cuda:{device}", "cuStreamQuery")
            if time.monotonic() > deadline:
                raise TransferTimeout(rank=-1, step=-1, flag=f"0x{ptr:x}", expected=expected, seen=None,
                                      timeout_s=self.host_op_timeout_s,
                                      what=f"{what} on cuda:{device}'s helper stream did not finish: the "
                                           "device's copy queue is blocked")
            spins += 1
            if spins > 200:
                time.sleep(delay)
                delay = min(delay * 2, 1e-3)

    def read_flag(self, ptr: int, device: int) -> int:
        """An 8-byte device-to-host copy on the device's helper stream, polled with a timeout."""
        ptr = int(ptr)
        check_flag_ptr(ptr)
        device = self._ctx.check_device(device)
        h = self._helper(device)
        with h.lock, self._ctx.on(device), _RelaxedCapture():
            _cu(_driver().cuMemcpyDtoHAsync, h.host_ptr, ptr, 8, h.stream,
                doing=f"reading flag 0x{ptr:x} from the host (cuda:{device})")
            self._finish_helper(h, device, ptr, "a host read", -1)
            return ctypes.c_int64.from_address(h.host_ptr).value

    def host_write_flag(self, ptr: int, value: int, device: int) -> None:
        """An 8-byte host-to-device copy on the device's helper stream, waited for with a timeout."""
        ptr = int(ptr)
        check_flag_ptr(ptr)
        v = _u64(value)
        device = self._ctx.check_device(device)
        h = self._helper(device)
        with h.lock, self._ctx.on(device), _RelaxedCapture():
            ctypes.c_uint64.from_address(h.host_ptr + 8).value = v
            _cu(_driver().cuMemcpyHtoDAsync, ptr, h.host_ptr + 8, 8, h.stream,
                doing=f"writing flag 0x{ptr:x} := {int(value)} from the host (cuda:{device})")
            self._finish_helper(h, device, ptr, "a host write", int(value))

    # ---- a per-step path ----
    def stream_calls(self, stream: Stream, checked: Platform) -> StreamCalls | None:
        """The flag, graph and copy calls bound to ``stream``: one driver call each, through its entry point
        (``cuGetProcAddress``, the CUDA 12 ABI, called through ctypes with plain integers: no per-call
        argument objects), where the arguments are in-range integers (and a graph of this platform;
        ``flag_ops``: an array the checked method took before, its first call goes there), with
        the stream's checks done here, once. Any other argument, and any call the driver refuses (no
        context current on this thread included), goes through the checked method, which repeats it in
        the stream's context or raises what is wrong. A default stream's handle means "the current
        context's" stream: in a process that sees several devices each call first asks the driver which
        context is current (one more entry-point call) and takes the checked method unless it is the
        device's. The checked methods are ``checked``'s (the platform's ``write_flag``, ``wait_flag``,
        ``launch_graph``, ``copy_async`` and ``flag_ops``). None where the driver has no entry points (the
        caller keeps the checked methods)."""
        s = as_stream(stream)
        fns = self._step_fns
        if fns is None:
            fns = self._step_fns = resolve_step_fns(_driver)
        if not fns:
            return None
        write, wait, launch, current, memcpy = fns
        h = s.handle
        write_flag, wait_flag, launch_graph, copy_async = checked.write_flag, checked.wait_flag, \
            checked.launch_graph, checked.copy_async
        other = None            # None, or a callable: True where another context may be current
        if h in _DEFAULT_STREAM_HANDLES and self._ctx.device_count() != 1:
            ctx, c = self._ctx.retain(s.device)[1], ctypes

            def other() -> bool:
                cur = c.c_void_p()
                return bool(current(c.byref(cur))) or cur.value != ctx

        def write_fast(ptr: int, value: int) -> None:
            if (type(ptr) is not int or ptr & 7 or type(value) is not int or not 0 <= value <= _MASK64 or s._closed
                    or (other is not None and other()) or write(h, ptr, value, 0)):
                write_flag(s, ptr, value)

        def wait_fast(ptr: int, value: int) -> None:
            if (type(ptr) is not int or ptr & 7 or type(value) is not int or not 0 <= value <= _MASK64 or s._closed
                    or (other is not None and other()) or wait(h, ptr, value, _WAIT_GEQ)):
                wait_flag(s, ptr, value)

        def launch_fast(graph) -> None:
            if (type(graph) is not CudaGraph or s._closed or (other is not None and other())
                    or launch(graph.handle, h)):
                launch_graph(s, graph)

        def copy_fast(dst: int, src: int, nbytes: int) -> None:
            if (type(dst) is not int or type(src) is not int or type(nbytes) is not int or not 0 < nbytes <= _MASK64
                    or not 0 <= dst <= _MASK64 or not 0 <= src <= _MASK64 or s._closed
                    or (other is not None and other()) or memcpy(dst, src, nbytes, h)):
                copy_async(s, dst, src, nbytes)

        memop = self._memop
        if memop is None:
            memop = self._memop = resolve_memop(_driver)
        if memop is False:
            return StreamCalls(s, write_fast, wait_fast, launch_fast, lambda ops: checked.flag_ops(s, ops), copy_fast)
        arrays: dict = {}       # id -> (array, address, rows) of the arrays the checked method took

        def flag_ops_fast(ops) -> None:
            entry = arrays.get(id(ops))
            if (entry is None or entry[0] is not ops or s._closed or (other is not None and other())
                    or memop(h, entry[2], entry[1], 0)):
                checked.flag_ops(s, ops)        # checks the array (BadInput): later calls skip that
                if entry is None or entry[0] is not ops:
                    if len(arrays) > 64:
                        arrays.clear()
                    arrays[id(ops)] = (ops, ops.ctypes.data, len(ops))

        return StreamCalls(s, write_fast, wait_fast, launch_fast, flag_ops_fast, copy_fast)

    def probe(self, plat: Platform, device: int, timeout_s: float) -> str | None:
        """:func:`run_probe` on ``plat``'s ``device`` (a checked index), once per device: later calls return its first
        answer."""
        if device in self._probes:
            return self._probes[device]
        why = run_probe(plat, device, timeout_s)
        with self._lock:
            self._probes.setdefault(device, why)
        return self._probes[device]

    def close(self, release: Release) -> None:
        """Destroy the helper streams and free their pinned words."""
        with self._lock:
            helpers, self._helpers = self._helpers, {}
        if not helpers:
            return
        drv = _driver()

        def on_device(dev: int) -> None:
            release.attempt(drv.cuStreamDestroy, helpers[dev].stream,
                            doing=f"destroying the flag helper stream of cuda:{dev}")
            release.attempt(drv.cuMemFreeHost, helpers[dev].host_ptr,
                            doing=f"freeing the pinned flag memory of cuda:{dev}")

        release.on_each(helpers, on_device)


def run_probe(plat: Platform, device: int, timeout_s: float) -> str | None:
    """None if 64-bit stream write / wait really work on ``plat``'s ``device``, else why not.

    On a fresh buffer and a fresh stream: write 7 + wait >= 7 must complete and
    read back 7; then a wait >= 1 on a zero word must hold the stream until the
    host writes 1. If a wait never completes, the buffer and stream are leaked on
    purpose (freeing them could block behind the stuck wait).
    """
    try:
        buf = plat.alloc(64, device)
    except GpuxferError as exc:
        return f"could not allocate the probe buffer: {exc}"
    stream = None
    stuck = False
    try:
        stream = plat.create_stream(device)
        plat.memset_async(stream, buf.ptr, 0, 64)
        plat.write_flag(stream, buf.ptr, 7)
        plat.wait_flag(stream, buf.ptr, 7)
        if not plat.event_wait(plat.record_event(stream), timeout_s):
            stuck = True
            return f"a stream write of 7 then a wait for >= 7 did not complete within {timeout_s:g} s"
        seen = plat.read_flag(buf.ptr, device)
        if seen != 7:
            return f"cuStreamWriteValue64 wrote nothing visible: read back {seen}, expected 7"
        plat.wait_flag(stream, buf.ptr + 8, 1)
        held = plat.record_event(stream)
        time.sleep(0.005)
        if plat.event_query(held):
            return "cuStreamWaitValue64 did not hold the stream (a wait for >= 1 on a zero word completed)"
        plat.host_write_flag(buf.ptr + 8, 1, device)
        if not plat.event_wait(held, timeout_s):
            stuck = True
            return f"a stream wait was not released within {timeout_s:g} s of the host writing the flag"
        return None
    except GpuxferError as exc:
        return f"{exc}"
    finally:
        if stuck:
            try:   # try to let it go; leak the buffer and stream either way
                plat.host_write_flag(buf.ptr, RELEASE_VALUE, device)
                plat.host_write_flag(buf.ptr + 8, RELEASE_VALUE, device)
            except Exception:
                pass
            buf._closed = True          # leaked on purpose: freeing could block behind the wait
        else:
            if stream is not None:
                stream.close()
            buf.close()
