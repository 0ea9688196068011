"""`gpuxfer bench kv --plan-only`: the table, the JSON, and clear errors for bad options."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gpuxfer.cli import build_parser, main
from gpuxfer.errors import BadInput
from gpuxfer.bench.kv.cli import parse_grid_args, parse_list, parse_run_options, parse_size
from gpuxfer.bench.kv.engines import DEFAULT_ENGINES


def _full_plan(capsys, *argv):
    """The command with --full: the grid of a GPU run, whatever this machine has (the host's small grid
    is tests/bench/test_kv_bench.py's)."""
    rc = main(["bench", "kv", "--full", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_plan_only_prints_the_grid(capsys):
    rc, out, err = _full_plan(capsys, "--plan-only")
    assert rc == 0, err
    for text in ("kv-dsv4", "131,304", "38,778", "183.1 MB", "1,2,4,8,16,32,64", "pool", "no batch shed"):
        assert text in out


def test_plan_only_reports_shed_batches_with_reasons(capsys):
    rc, out, _ = _full_plan(capsys, "--plan-only", "--isl", "8k,32k,128k,512k", "--pool-budget", "16GiB")
    assert rc == 0
    assert "shed batches" in out and "descriptor-budget" in out and "pool-budget" in out
    assert "2,093,544" in out                  # 512k at 16-token pages


def test_plan_only_json_matches_the_grid(capsys):
    rc, out, _ = _full_plan(capsys, "--plan-only", "--json", "--isl", "32k,512k", "--workload", "kv-dsv4,kv-dsv4-vllm")
    assert rc == 0
    doc = json.loads(out)
    assert doc["kind"] == "gpuxfer-kv-plan"
    grid = doc["grid"]
    assert grid["pool_budget_bytes"] == 64 << 30 and grid["desc_budget_descriptors"] == 1 << 24
    pts = {(p["workload"], p["isl_tokens"], p["page_tokens"]): p for p in grid["points"]}
    assert pts[("kv-dsv4", 32768, 16)]["request_descriptors"] == 131_304
    assert pts[("kv-dsv4", 32768, 64)]["request_descriptors"] == 38_778
    assert pts[("kv-dsv4", 32768, 64)]["request_bytes"] == 183_066_624
    assert pts[("kv-dsv4", 524288, 16)]["request_descriptors"] == 2_093_544
    assert pts[("kv-dsv4-vllm", 32768, 256)]["request_descriptors"] == 132
    p = pts[("kv-dsv4", 524288, 16)]
    assert p["batches"] == [1, 2, 4, 8]
    assert [s["batch"] for s in p["shed"]] == [16, 32, 64]
    assert all(s["reason"] == "descriptor-budget" and s["detail"] for s in p["shed"])
    assert p["pool_per_rank_bytes"] > 0 and p["bursts"][-1]["burst_descriptors"] == 8 * 2_093_544
    assert doc["run"]["engines"] == list(DEFAULT_ENGINES) and doc["run"]["trials"] == 5
    assert set(doc["workloads"]) == {"kv-dsv4", "kv-dsv4-vllm"}
    # same content as the table
    _, table, _ = _full_plan(capsys, "--plan-only", "--isl", "32k,512k", "--workload", "kv-dsv4,kv-dsv4-vllm")
    for key in pts:
        assert f"{pts[key]['request_descriptors']:,}" in table


def test_defaults():
    args = build_parser().parse_args(["bench", "kv"])
    grid = parse_grid_args(args)
    opts = parse_run_options(args)
    assert [(p.workload.name, p.isl_tokens, p.page_tokens) for p in grid.points] == \
        [("kv-dsv4", 32768, 16), ("kv-dsv4", 32768, 64)]
    assert grid.points[0].batches == (1, 2, 4, 8, 16, 32, 64)
    assert opts.engines == ("triton", "pack", "copy_engine", "bulk") and opts.directions == ("pull", "push")
    assert opts.trials == 5 and opts.seed == 0 and opts.platform == "auto" and not opts.plan_only


@pytest.mark.parametrize("argv,option", [
    (["--isl", "3x"], "--isl"),
    (["--isl", "0"], "--isl"),
    (["--isl", "1.3k"], "--isl"),
    (["--isl", ""], "--isl"),
    (["--page", "6"], "--page"),
    (["--page", "16", "--workload", "kv-dsv4-vllm"], "--page"),
    (["--page", "16,,64"], "--page"),
    (["--batch", "0"], "--batch"),
    (["--batch", "two"], "--batch"),
    (["--pool-budget", "lots"], "--pool-budget"),
    (["--pool-budget", "0GiB"], "--pool-budget"),
    (["--pool-budget", "64Gx"], "--pool-budget"),
    (["--desc-budget", "-5"], "--desc-budget"),
    (["--trials", "0"], "--trials"),
    (["--trials", "x"], "--trials"),
    (["--engine", "no-such-engine"], "--engine"),
    (["--direction", "sideways"], "--direction"),
    (["--workload", "kv-llama"], "--workload"),
    (["--seed", "-1"], "--seed"),
    (["--seed", "abc"], "--seed"),
    (["--platform", "tpu"], "--platform"),
    (["--out", " "], "--out"),
])
def test_bad_options_fail_clearly(capsys, argv, option):
    rc, out, err = _full_plan(capsys, "--plan-only", *argv)
    assert rc == 2 and out == ""
    assert err.startswith("gpuxfer bench kv: error: ") and option in err


def test_unknown_workload_error_lists_the_known_ones(capsys):
    _, _, err = _full_plan(capsys, "--plan-only", "--workload", "kv-llama")
    for name in ("kv-dsv4", "kv-dsv4-vllm", "kv-mla", "kv-gqa"):
        assert name in err


@pytest.mark.parametrize("text,kind,value", [
    ("32k", "tokens", 32768), ("512K", "tokens", 524288), ("4096", "tokens", 4096), ("1.5k", "tokens", 1536),
    ("64GiB", "bytes", 64 << 30), ("64G", "bytes", 64 << 30), ("64GB", "bytes", 64 * 10 ** 9),
    ("512MiB", "bytes", 512 << 20), ("100B", "bytes", 100), ("16M", "descriptors", 1 << 24),
])
def test_parse_size(text, kind, value):
    assert parse_size(text, option="--x", kind=kind) == value


@pytest.mark.parametrize("text", ["", "k", "-1", "0", "1.3k", "12 apples", "64GB", "0.5"])
def test_parse_size_rejects(text):
    with pytest.raises(BadInput, match="--x"):
        parse_size(text, option="--x", kind="tokens")


def test_parse_list():
    assert parse_list("1, 2,2,3", option="--b", item=int) == [1, 2, 3]
    for bad in ("", " ", "1,", ",1"):
        with pytest.raises(BadInput, match="--b"):
            parse_list(bad, option="--b", item=int)


def test_plan_only_end_to_end_in_a_fresh_process():
    env = dict(os.environ, GPUXFER_PLATFORM="host")
    proc = subprocess.run([sys.executable, "-m", "gpuxfer", "bench", "kv", "--plan-only", "--json", "--full"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["grid"]["points"][0]["request_descriptors"] == 131_304


def test_defaults_are_resolved_in_one_place_and_typed_values_stay():
    """Options left out are None until resolve_defaults fills them (the host emulation's small grid, or a
    GPU run's); a value typed equal to a default is the user's and is kept."""
    from gpuxfer.bench.kv.options import DEFAULTS, parse_grid_spec, resolve_defaults
    args = build_parser().parse_args(["bench", "kv", "--trials", DEFAULTS["trials"], "--batch", "1,2"])
    assert args.isl is None and args.warmup is None
    shrunk = resolve_defaults(args, host=True)
    assert args.given == {"trials", "batch"} and args.trials == "5" and args.batch == "1,2"
    assert shrunk == {"isl": "16", "page": "16", "pool_budget": "256MiB", "warmup": "0"}
    assert resolve_defaults(args, host=False) == shrunk and args.isl == "16"      # idempotent
    spec = parse_grid_spec(args)
    assert [w.name for w in spec.workloads] == ["kv-dsv4"] and spec.isls == (16,) and spec.batches == (1, 2)
    assert spec.build().points[0].workload is spec.workloads[0]           # the workload travels as an object
    gpu = build_parser().parse_args(["bench", "kv"])
    assert resolve_defaults(gpu) == {} and gpu.given == frozenset() and gpu.isl == DEFAULTS["isl"]


@pytest.mark.parametrize("argv, option", [
    (["--workload", "kv-dsv4"], "--workload"), (["--pool-budget", "64GiB"], "--pool-budget"),
    (["--desc-budget", "16M"], "--desc-budget"),
])
def test_the_suite_refuses_what_it_fixes_even_when_typed_as_the_default(argv, option):
    with pytest.raises(BadInput, match=f"{option}: --suite collectivex fixes it"):
        parse_grid_args(build_parser().parse_args(["bench", "kv", "--suite", "collectivex", *argv]))


def _host_plan(capsys, *argv):
    rc = main(["bench", "kv", "--platform", "host", "--plan-only", *argv])
    out, err = capsys.readouterr()
    assert rc == 0, err
    if "--json" not in argv:           # the plan fits 120 columns when piped
        assert max(len(ln) for ln in out.splitlines()) <= 120, out
    return out


def test_the_run_report_wraps_its_prose_at_120_columns(capsys):
    """Long prose (an engine's reason, a shed row's, a note) is wrapped; table rows keep their columns."""
    from gpuxfer.bench.kv import report as R
    rep = R.Reporter(out_dir=None, plots=False)
    why = "NIXL is not installed: " + "pip install something long " * 12
    rep.handle("start", {"env": {"is_emulation": True, "engines": {"nixl": why, "nixl-bulk": why}},
                         "params": {"engines": ["bulk"]}, "expected_rows": 1,
                         "shed": [{"engine": "nixl", "reason": why, "rows": 0}]})
    rep.handle("note", {"text": why})
    out = capsys.readouterr().out
    lines = out.splitlines()
    prose = [ln for ln in lines if ln.startswith("# ") and not ln[2:3].isspace() and ln not in R.header_lines()]
    assert len(prose) > 3 and max(len(ln) for ln in prose) <= 120, out
    assert any(ln.startswith("#   ") for ln in lines), out


def test_the_host_plan_is_the_run_rows_and_time_included(capsys):
    """The suite's plan counts its bulk rows (page 64, one descriptor, every engine and direction), gives
    a time, and names the suite's own --full; an estimate grows with the bytes."""
    out = _host_plan(capsys, "--suite", "collectivex")
    assert "16 rows (8 paged + 8 bulk" in out and "minutes" in out
    assert "`gpuxfer bench kv --suite collectivex --full`" in out
    small = _host_plan(capsys)
    assert "8 rows: engines triton, pack, copy_engine, bulk; pull and push" in small
    big = json.loads(_host_plan(capsys, "--isl", "1.5k", "--json"))["rows"]
    default = json.loads(_host_plan(capsys, "--json"))["rows"]
    assert big["rows"] == default["rows"] == 8 and big["estimate_s"] > 3 * default["estimate_s"]
    assert big["emulation"] is True


def test_the_banner_says_what_will_run(capsys):
    """--engine triton --direction pull: one row, one engine, one direction (not every engine, both ways)."""
    out = _host_plan(capsys, "--engine", "triton", "--direction", "pull")
    assert "rows: 1 row: engines triton; pull;" in out
    assert "every engine" not in out and "both directions" not in out


def test_the_summary_covers_the_suites_bulk_rows():
    from gpuxfer.bench.kv import report as R
    base = {"workload": "kv-dsv4", "isl_tokens": 16, "direction": "pull", "batch": 1, "valid": True,
            "p50_gbps": 0.5, "of_ceiling_pct": 50.0, "per_descriptor_p50_us": 3.0}
    rows = [dict(base, engine="triton", page_tokens=16), dict(base, engine="triton", page_tokens=64, kind="bulk"),
            dict(base, engine="bulk", page_tokens=64, kind="bulk", p50_gbps=1.0, of_ceiling_pct=100.0)]
    summ = R.summary(rows)
    assert [(s["kind"], s["engine"]) for s in summ] == [("paged", "triton"), ("bulk", "triton"), ("bulk", "bulk")]
    lines = R.summary_lines(summ)
    assert sum(" bulk pull triton" in line for line in lines) == 1


def test_the_engines_line_says_each_reason_once_and_short():
    from gpuxfer.bench.kv.report import REASON_CHARS, engines_line
    why = "NIXL is not installed (tried nixl_cu13, nixl_cu12, nixl): pip install nixl-cu13 " + "x" * 300
    line = engines_line({"bulk": None, "triton": None, "nixl": why, "nixl-bulk": why, "mooncake": "no module"})
    assert line.startswith("# engines: bulk, triton ok; nixl, nixl-bulk unusable (NIXL is not installed")
    assert line.count("NIXL is not installed") == 1 and "mooncake unusable (no module)" in line
    assert len(line) < 2 * REASON_CHARS + 100


def test_negative_and_zero_token_counts_read_alike(capsys):
    for isl in ("0", "-5"):
        rc = main(["bench", "kv", "--platform", "host", "--plan-only", "--isl", isl])
        err = capsys.readouterr().err
        assert rc == 2 and "--isl:" in err and "must be positive" in err, err


def test_budgets_print_in_the_units_they_are_given(capsys):
    from gpuxfer.bench.kv.cli import binary_bytes
    assert (binary_bytes(256 << 20), binary_bytes(64 << 30), binary_bytes(3 << 29)) == ("256 MiB", "64 GiB", "1.5 GiB")
    out = _host_plan(capsys)
    assert "pool budget 256 MiB per rank" in out


def test_an_interrupted_run_says_so_first_and_exits_130(tmp_path, capsys):
    """Ctrl-C: the headline is the interruption (not a rank's exit code -9), the exit code is 130."""
    from gpuxfer.bench.kv import report as R
    rep = R.Reporter(out_dir=str(tmp_path), plots=False, argv=["gpuxfer", "bench", "kv"])
    rep.handle("start", {"env": {"is_emulation": True}, "params": {}, "shed": [], "expected_rows": 8})
    rep.error("rank 0 (prefill): KeyboardInterrupt: ")
    rep.error("rank 0 (gpuxfer-kv-prefill, pid 1) exited with code -9")
    rep.error("interrupted")
    assert rep.finish() == R.EXIT_INTERRUPTED == 130
    out = capsys.readouterr().out
    assert "# Result: FAIL: interrupted (Ctrl-C) after 0 of 8 rows" in out and "code -9" not in out.split("# ERROR")[-1]
    assert json.loads((tmp_path / "kv_bench.json").read_text())["outcome"]["status"] == "interrupted"


def test_an_interrupted_run_leaves_latest_and_no_empty_directory(tmp_path, monkeypatch, capsys):
    import gpuxfer.bench.kv.runner as runner

    def interrupted(cfg):
        from gpuxfer.bench.kv import report as R
        rep = R.Reporter(out_dir=cfg.out, plots=False)
        rep.handle("start", {"env": {}, "params": {}, "shed": [], "expected_rows": 8})
        rep.error("interrupted")
        return rep.finish()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runner, "run_sweep", interrupted)
    rc = main(["bench", "kv", "--platform", "host", "--engine", "bulk", "--direction", "pull"])
    capsys.readouterr()
    assert rc == 130
    root = tmp_path / "gpuxfer-out" / "kv"
    assert not (root / "latest").exists() and [p.name for p in root.iterdir()] == []


def test_the_progress_bar_names_the_running_row(capsys):
    from gpuxfer.bench.kv import report as R
    rep = R.Reporter(out_dir=None, plots=False)

    class Bar:
        def __init__(self):
            self.calls = []

        def update(self, task, **kw):
            self.calls.append(kw)
    rep._progress, rep._task = Bar(), 0
    rep.handle("running", {"engine": "pack", "direction": "push", "page_tokens": 16, "batch": 4})
    assert rep._progress.calls == [{"description": "running: pack push page 16 batch 4"}]
