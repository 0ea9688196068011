"""Host cost of the KV API per request: register, add_peer, prepare (setup), post, and post -> complete.

    PYTHONPATH=. python scripts/kv_host_costs.py [--workload kv-dsv4] [--isl 32768,524288] [--page 16,64]
        [--ops pull,push] [--engines triton,copy_engine,pack] [--launch graph,direct] [--iters 20] [--profile]
        [--cpu auto|none|N] [--batch N] [--ids host,device] [--json PATH]

A tuning aid for the KV API's host-time targets (not a test): two agents in this process, on
devices 0 and 1 (device 0 twice when only one is present), register the benchmark's layout of
``--workload`` on pools from ``Platform.alloc``, swap metadata, then per request (the seeded block
tables of a batch-1 burst) time ``prepare`` (block IDs in hand -> ready to post), ``post`` (host
time of the call), a re-post of one prepared transfer, and post -> complete (``handle.wait``); p50
and p90 of each. ``--launch``: the ``triton`` engine's posts replay each slot's graph (``graph``,
the default) or launch the slot's kernels one by one (``direct``); ``graph_used`` says whether the
platform captured one. The first prepare + post of a row (``first_*``) also makes the route's slot
(device buffers, the kernels' first load, the capture). Runs on whatever platform is present; on the
host emulation (Triton's interpreter) the defaults shrink to a small request.

``--cpu``: a host time is the time of one busy Python thread, and the CPUs of a virtual machine differ
(on the lent H200 machine half of them ran a pure-Python loop about 2x slower than the others, and
changed over time). ``auto`` (the default): before each row's timed loops (after its first prepare and
post, which compile and load the kernels) the process times a Python yardstick on each of its CPUs
(:func:`gpuxfer.bench.cpus.fastest_cpu`) and pins its thread to the fastest; ``N``: to CPU N;
``none``: the scheduler places it. Each row says where it ran (``cpu``, ``cpu_choice``) and the
yardstick there before and after its timed loops (``yardstick_us``, ``yardstick_end_us``; the
yardsticks of every CPU under ``auto``), so runs on different machines or moments compare.

``--ids device``: the ``triton`` rows again with each request's block IDs as int32 tensors on the
initiator's device (uploaded once, before the timed loops, as an engine's block table already lives
there), passed with ``device_ids=True``: checked on the device at each post, nothing on the host
proportional to the IDs (:mod:`gpuxfer.kv.device_ids`); ``ids`` in each row says which.

``--batch N`` also times N requests of one burst posted by one ``KVAgent.post_many`` (one upload and one
graph launch per route) against N ``post`` calls, each request prepared beforehand.

``--profile`` runs the prepare + post loop (and, with ``--batch``, ``post_many`` alone) under cProfile and
prints where gpuxfer's own Python time goes (driver calls show as the built-in functions they are), to tell
it apart from the driver.

``--engines pack``: the two-sided engine; both agents post every request (the destination ``pull``,
then the source ``push``, the same block IDs; ``--ops`` does not apply), each post timed on its own:
``post_p50_us`` is the slower side's median, ``post_src_p50_us`` / ``post_dst_p50_us`` each side's;
``setup_p50_us`` the source's prepare; post -> complete runs from the first post to both handles
done. Both sides prepare before either posts (a shape's first prepare loads its kernels on a GPU, which
must not wait behind a stream waiting for the other side). A shape's first post enqueues its work op by
op (``first_post_us``); its next prepare captures the graphs (``capture_posts_us``: the second and third
posts, the first replays); the medians are of the posts after those.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import numpy as np


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


class _Cpu:
    """Where a row's timed loops run (``--cpu``): :meth:`pin` before them, :meth:`release` after."""

    def __init__(self, spec: str):
        self.spec = spec
        self.all = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if spec not in ("auto", "none") and (not spec.isdigit() or int(spec) not in self.all):
            raise ValueError(f"--cpu takes auto, none or one of this process's CPUs {self.all}, got {spec!r}")
        if not self.all:
            self.spec = "none"          # no affinity calls here

    def pin(self) -> dict:
        """Pin the calling thread for the timed loops; what the row reports about it."""
        from gpuxfer.bench.cpus import current_cpu, fastest_cpu, pin, python_speed_us
        if self.spec == "auto":
            cpu, us, each = fastest_cpu(self.all)
            pin((cpu,))
            return {"cpu": cpu, "cpu_choice": f"auto: the fastest of {len(each)} by a Python yardstick",
                    "yardstick_us": us, "yardsticks_us": {str(c): round(v, 1) for c, v in each.items()}}
        if self.spec != "none":
            pin((int(self.spec),))
        return {"cpu": current_cpu(), "cpu_choice": "not pinned" if self.spec == "none" else "as named",
                "yardstick_us": python_speed_us()}

    def release(self, row: dict | None) -> None:
        """The yardstick after the timed loops (into ``row``), then the thread back on every CPU."""
        from gpuxfer.bench.cpus import pin, python_speed_us
        if row is not None:
            row["yardstick_end_us"] = python_speed_us()
        if self.spec != "none":
            pin(self.all)


