"""Descriptor plans: per request, what moves from which source byte to which destination byte.

A plan is an int64 array of shape (N, 3), columns ``(src_offset, dst_offset, nbytes)``,
byte offsets into the source and destination pools. A request's rows are in region,
plane (layer), page order -- the order the suite posts them in. A :class:`Burst`
groups the requests of one burst: one concatenated (N_total, 3) array and per-request
views into it, plus the spans saying which rows belong to which request and region.

Everything is vectorised numpy; counting without materialising lives in
:mod:`gpuxfer.bench.kv.model.workloads` (``descriptors_per_request``, ``bytes_per_request``).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import numpy as np

from ....errors import BadInput
from ....kv.descriptors import DIRECTIONS, PLAN_DTYPE, _as_plan, _first, check_bounds
from .blocktable import burst_tables
from .layout import PoolLayout, layout_for_burst
from .workloads import Workload, _pos_int, get_workload

__all__ = ["DIRECTIONS", "PlanSpan", "Burst", "build_burst", "request_plan", "coalesce", "bulk_plan", "validate_plan",
           "check_bounds", "find_dst_overlap"]


@dataclass(frozen=True)
class PlanSpan:
    """Rows ``[start, stop)`` of a plan belong to ``region`` of request ``request``."""

    request: int
    region: str
    start: int
    stop: int


def _check_compatible(src: PoolLayout, dst: PoolLayout) -> None:
    a = [(r.name, r.planes, r.desc_bytes) for r in src.regions]
    b = [(r.name, r.planes, r.desc_bytes) for r in dst.regions]
    if src.workload.name != dst.workload.name or src.page_tokens != dst.page_tokens or a != b:
        raise BadInput(f"source layout ({src.workload.name!r}, {src.page_tokens}-token pages) and destination "
                       f"layout ({dst.workload.name!r}, {dst.page_tokens}-token pages) do not describe the same "
                       "regions")


def request_plan(src_layout: PoolLayout, dst_layout: PoolLayout, src_table: dict[str, np.ndarray],
                 dst_table: dict[str, np.ndarray]) -> np.ndarray:
    """One request's plan from its source and destination block tables (region -> page indices)."""
    _check_compatible(src_layout, dst_layout)
    parts = []
    for s_reg in src_layout.regions:
        d_reg = dst_layout.region(s_reg.name)
        sp = np.asarray(src_table[s_reg.name], dtype=np.int64)
        dp = np.asarray(dst_table[s_reg.name], dtype=np.int64)
        if sp.shape != dp.shape or sp.ndim != 1:
            raise BadInput(f"region {s_reg.name!r}: source and destination tables must be 1-D of one length, "
                           f"got {sp.shape} and {dp.shape}")
        part = np.empty((s_reg.planes * sp.size, 3), dtype=PLAN_DTYPE)
        part[:, 0] = s_reg.offsets(sp)
        part[:, 1] = d_reg.offsets(dp)
        part[:, 2] = s_reg.desc_bytes
        parts.append(part)
    return np.concatenate(parts) if parts else np.empty((0, 3), dtype=PLAN_DTYPE)


@dataclass(frozen=True, eq=False)
class Burst:
    """The requests of one burst, as one concatenated plan and per-request views.

    ``plan`` is the (N, 3) int64 concatenation; ``requests[r]`` is a view of request
    r's rows; ``spans`` name every (request, region) run of rows. ``src_tables`` / ``dst_tables``
    (None where the plan has no block tables, e.g. one bulk descriptor): per request, region ->
    its page indices on each side, the block IDs the plan was expanded from.
    """

    workload: Workload
    isl_tokens: int
    page_tokens: int
    batch: int
    seed: int
    order: str
    src_layout: PoolLayout
    dst_layout: PoolLayout
    plan: np.ndarray
    request_rows: tuple[tuple[int, int], ...]
    spans: tuple[PlanSpan, ...]
    coalesced: bool = False
    _span_starts: np.ndarray = field(default=None, repr=False)
    src_tables: tuple[dict[str, np.ndarray], ...] | None = field(default=None, repr=False)
    dst_tables: tuple[dict[str, np.ndarray], ...] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_span_starts", np.array([s.start for s in self.spans], dtype=np.int64))

    @property
    def requests(self) -> list[np.ndarray]:
        """Per-request (n_r, 3) views into :attr:`plan` (no copies)."""
        return [self.plan[a:b] for a, b in self.request_rows]

    @property
    def descriptors(self) -> int:
        return int(self.plan.shape[0])

    @property
    def total_bytes(self) -> int:
        return int(self.plan[:, 2].sum())

    @property
    def request_bytes(self) -> list[int]:
        return [int(self.plan[a:b, 2].sum()) for a, b in self.request_rows]

    def describe_row(self, row: int) -> str:
        """'descriptor 12 (request 0, region 'csa', row 12 of the request)'."""
        i = int(np.searchsorted(self._span_starts, row, side="right")) - 1
        if 0 <= i < len(self.spans) and self.spans[i].start <= row < self.spans[i].stop:
            s = self.spans[i]
            a, _ = self.request_rows[s.request]
            return f"descriptor {row} (request {s.request}, region {s.region!r}, row {row - a} of the request)"
        return f"descriptor {row}"

    def validate(self) -> None:
        """Every descriptor inside its region and both pools, none overlapping on the destination."""
        validate_plan(self.plan, self.src_layout, self.dst_layout, spans=self.spans, describe=self.describe_row)

    def bulk_plan(self) -> np.ndarray:
        """One descriptor of the burst's total bytes, at offset 0 of both pools: the ceiling's plan."""
        plan = bulk_plan(self.total_bytes)
        validate_plan(plan, self.src_layout, self.dst_layout)
        return plan

    def coalesce(self) -> "Burst":
        """A burst whose runs of adjacent descriptors (source and destination both contiguous) are merged.

        Merges never cross a (request, region) span, so the result validates the same way.
        """
        breaks = self._span_starts
        merged, new_index = _coalesce(self.plan, breaks)
        n_old = self.plan.shape[0]

        def remap(start: int, stop: int) -> tuple[int, int]:
            if stop <= start:
                lo = int(new_index[start]) if start < n_old else merged.shape[0]
                return lo, lo
            return int(new_index[start]), int(new_index[stop - 1]) + 1

        spans = tuple(PlanSpan(s.request, s.region, *remap(s.start, s.stop)) for s in self.spans)
        rows = tuple(remap(a, b) for a, b in self.request_rows)
        return replace(self, plan=merged, spans=spans, request_rows=rows, coalesced=True)

    def as_dict(self) -> dict:
        return {
            "workload": self.workload.name, "isl_tokens": self.isl_tokens, "page_tokens": self.page_tokens,
            "batch": self.batch, "seed": self.seed, "order": self.order, "coalesced": self.coalesced,
            "descriptors": self.descriptors, "total_bytes": self.total_bytes,
            "src_pool_bytes": self.src_layout.pool_bytes, "dst_pool_bytes": self.dst_layout.pool_bytes,
        }


