"""The CollectiveX suite's geometry: pool pages and layouts, table seeds and block tables, bursts, the
grid and the bulk points, the suite's byte pattern and its sampled check."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ....errors import BadInput
from ..model.layout import PoolLayout, build_layout
from ..model.plan import Burst, PlanSpan, validate_plan
from ..model.workloads import Workload, _pos_int
from ..grid import SHED_DESC, SHED_POOL, Grid, GridPoint, ShedBatch, human_bytes
from .suite import (BATCHES, BATCH_SLACK_QUARTERS, BULK_CAP_BYTES, BULK_PAGE_TOKENS, DESC_BUDGET, FLOOR_BATCHES,
                    ISL_LADDER, OPS, PAGES, PATTERN_ADD, PATTERN_CHUNK_BYTES, PATTERN_MULT, POOL_BUDGET_BYTES,
                    POOL_SLACK_QUARTERS, PRESET, SEED_INITIATOR_OFFSET, SEED_ISL_FACTOR, SEED_PRESET_FACTOR, SIDES,
                    SPARE_PAGES, SUITE, VERIFY_RNG_SEED, VERIFY_SAMPLES, VERIFY_SAMPLE_BYTES, WORKLOAD,
                    _check_isl_page, _workload)


# ----------------------------------------------------------------------------- geometry


def pool_pages(isl: int, page: int, batch_max: int) -> dict[str, int]:
    """Pool pages per region for a point planned for ``batch_max`` requests: ``int(pages_req * slack) + 8``."""
    _check_isl_page(isl, page)
    _pos_int(batch_max, "batch_max (requests)")
    quarters = max(POOL_SLACK_QUARTERS, BATCH_SLACK_QUARTERS * batch_max)
    return {t.name: t.pages_per_request(isl) * quarters // 4 + SPARE_PAGES
            for t in _workload().transfer_regions(page)}


def layout(isl: int, page: int, batch_max: int) -> PoolLayout:
    """The suite's pool: regions in order, ``[layer][page]`` inside, bases back to back (no alignment)."""
    return build_layout(_workload(), page, pool_pages(isl, page, batch_max), align_bytes=1)


def table_seed(isl: int, page: int, side: str, preset: str = PRESET) -> int:
    """``isl * 31 + page + 7 * len(preset)``, plus 1000 on the initiator (the suite's "local" side)."""
    _check_isl_page(isl, page)
    if side not in SIDES:
        raise BadInput(f"table side must be one of {', '.join(SIDES)}, got {side!r}")
    base = isl * SEED_ISL_FACTOR + page + SEED_PRESET_FACTOR * len(preset)
    return base + (SEED_INITIATOR_OFFSET if side == "initiator" else 0)


def block_tables(lay: PoolLayout, isl: int, seed: int, batch: int) -> list[dict[str, np.ndarray]]:
    """Per request of a burst: region -> page indices (int64), drawn as the suite draws them.

    One ``default_rng(seed)`` draws a permutation of each region's pool pages, region by
    region; request r takes ``[r * pages_req, (r + 1) * pages_req)``. A slice past the
    pool raises :class:`BadInput`.
    """
    _pos_int(batch, "batch (requests per burst)")
    rng = np.random.default_rng(seed)
    out: list[dict[str, np.ndarray]] = [{} for _ in range(batch)]
    for reg in lay.regions:
        need = _workload_region(lay, reg.name).pages_per_request(isl)
        perm = rng.permutation(reg.pool_pages).astype(np.int64, copy=False)
        if batch * need > reg.pool_pages:
            raise BadInput(f"pool too small for the burst: region {reg.name!r} holds {reg.pool_pages} pages, "
                           f"{batch} request(s) of {isl} tokens need {need} each")
        for r in range(batch):
            out[r][reg.name] = perm[r * need:(r + 1) * need]
    return out


def _workload_region(lay: PoolLayout, name: str):
    for t in lay.workload.transfer_regions(lay.page_tokens):
        if t.name == name:
            return t
    raise BadInput(f"workload {lay.workload.name!r} has no region {name!r}")


