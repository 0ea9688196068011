"""The NIXL engines over the fake NIXL: every byte moved in both directions, failures on one side, stuck
transfers, the shed cap, ``gpuxfer bench kv --cross-host`` over tests/fake_nixl_net.py, and hostile
descriptors refused by every library engine (Mooncake's too).
"""
from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from gpuxfer.errors import BackendUnavailable, TransferTimeout
from gpuxfer.bench.kv.engines import DescriptorBurst
from gpuxfer.bench.kv.engines import nixl as ne
from gpuxfer.kv import nixl_ffi as nf

from _nixl_engines import hostile_results, run_engine_pair


# --------------------------------------------------------------------------- the engines over a fake NIXL
#
# Both sides run in this process, one thread each, each with its own host platform and
# pool; Side.exchange is an all-gather over a barrier. The fake NIXL copies with memmove,
# so the bytes really move; the pack kernel is the reference copy (torch on the CPU).


@pytest.mark.parametrize("engine", ["nixl", "nixl-oneshot", "nixl+pack", "nixl-bulk"])
@pytest.mark.parametrize("direction", ["pull", "push"])
def test_engine_moves_every_byte_over_fake_nixl(fake_engines, engine, direction):
    engines, stats = run_engine_pair(engine, direction, stage_bytes=16 << 10 if engine == "nixl+pack" else None)
    calls = [c[1] for c in fake_engines.calls]
    op = "READ" if direction == "pull" else "WRITE"
    ops = {c[2] for c in fake_engines.calls if c[1] in ("make_prepped_xfer", "initialize_xfer")}
    assert ops == {op}
    if engine == "nixl-oneshot":
        assert "initialize_xfer" in calls and "make_prepped_xfer" not in calls
    else:
        assert "make_prepped_xfer" in calls and "initialize_xfer" not in calls
    if engine == "nixl":
        # one transfer per request, telemetry of the burst collected on release
        assert stats[-1]["nixl_transfers_per_burst"] == 3 and stats[-1]["nixl_descriptors_after_merge"] == 120
        assert stats[-1]["nixl_backend"] == "UCX" and stats[-1]["nixl_bursts"] == 3
        assert stats[-1]["nixl_post_us_p50"] == 9 and stats[-1]["nixl_xfer_us_p50"] == 7
    if engine in ("nixl+pack", "nixl-bulk"):
        # bulk descriptors only: one per round of nixl+pack (rounds of 16 KiB), one per burst of nixl-bulk
        assert {c[3] for c in fake_engines.calls if c[1] == "make_prepped_xfer"} == {1}
    # every handle and prepped list was released, registrations undone, peers removed
    assert calls.count("release_xfer_handle") == calls.count("make_prepped_xfer") + calls.count("initialize_xfer")
    assert calls.count("release_dlist_handle") == calls.count("prep_xfer_dlist")
    assert calls.count("deregister_memory") == calls.count("register_memory")
    assert calls.count("remove_remote_agent") == calls.count("add_remote_agent") == 2


def test_engine_setup_failure_on_one_side_fails_both(fake_engines, monkeypatch):
    """A side whose agent cannot start tells its peer through the exchange: both raise, naming it."""
    real = fake_engines.nixl_agent

    def picky(name, conf):
        if "-destination-" in name:
            raise RuntimeError("no UCX context on this side")
        return real(name, conf)
    monkeypatch.setattr(sys.modules["fake_nixl_for_tests"], "nixl_agent", picky)
    with pytest.raises(BackendUnavailable) as ei:
        run_engine_pair("nixl", "pull", bursts=0)
    assert "rank 1" in str(ei.value) and "no UCX context" in str(ei.value)


def test_stuck_engine_transfer_times_out(fake_engines):
    fake_engines.stuck = True
    with pytest.raises(TransferTimeout, match="nixl READ"):
        run_engine_pair("nixl", "pull", bursts=1, timeout_s=0.3)


def test_nixl_shed_cap(fake_engines, monkeypatch):
    monkeypatch.setenv("GPUXFER_NIXL_MAX_DESCS", "10")
    burst = DescriptorBurst([np.array([[0, 0, 8]] * 11, np.int64)])
    why = ne.NixlEngine.shed_reason(types.SimpleNamespace(name="nixl"), burst)
    assert "capped at 10" in why and "GPUXFER_NIXL_MAX_DESCS" in why
    assert ne.NixlEngine.shed_reason(types.SimpleNamespace(name="nixl"), DescriptorBurst([np.array([[0, 0, 8]])])) is None


# --------------------------------------------------------------------------- the benchmark across hosts, over the fake
#
# ``gpuxfer bench kv --cross-host`` on the host emulation: two spawned ranks, the peer pool never
# mapped by the runner; the NIXL engines run over tests/fake_nixl_net.py (tests/fake_nixl.py's FakeNixl,
# reaching the other process's registered memory itself, as a network transport would).

