"""Pull and push across two processes through the platform contract.

Rank 0 (this process, device 0) owns pool A; rank 1 (a spawned child, device 1
on a two-GPU machine) owns pool B. Each opens the other's pool over IPC
(``export_handle`` / ``open_handle`` / ``as_tensor``) and:

* rank 1 **pulls**: runs the copy kernel on its device reading A into B;
* rank 1 **pushes**: runs the copy kernel on its device writing B's bytes into A;
* each side verifies what landed in its own pool (the pull in the child, the push
  here), and the child also verifies the push through its mapping.

``host`` runs on the CPU (Triton's interpreter over shared memory); ``cuda`` is
marked ``gpu``. Every join and queue read has a timeout; exit codes are asserted.
"""
from __future__ import annotations

import numpy as np
import pytest

from gpuxfer.kernels import reference as ref
from gpuxfer.platforms import get_platform

T = 120.0
PAGE, NPAGES = 2304, 48
SEED_A, SEED_B = 11, 22
POOL = PAGE * NPAGES


def _tables() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    pull = np.stack([rng.permutation(NPAGES)[:20] * PAGE, rng.permutation(NPAGES // 2)[:20] * PAGE,
                     np.full(20, PAGE)], 1).astype(np.int64)
    # push: B's second half (pattern of SEED_B) into A's pages that nothing else touches
    push = np.stack([(NPAGES // 2 + rng.permutation(NPAGES // 2)[:12]) * PAGE,
                     rng.permutation(NPAGES)[:12] * PAGE, np.full(12, PAGE)], 1).astype(np.int64)
    push[3, 2] = 528          # one short row
    return pull, push


def _dev(p, rank: int) -> int:
    return rank % p.device_count()


def _sync(p, dev: int) -> None:
    import torch
    assert p.synchronize(p.current_stream(dev), T), "stream did not drain"
    if p.name == "cuda":
        torch.cuda.synchronize(dev)


def _rank1(platform_name: str, handle_a, to_parent, to_child) -> dict:
    import torch

    from gpuxfer.kernels import copy_descriptors, fill_pattern, verify
    p = get_platform(platform_name)
    try:
        dev = _dev(p, 1)
        p.set_device(dev)
        b = p.alloc(POOL, dev)
        tb = p.as_tensor(b)
        fill_pattern(tb, SEED_B)
        _sync(p, dev)
        to_parent.put(p.export_handle(b))
        a = p.open_handle(handle_a, dev)
        ta = p.as_tensor(a)
        assert ta.device == tb.device and ta.numel() == POOL
        tdev = tb.device
        pull, push = _tables()
        # pull: the kernel runs here (B's device) and reads A
        dp = torch.from_numpy(pull).to(tdev)
        copy_descriptors(ta, tb, dp)
        _sync(p, dev)
        v_pull = verify(tb, dp, SEED_A)
        untouched = verify(tb, torch.tensor([[POOL // 2, POOL // 2, POOL // 2]], device=tdev), SEED_B)
        # push: the kernel runs here and writes A
        dq = torch.from_numpy(push).to(tdev)
        copy_descriptors(tb, ta, dq)
        _sync(p, dev)
        v_push_here = verify(ta, dq, SEED_B)        # read back through the mapping
        to_parent.put("pushed")
        assert to_child.get(timeout=T) == "verified"
        a.close()
        b.close()
        return {"device": dev, "pull": (v_pull.wrong_bytes, v_pull.first_bad, v_pull.nbytes),
                "untouched": untouched.wrong_bytes,
                "push_via_mapping": (v_push_here.wrong_bytes, v_push_here.first_bad)}
    finally:
        p.close()


@pytest.mark.timeout(300)
def test_pull_and_push_across_two_processes(platform, platform_name, spawner):
    import torch

    from gpuxfer.kernels import fill_pattern, verify
    dev = _dev(platform, 0)
    platform.set_device(dev)
    a = platform.alloc(POOL, dev)
    try:
        ta = platform.as_tensor(a)
        fill_pattern(ta, SEED_A)
        _sync(platform, dev)
        to_parent, to_child = spawner.queue(), spawner.queue()
        child = spawner.start(_rank1, platform_name, platform.export_handle(a), to_parent, to_child, name="rank 1")
        handle_b = to_parent.get(timeout=T)
        b = platform.open_handle(handle_b, dev)
        try:
            assert to_parent.get(timeout=T) == "pushed"
            pull, push = _tables()
            dq = torch.from_numpy(push).to(ta.device)
            v = verify(ta, dq, SEED_B)                  # the pushed bytes, checked by their owner
            assert v.ok, v
            # the rest of A still holds A's own pattern
            touched = np.zeros(POOL, dtype=bool)
            for _, d, n in push.tolist():
                touched[d:d + n] = True
            keep = np.flatnonzero(~touched)
            assert np.array_equal(ta.cpu().numpy()[keep], ref.pattern_at(SEED_A, keep))
            # and B, seen from here, holds what rank 1 pulled
            tb = platform.as_tensor(b)
            assert verify(tb, torch.from_numpy(pull).to(tb.device), SEED_A).ok
        finally:
            to_child.put("verified")
            res = child.result(T)
            child.join(T)
            b.close()
        assert res["pull"] == (0, -1, 20 * PAGE)
        assert res["untouched"] == 0
        assert res["push_via_mapping"] == (0, -1)
        if platform.device_count() >= 2:
            assert res["device"] == 1
    finally:
        a.close()


@pytest.mark.timeout(300)
def test_peer_pools_calls_after_close_or_after_the_helper_died_are_typed(host):
    """A call on closed pools, or to a helper that was killed: a GpuxferError naming it, not the pipe's
    OSError / BrokenPipeError."""
    import os
    import signal

    from gpuxfer.errors import BadInput, GpuxferError
    from gpuxfer.kernels.peer import PeerPools
    pools = PeerPools(host, 0, 0, [4096], timeout_s=T)
    pools.call("fill", 0, 3)
    os.kill(pools.pid, signal.SIGKILL)
    pools._proc.join(T)
    with pytest.raises(GpuxferError, match="helper"):
        pools.call("fill", 0, 3)
    with pytest.raises(GpuxferError, match="exited with code"):
        pools.close()
    with pytest.raises(BadInput, match="closed"):
        pools.call("fill", 0, 3)
