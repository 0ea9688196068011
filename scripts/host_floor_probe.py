"""The least host time a KV read and a completion poll can cost from Python on this machine, back to back ("warm")
and with the CPU's caches holding other data ("cold", as inside an engine step), and what one Python call costs
there: the floor a host-time target is judged against (a measuring aid, not a test; CUDA only).

    PYTHONPATH=. python scripts/host_floor_probe.py [--blocks 512] [--iters 200] [--flush-mb 64] [--json PATH]

Rows, p50 / p90 of each call's host time (us), warm and cold (``--flush-mb`` MiB of this process's memory written
just before each call, untimed, as ``scripts/vllm_connector_bench.py``'s flushed read loop does):

- ``floor_read``: what any read of one request must do, and nothing else: its two int64 arrays of ``--blocks``
  block IDs (as gpuxfer's connector holds them) copied into one pinned array, the array's upload, one launch of a
  captured graph (the blocks' rows gathered by the uploaded IDs), one event recorded; one Python function, the
  driver calls through their entry points (ctypes, plain integers). No check of the IDs, no bookkeeping.
- ``floor_launch``: the graph's launch alone, on an idle stream (a stage step's sender makes one such call).
- ``floor_poll``: a completion poll of one read in flight: one event query and the done set built.
- ``call_cold_us``: the cost of one call of a small Python function not run lately: a chain of 64 distinct
  functions, less an empty loop, per function.

The CPU is pinned to the fastest of its cores by a Python yardstick (printed beside the rows). Exits non-zero
where the platform is not CUDA or a gathered row came out wrong.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _entry(drv, name: bytes, *argtypes):
    err, pfn, _ = drv.cuGetProcAddress(name, 12000, 0)
    if int(err) != 0 or not pfn:
        raise RuntimeError(f"no driver entry point {name.decode()}")
    return ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(int(pfn))


def _chain(k: int):
    """k distinct small functions (own code objects) and a runner calling each once."""
    ns: dict = {}
    src = "\n".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(k))
    exec(compile(src, f"<chain{k}>", "exec"), ns)       # noqa: S102 - generated here, constant text
    fs = [ns[f"f{i}"] for i in range(k)]

    def run():
        x = 0
        for f in fs:
            x = f(x)
        return x
    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=512, help="block IDs per side of the read (default 512)")
    ap.add_argument("--iters", type=int, default=200, help="calls timed per row and state (default 200)")
    ap.add_argument("--flush-mb", type=int, default=64, help="MiB written before each cold call (default 64)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    a = ap.parse_args(argv)
    if a.blocks < 1 or a.iters < 10 or a.flush_mb < 1:
        ap.error("--blocks >= 1, --iters >= 10, --flush-mb >= 1")
    from gpuxfer.bench.cliutil import json_path_option
    from gpuxfer.errors import BadInput
    try:        # checked before the measurements: a new file in an existing, writable directory
        json_path_option(a.json)
    except BadInput as exc:
        ap.error(str(exc))
    import torch

    from gpuxfer.bench.cpus import fastest_cpu, machine_line, pin, python_speed_us
    from gpuxfer.bench.report import nearest_rank as pct
    from gpuxfer.platforms import get_platform
    from gpuxfer.platforms.cuda_driver import _driver
    plat = get_platform()
    if plat.name != "cuda":
        print(f"# host floor probe: needs CUDA, the platform is {plat.name}")
        return 1
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cpu, speed, _ = fastest_cpu(cpus) if cpus else (None, python_speed_us(), {})
    if cpu is not None:
        pin((cpu,))
    drv = _driver()
    c = ctypes
    memcpy = _entry(drv, b"cuMemcpyAsync", c.c_uint64, c.c_uint64, c.c_size_t, c.c_void_p)
    launch = _entry(drv, b"cuGraphLaunch", c.c_void_p, c.c_void_p)
    record = _entry(drv, b"cuEventRecord", c.c_void_p, c.c_void_p)
    query = _entry(drv, b"cuEventQuery", c.c_void_p)

    n, rows_bytes = a.blocks, 4096
    nblocks = max(4 * n, 1024)
    src = torch.randint(0, 255, (nblocks, rows_bytes), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    ids_dev = torch.zeros(2 * n, dtype=torch.int64, device="cuda")
    tmp = torch.empty((n, rows_bytes), dtype=torch.uint8, device="cuda")
    pinned = torch.zeros(2 * n, dtype=torch.int64, pin_memory=True)
    host, host_ptr, dev_ptr, nbytes = pinned.numpy(), pinned.data_ptr(), ids_dev.data_ptr(), 16 * n
    s = plat.create_stream(0)
    cap = plat.create_stream(0)
    torch.cuda.synchronize()

    def gather(st):
        with torch.cuda.stream(torch.cuda.ExternalStream(st.handle)):
            torch.index_select(src, 0, ids_dev[n:], out=tmp)
            dst.index_copy_(0, ids_dev[:n], tmp)
    gather(s)                   # once outside the capture: torch's kernels loaded, any workspace cached
    plat.synchronize(s, 60)
    graph = plat.capture_graph(cap, gather)
    exe, h = graph.handle, s.handle
    ev = plat.record_event(s)
    evh = ev.handle
    rng = np.random.default_rng(7)
    local = rng.permutation(nblocks)[:n].astype(np.int64)
    remote = rng.permutation(nblocks)[:n].astype(np.int64)

    def floor_read(local_ids, remote_ids):
        m = len(local_ids)
        host[:m] = local_ids
        host[m:2 * m] = remote_ids
        if memcpy(dev_ptr, host_ptr, 16 * m, h) or launch(exe, h) or record(evh, h):
            raise RuntimeError("a driver call failed")

    def floor_launch():
        if launch(exe, h):
            raise RuntimeError("cuGraphLaunch failed")

    done_names = ["req-0"]

    def floor_poll():
        return set(done_names) if query(evh) == 0 else set()

    junk = np.zeros(a.flush_mb << 17, dtype=np.int64)
    clock = time.perf_counter

    def timed(fn, cold: bool) -> list[float]:
        out = []
        for _ in range(a.iters):
            plat.synchronize(s, 60)
            if cold:
                junk.__iadd__(1)
            t0 = clock()
            fn()
            out.append((clock() - t0) * 1e6)
        plat.synchronize(s, 60)
        return out

    res: dict = {"machine": machine_line(), "cpu": cpu, "yardstick_us": speed, "blocks": n,
                 "flush_mb": a.flush_mb, "iters": a.iters, "rows": {}}
    read = lambda: floor_read(local, remote)        # noqa: E731
    for name, fn in (("floor_read", read), ("floor_launch", floor_launch), ("floor_poll", floor_poll)):
        for state in ("warm", "cold"):
            xs = timed(fn, state == "cold")
            res["rows"][f"{name}_{state}"] = {"p50_us": statistics.median(xs), "p90_us": pct(xs, 0.9)}
    ok = torch.equal(dst[torch.from_numpy(local).cuda()], src[torch.from_numpy(remote).cuda()])
    chain, empty = _chain(64), _chain(0)
    for state in ("warm", "cold"):
        with_calls = timed(chain, state == "cold")
        without = timed(empty, state == "cold")
        per = (statistics.median(with_calls) - statistics.median(without)) / 64
        per90 = (pct(with_calls, 0.9) - pct(without, 0.9)) / 64
        res["rows"][f"call_{state}"] = {"p50_us": per, "p90_us": per90}
    res["yardstick_end_us"] = python_speed_us()
    res["gathered_rows_right"] = bool(ok)
    print(f"# host floor probe: {res['machine']}; CPU {cpu} (yardstick {speed:.1f} us, at the end "
          f"{res['yardstick_end_us']:.1f}); {n} block IDs a side; cold = {a.flush_mb} MiB written before each call")
    print(f"# {'row':<18} {'p50_us':>8} {'p90_us':>8}")
    for k, v in res["rows"].items():
        print(f"  {k:<18} {v['p50_us']:8.2f} {v['p90_us']:8.2f}" + ("   (per call)" if k.startswith("call_") else ""))
    print(f"# gathered rows {'right' if ok else 'WRONG'}")
    if a.json:
        with open(a.json, "x") as fh:
            json.dump(res, fh, indent=1)
    plat.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
