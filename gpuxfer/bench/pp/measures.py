"""What a rank of ``gpuxfer bench pp`` measures beside the eager step loops: the graph rows (one captured
step replayed), the ping-pong latency, the bulk peer-copy ceiling and the SM contention of a matmul loop
next to transfers; and the byte check every row runs."""
from __future__ import annotations

import contextlib
import statistics

from ..timing import now
from . import BULK_REPEATS, GRAPH, PING_SIZES, PLAIN
from .plain import _PlainP2P


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
    Rank 1 sends back what it received; rank 0 checks the last round trip's bytes after the loop. Each round
    trip carries other bytes than the ones before it (one of ``2 * recv_slots + 1`` sources, each byte
    shifted by its number), so a receiver left holding an earlier step's bytes is caught; graph replays send
    one static source, so the receive buffers are zeroed before one more, checked, replay. Host time per
    round trip beside it: where it exceeds the GPU's round trip, the loop measures the host."""
    import torch
    import torch.distributed as dist
    from ...pp.selection import connect
    peer = 1 - rank
    top = max(PING_SIZES)
    specs = {"x": ((top,), torch.uint8)}
    base = torch.randint(0, 256, (top,), dtype=torch.uint8, generator=torch.Generator().manual_seed(99)).to(tdev)
    n = 10 if plat.host_memory else opts.get("pingpong_iters") or 500
    kinds = min(255, 2 * int(opts.get("recv_slots") or 2) + 1)
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
                sources = [{"x": base[:size] + k} for k in range(kinds)]       # uint8: each byte + k mod 256
                x = sources[0]
                sent = [0]          # round trips started (rank 0 picks the source of each)
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
                            snd.send(sources[sent[0] % kinds])
                            sent[0] += 1
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
                if backend == GRAPH:        # one static source: zero what the replays write, replay once more
                    back.zero_()
                    _sync(plat, dev)
                    dist.barrier()
                    step()
                    _sync(plat, dev)
                    snd.synchronize()
                    rcv.synchronize()
                else:
                    x = sources[(sent[0] - 1) % kinds]
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
