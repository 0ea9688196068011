"""Hand one request's KV cache from a prefill process to a decode process, then check every byte.

What a prefill/decode engine author needs, end to end, in one page:

* two processes, one per GPU (both on one GPU if there is one; the CPU emulation if none);
* each allocates its KV pool through the platform (a raw, IPC-exportable buffer) and opens
  the other's pool over IPC; a small gloo CPU group carries the handles, never the data;
* both derive the request's descriptors ``(src_offset, dst_offset, nbytes)`` from the same
  block tables (here: seeded, as ``gpuxfer bench kv`` does);
* the request moves with the ``pack`` engine (pack on the prefill GPU, one copy-engine transfer,
  unpack on the decode GPU), the fastest of the 2x H200 runs (docs/PERFORMANCE.md);
  ``--engine triton`` pulls with the descriptor-copy kernel reading the peer pool instead;
* the decode side verifies every byte against the pattern the prefill side painted.

Run:  python examples/kv_handoff.py [--workload kv-dsv4] [--isl 32768] [--page 64] [--engine pack]
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time


def side_main(rank: int, init_file: str, args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from gpuxfer.kernels import fill_pattern, verify
    from gpuxfer.kv.engines import Burst, Role, Side, engine_class
    from gpuxfer.kv.plan import build_burst
    from gpuxfer.platforms import get_platform

    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # flag waits never share a hardware queue
    plat = get_platform(args.platform)
    device = rank if plat.device_count() > 1 else 0
    plat.set_device(device)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))

    def exchange(obj):
        out = [None, None]
        dist.all_gather_object(out, obj)
        return out

    # 1. The request's descriptors: the same on both sides, from the same seed.
    plan = build_burst(args.workload, args.isl, args.page, batch=1, seed=args.seed)
    role = Role.SOURCE if rank == 0 else Role.DESTINATION
    seed = 1234 if role is Role.SOURCE else 5678                 # what each pool holds before the hand-off

    # 2. A pool per process, opened by the other over IPC.
    pool = plat.alloc(plan.src_layout.pool_bytes, device)
    peer = plat.open_handle(exchange(pool.export())[1 - rank], device)
    stream = plat.create_stream(device)
    plat.launch(stream, lambda: fill_pattern(plat.as_tensor(pool), seed))   # "the KV the model wrote"
    assert plat.synchronize(stream, 60)

    # 3. The engine: prepare (descriptor tables on the GPU, outside the hot path), then post and wait.
    #    Both sides post: for a pull with `triton` the prefill side has nothing to do; with `pack`
    #    it packs. (gpuxfer bench kv also "arms" bursts ahead behind a GPU flag; see docs/kv_bench.md.)
    side = Side(platform=plat, device=device, rank=rank, role=role, pool=pool, peer_pool=peer,
                exchange=exchange, timeout_s=60, armed=False)
    side.open_streams()
    engine = engine_class(args.engine)(side)
    burst = Burst.from_plan(plan)
    p = engine.prepare(burst, "pull")
    dist.barrier()                      # ... the prefill is done: the KV is ready
    t0 = time.perf_counter()
    engine.post(p)
    engine.wait(p)
    dt = time.perf_counter() - t0       # the first transfer: it includes loading the kernels
    engine.release(p)
    dist.barrier()

    # 4. Decode checks every byte of the request against the prefill side's pattern.
    if role is Role.DESTINATION:
        res = []
        table = burst.concatenated()
        import numpy as np
        import torch
        dst = plat.as_tensor(pool)
        descs = torch.from_numpy(np.ascontiguousarray(table)).to(dst.device)
        plat.launch(stream, lambda: res.append(verify(dst, descs, 1234)))
        assert plat.synchronize(stream, 60)
        r = res[0]
        print(f"{args.engine} pull of one {args.workload} request (ISL {args.isl}, {args.page}-token pages, "
              f"{burst.descriptors:,} descriptors, {burst.nbytes / 1e6:.1f} MB) on {plat.label}: "
              f"{dt * 1e3:.3f} ms, {burst.nbytes / dt / 1e9:.2f} GB/s; wrong bytes: {r.wrong_bytes}")
        r.raise_if_failed("the KV hand-off")

    engine.close()
    side.close()
    peer.close()
    pool.close()
    dist.destroy_process_group()
    plat.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="kv-dsv4")
    ap.add_argument("--isl", type=int, default=None, help="input tokens (default 32768; 16 on the CPU emulation)")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--engine", default="pack", help="pack, triton, copy_engine or bulk")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--platform", default=None, help="cuda, rocm or host (default: the first usable)")
    args = ap.parse_args()
    from gpuxfer.kv.runner import resolve_platform
    name = args.platform = resolve_platform(args.platform or "auto")   # never touches a device here
    if args.isl is None:
        args.isl = 16 if name == "host" else 32768
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=side_main, args=(r, os.path.join(tmp, "rdv"), args)) for r in (0, 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(300)
            if p.is_alive():
                p.kill()
        codes = [p.exitcode for p in procs]
    if codes != [0, 0]:
        print(f"hand-off failed: exit codes {codes}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
