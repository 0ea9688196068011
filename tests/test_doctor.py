"""``gpuxfer doctor``: reports, exit codes, and the capability lookups of other layers."""
from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

from gpuxfer import doctor
from gpuxfer.cli import main
from gpuxfer.platforms import PLATFORMS


def _json(capsys, *argv) -> tuple[int, dict]:
    rc = main(["doctor", "--json", *argv])
    return rc, json.loads(capsys.readouterr().out)


def test_json_on_host(capsys, monkeypatch):
    monkeypatch.setenv("GPUXFER_HOST_DEVICES", "3")
    rc, rep = _json(capsys, "--platform", "host")
    assert rc == 0
    assert rep["platform"]["name"] == "host" and rep["platform"]["is_emulation"]
    assert "EMULATION" in rep["platform"]["label"]
    assert set(rep["skipped"]) == set(PLATFORMS) - {"host"}
    assert all(isinstance(v, str) and v for v in rep["skipped"].values())
    assert [d["index"] for d in rep["devices"]] == [0, 1, 2]
    assert all(d["stream_mem_ops_64"] is True for d in rep["devices"])
    assert len(rep["links"]) == 9
    assert {ln["kind"] for ln in rep["links"] if ln["src"] != ln["dst"]} == {"shared-memory"}
    for key in ("python", "gpuxfer", "torch", "triton", "numpy", "cupy", "cuda-bindings", "nvidia-ml-py", "nixl"):
        assert rep["versions"][key]
    for key in ("pp_backends", "kv_engines", "kv_routes"):
        assert (rep[key] is None) != (rep[f"{key}_note"] is None)
    assert rep["kv_routes"]["ipc"] is None and set(rep["kv_routes"]) == {"ipc", "nixl"}
    assert rep["config"]["GPUXFER_HOST_DEVICES"] == {"value": 3, "set": True, "error": None}


