"""GpuxferConnector with tensor parallelism against vLLM 0.33's real Scheduler: instances of two ranks
(tests/integrations/vllm_instance.py, ``tp=2``: one worker-side connector per rank, each with its own caches
holding its half of the KV heads, their outputs combined by vLLM's ``KVOutputAggregator``). Decode rank i reads
prefill rank i's shard; a decode of twice the prefill's TP size reads half a prefill rank's heads per rank, and one
of half the prefill's reads two prefill ranks into its heads; every loaded byte of every rank is checked.
"""
from __future__ import annotations

import time

import pytest

from _requires import require

require("vllm", "GPUXFER_REQUIRE_VLLM", "vllm==0.33.0")

from vllm_instance import (assert_failed, assert_idle, assert_loaded, decode, free_port,  # noqa: E402
                           lease_runs_out, prefill, resealed, running, write_model)

ENV = {"GPUXFER_PLATFORM": "host", "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "VLLM_LOGGING_LEVEL": "WARNING"}
TM = {"token_major": True}


@pytest.fixture(scope="module")
def inst(tmp_path_factory):
    """P2 (TP=2, 32-token blocks) read by D2 (TP=2, 16-token blocks); P1 and D1 (TP=1); DX (TP=1, 16-token
    blocks, described as not token-major, so P1 cannot pair with it). Four KV heads: two per rank under TP=2."""
    model = write_model(str(tmp_path_factory.mktemp("model")), num_key_value_heads=4)
    specs = {"P2": (32, 2, TM), "D2": (16, 2, TM), "P1": (32, 1, TM), "D1": (16, 1, TM),
             "DX": (16, 1, {"token_major": False})}
    with running({name: dict(model_dir=model, block_size=bs, tp=tp, extra=extra, env=ENV)
                  for name, (bs, tp, extra) in specs.items()}) as out:
        yield out


def test_tp2_many_concurrent_requests_land_on_both_ranks(inst):
    P, D = inst["P2"], inst["D2"]
    assert P.info["heads"] == D.info["heads"] == [2, 2] and inst["D1"].info["heads"] == [4]
    D.call("stats", True)
    reqs = [(f"c{i}", 30 + 37 * i, 1000 + i) for i in range(48)]
    params = prefill(P, reqs)
    p0 = next(iter(params.values()))
    assert p0["tp_size"] == 2 and len(p0["remote_endpoints"]) == 2
    assert p0["remote_endpoints"][0] != p0["remote_endpoints"][1]
    res = decode(D, reqs, params)
    assert_loaded(res)
    s = assert_idle(P)
    # each rank of the prefill let go of each request on its own decode rank's word, none by its lease
    assert s["stats"]["sends_done"] >= 2 * len(reqs) and s["stats"].get("leases_expired", 0) == 0
    d = D.call("stats")
    assert d["requests"] == 0 and d["free"] == D.info["free"]
    st = d["stats"]
    assert st["handshakes"] == 2 and st["failed"] == 0           # one handshake per rank
    assert st["transfers"] == 2 * len(reqs)                        # each request read by both ranks
    assert not [m for m in D.call("logs") if "fail" in m]


def _refused(P, D, reqs, want: list[str]) -> None:
    """Loads of ``P``'s requests on ``D`` fail, the reason logged on ``D``; ``P`` frees the blocks (released by
    the rank that refused it, at a short lease where no rank reached it), and both end holding nothing."""
    D.call("logs")
    P.call("set_lease", 3.0)
    try:
        params = prefill(P, reqs)
        t0 = time.monotonic()
        res = decode(D, reqs, params, timeout=60)
        assert time.monotonic() - t0 < 30
        assert_failed(D, res)
        logs = D.call("logs")
        for w in want:
            assert any(w in m for m in logs), (w, logs)
        assert_idle(D)
        assert_idle(P, timeout=30)
    finally:
        P.call("set_lease", 120.0)


def test_decode_of_half_the_prefills_tp_reads_both_ranks_into_its_heads(inst):
    """P2's ranks hold two of four heads each; D1's one rank reads both (prefill rank j into its heads 2j and
    2j + 1, a view of its own blocks' pieces), reported once both reads ended; each prefill rank frees the request
    on its own done word."""
    P, D = inst["P2"], inst["D1"]
    before = P.call("stats")["stats"]
    D.call("stats", True)
    reqs = [(f"m{i}", 45 + 37 * i, 2000 + i) for i in range(12)]
    assert_loaded(decode(D, reqs, prefill(P, reqs)))
    s = assert_idle(P)["stats"]
    assert s["sends_done"] == before.get("sends_done", 0) + 2 * len(reqs)        # both prefill ranks
    assert s.get("leases_expired", 0) == before.get("leases_expired", 0)
    st = D.call("stats")["stats"]
    assert st["handshakes"] == 2 and st["transfers"] == 2 * len(reqs) and st["failed"] == 0
    assert_idle(D)


def _prefill_rank_one_unreachable(P, D, reqs) -> None:
    """Load ``reqs`` of ``P`` (TP 2) on ``D`` with the params pointing prefill rank 1 at a port nobody listens on
    (sealed again, as genuine params of a rank that went away): the loads fail (vLLM computes the prompts) while rank
    1 still holds the blocks; rank 0 frees them on its done word, rank 1 at its lease (10 s here)."""
    before = P.call("stats")["stats"]
    P.call("set_lease", 10.0)           # long enough for rank 0's read, short enough to wait for
    try:
        params = prefill(P, reqs)
        nobody = free_port()
        for r, p in params.items():
            p["remote_endpoints"][1] = ["127.0.0.1", nobody]
            params[r] = resealed(P, p)
        assert_failed(D, decode(D, reqs, params, timeout=60))
        assert P.call("stats")["free"] < P.info["free"]           # rank 1 still holds them
        s = assert_idle(P, timeout=60)["stats"]
    finally:
        P.call("set_lease", 120.0)
    assert s["sends_done"] == before.get("sends_done", 0) + len(reqs)              # rank 0's
    assert s["leases_expired"] == before.get("leases_expired", 0) + len(reqs)      # rank 1's
    assert_idle(D)


def test_a_decode_whose_read_from_one_of_two_prefill_ranks_fails_recomputes_after_both_ended(inst):
    """D1 reads P2's rank 0 and cannot reach rank 1: the load fails (vLLM recomputes it) once rank 0's read ended
    too."""
    _prefill_rank_one_unreachable(inst["P2"], inst["D1"], [(f"k{i}", 120 + i, 7500 + i) for i in range(3)])


def test_decode_of_twice_the_prefills_tp_reads_half_its_heads_per_rank(inst):
    """P1 holds four heads per block; each rank of D2 reads its two of them (rank i: heads 2i and 2i + 1, one
    piece each) from P1's one rank. P1 frees a request once both decode ranks said they read it."""
    P, D = inst["P1"], inst["D2"]
    before = P.call("stats")["stats"]
    D.call("stats", True)
    reqs = [(f"h{i}", 40 + 29 * i, 4000 + i) for i in range(16)]
    params = prefill(P, reqs)
    assert all(p["tp_size"] == 1 for p in params.values())
    assert_loaded(decode(D, reqs, params))
    s = assert_idle(P)["stats"]
    assert s["sends_done"] == before.get("sends_done", 0) + len(reqs)          # one let-go per request, after both ranks
    assert s["leases_expired"] == before.get("leases_expired", 0)
    assert P.call("stats")["unheld"] == [0]         # the second rank's word ended it, the first's did not
    st = D.call("stats")["stats"]
    assert st["handshakes"] == 2 and st["transfers"] == 2 * len(reqs) and st["failed"] == 0
    assert_idle(D)


def test_decode_ranks_holding_replicas_of_a_head_read_that_head(tmp_path_factory):
    """Two KV heads: a prefill of TP 1 holds both; a decode of TP 4 gives each rank one head, ranks 0 and 1 head
    0, ranks 2 and 3 head 1 (vLLM's replicas). Each rank reads its head of the prefill's two, every byte checked;
    the prefill frees a request once all four ranks said they read it."""
    model = write_model(str(tmp_path_factory.mktemp("model2")), num_key_value_heads=2)
    with running({"P": dict(model_dir=model, block_size=32, tp=1, extra=TM, env=ENV),
                  "D": dict(model_dir=model, block_size=32, tp=4, extra=TM, env=ENV)}) as out:
        P, D = out["P"], out["D"]
        assert P.info["heads"] == [2] and D.info["heads"] == [1, 1, 1, 1]
        reqs = [(f"v{i}", 50 + 41 * i, 4500 + i) for i in range(6)]
        params = prefill(P, reqs)
        assert_loaded(decode(D, reqs, params))
        s = assert_idle(P)["stats"]
        assert s["sends_done"] == len(reqs) and s.get("leases_expired", 0) == 0
        assert P.call("stats")["unheld"] == [0]
        st = D.call("stats")["stats"]
        assert st["handshakes"] == 4 and st["transfers"] == 4 * len(reqs) and st["failed"] == 0


def test_a_refused_handshake_releases_the_blocks_at_once(inst):
    """The prefill's rank answers and the decode refuses it (blocks of other sizes that are not token-major):
    the decode releases the requests on its side channel, so the prefill frees them now, not at their lease
    (120 s here)."""
    P, D = inst["P1"], inst["DX"]
    before = P.call("stats")["stats"]
    reqs = [(f"q{i}", 100 + i, 3500 + i) for i in range(3)]
    params = prefill(P, reqs)
    assert_failed(D, decode(D, reqs, params, timeout=60))
    s = assert_idle(P, timeout=20)["stats"]
    assert s["sends_done"] == before.get("sends_done", 0) + len(reqs)
    assert s["leases_expired"] == before.get("leases_expired", 0)
    assert_idle(D)


def test_a_load_failing_on_one_rank_fails_the_request_and_the_prefill_waits_for_every_rank(inst):
    """Rank 1 of the decode cannot reach its prefill rank: rank 0 reads its shard and says so, rank 1 fails.
    vLLM's aggregation fails the request (rank 1's load errors), and the prefill frees the blocks only once its
    rank 1 lets go of them too: at its lease."""
    _prefill_rank_one_unreachable(inst["P2"], inst["D2"], [(f"o{i}", 120 + i, 7000 + i) for i in range(3)])


def test_tp2_decode_abort_releases_both_prefill_ranks(inst):
    P, D = inst["P2"], inst["D2"]
    expired = P.call("stats")["stats"].get("leases_expired", 0)
    reqs = [(f"b{i}", 200 + i, 5000 + i) for i in range(6)]
    params = prefill(P, reqs)
    states = D.call("submit_abort", "decode", [(f"d-{r}", n, s, params[r]) for r, n, s in reqs])
    assert "WAITING_FOR_REMOTE_KVS" in states.values(), states
    assert_idle(D)
    s = assert_idle(P)          # read or released by each rank, not left to the lease
    assert s["stats"].get("leases_expired", 0) == expired


def test_tp2_lease_expiry(inst):
    lease_runs_out(inst["P2"], inst["D2"], [(f"l{i}", 150, 6000 + i) for i in range(2)], ranks=2)


def test_the_worker_reads_its_rank_from_vllms_tensor_parallel_group():
    """The rank and size of vLLM's group; without a group, rank 0 of an engine of one rank and a typed error
    for more; a group that disagrees with the config is refused."""
    from gpuxfer.errors import BadInput
    from gpuxfer.integrations.vllm.connector import tensor_parallel_rank
    from vllm_instance import _as_rank
    assert tensor_parallel_rank(1) == (0, 1)
    with pytest.raises(BadInput, match="tensor parallel group is not made"):
        tensor_parallel_rank(2)
    with _as_rank(1, 2):
        assert tensor_parallel_rank(2) == (1, 2)
        with pytest.raises(BadInput, match="rank 1 of 2; the engine's config says TP=4"):
            tensor_parallel_rank(4)


def test_the_scheduler_side_takes_every_ranks_side_channel(caplog):
    """``set_xfer_handshake_metadata``: the endpoints by rank; with a rank missing (or metadata of another rank
    under its key) none, logged, and a finished request is then not held."""
    import types
    from gpuxfer.integrations.vllm.connector import GpuxferConnector, GpuxferHandshakeMetadata as M
    from gpuxfer.integrations.vllm.scheduler import SchedulerSide
    me = types.SimpleNamespace(tp_size=2, engine_id="P", _scheduler=SchedulerSide(engine_id="P", block_sizes=[16],
                                                                                  lease_s=60, endpoints=None))
    GpuxferConnector.set_xfer_handshake_metadata(me, {1: M("P", "h1", 6002, 1), 0: M("P", "h0", 6001, 0)})
    assert me._scheduler.endpoints == [("h0", 6001), ("h1", 6002)]
    for bad in ({0: M("P", "h0", 6001, 0)}, {0: M("P", "h0", 6001, 0), 1: M("P", "h1", 6002, 0)}):
        GpuxferConnector.set_xfer_handshake_metadata(me, bad)
        assert me._scheduler.endpoints is None
    assert any("not each of the 2 tensor parallel ranks" in m for m in caplog.messages)
    req = types.SimpleNamespace(request_id="r", kv_transfer_params={"do_remote_decode": True},
                                status=types.SimpleNamespace(name="FINISHED_LENGTH_CAPPED"))
    assert me._scheduler.request_finished(req, ([1, 2],)) == (False, None)


@pytest.mark.parametrize("sizes,says", [(dict(pipeline_parallel_size=2), "PP=2"),
                                         (dict(decode_context_parallel_size=2), "DCP=2"),
                                         (dict(prefill_context_parallel_size=2), "PCP=2")])
def test_pipeline_and_context_parallelism_are_refused(sizes, says):
    """Context parallelism spreads a block's tokens over the ranks: refused with pipeline parallelism."""
    import types
    from gpuxfer.errors import BadInput
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from gpuxfer.integrations.vllm.connector import GpuxferConnector
    par = dict(tensor_parallel_size=2, pipeline_parallel_size=1, decode_context_parallel_size=1,
               prefill_context_parallel_size=1)
    cfg = types.SimpleNamespace(kv_transfer_config=object(), parallel_config=types.SimpleNamespace(**{**par, **sizes}))
    with pytest.raises(BadInput, match=says):
        GpuxferConnector(cfg, KVConnectorRole.SCHEDULER, object())


@pytest.mark.parametrize("p_tp,d_tp", [(2, 2), (1, 2), (2, 1)])
def test_tp_over_nixl_from_a_host_on_another_clock(tmp_path_factory, p_tp, d_tp):
    """Every decode rank reads through NIXL (each rank's own NIXL agent) from a prefill whose lease clock is 5000 s
    behind: TP 2 from TP 2 (rank to rank), TP 2 from TP 1 (each decode rank its two of the prefill's four heads, a
    view of the peer's pieces in NIXL's descriptors) or TP 1 from TP 2 (each prefill rank's two heads into two of
    the decode's four, a view of the decode's own pieces)."""
    from test_vllm_nixl import BASE, _need_nixl
    _need_nixl()
    model = write_model(str(tmp_path_factory.mktemp("model")), num_key_value_heads=4)
    specs = {"NP": dict(block_size=32, tp=p_tp, env=dict(BASE, GPUXFER_VLLM_TEST_CLOCK_SHIFT_S="-5000")),
             "ND": dict(block_size=16, tp=d_tp, env=BASE)}
    with running({n: dict(kw, model_dir=model, extra=TM, num_blocks=1024) for n, kw in specs.items()}) as i:
        P, D = i["NP"], i["ND"]
        reqs = [(f"x{k}", 40 + 61 * k, 9000 + k) for k in range(16)]
        assert_loaded(decode(D, reqs, prefill(P, reqs)))
        s = assert_idle(P)
        assert s["stats"]["sends_done"] >= p_tp * len(reqs) and s["stats"].get("leases_expired", 0) == 0
        d = D.call("stats")
        assert d["routes"] == {"nixl"} and d["stats"]["handshakes"] == 2 and d["stats"]["transfers"] == 2 * len(reqs)


def _connector_info(host, spec, heads_slots: int, tp: tuple[int, int]):
    """The engine description of a worker-side GpuxferConnector (TP 1 as vLLM made it, then described as rank
    ``tp`` of its size) over one LBHNC layer of ``heads_slots`` head slots per block, its group's spec ``spec``."""
    import types
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from gpuxfer.integrations.vllm.connector import GpuxferConnector
    cfg = types.SimpleNamespace(
        kv_transfer_config=types.SimpleNamespace(engine_id=f"e{tp[0]}",
                                                 kv_connector_extra_config={"engine": "copy_engine"}),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                                              decode_context_parallel_size=1, prefill_context_parallel_size=1),
        device_config=types.SimpleNamespace(device_type="cpu"),
        model_config=types.SimpleNamespace(model="m", dtype="bfloat16"),
        cache_config=types.SimpleNamespace(cache_dtype="nvfp4"))
    kcc = types.SimpleNamespace(kv_cache_groups=[types.SimpleNamespace(kv_cache_spec=spec, layer_names=["l0"])],
                                kv_cache_layout="LBHNC")
    c = GpuxferConnector(cfg, KVConnectorRole.WORKER, kcc)
    c._worker.platform = host
    cache = torch.zeros(8, heads_slots, 16, 64, dtype=torch.uint8)
    try:
        c.register_kv_caches({"l0": cache})
        return dict(c._worker.info, tp_rank=tp[0], tp_size=tp[1])
    finally:
        c._worker.close()


