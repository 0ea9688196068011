"""The NIXL engines between two processes: real NIXL on the host emulation (skipped with the reason where
it is not importable) and, marked ``gpu``, two GPUs, directly and through the benchmark runner.
"""
from __future__ import annotations

import sys

import pytest

from gpuxfer.kv import nixl_ffi as nf

from _nixl_engines import run_two_processes, two_gpus_reason


# --------------------------------------------------------------------------- real NIXL, two processes
#
# With NIXL importable (e.g. PYTHONPATH pointing at the slim tree of docs/MULTINODE.md), the
# engines run between two processes on the host emulation (DRAM pools in shared memory,
# UCX's shared-memory / cma / tcp transports): the production call sequence, every byte
# checked. Skipped with the reason where NIXL is not importable (CI).


@pytest.mark.skipif(nf.nixl_unavailable_reason() is not None,
                    reason=f"real NIXL not importable: {nf.nixl_unavailable_reason()}")
@pytest.mark.parametrize("engine", ["nixl", "nixl-oneshot", "nixl+pack", "nixl-bulk"])
@pytest.mark.parametrize("direction", ["pull", "push"])
def test_real_nixl_two_processes_host(spawner, engine, direction):
    out = run_two_processes(spawner, engine, direction, "host", patch_kernels=True)
    assert out[1]["wrong"] == [0, 0]
    initiator = out[1] if direction == "pull" else out[0]
    if engine == "nixl":
        assert initiator["extra"]["nixl_transfers_per_burst"] == 2 and initiator["extra"]["nixl_bursts"] == 3


# --------------------------------------------------------------------------- GPU: two processes, two GPUs


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["nixl", "nixl-oneshot", "nixl+pack", "nixl-bulk"])
@pytest.mark.parametrize("direction", ["pull", "push"])
def test_nixl_engines_two_gpus(spawner, engine, direction):
    why = two_gpus_reason()
    if why:
        pytest.skip(why)
    out = run_two_processes(spawner, engine, direction, "cuda", patch_kernels=False, bursts=3,
                             pool_bytes=64 << 20)
    assert out[1]["wrong"] == [0, 0, 0]
    initiator = out[1] if direction == "pull" else out[0]
    if engine != "nixl+pack":
        assert initiator["extra"].get("nixl_backend") == "UCX"


NIXL_ENGINE_NAMES = ("nixl", "nixl-oneshot", "nixl+pack", "nixl-bulk")


@pytest.mark.gpu
def test_nixl_engines_through_the_benchmark_runner(tmp_path):
    """``gpuxfer bench kv`` on two GPUs with every NIXL engine: every row verified byte for byte."""
    why = two_gpus_reason()
    if why:
        pytest.skip(why)
    import json
    import subprocess
    out = tmp_path / "kv"
    cmd = [sys.executable, "-m", "gpuxfer", "bench", "kv", "--platform", "cuda",
           "--engine", "bulk,triton," + ",".join(NIXL_ENGINE_NAMES) + ",mooncake",
           "--workload", "kv-dsv4", "--isl", "8k", "--page", "16,64", "--batch", "1,2",
           "--direction", "pull,push", "--trials", "3", "--warmup", "1", "--timeout", "120", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540)
    doc_path = out / "kv_bench.json"
    assert doc_path.exists(), f"no artifact; exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    doc = json.loads(doc_path.read_text())
    rows = doc["rows"]
    for engine in NIXL_ENGINE_NAMES:
        for direction in ("pull", "push"):
            mine = [r for r in rows if r["engine"] == engine and r["direction"] == direction]
            assert len(mine) == 4, f"{engine} {direction}: {len(mine)} rows; shed: {doc['shed']}"
            for r in mine:
                assert r.get("error") is None, r["error"]
                assert r["verified"] and r["valid"] and r["wrong_bytes"] == 0, r
                assert r["p50_gbps"] and r["p50_gbps"] > 0
                if engine in ("nixl", "nixl-oneshot"):
                    assert r.get("nixl_backend") == "UCX", r
    mc = [r for r in rows if r["engine"] == "mooncake"]
    if not mc:   # not installed / no nvlink_intra: skipped with the reason
        assert any(s.get("engine") == "mooncake" and s.get("reason") for s in doc["shed"]), doc["shed"]
    else:
        assert all(r["valid"] and r["wrong_bytes"] == 0 for r in mc)
    assert proc.returncode == 0, proc.stderr[-4000:]
