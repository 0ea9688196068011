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
    from gpuxfer.platforms import cuda
    monkeypatch.setattr(cuda, "_DRIVER", cuda._DRIVER)      # the stub driver goes with the test
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
