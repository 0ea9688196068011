"""The sweep grid: (workload, input length, page size) points, each with the batches it keeps.

Two budgets shed a point's largest batches, never the point itself:

* the **descriptor budget** per burst: a batch is kept if ``batch * descriptors_per_request
  <= desc_budget``, or if it is one of the two smallest batches asked for (the floor), so
  a single request stays measurable everywhere and the batch axis keeps a one-to-two step;
* the **pool budget** per rank, a hard limit: batches are dropped from the largest down
  until the pool for the largest survivor fits. It may drop the floor too. The budget is
  ``min(pool_budget_bytes, free_memory_bytes)``; with ``pools_per_device=2`` (both pools on
  one GPU) a point needs twice its pool.

Every shed batch is reported with its reason. Counts are analytic: nothing here
materialises a descriptor, so the whole grid costs milliseconds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from ...errors import BadInput
from .model.layout import PoolLayout, layout_for_burst, pages_for_burst
from .model.plan import Burst, build_burst
from .model.workloads import Workload, _pos_int, get_workload

__all__ = [
    "DEFAULT_PAGES", "DEFAULT_ISLS", "DEFAULT_BATCHES", "DEFAULT_POOL_BUDGET_BYTES", "DEFAULT_DESC_BUDGET",
    "FLOOR_BATCHES", "HOST_GRID", "ShedBatch", "human_bytes", "GridPoint", "Grid", "build_grid", "SHED_DESC", "SHED_POOL",
]

GiB = 1 << 30


def human_bytes(nbytes: int) -> str:
    """183.1 MB, 64.0 GB (decimal units, one decimal)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"

DEFAULT_PAGES = (16, 64)
DEFAULT_ISLS = (8192, 32768, 131072, 524288)
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64)
#: Per-rank pool budget: what one benchmark process may allocate for its pool.
DEFAULT_POOL_BUDGET_BYTES = 64 * GiB
#: Per-burst descriptor budget, 2**24 = 16,777,216 descriptors.
#:
#: * It keeps the whole target grid of the benchmark -- ``kv-dsv4`` at 32k tokens, 16- and
#:   64-token pages, batches 1..64 -- with 2x headroom: the largest burst there is
#:   64 x 131,304 = 8,403,456 descriptors. 8k points keep every batch too.
#: * It bounds what a burst costs the host and the device: a descriptor is 24 bytes
#:   (int64 src, dst, nbytes), so a burst at the budget is a 403 MB table and a few seconds
#:   of vectorised planning and validation on one CPU core (8.4 M descriptors: ~0.3 s to
#:   plan, ~1 s to validate).
#: * Larger points shed by it alone: 128k at 16-token pages keeps batches up to 32
#:   (32 x 523,752 = 16.76 M), 512k at 16-token pages up to 8 (8 x 2,093,544 = 16.75 M).
#:   The suite's own budget (2.25 M) was sized for NIC descriptor floors of ~1-4 us; a GPU
#:   kernel walks descriptors at memory speed, so a 7x larger budget keeps the batch axis
#:   where the engines under test differ.
#: * Engines with a per-descriptor cost (``copy_engine``, 0.6-1 us of burst time per descriptor
#:   measured on 2xH200) need their own, smaller cap: that is the benchmark's call, per engine.
DEFAULT_DESC_BUDGET = 1 << 24
#: The host emulation's grid, for every option left at its GPU default (``gpuxfer bench kv --full`` keeps
#: the GPU grid). Triton's interpreter moves well under 1 MB/s through the ``triton`` and ``pack`` kernels
#: (0.6-2.5 s for one 152-descriptor, 665 kB kv-dsv4 request on a core), and a kernel row is three bursts
#: (one untimed, one timed, one verified), so the default run is one request of 16 tokens at one page size:
#: every engine, both directions, every byte verified, in under a minute on two cores. It checks
#: correctness and ordering; its times say nothing about GPUs.
HOST_GRID = {"isl": "16", "page": "16", "batch": "1", "pool_budget": "256MiB", "trials": "1", "warmup": "0"}
#: How many of the smallest requested batches the descriptor budget never sheds.
FLOOR_BATCHES = 2

SHED_DESC = "descriptor-budget"
SHED_POOL = "pool-budget"


