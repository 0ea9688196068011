"""NIXL: descriptor translation (hypothesis round trips), what happens without the package, and the call
sequence (register, metadata, add_remote_agent, prep, make_prepped_xfer, transfer, check_xfer_state,
release) over a fake ``nixl`` module that records the calls and can get stuck, so a stuck transfer must end
in TransferTimeout.
"""
from __future__ import annotations

import sys
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuxfer.errors import BackendUnavailable, BadInput, TransferTimeout
from gpuxfer.kv import nixl_ffi as nf
from gpuxfer.bench.kv.engines.chunks import bulk_descriptors

from _nixl_engines import descriptor_tables


# --------------------------------------------------------------------------- translation


@settings(max_examples=50, deadline=None)
@given(desc=descriptor_tables(), op=st.sampled_from(["READ", "WRITE"]),
       src_base=st.integers(0, 1 << 47), dst_base=st.integers(0, 1 << 47),
       src_dev=st.integers(0, 7), dst_dev=st.integers(0, 7))
def test_translation_round_trip(desc, op, src_base, dst_base, src_dev, dst_dev):
    local, remote = nf.to_nixl_dlists(desc, op, src_base=src_base, dst_base=dst_base,
                                      src_dev=src_dev, dst_dev=dst_dev)
    assert local.dtype == np.uint64 and remote.dtype == np.uint64
    assert local.shape == remote.shape == (len(desc), 3)
    # the initiator's side is local: READ is issued by the destination, WRITE by the source
    src, dst = (remote, local) if op == "READ" else (local, remote)
    assert (src[:, 0] == np.uint64(src_base) + desc[:, 0].astype(np.uint64)).all()
    assert (dst[:, 0] == np.uint64(dst_base) + desc[:, 1].astype(np.uint64)).all()
    assert (src[:, 1] == desc[:, 2].astype(np.uint64)).all() and (dst[:, 1] == src[:, 1]).all()
    assert (src[:, 2] == src_dev).all() and (dst[:, 2] == dst_dev).all()
    back = nf.from_nixl_dlists(local, remote, op, src_base=src_base, dst_base=dst_base)
    assert back.dtype == np.int64
    np.testing.assert_array_equal(back, desc)


def test_translation_worked_example():
    desc = np.array([[0, 4096, 2304], [8192, 0, 576]], dtype=np.int64)
    local, remote = nf.to_nixl_dlists(desc, "READ", src_base=0x1000_0000, dst_base=0x2000_0000,
                                      src_dev=0, dst_dev=1)
    np.testing.assert_array_equal(local, [[0x2000_1000, 2304, 1], [0x2000_0000, 576, 1]])
    np.testing.assert_array_equal(remote, [[0x1000_0000, 2304, 0], [0x1000_2000, 576, 0]])
    local_w, remote_w = nf.to_nixl_dlists(desc, "WRITE", src_base=0x1000_0000, dst_base=0x2000_0000,
                                          src_dev=0, dst_dev=1)
    np.testing.assert_array_equal(local_w, remote)
    np.testing.assert_array_equal(remote_w, local)


@pytest.mark.parametrize("bad, match", [
    (np.zeros((3, 2), np.int64), "shape"),
    (np.zeros((2, 3), np.float64), "integers"),
    (np.array([[0, 0, 0]], np.int64), "moves 0 bytes"),
    (np.array([[-1, 0, 8]], np.int64), r"source range \[-1, 7\)"),
    (np.array([[0, 120, 16]], np.int64), "destination pool"),
    (np.array([[100, 0, 64]], np.int64), "source pool"),
])
def test_translation_rejects_bad_tables(bad, match):
    with pytest.raises(BadInput, match=match):
        nf.to_nixl_dlists(bad, "READ", src_base=0, dst_base=0, src_dev=0, dst_dev=0,
                          src_nbytes=128, dst_nbytes=128)


def test_translation_rejects_bad_op_and_mismatched_lists():
    d = np.array([[0, 0, 8]], np.int64)
    with pytest.raises(BadInput, match="op"):
        nf.to_nixl_dlists(d, "GET", src_base=0, dst_base=0, src_dev=0, dst_dev=0)
    loc, rem = nf.to_nixl_dlists(d, "READ", src_base=64, dst_base=64, src_dev=0, dst_dev=0)
    rem2 = rem.copy()
    rem2[0, 1] = 9
    with pytest.raises(BadInput, match="length"):
        nf.from_nixl_dlists(loc, rem2, "READ", src_base=64, dst_base=64)
    with pytest.raises(BadInput, match="below"):
        nf.from_nixl_dlists(loc, rem, "READ", src_base=128, dst_base=64)
    with pytest.raises(BadInput, match="shape"):
        nf.from_nixl_dlists(loc, rem[:0], "READ", src_base=64, dst_base=64)


