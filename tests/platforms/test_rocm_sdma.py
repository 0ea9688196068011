"""The ``sdma`` stage hand-off against the fake ROCr (tests/fake_hsa.py) on the host emulation.

What is checked without an AMD GPU: bytes arrive intact; what the sender queues
for each step of the ring, in which order and with which dependencies (the
dependency armed before the stream opens it and before the copies are queued;
flag copies depending on the data copies' completion signals; the ring entry
reused only after its previous step completed); one completion signal per
copy unless 64-bit PCIe atomics are known; the engine comes from the driver's
recommendation; the ``hip`` path; local reasons; and the collective selection
(one rank lacking ROCr: ``sdma`` forced raises on every rank; ``auto`` keeps
NCCL on ROCm).
"""
from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch

from fake_hsa import FakeHsaLib, FakeRocmPlatform
from gpuxfer import config
from gpuxfer.errors import BadInput, GpuxferError
from gpuxfer.platforms.host import HostPlatform
from gpuxfer.pp import sdma as S
from gpuxfer.pp.copy_engine import CopyEngineTransport
from gpuxfer.pp.sdma import SdmaTransport
from gpuxfer.pp.spec import SpecTable

G0, G1 = 0x1000, 0x1100          # the fake's GPU agent handles


def _specs(n=4096):
    return SpecTable({"h": ((n,), torch.float32), "r": ((3, 5), torch.bfloat16)})


def _pair(*, lib=None, ring=3, recv_slots=2, copies=1, path="hsa", pcie_atomics=None, specs=None,
          flag_path="copy", preferred=0x10):
    """Both ends of a pair in this process, set up through the same phases as selection.connect."""
    lib = lib or FakeHsaLib(gpus=2, preferred={(G1, G0): preferred})
    lib.start()
    plat = FakeRocmPlatform(lib, allow_self_open=True, pcie_atomics=pcie_atomics)
    specs = specs or _specs()
    common = dict(platform=plat, specs=specs, timeout_s=20.0, metadata=False, group=None, tag_base=0,
                  torch_device=torch.device("cpu"), recv_slots=recv_slots, flag_path=flag_path,
                  ring=ring, copies=copies, sdma_path=path)
    snd = SdmaTransport(role="send", rank=0, peer=1, device=0, **common)
    rcv = SdmaTransport(role="recv", rank=1, peer=0, device=1, **common)
    ps, pr = snd.setup_prepare(), rcv.setup_prepare()
    snd.setup_open(pr)
    rcv.setup_open(ps)
    a, b = snd.setup_probe_send(1 << 8), rcv.setup_probe_send(1 << 8)
    ca, cb = snd.setup_probe_check(b), rcv.setup_probe_check(a)
    snd.setup_finish(cb)
    rcv.setup_finish(ca)
    return lib, plat, snd, rcv


def _teardown(lib, plat, *ends):
    try:
        for t in ends:
            assert t._drain(10.0)
        for t in ends:
            t._close_mappings()
        for t in ends:
            t._free()
            t._state = "closed"
    finally:
        lib.stop()
        plat.close()


def _step(k, n):
    g = torch.Generator().manual_seed(k)
    return {"h": torch.randn(n, generator=g), "r": torch.randn(3, 5, generator=g).to(torch.bfloat16)}


def _check(got, sent):
    assert set(got) == set(sent)
    for name in sent:
        assert torch.equal(got[name], sent[name]), name


def _shapes(t):
    return {n: tuple(v.shape) for n, v in t.items()}


def _no_exec(calls):
    return [c for c in calls if c[0] != "exec"]


def _step_copies(lib):
    """The three copies of each step (the warm-up copies have no dependencies)."""
    copies = [c for c in lib.calls if c[0] == "copy" and c[6]]
    assert len(copies) % 3 == 0
    return [copies[i:i + 3] for i in range(0, len(copies), 3)]


# --------------------------------------------------------------------------- the protocol on the fake


