"""The NIXL route of KVAgent, timed: one request of many blocks between two processes, every byte checked.

    UCX_NET_DEVICES=lo PYTHONPATH=. python scripts/kv_nixl_route.py [--platform host|cuda] [--blocks 10000]
        [--layers 1] [--block-bytes 576] [--ops pull,push] [--iters 10] [--json PATH]

A benchmark, not a test: the CPU target of the route (a 10,000-block request moves correctly in under 1 s on
two cores) and, on a GPU, the comparison of the route's post with NIXL's own. Two spawned processes each make
a ``KVAgent(remote="nixl")`` over caches of ``--layers`` layers of ``--block-bytes``-byte blocks (one piece
per block, 2 x ``--blocks`` blocks per side; host emulation: a shared-memory pool, DRAM; cuda: a torch
allocation on device 0, VRAM), swap metadata over a pipe and add each other with ``route="nixl"``. The
initiator (decode pulls, prefill pushes) then, per iteration, moves ``--blocks`` random source blocks into
random destination blocks: ``prepare`` (IDs checked, index arrays built), ``post`` (host time of the call:
NIXL's ``make_prepped_xfer`` + ``transfer``, which on the host emulation's cma transport also copies) and
post -> complete; the destination checks every byte of its caches after each iteration. ``nixl_own_post``
is NIXL's own ``make_prepped_xfer`` + ``transfer`` on the same prepped lists and indices, without the
agent. Medians over the iterations; ``request_s`` is prepare + post + complete.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import numpy as np


def _pool(platform_name: str, nbytes: int, rank: int):
    """A uint8 tensor of ``nbytes`` the agent can register, and what keeps it alive."""
    from gpuxfer.platforms import get_platform
    plat = get_platform(platform_name)
    if platform_name == "host":
        buf = plat.alloc(nbytes, rank)
        return plat, rank, plat.as_tensor(buf), buf
    import torch
    return plat, 0, torch.empty(nbytes, dtype=torch.uint8, device="cuda:0"), None


def _content(rank: int, iteration: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(1000 * iteration + rank).integers(0, 256, nbytes, dtype=np.uint8)


def _side(rank: int, conn, args) -> list:
    import torch
    from gpuxfer.kv.agent import KVAgent
    from gpuxfer.kv.layers import KVLayerSpec, KVPiece
    blocks, bb, layers = args.blocks * 2, args.block_bytes, args.layers
    per_layer = blocks * bb
    plat, device, flat, keep = _pool(args.platform, layers * per_layer, rank)
    specs = {f"layers.{i}": KVLayerSpec(flat[i * per_layer:(i + 1) * per_layer], blocks, bb, (KVPiece(0, bb),))
             for i in range(layers)}
    agent = KVAgent(f"rank{rank}", platform=plat, device=device, timeout_s=120, remote="nixl")
    rows = []
    try:
        agent.register_group("kv", 1, specs)
        conn.send(agent.metadata())
        peer = agent.add_peer(conn.recv(), route="nixl")
        for op in args.ops:
            initiator = 1 if op == "pull" else 0
            for it in range(args.iters + 1):            # iteration 0 warms up (first transfer connects)
                g = np.random.default_rng(it)
                src = g.permutation(blocks)[:args.blocks]
                dst = g.permutation(blocks)[:args.blocks]
                seed = it + (0 if op == "pull" else 10_000)
                flat.copy_(torch.from_numpy(_content(rank, seed, flat.numel())).to(flat.device))
                conn.send("filled")
                assert conn.recv() == "filled"
                row = None
                if rank == initiator:
                    mine, theirs = (dst, src) if op == "pull" else (src, dst)
                    t0 = time.perf_counter()
                    x = agent.prepare(peer, op, local_blocks={"kv": mine}, remote_blocks={"kv": theirs})
                    t1 = time.perf_counter()
                    h = x.post()
                    t2 = time.perf_counter()
                    h.wait(120)
                    t3 = time.perf_counter()
                    row = {"op": op, "prepare_s": t1 - t0, "post_s": t2 - t1, "complete_s": t3 - t2,
                           "request_s": t3 - t0, "descriptors": x.descriptors, "bytes": x.nbytes,
                           "nixl_own_post_s": _nixl_own(peer, x)}
                conn.send("moved")
                assert conn.recv() == "moved"
                if rank == 1:                       # decode, the destination both ways, checks every byte
                    want = _content(rank, seed, flat.numel()).reshape(layers, blocks, bb)
                    other = _content(1 - rank, seed, flat.numel()).reshape(layers, blocks, bb)
                    want[:, dst] = other[:, src]
                    got = flat.cpu().numpy().reshape(layers, blocks, bb)
                    wrong = int(np.count_nonzero(got != want))
                    conn.send(wrong)
                else:
                    wrong = conn.recv()
                if row is not None and it:
                    row["wrong_bytes"] = wrong
                    rows.append(row)
                if wrong:
                    raise AssertionError(f"{op} iteration {it}: {wrong} wrong bytes")
        conn.send("end")
        assert conn.recv() == "end"
        return rows
    finally:
        agent.close()
        if keep is not None:
            keep.close()
        plat.close()


def _nixl_own(peer, x) -> float:
    """NIXL's own make_prepped_xfer + transfer on the request's lists and indices (completed and released)."""
    side = peer.side
    op = "READ" if x.op == "pull" else "WRITE"
    with side.lock:
        t0 = time.perf_counter()
        h = side.nixl.make_prepped(op, x.lists.local_h, x.local_idx, x.lists.remote_h, x.remote_idx)
        state = side.nixl.post(h, "nixl's own")
        t1 = time.perf_counter()
        side.nixl.wait(h, "nixl's own", timeout_s=120, state=state)
        side.nixl.release_xfer(h)
    return t1 - t0


def _run(rank, conn, out, args):
    try:
        out.send(_side(rank, conn, args))
    except BaseException as exc:
        import traceback
        traceback.print_exc()
        print(f"rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        os._exit(1)
    os._exit(0)         # NIXL's and UCX's threads: leave without the interpreter's teardown


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--platform", default="host", choices=("host", "cuda"))
    p.add_argument("--blocks", type=int, default=10_000)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--block-bytes", type=int, default=576)
    p.add_argument("--ops", default="pull,push")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.ops = [o for o in args.ops.split(",") if o]
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    outs = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [ctx.Process(target=_run, args=(r, c, outs[r][1], args)) for r, c in ((0, a), (1, b))]
    for pr in procs:
        pr.start()
    rows = []
    for r in range(2):
        if outs[r][0].poll(900):
            rows += outs[r][0].recv()
    for pr in procs:
        pr.join(60)
        if pr.is_alive():
            pr.kill()
            pr.join(5)
    codes = [pr.exitcode for pr in procs]
    summary = []
    for op in args.ops:
        mine = [r for r in rows if r["op"] == op]
        if not mine:
            continue
        med = {k: statistics.median(r[k] for r in mine) for k in ("prepare_s", "post_s", "complete_s", "request_s",
                                                                   "nixl_own_post_s")}
        summary.append(dict(op=op, platform=args.platform, blocks=args.blocks, layers=args.layers,
                            descriptors=mine[0]["descriptors"], bytes=mine[0]["bytes"], iterations=len(mine),
                            wrong_bytes=sum(r["wrong_bytes"] for r in mine), **med,
                            post_over_nixl_own=med["post_s"] / med["nixl_own_post_s"]))
    for s in summary:
        print(f"{s['op']:4s} {s['platform']}: {s['blocks']:,} blocks x {s['layers']} layers = {s['descriptors']:,} "
              f"descriptors, {s['bytes']:,} B; median of {s['iterations']}: prepare {1e3 * s['prepare_s']:.2f} ms, "
              f"post {1e3 * s['post_s']:.2f} ms (NIXL's own {1e3 * s['nixl_own_post_s']:.2f} ms, "
              f"x{s['post_over_nixl_own']:.2f}), complete {1e3 * s['complete_s']:.2f} ms, request "
              f"{1e3 * s['request_s']:.1f} ms; wrong bytes {s['wrong_bytes']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": summary, "exit_codes": codes}, f, indent=1)
    ok = codes == [0, 0] and summary and all(s["wrong_bytes"] == 0 for s in summary)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
