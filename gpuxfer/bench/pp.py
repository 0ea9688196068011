"""``gpuxfer bench pp``: the stage hand-off, copy engines against NCCL in one run.

Two ranks (rank 0 sends, rank 1 receives), spawned here (or run under
``torchrun`` with ``RANK``/``WORLD_SIZE`` set). For every size from 16 KiB to
256 MiB (two bf16 tensors, ``hidden`` and ``residual``, half the bytes each) and
every configuration (copy_engine and nccl, with and without per-step metadata,
which goes through the pair's shared-memory mailbox, or over the CPU group with
``GPUXFER_PP_META_CHANNEL=group``) it times a pipelined loop of steps (the sender never waits
for the receiver; per-step time = the receiver's wall clock over the timed steps,
ended by a device synchronize) ``--repeats`` times, reporting the median loop
(the JSON keeps the fastest and slowest too), and checks every byte of
verification steps and of each loop's last step against the source (``wrong``
column, bytes).

Then, in the same run: the bulk peer-copy rate (back-to-back ``copy_async``
from the sender's staging buffer into the receiver's slot: the copy-engine
ceiling), and SM contention: a matmul loop's throughput alone, next to NCCL
transfers, next to copy-engine transfers, and next to copy-engine transfers
paced to the rate NCCL moved (equal traffic). Both ranks compute; the report is
of the rank where copy_engine cost more, with both ranks' losses beside it.

On the host emulation it runs at tiny sizes and says so everywhere: its
numbers measure Python and memmove, not a GPU. Speed targets (2x H200) are
reported as met or missed; ``--check-targets`` turns a miss into exit code 1.
Any wrong byte or error is exit code 1.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import platform as _pyplatform
import statistics
import sys

from . import report as R
from .timing import now
from .cliutil import (add_common_arguments, device_count, error_line, int_option, platform_option, prepare_outputs,
                       seconds_option)
from ..common import parse_size, run_versions
from ..errors import BadInput, GpuxferError

KiB, MiB = 1 << 10, 1 << 20
GRAPH = "copy_engine_graph"     # steps captured once, moved by graph replays (connect(graph=True))
PLAIN = "nccl_plain"            # plain torch.distributed isend / irecv: the NCCL baseline
NO_META = (GRAPH, PLAIN)        # measured without per-step metadata only
PING_SIZES = [1, 64, KiB, 4 * KiB, 16 * KiB, 64 * KiB]
BULK_REPEATS = 5                # timed loops of the bulk peer-copy ceiling, the median reported
TARGET_SMALL_RATIO = 1 / 3      # copy-engine step time vs NCCL's at <= 1 MiB
TARGET_BULK_FRACTION = 0.97     # of the bulk peer-copy rate at >= 64 MiB
TARGET_COMPUTE_LOSS = 0.01      # matmul throughput lost next to copy-engine transfers
TARGET_LATENCY_US = 10.0        # one-way step latency at <= 64 KiB
TARGET_HOST_US = 10.0           # copy_engine eager host time per side and step at 16 KiB - 1 MiB (paced)
HOST_TARGET = (f"copy_engine eager host time <= {TARGET_HOST_US:g} us per side and step at 16 KiB-1 MiB "
               f"(paced, without metadata)")
PACED_STEPS = 200               # most steps of the paced host-time loop


def _fmt_size(n: int) -> str:
    for unit, m in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if n >= m and n % m == 0:
            return f"{n // m} {unit}"
    return f"{n} B"


BACKENDS = ("copy_engine", GRAPH, "nccl", PLAIN)
#: the file a run leaves in its directory
ARTIFACT = "pp_bench.json"


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

    def __init__(self, group, peer: int, specs: dict, tdev):
        self.group, self.peer, self.tdev = group, peer, tdev
        self.names = sorted(specs)
        self.dtypes = {k: specs[k][1] for k in self.names}
        self._sent: list = []

    def send(self, tensors: dict) -> None:
        import torch.distributed as dist
        for w in self._sent:
            w.wait()
        self._sent = [dist.isend(tensors[k], dst=self.peer, group=self.group) for k in self.names]

    def recv(self, shapes: dict):
        import torch
        import torch.distributed as dist
        bufs = {k: torch.empty(shapes[k], dtype=self.dtypes[k], device=self.tdev) for k in self.names}
        return _PlainReceived(bufs, [dist.irecv(bufs[k], src=self.peer, group=self.group) for k in self.names])

    def synchronize(self) -> None:
        for w in self._sent:
            w.wait()
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
    def __init__(self, bufs: dict, works: list):
        self._bufs, self._works = bufs, works

    @property
    def tensors(self) -> dict:
        for w in self._works:
            w.wait()
        self._works = []
        return self._bufs


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

    from ..platforms import get_platform
    from ..pp.selection import connect
    if opts.get("platform"):
        os.environ["GPUXFER_PLATFORM"] = opts["platform"]
    plat = get_platform(opts.get("platform"))
    emu = plat.is_emulation
    dev = rank % plat.device_count()
    tdev = plat.torch_device(dev)
    if not emu:
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
    if not emu and {"nccl", PLAIN} & set(opts["backends"]):
        device_group = dist.new_group(backend="nccl")
    info = {"rank": rank, "device": dev, "device_info": plat.device_info(dev).as_dict(),
            "link": plat.link(dev, peer % plat.device_count()).as_dict(), "versions": run_versions(plat),
            "label": plat.label, "emulation": emu, "host": _pyplatform.node()}
    rows, bulk, contention, flag_paths, meta_channels, profiles, pingpong = [], [], {}, {}, {}, [], []

    def iters_for(size: int) -> int:
        if opts["iters"]:
            return opts["iters"]
        return 10 if emu else max(20, min(400, (4 << 30) // size))

    def open_conn(backend: str, metadata: bool):
        if backend == PLAIN:
            return _PlainP2P(device_group or dist.group.WORLD, peer, specs, tdev)
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
        Returns (median s, the receiver's last tensors)."""
        box = [now() + 0.01, max(2 * step_s, 20e-6)] if rank == 1 else [None, None]
        dist.broadcast_object_list(box, src=1)
        start, iv = box
        if rank == 1:
            start += iv / 2
        shapes = {"hidden": (size // 4,), "residual": (size // 4,)}
        per, last, clock = [], None, now
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
        return statistics.median(per), last

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
                        paced, got = paced_host(t, size, k, np_, metadata, elapsed / n)
                        t.synchronize()
                        if rank == 1:
                            wrong += wrong_bytes(got, size, k + np_ - 1)
                        k += np_
                        rows.append({"backend": backend, "metadata": metadata, "size_bytes": size,
                                     "iters": n, "repeats": len(times), "time_us": elapsed / n * 1e6,
                                     "time_us_min": min(times) / n * 1e6, "time_us_max": max(times) / n * 1e6,
                                     "host_us": host / n * 1e6, "host_paced_us": paced * 1e6,
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
    from ..pp.selection import connect
    peer = 1 - rank
    top = max(PING_SIZES)
    specs = {"x": ((top,), torch.uint8)}
    base = torch.randint(0, 256, (top,), dtype=torch.uint8, generator=torch.Generator().manual_seed(99)).to(tdev)
    n = 10 if plat.host_memory else opts.get("pingpong_iters") or 500
    rows = []
    for backend in opts["backends"]:
        if backend == PLAIN:
            conn = _PlainP2P(device_group or dist.group.WORLD, peer, specs, tdev)
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
    emu = plat.is_emulation
    n = 128 if emu else opts["matmul"]
    dtype = torch.float32 if emu else torch.bfloat16
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


def _host_target(res: dict) -> tuple[str, str, bool] | None:
    """The eager host-time target from the paced rows (copy_engine without metadata, 16 KiB-1 MiB)."""
    rows = [r for r in res["rows"] if r["backend"] == "copy_engine" and not r["metadata"]
            and 16 * KiB <= r["size_bytes"] <= MiB and not r.get("instrumented")
            and r.get("send_host_paced_us") is not None and r.get("recv_host_paced_us") is not None]
    if not rows:
        return None
    snd, rcv = max(r["send_host_paced_us"] for r in rows), max(r["recv_host_paced_us"] for r in rows)
    return HOST_TARGET, f"worst sender {snd:.1f} us, receiver {rcv:.1f} us", max(snd, rcv) <= TARGET_HOST_US


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
    L.append("# host time per step when neither end waits for the other (us): sender / receiver, the median step "
             "of a loop paced at twice the step time (the receiver half an interval behind the sender)")
    for size in opts["sizes"]:
        cells = []
        for b, m in cols:
            r = by.get((b, m, size))
            h = (r.get("send_host_paced_us"), r.get("recv_host_paced_us")) if r else (None, None)
            cells.append(f"{h[0]:>8.1f}/{h[1]:<8.1f}" if None not in h else f"{'-':^17}")
        L.append(f"  {size:>10} " + " ".join(cells))
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
        bulk = {b["size_bytes"]: b["algbw_gbps"] for b in res["bulk"]}
        pct = [(r["size_bytes"], r["algbw_gbps"] / bulk[r["size_bytes"]] * 100) for r in res["rows"]
               if r["backend"] == "copy_engine" and not r["metadata"] and bulk.get(r["size_bytes"])
               and r["size_bytes"] >= MiB]
        if pct:
            L.append("# copy_engine -meta as % of that ceiling: " + ", ".join(
                f"{_fmt_size(sz)} {p:.1f}%{' (ABOVE 100%: within the ceiling loops spread)' if p > 100 else ''}"
                for sz, p in pct))
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
    return "\n".join(L)


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
                   "inline_bytes": opts["inline_bytes"], "backends": opts["backends"]},
        "rows": res["rows"], "bulk_copy": res["bulk"], "contention": res["contention"],
        "pingpong": res.get("pingpong") or [],
        "targets": [{"target": n, "measured": g, "met": m} for n, g, m in res["targets"]],
        "wrong_bytes": total_wrong(res), "result": res["result"],
    }


def _options(args) -> dict:
    """Every option checked (and the platform resolved) in the parent: BadInput naming the option."""
    from ..platforms import platform_class
    from ..pp.copy_engine import inline_bytes_from_env

    def size(text, option: str, default: int | None) -> int | None:
        return default if text is None else parse_size(text, option=option, kind="bytes")

    checked = {"iters": 0 if args.iters is None else int_option(args.iters, "--iters"),
               "warmup": int_option(args.warmup, "--warmup", minimum=0),
               "repeats": None if args.repeats is None else int_option(args.repeats, "--repeats"),
               "verify_steps": int_option(args.verify_steps, "--verify-steps"),
               "recv_slots": int_option(args.recv_slots, "--recv-slots", minimum=2),
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
    nccls = [b for b in backends if b in ("nccl", PLAIN)]
    if ndev < 2 and not emu and nccls:
        why = f"both ranks share device 0 ({name} shows one device) and NCCL refuses two ranks on one device"
        if backends == nccls:
            raise BadInput(f"--backend {','.join(nccls)}: {why}")
        for b in nccls:
            backends.remove(b)
        opts["notes"].append(f"{' and '.join(nccls)} not measured: {why}")
    return opts


def run(args) -> int:
    from ..pp.launch import init_cpu_group
    from ..spawn import run_ranks
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    try:
        opts = _options(args)
        if torchrun and os.environ["WORLD_SIZE"] != "2":
            raise BadInput(f"runs on exactly 2 ranks; torchrun gave WORLD_SIZE={os.environ['WORLD_SIZE']}")
        reports = not torchrun or os.environ["RANK"] == "1"      # the receiver reports
        outputs = prepare_outputs("pp", args.out, args.json, artifacts=(ARTIFACT,), create=reports)
    except GpuxferError as exc:
        return error_line("gpuxfer bench pp", exc)
    opts["trace_dir"] = os.path.abspath(args.trace_dir or outputs.directory or ".")
    env = {"GPUXFER_PLATFORM": opts["platform"]}
    try:
        if torchrun:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
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
        if "host_paced_us" in r:
            r["recv_host_paced_us"] = r.pop("host_paced_us")
            r["send_host_paced_us"] = s.get("host_paced_us")
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
    host = _host_target(res)
    if host is not None:       # host costs show on one device too
        res["targets"].append(host if not res["info"]["emulation"] else host[:2] + (None,))
    missed = [t for t in res["targets"] if t[2] is False]
    verdict = R.Verdict(wrong, ["targets missed"] if args.check_targets and missed and judged and not wrong else [],
                        emulation=res["info"]["emulation"])
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
