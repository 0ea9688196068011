"""Finding: a pool whose size is not whole 2 MiB pages makes scattered page copies over it ~2.5x slower.

The `bench kv` batch-1 plan of
kv-dsv4 (ISL 32k, 16-token pages), its descriptors split by size and sorted by the source
offsets as the `triton` engine does, copied by the descriptor-copy kernel from a source pool
that a helper process allocates and exports over IPC (as the prefill rank does) into a local
destination pool. The pools are laid out for ``--pool-batch`` requests, and allocated with
plain ``cudaMalloc`` (not through the platform, which rounds sizes up), either at the
layout's exact size or rounded up to whole 2 MiB pages. An exact 14.65 GB pool ran 2.5x
slower than the same pool 53 KiB larger.

Each size class is timed over back-to-back launches (so the host's launch cost hides behind
the GPU). Needs CUDA (two GPUs for ``pull``); prints one line per case and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time

import numpy as np
import torch

from gpuxfer.kernels.launch import copy_descriptors
from gpuxfer.bench.kv.engines.triton import size_classes
from gpuxfer.bench.kv.model.layout import layout_for_burst
from gpuxfer.bench.kv.model.plan import build_burst
from gpuxfer.platforms.cuda_memory import LARGE_PAGE_BYTES, _view_by_storage

REPS = 5


def _owner(device: int, nbytes: int, conn) -> None:
    """The helper: cudaMalloc ``nbytes`` on ``device``, send its IPC handle, wait for "exit"."""
    import cupy
    with cupy.cuda.Device(device):
        ptr = cupy.cuda.runtime.malloc(nbytes)
        conn.send(bytes(cupy.cuda.runtime.ipcGetMemHandle(ptr)))
        conn.poll(600)
        conn.recv()
        cupy.cuda.runtime.free(ptr)


def case(mode: str, pool_batch: int, exact: bool, args) -> dict:
    import cupy
    lay = layout_for_burst(args.workload, args.isl, args.page, pool_batch)
    burst = build_burst(args.workload, args.isl, args.page, 1, layout=lay)
    pool = lay.pool_bytes if exact else -(-lay.pool_bytes // LARGE_PAGE_BYTES) * LARGE_PAGE_BYTES
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    helper = ctx.Process(target=_owner, args=(1 if mode == "pull" else 0, pool, child), daemon=True)
    helper.start()
    if not conn.poll(120):
        raise TimeoutError("the pool owner did not send its handle within 120 s")
    with cupy.cuda.Device(0):
        src_ptr = int(cupy.cuda.runtime.ipcOpenMemHandle(conn.recv()))
        dst_ptr = int(cupy.cuda.runtime.malloc(pool))
    dev = torch.device("cuda", 0)
    src, dst = _view_by_storage(src_ptr, pool, dev), _view_by_storage(dst_ptr, pool, dev)
    classes = [torch.from_numpy(np.ascontiguousarray(c)).to(dev) for c in size_classes(burst.plan, 0)]
    local = mode == "local"
    try:
        for c in classes:          # validates every descriptor, compiles and loads the kernels
            copy_descriptors(src, dst, c, nbytes_hint=int(c[0, 2]), local=local)
        torch.cuda.synchronize()
        per_class = []
        for c in classes:
            times = []
            for _ in range(args.trials):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(REPS):
                    copy_descriptors(src, dst, c, nbytes_hint=int(c[0, 2]), local=local, validate=False)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e3 / REPS)
            per_class.append(float(np.median(times)))
    finally:
        del src, dst
        torch.cuda.synchronize()
        with cupy.cuda.Device(0):
            cupy.cuda.runtime.ipcCloseMemHandle(src_ptr)
            cupy.cuda.runtime.free(dst_ptr)
        conn.send("exit")
        helper.join(60)
    total_us = sum(per_class)
    nbytes = int(burst.plan[:, 2].sum())
    return dict(mode=mode, pool_batch=pool_batch, pool_bytes=pool, exact_size=exact,
                whole_2mib_pages=pool % LARGE_PAGE_BYTES == 0, burst_bytes=nbytes,
                descriptors=int(burst.plan.shape[0]), time_us=round(total_us, 1),
                gbps=round(nbytes / total_us / 1e3, 1),
                per_class_us={int(c[0, 2]): round(t, 1) for c, t in zip(classes, per_class)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="kv-dsv4")
    ap.add_argument("--isl", type=int, default=32768)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--pool-batch", type=int, nargs="+", default=[4, 64],
                    help="size the pools for this many requests, as bench kv does for its largest batch")
    ap.add_argument("--modes", default="pull", help="pull (source pool on GPU 1) and/or local (on GPU 0)")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    torch.cuda.set_device(0)
    rows = []
    for mode in args.modes.split(","):
        for pb in args.pool_batch:
            for exact in (True, False):
                rows.append(case(mode, pb, exact, args))
                print(rows[-1], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"when": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
