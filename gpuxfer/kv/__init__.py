"""Paged KV-cache hand-off: the transfer API (:class:`KVAgent`), workloads, pool layouts, block tables,
descriptor plans.

Pure Python + numpy; importing it touches no device (torch and Triton load when an agent is built).
The benchmark (``gpuxfer bench kv``, its sweep grid and reports) lives in :mod:`gpuxfer.bench.kv`.
"""
from __future__ import annotations

from .agent import (KVAgent, KVLayerSpec, KVPeer, KVPiece, KVTransfer, KVTransferHandle, describe_layer,
                    layout_groups, memory_at)
from .blocktable import burst_tables, derive_seed, space_permutation
from .layout import (PoolLayout, RegionLayout, build_layout, layout_for_burst, max_batch_for_budget,
                     pages_for_burst, pool_bytes_for_burst, pool_pages_for_budget)
from .plan import Burst, PlanSpan, build_burst, bulk_plan, coalesce, find_dst_overlap, request_plan, validate_plan
from .workloads import (WORKLOADS, PageMap, Region, RequestShape, TransferRegion, Workload, dsv4_vllm_workload,
                        get_workload, workload_names)

__all__ = [
    "KVAgent", "KVLayerSpec", "KVPeer", "KVPiece", "KVTransfer", "KVTransferHandle", "describe_layer",
    "layout_groups", "memory_at",
    "WORKLOADS", "PageMap", "Region", "RequestShape", "TransferRegion", "Workload", "dsv4_vllm_workload",
    "get_workload", "workload_names",
    "PoolLayout", "RegionLayout", "build_layout", "layout_for_burst", "max_batch_for_budget", "pages_for_burst",
    "pool_bytes_for_burst", "pool_pages_for_budget",
    "burst_tables", "derive_seed", "space_permutation",
    "Burst", "PlanSpan", "build_burst", "bulk_plan", "coalesce", "find_dst_overlap", "request_plan",
    "validate_plan",
]
