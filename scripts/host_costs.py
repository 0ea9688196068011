"""Host cost of each call on the stage hand-off's per-step path, on one GPU (a tuning aid, not a test).

    PYTHONPATH=. python3 scripts/host_costs.py [--json PATH]

Times N calls of each platform hook the ``copy_engine`` transport makes per step,
and the raw ``cuda.bindings`` / torch calls under them, with the GPU kept busy
enough that nothing blocks; prints microseconds per call.
"""
from __future__ import annotations

import argparse
import json
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch
    from cuda.bindings import driver as drv

    from gpuxfer.platforms import get_platform
    plat = get_platform("cuda")
    dev = 0
    torch.cuda.set_device(dev)
    flags = plat.alloc(4096, dev)
    buf = plat.alloc(1 << 20, dev)
    cur = plat.current_stream(dev)
    side = plat.create_stream(dev)
    plat.memset_async(cur, flags.ptr, 0, 4096)
    plat.synchronize(cur, 10)
    ev = plat.record_event(cur)
    x = torch.empty(1 << 14, dtype=torch.uint8, device="cuda")
    h = int(side.handle)
    out = {}

    def timeit(name, fn):
        for _ in range(50):
            fn()
        t0 = time.perf_counter()
        for _ in range(args.n):
            fn()
        out[name] = (time.perf_counter() - t0) / args.n * 1e6
        plat.synchronize(side, 60)
        plat.synchronize(cur, 60)

    timeit("plat.current_stream", lambda: plat.current_stream(dev))
    timeit("torch.cuda.current_stream", lambda: torch.cuda.current_stream(dev))
    timeit("torch._C._cuda_getCurrentRawStream", lambda: torch._C._cuda_getCurrentRawStream(dev))
    timeit("plat.record_event", lambda: plat.record_event(side))
    reuse = plat.record_event(side)
    timeit("plat.record_event (re-record)", lambda: plat.record_event(side, reuse))
    timeit("torch.cuda.Event()+record", lambda: torch.cuda.Event().record(side.torch))
    timeit("plat.stream_wait_event", lambda: plat.stream_wait_event(side, ev))
    timeit("plat.write_flag", lambda: plat.write_flag(side, flags.ptr, 1))
    timeit("cuStreamWriteValue64 raw", lambda: drv.cuStreamWriteValue64(h, flags.ptr, 1, 0))
    geq = drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
    timeit("plat.wait_flag", lambda: plat.wait_flag(side, flags.ptr, 0))
    timeit("cuStreamWaitValue64 raw", lambda: drv.cuStreamWaitValue64(h, flags.ptr, 0, geq))
    timeit("plat.copy_async 16 KiB", lambda: plat.copy_async(side, buf.ptr, buf.ptr + (1 << 19), 1 << 14))
    timeit("cuMemcpyAsync raw 16 KiB", lambda: drv.cuMemcpyAsync(buf.ptr, buf.ptr + (1 << 19), 1 << 14, h))
    timeit("cuMemcpyDtoDAsync raw 16 KiB", lambda: drv.cuMemcpyDtoDAsync(buf.ptr, buf.ptr + (1 << 19), 1 << 14, h))
    import ctypes
    err, pfn, _ = drv.cuGetProcAddress(b"cuMemcpyAsync", 13000, 0)
    cfn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p)(int(pfn))
    timeit("cuMemcpyAsync ctypes 16 KiB", lambda: cfn(buf.ptr, buf.ptr + (1 << 19), 1 << 14, h))
    calls = plat.stream_calls(side)      # the bound per-step calls of the copy_engine transport
    timeit("stream_calls.write_flag", lambda: calls.write_flag(flags.ptr, 1))
    timeit("stream_calls.wait_flag", lambda: calls.wait_flag(flags.ptr, 0))
    cap = plat.create_stream(dev)
    graph = plat.capture_graph(cap, lambda st: (plat.copy_async(st, buf.ptr, buf.ptr + (1 << 19), 8192),
                                                plat.copy_async(st, buf.ptr + 8192, buf.ptr + (1 << 19) + 8192, 8192)))
    timeit("plat.launch_graph (2 copies)", lambda: plat.launch_graph(side, graph))
    timeit("stream_calls.launch_graph (2 copies)", lambda: calls.launch_graph(graph))
    timeit("cuGraphLaunch raw (2 copies)", lambda: drv.cuGraphLaunch(graph.exe, h))

    def proc(name, *argtypes):
        err, pfn, _ = drv.cuGetProcAddress(name, 12000, 0)
        return ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(int(pfn))
    w64 = proc(b"cuStreamWriteValue64", ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint)
    q64 = proc(b"cuStreamWaitValue64", ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint)
    gl = proc(b"cuGraphLaunch", ctypes.c_void_p, ctypes.c_void_p)
    exe = int(graph.exe)
    timeit("cuStreamWriteValue64 ctypes", lambda: w64(h, flags.ptr, 1, 0))
    timeit("cuStreamWaitValue64 ctypes", lambda: q64(h, flags.ptr, 0, 0))
    timeit("cuGraphLaunch ctypes (2 copies)", lambda: gl(exe, h))
    timeit("torch copy_ 16 KiB (SM kernel)", lambda: x[:1 << 13].copy_(x[1 << 13:]))
    ev2 = torch.cuda.Event()
    ev2.record(side.torch)
    timeit("cuEventRecord raw", lambda: drv.cuEventRecord(ev2.cuda_event, h))
    timeit("cuStreamWaitEvent raw", lambda: drv.cuStreamWaitEvent(h, ev2.cuda_event, 0))

    import numpy as np
    bd = np.array([buf.ptr, buf.ptr + 8192], dtype=np.int64)
    bs = np.array([buf.ptr + (1 << 19), buf.ptr + (1 << 19) + 8192], dtype=np.int64)
    bn = np.array([8192, 8192], dtype=np.int64)
    timeit("plat.copy_batch_async 2 x 8 KiB (created stream)", lambda: plat.copy_batch_async(side, bd, bs, bn))
    timeit("plat.copy_async 2 x 8 KiB", lambda: (plat.copy_async(side, buf.ptr, buf.ptr + (1 << 19), 8192),
                                                  plat.copy_async(side, buf.ptr + 8192, buf.ptr + (1 << 19) + 8192,
                                                                  8192)))

    # one copy_engine sender step's calls (a local stand-in: the 'peer' slot is on the same device)
    t1, t2 = x[:1 << 12].view(torch.bfloat16), x[1 << 12:1 << 13].view(torch.bfloat16)
    state = {"k": 0, "packed": None, "copied": [None, None]}

    def sender_step():
        k = state["k"] = state["k"] + 1
        c = plat.current_stream(dev)
        s_ = k & 1
        if state["copied"][s_] is not None:
            plat.stream_wait_event(c, state["copied"][s_])
        plat.copy_async(c, buf.ptr + s_ * 65536, t1.data_ptr(), 8192)
        plat.copy_async(c, buf.ptr + s_ * 65536 + 8192, t2.data_ptr(), 8192)
        state["packed"] = plat.record_event(c, state["packed"])
        plat.stream_wait_event(side, state["packed"])
        plat.wait_flag(side, flags.ptr, 0)
        plat.copy_async(side, buf.ptr + (1 << 19), buf.ptr + s_ * 65536, 16384)
        plat.write_flag(side, flags.ptr + 64, k)
        state["copied"][s_] = plat.record_event(side, state["copied"][s_])
    timeit("a copy_engine sender step (10 calls)", sender_step)

    # the sender's give-back words in shared host memory (gpuxfer.hostwords): a host load and store, a copy
    # graph that ends with the 8-byte publish from a value word, and the wait + value write as one flag_ops call
    from gpuxfer.platforms.base import FLAG_OP_WAIT, FLAG_OP_WRITE, flag_ops_array
    from gpuxfer.hostwords import HostWords
    words = HostWords.create(plat, dev, 4)
    loads = words.loads()
    timeit("host word load", lambda: loads[0] < 5)
    timeit("host word store", lambda: loads.__setitem__(16, 7))
    graph_pub = plat.capture_graph(cap, lambda st: (
        plat.copy_async(st, buf.ptr, buf.ptr + (1 << 19), 8192),
        plat.copy_async(st, buf.ptr + 8192, buf.ptr + (1 << 19) + 8192, 8192),
        plat.copy_async(st, flags.ptr + 128, words.ptr(2), 8)))
    timeit("stream_calls.launch_graph (2 copies + 8 B from host)", lambda: calls.launch_graph(graph_pub))
    ops = flag_ops_array([(FLAG_OP_WAIT, words.ptr(0), 0), (FLAG_OP_WRITE, words.ptr(2), 0)])
    timeit("plat.flag_ops (wait host word, write host word)", lambda: plat.flag_ops(side, ops))
    timeit("stream_calls.wait_flag (host word)", lambda: calls.wait_flag(words.ptr(0), 0))
    timeit("cuCtxGetCurrent raw", lambda: drv.cuCtxGetCurrent())
    timeit("torch.empty 16 KiB", lambda: torch.empty(1 << 14, dtype=torch.uint8, device="cuda"))
    timeit("tensor.data_ptr", lambda: x.data_ptr())
    for k, v in out.items():
        print(f"{k:32s} {v:8.2f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"us_per_call": out, "n": args.n}, f, indent=1)
    side.close()
    cap.close()
    words.close()
    buf.close()
    flags.close()
    plat.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
