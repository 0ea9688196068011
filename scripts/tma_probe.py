"""Finding: TMA (tensor-memory-accelerator) copies move no more over NVLink than SM loads and stores.

Plain loads and stores reached
94.6-95.6% pulling and 92-93% pushing a contiguous 1 GiB (scripts/sm_ceiling.py).
This probe times the same bytes (one process, two GPUs with peer
access) moved by

* the copy engines (``cuMemcpyAsync``): the ceiling;
* a plain persistent Triton load/store copy (sm_ceiling.py's best tiling);
* Triton tensor descriptors (host-built TMA maps; Hopper lowers ``desc.load`` / ``desc.store`` to
  ``cp.async.bulk.tensor``): the buffer as rows of ``W`` bytes, ``BM`` rows per tile;
* gpuxfer's descriptor copy on ``--cache-sizes`` pages in a random order with load/store cache
  modifiers (``--only-cache``: these rows alone);
* descriptor-shaped TMA copies: ``--page``-byte pages in a random order, each page one box of a
  3-D view ``[pages, page/256, 256]`` whose box is rounded up to a power of two rows (the rows past
  the page are outside the tensor: zero on load, not written on store).

Pull runs on ``--local`` and reads ``--peer``; push runs on ``--local`` and writes the peer. GPU
time by events, median of ``--trials``. Each case is tried on its own: one that fails to compile
or launch prints why and the rest go on. ``--json`` writes the rows.
"""
from __future__ import annotations

import argparse
import json
import traceback

import numpy as np
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from sm_ceiling import _contig, peer_buffers     # scripts/ is on the path when run as scripts/tma_probe.py


