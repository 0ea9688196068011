"""Collective backend selection: one stage failing setup in a 4-stage chain, inconsistent setups, and
the local parts (backend names, env, backend_report)."""
from __future__ import annotations

import os

import pytest

from test_pp_chain import run_chain, specs


def counting_platform(name: str, *, slow_link: bool = False, no_memops: bool = False):
    """The platform class of ``name``, subclassed to count live allocations and open mappings.

    ``slow_link``: every link looks like PCIe; ``no_memops``: no 64-bit stream memory operations.
    """
    import dataclasses

    from gpuxfer.platforms import platform_class
    from gpuxfer.platforms.base import LinkInfo
    base = platform_class(name)

    class Counting(base):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.live_bytes = 0
            self.open_maps = 0

        def alloc(self, nbytes, device):
            b = super().alloc(nbytes, device)
            self.live_bytes += b.nbytes
            return b

        def _free(self, buf):
            super()._free(buf)
            self.live_bytes -= buf.nbytes

        def open_handle(self, handle, device):
            m = super().open_handle(handle, device)
            self.open_maps += 1
            return m

        def _close_mapping(self, mapping):
            super()._close_mapping(mapping)
            self.open_maps -= 1

        def link(self, src, dst):
            if slow_link and src != dst:
                return LinkInfo(src, dst, "pcie", True, "test: forced PCIe")
            return super().link(src, dst)

        def device_info(self, device):
            info = super().device_info(device)
            return dataclasses.replace(info, stream_mem_ops_64=False) if no_memops else info

    return Counting


def setup_session(rank: int, world: int, init_method: str, platform_name: str) -> dict:
    os.environ["GPUXFER_PLATFORM"] = platform_name
    import torch
    import torch.distributed as dist

    from gpuxfer.errors import BackendUnavailable, BadInput
    from gpuxfer.pp import connect
    from gpuxfer.pp.launch import init_cpu_group
    init_cpu_group(rank, world, init_method)
    FAIL = 2
    chain = dict(send_to=rank + 1 if rank < world - 1 else None, recv_from=rank - 1 if rank else None)
    seen = {}
    cases = [("inject", "check"), ("inject", "alloc"), ("inject", "open"), ("inject", "probe"),
             ("slow_link", None), ("no_memops", None)]
    try:
        for kind, phase in cases:
            for backend in ("copy_engine", "auto"):
                cls = counting_platform(platform_name, slow_link=(kind == "slow_link" and rank == FAIL),
                                        no_memops=(kind == "no_memops" and rank == FAIL))
                plat = cls()
                device = rank % plat.device_count()
                if not plat.is_emulation:
                    torch.cuda.set_device(device)
                label = f"{kind}:{phase}:{backend}"
                kw = dict(chain, specs=specs(), backend=backend, platform=plat, device=device, timeout_s=60,
                          inject_failure=f"{FAIL}:{phase}" if kind == "inject" else "")
                try:
                    if backend == "copy_engine":
                        with pytest.raises(BackendUnavailable) as ei:
                            connect(**kw)
                        assert set(ei.value.reasons) == {FAIL}, ei.value.reasons
                        why = ei.value.reasons[FAIL]
                        seen[label] = why
                    else:
                        conn = connect(**kw)
                        with conn:
                            assert conn.backend == "nccl"
                            assert set(conn.fallback_reasons) == {FAIL}
                            seen[label] = conn.fallback_reasons[FAIL]
                            # nccl buffers come from torch; every platform buffer of the failed backend is freed
                            assert plat.live_bytes == 0 and plat.open_maps == 0, (plat.live_bytes, plat.open_maps)
                            if rank < world - 1:
                                assert conn.allocated_bytes == 2 * conn.sender().specs.slot_bytes
                            if kind == "inject" and phase == "open":   # the fallback carries data
                                run_chain(conn, rank, world, seed=3, steps=6, lag_ms=1.0, metadata=True,
                                          use_out=False, device=device, torch_device=conn.transports[0].torch_device)
                    # every rank frees everything on failure, the failing one and its peers alike
                    assert plat.live_bytes == 0 and plat.open_maps == 0, (label, plat.live_bytes, plat.open_maps)
                finally:
                    plat.close()

        # an inconsistent setup raises BadInput on every rank, naming the culprit
        from gpuxfer.platforms import get_platform
        plat = get_platform(platform_name)
        try:
            bad = specs()
            if rank == 3:
                bad["hidden"] = ((49, 40), bad["hidden"][1])
            with pytest.raises(BadInput) as ei:
                connect(**chain, specs=bad, backend="auto", platform=plat, device=rank % plat.device_count())
            seen["inconsistent"] = str(ei.value)
            with pytest.raises(BadInput) as ei:
                connect(**chain, specs=specs(), backend="copy_engine" if rank else "nccl", platform=plat,
                        device=rank % plat.device_count())
            seen["backend mismatch"] = str(ei.value)
            with pytest.raises(BadInput) as ei:   # a sender whose receiver does not expect it
                connect(send_to=(rank + 2) % world, specs=specs(), platform=plat, device=rank % plat.device_count())
            seen["unmatched"] = str(ei.value)
        finally:
            plat.close()
    finally:
        dist.destroy_process_group()
    return seen


