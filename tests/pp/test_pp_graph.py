"""Graph mode (``connect(graph=True)``): steps captured once, moved by replays, every byte checked.

On the host emulation a capture records the stream's operations and a replay enqueues them again, so the
protocol's flag logic (tokens set by the peer and consumed by the waiter, the device-side step counters, the
watchdog's release) runs here; marked ``gpu``, the same sessions run with ``torch.cuda.graph`` on one GPU
(two processes on one device).
"""
from __future__ import annotations

import os
import time

import pytest

TIMEOUT = 1.5
SPECS = {"hidden": ((24, 40), "bfloat16"), "pos": ((24,), "int64")}


def _specs():
    import torch
    return {k: (s, getattr(torch, d)) for k, (s, d) in SPECS.items()}


def _pattern(i: int, device) -> dict:
    """Replay i's bytes (every bit pattern, NaNs included); the same on both ends."""
    import torch
    g = torch.Generator().manual_seed(7919 * i + 13)
    out = {}
    for name, (shape, dt) in SPECS.items():
        dtype = getattr(torch, dt)
        n = torch.empty(shape, dtype=dtype).numel() * torch.empty((), dtype=dtype).element_size()
        out[name] = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).view(shape).to(device)
    return out


class _Env:
    """What a session needs on either platform: capture, launch on the current stream, synchronize."""

    def __init__(self, platform_name: str, rank: int, world: int, init_method: str):
        # "cuda": both ranks on device 0; "cuda-2": rank r on device r (two GPUs)
        platform_name, _, split = platform_name.partition("-")
        os.environ["GPUXFER_PLATFORM"] = platform_name
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        import torch

        from gpuxfer.platforms import get_platform
        from gpuxfer.pp.launch import init_cpu_group
        init_cpu_group(rank, world, init_method)
        self.plat = get_platform(platform_name)
        self.emu = self.plat.is_emulation
        self.device = rank if split else 0
        self.tdev = torch.device("cpu") if self.emu else torch.device("cuda", self.device)
        if self.emu:
            torch.set_num_threads(1)        # torch runs on the stream workers: no intra-op pool to contend
        else:
            torch.cuda.set_device(self.device)

    def capture(self):
        import torch
        if self.emu:
            return self.plat.capture(device=self.device)
        g = torch.cuda.CUDAGraph()
        ctx = torch.cuda.graph(g)

        class _Cap:
            def __enter__(s):
                ctx.__enter__()
                return g

            def __exit__(s, *exc):
                return ctx.__exit__(*exc)
        return _Cap()

    def launch(self, fn) -> None:
        """Run ``fn`` (torch ops) in the current stream's order (recorded if it captures)."""
        self.plat.launch(self.plat.current_stream(self.device), fn)

    def sync(self, timeout_s: float = 60.0) -> bool:
        return self.plat.synchronize(self.plat.current_stream(self.device), timeout_s)

    def close(self) -> None:
        import torch.distributed as dist
        dist.destroy_process_group()
        self.plat.close()


def _connect(env, rank: int, **kw):
    import torch.distributed as dist

    from gpuxfer.pp import connect
    g = dist.new_group(backend="gloo")
    return connect(g, send_to=1 if rank == 0 else None, recv_from=0 if rank == 1 else None, specs=_specs(),
                   platform=env.plat, device=env.device, graph=True, **kw)


# --------------------------------------------------------------------------- sessions


