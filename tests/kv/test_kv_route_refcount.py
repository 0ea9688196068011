"""A route dropped from an agent's cache goes with its last reference, not at a cyclic collection: nothing it owns
(its slots, their graphs and launchers, a device-ID check's parts) refers back to it. An engine process that
freezes its startup heap out of the collector's scans (vLLM's ``freeze_gc_heap``) or collects rarely would
otherwise keep every dropped route's device buffers allocated."""
from __future__ import annotations

import gc

import pytest
import torch

from gpuxfer.kv import routes as kv_routes

from _agent_arena import same_bytes
from test_kv_route_cache import _gapped


@pytest.mark.parametrize("mode", ["blocks", "descriptors"])
@pytest.mark.parametrize("ids", ["host", "device"])
@pytest.mark.parametrize("many", [False, True])
def test_a_dropped_route_is_freed_without_the_cycle_collector(pair, monkeypatch, mode, ids, many):
    """At most one route per peer: posts over one layer range, then another (dropping the first's route), then
    the first again; each moves its bytes. With the cycle collector off, once the posts completed and their
    handles went, no dropped route is still allocated (``held_routes`` 0)."""
    monkeypatch.setenv("GPUXFER_KV_COPY", mode)
    monkeypatch.setattr(kv_routes, "ROUTES_PER_PEER", 1, raising=False)
    pre, dec, a0, a1 = pair
    dst, src, p = _gapped(pre, dec, a0, a1, range(2))

    def blocks(b):
        return [b] if ids == "host" else torch.tensor([b], dtype=torch.int64, device=dec._torch_device())
    gc.collect()
    gc.disable()
    try:
        for k, rng in enumerate(((0, 1), (1, 2), (0, 1), (1, 2))):
            d, s = k, 7 - k
            x = dec.prepare(p, "pull", local_blocks={"full": blocks(d)}, remote_blocks={"full": blocks(s)},
                            layers=rng)
            h = dec.post_many([x])[0] if many else x.post()
            h.wait(60)
            name = f"model.layers.{rng[0]}.self_attn"
            assert same_bytes(dst[name][:, d], src[name][:, s]), (rng, name)
            del x, h
        dec._poster.reap_locked()
        got = dec.device_bytes()
        assert got["routes"] == 1 and got["held_routes"] == 0, got
    finally:
        gc.enable()
