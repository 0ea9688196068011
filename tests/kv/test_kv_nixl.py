"""NIXL / Mooncake engines: descriptor translation, skip logic, and the NIXL call sequence.

CPU tests run everywhere: the translation functions (hypothesis round trips), what
happens without the packages, and a fake ``nixl`` module that records the engine's
calls (register, metadata, add_remote_agent, prep, make_prepped_xfer, transfer,
check_xfer_state, release) and can get stuck, so a stuck transfer must end in
TransferTimeout. GPU tests (marked ``gpu``) run the engines between two GPUs
through the benchmark runner, every byte verified.
"""
from __future__ import annotations

import ctypes
import sys
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuxfer.errors import BackendUnavailable, BadInput, TransferTimeout
from gpuxfer.bench.kv.engines import nixl as ne
from gpuxfer.kv import nixl_ffi as nf
from gpuxfer.bench.kv.engines.chunks import bulk_descriptors


# --------------------------------------------------------------------------- translation

def _tables(max_n=40):
    @st.composite
    def build(draw):
        n = draw(st.integers(0, max_n))
        sizes = draw(st.lists(st.integers(1, 1 << 20), min_size=n, max_size=n))
        src = draw(st.lists(st.integers(0, 1 << 40), min_size=n, max_size=n))
        dst = draw(st.lists(st.integers(0, 1 << 40), min_size=n, max_size=n))
        return np.array(list(zip(src, dst, sizes)), dtype=np.int64).reshape(-1, 3)
    return build()