def replay_session(rank: int, world: int, init_method: str, platform_name: str, replays: int) -> dict:
    """Capture a step in each of two graphs (slots 0 and 1; out= and a pool buffer), replay them alternately
    with fresh bytes each time, check every byte of every replay; mixing eager and graph steps raises."""
    import torch
    import torch.distributed as dist

    from gpuxfer.errors import BadInput, GraphModeError
    env = _Env(platform_name, rank, world, init_method)
    out = {}
    try:
        with pytest.raises(BadInput, match="cannot be captured"):
            _connect(env, rank, backend="nccl")
        conn = _connect(env, rank, timeout_s=60)
        assert conn.backend == "copy_engine_graph"
        with conn:
            if rank == 0:
                t = conn.sender()
                static = [{k: torch.zeros(s, dtype=getattr(torch, d), device=env.tdev)
                           for k, (s, d) in SPECS.items()} for _ in range(2)]
                with pytest.raises(GraphModeError):          # an eager step on a graph transport
                    t.send(static[0])
                graphs = []
                for c in range(3):        # the third is never replayed (its receive is refused, see rank 1)
                    with env.capture() as g:
                        t.send(static[c % 2])
                    graphs.append(g)
                assert t.step == 3
                with pytest.raises(GraphModeError):          # still refused after capture, still usable
                    t.send(static[0])
                pats = [_pattern(i, env.tdev) for i in range(5)]
                for i in range(replays):
                    c = i % 2

                    def fill(c=c, i=i):
                        for k in SPECS:
                            static[c][k].copy_(pats[i % 5][k])
                    env.launch(fill)          # ordered before the replay that reads it, after the last one
                    graphs[c].replay()
                assert env.sync()
                t.synchronize()
                out["device_steps"] = t.device_steps()
            else:
                t = conn.receiver()
                outbuf = {k: torch.zeros(s, dtype=getattr(torch, d), device=env.tdev) for k, (s, d) in SPECS.items()}
                with pytest.raises(GraphModeError):
                    t.recv(out=outbuf)
                with env.capture() as g0:
                    got0 = t.recv(out=outbuf).tensors
                with env.capture() as g1:
                    rcv1 = t.recv()
                    got1 = rcv1.tensors               # views of a buffer the graph owns
                rcv_late = None
                with env.capture():
                    rcv_late = t.recv()               # captured receive, .tensors read after the capture
                wrong = 0
                for i in range(replays):
                    (g0 if i % 2 == 0 else g1).replay()
                    assert env.sync()
                    want = _pattern(i % 5, env.tdev)
                    got = got0 if i % 2 == 0 else got1
                    for k in SPECS:
                        assert got[k].shape == want[k].shape and got[k].dtype == want[k].dtype
                        wrong += int((got[k].contiguous().view(torch.uint8) != want[k].view(torch.uint8)).sum())
                out["wrong"] = wrong
                with pytest.raises(GraphModeError, match="outside graph capture"):
                    rcv_late.tensors
                out["broken_by_late_tensors"] = t.error is not None
                out["device_steps"] = t.device_steps() if t.error is None else None
            dist.barrier()
    finally:
        env.close()
    return out


def timeout_session(rank: int, world: int, init_method: str, platform_name: str) -> dict:
    """A replay whose peer never replays ends in TransferTimeout (both directions); nothing hangs after."""
    import torch
    import torch.distributed as dist

    from gpuxfer.errors import TransferTimeout
    env = _Env(platform_name, rank, world, init_method)
    out = {}
    try:
        # A. the receiver replays, the sender never does: full[0] never arrives
        # B. the sender replays twice, the receiver never does: the second waits for empty[0]
        for case in ("A", "B"):
            conn = _connect(env, rank, timeout_s=TIMEOUT)
            static = {k: torch.ones(s, dtype=getattr(torch, d), device=env.tdev) for k, (s, d) in SPECS.items()}
            waiter = (rank == 1) if case == "A" else (rank == 0)
            with env.capture() as g:
                if rank == 0:
                    conn.sender().send(static)
                else:
                    conn.receiver().recv(out=static).tensors
            t = conn.transports[0]
            if waiter:
                t0 = time.monotonic()
                for _ in range(1 if case == "A" else 2):
                    g.replay()
                with pytest.raises(TransferTimeout) as ei:
                    t.synchronize(TIMEOUT * 6)
                out[f"{case}:s"] = time.monotonic() - t0
                e = ei.value
                out[case] = (e.rank, e.step, e.flag, e.expected, e.seen)
                assert env.sync(10.0), "the stuck replay was not released"
                g.replay()                             # broken: released on the next poll, no hang
                out[f"{case}:replay_after_error"] = env.sync(10.0)
                with pytest.raises(TransferTimeout):
                    t.synchronize()
            dist.barrier()
            t0 = time.monotonic()
            conn.close()
            out[f"{case}:close_s"] = time.monotonic() - t0
            del g
    finally:
        env.close()
    return out


