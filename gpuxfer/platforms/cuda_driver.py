"""The CUDA driver's gate: the lazy loaders of ``cuda.bindings`` and CuPy, the one error checker
(:func:`check`: every driver / runtime status becomes a :class:`~gpuxfer.errors.DriverError` naming the
API, the status and what gpuxfer was doing), the driver's enum values, and the context switches driver
calls run in. Importing it loads neither library.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from ..errors import DriverError
from .cuda_entry import CUDA_SUCCESS

if TYPE_CHECKING:
    from .cuda import CudaPlatform

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
    """``with plat._on(dev):`` -- the device's primary context is current inside (pushed only if needed)."""

    __slots__ = ("_plat", "_dev", "_pushed")

    def __init__(self, plat: "CudaPlatform", dev: int):
        self._plat, self._dev, self._pushed = plat, dev, False

    def __enter__(self):
        self._pushed = self._plat._make_current(self._dev)
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