def test_head_slots_that_are_not_kv_heads_are_not_split_between_decode_ranks(host):
    """vLLM's FlashInfer NVFP4 cache publishes 2 x num_kv_heads head slots per block: every K head's slot, then
    every V head's (``num_head_slots``). A decode rank of twice the prefill's TP size cannot read its heads as a
    range of the prefill rank's slots (rank 1 would get slots 4..7: the V of all four heads, written over its K
    and V), so the handshake refuses it; with one slot per KV head the share is read as before."""
    import dataclasses
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from gpuxfer.errors import LayoutMismatch
    from gpuxfer.integrations.vllm.handshake import check_compatible

    def spec(heads, nvfp4=False):
        s = FullAttentionSpec(block_size=16, num_kv_heads=heads, head_size=64, dtype=torch.bfloat16)
        # what FlashInferBackend.customize_spec makes of an NVFP4 cache (flashinfer is not installed here)
        return dataclasses.replace(s, num_head_slots=2 * heads, state_content_bytes=64) if nvfp4 else s
    nvfp4 = dict(nvfp4=True)
    prefill = _connector_info(host, spec(4, **nvfp4), 8, (0, 1))
    decode = _connector_info(host, spec(2, **nvfp4), 4, (1, 2))
    with pytest.raises(LayoutMismatch, match="slots"):
        check_compatible(decode, prefill)
    plain_p = _connector_info(host, spec(4), 4, (0, 1))
    plain_d = _connector_info(host, spec(2), 2, (1, 2))
    assert check_compatible(plain_d, plain_p).remote == {0: (2, 4)}
