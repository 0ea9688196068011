"""The HSA (ROCr) ctypes layer against the fake ROCr of tests/fake_hsa.py, and its pure helpers.

No AMD GPU or ROCm is needed: this checks the ctypes prototypes are called with
arguments of the declared types, that every status is checked, and that the
semantics the sdma backend relies on hold in the model (dependencies read at
queue time, completion decrements, waits time out).
"""
from __future__ import annotations

import ctypes
import time

import pytest

from fake_hsa import FakeHsaLib
from gpuxfer.errors import BadInput, DriverError, TransferTimeout
from gpuxfer.platforms import hsa as H
from gpuxfer.platforms.hsa import Hsa, Signal, choose_engine, sdma_engine


@pytest.fixture
def lib():
    return FakeHsaLib(gpus=2)


@pytest.fixture
def hsa(lib):
    h = Hsa(lib=lib).init()
    yield h
    h.close()


def _buf(n, fill=0):
    b = (ctypes.c_uint8 * n)(*([fill] * n))
    return b, ctypes.addressof(b)


def _gpus(hsa):
    g = [a for a in hsa.agents() if a.is_gpu]
    return g[0].handle, g[1].handle


# --------------------------------------------------------------------------- loading and checking


def test_import_loads_nothing_and_missing_library_is_a_driver_error():
    h = Hsa(path="/nonexistent/libhsa-runtime64.so.1")      # nothing happens until first use
    with pytest.raises(DriverError) as ei:
        h.init()
    assert ei.value.api == "dlopen" and ei.value.status_name == "LIBRARY_NOT_FOUND"
    assert "/nonexistent/libhsa-runtime64.so.1" in str(ei.value)


def test_library_candidates_start_with_the_soname(monkeypatch):
    monkeypatch.setenv("ROCM_PATH", "/opt/rocm-x")
    monkeypatch.delenv("GPUXFER_HSA_LIBRARY", raising=False)
    c = H.library_candidates()
    assert c[0] == "libhsa-runtime64.so.1" and "/opt/rocm-x/lib/libhsa-runtime64.so.1" in c


def test_every_function_has_a_prototype_and_the_fake_implements_it(lib):
    for f in H.FUNCTIONS:
        assert f.restype is None or f.restype is not None   # declared (void functions: None)
        assert isinstance(f.argtypes, tuple)
        assert callable(getattr(lib, f.name)), f.name


def test_error_status_is_named_with_what_was_done(lib, hsa):
    d0, d1 = _gpus(hsa)
    lib.fail["hsa_amd_memory_copy_engine_status"] = H.HSA_STATUS_ERROR_INVALID_ARGUMENT
    with pytest.raises(DriverError) as ei:
        hsa.copy_engine_status(d1, d0)
    e = ei.value
    assert e.api == "hsa_amd_memory_copy_engine_status"
    assert e.status == 0x1001 and e.status_name == "HSA_STATUS_ERROR_INVALID_ARGUMENT"
    assert "engines available" in e.doing and "fake status string" in str(e)


def test_unknown_status_still_gets_a_name(hsa):
    assert hsa.status_name(0x1234) == "HSA_STATUS_0x1234"
    assert hsa.status_name(0x1006) == "HSA_STATUS_ERROR_INVALID_SIGNAL"


def test_out_of_resources_engine_status_means_no_engine_free(lib, hsa):
    d0, d1 = _gpus(hsa)
    lib.fail["hsa_amd_memory_copy_engine_status"] = H.HSA_STATUS_ERROR_OUT_OF_RESOURCES
    assert hsa.copy_engine_status(d1, d0) == 0


def test_arguments_are_type_checked_like_a_foreign_call(hsa):
    with pytest.raises(DriverError) as ei:
        hsa.call("hsa_signal_destroy", 1234, doing="passing an int where hsa_signal_t is declared")
    assert ei.value.status_name == "BAD_ARGUMENT_TYPE"


def test_missing_optional_symbol_is_none_and_required_one_fails():
    lib = FakeHsaLib(missing=("hsa_amd_memory_get_preferred_copy_engine",))
    with Hsa(lib=lib) as h:
        d0, d1 = _gpus(h)
        assert h.preferred_copy_engine(d1, d0) is None          # ROCr older than hsa_ext_amd 1.8
    lib = FakeHsaLib(missing=("hsa_amd_memory_async_copy_on_engine",))
    with pytest.raises(DriverError) as ei:
        Hsa(lib=lib).init()
    assert ei.value.status_name == "SYMBOL_NOT_FOUND" and "hsa_amd_memory_async_copy_on_engine" in str(ei.value)


