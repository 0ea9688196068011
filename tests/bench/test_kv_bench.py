"""``gpuxfer bench kv``: the whole command end to end, its verifier, its errors, its artifacts.

CPU tests run the real command (two spawned processes, the host emulation, the
Triton kernels in the interpreter) at tiny sizes: ``kv-mla`` at 16 tokens is 61
descriptors of 9,216 bytes a request. GPU tests (marked ``gpu``) run a short
sweep on two GPUs, every engine, every byte verified.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuxfer.cli import main
from gpuxfer.bench.kv import report as R
from gpuxfer.errors import BadInput
from gpuxfer.flaglink import ENV_FLAG_PATH
from gpuxfer.bench.kv import engines as E
from gpuxfer.bench.kv.engines import pack as P

TINY = ["--platform", "host", "--workload", "kv-mla", "--isl", "16", "--page", "16", "--batch", "1"]
FAST = ["--warmup", "0", "--trials", "1", "--timeout", "60"]

#: keys every measured row of the JSON artifact carries (docs/kv_bench.md lists them)
ROW_KEYS = {"workload", "page_tokens", "isl_tokens", "batch", "engine", "direction", "initiator", "post",
            "burst_bytes", "descriptors", "request_bytes", "request_descriptors", "prep_ms", "arm_p50_ms",
            "warmup", "trials", "samples_ms", "burst_p50_ms", "burst_p10_ms", "burst_p90_ms", "burst_min_ms",
            "burst_max_ms", "p50_gbps", "min_gbps", "max_gbps", "ceiling_gbps", "of_ceiling_pct",
            "per_descriptor_p50_us", "wrong_bytes", "first_wrong_descriptor", "verified", "valid", "error",
            "initiator_cpus", "initiator_python_us"}
DOC_KEYS = {"schema", "generated_at", "command", "gbps_definition", "environment", "parameters", "rows", "shed",
            "summary", "outcome", "artifacts"}
SUMMARY_KEYS = {"workload", "isl_tokens", "page_tokens", "direction", "engine", "batch_min", "batch_min_gbps",
                "batch_min_of_ceiling_pct", "batch_max", "batch_max_gbps", "batch_max_of_ceiling_pct",
                "worst_of_ceiling_pct", "batch_min_per_descriptor_us", "all_valid"}


def _bench_kv(capsys, tmp_path, *argv) -> tuple[int, str, str, dict | None]:
    out_dir = tmp_path / "out"
    rc = main(["bench", "kv", *argv, "--out", str(out_dir)])
    cap = capsys.readouterr()
    doc = None
    path = out_dir / "kv_bench.json"
    if path.exists():
        doc = json.loads(path.read_text())
    return rc, cap.out, cap.err, doc


# ----------------------------------------------------------------------------- end to end (CPU)


def test_every_engine_both_directions_end_to_end(capsys, tmp_path):
    rc, out, err, doc = _bench_kv(capsys, tmp_path, *TINY, *FAST)
    assert rc == 0, out + err
    # the live table: preamble, header + units rows, a line per row, summary, PASS footer
    assert "EMULATION" in out and "# parameters:" in out and "# versions:" in out
    assert "GB/s" in out and "#wrong" in out and "tokens" in out
    assert "# CPUs: rank 0 on CPU" in out           # --cpus auto (the default): where each rank ran, and how
    assert "# summary" in out and "# PASS" in out
    # the artifact
    assert doc is not None and DOC_KEYS <= set(doc)
    assert doc["schema"] == R.SCHEMA
    assert doc["environment"]["is_emulation"] is True and "EMULATION" in doc["environment"]["platform_label"]
    assert doc["environment"]["launcher"] == "spawn"
    assert [d["role"].split()[0] for d in doc["environment"]["devices"]] == ["prefill", "decode"]
    assert doc["parameters"]["cpus"] == "auto" and len(doc["environment"]["cpus_by_rank"]) == 2
    rows = doc["rows"]
    engines = {r["engine"] for r in rows}
    assert engines == {"triton", "pack", "copy_engine", "bulk"}
    assert len(rows) == 8 and doc["outcome"]["rows_expected"] == 8
    for r in rows:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert r["valid"] and r["verified"] and r["wrong_bytes"] == 0 and r["error"] is None, r
        assert r["burst_bytes"] == 61 * 9216 and r["p50_gbps"] > 0
        assert r["post"] == "host"                   # the default: post -> complete, host enqueue included
        assert r["post_p50_us"] > 0 and r["setup_us"] > 0
        if r["engine"] != "bulk":                    # through the KV API: registration, setup per request
            assert r["api"] == "KVAgent" and r["register_ms"] > 0 and r["first_setup_us"] > 0
        assert r["initiator"] == ("decode" if r["direction"] == "pull" else "prefill")
        assert r["descriptors"] == (1 if r["engine"] == "bulk" else 61)
        assert r["ceiling_gbps"] is not None and r["of_ceiling_pct"] is not None
        if r["engine"] == "pack":       # the host's shared memory takes remote stream writes
            assert r["flag_path"] == "remote stream writes"
    assert {(r["direction"]) for r in rows} == {"pull", "push"}
    assert doc["outcome"]["status"] == "pass"
    for s in doc["summary"]:
        assert SUMMARY_KEYS <= set(s)
    # the plot
    plots = doc["artifacts"]["plots"]
    assert len(plots) == 1 and os.path.basename(plots[0]) == "kv_bench_kv-mla_isl16.png"
    with open(plots[0], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(plots[0]) > 10_000


def test_corrupted_transfer_fails_verification_and_exits_nonzero(capsys, tmp_path):
    rc, out, err, doc = _bench_kv(capsys, tmp_path, *TINY, *FAST, "--engine", "bulk,copy_engine", "--direction", "push",
                                  "--inject-fault", "copy_engine:push")
    assert rc == 1, out + err
    assert "INVALID" in out and "# FAIL" in out
    rows = {r["engine"]: r for r in doc["rows"]}
    assert rows["bulk"]["valid"] and rows["bulk"]["wrong_bytes"] == 0 and not rows["bulk"]["fault_injected"]
    bad = rows["copy_engine"]
    assert bad["fault_injected"] and not bad["valid"]
    assert bad["wrong_bytes"] == 1 and bad["first_wrong_descriptor"] == 0
    assert "request 0" in bad["first_wrong"]
    assert doc["outcome"]["status"] == "fail" and doc["outcome"]["rows_invalid"] == 1


def test_fault_injection_by_environment_on_the_bulk_row(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("GPUXFER_INJECT_FAULT", "bulk")
    rc, out, err, doc = _bench_kv(capsys, tmp_path, *TINY, *FAST, "--engine", "bulk", "--direction", "pull",
                                  "--post", "host")
    assert rc == 1, out + err
    (row,) = doc["rows"]
    assert row["wrong_bytes"] == 1 and not row["valid"] and row["post"] == "host"
    assert "bulk copy" in row["first_wrong"]


def test_a_failing_process_does_not_hang_the_other(capsys, tmp_path):
    # the decode side asks for a device that does not exist (the runner, past the command's own checks):
    # it fails at once, the prefill side is left waiting for its peer and must fail on the group timeout,
    # not hang
    from gpuxfer.cli import build_parser
    from gpuxfer.bench.kv.cli import parse_grid_args, parse_run_options, run_transfers
    out_dir = tmp_path / "out"
    args = build_parser().parse_args(["bench", "kv", *TINY, "--warmup", "0", "--trials", "1", "--timeout", "8",
                                      "--engine", "bulk", "--devices", "0,7", "--out", str(out_dir)])
    t0 = time.monotonic()
    rc = run_transfers(parse_grid_args(args), parse_run_options(args), args)
    out = capsys.readouterr().out
    assert rc == 1
    assert time.monotonic() - t0 < 120
    assert "device 7 does not exist" in out
    doc = json.loads((out_dir / "kv_bench.json").read_text())
    assert doc["outcome"]["status"] == "fail" and not doc["outcome"]["complete"]


@pytest.mark.parametrize("argv, message", [
    (["--engine", "warp-drive"], "--engine: unknown value 'warp-drive'"),
    (["--direction", "sideways"], "--direction: unknown value"),
    (["--trials", "0"], "--trials: must be positive"),
    (["--warmup", "-1"], "--warmup: must be >= 0"),
    (["--timeout", "0"], "--timeout: must be a positive number of seconds"),
    (["--devices", "0,5"], "--devices: device 5 does not exist"),
    (["--platform", "tpu"], "--platform: unknown platform 'tpu'"),
    (["--batch", "100000"], "nothing to measure"),
    (["--isl", "100M"], "nothing to measure"),
    (["--pool-budget", "1"], "nothing to measure"),
    (["--out", "/proc/gpuxfer-no-such-dir"], "--out: cannot write in /proc/gpuxfer-no-such-dir"),
    (["--json", "/proc/gpuxfer-no-such-dir/kv.json"], "--json: directory /proc/gpuxfer-no-such-dir does not exist"),
    (["--json", "/proc/kv.json"], "--json: cannot write in /proc"),
    (["--post", "eager"], "--post: unknown value 'eager'"),
    (["--inject-fault", "teleport"], "--inject-fault: unknown engine 'teleport'"),
    (["--inject-fault", "bulk:sideways"], "--inject-fault: unknown direction 'sideways'"),
    (["--devices", "0,1,2"], "--devices: give one or two device indexes"),
    (["--isl", "lots"], "--isl: cannot read 'lots'"),
    (["--pool-budget", "12XB"], "--pool-budget: unknown unit"),
    (["--pack-chunk", "0"], "--pack-chunk: '0' must be positive"),
    (["--copy-engine-max-descs", "many"], "--copy-engine-max-descs: cannot read 'many'"),
    (["--pack-lanes", "9"], "--pack-lanes must be 1..8, got 9"),
    (["--pack-first-chunk", "0"], "--pack-first-chunk: '0' must be positive"),
    (["--workload", "kv-nope"], "unknown KV workload 'kv-nope'"),
    (["--cpus", "0"], "--cpus: 2 ranks need 2 CPU sets, got 1"),
    (["--cpus", "fast"], "--cpus: auto, none, or one CPU set per rank"),
    (["--cpus", "4096,4096"], "--cpus: CPU(s) [4096] are not among this process's CPUs"),
])
def test_bad_options_give_clear_errors(capsys, tmp_path, argv, message):
    """Every bad option fails in the parent at once: one line on stderr, exit 2, no process, no file."""
    t0 = time.monotonic()
    argv = argv if "--out" in argv else [*argv, "--out", str(tmp_path / "o")]
    rc = main(["bench", "kv", *TINY, *argv])
    cap = capsys.readouterr()
    assert rc == 2
    assert message in cap.err, cap.err
    assert cap.err.count("\n") == 1 and cap.err.startswith("gpuxfer bench kv: error: ") and cap.out == ""
    assert "Traceback" not in cap.err
    assert not (tmp_path / "o").exists()
    assert time.monotonic() - t0 < 60      # no process was started (a hang guard, not a speed test)


def _config(*argv):
    from gpuxfer.bench.kv.cli import parse_grid_spec, parse_run_options
    from gpuxfer.bench.kv.runner import config_from_args
    from gpuxfer.cli import build_parser
    args = build_parser().parse_args(["bench", "kv", *TINY, *argv])
    spec = parse_grid_spec(args)
    return config_from_args(args, parse_run_options(args), spec)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this OS")
def test_cpus_option_parses_like_bench_pp():
    """--cpus auto (the default), none, or one CPU set per rank ('+' joins CPUs, ',' the sets), checked
    against this process's CPUs in the parent; the parameters record it as given."""
    from gpuxfer.bench.cpus import AUTO
    cpus = sorted(os.sched_getaffinity(0))
    a, b = cpus[0], cpus[-1]
    auto = _config()
    assert auto.cpus in (AUTO, None) and auto.params()["cpus"] == "auto"    # None: fewer cores than ranks
    assert _config("--cpus", "auto").cpus == auto.cpus
    none = _config("--cpus", "none")
    assert none.cpus is None and none.params()["cpus"] == "none"
    named = _config("--cpus", f" {a},{b} ")
    assert named.cpus == [(a,), (b,)] and named.params()["cpus"] == f"{a},{b}"
    assert _config("--cpus", f"{a}+{b},{b}").cpus == [(a, b), (b,)]


