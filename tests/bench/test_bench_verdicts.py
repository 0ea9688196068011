"""The benchmarks' verdicts: what must fail a run (and exit non-zero) besides a wrong byte.

* a run that measured no row is not a pass (a vacuous "every byte verified");
* a row faster than its ceiling is only a pass when the ceiling's own spread explains it (the row is at most
  the ceiling's fastest sample), in ``bench kv``, ``bench pp`` and ``bench kernels``;
* percentiles by nearest rank take the ceil(q * n)-th smallest sample;
* a bad option value is a one-line error, never silently dropped.
"""
from __future__ import annotations

import json

import pytest

from gpuxfer.bench import report as BR
from gpuxfer.bench.kv import report as R
from gpuxfer.cli import main

TINY = ["--platform", "host", "--workload", "kv-mla", "--isl", "16", "--page", "16", "--batch", "1",
        "--warmup", "0", "--trials", "1", "--timeout", "60"]


def _row(engine="triton", ms=(1.0, 2.0, 3.0)):
    row = {"workload": "kv-mla", "page_tokens": 16, "isl_tokens": 16, "batch": 1, "engine": engine,
           "direction": "pull", "burst_bytes": 2_000_000_000, "descriptors": 1000, "prep_ms": 1.0,
           "wrong_bytes": 0, "valid": True, "verified": True, "error": None}
    R.finish_row(row, [m / 1e3 for m in ms])
    return row


# ----------------------------------------------------------------------------- nothing measured


def test_an_empty_kv_outcome_is_not_a_pass():
    out = R.outcome([], [], expected_rows=0, complete=True)
    assert out["status"] == "fail" and any("no row was measured" in r for r in out["reasons"])


def test_a_complete_kv_run_missing_an_expected_row_is_not_a_pass():
    """The ranks said which rows they would measure; a complete run with fewer (a row skipped without an error,
    its bytes never verified) fails."""
    rows = [_row("bulk"), _row("triton")]
    assert R.outcome(rows, [], expected_rows=2)["status"] == "pass"
    out = R.outcome(rows, [], expected_rows=3)
    assert out["status"] == "fail" and "2 rows measured of the 3" in out["reasons"][0]


@pytest.mark.timeout(300)
def test_bench_kv_with_every_row_shed_fails(capsys, tmp_path):
    """Every burst over the copy-engine cap: the engine sheds each row, nothing is measured; the run says so
    and exits 1 instead of printing "PASS: every byte of every request verified"."""
    rc = main(["bench", "kv", *TINY, "--engine", "copy_engine-table", "--direction", "pull",
               "--copy-engine-max-descs", "1", "--out", str(tmp_path / "o")])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "# Result: FAIL: no row was measured" in out and "# PASS" not in out
    doc = json.loads((tmp_path / "o" / "kv_bench.json").read_text())
    assert doc["outcome"]["status"] == "fail" and doc["rows"] == []


# ----------------------------------------------------------------------------- above the ceiling


def test_ceiling_excess_is_explained_only_within_the_ceilings_spread():
    assert BR.ceiling_excess(90.0, 100.0, 110.0) is None
    assert BR.ceiling_excess(None, 100.0) is None and BR.ceiling_excess(90.0, None) is None
    explained, note = BR.ceiling_excess(105.0, 100.0, 110.0)
    assert explained and "105.0%" in note and "spread" in note
    explained, note = BR.ceiling_excess(120.0, 100.0, 110.0)
    assert not explained and "120.0%" in note and "fastest" in note
    assert BR.ceiling_excess(120.0, 100.0)[0] is False         # no spread known: nothing explains it
    explained, note = BR.ceiling_excess(120.0, 100.0, 110.0, judged=False)
    assert explained is None and "EMULATION" in note           # a shared CPU's times: noted, not judged


