"""The CUDA driver's gate: the lazy loaders of ``cuda.bindings`` and CuPy, the one error checker
(:func:`check`: every driver / runtime status becomes a :class:`~gpuxfer.errors.DriverError` naming the
API, the status and what gpuxfer was doing), the driver's enum values, and :class:`CudaContexts`: the
devices a platform sees and the primary contexts driver calls run in, which every component of
:class:`~gpuxfer.platforms.cuda.CudaPlatform` shares. Importing it loads neither library.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

from ..errors import BadInput, DriverError
from .cuda_entry import CUDA_SUCCESS

# driver enum values (checked against cuda-bindings 12.9 and 13.x; see tests)
CU_STREAM_NON_BLOCKING = 1
CU_EVENT_DISABLE_TIMING = 2
CU_MEMHOSTALLOC_PORTABLE = 1
CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1
_WAIT_GEQ = 0                 # CU_STREAM_WAIT_VALUE_GEQ
_ERR_INVALID_CONTEXT = 201     # CUDA_ERROR_INVALID_CONTEXT
_EVENT_DISABLE_TIMING = 2      # CU_EVENT_DISABLE_TIMING
CUDA_ERROR_NOT_READY = 600
CU_MEMORYTYPE_DEVICE = 2
_LEGACY_STREAM_HANDLES = (0, 1)    # NULL and cudaStreamLegacy; 2 (per-thread default) is not legacy
_DEFAULT_STREAM_HANDLES = (0, 1, 2)  # streams that mean "the current context's"


# --------------------------------------------------------------------------- lazy imports


_DRIVER = None


def _driver():
    global _DRIVER
    if _DRIVER is None:
        from cuda.bindings import driver
        _DRIVER = driver
    return _DRIVER


def _cupy():
    import cupy
    from cupy_backends.cuda.api.runtime import CUDARuntimeError
    return cupy, cupy.cuda.runtime, CUDARuntimeError


# --------------------------------------------------------------------------- the one error checker


def _status_info(status: Any) -> tuple[int, str, str]:
    """``(code, name, text)`` of a driver / runtime status or a CuPy ``CUDARuntimeError``."""
    # CuPy: CUDARuntimeError(status) whose str() is "cudaErrorName: text"
    if isinstance(status, BaseException):
        code = int(getattr(status, "status", -1))
        name, sep, text = str(status).partition(": ")
        if not sep or not name.startswith("cuda"):
            name, text = f"cudaError({code})", str(status)
        return code, name, text
    code = int(status)
    enum_name = type(status).__name__
    try:
        if enum_name == "cudaError_t":           # cuda.bindings runtime status
            from cuda.bindings import runtime
            name = runtime.cudaError_t(code).name
            text = runtime.cudaGetErrorString(runtime.cudaError_t(code))[1]
        else:                                    # CUresult, or a plain int from a ctypes call
            drv = _driver()
            try:
                name = drv.CUresult(code).name
            except ValueError:
                return code, f"CUresult({code})", ""
            try:
                err, text = drv.cuGetErrorString(drv.CUresult(code))
                if int(err) != CUDA_SUCCESS:
                    text = b""
            except Exception:                    # driver library missing (CPU machines): no text
                text = b""
    except Exception:
        return code, getattr(status, "name", f"status({code})"), ""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return code, name, text or ""


def check(result: Any, doing: "str | Callable[[], str]", api: str = "") -> Any:
    """Return the outputs of a CUDA call, or raise :class:`DriverError`.

    ``result`` is what a ``cuda.bindings`` call returns (``(status, *outputs)``;
    the status is a ``CUresult`` / ``cudaError_t``), a bare status (a ctypes
    call's int is read as a ``CUresult``), or a CuPy ``CUDARuntimeError``.
    Returns ``None`` for no output, the output for one, a tuple for several.
    ``doing`` says what gpuxfer was doing ("opening the IPC handle of ..."); hot
    paths pass a callable so the text is only formatted when the call failed.
    """
    if isinstance(result, BaseException):
        code, name, text = _status_info(result)
        raise DriverError(api or "CUDA runtime", name, code, _text(doing), text) from result
    if isinstance(result, tuple):
        if not result:
            raise TypeError("check() got an empty result tuple")
        status, outputs = result[0], result[1:]
    else:
        status, outputs = result, ()
    if int(status) != CUDA_SUCCESS:
        code, name, text = _status_info(status)
        raise DriverError(api or "CUDA driver", name, code, _text(doing), text)
    if not outputs:
        return None
    return outputs[0] if len(outputs) == 1 else outputs


def _text(doing: "str | Callable[[], str]") -> str:
    return doing() if callable(doing) else doing


def _cu(fn: Callable, *args, doing: "str | Callable[[], str]") -> Any:
    """Call a ``cuda.bindings`` function and :func:`check` its result."""
    return check(fn(*args), doing, getattr(fn, "__name__", "CUDA driver"))


def _runtime_api_name(fn: Callable) -> str:
    n = getattr(fn, "__name__", "runtime")
    return "cuda" + n[:1].upper() + n[1:]


class _OnDevice:
    """``with contexts.on(dev):`` -- the device's primary context is current inside (pushed only if needed)."""

    __slots__ = ("_contexts", "_dev", "_pushed")

    def __init__(self, contexts: "CudaContexts", dev: int):
        self._contexts, self._dev, self._pushed = contexts, dev, False

    def __enter__(self):
        self._pushed = self._contexts.make_current(self._dev)
        return self

    def __exit__(self, *exc) -> None:
        if self._pushed:
            self._pushed = False
            _cu(_driver().cuCtxPopCurrent, doing=f"restoring the caller's context after work on cuda:{self._dev}")


class _OnDeviceCtx:
    """Push a given context for the block (used by close(), after the context table is cleared)."""

    def __init__(self, ctx):
        self._ctx = ctx

    def __enter__(self):
        _cu(_driver().cuCtxPushCurrent, self._ctx, doing="making a context current to release its resources")
        return self

    def __exit__(self, *exc) -> None:
        _cu(_driver().cuCtxPopCurrent, doing="restoring the caller's context")


class CudaContexts:
    """The devices this process sees and their primary contexts, retained on first use: device checks,
    the context switches every driver call runs in (:meth:`on`, :meth:`stream_op`, :meth:`rt`), the
    driver's version and device attributes. Closing it (:meth:`detach`) closes the platform: new
    resources are refused from then on."""

    def __init__(self):
        self._lock = threading.RLock()
        self.closed = False
        self.count: int | None = None
        self.ctxs: dict[int, tuple[Any, int]] = {}       # device -> (CUcontext, as int)
        self._driver_version: int | None = None

    def check_open(self) -> None:
        if self.closed:
            raise BadInput("the cuda platform is closed")

    def device_count(self) -> int:
        if self.count is None:
            drv = _driver()
            _cu(drv.cuInit, 0, doing="initialising the CUDA driver")
            self.count = int(_cu(drv.cuDeviceGetCount, doing="counting CUDA devices"))
        return self.count

    def check_device(self, device: int) -> int:
        if isinstance(device, bool) or not isinstance(device, (int, np.integer)):
            raise BadInput(f"device must be an integer, got {device!r}")
        n = self.device_count()
        if not 0 <= int(device) < n:
            raise BadInput(f"device {device!r} does not exist: {n} CUDA device(s) are visible")
        return int(device)

    def retain(self, device: int) -> tuple[Any, int]:
        with self._lock:
            if device not in self.ctxs:
                ctx = _cu(_driver().cuDevicePrimaryCtxRetain, device,
                          doing=f"retaining the primary context of cuda:{device}")
                self.ctxs[device] = (ctx, int(ctx))
            return self.ctxs[device]

    def make_current(self, device: int) -> bool:
        """Make ``device``'s primary context current; True if it was pushed (pop it after)."""
        ctx, _ = self.retain(device)
        if self.is_current(device):
            return False
        _cu(_driver().cuCtxPushCurrent, ctx, doing=f"making the primary context of cuda:{device} current")
        return True

    def is_current(self, device: int) -> bool:
        """Is ``device``'s primary context (already retained) current on this thread?"""
        entry = self.ctxs.get(device)
        if entry is None:
            return False
        _, cur = _driver().cuCtxGetCurrent()
        return cur is not None and int(cur) == entry[1]

    def on(self, device: int) -> _OnDevice:
        return _OnDevice(self, device)

    def stream_op(self, s, fn: Callable, *args, doing: "str | Callable[[], str]") -> None:
        """``fn(*args)`` (a driver call queued on stream ``s``) in ``s``'s context, errors through :func:`check`.

        The per-step hot path. A created stream names its context, and stream-ordered
        calls on it run there whatever context is current (measured on 2x H200:
        copies, flag writes and waits on device 1's stream with device 0's context
        current), so it is one driver call. The default streams (handles 0-2) mean
        "the current context's", so for them the device's context is made current
        first -- without that check, work meant for device 1's default stream would
        land on device 0's (measured: an event record there fails, INVALID_HANDLE).
        A process that sees one device skips the check (a driver call per op): any
        context current on its thread is that device's (torch's primary context; a
        context of the caller's own, made with the driver API, would take the work),
        and with none current the call fails with INVALID_CONTEXT and is repeated
        with the device's context pushed.
        """
        if s.handle in _DEFAULT_STREAM_HANDLES and self.count != 1 and not self.is_current(s.device):
            with self.on(s.device):
                _cu(fn, *args, doing=doing)
            return
        res = fn(*args)
        status = int(res[0])
        if status == CUDA_SUCCESS:
            return
        if status != _ERR_INVALID_CONTEXT:
            check(res, doing, fn.__name__)
            return
        with self.on(s.device):           # no context current on this thread: repeat it with one pushed
            _cu(fn, *args, doing=doing)

    @staticmethod
    def rt(device: int, fn: Callable, *args, doing: str) -> Any:
        """Call a CuPy runtime function with ``device`` current; CuPy errors become DriverError via check()."""
        cupy, _, CUDARuntimeError = _cupy()
        try:
            with cupy.cuda.Device(device):
                return fn(*args)
        except CUDARuntimeError as exc:
            check(exc, doing, _runtime_api_name(fn))

    def driver_version(self) -> int:
        if self._driver_version is None:
            self._driver_version = int(_cu(_driver().cuDriverGetVersion, doing="reading the driver version"))
        return self._driver_version

    def attr(self, device: int, name: str) -> int:
        drv = _driver()
        attr = getattr(drv.CUdevice_attribute, name)
        return int(_cu(drv.cuDeviceGetAttribute, attr, device, doing=f"reading {name} of cuda:{device}"))

    def detach(self) -> "Release | None":
        """Close: refuse new resources from now on and hand the retained contexts to a :class:`Release`
        (None where this was closed already)."""
        with self._lock:
            if self.closed:
                return None
            self.closed = True
            ctxs, self.ctxs = self.ctxs, {}
        return Release(ctxs)


class Release:
    """What closing a platform releases, component by component: each releases its resources per device with
    that device's context pushed (:meth:`on_each`, through :meth:`attempt`, which keeps going past a failure),
    then :meth:`finish` releases the primary contexts and raises the first failure."""

    def __init__(self, ctxs: dict[int, tuple[Any, int]]):
        self.ctxs = ctxs
        self.errors: list[BaseException] = []

    def attempt(self, fn: Callable, *args, doing: str) -> None:
        try:
            _cu(fn, *args, doing=doing)
        except Exception as exc:  # keep releasing the rest, report the first failure
            self.errors.append(exc)

    def on_each(self, devices, release: Callable[[int], None]) -> None:
        """``release(device)`` for each of ``devices`` with a retained context, that context current."""
        for dev in sorted(devices):
            if dev not in self.ctxs:
                continue
            try:
                with _OnDeviceCtx(self.ctxs[dev][0]):
                    release(dev)
            except Exception as exc:
                self.errors.append(exc)

    def finish(self) -> None:
        if self.ctxs:
            drv = _driver()
            for dev in sorted(self.ctxs):
                self.attempt(drv.cuDevicePrimaryCtxRelease, dev, doing=f"releasing the primary context of cuda:{dev}")
        if self.errors:
            raise self.errors[0]
