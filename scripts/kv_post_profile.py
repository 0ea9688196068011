"""Python host time of the KV API's ``post()`` on the CPU: the host emulation with its stream operations
replaced by counting no-ops, so what is left is gpuxfer's own Python (no driver, no kernels run).

    PYTHONPATH=. python scripts/kv_post_profile.py [--workload kv-dsv4] [--isl 32768] [--page 16]
        [--op pull] [--iters 2000] [--ids host|device] [--flush-mb N] [--batch N] [--profile]

Two agents in this process register the benchmark's layout of ``--workload``, then three loops run:
``fresh`` (prepare, post, wait: each post a transfer just prepared, the previous one dropped, as a
benchmark or an engine does), ``repost`` (one prepared transfer posted again and again) and
``prepare`` alone. Per loop: the median and p90 host time of ``post`` (``prepare`` for the last) in
microseconds, and the platform calls a post makes, by name (averaged over the posts). Stream operations are no-ops and every event is
complete when recorded; recording makes a :class:`~gpuxfer.platforms.cuda_streams.CudaEvent` over a
spare handle, as the CUDA platform does, so the event's Python costs stay in. A tuning aid (not a test):
the numbers are this machine's Python speed; the calls per post are exact. ``--ids device``: the block IDs
as int32 tensors on the emulation's device (the CPU), prepared with ``device_ids=True``, as an engine whose
block table lives on its GPU prepares them (:mod:`gpuxfer.kv.device_ids`: the check's kernels do not run here).
``--flush-mb N``: before each timed call, untimed, write N MiB (more than the CPU's caches hold): the call then
starts on cold caches, as a load inside an engine's step does after the scheduler's and the model's work.

``--batch N``: instead of the ``fresh`` and ``repost`` loops, one loop ``manyN``: each iteration prepares ``N``
requests (untimed; each of its own blocks, so the pool holds ``N`` requests of ``--isl`` tokens: sparse host
memory, untouched) and times :meth:`KVAgent.post_many <gpuxfer.kv.agent.KVAgent.post_many>` of them, then waits
for them and drops them. Its row: p50 and p90 of a whole ``post_many``, the p50 per request, and the platform
calls per ``post_many`` (one batch of ``N`` posted untimed first, so its slot is made before the timing). Where
slots hold descriptor tables (the default ``GPUXFER_KV_COPY``), a route's batch past
:data:`~gpuxfer.kv.batch.BATCH_ROWS` descriptors is cut, and small parts of host-ID requests are posted one by
one (kv-dsv4 at 32k tokens: every request alone; device-ID parts are merged, ten posts); with
``GPUXFER_KV_COPY=blocks`` it is one post. ``--profile`` gives the cProfile
of the timed ``post_many`` calls (and of the ``prepare`` loop's calls).

``--calls``: no timing; the Python calls and C calls from Python (``sys.setprofile``) of gpuxfer's own code in one
``prepare``, one ``post`` and one ``post_many`` of ``--batch`` (default 64) and of half as many requests, the
emulated driver's apart (:func:`count_calls`; with ``--profile``, each call by name). Inside an engine's step each
call costs microseconds (cold caches), so the count is the host time's shape.
"""
from __future__ import annotations

import argparse
import cProfile
import collections
import contextlib
import io
import json
import pstats
import sys
import time

import numpy as np


def stub_platform():
    """A host emulation whose stream operations count and do nothing (events complete at once)."""
    from gpuxfer.platforms.base import StreamCalls
    from gpuxfer.platforms.cuda_streams import CudaEvent, _EventPool
    from gpuxfer.platforms.host import HostPlatform

    class StubPlatform(HostPlatform):
        calls: collections.Counter = collections.Counter()

        def __init__(self):
            super().__init__()
            self._pool = _EventPool()
            self._handles = iter(range(1 << 20, 1 << 40))

        def record_event(self, stream, event=None):
            self.calls["record_event"] += 1
            self._stream(stream)
            if type(event) is not CudaEvent:
                handle = self._pool.take(0)
                event = CudaEvent(0, next(self._handles) if handle is None else handle, self._pool)
            return event

        def event_query(self, event):
            self.calls["event_query"] += 1
            return True

        def event_wait(self, event, timeout_s):
            self.calls["event_wait"] += 1
            return True

        def stream_wait_event(self, stream, event):
            self.calls["stream_wait_event"] += 1

        def copy_async(self, stream, dst, src, nbytes):
            self.calls["copy_async"] += 1

        def memset_async(self, stream, ptr, value, nbytes):
            self.calls["memset_async"] += 1

        def launch(self, stream, fn):
            self.calls["launch"] += 1

        def launch_graph(self, stream, graph):
            self.calls["launch_graph"] += 1

        def write_flag(self, stream, ptr, value):
            self.calls["write_flag"] += 1

        def wait_flag(self, stream, ptr, value):
            self.calls["wait_flag"] += 1

        def stream_calls(self, stream):
            def graph(g):
                self.calls["launch_graph"] += 1
            return StreamCalls(stream, lambda p, v: self.write_flag(stream, p, v),
                               lambda p, v: self.wait_flag(stream, p, v), graph,
                               copy=lambda d, s_, n: self.copy_async(stream, d, s_, n))

    return StubPlatform()


