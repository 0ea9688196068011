"""The HSA runtime (ROCr) through ctypes, for the ``sdma`` stage hand-off on ROCm.

hip-python does not bind HSA, so the few calls gpuxfer needs -- SDMA copies on
a chosen engine, signals, agent and pointer queries -- go through ctypes on
``libhsa-runtime64.so.1``. Nothing is loaded at import: :class:`Hsa` opens the
library (or takes an injected one) on first use.

Every C function is declared once in :data:`FUNCTIONS` with its prototype; every
call that returns an ``hsa_status_t`` goes through :meth:`Hsa.call`, which raises
:class:`~gpuxfer.errors.DriverError` naming the function, the status name and
what gpuxfer was doing.

**Injecting a fake** (tests/fake_hsa.py): pass ``Hsa(lib=obj)`` where ``obj`` has
Python callables named like the C functions. They are bound through the same
:data:`FUNCTIONS` table, and every argument is converted with the declared
ctypes ``argtypes`` exactly as a real foreign call would convert it (a wrong
argument type raises ``ctypes.ArgumentError`` on the fake too), then handed to
the fake as those converted ctypes objects.

Facts this layer relies on (sources: ROCm/rocm-systems, rocr-runtime's ``hsa.h``,
``hsa_ext_amd.h`` and their implementation; none has run on an AMD GPU here):

* ``hsa_amd_memory_async_copy_on_engine`` reads each dependency signal **when
  the copy is queued**: a signal already 0 adds no wait; a non-zero one makes
  the engine poll it until it is 0. So a dependency must be armed (non-zero)
  before the copy that depends on it is queued.
* Completion decrements the completion signal by one (an SDMA atomic when the
  GPU-CPU link has 64-bit PCIe atomics, else a fence that *writes*
  ``value_at_submit - 1``, so several copies sharing a signal lose decrements
  without those atomics).
* ``engine_id`` is one-hot (``HSA_AMD_SDMA_ENGINE_n = 1 << n``); engines 0-1 are
  PCIe ("paging") engines and ROCr rejects them for xGMI peer copies.
* Consecutive SDMA packets may overlap: order between two copies comes only from
  dependency signals, never from queue position.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from .. import config
from ..errors import BadInput, DriverError, TransferTimeout

log = logging.getLogger("gpuxfer.platforms.hsa")

# --------------------------------------------------------------------------- constants
# hsa.h / hsa_ext_amd.h (ROCm/rocm-systems projects/rocr-runtime/runtime/hsa-runtime/inc)

HSA_STATUS_SUCCESS = 0x0
HSA_STATUS_INFO_BREAK = 0x1
HSA_STATUS_ERROR_INVALID_ARGUMENT = 0x1001
HSA_STATUS_ERROR_OUT_OF_RESOURCES = 0x1008

HSA_STATUS_NAMES = {
    0x0: "HSA_STATUS_SUCCESS", 0x1: "HSA_STATUS_INFO_BREAK", 0x1000: "HSA_STATUS_ERROR",
    0x1001: "HSA_STATUS_ERROR_INVALID_ARGUMENT", 0x1002: "HSA_STATUS_ERROR_INVALID_QUEUE_CREATION",
    0x1003: "HSA_STATUS_ERROR_INVALID_ALLOCATION", 0x1004: "HSA_STATUS_ERROR_INVALID_AGENT",
    0x1005: "HSA_STATUS_ERROR_INVALID_REGION", 0x1006: "HSA_STATUS_ERROR_INVALID_SIGNAL",
    0x1007: "HSA_STATUS_ERROR_INVALID_QUEUE", 0x1008: "HSA_STATUS_ERROR_OUT_OF_RESOURCES",
    0x1009: "HSA_STATUS_ERROR_INVALID_PACKET_FORMAT", 0x100A: "HSA_STATUS_ERROR_RESOURCE_FREE",
    0x100B: "HSA_STATUS_ERROR_NOT_INITIALIZED", 0x100C: "HSA_STATUS_ERROR_REFCOUNT_OVERFLOW",
    0x100D: "HSA_STATUS_ERROR_INCOMPATIBLE_ARGUMENTS", 0x100E: "HSA_STATUS_ERROR_INVALID_INDEX",
    0x100F: "HSA_STATUS_ERROR_INVALID_ISA", 0x1010: "HSA_STATUS_ERROR_INVALID_CODE_OBJECT",
    0x1011: "HSA_STATUS_ERROR_INVALID_EXECUTABLE", 0x1012: "HSA_STATUS_ERROR_FROZEN_EXECUTABLE",
    0x1013: "HSA_STATUS_ERROR_INVALID_SYMBOL_NAME", 0x1014: "HSA_STATUS_ERROR_VARIABLE_ALREADY_DEFINED",
    0x1015: "HSA_STATUS_ERROR_VARIABLE_UNDEFINED", 0x1016: "HSA_STATUS_ERROR_EXCEPTION",
    0x1017: "HSA_STATUS_ERROR_INVALID_ISA_NAME", 0x1018: "HSA_STATUS_ERROR_INVALID_CODE_SYMBOL",
    0x1019: "HSA_STATUS_ERROR_INVALID_EXECUTABLE_SYMBOL", 0x1020: "HSA_STATUS_ERROR_INVALID_FILE",
    0x1021: "HSA_STATUS_ERROR_INVALID_CODE_OBJECT_READER", 0x1022: "HSA_STATUS_ERROR_INVALID_CACHE",
    0x1023: "HSA_STATUS_ERROR_INVALID_WAVEFRONT", 0x1024: "HSA_STATUS_ERROR_INVALID_SIGNAL_GROUP",
    0x1025: "HSA_STATUS_ERROR_INVALID_RUNTIME_STATE",
}

HSA_AGENT_INFO_NAME = 0                  # char[64]
HSA_AGENT_INFO_NODE = 16                 # uint32
HSA_AGENT_INFO_DEVICE = 17               # hsa_device_type_t (uint32)
HSA_DEVICE_TYPE_CPU = 0
HSA_DEVICE_TYPE_GPU = 1
HSA_AMD_AGENT_INFO_DRIVER_NODE_ID = 0xA004   # uint32
HSA_AMD_AGENT_INFO_BDFID = 0xA006            # uint32: bus << 8 | device << 3 | function
HSA_AMD_AGENT_INFO_DOMAIN = 0xA00F           # uint32
HSA_AMD_AGENT_INFO_NUM_SDMA_ENG = 0xA10A     # uint32 (PCIe / "paging" engines)
HSA_AMD_AGENT_INFO_NUM_SDMA_XGMI_ENG = 0xA10B

HSA_SYSTEM_INFO_TIMESTAMP_FREQUENCY = 3  # uint64, Hz: the unit of a wait's timeout hint

HSA_SIGNAL_CONDITION_EQ = 0
HSA_SIGNAL_CONDITION_NE = 1
HSA_SIGNAL_CONDITION_LT = 2
HSA_SIGNAL_CONDITION_GTE = 3
HSA_WAIT_STATE_BLOCKED = 0
HSA_WAIT_STATE_ACTIVE = 1

HSA_AMD_SIGNAL_AMD_GPU_ONLY = 1   # a plain memory signal, never an interrupt one
HSA_AMD_SIGNAL_IPC = 2

HSA_EXT_POINTER_TYPE_UNKNOWN = 0
HSA_EXT_POINTER_TYPE_HSA = 1
HSA_EXT_POINTER_TYPE_LOCKED = 2
HSA_EXT_POINTER_TYPE_GRAPHICS = 3
HSA_EXT_POINTER_TYPE_IPC = 4


def sdma_engine(n: int) -> int:
    """``HSA_AMD_SDMA_ENGINE_n`` (one-hot)."""
    if not 0 <= n < 32:
        raise BadInput(f"SDMA engine index {n} is out of range")
    return 1 << n


def engine_bits(mask: int) -> list[int]:
    """Engine indices set in ``mask``, lowest first."""
    return [i for i in range(32) if mask >> i & 1]


def mask_str(mask: int | None) -> str:
    if mask is None:
        return "unknown"
    return f"0x{mask:x} (engines {', '.join(map(str, engine_bits(mask))) or 'none'})"


# --------------------------------------------------------------------------- ctypes types


class hsa_agent_t(ctypes.Structure):
    _fields_ = [("handle", ctypes.c_uint64)]


class hsa_signal_t(ctypes.Structure):
    _fields_ = [("handle", ctypes.c_uint64)]


class hsa_amd_pointer_info_t(ctypes.Structure):
    # Fields up to global_flags; `size` tells the runtime how much we have ("can only grow").
    _fields_ = [("size", ctypes.c_uint32), ("type", ctypes.c_uint32),
                ("agentBaseAddress", ctypes.c_void_p), ("hostBaseAddress", ctypes.c_void_p),
                ("sizeInBytes", ctypes.c_size_t), ("userData", ctypes.c_void_p),
                ("agentOwner", hsa_agent_t), ("global_flags", ctypes.c_uint32)]


hsa_status_t = ctypes.c_int
hsa_signal_value_t = ctypes.c_int64
AGENT_CALLBACK = ctypes.CFUNCTYPE(hsa_status_t, hsa_agent_t, ctypes.c_void_p)


@dataclass(frozen=True)
class Function:
    """One C function: its name, return type, argument types; ``optional`` ones may be absent."""

    name: str
    restype: Any
    argtypes: tuple
    optional: bool = False
    returns_status: bool = True


_u32p = ctypes.POINTER(ctypes.c_uint32)
_sigp = ctypes.POINTER(hsa_signal_t)
_agentp = ctypes.POINTER(hsa_agent_t)

FUNCTIONS: tuple[Function, ...] = (
    # hsa_status_t hsa_init(void);
    Function("hsa_init", hsa_status_t, ()),
    # hsa_status_t hsa_shut_down(void);
    Function("hsa_shut_down", hsa_status_t, ()),
    # hsa_status_t hsa_status_string(hsa_status_t status, const char** status_string);
    Function("hsa_status_string", hsa_status_t, (hsa_status_t, ctypes.POINTER(ctypes.c_char_p))),
    # hsa_status_t hsa_system_get_info(hsa_system_info_t attribute, void* value);
    Function("hsa_system_get_info", hsa_status_t, (ctypes.c_int, ctypes.c_void_p)),
    # hsa_status_t hsa_iterate_agents(hsa_status_t (*callback)(hsa_agent_t agent, void* data), void* data);
    Function("hsa_iterate_agents", hsa_status_t, (AGENT_CALLBACK, ctypes.c_void_p)),
    # hsa_status_t hsa_agent_get_info(hsa_agent_t agent, hsa_agent_info_t attribute, void* value);
    Function("hsa_agent_get_info", hsa_status_t, (hsa_agent_t, ctypes.c_int, ctypes.c_void_p)),
    # hsa_status_t hsa_amd_signal_create(hsa_signal_value_t initial_value, uint32_t num_consumers,
    #                                    const hsa_agent_t* consumers, uint64_t attributes, hsa_signal_t* signal);
    Function("hsa_amd_signal_create", hsa_status_t,
             (hsa_signal_value_t, ctypes.c_uint32, _agentp, ctypes.c_uint64, _sigp)),
    # hsa_status_t hsa_signal_destroy(hsa_signal_t signal);
    Function("hsa_signal_destroy", hsa_status_t, (hsa_signal_t,)),
    # hsa_status_t hsa_amd_signal_value_pointer(hsa_signal_t signal, volatile hsa_signal_value_t** value_ptr);
    Function("hsa_amd_signal_value_pointer", hsa_status_t, (hsa_signal_t, ctypes.POINTER(ctypes.c_void_p))),
    # hsa_signal_value_t hsa_signal_load_scacquire(hsa_signal_t signal);
    Function("hsa_signal_load_scacquire", hsa_signal_value_t, (hsa_signal_t,), returns_status=False),
    # void hsa_signal_store_screlease(hsa_signal_t signal, hsa_signal_value_t value);
    Function("hsa_signal_store_screlease", None, (hsa_signal_t, hsa_signal_value_t), returns_status=False),
    # hsa_signal_value_t hsa_signal_wait_scacquire(hsa_signal_t signal, hsa_signal_condition_t condition,
    #     hsa_signal_value_t compare_value, uint64_t timeout_hint, hsa_wait_state_t wait_state_hint);
    Function("hsa_signal_wait_scacquire", hsa_signal_value_t,
             (hsa_signal_t, ctypes.c_int, hsa_signal_value_t, ctypes.c_uint64, ctypes.c_int), returns_status=False),
    # hsa_status_t hsa_amd_memory_async_copy_on_engine(void* dst, hsa_agent_t dst_agent, const void* src,
    #     hsa_agent_t src_agent, size_t size, uint32_t num_dep_signals, const hsa_signal_t* dep_signals,
    #     hsa_signal_t completion_signal, hsa_amd_sdma_engine_id_t engine_id, bool force_copy_on_sdma);
    Function("hsa_amd_memory_async_copy_on_engine", hsa_status_t,
             (ctypes.c_void_p, hsa_agent_t, ctypes.c_void_p, hsa_agent_t, ctypes.c_size_t, ctypes.c_uint32,
              _sigp, hsa_signal_t, ctypes.c_uint, ctypes.c_bool)),
    # hsa_status_t hsa_amd_memory_copy_engine_status(hsa_agent_t dst_agent, hsa_agent_t src_agent,
    #                                                uint32_t* engine_ids_mask);
    Function("hsa_amd_memory_copy_engine_status", hsa_status_t, (hsa_agent_t, hsa_agent_t, _u32p)),
    # hsa_status_t hsa_amd_memory_get_preferred_copy_engine(hsa_agent_t dst_agent, hsa_agent_t src_agent,
    #                                                       uint32_t* recommended_ids_mask);   (ext_amd >= 1.8)
    Function("hsa_amd_memory_get_preferred_copy_engine", hsa_status_t, (hsa_agent_t, hsa_agent_t, _u32p),
             optional=True),
    # hsa_status_t hsa_amd_pointer_info(const void* ptr, hsa_amd_pointer_info_t* info, void* (*alloc)(size_t),
    #                                   uint32_t* num_agents_accessible, hsa_agent_t** accessible);
    Function("hsa_amd_pointer_info", hsa_status_t,
             (ctypes.c_void_p, ctypes.POINTER(hsa_amd_pointer_info_t), ctypes.c_void_p, _u32p,
              ctypes.POINTER(_agentp))),
)

FUNCTIONS_BY_NAME = {f.name: f for f in FUNCTIONS}

LIBRARY_SONAME = "libhsa-runtime64.so.1"


def library_candidates() -> list[str]:
    """Where to look for ROCr, in order.

    The SONAME first: libamdhip64 (torch's) depends on it, so once torch/HIP is up
    the loader hands back the instance already in the process, the one whose
    signals and agents HIP uses.
    """
    out = []
    if config.get("GPUXFER_HSA_LIBRARY"):
        out.append(config.get("GPUXFER_HSA_LIBRARY"))
    out.append(LIBRARY_SONAME)
    for var in ("ROCM_PATH", "ROCM_HOME"):
        if os.environ.get(var):
            out.append(os.path.join(os.environ[var], "lib", LIBRARY_SONAME))
    out.append(os.path.join("/opt/rocm/lib", LIBRARY_SONAME))
    return list(dict.fromkeys(out))


def _converting(fn: Callable, f: Function) -> Callable:
    """Wrap a Python stand-in so its arguments are type-checked exactly as a foreign call checks them.

    Each argument goes through its declared type's ``from_param`` (what ctypes
    does before a real call), so an argument the real library would refuse
    raises ``ctypes.ArgumentError`` here too; the stand-in then receives the
    original Python objects (``from_param`` results hide simple values).
    """

    def call(*args):
        if len(args) != len(f.argtypes):
            raise TypeError(f"{f.name} takes {len(f.argtypes)} arguments ({len(args)} given)")
        for i, (a, t) in enumerate(zip(args, f.argtypes)):
            try:
                t.from_param(a)
            except TypeError as exc:
                raise ctypes.ArgumentError(f"argument {i + 1}: {exc}") from None
        return fn(*args)

    call.__name__ = f.name
    return call


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Agent:
    """One HSA agent (GPU or CPU) as gpuxfer needs it."""

    handle: int
    device_type: int
    name: str
    node: int | None = None             # HSA_AGENT_INFO_NODE
    driver_node: int | None = None      # HSA_AMD_AGENT_INFO_DRIVER_NODE_ID (KFD topology node)
    domain: int | None = None
    bdfid: int | None = None
    num_sdma: int | None = None         # PCIe engines
    num_sdma_xgmi: int | None = None

    @property
    def is_gpu(self) -> bool:
        return self.device_type == HSA_DEVICE_TYPE_GPU

    @property
    def pci_bus_id(self) -> str | None:
        """``dddd:bb:dd.f`` as hipDeviceGetPCIBusId formats it (lower case)."""
        if self.bdfid is None:
            return None
        return (f"{self.domain or 0:04x}:{self.bdfid >> 8 & 0xFF:02x}:"
                f"{self.bdfid >> 3 & 0x1F:02x}.{self.bdfid & 0x7:x}")


@dataclass(frozen=True)
class PointerInfo:
    type: int
    agent_base: int
    host_base: int
    size: int
    agent_owner: int


@dataclass(frozen=True)
class Signal:
    """An ``hsa_signal_t`` handle (not owned: see :meth:`Hsa.signal_create` / ``signal_destroy``)."""

    handle: int

    def c(self) -> hsa_signal_t:
        return hsa_signal_t(self.handle)


def parse_pci_bus_id(bus_id: str) -> tuple[int, int]:
    """``"0000:c1:00.0"`` -> (domain, bdfid) as HSA reports them."""
    try:
        dom, bus, rest = bus_id.strip().lower().split(":")
        dev, fn = rest.split(".")
        return int(dom, 16), int(bus, 16) << 8 | int(dev, 16) << 3 | int(fn, 16)
    except ValueError:
        raise BadInput(f"not a PCI bus id: {bus_id!r}") from None


def choose_engine(available: int, preferred: int | None, *, pcie_engines: int = 2,
                  xgmi_peer: bool = True) -> tuple[int, str]:
    """Pick one engine (one-hot) for a copy, and say why.

    ``preferred`` is the driver's recommended mask for the pair (0 or None: no
    preference); ``available`` is what ``hsa_amd_memory_copy_engine_status``
    reports for the pair. The recommendation wins (the lowest recommended engine
    that is also available, else the lowest recommended); without one, the
    lowest available engine that may carry this copy (not a PCIe engine for an
    xGMI peer: ROCr refuses those). Raises BadInput when nothing qualifies.
    """
    if preferred:
        both = preferred & available
        pick = both if both else preferred
        low = pick & -pick
        why = (f"lowest engine of the driver's recommended mask {mask_str(preferred)}"
               + ("" if both else f", none of which is idle now (available {mask_str(available)})"))
        return low, why
    usable = available
    if xgmi_peer:
        usable &= ~((1 << pcie_engines) - 1)
    if not usable:
        raise BadInput(f"no SDMA engine can carry this copy: the driver recommends none and the available "
                       f"mask is {mask_str(available)}"
                       + (f" (engines below {pcie_engines} are PCIe engines, refused for xGMI peers)"
                          if xgmi_peer else ""))
    return usable & -usable, (f"no driver recommendation; lowest available "
                              f"{'xGMI ' if xgmi_peer else ''}engine of {mask_str(available)}")


# --------------------------------------------------------------------------- KFD topology (sysfs)

KFD_TOPOLOGY = "/sys/class/kfd/kfd/topology/nodes"
CRAT_IOLINK_FLAGS_NO_ATOMICS_64_BIT = 1 << 3   # Linux drivers/gpu/drm/amd/amdkfd/kfd_crat.h


def _read_properties(path: Path) -> dict[str, int]:
    out = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:
            try:
                out[parts[0]] = int(parts[1])
            except ValueError:
                pass
    return out


def kfd_io_links(node: int, root: str | os.PathLike = KFD_TOPOLOGY) -> list[dict[str, int]]:
    """The io_link property dicts of KFD topology node ``node`` (empty if unreadable)."""
    base = Path(root) / str(node) / "io_links"
    try:
        return [_read_properties(p / "properties") for p in sorted(base.iterdir()) if (p / "properties").is_file()]
    except OSError:
        return []


def kfd_recommended_mask(src_node: int, dst_node: int, root: str | os.PathLike = KFD_TOPOLOGY) -> int | None:
    """``recommended_sdma_engine_id_mask`` of the io_link src -> dst, or None if absent/unreadable."""
    for link in kfd_io_links(src_node, root):
        if link.get("node_to") == dst_node and "recommended_sdma_engine_id_mask" in link:
            return link["recommended_sdma_engine_id_mask"]
    return None


def kfd_pcie_atomics_64(gpu_node: int, root: str | os.PathLike = KFD_TOPOLOGY) -> bool | None:
    """Whether the GPU's link to a CPU node has 64-bit atomics (None if it cannot be told).

    ROCr ends an SDMA copy with an atomic decrement of the completion signal
    only with these atomics; otherwise with a fence that writes
    ``value_at_submit - 1``, so sharing one completion signal between copies
    is safe only when this returns True.
    """
    links = kfd_io_links(gpu_node, root)
    seen = None
    for link in links:
        to = link.get("node_to")
        if to is None or "flags" not in link:
            continue
        try:
            props = _read_properties(Path(root) / str(to) / "properties")
        except OSError:
            continue
        if props.get("cpu_cores_count", 0) > 0 and props.get("simd_count", 0) == 0:
            ok = not (link["flags"] & CRAT_IOLINK_FLAGS_NO_ATOMICS_64_BIT)
            seen = ok if seen is None else (seen and ok)
    return seen


# --------------------------------------------------------------------------- the runtime


class Hsa:
    """ROCr through ctypes, loaded lazily; every status-returning call is checked.

    ``lib``: an already-open library (a ``ctypes.CDLL``) or a fake object with
    Python callables named like the C functions. ``path``: a library to open
    instead of searching :func:`library_candidates`. Call :meth:`init` before
    anything else and :meth:`close` at the end (``hsa_init`` is reference
    counted: HIP's own reference is untouched).
    """

    def __init__(self, lib: Any = None, path: str | None = None):
        self._lib_given = lib
        self._path = path
        self._fns: dict[str, Callable | None] | None = None
        self._lock = threading.Lock()
        self._inits = 0
        self._closed = False
        self._ts_hz: int | None = None
        self.library_path: str | None = None

    # ---- loading ----
    def _open(self) -> Any:
        if self._lib_given is not None:
            self.library_path = getattr(self._lib_given, "_name", type(self._lib_given).__name__)
            return self._lib_given
        errors = []
        for cand in ([self._path] if self._path else library_candidates()):
            try:
                lib = ctypes.CDLL(cand, mode=ctypes.RTLD_GLOBAL)
            except OSError as exc:
                errors.append(f"{cand}: {exc}")
                continue
            self.library_path = cand
            return lib
        raise DriverError("dlopen", "LIBRARY_NOT_FOUND", -1, "loading the HSA runtime (ROCr)",
                          "; ".join(errors))

    def _bind(self) -> dict[str, Callable | None]:
        with self._lock:
            if self._fns is not None:
                return self._fns
            lib = self._open()
            real = isinstance(lib, ctypes.CDLL)
            fns: dict[str, Callable | None] = {}
            for f in FUNCTIONS:
                try:
                    raw = getattr(lib, f.name)
                except AttributeError:
                    if f.optional:
                        fns[f.name] = None
                        continue
                    raise DriverError("dlsym", "SYMBOL_NOT_FOUND", -1, f"binding {f.name}",
                                      f"{self.library_path} does not export it (ROCm too old?)") from None
                if real:
                    raw.restype = f.restype
                    raw.argtypes = list(f.argtypes)
                    fns[f.name] = raw
                else:
                    fns[f.name] = _converting(raw, f)
            self._fns = fns
            return fns

    def has(self, name: str) -> bool:
        return self._bind().get(name) is not None

    # ---- checking ----
    def status_name(self, status: int) -> str:
        return HSA_STATUS_NAMES.get(int(status), f"HSA_STATUS_0x{int(status):x}")

    def _status_string(self, status: int) -> str:
        fn = (self._fns or {}).get("hsa_status_string")
        if fn is None:
            return ""
        try:
            out = ctypes.c_char_p()
            if fn(int(status), ctypes.byref(out)) == HSA_STATUS_SUCCESS and out.value:
                return out.value.decode(errors="replace")
        except Exception:  # noqa: BLE001 - the description is a courtesy
            pass
        return ""

    def call(self, name: str, *args, doing: str, ok: Iterable[int] = (HSA_STATUS_SUCCESS,)) -> int:
        """Call a status-returning function; raise DriverError unless the status is in ``ok``."""
        f = FUNCTIONS_BY_NAME[name]
        fn = self._bind()[name]
        if fn is None:
            raise DriverError(name, "SYMBOL_NOT_FOUND", -1, doing, f"{self.library_path} does not export it")
        if not f.returns_status:
            raise BadInput(f"{name} does not return a status; use Hsa.raw")
        try:
            status = int(fn(*args))
        except ctypes.ArgumentError as exc:
            raise DriverError(name, "BAD_ARGUMENT_TYPE", -1, doing, str(exc)) from exc
        if status not in tuple(ok):
            raise DriverError(name, self.status_name(status), status, doing, self._status_string(status))
        return status

    def raw(self, name: str) -> Callable:
        """A function that returns a value, not a status (signal load/store/wait)."""
        fn = self._bind()[name]
        if fn is None:  # pragma: no cover - none of these is optional
            raise DriverError(name, "SYMBOL_NOT_FOUND", -1, f"calling {name}", "")
        return fn

    # ---- lifetime ----
    def init(self) -> "Hsa":
        if self._closed:
            raise BadInput("this Hsa object is closed")
        self.call("hsa_init", doing="initializing the HSA runtime")
        self._inits += 1
        return self

    def close(self) -> None:
        """Drop our hsa_init references. Idempotent."""
        if self._closed:
            return
        self._closed = True
        while self._inits:
            self._inits -= 1
            try:
                self.call("hsa_shut_down", doing="releasing gpuxfer's reference to the HSA runtime")
            except DriverError as exc:  # a failed release must not hide the error that led here
                log.warning("%s", exc)

    def __enter__(self):
        return self.init()

    def __exit__(self, *exc):
        self.close()

    # ---- system and agents ----
    def timestamp_hz(self) -> int:
        if self._ts_hz is None:
            hz = ctypes.c_uint64(0)
            self.call("hsa_system_get_info", HSA_SYSTEM_INFO_TIMESTAMP_FREQUENCY, ctypes.byref(hz),
                      doing="reading the system timestamp frequency")
            self._ts_hz = int(hz.value) or 1_000_000_000
        return self._ts_hz

    def _agent_u32(self, handle: int, attribute: int, doing: str, optional: bool = False) -> int | None:
        val = ctypes.c_uint32(0)
        try:
            self.call("hsa_agent_get_info", hsa_agent_t(handle), attribute, ctypes.byref(val), doing=doing)
        except DriverError:
            if optional:
                return None
            raise
        return int(val.value)

    def agents(self) -> list[Agent]:
        """Every agent ROCr shows this process (ROCR_VISIBLE_DEVICES applies, HIP_VISIBLE_DEVICES does not)."""
        handles: list[int] = []

        def collect(agent, _data):
            handles.append(int(agent.handle))
            return HSA_STATUS_SUCCESS

        cb = AGENT_CALLBACK(collect)   # kept alive for the call
        self.call("hsa_iterate_agents", cb, None, doing="listing HSA agents")
        out = []
        for h in handles:
            dev = self._agent_u32(h, HSA_AGENT_INFO_DEVICE, f"reading the device type of agent 0x{h:x}")
            name_buf = ctypes.create_string_buffer(64)
            self.call("hsa_agent_get_info", hsa_agent_t(h), HSA_AGENT_INFO_NAME, name_buf,
                      doing=f"reading the name of agent 0x{h:x}")
            name = name_buf.value.decode(errors="replace")
            if dev != HSA_DEVICE_TYPE_GPU:
                out.append(Agent(h, dev, name))
                continue
            d = f"reading GPU agent 0x{h:x} ({name})"
            out.append(Agent(
                h, dev, name,
                node=self._agent_u32(h, HSA_AGENT_INFO_NODE, d, optional=True),
                driver_node=self._agent_u32(h, HSA_AMD_AGENT_INFO_DRIVER_NODE_ID, d, optional=True),
                domain=self._agent_u32(h, HSA_AMD_AGENT_INFO_DOMAIN, d, optional=True),
                bdfid=self._agent_u32(h, HSA_AMD_AGENT_INFO_BDFID, d, optional=True),
                num_sdma=self._agent_u32(h, HSA_AMD_AGENT_INFO_NUM_SDMA_ENG, d, optional=True),
                num_sdma_xgmi=self._agent_u32(h, HSA_AMD_AGENT_INFO_NUM_SDMA_XGMI_ENG, d, optional=True)))
        return out

    def gpu_agent_by_pci(self, pci_bus_id: str) -> Agent:
        """The GPU agent at a PCI address (HIP ordinals and HSA agent order need not agree)."""
        domain, bdfid = parse_pci_bus_id(pci_bus_id)
        gpus = [a for a in self.agents() if a.is_gpu]
        for a in gpus:
            if a.bdfid == bdfid and (a.domain is None or a.domain == domain):
                return a
        raise DriverError("hsa_iterate_agents", "AGENT_NOT_FOUND", -1, f"finding the HSA agent of GPU {pci_bus_id}",
                          "GPU agents seen: " + (", ".join(f"{a.name}@{a.pci_bus_id}" for a in gpus) or "none")
                          + " (ROCR_VISIBLE_DEVICES hides GPUs from HSA)")

    # ---- signals ----
    def signal_create(self, initial: int, *, gpu_only: bool = True) -> Signal:
        sig = hsa_signal_t(0)
        self.call("hsa_amd_signal_create", int(initial), 0, None,
                  HSA_AMD_SIGNAL_AMD_GPU_ONLY if gpu_only else 0, ctypes.byref(sig),
                  doing=f"creating a signal with value {initial}")
        return Signal(int(sig.handle))

    def signal_destroy(self, sig: Signal) -> None:
        self.call("hsa_signal_destroy", sig.c(), doing=f"destroying signal 0x{sig.handle:x}")

    def signal_value_pointer(self, sig: Signal) -> int:
        ptr = ctypes.c_void_p(0)
        self.call("hsa_amd_signal_value_pointer", sig.c(), ctypes.byref(ptr),
                  doing=f"reading the value address of signal 0x{sig.handle:x}")
        return int(ptr.value or 0)

    def signal_store(self, sig: Signal, value: int) -> None:
        self.raw("hsa_signal_store_screlease")(sig.c(), int(value))

    def signal_load(self, sig: Signal) -> int:
        return int(self.raw("hsa_signal_load_scacquire")(sig.c()))

    def signal_wait_at_most(self, sig: Signal, value: int, timeout_s: float, *, rank: int = -1, step: int = -1,
                            flag: str | None = None, what: str = "", slice_s: float = 0.05) -> int:
        """Wait on the host until ``signal <= value``; raise TransferTimeout after ``timeout_s``.

        ``hsa_signal_wait_scacquire`` may return early (spurious wake-ups, the
        hint is only a hint), so this loops on its own deadline, one slice at a
        time. Returns the value seen.
        """
        fn = self.raw("hsa_signal_wait_scacquire")
        hint = max(1, int(slice_s * self.timestamp_hz()))
        deadline = time.monotonic() + timeout_s
        seen = None
        while True:
            seen = int(fn(sig.c(), HSA_SIGNAL_CONDITION_LT, int(value) + 1, hint, HSA_WAIT_STATE_BLOCKED))
            if seen <= value:
                return seen
            if time.monotonic() >= deadline:
                seen = self.signal_load(sig)
                if seen <= value:
                    return seen
                note = f"an HSA signal counts down: this waited for it to fall to <= {value}"
                raise TransferTimeout(rank=rank, step=step, flag=flag or f"hsa signal 0x{sig.handle:x}",
                                      expected=value, seen=seen, timeout_s=timeout_s,
                                      what=f"{what}; {note}" if what else note)

    # ---- copies ----
    def copy_on_engine(self, dst: int, dst_agent: int, src: int, src_agent: int, nbytes: int,
                       deps: Sequence[Signal], completion: Signal, engine: int, *, force_sdma: bool = True,
                       doing: str = "") -> None:
        """Queue an SDMA copy on ``engine`` (one-hot). Dependencies are read *now* (see the module doc)."""
        if engine <= 0 or engine & (engine - 1):
            raise BadInput(f"engine_id must be one-hot (HSA_AMD_SDMA_ENGINE_n), got 0x{engine:x}")
        arr = (hsa_signal_t * max(1, len(deps)))(*[d.c() for d in deps])
        self.call("hsa_amd_memory_async_copy_on_engine", int(dst), hsa_agent_t(dst_agent), int(src),
                  hsa_agent_t(src_agent), int(nbytes), len(deps), arr if deps else None, completion.c(),
                  int(engine), bool(force_sdma),
                  doing=doing or (f"queueing an SDMA copy of {nbytes} B 0x{src:x} -> 0x{dst:x} on engine "
                                  f"{engine_bits(engine)[0]}"))

    def copy_engine_status(self, dst_agent: int, src_agent: int) -> int:
        """The engines free for a copy src -> dst now (0 when ROCr says it is out of them)."""
        mask = ctypes.c_uint32(0)
        st = self.call("hsa_amd_memory_copy_engine_status", hsa_agent_t(dst_agent), hsa_agent_t(src_agent),
                       ctypes.byref(mask), doing="reading the SDMA engines available for a GPU pair",
                       ok=(HSA_STATUS_SUCCESS, HSA_STATUS_ERROR_OUT_OF_RESOURCES))
        return 0 if st == HSA_STATUS_ERROR_OUT_OF_RESOURCES else int(mask.value)

    def preferred_copy_engine(self, dst_agent: int, src_agent: int) -> int | None:
        """The driver's recommended engine mask for the pair (0: no preference; None: ROCr too old)."""
        if not self.has("hsa_amd_memory_get_preferred_copy_engine"):
            return None
        mask = ctypes.c_uint32(0)
        self.call("hsa_amd_memory_get_preferred_copy_engine", hsa_agent_t(dst_agent), hsa_agent_t(src_agent),
                  ctypes.byref(mask), doing="reading the recommended SDMA engines of a GPU pair")
        return int(mask.value)

    # ---- pointers ----
    def pointer_info(self, ptr: int) -> PointerInfo:
        info = hsa_amd_pointer_info_t()
        info.size = ctypes.sizeof(hsa_amd_pointer_info_t)
        self.call("hsa_amd_pointer_info", int(ptr), ctypes.byref(info), None, None, None,
                  doing=f"reading the owner of address 0x{int(ptr):x}")
        return PointerInfo(int(info.type), int(info.agentBaseAddress or 0), int(info.hostBaseAddress or 0),
                           int(info.sizeInBytes), int(info.agentOwner.handle))


# --------------------------------------------------------------------------- engine choice per GPU pair


@dataclass(frozen=True)
class EnginePlan:
    """Which SDMA engines carry a pair's copies, and why."""

    data: tuple[int, ...]          # one-hot engine ids, used round-robin by the data copies
    local: int                     # one-hot engine id of the local 8-byte ``sent`` copy
    why: str


def plan_engines(hsa, src_agent, dst_agent, copies: int, *, topology_root: str | None = None) -> EnginePlan:
    """Pick the engines for a GPU pair from the driver's recommendation (never a hard-coded engine).

    ``src_agent`` / ``dst_agent``: :class:`Agent`. The
    recommended mask comes from ``hsa_amd_memory_get_preferred_copy_engine``
    (ROCr with hsa_ext_amd >= 1.8) or else KFD's sysfs
    ``recommended_sdma_engine_id_mask``; the available mask from
    ``hsa_amd_memory_copy_engine_status``. With several recommended engines and
    ``copies > 1`` the data copies rotate over them.
    """
    kw = {} if topology_root is None else {"root": topology_root}
    pcie = src_agent.num_sdma if src_agent.num_sdma is not None else 2
    preferred = hsa.preferred_copy_engine(dst_agent.handle, src_agent.handle)
    source = "hsa_amd_memory_get_preferred_copy_engine"
    if preferred is None:
        src_node = src_agent.driver_node if src_agent.driver_node is not None else src_agent.node
        dst_node = dst_agent.driver_node if dst_agent.driver_node is not None else dst_agent.node
        preferred = (kfd_recommended_mask(src_node, dst_node, **kw)
                     if src_node is not None and dst_node is not None else None)
        source = "KFD sysfs recommended_sdma_engine_id_mask"
    available = hsa.copy_engine_status(dst_agent.handle, src_agent.handle)
    first, why = choose_engine(available, preferred, pcie_engines=pcie, xgmi_peer=True)
    data = [first]
    if copies > 1 and preferred:
        data = [1 << b for b in engine_bits(preferred)] or data
    local_avail = hsa.copy_engine_status(src_agent.handle, src_agent.handle)
    local_pref = hsa.preferred_copy_engine(src_agent.handle, src_agent.handle) or 0
    try:
        local, _ = choose_engine(local_avail, local_pref, pcie_engines=pcie, xgmi_peer=False)
    except BadInput:
        local = first
    return EnginePlan(tuple(data), local,
                      f"data on engine(s) {[engine_bits(e)[0] for e in data]} ({why}; recommendation from {source}: "
                      f"{mask_str(preferred)}); local flag copy on engine {engine_bits(local)[0]}")
