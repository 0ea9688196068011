"""One rank of ``gpuxfer bench pp``: the timed step loops per backend and size (every byte of the checked
steps compared with the source), their host time paced and under a profiler; then what
:mod:`.measures` measures beside them (graph rows, ping-pong latency, bulk peer-copy ceiling, SM
contention)."""
from __future__ import annotations

import os
import platform as _pyplatform
import statistics
import sys

from ...common import run_versions
from ..report import nearest_rank
from ..timing import now
from . import GRAPH, NO_META, PACE_FLOOR_S, PACED_STEPS, PLAIN, _fmt_size
from .measures import _bulk_copy, _contention, _graph_rows, _pingpong, _sync, count_wrong_bytes
from .plain import _PlainP2P


def _rank_main(rank: int, world: int, opts: dict) -> dict:
    """One rank of the benchmark; returns what the receiver measured (rank 1) or the sender's notes."""
    import torch
    import torch.distributed as dist

    from ...platforms import get_platform
    from ...pp.selection import connect
    from ..cpus import AUTO, current_cpu, fastest_cpu, pin, pin_auto, python_speed_us
    placed = opts.get("cpus")
    if placed is not None and placed != AUTO:
        pin(placed[rank])
    if opts.get("platform"):
        os.environ["GPUXFER_PLATFORM"] = opts["platform"]
    plat = get_platform(opts.get("platform"))
    emu = plat.is_emulation
    dev = rank % plat.device_count()
    tdev = plat.torch_device(dev)
    if not plat.host_memory:
        torch.cuda.set_device(dev)
    peer = 1 - rank
    sizes = opts["sizes"]
    maxs = max(sizes)
    half = maxs // 2
    specs = {"hidden": ((half // 2,), torch.bfloat16), "residual": ((half // 2,), torch.bfloat16)}
    nver = max(1, opts["verify_steps"])
    period = source_period(nver, opts["recv_slots"])
    stride = 4096
    g = torch.Generator().manual_seed(1234)
    base = torch.randint(0, 256, (maxs + period * stride,), dtype=torch.uint8, generator=g).to(tdev)

    views: dict = {}

    def src(size: int, k: int) -> dict:
        """Step k's tensors: views of ``base`` at one of ``period`` offsets (made once: the loop times the
        transport)."""
        key = (size, k % period)
        got = views.get(key)
        if got is None:
            o, h = key[1] * stride, size // 2
            got = views[key] = {"hidden": base[o:o + h].view(torch.bfloat16),
                                "residual": base[o + h:o + size].view(torch.bfloat16)}
        return got

    def wrong_bytes(got: dict, size: int, k: int) -> int:
        if opts.get("corrupt"):        # test hook: prove a wrong byte fails the run
            got = {key: v.clone() for key, v in got.items()}
            got["hidden"].view(torch.uint8)[0] ^= 0xFF
        return count_wrong_bytes(got, src(size, k))

    device_group = None
    if plat.collective_backend == "nccl" and {"nccl", PLAIN} & set(opts["backends"]):
        device_group = dist.new_group(backend="nccl")
    dinfo = plat.device_info(dev)
    pick = part = None
    if placed == AUTO:      # the fastest of this rank's cores near its GPU, now that it is known
        part, pick = pin_auto(rank, world, None if emu else dinfo.pci_bus_id)
    info = {"rank": rank, "device": dev, "device_info": dinfo.as_dict(), "cpu_pick": pick,
            "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "link": plat.link(dev, peer % plat.device_count()).as_dict(), "versions": run_versions(plat),
            "label": plat.label, "emulation": emu, "host": _pyplatform.node()}
    rows, bulk, contention, flag_paths, meta_channels, profiles, pingpong = [], [], {}, {}, {}, [], []

    def iters_for(size: int) -> int:
        if opts["iters"]:
            return opts["iters"]
        return 10 if emu else max(20, min(400, (4 << 30) // size))

    def open_conn(backend: str, metadata: bool):
        if backend == PLAIN:
            return _PlainP2P(device_group or dist.group.WORLD, peer, specs, tdev, opts["timeout"])
        return connect(send_to=peer if rank == 0 else None, recv_from=peer if rank == 1 else None, specs=specs,
                       backend=backend, platform=plat, device=dev, metadata=metadata, timeout_s=opts["timeout"],
                       recv_slots=opts["recv_slots"], flag_path=opts["flag_path"],
                       inline_bytes=opts["inline_bytes"], device_group=device_group,
                       recv_views=opts.get("recv_views", False))

    def timed_loop(t, backend: str, size: int, first: int, n: int, metadata: bool, instrument: bool):
        """One timed pipelined loop of n steps: (the receiver's last tensors, host s, elapsed s, the
        instrument it ran under or None)."""
        prof = trace = None
        if instrument and opts.get("profile") == size:
            import cProfile
            prof = cProfile.Profile()
            prof.enable()
        if instrument and opts.get("trace") == size and not metadata and not emu:
            trace = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                       torch.profiler.ProfilerActivity.CUDA])
            trace.start()
        t0 = now()
        got = run_steps(t, size, first, n, metadata, True)
        host = now() - t0      # this rank's host time in send() / recv()
        _sync(plat, dev)
        elapsed = now() - t0
        if trace is not None:
            trace.stop()
            os.makedirs(opts["trace_dir"], exist_ok=True)
            trace.export_chrome_trace(os.path.join(opts["trace_dir"], f"pp-trace-{backend}-rank{rank}.json"))
        if prof is not None:
            prof.disable()
            profiles.append(_profile_text(prof, f"rank {rank} ({'sender' if rank == 0 else 'receiver'}), "
                                                f"{backend} {'+' if metadata else '-'}meta, {_fmt_size(size)}, "
                                                f"{n} steps", n))
        return got, host, elapsed, ("cProfile" if prof is not None else "torch.profiler" if trace is not None else None)

    def run_steps(t, size: int, first: int, n: int, metadata: bool, keep_last: bool, interval_s: float = 0.0):
        """Steps first..first+n-1; the receiver returns the last step's tensors (or None). With
        ``interval_s``, the sender starts a step at most every ``interval_s`` (paced to a rate)."""
        last = None
        if rank == 0:
            due = now()
            for k in range(first, first + n):
                while interval_s and now() < due:
                    pass
                due += interval_s
                t.send(src(size, k))
        else:
            shapes = {"hidden": (size // 4,), "residual": (size // 4,)}
            for k in range(first, first + n):
                r = t.recv() if metadata else t.recv(shapes=shapes)
                last = r.tensors
        return last if keep_last else None

    def paced_host(t, size: int, first: int, n: int, metadata: bool, step_s: float):
        """Each end's own host time per step when neither waits for the other: the median over n steps,
        the sender starting step i at a common start + i * interval (twice the step time the receiver just
        measured, at least ``PACE_FLOOR_S``), the receiver half an interval later (one host clock,
        CLOCK_MONOTONIC, on one host).
        Returns ((median, 10th, 90th percentile) s, the receiver's last tensors, the CPU speed beside it:
        a pure-Python yardstick's us just before the loop and the CPUs the loop started and ended on). With
        ``--cpus auto`` each rank first moves to the fastest of its cores again: a virtual machine's CPUs change
        speed within seconds."""
        if pick is not None:
            pin((fastest_cpu(part, passes=2)[0],))
        box = [now() + 0.01, max(2 * step_s, PACE_FLOOR_S)] if rank == 1 else [None, None]
        dist.broadcast_object_list(box, src=1)
        start, iv = box
        if rank == 1:
            start += iv / 2
        shapes = {"hidden": (size // 4,), "residual": (size // 4,)}
        per, last, clock = [], None, now
        speed = {"python_us": python_speed_us(), "cpus": [current_cpu()]}
        waits = getattr(t, "slot_waits", None) if rank == 0 else None
        for i in range(n):
            x = src(size, first + i) if rank == 0 else None
            due = start + i * iv
            while clock() < due:
                pass
            t0 = clock()
            if rank == 0:
                t.send(x)
            else:
                last = (t.recv() if metadata else t.recv(shapes=shapes)).tensors
            per.append(clock() - t0)
        speed["cpus"].append(current_cpu())
        if waits is not None:      # steps whose slot the sender did not see free on the host (a GPU wait queued)
            speed["slot_waits_pct"] = (t.slot_waits - waits) / n * 100
        return (statistics.median(per), nearest_rank(per, 0.1), nearest_rank(per, 0.9)), last, speed

    try:
        for backend in opts["backends"]:
            if backend == GRAPH:
                rows += _graph_rows(plat, dev, rank, opts, open_conn, src, wrong_bytes, iters_for)
                _progress(rank, f"{GRAPH}: {len(sizes)} sizes, "
                                f"{sum(r['wrong_bytes'] for r in rows if r['backend'] == GRAPH)} wrong bytes")
                continue
            for metadata in ((False,) if backend in NO_META else (True, False)):
                conn = open_conn(backend, metadata)
                with conn:
                    t = conn.transports[0]
                    flag_paths[backend] = getattr(t, "flags_via", None) or "-"
                    if getattr(t, "_lend_arrays", None) is not None:
                        flag_paths[backend] += " (receiver: give back + wait as one flag_ops call)"
                    if getattr(t, "_give_back", None) is not None:
                        flag_paths[backend] += " (sender's empty words in host memory)"
                    if metadata:
                        meta_channels[backend] = t.meta.what
                    k = 1
                    for size in sizes:
                        wrong = 0
                        for v in range(nver):                    # verification steps, each checked
                            got = run_steps(t, size, k, 1, metadata, True)
                            if rank == 1:
                                wrong += wrong_bytes(got, size, k)
                            k += 1
                        run_steps(t, size, k, opts["warmup"], metadata, False)
                        k += opts["warmup"]
                        _sync(plat, dev)
                        t.synchronize()
                        dist.barrier()
                        n = iters_for(size)
                        times, hosts, instrumented = [], [], None
                        for rep in range(opts["repeats"]):
                            if rep:
                                dist.barrier()
                            got, host, elapsed, how = timed_loop(t, backend, size, k, n, metadata,
                                                                 instrument=rep == 0)
                            instrumented = instrumented or how
                            t.synchronize()
                            if rank == 1:
                                wrong += wrong_bytes(got, size, k + n - 1)
                            k += n
                            times.append(elapsed)
                            hosts.append(host)
                        elapsed, host = statistics.median_high(times), statistics.median_high(hosts)
                        dist.barrier()
                        np_ = min(n, PACED_STEPS)
                        paced, got, speed = paced_host(t, size, k, np_, metadata, elapsed / n)
                        t.synchronize()
                        if rank == 1:
                            wrong += wrong_bytes(got, size, k + np_ - 1)
                        k += np_
                        rows.append({"backend": backend, "metadata": metadata, "size_bytes": size,
                                     "iters": n, "repeats": len(times), "time_us": elapsed / n * 1e6,
                                     "time_us_min": min(times) / n * 1e6, "time_us_max": max(times) / n * 1e6,
                                     "host_us": host / n * 1e6, "host_paced_us": paced[0] * 1e6,
                                     "host_paced_p10_us": paced[1] * 1e6, "host_paced_p90_us": paced[2] * 1e6,
                                     "host_paced_python_us": speed["python_us"], "host_paced_cpus": speed["cpus"],
                                     "host_paced_slot_waits_pct": speed.get("slot_waits_pct"),
                                     "algbw_gbps": size / (elapsed / n) / 1e9,
                                     "wrong_bytes": wrong,
                                     "instrumented": instrumented + " (first repeat)" if instrumented else None})
                        _progress(rank, f"{backend} {'+' if metadata else '-'}meta {_fmt_size(size)}: "
                                        f"{rows[-1]['time_us']:.1f} us per step, {wrong} wrong bytes")
                    if backend == "copy_engine" and not metadata:
                        _progress(rank, "the bulk peer-copy ceiling")
                        bulk = _bulk_copy(plat, dev, t, sizes, rank, iters_for)
                dist.barrier()
        if opts.get("pingpong", True):
            _progress(rank, "the one-way latency ping-pong")
            pingpong = _pingpong(plat, dev, tdev, rank, opts, device_group)
        if not opts["no_contention"]:
            _progress(rank, "SM contention next to a matmul loop")
            contention = _contention(plat, dev, tdev, rank, opts, open_conn, src, run_steps, rows)
    finally:
        plat.close()
    return {"info": info, "rows": rows, "bulk": bulk, "contention": contention, "flag_paths": flag_paths,
            "meta_channels": meta_channels, "profiles": profiles, "pingpong": pingpong}


def _progress(rank: int, text: str) -> None:
    """One line on stderr as the run goes, from the receiver (the report comes at the end, on stdout): a long
    run on a GPU shows it is moving, and where."""
    if rank == 1:
        print(f"# pp progress: {text}", file=sys.stderr, flush=True)


def source_period(verify_steps: int, recv_slots: int) -> int:
    """How many different sources the steps cycle through: more than the verification steps and their
    neighbours, and odd and above twice the receive slots, so that a receive slot still holding the step one
    or two turns of the slots earlier never holds the bytes the checked step was sent."""
    return max(verify_steps + 2, 2 * recv_slots + 1)


def _profile_text(prof, title: str, steps: int) -> str:
    """The host-side hot spots of one timed loop (per step), for tuning the per-step path."""
    import io
    import pstats
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(22)
    total = sum(v[2] for v in st.stats.values())
    return (f"## host profile: {title}: {total / steps * 1e6:.1f} us per step under cProfile (which inflates "
            f"it 2-3x)\n" + buf.getvalue())
