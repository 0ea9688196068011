"""The report of ``gpuxfer bench pp``: the speed targets met or missed, the nccl-tests-style table
(through :mod:`gpuxfer.bench.report`) and the JSON document."""
from __future__ import annotations

from .. import report as R
from ..cpus import describe
from . import (BULK_REPEATS, GRAPH, HOST_TARGET, KiB, MiB, NO_META, PACE_FLOOR_S, PING_SIZES, PLAIN,
               TARGET_BULK_FRACTION, TARGET_COMPUTE_LOSS, TARGET_HOST_US, TARGET_LATENCY_US, TARGET_SMALL_RATIO, _fmt_size)
from .measures import PACED, baseline, contention_backends


# --------------------------------------------------------------------------- report


def _targets(res: dict, backends: list) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) for the 2xH200 targets; met None where this run cannot tell.

    Rows timed under a profiler (``--profile`` / ``--trace``) are left out: the profiler's cost is in them.
    """
    rows = [r for r in res["rows"] if not r.get("instrumented")]
    out = []
    base = baseline(backends)
    for ours, metas in (("copy_engine", (False, True)), (GRAPH, (False,))):
        if ours not in backends or base is None:
            continue
        for metadata in metas:
            ratios = []
            for r in rows:
                if r["backend"] == ours and r["metadata"] == metadata and r["size_bytes"] <= MiB:
                    n = [x for x in rows if x["backend"] == base and x["size_bytes"] == r["size_bytes"]
                         and x["metadata"] == (metadata and base not in NO_META)]
                    if n:
                        ratios.append(r["time_us"] / n[0]["time_us"])
            if ratios:
                worst = max(ratios)
                out.append((f"{ours} step time <= 1/3 of {base}'s at <= 1 MiB "
                            f"({'with' if metadata else 'without'} metadata)",
                            f"worst ratio {worst:.2f}", worst <= TARGET_SMALL_RATIO))
    for ours in ("copy_engine", GRAPH):
        lat = [p["one_way_us"] for p in res.get("pingpong") or [] if p["backend"] == ours
               and p["size_bytes"] <= 64 * KiB]
        if lat:
            out.append((f"{ours} one-way step latency <= {TARGET_LATENCY_US:g} us at <= 64 KiB (ping-pong)",
                        f"worst {max(lat):.1f} us", max(lat) <= TARGET_LATENCY_US))
    bulk = {b["size_bytes"]: b["algbw_gbps"] for b in res.get("bulk") or []}
    fr = [r["algbw_gbps"] / bulk[r["size_bytes"]] for r in rows
          if r["backend"] == "copy_engine" and not r["metadata"] and r["size_bytes"] >= 64 * MiB
          and bulk.get(r["size_bytes"])]
    if fr:
        out.append(("copy_engine >= 97% of the bulk peer-copy rate at >= 64 MiB", f"worst {min(fr) * 100:.1f}%",
                    min(fr) >= TARGET_BULK_FRACTION))
    con = res.get("contention") or {}
    if "copy_engine_loss_pct" in con:
        extra = "".join(f", {b} loses {con[f'{b}_loss_pct']:.1f}%" for b in ("nccl", PLAIN)
                        if f"{b}_loss_pct" in con)
        if f"{PACED}_loss_pct" in con:
            extra += f", copy_engine at nccl's rate loses {con[f'{PACED}_loss_pct']:.1f}%"
        out.append(("matmul loses <= 1% next to copy_engine transfers",
                    f"loses {con['copy_engine_loss_pct']:.1f}%{extra}",
                    con["copy_engine_loss_pct"] <= TARGET_COMPUTE_LOSS * 100))
    return out


def _host_target(res: dict, recv_views: bool = False) -> tuple[str, str, bool] | None:
    """The eager host-time target from the paced rows (copy_engine without metadata, 16 KiB-1 MiB), judged on
    each side's p90 step (a user gets the run's slow steps too); the medians are reported beside it, and which
    receiver ran (``recv_views``: views of the slot; else the default, copied out)."""
    rows = [r for r in res["rows"] if r["backend"] == "copy_engine" and not r["metadata"]
            and 16 * KiB <= r["size_bytes"] <= MiB and not r.get("instrumented")
            and r.get("send_host_paced_us") is not None and r.get("recv_host_paced_us") is not None]
    if not rows:
        return None

    def worst(side: str) -> tuple[float, float]:
        p50 = max(r[f"{side}_host_paced_us"] for r in rows)
        p90 = max(r.get(f"{side}_host_paced_p90_us") or r[f"{side}_host_paced_us"] for r in rows)
        return p50, p90
    (s50, s90), (r50, r90) = worst("send"), worst("recv")
    how = "views of the slot, --recv-views" if recv_views else "copies out, the default"
    return (HOST_TARGET, f"worst sender {s50:.1f} us (p90 {s90:.1f}), receiver ({how}) {r50:.1f} us "
                         f"(p90 {r90:.1f})", max(s90, r90) <= TARGET_HOST_US)


def ceiling_rows(res: dict) -> list[tuple[int, float, tuple[bool, str] | None]]:
    """``(size, % of the bulk peer copy, excess)`` of each copy_engine -meta row of at least 1 MiB with a bulk
    ceiling of its size (what the report shows as % of that ceiling); ``excess`` is
    :func:`gpuxfer.bench.report.ceiling_excess` against the bulk loops' median and fastest (None: at most 100%)."""
    bulk = {b["size_bytes"]: b for b in res.get("bulk") or []}
    out = []
    for r in res["rows"]:
        b = bulk.get(r["size_bytes"])
        if r["backend"] != "copy_engine" or r["metadata"] or r["size_bytes"] < MiB or not b or not b["algbw_gbps"]:
            continue
        out.append((r["size_bytes"], r["algbw_gbps"] / b["algbw_gbps"] * 100,
                    R.ceiling_excess(r["algbw_gbps"], b["algbw_gbps"], b.get("algbw_gbps_max"),
                                     judged=not (res.get("info") or {}).get("emulation"))))
    return out