def test_cpus_preamble_says_where_each_rank_ran_and_how():
    """The # CPUs: lines from the start event's environment (no machine involved)."""
    from gpuxfer.bench.cpus import AUTO
    picks = [{"cpu": 6, "python_us": 34.2, "candidates_python_us": {"6": 34.2, "7": 61.0}},
             {"cpu": 9, "python_us": 35.0, "candidates_python_us": {"8": 70.1, "9": 35.0}}]
    env = {"cpus_spec": AUTO, "cpus_by_rank": [[6], [9]], "cpu_pick_by_rank": picks}
    lines = R.cpu_lines(env, "auto")
    assert lines[0] == ("# CPUs: rank 0 on CPU 6, rank 1 on CPU 9 (auto: the fastest, by a Python yardstick, "
                        "of physical cores of its own near its GPU)")
    assert "rank 0 CPU 6 34 (34-61), rank 1 CPU 9 35 (35-70)" in lines[1]
    # auto with fewer physical cores than ranks: not pinned, and why
    env = {"cpus_spec": None, "cpus_by_rank": [[0, 1], [0, 1]], "cpu_pick_by_rank": [None, None]}
    (line,) = R.cpu_lines(env, "auto")
    assert "(not pinned: the scheduler places them); --cpus auto needs a physical core per rank" in line
    # auto where the OS refused a rank's CPUs: not pinned either
    env = {"cpus_spec": AUTO, "cpus_by_rank": [[6], [0, 1]], "cpu_pick_by_rank": [picks[0], None]}
    assert R.cpu_lines(env, "auto")[0].endswith("; --cpus auto could not pin every rank")
    env = {"cpus_spec": None, "cpus_by_rank": [[0, 1], [0, 1]], "cpu_pick_by_rank": [None, None]}
    assert R.cpu_lines(env, "none") == ["# CPUs: rank 0 on CPUs 0+1, rank 1 on CPUs 0+1 (not pinned: the scheduler places them)"]
    env = {"cpus_spec": [[2, 3], [4]], "cpus_by_rank": [[2, 3], [4]], "cpu_pick_by_rank": [None, None]}
    assert R.cpu_lines(env, "2+3,4") == ["# CPUs: rank 0 on CPUs 2+3, rank 1 on CPU 4 (as named)"]
    assert "# CPUs: rank 0 on CPU 6" in "\n".join(R.preamble_lines(dict(env, cpus_by_rank=[[6], [9]]), {}))


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this OS")
@pytest.mark.parametrize("how", ["none", pytest.param("named", marks=pytest.mark.slow)])
def test_cpus_none_leaves_affinity_alone_and_a_list_pins(capsys, tmp_path, how):
    cpus = sorted(os.sched_getaffinity(0))
    spec = "none" if how == "none" else f"{cpus[0]},{cpus[-1]}"
    rc, out, err, doc = _bench_kv(capsys, tmp_path, *TINY, *FAST, "--engine", "bulk", "--direction", "pull",
                                  "--cpus", spec)
    assert rc == 0, out + err
    env, (row,) = doc["environment"], doc["rows"]
    assert doc["parameters"]["cpus"] == spec and env["cpu_pick_by_rank"] == [None, None]
    if how == "none":       # each rank keeps the CPUs it started with (the parent's)
        assert env["cpus_spec"] is None and env["cpus_by_rank"] == [cpus, cpus]
        assert "(not pinned: the scheduler places them)" in out
        assert set(row["initiator_cpus"]) <= set(cpus)
    else:                   # pull: the decode side (rank 1) initiates, pinned to its CPU
        assert env["cpus_by_rank"] == [[cpus[0]], [cpus[-1]]] and "(as named)" in out
        assert row["initiator_cpus"] == [cpus[-1], cpus[-1]]
    assert row["initiator_python_us"] > 0


