"""The Mooncake engine: descriptor lists and chunks, skip reasons, the engine over a fake
``mooncake.engine.TransferEngine`` (moves and failures), and (marked ``gpu``) two GPUs.
"""
from __future__ import annotations

import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuxfer.errors import BackendUnavailable, BadInput, TransferTimeout
from gpuxfer.bench.kv.engines import mooncake as me

from _nixl_engines import descriptor_tables, run_engine_pair, run_two_processes, two_gpus_reason


# --------------------------------------------------------------------------- Mooncake


@settings(max_examples=40, deadline=None)
@given(desc=descriptor_tables(), op=st.sampled_from(["READ", "WRITE"]),
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
    run_engine_pair("mooncake", direction, bursts=2)
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
        run_engine_pair("mooncake", "pull", bursts=0)
    fake_mooncake(fail_rc=-5)
    with pytest.raises(Exception, match="rc"):
        run_engine_pair("mooncake", "pull", bursts=1)
    fake_mooncake(stuck=True)
    with pytest.raises(TransferTimeout, match="mooncake"):
        run_engine_pair("mooncake", "push", bursts=1, timeout_s=0.3)
    monkeypatch.setattr(me, "probe_nvlink_intra", lambda device, timeout_s=60.0: "no nvlink_intra in this build")
    with pytest.raises(BackendUnavailable, match="no nvlink_intra"):
        run_engine_pair("mooncake", "pull", bursts=0)


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["pull", "push"])
def test_mooncake_engine_two_gpus(spawner, direction):
    why = two_gpus_reason()
    if why and "NIXL" not in why:
        pytest.skip(why)
    why = me.probe_nvlink_intra(0)
    if why:
        pytest.skip(f"mooncake: {why}")
    out = run_two_processes(spawner, "mooncake", direction, "cuda", patch_kernels=False, bursts=2,
                             pool_bytes=64 << 20)
    assert out[1]["wrong"] == [0, 0]
