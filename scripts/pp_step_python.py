"""The Python cost of one eager ``copy_engine`` step per side, with every platform call a no-op (CPU; a tuning aid).

    PYTHONPATH=. python scripts/pp_step_python.py [--steps N] [--meta] [--copy-out] [--profile] [--json PATH]

Builds a sender and a receiver in one process on a platform whose stream calls (flag waits and writes,
copies, graph launches, events) do nothing but count themselves, and times ``send()`` and
``recv().tensors`` step by step, alternating the two ends. The receiver hands out views of its slot
(``recv_views``: what ``gpuxfer bench pp --recv-views`` times), or with ``--copy-out`` copies each step
out into new tensors of its own (the default receiver, what ``gpuxfer bench pp`` times; its allocation is
torch's CPU one here). What it prints is the host time a step costs on top of its driver calls (the
calls per step are counted beside it): on a GPU add ~1-2 us per call.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time
import types


class NullStream:
    handle = 0

    def close(self) -> None:
        pass


class NullPlatform:
    """The platform hooks a steady-state step calls, each a counted no-op."""

    name = "null"
    is_emulation = False
    host_memory = False
    QUEUED = ("wait_flag", "write_flag", "flag_ops", "copy_async", "launch_graph", "record_event",
              "stream_wait_event")

    def __init__(self):
        self.calls = collections.Counter()
        self._stream = NullStream()
        self.counting = False
        for name in self.QUEUED:
            setattr(self, name, self._counter(name))

    def _counter(self, name: str):
        calls = self.calls

        def op(*args):
            calls[name] += 1
        return op

    def current_stream(self, device):
        return self._stream

    def stream_calls(self, stream):
        from gpuxfer.platforms.base import StreamCalls
        return StreamCalls(stream, self._counter("write_flag"), self._counter("wait_flag"),
                           self._counter("launch_graph"), self._counter("flag_ops"))

    def create_stream(self, device):
        return NullStream()

    def is_capturing(self, stream) -> bool:
        return False

    def capture_graph(self, stream, record):
        record(stream)
        return object()

    def read_flag(self, ptr, device) -> int:
        return 1 << 62


class HarnessDevice:
    """A device the CPU tensors' get_device() (-1) matches, and their .device equals, not of type "cpu": the
    GPU's per-step checks run (the first step of a shape takes the checked path, later ones the fast one)."""

    type, index = "null", -1

    def __eq__(self, other) -> bool:
        import torch
        return other == torch.device("cpu")

    def __hash__(self) -> int:
        return hash("cpu")

    def __repr__(self) -> str:
        return "HarnessDevice(null, -1)"


def cuda_stub():
    """The cuda platform's own Python, over a driver whose calls return success at once (counted; the ctypes
    entry points of ``stream_calls`` are Python functions here, so their ctypes argument conversion is left out)."""
    from gpuxfer.platforms import cuda, cuda_driver
    calls = collections.Counter()

    def fn(name):
        def call(*args):
            calls[name] += 1
            return (0,)
        call.__name__ = name
        return call
    names = ("cuStreamWriteValue64", "cuStreamWaitValue64", "cuGraphLaunch", "cuMemcpyAsync", "cuEventRecord",
             "cuStreamWaitEvent", "cuCtxGetCurrent")
    cuda_driver._DRIVER = types.SimpleNamespace(**{n: fn(n) for n in names})

    def entry(name):                        # entry points through ctypes: a C status, 0
        def call(*args):
            calls[name] += 1
            return 0
        return call
    plat = cuda.CudaPlatform()
    plat._contexts.count, plat._contexts.ctxs[0] = 1, (None, 1)
    plat._flags._memop = entry("cuStreamBatchMemOp")   # flag_ops (GPUXFER_PP_FLAG_BATCH=1)
    stream = cuda.CudaStream(0, 0, None)       # torch's default stream, as in the bench
    plat._streams._raw_stream = lambda device: 0
    plat._streams._current[(0, 0)] = stream
    plat.create_stream = lambda device: cuda.CudaStream(0, 0x100, None, plat)
    plat.is_capturing = lambda s: False
    plat.capture_graph = lambda s, record: cuda.CudaGraph(0, None, 0)
    plat._flags._step_fns = tuple(entry(n) for n in ("cuStreamWriteValue64", "cuStreamWaitValue64",
                                                     "cuGraphLaunch", "cuCtxGetCurrent", "cuMemcpyAsync"))
    plat.calls = calls
    return plat


