"""``gpuxfer bench pp`` and ``examples/pp_two_stage.py`` on the host emulation (tiny sizes, labelled as such).

Not timed tests: they check the benchmark runs end to end, verifies bytes, reports in the
documented shape, fails with a non-zero exit on a wrong byte, and that the example matches
its one-device run.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

from gpuxfer.bench.pp.measures import count_wrong_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def _cli(capsys, *args):
    """``gpuxfer bench pp --platform host ARGS`` in this process (it spawns its own two ranks, with timeouts)."""
    from gpuxfer.cli import main
    scratch = None
    if "--out" not in args:         # a run directory nobody reads: removed after the run
        scratch = tempfile.mkdtemp(prefix="gpuxfer-pp-test-")
        args = (*args, "--out", scratch)
    try:
        rc = main(["bench", "pp", "--platform", "host", "--timeout", "180", *args])
    except SystemExit as exc:
        rc = exc.code
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
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
             "--json", str(out), "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "run" / "pp_bench.json").read_bytes() == out.read_bytes()
    assert os.stat(out).st_mode & 0o777 == 0o644
    text = r.stdout
    assert "EMULATION" in text.splitlines()[0]
    assert "(us)" in text and "(GB/s)" in text and "wrong" in text and "the median of 2 loop(s)" in text
    assert "# Out of bounds values : 0 OK" in text and "# Result: PASS (EMULATION)" in text
    assert "SM contention" in text and "bulk peer copy" in text
    assert "# CPUs: rank 0 on CPU" in text or "# CPUs: ranks not pinned" in text
    long = [ln for ln in text.splitlines() if len(ln) > (120 if ln.startswith("# ") and ln[2] != " " else 240)]
    assert not long, f"{len(long)} report lines too long, the longest {max(map(len, long))}: {long[0][:120]}"
    doc = json.loads(out.read_text())
    assert doc["emulation"] is True and doc["result"] == "PASS" and doc["wrong_bytes"] == 0
    assert doc["targets"] and all(t["met"] is None for t in doc["targets"])   # not judged on the emulation
    sizes = doc["params"]["sizes_bytes"]
    assert sizes == [16384, 32768, 65536]
    configs = {(r["backend"], r["metadata"]) for r in doc["rows"]}
    assert configs == {("copy_engine", True), ("copy_engine", False), ("nccl", True), ("nccl", False),
                       ("copy_engine_graph", False), ("nccl_plain", False)}
    for row in doc["rows"]:
        assert set(row) >= {"size_bytes", "time_us", "algbw_gbps", "wrong_bytes", "iters", "send_host_us",
                            "recv_host_us"}
        assert row["time_us"] > 0 and row["wrong_bytes"] == 0
        assert row["repeats"] == 2 and row["time_us_min"] <= row["time_us"] <= row["time_us_max"]
        assert 0 < row["send_host_us"] and 0 < row["recv_host_us"] <= row["time_us"] * 1.01
        if row["backend"] != "copy_engine_graph":     # each end's own host time, paced (graph: replays only)
            assert row["send_host_paced_us"] > 0 and row["recv_host_paced_us"] > 0
            for side in ("send", "recv"):   # the paced loop's spread: 10th <= median <= 90th percentile step
                lo, mid, hi = (row[f"{side}_host_paced{q}_us"] for q in ("_p10", "", "_p90"))
                assert 0 < lo <= mid <= hi
    assert any(t["target"].startswith("copy_engine eager host time") for t in doc["targets"])
    assert "neither end waits for the other" in text
    assert {"alone_tflops", "nccl_tflops", "copy_engine_tflops", "copy_engine_loss_pct",
            "copy_engine_transfer_gbps", "nccl_transfer_gbps"} <= set(doc["contention"])
    con = doc["contention"]     # copy_engine again, its steps paced to the rate plain nccl moved: no faster
    assert {"copy_engine_at_nccl_rate_loss_pct", "copy_engine_at_nccl_rate_steps"} <= set(con)
    assert con["paced_to"] == "nccl_plain"
    n = con["copy_engine_at_nccl_rate_steps"]      # n steps started >= (n - 1) intervals apart
    assert con["copy_engine_at_nccl_rate_transfer_gbps"] <= con["nccl_plain_transfer_gbps"] * n / (n - 1) * 1.02, con
    assert "next to copy_engine_at_nccl_rate" in text and "at nccl's rate loses" in text
    by_rank = con["loss_pct_by_rank"]           # the worse rank's line, both ranks' losses beside it
    assert con["copy_engine_loss_pct"] == by_rank["copy_engine"][con["rank"]] == max(by_rank["copy_engine"])
    assert "loss by rank 0 / 1" in text
    assert "host time per step" in text and "moving" in text
    assert [b["size_bytes"] for b in doc["bulk_copy"]] == sizes
    assert all(b["repeats"] == 5 and b["algbw_gbps_min"] <= b["algbw_gbps"] <= b["algbw_gbps_max"]
               for b in doc["bulk_copy"])
    # the one-way latency of every backend at 1 B-64 KiB, every round trip's bytes checked
    pings = {(p["backend"], p["size_bytes"]) for p in doc["pingpong"]}
    assert pings == {(b, s) for b in ("copy_engine", "copy_engine_graph", "nccl", "nccl_plain")
                     for s in (1, 64, 1024, 4096, 16384, 65536)}
    assert all(p["wrong_bytes"] == 0 and p["one_way_us"] > 0 and p["host_us_per_round_trip_rank1"] > 0
               for p in doc["pingpong"])
    assert "one-way step latency" in text and "at equal traffic" in text and "time / nccl_plain time" in text
    assert "copy_engine_at_nccl_rate_worst_rank" in con


def test_bench_pp_fails_on_a_wrong_byte(capsys):
    r = _cli(capsys, "--max-size", "16K", "--iters", "2", "--warmup", "1", "--no-contention", "--backends", "copy_engine",
             "--corrupt-for-test")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAILED" in r.stdout and "FAIL: wrong bytes" in r.stdout


@pytest.mark.parametrize("argv, message", [
    (["--backends", "bogus"], "--backend: unknown backend 'bogus'"),
    (["--backend", ""], "--backend: give at least one"),
    (["--repeats", "-1"], "--repeats: must be >= 1"),
    (["--inline-bytes", "lots"], "--inline-bytes"),
    (["--platform", "tpu"], "--platform: unknown platform 'tpu'"),
    (["--recv-slots", "0"], "--recv-slots: must be >= 2"),
    (["--cpus", "0"], "--cpus: 2 ranks need 2 CPU sets"),
    (["--iters", "-1"], "--iters: must be >= 1"),
    (["--warmup", "-3"], "--warmup: must be >= 0"),
    (["--timeout", "0"], "--timeout: must be a positive number of seconds"),
    (["--contention-ms", "nan"], "--contention-ms"),
    (["--max-size", "1K", "--min-size", "4K"], "--min-size <= --max-size"),
    (["--out", "/proc/gpuxfer-no-such-dir"], "--out: cannot write in"),
    (["--json", "/proc/gpuxfer-no-such-dir/pp.json"], "--json: directory /proc/gpuxfer-no-such-dir does not exist"),
    (["--json", "/proc/pp.json"], "--json: cannot write in"),
])
def test_bench_pp_bad_arguments(capsys, tmp_path, argv, message):
    """Checked in the parent before a rank starts: one line on stderr, exit 2, nothing written."""
    r = _cli(capsys, *argv) if "--out" in argv else _cli(capsys, *argv, "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert r.stderr.startswith("gpuxfer bench pp: error: ") and r.stderr.count("\n") == 1 and r.stdout == ""
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("max_size", ["1T", "4096T"])
def test_bench_pp_max_size_past_the_free_memory(capsys, tmp_path, max_size):
    """A largest step whose buffers cannot fit the free memory is a --max-size error in the parent (exit 2),
    not a rank's allocation failure."""
    r = _cli(capsys, "--max-size", max_size, "--out", str(tmp_path / "o"))
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("gpuxfer bench pp: error: --max-size ") and "B free" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and r.stdout == "" and not (tmp_path / "o").exists()


