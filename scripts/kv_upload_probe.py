"""Host time of a KV post's request upload (``copy_async`` host -> device) on CUDA, by source memory and by
what the CPU did just before, to tell a driver cost from a cache effect.

    PYTHONPATH=. python scripts/kv_upload_probe.py [--bytes 35840] [--iters 300] [--json PATH]

Rows (p50 / p90 of the call's host time, microseconds; the stream synchronised between calls,
outside the timing): ``pinned_same`` one pinned array (torch ``pin_memory``, as the agent's pool makes
them) again and again (``pinned_same_<n>B``: other sizes); ``pinned_alternate`` two of them in turn;
``pinned_rewritten`` the array rewritten by the CPU just before (as a prepare does); ``pinned_cold``
after 16 MiB of other memory was read (caches cooled); ``pageable`` a NumPy array; ``raw_driver`` the
bare ``cuMemcpyAsync`` of the pinned array (no platform Python); ``ctypes_entry`` the same through its
driver entry point, as ``Platform.stream_calls`` makes its calls; ``record_event_new`` /
``record_event_reuse`` an event per call vs one re-recorded. Non-zero exit on failure.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def _entry(drv):
    """``cuMemcpyAsync`` and ``cuEventRecord`` through their entry points (ctypes, plain integers), or None."""
    import ctypes
    c = ctypes
    out = []
    for name, args in ((b"cuMemcpyAsync", (c.c_uint64, c.c_uint64, c.c_size_t, c.c_void_p)),
                       (b"cuEventRecord", (c.c_void_p, c.c_void_p))):
        try:
            err, pfn, status = drv.cuGetProcAddress(name, 12000, 0)
        except Exception:  # noqa: BLE001 - an older cuda.bindings
            return None
        if int(err) != 0 or not pfn:
            return None
        out.append(c.CFUNCTYPE(c.c_int, *args)(int(pfn)))
    return tuple(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=35840)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch
    from gpuxfer.platforms import get_platform
    from gpuxfer.platforms.cuda_driver import _driver
    plat = get_platform()
    if plat.name != "cuda":
        print(f"needs CUDA, got {plat.name}")
        return 1
    n = args.bytes // 8
    s = plat.create_stream(0)
    dev = plat.alloc(max(args.bytes, 1 << 16), 0)
    big = plat.alloc(1 << 17, 0)
    a = torch.zeros(max(n, 1 << 14), dtype=torch.int64, pin_memory=True)
    b = torch.zeros(n, dtype=torch.int64, pin_memory=True)
    page = np.zeros(n, dtype=np.int64)
    churn = np.ones(2 << 20, dtype=np.int64)
    src = np.arange(n, dtype=np.int64)
    drv = _driver()
    rows = {}

    def timed(name, call, before=None):
        times = []
        for i in range(args.iters):
            if before is not None:
                before(i)
            t0 = time.perf_counter()
            call(i)
            times.append((time.perf_counter() - t0) * 1e6)
            plat.synchronize(s, 30)
        rows[name] = {"p50_us": float(np.median(times)), "p90_us": float(np.percentile(times, 90))}
        print(f"{name:>20}: p50 {rows[name]['p50_us']:7.2f} us  p90 {rows[name]['p90_us']:7.2f} us", flush=True)

    try:
        pa, pb = a.data_ptr(), b.data_ptr()
        an = a.numpy()[:n]
        nbytes = n * 8
        timed("pinned_same", lambda i: plat.copy_async(s, dev.ptr, pa, nbytes))
        for size in (1024, 8192, 131072):           # does the call's host time grow with the bytes?
            timed(f"pinned_same_{size}B", lambda i, size=size: plat.copy_async(s, big.ptr, pa, size))
        timed("pinned_alternate", lambda i: plat.copy_async(s, dev.ptr, pb if i % 2 else pa, nbytes))
        timed("pinned_rewritten", lambda i: plat.copy_async(s, dev.ptr, pa, nbytes),
              before=lambda i: np.copyto(an, src))
        timed("pinned_cold", lambda i: plat.copy_async(s, dev.ptr, pa, nbytes), before=lambda i: churn.sum())
        timed("pageable", lambda i: plat.copy_async(s, dev.ptr, page.ctypes.data, nbytes))
        timed("raw_driver", lambda i: drv.cuMemcpyAsync(dev.ptr, pa, nbytes, s.handle))
        timed("raw_driver_cold", lambda i: drv.cuMemcpyAsync(dev.ptr, pa, nbytes, s.handle),
              before=lambda i: churn.sum())
        entry = _entry(drv)
        if entry is not None:
            copy, record = entry
            timed("ctypes_entry", lambda i: copy(dev.ptr, pa, nbytes, s.handle))
            timed("ctypes_entry_cold", lambda i: copy(dev.ptr, pa, nbytes, s.handle), before=lambda i: churn.sum())
        keep = []
        timed("record_event_new", lambda i: keep.append(plat.record_event(s)))
        keep.clear()
        ev = plat.record_event(s)
        timed("record_event_reuse", lambda i: plat.record_event(s, ev))
        timed("event_query", lambda i: plat.event_query(ev))
        if entry is not None:
            timed("ctypes_record_reuse", lambda i: record(ev.handle, s.handle))
    finally:
        dev.close()
        big.close()
        s.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes": n * 8, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
