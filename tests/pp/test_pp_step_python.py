"""scripts/pp_step_python.py (the Python cost of an eager copy_engine step over a no-op platform) runs, and
counts the driver calls a steady-state step makes per side: the sender waits for its slot, launches one
cached copy graph and publishes; the receiver gives the lent slot back and waits (one batched call with
``--flag-batch``). Structural, not timed."""
from __future__ import annotations

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _harness():
    spec = importlib.util.spec_from_file_location("pp_step_python", os.path.join(ROOT, "scripts", "pp_step_python.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("metadata", [False, True], ids=["no-meta", "meta"])
@pytest.mark.parametrize("platform,flag_batch", [("null", False), ("cuda-stub", False), ("cuda-stub", True)])
def test_step_harness_counts_the_calls(monkeypatch, platform, flag_batch, metadata):
    from gpuxfer.platforms import cuda_driver
    monkeypatch.setattr(cuda_driver, "_DRIVER", cuda_driver._DRIVER)      # the stub driver goes with the test
    res = _harness().measure(40, metadata, 16384, False, platform, flag_batch)
    calls = res["calls_per_step_both_sides"]
    if platform == "null":
        assert calls == {"launch_graph": 1.0, "wait_flag": 2.0, "write_flag": 2.0}
    elif flag_batch:
        assert calls == {"cuGraphLaunch": 1.0, "cuStreamWaitValue64": 1.0, "cuStreamWriteValue64": 1.0,
                         "cuStreamBatchMemOp": 1.0}
    else:
        assert calls == {"cuGraphLaunch": 1.0, "cuStreamWaitValue64": 2.0, "cuStreamWriteValue64": 2.0}
    assert res["send_us_median"] > 0 and res["recv_us_median"] > 0


@pytest.mark.parametrize("platform,flag_batch", [("null", False), ("cuda-stub", False), ("cuda-stub", True)])
def test_step_harness_default_receiver_copies_each_step_out_in_one_call(monkeypatch, platform, flag_batch):
    """The default receiver (no recv_views): the give-back and wait as with views, plus one copy of the step
    into a new buffer (through the stream-bound copy call on CUDA); its tensors are new each step."""
    from gpuxfer.platforms import cuda_driver
    monkeypatch.setattr(cuda_driver, "_DRIVER", cuda_driver._DRIVER)
    res = _harness().measure(40, False, 16384, False, platform, flag_batch, recv_views=False)
    calls = res["calls_per_step_both_sides"]
    if platform == "null":
        assert calls == {"launch_graph": 1.0, "wait_flag": 2.0, "write_flag": 2.0, "copy_async": 1.0}
    elif flag_batch:
        assert calls == {"cuGraphLaunch": 1.0, "cuStreamWaitValue64": 1.0, "cuStreamWriteValue64": 1.0,
                         "cuStreamBatchMemOp": 1.0, "cuMemcpyAsync": 1.0}
    else:
        assert calls == {"cuGraphLaunch": 1.0, "cuStreamWaitValue64": 2.0, "cuStreamWriteValue64": 2.0,
                         "cuMemcpyAsync": 1.0}
    plat, (snd, rcv) = _harness().build(False, recv_views=False)
    import torch
    src = {"hidden": torch.ones(256, dtype=torch.bfloat16), "residual": torch.ones(256, dtype=torch.bfloat16)}
    shapes = {"hidden": (256,), "residual": (256,)}
    got = []
    for _ in range(4):
        snd.send(src)
        got.append(rcv.recv(shapes=shapes).tensors)
    ptrs = {t.untyped_storage().data_ptr() for g in got for t in g.values()}
    assert len(ptrs) == 4 and all(g["hidden"].shape == (256,) for g in got)   # one new buffer per step


def test_step_harness_sender_seeing_its_slot_free_launches_one_graph(monkeypatch):
    """With its empty words in host memory and the slot seen free, the sender's step is one graph launch
    (its copies and the publish); the receiver's stays one flag_ops call."""
    from gpuxfer.platforms import cuda_driver
    monkeypatch.setattr(cuda_driver, "_DRIVER", cuda_driver._DRIVER)
    res = _harness().measure(40, False, 16384, False, "cuda-stub", True, host_give_back=True)
    assert res["calls_per_step_both_sides"] == {"cuGraphLaunch": 1.0, "cuStreamBatchMemOp": 1.0}


@pytest.mark.parametrize("sets", [5, 32, 33, 200])
def test_steady_steps_capture_no_graph_whatever_the_copy_sets_in_turn(sets):
    """Source sets in turn on alternating slots (slot x addresses: the copy graphs' key): once steady, a step
    captures nothing and creates no event. Sets that fit the graph cache launch one cached graph each step;
    more of them in turn than it holds (they would evict each other) stay plain copies, not a capture per step."""
    import torch

    from gpuxfer.pp.copy_engine import STEP_GRAPHS
    plat, (snd, rcv) = _harness().build(False)
    captures = []
    capture = plat.capture_graph
    plat.capture_graph = lambda stream, record: captures.append(1) or capture(stream, record)
    n = 256
    base = torch.zeros(sets * 2 * n, dtype=torch.bfloat16)
    srcs = [{"hidden": base[2 * i * n:(2 * i + 1) * n], "residual": base[(2 * i + 1) * n:(2 * i + 2) * n]}
            for i in range(sets)]
    shapes = {"hidden": (n,), "residual": (n,)}
    keys = len({((k - 1) % 2, k % sets) for k in range(1, 2 * sets * 2 + 1)})   # (slot, set) pairs in turn
    steady = 3 * keys + 2 * STEP_GRAPHS
    for k in range(1, steady + 2 * keys + 1):
        if k == steady + 1:
            plat.calls.clear()
            captures.clear()
        snd.send(srcs[k % sets])
        rcv.recv(shapes=shapes).tensors
        if len(snd._wd) > 256:      # the watchdog's work, off the step
            snd._wd.clear()
            rcv._wd.clear()
    steps = 2 * keys
    calls = {name: v / steps for name, v in plat.calls.items()}
    assert not captures and "record_event" not in calls
    if keys <= STEP_GRAPHS:
        assert calls == {"launch_graph": 1.0, "wait_flag": 2.0, "write_flag": 2.0}
        assert len(snd._graphs) == keys
    else:
        assert calls == {"copy_async": 2.0, "wait_flag": 2.0, "write_flag": 2.0}
        assert not snd._graphs
