"""``gpuxfer bench kv``: the KV-cache hand-off benchmark's command line.

Every option, their parsing and validation, and ``--plan-only`` (the sweep grid
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
from dataclasses import dataclass
from typing import Callable, TextIO

from ... import config
from ..cliutil import (PLATFORM_CHOICES, add_common_arguments, device_count, error_line, int_option,
                       platform_option, prepare_outputs, seconds_option)
from ...common import parse_size
from ...errors import BadInput
from .grid import (DEFAULT_BATCHES, DEFAULT_DESC_BUDGET, DEFAULT_POOL_BUDGET_BYTES, HOST_GRID, SHED_DESC, Grid,
                   build_grid, human_bytes)
from ...kv.engines.registry import DEFAULT_ENGINES, ENGINES
from ...kv.plan import DIRECTIONS
from ...kv.workloads import WORKLOADS, get_workload

__all__ = ["PLATFORM_CHOICES", "RunOptions", "add_arguments", "run", "parse_grid_args",
           "parse_run_options", "print_plan", "parse_size", "parse_list", "plan_document"]

DEFAULT_ISL = "32k"
#: the file a run leaves in its directory (beside one PNG per workload and ISL)
ARTIFACT = "kv_bench.json"
#: the grid options' defaults (a GPU run's); on the host emulation those left so shrink to HOST_GRID


class _NotGiven(str):
    """A default that compares as its text but is told apart from the same text typed by the user."""


#: ``--isl``'s default (``args.isl is ISL_NOT_GIVEN``: the user gave none)
ISL_NOT_GIVEN = _NotGiven(DEFAULT_ISL)
GPU_DEFAULTS = {"isl": DEFAULT_ISL, "page": "auto", "batch": ",".join(map(str, DEFAULT_BATCHES)),
                "pool_budget": f"{DEFAULT_POOL_BUDGET_BYTES >> 30}GiB", "trials": "5", "warmup": "2"}

# ---------------------------------------------------------------------------- parsing


def parse_list(text: str, *, option: str, item: Callable[[str], object]) -> list:
    """A comma-separated list; every item parsed by ``item``; empty items are errors."""
    if text is None or not str(text).strip():
        raise BadInput(f"{option}: give at least one value")
    parts = [p.strip() for p in str(text).split(",")]
    if any(not p for p in parts):
        raise BadInput(f"{option}: empty item in {text!r}")
    out = []
    for p in parts:
        v = item(p)
        if v not in out:
            out.append(v)
    return out


def _registered_engines() -> tuple[str, ...]:
    """Every engine of the registry (the optional ones, NIXL and Mooncake, too: named, they are measured
    where they can run and reported with the reason where they cannot)."""
    return tuple(dict.fromkeys(DEFAULT_ENGINES + tuple(ENGINES)))


def _choice(known: tuple[str, ...], option: str) -> Callable[[str], str]:
    def parse(p: str) -> str:
        if p not in known:
            raise BadInput(f"{option}: unknown value {p!r}; known: {', '.join(known)}")
        return p
    return parse


def _workload_item(p: str) -> str:
    try:
        return get_workload(p).name
    except BadInput as exc:
        raise BadInput(f"--workload: {exc}") from None


def _positive_int(text, option: str) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        raise BadInput(f"{option}: {text!r} is not an integer") from None
    if value <= 0:
        raise BadInput(f"{option}: must be positive, got {value}")
    return value


# ---------------------------------------------------------------------------- arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every option of ``gpuxfer bench kv`` (lists are comma-separated)."""
    g = parser.add_argument_group("what moves")
    g.add_argument("--workload", default="kv-dsv4", metavar="NAMES",
                   help=f"KV workload presets, comma-separated; known: {', '.join(WORKLOADS)}")
    g.add_argument("--page", default=GPU_DEFAULTS["page"], metavar="TOKENS",
                   help="page sizes in tokens, comma-separated; 'auto' = each workload's own "
                        "(16,64; kv-dsv4-vllm: its native 256-token block)")
    g.add_argument("--isl", default=ISL_NOT_GIVEN, metavar="TOKENS",
                   help=f"input lengths in tokens, comma-separated; k = 1024 (32k = 32,768); default {DEFAULT_ISL} "
                        "(--suite collectivex: its ladder 8k,32k,128k,512k)")
    g.add_argument("--batch", default=GPU_DEFAULTS["batch"], metavar="N",
                   help="requests per burst, comma-separated; the two smallest are always kept unless "
                        "the pool budget forbids them")
    g.add_argument("--seed", default="0", metavar="INT",
                   help="block-table seed: both sides' tables derive from it and the geometry")
    b = parser.add_argument_group("budgets")
    b.add_argument("--pool-budget", default=GPU_DEFAULTS["pool_budget"], metavar="BYTES",
                   help="pool bytes per rank (e.g. 64GiB, 512MiB, 100GB); capped at the device's free memory "
                        "when a device is used; sheds a point's largest batches")
    b.add_argument("--desc-budget", default="16M", metavar="DESCRIPTORS",
                   help=f"descriptors per burst (16M = 2**24 = {DEFAULT_DESC_BUDGET:,}); larger bursts are shed, "
                        "except the two smallest batches")
    r = parser.add_argument_group("how it is measured")
    r.add_argument("--engine", "--engines", dest="engine", default=",".join(DEFAULT_ENGINES), metavar="NAMES",
                   help=f"transfer engines, comma-separated; known: {', '.join(DEFAULT_ENGINES)} "
                        "(bulk: one descriptor of the same bytes, the ceiling)")
    r.add_argument("--direction", default=",".join(DIRECTIONS), metavar="DIRS",
                   help="pull (decode side reads) and/or push (prefill side writes), comma-separated")
    r.add_argument("--trials", default=GPU_DEFAULTS["trials"], metavar="N",
                   help=f"timed bursts per row, after warm-up (host emulation: {HOST_GRID['trials']})")
    r.add_argument("--warmup", default=GPU_DEFAULTS["warmup"], metavar="N",
                   help="untimed bursts per row before the timed ones (a first burst slower than 1 s skips the "
                        f"rest; host emulation: {HOST_GRID['warmup']})")
    r.add_argument("--full", action="store_true",
                   help="on the host emulation, the full grid of a GPU run instead of the small one (slow: "
                        "Triton's interpreter moves a few MB/s)")
    r.add_argument("--devices", default=None, metavar="PREFILL,DECODE",
                   help="device indexes of the prefill and decode processes (default 0,1; 0,0 with one device)")
    r.add_argument("--copy-engine-max-descs", default=None, metavar="DESCRIPTORS",
                   help="copy_engine measures bursts of at most this many descriptors (default 140k: "
                        "~0.6-1 us each on H200); larger bursts are shed, with the reason")
    r.add_argument("--pack-chunk", default=None, metavar="BYTES",
                   help="largest chunk (staging slot) of the pack engine (default 32MiB; 256KiB on the emulation)")
    r.add_argument("--pack-first-chunk", default=None, metavar="BYTES",
                   help="the pack engine's chunks ramp up from this size and down to it again (default 16MiB: "
                        "a short pipeline fill; smaller copy-engine copies run below the link rate)")
    r.add_argument("--pack-lanes", default=None, metavar="N",
                   help="copy streams the pack engine's chunks alternate over, 1..8 (default 2; staging slots: "
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


@dataclass(frozen=True)
class RunOptions:
    """The measurement options, parsed and checked."""

    engines: tuple[str, ...]
    directions: tuple[str, ...]
    trials: int
    seed: int
    platform: str
    out: str
    plan_only: bool
    json: bool
    suite: str | None = None


SUITES = ("collectivex",)


def parse_suite(args: argparse.Namespace) -> str | None:
    suite = getattr(args, "suite", None)
    if suite is None:
        return None
    suite = str(suite).strip()
    if suite not in SUITES:
        raise BadInput(f"--suite: unknown suite {suite!r}; known: {', '.join(SUITES)}")
    return suite


def _suite_grid(args: argparse.Namespace) -> Grid:
    """The CollectiveX suite's grid; --isl, --page and --batch (when given) narrow it, nothing else may change."""
    from . import collectivex as CX
    fixed = [("--workload", args.workload, "kv-dsv4"),
             ("--pool-budget", args.pool_budget, GPU_DEFAULTS["pool_budget"]),
             ("--desc-budget", args.desc_budget, "16M")]
    for option, value, default in fixed:
        if str(value).strip() != default:
            raise BadInput(f"{option}: --suite collectivex fixes it (workload {CX.WORKLOAD}, pool budget "
                           f"{CX.POOL_BUDGET_BYTES >> 30} GiB, descriptor budget {CX.DESC_BUDGET:,}); drop {option}")
    isls = CX.ISL_LADDER if args.isl is ISL_NOT_GIVEN else parse_list(
        args.isl, option="--isl", item=lambda p: parse_size(p, option="--isl", kind="tokens"))
    pages = CX.PAGES if str(args.page).strip().lower() == "auto" else parse_list(
        args.page, option="--page", item=lambda p: parse_size(p, option="--page", kind="tokens"))
    batches = CX.BATCHES if str(args.batch) == GPU_DEFAULTS["batch"] else parse_list(
        args.batch, option="--batch", item=lambda p: _positive_int(p, "--batch"))
    for p in pages:
        try:
            get_workload(CX.WORKLOAD).check_page(p)
        except BadInput as exc:
            raise BadInput(f"--page: {exc}") from None
    return CX.build_grid(isls, pages, batches, free_memory_bytes=getattr(args, "free_memory_bytes", None),
                         pools_per_device=getattr(args, "pools_per_device", 1))


def parse_grid_args(args: argparse.Namespace) -> Grid:
    """The sweep grid the options ask for (the budgets applied, nothing materialised)."""
    if parse_suite(args):
        return _suite_grid(args)
    workloads = parse_list(args.workload, option="--workload", item=_workload_item)
    page_text = str(args.page).strip()
    pages = None if page_text.lower() == "auto" else parse_list(
        page_text, option="--page", item=lambda p: parse_size(p, option="--page", kind="tokens"))
    isls = parse_list(args.isl, option="--isl", item=lambda p: parse_size(p, option="--isl", kind="tokens"))
    batches = parse_list(args.batch, option="--batch", item=lambda p: _positive_int(p, "--batch"))
    pool_budget = parse_size(args.pool_budget, option="--pool-budget", kind="bytes")
    desc_budget = parse_size(args.desc_budget, option="--desc-budget", kind="descriptors")
    if pages is not None:
        for w in workloads:
            for p in pages:
                try:
                    get_workload(w).check_page(p)
                except BadInput as exc:
                    raise BadInput(f"--page: {exc}") from None
    return build_grid(workloads, pages, isls, batches, pool_budget_bytes=pool_budget,
                      free_memory_bytes=getattr(args, "free_memory_bytes", None), desc_budget=desc_budget)


def parse_run_options(args: argparse.Namespace) -> RunOptions:
    seed_text = str(args.seed).strip()
    try:
        seed = int(seed_text)
    except ValueError:
        raise BadInput(f"--seed: {args.seed!r} is not an integer") from None
    if seed < 0:
        raise BadInput(f"--seed: must be >= 0, got {seed}")
    suite = parse_suite(args)
    if suite and seed_text == "0":
        from .collectivex import RUN_SEED
        seed = RUN_SEED
    platform = str(args.platform or "auto").strip().lower()
    if platform not in PLATFORM_CHOICES:
        raise BadInput(f"--platform: unknown platform {platform!r}; known: {', '.join(PLATFORM_CHOICES)}")
    if args.out is not None and not str(args.out).strip():
        raise BadInput("--out: give a directory")
    return RunOptions(
        engines=tuple(parse_list(args.engine, option="--engine", item=_choice(_registered_engines(), "--engine"))),
        directions=tuple(parse_list(args.direction, option="--direction", item=_choice(DIRECTIONS, "--direction"))),
        trials=_positive_int(args.trials, "--trials"),
        seed=seed, platform=platform, out=args.out, plan_only=bool(args.plan_only), json=args.json is True,
        suite=suite,
    )


def apply_host_grid(args: argparse.Namespace, platform: str) -> dict[str, str]:
    """On the host emulation (unless ``--full``), shrink every grid option left at its GPU default to
    :data:`~gpuxfer.bench.kv.grid.HOST_GRID`, in ``args``; returns what shrank (empty on a GPU)."""
    from ...platforms import platform_class
    if getattr(args, "full", False) or platform == "auto" or not platform_class(platform).kernels_interpreted:
        return {}
    shrunk = {}
    for key, value in HOST_GRID.items():
        if parse_suite(args) and key not in ("isl", "page", "batch"):
            continue                    # the suite's budgets and timing stay the suite's
        given = key == "isl" and args.isl is not ISL_NOT_GIVEN      # an --isl typed as the default stays
        if str(getattr(args, key)) == GPU_DEFAULTS[key] and not given:
            setattr(args, key, value)
            shrunk[key] = value
    return shrunk


def _platform_for(args: argparse.Namespace) -> str:
    """The platform the run (or the plan) is for: auto resolved; a named one must be usable, except for
    ``--plan-only``, which may show another platform's grid."""
    name = str(args.platform or config.get("GPUXFER_PLATFORM") or "auto").strip().lower()
    if name not in PLATFORM_CHOICES:
        raise BadInput(f"--platform: unknown platform {name!r}; known: {', '.join(PLATFORM_CHOICES)}")
    if args.plan_only and name != "auto":
        return name
    return platform_option(name)


def _parse_devices(text) -> tuple[int, int] | None:
    if text is None or not str(text).strip():
        return None
    devs = parse_list(text, option="--devices", item=lambda p: int_option(p, "--devices", minimum=0))
    if len(devs) == 1:
        devs = devs * 2
    if len(devs) != 2:
        raise BadInput(f"--devices: give one or two device indexes (prefill,decode), got {text!r}")
    return devs[0], devs[1]


def check_before_start(grid: Grid, args: argparse.Namespace, platform: str) -> None:
    """What the parent can check before any process starts: waits, device indexes, a grid with something left."""
    seconds_option(args.timeout)
    int_option(args.warmup, "--warmup", minimum=0)
    devices = _parse_devices(args.devices)
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


def plan_document(grid: Grid, options: RunOptions | None = None) -> dict:
    """The plan as a JSON-ready dict (unit-suffixed keys)."""
    names = []
    for p in grid.points:
        if p.workload.name not in names:
            names.append(p.workload.name)
    doc = {"kind": "gpuxfer-kv-plan", "grid": grid.as_dict(),
           "workloads": {n: get_workload(n).as_dict() for n in names}}
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


def _count(n: int) -> str:
    if n >= 10_000_000:
        return f"{n / 1e6:.1f} M"
    return f"{n:,}"


def print_plan(grid: Grid, *, as_json: bool = False, options: RunOptions | None = None,
               file: TextIO | None = None) -> None:
    """Print the grid: one row per point, then every shed batch with its reason."""
    file = file or sys.stdout
    if as_json:
        json.dump(plan_document(grid, options), file, indent=2)
        file.write("\n")
        return
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file, width=None if file.isatty() else 150, highlight=False)
    budget = grid.pool_budget_bytes
    cap = ("capped at free memory " + _si(grid.free_memory_bytes) if grid.free_memory_bytes is not None
           and grid.free_memory_bytes < grid.asked_pool_budget_bytes else
           "not capped by free memory: --plan-only queries no device")
    console.print(f"[bold]gpuxfer bench kv --plan-only[/bold]: {len(grid.points)} point{'' if len(grid.points) == 1 else 's'}; "
                  f"pool budget {budget / (1 << 30):.1f} GiB per rank ({cap}); descriptor budget "
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
            console.print("bulk rows (one descriptor, batch 1, per ISL and direction): " + ", ".join(
                f"{p:,} tokens {_si(CX.bulk_bytes(p, grid))}" for p in sorted({q.isl_tokens for q in kept})))
    elif options is not None:
        console.print(f"engines {', '.join(options.engines)}; directions {', '.join(options.directions)}; "
                      f"{options.trials} trials; seed {options.seed}")
    table = Table(title="sweep grid", header_style="bold")
    for col, just in (("workload", "left"), ("ISL\ntokens", "right"), ("page\ntokens", "right"),
                      ("bytes /\nrequest", "right"), ("descriptors /\nrequest", "right"),
                      ("mean B /\ndescriptor", "right"), ("batches kept", "left"),
                      ("largest burst\nbytes", "right"), ("largest burst\ndescriptors", "right"),
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


# ---------------------------------------------------------------------------- run


def run(args: argparse.Namespace) -> int:
    """Check everything the parent can (options, devices, output places), then measure."""
    from ...errors import GpuxferError
    try:
        parse_run_options(args)             # what needs no platform first: a typo fails at once
        if not args.plan_only:
            seconds_option(args.timeout)
            int_option(args.warmup, "--warmup", minimum=0)
            _parse_devices(args.devices)
        platform = _platform_for(args)
        shrunk = apply_host_grid(args, platform)
        grid = parse_grid_args(args)
        options = parse_run_options(args)
        if options.plan_only:
            if shrunk:
                print(host_note(shrunk, plan=True), file=sys.stderr if options.json else sys.stdout)
            print_plan(grid, as_json=options.json, options=options)
            if isinstance(args.json, str):       # --plan-only --json PATH: the plan's JSON there too
                from ..cliutil import json_path_option, write_atomic
                write_atomic(json_path_option(args.json), json.dumps(plan_document(grid, options), indent=2) + "\n")
            return 0
        check_before_start(grid, args, platform)
        from .runner import config_from_args, run_sweep, under_torchrun
        args.host_grid = shrunk
        cfg = config_from_args(args, dataclasses.replace(options, platform=platform))
        writes = not under_torchrun() or os.environ.get("RANK") == "0"
        outputs = prepare_outputs("kv", args.out, args.json, artifacts=(ARTIFACT,), create=writes)
    except GpuxferError as exc:
        return error_line("gpuxfer bench kv", exc)
    if shrunk and writes:
        print(host_note(shrunk), file=sys.stderr if outputs.json_stdout else sys.stdout, flush=True)
    cfg.out, cfg.json = outputs.directory, outputs.json_stdout
    rc = run_sweep(cfg)
    if writes:
        outputs.link_latest()
        made = outputs.path(ARTIFACT)
        if outputs.json_path and made and os.path.exists(made):
            from ..cliutil import write_atomic
            with open(made, "rb") as f:
                write_atomic(outputs.json_path, f.read())
    return rc


def host_note(shrunk: dict[str, str], *, plan: bool = False) -> str:
    """The first lines of a host-emulation run: what it is, what it shrank, how to run the full grid."""
    what = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in shrunk.items())
    return ("# host EMULATION (no GPU here): " + ("the grid below is" if plan else "this run is") +
            f" the small one ({what}): it checks that every engine moves every byte right, in both directions, "
            "in about a minute; its times say nothing about GPUs.\n"
            "# The full grid: `gpuxfer bench kv --full` (hours in Triton's interpreter; `--plan-only --full` "
            "shows it); on a GPU machine plain `gpuxfer bench kv` runs it.")


def run_transfers(grid: Grid, options: RunOptions, args: argparse.Namespace) -> int:
    """The measured sweep: two processes, every engine, every byte verified (:mod:`gpuxfer.bench.kv.runner`),
    with none of :func:`run`'s checks in the parent (``options.out`` is written as given)."""
    from ...errors import GpuxferError
    from .runner import config_from_args, run_sweep
    try:
        cfg = config_from_args(args, options)
    except BadInput as exc:
        print(f"gpuxfer bench kv: error: {exc}", file=sys.stderr)
        return 2
    except GpuxferError as exc:
        print(f"gpuxfer bench kv: {exc}", file=sys.stderr)
        return 1
    return run_sweep(cfg)
