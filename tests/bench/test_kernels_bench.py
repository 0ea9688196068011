"""``gpuxfer bench kernels`` end to end at tiny size on the host emulation (and its argument checks)."""
from __future__ import annotations

import json
import os

import pytest

from gpuxfer.cli import main


@pytest.mark.timeout(300)
def test_bench_kernels_runs_end_to_end_on_the_host_emulation(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GPUXFER_PLATFORM", "host")
    out = tmp_path / "k.json"
    rc = main(["bench", "kernels", "--platform", "host", "--sizes", "528,2304", "--pool", "24KiB",
               "--sweep", "1,sms,all", "--trials", "1", "--warmup", "0", "--json", str(out),
               "--out", str(tmp_path / "run")])
    text = capsys.readouterr().out
    assert rc == 0, text
    lines = text.splitlines()
    assert any(ln.startswith("#") and "EMULATION" in ln for ln in lines)
    header = next(ln for ln in lines if ln.startswith("#") and "GB/s" in ln and "wrong_B" in ln)
    assert "%ceil" in header and "(GB/s)" in lines[lines.index(header) + 1]
    assert "# Out of bounds values : 0 OK" in lines and "# Result: PASS (EMULATION)" in lines
    assert f"# json: {out}" in lines and (tmp_path / "run" / "kernels_bench.json").read_bytes() == out.read_bytes()
    assert os.stat(out).st_mode & 0o777 == 0o644
    doc = json.loads(out.read_text())
    assert doc["result"] == "PASS" and doc["wrong_bytes"] == 0 and doc["preamble"]["emulation"] is True
    ops = [r["op"] for r in doc["rows"]]
    for op in ("ce-pull", "ce-push", "hbm-copy", "pull", "push", "local", "pack", "unpack", "sweep", "exp+copy",
               "blocks"):
        assert op in ops
    assert ops.count("sweep") == 3 and ops.count("pull") == 2 and ops.count("blocks") == 2
    for r in doc["rows"]:
        assert r["wrong_bytes"] == 0 and r["bandwidth_gbps"] > 0 and r["time_p50_us"] > 0
        if r["op"] in ("pull", "push", "local", "pack", "unpack", "sweep", "exp+copy", "blocks"):
            assert r["ceiling_gbps"] > 0 and r["ceiling_pct"] > 0 and r["programs"] >= 1
    # the two ways of one request: the same rows, the descriptor buffer only on the expansion's side
    pairs = [(a, b) for a, b in zip(doc["rows"], doc["rows"][1:]) if (a["op"], b["op"]) == ("exp+copy", "blocks")]
    assert len(pairs) == 2
    for a, b in pairs:
        assert a["descriptors"] == b["descriptors"] and a["moved_bytes"] == b["moved_bytes"]
        assert a["descriptor_bytes"] == 24 * a["descriptors"] and b["descriptor_bytes"] == 0 and a["expand_us"] > 0
    assert doc["parameters"]["pool_bytes"] == 24 * 1024
    # the emulation has no SMs (doctor counts the host's CPUs there): no SM count pretends otherwise
    assert doc["preamble"]["local_device"]["sms"] is None and all(r["sms_used"] is None for r in doc["rows"])
    assert all(len(ln) <= 120 for ln in lines if ln.startswith("# ") and not ln[2:3].isspace()), text


@pytest.mark.timeout(300)
def test_bench_kernels_tilings_add_a_verified_blocks_row_each(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GPUXFER_PLATFORM", "host")
    out = tmp_path / "k.json"
    rc = main(["bench", "kernels", "--platform", "host", "--ops", "blocks", "--sizes", "528", "--pool", "24KiB",
               "--sweep", "", "--tilings", "r8w4u1n4, r16w8u2n4p1", "--trials", "1", "--warmup", "0",
               "--json", str(out), "--out", str(tmp_path / "run")])
    text = capsys.readouterr().out
    assert rc == 0, text
    doc = json.loads(out.read_text())
    blocks = [r for r in doc["rows"] if r["op"] == "blocks"]
    assert doc["parameters"]["tilings"] == ["r8w4u1n4p2", "r16w8u2n4p1"]
    assert [r["tiling"] for r in blocks[1:]] == ["r8w4u1n4p2", "r16w8u2n4p1"]
    assert blocks[1]["config"]["rows"] == 8 and blocks[2]["config"]["programs_per_sm"] == 1
    assert all(r["wrong_bytes"] == 0 and r["descriptors"] == blocks[0]["descriptors"] for r in blocks)
    assert "tiling r16w8u2n4p1" in text


@pytest.mark.parametrize("argv, match", [
    (["--ops", "blocks", "--tilings", "r8w4"], "--tilings: expected rROWSwWIDTHuUNROLLnWARPS"),
    (["--ops", "blocks", "--tilings", "r8w3u1n4"], "--tilings r8w3u1n4: CopyConfig.width must be a power of two"),
    (["--ops", "blocks", "--tilings", "r8w4u1n3"], "--tilings r8w4u1n3: CopyConfig.num_warps"),
    (["--ops", "pull", "--tilings", "r8w4u1n4"], "--tilings: it tiles the blocks rows"),
    (["--sizes", "0"], "--sizes"),
    (["--ops", "pull,teleport"], "unknown teleport"),
    (["--sweep", "1,many"], "--sweep"),
    (["--pool", "lots"], "--pool: cannot read 'lots'"),
    (["--pool", "0"], "--pool: '0' must be positive"),
    (["--pool", "1KiB", "--sizes", "2304"], "larger than the pool"),
    (["--local-device", "7"], "--local-device 7"),
    (["--trials", "0"], "--trials: must be >= 1"),
    (["--warmup", "-3"], "--warmup: must be >= 0"),
    (["--timeout", "0"], "--timeout: must be a positive number"),
    (["--platform", "tpu"], "--platform: unknown platform 'tpu'"),
    (["--json", "/proc/gpuxfer-no-such-dir/k.json"], "--json: directory /proc/gpuxfer-no-such-dir does not exist"),
    (["--json", "/proc/k.json"], "--json: cannot write in"),
    (["--out", "/proc/gpuxfer-no-such-dir"], "--out: cannot write in"),
])
def test_bench_kernels_rejects_bad_arguments(capsys, monkeypatch, tmp_path, argv, match):
    """Checked before a device or the helper is touched: one line on stderr, exit 2, nothing written."""
    monkeypatch.setenv("GPUXFER_PLATFORM", "host")
    argv = argv if "--out" in argv else [*argv, "--out", str(tmp_path / "o")]
    rc = main(["bench", "kernels", "--platform", "host", *argv])
    cap = capsys.readouterr()
    assert rc == 2 and match in cap.err, cap.err
    assert cap.err.startswith("gpuxfer bench kernels: error: ") and cap.err.count("\n") == 1 and cap.out == ""
    assert not (tmp_path / "o").exists()


def test_bench_kernels_json_replaces_a_symlink_instead_of_following_it(tmp_path):
    from gpuxfer.bench.cliutil import write_atomic
    target = tmp_path / "elsewhere"
    os.symlink(target, tmp_path / "k.json")
    os.symlink(target, tmp_path / "k.json.tmp")        # a symlink planted at a predictable temporary name
    write_atomic(str(tmp_path / "k.json"), "{}")
    assert not target.exists() and (tmp_path / "k.json").read_text() == "{}"


def test_write_atomic_syncs_before_the_name_and_never_overwrites_without_replace(tmp_path, monkeypatch):
    """The data reaches the disk before the file takes its name (a crash leaves the old file or the whole
    new one); ``replace=False`` (``--json PATH``) keeps a file that appeared meanwhile, and leaves no temporary."""
    import gpuxfer.bench.cliutil as cu
    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(cu.os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(cu.os, "replace", lambda a, b: (calls.append("replace"), real_replace(a, b))[1])
    cu.write_atomic(str(tmp_path / "a.json"), "{}")
    assert calls[:2] == ["fsync", "replace"] and (tmp_path / "a.json").read_text() == "{}"
    (tmp_path / "b.json").write_text("earlier")
    with pytest.raises(cu.BadInput, match="exists; it is kept"):
        cu.write_atomic(str(tmp_path / "b.json"), "{}", replace=False)
    assert (tmp_path / "b.json").read_text() == "earlier"
    cu.write_atomic(str(tmp_path / "c.json"), "{}", replace=False)
    assert (tmp_path / "c.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.json", "c.json"]


@pytest.mark.timeout(300)
def test_bench_kernels_fails_on_a_wrong_byte(tmp_path, capsys, monkeypatch):
    """The bench's own verification: one flipped destination byte per checked row fails the run (exit 1)."""
    import gpuxfer.kernels.launch as launch
    monkeypatch.setenv("GPUXFER_PLATFORM", "host")
    real = launch.verify

    def corrupting_verify(dst_pool, descs, seed, **kw):
        dst_pool[int(descs[0, 1])] ^= 0xFF        # a byte the copy wrote, flipped before the check
        return real(dst_pool, descs, seed, **kw)
    monkeypatch.setattr(launch, "verify", corrupting_verify)
    out = tmp_path / "k.json"
    rc = main(["bench", "kernels", "--platform", "host", "--sizes", "528", "--pool", "8KiB", "--ops", "local",
               "--sweep", "", "--trials", "1", "--warmup", "0", "--json", str(out), "--out", str(tmp_path / "run")])
    text = capsys.readouterr().out
    assert rc == 1, text
    assert "# Result: FAIL: wrong bytes (EMULATION)" in text
    doc = json.loads(out.read_text())
    assert doc["result"] == "FAIL" and doc["wrong_bytes"] > 0
    assert all(r["wrong_bytes"] == 1 for r in doc["rows"])