@settings(max_examples=50, deadline=None)
@given(desc=_tables(), op=st.sampled_from(["READ", "WRITE"]),
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


# --------------------------------------------------------------------------- a fake NIXL

class FakeNixl:
    """A module-like fake of NIXL's Python API that moves bytes in this process (ctypes.memmove).

    Agents in one process see each other through a shared registry, so a READ or a
    WRITE really copies. ``stuck=True`` leaves every transfer in PROC forever.
    """

    def __init__(self, *, stuck=False, plugins=("UCX",), telemetry=True):
        self.calls: list[tuple] = []
        self.agents: dict[str, "FakeNixl.Agent"] = {}
        self.stuck, self.plugins, self.with_telemetry = stuck, list(plugins), telemetry
        fake = self

        class nixl_agent_config:  # noqa: N801 - NIXL's name
            def __init__(self, enable_prog_thread=True, enable_listen_thread=False, listen_port=0,
                         capture_telemetry=False, num_threads=0, backends=("UCX",)):
                self.backends, self.capture_telemetry = list(backends), capture_telemetry

        class nixl_agent(FakeNixl.Agent):  # noqa: N801
            def __init__(self, name, conf):
                super().__init__(fake, name, conf)

        self.nixl_agent_config = nixl_agent_config
        self.nixl_agent = nixl_agent

    class Handle:
        def __init__(self, kind, **kw):
            self.kind, self.released, self.__dict__["kw"] = kind, False, kw

    class Agent:
        def __init__(self, fake, name, conf):
            self.fake, self.name, self.conf = fake, name, conf
            self.regions: list[tuple[int, int]] = []
            self.remotes: set[str] = set()
            self.notifs: dict[str, list[bytes]] = {}
            fake.agents[name] = self
            self._log("nixl_agent", name)

        def _log(self, *call):
            self.fake.calls.append((self.name,) + call)

        def get_plugin_list(self):
            return list(self.fake.plugins)

        def register_memory(self, regs, mem_type):
            self._log("register_memory", mem_type, len(regs))
            self.regions += [(a, n) for a, n, _dev, _meta in regs]
            return FakeNixl.Handle("reg", regs=regs)

        def deregister_memory(self, h):
            self._log("deregister_memory")

        def get_agent_metadata(self):
            return self.name.encode()

        def add_remote_agent(self, md):
            name = md.decode()
            assert name in self.fake.agents, "metadata of an unknown agent"
            self.remotes.add(name)
            self._log("add_remote_agent", name)
            return name

        def remove_remote_agent(self, name):
            self._log("remove_remote_agent", name)
            self.remotes.discard(name)

        def make_connection(self, remote):
            self._log("make_connection", remote)

        def _check_rows(self, owner, rows):
            regions = self.fake.agents[owner].regions
            for a, n, _ in rows.tolist():
                assert any(ra <= a and a + n <= ra + rn for ra, rn in regions), \
                    f"row 0x{a:x}+{n} not inside a region registered by {owner}"

        def prep_xfer_dlist(self, agent_name, rows, mem_type):
            owner = self.name if agent_name in ("NIXL_INIT_AGENT", "") else agent_name
            assert owner == self.name or owner in self.remotes, f"prep for unknown agent {owner}"
            rows = np.asarray(rows)
            assert rows.dtype == np.uint64 and rows.ndim == 2 and rows.shape[1] == 3
            self._check_rows(owner, rows)
            self._log("prep_xfer_dlist", "local" if owner == self.name else "remote", len(rows))
            return FakeNixl.Handle("dlist", rows=rows.copy(), owner=owner)

        def release_dlist_handle(self, h):
            assert not h.released
            h.released = True
            self._log("release_dlist_handle")

        def make_prepped_xfer(self, op, lh, li, rh, ri, notif=b""):
            assert op in ("READ", "WRITE") and not lh.released and not rh.released
            li, ri = np.asarray(li), np.asarray(ri)
            assert li.dtype == np.int32 and ri.dtype == np.int32 and len(li) == len(ri)
            self._log("make_prepped_xfer", op, len(li))
            return FakeNixl.Handle("xfer", op=op, local=lh.kw["rows"][li], remote=rh.kw["rows"][ri],
                                   peer=rh.kw["owner"], notif=notif)

        def get_xfer_descs(self, rows, mem_type):
            rows = np.asarray(rows)
            assert rows.dtype == np.uint64
            return rows.copy()

        def initialize_xfer(self, op, loc, rem, remote, notif=b""):
            assert remote in self.remotes
            self._check_rows(self.name, loc)
            self._check_rows(remote, rem)
            self._log("initialize_xfer", op, len(loc))
            return FakeNixl.Handle("xfer", op=op, local=loc, remote=rem, peer=remote, notif=notif)

        def transfer(self, h, notif_msg=b""):
            assert not h.released
            self._log("transfer", h.kw["op"])
            if self.fake.stuck:
                h.state = "PROC"
                return "PROC"
            peer = h.kw["peer"]
            for (la, n, _), (ra, rn, _) in zip(h.kw["local"].tolist(), h.kw["remote"].tolist()):
                assert n == rn
                there = self._here(peer, ra, n)
                if h.kw["op"] == "READ":
                    ctypes.memmove(la, there, n)
                else:
                    ctypes.memmove(there, la, n)
            if h.kw["notif"]:
                self.send_notif(peer, h.kw["notif"])
            h.state = "DONE"
            return "PROC"  # report DONE on the first check, as a real asynchronous transfer would

        def _here(self, peer, addr, n):
            """The peer's address ``addr`` as seen from this process (one process: the same)."""
            return addr

        def check_xfer_state(self, h):
            return h.state

        def get_xfer_telemetry(self, h):
            if not self.fake.with_telemetry:
                raise RuntimeError("telemetry was not captured")
            return types.SimpleNamespace(postDuration=3, xferDuration=7, descCount=len(h.kw["local"]),
                                         totalBytes=int(h.kw["local"][:, 1].sum()), startTime=0)

        def query_xfer_backend(self, h):
            return "UCX"

        def release_xfer_handle(self, h):
            assert not h.released
            h.released = True
            self._log("release_xfer_handle")

        def send_notif(self, remote, msg):
            self.fake.agents[remote].notifs.setdefault(self.name, []).append(msg)

        def check_remote_xfer_done(self, remote, tag):
            msgs = self.notifs.get(remote, [])
            for m in msgs:
                if m.startswith(tag):
                    msgs.remove(m)
                    return True
            return False


@pytest.fixture
def fake_nixl(monkeypatch):
    fake = FakeNixl()
    mod = types.ModuleType("fake_nixl_for_tests")
    mod.nixl_agent, mod.nixl_agent_config = fake.nixl_agent, fake.nixl_agent_config
    monkeypatch.setitem(sys.modules, "fake_nixl_for_tests", mod)
    monkeypatch.setenv(nf.NIXL_MODULE_ENV, "fake_nixl_for_tests")
    nf._found.clear()
    yield fake
    nf._found.clear()


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


# --------------------------------------------------------------------------- the engines over a fake NIXL
#
# Both sides run in this process, one thread each, each with its own host platform and
# pool; Side.exchange is an all-gather over a barrier. The fake NIXL copies with memmove,
# so the bytes really move; the pack kernel is the reference copy (torch on the CPU).

import threading  # noqa: E402

from _spawn import on_threads  # noqa: E402
from gpuxfer.bench.kv.engines import DescriptorBurst, Role, Side  # noqa: E402
from gpuxfer.platforms.base import Memory  # noqa: E402


class _Alias(Memory):
    """The peer's pool as seen from the other thread (same process: no IPC mapping needed)."""

    def __init__(self, buf):
        self.platform, self.device, self.ptr, self.nbytes = buf.platform, buf.device, buf.ptr, buf.nbytes

    def _release(self):
        pass


class _Exchange:
    def __init__(self, n=2):
        self.slots = [None] * n
        self.barrier = threading.Barrier(n, timeout=30)

    def __call__(self, rank):
        def exchange(obj):
            self.slots[rank] = obj
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out
        return exchange


def _reference_kernels():
    """The reference copy (torch on the CPU) in place of the Triton launchers, with their bounds check."""
    def check_copy(src_t, dst_t, desc_t):
        for s, d, n in desc_t.tolist():
            assert 0 <= s and s + n <= src_t.numel() and 0 <= d and d + n <= dst_t.numel(), (s, d, n)

    def copy_descriptors(src_t, dst_t, desc_t, *, validate=True, nbytes_hint=None):
        if validate:
            check_copy(src_t, dst_t, desc_t)
        for s, d, n in desc_t.tolist():
            dst_t[d:d + n] = src_t[s:s + n]
    return types.SimpleNamespace(copy_descriptors=copy_descriptors, check_copy=check_copy)


def _fake_kernels(monkeypatch):
    monkeypatch.setattr(ne, "kernels", _reference_kernels)
    monkeypatch.setattr(ne, "kernel_reason", lambda platform: None)


def _random_requests(rng, pool_bytes, n_req, n_desc, max_len):
    reqs = []
    for _ in range(n_req):
        n = rng.integers(1, max_len, n_desc)
        s = rng.integers(0, pool_bytes - max_len, n_desc)
        d = rng.permutation(pool_bytes // max_len - 1)[:n_desc] * max_len   # disjoint destinations
        reqs.append(np.stack([s, d, n], axis=1).astype(np.int64))
    # destinations disjoint across requests too
    cat = np.concatenate(reqs)
    order = np.random.default_rng(1).permutation(pool_bytes // max_len - 1)[:len(cat)] * max_len
    cat[:, 1] = order
    out, i = [], 0
    for r in reqs:
        out.append(cat[i:i + len(r)])
        i += len(r)
    return out


def _run_engine_pair(engine_name, direction, *, pool_bytes=1 << 18, bursts=2, n_req=3, stage_bytes=None,
                     timeout_s=20.0):
    from gpuxfer.bench.kv.engines import engine_class
    from gpuxfer.platforms.host import HostPlatform
    cls = engine_class(engine_name)
    plats = [HostPlatform(), HostPlatform()]
    pools = [plats[r].alloc(pool_bytes, r) for r in range(2)]
    ex = _Exchange()
    rng = np.random.default_rng(7)
    src_np = np.frombuffer((ctypes.c_uint8 * pool_bytes).from_address(pools[0].ptr), dtype=np.uint8)
    dst_np = np.frombuffer((ctypes.c_uint8 * pool_bytes).from_address(pools[1].ptr), dtype=np.uint8)
    src_np[:] = rng.integers(0, 256, pool_bytes, dtype=np.uint8)
    sides = [Side(plats[r], r, r, Role.SOURCE if r == 0 else Role.DESTINATION, pools[r], _Alias(pools[1 - r]),
                  ex(r), timeout_s=timeout_s) for r in range(2)]
    try:
        engines = on_threads([lambda r=r: cls(sides[r]) for r in range(2)])
        try:
            if stage_bytes:
                assert all(e.round_bytes == stage_bytes for e in engines)
            stats = []
            for b in range(bursts):          # a row: prepare once, several bursts (as the runner does), release
                reqs = _random_requests(rng, pool_bytes, n_req, 40, 2048)
                burst = DescriptorBurst(reqs)
                ps = on_threads([lambda r=r: engines[r].prepare(burst, direction) for r in range(2)])
                passive = 0 if direction == "pull" else 1
                for _ in range(3):
                    dst_np[:] = 0
                    engines[passive].post(ps[passive])
                    engines[1 - passive].post(ps[1 - passive])
                    on_threads([lambda r=r: engines[r].wait(ps[r]) for r in range(2)])
                    for s, d, n in engines[1].verify_descriptors(burst).tolist():
                        np.testing.assert_array_equal(dst_np[d:d + n], src_np[s:s + n])
                extra = [getattr(e, "row_extra", dict)() for e in engines]   # as the runner: before release
                for r in range(2):
                    engines[r].release(ps[r])
                stats.append(extra[1 - passive])
                assert extra[passive] == {}
            return engines, stats
        finally:
            for e in engines:
                e.close()
                e.close()
    finally:
        for p in pools:
            p.close()
        for p in plats:
            p.close()


@pytest.fixture
def fake_engines(fake_nixl, monkeypatch):
    _fake_kernels(monkeypatch)
    monkeypatch.setenv("GPUXFER_NIXL_PACK_STAGE_BYTES", str(16 << 10))   # several rounds per burst
    return fake_nixl


@pytest.mark.parametrize("engine", ["nixl", "nixl-oneshot", "nixl+pack", "nixl-bulk"])
@pytest.mark.parametrize("direction", ["pull", "push"])
def test_engine_moves_every_byte_over_fake_nixl(fake_engines, engine, direction):
    engines, stats = _run_engine_pair(engine, direction, stage_bytes=16 << 10 if engine == "nixl+pack" else None)
    calls = [c[1] for c in fake_engines.calls]
    op = "READ" if direction == "pull" else "WRITE"
    ops = {c[2] for c in fake_engines.calls if c[1] in ("make_prepped_xfer", "initialize_xfer")}
    assert ops == {op}
    if engine == "nixl-oneshot":
        assert "initialize_xfer" in calls and "make_prepped_xfer" not in calls
    else:
        assert "make_prepped_xfer" in calls and "initialize_xfer" not in calls
    if engine == "nixl":
        # one transfer per request, telemetry of the burst collected on release
        assert stats[-1]["nixl_transfers_per_burst"] == 3 and stats[-1]["nixl_descriptors_after_merge"] == 120
        assert stats[-1]["nixl_backend"] == "UCX" and stats[-1]["nixl_bursts"] == 3
        assert stats[-1]["nixl_post_us_p50"] == 9 and stats[-1]["nixl_xfer_us_p50"] == 7
    if engine in ("nixl+pack", "nixl-bulk"):
        # bulk descriptors only: one per round of nixl+pack (rounds of 16 KiB), one per burst of nixl-bulk
        assert {c[3] for c in fake_engines.calls if c[1] == "make_prepped_xfer"} == {1}
    # every handle and prepped list was released, registrations undone, peers removed
    assert calls.count("release_xfer_handle") == calls.count("make_prepped_xfer") + calls.count("initialize_xfer")
    assert calls.count("release_dlist_handle") == calls.count("prep_xfer_dlist")
    assert calls.count("deregister_memory") == calls.count("register_memory")
    assert calls.count("remove_remote_agent") == calls.count("add_remote_agent") == 2


def test_engine_setup_failure_on_one_side_fails_both(fake_engines, monkeypatch):
    """A side whose agent cannot start tells its peer through the exchange: both raise, naming it."""
    real = fake_engines.nixl_agent

    def picky(name, conf):
        if "-destination-" in name:
            raise RuntimeError("no UCX context on this side")
        return real(name, conf)
    monkeypatch.setattr(sys.modules["fake_nixl_for_tests"], "nixl_agent", picky)
    with pytest.raises(BackendUnavailable) as ei:
        _run_engine_pair("nixl", "pull", bursts=0)
    assert "rank 1" in str(ei.value) and "no UCX context" in str(ei.value)


def test_stuck_engine_transfer_times_out(fake_engines):
    fake_engines.stuck = True
    with pytest.raises(TransferTimeout, match="nixl READ"):
        _run_engine_pair("nixl", "pull", bursts=1, timeout_s=0.3)


def test_nixl_shed_cap(fake_engines, monkeypatch):
    monkeypatch.setenv("GPUXFER_NIXL_MAX_DESCS", "10")
    burst = DescriptorBurst([np.array([[0, 0, 8]] * 11, np.int64)])
    why = ne.NixlEngine.shed_reason(types.SimpleNamespace(name="nixl"), burst)
    assert "capped at 10" in why and "GPUXFER_NIXL_MAX_DESCS" in why
    assert ne.NixlEngine.shed_reason(types.SimpleNamespace(name="nixl"), DescriptorBurst([np.array([[0, 0, 8]])])) is None


# --------------------------------------------------------------------------- the benchmark across hosts, over the fake
#
# ``gpuxfer bench kv --cross-host`` on the host emulation: two spawned ranks, the peer pool never
# mapped by the runner; the NIXL engines run over tests/fake_nixl_net.py (this file's FakeNixl,
# reaching the other process's registered memory itself, as a network transport would).

CROSS_TINY = ["bench", "kv", "--platform", "host", "--workload", "kv-mla", "--isl", "16", "--page", "16",
              "--batch", "1", "--warmup", "0", "--trials", "1", "--timeout", "60", "--cross-host"]


@pytest.fixture
def net_fake_nixl(monkeypatch, tmp_path):
    mail = tmp_path / "nixl-mail"
    mail.mkdir()
    monkeypatch.setenv(nf.NIXL_MODULE_ENV, "fake_nixl_net")    # the spawned ranks import it (tests/ on sys.path)
    monkeypatch.setenv("FAKE_NIXL_NET_DIR", str(mail))
    monkeypatch.delenv("GPUXFER_INJECT_FAULT", raising=False)


def _bench(capsys, tmp_path, *argv):
    import json
    import time
    from gpuxfer.cli import main
    out = tmp_path / "out"
    t0 = time.monotonic()
    rc = main([*CROSS_TINY, *argv, "--out", str(out)])
    assert time.monotonic() - t0 < 120
    cap = capsys.readouterr()
    path = out / "kv_bench.json"
    return rc, cap.out + cap.err, json.loads(path.read_text()) if path.exists() else None


@pytest.mark.slow      # 15-35 s each; test_bench_cross_host_verification_catches_a_wrong_byte runs by default
@pytest.mark.parametrize("engines", [("nixl", "nixl-oneshot", "nixl-bulk"), ("nixl+pack", "nixl-bulk")],
                         ids=["per-descriptor", "pack"])
def test_bench_cross_host_runs_the_nixl_engines_over_the_fake(net_fake_nixl, capsys, tmp_path, engines):
    rc, text, doc = _bench(capsys, tmp_path, "--engine", ",".join(("bulk", "triton") + engines))
    assert rc == 0, text
    assert doc["environment"]["cross_host"] is True and "# PASS" in text
    assert "% of ceiling is of the nixl-bulk row" in text
    shed = {s["engine"]: s["reason"] for s in doc["shed"] if "engine" in s}
    assert set(shed) == {"bulk", "triton"}
    assert all("needs the peer pool mapped over IPC; the ranks are on different hosts" in r for r in shed.values())
    rows = doc["rows"]
    assert {(r["engine"], r["direction"]) for r in rows} == {(e, d) for e in engines for d in ("pull", "push")}
    assert len(rows) == 2 * len(engines)
    for r in rows:
        assert r["error"] is None and r["verified"] and r["valid"] and r["wrong_bytes"] == 0, r
        assert r["burst_bytes"] == 61 * 9216
    for d in ("pull", "push"):
        ceiling = next(r for r in rows if r["engine"] == "nixl-bulk" and r["direction"] == d)
        assert ceiling["of_ceiling_pct"] == pytest.approx(100.0)
        for r in rows:
            if r["direction"] == d:
                assert r["ceiling_gbps"] == ceiling["p50_gbps"]
    for r in rows:
        if r["engine"] == "nixl":
            assert r["nixl_backend"] == "UCX" and r["nixl_descriptors_after_merge"] == 61


def test_bench_cross_host_verification_catches_a_wrong_byte(net_fake_nixl, capsys, tmp_path):
    """Verification is local to the destination across hosts too: an injected wrong byte fails the row.
    With no ceiling engine running, rows carry no % of ceiling."""
    rc, text, doc = _bench(capsys, tmp_path, "--engine", "nixl", "--direction", "push", "--inject-fault", "nixl")
    assert rc == 1, text
    (row,) = doc["rows"]
    assert row["fault_injected"] and not row["valid"] and row["wrong_bytes"] == 1
    assert row["ceiling_gbps"] is None and row["of_ceiling_pct"] is None
    assert "no ceiling engine runs" in text


# --------------------------------------------------------------------------- real NIXL, two processes
#
# With NIXL importable (e.g. PYTHONPATH pointing at the slim tree of docs/MULTINODE.md), the
# engines run between two processes on the host emulation (DRAM pools in shared memory,
# UCX's shared-memory / cma / tcp transports): the production call sequence, every byte
# checked. Skipped with the reason where NIXL is not importable (CI).

def _two_proc_child(rank, engine_name, direction, platform_name, q_out, q_in, seed, bursts, pool_bytes, patch_kernels):
    import os as _os
    if patch_kernels:
        _os.environ["GPUXFER_NIXL_PACK_STAGE_BYTES"] = str(64 << 10)
    from gpuxfer.bench.kv.engines import nixl as _ne
    from gpuxfer.bench.kv.engines import DescriptorBurst as _Burst, Role as _Role, Side as _Side, engine_class
    from gpuxfer.platforms import get_platform
    if patch_kernels:  # the reference copy in place of the Triton kernel (host emulation)
        _ne.kernels = _reference_kernels
        _ne.kernel_reason = lambda platform: None

    def exchange(obj):
        q_out.put(obj)
        peer = q_in.get(timeout=60)
        return [obj, peer] if rank == 0 else [peer, obj]

    plat = get_platform(platform_name)
    dev = rank if plat.device_count() > 1 else 0
    plat.set_device(dev)
    pool = plat.alloc(pool_bytes, dev)
    peer_pool = None
    try:
        handles = exchange(pool.export())
        peer_pool = plat.open_handle(handles[1 - rank], dev)
        view = plat.as_tensor(pool)
        rng = np.random.default_rng(seed)
        content = rng.integers(0, 256, pool_bytes, dtype=np.uint8)
        import torch
        view.copy_(torch.from_numpy(content if rank == 0 else np.zeros(pool_bytes, np.uint8)).to(view.device))
        if not plat.is_emulation:
            torch.cuda.synchronize(dev)
        side = _Side(plat, dev, rank, _Role.SOURCE if rank == 0 else _Role.DESTINATION, pool, peer_pool,
                     exchange, timeout_s=60.0)
        eng = engine_class(engine_name)(side)
        results = []
        try:
            passive = 0 if direction == "pull" else 1
            for b in range(bursts):       # a row: prepare once, bursts, release (as the runner does)
                reqs = _random_requests(np.random.default_rng(seed + 1 + b), pool_bytes, 2, 64, 4096)
                burst = _Burst(reqs)
                p = eng.prepare(burst, direction)
                wrong = 0
                for _ in range(3):
                    exchange("prepared")
                    if rank == passive:
                        eng.post(p)
                    exchange("passive posted")
                    if rank != passive:
                        eng.post(p)
                    eng.wait(p)
                    exchange("waited")
                    if rank == 1:
                        got = view.cpu().numpy()
                        wrong += sum(int((got[d:d + n] != content[s:s + n]).sum())
                                     for s, d, n in eng.verify_descriptors(burst).tolist())
                        view.zero_()
                        if not plat.is_emulation:
                            torch.cuda.synchronize(dev)
                    exchange("verified")
                eng.release(p)
                results.append(wrong)
            return {"wrong": results, "extra": eng.row_extra()}
        finally:
            eng.close()
    finally:
        if peer_pool is not None:
            peer_pool.close()
        pool.close()
        plat.close()


def _run_two_processes(spawner, engine, direction, platform_name, *, patch_kernels, bursts=2, pool_bytes=1 << 20):
    q01, q10 = spawner.queue(), spawner.queue()
    kids = [spawner.start(_two_proc_child, 0, engine, direction, platform_name, q01, q10, 11, bursts, pool_bytes,
                          patch_kernels, name="source"),
            spawner.start(_two_proc_child, 1, engine, direction, platform_name, q10, q01, 11, bursts, pool_bytes,
                          patch_kernels, name="destination")]
    out = [k.result(timeout=240) for k in kids]
    for k in kids:
        k.join(timeout=30)
    return out


@pytest.mark.skipif(nf.nixl_unavailable_reason() is not None,
                    reason=f"real NIXL not importable: {nf.nixl_unavailable_reason()}")
@pytest.mark.parametrize("engine", ["nixl", "nixl-oneshot", "nixl+pack", "nixl-bulk"])
@pytest.mark.parametrize("direction", ["pull", "push"])
def test_real_nixl_two_processes_host(spawner, engine, direction):
    out = _run_two_processes(spawner, engine, direction, "host", patch_kernels=True)
    assert out[1]["wrong"] == [0, 0]
    initiator = out[1] if direction == "pull" else out[0]
    if engine == "nixl":
        assert initiator["extra"]["nixl_transfers_per_burst"] == 2 and initiator["extra"]["nixl_bursts"] == 3


# --------------------------------------------------------------------------- GPU: two processes, two GPUs

def _gpu_reason() -> str | None:
    try:
        import torch
        if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
            return "needs 2 CUDA GPUs"
    except Exception as exc:  # noqa: BLE001
        return f"torch: {exc}"
    from gpuxfer.platforms import unavailable_reason
    why = unavailable_reason("cuda")
    return f"cuda platform: {why}" if why else nf.nixl_unavailable_reason()


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["nixl", "nixl-oneshot", "nixl+pack", "nixl-bulk"])
@pytest.mark.parametrize("direction", ["pull", "push"])
def test_nixl_engines_two_gpus(spawner, engine, direction):
    why = _gpu_reason()
    if why:
        pytest.skip(why)
    out = _run_two_processes(spawner, engine, direction, "cuda", patch_kernels=False, bursts=3,
                             pool_bytes=64 << 20)
    assert out[1]["wrong"] == [0, 0, 0]
    initiator = out[1] if direction == "pull" else out[0]
    if engine != "nixl+pack":
        assert initiator["extra"].get("nixl_backend") == "UCX"


NIXL_ENGINE_NAMES = ("nixl", "nixl-oneshot", "nixl+pack", "nixl-bulk")


@pytest.mark.gpu
def test_nixl_engines_through_the_benchmark_runner(tmp_path):
    """``gpuxfer bench kv`` on two GPUs with every NIXL engine: every row verified byte for byte."""
    why = _gpu_reason()
    if why:
        pytest.skip(why)
    import json
    import subprocess
    out = tmp_path / "kv"
    cmd = [sys.executable, "-m", "gpuxfer", "bench", "kv", "--platform", "cuda",
           "--engine", "bulk,triton," + ",".join(NIXL_ENGINE_NAMES) + ",mooncake",
           "--workload", "kv-dsv4", "--isl", "8k", "--page", "16,64", "--batch", "1,2",
           "--direction", "pull,push", "--trials", "3", "--warmup", "1", "--timeout", "120", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540)
    doc_path = out / "kv_bench.json"
    assert doc_path.exists(), f"no artifact; exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    doc = json.loads(doc_path.read_text())
    rows = doc["rows"]
    for engine in NIXL_ENGINE_NAMES:
        for direction in ("pull", "push"):
            mine = [r for r in rows if r["engine"] == engine and r["direction"] == direction]
            assert len(mine) == 4, f"{engine} {direction}: {len(mine)} rows; shed: {doc['shed']}"
            for r in mine:
                assert r.get("error") is None, r["error"]
                assert r["verified"] and r["valid"] and r["wrong_bytes"] == 0, r
                assert r["p50_gbps"] and r["p50_gbps"] > 0
                if engine in ("nixl", "nixl-oneshot"):
                    assert r.get("nixl_backend") == "UCX", r
    mc = [r for r in rows if r["engine"] == "mooncake"]
    if not mc:   # not installed / no nvlink_intra: skipped with the reason
        assert any(s.get("engine") == "mooncake" and s.get("reason") for s in doc["shed"]), doc["shed"]
    else:
        assert all(r["valid"] and r["wrong_bytes"] == 0 for r in mc)
    assert proc.returncode == 0, proc.stderr[-4000:]


# --------------------------------------------------------------------------- Mooncake

from gpuxfer.bench.kv.engines import mooncake as me  # noqa: E402


@settings(max_examples=40, deadline=None)
@given(desc=_tables(), op=st.sampled_from(["READ", "WRITE"]),
       local_base=st.integers(0, 1 << 47), remote_base=st.integers(0, 1 << 47))
def test_mooncake_lists_round_trip(desc, op, local_base, remote_base):
    loc, rem, ln = me.to_mooncake_lists(desc, op, local_base=local_base, remote_base=remote_base)
    assert loc.dtype == rem.dtype == ln.dtype == np.int64
    local_col, remote_col = (1, 0) if op == "READ" else (0, 1)
    back = np.empty_like(desc)
    back[:, local_col] = loc - local_base
    back[:, remote_col] = rem - remote_base
    back[:, 2] = ln
    np.testing.assert_array_equal(back, desc)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 100_000), cap=st.integers(1, 10_000))
