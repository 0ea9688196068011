"""scripts/vllm_claim_latency.py runs end to end on the CPU (no vLLM needed): both engine modes answered, its
JSON written, a bad destination refused before any run."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "vllm_claim_latency.py")


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120, env=env)


def test_every_claim_answered_and_the_rows_written(tmp_path):
    out = tmp_path / "claims.json"
    p = _run("--claims", "3", "--step-ms", "5", "--json", str(out))
    assert p.returncode == 0, p.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["sleep", "busy"]
    assert all(r["claims"] == 3 and 0 < r["p50_ms"] <= r["p90_ms"] <= r["max_ms"] for r in rows), rows


def test_a_json_destination_that_cannot_be_written_is_a_usage_error():
    p = _run("--claims", "1", "--json", "/proc/gpuxfer-no-such-dir/o.json")
    assert p.returncode == 2 and "cannot write in /proc/gpuxfer-no-such-dir" in p.stderr, (p.returncode, p.stderr)