def burst(isl: int, page: int, batch: int, direction: str, *, lay: PoolLayout) -> Burst:
    """The plan of one burst: ``batch`` requests at (isl, page) in pool ``lay``, for ``direction``.

    pull: sources from the target tables, destinations from the initiator tables;
    push: the other way round (the suite's ``table_pairs``).
    """
    if direction not in OPS:
        raise BadInput(f"direction must be one of {', '.join(OPS)}, got {direction!r}")
    if lay.page_tokens != page or lay.workload.name != WORKLOAD:
        raise BadInput(f"layout is for {lay.workload.name!r} at {lay.page_tokens}-token pages, not "
                       f"{WORKLOAD!r} at {page}-token pages")
    ini = block_tables(lay, isl, table_seed(isl, page, "initiator"), batch)
    tgt = block_tables(lay, isl, table_seed(isl, page, "target"), batch)
    src_t, dst_t = (tgt, ini) if direction == "pull" else (ini, tgt)
    per_request = _workload().descriptors_per_request(isl, page)
    plan = np.empty((batch * per_request, 3), dtype=np.int64)
    spans: list[PlanSpan] = []
    for r in range(batch):
        row = r * per_request
        for reg in lay.regions:
            s = np.asarray(src_t[r][reg.name], dtype=np.int64)
            d = np.asarray(dst_t[r][reg.name], dtype=np.int64)
            n = reg.planes * s.size
            plan[row:row + n, 0] = reg.offsets(s)
            plan[row:row + n, 1] = reg.offsets(d)
            plan[row:row + n, 2] = reg.desc_bytes
            spans.append(PlanSpan(r, reg.name, row, row + n))
            row += n
    b = Burst(workload=_workload(), isl_tokens=isl, page_tokens=page, batch=batch,
              seed=table_seed(isl, page, "initiator"), order=SUITE, src_layout=lay, dst_layout=lay, plan=plan,
              request_rows=tuple((r * per_request, (r + 1) * per_request) for r in range(batch)),
              spans=tuple(spans), src_tables=tuple(src_t), dst_tables=tuple(dst_t))
    validate_plan(plan, lay, lay, spans=b.spans, describe=b.describe_row)
    return b


# ----------------------------------------------------------------------------- the grid


@dataclass(frozen=True)
class SuitePoint(GridPoint):
    """A grid point whose pool and bursts are the suite's (its pool pages, its tables)."""

    def layout(self) -> PoolLayout:
        if not self.batches:
            raise BadInput(f"point isl={self.isl_tokens} page={self.page_tokens} keeps no batch; it has no pool")
        return layout(self.isl_tokens, self.page_tokens, self.max_batch)

    def burst(self, batch: int, *, seed: int = 0, layout: PoolLayout | None = None, direction: str = "pull",
              **_ignored) -> Burst:
        """The suite's burst of ``batch`` requests for ``direction`` (``seed`` is not read: the suite's
        tables derive from the geometry alone)."""
        if batch not in self.batches:
            raise BadInput(f"batch {batch} is not kept at point isl={self.isl_tokens} page={self.page_tokens}; "
                           f"kept: {list(self.batches)}")
        return burst(self.isl_tokens, self.page_tokens, batch, direction, lay=layout or self.layout())

    def as_dict(self) -> dict:
        d = super().as_dict()
        d["table_seeds"] = {s: table_seed(self.isl_tokens, self.page_tokens, s) for s in SIDES}
        return d


def _pool_bytes(isl: int, page: int, batch_max: int) -> int:
    return layout(isl, page, batch_max).pool_bytes