def test_init_and_close_are_balanced_and_close_is_idempotent(lib):
    h = Hsa(lib=lib).init()
    h.init()
    assert lib.init_count == 2
    h.close()
    h.close()
    assert lib.init_count == 0
    with pytest.raises(BadInput):
        h.init()


# --------------------------------------------------------------------------- agents and pointers


def test_agents_and_pci_matching(hsa):
    agents = hsa.agents()
    gpus = [a for a in agents if a.is_gpu]
    assert len(gpus) == 2 and any(not a.is_gpu for a in agents)
    assert gpus[0].name == "gfx950" and gpus[0].num_sdma == 2 and gpus[0].num_sdma_xgmi == 14
    assert gpus[1].pci_bus_id == "0000:c2:00.0"
    assert hsa.gpu_agent_by_pci("0000:C2:00.0").handle == gpus[1].handle   # HIP may print upper case
    with pytest.raises(DriverError) as ei:
        hsa.gpu_agent_by_pci("0000:99:00.0")
    assert "ROCR_VISIBLE_DEVICES" in str(ei.value)


def test_parse_pci_bus_id():
    assert H.parse_pci_bus_id("0001:c1:02.3") == (1, 0xC1 << 8 | 2 << 3 | 3)
    with pytest.raises(BadInput):
        H.parse_pci_bus_id("c1:00")


def test_pointer_info_names_the_owner(lib, hsa):
    d0, d1 = _gpus(hsa)
    b, p = _buf(64)
    lib.register_memory(p, 64, d1, H.HSA_EXT_POINTER_TYPE_IPC)
    info = hsa.pointer_info(p + 10)
    assert info.type == H.HSA_EXT_POINTER_TYPE_IPC and info.agent_owner == d1 and info.size == 64
    assert hsa.pointer_info(12345).type == H.HSA_EXT_POINTER_TYPE_UNKNOWN


# --------------------------------------------------------------------------- signals and copies


def test_signal_value_lives_at_handle_plus_8(lib, hsa):
    s = hsa.signal_create(5)
    assert hsa.signal_value_pointer(s) == s.handle + 8
    ctypes.c_int64.from_address(s.handle + 8).value = 3   # what a HIP stream write to the word does
    assert hsa.signal_load(s) == 3
    hsa.signal_store(s, 0)
    assert lib.signal_value(s.handle) == 0
    hsa.signal_destroy(s)


def test_dependency_is_read_when_the_copy_is_queued(lib, hsa):
    d0, d1 = _gpus(hsa)
    (src, ps), (dst, pd) = _buf(32, 7), _buf(32)
    dep, done = hsa.signal_create(1), hsa.signal_create(1)
    hsa.copy_on_engine(pd, d1, ps, d0, 32, [dep], done, sdma_engine(2))
    assert lib.pump() == 0 and bytes(dst) == bytes(32)       # non-zero at queue time: the engine polls
    hsa.signal_store(dep, 0)
    assert lib.pump() == 1 and bytes(dst) == bytes([7] * 32)
    assert hsa.signal_load(done) == 0                         # completion decrements 1 -> 0

    # a dependency that is 0 when queued adds nothing, even if it is set non-zero afterwards
    (dst2, pd2) = _buf(32)
    dep2, done2 = hsa.signal_create(0), hsa.signal_create(1)
    hsa.copy_on_engine(pd2, d1, ps, d0, 32, [dep2], done2, sdma_engine(2))
    hsa.signal_store(dep2, 1)                                # too late: the copy does not wait for it
    assert lib.pump() == 1 and bytes(dst2) == bytes([7] * 32)
    copies = lib.calls_named("copy")
    assert copies[0][7] == (1,) and copies[1][7] == (0,)      # the dependency values seen at queue time


