"""The CUDA driver's entry points through ctypes, apart from the platform that calls them.

``cuGetProcAddress`` gives the address of a driver function for one ABI version;
called through ``ctypes`` with plain integers it costs no per-call argument
objects. Resolved here, each once per platform (``None``/``False``: the driver has
none, and the platform keeps its checked ``cuda.bindings`` call):

* ``cuMemcpyBatchAsync`` (:func:`resolve_batch`): its C signature differs between
  CUDA 12.8 (``..., size_t *failIdx, CUstream``) and 13.0 (``..., CUstream``), so it
  is requested for one ABI (:data:`BATCH_ABIS`) and called with exactly that
  signature; the descriptor arrays are cut and laid out by :func:`plan_batch_copies`
  and :func:`batch_call_args`, and :func:`batch_status` reads any result shape;
* ``cuStreamBatchMemOp`` (:func:`resolve_memop`): a row of flag operations in one call;
* ``cuStreamWriteValue64``, ``cuStreamWaitValue64``, ``cuGraphLaunch`` and
  ``cuCtxGetCurrent`` (:func:`resolve_step_fns`): the per-step calls of
  :meth:`~gpuxfer.platforms.cuda.CudaPlatform.stream_calls`.
"""
from __future__ import annotations

import ctypes
from typing import Any, Callable

import numpy as np

from ..errors import BadInput, DriverError
from .base import as_int64_array

CUDA_SUCCESS = 0
BATCH_MAX_PER_CALL = 8192          # copies per cuMemcpyBatchAsync call
BATCH_ABIS = (12080, 13000)        # entry-point versions of cuMemcpyBatchAsync we know the C signature of
SIZE_MAX = (1 << 64) - 1

# env override for the batch path (tests and debugging): "auto" (default), "ctypes", "ctypes12080"
# (the CUDA 12.8 entry point even on a 13.x driver), "bindings" (cuda.bindings' wrapper) or "loop"
BATCH_MODE_ENV = "GPUXFER_CUDA_BATCH"