def test_a_bad_device_count_variable_is_one_line_before_any_process(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("GPUXFER_HOST_DEVICES", "abc")
    rc = main(["bench", "kv", *TINY, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and err == "gpuxfer bench kv: error: GPUXFER_HOST_DEVICES must be an integer, got 'abc'\n"
    assert not (tmp_path / "o").exists()


def test_nothing_to_measure_is_an_error(capsys, tmp_path):
    rc = main(["bench", "kv", *TINY, *FAST, "--engine", "bulk", "--pool-budget", "4096", "--out", str(tmp_path)])
    assert rc == 2
    assert "nothing to measure" in capsys.readouterr().err


def test_an_earlier_run_is_never_overwritten(capsys, tmp_path):
    """An --out holding an earlier run's results is refused before measuring, the results left as they were."""
    held = tmp_path / "held"
    held.mkdir()
    (held / "kv_bench.json").write_text("{\"earlier\": true}")
    rc = main(["bench", "kv", *TINY, "--out", str(held)])
    err = capsys.readouterr().err
    assert rc == 2 and "holds an earlier run's kv_bench.json" in err
    assert (held / "kv_bench.json").read_text() == "{\"earlier\": true}"


def test_default_places_one_directory_per_run(tmp_path, monkeypatch):
    """Without --out every run gets its own directory and `latest` points at the newest."""
    from gpuxfer.bench.cliutil import prepare_outputs
    monkeypatch.chdir(tmp_path)
    a = prepare_outputs("kv", None, None, artifacts=("kv_bench.json",))
    b = prepare_outputs("kv", None, None, artifacts=("kv_bench.json",))
    assert a.directory != b.directory and os.path.dirname(a.directory) == str(tmp_path / "gpuxfer-out" / "kv")
    b.link_latest()
    assert os.path.realpath(tmp_path / "gpuxfer-out" / "kv" / "latest") == b.directory
    nothing = prepare_outputs("kv", None, None, artifacts=("kv_bench.json",), create=False)
    assert nothing.directory is None
    a.remove_if_empty()                                   # a run that wrote nothing leaves nothing
    assert not os.path.exists(a.directory)
    kept = tmp_path / "kept"
    kept.mkdir()
    prepare_outputs("kv", str(kept), None, artifacts=("kv_bench.json",)).remove_if_empty()
    assert kept.is_dir()                                  # a directory the run did not make stays


def test_the_host_runs_the_small_grid_and_says_so(capsys):
    """--plan-only on the host shows the grid the host runs (HOST_GRID), with the note; --full the GPU's."""
    from gpuxfer.bench.kv.grid import HOST_GRID
    rc = main(["bench", "kv", "--platform", "host", "--plan-only", "--json"])
    cap = capsys.readouterr()
    assert rc == 0 and "host EMULATION" in cap.err and "--full" in cap.err
    doc = json.loads(cap.out)
    [point] = doc["grid"]["points"]
    assert (point["isl_tokens"], point["page_tokens"], point["batches"]) == \
        (int(HOST_GRID["isl"]), int(HOST_GRID["page"]), [int(HOST_GRID["batch"])])
    assert doc["run"]["trials"] == int(HOST_GRID["trials"])
    rc = main(["bench", "kv", "--platform", "host", "--plan-only", "--json", "--full", "--isl", "8k"])
    cap = capsys.readouterr()
    assert rc == 0 and "EMULATION" not in cap.err
    assert [p["isl_tokens"] for p in json.loads(cap.out)["grid"]["points"]] == [8192, 8192]


def test_plan_only_json_path_writes_the_plan_and_no_run_directory(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    rc = main(["bench", "kv", "--platform", "host", "--plan-only", "--json", "sub/plan.json"])
    out = capsys.readouterr().out
    assert rc == 0 and "sweep grid" in out and f"# json: {tmp_path / 'sub' / 'plan.json'}" in out
    assert json.loads((tmp_path / "sub" / "plan.json").read_text())["kind"] == "gpuxfer-kv-plan"
    assert not (tmp_path / "gpuxfer-out").exists()


def test_json_path_is_never_overwritten_nor_its_directory_made(capsys, tmp_path, monkeypatch):
    """--json PATH, like --out, keeps what is there: an existing file (or symlink) is refused before
    anything is printed, a missing directory is refused, not created (one line, exit 2)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan.json").write_text("earlier")
    os.symlink(tmp_path / "nowhere", tmp_path / "link.json")
    for path, said in (("plan.json", "exists; it is kept"), ("link.json", "exists; it is kept"),
                       ("missing/plan.json", "does not exist")):
        rc = main(["bench", "kv", "--platform", "host", "--plan-only", "--json", path])
        cap = capsys.readouterr()
        assert rc == 2 and cap.out == "" and cap.err.count("\n") == 1 and said in cap.err, cap.err
        assert cap.err.startswith("gpuxfer bench kv: error: --json: ")
    assert (tmp_path / "plan.json").read_text() == "earlier"
    assert not (tmp_path / "missing").exists() and not (tmp_path / "nowhere").exists()


ALL_ENGINES = ("triton", "pack", "copy_engine", "bulk", "nixl", "nixl-bulk", "nixl-oneshot", "nixl+pack", "mooncake")


def test_cross_host_without_nixl_sheds_every_engine_and_fails(capsys, tmp_path, monkeypatch):
    """--cross-host on one host, no NIXL: every engine listed with its reason, no peer mapping, a clear
    'nothing could run' failure (exit 1), and no hang."""
    monkeypatch.setenv("GPUXFER_NIXL_MODULE", "no_such_nixl_module_for_tests")   # even where NIXL is installed
    t0 = time.monotonic()
    rc, out, err, doc = _bench_kv(capsys, tmp_path, *TINY, *FAST, "--cross-host", "--engine", ",".join(ALL_ENGINES))
    assert time.monotonic() - t0 < 60
    assert rc == 1, out + err
    assert "nothing could run" in out and "# FAIL" in out
    assert doc is not None and doc["rows"] == [] and doc["outcome"]["status"] == "fail"
    assert doc["environment"]["cross_host"] is True and doc["environment"]["link"]["kind"] == "cross-host"
    assert doc["parameters"]["cross_host"] == "forced"
    reasons = {s["engine"]: s["reason"] for s in doc["shed"] if "engine" in s and "batch" not in s}
    assert set(reasons) == set(ALL_ENGINES)
    for name in ("triton", "pack", "copy_engine", "bulk"):
        assert reasons[name].endswith(E.CROSS_HOST_PEER_MAPPING), reasons[name]
    for name in ("nixl", "nixl-bulk", "nixl-oneshot", "nixl+pack"):
        assert "NIXL is not installed" in reasons[name], reasons[name]
    assert "intra-node" in reasons["mooncake"] and "different hosts" in reasons["mooncake"]


def test_no_usable_engine_on_one_host_fails(capsys, tmp_path, monkeypatch):
    """An engine set of which nothing can run here is a failure, not an empty PASS."""
    monkeypatch.setenv("GPUXFER_NIXL_MODULE", "no_such_nixl_module_for_tests")
    rc, out, err, doc = _bench_kv(capsys, tmp_path, *TINY, *FAST, "--engine", "nixl,mooncake")
    assert rc == 1, out + err
    assert "nothing could run" in out and "usable here" in out
    assert doc is not None and doc["rows"] == [] and doc["outcome"]["status"] == "fail"


def test_cross_host_engine_attributes():
    """Which engines need the peer mapping, and the ceiling across hosts (class attributes, no device)."""
    need = {n for n in ALL_ENGINES if E.engine_class(n).needs_peer_mapping}
    assert need == {"triton", "pack", "copy_engine", "bulk"}
    blocked = {n for n in ALL_ENGINES if E.engine_class(n).cross_host_reason()}
    assert blocked == need | {"mooncake"}
    assert E.measurement_order(["triton", "nixl", "nixl-bulk", "bulk"], cross_host=True)[0] == "nixl-bulk"
    assert E.measurement_order(["triton", "nixl", "nixl-bulk", "bulk"]) == ["bulk", "triton", "nixl", "nixl-bulk"]


@pytest.mark.slow
def test_under_torchrun_environment(tmp_path):
    """Two ranks started by hand the way torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_dir = tmp_path / "out"
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "gpuxfer", "bench", "kv", *TINY, *FAST, "--engine", "bulk,copy_engine",
             "--out", str(out_dir)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=180)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("torchrun-style ranks did not finish in 180 s")
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "# PASS" in outs[0] and "# PASS" not in outs[1]
    doc = json.loads((out_dir / "kv_bench.json").read_text())
    assert doc["environment"]["launcher"] == "torchrun" and len(doc["rows"]) == 4


# ----------------------------------------------------------------------------- engine helpers (no processes)


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=60), cap=st.integers(1, 3000))
def test_split_large_keeps_the_byte_map(sizes, cap):
    n = np.array(sizes, dtype=np.int64)
    src = np.concatenate([[0], np.cumsum(n)[:-1]]) * 3 + 7
    dst = np.concatenate([[0], np.cumsum(n)[:-1]]) + 11
    d = np.stack([src, dst, n], axis=1)
    out = E.split_large(d, cap)
    assert out[:, 2].max() <= cap and out[:, 2].min() > 0
    assert out[:, 2].sum() == n.sum()

    def bytemap(t):
        return np.concatenate([np.stack([np.arange(s, s + k), np.arange(q, q + k)], 1) for s, q, k in t.tolist()])
    assert np.array_equal(bytemap(out), bytemap(d))


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 4096), min_size=1, max_size=200), chunk=st.integers(4096, 50_000),
       first=st.integers(1, 50_000))