def test_bytes_arrive_and_each_step_queues_armed_dependent_copies():
    lib, plat, snd, rcv = _pair(ring=3)
    sizes = [4096, 1, 777, 0, 2048, 5, 4096, 300]
    try:
        for k, n in enumerate(sizes, 1):
            t = _step(k, n)
            snd.send(t)
            _check(rcv.recv(shapes=_shapes(t)).tensors, t)
        assert snd.step == rcv.step == len(sizes)
        entries, side_name, recv_name = list(snd._entries), snd._aux.name, rcv._eager_stream.name
    finally:
        _teardown(lib, plat, snd, rcv)

    calls, steps = _no_exec(lib.calls), _step_copies(lib)
    assert len(steps) == len(sizes)
    exec_at = {c[1]: n for n, c in enumerate(lib.calls) if c[0] == "exec"}
    pos = {id(c): n for n, c in enumerate(lib.calls)}
    for k, (data, full, sent) in enumerate(steps, 1):
        i, j, s = k % 3, (k - 1) % 2, k & 1
        e = entries[i]
        nbytes = snd.specs.layout((((sizes[k - 1],)), (3, 5))).total
        # the data copy: staging slot s -> the receiver's slot j, on the recommended engine (0x10 -> 4),
        # depending only on the ring entry's open signal
        assert data[2] == 4 and data[3] == snd._peer_slot_ptr[j] and data[4] == snd._staging_ptr[s]
        assert data[5] == nbytes and data[6] == (e.open.handle,) and data[8] == e.data[0].handle and data[9]
        # both flag copies: from stage[i], after the open signal AND the data copy's completion
        deps = (e.open.handle, e.data[0].handle)
        assert full[3] == snd._peer_in_ptr[j] and full[4] == snd._stage[i] and full[5] == 8
        assert full[6] == deps and full[8] == e.full.handle and full[2] == 4
        assert sent[3] == snd._sent[s] and sent[4] == snd._stage[i] and sent[6] == deps and sent[8] == e.sent.handle
        # executed in dependency order although the fake runs independent packets last-first
        assert exec_at[data[1]] < exec_at[full[1]] and exec_at[data[1]] < exec_at[sent[1]]
        # what the host did just before queueing them: arm, then the side stream's work, ending with the opening
        n = calls.index(data)
        side = side_name
        tail = calls[n - 7:n] if k <= 2 else calls[n - 8:n]
        assert tail[:4] == [("store", e.data[0].handle, 1), ("store", e.full.handle, 1),
                            ("store", e.sent.handle, 1), ("store", e.open.handle, 1)]
        assert tail[4] == ("stream wait event", side)
        if k > 2:       # k > recv_slots: wait for the receiver to free slot j
            assert tail[5] == ("stream wait", side, snd._in_ptr[j], k - 2)
        assert calls[n - 2:n] == [("stream write", side, snd._stage[i], k), ("stream write", side, e.open_mem.ptr, 0)]
        # a reused ring entry is re-armed only after all of its previous step's copies completed
        if k > 3:
            first_store = pos[id(next(c for c in lib.calls[pos[id(steps[k - 4][2])]:]
                                     if c == ("store", e.data[0].handle, 1)))]
            for prev in steps[k - 4]:
                assert exec_at[prev[1]] < first_store
    # the receiver's copy-outs and `empty` flags are stream-ordered SDMA copies (hipMemcpyDeviceToDeviceNoCU)
    on_recv = [c for c in calls if c[0] == "stream copy" and c[1] == recv_name]
    assert all(c[5] is True for c in on_recv)
    totals = [snd.specs.layout(((n,), (3, 5))).total for n in sizes]
    assert [c[4] for c in on_recv if c[4] != 8] == [t for t in totals if t != 8]
    assert len([c for c in on_recv if c[4] == 8]) >= len(sizes)


def test_an_armed_dependency_holds_the_copy_until_the_receiver_frees_the_slot():
    lib, plat, snd, rcv = _pair(ring=4)
    try:
        sent = [_step(k, 1000) for k in (1, 2, 3)]
        for t in sent:
            snd.send(t)                               # nothing received yet: step 3 must wait for slot 0
        data3 = _step_copies(lib)[2][0]
        assert data3[7] == (1,)                       # its dependency was armed (1) when it was queued
        time.sleep(0.2)
        assert data3[1] not in {p.id for p in lib.executed}
        r1 = rcv.recv(shapes=_shapes(sent[0]))
        _check(r1.tensors, sent[0])                   # step 1's bytes were not overwritten by step 3
        _check(rcv.recv(shapes=_shapes(sent[1])).tensors, sent[1])
        _check(rcv.recv(shapes=_shapes(sent[2])).tensors, sent[2])
        assert data3[1] in {p.id for p in lib.executed}
    finally:
        _teardown(lib, plat, snd, rcv)


@pytest.mark.parametrize("atomics", [None, False, True])
def test_completion_signals_per_copy_unless_pcie_atomics_are_known(atomics):
    # without known atomics, the fake's completions are fences (they lose shared decrements)
    lib = FakeHsaLib(gpus=2, preferred={(G1, G0): 0x14}, atomic_completion=bool(atomics))
    lib, plat, snd, rcv = _pair(lib=lib, ring=2, copies=3, pcie_atomics=atomics)
    try:
        for k in (1, 2, 3):
            t = _step(k, 4096)
            snd.send(t)
            _check(rcv.recv(shapes=_shapes(t)).tensors, t)
        e = snd._entries[1]
    finally:
        _teardown(lib, plat, snd, rcv)
    assert snd.shared_completion is bool(atomics)
    copies = [c for c in lib.calls if c[0] == "copy" and c[6]]
    step1 = copies[:5]                                 # 3 data copies + 2 flag copies
    data, flags = step1[:3], step1[3:]
    assert [c[2] for c in data] == [2, 4, 2]           # rotating over the recommended engines (0x14)
    assert sum(c[5] for c in data) == snd.specs.layout(((4096,), (3, 5))).total
    completions = [c[8] for c in data]
    if atomics:
        assert len(set(completions)) == 1 and ("store", completions[0], 3) in lib.calls
        assert flags[0][6] == (e.open.handle, completions[0])
    else:
        assert len(set(completions)) == 3
        assert flags[0][6] == (e.open.handle, *completions) == flags[1][6]