def cuda_version_str(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


# --------------------------------------------------------------------------- cuMemcpyBatchAsync arguments (pure)


class _CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CUmemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes`` (24 bytes), as in ``cuda.h`` 12.8+ and 13.x."""

    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _CUmemLocation),
                ("dstLocHint", _CUmemLocation), ("flags", ctypes.c_uint)]


def plan_batch_copies(dsts, srcs, sizes, max_per_call: int = BATCH_MAX_PER_CALL
                      ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Validate copy descriptors and cut them into chunks of at most ``max_per_call`` copies.

    Zero-byte copies are dropped. Each chunk is ``(dsts, srcs, sizes)`` as
    contiguous ``uint64`` arrays (``CUdeviceptr`` / ``size_t`` layout), ready to
    hand to the driver by address.
    """
    d = as_int64_array(dsts, "dsts")
    s = as_int64_array(srcs, "srcs")
    n = as_int64_array(sizes, "sizes")
    if not len(d) == len(s) == len(n):
        raise BadInput(f"dsts, srcs and sizes differ in length: {len(d)}, {len(s)}, {len(n)}")
    if int(max_per_call) < 1:
        raise BadInput(f"max_per_call must be >= 1, got {max_per_call}")
    if len(n) and int(n.min()) < 0:
        raise BadInput(f"a copy size is negative (copy {int(np.argmin(n))}: {int(n.min())} bytes)")
    keep = n > 0
    if not keep.all():
        d, s, n = d[keep], s[keep], n[keep]
    if len(n) and (int(d.min()) <= 0 or int(s.min()) <= 0):
        raise BadInput("a copy has a null (or negative) source or destination pointer")
    d64, s64, n64 = (np.ascontiguousarray(a).view(np.uint64) for a in (d, s, n))
    m = int(max_per_call)
    return [(d64[i:i + m], s64[i:i + m], n64[i:i + m]) for i in range(0, len(n64), m)]


def batch_call_args(abi: int, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, attrs_addr: int,
                    attr_idxs_addr: int, fail_idx_addr: int, stream_handle: int) -> tuple:
    """The C arguments of one ``cuMemcpyBatchAsync`` call (one attribute for all copies).

    ABI 12080: ``(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, failIdx, hStream)``;
    ABI 13000: the same without ``failIdx``.
    """
    if not (len(dsts) == len(srcs) == len(sizes)) or not len(dsts):
        raise BadInput("a batch needs equally long, non-empty dsts, srcs and sizes")
    for a in (dsts, srcs, sizes):
        if a.dtype != np.uint64 or not a.flags.c_contiguous:
            raise BadInput("batch arrays must be contiguous uint64 (use plan_batch_copies)")
    head = (dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, len(dsts), attrs_addr, attr_idxs_addr, 1)
    if abi == 12080:
        return head + (fail_idx_addr, stream_handle)
    if abi == 13000:
        return head + (stream_handle,)
    raise BadInput(f"unknown cuMemcpyBatchAsync ABI {abi}; known: {BATCH_ABIS}")


def batch_status(result: Any) -> tuple[Any, int | None]:
    """``(status, fail_idx)`` of a batch call, whatever its shape.

    * ctypes entry point: a bare status int;
    * cuda.bindings 12.8 / 12.9: ``(err, failIdx)`` (``failIdx`` is None on error);
    * cuda.bindings 13.x: ``(err,)``.
    ``fail_idx`` is None when unknown or ``SIZE_MAX`` (not about one copy).
    """
    if isinstance(result, tuple):
        if len(result) == 1:
            return result[0], None
        if len(result) == 2:
            fail = result[1]
            return result[0], (None if fail is None or int(fail) == SIZE_MAX else int(fail))
        raise TypeError(f"unexpected cuMemcpyBatchAsync result of length {len(result)}: {result!r}")
    return result, None


# --------------------------------------------------------------------------- entry points


def resolve_batch(driver: Callable[[], Any], driver_version: Callable[[], int], mode: str) -> tuple:
    """How ``copy_batch_async`` reaches ``cuMemcpyBatchAsync`` under ``GPUXFER_CUDA_BATCH=mode``:
    ``("ctypes", fn, abi)`` | ``("bindings", None, None)`` | ``("loop", why, None)``. ``driver`` gives the
    ``cuda.bindings`` driver module and ``driver_version`` the driver's CUDA version, both asked only where
    the mode needs them. Raises :class:`~gpuxfer.errors.DriverError` when a forced ctypes mode finds no
    entry point."""
    if mode == "loop":
        return ("loop", f"{BATCH_MODE_ENV}=loop", None)
    drv = driver()
    ver = driver_version()
    if ver < 12080:
        return ("loop", f"driver CUDA {cuda_version_str(ver)} has no cuMemcpyBatchAsync (needs 12.8)", None)
    if mode == "bindings":
        if not hasattr(drv, "cuMemcpyBatchAsync"):
            return ("loop", "this cuda.bindings has no cuMemcpyBatchAsync", None)
        return ("bindings", None, None)
    # the newest ABI this driver has; "ctypes12080" forces the 12.8 one (a 13.x driver still serves it)
    abi = 12080 if mode == "ctypes12080" or ver < 13000 else 13000
    err, pfn, status = drv.cuGetProcAddress(b"cuMemcpyBatchAsync", abi, 0)
    if int(err) != CUDA_SUCCESS or not pfn or (status is not None and int(status) != 0):
        why = f"cuGetProcAddress(cuMemcpyBatchAsync, {abi}) found no entry point ({err}, {status})"
        if mode != "auto":
            bad = err if int(err) != CUDA_SUCCESS else status
            raise DriverError("cuGetProcAddress", getattr(bad, "name", "CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND"),
                              int(bad or 0), f"resolving cuMemcpyBatchAsync for {BATCH_MODE_ENV}={mode}", why)
        return ("loop", why, None)
    args = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_size_t]
    args += [ctypes.c_void_p, ctypes.c_void_p] if abi == 12080 else [ctypes.c_void_p]
    fn = ctypes.CFUNCTYPE(ctypes.c_int, *args)(int(pfn))
    return ("ctypes", fn, abi)


def resolve_memop(driver: Callable[[], Any]):
    """The ctypes entry point of ``cuStreamBatchMemOp`` (the CUDA 12 ABI), or False (``driver`` gives the
    ``cuda.bindings`` driver module)."""
    err, pfn, status = driver().cuGetProcAddress(b"cuStreamBatchMemOp", 12000, 0)
    if int(err) != CUDA_SUCCESS or not pfn or (status is not None and int(status) != 0):
        return False        # flag operations go one call each
    return ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p,
                            ctypes.c_uint)(int(pfn))


def resolve_step_fns(driver: Callable[[], Any]):
    """ctypes entry points of ``cuStreamWriteValue64``, ``cuStreamWaitValue64``, ``cuGraphLaunch``,
    ``cuCtxGetCurrent`` and ``cuMemcpyAsync`` (the CUDA 12 ABI; they release the GIL while they run, as a
    blocked launch may), or False (``driver`` gives the ``cuda.bindings`` driver module)."""
    c = ctypes
    flag = (c.c_void_p, c.c_uint64, c.c_uint64, c.c_uint)
    out = []
    for name, args in ((b"cuStreamWriteValue64", flag), (b"cuStreamWaitValue64", flag),
                       (b"cuGraphLaunch", (c.c_void_p, c.c_void_p)), (b"cuCtxGetCurrent", (c.c_void_p,)),
                       (b"cuMemcpyAsync", (c.c_uint64, c.c_uint64, c.c_size_t, c.c_void_p))):
        try:
            err, pfn, status = driver().cuGetProcAddress(name, 12000, 0)
        except Exception:  # noqa: BLE001 - an older cuda.bindings: the checked methods
            return False
        if int(err) != CUDA_SUCCESS or not pfn or (status is not None and int(status) != 0):
            return False
        out.append(c.CFUNCTYPE(c.c_int, *args)(int(pfn)))
    return tuple(out)
