"""Pool layouts: where every transfer region lives in one flat byte pool.

A pool holds, for each transfer region of a workload at a page size, ``planes``
planes of ``pool_pages`` pages. The byte offset of (plane, page) in region R is::

    R.base_offset_bytes + plane * R.plane_stride_bytes + page * R.page_stride_bytes

and a descriptor there moves ``R.desc_bytes``.

* Unpacked regions are laid out region-major, ``[plane][page]`` inside (the
  CollectiveX layout): ``page_stride = desc_bytes``, ``plane_stride = pool_pages *
  desc_bytes``. Each region has its own page space.
* Packed groups share one array of slabs (:data:`~gpuxfer.bench.kv.model.workloads.SLAB_SPACE`):
  every group's block sits at the start of a slab whose stride is the largest
  group's stack (vLLM's ``block_stride``); groups draw disjoint slabs from one block
  table, so their extents coincide while their descriptors never overlap.

Region bases are aligned to :data:`POOL_ALIGN_BYTES`.

Pool sizing for a burst follows the suite's rule: per page space,
``ceil(pages_per_request * max(2, 1.25 * batch)) + 8`` pages, so a random block
table scatters the burst over a pool larger than the burst itself.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ....errors import BadInput
from ....kv.layers import KVLayerSpec, _torch
from .workloads import TransferRegion, Workload, _pos_int, get_workload

__all__ = [
    "POOL_ALIGN_BYTES", "POOL_SPARE_PAGES", "RegionLayout", "PoolLayout", "build_layout",
    "pages_for_burst", "layout_for_burst", "pool_bytes_for_burst", "pool_pages_for_budget",
    "max_batch_for_budget", "layout_groups",
]

#: Alignment of every region base (and of the pool size).
POOL_ALIGN_BYTES = 256
#: Extra pages per page space on top of the headroom (the suite's ``+ 8``).
POOL_SPARE_PAGES = 8
# Headroom factor: pool pages = per-request pages * max(2, 1.25 * batch), in quarters.
_HEADROOM_QUARTERS_PER_REQUEST = 5   # 1.25
_MIN_HEADROOM_QUARTERS = 8           # 2.0


def _align(value: int, align: int) -> int:
    return -(-value // align) * align


@dataclass(frozen=True)
class RegionLayout:
    """One transfer region's place in the pool."""

    name: str
    page_space: str
    base_offset_bytes: int
    plane_stride_bytes: int
    page_stride_bytes: int
    desc_bytes: int
    planes: int
    pool_pages: int
    size_bytes: int

    @property
    def end_offset_bytes(self) -> int:
        return self.base_offset_bytes + self.size_bytes

    def offsets(self, pages: np.ndarray) -> np.ndarray:
        """Byte offsets of ``pages`` (page indices) in every plane, plane-major: shape (planes * len(pages),)."""
        pages = np.asarray(pages, dtype=np.int64)
        planes = np.arange(self.planes, dtype=np.int64) * self.plane_stride_bytes + self.base_offset_bytes
        return (planes[:, None] + pages[None, :] * self.page_stride_bytes).reshape(-1)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class PoolLayout:
    """Every transfer region of ``workload`` at ``page_tokens`` in one pool of ``pool_bytes``."""

    workload: Workload
    page_tokens: int
    regions: tuple[RegionLayout, ...]
    pool_pages: tuple[tuple[str, int], ...]   # (page space, pages), in pool order
    pool_bytes: int
    align_bytes: int = POOL_ALIGN_BYTES

    def region(self, name: str) -> RegionLayout:
        for r in self.regions:
            if r.name == name:
                return r
        raise BadInput(f"layout of {self.workload.name!r} has no region {name!r}; "
                       f"regions: {', '.join(r.name for r in self.regions)}")

    def pages_in(self, space: str) -> int:
        for s, n in self.pool_pages:
            if s == space:
                return n
        raise BadInput(f"layout of {self.workload.name!r} has no page space {space!r}; "
                       f"spaces: {', '.join(s for s, _ in self.pool_pages)}")

    @property
    def spaces(self) -> tuple[str, ...]:
        return tuple(s for s, _ in self.pool_pages)

    @property
    def min_alignment_bytes(self) -> int:
        """The largest power of two (capped at the pool alignment) dividing every descriptor offset and size."""
        g = self.align_bytes
        for r in self.regions:
            for v in (r.base_offset_bytes, r.plane_stride_bytes, r.page_stride_bytes, r.desc_bytes):
                g = math.gcd(g, v)
        return g & -g

    def as_dict(self) -> dict:
        return {
            "workload": self.workload.name,
            "page_tokens": self.page_tokens,
            "pool_bytes": self.pool_bytes,
            "align_bytes": self.align_bytes,
            "pool_pages": {s: n for s, n in self.pool_pages},
            "regions": [r.as_dict() for r in self.regions],
        }


