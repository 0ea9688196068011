"""The options of ``gpuxfer bench kv``, parsed and checked once.

Every grid and timing option defaults to ``None`` on the command line: :func:`resolve_defaults`
is the one place that fills what the user left out (a GPU run's defaults, or on the host
emulation the small grid of :data:`~gpuxfer.bench.kv.grid.HOST_GRID`) and records what the
user gave (``args.given``), so nothing downstream compares option text against a default.

The grid travels as a :class:`GridSpec` (the workloads as objects, every list parsed),
built into a :class:`~gpuxfer.bench.kv.grid.Grid` where the device facts are known.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

from ...common import parse_size
from ...errors import BadInput
from .engines.registry import DEFAULT_ENGINES, ENGINES
from .model.plan import DIRECTIONS
from .model.workloads import Workload, get_workload
from ..cliutil import PLATFORM_CHOICES
from .grid import DEFAULT_BATCHES, DEFAULT_POOL_BUDGET_BYTES, HOST_GRID, Grid, build_grid

DEFAULT_ISL = "32k"
#: every grid and timing option's default: a GPU run's (the command line leaves them None)
DEFAULTS = {"workload": "kv-dsv4", "isl": DEFAULT_ISL, "page": "auto", "batch": ",".join(map(str, DEFAULT_BATCHES)),
            "pool_budget": f"{DEFAULT_POOL_BUDGET_BYTES >> 30}GiB", "desc_budget": "16M", "seed": "0",
            "trials": "5", "warmup": "2"}
SUITES = ("collectivex",)
#: what the CollectiveX suite lets the user narrow; it fixes the rest
SUITE_NARROWS = ("isl", "page", "batch")


# ---------------------------------------------------------------------------- defaults


def resolve_defaults(args: argparse.Namespace, *, host: bool = False) -> dict[str, str]:
    """Fill every option left out (None) with its default, in ``args``: the host emulation's small
    grid where ``host`` (the suite's budgets and timing stay the suite's), else a GPU run's.

    Records the options the user gave in ``args.given`` and what the emulation shrank in
    ``args.host_grid`` (returned). Idempotent: a second call changes nothing.
    """
    if getattr(args, "given", None) is not None:
        return dict(args.host_grid)
    suite = parse_suite(args)
    given = frozenset(k for k in DEFAULTS if getattr(args, k, None) is not None)
    shrunk: dict[str, str] = {}
    for key, default in DEFAULTS.items():
        if key in given:
            continue
        if host and key in HOST_GRID and (not suite or key in SUITE_NARROWS):
            shrunk[key] = HOST_GRID[key]
        setattr(args, key, shrunk.get(key, default))
    args.given, args.host_grid = given, shrunk
    return dict(shrunk)


def _chosen(args: argparse.Namespace, key: str) -> bool:
    """The user gave ``key``, or the host emulation set it."""
    return key in args.given or key in args.host_grid


# ---------------------------------------------------------------------------- items


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


def parse_devices(text) -> tuple[int, int] | None:
    """``--devices PREFILL,DECODE`` (one index: both ranks on it); None when not given. Unlike the other lists,
    a repeated index is kept (``0,0``: both ranks on device 0) and a third index is an error, not dropped."""
    if text is None or not str(text).strip():
        return None
    parts = [p.strip() for p in str(text).split(",")]
    if any(not p for p in parts):
        raise BadInput(f"--devices: empty item in {text!r}")
    devs = []
    for p in parts:
        try:
            v = int(p)
        except ValueError:
            raise BadInput(f"--devices: {p!r} is not an integer") from None
        if v < 0:
            raise BadInput(f"--devices: must be >= 0, got {v}")
        devs.append(v)
    if len(devs) == 1:
        devs = devs * 2
    if len(devs) != 2:
        raise BadInput(f"--devices: give one or two device indexes (prefill,decode), got {text!r}")
    return devs[0], devs[1]


def registered_engines() -> tuple[str, ...]:
    """Every engine of the registry (the optional ones, NIXL and Mooncake, too: named, they are measured
    where they can run and reported with the reason where they cannot)."""
    return tuple(dict.fromkeys(DEFAULT_ENGINES + tuple(ENGINES)))


def _choice(known: tuple[str, ...], option: str) -> Callable[[str], str]:
    def parse(p: str) -> str:
        if p not in known:
            raise BadInput(f"{option}: unknown value {p!r}; known: {', '.join(known)}")
        return p
    return parse


def _workload_item(p: str) -> Workload:
    try:
        return get_workload(p)
    except BadInput as exc:
        raise BadInput(f"--workload: {exc}") from None


def positive_int(text, option: str) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        raise BadInput(f"{option}: {text!r} is not an integer") from None
    if value <= 0:
        raise BadInput(f"{option}: must be positive, got {value}")
    return value


def _tokens(option: str) -> Callable[[str], int]:
    def parse(p: str) -> int:
        if p.strip().startswith("-"):        # as --isl 0 is: a count of tokens, not an unreadable number
            raise BadInput(f"{option}: {p!r} must be positive")
        return parse_size(p, option=option, kind="tokens")
    return parse


def _check_pages(workloads, pages) -> None:
    for w in workloads:
        for p in pages:
            try:
                w.check_page(p)
            except BadInput as exc:
                raise BadInput(f"--page: {exc}") from None


# ---------------------------------------------------------------------------- the grid


@dataclass(frozen=True)
class GridSpec:
    """The sweep grid the options ask for, parsed: built into a :class:`Grid` where the device's free
    memory and the pools per device are known (``--plan-only`` builds it with neither)."""

    workloads: tuple[Workload, ...]
    pages: tuple[int, ...] | None       # None: each workload's own page sizes
    isls: tuple[int, ...]
    batches: tuple[int, ...]
    pool_budget_bytes: int
    desc_budget: int
    suite: str | None = None

    def build(self, *, free_memory_bytes: int | None = None, pools_per_device: int = 1) -> Grid:
        if self.suite:
            from . import collectivex as CX
            return CX.build_grid(self.isls, self.pages, self.batches, free_memory_bytes=free_memory_bytes,
                                 pools_per_device=pools_per_device)
        return build_grid(self.workloads, self.pages, self.isls, self.batches, pool_budget_bytes=self.pool_budget_bytes,
                          free_memory_bytes=free_memory_bytes, desc_budget=self.desc_budget,
                          pools_per_device=pools_per_device)


def parse_suite(args: argparse.Namespace) -> str | None:
    suite = getattr(args, "suite", None)
    if suite is None:
        return None
    suite = str(suite).strip()
    if suite not in SUITES:
        raise BadInput(f"--suite: unknown suite {suite!r}; known: {', '.join(SUITES)}")
    return suite


def _suite_spec(args: argparse.Namespace, suite: str) -> GridSpec:
    """The CollectiveX suite's grid; --isl, --page and --batch (when given) narrow it, nothing else may change."""
    from . import collectivex as CX
    for option, key in (("--workload", "workload"), ("--pool-budget", "pool_budget"), ("--desc-budget", "desc_budget")):
        if key in args.given:
            raise BadInput(f"{option}: --suite collectivex fixes it (workload {CX.WORKLOAD}, pool budget "
                           f"{CX.POOL_BUDGET_BYTES >> 30} GiB, descriptor budget {CX.DESC_BUDGET:,}); drop {option}")
    isls = parse_list(args.isl, option="--isl", item=_tokens("--isl")) if _chosen(args, "isl") else CX.ISL_LADDER
    page_text = str(args.page).strip()
    pages = CX.PAGES if page_text.lower() == "auto" else parse_list(page_text, option="--page", item=_tokens("--page"))
    batches = parse_list(args.batch, option="--batch", item=lambda p: positive_int(p, "--batch")) \
        if _chosen(args, "batch") else CX.BATCHES
    workload = get_workload(CX.WORKLOAD)
    _check_pages([workload], pages)
    return GridSpec((workload,), tuple(pages), tuple(isls), tuple(batches), CX.POOL_BUDGET_BYTES, CX.DESC_BUDGET,
                    suite=suite)


