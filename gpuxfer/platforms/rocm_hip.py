"""hip-python for the ROCm platform: the HIP enum values gpuxfer passes, the lazy import of hip-python,
the version checks detection runs, the one error checker every call goes through (:func:`hip_call`), the
10.x signature shim (:class:`HipApi`), the devices a platform sees (:class:`HipDevices`, shared by the
components of :class:`~gpuxfer.platforms.rocm.RocmPlatform`) and an IPC handle's 64 raw bytes. Importing it
loads no HIP.
"""
from __future__ import annotations

import ctypes
import importlib
import os
import re
from contextlib import contextmanager
from typing import Any, Iterable

import numpy as np

from .. import config
from ..common import package_version
from ..errors import BadInput, DriverError

HIP_SUCCESS = 0
HIP_ERROR_NOT_READY = 600
HIP_DEVICE_MALLOC_DEFAULT = 0x0
HIP_MALLOC_SIGNAL_MEMORY = 0x2
# hipDeviceMallocUncached is not exported by hip-python (checked in 6.4.4, 7.2.2 and
# 10.0.0.0.1.2); its value is `#define hipDeviceMallocUncached 0x3` in HIP's
# include/hip/hip_runtime_api.h (ROCm/clr; also in the hipExtMallocWithFlags
# docstring of the bindings), handled in ROCm/clr hipamd/src/hip_memory.cpp.
HIP_DEVICE_MALLOC_UNCACHED = 0x3
HIP_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1
HIP_STREAM_WAIT_VALUE_GTE = 0
HIP_MEMCPY_HOST_TO_DEVICE = 1
HIP_MEMCPY_DEVICE_TO_HOST = 2
HIP_MEMCPY_DEFAULT = 4
HIP_MEMCPY_DEVICE_TO_DEVICE_NOCU = 1024
IPC_HANDLE_BYTES = 64
MASK64 = (1 << 64) - 1
HSA_AMD_LINK_INFO_TYPE_PCIE = 2
HSA_AMD_LINK_INFO_TYPE_XGMI = 4

#: how long a host read or write of a flag word (an 8-byte copy) may take, in seconds
HOST_FLAG_TIMEOUT_ENV = "GPUXFER_ROCM_HOST_FLAG_TIMEOUT_S"
HOST_FLAG_TIMEOUT_S = config.VARS[HOST_FLAG_TIMEOUT_ENV].default


def host_flag_timeout_from_env() -> float:
    """``$GPUXFER_ROCM_HOST_FLAG_TIMEOUT_S`` (default 10): a finite number of seconds > 0, else
    :class:`BadInput` naming the variable."""
    return config.get(HOST_FLAG_TIMEOUT_ENV)


# --------------------------------------------------------------------------- hip-python access


def _import_hip():
    """``hip.hip`` of hip-python (tests replace this function to inject a fake)."""
    from hip import hip  # noqa: PLC0415 - lazily, so importing gpuxfer never needs hip-python
    return hip


def hip_python_version() -> str | None:
    v = package_version("hip-python", "rocm-bindings-hip")
    if v:
        return v
    try:
        return str(importlib.import_module("hip").__version__)
    except Exception:  # noqa: BLE001
        return None


def _major_minor(text: Any) -> tuple[int, int] | None:
    if isinstance(text, (tuple, list)) and len(text) >= 2:
        try:
            return int(text[0]), int(text[1])
        except (TypeError, ValueError):
            return None
    m = re.match(r"\s*(\d+)\.(\d+)", str(text or ""))
    return (int(m.group(1)), int(m.group(2))) if m else None


def binding_hip_version() -> tuple[int, int] | None:
    """The HIP version (major, minor) the installed hip-python was generated for.

    Every hip-python (5.4 .. 10.x) exposes ``hip.HIP_VERSION_TUPLE``; 10.x maps
    it from ``rocm.version`` (ROCm 10.0 = HIP 7.15).
    """
    try:
        return _major_minor(getattr(importlib.import_module("hip"), "HIP_VERSION_TUPLE", None))
    except Exception:  # noqa: BLE001
        return None


def torch_hip_version() -> str | None:
    try:
        import torch
    except Exception:  # noqa: BLE001
        return None
    return getattr(torch.version, "hip", None)


def mapped_hip_runtimes(maps: str = "/proc/self/maps") -> set[str]:
    """Real paths of every ``libamdhip64`` mapped into this process."""
    out = set()
    try:
        with open(maps) as fh:
            for line in fh:
                parts = line.split(None, 5)
                if len(parts) == 6:
                    path = parts[5].strip()
                    if os.path.basename(path).startswith("libamdhip64"):
                        out.add(os.path.realpath(path))
    except OSError:
        pass
    return out


def hip_error_name(hip, code: int) -> str:
    try:
        return hip.hipError_t(code).name
    except Exception:  # noqa: BLE001
        return f"hipError({code})"


def hip_check(hip, result: Any, api: str, doing: str, ok: Iterable[int] = (HIP_SUCCESS,)) -> tuple:
    """Check a hip-python result ``(hipError_t, *outputs)``; return the outputs (a tuple, maybe empty)."""
    if not isinstance(result, tuple) or not result:
        raise DriverError(api, "UNEXPECTED_RESULT", -1, doing, f"hip-python returned {result!r}")
    code = int(result[0])
    if code not in tuple(ok):
        raise DriverError(api, hip_error_name(hip, code), code, doing)
    return result[1:]


