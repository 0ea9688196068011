"""scripts/kv_host_costs.py's measurements on the host emulation, one small request each (not timed: each row
comes back with its fields and, with ``--profile``, the profile of its loop)."""
from __future__ import annotations

import importlib.util
import os

import pytest


@pytest.fixture(scope="module")
def script():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("kv_host_costs", os.path.join(root, "scripts", "kv_host_costs.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_pack_rows_profile_the_prepare_and_post_loop(script, host):
    row = script.measure_pack(host, "kv-mla", 16, 16, 1, True)
    assert row["engine"] == "pack" and row["post_p50_us"] > 0
    assert "post" in row["profile"] and "function calls" in row["profile"]


def test_batch_rows_profile_post_many(script, host):
    row = script.measure_batch(host, "kv-mla", 16, 16, "pull", 2, 1, profile=True)
    assert row["batch"] == 2 and row["post_many_p50_us"] > 0
    assert "post_many" in row["profile"]