def test_chunk_plan_covers_every_descriptor_once_within_the_slot(sizes, chunk, first):
    d = np.zeros((len(sizes), 3), dtype=np.int64)
    d[:, 2] = sizes
    plan = E.chunk_plan(d, chunk, min(first, chunk))
    assert plan[0][0] == 0 and plan[-1][1] == len(sizes)
    for (a, b, nbytes), nxt in zip(plan, plan[1:] + [(len(sizes), None, None)]):
        assert b > a and b == nxt[0]
        assert nbytes == int(d[a:b, 2].sum()) and nbytes <= chunk
    # chunks ramp up: never smaller than the first target unless the table ends or a descriptor overflows it
    assert sum(c[2] for c in plan) == sum(sizes)


def test_bad_flag_path_is_a_clear_error_on_both_sides(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_FLAG_PATH, "bogus")
    rc, out, err, doc = _bench_kv(capsys, tmp_path, *TINY, *FAST, "--engine", "pack")
    assert rc == 1, out + err
    assert (out + err).count("GPUXFER_FLAG_PATH must be auto, remote or copy, got 'bogus'") >= 2, out + err


@pytest.mark.slow      # 15-45 s of Triton's interpreter; the remote-write path runs by default
@pytest.mark.parametrize("engine", ["pack", "pack-table"])
def test_pack_over_flag_copies_end_to_end(capsys, tmp_path, monkeypatch, engine):
    monkeypatch.setenv(ENV_FLAG_PATH, "copy")
    rc, out, err, doc = _bench_kv(capsys, tmp_path, *TINY, *FAST, "--engine", f"{engine},bulk")
    assert rc == 0, out + err
    rows = [r for r in doc["rows"] if r["engine"] == engine]
    assert len(rows) == 2 and all(r["valid"] and r["flag_path"] == "8-byte copies" for r in rows)