@dataclass(frozen=True)
class ShedBatch:
    """A batch a point dropped, and why."""

    batch: int
    reason: str          # SHED_DESC or SHED_POOL
    detail: str
    burst_descriptors: int
    pool_bytes: int      # pool one rank would need for it

    def as_dict(self) -> dict:
        return {"batch": self.batch, "reason": self.reason, "detail": self.detail,
                "burst_descriptors": self.burst_descriptors, "pool_per_rank_bytes": self.pool_bytes}


@dataclass(frozen=True)
class GridPoint:
    """One (workload, ISL, page) point: the batches it keeps and what it needs."""

    workload: Workload
    isl_tokens: int
    page_tokens: int
    batches: tuple[int, ...]            # kept, ascending
    shed: tuple[ShedBatch, ...]         # ascending by batch
    request_bytes: int
    request_descriptors: int
    pool_bytes: int                     # per rank, for the largest kept batch (0 if none kept)
    pool_pages: tuple[tuple[str, int], ...]   # per page space, for the largest kept batch

    @property
    def max_batch(self) -> int:
        return self.batches[-1] if self.batches else 0

    def burst_bytes(self, batch: int) -> int:
        return batch * self.request_bytes

    def burst_descriptors(self, batch: int) -> int:
        return batch * self.request_descriptors

    def layout(self) -> PoolLayout:
        """The pool layout of this point: sized for its largest kept batch, shared by the smaller ones."""
        if not self.batches:
            raise BadInput(f"point {self.workload.name} isl={self.isl_tokens} page={self.page_tokens} keeps no "
                           "batch; it has no pool")
        return layout_for_burst(self.workload, self.isl_tokens, self.page_tokens, self.max_batch)

    def burst(self, batch: int, *, seed: int = 0, layout: PoolLayout | None = None, **kwargs) -> Burst:
        """The descriptor plan of one of this point's bursts, in this point's pool layout."""
        if batch not in self.batches:
            raise BadInput(f"batch {batch} is not kept at point {self.workload.name} isl={self.isl_tokens} "
                           f"page={self.page_tokens}; kept: {list(self.batches)}")
        return build_burst(self.workload, self.isl_tokens, self.page_tokens, batch, seed=seed,
                           layout=layout or self.layout(), **kwargs)

    def as_dict(self) -> dict:
        return {
            "workload": self.workload.name,
            "isl_tokens": self.isl_tokens,
            "page_tokens": self.page_tokens,
            "request_bytes": self.request_bytes,
            "request_descriptors": self.request_descriptors,
            "mean_desc_bytes": self.request_bytes / self.request_descriptors,
            "batches": list(self.batches),
            "bursts": [{"batch": b, "burst_bytes": self.burst_bytes(b),
                        "burst_descriptors": self.burst_descriptors(b)} for b in self.batches],
            "pool_per_rank_bytes": self.pool_bytes,
            "pool_pages": {s: n for s, n in self.pool_pages},
            "shed": [s.as_dict() for s in self.shed],
        }


@dataclass(frozen=True)
class Grid:
    points: tuple[GridPoint, ...]
    pool_budget_bytes: int           # the effective budget: min(asked, free memory)
    asked_pool_budget_bytes: int
    free_memory_bytes: int | None
    desc_budget: int
    pools_per_device: int
    floor_batches: int = FLOOR_BATCHES

    @property
    def shed(self) -> list[tuple[GridPoint, ShedBatch]]:
        return [(p, s) for p in self.points for s in p.shed]

    @property
    def max_pool_bytes(self) -> int:
        return max((p.pool_bytes for p in self.points), default=0)

    def as_dict(self) -> dict:
        return {
            "pool_budget_bytes": self.pool_budget_bytes,
            "asked_pool_budget_bytes": self.asked_pool_budget_bytes,
            "free_memory_bytes": self.free_memory_bytes,
            "desc_budget_descriptors": self.desc_budget,
            "pools_per_device": self.pools_per_device,
            "floor_batches": self.floor_batches,
            "max_pool_per_rank_bytes": self.max_pool_bytes,
            "points": [p.as_dict() for p in self.points],
        }


def _unique_sorted(values: Iterable[int], what: str) -> tuple[int, ...]:
    vals = tuple(values)
    if not vals:
        raise BadInput(f"{what}: at least one value is needed")
    for v in vals:
        _pos_int(v, what)
    return tuple(sorted(set(vals)))