def _space_members(trs: tuple[TransferRegion, ...]) -> dict[str, list[TransferRegion]]:
    spaces: dict[str, list[TransferRegion]] = {}
    for t in trs:
        spaces.setdefault(t.page_space, []).append(t)
    return spaces


def build_layout(workload: Workload | str, page_tokens: int, pool_pages: int | Mapping[str, int], *,
                 align_bytes: int = POOL_ALIGN_BYTES) -> PoolLayout:
    """Lay out ``workload`` at ``page_tokens`` with ``pool_pages`` pages per page space.

    ``pool_pages`` is one count for every page space, or a mapping page space -> count
    (see :func:`pages_for_burst`).
    """
    workload = get_workload(workload)
    trs = workload.transfer_regions(page_tokens)
    _pos_int(align_bytes, "align_bytes")
    if align_bytes & (align_bytes - 1):
        raise BadInput(f"align_bytes must be a power of two, got {align_bytes}")
    spaces = _space_members(trs)
    if isinstance(pool_pages, Mapping):
        unknown = set(pool_pages) - set(spaces)
        missing = set(spaces) - set(pool_pages)
        if unknown or missing:
            raise BadInput(f"pool_pages for {workload.name!r} must name exactly its page spaces "
                           f"{', '.join(spaces)} (missing: {sorted(missing)}, unknown: {sorted(unknown)})")
        counts = {s: _pos_int(pool_pages[s], f"pool pages of space {s!r}") for s in spaces}
    else:
        n = _pos_int(pool_pages, "pool pages")
        counts = {s: n for s in spaces}
    offset = 0
    regions: list[RegionLayout] = []
    for space, members in spaces.items():
        pages = counts[space]
        base = _align(offset, align_bytes)
        if members[0].packed:
            stride = max(t.desc_bytes for t in members)
            size = pages * stride
            for t in members:
                regions.append(RegionLayout(
                    name=t.name, page_space=space, base_offset_bytes=base, plane_stride_bytes=size,
                    page_stride_bytes=stride, desc_bytes=t.desc_bytes, planes=1, pool_pages=pages,
                    size_bytes=size))
        else:
            (t,) = members
            plane_stride = pages * t.desc_bytes
            size = t.planes * plane_stride
            regions.append(RegionLayout(
                name=t.name, page_space=space, base_offset_bytes=base, plane_stride_bytes=plane_stride,
                page_stride_bytes=t.desc_bytes, desc_bytes=t.desc_bytes, planes=t.planes, pool_pages=pages,
                size_bytes=size))
        offset = base + size
    return PoolLayout(workload=workload, page_tokens=page_tokens, regions=tuple(regions),
                      pool_pages=tuple(counts.items()), pool_bytes=_align(offset, align_bytes),
                      align_bytes=align_bytes)


