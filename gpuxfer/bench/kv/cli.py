"""``gpuxfer bench kv``: the KV-cache hand-off benchmark's command line.

Every option (parsed and checked by :mod:`gpuxfer.bench.kv.options`), and ``--plan-only`` (the sweep grid
with bytes and descriptors per point, pool per rank, and what was shed and why;
``--json`` for the same as JSON). The measured sweep itself (two processes, every
engine, every byte verified, artifacts) is :mod:`gpuxfer.bench.kv.runner`.

``run`` is split in small steps: ``parse_grid_args(args) -> Grid``,
``parse_run_options(args) -> RunOptions``, ``print_plan(grid, ...)``,
``run_transfers(grid, options, args)``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import TextIO

from ... import config
from ..cpus import HELP as CPUS_HELP
from ..report import wrap_comments
from ..cliutil import (PLATFORM_CHOICES, add_common_arguments, device_count, error_line, int_option,
                       platform_option, prepare_outputs, seconds_option)
from ...common import parse_size
from ...errors import BadInput
from .engines.registry import DEFAULT_ENGINES
from .model.plan import DIRECTIONS
from .model.workloads import WORKLOADS
from .grid import DEFAULT_DESC_BUDGET, HOST_GRID, SHED_DESC, Grid, human_bytes
from .report import EXIT_INTERRUPTED
from .options import (DEFAULTS, RunOptions, parse_devices, parse_grid_args, parse_grid_spec, parse_list,
                      parse_run_options, parse_suite, resolve_defaults)

__all__ = ["PLATFORM_CHOICES", "RunOptions", "add_arguments", "run", "parse_grid_args", "parse_grid_spec",
           "parse_run_options", "parse_suite", "print_plan", "parse_size", "parse_list", "plan_document"]

#: the file a run leaves in its directory (beside one PNG per workload and ISL)
ARTIFACT = "kv_bench.json"


# ---------------------------------------------------------------------------- arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every option of ``gpuxfer bench kv`` (lists are comma-separated)."""
    g = parser.add_argument_group("what moves")
    g.add_argument("--workload", default=None, metavar="NAMES",
                   help=f"KV workload presets, comma-separated; known: {', '.join(WORKLOADS)} "
                        f"(default {DEFAULTS['workload']})")
    g.add_argument("--page", default=None, metavar="TOKENS",
                   help="page sizes in tokens, comma-separated; 'auto' (the default) = each workload's own "
                        "(16,64; kv-dsv4-vllm: its native 256-token block)")
    g.add_argument("--isl", default=None, metavar="TOKENS",
                   help=f"input lengths in tokens, comma-separated; k = 1024 (32k = 32,768); default {DEFAULTS['isl']} "
                        "(--suite collectivex: its ladder 8k,32k,128k,512k)")
    g.add_argument("--batch", default=None, metavar="N",
                   help="requests per burst, comma-separated; the two smallest are always kept unless "
                        f"the pool budget forbids them (default {DEFAULTS['batch']})")
    g.add_argument("--seed", default=None, metavar="INT",
                   help="block-table seed: both sides' tables derive from it and the geometry (default 0; "
                        "--suite collectivex: its run seed)")
    b = parser.add_argument_group("budgets")
    b.add_argument("--pool-budget", default=None, metavar="BYTES",
                   help="pool bytes per rank (e.g. 64GiB, 512MiB, 100GB); capped at the device's free memory "
                        f"when a device is used; sheds a point's largest batches (default {DEFAULTS['pool_budget']})")
    b.add_argument("--desc-budget", default=None, metavar="DESCRIPTORS",
                   help=f"descriptors per burst (default 16M = 2**24 = {DEFAULT_DESC_BUDGET:,}); larger bursts are "
                        "shed, except the two smallest batches")
    r = parser.add_argument_group("how it is measured")
    r.add_argument("--engine", "--engines", dest="engine", default=",".join(DEFAULT_ENGINES), metavar="NAMES",
                   help=f"transfer engines, comma-separated (default: {', '.join(DEFAULT_ENGINES)}: triton, pack and "
                        "copy_engine through the KV API, KVAgent, bulk: one descriptor of the same bytes, the "
                        "ceiling); triton-table, pack-table, copy_engine-table: the same copies over descriptor "
                        "tables uploaded per burst; `gpuxfer doctor` lists every registered engine")
    r.add_argument("--direction", default=",".join(DIRECTIONS), metavar="DIRS",
                   help="pull (decode side reads) and/or push (prefill side writes), comma-separated")
    r.add_argument("--trials", default=None, metavar="N",
                   help=f"timed bursts per row, after warm-up (default {DEFAULTS['trials']}; host emulation: "
                        f"{HOST_GRID['trials']})")
    r.add_argument("--warmup", default=None, metavar="N",
                   help="untimed bursts per row before the timed ones (a first burst slower than 1 s skips the "
                        f"rest; default {DEFAULTS['warmup']}; host emulation: {HOST_GRID['warmup']})")
    r.add_argument("--full", action="store_true",
                   help="on the host emulation, the full grid of a GPU run instead of the small one (slow: "
                        "Triton's interpreter moves a few MB/s)")
    r.add_argument("--devices", default=None, metavar="PREFILL,DECODE",
                   help="device indexes of the prefill and decode processes (default 0,1; 0,0 with one device)")
    r.add_argument("--copy-engine-max-descs", default=None, metavar="DESCRIPTORS",
                   help="copy_engine measures bursts of at most this many descriptors (default 140k: "
                        "~0.6-1 us each on H200); larger bursts are shed, with the reason")
    r.add_argument("--pack-chunk", default=None, metavar="BYTES",
                   help="staging slot of pack and pack-table: their largest chunk (default 32MiB, more for big bursts; "
                        "256KiB on the emulation)")
    r.add_argument("--pack-first-chunk", default=None, metavar="BYTES",
                   help="pack-table's chunks ramp up from this size and down to it again (default 16MiB: "
                        "a short pipeline fill; smaller copy-engine copies run below the link rate)")
    r.add_argument("--pack-lanes", default=None, metavar="N",
                   help="copy streams pack-table's chunks alternate over, 1..8 (default 2; staging slots: "
                        "twice this)")
    r.add_argument("--post", default="host", metavar="MODE",
                   help="host (default): the timer runs from the first post to the last byte landed, the engine's "
                        "host enqueue included (what a caller waits for); armed: each engine enqueues its device "
                        "work ahead behind a GPU flag and the timer runs from the trigger, leaving out the host "
                        "enqueue (reported apart as arm ms; per-burst setup is never timed)")
    r.add_argument("--cross-host", action="store_true",
                   help="run as if the two ranks were on different hosts (set automatically when their hostnames "
                        "or kernel boot ids differ): the peer pool is never mapped over IPC, engines that need the mapping are shed, "
                        "nixl-bulk is the ceiling; see docs/MULTINODE.md")
    r.add_argument("--cpus", default="auto", metavar="auto|none|LIST",
                   help=CPUS_HELP + "; auto moves each rank to its fastest core again before each row, so the "
                        "post and setup host costs are measured there")
    # Fault injection for tests (documented in docs/kv_bench.md): ENGINE[:DIRECTION] or all.
    r.add_argument("--inject-fault", default=None, help=argparse.SUPPRESS)
    r.add_argument("--suite", default=None, metavar="NAME",
                   help="collectivex: the CollectiveX kv-transfer suite's grid, seeds, timing, statistics, bulk "
                        "rows and sampled verification (beside gpuxfer's full one), and its JSON rows "
                        "(docs/kv_bench.md); --isl, --page and --batch may narrow its grid")
    o = parser.add_argument_group("platform and output")
    add_common_arguments(o, name="kv")
    o.add_argument("--plan-only", action="store_true",
                   help="print the sweep grid that would run here (bytes and descriptors per point, pool per rank, "
                        "shed batches and why) and exit; touches no device")


