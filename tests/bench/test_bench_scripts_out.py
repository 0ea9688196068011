"""scripts/vllm_connector_bench.py, scripts/sglang_backend_bench.py and scripts/host_floor_probe.py check where
their JSON goes before the runs (minutes on a GPU): a missing or unwritable directory is a one-line usage error
(exit 2), not a traceback at the end that loses every measurement."""
from __future__ import annotations

import importlib.util
import os
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_script_{name}", os.path.join(ROOT, "scripts", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _no_run(monkeypatch, module: str, *names: str) -> None:
    """The harness module the script runs its instances with: reaching it means the run started."""
    def started(*a, **k):
        raise RuntimeError("the run started")
    fake = types.ModuleType(module)
    for n in names:
        setattr(fake, n, started)
    fake.MOONCAKE_ENV = {}
    monkeypatch.setitem(sys.modules, module, fake)


@pytest.mark.parametrize("script, option, module, names", [
    ("vllm_connector_bench", "--out", "vllm_instance", ("write_model", "Instance", "free_port")),
    ("sglang_backend_bench", "--json", "sglang_instance", ("Rank", "mooncake_library_path")),
])
@pytest.mark.parametrize("where, message", [
    ("/proc/gpuxfer-no-such-dir/o.json", "directory /proc/gpuxfer-no-such-dir does not exist"),
    ("/proc/o.json", "cannot write in /proc"),
])
def test_the_json_place_is_checked_before_the_runs(capsys, monkeypatch, script, option, module, names, where,
                                                   message):
    _no_run(monkeypatch, module, *names)
    mod = _script(script)
    with pytest.raises(SystemExit) as exc:
        mod.main([option, where, "--platform" if script.startswith("sglang") else "--device", "host"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"{option}: " in err and message in err, err


@pytest.mark.parametrize("script, option, module, names", [
    ("vllm_connector_bench", "--out", "vllm_instance", ("write_model", "Instance", "free_port")),
    ("sglang_backend_bench", "--json", "sglang_instance", ("Rank", "mooncake_library_path")),
])
def test_an_existing_json_file_is_kept(capsys, monkeypatch, tmp_path, script, option, module, names):
    _no_run(monkeypatch, module, *names)
    path = tmp_path / "o.json"
    path.write_text("earlier")
    with pytest.raises(SystemExit) as exc:
        _script(script).main([option, str(path), "--platform" if script.startswith("sglang") else "--device", "host"])
    assert exc.value.code == 2 and "exists" in capsys.readouterr().err and path.read_text() == "earlier"


def test_the_floor_probe_checks_its_json_place_before_it_measures(capsys, tmp_path):
    """scripts/host_floor_probe.py: an existing file or a missing directory is a usage error before the platform
    is even asked (on this machine it would otherwise stop at "needs CUDA", exit 1)."""
    path = tmp_path / "o.json"
    path.write_text("earlier")
    mod = _script("host_floor_probe")
    for where, message in ((str(path), "exists"), ("/proc/gpuxfer-no-such-dir/o.json", "does not exist")):
        with pytest.raises(SystemExit) as exc:
            mod.main(["--json", where])
        assert exc.value.code == 2 and message in capsys.readouterr().err
    assert path.read_text() == "earlier"
