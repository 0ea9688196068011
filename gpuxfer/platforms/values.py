"""The platform contract's plain values: what a device is (:class:`DeviceInfo`), how two devices are linked
(:class:`LinkInfo`), and the picklable handles another process opens (:class:`IpcHandle`,
:class:`ExportedRange`). :mod:`gpuxfer.platforms.base` re-exports them."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceInfo:
    """What gpuxfer needs to know about one device."""

    index: int
    name: str
    arch: str                       # "sm_90", "gfx950", "host"
    total_bytes: int
    free_bytes: int | None
    pci_bus_id: str | None
    sm_count: int                   # SMs / CUs; host: emulated worker cores
    copy_engines: int               # async (copy) engines; 0 if unknown
    stream_mem_ops_64: bool         # 64-bit stream write/wait, probed for real
    stream_wait_nor: bool = False
    can_flush_remote_writes: bool = False
    notes: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["notes"] = list(self.notes)
        return d


@dataclass(frozen=True)
class LinkInfo:
    """The link between two devices of this node."""

    src: int
    dst: int
    kind: str        # "nvlink", "xgmi", "pcie", "shared-memory", "same-device", "unknown"
    peer_access: bool
    detail: str = ""

    @property
    def is_fast(self) -> bool:
        """NVLink / xGMI class (or the same device, or the host emulation)."""
        return self.kind in ("nvlink", "xgmi", "same-device", "shared-memory")

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class IpcHandle:
    """A picklable handle to a raw buffer, opened by another process.

    ``payload`` is the platform's raw handle (64 bytes for CUDA/HIP, a shared
    memory name for the host emulation). ``owner_pid`` and ``owner_namespace`` name the exporting process:
    its pid and the PID namespace that pid counts in (:func:`gpuxfer.common.process_namespace`; ``None``:
    not said, the pid alone names it).
    """

    platform: str
    device: int
    nbytes: int
    payload: bytes
    owner_pid: int
    owner_namespace: str | None = None


@dataclass(frozen=True)
class ExportedRange:
    """Memory inside an exportable allocation: the allocation's handle and the range's offset in it.

    Another process opens ``handle`` (the *whole* allocation) and adds ``offset``.
    """

    handle: IpcHandle
    offset: int