def build(metadata: bool, slots: int = 2, platform: str = "null", flag_batch: bool = False,
          host_give_back: bool = False, recv_views: bool = True):
    """A (sender, receiver) pair on :class:`NullPlatform` (or the cuda platform over a stub driver), set up
    by hand (no peers, no device memory). ``host_give_back``: the sender's empty words are host memory it
    loads (as with ``GPUXFER_PP_HOST_GIVE_BACK=1``), here always showing the slot free. ``recv_views``
    False: the receiver copies each step out into new CPU tensors (the copy itself a counted no-op)."""
    import torch

    from gpuxfer.pp.copy_engine import W_IN, CopyEngineTransport
    from gpuxfer.pp.mailbox import Mailbox
    from gpuxfer.pp.spec import SpecTable
    plat = NullPlatform() if platform == "null" else cuda_stub()
    dev = HarnessDevice()
    specs = SpecTable({"hidden": ((1 << 18,), torch.bfloat16), "residual": ((1 << 18,), torch.bfloat16)})
    ends = []
    for role in ("send", "recv"):
        t = CopyEngineTransport(platform=plat, role=role, rank=0 if role == "send" else 1,
                                peer=1 if role == "send" else 0, device=0, specs=specs, timeout_s=30.0,
                                metadata=metadata, group=None, tag_base=0,
                                torch_device=dev if role == "send" else torch.device("cpu"),
                                recv_slots=slots, recv_views=recv_views, flag_path="remote")
        base = 1 << 40 if role == "send" else 1 << 41
        t.remote_flags = True
        t._in_ptr = [base + (W_IN + j) * 64 for j in range(slots)]
        t._stage_ptr = [base + (W_IN + slots + j) * 64 for j in range(slots)]
        t._peer_in_ptr = [(base ^ (3 << 40)) + (W_IN + j) * 64 for j in range(slots)]
        if role == "send":
            t._cap = plat.create_stream(0)
            t._peer_slot_ptr = [(1 << 42) + j * specs.slot_bytes for j in range(slots)]
            t._staging_ptr = [(1 << 43) + s * specs.slot_bytes for s in range(2)]
            if host_give_back:
                import ctypes
                t._free_loads = (ctypes.c_int64 * (16 * slots))(*([1 << 40] * (8 * slots)))   # empty, value
                t._value_ptr = [(1 << 45) + (slots + j) * 64 for j in range(slots)]
        else:
            t._slot_ptr = [(1 << 44) + j * specs.slot_bytes for j in range(slots)]
            if flag_batch:      # as setup_finish makes them with GPUXFER_PP_FLAG_BATCH=1
                from gpuxfer.platforms.base import FLAG_OP_WAIT, FLAG_OP_WRITE, flag_ops_array
                t._lend_arrays = [flag_ops_array([(FLAG_OP_WRITE, t._peer_in_ptr[(j - 1) % slots], 0),
                                                  (FLAG_OP_WAIT, t._in_ptr[j], 0)]) for j in range(slots)]
                t._lend_ops = [memoryview(a).cast("B").cast("Q") for a in t._lend_arrays]
            t._data_bytes = torch.zeros(slots * specs.slot_bytes, dtype=torch.uint8)
        t._state = "open"
        ends.append(t)
    if metadata:
        name = f"gx-pp-harness-{os.getpid()}"
        box = Mailbox.create(name, specs.meta_len, 7)
        ends[0].meta, ends[1].meta = Mailbox.open(name, specs.meta_len, 7), box
        box.unlink()
    return plat, ends


