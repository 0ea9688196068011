"""The ROCm platform's SDMA capability (:class:`RocmSdma`, the platform's ``sdma``), over the hooks of
:class:`SdmaHost` (what :class:`~gpuxfer.platforms.rocm.RocmPlatform` offers besides the contract). ROCr
itself is :mod:`gpuxfer.platforms.hsa`.
"""
from __future__ import annotations

import logging
from typing import Any, Protocol

from .. import config
from ..errors import GpuxferError
from .base import DeviceBuffer, DeviceInfo, SdmaEngines, Stream

log = logging.getLogger("gpuxfer.platforms.rocm")


#: architectures whose driver recommends SDMA engines per GPU pair (KFD masks exist from gfx9.4 on)
SDMA_ARCH_PREFIXES = ("gfx94", "gfx95")


def sdma_disabled_by() -> str | None:
    """The ROCr variable (``HSA_ENABLE_SDMA`` or ``HSA_ENABLE_PEER_SDMA``) set to 0, which turns SDMA copies into
    blit kernels on compute units, or None."""
    for var in ("HSA_ENABLE_SDMA", "HSA_ENABLE_PEER_SDMA"):
        if (config.get(var) or "").strip() == "0":
            return var
    return None


class SdmaHost(Protocol):
    """The platform hooks :class:`RocmSdma` works through (:class:`~gpuxfer.platforms.rocm.RocmPlatform`'s)."""

    def device_info(self, device: int) -> DeviceInfo: ...

    def hsa(self) -> Any: ...

    def agent(self, device: int) -> Any: ...

    def alloc_flags(self, nbytes: int, device: int) -> DeviceBuffer: ...

    def alloc_signal(self, device: int) -> Any: ...

    def pcie_atomics_64(self, device: int) -> bool | None: ...

    def copy_async(self, stream: Stream, dst: int, src: int, nbytes: int, *, force_nocu: bool = False) -> None: ...


class RocmSdma(SdmaEngines):
    """The SDMA engines of a ROCm platform (:attr:`RocmPlatform.sdma`).

    Stream-ordered: ``hipMemcpyAsync`` with ``hipMemcpyDeviceToDeviceNoCU`` and uncached
    flag memory. Host-queued: ROCr through :class:`~gpuxfer.platforms.hsa.Hsa`, on the
    engine the driver recommends for the pair (:func:`~gpuxfer.platforms.hsa.plan_engines`).
    It works through the platform's ``hsa()``, ``agent()``, ``alloc_flags()``,
    ``alloc_signal()``, ``pcie_atomics_64()`` and ``copy_async(..., force_nocu=True)``.
    """

    def __init__(self, platform: SdmaHost):
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
