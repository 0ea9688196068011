"""A CUDA graph capture runs with the garbage collector off: a collection inside the capture would run
finalizers on the capturing thread, and a finalizer's driver call that a capture forbids (a synchronise, a host
buffer's unregister) ends the capture invalidated ("operation failed due to a previous error during capture").

The guard's bookkeeping is checked on the CPU; the capture itself with ``-m gpu``.
"""
from __future__ import annotations

import gc
import threading

import pytest

from gpuxfer.platforms.cuda_graphs import _NoCollection

T = 30.0


def test_collection_is_off_inside_and_restored_after_the_last_block():
    guard = _NoCollection()
    assert gc.isenabled()
    with guard:
        assert not gc.isenabled()
        with guard:
            assert not gc.isenabled()
        assert not gc.isenabled()       # an inner block's end leaves it off
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with guard:
            raise RuntimeError("record failed")
    assert gc.isenabled()


def test_collection_stays_off_where_the_caller_had_turned_it_off():
    guard = _NoCollection()
    gc.disable()
    try:
        with guard:
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_two_threads_capturing_at_once_keep_collection_off_until_both_end():
    guard = _NoCollection()
    inside, leave = threading.Event(), threading.Event()

    def other():
        with guard:
            inside.set()
            assert leave.wait(T)

    t = threading.Thread(target=other)
    t.start()
    try:
        assert inside.wait(T)
        with guard:
            pass
        assert not gc.isenabled()       # the other thread's block is still open
    finally:
        leave.set()
        t.join(T)
    assert not t.is_alive()
    assert gc.isenabled()


class _Forbidden:
    """Cyclic garbage whose finalizer makes a call a capture forbids on its thread."""

    def __init__(self):
        self.me = self

    def __del__(self):
        from cuda.bindings import driver
        driver.cuCtxSynchronize()


@pytest.mark.gpu
def test_cuda_capture_survives_garbage_whose_finalizer_a_capture_forbids():
    from _skips import platform_reason

    from gpuxfer.platforms import get_platform
    why = platform_reason("cuda")
    if why is not None:
        pytest.skip(f"platform cuda unavailable: {why}")
    import torch
    plat = get_platform("cuda")
    try:
        src = torch.arange(4096, dtype=torch.uint8, device="cuda:0")
        dst = torch.zeros_like(src)
        cap, s = plat.create_stream(0), plat.create_stream(0)
        torch.cuda.synchronize()
        seen = []

        def record(c):
            for _ in range(4):
                _Forbidden()                    # garbage a collection would finalize here
            junk = [[i] for i in range(3 * gc.get_threshold()[0])]   # enough allocations to run one
            seen.append(gc.isenabled())
            del junk
            plat.copy_async(c, dst.data_ptr(), src.data_ptr(), 4096)

        gc.collect()
        g = plat.capture_graph(cap, record)
        assert seen == [False] and gc.isenabled()
        gc.collect()                            # the finalizers run here, outside any capture
        plat.launch_graph(s, g)
        assert plat.synchronize(s, T)
        assert torch.equal(dst.cpu(), src.cpu())

        def failing(c):
            raise LookupError("record failed")
        with pytest.raises(LookupError):
            plat.capture_graph(cap, failing)
        assert gc.isenabled()
    finally:
        plat.close()