def parse_grid_spec(args: argparse.Namespace) -> GridSpec:
    """The grid the options ask for, every value parsed and checked (defaults resolved first)."""
    resolve_defaults(args)
    suite = parse_suite(args)
    if suite:
        return _suite_spec(args, suite)
    workloads = parse_list(args.workload, option="--workload", item=_workload_item)
    page_text = str(args.page).strip()
    pages = None if page_text.lower() == "auto" else parse_list(page_text, option="--page", item=_tokens("--page"))
    isls = parse_list(args.isl, option="--isl", item=_tokens("--isl"))
    batches = parse_list(args.batch, option="--batch", item=lambda p: positive_int(p, "--batch"))
    pool_budget = parse_size(args.pool_budget, option="--pool-budget", kind="bytes")
    desc_budget = parse_size(args.desc_budget, option="--desc-budget", kind="descriptors")
    if pages is not None:
        _check_pages(workloads, pages)
    return GridSpec(tuple(workloads), None if pages is None else tuple(pages), tuple(isls), tuple(batches),
                    pool_budget, desc_budget)


def parse_grid_args(args: argparse.Namespace) -> Grid:
    """The sweep grid the options ask for (the budgets applied, nothing materialised)."""
    return parse_grid_spec(args).build(free_memory_bytes=getattr(args, "free_memory_bytes", None))


# ---------------------------------------------------------------------------- the measurement


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


def parse_run_options(args: argparse.Namespace) -> RunOptions:
    resolve_defaults(args)
    try:
        seed = int(str(args.seed).strip())
    except ValueError:
        raise BadInput(f"--seed: {args.seed!r} is not an integer") from None
    if seed < 0:
        raise BadInput(f"--seed: must be >= 0, got {seed}")
    suite = parse_suite(args)
    if suite and "seed" not in args.given:
        from .collectivex import RUN_SEED
        seed = RUN_SEED
    platform = str(args.platform or "auto").strip().lower()
    if platform not in PLATFORM_CHOICES:
        raise BadInput(f"--platform: unknown platform {platform!r}; known: {', '.join(PLATFORM_CHOICES)}")
    if args.out is not None and not str(args.out).strip():
        raise BadInput("--out: give a directory")
    return RunOptions(
        engines=tuple(parse_list(args.engine, option="--engine", item=_choice(registered_engines(), "--engine"))),
        directions=tuple(parse_list(args.direction, option="--direction", item=_choice(DIRECTIONS, "--direction"))),
        trials=positive_int(args.trials, "--trials"),
        seed=seed, platform=platform, out=args.out, plan_only=bool(args.plan_only), json=args.json is True,
        suite=suite,
    )
