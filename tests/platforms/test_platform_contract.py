"""The platform contract (gpuxfer/platforms/base.py), run on every platform present.

``host`` always runs; ``cuda`` runs with ``-m gpu`` on a machine with a usable
GPU. Cross-process tests use spawn; rank ``i`` uses device ``i % device_count``,
so on a 2-GPU machine the two processes sit on different GPUs (and on one GPU,
or on the host emulation, they share it).

Buffers are zeroed before use (``alloc`` leaves contents undefined), and every
test that blocks a stream on a flag releases it in ``finally`` so a failing
assertion never leaves a GPU stream stuck.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from gpuxfer.errors import BadInput, DriverError, GpuxferError, TransferTimeout, VerificationFailed
from gpuxfer.platforms import get_platform
from gpuxfer.sync import wait_event_or_raise, wait_flag_or_raise

T = 30.0          # generous timeout for anything that should take milliseconds
RELEASE = 1 << 40  # a flag value that releases every pending wait of a test


def pattern(rank: int, nbytes: int) -> torch.Tensor:
    """A rank-dependent byte pattern with a prime period (misplaced bytes do not line up)."""
    return ((torch.arange(nbytes, dtype=torch.int64) * 7 + 13 * (rank + 1)) % 251).to(torch.uint8)


def zeroed(p, nbytes: int, device: int):
    buf = p.alloc(nbytes, device)
    s = p.current_stream(device)
    p.memset_async(s, buf.ptr, 0, nbytes)
    assert p.synchronize(s, T)
    return buf


def host_bytes(p, mem, nbytes: int | None = None) -> torch.Tensor:
    """The bytes of ``mem`` on the CPU (after the caller synchronized the writers)."""
    t = p.as_tensor(mem, torch.uint8, (mem.nbytes if nbytes is None else nbytes,))
    if t.device.type == "cuda":
        # Read on a side stream of torch's (non-blocking) pool: the legacy default stream would
        # wait behind any blocking stream that a test holds on a flag.
        with torch.cuda.stream(torch.cuda.Stream(t.device)):
            return t.cpu().clone()
    return t.cpu().clone()


def fill(p, mem, data: torch.Tensor, device: int) -> None:
    """Write ``data`` (CPU uint8) into ``mem`` through torch, then wait for it."""
    t = p.as_tensor(mem, torch.uint8, (data.numel(),))
    t.copy_(data.to(t.device))
    if t.device.type != "cpu":
        torch.cuda.synchronize(t.device)


def dev_of(p, rank: int) -> int:
    return rank % p.device_count()


# --------------------------------------------------------------------------- devices


def test_devices_and_links(platform):
    n = platform.device_count()
    assert n >= 1
    for d in range(n):
        info = platform.device_info(d)
        assert info.index == d and info.name and info.arch
        assert info.total_bytes > 0 and info.sm_count > 0 and info.copy_engines >= 0
        assert isinstance(info.stream_mem_ops_64, bool)
        assert info.as_dict()["index"] == d
        for e in range(n):
            link = platform.link(d, e)
            assert (link.src, link.dst) == (d, e)
            if d == e:
                assert link.kind == "same-device"
    assert isinstance(platform.versions(), dict)
    assert platform.name in platform.label


# --------------------------------------------------------------------------- memory


def test_alloc_free_close_idempotent(platform):
    buf = platform.alloc(4096, 0)
    assert buf.nbytes == 4096 and buf.ptr and buf.device == 0 and not buf.closed
    buf.close()
    buf.close()
    assert buf.closed
    with platform.alloc(64, dev_of(platform, 1)) as b2:
        assert b2.device == dev_of(platform, 1)
    assert b2.closed
    platform.close()
    platform.close()


def test_streams_close_idempotent_and_refused_when_closed(platform):
    own = platform.create_stream(0)
    cur = platform.current_stream(0)
    assert not own.closed and not cur.closed
    buf = zeroed(platform, 64, 0)
    try:
        platform.write_flag(own, buf.ptr, 3)
        own.close()                                  # queued work still completes
        own.close()
        assert own.closed
        wait_flag_or_raise(platform, buf.ptr, 3, T, rank=0, step=0, flag="closed stream's last write", device=0)
        for use in (lambda s: platform.write_flag(s, buf.ptr, 4), lambda s: platform.record_event(s),
                    lambda s: platform.memset_async(s, buf.ptr, 0, 8)):
            with pytest.raises(BadInput, match="closed"):
                use(own)
        cur.close()                                  # borrowed: nothing happens
        assert not cur.closed
        platform.write_flag(cur, buf.ptr + 8, 5)
        assert platform.synchronize(cur, T) and platform.read_flag(buf.ptr + 8, 0) == 5
    finally:
        buf.close()


def test_as_tensor_dtypes_zero_copy(platform):
    dev = 0
    buf = zeroed(platform, 4096, dev)
    try:
        u8 = platform.as_tensor(buf)
        assert u8.dtype == torch.uint8 and u8.shape == (4096,) and u8.data_ptr() == buf.ptr

        f32 = platform.as_tensor(buf, torch.float32, (16, 16), offset=1024)
        assert f32.shape == (16, 16) and f32.data_ptr() == buf.ptr + 1024
        vals = torch.arange(256, dtype=torch.float32).reshape(16, 16) / 3
        f32.copy_(vals.to(f32.device))

        bf = platform.as_tensor(buf, torch.bfloat16, (64,), offset=2048)
        assert bf.dtype == torch.bfloat16 and bf.data_ptr() == buf.ptr + 2048
        bvals = (torch.arange(64, dtype=torch.float32) - 31.5).to(torch.bfloat16)
        bf.copy_(bvals.to(bf.device))

        assert platform.synchronize(platform.current_stream(dev), T)
        if u8.device.type != "cpu":
            torch.cuda.synchronize(u8.device)
        raw = u8.cpu()
        assert torch.equal(raw[1024:2048], vals.view(torch.uint8).reshape(-1))
        assert torch.equal(raw[2048:2176], bvals.view(torch.uint8))
        assert int(raw[:1024].count_nonzero()) == 0 and int(raw[2176:].count_nonzero()) == 0
        # a view over the other's bytes reads the same values
        assert torch.equal(platform.as_tensor(buf, torch.float32, (256,), offset=1024).cpu(), vals.reshape(-1))
        with pytest.raises(GpuxferError):
            platform.as_tensor(buf, torch.float32, (1025,))
        with pytest.raises(GpuxferError):
            platform.as_tensor(buf, torch.uint8, (16,), offset=4090)
        del u8, f32, bf
    finally:
        buf.close()


@pytest.mark.parametrize("shape", [(1 << 32, 1 << 32), (1 << 61, 8), ((1 << 64) + 4,), (1 << 63, 0, 1 << 63),
                                   ("x",), 5, (2.5,), (True, 4), (None,)])
def test_as_tensor_of_a_shape_past_int64_or_not_of_ints_is_bad_input(platform, shape):
    """A view's bytes counted in Python integers: a shape whose product wraps int64 (to 0, or to a few bytes
    inside the buffer) or is not a sequence of ints is BadInput, never an allocation of the wrapped shape or
    torch's error."""
    buf = zeroed(platform, 4096, 0)
    try:
        with pytest.raises(BadInput):
            platform.as_tensor(buf, torch.uint8, shape)
        assert platform.as_tensor(buf, torch.uint8, (0, 1 << 40)).shape == (0, 1 << 40)
    finally:
        buf.close()


