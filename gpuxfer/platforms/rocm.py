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

Layout: this module holds :class:`RocmPlatform` (detection, devices, links,
versions, HSA and its agents, ``close``), which builds and owns one component
per concept and hands each hook to it:
:class:`~gpuxfer.platforms.rocm_hip.HipDevices` (device checks, the current
device, attributes), :class:`~gpuxfer.platforms.rocm_memory.RocmMemory`
(buffers, IPC, signal words, tensor views) and
:class:`~gpuxfer.platforms.rocm_streams.RocmStreams` (streams, events, copies,
flags); :class:`~gpuxfer.platforms.rocm_sdma.RocmSdma` (the SDMA capability)
works through the platform's hooks. hip-python access and the error checker
are :mod:`~gpuxfer.platforms.rocm_hip`. No component imports this module.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Sequence

from .. import config
from ..errors import DriverError, PlatformUnavailable
from .base import (DeviceBuffer, DeviceInfo, Event, ExportedRange, IpcHandle, LinkInfo, Memory, PeerMapping, Platform,
                   Stream)
from .rocm_hip import (HOST_FLAG_TIMEOUT_ENV, HOST_FLAG_TIMEOUT_S, HSA_AMD_LINK_INFO_TYPE_PCIE,
                       HSA_AMD_LINK_INFO_TYPE_XGMI, HipApi, HipDevices, _import_hip, _major_minor, _s,
                       binding_hip_version, hip_call, hip_first, hip_python_version, host_flag_timeout_from_env,
                       mapped_hip_runtimes, torch_hip_version)
from .rocm_memory import RocmMemory, SignalMemory
from .rocm_sdma import SDMA_ARCH_PREFIXES, RocmSdma, sdma_disabled_by
from .rocm_streams import RocmEvent, RocmStream, RocmStreams

__all__ = ["RocmPlatform", "RocmStream", "RocmEvent", "RocmSdma", "SignalMemory", "SDMA_ARCH_PREFIXES",
           "HOST_FLAG_TIMEOUT_ENV", "HOST_FLAG_TIMEOUT_S"]

log = logging.getLogger("gpuxfer.platforms.rocm")


# --------------------------------------------------------------------------- the platform


