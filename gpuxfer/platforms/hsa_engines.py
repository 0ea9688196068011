"""The SDMA engine choice per GPU pair: one-hot engine ids and masks, the pick between the driver's
recommendation and the engines available (:func:`choose_engine`), KFD's sysfs topology (recommended
masks, 64-bit PCIe atomics) and the plan for a pair (:func:`plan_engines`), over a
:class:`~gpuxfer.platforms.hsa.Hsa`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import BadInput


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
