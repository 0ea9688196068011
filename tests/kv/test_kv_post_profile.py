"""scripts/kv_post_profile.py (the Python of a KV ``post()`` over a host emulation whose stream operations
are counting no-ops) runs, and counts the platform calls a ``triton`` post makes: a post of a transfer just
prepared uploads the request, launches the slot's graph and records its event -- it queries no event (the
prepare dropped the completed posts); a re-post queries at most one per post, amortised. Structural, not
timed."""
from __future__ import annotations

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _harness():
    spec = importlib.util.spec_from_file_location("kv_post_profile",
                                                  os.path.join(ROOT, "scripts", "kv_post_profile.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("op", ["pull", "push"])
def test_post_harness_counts_the_calls(op):
    res = _harness().run("kv-dsv4", 256, 16, op, 40, False)
    rows = res["rows"]
    assert rows["fresh"]["calls_per_post"] == {"copy_async": 1.0, "launch_graph": 1.0, "record_event": 1.0}
    repost = dict(rows["repost"]["calls_per_post"])
    assert repost.pop("event_query", 0.0) <= 1.0
    assert repost == {"copy_async": 1.0, "launch_graph": 1.0, "record_event": 1.0}
    assert all(rows[k]["p50_us"] > 0 for k in ("fresh", "repost", "prepare"))


def test_post_harness_with_device_ids_counts_the_checked_post():
    """Device IDs: the header upload, the checked graph, the status word's copy back and the event (on the
    emulation a slot has no host words, so the post is not folded)."""
    res = _harness().run("kv-dsv4", 256, 16, "pull", 40, False, "device")
    assert res["ids"] == "device"
    assert res["rows"]["fresh"]["calls_per_post"] == {"copy_async": 2.0, "launch_graph": 1.0, "record_event": 1.0}


def test_post_harness_flushes_the_caches_between_calls():
    res = _harness().run("kv-dsv4", 256, 16, "pull", 10, False, "host", 1)
    assert res["flush_mb"] == 1
    assert res["rows"]["fresh"]["calls_per_post"] == {"copy_async": 1.0, "launch_graph": 1.0, "record_event": 1.0}


@pytest.mark.parametrize("ids", ["host", "device"])
def test_call_counts_of_prepare_post_and_post_many(ids):
    """--calls: the Python calls of gpuxfer's own code per row, the emulated driver's apart; a post_many's calls do
    not grow with its requests (one route's requests merged: nothing per request runs a call of its own)."""
    res = _harness().count_calls("kv-mla", 256, 16, "pull", ids, batch=8)
    calls = res["calls"]
    assert set(calls) == {"prepare", "post", "post_many8", "post_many4", "per_extra_request"}
    assert calls["per_extra_request"] == {"call": 0.0, "c_call": 0.0}
    assert all(calls[k]["call"] > 0 and calls[k]["drv_call"] > 0 for k in ("post", "post_many8", "post_many4"))
    assert calls["prepare"]["call"] > 0 and calls["prepare"]["drv_call"] == 0
