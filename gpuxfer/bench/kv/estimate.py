"""What a ``gpuxfer bench kv`` run will measure, row by row, and roughly how long it takes: from the plan
alone (no device is touched), for ``--plan-only`` and the first lines of a run.

A row is one engine, one direction, one batch at a grid point; with ``--suite collectivex`` also one bulk
row per ISL, direction and engine (one descriptor, batch 1). Rows an engine sheds by its own caps
(``copy_engine``'s descriptor cap) are decided in the workers, so the count is an upper bound.

The time is a model, not a measurement. On a GPU a row costs about :data:`GPU_ROW_S` (the timed bursts
aim at the row budget, plus preparation and the byte check). On the host emulation the interpreted
engines (``triton``, ``pack`` and their ``-table`` twins) move about :data:`HOST_INTERP_BPS` through
Triton's interpreter, and a burst of fewer than :data:`HOST_FEW_DESCS` descriptors (the suite's bulk rows)
runs :data:`HOST_FEW_DESCS_SLOWDOWN` times slower per byte (fewer interpreted programs share it); every
row's byte check runs there too; a row has a fixed cost of :data:`HOST_ROW_S` (process barriers, fills,
preparation). The constants were fitted to runs on an idle 2-core machine (the default run, ``--isl 1.5k``,
``--suite collectivex``); a loaded or slower machine takes longer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

#: one-off cost of a run: two processes started, platforms, pools, engines (seconds)
HOST_START_S, GPU_START_S = 20.0, 30.0
#: fixed cost of one row on the host emulation, and of one row on a GPU (seconds)
HOST_ROW_S, GPU_ROW_S = 4.0, 3.0
#: bytes per second an interpreted kernel moves (or checks) on the host emulation
HOST_INTERP_BPS = 0.8e6
#: a burst of fewer descriptors than this runs on fewer interpreted programs: this many times slower per byte
HOST_FEW_DESCS, HOST_FEW_DESCS_SLOWDOWN = 8, 2.0


@dataclass(frozen=True)
class PlannedRow:
    engine: str
    direction: str
    workload: str
    isl_tokens: int
    page_tokens: int
    batch: int
    burst_bytes: int
    descriptors: int
    kind: str = "paged"             # or "bulk": the suite's one-descriptor row


def interpreted(engine: str) -> bool:
    """The engine's copies run as Triton kernels (the interpreter's on the host emulation)."""
    return engine.split("-")[0] in ("triton", "pack")


def planned_rows(grid, engines: Sequence[str], directions: Sequence[str], *, suite: str | None = None
                 ) -> list[PlannedRow]:
    """Every row the run measures, in the order it measures them (engine caps not applied)."""
    rows = []
    for p in grid.points:
        for b in p.batches:
            for d in directions:
                rows += [PlannedRow(e, d, p.workload.name, p.isl_tokens, p.page_tokens, b, p.burst_bytes(b),
                                    p.burst_descriptors(b)) for e in engines]
    if suite:
        from . import collectivex as CX
        for bp in CX.bulk_points(grid):
            for d in directions:
                rows += [PlannedRow(e, d, bp.workload.name, bp.isl_tokens, bp.page_tokens, 1, bp.request_bytes, 1,
                                    kind="bulk") for e in engines]
    return rows


def bursts_per_row(engine: str, *, trials: int, warmup: int, suite: str | None = None) -> int:
    """Bursts one row runs: a kernel-loading one (kernel engines), warm-ups, timed ones (at least
    ``min(3, trials)``), and the verified one."""
    if suite:
        from . import collectivex as CX
        timed = CX.TRIALS * (CX.WARMUP_PER_TRIAL + CX.REPS_PER_TRIAL)
    else:
        timed = warmup + trials
    return (1 if interpreted(engine) else 0) + timed + 1


def estimate_s(rows: Sequence[PlannedRow], *, emulation: bool, trials: int, warmup: int,
               suite: str | None = None) -> float:
    """Roughly how long the run takes, in seconds (see the module's text for the model)."""
    if not rows:
        return 0.0
    if not emulation:
        return GPU_START_S + GPU_ROW_S * len(rows)
    total = HOST_START_S
    for r in rows:
        slow = HOST_FEW_DESCS_SLOWDOWN if r.descriptors < HOST_FEW_DESCS else 1.0
        check = r.burst_bytes / HOST_INTERP_BPS                # every row's bytes are checked in the interpreter
        moved = 0.0
        if interpreted(r.engine):
            moved = bursts_per_row(r.engine, trials=trials, warmup=warmup, suite=suite) * r.burst_bytes \
                / HOST_INTERP_BPS * slow
        total += HOST_ROW_S + check + moved
    return total


def about(seconds: float) -> str:
    """``about 40 seconds``, ``about 6 minutes``, ``about 3.5 hours``."""
    if seconds < 90:
        return f"about {max(10, int(round(seconds, -1)))} seconds"
    if seconds < 90 * 60:
        return f"about {int(round(seconds / 60))} minutes"
    return f"about {seconds / 3600:.1f} hours"


def summary_line(rows: Sequence[PlannedRow], seconds: float, *, emulation: bool) -> str:
    """One line: how many rows, of which engines and directions, and the estimate."""
    engines = list(dict.fromkeys(r.engine for r in rows))
    dirs = list(dict.fromkeys(r.direction for r in rows))
    bulk = sum(1 for r in rows if r.kind == "bulk")
    count = f"{len(rows)} row{'' if len(rows) == 1 else 's'}" + (f" ({len(rows) - bulk} paged + {bulk} bulk: one descriptor, batch 1, "
                                   f"per ISL, direction and engine)" if bulk else "")
    where = "on the host emulation, idle 2 cores" if emulation else "on GPUs"
    return (f"{count}: engines {', '.join(engines)}; {' and '.join(dirs)}; {about(seconds)} "
            f"({where}; a rough model, see docs/kv_bench.md)")