def test_mooncake_chunks_cover(n, cap):
    c = me.chunks(n, cap)
    assert sum(j - i for i, j in c) == n and all(0 < j - i <= cap for i, j in c)
    assert all(c[k][1] == c[k + 1][0] for k in range(len(c) - 1))


def test_mooncake_rejects_bad_input():
    with pytest.raises(BadInput):
        me.to_mooncake_lists(np.zeros((2, 2), np.int64), "READ", local_base=0, remote_base=0)
    with pytest.raises(BadInput):
        me.to_mooncake_lists(np.array([[0, 0, 0]]), "READ", local_base=0, remote_base=0)
    with pytest.raises(BadInput):
        me.to_mooncake_lists(np.array([[0, 0, 1]]), "PUT", local_base=0, remote_base=0)
    with pytest.raises(BadInput):
        me.chunks(5, 0)


class FakeMooncake:
    """``mooncake.engine.TransferEngine`` in one process: sessions find each other in a registry."""

    def __init__(self, *, init_rc=0, stuck=False, fail_rc=0):
        self.sessions: dict[str, "object"] = {}
        self.calls: list[tuple] = []
        fake = self

        class TransferEngine:
            def __init__(self):
                self.regions, self.port = [], None

            def initialize(self, hostname, metadata, protocol, device):
                fake.calls.append(("initialize", metadata, protocol, device))
                if init_rc == 0:
                    self.port = 5000 + len(fake.sessions)
                    fake.sessions[f"{hostname.split(':')[0]}:{self.port}"] = self
                return init_rc

            def get_rpc_port(self):
                return self.port

            def register_memory(self, ptr, n):
                fake.calls.append(("register_memory", n))
                self.regions.append((ptr, n))
                return 0

            def unregister_memory(self, ptr):
                fake.calls.append(("unregister_memory",))
                return 0

            def _move(self, session, local, remote, lengths, read):
                assert len(local) <= me.BATCH_CAP and len(local) == len(remote) == len(lengths)
                assert all(isinstance(x, int) for x in local + remote + lengths)
                peer = fake.sessions[session]
                for la, ra, n in zip(local, remote, lengths):
                    assert any(a <= la and la + n <= a + m for a, m in self.regions)
                    assert any(a <= ra and ra + n <= a + m for a, m in peer.regions)
                    ctypes.memmove(la, ra, n) if read else ctypes.memmove(ra, la, n)
                if stuck:
                    import time
                    time.sleep(2)
                return fail_rc

            def batch_transfer_sync_read(self, session, local, remote, lengths):
                fake.calls.append(("read", len(local)))
                return self._move(session, local, remote, lengths, True)

            def batch_transfer_sync_write(self, session, local, remote, lengths):
                fake.calls.append(("write", len(local)))
                return self._move(session, local, remote, lengths, False)

        self.TransferEngine = TransferEngine


