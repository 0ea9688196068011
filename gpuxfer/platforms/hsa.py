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

Layout: this module holds the runtime (:class:`Hsa`) and what its queries return;
the C declarations are :mod:`~gpuxfer.platforms.hsa_ffi`, the engine choice per
GPU pair (masks, KFD topology, :func:`plan_engines`) is
:mod:`~gpuxfer.platforms.hsa_engines`; both are re-exported here.
"""
from __future__ import annotations

import ctypes
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from ..errors import BadInput, DriverError, TransferTimeout
from .hsa_engines import (CRAT_IOLINK_FLAGS_NO_ATOMICS_64_BIT, KFD_TOPOLOGY, EnginePlan, choose_engine, engine_bits,
                          kfd_io_links, kfd_pcie_atomics_64, kfd_recommended_mask, mask_str, plan_engines, sdma_engine)
from .hsa_ffi import (AGENT_CALLBACK, FUNCTIONS, FUNCTIONS_BY_NAME, HSA_AGENT_INFO_DEVICE, HSA_AGENT_INFO_NAME,
                      HSA_AGENT_INFO_NODE, HSA_AMD_AGENT_INFO_BDFID, HSA_AMD_AGENT_INFO_DOMAIN,
                      HSA_AMD_AGENT_INFO_DRIVER_NODE_ID, HSA_AMD_AGENT_INFO_NUM_SDMA_ENG,
                      HSA_AMD_AGENT_INFO_NUM_SDMA_XGMI_ENG, HSA_AMD_SIGNAL_AMD_GPU_ONLY, HSA_AMD_SIGNAL_IPC,
                      HSA_DEVICE_TYPE_CPU, HSA_DEVICE_TYPE_GPU, HSA_EXT_POINTER_TYPE_GRAPHICS,
                      HSA_EXT_POINTER_TYPE_HSA, HSA_EXT_POINTER_TYPE_IPC, HSA_EXT_POINTER_TYPE_LOCKED,
                      HSA_EXT_POINTER_TYPE_UNKNOWN, HSA_SIGNAL_CONDITION_EQ, HSA_SIGNAL_CONDITION_GTE,
                      HSA_SIGNAL_CONDITION_LT, HSA_SIGNAL_CONDITION_NE, HSA_STATUS_ERROR_INVALID_ARGUMENT,
                      HSA_STATUS_ERROR_OUT_OF_RESOURCES, HSA_STATUS_INFO_BREAK, HSA_STATUS_NAMES, HSA_STATUS_SUCCESS,
                      HSA_SYSTEM_INFO_TIMESTAMP_FREQUENCY, HSA_WAIT_STATE_ACTIVE, HSA_WAIT_STATE_BLOCKED,
                      LIBRARY_SONAME, Function, hsa_agent_t, hsa_amd_pointer_info_t, hsa_signal_t, hsa_signal_value_t,
                      hsa_status_t, library_candidates, _converting)

__all__ = [  # the runtime, and the FFI tables and engine choice it is built on
    "Agent", "PointerInfo", "Signal", "parse_pci_bus_id", "Hsa", "HSA_STATUS_SUCCESS",
    "HSA_STATUS_INFO_BREAK", "HSA_STATUS_ERROR_INVALID_ARGUMENT", "HSA_STATUS_ERROR_OUT_OF_RESOURCES",
    "HSA_STATUS_NAMES", "HSA_AGENT_INFO_NAME", "HSA_AGENT_INFO_NODE", "HSA_AGENT_INFO_DEVICE",
    "HSA_DEVICE_TYPE_CPU", "HSA_DEVICE_TYPE_GPU", "HSA_AMD_AGENT_INFO_DRIVER_NODE_ID", "HSA_AMD_AGENT_INFO_BDFID",
    "HSA_AMD_AGENT_INFO_DOMAIN", "HSA_AMD_AGENT_INFO_NUM_SDMA_ENG", "HSA_AMD_AGENT_INFO_NUM_SDMA_XGMI_ENG",
    "HSA_SYSTEM_INFO_TIMESTAMP_FREQUENCY", "HSA_SIGNAL_CONDITION_EQ", "HSA_SIGNAL_CONDITION_NE",
    "HSA_SIGNAL_CONDITION_LT", "HSA_SIGNAL_CONDITION_GTE", "HSA_WAIT_STATE_BLOCKED", "HSA_WAIT_STATE_ACTIVE",
    "HSA_AMD_SIGNAL_AMD_GPU_ONLY", "HSA_AMD_SIGNAL_IPC", "HSA_EXT_POINTER_TYPE_UNKNOWN", "HSA_EXT_POINTER_TYPE_HSA",
    "HSA_EXT_POINTER_TYPE_LOCKED", "HSA_EXT_POINTER_TYPE_GRAPHICS", "HSA_EXT_POINTER_TYPE_IPC", "hsa_agent_t",
    "hsa_signal_t", "hsa_amd_pointer_info_t", "hsa_status_t", "hsa_signal_value_t", "AGENT_CALLBACK", "Function",
    "FUNCTIONS", "FUNCTIONS_BY_NAME", "LIBRARY_SONAME", "library_candidates", "sdma_engine", "engine_bits",
    "mask_str", "choose_engine", "KFD_TOPOLOGY", "CRAT_IOLINK_FLAGS_NO_ATOMICS_64_BIT", "kfd_io_links",
    "kfd_recommended_mask", "kfd_pcie_atomics_64", "EnginePlan", "plan_engines",
]

log = logging.getLogger("gpuxfer.platforms.hsa")


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
