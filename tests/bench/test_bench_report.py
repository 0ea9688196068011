"""The benchmarks' shared reporter and clock (gpuxfer.bench.report, gpuxfer.bench.timing)."""
from __future__ import annotations

import json

import numpy as np

from gpuxfer.bench import report as R
from gpuxfer.bench import timing as T


def test_table_lines_up_headers_units_and_rows():
    t = R.Table([R.Column("op", "op", "", 6, left=True), R.Column("nbytes", "bytes", "(B)", 8, R.integer),
                 R.Column("gbps", "GB/s", "(GB/s)", 7, R.rate), R.Column("wrong_bytes", "wrong", "(B)", 6, R.integer)])
    head, units = t.header_lines()
    line = t.line({"op": "pull", "nbytes": 4096, "gbps": 12.3456, "wrong_bytes": 0})
    assert head.startswith("#") and units.startswith("#") and len(head) == len(units) == len(line)
    assert line.split() == ["pull", "4096", "12.35", "0"] and "(GB/s)" in units
    assert t.line({"op": "push"}).split() == ["push", "-", "-", "-"]          # a missing value is a dash
    assert R.Table(t.columns, prefix="").header_lines()[0][0] == "#"


def test_a_wrong_byte_fails_the_verdict_and_the_exit_code():
    good = R.Verdict(0, [], emulation=True)
    assert good.ok and good.exit_code == 0 and good.lines() == ["# Out of bounds values : 0 OK",
                                                                "# Result: PASS (EMULATION)"]
    bad = R.Verdict(3)
    assert not bad.ok and bad.exit_code == 1 and bad.result == "FAIL: wrong bytes"
    assert bad.lines()[0] == "# Out of bounds values : 3 FAILED"
    other = R.Verdict(0, ["rank 1 died\nTraceback (most recent call last): ..."])
    assert other.exit_code == 1 and other.lines()[1] == "# Result: FAIL: rank 1 died"   # one line per footer line


def test_json_is_strict_and_plain():
    doc = {"a_gbps": float("nan"), "b_us": np.float32(1.5), "n": np.int64(3), "t": (1, 2), "arr": np.arange(2),
           "inf_ms": float("inf"), "obj": object}
    back = json.loads(R.dumps(doc))
    assert back["a_gbps"] is None and back["inf_ms"] is None and back["b_us"] == 1.5 and back["n"] == 3
    assert back["t"] == [1, 2] and back["arr"] == [0, 1] and isinstance(back["obj"], str)


def test_sample_statistics():
    st = T.sample_stats([0.001, 0.003, 0.002])
    assert st["n"] == 3 and st["p50_ms"] == 2.0 and st["min_ms"] == 1.0 and st["max_ms"] == 3.0
    assert T.sample_stats([])["p50_ms"] is None
    assert T.gbps(2_000_000_000, 1000.0) == 2.0 and T.gbps(1, 0) is None and T.gbps(1, None) is None


def test_small_rates_and_percentages_keep_their_digits():
    """The emulation's rates (well under 1 MB/s) are not printed as 0.000 GB/s and 0.0 % of the ceiling."""
    from gpuxfer.bench.report import percent, rate
    assert rate(0.00041234) == "0.00041" and rate(0.0412) == "0.041" and rate(3.14159) == "3.142"
    assert rate(456.7) == "456.7" and rate(0) == "0.000" and rate(None) == "-" and rate(2e-8) == "2.0e-08"
    assert percent(0.0423) == "0.042" and percent(42.26) == "42.3" and percent(None) == "-"


def test_kv_parameters_never_say_more_minimum_trials_than_maximum():
    from gpuxfer.bench.kv.options import GridSpec
    from gpuxfer.bench.kv.runner import RunConfig
    from gpuxfer.bench.kv import engines as E
    cfg = RunConfig(grid=GridSpec((), None, (16,), (1,), 1, 1), grid_args=dict.fromkeys(
        ("workload", "page", "isl", "batch", "pool_budget", "desc_budget"), "x"), engines=("triton",),
        directions=("pull",), trials=1, warmup=0, seed=0, platform="host", out=None, json=False, timeout_s=1.0,
        engine_options=E.EngineOptions())
    p = cfg.params()
    assert (p["trials_max"], p["trials_min"]) == (1, 1)


def test_nearest_rank():
    from gpuxfer.bench.report import nearest_rank
    assert nearest_rank([], 0.9) is None
    assert nearest_rank([3, 1, 2], 0.5) == 2
    assert nearest_rank(list(range(10)), 0.9) == 8
    assert nearest_rank([5], 0.99) == 5