@settings(max_examples=40, deadline=None)
@given(nbytes=st.integers(0, 1 << 34), chunk=st.integers(1, 1 << 30))
def test_bulk_descriptors_cover_exactly(nbytes, chunk):
    if nbytes // chunk > 100_000:
        chunk = max(chunk, nbytes // 100_000 + 1)
    d = bulk_descriptors(nbytes, chunk, src_offset=5, dst_offset=7)
    assert d.dtype == np.int64 and d.shape[1] == 3
    assert int(d[:, 2].sum()) == nbytes
    assert (d[:, 2] <= chunk).all() and (d[:, 2] > 0).all()
    if len(d):
        assert (np.diff(d[:, 0]) == d[:-1, 2]).all() and (d[:, 1] - d[:, 0] == 2).all()
        assert d[0, 0] == 5


# --------------------------------------------------------------------------- the call sequence over a fake NIXL (tests/fake_nixl.py)


def _pair(fake, mem_type="DRAM"):
    nm = nf.NixlModule("fake", fake)
    a = nf.NixlAgent(nm, "src", mem_type=mem_type, rank=0)
    b = nf.NixlAgent(nm, "dst", mem_type=mem_type, rank=1)
    return a, b


def _buffers(n=1 << 16, seed=0):
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n, dtype=np.uint8)
    return src, dst


def test_find_nixl_uses_the_forced_module(fake_nixl):
    mod, why = nf.find_nixl(refresh=True)
    assert why is None and mod.name == "fake_nixl_for_tests"


def test_find_nixl_reports_why_when_missing(monkeypatch):
    monkeypatch.setenv(nf.NIXL_MODULE_ENV, "no_such_nixl_module_xyz")
    nf._found.clear()
    try:
        mod, why = nf.find_nixl(refresh=True)
        assert mod is None
        assert "not installed (tried no_such_nixl_module_xyz)" in why and "nixl-cu13" in why
        assert nf.nixl_unavailable_reason() == why
    finally:
        nf._found.clear()


def test_find_nixl_reports_a_broken_install(monkeypatch):
    broken = types.ModuleType("broken_nixl_for_tests")  # imports, but has no nixl_agent
    monkeypatch.setitem(sys.modules, "broken_nixl_for_tests", broken)
    monkeypatch.setenv(nf.NIXL_MODULE_ENV, "broken_nixl_for_tests")
    nf._found.clear()
    try:
        mod, why = nf.find_nixl(refresh=True)
        assert mod is None and "AttributeError" in why
    finally:
        nf._found.clear()


def test_module_order_prefers_the_cuda_major(monkeypatch):
    monkeypatch.delenv(nf.NIXL_MODULE_ENV, raising=False)
    monkeypatch.setattr(nf, "_cuda_major", lambda: 12)
    assert nf._module_order()[0] == "nixl_cu12"
    monkeypatch.setattr(nf, "_cuda_major", lambda: None)
    assert nf._module_order() == nf.NIXL_MODULES