def test_a_poll_blocks_the_rest_of_its_engine_but_not_other_engines(lib, hsa):
    d0, d1 = _gpus(hsa)
    (src, ps) = _buf(8, 1)
    bufs = [_buf(8) for _ in range(3)]
    dep = hsa.signal_create(1)
    done = [hsa.signal_create(1) for _ in range(3)]
    hsa.copy_on_engine(bufs[0][1], d1, ps, d0, 8, [dep], done[0], sdma_engine(2))
    hsa.copy_on_engine(bufs[1][1], d1, ps, d0, 8, [], done[1], sdma_engine(2))   # behind the poll
    hsa.copy_on_engine(bufs[2][1], d1, ps, d0, 8, [], done[2], sdma_engine(3))   # another engine
    lib.pump()
    assert [hsa.signal_load(s) for s in done] == [1, 1, 0]
    hsa.signal_store(dep, 0)
    lib.pump()
    assert [hsa.signal_load(s) for s in done] == [0, 0, 0]


def test_packets_without_dependencies_may_overlap(lib, hsa):
    """Queue order is no order: the fake runs a run of runnable packets last-first."""
    d0, d1 = _gpus(hsa)
    (data_src, pds), (data_dst, pdd) = _buf(64, 9), _buf(64)
    (flag_src, pfs), (flag_dst, pfd) = _buf(8, 1), _buf(8)
    a, b = hsa.signal_create(1), hsa.signal_create(1)
    hsa.copy_on_engine(pdd, d1, pds, d0, 64, [], a, sdma_engine(2))
    hsa.copy_on_engine(pfd, d1, pfs, d0, 8, [], b, sdma_engine(2))        # no dependency on the data
    lib.pump()
    ids = [p.id for p in lib.executed]
    assert ids == sorted(ids, reverse=True)                               # the flag landed first
    # with the data copy's completion as a dependency, the flag waits for the data
    lib.executed.clear()
    a2, b2 = hsa.signal_create(1), hsa.signal_create(1)
    hsa.copy_on_engine(pdd, d1, pds, d0, 64, [], a2, sdma_engine(2))
    hsa.copy_on_engine(pfd, d1, pfs, d0, 8, [a2], b2, sdma_engine(2))
    lib.pump()
    ids = [p.id for p in lib.executed]
    assert ids == sorted(ids)


def test_shared_completion_loses_decrements_without_pcie_atomics():
    """Why the sdma backend gives every copy its own completion signal unless 64-bit PCIe atomics are known."""
    for atomic, final in ((True, 0), (False, 1)):
        lib = FakeHsaLib(atomic_completion=atomic)
        with Hsa(lib=lib) as h:
            d0, d1 = _gpus(h)
            (src, ps), (dst, pd) = _buf(16, 3), _buf(16)
            shared = h.signal_create(2)
            h.copy_on_engine(pd, d1, ps, d0, 8, [], shared, sdma_engine(2))
            h.copy_on_engine(pd + 8, d1, ps + 8, d0, 8, [], shared, sdma_engine(3))
            lib.pump()
            assert h.signal_load(shared) == final


def test_engine_rules_enforced(lib, hsa):
    d0, d1 = _gpus(hsa)
    (src, ps), (dst, pd) = _buf(8), _buf(8)
    done = hsa.signal_create(1)
    with pytest.raises(BadInput):
        hsa.copy_on_engine(pd, d1, ps, d0, 8, [], done, 0b110)          # not one-hot: refused before ROCr
    with pytest.raises(DriverError) as ei:
        hsa.copy_on_engine(pd, d1, ps, d0, 8, [], done, sdma_engine(1))  # a PCIe engine for an xGMI peer
    assert ei.value.status_name == "HSA_STATUS_ERROR_INVALID_ARGUMENT" and "engine 1" in ei.value.doing
    hsa.copy_on_engine(pd, d0, ps, d0, 8, [], done, sdma_engine(0))      # a local copy may use it


def test_wait_returns_when_done_and_times_out_with_names(lib, hsa):
    d0, d1 = _gpus(hsa)
    (src, ps), (dst, pd) = _buf(8, 5), _buf(8)
    done = hsa.signal_create(1)
    hsa.copy_on_engine(pd, d1, ps, d0, 8, [], done, sdma_engine(4))
    assert hsa.signal_wait_at_most(done, 0, 5.0) == 0                  # the wait lets the engines run
    stuck = hsa.signal_create(1)
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout) as ei:
        hsa.signal_wait_at_most(stuck, 0, 0.3, rank=3, step=7, flag="sdma data[2]", slice_s=0.05)
    assert 0.25 < time.monotonic() - t0 < 60      # the wait ends (a hang guard, not a speed test)
    e = ei.value
    assert (e.rank, e.step, e.flag, e.seen, e.expected) == (3, 7, "sdma data[2]", 1, 0)
    assert "counts down" in str(e)