def host_grid_applies(args: argparse.Namespace, platform: str) -> bool:
    """The host emulation runs the small grid (:data:`~gpuxfer.bench.kv.grid.HOST_GRID`) unless ``--full``."""
    from ...platforms import platform_class
    return not getattr(args, "full", False) and platform != "auto" and platform_class(platform).kernels_interpreted


def _platform_for(args: argparse.Namespace) -> str:
    """The platform the run (or the plan) is for: auto resolved; a named one must be usable, except for
    ``--plan-only``, which may show another platform's grid."""
    name = str(args.platform or config.get("GPUXFER_PLATFORM") or "auto").strip().lower()
    if name not in PLATFORM_CHOICES:
        raise BadInput(f"--platform: unknown platform {name!r}; known: {', '.join(PLATFORM_CHOICES)}")
    if args.plan_only and name != "auto":
        return name
    return platform_option(name)


def check_before_start(grid: Grid, args: argparse.Namespace, platform: str) -> None:
    """What the parent can check before any process starts: waits, device indexes, a grid with something left."""
    seconds_option(args.timeout)
    int_option(args.warmup, "--warmup", minimum=0)
    devices = parse_devices(args.devices)
    n = device_count(platform)          # also where a bad GPUXFER_HOST_DEVICES says so, once
    if devices is not None:
        for d in devices:
            if d >= n:
                raise BadInput(f"--devices: device {d} does not exist: platform {platform} shows {n} device(s) "
                               f"(0..{n - 1})")
    if grid.max_pool_bytes <= 0:
        first = grid.shed[0][1].detail if grid.shed else "no point"
        raise BadInput(f"nothing to measure: every batch of every point is shed (e.g. {first}); see --plan-only")


