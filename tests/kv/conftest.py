"""Fixtures of the KV tests: the host platform, pairs of agents (prefill on device 0, decode on device 1)
with their arenas, and the fake NIXL and Mooncake libraries installed in their place."""
from __future__ import annotations

import sys
import types

import pytest

from _agent_arena import Arena
from _nixl_engines import FakeMooncake, fake_kernels
from fake_nixl import FakeNixl
from gpuxfer.kv.agent import KVAgent
from gpuxfer.bench.kv.engines import mooncake as me
from gpuxfer.kv import nixl_ffi as nf


@pytest.fixture
def plat(host):
    """The host emulation platform (the root conftest's ``host``), closed after the test."""
    return host


@pytest.fixture
def pair(plat):
    """Two agents (prefill on device 0, decode on device 1) and their arenas."""
    a0, a1 = Arena(plat, 0), Arena(plat, 1)
    pre = KVAgent("prefill", platform=plat, device=0, engine="triton", timeout_s=60)
    dec = KVAgent("decode", platform=plat, device=1, engine="triton", timeout_s=60)
    yield pre, dec, a0, a1
    dec.close()
    pre.close()
    a0.close()
    a1.close()


@pytest.fixture
def pack_pair(plat):
    """Two pack-engine agents with 512-byte staging slots and their arenas."""
    a0, a1 = Arena(plat, 0), Arena(plat, 1)
    pre = KVAgent("prefill", platform=plat, device=0, engine="pack", slot_bytes=512)
    dec = KVAgent("decode", platform=plat, device=1, engine="pack", slot_bytes=512)
    yield pre, dec, a0, a1
    dec.close()
    pre.close()
    a0.close()
    a1.close()


@pytest.fixture
def fake_nixl(monkeypatch):
    """A FakeNixl installed as the NIXL module (GPUXFER_NIXL_MODULE names it)."""
    fake = FakeNixl()
    mod = types.ModuleType("fake_nixl_for_tests")
    mod.nixl_agent, mod.nixl_agent_config = fake.nixl_agent, fake.nixl_agent_config
    monkeypatch.setitem(sys.modules, "fake_nixl_for_tests", mod)
    monkeypatch.setenv(nf.NIXL_MODULE_ENV, "fake_nixl_for_tests")
    nf._found.clear()
    yield fake
    nf._found.clear()


@pytest.fixture
def fake_engines(fake_nixl, monkeypatch):
    """The fake NIXL, the reference copy in place of the Triton kernels and small pack stages."""
    fake_kernels(monkeypatch)
    monkeypatch.setenv("GPUXFER_NIXL_PACK_STAGE_BYTES", str(16 << 10))   # several rounds per burst
    return fake_nixl


@pytest.fixture
def fake_mooncake(monkeypatch):
    """``install(**kw)``: a FakeMooncake installed as ``mooncake.engine``; returns the fake."""
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
