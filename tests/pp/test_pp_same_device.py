"""Two ranks on one device: ``connect(backend="nccl")`` refuses before NCCL is initialised (NCCL itself
fails at its first operation with "Duplicate GPU detected"), and ``auto`` does not pick NCCL there.

The host emulation has no such limit (its "NCCL" is gloo), so the two-rank test makes the check see a
GPU platform; everything else (the exchange, the verdict on every rank) is the real code.
"""
from __future__ import annotations

import pytest

from test_pp_chain import specs


def _infos(pci0, pci1, dev0=0, dev1=0, host1="h"):
    return {0: {"rank": 0, "host": "h", "device": dev0, "pci": pci0},
            1: {"rank": 1, "host": host1, "device": dev1, "pci": pci1}}


PAIR = [("send", 1, (0, 1), None)]


def test_same_device_reason():
    from gpuxfer.pp.setup import nccl_same_device
    why = nccl_same_device(_infos("0000:1a:00.0", "0000:1a:00.0"), PAIR, False)
    assert "ranks 0 and 1 share device 0 (PCI 0000:1a:00.0)" in why and "NCCL refuses" in why
    assert nccl_same_device(_infos("0000:1a:00.0", "0000:1b:00.0", 0, 1), PAIR, False) is None
    # device indexes may differ between processes (CUDA_VISIBLE_DEVICES): the PCI id decides
    assert nccl_same_device(_infos("0000:1a:00.0", "0000:1a:00.0", 0, 1), PAIR, False) is not None
    assert nccl_same_device(_infos(None, None, 0, 0), PAIR, False) is not None
    assert nccl_same_device(_infos(None, None, 0, 1), PAIR, False) is None
    assert nccl_same_device(_infos(None, None, 0, 0, host1="other"), PAIR, False) is None
    assert nccl_same_device(_infos(None, None, 0, 0), PAIR, True) is None       # the emulation: gloo


def _session(rank: int, world: int, init_method: str) -> dict:
    import os
    os.environ["GPUXFER_PLATFORM"] = "host"
    import torch.distributed as dist

    from gpuxfer.errors import BackendUnavailable
    from gpuxfer.platforms import get_platform
    from gpuxfer.pp import ConnectOptions, connect, setup
    from gpuxfer.pp.launch import init_cpu_group
    real = setup.nccl_same_device
    setup.nccl_same_device = lambda infos, pairs, emulation: real(infos, pairs, False)  # as on a GPU
    init_cpu_group(rank, world, init_method)
    out = {}
    plat = get_platform("host")
    try:
        kw = dict(send_to=1 if rank == 0 else None, recv_from=0 if rank == 1 else None, specs=specs(),
                  platform=plat, device=0, timeout_s=30)
        try:
            connect(backend="nccl", **kw)
            out["nccl"] = "connected"
        except BackendUnavailable as exc:
            out["nccl"] = str(exc)
        topology = {k: kw.pop(k) for k in ("send_to", "recv_from", "specs")}
        opts = ConnectOptions(backend="nccl", **kw)
        with connect(**topology, options=opts, backend="auto") as conn:     # a keyword takes an option's place
            out["auto"] = conn.backend
    finally:
        plat.close()
        dist.destroy_process_group()
    return out


@pytest.mark.timeout(120)
def test_nccl_refuses_two_ranks_on_one_device_before_it_starts(spawner):
    results = spawner.run_ranks(_session, 2, timeout=90)
    for r in results:
        assert "share device 0" in r["nccl"] and "NCCL refuses two ranks on one device" in r["nccl"], r
        assert r["auto"] == "copy_engine"