@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_prepped_call_sequence_moves_the_bytes(fake_nixl, op):
    src, dst = _buffers()
    a, b = _pair(fake_nixl)
    a.register(src.ctypes.data, src.nbytes, 0)
    b.register(dst.ctypes.data, dst.nbytes, 0)
    peer_of_b = b.add_remote(a.metadata())
    peer_of_a = a.add_remote(b.metadata())
    desc = np.array([[0, 1000, 100], [5000, 0, 999], [60000, 60000, 5536]], np.int64)
    init, peer, init_name = (b, peer_of_b, "dst") if op == "READ" else (a, peer_of_a, "src")
    local, remote = nf.to_nixl_dlists(desc, op, src_base=src.ctypes.data, dst_base=dst.ctypes.data,
                                      src_dev=0, dst_dev=0)
    lh, rh = init.prep(None, local), init.prep(peer, remote)
    idx = np.arange(len(desc))
    h = init.make_prepped(op, lh, idx, rh, idx)
    init.run(h, "test", timeout_s=5)
    stats = init.stats(h, len(desc), int(desc[:, 2].sum()))
    assert stats.post_us == 3 and stats.xfer_us == 7 and stats.merged_descriptors == 3 and stats.backend == "UCX"
    init.release_xfer(h)
    for s, d, n in desc.tolist():
        np.testing.assert_array_equal(dst[d:d + n], src[s:s + n])
    a.close(), b.close()
    a.close()  # idempotent
    names = [c[1] for c in fake_nixl.calls if c[0] == init_name]
    assert names[:2] == ["nixl_agent", "register_memory"]
    i = names.index("make_prepped_xfer")
    assert names[i - 2:i] == ["prep_xfer_dlist", "prep_xfer_dlist"]
    assert names[i:i + 3] == ["make_prepped_xfer", "transfer", "release_xfer_handle"]
    # close releases the prepped lists, then the peer, then the registration
    assert names[-4:] == ["release_dlist_handle", "release_dlist_handle", "remove_remote_agent", "deregister_memory"]


def test_oneshot_call_sequence(fake_nixl):
    src, dst = _buffers(seed=1)
    a, b = _pair(fake_nixl)
    with a, b:
        a.register(src.ctypes.data, src.nbytes, 0)
        b.register(dst.ctypes.data, dst.nbytes, 0)
        peer = b.add_remote(a.metadata())
        desc = np.array([[128, 256, 4096]], np.int64)
        local, remote = nf.to_nixl_dlists(desc, "READ", src_base=src.ctypes.data, dst_base=dst.ctypes.data,
                                          src_dev=0, dst_dev=0)
        h = b.oneshot("READ", local, remote, peer, notif=b"landed")
        b.run(h, "oneshot", timeout_s=5)
        b.release_xfer(h)
        a.wait_notif("dst", b"landed", timeout_s=5)
        np.testing.assert_array_equal(dst[256:256 + 4096], src[128:128 + 4096])
    names = [c[1] for c in fake_nixl.calls if c[0] == "dst"]
    assert "initialize_xfer" in names and "prep_xfer_dlist" not in names


def test_stuck_transfer_times_out_and_close_still_releases(fake_nixl):
    fake_nixl.stuck = True
    src, dst = _buffers(n=4096)
    a, b = _pair(fake_nixl)
    a.register(src.ctypes.data, src.nbytes, 0)
    b.register(dst.ctypes.data, dst.nbytes, 0)
    peer = b.add_remote(a.metadata())
    local, remote = nf.to_nixl_dlists(np.array([[0, 0, 64]]), "READ", src_base=src.ctypes.data,
                                      dst_base=dst.ctypes.data, src_dev=0, dst_dev=0)
    h = b.oneshot("READ", local, remote, peer)
    with pytest.raises(TransferTimeout) as ei:
        b.run(h, "a stuck READ", timeout_s=0.2, step=4)
    assert ei.value.rank == 1 and ei.value.step == 4 and "nixl" in ei.value.flag
    assert "a stuck READ" in str(ei.value) and "PROC" in str(ei.value)
    b.close()
    a.close()
    assert h.released  # close() released the handle it still held
    # ... and kept the agent that held it running: its memory stays registered
    assert b in nf._KEPT and a not in nf._KEPT
    assert [c[0] for c in fake_nixl.calls if c[1] == "deregister_memory"] == ["src"]
    nf._KEPT.remove(b)
    with pytest.raises(TransferTimeout, match="notification"):
        a2 = nf.NixlAgent(nf.NixlModule("fake", fake_nixl), "lonely", rank=3)
        try:
            a2.wait_notif("nobody", b"x", timeout_s=0.05)
        finally:
            a2.close()


def test_err_state_raises_a_typed_error(fake_nixl):
    src, dst = _buffers(n=4096)
    a, b = _pair(fake_nixl)
    with a, b:
        a.register(src.ctypes.data, src.nbytes, 0)
        b.register(dst.ctypes.data, dst.nbytes, 0)
        peer = b.add_remote(a.metadata())
        local, remote = nf.to_nixl_dlists(np.array([[0, 0, 64]]), "READ", src_base=src.ctypes.data,
                                          dst_base=dst.ctypes.data, src_dev=0, dst_dev=0)
        h = b.oneshot("READ", local, remote, peer)
        fake_nixl.agents["dst"].check_xfer_state = lambda h: "ERR"
        with pytest.raises(nf.NixlError, match="ERR"):
            b.run(h, "failing READ", timeout_s=5)
        # a call that raises inside NIXL comes back typed too, naming what we were doing
        with pytest.raises(nf.NixlError, match="prepping"):
            b.prep(peer, np.array([[1, 8, 0]], np.uint64))  # not inside any registered region


