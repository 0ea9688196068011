"""scripts/kv_post_profile.py --batch N: KVAgent.post_many of N prepared requests over the host emulation whose
stream operations are counting no-ops; its row and its calls per post_many (structural, not timed)."""
from __future__ import annotations

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("kv_post_profile", os.path.join(ROOT, "scripts", "kv_post_profile.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("ids, uploads", [("host", 1.0), ("device", 2.0)])
def test_batch_of_four_is_one_post(script, ids, uploads, capsys):
    """Four small requests of one route: one upload (device IDs: and the status word's copy back), one graph
    launch and one event per post_many; the script prints the row and, with --profile, post_many's profile."""
    assert script.main(["--batch", "4", "--iters", "3", "--isl", "256", "--ids", ids, "--profile"]) == 0
    out = capsys.readouterr().out
    assert "many4: p50" in out and "post_many" in out and "function calls" in out
    res = script.run("kv-dsv4", 256, 16, "pull", 3, False, ids, 0, 4)
    row = res["rows"]["many4"]
    assert res["batch"] == 4 and row["p50_us"] > 0 and row["per_request_p50_us"] > 0
    assert row["calls_per_post"] == {"copy_async": uploads, "launch_graph": 1.0, "record_event": 1.0}


def test_batch_must_not_be_negative(script):
    with pytest.raises(SystemExit):
        script.main(["--batch", "-1"])