def _plan_point(workload: Workload, isl: int, page: int, batches: tuple[int, ...], *, budget: int,
                desc_budget: int, pools_per_device: int) -> GridPoint:
    req_bytes = workload.bytes_per_request(isl, page)
    req_descs = workload.descriptors_per_request(isl, page)
    floor = set(batches[:FLOOR_BATCHES])
    pool_cache: dict[int, int] = {}

    def pool(b: int) -> int:
        if b not in pool_cache:
            pool_cache[b] = layout_for_burst(workload, isl, page, b).pool_bytes
        return pool_cache[b]

    kept: list[int] = []
    shed: list[ShedBatch] = []
    for b in batches:
        descs = b * req_descs
        if descs <= desc_budget or b in floor:
            kept.append(b)
        else:
            shed.append(ShedBatch(b, SHED_DESC,
                                  f"a burst of {b} x {req_descs:,} = {descs:,} descriptors exceeds the per-burst "
                                  f"budget of {desc_budget:,}", descs, pool(b)))
    while kept and pools_per_device * pool(kept[-1]) > budget:
        b = kept.pop()
        need = pools_per_device * pool(b)
        shed.append(ShedBatch(b, SHED_POOL,
                              f"its pool needs {human_bytes(need)} per rank"
                              f"{f' ({pools_per_device} pools on one device)' if pools_per_device > 1 else ''}, "
                              f"over the pool budget of {human_bytes(budget)} ({budget / GiB:.1f} GiB)",
                              b * req_descs, pool(b)))
    shed.sort(key=lambda s: s.batch)
    if kept:
        pool_pages = tuple(pages_for_burst(workload, isl, page, kept[-1]).items())
        pool_bytes = pool(kept[-1])
    else:
        pool_pages, pool_bytes = (), 0
    return GridPoint(workload=workload, isl_tokens=isl, page_tokens=page, batches=tuple(kept), shed=tuple(shed),
                     request_bytes=req_bytes, request_descriptors=req_descs, pool_bytes=pool_bytes,
                     pool_pages=pool_pages)


def build_grid(workloads: Sequence[str | Workload] = ("kv-dsv4",), pages: Sequence[int] | None = None,
               isls: Sequence[int] = DEFAULT_ISLS, batches: Sequence[int] = DEFAULT_BATCHES, *,
               pool_budget_bytes: int = DEFAULT_POOL_BUDGET_BYTES, free_memory_bytes: int | None = None,
               desc_budget: int = DEFAULT_DESC_BUDGET, pools_per_device: int = 1) -> Grid:
    """The sweep grid: every (workload, ISL, page) point with its kept and shed batches.

    ``pages=None`` uses each workload's own default page sizes (16 and 64 tokens; a
    native-only workload such as ``kv-dsv4-vllm`` its block size). Explicit pages a
    workload cannot map raise :class:`BadInput`.
    """
    wls = [get_workload(w) for w in workloads]
    if not wls:
        raise BadInput("workload: at least one is needed")
    isl_vals = _unique_sorted(isls, "input length (tokens)")
    batch_vals = _unique_sorted(batches, "batch (requests per burst)")
    asked = _pos_int(pool_budget_bytes, "pool budget (bytes)")
    if free_memory_bytes is not None:
        _pos_int(free_memory_bytes, "free memory (bytes)", allow_zero=True)
    _pos_int(desc_budget, "descriptor budget (descriptors per burst)")
    _pos_int(pools_per_device, "pools per device")
    budget = asked if free_memory_bytes is None else min(asked, free_memory_bytes)
    points: list[GridPoint] = []
    seen: set[str] = set()
    for w in wls:
        if w.name in seen:
            continue
        seen.add(w.name)
        page_vals = w.default_pages if pages is None else _unique_sorted(pages, "page size (tokens)")
        for page in page_vals:
            w.check_page(page)
        for isl in isl_vals:
            for page in page_vals:
                points.append(_plan_point(w, isl, page, batch_vals, budget=budget, desc_budget=desc_budget,
                                          pools_per_device=pools_per_device))
    return Grid(points=tuple(points), pool_budget_bytes=budget, asked_pool_budget_bytes=asked,
                free_memory_bytes=free_memory_bytes, desc_budget=desc_budget, pools_per_device=pools_per_device)