# ---------------------------------------------------------------------------- plan output


def plan_document(grid: Grid, options: RunOptions | None = None, estimate: dict | None = None) -> dict:
    """The plan as a JSON-ready dict (unit-suffixed keys)."""
    doc = {"kind": "gpuxfer-kv-plan", "grid": grid.as_dict(),
           "workloads": {p.workload.name: p.workload.as_dict() for p in grid.points}}
    if estimate is not None:
        doc["rows"] = {k: estimate[k] for k in ("rows", "bulk_rows", "estimate_s", "emulation")}
    if options is not None:
        doc["run"] = {"engines": list(options.engines), "directions": list(options.directions),
                      "trials": options.trials, "seed": options.seed, "platform": options.platform}
    if options is not None and options.suite:
        from . import collectivex as CX
        doc["suite"] = CX.facts()
        doc["suite"]["bulk_rows"] = [{"isl_tokens": i, "bytes": CX.bulk_bytes(i, grid)}
                                     for i in sorted({p.isl_tokens for p in grid.points if p.batches})]
    return doc


_si = human_bytes


def binary_bytes(n: int) -> str:
    """256 MiB, 64 GiB, 1.5 GiB: a budget as it is given on the command line."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            v = n / (1 << shift)
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n} B"


def _count(n: int) -> str:
    if n >= 10_000_000:
        return f"{n / 1e6:.1f} M"
    return f"{n:,}"


def print_plan(grid: Grid, *, as_json: bool = False, options: RunOptions | None = None,
               file: TextIO | None = None, estimate: dict | None = None) -> None:
    """Print the grid: one row per point, then every shed batch with its reason, then the rows and time."""
    file = file or sys.stdout
    if as_json:
        json.dump(plan_document(grid, options, estimate), file, indent=2)
        file.write("\n")
        return
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file, width=None if file.isatty() else 120, highlight=False)
    budget = grid.pool_budget_bytes
    cap = ("capped at free memory " + _si(grid.free_memory_bytes) if grid.free_memory_bytes is not None
           and grid.free_memory_bytes < grid.asked_pool_budget_bytes else
           "not capped by free memory: --plan-only queries no device")
    console.print(f"[bold]gpuxfer bench kv --plan-only[/bold]: {len(grid.points)} point{'' if len(grid.points) == 1 else 's'}; "
                  f"pool budget {binary_bytes(budget)} per rank ({cap}); descriptor budget "
                  f"{grid.desc_budget:,} per burst; the {grid.floor_batches} smallest batches are kept unless the "
                  "pool budget forbids them")
    if options is not None and options.suite:
        from . import collectivex as CX
        console.print(f"suite {options.suite} ({CX.SOURCE}): {CX.TRIALS} trials x {CX.REPS_PER_TRIAL} timed bursts "
                      f"after {CX.WARMUP_PER_TRIAL} warm-ups each, p50/p95; block tables seeded isl*31 + page + "
                      f"7*len('{CX.PRESET}') (+{CX.SEED_INITIATOR_OFFSET} on the initiator); sampled verification "
                      f"({CX.VERIFY_SAMPLES} x {CX.VERIFY_SAMPLE_BYTES} B per request) and every byte")
        kept = [p for p in grid.points if p.batches]
        if kept:
            console.print("bulk rows (one descriptor of the page-64 request's bytes, batch 1, per ISL, direction "
                          "and engine): " + ", ".join(
                f"{p:,} tokens {_si(CX.bulk_bytes(p, grid))}" for p in sorted({q.isl_tokens for q in kept})))
    elif options is not None:
        console.print(f"engines {', '.join(options.engines)}; directions {', '.join(options.directions)}; "
                      f"{options.trials} trial{'' if options.trials == 1 else 's'}; seed {options.seed}")
    table = Table(title="sweep grid", header_style="bold")
    for col, just in (("workload", "left"), ("ISL\ntokens", "right"), ("page\ntokens", "right"),
                      ("bytes /\nrequest", "right"), ("descs /\nrequest", "right"),
                      ("mean B /\ndesc", "right"), ("batches\nkept", "left"),
                      ("largest\nburst\nbytes", "right"), ("largest\nburst\ndescs", "right"),
                      ("pool /\nrank", "right"), ("shed", "left")):
        table.add_column(col, justify=just, overflow="fold")
    for p in grid.points:
        by_reason: dict[str, list[str]] = {}
        for s in p.shed:
            by_reason.setdefault("descriptors" if s.reason == SHED_DESC else "pool", []).append(str(s.batch))
        shed = "; ".join(f"{k}: {','.join(v)}" for k, v in by_reason.items())
        table.add_row(
            p.workload.name, f"{p.isl_tokens:,}", str(p.page_tokens), _si(p.request_bytes),
            f"{p.request_descriptors:,}", f"{p.request_bytes / p.request_descriptors:,.0f}",
            ",".join(map(str, p.batches)) or "[red]none[/red]",
            _si(p.burst_bytes(p.max_batch)) if p.batches else "-",
            _count(p.burst_descriptors(p.max_batch)) if p.batches else "-",
            _si(p.pool_bytes) if p.batches else "-", shed or "-")
    console.print(table)
    if grid.shed:
        st = Table(title="shed batches", header_style="bold")
        for col in ("workload", "ISL tokens", "page tokens", "batch", "reason", "why"):
            st.add_column(col)
        for p, s in grid.shed:
            st.add_row(p.workload.name, f"{p.isl_tokens:,}", str(p.page_tokens), str(s.batch), s.reason, s.detail)
        console.print(st)
    else:
        console.print("no batch shed")
    console.print(f"largest pool per rank: {_si(grid.max_pool_bytes)}")
    if estimate is not None:
        console.print(f"rows: {estimate['line']}")


# ---------------------------------------------------------------------------- run


def run(args: argparse.Namespace) -> int:
    """Check everything the parent can (options, devices, output places), then measure."""
    from ...errors import GpuxferError
    try:
        parse_run_options(argparse.Namespace(**vars(args)))   # what needs no platform first: a typo fails at once
        if not args.plan_only:
            seconds_option(args.timeout)
            if args.warmup is not None:
                int_option(args.warmup, "--warmup", minimum=0)
            parse_devices(args.devices)
        platform = _platform_for(args)
        shrunk = resolve_defaults(args, host=host_grid_applies(args, platform))
        spec = parse_grid_spec(args)
        grid = spec.build()
        options = parse_run_options(args)
        estimate = plan_estimate(grid, options, args, platform)
        if options.plan_only:
            from ..cliutil import json_path_option, write_atomic
            json_path = json_path_option(args.json)     # checked before anything is printed
            if shrunk:
                print(host_note(shrunk, plan=True, suite=options.suite), file=sys.stderr if options.json else sys.stdout)
            print_plan(grid, as_json=options.json, options=options, estimate=estimate)
            if json_path:                        # --plan-only --json PATH: the plan's JSON there
                write_atomic(json_path, json.dumps(plan_document(grid, options, estimate), indent=2) + "\n",
                             replace=False)
                print(f"# json: {json_path}")
            return 0
        check_before_start(grid, args, platform)
        from .runner import config_from_args, run_sweep, under_torchrun
        cfg = config_from_args(args, dataclasses.replace(options, platform=platform), spec)
        writes = not under_torchrun() or config.torchrun()[0] == 0
        outputs = prepare_outputs("kv", args.out, args.json, artifacts=(ARTIFACT,), create=writes)
    except GpuxferError as exc:
        return error_line("gpuxfer bench kv", exc)
    if writes:
        text = sys.stderr if outputs.json_stdout else sys.stdout
        if shrunk:
            print(host_note(shrunk, suite=options.suite), file=text)
        print("\n".join(wrap_comments([f"# plan: {estimate['line']}"])), file=text, flush=True)
    cfg.out, cfg.json = outputs.directory, outputs.json_stdout
    rc = run_sweep(cfg)
    if rc == EXIT_INTERRUPTED:
        if writes:
            _after_interrupt(outputs)
        return rc
    if writes:
        outputs.link_latest()
        made = outputs.path(ARTIFACT)
        if outputs.json_path and made and os.path.exists(made):
            from ..cliutil import write_atomic
            with open(made, "rb") as f:
                data = f.read()
            try:
                write_atomic(outputs.json_path, data, replace=False)
            except (GpuxferError, OSError) as exc:
                print(f"gpuxfer bench kv: error: --json: {exc} (the run's JSON is {made})", file=sys.stderr)
                return rc or 1
            print(f"# json: {outputs.json_path}", flush=True)
    return rc


def _after_interrupt(outputs) -> None:
    """Ctrl-C: ``latest`` keeps pointing at the last whole run; a run directory this run made and in which
    no row was finished is removed (its finished rows, if any, are kept where the footer said)."""
    made = outputs.path(ARTIFACT)
    rows = None
    if made and os.path.exists(made):
        try:
            with open(made) as f:
                rows = len(json.load(f).get("rows") or [])
        except (OSError, ValueError):
            rows = None
    if outputs._created and outputs.directory and rows == 0:
        import shutil
        shutil.rmtree(outputs.directory, ignore_errors=True)
        print(f"# interrupted before any row finished: {outputs.directory} removed", file=sys.stderr)


def host_note(shrunk: dict[str, str], *, plan: bool = False, suite: str | None = None) -> str:
    """The first lines of a host-emulation run: what it is, what it shrank, how to run the full grid
    (the ``# plan:`` line after it says which rows and how long)."""
    what = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in shrunk.items())
    cmd = "gpuxfer bench kv" + (f" --suite {suite}" if suite else "")
    return "\n".join(wrap_comments([
        "# host EMULATION (no GPU here): " + ("the grid below is" if plan else "this run is") +
        f" the small one ({what}): it checks that each engine asked for moves every byte right; its times "
        "say nothing about GPUs.",
        f"# The full grid: `{cmd} --full` (hours in Triton's interpreter; `{cmd} --plan-only --full` "
        f"shows it); on a GPU machine plain `{cmd}` runs it."]))


