"""What each rank of ``gpuxfer bench pp`` measures: the timed step loops per backend and size (every
byte of the checked steps compared with the source), the graph rows, the ping-pong latency, the bulk
peer-copy ceiling and the SM contention of a matmul loop next to transfers."""
from __future__ import annotations

import contextlib
import os
import platform as _pyplatform
import statistics

from ...common import run_versions
from ..timing import now
from . import BULK_REPEATS, GRAPH, NO_META, PACED_STEPS, PING_SIZES, PLAIN, _fmt_size


# --------------------------------------------------------------------------- the ranks


def count_wrong_bytes(got: dict, want: dict) -> int:
    """Bytes that differ between two dicts of tensors (a missing key or a size difference counts in full)."""
    import torch
    n = 0
    for key, w in want.items():
        b = w.contiguous().view(torch.uint8).reshape(-1)
        if key not in got:
            n += b.numel()
            continue
        a = got[key].contiguous().view(torch.uint8).reshape(-1)
        m = min(a.numel(), b.numel())
        n += int((a[:m] != b[:m].to(a.device)).sum().item()) + abs(a.numel() - b.numel())
    return n


def _sync(plat, dev) -> None:
    if not plat.synchronize(plat.current_stream(dev), 120.0):
        raise RuntimeError("device synchronize timed out")


class _PlainP2P:
    """Plain ``torch.distributed`` point-to-point, the baseline a skeptic would write: ``isend`` of each of
    the step's tensors (waited on at the next step, which on NCCL makes the stream wait, not the host) and,
    per step, ``torch.empty`` + ``irecv`` of each (as vLLM's ``irecv_tensor_dict`` does). No gpuxfer code
    on the path; both directions through one object."""

    name = PLAIN

    def __init__(self, group, peer: int, specs: dict, tdev, timeout_s: float):
        import torch.distributed as dist
        self.group, self.peer, self.tdev = group, peer, tdev
        self.names = sorted(specs)
        self.dtypes = {k: specs[k][1] for k in self.names}
        self._sent: list = []
        self._bound = _WorkBound(dist.get_rank(), dist.get_backend(group) == "gloo", timeout_s)
        self._sends = self._recvs = 0

    def send(self, tensors: dict) -> None:
        import torch.distributed as dist
        self._bound.wait(self._sent, self._sends, "isend")
        self._sends += 1
        self._sent = [dist.isend(tensors[k], dst=self.peer, group=self.group) for k in self.names]

    def recv(self, shapes: dict):
        import torch
        import torch.distributed as dist
        self._recvs += 1
        bufs = {k: torch.empty(shapes[k], dtype=self.dtypes[k], device=self.tdev) for k in self.names}
        works = [dist.irecv(bufs[k], src=self.peer, group=self.group) for k in self.names]
        return _PlainReceived(bufs, works, self._bound, self._recvs)

    def synchronize(self) -> None:
        self._bound.wait(self._sent, self._sends, "isend")
        self._sent = []

    # the Connection-shaped surface the loops use
    @property
    def transports(self) -> list:
        return [self]

    def sender(self):
        return self

    def receiver(self):
        return self

    def close(self) -> None:
        self.synchronize()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _PlainReceived:
    def __init__(self, bufs: dict, works: list, bound: "_WorkBound", step: int):
        self._bufs, self._works, self._bound, self._step = bufs, works, bound, step

    @property
    def tensors(self) -> dict:
        self._bound.wait(self._works, self._step, "irecv")
        self._works = []
        return self._bufs


class _WorkBound:
    """Waits on ``torch.distributed`` works. On gloo the host blocks, so each wait is bounded by ``timeout_s``
    (:class:`~gpuxfer.errors.TransferTimeout`). On NCCL ``wait()`` makes the current stream wait and returns;
    a timeout would make the host block until the work completes and change what the baseline times, so none
    is given there: the bounded device synchronize of the loop catches a hang."""

    def __init__(self, rank: int, gloo: bool, timeout_s: float):
        self.rank, self.gloo, self.timeout_s = rank, gloo, float(timeout_s)

    def wait(self, works: list, step: int, what: str) -> None:
        from datetime import timedelta

        from ...errors import TransferTimeout
        for w in works:
            if not self.gloo:
                w.wait()
                continue
            try:
                w.wait(timeout=timedelta(seconds=self.timeout_s))
            except RuntimeError as exc:
                raise TransferTimeout(rank=self.rank, step=step, flag=what, expected=step, seen=None,
                                      timeout_s=self.timeout_s, what=f"plain torch.distributed {what} ({exc})") from None