def ceiling_reasons(res: dict) -> list[str]:
    """Why the run fails for its rows above the bulk ceiling: each one above every loop of the ceiling."""
    return [f"copy_engine -meta at {_fmt_size(size)}: {x[1]}" for size, _, x in ceiling_rows(res)
            if x is not None and x[0] is False]


def _cpus(cpus) -> str:
    return "?" if not cpus else "-".join("?" if c is None else str(c) for c in cpus)


def format_report(res: dict, opts: dict) -> str:
    info, sinfo = res["info"], res["sender_info"]
    emu = info["emulation"]
    L = []
    tag = "  [EMULATION on the CPU: no GPU is used; the numbers measure Python and memmove]" if emu else ""
    L.append(f"# gpuxfer bench pp: stage hand-off, copy engines vs NCCL{tag}")
    L.append(f"# platform {info['label']}")
    if R.versions_line(info["versions"]):
        L.append(R.versions_line(info["versions"]))
    for who, i in (("sender", sinfo), ("receiver", info)):
        d = i["device_info"]
        L.append(f"# rank {i['rank']} ({who}): device {i['device']} {d['name']} ({d['arch']}, pci {d['pci_bus_id']}, "
                 f"{d['sm_count']} SMs, {d['copy_engines']} copy engines, 64-bit stream mem ops "
                 f"{'yes' if d['stream_mem_ops_64'] else 'no'}) on {i['host']}")
    lk = info["link"]
    L.append(f"# link: device {R.link_text(lk, arrow='<->')}")
    L.append(f"# tensors per step: hidden + residual (bf16, half the bytes each); warmup {opts['warmup']}, "
             f"verified steps {opts['verify_steps']} + the last timed step; iters "
             f"{opts['iters'] or 'by size'}; recv slots {opts['recv_slots']}; copy_engine steps inline (no "
             f"staging) up to {_fmt_size(opts['inline_bytes'])}"
             f"{'; copy_engine receives: views of the slot' if opts.get('recv_views') else ''}; flags: "
             f"{res['flag_paths'].get('copy_engine', '-')}; +meta: metadata over "
             f"{', '.join(sorted(set(res['meta_channels'].values()))) or '-'}")
    L.append(f"# CPUs: {describe([i.get('cpus') for i in (sinfo, info)], opts.get('cpus'))}")
    picks = [i.get("cpu_pick") for i in (sinfo, info)]
    if all(picks):
        L.append("# CPUs picked (a pure-Python yardstick, us; the same loop on the rank's other cores): "
                 + ", ".join(f"rank {r} CPU {p['cpu']} {p['python_us']:.0f} (its cores "
                             f"{min(p['candidates_python_us'].values()):.0f}-"
                             f"{max(p['candidates_python_us'].values()):.0f})" for r, p in enumerate(picks)))
    for note in opts.get("notes", ()):
        L.append(f"# {note}")
    L.append(f"# time: receiver wall clock over a pipelined loop (the sender never waits), / steps, the median "
             f"of {opts['repeats']} loop(s); algbw = bytes per step / time")
    L.append("#")
    cols = [(b, m) for b in opts["backends"] for m in ((False,) if b in NO_META else (True, False))]
    head1 = f"# {'':>10} {'':>9} " + " ".join(f"{(b + (' +meta' if m else ' -meta')):^28}" for b, m in cols)
    base = baseline(opts["backends"])
    ratio_cols = [(b, m) for b, m in cols if b in ("copy_engine", GRAPH)] if base else []
    columns = [R.Column("size", "size", "(B)", 10), R.Column("count", "count", "(elems)", 9)]
    for b, m in cols:
        columns += [R.Column((b, m, "time_us"), "time", "(us)", 9, R.fixed(2)),
                    R.Column((b, m, "algbw_gbps"), "algbw", "(GB/s)", 8, R.fixed(2)),
                    R.Column((b, m, "wrong_bytes"), "wrong", "(B)", 9, R.integer)]
    columns += [R.Column((b, m, "ratio"), ("graph" if b == GRAPH else "ce") + ("+m" if m else "-m"), "(x)", 7,
                         R.fixed(2)) for b, m in ratio_cols]
    table = R.Table(columns)
    if ratio_cols:
        head1 += " " + f"{'time / ' + base + ' time':^{8 * len(ratio_cols)}}"
    L += [head1, *table.header_lines()]
    by = {(r["backend"], r["metadata"], r["size_bytes"]): r for r in res["rows"]}
    for size in opts["sizes"]:
        cells: dict = {"size": size, "count": size // 2}
        for b, m in cols:
            r = by.get((b, m, size)) or {}
            cells.update({(b, m, k): r.get(k) for k in ("time_us", "algbw_gbps", "wrong_bytes")})
        for b, m in ratio_cols:
            a, n = by.get((b, m, size)), by.get((base, m and base not in NO_META, size))
            cells[(b, m, "ratio")] = a["time_us"] / n["time_us"] if a and n else None
        L.append(table.line(cells))
    L.append("#")
    L.append("# host time per step (us): in the sender's send() loop / in the receiver's recv() + .tensors loop "
             "(the step time is bound by the larger, unless the GPU is)")
    L.append(f"# {'size':>10} " + " ".join(f"{(b + (' +meta' if m else ' -meta')):^17}" for b, m in cols))
    for size in opts["sizes"]:
        cells = []
        for b, m in cols:
            r = by.get((b, m, size))
            h = (r.get("send_host_us"), r.get("recv_host_us")) if r else (None, None)
            cells.append(f"{h[0]:>8.1f}/{h[1]:<8.1f}" if None not in h else f"{'-':^17}")
        L.append(f"  {size:>10} " + " ".join(cells))
    for stat, key in (("the median step", "host_paced_us"), ("the p90 step", "host_paced_p90_us")):
        L.append(f"# host time per step when neither end waits for the other (us): sender / receiver, {stat} "
                 f"of a loop paced at twice the step time, at least {PACE_FLOOR_S * 1e6:g} us apart (the receiver half "
                 "an interval behind the sender)")
        for size in opts["sizes"]:
            cells = []
            for b, m in cols:
                r = by.get((b, m, size))
                h = (r.get("send_" + key), r.get("recv_" + key)) if r else (None, None)
                cells.append(f"{h[0]:>8.1f}/{h[1]:<8.1f}" if None not in h else f"{'-':^17}")
            L.append(f"  {size:>10} " + " ".join(cells))
    for b, m in cols:
        speed = []
        for size in opts["sizes"]:
            r = by.get((b, m, size))
            if r and r.get("send_host_paced_python_us") is not None and r.get("recv_host_paced_python_us") is not None:
                speed.append(f"#   {_fmt_size(size):>8}  {r['send_host_paced_python_us']:.0f}/"
                             f"{r['recv_host_paced_python_us']:.0f} us on CPUs {_cpus(r.get('send_host_paced_cpus'))}/"
                             f"{_cpus(r.get('recv_host_paced_cpus'))}"
                             + (f", sender waited for its slot in {r['send_host_paced_slot_waits_pct']:.0f}% of steps"
                                if r.get("send_host_paced_slot_waits_pct") is not None else ""))
        if speed:
            L.append(f"# paced loops' CPUs, {b} {'+' if m else '-'}meta: a pure-Python yardstick just before each "
                     "loop (sender/receiver; a slower CPU takes longer), the CPUs it started/ended on:")
            L.extend(speed)
    for r in res["rows"]:
        if r.get("instrumented"):
            L.append(f"# ({r['backend']} {'+' if r['metadata'] else '-'}meta at {_fmt_size(r['size_bytes'])} was timed "
                     f"under {r['instrumented']}: left out of the targets)")
    if res.get("bulk"):
        L.append("#")
        L.append(f"# bulk peer copy (copy_async back to back, staging -> peer slot, same run; the median of "
                 f"{BULK_REPEATS} loops, [slowest, fastest]): "
                 + ", ".join(f"{_fmt_size(b['size_bytes'])} {b['algbw_gbps']:.1f} "
                             f"[{b.get('algbw_gbps_min', b['algbw_gbps']):.1f}, "
                             f"{b.get('algbw_gbps_max', b['algbw_gbps']):.1f}] GB/s" for b in res["bulk"]
                             if b["size_bytes"] >= MiB or len(res["bulk"]) < 6))
        pct = ceiling_rows(res)
        if pct:
            L.append("# copy_engine -meta as % of that ceiling: " + ", ".join(
                f"{_fmt_size(sz)} {p:.1f}%" + ("" if x is None else " (ABOVE 100%: EMULATION, not judged)"
                                               if x[0] is None else " (ABOVE 100%: within the ceiling loops' spread)"
                                               if x[0] else " (ABOVE the ceiling's fastest loop: unexplained)")
                for sz, p, x in pct))
    pings = res.get("pingpong") or []
    if pings:
        L.append("#")
        L.append("# one-way step latency (ping-pong: rank 0 sends, rank 1 receives and sends it back; wall clock over "
                 "the round trips / 2), with each rank's host time per round trip; (us)")
        pb = list(dict.fromkeys(p["backend"] for p in pings))
        L.append(f"# {'size':>10} " + " ".join(f"{b:^26}" for b in pb))
        L.append(f"# {'(B)':>10} " + " ".join(f"{'one-way':>8} {'host r0/r1':>17}" for _ in pb))
        pby = {(p["backend"], p["size_bytes"]): p for p in pings}
        for size in PING_SIZES:
            cells = []
            for b in pb:
                p = pby.get((b, size))
                cells.append(f"{p['one_way_us']:>8.2f} {p['host_us_per_round_trip']:>8.1f}/"
                             f"{p.get('host_us_per_round_trip_rank1', float('nan')):<8.1f}" if p
                             else f"{'-':>8} {'-':>17}")
            L.append(f"  {size:>10} " + " ".join(cells))
    con = res.get("contention") or {}
    if con:
        L.append("#")
        if f"{PACED}_loss_pct" in con:
            nb = con.get("paced_to", "nccl")
            L.append(f"# SM contention at equal traffic ({con[f'{nb}_transfer_gbps']:.3g} GB/s, {nb}'s rate next "
                     f"to the matmuls): matmul throughput lost next to {nb} {con[f'{nb}_loss_pct']:.1f}% (worst "
                     f"rank {con.get(f'{nb}_worst_rank', '-')}), next to copy_engine at that rate "
                     f"{con[f'{PACED}_loss_pct']:.1f}% (worst rank {con.get(f'{PACED}_worst_rank', '-')})")
        parts = [f"alone {con['alone_tflops']:.2f} TFLOPS (spread of two runs {con['alone_spread_pct']:.1f}%)"]
        for b in [*contention_backends(opts["backends"]), PACED]:
            if f"{b}_tflops" in con:
                parts.append(f"next to {b} {con[f'{b}_tflops']:.2f} TFLOPS ({-con[f'{b}_loss_pct']:+.1f}%"
                             + (f", {b} moving {con[f'{b}_transfer_gbps']:.3g} GB/s)" if f"{b}_transfer_gbps" in con
                                else ")")
                             + ("" if con.get(f"{b}_covered", True) else ", transfers ended before the matmuls")
                             + (f", worst rank {con[f'{b}_worst_rank']}" if f"{b}_worst_rank" in con else ""))
        L.append(f"# SM contention: {con['matmuls']} matmuls {con['matmul_n']}^3 (timed by "
                 f"{con.get('matmul_clock', 'host wall clock')}), transfers of "
                 f"{_fmt_size(con['transfer_size_bytes'])} back to back: " + "; ".join(parts))
        if "loss_pct_by_rank" in con:
            L.append(f"# (the GPU of rank {con['rank']}, where copy_engine cost more; loss by rank 0 / 1: "
                     + ", ".join(f"{b} {a:.1f}% / {c:.1f}%" for b, (a, c) in con["loss_pct_by_rank"].items()
                                 if a is not None and c is not None) + ")")
    wrong = total_wrong(res)
    L.append("#")
    if res.get("same_device") and not emu:
        L.append(f"# both ranks share device {info['device']}: every step is a copy within that GPU (its "
                 "memory bandwidth, two processes' launches), not a transfer between two GPUs; the 2x H200 "
                 "targets are about a link between two GPUs and do not apply")
    for name, got, met in res["targets"]:
        verdict = ("n/a (emulation)" if emu else "n/a (one device)" if res.get("same_device") and name != HOST_TARGET
                   else "met" if met else "MISSED")
        L.append(f"# target ({'any GPU' if name == HOST_TARGET else '2x H200'}): {name}: {got}: {verdict}")
    L += R.footer_lines(wrong, res["result"], emulation=emu)
    return "\n".join(R.wrap_comments(L))


def total_wrong(res: dict) -> int:
    """Wrong bytes over every checked step: the timed rows and the ping-pong round trips."""
    return sum(r["wrong_bytes"] for r in res["rows"]) + sum(p["wrong_bytes"] for p in res.get("pingpong") or [])


def _json_doc(res: dict, opts: dict) -> dict:
    info = res["info"]
    return {
        "benchmark": "gpuxfer bench pp", "platform": info["label"], "emulation": info["emulation"],
        "versions": info["versions"], "devices": [res["sender_info"]["device_info"], info["device_info"]],
        "link": info["link"], "same_device": res.get("same_device", False), "notes": opts.get("notes", []),
        "flag_paths": res["flag_paths"], "meta_channels": res["meta_channels"],
        "params": {"sizes_bytes": opts["sizes"], "warmup_steps": opts["warmup"], "verify_steps": opts["verify_steps"],
                   "iters": opts["iters"], "repeats": opts["repeats"], "recv_slots": opts["recv_slots"],
                   "inline_bytes": opts["inline_bytes"], "backends": opts["backends"],
                   "cpus": opts.get("cpus")},
        "cpus_by_rank": [res["sender_info"].get("cpus"), info.get("cpus")],
        "cpu_pick_by_rank": [res["sender_info"].get("cpu_pick"), info.get("cpu_pick")],
        "rows": res["rows"], "bulk_copy": res["bulk"], "contention": res["contention"],
        "copy_engine_of_bulk": [{"size_bytes": size, "of_ceiling_pct": pct,
                                 "above_ceiling": None if x is None else x[1],
                                 "above_ceiling_explained": None if x is None else x[0]}
                                for size, pct, x in ceiling_rows(res)],
        "pingpong": res.get("pingpong") or [],
        "targets": [{"target": n, "measured": g, "met": m} for n, g, m in res["targets"]],
        "wrong_bytes": total_wrong(res), "result": res["result"],
    }


