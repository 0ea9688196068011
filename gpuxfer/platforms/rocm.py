"""The platform contract on ROCm: hip-python for HIP, torch's ROCm build for tensors, streams and events.

**Nothing here has run on an AMD GPU** (none was reachable): it is built to the
published facts (hip-python's bindings; the HIP and ROCr sources in
ROCm/rocm-systems) and tested on the CPU with fakes (tests/platforms/test_rocm_*.py).
docs/ROCM.md lists what is unverified and how to validate it on an MI355X.

How each hook maps to HIP:

* **Detection** (:meth:`RocmPlatform.unavailable_reason`): ``from hip import hip``
  works without ROCm (hip-python loads ``libamdhip64`` lazily, at the first
  call, which then raises ``RuntimeError``); torch must be a ROCm build; the HIP
  version hip-python was generated for must match torch's (major.minor), and
  after the first call the process must map exactly one ``libamdhip64``: two
  runtimes in one process would make torch's streams and pointers meaningless to
  hip-python. Never raises.
* **Errors**: every hip-python call goes through :func:`hip_call` (hip-python
  returns ``(hipError_t, *outputs)``; a library that cannot be loaded raises
  ``RuntimeError`` instead), which raises :class:`~gpuxfer.errors.DriverError`
  with the API, the status name and what gpuxfer was doing.
* **Memory**: raw ``hipExtMallocWithFlags`` (never torch's caching allocator);
  :meth:`RocmPlatform.alloc_flags` allocates flag words *uncached*
  (``hipDeviceMallocUncached``, which hip-python does not export; see
  :data:`HIP_DEVICE_MALLOC_UNCACHED`), so a value a peer's copy engine wrote is
  seen by the waiting stream without cache maintenance.
  :meth:`RocmPlatform.alloc_signal` allocates ``hipMallocSignalMemory`` (a ROCr
  signal whose value word HIP stream operations may write).
* **IPC**: ``hipIpcGetMemHandle`` / ``hipIpcOpenMemHandle`` with
  ``hipIpcMemLazyEnablePeerAccess`` (the only flag HIP accepts); the handle
  travels as its 64 raw bytes. Opening a handle in the exporting process is
  refused (HIP returns ``hipErrorInvalidContext`` there). ``hipIpcCloseMemHandle``
  synchronizes the whole device: never close a mapping while a flag wait may be
  pending.
* **Flags**: ``hipStreamWriteValue64`` (flags 0) and ``hipStreamWaitValue64`` with
  ``hipStreamWaitValueGte`` and a mask of all ones. HIP runs both as tiny blit
  kernels by default (a wait spins one work-item), and a wait blocks its whole
  hardware queue: :meth:`RocmPlatform.create_stream` therefore gives every
  stream gpuxfer creates its own hardware queue (``hipExtStreamCreateWithCUMask``
  with every CU enabled: HIP never shares a CU-masked stream's queue).
* **Copies**: ``hipMemcpyAsync``; a copy that touches a peer's memory uses
  ``hipMemcpyDeviceToDeviceNoCU`` (an SDMA copy, no CU), others
  ``hipMemcpyDefault``.
* **Host flag access**: ``read_flag`` / ``host_write_flag`` copy 8 bytes through a
  pinned word on a private stream (own hardware queue, so no pending wait blocks
  it), polled with a timeout.
* **Tensors**: ``torch.as_tensor`` over ``__cuda_array_interface__`` (torch's ROCm
  build keeps the device type ``"cuda"``); the result is checked to alias the
  memory (no copy) on the right device.
* **Links**: ``hipDeviceCanAccessPeer`` and ``hipExtGetLinkTypeAndHopCount``
  (``hsa_amd_link_info_type_t``: 4 = xGMI, 2 = PCIe).

HSA (SDMA copies on a chosen engine, signals) lives in :mod:`gpuxfer.platforms.hsa`;
:meth:`RocmPlatform.hsa` opens it on first use.
"""
from __future__ import annotations

import ctypes
import importlib
import logging
import os
import re
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from .. import config
from ..common import package_version
from ..errors import BadInput, DriverError, GpuxferError, NotExportable, PlatformUnavailable
from .base import (Closable, DeviceBuffer, DeviceInfo, Event, ExportedRange, IpcHandle, LinkInfo, Memory,
                   PeerMapping, Platform, SdmaEngines, Stream, check_flag_ptr)

log = logging.getLogger("gpuxfer.platforms.rocm")

# --------------------------------------------------------------------------- constants

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


# --------------------------------------------------------------------------- objects


class RocmStream(Stream):
    """A torch stream (``torch_stream``) and its native handle; ``hip_stream`` when gpuxfer created it.

    Streams from :meth:`RocmPlatform.create_stream` are owned (``platform`` set): ``close()`` destroys the
    HIP stream of a dedicated one and makes either kind refused from then on; the platform's ``close()``
    destroys those still open.
    """

    def __init__(self, device: int, torch_stream, hip_stream=None, dedicated: bool = False,
                 platform: "RocmPlatform | None" = None):
        self.device = device
        self.torch_stream = torch_stream
        self.handle = int(torch_stream.cuda_stream)
        self.hip_stream = hip_stream
        self.dedicated = dedicated
        self._platform = platform      # set only for owned streams
        self._closed = False

    def __repr__(self) -> str:
        return (f"RocmStream(device {self.device}, 0x{self.handle:x}"
                f"{', own hardware queue' if self.dedicated else ''})")