def test_pp_room_two_devices_checks_each_rank(monkeypatch):
    """Two devices: the sender's device holds one buffer of the largest step, the receiver's two."""
    import argparse

    from gpuxfer.errors import BadInput
    from gpuxfer.bench.pp import cli as B
    infos = [argparse.Namespace(index=i, name=f"d{i}", free_bytes=f) for i, f in enumerate((100, 150))]
    monkeypatch.setattr("gpuxfer.platforms.platform_class", lambda name: argparse.Namespace(host_memory=False))
    monkeypatch.setattr(B, "device_infos", lambda name, devices: [infos[d] for d in devices])
    B._check_room("cuda", 75, 2)
    with pytest.raises(BadInput, match="--max-size 80 B: the run needs 160 B on device 1"):
        B._check_room("cuda", 80, 2)
    with pytest.raises(BadInput, match="--max-size 40 B: the run needs 120 B on device 0"):
        B._check_room("cuda", 40, 1)
    B._check_room("cuda", 60, 1, rank=0)        # under torchrun: each rank its own need on its device
    with pytest.raises(BadInput, match="--max-size 60 B: the run needs 120 B on device 0"):
        B._check_room("cuda", 60, 1, rank=1)
    with pytest.raises(BadInput, match="--max-size 80 B: the run needs 160 B on device 1"):
        B._check_room("cuda", 80, 2, rank=1)


