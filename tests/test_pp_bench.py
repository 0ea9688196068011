"""``gpuxfer bench pp`` and ``examples/pp_two_stage.py`` on the host emulation (tiny sizes, labelled as such).

Not timed tests: they check the benchmark runs end to end, verifies bytes, reports in the
documented shape, fails with a non-zero exit on a wrong byte, and that the example matches
its one-device run.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from gpuxfer.pp.bench import count_wrong_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def _cli(capsys, *args):
    """``gpuxfer bench pp --platform host ARGS`` in this process (it spawns its own two ranks, with timeouts)."""
    from gpuxfer.cli import main
    try:
        rc = main(["bench", "pp", "--platform", "host", "--timeout", "180", *args])
    except SystemExit as exc:
        rc = exc.code
    out = capsys.readouterr()
    return _Result(rc, out.out, out.err)


def test_count_wrong_bytes_sees_corruption():
    a = {"x": torch.arange(64, dtype=torch.int32), "y": torch.zeros(3, dtype=torch.bfloat16)}
    b = {k: v.clone() for k, v in a.items()}
    assert count_wrong_bytes(b, a) == 0
    b["x"].view(torch.uint8)[5] ^= 1
    b["y"].view(torch.uint8)[0] ^= 0x80
    assert count_wrong_bytes(b, a) == 2
    assert count_wrong_bytes({"x": a["x"][:60]}, a) == 16 + 6     # 4 elements short, y missing


def test_bench_pp_host(tmp_path, capsys):
    out = tmp_path / "pp.json"
    r = _cli(capsys, "--max-size", "64K", "--iters", "4", "--warmup", "2", "--repeats", "2", "--contention-ms", "30",
             "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    text = r.stdout
    assert "EMULATION" in text.splitlines()[0]
    assert "(us)" in text and "(GB/s)" in text and "wrong" in text and "the median of 2 loop(s)" in text
    assert "# Out of bounds values : 0 OK" in text and "# Result: PASS (EMULATION)" in text
    assert "SM contention" in text and "bulk peer copy" in text
    doc = json.loads(out.read_text())
    assert doc["emulation"] is True and doc["result"] == "PASS" and doc["wrong_bytes"] == 0
    sizes = doc["params"]["sizes_bytes"]
    assert sizes == [16384, 32768, 65536]
    configs = {(r["backend"], r["metadata"]) for r in doc["rows"]}
    assert configs == {("copy_engine", True), ("copy_engine", False), ("nccl", True), ("nccl", False)}
    for row in doc["rows"]:
        assert set(row) >= {"size_bytes", "time_us", "algbw_gbps", "wrong_bytes", "iters", "send_host_us",
                            "recv_host_us"}
        assert row["time_us"] > 0 and row["wrong_bytes"] == 0
        assert row["repeats"] == 2 and row["time_us_min"] <= row["time_us"] <= row["time_us_max"]
        assert 0 < row["send_host_us"] and 0 < row["recv_host_us"] <= row["time_us"] * 1.01
    assert {"alone_tflops", "nccl_tflops", "copy_engine_tflops", "copy_engine_loss_pct",
            "copy_engine_transfer_gbps", "nccl_transfer_gbps"} <= set(doc["contention"])
    con = doc["contention"]     # copy_engine again, its steps paced to the rate nccl moved: no faster
    assert {"copy_engine_at_nccl_rate_loss_pct", "copy_engine_at_nccl_rate_steps"} <= set(con)
    n = con["copy_engine_at_nccl_rate_steps"]      # n steps started >= (n - 1) intervals apart
    assert con["copy_engine_at_nccl_rate_transfer_gbps"] <= con["nccl_transfer_gbps"] * n / (n - 1) * 1.02, con
    assert "next to copy_engine_at_nccl_rate" in text and "at nccl's rate loses" in text
    by_rank = con["loss_pct_by_rank"]           # the worse rank's line, both ranks' losses beside it
    assert con["copy_engine_loss_pct"] == by_rank["copy_engine"][con["rank"]] == max(by_rank["copy_engine"])
    assert "loss by rank 0 / 1" in text
    assert "host time per step" in text and "moving" in text
    assert [b["size_bytes"] for b in doc["bulk_copy"]] == sizes


def test_bench_pp_fails_on_a_wrong_byte(capsys):
    r = _cli(capsys, "--max-size", "16K", "--iters", "2", "--warmup", "1", "--no-contention", "--backends", "copy_engine",
             "--corrupt-for-test")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAILED" in r.stdout and "FAIL: wrong bytes" in r.stdout


def test_bench_pp_bad_arguments(capsys):
    r = _cli(capsys, "--backends", "bogus")
    assert r.returncode != 0 and "unknown backend" in (r.stdout + r.stderr)
    r = _cli(capsys, "--repeats", "-1")
    assert r.returncode != 0 and "--repeats" in (r.stdout + r.stderr)
    r = _cli(capsys, "--inline-bytes", "lots")
    assert r.returncode != 0 and "--inline-bytes" in (r.stdout + r.stderr)


def test_example_two_stage_host(capsys, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "examples"))    # children import the stage function
    import pp_two_stage
    assert pp_two_stage.main(["--platform", "host"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "DIFFERENT" not in out and "platform host" in out


@pytest.mark.gpu
def test_bench_pp_cuda_small(tmp_path):
    """CUDA, 2 GPUs: a short sweep, every byte checked (speed is reported, not asserted)."""
    from gpuxfer.platforms import unavailable_reason
    why = unavailable_reason("cuda")
    if why is not None:
        pytest.skip(f"cuda unavailable: {why}")
    out = tmp_path / "pp.json"
    env = dict(os.environ, GPUXFER_PLATFORM="cuda")
    r = subprocess.run([sys.executable, "-m", "gpuxfer", "bench", "pp", "--platform", "cuda", "--max-size", "8M",
                        "--contention-ms", "200", "--json", str(out)], capture_output=True, text=True, timeout=600,
                       env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    assert doc["wrong_bytes"] == 0 and doc["emulation"] is False


@pytest.mark.gpu
def test_example_two_stage_cuda():
    from gpuxfer.platforms import unavailable_reason
    why = unavailable_reason("cuda")
    if why is not None:
        pytest.skip(f"cuda unavailable: {why}")
    env = dict(os.environ, GPUXFER_PLATFORM="cuda")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "pp_two_stage.py")], capture_output=True,
                       text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_targets_leave_out_rows_timed_under_a_profiler():
    from gpuxfer.pp.bench import _targets

    def row(backend, us, instrumented=None):
        return {"backend": backend, "metadata": False, "size_bytes": 16384, "time_us": us, "algbw_gbps": 1.0,
                "instrumented": instrumented}
    res = {"rows": [row("copy_engine", 10.0), row("nccl", 100.0)], "bulk": [], "contention": {}}
    assert _targets(res, ["copy_engine", "nccl"])[0][2] is True
    res["rows"][0] = row("copy_engine", 90.0, "cProfile")          # a profiled row alone would miss the target
    assert _targets(res, ["copy_engine", "nccl"]) == []