def build_burst(workload: Workload | str, isl_tokens: int, page_tokens: int, batch: int, *, seed: int = 0,
                layout: PoolLayout | None = None, dst_layout: PoolLayout | None = None, order: str = "random",
                validate: bool = True) -> Burst:
    """The plan of a burst of ``batch`` requests of ``isl_tokens`` at ``page_tokens``.

    ``layout`` is the pool layout of both sides (default: :func:`layout_for_burst`);
    ``dst_layout`` overrides the destination's. Source and destination block tables are
    drawn independently from ``seed`` (see :mod:`gpuxfer.bench.kv.model.blocktable`).
    """
    workload = get_workload(workload)
    _pos_int(batch, "batch (requests per burst)")
    _pos_int(isl_tokens, "input length (tokens)")
    trs = workload.transfer_regions(page_tokens)
    if layout is None:
        layout = layout_for_burst(workload, isl_tokens, page_tokens, batch)
    if layout.workload != workload or layout.page_tokens != page_tokens:
        raise BadInput(f"layout is for {layout.workload.name!r} at {layout.page_tokens}-token pages, not "
                       f"{workload.name!r} at {page_tokens}-token pages")
    dst_layout = layout if dst_layout is None else dst_layout
    _check_compatible(layout, dst_layout)
    src_t = burst_tables(layout, isl_tokens, batch, seed=seed, side="src", order=order)
    dst_t = burst_tables(dst_layout, isl_tokens, batch, seed=seed, side="dst", order=order)

    per_request = workload.descriptors_per_request(isl_tokens, page_tokens)
    plan = np.empty((batch * per_request, 3), dtype=PLAN_DTYPE)
    view = plan.reshape(batch, per_request, 3)
    spans: list[PlanSpan] = []
    col = 0
    region_cols: list[tuple[str, int, int]] = []
    for t in trs:
        s_reg, d_reg = layout.region(t.name), dst_layout.region(t.name)
        sp = np.stack([src_t[r][t.name] for r in range(batch)])          # (batch, pages)
        dp = np.stack([dst_t[r][t.name] for r in range(batch)])
        n = t.planes * sp.shape[1]
        planes = np.arange(t.planes, dtype=np.int64)
        view[:, col:col + n, 0] = (s_reg.base_offset_bytes + planes[None, :, None] * s_reg.plane_stride_bytes
                                   + sp[:, None, :] * s_reg.page_stride_bytes).reshape(batch, n)
        view[:, col:col + n, 1] = (d_reg.base_offset_bytes + planes[None, :, None] * d_reg.plane_stride_bytes
                                   + dp[:, None, :] * d_reg.page_stride_bytes).reshape(batch, n)
        view[:, col:col + n, 2] = t.desc_bytes
        region_cols.append((t.name, col, col + n))
        col += n
    assert col == per_request
    for r in range(batch):
        base = r * per_request
        spans.extend(PlanSpan(r, name, base + a, base + b) for name, a, b in region_cols)
    burst = Burst(workload=workload, isl_tokens=isl_tokens, page_tokens=page_tokens, batch=batch, seed=seed,
                  order=order, src_layout=layout, dst_layout=dst_layout, plan=plan,
                  request_rows=tuple((r * per_request, (r + 1) * per_request) for r in range(batch)),
                  spans=tuple(spans), src_tables=tuple(src_t), dst_tables=tuple(dst_t))
    if validate:
        burst.validate()
    return burst


