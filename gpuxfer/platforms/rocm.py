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
versions, HSA and its agents, ``close``); hip-python access and the error
checker are :mod:`~gpuxfer.platforms.rocm_hip`, the SDMA capability and signal
words :mod:`~gpuxfer.platforms.rocm_sdma`, and the hooks come from one mixin
per concept: :mod:`~gpuxfer.platforms.rocm_memory` (buffers, IPC, tensor views)
and :mod:`~gpuxfer.platforms.rocm_streams` (streams, events, copies, flags).
"""
from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from typing import Any

import numpy as np

from .. import config
from ..errors import BadInput, DriverError, PlatformUnavailable
from .base import DeviceInfo, LinkInfo, Platform
from .rocm_hip import (HOST_FLAG_TIMEOUT_ENV, HOST_FLAG_TIMEOUT_S, HSA_AMD_LINK_INFO_TYPE_PCIE,
                       HSA_AMD_LINK_INFO_TYPE_XGMI, HipApi, _import_hip, _major_minor, _s, binding_hip_version,
                       hip_call, hip_first, hip_python_version, host_flag_timeout_from_env, mapped_hip_runtimes,
                       torch_hip_version)
from .rocm_memory import _RocmMemory
from .rocm_sdma import SDMA_ARCH_PREFIXES, RocmSdma, SignalMemory, sdma_disabled_by
from .rocm_streams import RocmEvent, RocmStream, _RocmStreams

__all__ = ["RocmPlatform", "RocmStream", "RocmEvent", "RocmSdma", "SignalMemory", "SDMA_ARCH_PREFIXES",
           "HOST_FLAG_TIMEOUT_ENV", "HOST_FLAG_TIMEOUT_S"]

log = logging.getLogger("gpuxfer.platforms.rocm")


# --------------------------------------------------------------------------- the platform


class RocmPlatform(_RocmMemory, _RocmStreams, Platform):
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