def test_hip_path_is_the_parent_protocol_with_sdma_copies():
    lib, plat, snd, rcv = _pair(path="hip")
    side_name = snd._aux.name
    try:
        for k, n in enumerate((10, 4096, 3), 1):
            t = _step(k, n)
            snd.send(t)
            _check(rcv.recv(shapes=_shapes(t)).tensors, t)
    finally:
        _teardown(lib, plat, snd, rcv)
    assert not [c for c in lib.calls if c[0] == "copy"]          # no HSA copy at all
    side = [c for c in lib.calls if c[0] == "stream copy" and c[1] == side_name]
    data = [c for c in side if c[4] > 8]
    assert len(data) == 3 and all(c[5] is True for c in side)       # hipMemcpyDeviceToDeviceNoCU


def test_setup_fails_cleanly_when_rocr_does_not_know_the_peer_buffer():
    lib = FakeHsaLib(gpus=2)
    lib.register_memory = lambda *a, **k: None                       # pointer_info answers UNKNOWN
    with pytest.raises(GpuxferError, match="ROCr does not know"):
        _pair(lib=lib)
    lib.stop()


def test_engine_plan_falls_back_to_kfd_sysfs(tmp_path):
    d = tmp_path / "2" / "io_links" / "0"
    d.mkdir(parents=True)
    d.joinpath("properties").write_text("node_from 2\nnode_to 3\nrecommended_sdma_engine_id_mask 4096\n")
    lib = FakeHsaLib(gpus=2, missing=("hsa_amd_memory_get_preferred_copy_engine",))
    from gpuxfer.platforms.hsa import Hsa, plan_engines
    with Hsa(lib=lib) as h:
        me, peer = [a for a in h.agents() if a.is_gpu]
        plan = plan_engines(h, me, peer, 1, topology_root=str(tmp_path))
    assert plan.data == (1 << 12,) and "KFD sysfs" in plan.why


# --------------------------------------------------------------------------- local reasons


def test_unavailable_reasons(monkeypatch):
    monkeypatch.delenv("HSA_ENABLE_SDMA", raising=False)
    monkeypatch.delenv("HSA_ENABLE_PEER_SDMA", raising=False)
    monkeypatch.delenv(S.ENV_PATH, raising=False)
    host = HostPlatform()
    ok = FakeRocmPlatform()
    broken = FakeRocmPlatform(hsa_error="libhsa-runtime64.so.1: cannot open shared object file")
    try:
        assert "offers no SDMA engines" in SdmaTransport.unavailable_reason(host)
        assert "the sdma backend" in CopyEngineTransport.unavailable_reason(ok, 0)
        assert host.sdma is None and ok.sdma.unavailable_reason(0, host_queued=True) is None
        assert SdmaTransport.unavailable_reason(ok, 0) is None
        why = SdmaTransport.unavailable_reason(broken, 0)
        assert "hsa path unusable" in why and "libhsa-runtime64" in why
        monkeypatch.setenv(S.ENV_PATH, "hip")
        assert SdmaTransport.unavailable_reason(broken, 0) is None          # the hip path needs no HSA
        monkeypatch.setenv(S.ENV_PATH, "cuda")
        assert "must be hsa or hip" in SdmaTransport.unavailable_reason(ok, 0)
        monkeypatch.delenv(S.ENV_PATH)
        monkeypatch.setenv("HSA_ENABLE_PEER_SDMA", "0")
        assert "blit kernels" in SdmaTransport.unavailable_reason(ok, 0)
    finally:
        for p in (host, ok, broken):
            p.close()


def test_sdma_engines_reason_names_an_unsupported_architecture(monkeypatch):
    plat = FakeRocmPlatform()
    base = plat.device_info
    monkeypatch.setattr(plat, "device_info", lambda d: base(d).__class__(**{**base(d).__dict__, "arch": "gfx90a"}))
    try:
        why = SdmaTransport.unavailable_reason(plat, 0)
        assert "gfx90a" in why and "gfx942/gfx950" in why
    finally:
        plat.close()


