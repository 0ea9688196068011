"""The host emulation's cross-memory attach (cma): another process's plain memory (a torch CPU tensor that is
no shared-memory buffer) exported as a cma handle, opened as a mapping that is not addressable here, reached by
the copy hooks through process_vm_readv / process_vm_writev; its checks before any system call and its typed
errors (errno injected where the machine cannot produce it)."""
from __future__ import annotations

import ctypes
import errno
import os

import numpy as np
import pytest
import torch

from gpuxfer.errors import BackendUnavailable, BadInput, DriverError, NotExportable, PeerLost
from gpuxfer.platforms import host_cma
from gpuxfer.platforms.base import IpcHandle
from gpuxfer.platforms.host import HostPlatform

T = 60.0
N = 1 << 16


def _exporter(to_parent, from_parent, n: int) -> list[int]:
    """Hold a plain tensor of ``n`` bytes (byte i = i % 251), send its cma handle (the whole storage, the range
    asked starting 64 bytes in), wait for "stop", return the tensor's bytes then."""
    plat = HostPlatform()
    t = (torch.arange(n, dtype=torch.int64) % 251).to(torch.uint8)
    st = t.untyped_storage()
    ex = plat.export_range(t.data_ptr() + 64, 128, 0, within=(st.data_ptr(), st.nbytes()))
    assert ex.offset == 64 and ex.handle.nbytes == n and host_cma.is_cma_payload(ex.handle.payload)
    to_parent.put(ex.handle)
    assert from_parent.get(timeout=T) == "stop"
    return t.tolist()


@pytest.fixture
def exporter(spawner):
    to_parent, from_parent = spawner.queue(), spawner.queue()
    child = spawner.start(_exporter, to_parent, from_parent, N, name="exporter")
    handle = to_parent.get(timeout=T)

    def stop() -> list[int]:
        from_parent.put("stop")
        out = child.result(T)
        child.join(T)
        return out
    yield handle, child, stop


def _open(host, handle):
    """The exporter's memory opened here; the test skips where the kernel denies cross-memory attach (ptrace
    access: kernel.yama.ptrace_scope, a seccomp profile) with the reason."""
    try:
        return host.open_handle(handle, 0)
    except BackendUnavailable as exc:
        pytest.skip(f"cross-memory attach is denied here: {exc}")


def _want() -> np.ndarray:
    return (np.arange(N) % 251).astype(np.uint8)


def test_pull_and_push_plain_memory_of_another_process(host, exporter):
    handle, child, stop = exporter
    m = _open(host, handle)
    assert not m.addressable and m.nbytes == N
    assert host.allocation_range(m.ptr + 5, 0) == (m.ptr, N)
    s = host.create_stream(0)
    try:
        got = torch.zeros(N, dtype=torch.uint8)
        host.copy_async(s, got.data_ptr(), m.ptr, N)                # pull: process_vm_readv
        assert host.synchronize(s, T)
        assert np.array_equal(got.numpy(), _want())
        ones = torch.full((300,), 7, dtype=torch.uint8)
        offs = np.arange(0, 3000, 10, dtype=np.int64)               # 300 one-byte pushes: process_vm_writev
        host.copy_batch_async(s, m.ptr + offs, ones.data_ptr() + np.arange(300), np.ones(300, dtype=np.int64))
        assert host.synchronize(s, T)
        with pytest.raises(BadInput, match="not addressable"):
            host.as_tensor(m)
        with pytest.raises(NotExportable, match="another process's buffer"):
            host.export_range(m.ptr, 8, 0)
    finally:
        s.close()
        m.close()
    want = _want()
    want[offs] = 7
    assert np.array_equal(np.array(stop(), dtype=np.uint8), want)


def test_iovec_batches_of_at_most_iov_max(host, exporter, monkeypatch):
    handle, _, stop = exporter
    m = _open(host, handle)
    calls = []
    real = host_cma._vm_call

    def spy(write, pid, local, remote, count):
        calls.append(count)
        return real(write, pid, local, remote, count)

    monkeypatch.setattr(host_cma, "_vm_call", spy)
    monkeypatch.setattr(host_cma, "IOV_MAX", 3)
    s = host.create_stream(0)
    try:
        got = torch.zeros(10 * 16, dtype=torch.uint8)
        srcs = m.ptr + np.arange(10, dtype=np.int64) * 100
        host.copy_batch_async(s, got.data_ptr() + np.arange(10) * 16, srcs, np.full(10, 16))
        assert host.synchronize(s, T)
        assert calls == [3, 3, 3, 1]
        want = _want()
        assert np.array_equal(got.numpy().reshape(10, 16), np.stack([want[i * 100:i * 100 + 16] for i in range(10)]))
        calls.clear()                       # copies contiguous on both sides (a run of blocks) share one iovec
        offs = np.array([0, 16, 32, 48, 1000, 1016, 64, 80], dtype=np.int64)
        dsts = np.array([0, 16, 32, 48, 64, 80, 96, 112], dtype=np.int64)
        host.copy_batch_async(s, got.data_ptr() + dsts, m.ptr + offs, np.full(8, 16))
        assert host.synchronize(s, T)
        assert calls == [3]
        assert np.array_equal(got.numpy()[:128], np.concatenate([want[o:o + 16] for o in offs]))
    finally:
        s.close()
        m.close()
        stop()