def _open_agents(plat, layout, engine: str, prefix: str, agents: list, bufs: list) -> list[float]:
    """Two agents of ``engine``, on devices 0 and 1 (device 0 twice where only one is present), each with a pool
    from ``Platform.alloc`` where ``layout`` is registered; appended to ``agents`` and ``bufs`` as they are made
    (the caller closes them: :func:`_close_agents`). Returns each side's registration time (ms)."""
    from gpuxfer.kv.agent import KVAgent
    from gpuxfer.bench.kv.model.layout import layout_groups
    register_ms = []
    for i, d in enumerate((0, 1) if plat.device_count() > 1 else (0, 0)):
        bufs.append(plat.alloc(layout.pool_bytes, d))
        ag = KVAgent(f"{prefix}-{i}", platform=plat, device=d, engine=engine, timeout_s=120)
        agents.append(ag)
        t0 = time.perf_counter()
        for name, bt, layers in layout_groups(layout, plat.as_tensor(bufs[-1])):
            ag.register_group(name, bt, layers)
        register_ms.append((time.perf_counter() - t0) * 1e3)
    return register_ms


def _close_agents(agents: list, bufs: list) -> None:
    for ag in reversed(agents):
        ag.close()
    for b in bufs:
        b.close()


def measure(plat, workload: str, isl: int, page: int, op: str, engine: str, iters: int, profile: bool,
            launch: str = "graph", cpu: _Cpu | None = None, ids: str = "host") -> dict:
    from gpuxfer.bench.kv.model.blocktable import burst_tables
    from gpuxfer.bench.kv.model.layout import layout_for_burst, layout_groups

    layout = layout_for_burst(workload, isl, page, 1)
    bufs, agents, where = [], [], None
    try:
        register_ms = _open_agents(plat, layout, engine, "probe", agents, bufs)
        layers = sum(len(lay) for _, _, lay in layout_groups(layout, plat.as_tensor(bufs[0])))
        src = burst_tables(layout, isl, 1, seed=3, side="src")[0]
        dst = burst_tables(layout, isl, 1, seed=3, side="dst")[0]
        initiator = agents[1] if op == "pull" else agents[0]
        other = agents[0] if op == "pull" else agents[1]
        initiator.graphs = launch == "graph"
        t0 = time.perf_counter()
        peer = initiator.add_peer(other.metadata())
        add_peer_ms = (time.perf_counter() - t0) * 1e3
        mine, theirs = (dst, src) if op == "pull" else (src, dst)
        kw = {}
        if ids == "device":
            import torch
            dev = initiator._torch_device()
            mine, theirs = ({g: torch.as_tensor(np.asarray(v), dtype=torch.int32).to(dev) for g, v in m.items()}
                            for m in (mine, theirs))
            kw = {"device_ids": True}

        def one():
            t0 = time.perf_counter()
            x = initiator.prepare(peer, op, local_blocks=mine, remote_blocks=theirs, name="probe", **kw)
            t1 = time.perf_counter()
            h = x.post()
            t2 = time.perf_counter()
            h.wait(120)
            t3 = time.perf_counter()
            return x, (t1 - t0) * 1e6, (t2 - t1) * 1e6, (t3 - t1) * 1e6

        x, first_setup_us, first_post_us, _ = one()         # compiles / loads the kernels
        where = cpu.pin() if cpu is not None else None
        setup, post, complete = [], [], []
        for _ in range(iters):
            _, s, p, c = one()
            setup.append(s)
            post.append(p)
            complete.append(c)
        repost = []
        for _ in range(iters):
            t0 = time.perf_counter()
            h = x.post()
            repost.append((time.perf_counter() - t0) * 1e6)
            h.wait(120)
        row = {"platform": plat.name, "workload": workload, "isl_tokens": isl, "page_tokens": page, "op": op,
               "engine": engine, "ids": ids, "launch": launch if engine == "triton" else "-",
               "graph_used": bool(engine == "triton" and initiator.graphs), "slots": initiator.device_bytes()["slots"],
               "layers": layers, "descriptors": x.descriptors, "bytes": x.nbytes,
               "register_ms": max(register_ms), "add_peer_ms": add_peer_ms, "first_setup_us": first_setup_us,
               "first_post_us": first_post_us, "setup_p50_us": float(np.median(setup)),
               "post_p50_us": float(np.median(post)), "repost_p50_us": float(np.median(repost)),
               "complete_p50_us": float(np.median(complete)), "setup_p90_us": float(np.percentile(setup, 90)),
               "post_p90_us": float(np.percentile(post, 90)), "repost_p90_us": float(np.percentile(repost, 90)),
               **(where or {})}
        if profile:
            row["profile"] = _profiled(lambda: initiator.prepare(peer, op, local_blocks=mine, remote_blocks=theirs,
                                                                 **kw).post().wait(120), iters)
        if where is not None:         # the yardstick after the timed loops, and the thread back on every CPU
            where = None
            cpu.release(row)
        return row
    finally:
        if where is not None:
            cpu.release(None)
        _close_agents(agents, bufs)


