"""The ``amd-mori`` (MoRI-IO) and ``mooncake-rdma`` engines on the CPU, against fakes of their libraries.

MoRI-IO runs over tests/fake_mori.py (its Python API, moving bytes with memmove) on the host
emulation's pools: every byte of every request is checked after each burst (the pair runner of
_nixl_engines.py), every call is checked against the API, and the failure paths (a failed status,
a stuck one, a session that does not open, a missing library) end in typed errors. GPU tests
(marked ``gpu``) need a ROCm machine with MoRI-IO installed.
"""
from __future__ import annotations

import os
import types

import numpy as np
import pytest

import fake_mori
from gpuxfer.errors import BackendUnavailable, BadInput, DriverError, TransferTimeout
from gpuxfer.bench.kv import collectivex as CX
from gpuxfer.bench.kv.engines import mooncake as me
from gpuxfer.bench.kv.engines import mori as mo
from _nixl_engines import run_engine_pair


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setenv(mo.MODULE_ENV, "fake_mori")
    monkeypatch.delenv(mo.BACKEND_ENV, raising=False)
    mo._found.clear()
    fake_mori.reset()
    yield fake_mori
    mo._found.clear()
    fake_mori.reset()


def test_offsets_translation_and_wr_split():
    d = np.array([[0, 4096, 2304], [8192, 0, 5000]], np.int64)
    loc, rem, size = mo.to_mori_offsets(d, "READ")            # pull: issued by the destination
    assert loc.tolist() == [4096, 0] and rem.tolist() == [0, 8192] and size.tolist() == [2304, 5000]
    loc, rem, size = mo.to_mori_offsets(d, "WRITE")           # push: issued by the source
    assert loc.tolist() == [0, 8192] and rem.tolist() == [4096, 0]
    loc, rem, size = mo.to_mori_offsets(d, "WRITE", wr_cap=2048)
    assert size.tolist() == [2048, 256, 2048, 2048, 904] and loc.tolist() == [0, 2048, 8192, 10240, 12288]
    assert rem.tolist() == [4096, 6144, 0, 2048, 4096]
    b = mo.mori_batch(np.array([[i * 8, i * 8, 8] for i in range(10)], np.int64), "READ", cap=4)
    assert [len(c[2]) for c in b.chunks] == [4, 4, 2] and b.nbytes == 80
    assert all(isinstance(x, int) for c in b.chunks for part in c for x in part)
    assert mo.WR_CAP_BYTES == CX.MORI_BULK_WR_CAP == 1 << 30 and mo.BATCH_CAP == CX.MORI_BATCH_CAP == 16384


@pytest.mark.parametrize("bad, match", [
    (np.zeros((2, 2), np.int64), r"shape \(N, 3\)"), (np.zeros((1, 3), np.float32), "integers"),
    (np.array([[0, 0, 0]], np.int64), "moves 0 bytes"), (np.array([[-8, 0, 8]], np.int64), r"source range \[-8, 0\)"),
])
def test_offsets_reject_bad_tables(bad, match):
    with pytest.raises(BadInput, match=match):
        mo.to_mori_offsets(bad, "READ")
    with pytest.raises(BadInput, match="op"):
        mo.to_mori_offsets(np.zeros((0, 3), np.int64), "GET")


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_mori_engine_moves_and_verifies_every_byte(fake, monkeypatch, direction):
    monkeypatch.setattr(mo, "BATCH_CAP", 16)                  # several batch calls per request
    run_engine_pair("amd-mori", direction, bursts=2)         # checks every byte after each of 6 bursts
    kinds = [c[0] for c in fake.calls]
    want = "batch_read" if direction == "pull" else "batch_write"
    moves = [c for c in fake.calls if c[0].startswith("batch_")]
    assert {c[0] for c in moves} == {want}
    assert max(c[1] for c in moves) == 16 and sum(c[1] for c in moves) == 2 * 3 * 3 * 40
    assert len({c[2] for c in moves}) == len(moves)           # a fresh transfer uid per call
    (rdma, *_), seen = [c[2] for c in fake.calls if c[0] == "create_backend"], \
        {c[1] for c in fake.calls if c[0] == "create_backend"}
    assert seen == {"RDMA"} and kinds.count("create_backend") == 2
    suite = dict(CX.MORI_RDMA_CONFIG, poll_cq_mode=fake.PollCqMode.POLLING)
    assert {k: rdma[k] for k in suite} == suite                 # the suite's RDMA settings
    assert {c[2] for c in fake.calls if c[0] == "register_memory"} == {"CPU"}   # host emulation pools
    assert kinds.count("deregister_memory") == kinds.count("register_memory") == 2
    assert kinds.count("deregister_remote_engine") == kinds.count("register_remote_engine") == 2