@contextlib.contextmanager
def _capture(plat, dev):
    """A graph capture of the current stream: ``torch.cuda.graph`` on CUDA, the platform's own in emulation."""
    if plat.host_memory:
        with plat.capture(device=dev) as g:
            yield g
    else:
        import torch
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            yield g


def _rank_main(rank: int, world: int, opts: dict) -> dict:
    """One rank of the benchmark; returns what the receiver measured (rank 1) or the sender's notes."""
    import torch
    import torch.distributed as dist

    from ...platforms import get_platform
    from ...pp.selection import connect
    from ..cpus import AUTO, auto_cpus, current_cpu, gpu_local_cpus, pin, python_speed_us
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
    stride = 4096
    g = torch.Generator().manual_seed(1234)
    base = torch.randint(0, 256, (maxs + (nver + 2) * stride,), dtype=torch.uint8, generator=g).to(tdev)

    views: dict = {}

    def src(size: int, k: int) -> dict:
        """Step k's tensors: views of ``base`` at one of nver + 2 offsets (made once: the loop times the transport)."""
        key = (size, k % (nver + 2))
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
    if placed == AUTO:      # a core near this rank's GPU, now that it is known
        pin(auto_cpus(rank, world, gpu_local_cpus(None if emu else dinfo.pci_bus_id)))
    info = {"rank": rank, "device": dev, "device_info": dinfo.as_dict(),
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
        measured), the receiver half an interval later (one host clock, CLOCK_MONOTONIC, on one host).
        Returns ((median, 10th, 90th percentile) s, the receiver's last tensors, the CPU speed beside it:
        a pure-Python yardstick's us just before the loop and the CPUs the loop started and ended on)."""
        box = [now() + 0.01, max(2 * step_s, 20e-6)] if rank == 1 else [None, None]
        dist.broadcast_object_list(box, src=1)
        start, iv = box
        if rank == 1:
            start += iv / 2
        shapes = {"hidden": (size // 4,), "residual": (size // 4,)}
        per, last, clock = [], None, now
        speed = {"python_us": python_speed_us(), "cpus": [current_cpu()]}
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
        per.sort()
        return (statistics.median(per), per[len(per) // 10], per[len(per) * 9 // 10]), last, speed

    try:
        for backend in opts["backends"]:
            if backend == GRAPH:
                rows += _graph_rows(plat, dev, rank, opts, open_conn, src, wrong_bytes, iters_for)
                continue
            for metadata in ((False,) if backend in NO_META else (True, False)):
                conn = open_conn(backend, metadata)
                with conn:
                    t = conn.transports[0]
                    flag_paths[backend] = getattr(t, "flags_via", None) or "-"
                    if getattr(t, "_lend_arrays", None) is not None:
                        flag_paths[backend] += " (receiver: give back + wait as one flag_ops call)"
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
                                     "algbw_gbps": size / (elapsed / n) / 1e9,
                                     "wrong_bytes": wrong,
                                     "instrumented": instrumented + " (first repeat)" if instrumented else None})
                    if backend == "copy_engine" and not metadata:
                        bulk = _bulk_copy(plat, dev, t, sizes, rank, iters_for)
                dist.barrier()
        if opts.get("pingpong", True):
            pingpong = _pingpong(plat, dev, tdev, rank, opts, device_group)
        if not opts["no_contention"]:
            contention = _contention(plat, dev, tdev, rank, opts, open_conn, src, run_steps, rows)
    finally:
        plat.close()
    return {"info": info, "rows": rows, "bulk": bulk, "contention": contention, "flag_paths": flag_paths,
            "meta_channels": meta_channels, "profiles": profiles, "pingpong": pingpong}


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


def _graph_rows(plat, dev, rank, opts, open_conn, src, wrong_bytes, iters_for) -> list:
    """The graph mode: per size, each rank captures one step (the sender's ``send`` of a static source, the
    receiver's ``recv(out=...)`` into a static buffer) and replays it; timed like the eager loops (the
    receiver's wall clock over a pipelined loop of replays, host time = the replay calls). Verification:
    the receiver clears its buffer before each of ``verify_steps`` replays and checks every byte."""
    import torch
    import torch.distributed as dist
    rows = []
    conn = open_conn(GRAPH, False)
    with conn:
        t = conn.transports[0]
        quarter = max(opts["sizes"]) // 4
        out = None if rank == 0 else {k: torch.zeros(quarter, dtype=torch.bfloat16, device=t.torch_device)
                                      for k in ("hidden", "residual")}
        for size in opts["sizes"]:
            shapes = {"hidden": (size // 4,), "residual": (size // 4,)}
            with _capture(plat, dev) as g:
                if rank == 0:
                    t.send(src(size, 0))
                else:
                    got = t.recv(shapes=shapes, out=out).tensors
            wrong = 0
            for _ in range(max(1, opts["verify_steps"])):
                if rank == 1:
                    for x in out.values():
                        x.zero_()
                g.replay()
                _sync(plat, dev)
                if rank == 1:
                    wrong += wrong_bytes(got, size, 0)
            for _ in range(opts["warmup"]):
                g.replay()
            _sync(plat, dev)
            t.synchronize()
            n = iters_for(size)
            times, hosts = [], []
            for _ in range(opts["repeats"]):
                dist.barrier()
                t0 = now()
                for _ in range(n):
                    g.replay()
                hosts.append(now() - t0)
                _sync(plat, dev)
                times.append(now() - t0)
                t.synchronize()
            if rank == 1:
                wrong += wrong_bytes(got, size, 0)
            elapsed, host = statistics.median_high(times), statistics.median_high(hosts)
            rows.append({"backend": GRAPH, "metadata": False, "size_bytes": size, "iters": n, "repeats": len(times),
                         "time_us": elapsed / n * 1e6, "time_us_min": min(times) / n * 1e6,
                         "time_us_max": max(times) / n * 1e6, "host_us": host / n * 1e6,
                         "algbw_gbps": size / (elapsed / n) / 1e9, "wrong_bytes": wrong, "instrumented": None})
            dist.barrier()
            del g
    return rows


def _pingpong(plat, dev, tdev, rank, opts, device_group) -> list:
    """One-way step latency: rank 0 sends a step, rank 1 receives it and sends it back, ``n`` round trips
    back to back (each step's copies wait on the GPU for the previous receive), one-way = wall / 2n.
    Both directions' bytes are the same buffer's, checked on rank 0 after the loop. Host time per round
    trip beside it: where it exceeds the GPU's round trip, the loop measures the host."""
    import torch
    import torch.distributed as dist
    from ...pp.selection import connect
    peer = 1 - rank
    top = max(PING_SIZES)
    specs = {"x": ((top,), torch.uint8)}
    base = torch.randint(0, 256, (top,), dtype=torch.uint8, generator=torch.Generator().manual_seed(99)).to(tdev)
    n = 10 if plat.host_memory else opts.get("pingpong_iters") or 500
    rows = []
    for backend in opts["backends"]:
        if backend == PLAIN:
            conn = _PlainP2P(device_group or dist.group.WORLD, peer, specs, tdev, opts["timeout"])
        else:
            conn = connect(send_to=peer, recv_from=peer, specs=specs, backend=backend, platform=plat, device=dev,
                           metadata=False, timeout_s=opts["timeout"], recv_slots=opts["recv_slots"],
                           flag_path=opts["flag_path"], inline_bytes=opts["inline_bytes"], device_group=device_group,
                           recv_views=opts.get("recv_views", False))
        with conn:
            snd, rcv = conn.sender(), conn.receiver()
            for size in PING_SIZES:
                shapes = {"x": (size,)}
                x = {"x": base[:size]}
                last = {}
                if backend == GRAPH:
                    back = torch.zeros(top, dtype=torch.uint8, device=tdev)
                    with _capture(plat, dev) as g:
                        if rank == 0:
                            snd.send(x)
                            last["x"] = rcv.recv(shapes=shapes, out={"x": back}).tensors["x"]
                        else:
                            snd.send(rcv.recv(shapes=shapes, out={"x": back}).tensors)
                    step = g.replay
                else:
                    def step():
                        if rank == 0:
                            snd.send(x)
                            last["x"] = rcv.recv(shapes).tensors["x"]
                        else:
                            snd.send(rcv.recv(shapes).tensors)
                for _ in range(3):
                    step()
                _sync(plat, dev)
                dist.barrier()
                t0 = now()
                for _ in range(n):
                    step()
                host = now() - t0
                _sync(plat, dev)
                el = now() - t0
                snd.synchronize()
                rcv.synchronize()
                wrong = count_wrong_bytes({"x": last["x"]}, x) if rank == 0 else 0
                rows.append({"backend": backend, "size_bytes": size, "iters": n, "one_way_us": el / (2 * n) * 1e6,
                             "host_us_per_round_trip": host / n * 1e6, "wrong_bytes": wrong})
                dist.barrier()
    return rows


def _bulk_copy(plat, dev, t, sizes, rank, iters_for) -> list:
    """The sender copies staging -> the receiver's slot back to back (no flags): the peer-copy ceiling,
    :data:`BULK_REPEATS` timed loops per size, the median reported (and the spread)."""
    import torch.distributed as dist
    out = []
    dist.barrier()
    if rank == 0:
        side = t._aux
        for size in sizes:
            n = iters_for(size)
            for _ in range(3):
                plat.copy_async(side, t._peer_slot_ptr[0], t._staging_ptr[0], size)
            plat.synchronize(side, 120.0)
            times = []
            for _ in range(BULK_REPEATS):
                t0 = now()
                for _ in range(n):
                    plat.copy_async(side, t._peer_slot_ptr[0], t._staging_ptr[0], size)
                if not plat.synchronize(side, 120.0):
                    raise RuntimeError("bulk copy timed out")
                times.append(now() - t0)
            el = statistics.median(times)
            out.append({"size_bytes": size, "repeats": len(times), "time_us": el / n * 1e6,
                        "algbw_gbps": size / (el / n) / 1e9, "algbw_gbps_min": size / (max(times) / n) / 1e9,
                        "algbw_gbps_max": size / (min(times) / n) / 1e9})
    dist.barrier()
    got = [None, None]
    dist.all_gather_object(got, out)
    return got[0]


#: the contention line of copy_engine paced to the bytes per second nccl moved next to the matmuls
PACED = "copy_engine_at_nccl_rate"


def baseline(backends) -> str | None:
    """The NCCL line ratios are taken against: plain torch.distributed where measured, else gpuxfer's wrapper."""
    return next((b for b in (PLAIN, "nccl") if b in backends), None)


def contention_backends(backends) -> list:
    """The backends whose transfers run next to the matmul loop (graph replays are not a loop of steps here)."""
    return [b for b in backends if b != GRAPH]


def paced_to(backends) -> str | None:
    """The NCCL line the equal-traffic copy_engine line is paced to: plain NCCL where measured."""
    return baseline(backends) if "copy_engine" in backends else None


def _contention(plat, dev, tdev, rank, opts, open_conn, src, run_steps, rows) -> dict:
    """A matmul loop's throughput alone, next to NCCL transfers, next to copy-engine transfers (back to
    back, then paced to NCCL's rate, so the two are also compared at equal traffic)."""
    import torch
    import torch.distributed as dist
    cpu = plat.host_memory          # the matmuls run on the CPU: a small float32 one
    n = 128 if cpu else opts["matmul"]
    dtype = torch.float32 if cpu else torch.bfloat16
    a = torch.randn(n, n, device=tdev).to(dtype)
    b = torch.randn(n, n, device=tdev).to(dtype)
    c = torch.empty(n, n, device=tdev, dtype=dtype)
    comp = plat.create_stream(dev)

    def loop(k: int):
        def fn():
            for _ in range(k):
                torch.mm(a, b, out=c)
        return fn

    timed = getattr(comp, "torch", None) is not None     # a torch stream: time the matmuls with GPU events

    def run(k: int, transfer=None) -> tuple[float, float]:
        """(matmul time, transfer time) in seconds: k matmuls on the compute stream, ``transfer()`` meanwhile.

        The matmuls are timed on the GPU (events on the compute stream) where the
        platform has torch streams, so the host's own pace of enqueueing transfer
        steps cannot inflate them; the emulation falls back to the wall clock.
        The transfer time runs from the start to the transfer's last step done.
        """
        dist.barrier()
        t0 = now()
        if timed:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(comp.torch)
        plat.launch(comp, loop(k))
        if timed:
            end.record(comp.torch)
        ev = plat.record_event(comp)
        busy = 0.0
        if transfer is not None:
            transfer()
            _sync(plat, dev)
            busy = now() - t0
        if not plat.event_wait(ev, 300.0):
            raise RuntimeError("matmul loop timed out")
        el = now() - t0
        _sync(plat, dev)
        return (start.elapsed_time(end) / 1e3 if timed else el), busy

    # calibrate k so the loop takes about contention_ms alone (same k on both ranks)
    run(2)
    probe = run(8)[0]
    k_local = max(8, int(opts["contention_ms"] / 1e3 / (probe / 8)))
    ks = [None, None]
    dist.all_gather_object(ks, k_local)
    k = min(ks)
    flops = 2.0 * n ** 3 * k
    size = min(opts["contention_size"], max(opts["sizes"]))
    res = {"matmul_n": n, "matmuls": k, "transfer_size_bytes": size,
           "matmul_clock": "gpu events" if timed else "host wall clock"}
    alone = [run(k)[0]]

    def measure(key: str, backend: str, steps_wanted: int, interval_s: float = 0.0) -> None:
        both = [None, None]     # the receiver's numbers decide, so both ranks run the same steps
        dist.all_gather_object(both, (steps_wanted, interval_s) if rank == 1 else None)
        steps, interval_s = both[1]
        conn = open_conn(backend, False)
        with conn:
            t = conn.transports[0]
            run_steps(t, size, 1, 3, False, False)
            _sync(plat, dev)
            el, busy = run(k, lambda: run_steps(t, size, 4, steps, False, False, interval_s))
            t.synchronize()
        res[f"{key}_tflops"] = flops / el / 1e12
        res[f"{key}_steps"] = steps
        # the traffic next to the matmuls, over the longer of the two ranks' windows (they leave the barrier
        # at different times): both ranks report one rate, and the paced line's interval comes from it
        got = [None, None]
        dist.all_gather_object(got, (busy, busy >= el))
        res[f"{key}_transfer_gbps"] = steps * size / max(max(b for b, _ in got), 1e-9) / 1e9
        res[f"{key}_covered"] = all(c for _, c in got)  # the transfers must outlast the matmuls on both
        dist.barrier()

    for backend in contention_backends(opts["backends"]):
        step = [r["time_us"] for r in rows if r["backend"] == backend and not r["metadata"]
                and r["size_bytes"] == max(s for s in opts["sizes"] if s <= size)]
        step_s = (step[0] if step else 100.0) / 1e6
        measure(backend, backend, int(1.3 * alone[0] / max(step_s, 1e-6)) + 1)
    base = paced_to(opts["backends"])
    if base is not None:
        # the same traffic as the NCCL baseline moved: copy_engine steps started no faster than its rate
        res["paced_to"] = base
        interval = size / (res[f"{base}_transfer_gbps"] * 1e9)
        measure(PACED, "copy_engine", max(3, int(1.3 * alone[0] / interval) + 1), interval)
    alone.append(run(k)[0])
    res["alone_tflops"] = flops / min(alone) / 1e12
    res["alone_spread_pct"] = abs(alone[0] - alone[1]) / min(alone) * 100
    for backend in [*contention_backends(opts["backends"]), PACED]:
        if f"{backend}_tflops" in res:
            res[f"{backend}_loss_pct"] = (1 - res[f"{backend}_tflops"] / res["alone_tflops"]) * 100
    getattr(comp, "close", lambda: None)()
    return res