@pytest.mark.parametrize("ending", ["DONE", "ERR posting", "ERR later", "never posted"])
def test_close_keeps_the_agent_of_a_transfer_that_never_completed(fake_nixl, ending):
    """A transfer NIXL started and never reported DONE (ERR when posted or later) counts as unsettled once
    released: NIXL's release does not stop what it handed the backend, so close keeps the agent (no memory
    deregistered); one seen DONE, or never posted, does not."""
    src, dst = _buffers(n=4096)
    a, b = _pair(fake_nixl)
    a.register(src.ctypes.data, src.nbytes, 0)
    b.register(dst.ctypes.data, dst.nbytes, 0)
    peer = b.add_remote(a.metadata())
    local, remote = nf.to_nixl_dlists(np.array([[0, 0, 64]]), "READ", src_base=src.ctypes.data,
                                      dst_base=dst.ctypes.data, src_dev=0, dst_dev=0)
    h = b.oneshot("READ", local, remote, peer)
    if ending == "ERR posting":
        fake_nixl.agents["dst"].transfer = lambda x: "ERR"
    if ending == "ERR later":
        fake_nixl.agents["dst"].check_xfer_state = lambda x: "ERR"
    if ending != "never posted":
        try:
            b.run(h, "a READ", timeout_s=5)
        except nf.NixlError:
            assert ending.startswith("ERR")
    b.release_xfer(h)
    assert h.released and b.unsettled == (1 if ending.startswith("ERR") else 0)
    b.close()
    a.close()
    assert (b in nf._KEPT) == ending.startswith("ERR")
    assert [c[0] for c in fake_nixl.calls if c[1] == "deregister_memory"] == (
        ["src"] if ending.startswith("ERR") else ["dst", "src"])
    nf._KEPT.clear()


def test_a_remote_agent_is_added_once(fake_nixl):
    """NIXL loads an agent's metadata twice silently: the wrapper refuses the second, keeping one entry (two
    holders would remove it from under each other); given the name expected, before NIXL loads it."""
    a, b = _pair(fake_nixl)
    with a, b:
        assert b.add_remote(a.metadata()) == "src"
        with pytest.raises(nf.RemoteHeld, match="added already") as held:
            b.add_remote(a.metadata())
        assert held.value.name == "src" and b._remotes == ["src"]
        loads = [c for c in fake_nixl.calls if c[1] == "add_remote_agent"]
        with pytest.raises(nf.RemoteHeld, match="NIXL agent 'src' is added already"):
            b.add_remote(a.metadata(), "src")           # its name held: refused before NIXL loads it again
        assert [c for c in fake_nixl.calls if c[1] == "add_remote_agent"] == loads and b._remotes == ["src"]
        b.remove_remote("src")
        assert b._remotes == [] and fake_nixl.agents["dst"].remotes == set()


def test_missing_plugin_is_backend_unavailable(fake_nixl):
    fake_nixl.plugins = []
    with pytest.raises(BackendUnavailable, match="NIXL_PLUGIN_DIR"):
        nf.NixlAgent(nf.NixlModule("fake", fake_nixl), "noplugins", rank=0)


def test_missing_telemetry_leaves_fields_empty(fake_nixl):
    fake_nixl.with_telemetry = False
    src, dst = _buffers(n=4096)
    a, b = _pair(fake_nixl)
    with a, b:
        a.register(src.ctypes.data, src.nbytes, 0)
        b.register(dst.ctypes.data, dst.nbytes, 0)
        peer = b.add_remote(a.metadata())
        local, remote = nf.to_nixl_dlists(np.array([[0, 0, 64]]), "READ", src_base=src.ctypes.data,
                                          dst_base=dst.ctypes.data, src_dev=0, dst_dev=0)
        h = b.oneshot("READ", local, remote, peer)
        b.run(h, "x", timeout_s=5)
        s = b.stats(h, 1, 64)
        assert s.post_us is None and s.xfer_us is None and s.backend == "UCX"
