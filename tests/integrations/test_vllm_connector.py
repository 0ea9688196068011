"""GpuxferConnector against vLLM 0.33's real Scheduler: prefill and decode instances in spawned processes
on the host emulation (tests/integrations/vllm_instance.py), every loaded byte checked.

vLLM is not a dependency: without it these tests skip, unless GPUXFER_REQUIRE_VLLM=1 (CI's vLLM step),
which makes a missing vLLM a failure.
"""
from __future__ import annotations


import pytest

from _requires import require

require("vllm", "GPUXFER_REQUIRE_VLLM", "vllm==0.33.0")

from vllm_instance import (assert_idle, assert_loaded, decode, free_port, lease_runs_out, prefill,  # noqa: E402
                           prefill_dies, running, write_model)

ENV = {"GPUXFER_PLATFORM": "host", "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "VLLM_LOGGING_LEVEL": "WARNING"}
TM = {"token_major": True}          # token-major content, as the GPU backends keep it: different block sizes pair


@pytest.fixture(scope="module")
def inst(tmp_path_factory):
    """Five instances, started together: P64 (64-token blocks) read by D32 (ratio 2) and D16 (ratio 4);
    a hybrid pair HP/HD (full attention + sliding window, 32-token blocks, the CPU backend's layout). The caches
    are vLLM's own plain CPU tensors where the host platform reaches another process's memory."""
    model = write_model(str(tmp_path_factory.mktemp("model")))
    specs = {"P64": (64, False, TM), "D32": (32, False, TM), "D16": (16, False, TM),
             "HP": (32, True, {}), "HD": (32, True, {})}
    with running({name: dict(model_dir=model, block_size=bs, hybrid=hybrid, extra=extra, env=ENV)
                  for name, (bs, hybrid, extra) in specs.items()}) as out:
        yield out


def test_ratio_2_with_64_concurrent_requests(inst):
    P, D = inst["P64"], inst["D32"]
    reqs = [(f"c{i}", 40 + 23 * i, 1000 + i) for i in range(64)]
    params = prefill(P, reqs)
    res = decode(D, reqs, params)
    assert_loaded(res)
    s = assert_idle(P)
    assert s["stats"]["sends_done"] >= 64 and s["stats"].get("leases_expired", 0) == 0
    d = D.call("stats")
    assert d["requests"] == 0 and d["free"] == D.info["free"]
    st = d["stats"]
    assert st["transfers"] >= 64 and st["bytes"] > 0 and st["handshakes"] == 1 and st["failed"] == 0
    assert len(st["post_host_s"]) >= 64


def test_ratio_4(inst):
    P, D = inst["P64"], inst["D16"]
    reqs = [(f"q{i}", 17 + 101 * i, 2000 + i) for i in range(8)]
    assert_loaded(decode(D, reqs, prefill(P, reqs)))
    assert_idle(P)


def test_hybrid_groups(inst):
    P, D = inst["HP"], inst["HD"]
    assert P.info["groups"] == [2, 2]           # full attention and sliding window layers
    reqs = [(f"h{i}", 30 + 61 * i, 3000 + i) for i in range(4)]
    assert_loaded(decode(D, reqs, prefill(P, reqs)))
    assert_idle(P)
    assert D.call("stats")["free"] == D.info["free"]


def test_prefill_abort_frees_blocks(inst):
    P = inst["P64"]
    # 6000-token prompts need two steps of the 4096-token budget: aborted after the first, mid-prefill
    states = P.call("submit_abort", "prefill", [(f"a{i}", 6000, 4000 + i, None) for i in range(4)])
    assert "RUNNING" in states.values(), states
    assert_idle(P)


def test_decode_abort_releases_prefill(inst):
    P, D = inst["P64"], inst["D32"]
    expired = P.call("stats")["stats"].get("leases_expired", 0)
    reqs = [(f"b{i}", 200 + i, 5000 + i) for i in range(6)]
    params = prefill(P, reqs)
    states = D.call("submit_abort", "decode", [(f"d-{r}", n, s, params[r]) for r, n, s in reqs])
    assert "WAITING_FOR_REMOTE_KVS" in states.values(), states      # aborted while their loads run
    assert_idle(D)
    s = assert_idle(P)          # read or released, not left to the lease
    assert s["stats"].get("leases_expired", 0) == expired


def test_lease_expiry(inst):
    lease_runs_out(inst["P64"], inst["D32"], [(f"l{i}", 150, 6000 + i) for i in range(2)])


def test_hostile_transfer_params(inst):
    """Each bad request fails alone (computed locally); the good one beside them loads. The prefill cannot be
    told about params too broken to name it, nor about params whose seal does not cover what they name (their
    key is not to be trusted): the lease (short here) frees those blocks. Params pointed at blocks of the prefill
    that are in range (another request's, or the request's own shifted by one) or with a lease pushed out fail
    their seal: never a load of other bytes reported good."""
    P, D = inst["P64"], inst["D32"]
    P.call("set_lease", 20.0)
    reqs = [(f"x{i}", 130, 7000 + i) for i in range(15)]
    params = prefill(P, reqs)
    hp = prefill(inst["HP"], [("xh", 130, 7100)])["xh"]
    bad = {
        "x0": {"remote_block_ids": [[99999999, 1, 2]]},                     # past the prefill's pool
        "x1": {"remote_block_ids": [["1", "2", "3"]]},                      # not integers
        "x2": {"remote_block_ids": [[-5, 1, 2]]},                           # negative
        "x3": {"remote_block_ids": [[1] * 10_000_000]},                     # huge
        "x4": {"remote_engine_id": "someone-else"},                         # the engine at that port is not it
        "x5": {"remote_port": free_port()},                              # nobody listens
        "x6": {"remote_port": "80"},                                        # wrong type
        "x7": {"gpuxfer": 999},                                             # another version
        "x8": {"remote_block_sizes": [48]},                                 # 48 and 32 do not divide
        "x9": {"remote_host": hp["remote_host"], "remote_port": hp["remote_port"],
               "remote_engine_id": hp["remote_engine_id"]},                 # an incompatible engine (hybrid)
        "x10": {"remote_block_ids": [[1]]},                                 # too few blocks for the prompt
        "x12": {"remote_block_ids": [[b + 1 for b in params["x12"]["remote_block_ids"][0]]]},   # shifted by one
        "x13": {"remote_block_ids": params["x11"]["remote_block_ids"]},     # the good request's blocks
        "x14": {"lease_deadline": params["x14"]["lease_deadline"] + 3600},  # a lease pushed out
    }
    for r, patch in bad.items():
        params[r] = dict(params[r], **patch)
    res = decode(D, reqs, params)
    for r, v in res.items():
        key = r[2:]
        assert v.get("finished") == "length", (r, v)            # every request still completes
        assert v.get("bad", 0) == 0, (r, v)
        if key in ("x1", "x2", "x3", "x6", "x7", "x8", "x10"):
            assert "load" not in v, (r, v)                      # refused up front: computed locally
        elif key == "x11":
            assert v.get("load") == "ok" and v["bad"] == 0, (r, v)
        else:
            assert v.get("load") == "failed", (r, v)
    assert_idle(D)
    P.call("set_lease", 120.0)
    assert_idle(P, timeout=90)


def test_dead_prefill_reports_load_errors(inst):
    prefill_dies(inst["HP"], inst["HD"], [(f"k{i}", 160, 8000 + i) for i in range(3)])


def test_the_stats_p90_is_the_nearest_rank():
    """``get_kv_connector_stats``' p90 is the ceil(0.9 n)-th smallest sample: of ten post times 1..10 ms the 9th
    (9 ms), not the largest; of three, the largest."""
    from gpuxfer.integrations.vllm.connector import GpuxferStats
    s = GpuxferStats()
    s.data["post_host_s"] = [i / 1e3 for i in range(10, 0, -1)]
    s.data["xfer_s"] = [0.001, 0.003, 0.002]
    out = s.reduce()
    assert out["post_host_p90_ms"] == 9.0 and out["xfer_p90_ms"] == 3.0


def test_the_extra_config_is_checked():
    """``kv_connector_extra_config``: ``device_ids`` is true, false or "auto" (the default); anything else, and a
    ``token_major`` that is not a bool, is a typed error naming the key."""
    from gpuxfer.errors import BadInput
    from gpuxfer.integrations.vllm.connector import _settings
    assert _settings({}).device_ids == "auto"
    assert _settings({"device_ids": True}).device_ids is True and _settings({"device_ids": False}).device_ids is False
    for key, bad in (("device_ids", "yes"), ("device_ids", 1), ("token_major", "true")):
        with pytest.raises(BadInput, match=key):
            _settings({key: bad})


def test_the_key_secret_stays_out_of_what_vllm_logs():
    """A step's metadata carries the engine's key secret to its workers; what vLLM logs of it (its repr, and the
    scheduler output's dump when the engine fails) never shows it."""
    from vllm.logging_utils.dump_input import prepare_object_to_dump
    from gpuxfer.integrations.vllm.connector import GpuxferConnectorMetadata
    secret = bytes(range(0x41, 0x51))
    meta = GpuxferConnectorMetadata(holds={"cmpl-1": (1.0, "0" * 24)}, secret=secret)
    for text in (repr(meta), prepare_object_to_dump(meta)):
        assert "cmpl-1" in text and secret.decode() not in text and secret.hex() not in text


def test_params_loaded_twice_never_read_freed_blocks(tmp_path):
    """Two decode requests with one prefill request's params (vLLM's ``n > 1`` hands each child the parent's
    ``kv_transfer_params``; a proxy may retry): the first load's done message frees the prefill's blocks, which
    then hold another request's KV. The second request must not load them and report success; it is computed
    locally."""
    import time
    model = write_model(str(tmp_path / "model"))
    with running({"P": dict(model_dir=model, block_size=16, extra=TM, env=ENV, num_blocks=64, max_model_len=1024),
                  "D": dict(model_dir=model, block_size=16, extra=TM, env=ENV, num_blocks=64, max_model_len=1024)}
                 ) as inst:
        P, D = inst["P"], inst["D"]
        a = [("a", 100, 11)]
        pa = prefill(P, a)
        assert_loaded(decode(D, a, pa))
        assert_idle(P)                                      # the done message freed a's blocks
        P.call("set_lease", 1.0)
        prefill(P, [("f1", 900, 12)])                       # reuses the 63 free blocks, a's among them
        time.sleep(1.5)
        assert_idle(P)
        P.call("set_lease", 120.0)
        res = D.run("decode", [("d-a-again", 100, 11, pa["a"])])
        v = res["d-a-again"]
        assert v.get("finished") == "length", v
        assert v.get("load") != "ok", v                     # no load reported good over freed blocks
        assert_idle(D)


def test_a_pushed_out_lease_or_released_params_never_read_reused_blocks(tmp_path):
    """Params whose ``lease_deadline`` a client pushed past the prefill's lease: the prefill freed the blocks when
    its lease ran out and another request's KV is in them now. The decode must not load them and report success
    (the params' seal does not cover that deadline); the good request beside it loads. Then params first handed
    over with a prompt that leaves nothing to load (the decode releases them: the prefill frees the blocks, which
    are reused), and then with their prompt: that load must not read the freed blocks either."""
    import time
    model = write_model(str(tmp_path / "model"))
    with running({"P": dict(model_dir=model, block_size=16, extra=TM, env=ENV, num_blocks=64, max_model_len=1024),
                  "D": dict(model_dir=model, block_size=16, extra=TM, env=ENV, num_blocks=64, max_model_len=1024)}
                 ) as inst:
        P, D = inst["P"], inst["D"]
        P.call("set_lease", 1.0)
        pa = prefill(P, [("a", 100, 21)])
        time.sleep(1.5)
        assert_idle(P)                                      # a's lease ran out: its blocks are free
        prefill(P, [("f1", 900, 22)])                       # reuses the 63 free blocks, a's among them
        time.sleep(1.5)
        assert_idle(P)
        P.call("set_lease", 120.0)
        pg = prefill(P, [("g", 100, 23)])
        forged = dict(pa["a"], lease_deadline=pa["a"]["lease_deadline"] + 3600)
        res = D.run("decode", [("d-a", 100, 21, forged), ("d-g", 100, 23, pg["g"])])
        assert res["d-a"].get("finished") == "length", res
        assert res["d-a"].get("load") == "failed", res     # never reported good over another request's KV
        assert_loaded({"d-g": res["d-g"]})
        assert_idle(D)
        assert_idle(P)
        pb = prefill(P, [("b", 100, 24)])
        res = D.run("decode", [("d-b-short", 1, 24, pb["b"])])
        assert res["d-b-short"].get("finished") == "length" and "load" not in res["d-b-short"], res
        assert_idle(P)                                      # released: b's blocks are free
        prefill(P, [("f2", 900, 25)])                       # and reused
        res = D.run("decode", [("d-b", 100, 24, pb["b"])])
        assert res["d-b"].get("finished") == "length", res
        assert res["d-b"].get("load") != "ok", res
        assert_idle(D)


def test_params_handed_to_two_decode_instances_load_on_one_alone(tmp_path):
    """Genuine params handed to two decode instances (a proxy's retry or failover resends the request with the same
    ``kv_transfer_params``): the prefill grants the request to the first instance's claim and refuses the other's,
    so a read of blocks another instance's done or release let the prefill free is never reported good.

    * D1 loads ``a`` (its done frees a's blocks, which P then reuses); D2 gets the same params: its claim is refused
      and it computes the prompt itself.
    * D2 gets ``b``'s params with a one-token prompt, leaving nothing to load: its release frees b's blocks (no claim
      came first), which P reuses; D1's load of ``b`` is refused then.
    * Both get ``c``'s params at once: exactly one loads (every byte right), the other computes the prompt; the
      prefill frees c's blocks once, on the loader's done."""
    import time
    model = write_model(str(tmp_path / "model"))
    kw = dict(model_dir=model, block_size=16, extra=TM, env=ENV, num_blocks=64, max_model_len=1024)
    with running({"P": kw, "D1": kw, "D2": kw}) as inst:
        P, D1, D2 = inst["P"], inst["D1"], inst["D2"]

        def reuse(seed: int) -> None:           # P's free blocks (those just let go of among them) take other KV
            P.call("set_lease", 1.0)
            prefill(P, [(f"f{seed}", 900, seed)])
            time.sleep(1.5)
            assert_idle(P)
            P.call("set_lease", 120.0)

        pa = prefill(P, [("a", 100, 31)])
        assert_loaded(decode(D1, [("a", 100, 31)], pa))
        assert_idle(P)                                      # D1's done freed a's blocks
        reuse(32)
        res = D2.run("decode", [("d-a", 100, 31, pa["a"])])["d-a"]
        assert res.get("finished") == "length" and res.get("load") == "failed", res
        assert_idle(D2)

        pb = prefill(P, [("b", 100, 33)])
        res = D2.run("decode", [("d-b-short", 1, 33, pb["b"])])["d-b-short"]
        assert res.get("finished") == "length" and "load" not in res, res
        assert_idle(P)                                      # D2's release freed b's blocks
        reuse(34)
        res = D1.run("decode", [("d-b", 100, 33, pb["b"])])["d-b"]
        assert res.get("finished") == "length" and res.get("load") == "failed", res
        assert_idle(D1)

        pc = prefill(P, [("c", 300, 35)])
        D1.call("submit", "decode", [("d-c", 300, 35, pc["c"])])
        r2 = D2.run("decode", [("d-c", 300, 35, pc["c"])])["d-c"]
        assert_idle(D1)
        r1 = D1.call("results", ["d-c"])["d-c"]
        for v in (r1, r2):
            assert v.get("finished") == "length" and v.get("bad", 0) == 0, (r1, r2)
        assert sorted([r1.get("load"), r2.get("load")]) == ["failed", "ok"], (r1, r2)
        s = assert_idle(P)["stats"]
        assert s.get("claims_refused", 0) >= 2 and s.get("claims_granted", 0) >= 2, s
        assert_idle(D2)
