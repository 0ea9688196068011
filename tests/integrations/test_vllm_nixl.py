"""GpuxferConnector across hosts: the decode instance reads through the agent's NIXL route (real NIXL 1.5.1, UCX
over loopback) instead of mapping the prefill's memory, with vLLM 0.33's real Scheduler in spawned processes on
the host emulation (tests/integrations/vllm_instance.py), every loaded byte checked.

One machine stands in for two hosts: ``GPUXFER_KV_ROUTE=nixl`` sends every peer through NIXL, and the prefill's
lease clock is shifted by ``GPUXFER_VLLM_TEST_CLOCK_SHIFT_S`` (two hosts' monotonic clocks share no origin), so a
decode instance that compared the prefill's deadlines with its own clock as they are would get every verdict
wrong: shifted ahead, no lease would ever run out for it; shifted back, every read would count as too late.

Without NIXL these tests skip with the reason, unless GPUXFER_TEST_REQUIRE_NIXL=1 (CI's vLLM step), where they
fail; without vLLM they skip unless GPUXFER_REQUIRE_VLLM=1.
"""
from __future__ import annotations


import pytest

from _requires import require

require("vllm", "GPUXFER_REQUIRE_VLLM", "vllm==0.33.0")

from gpuxfer import config  # noqa: E402
from vllm_instance import (assert_idle, assert_loaded, decode, free_port, lease_runs_out, prefill,  # noqa: E402
                           prefill_dies, running, write_model)

BASE = {"GPUXFER_PLATFORM": "host", "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "VLLM_LOGGING_LEVEL": "WARNING", "UCX_NET_DEVICES": "lo", "GPUXFER_KV_REMOTE": "nixl",
        "GPUXFER_KV_ROUTE": "nixl"}
TM = {"token_major": True}
SHIFT = {"P": "-5000", "Q": "5000"}         # the prefill hosts' clocks: behind and ahead of the decode's


def _nixl_reason() -> str | None:
    from gpuxfer.kv.nixl_route import nixl_reason
    from gpuxfer.platforms.host import HostPlatform
    return nixl_reason(HostPlatform)


def _need_nixl() -> None:
    why = _nixl_reason()
    if why is not None:
        if config.get("GPUXFER_TEST_REQUIRE_NIXL"):
            pytest.fail(f"GPUXFER_TEST_REQUIRE_NIXL=1 but the NIXL route cannot run: {why}")
        pytest.skip(why)


@pytest.fixture(scope="module")
def inst(tmp_path_factory):
    """Two prefill instances with 64-token blocks on clocks 5000 s behind (P) and ahead (Q) of the decode
    instance D (32-token blocks: ratio 2), all with NIXL agents and every peer on the NIXL route."""
    _need_nixl()
    model = write_model(str(tmp_path_factory.mktemp("model")))
    with running({name: dict(model_dir=model, block_size=bs, extra=TM, num_blocks=1024,
                             env=dict(BASE, GPUXFER_VLLM_TEST_CLOCK_SHIFT_S=SHIFT.get(name, "0")))
                  for name, bs in (("P", 64), ("Q", 64), ("D", 32))}) as out:
        yield out


@pytest.mark.parametrize("name", ["P", "Q"])
def test_reads_over_nixl_from_a_host_on_another_clock(inst, name):
    P, D = inst[name], inst["D"]
    reqs = [(f"{name}{i}", 40 + 97 * i, 11000 + 100 * (name == "Q") + i) for i in range(16)]
    params = prefill(P, reqs)
    assert_loaded(decode(D, reqs, params))
    s = assert_idle(P)
    assert s["stats"]["sends_done"] >= 16 and s["stats"].get("leases_expired", 0) == 0
    st = D.call("stats")
    assert st["free"] == D.info["free"] and st["stats"]["failed"] == 0
    assert st["routes"] == {"nixl"}, st["routes"]            # the reads went through NIXL, not IPC


@pytest.mark.parametrize("name", ["P", "Q"])
def test_a_lease_that_ran_out_on_the_prefill_host_fails_the_load(inst, name):
    lease_runs_out(inst[name], inst["D"], [(f"e{name}{i}", 150, 12000 + i) for i in range(2)])


def test_dead_prefill_over_nixl_reports_load_errors(inst):
    prefill_dies(inst["Q"], inst["D"], [(f"k{i}", 160, 13000 + i) for i in range(3)])


def test_vllms_own_nixl_connector_runs_in_the_same_harness(tmp_path):
    """The baseline ``scripts/vllm_connector_bench.py --connector nixl`` measures: vLLM's NixlConnector on the same
    instances, caches and loads, every byte checked."""
    _need_nixl()
    model = write_model(str(tmp_path))
    env = {k: v for k, v in BASE.items() if not k.startswith("GPUXFER_KV")}
    with running({name: dict(model_dir=model, block_size=64, num_blocks=512, connector="nixl",
                             env=dict(env, VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port())))
                  for name in ("NP", "ND")}) as out:
        reqs = [(f"v{i}", 100 + 37 * i, 14000 + i) for i in range(4)]
        assert_loaded(decode(out["ND"], reqs, prefill(out["NP"], reqs)))