def measure(steps: int, metadata: bool, size: int, profile: bool, platform: str = "null",
            flag_batch: bool = False, host_give_back: bool = False, recv_views: bool = True) -> dict:
    import torch
    plat, (snd, rcv) = build(metadata, platform=platform, flag_batch=flag_batch, host_give_back=host_give_back,
                             recv_views=recv_views)
    n = size // 4
    srcs = [{"hidden": torch.zeros(n, dtype=torch.bfloat16), "residual": torch.zeros(n, dtype=torch.bfloat16)}
            for _ in range(5)]              # five source sets in turn, as the bench's steps
    shapes = {"hidden": (n,), "residual": (n,)}
    perf = time.perf_counter
    warm = 20
    prof = None
    if profile:
        import cProfile
        prof = cProfile.Profile()
    send_s, recv_s = [], []
    for k in range(1, warm + steps + 1):
        if k == warm + 1:
            plat.calls.clear()
            if prof is not None:
                prof.enable()
        src = srcs[k % 5]
        t0 = perf()
        snd.send(src)
        t1 = perf()
        r = rcv.recv() if metadata else rcv.recv(shapes=shapes)
        r.tensors
        t2 = perf()
        if k > warm:
            send_s.append(t1 - t0)
            recv_s.append(t2 - t1)
        if len(snd._wd) > 256:      # the watchdog's work, off the step
            snd._wd.clear()
            rcv._wd.clear()
    if prof is not None:
        prof.disable()
        import io
        import pstats
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        print(buf.getvalue())
    calls = {k: v / steps for k, v in sorted(plat.calls.items())}
    return {"platform": platform, "flag_batch": flag_batch, "host_give_back": host_give_back,
            "recv_views": recv_views, "size_bytes": size, "metadata": metadata, "steps": steps,
            "send_us_median": statistics.median(send_s) * 1e6, "recv_us_median": statistics.median(recv_s) * 1e6,
            "send_us_mean": statistics.fmean(send_s) * 1e6, "recv_us_mean": statistics.fmean(recv_s) * 1e6,
            "calls_per_step_both_sides": calls}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--size", type=int, default=64 << 10, help="bytes per step (two bf16 tensors)")
    ap.add_argument("--meta", action="store_true", help="shapes travel through the shared-memory mailbox")
    ap.add_argument("--platform", choices=["null", "cuda-stub"], default="null",
                    help="null: every platform call a no-op; cuda-stub: the cuda platform's wrappers over a driver "
                         "that returns at once (their Python counted in)")
    ap.add_argument("--flag-batch", action="store_true",
                    help="the receiver's give-back and wait as one flag_ops call (GPUXFER_PP_FLAG_BATCH=1)")
    ap.add_argument("--host-give-back", action="store_true",
                    help="the sender sees its slot free on the host and queues no wait (GPUXFER_PP_HOST_GIVE_BACK=1)")
    ap.add_argument("--copy-out", action="store_true",
                    help="the default receiver: each step copied out into new tensors (no recv_views)")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of the timed steps")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res = measure(args.steps, args.meta, args.size, args.profile, args.platform, args.flag_batch,
                  args.host_give_back, not args.copy_out)
    print(f"{args.platform}{' flag-batch' if args.flag_batch else ''}"
          f"{' host-give-back' if args.host_give_back else ''}{' copy-out' if args.copy_out else ' recv-views'}, "
          f"{args.size} B, {'+' if args.meta else '-'}meta: send {res['send_us_median']:.2f} us "
          f"(mean {res['send_us_mean']:.2f}), recv + .tensors {res['recv_us_median']:.2f} us "
          f"(mean {res['recv_us_mean']:.2f}); platform calls per step (both ends): "
          f"{res['calls_per_step_both_sides']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
