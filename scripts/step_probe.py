"""Where a small copy_engine pp step's time goes: host enqueue cost against GPU execution time.

`scripts/host_costs.py` times calls back to back while the GPU runs them, which cannot
tell a slow call from a full GPU queue. Here each case is also queued behind a *gate*
(every stream it uses first waits on a flag the host has not set yet), so nothing runs
while it is queued:

* ``host_us``: the enqueue time per iteration with the GPU idle -- the host's own cost;
* ``gpu_us``: once the gate opens, the GPU time per iteration (timing events around
  the gated work) -- what the streams themselves take;
* ``free_us``: the same loop run ungated (steady state), as the benchmark runs it.

If ``free_us`` is close to ``host_us`` and well above ``gpu_us``, the step is bound by the
host's calls, not by the GPU. One GPU (``--peer`` puts the receive slots on a second
one). ``--graphs`` also times the same copies and flag operations as CUDA graph launches,
and lists the GPU activities a torch.profiler trace shows for them (``Memcpy ...`` on copy
engines, or a kernel). Prints a table; ``--json`` writes it.
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=40, help="iterations queued behind one gate")
    ap.add_argument("--free-n", type=int, default=1000, help="iterations of the ungated loop")
    ap.add_argument("--rounds", type=int, default=5, help="gated rounds (median reported)")
    ap.add_argument("--peer", type=int, default=None, help="device of the 'peer' receive slots")
    ap.add_argument("--graphs", action="store_true", help="also time the same work as CUDA graph launches")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from gpuxfer.platforms import get_platform
    plat = get_platform("cuda")
    dev = 0
    torch.cuda.set_device(dev)
    flags = plat.alloc(1 << 16, dev)
    buf = plat.alloc(1 << 22, dev)
    peer = None
    if args.peer is not None:
        torch.empty(1, device=f"cuda:{args.peer}").copy_(torch.empty(1, device="cuda:0"))  # peer access on
        peer = plat.alloc(1 << 22, args.peer)
    slot = (peer or buf).ptr + (1 << 21)
    C = plat.create_stream(dev)        # the caller's stream (created: gating torch's legacy stream is unsafe)
    S = plat.create_stream(dev)        # the transport's side stream
    plat.memset_async(C, flags.ptr, 0, 1 << 16)
    plat.synchronize(C, 30)
    gate_ptr = [flags.ptr + 64 * 1000]
    gate_v = [0]
    x = torch.empty(1 << 14, dtype=torch.uint8, device="cuda")
    t1, t2 = x[:1 << 13], x[1 << 13:]
    out: dict[str, dict] = {}

    def run(name, fn, streams, n=args.n):
        hosts, gpus = [], []
        for _ in range(args.rounds):
            gate_v[0] += 1
            g = gate_v[0]
            ev0 = []
            for s in streams:
                plat.wait_flag(s, gate_ptr[0], g)
                e = torch.cuda.Event(enable_timing=True)
                e.record(s.torch)
                ev0.append(e)
            t0 = time.perf_counter()
            for i in range(n):
                fn(i)
            hosts.append((time.perf_counter() - t0) / n * 1e6)
            ends = []
            for s in streams:
                e = torch.cuda.Event(enable_timing=True)
                e.record(s.torch)
                ends.append(e)
            plat.host_write_flag(gate_ptr[0], g, dev)
            for s in streams:
                if not plat.synchronize(s, 60):
                    raise RuntimeError(f"{name}: the gated work did not finish")
            gpus.append(max(e0.elapsed_time(e1) * 1e3 for e0, e1 in zip(ev0, ends)) / n)
        for _ in range(20):
            fn(0)
        for s in streams:
            plat.synchronize(s, 60)
        t0 = time.perf_counter()
        for i in range(args.free_n):
            fn(i)
        free = (time.perf_counter() - t0) / args.free_n * 1e6
        for s in streams:
            plat.synchronize(s, 60)
        hosts.sort()
        gpus.sort()
        out[name] = {"host_us": hosts[len(hosts) // 2], "gpu_us": gpus[len(gpus) // 2], "free_us": free}
        r = out[name]
        print(f"{name:44s} host {r['host_us']:7.2f}  gpu {r['gpu_us']:7.2f}  free {r['free_us']:7.2f} us", flush=True)

    f = flags.ptr
    run("write_flag", lambda i: plat.write_flag(S, f, i), [S])
    run("wait_flag (satisfied)", lambda i: plat.wait_flag(S, f + 64, 0), [S])
    run("copy local 16 KiB", lambda i: plat.copy_async(S, buf.ptr, buf.ptr + (1 << 20), 1 << 14), [S])
    run("copy local 8 B", lambda i: plat.copy_async(S, buf.ptr, buf.ptr + (1 << 20), 8), [S])
    run(f"copy {'peer' if peer else 'local'} 16 KiB (to the slot)",
        lambda i: plat.copy_async(S, slot, buf.ptr, 1 << 14), [S])
    ev = [plat.record_event(C)]
    run("record_event (re-record)", lambda i: plat.record_event(S, ev[0]), [S])
    evc = plat.record_event(C)
    run("stream_wait_event (other stream)", lambda i: plat.stream_wait_event(S, evc), [S])

    def ping(i):      # C -> S -> C hand-offs by events, as the sender's two streams do each step
        plat.record_event(C, st["a"])
        plat.stream_wait_event(S, st["a"])
        plat.record_event(S, st["b"])
        plat.stream_wait_event(C, st["b"])
    st = {"a": plat.record_event(C), "b": plat.record_event(S)}
    run("event ping C->S->C (4 calls)", ping, [C, S])

    # the copy_engine sender's step (copy_engine.py's _send_impl, flags local)
    ss = {"packed": plat.record_event(C), "copied": [None, None], "k": 0}

    def sender(i):
        k = ss["k"] = ss["k"] + 1
        s_ = k & 1
        if ss["copied"][s_] is not None:
            plat.stream_wait_event(C, ss["copied"][s_])
        plat.copy_async(C, buf.ptr + s_ * 65536, t1.data_ptr(), 8192)
        plat.copy_async(C, buf.ptr + s_ * 65536 + 8192, t2.data_ptr(), 8192)
        ss["packed"] = plat.record_event(C, ss["packed"])
        plat.stream_wait_event(S, ss["packed"])
        plat.wait_flag(S, f + 128, 0)
        plat.copy_async(S, slot + s_ * 65536, buf.ptr + s_ * 65536, 16384)
        plat.write_flag(S, f + 192, k)
        ss["copied"][s_] = plat.record_event(S, ss["copied"][s_])
    run("sender step (10 calls)", sender, [C, S])

    def sender_side_pack(i):   # variant: pack on the side stream; the caller's stream waits for the pack only
        k = ss["k"] = ss["k"] + 1
        s_ = k & 1
        ss["packed"] = plat.record_event(C, ss["packed"])
        plat.stream_wait_event(S, ss["packed"])
        plat.copy_async(S, buf.ptr + s_ * 65536, t1.data_ptr(), 8192)
        plat.copy_async(S, buf.ptr + s_ * 65536 + 8192, t2.data_ptr(), 8192)
        ss["copied"][0] = plat.record_event(S, ss["copied"][0])
        plat.stream_wait_event(C, ss["copied"][0])
        plat.wait_flag(S, f + 128, 0)
        plat.copy_async(S, slot + s_ * 65536, buf.ptr + s_ * 65536, 16384)
        plat.write_flag(S, f + 192, k)
    ss["copied"] = [plat.record_event(S), None]
    run("sender step, pack on the side stream (9 calls)", sender_side_pack, [C, S])

    def receiver(i):
        plat.wait_flag(C, f + 256, 0)
        o = torch.empty(16384, dtype=torch.uint8, device="cuda")
        plat.copy_async(C, o.data_ptr(), slot, 16384)
        _ = (o[:8192].view(torch.bfloat16).view(2, 2048), o[8192:].view(torch.bfloat16).view(2, 2048))
        plat.write_flag(C, f + 320, i)
    with torch.cuda.stream(C.torch):
        run("receiver step (wait, empty, copy, views, write)", receiver, [C])

    if args.graphs:
        graph_cases(plat, run, C, S, buf, slot, f, t1, t2)

    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"cases": out, "n": args.n, "rounds": args.rounds, "free_n": args.free_n,
                       "peer": args.peer, "device": torch.cuda.get_device_name(dev)}, fh, indent=1)
    for s in (C, S):
        s.close()
    for b in (buf, flags, peer):
        if b is not None:
            b.close()
    plat.close()
    return 0


def _capture(drv, S, body):
    """A graph of what ``body()`` queues on stream S (stream capture), instantiated."""
    relaxed = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    err, = drv.cuStreamBeginCapture(S.handle, relaxed)
    assert int(err) == 0, err
    body()
    err, graph = drv.cuStreamEndCapture(S.handle)
    assert int(err) == 0, err
    err, exe = drv.cuGraphInstantiate(graph, 0)
    assert int(err) == 0, err
    err, nodes, n = drv.cuGraphGetNodes(graph, 16)
    nodes = [x for x in nodes[:n] if x is not None]
    return graph, exe, nodes


def graph_cases(plat, run, C, S, buf, slot, f, t1, t2):
    """The sender's and receiver's copies (and flag operations) as CUDA graph launches."""
    import torch
    from cuda.bindings import driver as drv
    OK = 0
    stage = buf.ptr + (1 << 20)

    def pack():
        plat.copy_async(S, stage, t1.data_ptr(), 8192)
        plat.copy_async(S, stage + 8192, t2.data_ptr(), 8192)
    _, g_pack, _ = _capture(drv, S, pack)
    _, g_one, _ = _capture(drv, S, lambda: plat.copy_async(S, slot, stage, 16384))

    def side():
        plat.wait_flag(S, f + 128, 0)
        plat.copy_async(S, slot, stage, 16384)
        plat.write_flag(S, f + 192, 1)
    graph, g_side, nodes = _capture(drv, S, side)
    memops = [x for x in nodes if drv.cuGraphNodeGetType(x)[1] == drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_BATCH_MEM_OP]
    kinds = [str(drv.cuGraphNodeGetType(x)[1]).rsplit(".", 1)[-1] for x in nodes]
    print(f"side graph nodes: {kinds}", flush=True)
    ctx = drv.cuCtxGetCurrent()[1]
    W64 = drv.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WRITE_VALUE_64
    A64 = drv.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WAIT_VALUE_64
    GEQ = drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ

    def memop_params(op, addr, value):
        """Node parameters of one 64-bit wait (GEQ) or write (built fresh: the getter returns no array)."""
        q = drv.CUstreamBatchMemOpParams()
        q.operation = op
        w = q.writeValue if op == W64 else q.waitValue
        w.operation = op
        w.address = addr
        w.value64 = value
        w.flags = 0 if op == W64 else GEQ
        p = drv.CUDA_BATCH_MEM_OP_NODE_PARAMS()
        p.ctx = ctx
        p.count = 1
        p.paramArray = [q]
        p.flags = 0
        return p
    wait_node, write_node = memops        # captured in order: the wait first

    def launch(exe, stream):
        err, = drv.cuGraphLaunch(exe, stream.handle)
        if int(err) != OK:
            raise RuntimeError(f"cuGraphLaunch: {err}")
    run("graph: pack (2 memcpy nodes)", lambda i: launch(g_pack, C), [C])
    run("graph: 1 memcpy node (to the slot)", lambda i: launch(g_one, S), [S])
    run("graph: wait + memcpy + write (no update)", lambda i: launch(g_side, S), [S])

    def update(i):
        for node, p in ((wait_node, memop_params(A64, f + 128, 0)), (write_node, memop_params(W64, f + 192, i))):
            err, = drv.cuGraphExecBatchMemOpNodeSetParams(g_side, node, p)
            if int(err) != OK:
                raise RuntimeError(f"cuGraphExecBatchMemOpNodeSetParams: {err}")
    run("graph: 2 memop value updates (no launch)", update, [S])
    run("graph: side (2 updates + launch)", lambda i: (update(i), launch(g_side, S)), [S])

    ss = {"packed": plat.record_event(C), "copied": plat.record_event(S)}

    def sender(i):
        plat.stream_wait_event(C, ss["copied"])
        launch(g_pack, C)
        plat.record_event(C, ss["packed"])
        plat.stream_wait_event(S, ss["packed"])
        update(i)
        launch(g_side, S)
        plat.record_event(S, ss["copied"])
    run("sender step with graphs (pack graph + side graph)", sender, [C, S])

    def sender_mixed(i):
        plat.stream_wait_event(C, ss["copied"])
        launch(g_pack, C)
        plat.record_event(C, ss["packed"])
        plat.stream_wait_event(S, ss["packed"])
        plat.wait_flag(S, f + 128, 0)
        launch(g_one, S)
        plat.write_flag(S, f + 192, i)
        plat.record_event(S, ss["copied"])
    run("sender step, copies as graphs, flags plain", sender_mixed, [C, S])

    # do graph memcpy nodes run on copy engines? (a kernel in the trace would say no)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            launch(g_pack, C)
            launch(g_one, S)
        plat.synchronize(C, 30)
        plat.synchronize(S, 30)
    names = sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})
    print(f"GPU activities of the graph launches: {names}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