class RocmEvent(Event):
    def __init__(self, torch_event):
        self.torch_event = torch_event


class SignalMemory(Closable):
    """An 8-byte ``hipMallocSignalMemory`` word: a ROCr signal HIP stream operations may write.

    ``ptr`` is the value word (HIP's pointer), ``handle`` the ``hsa_signal_t``
    (``ptr - 8``: ``amd_signal_t`` starts ``{int64 kind; int64 value; ...}``),
    checked at allocation with ``hsa_amd_signal_value_pointer``. HIP creates
    it with the value 1.
    """

    def __init__(self, platform: "RocmPlatform", device: int, ptr: int, handle: int, impl=None):
        self.platform, self.device, self.ptr, self.handle, self.impl = platform, device, ptr, handle, impl

    @property
    def signal(self):
        """The :class:`~gpuxfer.platforms.hsa.Signal` of this word (a copy's dependency or completion)."""
        from .hsa import Signal
        return Signal(self.handle)

    def _release(self) -> None:
        self.platform._free_raw(self.ptr, self.device, "a signal word")

    def __repr__(self) -> str:
        return f"SignalMemory(device {self.device}, value at 0x{self.ptr:x}, signal 0x{self.handle:x})"


#: architectures whose driver recommends SDMA engines per GPU pair (KFD masks exist from gfx9.4 on)
SDMA_ARCH_PREFIXES = ("gfx94", "gfx95")


def sdma_disabled_by() -> str | None:
    """The ROCr variable (``HSA_ENABLE_SDMA`` or ``HSA_ENABLE_PEER_SDMA``) set to 0, which turns SDMA copies into
    blit kernels on compute units, or None."""
    for var in ("HSA_ENABLE_SDMA", "HSA_ENABLE_PEER_SDMA"):
        if os.environ.get(var, "").strip() == "0":
            return var
    return None


class RocmSdma(SdmaEngines):
    """The SDMA engines of a ROCm platform (:attr:`RocmPlatform.sdma`).

    Stream-ordered: ``hipMemcpyAsync`` with ``hipMemcpyDeviceToDeviceNoCU`` and uncached
    flag memory. Host-queued: ROCr through :class:`~gpuxfer.platforms.hsa.Hsa`, on the
    engine the driver recommends for the pair (:func:`~gpuxfer.platforms.hsa.plan_engines`).
    It works through the platform's ``hsa()``, ``agent()``, ``alloc_flags()``,
    ``alloc_signal()``, ``pcie_atomics_64()`` and ``copy_async(..., force_nocu=True)``.
    """

    def __init__(self, platform: "RocmPlatform"):
        self.platform = platform

    def unavailable_reason(self, device: int, host_queued: bool) -> str | None:
        var = sdma_disabled_by()
        if var is not None:
            return f"{var}=0 makes ROCr run SDMA copies as blit kernels on CUs: unset it for the sdma backend"
        try:
            info = self.platform.device_info(device)
            if not info.arch.startswith(SDMA_ARCH_PREFIXES):
                return (f"device {device} is {info.arch}: SDMA hand-offs target gfx942/gfx950 "
                        f"(MI300/MI355 class), where the driver recommends SDMA engines per GPU pair")
            if host_queued:
                self.runtime()
                self.agent(device)
        except Exception as exc:  # noqa: BLE001 - a reason, not a crash
            return f"{'hsa' if host_queued else 'hip'} path unusable: {type(exc).__name__}: {exc}"
        return None

    def alloc_flags(self, nbytes: int, device: int) -> DeviceBuffer:
        return self.platform.alloc_flags(nbytes, device)

    def copy_async(self, stream: Stream, dst: int, src: int, nbytes: int) -> None:
        self.platform.copy_async(stream, dst, src, nbytes, force_nocu=True)

    def runtime(self):
        return self.platform.hsa()

    def agent(self, device: int):
        return self.platform.agent(device)

    def owner_agent(self, ptr: int, what: str):
        from .hsa import HSA_EXT_POINTER_TYPE_IPC, HSA_EXT_POINTER_TYPE_UNKNOWN
        hsa = self.runtime()
        info = hsa.pointer_info(ptr)
        if info.type == HSA_EXT_POINTER_TYPE_UNKNOWN or not info.agent_owner:
            raise GpuxferError(f"ROCr does not know {what} at 0x{ptr:x} (pointer type {info.type}): cannot name "
                               f"its agent for an SDMA copy")
        if info.type != HSA_EXT_POINTER_TYPE_IPC:
            log.info("%s has HSA pointer type %d (IPC is %d)", what, info.type, HSA_EXT_POINTER_TYPE_IPC)
        agent = {a.handle: a for a in hsa.agents()}.get(info.agent_owner)
        if agent is None or not agent.is_gpu:
            raise GpuxferError(f"{what} is owned by HSA agent 0x{info.agent_owner:x}, not a GPU this process sees "
                               f"(ROCR_VISIBLE_DEVICES?)")
        return agent

    def alloc_signal(self, device: int):
        return self.platform.alloc_signal(device)

    def plan_engines(self, src_agent, dst_agent, copies: int):
        from .hsa import plan_engines
        return plan_engines(self.runtime(), src_agent, dst_agent, copies)

    def pcie_atomics_64(self, device: int) -> bool | None:
        return self.platform.pcie_atomics_64(device)