@pytest.mark.parametrize("nslots,nlanes", [(2, 1), (4, 1), (4, 2), (6, 3), (8, 4), (8, 2)])
def test_pack_chunk_schedule(nslots, nlanes):
    """Slots round robin; lanes round robin but a burst's last chunk stays on the lane of the one before;
    each lane's chunks numbered 1, 2, ... over the engine's life; a chunk waits for the slot's previous
    user in its burst -- on that chunk's lane and number -- and for nothing left from earlier bursts."""
    sch = P._ChunkSchedule(nslots, nlanes)
    per_lane: dict[int, list[int]] = {lane: [] for lane in range(nlanes)}
    for n in (1, 2, 3, nslots + 1, 2 * nslots + 3, 1, 5):
        sch.start_burst()
        burst = [sch.next(i == n - 1) for i in range(n)]
        for i, c in enumerate(burst):
            assert c.slot == c.k % nslots
            per_lane[c.lane].append(c.seq)
            if i < n - 1 or n == 1:
                assert c.lane == c.k % nlanes
            else:
                assert c.lane == burst[i - 1].lane
            prev = burst[i - nslots] if i >= nslots else None
            assert c.before == ((prev.lane, prev.seq) if prev else None)
    for seqs in per_lane.values():
        assert seqs == list(range(1, len(seqs) + 1))


