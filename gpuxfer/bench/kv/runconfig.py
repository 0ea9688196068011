"""The KV benchmark run's configuration (:class:`RunConfig`): what the runner builds from the command line and
hands each worker.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from . import engines as E
from .options import GridSpec

__all__ = ["MIN_TRIALS", "ROW_BUDGET_S", "RunConfig"]

#: a row's timed bursts aim at this many seconds (fewer trials for slow bursts, never fewer than MIN_TRIALS)
ROW_BUDGET_S = 2.0
MIN_TRIALS = 3


@dataclass
class RunConfig:
    """Everything the workers need, picklable (the grid is built in the workers with device facts)."""

    grid: GridSpec
    grid_args: dict[str, Any]           # the grid options as given (or defaulted), for the parameters record
    engines: tuple[str, ...]
    directions: tuple[str, ...]
    trials: int
    warmup: int
    seed: int
    platform: str                       # resolved name: cuda / rocm / host
    out: str | None
    json: bool
    timeout_s: float
    engine_options: E.EngineOptions
    inject_fault: str | None = None
    armed: bool = False
    pack_chunk_fixed: bool = False
    devices: tuple[int, int] | None = None
    row_budget_s: float = ROW_BUDGET_S
    min_trials: int = MIN_TRIALS
    cross_host: bool = False            # --cross-host: behave as if the ranks were on different hosts
    suite: str | None = None            # --suite collectivex: the suite's grid, timing, checks and rows
    cpus: Any = None                    # each rank's CPUs (gpuxfer.bench.cpus.rank_cpus): AUTO, one set per rank,
    cpus_option: str = "none"           # or None (not pinned); and --cpus as given
    shrunk: dict[str, Any] = field(default_factory=dict)
    argv: list[str] = field(default_factory=lambda: list(sys.argv))

    def params(self) -> dict[str, Any]:
        p = {
            "workload": self.grid_args["workload"], "page": self.grid_args["page"], "isl": self.grid_args["isl"],
            "batch": self.grid_args["batch"], "engines": list(self.engines), "directions": list(self.directions),
            "warmup": self.warmup, "trials_max": self.trials, "trials_min": min(self.min_trials, self.trials),
            "row_budget_s": self.row_budget_s, "seed": self.seed, "pool_budget": self.grid_args["pool_budget"],
            "desc_budget": self.grid_args["desc_budget"], "timeout_s": self.timeout_s,
            "copy_engine_max_descs": self.engine_options.copy_engine_max_descs,
            "pack_chunk_bytes": self.engine_options.pack_chunk_bytes,
            "pack_slots": self.engine_options.pack_slots, "pack_lanes": self.engine_options.pack_lanes,
            "post": "armed" if self.armed else "host", "cpus": self.cpus_option,
        }
        if self.shrunk:
            p["emulation_shrunk"] = self.shrunk
        if self.inject_fault:
            p["inject_fault"] = self.inject_fault
        if self.cross_host:
            p["cross_host"] = "forced"
        if self.suite:
            from . import collectivex as CX
            p["suite"] = self.suite
            p.update(workload=CX.WORKLOAD, warmup=CX.WARMUP_PER_TRIAL * CX.TRIALS,
                     trials_max=CX.TRIALS * CX.REPS_PER_TRIAL, trials_min=CX.TRIALS * CX.REPS_PER_TRIAL,
                     row_budget_s=None, pool_budget=f"{CX.POOL_BUDGET_BYTES >> 30}GiB", desc_budget=CX.DESC_BUDGET)
        return p