def test_one_stage_fails_setup(spawner, platform_name, nccl_pairs):
    world = 4
    results = spawner.run_ranks(setup_session, world, platform_name, timeout=240)
    for seen in results:   # every rank saw the same reasons
        assert seen == results[0]
    seen = results[0]
    for phase in ("check", "alloc", "open", "probe"):
        assert f"phase '{phase}'" in seen[f"inject:{phase}:copy_engine"]
        assert f"phase '{phase}'" in seen[f"inject:{phase}:auto"]
    assert "pcie" in seen["slow_link:None:copy_engine"]
    assert "stream memory operations" in seen["no_memops:None:auto"]
    assert "rank 3" in seen["inconsistent"] and "rank 2" in seen["inconsistent"]
    assert "asks for backend" in seen["backend mismatch"]
    assert "does not receive from it" in seen["unmatched"]


# --------------------------------------------------------------------------- local parts


def test_requested_backend(monkeypatch):
    from gpuxfer.errors import BadInput
    from gpuxfer.pp import requested_backend
    monkeypatch.delenv("GPUXFER_PP_TRANSPORT", raising=False)
    assert requested_backend() == "auto"
    monkeypatch.setenv("GPUXFER_PP_TRANSPORT", "copy_engine")
    assert requested_backend() == "copy_engine"
    assert requested_backend("nccl") == "nccl"
    monkeypatch.setenv("GPUXFER_PP_TRANSPORT", "bogus")
    with pytest.raises(BadInput, match="bogus"):
        requested_backend()


def test_backend_report_host(host):
    from gpuxfer.pp import backend_report
    rep = backend_report(host)      # other backends (sdma) may be registered too
    assert rep["nccl"] is None and rep["copy_engine"] is None


def test_zero_sm_backends_follow_capabilities_not_names(host):
    """copy_engine asks Platform.copy_engine_peer_copies, sdma asks Platform.sdma: a platform's name plays no part."""
    from gpuxfer.platforms.host import HostPlatform
    from gpuxfer.pp.copy_engine import CopyEngineTransport
    from gpuxfer.pp.sdma import SdmaTransport

    class Blits(HostPlatform):          # the host emulation, said to copy with kernels
        copy_engine_peer_copies = False

    class Renamed(HostPlatform):
        name = "rocm"

    for cls in (Blits, Renamed):
        plat = cls()
        try:
            why = CopyEngineTransport.unavailable_reason(plat, 0)
            assert (why is None) == plat.copy_engine_peer_copies, why
            assert "copy_engine_peer_copies" in (why or "copy_engine_peer_copies")
            assert "no SDMA engines" in SdmaTransport.platform_reason(plat)
        finally:
            plat.close()


def test_backend_report_reasons():
    from gpuxfer.pp import backend_report
    plat = counting_platform("host", slow_link=True)()
    try:
        assert "pcie" in backend_report(plat)["copy_engine"]
    finally:
        plat.close()
    plat = counting_platform("host", no_memops=True)()
    try:
        assert "stream memory operations" in backend_report(plat)["copy_engine"]
    finally:
        plat.close()


def test_register_backend_hook(monkeypatch):
    from gpuxfer.pp import backends, selection
    monkeypatch.setattr(backends, "BACKENDS", dict(backends.BACKENDS))
    monkeypatch.setattr(backends, "ZERO_SM", list(backends.ZERO_SM))
    selection.register_backend("sdma_test", "gpuxfer.pp.copy_engine", "CopyEngineTransport")
    assert selection.requested_backend("sdma_test") == "sdma_test"
    assert backends.ZERO_SM[-1] == "sdma_test"
    assert selection.backend_class("sdma_test").name == "copy_engine"
    assert "sdma_test" not in selection.BACKENDS     # the registry as imported, untouched by the patched one


def test_connect_needs_distributed():
    from gpuxfer.errors import BadInput
    from gpuxfer.pp import connect
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(BadInput, match="torch.distributed"):
        connect(send_to=1, specs=specs())
