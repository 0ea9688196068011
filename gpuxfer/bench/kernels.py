"""``gpuxfer bench kernels``: the Triton copy kernels against the ceilings of the same run.

What it measures, for each descriptor size (default 528, 576, 2,304, 9,216 and
36,864 B), every page of a pool (default 2 GiB) moved in random order (a random
permutation of the source pages onto a random permutation of destination pages):

* ``pull``   -- the kernel runs on the local GPU and reads a peer GPU's pool,
  opened over IPC from a helper process that owns it (the platform contract);
* ``push``   -- the kernel runs on the local GPU and writes the peer's pool;
* ``ce-pull`` / ``ce-push`` -- the ceiling: ``platform.copy_async`` (copy engines)
  of the same total bytes as one contiguous copy;
* ``local``  -- descriptor copy between two local pools;
* ``pack`` / ``unpack`` -- gather into a contiguous staging buffer and scatter back;
* ``hbm-copy`` -- their ceiling: a torch ``copy_`` of the same bytes on the local GPU;
* ``blocks`` -- a KV request pulled from the peer two ways, for the same request: ``exp+copy`` (the
  expansion kernel writes the ``(N, 3)`` descriptors, then the copy kernel reads its row range from the
  request: what a ``triton``-engine slot runs with ``GPUXFER_KV_COPY=descriptors``) and ``blocks`` (the copy
  kernel's mode 5, which derives each row from the request and the plane table: no descriptor buffer, one
  launch: what a slot runs by default). The request: every block of
  the pools, two planes (a block's halves, each of the size), source and destination IDs in random order;
  the ``exp+copy`` row also reports the expansion alone (``expand_us``); ``--tilings`` adds a ``blocks`` row
  per tiling given (a tuning aid; mode 5's default tiling is a slot's: its own for rows up to 4 KB, else the
  descriptor copy's table);
* ``sweep``  -- pull at one size (2,304 B) on a bounded grid of 1, 2, 4, ... programs
  (one program per SM while it is at most the SM count): GB/s against SMs used.

GB/s = bytes moved (each byte once) / time / 1e9; time is the median of the
timed trials after the warm-up, measured with CUDA events on the stream the
work runs on (host clock + synchronize on the emulation). Every destination is
poisoned before the run and every byte is verified against the source pattern
after it (``wrong_B``); any wrong byte fails the run (exit code 1). Speeds are
reported against the ceiling of the same run (``%ceil``) and judged only above it: a row above its ceiling
passes within the ceiling's spread (at most its fastest trial) and otherwise fails the run (the ceiling is not
one); on the host emulation it is noted, not judged.

On the host emulation (no GPU) it runs at tiny sizes in Triton's interpreter and
says so: the numbers are not GPU performance.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import platform as _pyplatform
import re
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from . import report as R
from .cliutil import (add_common_arguments, check_room, device_count, error_line, int_option, platform_option,
                      prepare_outputs, seconds_option)
from ..common import parse_size, run_versions
from ..errors import BadInput, GpuxferError
from .timing import DeviceClock

DEFAULT_SIZES = "528,576,2304,9216,36864"
DEFAULT_OPS = "pull,push,local,pack,unpack,blocks"
DEFAULT_SWEEP = "1,2,4,8,16,32,sms,all"
SEED, POISON = 0x5EED, 0xBAD
SWEEP_DESCS_PER_PROGRAM = 16384
_TILING = re.compile(r"r(\d+)w(\d+)u(\d+)n(\d+)(?:p(\d+))?")


def _parse_ints(text: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BadInput(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not out or any(v <= 0 for v in out):
        raise BadInput(f"{what}: expected positive integers, got {text!r}")
    return out


def parse_tilings(text: str | None) -> list:
    """``--tilings``: ``rROWSwWIDTHuUNROLLnWARPS[pPROGRAMS_PER_SM]`` each, comma-separated, as ``CopyConfig``s
    (e.g. ``r64w8u4n8``: 64 rows of 8 16-byte units, 4 chunks in flight, 8 warps, 2 programs per SM)."""
    from ..kernels.launch import CopyConfig
    out = []
    for spec in (x.strip() for x in (text or "").split(",")):
        if not spec:
            continue
        m = _TILING.fullmatch(spec)
        if m is None:
            raise BadInput(f"--tilings: expected rROWSwWIDTHuUNROLLnWARPS[pPROGRAMS_PER_SM] (e.g. r64w8u4n8), "
                           f"got {spec!r}")
        rows, width, unroll, warps, pps = (int(g) if g else 2 for g in m.groups())
        try:
            out.append(CopyConfig(rows=rows, width=width, unroll=unroll, num_warps=warps, programs_per_sm=pps))
        except BadInput as exc:
            raise BadInput(f"--tilings {spec}: {exc}") from None
    return out


def tiling_name(cfg) -> str:
    return f"r{cfg.rows}w{cfg.width}u{cfg.unroll}n{cfg.num_warps}p{cfg.programs_per_sm}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("what moves")
    g.add_argument("--sizes", default=DEFAULT_SIZES, metavar="BYTES",
                   help="descriptor sizes in bytes, comma-separated")
    g.add_argument("--pool", default=None, metavar="BYTES",
                   help="bytes per pool buffer (every page of it moves in random order); default 2GiB, "
                        "256KiB on the host emulation")
    g.add_argument("--ops", default=DEFAULT_OPS, metavar="OPS",
                   help="kernel rows to run, comma-separated: pull, push, local, pack, unpack, blocks")
    g.add_argument("--tilings", default="", metavar="SPECS",
                   help="the blocks rows again with each of these tilings of the copy kernel's mode 5, "
                        "comma-separated rROWSwWIDTHuUNROLLnWARPS[pPROGRAMS_PER_SM] (e.g. r64w8u4n8,r32w8u4n4p1; "
                        "the programs per SM default to 2); needs blocks in --ops")
    g.add_argument("--sweep", default=DEFAULT_SWEEP, metavar="PROGRAMS",
                   help="pull on a bounded grid of these many programs ('sms' = one per SM, 'all' = the "
                        "default grid); empty to skip")
    g.add_argument("--sweep-size", default="2304", metavar="BYTES", help="descriptor size of the sweep")
    g.add_argument("--seed", default="0", help="seed of the random page permutations")
    m = parser.add_argument_group("how it is measured")
    m.add_argument("--trials", default=None, metavar="N",
                   help="timed runs per row (median reported), >= 1; default 7, 2 on the emulation")
    m.add_argument("--warmup", default=None, metavar="N", help="untimed runs first, >= 0; default 2, 1 on the emulation")
    m.add_argument("--local-device", default=None, metavar="I",
                   help="device the kernels run on (default 1 when there are two devices, else 0)")
    m.add_argument("--peer-device", default=None, metavar="I",
                   help="device whose pool is pulled from / pushed to, owned by a helper process (default 0)")
    o = parser.add_argument_group("platform and output")
    add_common_arguments(o, name="kernels", timeout_help="limit on every single wait (a trial, the helper process)")


# --------------------------------------------------------------------------- rows


@dataclass
class Row:
    op: str
    desc_bytes: int | None
    descriptors: int | None
    nbytes: int
    programs: int | None
    sms: int | None
    times_s: list[float]
    ceiling_gbps: float | None
    wrong_bytes: int | None
    note: str = ""
    extra: dict = field(default_factory=dict)
    ceiling_fastest_gbps: float | None = None      # the ceiling row's fastest trial: its spread
    judged: bool = True                             # above its ceiling fails the run (not on the emulation)

    @property
    def fastest_gbps(self) -> float:
        t = min(self.times_s)
        return self.nbytes / t / 1e9 if t > 0 else float("nan")

    @property
    def excess(self) -> tuple[bool, str] | None:
        """Above its ceiling: (explained by the ceiling's spread, note); None at or below it."""
        return R.ceiling_excess(self.gbps, self.ceiling_gbps, self.ceiling_fastest_gbps, judged=self.judged)

    @property
    def time_us(self) -> float:
        return statistics.median(self.times_s) * 1e6

    @property
    def gbps(self) -> float:
        t = statistics.median(self.times_s)
        return self.nbytes / t / 1e9 if t > 0 else float("nan")

    @property
    def pct(self) -> float | None:
        return None if not self.ceiling_gbps else 100.0 * self.gbps / self.ceiling_gbps

    def as_json(self) -> dict:
        return {"op": self.op, "desc_bytes": self.desc_bytes, "descriptors": self.descriptors,
                "moved_bytes": self.nbytes, "programs": self.programs, "sms_used": self.sms,
                "time_p50_us": self.time_us, "time_min_us": min(self.times_s) * 1e6,
                "time_max_us": max(self.times_s) * 1e6, "trials": len(self.times_s),
                "bandwidth_gbps": self.gbps, "ceiling_gbps": self.ceiling_gbps, "ceiling_pct": self.pct,
                "wrong_bytes": self.wrong_bytes, "note": self.note,
                "above_ceiling": None if self.excess is None else self.excess[1],
                "above_ceiling_explained": None if self.excess is None else self.excess[0], **self.extra}


def _g(v) -> str:
    return "-" if v is None else f"{v:.1f}" if v >= 10 else f"{v:.3g}"


TABLE = R.Table([
    R.Column("op", "op", "", 8), R.Column("desc_bytes", "desc_B", "(B)", 7, R.integer),
    R.Column("descriptors", "descs", "(count)", 9, R.integer), R.Column("moved_bytes", "bytes", "(B)", 12, R.integer),
    R.Column("programs", "progs", "(count)", 8, R.integer), R.Column("sms_used", "SMs", "(count)", 8, R.integer),
    R.Column("time_p50_us", "time_us", "(us)", 11, R.fixed(1)), R.Column("bandwidth_gbps", "GB/s", "(GB/s)", 8, _g),
    R.Column("ceiling_gbps", "ceil_GB/s", "(GB/s)", 10, _g), R.Column("ceiling_pct", "%ceil", "(%)", 6, R.fixed(1)),
    R.Column("wrong_bytes", "wrong_B", "(B)", 9, R.integer),
], prefix=" ")


def _row_line(r: Row) -> str:
    above = "" if r.excess is None else f"  ABOVE CEILING: {r.excess[1]}"
    return TABLE.line(r.as_json()) + (f"  # {r.note}" if r.note else "") + above


# --------------------------------------------------------------------------- the run


def _page_table(rng, pool: int, size: int) -> np.ndarray:
    n = pool // size
    return np.stack([rng.permutation(n).astype(np.int64) * size, rng.permutation(n).astype(np.int64) * size,
                     np.full(n, size, dtype=np.int64)], 1)


#: the file a run leaves in its directory
ARTIFACT = "kernels_bench.json"


def _check(args) -> dict:
    """Every option checked in the parent, before a device or the helper process is touched."""
    from ..platforms import platform_class
    sizes = _parse_ints(args.sizes, "--sizes")
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    known = ("pull", "push", "local", "pack", "unpack", "blocks")
    bad = [o for o in ops if o not in known]
    if bad:
        raise BadInput(f"--ops: unknown {', '.join(bad)} (known: {', '.join(known)})")
    sweep = [s.strip() for s in (args.sweep or "").split(",") if s.strip()]
    for s in sweep:
        if s not in ("all", "sms") and not (s.isdigit() and int(s) > 0):
            raise BadInput(f"--sweep: expected positive integers, 'sms' or 'all', got {s!r}")
    tilings = parse_tilings(args.tilings)
    if tilings and "blocks" not in ops:
        raise BadInput("--tilings: it tiles the blocks rows; add blocks to --ops")
    c = {"sizes": sizes, "ops": ops, "sweep": sweep, "tilings": tilings,
         "pool": parse_size(args.pool, option="--pool", kind="bytes") if args.pool else None,
         "trials": int_option(args.trials, "--trials") if args.trials is not None else None,
         "warmup": int_option(args.warmup, "--warmup", minimum=0) if args.warmup is not None else None,
         "sweep_size": int_option(args.sweep_size, "--sweep-size"), "seed": int_option(args.seed, "--seed", minimum=0),
         "timeout": seconds_option(args.timeout)}
    c["platform"] = name = platform_option(args.platform)      # after the checks that need no platform
    interpreted = platform_class(name).kernels_interpreted
    for key, host, gpu in (("pool", 256 << 10, 2 << 30), ("trials", 2, 7), ("warmup", 1, 2)):
        if c[key] is None:
            c[key] = host if interpreted else gpu
    if sweep and c["sweep_size"] not in sizes:
        raise BadInput(f"--sweep-size {c['sweep_size']} is not among --sizes ({args.sizes}): the sweep runs at one "
                       "of them; add it, or --sweep '' to leave the sweep out")
    if max(sizes) > c["pool"]:
        raise BadInput(f"descriptor size {max(sizes)} is larger than the pool ({c['pool']} bytes)")
    ndev = device_count(name)
    c["local"] = (int_option(args.local_device, "--local-device", minimum=0) if args.local_device is not None
                  else (1 if ndev >= 2 else 0))
    c["peer"] = int_option(args.peer_device, "--peer-device", minimum=0) if args.peer_device is not None else 0
    for d, what in ((c["local"], "--local-device"), (c["peer"], "--peer-device")):
        if d >= ndev:
            raise BadInput(f"{what} {d}: the platform has {ndev} device(s)")
    return c


def run(args) -> int:
    try:
        c = _check(args)
        outputs = prepare_outputs("kernels", args.out, args.json, artifacts=(ARTIFACT,))
    except GpuxferError as exc:
        return error_line("gpuxfer bench kernels", exc)
    out = sys.stderr if outputs.json_stdout else sys.stdout
    try:
        return _run(c, outputs, out)
    except GpuxferError as exc:
        outputs.remove_if_empty()
        return error_line("gpuxfer bench kernels", exc)


def _run(c: dict, outputs, out) -> int:
    import torch

    from ..platforms import get_platform
    from ..kernels import launch as L
    from ..kernels.checks import check_copy
    from ..kernels.peer import PeerPools

    sizes, ops, sweep = c["sizes"], c["ops"], c["sweep"]
    plat = get_platform(c["platform"])
    started = time.time()
    try:
        emu = plat.is_emulation
        pool, trials, warmup, local, peer = c["pool"], c["trials"], c["warmup"], c["local"], c["peer"]
        plat.set_device(local)
        tdev = plat.torch_device(local)
        clock = DeviceClock(plat, local, tdev, c["timeout"])
        info_l, info_p = plat.device_info(local), plat.device_info(peer)
        _check_room(pool, info_l, info_p, one_memory=plat.host_memory or local == peer)
        link = plat.link(local, peer)
        sms = L.sm_count(tdev)

        pre = {"command": "gpuxfer bench kernels", "date": _dt.datetime.now().astimezone().isoformat(),
               "host": _pyplatform.node(), "platform": plat.name, "platform_label": plat.label,
               "emulation": emu, "versions": run_versions(plat),
               # the emulation has no SMs (doctor's count is the host's CPUs): the interpreter's programs stand in
               "local_device": {"index": local, "name": info_l.name, "arch": info_l.arch,
                                "sms": None if emu else sms, "programs_per_grid": sms},
               "peer_device": {"index": peer, "name": info_p.name, "arch": info_p.arch},
               "link": link.as_dict()}
        params = {"sizes_bytes": sizes, "pool_bytes": pool, "ops": ops, "sweep_programs": sweep,
                  "sweep_size_bytes": c["sweep_size"], "tilings": [tiling_name(t) for t in c["tilings"]],
                  "trials": trials, "warmup": warmup, "seed": c["seed"],
                  "timeout_s": c["timeout"]}
        _preamble(out, pre, params)

        rows: list[Row] = []
        p = lambda r: (setattr(r, "judged", not emu), rows.append(r),  # noqa: E731
                       print(_row_line(r), file=out, flush=True))

        bufs = [plat.alloc(pool, local) for _ in range(3)]
        try:
            with PeerPools(plat, peer, local, [pool, pool], timeout_s=c["timeout"]) as peers:
                la, lb, stage = (plat.as_tensor(b) for b in bufs)
                p_src, p_dst = peers.tensors
                peer_src_ptr, peer_dst_ptr = peers.mappings[0].ptr, peers.mappings[1].ptr
                peers.call("fill", 0, SEED)
                L.fill_pattern(la, SEED)
                clock.sync("fill")
                stream = plat.current_stream(local)
                rng = np.random.default_rng(c["seed"])
                for size in sizes:
                    table = _page_table(rng, pool, size)
                    d = torch.from_numpy(table).to(tdev)
                    n, total = table.shape[0], int(table.shape[0]) * size
                    whole = torch.tensor([[0, 0, total]], dtype=torch.int64, device=tdev)
                    ceil, fastest = {}, {}

                    def bulk(name, fn, dst_t, ceiling_of):
                        L.fill_pattern(dst_t, POISON, nbytes=total)
                        ts = clock.time(fn, name, warmup, trials)
                        w = L.verify(dst_t, whole, SEED).wrong_bytes
                        r = Row(name, None, 1, total, None, None, ts, None, w, note=f"same bytes as {size} B rows")
                        ceil[ceiling_of], fastest[ceiling_of] = r.gbps, r.fastest_gbps
                        p(r)

                    if {"pull", "blocks"} & set(ops) or (sweep and size == c["sweep_size"]):
                        bulk("ce-pull", lambda: plat.copy_async(stream, bufs[1].ptr, peer_src_ptr, total), lb, "pull")
                    if "push" in ops:
                        bulk("ce-push", lambda: plat.copy_async(stream, peer_dst_ptr, bufs[0].ptr, total), p_dst,
                             "push")
                    if {"local", "pack", "unpack"} & set(ops):
                        bulk("hbm-copy", lambda: stage[:total].copy_(la[:total]), stage, "hbm")

                    offs = L.pack_offsets(d) if {"pack", "unpack"} & set(ops) else None
                    kinds = {
                        "pull": (lambda: L.copy_descriptors(p_src, lb, d, nbytes_hint=size, validate=False),
                                 lambda: check_copy(p_src, lb, d), lb, d, "pull"),
                        "push": (lambda: L.copy_descriptors(la, p_dst, d, nbytes_hint=size, validate=False),
                                 lambda: check_copy(la, p_dst, d), p_dst, d, "push"),
                        "local": (lambda: L.copy_descriptors(la, lb, d, nbytes_hint=size, validate=False,
                                                             local=True),
                                  lambda: check_copy(la, lb, d), lb, d, "hbm"),
                        "pack": (lambda: L.pack(la, stage, d, offs, nbytes_hint=size, validate=False),
                                 lambda: L.pack(la, stage, d, offs, nbytes_hint=size), stage, None, "hbm"),
                        "unpack": (lambda: L.unpack(stage, lb, d, offs, nbytes_hint=size, validate=False),
                                   lambda: L.unpack(stage, lb, d, offs, nbytes_hint=size), lb, d, "hbm"),
                    }
                    packed = False
                    for op in ("pull", "push", "local", "pack", "unpack"):
                        if op not in ops:
                            continue
                        fn, check, dst_t, vdescs, ceiling_of = kinds[op]
                        if op == "unpack" and not packed:
                            L.pack(la, stage, d, offs, nbytes_hint=size)
                        check()     # validate once (one host sync); pack's and unpack's check moves the bytes too,
                        # so the destination is poisoned after it: the verifier sees what the timed runs wrote
                        L.fill_pattern(dst_t, POISON, nbytes=total if op == "pack" else None)
                        ts = clock.time(fn, op, warmup, trials)
                        if vdescs is None:
                            vdescs = L.packed_descriptors(d, offs)
                        w = L.verify(dst_t, vdescs, SEED).wrong_bytes
                        packed = packed or op == "pack"
                        cfg, progs = L.launch_geometry(n, tdev, nbytes_hint=size,
                                                       local=op in ("local", "pack", "unpack"))
                        p(Row(op, size, n, total, progs, None if emu else min(progs, sms), ts, ceil.get(ceiling_of), w,
                              extra={"config": cfg.__dict__}, ceiling_fastest_gbps=fastest.get(ceiling_of)))

                    if "blocks" in ops:
                        for r in _block_rows(L, plat, clock, tdev, rng, p_src, lb, pool, size, warmup, trials,
                                             ceil.get("pull"), sms, emu, c["tilings"]):
                            r.ceiling_fastest_gbps = fastest.get("pull")
                            p(r)

                    if sweep and size == c["sweep_size"]:
                        print(f"# SM budget: pull of {size} B descriptors on a bounded grid "
                              f"(<= {sms} programs: one per SM)", file=out, flush=True)
                        for s in sweep:
                            g = None if s == "all" else sms if s == "sms" else int(s)
                            cfg, progs = L.launch_geometry(n, tdev, nbytes_hint=size, num_programs=g)
                            m = n if g is None else min(n, max(g, 4) * SWEEP_DESCS_PER_PROGRAM)
                            sub = d[:m]
                            L.fill_pattern(lb, POISON)
                            fn = (lambda sub=sub, g=g: L.copy_descriptors(p_src, lb, sub, nbytes_hint=size,
                                                                          num_programs=g, validate=False))
                            check_copy(p_src, lb, sub)
                            ts = clock.time(fn, f"sweep {s}", warmup, trials)
                            w = L.verify(lb, sub, SEED).wrong_bytes
                            p(Row("sweep", size, m, m * size, progs, None if emu else min(progs, sms), ts,
                                  ceil.get("pull"), w,
                                  note="all: the default grid" if g is None else
                                  "one program per SM" if s == "sms" else "",
                                  extra={"config": cfg.__dict__}, ceiling_fastest_gbps=fastest.get("pull")))
                    del d, whole, offs
        finally:
            for b in bufs:
                b.close()
    finally:
        plat.close()

    wrong = sum(r.wrong_bytes or 0 for r in rows)
    reasons = [] if all(r.wrong_bytes is not None for r in rows) else ["a row was not verified"]
    reasons += [f"{r.op} {r.desc_bytes} B: {r.excess[1]}" for r in rows
                if r.excess is not None and r.excess[0] is False]
    verdict = R.Verdict(wrong, reasons, emulation=emu)
    elapsed = time.time() - started
    print("#", file=out)
    print(f"# rows: {len(rows)}, wrong bytes: {wrong}, elapsed: {elapsed:.1f} s", file=out)
    if emu:
        print("# EMULATION: the host platform ran the kernels in Triton's interpreter on the CPU;\n"
              "#   these numbers are not GPU performance.", file=out)
    for line in verdict.lines():
        print(line, file=out, flush=True)
    result = "PASS" if verdict.ok else "FAIL"
    doc = {"schema": "gpuxfer.kernels-bench/1", "preamble": pre, "parameters": params,
           "gbps_definition": "moved bytes (each byte once) / median trial time / 1e9",
           "rows": [r.as_json() for r in rows], "wrong_bytes": wrong, "elapsed_s": elapsed,
           "result": result, "reasons": verdict.reasons}
    outputs.publish(ARTIFACT, R.dumps(doc), out)
    return verdict.exit_code


def _check_room(pool: int, local, peer, *, one_memory: bool) -> None:
    """Three pool buffers on the local device and two on the peer's (one memory on the host emulation or one
    device): more than the free memory is a ``--pool`` error before anything is allocated."""
    check_room("--pool", pool, [(5 * pool, local)] if one_memory else [(3 * pool, local), (2 * pool, peer)])


def _block_request(rng, pool: int, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A KV request over every block of two pools of ``pool`` bytes: ``(planes, request, descriptors)``. Two planes
    of one group (the halves of a block of ``2 * size`` bytes; one plane where a pool holds one segment), the IDs
    permuted on both sides; the descriptors are those the expansion writes (plane-major, in request order)."""
    from ..kernels.blocks import request_header_len
    n_planes = 2 if pool >= 2 * size else 1
    block = n_planes * size
    nb = pool // block
    planes = np.array([[k * size, block, k * size, block, size, 0, 1, 1, nb, nb] for k in range(n_planes)],
                      dtype=np.int64)
    src_ids, dst_ids = rng.permutation(nb).astype(np.int64), rng.permutation(nb).astype(np.int64)
    head = request_header_len(n_planes, 1)
    request = np.concatenate([np.arange(n_planes + 1, dtype=np.int64) * nb, [nb, head, head + nb], src_ids,
                              dst_ids]).astype(np.int64)
    k = np.repeat(np.arange(n_planes, dtype=np.int64) * size, nb)
    descs = np.stack([k + np.tile(src_ids, n_planes) * block, k + np.tile(dst_ids, n_planes) * block,
                      np.full(n_planes * nb, size, dtype=np.int64)], 1)
    return planes, request, descs


def _block_rows(L, plat, clock, tdev, rng, p_src, lb, pool: int, size: int, warmup: int, trials: int,
                ceiling: float | None, sms: int, emu: bool, tilings=()) -> list[Row]:
    """The ``blocks`` rows: one request pulled with the expansion + descriptor copy, then with mode 5 (at its
    default tiling, then at each of ``tilings``)."""
    import torch

    from ..kernels.blocks import expand_launcher
    planes_np, req_np, descs_np = _block_request(rng, pool, size)
    n_planes, n = planes_np.shape[0], descs_np.shape[0]
    planes = torch.from_numpy(planes_np).to(tdev)
    req = torch.from_numpy(req_np).to(tdev)
    want = torch.from_numpy(descs_np).to(tdev)
    out = torch.zeros((n, 3), dtype=torch.int64, device=tdev)       # (verified through the bytes it moves)
    expand = expand_launcher(planes, req, out, n_groups=1)
    copy = L.copy_range_launcher(p_src, lb, out, req, lo_at=0, hi_at=n_planes, nbytes_hint=size)
    rows = []
    expand_ts = clock.time(expand, "expand", warmup, trials)
    runs = [("exp+copy", None, lambda: (expand(), copy()),
             {"expand_us": statistics.median(expand_ts) * 1e6, "descriptor_bytes": 24 * n})]
    for tiling in (None, *tilings):
        runs.append(("blocks", tiling, L.copy_blocks_launcher(p_src, lb, planes, req, n_groups=1, plane_lo=0,
                                                              plane_hi=n_planes, max_rows=n, nbytes_hint=size,
                                                              config=tiling), {"descriptor_bytes": 0}))
    for op, tiling, fn, extra in runs:
        cfg, progs = L.launch_geometry(n, tdev, nbytes_hint=size,
                                       config=tiling or (L.blocks_config(size) if op == "blocks" else None))
        L.fill_pattern(lb, POISON)
        ts = clock.time(fn, op, warmup, trials)
        w = L.verify(lb, want, SEED).wrong_bytes
        note = f"{n_planes} planes x {n // n_planes} blocks, pulled" + (f", tiling {tiling_name(tiling)}"
                                                                        if tiling else "")
        rows.append(Row(op, size, n, n * size, progs, None if emu else min(progs, sms), ts, ceiling, w, note=note,
                        extra={"config": cfg.__dict__, "tiling": tiling_name(cfg), **extra}))
    return rows


def _preamble(out, pre: dict, params: dict) -> None:
    def w(s: str = "") -> None:
        print("\n".join(R.wrap_comments([f"# {s}".rstrip()])), file=out)
    w(f"gpuxfer bench kernels  {pre['date']}  host {pre['host']}")
    if R.versions_line(pre["versions"]):
        print("\n".join(R.wrap_comments([R.versions_line(pre["versions"])])), file=out)
    w(f"platform: {pre['platform_label']}")
    ld, pd, lk = pre["local_device"], pre["peer_device"], pre["link"]
    sms = (f"no SMs: the interpreter's {ld['programs_per_grid']} programs stand for them" if pre["emulation"] else
           f"{ld['sms']} SMs")
    w(f"local device {ld['index']}: {ld['name']} ({ld['arch']}, {sms}) runs every kernel")
    w(f"peer device {pd['index']}: {pd['name']} ({pd['arch']}), pool owned by a helper process, opened over IPC")
    w(f"link {R.link_text(lk, detail='{}')}")
    w(f"pool {params['pool_bytes']} B per buffer; every page moves, random permutation (seed {params['seed']}); "
      f"sizes {','.join(map(str, params['sizes_bytes']))} B; ops {','.join(params['ops'])}")
    w(f"timing: {params['warmup']} warm-up + {params['trials']} timed runs, median; "
      f"{'CUDA events' if pre['platform'] == 'cuda' else 'host clock + synchronize'}; "
      "GB/s = bytes moved (each once) / time / 1e9")
    w("ceilings of this run: ce-pull/ce-push = platform.copy_async of the same bytes (copy engines); "
      "hbm-copy = torch copy_ of the same bytes on the local device")
    w("%ceil: pull and sweep vs ce-pull, push vs ce-push, local/pack/unpack vs hbm-copy; "
      "wrong_B = bytes that differ from the source pattern after the timed runs")
    if pre["emulation"]:
        w("EMULATION: no GPU is used; the kernels run in Triton's interpreter on the CPU")
    w()
    for line in TABLE.header_lines():
        print(line, file=out, flush=True)