def measure_batch(plat, workload: str, isl: int, page: int, op: str, batch: int, iters: int,
                  cpu: _Cpu | None = None, ids: str = "host", profile: bool = False) -> dict:
    """``batch`` requests of one burst (distinct blocks) posted by one ``post_many`` against one ``post`` each,
    the ``triton`` engine: the host time of the call(s), each request prepared beforehand."""
    from gpuxfer.bench.kv.model.blocktable import burst_tables
    from gpuxfer.bench.kv.model.layout import layout_for_burst

    layout = layout_for_burst(workload, isl, page, batch)
    bufs, agents, where = [], [], None
    try:
        _open_agents(plat, layout, "triton", "batch", agents, bufs)
        src = burst_tables(layout, isl, batch, seed=3, side="src")
        dst = burst_tables(layout, isl, batch, seed=3, side="dst")
        initiator, other = (agents[1], agents[0]) if op == "pull" else (agents[0], agents[1])
        peer = initiator.add_peer(other.metadata())
        mine, theirs = (dst, src) if op == "pull" else (src, dst)
        kw = {}
        if ids == "device":
            import torch
            dev = initiator._torch_device()
            mine, theirs = ([{g: torch.as_tensor(np.asarray(v), dtype=torch.int32).to(dev) for g, v in m.items()}
                             for m in side] for side in (mine, theirs))
            kw = {"device_ids": True}

        def prepared():
            return [initiator.prepare(peer, op, local_blocks=m, remote_blocks=t, name=f"r{k}", **kw)
                    for k, (m, t) in enumerate(zip(mine, theirs))]

        def timed(xs, many: bool) -> float:
            t0 = time.perf_counter()
            hs = initiator.post_many(xs) if many else [x.post() for x in xs]
            dt = (time.perf_counter() - t0) * 1e6
            for h in hs:
                h.wait(120)
            return dt

        timed(prepared(), True)                 # makes the slots (the merged request's size) and loads kernels
        timed(prepared(), False)
        where = cpu.pin() if cpu is not None else None
        many, single = [], []
        for _ in range(iters):
            many.append(timed(prepared(), True))
            single.append(timed(prepared(), False))
        row = {"platform": plat.name, "workload": workload, "isl_tokens": isl, "page_tokens": page, "op": op,
               "engine": "triton", "ids": ids, "batch": batch, "graph_used": bool(initiator.graphs),
               "post_many_p50_us": float(np.median(many)), "post_many_p90_us": float(np.percentile(many, 90)),
               "posts_p50_us": float(np.median(single)), "posts_p90_us": float(np.percentile(single, 90)),
               **(where or {})}
        if profile:
            pr = cProfile.Profile()
            for _ in range(iters):
                xs = prepared()
                pr.enable()
                hs = initiator.post_many(xs)
                pr.disable()
                for h in hs:
                    h.wait(120)
            row["profile"] = _stats(pr)
        if where is not None:
            where = None
            cpu.release(row)
        return row
    finally:
        if where is not None:
            cpu.release(None)
        _close_agents(agents, bufs)


def _profiled(step, iters: int) -> str:
    """``step()`` run ``iters`` times under cProfile: the 20 functions of most own time."""
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(iters):
        step()
    pr.disable()
    return _stats(pr)


def _stats(pr: cProfile.Profile) -> str:
    """The 20 functions of most own time in ``pr``."""
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(20)
    return out.getvalue()


