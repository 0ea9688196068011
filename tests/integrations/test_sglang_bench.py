"""scripts/sglang_backend_bench.py at tiny sizes on the host emulation: it runs SGLang's prefill queue and the
direct KVAgent push end to end, checks every byte, writes its JSON and exits 0; bad options exit 2.

Skipped without SGLang, unless GPUXFER_REQUIRE_SGLANG=1 (CI's SGLang step).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from _requires import require

require("sglang", "GPUXFER_REQUIRE_SGLANG", "sglang==0.5.23")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "sglang_backend_bench.py")


def _run(*args, timeout=600):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, SGLANG_HOST_IP="127.0.0.1"))


def test_bench_runs_tiny_and_checks_every_byte(tmp_path):
    out = tmp_path / "bench.json"
    p = _run("--platform", "host", "--tokens", "300", "--page-size", "16", "--layers", "1", "--chunk-tokens", "100",
             "--repeats", "2", "--cpus", "none", "--trace", "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "# PASS" in p.stdout, p.stdout
    res = json.loads(out.read_text())
    assert res["wrong_bytes"] == 0 and res["failed"] == [], res["requests"]
    assert [r["warm_up"] for r in res["requests"]] == [True, False, False]
    assert res["pages"] == 19 and res["exit_codes"] == [0, 0]
    for r in res["requests"]:
        assert r["status"] == r["prefill_status"] == "Success", r
        assert len(r["send_s"]) == 3, r                 # one KVSender.send per 100-token prefill chunk
        assert r["checked_bytes"] > 0 and r["request_s"] > 0 and r["direct"]["total_s"] > 0, r
        # --trace: the metadata rows went into the decode's host memory before the last push, none on the socket
        assert "row_write" in r["trace_us"] and "row_from_agent" in r["trace_us"], r["trace_us"]
        assert "_send_aux" not in r["trace_us"] and "row_from_message" not in r["trace_us"], r["trace_us"]
        assert "end_by_word" in r["trace_us"], r["trace_us"]        # the decode ended it by its word
    assert set(res["summary"]) >= {"send_us", "request_minus_direct_us", "direct_ms_p90", "request_ms_p90"}
    assert set(res["verdicts"]) == {"send_us", "request_minus_direct_us", "request_minus_direct_minus_handover_us"}
    # the same-run reference: SGLang's fake backend's hand-over of the same requests, taken off request - direct
    fake = res["fake"]
    assert fake["exit_code"] == 0 and [r["warm_up"] for r in fake["requests"]] == [True, False, False], fake
    for r in fake["requests"]:
        assert r["ok"] and len(r["send_s"]) == 3 and 0 < r["floor_s"] < r["request_s"], r
        assert r["handover_s"] == r["request_s"] - r["floor_s"], r
    s = res["summary"]
    assert s["sglang_handover_us_p50"] > 0 and s["request_minus_direct_minus_handover_us"] is not None, s
    assert abs(s["request_minus_direct_minus_handover_us_p50"] + s["sglang_handover_us_p50"]
               - s["request_minus_direct_us_p50"]) < 1e-6 * max(1.0, abs(s["request_minus_direct_us_p50"])), s
    assert "# fake (SGLang's built-in fake backend" in p.stdout, p.stdout


def test_bench_refuses_bad_options(tmp_path):
    existing = tmp_path / "exists.json"
    existing.write_text("{}")
    assert _run("--json", str(existing), timeout=120).returncode == 2
    assert _run("--tokens", "0", "--json", str(tmp_path / "x.json"), timeout=120).returncode == 2
    assert _run("--backend", "mooncake", "--platform", "cuda", "--json", str(tmp_path / "m.json"),
                timeout=120).returncode == 2
    assert _run("--backend", "mooncake", "--platform", "host", "--trace", "--json", str(tmp_path / "t.json"),
                timeout=120).returncode == 2


def test_bench_runs_the_mooncake_reference_tiny(tmp_path):
    """``--backend mooncake``: SGLang's Mooncake backend over TCP in the same harness, every byte checked, no
    direct push (its columns and the request-minus-direct verdict are empty, not zero)."""
    import importlib.util
    from gpuxfer import config
    if importlib.util.find_spec("mooncake") is None:
        if config.get("GPUXFER_TEST_REQUIRE_MOONCAKE"):
            raise AssertionError("GPUXFER_TEST_REQUIRE_MOONCAKE=1 but Mooncake is not installed")
        import pytest
        pytest.skip("Mooncake is not installed (pip install --no-deps mooncake-transfer-engine-non-cuda)")
    out = tmp_path / "mooncake.json"
    p = _run("--platform", "host", "--backend", "mooncake", "--tokens", "300", "--page-size", "16", "--layers", "1",
             "--chunk-tokens", "100", "--repeats", "2", "--cpus", "none", "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "# PASS" in p.stdout and "backend mooncake (TCP)" in p.stdout, p.stdout
    res = json.loads(out.read_text())
    assert res["wrong_bytes"] == 0 and res["failed"] == [] and res["exit_codes"] == [0, 0], res["requests"]
    for r in res["requests"]:
        assert r["status"] == r["prefill_status"] == "Success" and r["direct"] is None, r
        assert r["checked_bytes"] > 0 and r["request_s"] > 0 and len(r["send_s"]) == 3, r
    assert res["summary"]["request_minus_direct_us"] is None and res["verdicts"]["request_minus_direct_us"] == "n/a"
    assert res["fake"] is None                  # (the fake reference is run beside gpuxfer's backend)