def test_wait_survives_early_returns(lib, hsa):
    """hsa_signal_wait_scacquire may return before the condition holds; the loop keeps its own deadline."""
    s = hsa.signal_create(1)
    calls = {"n": 0}
    real = lib.hsa_signal_wait_scacquire

    def early(signal, cond, cmp, hint, state):
        calls["n"] += 1
        if calls["n"] == 3:
            lib._set(signal.handle, 0)
        return lib.signal_value(signal.handle)        # returns at once, condition or not

    lib.hsa_signal_wait_scacquire = early
    h = Hsa(lib=lib).init()
    try:
        assert h.signal_wait_at_most(s, 0, 5.0) == 0 and calls["n"] == 3
    finally:
        lib.hsa_signal_wait_scacquire = real
        h.close()


def test_completion_signal_and_dependency_handles_must_exist(lib, hsa):
    d0, d1 = _gpus(hsa)
    (src, ps), (dst, pd) = _buf(8), _buf(8)
    with pytest.raises(DriverError) as ei:
        hsa.copy_on_engine(pd, d1, ps, d0, 8, [Signal(0xDEAD0)], hsa.signal_create(1), sdma_engine(2))
    assert ei.value.status_name == "HSA_STATUS_ERROR_INVALID_SIGNAL"


# --------------------------------------------------------------------------- engine choice and topology


@pytest.mark.parametrize("available, preferred, expect", [
    (0xFFFC, 0x14, 1 << 2),          # the lowest recommended engine that is free
    (0xFFF8, 0x14, 1 << 4),          # engine 2 busy: the other recommended one
    (0xFF00, 0x14, 1 << 2),          # none free now: still the recommendation (busy is not invalid)
    (0xFFFF, 0, 1 << 2),             # no recommendation: lowest xGMI engine (0/1 are PCIe)
    (0xFFFF, None, 1 << 2),          # ROCr cannot say: same
    (0x4000, 0, 1 << 14),
])
def test_choose_engine(available, preferred, expect):
    eng, why = choose_engine(available, preferred)
    assert eng == expect and why


def test_choose_engine_refuses_when_nothing_can_carry_the_copy():
    with pytest.raises(BadInput) as ei:
        choose_engine(0b11, 0)
    assert "PCIe engines" in str(ei.value)
    assert choose_engine(0b11, 0, xgmi_peer=False)[0] == 1


def _write_node(root, node, props, links=()):
    d = root / str(node)
    (d / "io_links").mkdir(parents=True)
    (d / "properties").write_text("".join(f"{k} {v}\n" for k, v in props.items()))
    for i, link in enumerate(links):
        (d / "io_links" / str(i)).mkdir()
        (d / "io_links" / str(i) / "properties").write_text("".join(f"{k} {v}\n" for k, v in link.items()))


def test_kfd_topology_recommended_mask_and_atomics(tmp_path):
    _write_node(tmp_path, 0, {"cpu_cores_count": 64, "simd_count": 0})
    _write_node(tmp_path, 2, {"cpu_cores_count": 0, "simd_count": 1024},
                [{"type": 2, "node_from": 2, "node_to": 0, "flags": 0x1},
                 {"type": 11, "node_from": 2, "node_to": 3, "flags": 0x3, "recommended_sdma_engine_id_mask": 0x14}])
    _write_node(tmp_path, 3, {"cpu_cores_count": 0, "simd_count": 1024},
                [{"type": 2, "node_from": 3, "node_to": 0, "flags": 0x1 | H.CRAT_IOLINK_FLAGS_NO_ATOMICS_64_BIT}])
    assert H.kfd_recommended_mask(2, 3, tmp_path) == 0x14
    assert H.kfd_recommended_mask(3, 2, tmp_path) is None
    assert H.kfd_pcie_atomics_64(2, tmp_path) is True
    assert H.kfd_pcie_atomics_64(3, tmp_path) is False
    assert H.kfd_pcie_atomics_64(9, tmp_path) is None