def test_mori_xgmi_backend_and_bad_choice(fake, monkeypatch):
    monkeypatch.setenv(mo.BACKEND_ENV, "xgmi")
    run_engine_pair("amd-mori", "pull", bursts=1)
    assert {c[1] for c in fake.calls if c[0] == "create_backend"} == {"XGMI"}
    assert "one host only" in mo.MoriEngine.cross_host_reason()
    monkeypatch.setenv(mo.BACKEND_ENV, "infiniband")
    with pytest.raises(BackendUnavailable, match="GPUXFER_MORI_BACKEND must be rdma or xgmi, got 'infiniband'"):
        run_engine_pair("amd-mori", "pull", bursts=0)
    assert "GPUXFER_MORI_BACKEND" in mo.MoriEngine.cross_host_reason()
    monkeypatch.setenv(mo.BACKEND_ENV, "rdma")
    assert mo.MoriEngine.cross_host_reason() is None


def test_mori_failed_status_is_a_driver_error(fake):
    fake.behaviour["fail"] = True
    with pytest.raises(DriverError, match="ERR_RDMA_OP.*EINVAL"):
        run_engine_pair("amd-mori", "push", bursts=1)
    kinds = [c[0] for c in fake.calls]
    assert kinds.count("deregister_memory") == 2               # closed cleanly all the same


def test_mori_stuck_status_times_out(fake):
    fake.behaviour["stuck"] = True
    with pytest.raises(TransferTimeout, match="amd-mori READ"):
        run_engine_pair("amd-mori", "pull", bursts=1, timeout_s=0.3)


def test_mori_wrong_byte_is_seen_by_the_pair_check(fake):
    fake.behaviour["flip"] = True
    with pytest.raises(AssertionError):
        run_engine_pair("amd-mori", "pull", bursts=1)


def test_mori_session_failure_fails_both_sides(fake):
    fake.behaviour["fail_session"] = True
    with pytest.raises(BackendUnavailable) as ei:
        run_engine_pair("amd-mori", "pull", bursts=0)
    assert "rank 0" in str(ei.value) and "rank 1" in str(ei.value) and "create_session" in str(ei.value)
    kinds = [c[0] for c in fake.calls]
    assert kinds.count("deregister_memory") == 2


def test_mori_unavailable_reasons(monkeypatch):
    mo._found.clear()
    monkeypatch.setenv(mo.MODULE_ENV, "no_such_mori_module_xyz")
    try:
        host = types.SimpleNamespace(name="host", memory_runtime="host", host_memory=True)
        assert "MoRI-IO is not installed" in mo.MoriEngine.unavailable_reason(host)
        assert "AMD's engine" in mo.MoriEngine.unavailable_reason(types.SimpleNamespace(name="cuda", memory_runtime="cuda"))
        monkeypatch.setenv(mo.MODULE_ENV, "os")                 # importable, but not MoRI-IO's API
        mo._found.clear()
        assert "lacks IOEngine" in mo.MoriEngine.unavailable_reason(host)
        monkeypatch.delenv(mo.MODULE_ENV)
        mo._found.clear()
        import importlib.util
        if importlib.util.find_spec("mori") is None:
            assert "pip install amd_mori" in mo.mori_unavailable_reason()
    finally:
        mo._found.clear()