def measure_pack(plat, workload: str, isl: int, page: int, iters: int, profile: bool, cpu: _Cpu | None = None
                 ) -> dict:
    """Both sides of the pack engine in this process: agents[0] the source, agents[1] the destination."""
    from gpuxfer.bench.kv.model.blocktable import burst_tables
    from gpuxfer.bench.kv.model.layout import layout_for_burst, layout_groups

    layout = layout_for_burst(workload, isl, page, 1)
    bufs, agents, where = [], [], None
    try:
        register_ms = _open_agents(plat, layout, "pack", "probe", agents, bufs)
        layers = sum(len(lay) for _, _, lay in layout_groups(layout, plat.as_tensor(bufs[0])))
        src = burst_tables(layout, isl, 1, seed=3, side="src")[0]
        dst = burst_tables(layout, isl, 1, seed=3, side="dst")[0]
        t0 = time.perf_counter()
        p_src = agents[0].add_peer(agents[1].metadata())
        p_dst = agents[1].add_peer(agents[0].metadata())
        add_peer_ms = (time.perf_counter() - t0) * 1e3 / 2

        def prepare():
            t0 = time.perf_counter()
            xs = agents[0].prepare(p_src, "push", local_blocks=src, remote_blocks=dst, name="probe")
            t1 = time.perf_counter()
            xd = agents[1].prepare(p_dst, "pull", local_blocks=dst, remote_blocks=src, name="probe")
            return xs, xd, (t1 - t0) * 1e6

        def post(xs, xd):
            t0 = time.perf_counter()
            hd = xd.post()
            t1 = time.perf_counter()
            hs = xs.post()
            t2 = time.perf_counter()
            hs.wait(120)
            hd.wait(120)
            t3 = time.perf_counter()
            return (t2 - t1) * 1e6, (t1 - t0) * 1e6, (t3 - t0) * 1e6

        xs, xd, first_setup_us = prepare()
        first = post(xs, xd)                           # loads the kernels: the operations one by one
        capture = [post(*prepare()[:2]) for _ in range(2)]     # after the captures (in prepare)
        where = cpu.pin() if cpu is not None else None
        setup, p_src_us, p_dst_us, complete = [], [], [], []
        for _ in range(iters):
            xs, xd, su = prepare()
            ps, pd, c = post(xs, xd)
            setup.append(su)
            p_src_us.append(ps)
            p_dst_us.append(pd)
            complete.append(c)
        repost = []
        for _ in range(iters):
            ps, pd, _ = post(xs, xd)
            repost.append(max(ps, pd))
        row = {"platform": plat.name, "workload": workload, "isl_tokens": isl, "page_tokens": page, "op": "both",
               "engine": "pack", "layers": layers, "descriptors": xs.descriptors, "bytes": xs.nbytes,
               "chunks": len(xs._chunks), "register_ms": max(register_ms), "add_peer_ms": add_peer_ms,
               "first_setup_us": first_setup_us, "first_post_us": max(first[:2]),
               "capture_posts_us": [round(max(c[:2]), 1) for c in capture],
               "setup_p50_us": float(np.median(setup)),
               "post_p50_us": max(float(np.median(p_src_us)), float(np.median(p_dst_us))),
               "post_p90_us": max(float(np.percentile(p_src_us, 90)), float(np.percentile(p_dst_us, 90))),
               "post_src_p50_us": float(np.median(p_src_us)), "post_dst_p50_us": float(np.median(p_dst_us)),
               "repost_p50_us": float(np.median(repost)), "complete_p50_us": float(np.median(complete)),
               "launch": "graph", "graph_used": all(g is not None for g in xs._shape.graphs), **(where or {})}
        if profile:
            row["profile"] = _profiled(lambda: post(*prepare()[:2]), iters)
        if where is not None:
            where = None
            cpu.release(row)
        return row
    finally:
        if where is not None:
            cpu.release(None)
        _close_agents(agents, bufs)