class _CudaArrayInterface:
    """The minimal ``__cuda_array_interface__`` (v3) torch needs to alias device memory."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None, "stream": None}


def _torch_dtype(dtype):
    import torch
    if dtype is None:
        return torch.uint8
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    raise BadInput(f"not a torch dtype: {dtype!r}")


def tensor_view_params(mem: Memory, dtype, shape: Sequence[int] | None, offset: int):
    """Validate an ``as_tensor`` request: returns (torch dtype, shape, bytes)."""
    import torch
    dt = _torch_dtype(dtype)
    item = torch.empty((), dtype=dt).element_size()
    if not isinstance(offset, (int, np.integer)) or offset < 0 or offset > mem.nbytes:
        raise BadInput(f"offset {offset!r} lies outside {mem!r}")
    if offset % item:
        raise BadInput(f"offset {offset} is not a multiple of the {dt} item size ({item} bytes)")
    if shape is None:
        shape = ((mem.nbytes - int(offset)) // item,)
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise BadInput(f"negative size in shape {shape}")
    count = int(np.prod(shape, dtype=np.int64)) * item
    mem.check_range(int(offset), count, f"a {dt} tensor of shape {shape} at byte offset {offset}")
    return dt, shape, count


# --------------------------------------------------------------------------- the platform


class RocmPlatform(Platform):
    """The contract on ROCm (hip-python + torch's ROCm build). See the module docstring."""

    name = "rocm"
    memory_runtime = "hip"

    # ---- detection ----
    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            return cls._unavailable_reason()
        except Exception as exc:  # noqa: BLE001 - a reason, never a crash
            return f"{type(exc).__name__} while probing ROCm: {exc}"

    @classmethod
    def _unavailable_reason(cls) -> str | None:
        try:
            hip = _import_hip()
        except ImportError as exc:
            return f"hip-python is not installed ({exc}); install gpuxfer[rocm]"
        try:
            import torch
        except ImportError as exc:
            return f"torch cannot be imported: {exc}"
        t_hip = getattr(torch.version, "hip", None)
        if not t_hip:
            return (f"torch {torch.__version__} is not a ROCm build (torch.version.hip is None); "
                    f"hip-python would load a HIP runtime torch does not use")
        b_ver, t_ver = binding_hip_version(), _major_minor(t_hip)
        if b_ver is not None and t_ver is not None and b_ver != t_ver:
            return (f"hip-python {hip_python_version()} is generated for HIP {b_ver[0]}.{b_ver[1]} but torch "
                    f"uses HIP {t_hip}: install the hip-python release matching torch's ROCm")
        before = mapped_hip_runtimes()
        try:
            count = hip_first(hip_call(hip, "hipGetDeviceCount", doing="counting AMD GPUs"))
        except DriverError as exc:
            return f"the HIP runtime cannot be used: {exc}"
        after = mapped_hip_runtimes()
        if len(after) > 1:
            return ("two HIP runtimes are loaded in this process (" + ", ".join(sorted(after)) + "): hip-python "
                    "loaded a different libamdhip64 than torch's (set LD_LIBRARY_PATH / ROCM_PATH so both use "
                    "the same ROCm)")
        if before and after and before != after:   # pragma: no cover - defensive
            return f"hip-python loaded {sorted(after)} while torch had {sorted(before)}"
        if not count:
            return "no AMD GPU is visible (hipGetDeviceCount returned 0; check HIP_VISIBLE_DEVICES / permissions)"
        try:
            rt = hip_first(hip_call(hip, "hipRuntimeGetVersion", doing="reading the HIP runtime version"))
        except DriverError:
            rt = None
        if rt and t_ver is not None and (rt // 10_000_000, rt // 100_000 % 100) != t_ver:
            return (f"the HIP runtime hip-python reached is {rt // 10_000_000}.{rt // 100_000 % 100} but torch "
                    f"was built for HIP {t_hip}")
        if not torch.cuda.is_available():
            return "torch's ROCm build sees no GPU (torch.cuda.is_available() is False)"
        return None

    def __init__(self, hip=None, hsa=None):
        self.host_flag_timeout_s = host_flag_timeout_from_env()     # a bad value is a configuration error
        if hip is None:
            why = type(self).unavailable_reason()
            if why is not None:
                raise PlatformUnavailable(self.name, why)
            hip = _import_hip()
        self._api = HipApi(hip)
        self.hip = hip
        self._hsa = hsa
        self._lock = threading.RLock()
        self._peer_ranges: dict[int, int] = {}          # start -> end of opened peer mappings
        self._ipc_open: dict[tuple[int, bytes], list] = {}  # (device, handle) -> [mapped pointer, open count]
        self._own: dict[int, tuple[int, int]] = {}      # ptr -> (device, nbytes) of our allocations
        self._stream_ops_ok: dict[int, bool] = {}
        self._info: dict[int, DeviceInfo] = {}
        self._host_io: dict[int, tuple] = {}            # device -> (pinned ptr, RocmStream, lock)
        self._streams: list[RocmStream] = []
        self._agents: dict[int, Any] = {}
        self._is_closed = False
        self.dedicated_queues = config.get("GPUXFER_ROCM_DEDICATED_QUEUES")

    # ---- helpers ----
    def _check_open(self) -> None:
        if self._is_closed:
            raise BadInput("the ROCm platform is closed")

    def _check_device(self, device: int) -> int:
        n = self.device_count()
        if not isinstance(device, (int, np.integer)) or not 0 <= int(device) < n:
            raise BadInput(f"device {device!r} does not exist: {n} AMD GPU(s) visible")
        return int(device)

    @contextmanager
    def _on_device(self, device: int):
        prev = hip_first(self._api("hipGetDevice", doing="reading the current device"))
        if prev != device:
            self._api("hipSetDevice", device, doing=f"making device {device} current")
        try:
            yield
        finally:
            if prev != device:
                self._api("hipSetDevice", prev, doing=f"restoring device {prev} as current")

    # ---- devices ----
    def device_count(self) -> int:
        return int(hip_first(self._api("hipGetDeviceCount", doing="counting AMD GPUs")))

    def set_device(self, device: int) -> None:
        device = self._check_device(device)
        self._api("hipSetDevice", device, doing=f"making device {device} current")
        import torch
        torch.cuda.set_device(device)

    def attribute(self, name: str, device: int) -> int:
        """``hipDeviceGetAttribute(hipDeviceAttribute<name>)``."""
        attr = getattr(self.hip.hipDeviceAttribute_t, f"hipDeviceAttribute{name}")
        return int(hip_first(self._api("hipDeviceGetAttribute", attr, device,
                                       doing=f"reading attribute {name} of device {device}")))

    def pci_bus_id(self, device: int) -> str:
        return self._api.pci_bus_id(device)

    def device_info(self, device: int) -> DeviceInfo:
        device = self._check_device(device)
        if device in self._info:
            return self._info[device]
        props = self._api.device_properties(device)
        arch = _s(props.gcnArchName).split(":")[0] or f"gfx{props.major}{props.minor}"
        with self._on_device(device):
            free, total = self._api("hipMemGetInfo", doing=f"reading free memory of device {device}")[:2]
        notes = ["hipStreamWaitValue64 runs as a one-work-item kernel unless GPU_STREAMOPS_CP_WAIT=1; "
                 "gpuxfer streams get their own hardware queue so a wait blocks nothing else"]
        engines = 0
        try:
            agent = self.agent(device)
            engines = (agent.num_sdma or 0) + (agent.num_sdma_xgmi or 0)
            notes.append(f"SDMA engines: {agent.num_sdma} PCIe + {agent.num_sdma_xgmi} xGMI (HSA agent {agent.name})")
        except Exception as exc:  # noqa: BLE001 - engine count is informative
            engines = int(getattr(props, "asyncEngineCount", 0) or 0)
            notes.append(f"SDMA engine count from hipDeviceProp_t.asyncEngineCount (HSA unavailable: {exc})")
        var = sdma_disabled_by()
        if var is not None:
            notes.append(f"{var}=0: ROCr turns SDMA copies into blit kernels (CUs)")
        info = DeviceInfo(
            index=device, name=_s(props.name) or arch, arch=arch, total_bytes=int(total or props.totalGlobalMem),
            free_bytes=int(free), pci_bus_id=self.pci_bus_id(device), sm_count=int(props.multiProcessorCount),
            copy_engines=engines, stream_mem_ops_64=self.probe_stream_mem_ops(device),
            stream_wait_nor=False, can_flush_remote_writes=False, notes=tuple(notes))
        self._info[device] = info
        return info

    def probe_stream_mem_ops(self, device: int, timeout_s: float = 10.0) -> bool:
        """A real 64-bit stream write + wait + synchronize on ``device`` (cached)."""
        if device in self._stream_ops_ok:
            return self._stream_ops_ok[device]
        ok = False
        try:
            if not self.attribute("CanUseStreamWaitValue", device):
                self._stream_ops_ok[device] = False
                return False
            with self.alloc_flags(8, device) as flag:
                stream = self.create_stream(device)
                try:
                    self.memset_async(stream, flag.ptr, 0, 8)
                    self.write_flag(stream, flag.ptr, 7)
                    self.wait_flag(stream, flag.ptr, 7)
                    ok = self.synchronize(stream, timeout_s) and self.read_flag(flag.ptr, device) == 7
                    if not ok:   # release the wait so the stream can be destroyed
                        self.host_write_flag(flag.ptr, 7, device)
                        self.synchronize(stream, timeout_s)
                finally:
                    stream.close()
        except DriverError as exc:
            log.info("stream memory operation probe failed on device %d: %s", device, exc)
            ok = False
        self._stream_ops_ok[device] = ok
        return ok

    def link(self, src: int, dst: int) -> LinkInfo:
        src, dst = self._check_device(src), self._check_device(dst)
        if src == dst:
            return LinkInfo(src, dst, "same-device", True)
        peer = bool(hip_first(self._api("hipDeviceCanAccessPeer", src, dst,
                                        doing=f"checking peer access {src} -> {dst}")))
        try:
            linktype, hops = self._api("hipExtGetLinkTypeAndHopCount", src, dst,
                                       doing=f"reading the link type {src} -> {dst}")[:2]
        except DriverError as exc:
            return LinkInfo(src, dst, "unknown", peer, f"link type unreadable: {exc}")
        kind = {HSA_AMD_LINK_INFO_TYPE_XGMI: "xgmi", HSA_AMD_LINK_INFO_TYPE_PCIE: "pcie"}.get(int(linktype), "unknown")
        return LinkInfo(src, dst, kind, peer, f"hsa link type {int(linktype)}, {int(hops)} hop(s)")

    def versions(self) -> dict[str, str]:
        out = {"hip-python": hip_python_version() or "?", "torch.version.hip": str(torch_hip_version())}
        b = binding_hip_version()
        if b:
            out["hip-python generated for HIP"] = f"{b[0]}.{b[1]}"
        for api, key in (("hipRuntimeGetVersion", "HIP runtime"), ("hipDriverGetVersion", "HIP driver")):
            try:
                v = int(hip_first(self._api(api, doing=f"reading the {key} version")))
                out[key] = f"{v // 10_000_000}.{v // 100_000 % 100}.{v % 100_000}"
            except DriverError as exc:
                out[key] = f"unreadable ({exc.status_name})"
        runtimes = mapped_hip_runtimes()
        if runtimes:
            out["libamdhip64"] = ", ".join(sorted(runtimes))
        return out

    # ---- SDMA engines and HSA ----
    @property
    def sdma(self) -> RocmSdma:
        return RocmSdma(self)

    def hsa(self):
        """The process's :class:`~gpuxfer.platforms.hsa.Hsa` (loaded and initialized on first use)."""
        with self._lock:
            if self._hsa is None:
                from .hsa import Hsa
                self._hsa = Hsa().init()
            return self._hsa

    def agent(self, device: int):
        """The HSA GPU agent of HIP device ``device``, matched by PCI bus id (never by ordinal)."""
        with self._lock:
            if device not in self._agents:
                self._agents[device] = self.hsa().gpu_agent_by_pci(self.pci_bus_id(device))
            return self._agents[device]

    def pcie_atomics_64(self, device: int) -> bool | None:
        """Whether the GPU's link to the CPU has 64-bit PCIe atomics (KFD topology); None if it cannot be told.

        ROCr decrements an SDMA completion signal atomically only then; the sdma
        backend shares one completion signal between copies only when this is True.
        """
        from .hsa import kfd_pcie_atomics_64
        try:
            agent = self.agent(device)
        except Exception:  # noqa: BLE001 - unknown is an answer
            return None
        node = agent.driver_node if agent.driver_node is not None else agent.node
        return None if node is None else kfd_pcie_atomics_64(node)

    # ---- memory ----
    def _malloc(self, nbytes: int, device: int, flags: int, what: str) -> tuple[int, Any]:
        self._check_open()
        device = self._check_device(device)
        if not isinstance(nbytes, (int, np.integer)) or int(nbytes) <= 0:
            raise BadInput(f"cannot allocate {nbytes!r} bytes: the size must be a positive integer")
        with self._on_device(device):
            arr = hip_first(self._api("hipExtMallocWithFlags", int(nbytes), flags,
                                      doing=f"allocating {nbytes} B of {what} on device {device}"))
        ptr = int(arr)
        with self._lock:
            self._own[ptr] = (device, int(nbytes))
        return ptr, arr

    def alloc(self, nbytes: int, device: int) -> DeviceBuffer:
        ptr, arr = self._malloc(nbytes, device, HIP_DEVICE_MALLOC_DEFAULT, "device memory")
        return DeviceBuffer(self, device, ptr, int(nbytes), impl=arr)

    def alloc_flags(self, nbytes: int, device: int) -> DeviceBuffer:
        """Uncached device memory for flag words (exportable like :meth:`alloc`)."""
        ptr, arr = self._malloc(nbytes, device, HIP_DEVICE_MALLOC_UNCACHED, "uncached flag memory")
        return DeviceBuffer(self, device, ptr, int(nbytes), impl=arr)

    def alloc_signal(self, device: int) -> SignalMemory:
        """A ``hipMallocSignalMemory`` word (value 1) and its HSA signal handle, checked with ROCr."""
        ptr, arr = self._malloc(8, device, HIP_MALLOC_SIGNAL_MEMORY, "signal memory")
        sig = SignalMemory(self, device, ptr, ptr - 8, impl=arr)
        try:
            from .hsa import Signal
            seen = self.hsa().signal_value_pointer(Signal(sig.handle))
            if seen != ptr:
                raise DriverError("hsa_amd_signal_value_pointer", "LAYOUT_MISMATCH", -1,
                                  "checking that a hipMallocSignalMemory word is the value of signal (ptr - 8)",
                                  f"ROCr says the value of signal 0x{sig.handle:x} lives at 0x{seen:x}, not 0x{ptr:x}")
        except BaseException:
            sig.close()
            raise
        return sig

    def _free_raw(self, ptr: int, device: int, what: str) -> None:
        with self._lock:
            self._own.pop(ptr, None)
        self._api("hipFree", ptr, doing=f"freeing {what} at 0x{ptr:x} on device {device}")

    def _free(self, buf: DeviceBuffer) -> None:
        self._free_raw(buf.ptr, buf.device, f"{buf.nbytes} B")

    def export_handle(self, buf: DeviceBuffer) -> IpcHandle:
        if buf.platform is not self:
            raise BadInput(f"{buf!r} was not allocated by this ROCm platform")
        if buf.closed:
            raise BadInput(f"cannot export {buf!r}: it is freed")
        h = hip_first(self._api("hipIpcGetMemHandle", buf.ptr,
                                doing=f"exporting an IPC handle of {buf.nbytes} B on device {buf.device}"))
        return IpcHandle(self.name, buf.device, buf.nbytes, handle_bytes(h), os.getpid())

    def allocation_range(self, ptr: int, device: int) -> tuple[int, int] | None:
        """``hipMemGetAddressRange``: the allocation (or IPC mapping) holding ``ptr``."""
        device = self._check_device(device)
        with self._on_device(device):
            outs = self._api("hipMemGetAddressRange", int(ptr),
                             doing=f"finding the allocation holding 0x{int(ptr):x} on device {device}")
        if len(outs) != 2:
            raise DriverError("hipMemGetAddressRange", "UNEXPECTED_RESULT", -1, "reading an allocation range",
                              f"hip-python returned {outs!r}")
        return int(outs[0]), int(outs[1])

    def export_range(self, ptr: int, nbytes: int, device: int) -> ExportedRange:
        """The IPC handle of the ``hipMalloc`` allocation holding ``[ptr, ptr + nbytes)`` (a torch
        caching-allocator block lies in one) and the range's offset in it (``hipMemGetAddressRange``,
        then ``hipIpcGetMemHandle`` on its base)."""
        self._check_open()
        device = self._check_device(device)
        ptr, nbytes = int(ptr), int(nbytes)
        what = f"memory [0x{ptr:x}, +{nbytes}) on device {device}"
        try:
            base, size = self.allocation_range(ptr, device)
        except DriverError as exc:
            raise NotExportable(what, f"HIP does not know the pointer ({exc.status_name})") from exc
        if nbytes < 0 or ptr + nbytes > base + size:
            raise NotExportable(what, f"it runs past the end of its allocation [0x{base:x}, +{size})")
        try:
            h = hip_first(self._api("hipIpcGetMemHandle", base,
                                    doing=f"exporting an IPC handle of the allocation [0x{base:x}, +{size})"))
        except DriverError as exc:
            raise NotExportable(what, f"hipIpcGetMemHandle refused its allocation ({exc.status_name}): "
                                      "virtual-memory allocations cannot be exported this way") from exc
        return ExportedRange(IpcHandle(self.name, device, size, handle_bytes(h), os.getpid()), ptr - base)

    def open_handle(self, handle: IpcHandle, device: int) -> PeerMapping:
        self._check_open()
        device = self._check_device(device)
        if handle.platform != self.name:
            raise BadInput(f"a {handle.platform!r} IPC handle cannot be opened on ROCm")
        if handle.owner_pid == os.getpid():
            raise BadInput("cannot open an IPC handle in the process that exported it (HIP returns "
                           "hipErrorInvalidContext): use the DeviceBuffer itself")
        # an allocation's handle is opened once per device: a second open shares the first mapping
        # (counted), and the last close unmaps it
        key = (device, bytes(handle.payload))
        with self._lock:
            entry = self._ipc_open.get(key)
            if entry is not None:
                entry[1] += 1
                self._peer_ranges[entry[0]] = max(self._peer_ranges.get(entry[0], 0), entry[0] + handle.nbytes)
                return PeerMapping(self, device, entry[0], handle, impl=key)
        h = handle_from_bytes(self.hip, handle.payload)
        with self._on_device(device):
            p = hip_first(self._api("hipIpcOpenMemHandle", h, HIP_IPC_MEM_LAZY_ENABLE_PEER_ACCESS,
                                    doing=f"opening the IPC handle of device {handle.device} of pid "
                                          f"{handle.owner_pid} ({handle.nbytes} B) on device {device}"))
        ptr = int(p)
        with self._lock:
            self._peer_ranges[ptr] = ptr + handle.nbytes
            self._ipc_open[key] = [ptr, 1]
        return PeerMapping(self, device, ptr, handle, impl=key)

    def _close_mapping(self, mapping: PeerMapping) -> None:
        with self._lock:
            entry = self._ipc_open.get(mapping.impl)
            if entry is not None:
                entry[1] -= 1
                if entry[1] > 0:
                    return
                del self._ipc_open[mapping.impl]
            self._peer_ranges.pop(mapping.ptr, None)
        with self._on_device(mapping.device):
            self._api("hipIpcCloseMemHandle", mapping.ptr,
                      doing=f"closing the IPC mapping of device {mapping.handle.device} on device {mapping.device}")

    def is_peer_address(self, ptr: int, device: int | None = None) -> bool:
        """Whether ``ptr`` lies in an opened peer mapping (or in our memory on another device)."""
        with self._lock:
            if any(start <= ptr < end for start, end in self._peer_ranges.items()):
                return True
            if device is not None:
                for start, (dev, n) in self._own.items():
                    if dev != device and start <= ptr < start + n:
                        return True
        return False

    def as_tensor(self, mem: Memory, dtype=None, shape: Sequence[int] | None = None, offset: int = 0):
        import torch
        if mem.platform is not self:
            raise BadInput(f"{mem!r} does not belong to this ROCm platform")
        if mem.closed:
            raise BadInput(f"cannot view {mem!r}: it is closed")
        dt, shape, count = tensor_view_params(mem, dtype, shape, offset)
        dev = torch.device("cuda", mem.device)     # torch's ROCm build keeps the "cuda" device type
        if count == 0:
            return torch.empty(shape, dtype=dt, device=dev)
        ptr = mem.ptr + int(offset)
        with torch.cuda.device(mem.device):
            flat = torch.as_tensor(_CudaArrayInterface(ptr, count), device=dev)
        if flat.data_ptr() != ptr or flat.device != dev:
            raise DriverError("torch.as_tensor", "NOT_ZERO_COPY", -1,
                              f"viewing 0x{ptr:x} ({count} B) on device {mem.device} as a tensor",
                              f"torch made a tensor at 0x{flat.data_ptr():x} on {flat.device}")
        return flat.view(dt).reshape(shape)

    # ---- streams and events ----
    def _stream(self, stream) -> RocmStream:
        if not isinstance(stream, RocmStream):
            raise BadInput(f"not a ROCm stream: {stream!r}")
        if stream._closed:
            raise BadInput(f"{stream!r} is closed")
        return stream

    def create_stream(self, device: int, dedicated: bool | None = None) -> RocmStream:
        """A new stream; with ``dedicated`` (the default, ``GPUXFER_ROCM_DEDICATED_QUEUES=0`` turns it
        off) it has its own hardware queue, so a flag wait on it blocks nothing else."""
        import torch
        self._check_open()
        device = self._check_device(device)
        dedicated = self.dedicated_queues if dedicated is None else dedicated
        tdev = torch.device("cuda", device)
        if not dedicated:
            return RocmStream(device, torch.cuda.Stream(device=tdev), platform=self)
        cus = max(1, self.attribute("MultiprocessorCount", device))
        words = (cus + 31) // 32
        with self._on_device(device):
            hs = hip_first(self._api("hipExtStreamCreateWithCUMask", words, [0xFFFFFFFF] * words,
                                     doing=f"creating a stream with its own hardware queue on device {device}"))
        s = RocmStream(device, torch.cuda.ExternalStream(int(hs), device=tdev), hip_stream=hs, dedicated=True,
                       platform=self)
        with self._lock:
            self._streams.append(s)
        return s

    def _destroy_stream(self, stream: RocmStream) -> None:
        if stream.hip_stream is None:
            return
        with self._lock:
            if stream in self._streams:
                self._streams.remove(stream)
        hs, stream.hip_stream = stream.hip_stream, None
        self._api("hipStreamDestroy", hs, doing=f"destroying {stream!r}")

    def current_stream(self, device: int) -> RocmStream:
        import torch
        device = self._check_device(device)
        return RocmStream(device, torch.cuda.current_stream(torch.device("cuda", device)))

    def record_event(self, stream: Stream, event: Event | None = None) -> RocmEvent:
        import torch
        s = self._stream(stream)
        if type(event) is RocmEvent:
            event.torch_event.record(s.torch_stream)
            return event
        ev = torch.cuda.Event()
        ev.record(s.torch_stream)
        return RocmEvent(ev)

    def stream_wait_event(self, stream: Stream, event: Event) -> None:
        if not isinstance(event, RocmEvent):
            raise BadInput(f"not a ROCm event: {event!r}")
        self._stream(stream).torch_stream.wait_event(event.torch_event)

    def event_query(self, event: Event) -> bool:
        if not isinstance(event, RocmEvent):
            raise BadInput(f"not a ROCm event: {event!r}")
        return bool(event.torch_event.query())

    def launch(self, stream: Stream, fn: Callable[[], object]) -> None:
        import torch
        if not callable(fn):
            raise BadInput(f"launch needs a callable, got {fn!r}")
        with torch.cuda.stream(self._stream(stream).torch_stream):
            fn()

    # ---- copies ----
    def copy_kind(self, dst: int, src: int, device: int, force_nocu: bool = False) -> int:
        if force_nocu or self.is_peer_address(dst, device) or self.is_peer_address(src, device):
            return HIP_MEMCPY_DEVICE_TO_DEVICE_NOCU
        return HIP_MEMCPY_DEFAULT

    def copy_async(self, stream: Stream, dst: int, src: int, nbytes: int, *, force_nocu: bool = False) -> None:
        s = self._stream(stream)
        if nbytes < 0:
            raise BadInput(f"cannot copy {nbytes} bytes")
        if not nbytes:
            return
        kind = self.copy_kind(int(dst), int(src), s.device, force_nocu)
        self._api("hipMemcpyAsync", int(dst), int(src), int(nbytes), self._api.enum("hipMemcpyKind", kind), s.handle,
                  doing=f"queueing a copy of {nbytes} B 0x{int(src):x} -> 0x{int(dst):x} "
                        f"({'SDMA, no CU' if kind == HIP_MEMCPY_DEVICE_TO_DEVICE_NOCU else 'default'}) on {s!r}")

    def memset_async(self, stream: Stream, ptr: int, value: int, nbytes: int) -> None:
        s = self._stream(stream)
        if nbytes < 0 or not 0 <= int(value) <= 255:
            raise BadInput(f"memset of {nbytes} bytes to {value!r}: need nbytes >= 0 and a byte value")
        if nbytes:
            self._api("hipMemsetAsync", int(ptr), int(value), int(nbytes), s.handle,
                      doing=f"queueing a memset of {nbytes} B at 0x{int(ptr):x} on {s!r}")

    # ---- flags ----
    def write_flag(self, stream: Stream, ptr: int, value: int) -> None:
        s = self._stream(stream)
        check_flag_ptr(int(ptr))
        self._api("hipStreamWriteValue64", s.handle, int(ptr), int(value) & MASK64, 0,
                  doing=f"queueing a flag write of {value} to 0x{int(ptr):x} on {s!r}")

    def wait_flag(self, stream: Stream, ptr: int, value: int) -> None:
        s = self._stream(stream)
        check_flag_ptr(int(ptr))
        self._api("hipStreamWaitValue64", s.handle, int(ptr), int(value) & MASK64, HIP_STREAM_WAIT_VALUE_GTE, MASK64,
                  doing=f"queueing a flag wait 0x{int(ptr):x} >= {value} on {s!r}")

    def _host_io_for(self, device: int):
        with self._lock:
            io = self._host_io.get(device)
            if io is None:
                with self._on_device(device):
                    pinned = int(hip_first(self._api("hipHostMalloc", 16, 0,
                                                     doing="allocating a pinned word for host flag access")))
                io = (pinned, self.create_stream(device, dedicated=True), threading.Lock())
                self._host_io[device] = io
            return io

    def _host_copy(self, device: int, dst: int, src: int, kind: int, doing: str) -> None:
        _, s, _ = self._host_io_for(device)
        self._api("hipMemcpyAsync", dst, src, 8, self._api.enum("hipMemcpyKind", kind), s.handle, doing=doing)
        deadline = time.monotonic() + self.host_flag_timeout_s
        delay = 1e-5
        while True:
            try:
                self._api("hipStreamQuery", s.handle, doing=doing)
                return
            except DriverError as exc:
                if exc.status != HIP_ERROR_NOT_READY:
                    raise
                if time.monotonic() > deadline:
                    raise DriverError("hipStreamQuery", exc.status_name, exc.status, doing,
                                      f"the 8-byte copy did not finish in {self.host_flag_timeout_s:g} s") from None
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def read_flag(self, ptr: int, device: int) -> int:
        check_flag_ptr(int(ptr))
        pinned, _, lock = self._host_io_for(self._check_device(device))
        with lock:
            self._host_copy(device, pinned, int(ptr), HIP_MEMCPY_DEVICE_TO_HOST,
                            f"reading the flag at 0x{int(ptr):x} from the host")
            return ctypes.c_int64.from_address(pinned).value

    def host_write_flag(self, ptr: int, value: int, device: int) -> None:
        check_flag_ptr(int(ptr))
        pinned, _, lock = self._host_io_for(self._check_device(device))
        with lock:
            ctypes.c_uint64.from_address(pinned + 8).value = int(value) & MASK64
            self._host_copy(device, int(ptr), pinned + 8, HIP_MEMCPY_HOST_TO_DEVICE,
                            f"writing {value} to the flag at 0x{int(ptr):x} from the host")

    # ---- lifetime ----
    @property
    def closed(self) -> bool:
        return self._is_closed

    def close(self) -> None:
        """Destroy gpuxfer's streams, free the pinned words, drop the HSA reference. Idempotent."""
        with self._lock:
            if self._is_closed:
                return
            self._is_closed = True
            streams, self._streams = list(self._streams), []
            host_io, self._host_io = dict(self._host_io), {}
            hsa, self._hsa = self._hsa, None
        for s in streams:
            s._closed = True
            try:
                self._destroy_stream(s)
            except DriverError as exc:
                log.warning("%s", exc)
        for pinned, _, _ in host_io.values():
            try:
                self._api("hipHostFree", pinned, doing="freeing the pinned flag word")
            except DriverError as exc:
                log.warning("%s", exc)
        if hsa is not None:
            hsa.close()

    def __repr__(self) -> str:
        return f"RocmPlatform({'closed' if self._is_closed else 'open'})"


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
