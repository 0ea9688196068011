"""Finding: scattered 528 B page writes reach only 70-72% of an HBM copy, which bounds unpack there.

What rate do scattered page writes and reads reach in local HBM, with nothing else to do?
At 528 B, unpack (contiguous staging reads, writes scattered over the pool) ran at 53-54%
and pack (scattered reads, contiguous writes) at 72-74% (``gpuxfer bench kernels``). This probe asks
whether any kernel could do better: on one GPU, for each page size, every page of a
``--pool`` buffer in a random order (as ``bench kernels`` lays them out), it times

* ``hbm-copy``: torch ``copy_`` of the same bytes, the rate ``bench kernels`` divides by;
* ``write-only random`` / ``in order``: a kernel that only stores the pages (no reads at all);
* ``read-only random``: a kernel that only loads them (xor-reduced, one word per program);
* ``write-only random, start 32 B-aligned``: the same pages at a stride rounded up to 32 B
  (every page starts on a 32-byte sector; a 528 B page still ends inside one);
* gpuxfer's own ``pack`` and ``unpack`` on the same table.

An unpack cannot beat the write-only rate of its pages, nor a pack the read-only rate. GPU
time by events, median of ``--trials``; rates are bytes moved (a copy's bytes once) per second.
"""
from __future__ import annotations

import argparse
import json

import numpy as np
import torch
import triton
import triton.language as tl


