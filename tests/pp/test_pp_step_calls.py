"""A steady-state eager copy_engine step issues a fixed, small number of platform calls per side, and a
stuck peer on that path still ends in TransferTimeout with the caller's stream released.

Structural, not timed: a spy wrapped around the platform's methods counts the calls each side's main
thread makes per step (the watchdog thread's flag reads are not the step's). The path measured is the
one ``gpuxfer bench pp --recv-views`` times: inline steps whose peer copies replay a cached copy graph,
receives handed out as views of the slot, no metadata.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import os
import threading
import time

import pytest

TIMEOUT = 1.5
N = 64                 # elements of each tensor (float32, int64): one small inline step
WARM, COUNTED = 6, 10  # the copy graph is captured at a slot's second sighting: steps 3-4 on

# the platform methods a step may call: every one is counted
SPIED = ("current_stream", "is_capturing", "wait_flag", "write_flag", "flag_ops", "copy_async", "copy_batch_async",
         "launch_graph", "capture_graph", "record_event", "stream_wait_event", "launch", "memset_async",
         "event_wait", "event_query", "synchronize", "read_flag", "host_write_flag")
# queued stream operations (one driver call each on CUDA)
QUEUED = ("wait_flag", "write_flag", "flag_ops", "copy_async", "copy_batch_async", "launch_graph", "stream_wait_event",
          "launch", "memset_async")
# what the host emulation adds per step in place of stream order: a recorded event and a bounded wait on it, and
# the receiver's read of its slot word once the step is copied out (a released sender's copies never pass)
EMULATION_ONLY = ("record_event", "event_wait", "read_flag")


def _spy(plat) -> collections.Counter:
    """Count the calls the main thread makes into ``plat`` (outermost only: a platform method that calls
    another, as the default ``flag_ops`` does, counts once), the calls bound by ``stream_calls`` under the
    names of the methods they stand for."""
    counts: collections.Counter = collections.Counter()
    main = threading.get_ident()
    depth = [0]

    def spied(fn, name):
        def counted(*a, **kw):
            if threading.get_ident() != main:
                return fn(*a, **kw)
            if not depth[0]:
                counts[name] += 1
            depth[0] += 1
            try:
                return fn(*a, **kw)
            finally:
                depth[0] -= 1
        return functools.wraps(fn)(counted)

    for name in SPIED:
        fn = getattr(plat, name, None)
        if fn is not None:
            setattr(plat, name, spied(fn, name))
    bind = plat.stream_calls

    def stream_calls(stream):
        calls = bind(stream)
        for name in ("write_flag", "wait_flag", "launch_graph", "flag_ops"):
            setattr(calls, name, spied(getattr(calls, name), name))
        if calls.copy is not None:
            calls.copy = spied(calls.copy, "copy_async")
        return calls
    plat.stream_calls = stream_calls
    return counts


def step_calls_session(rank: int, world: int, init_method: str, platform_name: str, batch: str) -> dict:
    os.environ["GPUXFER_PLATFORM"] = platform_name
    os.environ["GPUXFER_PP_FLAG_BATCH"] = batch
    import pytest
    import torch
    import torch.distributed as dist

    from gpuxfer.errors import TransferTimeout
    from gpuxfer.platforms import get_platform
    from gpuxfer.pp import connect
    from gpuxfer.pp.launch import init_cpu_group
    init_cpu_group(rank, world, init_method)
    plat = get_platform(platform_name)
    device = rank % plat.device_count()
    dev = torch.device("cpu") if plat.is_emulation else torch.device("cuda", device)
    if not plat.is_emulation:
        torch.cuda.set_device(device)
    counts = _spy(plat)       # before connect: the transport may keep the platform's bound methods
    specs = {"x": ((N,), torch.float32), "i": ((N,), torch.int64)}
    shapes = {"x": (N,), "i": (N,)}
    out: dict = {"emulation": plat.is_emulation}

    def conn_for():    # a gloo group of its own: gloo closes a pair whose timed wait expires
        return connect(dist.new_group(backend="gloo"), send_to=1 if rank == 0 else None,
                       recv_from=0 if rank == 1 else None, specs=specs, backend="copy_engine", platform=plat,
                       device=device, timeout_s=TIMEOUT, metadata=False, recv_views=True)

    src = {"x": torch.zeros(N, dtype=torch.float32, device=dev),
           "i": torch.zeros(N, dtype=torch.int64, device=dev)}    # persistent: the copy graph's sources

    def send(t, k):
        src["x"].fill_(k)
        src["i"].fill_(-k)
        t.send(src)

    def take(t, k):
        got = t.recv(shapes=shapes).tensors
        assert bool((got["x"] == k).all()) and bool((got["i"] == -k).all()), f"step {k}: wrong bytes"

    # A. steady-state steps, counted; then the receiver stops taking: the sender's stream waits for a slot
    # that never frees, and the wait ends in TransferTimeout with the stream released
    conn = conn_for()
    try:
        t = conn.transports[0]
        out["remote_flags"] = t.remote_flags
        for k in range(1, WARM + COUNTED + 1):
            if k == WARM + 1:
                counts.clear()
            send(t, k) if rank == 0 else take(t, k)
            if k == WARM + COUNTED:
                out["calls"] = dict(counts)
        dist.barrier()
        if rank == 0:
            with pytest.raises(TransferTimeout) as ei:
                deadline = time.monotonic() + TIMEOUT * 10
                while time.monotonic() < deadline:   # the host emulation raises in send(); on a GPU the
                    send(t, 0)                       # watchdog finds the stuck wait and send() raises it
                    time.sleep(0.05)
            out["stuck"] = (ei.value.flag.split("[")[0], ei.value.rank)
            out["released"] = plat.synchronize(plat.current_stream(device), 10.0)
        dist.barrier()
    finally:
        conn.abort()
    # B. the sender stops sending: the receiver's wait ends in TransferTimeout, its stream released
    conn = conn_for()
    try:
        t = conn.transports[0]
        for k in range(1, 5):
            send(t, k) if rank == 0 else take(t, k)
        if rank == 1:
            with pytest.raises(TransferTimeout) as ei:
                t.recv(shapes=shapes).tensors
                t.synchronize(TIMEOUT * 10)
            out["stuck"] = (ei.value.flag.split("[")[0], ei.value.rank)
            out["released"] = plat.synchronize(plat.current_stream(device), 10.0)
        dist.barrier()
    finally:
        conn.abort()
        dist.destroy_process_group()
        plat.close()
    return out


@pytest.mark.parametrize("batch", ["0", "1"], ids=["flag-calls", "flag-batch"])
def test_steady_step_calls_and_stuck_peer(spawner, platform_name, batch):
    sender, receiver = spawner.run_ranks(step_calls_session, 2, platform_name, batch, timeout=120)
    for side, got, flag in (("sender", sender, "empty"), ("receiver", receiver, "full")):
        per_step = collections.Counter({k: v / COUNTED for k, v in got["calls"].items()})
        copy_flags = 0 if got["remote_flags"] else 1     # a publish by local write + 8-byte copy
        queued = sum(per_step[k] for k in QUEUED)
        # sender: wait for the slot, one copy-graph launch, publish; receiver: give the lent slot back, wait
        # (with the flag batch and remote writes, the receiver's two are one flag_ops call)
        batched = side == "receiver" and batch == "1" and got["remote_flags"]
        want = 3 if side == "sender" else 1 if batched else 2
        assert queued <= want + copy_flags, f"{side}: {queued} queued calls per step: {dict(per_step)}"
        mark = "launch_graph" if side == "sender" else "flag_ops" if batched else "wait_flag"
        assert per_step[mark] == 1, f"{side}: {dict(per_step)}"
        others = {k: v for k, v in per_step.items() if k not in QUEUED and k != "current_stream"
                  and not (got["emulation"] and k in EMULATION_ONLY)}
        assert not others, f"{side}: calls besides the step's own per step: {others}"
        assert per_step["current_stream"] <= 1, f"{side}: {dict(per_step)}"
        assert got["stuck"] == (flag, 0 if side == "sender" else 1), f"{side}: {got['stuck']}"
        assert got["released"], f"{side}: its current stream still waits after the timeout"


def test_flag_ops_in_order(platform):
    """flag_ops queues its rows in order: a write after a wait lands only once the wait passed."""
    from gpuxfer.errors import BadInput
    from gpuxfer.platforms.base import FLAG_OP_WAIT, FLAG_OP_WRITE, StreamCalls, flag_ops_array
    s = platform.create_stream(0)
    buf = platform.alloc(256, 0)
    try:
        platform.memset_async(s, buf.ptr, 0, 256)
        assert platform.synchronize(s, 30.0)
        a, b = buf.ptr, buf.ptr + 64
        ops = flag_ops_array([(FLAG_OP_WRITE, a, 7), (FLAG_OP_WAIT, b, 3), (FLAG_OP_WRITE, a, 9)])
        platform.flag_ops(s, ops)
        deadline = time.monotonic() + 30.0
        while platform.read_flag(a, 0) != 7:        # the first write needs nothing
            assert time.monotonic() < deadline, "the first flag write never landed"
            time.sleep(1e-3)
        time.sleep(0.05)
        assert platform.read_flag(a, 0) == 7, "a write queued after a wait landed before the wait passed"
        platform.host_write_flag(b, 3, 0)
        assert platform.synchronize(s, 30.0)
        assert platform.read_flag(a, 0) == 9
        ops[2, 2] = 11                               # values change in place between calls
        platform.flag_ops(s, ops)
        assert platform.synchronize(s, 30.0) and platform.read_flag(a, 0) == 11
        bound = platform.stream_calls(s)             # the same, bound to the stream (the per-step path), and
        plain = StreamCalls(s, bound.write_flag, bound.wait_flag, bound.launch_graph)  # one call per row
        for calls, value in ((bound, 13), (bound, 15), (plain, 17)):
            ops[0, 2], ops[1, 2], ops[2, 2] = value, 3, value + 1
            calls.flag_ops(ops)
            assert platform.synchronize(s, 30.0) and platform.read_flag(a, 0) == value + 1
        with pytest.raises(BadInput):
            flag_ops_array([(3, a, 1)])              # neither a wait nor a write
        with pytest.raises(BadInput):
            flag_ops_array([(FLAG_OP_WRITE, a + 4, 1)])   # not a flag address
        ops[1, 0] = 2
        if platform.is_emulation:                    # the default one-call-per-row path checks each row
            with pytest.raises(BadInput):
                platform.flag_ops(s, ops)
        with pytest.raises(BadInput):
            plain.flag_ops(ops)
    finally:
        platform.synchronize(s, 10.0)
        s.close()
        buf.close()


@contextlib.contextmanager
def _copy_engine_pair(rank: int, world: int, init_method: str, platform_name: str, host_give_back: str,
                      timeout_s: float, spy: bool = False):
    """A ``copy_engine`` pair (rank 0 sends ``x``, ``N`` float32, no metadata, slot views) with the sender's
    host empty words on (``"1"``) or off: ``(platform, device, torch device, transport, call counts)``;
    aborted and the platform closed after."""
    os.environ["GPUXFER_PLATFORM"] = platform_name
    os.environ["GPUXFER_PP_HOST_GIVE_BACK"] = host_give_back
    import torch
    import torch.distributed as dist

    from gpuxfer.platforms import get_platform
    from gpuxfer.pp import connect
    from gpuxfer.pp.launch import init_cpu_group
    init_cpu_group(rank, world, init_method)
    plat = get_platform(platform_name)
    device = rank % plat.device_count()
    dev = torch.device("cpu") if plat.is_emulation else torch.device("cuda", device)
    if not plat.is_emulation:
        torch.cuda.set_device(device)
    counts = _spy(plat) if spy else None
    conn = connect(dist.new_group(backend="gloo"), send_to=1 if rank == 0 else None,
                   recv_from=0 if rank == 1 else None, specs={"x": ((N,), torch.float32)}, backend="copy_engine",
                   platform=plat, device=device, timeout_s=timeout_s, metadata=False, recv_views=True)
    try:
        yield plat, device, dev, conn.transports[0], counts
        dist.barrier()
        conn.close()
    finally:
        conn.abort()
        dist.destroy_process_group()
        plat.close()


def give_back_session(rank: int, world: int, init_method: str, platform_name: str, host: str) -> dict:
    """Steps in lock step (the receiver takes step k and its stream finishes before the sender sends k + 1):
    with the sender's empty words in host memory it sees every slot free, queues no GPU wait, and its copy
    graph publishes the step: one queued call per step."""
    if host == "refused" and rank == 1:     # the receiver's check of the sender's host words fails
        from gpuxfer.hostwords import HostWords

        def refuse(*a, **kw):
            raise RuntimeError("refused by the test")
        HostWords.check_peer_writes = refuse
    import torch
    import torch.distributed as dist
    out: dict = {}
    with _copy_engine_pair(rank, world, init_method, platform_name, "0" if host == "0" else "1", TIMEOUT * 4,
                           spy=True) as (plat, device, dev, t, counts):
        src = {"x": torch.zeros(N, dtype=torch.float32, device=dev)}
        out["host_words"] = t._give_back is not None
        for k in range(1, 13):
            if k == 5:
                counts.clear()
            if rank == 0:
                src["x"].fill_(k)
                t.send(src)
            dist.barrier()
            if rank == 1:
                got = t.recv(shapes={"x": (N,)}).tensors
                assert bool((got["x"] == k).all()), f"step {k}: wrong bytes"
                assert plat.synchronize(plat.current_stream(device), 10.0)
            dist.barrier()
        out["waits"] = counts["wait_flag"] / 8
        out["queued"] = sum(counts[q] for q in QUEUED) / 8
        out["remote_flags"] = t.remote_flags
        out["slot_waits"] = getattr(t, "slot_waits", None)
    return out


@pytest.mark.parametrize("host", ["1", "0", "refused"], ids=["host-give-back", "device-give-back", "receiver-refuses"])
def test_sender_queues_no_wait_for_a_slot_seen_free(spawner, platform_name, host):
    """(A receiver that cannot use the sender's host words makes both ends keep the device words.)"""
    sender, receiver = spawner.run_ranks(give_back_session, 2, platform_name, host, timeout=120)
    assert sender["host_words"] == receiver["host_words"] == (host == "1")
    assert sender["waits"] == (0 if host == "1" else 1), sender
    assert sender["slot_waits"] == (0 if host == "1" else 12 - 2), sender     # steps 3-12 reuse a slot
    # host words: one copy-graph launch (copies and publish); else wait, launch, publish (+1: a copy-path publish)
    assert sender["queued"] == (1 if host == "1" else 3 + (0 if sender["remote_flags"] else 1)), sender


def sender_ahead_session(rank: int, world: int, init_method: str, platform_name: str) -> dict:
    """The sender runs ahead of a late receiver: steps whose slot is not seen free queue the wait and the value
    word's write as one flag_ops call before the copy graph, and every step arrives with its own bytes."""
    import torch
    import torch.distributed as dist
    out: dict = {}
    with _copy_engine_pair(rank, world, init_method, platform_name, "1", TIMEOUT * 8,
                           spy=True) as (_plat, _device, dev, t, counts):
        srcs = [{"x": torch.full((N,), float(i), device=dev)} for i in range(2)]    # two copy sets in turn
        dist.barrier()
        steps = 24
        if rank == 0:
            for k in range(1, steps + 1):
                src = srcs[k % 2]
                src["x"].fill_(k)              # (stream-ordered after the copies that read it last)
                t.send(src)
            t.synchronize()
            out["slot_waits"], out["flag_ops"] = t.slot_waits, counts["flag_ops"]
        else:
            time.sleep(0.3)                     # late: the sender's third step finds no free slot
            for k in range(1, steps + 1):
                got = t.recv(shapes={"x": (N,)}).tensors
                assert bool((got["x"] == k).all()), f"step {k}: got {got['x'][:4].tolist()}"
            t.synchronize()
    return out


def test_sender_ahead_waits_and_sets_the_value_word_in_one_call(spawner, platform_name):
    sender, _ = spawner.run_ranks(sender_ahead_session, 2, platform_name, timeout=120)
    assert sender["slot_waits"] >= 1 and sender["flag_ops"] >= 1, sender


def released_send_session(rank: int, world: int, init_method: str, platform_name: str) -> dict:
    """A failure releases the sender's host empty words while a send() is already past its usability check:
    that send raises the stored error (or PeerLost where the receiver released them) and touches no slot."""
    import torch
    import torch.distributed as dist

    from gpuxfer.errors import PeerLost, TransferTimeout
    from gpuxfer.platforms.base import RELEASE_VALUE
    out: dict = {}
    with _copy_engine_pair(rank, world, init_method, platform_name, "1", TIMEOUT * 8) as (_plat, _device, dev, t, _):
        dist.barrier()
        if rank == 0:
            src = {"x": torch.full((N,), 1.0, device=dev)}
            t.send(src)
            t.synchronize()
            layout = t.specs.layout(((N,),))
            loads = t._free_loads
            out["host_words"] = loads is not None
            if loads is not None:
                j = 1 % t.recv_slots                      # step 2's slot
                loads[j << 3] = RELEASE_VALUE             # as a receiver's release would leave it
                try:
                    t._send_impl(2, src, layout)
                    out["peer_release"] = "sent"
                except PeerLost as exc:
                    out["peer_release"] = type(exc).__name__
                err = TransferTimeout(rank=0, step=2, flag="test", expected=1, seen=0, timeout_s=0.0, what="test")
                t._fail(err)                              # this end fails: its release writes every empty word
                try:
                    t._send_impl(2, src, layout)
                    out["own_release"] = "sent"
                except TransferTimeout as exc:
                    out["own_release"] = "stored error" if exc is err else repr(exc)
    return out


def test_a_send_past_its_check_raises_on_released_slot_words(spawner, platform_name):
    sender, _ = spawner.run_ranks(released_send_session, 2, platform_name, timeout=120)
    if not sender["host_words"]:
        pytest.skip("the sender's empty words are not in host memory here")
    assert sender["peer_release"] == "PeerLost" and sender["own_release"] == "stored error", sender
