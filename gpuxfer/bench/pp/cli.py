"""``gpuxfer bench pp``'s command line: every option checked in the parent, the two ranks spawned
(:func:`gpuxfer.spawn.run_ranks`) or run under ``torchrun``, their results gathered and reported."""
from __future__ import annotations

import argparse
import os
import sys

from ... import config
from ...common import parse_size
from ...errors import BadInput, GpuxferError
from .. import report as R
from ..cliutil import (add_common_arguments, check_room, device_count, device_infos, error_line, int_option,
                       platform_option, prepare_outputs, seconds_option)
from . import ARTIFACT, BACKENDS, GRAPH, PLAIN, KiB, MiB
from ..cpus import HELP as CPUS_HELP, rank_cpus
from .ranks import _rank_main
from .report import _host_target, _json_doc, _targets, ceiling_reasons, format_report, total_wrong


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every option is a string here, checked in the parent by :func:`_options` before a rank starts."""
    g = p.add_argument_group("what moves")
    g.add_argument("--min-size", default=None, metavar="BYTES", help="smallest step (default 16K)")
    g.add_argument("--max-size", default=None, metavar="BYTES", help="largest step (default 256M; host: 256K)")
    g.add_argument("--backend", "--backends", dest="backends", default=",".join(BACKENDS), metavar="NAMES",
                   help=f"backends to compare, comma-separated: {', '.join(BACKENDS)} ({GRAPH}: steps captured in a "
                        f"CUDA graph and replayed; {PLAIN}: plain torch.distributed isend/irecv, the baseline; the "
                        f"nccl ones need two devices)")
    m = p.add_argument_group("how it is measured")
    m.add_argument("--iters", default=None, metavar="N",
                   help="timed steps per size, >= 1 (default: by size, 20..400; host: 10)")
    m.add_argument("--warmup", default="5", metavar="N", help="untimed steps per size, >= 0")
    m.add_argument("--repeats", "--trials", dest="repeats", default=None, metavar="N",
                   help="timed loops per size and configuration, the median reported, >= 1 (default 3; host: 1)")
    m.add_argument("--verify-steps", default="3", metavar="N", help="steps per size whose every byte is checked, >= 1")
    m.add_argument("--no-pingpong", action="store_true", help="skip the one-way latency ping-pong")
    m.add_argument("--recv-views", action="store_true",
                   help="copy_engine receivers hand out views of the receive slot (no copy-out), lent until the next "
                        "step's .tensors")
    m.add_argument("--flag-path", default=None, choices=["auto", "remote", "copy"],
                   help="copy_engine flag path (default: GPUXFER_FLAG_PATH or auto)")
    m.add_argument("--cpus", default="auto", metavar="auto|none|LIST", help=CPUS_HELP)
    m.add_argument("--recv-slots", default="2", metavar="N", help="copy_engine receive slots, >= 2")
    m.add_argument("--inline-bytes", default=None, metavar="SIZE",
                   help="copy_engine steps up to SIZE go on the sender's stream without staging; 0: none "
                        "(default: $GPUXFER_PP_INLINE_BYTES or 1M)")
    m.add_argument("--contention-size", default="16M", metavar="BYTES",
                   help="step size of the transfers run next to the matmul loop")
    m.add_argument("--contention-ms", default="500", metavar="MS", help="length of the matmul loop (alone)")
    m.add_argument("--matmul", default="8192", metavar="N", help="matmul size n (n x n x n, bf16; host: 128)")
    m.add_argument("--no-contention", action="store_true", help="skip the SM contention measurement")
    m.add_argument("--check-targets", action="store_true", help="exit 1 when a speed target is missed")
    o = p.add_argument_group("platform and output")
    add_common_arguments(o, name="pp", timeout_help="limit on every single wait (a step, a CPU-group exchange); "
                                                    "a hang becomes an error")
    o.add_argument("--trace", default=None, metavar="SIZE",
                   help="record the timed loops at this size (without metadata) with torch.profiler and write a "
                        "Chrome trace per rank and backend into --trace-dir: the GPU timeline of copies and kernels")
    o.add_argument("--trace-dir", default=None, metavar="DIR", help="where --trace writes (default: the run's directory)")
    o.add_argument("--profile", default=None, metavar="SIZE",
                   help="cProfile the timed loop at this size on both ranks and print the hot spots")
    o.add_argument("--corrupt-for-test", action="store_true", help=argparse.SUPPRESS)


def _options(args) -> dict:
    """Every option checked (and the platform resolved) in the parent: BadInput naming the option."""
    from ...platforms import platform_class
    from ...pp.copy_engine import inline_bytes_from_env

    def size(text, option: str, default: int | None) -> int | None:
        return default if text is None else parse_size(text, option=option, kind="bytes")

    checked = {"iters": 0 if args.iters is None else int_option(args.iters, "--iters"),
               "warmup": int_option(args.warmup, "--warmup", minimum=0),
               "repeats": None if args.repeats is None else int_option(args.repeats, "--repeats"),
               "verify_steps": int_option(args.verify_steps, "--verify-steps"),
               "recv_slots": int_option(args.recv_slots, "--recv-slots", minimum=2),
               "cpus": rank_cpus(args.cpus, 2),
               "inline_bytes": inline_bytes_from_env(args.inline_bytes, "--inline-bytes"),
               "contention_size": size(args.contention_size, "--contention-size", None),
               "contention_ms": seconds_option(args.contention_ms, "--contention-ms"),
               "matmul": int_option(args.matmul, "--matmul"), "timeout": seconds_option(args.timeout),
               "profile": size(args.profile, "--profile", None), "trace": size(args.trace, "--trace", None)}
    lo = size(args.min_size, "--min-size", 16 * KiB)
    size(args.max_size, "--max-size", None)
    backends = [b.strip() for b in str(args.backends).split(",") if b.strip()]
    if not backends:
        raise BadInput("--backend: give at least one backend")
    for b in backends:
        if b not in BACKENDS:
            raise BadInput(f"--backend: unknown backend {b!r} (choose from {', '.join(BACKENDS)})")
    backends = list(dict.fromkeys(backends))
    name = platform_option(args.platform)       # after the checks that need no platform: a typo fails at once
    emu = platform_class(name).is_emulation
    hi = size(args.max_size, "--max-size", 256 * KiB if emu else 256 * MiB)
    if lo < 16 or hi < lo:
        raise BadInput(f"need 16 <= --min-size <= --max-size, got {lo}, {hi}")
    sizes, s = [], lo
    while s <= hi:
        sizes.append(s // 16 * 16)   # multiple of 16 bytes: two bf16 halves
        s *= 2
    opts = dict(checked, platform=name, sizes=sizes, backends=backends, flag_path=args.flag_path,
                no_contention=args.no_contention, corrupt=args.corrupt_for_test, pingpong=not args.no_pingpong,
                recv_views=args.recv_views, notes=[])
    if opts["repeats"] is None:
        opts["repeats"] = 1 if emu else 3
    if emu:
        opts["contention_ms"] = min(opts["contention_ms"], 100.0)
    # Two ranks, one device each where there are two; with one, both ranks share it: NCCL refuses that
    # (and the speed targets, about a link between two GPUs, do not apply).
    ndev = device_count(name)
    opts["same_device"] = ndev < 2
    torchrun = config.torchrun()
    _check_room(name, sizes[-1], ndev, None if torchrun is None else torchrun[0])
    nccls = [b for b in backends if b in ("nccl", PLAIN)]
    if ndev < 2 and platform_class(name).collective_backend == "nccl" and nccls:
        why = f"both ranks share device 0 ({name} shows one device) and NCCL refuses two ranks on one device"
        if backends == nccls:
            raise BadInput(f"--backend {','.join(nccls)}: {why}")
        for b in nccls:
            backends.remove(b)
        opts["notes"].append(f"{' and '.join(nccls)} not measured: {why}")
    return opts


def _check_room(name: str, largest: int, ndev: int, rank: int | None = None) -> None:
    """The least any backend holds at the largest step: the sender its source buffer, the receiver that and the
    tensors it receives into; both on device 0 where the ranks share one (or the host's memory). More than a
    device's free memory is a ``--max-size`` error before a rank starts. Under torchrun (``rank`` given) a rank
    checks its own need alone: the other rank may be allocating already."""
    from ...platforms import platform_class
    needs = (largest, 2 * largest)          # the sender's, the receiver's
    if rank is not None:
        wants = [(rank % ndev, needs[min(rank, 1)])]
    elif platform_class(name).host_memory or ndev < 2:
        wants = [(0, sum(needs))]
    else:
        wants = [(0, needs[0]), (1, needs[1])]
    infos = device_infos(name, [d for d, _ in wants])
    check_room("--max-size", largest, [(need, info) for (_, need), info in zip(wants, infos)])


def run(args) -> int:
    from ...pp.launch import init_cpu_group
    from ...spawn import run_ranks
    try:
        torchrun = config.torchrun()
        opts = _options(args)
        if torchrun and torchrun[1] != 2:
            raise BadInput(f"runs on exactly 2 ranks; torchrun gave WORLD_SIZE={torchrun[1]}")
        reports = not torchrun or torchrun[0] == 1      # the receiver reports
        outputs = prepare_outputs("pp", args.out, args.json, artifacts=(ARTIFACT,), create=reports)
    except GpuxferError as exc:
        return error_line("gpuxfer bench pp", exc)
    opts["trace_dir"] = os.path.abspath(args.trace_dir or outputs.directory or ".")
    env = {"GPUXFER_PLATFORM": opts["platform"]}
    try:
        if torchrun:
            rank, world, _ = torchrun
            os.environ.update(env)
            init_cpu_group(rank, world, "env://")
            import torch.distributed as dist
            mine = _rank_main(rank, world, opts)
            both = [None, None]
            dist.all_gather_object(both, mine)
            dist.destroy_process_group()
            if rank != 1:
                return 0
        else:
            # every wait inside is bounded by --timeout; this only catches a rank that stops reporting
            both = run_ranks(_rank_main, 2, (opts,), timeout_s=3 * opts["timeout"] + 600, env=env)
    except Exception as exc:  # noqa: BLE001 - a failed rank is a failed benchmark
        print(f"gpuxfer bench pp: FAILED: {exc}", file=sys.stderr)
        outputs.remove_if_empty()
        return 1
    res = dict(both[1])
    res["sender_info"] = both[0]["info"]
    sent = {(r["backend"], r["metadata"], r["size_bytes"]): r for r in both[0]["rows"]}
    rows = []
    for r in res["rows"]:        # the receiver's rows, with each side's host time per step
        r = dict(r)
        s = sent.get((r["backend"], r["metadata"], r["size_bytes"]), {})
        r["recv_host_us"] = r.pop("host_us")
        r["send_host_us"] = s.get("host_us")
        for key in ("host_paced_us", "host_paced_p10_us", "host_paced_p90_us", "host_paced_python_us",
                    "host_paced_cpus", "host_paced_slot_waits_pct"):
            if key in r:
                r["recv_" + key] = r.pop(key)
                r["send_" + key] = s.get(key)
        rows.append(r)
    res["rows"] = rows
    res["bulk"] = both[0]["bulk"] or both[1]["bulk"]
    cons = [both[0]["contention"], both[1]["contention"]]
    if cons[0] and cons[1]:     # each rank timed the matmuls on its own GPU: each backend's worse rank
        worse = max((0, 1), key=lambda r: cons[r].get("copy_engine_loss_pct", 0.0))
        con = dict(cons[worse], rank=worse, loss_pct_by_rank={
            k[:-len("_loss_pct")]: [c.get(k) for c in cons] for k in cons[worse] if k.endswith("_loss_pct")})
        for b, losses in con["loss_pct_by_rank"].items():
            if None not in losses:
                r = max((0, 1), key=lambda i: losses[i])
                con[f"{b}_loss_pct"], con[f"{b}_tflops"], con[f"{b}_worst_rank"] = \
                    losses[r], cons[r][f"{b}_tflops"], r
        res["contention"] = con
    p0 = both[0].get("pingpong") or []
    h1 = {(p["backend"], p["size_bytes"]): p["host_us_per_round_trip"] for p in both[1].get("pingpong") or []}
    res["pingpong"] = [dict(p, host_us_per_round_trip_rank1=h1.get((p["backend"], p["size_bytes"]))) for p in p0]
    wrong = total_wrong(res)
    res["same_device"] = _same_device(res)
    judged = not res["info"]["emulation"] and not res["same_device"]
    # a target is about a link between two GPUs: on the emulation or one device it is not judged (None)
    res["targets"] = [(n, g, m if judged else None) for n, g, m in _targets(res, opts["backends"])]
    host = _host_target(res, opts.get("recv_views", False))
    if host is not None:       # host costs show on one device too
        res["targets"].append(host if not res["info"]["emulation"] else host[:2] + (None,))
    missed = [t for t in res["targets"] if t[2] is False]
    reasons = ceiling_reasons(res)
    if args.check_targets and missed and judged and not wrong:
        reasons.append("targets missed")
    verdict = R.Verdict(wrong, reasons, emulation=res["info"]["emulation"])
    res["result"] = verdict.result
    text = sys.stderr if outputs.json_stdout else sys.stdout
    print(format_report(res, opts), file=text)
    for prof in both[0].get("profiles", []) + both[1].get("profiles", []):
        print(prof, file=text)
    outputs.publish(ARTIFACT, R.dumps(_json_doc(res, opts), indent=2), text)
    return verdict.exit_code


def _same_device(res: dict) -> bool:
    """Both ranks on one device (one GPU here): copies within it, not over a link between two."""
    a, b = res["sender_info"], res["info"]
    return a["host"] == b["host"] and a["device"] == b["device"]