@pytest.mark.slow      # 15-50 s each in the interpreter; the default run's pack rows cover two lanes
@pytest.mark.parametrize("lanes", ["1", "2", "3"])
def test_pack_many_chunks_over_lanes_end_to_end(capsys, tmp_path, lanes):
    """Many chunks per burst, two bursts a row (timed, then verified), 1-3 lanes: slots are reused within
    a burst and the last chunk takes the lane of the one before it. Every byte must land, and a wait for a
    flag value that never comes would end the row in a timeout."""
    rc, out, err, doc = _bench_kv(capsys, tmp_path, *TINY, "--warmup", "0", "--trials", "1", "--timeout", "60",
                                  "--engine", "pack-table,bulk", "--pack-chunk", "64K", "--pack-first-chunk", "16K",
                                  "--pack-lanes", lanes)
    assert rc == 0, out + err
    rows = [r for r in doc["rows"] if r["engine"] == "pack-table"]
    assert len(rows) == 2 and all(r["valid"] and r["wrong_bytes"] == 0 for r in rows), rows
    assert all(r["burst_bytes"] > 8 * (64 << 10) for r in rows)     # > 8 chunks of <= 64 KiB: slots reused


@pytest.mark.parametrize("largest", [132, 528, 576, 2304, 9216, 36864])
@pytest.mark.parametrize("rows", [1, 7, 130, 500, 31775])
def test_pack_chunk_geometry_is_tiled_for_its_sizes_and_never_slices(monkeypatch, largest, rows):
    """Each pack chunk's kernels get the local tiling of its own largest descriptor, and no more programs
    than row groups of that tiling (slices > 1 gave wrong bytes on H200), whatever the grid would be; a
    pack after the burst's first runs on at most one program per two SMs."""
    import torch

    from gpuxfer.kernels import launch as L
    from gpuxfer.kernels import tiling
    monkeypatch.setattr(tiling, "_sm_count", lambda index: 132)
    cfg, programs, later = E.PackEngine._geometry(torch.device("cuda", 0), rows, largest)
    assert cfg == L.choose_config(largest, local=True)
    assert 1 <= programs <= L.default_programs(torch.device("cuda", 0), cfg)
    assert 1 <= later <= min(programs, 66) and (later == 66 or later == programs)
    for grid in (programs, later):
        _, _, slices = L._grid(rows, cfg, grid)
        assert slices == 1


def test_pack_grid_whole_for_the_fill_half_for_later_packs(monkeypatch):
    """The burst's first pack (the fill) runs on the chunk's whole grid, every later pack on the smaller
    one; unpacks always on the whole grid."""
    seen = []

    class Kernels:
        def pack(self, *args, num_programs, **kw):
            seen.append(("pack", kw["start"], num_programs))

        def unpack(self, *args, num_programs, **kw):
            seen.append(("unpack", kw["start"], num_programs))

    class Plat:
        def launch(self, stream, fn):
            fn()
    monkeypatch.setattr(P, "kernels", Kernels)
    eng = object.__new__(E.PackEngine)
    eng.platform, eng.slot_bytes, eng._stage_t, eng._pool_t = Plat(), 0, "stage", "pool"
    plan = P._PackPlan([(0, 4, 40), (4, 9, 50), (9, 12, 30)], None, None,
                       {0: ("cfg", 8, 3), 4: ("cfg", 7, 2), 9: ("cfg", 6, 1)})
    for a, b, _ in plan.chunks:
        eng._pack(None, plan, a, b, 0)
        eng._unpack(None, plan, a, b, 0)
    assert seen == [("pack", 0, 8), ("unpack", 0, 8), ("pack", 4, 2), ("unpack", 4, 7),
                    ("pack", 9, 1), ("unpack", 9, 6)]


def test_bulk_descriptors_and_bursts():
    d = E.bulk_descriptors(10, 4)
    assert d.tolist() == [[0, 0, 4], [4, 4, 4], [8, 8, 2]]
    b = E.DescriptorBurst([np.array([[0, 0, 8], [8, 16, 8]]), np.array([[100, 200, 4]])])
    assert (b.batch, b.descriptors, b.nbytes) == (2, 3, 20)
    assert b.shape == E.BurstShape(2, 3, 20)
    b.check_bounds(104, 204)
    with pytest.raises(BadInput, match="destination pool"):
        b.check_bounds(104, 203)
    with pytest.raises(BadInput, match="shape"):
        E.DescriptorBurst([np.zeros((2, 2), dtype=np.int64)])
    with pytest.raises(BadInput, match="at least one request"):
        E.DescriptorBurst([])


def test_registry_parse_and_report(host):
    assert E.parse_engines("triton,bulk,triton") == ["triton", "bulk"]
    assert E.measurement_order(["triton", "pack", "bulk"])[0] == "bulk"
    with pytest.raises(BadInput, match="unknown engine"):
        E.parse_engines("triton,teleport")
    with pytest.raises(BadInput, match="no engine"):
        E.parse_engines(" , ")
    rep = E.engine_report(host)
    assert {"triton", "pack", "copy_engine", "bulk"} <= set(rep)
    assert all(rep[n] is None for n in ("triton", "pack", "copy_engine", "bulk"))
    assert all(v is None or (isinstance(v, str) and v) for v in rep.values())

    class Fake(E.Engine):
        name = "fake"

        @classmethod
        def unavailable_reason(cls, platform):
            return "needs a warp core"

        def prepare(self, burst, direction):
            return self._new_prepared(burst, direction)

    saved = dict(E.ENGINES)
    try:
        E.register_engine("fake", Fake)
        assert E.engine_report(host)["fake"] == "needs a warp core"
        with pytest.raises(BadInput, match="not an Engine"):
            E.register_engine("bad", int)
        with pytest.raises(BadInput, match="module:Class"):
            E.register_engine("bad", "no_colon")
    finally:
        E.ENGINES.clear()
        E.ENGINES.update(saved)