def test_a_kv_row_above_its_ceilings_fastest_burst_fails_the_run():
    bulk = _row("bulk", ms=(2.0, 2.0, 2.0))           # 1000 GB/s, fastest burst 1000 GB/s
    fast = _row("triton", ms=(1.0, 1.0, 1.0))         # 2000 GB/s: twice the ceiling
    R.apply_ceiling(bulk, bulk["p50_gbps"], bulk["max_gbps"])
    R.apply_ceiling(fast, bulk["p50_gbps"], bulk["max_gbps"])
    assert fast["of_ceiling_pct"] == pytest.approx(200.0)
    assert fast["above_ceiling_explained"] is False and "200.0%" in fast["above_ceiling"]
    out = R.outcome([bulk, fast], [], expected_rows=2)
    assert out["status"] == "fail" and any("triton" in r and "200.0%" in r for r in out["reasons"])
    assert "ABOVE CEILING" in R.format_row(fast)
    # within the ceiling's spread (its fastest burst): reported, not failed
    spread = _row("bulk", ms=(1.0, 2.0, 3.0))          # p50 1000, fastest 2000 GB/s
    near = _row("triton", ms=(1.9, 1.9, 1.9))
    R.apply_ceiling(near, spread["p50_gbps"], spread["max_gbps"])
    assert near["above_ceiling_explained"] is True
    assert R.outcome([spread, near], [], expected_rows=2)["status"] == "pass"
    assert bulk.get("above_ceiling") is None
    # on the host emulation (one trial of a shared CPU by default) it is noted, not judged
    R.apply_ceiling(fast, bulk["p50_gbps"], bulk["max_gbps"], judged=False)
    assert fast["above_ceiling_explained"] is None and "EMULATION" in fast["above_ceiling"]
    assert R.outcome([bulk, fast], [], expected_rows=2)["status"] == "pass"


def _scaled_ranks(monkeypatch, factor: float):
    """``bench pp``'s ranks run for real; the receiver's copy_engine -meta rows then report ``factor`` times
    the bulk peer copy's fastest loop (a ceiling that is not one), and the ranks report no emulation (which is
    not judged: its times measure a shared CPU)."""
    import gpuxfer.spawn as S
    real = S.run_ranks

    def scaled(*a, **kw):
        both = real(*a, **kw)
        fastest = {b["size_bytes"]: b["algbw_gbps_max"] for b in both[0]["bulk"] or both[1]["bulk"]}
        for r in both[1]["rows"]:
            if r["backend"] == "copy_engine" and not r["metadata"] and r["size_bytes"] in fastest:
                r["algbw_gbps"] = factor * fastest[r["size_bytes"]]
        for b in both:
            b["info"]["emulation"] = False
        return both
    monkeypatch.setattr(S, "run_ranks", scaled)


@pytest.mark.timeout(300)
def test_bench_pp_row_above_the_bulk_ceilings_fastest_loop_fails(capsys, tmp_path, monkeypatch):
    _scaled_ranks(monkeypatch, 1.5)
    rc = main(["bench", "pp", "--platform", "host", "--timeout", "120", "--min-size", "1M", "--max-size", "1M",
               "--iters", "2", "--warmup", "0", "--no-contention", "--no-pingpong", "--backends", "copy_engine",
               "--out", str(tmp_path / "o")])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "within the ceiling loops spread" not in out
    assert "ABOVE the ceiling's fastest loop" in out and "# Result: FAIL: copy_engine -meta at 1 MiB" in out
    doc = json.loads((tmp_path / "o" / "pp_bench.json").read_text())
    assert doc["result"].startswith("FAIL") and doc["wrong_bytes"] == 0


def test_pp_ceiling_rows_explain_only_what_the_spread_covers():
    from gpuxfer.bench.pp.report import ceiling_rows
    res = {"bulk": [{"size_bytes": 1 << 20, "algbw_gbps": 100.0, "algbw_gbps_min": 95.0, "algbw_gbps_max": 104.0}],
           "rows": [{"backend": "copy_engine", "metadata": False, "size_bytes": 1 << 20, "algbw_gbps": g}
                    for g in (103.0,)]}
    ((size, pct, excess),) = ceiling_rows(res)
    assert size == 1 << 20 and pct == pytest.approx(103.0) and excess[0] is True
    res["rows"][0]["algbw_gbps"] = 105.0
    assert ceiling_rows(res)[0][2][0] is False
    res["info"] = {"emulation": True}
    assert ceiling_rows(res)[0][2][0] is None                   # the emulation: noted, not judged
    res["rows"][0]["algbw_gbps"] = 90.0
    assert ceiling_rows(res)[0][2] is None


