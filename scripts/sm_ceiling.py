"""Finding: SM loads and stores pull ~95% and push ~93% of the copy engines over NVLink, even contiguous.

How fast can SMs move bytes over NVLink at all, in the easiest case: one process,
two GPUs with peer access, a 1 GiB contiguous buffer moved by

* the copy engines (``cuMemcpyAsync``, the ceiling of ``bench kernels``), pull and push;
* a plain persistent Triton kernel (each program copies BLOCK int32 per iteration, every
  load of an iteration issued before its stores), over grids and block sizes;
* the descriptor-copy kernel itself on the same bytes cut into in-order 64 KiB and
  2,304 B descriptors, and 2,304 B descriptors in a random order.

Pull runs on the local device and reads the peer; push runs on the local device and writes
the peer. ``--configs`` times tilings of the descriptor copy, ``--programs`` bounded grids (an SM
budget). GPU time by events, median of ``--trials``. Prints a table; ``--json`` writes it.
"""
from __future__ import annotations

import argparse
import json

import numpy as np
import torch
import triton
import triton.language as tl


@triton.jit
def _contig(src, dst, n_units, BLOCK: tl.constexpr, UNROLL: tl.constexpr, LOAD_CM: tl.constexpr = "",
            STORE_CM: tl.constexpr = ""):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    step = tl.cast(G, tl.int64) * BLOCK * UNROLL
    start = tl.cast(pid, tl.int64) * BLOCK * UNROLL
    while start < n_units:
        xs = ()
        for u in tl.static_range(UNROLL):
            o = start + u * BLOCK + offs
            xs = xs + (tl.load(src + o, mask=o < n_units, cache_modifier=LOAD_CM),)
        for u in tl.static_range(UNROLL):
            o = start + u * BLOCK + offs
            tl.store(dst + o, xs[u], mask=o < n_units, cache_modifier=STORE_CM)
        start += step


def peer_buffers(local: int, peer: int, nbytes: int):
    """``nbytes`` on ``local`` and on ``peer`` with peer access both ways, and a view of the peer's bytes
    labelled as on ``local`` (what Triton takes), as ``(a, b, b_view)``."""
    from gpuxfer.platforms.cuda_memory import _view_by_storage

    torch.cuda.set_device(local)
    a = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{local}")
    b = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{peer}")
    b.copy_(a)                             # enables peer access both ways (torch's copy does it)
    a.copy_(b)
    torch.cuda.synchronize(local)
    torch.cuda.synchronize(peer)
    return a, b, _view_by_storage(b.data_ptr(), nbytes, torch.device("cuda", local))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=1 << 30)
    ap.add_argument("--local", type=int, default=1)
    ap.add_argument("--peer", type=int, default=0)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--configs", default="", help="descriptor-copy tilings 'rows,width,unroll,warps,pps;...' "
                    "to time on 2,304 B random pages")
    ap.add_argument("--configs-programs", type=int, default=0, help="grid of the --configs rows (default: "
                    "programs per SM x SMs)")
    ap.add_argument("--programs", default="", help="bounded grids 'G1,G2,...' for pull: contiguous against "
                    "descriptor copies (an SM budget)")
    ap.add_argument("--skip-basic", action="store_true", help="only the --configs / --programs rows")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from gpuxfer.kernels.launch import copy_descriptors
    from gpuxfer.platforms import get_platform

    plat = get_platform("cuda")
    L, P, nb = args.local, args.peer, args.bytes
    a, b, bv = peer_buffers(L, P, nb)
    stream = torch.cuda.current_stream(L)
    s = plat.current_stream(L)
    sms = torch.cuda.get_device_properties(L).multi_processor_count
    rows = []

    def timed(name, fn, direction):
        for _ in range(2):
            fn()
        ts = []
        for _ in range(args.trials):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(stream)
            fn()
            e1.record(stream)
            e1.synchronize()
            ts.append(e0.elapsed_time(e1) * 1e-3)
        ts.sort()
        t = ts[len(ts) // 2]
        rows.append({"case": name, "direction": direction, "gbps": nb / t / 1e9, "us": t * 1e6})
        print(f"{direction:5s} {name:48s} {nb / t / 1e9:7.1f} GB/s", flush=True)

    def pages(size: int, order: str):
        """The buffer as ``size``-byte descriptors, moved in place, in order or in a random order."""
        starts = np.arange(nb // size, dtype=np.int64) * size
        srcs = starts if order == "in order" else np.random.default_rng(0).permutation(starts)
        return torch.from_numpy(np.stack([srcs, starts, np.full(starts.size, size, np.int64)], 1)).to(f"cuda:{L}")

    for direction in ("pull", "push"):
        src, dst = (bv, a) if direction == "pull" else (a, bv)
        timed("copy engines (cuMemcpyAsync)", lambda: plat.copy_async(s, dst.data_ptr(), src.data_ptr(), nb),
              direction)
        if args.skip_basic:
            continue
        s32, d32 = src.view(torch.int32), dst.view(torch.int32)
        for block, unroll, warps, pps in ((4096, 1, 8, 2), (4096, 4, 8, 1), (4096, 4, 8, 2), (8192, 2, 16, 1),
                                          (8192, 4, 16, 1), (2048, 8, 8, 2), (4096, 2, 4, 4), (1024, 4, 4, 8)):
            grid = (sms * pps,)
            timed(f"triton contiguous B{block * 4 // 1024}K x{unroll} w{warps} {pps}/SM",
                  lambda: _contig[grid](s32, d32, s32.numel(), BLOCK=block, UNROLL=unroll, num_warps=warps),
                  direction)
        for size, order in ((65536, "in order"), (2304, "in order"), (2304, "random")):
            desc = pages(size, order)
            timed(f"descriptor copy {size} B {order}",
                  lambda: copy_descriptors(src, dst, desc, nbytes_hint=size, validate=False), direction)
    if args.configs:   # the descriptor-copy kernel's tilings on 2,304 B pages in random order
        from gpuxfer.kernels.launch import CopyConfig
        desc = pages(2304, "random")
        for spec in args.configs.split(";"):
            r, w, u, nw, pps = (int(v) for v in spec.split(","))
            cfg = CopyConfig(rows=r, width=w, unroll=u, num_warps=nw, programs_per_sm=pps)
            grid = args.configs_programs or pps * sms
            for direction in ("pull", "push"):
                src, dst = (bv, a) if direction == "pull" else (a, bv)
                timed(f"2304 B random, rows {r} width {w} unroll {u} warps {nw}, {grid} programs",
                      lambda: copy_descriptors(src, dst, desc, config=cfg, num_programs=grid, validate=False),
                      direction)
    if args.programs:   # an SM budget: pull on a bounded grid (one program per SM)
        desc = pages(2304, "random")
        s32, a32 = bv.view(torch.int32), a.view(torch.int32)
        for g in (int(v) for v in args.programs.split(",")):
            for block, unroll, warps in ((4096, 4, 8), (8192, 4, 16), (4096, 8, 16), (16384, 2, 16)):
                timed(f"{g} programs: triton contiguous B{block * 4 // 1024}K x{unroll} w{warps}",
                      lambda: _contig[(g,)](s32, a32, s32.numel(), BLOCK=block, UNROLL=unroll, num_warps=warps),
                      "pull")
            timed(f"{g} programs: descriptor copy 2304 B random", lambda: copy_descriptors(
                bv, a, desc, nbytes_hint=2304, num_programs=g, validate=False), "pull")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "bytes": nb, "local": L, "peer": P, "sms": sms,
                       "device": torch.cuda.get_device_name(L)}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