def build_grid(isls: Sequence[int] = ISL_LADDER, pages: Sequence[int] = PAGES, batches: Sequence[int] = BATCHES,
               *, free_memory_bytes: int | None = None, pools_per_device: int = 1) -> Grid:
    """The suite's grid (``run_kv._grid``): per (ISL, page), batches over the descriptor budget shed
    except the two smallest asked for, then the largest batches popped until the point's pool fits the
    pool budget (capped at ``free_memory_bytes`` when given; ``pools_per_device=2``: both pools on one
    device)."""
    isl_vals = sorted({_pos_int(v, "input length (tokens)") for v in isls})
    page_vals = sorted({_pos_int(v, "page size (tokens)") for v in pages})
    batch_vals = sorted({_pos_int(v, "batch (requests per burst)") for v in batches})
    if not isl_vals or not page_vals or not batch_vals:
        raise BadInput("the suite's grid needs at least one ISL, page and batch")
    _pos_int(pools_per_device, "pools per device")
    budget = POOL_BUDGET_BYTES
    if free_memory_bytes is not None:
        budget = min(budget, _pos_int(free_memory_bytes, "free memory (bytes)", allow_zero=True))
    w = _workload()
    points = []
    for isl in isl_vals:
        for page in page_vals:
            _check_isl_page(isl, page)
            req_descs = w.descriptors_per_request(isl, page)
            floor = set(batch_vals[:FLOOR_BATCHES])
            kept, shed = [], []
            for b in batch_vals:
                if b in floor or b * req_descs <= DESC_BUDGET:
                    kept.append(b)
                else:
                    shed.append(ShedBatch(b, SHED_DESC, f"a burst of {b} x {req_descs:,} = {b * req_descs:,} "
                                                        f"descriptors exceeds the suite's budget of {DESC_BUDGET:,}",
                                          b * req_descs, _pool_bytes(isl, page, b)))
            while kept and pools_per_device * _pool_bytes(isl, page, kept[-1]) > budget:
                b = kept.pop()
                need = pools_per_device * _pool_bytes(isl, page, b)
                shed.append(ShedBatch(b, SHED_POOL, f"its pool needs {human_bytes(need)} per rank, over the pool "
                                                    f"budget of {human_bytes(budget)}", b * req_descs,
                                      _pool_bytes(isl, page, b)))
            shed.sort(key=lambda s: s.batch)
            lay = layout(isl, page, kept[-1]) if kept else None
            points.append(SuitePoint(
                workload=w, isl_tokens=isl, page_tokens=page, batches=tuple(kept), shed=tuple(shed),
                request_bytes=w.bytes_per_request(isl, page), request_descriptors=req_descs,
                pool_bytes=lay.pool_bytes if lay else 0, pool_pages=lay.pool_pages if lay else ()))
    return Grid(points=tuple(points), pool_budget_bytes=budget, asked_pool_budget_bytes=POOL_BUDGET_BYTES,
                free_memory_bytes=free_memory_bytes, desc_budget=DESC_BUDGET, pools_per_device=pools_per_device,
                floor_batches=FLOOR_BATCHES)


def bulk_bytes(isl: int, grid: Grid) -> int:
    """Bytes of the bulk row at ``isl``: ``min(request bytes at page 64, 8 GiB, the largest paged request)``."""
    largest = max((p.request_bytes for p in grid.points if p.batches), default=0)
    if largest <= 0:
        raise BadInput("the grid keeps no paged point; there is no bulk row")
    return min(_workload().bytes_per_request(isl, BULK_PAGE_TOKENS), BULK_CAP_BYTES, largest)


@dataclass(frozen=True)
class BulkPoint:
    """The bulk row of one ISL: one descriptor of :func:`bulk_bytes` at offset 0 of both pools, batch 1."""

    workload: Workload
    isl_tokens: int
    request_bytes: int
    pool: PoolLayout                    # the pool the bulk copy lies in (the grid's largest)
    kind: str = "bulk"
    page_tokens: int = BULK_PAGE_TOKENS
    request_descriptors: int = 1
    batches: tuple[int, ...] = (1,)

    def burst(self, batch: int = 1, **_ignored) -> Burst:
        if batch != 1:
            raise BadInput(f"the bulk row is batch 1, not {batch}")
        plan = np.array([[0, 0, self.request_bytes]], dtype=np.int64)
        validate_plan(plan, self.pool, self.pool)
        return Burst(workload=self.workload, isl_tokens=self.isl_tokens, page_tokens=self.page_tokens, batch=1,
                     seed=0, order="bulk", src_layout=self.pool, dst_layout=self.pool, plan=plan,
                     request_rows=((0, 1),), spans=(PlanSpan(0, "bulk", 0, 1),))