def test_copy_engine_cap_sheds_with_the_reason():
    opts = E.EngineOptions(copy_engine_max_descs=100)

    class _S:
        options = opts
        platform = None

    for name in ("copy_engine", "copy_engine-table"):
        cls = E.engine_class(name)
        eng = cls.__new__(cls)
        eng.options = opts
        assert eng.shed_reason(E.BurstShape(1, 100, 1000)) is None
        why = eng.shed_reason(E.BurstShape(2, 101, 1000))
        assert why.startswith(f"{name} is capped at 100 descriptors") and "--copy-engine-max-descs" in why


def test_engine_options_are_checked():
    with pytest.raises(BadInput, match="multiple of pack_lanes"):
        E.EngineOptions(pack_slots=3, pack_lanes=2).validate()
    with pytest.raises(BadInput, match="positive integer"):
        E.EngineOptions(pack_chunk_bytes=0).validate()


# ----------------------------------------------------------------------------- report (no processes)


def _row(engine="triton", batch=1, direction="pull", ms=(1.0, 2.0, 3.0), wrong=0, page=16):
    row = {"workload": "kv-dsv4", "page_tokens": page, "isl_tokens": 32768, "batch": batch, "engine": engine,
           "direction": direction, "burst_bytes": 2_000_000_000, "descriptors": 1000, "prep_ms": 1.0,
           "wrong_bytes": wrong, "valid": wrong == 0, "verified": True, "error": None}
    R.finish_row(row, [m / 1e3 for m in ms])
    return row


def test_statistics_and_decimal_gbps():
    row = _row(ms=(4.0, 1.0, 2.0))
    assert row["burst_p50_ms"] == pytest.approx(2.0)
    assert row["p50_gbps"] == pytest.approx(1000.0)            # 2e9 B in 2 ms = 1000 GB/s (decimal)
    assert row["min_gbps"] == pytest.approx(500.0) and row["max_gbps"] == pytest.approx(2000.0)
    assert row["per_descriptor_p50_us"] == pytest.approx(2.0)
    R.apply_ceiling(row, 1250.0)
    assert row["of_ceiling_pct"] == pytest.approx(80.0)
    assert R.gbps(1, 0) is None and R.sample_stats([])["p50_ms"] is None


def test_outcome_fails_on_a_wrong_byte_an_error_or_an_incomplete_run():
    good = [_row(), _row(engine="bulk")]
    assert R.outcome(good, [])["status"] == "pass"
    bad = good + [_row(engine="pack", wrong=3)]
    out = R.outcome(bad, [])
    assert out["status"] == "fail" and out["rows_invalid"] == 1 and "3 wrong bytes" in out["reasons"][0]
    err = dict(_row(), error="boom", valid=False)
    assert R.outcome([err], [])["rows_failed"] == 1
    assert R.outcome(good, [], complete=False)["status"] == "fail"
    assert R.outcome(good, ["rank 1 died"])["status"] == "fail"
    assert "INVALID" in R.format_row(bad[-1]) and "ERROR: boom" in R.format_row(err)


def test_table_columns_line_up_with_the_header():
    head, units = R.header_lines()
    line = R.format_row(_row())
    assert len(head) == len(units) == len(line)
    assert head.startswith("# ") and line.startswith("  ")


def test_summary_and_plot(tmp_path):
    rows = []
    for page in (16, 64):
        for d in ("pull", "push"):
            for b in (1, 8, 64):
                bulk = _row("bulk", b, d, (1.0, 1.0, 1.0), page=page)
                rows.append(bulk)
                for eng, ms in (("triton", 1.05), ("pack", 1.2), ("copy_engine", 50.0)):
                    r = _row(eng, b, d, (ms, ms, ms), wrong=1 if (eng == "pack" and b == 8) else 0, page=page)
                    R.apply_ceiling(r, bulk["p50_gbps"])
                    rows.append(r)
    summ = R.summary(rows)
    tri = [s for s in summ if s["engine"] == "triton" and s["page_tokens"] == 16 and s["direction"] == "pull"][0]
    assert (tri["batch_min"], tri["batch_max"]) == (1, 64)
    assert tri["worst_of_ceiling_pct"] == pytest.approx(100 / 1.05)
    assert not [s for s in summ if s["engine"] == "pack"][0]["all_valid"]
    text = "\n".join(R.summary_lines(summ))
    assert "triton" in text and "NO" in text
    paths = R.plot(rows, str(tmp_path))
    assert paths == [str(tmp_path / "kv_bench_kv-dsv4_isl32768.png")]
    with open(paths[0], "rb") as f:
        assert f.read(4) == b"\x89PNG"


def test_json_is_strict_and_atomic(tmp_path):
    doc = R.build_document(env={"is_emulation": True}, params={"trials": 3}, rows=[_row()], shed=[],
                           out=R.outcome([_row()], []), artifacts={"json": None, "plots": []}, argv=["x"])
    path = R.write_json_atomic(str(tmp_path / "a" / "kv_bench.json"), doc)
    back = json.loads(open(path).read())
    assert DOC_KEYS <= set(back) and back["rows"][0]["p50_gbps"] == doc["rows"][0]["p50_gbps"]
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["kv_bench.json"]
    assert os.stat(path).st_mode & 0o777 == 0o644
    os.symlink(tmp_path / "elsewhere.json", tmp_path / "b.json")      # a symlink is replaced, not followed
    R.write_json_atomic(str(tmp_path / "b.json"), doc)
    assert not (tmp_path / "elsewhere.json").exists() and not os.path.islink(tmp_path / "b.json")


# ----------------------------------------------------------------------------- GPU