def hip_call(hip, api: str, *args, doing: str, ok: Iterable[int] = (HIP_SUCCESS,)) -> tuple:
    """Call ``hip.<api>(*args)`` through the one checker. Returns the outputs tuple."""
    fn = getattr(hip, api, None)
    if fn is None:
        raise DriverError(api, "NOT_IN_BINDINGS", -1, doing,
                          f"hip-python {hip_python_version() or '?'} has no {api}")
    try:
        result = fn(*args)
    except RuntimeError as exc:   # hip-python could not dlopen libamdhip64 (or a symbol)
        raise DriverError(api, "LIBRARY_NOT_LOADED", -1, doing, str(exc)) from exc
    return hip_check(hip, result, api, doing, ok)


def hip_first(outs: tuple) -> Any:
    return outs[0] if outs else None


def _s(x: Any) -> str:
    if isinstance(x, (bytes, bytearray)):
        x = bytes(x).split(b"\0", 1)[0].decode(errors="replace")
    return str(x).strip("\0 ").strip()


class HipApi:
    """hip-python plus the version shim for the calls whose signature changed in 10.x."""

    def __init__(self, hip):
        self.hip = hip
        ver = _major_minor(hip_python_version())
        self._new_props = ver is not None and ver[0] >= 10   # 10.x binds hipGetDevicePropertiesR0600(deviceId)

    def __call__(self, api: str, *args, doing: str, ok: Iterable[int] = (HIP_SUCCESS,)) -> tuple:
        return hip_call(self.hip, api, *args, doing=doing, ok=ok)

    def enum(self, enum_name: str, value: int):
        """An enum member (hip-python refuses plain ints for enum-typed arguments)."""
        return getattr(self.hip, enum_name)(value)

    def device_properties(self, device: int):
        """``hipGetDeviceProperties``: ``(deviceId) -> (err, props)`` in 10.x, ``(props, deviceId) -> (err,)`` before."""
        doing = f"reading the properties of device {device}"
        forms = ("new", "old") if self._new_props else ("old", "new")
        last: TypeError | None = None
        for form in forms:
            try:
                if form == "new":
                    return hip_first(self("hipGetDeviceProperties", device, doing=doing))
                props = self.hip.hipDeviceProp_t()
                self("hipGetDeviceProperties", props, device, doing=doing)
                return props
            except TypeError as exc:   # the other signature
                last = exc
        raise DriverError("hipGetDeviceProperties", "SIGNATURE_MISMATCH", -1, doing, str(last))

    def pci_bus_id(self, device: int) -> str:
        out = hip_first(self("hipDeviceGetPCIBusId", 64, device, doing=f"reading the PCI bus id of device {device}"))
        return _s(bytes(out) if not isinstance(out, str) else out).lower()


class HipDevices:
    """The devices a ROCm platform sees: device checks, the current-device switch calls run under
    (:meth:`on`), device attributes, and whether the platform is closed (:meth:`close`: new resources are
    refused from then on)."""

    def __init__(self, api: HipApi):
        self._api = api
        self.closed = False

    def check_open(self) -> None:
        if self.closed:
            raise BadInput("the ROCm platform is closed")

    def close(self) -> bool:
        """Refuse new resources from now on; False where this was closed already."""
        if self.closed:
            return False
        self.closed = True
        return True

    def count(self) -> int:
        return int(hip_first(self._api("hipGetDeviceCount", doing="counting AMD GPUs")))

    def check(self, device: int) -> int:
        n = self.count()
        if not isinstance(device, (int, np.integer)) or not 0 <= int(device) < n:
            raise BadInput(f"device {device!r} does not exist: {n} AMD GPU(s) visible")
        return int(device)

    @contextmanager
    def on(self, device: int):
        prev = hip_first(self._api("hipGetDevice", doing="reading the current device"))
        if prev != device:
            self._api("hipSetDevice", device, doing=f"making device {device} current")
        try:
            yield
        finally:
            if prev != device:
                self._api("hipSetDevice", prev, doing=f"restoring device {prev} as current")

    def attribute(self, name: str, device: int) -> int:
        """``hipDeviceGetAttribute(hipDeviceAttribute<name>)``."""
        attr = getattr(self._api.hip.hipDeviceAttribute_t, f"hipDeviceAttribute{name}")
        return int(hip_first(self._api("hipDeviceGetAttribute", attr, device,
                                       doing=f"reading attribute {name} of device {device}")))


# --------------------------------------------------------------------------- IPC handle bytes


def handle_bytes(handle) -> bytes:
    """The 64 raw bytes of a ``hipIpcMemHandle_st`` (never ``.reserved``: 7.2 truncates it at a NUL)."""
    raw = ctypes.string_at(int(handle), IPC_HANDLE_BYTES)
    if len(raw) != IPC_HANDLE_BYTES:  # pragma: no cover - string_at returns exactly that many
        raise DriverError("hipIpcGetMemHandle", "BAD_HANDLE", -1, "serializing an IPC handle", f"{len(raw)} bytes")
    return raw


def handle_from_bytes(hip, raw: bytes):
    """A ``hipIpcMemHandle_st`` holding ``raw`` (64 bytes)."""
    if not isinstance(raw, (bytes, bytearray)) or len(raw) != IPC_HANDLE_BYTES:
        raise BadInput(f"a HIP IPC handle is {IPC_HANDLE_BYTES} bytes, got "
                       f"{len(raw) if isinstance(raw, (bytes, bytearray)) else type(raw).__name__}")
    return hip.hipIpcMemHandle_st.fromObj(bytearray(raw))