CROSS_TINY = ["bench", "kv", "--platform", "host", "--workload", "kv-mla", "--isl", "16", "--page", "16",
              "--batch", "1", "--warmup", "0", "--trials", "1", "--timeout", "60", "--cross-host"]


@pytest.fixture
def net_fake_nixl(monkeypatch, tmp_path):
    mail = tmp_path / "nixl-mail"
    mail.mkdir()
    monkeypatch.setenv(nf.NIXL_MODULE_ENV, "fake_nixl_net")    # the spawned ranks import it (tests/ on sys.path)
    monkeypatch.setenv("FAKE_NIXL_NET_DIR", str(mail))
    monkeypatch.delenv("GPUXFER_INJECT_FAULT", raising=False)


def _bench(capsys, tmp_path, *argv):
    import json
    import time
    from gpuxfer.cli import main
    out = tmp_path / "out"
    t0 = time.monotonic()
    rc = main([*CROSS_TINY, *argv, "--out", str(out)])
    assert time.monotonic() - t0 < 120
    cap = capsys.readouterr()
    path = out / "kv_bench.json"
    return rc, cap.out + cap.err, json.loads(path.read_text()) if path.exists() else None


@pytest.mark.slow      # 15-35 s each; test_bench_cross_host_verification_catches_a_wrong_byte runs by default
@pytest.mark.parametrize("engines", [("nixl", "nixl-oneshot", "nixl-bulk"), ("nixl+pack", "nixl-bulk")],
                         ids=["per-descriptor", "pack"])
def test_bench_cross_host_runs_the_nixl_engines_over_the_fake(net_fake_nixl, capsys, tmp_path, engines):
    rc, text, doc = _bench(capsys, tmp_path, "--engine", ",".join(("bulk", "triton") + engines))
    assert rc == 0, text
    assert doc["environment"]["cross_host"] is True and "# PASS" in text
    assert "% of ceiling is of the nixl-bulk row" in text
    shed = {s["engine"]: s["reason"] for s in doc["shed"] if "engine" in s}
    assert set(shed) == {"bulk", "triton"}
    assert all("needs the peer pool mapped over IPC; the ranks are on different hosts" in r for r in shed.values())
    rows = doc["rows"]
    assert {(r["engine"], r["direction"]) for r in rows} == {(e, d) for e in engines for d in ("pull", "push")}
    assert len(rows) == 2 * len(engines)
    for r in rows:
        assert r["error"] is None and r["verified"] and r["valid"] and r["wrong_bytes"] == 0, r
        assert r["burst_bytes"] == 61 * 9216
    for d in ("pull", "push"):
        ceiling = next(r for r in rows if r["engine"] == "nixl-bulk" and r["direction"] == d)
        assert ceiling["of_ceiling_pct"] == pytest.approx(100.0)
        for r in rows:
            if r["direction"] == d:
                assert r["ceiling_gbps"] == ceiling["p50_gbps"]
    for r in rows:
        if r["engine"] == "nixl":
            assert r["nixl_backend"] == "UCX" and r["nixl_descriptors_after_merge"] == 61


def test_bench_cross_host_verification_catches_a_wrong_byte(net_fake_nixl, capsys, tmp_path):
    """Verification is local to the destination across hosts too: an injected wrong byte fails the row.
    With no ceiling engine running, rows carry no % of ceiling."""
    rc, text, doc = _bench(capsys, tmp_path, "--engine", "nixl", "--direction", "push", "--inject-fault", "nixl")
    assert rc == 1, text
    (row,) = doc["rows"]
    assert row["fault_injected"] and not row["valid"] and row["wrong_bytes"] == 1
    assert row["ceiling_gbps"] is None and row["of_ceiling_pct"] is None
    assert "no ceiling engine runs" in text


# --------------------------------------------------------------------------- hostile descriptors


@pytest.mark.parametrize("engine", ["nixl", "nixl-oneshot", "nixl+pack", "nixl-bulk", "mooncake"])
def test_hostile_descriptors_are_refused_by_the_library_engines(fake_engines, fake_mooncake, engine):
    """Overflowing, negative, zero-size and out-of-range descriptors: BadInput naming the descriptor from
    prepare on both sides, before any library call moves a byte."""
    fake_mooncake()
    res = hostile_results(engine)
    assert res and all(v.startswith("BadInput: descriptor ") for v in res.values()), \
        {k: v for k, v in res.items() if not v.startswith("BadInput: descriptor ")}
    moves = [c for c in fake_engines.calls if c[1] in ("make_prepped_xfer", "initialize_xfer", "transfer")]
    assert not moves, moves