def plan_estimate(grid: Grid, options: RunOptions, args: argparse.Namespace, platform: str) -> dict:
    """The rows the run measures and roughly how long it takes here (:mod:`gpuxfer.bench.kv.estimate`)."""
    from ...platforms import platform_class
    from . import estimate as T
    emulation = platform != "auto" and platform_class(platform).kernels_interpreted
    rows = T.planned_rows(grid, options.engines, options.directions, suite=options.suite)
    warmup = int(str(args.warmup).strip()) if str(args.warmup).strip().isdigit() else 0
    seconds = T.estimate_s(rows, emulation=emulation, trials=options.trials, warmup=warmup, suite=options.suite)
    return {"rows": len(rows), "bulk_rows": sum(1 for r in rows if r.kind == "bulk"), "estimate_s": round(seconds),
            "emulation": emulation, "line": T.summary_line(rows, seconds, emulation=emulation)}


def run_transfers(grid: Grid, options: RunOptions, args: argparse.Namespace) -> int:
    """The measured sweep: two processes, every engine, every byte verified (:mod:`gpuxfer.bench.kv.runner`),
    with none of :func:`run`'s checks in the parent (``options.out`` is written as given)."""
    from ...errors import GpuxferError
    from .runner import config_from_args, run_sweep
    try:
        cfg = config_from_args(args, options, parse_grid_spec(args))
    except BadInput as exc:
        print(f"gpuxfer bench kv: error: {exc}", file=sys.stderr)
        return 2
    except GpuxferError as exc:
        print(f"gpuxfer bench kv: {exc}", file=sys.stderr)
        return 1
    return run_sweep(cfg)