def _cuda_count() -> int:
    from gpuxfer.platforms import unavailable_reason
    if unavailable_reason("cuda") is not None:
        return 0
    import torch
    return torch.cuda.device_count()


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_gpu_short_sweep_every_engine_every_byte(capsys, tmp_path):
    n = _cuda_count()
    if n < 2:
        pytest.skip(f"needs two CUDA GPUs, found {n}")
    rc, out, err, doc = _bench_kv(capsys, tmp_path, "--platform", "cuda", "--isl", "8k", "--page", "16,64",
                                  "--batch", "1,4", "--trials", "3", "--warmup", "1")
    assert rc == 0, out + err
    rows = doc["rows"]
    assert {r["engine"] for r in rows} == {"triton", "pack", "copy_engine", "bulk"}
    assert {r["direction"] for r in rows} == {"pull", "push"}
    assert all(r["valid"] and r["verified"] and r["wrong_bytes"] == 0 for r in rows)
    assert doc["environment"]["is_emulation"] is False and not doc["environment"]["same_device"]
    bulk = [r for r in rows if r["engine"] == "bulk"]
    assert all(r["p50_gbps"] > 20 for r in bulk), [r["p50_gbps"] for r in bulk]


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_gpu_corrupted_transfer_fails(capsys, tmp_path):
    if _cuda_count() < 1:
        pytest.skip("needs a CUDA GPU")
    rc, out, err, doc = _bench_kv(capsys, tmp_path, "--platform", "cuda", "--isl", "8k", "--page", "64", "--batch", "1",
                                  "--engine", "triton,pack", "--trials", "1", "--warmup", "0", "--devices", "0,0",
                                  "--inject-fault", "pack")
    assert rc == 1, out + err
    assert doc["environment"]["same_device"] is True
    rows = {(r["engine"], r["direction"]): r for r in doc["rows"]}
    assert all(rows[("triton", d)]["valid"] for d in ("pull", "push"))
    assert all(rows[("pack", d)]["wrong_bytes"] == 1 for d in ("pull", "push"))


def test_size_classes_partition_the_plan():
    """The triton engine launches once per descriptor size: the classes must partition the plan."""
    import numpy as np
    from gpuxfer.bench.kv.engines.triton import size_classes
    rng = np.random.default_rng(0)
    plan = np.stack([rng.permutation(64) * 10_000, rng.permutation(64) * 10_000,
                     rng.choice([528, 2304, 9216], 64)], axis=1).astype(np.int64)
    classes = size_classes(plan)
    assert sorted({int(c[0, 2]) for c in classes}) == sorted(set(plan[:, 2].tolist()))
    assert all((c[:, 2] == c[0, 2]).all() for c in classes)
    merged = np.concatenate(classes)
    assert sorted(map(tuple, merged.tolist())) == sorted(map(tuple, plan.tolist()))
    assert size_classes(plan[:0]) == []
    for col in (0, 1):          # sorted by the peer pool's offsets, still a partition
        by = size_classes(plan, sort_col=col)
        assert all((np.diff(c[:, col]) >= 0).all() and (c[:, 2] == c[0, 2]).all() for c in by)
        assert sorted(map(tuple, np.concatenate(by).tolist())) == sorted(map(tuple, plan.tolist()))


def test_triton_order_policy(monkeypatch):
    """GPUXFER_KV_TRITON_ORDER: the peer pool's column by default, the local one, the plan's order, or an error."""
    from gpuxfer.bench.kv.engines.triton import order_column
    monkeypatch.delenv("GPUXFER_KV_TRITON_ORDER", raising=False)
    assert (order_column("pull"), order_column("push")) == (0, 1)        # pull reads the source, push writes the destination
    monkeypatch.setenv("GPUXFER_KV_TRITON_ORDER", "local")
    assert (order_column("pull"), order_column("push")) == (1, 0)
    monkeypatch.setenv("GPUXFER_KV_TRITON_ORDER", "plan")
    assert order_column("pull") is None
    monkeypatch.setenv("GPUXFER_KV_TRITON_ORDER", "random")
    with pytest.raises(BadInput, match="GPUXFER_KV_TRITON_ORDER"):
        order_column("pull")


def test_trace_env_is_off_on_the_emulation_and_when_unset(monkeypatch, tmp_path):
    """GPUXFER_KV_TRACE profiles GPU rows only: unset, or on the emulation, no profiler starts."""
    from gpuxfer.bench.kv.worker import TRACE_ENV, Worker
    stand_in = type("W", (), {"platform": type("P", (), {"host_memory": True})()})()
    monkeypatch.delenv(TRACE_ENV, raising=False)
    assert Worker._trace_start(stand_in) is None
    monkeypatch.setenv(TRACE_ENV, str(tmp_path / "tr"))
    assert Worker._trace_start(stand_in) is None and not (tmp_path / "tr").exists()


def test_plot_panels_have_their_own_y_axis(tmp_path, monkeypatch):
    """A page size several times faster than another keeps its lines inside its own panel; the PNG is 0644."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    rows = [dict(workload="kv-dsv4", isl_tokens=32768, page_tokens=page, direction=d, engine=eng, batch=b,
                 p50_gbps=scale * b, min_gbps=scale * b, max_gbps=scale * b, valid=True)
            for d in ("pull", "push") for page, scale in ((16, 10.0), (64, 300.0))
            for eng in ("bulk", "triton") for b in (1, 2, 4)]
    figs, close = [], plt.close
    monkeypatch.setattr(plt, "close", figs.append)
    [path] = R.plot(rows, str(tmp_path))
    try:
        for ax in figs[0].axes:
            top = max(y for line in ax.get_lines() for y in line.get_ydata())
            assert ax.get_ylim()[1] >= top and ax.get_ylim()[1] < 3 * top
    finally:
        close(figs[0])
    assert os.stat(path).st_mode & 0o777 == 0o644
