"""GpuxferConnector with its decode loads in a loader process (``kv_connector_extra_config['loader']:
"process"``), against vLLM 0.33's real Scheduler on the host emulation: the caches vLLM allocated reach the loader
(shared memory here, CUDA IPC on a GPU), every loaded byte is checked, and a loader that dies fails its loads (load
errors reported, no hang) and every later one.
"""
from __future__ import annotations

import os

import pytest

from _requires import require

require("vllm", "GPUXFER_REQUIRE_VLLM", "vllm==0.33.0")

from vllm_instance import (assert_idle, assert_loaded, decode, loader_dies, prefill, prefill_dies,  # noqa: E402
                           running, write_model)

ENV = {"GPUXFER_PLATFORM": "host", "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "VLLM_LOGGING_LEVEL": "WARNING"}
TM = {"token_major": True}
LOADER = {"loader": "process"}


@pytest.fixture(scope="module")
def inst(tmp_path_factory):
    """P64 read by D32 (ratio 2), a hybrid pair HP/HD, and DX (a decode whose loader the test kills); the decode
    instances load in loader processes."""
    model = write_model(str(tmp_path_factory.mktemp("model")))
    specs = {"P64": (64, False, TM), "D32": (32, False, {**TM, **LOADER}), "HP": (32, True, {}),
             "HD": (32, True, LOADER), "DX": (32, False, {**TM, **LOADER})}
    with running({name: dict(model_dir=model, block_size=bs, hybrid=hybrid, extra=extra, env=ENV)
                  for name, (bs, hybrid, extra) in specs.items()}) as out:
        yield out


def test_64_concurrent_requests_through_the_loader(inst):
    P, D = inst["P64"], inst["D32"]
    pid = D.call("loader_pid")
    assert pid is not None and pid != os.getpid()
    reqs = [(f"l{i}", 40 + 23 * i, 1000 + i) for i in range(64)]
    assert_loaded(decode(D, reqs, prefill(P, reqs)))
    s = assert_idle(P)
    assert s["stats"]["sends_done"] >= 64
    d = D.call("stats")
    assert d["requests"] == 0 and d["free"] == D.info["free"]
    st = d["stats"]         # (the loader's counters, merged into the worker's)
    assert st["transfers"] >= 64 and st["handshakes"] == 1 and st["failed"] == 0 and len(st["post_host_s"]) >= 64


def test_hybrid_groups_through_the_loader(inst):
    P, D = inst["HP"], inst["HD"]
    reqs = [(f"lh{i}", 30 + 61 * i, 3000 + i) for i in range(4)]
    assert_loaded(decode(D, reqs, prefill(P, reqs)))
    assert_idle(P)


def test_a_dead_prefill_fails_the_loaders_loads(inst):
    prefill_dies(inst["HP"], inst["HD"], [(f"lk{i}", 160, 8000 + i) for i in range(3)])


def test_a_dead_loader_fails_its_loads_and_every_later_one(inst):
    """The loader killed right after a step's loads were handed to it (vllm_instance.loader_dies)."""
    P, D = inst["P64"], inst["DX"]
    warm = [(f"x{i}", 100 + 7 * i, 5000 + i) for i in range(2)]
    assert_loaded(decode(D, warm, prefill(P, warm)))        # (handshaken: the next loads post at once)
    loader_dies(P, D, [(f"y{i}", 300 + 7 * i, 6000 + i) for i in range(8)],
                [(f"z{i}", 100 + i, 7000 + i) for i in range(3)], timeout=60)


def test_a_loader_that_does_not_start_fails_the_startup_it_was_asked_for(tmp_path):
    """``loader: "process"`` and a loader that cannot be ready in time (its start-up limit 10 ms): the instance's
    startup fails with the typed error naming it, nothing left running."""
    model = write_model(str(tmp_path / "model"))
    with pytest.raises(RuntimeError, match="loader process of engine .* (did not start within|took no start-up)"):
        with running({"DS": dict(model_dir=model, block_size=32, extra={**TM, **LOADER},
                                 env={**ENV, "GPUXFER_VLLM_LOADER_START_S": "0.01"})}):
            pass