@pytest.mark.timeout(300)
def test_bench_kernels_row_above_its_ceilings_fastest_run_fails(tmp_path, capsys, monkeypatch):
    """A kernel row timed faster than every run of its ceiling (hbm-copy for local) fails the run (judged as on
    a GPU: the emulation's times, of a shared CPU, are noted, not judged)."""
    import gpuxfer.bench.kernels as K
    from gpuxfer.platforms.host import HostPlatform
    monkeypatch.setattr(HostPlatform, "is_emulation", False)
    real = K.DeviceClock.time

    def fast_local(self, fn, what, warmup, trials):
        ts = real(self, fn, what, warmup, trials)
        return [1e-9] * len(ts) if what == "local" else ts
    monkeypatch.setattr(K.DeviceClock, "time", fast_local)
    monkeypatch.setenv("GPUXFER_PLATFORM", "host")
    out = tmp_path / "k.json"
    rc = main(["bench", "kernels", "--platform", "host", "--sizes", "528", "--pool", "8KiB", "--ops", "local",
               "--sweep", "", "--trials", "1", "--warmup", "0", "--json", str(out), "--out", str(tmp_path / "run")])
    text = capsys.readouterr().out
    assert rc == 1, text
    assert "ABOVE CEILING" in text and "# Result: FAIL: local 528 B:" in text
    doc = json.loads(out.read_text())
    (local,) = [r for r in doc["rows"] if r["op"] == "local"]
    assert doc["result"] == "FAIL" and local["above_ceiling_explained"] is False and local["wrong_bytes"] == 0


# ----------------------------------------------------------------------------- percentiles


def test_nearest_rank_takes_the_ceil_q_n_th_sample():
    assert BR.nearest_rank(list(range(10)), 0.9) == 8          # the 9th of 10, not the maximum
    assert BR.nearest_rank(list(range(20)), 0.9) == 17
    assert BR.nearest_rank([3.0, 1.0, 2.0], 0.9) == 3.0         # p90 of three runs: the slowest
    assert BR.nearest_rank([2.0, 1.0], 0.5) == 1.0
    assert BR.nearest_rank([1, 2, 3, 4], 0.0) == 1 and BR.nearest_rank([1, 2, 3, 4], 1.0) == 4
    assert BR.nearest_rank([], 0.9) is None


# ----------------------------------------------------------------------------- option values