@pytest.fixture
def fake_mooncake(monkeypatch):
    def install(**kw):
        fake = FakeMooncake(**kw)
        pkg = types.ModuleType("mooncake")
        pkg.__path__ = []
        eng = types.ModuleType("mooncake.engine")
        eng.TransferEngine = fake.TransferEngine
        monkeypatch.setitem(sys.modules, "mooncake", pkg)
        monkeypatch.setitem(sys.modules, "mooncake.engine", eng)
        monkeypatch.setattr(me, "probe_nvlink_intra", lambda device, timeout_s=60.0: None)
        me._found.clear()
        return fake
    yield install
    me._found.clear()


def test_mooncake_skip_reasons(monkeypatch):
    from gpuxfer.platforms.host import HostPlatform
    me._found.clear()
    try:
        with HostPlatform() as host:
            assert "needs CUDA GPUs" in me.MooncakeEngine.unavailable_reason(host)
        cuda_like = types.SimpleNamespace(name="cuda", memory_runtime="cuda", host_memory=False)
        why = me.MooncakeEngine.unavailable_reason(cuda_like)
        if importlib_util_find("mooncake") is None:
            assert "mooncake-transfer-engine is not installed" in why
            assert "not installed" in me.probe_nvlink_intra(0)
    finally:
        me._found.clear()