def main(argv=None) -> int:
    from gpuxfer.platforms import get_platform

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="kv-dsv4")
    ap.add_argument("--isl", default=None, help="input lengths (tokens), comma-separated")
    ap.add_argument("--page", default=None, help="block sizes (tokens), comma-separated")
    ap.add_argument("--ops", default="pull,push")
    ap.add_argument("--engines", default="triton")
    ap.add_argument("--launch", default="graph", help="triton posts: graph and/or direct, comma-separated")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--profile", action="store_true", help="cProfile the prepare + post loop (and post_many with --batch)")
    ap.add_argument("--cpu", default="auto", metavar="auto|none|N",
                    help="where the timed loops run: the fastest CPU by a Python yardstick (auto), CPU N, or "
                         "where the scheduler puts them (none)")
    ap.add_argument("--batch", type=int, default=0,
                    help="also time N requests posted by one post_many against N posts (triton; 0: not)")
    ap.add_argument("--ids", default="host",
                    help="triton rows with block IDs on the host and/or on the device (device_ids=True), "
                         "comma-separated")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    id_kinds = _names(args.ids)
    if not id_kinds or any(x not in ("host", "device") for x in id_kinds):
        ap.error(f"--ids takes host and/or device, got {args.ids!r}")
    if args.batch < 0 or args.batch == 1:
        ap.error("--batch takes 0 (none) or at least 2 requests")
    try:
        cpu = _Cpu(args.cpu.strip())
    except ValueError as exc:
        ap.error(str(exc))
    plat = get_platform()
    emu = plat.is_emulation
    isls = _ints(args.isl or ("256" if emu else "32768,524288"))
    pages = _ints(args.page or ("16" if emu else "16,64"))
    iters = args.iters or (3 if emu else 20)
    launches = _names(args.launch)
    if not launches or any(x not in ("graph", "direct") for x in launches):
        ap.error(f"--launch takes graph and/or direct, got {args.launch!r}")
    rows, failed = [], 0
    try:
        for engine in _names(args.engines):
            for launch in (launches if engine == "triton" else ["-"]):
                for isl in isls:
                    for page in pages:
                        for op in (["both"] if engine == "pack" else _names(args.ops)):
                            try:
                                if engine == "pack":
                                    rows.append(measure_pack(plat, args.workload, isl, page, iters, args.profile,
                                                             cpu))
                                    continue
                                for kind in (id_kinds if engine == "triton" else ["host"]):
                                    rows.append(measure(plat, args.workload, isl, page, op, engine, iters,
                                                        args.profile, launch, cpu, kind))
                            except Exception as exc:  # noqa: BLE001 - report the row and go on
                                failed += 1
                                rows.append({"workload": args.workload, "isl_tokens": isl, "page_tokens": page,
                                             "op": op, "engine": engine, "launch": launch,
                                             "error": f"{type(exc).__name__}: {exc}"})
        if args.batch:
            for isl in isls:
                for page in pages:
                    for op, kind in ((o, k) for o in _names(args.ops) for k in id_kinds):
                        try:
                            rows.append(measure_batch(plat, args.workload, isl, page, op, args.batch, iters, cpu,
                                                      kind, args.profile))
                        except Exception as exc:  # noqa: BLE001 - report the row and go on
                            failed += 1
                            rows.append({"workload": args.workload, "isl_tokens": isl, "page_tokens": page,
                                         "op": op, "engine": "triton", "batch": args.batch, "launch": "-",
                                         "error": f"{type(exc).__name__}: {exc}"})
    finally:
        plat.close()
    cols = ["engine", "ids", "launch", "graph_used", "op", "isl_tokens", "page_tokens", "descriptors", "register_ms",
            "add_peer_ms", "setup_p50_us", "post_p50_us", "post_p90_us", "repost_p50_us", "complete_p50_us",
            "first_setup_us", "first_post_us", "cpu", "yardstick_us", "yardstick_end_us"]
    print("# " + " ".join(f"{c:>14}" for c in cols))
    for r in rows:
        if "batch" in r and "error" not in r:
            print(f"# post_many of {r['batch']} {r['op']} requests ({r['isl_tokens']}/{r['page_tokens']}, "
                  f"{r['ids']} IDs): "
                  f"p50 {r['post_many_p50_us']:.1f} us, p90 {r['post_many_p90_us']:.1f} us; {r['batch']} posts: "
                  f"p50 {r['posts_p50_us']:.1f} us, p90 {r['posts_p90_us']:.1f} us")
            if "profile" in r:
                print(r.pop("profile"))
            continue
        if "error" in r:
            print(f"# {r['engine']} {r.get('launch', '-')} {r['op']} {r['isl_tokens']}/{r['page_tokens']}: "
                  f"{r['error']}")
            continue
        print("  " + " ".join(f"{r.get(c):>14.1f}" if isinstance(r.get(c), float) else f"{r.get(c, '-')!s:>14}"
                              for c in cols))
        if "profile" in r:
            print(r.pop("profile"))
    text = json.dumps({"rows": rows}, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