def test_settings_are_validated(monkeypatch):
    monkeypatch.setenv(S.ENV_RING, "0")
    with pytest.raises(BadInput, match=S.ENV_RING):
        config.get(S.ENV_RING)
    assert S.sdma_path_from_env("HIP") == "hip"
    assert not S.VALIDATED_ON_HARDWARE


def test_registered_but_not_an_auto_candidate():
    from gpuxfer.pp import selection
    assert selection.BACKENDS["sdma"] == ("gpuxfer.pp.sdma", "SdmaTransport")
    assert "sdma" not in selection.ZERO_SM          # auto keeps NCCL on ROCm until validated on hardware
    assert selection.requested_backend("sdma") == "sdma"


# --------------------------------------------------------------------------- collective selection


def _child(rank: int, rdv: str, lacking_rank: int | None, n_steps: int) -> dict:
    import logging
    import torch.distributed as dist
    from fake_hsa import FakeHsaLib, FakeRocmPlatform
    from gpuxfer.errors import BackendUnavailable
    from gpuxfer.pp.selection import connect
    import gpuxfer.pp.sdma  # noqa: F401 - registers the backend

    logging.basicConfig(level=logging.WARNING)
    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    lib = FakeHsaLib(gpus=2, preferred={(G1, G0): 0x10}).start()
    plat = FakeRocmPlatform(lib, hsa_error="libhsa-runtime64.so.1: cannot open shared object file"
                            if rank == lacking_rank else None)
    out: dict = {}
    peer = dict(send_to=1) if rank == 0 else dict(recv_from=0)
    specs = {"h": ((2048,), torch.float32), "r": ((3, 5), torch.bfloat16)}
    try:
        # 1. sdma forced
        try:
            conn = connect(backend="sdma", platform=plat, device=rank, specs=specs, timeout_s=30, **peer)
        except BackendUnavailable as exc:
            out["forced_error"] = {"backend": exc.backend, "reasons": {int(k): v for k, v in exc.reasons.items()}}
        else:
            out["forced_backend"] = conn.backend
            with conn:
                for k in range(1, n_steps + 1):
                    t = _step(k, [2048, 7, 1500, 0, 64][k % 5])
                    if rank == 0:
                        conn.sender().send(t)
                    else:
                        got = conn.receiver().recv().tensors
                        assert all(torch.equal(got[n], t[n]) for n in t), f"step {k} corrupted"
                conn.synchronize(30)
            out["sdma_copies"] = len(lib.executed)
            out["allocated_after_close"] = conn.allocated_bytes
        # 2. auto: NCCL on ROCm, whatever each rank could do
        with connect(backend="auto", platform=plat, device=rank, specs=specs, timeout_s=30, **peer) as conn:
            out["auto_backend"] = conn.backend
            out["auto_fallback"] = {int(k): v for k, v in conn.fallback_reasons.items()}
            t = _step(99, 2048)
            if rank == 0:
                conn.sender().send(t)
            else:
                got = conn.receiver().recv().tensors
                assert all(torch.equal(got[n], t[n]) for n in t)
            conn.synchronize(30)
        dist.barrier()
    finally:
        lib.stop()
        plat.close()
        dist.destroy_process_group()
    return out


def _run_pair(spawner, tmp_path, lacking_rank, n_steps):
    rdv = str(tmp_path / "rdv")
    kids = [spawner.start(_child, r, rdv, lacking_rank, n_steps, name=f"rank {r}") for r in (0, 1)]
    outs = [k.result(timeout=240) for k in kids]
    for k in kids:
        k.join(30)
    return outs


@pytest.mark.slow      # two spawned ranks; the forced end-to-end selection test runs by default
def test_selection_one_rank_lacking_rocr(spawner, tmp_path):
    outs = _run_pair(spawner, tmp_path, lacking_rank=1, n_steps=0)
    for out in outs:                                  # forced: every rank raises, with rank 1's reason
        err = out["forced_error"]
        assert err["backend"] == "sdma" and set(err["reasons"]) == {1}
        assert "libhsa-runtime64.so.1" in err["reasons"][1] and "hsa path unusable" in err["reasons"][1]
        assert out["auto_backend"] == "nccl"
        assert out["auto_fallback"] and all("rocm" in why for why in out["auto_fallback"].values())


def test_selection_sdma_forced_end_to_end_and_auto_still_nccl(spawner, tmp_path):
    outs = _run_pair(spawner, tmp_path, lacking_rank=None, n_steps=7)
    assert [o["forced_backend"] for o in outs] == ["sdma", "sdma"]
    assert outs[0]["sdma_copies"] >= 7 * 3 and outs[1]["sdma_copies"] == 0   # only the sender queues SDMA
    assert [o["allocated_after_close"] for o in outs] == [0, 0]
    assert [o["auto_backend"] for o in outs] == ["nccl", "nccl"]