def importlib_util_find(name):
    import importlib.util
    return importlib.util.find_spec(name)


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_mooncake_engine_over_fake(fake_mooncake, monkeypatch, direction):
    fake = fake_mooncake()
    monkeypatch.setattr(me, "BATCH_CAP", 16)          # several batch calls per request
    _run_engine_pair("mooncake", direction, bursts=2)
    kinds = [c[0] for c in fake.calls]
    assert kinds.count("initialize") == 2
    assert {c[2] for c in fake.calls if c[0] == "initialize"} == {"nvlink_intra"}
    assert {c[1] for c in fake.calls if c[0] == "initialize"} == {"P2PHANDSHAKE"}
    moves = [c for c in fake.calls if c[0] in ("read", "write")]
    assert {c[0] for c in moves} == {"read" if direction == "pull" else "write"}
    assert max(c[1] for c in moves) == 16 and sum(c[1] for c in moves) == 2 * 3 * 3 * 40
    assert kinds.count("unregister_memory") == kinds.count("register_memory") == 2


def test_mooncake_engine_failures(fake_mooncake, monkeypatch):
    fake_mooncake(init_rc=-1)
    with pytest.raises(BackendUnavailable, match="returned -1"):
        _run_engine_pair("mooncake", "pull", bursts=0)
    fake_mooncake(fail_rc=-5)
    with pytest.raises(Exception, match="rc"):
        _run_engine_pair("mooncake", "pull", bursts=1)
    fake_mooncake(stuck=True)
    with pytest.raises(TransferTimeout, match="mooncake"):
        _run_engine_pair("mooncake", "push", bursts=1, timeout_s=0.3)
    monkeypatch.setattr(me, "probe_nvlink_intra", lambda device, timeout_s=60.0: "no nvlink_intra in this build")
    with pytest.raises(BackendUnavailable, match="no nvlink_intra"):
        _run_engine_pair("mooncake", "pull", bursts=0)


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["pull", "push"])
def test_mooncake_engine_two_gpus(spawner, direction):
    why = _gpu_reason()
    if why and "NIXL" not in why:
        pytest.skip(why)
    why = me.probe_nvlink_intra(0)
    if why:
        pytest.skip(f"mooncake: {why}")
    out = _run_two_processes(spawner, "mooncake", direction, "cuda", patch_kernels=False, bursts=2,
                             pool_bytes=64 << 20)
    assert out[1]["wrong"] == [0, 0]


