"""The measured sweep of ``gpuxfer bench kv``: two processes, two pools, every engine, every byte verified.

Processes
---------
Rank 0 is the **prefill** side: it owns the *source* pool. Rank 1 is the
**decode** side: it owns the *destination* pool. Each allocates its pool through
the platform contract (a raw exportable buffer) and opens the other's over IPC.
With two devices each process takes one; with one device both pools share it;
with none the host emulation runs at small sizes, and says so everywhere.

The command starts the two processes itself (:func:`gpuxfer.spawn.spawn`: the
spawn context, a gloo CPU group over a ``file://`` rendezvous) and reads their
events as they come: the parent prints the table, writes the artifacts and
watches the children (a crash in one kills the other after a grace period; no
event for a long time kills both). Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set; the
world must be 2) each rank runs in place and rank 0 reports.

Across hosts (the ranks' hostnames or kernel boot ids differ, or ``--cross-host``
forces it on one host) the peer's pool is never opened over IPC: engines with
``needs_peer_mapping`` (and Mooncake's intra-node transport) are listed as
unusable with the reason, ``nixl-bulk`` is the ceiling, and fill and
verification stay local to each side as always. See docs/MULTINODE.md.
On one host or across hosts, no usable engine is an error ("nothing could run").

Control never rides the data path: descriptor plans derive from the seed on
both sides, and the gloo group only carries handles, timings and verdicts.
Every gloo operation has the group timeout; every device wait has
``--timeout``.

One row (an engine, a direction, a batch at a grid point)
---------------------------------------------------------
1. both sides ``prepare`` the burst (timed apart: ``prep_ms``, the larger side), each first moved to
   the fastest core of its own with ``--cpus auto`` (:mod:`gpuxfer.bench.cpus`);
2. warm-up bursts, then timed bursts (``--trials`` at most; fewer when a burst is
   slow, never fewer than three: a row costs about ``ROW_BUDGET_S`` seconds);
   a burst is: the passive side posts its flag-gated part, a barrier, then the
   initiating side times ``post`` + ``wait`` on its host clock;
3. verification: the destination pool is refilled with *its own* pattern
   (another seed), one more burst moves the data, and the verify kernel checks
   every byte of every request against the source pattern at the source offset,
   and every byte outside every descriptor against the destination's own
   pattern (a stray write anywhere in the pool: ``stray_bytes``). A wrong byte
   marks the row invalid and the command exits non-zero.

Fault injection (for tests; hidden from ``--help``, documented in
docs/kv_bench.md): ``--inject-fault ENGINE[:DIRECTION][:stray]`` (``ENGINE`` may
be ``all``), or the environment variable ``GPUXFER_INJECT_FAULT``, flips one
destination byte after the verified burst of the matching rows: a byte of the
first descriptor, as a transfer that delivered a wrong byte would, or with
``:stray`` the first byte past the first descriptor that no descriptor covers,
as a transfer that wrote past its range would. The verifier must then fail the row.

This module builds the run's configuration (:mod:`.runconfig`) and starts the two processes; each runs a
:class:`~gpuxfer.bench.kv.worker.Worker`, whose fills, checks and faults are in
:mod:`gpuxfer.bench.kv.checks`.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from ... import config
from ...common import parse_size
from ...errors import BadInput, PlatformUnavailable
from . import engines as E
from .model.plan import DIRECTIONS
from ..cpus import rank_cpus
from . import report as R
from .checks import inject_parts
from .options import GridSpec, RunOptions, parse_devices
from .runconfig import MIN_TRIALS, ROW_BUDGET_S, RunConfig  # noqa: F401 - the runner's configuration
from .worker import Worker

log = logging.getLogger("gpuxfer.bench.kv.runner")

INJECT_ENV = "GPUXFER_INJECT_FAULT"

#: how long the parent lets a surviving child finish after its peer died
GRACE_S = 20.0

# the pack engine's chunks on the host emulation (the grid it runs is gpuxfer.bench.kv.grid.HOST_GRID)
EMULATION = {"pack_chunk_bytes": 256 << 10, "pack_first_chunk_bytes": 64 << 10}


# ----------------------------------------------------------------------------- configuration


def resolve_platform(name: str) -> str:
    """``auto`` -> the first usable of cuda, rocm, host (side-effect free); a forced name must be usable."""
    from ...platforms import PLATFORMS, unavailable_reason
    if name and name != "auto":
        why = unavailable_reason(name)
        if why is not None:
            raise PlatformUnavailable(name, why)
        return name
    skipped = {}
    for cand in PLATFORMS:
        why = unavailable_reason(cand)
        if why is None:
            for k, v in skipped.items():
                log.info("platform %s skipped: %s", k, v)
            return cand
        skipped[cand] = why
    raise PlatformUnavailable("any", "; ".join(f"{k}: {v}" for k, v in skipped.items()))


def _parse_inject(spec: str | None, engines: tuple[str, ...]) -> str | None:
    if spec is None or not str(spec).strip():
        return None
    spec = str(spec).strip()
    eng, d, _ = inject_parts(spec)
    if eng not in ("all",) + tuple(E.ENGINES):
        raise BadInput(f"--inject-fault: unknown engine {eng!r}; use ENGINE[:DIRECTION][:stray] or all")
    if d and d not in DIRECTIONS:
        raise BadInput(f"--inject-fault: unknown direction {d!r}; use pull or push")
    return spec


def config_from_args(args: argparse.Namespace, options: RunOptions, grid: GridSpec) -> RunConfig:
    """Build the run configuration from the parsed command line, its defaults resolved
    (:func:`~gpuxfer.bench.kv.options.resolve_defaults`), the measurement options and the grid."""
    platform = resolve_platform(options.platform)
    grid_args = {k: getattr(args, k) for k in ("workload", "page", "isl", "batch", "pool_budget", "desc_budget")}
    opts = E.EngineOptions()
    trials, warmup = options.trials, _nonneg_int(getattr(args, "warmup", 2), "--warmup")
    # what the command shrank on the host emulation (gpuxfer.bench.kv.grid.HOST_GRID), reported in the parameters
    shrunk: dict[str, Any] = dict(getattr(args, "host_grid", None) or {})
    from ...platforms import platform_class
    if platform_class(platform).kernels_interpreted:
        opts.pack_chunk_bytes = EMULATION["pack_chunk_bytes"]
        opts.pack_first_chunk_bytes = EMULATION["pack_first_chunk_bytes"]
    pack_fixed = bool(getattr(args, "pack_chunk", None))
    if pack_fixed:
        opts.pack_chunk_bytes = parse_size(args.pack_chunk, option="--pack-chunk", kind="bytes")
        opts.pack_first_chunk_bytes = min(opts.pack_first_chunk_bytes, opts.pack_chunk_bytes)
    if getattr(args, "pack_first_chunk", None):
        opts.pack_first_chunk_bytes = parse_size(args.pack_first_chunk, option="--pack-first-chunk", kind="bytes")
    if getattr(args, "pack_lanes", None):
        lanes = parse_size(args.pack_lanes, option="--pack-lanes")
        if lanes > 8:
            raise BadInput(f"--pack-lanes must be 1..8, got {lanes}")
        opts.pack_lanes, opts.pack_slots = lanes, 2 * lanes
    if getattr(args, "copy_engine_max_descs", None):
        opts.copy_engine_max_descs = parse_size(args.copy_engine_max_descs, option="--copy-engine-max-descs",
                                                kind="descriptors")
    opts.validate()
    timeout = float(getattr(args, "timeout", 120) or 120)
    if not timeout > 0:
        raise BadInput(f"--timeout must be positive, got {timeout}")
    inject = _parse_inject(getattr(args, "inject_fault", None) or config.get(INJECT_ENV), options.engines)
    devices = parse_devices(getattr(args, "devices", None))
    post = str(getattr(args, "post", "host") or "host").strip()
    if post not in ("armed", "host"):
        raise BadInput(f"--post: unknown value {post!r}; use armed or host")
    if options.suite:
        # the suite's timing contract: the initiator posts every request's prepared transfer, then waits
        if post != "host" or {"trials", "warmup"} & args.given:
            raise BadInput("--suite collectivex fixes the timing (host posting, 3 trials x 8 timed bursts after 2 "
                           "warm-ups each); drop --post, --trials and --warmup")
        post = "host"
    for name in options.engines:
        E.engine_class(name)       # unknown names fail here, before any process starts
    cpus_option = str(getattr(args, "cpus", None) or "auto").strip()
    cpus = rank_cpus(cpus_option, 2)
    return RunConfig(grid=grid, grid_args=grid_args, engines=tuple(options.engines), directions=tuple(options.directions),
                     trials=trials, warmup=warmup, seed=options.seed, platform=platform,
                     out=options.out or None, json=options.json, timeout_s=timeout, engine_options=opts,
                     inject_fault=inject, armed=post == "armed", devices=devices, shrunk=shrunk,
                     pack_chunk_fixed=pack_fixed, cross_host=bool(getattr(args, "cross_host", False)),
                     suite=options.suite, cpus=cpus, cpus_option=cpus_option)


def _nonneg_int(text, option: str) -> int:
    try:
        v = int(str(text).strip())
    except ValueError:
        raise BadInput(f"{option}: {text!r} is not an integer") from None
    if v < 0:
        raise BadInput(f"{option}: must be >= 0, got {v}")
    return v


# ----------------------------------------------------------------------------- launching


def _spawned_rank(ctx, cfg: RunConfig) -> None:
    code = Worker(ctx.rank, cfg, ctx.emit, init_method=ctx.init_method, launcher="spawn").run()
    if code:
        raise SystemExit(code)  # the worker reported why; leave without the interpreter's teardown


def under_torchrun() -> bool:
    return config.torchrun() is not None


def run_sweep(cfg: RunConfig) -> int:
    """Run the sweep (spawning the two processes, or in place under torchrun); the exit code."""
    if under_torchrun():
        return _run_torchrun(cfg)
    return _run_spawned(cfg)


def _run_torchrun(cfg: RunConfig) -> int:
    rank, world, local = config.torchrun()
    if world != 2:
        raise BadInput(f"gpuxfer bench kv runs on exactly 2 ranks (prefill, decode); torchrun gave WORLD_SIZE={world}")
    reporter = R.Reporter(out_dir=cfg.out, machine_json=cfg.json, argv=cfg.argv) if rank == 0 else None

    def sink(kind: str, payload: dict) -> None:
        if reporter is not None:
            reporter.handle(kind, payload)
        elif kind == "error":
            print(f"gpuxfer bench kv: {payload['text']}", file=sys.stderr)

    code = Worker(rank, cfg, sink, init_method="env://", launcher="torchrun", local_rank=local).run()
    if reporter is None:
        return code
    rc = reporter.finish()
    return rc or code


def _run_spawned(cfg: RunConfig) -> int:
    """Both ranks spawned (:func:`gpuxfer.spawn.spawn`), their events into the reporter as they come."""
    from ...spawn import spawn
    reporter = R.Reporter(out_dir=cfg.out, machine_json=cfg.json, argv=cfg.argv)
    out = spawn(_spawned_rank, 2, (cfg,), on_event=lambda rank, kind, payload: reporter.handle(kind, payload),
                idle_s=3 * cfg.timeout_s + 120, grace_s=GRACE_S, names=("gpuxfer-kv-prefill", "gpuxfer-kv-decode"),
                prefix="gpuxfer-kv-")
    for e in out.errors:
        reporter.error(e)
    return reporter.finish()
