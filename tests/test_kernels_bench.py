"""``gpuxfer bench kernels`` end to end at tiny size on the host emulation (and its argument checks)."""
from __future__ import annotations

import json

import pytest

from gpuxfer.cli import main


@pytest.mark.timeout(300)
def test_bench_kernels_runs_end_to_end_on_the_host_emulation(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GPUXFER_PLATFORM", "host")
    out = tmp_path / "k.json"
    rc = main(["bench", "kernels", "--platform", "host", "--sizes", "528,2304", "--pool", "24KiB",
               "--sweep", "1,sms,all", "--trials", "1", "--warmup", "0", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    lines = text.splitlines()
    assert any(ln.startswith("#") and "EMULATION" in ln for ln in lines)
    header = next(ln for ln in lines if ln.startswith("#") and "GB/s" in ln and "wrong_B" in ln)
    assert "%ceil" in header and "(GB/s)" in lines[lines.index(header) + 1]
    assert lines[-2].endswith("PASS") or lines[-1].endswith("PASS")
    doc = json.loads(out.read_text())
    assert doc["result"] == "PASS" and doc["wrong_bytes"] == 0 and doc["preamble"]["emulation"] is True
    ops = [r["op"] for r in doc["rows"]]
    for op in ("ce-pull", "ce-push", "hbm-copy", "pull", "push", "local", "pack", "unpack", "sweep"):
        assert op in ops
    assert ops.count("sweep") == 3 and ops.count("pull") == 2
    for r in doc["rows"]:
        assert r["wrong_bytes"] == 0 and r["bandwidth_gbps"] > 0 and r["time_p50_us"] > 0
        if r["op"] in ("pull", "push", "local", "pack", "unpack", "sweep"):
            assert r["ceiling_gbps"] > 0 and r["ceiling_pct"] > 0 and r["programs"] >= 1
    assert doc["parameters"]["pool_bytes"] == 24 * 1024


@pytest.mark.parametrize("argv, match", [
    (["--sizes", "0"], "--sizes"),
    (["--ops", "pull,teleport"], "unknown teleport"),
    (["--sweep", "1,many"], "--sweep"),
    (["--pool", "lots"], "cannot read a size"),
    (["--pool", "1KiB", "--sizes", "2304"], "larger than the pool"),
    (["--local-device", "7"], "--local-device 7"),
])
def test_bench_kernels_rejects_bad_arguments(capsys, monkeypatch, argv, match):
    monkeypatch.setenv("GPUXFER_PLATFORM", "host")
    rc = main(["bench", "kernels", "--platform", "host", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and match in err, err