def test_out_of_range_and_unaddressable_uses_refused_before_any_syscall(host, exporter, monkeypatch):
    handle, _, stop = exporter
    m = _open(host, handle)
    calls = []
    monkeypatch.setattr(host_cma, "_vm_call", lambda *a: calls.append(a) or (0, 0))
    s = host.create_stream(0)
    buf = torch.zeros(64, dtype=torch.uint8)
    try:
        for src, n in ((m.ptr + N - 4, 8), (m.ptr + N - 1, 2), (m.ptr, N + 1), (m.ptr + 8, (1 << 63) - 1)):
            with pytest.raises(BadInput, match="run past"):
                host.copy_async(s, buf.data_ptr(), src, n)
        with pytest.raises(BadInput, match="run past"):
            host.copy_batch_async(s, [buf.data_ptr(), m.ptr + N - 8], [m.ptr, buf.data_ptr()], [8, 16])
        with pytest.raises(BadInput, match="reaches into"):      # a plain range running into the mapping
            host.copy_async(s, m.ptr - 8, buf.data_ptr(), 16)
        with pytest.raises(BadInput, match="both ends"):
            host.copy_async(s, m.ptr, m.ptr + 64, 8)
        with pytest.raises(BadInput, match="not addressable"):
            host.memset_async(s, m.ptr, 0, 8)
        for call in (lambda: host.write_flag(s, m.ptr + 8, 1), lambda: host.wait_flag(s, m.ptr, 1),
                     lambda: host.read_flag(m.ptr, 0), lambda: host.host_write_flag(m.ptr, 1, 0)):
            with pytest.raises(BadInput, match="not addressable"):
                call()
        assert host.synchronize(s, T)
        assert calls == []
    finally:
        s.close()
        m.close()
        stop()


def test_eperm_names_ptrace_scope(host, exporter, monkeypatch):
    handle, _, stop = exporter
    m = _open(host, handle)
    s = host.create_stream(0)
    try:
        monkeypatch.setattr(host_cma, "_vm_call", lambda *a: (-1, errno.EPERM))
        with pytest.raises(BackendUnavailable, match="ptrace_scope"):
            host.open_handle(handle, 0)                             # the probe at open
        buf = torch.zeros(8, dtype=torch.uint8)
        host.copy_async(s, buf.data_ptr(), m.ptr, 8)                # a copy: its transfer fails
        with pytest.raises(BackendUnavailable, match="ptrace_scope"):
            host.synchronize(s, T)
        monkeypatch.setattr(host_cma, "_vm_call", lambda *a: (3, 0))    # a short copy
        host.copy_async(s, buf.data_ptr(), m.ptr, 8)
        host.copy_async(s, buf.data_ptr(), m.ptr, 8)
        with pytest.raises(DriverError, match="moved 3 of 8 bytes"):
            host.synchronize(s, T)
        monkeypatch.setattr(host_cma, "_vm_call", lambda *a: (-1, errno.EFAULT))
        host.copy_batch_async(s, [buf.data_ptr()], [m.ptr], [8])
        with pytest.raises(DriverError, match="EFAULT"):
            host.synchronize(s, T)
        other = host.create_stream(0)
        try:                                                        # a stream waiting on the failed transfer:
            host.copy_async(s, buf.data_ptr(), m.ptr, 8)            # its work up to its next event fails too,
            host.stream_wait_event(other, host.record_event(s))     # then it runs on
            with pytest.raises(DriverError, match="EFAULT"):
                host.synchronize(other, T)
            assert host.synchronize(other, T)
        finally:
            other.close()
        monkeypatch.undo()
        host.copy_async(s, buf.data_ptr(), m.ptr + 1, 8)           # the stream runs on after a failed transfer
        assert host.synchronize(s, T) and buf.tolist() == list(range(1, 9))
    finally:
        s.close()
        m.close()
        stop()


