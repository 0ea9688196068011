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
engines, or a kernel). ``--variants`` times each call through other bindings (the raw
cuda.bindings call, ctypes into libcuda, CuPy's runtime, torch) and the sender's step through
each, to tell the driver's own cost from a wrapper's. Prints a table; ``--json`` writes it.
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
    ap.add_argument("--variants", action="store_true",
                    help="also time each call through other bindings (raw cuda.bindings, ctypes, CuPy, torch)")
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

    def sender_inline(i):      # copy_engine.py's _send_inline: a small step on the caller's stream
        k = ss["k"] = ss["k"] + 1
        s_ = k & 1
        plat.wait_flag(C, f + 128, 0)
        plat.copy_async(C, slot + s_ * 65536, t1.data_ptr(), 8192)
        plat.copy_async(C, slot + s_ * 65536 + 8192, t2.data_ptr(), 8192)
        plat.write_flag(C, f + 192, k)
    run("sender step inline (4 calls)", sender_inline, [C])

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
    if args.variants:
        variant_cases(plat, run, C, S, buf, slot, f, t1, t2)

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


def variant_cases(plat, run, C, S, buf, slot, f, t1, t2):
    """Each per-step call through other bindings, to split a call's host cost into the driver's own
    and the binding's: the platform's wrapper, the raw ``cuda.bindings`` call, a ctypes call into
    libcuda, CuPy's runtime wrapper and torch's own copy."""
    import ctypes

    import cupy
    import numpy as np
    import torch
    from cuda.bindings import driver as drv

    lib = ctypes.CDLL("libcuda.so.1")
    u64, vp, ui, sz = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint, ctypes.c_size_t

    def fn(names, argtypes):
        for n in names:
            try:
                f_ = getattr(lib, n)
            except AttributeError:
                continue
            f_.argtypes, f_.restype = argtypes, ctypes.c_int
            return f_
        raise RuntimeError(f"libcuda has none of {names}")
    c_copy = fn(["cuMemcpyAsync"], [u64, u64, sz, vp])
    c_d2d = fn(["cuMemcpyDtoDAsync_v2", "cuMemcpyDtoDAsync"], [u64, u64, sz, vp])
    c_write = fn(["cuStreamWriteValue64_v2", "cuStreamWriteValue64"], [vp, u64, u64, ui])
    c_wait = fn(["cuStreamWaitValue64_v2", "cuStreamWaitValue64"], [vp, u64, u64, ui])
    c_record = fn(["cuEventRecord"], [vp, vp])
    c_swait = fn(["cuStreamWaitEvent"], [vp, vp, ui])
    c_ctx = fn(["cuCtxGetCurrent"], [ctypes.POINTER(vp)])
    out_ctx = vp()

    def check(rc):
        if rc != 0:
            raise RuntimeError(f"CUresult {rc}")

    Sh, Ch = S.handle, C.handle
    Sv, Cv = vp(Sh), vp(Ch)
    src, dst = buf.ptr + (1 << 20), buf.ptr
    n = 1 << 14

    def raw_event():
        err, ev = drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        check(int(err))
        return ev
    evA, evB = raw_event(), raw_event()
    check(int(drv.cuEventRecord(evA, Ch)[0]))
    evA_int, evB_int = int(evA), int(evB)
    evA_v, evB_v = vp(evA_int), vp(evB_int)
    S_obj = drv.CUstream(Sh)
    GEQ = 1

    run("python: a no-op call", lambda i: None, [S])
    run("cuCtxGetCurrent: bindings", lambda i: drv.cuCtxGetCurrent(), [S])
    run("cuCtxGetCurrent: ctypes", lambda i: c_ctx(ctypes.byref(out_ctx)), [S])
    for label, d, s_ in (("local", dst, src), ("peer", slot, buf.ptr)):
        run(f"copy {label} 16 KiB: platform", lambda i, d=d, s_=s_: plat.copy_async(S, d, s_, n), [S])
        run(f"copy {label} 16 KiB: bindings cuMemcpyAsync",
            lambda i, d=d, s_=s_: check(int(drv.cuMemcpyAsync(d, s_, n, Sh)[0])), [S])
        run(f"copy {label} 16 KiB: bindings, CUstream object",
            lambda i, d=d, s_=s_: check(int(drv.cuMemcpyAsync(d, s_, n, S_obj)[0])), [S])
        run(f"copy {label} 16 KiB: bindings cuMemcpyDtoDAsync",
            lambda i, d=d, s_=s_: check(int(drv.cuMemcpyDtoDAsync(d, s_, n, Sh)[0])), [S])
        run(f"copy {label} 16 KiB: ctypes cuMemcpyAsync", lambda i, d=d, s_=s_: check(c_copy(d, s_, n, Sv)), [S])
        run(f"copy {label} 16 KiB: ctypes cuMemcpyDtoDAsync", lambda i, d=d, s_=s_: check(c_d2d(d, s_, n, Sv)), [S])
        run(f"copy {label} 16 KiB: cupy runtime memcpyAsync",
            lambda i, d=d, s_=s_: cupy.cuda.runtime.memcpyAsync(d, s_, n, 4, Sh), [S])
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty(n, dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(S.torch):
        run("copy local 16 KiB: torch copy_ (non_blocking)", lambda i: a.copy_(b, non_blocking=True), [S])
    run("write_flag: platform", lambda i: plat.write_flag(S, f, i), [S])
    run("write_flag: bindings", lambda i: check(int(drv.cuStreamWriteValue64(Sh, f, i, 0)[0])), [S])
    run("write_flag: ctypes", lambda i: check(c_write(Sv, f, i, 0)), [S])
    run("wait_flag: platform", lambda i: plat.wait_flag(S, f + 64, 0), [S])
    run("wait_flag: bindings", lambda i: check(int(drv.cuStreamWaitValue64(Sh, f + 64, 0, GEQ)[0])), [S])
    run("wait_flag: ctypes", lambda i: check(c_wait(Sv, f + 64, 0, GEQ)), [S])
    ev = [plat.record_event(C)]
    run("record_event: platform", lambda i: plat.record_event(S, ev[0]), [S])
    run("record_event: bindings", lambda i: check(int(drv.cuEventRecord(evB_int, Sh)[0])), [S])
    run("record_event: ctypes", lambda i: check(c_record(evB_v, Sv)), [S])
    evc = plat.record_event(C)
    run("stream_wait_event: platform", lambda i: plat.stream_wait_event(S, evc), [S])
    run("stream_wait_event: bindings", lambda i: check(int(drv.cuStreamWaitEvent(Sh, evA_int, 0)[0])), [S])
    run("stream_wait_event: ctypes", lambda i: check(c_swait(Sv, evA_v, 0)), [S])

    d2 = np.array([dst, dst + 8192], dtype=np.int64)
    s2 = np.array([src, src + 8192], dtype=np.int64)
    n2 = np.array([8192, 8192], dtype=np.int64)
    run("copy local 2 x 8 KiB: platform copy_batch_async (created stream)",
        lambda i: plat.copy_batch_async(S, d2, s2, n2), [S])
    ctx = drv.cuCtxGetCurrent()[1]
    run("copy local 16 KiB: bindings cuMemcpyPeerAsync (same context twice)",
        lambda i: check(int(drv.cuMemcpyPeerAsync(dst, ctx, src, ctx, n, Sh)[0])), [S])

    # the sender's step of copy_engine.py (remote flag path), every call through one binding
    st = {"k": 0}
    ev1, ev2 = raw_event(), raw_event()
    cop = [vp(int(ev1)), vp(int(ev2))]
    cop_i = [int(ev1), int(ev2)]
    stage, peer_slot = buf.ptr + (2 << 20), slot
    p1, p2 = t1.data_ptr(), t2.data_ptr()

    def sender_ctypes(i):
        k = st["k"] = st["k"] + 1
        s_ = k & 1
        check(c_swait(Cv, cop[s_], 0))
        check(c_copy(stage + s_ * 65536, p1, 8192, Cv))
        check(c_copy(stage + s_ * 65536 + 8192, p2, 8192, Cv))
        check(c_record(evA_v, Cv))
        check(c_swait(Sv, evA_v, 0))
        check(c_wait(Sv, f + 128, 0, GEQ))
        check(c_copy(peer_slot + s_ * 65536, stage + s_ * 65536, 16384, Sv))
        check(c_write(Sv, f + 192, k, 0))
        check(c_record(cop[s_], Sv))

    def sender_bindings(i):
        k = st["k"] = st["k"] + 1
        s_ = k & 1
        check(int(drv.cuStreamWaitEvent(Ch, cop_i[s_], 0)[0]))
        check(int(drv.cuMemcpyAsync(stage + s_ * 65536, p1, 8192, Ch)[0]))
        check(int(drv.cuMemcpyAsync(stage + s_ * 65536 + 8192, p2, 8192, Ch)[0]))
        check(int(drv.cuEventRecord(evA_int, Ch)[0]))
        check(int(drv.cuStreamWaitEvent(Sh, evA_int, 0)[0]))
        check(int(drv.cuStreamWaitValue64(Sh, f + 128, 0, GEQ)[0]))
        check(int(drv.cuMemcpyAsync(peer_slot + s_ * 65536, stage + s_ * 65536, 16384, Sh)[0]))
        check(int(drv.cuStreamWriteValue64(Sh, f + 192, k, 0)[0]))
        check(int(drv.cuEventRecord(cop_i[s_], Sh)[0]))
    ev_a, ev_b = plat.record_event(C), plat.record_event(S)
    cp = [plat.record_event(S), plat.record_event(S)]
    packs = [(np.array([stage + s_ * 65536, stage + s_ * 65536 + 8192], dtype=np.int64),
              np.array([p1, p2], dtype=np.int64)) for s_ in range(2)]

    def sender_platform(i):       # copy_engine.py's _send_impl through the platform (remote flags)
        k = st["k"] = st["k"] + 1
        s_ = k & 1
        base = stage + s_ * 65536
        plat.stream_wait_event(C, cp[s_])
        plat.copy_async(C, base, p1, 8192)
        plat.copy_async(C, base + 8192, p2, 8192)
        plat.record_event(C, ev_a)
        plat.stream_wait_event(S, ev_a)
        plat.wait_flag(S, f + 128, 0)
        plat.copy_async(S, peer_slot + s_ * 65536, base, 16384)
        plat.write_flag(S, f + 192, k)
        plat.record_event(S, cp[s_])

    def sender_side_batch(i):     # the pack on the side stream, one batch call; the caller waits for it
        k = st["k"] = st["k"] + 1
        s_ = k & 1
        base = stage + s_ * 65536
        plat.record_event(C, ev_a)
        plat.stream_wait_event(S, ev_a)
        plat.copy_batch_async(S, packs[s_][0], packs[s_][1], n2)
        plat.record_event(S, ev_b)
        plat.stream_wait_event(C, ev_b)
        plat.wait_flag(S, f + 128, 0)
        plat.copy_async(S, peer_slot + s_ * 65536, base, 16384)
        plat.write_flag(S, f + 192, k)

    for _ in range(2):     # interleaved, twice: the host's speed drifts
        run("sender step (9 calls): ctypes", sender_ctypes, [C, S])
        run("sender step (9 calls): bindings", sender_bindings, [C, S])
        run("sender step (9 calls): platform", sender_platform, [C, S])
        run("sender step, pack by one batch on the side stream (8 calls): platform", sender_side_batch, [C, S])


if __name__ == "__main__":
    raise SystemExit(main())