@contextlib.contextmanager
def _pair(workload: str, isl: int, page: int, op: str, ids: str, n: int, int64: bool = False):
    """``(platform, initiator, peer, sides)``: two triton agents on the stub platform with ``workload``'s caches
    registered, the initiator (``op``'s decode for a pull) paired with the other, and ``n`` requests' ``(local
    blocks, remote blocks)`` of distinct blocks -- tensors for ``ids`` "device", else the tables as built (int64
    arrays where ``int64``); everything closed on exit."""
    from gpuxfer.kv.agent import KVAgent
    from gpuxfer.bench.kv.model.blocktable import burst_tables
    from gpuxfer.bench.kv.model.layout import layout_for_burst, layout_groups

    plat = stub_platform()
    layout = layout_for_burst(workload, isl, page, n)
    bufs = [plat.alloc(layout.pool_bytes, 0) for _ in (0, 1)]
    agents = []
    try:
        for i, buf in enumerate(bufs):
            ag = KVAgent(f"stub-{i}", platform=plat, device=0, engine="triton", timeout_s=60)
            agents.append(ag)
            for name, bt, layers in layout_groups(layout, plat.as_tensor(buf)):
                ag.register_group(name, bt, layers)
        initiator, other = (agents[1], agents[0]) if op == "pull" else (agents[0], agents[1])
        peer = initiator.add_peer(other.metadata())
        sides = []
        for src, dst in zip(burst_tables(layout, isl, n, seed=3, side="src"),
                            burst_tables(layout, isl, n, seed=3, side="dst")):
            mine, theirs = (dst, src) if op == "pull" else (src, dst)
            if ids == "device":
                import torch
                mine, theirs = ({g: torch.as_tensor(np.asarray(v), dtype=torch.int32) for g, v in t.items()}
                                for t in (mine, theirs))
            elif int64:
                mine, theirs = ({g: np.asarray(v, dtype=np.int64) for g, v in t.items()} for t in (mine, theirs))
            sides.append((mine, theirs))
        yield plat, initiator, peer, sides
    finally:
        for ag in reversed(agents):
            ag.close()
        for b in bufs:
            b.close()
        plat.close()