def test_bench_pp_platform_rocm_without_rocm_is_one_line(capsys, tmp_path, monkeypatch):
    from gpuxfer.platforms import unavailable_reason
    if unavailable_reason("rocm") is None:
        pytest.skip("ROCm is usable here")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    r = _cli(capsys, "--platform", "rocm")
    assert r.returncode == 2 and r.stderr.startswith("gpuxfer bench pp: error: --platform: rocm cannot run here")
    assert list(tmp_path.iterdir()) == []          # the tests' scratch run directory is not left behind


def test_one_device_leaves_nccl_out_and_the_targets_do_not_apply(monkeypatch):
    """One GPU: NCCL is not started for two ranks on it (it refuses them), and the report says the pair
    shares a device, the targets marked not applicable (checked on the parent's options and the report)."""
    import argparse

    from gpuxfer.cli import build_parser
    from gpuxfer.errors import BadInput
    from gpuxfer.bench.pp import cli as B
    monkeypatch.setattr(B, "platform_option", lambda text: "cuda")
    monkeypatch.setattr(B, "device_count", lambda name: 1)
    monkeypatch.setattr("gpuxfer.platforms.platform_class", lambda name: argparse.Namespace(
        is_emulation=False, collective_backend="nccl", host_memory=False))
    monkeypatch.setattr(B, "device_infos", lambda name, devices: [argparse.Namespace(free_bytes=None)] * len(devices))
    args = build_parser().parse_args(["bench", "pp", "--inline-bytes", "1M"])
    opts = B._options(args)
    assert opts["backends"] == ["copy_engine", "copy_engine_graph"] and opts["same_device"]
    assert "NCCL refuses two ranks on one device" in opts["notes"][0] and "nccl_plain" in opts["notes"][0]
    with pytest.raises(BadInput, match="--backend nccl: both ranks share device 0"):
        B._options(build_parser().parse_args(["bench", "pp", "--backend", "nccl"]))
    dev = {"name": "GPU", "arch": "x", "pci_bus_id": "0", "sm_count": 1, "copy_engines": 1, "stream_mem_ops_64": True}
    info = {"rank": 1, "device": 0, "device_info": dev, "host": "h", "label": "cuda", "emulation": False,
            "versions": {}, "link": {"src": 0, "dst": 0, "kind": "same-device", "detail": ""}}
    res = {"info": info, "sender_info": dict(info, rank=0), "rows": [], "bulk": [], "contention": {},
           "flag_paths": {}, "meta_channels": {}, "result": "PASS",
           "targets": [("copy_engine >= 97% of the bulk peer-copy rate at >= 64 MiB", "worst 50.0%", False)]}
    res["same_device"] = B._same_device(res)
    text = B.format_report(res, dict(opts, inline_bytes=1 << 20))
    assert "both ranks share device 0" in text and "do not apply" in text
    assert "n/a (one device)" in text and "MISSED" not in text