# --------------------------------------------------------------------------- hostile descriptors


def _hostile_results(engine_name: str) -> dict:
    """What ``prepare`` says on each side of ``engine_name`` (over the fakes) for every hostile burst of
    test_kv_faults, both directions."""
    from test_kv_faults import HOSTILE, POOL, _hostile_burst

    from gpuxfer.bench.kv.engines import engine_class
    from gpuxfer.platforms.host import HostPlatform
    cls = engine_class(engine_name)
    plats = [HostPlatform(), HostPlatform()]
    pools = [plats[r].alloc(POOL, r) for r in range(2)]
    ex = _Exchange()
    sides = [Side(plats[r], r, r, Role.SOURCE if r == 0 else Role.DESTINATION, pools[r], _Alias(pools[1 - r]),
                  ex(r), timeout_s=20.0) for r in range(2)]
    out = {}
    try:
        engines = on_threads([lambda r=r: cls(sides[r]) for r in range(2)])
        try:
            for direction in ("pull", "push"):
                for case, rows in HOSTILE.items():
                    for r in range(2):
                        try:
                            engines[r].release(engines[r].prepare(_hostile_burst(rows), direction))
                            out[(direction, case, r)] = "accepted"
                        except Exception as exc:  # noqa: BLE001 - reported to the test
                            out[(direction, case, r)] = f"{type(exc).__name__}: {exc}"
        finally:
            for e in engines:
                e.close()
    finally:
        for p in (*pools, *plats):
            p.close()
    return out


@pytest.mark.parametrize("engine", ["nixl", "nixl-oneshot", "nixl+pack", "nixl-bulk", "mooncake"])
def test_hostile_descriptors_are_refused_by_the_library_engines(fake_engines, fake_mooncake, engine):
    """Overflowing, negative, zero-size and out-of-range descriptors: BadInput naming the descriptor from
    prepare on both sides, before any library call moves a byte."""
    fake_mooncake()
    res = _hostile_results(engine)
    assert res and all(v.startswith("BadInput: descriptor ") for v in res.values()), \
        {k: v for k, v in res.items() if not v.startswith("BadInput: descriptor ")}
    moves = [c for c in fake_engines.calls if c[1] in ("make_prepped_xfer", "initialize_xfer", "transfer")]
    assert not moves, moves