# ---------------------------------------------------------------------------- coalescing


def _coalesce(plan: np.ndarray, breaks: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    plan = _as_plan(plan)
    n = plan.shape[0]
    if n == 0:
        return plan.copy(), np.zeros(0, dtype=np.int64)
    src, dst, size = plan[:, 0], plan[:, 1], plan[:, 2]
    new_run = np.ones(n, dtype=bool)
    new_run[1:] = (src[:-1] + size[:-1] != src[1:]) | (dst[:-1] + size[:-1] != dst[1:])
    if breaks is not None and len(breaks):
        b = np.asarray(breaks, dtype=np.int64)
        new_run[b[(b >= 0) & (b < n)]] = True
    starts = np.flatnonzero(new_run)
    out = np.empty((starts.size, 3), dtype=PLAN_DTYPE)
    out[:, 0] = src[starts]
    out[:, 1] = dst[starts]
    out[:, 2] = np.add.reduceat(size, starts)
    return out, np.cumsum(new_run) - 1


def coalesce(plan: np.ndarray, *, breaks: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
    """Merge runs of consecutive rows whose source and destination are both contiguous.

    Rows listed in ``breaks`` always start a new descriptor (e.g. region boundaries).
    The byte map (every source byte -> destination byte) is unchanged.
    """
    return _coalesce(plan, breaks)[0]


def bulk_plan(nbytes: int, *, src_offset: int = 0, dst_offset: int = 0) -> np.ndarray:
    """A one-descriptor plan of ``nbytes``: the bulk copy every engine is compared with."""
    _pos_int(nbytes, "bulk bytes")
    _pos_int(src_offset, "bulk source offset", allow_zero=True)
    _pos_int(dst_offset, "bulk destination offset", allow_zero=True)
    return np.array([[src_offset, dst_offset, nbytes]], dtype=PLAN_DTYPE)


# ---------------------------------------------------------------------------- validation


def find_dst_overlap(plan: np.ndarray) -> tuple[int, int] | None:
    """The first pair of rows (i, j) whose destination ranges overlap, or None (sort-based, vectorised)."""
    plan = _as_plan(plan)
    if plan.shape[0] < 2:
        return None
    order = np.argsort(plan[:, 1], kind="stable")
    starts = plan[order, 1]
    ends = starts + plan[order, 2]
    reach = np.maximum.accumulate(ends)
    bad = np.flatnonzero(starts[1:] < reach[:-1])
    if bad.size == 0:
        return None
    k = int(bad[0]) + 1
    j = int(np.argmax(ends[:k]))          # the earlier-starting range that reaches past starts[k]
    a, b = int(order[j]), int(order[k])
    return (min(a, b), max(a, b))


def validate_plan(plan: np.ndarray, src_layout: PoolLayout, dst_layout: PoolLayout | None = None, *,
                  spans: Sequence[PlanSpan] | None = None,
                  describe: Callable[[int], str] | None = None) -> None:
    """Check a plan against its pools; raise :class:`BadInput` naming the first offending descriptor.

    * shape (N, 3), int64; every ``nbytes > 0``;
    * every range inside the source and the destination pool;
    * with ``spans``: every row of a span inside that region's extent on both sides;
    * no two destination ranges overlap.
    """
    plan = _as_plan(plan)
    dst_layout = src_layout if dst_layout is None else dst_layout
    name = describe or (lambda i: f"descriptor {i}")
    if plan.shape[0] == 0:
        return
    check_bounds(plan, src_layout.pool_bytes, dst_layout.pool_bytes, describe=name)
    src, dst, size = plan[:, 0], plan[:, 1], plan[:, 2]
    if spans:
        for sp in spans:
            if sp.stop <= sp.start:
                continue
            if sp.start < 0 or sp.stop > plan.shape[0]:
                raise BadInput(f"span of request {sp.request}, region {sp.region!r} covers rows "
                               f"[{sp.start}, {sp.stop}) of a plan of {plan.shape[0]} rows")
            rows = slice(sp.start, sp.stop)
            for side, col, lay in (("source", src, src_layout), ("destination", dst, dst_layout)):
                reg = lay.region(sp.region)
                lo, hi = reg.base_offset_bytes, reg.end_offset_bytes
                i = _first((col[rows] < lo) | (col[rows] > hi - size[rows]))
                if i is not None:
                    i += sp.start
                    raise BadInput(f"{name(i)}: {side} range [{int(col[i])}, {int(col[i]) + int(size[i])}) lies "
                                   f"outside its region {sp.region!r} [{lo}, {hi})")
    pair = find_dst_overlap(plan)
    if pair is not None:
        a, b = pair
        raise BadInput(f"{name(b)} overlaps {name(a)} on the destination: "
                       f"[{int(dst[b])}, {int(dst[b]) + int(size[b])}) and [{int(dst[a])}, {int(dst[a]) + int(size[a])})")