def pages_for_burst(workload: Workload | str, isl_tokens: int, page_tokens: int, batch: int) -> dict[str, int]:
    """Pool pages per page space for a burst of ``batch`` requests of ``isl_tokens``.

    ``ceil(per_request * max(2, 1.25 * batch)) + 8`` where ``per_request`` is the pages one
    request takes from that space (summed over the regions sharing it).
    """
    workload = get_workload(workload)
    _pos_int(batch, "batch (requests per burst)")
    quarters = max(_MIN_HEADROOM_QUARTERS, _HEADROOM_QUARTERS_PER_REQUEST * batch)
    out: dict[str, int] = {}
    for space, members in _space_members(workload.transfer_regions(page_tokens)).items():
        per_request = sum(t.pages_per_request(isl_tokens) for t in members)
        out[space] = -(-per_request * quarters // 4) + POOL_SPARE_PAGES
    return out


def layout_for_burst(workload: Workload | str, isl_tokens: int, page_tokens: int, batch: int, *,
                     align_bytes: int = POOL_ALIGN_BYTES) -> PoolLayout:
    """The pool layout sized for a burst (see :func:`pages_for_burst`)."""
    return build_layout(workload, page_tokens, pages_for_burst(workload, isl_tokens, page_tokens, batch),
                        align_bytes=align_bytes)


def pool_bytes_for_burst(workload: Workload | str, isl_tokens: int, page_tokens: int, batch: int) -> int:
    """Bytes of one pool (one rank's) for a burst of ``batch`` requests."""
    return layout_for_burst(workload, isl_tokens, page_tokens, batch).pool_bytes


def pool_pages_for_budget(workload: Workload | str, page_tokens: int, budget_bytes: int, *,
                          align_bytes: int = POOL_ALIGN_BYTES) -> int:
    """The most pages per page space (the same count in each) whose pool fits ``budget_bytes``; 0 if none."""
    workload = get_workload(workload)
    _pos_int(budget_bytes, "pool budget (bytes)", allow_zero=True)
    per_page = build_layout(workload, page_tokens, 1, align_bytes=align_bytes)
    bytes_per_page = sum(max(t.desc_bytes for t in m) * (1 if m[0].packed else m[0].planes)
                         for m in _space_members(workload.transfer_regions(page_tokens)).values())
    if per_page.pool_bytes > budget_bytes:
        return 0
    n = max(1, budget_bytes // bytes_per_page)
    while n > 1 and build_layout(workload, page_tokens, n, align_bytes=align_bytes).pool_bytes > budget_bytes:
        n -= 1
    return n


def max_batch_for_budget(workload: Workload | str, isl_tokens: int, page_tokens: int, budget_bytes: int,
                         *, limit: int = 1 << 20) -> int:
    """The largest batch whose burst pool fits ``budget_bytes`` (0 if not even one request fits)."""
    workload = get_workload(workload)
    _pos_int(budget_bytes, "pool budget (bytes)", allow_zero=True)
    if pool_bytes_for_burst(workload, isl_tokens, page_tokens, 1) > budget_bytes:
        return 0
    lo, hi = 1, 2
    while hi <= limit and pool_bytes_for_burst(workload, isl_tokens, page_tokens, hi) <= budget_bytes:
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:                       # invariant: lo fits, hi does not (or is past the limit)
        mid = (lo + hi) // 2
        if pool_bytes_for_burst(workload, isl_tokens, page_tokens, mid) <= budget_bytes:
            lo = mid
        else:
            hi = mid
    return lo


def layout_groups(layout: PoolLayout, pool) -> list[tuple[str, int, dict[str, KVLayerSpec]]]:
    """The KV-cache groups of a :class:`PoolLayout` laid over ``pool`` (a flat uint8
    tensor): ``(group name, block tokens, {layer name: spec})`` for :meth:`KVAgent.register_group`.

    An unpacked region is a group of ``planes`` layers (one piece per block: the region's page);
    a packed group is a group of one layer (its slab). Page indices of the layout's block
    tables are the block IDs.
    """
    torch = _torch()
    if not isinstance(pool, torch.Tensor) or pool.dtype != torch.uint8 or pool.dim() != 1:
        raise BadInput("pool must be a flat uint8 tensor")
    if pool.numel() < layout.pool_bytes:
        raise BadInput(f"pool holds {pool.numel()} bytes, the layout needs {layout.pool_bytes}")
    trs = {t.name: t for t in layout.workload.transfer_regions(layout.page_tokens)}
    out = []
    for r in layout.regions:
        layers = {}
        for plane in range(r.planes):
            start = r.base_offset_bytes + plane * r.plane_stride_bytes
            view = pool[start:start + r.pool_pages * r.page_stride_bytes]
            layers[f"{r.name}.{plane}"] = KVLayerSpec(view, r.pool_pages, r.page_stride_bytes,
                                                      [(0, r.desc_bytes)], index=plane)
        out.append((r.name, trs[r.name].tokens_per_page, layers))
    return out
