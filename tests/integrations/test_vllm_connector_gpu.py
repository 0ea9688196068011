"""GpuxferConnector with CUDA KV caches vLLM's allocator code made (plain torch memory), prefill and decode
in two processes on one GPU, vLLM's real Scheduler in each; every loaded byte checked.

Run on a GPU machine with vLLM's pure-Python tree on PYTHONPATH (scripts/vllm_device_tree.py):
``GPUXFER_REQUIRE_VLLM=1 python -m pytest -m gpu tests/integrations/test_vllm_connector_gpu.py``.
"""
from __future__ import annotations

import pytest

from _requires import require

pytestmark = pytest.mark.gpu

require("vllm", "GPUXFER_REQUIRE_VLLM", "vllm==0.33.0")

from vllm_instance import running, write_model  # noqa: E402

ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model = write_model(str(tmp_path_factory.mktemp("model")))
    tm = {"token_major": True}
    with running({"gP": dict(model_dir=model, block_size=64, extra=tm, env=ENV, device="cuda", num_blocks=16384),
                  "gD": dict(model_dir=model, block_size=32, extra={**tm, "loader": "inline"}, env=ENV, device="cuda",
                             num_blocks=16384),
                  "gE": dict(model_dir=model, block_size=64, env=ENV, device="cuda", num_blocks=16384),
                  "gL": dict(model_dir=model, block_size=32, extra={**tm, "loader": "process"}, env=ENV,
                             device="cuda", num_blocks=16384),
                  # the default loader, whose process cannot be ready in time: loads on the engine thread, logged
                  "gF": dict(model_dir=model, block_size=32, extra=tm, device="cuda", num_blocks=4096,
                             env={**ENV, "GPUXFER_VLLM_LOADER_START_S": "0.01"})}) as out:
        yield {"P": out["gP"], "D": out["gD"], "E": out["gE"], "L": out["gL"], "F": out["gF"]}


@pytest.mark.parametrize("dec", ["D", "E", "L", "F"])
def test_gpu_prefill_to_decode(pair, dec):
    """D: 32-token blocks reading 64-token ones (ratio 2), loads on the engine thread; E: equal block sizes, the
    default loader (a loader process on a GPU); L: as D, its loads in a loader process (the caches reach it by CUDA
    IPC); F: the default loader whose process cannot start in time, so loads on the engine thread. 64 requests up
    to 4k tokens."""
    P, D = pair["P"], pair[dec]
    reqs = [(f"{dec}{i}", 100 + 61 * i, 9000 + i) for i in range(64)]
    res = P.run("prefill", [(r, n, s, None) for r, n, s in reqs], timeout=600)
    params = {r: v["params"] for r, v in res.items()}
    out = D.run("decode", [(f"d-{r}", n, s, params[r]) for r, n, s in reqs], timeout=600)
    for r, v in out.items():
        assert v.get("load") == "ok" and v["bad"] == 0 and v["checked"] > 0, (r, v)
    s = P.call("idle", 60, timeout=120)
    assert s["requests"] == 0 and s["free"] == P.info["free"], s
    st = D.call("stats")["stats"]
    assert st["failed"] == 0 and st["transfers"] >= 64
    if dec == "F":
        assert D.call("loader_pid") is None
        assert any("the loader process did not start" in line for line in D.call("logs"))
    elif dec in "EL":
        assert D.call("loader_pid") is not None


def test_gpu_a_loader_killed_with_reads_in_flight_fails_them(pair):
    """The loader process killed right after the loads of 16 requests were handed to it, reads in flight or queued
    (vllm_instance.loader_dies)."""
    from vllm_instance import loader_dies
    loader_dies(pair["P"], pair["L"], [(f"K{i}", 4000 + 13 * i, 9500 + i) for i in range(16)],
                [(f"M{i}", 300 + i, 9600 + i) for i in range(4)])


@pytest.mark.parametrize("p_tp, d_tp", [(2, 2), (1, 2)])
def test_gpu_tensor_parallel_ranks_read_their_own_shards(tmp_path, p_tp, d_tp):
    """Prefill and decode with CUDA caches (tests/integrations/test_vllm_tp.py's instances), four KV heads: at TP 2
    and 2, decode rank i reads prefill rank i's half of the heads; at TP 1 and 2, decode rank i reads its two of
    the prefill's four (a view of the prefill's pieces). Every byte of both ranks checked."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from vllm_instance import assert_idle, assert_loaded, decode, prefill
    model = write_model(str(tmp_path / "model"), num_key_value_heads=4)
    tm = {"token_major": True}
    with running({"tP": dict(model_dir=model, block_size=64, tp=p_tp, extra=tm, env=ENV, device="cuda",
                             num_blocks=4096),
                  "tD": dict(model_dir=model, block_size=32, tp=d_tp, extra=tm, env=ENV, device="cuda",
                             num_blocks=4096)}) as out:
        P, D = out["tP"], out["tD"]
        assert P.info["heads"] == [4 // p_tp] * p_tp and D.info["heads"] == [4 // d_tp] * d_tp
        reqs = [(f"t{i}", 100 + 61 * i, 9500 + i) for i in range(32)]
        res = decode(D, reqs, prefill(P, reqs))
        assert_loaded(res)
        assert_idle(P)
        st = D.call("stats")["stats"]
        assert st["failed"] == 0 and st["transfers"] == d_tp * len(reqs) and st["handshakes"] == d_tp