def decode_session(rank: int, world: int, init_method: str, platform_name: str, steps: int) -> dict:
    """A two-stage decode loop: rank 0 h = tanh(x W0) -> send -> (rank 1: recv, tanh(h W1), pos + 1, send) ->
    recv into x, acc += x; each rank's step is one captured graph, replayed ``steps`` times, then compared
    bit for bit with the same loop run eagerly in one process on the same device."""
    import torch
    import torch.distributed as dist

    from gpuxfer.pp import connect
    env = _Env(platform_name, rank, world, init_method)
    torch.backends.cuda.matmul.allow_tf32 = False
    n, d = 16, 128
    specs = {"h": ((n, d), torch.float32), "pos": ((1,), torch.int64)}

    def weights(seed):
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(d, d, generator=g) * (2.0 / d ** 0.5)).to(env.tdev)

    W0, W1 = weights(1), weights(2)
    x0 = torch.randn(n, d, generator=torch.Generator().manual_seed(3)).to(env.tdev)
    out = {}
    try:
        g = dist.new_group(backend="gloo")
        peer = 1 - rank
        conn = connect(g, send_to=peer, recv_from=peer, specs=specs, platform=env.plat, device=env.device,
                       graph=True, timeout_s=60)
        with conn:
            snd, rcv = conn.sender(), conn.receiver()
            if rank == 0:
                x, pos, acc = x0.clone(), torch.zeros(1, dtype=torch.int64, device=env.tdev), torch.zeros_like(x0)
                a = torch.empty_like(x0)

                def stage0():
                    a.copy_(torch.tanh(x @ W0))

                def accumulate():
                    acc.add_(x)
                env.launch(stage0)            # warm up (cuBLAS) outside the capture
                assert env.sync()
                with env.capture() as graph:
                    env.launch(stage0)
                    snd.send({"h": a, "pos": pos})
                    rcv.recv(out={"h": x, "pos": pos}).tensors
                    env.launch(accumulate)
            else:
                y, pos = torch.empty(n, d, device=env.tdev), torch.zeros(1, dtype=torch.int64, device=env.tdev)
                b, pos_b = torch.empty(n, d, device=env.tdev), torch.zeros(1, dtype=torch.int64, device=env.tdev)

                def stage1():
                    b.copy_(torch.tanh(y @ W1))
                    pos_b.copy_(pos + 1)
                env.launch(stage1)
                assert env.sync()
                with env.capture() as graph:
                    rcv.recv(out={"h": y, "pos": pos}).tensors
                    env.launch(stage1)
                    snd.send({"h": b, "pos": pos_b})
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                graph.replay()
            host_s = time.perf_counter() - t0
            assert env.sync(120.0)
            wall_s = time.perf_counter() - t0
            conn.synchronize()
            out.update(host_us_per_step=host_s / steps * 1e6, step_us=wall_s / steps * 1e6,
                       device_steps=[snd.device_steps(), rcv.device_steps()])
            if rank == 0:
                rx, rpos, racc = x0.clone(), torch.zeros(1, dtype=torch.int64, device=env.tdev), torch.zeros_like(x0)
                for _ in range(steps):      # the same loop, eager, one process
                    ra = torch.tanh(rx @ W0)
                    rx = torch.tanh(ra @ W1)
                    rpos = rpos + 1
                    racc.add_(rx)
                out["pos"] = int(pos.item())
                out["exact"] = [bool(torch.equal(x.view(torch.int32), rx.view(torch.int32))),
                                bool(torch.equal(acc.view(torch.int32), racc.view(torch.int32))),
                                bool(torch.equal(pos, rpos))]
            dist.barrier()
            del graph
    finally:
        env.close()
    return out


