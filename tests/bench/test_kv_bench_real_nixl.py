"""The benchmark's NIXL engines and the CollectiveX suite's ``--cross-host`` mode against real NIXL on the host
emulation (two spawned ranks, UCX over loopback), every byte verified.

Without NIXL these skip with the reason, unless ``GPUXFER_TEST_REQUIRE_NIXL=1`` (CI's NIXL step), where they
fail. Both are long (marked ``slow``; CI's NIXL step runs them): the host emulation verifies every byte in
Triton's interpreter, on two shared cores; the timeouts are hang guards.
"""
from __future__ import annotations

import json

import pytest

from gpuxfer import config
from gpuxfer.cli import main

TINY = ["--platform", "host", "--workload", "kv-mla", "--isl", "16", "--page", "16", "--batch", "1",
        "--warmup", "0", "--trials", "1", "--timeout", "300"]


@pytest.fixture
def real_nixl(monkeypatch):
    from gpuxfer.bench.kv.engines.nixl import _NixlEngineBase
    from gpuxfer.platforms.host import HostPlatform
    why = _NixlEngineBase.unavailable_reason(HostPlatform)
    if why is not None:
        if config.get("GPUXFER_TEST_REQUIRE_NIXL"):
            pytest.fail(f"GPUXFER_TEST_REQUIRE_NIXL=1 but NIXL cannot run: {why}")
        pytest.skip(why)
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.delenv("GPUXFER_NIXL_MODULE", raising=False)
    monkeypatch.delenv("GPUXFER_INJECT_FAULT", raising=False)


@pytest.mark.slow
@pytest.mark.timeout(1800)     # a hang guard: each row verifies in Triton's interpreter
def test_nixl_engines_against_real_nixl(real_nixl, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["bench", "kv", *TINY, "--engine", "nixl,nixl-oneshot,nixl-bulk", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    doc = json.loads((out / "kv_bench.json").read_text())
    rows = doc["rows"]
    assert {(r["engine"], r["direction"]) for r in rows} == {(e, d) for e in ("nixl", "nixl-oneshot", "nixl-bulk")
                                                             for d in ("pull", "push")}
    for r in rows:
        assert r["valid"] and r["wrong_bytes"] == 0 and r["verified"], r
        assert r["nixl_module"].startswith("nixl_cu"), r      # the real wheel, not a fake


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_collectivex_cross_host_against_real_nixl(real_nixl, tmp_path, capsys):
    """--cross-host: NIXL reaches the peer's pool itself (no IPC mapping); nixl-bulk is the ceiling there."""
    out = tmp_path / "out"
    rc = main(["bench", "kv", "--suite", "collectivex", "--platform", "host", "--cross-host",
               "--engine", "nixl,nixl-bulk", "--isl", "16", "--page", "16", "--batch", "1",
               "--direction", "pull", "--timeout", "300", "--out", str(out)])
    assert rc == 0, capsys.readouterr().out
    own = json.loads((out / "kv_bench.json").read_text())
    assert {(r["engine"], r["kind"]) for r in own["rows"]} == {("nixl-bulk", "ceiling"), ("nixl", "paged"),
                                                              ("nixl-bulk", "bulk"), ("nixl", "bulk")}
    assert all(r["valid"] for r in own["rows"])
    doc = json.loads((out / "collectivex_nixl.json").read_text())
    assert doc["outcome"]["status"] == "success"
    assert [r["kind"] for r in doc["measurement"]["rows"]] == ["paged", "bulk"]
