"""The KV benchmark's workload model: workloads (:mod:`.workloads`), pool layouts (:mod:`.layout`), seeded block
tables (:mod:`.blocktable`) and the descriptor plans of a burst (:mod:`.plan`).

Pure Python + numpy; importing it touches no device.
"""
from __future__ import annotations

from .blocktable import burst_tables, derive_seed, space_permutation
from .layout import (PoolLayout, RegionLayout, build_layout, layout_for_burst, layout_groups, max_batch_for_budget,
                     pages_for_burst, pool_bytes_for_burst, pool_pages_for_budget)
from .plan import Burst, PlanSpan, build_burst, bulk_plan, coalesce, find_dst_overlap, request_plan, validate_plan
from .workloads import (WORKLOADS, PageMap, Region, RequestShape, TransferRegion, Workload, dsv4_vllm_workload,
                        get_workload, workload_names)

__all__ = [
    "WORKLOADS", "PageMap", "Region", "RequestShape", "TransferRegion", "Workload", "dsv4_vllm_workload",
    "get_workload", "workload_names",
    "PoolLayout", "RegionLayout", "build_layout", "layout_for_burst", "layout_groups", "max_batch_for_budget",
    "pages_for_burst", "pool_bytes_for_burst", "pool_pages_for_budget",
    "burst_tables", "derive_seed", "space_permutation",
    "Burst", "PlanSpan", "build_burst", "bulk_plan", "coalesce", "find_dst_overlap", "request_plan",
    "validate_plan",
]
