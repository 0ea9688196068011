"""A fake ROCr (HSA runtime) for CPU tests of gpuxfer.platforms.hsa and the ``sdma`` backend.

``FakeHsaLib`` has Python stand-ins named like the C functions in
``gpuxfer.platforms.hsa.FUNCTIONS``; inject it with ``Hsa(lib=FakeHsaLib(...))``.
``Hsa`` type-checks every argument against the declared ctypes prototypes before
the stand-in sees it, so marshalling mistakes fail here as they would on ROCr.

It behaves as ROCr's sources (ROCm/rocm-systems, rocr-runtime) describe ROCr:

* signals are real ``amd_signal_t``-like blocks in host memory: the handle is
  the block's address and the value lives at ``handle + 8`` (so anything that
  writes that word -- a host-platform stream write included -- moves the
  signal);
* ``hsa_amd_memory_async_copy_on_engine`` reads every dependency signal **when
  the copy is queued**: a dependency that is 0 then adds nothing; a non-zero one
  becomes a poll that blocks that engine's ring until the signal reads 0;
* a copy's completion decrements its completion signal by one -- atomically
  with ``atomic_completion=True`` (ROCr's SDMA ATOMIC ADD64 where the GPU-CPU
  link has 64-bit PCIe atomics), else by *writing* the value the signal had
  when the copy was queued minus one (ROCr's FENCE), which loses decrements
  when copies share a signal;
* consecutive runnable packets of one engine may overlap: with ``overlap=True``
  (the default) a run of packets with no pending poll executes *last first*, so
  a protocol that relies on queue order instead of dependency signals is caught;
* PCIe engines (below ``num_sdma``) are refused for GPU-to-GPU copies, and the
  engine id must be one-hot, as ROCr does;
* ``hsa_signal_wait_scacquire`` returns the current value once the condition
  holds or the timeout hint has passed (engines progress while it waits).

Engines progress only when the test calls :meth:`FakeHsaLib.pump`, inside a
signal wait, or continuously once :meth:`FakeHsaLib.start` runs a pump thread.
``calls`` is one ordered log of what the host did (copies queued, signal
stores, and -- through :class:`FakeRocmPlatform` -- stream operations queued)
and of what the engines did (``("exec", packet id)``); ``executed`` lists the
packets in execution order.

:class:`FakeRocmPlatform` is the host emulation dressed as ROCm for the sdma
backend: ``alloc_flags``, ``alloc_signal`` (a fake ROCr signal whose value word
host streams write), ``hsa()``, ``agent(device)``, ``pcie_atomics_64``,
``copy_async(force_nocu=)``, IPC mappings registered with the fake's
``hsa_amd_pointer_info`` (owner = the exporting device's GPU agent).
"""
from __future__ import annotations

import ctypes
import dataclasses
import itertools
import os
import threading
import time
from dataclasses import dataclass

from gpuxfer.errors import DriverError
from gpuxfer.platforms import hsa as H
from gpuxfer.platforms.base import DeviceInfo
from gpuxfer.platforms.host import HostPlatform

_U64 = (1 << 64) - 1


def _val(x):
    """The Python value of what a caller passed (an int, a ctypes scalar, a one-field struct, a byref)."""
    if x is None:
        return None
    if isinstance(x, (H.hsa_signal_t, H.hsa_agent_t)):
        return int(x.handle)
    if hasattr(x, "_obj"):          # byref(...)
        return x._obj
    if isinstance(x, ctypes._SimpleCData):
        return x.value
    return x


def _address(x) -> int:
    """The address an out-parameter points to (byref, an array, a c_void_p, an int)."""
    if hasattr(x, "_obj"):
        return ctypes.addressof(x._obj)
    if isinstance(x, ctypes.Array):
        return ctypes.addressof(x)
    if isinstance(x, ctypes.c_void_p):
        return int(x.value)
    return int(x)


@dataclass
class Packet:
    id: int
    engine: int                 # engine index
    dst: int
    src: int
    size: int
    polls: list[int]            # dependency signal handles that were non-zero at queue time
    completion: int
    deps: list[int]
    dep_values: list[int]
    completion_at_submit: int = 0


@dataclass
class FakeGpu:
    handle: int
    name: str = "gfx950"
    node: int = 0
    driver_node: int = 0
    domain: int = 0
    bdfid: int = 0