@triton.jit
def _rows_write(dst, offs, n_rows, row_i32, R: tl.constexpr, C: tl.constexpr):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    lanes = tl.arange(0, R)
    cols = tl.arange(0, C)
    dp = dst.to(tl.pointer_type(tl.int32), bitcast=True)
    val = tl.full([R, C], 0x5A5A5A5A, tl.int32)
    g = tl.cast(pid, tl.int64) * R
    while g < n_rows:
        r = g + lanes
        m = r < n_rows
        o = (tl.load(offs + r, mask=m, other=0) // 16) * 4     # 16-byte aligned: v4 accesses
        tl.store(dp + (o[:, None] + cols[None, :]), val, mask=m[:, None] & (cols[None, :] < row_i32))
        g += tl.cast(G, tl.int64) * R


@triton.jit
def _rows_read(src, offs, n_rows, row_i32, out, R: tl.constexpr, C: tl.constexpr):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    lanes = tl.arange(0, R)
    cols = tl.arange(0, C)
    sp = src.to(tl.pointer_type(tl.int32), bitcast=True)
    acc = tl.zeros([R, C], tl.int32)
    g = tl.cast(pid, tl.int64) * R
    while g < n_rows:
        r = g + lanes
        m = r < n_rows
        o = (tl.load(offs + r, mask=m, other=0) // 16) * 4     # 16-byte aligned: v4 accesses
        acc ^= tl.load(sp + (o[:, None] + cols[None, :]), mask=m[:, None] & (cols[None, :] < row_i32), other=0)
        g += tl.cast(G, tl.int64) * R
    tl.store(out + pid, tl.reduce(tl.reshape(acc, [R * C]), 0, _xor))


@triton.jit
def _rows_copy(src, dst, soffs, doffs, n_rows, row_i32, R: tl.constexpr, C: tl.constexpr):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    lanes = tl.arange(0, R)
    cols = tl.arange(0, C)
    sp = src.to(tl.pointer_type(tl.int32), bitcast=True)
    dp = dst.to(tl.pointer_type(tl.int32), bitcast=True)
    g = tl.cast(pid, tl.int64) * R
    while g < n_rows:
        r = g + lanes
        m = r < n_rows
        so = (tl.load(soffs + r, mask=m, other=0) // 16) * 4
        do = (tl.load(doffs + r, mask=m, other=0) // 16) * 4
        mm = m[:, None] & (cols[None, :] < row_i32)
        x = tl.load(sp + (so[:, None] + cols[None, :]), mask=mm)
        tl.store(dp + (do[:, None] + cols[None, :]), x, mask=mm)
        g += tl.cast(G, tl.int64) * R


@triton.jit
def _xor(a, b):
    return a ^ b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", type=int, default=1)
    ap.add_argument("--pool", type=int, default=2 << 30)
    ap.add_argument("--sizes", default="528,576,2304,9216,36864")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--configs", default="32,4,9,8,2;16,8,5,4,4;128,4,9,16,1;64,8,5,8,1;32,16,3,8,2;8,64,1,4,8",
                    help="other tilings 'rows,width,unroll,warps,pps;...' of gpuxfer's pack/unpack at pages <= 1 KiB")
    ap.add_argument("--no-basic", action="store_true", help="only gpuxfer's pack/unpack rows")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from gpuxfer.kernels import launch as L

    dev = torch.device("cuda", args.device)
    torch.cuda.set_device(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    pool = torch.empty(args.pool, dtype=torch.uint8, device=dev)
    pool2 = torch.empty(args.pool, dtype=torch.uint8, device=dev)
    stage = torch.empty(args.pool, dtype=torch.uint8, device=dev)
    out = torch.empty(sms * 64, dtype=torch.int32, device=dev)
    rng = np.random.default_rng(0)
    rows = []

    def timed(name, size, nbytes, fn, hbm=None):
        for _ in range(2):
            fn()
        ts = []
        for _ in range(args.trials):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1) * 1e-3)
        ts.sort()
        gbps = nbytes / ts[len(ts) // 2] / 1e9
        pct = 100.0 * gbps / hbm if hbm else None
        rows.append({"case": name, "page_bytes": size, "gbps": gbps, "pct_of_hbm_copy": pct})
        print(f"{size:6d} B  {name:44s} {gbps:8.1f} GB/s" + (f"  {pct:5.1f}% of hbm-copy" if pct else ""),
              flush=True)
        return gbps

    for size in (int(v) for v in args.sizes.split(",")):
        n = args.pool // size
        total = n * size
        row_i32 = size // 4
        C = 1 << (row_i32 - 1).bit_length()
        R = max(1, 2048 // C)
        hbm = timed("hbm-copy (torch copy_)", size, total, lambda: stage[:total].copy_(pool[:total]))
        rand = torch.from_numpy(rng.permutation(n).astype(np.int64) * size).to(dev)
        order = torch.arange(n, dtype=torch.int64, device=dev) * size
        for pps, warps in () if args.no_basic else ((2, 8), (4, 4), (8, 4)):
            grid = (sms * pps,)
            timed(f"write-only random ({pps}/SM, {warps} warps)", size, total,
                  lambda: _rows_write[grid](pool, rand, n, row_i32, R=R, C=C, num_warps=warps), hbm)
            timed(f"read-only random ({pps}/SM, {warps} warps)", size, total,
                  lambda: _rows_read[grid](pool, rand, n, row_i32, out, R=R, C=C, num_warps=warps), hbm)
        grid = (sms * 4,)
        if not args.no_basic:
            timed("write-only in order (4/SM)", size, total,
                  lambda: _rows_write[grid](pool, order, n, row_i32, R=R, C=C, num_warps=4), hbm)
        if size % 32 and not args.no_basic:
            stride = -(-size // 32) * 32
            n32 = args.pool // stride
            rand32 = torch.from_numpy(rng.permutation(n32).astype(np.int64) * stride).to(dev)
            timed(f"write-only random, start 32 B-aligned (stride {stride})", size, n32 * size,
                  lambda: _rows_write[grid](pool, rand32, n32, row_i32, R=R, C=C, num_warps=4), hbm)
        d = torch.stack([rand, torch.from_numpy(rng.permutation(n).astype(np.int64) * size).to(dev),
                         torch.full((n,), size, dtype=torch.int64, device=dev)], 1).contiguous()
        offs = L.pack_offsets(d)
        timed("gpuxfer pack", size, total, lambda: L.pack(pool, stage, d, offs, nbytes_hint=size, validate=False),
              hbm)
        timed("gpuxfer unpack", size, total,
              lambda: L.unpack(stage, pool2, d, offs, nbytes_hint=size, validate=False), hbm)
        # the simple row kernel as an unpack (contiguous reads, the table's scattered writes)
        dcol = d[:, 1].contiguous()
        for pps, warps in () if args.no_basic else ((4, 4), (8, 4)):
            grid = (sms * pps,)
            timed(f"row-kernel unpack ({pps}/SM, {warps} warps)", size, total,
                  lambda: _rows_copy[grid](stage, pool2, offs, dcol, n, row_i32, R=R, C=C, num_warps=warps),
                  hbm)
        if size <= 1024:   # other tilings of gpuxfer's kernel at small pages
            for spec in (tuple(int(v) for v in c.split(",")) for c in args.configs.split(";") if c):
                cfg = L.CopyConfig(*spec)
                timed(f"gpuxfer unpack rows {spec[0]} w{spec[1]} x{spec[2]} warps {spec[3]} {spec[4]}/SM", size,
                      total, lambda: L.unpack(stage, pool2, d, offs, config=cfg, validate=False), hbm)
                timed(f"gpuxfer pack rows {spec[0]} w{spec[1]} x{spec[2]} warps {spec[3]} {spec[4]}/SM", size,
                      total, lambda: L.pack(pool, stage, d, offs, config=cfg, validate=False), hbm)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "pool_bytes": args.pool, "device": torch.cuda.get_device_name(dev),
                       "sms": sms, "triton": triton.__version__}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