class RocmPlatform(Platform):
    """The contract on ROCm (hip-python + torch's ROCm build), built of components it owns and closes. See the
    module docstring."""

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
        # torch's build first: without a ROCm torch, installing hip-python would not help (a CPU machine
        # is not told to install gpuxfer[rocm])
        try:
            import torch
        except ImportError as exc:
            return f"torch cannot be imported: {exc}"
        t_hip = getattr(torch.version, "hip", None)
        if not t_hip:
            return (f"torch {torch.__version__} is not a ROCm build (torch.version.hip is None); "
                    f"hip-python would load a HIP runtime torch does not use")
        try:
            hip = _import_hip()
        except ImportError as exc:
            return f"hip-python is not installed ({exc}); install gpuxfer[rocm]"
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
        host_flag_timeout_s = host_flag_timeout_from_env()     # a bad value is a configuration error
        if hip is None:
            why = type(self).unavailable_reason()
            if why is not None:
                raise PlatformUnavailable(self.name, why)
            hip = _import_hip()
        self._api = HipApi(hip)
        self.hip = hip
        self._hsa = hsa
        self._lock = threading.RLock()
        self._stream_ops_ok: dict[int, bool] = {}
        self._info: dict[int, DeviceInfo] = {}
        self._agents: dict[int, Any] = {}
        self._devices = HipDevices(self._api)
        self._memory = RocmMemory(self._devices, self._api, self, self.hsa)
        self._streams = RocmStreams(self._devices, self._api, self, self._memory.is_peer_address,
                                    config.get("GPUXFER_ROCM_DEDICATED_QUEUES"), host_flag_timeout_s)

    @property
    def host_flag_timeout_s(self) -> float:
        """How long a host read or write of a flag word may take, in seconds."""
        return self._streams.host_flag_timeout_s

    @property
    def dedicated_queues(self) -> bool:
        """Whether :meth:`create_stream` gives a stream its own hardware queue by default."""
        return self._streams.dedicated_queues

    # ---- devices ----
    def device_count(self) -> int:
        return self._devices.count()

    def set_device(self, device: int) -> None:
        device = self._devices.check(device)
        self._api("hipSetDevice", device, doing=f"making device {device} current")
        import torch
        torch.cuda.set_device(device)

    def attribute(self, name: str, device: int) -> int:
        """``hipDeviceGetAttribute(hipDeviceAttribute<name>)``."""
        return self._devices.attribute(name, device)

    def pci_bus_id(self, device: int) -> str:
        return self._api.pci_bus_id(device)

    def device_info(self, device: int) -> DeviceInfo:
        device = self._devices.check(device)
        if device in self._info:
            return self._info[device]
        props = self._api.device_properties(device)
        arch = _s(props.gcnArchName).split(":")[0] or f"gfx{props.major}{props.minor}"
        with self._devices.on(device):
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
        src, dst = self._devices.check(src), self._devices.check(dst)
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

    # ---- memory (RocmMemory) ----
    def alloc(self, nbytes: int, device: int) -> DeviceBuffer:
        return self._memory.alloc(nbytes, device)

    def alloc_flags(self, nbytes: int, device: int) -> DeviceBuffer:
        """Uncached device memory for flag words (exportable like :meth:`alloc`)."""
        return self._memory.alloc_flags(nbytes, device)

    def alloc_signal(self, device: int) -> SignalMemory:
        """A ``hipMallocSignalMemory`` word (value 1) and its HSA signal handle, checked with ROCr."""
        return self._memory.alloc_signal(device)

    def _free(self, buf: DeviceBuffer) -> None:
        self._memory.free(buf)

    def export_handle(self, buf: DeviceBuffer) -> IpcHandle:
        return self._memory.export_handle(buf)

    def allocation_range(self, ptr: int, device: int) -> tuple[int, int] | None:
        return self._memory.allocation_range(ptr, device)

    def export_range(self, ptr: int, nbytes: int, device: int, within: tuple[int, int] | None = None
                     ) -> ExportedRange:
        return self._memory.export_range(ptr, nbytes, device, within)

    def open_handle(self, handle: IpcHandle, device: int) -> PeerMapping:
        return self._memory.open_handle(handle, device)

    def _close_mapping(self, mapping: PeerMapping) -> None:
        self._memory.close_mapping(mapping)

    def is_peer_address(self, ptr: int, device: int | None = None) -> bool:
        """Whether ``ptr`` lies in an opened peer mapping (or in our memory on another device)."""
        return self._memory.is_peer_address(ptr, device)

    def as_tensor(self, mem: Memory, dtype=None, shape: Sequence[int] | None = None, offset: int = 0):
        return self._memory.as_tensor(mem, dtype, shape, offset)

    # ---- streams, events, copies, flags (RocmStreams) ----
    def create_stream(self, device: int, dedicated: bool | None = None) -> RocmStream:
        """A new stream; with ``dedicated`` (the default, ``GPUXFER_ROCM_DEDICATED_QUEUES=0`` turns it
        off) it has its own hardware queue, so a flag wait on it blocks nothing else."""
        return self._streams.create(device, dedicated)

    def _destroy_stream(self, stream: RocmStream) -> None:
        self._streams.destroy(stream)

    def current_stream(self, device: int) -> RocmStream:
        return self._streams.current(device)

    def record_event(self, stream: Stream, event: Event | None = None) -> RocmEvent:
        return self._streams.record_event(stream, event)

    def stream_wait_event(self, stream: Stream, event: Event) -> None:
        self._streams.stream_wait_event(stream, event)

    def event_query(self, event: Event) -> bool:
        return self._streams.event_query(event)

    def launch(self, stream: Stream, fn: Callable[[], object]) -> None:
        self._streams.launch(stream, fn)

    def copy_kind(self, dst: int, src: int, device: int, force_nocu: bool = False) -> int:
        return self._streams.copy_kind(dst, src, device, force_nocu)

    def copy_async(self, stream: Stream, dst: int, src: int, nbytes: int, *, force_nocu: bool = False) -> None:
        self._streams.copy_async(stream, dst, src, nbytes, force_nocu=force_nocu)

    def memset_async(self, stream: Stream, ptr: int, value: int, nbytes: int) -> None:
        self._streams.memset_async(stream, ptr, value, nbytes)

    def write_flag(self, stream: Stream, ptr: int, value: int) -> None:
        self._streams.write_flag(stream, ptr, value)

    def wait_flag(self, stream: Stream, ptr: int, value: int) -> None:
        self._streams.wait_flag(stream, ptr, value)

    def read_flag(self, ptr: int, device: int) -> int:
        return self._streams.read_flag(ptr, device)

    def host_write_flag(self, ptr: int, value: int, device: int) -> None:
        self._streams.host_write_flag(ptr, value, device)

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

    # ---- lifetime ----
    @property
    def closed(self) -> bool:
        return self._devices.closed

    def close(self) -> None:
        """Destroy gpuxfer's streams, free the pinned words, drop the HSA reference. Idempotent."""
        with self._lock:
            if not self._devices.close():
                return
            hsa, self._hsa = self._hsa, None
        self._streams.close()
        if hsa is not None:
            hsa.close()

    def __repr__(self) -> str:
        return f"RocmPlatform({'closed' if self.closed else 'open'})"