@triton.jit
def _tma_rows(src_desc, dst_desc, n_tiles, BM: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    for t in tl.range(pid, n_tiles, G, num_stages=STAGES):
        x = src_desc.load([t * BM, 0])
        dst_desc.store([t * BM, 0], x)


@triton.jit
def _tma_pages(src_desc, dst_desc, src_page, dst_page, n_pages, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    for i in tl.range(pid, n_pages, G, num_stages=STAGES):
        ps = tl.load(src_page + i)
        pd = tl.load(dst_page + i)
        x = src_desc.load([ps, 0, 0])
        dst_desc.store([pd, 0, 0], x)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=1 << 30)
    ap.add_argument("--local", type=int, default=1)
    ap.add_argument("--peer", type=int, default=0)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--pages", default="2304,9216", help="page sizes (multiples of 256 B) for the "
                    "descriptor-shaped TMA rows")
    ap.add_argument("--only-cache", action="store_true", help="only the descriptor-copy cache-modifier rows")
    ap.add_argument("--cache-sizes", default="2304", help="page sizes of the cache-modifier rows")
    ap.add_argument("--cache-reps", type=int, default=2, help="rounds of the cache-modifier rows (each round "
                    "starts one variant later, so no variant always runs first)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from gpuxfer.platforms import get_platform

    plat = get_platform("cuda")
    L, P, nb = args.local, args.peer, args.bytes
    a, b, bv = peer_buffers(L, P, nb)
    stream = torch.cuda.current_stream(L)
    s = plat.current_stream(L)
    sms = torch.cuda.get_device_properties(L).multi_processor_count
    rows = []

    # scratch for any descriptor Triton builds on the device (host-built ones need none)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=f"cuda:{L}"))

    def timed(name, fn, direction, check=None):
        try:
            for _ in range(2):
                fn()
            torch.cuda.synchronize(L)
            ts = []
            for _ in range(args.trials):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record(stream)
                fn()
                e1.record(stream)
                e1.synchronize()
                ts.append(e0.elapsed_time(e1) * 1e-3)
            ok = check() if check else None
        except Exception as exc:   # a probe: report and go on
            print(f"{direction:5s} {name:52s} FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
                  flush=True)
            rows.append({"case": name, "direction": direction, "error": traceback.format_exc()[-2000:]})
            return
        ts.sort()
        t = ts[len(ts) // 2]
        rows.append({"case": name, "direction": direction, "gbps": nb / t / 1e9, "us": t * 1e6, "exact": ok})
        print(f"{direction:5s} {name:52s} {nb / t / 1e9:7.1f} GB/s  exact={ok}", flush=True)

    def exact(src, dst, n=None):
        def f():
            torch.cuda.synchronize(L)
            k = n if n is not None else nb
            return bool(torch.equal(src[:k].to(f"cuda:{L}"), dst[:k].to(f"cuda:{L}")))
        return f

    a.random_(0, 256)
    for direction in () if args.only_cache else ("pull", "push"):
        src, dst = (bv, a) if direction == "pull" else (a, bv)
        src.copy_(torch.randint(0, 256, (nb,), dtype=torch.uint8, device=f"cuda:{L}"))
        timed("copy engines (cuMemcpyAsync)", lambda: plat.copy_async(s, dst.data_ptr(), src.data_ptr(), nb),
              direction)
        s32, d32 = src.view(torch.int32), dst.view(torch.int32)
        for block, unroll, warps, pps in ((4096, 4, 8, 1), (4096, 1, 8, 2)):
            grid = (sms * pps,)
            dst.zero_()
            timed(f"ld/st contiguous B{block * 4 // 1024}K x{unroll} w{warps} {pps}/SM",
                  lambda: _contig[grid](s32, d32, s32.numel(), BLOCK=block, UNROLL=unroll, num_warps=warps),
                  direction, exact(src, dst))
        for lcm, scm in ((".cg", ""), ("", ".cs"), ("", ".wt"), ("", ".cg"), (".cg", ".cs")):
            dst.zero_()
            timed(f"ld/st contiguous B16K x4 w8 1/SM load{lcm or '-'} store{scm or '-'}",
                  lambda: _contig[(sms,)](s32, d32, s32.numel(), BLOCK=4096, UNROLL=4, LOAD_CM=lcm, STORE_CM=scm,
                                          num_warps=8), direction, exact(src, dst))
        for width, bm, stages, warps, pps in ((256, 16, 3, 4, 1), (256, 32, 3, 4, 1), (256, 16, 4, 4, 2),
                                              (256, 64, 2, 4, 1), (256, 32, 2, 8, 2), (128, 32, 3, 4, 1),
                                              (16, 256, 3, 4, 1)):
            n_rows = nb // width
            sd = TensorDescriptor(src.view(n_rows, width), [n_rows, width], [width, 1], [bm, width])
            dd = TensorDescriptor(dst.view(n_rows, width), [n_rows, width], [width, 1], [bm, width])
            grid = (sms * pps,)
            dst.zero_()
            timed(f"tma rows of {width} B, {bm} rows/tile, {stages} stages w{warps} {pps}/SM",
                  lambda: _tma_rows[grid](sd, dd, n_rows // bm, BM=bm, STAGES=stages, num_warps=warps),
                  direction, exact(src, dst))
        for page in (int(v) for v in args.pages.split(",") if v):
            per = page // 256
            box = 1 << (per - 1).bit_length()
            n_pages = nb // page
            rng = np.random.default_rng(0)
            sp = torch.from_numpy(rng.permutation(n_pages).astype(np.int32)).to(f"cuda:{L}")
            dp = torch.arange(n_pages, dtype=torch.int32, device=f"cuda:{L}")
            sd = TensorDescriptor(src[:n_pages * page].view(n_pages, per, 256), [n_pages, per, 256],
                                  [per * 256, 256, 1], [1, box, 256])
            dd = TensorDescriptor(dst[:n_pages * page].view(n_pages, per, 256), [n_pages, per, 256],
                                  [per * 256, 256, 1], [1, box, 256])

            def check(sp=sp, page=page, n_pages=n_pages, per=per):
                torch.cuda.synchronize(L)
                got = dst[:n_pages * page].to(f"cuda:{L}").view(n_pages, per * 256)
                want = src[:n_pages * page].to(f"cuda:{L}").view(n_pages, per * 256)[sp.long()]
                return bool(torch.equal(got, want))
            for stages, pps in ((3, 2), (4, 4)):
                grid = (sms * pps,)
                dst.zero_()
                timed(f"tma pages of {page} B random (box {box}x256), {stages} stages {pps}/SM",
                      lambda: _tma_pages[grid](sd, dd, sp, dp, n_pages, STAGES=stages, num_warps=4),
                      direction, check)
    # the descriptor-copy kernel on pages in random order with cache modifiers (rounds rotate the order)
    import dataclasses

    from gpuxfer.kernels.launch import choose_config, copy_descriptors
    variants = (("", ""), (".cg", ""), (".cv", ""), (".cg", ".cs"), ("", ".cs"))
    for size in (int(v) for v in args.cache_sizes.split(",") if v):
        n_pages = nb // size
        rng = np.random.default_rng(1)
        starts = np.arange(n_pages, dtype=np.int64) * size
        desc = torch.from_numpy(np.stack([rng.permutation(starts), starts, np.full(n_pages, size, np.int64)], 1)
                                ).to(f"cuda:{L}")
        base = choose_config(size)
        for rep in range(args.cache_reps):
            k = rep % len(variants)
            for lcm, scm in variants[k:] + variants[:k]:
                cfg = dataclasses.replace(base, load_cache=lcm, store_cache=scm)
                for direction in ("pull", "push"):
                    src, dst = (bv, a) if direction == "pull" else (a, bv)
                    timed(f"descriptor copy {size} B random load{lcm or '-'} store{scm or '-'} #{rep + 1}",
                          lambda: copy_descriptors(src, dst, desc, config=cfg, validate=False), direction)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "bytes": nb, "local": L, "peer": P, "sms": sms,
                       "device": torch.cuda.get_device_name(L), "triton": triton.__version__}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