# --------------------------------------------------------------------------- tests

GPU = pytest.mark.gpu


@pytest.fixture(params=[pytest.param("host", id="host"), pytest.param("cuda", id="cuda", marks=GPU),
                        pytest.param("cuda-2", id="cuda-2gpu", marks=GPU)])
def graph_platform(request):
    """host; cuda: two processes on device 0; cuda-2: rank r on device r (skipped with fewer than two)."""
    from _skips import platform_reason
    name = request.param.partition("-")[0]
    why = platform_reason(name)
    if why is not None:
        pytest.skip(f"platform {name} unavailable: {why}")
    if request.param == "cuda-2":
        import torch
        if torch.cuda.device_count() < 2:
            pytest.skip("needs two GPUs")
    return request.param


def test_replays_move_steps_every_byte_checked(spawner, graph_platform):
    replays = 24 if graph_platform == "host" else 400
    s, r = spawner.run_ranks(replay_session, 2, graph_platform, replays, timeout=180)
    assert r["wrong"] == 0
    assert s["device_steps"] == replays
    assert r["broken_by_late_tensors"]


def test_stuck_peer_during_replay_times_out(spawner, graph_platform):
    s, r = spawner.run_ranks(timeout_session, 2, graph_platform, timeout=180)
    # A: the receiver's first replay waits for full[0] (never published); B: the sender's second replay
    # waits for empty[0] (the receiver never consumed the first)
    assert r["A"] == (1, 1, "full[0]", 1, 0)
    assert s["B"] == (0, 2, "empty[0]", 1, 0)
    for who, case in ((r, "A"), (s, "B")):
        assert who[f"{case}:replay_after_error"]
        assert who[f"{case}:s"] < TIMEOUT + 10
    for who in (r, s):
        assert who["A:close_s"] < 30 and who["B:close_s"] < 30


def test_captured_decode_loop_bit_exact(spawner, graph_platform):
    steps = 50 if graph_platform == "host" else 2000
    r0, r1 = spawner.run_ranks(decode_session, 2, graph_platform, steps, timeout=240)
    assert r0["exact"] == [True, True, True] and r0["pos"] == steps
    assert r0["device_steps"] == [steps, steps] and r1["device_steps"] == [steps, steps]


@GPU
@pytest.mark.slow
def test_captured_decode_loop_ten_thousand_steps(spawner):
    from _skips import platform_reason
    why = platform_reason("cuda")
    if why is not None:
        pytest.skip(why)
    r0, r1 = spawner.run_ranks(decode_session, 2, "cuda", 10_000, timeout=300)
    assert r0["exact"] == [True, True, True] and r0["pos"] == 10_000
    print(f"graph decode loop: {r0['step_us']:.2f} us per step, host {r0['host_us_per_step']:.2f} / "
          f"{r1['host_us_per_step']:.2f} us per replay")


def test_host_capture_records_and_replays(host):
    """The emulation's capture: operations recorded (not run), replayed in order with their recorded values."""
    import ctypes

    from gpuxfer.errors import BadInput
    buf = host.alloc(64, 0)
    try:
        s = host.create_stream(0)
        src, flag, dst = buf.ptr, buf.ptr + 8, buf.ptr + 16
        ctypes.c_int64.from_address(src).value = 41
        with host.capture(s) as g:
            assert host.is_capturing(s)
            host.wait_flag(s, flag, 1)
            host.write_flag(s, flag, 0)
            host.copy_async(s, dst, src, 8)
            host.launch(s, lambda: setattr(ctypes.c_int64.from_address(src), "value",
                                           ctypes.c_int64.from_address(src).value + 1))
            with pytest.raises(BadInput):
                host.record_event(s)
        assert not host.is_capturing(s) and len(g.ops) == 4
        assert ctypes.c_int64.from_address(dst).value == 0      # nothing ran at capture
        for want in (41, 42):
            g.replay()
            host.host_write_flag(flag, 1, 0)
            assert host.synchronize(s, 10)
            assert ctypes.c_int64.from_address(dst).value == want
            assert ctypes.c_int64.from_address(flag).value == 0
        s.close()
    finally:
        buf.close()