@pytest.mark.parametrize("mode,per_row", [("blocks", 0), ("descriptors", 24)])
def test_the_kv_slots_device_memory_is_reported(capsys, monkeypatch, mode, per_row):
    """``doctor`` says what a KV slot holds on the device beyond the caches, by ``GPUXFER_KV_COPY``: its block IDs,
    and a descriptor table only with descriptor slots."""
    monkeypatch.setenv("GPUXFER_KV_COPY", mode)
    rc, rep = _json(capsys, "--platform", "host")
    assert rc == 0 and rep["kv_slot_memory"] == {"GPUXFER_KV_COPY": mode, "bytes_per_block_id": 8,
                                                 "bytes_per_descriptor": per_row}
    assert main(["doctor", "--platform", "host"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"GPUXFER_KV_COPY={mode}" in out and ("no descriptor table" in out) == (mode == "blocks")


def test_text_says_emulation_loudly(capsys, monkeypatch):
    monkeypatch.setenv("GPUXFER_PP_TIMEOUT_S", "45")
    assert main(["doctor", "--platform", "host"]) == 0
    out = capsys.readouterr().out
    assert "EMULATION" in out and "links" in out and "devices" in out and "versions" in out
    assert "KVAgent routes to peers" in out
    assert "GPUXFER_PP_TIMEOUT_S" in out and "45.0" in out


def test_unusable_forced_platform_reports_why_and_exits_1(capsys, monkeypatch):
    monkeypatch.setitem(PLATFORMS, "rocm", ("gpuxfer.platforms._no_such_module", "RocmPlatform"))
    rc, rep = _json(capsys, "--platform", "rocm")
    assert rc == 1
    assert rep["platform"] is None and "ModuleNotFoundError" in rep["platform_error"]
    assert "ModuleNotFoundError" in rep["skipped"]["rocm"]
    assert rep["versions"]["torch"]


def test_capability_report_lookup(monkeypatch, host):
    rep, note = doctor.capability_report("gpuxfer._no_such_module", "backend_report", host)
    assert rep is None and note.startswith("report failed")

    mod = types.ModuleType("gpuxfer._fake_selection")
    mod.backend_report = lambda platform: {"nccl": None, "copy_engine": "needs NVLink"}
    mod.broken_report = lambda platform: 1 / 0
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    assert doctor.capability_report(mod.__name__, "backend_report", host) == (
        {"nccl": None, "copy_engine": "needs NVLink"}, None)
    rep, note = doctor.capability_report(mod.__name__, "no_such_function", host)
    assert rep is None and note.startswith("report failed")
    rep, note = doctor.capability_report(mod.__name__, "broken_report", host)
    assert rep is None and note.startswith("report failed: ZeroDivisionError")


def test_rendered_capability_tables(capsys, monkeypatch):
    mod = types.ModuleType("gpuxfer._fake_engines")
    mod.engine_report = lambda platform: {"bulk": None, "nixl": "nixl is not installed"}
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(doctor, "_CAPABILITY_REPORTS", [("kv_engines", mod.__name__, "engine_report")])
    assert main(["doctor", "--platform", "host"]) == 0
    out = capsys.readouterr().out
    assert "KV engines" in out and "nixl is not installed" in out


@pytest.mark.timeout(120)
def test_console_script_exits_0():
    out = subprocess.run([sys.executable, "-m", "gpuxfer", "doctor", "--json"], capture_output=True, text=True,
                         timeout=100)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["platform"]["name"]


@pytest.mark.parametrize("var, value, message", [
    ("GPUXFER_PLATFORM", "bogus", "GPUXFER_PLATFORM='bogus' is not a platform"),
    ("GPUXFER_HOST_DEVICES", "abc", "GPUXFER_HOST_DEVICES must be an integer, got 'abc'"),
    ("GPUXFER_HOST_DEVICES", "0", "GPUXFER_HOST_DEVICES must be >= 1"),
])
@pytest.mark.parametrize("as_json", [False, True])
def test_bad_environment_is_one_line_naming_the_variable(capsys, monkeypatch, var, value, message, as_json):
    monkeypatch.setenv(var, value)
    if var == "GPUXFER_HOST_DEVICES":
        monkeypatch.setenv("GPUXFER_PLATFORM", "host")
    rc = main(["doctor", *(["--json"] if as_json else [])])
    cap = capsys.readouterr()
    assert rc == 2 and cap.out == ""
    assert cap.err == f"gpuxfer doctor: error: {cap.err.split('error: ', 1)[1]}" and cap.err.count("\n") == 1
    assert message in cap.err and "Traceback" not in cap.err


def test_messages_are_not_read_as_markup(capsys, monkeypatch):
    """`install gpuxfer[rocm]` stays as written (rich would read `[rocm]` as a style and drop it)."""
    mod = types.ModuleType("gpuxfer._fake_engines2")
    mod.engine_report = lambda platform: {"sdma": "install gpuxfer[rocm] for [bold]this[/bold]"}
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(doctor, "_CAPABILITY_REPORTS", [("kv_engines", mod.__name__, "engine_report")])
    real = doctor.unavailable_reason
    monkeypatch.setattr(doctor, "unavailable_reason",
                        lambda n: "hip-python is missing: install gpuxfer[rocm]" if n == "rocm" else real(n))
    assert main(["doctor", "--platform", "host"]) == 0
    out = capsys.readouterr().out
    assert "install gpuxfer[rocm] for [bold]this[/bold]" in out
    assert "hip-python is missing: install gpuxfer[rocm]" in out


def test_two_cupy_packages_are_flagged(capsys, monkeypatch):
    monkeypatch.setattr(doctor, "library_versions",
                        lambda: {"cupy": "cupy-cuda12x 14.2.0, cupy-cuda13x 14.2.0", "torch": "2.13.0"})
    rc, rep = _json(capsys, "--platform", "host")
    assert rc == 0 and len(rep["problems"]) == 1 and "2 CuPy packages" in rep["problems"][0]
    assert main(["doctor", "--platform", "host"]) == 0
    assert "problem:" in capsys.readouterr().out
    assert doctor.install_problems({"cupy": "cupy-cuda12x 14.2.0"}) == []
    assert doctor.install_problems({"cupy": "not installed"}) == []