def test_doctor_lists_amd_mori_with_its_reason(monkeypatch):
    from gpuxfer.bench.kv.engines import engine_report
    from gpuxfer.platforms.host import HostPlatform
    monkeypatch.setenv(mo.MODULE_ENV, "no_such_mori_module_xyz")
    mo._found.clear()
    try:
        with HostPlatform() as host:
            rep = engine_report(host)
        assert "MoRI-IO is not installed" in rep["amd-mori"]
        assert "registers GPU memory" in rep["mooncake-rdma"]
    finally:
        mo._found.clear()


# --------------------------------------------------------------------------- mooncake-rdma


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_mooncake_rdma_engine_over_fake(fake_mooncake, monkeypatch, direction):  # noqa: F811
    fake = fake_mooncake()
    for k in CX.MOONCAKE_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv(me.NIC_ENV, "rdma{gpu}")
    probes = []
    monkeypatch.setattr(me, "probe_transport", lambda protocol, device=0, nic=None, timeout_s=60.0:
                        probes.append((protocol, nic, dict((k, os.environ.get(k)) for k in CX.MOONCAKE_ENV))))
    run_engine_pair("mooncake-rdma", direction, bursts=2)
    inits = [c for c in fake.calls if c[0] == "initialize"]
    assert {(c[1], c[2]) for c in inits} == {("P2PHANDSHAKE", "rdma")}
    assert {c[3] for c in inits} == {"rdma0", "rdma1"}               # {gpu}: each side's device
    # the suite's settings are in force before the transport is probed and started
    assert {p[0] for p in probes} == {"rdma"}
    assert all(p[2] == {"MC_USE_NVLINK_IPC": "0", "MC_TRANSFER_TIMEOUT": "120"} for p in probes)
    moves = [c for c in fake.calls if c[0] in ("read", "write")]
    assert {c[0] for c in moves} == {"read" if direction == "pull" else "write"}
    assert me.MooncakeRdmaEngine.cross_host_reason() is None


def test_mooncake_rdma_keeps_an_operators_settings(fake_mooncake, monkeypatch):  # noqa: F811
    fake_mooncake()
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "300")
    monkeypatch.delenv("MC_USE_NVLINK_IPC", raising=False)
    monkeypatch.setattr(me, "probe_transport", lambda *a, **k: None)
    assert me.apply_suite_env() == {"MC_USE_NVLINK_IPC": "0", "MC_TRANSFER_TIMEOUT": "300"}
    monkeypatch.setattr(me, "probe_transport", lambda *a, **k: "no rdma device found")
    with pytest.raises(BackendUnavailable, match="no rdma device"):
        run_engine_pair("mooncake-rdma", "pull", bursts=0)


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["pull", "push"])
def test_mori_engine_two_rocm_gpus(direction):
    from gpuxfer.platforms import unavailable_reason
    why = unavailable_reason("rocm") or mo.mori_unavailable_reason()
    if why:
        pytest.skip(why)
    from gpuxfer.cli import main
    import tempfile
    with tempfile.TemporaryDirectory() as out:
        rc = main(["bench", "kv", "--platform", "rocm", "--engine", "amd-mori", "--isl", "8k", "--batch", "1,2",
                   "--direction", direction, "--out", out])
    assert rc == 0


def test_hostile_descriptors_are_refused_by_amd_mori(fake):
    """Overflowing, negative, zero-size and out-of-range descriptors: BadInput naming the descriptor from
    prepare on both sides (the engines' one bounds check)."""
    from _nixl_engines import hostile_results
    res = hostile_results("amd-mori")
    assert res and all(v.startswith("BadInput: descriptor ") for v in res.values()), \
        {k: v for k, v in res.items() if not v.startswith("BadInput: descriptor ")}