def test_bench_kv_devices_with_three_indexes_is_an_error(capsys, tmp_path):
    rc = main(["bench", "kv", *TINY, "--engine", "bulk", "--devices", "0,1,0", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "--devices: give one or two device indexes" in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_bench_kernels_sweep_size_not_among_the_sizes_is_an_error(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("GPUXFER_PLATFORM", "host")
    rc = main(["bench", "kernels", "--platform", "host", "--sizes", "528", "--sweep", "1", "--sweep-size", "2304",
               "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "--sweep-size 2304 is not among --sizes" in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- the ping-pong's byte check


class _StaleLoopback:
    """A connection whose receiver hands back the bytes of the *first* step sent, whatever was sent since (a
    transport that stopped delivering, its slot still holding an earlier step)."""

    def __init__(self):
        self.first = {}         # per step size: its first step's bytes

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def sender(self):
        return self

    def receiver(self):
        return self

    def synchronize(self):
        return None

    def send(self, tensors):
        size = next(iter(tensors.values())).numel()
        self.first.setdefault(size, {k: v.clone() for k, v in tensors.items()})

    def recv(self, shapes=None, out=None):
        got = {k: v.clone() for k, v in self.first[shapes["x"][0]].items()}
        return type("Received", (), {"tensors": got})()


def test_pingpong_check_catches_a_transport_that_stopped_delivering(monkeypatch):
    """Each round trip carries other bytes than the one before it: a receiver left with an earlier step's
    bytes is a wrong byte, not a pass."""
    import torch.distributed as dist

    import gpuxfer.pp.selection as sel
    from gpuxfer.bench.pp import measures as M
    from gpuxfer.platforms import get_platform
    monkeypatch.setattr(sel, "connect", lambda **kw: _StaleLoopback())
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: None)
    plat = get_platform("host")
    try:
        rows = M._pingpong(plat, 0, plat.torch_device(0), 0,
                           {"backends": ["copy_engine"], "timeout": 10.0, "recv_slots": 2, "flag_path": None,
                            "inline_bytes": 0}, None)
    finally:
        plat.close()
    assert len(rows) == len(M.PING_SIZES) and all(r["wrong_bytes"] > 0 for r in rows), rows


# ----------------------------------------------------------------------------- bench kernels: what is verified


@pytest.mark.timeout(300)
@pytest.mark.parametrize("op", ["pack", "unpack"])
def test_bench_kernels_verifies_the_timed_runs_not_the_validation(tmp_path, capsys, monkeypatch, op):
    """pack and unpack are validated once by a checked call that moves the bytes too: the timed, unchecked
    calls must still be what the verifier sees (an unchecked path that writes nothing is wrong bytes)."""
    import gpuxfer.kernels.launch as launch
    real = getattr(launch, op)

    def checked_only(*a, validate=True, **kw):
        if validate:
            return real(*a, **kw)
        return None                 # the timed path: moves nothing
    monkeypatch.setattr(launch, op, checked_only)
    monkeypatch.setenv("GPUXFER_PLATFORM", "host")
    out = tmp_path / "k.json"
    rc = main(["bench", "kernels", "--platform", "host", "--sizes", "528", "--pool", "8KiB", "--ops", op,
               "--sweep", "", "--trials", "1", "--warmup", "0", "--json", str(out), "--out", str(tmp_path / "run")])
    text = capsys.readouterr().out
    assert rc == 1, text
    (row,) = [r for r in json.loads(out.read_text())["rows"] if r["op"] == op]
    assert row["wrong_bytes"] > 0


def test_pp_step_sources_never_repeat_at_a_turn_of_the_receive_slots():
    """``bench pp`` checks a step's bytes against the source it was sent: a slot left holding the step one or two
    turns of the receive slots earlier must hold other bytes (``--recv-slots 5`` with 3 verified steps did not)."""
    from gpuxfer.bench.pp.ranks import source_period
    for slots in range(2, 17):
        for nver in range(1, 9):
            period = source_period(nver, slots)
            assert period >= nver + 2 and slots % period and (2 * slots) % period, (slots, nver, period)


@pytest.mark.timeout(300)
def test_bench_pp_shows_progress_as_it_goes(capfd, tmp_path):
    """Each measured row is said on stderr when it is done (a GPU run takes minutes before its report)."""
    rc = main(["bench", "pp", "--platform", "host", "--timeout", "120", "--max-size", "32K", "--iters", "2",
               "--warmup", "0", "--no-contention", "--backends", "copy_engine", "--out", str(tmp_path / "o")])
    cap = capfd.readouterr()
    assert rc == 0, cap.out + cap.err
    for line in ("# pp progress: copy_engine -meta 16 KiB:", "# pp progress: copy_engine +meta 32 KiB:",
                 "# pp progress: the one-way latency ping-pong"):
        assert line in cap.err, cap.err
    assert "# pp progress" not in cap.out


def test_kv_notes_printed_in_the_table_are_in_the_json(tmp_path, capsys):
    """A ``# `` note the ranks send (e.g. what % of ceiling is of across hosts) is in the JSON document too."""
    rep = R.Reporter(out_dir=str(tmp_path), plots=False, argv=["gpuxfer", "bench", "kv"])
    rep.handle("start", {"env": {}, "params": {}, "shed": [], "expected_rows": 1})
    rep.handle("note", {"text": "cross-host mode: % of ceiling is of the nixl-bulk row"})
    rep.handle("row", _row("bulk"))
    rep.handle("done", {})
    assert rep.finish() == 0
    assert "# cross-host mode" in capsys.readouterr().out
    doc = json.loads((tmp_path / "kv_bench.json").read_text())
    assert doc["notes"] == ["cross-host mode: % of ceiling is of the nixl-bulk row"]


@pytest.mark.timeout(120)
def test_bench_kernels_pool_larger_than_the_memory_is_an_option_error(capsys, tmp_path, monkeypatch):
    """``--pool`` past the device's free memory: one line naming it, exit 2, before anything is allocated (the
    host emulation would otherwise fill a sparse terabyte for hours)."""
    monkeypatch.setenv("GPUXFER_PLATFORM", "host")
    rc = main(["bench", "kernels", "--platform", "host", "--pool", "1TiB", "--sizes", "528", "--ops", "local",
               "--sweep", "", "--out", str(tmp_path / "o")])
    cap = capsys.readouterr()
    assert rc == 2 and cap.err.startswith("gpuxfer bench kernels: error: --pool 1099511627776 B: the run needs"), cap.err
    assert not (tmp_path / "o").exists()