def test_forged_and_stale_handles(host, exporter):
    handle, child, stop = exporter
    magic, pid, start, addr, size, boot = host_cma._PAYLOAD.unpack(handle.payload)

    def forged(**kw):
        f = dict(pid=pid, start=start, addr=addr, size=size, boot=boot)
        f.update(kw)
        payload = host_cma._PAYLOAD.pack(magic, f["pid"], f["start"], f["addr"], f["size"], f["boot"])
        return IpcHandle("host", 0, kw.get("nbytes", f["size"]), payload, kw.get("owner", pid))

    with pytest.raises(BadInput, match="another boot"):
        host.open_handle(forged(boot=bytes(16)), 0)
    with pytest.raises(BadInput, match="comes from process"):
        host.open_handle(forged(owner=pid + 1), 0)
    with pytest.raises(BadInput, match="claims"):
        host.open_handle(forged(nbytes=size + 1), 0)
    with pytest.raises(BadInput, match="claims"):
        host.open_handle(forged(addr=(1 << 63) - 8, size=64), 0)
    with pytest.raises(BadInput, match="never exported"):     # a range of the process it did not export
        host.open_handle(forged(addr=addr + 8, size=size - 8), 0)
    with pytest.raises(BadInput, match="published no cma registry"):     # a live process that exported nothing
        host.open_handle(forged(pid=os.getppid(), owner=os.getppid(), start=host_cma.start_time(os.getppid())), 0)
    with pytest.raises(PeerLost, match="another process"):
        host.open_handle(forged(start=start + 1), 0)            # the pid names another process (start time)
    with pytest.raises(BadInput, match="payload holds"):
        host.open_handle(IpcHandle("host", 0, 8, host_cma.CMA_MAGIC + b"x", pid), 0)
    with pytest.raises(BadInput, match="exported"):
        host.open_handle(IpcHandle("host", 0, 8, handle.payload, os.getpid()), 0)
    stop()
    with pytest.raises(PeerLost):
        host.open_handle(handle, 0)                             # the exporter exited


def test_export_range_of_plain_memory(host):
    t = torch.zeros(1000, dtype=torch.uint8)
    ex = host.export_range(t.data_ptr() + 10, 20, 0)
    assert ex.offset == 0 and ex.handle.nbytes == 20 and ex.handle.owner_pid == os.getpid()
    st = t.untyped_storage()
    ex = host.export_range(t.data_ptr() + 10, 20, 0, within=(st.data_ptr(), st.nbytes()))
    assert ex.offset == 10 and ex.handle.nbytes == 1000
    ex = host.export_range(t.data_ptr() + 10, 2000, 0, within=(st.data_ptr(), st.nbytes()))
    assert ex.offset == 0 and ex.handle.nbytes == 2000          # not within: the range itself
    with pytest.raises(NotExportable, match="empty"):
        host.export_range(t.data_ptr(), 0, 0)
    with pytest.raises(BadInput, match="exported"):
        host.open_handle(ex.handle, 0)
    assert ctypes.sizeof(ctypes.c_void_p) == 8


@pytest.mark.parametrize("pid", [0, 1 << 31, 1 << 40, (1 << 64) - 1])
def test_a_handle_naming_a_pid_no_process_can_have_is_bad_input(host, pid):
    """A forged handle whose pid lies outside pid_t's positive range: BadInput, not an OverflowError of the
    pidfd call nor a PeerLost for a process that never was."""
    payload = host_cma._PAYLOAD.pack(host_cma.CMA_MAGIC, pid, 5, 4096, 4096, host_cma.boot_id())
    with pytest.raises(BadInput, match="names no process"):
        host.open_handle(IpcHandle("host", 0, 4096, payload, pid), 0)


@pytest.mark.parametrize("nbytes", [4096.0, True])
def test_a_cma_handle_whose_size_is_not_an_int_is_bad_input(host, nbytes):
    payload = host_cma._PAYLOAD.pack(host_cma.CMA_MAGIC, os.getppid(), 5, 4096, 4096, host_cma.boot_id())
    with pytest.raises(BadInput, match="claims"):
        host.open_handle(IpcHandle("host", 0, nbytes, payload, os.getppid()), 0)


@pytest.mark.parametrize("payload", ["/gx1_1_abcdef12", None, 5, [b"GXCMA"], memoryview(b"/gx1_1_abcdef12")])
def test_a_handle_whose_payload_is_not_bytes_is_bad_input(host, payload):
    with pytest.raises(BadInput, match="not a host IPC handle"):
        host.open_handle(IpcHandle("host", 0, 4096, payload, os.getppid()), 0)


def test_a_registry_shorter_than_its_count_is_bad_input(host):
    """A registry segment another process of the user put under a live process's name, counting more entries
    than it holds: refused, not read past its end."""
    from gpuxfer.common import map_shm, unlink_shm
    pid = os.getppid()
    start = host_cma.start_time(pid)
    name = host_cma._Registry.name(pid, start)
    mm = map_shm(name, host_cma._Registry.HEADER.size + 8, create=True)
    try:
        host_cma._Registry.HEADER.pack_into(mm, 0, host_cma.CMA_MAGIC, pid, start, 1)
        payload = host_cma._PAYLOAD.pack(host_cma.CMA_MAGIC, pid, start, 4096, 4096, host_cma.boot_id())
        with pytest.raises(BadInput, match="fewer than"):
            host.open_handle(IpcHandle("host", 0, 4096, payload, pid), 0)
    finally:
        mm.close()
        unlink_shm(name)