def run(workload: str, isl: int, page: int, op: str, iters: int, profile: bool, ids: str = "host",
        flush_mb: int = 0, batch: int = 0) -> dict:
    on_device = ids == "device"
    with _pair(workload, isl, page, op, ids, max(batch, 1)) as (plat, initiator, peer, sides):
        def prepare(r: int = 0):
            mine, theirs = sides[r]
            return initiator.prepare(peer, op, local_blocks=mine, remote_blocks=theirs, name=f"probe{r}",
                                     device_ids=on_device)

        prepare().post().wait(60)           # the route's slot and graph
        rows = {}
        junk = np.zeros(flush_mb << 17, dtype=np.int64)

        def flush():
            if flush_mb:
                np.add(junk, 1, out=junk)

        def batch_loop(n: int):
            # each post_many: n requests prepared beforehand (untimed), the previous batch dropped
            for h in initiator.post_many([prepare(r) for r in range(n)]):
                h.wait(60)                  # (the slot a batch of n needs, made untimed)
            times = []
            posted: collections.Counter = collections.Counter()
            pr = cProfile.Profile() if profile else None
            for _ in range(iters):
                xs = [prepare(r) for r in range(n)]
                plat.calls.clear()
                flush()
                if pr is not None:
                    pr.enable()
                t0 = time.perf_counter()
                hs = initiator.post_many(xs)
                t1 = time.perf_counter()
                if pr is not None:
                    pr.disable()
                times.append((t1 - t0) * 1e6)
                posted.update(plat.calls)
                for h in hs:
                    h.wait(60)
                del hs, xs
            rows[f"many{n}"] = {"p50_us": float(np.median(times)), "p90_us": float(np.percentile(times, 90)),
                                "per_request_p50_us": float(np.median(times)) / n,
                                "calls_per_post": {k: v / iters for k, v in sorted(posted.items())}}
            if pr is not None:
                out = io.StringIO()
                pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(40)
                rows[f"many{n}"]["profile"] = out.getvalue()

        def loop(name, fresh: bool):
            x = prepare()
            times = []
            posted: collections.Counter = collections.Counter()       # the platform calls of the posts only
            pr = cProfile.Profile() if profile else None
            for _ in range(iters):
                if fresh:
                    x = prepare()
                plat.calls.clear()
                flush()
                if pr is not None:
                    pr.enable()
                t0 = time.perf_counter()
                h = x.post()
                t1 = time.perf_counter()
                if pr is not None:
                    pr.disable()
                times.append((t1 - t0) * 1e6)
                posted.update(plat.calls)
                h.wait(60)
                del h
            rows[name] = {"p50_us": float(np.median(times)), "p90_us": float(np.percentile(times, 90)),
                          "calls_per_post": {k: v / iters for k, v in sorted(posted.items())}}
            if pr is not None:
                out = io.StringIO()
                pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(18)
                rows[name]["profile"] = out.getvalue()

        if batch:
            batch_loop(batch)
        else:
            loop("fresh", True)
            loop("repost", False)
        times = []
        pr = cProfile.Profile() if profile else None
        for _ in range(max(iters // 10, 5)):
            flush()
            if pr is not None:
                pr.enable()
            t0 = time.perf_counter()
            prepare()
            t1 = time.perf_counter()
            if pr is not None:
                pr.disable()
            times.append((t1 - t0) * 1e6)
        rows["prepare"] = {"p50_us": float(np.median(times)), "p90_us": float(np.percentile(times, 90))}
        if pr is not None:
            out = io.StringIO()
            pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(30)
            rows["prepare"]["profile"] = out.getvalue()
        return {"workload": workload, "isl_tokens": isl, "page_tokens": page, "op": op, "ids": ids,
                "flush_mb": flush_mb, "batch": batch, "rows": rows}


def _is_driver(code, _stub=[]) -> bool:
    """Whether ``code`` is the emulated driver's: the host platform's modules or :func:`stub_platform`'s methods (on
    CUDA each of their entry points is one driver call, so their Python is counted apart)."""
    if not _stub:
        import inspect
        lines, first = inspect.getsourcelines(stub_platform)
        _stub[:] = [stub_platform.__code__.co_filename, first, first + len(lines)]
    if "gpuxfer/platforms/host" in code.co_filename:
        return True
    return code.co_filename == _stub[0] and _stub[1] <= code.co_firstlineno < _stub[2]


class _CallCounter:
    """A ``sys.setprofile`` hook: ``call`` and ``c_call`` events, those under a driver frame apart (``drv_*``), and
    per (kind, name) where ``names``."""

    def __init__(self):
        self.n: collections.Counter = collections.Counter()
        self.names: collections.Counter = collections.Counter()

    def __call__(self, frame, event, arg):
        if event not in ("call", "c_call"):
            return
        f, driver = frame, False
        while f is not None and not driver:
            driver = _is_driver(f.f_code)
            f = f.f_back
        kind = ("drv_" if driver else "") + event
        self.n[kind] += 1
        code = frame.f_code
        where = f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_name}"
        self.names[(kind, where if event == "call" else f"{getattr(arg, '__qualname__', arg)} <{where}>")] += 1


def _counted(fn):
    """``(counts of fn(), its result)``: the hook's own events (the lambda called, setprofile) taken off."""
    c = _CallCounter()
    sys.setprofile(c)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    c.n["call"] -= 1
    c.n["c_call"] -= 1
    return c, out


def count_calls(workload: str, isl: int, page: int, op: str = "pull", ids: str = "host", batch: int = 64,
                names: bool = False) -> dict:
    """The Python calls (``call`` events) and C calls from Python (``c_call``) of gpuxfer's own code in one
    ``prepare``, one ``post`` of a transfer just prepared, and one ``post_many`` of ``batch`` and of ``batch // 2``
    requests (each of its own blocks), counted with ``sys.setprofile`` on this thread after warm posts of each
    shape; the emulated driver's calls apart (``drv_call``, ``drv_c_call``). Stream operations are no-ops here, so
    before each counted call the landed words of the route's slots are written as a completed folded graph
    writes them: posts take the folded path, as on a GPU. ``per_extra_request``: the difference between the two
    ``post_many`` counts per request. ``names``: each row's calls by name too."""
    on_device = ids == "device"
    with _pair(workload, isl, page, op, ids, batch, int64=True) as (plat, initiator, peer, sides):
        def prepare(r: int = 0):
            mine, theirs = sides[r]
            return initiator.prepare(peer, op, local_blocks=mine, remote_blocks=theirs, name=f"count{r}",
                                     device_ids=on_device)

        def land():
            for route in list(initiator._routes.routes.values()):
                for slot in route.slots:
                    if slot.host is not None:
                        slot.host[slot.entries + 1] = slot.seq

        def posted(fn):
            land()
            c, hs = _counted(fn)
            for h in (hs if isinstance(hs, list) else [hs]):
                h.wait(60)
            return c

        sizes = (batch, batch // 2) if batch > 1 else ()
        rows = {}
        for _ in range(3):                  # (warm: the route's slots, pooled arrays and headers of each shape)
            x = prepare()
            rows["post"] = posted(lambda: x.post())
            for n in sizes:
                xs = [prepare(r) for r in range(n)]
                rows[f"post_many{n}"] = posted(lambda: initiator.post_many(xs))
                del xs
        kept = [prepare()]
        rows["prepare"], x = _counted(prepare)
        kept.append(x)
        out = {k: {kind: c.n[kind] for kind in ("call", "c_call", "drv_call", "drv_c_call")} for k, c in rows.items()}
        if sizes:
            a, b = out[f"post_many{sizes[0]}"], out[f"post_many{sizes[1]}"]
            out["per_extra_request"] = {k: (a[k] - b[k]) / (sizes[0] - sizes[1]) for k in ("call", "c_call")}
        if names:
            for k, c in rows.items():
                out[k]["names"] = {f"{kind} {name}": v for (kind, name), v in sorted(c.names.items())}
        return {"workload": workload, "isl_tokens": isl, "page_tokens": page, "op": op, "ids": ids,
                "groups": len(sides[0][0]), "batch": batch, "calls": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="kv-dsv4")
    ap.add_argument("--isl", type=int, default=32768)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--op", default="pull", choices=("pull", "push"))
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--ids", default="host", choices=("host", "device"),
                    help="block IDs as numpy arrays (host) or as tensors checked on the device (device)")
    ap.add_argument("--flush-mb", type=int, default=0,
                    help="write this many MiB before each timed call (cold caches, as inside an engine's step)")
    ap.add_argument("--profile", action="store_true", help="cProfile the timed posts")
    ap.add_argument("--batch", type=int, default=0,
                    help="time KVAgent.post_many of this many requests prepared beforehand (instead of the post loops)")
    ap.add_argument("--calls", action="store_true",
                    help="count the Python and C calls of one prepare, post and post_many (--batch, default 64) "
                         "instead of timing (sys.setprofile; the emulated driver's apart)")
    args = ap.parse_args(argv)
    if args.calls:
        res = count_calls(args.workload, args.isl, args.page, args.op, args.ids, args.batch or 64, args.profile)
        for name, r in res["calls"].items():
            print(f"{name:>18}: " + "  ".join(f"{k} {v:g}" for k, v in r.items() if k != "names"))
            for k, v in r.get("names", {}).items():
                print(f"{'':>20}{v:4d} {k}")
        return 0
    if args.flush_mb < 0:
        ap.error("--flush-mb must be >= 0")
    if args.batch < 0:
        ap.error("--batch must be >= 0")
    res = run(args.workload, args.isl, args.page, args.op, args.iters, args.profile, args.ids, args.flush_mb, args.batch)
    for name, r in res["rows"].items():
        print(f"{name:>8}: p50 {r['p50_us']:7.2f} us  p90 {r['p90_us']:7.2f} us  {r.get('calls_per_post', '')}")
        if "profile" in r:
            print(r.pop("profile"))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