def bulk_points(grid: Grid) -> list[BulkPoint]:
    """One bulk row per ISL the grid keeps a point at, in the grid's largest pool."""
    kept = [p for p in grid.points if p.batches]
    if not kept:
        return []
    big = max(kept, key=lambda p: p.pool_bytes).layout()
    return [BulkPoint(_workload(), isl, bulk_bytes(isl, grid), big)
            for isl in sorted({p.isl_tokens for p in kept})]


# ----------------------------------------------------------------------------- the pattern and the sampled check


def pattern_at(offsets) -> np.ndarray:
    """The suite's byte at each pool offset: ``((o >> 8) * 131 + 7) & 0xFF`` (uint8)."""
    o = np.asarray(offsets, dtype=np.int64)
    return (((o >> 8) * PATTERN_MULT + PATTERN_ADD) & 0xFF).astype(np.uint8)


def fill_pattern(pool) -> None:
    """Paint the suite's pattern over a whole pool: a uint8 numpy array or torch tensor (any device)."""
    n = pool.shape[0]
    if isinstance(pool, np.ndarray):
        pool[:] = pattern_at(np.arange(n, dtype=np.int64))
        return
    import torch
    chunks = n // PATTERN_CHUNK_BYTES
    vals = ((torch.arange(chunks + 1, device=pool.device, dtype=torch.int64) * PATTERN_MULT + PATTERN_ADD)
            & 0xFF).to(torch.uint8)
    if chunks:
        pool[:chunks * PATTERN_CHUNK_BYTES].view(chunks, PATTERN_CHUNK_BYTES).copy_(
            vals[:chunks, None].expand(chunks, PATTERN_CHUNK_BYTES))
    if n > chunks * PATTERN_CHUNK_BYTES:
        pool[chunks * PATTERN_CHUNK_BYTES:].fill_(int(vals[chunks].item()))


@dataclass(frozen=True)
class Sample:
    request: int
    region: str
    layer: int
    index: int
    src_offset: int
    dst_offset: int


def sample_positions(b: Burst) -> list[Sample]:
    """The suite's samples for every request of ``b``: a fresh ``default_rng(7)`` per request, each
    sample a region (uniform over regions), a layer of it and a page index of the request."""
    out: list[Sample] = []
    regions = list(b.src_layout.regions)
    for r, (start, _stop) in enumerate(b.request_rows):
        rng = np.random.default_rng(VERIFY_RNG_SEED)
        bases = {}
        row = start
        for reg in regions:
            n = reg.planes * _workload_region(b.src_layout, reg.name).pages_per_request(b.isl_tokens)
            bases[reg.name] = (row, n // reg.planes)
            row += n
        for _ in range(VERIFY_SAMPLES):
            reg = regions[int(rng.integers(len(regions)))]
            layer = int(rng.integers(reg.planes))
            base, pages = bases[reg.name]
            i = int(rng.integers(pages))
            src, dst, _n = (int(v) for v in b.plan[base + layer * pages + i])
            out.append(Sample(r, reg.name, layer, i, src, dst))
    return out


def sampled_verify(read: Callable[[np.ndarray], np.ndarray], b: Burst) -> tuple[bool, str]:
    """The suite's check of one burst on the destination pool: ``(passed, detail)``.

    ``read(offsets)`` returns the 8 destination-pool bytes at each offset, as a
    ``(len(offsets), 8)`` uint8 array (one gather for the whole burst). A sample passes
    when those bytes equal the pattern at the sample's source offset. The detail of a
    failure names the first failing request and sample as the suite does.
    """
    samples = sample_positions(b)
    if not samples:
        return True, ""
    dst = np.array([s.dst_offset for s in samples], dtype=np.int64)
    got = np.asarray(read(dst), dtype=np.uint8).reshape(len(samples), VERIFY_SAMPLE_BYTES)
    src = np.array([s.src_offset for s in samples], dtype=np.int64)
    want = pattern_at(src[:, None] + np.arange(VERIFY_SAMPLE_BYTES, dtype=np.int64)[None, :])
    bad = np.flatnonzero((got != want).any(axis=1))
    if not bad.size:
        return True, ""
    k = int(bad[0])
    s = samples[k]
    return False, (f"request={s.request} region={s.region} layer={s.layer} i={s.index} "
                   f"expected={want[k].tolist()} got={got[k].tolist()}")
