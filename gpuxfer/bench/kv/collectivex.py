"""The CollectiveX kv-transfer suite, as facts: ``gpuxfer bench kv --suite collectivex``.

Every number here is the suite's, read from SemiAnalysisAI/InferenceX PR #2510 at
``dc95b1fc0ce7`` (paths under ``experimental/CollectiveX/``; the PR page is
https://github.com/SemiAnalysisAI/InferenceX/pull/2510):

=========================  =====================================================================
fact                       source
=========================  =====================================================================
workload ``kv-dsv4`` fp8   ``configs/kv_sweep.json`` ``workloads``; ``bench/kv_workload.py`` ``PRESETS``
ISL ladder 8k..512k        ``configs/kv_sweep.json`` ``isl_ladder``
pages 16, 64               ``configs/kv_sweep.json`` ``page_tokens``
batches 1..64              ``configs/kv_sweep.json`` ``batch_sizes``
ops pull, push             ``configs/kv_sweep.json`` ``ops``
2 warm-up / 8 reps / 3     ``configs/kv_sweep.json`` ``timing``; ``bench/kv_backend.py`` ``time_bursts``
pool slack 2.0, 1.25/batch ``bench/kv_workload.py`` ``plan_config``: ``max(pool_slack, 1.25 * batch_max)``
pool pages ``int(..)+8``   ``plan_config``: ``int(pages_req * slack) + 8`` per region, bases unaligned
run seed 67                ``configs/kv_sweep.json`` ``seed`` (recorded; the block tables do not read it)
table seed                 ``kv_workload.table_seed``: ``isl*31 + page + 7*len(preset)``, +1000 "local"
block tables               ``kv_workload.block_table``: ``default_rng(seed)``, one permutation per
                           region in order, request r takes ``[r*pages_req, (r+1)*pages_req)``
descriptor budget          ``bench/run_kv.py`` ``DESC_BUDGET = 2_250_000`` per burst; the two smallest
                           requested batches ride over it (``_grid``)
pool budget                ``run_kv.POOL_BUDGET = 64 << 30`` per rank, pops the largest batches
bulk row                   ``run_kv.main``: per ISL and op, batch 1, one descriptor of
                           ``min(req_bytes at page 64, BULK_CAP = 8 << 30, largest paged req_bytes)``
pattern                    ``kv_workload._chunk_byte``: ``((o >> 8) * 131 + 7) & 0xFF`` (period 64 KiB)
sampled verification       ``kv_workload.verify_transfer``: per request a fresh ``default_rng(7)``,
                           16 samples of (region, layer, index) x 8 bytes; every request of a burst
statistics                 ``kv_workload.pcts``: p50 ``s[n//2]``, p95 ``s[min(n-1, int(0.95n))]``,
                           min, max, n; ``gbps_p50 = req_bytes * batch / p50_ms / 1e6``
exit code 3                ``run_kv.main``: 0 only if every row verified, else 3
row / document schema      ``run_kv.main`` (``measure``, ``doc``); read by ``summarize.render_kv``
Mooncake settings          ``bench/kv_mooncake.py``: protocol ``rdma``, ``MC_USE_NVLINK_IPC=0``,
                           ``MC_TRANSFER_TIMEOUT=120``, 8,192 descriptors per batch call
MoRI-IO settings           ``bench/kv_mori_io.py``: RDMA backend, qp 1, no chunking, 16,384 offsets
                           per batch call, bulk work requests of at most 1 GiB
=========================  =====================================================================

The suite's geometry is gpuxfer's ``kv-dsv4`` workload (same regions, same counts)
laid out the suite's way (:func:`layout`): its pool pages per region and its
unaligned region bases, so the pool per rank, the block tables and therefore
every descriptor offset equal the suite's. Side names: the suite's *initiator*
(rank 1, "local" seed) initiates both directions; in gpuxfer the initiator is the
decode (destination) side for pull and the prefill (source) side for push, so
pull takes its destination tables from the initiator seed and push its source
tables (:func:`burst`).

Everything here is pure Python + numpy; nothing touches a device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ...errors import BadInput
from .grid import SHED_DESC, SHED_POOL, Grid, GridPoint, ShedBatch, human_bytes
from ...kv.engines import mooncake as mooncake_engine
from ...kv.engines import mori as mori_engine
from ...kv.layout import PoolLayout, build_layout
from ...kv.plan import Burst, PlanSpan, validate_plan
from ...kv.workloads import Workload, _pos_int, get_workload

__all__ = [
    "SUITE", "WORKLOAD", "PRESET", "PRECISION", "ISL_LADDER", "PAGES", "BATCHES", "OPS", "WARMUP_PER_TRIAL",
    "REPS_PER_TRIAL", "TRIALS", "RUN_SEED", "DESC_BUDGET", "POOL_BUDGET_BYTES", "FLOOR_BATCHES", "BULK_CAP_BYTES",
    "BULK_PAGE_TOKENS", "VERIFY_SAMPLES", "VERIFY_SAMPLE_BYTES", "VERIFY_RNG_SEED", "PATTERN_PERIOD_BYTES",
    "EXIT_VERIFY_FAILED", "MOONCAKE_ENV", "MORI_RDMA_CONFIG", "MORI_BATCH_CAP", "MORI_BULK_WR_CAP",
    "SIDES", "pool_pages", "layout", "table_seed", "block_tables", "burst", "SuitePoint", "build_grid",
    "bulk_bytes", "pattern_at", "fill_pattern", "sampled_verify", "pcts", "gbps_p50", "paged_row", "bulk_row",
    "document", "validate_row", "validate_document", "facts",
]

SUITE = "collectivex"
SOURCE = ("SemiAnalysisAI/InferenceX PR #2510 @ dc95b1fc0ce7, experimental/CollectiveX/ "
          "(configs/kv_sweep.json, bench/run_kv.py, bench/kv_workload.py, bench/kv_backend.py)")

# --- the workload (configs/kv_sweep.json: workloads {"kv-dsv4": ["fp8"]})
WORKLOAD = "kv-dsv4"
PRESET = "dsv4"
PRECISION = "fp8"
MODEL_CLASS = "deepseek-v4-pro"

# --- the grid (configs/kv_sweep.json)
ISL_LADDER = (8192, 32768, 131072, 524288)
PAGES = (16, 64)
BATCHES = (1, 2, 4, 8, 16, 32, 64)
OPS = ("pull", "push")

# --- timing (configs/kv_sweep.json "timing"; kv_backend.time_bursts drops each trial's warm-ups)
WARMUP_PER_TRIAL = 2
REPS_PER_TRIAL = 8
TRIALS = 3

# --- pool sizing (kv_workload.plan_config): pool pages per region = int(pages_req * slack) + 8,
#     slack = max(2.0, 1.25 * batch_max); kept in quarters so the arithmetic is exact
POOL_SLACK_QUARTERS = 8          # 2.0
BATCH_SLACK_QUARTERS = 5         # 1.25 per request of the point's largest batch
SPARE_PAGES = 8

# --- seeds (configs/kv_sweep.json "seed"; kv_workload.table_seed)
RUN_SEED = 67
SEED_ISL_FACTOR = 31
SEED_PRESET_FACTOR = 7
SEED_INITIATOR_OFFSET = 1000
#: gpuxfer's name for the suite's two table sides: the suite's "local" is the initiator, "remote" the target
SIDES = ("initiator", "target")

# --- budgets (run_kv.DESC_BUDGET, run_kv.POOL_BUDGET, run_kv._grid)
DESC_BUDGET = 2_250_000
POOL_BUDGET_BYTES = 64 << 30
FLOOR_BATCHES = 2

# --- the bulk row (run_kv.BULK_CAP; plan_config at page 64, batch_max 1)
BULK_CAP_BYTES = 8 << 30
BULK_PAGE_TOKENS = 64

# --- verification (kv_workload._chunk_byte, verify_transfer; run_kv exit code)
PATTERN_CHUNK_BYTES = 256
PATTERN_MULT = 131
PATTERN_ADD = 7
#: 131 is odd, so the chunk value repeats every 256 chunks: 64 KiB
PATTERN_PERIOD_BYTES = 256 * PATTERN_CHUNK_BYTES
VERIFY_SAMPLES = 16
VERIFY_SAMPLE_BYTES = 8
VERIFY_RNG_SEED = 7
EXIT_VERIFY_FAILED = 3

# --- engines (bench/kv_mooncake.py, bench/kv_mori_io.py): the engines carry these settings
MOONCAKE_PROTOCOL = "rdma"
MOONCAKE_ENV = mooncake_engine.SUITE_ENV
MOONCAKE_BATCH_CAP = mooncake_engine.BATCH_CAP
MORI_BATCH_CAP = mori_engine.BATCH_CAP
MORI_BULK_WR_CAP = mori_engine.WR_CAP_BYTES
MORI_RDMA_CONFIG = mori_engine.RDMA_CONFIG

# --- the document (run_kv.main)
DOC_VERSION = 1
SUITE_NAME = "kv-transfer"
RECORD_TYPE = "case-attempt"
PAYLOAD_UNIT = "request-kv-bytes"
OUTCOME_REASON = "transfer verification failed"


def _workload() -> Workload:
    return get_workload(WORKLOAD)


def _check_isl_page(isl: int, page: int) -> None:
    _pos_int(isl, "input length (tokens)")
    _pos_int(page, "page size (tokens)")
    _workload().check_page(page)


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
              spans=tuple(spans))
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


# ----------------------------------------------------------------------------- statistics and rows


def pcts(samples_ms: Sequence[float]) -> dict[str, float | int]:
    """The suite's statistics: p50 ``s[n // 2]``, p95 ``s[min(n - 1, int(n * 0.95))]``, min, max, n."""
    s = sorted(float(v) for v in samples_ms)
    if not s:
        raise BadInput("no timed samples")
    n = len(s)
    return {"p50": s[n // 2], "p95": s[min(n - 1, int(n * 0.95))], "min": s[0], "max": s[-1], "n": n}


def gbps_p50(req_bytes: int, batch: int, p50_ms: float) -> float:
    """``req_bytes * batch / p50_ms / 1e6`` (decimal GB/s of the burst)."""
    if not p50_ms > 0:
        raise BadInput(f"p50 must be positive, got {p50_ms!r} ms")
    return req_bytes * batch / p50_ms / 1e6


def _timed_fields(samples_ms: Sequence[float], req_bytes: int, batch: int, prep_ms: float) -> dict:
    st = pcts(samples_ms)
    return {"prep_ms": round(float(prep_ms), 3), "latency_ms": {k: round(v, 3) for k, v in st.items()},
            "gbps_p50": round(gbps_p50(req_bytes, batch, st["p50"]), 2)}


def paged_row(isl: int, page: int, batch: int, op: str, *, samples_ms: Sequence[float], prep_ms: float,
              verify: dict) -> dict[str, Any]:
    """A ``kind: paged`` row of the suite's schema (``page_bytes``: the first region's, as the suite labels it)."""
    w = _workload()
    req_bytes = w.bytes_per_request(isl, page)
    return {"kind": "paged", "preset": PRESET, "isl": isl, "page_tokens": page, "layers": _suite_layers(),
            "page_bytes": w.transfer_regions(page)[0].desc_bytes, "descs": w.descriptors_per_request(isl, page),
            "req_bytes": req_bytes, "batch": batch, "op": op,
            **_timed_fields(samples_ms, req_bytes, batch, prep_ms), "verify": dict(verify)}


def bulk_row(isl: int, nbytes: int, op: str, *, samples_ms: Sequence[float], prep_ms: float = 0.0) -> dict:
    """A ``kind: bulk`` row: one descriptor, batch 1, no verifying side (it passes by construction)."""
    return {"kind": "bulk", "preset": PRESET, "isl": isl, "page_tokens": None,
            "layers": _suite_layers(), "page_bytes": None, "descs": 1, "batch": 1, "req_bytes": nbytes, "op": op,
            **_timed_fields(samples_ms, nbytes, 1, prep_ms), "verify": {"passed": True, "detail": ""}}


def _suite_layers() -> int:
    """``plan_config``'s ``layers``: the sum of the preset's layer groups (30 CSA + 31 HCA = 61)."""
    return sum(r.layers for r in _workload().regions if r.name in ("csa", "hca"))


ROW_FIELDS: dict[str, tuple] = {
    "kind": (str,), "preset": (str,), "isl": (int,), "page_tokens": (int, type(None)), "layers": (int,),
    "page_bytes": (int, type(None)), "descs": (int,), "req_bytes": (int,), "batch": (int,), "op": (str,),
    "prep_ms": (int, float), "latency_ms": (dict,), "gbps_p50": (int, float), "verify": (dict,),
}
LATENCY_FIELDS = ("p50", "p95", "min", "max", "n")


def validate_row(row: dict) -> None:
    """Raise :class:`BadInput` naming the first field of ``row`` that the suite's schema rejects."""
    if not isinstance(row, dict):
        raise BadInput(f"a suite row must be a dict, got {type(row).__name__}")
    for key, types in ROW_FIELDS.items():
        if key not in row:
            raise BadInput(f"suite row lacks {key!r}")
        v = row[key]
        if isinstance(v, bool) or not isinstance(v, types):
            raise BadInput(f"suite row field {key!r} = {v!r} is not {' or '.join(t.__name__ for t in types)}")
    if row["kind"] not in ("paged", "bulk"):
        raise BadInput(f"suite row kind must be 'paged' or 'bulk', got {row['kind']!r}")
    if row["op"] not in OPS:
        raise BadInput(f"suite row op must be one of {', '.join(OPS)}, got {row['op']!r}")
    if row["kind"] == "paged" and (row["page_tokens"] is None or row["page_bytes"] is None):
        raise BadInput("a paged suite row needs page_tokens and page_bytes")
    if row["kind"] == "bulk" and (row["page_tokens"] is not None or row["descs"] != 1 or row["batch"] != 1):
        raise BadInput("a bulk suite row has page_tokens None, one descriptor and batch 1")
    lat = row["latency_ms"]
    for k in LATENCY_FIELDS:
        if k not in lat or isinstance(lat[k], bool) or not isinstance(lat[k], (int, float)):
            raise BadInput(f"suite row latency_ms lacks a number {k!r}")
    if not 0 < lat["min"] <= lat["p50"] <= lat["p95"] <= lat["max"]:
        raise BadInput(f"suite row latency_ms is not ordered min <= p50 <= p95 <= max: {lat}")
    v = row["verify"]
    if not isinstance(v.get("passed"), bool) or not isinstance(v.get("detail"), str):
        raise BadInput("suite row verify needs a bool 'passed' and a str 'detail'")


def document(rows: Sequence[dict], *, backend: str, fabric: str, runner: str, device_product: str | None,
             framework: str | None, vendor: str | None, library_version: str | None = None,
             generated_at: str | None = None, batches: Sequence[int] = BATCHES,
             reasons: Sequence[str] = (), extra: dict | None = None) -> dict:
    """One case-attempt document of the suite (``run_kv.main``'s ``doc``) for one backend's rows.

    The outcome is ``success`` only if every row's ``verify.passed`` and there is no other
    reason (``reasons``: gpuxfer's full verification, rows that failed to run); ``extra``
    (gpuxfer's own fields) lands under the ``gpuxfer`` key, which the suite's readers ignore.
    """
    import datetime as _dt
    rows = [dict(r) for r in rows]
    for r in rows:
        validate_row(r)
    sampled_ok = bool(rows) and all(r["verify"]["passed"] for r in rows)
    ok = sampled_ok and not reasons
    case = {"backend": backend, "workload": WORKLOAD, "mode": fabric, "phase": "xfer", "ep": 2,
            "routing": "paged", "precision": PRECISION, "suite": SUITE_NAME}
    doc = {
        "version": DOC_VERSION,
        "record_type": RECORD_TYPE,
        "generated_at": generated_at or _dt.datetime.now().astimezone().isoformat(),
        "identity": {
            "allocation_factors": {"run_attempt": None, "run_id": None, "source_sha": None},
            "attempt_ordinal": 1,
            "case_factors": {"case": case, "sku": runner},
            "case_id": f"{runner}:{backend}:{WORKLOAD}:{fabric}:{PRECISION}",
        },
        "workload": {"isl_ladder": sorted({r["isl"] for r in rows}),
                     "page_tokens": sorted({r["page_tokens"] for r in rows if r["page_tokens"] is not None}),
                     "batch_sizes": list(batches), "ops": [o for o in OPS if any(r["op"] == o for r in rows)],
                     "preset": _workload().as_dict()},
        "measurement": {"payload_unit": PAYLOAD_UNIT, "rows": rows,
                        "sampling": {"reps_per_trial": REPS_PER_TRIAL, "trials": TRIALS,
                                     "warmup_per_trial": WARMUP_PER_TRIAL}},
        "implementation": {"name": backend, "fabric": fabric, "library_version": library_version,
                           "maturity": "candidate"},
        "topology": {"device_product": device_product, "gpus_per_node": None, "nodes": None, "ranks_per_node": None,
                     "scale_up_domain": None, "scale_up_transport": None, "topology_class": None, "world_size": 2},
        "runtime": {"framework": framework, "vendor": vendor},
        "provenance": {"image": None, "source_sha": None},
        "outcome": {"reasons": ([] if sampled_ok else [OUTCOME_REASON]) + list(reasons),
                    "status": "success" if ok else "invalid"},
    }
    if extra:
        doc["gpuxfer"] = extra
    validate_document(doc)
    return doc


def validate_document(doc: dict) -> None:
    """Raise :class:`BadInput` naming the first field the suite's summary (``summarize.render_kv``) needs
    and ``doc`` lacks, then validate every row."""
    def get(path: str):
        cur: Any = doc
        for part in path.split("."):
            if not isinstance(cur, dict) or part not in cur:
                raise BadInput(f"suite document lacks {path!r}")
            cur = cur[part]
        return cur
    if get("version") != DOC_VERSION or isinstance(get("version"), bool):
        raise BadInput(f"suite document version must be the number {DOC_VERSION}")
    for path in ("identity.case_factors.sku", "identity.case_factors.case.backend",
                 "identity.case_factors.case.mode", "identity.case_factors.case.workload",
                 "identity.case_factors.case.precision", "outcome.status"):
        if not isinstance(get(path), str):
            raise BadInput(f"suite document field {path!r} must be a string")
    if get("identity.case_factors.case.suite") != SUITE_NAME:
        raise BadInput(f"suite document case.suite must be {SUITE_NAME!r}")
    if get("outcome.status") not in ("success", "invalid"):
        raise BadInput("suite document outcome.status must be 'success' or 'invalid'")
    rows = get("measurement.rows")
    if not isinstance(rows, list):
        raise BadInput("suite document measurement.rows must be a list")
    for r in rows:
        validate_row(r)
    ok = bool(rows) and all(r["verify"]["passed"] for r in rows)
    if get("outcome.status") == "success" and not ok:
        raise BadInput("suite document outcome.status disagrees with its rows' verify verdicts")


def suite_row_from(row: dict) -> dict | None:
    """The suite's row for one of gpuxfer's ``--suite collectivex`` rows (None if it has no timings), with
    gpuxfer's full verification beside the suite's ``verify`` as ``gpuxfer_full_verify``."""
    samples = row.get("samples_ms") or []
    if row.get("error") or not samples or row.get("kind") not in ("paged", "bulk"):
        return None
    prep = (row.get("prep_ms_by_side") or {}).get(row.get("initiator"), row.get("prep_ms") or 0.0)
    if row.get("kind") == "bulk":
        out = bulk_row(row["isl_tokens"], row["request_bytes"], row["direction"], samples_ms=samples, prep_ms=prep)
    else:
        out = paged_row(row["isl_tokens"], row["page_tokens"], row["batch"], row["direction"], samples_ms=samples,
                        prep_ms=prep, verify=row.get("suite_verify") or {"passed": False, "detail": "not checked"})
    wrong = row.get("wrong_bytes")
    out["gpuxfer_full_verify"] = {"passed": wrong == 0, "wrong_bytes": wrong, "detail": row.get("first_wrong") or ""}
    return out


def documents_from_rows(rows: Sequence[dict], env: dict, *, errors: Sequence[str] = ()) -> dict[str, dict]:
    """One suite document per engine of a ``--suite collectivex`` run (its rows, in the suite's schema)."""
    engines: list[str] = []
    for r in rows:
        if r.get("engine") not in engines:
            engines.append(r.get("engine"))
    devices = env.get("devices") or [{}]
    product = ((devices[0] or {}).get("info") or {}).get("name")
    versions = env.get("versions") or {}
    platform = env.get("platform")
    vendor = {"cuda": "nvidia", "rocm": "amd"}.get(platform, platform)
    fabric = (env.get("link") or {}).get("kind") or "unknown"
    docs = {}
    for eng in engines:
        mine = [r for r in rows if r.get("engine") == eng]
        suite_rows, reasons = [], list(errors)
        for r in mine:
            if r.get("kind") == "ceiling":     # gpuxfer's per-burst ceiling: not a row of the suite
                continue
            sr = suite_row_from(r)
            where = f"{r.get('kind', 'paged')} {r.get('direction')} isl {r.get('isl_tokens')} page " \
                    f"{r.get('page_tokens')} batch {r.get('batch')}"
            if sr is None:
                reasons.append(f"{where}: did not run ({r.get('error')})")
                continue
            if not sr["gpuxfer_full_verify"]["passed"]:
                reasons.append(f"{where}: gpuxfer's full verification found {sr['gpuxfer_full_verify']['wrong_bytes']} "
                               "wrong bytes")
            suite_rows.append(sr)
        extra = {"engine": eng, "platform": platform, "is_emulation": env.get("is_emulation"),
                 "full_verification": "every byte of every request, gpuxfer's seeded pattern (gpuxfer_full_verify)"}
        if not suite_rows:
            continue
        docs[eng] = document(suite_rows, backend=eng, fabric=fabric, runner=env.get("hostname") or "unknown",
                             device_product=product, framework=versions.get("torch"), vendor=vendor,
                             reasons=reasons, extra=extra)
    return docs


def exit_code(rows: Sequence[dict], rc: int) -> int:
    """The suite's exit code: 3 when a row failed a verification (sampled or full), else ``rc``."""
    failed = any((r.get("suite_verify") or {}).get("passed") is False or (r.get("wrong_bytes") or 0) > 0
                 for r in rows)
    return EXIT_VERIFY_FAILED if failed else rc


def facts() -> dict[str, Any]:
    """The suite's facts as a JSON-ready dict (for ``--plan-only`` and the artifacts)."""
    return {
        "suite": SUITE, "source": SOURCE, "workload": WORKLOAD, "precision": PRECISION,
        "isl_ladder_tokens": list(ISL_LADDER), "pages_tokens": list(PAGES), "batches": list(BATCHES),
        "ops": list(OPS),
        "timing": {"warmup_per_trial": WARMUP_PER_TRIAL, "reps_per_trial": REPS_PER_TRIAL, "trials": TRIALS,
                   "contract": "host wall clock from posting every request's prepped transfer to the last "
                               "completion; prep excluded; warm-ups dropped"},
        "statistics": "p50 = s[n//2], p95 = s[min(n-1, int(0.95 n))], min, max, n; "
                      "gbps_p50 = req_bytes * batch / p50_ms / 1e6",
        "pool_pages": "int(pages_req * max(2.0, 1.25 * batch_max)) + 8 per region; region bases unaligned",
        "desc_budget_descriptors": DESC_BUDGET, "pool_budget_bytes": POOL_BUDGET_BYTES,
        "floor_batches": FLOOR_BATCHES,
        "run_seed": RUN_SEED,
        "table_seed": "isl*31 + page + 7*len('dsv4'), +1000 on the initiator (the run seed is not read)",
        "bulk": {"bytes": "min(request bytes at page 64, 8 GiB, largest paged request)", "batch": 1,
                 "descriptors": 1, "cap_bytes": BULK_CAP_BYTES},
        "verification": {"samples_per_request": VERIFY_SAMPLES, "bytes_per_sample": VERIFY_SAMPLE_BYTES,
                         "rng_seed": VERIFY_RNG_SEED, "pattern": "((o >> 8) * 131 + 7) & 0xFF",
                         "pattern_period_bytes": PATTERN_PERIOD_BYTES, "exit_code_on_failure": EXIT_VERIFY_FAILED},
        "mooncake": {"protocol": MOONCAKE_PROTOCOL, "env": dict(MOONCAKE_ENV), "batch_cap": MOONCAKE_BATCH_CAP},
        "mori_io": {"backend": "RDMA", "config": dict(MORI_RDMA_CONFIG), "batch_cap": MORI_BATCH_CAP,
                    "bulk_wr_cap_bytes": MORI_BULK_WR_CAP},
    }