# --------------------------------------------------------------------------- eager small steps


def eager_session(rank: int, world: int, init_method: str, platform_name: str, steps: int) -> dict:
    """Eager copy_engine steps from three static source sets (the sender's copies become cached graphs from a
    set's second sight) into a receiver whose .tensors are views of the slot (recv_views): every byte checked
    before the next receive, which hands the slot back."""
    import torch
    import torch.distributed as dist

    from gpuxfer.pp import connect
    env = _Env(platform_name, rank, world, init_method)
    out = {}
    try:
        g = dist.new_group(backend="gloo")
        conn = connect(g, send_to=1 if rank == 0 else None, recv_from=0 if rank == 1 else None, specs=_specs(),
                       backend="copy_engine", platform=env.plat, device=env.device, timeout_s=60,
                       recv_views=True)
        with conn:
            if rank == 0:
                t = conn.sender()
                sets = [_pattern(i, env.tdev) for i in range(3)]
                for k in range(steps):
                    t.send(sets[k % 3])
                t.synchronize()
                out["graphs"] = len(t._graphs)
            else:
                t = conn.receiver()
                wrong = 0
                for k in range(steps):
                    got = t.recv().tensors
                    assert env.sync()
                    want = _pattern(k % 3, env.tdev)
                    for name in SPECS:
                        wrong += int((got[name].contiguous().view(torch.uint8) != want[name].view(torch.uint8)).sum())
                out["wrong"] = wrong
                out["lent"] = t._lent is not None
                t.synchronize()
            dist.barrier()
    finally:
        env.close()
    return out


def test_eager_small_steps_cached_graphs_and_slot_views(spawner, graph_platform):
    steps = 30 if graph_platform == "host" else 200
    s, r = spawner.run_ranks(eager_session, 2, graph_platform, steps, timeout=180)
    assert r["wrong"] == 0 and r["lent"]
    assert s["graphs"] == 6          # three source sets x two slots, each captured at its second sight


def eager_in_capture_session(rank: int, world: int, init_method: str, platform_name: str) -> dict:
    """An eager copy_engine step queued while the stream captures a graph is refused (GraphModeError)."""
    import torch.distributed as dist

    from gpuxfer.errors import GraphModeError
    from gpuxfer.pp import connect
    env = _Env(platform_name, rank, world, init_method)
    out = {}
    try:
        g = dist.new_group(backend="gloo")
        conn = connect(g, send_to=1 if rank == 0 else None, recv_from=0 if rank == 1 else None, specs=_specs(),
                       backend="copy_engine", platform=env.plat, device=env.device, timeout_s=30, metadata=False)
        shapes = {k: s for k, (s, _) in SPECS.items()}
        with conn:
            t = conn.transports[0]
            if rank == 0:
                t.send(_pattern(0, env.tdev))                  # an eager step first: that stream is checked once
                second = _pattern(1, env.tdev)                 # made before the capture (no host copy inside it)
                with pytest.raises(GraphModeError, match="captures a graph"):
                    with env.capture():
                        t.send(second)
            else:
                t.recv(shapes=shapes).tensors
                assert env.sync()
                rcv = t.recv(shapes=shapes)
                with pytest.raises(GraphModeError, match="captures a graph"):
                    with env.capture():
                        rcv.tensors
            out["broken"] = isinstance(t.error, GraphModeError)
            dist.barrier()
    finally:
        env.close()
    return out


def test_eager_step_inside_a_capture_raises(spawner, graph_platform):
    s, r = spawner.run_ranks(eager_in_capture_session, 2, graph_platform, timeout=120)
    assert s["broken"] and r["broken"]