class FakeHsaLib:
    """A fake ROCr. See the module docstring."""

    CPU_AGENT = 0x5000

    def __init__(self, gpus: int = 2, *, num_sdma: int = 2, num_sdma_xgmi: int = 14, overlap: bool = True,
                 preferred: dict | None = None, available: dict | None = None, missing: tuple[str, ...] = (),
                 ts_hz: int = 1_000_000_000, atomic_completion: bool = True):
        self.gpus = [FakeGpu(0x1000 + 0x100 * i, node=2 + i, driver_node=2 + i, bdfid=(0xC1 + i) << 8)
                     for i in range(gpus)]
        self.num_sdma, self.num_sdma_xgmi = num_sdma, num_sdma_xgmi
        self.overlap = overlap
        self.atomic_completion = atomic_completion
        self.preferred = dict(preferred or {})     # (dst_agent, src_agent) -> mask
        self.available = dict(available or {})     # (dst_agent, src_agent) -> mask
        self.missing = set(missing)                # functions this "ROCr" does not export
        self.fail: dict[str, int] = {}             # function name -> status to return instead of success
        self.ts_hz = ts_hz
        self.calls: list[tuple] = []
        self.executed: list[Packet] = []
        self.init_count = 0
        self.memory: list[tuple[int, int, int, int]] = []   # (base, size, owner agent, pointer type)
        self._signals: dict[int, ctypes.Array] = {}
        self._queues: dict[int, list[Packet]] = {}
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self._keep: list = []
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # ---- the "missing symbol" switch ----
    def __getattribute__(self, name):
        if name.startswith("hsa_") and name in object.__getattribute__(self, "missing"):
            raise AttributeError(name)
        return object.__getattribute__(self, name)

    def _rec(self, *entry) -> None:
        with self._lock:
            self.calls.append(entry)

    def _status(self, name: str) -> int:
        return self.fail.get(name, H.HSA_STATUS_SUCCESS)

    # ---- test helpers ----
    def signal_value(self, handle: int) -> int:
        return ctypes.c_int64.from_address(handle + 8).value

    def _set(self, handle: int, value: int) -> None:
        ctypes.c_int64.from_address(handle + 8).value = value

    def register_memory(self, base: int, size: int, owner: int, ptype: int = H.HSA_EXT_POINTER_TYPE_HSA) -> None:
        self.memory.append((base, size, owner, ptype))

    def make_signal(self, initial: int) -> int:
        block = (ctypes.c_int64 * 4)(1, initial, 0, 0)    # {kind, value, ...}
        h = ctypes.addressof(block)
        with self._lock:
            self._signals[h] = block
        return h

    def pending(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._queues.values())

    def calls_named(self, *names: str) -> list[tuple]:
        return [c for c in self.calls if c[0] in names]

    def pump(self) -> int:
        """Run every packet that can run now; returns how many ran."""
        ran = 0
        with self._lock:
            for eng in sorted(self._queues):
                q = self._queues[eng]
                while q:
                    run = []
                    for p in q:
                        if all(self.signal_value(s) == 0 for s in p.polls):
                            run.append(p)
                        else:
                            break     # a POLL_REGMEM blocks the rest of this ring
                    if not run:
                        break
                    del q[:len(run)]
                    for p in (reversed(run) if self.overlap else run):
                        if p.size:
                            ctypes.memmove(p.dst, p.src, p.size)
                        if self.atomic_completion:
                            self._set(p.completion, self.signal_value(p.completion) - 1)
                        else:
                            self._set(p.completion, p.completion_at_submit - 1)
                        self.executed.append(p)
                        self.calls.append(("exec", p.id))
                        ran += 1
        return ran

    def start(self, period_s: float = 2e-5) -> "FakeHsaLib":
        """Pump continuously on a daemon thread (for tests where streams run on threads too)."""
        def loop():
            while not self._stop.is_set():
                if not self.pump():
                    time.sleep(period_s)
        self._thread = threading.Thread(target=loop, name="fake-hsa-pump", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    # ---- hsa.h ----
    def hsa_init(self):
        self._rec("hsa_init")
        st = self._status("hsa_init")
        if st == H.HSA_STATUS_SUCCESS:
            self.init_count += 1
        return st

    def hsa_shut_down(self):
        self._rec("hsa_shut_down")
        if self.init_count == 0:
            return 0x100B   # HSA_STATUS_ERROR_NOT_INITIALIZED
        self.init_count -= 1
        return self._status("hsa_shut_down")

    def hsa_status_string(self, status, out):
        text = f"fake status string for 0x{int(_val(status)):x}".encode()
        self._keep.append(text)
        out._obj.value = text
        return H.HSA_STATUS_SUCCESS

    def hsa_system_get_info(self, attribute, value):
        if _val(attribute) == H.HSA_SYSTEM_INFO_TIMESTAMP_FREQUENCY:
            ctypes.c_uint64.from_address(_address(value)).value = self.ts_hz
            return H.HSA_STATUS_SUCCESS
        return H.HSA_STATUS_ERROR_INVALID_ARGUMENT

    def _agent_handles(self) -> list[int]:
        return [self.CPU_AGENT] + [g.handle for g in self.gpus]

    def _gpu(self, handle: int) -> FakeGpu | None:
        return next((g for g in self.gpus if g.handle == handle), None)

    def hsa_iterate_agents(self, callback, data):
        self._rec("hsa_iterate_agents")
        for h in self._agent_handles():
            st = callback(H.hsa_agent_t(h), data)
            if st != H.HSA_STATUS_SUCCESS:
                return st
        return H.HSA_STATUS_SUCCESS

    def hsa_agent_get_info(self, agent, attribute, value):
        h, attr, addr = _val(agent), _val(attribute), _address(value)
        if h not in self._agent_handles():
            return 0x1004   # HSA_STATUS_ERROR_INVALID_AGENT
        gpu = self._gpu(h)
        if attr == H.HSA_AGENT_INFO_NAME:
            name = (gpu.name if gpu else "FAKE-CPU").encode()[:63] + b"\0"
            ctypes.memmove(addr, name, len(name))
            return H.HSA_STATUS_SUCCESS
        if attr == H.HSA_AGENT_INFO_DEVICE:
            ctypes.c_uint32.from_address(addr).value = H.HSA_DEVICE_TYPE_GPU if gpu else H.HSA_DEVICE_TYPE_CPU
            return H.HSA_STATUS_SUCCESS
        if gpu is None:
            return H.HSA_STATUS_ERROR_INVALID_ARGUMENT
        table = {H.HSA_AGENT_INFO_NODE: gpu.node, H.HSA_AMD_AGENT_INFO_DRIVER_NODE_ID: gpu.driver_node,
                 H.HSA_AMD_AGENT_INFO_DOMAIN: gpu.domain, H.HSA_AMD_AGENT_INFO_BDFID: gpu.bdfid,
                 H.HSA_AMD_AGENT_INFO_NUM_SDMA_ENG: self.num_sdma,
                 H.HSA_AMD_AGENT_INFO_NUM_SDMA_XGMI_ENG: self.num_sdma_xgmi}
        if attr not in table:
            return H.HSA_STATUS_ERROR_INVALID_ARGUMENT
        ctypes.c_uint32.from_address(addr).value = table[attr]
        return H.HSA_STATUS_SUCCESS

    # ---- signals ----
    def hsa_amd_signal_create(self, initial, num_consumers, consumers, attributes, signal):
        st = self._status("hsa_amd_signal_create")
        if st != H.HSA_STATUS_SUCCESS:
            return st
        h = self.make_signal(int(_val(initial)))
        signal._obj.handle = h
        self._rec("hsa_amd_signal_create", h, int(_val(initial)), int(_val(attributes)))
        return H.HSA_STATUS_SUCCESS

    def hsa_signal_destroy(self, signal):
        h = _val(signal)
        with self._lock:
            if h not in self._signals:
                return 0x1006   # HSA_STATUS_ERROR_INVALID_SIGNAL
            if any(h in p.polls or h == p.completion for q in self._queues.values() for p in q):
                raise AssertionError(f"signal 0x{h:x} destroyed while a queued copy still uses it")
            del self._signals[h]
        self._rec("hsa_signal_destroy", h)
        return H.HSA_STATUS_SUCCESS

    def hsa_amd_signal_value_pointer(self, signal, value_ptr):
        h = _val(signal)
        if h not in self._signals:
            return 0x1006
        value_ptr._obj.value = h + 8
        return H.HSA_STATUS_SUCCESS

    def hsa_signal_load_scacquire(self, signal):
        return self.signal_value(_val(signal))

    def hsa_signal_store_screlease(self, signal, value):
        h = _val(signal)
        self._rec("store", h, int(_val(value)))
        self._set(h, int(_val(value)))

    def _holds(self, cur: int, cond: int, cmp: int) -> bool:
        return {H.HSA_SIGNAL_CONDITION_EQ: cur == cmp, H.HSA_SIGNAL_CONDITION_NE: cur != cmp,
                H.HSA_SIGNAL_CONDITION_LT: cur < cmp, H.HSA_SIGNAL_CONDITION_GTE: cur >= cmp}[cond]

    def hsa_signal_wait_scacquire(self, signal, condition, compare_value, timeout_hint, wait_state_hint):
        h, cond, cmp = _val(signal), _val(condition), _val(compare_value)
        hint_s = int(_val(timeout_hint)) / self.ts_hz
        end = time.monotonic() + min(hint_s, 0.5)
        while True:
            self.pump()
            cur = self.signal_value(h)
            if self._holds(cur, cond, cmp) or time.monotonic() >= end:
                return cur
            time.sleep(1e-4)

    # ---- copies ----
    def hsa_amd_memory_async_copy_on_engine(self, dst, dst_agent, src, src_agent, size, num_dep_signals,
                                            dep_signals, completion_signal, engine_id, force_copy_on_sdma):
        st = self._status("hsa_amd_memory_async_copy_on_engine")
        if st != H.HSA_STATUS_SUCCESS:
            return st
        eng_mask, da, sa = int(_val(engine_id)), _val(dst_agent), _val(src_agent)
        n = int(_val(num_dep_signals))
        deps = [int(dep_signals[i].handle) for i in range(n)]
        comp = _val(completion_signal)
        with self._lock:
            if eng_mask <= 0 or eng_mask & (eng_mask - 1):
                return H.HSA_STATUS_ERROR_INVALID_ARGUMENT          # not one-hot
            eng = eng_mask.bit_length() - 1
            if eng >= self.num_sdma + self.num_sdma_xgmi:
                return H.HSA_STATUS_ERROR_INVALID_ARGUMENT
            if self._gpu(da) and self._gpu(sa) and da != sa and eng < self.num_sdma:
                return H.HSA_STATUS_ERROR_INVALID_ARGUMENT          # PCIe engine for an xGMI peer copy
            if da not in self._agent_handles() or sa not in self._agent_handles():
                return 0x1004
            if comp not in self._signals or any(d not in self._signals for d in deps):
                return 0x1006
            values = [self.signal_value(d) for d in deps]            # read NOW, at queue time
            p = Packet(next(self._ids), eng, _val(dst) or 0, _val(src) or 0, int(_val(size)),
                       [d for d, v in zip(deps, values) if v != 0], comp, deps, values, self.signal_value(comp))
            self._queues.setdefault(eng, []).append(p)
            self.calls.append(("copy", p.id, eng, p.dst, p.src, p.size, tuple(deps), tuple(values), comp,
                               bool(_val(force_copy_on_sdma))))
        return H.HSA_STATUS_SUCCESS

    def _default_mask(self, da: int, sa: int) -> int:
        if self._gpu(da) and self._gpu(sa) and da != sa:
            return ((1 << self.num_sdma_xgmi) - 1) << self.num_sdma
        return (1 << self.num_sdma) - 1

    def hsa_amd_memory_copy_engine_status(self, dst_agent, src_agent, engine_ids_mask):
        da, sa = _val(dst_agent), _val(src_agent)
        mask = self.available.get((da, sa), self._default_mask(da, sa))
        with self._lock:
            busy = sum(1 << e for e, q in self._queues.items() if q)
        engine_ids_mask._obj.value = mask & ~busy
        return self._status("hsa_amd_memory_copy_engine_status")

    def hsa_amd_memory_get_preferred_copy_engine(self, dst_agent, src_agent, recommended_ids_mask):
        recommended_ids_mask._obj.value = self.preferred.get((_val(dst_agent), _val(src_agent)), 0)
        return self._status("hsa_amd_memory_get_preferred_copy_engine")

    # ---- pointers ----
    def hsa_amd_pointer_info(self, ptr, info, alloc, num_agents_accessible, accessible):
        p = int(_val(ptr) or 0)
        out = info._obj
        for base, size, owner, ptype in self.memory:
            if base <= p < base + size:
                out.type, out.agentBaseAddress, out.hostBaseAddress = ptype, base, base
                out.sizeInBytes, out.agentOwner.handle = size, owner
                break
        else:
            out.type = H.HSA_EXT_POINTER_TYPE_UNKNOWN
        return self._status("hsa_amd_pointer_info")


# --------------------------------------------------------------------------- a fake ROCm platform


class FakeSignalMemory:
    """What ``RocmPlatform.alloc_signal`` returns: the value word ``ptr`` and the signal ``handle``."""

    def __init__(self, lib: FakeHsaLib, handle: int, device: int):
        self.lib, self.handle, self.ptr, self.device = lib, handle, handle + 8, device
        self.closed = False

    @property
    def signal(self):
        return H.Signal(self.handle)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with self.lib._lock:
                self.lib._signals.pop(self.handle, None)


class FakeRocmPlatform(HostPlatform):
    """The host emulation with RocmPlatform's SDMA hooks (:class:`~gpuxfer.platforms.rocm.RocmSdma` over them), over
    a :class:`FakeHsaLib`.

    ``hsa_error``: make ``hsa()`` fail as on a machine whose ROCr cannot be
    loaded. ``allow_self_open``: let this process open its own IPC handles (a
    second mapping of the same memory, at another address), so both ends of a
    pair can live in one test process.
    """

    name = "rocm"
    copy_engine_peer_copies = False

    def __init__(self, lib: FakeHsaLib | None = None, devices: int = 2, *, hsa_error: str | None = None,
                 pcie_atomics: bool | None = None, allow_self_open: bool = False):
        super().__init__(devices)
        self.lib = lib if lib is not None else FakeHsaLib(gpus=devices)
        self.hsa_error, self.pcie_atomics, self.allow_self_open = hsa_error, pcie_atomics, allow_self_open
        self._hsa_obj = None

    def device_info(self, device: int) -> DeviceInfo:
        info = super().device_info(device)
        g = self.lib.gpus[device]
        return DeviceInfo(**{**info.__dict__, "pci_bus_id": f"0000:{g.bdfid >> 8:02x}:00.0", "name": "fake-gfx950",
                             "arch": "gfx950",
                             "notes": info.notes})

    # ---- the ROCm-only hooks (behind the contract's SdmaEngines, as on RocmPlatform) ----
    @property
    def sdma(self):
        from gpuxfer.platforms.rocm import RocmSdma
        return RocmSdma(self)

    def hsa(self):
        if self.hsa_error:
            raise DriverError("dlopen", "LIBRARY_NOT_FOUND", -1, "loading the HSA runtime (ROCr)", self.hsa_error)
        if self._hsa_obj is None:
            self._hsa_obj = H.Hsa(lib=self.lib).init()
        return self._hsa_obj

    def agent(self, device: int):
        return self.hsa().gpu_agent_by_pci(self.device_info(device).pci_bus_id)

    def pcie_atomics_64(self, device: int):
        return self.pcie_atomics

    def alloc_flags(self, nbytes: int, device: int):
        return self.alloc(nbytes, device)

    def alloc_signal(self, device: int) -> FakeSignalMemory:
        return FakeSignalMemory(self.lib, self.lib.make_signal(1), device)

    # ---- recorded stream work ----
    def _log(self, *entry) -> None:
        self.lib._rec(*entry)

    def copy_async(self, stream, dst, src, nbytes, *, force_nocu: bool = False) -> None:
        self._log("stream copy", stream.name, int(dst), int(src), int(nbytes), force_nocu)
        super().copy_async(stream, dst, src, nbytes)

    def write_flag(self, stream, ptr, value) -> None:
        self._log("stream write", stream.name, int(ptr), int(value))
        super().write_flag(stream, ptr, value)

    def wait_flag(self, stream, ptr, value) -> None:
        self._log("stream wait", stream.name, int(ptr), int(value))
        super().wait_flag(stream, ptr, value)

    def stream_wait_event(self, stream, event) -> None:
        self._log("stream wait event", stream.name)
        super().stream_wait_event(stream, event)

    # ---- IPC, registered with the fake's pointer table ----
    def open_handle(self, handle, device: int):
        if self.allow_self_open and handle.owner_pid == os.getpid():
            handle = dataclasses.replace(handle, owner_pid=-1)
        m = super().open_handle(handle, device)
        self.lib.register_memory(m.ptr, m.nbytes, self.lib.gpus[handle.device].handle, H.HSA_EXT_POINTER_TYPE_IPC)
        return m

    def close(self) -> None:
        super().close()
        if self._hsa_obj is not None:
            self._hsa_obj.close()
