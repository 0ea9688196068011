"""Finding: a local HBM copy beside a 64 MiB peer copy slows the peer copy by 13-14%; a second stream does not.

    PYTHONPATH=. python3 scripts/ce_overlap_probe.py [--size 64M] [--iters 40] [--json PATH]

A tuning aid for the stage hand-off's large-step target (>= 97% of the bulk
peer-copy rate at >= 64 MiB; not a test). A ``copy_engine`` step of that size is a
peer copy (GPU 0 -> GPU 1) with a local copy of the same size on each GPU next to
it: the sender's pack into staging and the receiver's copy-out. This probe times
``--iters`` peer copies back to back (GPU events) in each case:

- ``alone``: on one stream;
- ``two streams``: alternating between two streams of GPU 0;
- ``+ local on 0`` / ``+ local on 1`` / ``+ local on both``: with local copies of the
  same size looping on another stream of GPU 0, of GPU 1, or both, meanwhile.

One process, torch streams, peer access on (``copy_`` between the GPUs).
"""
from __future__ import annotations

import argparse
import json


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().rstrip("B").rstrip("I")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=_size, default=64 << 20, help="bytes per copy (default 64M)")
    ap.add_argument("--iters", type=int, default=40, help="peer copies per case")
    ap.add_argument("--repeats", type=int, default=3, help="times each case runs (interleaved)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs two GPUs")
    n, size = args.iters, args.size
    src = torch.empty(size, dtype=torch.uint8, device="cuda:0").fill_(1)
    dst = torch.empty(size, dtype=torch.uint8, device="cuda:1")
    loc = {d: (torch.empty(size, dtype=torch.uint8, device=f"cuda:{d}").fill_(2),
               torch.empty(size, dtype=torch.uint8, device=f"cuda:{d}")) for d in (0, 1)}
    peer = [torch.cuda.Stream(device=0), torch.cuda.Stream(device=0)]
    side = {d: torch.cuda.Stream(device=d) for d in (0, 1)}
    dst.copy_(src)          # enables peer access, warms up
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)

    def case(streams: int, local_on: tuple) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(0):
            start.record(peer[0])
        for s in peer[1:streams]:
            s.wait_event(start)
        for d in local_on:      # about as many local copies as fit in the peer copies' time (~6x faster)
            side[d].wait_event(start)
            with torch.cuda.stream(side[d]):
                for _ in range(n * 4):
                    loc[d][1].copy_(loc[d][0], non_blocking=True)
        for i in range(n):
            with torch.cuda.stream(peer[i % streams]):
                dst.copy_(src, non_blocking=True)
        for s in peer[1:streams]:
            peer[0].wait_stream(s)
        with torch.cuda.device(0):
            end.record(peer[0])
        end.synchronize()
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        return start.elapsed_time(end) * 1e3 / n         # us per peer copy

    cases = {"alone": (1, ()), "two streams": (2, ()), "+ local on 0": (1, (0,)), "+ local on 1": (1, (1,)),
             "+ local on both": (1, (0, 1)), "two streams + local on both": (2, (0, 1))}
    res = {k: [] for k in cases}
    for _ in range(args.repeats):
        for k, (st, lo) in cases.items():
            res[k].append(case(st, lo))
    base = min(res["alone"])
    out = {"size_bytes": size, "iters": n, "cases": {}}
    print(f"# {n} peer copies of {size} B, GPU 0 -> GPU 1, us per copy (each case {args.repeats}x, interleaved)")
    for k, ts in res.items():
        best = min(ts)
        out["cases"][k] = {"us_per_copy": ts, "best_us": best, "gbps": size / best / 1e3,
                           "of_alone_pct": base / best * 100}
        print(f"{k:>28}: {' '.join(f'{t:7.1f}' for t in ts)}  best {best:7.1f} us  {size / best / 1e3:6.1f} GB/s "
              f" {base / best * 100:5.1f}% of alone")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