@pytest.mark.slow      # tests/test_examples.py runs the same example by default, as a user does
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
                        "--contention-ms", "200", "--json", str(out), "--out", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=600,
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
    from gpuxfer.bench.pp.report import _targets

    def row(backend, us, instrumented=None):
        return {"backend": backend, "metadata": False, "size_bytes": 16384, "time_us": us, "algbw_gbps": 1.0,
                "instrumented": instrumented}
    res = {"rows": [row("copy_engine", 10.0), row("nccl", 100.0)], "bulk": [], "contention": {}}
    assert _targets(res, ["copy_engine", "nccl"])[0][2] is True
    res["rows"][0] = row("copy_engine", 90.0, "cProfile")          # a profiled row alone would miss the target
    assert _targets(res, ["copy_engine", "nccl"]) == []


def test_host_target_from_the_paced_rows():
    """The eager host target: copy_engine without metadata at 16 KiB-1 MiB, each side's paced host time."""
    from gpuxfer.bench.pp import HOST_TARGET
    from gpuxfer.bench.pp.report import _host_target

    def row(size, snd, rcv, metadata=False, backend="copy_engine", p90=None):
        return {"backend": backend, "metadata": metadata, "size_bytes": size, "send_host_paced_us": snd,
                "recv_host_paced_us": rcv, "send_host_paced_p90_us": p90 and p90[0],
                "recv_host_paced_p90_us": p90 and p90[1]}
    res = {"rows": [row(16384, 6.0, 4.0, p90=(7.0, 6.0)), row(1 << 20, 8.0, 5.0, p90=(9.5, 6.5)),
                    row(4 << 20, 30.0, 30.0), row(16384, 40.0, 40.0, metadata=True),
                    row(16384, 50.0, 50.0, backend="nccl")]}
    assert _host_target(res) == (HOST_TARGET, "worst sender 8.0 us (p90 9.5), receiver (copies out, the default) "
                                              "5.0 us (p90 6.5)", True)
    assert "receiver (views of the slot, --recv-views) 5.0 us" in _host_target(res, recv_views=True)[1]
    res["rows"].append(row(65536, 7.0, 6.0, p90=(8.0, 10.5)))        # medians inside, a p90 outside: missed
    assert _host_target(res)[2] is False
    res["rows"][-1] = row(65536, 7.0, 11.0)                           # no p90 in the row: its median judged
    assert _host_target(res)[2] is False
    assert _host_target({"rows": [row(16384, 1.0, 1.0, metadata=True)]}) is None


def test_targets_against_plain_nccl_and_pingpong():
    """Ratios are taken against plain torch.distributed where it was measured (+meta rows against its only,
    metadata-free, row); the graph column has its own ratio; ping-pong rows give the latency target."""
    from gpuxfer.bench.pp.report import _targets

    def row(backend, us, metadata=False, size=16384):
        return {"backend": backend, "metadata": metadata, "size_bytes": size, "time_us": us, "algbw_gbps": 1.0}
    res = {"rows": [row("copy_engine", 10.0), row("copy_engine", 40.0, True), row("copy_engine_graph", 5.0),
                    row("nccl", 200.0), row("nccl_plain", 60.0)],
           "bulk": [], "contention": {},
           "pingpong": [{"backend": "copy_engine", "size_bytes": 64, "one_way_us": 8.0},
                        {"backend": "copy_engine", "size_bytes": 1 << 20, "one_way_us": 99.0},
                        {"backend": "copy_engine_graph", "size_bytes": 64, "one_way_us": 12.0}]}
    got = {name: (measured, met) for name, measured, met in _targets(res, ["copy_engine", "copy_engine_graph",
                                                                          "nccl", "nccl_plain"])}
    assert got["copy_engine step time <= 1/3 of nccl_plain's at <= 1 MiB (without metadata)"] == (
        "worst ratio 0.17", True)
    assert got["copy_engine step time <= 1/3 of nccl_plain's at <= 1 MiB (with metadata)"] == ("worst ratio 0.67", False)
    assert got["copy_engine_graph step time <= 1/3 of nccl_plain's at <= 1 MiB (without metadata)"][1] is True
    assert got["copy_engine one-way step latency <= 10 us at <= 64 KiB (ping-pong)"] == ("worst 8.0 us", True)
    assert got["copy_engine_graph one-way step latency <= 10 us at <= 64 KiB (ping-pong)"][1] is False