def test_copy_async_and_batch_local(platform):
    n = 64 * 1024 + 5
    dev = 0
    src, dst = platform.alloc(n, dev), zeroed(platform, n, dev)
    try:
        data = pattern(0, n)
        fill(platform, src, data, dev)
        s = platform.create_stream(dev)
        platform.copy_async(s, dst.ptr, src.ptr, 1000)
        assert platform.synchronize(s, T)
        got = host_bytes(platform, dst)
        assert torch.equal(got[:1000], data[:1000]) and int(got[1000:].count_nonzero()) == 0

        # many independent copies: reverse 1 KiB chunks (+ a ragged tail)
        sizes = np.full(n // 1024, 1024, dtype=np.int64)
        srcs = src.ptr + np.arange(len(sizes), dtype=np.int64) * 1024
        dsts = dst.ptr + (len(sizes) - 1 - np.arange(len(sizes), dtype=np.int64)) * 1024
        platform.copy_batch_async(s, dsts, srcs, sizes)
        assert platform.synchronize(s, T)
        got = host_bytes(platform, dst)
        k = len(sizes)
        want = data[: k * 1024].reshape(k, 1024).flip(0).reshape(-1)
        assert torch.equal(got[: k * 1024], want)
    finally:
        src.close()
        dst.close()


# --------------------------------------------------------------------------- streams and flags


def test_wait_blocks_only_its_stream(platform):
    """A flag wait holds back later work on its stream; another stream runs on; the host releases it."""
    dev = 0
    flags = zeroed(platform, 64, dev)
    a, b, c = platform.alloc(4096, dev), zeroed(platform, 4096, dev), zeroed(platform, 4096, dev)
    s1, s2, s3 = (platform.create_stream(dev) for _ in range(3))
    try:
        fill(platform, a, pattern(0, 4096), dev)
        platform.wait_flag(s1, flags.ptr, 5)
        platform.copy_async(s1, b.ptr, a.ptr, 4096)
        platform.write_flag(s1, flags.ptr + 8, 7)
        e1 = platform.record_event(s1)
        # s3 waits for s1's event: blocked too
        platform.stream_wait_event(s3, e1)
        platform.memset_async(s3, c.ptr, 0xAB, 4096)
        e3 = platform.record_event(s3)
        # s2 is independent: runs now
        platform.copy_async(s2, c.ptr, a.ptr, 16)
        assert platform.synchronize(s2, T)

        time.sleep(0.2)
        assert not platform.event_query(e1) and not platform.event_query(e3)
        assert not platform.event_wait(e1, 0.05)
        assert platform.read_flag(flags.ptr + 8, dev) == 0
        assert int(host_bytes(platform, b).count_nonzero()) == 0
        assert torch.equal(host_bytes(platform, c, 16), pattern(0, 16))

        platform.host_write_flag(flags.ptr, 4, dev)          # not enough: still blocked
        time.sleep(0.1)
        assert not platform.event_query(e1)
        platform.host_write_flag(flags.ptr, 5, dev)          # GEQ: released
        wait_event_or_raise(platform, e1, T, rank=0, step=5, flag="go", flag_ptr=flags.ptr, expected=5, device=dev)
        wait_event_or_raise(platform, e3, T, rank=0, step=5, flag="s3", expected=0)
        assert platform.read_flag(flags.ptr + 8, dev) == 7
        assert torch.equal(host_bytes(platform, b), pattern(0, 4096))
        assert torch.equal(host_bytes(platform, c), torch.full((4096,), 0xAB, dtype=torch.uint8))
    finally:
        platform.host_write_flag(flags.ptr, RELEASE, dev)
        for s in (s1, s2, s3):
            platform.synchronize(s, T)
        for m in (flags, a, b, c):
            m.close()


def test_rerecorded_event_keeps_earlier_waits(platform):
    """record_event(stream, event): a wait enqueued before the re-record still waits for the first recording
    only; the returned event (the same one where the platform reuses it) completes after the new work."""
    dev = 0
    flags = zeroed(platform, 64, dev)
    s1, s2 = platform.create_stream(dev), platform.create_stream(dev)
    try:
        first = platform.record_event(s1)                    # s1 is idle: complete at once
        platform.stream_wait_event(s2, first)
        platform.write_flag(s2, flags.ptr + 8, 3)
        platform.wait_flag(s1, flags.ptr, 1)                 # s1 blocks from here
        again = platform.record_event(s1, first)
        assert again is first or platform.name == "host"     # CUDA / ROCm reuse it; the emulation makes a new one
        assert platform.synchronize(s2, T)                   # s2 waited for the first recording only
        assert platform.read_flag(flags.ptr + 8, dev) == 3
        time.sleep(0.1)
        assert not platform.event_query(again)
        platform.host_write_flag(flags.ptr, 1, dev)
        assert platform.event_wait(again, T)
    finally:
        platform.host_write_flag(flags.ptr, RELEASE, dev)
        for s in (s1, s2):
            platform.synchronize(s, T)
        flags.close()


def test_wait_that_never_completes_times_out(platform):
    dev = 0
    flags = zeroed(platform, 8, dev)
    s = platform.create_stream(dev)
    try:
        platform.host_write_flag(flags.ptr, 2, dev)
        platform.wait_flag(s, flags.ptr, 3)
        ev = platform.record_event(s)
        assert platform.event_wait(ev, 0.2) is False
        with pytest.raises(TransferTimeout) as info:
            wait_event_or_raise(platform, ev, 0.2, rank=3, step=3, flag="recv.full", flag_ptr=flags.ptr,
                                expected=3, device=dev)
        e = info.value
        assert (e.rank, e.step, e.flag, e.expected, e.seen) == (3, 3, "recv.full", 3, 2)
        msg = str(e)
        assert "rank 3" in msg and "step 3" in msg and "'recv.full'" in msg and "last value seen: 2" in msg
        with pytest.raises(TransferTimeout, match="last value seen: 2"):
            wait_flag_or_raise(platform, flags.ptr, 3, 0.1, rank=0, step=3, flag="recv.full", device=dev)
        platform.host_write_flag(flags.ptr, 3, dev)
        assert platform.event_wait(ev, T)
        assert wait_flag_or_raise(platform, flags.ptr, 3, T, rank=0, step=3, flag="recv.full", device=dev) == 3
    finally:
        platform.host_write_flag(flags.ptr, RELEASE, dev)
        platform.synchronize(s, T)
        flags.close()


# --------------------------------------------------------------------------- across processes


def _child_copy_pattern(platform_name: str, rank: int, handle, nbytes: int) -> int:
    p = get_platform(platform_name)
    try:
        dev = dev_of(p, rank)
        p.set_device(dev)
        src = p.alloc(nbytes, dev)
        peer = p.open_handle(handle, dev)
        assert peer.nbytes == nbytes and peer.ptr != 0 and peer.addressable
        fill(p, src, pattern(rank, nbytes), dev)
        s = p.current_stream(dev)
        p.copy_async(s, peer.ptr, src.ptr, nbytes)
        assert p.synchronize(s, T), "copy to the peer did not finish"
        peer.close()
        peer.close()
        src.close()
        return dev
    finally:
        p.close()


@pytest.mark.timeout(180)
def test_copy_pattern_to_peer_process(platform, platform_name, spawner):
    n = (1 << 20) + 13
    dst = zeroed(platform, n, 0)
    try:
        h = dst.export()
        assert h.nbytes == n and h.device == 0 and isinstance(h.payload, bytes)
        child = spawner.start(_child_copy_pattern, platform_name, 1, h, n, name="rank 1")
        assert child.result(120) == dev_of(platform, 1)
        child.join(60)
        got = host_bytes(platform, dst)
        want = pattern(1, n)
        bad = (got != want).nonzero()
        assert bad.numel() == 0, f"{bad.numel()} wrong bytes, first at {int(bad[0])}"
    finally:
        dst.close()


def _child_flag_handshake(platform_name: str, rank: int, data_h, flag_h, to_parent, to_child, n: int) -> None:
    """Rank 1: wait for "go" on a local flag, copy data into rank 0, then signal "done" to rank 0.

    The flag to the peer is staged locally and copied over (never a remote flag write).
    """
    p = get_platform(platform_name)
    try:
        dev = dev_of(p, rank)
        p.set_device(dev)
        flags = zeroed(p, 16, dev)       # [0]: go (written by rank 0), [1]: staging for "done"
        src = p.alloc(n, dev)
        fill(p, src, pattern(rank, n), dev)
        to_parent.put(flags.export())
        data, peer_flag = p.open_handle(data_h, dev), p.open_handle(flag_h, dev)
        s = p.create_stream(dev)
        p.wait_flag(s, flags.ptr, 1)
        p.copy_async(s, data.ptr, src.ptr, n)
        p.write_flag(s, flags.ptr + 8, 1)
        p.copy_async(s, peer_flag.ptr, flags.ptr + 8, 8)
        ev = p.record_event(s)
        to_parent.put("enqueued")
        wait_event_or_raise(p, ev, 60, rank=rank, step=1, flag="go", flag_ptr=flags.ptr, expected=1, device=dev)
        data.close()
        peer_flag.close()
        assert to_child.get(timeout=60) == "closed"   # rank 0 closed its mapping of our flags
        flags.close()
        src.close()
    finally:
        p.close()


@pytest.mark.timeout(180)
def test_flag_handshake_across_processes(platform, platform_name, spawner):
    n = 256 * 1024 + 3
    dev = 0
    data, flags = zeroed(platform, n, dev), zeroed(platform, 16, dev)   # flags: [0] done, [1] staging for go
    to_parent, to_child = spawner.queue(), spawner.queue()
    child = spawner.start(_child_flag_handshake, platform_name, 1, data.export(), flags.export(),
                          to_parent, to_child, n, name="rank 1")
    s, s_go = platform.create_stream(dev), platform.create_stream(dev)
    peer_flags = None
    try:
        peer_flags = platform.open_handle(to_parent.get(timeout=120), dev)
        assert to_parent.get(timeout=120) == "enqueued"
        platform.wait_flag(s, flags.ptr, 1)
        done = platform.record_event(s)
        time.sleep(0.3)
        # rank 1's stream is held by its wait: nothing has arrived yet
        assert not platform.event_query(done)
        assert platform.read_flag(flags.ptr, dev) == 0
        assert int(host_bytes(platform, data).count_nonzero()) == 0
        # go: stage locally, copy 8 bytes to the peer's flag
        platform.write_flag(s_go, flags.ptr + 8, 1)
        platform.copy_async(s_go, peer_flags.ptr, flags.ptr + 8, 8)
        wait_event_or_raise(platform, done, 60, rank=0, step=1, flag="done", flag_ptr=flags.ptr, expected=1,
                            device=dev)
        assert platform.read_flag(flags.ptr, dev) == 1
        got, want = host_bytes(platform, data), pattern(1, n)
        assert torch.equal(got, want), f"{int((got != want).sum())} wrong bytes"
        peer_flags.close()
        to_child.put("closed")
        child.result(60)
        child.join(60)
    finally:
        platform.host_write_flag(flags.ptr, RELEASE, dev)
        platform.synchronize(s, T)
        platform.synchronize(s_go, T)
        if peer_flags is not None:
            peer_flags.close()
        data.close()
        flags.close()


# --------------------------------------------------------------------------- host emulation only


def test_host_identity(host):
    assert host.name == "host" and host.is_emulation and "EMULATION" in host.label
    info = host.device_info(0)
    assert info.arch == "host" and info.stream_mem_ops_64 and any("EMULATION" in x for x in info.notes)
    assert host.link(0, 1).kind == "shared-memory" and host.link(0, 1).is_fast
    with pytest.raises(BadInput):
        host.device_info(host.device_count())
    with pytest.raises(BadInput):
        host.alloc(0, 0)


def test_host_device_count_env(monkeypatch):
    from gpuxfer.platforms.host import HostPlatform
    monkeypatch.setenv("GPUXFER_HOST_DEVICES", "3")
    with HostPlatform() as p:
        assert p.device_count() == 3
    monkeypatch.setenv("GPUXFER_HOST_DEVICES", "three")
    with pytest.raises(BadInput, match="GPUXFER_HOST_DEVICES"):
        HostPlatform()


def test_host_refuses_to_open_own_handle(host):
    with host.alloc(64, 0) as buf:
        with pytest.raises(BadInput, match="exported"):
            host.open_handle(buf.export(), 0)


def test_host_misaligned_flag_and_bad_values(host):
    with host.alloc(64, 0) as buf:
        s = host.create_stream(0)
        with pytest.raises(BadInput, match="aligned"):
            host.write_flag(s, buf.ptr + 4, 1)
        with pytest.raises(BadInput, match="aligned"):
            host.wait_flag(s, buf.ptr + 4, 1)
        with pytest.raises(BadInput):
            host.write_flag(s, buf.ptr, 1 << 64)
        with pytest.raises(BadInput):
            host.as_tensor(buf, torch.float32, (2,), offset=2)


def _host_values_outside_what_they_name() -> int:
    from gpuxfer.platforms.base import FLAG_OP_WAIT, flag_ops_array
    from gpuxfer.platforms.host import HostPlatform
    host = HostPlatform()
    s = host.create_stream(0)
    calls = [
        lambda: host.copy_batch_async(s, [1 << 64], [0], [1]),       # past 64 bits
        lambda: host.copy_batch_async(s, ["x"], [0], [1]),
        lambda: host.copy_async(s, 1 << 70, 0, 1),
        lambda: host.memset_async(s, 8, "a", 1),
        lambda: host.alloc(1 << 70, 0),
        lambda: flag_ops_array([(FLAG_OP_WAIT, -8, 1)]),
        lambda: flag_ops_array([(FLAG_OP_WAIT, 1 << 70, 1)]),
        lambda: host.write_flag(s, 0, 1),                            # a null flag: its worker would fault
        lambda: host.host_write_flag(0, 1, 0),
        lambda: host.synchronize(s, float("inf")),                   # a host wait is bounded
        lambda: host.event_wait(host.record_event(s), float("nan")),
        lambda: host.synchronize(s, 1e300),                          # past any clock: not an OverflowError
        lambda: host.event_wait(host.record_event(s), 1e300),
        lambda: host.copy_batch_async(s, np.array([1.5]), np.array([2.5]), np.array([1.0])),   # never truncated
        lambda: host.copy_batch_async(s, np.array([True]), np.array([True]), np.array([True])),
        lambda: host.copy_batch_async(s, np.array([(1 << 64) - 8], dtype=np.uint64), [8], [1]),  # never wrapped
        lambda: host.write_flag(s, "x", 1),                          # an address that is not an integer
        lambda: host.wait_flag(s, 8.0, 1),
        lambda: host.read_flag(None, 0),
        lambda: host.export_range("x", 8, 0),
        lambda: host.export_range(4096, 8, 0, within=("a", 1)),
        lambda: host.allocation_range("x", 0),
        lambda: host.capture_graph(s, None),                         # not callable
        lambda: host.set_device(9),                                  # no such device
        lambda: host.copy_async(s, 0, 4096, 8),                      # a null or negative address: its worker
        lambda: host.copy_async(s, 4096, -4096, 8),                  # would fault
        lambda: host.copy_batch_async(s, [4096, 0], [4096, 8192], [8, 8]),
        lambda: host.copy_batch_async(s, [4096], [-8], [8]),
        lambda: host.memset_async(s, 0, 1, 8),
    ]
    for call in calls:
        with pytest.raises(BadInput):
            call()
    ev = host.record_event(s)
    assert host.synchronize(s, 10.0) and host.event_wait(ev, -1.0)     # below 0: a poll
    host.close()
    return len(calls)


def test_host_values_outside_64_bits_null_flags_and_unbounded_waits_are_bad_input(spawner):
    # in a child: a null flag reached ends the process with a signal
    assert spawner.start(_host_values_outside_what_they_name).result(60) == 29


def test_host_wait_is_cyclic_geq():
    from gpuxfer.platforms.host_streams import _geq_cyclic
    assert _geq_cyclic(5, 5) and _geq_cyclic(6, 5) and not _geq_cyclic(4, 5)
    assert _geq_cyclic(-(1 << 63), (1 << 63) - 1)        # wrapped past the top: reached


def test_host_worker_errors_are_raised_not_lost(host):
    s = host.create_stream(0)
    ok = host.record_event(s)

    def boom():
        raise ValueError("bad kernel")

    host.launch(s, boom)
    after = host.record_event(s)
    assert host.event_wait(ok, T)
    with pytest.raises(DriverError, match="bad kernel") as info:
        host.event_wait(after, T)
    assert isinstance(info.value.__cause__, ValueError) and info.value.status_name == "ValueError"
    with pytest.raises(DriverError):          # sticky: the stream stays failed
        host.synchronize(s)
    with pytest.raises(DriverError):
        host.launch(s, lambda: None)

    # a gpuxfer error keeps its type, and spreads to a stream waiting on the failed one
    s2, s3 = host.create_stream(0), host.create_stream(1)

    def verify():
        raise VerificationFailed("3 wrong bytes", wrong_bytes=3)

    host.launch(s2, verify)
    ev2 = host.record_event(s2)
    host.stream_wait_event(s3, ev2)
    with pytest.raises(VerificationFailed):
        host.synchronize(s3)


def test_host_close_stops_a_stuck_wait(host):
    buf = zeroed(host, 8, 0)
    s = host.create_stream(0)
    host.wait_flag(s, buf.ptr, 1)
    ev = host.record_event(s)
    t0 = time.monotonic()
    host.close()
    assert time.monotonic() - t0 < 60      # close does not wait for the flag (a hang guard, not a speed test)
    assert not s._worker.thread.is_alive()
    with pytest.raises(DriverError, match="STREAM_CLOSED"):
        host.event_query(ev)
    with pytest.raises(BadInput, match="closed"):
        host.alloc(8, 0)
    host.close()
    buf.close()


def test_host_free_under_a_waiting_stream_is_unmapped_once_it_stops(host):
    """Freeing the flag a closed stream still waits on (no one will ever write it) never ends in a signal: the
    memory leaves the platform's books at once and is unmapped when the platform has stopped the stream."""
    buf = zeroed(host, 64, 0)
    s = host.create_stream(0)
    host.wait_flag(s, buf.ptr, 1)
    s.close()                   # drains: the wait stays queued on the worker
    buf.close()
    assert host.allocation_range(buf.ptr, 0) is None
    other = zeroed(host, 64, 0)
    other.close()               # nothing is unmapped while the wait may still read its flag
    time.sleep(0.01)
    assert s._worker.thread.is_alive() and host._unmapped_later
    host.close()
    assert not s._worker.thread.is_alive() and not host._unmapped_later


def test_host_free_with_live_tensor_and_unlink(host):
    import os
    buf = host.alloc(4096, 0)
    name = buf.export().payload.decode()
    t = host.as_tensor(buf, torch.int32)
    t.fill_(7)
    buf.close()                        # the tensor keeps the mapping alive; the name is gone
    assert int(t.sum()) == 7 * 1024
    if os.path.isdir("/dev/shm"):
        assert not os.path.exists("/dev/shm" + name)
    del t


def test_host_stream_gc_drains_work(host):
    a, b = host.alloc(64, 0), zeroed(host, 64, 0)
    host.as_tensor(a).fill_(9)
    s = host.create_stream(0)
    worker = s._worker
    host.copy_async(s, b.ptr, a.ptr, 64)
    ev = host.record_event(s)
    del s
    assert host.event_wait(ev, T)
    worker.join(T)
    assert not worker.thread.is_alive()
    assert int(host.as_tensor(b).sum()) == 9 * 64

    s = host.create_stream(1)            # close(): queued work still runs, new work is refused
    host.memset_async(s, b.ptr, 1, 64)
    ev = host.record_event(s)
    s.close()
    s.close()
    assert s.closed and host.event_wait(ev, T)
    assert int(host.as_tensor(b).sum()) == 64
    with pytest.raises(BadInput, match="closed"):
        host.copy_async(s, b.ptr, a.ptr, 8)
    a.close()
    b.close()


def test_capabilities_say_what_the_code_asks(platform):
    """The capabilities pp/ and kv/ ask instead of a platform's name agree with what the platform does."""
    import torch
    assert isinstance(platform.host_memory, bool) and isinstance(platform.kernels_interpreted, bool)
    assert platform.memory_runtime in ("cuda", "hip", "host")
    assert platform.collective_backend in ("nccl", "gloo")
    buf = platform.alloc(64, 0)
    try:
        assert buf.addressable      # alloc's buffers and their IPC mappings are; a host cma mapping is not
        t = platform.as_tensor(buf)
        assert t.device == platform.torch_device(0)
        assert (t.device.type == "cpu") == platform.host_memory == (platform.memory_runtime == "host")
    finally:
        buf.close()
    assert platform.sdma is None or platform.memory_runtime == "hip"
    assert isinstance(platform.copy_engine_peer_copies, bool)
    assert not (platform.copy_engine_peer_copies and platform.memory_runtime == "hip")    # ROCm's: the sdma backend
    assert torch.device(platform.torch_device(0)).type in ("cpu", "cuda")
