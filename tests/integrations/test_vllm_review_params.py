"""Genuine ``kv_transfer_params`` handed to a decode request of another prompt (a proxy that mixes up two requests'
params, or a client that attaches the params of one of its prompts to another): vLLM 0.33's real Scheduler in
spawned instances on the host emulation (tests/integrations/vllm_instance.py), every loaded byte checked."""
from __future__ import annotations

from _requires import require

require("vllm", "GPUXFER_REQUIRE_VLLM", "vllm==0.33.0")

from vllm_instance import assert_idle, assert_loaded, prefill, running, write_model  # noqa: E402

ENV = {"GPUXFER_PLATFORM": "host", "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "VLLM_LOGGING_LEVEL": "WARNING"}
TM = {"token_major": True}


def test_params_of_one_prompt_never_load_into_another(tmp_path):
    """A prefill of prompt A (seed 41) hands out params; a decode request of prompt B (seed 42, as long) arrives with
    them. Loading A's KV for B and reporting it loaded would make B's output (and, with prefix caching, every later
    request sharing B's prefix) run on A's KV: B is computed locally, and the params are released (the prefill frees
    A's blocks now, not at the lease); a load of them into prompt A then fails (released), never lands other bytes."""
    model = write_model(str(tmp_path / "model"))
    kw = dict(model_dir=model, block_size=16, extra=TM, env=ENV, num_blocks=64, max_model_len=1024)
    with running({"P": kw, "D": kw}) as inst:
        P, D = inst["P"], inst["D"]
        pa, pc = prefill(P, [("a", 100, 41)]), prefill(P, [("c", 100, 43)])
        assert_loaded(D.run("decode", [("d-c", 100, 43, pc["c"])]))        # (the handshake: releases reach P)
        res = D.run("decode", [("d-b", 100, 42, pa["a"])])["d-b"]
        assert res.get("finished") == "length", res
        assert "load" not in res, res
        assert_idle(D)
        assert_idle(P)                                      # released, not held to the lease
        res = D.run("decode", [("d-a", 100, 41, pa["a"])])["d-a"]
        assert res.get("finished") == "length" and res.get("load") != "ok", res
        assert_idle(D)
